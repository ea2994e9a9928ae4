// Causal prefill attention, flash style: online softmax over key tiles, f32 statistics, O(T) memory
// (no score matrix is ever stored).
//
//   score(i, s) = scale * (q_a[i,h] . k_a[s,g] + q_b[i,h] . k_b[s,g]),   g = h / (heads / kv_heads)
//   out[i,h]    = sum_{s <= q_start + i} softmax_s(score(i, s)) * v[s,g]
//
// Every tensor is a strided BF16 (flash_prefill_simt_f32: f32) view [tokens, heads, dim]: element d
// of head h of token t is at p[t*token_stride + h*head_stride + d]; head_stride may be 0 (one
// vector shared by every head, e.g. MLA's rope key). Part b is optional (dim 0, null pointer). The
// output is f32 with its own strides. Inputs are assumed finite (a masked key's V row is still
// multiplied by a zero weight).
//
// The kernels:
//   flash_prefill_simt: the correctness fallback. One warp per (query, head); lanes split the dims
//     (at most SIMT_MAX_DIM per part), one key at a time with a warp-reduced dot product and an
//     exact online softmax in f32 (expf). Any dims, any strides, any architecture.
//     flash_prefill_simt_f32 is the same kernel over f32 q, k and v (the precise GPU mode).
//   flash_prefill_mma: FlashAttention-2 style on tensor cores (mma.sync m16n8k16 bf16 -> f32,
//     sm_80+). One block of 4 warps per (64-query tile, head); each warp owns 16 query rows with Q
//     fragments in registers. 64-key K/V tiles are double-buffered in shared memory (cp.async when
//     a tensor is 16-byte aligned, plain loads otherwise); dims are zero-padded to 16 in shared
//     memory, so ragged dims work. S = Q K^T and O += P V run on tensor cores; P is rounded to
//     BF16 for the second MMA (row sums use the unrounded f32 P). Tiles past the diagonal are never
//     loaded; a warp whose 16 rows see none of a tile skips it. The scale must be positive: it is
//     folded into the exp2 (one FFMA + ex2.approx per score), as in the kernel below.
//   flash_prefill_fixed_<A>_<B>_<V>: the same mathematics with the head dims fixed at compile time
//     (A, B, V: multiples of 16; smaller multiples of 8 are zero-filled), for 16-byte-aligned
//     tensors and a positive scale. One block of 8 warps per (128-query tile, head), three-stage
//     cp.async K/V pipeline with one barrier per key tile, Q/K/V fragments through ldmatrix. Every
//     copy address is a shift and a multiply-add, not the runtime division the generic kernel pays
//     per chunk. The mask, the online softmax and P V are the generic kernel's (shared helpers).
//
// Options (gpt-oss), the same in every kernel: `window` > 0 is a sliding window (query i sees keys
// q_start + i - window < s <= q_start + i; keys below it are masked like those past the diagonal,
// a block starts at the key tile of its first query's first visible key (no earlier tile is
// staged), and a warp skips the products of a later tile none of its rows sees),
// `sinks` (BF16 [heads], or null) one sink logit per head: one more softmax column that joins the
// denominator where the output is normalised, e^(sink - m), and adds nothing to the output.
//
// Two NVRTC programs share this file (flash_prefill.rs): the wgmma kernels (sm_90a, below;
// -DFLASH_WGMMA) and the others (no macro), so they compile in parallel.
#include "krasis_common.cuh"

#define NEG_INF __uint_as_float(0xff800000u)
#define LOG2E 1.4426950408889634f

// ------------------------------------------------------------------------------------------ SIMT

// Dims per part the SIMT kernel supports: 8 per lane.
#define SIMT_MAX_DIM 256
#define SIMT_PER_LANE (SIMT_MAX_DIM / 32)
// Warps (= queries of one head) per block.
#define SIMT_WARPS 4

template <typename T>
__device__ __forceinline__ void simt_load_row(float (&r)[SIMT_PER_LANE], const T* p, long long off, int dim,
                                              int lane) {
#pragma unroll
    for (int j = 0; j < SIMT_PER_LANE; ++j) {
        const int d = lane + 32 * j;
        r[j] = d < dim ? load_f(p, off + d) : 0.0f;
    }
}

template <typename T>
__device__ __forceinline__ float simt_partial_dot(const float (&q)[SIMT_PER_LANE], const T* p, long long off,
                                                  int dim, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < SIMT_PER_LANE; ++j) {
        const int d = lane + 32 * j;
        if (d < dim) s += q[j] * load_f(p, off + d);
    }
    return s;
}

#ifndef FLASH_WGMMA
// T: the element type of q, k and v (BF16, or f32 for the precise GPU mode: the same kernel, no
// rounding of its inputs).
template <typename T>
__device__ __forceinline__ void flash_prefill_simt_body(
    const T* __restrict__ q_a, const T* __restrict__ q_b, const T* __restrict__ k_a, const T* __restrict__ k_b,
    const T* __restrict__ v, float* __restrict__ out, int n_q, int q_start, int group, float scale, int da, int db,
    int dv, long long qa_ts, long long qa_hs, long long qb_ts, long long qb_hs, long long ka_ts, long long ka_hs,
    long long kb_ts, long long kb_hs, long long v_ts, long long v_hs, long long o_ts, long long o_hs, int window,
    const bf16_t* __restrict__ sinks) {
    const int lane = threadIdx.x & 31;
    const int i = blockIdx.x * SIMT_WARPS + (threadIdx.x >> 5);
    const int h = blockIdx.y;
    if (i >= n_q) return;  // whole warps only; no block barrier below
    const int g = h / group;

    float qa[SIMT_PER_LANE], qb[SIMT_PER_LANE], acc[SIMT_PER_LANE];
    simt_load_row(qa, q_a, i * qa_ts + h * qa_hs, da, lane);
    if (db > 0) {
        simt_load_row(qb, q_b, i * qb_ts + h * qb_hs, db, lane);
    } else {
#pragma unroll
        for (int j = 0; j < SIMT_PER_LANE; ++j) qb[j] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < SIMT_PER_LANE; ++j) acc[j] = 0.0f;

    float m = NEG_INF, l = 0.0f;
    const int last = q_start + i;
    const int first = window > 0 ? max(0, last - window + 1) : 0;
    for (int s = first; s <= last; ++s) {
        float part = simt_partial_dot(qa, k_a, s * ka_ts + g * ka_hs, da, lane);
        if (db > 0) part += simt_partial_dot(qb, k_b, s * kb_ts + g * kb_hs, db, lane);
        const float x = warp_sum(part) * scale;  // identical in every lane
        const float m_new = fmaxf(m, x);
        const float alpha = expf(m - m_new);  // 0 on the first key (m = -inf)
        const float p = expf(x - m_new);
        l = l * alpha + p;
        const long long vo = s * v_ts + g * v_hs;
#pragma unroll
        for (int j = 0; j < SIMT_PER_LANE; ++j) {
            const int d = lane + 32 * j;
            const float vv = d < dv ? load_f(v, vo + d) : 0.0f;
            acc[j] = acc[j] * alpha + p * vv;
        }
        m = m_new;
    }
    float inv = 1.0f / l;
    if (sinks) {  // the sink's column: e^(sink - m') joins the sum, m' = max(m, sink)
        const float sk = bf16_to_f32(sinks[h]);
        const float mm = fmaxf(m, sk);
        const float c = expf(m - mm);
        inv = c / (l * c + expf(sk - mm));
    }
#pragma unroll
    for (int j = 0; j < SIMT_PER_LANE; ++j) {
        const int d = lane + 32 * j;
        if (d < dv) out[i * o_ts + h * o_hs + d] = acc[j] * inv;
    }
}

