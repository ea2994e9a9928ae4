// Gated-DeltaNet layers (Qwen3-Next, Qwen3.5) and the output gate of gated attention:
//
//   delta_conv_silu   the depthwise causal convolution of a layer's q/k/v channels, then SiLU;
//   delta_conv_state  the convolution state after it (the last kernel - 1 inputs);
//   delta_prep        q and k L2-normalised per key head (q also scaled), beta = sigmoid(b) and
//                     g = -exp(A_log) * softplus(a + dt_bias) per value head, in place;
//   delta_rule_dkN    the gated delta rule, token by token, for key dims up to N;
//   delta_chunk_prep, delta_chunk_rule_dkN  the same rule CHUNK tokens at a time (prompts);
//   delta_decode_prep_dkN, delta_decode_rule_dkN  one decode step of a layer (conv, prep, rule,
//                     gated norm) in two launches, for one sequence;
//   delta_decode_dkN  the same in one launch, for a batch;
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

// The pieces the prefill kernels and the decode steps share (the same f32 operations in the same
// order, so the same bits on either path).

// One warp: the dk-vector v L2-normalised, times scale: x · (scale / sqrt(Σ x² + 1e-6)), into dst (may be v).
__device__ __forceinline__ void dn_l2norm_warp(const float* v, float* dst, int dk, float scale, int lane) {
    float ss = 0.0f;
    for (int i = lane; i < dk; i += 32) ss += v[i] * v[i];
    ss = warp_sum(ss);
    const float inv = scale / sqrtf(ss + 1e-6f);
    for (int i = lane; i < dk; i += 32) dst[i] = v[i] * inv;
}

// Value head h's gates from its raw b and a: (beta, g) with beta = sigmoid(b) and g = -exp(A_log)
// * softplus(a + dt_bias) (torch's softplus: x > 20 gives x); the decay of S is e^g.
__device__ __forceinline__ float2 dn_gates(float b, float a, int h, const bf16_t* a_log, const bf16_t* dt_bias) {
    const float beta = 1.0f / (1.0f + expf(-b));
    const float xa = a + bf16_to_f32(dt_bias[h]);
    const float sp = xa > 20.0f ? xa : log1pf(expf(xa));
    return make_float2(beta, -expf(bf16_to_f32(a_log[h])) * sp);
}

// One column of S through a step, by the RULE_SPLIT consecutive lanes that hold it (thread `part`
// holds rows part + 4 i in s, zero past dk): S <- S e^g; kv = S^T k; d = beta (v - kv);
// S <- S + k d^T; returns (S^T q) of the column, the same bits in all four lanes. vj: the
// column's v (0 for a column past dv).
template <int RPT>
__device__ __forceinline__ float dn_rule_column(float (&s)[RPT], const float* ks, const float* qs, int part,
                                                 float decay, float bt, float vj) {
    float kv2[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        s[i] *= decay;
        kv2[i & 1] += s[i] * ks[part + RULE_SPLIT * i];
    }
    float kv = kv2[0] + kv2[1];
    kv += __shfl_xor_sync(0xffffffffu, kv, 1);
    kv += __shfl_xor_sync(0xffffffffu, kv, 2);
    const float d = (vj - kv) * bt;
    float o2[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int a = part + RULE_SPLIT * i;
        s[i] += ks[a] * d;
        o2[i & 1] += s[i] * qs[a];
    }
    float o = o2[0] + o2[1];
    o += __shfl_xor_sync(0xffffffffu, o, 1);
    o += __shfl_xor_sync(0xffffffffu, o, 2);
    return o;
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
        dn_l2norm_warp(x, x, dk, v < nk ? q_scale : 1.0f, lane);
    }
    for (int h = threadIdx.x; h < nv; h += blockDim.x) {
        const long long i = (long long)r * nv + h;
        const float2 gates = dn_gates(b_beta[i], a_g[i], h, a_log, dt_bias);
        b_beta[i] = gates.x;
        a_g[i] = gates.y;
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
            const float o = dn_rule_column<RPT>(s, ks[tt], qs[tt], part, eg[tt], bt[tt], vs[tt][col]);
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

// ---------------------------------------------------------------------------------------------
// The chunked rule (the WY form of transformers' torch_chunk_gated_delta_rule and of
// krasis_cpu::delta_rule::chunked), CHUNK tokens at a time, for prompts. Per value head h and
// chunk of c <= CHUNK tokens, with G_i the cumulative log decay inside the chunk (G_i = g_0 + ...
// + g_i), K, Q, V the chunk's rows and S the state at the chunk's start:
//   L[i][j] = -beta_i (k_i . k_j) e^(G_i - G_j) for j < i (0 elsewhere);  M = (I - L)^-1;
//   T = M diag(beta);  Aqk[i][j] = (q_i . k_j) e^(G_i - G_j) for j <= i (0 elsewhere);
//   v_new = T (V - diag(e^G) K S);  out = diag(e^G) Q S + Aqk v_new;
//   S <- e^(G_last) S + (diag(e^(G_last - G)) K)^T v_new.
// (v_new = u - w S of the CPU form, with u = M diag(beta) V and w = M diag(beta) diag(e^G) K
// factored.) Every exponent is <= 0. Rows past c are zeros in K, Q, V, beta and g, which leaves
// every product of the real rows unchanged and v_new's padded rows zero.
//
// Two kernels, launched in order on one stream:
//   delta_chunk_prep  per (chunk, key head, sequence), parallel over every chunk: T and Aqk of
//                     each value head of the key head into the scratch;
//   delta_chunk_rule  per (32 value columns, value head, sequence), the chunks in order: the
//                     state tile [dk, 32] in shared memory, the output and the new state.
// Scratch: [n_seqs, chunks, nv, 2, CHUNK, CHUNK] floats, T then Aqk.
#define CHUNK 64
// Key dims staged per pass, and the staged rows' stride (16-byte rows; float4 reads of 8
// consecutive rows hit distinct banks).
#define CK_SLICE 32
#define CK_LD 36
// Row stride of T or Aqk in delta_chunk_rule's shared memory.
#define CT_LD 68
// Row stride of M in delta_chunk_prep's shared memory.
#define MR_LD 65
// Value columns per block of delta_chunk_rule.
#define CB_COLS 32
#define CHUNK_THREADS 256
// Floats of the staging area of delta_chunk_rule: two [CHUNK][CK_LD] slices, or T / Aqk
// [CHUNK][CT_LD], or [16][DKM] key rows.
#define CB_STAGE (2 * CHUNK * CK_LD)

// Warp 0: the chunk's cumulative log decays G_i (rows past c: g = 0, so G stays at G_{c-1}),
// lane l computing rows 2l and 2l + 1. Returns G_last (= G_63), to every lane.
__device__ __forceinline__ float chunk_cumsum(const float* __restrict__ g, long long row, int nv, int h, int c,
                                              float* gcs) {
    const int lane = threadIdx.x & 31;
    const int i0 = 2 * lane;
    const float x0 = i0 < c ? g[(row + i0) * nv + h] : 0.0f;
    const float x1 = i0 + 1 < c ? g[(row + i0 + 1) * nv + h] : 0.0f;
    float p = x0 + x1;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, p, o);
        if (lane >= o) p += y;
    }
    float before = __shfl_up_sync(0xffffffffu, p, 1);
    if (lane == 0) before = 0.0f;
    gcs[i0] = before + x0;
    gcs[i0 + 1] = p;
    return __shfl_sync(0xffffffffu, p, 31);
}

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    return fmaf(a.w, b.w, acc);
}

