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
// The queries of a block are up to ATT_Q = 16 (token i, head h) pairs of one kv group: the M
// dimension of the BF16 tensor-core MMA (mma.sync m16n8k16, f32 accumulate). Query i (absolute
// position q_start + i) sees rows 0 ..= q_start + i.
//
// Exactness: every f32 operand x enters the MMA as two BF16 halves hi = bf16(x), lo = bf16(x - hi)
// (|x - hi - lo| <= 2^-17 |x|); products of BF16 values are exact and accumulate in f32. Scores are
// Qhi·K + Qlo·K (+ Qhi·Klo for FP8, whose dequantised code*scale is not a BF16 value; BF16 keys are
// exact, so Klo = 0), the output P·V likewise with P = Phi + Plo. Dropped lo·lo terms are
// <= 2^-17 relative, far inside the f32 accumulation error the tests allow.
//
// attn_decode_partial: grid (n_splits, kv_heads, query tiles), ATT_THREADS threads. Split s covers
// rows [s*split_rows, min((s+1)*split_rows, q_start + t)), in tiles of ATT_ROWS rows:
//   1. the tile's K (and GQA's V) rows are stored into shared memory as BF16 (FP8: hi and lo
//      planes); the next tile's raw bytes are loaded into registers meanwhile (one tile ahead);
//   2. scores S[16 queries][32 rows]: warp w computes the 8-row MMA n-tile (w & 3) over half
//      (w >> 2) of the key dimension; the halves are summed in the softmax step;
//   3. online softmax: one warp per query (lane = row), one max/sum update per tile; P goes to
//      shared memory as BF16 hi/lo;
//   4. O = O*alpha + P·V: warp w owns the value n-tiles w, w+8, ... (NTW of them) in registers.
// With one split the block writes the normalised output; otherwise (m, l, unnormalised O) go to the
// workspace and attn_decode_combine merges the splits.
//
// Options (gpt-oss): a sliding window (window > 0: query i sees rows q_start + i - window < j <=
// q_start + i; the splits cover rows kv_lo .. q_start + t only, and a block starts at its first
// query's first visible row) and attention sinks (sinks[h]: a logit that joins the softmax's
// denominator, e^(sink - m), and adds nothing to the output; taken where the output is normalised:
// here with one split, else in attn_decode_combine).
#include "krasis_common.cuh"

#define ATT_THREADS 256
#define ATT_WARPS 8
#define ATT_ROWS 32  // KV rows per tile: 4 MMA n-tiles, one lane per row in the softmax
#define ATT_Q 16     // queries per block: the MMA's M
#define ATT_PF 10    // 16-byte staging units a thread prefetches (a V2-Lite BF16 tile needs 9)
#define ATT_QB 8     // query float4 loads a thread keeps in flight while staging Q
#define ATT_SLD (ATT_ROWS + 4)  // f32 score row stride (padding against bank conflicts)
#define ATT_PLD (ATT_ROWS + 8)  // BF16 probability row stride (conflict-free A fragments)

// E4M3 code -> f32, exact; 0x7f / 0xff are NaN (see kv_cache.cu, which holds the same function).
__device__ __forceinline__ float att_e4m3_to_f32(u32 c) {
    const u32 mag = c & 0x7fu;
    float v = __uint_as_float(mag << 20) * __uint_as_float(0x7b800000u);  // * 2^120
    if (mag == 0x7fu) v = krasis_nan();
    return (c & 0x80u) ? -v : v;
}

__device__ __forceinline__ float att_neg_inf() { return __uint_as_float(0xff800000u); }

// 1 / the softmax denominator of a query whose running max is m and whose sum (over its rows, in
// base m) is l; with sinks, head h's sink logit s joins it: e^(m - m') / (l e^(m - m') + e^(s - m'))
// with m' = max(m, s), so a sink far above every score neither overflows nor divides 0 by 0.
__device__ __forceinline__ float att_inverse_sum(float m, float l, const bf16_t* sinks, int h) {
    if (!sinks) return 1.0f / l;
    const float s = bf16_to_f32(sinks[h]);
    const float mm = fmaxf(m, s);
    const float c = m == att_neg_inf() ? 0.0f : expf(m - mm);
    return c / (l * c + expf(s - mm));
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
    int ldk, ldv;            // shared-memory row strides (BF16 elements) of K and (GQA) V
    int vec;                 // elements per staging unit: 16 bytes' worth, or 1 (unaligned shapes)
    float scale;
    int window;              // > 0: query at position p sees rows p - window < j <= p (sliding window)
    int kv_lo;               // first row any query of the call sees; the splits cover kv_lo .. q_start + t
    const bf16_t* sinks;     // [heads] BF16 sink logits (one more softmax column per head), or null
};

