// Rotary position embedding applied in place from precomputed tables (the host computes them,
// YaRN frequency correction and attention scaling included):
//   cos_t, sin_t: f32 [max_pos, rot_dim/2]; pair i of a head rotates by angle (pos, i).
// x holds n_tokens x n_heads heads; element j of head h of token t is at
//   x[t*token_stride + h*head_stride + rot_offset + j],   0 <= j < rot_dim,
// so a partial rotary slice (DeepSeek's qk_rope_head_dim at the end of each head) is covered.
// Pairing: interleaved = (2i, 2i+1) (DeepSeek, GPT-J style); halves = (i, i + rot_dim/2) (Llama/Qwen,
// HF rotate_half). Both: a' = a*cos - b*sin, b' = b*cos + a*sin.
// A position outside [0, max_pos) writes NaN into the rotated slice (loud); the host checks positions.
// Launch: grid = n_tokens, blockDim = heads * rot_dim/2 rounded up to a warp, within 32..=512, so
// a token's pairs are one per thread (the loop strides only past 512 pairs).
#include "krasis_common.cuh"

// Token t's pairs, strided over the block's threads.
template <typename T>
__device__ __forceinline__ void rope_token(T* __restrict__ x, int t, const int* __restrict__ positions,
                                           const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                           int n_heads, long long token_stride, long long head_stride, int rot_offset,
                                           int rot_dim, int interleaved, int max_pos) {
    const int half = rot_dim >> 1;
    const int pos = positions[t];
    const bool ok = pos >= 0 && pos < max_pos;
    const float* ct = cos_t + (long long)(ok ? pos : 0) * half;
    const float* st = sin_t + (long long)(ok ? pos : 0) * half;
    const int work = n_heads * half;
    for (int k = threadIdx.x; k < work; k += blockDim.x) {
        const int h = k / half, i = k - h * half;
        const long long base = (long long)t * token_stride + (long long)h * head_stride + rot_offset;
        const long long ia = base + (interleaved ? 2 * i : i);
        const long long ib = base + (interleaved ? 2 * i + 1 : i + half);
        if (!ok) {
            store_f(x, ia, krasis_nan());
            store_f(x, ib, krasis_nan());
            continue;
        }
        const float c = ct[i], s = st[i];
        const float a = load_f(x, ia), b = load_f(x, ib);
        store_f(x, ia, a * c - b * s);
        store_f(x, ib, b * c + a * s);
    }
}

template <typename T>
__device__ __forceinline__ void rope_body(T* __restrict__ x, const int* __restrict__ positions,
                                          const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                          int n_tokens, int n_heads, long long token_stride, long long head_stride,
                                          int rot_offset, int rot_dim, int interleaved, int max_pos) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    rope_token(x, t, positions, cos_t, sin_t, n_heads, token_stride, head_stride, rot_offset, rot_dim, interleaved,
               max_pos);
}

extern "C" __global__ void rope_f32(float* x, const int* positions, const float* cos_t, const float* sin_t,
                                    int n_tokens, int n_heads, long long token_stride, long long head_stride,
                                    int rot_offset, int rot_dim, int interleaved, int max_pos) {
    rope_body(x, positions, cos_t, sin_t, n_tokens, n_heads, token_stride, head_stride, rot_offset, rot_dim,
              interleaved, max_pos);
}

extern "C" __global__ void rope_bf16(bf16_t* x, const int* positions, const float* cos_t, const float* sin_t,
                                     int n_tokens, int n_heads, long long token_stride, long long head_stride,
                                     int rot_offset, int rot_dim, int interleaved, int max_pos) {
    rope_body(x, positions, cos_t, sin_t, n_tokens, n_heads, token_stride, head_stride, rot_offset, rot_dim,
              interleaved, max_pos);
}