// acc[0..3] += x * v
__device__ __forceinline__ void axpy4(float* acc, float x, float4 v) {
    acc[0] = fmaf(x, v.x, acc[0]);
    acc[1] = fmaf(x, v.y, acc[1]);
    acc[2] = fmaf(x, v.z, acc[2]);
    acc[3] = fmaf(x, v.w, acc[3]);
}

// T and Aqk of one chunk for every value head of one key head. Grid (chunks, nk, n_seqs),
// CHUNK_THREADS threads. The raw products K K^T and Q K^T (64 x 64, shared by the key head's
// value heads) are a thread's 4 x 4 rows ty + 16 m, columns tx + 16 n, summed over key-dim slices
// staged in shared memory. Then per value head: L into shared memory, Aqk straight to the scratch,
// M = (I - L)^-1 by forward substitution a column per four threads (column j of M depends only
// on column j: M[i][j] = L[i][j] + sum_{j<m<i} L[i][m] M[m][j]), and T = M diag(beta) to the
// scratch.
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS)
    delta_chunk_prep(const float* __restrict__ qkv, const float* __restrict__ beta, const float* __restrict__ g,
                     float* __restrict__ scratch, int ch, int nk, int nv, int dk, int rows_per_seq) {
    __shared__ __align__(16) float stage[2 * CHUNK * CK_LD];  // K and Q slices, then M [CHUNK][CHUNK]
    __shared__ float ls[CHUNK * (CHUNK + 1)];
    __shared__ float gcs[CHUNK];
    __shared__ float bt[CHUNK];
    const int chunk = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
    const int nchunks = gridDim.x;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int c = min(CHUNK, rows_per_seq - chunk * CHUNK);
    const long long row = (long long)b * rows_per_seq + (long long)chunk * CHUNK;
    float* ks = stage;
    float* qs = stage + CHUNK * CK_LD;
    const float* kbase = qkv + (long long)(nk + kh) * dk;
    const float* qbase = qkv + (long long)kh * dk;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
#pragma unroll
        for (int n = 0; n < 4; ++n) kk[m][n] = qk[m][n] = 0.0f;
    }
    for (int a0 = 0; a0 < dk; a0 += CK_SLICE) {
        __syncthreads();  // the previous slice's reads are done
        for (int e = tid; e < CHUNK * CK_SLICE; e += CHUNK_THREADS) {
            const int i = e / CK_SLICE, a = e % CK_SLICE;
            const bool in = i < c && a0 + a < dk;
            const long long o = (row + i) * ch + a0 + a;
            ks[i * CK_LD + a] = in ? kbase[o] : 0.0f;
            qs[i * CK_LD + a] = in ? qbase[o] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int a = 0; a < CK_SLICE; a += 4) {
            float4 kr[4], qr[4], kc[4];
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                kr[m] = ld4(&ks[(ty + 16 * m) * CK_LD + a]);
                qr[m] = ld4(&qs[(ty + 16 * m) * CK_LD + a]);
                kc[m] = ld4(&ks[(tx + 16 * m) * CK_LD + a]);
            }
#pragma unroll
            for (int m = 0; m < 4; ++m) {
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    kk[m][n] = dot4(kr[m], kc[n], kk[m][n]);
                    qk[m][n] = dot4(qr[m], kc[n], qk[m][n]);
                }
            }
        }
    }
    const int per = nv / nk;
    float* mr = stage;  // M, row-major [CHUNK][MR_LD]
    for (int hh = 0; hh < per; ++hh) {
        const int h = kh * per + hh;
        __syncthreads();  // the slices (or the previous head's M, L, beta) are read
        if (tid < 32) chunk_cumsum(g, row, nv, h, c, gcs);
        if (tid < CHUNK) bt[tid] = tid < c ? beta[(row + tid) * nv + h] : 0.0f;
        __syncthreads();
        float* tg = scratch + (((long long)b * nchunks + chunk) * nv + h) * (2LL * CHUNK * CHUNK);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                const int i = ty + 16 * m, j = tx + 16 * n;
                const float dec = j <= i ? expf(gcs[i] - gcs[j]) : 0.0f;
                ls[i * (CHUNK + 1) + j] = j < i ? -bt[i] * kk[m][n] * dec : 0.0f;
                tg[CHUNK * CHUNK + i * CHUNK + j] = (j <= i && i < c) ? qk[m][n] * dec : 0.0f;
            }
        }
        __syncthreads();
        {
            // Column j = tid / 4 of M by four lanes, lane p summing the terms m = j + 1 + p + 4 k,
            // the parts added across the lanes; every lane runs every row, so the shuffles are
            // uniform across the warp.
            const int j = tid >> 2, p = tid & 3;
            for (int i = p; i < CHUNK; i += 4) {
                if (i <= j || i >= c) mr[i * MR_LD + j] = i == j ? 1.0f : 0.0f;
            }
            __syncwarp();
            for (int i = 1; i < c; ++i) {
                float part = 0.0f;
                if (i > j) {
                    const float* li = ls + i * (CHUNK + 1);
                    if (p == 0) part = li[j];
                    for (int m = j + 1 + p; m < i; m += 4) part = fmaf(li[m], mr[m * MR_LD + j], part);
                }
                part += __shfl_xor_sync(0xffffffffu, part, 1);
                part += __shfl_xor_sync(0xffffffffu, part, 2);
                if (i > j && p == 0) mr[i * MR_LD + j] = part;
                __syncwarp();
            }
        }
        __syncthreads();
        for (int e = tid; e < CHUNK * CHUNK; e += CHUNK_THREADS) {
            const int i = e / CHUNK, j = e % CHUNK;
            tg[e] = mr[i * MR_LD + j] * bt[j];
        }
    }
}

