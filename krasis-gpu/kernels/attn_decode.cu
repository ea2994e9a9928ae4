// Decode attention straight from the KV cache (BF16, or FP8 E4M3 with per-group f32 scales), split
// over the KV rows (flash-decoding), plus the two MLA weight-absorption kernels.
//
// One formulation serves MLA (absorbed) and GQA. A "kv group" g owns the query heads
// h = g*group .. (g+1)*group (group = heads / kv_heads); its keys are elements
// [g*k_dim, (g+1)*k_dim) of each row of the K plane, its values elements [g*v_dim, (g+1)*v_dim) of
// each row of the V plane. MLA: kv_heads = 1, K = V = the same plane, k_dim = latent + rope,
// v_dim = latent (values are the first `latent` elements of the key row). GQA: K = plane 0,
// V = plane 1, k_dim = v_dim = head_dim.
//
// The queries of a block are (token i, head h) pairs of one kv group, at most QT of them, so every
// K/V row is staged into shared memory once per block and used by all QT queries (all 16 heads of
// V2-Lite's MLA share each latent row). Query i (absolute position q_start + i) sees rows
// 0 ..= q_start + i.
//
// attn_decode_partial: grid (n_splits, kv_heads, query tiles), ATT_THREADS threads. Split s covers
// rows [s*split_rows, min((s+1)*split_rows, q_start + t)). Rows are processed in tiles of
// ATT_ROWS (= 32, one warp lane per row in the softmax step) rows:
//   1. stage the tile's K (and GQA's V) rows into shared memory as f32 (FP8 decoded and scaled);
//   2. scores: thread (row r = tid/8, part p = tid%8) dots row r with every query over the
//      4-element chunks p, p+8, ... of the key, then the 8 parts are summed with shuffles;
//   3. online softmax: one warp per query updates the running max m and sum l;
//   4. output: thread owns columns tid, tid+256, ... (CPT of them) for every query and adds
//      p * V over the tile's rows.
// With one split the block writes the normalised output; otherwise (m, l, unnormalised O) go to the
// workspace and attn_decode_combine merges the splits.
#include "krasis_common.cuh"

#define ATT_THREADS 256
#define ATT_ROWS 32
#define ATT_PARTS 8  // ATT_THREADS / ATT_ROWS threads share one row in the score step

// E4M3 code -> f32, exact; 0x7f / 0xff are NaN (see kv_cache.cu, which holds the same function).
__device__ __forceinline__ float att_e4m3_to_f32(u32 c) {
    const u32 mag = c & 0x7fu;
    float v = __uint_as_float(mag << 20) * __uint_as_float(0x7b800000u);  // * 2^120
    if (mag == 0x7fu) v = krasis_nan();
    return (c & 0x80u) ? -v : v;
}

__device__ __forceinline__ float att_neg_inf() { return __uint_as_float(0xff800000u); }

// Loads NB bytes (4, 8 or 16; aligned) as 32-bit words.
template <int NB>
__device__ __forceinline__ void load_words(const unsigned char* p, u32* w) {
    if constexpr (NB == 16) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if constexpr (NB == 8) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    } else {
        w[0] = *reinterpret_cast<const u32*>(p);
    }
}

// Stages `n_r` rows (plane rows row0..row0+n_r) of `len` elements starting at element `off` of each
// row into dst[r*ld + e] as f32. VEC elements per load (the host checks that VEC divides row, off,
// len and, for FP8, the scale group, so a chunk never straddles two groups). VEC = 1 is the
// unaligned fallback.
template <bool FP8, int VEC>
__device__ __forceinline__ void stage_rows(float* __restrict__ dst, int ld, const unsigned char* __restrict__ base,
                                           const float* __restrict__ scales, long long row0, int n_r, int row,
                                           int off, int len, int group) {
    constexpr int ES = FP8 ? 1 : 2;
    const int per_row = len / VEC;
    const int groups = FP8 ? row / group : 0;
    for (int idx = threadIdx.x; idx < n_r * per_row; idx += blockDim.x) {
        const int r = idx / per_row;
        const int c = (idx - r * per_row) * VEC;
        const long long e = (row0 + r) * (long long)row + off + c;
        const unsigned char* p = base + e * ES;
        float v[VEC];
        if constexpr (VEC == 1) {
            v[0] = FP8 ? att_e4m3_to_f32(*p) : bf16_to_f32(*reinterpret_cast<const bf16_t*>(p));
        } else {
            constexpr int NB = VEC * ES;
            u32 w[NB / 4];
            load_words<NB>(p, w);
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                if constexpr (FP8) {
                    v[k] = att_e4m3_to_f32((w[k >> 2] >> (8 * (k & 3))) & 0xffu);
                } else {
                    v[k] = bf16_to_f32((bf16_t)((w[k >> 1] >> (16 * (k & 1))) & 0xffffu));
                }
            }
        }
        if constexpr (FP8) {
            const float s = scales[(row0 + r) * (long long)groups + (off + c) / group];
#pragma unroll
            for (int k = 0; k < VEC; k++) v[k] *= s;
        }
        float* d = dst + (long long)r * ld + c;
#pragma unroll
        for (int k = 0; k < VEC; k++) d[k] = v[k];
    }
}

