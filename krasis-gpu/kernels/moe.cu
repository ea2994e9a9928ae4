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

// Six NVRTC programs share this file (moe.rs): the routing, glue and BF16 kernels (no macro), the
// INT4, INT8 and FP4 tiles (-DMOE_QTILES=4, =8, =5), the integer decode kernels (-DMOE_QDEC) and
// the FP4 ones (-DMOE_QDEC_FP4), so they compile in parallel (as one program, 7.8–10.4 s of a
// fresh machine's cold start).
#if !defined(MOE_QTILES) && !defined(MOE_QDEC) && !defined(MOE_QDEC_FP4)
#define MOE_BASE
#endif

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

// The routed experts' activation: `MoeAct` and `moe_act` in krasis_common.cuh (moe_pcie.cu uses them too).

// tm: pairs per tile (MOE_TM for the BF16 tiles; the quantised tiles' TM).
#ifdef MOE_BASE
extern "C" __global__ void moe_route(const int* __restrict__ ids, int n_pairs, int n_experts, int tm,
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
            tt += (c + tm - 1) / tm;
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
#endif

// x [tokens, k] f32 -> its two BF16 halves hi, lo [tokens, ldo] (bf16_split), zero from k to ldo.
// Launch: grid (tokens, ceil(ldo / 256)), 256 threads.
#ifdef MOE_BASE
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
#endif

// The expert owning `tile` (tile_offsets[e] <= tile < tile_offsets[e + 1]); fills s_pair with the
// tile's pair indices (-1 past its `count` pairs; TM pairs a tile) and ends with a barrier.
template <int TM>
__device__ __forceinline__ int moe_tile_pairs(int tile, const int* __restrict__ sorted, const int* __restrict__ offsets,
                                              const int* __restrict__ tile_offsets, int n_experts, int* s_pair,
                                              int& count) {
    int lo = 0, hi = n_experts;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (tile_offsets[mid] <= tile) lo = mid;
        else hi = mid;
    }
    const int start = offsets[lo] + (tile - tile_offsets[lo]) * TM;
    count = min(TM, offsets[lo + 1] - start);
    for (int i = threadIdx.x; i < TM; i += blockDim.x) s_pair[i] = i < count ? sorted[start + i] : -1;
    __syncthreads();
    return lo;
}

// This thread's A copies of every chunk: staged row row0 + i · ROWS_PER_PASS (the tile's pair
// s_pair[..], A row pair / a_div), 16-byte piece `part`; empty slots zero-fill (0 bytes).
template <int A_SLOTS, int ROWS_PER_PASS>
__device__ __forceinline__ void moe_a_sources(const int* s_pair, int row0, int part, int a_div, int lda,
                                              long long (&a_off)[A_SLOTS], int (&a_bytes)[A_SLOTS]) {
#pragma unroll
    for (int i = 0; i < A_SLOTS; ++i) {
        const int p = s_pair[row0 + i * ROWS_PER_PASS];
        a_off[i] = p >= 0 ? (long long)(p / a_div) * lda + part * 8 : 0;
        a_bytes[i] = p >= 0 ? 16 : 0;
    }
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
                                         const int* __restrict__ tile_offsets, int n_experts, const MoeAct& act) {
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
    const int tid = threadIdx.x;
    int count;
    const int e = moe_tile_pairs<MOE_TM>(tile, sorted, offsets, tile_offsets, n_experts, s_pair, count);

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
    moe_a_sources<A_SLOTS, ROWS_PER_PASS>(s_pair, row0, part, a_div, lda, a_off, a_bytes);
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
                    const float v = o + c < n_out ? moe_act(act, e, o + c, gv, uv) : 0.0f;
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
#ifdef MOE_BASE
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_gate_up(const bf16_t* w13, int ldw, int inter, int hidden, const bf16_t* x_hi, const bf16_t* x_lo, int top_k,
                bf16_t* act_hi, bf16_t* act_lo, int inter_pad, const int* sorted, const int* offsets,
                const int* tile_offsets, int n_experts, MoeAct act) {
    moe_tile<true>(w13, (long long)2 * inter * ldw, ldw, inter, inter, hidden, x_hi, x_lo, ldw, top_k,
                               nullptr, act_hi, act_lo, inter_pad, sorted, offsets, tile_offsets, n_experts, act);
}
#endif

// ypair [n_pairs, hidden] from act halves [n_pairs, ldw] and w2 [E, hidden, ldw] (ldw = inter_pad).
#ifdef MOE_BASE
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_down(const bf16_t* w2, int ldw, int inter, int hidden, const bf16_t* act_hi, const bf16_t* act_lo,
             float* ypair, const int* sorted, const int* offsets, const int* tile_offsets, int n_experts) {
    moe_tile<false>(w2, (long long)hidden * ldw, ldw, hidden, 0, inter, act_hi, act_lo, ldw, 1, ypair,
                                nullptr, nullptr, hidden, sorted, offsets, tile_offsets, n_experts, MoeAct{});
}
#endif

// ---- Quantised experts: INT4 / INT8 weights in the GPU tile layout (krasis_quant::gpu_layout) ----
//
// The tiles compute what the CPU's expert kernels compute (krasis-cpu quant: value + residual
// activation rows), so a strategy that runs some experts on the CPU gives the logits of one that
// runs them all here, up to f32 summation order:
//   - activations (x, then the SwiGLU intermediate) are quantised per (row, weight group) into two
//     INT8 rows by moe_quant_rows, with the CPU quantiser's IEEE steps: the value q_hi (scale
//     s_hi = amax / 127) and its residual x − q_hi·s_hi quantised again (s_lo);
//   - weights are the stored integers q (INT4 nibbles as 16·q in the high half of a byte, INT8
//     bytes as q), so each group's products are exact integer sums on the tensor cores
//     (mma.sync m16n8k32 s8, s32 accumulators);
//   - once per group the sums become f32: y += sum·(s_w·s_x), value row and residual row; an
//     INT4 sum is 16 times the CPU's, so its activation scales are taken / 16 (exact).
// Same grouping and grid as the BF16 tiles, TM = 32 or 64 pairs a tile (2·TM staged A rows: a
// pair's value and residual rows in one 16-row slice, rows g and g + 8); weights: each (64-row panel,
// 64-k chunk) block is one contiguous 2 KiB (INT4) or 4 KiB (INT8) copy in fragment order (a lane
// reads one 4-byte word per n8 tile pair (INT4) or tile (INT8) and 16 k values); scales f16 per
// panel and group, each chunk staging the groups of its two 32-wide halves.
#define MOE_QPANEL 64  // rows of a panel (gpu_layout::PANEL_ROWS)
#define MOE_QCHUNK 64  // k of a chunk (gpu_layout::CHUNK_K)
#define MOE_QUANT_WARPS 4  // moe_quant_rows: groups per block (must match moe.rs)
// The weight format of the quantised kernels (their BITS template argument and the activation
// quantisers' `bits`): 4 INT4, 8 INT8, or a 4-bit float in the FP4 tile layout (gpu_layout.rs):
// MXFP4 (groups of 32) or NVFP4 (groups of 16), whose words are INT4's and whose activation rows
// take INT4's k order; their bytes hold 2·E2M1 and their f32 scales the ½, so the activation
// scales are not divided (INT4's bytes hold 16·q).
#define MOE_FMT_MXFP4 5  // must match moe.rs
#define MOE_FMT_NVFP4 6

// The order of a quantised activation row for weights of `bits`: the k at position p (within its
// 32-wide window). The stored weight fragments give lane (g, q) the k values {2q, 2q+1, 2q+8,
// 2q+9} of each 16-wide half h (the m16n8k16 order); an m16n8k32 s8 fragment takes positions
// 4q..4q+3 of register 0 (positions 0..15) and of register 1 (16..31). An integer dot product does
// not depend on the order of its terms, so the activations are stored permuted to the order in
// which the weights' fragments are built (i = p & 3, q = (p >> 2) & 3, r1 = (p >> 4) & 1):
//   INT8 (a word per half, as stored): k = 16·r1 + 8·(i >> 1) + 2q + (i & 1);
//   INT4 (int4_frags: low nibbles to register 0, high to 1) and FP4 (fp4_frags): k = 16·(i >> 1) +
//   8·r1 + 2q + (i & 1). So in either order bytes 0, 1 of a word are k < 16 of the 32-wide window
//   and bytes 2, 3 are k ≥ 16: NVFP4's two groups of 16 are byte masks of the same words.
__device__ __forceinline__ int moe_qk(int p, int bits) {
    const int i = p & 3, qq = (p >> 2) & 3, hi16 = (p >> 4) & 1;
    return bits != 8 ? (p & ~31) + 16 * (i >> 1) + 8 * hi16 + 2 * qq + (i & 1)
                     : (p & ~31) + 16 * hi16 + 8 * (i >> 1) + 2 * qq + (i & 1);
}

// The CPU's quantisation of one group (krasis-cpu quant/actq.rs group_body) of nw words of 4
// positions, value(p) the value at position p: amax over the |x| bit patterns, q =
// round-half-even(clamp(x · (127 / amax))), scale amax / 127; an all-zero group scale 0, a
// non-finite one NaN (q = 0). Every step is one IEEE operation (no contraction), so q and the
// scale are the CPU's bits. Lane l writes words l, l + 32, ... of dst (the values read twice,
// from cache, rather than held); returns the scale (all lanes).
template <typename F>
__device__ __forceinline__ float moe_quant_words(F value, int nw, int lane, u32* __restrict__ dst) {
    u32 m = 0;
    for (int w = lane; w < nw; w += 32)
#pragma unroll
        for (int c = 0; c < 4; ++c) m = max(m, __float_as_uint(value(4 * w + c)) & 0x7fffffffu);
    m = __reduce_max_sync(0xffffffffu, m);
    const float amax = __uint_as_float(m);
    const bool ok = m != 0 && m < 0x7f800000u;
    const float inv = ok ? __fdiv_rn(127.0f, amax) : 0.0f;
    for (int w = lane; w < nw; w += 32) {
        u32 word = 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            // 0 · inf (a subnormal amax) is NaN, which the CPU's clamp keeps and then zeroes.
            const float p = __fmul_rn(value(4 * w + c), inv);
            const float cl = p != p ? 0.0f : fminf(fmaxf(p, -127.0f), 127.0f);
            word |= (u32)((ok ? __float2int_rn(cl) : 0) & 0xff) << (8 * c);
        }
        dst[w] = word;
    }
    return m == 0 ? 0.0f : ok ? __fdiv_rn(amax, 127.0f) : __uint_as_float(0x7fc00000u);
}

