// Routed experts in BF16, grouped by expert on the device (no host synchronisation).
//
// A pass handles n_pairs = tokens * top_k (token, slot) pairs; pair p = token * top_k + slot.
//   1. moe_route (one block): count pairs per expert, exclusive offsets, tiles of MOE_TM pairs per
//      expert (tile_offsets), and `sorted`: the pair indices grouped by expert. Pairs whose id is
//      outside [0, n_experts) are left out (moe_combine turns their token's row into NaN).
//   2. moe_gate_up: one block per (tile, MOE_BN intermediate columns): act[p, i] =
//      silu(gate_e[i] . x[token(p)]) * (up_e[i] . x[token(p)]) for the tile's pairs; the weight
//      rows are read once per tile and shared by its pairs, on the tensor cores (moe_tile).
//   3. moe_down: the same with MOE_BN_DOWN hidden columns per block, ypair[p, h] = down_e[h] . act[p].
//   4. moe_combine: out[t, h] = sum_j w[t, j] * ypair[t*top_k + j, h], j ascending.
// Each output element is computed by one thread with one accumulator in a fixed order, whatever
// tile or slot its pair lands in, so the result is bitwise deterministic even though the order
// inside an expert's group (atomics in moe_route) is not.
//
// Decode path (few pairs, e.g. t * top_k <= 16): no grouping. Every pair reads its own expert's
// rows, GEMV style, so at t = 1 each weight byte is read once with full 16-byte coalesced loads:
//   moe_dec_gate_up: grid (pair, MOE_DEC_THREADS/32 * MOE_DEC_GU_COLS intermediate columns);
//      each warp owns MOE_DEC_GU_COLS columns, i.e. 2 * MOE_DEC_GU_COLS weight rows in flight.
//   moe_dec_down: grid (pair, MOE_DEC_THREADS/32 * MOE_DEC_DN_ROWS hidden rows), same scheme.
//   then moe_combine as above. A pair whose id is outside [0, n_experts) exits at once (never
//   indexes the weights); its ypair row stays unwritten and moe_combine discards it (NaN row).
// Each output element is one warp's sum: per lane, one accumulator over its k positions in
// ascending order, then a fixed butterfly over the lanes, so the result is deterministic.
//
// Weights are BF16 row-major with rows padded with zeros to a multiple of MOE_PAD elements
// (w13 [E, 2*inter, hidden_pad], gate rows then up rows; w2 [E, hidden, inter_pad]), so every
// chunk load is a full aligned 16-byte vector.
#include "krasis_common.cuh"

#define MOE_TM 64          // pairs per tile (must match moe.rs): one m16 slice per warp
#define MOE_BN 64          // output columns per gate/up block (must match moe.rs)
#define MOE_BN_DOWN 128    // output columns per down block (must match moe.rs)
#define MOE_PAD 64         // weight rows are zero padded to a multiple of this (must match moe.rs)
#define MOE_KC 64          // k elements per shared-memory chunk of the tiles (divides MOE_PAD): 64
                           // against 32 measured 596 against 801 us a Qwen3-like layer (t = 512)
static_assert(MOE_BN == MOE_PAD, "the gate/up step's last column block must end at the padded row length");
static_assert(MOE_PAD % MOE_KC == 0, "a k chunk must not cross the padded row end");
#define MOE_THREADS 128    // threads per GEMM block (must match moe.rs): 4 warps x 16 pairs
#define MOE_STAGES 2       // shared-memory buffers of the tiles' k loop (must match moe.rs): measured
                           // on an H100, 3 buffers were 1-7 % slower (fewer blocks per SM)
#define MOE_SK (MOE_KC + 8)  // BF16 row stride of the staged chunks: 36 words, so the fragment
                             // loads of a warp (8 rows x 16 bytes per ldmatrix matrix) hit 32
                             // different banks, and rows stay 16-byte aligned (cp.async, ldmatrix)
