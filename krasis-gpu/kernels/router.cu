// MoE router on the GPU: gate logits, then scores and top-k as krasis-model's CPU `route` does.
//
// router_logits: logits[t, e] = dot(w[e, :], x[t, :]) in f32. Launch: grid (E, ceil(t /
//   ROUTER_TOK_TILE)), ROUTER_LOGITS_THREADS = 256 threads: one block per (expert, tile of up to
//   8 tokens), the hidden (K) dimension split over all 256 threads, so each weight element is read
//   once per tile. Why: at decode (t = 1) one warp per expert (E/4 blocks, each lane walking
//   hidden/32 elements serially) was latency-bound; now E blocks each issue their whole weight row
//   at once (hidden 2048: two float4 loads per thread). 16-byte loads when hidden % 4 == 0 and w,
//   x are 16-byte aligned, else scalar loads. Summation order (deterministic): thread j sums, in
//   one fmaf chain per token, float4 groups j, j + 256, ... (each group's x, y, z, w in order;
//   scalar path: elements j, j + 256, ...); the 32 lanes of a warp are combined by a butterfly
//   (warp_sum), then the 8 warp sums are added in warp order 0..7. This differs from the CPU's
//   sequential order in the last bits in general (the tests use data exact in any order).
// router_topk: one block per token over the E (<= ROUTER_MAX_E) logits of that token; the block
//   has E rounded up to a warp, 32..=256 threads (every loop strides by blockDim, so any such
//   size computes the same ids; only the f64 softmax sum's tree shape depends on it):
//   logits   x = logit, or (a router with a logit bias: any method but noaux_tc, bias given)
//            x = logit + bias[e] in f32 (gpt-oss's `mlp.router.bias`; with softmax, greedy and norm
//            this is its softmax over the top-k logits)
//   scores   softmax: m = max (f32), e = exp((double)(x - m)), z = sum e (f64), s = (float)(e / z)
//            sigmoid: s = 1 / (1 + expf(-x)) in f32, expf evaluated as (float)exp((double)-x),
//                     i.e. correctly rounded, as glibc's expf (the CPU's) is to within its 0.5 ulp
//   choice   = s (+ e_score_correction_bias for noaux_tc)
//   groups   group-limited: group score = max of the group's choice; noaux_tc: sum of its two
//            largest; the topk_group best groups are kept (value desc, index asc), the others'
//            choice is set to 0.0 (not -inf: the reference's masked_fill(…, 0.0))
//   top-k    the top_k largest choices (value desc, index asc), in that order
//   weights  w = s[id] (unbiased); if norm: w /= (sum w [+ 1e-20 for sigmoid]), summed in id
//            order in f32; then w *= routed_scaling_factor
// router_publish: both in one launch, with the routes and the activations written to mapped host
//   memory and a host flag set (the hybrid engine's hand-off; see the kernel).
// Ranking treats NaN as -inf (the CPU's order with NaN is unspecified), so ids are always a
// valid set of distinct experts. The softmax sum is a tree sum in f64 where the CPU sums in
// index order: the rounded f32 scores can differ only when the f64 quotient sits within a few
// f64 ulps of an f32 rounding boundary.
#include "krasis_common.cuh"

#define ROUTER_MAX_E 512
#define ROUTER_MAX_K 16
#define ROUTER_TOK_TILE 8
#define ROUTER_EXP_GROUP 8  // most experts a router_logits block computes (must match router.rs)
#define RT_RANK_UNROLL 32   // keys compared between two checks of a rank against top_k
#define RT_PRE 2            // weight float4s a router_publish thread loads before its wait (hidden 2048: all)

__device__ __forceinline__ float rt_neg_inf() { return __uint_as_float(0xff800000u); }

// NaN ranks as -inf.
__device__ __forceinline__ float rt_rank_val(float v) { return v != v ? rt_neg_inf() : v; }

// True when (a, ia) comes before (b, ib): larger value first, lower index on equal values.
__device__ __forceinline__ bool rt_before(float a, int ia, float b, int ib) {
    return a > b || (a == b && ia < ib);
}

// A key whose unsigned order is rt_before's (NaN ranked as -inf): the value's bits made
// order-preserving (-0 taken as +0, which compares equal to it), then the complemented index, so
// that of equal values the lower index has the larger key. Distinct indices give distinct keys.
__device__ __forceinline__ u64 rt_rank_key(float v, int i) {
    u32 u = __float_as_uint(rt_rank_val(v));
    if ((u << 1) == 0u) u = 0u;  // -0 -> +0
    const u32 ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((u64)ord << 32) | (u64)(~(u32)i);
}