#define KRASIS_FLASH_SIMT(NAME, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(SIMT_WARPS * 32)                                                  \
        NAME(const T* q_a, const T* q_b, const T* k_a, const T* k_b, const T* v, float* out, int n_q, int q_start, \
             int group, float scale, int da, int db, int dv, long long qa_ts, long long qa_hs, long long qb_ts,    \
             long long qb_hs, long long ka_ts, long long ka_hs, long long kb_ts, long long kb_hs, long long v_ts,  \
             long long v_hs, long long o_ts, long long o_hs, int window, const bf16_t* sinks) {                    \
        flash_prefill_simt_body<T>(q_a, q_b, k_a, k_b, v, out, n_q, q_start, group, scale, da, db, dv, qa_ts,      \
                                   qa_hs, qb_ts, qb_hs, ka_ts, ka_hs, kb_ts, kb_hs, v_ts, v_hs, o_ts, o_hs, window, \
                                   sinks);                                                                         \
    }
KRASIS_FLASH_SIMT(flash_prefill_simt, bf16_t)
KRASIS_FLASH_SIMT(flash_prefill_simt_f32, float)
#endif

// ------------------------------------------------------------------------------------------ MMA

// Query rows per block (4 warps x 16 rows) and keys per tile. Equal on purpose: Q is staged through
// a K buffer.
#define MMA_BQ 64
#define MMA_BK 64
#define MMA_WARPS 4
// Padded (to 16) q.k dim and v dim the register arrays hold: qk <= 256 (16 k-steps), v <= 128
// (16 n-tiles of 8). Q fragments 64 + O 64 + S 32 registers per thread.
#define MMA_MAX_QK 256
#define MMA_MAX_V 128
#define MMA_QK_STEPS (MMA_MAX_QK / 16)
#define MMA_V_TILES (MMA_MAX_V / 8)
// Shared-memory rows are padded by 8 elements (16 bytes): with a multiple-of-16 dim the pitch is an
// odd number of 16-byte units, so the 8 rows one fragment load (or one ldmatrix) touches fall in 8
// different 4-bank groups (no bank conflicts), and ldmatrix rows stay 16-byte aligned.
#define MMA_ROW_PAD 8

// Bit k of `vec_mask`: tensor k (0 q_a, 1 q_b, 2 k_a, 3 k_b, 4 v) may be copied in 16-byte chunks
// (pointer 16-byte aligned, dim and strides multiples of 8 elements), checked on the host.
#define VEC_QA 1
#define VEC_QB 2
#define VEC_KA 4
#define VEC_KB 8
#define VEC_V 16

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

// Two floats -> packed bf16x2 (round to nearest even); `lo` lands in bits 0..15. cvt.rn.bf16x2.f32
// puts its FIRST source in the upper half, hence %2, %1.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %2, %1;\n" : "=r"(r) : "f"(lo), "f"(hi));
    return r;
}

// Four 8x8 b16 matrices from shared memory, transposed (the twin of krasis_common.cuh's
// ldmatrix_x4): lanes 8j..8j+7 give the shared-space row addresses of matrix j; register j of
// lane l gets (M_j[2(l%4)][l/4], M_j[2(l%4)+1][l/4]).
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");  // reads shared memory written by other threads before a barrier
}

// Stages MMA_BK rows (tokens tok0..tok0+63 of head `head`) of one part into shared memory at column
// col0 of rows with pitch `ld`, zero-filled up to `dpad` columns and for tokens >= tok_end.
__device__ __forceinline__ void stage_part(bf16_t* sm, int ld, int col0, const bf16_t* __restrict__ p,
                                           long long ts, long long hs, int head, int dim, int dpad, int tok0,
                                           int tok_end, bool vec) {
    const int tid = threadIdx.x;
    const long long hoff = (long long)head * hs;
    if (vec) {
        const int chunks = dpad >> 3;  // 8 elements = 16 bytes; dim % 8 == 0, so a chunk is all in or all out
        for (int c = tid; c < MMA_BK * chunks; c += MMA_WARPS * 32) {
            const int r = c / chunks, d = (c - r * chunks) << 3;
            const int tok = tok0 + r;
            const bool ok = tok < tok_end && d < dim;
            const bf16_t* src = ok ? p + (long long)tok * ts + hoff + d : p;
            cp_async16(sm + r * ld + col0 + d, src, ok ? 16 : 0);
        }
    } else {
        for (int e = tid; e < MMA_BK * dpad; e += MMA_WARPS * 32) {
            const int r = e / dpad, d = e - r * dpad;
            const int tok = tok0 + r;
            sm[r * ld + col0 + d] = (tok < tok_end && d < dim) ? p[(long long)tok * ts + hoff + d] : (bf16_t)0;
        }
    }
}

// 2^x, approximate (2 ulp), denormals flushed; 2^-inf = 0.
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// The per-tile steps every MMA kernel shares. One warp holds a 16-row x 8·NT-key tile (64 keys
// for the mma.sync kernels) of raw scores s[n][e] (n-tile n = keys 8n..8n+7; e 0/1: row gr, keys
// 2tq, 2tq+1; e 2/3: row gr+8), rows gr / gr+8 of its O accumulator, and their running max m
// (scaled log2 domain) and partial sum l.

// Sets scores of keys past each row's last visible key (lim0 for row gr, lim1 for row gr+8), and
// of keys before its first (lo0, lo1: a sliding window; <= 0 without one), to -inf; kb is the
// tile's first key.
template <int NT>
__device__ __forceinline__ void mask_tile(float (&s)[NT][4], int kb, int tq, int lim0, int lim1, int lo0, int lo1) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int key = kb + n * 8 + 2 * tq;
        if (key > lim0 || key < lo0) s[n][0] = NEG_INF;
        if (key + 1 > lim0 || key + 1 < lo0) s[n][1] = NEG_INF;
        if (key > lim1 || key < lo1) s[n][2] = NEG_INF;
        if (key + 1 > lim1 || key + 1 < lo1) s[n][3] = NEG_INF;
    }
}

// The first visible key of a row whose last is `lim` (a sliding window of `window` > 0 keys), or 0.
__device__ __forceinline__ int window_lo(int lim, int window) { return window > 0 ? lim - window + 1 : 0; }

// The head's sink logit in the scaled log2 domain of the MMA kernels' row maxima, or -inf.
__device__ __forceinline__ float sink_log2(const bf16_t* sinks, int h) {
    return sinks ? bf16_to_f32(sinks[h]) * LOG2E : NEG_INF;
}

// Lazy rescaling: a row keeps its exponent base (its running max) until a tile's max exceeds it
// by more than this (log2 domain), so p <= 2^8 meanwhile; O and l are rescaled only then (and
// only when some row of the warp moved). The result is the same up to rounding: out = O / l with
// one base for both, and P's BF16 rounding is relative.
#define RESCALE_SLACK 8.0f

