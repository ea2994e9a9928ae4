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

// x [tokens, k] f32 -> its two BF16 halves hi, lo [tokens, ldo] (bf16_split), zero from k to ldo.
// Launch: grid (tokens, ceil(ldo / 256)), 256 threads.
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

// The expert owning `tile` (tile_offsets[e] <= tile < tile_offsets[e + 1]); fills s_pair with the
// tile's pair indices (-1 past its `count` pairs) and ends with a barrier.
__device__ __forceinline__ int moe_tile_pairs(int tile, const int* __restrict__ sorted, const int* __restrict__ offsets,
                                              const int* __restrict__ tile_offsets, int n_experts, int* s_pair,
                                              int& count) {
    int lo = 0, hi = n_experts;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (tile_offsets[mid] <= tile) lo = mid;
        else hi = mid;
    }
    const int start = offsets[lo] + (tile - tile_offsets[lo]) * MOE_TM;
    count = min(MOE_TM, offsets[lo + 1] - start);
    for (int i = threadIdx.x; i < MOE_TM; i += blockDim.x) s_pair[i] = i < count ? sorted[start + i] : -1;
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
                                         const int* __restrict__ tile_offsets, int n_experts) {
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
    const int e = moe_tile_pairs(tile, sorted, offsets, tile_offsets, n_experts, s_pair, count);

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
                    const float v = o + c < n_out ? gv / (1.0f + expf(-gv)) * uv : 0.0f;
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
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_gate_up(const bf16_t* w13, int ldw, int inter, int hidden, const bf16_t* x_hi, const bf16_t* x_lo, int top_k,
                bf16_t* act_hi, bf16_t* act_lo, int inter_pad, const int* sorted, const int* offsets,
                const int* tile_offsets, int n_experts) {
    moe_tile<true>(w13, (long long)2 * inter * ldw, ldw, inter, inter, hidden, x_hi, x_lo, ldw, top_k,
                               nullptr, act_hi, act_lo, inter_pad, sorted, offsets, tile_offsets, n_experts);
}

// ypair [n_pairs, hidden] from act halves [n_pairs, ldw] and w2 [E, hidden, ldw] (ldw = inter_pad).
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_down(const bf16_t* w2, int ldw, int inter, int hidden, const bf16_t* act_hi, const bf16_t* act_lo,
             float* ypair, const int* sorted, const int* offsets, const int* tile_offsets, int n_experts) {
    moe_tile<false>(w2, (long long)hidden * ldw, ldw, hidden, 0, inter, act_hi, act_lo, ldw, 1, ypair,
                                nullptr, nullptr, hidden, sorted, offsets, tile_offsets, n_experts);
}

// ---- Quantised experts: INT4 / INT8 weights in the GPU tile layout (krasis_quant::gpu_layout) ----
//
// Same grouping, pairs and grid as the BF16 tiles; what differs:
//   - weights: each (64-row panel, 64-k chunk) block is one contiguous 2 KiB (INT4) or 4 KiB (INT8)
//     copy, already in mma fragment order: at each k step a lane reads one 4-byte word per n8 tile
//     pair (INT4) or tile (INT8) from shared memory and turns it into B fragments in registers
//     (INT4: the nibble pair | 0x6400 is 1024 + u in FP16, minus 1032 is q exactly; INT8 the
//     byte under 0x64, minus 1152), times the (row, group) f16 scale; the product rounds to FP16
//     once.
//   - scales: f16, per panel and group; each chunk stages the groups of its two 32-wide halves.
//   - activations: one FP16 copy (x rounded; the intermediate rounded), one FP16 product per k
//     step (as fast as BF16's, 8 times finer: see mul_f16x2), nearer the CPU's about
//     f32-accurate experts.
#define MOE_QPANEL 64  // rows of a panel (gpu_layout::PANEL_ROWS)
#define MOE_QCHUNK 64  // k of a chunk (gpu_layout::CHUNK_K)
static_assert(MOE_QCHUNK == MOE_KC, "the A staging of the tiles is shared");

// The quantised kernels compute in FP16 (11 significant bits against BF16's 8): the stored q
// values and f16 scales are exact in it, each weight q·s rounds once to FP16, and x and the SwiGLU
// intermediate round to FP16, so each rounding is at most 2^-11 relative where BF16 allowed
// 2^-8. Magnitudes beyond FP16's 65504 saturate to ±65504 (NaN stays NaN); activations reaching
// the experts are normalised hidden states and their SwiGLU products, far inside that range.
typedef unsigned short f16_t;  // IEEE half bits

__device__ __forceinline__ u32 mul_f16x2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 sub_f16x2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
// An f16 (bits) in both halves of a register.
__device__ __forceinline__ u32 f16x2_dup(u32 h) { return h | (h << 16); }
// f32 -> f16 bits, round to nearest even; beyond ±65504 saturates, NaN stays NaN.
__device__ __forceinline__ f16_t f32_to_f16_sat(float x) {
    if (fabsf(x) > 65504.0f) x = copysignf(65504.0f, x);
    f16_t r;
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(r) : "f"(x));
    return r;
}
// d[16x8] += a[16x16] · b[16x8] in FP16 with f32 accumulators; fragments as mma_bf16's.
__device__ __forceinline__ void mma_f16(float* d, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Nibbles s and s + 4 of an INT4 word (stored u = q + 8) as FP16x2 q values, exact: u | 0x6400 is
// 1024 + u, minus 1032.
__device__ __forceinline__ u32 int4_pair(u32 w, int s) {
    return sub_f16x2(((w >> (4 * s)) & 0x000f000fu) | 0x64006400u, 0x64086408u);
}
// Bytes b, b + 1 of an INT8 word (stored u = q + 128) as FP16x2 q values (low half byte b), exact:
// 0x64 above the byte is 1024 + u, minus 1152.
__device__ __forceinline__ u32 int8_pair(u32 w, int b) {
    return sub_f16x2(__byte_perm(w, 0x64646464u, 0x4040 + b + ((b + 1) << 8)), 0x64806480u);
}
// x [tokens, k] f32 -> FP16 rows [tokens, ldo] (the quantised tiles' A), zero from k to ldo.
// Launch: grid (tokens, ceil(ldo / 256)), 256 threads.
extern "C" __global__ void moe_f16_rows(const float* __restrict__ x, int k, f16_t* __restrict__ out, int ldo) {
    const long long t = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c < ldo) out[t * ldo + c] = c < k ? f32_to_f16_sat(x[t * k + c]) : (f16_t)0;
}