__device__ __forceinline__ float rt_block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : rt_neg_inf();
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
    __syncthreads();
    return t;
}

__device__ __forceinline__ double rt_block_sum_d(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = lane < nwarps ? scratch[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    __syncthreads();
    return t;
}

#define ROUTER_LOGITS_THREADS 256
#define ROUTER_LOGITS_WARPS (ROUTER_LOGITS_THREADS / 32)

// a = fma chain of one float4 group: a + w.x·x.x + w.y·x.y + w.z·x.z + w.w·x.w, in that order.
__device__ __forceinline__ float rt_fma4(float a, float4 w, float4 x) {
    a = fmaf(w.x, x.x, a);
    a = fmaf(w.y, x.y, a);
    a = fmaf(w.z, x.z, a);
    return fmaf(w.w, x.w, a);
}

// Logits of experts e0 .. e0 + ne - 1 (1 <= ne <= EG) for the tile of tokens t0 .. t0 + nt
// (nt >= 1) of x; block = ROUTER_LOGITS_THREADS. Ends with a barrier; thread k·EG + j (k < nt,
// j < ne) writes logits[(t0 + k) * E + e0 + j]. Every (token, expert) sum has the order the file
// header gives, whatever EG: so the logits depend on neither EG, the tile nor the batch. EG = 1
// (decode, router_publish) loads x per weight group, two groups in flight; EG > 1 (prefill) holds
// the tile's x groups in registers across its EG experts, so x crosses from L2 once per EG
// experts (at EG = 1, once per expert: 4.3 GB at t = 8192, hidden 2048, E = 64).
// DEP (EG = 1 only): the kernel is a dependent launch that has not yet waited for its
// predecessor: the first RT_PRE weight groups of a thread are loaded (the weights are static),
// then the wait, then everything else.
template <int EG, bool DEP = false>
__device__ __forceinline__ void rt_logits_tile(const float* __restrict__ w, const float* __restrict__ x,
                                               float* __restrict__ logits, int n_experts, int hidden, int e0, int ne,
                                               int t0, int nt) {
    static_assert(!DEP || EG == 1, "the early weight loads serve the one-expert tile");
    __shared__ float red[ROUTER_TOK_TILE][EG][ROUTER_LOGITS_WARPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* wr = w + (long long)e0 * hidden;
    const float* xt = x + (long long)t0 * hidden;
    float acc[ROUTER_TOK_TILE][EG];
#pragma unroll
    for (int k = 0; k < ROUTER_TOK_TILE; k++)
#pragma unroll
        for (int j = 0; j < EG; j++) acc[k][j] = 0.0f;
    const bool vec = (hidden & 3) == 0 && (((unsigned long long)w | (unsigned long long)x) & 15ull) == 0;
    float4 pre[RT_PRE];
    if constexpr (DEP) {
        const float4* w4 = reinterpret_cast<const float4*>(wr);
#pragma unroll
        for (int q = 0; q < RT_PRE; q++) {
            const int i = threadIdx.x + q * ROUTER_LOGITS_THREADS;
            pre[q] = vec && i < (hidden >> 2) ? w4[i] : make_float4(0, 0, 0, 0);
        }
        KRASIS_GRID_WAIT();
        KRASIS_GRID_LAUNCH_DEPENDENTS();
    }
    if (vec) {
        const int h4 = hidden >> 2;
        const float4* w4 = reinterpret_cast<const float4*>(wr);
        const float4* x4 = reinterpret_cast<const float4*>(xt);
        int i0 = threadIdx.x;  // the first group the loop below loads itself
        if constexpr (DEP) {
#pragma unroll
            for (int q = 0; q < RT_PRE; q++, i0 += ROUTER_LOGITS_THREADS) {
                if (i0 >= h4) break;
#pragma unroll
                for (int k = 0; k < ROUTER_TOK_TILE; k++)
                    if (k < nt) acc[k][0] = rt_fma4(acc[k][0], pre[q], x4[(long long)k * h4 + i0]);
            }
        }
#pragma unroll(EG == 1 ? 2 : 1)  // EG = 1, hidden 2048: both of a thread's groups loaded together
        for (int i = i0; i < h4; i += ROUTER_LOGITS_THREADS) {
            if constexpr (EG == 1) {
                const float4 wv = w4[i];
#pragma unroll
                for (int k = 0; k < ROUTER_TOK_TILE; k++)
                    if (k < nt) acc[k][0] = rt_fma4(acc[k][0], wv, x4[(long long)k * h4 + i]);
            } else {
                float4 xv[ROUTER_TOK_TILE];
#pragma unroll
                for (int k = 0; k < ROUTER_TOK_TILE; k++)
                    xv[k] = k < nt ? x4[(long long)k * h4 + i] : make_float4(0, 0, 0, 0);
#pragma unroll
                for (int j = 0; j < EG; j++) {
                    if (j >= ne) break;
                    const float4 wv = w4[(long long)j * h4 + i];
#pragma unroll
                    for (int k = 0; k < ROUTER_TOK_TILE; k++) acc[k][j] = rt_fma4(acc[k][j], wv, xv[k]);
                }
            }
        }
    } else {
        for (int i = threadIdx.x; i < hidden; i += ROUTER_LOGITS_THREADS) {
#pragma unroll
            for (int j = 0; j < EG; j++) {
                if (j >= ne) break;
                const float wv = wr[(long long)j * hidden + i];
#pragma unroll
                for (int k = 0; k < ROUTER_TOK_TILE; k++)
                    if (k < nt) acc[k][j] = fmaf(wv, xt[(long long)k * hidden + i], acc[k][j]);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < ROUTER_TOK_TILE; k++)
#pragma unroll
        for (int j = 0; j < EG; j++) {
            const float v = warp_sum(acc[k][j]);
            if (lane == 0) red[k][j][warp] = v;
        }
    __syncthreads();
    if (threadIdx.x < ROUTER_TOK_TILE * EG) {
        const int k = threadIdx.x / EG, j = threadIdx.x % EG;
        if (k < nt && j < ne) {
            float s = red[k][j][0];
#pragma unroll
            for (int v = 1; v < ROUTER_LOGITS_WARPS; v++) s += red[k][j][v];
            logits[(long long)(t0 + k) * n_experts + e0 + j] = s;
        }
    }
    __syncthreads();
}

// grid (ceil(E / eg), ceil(t / ROUTER_TOK_TILE)); block = ROUTER_LOGITS_THREADS. Block (g, y)
// computes experts g·eg .. g·eg + eg - 1 (eg <= ROUTER_EXP_GROUP) for token tile y (see
// rt_logits_tile; eg = 1 and unaligned rows take the one-expert loop).
extern "C" __global__ void __launch_bounds__(ROUTER_LOGITS_THREADS)
    router_logits(const float* __restrict__ w, const float* __restrict__ x, float* __restrict__ logits,
                  int n_experts, int hidden, int t, int eg) {
    const int t0 = blockIdx.y * ROUTER_TOK_TILE, e0 = blockIdx.x * eg;
    // nt >= 1, ne >= 1: the grid has exactly ceil(t / tile) rows and ceil(E / eg) columns.
    const int nt = min(ROUTER_TOK_TILE, t - t0), ne = min(eg, n_experts - e0);
    const bool vec = (hidden & 3) == 0 && (((unsigned long long)w | (unsigned long long)x) & 15ull) == 0;
    if (!vec || ne == 1) {
        for (int j = 0; j < ne; ++j) rt_logits_tile<1>(w, x, logits, n_experts, hidden, e0 + j, 1, t0, nt);
    } else {
        rt_logits_tile<ROUTER_EXP_GROUP>(w, x, logits, n_experts, hidden, e0, ne, t0, nt);
    }
}

// The routing rule for one token's logits `row` (any address space; E = n_experts values):
// writes its top_k ids and weights to ids_out[0..top_k], w_out[0..top_k] (thread 0).
// scoring: 0 softmax, 1 sigmoid. method: 0 greedy, 1 group-limited, 2 noaux_tc.
// bias may be 0; noaux_tc: the score-correction bias (it only chooses); the other methods: a logit
// bias, added to every logit before the scores.
// Every thread of the block calls it; blockDim a multiple of 32, at most 1024.
__device__ void rt_topk_row(const float* row, const float* __restrict__ bias, int* ids_out, float* w_out,
                            int n_experts, int scoring, int method, int n_group, int topk_group, int top_k,
                            int norm_topk_prob, float routed_scaling_factor) {
    __shared__ float score[ROUTER_MAX_E];
    __shared__ float choice[ROUTER_MAX_E];
    __shared__ float gscore[ROUTER_MAX_E];
    __shared__ int gkeep[ROUTER_MAX_E];
    __shared__ u64 keys[ROUTER_MAX_E];
    __shared__ double ex_d[ROUTER_MAX_E];
    __shared__ int sel[ROUTER_MAX_K];
    __shared__ double scratch_d[32];
    __shared__ float scratch_f[32];
    const int E = n_experts;
    const float* lbias = method != 2 ? bias : nullptr;  // a logit bias
    auto logit = [&](int i) { return lbias ? row[i] + lbias[i] : row[i]; };

    if (scoring == 0) {
        float m = rt_neg_inf();
        for (int i = threadIdx.x; i < E; i += blockDim.x) m = fmaxf(m, logit(i));
        m = rt_block_max(m, scratch_f);
        // Each thread keeps its own e^(x - m) for the quotient (one f64 exp per logit).
        double part = 0.0;
        for (int i = threadIdx.x; i < E; i += blockDim.x) {
            const double ex = exp((double)(logit(i) - m));
            ex_d[i] = ex;
            part += ex;
        }
        const double z = rt_block_sum_d(part, scratch_d);
        for (int i = threadIdx.x; i < E; i += blockDim.x) score[i] = (float)(ex_d[i] / z);
    } else {
        for (int i = threadIdx.x; i < E; i += blockDim.x) {
            const float ex = (float)exp(-(double)logit(i));
            score[i] = 1.0f / (1.0f + ex);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        float c = score[i];
        if (method == 2 && bias) c = c + bias[i];
        choice[i] = c;
    }
    __syncthreads();

    if (method != 0) {
        const int per = E / n_group;
        for (int g = threadIdx.x; g < n_group; g += blockDim.x) {
            const float* c = choice + g * per;
            float gs;
            if (method == 1) {
                gs = rt_neg_inf();
                for (int j = 0; j < per; j++) gs = fmaxf(gs, c[j]);
            } else {
                // The two largest (as values: the pair's sum does not depend on which ties win).
                float a = rt_neg_inf(), b = rt_neg_inf();
                for (int j = 0; j < per; j++) {
                    const float v = rt_rank_val(c[j]);
                    if (j == 0 || v > a) {
                        if (j > 0) b = a;
                        a = v;
                    } else if (j == 1 || v > b) {
                        b = v;
                    }
                }
                gs = per >= 2 ? a + b : a;
            }
            gscore[g] = gs;
        }
        __syncthreads();
        for (int g = threadIdx.x; g < n_group; g += blockDim.x) {
            const float v = rt_rank_val(gscore[g]);
            int rank = 0;
            for (int h = 0; h < n_group; h++) rank += rt_before(rt_rank_val(gscore[h]), h, v, g) ? 1 : 0;
            gkeep[g] = rank < topk_group;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < E; i += blockDim.x)
            if (!gkeep[i / per]) choice[i] = 0.0f;
        __syncthreads();
    }

    // Rank of every expert in (choice desc, index asc); those ranked below top_k are the ids. The
    // order is that of one 64-bit key per expert (see rt_rank_key), so a rank is a count of larger
    // keys: every thread reads the same key at a time (a shared-memory broadcast), with no
    // data-dependent branch inside a run of RT_RANK_UNROLL keys.
    for (int i = threadIdx.x; i < E; i += blockDim.x) keys[i] = rt_rank_key(choice[i], i);
    __syncthreads();
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        const u64 ki = keys[i];
        int rank = 0;
        int j = 0;
        for (; j + RT_RANK_UNROLL <= E && rank < top_k; j += RT_RANK_UNROLL) {
#pragma unroll
            for (int u = 0; u < RT_RANK_UNROLL; u++) rank += keys[j + u] > ki ? 1 : 0;
        }
        for (; j < E && rank < top_k; j++) rank += keys[j] > ki ? 1 : 0;
        if (rank < top_k) sel[rank] = i;
    }
    __syncthreads();

    // Warp 0: lane r holds route r; the normalising sum is taken in route order (as the CPU does),
    // every lane adding the same broadcast values, so all hold the same bits.
    if (threadIdx.x < 32) {
        const int r = threadIdx.x;
        const int id = r < top_k ? sel[r] : 0;
        float w = r < top_k ? score[id] : 0.0f;
        if (norm_topk_prob) {
            float s = 0.0f;
#pragma unroll
            for (int q = 0; q < ROUTER_MAX_K; q++) {
                const float v = __shfl_sync(0xffffffffu, w, q);
                if (q < top_k) s = s + v;
            }
            const float denom = scoring == 1 ? s + 1e-20f : s;
            w = w / denom;
        }
        if (r < top_k) {
            ids_out[r] = id;
            w_out[r] = w * routed_scaling_factor;
        }
    }
    __syncthreads();  // the block's shared arrays may be reused by a following call
}

// grid = t blocks, one per token; blockDim a multiple of 32, at most 1024.
extern "C" __global__ void router_topk(const float* __restrict__ logits, const float* __restrict__ bias,
                                       int* __restrict__ ids_out, float* __restrict__ w_out, int t, int n_experts,
                                       int scoring, int method, int n_group, int topk_group, int top_k,
                                       int norm_topk_prob, float routed_scaling_factor) {
    const int tok = blockIdx.x;
    if (tok >= t) return;
    rt_topk_row(logits + (long long)tok * n_experts, bias, ids_out + (long long)tok * top_k,
                w_out + (long long)tok * top_k, n_experts, scoring, method, n_group, topk_group, top_k,
                norm_topk_prob, routed_scaling_factor);
}

// Routing in one launch: router_logits, then router_topk, then (the hybrid engine's hand-off)
// publication to page-locked host memory the GPU maps (the CPU expert thread reads it):
//   block (e, y) computes expert e's logits of token tile y as router_logits does, then counts
//   itself done on tile_done[y]; the tile's last block (it sees E - 1) routes the tile's tokens
//   with rt_topk_row (ids and weights straight into host_ids / host_w) and copies their x rows to
//   host_x. It then counts the tile on all_done; the grid's last tile stores `seq` to the host
//   flag, after a system-wide fence, so a host that sees the flag sees every published byte.
//   With host_x and flag null, host_ids / host_w may be device memory: routing alone (a decode
//   step's router, one launch instead of two).
// Counters are device memory, zero before the launch; the last blocks reset them to zero, so the
// next launch finds them so. Logits of other blocks are read with ld.cg (L2): a block's L1 may
// not hold lines it never loaded, but ld.cg states the intent.
// grid (E, ceil(t / ROUTER_TOK_TILE)); block = ROUTER_LOGITS_THREADS.
extern "C" __global__ void __launch_bounds__(ROUTER_LOGITS_THREADS)
    router_publish(const float* __restrict__ w, const float* __restrict__ x, float* __restrict__ logits,
                   int n_experts, int hidden, int t, const float* __restrict__ bias, int scoring, int method,
                   int n_group, int topk_group, int top_k, int norm_topk_prob, float routed_scaling_factor,
                   float* host_x, int* host_ids, float* host_w, u32* tile_done, u32* all_done,
                   volatile u64* flag, u64 seq) {
    __shared__ float row[ROUTER_MAX_E];
    __shared__ int last;
    const int e = blockIdx.x, y = blockIdx.y;
    const int t0 = y * ROUTER_TOK_TILE;
    const int nt = min(ROUTER_TOK_TILE, t - t0);
    rt_logits_tile<1, true>(w, x, logits, n_experts, hidden, e, 1, t0, nt);  // waits inside
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(&tile_done[y], 1u) == (u32)(n_experts - 1);
    }
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) tile_done[y] = 0;
    __threadfence();
    // The activations first: their writes cross to the host while the tile is routed.
    if (host_x) {
        const long long n = (long long)nt * hidden;
        const float* src = x + (long long)t0 * hidden;
        float* dst = host_x + (long long)t0 * hidden;
        if ((hidden & 3) == 0 && (((unsigned long long)src | (unsigned long long)dst) & 15ull) == 0) {
            for (long long i = threadIdx.x; i < n / 4; i += blockDim.x)
                reinterpret_cast<float4*>(dst)[i] = reinterpret_cast<const float4*>(src)[i];
        } else {
            for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
        }
    }
    for (int k = 0; k < nt; k++) {
        const int tok = t0 + k;
        for (int i = threadIdx.x; i < n_experts; i += blockDim.x) row[i] = __ldcg(logits + (long long)tok * n_experts + i);
        __syncthreads();
        rt_topk_row(row, bias, host_ids + (long long)tok * top_k, host_w + (long long)tok * top_k, n_experts, scoring,
                    method, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor);
    }
    if (!flag) return;  // routing alone: the stream orders the readers
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 tiles = gridDim.y;
        if (atomicAdd(all_done, 1u) == tiles - 1) {
            *all_done = 0;
            __threadfence_system();
            *flag = seq;
        }
    }
}

// Heatmap counts: counts[ids[i]] += 1 for each of the n ids in [0, n_experts) (one MoE layer's
// row of the [layers, experts] counts; other ids are skipped). Launch: ceil(n / 256) blocks
// (at most 1024, the loop strides), 256 threads; a dependent launch.
extern "C" __global__ void router_count(const int* __restrict__ ids, int n, unsigned long long* __restrict__ counts,
                                        int n_experts) {
    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int e = ids[i];
        if (e >= 0 && e < n_experts) atomicAdd(&counts[e], 1ull);
    }
}