// The chunks of one sequence in order for value head h, columns j0 .. j0 + 31 of S (a block of
// CHUNK_THREADS threads; grid (ceil(dv / 32), nv, n_seqs)). Thread (tx = tid % 8, ty = tid / 8)
// owns output rows ty and ty + 32, columns j0 + 4 tx .. + 3; in the state update, rows
// ty + 32 m of S (DKM / 32 of them), the same columns. Dynamic shared memory
// (DKM * 32 + CB_STAGE + CHUNK * 32 + 3 * CHUNK floats):
//   S [DKM][32]; the staging area; R [CHUNK][32] (V - e^G K S, then v_new); G, e^G, e^(G_last - G).
// scratch as delta_chunk_prep left it. qkv, g and out as delta_rule's.
template <int DKM>
__device__ __forceinline__ void delta_chunk_rule_body(const float* __restrict__ qkv, const float* __restrict__ g,
                                                      const float* __restrict__ scratch, float* __restrict__ out,
                                                      const u64* __restrict__ states, long long off, int ch, int nk,
                                                      int nv, int dk, int dv, int rows_per_seq) {
    constexpr int RA = DKM / 32;
    // Elements per thread of a staged [CHUNK][CK_SLICE] slice, of T or Aqk (float4s), and of
    // 16 staged key rows [16][DKM].
    constexpr int SL = CHUNK * CK_SLICE / CHUNK_THREADS;
    constexpr int TL = CHUNK * CHUNK / 4 / CHUNK_THREADS;
    constexpr int KL = 16 * DKM / CHUNK_THREADS;
    extern __shared__ __align__(16) float csm[];
    float* S = csm;
    float* stage = S + DKM * CB_COLS;
    float* R = stage + CB_STAGE;
    float* gcs = R + CHUNK * CB_COLS;
    float* eg = gcs + CHUNK;
    float* ed = eg + CHUNK;
    const int b = blockIdx.z, h = blockIdx.y, j0 = blockIdx.x * CB_COLS;
    const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
    const int kh = h / (nv / nk);
    const int jt = 4 * tx;  // the thread's first column within the tile
    float* Sg = state_of(states, b, off) + (long long)h * dk * dv;
    for (int e = tid; e < DKM * CB_COLS; e += CHUNK_THREADS) {
        const int a = e / CB_COLS, j = j0 + e % CB_COLS;
        S[e] = (a < dk && j < dv) ? Sg[(long long)a * dv + j] : 0.0f;
    }
    const float* qbase = qkv + (long long)kh * dk;
    const float* kbase = qkv + (long long)(nk + kh) * dk;
    const float* vbase = qkv + 2LL * nk * dk + (long long)h * dv;
    const int nchunks = (rows_per_seq + CHUNK - 1) / CHUNK;
    float* ks = stage;
    float* qs = stage + CHUNK * CK_LD;
    for (int chunk = 0; chunk < nchunks; ++chunk) {
        const int c = min(CHUNK, rows_per_seq - chunk * CHUNK);
        const long long row = (long long)b * rows_per_seq + (long long)chunk * CHUNK;
        const float* tg = scratch + (((long long)b * nchunks + chunk) * nv + h) * (2LL * CHUNK * CHUNK);
        // Loads issued early, into registers, to be in flight while the block computes: the
        // chunk's T and Aqk, the thread's values, the first key-dim slice of K and Q.
        float4 tr[TL], ar[TL];
#pragma unroll
        for (int u = 0; u < TL; ++u) {
            const int e = tid + u * CHUNK_THREADS;
            tr[u] = ld4(&tg[4 * e]);
            ar[u] = ld4(&tg[CHUNK * CHUNK + 4 * e]);
        }
        float vr[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = ty + 32 * r;
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int j = j0 + jt + u;
                vr[r][u] = (i < c && j < dv) ? vbase[(row + i) * ch + j] : 0.0f;
            }
        }
        float pk[SL], pq[SL];
        auto load_slice = [&](int a0) {
#pragma unroll
            for (int u = 0; u < SL; ++u) {
                const int e = tid + u * CHUNK_THREADS;
                const int i = e / CK_SLICE, a = e % CK_SLICE;
                const bool in = i < c && a0 + a < dk;
                const long long o = (row + i) * ch + a0 + a;
                pk[u] = in ? kbase[o] : 0.0f;
                pq[u] = in ? qbase[o] : 0.0f;
            }
        };
        load_slice(0);
        __syncthreads();  // the previous chunk's state update is done (S written; staging, R, ed read)
        if (tid < 32) {
            const float last = chunk_cumsum(g, row, nv, h, c, gcs);
            __syncwarp();
            for (int i = tid; i < CHUNK; i += 32) {
                eg[i] = expf(gcs[i]);
                ed[i] = expf(last - gcs[i]);
            }
        }
        // 1. ak = K S and aq = Q S for the thread's rows and columns, over key-dim slices (the
        // next slice's loads in flight during a slice's products).
        float ak[2][4], aq[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int u = 0; u < 4; ++u) ak[r][u] = aq[r][u] = 0.0f;
        }
        for (int a0 = 0; a0 < dk; a0 += CK_SLICE) {
            if (a0 > 0) __syncthreads();  // the previous slice's reads are done
#pragma unroll
            for (int u = 0; u < SL; ++u) {
                const int e = tid + u * CHUNK_THREADS;
                const int i = e / CK_SLICE, a = e % CK_SLICE;
                ks[i * CK_LD + a] = pk[u];
                qs[i * CK_LD + a] = pq[u];
            }
            __syncthreads();  // (first pass: also the decays written)
            if (a0 + CK_SLICE < dk) load_slice(a0 + CK_SLICE);
#pragma unroll
            for (int a = 0; a < CK_SLICE; a += 4) {
                const float4 k0 = ld4(&ks[ty * CK_LD + a]), k1 = ld4(&ks[(ty + 32) * CK_LD + a]);
                const float4 q0 = ld4(&qs[ty * CK_LD + a]), q1 = ld4(&qs[(ty + 32) * CK_LD + a]);
                const float kv0[4] = {k0.x, k0.y, k0.z, k0.w}, kv1[4] = {k1.x, k1.y, k1.z, k1.w};
                const float qv0[4] = {q0.x, q0.y, q0.z, q0.w}, qv1[4] = {q1.x, q1.y, q1.z, q1.w};
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const float4 s = ld4(&S[(a0 + a + u) * CB_COLS + jt]);
                    axpy4(ak[0], kv0[u], s);
                    axpy4(ak[1], kv1[u], s);
                    axpy4(aq[0], qv0[u], s);
                    axpy4(aq[1], qv1[u], s);
                }
            }
        }
        __syncthreads();  // the slices are read: the staging area becomes T
        // R = V - e^G K S (zero past c); o = e^G Q S.
        float o[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = ty + 32 * r;
            float rv[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                rv[u] = i < c ? vr[r][u] - eg[i] * ak[r][u] : 0.0f;
                o[r][u] = eg[i] * aq[r][u];
            }
            *reinterpret_cast<float4*>(&R[i * CB_COLS + jt]) = make_float4(rv[0], rv[1], rv[2], rv[3]);
        }