__device__ __forceinline__ u32 lds32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

// One tile of one expert, quantised weights; PB panels of 64 rows per block, 2·PB warps, S
// shared-memory buffers. GATED: gate panels G·blockIdx.y + i and up panels n_panels / 2 +
// G·blockIdx.y + i (i < G = PB / 2) of w13 (gate rows then up rows, each padded to whole panels);
// act = silu(gate) * up to out[p, ldo] (FP16) for every column of the block's 64·G columns (zero
// past n_out). Else panels PB·blockIdx.y + i of w2 to ypair[p, n0 + i] (f32) for columns below
// n_out. Panels past the matrix are zero-filled. A: FP16 rows a[p / a_div, lda] (lda = the padded
// K = chunks · 64), staged once for all the block's columns.
//
// The warps split the block's output columns, not its pairs: warp w dequantises only its 4 n8
// tiles (GATED: tiles 2(w%4), +1 of gate panel w/4 and the same up tiles; else tiles
// 4(w%2)..+3 of panel w/2) and multiplies them by every 16-pair slice of A that holds a pair, so
// each weight is dequantised once per block rather than once per warp.
template <bool GATED, int BITS, int PB, int S>
__device__ __forceinline__ void moe_qtile(const unsigned char* __restrict__ w, const unsigned short* __restrict__ sc,
                                          long long expert_wbytes, long long expert_scales, int chunks, int groups,
                                          int gs, int n_panels, int n_out, const f16_t* __restrict__ a, int lda,
                                          int a_div, float* __restrict__ ypair, f16_t* __restrict__ out, int ldo,
                                          const int* __restrict__ sorted, const int* __restrict__ offsets,
                                          const int* __restrict__ tile_offsets, int n_experts) {
    static_assert(MOE_BN == MOE_QPANEL && MOE_BN_DOWN == 2 * MOE_QPANEL, "a block is two panels");
    static_assert(MOE_TM == 64 && PB % 2 == 0, "4 slices of 16 pairs; gate and up panels in pairs");
    constexpr int THREADS = 64 * PB, G = PB / 2;
    constexpr int BLOCK = MOE_QPANEL * MOE_QCHUNK * BITS / 8;  // bytes of a (panel, chunk) block
    constexpr int W_BYTES = PB * BLOCK;
    constexpr int S_BYTES = PB * 2 * MOE_QPANEL * 2;  // per panel the f16 scales of the chunk's two halves
    constexpr int ROW_BYTES = MOE_SK * 2;
    constexpr int A_AT = W_BYTES + S_BYTES;
    constexpr int STAGE_BYTES = A_AT + MOE_TM * ROW_BYTES;
    constexpr int W_COPIES = W_BYTES / 16 / THREADS;
    constexpr int PARTS = MOE_QCHUNK / 8, ROWS_PER_PASS = THREADS / PARTS, A_SLOTS = MOE_TM / ROWS_PER_PASS;
    static_assert(W_BYTES % (16 * THREADS) == 0 && S_BYTES / 16 <= THREADS, "whole copies");
    static_assert(STAGE_BYTES % 16 == 0 && A_AT % 16 == 0, "16-byte aligned staging");
    __shared__ int s_pair[MOE_TM];
    extern __shared__ __align__(16) unsigned char moe_smem[];  // MOE_STAGES buffers (moe.rs: qtile_smem)

    const int tile = blockIdx.x;
    if (tile >= tile_offsets[n_experts]) return;  // uniform over the block
    const int tid = threadIdx.x;
    int count;
    const int e = moe_tile_pairs(tile, sorted, offsets, tile_offsets, n_experts, s_pair, count);

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
    const unsigned short* se = sc + (long long)e * expert_scales;
    // This thread's copies, worked out once: weight piece (i · THREADS + tid) of the stage's PB
    // blocks; scale piece tid (< 16·PB: panel tid / 16, half (tid / 8) % 2, 8 scales tid % 8);
    // A rows as in moe_tile. Sources advance by BLOCK (weights) or MOE_QCHUNK (A) per chunk.
    const unsigned char* w_src[W_COPIES];
    int w_bytes[W_COPIES];
#pragma unroll
    for (int i = 0; i < W_COPIES; ++i) {
        const int off = (i * THREADS + tid) * 16;
        const int pn = panel_of(off / BLOCK);
        w_src[i] = pn >= 0 ? we + (long long)pn * chunks * BLOCK + off % BLOCK : we;
        w_bytes[i] = pn >= 0 ? 16 : 0;
    }
    const int s_panel = tid < S_BYTES / 16 ? panel_of(tid / 16) : -1, s_half = (tid / 8) % 2;
    const bool s_ok = s_panel >= 0;
    const unsigned short* s_src = se + (long long)max(s_panel, 0) * groups * MOE_QPANEL + (tid % 8) * 8;
    const int part = tid % PARTS, row0 = tid / PARTS;
    long long a_off[A_SLOTS];
    int a_bytes[A_SLOTS];
    moe_a_sources<A_SLOTS, ROWS_PER_PASS>(s_pair, row0, part, a_div, lda, a_off, a_bytes);
    const u32 smem0 = smem_addr(moe_smem);
    auto stage = [&](int c, int b) {
        const u32 dst = smem0 + b * STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < W_COPIES; ++i)
            cp_async16_at(dst + (i * THREADS + tid) * 16, w_src[i] + (w_bytes[i] ? (long long)c * BLOCK : 0),
                          w_bytes[i]);
        if (tid < S_BYTES / 16) {
            const int grp = (c * MOE_QCHUNK + s_half * 32) / gs;
            cp_async16_at(dst + W_BYTES + tid * 16, s_ok ? s_src + (long long)grp * MOE_QPANEL : se, s_ok ? 16 : 0);
        }
        const int k0 = c * MOE_QCHUNK;
#pragma unroll
        for (int i = 0; i < A_SLOTS; ++i)
            cp_async16_at(dst + A_AT + (row0 + i * ROWS_PER_PASS) * ROW_BYTES + part * 16,
                          a + a_off[i] + (a_bytes[i] ? k0 : 0), a_bytes[i]);
    };

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int slices = (count + 15) / 16;  // 16-pair slices of A holding a pair (uniform)
    // The warp's 4 n8 tiles as (staged panel, tile in panel): GATED (w/4, tt0), (w/4, tt0 + 1),
    // (G + w/4, tt0), (G + w/4, tt0 + 1) with tt0 = 2(w % 4); else (w / 2, 4(w % 2) + j).
    const int tp0 = GATED ? warp / 4 : warp / 2, tt0 = GATED ? 2 * (warp % 4) : 4 * (warp % 2);
    float acc[4][4][4];  // [A slice][tile j][fragment]
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.0f;
    // ldmatrix row address of this lane for A slice 0 (slice m adds 16 rows).
    const u32 a_at = (u32)(A_AT + ((lane & 7) + 8 * ((lane >> 3) & 1)) * ROW_BYTES + 16 * (lane >> 4));
    const bool halves_differ = gs < MOE_QCHUNK;  // otherwise a chunk lies in one group

