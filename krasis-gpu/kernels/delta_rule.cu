// Gated-DeltaNet layers (Qwen3-Next, Qwen3.5) and the output gate of gated attention:
//
//   delta_conv_silu   the depthwise causal convolution of a layer's q/k/v channels, then SiLU;
//   delta_conv_state  the convolution state after it (the last kernel - 1 inputs);
//   delta_prep        q and k L2-normalised per key head (q also scaled), beta = sigmoid(b) and
//                     g = -exp(A_log) * softplus(a + dt_bias) per value head, in place;
//   delta_rule_dkN    the gated delta rule, token by token, for key dims up to N;
//   delta_gated_norm  rmsnorm(o) * w * silu(z) per value head, in place;
//   output_gate_rows_f32  y /= 1 + exp(-gate): attention's output gate (Qwen3-Next).
//
// The twins are krasis_cpu::delta_rule::recurrent_f64 and krasis_model's cpu/deltanet.rs; the
// operations are the same f32 steps, the sums in another order (the rule's over dk split over
// four threads, the L2 and RMS norms' sums of squares reduced across a warp).
//
// Sequences and their states. A call covers n_seqs sequences of rows_per_seq rows each (one
// sequence of t rows: a prompt; n sequences of one row: a batched decode step); sequence b's rows
// are b * rows_per_seq .. (b + 1) * rows_per_seq of every row-major [rows, ...] tensor. Each
// sequence keeps its state in its own device block, whose address is states[b] (a table of
// n_seqs addresses on the device); the layer's part starts `off` floats into the block:
//   conv state [kernel - 1, ch]     the last kernel - 1 inputs of the convolution, oldest first;
//   rule state [nv, dk, dv]         S of every value head, S[h][a][j] at (h * dk + a) * dv + j.
// Value head h reads key head h / (nv / nk). The conv channels of a row are [q | k | v]:
// q of key head kh at kh * dk, k at nk * dk + kh * dk, v of value head h at 2 * nk * dk + h * dv.
#include "krasis_common.cuh"

#define CONV_THREADS 128
// Output rows per thread of delta_conv_silu.
#define CONV_ROWS 16
// Largest convolution kernel (Qwen3-Next and Qwen3.5: 4).
#define CONV_MAX_K 8
// Columns of S per block of delta_rule, and threads per column (a block: 128 threads).
#define RULE_COLS 32
#define RULE_SPLIT 4
// Tokens whose q and k a delta_rule block stages in shared memory at a time.
#define RULE_TT 8

__device__ __forceinline__ float dn_silu(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float* state_of(const u64* states, int b, long long off) {
    return reinterpret_cast<float*>(states[b]) + off;
}

// out[r, c] = silu(sum_j taps[c, j] * in(r - (kernel - 1) + j)), where in(i) is x row i of the
// sequence for i >= 0 and conv state row kernel - 1 + i for i < 0. taps BF16 [ch, kernel].
// Grid (ceil(ch / 128), ceil(rows_per_seq / CONV_ROWS), n_seqs), 128 threads: a thread is one
// channel of CONV_ROWS rows. The state is only read here (delta_conv_state updates it after).
extern "C" __global__ void delta_conv_silu(const float* __restrict__ x, float* __restrict__ out,
                                           const bf16_t* __restrict__ taps, const u64* __restrict__ states,
                                           long long off, int ch, int kernel, int rows_per_seq) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= ch) return;
    const int b = blockIdx.z;
    const int r0 = blockIdx.y * CONV_ROWS;
    const int r1 = min(r0 + CONV_ROWS, rows_per_seq);
    const int keep = kernel - 1;
    const float* st = state_of(states, b, off);
    const long long base = (long long)b * rows_per_seq;
    float w[CONV_MAX_K];
#pragma unroll
    for (int j = 0; j < CONV_MAX_K; ++j) w[j] = j < kernel ? bf16_to_f32(taps[(long long)c * kernel + j]) : 0.0f;
    for (int r = r0; r < r1; ++r) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < CONV_MAX_K; ++j) {
            if (j < kernel) {
                const int i = r - keep + j;
                const float in = i >= 0 ? x[(base + i) * ch + c] : st[(long long)(keep + i) * ch + c];
                acc += w[j] * in;
            }
        }
        out[(base + r) * ch + c] = dn_silu(acc);
    }
}

