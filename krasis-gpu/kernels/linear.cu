// Dense linears: y[m, rows] = x[m, cols] . W^T, W row-major [rows, cols].
//
// BF16 weights: our own GEMV for m <= 8 (bf16_gemv_*), cuBLAS above that. These kernels are the
// pieces around cuBLAS (x to BF16), the BF16 GEMV, and the INT8 weight-only path: W8 row-major
// [rows, ldw] (ldw = cols rounded up to 16, zero padded, so every row starts 16-byte aligned),
// one f32 scale per output row, y = scale_r * sum_c q[r,c] x[c].
#include "krasis_common.cuh"

// Sign-extended byte `b` (0..3, little-endian) of a 32-bit word, as float (exact).
__device__ __forceinline__ float i8_at(int word, int b) { return (float)((int)((u32)word << (24 - 8 * b)) >> 24); }

// Three NVRTC programs share this file (linear.rs): the helpers below (no macro), the INT8
// GEMVs (-DLINEAR_INT8_GEMV) and the BF16 GEMVs of one and of four rows per warp
// (-DLINEAR_BF16_GEMV=1, =4), so they compile in parallel.
#if !defined(LINEAR_INT8_GEMV) && !defined(LINEAR_BF16_GEMV)
// x f32 [m, cols] -> BF16 [m, ld] (round to nearest even), columns cols..ld-1 zeroed. One block
// per row.
extern "C" __global__ void f32_to_bf16_pad(const float* __restrict__ x, bf16_t* __restrict__ out, int m, int cols,
                                           int ld) {
    const int t = blockIdx.x;
    if (t >= m) return;
    convert_row(x + (long long)t * cols, out + (long long)t * ld, cols, ld, threadIdx.x, blockDim.x);
}

// x f32 [m, cols] -> its BF16 halves (bf16_split: x ~= hi + lo within 2^-17 |x|): hi into
// out [m, ld], lo into out + m * ld [m, ld], columns cols..ld-1 zeroed in both. One block per row.
// The precise GPU mode multiplies both halves (two GEMMs into one y), so x keeps about f32's
// accuracy through cuBLAS's BF16 tensor cores.
extern "C" __global__ void f32_to_bf16_split_pad(const float* __restrict__ x, bf16_t* __restrict__ out, int m,
                                                 int cols, int ld) {
    const int t = blockIdx.x;
    if (t >= m) return;
    const float* src = x + (long long)t * cols;
    bf16_t* hi = out + (long long)t * ld;
    bf16_t* lo = out + ((long long)m + t) * ld;
    for (int c = threadIdx.x; c < ld; c += blockDim.x) {
        bf16_t h = 0, l = 0;
        if (c < cols) bf16_split(src[c], h, l);
        hi[c] = h;
        lo[c] = l;
    }
}

// INT8 values -> BF16 (exact: |q| <= 128 fits BF16's 8-bit significand). No scale: it is applied
// to the GEMM's f32 output by scale_rows_f32. `n16` = number of 16-byte groups.
extern "C" __global__ void int8_dequant_bf16(const int4* __restrict__ w, uint4* __restrict__ out, long long n16) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16;
         i += (long long)gridDim.x * blockDim.x) {
        const int4 v = w[i];
        const int words[4] = {v.x, v.y, v.z, v.w};
        u32 packed[8];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
#pragma unroll
            for (int b = 0; b < 4; b += 2)
                packed[q * 2 + b / 2] =
                    (u32)f32_to_bf16(i8_at(words[q], b)) | ((u32)f32_to_bf16(i8_at(words[q], b + 1)) << 16);
        }
        out[2 * i] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        out[2 * i + 1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
}

// y[t, r] *= scale[r] over y [m, rows].
extern "C" __global__ void scale_rows_f32(float* __restrict__ y, const float* __restrict__ scale, int m, int rows) {
    const long long n = (long long)m * rows;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] *= scale[i % rows];
}

#endif