#pragma unroll
    for (int c = 0; c < S - 1; ++c) {
        if (c < chunks) stage(c, c);
        cp_async_commit();
    }
    u32 sb[4];  // this lane's BF16x2 scales of its 4 tiles (rows 8t + g)
    for (int c = 0; c < chunks; ++c) {
        cp_async_wait<S - 2>();
        __syncthreads();
        const int nc = c + S - 1;
        if (nc < chunks) stage(nc, nc % S);
        cp_async_commit();
        const u32 buf = smem0 + (c % S) * STAGE_BYTES;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            if (half == 0 || halves_differ) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int pp = GATED ? tp0 + (j / 2) * G : tp0, t = GATED ? tt0 + j % 2 : tt0 + j;
                    const u32 h2 = lds32(buf + W_BYTES + ((pp * 2 + half) * MOE_QPANEL + g * 8 + (t & ~1)) * 2);
                    sb[j] = f16x2_dup((h2 >> (16 * (t & 1))) & 0xffffu);
                }
            }
#pragma unroll
            for (int k2 = 0; k2 < 2; ++k2) {
                const int ks = half * 2 + k2;
                // B fragments of the warp's 4 tiles, dequantised once, used for every slice.
                u32 b[4][2];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int pp = GATED ? tp0 + (j / 2) * G : tp0, t = GATED ? tt0 + j % 2 : tt0 + j;
                    const u32 wb = buf + pp * BLOCK;
                    if (BITS == 4) {
                        const u32 word = lds32(wb + ((ks * 4 + t / 2) * 32 + lane) * 4);
                        b[j][0] = int4_pair(word, 2 * (t % 2));
                        b[j][1] = int4_pair(word, 2 * (t % 2) + 1);
                    } else {
                        const u32 word = lds32(wb + ((ks * 8 + t) * 32 + lane) * 4);
                        b[j][0] = int8_pair(word, 0);
                        b[j][1] = int8_pair(word, 2);
                    }
                    b[j][0] = mul_f16x2(b[j][0], sb[j]);
                    b[j][1] = mul_f16x2(b[j][1], sb[j]);
                }
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    if (m >= slices) break;
                    u32 fa[4];
                    ldmatrix_x4(fa, buf + a_at + m * 16 * ROW_BYTES + ks * 32);