// Staging unit u of a tile with n_r rows: K units first (pk per row), then GQA's V units.
template <bool FP8>
__device__ __forceinline__ void att_load_unit(const AttnArgs& a, int g, long long row0, int u, int nk, int pk,
                                              int pv, uint4& w, float& sc) {
    const bool is_v = u >= nk;
    const int uu = is_v ? u - nk : u;
    const int per = is_v ? pv : pk;
    const int r = uu / per, c = (uu - r * per) * a.vec;
    const unsigned char* base = is_v ? a.v : a.k;
    const int rowlen = is_v ? a.v_row : a.k_row;
    const int off = g * (is_v ? a.v_dim : a.k_dim) + c;
    const long long e = (row0 + r) * (long long)rowlen + off;
    if (a.vec > 1) {
        w = *reinterpret_cast<const uint4*>(base + e * (FP8 ? 1 : 2));
    } else {
        w.x = FP8 ? (u32)base[e] : (u32)*reinterpret_cast<const bf16_t*>(base + e * 2);
    }
    if constexpr (FP8) {
        const float* sp = is_v ? a.v_scales : a.k_scales;
        sc = sp[(row0 + r) * (long long)(rowlen / a.group) + off / a.group];
    }
}

template <bool FP8>
__device__ __forceinline__ void att_store_unit(const AttnArgs& a, int u, int nk, int pk, int pv, const uint4& w,
                                               float sc, bf16_t* sKh, bf16_t* sKl, bf16_t* sVh, bf16_t* sVl) {
    const bool is_v = u >= nk;
    const int uu = is_v ? u - nk : u;
    const int per = is_v ? pv : pk;
    const int r = uu / per, c = (uu - r * per) * a.vec;
    const int ld = is_v ? a.ldv : a.ldk;
    bf16_t* dh = (is_v ? sVh : sKh) + r * ld + c;
    if constexpr (!FP8) {
        if (a.vec > 1) *reinterpret_cast<uint4*>(dh) = w;
        else *dh = (bf16_t)w.x;
    } else {
        bf16_t* dl = (is_v ? sVl : sKl) + r * ld + c;
        if (a.vec > 1) {
            const u32 ww[4] = {w.x, w.y, w.z, w.w};
            u32 hw[8], lw[8];
#pragma unroll
            for (int k = 0; k < 16; k += 2) {
                bf16_t h0, l0, h1, l1;
                bf16_split(att_e4m3_to_f32((ww[k >> 2] >> (8 * (k & 3))) & 0xffu) * sc, h0, l0);
                bf16_split(att_e4m3_to_f32((ww[k >> 2] >> (8 * ((k + 1) & 3))) & 0xffu) * sc, h1, l1);
                hw[k >> 1] = bf16x2_of(h0, h1);
                lw[k >> 1] = bf16x2_of(l0, l1);
            }
            reinterpret_cast<uint4*>(dh)[0] = make_uint4(hw[0], hw[1], hw[2], hw[3]);
            reinterpret_cast<uint4*>(dh)[1] = make_uint4(hw[4], hw[5], hw[6], hw[7]);
            reinterpret_cast<uint4*>(dl)[0] = make_uint4(lw[0], lw[1], lw[2], lw[3]);
            reinterpret_cast<uint4*>(dl)[1] = make_uint4(lw[4], lw[5], lw[6], lw[7]);
        } else {
            bf16_t h, l;
            bf16_split(att_e4m3_to_f32(w.x & 0xffu) * sc, h, l);
            *dh = h;
            *dl = l;
        }
    }
}