// The value of one word of 4 positions quantised as moe_quant_words does, given the group's
// amax bits m (from the warp's reduction): the word of 4 bytes, with q (as floats) kept in qf.
// m1: the amax of positions 2 and 3 when they are another group's (NVFP4's groups of 16), else m.
__device__ __forceinline__ u32 moe_quant_word(const float* v, u32 m, float* qf, u32 m1) {
    // The two groups' reciprocals once (one when m1 == m, the integer formats' case), not per position.
    const bool ok0 = m != 0 && m < 0x7f800000u, ok1 = m1 != 0 && m1 < 0x7f800000u;
    const float inv0 = ok0 ? __fdiv_rn(127.0f, __uint_as_float(m)) : 0.0f;
    const float inv1 = m1 == m ? inv0 : ok1 ? __fdiv_rn(127.0f, __uint_as_float(m1)) : 0.0f;
    u32 word = 0;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const bool ok = c < 2 ? ok0 : ok1;
        const float p = __fmul_rn(v[c], c < 2 ? inv0 : inv1);
        const float cl = p != p ? 0.0f : fminf(fmaxf(p, -127.0f), 127.0f);
        const int q = ok ? __float2int_rn(cl) : 0;
        qf[c] = (float)q;
        word |= (u32)(q & 0xff) << (8 * c);
    }
    return word;
}

// The largest |x| bit pattern of a word's values c0 .. c1 − 1 over the warp (lanes past the group
// give 0).
__device__ __forceinline__ u32 moe_quant_amax(const float* v, bool active, int c0 = 0, int c1 = 4) {
    u32 m = 0;
#pragma unroll
    for (int c = 0; c < 4; ++c)
        if (c >= c0 && c < c1) m = max(m, __float_as_uint(v[c]) & 0x7fffffffu);
    return __reduce_max_sync(0xffffffffu, active ? m : 0u);
}

__device__ __forceinline__ float moe_quant_scale(u32 m) {
    const bool ok = m != 0 && m < 0x7f800000u;
    return m == 0 ? 0.0f : ok ? __fdiv_rn(__uint_as_float(m), 127.0f) : __uint_as_float(0x7fc00000u);
}

// moe_quant_split for a group of at most 128 values (a word of 4 positions per lane, at most):
// the same IEEE steps on values held in registers, so the same bytes and scales, with each value
// loaded once and the residual formed from the q in registers (no read back of hi). Why: the
// looping form re-derived each position and re-read each value four times, and the SwiGLU
// intermediate's quantisation ran at ~1/5 of the memory bandwidth (ncu, 2K-token prefill).
__device__ __forceinline__ float2 moe_quant_split_word(const float* __restrict__ xg, int kn, int gs, int lane,
                                                       signed char* __restrict__ hi, signed char* __restrict__ lo,
                                                       int bits) {
    const bool active = lane < gs / 4;
    float v[4], qf[4], r[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const int k = moe_qk(4 * lane + c, bits);
        v[c] = active && k < kn ? xg[k] : 0.0f;
    }
    const u32 m_hi = moe_quant_amax(v, active);
    const u32 w_hi = moe_quant_word(v, m_hi, qf, m_hi);
    const float s_hi = moe_quant_scale(m_hi);
#pragma unroll
    for (int c = 0; c < 4; ++c) r[c] = __fsub_rn(v[c], __fmul_rn(qf[c], s_hi));
    const u32 m_lo = moe_quant_amax(r, active);
    const u32 w_lo = moe_quant_word(r, m_lo, qf, m_lo);
    if (active) {
        ((u32*)hi)[lane] = w_hi;
        ((u32*)lo)[lane] = w_lo;
    }
    const float unit = bits == 4 ? 0.0625f : 1.0f;
    return make_float2(s_hi * unit, moe_quant_scale(m_lo) * unit);
}

// NVFP4's groups of 16 (the CPU's activation groups for it too): one warp quantises the 32-wide
// window at xw (kn values, zero past them) as moe_quant_split_word does a group, each of its two
// groups with its own amax, in the INT4 k order, where a word's bytes 0, 1 are the first group's
// (k < 16) and bytes 2, 3 the second's. Returns (s_hi, s_lo) of the first group, then the second's.
__device__ __forceinline__ float4 moe_quant_split16(const float* __restrict__ xw, int kn, int lane,
                                                    signed char* __restrict__ hi, signed char* __restrict__ lo) {
    const bool active = lane < 8;
    float v[4], qf[4], r[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const int k = moe_qk(4 * lane + c, 4);
        v[c] = active && k < kn ? xw[k] : 0.0f;
    }
    const u32 ma = moe_quant_amax(v, active, 0, 2), mb = moe_quant_amax(v, active, 2, 4);
    const u32 w_hi = moe_quant_word(v, ma, qf, mb);
    const float sa = moe_quant_scale(ma), sb = moe_quant_scale(mb);
#pragma unroll
    for (int c = 0; c < 4; ++c) r[c] = __fsub_rn(v[c], __fmul_rn(qf[c], c < 2 ? sa : sb));
    const u32 la = moe_quant_amax(r, active, 0, 2), lb = moe_quant_amax(r, active, 2, 4);
    const u32 w_lo = moe_quant_word(r, la, qf, lb);
    if (active) {
        ((u32*)hi)[lane] = w_hi;
        ((u32*)lo)[lane] = w_lo;
    }
    return make_float4(sa, moe_quant_scale(la), sb, moe_quant_scale(lb));
}