#pragma unroll
                    for (int j = 0; j < 4; ++j) mma_f16(acc[m][j], fa, b[j][0], b[j][1]);
                }
            }
        }
    }
    // acc[m][j][2r + c]: pair slot 16m + g + 8r, column 8·t_j + 2q + c of tile j's panel.
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        if (m >= slices) break;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int p = s_pair[16 * m + g + 8 * r];
            if (p < 0) continue;
            if (GATED) {
                if (G * (int)blockIdx.y + tp0 >= n_panels / 2) continue;  // a gate panel past the matrix
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int o = (G * blockIdx.y + tp0) * MOE_QPANEL + (tt0 + j) * 8 + 2 * q;
                    bf16_t h[2];
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const float gv = acc[m][j][2 * r + c], uv = acc[m][j + 2][2 * r + c];
                        h[c] = f32_to_f16_sat(o + c < n_out ? gv / (1.0f + expf(-gv)) * uv : 0.0f);
                    }
                    *(u32*)(out + (long long)p * ldo + o) = bf16x2_of(h[0], h[1]);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int o = blockIdx.y * PB * MOE_QPANEL + warp * 32 + j * 8 + 2 * q;
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        if (o + c < n_out) ypair[(long long)p * ldo + o + c] = acc[m][j][2 * r + c];
                    }
                }
            }
        }
    }
}