#define MOE_MAX_EXPERTS 4096  // moe_route's shared counters (must match moe.rs)
#define MOE_DEC_THREADS 128   // decode path block (must match moe.rs): 4 warps, many blocks per SM
#define MOE_DEC_GU_COLS 2     // intermediate columns per warp (gate+up: 4 rows of 16-byte loads in flight)
#define MOE_DEC_DN_ROWS 4     // hidden rows per warp in the down projection (4 loads in flight)
#define MOE_DEC_KCH 4096      // k elements of the activation row staged in shared memory at once (16 KiB)

extern "C" __global__ void moe_route(const int* __restrict__ ids, int n_pairs, int n_experts,
                                     int* __restrict__ offsets, int* __restrict__ tile_offsets,
                                     int* __restrict__ sorted) {
    __shared__ int cnt[MOE_MAX_EXPERTS];
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        const int e = ids[p];
        if (e >= 0 && e < n_experts) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int o = 0, tt = 0;
        for (int e = 0; e < n_experts; ++e) {
            const int c = cnt[e];
            offsets[e] = o;
            tile_offsets[e] = tt;
            cnt[e] = o;  // becomes the scatter cursor
            o += c;
            tt += (c + MOE_TM - 1) / MOE_TM;
        }
        offsets[n_experts] = o;
        tile_offsets[n_experts] = tt;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        const int e = ids[p];
        if (e >= 0 && e < n_experts) sorted[atomicAdd(&cnt[e], 1)] = p;
    }
}

// x [tokens, k] f32 -> its two BF16 halves hi, lo [tokens, ldo] (bf16_split), zero from k to ldo.
// Launch: grid (tokens, ceil(ldo / 256)), 256 threads.
extern "C" __global__ void moe_split_rows(const float* __restrict__ x, int k, bf16_t* __restrict__ hi,
                                          bf16_t* __restrict__ lo, int ldo) {
    const long long t = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= ldo) return;
    bf16_t h = 0, l = 0;
    if (c < k) bf16_split(x[t * k + c], h, l);
    hi[t * ldo + c] = h;
    lo[t * ldo + c] = l;
}