// One group of an activation row as the CPU quantises it (krasis-cpu moe.rs quantize_acts_split):
// xg's first kn values (zero past them, gs in all) into the value row hi and, from the residual
// x − q·s_hi (one multiply, one subtraction, as the CPU forms it), the residual row lo, both in
// the moe_qk order of weights of `bits`, whole words; returns (s_hi, s_lo), for INT4 weights
// (bytes of 16·q) divided by 16 (exact: a power of two). One warp; hi and lo 4-byte aligned.
__device__ __forceinline__ float2 moe_quant_split(const float* __restrict__ xg, int kn, int gs, int lane,
                                                  signed char* __restrict__ hi, signed char* __restrict__ lo,
                                                  int bits) {
    if (gs <= 128) return moe_quant_split_word(xg, kn, gs, lane, hi, lo, bits);
    auto xv = [&](int p) {
        const int k = moe_qk(p, bits);
        return k < kn ? xg[k] : 0.0f;
    };
    const float s_hi = moe_quant_words(xv, gs / 4, lane, (u32*)hi);
    __syncwarp();
    // q read back from the lane's own words of hi.
    auto rv = [&](int p) { return __fsub_rn(xv(p), __fmul_rn((float)hi[p], s_hi)); };
    const float s_lo = moe_quant_words(rv, gs / 4, lane, (u32*)lo);
    const float unit = bits == 4 ? 0.0625f : 1.0f;
    return make_float2(s_hi * unit, s_lo * unit);
}

// x [rows, ldx] f32 (k values a row, zero past k) -> q [rows, 2, ldq] INT8 (value row, residual
// row, each in the moe_qk order of weights of `bits`; ldq = ng · gs, a multiple of 32) and
// scales [rows, ng] as (s_hi, s_lo) (for INT4 weights, whose bytes hold 16·q, divided by 16).
// Launch: grid (rows, ceil(ng / MOE_QUANT_WARPS)), 32 · MOE_QUANT_WARPS threads; warp w quantises
// group blockIdx.y · MOE_QUANT_WARPS + w; for gs = 16, grid (rows, ceil(ng / 2 / MOE_QUANT_WARPS))
// and warp w the window of groups 2w, 2w + 1 (moe_quant_split16).
#ifdef MOE_BASE
extern "C" __global__ void moe_quant_rows(const float* __restrict__ x, int k, int ldx, int gs, int ng,
                                          signed char* __restrict__ q, int ldq, float2* __restrict__ scales,
                                          int bits) {
    const int grp = blockIdx.y * MOE_QUANT_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const long long row = blockIdx.x;
    if (gs == 16) {  // NVFP4: warp grp quantises window grp, groups 2·grp and 2·grp + 1
        if (2 * grp >= ng) return;  // uniform over the warp
        const int k0 = 32 * grp;
        signed char* hi = q + row * 2 * ldq + k0;
        const float4 s = moe_quant_split16(x + row * ldx + k0, min(32, max(k - k0, 0)), lane, hi, hi + ldq);
        if (lane == 0) {
            scales[row * ng + 2 * grp] = make_float2(s.x, s.y);
            scales[row * ng + 2 * grp + 1] = make_float2(s.z, s.w);
        }
        return;
    }
    if (grp >= ng) return;  // uniform over the warp
    const int k0 = grp * gs;
    signed char* hi = q + row * 2 * ldq + k0;
    const float2 s = moe_quant_split(x + row * ldx + k0, min(gs, max(k - k0, 0)), gs, lane, hi, hi + ldq, bits);
    if (lane == 0) scales[row * ng + grp] = s;
}
#endif

// d[16x8] += a[16x32] · b[32x8], s8 x s8 -> s32 (fragments as the PTX ISA's m16n8k32).
__device__ __forceinline__ void mma_s8(int* d, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// d = a · b + c0 (every element of C is c0): a flush period's first product.
__device__ __forceinline__ void mma_s8_from(int* d, const u32* a, u32 b0, u32 b1, int c0) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c0));
}
// Each byte's high nibble u (a stored INT4 value, q + 8) as the s8 byte 16·q = (u << 4) − 128:
// (v & 0xf0f0f0f0) ^ 0x80808080 in one lop3 (the constants in registers).
__device__ __forceinline__ u32 int4_hi16(u32 v) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;\n" : "=r"(d) : "r"(v), "r"(0xf0f0f0f0u), "r"(0x80808080u));
    return d;
}
// The s8 fragments (16·q bytes) of INT4 tiles t (ft) and t + 1 (fu) for one k32 step from the
// tile pair's words of k16 steps 2kk (w0) and 2kk + 1 (w1). A word holds tile t in nibbles 0, 4,
// 1, 5 (bytes 0 and 2) and tile t + 1 in nibbles 2, 6, 3, 7 (bytes 1 and 3); gathering a tile's
// bytes of both words puts its low nibbles in register 0 and its high nibbles in register 1, the
// order moe_qk(p, 4) gives the activations. 8 operations for 4 fragments.
__device__ __forceinline__ void int4_frags(u32 w0, u32 w1, u32 (&ft)[2], u32 (&fu)[2]) {
    const u32 t = __byte_perm(w0, w1, 0x6420), u = __byte_perm(w0, w1, 0x7531);
    ft[0] = int4_hi16(t << 4);
    ft[1] = int4_hi16(t);
    fu[0] = int4_hi16(u << 4);
    fu[1] = int4_hi16(u);
}
// FP4: the four E2M1 codes in the low 16 bits of c (code i in bits 4i..4i+3, sign in bit 3) as
// the s8 bytes 2·E2M1 (0, ±1, ±2, ±3, ±4, ±6, ±8, ±12). prmt looks a selector nibble's low 3
// bits up in the 8 table bytes; with bit 3 set it gives the byte's sign instead (0 here: the
// table is non-negative). So p holds the positive codes' magnitudes (0 for negative codes) and n,
// from the selectors with bit 3 flipped, the negative codes' magnitudes; then bytewise p − n with
// no borrow between bytes (every byte of p | 0x80.. is ≥ 128, every byte of n ≤ 12).
#define FP4_LUT_LO 0x03020100u  // 2·E2M1 of codes 0..3
#define FP4_LUT_HI 0x0c080604u  // codes 4..7
__device__ __forceinline__ u32 fp4_s8(u32 c) {
    u32 p, n;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(p) : "r"(FP4_LUT_LO), "r"(FP4_LUT_HI), "r"(c));
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(n) : "r"(FP4_LUT_LO), "r"(FP4_LUT_HI), "r"(c ^ 0x8888u));
    return ((p | 0x80808080u) - n) ^ 0x80808080u;
}
// The s8 fragments of FP4 tiles t (ft) and t + 1 (fu) for one k32 step, from the tile pair's two
// words (gpu_layout.rs: w0 holds register 0 of tile t in bits 0..15 and of tile t + 1 in 16..31,
// w1 their register 1), in the order int4_frags gives.
__device__ __forceinline__ void fp4_frags(u32 w0, u32 w1, u32 (&ft)[2], u32 (&fu)[2]) {
    ft[0] = fp4_s8(w0);
    fu[0] = fp4_s8(w0 >> 16);
    ft[1] = fp4_s8(w1);
    fu[1] = fp4_s8(w1 >> 16);
}
// A weight format's s8 fragments of a tile pair (INT4 or FP4 words).
template <int BITS>
__device__ __forceinline__ void q4_frags(u32 w0, u32 w1, u32 (&ft)[2], u32 (&fu)[2]) {
    if (BITS == 4)
        int4_frags(w0, w1, ft, fu);
    else
        fp4_frags(w0, w1, ft, fu);
}
// The byte mask of NVFP4's group h (0: k < 16, 1: k ≥ 16) of a 32-wide window in a fragment
// register (moe_qk's INT4 order).
__device__ __forceinline__ u32 g16_mask(int h) { return h ? 0xffff0000u : 0x0000ffffu; }
// Bits of one stored weight: 8 for INT8, else 4 (INT4, FP4).
#define MOE_WBITS(BITS) ((BITS) == 8 ? 8 : 4)
// An INT8 word's 4 bytes (stored u = q + 128) as s8 q: u − 128 is the sign bit flipped.
__device__ __forceinline__ u32 int8_s8(u32 w) { return w ^ 0x80808080u; }
#define MOE_MAGIC_I 0x4B400000   // bits of 1.5 · 2^23: an int acc started here holds 1.5·2^23 + s as
#define MOE_MAGIC_F 12582912.0f  // float bits while |s| < 2^22, true for up to MOE_MAGIC_GS k values
#define MOE_MAGIC_GS 256         // (|s| ≤ 256 · 127 · 127; INT4 16 · 7 · 127)

