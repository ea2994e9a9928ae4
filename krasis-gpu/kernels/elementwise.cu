// Small glue kernels the engine needs between the big ops: positions, residual adds, a
// projection's bias added to each row, strided row copies with an optional cast to BF16, an
// in-place RMSNorm over a prefix of strided rows (MLA's latent, Qwen3's per-head q/k norm) and a
// row scaled by the sigmoid of a one-logit gate (a shared expert's gate).
#include "krasis_common.cuh"

// ids[i] = map[ids[i]] for ids in [0, n_map); other values are left as they are (out of range
// stays out of range). Renumbers routed expert ids into a layer's pinned order.
extern "C" __global__ void remap_ids_i32(int* ids, const int* map, int n_map, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        int e = ids[i];
        if (e >= 0 && e < n_map) ids[i] = map[e];
    }
}

// out[i] = start + i
extern "C" __global__ void iota_i32(int* out, int start, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = start + i;
}

// y[i] += x[i]
extern "C" __global__ void add_inplace_f32(float* y, const float* x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}

// y[r, c] += bias[c] for y [rows, cols] f32 and a BF16 bias [cols] (a projection's bias after its
// GEMM: GLM-4.5's q/k/v). One element per thread over the whole matrix.
extern "C" __global__ void add_bias_rows_f32(float* y, const bf16_t* bias, long long rows, int cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) y[i] += bf16_to_f32(bias[i % cols]);
}

// dst[r, c] = src[r * src_stride + c] for c < cols, dst row stride dst_stride. One block row per
// grid.y row; threads along the columns.
template <typename T>
__device__ void copy_rows(const float* src, long long src_stride, T* dst, long long dst_stride, int rows, int cols) {
    int r = blockIdx.y;
    if (r >= rows) return;
    convert_row(src + (long long)r * src_stride, dst + (long long)r * dst_stride, cols, cols,
                blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
}

extern "C" __global__ void copy_rows_f32(const float* src, long long src_stride, float* dst, long long dst_stride,
                                        int rows, int cols) {
    copy_rows(src, src_stride, dst, dst_stride, rows, cols);
}

extern "C" __global__ void copy_rows_f32_bf16(const float* src, long long src_stride, bf16_t* dst,
                                             long long dst_stride, int rows, int cols) {
    copy_rows(src, src_stride, dst, dst_stride, rows, cols);
}

// In place: for each row r, x[r*stride .. r*stride+n] = x / sqrt(mean(x^2) + eps) * w (w BF16 [n]).
// One block per row.
extern "C" __global__ void rmsnorm_strided_inplace(float* x, long long stride, const bf16_t* w, int rows, int n,
                                                  float eps) {
    __shared__ float scratch[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    rmsnorm_row_inplace(x + (long long)r * stride, n, w, eps, scratch);
}

// y[r, :n_out] *= sigmoid(dot(x[r, :n_in], w)) for y [rows, n_out] and x [rows, n_in] f32 and a
// BF16 w [n_in]: each row scaled by the sigmoid of one logit of its input (the shared expert's
// `shared_expert_gate` of Qwen2-MoE / Qwen3-Next). One block per row: the dot product summed over
// the block in f32, then the row scaled. 1/(1+expf), not __expf: as the CPU's sigmoid.
extern "C" __global__ void sigmoid_gate_rows_f32(float* y, const float* x, const bf16_t* w, int rows, int n_in,
                                                int n_out) {
    __shared__ float scratch[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long long)r * n_in;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n_in; i += blockDim.x) s += xr[i] * bf16_to_f32(w[i]);
    s = block_sum(s, scratch);
    const float g = 1.0f / (1.0f + expf(-s));
    float* yr = y + (long long)r * n_out;
    for (int i = threadIdx.x; i < n_out; i += blockDim.x) yr[i] *= g;
}
