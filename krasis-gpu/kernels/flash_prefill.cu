// Causal prefill attention, flash style: online softmax over key tiles, f32 statistics, O(T) memory
// (no score matrix is ever stored).
//
//   score(i, s) = scale * (q_a[i,h] . k_a[s,g] + q_b[i,h] . k_b[s,g]),   g = h / (heads / kv_heads)
//   out[i,h]    = sum_{s <= q_start + i} softmax_s(score(i, s)) * v[s,g]
//
// Every tensor is a strided BF16 view [tokens, heads, dim]: element d of head h of token t is at
// p[t*token_stride + h*head_stride + d]; head_stride may be 0 (one vector shared by every head, e.g.
// MLA's rope key). Part b is optional (dim 0, null pointer). The output is f32 with its own strides.
// Inputs are assumed finite (a masked key's V row is still multiplied by a zero weight).
//
// Two kernels:
//   flash_prefill_simt: the correctness fallback. One warp per (query, head); lanes split the dims
//     (at most SIMT_MAX_DIM per part), one key at a time with a warp-reduced dot product and an
//     exact online softmax in f32 (expf). Any dims, any strides, any architecture.
//   flash_prefill_mma: FlashAttention-2 style on tensor cores (mma.sync m16n8k16 bf16 -> f32,
//     sm_80+). One block of 4 warps per (64-query tile, head); each warp owns 16 query rows with Q
//     fragments in registers. 64-key K/V tiles are double-buffered in shared memory (cp.async when
//     a tensor is 16-byte aligned, plain loads otherwise); dims are zero-padded to 16 in shared
//     memory, so ragged dims work. S = Q K^T and O += P V run on tensor cores; P is rounded to
//     BF16 for the second MMA (row sums use the unrounded f32 P). Tiles past the diagonal are never
//     loaded; a warp whose 16 rows see none of a tile skips it.
#include "krasis_common.cuh"

#define NEG_INF __uint_as_float(0xff800000u)
#define LOG2E 1.4426950408889634f

// ------------------------------------------------------------------------------------------ SIMT

// Dims per part the SIMT kernel supports: 8 per lane.
#define SIMT_MAX_DIM 256
#define SIMT_PER_LANE (SIMT_MAX_DIM / 32)
// Warps (= queries of one head) per block.
#define SIMT_WARPS 4

__device__ __forceinline__ void simt_load_row(float (&r)[SIMT_PER_LANE], const bf16_t* p, long long off, int dim,
                                              int lane) {
#pragma unroll
    for (int j = 0; j < SIMT_PER_LANE; ++j) {
        const int d = lane + 32 * j;
        r[j] = d < dim ? bf16_to_f32(p[off + d]) : 0.0f;
    }
}

__device__ __forceinline__ float simt_partial_dot(const float (&q)[SIMT_PER_LANE], const bf16_t* p, long long off,
                                                  int dim, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < SIMT_PER_LANE; ++j) {
        const int d = lane + 32 * j;
        if (d < dim) s += q[j] * bf16_to_f32(p[off + d]);
    }
    return s;
}

extern "C" __global__ void __launch_bounds__(SIMT_WARPS * 32)
    flash_prefill_simt(const bf16_t* __restrict__ q_a, const bf16_t* __restrict__ q_b,
                       const bf16_t* __restrict__ k_a, const bf16_t* __restrict__ k_b,
                       const bf16_t* __restrict__ v, float* __restrict__ out, int n_q, int q_start, int group,
                       float scale, int da, int db, int dv, long long qa_ts, long long qa_hs, long long qb_ts,
                       long long qb_hs, long long ka_ts, long long ka_hs, long long kb_ts, long long kb_hs,
                       long long v_ts, long long v_hs, long long o_ts, long long o_hs) {
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
    for (int s = 0; s <= last; ++s) {
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
            const float vv = d < dv ? bf16_to_f32(v[vo + d]) : 0.0f;
            acc[j] = acc[j] * alpha + p * vv;
        }
        m = m_new;
    }
    const float inv = 1.0f / l;
#pragma unroll
    for (int j = 0; j < SIMT_PER_LANE; ++j) {
        const int d = lane + 32 * j;
        if (d < dv) out[i * o_ts + h * o_hs + d] = acc[j] * inv;
    }
}

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

// Four 8x8 b16 matrices from shared memory, transposed: lanes 8j..8j+7 give the row addresses of
// matrix j; register j of lane l gets (M_j[2(l%4)][l/4], M_j[2(l%4)+1][l/4]).
__device__ __forceinline__ void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p))
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

#endif  // __CUDA_ARCH__ >= 800

