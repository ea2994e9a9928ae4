// RMSNorm fused with the residual add, one block per row of `hidden`:
//   if a delta is given:  x += delta            (x is the f32 residual stream, updated in place)
//   y = x / sqrt(mean(x^2) + eps) * w           (w: BF16 weight; y in f32 and/or BF16)
// Without a delta it is a plain RMSNorm of x (x unchanged), e.g. Qwen3's per-head qk-norm with
// rows = tokens*heads and hidden = head_dim. Pointers that are unused are passed as 0.
// Sum of squares and the scale in f32; 1/sqrtf (correctly rounded without fast-math), not rsqrtf.
#include "krasis_common.cuh"

extern "C" __global__ void rmsnorm_residual(float* __restrict__ x, const float* __restrict__ delta_f32,
                                            const bf16_t* __restrict__ delta_bf16, const bf16_t* __restrict__ w,
                                            float* __restrict__ y_f32, bf16_t* __restrict__ y_bf16, int rows,
                                            int hidden, float eps) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    float* xr = x + (long long)r * hidden;
    const long long base = (long long)r * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = xr[i];
        if (delta_f32) v += delta_f32[base + i];
        if (delta_bf16) v += bf16_to_f32(delta_bf16[base + i]);
        if (delta_f32 || delta_bf16) xr[i] = v;
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