// act [n_pairs, inter_pad] (FP16) from x [tokens, ldx] (FP16) and w13 in the GPU tile layout
// (rows 2 · inter_pad: gate then up; expert stride expert_wbytes bytes, expert_scales scales).
// moe_q*_down: ypair [n_pairs, hidden] (f32) from act and w2 in the GPU tile layout (rows hidden,
// K inter_pad).
// Entry points per width and (PB, S) variant V: moe_q{BITS}_{gate_up,down}_v{V}.
#define MOE_Q_ENTRIES(BITS, V, PB, S)                                                                               \
    extern "C" __global__ void __launch_bounds__(64 * PB) moe_q##BITS##_gate_up_v##V(                               \
        const unsigned char* w13, const unsigned short* s13, long long expert_wbytes, long long expert_scales,      \
        int chunks, int groups, int gs, int n_panels, int inter, const f16_t* x, int ldx, int top_k, f16_t* act, \
        int inter_pad, const int* sorted, const int* offsets, const int* tile_offsets, int n_experts) {            \
        moe_qtile<true, BITS, PB, S>(w13, s13, expert_wbytes, expert_scales, chunks, groups, gs, n_panels, inter,  \
                                     x, ldx, top_k, nullptr, act, inter_pad, sorted, offsets, tile_offsets,        \
                                     n_experts);                                                                    \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(64 * PB) moe_q##BITS##_down_v##V(                                  \
        const unsigned char* w2, const unsigned short* s2, long long expert_wbytes, long long expert_scales,        \
        int chunks, int groups, int gs, int n_panels, int hidden, const f16_t* act, int inter_pad, float* ypair,  \
        const int* sorted, const int* offsets, const int* tile_offsets, int n_experts) {                           \
        moe_qtile<false, BITS, PB, S>(w2, s2, expert_wbytes, expert_scales, chunks, groups, gs, n_panels, hidden,  \
                                      act, inter_pad, 1, ypair, nullptr, hidden, sorted, offsets, tile_offsets,    \
                                      n_experts);                                                                   \
    }
// v0: 4 panels, 3 buffers (the default, moe.rs: QTILE_VARIANTS); v1: 2 panels, 2 buffers.
MOE_Q_ENTRIES(4, 0, 4, 3)
MOE_Q_ENTRIES(4, 1, 2, 2)
MOE_Q_ENTRIES(8, 0, 4, 3)
MOE_Q_ENTRIES(8, 1, 2, 2)