#pragma unroll
        for (int u = 0; u < TL; ++u) {
            const int e = tid + u * CHUNK_THREADS;
            *reinterpret_cast<float4*>(&stage[(e / (CHUNK / 4)) * CT_LD + 4 * (e % (CHUNK / 4))]) = tr[u];
        }
        __syncthreads();
        // 2. v_new = T R (T lower triangular: row i needs m <= i).
        float vn[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int u = 0; u < 4; ++u) vn[r][u] = 0.0f;
        }
        for (int m = 0; m <= ty; ++m) {
            const float4 rm = ld4(&R[m * CB_COLS + jt]);
            axpy4(vn[0], stage[ty * CT_LD + m], rm);
            axpy4(vn[1], stage[(ty + 32) * CT_LD + m], rm);
        }
        for (int m = ty + 1; m <= ty + 32; ++m) axpy4(vn[1], stage[(ty + 32) * CT_LD + m], ld4(&R[m * CB_COLS + jt]));
        __syncthreads();  // R and T are read
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            *reinterpret_cast<float4*>(&R[(ty + 32 * r) * CB_COLS + jt]) =
                make_float4(vn[r][0], vn[r][1], vn[r][2], vn[r][3]);
        }
#pragma unroll
        for (int u = 0; u < TL; ++u) {
            const int e = tid + u * CHUNK_THREADS;
            *reinterpret_cast<float4*>(&stage[(e / (CHUNK / 4)) * CT_LD + 4 * (e % (CHUNK / 4))]) = ar[u];
        }
        // The state update's first key rows, in flight during step 3.
        float pr[KL];
        auto load_rows = [&](int i0) {
#pragma unroll
            for (int u = 0; u < KL; ++u) {
                const int e = tid + u * CHUNK_THREADS;
                const int i = i0 + e / DKM, a = e % DKM;
                pr[u] = (i < c && a < dk) ? kbase[(row + i) * ch + a] : 0.0f;
            }
        };
        load_rows(0);
        __syncthreads();
        // 3. out = o + Aqk v_new (Aqk lower triangular).
        for (int m = 0; m <= ty; ++m) {
            const float4 rm = ld4(&R[m * CB_COLS + jt]);
            axpy4(o[0], stage[ty * CT_LD + m], rm);
            axpy4(o[1], stage[(ty + 32) * CT_LD + m], rm);
        }
        for (int m = ty + 1; m <= ty + 32; ++m) axpy4(o[1], stage[(ty + 32) * CT_LD + m], ld4(&R[m * CB_COLS + jt]));
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = ty + 32 * r;
            if (i < c) {
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int j = j0 + jt + u;
                    if (j < dv) out[((row + i) * nv + h) * dv + j] = o[r][u];
                }
            }
        }
        // 4. S = e^G_last S + (diag(e^(G_last - G)) K)^T v_new, 16 key rows staged at a time (the
        // next 16 rows' loads in flight during the products).
        float acc[RA][4];
