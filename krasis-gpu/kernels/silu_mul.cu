// SwiGLU activation: out[r, c] = silu(gate[r, c]) * up[r, c], silu(g) = g / (1 + exp(-g)), in f32.
// Rows are strided, so the fused gate_up [rows, 2*cols] layout (gate first, up second) is
// gate = base, up = base + cols, strides 2*cols.
// Launch: grid (rows, ceil(cols / blockDim.x) capped at 65535), 256 threads: block (r, y) covers
// columns y*256 + j, stepping by gridDim.y*256, so a thread handles one element when the grid is
// not capped. Why: with one block per row, decode (rows = 1, cols = 2816) ran on one SM with each
// thread walking 11 elements serially; now it is 11 blocks of single loads.
#include "krasis_common.cuh"

template <typename In, typename Out>
__device__ __forceinline__ void silu_mul_body(const In* __restrict__ gate, const In* __restrict__ up,
                                              Out* __restrict__ out, int rows, int cols, long long gate_stride,
                                              long long up_stride, long long out_stride) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const long long g0 = (long long)r * gate_stride, u0 = (long long)r * up_stride, o0 = (long long)r * out_stride;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < cols; c += gridDim.y * blockDim.x) {
        const float g = load_f(gate, g0 + c);
        const float u = load_f(up, u0 + c);
        store_f(out, o0 + c, g / (1.0f + expf(-g)) * u);
    }
}

extern "C" __global__ void silu_mul_f32(const float* gate, const float* up, float* out, int rows, int cols,
                                        long long gate_stride, long long up_stride, long long out_stride) {
    silu_mul_body(gate, up, out, rows, cols, gate_stride, up_stride, out_stride);
}

extern "C" __global__ void silu_mul_bf16(const bf16_t* gate, const bf16_t* up, bf16_t* out, int rows, int cols,
                                         long long gate_stride, long long up_stride, long long out_stride) {
    silu_mul_body(gate, up, out, rows, cols, gate_stride, up_stride, out_stride);
}

extern "C" __global__ void silu_mul_f32_bf16(const float* gate, const float* up, bf16_t* out, int rows, int cols,
                                             long long gate_stride, long long up_stride, long long out_stride) {
    silu_mul_body(gate, up, out, rows, cols, gate_stride, up_stride, out_stride);
}