// MLA's per-token preparation in one launch: RoPE on the rope slice of each of q's heads, RoPE on
// the rope slice of the kv_a row, and RMSNorm (weight w, norm_n elements from the row's start) of
// the row's latent part: what rope_f32 (twice) and rmsnorm_strided_inplace do, with the same f32
// operations per element. The three touch disjoint elements, so no barrier orders them. With
// kv_out (the first of the call's rows in a BF16 KV cache plane, rows of kv_row elements), the
// finished kv rows are also written there, token t at row t (what kv_write_bf16 would do, one
// launch fewer).
// Launch: grid = n_tokens, RMS_NORM_THREADS (a multiple of 32, for block_sum) threads.
extern "C" __global__ void mla_rope_norm(float* q, long long q_ts, long long q_hs, int q_heads, int q_off, float* kv,
                                         long long kv_ts, int kv_off, const bf16_t* w, int norm_n, float eps,
                                         const int* positions, const float* cos_t, const float* sin_t, int n_tokens,
                                         int rot_dim, int interleaved, int max_pos, bf16_t* kv_out,
                                         int kv_row) {
    __shared__ float scratch[32];
    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    rope_token(q, t, positions, cos_t, sin_t, q_heads, q_ts, q_hs, q_off, rot_dim, interleaved, max_pos);
    rope_token(kv, t, positions, cos_t, sin_t, 1, kv_ts, kv_ts, kv_off, rot_dim, interleaved, max_pos);
    rmsnorm_row_inplace(kv + (long long)t * kv_ts, norm_n, w, eps, scratch);
    if (kv_out) {  // the finished row into the BF16 KV cache, token t at row t
        __syncthreads();
        const float* src = kv + (long long)t * kv_ts;
        bf16_t* dst = kv_out + t * (long long)kv_row;
        for (int j = threadIdx.x; j < kv_row; j += blockDim.x) dst[j] = f32_to_bf16(src[j]);
    }
}

// GQA's per-token preparation in one launch: the biases (qb, kb, vb, all or none) added to the
// token's q, k and v rows (add_bias_rows_f32's f32 addition), RoPE on q's and k's heads
// (rope_f32's operations: rot_dim elements from the start of each head of head_dim), and, with
// k_out / v_out (row 0 of the call in a BF16 KV cache's key and value planes, rows of kv_row
// elements), k's and v's finished rows written there, token t at row t (kv_write_bf16's
// rounding): the same f32 operations per element as those launches, in the same order.
// One block per (token, head): block y < q_heads takes q's head y, block y = q_heads + g kv head
// g (its k head and its v head), so a decode token's work spreads over q_heads + kv_heads SMs
// (one block per token ran GLM-4.5-Air's 96 q heads on one SM: 27 us against the separate
// launches' 22).
// Launch: grid (n_tokens, q_heads + kv_heads), a multiple of 32 threads (head_dim rounded up).
extern "C" __global__ void gqa_prep(float* q, float* k, float* v, const bf16_t* qb, const bf16_t* kb,
                                    const bf16_t* vb, int q_heads, int kv_heads, int head_dim, const int* positions,
                                    const float* cos_t, const float* sin_t, int n_tokens, int rot_dim, int interleaved,
                                    int max_pos, bf16_t* k_out, bf16_t* v_out) {
    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();
    const int t = blockIdx.x, y = blockIdx.y;
    if (t >= n_tokens || y >= q_heads + kv_heads) return;
    const bool is_q = y < q_heads;
    const int h = is_q ? y : y - q_heads;
    const int row = (is_q ? q_heads : kv_heads) * head_dim;
    const long long at = (long long)t * row + (long long)h * head_dim;  // the head's first element
    float* x = is_q ? q : k;
    float* vh = v + at;  // kv blocks only
    if (qb) {  // the rotation pairs elements other threads add to: all additions first
        const bf16_t* b = (is_q ? qb : kb) + h * head_dim;
        for (int j = threadIdx.x; j < head_dim; j += blockDim.x) x[at + j] += bf16_to_f32(b[j]);
        if (!is_q) {
            const bf16_t* bv = vb + h * head_dim;
            for (int j = threadIdx.x; j < head_dim; j += blockDim.x) vh[j] += bf16_to_f32(bv[j]);
        }
        __syncthreads();
    }
    // This head alone: rope_token over one head of x shifted to it (token stride row).
    rope_token(x + (long long)h * head_dim, t, positions, cos_t, sin_t, 1, row, head_dim, 0, rot_dim, interleaved,
               max_pos);
    if (!is_q && k_out) {  // the finished head into the BF16 KV cache, token t at row t
        __syncthreads();
        const float* kh = k + at;
        bf16_t* kd = k_out + at;
        bf16_t* vd = v_out + at;
        for (int j = threadIdx.x; j < head_dim; j += blockDim.x) {
            kd[j] = f32_to_bf16(kh[j]);
            vd[j] = f32_to_bf16(vh[j]);
        }
    }
}