__device__ __forceinline__ u32 lds32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

// One k32 step of a warp's 4 slices (A fragments from the staged rows at a, slice m at 16·m rows)
// by its 4 tiles' B fragments b. FRESH: the step opens a flush period, its sums start at MOE_MAGIC.
// Every slice, empty ones too (zero rows): straight-line code the scheduler can interleave (a break
// on empty slices cost more than the idle products).
template <bool FRESH, int QSK>
__device__ __forceinline__ void moe_qproducts(int (&acc)[4][4][4], u32 a, const u32 (&b)[4][2]) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        u32 fa[4];
        ldmatrix_x4(fa, a + m * 16 * QSK);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (FRESH)
                mma_s8_from(acc[m][j], fa, b[j][0], b[j][1], MOE_MAGIC_I);
            else
                mma_s8(acc[m][j], fa, b[j][0], b[j][1]);
        }
    }
}

// One tile of TM pairs of one expert, quantised weights; PB panels of 64 rows per block,
// 2·PB·TM/32 warps, S shared-memory buffers of CPS chunks each (a stage); YS: the f32 results in
// shared memory, not registers. GATED: gate panels G·blockIdx.y + i and up panels n_panels / 2 +
// G·blockIdx.y + i (i < G = PB / 2) of w13 (gate rows then up rows, each padded to whole panels);
// act = silu(gate) * up to out[p, ldo] (f32) for every column of the block's 64·G columns (zero
// past n_out). Else panels PB·blockIdx.y + i of w2 to out[p, ldo] for columns below n_out. Panels
// past the matrix, and chunks past K in the last stage, are zero-filled. A: the quantised rows of
// moe_quant_rows, a[(p / a_div), 2, lda] (lda = the padded K = chunks · 64) with a_scales[p /
// a_div, a_ng]; staged per stage as 2·TM rows (slice m = rows 16m..: pair slot 8m + i's value row
// i and residual row 8 + i).
//
// Warp w = 2·PB·h + v takes slices 4h..4h + 3 (pairs 32h..; h = 0 for TM = 32) and column set v:
// it unpacks only its 4 n8 tiles (GATED: tiles 2(v%4), +1 of gate panel v/4 and the same up
// tiles; else tiles 4(v%2)..+3 of panel v/2) and multiplies them by its 4 slices. Each output is one thread's f32 sum
// over the groups in order, so the result does not depend on timing.
template <bool GATED, int BITS, int TM, int PB, int S, int CPS, bool YS>
__device__ __forceinline__ void moe_qtile(const unsigned char* __restrict__ w, const unsigned short* __restrict__ sc,
                                          long long expert_wbytes, long long expert_scales, int chunks, int groups,
                                          int gs, int n_panels, int n_out, const signed char* __restrict__ a,
                                          const float2* __restrict__ a_scales, int a_ng, int lda, int a_div,
                                          float* __restrict__ out, int ldo, const int* __restrict__ sorted,
                                          const int* __restrict__ offsets, const int* __restrict__ tile_offsets,
                                          int n_experts, const MoeAct& act) {
    static_assert(MOE_BN == MOE_QPANEL && MOE_BN_DOWN == 2 * MOE_QPANEL, "a block is two panels");
    static_assert((TM == 32 || TM == 64) && PB % 2 == 0, "slices of 8 pairs, 4 a warp; gate and up panels in pairs");
    constexpr int THREADS = 2 * TM * PB, G = PB / 2;
    constexpr bool FP4 = BITS == MOE_FMT_MXFP4 || BITS == MOE_FMT_NVFP4;
    constexpr int GPS = BITS == MOE_FMT_NVFP4 ? 2 : 1;  // scale groups a k32 step covers
    constexpr int SB = FP4 ? 4 : 2;                      // bytes of a weight scale (f32, f16)
    constexpr int BLOCK = MOE_QPANEL * MOE_QCHUNK * MOE_WBITS(BITS) / 8;  // bytes of a (panel, chunk) block
    constexpr int PANEL_BYTES = CPS * BLOCK;                   // a panel's blocks of a stage
    constexpr int KS = CPS * MOE_QCHUNK, STEPS = KS / 32;       // k and k32 steps of a stage
    constexpr int QSK = KS + 16;  // byte stride of a staged A row: a warp's ldmatrix rows (8 x 16
                                  // bytes) hit 32 different banks
    constexpr int W_BYTES = PB * PANEL_BYTES;
    constexpr int S_PIECES = MOE_QPANEL * SB * GPS / 16;     // 16-byte scale copies per panel and step
    constexpr int S_BYTES = PB * STEPS * S_PIECES * 16;      // per panel and step the scales of its group(s)
    constexpr int X_AT = W_BYTES + S_BYTES;                  // per pair slot and step its (s_hi, s_lo) per group
    constexpr int A_AT = X_AT + TM * STEPS * 8 * GPS;
    constexpr int A_ROWS = 2 * TM;
    constexpr int STAGE_BYTES = A_AT + A_ROWS * QSK;
    constexpr int W_COPIES = W_BYTES / 16 / THREADS;
    constexpr int PARTS = KS / 16, ROWS_PER_PASS = THREADS / PARTS, A_SLOTS = A_ROWS / ROWS_PER_PASS;
    static_assert(W_BYTES % (16 * THREADS) == 0 && S_BYTES / 16 <= THREADS && TM * STEPS <= THREADS, "whole copies");
    static_assert(A_ROWS % ROWS_PER_PASS == 0, "whole A staging passes");
    static_assert(STAGE_BYTES % 16 == 0 && A_AT % 16 == 0, "16-byte aligned staging");
    __shared__ int s_pair[TM];
    extern __shared__ __align__(16) unsigned char moe_smem[];  // S buffers (moe.rs: qtile_smem)

    const int tile = blockIdx.x;
    if (tile >= tile_offsets[n_experts]) return;  // uniform over the block
    const int tid = threadIdx.x;
    int count;
    const int e = moe_tile_pairs<TM>(tile, sorted, offsets, tile_offsets, n_experts, s_pair, count);

    // Staged panel i (< PB) of this block, or -1 past the matrix.
    auto panel_of = [&](int i) {
        if (GATED) {
            const int gp = G * (int)blockIdx.y + i % G;
            return gp < n_panels / 2 ? (i < G ? gp : n_panels / 2 + gp) : -1;
        }
        const int pn = PB * (int)blockIdx.y + i;
        return pn < n_panels ? pn : -1;
    };
    const unsigned char* we = w + (long long)e * expert_wbytes;
    const unsigned char* se = (const unsigned char*)sc + (long long)e * expert_scales * SB;
    // This thread's copies, worked out once: weight piece (i · THREADS + tid) of the stage's PB
    // panels (chunk w_chunk[i] of the stage); scale piece tid (< S_PIECES·STEPS·PB: panel tid /
    // (S_PIECES·STEPS), step (tid / S_PIECES) % STEPS, 16 bytes tid % S_PIECES of the step's groups);
    // A piece tid % PARTS of staged rows tid / PARTS + i · ROWS_PER_PASS. Sources advance by
    // PANEL_BYTES (weights) or KS (A) per stage.
    const unsigned char* w_src[W_COPIES];
    int w_bytes[W_COPIES], w_chunk[W_COPIES];
#pragma unroll
    for (int i = 0; i < W_COPIES; ++i) {
        const int off = (i * THREADS + tid) * 16;
        const int pn = panel_of(off / PANEL_BYTES);
        w_src[i] = pn >= 0 ? we + (long long)pn * chunks * BLOCK + off % PANEL_BYTES : we;
        w_bytes[i] = pn >= 0 ? 16 : 0;
        w_chunk[i] = off % PANEL_BYTES / BLOCK;
    }
    const int s_panel = tid < S_BYTES / 16 ? panel_of(tid / (S_PIECES * STEPS)) : -1;
    const int s_step = (tid / S_PIECES) % STEPS;
    const bool s_ok = s_panel >= 0;
    const unsigned char* s_src = se + (long long)max(s_panel, 0) * groups * MOE_QPANEL * SB + (tid % S_PIECES) * 16;
    const int part = tid % PARTS, row0 = tid / PARTS;
    long long a_off[A_SLOTS];
    int a_bytes[A_SLOTS];
#pragma unroll
    for (int i = 0; i < A_SLOTS; ++i) {
        const int r = row0 + i * ROWS_PER_PASS;  // slice r / 16, slot 8 (r / 16) + r % 8, row half (r / 8) % 2
        const int p = s_pair[8 * (r / 16) + r % 8];
        a_off[i] = p >= 0 ? ((long long)(p / a_div) * 2 + (r / 8) % 2) * lda + part * 16 : 0;
        a_bytes[i] = p >= 0 ? 16 : 0;
    }
    // Activation scales: thread tid < STEPS·TM copies slot tid / STEPS's pair for step tid % STEPS.
    const int x_pair = tid < STEPS * TM ? s_pair[tid / STEPS] : -1;
    const float2* x_src = a_scales + (long long)max(x_pair, 0) / a_div * a_ng;
    const u32 smem0 = smem_addr(moe_smem);
    // k32 steps per group (gs is a multiple of 32, at most 1024): a step's group by a multiply-high
    // with ceil(2^32 / spg), exact while step · spg < 2^32 (the integer divisions cost ~25
    // instructions each in the k loop).
    const int spg = gs >> 5;
    const u32 spg_magic = spg > 1 ? 0xffffffffu / (u32)spg + 1u : 0u;
    auto group_of_step = [&](int step) {
        return GPS == 2 ? 2 * step : spg > 1 ? (int)__umulhi((u32)step, spg_magic) : step;
    };
    // Stage c (chunks CPS·c ..) into buffer b; steps past K (an odd chunk count's last stage) are
    // zero-filled, weights, scales and activations alike, so they add nothing.
    const int steps = 2 * chunks;
    auto stage = [&](int c, int b) {
        const u32 dst = smem0 + b * STAGE_BYTES;
        if (tid < STEPS * TM) {
            const int step = STEPS * c + tid % STEPS;
            const bool ok = x_pair >= 0 && step < steps;
            if (GPS == 2)  // both groups' pairs: 16 bytes (a_ng even, so 16-byte aligned)
                cp_async16_at(dst + X_AT + tid * 16, ok ? x_src + group_of_step(step) : x_src, ok ? 16 : 0);
            else
                asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst + X_AT + tid * 8),
                             "l"(ok ? x_src + group_of_step(step) : x_src), "r"(ok ? 8 : 0)
                             : "memory");
        }
