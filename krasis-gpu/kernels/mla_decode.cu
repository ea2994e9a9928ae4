// MLA absorbed decode attention for one query token over a BF16 cache, on CUDA cores: the common
// decode step of DeepSeek-style models, where the general tensor-core kernel of attn_decode.cu is
// latency-bound (one 16-query MMA tile per block, four block barriers per 32-row tile, a large
// unrolled body run once per SM from a cold instruction cache: ~25 us at 64 cached rows on an
// H100 for ~1 MFLOP of work).
//
// q [heads, row] f32 (absorbed q_lat ‖ q_pe), cache rows [S, row] BF16 (latent ‖ k_pe; the values
// are the first `latent` elements of each row), out [heads, latent] f32. The query sees rows
// 0 .. visible-1.
//
// Layout: grid (n_splits, ceil(heads / 16)), 256 threads = 8 warps; warp w of block (s, g) owns
// heads 16g + 2w and 16g + 2w + 1 over split s's rows. Lane l holds the query elements
// 2p, 2p+1 for p = l + 32j (j < NJ) of both heads in registers, pre-scaled by scale·log2(e), and
// accumulates the output columns 2p, 2p+1 for p = l + 32j (j < NV). Rows go four at a time (the
// next four's loads issued before this four is computed): every lane loads its bf16 pairs of the four rows (the eight warps of a block read the same rows, so
// L1 serves all but the first), forms 8 partial dot products (4 rows x 2 heads), and one
// reduce-scatter + all-gather over the warp (17 shuffles) gives every lane the 8 scores. Online
// softmax in base 2 per head, then the value update reuses the loaded latent pairs. No shared
// memory and no block barriers: warps are independent.
//
// Output: with one split, out = acc / l. Otherwise (m, l, acc) go to the workspace in
// attn_decode_combine's format (m in natural-log units), and that kernel merges the splits.
//
// Summation order is fixed (lane-ordered butterfly, rows in increasing order), so results do not
// depend on timing.
#include "krasis_common.cuh"

#define MLA1_THREADS 256
#define MLA1_WARPS 8
#define MLA1_ROWS 4  // rows per step: 4 rows x 2 heads = 8 scores per reduction
#define MLA1_LN2 0.6931471805599453f

struct MlaT1Args {
    const unsigned int* kv;  // the layer's cache plane as bf16 pairs: row r, pair p at kv[r * half_row + p]
    const float* q;          // [heads, row]
    float* out;              // [heads, latent] (one split)
    float* ws_o;             // [n_splits, heads, latent]
    float* ws_ml;            // [n_splits, heads, 2]
    int heads, half_row, half_lat;
    int visible, n_splits, split_rows;
    float qscale;  // softmax scale x log2(e)
};

__device__ __forceinline__ float mla1_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float mla1_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// Sum of v[0..8] over the warp; afterwards every lane holds all eight sums in v. Reduce-scatter
// (4 + 2 + 1 shuffles, then 2 more for the last two lane bits) leaves sum k in the lanes with
// (lane >> 2) & 7 == k; an all-gather (8 shuffles) hands them out.
__device__ __forceinline__ void mla1_allreduce8(float* v, int lane) {
    const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
    float w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float send = b4 ? v[i] : v[i + 4];
        const float keep = b4 ? v[i + 4] : v[i];
        w[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
    }
    float x[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const float send = b3 ? w[i] : w[i + 2];
        const float keep = b3 ? w[i + 2] : w[i];
        x[i] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
    }
    float y;
    {
        const float send = b2 ? x[0] : x[1];
        const float keep = b2 ? x[1] : x[0];
        y = keep + __shfl_xor_sync(0xffffffffu, send, 4);
    }
    y += __shfl_xor_sync(0xffffffffu, y, 2);
    y += __shfl_xor_sync(0xffffffffu, y, 1);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = __shfl_sync(0xffffffffu, y, k << 2);
}