#pragma unroll
        for (int m = 0; m < RA; ++m) {
#pragma unroll
            for (int u = 0; u < 4; ++u) acc[m][u] = 0.0f;
        }
        for (int i0 = 0; i0 < c; i0 += 16) {
            __syncthreads();  // Aqk (or the previous rows) read
#pragma unroll
            for (int u = 0; u < KL; ++u) {
                const int e = tid + u * CHUNK_THREADS;
                stage[e] = pr[u] * ed[i0 + e / DKM];
            }
            __syncthreads();
            if (i0 + 16 < c) load_rows(i0 + 16);
#pragma unroll 4
            for (int ii = 0; ii < 16; ++ii) {
                const float4 rm = ld4(&R[(i0 + ii) * CB_COLS + jt]);
#pragma unroll
                for (int m = 0; m < RA; ++m) axpy4(acc[m], stage[ii * DKM + ty + 32 * m], rm);
            }
        }
        const float el = expf(gcs[CHUNK - 1]);
#pragma unroll
        for (int m = 0; m < RA; ++m) {
            float* sp = &S[(ty + 32 * m) * CB_COLS + jt];
            const float4 s = ld4(sp);
            *reinterpret_cast<float4*>(sp) =
                make_float4(fmaf(el, s.x, acc[m][0]), fmaf(el, s.y, acc[m][1]), fmaf(el, s.z, acc[m][2]),
                            fmaf(el, s.w, acc[m][3]));
        }
    }
    __syncthreads();
    for (int e = tid; e < DKM * CB_COLS; e += CHUNK_THREADS) {
        const int a = e / CB_COLS, j = j0 + e % CB_COLS;
        if (a < dk && j < dv) Sg[(long long)a * dv + j] = S[e];
    }
}

#define DELTA_CHUNK_RULE_KERNEL(N)                                                                                \
    extern "C" __global__ void __launch_bounds__(CHUNK_THREADS)                                                   \
        delta_chunk_rule_dk##N(const float* __restrict__ qkv, const float* __restrict__ g,                        \
                               const float* __restrict__ scratch, float* __restrict__ out,                        \
                               const u64* __restrict__ states, long long off, int ch, int nk, int nv, int dk,     \
                               int dv, int rows_per_seq) {                                                        \
        delta_chunk_rule_body<N>(qkv, g, scratch, out, states, off, ch, nk, nv, dk, dv, rows_per_seq);            \
    }

DELTA_CHUNK_RULE_KERNEL(64)
DELTA_CHUNK_RULE_KERNEL(128)
DELTA_CHUNK_RULE_KERNEL(256)

// ---------------------------------------------------------------------------------------------
// One sequence's decode step of a whole layer (one row) in two launches, the second a dependent
// launch of the first (a batch's step is delta_decode_dkN, below): what delta_conv_silu, delta_conv_state, delta_prep,
// delta_rule_dkN and delta_gated_norm do for a single row, the same f32 operations in the same
// order.
//
// delta_decode_prep: grid (nk, n_seqs), DEC_THREADS threads. A block owns one key head of one
//   sequence, i.e. the conv channels of its q and k and of the v of its value heads (nv / nk of
//   them), so it alone shifts their conv state. In place: x's channels become the convolution's
//   SiLU outputs with q and k L2-normalised (as delta_prep), b becomes beta = sigmoid(b) and a the
//   decay e^g. Dynamic shared memory: q and k (2 * DKM floats).
// delta_decode_rule_dkN: grid (nv, n_seqs), RULE_SPLIT * cols threads (cols a multiple of 8, at
//   most DEC_RULE_COLS): a block owns one value head, its columns in passes of `cols` (thread
//   (col, part) holds rows part + 4 i of column col of S, as delta_rule; two passes' S loaded
//   together), the head's output in shared memory, then the gated norm (warp 0 sums the squares
//   as delta_gated_norm) into out. The first passes' S is loaded before the wait for
//   delta_decode_prep: no launch since the previous step writes it, and delta_decode_prep releases
//   this kernel only after its own wait, when every earlier launch has finished. Why two launches: a
//   block per value head puts the 2 MB of a Qwen3.6 layer's rule state on 32 SMs where the single
//   fused kernel (a block per key head, which the conv state's shift requires) had 16, each
//   walking its value heads' columns in turn.
// x [n_seqs, ch] (the projection's output), z [n_seqs, nv * dv], b and a [n_seqs, nv] (raw),
// out [n_seqs, nv * dv]. conv_off and rule_off: the layer's conv and rule states' offsets into
// every block. The rule kernel's dynamic shared memory: q, k (2 * DKM floats), the output (dv).
#define DEC_THREADS 256
#define DEC_RULE_COLS 64   // columns a rule block computes at a time: 256 threads, 4 per column