template <bool FP8>
__device__ __forceinline__ void stage_any(int vec, float* dst, int ld, const unsigned char* base, const float* scales,
                                          long long row0, int n_r, int row, int off, int len, int group) {
    switch (vec) {
        case 16: if constexpr (FP8) stage_rows<FP8, 16>(dst, ld, base, scales, row0, n_r, row, off, len, group); break;
        case 8: stage_rows<FP8, 8>(dst, ld, base, scales, row0, n_r, row, off, len, group); break;
        case 4: stage_rows<FP8, 4>(dst, ld, base, scales, row0, n_r, row, off, len, group); break;
        case 2: if constexpr (!FP8) stage_rows<FP8, 2>(dst, ld, base, scales, row0, n_r, row, off, len, group); break;
        default: stage_rows<FP8, 1>(dst, ld, base, scales, row0, n_r, row, off, len, group); break;
    }
}

struct AttnArgs {
    const unsigned char* k;  // K plane of the layer (element 0 of row 0)
    const unsigned char* v;  // V plane (MLA: same as k)
    const float* k_scales;   // FP8: [cap, row / group] per plane; else unused
    const float* v_scales;
    const float* q;          // [t, heads, k_dim]
    float* ws_o;             // [n_splits, t*heads, v_dim]
    float* ws_ml;            // [n_splits, t*heads, 2]: (m, l)
    float* out;              // [t, heads, v_dim], written directly when n_splits == 1
    int t, heads, kv_heads, k_dim, v_dim;
    int k_row, v_row;        // elements per row of the K / V plane
    int shared_kv;           // MLA: values are the first v_dim elements of the staged key row
    int group;               // FP8 scale group (elements)
    int q_start, n_splits, split_rows;
    int qt;                  // queries per block (<= QT)
    int ldq, ldk, ldv;       // shared-memory row strides (floats)
    int vec_k, vec_v;        // staging vector widths (elements)
    float scale;
};