// 16-byte weight loads each INT8 GEMV lane keeps in flight per chunk (R rows x U column steps,
// U = 8 / R): 4 KiB per warp, as the BF16 GEMV keeps. The host's INT8_GEMV_MIN_WARPS_PER_SM
// (linear.rs) counts on it; it has no copy of its own, needing no chunk size.
#define INT8_GEMV_LOADS 8

// Up to INT8_GEMV_PARTS INT8 matrices of the same x (and the same cols, so the same ldw) in one
// launch (attention's q, k and v): the launch's rows are the parts' rows one after the other, part
// p's rows [end[p-1], end[p]) are W_p [end[p] - end[p-1], ldw] with scales scale_p into y_p. Every
// end but the last is a multiple of R. Unused parts repeat the last end. The host mirrors the
// count as GEMV_GROUP_MAX.
#define INT8_GEMV_PARTS 4
struct Int8GemvParts {
    const signed char* w[INT8_GEMV_PARTS];
    const float* scale[INT8_GEMV_PARTS];
    float* y[INT8_GEMV_PARTS];
    int end[INT8_GEMV_PARTS];
};

// One chunk of INT8 weights, columns c0 .. c0 + U * 512 of rows r0 .. r0 + R, into wv (zeros
// outside [rows, cols]); lane `lane` takes columns c0 + (u * 32 + lane) * 16 .. + 16 of step u.
// Rows are padded to ldw (a multiple of 16), so a load that starts below cols stays in its row.
template <int R, int U>
__device__ __forceinline__ void int8_gemv_load_chunk(int4 (&wv)[R][U], const signed char* __restrict__ w, int r0,
                                                     int rows, int cols, int ldw, int c0, int lane) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + (u * 32 + lane) * 16;
            wv[r][u] = make_int4(0, 0, 0, 0);
            if (r0 + r < rows && c < cols) wv[r][u] = __ldg((const int4*)(w + (long long)(r0 + r) * ldw + c));
        }
}

// GEMV for small m (decode): one warp per R consecutive output rows; each lane reads 16 weights
// (one 16-byte load) per row per step, the warp 512 consecutive columns (coalesced), so every
// weight byte is read once for all m <= MT tokens. A chunk is U = 8 / R steps, so every lane has
// 8 independent loads in flight, and the first chunk's loads go out before the wait for the
// previous kernel (the weights are static; a dependent launch overlaps that kernel's tail). x is
// read as f32 (float4 when x_vec4, i.e. cols % 4 == 0 and x 16-byte aligned), accumulation is f32
// per lane in column order (the same order whatever U or the parts), and the row scale is applied
// once at the end.
template <int MT, int R>
__device__ __forceinline__ void int8_gemv_body(const Int8GemvParts& parts, const float* __restrict__ x, int m,
                                               int cols, int ldw, int x_vec4) {
    constexpr int U = INT8_GEMV_LOADS / R;
    constexpr int CHUNK = U * 32 * 16;
    const int lane = threadIdx.x & 31;
    const int g0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
    // The warp's part (warp-uniform; constant indices keep the parameters out of local memory).
    const signed char* wp = parts.w[0];
    const float* sp = parts.scale[0];
    float* yp = parts.y[0];
    int start = 0, end = parts.end[0];
#pragma unroll
    for (int p = 1; p < INT8_GEMV_PARTS; ++p)
        if (g0 >= parts.end[p - 1] && parts.end[p] > parts.end[p - 1]) {
            wp = parts.w[p];
            sp = parts.scale[p];
            yp = parts.y[p];
            start = parts.end[p - 1];
            end = parts.end[p];
        }
    const signed char* __restrict__ w = wp;
    const int r0 = g0 - start;
    const int rows = end - start;
    if (r0 >= rows) return;  // whole warps leave together: no block-level barrier below
    int4 wv[R][U];
    float acc[MT][R];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[i][r] = 0.0f;

    int8_gemv_load_chunk<R, U>(wv, w, r0, rows, cols, ldw, 0, lane);
    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();
    for (int c0 = 0; c0 < cols; c0 += CHUNK) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + (u * 32 + lane) * 16;
            if (c >= cols) continue;
            const bool full = x_vec4 && c + 16 <= cols;
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                if (i >= m) break;
                const float* xr = x + (long long)i * cols + c;
                float xv[16];
                if (full) {
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const float4 f = __ldg((const float4*)xr + q);
                        xv[4 * q] = f.x;
                        xv[4 * q + 1] = f.y;
                        xv[4 * q + 2] = f.z;
                        xv[4 * q + 3] = f.w;
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < 16; ++j) xv[j] = c + j < cols ? __ldg(xr + j) : 0.0f;
                }
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const int words[4] = {wv[r][u].x, wv[r][u].y, wv[r][u].z, wv[r][u].w};
#pragma unroll
                    for (int j = 0; j < 16; ++j) acc[i][r] += i8_at(words[j >> 2], j & 3) * xv[j];
                }
            }
        }
        if (c0 + CHUNK < cols) int8_gemv_load_chunk<R, U>(wv, w, r0, rows, cols, ldw, c0 + CHUNK, lane);
    }
    const float* __restrict__ scale = sp;
    float* __restrict__ y = yp;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float v = warp_sum(acc[i][r]);
            // Spread the stores over the lanes; every lane holds the sum.
            if (lane == ((i * R + r) & 31) && i < m && r0 + r < rows) y[(long long)i * rows + r0 + r] = v * scale[r0 + r];
        }
}