// Online softmax over one tile: s becomes p = 2^(s * scale_log2 - base) (one FFMA + ex2 each;
// the scale is positive, so max(s) * scale = max(s * scale)), the base m (scaled log2 domain) and
// the partial sums l are updated, and O is rescaled by 2^(m_old - m_new) when a base moves. A row
// with no visible key yet keeps base -inf and subtracts 0 (no NaN).
template <int NT, int V_TILES>
__device__ __forceinline__ void softmax_tile(float (&s)[NT][4], float (&o)[V_TILES][4], float& m0, float& m1,
                                             float& l0, float& l1, float scale_log2) {
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
        mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    // The 4 threads of a quad hold one row's columns.
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = mx0 * scale_log2, mn1 = mx1 * scale_log2;
    const bool up0 = mn0 > m0 + RESCALE_SLACK, up1 = mn1 > m1 + RESCALE_SLACK;  // false for -inf
    if (__any_sync(0xffffffffu, up0 || up1)) {
        const float alpha0 = up0 ? ex2_approx(m0 - mn0) : 1.0f;  // 0 on a row's first max
        const float alpha1 = up1 ? ex2_approx(m1 - mn1) : 1.0f;
        m0 = up0 ? mn0 : m0;
        m1 = up1 ? mn1 : m1;
        l0 *= alpha0;
        l1 *= alpha1;
#pragma unroll
        for (int j = 0; j < V_TILES; ++j) {
            o[j][0] *= alpha0;
            o[j][1] *= alpha0;
            o[j][2] *= alpha1;
            o[j][3] *= alpha1;
        }
    }
    const float base0 = m0 == NEG_INF ? 0.0f : m0, base1 = m1 == NEG_INF ? 0.0f : m1;
    float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        s[n][0] = ex2_approx(fmaf(s[n][0], scale_log2, -base0));
        s[n][1] = ex2_approx(fmaf(s[n][1], scale_log2, -base0));
        s[n][2] = ex2_approx(fmaf(s[n][2], scale_log2, -base1));
        s[n][3] = ex2_approx(fmaf(s[n][3], scale_log2, -base1));
        rs0 += s[n][0] + s[n][1];
        rs1 += s[n][2] + s[n][3];
    }
    l0 += rs0;
    l1 += rs1;
}

// P of keys 16·k2 .. 16·k2 + 15 (n-tiles 2·k2, 2·k2 + 1 of the probabilities in s) rounded to
// BF16: exactly the A fragment of the P·V product's k step k2 (m16n8k16 and wgmma alike).
template <int NT>
__device__ __forceinline__ void p_fragment(const float (&s)[NT][4], int k2, u32 (&pa)[4]) {
    pa[0] = pack_bf16x2(s[2 * k2][0], s[2 * k2][1]);
    pa[1] = pack_bf16x2(s[2 * k2][2], s[2 * k2][3]);
    pa[2] = pack_bf16x2(s[2 * k2 + 1][0], s[2 * k2 + 1][1]);
    pa[3] = pack_bf16x2(s[2 * k2 + 1][2], s[2 * k2 + 1][3]);
}

// 1 / the softmax denominator of a row with base m (scaled log2 domain) and sum l, with the sink
// column sk (same domain; -inf: none): 2^(m - m') / (l 2^(m - m') + 2^(sk - m')), m' = max(m, sk).
__device__ __forceinline__ float row_inverse(float m, float l, float sk) {
    if (sk == NEG_INF) return 1.0f / l;
    const float mm = fmaxf(m, sk);
    const float c = m == NEG_INF ? 0.0f : ex2_approx(m - mm);
    return c / (l * c + ex2_approx(sk - mm));
}

// 1 / the row sums of rows gr and gr+8, from this thread's partial sums (summed over the quad) and
// the rows' bases m0, m1, with the sink column sk (see row_inverse).
__device__ __forceinline__ void row_inverses(float l0, float l1, float m0, float m1, float sk, float& inv0,
                                             float& inv1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    inv0 = row_inverse(m0, l0, sk);
    inv1 = row_inverse(m1, l1, sk);
}

// O += P V for one tile: p (from softmax_tile) rounded to BF16; the accumulators of n-tiles 2k,
// 2k+1 are exactly the A fragment of keys 16k..16k+15. V is the tile's [64][ldv] rows at shared
// address vs; v_lane is this lane's ldmatrix offset (bytes) for keys (l&7) + 8((l>>3)&1), dims
// 8(l>>4). Only the first v_tiles n-tiles of 8 dims are computed (v_tiles = V_TILES folds away).
template <int V_TILES>
__device__ __forceinline__ void pv_tile(float (&o)[V_TILES][4], const float (&s)[8][4], u32 vs, u32 v_lane, int ldv,
                                        int v_tiles) {
#pragma unroll
    for (int k2 = 0; k2 < 4; ++k2) {
        u32 pa[4];
        p_fragment(s, k2, pa);
#pragma unroll
        for (int j = 0; j < V_TILES / 2; ++j) {
            if (2 * j < v_tiles) {
                u32 b[4];
                ldmatrix_x4_trans(b, vs + v_lane + (u32)(k2 * 16 * ldv + j * 16) * 2u);
                mma_bf16(o[2 * j], pa, b[0], b[1]);
                mma_bf16(o[2 * j + 1], pa, b[2], b[3]);
            }
        }
    }
}

#endif  // __CUDA_ARCH__ >= 800