template <bool FP8, int NTW>
__device__ __forceinline__ void attn_decode_body(const AttnArgs& a) {
    extern __shared__ __align__(16) unsigned char att_smem[];
    constexpr int KP = FP8 ? 2 : 1;  // BF16 planes per staged tensor (hi, lo)
    float* sS = reinterpret_cast<float*>(att_smem);  // [2 halves][ATT_Q][ATT_SLD]
    float* sM = sS + 2 * ATT_Q * ATT_SLD;            // [ATT_Q] running max
    float* sL = sM + ATT_Q;                          // [ATT_Q] running sum
    float* sA = sL + ATT_Q;                          // [ATT_Q] rescale of this tile
    bf16_t* sQh = reinterpret_cast<bf16_t*>(sA + ATT_Q);  // [ATT_Q][ldk]
    bf16_t* sQl = sQh + ATT_Q * a.ldk;
    bf16_t* sKh = sQl + ATT_Q * a.ldk;  // [ATT_ROWS][ldk]
    bf16_t* sKl = FP8 ? sKh + ATT_ROWS * a.ldk : sKh;
    bf16_t* after_k = sKh + KP * ATT_ROWS * a.ldk;
    bf16_t* sVh = a.shared_kv ? sKh : after_k;  // [ATT_ROWS][ldv]
    bf16_t* sVl = a.shared_kv ? sKl : (FP8 ? after_k + ATT_ROWS * a.ldv : sVh);
    bf16_t* sPh = a.shared_kv ? after_k : after_k + KP * ATT_ROWS * a.ldv;  // [ATT_Q][ATT_PLD]
    bf16_t* sPl = sPh + ATT_Q * ATT_PLD;
    const int ldvs = a.shared_kv ? a.ldk : a.ldv;  // row stride of the staged values

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
    const int split = blockIdx.x, g = blockIdx.y, qtile = blockIdx.z;
    const int group_heads = a.heads / a.kv_heads;
    const int nq = a.t * group_heads;  // queries of this kv group
    const int q0 = qtile * ATT_Q;
    const int qn = min(ATT_Q, nq - q0);

    const int last_i = (q0 + qn - 1) / group_heads;  // the block's last query sees the most rows
    const long long visible = (long long)a.q_start + a.t;
    const long long split_begin = (long long)a.kv_lo + (long long)split * a.split_rows;
    long long s_end = split_begin + a.split_rows;
    if (s_end > visible) s_end = visible;
    const long long block_end = min(s_end, (long long)a.q_start + last_i + 1);
    // A window hides the rows before the block's first query's first visible row.
    const long long s_begin =
        a.window > 0 ? max(split_begin, (long long)a.q_start + q0 / group_heads + 1 - a.window) : split_begin;

    const int pk = a.k_dim / a.vec, pv = a.shared_kv ? 0 : a.v_dim / a.vec;
    // The first tile's bytes are requested before the queries are staged, so the two overlap.
    uint4 pw[ATT_PF];
    float ps[ATT_PF];
#pragma unroll
    for (int i = 0; i < ATT_PF; i++) ps[i] = 0.0f;
    if (s_begin < block_end) {
        const int n_r = (int)min((long long)ATT_ROWS, block_end - s_begin);
        const int nk = n_r * pk, nu = n_r * (pk + pv);
#pragma unroll
        for (int i = 0; i < ATT_PF; i++) {
            const int u = tid + i * ATT_THREADS;
            if (u < nu) att_load_unit<FP8>(a, g, s_begin, u, nk, pk, pv, pw[i], ps[i]);
        }
    }

    // Zero the K/V tiles once: padding columns and rows past a short last tile are read by the MMAs
    // (multiplied by zero queries / probabilities), so they must hold finite values.
    for (u32* p = reinterpret_cast<u32*>(sKh) + tid; p < reinterpret_cast<u32*>(sPh); p += ATT_THREADS) *p = 0u;
    // Queries as BF16 hi/lo, zero-padded to ldk columns and to ATT_Q rows; 4 columns per item,
    // ATT_QB items per thread in flight.
    {
        const int per = a.ldk >> 2, items = ATT_Q * per;
        const bool v4 = (a.k_dim & 3) == 0;
        for (int base = tid; base < items; base += ATT_THREADS * ATT_QB) {
            float4 v[ATT_QB];
#pragma unroll
            for (int b = 0; b < ATT_QB; b++) {
                v[b] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                const int it = base + b * ATT_THREADS;
                const int qq = it / per, d = (it - qq * per) * 4;
                if (it < items && qq < qn && d < a.k_dim) {
                    const int j = q0 + qq;
                    const int i = j / group_heads, h = g * group_heads + (j - i * group_heads);
                    const float* src = a.q + ((long long)i * a.heads + h) * a.k_dim + d;
                    if (v4) {
                        v[b] = *reinterpret_cast<const float4*>(src);
                    } else {
                        v[b].x = src[0];
                        if (d + 1 < a.k_dim) v[b].y = src[1];
                        if (d + 2 < a.k_dim) v[b].z = src[2];
                        if (d + 3 < a.k_dim) v[b].w = src[3];
                    }
                }
            }
#pragma unroll
            for (int b = 0; b < ATT_QB; b++) {
                const int it = base + b * ATT_THREADS;
                if (it >= items) break;
                const int qq = it / per, d = (it - qq * per) * 4;
                bf16_t* dh = sQh + qq * a.ldk + d;
                bf16_t* dl = sQl + qq * a.ldk + d;
                bf16_split(v[b].x, dh[0], dl[0]);
                bf16_split(v[b].y, dh[1], dl[1]);
                bf16_split(v[b].z, dh[2], dl[2]);
                bf16_split(v[b].w, dh[3], dl[3]);
            }
        }
    }
    if (tid < ATT_Q) {
        sM[tid] = att_neg_inf();
        sL[tid] = 0.0f;
    }


    float acc[NTW][4];
#pragma unroll
    for (int i = 0; i < NTW; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[i][e] = 0.0f;

    const int ks_total = (a.k_dim + 15) >> 4;
    const int ks_half = (ks_total + 1) >> 1;
    const int ks0 = (warp >> 2) * ks_half, ks1 = min(ks_total, ks0 + ks_half);

    for (long long row0 = s_begin; row0 < block_end; row0 += ATT_ROWS) {
        const int n_r = (int)min((long long)ATT_ROWS, block_end - row0);
        const int nk = n_r * pk, nu = n_r * (pk + pv);
        __syncthreads();  // the previous tile is no longer read (first tile: zeroing done)
#pragma unroll
        for (int i = 0; i < ATT_PF; i++) {
            const int u = tid + i * ATT_THREADS;
            if (u < nu) att_store_unit<FP8>(a, u, nk, pk, pv, pw[i], ps[i], sKh, sKl, sVh, sVl);
        }
        for (int u = tid + ATT_PF * ATT_THREADS; u < nu; u += ATT_THREADS) {  // beyond the prefetch
            uint4 w;
            float sc = 0.0f;
            att_load_unit<FP8>(a, g, row0, u, nk, pk, pv, w, sc);
            att_store_unit<FP8>(a, u, nk, pk, pv, w, sc, sKh, sKl, sVh, sVl);
        }
        __syncthreads();
        // Prefetch the next tile into registers; it lands while this one is computed.
        if (row0 + ATT_ROWS < block_end) {
            const long long nrow0 = row0 + ATT_ROWS;
            const int n_r2 = (int)min((long long)ATT_ROWS, block_end - nrow0);
            const int nk2 = n_r2 * pk, nu2 = n_r2 * (pk + pv);
#pragma unroll
            for (int i = 0; i < ATT_PF; i++) {
                const int u = tid + i * ATT_THREADS;
                if (u < nu2) att_load_unit<FP8>(a, g, nrow0, u, nk2, pk, pv, pw[i], ps[i]);
            }
        }

        // 2. Scores: n-tile (warp & 3), key half (warp >> 2).
        {
            const int nt = warp & 3;
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const bf16_t* kr = sKh + (nt * 8 + gid) * a.ldk + 2 * tig;
            const bf16_t* qh = sQh + gid * a.ldk + 2 * tig;
            const bf16_t* ql = sQl + gid * a.ldk + 2 * tig;
            const int q8 = 8 * a.ldk;
            for (int ks = ks0; ks < ks1; ks++) {
                const int k0 = ks * 16;
                const u32 ah[4] = {ld_bf16x2(qh + k0), ld_bf16x2(qh + q8 + k0), ld_bf16x2(qh + k0 + 8),
                                   ld_bf16x2(qh + q8 + k0 + 8)};
                const u32 al[4] = {ld_bf16x2(ql + k0), ld_bf16x2(ql + q8 + k0), ld_bf16x2(ql + k0 + 8),
                                   ld_bf16x2(ql + q8 + k0 + 8)};
                const u32 b0 = ld_bf16x2(kr + k0), b1 = ld_bf16x2(kr + k0 + 8);
                mma_bf16(c, ah, b0, b1);
                mma_bf16(c, al, b0, b1);
                if constexpr (FP8) {
                    const bf16_t* krl = sKl + (nt * 8 + gid) * a.ldk + 2 * tig;
                    mma_bf16(c, ah, ld_bf16x2(krl + k0), ld_bf16x2(krl + k0 + 8));
                }
            }
            float* so = sS + (warp >> 2) * ATT_Q * ATT_SLD + nt * 8 + 2 * tig;
            so[gid * ATT_SLD] = c[0];
            so[gid * ATT_SLD + 1] = c[1];
            so[(gid + 8) * ATT_SLD] = c[2];
            so[(gid + 8) * ATT_SLD + 1] = c[3];
        }
        __syncthreads();

        // 3. Online softmax, one warp per query; lane = row.
        for (int qq = warp; qq < ATT_Q; qq += ATT_WARPS) {
            const int j = q0 + qq;
            const long long qpos = (long long)a.q_start + j / group_heads;
            const bool ok = qq < qn && lane < n_r && row0 + lane <= qpos && (a.window <= 0 || row0 + lane > qpos - a.window);
            const float raw = (sS[qq * ATT_SLD + lane] + sS[(ATT_Q + qq) * ATT_SLD + lane]) * a.scale;
            const float sc = ok ? raw : att_neg_inf();
            float mx = sc;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_old = sM[qq];
            const float m_new = fmaxf(m_old, mx);
            float p = 0.0f, alpha = 1.0f;
            if (m_new != att_neg_inf()) {
                p = sc == att_neg_inf() ? 0.0f : expf(sc - m_new);
                alpha = m_old == att_neg_inf() ? 0.0f : expf(m_old - m_new);
            }
            float sum = p;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            bf16_split(p, sPh[qq * ATT_PLD + lane], sPl[qq * ATT_PLD + lane]);
            if (lane == 0) {
                sM[qq] = m_new;
                sL[qq] = sL[qq] * alpha + sum;
                sA[qq] = alpha;
            }
        }
        __syncthreads();

        // 4. O = O * alpha + P · V; warp owns value n-tiles warp, warp + 8, ...
        {
            const float al0 = sA[gid], al8 = sA[gid + 8];
#pragma unroll
            for (int i = 0; i < NTW; i++) {
                acc[i][0] *= al0;
                acc[i][1] *= al0;
                acc[i][2] *= al8;
                acc[i][3] *= al8;
            }
#pragma unroll
            for (int r0 = 0; r0 < ATT_ROWS; r0 += 16) {
                const bf16_t* ph = sPh + gid * ATT_PLD + r0 + 2 * tig;
                const bf16_t* pl = sPl + gid * ATT_PLD + r0 + 2 * tig;
                const u32 pa[4] = {ld_bf16x2(ph), ld_bf16x2(ph + 8 * ATT_PLD), ld_bf16x2(ph + 8), ld_bf16x2(ph + 8 * ATT_PLD + 8)};
                const u32 pb[4] = {ld_bf16x2(pl), ld_bf16x2(pl + 8 * ATT_PLD), ld_bf16x2(pl + 8), ld_bf16x2(pl + 8 * ATT_PLD + 8)};
#pragma unroll
                for (int i = 0; i < NTW; i++) {
                    const int nt = warp + ATT_WARPS * i;
                    if (nt * 8 >= a.v_dim) break;  // warp-uniform
                    const bf16_t* vp = sVh + (r0 + 2 * tig) * ldvs + nt * 8 + gid;
                    const u32 b0 = bf16x2_of(vp[0], vp[ldvs]), b1 = bf16x2_of(vp[8 * ldvs], vp[9 * ldvs]);
                    mma_bf16(acc[i], pa, b0, b1);
                    mma_bf16(acc[i], pb, b0, b1);
                    if constexpr (FP8) {
                        const bf16_t* vl = sVl + (r0 + 2 * tig) * ldvs + nt * 8 + gid;
                        mma_bf16(acc[i], pa, bf16x2_of(vl[0], vl[ldvs]), bf16x2_of(vl[8 * ldvs], vl[9 * ldvs]));
                    }
                }
            }
        }
    }
    __syncthreads();

    // Results: query qq = (token i, head h) -> global index i*heads + h.
    const int nq_total = a.t * a.heads;
#pragma unroll
    for (int i = 0; i < NTW; i++) {
        const int col = (warp + ATT_WARPS * i) * 8 + 2 * tig;
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int qq = gid + 8 * half;
            if (qq >= qn) continue;
            const int j = q0 + qq;
            const int ti = j / group_heads, h = g * group_heads + (j - ti * group_heads);
            const long long gq = (long long)ti * a.heads + h;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                if (col + e >= a.v_dim) continue;
                const float v = acc[i][2 * half + e];
                if (a.n_splits == 1) {
                    a.out[gq * a.v_dim + col + e] = v * att_inverse_sum(sM[qq], sL[qq], a.sinks, h);
                } else {
                    a.ws_o[((long long)split * nq_total + gq) * a.v_dim + col + e] = v;
                }
            }
        }
    }
    if (a.n_splits > 1 && tid < qn) {
        const int j = q0 + tid;
        const int ti = j / group_heads, h = g * group_heads + (j - ti * group_heads);
        const long long base = (long long)split * nq_total + (long long)ti * a.heads + h;
        a.ws_ml[base * 2] = sM[tid];
        a.ws_ml[base * 2 + 1] = sL[tid];
    }
}