template <bool FP8, int CPT, int QT>
__device__ __forceinline__ void attn_decode_body(const AttnArgs& a) {
    extern __shared__ __align__(16) float smem[];
    float* sQ = smem;                                            // [QT][ldq]
    float* sK = sQ + QT * a.ldq;                                 // [ATT_ROWS][ldk]
    float* sV = a.shared_kv ? sK : sK + ATT_ROWS * a.ldk;        // [ATT_ROWS][ldv]
    float* sP = (a.shared_kv ? sK + ATT_ROWS * a.ldk : sV + ATT_ROWS * a.ldv);  // [ATT_ROWS][QT]
    float* sM = sP + ATT_ROWS * QT;                              // [QT] running max
    float* sL = sM + QT;                                         // [QT] running sum
    float* sA = sL + QT;                                         // [QT] rescale of this tile

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int split = blockIdx.x, g = blockIdx.y, qtile = blockIdx.z;
    const int group_heads = a.heads / a.kv_heads;
    const int nq = a.t * group_heads;  // queries of this kv group
    const int q0 = qtile * a.qt;

    // Stage the queries (zero-padded to ldq and to QT) and reset the running softmax state.
    int last_i = 0;
    for (int idx = tid; idx < QT * a.ldq; idx += blockDim.x) {
        const int qq = idx / a.ldq, d = idx - qq * a.ldq;
        const int j = q0 + qq;
        float v = 0.0f;
        if (qq < a.qt && j < nq && d < a.k_dim) {
            const int i = j / group_heads, h = g * group_heads + (j - i * group_heads);
            v = a.q[((long long)i * a.heads + h) * a.k_dim + d];
        }
        sQ[idx] = v;
    }
    if (tid < QT) {
        sM[tid] = att_neg_inf();
        sL[tid] = 0.0f;
    }
    {
        const int jl = min(q0 + a.qt, nq) - 1;  // the block's last query sees the most rows
        last_i = jl / group_heads;
    }
    const long long visible = (long long)a.q_start + a.t;
    const long long s_begin = (long long)split * a.split_rows;
    long long s_end = s_begin + a.split_rows;
    if (s_end > visible) s_end = visible;
    const long long block_end = min(s_end, (long long)a.q_start + last_i + 1);

    float acc[CPT][QT];
#pragma unroll
    for (int c = 0; c < CPT; c++)
#pragma unroll
        for (int q = 0; q < QT; q++) acc[c][q] = 0.0f;

    const int r_mine = tid / ATT_PARTS, part = tid % ATT_PARTS;
    const int chunks = a.ldq >> 2;  // 4-float chunks of a key (ldq == ldk, both padded with zeros)

    for (long long row0 = s_begin; row0 < block_end; row0 += ATT_ROWS) {
        const int n_r = (int)min((long long)ATT_ROWS, block_end - row0);
        __syncthreads();  // the previous tile's sK/sV/sP are no longer read
        stage_any<FP8>(a.vec_k, sK, a.ldk, a.k, a.k_scales, row0, n_r, a.k_row, g * a.k_dim, a.k_dim, a.group);
        for (int idx = tid; idx < n_r * (a.ldk - a.k_dim); idx += blockDim.x) {  // zero key padding
            const int w = a.ldk - a.k_dim, r = idx / w;
            sK[r * a.ldk + a.k_dim + (idx - r * w)] = 0.0f;
        }
        if (!a.shared_kv)
            stage_any<FP8>(a.vec_v, sV, a.ldv, a.v, a.v_scales, row0, n_r, a.v_row, g * a.v_dim, a.v_dim, a.group);
        __syncthreads();

        // 2. Scores of row r_mine against every query.
        {
            float s[QT];
#pragma unroll
            for (int q = 0; q < QT; q++) s[q] = 0.0f;
            if (r_mine < n_r) {
                const float* kr = sK + r_mine * a.ldk;
                for (int ch = part; ch < chunks; ch += ATT_PARTS) {
                    const float4 kv = *reinterpret_cast<const float4*>(kr + 4 * ch);
#pragma unroll
                    for (int q = 0; q < QT; q++) {
                        const float4 qv = *reinterpret_cast<const float4*>(sQ + q * a.ldq + 4 * ch);
                        s[q] = fmaf(qv.x, kv.x, s[q]);
                        s[q] = fmaf(qv.y, kv.y, s[q]);
                        s[q] = fmaf(qv.z, kv.z, s[q]);
                        s[q] = fmaf(qv.w, kv.w, s[q]);
                    }
                }
            }
#pragma unroll
            for (int q = 0; q < QT; q++) {
#pragma unroll
                for (int o = ATT_PARTS / 2; o > 0; o >>= 1) s[q] += __shfl_xor_sync(0xffffffffu, s[q], o);
            }
            const long long abs_row = row0 + r_mine;
#pragma unroll
            for (int q = 0; q < QT; q++) {
                if (q % ATT_PARTS != part) continue;
                const int j = q0 + q;
                const bool ok = r_mine < n_r && q < a.qt && j < nq && abs_row <= (long long)a.q_start + j / group_heads;
                sP[r_mine * QT + q] = ok ? s[q] * a.scale : att_neg_inf();
            }
        }
        __syncthreads();

        // 3. Online softmax, one warp per query; lane = row.
        for (int q = warp; q < QT; q += ATT_THREADS / 32) {
            const float sc = lane < n_r ? sP[lane * QT + q] : att_neg_inf();
            float mx = sc;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_old = sM[q];
            const float m_new = fmaxf(m_old, mx);
            float p = 0.0f, alpha = 1.0f;
            if (m_new != att_neg_inf()) {
                p = sc == att_neg_inf() ? 0.0f : expf(sc - m_new);
                alpha = m_old == att_neg_inf() ? 0.0f : expf(m_old - m_new);
            }
            float sum = p;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            sP[lane * QT + q] = p;
            __syncwarp();
            if (lane == 0) {
                sM[q] = m_new;
                sL[q] = sL[q] * alpha + sum;
                sA[q] = alpha;
            }
        }
        __syncthreads();

        // 4. acc = acc * alpha + P · V over the tile's rows.
        float al[QT];
#pragma unroll
        for (int q = 0; q < QT; q++) al[q] = sA[q];
#pragma unroll
        for (int c = 0; c < CPT; c++)
#pragma unroll
            for (int q = 0; q < QT; q++) acc[c][q] *= al[q];
        for (int r = 0; r < n_r; r++) {
            float pr[QT];
#pragma unroll
            for (int q = 0; q < QT; q += 4) {
                const float4 v4 = *reinterpret_cast<const float4*>(sP + r * QT + q);
                pr[q] = v4.x; pr[q + 1] = v4.y; pr[q + 2] = v4.z; pr[q + 3] = v4.w;
            }
            const float* vr = sV + r * (a.shared_kv ? a.ldk : a.ldv);
#pragma unroll
            for (int c = 0; c < CPT; c++) {
                const int col = tid + c * ATT_THREADS;
                const float vv = col < a.v_dim ? vr[col] : 0.0f;
#pragma unroll
                for (int q = 0; q < QT; q++) acc[c][q] = fmaf(pr[q], vv, acc[c][q]);
            }
        }
    }
    __syncthreads();

    // Results: per query (token i, head h) -> global index i*heads + h.
    const int nq_total = a.t * a.heads;
#pragma unroll
    for (int q = 0; q < QT; q++) {
        const int j = q0 + q;
        if (q >= a.qt || j >= nq) continue;
        const int i = j / group_heads, h = g * group_heads + (j - i * group_heads);
        const long long gq = (long long)i * a.heads + h;
        const float m = sM[q], l = sL[q];
        if (a.n_splits == 1) {
            const float inv = 1.0f / l;
#pragma unroll
            for (int c = 0; c < CPT; c++) {
                const int col = tid + c * ATT_THREADS;
                if (col < a.v_dim) a.out[gq * a.v_dim + col] = acc[c][q] * inv;
            }
        } else {
            const long long base = (long long)split * nq_total + gq;
#pragma unroll
            for (int c = 0; c < CPT; c++) {
                const int col = tid + c * ATT_THREADS;
                if (col < a.v_dim) a.ws_o[base * a.v_dim + col] = acc[c][q];
            }
            if (tid == 0) {
                a.ws_ml[base * 2] = m;
                a.ws_ml[base * 2 + 1] = l;
            }
        }
    }
}