// One tile of one expert on the tensor cores: the tile's pairs p times BN output columns
// from n0. GATED: weight rows n0+i (gate) and up_row0+n0+i (up), act = silu(gate) * up, written
// as its two BF16 halves to out_hi/out_lo [p, ldo] for every column below the block's end (zero
// past n_out: the padding the down step reads); else ypair[p, n0 + i] f32 for i < n_out - n0.
// A's row for pair p is p / a_div (the token for gate/up, the pair itself for down), given as
// two BF16 halves a_hi, a_lo [rows, lda] (lda a multiple of 8, zero padded to the weights' ldw).
//
// The k loop runs over chunks of MOE_KC through MOE_STAGES shared-memory buffers: while the
// warps multiply one chunk, cp.async brings the next ones' weight rows and A rows in. Warp w
// multiplies its 16 pairs (tile rows 16w..) by every staged weight row with mma.sync m16n8k16
// (fragments by ldmatrix), once per half of A, into f32 accumulators kept over all of k; a warp
// whose 16 rows hold no pair skips the products. Each output is one thread's accumulator in a
// fixed order, so the result does not depend on timing.
template <bool GATED>
__device__ __forceinline__ void moe_tile(const bf16_t* __restrict__ w, long long expert_stride, int ldw, int n_out,
                                         int up_row0, int k, const bf16_t* __restrict__ a_hi,
                                         const bf16_t* __restrict__ a_lo, int lda, int a_div, float* __restrict__ ypair,
                                         bf16_t* __restrict__ out_hi, bf16_t* __restrict__ out_lo, int ldo,
                                         const int* __restrict__ sorted, const int* __restrict__ offsets,
                                         const int* __restrict__ tile_offsets, int n_experts) {
    constexpr int BN = GATED ? MOE_BN : MOE_BN_DOWN;  // output columns of the block
    constexpr int WR = GATED ? 2 * BN : BN;            // weight rows staged per chunk
    constexpr int NT = WR / 8;                        // n8 tiles of a warp's products
    constexpr int PARTS = MOE_KC / 8;                 // 16-byte pieces of a staged row
    constexpr int ROWS_PER_PASS = MOE_THREADS / PARTS;
    constexpr int W_SLOTS = WR / ROWS_PER_PASS, A_SLOTS = MOE_TM / ROWS_PER_PASS;  // copies per thread
    constexpr int ROW_BYTES = MOE_SK * 2;
    constexpr int STAGE_BYTES = (WR + 2 * MOE_TM) * ROW_BYTES;  // weight rows, then A hi, A lo
    static_assert(WR % ROWS_PER_PASS == 0 && MOE_TM % ROWS_PER_PASS == 0, "whole staging passes");
    __shared__ int s_pair[MOE_TM];
    extern __shared__ __align__(16) unsigned char moe_smem[];  // MOE_STAGES buffers (moe.rs: tile_smem)

    const int tile = blockIdx.x;
    if (tile >= tile_offsets[n_experts]) return;  // uniform over the block
    // The expert owning this tile: tile_offsets[e] <= tile < tile_offsets[e + 1].
    int lo = 0, hi = n_experts;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (tile_offsets[mid] <= tile) lo = mid;
        else hi = mid;
    }
    const int e = lo;
    const int start = offsets[e] + (tile - tile_offsets[e]) * MOE_TM;
    const int count = min(MOE_TM, offsets[e + 1] - start);
    const int tid = threadIdx.x;
    for (int i = tid; i < MOE_TM; i += MOE_THREADS) s_pair[i] = i < count ? sorted[start + i] : -1;
    __syncthreads();

    // This thread's copies of every chunk, worked out once: staged row (tid / PARTS) + i ·
    // ROWS_PER_PASS, piece tid % PARTS; the sources advance by MOE_KC per chunk. Rows past n_out
    // and empty pair slots are zero-filled (0 source bytes; the source pointer stays valid).
    const int n0 = blockIdx.y * BN;
    const bf16_t* we = w + (long long)e * expert_stride;
    const int part = tid % PARTS, row0 = tid / PARTS;
    const bf16_t* w_src[W_SLOTS];
    int w_bytes[W_SLOTS];
#pragma unroll
    for (int i = 0; i < W_SLOTS; ++i) {
        const int row = row0 + i * ROWS_PER_PASS;
        const int j = GATED && row >= BN ? row - BN : row;
        const int grow = GATED && row >= BN ? up_row0 + n0 + j : n0 + j;
        const bool ok = n0 + j < n_out;
        w_src[i] = ok ? we + (long long)grow * ldw + part * 8 : we;
        w_bytes[i] = ok ? 16 : 0;
    }
    long long a_off[A_SLOTS];
    int a_bytes[A_SLOTS];