#pragma unroll
        for (int i = 0; i < W_COPIES; ++i) {
            const bool ok = w_bytes[i] && (CPS == 1 || CPS * c + w_chunk[i] < chunks);
            cp_async16_at(dst + (i * THREADS + tid) * 16, ok ? w_src[i] + (long long)c * PANEL_BYTES : we, ok ? 16 : 0);
        }
        if (tid < S_BYTES / 16) {
            const int step = STEPS * c + s_step;
            const bool ok = s_ok && step < steps;
            cp_async16_at(dst + W_BYTES + tid * 16,
                          ok ? s_src + (long long)group_of_step(step) * MOE_QPANEL * SB : se, ok ? 16 : 0);
        }
        const int k0 = c * KS;
#pragma unroll
        for (int i = 0; i < A_SLOTS; ++i) {
            const bool ok = a_bytes[i] && (CPS == 1 || k0 + part * 16 < lda);
            cp_async16_at(dst + A_AT + (row0 + i * ROWS_PER_PASS) * QSK + part * 16, a + (ok ? a_off[i] + k0 : 0),
                          ok ? 16 : 0);
        }
    };

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int m0 = 4 * (warp / (2 * PB)), v = warp % (2 * PB);  // the warp's slices and column set
    const int slices = min(max((count + 7) / 8 - m0, 0), 4);   // its slices holding a pair (uniform)
    // The warp's 4 n8 tiles as (staged panel, tile in panel): GATED (v/4, tt0), (v/4, tt0 + 1),
    // (G + v/4, tt0), (G + v/4, tt0 + 1) with tt0 = 2(v % 4); else (v / 2, 4(v % 2) + j).
    const int tp0 = GATED ? v / 4 : v / 2, tt0 = GATED ? 2 * (v % 4) : 4 * (v % 2);
    // Sums flush every group, and every MOE_MAGIC_GS within larger groups (same scales), so they
    // always convert by MOE_MAGIC: every flush_steps k32 steps; ph counts the steps of the period.
    const int flush_steps = min(gs, MOE_MAGIC_GS) >> 5;
    int ph = 0;
    int acc[4][4][4];    // [slice][tile j][fragment]: the current flush period's integer sums
    // The f32 results so far, [slice][tile j][column 2q + cc]: in registers, or (YS) in shared
    // memory after the buffers, float4 i of a lane at ys[32·i] holding slice i / 2, tiles 2(i % 2)
    // and 2(i % 2) + 1 (32 registers fewer for the products and the staging).
    float y[YS ? 1 : 4][4][2];
    float4* ys = (float4*)(moe_smem + S * STAGE_BYTES) + warp * 8 * 32 + lane;
    auto y_load = [&](int m, float (&r)[4][2]) {
        if constexpr (YS) {
            const float4 u = ys[32 * (2 * m)], w = ys[32 * (2 * m + 1)];
            r[0][0] = u.x, r[0][1] = u.y, r[1][0] = u.z, r[1][1] = u.w;
            r[2][0] = w.x, r[2][1] = w.y, r[3][0] = w.z, r[3][1] = w.w;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) r[j][0] = y[m][j][0], r[j][1] = y[m][j][1];
        }
    };
    auto y_store = [&](int m, const float (&r)[4][2]) {
        if constexpr (YS) {
            ys[32 * (2 * m)] = make_float4(r[0][0], r[0][1], r[1][0], r[1][1]);
            ys[32 * (2 * m + 1)] = make_float4(r[2][0], r[2][1], r[3][0], r[3][1]);
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) y[m][j][0] = r[j][0], y[m][j][1] = r[j][1];
        }
    };
#pragma unroll
    for (int m = 0; m < 4; ++m) y_store(m, {{0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}});
    // ldmatrix row address of this lane for A slice 0 (slice m adds 16 rows).
    const u32 a_at = (u32)(A_AT + ((lane & 7) + 8 * ((lane >> 3) & 1)) * QSK + 16 * (lane >> 4));

    const int n_stages = (chunks + CPS - 1) / CPS;
#pragma unroll
    for (int c = 0; c < S - 1; ++c) {
        if (c < n_stages) stage(c, c);
        cp_async_commit();
    }
    for (int c = 0; c < n_stages; ++c) {
        cp_async_wait<S - 2>();
        __syncthreads();
        const int nc = c + S - 1;
        if (nc < n_stages) stage(nc, nc % S);
        cp_async_commit();
        const u32 buf = smem0 + (c % S) * STAGE_BYTES;
#pragma unroll
        for (int kk = 0; kk < STEPS; ++kk) {
            // B fragments of the warp's 4 tiles (k16 steps 2(kk % 2) and 2(kk % 2) + 1 of chunk
            // kk / 2), used for every slice; an INT4 or FP4 word holds a tile pair (tiles j and
            // j + 1 of the same panel: t even, t + 1).
            u32 b[4][2];
            const int ks0 = 2 * (kk % 2);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int pp = GATED ? tp0 + (j / 2) * G : tp0, t = GATED ? tt0 + j % 2 : tt0 + j;
                const u32 wb = buf + pp * PANEL_BYTES + (kk / 2) * BLOCK;
                if (MOE_WBITS(BITS) == 4) {
                    if (j % 2 == 0) {
                        const u32 w0 = lds32(wb + ((ks0 * 4 + t / 2) * 32 + lane) * 4);
                        const u32 w1 = lds32(wb + (((ks0 + 1) * 4 + t / 2) * 32 + lane) * 4);
                        q4_frags<BITS>(w0, w1, b[j], b[j + 1]);
                    }
                } else {
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        b[j][h] = int8_s8(lds32(wb + (((ks0 + h) * 8 + t) * 32 + lane) * 4));
                }
            }
            const u32 a_kk = buf + a_at + m0 * 16 * QSK + kk * 32;
            // A group's sums into y, times s_w (its staged scales) and s_x (value row and residual
            // row): group h of the step's GPS.
            auto flush = [&](int h) {
                float sw[4][2];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int pp = GATED ? tp0 + (j / 2) * G : tp0, t = GATED ? tt0 + j % 2 : tt0 + j;
                    // Staged scale of panel row rr at (rr % 8) · 8 + rr / 8; rr = 8t + 2q + cc.
#pragma unroll
                    for (int cc = 0; cc < 2; ++cc) {
                        const u32 at =
                            buf + W_BYTES + (((pp * STEPS + kk) * GPS + h) * MOE_QPANEL + (2 * q + cc) * 8 + t) * SB;
                        if (FP4) {
                            asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(sw[j][cc]) : "r"(at) : "memory");
                        } else {
                            unsigned short hb;
                            asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(hb) : "r"(at) : "memory");
                            asm("cvt.f32.f16 %0, %1;\n" : "=f"(sw[j][cc]) : "h"(hb));
                        }
                    }
                }
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    float2 sx;
                    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                                 : "=f"(sx.x), "=f"(sx.y)
                                 : "r"(buf + X_AT + (((8 * (m0 + m) + g) * STEPS + kk) * GPS + h) * 8)
                                 : "memory");
                    float r[4][2];
                    y_load(m, r);