// The conv state after delta_conv_silu (launched after it on the same stream): the last
// kernel - 1 rows of [state; x] of each sequence. In place and ascending, so that a row still to
// be read (index rows + r > r) is never overwritten first. Grid (ceil(ch / 128), n_seqs).
extern "C" __global__ void delta_conv_state(const float* __restrict__ x, const u64* __restrict__ states,
                                            long long off, int ch, int kernel, int rows_per_seq) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= ch) return;
    const int b = blockIdx.y;
    const int keep = kernel - 1;
    float* st = state_of(states, b, off);
    const long long base = (long long)b * rows_per_seq;
    for (int r = 0; r < keep; ++r) {
        const int e = rows_per_seq + r;  // index into [state (keep rows); x (rows_per_seq rows)]
        st[(long long)r * ch + c] = e < keep ? st[(long long)e * ch + c] : x[(base + e - keep) * ch + c];
    }
}

// Per row (one block of 128 threads): q and k of every key head L2-normalised in place,
// x * (scale / sqrt(sum x^2 + 1e-6)) with scale = q_scale for q and 1 for k, a warp per head
// vector; then per value head, in place: b_beta = sigmoid(b), a_g = -exp(A_log) * softplus(a +
// dt_bias) with torch's softplus (x > 20: x). qkv [rows, ch]; b_beta, a_g [rows, nv]; a_log,
// dt_bias BF16 [nv].
extern "C" __global__ void delta_prep(float* __restrict__ qkv, float* __restrict__ b_beta, float* __restrict__ a_g,
                                      const bf16_t* __restrict__ a_log, const bf16_t* __restrict__ dt_bias, int rows,
                                      int ch, int nk, int dk, int nv, float q_scale) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    float* row = qkv + (long long)r * ch;
    for (int v = warp; v < 2 * nk; v += nwarps) {
        float* x = row + (long long)v * dk;  // q heads then k heads
        float ss = 0.0f;
        for (int i = lane; i < dk; i += 32) ss += x[i] * x[i];
        ss = warp_sum(ss);
        const float inv = (v < nk ? q_scale : 1.0f) / sqrtf(ss + 1e-6f);
        for (int i = lane; i < dk; i += 32) x[i] *= inv;
    }
    for (int h = threadIdx.x; h < nv; h += blockDim.x) {
        const long long i = (long long)r * nv + h;
        b_beta[i] = 1.0f / (1.0f + expf(-b_beta[i]));
        const float x = a_g[i] + bf16_to_f32(dt_bias[h]);
        const float sp = x > 20.0f ? x : log1pf(expf(x));
        a_g[i] = -expf(bf16_to_f32(a_log[h])) * sp;
    }
}