// Blocks of 256 threads each SM must hold at once (the BF16 GEMV's rule, KRASIS_GEMV_MIN_BLOCKS
// below): 4 for the one-token, one-row-per-warp GEMV, so 32 warps fit an SM; the others keep
// their registers.
#define KRASIS_INT8_GEMV_MIN_BLOCKS(MT, R) ((MT) == 1 && (R) == 1 ? 4 : 1)
#define KRASIS_INT8_GEMV(MT, R)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, KRASIS_INT8_GEMV_MIN_BLOCKS(MT, R))                    \
        int8_gemv_m##MT##_r##R(const Int8GemvParts parts, const float* x, int m, int cols, int ldw,          \
                               int x_vec4) {                                                                 \
        int8_gemv_body<MT, R>(parts, x, m, cols, ldw, x_vec4);                                               \
    }
#ifdef LINEAR_INT8_GEMV
KRASIS_INT8_GEMV(1, 1)
KRASIS_INT8_GEMV(2, 1)
KRASIS_INT8_GEMV(4, 1)
KRASIS_INT8_GEMV(8, 1)
KRASIS_INT8_GEMV(1, 4)
KRASIS_INT8_GEMV(2, 4)
KRASIS_INT8_GEMV(4, 4)
KRASIS_INT8_GEMV(8, 4)
#endif

// ---------------------------------------------------------------- BF16 GEMV (small m, decode)

// The two halves of a word holding two BF16 (element 2j in the low half), as f32 (exact).
__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

// 16-byte weight loads each lane keeps in flight per chunk (R rows x U column steps, U = 8 / R):
// 4 KiB per warp, so a few warps per SM cover HBM's bandwidth-delay product. The host mirrors
// this as BF16_GEMV_LOADS (a chunk is 8 / R steps of 256 columns, i.e. 2048 / R columns).
#define BF16_GEMV_LOADS 8

// Eight BF16 of row `row` from column c (c < cols): one 16-byte load when rows are 16-byte aligned
// (w_vec: cols % 8 == 0), else eight 2-byte loads with columns >= cols read as zero.
__device__ __forceinline__ uint4 bf16_gemv_load(const bf16_t* __restrict__ w, long long row, int cols, int c,
                                                int w_vec) {
    const bf16_t* p = w + row * cols + c;
    if (w_vec) return __ldg((const uint4*)p);
    u32 h[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] = c + j < cols ? (u32)__ldg(p + j) : 0u;
    return make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16));
}

// One chunk of weights, columns c0 .. c0 + U * 256 of rows r0 .. r0 + R, into wv (zeros outside
// [rows, cols]); lane `lane` takes columns c0 + (u * 32 + lane) * 8 .. + 8 of step u.
template <int R, int U>
__device__ __forceinline__ void bf16_gemv_load_chunk(uint4 (&wv)[R][U], const bf16_t* __restrict__ w, int r0,
                                                     int rows, int cols, int c0, int lane, int w_vec) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + (u * 32 + lane) * 8;
            wv[r][u] = make_uint4(0u, 0u, 0u, 0u);
            if (r0 + r < rows && c < cols) wv[r][u] = bf16_gemv_load(w, r0 + r, cols, c, w_vec);
        }
}