#pragma unroll
                    for (int j = 0; j < 4; ++j)
#pragma unroll
                        for (int cc = 0; cc < 2; ++cc) {
                            const float dh = __int_as_float(acc[m][j][cc]) - MOE_MAGIC_F;
                            const float dl = __int_as_float(acc[m][j][2 + cc]) - MOE_MAGIC_F;
                            r[j][cc] = fmaf(fmaf(dh, sx.x, dl * sx.y), sw[j][cc], r[j][cc]);
                        }
                    y_store(m, r);
                }
            };
            if (GPS == 2) {
                // NVFP4: each group of 16 is its own flush period, its products over the B bytes
                // of its half of the window (the other half masked to zero).
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    u32 bm[4][2];
#pragma unroll
                    for (int j = 0; j < 4; ++j) bm[j][0] = b[j][0] & g16_mask(h), bm[j][1] = b[j][1] & g16_mask(h);
                    moe_qproducts<true, QSK>(acc, a_kk, bm);
                    flush(h);
                }
                continue;
            }
            // The first step of a flush period starts its sums at MOE_MAGIC (no separate reset);
            // one branch a step, not one a slice.
            if (ph == 0)
                moe_qproducts<true, QSK>(acc, a_kk, b);
            else
                moe_qproducts<false, QSK>(acc, a_kk, b);
            // The end of a group (gs divides the padded K, so the last step ends one).
            if (++ph == flush_steps) {
                ph = 0;
                flush(0);
            }
        }
    }
    // Result [m][j][cc]: pair slot 8(m0 + m) + g, column 8·t_j + 2q + cc of tile j's panel.
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        if (m >= slices) break;
        const int p = s_pair[8 * (m0 + m) + g];
        if (p < 0) continue;
        float r[4][2];
        y_load(m, r);
        if (GATED) {
            if (G * (int)blockIdx.y + tp0 >= n_panels / 2) continue;  // a gate panel past the matrix
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int o = (G * blockIdx.y + tp0) * MOE_QPANEL + (tt0 + j) * 8 + 2 * q;
                float v[2];
#pragma unroll
                for (int cc = 0; cc < 2; ++cc) {
                    const float gv = r[j][cc], uv = r[j + 2][cc];
                    v[cc] = o + cc < n_out ? moe_act(act, e, o + cc, gv, uv) : 0.0f;
                }
                *(float2*)(out + (long long)p * ldo + o) = make_float2(v[0], v[1]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int o = blockIdx.y * PB * MOE_QPANEL + v * 32 + j * 8 + 2 * q;
#pragma unroll
                for (int cc = 0; cc < 2; ++cc) {
                    if (o + cc < n_out) out[(long long)p * ldo + o + cc] = r[j][cc];
                }
            }
        }
    }
}

// act [n_pairs, inter_pad] (f32) from x quantised (moe_quant_rows: xq [tokens, 2, ldx], xs
// [tokens, x_ng]) and w13 in the GPU tile layout (rows 2 · inter_pad: gate then up; expert
// stride expert_wbytes bytes, expert_scales scales). moe_q*_down: ypair [n_pairs, hidden] (f32)
// from act quantised (aq [n_pairs, 2, inter_pad], as [n_pairs, a_ng]) and w2 in the GPU tile
// layout (rows hidden, K inter_pad). Entry points per width and (PB, S) variant V:
// moe_q{BITS}_{gate_up,down}_v{V}.
#define MOE_Q_ENTRIES(NAME, BITS, V, TM, PB, S, CPS, YS, MINB)                                                                       \
    extern "C" __global__ void __launch_bounds__(2 * TM * PB, MINB) moe_q##NAME##_gate_up_v##V(                          \
        const unsigned char* w13, const unsigned short* s13, long long expert_wbytes, long long expert_scales,      \
        int chunks, int groups, int gs, int n_panels, int inter, const signed char* xq, const float2* xs, int x_ng, \
        int ldx, int top_k, float* act, int inter_pad, const int* sorted, const int* offsets,                      \
        const int* tile_offsets, int n_experts, MoeAct fn) {                                                        \
        moe_qtile<true, BITS, TM, PB, S, CPS, YS>(w13, s13, expert_wbytes, expert_scales, chunks, groups, gs, n_panels, inter,  \
                                     xq, xs, x_ng, ldx, top_k, act, inter_pad, sorted, offsets, tile_offsets,      \
                                     n_experts, fn);                                                                \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(2 * TM * PB, MINB) moe_q##NAME##_down_v##V(                            \
        const unsigned char* w2, const unsigned short* s2, long long expert_wbytes, long long expert_scales,        \
        int chunks, int groups, int gs, int n_panels, int hidden, const signed char* aq, const float2* as, int a_ng, \
        int inter_pad, float* ypair, const int* sorted, const int* offsets, const int* tile_offsets,               \
        int n_experts) {                                                                                            \
        moe_qtile<false, BITS, TM, PB, S, CPS, YS>(w2, s2, expert_wbytes, expert_scales, chunks, groups, gs, n_panels, hidden,  \
                                      aq, as, a_ng, inter_pad, 1, ypair, hidden, sorted, offsets, tile_offsets,    \
                                      n_experts, MoeAct{});                                                         \
    }
// All 32-pair tiles of 4 panels (8 warps), two blocks an SM. v0: 3 buffers of one chunk, results
// in registers (spills a little at 128); v1: the same with the results in shared memory (the
// default, moe.rs: QTILE_VARIANTS); v2: 2 buffers of two chunks, results in shared memory.
#if MOE_QTILES == 4
MOE_Q_ENTRIES(4, 4, 0, 32, 4, 3, 1, false, 2)
MOE_Q_ENTRIES(4, 4, 1, 32, 4, 3, 1, true, 2)
MOE_Q_ENTRIES(4, 4, 2, 32, 4, 2, 2, true, 2)
#elif MOE_QTILES == 8
MOE_Q_ENTRIES(8, 8, 0, 32, 4, 3, 1, false, 2)
MOE_Q_ENTRIES(8, 8, 1, 32, 4, 3, 1, true, 2)
MOE_Q_ENTRIES(8, 8, 2, 32, 4, 2, 2, true, 2)
#elif MOE_QTILES == 5
// The FP4 formats: the default shape (v1) only; NVFP4's two groups a step fill its scale copies
// (one 16-byte copy a thread), which a two-chunk stage (v2) would exceed.
MOE_Q_ENTRIES(mx, MOE_FMT_MXFP4, 1, 32, 4, 3, 1, true, 2)
MOE_Q_ENTRIES(nv, MOE_FMT_NVFP4, 1, 32, 4, 3, 1, true, 2)
#endif