// Dynamic shared memory: two buffers, each K [64][ldk] then V [64][ldv] (bf16), ldk = qk_pad + 8,
// ldv = v_pad + 8. Q is staged through buffer 1's K rows before the loop.
#ifndef FLASH_WGMMA
extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)
    flash_prefill_mma(const bf16_t* __restrict__ q_a, const bf16_t* __restrict__ q_b,
                      const bf16_t* __restrict__ k_a, const bf16_t* __restrict__ k_b,
                      const bf16_t* __restrict__ v, float* __restrict__ out, int n_q, int n_kv, int q_start,
                      int group, float scale, int da, int db, int dv, long long qa_ts, long long qa_hs,
                      long long qb_ts, long long qb_hs, long long ka_ts, long long ka_hs, long long kb_ts,
                      long long kb_hs, long long v_ts, long long v_hs, long long o_ts, long long o_hs,
                      int vec_mask, int window, const bf16_t* __restrict__ sinks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_t* smem = (bf16_t*)smem_raw;

    const int da_pad = (da + 15) & ~15, db_pad = (db + 15) & ~15, dv_pad = (dv + 15) & ~15;
    const int qk_pad = da_pad + db_pad;
    const int qk_steps = qk_pad >> 4, v_tiles = dv_pad >> 3;
    const int ldk = qk_pad + MMA_ROW_PAD, ldv = dv_pad + MMA_ROW_PAD;
    const int buf_elems = MMA_BK * (ldk + ldv);
    bf16_t* const kbuf0 = smem;
    bf16_t* const kbuf1 = smem + buf_elems;

    // Heaviest query tiles (most keys) first, for load balance under causality.
    const int q0 = (gridDim.x - 1 - blockIdx.x) * MMA_BQ;
    const int h = blockIdx.y;
    const int g = h / group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gr = lane >> 2, tq = lane & 3;  // fragment row group and thread-in-group
    const int w0 = q0 + warp * 16;            // first query row of this warp

    // Last key any row of this block sees, and the number of key tiles.
    const int q_last = min(q0 + MMA_BQ, n_q) - 1;
    const int key_end = min(q_start + q_last + 1, n_kv);
    const int n_tiles = (key_end + MMA_BK - 1) / MMA_BK;
    // The first key tile any row of the block sees (0 without a window); buffers alternate from it.
    const int t0 = window > 0 ? max(0, q_start + q0 - window + 1) / MMA_BK : 0;

    const bool vqa = vec_mask & VEC_QA, vqb = vec_mask & VEC_QB, vka = vec_mask & VEC_KA, vkb = vec_mask & VEC_KB,
               vvv = vec_mask & VEC_V;

    // Q tile -> buffer 1 (K rows), key tile t0 -> buffer 0.
    stage_part(kbuf1, ldk, 0, q_a, qa_ts, qa_hs, h, da, da_pad, q0, n_q, vqa);
    if (db > 0) stage_part(kbuf1, ldk, da_pad, q_b, qb_ts, qb_hs, h, db, db_pad, q0, n_q, vqb);
    const int kb0 = t0 * MMA_BK;
    stage_part(kbuf0, ldk, 0, k_a, ka_ts, ka_hs, g, da, da_pad, kb0, n_kv, vka);
    if (db > 0) stage_part(kbuf0, ldk, da_pad, k_b, kb_ts, kb_hs, g, db, db_pad, kb0, n_kv, vkb);
    stage_part(kbuf0 + MMA_BK * ldk, ldv, 0, v, v_ts, v_hs, g, dv, dv_pad, kb0, n_kv, vvv);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    u32 qf[MMA_QK_STEPS][4];
#pragma unroll
    for (int kk = 0; kk < MMA_QK_STEPS; ++kk) {
        if (kk < qk_steps) {
            const bf16_t* r0 = kbuf1 + (warp * 16 + gr) * ldk + kk * 16 + 2 * tq;
            const bf16_t* r8 = r0 + 8 * ldk;
            qf[kk][0] = *(const u32*)r0;
            qf[kk][1] = *(const u32*)r8;
            qf[kk][2] = *(const u32*)(r0 + 8);
            qf[kk][3] = *(const u32*)(r8 + 8);
        } else {
            qf[kk][0] = qf[kk][1] = qf[kk][2] = qf[kk][3] = 0u;
        }
    }
    __syncthreads();  // buffer 1 is reused for key tile 1

    float o[MMA_V_TILES][4];
#pragma unroll
    for (int j = 0; j < MMA_V_TILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    // Row statistics for rows gr and gr+8 of this warp (max in the scaled log2 domain; l is this
    // thread's partial sum over its columns, reduced over the quad at the end).
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    const float scale_log2 = scale * LOG2E;
    const int lim0 = q_start + w0 + gr, lim1 = lim0 + 8;  // last visible key of each row
    const int lo0 = window_lo(lim0, window), lo1 = window_lo(lim1, window);  // first visible key
    const int warp_lim = q_start + w0 + 15;               // last key any row of this warp sees
    const int warp_lo = window_lo(q_start + w0, window);  // first key any row of this warp sees
    const int warp_lo_max = window_lo(warp_lim, window);  // keys below it are hidden from some row
    const u32 v_lane = (u32)(((lane & 7) + ((lane >> 3) & 1) * 8) * ldv + ((lane >> 4) << 3)) * 2u;

    for (int t = t0; t < n_tiles; ++t) {
        // Prefetch tile t+1 into the other buffer (freed by the barrier ending iteration t-1).
        if (t + 1 < n_tiles) {
            bf16_t* nb = ((t + 1 - t0) & 1) ? kbuf1 : kbuf0;
            const int kb1 = (t + 1) * MMA_BK;
            stage_part(nb, ldk, 0, k_a, ka_ts, ka_hs, g, da, da_pad, kb1, n_kv, vka);
            if (db > 0) stage_part(nb, ldk, da_pad, k_b, kb_ts, kb_hs, g, db, db_pad, kb1, n_kv, vkb);
            stage_part(nb + MMA_BK * ldk, ldv, 0, v, v_ts, v_hs, g, dv, dv_pad, kb1, n_kv, vvv);
        }
        cp_async_commit();  // possibly empty group: keeps the wait count uniform
        cp_async_wait<1>();  // tile t has landed (for this thread's copies) ...
        __syncthreads();    // ... and for everyone's

        const int kb = t * MMA_BK;
        const bf16_t* ks = ((t - t0) & 1) ? kbuf1 : kbuf0;
        const bf16_t* vs = ks + MMA_BK * ldk;

        if (kb <= warp_lim && kb + MMA_BK - 1 >= warp_lo) {
            // S = Q K^T for 16 rows x 64 keys: 8 n-tiles of 8 keys.
            float s[8][4];
#pragma unroll
            for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < MMA_QK_STEPS; ++kk) {
                if (kk < qk_steps) {
#pragma unroll
                    for (int n = 0; n < 8; ++n) {
                        const bf16_t* kp = ks + (n * 8 + gr) * ldk + kk * 16 + 2 * tq;
                        mma_bf16(s[n], qf[kk], *(const u32*)kp, *(const u32*)(kp + 8));
                    }
                }
            }
            if (kb + MMA_BK - 1 > q_start + w0 || kb < warp_lo_max) mask_tile(s, kb, tq, lim0, lim1, lo0, lo1);
            softmax_tile(s, o, m0, m1, l0, l1, scale_log2);
            pv_tile(o, s, smem_addr(vs), v_lane, ldv, v_tiles);
        }
        __syncthreads();  // everyone is done with this buffer before iteration t+1 refills it
    }
    cp_async_wait<0>();

    float inv0, inv1;
    row_inverses(l0, l1, m0, m1, sink_log2(sinks, h), inv0, inv1);
    const int i0 = w0 + gr, i1 = i0 + 8;
#pragma unroll
    for (int j = 0; j < MMA_V_TILES; ++j) {
        const int d = j * 8 + 2 * tq;
        if (d < dv) {
            if (i0 < n_q) {
                float* p = out + i0 * o_ts + h * o_hs + d;
                p[0] = o[j][0] * inv0;
                if (d + 1 < dv) p[1] = o[j][1] * inv0;
            }
            if (i1 < n_q) {
                float* p = out + i1 * o_ts + h * o_hs + d;
                p[0] = o[j][2] * inv1;
                if (d + 1 < dv) p[1] = o[j][3] * inv1;
            }
        }
    }
#else
    // The host never launches this kernel below sm_80 (no bf16 mma.sync there).
    __trap();
#endif
}
#endif

// ------------------------------------------------------------------------------------------ fixed dims

// The arguments of the fixed-dims and wgmma kernels, in the order flash_prefill.rs's
// launch_tiles passes them: pointers, shapes, dims, then (token, head) strides in elements.
#define FLASH_TILE_PARAMS                                                                                     \
    const bf16_t *__restrict__ q_a, const bf16_t *__restrict__ q_b, const bf16_t *__restrict__ k_a,          \
        const bf16_t *__restrict__ k_b, const bf16_t *__restrict__ v, float *__restrict__ out, int n_q,      \
        int n_kv, int q_start, int group, float scale, int da, int db, int dv, long long qa_ts,              \
        long long qa_hs, long long qb_ts, long long qb_hs, long long ka_ts, long long ka_hs, long long kb_ts, \
        long long kb_hs, long long v_ts, long long v_hs, long long o_ts, long long o_hs, int window,          \
        const bf16_t *__restrict__ sinks
#define FLASH_TILE_ARGS                                                                                       \
    q_a, q_b, k_a, k_b, v, out, n_q, n_kv, q_start, group, scale, da, db, dv, qa_ts, qa_hs, qb_ts, qb_hs,    \
        ka_ts, ka_hs, kb_ts, kb_hs, v_ts, v_hs, o_ts, o_hs, window, sinks

// 8 warps x 16 query rows per block; 64-key tiles; three K/V stages in flight.
#define FIX_WARPS 8
#define FIX_THREADS (FIX_WARPS * 32)
#define FIX_BQ (FIX_WARPS * 16)
#define FIX_BK 64
#define FIX_STAGES 3

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