// y[m, rows] = bf16(x)[m, cols] . W^T for m <= MT, W BF16 row-major [rows, cols] (no padding).
//
// Each warp owns R consecutive rows; a lane reads 8 consecutive weights (16 bytes) per row per
// step, the warp 256 consecutive columns (coalesced), and a chunk is U = 8 / R steps, so every
// lane has 8 independent 16-byte loads in flight. Every weight byte is read once for all m tokens.
// x is rounded to BF16 (round to nearest even, as f32_to_bf16_pad does for the cuBLAS path) and
// staged in shared memory as BF16, `tile` columns at a time ([m, tile], tile a multiple of the
// chunk, 2048 / R columns); the first chunk's weight loads are issued before the staging, so the
// x round trip overlaps them. Accumulation is f32 per lane, then a warp-shuffle reduction.
// Ragged rows are predicated (no early exit: the staging has block barriers); ragged cols are
// zero-filled in both x and W.
//
// Up to BF16_GEMV_PARTS matrices of the same x in one launch (a gated-DeltaNet layer's four input
// projections, attention's q, k and v, MLA's q and kv_a): the launch's rows are the parts' rows
// one after the other, part p's rows [end[p-1], end[p]) are W_p [end[p] - end[p-1], cols] into
// y_p [m, end[p] - end[p-1]]. Every end but the last is a multiple of R, so a warp's rows lie in
// one part. Unused parts repeat the last end (they hold no rows). A single matrix has one part.
#define BF16_GEMV_PARTS 4
struct GemvParts {
    const bf16_t* w[BF16_GEMV_PARTS];
    float* y[BF16_GEMV_PARTS];
    int end[BF16_GEMV_PARTS];
};

template <int MT, int R>
__device__ __forceinline__ void bf16_gemv_body(const GemvParts& parts, const float* __restrict__ x, int m, int cols,
                                               int tile, int w_vec, int x_vec4) {
    constexpr int U = BF16_GEMV_LOADS / R;
    constexpr int CHUNK = U * 32 * 8;
    extern __shared__ __align__(16) unsigned char bf16_gemv_smem[];
    bf16_t* xs = (bf16_t*)bf16_gemv_smem;  // [m, tile]
    const int lane = threadIdx.x & 31;
    const int g0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
    // The warp's part (warp-uniform; constant indices keep the parameters out of local memory).
    const bf16_t* wp = parts.w[0];
    float* yp = parts.y[0];
    int start = 0, end = parts.end[0];
#pragma unroll
    for (int p = 1; p < BF16_GEMV_PARTS; ++p)
        if (g0 >= parts.end[p - 1] && parts.end[p] > parts.end[p - 1]) {
            wp = parts.w[p];
            yp = parts.y[p];
            start = parts.end[p - 1];
            end = parts.end[p];
        }
    const bf16_t* __restrict__ w = wp;
    float* __restrict__ y = yp;
    const int r0 = g0 - start;
    const int rows = end - start;

    uint4 wv[R][U];
    float acc[MT][R];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[i][r] = 0.0f;

    // The weights are never written by stream work, so the first chunk's loads go out before the
    // wait for the previous kernel (launched as a dependent launch, they overlap its tail).
    bf16_gemv_load_chunk<R, U>(wv, w, r0, rows, cols, 0, lane, w_vec);
    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();
    for (int t0 = 0; t0 < cols; t0 += tile) {
        const int tl = min(tile, cols - t0);
        const int tl8 = (tl + 7) & ~7;
        if (t0 > 0) __syncthreads();  // every warp is done with the previous tile
        // Stage x[:, t0 .. t0 + tl8) as BF16 (zeros past cols), 4 columns per thread per step.
#pragma unroll 4
        for (int e = threadIdx.x * 4; e < m * tl8; e += blockDim.x * 4) {
            const int i = e / tl8, c = e - i * tl8;
            const float* xr = x + (long long)i * cols + t0 + c;
            float v[4];
            if (x_vec4 && c + 4 <= tl) {
                const float4 f = __ldg((const float4*)xr);
                v[0] = f.x;
                v[1] = f.y;
                v[2] = f.z;
                v[3] = f.w;
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) v[j] = c + j < tl ? __ldg(xr + j) : 0.0f;
            }
            *(uint2*)(xs + i * tile + c) = make_uint2((u32)f32_to_bf16(v[0]) | ((u32)f32_to_bf16(v[1]) << 16),
                                                      (u32)f32_to_bf16(v[2]) | ((u32)f32_to_bf16(v[3]) << 16));
        }
        __syncthreads();
        for (int c0 = t0; c0 < t0 + tl; c0 += CHUNK) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + (u * 32 + lane) * 8;  // < t0 + tl whenever < cols
                if (c >= cols) continue;
                float wf[R][8];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const u32 q[4] = {wv[r][u].x, wv[r][u].y, wv[r][u].z, wv[r][u].w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        wf[r][2 * j] = bf16_lo(q[j]);
                        wf[r][2 * j + 1] = bf16_hi(q[j]);
                    }
                }
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    if (i >= m) break;
                    const uint4 xv = *(const uint4*)(xs + i * tile + (c - t0));
                    const u32 q[4] = {xv.x, xv.y, xv.z, xv.w};
                    float xf[8];
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        xf[2 * j] = bf16_lo(q[j]);
                        xf[2 * j + 1] = bf16_hi(q[j]);
                    }
