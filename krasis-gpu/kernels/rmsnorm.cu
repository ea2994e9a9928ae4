// RMSNorm fused with the residual add, one block per row of `hidden`:
//   if a delta is given:  x += delta            (x is the f32 residual stream, updated in place)
//   if a host delta too:  x += delta_host       (f32 in mapped host memory, read over PCIe: the
//                                                hybrid engine's CPU expert output, added after
//                                                `delta`, so x = (x + shared) + routed)
//   y = x / sqrt(mean(x^2) + eps) * w           (w: BF16 weight; y in f32 and/or BF16)
// Without a delta it is a plain RMSNorm of x (x unchanged), e.g. Qwen3's per-head qk-norm with
// rows = tokens*heads and hidden = head_dim. Pointers that are unused are passed as 0.
// Sum of squares and the scale in f32; 1/sqrtf (correctly rounded without fast-math), not rsqrtf.
//
// Launch: grid = rows, 256 threads (cfg_rows). Vector path (hidden % 4 == 0, f32 pointers 16-byte
// and BF16 pointers 8-byte aligned): thread j handles the groups of 4 elements j, j + 256, ...
// with 16-byte f32 and 8-byte BF16 loads, so a decode row of 2048 is two loads per thread per
// tensor, all in flight at once (the scalar loop issued eight dependent-address iterations).
// Otherwise the scalar loop over elements j, j + 256, ... Each element's x += delta and y are the
// same f32 operations on either path; only the order of the sum of squares differs (per thread in
// index order, then block_sum).
#include "krasis_common.cuh"

#define RMS_THREADS 256

__device__ __forceinline__ float4 rms_bf16x4(const bf16_t* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
}

extern "C" __global__ void rmsnorm_residual(float* __restrict__ x, const float* __restrict__ delta_f32,
                                            const bf16_t* __restrict__ delta_bf16,
                                            const float* __restrict__ delta_host, const bf16_t* __restrict__ w,
                                            float* __restrict__ y_f32, bf16_t* __restrict__ y_bf16, int rows,
                                            int hidden, float eps) {
    __shared__ float scratch[32];
    KRASIS_GRID_WAIT();
    KRASIS_GRID_LAUNCH_DEPENDENTS();
    const int r = blockIdx.x;
    if (r >= rows) return;
    float* xr = x + (long long)r * hidden;
    const long long base = (long long)r * hidden;
    const bool has_delta = delta_f32 || delta_bf16 || delta_host;
    const unsigned long long a16 = (unsigned long long)x | (unsigned long long)delta_f32 |
                                   (unsigned long long)delta_host | (unsigned long long)y_f32;
    const unsigned long long a8 = (unsigned long long)delta_bf16 | (unsigned long long)w | (unsigned long long)y_bf16;
    const bool vec = (hidden & 3) == 0 && (a16 & 15ull) == 0 && (a8 & 7ull) == 0;
    float ss = 0.0f;
    if (vec) {
        const int h4 = hidden >> 2;
        float4* x4 = reinterpret_cast<float4*>(xr);
        for (int i = threadIdx.x; i < h4; i += blockDim.x) {
            float4 v = x4[i];
            if (delta_f32 || delta_bf16) {
                const float4 d = delta_f32 ? reinterpret_cast<const float4*>(delta_f32 + base)[i]
                                           : rms_bf16x4(delta_bf16 + base + 4 * i);
                v.x += d.x;
                v.y += d.y;
                v.z += d.z;
                v.w += d.w;
            }
            if (delta_host) {
                const float4 d = reinterpret_cast<const float4*>(delta_host + base)[i];
                v.x += d.x;
                v.y += d.y;
                v.z += d.z;
                v.w += d.w;
            }
            if (has_delta) x4[i] = v;
            ss += v.x * v.x;
            ss += v.y * v.y;
            ss += v.z * v.z;
            ss += v.w * v.w;
        }
        ss = block_sum(ss, scratch);
        const float scale = 1.0f / sqrtf(ss / (float)hidden + eps);
        // Each thread reads back only the groups it wrote above: no barrier needed.
        for (int i = threadIdx.x; i < h4; i += blockDim.x) {
            const float4 v = x4[i];
            const float4 wv = rms_bf16x4(w + 4 * i);
            float4 y;
            y.x = v.x * scale * wv.x;
            y.y = v.y * scale * wv.y;
            y.z = v.z * scale * wv.z;
            y.w = v.w * scale * wv.w;
            if (y_f32) reinterpret_cast<float4*>(y_f32 + base)[i] = y;
            if (y_bf16) {
                uint2 u;
                u.x = (u32)f32_to_bf16(y.x) | ((u32)f32_to_bf16(y.y) << 16);
                u.y = (u32)f32_to_bf16(y.z) | ((u32)f32_to_bf16(y.w) << 16);
                reinterpret_cast<uint2*>(y_bf16 + base)[i] = u;
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = xr[i];
        if (delta_f32) v += delta_f32[base + i];
        if (delta_bf16) v += bf16_to_f32(delta_bf16[base + i]);
        if (delta_host) v += delta_host[base + i];
        if (has_delta) xr[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)hidden + eps);
    // Each thread reads back only the elements it wrote above: no barrier needed.
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float y = xr[i] * scale * bf16_to_f32(w[i]);
        if (y_f32) y_f32[base + i] = y;
        if (y_bf16) y_bf16[base + i] = f32_to_bf16(y);
    }
}