// One entry point per (dtype, value n-tiles per warp): NTW * 8 warps * 8 columns >= v_dim. Each is
// its own NVRTC program (compiled with -DATT_NAME=attn_decode_<dtype>_n<NTW> -DATT_FP8=<bool>
// -DATT_NTW=<n>; see attn_decode.rs): one instantiation of the body takes seconds to compile, so
// the programs compile in parallel and a model compiles only the ones it launches; the program
// without ATT_NAME holds the kernels below (combine, absorption, W_UV).
#ifdef ATT_NAME
extern "C" __global__ void __launch_bounds__(ATT_THREADS) ATT_NAME(AttnArgs a) { attn_decode_body<ATT_FP8, ATT_NTW>(a); }
#else

// Merges the splits of every query: out = Σ_s e^(m_s - M) O_s / Σ_s e^(m_s - M) l_s; with sinks
// (sinks[h] for query gq = token * heads + h) M also covers the sink and the denominator adds
// e^(sink - M).
// Grid: (t*heads, ceil(v_dim / COMB_COLS)), block: COMB_THREADS; shared memory: n_splits + 32
// floats plus COMB_THREADS float4. Thread (column quad tid % 32, split lane tid / 32) sums the splits
// s = lane, lane + 8, ... of 4 columns; the 8 partial sums are added in a fixed order, so the result
// does not depend on timing.
#define COMB_THREADS 256
#define COMB_COLS 128
extern "C" __global__ void __launch_bounds__(COMB_THREADS)
    attn_decode_combine(const float* __restrict__ ws_o, const float* __restrict__ ws_ml, float* __restrict__ out,
                        int nq_total, int v_dim, int n_splits, const bf16_t* __restrict__ sinks, int heads) {
    extern __shared__ __align__(16) float sw[];
    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();
    float4* part = reinterpret_cast<float4*>(sw + ((n_splits + 32 + 3) & ~3));  // [COMB_THREADS]
    float* red = sw + n_splits;
    const long long gq = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = COMB_THREADS / 32;
    float mx = att_neg_inf();
    for (int s = tid; s < n_splits; s += COMB_THREADS) mx = fmaxf(mx, ws_ml[((long long)s * nq_total + gq) * 2]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = att_neg_inf();
    for (int w = 0; w < nwarps; w++) mx = fmaxf(mx, red[w]);
    __syncthreads();
    // The sink (when given) is one more column of the softmax: it raises the max and the
    // denominator, and adds nothing to the output.
    const float sink = sinks ? bf16_to_f32(sinks[gq % heads]) : att_neg_inf();
    mx = fmaxf(mx, sink);
    float den = 0.0f;
    for (int s = tid; s < n_splits; s += COMB_THREADS) {
        const float m = ws_ml[((long long)s * nq_total + gq) * 2];
        const float w = m == att_neg_inf() ? 0.0f : expf(m - mx);
        sw[s] = w;
        den += w * ws_ml[((long long)s * nq_total + gq) * 2 + 1];
    }
    den = block_sum(den, red);  // ends with a barrier: sw is complete
    if (sinks) den += expf(sink - mx);
    const int c = blockIdx.y * COMB_COLS + (tid & 31) * 4;
    const int sl = tid >> 5;
    const long long stride = (long long)nq_total * v_dim;
    const float* o = ws_o + gq * v_dim + c;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (c < v_dim) {
        if ((v_dim & 3) == 0) {
            for (int s = sl; s < n_splits; s += 4 * nwarps) {  // 4 loads in flight
                float4 v[4];
                float w[4];
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const int ss = s + k * nwarps;
                    w[k] = ss < n_splits ? sw[ss] : 0.0f;
                    v[k] = ss < n_splits ? *reinterpret_cast<const float4*>(o + ss * stride)
                                         : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    acc.x = fmaf(w[k], v[k].x, acc.x);
                    acc.y = fmaf(w[k], v[k].y, acc.y);
                    acc.z = fmaf(w[k], v[k].z, acc.z);
                    acc.w = fmaf(w[k], v[k].w, acc.w);
                }
            }
        } else {
            for (int s = sl; s < n_splits; s += nwarps) {
                const float w = sw[s];
                const float* os = o + s * stride;
                acc.x = fmaf(w, os[0], acc.x);
                if (c + 1 < v_dim) acc.y = fmaf(w, os[1], acc.y);
                if (c + 2 < v_dim) acc.z = fmaf(w, os[2], acc.z);
                if (c + 3 < v_dim) acc.w = fmaf(w, os[3], acc.w);
            }
        }
    }
    part[tid] = acc;
    __syncthreads();
    if (sl != 0 || c >= v_dim) return;
    float4 t = part[tid];
    for (int k = 1; k < nwarps; k++) {
        const float4 p = part[tid + 32 * k];
        t.x += p.x;
        t.y += p.y;
        t.z += p.z;
        t.w += p.w;
    }
    const float inv = 1.0f / den;
    const float r[4] = {t.x, t.y, t.z, t.w};
    for (int e = 0; e < 4 && c + e < v_dim; e++) out[gq * v_dim + c + e] = r[e] * inv;
}