#pragma unroll
    for (int i = 0; i < A_SLOTS; ++i) {
        const int p = s_pair[row0 + i * ROWS_PER_PASS];
        a_off[i] = p >= 0 ? (long long)(p / a_div) * lda + part * 8 : 0;
        a_bytes[i] = p >= 0 ? 16 : 0;
    }
    const u32 smem0 = smem_addr(moe_smem);
    const u32 copy_dst = (u32)(row0 * ROW_BYTES + part * 16);
    auto stage = [&](int c, int b) {
        const int k0 = c * MOE_KC;
        const u32 dst = smem0 + b * STAGE_BYTES + copy_dst;
#pragma unroll
        for (int i = 0; i < W_SLOTS; ++i)
            cp_async16_at(dst + i * ROWS_PER_PASS * ROW_BYTES, w_src[i] + (w_bytes[i] ? k0 : 0), w_bytes[i]);
#pragma unroll
        for (int i = 0; i < A_SLOTS; ++i) {
            const u32 d = dst + (WR + i * ROWS_PER_PASS) * ROW_BYTES;
            cp_async16_at(d, a_hi + a_off[i] + (a_bytes[i] ? k0 : 0), a_bytes[i]);
            cp_async16_at(d + MOE_TM * ROW_BYTES, a_lo + a_off[i] + (a_bytes[i] ? k0 : 0), a_bytes[i]);
        }
    };

    const int warp = tid >> 5, lane = tid & 31;
    const bool active = warp * 16 < count;  // pairs fill the tile's rows from the first
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    // ldmatrix row addresses of this lane (bytes into a buffer): A (matrix lane/8: rows +8 for
    // odd, k +8 for the upper two) and B (two n8 tiles per x4: k +8 for odd matrices, the next
    // tile for the upper two).
    const u32 a_at = (u32)((WR + warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * ROW_BYTES + 16 * (lane >> 4));
    const u32 b_at = (u32)(((lane & 7) + 8 * (lane >> 4)) * ROW_BYTES + 16 * ((lane >> 3) & 1));

    // MOE_STAGES - 1 chunks in flight ahead of the one being multiplied; one commit group per chunk
    // (empty past the end), so "all but the newest MOE_STAGES - 2 groups done" means the chunk about
    // to be multiplied has landed. One barrier per chunk: after it every warp is done with the
    // buffer the next copy refills.
    const int chunks = (k + MOE_KC - 1) / MOE_KC;
#pragma unroll
    for (int c = 0; c < MOE_STAGES - 1; ++c) {
        if (c < chunks) stage(c, c);
        cp_async_commit();
    }
    for (int c = 0; c < chunks; ++c) {
        cp_async_wait<MOE_STAGES - 2>();
        __syncthreads();
        const int nc = c + MOE_STAGES - 1;
        if (nc < chunks) stage(nc, nc % MOE_STAGES);
        cp_async_commit();
        if (active) {
            const u32 buf = smem0 + (c % MOE_STAGES) * STAGE_BYTES;
#pragma unroll
            for (int kk = 0; kk < MOE_KC; kk += 16) {
                // Every fragment of the k step first, then the products: the loads' latency is
                // paid once per step instead of before each pair of tiles.
                u32 fa[2][4], fb[NT / 2][4];  // fb[i]: b0, b1 of tile 2i, then of tile 2i + 1
                ldmatrix_x4(fa[0], buf + a_at + kk * 2);
                ldmatrix_x4(fa[1], buf + a_at + MOE_TM * ROW_BYTES + kk * 2);
#pragma unroll
                for (int i = 0; i < NT / 2; ++i) ldmatrix_x4(fb[i], buf + b_at + i * 16 * ROW_BYTES + kk * 2);
#pragma unroll
                for (int i = 0; i < NT / 2; ++i) {
                    mma_bf16(acc[2 * i], fa[0], fb[i][0], fb[i][1]);
                    mma_bf16(acc[2 * i + 1], fa[0], fb[i][2], fb[i][3]);
                }
#pragma unroll
                for (int i = 0; i < NT / 2; ++i) {
                    mma_bf16(acc[2 * i], fa[1], fb[i][0], fb[i][1]);
                    mma_bf16(acc[2 * i + 1], fa[1], fb[i][2], fb[i][3]);
                }
            }
        }
    }
    if (!active) return;
    const int g = lane >> 2, q = lane & 3;
    // acc[j][2r + c]: tile row warp*16 + g + 8r, column j*8 + 2q + c of the staged rows (GATED:
    // tile j < NT/2 the gate rows, tile j + NT/2 the matching up rows).
    constexpr int NO = GATED ? NT / 2 : NT;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int p = s_pair[warp * 16 + g + 8 * r];
        if (p < 0) continue;
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            const int o = n0 + j * 8 + 2 * q;  // this thread's columns o, o + 1
            if (GATED) {
                bf16_t h[2], l[2];
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float gv = acc[j][2 * r + c], uv = acc[j + NO][2 * r + c];
                    const float v = o + c < n_out ? gv / (1.0f + expf(-gv)) * uv : 0.0f;
                    bf16_split(v, h[c], l[c]);
                }
                *(u32*)(out_hi + (long long)p * ldo + o) = bf16x2_of(h[0], h[1]);
                *(u32*)(out_lo + (long long)p * ldo + o) = bf16x2_of(l[0], l[1]);
            } else {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    if (o + c < n_out) ypair[(long long)p * ldo + o + c] = acc[j][2 * r + c];
                }
            }
        }
    }
}