// One entry point per (dtype, columns per thread, queries per block).
#define ATT_KERNEL(NAME, FP8, CPT, QT) \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) NAME(AttnArgs a) { attn_decode_body<FP8, CPT, QT>(a); }

ATT_KERNEL(attn_decode_bf16_c1_q4, false, 1, 4)
ATT_KERNEL(attn_decode_bf16_c1_q8, false, 1, 8)
ATT_KERNEL(attn_decode_bf16_c1_q16, false, 1, 16)
ATT_KERNEL(attn_decode_bf16_c2_q4, false, 2, 4)
ATT_KERNEL(attn_decode_bf16_c2_q8, false, 2, 8)
ATT_KERNEL(attn_decode_bf16_c2_q16, false, 2, 16)
ATT_KERNEL(attn_decode_bf16_c4_q4, false, 4, 4)
ATT_KERNEL(attn_decode_bf16_c4_q8, false, 4, 8)
ATT_KERNEL(attn_decode_bf16_c4_q16, false, 4, 16)
ATT_KERNEL(attn_decode_fp8_c1_q4, true, 1, 4)
ATT_KERNEL(attn_decode_fp8_c1_q8, true, 1, 8)
ATT_KERNEL(attn_decode_fp8_c1_q16, true, 1, 16)
ATT_KERNEL(attn_decode_fp8_c2_q4, true, 2, 4)
ATT_KERNEL(attn_decode_fp8_c2_q8, true, 2, 8)
ATT_KERNEL(attn_decode_fp8_c2_q16, true, 2, 16)
ATT_KERNEL(attn_decode_fp8_c4_q4, true, 4, 4)
ATT_KERNEL(attn_decode_fp8_c4_q8, true, 4, 8)
ATT_KERNEL(attn_decode_fp8_c4_q16, true, 4, 16)