// MLA weight absorption: dst[i,h,0:latent] = Σ_d q[i,h,d] · kv_b[h*(nope+v) + d, :] (d < nope), and
// dst[i,h,latent:latent+rope] = q[i,h,nope:nope+rope].
//
// Launch: grid (ceil(latent / ABS_COLS), heads, ceil(t / ABS_TT)), ABS_THREADS = 256 threads, no
// dynamic shared memory. A block owns ABS_COLS = 64 latent columns of one head for up to ABS_TT = 4
// tokens; lane c of every warp owns columns 2c, 2c+1 of the tile (one 4-byte bf16x2 load per row:
// a warp reads 128 contiguous bytes of a kv_b row), and the nope (d) range is split over the 8
// warps, warp w taking rows d = w, w + 8, w + 16, ... Why: at decode (t = 1) the old
// one-thread-per-column layout gave latent/128 x heads = 64 blocks, each thread walking all nope
// rows serially; this gives latent/64 x heads = 128 blocks (V2-Lite) of 8 warps, each warp with
// nope/8 rows of independent loads in flight, and each weight element read once per ABS_TT tokens.
// Summation order (deterministic, independent of timing): each thread sums its rows in increasing
// d in one fmaf chain; the 8 warp partials are then added in warp order 0..7 (from shared memory)
// by one thread per (token, column).
#define ABS_THREADS 256
#define ABS_WARPS 8
#define ABS_COLS 64
#define ABS_TT 4
// acc{0,1}[k] += q[token k][d] * w{0,1} for the nt (<= ABS_TT) tokens of the tile; qd = &q[token 0][d].
__device__ __forceinline__ void abs_accumulate(float* acc0, float* acc1, const float* qd, long long qstride, int nt,
                                               float w0, float w1) {
#pragma unroll
    for (int k = 0; k < ABS_TT; k++) {
        if (k < nt) {
            const float qv = __ldg(qd + k * qstride);
            acc0[k] = fmaf(qv, w0, acc0[k]);
            acc1[k] = fmaf(qv, w1, acc1[k]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(ABS_THREADS, 1)
    mla_absorb_q(const bf16_t* __restrict__ kv_b, const float* __restrict__ q, float* __restrict__ dst, int t,
                 int heads, int nope, int rope, int v_dim, int latent) {
    __shared__ float part[ABS_WARPS][ABS_TT][ABS_COLS];
    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.y, i0 = blockIdx.z * ABS_TT;
    const int nt = min(ABS_TT, t - i0);
    const int c0 = blockIdx.x * ABS_COLS + 2 * lane;  // this lane's first column
    const bf16_t* wh = kv_b + (long long)h * (nope + v_dim) * latent;
    const float* qb = q + ((long long)i0 * heads + h) * (nope + rope);  // token i0's q for head h
    const long long qstride = (long long)heads * (nope + rope);           // next token
    float acc0[ABS_TT], acc1[ABS_TT];
#pragma unroll
    for (int k = 0; k < ABS_TT; k++) acc0[k] = acc1[k] = 0.0f;
    // Paired (4-byte) loads need a 4-byte aligned kv_b, an even row length (rows then start 4-byte
    // aligned) and both columns in range.
    const bool pair = ((unsigned long long)kv_b & 3ull) == 0 && (latent & 1) == 0 && c0 + 1 < latent;
    // The branch is outside the row loops, so each loop's loads batch across unrolled rows.
    if (pair) {
#pragma unroll 8  // 8 rows' loads issued together (V2-Lite: 16 rows per warp, two batches)
        for (int d = warp; d < nope; d += ABS_WARPS) {
            const u32 u = *reinterpret_cast<const u32*>(wh + (long long)d * latent + c0);
            const float w0 = __uint_as_float(u << 16), w1 = __uint_as_float(u & 0xffff0000u);
            abs_accumulate(acc0, acc1, qb + d, qstride, nt, w0, w1);
        }
    } else if (c0 < latent) {
        const bool two = c0 + 1 < latent;
#pragma unroll 4
        for (int d = warp; d < nope; d += ABS_WARPS) {
            const bf16_t* wr = wh + (long long)d * latent + c0;
            const float w0 = bf16_to_f32(wr[0]), w1 = two ? bf16_to_f32(wr[1]) : 0.0f;
            abs_accumulate(acc0, acc1, qb + d, qstride, nt, w0, w1);
        }
    }
#pragma unroll
    for (int k = 0; k < ABS_TT; k++) {
        part[warp][k][2 * lane] = acc0[k];
        part[warp][k][2 * lane + 1] = acc1[k];
    }
    __syncthreads();
    for (int o = threadIdx.x; o < ABS_TT * ABS_COLS; o += ABS_THREADS) {
        const int k = o / ABS_COLS, c = o % ABS_COLS, l = blockIdx.x * ABS_COLS + c;
        if (k >= nt || l >= latent) continue;
        float s = part[0][k][c];
#pragma unroll
        for (int w = 1; w < ABS_WARPS; w++) s += part[w][k][c];
        dst[((long long)(i0 + k) * heads + h) * (latent + rope) + l] = s;
    }
    if (blockIdx.x == 0)
        for (int o = threadIdx.x; o < nt * rope; o += ABS_THREADS) {
            const int k = o / rope, r = o % rope;
            dst[((long long)(i0 + k) * heads + h) * (latent + rope) + latent + r] = qb[k * qstride + nope + r];
        }
}

// out[i,h,j] = Σ_l kv_b[h*(nope+v) + nope + j, l] · o_lat[i,h,l]. One warp per (i, h, j).
// Grid: ceil(t*heads*v_dim / warps per block).
extern "C" __global__ void mla_apply_uv(const bf16_t* __restrict__ kv_b, const float* __restrict__ o_lat,
                                        float* __restrict__ out, int t, int heads, int nope, int v_dim,
                                        int latent) {
    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();
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
#endif  // ATT_NAME