// The decode steps' own shared pieces (one sequence's two launches and a batch's one launch;
// the L2 norm, the gates and the rule's column step, which prefill shares too, are at the top).

// Channel e of key head kh's conv channels (e < dk: its q, < 2 dk: its k, else its value heads'
// v): SiLU of the taps over [conv state; x row xr] into qs[e], ks[e - dk] or vs[e - 2 dk], and
// the channel's conv state shifted by one row (oldest first).
__device__ __forceinline__ void dec_conv_channel(int e, int kh, int nk, int per, int dk, int dv, int kernel,
                                                 const bf16_t* taps, const float* xr, float* cst, float* qs,
                                                 float* ks, float* vs) {
    const int ch = 2 * nk * dk + nk * per * dv;
    const int keep = kernel - 1;
    int c;
    float* dst;
    if (e < dk) {
        c = kh * dk + e;
        dst = qs + e;
    } else if (e < 2 * dk) {
        c = (nk + kh) * dk + e - dk;
        dst = ks + e - dk;
    } else {
        c = 2 * nk * dk + kh * per * dv + e - 2 * dk;
        dst = vs + e - 2 * dk;
    }
    float w[CONV_MAX_K];
#pragma unroll
    for (int j = 0; j < CONV_MAX_K; ++j) w[j] = j < kernel ? bf16_to_f32(taps[(long long)c * kernel + j]) : 0.0f;
    const float xc = xr[c];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < CONV_MAX_K; ++j) {
        if (j < kernel) acc += w[j] * (j < keep ? cst[(long long)j * ch + c] : xc);
    }
    *dst = dn_silu(acc);
    for (int r = 0; r < keep; ++r) {
        cst[(long long)r * ch + c] = r + 1 < keep ? cst[(long long)(r + 1) * ch + c] : xc;
    }
}

// The gated norm of one head's output ob [dv] into out [dv], z [dv] its gate (every thread of
// the block calls it, after a barrier that published ob): warp 0 sums the squares (as
// delta_gated_norm), then out[i] = ob[i] / rms * w[i] * silu(z[i]). inv_s: a shared float.
__device__ __forceinline__ void dec_gated_norm(const float* ob, int dv, float eps, const bf16_t* norm_w,
                                               const float* z, float* out, float* inv_s) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (warp == 0) {
        float ss = 0.0f;
        for (int i = lane; i < dv; i += 32) ss += ob[i] * ob[i];
        ss = warp_sum(ss);
        if (lane == 0) *inv_s = 1.0f / sqrtf(ss / (float)dv + eps);
    }
    __syncthreads();
    const float inv = *inv_s;
    for (int i = tid; i < dv; i += blockDim.x) out[i] = ob[i] * inv * bf16_to_f32(norm_w[i]) * dn_silu(z[i]);
}

template <int DKM>
__device__ __forceinline__ void delta_decode_prep_body(float* __restrict__ x, float* __restrict__ b_io,
                                                       float* __restrict__ a_io, const bf16_t* __restrict__ taps,
                                                       const bf16_t* __restrict__ a_log,
                                                       const bf16_t* __restrict__ dt_bias, const u64* __restrict__ states,
                                                       long long conv_off, int nk, int nv, int dk, int dv, int kernel,
                                                       float q_scale) {
    extern __shared__ __align__(16) float dsm[];
    float* qs = dsm;
    float* ks = qs + DKM;
    const int per = nv / nk;
    const int kh = blockIdx.x, b = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ch = 2 * nk * dk + nv * dv;
    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();
    float* cst = state_of(states, b, conv_off);
    float* xr = x + (long long)b * ch;

    // 1. Convolution and conv state (v's outputs straight back into x).
    const int nc = 2 * dk + per * dv;
    for (int e = tid; e < nc; e += DEC_THREADS)
        dec_conv_channel(e, kh, nk, per, dk, dv, kernel, taps, xr, cst, qs, ks, xr + 2 * nk * dk + kh * per * dv);
    __syncthreads();

    // 2. q and k normalised into x; beta and the decay of each value head into b and a.
    if (warp < 2)
        dn_l2norm_warp(warp == 0 ? qs : ks, xr + (warp == 0 ? kh * dk : (nk + kh) * dk), dk,
                        warp == 0 ? q_scale : 1.0f, lane);
    for (int hh = tid - 64; hh < per; hh += DEC_THREADS - 64) {
        if (hh < 0) break;
        const int h = kh * per + hh;
        const long long i = (long long)b * nv + h;
        const float2 g = dn_gates(b_io[i], a_io[i], h, a_log, dt_bias);
        b_io[i] = g.x;
        a_io[i] = expf(g.y);
    }
}