// Decode path for quantised weights (few pairs): no grouping; block (pair, output panel) reads
// its expert's panel (GATED: the gate panel and the matching up panel) once, coalesced (each
// warp load is 128 contiguous bytes). Warp w works on panel w % NP (GATED: even warps gate, odd
// warps up) and takes its chunks c = w / NP, + W / NP, ..., the next chunk's words in flight while
// it multiplies the current one. Same arithmetic as the tiles (the CPU's): the block first
// quantises its activation row (x, or the f32 intermediate) into shared memory with
// moe_quant_split, one warp a group. The products run on the tensor cores with the weights as the
// A operand: the stored fragments of n8 tiles 2j and 2j + 1 are A's fragment of m16 tile j
// (rows g and g + 8); B is the value row (column 0) and the residual row (column 1), other
// columns zero, so lane (g, 0) ends each k32 step with rows g and g + 8's value and residual
// sums, which it adds to its f32 rows at once (a step lies in one group). Row sums across the
// warps of a panel in order. GATED writes act [pair, ldo] f32 (zero past n_out); else ypair
// [pair, ldo] f32. a: f32 rows a[(pair / a_div) · lda], k values. Dynamic shared memory (moe.rs
// qdec_smem): the two INT8 rows (chunks · 64 each), the group scales (chunks · 2 pairs at most)
// and the warps' row sums. Launched as a dependent launch: everything after KRASIS_GRID_WAIT.
#define MOE_QDEC_GU_THREADS 512  // gate/up block, 16 warps (must match moe.rs): a V2-Lite layer's 6
                                 // pairs × 22 panels are one block per SM (~125 registers a thread)
#define MOE_QDEC_DN_THREADS 256  // down block, 8 warps (must match moe.rs): 6 pairs × 32 panels fit
                                 // in one wave at 2 blocks per SM (16 warps: two waves)
template <bool GATED, int BITS, int THREADS>
__device__ __forceinline__ void moe_qdec(const unsigned char* __restrict__ w, const unsigned short* __restrict__ sc,
                                         long long expert_wbytes, long long expert_scales, int chunks, int groups,
                                         int gs, int n_panels, int n_out, const float* __restrict__ a, int k,
                                         int lda, int a_div, float* __restrict__ out, int ldo,
                                         const int* __restrict__ ids, int n_experts, const MoeAct& act) {
    constexpr int WB = MOE_WBITS(BITS);
    constexpr bool FP4 = BITS == MOE_FMT_MXFP4 || BITS == MOE_FMT_NVFP4;
    constexpr int GPS = BITS == MOE_FMT_NVFP4 ? 2 : 1;  // scale groups a k32 step covers
    constexpr int SB = FP4 ? 4 : 2;                      // bytes of a weight scale (f32, f16)
    constexpr int BLOCK_WORDS = MOE_QPANEL * MOE_QCHUNK * WB / 32;  // u32 words of a (panel, chunk) block
    constexpr int NP = GATED ? 2 : 1;                                // panels per block
    constexpr int WARPS = THREADS / 32;
    constexpr int CW = WARPS / NP;  // warps per panel
    constexpr int J = WB;           // words per lane per k16 step: INT4 / FP4 tile pairs, INT8 tiles
    constexpr int WORDS = 4 * J;    // per lane per chunk
    static_assert(WARPS % NP == 0, "whole warps per panel");
    extern __shared__ __align__(16) unsigned char moe_smem[];
    const int kpad = chunks * MOE_QCHUNK;
    signed char* xq = (signed char*)moe_smem;                      // [2][kpad]: value row, residual row
    float2* xsc = (float2*)(moe_smem + 2 * kpad);                  // [kpad / gs], room for gs = 16
    float* red = (float*)(moe_smem + 2 * kpad + (kpad / 16) * 8);  // [WARPS][64]

    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();
    const int pair = blockIdx.x;
    const int e = ids[pair];
    if (e < 0 || e >= n_experts) return;  // uniform over the block, before any barrier
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int pp = warp % NP;
    const int panel = pp == 0 ? (int)blockIdx.y : n_panels / 2 + (int)blockIdx.y;
    const u32* __restrict__ wp =
        (const u32*)(w + (long long)e * expert_wbytes) + (long long)panel * chunks * BLOCK_WORDS + lane;
    // This lane's 8 scales of a group (rows 8t + g of the panel) at sp + group · 64 · SB bytes.
    const unsigned char* __restrict__ sp =
        (const unsigned char*)sc + ((long long)e * expert_scales + (long long)panel * groups * MOE_QPANEL + g * 8) * SB;
    u32 v[2][WORDS];
    auto load = [&](u32(&d)[WORDS], int c) {
#pragma unroll
        for (int i = 0; i < WORDS; ++i) d[i] = __ldg(wp + (long long)c * BLOCK_WORDS + i * 32);
    };
    int c = warp / NP;
    if (c < chunks) load(v[0], c);  // the weights' loads go out before the activation quantising

    const float* arow = a + (long long)(pair / a_div) * lda;
    if (GPS == 2) {  // NVFP4: a warp a 32-wide window of two groups
        for (int win = warp; win < kpad / 32; win += WARPS) {
            const int k0 = 32 * win;
            const float4 s = moe_quant_split16(arow + k0, min(32, max(k - k0, 0)), lane, xq + k0, xq + kpad + k0);
            if (lane == 0) xsc[2 * win] = make_float2(s.x, s.y), xsc[2 * win + 1] = make_float2(s.z, s.w);
        }
    } else {
        for (int grp = warp; grp < kpad / gs; grp += WARPS) {
            const int k0 = grp * gs;
            const float2 s =
                moe_quant_split(arow + k0, min(gs, max(k - k0, 0)), gs, lane, xq + k0, xq + kpad + k0, BITS);
            if (lane == 0) xsc[grp] = s;
        }
    }
    __syncthreads();

    float y[4][2];  // lane (g, 0): rows 16j + g and 16j + 8 + g of the panel
#pragma unroll
    for (int j = 0; j < 4; ++j) y[j][0] = y[j][1] = 0.0f;
    const u32* xrow = (const u32*)(xq + (g == 1 ? kpad : 0));  // lanes g < 2 hold B's columns 0, 1
    auto multiply = [&](const u32(&vv)[WORDS], int c) {
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            const int k0 = c * MOE_QCHUNK + kk * 32;
            const int grp = GPS == 2 ? k0 / 16 : k0 / gs;  // the step's (first) group
            float sw[GPS][8];  // rows 8t + g of the panel, per group of the step
            float2 sx[GPS];
#pragma unroll
            for (int h = 0; h < GPS; ++h) {
                const unsigned char* sg = sp + (long long)(grp + h) * MOE_QPANEL * SB;
                if (FP4) {
                    const float4 lo4 = __ldg((const float4*)sg), hi4 = __ldg((const float4*)sg + 1);
                    sw[h][0] = lo4.x, sw[h][1] = lo4.y, sw[h][2] = lo4.z, sw[h][3] = lo4.w;
                    sw[h][4] = hi4.x, sw[h][5] = hi4.y, sw[h][6] = hi4.z, sw[h][7] = hi4.w;
                } else {
                    const uint4 raw = __ldg((const uint4*)sg);
                    const u32 sw2[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                    for (int t = 0; t < 8; ++t)
                        asm("cvt.f32.f16 %0, %1;\n"
                            : "=f"(sw[h][t])
                            : "h"((unsigned short)(sw2[t / 2] >> (16 * (t % 2)))));
                }
                sx[h] = xsc[grp + h];
            }
            const u32 b0 = g < 2 ? xrow[(k0 + 4 * q) / 4] : 0u, b1 = g < 2 ? xrow[(k0 + 16 + 4 * q) / 4] : 0u;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                // A of m16 tile j: tiles 2j (rows g) and 2j + 1 (rows g + 8), k16 steps 2kk, 2kk + 1.
                u32 fa[4];
                if (WB == 4) {
                    u32 ft[2], fu[2];
                    q4_frags<BITS>(vv[(2 * kk) * J + j], vv[(2 * kk + 1) * J + j], ft, fu);
                    fa[0] = ft[0];
                    fa[1] = fu[0];
                    fa[2] = ft[1];
                    fa[3] = fu[1];
                } else {
                    fa[0] = int8_s8(vv[(2 * kk) * J + 2 * j]);
                    fa[1] = int8_s8(vv[(2 * kk) * J + 2 * j + 1]);
                    fa[2] = int8_s8(vv[(2 * kk + 1) * J + 2 * j]);
                    fa[3] = int8_s8(vv[(2 * kk + 1) * J + 2 * j + 1]);
                }
                // NVFP4: one product per group of 16, over B's bytes of that half of the window.
#pragma unroll
                for (int h = 0; h < GPS; ++h) {
                    const u32 mask = GPS == 2 ? g16_mask(h) : 0xffffffffu;
                    int s[4];
                    mma_s8_from(s, fa, b0 & mask, b1 & mask, MOE_MAGIC_I);
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const float dh = __int_as_float(s[2 * r]) - MOE_MAGIC_F;
                        const float dl = __int_as_float(s[2 * r + 1]) - MOE_MAGIC_F;
                        y[j][r] = fmaf(fmaf(dh, sx[h].x, dl * sx[h].y), sw[h][2 * j + r], y[j][r]);
                    }
                }
            }
        }
    };
    // Two register buffers: chunk c + CW loads while chunk c multiplies.
    for (; c < chunks; c += 2 * CW) {
        if (c + CW < chunks) load(v[1], c + CW);
        multiply(v[0], c);
        if (c + CW >= chunks) break;
        if (c + 2 * CW < chunks) load(v[0], c + 2 * CW);
        multiply(v[1], c + CW);
    }
    if (q == 0) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            red[warp * MOE_QPANEL + 16 * j + g] = y[j][0];
            red[warp * MOE_QPANEL + 16 * j + 8 + g] = y[j][1];
        }
    }
    __syncthreads();
    if (tid >= MOE_QPANEL) return;
    float r[NP];
