// Shared helpers for krasis kernels. Header-free on purpose: NVRTC compiles these with no CUDA
// headers at all (no cuda_bf16.h), so every GPU architecture and every NVRTC release that
// krasis supports can build them, including the PyPI libnvrtc used by CI.
#pragma once

typedef unsigned short bf16_t;  // bfloat16 bits
typedef unsigned int u32;
typedef unsigned long long u64;

// bf16 -> f32 is exact: the bf16 bits are the top half of the f32.
__device__ __forceinline__ float bf16_to_f32(bf16_t h) { return __uint_as_float(((u32)h) << 16); }

// f32 -> bf16, round to nearest even; NaN stays a (quiet) NaN. Same as krasis_core::dtype::f32_to_bf16.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// x ~= hi + lo, both BF16: hi is x rounded, lo the remainder rounded, so |x - hi - lo| <= 2^-17 |x|
// (8 significant bits each). Two tensor-core products, one per half, keep an f32 operand to
// about f32 accuracy.
__device__ __forceinline__ void bf16_split(float x, bf16_t& hi, bf16_t& lo) {
    hi = f32_to_bf16(x);
    lo = f32_to_bf16(x - bf16_to_f32(hi));
}

// Two consecutive BF16 (4-byte aligned) as one register of an MMA fragment.
__device__ __forceinline__ u32 ld_bf16x2(const bf16_t* p) { return *reinterpret_cast<const u32*>(p); }
// Two BF16 as one register, `lo_elem` in bits 0..15.
__device__ __forceinline__ u32 bf16x2_of(bf16_t lo_elem, bf16_t hi_elem) { return (u32)lo_elem | ((u32)hi_elem << 16); }

// d[16x8] += a[16x16] · b[16x8] (A row-major, B column-major), BF16 inputs, f32 accumulators
// (sm_80+). Fragments (PTX ISA; g = lane / 4, q = lane % 4; pairs packed low element first):
// a[0..3] = A[g][2q..], A[g+8][2q..], A[g][2q+8..], A[g+8][2q+8..]; b0 = B[2q..][g],
// b1 = B[2q+8..][g]; d[0..1] = D[g][2q..], d[2..3] = D[g+8][2q..]. Not volatile: a pure function
// of its registers, so the compiler may interleave it freely.
__device__ __forceinline__ void mma_bf16(float* d, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// Four 8x8 b16 matrices from shared memory (sm_75+): lanes 8j..8j+7 give the (16-byte aligned)
// shared-space row addresses of matrix j; register j of lane l gets (M_j[l/4][2(l%4)],
// M_j[l/4][2(l%4)+1]), i.e. an MMA A or B fragment register when the rows are the fragment's rows.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");  // reads shared memory written by other threads before a barrier
}

