// Routed experts in BF16, grouped by expert on the device (no host synchronisation).
//
// A pass handles n_pairs = tokens * top_k (token, slot) pairs; pair p = token * top_k + slot.
//   1. moe_route (one block): count pairs per expert, exclusive offsets, tiles of MOE_TM pairs per
//      expert (tile_offsets), and `sorted`: the pair indices grouped by expert. Pairs whose id is
//      outside [0, n_experts) are left out (moe_combine turns their token's row into NaN).
//   2. moe_gate_up: one block per (tile, MOE_BN intermediate columns): act[p, i] =
//      silu(gate_e[i] . x[token(p)]) * (up_e[i] . x[token(p)]) for the tile's pairs; the weight
//      rows are read once per tile and shared by its pairs.
//   3. moe_down: same tiling, ypair[p, h] = down_e[h] . act[p].
//   4. moe_combine: out[t, h] = sum_j w[t, j] * ypair[t*top_k + j, h], j ascending.
// Each output element is computed by one thread with one accumulator over k ascending, whatever
// tile or slot its pair lands in, so the result is bitwise deterministic even though the order
// inside an expert's group (atomics in moe_route) is not.
//
// Weights are BF16 row-major with rows padded with zeros to a multiple of MOE_KC elements
// (w13 [E, 2*inter, hidden_pad], gate rows then up rows; w2 [E, hidden, inter_pad]), so every
// chunk load is a full aligned 16-byte vector.
#include "krasis_common.cuh"

#define MOE_TM 16          // pairs per tile (must match moe.rs)
#define MOE_BN 32          // output columns per block (must match moe.rs)
#define MOE_KC 64          // k elements per shared-memory chunk (= weight row padding, moe.rs)
#define MOE_THREADS 256    // threads per GEMM block: MOE_TM pairs x 16 column pairs
#define MOE_MAX_EXPERTS 4096  // moe_route's shared counters (must match moe.rs)

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

// One tile of one expert: out[p, n0 + i] for the tile's pairs p and i < MOE_BN.
// GATED: weight rows n0+i (gate) and up_row0+n0+i (up), out = silu(gate) * up.
// A's row for pair p is p / a_div (the token for the gate/up step, the pair itself for down).
template <bool GATED>
__device__ __forceinline__ void moe_tile(const bf16_t* __restrict__ w, long long expert_stride, int ldw, int n_out,
                                         int up_row0, int k, const float* __restrict__ a, int lda, int a_div,
                                         float* __restrict__ out, int ldo, const int* __restrict__ sorted,
                                         const int* __restrict__ offsets, const int* __restrict__ tile_offsets,
                                         int n_experts) {
    constexpr int WR = GATED ? 2 * MOE_BN : MOE_BN;
    __shared__ int s_pair[MOE_TM];
    __shared__ float xs[MOE_TM][MOE_KC + 1];
    __shared__ float ws[WR][MOE_KC + 1];

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
    if (tid < MOE_TM) s_pair[tid] = tid < count ? sorted[start + tid] : -1;
    __syncthreads();

    const int n0 = blockIdx.y * MOE_BN;
    const bf16_t* we = w + (long long)e * expert_stride;
    const int s = tid >> 4, c = tid & 15;  // pair slot, column pair (2c, 2c+1)
    const int my_pair = s_pair[s];
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};

    for (int k0 = 0; k0 < k; k0 += MOE_KC) {
        for (int idx = tid; idx < WR * (MOE_KC / 8); idx += MOE_THREADS) {
            const int row = idx / (MOE_KC / 8), part = idx % (MOE_KC / 8);
            const int j = GATED && row >= MOE_BN ? row - MOE_BN : row;
            const bool ok = n0 + j < n_out;
            const int grow = GATED && row >= MOE_BN ? up_row0 + n0 + j : n0 + j;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (ok) v = *(const uint4*)(we + (long long)grow * ldw + k0 + part * 8);
            const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                ws[row][part * 8 + 2 * q] = bf16_to_f32((bf16_t)(words[q] & 0xffffu));
                ws[row][part * 8 + 2 * q + 1] = bf16_to_f32((bf16_t)(words[q] >> 16));
            }
        }
        for (int idx = tid; idx < MOE_TM * MOE_KC; idx += MOE_THREADS) {
            const int ss = idx / MOE_KC, kk = idx % MOE_KC;
            const int p = s_pair[ss];
            xs[ss][kk] = p >= 0 && k0 + kk < k ? a[(long long)(p / a_div) * lda + k0 + kk] : 0.0f;
        }
        __syncthreads();
        if (my_pair >= 0) {
#pragma unroll 8
            for (int kk = 0; kk < MOE_KC; ++kk) {
                const float xv = xs[s][kk];
                acc[0] += ws[2 * c][kk] * xv;
                acc[1] += ws[2 * c + 1][kk] * xv;
                if (GATED) {
                    acc[2] += ws[MOE_BN + 2 * c][kk] * xv;
                    acc[3] += ws[MOE_BN + 2 * c + 1][kk] * xv;
                }
            }
        }
        __syncthreads();
    }
    if (my_pair < 0) return;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int o = n0 + 2 * c + q;
        if (o >= n_out) continue;
        float v = acc[q];
        if (GATED) v = v / (1.0f + expf(-v)) * acc[2 + q];
        out[(long long)my_pair * ldo + o] = v;
    }
}

// act [n_pairs, inter] from x [tokens, hidden] and w13 [E, 2*inter, ldw].
extern "C" __global__ void moe_gate_up(const bf16_t* w13, int ldw, int inter, int hidden, const float* x, int top_k,
                                       float* act, const int* sorted, const int* offsets, const int* tile_offsets,
                                       int n_experts) {
    moe_tile<true>(w13, (long long)2 * inter * ldw, ldw, inter, inter, hidden, x, hidden, top_k, act, inter, sorted,
                   offsets, tile_offsets, n_experts);
}

// ypair [n_pairs, hidden] from act [n_pairs, inter] and w2 [E, hidden, ldw].
extern "C" __global__ void moe_down(const bf16_t* w2, int ldw, int inter, int hidden, const float* act,
                                    float* ypair, const int* sorted, const int* offsets, const int* tile_offsets,
                                    int n_experts) {
    moe_tile<false>(w2, (long long)hidden * ldw, ldw, hidden, 0, inter, act, inter, 1, ypair, hidden, sorted,
                    offsets, tile_offsets, n_experts);
}

// out [tokens, hidden] = sum over j ascending of weights[t, j] * ypair[t*top_k + j]; a token with
// any id outside [0, n_experts) gets a NaN row. One block per token.
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
    for (int h = threadIdx.x; h < hidden; h += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            const long long p = (long long)t * top_k + j;
            acc += weights[p] * ypair[p * hidden + h];
        }
        out[(long long)t * hidden + h] = valid ? acc : krasis_nan();
    }
}