#pragma unroll
    for (int p = 0; p < NP; ++p) {
        r[p] = 0.0f;
        for (int wi = p; wi < WARPS; wi += NP) r[p] += red[wi * MOE_QPANEL + tid];
    }
    const int o = blockIdx.y * MOE_QPANEL + tid;
    if (GATED) {
        const float gv = r[0], uv = r[NP - 1];
        out[(long long)pair * ldo + o] = o < n_out ? moe_act(act, e, o, gv, uv) : 0.0f;
    } else if (o < n_out) {
        out[(long long)pair * ldo + o] = r[0];
    }
}

// Decode path, quantised: act [n_pairs, inter_pad] (f32) from x [tokens, hidden] (f32); grid
// (pairs, inter_pad / 64). Then moe_q*_dec_down: ypair [n_pairs, hidden] from act; grid (pairs,
// panels of w2).
#define MOE_QDEC_ENTRIES(NAME, BITS)                                                                               \
    extern "C" __global__ void __launch_bounds__(MOE_QDEC_GU_THREADS) moe_q##NAME##_dec_gate_up(                     \
        const unsigned char* w13, const unsigned short* s13, long long expert_wbytes, long long expert_scales,     \
        int chunks, int groups, int gs, int n_panels, int inter, const float* x, int hidden, int top_k,           \
        float* act, int inter_pad, const int* ids, int n_experts, MoeAct fn) {                       \
        moe_qdec<true, BITS, MOE_QDEC_GU_THREADS>(w13, s13, expert_wbytes, expert_scales, chunks, groups, gs,     \
                                                  n_panels, inter, x, hidden, hidden, top_k, act,          \
                                                  inter_pad, ids, n_experts, fn);                                \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(MOE_QDEC_DN_THREADS) moe_q##NAME##_dec_down(                        \
        const unsigned char* w2, const unsigned short* s2, long long expert_wbytes, long long expert_scales,      \
        int chunks, int groups, int gs, int n_panels, int hidden, const float* act, int inter, int inter_pad,    \
        float* ypair, const int* ids, int n_experts) {                                              \
        moe_qdec<false, BITS, MOE_QDEC_DN_THREADS>(w2, s2, expert_wbytes, expert_scales, chunks, groups, gs,     \
                                                   n_panels, hidden, act, inter, inter_pad, 1, ypair,     \
                                                   hidden, ids, n_experts, MoeAct{});                           \
    }
#ifdef MOE_QDEC
MOE_QDEC_ENTRIES(4, 4)
MOE_QDEC_ENTRIES(8, 8)
#endif
#ifdef MOE_QDEC_FP4  // the FP4 formats' decode kernels: a program of their own (moe.rs)
MOE_QDEC_ENTRIES(mx, MOE_FMT_MXFP4)
MOE_QDEC_ENTRIES(nv, MOE_FMT_NVFP4)
#endif

// Decode-path body: for pair = blockIdx.x with expert e = ids[pair], the warp's NC outputs
// o = o0 + q: GATED: out[pair, o] = silu(w[o] . a) * (w[up_row0 + o] . a), else w[o] . a, where
// a = a_rows[pair / a_div] (length k, zero padded to ldw in shared memory).
template <bool GATED, int NC>
__device__ __forceinline__ void moe_dec_body(const bf16_t* __restrict__ w, long long expert_stride, int ldw,
                                             int n_out, int up_row0, int k, const float* __restrict__ a, int lda,
                                             int a_div, float* __restrict__ out, int ldo,
                                             const int* __restrict__ ids, int n_experts, const MoeAct& act) {
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
        if (GATED) v = moe_act(act, e, o0 + q, v, acc[NC + q]);
        out[(long long)pair * ldo + o0 + q] = v;
    }
}

// Decode path, act [n_pairs, inter] from x [tokens, hidden], ids [n_pairs], w13 [E, 2*inter, ldw].
#ifdef MOE_BASE
extern "C" __global__ void moe_dec_gate_up(const bf16_t* w13, int ldw, int inter, int hidden, const float* x,
                                           int top_k, float* act, const int* ids, int n_experts, MoeAct fn) {
    moe_dec_body<true, MOE_DEC_GU_COLS>(w13, (long long)2 * inter * ldw, ldw, inter, inter, hidden, x, hidden, top_k,
                                        act, inter, ids, n_experts, fn);
}
#endif

// Decode path, ypair [n_pairs, hidden] from act [n_pairs, inter], ids [n_pairs], w2 [E, hidden, ldw].
#ifdef MOE_BASE
extern "C" __global__ void moe_dec_down(const bf16_t* w2, int ldw, int inter, int hidden, const float* act,
                                        float* ypair, const int* ids, int n_experts) {
    moe_dec_body<false, MOE_DEC_DN_ROWS>(w2, (long long)hidden * ldw, ldw, hidden, 0, inter, act, inter, 1, ypair,
                                         hidden, ids, n_experts, MoeAct{});
}
#endif

// out [tokens, hidden] = sum over j ascending of weights[t, j] * (ypair[t*top_k + j] + b2[id]), b2
// f32 [n_experts, hidden] the experts' down biases (or null: none, and nothing is added); a token with
// any id outside [0, n_experts) gets a NaN row; pairs with an id in [n_present, n_experts) are
// computed elsewhere (the CPU's share of a split layer) and left out of the sum (their ypair rows
// are never written, never read). Launch: grid (tokens, ceil(hidden / blockDim.x)
// capped at 65535), 256 threads; block (t, y) covers columns y*256 + j, stepping by
// gridDim.y*256. Why: one block per token put decode (tokens = 1, hidden 2048) on one SM with
// each thread walking 8 columns serially; now 8 blocks of one column per thread. Each element is
// the same f32 sum (j ascending) whatever the grid.
#ifdef MOE_BASE
extern "C" __global__ void moe_combine(const float* __restrict__ ypair, const int* __restrict__ ids,
                                       const float* __restrict__ weights, float* __restrict__ out, int tokens,
                                       int top_k, int hidden, int n_experts, int n_present,
                                       const float* __restrict__ b2) {
    KRASIS_GRID_WAIT();  // launched as a dependent launch on the decode path
    KRASIS_GRID_LAUNCH_DEPENDENTS();
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
            const int e = ids[p];
            if (e < n_present) {
                const float y = ypair[p * hidden + h];
                acc += weights[p] * (b2 && e >= 0 ? y + b2[(long long)e * hidden + h] : y);
            }
        }
        out[(long long)t * hidden + h] = valid ? acc : krasis_nan();
    }
}
#endif