// 16-byte async copy global -> shared (sm_80+) to the shared-space address `dst`; src_bytes 0
// zero-fills the destination without reading.
__device__ __forceinline__ void cp_async16_at(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    cp_async16_at(smem_addr(dst), src, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N committed groups (the newest) are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ float krasis_nan() { return __uint_as_float(0x7fc00000u); }

// Loads/stores that let one kernel body serve f32 and bf16 tensors.
__device__ __forceinline__ float load_f(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load_f(const bf16_t* p, long long i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void store_f(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f(bf16_t* p, long long i, float v) { p[i] = f32_to_bf16(v); }
// Four values at p + i (i a multiple of 4, p + i aligned to 4 elements), converted as store_f.
__device__ __forceinline__ void store_f4(float* p, long long i, float4 v) { *(float4*)(p + i) = v; }
__device__ __forceinline__ void store_f4(bf16_t* p, long long i, float4 v) {
    const u32 lo = (u32)f32_to_bf16(v.x) | ((u32)f32_to_bf16(v.y) << 16);
    const u32 hi = (u32)f32_to_bf16(v.z) | ((u32)f32_to_bf16(v.w) << 16);
    *(uint2*)(p + i) = make_uint2(lo, hi);
}
// True when p is aligned to `bytes` (a power of two).
__device__ __forceinline__ bool aligned_to(const void* p, unsigned bytes) {
    return ((unsigned long long)p & (bytes - 1)) == 0;
}

// One row: dst[c] = src[c] (converted as store_f) for c < cols and 0 for cols <= c < len, over
// columns c0, c0 + step, ... (a thread's share). Whole float4s when cols and len are multiples of
// 4 and both rows are aligned to 4 elements: the same values, a quarter of the load instructions.
template <typename T>
__device__ __forceinline__ void convert_row(const float* src, T* dst, int cols, int len,
                                            int c0, int step) {
    if ((cols & 3) == 0 && (len & 3) == 0 && aligned_to(src, 16) && aligned_to(dst, 4 * sizeof(T))) {
        const float4* s4 = (const float4*)src;
        for (int c = c0; c < len / 4; c += step)
            store_f4(dst, 4 * c, 4 * c < cols ? s4[c] : make_float4(0.0f, 0.0f, 0.0f, 0.0f));
        return;
    }
    for (int c = c0; c < len; c += step) store_f(dst, c, c < cols ? src[c] : 0.0f);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block; every thread gets the result. blockDim.x must be a multiple of 32.
// `scratch` must hold 32 floats of shared memory; the call ends with a barrier, so the same
// scratch can be reused by a following call.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}

// In place: row[0..n] = row / sqrt(mean(row^2) + eps) * w (w BF16 [n]), by the whole block
// (blockDim a multiple of 32; `scratch` 32 floats of shared memory). 1/sqrtf, not rsqrtf: correctly
// rounded without fast-math, as rmsnorm.cu.
__device__ __forceinline__ void rmsnorm_row_inplace(float* row, int n, const bf16_t* w, float eps, float* scratch) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += row[i] * row[i];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) row[i] = row[i] * inv * bf16_to_f32(w[i]);
}

// Programmatic dependent launch (GpuDevice::launch_dependent, sm_90+): a kernel launched that way
// may start while the previous kernel in the stream still runs. KRASIS_GRID_WAIT() blocks until
// that kernel has finished and its writes are visible, so it must come before any access to
// memory that earlier stream work writes or reads; KRASIS_GRID_LAUNCH_DEPENDENTS() lets the next
// kernel's blocks be scheduled early (they still wait for this kernel to finish). Both are no-ops
// below sm_90 and in a kernel launched the ordinary way.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KRASIS_GRID_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define KRASIS_GRID_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define KRASIS_GRID_WAIT() \
    do {                   \
    } while (0)
#define KRASIS_GRID_LAUNCH_DEPENDENTS() \
    do {                                \
    } while (0)
#endif

// The routed experts' activation, an argument of every gate/up kernel (krasis-core's
// ExpertActivation and the experts' biases; gpt-oss): b13 f32 [n_experts, 2 * inter] holds expert
// e's gate biases then its up biases (or is null: no biases), added to the gate and up sums before
// the activation; clamped 0: silu(g) * u; 1: gpt-oss's clamped SwiGLU, g' = min(g, limit),
// u' = clamp(u, -limit, limit), (u' + 1) * g' * sigmoid(alpha * g'). The down bias is moe_combine's.
struct MoeAct {
    const float* b13;
    int inter;
    int clamped;
    float alpha, limit;
};

// The activation of expert e's intermediate column o (o < inter) from its gate and up sums.
__device__ __forceinline__ float moe_act(const MoeAct& a, int e, int o, float g, float u) {
    if (a.b13) {
        const float* b = a.b13 + (long long)e * 2 * a.inter;
        g += b[o];
        u += b[a.inter + o];
    }
    if (!a.clamped) return g / (1.0f + expf(-g)) * u;
    g = fminf(g, a.limit);
    u = fminf(fmaxf(u, -a.limit), a.limit);
    return (u + 1.0f) * (g / (1.0f + expf(-a.alpha * g)));
}