// Lane's bf16 pairs p = lane + 32j of rows r0 .. r0+3 (zeros past r_end or the row).
template <int NJ>
__device__ __forceinline__ void mla1_load(u32 (&kw)[MLA1_ROWS][NJ], const MlaT1Args& a, int r0, int r_end, int lane) {
#pragma unroll
    for (int i = 0; i < MLA1_ROWS; i++) {
        const bool ok = r0 + i < r_end;
        const u32* rowp = a.kv + (long long)(r0 + i) * a.half_row;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const int p = lane + 32 * j;
            kw[i][j] = (ok && p < a.half_row) ? __ldg(rowp + p) : 0u;
        }
    }
}

// Scores of rows r0 .. r0+3 for both heads, the online-softmax update and the value update.
template <int NJ, int NV>
__device__ __forceinline__ void mla1_step(const u32 (&kw)[MLA1_ROWS][NJ], int r0, int r_end, int lane,
                                          const float2 (&qa)[NJ], const float2 (&qb)[NJ], float& ma, float& mb,
                                          float& la, float& lb, float2 (&acca)[NV], float2 (&accb)[NV]) {
    const float ninf = __uint_as_float(0xff800000u);
    // s[i] = head a's score of row r0 + i, s[4 + i] head b's.
    float s[8];
#pragma unroll
    for (int i = 0; i < MLA1_ROWS; i++) {
        float sa = 0.0f, sb = 0.0f;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const float lo = mla1_lo(kw[i][j]), hi = mla1_hi(kw[i][j]);
            sa = fmaf(qa[j].x, lo, sa);
            sa = fmaf(qa[j].y, hi, sa);
            sb = fmaf(qb[j].x, lo, sb);
            sb = fmaf(qb[j].y, hi, sb);
        }
        s[i] = sa;
        s[4 + i] = sb;
    }
    mla1_allreduce8(s, lane);
#pragma unroll
    for (int i = 0; i < MLA1_ROWS; i++) {
        if (r0 + i >= r_end) s[i] = s[4 + i] = ninf;
    }
    // Online softmax (base 2) per head; the first row of every step is valid, so the new maxima
    // are finite.
    const float mna = fmaxf(ma, fmaxf(fmaxf(s[0], s[1]), fmaxf(s[2], s[3])));
    const float mnb = fmaxf(mb, fmaxf(fmaxf(s[4], s[5]), fmaxf(s[6], s[7])));
    const float alpha_a = exp2f(ma - mna), alpha_b = exp2f(mb - mnb);  // exp2(-inf) = 0
    float pa[MLA1_ROWS], pb[MLA1_ROWS];
#pragma unroll
    for (int i = 0; i < MLA1_ROWS; i++) {
        pa[i] = exp2f(s[i] - mna);
        pb[i] = exp2f(s[4 + i] - mnb);
    }
    la = la * alpha_a + ((pa[0] + pa[1]) + (pa[2] + pa[3]));
    lb = lb * alpha_b + ((pb[0] + pb[1]) + (pb[2] + pb[3]));
    ma = mna;
    mb = mnb;
#pragma unroll
    for (int j = 0; j < NV; j++) {
        float2 xa = make_float2(acca[j].x * alpha_a, acca[j].y * alpha_a);
        float2 xb = make_float2(accb[j].x * alpha_b, accb[j].y * alpha_b);
#pragma unroll
        for (int i = 0; i < MLA1_ROWS; i++) {
            const float lo = mla1_lo(kw[i][j]), hi = mla1_hi(kw[i][j]);
            xa.x = fmaf(pa[i], lo, xa.x);
            xa.y = fmaf(pa[i], hi, xa.y);
            xb.x = fmaf(pb[i], lo, xb.x);
            xb.y = fmaf(pb[i], hi, xb.y);
        }
        acca[j] = xa;
        accb[j] = xb;
    }
}