// Decode path for quantised weights (few pairs): no grouping; block (pair, output panel) reads
// its expert's panel (GATED: the gate panel and the matching up panel) once, coalesced (each
// warp load is 128 contiguous bytes). Warp w works on panel w % NP (GATED: even warps gate, odd
// warps up) and takes its chunks c = w / NP, + W / NP, ..., the next chunk's words in flight while
// it multiplies the current one. The products run on the tensor cores with the weights as the
// A operand: the stored B fragments of n8 tiles 2j and 2j + 1 (rows 8t + g, k 2q.., 2q + 8..) are
// exactly A's fragment of m16 tile j, dequantised as in moe_qtile (FP16 q times the f16 scale,
// rounded once); x rounded to FP16 is B with all 8 columns equal, so lane (g, q) ends with the
// f32 sums of rows 16j + g and 16j + g + 8 (the other columns are the same sums; only one is
// used). Same roundings as the tiles; only the f32 summation order differs. Row sums across
// the warps of a panel in order. GATED writes act [pair, ldo] as FP16 (zero past n_out), for either
// down path; else ypair [pair, ldo] f32. x: f32 rows (GATED, row pair / a_div) or FP16 rows (act),
// staged as FP16 in dynamic shared memory (chunks · 64 elements, zero past k). Launched as a
// dependent launch: everything after KRASIS_GRID_WAIT.
#define MOE_QDEC_GU_THREADS 512  // gate/up block, 16 warps (must match moe.rs): a V2-Lite layer's 6
                                 // pairs × 22 panels are one block per SM (~125 registers a thread)
#define MOE_QDEC_DN_THREADS 256  // down block, 8 warps (must match moe.rs): 6 pairs × 32 panels fit
                                 // in one wave at 2 blocks per SM (16 warps: two waves)