// act halves [n_pairs, inter_pad] from x halves [tokens, hidden_pad] and w13 [E, 2*inter, ldw]
// (ldw = hidden_pad).
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_gate_up(const bf16_t* w13, int ldw, int inter, int hidden, const bf16_t* x_hi, const bf16_t* x_lo, int top_k,
                bf16_t* act_hi, bf16_t* act_lo, int inter_pad, const int* sorted, const int* offsets,
                const int* tile_offsets, int n_experts) {
    moe_tile<true>(w13, (long long)2 * inter * ldw, ldw, inter, inter, hidden, x_hi, x_lo, ldw, top_k,
                               nullptr, act_hi, act_lo, inter_pad, sorted, offsets, tile_offsets, n_experts);
}

// ypair [n_pairs, hidden] from act halves [n_pairs, ldw] and w2 [E, hidden, ldw] (ldw = inter_pad).
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_down(const bf16_t* w2, int ldw, int inter, int hidden, const bf16_t* act_hi, const bf16_t* act_lo,
             float* ypair, const int* sorted, const int* offsets, const int* tile_offsets, int n_experts) {
    moe_tile<false>(w2, (long long)hidden * ldw, ldw, hidden, 0, inter, act_hi, act_lo, ldw, 1, ypair,
                                nullptr, nullptr, hidden, sorted, offsets, tile_offsets, n_experts);
}