template <int NJ, int NV>
__device__ __forceinline__ void mla_decode_t1_body(const MlaT1Args& a) {
    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h0 = (blockIdx.y * MLA1_WARPS + warp) * 2;
    if (h0 >= a.heads) return;
    const bool two = h0 + 1 < a.heads;
    const int split = blockIdx.x;
    const int r_begin = split * a.split_rows;
    const int r_end = min(r_begin + a.split_rows, a.visible);

    float2 qa[NJ], qb[NJ];
    const float2* q0 = reinterpret_cast<const float2*>(a.q + (long long)h0 * 2 * a.half_row);
    const float2* q1 = q0 + a.half_row;
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        const int p = lane + 32 * j;
        qa[j] = qb[j] = make_float2(0.0f, 0.0f);
        if (p < a.half_row) {
            const float2 x = q0[p];
            qa[j] = make_float2(x.x * a.qscale, x.y * a.qscale);
            if (two) {
                const float2 y = q1[p];
                qb[j] = make_float2(y.x * a.qscale, y.y * a.qscale);
            }
        }
    }
    const float ninf = __uint_as_float(0xff800000u);
    float ma = ninf, mb = ninf, la = 0.0f, lb = 0.0f;
    float2 acca[NV], accb[NV];
#pragma unroll
    for (int j = 0; j < NV; j++) acca[j] = accb[j] = make_float2(0.0f, 0.0f);

    // Rows four at a time, the next four's loads in flight while this four is computed.
    u32 ka[MLA1_ROWS][NJ], kb[MLA1_ROWS][NJ];
    int r0 = r_begin;
    mla1_load<NJ>(ka, a, r0, r_end, lane);
    while (r0 < r_end) {
        const int r1 = r0 + MLA1_ROWS;
        if (r1 < r_end) mla1_load<NJ>(kb, a, r1, r_end, lane);
        mla1_step<NJ, NV>(ka, r0, r_end, lane, qa, qb, ma, mb, la, lb, acca, accb);
        if (r1 >= r_end) break;
        const int r2 = r1 + MLA1_ROWS;
        if (r2 < r_end) mla1_load<NJ>(ka, a, r2, r_end, lane);
        mla1_step<NJ, NV>(kb, r1, r_end, lane, qa, qb, ma, mb, la, lb, acca, accb);
        r0 = r2;
    }

    // Results. Columns 2p, 2p+1 for p = lane + 32j < half_lat.
    const int latent = 2 * a.half_lat;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        if (hh == 1 && !two) break;
        const int h = h0 + hh;
        const float m = hh ? mb : ma, l = hh ? lb : la;
        const float2* acc = hh ? accb : acca;
        if (a.n_splits == 1) {
            const float inv = 1.0f / l;
            float2* o = reinterpret_cast<float2*>(a.out + (long long)h * latent);
#pragma unroll
            for (int j = 0; j < NV; j++) {
                const int p = lane + 32 * j;
                if (p < a.half_lat) o[p] = make_float2(acc[j].x * inv, acc[j].y * inv);
            }
        } else {
            const long long gq = (long long)split * a.heads + h;
            float2* o = reinterpret_cast<float2*>(a.ws_o + gq * latent);
#pragma unroll
            for (int j = 0; j < NV; j++) {
                const int p = lane + 32 * j;
                if (p < a.half_lat) o[p] = acc[j];
            }
            if (lane == 0) {
                a.ws_ml[gq * 2] = m * MLA1_LN2;
                a.ws_ml[gq * 2 + 1] = l;
            }
        }
    }
}

// One entry point per (query/key pair chunks NJ = ceil(row / 64), value chunks NV = ceil(latent / 64)).
#define MLA1_KERNEL(NAME, NJ, NV) \
    extern "C" __global__ void __launch_bounds__(MLA1_THREADS) NAME(MlaT1Args a) { mla_decode_t1_body<NJ, NV>(a); }

MLA1_KERNEL(mla_decode_t1_j9_v8, 9, 8)  // DeepSeek-V2/V3: latent 512, rope 64
MLA1_KERNEL(mla_decode_t1_j2_v1, 2, 1)  // the tiny oracle fixtures: latent 64, rope 16