template <bool GATED, int BITS, int THREADS>
__device__ __forceinline__ void moe_qdec(const unsigned char* __restrict__ w, const unsigned short* __restrict__ sc,
                                         long long expert_wbytes, long long expert_scales, int chunks, int groups,
                                         int gs, int n_panels, int n_out, const float* __restrict__ a_f32,
                                         const f16_t* __restrict__ a_f16, int k, int lda, int a_div,
                                         float* __restrict__ ypair, f16_t* __restrict__ out, int ldo,
                                         const int* __restrict__ ids, int n_experts) {
    constexpr int BLOCK_WORDS = MOE_QPANEL * MOE_QCHUNK * BITS / 32;  // u32 words of a (panel, chunk) block
    constexpr int NP = GATED ? 2 : 1;                                  // panels per block
    constexpr int WARPS = THREADS / 32;
    constexpr int CW = WARPS / NP;  // warps per panel
    constexpr int J = BITS;         // words per lane per k step: INT4 tile pairs, INT8 tiles
    constexpr int WORDS = 4 * J;    // per lane per chunk
    static_assert(WARPS % NP == 0, "whole warps per panel");
    extern __shared__ __align__(16) unsigned char moe_smem[];
    f16_t* xs = (f16_t*)moe_smem;                             // [chunks · 64]
    float* red = (float*)(moe_smem + chunks * MOE_QCHUNK * 2);  // [WARPS][64]

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
    const unsigned short* __restrict__ sp =
        sc + (long long)e * expert_scales + (long long)panel * groups * MOE_QPANEL + g * 8;
    u32 v[2][WORDS];
    auto load = [&](u32(&d)[WORDS], int c) {
#pragma unroll
        for (int i = 0; i < WORDS; ++i) d[i] = __ldg(wp + (long long)c * BLOCK_WORDS + i * 32);
    };
    int c = warp / NP;
    if (c < chunks) load(v[0], c);  // the weights' loads go out before the activation staging

    const long long arow = (long long)(pair / a_div) * lda;
    for (int j = tid; j < chunks * MOE_QCHUNK; j += THREADS)
        xs[j] = j < k ? (GATED ? f32_to_f16_sat(a_f32[arow + j]) : a_f16[arow + j]) : (f16_t)0;
    __syncthreads();

    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
    auto multiply = [&](const u32(&vv)[WORDS], int c) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int grp = (c * MOE_QCHUNK + half * 32) / gs;
            const uint4 raw = __ldg((const uint4*)(sp + (long long)grp * MOE_QPANEL));
            const u32 sw[4] = {raw.x, raw.y, raw.z, raw.w};
            u32 sb[8];
#pragma unroll
            for (int t = 0; t < 8; ++t) sb[t] = f16x2_dup((sw[t / 2] >> (16 * (t % 2))) & 0xffffu);
#pragma unroll
            for (int k2 = 0; k2 < 2; ++k2) {
                const int ks = half * 2 + k2;
                const int k0 = c * MOE_QCHUNK + ks * 16 + 2 * q;
                const u32 xa = *(const u32*)(xs + k0), xb = *(const u32*)(xs + k0 + 8);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    // A of m16 tile j: tile 2j's (b0, b1) and tile 2j + 1's, as rows g and g + 8.
                    u32 lo0, lo1, hi0, hi1;
                    if (BITS == 4) {
                        const u32 word = vv[ks * J + j];  // tiles 2j and 2j + 1
                        lo0 = int4_pair(word, 0);
                        lo1 = int4_pair(word, 1);
                        hi0 = int4_pair(word, 2);
                        hi1 = int4_pair(word, 3);
                    } else {
                        const u32 w0 = vv[ks * J + 2 * j], w1 = vv[ks * J + 2 * j + 1];
                        lo0 = int8_pair(w0, 0);
                        lo1 = int8_pair(w0, 2);
                        hi0 = int8_pair(w1, 0);
                        hi1 = int8_pair(w1, 2);
                    }
                    const u32 a[4] = {mul_f16x2(lo0, sb[2 * j]), mul_f16x2(hi0, sb[2 * j + 1]),
                                      mul_f16x2(lo1, sb[2 * j]), mul_f16x2(hi1, sb[2 * j + 1])};
                    mma_f16(acc[j], a, xa, xb);
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
            red[warp * MOE_QPANEL + 16 * j + g] = acc[j][0];
            red[warp * MOE_QPANEL + 16 * j + 8 + g] = acc[j][2];
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
        out[(long long)pair * ldo + o] = f32_to_f16_sat(o < n_out ? gv / (1.0f + expf(-gv)) * uv : 0.0f);
    } else if (o < n_out) {
        ypair[(long long)pair * ldo + o] = r[0];
    }
}

// Decode path, quantised: act [n_pairs, inter_pad] (FP16) from x [tokens, hidden] (f32);
// grid (pairs, inter_pad / 64). Then moe_q*_dec_down: ypair [n_pairs, hidden] from act; grid
// (pairs, panels of w2). Dynamic shared memory: chunks · 64 · 2 + 16 · 2 · 64 · 4 bytes.
#define MOE_QDEC_ENTRIES(BITS)                                                                                     \
    extern "C" __global__ void __launch_bounds__(MOE_QDEC_GU_THREADS) moe_q##BITS##_dec_gate_up(                     \
        const unsigned char* w13, const unsigned short* s13, long long expert_wbytes, long long expert_scales,     \
        int chunks, int groups, int gs, int n_panels, int inter, const float* x, int hidden, int top_k,           \
        f16_t* act, int inter_pad, const int* ids, int n_experts) {                                              \
        moe_qdec<true, BITS, MOE_QDEC_GU_THREADS>(w13, s13, expert_wbytes, expert_scales, chunks, groups, gs, n_panels, inter, x,      \
                             nullptr, hidden, hidden, top_k, nullptr, act, inter_pad, ids, n_experts);            \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(MOE_QDEC_DN_THREADS) moe_q##BITS##_dec_down(                        \
        const unsigned char* w2, const unsigned short* s2, long long expert_wbytes, long long expert_scales,      \
        int chunks, int groups, int gs, int n_panels, int hidden, const f16_t* act, int inter, int inter_pad,    \
        float* ypair, const int* ids, int n_experts) {                                                            \
        moe_qdec<false, BITS, MOE_QDEC_DN_THREADS>(w2, s2, expert_wbytes, expert_scales, chunks, groups, gs, n_panels, hidden,         \
                              nullptr, act, inter, inter_pad, 1, ypair, nullptr, hidden, ids, n_experts);         \
    }