// Merges the splits of every query: out = Σ_s e^(m_s - M) O_s / Σ_s e^(m_s - M) l_s.
// Grid: (t*heads), block: any multiple of 32; shared memory: n_splits floats.
extern "C" __global__ void attn_decode_combine(const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                                               float* __restrict__ out, int nq_total, int v_dim, int n_splits) {
    extern __shared__ float sw[];
    const long long gq = blockIdx.x;
    if (gq >= nq_total) return;
    float mx = att_neg_inf();
    for (int s = 0; s < n_splits; s++) mx = fmaxf(mx, ws_ml[((long long)s * nq_total + gq) * 2]);
    float denom = 0.0f;
    for (int s = 0; s < n_splits; s++) {
        const float m = ws_ml[((long long)s * nq_total + gq) * 2];
        const float w = m == att_neg_inf() ? 0.0f : expf(m - mx);
        denom += w * ws_ml[((long long)s * nq_total + gq) * 2 + 1];
        if (threadIdx.x == 0) sw[s] = w;
    }
    __syncthreads();
    const float inv = 1.0f / denom;
    for (int c = threadIdx.x; c < v_dim; c += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < n_splits; s++) acc = fmaf(sw[s], ws_o[((long long)s * nq_total + gq) * v_dim + c], acc);
        out[gq * v_dim + c] = acc * inv;
    }
}

// MLA weight absorption: dst[i,h,0:latent] = Σ_d q[i,h,d] · kv_b[h*(nope+v) + d, :] (d < nope), and
// dst[i,h,latent:latent+rope] = q[i,h,nope:nope+rope].
// Grid: (ceil(latent / blockDim.x), heads, t); shared memory: nope floats.
extern "C" __global__ void mla_absorb_q(const bf16_t* __restrict__ kv_b, const float* __restrict__ q,
                                        float* __restrict__ dst, int heads, int nope, int rope, int v_dim,
                                        int latent) {
    extern __shared__ float s_qn[];
    const int h = blockIdx.y, i = blockIdx.z;
    const float* qh = q + ((long long)i * heads + h) * (nope + rope);
    float* dh = dst + ((long long)i * heads + h) * (latent + rope);
    for (int d = threadIdx.x; d < nope; d += blockDim.x) s_qn[d] = qh[d];
    __syncthreads();
    const int l = blockIdx.x * blockDim.x + threadIdx.x;
    if (l < latent) {
        const bf16_t* w = kv_b + (long long)h * (nope + v_dim) * latent + l;
        float acc0 = 0.0f, acc1 = 0.0f;  // two chains for ILP; summed in a fixed order
        int d = 0;
        for (; d + 1 < nope; d += 2) {
            acc0 = fmaf(s_qn[d], bf16_to_f32(w[(long long)d * latent]), acc0);
            acc1 = fmaf(s_qn[d + 1], bf16_to_f32(w[(long long)(d + 1) * latent]), acc1);
        }
        if (d < nope) acc0 = fmaf(s_qn[d], bf16_to_f32(w[(long long)d * latent]), acc0);
        dh[l] = acc0 + acc1;
    }
    if (blockIdx.x == 0)
        for (int r = threadIdx.x; r < rope; r += blockDim.x) dh[latent + r] = qh[nope + r];
}

// out[i,h,j] = Σ_l kv_b[h*(nope+v) + nope + j, l] · o_lat[i,h,l]. One warp per (i, h, j).
// Grid: ceil(t*heads*v_dim / warps per block).
extern "C" __global__ void mla_apply_uv(const bf16_t* __restrict__ kv_b, const float* __restrict__ o_lat,
                                        float* __restrict__ out, int t, int heads, int nope, int v_dim,
                                        int latent) {
    const int lane = threadIdx.x & 31;
    const long long wid = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const long long total = (long long)t * heads * v_dim;
    if (wid >= total) return;
    const int j = (int)(wid % v_dim);
    const long long ih = wid / v_dim;  // i*heads + h
    const int h = (int)(ih % heads);
    const bf16_t* w = kv_b + ((long long)h * (nope + v_dim) + nope + j) * latent;
    const float* o = o_lat + ih * latent;
    float acc = 0.0f;
    for (int l = lane; l < latent; l += 32) acc = fmaf(bf16_to_f32(w[l]), o[l], acc);
    acc = warp_sum(acc);
    if (lane == 0) out[ih * v_dim + j] = acc;
}