#pragma unroll
                    for (int r = 0; r < R; ++r)
#pragma unroll
                        for (int j = 0; j < 8; ++j) acc[i][r] = fmaf(wf[r][j], xf[j], acc[i][r]);
                }
            }
            // The next chunk may lie in the next tile: its loads are issued before that tile's staging.
            if (c0 + CHUNK < cols) bf16_gemv_load_chunk<R, U>(wv, w, r0, rows, cols, c0 + CHUNK, lane, w_vec);
        }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float v = warp_sum(acc[i][r]);
            // Spread the stores over the lanes; every lane holds the sum.
            if (lane == ((i * R + r) & 31) && i < m && r0 + r < rows) y[(long long)i * rows + r0 + r] = v;
        }
}

// Blocks of 256 threads each SM must hold at once: 4 for the one-token, one-row-per-warp GEMV
// (at most 64 registers, against 90 unbounded: 31 warps per SM instead of 16, so a 4096-row
// matrix's 512 blocks run in one wave; 3.3 against 2.8 TB/s on GLM-4.5-Air's o_proj on the H200,
// with no spill). The others keep their registers: bounded, the four-row one spills.
#define KRASIS_GEMV_MIN_BLOCKS(MT, R) ((MT) == 1 && (R) == 1 ? 4 : 1)
#define KRASIS_BF16_GEMV(MT, R)                                                                                \
    extern "C" __global__ void __launch_bounds__(256, KRASIS_GEMV_MIN_BLOCKS(MT, R))                           \
        bf16_gemv_m##MT##_r##R(const GemvParts parts, const float* x, int m, int cols, int tile, int w_vec,    \
                               int x_vec4) {                                                                   \
        bf16_gemv_body<MT, R>(parts, x, m, cols, tile, w_vec, x_vec4);                                         \
    }
#if defined(LINEAR_BF16_GEMV) && LINEAR_BF16_GEMV == 1
KRASIS_BF16_GEMV(1, 1)
KRASIS_BF16_GEMV(2, 1)
KRASIS_BF16_GEMV(4, 1)
KRASIS_BF16_GEMV(8, 1)
#endif
#if defined(LINEAR_BF16_GEMV) && LINEAR_BF16_GEMV == 4
KRASIS_BF16_GEMV(1, 4)
KRASIS_BF16_GEMV(2, 4)
KRASIS_BF16_GEMV(4, 4)
KRASIS_BF16_GEMV(8, 4)
#endif