MOE_QDEC_ENTRIES(4)
MOE_QDEC_ENTRIES(8)

// Decode-path body: for pair = blockIdx.x with expert e = ids[pair], the warp's NC outputs
// o = o0 + q: GATED: out[pair, o] = silu(w[o] . a) * (w[up_row0 + o] . a), else w[o] . a, where
// a = a_rows[pair / a_div] (length k, zero padded to ldw in shared memory).
template <bool GATED, int NC>
__device__ __forceinline__ void moe_dec_body(const bf16_t* __restrict__ w, long long expert_stride, int ldw,
                                             int n_out, int up_row0, int k, const float* __restrict__ a, int lda,
                                             int a_div, float* __restrict__ out, int ldo,
                                             const int* __restrict__ ids, int n_experts) {
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
        if (GATED) v = v / (1.0f + expf(-v)) * acc[NC + q];
        out[(long long)pair * ldo + o0 + q] = v;
    }
}

// Decode path, act [n_pairs, inter] from x [tokens, hidden], ids [n_pairs], w13 [E, 2*inter, ldw].
extern "C" __global__ void moe_dec_gate_up(const bf16_t* w13, int ldw, int inter, int hidden, const float* x,
                                           int top_k, float* act, const int* ids, int n_experts) {
    moe_dec_body<true, MOE_DEC_GU_COLS>(w13, (long long)2 * inter * ldw, ldw, inter, inter, hidden, x, hidden, top_k,
                                        act, inter, ids, n_experts);
}

// Decode path, ypair [n_pairs, hidden] from act [n_pairs, inter], ids [n_pairs], w2 [E, hidden, ldw].
extern "C" __global__ void moe_dec_down(const bf16_t* w2, int ldw, int inter, int hidden, const float* act,
                                        float* ypair, const int* ids, int n_experts) {
    moe_dec_body<false, MOE_DEC_DN_ROWS>(w2, (long long)hidden * ldw, ldw, hidden, 0, inter, act, inter, 1, ypair,
                                         hidden, ids, n_experts);
}

// out [tokens, hidden] = sum over j ascending of weights[t, j] * ypair[t*top_k + j]; a token with
// any id outside [0, n_experts) gets a NaN row; pairs with an id in [n_present, n_experts) are
// computed elsewhere (the CPU's share of a split layer) and left out of the sum (their ypair rows
// are never written, never read). Launch: grid (tokens, ceil(hidden / blockDim.x)
// capped at 65535), 256 threads; block (t, y) covers columns y*256 + j, stepping by
// gridDim.y*256. Why: one block per token put decode (tokens = 1, hidden 2048) on one SM with
// each thread walking 8 columns serially; now 8 blocks of one column per thread. Each element is
// the same f32 sum (j ascending) whatever the grid.
extern "C" __global__ void moe_combine(const float* __restrict__ ypair, const int* __restrict__ ids,
                                       const float* __restrict__ weights, float* __restrict__ out, int tokens,
                                       int top_k, int hidden, int n_experts, int n_present) {
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
            if (ids[p] < n_present) acc += weights[p] * ypair[p * hidden + h];
        }
        out[(long long)t * hidden + h] = valid ? acc : krasis_nan();
    }
}