// One part (DPAD columns, compile time, a multiple of 8) of ROWS-token tiles copied to shared
// memory with pitch LD, all in 16-byte cp.async chunks. Thread `tid` always copies column
// d = 8 (tid % CH) of rows tid / CH + i * RSTEP, so everything but the tile's first token is worked
// out once: a copy is one 64-bit add and one compare. Tokens >= tok_end and columns >= dim are
// zero-filled.
template <int ROWS, int DPAD, int LD>
struct FixPart {
    static constexpr int CH = DPAD > 0 ? DPAD / 8 : 1;  // DPAD 0 (no part b) copies nothing
    static constexpr int RSTEP = FIX_THREADS / CH;
    static constexpr int N = DPAD > 0 ? ROWS / RSTEP : 0;
    static_assert(DPAD == 0 || (FIX_THREADS % CH == 0 && ROWS % (FIX_THREADS / CH) == 0), "whole rows per pass");
    const bf16_t* thr;  // this thread's first chunk of token 0
    long long ts;
    int r0;             // this thread's first row
    bool col_ok;        // d < dim

    __device__ __forceinline__ FixPart(const bf16_t* p, long long ts_, long long hoff, int dim)
        : ts(ts_), r0(threadIdx.x / CH) {
        const int d = (threadIdx.x % CH) * 8;
        col_ok = d < dim;
        thr = p + hoff + d + (long long)r0 * ts_;
    }
    // Copies tokens tok0.. to shared address dst (row 0, the part's first column).
    __device__ __forceinline__ void copy(u32 dst, int tok0, int tok_end) const {
        const int left = tok_end - tok0 - r0;  // rows r0 + i*RSTEP < left exist
        const bf16_t* src = thr + (long long)tok0 * ts;
        const long long step = (long long)RSTEP * ts;
        const u32 d0 = dst + (u32)(r0 * LD + (threadIdx.x % CH) * 8) * 2u;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const bool ok = col_ok && i * RSTEP < left;
            cp_async16_at(d0 + (u32)(i * RSTEP * LD) * 2u, ok ? src : thr, ok ? 16 : 0);
            src += step;
        }
    }
};

__device__ __forceinline__ void st_global_f32x2(float* p, float a, float b) {
    asm volatile("st.global.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
}

// O / l of rows i0 and i0 + 8 (with the sink column sk, see row_inverse; this thread's columns
// 8j + 2tq, + 1 of each n-tile j) to the f32
// output in 8-byte stores; rows past n_q and columns past dv (a multiple of 8, so d < dv implies
// d + 1 < dv) are skipped.
template <int V_TILES>
__device__ __forceinline__ void store_rows(const float (&o)[V_TILES][4], float l0, float l1, float m0, float m1,
                                           float sk, float* __restrict__ out, int i0, int n_q, int dv, int tq, int h,
                                           long long o_ts, long long o_hs) {
    float inv0, inv1;
    row_inverses(l0, l1, m0, m1, sk, inv0, inv1);
    const int i1 = i0 + 8;
#pragma unroll
    for (int j = 0; j < V_TILES; ++j) {
        const int d = j * 8 + 2 * tq;
        if (d < dv) {
            if (i0 < n_q) st_global_f32x2(out + i0 * o_ts + h * o_hs + d, o[j][0] * inv0, o[j][1] * inv0);
            if (i1 < n_q) st_global_f32x2(out + i1 * o_ts + h * o_hs + d, o[j][2] * inv1, o[j][3] * inv1);
        }
    }
}

#endif  // __CUDA_ARCH__ >= 800

// Shared memory (bytes): Q [128][A+B+8], then FIX_STAGES x (K [64][A+B+8], V [64][V+8]), BF16.
// Grid: (heads, query tiles); query tiles run heaviest (most keys) first across all heads.
template <int DA, int DB, int DV>
__device__ __forceinline__ void flash_prefill_fixed(FLASH_TILE_PARAMS) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int QK = DA + DB, LDK = QK + MMA_ROW_PAD, LDV = DV + MMA_ROW_PAD;
    constexpr int QK_STEPS = QK / 16, V_TILES = DV / 8;
    constexpr int K_ELEMS = FIX_BK * LDK, STAGE_ELEMS = FIX_BK * (LDK + LDV);
    static_assert(DA % 16 == 0 && DB % 16 == 0 && DV % 16 == 0, "dims are multiples of 16");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 sq = smem_addr(smem_raw);
    const u32 sk0 = sq + (u32)(FIX_BQ * LDK) * 2u;

    const int h = blockIdx.x;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * FIX_BQ;
    const int g = h / group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gr = lane >> 2, tq = lane & 3;
    const int w0 = q0 + warp * 16;

    const int q_last = min(q0 + FIX_BQ, n_q) - 1;
    const int key_end = min(q_start + q_last + 1, n_kv);
    const int n_tiles = (key_end + FIX_BK - 1) / FIX_BK;
    // The first key tile any row of the block sees (0 without a window); stages rotate from it.
    const int t0 = window > 0 ? max(0, q_start + q0 - window + 1) / FIX_BK : 0;

    const long long qa_h = (long long)h * qa_hs, qb_h = (long long)h * qb_hs;
    const long long ka_h = (long long)g * ka_hs, kb_h = (long long)g * kb_hs, v_h = (long long)g * v_hs;

    const FixPart<FIX_BK, DA, LDK> ka_part(k_a, ka_ts, ka_h, da);
    const FixPart<FIX_BK, DB, LDK> kb_part(k_b, kb_ts, kb_h, db);
    const FixPart<FIX_BK, DV, LDV> v_part(v, v_ts, v_h, dv);
    // Key tile t -> stage `slot`.
    auto stage_tile = [&](int t, int slot) {
        const u32 base = sk0 + (u32)(slot * STAGE_ELEMS) * 2u;
        const int kb0 = t * FIX_BK;
        ka_part.copy(base, kb0, n_kv);
        kb_part.copy(base + DA * 2, kb0, n_kv);
        v_part.copy(base + K_ELEMS * 2, kb0, n_kv);
    };

    // Group 0: Q and key tile t0; group 1: key tile t0 + 1 (maybe empty).
    FixPart<FIX_BQ, DA, LDK>(q_a, qa_ts, qa_h, da).copy(sq, q0, n_q);
    FixPart<FIX_BQ, DB, LDK>(q_b, qb_ts, qb_h, db).copy(sq + DA * 2, q0, n_q);
    stage_tile(t0, 0);
    cp_async_commit();
    if (n_tiles > t0 + 1) stage_tile(t0 + 1, 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    // Q fragments of this warp's 16 rows: matrices (rows +0/+8) x (columns +0/+8).
    u32 qf[QK_STEPS][4];
    {
        const u32 qaddr = sq + (u32)((warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDK + (lane >> 4) * 8) * 2u;
#pragma unroll
        for (int kk = 0; kk < QK_STEPS; ++kk) ldmatrix_x4(qf[kk], qaddr + kk * 32);
    }

    float o[V_TILES][4];
#pragma unroll
    for (int j = 0; j < V_TILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    // Row statistics of rows gr and gr+8 (max in the scaled log2 domain; l per thread, reduced
    // over the quad at the end).
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    const float scale_log2 = scale * LOG2E;
    const int lim0 = q_start + w0 + gr, lim1 = lim0 + 8;
    const int lo0 = window_lo(lim0, window), lo1 = window_lo(lim1, window);  // first visible key
    const int warp_lim = w0 < n_q ? q_start + w0 + 15 : -1;  // a warp past the end computes nothing
    const int warp_lo = window_lo(q_start + w0, window);     // first key any row of this warp sees
    const int warp_lo_max = window_lo(q_start + w0 + 15, window);
    // ldmatrix row offsets: K (non-transposed) keys (l&7) + 8(l>>4), dims 8((l>>3)&1); V
    // (transposed) keys (l&7) + 8((l>>3)&1), dims 8(l>>4).
    const u32 k_lane = (u32)(((lane & 7) + ((lane >> 4) << 3)) * LDK + ((lane >> 3) & 1) * 8) * 2u;
    const u32 v_lane = (u32)(((lane & 7) + ((lane >> 3) & 1) * 8) * LDV + ((lane >> 4) << 3)) * 2u;

    int slot = 0;
    for (int t = t0; t < n_tiles; ++t) {
        if (t > t0) {
            cp_async_wait<1>();  // tile t has landed for this thread's copies ...
            __syncthreads();    // ... and everyone's; and everyone is done with tile t-1's stage
        }
        if (t + 2 < n_tiles) stage_tile(t + 2, slot == 0 ? 2 : slot - 1);  // (t+2) % 3 = (t-1) % 3
        cp_async_commit();

        const int kb = t * FIX_BK;
        const u32 ks = sk0 + (u32)(slot * STAGE_ELEMS) * 2u;
        const u32 vs = ks + K_ELEMS * 2;
        slot = slot == FIX_STAGES - 1 ? 0 : slot + 1;
        if (kb > warp_lim || kb + FIX_BK - 1 < warp_lo) continue;

        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < QK_STEPS; ++kk) {
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                u32 b[4];
                ldmatrix_x4(b, ks + k_lane + (u32)(np * 16 * LDK + kk * 16) * 2u);
                mma_bf16(s[2 * np], qf[kk], b[0], b[1]);
                mma_bf16(s[2 * np + 1], qf[kk], b[2], b[3]);
            }
        }
        if (kb + FIX_BK - 1 > q_start + w0 || kb < warp_lo_max) mask_tile(s, kb, tq, lim0, lim1, lo0, lo1);
        softmax_tile(s, o, m0, m1, l0, l1, scale_log2);
        pv_tile(o, s, vs, v_lane, LDV, V_TILES);
    }
    cp_async_wait<0>();

    store_rows(o, l0, l1, m0, m1, sink_log2(sinks, h), out, w0 + gr, n_q, dv, tq, h, o_ts, o_hs);
#else
    __trap();
#endif
}

#define FLASH_FIXED_ENTRY(DA, DB, DV)                                                                        \
    extern "C" __global__ void __launch_bounds__(FIX_THREADS, 1)                                             \
        flash_prefill_fixed_##DA##_##DB##_##DV(FLASH_TILE_PARAMS) {                                          \
        flash_prefill_fixed<DA, DB, DV>(FLASH_TILE_ARGS);                                                    \
    }