// Decode-path body: for pair = blockIdx.x with expert e = ids[pair], the warp's NC outputs
// o = o0 + q: GATED: out[pair, o] = silu(w[o] . a) * (w[up_row0 + o] . a), else w[o] . a, where
// a = a_rows[pair / a_div] (length k, zero padded to ldw in shared memory).
template <bool GATED, int NC>
__device__ __forceinline__ void moe_dec_body(const bf16_t* __restrict__ w, long long expert_stride, int ldw,
                                             int n_out, int up_row0, int k, const float* __restrict__ a, int lda,
                                             int a_div, float* __restrict__ out, int ldo,
                                             const int* __restrict__ ids, int n_experts) {
    constexpr int R = GATED ? 2 * NC : NC;  // weight rows per warp
    __shared__ float4 xs4[MOE_DEC_KCH / 4];
    float* xs = (float*)xs4;

    const int pair = blockIdx.x;
    const int e = ids[pair];
    if (e < 0 || e >= n_experts) return;  // uniform over the block, before any barrier
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int o0 = (blockIdx.y * (MOE_DEC_THREADS / 32) + warp) * NC;
    const bf16_t* we = w + (long long)e * expert_stride;
    const bf16_t* rows[R];
    bool ok[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int q = GATED && r >= NC ? r - NC : r;
        const int grow = GATED && r >= NC ? up_row0 + o0 + q : o0 + q;
        ok[r] = o0 + q < n_out;
        rows[r] = we + (long long)(ok[r] ? grow : 0) * ldw;
    }
    const float* arow = a + (long long)(pair / a_div) * lda;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;

    for (int k0 = 0; k0 < ldw; k0 += MOE_DEC_KCH) {
        const int kn = min(MOE_DEC_KCH, ldw - k0);  // a multiple of 8: ldw is padded to MOE_PAD
        for (int j = threadIdx.x; j < kn; j += MOE_DEC_THREADS) xs[j] = k0 + j < k ? arow[k0 + j] : 0.0f;
        __syncthreads();
        // Two 256-element steps per iteration: 2R independent 16-byte loads per lane in flight.
        for (int c = lane * 8; c < kn; c += 2 * 32 * 8) {
            const bool second = c + 32 * 8 < kn;
            uint4 v[2][R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint4 z = make_uint4(0, 0, 0, 0);
                v[0][r] = ok[r] ? __ldg((const uint4*)(rows[r] + k0 + c)) : z;
                v[1][r] = ok[r] && second ? __ldg((const uint4*)(rows[r] + k0 + c + 32 * 8)) : z;
            }
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                if (s == 1 && !second) break;
                const float4 xa = xs4[(c + s * 32 * 8) / 4], xb = xs4[(c + s * 32 * 8) / 4 + 1];
                const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const u32 words[4] = {v[s][r].x, v[s][r].y, v[s][r].z, v[s][r].w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        acc[r] += bf16_to_f32((bf16_t)(words[j] & 0xffffu)) * xv[2 * j];
                        acc[r] += bf16_to_f32((bf16_t)(words[j] >> 16)) * xv[2 * j + 1];
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
    if (lane != 0) return;
#pragma unroll
    for (int q = 0; q < NC; ++q) {
        if (!ok[q]) continue;
        float v = acc[q];
        if (GATED) v = v / (1.0f + expf(-v)) * acc[NC + q];
        out[(long long)pair * ldo + o0 + q] = v;
    }
}

// Decode path, act [n_pairs, inter] from x [tokens, hidden], ids [n_pairs], w13 [E, 2*inter, ldw].
extern "C" __global__ void moe_dec_gate_up(const bf16_t* w13, int ldw, int inter, int hidden, const float* x,
                                           int top_k, float* act, const int* ids, int n_experts) {
    moe_dec_body<true, MOE_DEC_GU_COLS>(w13, (long long)2 * inter * ldw, ldw, inter, inter, hidden, x, hidden, top_k,
                                        act, inter, ids, n_experts);
}

// Decode path, ypair [n_pairs, hidden] from act [n_pairs, inter], ids [n_pairs], w2 [E, hidden, ldw].
extern "C" __global__ void moe_dec_down(const bf16_t* w2, int ldw, int inter, int hidden, const float* act,
                                        float* ypair, const int* ids, int n_experts) {
    moe_dec_body<false, MOE_DEC_DN_ROWS>(w2, (long long)hidden * ldw, ldw, hidden, 0, inter, act, inter, 1, ypair,
                                         hidden, ids, n_experts);
}

// out [tokens, hidden] = sum over j ascending of weights[t, j] * ypair[t*top_k + j]; a token with
// any id outside [0, n_experts) gets a NaN row. Launch: grid (tokens, ceil(hidden / blockDim.x)
// capped at 65535), 256 threads; block (t, y) covers columns y*256 + j, stepping by
// gridDim.y*256. Why: one block per token put decode (tokens = 1, hidden 2048) on one SM with
// each thread walking 8 columns serially; now 8 blocks of one column per thread. Each element is
// the same f32 sum (j ascending) whatever the grid.
extern "C" __global__ void moe_combine(const float* __restrict__ ypair, const int* __restrict__ ids,
                                       const float* __restrict__ weights, float* __restrict__ out, int tokens,
                                       int top_k, int hidden, int n_experts) {
    const int t = blockIdx.x;
    if (t >= tokens) return;
    bool valid = true;
    for (int j = 0; j < top_k; ++j) {
        const int e = ids[(long long)t * top_k + j];
        valid = valid && e >= 0 && e < n_experts;
    }
    for (int h = blockIdx.y * blockDim.x + threadIdx.x; h < hidden; h += gridDim.y * blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            const long long p = (long long)t * top_k + j;
            acc += weights[p] * ypair[p * hidden + h];
        }
        out[(long long)t * hidden + h] = valid ? acc : krasis_nan();
    }
}
