// Dense linears: y[m, rows] = x[m, cols] . W^T, W row-major [rows, cols].
//
// BF16 weights go through cuBLAS; these kernels are the pieces around it (x to BF16) and the
// INT8 weight-only path: W8 row-major [rows, ldw] (ldw = cols rounded up to 16, zero padded, so
// every row starts 16-byte aligned), one f32 scale per output row, y = scale_r * sum_c q[r,c] x[c].
#include "krasis_common.cuh"

// Sign-extended byte `b` (0..3, little-endian) of a 32-bit word, as float (exact).
__device__ __forceinline__ float i8_at(int word, int b) { return (float)((int)((u32)word << (24 - 8 * b)) >> 24); }

// x f32 [m, cols] -> BF16 [m, ld] (round to nearest even), columns cols..ld-1 zeroed. One block
// per row.
extern "C" __global__ void f32_to_bf16_pad(const float* __restrict__ x, bf16_t* __restrict__ out, int m, int cols,
                                           int ld) {
    const int t = blockIdx.x;
    if (t >= m) return;
    const float* xr = x + (long long)t * cols;
    bf16_t* o = out + (long long)t * ld;
    for (int c = threadIdx.x; c < ld; c += blockDim.x) o[c] = c < cols ? f32_to_bf16(xr[c]) : (bf16_t)0;
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

// GEMV for small m (decode): one warp per R consecutive output rows; each lane reads 16 weights
// (one 16-byte load) per row per step, the warp 512 consecutive columns (coalesced), so every
// weight byte is read once for all m <= MT tokens. x is read as f32 (float4 when x_vec4, i.e.
// cols % 4 == 0 and x 16-byte aligned), accumulation is f32, and the row scale is applied once at
// the end.
template <int MT, int R>
__device__ __forceinline__ void int8_gemv_body(const signed char* __restrict__ w, const float* __restrict__ scale,
                                               const float* __restrict__ x, float* __restrict__ y, int m, int rows,
                                               int cols, int ldw, int x_vec4) {
    const int lane = threadIdx.x & 31;
    const int warp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int r0 = warp * R;
    if (r0 >= rows) return;  // whole warps leave together: no block-level barrier below
    float acc[MT][R];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[i][r] = 0.0f;

    for (int c0 = lane * 16; c0 < cols; c0 += 32 * 16) {
        int4 wv[R];
#pragma unroll
        for (int r = 0; r < R; ++r)
            wv[r] = r0 + r < rows ? __ldg((const int4*)(w + (long long)(r0 + r) * ldw + c0)) : make_int4(0, 0, 0, 0);
        const bool full = x_vec4 && c0 + 16 <= cols;
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            if (i >= m) break;
            const float* xr = x + (long long)i * cols + c0;
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
                for (int j = 0; j < 16; ++j) xv[j] = c0 + j < cols ? __ldg(xr + j) : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int words[4] = {wv[r].x, wv[r].y, wv[r].z, wv[r].w};
#pragma unroll
                for (int j = 0; j < 16; ++j) acc[i][r] += i8_at(words[j >> 2], j & 3) * xv[j];
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float v = warp_sum(acc[i][r]);
            if (lane == 0 && i < m && r0 + r < rows) y[(long long)i * rows + r0 + r] = v * scale[r0 + r];
        }
}

#define KRASIS_INT8_GEMV(MT, R)                                                                                  \
    extern "C" __global__ void int8_gemv_m##MT##_r##R(const signed char* w, const float* scale, const float* x, \
                                                      float* y, int m, int rows, int cols, int ldw, int x_vec4) { \
        int8_gemv_body<MT, R>(w, scale, x, y, m, rows, cols, ldw, x_vec4);                                       \
    }
KRASIS_INT8_GEMV(1, 1)
KRASIS_INT8_GEMV(2, 1)
KRASIS_INT8_GEMV(4, 1)
KRASIS_INT8_GEMV(8, 1)
KRASIS_INT8_GEMV(1, 4)
KRASIS_INT8_GEMV(2, 4)
KRASIS_INT8_GEMV(4, 4)
KRASIS_INT8_GEMV(8, 4)