template <int DKM>
__device__ __forceinline__ void delta_decode_rule_body(const float* __restrict__ x, const float* __restrict__ z,
                                                       const float* __restrict__ beta, const float* __restrict__ decay_in,
                                                       const bf16_t* __restrict__ norm_w, float* __restrict__ out,
                                                       const u64* __restrict__ states, long long rule_off, int nk,
                                                       int nv, int dk, int dv, float eps) {
    constexpr int RPT = DKM / RULE_SPLIT;
    // Passes whose S a thread holds at once (all of a 128-wide head's in one load); one at dk 256,
    // whose 64 rows per thread fill the registers alone.
    constexpr int NP = DKM <= 128 ? 2 : 1;
    extern __shared__ __align__(16) float dsm[];
    __shared__ float inv_s;
    float* qs = dsm;
    float* ks = qs + DKM;
    float* ob = ks + DKM;
    const int h = blockIdx.x, b = blockIdx.y;
    const int kh = h / (nv / nk);
    const int tid = threadIdx.x;
    const int cols = blockDim.x / RULE_SPLIT;
    const int ch = 2 * nk * dk + nv * dv;
    const int col = tid / RULE_SPLIT, part = tid % RULE_SPLIT;
    float* S = state_of(states, b, rule_off) + (long long)h * dk * dv;

    float s[NP][RPT];
    auto load_s = [&](int g0) {
#pragma unroll
        for (int p = 0; p < NP; ++p) {
            const int j = g0 + p * cols + col;
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const int a = part + RULE_SPLIT * i;
                s[p][i] = (j < dv && a < dk) ? S[(long long)a * dv + j] : 0.0f;
            }
        }
    };
    load_s(0);
    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();

    const float* xr = x + (long long)b * ch;
    for (int a = tid; a < DKM; a += blockDim.x) {
        qs[a] = a < dk ? xr[kh * dk + a] : 0.0f;
        ks[a] = a < dk ? xr[(nk + kh) * dk + a] : 0.0f;
    }
    const float bt = beta[(long long)b * nv + h], decay = decay_in[(long long)b * nv + h];
    const float* vr = xr + 2 * nk * dk + (long long)h * dv;
    __syncthreads();

    for (int g0 = 0; g0 < dv; g0 += NP * cols) {
        if (g0 > 0) load_s(g0);
#pragma unroll
        for (int p = 0; p < NP; ++p) {
            const int j = g0 + p * cols + col;
            const bool live = j < dv;
            const float o = dn_rule_column<RPT>(s[p], ks, qs, part, decay, bt, live ? vr[j] : 0.0f);
            if (live) {
                if (part == 0) ob[j] = o;
#pragma unroll
                for (int i = 0; i < RPT; ++i) {
                    const int a = part + RULE_SPLIT * i;
                    if (a < dk) S[(long long)a * dv + j] = s[p][i];
                }
            }
        }
    }
    __syncthreads();  // the head's output is in ob
    const long long base = ((long long)b * nv + h) * dv;
    dec_gated_norm(ob, dv, eps, norm_w, z + base, out + base, &inv_s);
}

#define DELTA_DECODE_KERNELS(N)                                                                                  \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS)                                                    \
        delta_decode_prep_dk##N(float* __restrict__ x, float* __restrict__ b_io, float* __restrict__ a_io,      \
                                const bf16_t* __restrict__ taps, const bf16_t* __restrict__ a_log,              \
                                const bf16_t* __restrict__ dt_bias, const u64* __restrict__ states,             \
                                long long conv_off, int nk, int nv, int dk, int dv, int kernel, float q_scale) { \
        delta_decode_prep_body<N>(x, b_io, a_io, taps, a_log, dt_bias, states, conv_off, nk, nv, dk, dv, kernel, \
                                  q_scale);                                                                      \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(RULE_SPLIT * DEC_RULE_COLS)                                     \
        delta_decode_rule_dk##N(const float* __restrict__ x, const float* __restrict__ z,                       \
                                const float* __restrict__ beta, const float* __restrict__ decay,                \
                                const bf16_t* __restrict__ norm_w, float* __restrict__ out,                     \
                                const u64* __restrict__ states, long long rule_off, int nk, int nv, int dk,     \
                                int dv, float eps) {                                                             \
        delta_decode_rule_body<N>(x, z, beta, decay, norm_w, out, states, rule_off, nk, nv, dk, dv, eps);        \
    }

DELTA_DECODE_KERNELS(64)
DELTA_DECODE_KERNELS(128)
DELTA_DECODE_KERNELS(256)

// ---------------------------------------------------------------------------------------------
// One decode step of a whole layer (one row per sequence) in one launch, for a batched step
// (16 sequences of Qwen3.6: 32.0 us against 41.0 for the two launches above, whose rule kernel
// takes 256 threads per value head and sequence at 255 registers): what delta_conv_silu,
// delta_conv_state, delta_prep, delta_rule_dkN and delta_gated_norm do for a single row, the
// same f32 operations in the same order. Grid (nk, n_seqs), DEC_THREADS threads: a block owns
// one key head of one sequence, i.e. the conv channels of its q and k and of the v of its value
// heads (nv / nk of them), so it alone updates their conv state. Steps, with barriers between:
//   1. the convolution of those channels from the conv state and the row x, SiLU, into shared
//      memory; the conv state shifted (each channel by the thread that read it);
//   2. q and k L2-normalised (a warp each, as delta_prep), beta and e^g of each value head;
//   3. per value head: the rule (as delta_rule: thread (col, part) holds rows part + 4 i of
//      column col of S, DEC_COLS columns per pass), the output into shared memory; then the
//      gated norm (warp 0 sums the squares as delta_gated_norm) into out.
// x [n_seqs, ch] (the projection's output), z [n_seqs, nv * dv], b and a [n_seqs, nv] (raw:
// sigmoid and the decay are taken here), out [n_seqs, nv * dv]. conv_off and rule_off: the
// layer's conv and rule states' offsets into every block. Dynamic shared memory
// (2 * DKM + (nv / nk + 1) * dv + 2 * (nv / nk) floats): q, k, the key head's v, one head's
// output, then (beta, e^g) per value head.
#define DEC_COLS (DEC_THREADS / RULE_SPLIT)