// Dynamic shared memory: two buffers, each K [64][ldk] then V [64][ldv] (bf16), ldk = qk_pad + 8,
// ldv = v_pad + 8. Q is staged through buffer 1's K rows before the loop.
extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)
    flash_prefill_mma(const bf16_t* __restrict__ q_a, const bf16_t* __restrict__ q_b,
                      const bf16_t* __restrict__ k_a, const bf16_t* __restrict__ k_b,
                      const bf16_t* __restrict__ v, float* __restrict__ out, int n_q, int n_kv, int q_start,
                      int group, float scale, int da, int db, int dv, long long qa_ts, long long qa_hs,
                      long long qb_ts, long long qb_hs, long long ka_ts, long long ka_hs, long long kb_ts,
                      long long kb_hs, long long v_ts, long long v_hs, long long o_ts, long long o_hs,
                      int vec_mask) {
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

    const bool vqa = vec_mask & VEC_QA, vqb = vec_mask & VEC_QB, vka = vec_mask & VEC_KA, vkb = vec_mask & VEC_KB,
               vvv = vec_mask & VEC_V;

    // Q tile -> buffer 1 (K rows), key tile 0 -> buffer 0.
    stage_part(kbuf1, ldk, 0, q_a, qa_ts, qa_hs, h, da, da_pad, q0, n_q, vqa);
    if (db > 0) stage_part(kbuf1, ldk, da_pad, q_b, qb_ts, qb_hs, h, db, db_pad, q0, n_q, vqb);
    stage_part(kbuf0, ldk, 0, k_a, ka_ts, ka_hs, g, da, da_pad, 0, n_kv, vka);
    if (db > 0) stage_part(kbuf0, ldk, da_pad, k_b, kb_ts, kb_hs, g, db, db_pad, 0, n_kv, vkb);
    stage_part(kbuf0 + MMA_BK * ldk, ldv, 0, v, v_ts, v_hs, g, dv, dv_pad, 0, n_kv, vvv);
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
    // Row statistics for rows gr and gr+8 of this warp (max in the log2 domain; l is this thread's
    // partial sum over its columns, reduced over the quad at the end).
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    const float scale_log2 = scale * LOG2E;
    const int lim0 = q_start + w0 + gr, lim1 = lim0 + 8;  // last visible key of each row
    const int warp_lim = q_start + w0 + 15;               // last key any row of this warp sees

    for (int t = 0; t < n_tiles; ++t) {
        // Prefetch tile t+1 into the other buffer (freed by the barrier ending iteration t-1).
        if (t + 1 < n_tiles) {
            bf16_t* nb = ((t + 1) & 1) ? kbuf1 : kbuf0;
            const int kb1 = (t + 1) * MMA_BK;
            stage_part(nb, ldk, 0, k_a, ka_ts, ka_hs, g, da, da_pad, kb1, n_kv, vka);
            if (db > 0) stage_part(nb, ldk, da_pad, k_b, kb_ts, kb_hs, g, db, db_pad, kb1, n_kv, vkb);
            stage_part(nb + MMA_BK * ldk, ldv, 0, v, v_ts, v_hs, g, dv, dv_pad, kb1, n_kv, vvv);
        }
        cp_async_commit();  // possibly empty group: keeps the wait count uniform
        cp_async_wait<1>();  // tile t has landed (for this thread's copies) ...
        __syncthreads();    // ... and for everyone's

        const int kb = t * MMA_BK;
        const bf16_t* ks = (t & 1) ? kbuf1 : kbuf0;
        const bf16_t* vs = ks + MMA_BK * ldk;

        if (kb <= warp_lim) {
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
            // Scale to the log2 domain and mask keys past each row's position.
            const bool need_mask = kb + MMA_BK - 1 > q_start + w0;
            float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                const int key = kb + n * 8 + 2 * tq;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = s[n][e] * scale_log2;
                    if (need_mask) {
                        const int kk = key + (e & 1);
                        if (kk > ((e < 2) ? lim0 : lim1)) x = NEG_INF;
                    }
                    s[n][e] = x;
                }
                mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
                mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
            }
            // The 4 threads of a quad hold one row's 64 columns.
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            // A row with no visible key yet keeps max -inf; subtract 0 then so no -inf - -inf NaN.
            const float base0 = mn0 == NEG_INF ? 0.0f : mn0, base1 = mn1 == NEG_INF ? 0.0f : mn1;
            const float alpha0 = exp2f(m0 - base0), alpha1 = exp2f(m1 - base1);
            m0 = mn0;
            m1 = mn1;
            float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                s[n][0] = exp2f(s[n][0] - base0);
                s[n][1] = exp2f(s[n][1] - base0);
                s[n][2] = exp2f(s[n][2] - base1);
                s[n][3] = exp2f(s[n][3] - base1);
                rs0 += s[n][0] + s[n][1];
                rs1 += s[n][2] + s[n][3];
            }
            l0 = l0 * alpha0 + rs0;
            l1 = l1 * alpha1 + rs1;
#pragma unroll
            for (int j = 0; j < MMA_V_TILES; ++j) {
                o[j][0] *= alpha0;
                o[j][1] *= alpha0;
                o[j][2] *= alpha1;
                o[j][3] *= alpha1;
            }
            // O += P V. The S accumulators of n-tiles 2k and 2k+1 are exactly the A fragment of
            // k-step k (keys 16k..16k+15).
#pragma unroll
            for (int k2 = 0; k2 < MMA_BK / 16; ++k2) {
                u32 pa[4];
                pa[0] = pack_bf16x2(s[2 * k2][0], s[2 * k2][1]);
                pa[1] = pack_bf16x2(s[2 * k2][2], s[2 * k2][3]);
                pa[2] = pack_bf16x2(s[2 * k2 + 1][0], s[2 * k2 + 1][1]);
                pa[3] = pack_bf16x2(s[2 * k2 + 1][2], s[2 * k2 + 1][3]);
                // Lane l addresses row (key) 16k2 + (l&7) + 8*((l>>3)&1), columns (dims) 16j + 8*(l>>4):
                // matrices 0/1 = keys +0/+8 of dims 16j..+7, matrices 2/3 = the same of dims 16j+8..+15.
                const bf16_t* vrow = vs + (k2 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ldv + ((lane >> 4) << 3);
#pragma unroll
                for (int j = 0; j < MMA_V_TILES / 2; ++j) {
                    if (2 * j < v_tiles) {
                        u32 b0, b1, b2, b3;
                        ldmatrix_x4_trans(b0, b1, b2, b3, vrow + j * 16);
                        mma_bf16(o[2 * j], pa, b0, b1);
                        mma_bf16(o[2 * j + 1], pa, b2, b3);
                    }
                }
            }
        }
        __syncthreads();  // everyone is done with this buffer before iteration t+1 refills it
    }
    cp_async_wait<0>();

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
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