// MLA as DeepSeek V2/V3 have it (nope 128 + rope 64, v 128) and GQA with 128-wide heads. The host
// table FIXED_SHAPES lists the same three numbers.
#ifndef FLASH_WGMMA
FLASH_FIXED_ENTRY(128, 64, 128)
FLASH_FIXED_ENTRY(128, 0, 128)
#endif

// ------------------------------------------------------------------------------------------ wgmma (sm_90a)
//
// flash_prefill_wgmma_<A>_<B>_<V>: the fixed-dims kernel's mathematics on Hopper's asynchronous
// warpgroup MMAs. One block of two warpgroups (8 warps) per (128-query tile, head); each warpgroup
// owns 64 query rows, whose Q fragments it loads into registers once (or, Q_SMEM, leaves in shared
// memory). Per key tile (BK keys) a warpgroup issues S = Q K^T as (A+B)/16 x BK/64 wgmma m64n64k16
// with Q from registers (or (A+B)/16 m64nBKk16 with Q from shared memory) and K from shared memory,
// waits, masks and runs the online softmax on S in registers (the accumulator layout of a warp's
// 16 rows is the m16n8 one, so the helpers above serve unchanged), and issues O += P V as BK/16
// m64n128k16 (P from registers, V from shared memory). It does not wait for P V: that product runs
// while the next tile's barrier and S are issued. The two warpgroups issue their S in turn
// (warpgroup 1 after warpgroup 0, through a named barrier), so one's softmax overlaps the other's
// products. K/V tiles stream through STAGES shared-memory stages with cp.async (all 256 threads),
// one block barrier per tile. A warpgroup whose rows end before a tile's keys leaves the product
// loop; the loop itself has no path around a product (a path around one would make the compiler
// copy accumulators while a product is in flight, which serialises every wgmma).
//
// Q is staged unswizzled (column block j of row r at byte (j*R + r)*16, read once by ldmatrix)
// or, Q_SMEM, in the swizzle; K and V use wgmma's 128-byte swizzle (64-column atoms, rows of 128
// bytes with the 16-byte chunk index XORed by the row's low three bits), which the tensor cores
// read without bank conflicts.

#define WG_THREADS 256
#define WG_BQ 128

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The 64-bit wgmma shared-memory matrix descriptor for the 128-byte swizzle: start address,
// "leading" and "stride" byte offsets (16-byte units), layout type 1 (128B swizzle) in bits 62-63.
// With this swizzle, K-major operands ignore the leading offset and step 1024 bytes (8 rows) with
// the stride; MN-major ones step between 64-element atoms with the leading offset and between
// 8-row groups along K with the stride.
__device__ __forceinline__ u64 wgmma_desc_sw128(u32 addr, u32 lead_bytes, u32 stride_bytes) {
    return (u64)((addr & 0x3ffffu) >> 4) | ((u64)((lead_bytes >> 4) & 0x3fffu) << 16) |
           ((u64)((stride_bytes >> 4) & 0x3fffu) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed wgmma groups of this warpgroup are in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes shared-memory writes of this thread (cp.async included) visible to the async proxy that
// wgmma reads through; precedes the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The accumulator operands of an m64nN product: N/2 f32 registers per thread (%0 ..), bound to
// d[N/8][4] in order.
#define WG_ACC32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_ACC32_OUT(d) \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
    "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
    "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
// N = 128: the N = 64 operands, then the next 32.
#define WG_ACC64 \
    WG_ACC32 ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_ACC64_OUT(d) \
    WG_ACC32_OUT(d), \
    "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
    "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
    "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
    "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])

// d[64 x N] (= or +=) A[64 x 16] · B[16 x N], N = 64 or 128, A and B K-major in shared memory.
// Otherwise as wgmma_rs.
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        WG_ACC32
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC32_OUT(d)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d)
        : "memory");
}

__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[16][4], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        WG_ACC64
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC64_OUT(d)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d)
        : "memory");
}

template <int NT>
__device__ __forceinline__ void wgmma_ss(float (&d)[NT][4], u64 desc_a, u64 desc_b, int scale_d) {
    static_assert(NT == 8 || NT == 16, "N is 64 or 128");
    if constexpr (NT == 8) {
        wgmma_m64n64k16_ss(d, desc_a, desc_b, scale_d);
    } else {
        wgmma_m64n128k16_ss(d, desc_a, desc_b, scale_d);
    }
}

// Named barrier 1 over the block's 256 threads: one warpgroup arrives, the other waits (orders
// the two warpgroups' S products on the tensor cores).
__device__ __forceinline__ void wg_bar_arrive() { asm volatile("bar.arrive 1, %0;\n" ::"n"(WG_THREADS) : "memory"); }
__device__ __forceinline__ void wg_bar_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(WG_THREADS) : "memory"); }