template <int DKM>
__device__ __forceinline__ void delta_decode_body(const float* __restrict__ x, const float* __restrict__ z,
                                                  const float* __restrict__ b_in, const float* __restrict__ a_in,
                                                  const bf16_t* __restrict__ taps, const bf16_t* __restrict__ a_log,
                                                  const bf16_t* __restrict__ dt_bias, const bf16_t* __restrict__ norm_w,
                                                  float* __restrict__ out, const u64* __restrict__ states,
                                                  long long conv_off, long long rule_off, int nk, int nv, int dk,
                                                  int dv, int kernel, float q_scale, float eps) {
    constexpr int RPT = DKM / RULE_SPLIT;
    extern __shared__ __align__(16) float dsm[];
    __shared__ float inv_s;
    const int per = nv / nk;
    float* qs = dsm;
    float* ks = qs + DKM;
    float* vs = ks + DKM;
    float* ob = vs + per * dv;
    float* hb = ob + dv;
    const int kh = blockIdx.x, b = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ch = 2 * nk * dk + nv * dv;
    float* cst = state_of(states, b, conv_off);
    const float* xr = x + (long long)b * ch;

    // 1. Convolution and conv state.
    const int nc = 2 * dk + per * dv;
    for (int e = tid; e < nc; e += DEC_THREADS) dec_conv_channel(e, kh, nk, per, dk, dv, kernel, taps, xr, cst, qs, ks, vs);
    for (int a = dk + tid; a < DKM; a += DEC_THREADS) qs[a] = ks[a] = 0.0f;
    __syncthreads();

    // 2. q and k normalised; beta and the decay of each value head.
    if (warp < 2) dn_l2norm_warp(warp == 0 ? qs : ks, warp == 0 ? qs : ks, dk, warp == 0 ? q_scale : 1.0f, lane);
    for (int hh = tid - 64; hh < per; hh += DEC_THREADS - 64) {
        if (hh < 0) break;
        const int h = kh * per + hh;
        const long long i = (long long)b * nv + h;
        const float2 g = dn_gates(b_in[i], a_in[i], h, a_log, dt_bias);
        hb[2 * hh] = g.x;
        hb[2 * hh + 1] = expf(g.y);
    }
    __syncthreads();

    // 3. The rule and the gated norm, a value head at a time.
    const int col = tid / RULE_SPLIT, part = tid % RULE_SPLIT;
    for (int hh = 0; hh < per; ++hh) {
        const int h = kh * per + hh;
        float* S = state_of(states, b, rule_off) + (long long)h * dk * dv;
        const float bt = hb[2 * hh], decay = hb[2 * hh + 1];
        for (int j0 = 0; j0 < dv; j0 += DEC_COLS) {
            const int j = j0 + col;
            const bool live = j < dv;
            float s[RPT];
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const int a = part + RULE_SPLIT * i;
                s[i] = (live && a < dk) ? S[(long long)a * dv + j] : 0.0f;
            }
            const float o = dn_rule_column<RPT>(s, ks, qs, part, decay, bt, live ? vs[hh * dv + j] : 0.0f);
            if (live) {
                if (part == 0) ob[j] = o;
#pragma unroll
                for (int i = 0; i < RPT; ++i) {
                    const int a = part + RULE_SPLIT * i;
                    if (a < dk) S[(long long)a * dv + j] = s[i];
                }
            }
        }
        __syncthreads();  // the head's output is in ob
        const long long base = ((long long)b * nv + h) * dv;
        dec_gated_norm(ob, dv, eps, norm_w, z + base, out + base, &inv_s);
        __syncthreads();  // ob and inv_s are read before the next head writes them
    }
}

#define DELTA_DECODE_KERNEL(N)                                                                                   \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS)                                                    \
        delta_decode_dk##N(const float* __restrict__ x, const float* __restrict__ z,                            \
                           const float* __restrict__ b_in, const float* __restrict__ a_in,                      \
                           const bf16_t* __restrict__ taps, const bf16_t* __restrict__ a_log,                   \
                           const bf16_t* __restrict__ dt_bias, const bf16_t* __restrict__ norm_w,               \
                           float* __restrict__ out, const u64* __restrict__ states, long long conv_off,         \
                           long long rule_off, int nk, int nv, int dk, int dv, int kernel, float q_scale,       \
                           float eps) {                                                                          \
        delta_decode_body<N>(x, z, b_in, a_in, taps, a_log, dt_bias, norm_w, out, states, conv_off, rule_off,   \
                             nk, nv, dk, dv, kernel, q_scale, eps);                                              \
    }

DELTA_DECODE_KERNEL(64)
DELTA_DECODE_KERNEL(128)
DELTA_DECODE_KERNEL(256)

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