// The gated delta rule per value head h, for every row of its sequence in order:
//   S <- S * exp(g);  kv = S^T k;  d = beta * (v - kv);  S <- S + k d^T;  o = S^T q.
// Grid (ceil(dv / 32), nv, n_seqs), 128 threads: a block holds 32 columns of S, four threads
// (consecutive lanes) per column j, thread `part` holding the rows a = part + 4 i (DKM / 4 floats,
// in registers; DKM >= dk, the rows past dk held at zero, which leaves every sum unchanged). A
// sum over the dk rows is each thread's own (two interleaved partial sums), then added across
// the four lanes with two xor shuffles, which gives all four the same bits. q, k and v of
// RULE_TT tokens at a time are staged in shared memory. qkv is the prepared [rows, ch]
// (delta_prep), beta and g [rows, nv], out [rows, nv * dv].
template <int DKM>
__device__ __forceinline__ void delta_rule_body(const float* __restrict__ qkv, const float* __restrict__ beta,
                                                const float* __restrict__ g, float* __restrict__ out,
                                                const u64* __restrict__ states, long long off, int ch, int nk,
                                                int nv, int dk, int dv, int rows_per_seq) {
    constexpr int RPT = DKM / RULE_SPLIT;
    __shared__ float qs[RULE_TT][DKM];
    __shared__ float ks[RULE_TT][DKM];
    __shared__ float vs[RULE_TT][RULE_COLS];
    __shared__ float eg[RULE_TT];
    __shared__ float bt[RULE_TT];
    const int b = blockIdx.z, h = blockIdx.y;
    const int col = threadIdx.x / RULE_SPLIT, part = threadIdx.x % RULE_SPLIT;
    const int j = blockIdx.x * RULE_COLS + col;
    const bool live = j < dv;
    const int kh = h / (nv / nk);
    float* S = state_of(states, b, off) + (long long)h * dk * dv;
    float s[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int a = part + RULE_SPLIT * i;
        s[i] = (live && a < dk) ? S[(long long)a * dv + j] : 0.0f;
    }
    const long long row0 = (long long)b * rows_per_seq;
    const float* qbase = qkv + (long long)kh * dk;
    const float* kbase = qkv + (long long)(nk + kh) * dk;
    const float* vbase = qkv + 2LL * nk * dk + (long long)h * dv;
    for (int t0 = 0; t0 < rows_per_seq; t0 += RULE_TT) {
        const int nt = min(RULE_TT, rows_per_seq - t0);
        __syncthreads();  // the previous tile's reads are done
        for (int i = threadIdx.x; i < nt * DKM; i += blockDim.x) {
            const int tt = i / DKM, a = i % DKM;
            const long long ro = (row0 + t0 + tt) * ch;
            qs[tt][a] = a < dk ? qbase[ro + a] : 0.0f;
            ks[tt][a] = a < dk ? kbase[ro + a] : 0.0f;
        }
        for (int tt = threadIdx.x; tt < nt; tt += blockDim.x) {
            const long long gi = (row0 + t0 + tt) * nv + h;
            eg[tt] = expf(g[gi]);
            bt[tt] = beta[gi];
        }
        if (part == 0) {
            for (int tt = 0; tt < nt; ++tt) vs[tt][col] = live ? vbase[(row0 + t0 + tt) * ch + j] : 0.0f;
        }
        __syncthreads();
        for (int tt = 0; tt < nt; ++tt) {
            const long long r = row0 + t0 + tt;
            const float decay = eg[tt];
            float kv2[2] = {0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                s[i] *= decay;
                kv2[i & 1] += s[i] * ks[tt][part + RULE_SPLIT * i];
            }
            float kv = kv2[0] + kv2[1];
            kv += __shfl_xor_sync(0xffffffffu, kv, 1);
            kv += __shfl_xor_sync(0xffffffffu, kv, 2);
            const float d = (vs[tt][col] - kv) * bt[tt];
            float o2[2] = {0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const int a = part + RULE_SPLIT * i;
                s[i] += ks[tt][a] * d;
                o2[i & 1] += s[i] * qs[tt][a];
            }
            float o = o2[0] + o2[1];
            o += __shfl_xor_sync(0xffffffffu, o, 1);
            o += __shfl_xor_sync(0xffffffffu, o, 2);
            if (live && part == 0) out[(r * nv + h) * dv + j] = o;
        }
    }
    if (live) {
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int a = part + RULE_SPLIT * i;
            if (a < dk) S[(long long)a * dv + j] = s[i];
        }
    }
}

#define DELTA_RULE_KERNEL(N)                                                                                      \
    extern "C" __global__ void delta_rule_dk##N(const float* __restrict__ qkv, const float* __restrict__ beta,   \
                                                const float* __restrict__ g, float* __restrict__ out,             \
                                                const u64* __restrict__ states, long long off, int ch, int nk,    \
                                                int nv, int dk, int dv, int rows_per_seq) {                      \
        delta_rule_body<N>(qkv, beta, g, out, states, off, ch, nk, nv, dk, dv, rows_per_seq);                     \
    }

DELTA_RULE_KERNEL(64)
DELTA_RULE_KERNEL(128)
DELTA_RULE_KERNEL(256)

// In place per vector v of n_vec (o, z [n_vec, dv] contiguous; w BF16 [dv]):
//   o = o / sqrt(mean(o^2) + eps) * w * silu(z)
// a warp per vector, 4 vectors per block of 128 threads.
extern "C" __global__ void delta_gated_norm(float* __restrict__ o, const float* __restrict__ z,
                                            const bf16_t* __restrict__ w, long long n_vec, int dv, float eps) {
    const int lane = threadIdx.x & 31;
    const long long v = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (v >= n_vec) return;
    float* x = o + v * dv;
    const float* zr = z + v * dv;
    float ss = 0.0f;
    for (int i = lane; i < dv; i += 32) ss += x[i] * x[i];
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
    for (int i = lane; i < dv; i += 32) x[i] = x[i] * inv * bf16_to_f32(w[i]) * dn_silu(zr[i]);
}

// y[r, c] /= 1 + exp(-gate[r * g_stride + c]) for y [rows, cols] contiguous (the gate pointer
// already at its first element): gated attention's output, before o_proj, as the CPU divides.
// One thread per element.
extern "C" __global__ void output_gate_rows_f32(float* __restrict__ y, const float* __restrict__ gate,
                                                long long g_stride, long long rows, int cols) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    const long long r = i / cols, c = i % cols;
    y[i] /= 1.0f + expf(-gate[r * g_stride + c]);
}