// Keeps registers that an in-flight wgmma reads or writes where they are: the compiler sees them
// read and rewritten here, so it can neither reuse them early nor move them across this point.
template <int N, int E>
__device__ __forceinline__ void keep_regs(float (&r)[N][E]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < E; ++e) asm volatile("" : "+f"(r[i][e])::"memory");
}
template <int N, int E>
__device__ __forceinline__ void keep_regs(u32 (&r)[N][E]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < E; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}

// d[64 x N] (= or +=) A[64 x 16] · B[16 x N], N = 64 or 128: A from registers (each warp's 16 rows
// as the m16n8k16 A fragment), B in shared memory, K-major (TRANS_B 0) or N-major (TRANS_B 1).
// BF16 in, f32 accumulators; scale_d 0 overwrites d. Issued asynchronously for the whole
// warpgroup (every thread of it must call it); the result is there after wgmma_wait, and `a`
// must stay live until then.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[8][4], const u32 (&a)[4], u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        WG_ACC32
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : WG_ACC32_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B)
        : "memory");
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[16][4], const u32 (&a)[4], u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        WG_ACC64
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : WG_ACC64_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B)
        : "memory");
}

// The product above for an 8·NT-wide accumulator.
template <int TRANS_B, int NT>
__device__ __forceinline__ void wgmma_rs(float (&d)[NT][4], const u32 (&a)[4], u64 desc_b, int scale_d) {
    static_assert(NT == 8 || NT == 16, "N is 64 or 128");
    if constexpr (NT == 8) {
        wgmma_m64n64k16_rs<TRANS_B>(d, a, desc_b, scale_d);
    } else {
        wgmma_m64n128k16_rs<TRANS_B>(d, a, desc_b, scale_d);
    }
}

