// The GPU KV cache: writing f32 rows into f32, BF16 or FP8 E4M3 storage, and dequantised reads.
//
// Storage of one (layer, plane): `capacity` rows of `row` elements, row-major, rows back to back
// (f32: 4 bytes per element, stored as given; BF16: 2 bytes; FP8: 1 byte). FP8 also keeps one f32
// scale per `group` consecutive elements of a row: scales [capacity, row / group]. A stored FP8
// element decodes as e4m3(code) * scale, where scale = amax(|group|) / 448 (codes 0 where that
// scale is 0).
#include "krasis_common.cuh"

// Largest finite E4M3 ("fn" variant) value.
#define KV_FP8_MAX 448.0f

// f32 -> E4M3 code, round to nearest even, saturating to +-448; NaN -> 0x7f. Same algorithm as
// krasis_gpu::kv_cache::f32_to_fp8_e4m3 on the host (the tests compare the two bit for bit).
__device__ __forceinline__ unsigned char kv_f32_to_e4m3(float x) {
    const u32 bits = __float_as_uint(x);
    const u32 sign = (bits >> 24) & 0x80u;
    const u32 abits = bits & 0x7fffffffu;
    if (abits > 0x7f800000u) return 0x7f;                  // NaN
    const float a = __uint_as_float(abits);
    if (a >= KV_FP8_MAX) return (unsigned char)(sign | 0x7eu);  // saturate (inf included)
    if (a < 0.015625f) {                                    // below 2^-6: subnormal grid m * 2^-9
        const u32 m = (u32)rintf(a * 512.0f);               // exact scaling, RNE; m == 8 is 2^-6
        return (unsigned char)(sign | m);
    }
    int e = (int)(abits >> 23) - 127;                       // -6 ..= 8
    u32 q = (abits >> 20) & 7u;
    const u32 rem = abits & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (q & 1u))) q++;
    if (q == 8u) { q = 0; e++; }
    return (unsigned char)(sign | ((u32)(e + 7) << 3) | q);
}

// E4M3 code -> f32, exact; 0x7f / 0xff are NaN. The code's magnitude bits placed at the top of an
// f32 mantissa/exponent give the value times 2^-120 (subnormals included), so one exact multiply
// by 2^120 rebiases it. Duplicated in attn_decode.cu (kernels are compiled one file at a time).
__device__ __forceinline__ float kv_e4m3_to_f32(u32 c) {
    const u32 mag = c & 0x7fu;
    float v = __uint_as_float(mag << 20) * __uint_as_float(0x7b800000u);  // * 2^120
    if (mag == 0x7fu) v = krasis_nan();
    return (c & 0x80u) ? -v : v;
}

// src f32 [t, row] -> rows pos..pos+t of a BF16 (rounded to nearest even) or f32 (as given)
// plane. Grid: (t), any block size.
template <typename Out>
__device__ __forceinline__ void kv_write_plain_body(const float* __restrict__ src, Out* __restrict__ dst, int t,
                                                    int row, long long pos) {
    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();
    const int i = blockIdx.x;
    if (i >= t) return;
    const float* s = src + (long long)i * row;
    Out* d = dst + (pos + i) * (long long)row;
    for (int j = threadIdx.x; j < row; j += blockDim.x) store_f(d, j, s[j]);
}

extern "C" __global__ void kv_write_bf16(const float* src, bf16_t* dst, int t, int row, long long pos) {
    kv_write_plain_body(src, dst, t, row, pos);
}

extern "C" __global__ void kv_write_f32(const float* src, float* dst, int t, int row, long long pos) {
    kv_write_plain_body(src, dst, t, row, pos);
}

// src f32 [t, row] -> rows pos..pos+t of an FP8 plane and its scales [cap, row/group].
// Grid: (t), block: a multiple of 32; one warp per group at a time.
extern "C" __global__ void kv_write_fp8(const float* __restrict__ src, unsigned char* __restrict__ dst,
                                        float* __restrict__ scales, int t, int row, int group, long long pos) {
    const int i = blockIdx.x;
    if (i >= t) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int groups = row / group;
    const float* s = src + (long long)i * row;
    unsigned char* d = dst + (pos + i) * (long long)row;
    float* sc = scales + (pos + i) * (long long)groups;
    for (int g = warp; g < groups; g += nwarps) {
        const float* sg = s + (long long)g * group;
        float amax = 0.0f;
        for (int j = lane; j < group; j += 32) amax = fmaxf(amax, fabsf(sg[j]));  // fmaxf skips NaN
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float scale = amax / KV_FP8_MAX;
        for (int j = lane; j < group; j += 32) {
            const float x = sg[j];
            // A group whose scale is 0 (all zero, or amax / 448 underflows) stores zero codes.
            d[(long long)g * group + j] = scale == 0.0f ? (unsigned char)0 : kv_f32_to_e4m3(x / scale);
        }
        if (lane == 0) sc[g] = scale;
    }
}

// Rows start..start+len of an f32 or BF16 plane into f32 or BF16 dst [len, row] (converted as
// load_f / store_f do). Grid: (len).
template <typename In, typename Out>
__device__ __forceinline__ void kv_read_plain_body(const In* __restrict__ src, Out* __restrict__ dst, int len,
                                                   int row, long long start) {
    const int i = blockIdx.x;
    if (i >= len) return;
    const In* s = src + (start + i) * (long long)row;
    for (int j = threadIdx.x; j < row; j += blockDim.x) store_f(dst, (long long)i * row + j, load_f(s, j));
}

template <typename Out>
__device__ __forceinline__ void kv_read_fp8_body(const unsigned char* __restrict__ src,
                                                 const float* __restrict__ scales, Out* __restrict__ dst, int len,
                                                 int row, int group, long long start) {
    const int i = blockIdx.x;
    if (i >= len) return;
    const int groups = row / group;
    const unsigned char* s = src + (start + i) * (long long)row;
    const float* sc = scales + (start + i) * (long long)groups;
    for (int j = threadIdx.x; j < row; j += blockDim.x)
        store_f(dst, (long long)i * row + j, kv_e4m3_to_f32(s[j]) * sc[j / group]);
}

extern "C" __global__ void kv_read_bf16_f32(const bf16_t* src, float* dst, int len, int row, long long start) {
    kv_read_plain_body(src, dst, len, row, start);
}

extern "C" __global__ void kv_read_bf16_bf16(const bf16_t* src, bf16_t* dst, int len, int row, long long start) {
    kv_read_plain_body(src, dst, len, row, start);
}

extern "C" __global__ void kv_read_f32_f32(const float* src, float* dst, int len, int row, long long start) {
    kv_read_plain_body(src, dst, len, row, start);
}

extern "C" __global__ void kv_read_f32_bf16(const float* src, bf16_t* dst, int len, int row, long long start) {
    kv_read_plain_body(src, dst, len, row, start);
}

extern "C" __global__ void kv_read_fp8_f32(const unsigned char* src, const float* scales, float* dst, int len,
                                           int row, int group, long long start) {
    kv_read_fp8_body(src, scales, dst, len, row, group, start);
}

extern "C" __global__ void kv_read_fp8_bf16(const unsigned char* src, const float* scales, bf16_t* dst, int len,
                                            int row, int group, long long start) {
    kv_read_fp8_body(src, scales, dst, len, row, group, start);
}