// One part (DPAD columns, a multiple of 32; 0 = no part) of an R-row token tile copied at column
// block j0 (8 columns a block), in 16-byte cp.async chunks: warp w copies units w, w + 8, ... of
// 8 rows x 4 column blocks. Tokens >= tok_end and columns >= dim are zero-filled. Layouts:
//   SW128 false (unswizzled, read by ldmatrix): block j of row r at byte (j*R + r)*16.
//   SW128 true (wgmma's 128-byte swizzle): 64-column atoms of R rows x 128 bytes, block j of row r
//     at (j/8)*R*128 + r*128 + ((j%8) ^ (r%8))*16; the tile must start 1024-byte aligned.
// Either way a unit's 32 chunks cover each bank once per column block (no conflicts).
template <int R, int DPAD, bool SW128>
__device__ __forceinline__ void wg_copy_part(u32 tile, int j0, const bf16_t* __restrict__ p, long long ts,
                                             long long hoff, int dim, int tok0, int tok_end) {
    if constexpr (DPAD > 0) {
        static_assert(DPAD % 32 == 0 && R % 8 == 0, "whole 8-row x 4-block units");
        constexpr int ROW_UNITS = R / 8, UNITS = ROW_UNITS * (DPAD / 32);
        static_assert(UNITS % (WG_THREADS / 32) == 0, "the same number of units per warp");
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
        for (int i = 0; i < UNITS / (WG_THREADS / 32); ++i) {
            const int u = warp + i * (WG_THREADS / 32);
            const int row = (u % ROW_UNITS) * 8 + (lane & 7);
            const int j = (u / ROW_UNITS) * 4 + (lane >> 3);
            const int tok = tok0 + row;
            const bool ok = tok < tok_end && j * 8 < dim;
            const bf16_t* src = ok ? p + (long long)tok * ts + hoff + j * 8 : p;
            const int jb = j0 + j;
            const u32 off = SW128 ? (u32)((jb >> 3) * R * 128 + row * 128 + (((jb & 7) ^ (row & 7)) << 4))
                                  : (u32)((jb * R + row) * 16);
            cp_async16_at(tile + off, src, ok ? 16 : 0);
        }
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Shared memory (bytes): up to 1023 bytes to align, Q [128 rows][A+B] unswizzled, then STAGES x
// (K [BK][A+B], V [BK][V]) in the 128-byte swizzle, BF16. Grid: (heads, query tiles), heaviest
// query tiles first. BK keys per tile (64 or 128: the N of S), STAGES K/V stages (STAGES - 2
// copied ahead of the tile in use, one kept for the P V product still in flight).
template <int DA, int DB, int DV, int BK, int STAGES, bool Q_SMEM>
__device__ __forceinline__ void flash_prefill_wgmma(FLASH_TILE_PARAMS) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int QK = DA + DB, QK_STEPS = QK / 16, V_TILES = DV / 8, KT = BK / 8, AHEAD = STAGES - 2;
    static_assert(DV == 128, "P V is one m64n128 product per 16 keys (smaller v dims are zero-filled)");
    static_assert(BK == 64 || BK == 128, "S is one m64n64 or m64n128 product per 16 dims");
    static_assert(AHEAD >= 1, "at least one tile copied ahead");
    static_assert(QK % 64 == 0, "K rows are whole 64-column swizzle atoms");
    constexpr u32 Q_BYTES = WG_BQ * QK * 2, K_BYTES = BK * QK * 2, STAGE_BYTES = K_BYTES + BK * DV * 2;
    static_assert(Q_BYTES % 1024 == 0 && K_BYTES % 1024 == 0 && STAGE_BYTES % 1024 == 0, "swizzle atoms aligned");
    extern __shared__ __align__(128) unsigned char wg_smem[];
    const u32 sq = (smem_addr(wg_smem) + 1023u) & ~1023u;
    const u32 sk0 = sq + Q_BYTES;

    const int h = blockIdx.x;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * WG_BQ;
    const int g = h / group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wg = warp >> 2;
    const int gr = lane >> 2, tq = lane & 3;
    const int g0 = q0 + wg * 64;          // this warpgroup's first query
    const int w0 = g0 + (warp & 3) * 16;  // this warp's first query

    const int q_last = min(q0 + WG_BQ, n_q) - 1;
    const int key_end = min(q_start + q_last + 1, n_kv);
    const int n_tiles = (key_end + BK - 1) / BK;
    // The first key tile any row of the block sees (0 without a window).
    const int t0 = window > 0 ? max(0, q_start + q0 - window + 1) / BK : 0;

    const long long qa_h = (long long)h * qa_hs, qb_h = (long long)h * qb_hs;
    const long long ka_h = (long long)g * ka_hs, kb_h = (long long)g * kb_hs, v_h = (long long)g * v_hs;
    auto stage_tile = [&](int t) {
        const u32 base = sk0 + (u32)(t % STAGES) * STAGE_BYTES;
        const int kb0 = t * BK;
        wg_copy_part<BK, DA, true>(base, 0, k_a, ka_ts, ka_h, da, kb0, n_kv);
        wg_copy_part<BK, DB, true>(base, DA / 8, k_b, kb_ts, kb_h, db, kb0, n_kv);
        wg_copy_part<BK, DV, true>(base + K_BYTES, 0, v, v_ts, v_h, dv, kb0, n_kv);
    };

    // Groups: Q with key tile t0, then tiles t0 + 1 .. t0 + AHEAD-1 (maybe empty).
    wg_copy_part<WG_BQ, DA, Q_SMEM>(sq, 0, q_a, qa_ts, qa_h, da, q0, n_q);
    wg_copy_part<WG_BQ, DB, Q_SMEM>(sq, DA / 8, q_b, qb_ts, qb_h, db, q0, n_q);
    stage_tile(t0);
    cp_async_commit();
#pragma unroll
    for (int i = 1; i < AHEAD; ++i) {
        if (t0 + i < n_tiles) stage_tile(t0 + i);
        cp_async_commit();
    }

    // Q fragments of this warp's 16 rows, once: the A operand of every S product (unless Q_SMEM:
    // then the products read Q from shared memory, in the swizzle).
    u32 qf[Q_SMEM ? 1 : QK_STEPS][4];
    cp_async_wait<AHEAD - 1>();
    __syncthreads();
    if constexpr (!Q_SMEM) {
        const int row = wg * 64 + (warp & 3) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int kk = 0; kk < QK_STEPS; ++kk)
            ldmatrix_x4(qf[kk], sq + (u32)(((2 * kk + (lane >> 4)) * WG_BQ + row) * 16));
    }

    float o[V_TILES][4];
#pragma unroll
    for (int j = 0; j < V_TILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float s[KT][4];
    u32 pa[KT / 2][4];
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    const float scale_log2 = scale * LOG2E;
    const int lim0 = q_start + w0 + gr, lim1 = lim0 + 8;
    const int lo0 = window_lo(lim0, window), lo1 = window_lo(lim1, window);  // first visible key
    const int warp_lo_max = window_lo(q_start + w0 + 15, window);
    // The warpgroup's last visible key (wgmma is collective: skip decisions are per warpgroup).
    const int group_lim = g0 < n_q ? q_start + g0 + 63 : -1;

    // Tile t has landed for this thread's copies; the fence and the barrier publish it to the
    // async proxy and every thread. Past the barrier every warpgroup has waited for its products
    // of tile t - 2 and older (P V of tile t - 1 may still run), so tile t + AHEAD takes tile
    // t - 2's stage.
    auto next_tile = [&](int t) {
        cp_async_wait<AHEAD - 1>();
        fence_proxy_async();
        __syncthreads();
        if (t + AHEAD < n_tiles) stage_tile(t + AHEAD);
        cp_async_commit();
    };
    // Tiles this warpgroup computes: those up to its last row's diagonal. The loop has no path
    // around its products, so the accumulators never need copying while a product is in flight.
    const int my_tiles = min(n_tiles, (group_lim + BK) / BK);
    // Tile t's S = Q K^T into s; warpgroup 1 issues after warpgroup 0 (see below).
    auto issue_s = [&](int t) {
        const u32 ks = sk0 + (u32)(t % STAGES) * STAGE_BYTES;
        // K's dims in 64-column atoms of BK rows x 128 bytes, 32 bytes per 16 dims.
#pragma unroll
        for (int kk = 0; kk < QK_STEPS; ++kk) {
            const u32 k_at = ks + (u32)((kk >> 2) * BK * 128 + (kk & 3) * 32);
            if constexpr (Q_SMEM) {
                // Q likewise, this warpgroup's 64 rows 8 KiB into each 128-row atom.
                const u32 q_at = sq + (u32)((kk >> 2) * WG_BQ * 128 + wg * 64 * 128 + (kk & 3) * 32);
                wgmma_ss(s, wgmma_desc_sw128(q_at, 16, 1024), wgmma_desc_sw128(k_at, 16, 1024), kk > 0);
            } else {
                // Keys in m64n64 products of 64 rows (8 KiB of each atom) each: one m64n128
                // product per 16 dims read wrong keys from the second tile on (H200, 128-key
                // tiles), two m64n64 do not.
#pragma unroll
                for (int nh = 0; nh < BK / 64; ++nh)
                    wgmma_rs<0>(*reinterpret_cast<float(*)[8][4]>(&s[nh * 8][0]), qf[kk],
                                wgmma_desc_sw128(k_at + (u32)(nh * 8192), 16, 1024), kk > 0);
            }
        }
    };
    // O += P V of tile t (P in pa).
    auto issue_pv = [&](int t) {
        const u32 vs = sk0 + (u32)(t % STAGES) * STAGE_BYTES + K_BYTES;
        // V [BK keys][128 dims], N-major: two 64-dim atoms BK*128 bytes apart (leading), 8-key
        // groups 1024 bytes apart (stride); 16 keys = 2048 bytes a step.
#pragma unroll
        for (int k2 = 0; k2 < KT / 2; ++k2)
            wgmma_rs<1>(o, pa[k2], wgmma_desc_sw128(vs + (u32)(k2 * 2048), BK * 128, 1024), 1);
    };
    // Tile t's scores (landed in s) to P in pa: mask, online softmax (O rescaled: no product
    // writes it now), P's fragments in BF16.
    auto scores_to_p = [&](int t) {
        const int kb = t * BK;
        if (kb + BK - 1 > q_start + w0 || kb < warp_lo_max) mask_tile(s, kb, tq, lim0, lim1, lo0, lo1);
        softmax_tile(s, o, m0, m1, l0, l1, scale_log2);
#pragma unroll
        for (int k2 = 0; k2 < KT / 2; ++k2) p_fragment(s, k2, pa[k2]);
    };

    // Per tile: S issued and waited for (which also retires the previous tile's P V), softmax,
    // then P V issued and left running into the next tile's barrier and S. Warpgroup 1 issues
    // its S after warpgroup 0's, so the tensor cores finish warpgroup 0's first and its softmax
    // overlaps warpgroup 1's product (and the other way round for P V). Every tile, warpgroup 0
    // arrives once and warpgroup 1 waits once, computing or not. (Issuing tile t's S together with
    // tile t - 1's P V and overlapping the softmax with the latter measured slower on the H200.)
    int t = t0;
    for (; t < my_tiles; ++t) {
        next_tile(t);
        if (wg == 1) wg_bar_sync();
        wgmma_fence();
        issue_s(t);
        wgmma_commit();
        if (wg == 0) wg_bar_arrive();
        wgmma_wait<0>();  // S of this tile, and the previous tile's O += P V
        keep_regs(s);
        keep_regs(o);
        keep_regs(pa);
        scores_to_p(t);
        wgmma_fence();
        issue_pv(t);
        wgmma_commit();
    }
    wgmma_wait<0>();  // nothing may read a stage after this warpgroup stops waiting
    keep_regs(o);
    keep_regs(pa);
    // The other warpgroup's remaining tiles: copies, barriers and the turn order only.
    for (; t < n_tiles; ++t) {
        next_tile(t);
        if (wg == 1) wg_bar_sync();
        if (wg == 0) wg_bar_arrive();
    }
    cp_async_wait<0>();

    store_rows(o, l0, l1, m0, m1, sink_log2(sinks, h), out, w0 + gr, n_q, dv, tq, h, o_ts, o_hs);
#else
    __trap();
#endif
}

#define FLASH_WGMMA_ENTRY(DA, DB, DV, BK, STAGES, Q_SMEM)                                                    \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)                                              \
        flash_prefill_wgmma_##DA##_##DB##_##DV(FLASH_TILE_PARAMS) {                                          \
        flash_prefill_wgmma<DA, DB, DV, BK, STAGES, Q_SMEM>(FLASH_TILE_ARGS);                                \
    }

// MLA: 64-key tiles in four stages (128-key ones would need 80 KiB a stage), Q in registers.
// GQA: 128-key tiles in three stages with Q in shared memory: one m64n128 S product per 16 dims
// runs nearer the tensor cores' peak (H200, 8K: 41.4 % of the peak against 38.1 % with 64-key
// tiles and Q in registers; MLA the other way round, 41.7 % against 41.1 %). The host table
// WGMMA_TILES lists the same numbers.
#ifdef FLASH_WGMMA
FLASH_WGMMA_ENTRY(128, 64, 128, 64, 4, false)
FLASH_WGMMA_ENTRY(128, 0, 128, 128, 3, true)
#endif
