// A decode step's share of routed experts read straight from the CPU expert records
// (cpu-rb16-v1: symmetric INT4 or INT8 with f16 scales per group; cpu-rb16-int4a-g32-v1:
// asymmetric INT4 g32, `4a`, w = d q + m) in page-locked host memory:
// the SMs load the records over PCIe as they compute, with nothing copied into VRAM and no host
// involvement (the routes come from the router's published buffers). The CPU reads the other
// routes' experts at the same time, so the two links' bandwidths add.
//
// Layout (docs/FORMATS.md): a matrix is row blocks of 16 rows, each [scale header: per group the
// 16 rows' f16 scales, 32 bytes, padded to 64][group 0 weights][group 1 weights]...; a group is
// 64-byte chunks in which byte 4j + b holds row j's k0 + b (INT8: u = q + 128, 4 k-steps a
// chunk; INT4: u = q + 8 in the low nibble, k0 + 4 + b in the high one, 8 k-steps a chunk). `4a`:
// INT4's chunks with codes 0..15 as they are, and 64 header bytes a group: the 16 rows' f16
// scales d, then their f16 minimums m. A fused w13 interleaves gate and up row blocks.
//
// Each thread reads 16-byte vectors (four rows' words of one chunk). Blocks take vectors
// tid, tid + 256, ...; since a group's vector count is a multiple of 4, a thread always holds the
// same four rows, 4 (tid % 4) .. + 3, and keeps their sums in registers.
#include "krasis_common.cuh"

#define PCIE_THREADS 256
#define PCIE_WARPS (PCIE_THREADS / 32)

struct PciePart {
    int rows;         // logical rows (a w13 half: inter; w2: hidden)
    int k;            // columns (the x a row block reads)
    int gs;           // group size
    int bits;         // 4 or 8
    int block_bytes;  // bytes of one row block
    int header_bytes; // its scale header
    int group_bytes;  // weight bytes of one group of a row block
    int asym;         // 1: `4a` (codes 0..15, a minimum beside each scale; header 64 bytes a group)
};

// Route `slot` of token `tok`: the GPU takes positions [first, first + g) of each token's top_k.
__device__ __forceinline__ int pcie_route_id(const int* __restrict__ ids, int tok, int top_k, int first, int slot,
                                             int n_experts) {
    const int id = ids[tok * top_k + first + slot];
    return (id >= 0 && id < n_experts) ? id : -1;
}

// The row block at blk's f16 scales into sc (f32, [group][16]), and for `4a` its minimums into mn.
__device__ __forceinline__ float pcie_f16(const unsigned char* p) {
    const unsigned short h = *(const unsigned short*)p;
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ void pcie_load_scales(const unsigned char* __restrict__ blk, const PciePart& p,
                                                 float* __restrict__ sc, float* __restrict__ mn) {
    const int n = (p.k / p.gs) * 16;
    const int per_group = p.asym ? 64 : 32;
    for (int i = threadIdx.x; i < n; i += PCIE_THREADS) {
        const unsigned char* h = blk + (i >> 4) * per_group + 2 * (i & 15);
        sc[i] = pcie_f16(h);
        if (p.asym) mn[i] = pcie_f16(h + 32);
    }
}

// acc[m] += sum over this thread's vectors of row 4 (tid % 4) + m's weights . xs (per group: the
// scale times the codes' sum, plus for `4a` the minimum times the x sum).
__device__ __forceinline__ void pcie_block_dot(const unsigned char* __restrict__ blk, const PciePart& p,
                                               const float* __restrict__ xs, const float* __restrict__ sc,
                                               const float* __restrict__ mn, float (&acc)[4]) {
    const int vpg = p.group_bytes >> 4;  // vectors per group (a multiple of 4)
    const int nv = (p.k / p.gs) * vpg;
    const int jq = threadIdx.x & 3;
    const unsigned char* w = blk + p.header_bytes;
    const int zero = p.asym ? 0 : 8;
#pragma unroll 4
    for (int v = threadIdx.x; v < nv; v += PCIE_THREADS) {
        const int g = v / vpg, off = v - g * vpg;
        const uint4 q = *(const uint4*)(w + (long long)g * p.group_bytes + 16 * off);
        const u32 words[4] = {q.x, q.y, q.z, q.w};
        const float* s = sc + g * 16 + 4 * jq;
        if (p.bits == 4) {
            const float* x = xs + g * p.gs + (off >> 2) * 8;
            float sx = 0.0f;
            if (p.asym) {
#pragma unroll
                for (int b = 0; b < 8; ++b) sx += x[b];
            }
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const u32 wd = words[m];
                float d = 0.0f;
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const u32 byte = (wd >> (8 * b)) & 0xffu;
                    d += (float)((int)(byte & 0xfu) - zero) * x[b] + (float)((int)(byte >> 4) - zero) * x[4 + b];
                }
                acc[m] += s[m] * d;
                if (p.asym) acc[m] += mn[g * 16 + 4 * jq + m] * sx;
            }
        } else {
            const float* x = xs + g * p.gs + (off >> 2) * 4;
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const u32 wd = words[m];
                float d = 0.0f;
#pragma unroll
                for (int b = 0; b < 4; ++b) d += (float)((int)((wd >> (8 * b)) & 0xffu) - 128) * x[b];
                acc[m] += s[m] * d;
            }
        }
    }
}

// The block's 16 row sums of acc (every thread's four rows) into red[16] (shared), visible
// to the whole block on return. red must hold PCIE_WARPS * 16 floats.
__device__ __forceinline__ void pcie_reduce(float (&acc)[4], float* __restrict__ red, float* __restrict__ out16) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
    }
    if (lane < 4) {
#pragma unroll
        for (int m = 0; m < 4; ++m) red[warp * 16 + 4 * lane + m] = acc[m];
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < PCIE_WARPS; ++w) s += red[w * 16 + threadIdx.x];
        out16[threadIdx.x] = s;
    }
    __syncthreads();
}

// Gate and up of one row-block pair for one route: h[route][16 pair + j] = act(gate_j, up_j).
// grid (inter / 16, t * g); dynamic shared memory (k + (1 + asym) * groups * 16 + PCIE_WARPS * 16
// + 32) floats. records: the layer's expert 0 record (device address of page-locked host memory);
// x [t][k] f32.
extern "C" __global__ void __launch_bounds__(PCIE_THREADS)
    pcie_w13(const unsigned char* __restrict__ records, long long stride, PciePart p, MoeAct act,
             const float* __restrict__ x, const int* __restrict__ ids, int top_k, int first, int g, int n_experts,
             float* __restrict__ h) {
    extern __shared__ float sm[];
    const int groups = p.k / p.gs;
    float* xs = sm;
    float* sc = xs + p.k;
    float* mn = sc + groups * 16;
    float* red = mn + (p.asym ? groups * 16 : 0);
    float* sums = red + PCIE_WARPS * 16;
    const int pair = blockIdx.x, route = blockIdx.y, tok = route / g;
    const int id = pcie_route_id(ids, tok, top_k, first, route - tok * g, n_experts);
    float* out = h + (long long)route * p.rows;
    if (id < 0) {
        if (threadIdx.x < 16 && 16 * pair + threadIdx.x < p.rows) out[16 * pair + threadIdx.x] = 0.0f;
        return;
    }
    const unsigned char* gate = records + (long long)id * stride + (long long)(2 * pair) * p.block_bytes;
    const unsigned char* up = gate + p.block_bytes;
    for (int i = threadIdx.x; i < p.k; i += PCIE_THREADS) xs[i] = x[(long long)tok * p.k + i];
    // One header buffer, gate's then up's (the reductions' barriers order the reuse).
    pcie_load_scales(gate, p, sc, mn);
    __syncthreads();
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    pcie_block_dot(gate, p, xs, sc, mn, a);
    pcie_reduce(a, red, sums);
    pcie_load_scales(up, p, sc, mn);
    __syncthreads();
    float b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    pcie_block_dot(up, p, xs, sc, mn, b);
    pcie_reduce(b, red, sums + 16);
    const int o = 16 * pair + threadIdx.x;
    if (threadIdx.x < 16 && o < p.rows) out[o] = moe_act(act, id, o, sums[threadIdx.x], sums[16 + threadIdx.x]);
}

// The down projection of every GPU route of token blockIdx.y for one row block, weighted by the
// routes' weights and summed: y[tok][16 rb + j] = (accumulate ? y : 0) + sum. grid (row blocks, t);
// dynamic shared memory (k + (1 + asym) * groups * 16 + PCIE_WARPS * 16 + 16) floats. h [t * g][k]
// from pcie_w13.
extern "C" __global__ void __launch_bounds__(PCIE_THREADS)
    pcie_w2(const unsigned char* __restrict__ records, long long stride, long long w2_offset, PciePart p,
            const float* __restrict__ h, const int* __restrict__ ids, const float* __restrict__ weights, int top_k,
            int first, int g, int n_experts, float* __restrict__ y, int accumulate) {
    extern __shared__ float sm[];
    const int groups = p.k / p.gs;
    float* xs = sm;
    float* sc = xs + p.k;
    float* mn = sc + groups * 16;
    float* red = mn + (p.asym ? groups * 16 : 0);
    float* sums = red + PCIE_WARPS * 16;
    const int rb = blockIdx.x, tok = blockIdx.y;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int slot = 0; slot < g; ++slot) {
        const int id = pcie_route_id(ids, tok, top_k, first, slot, n_experts);
        if (id < 0) continue;
        const float wt = weights[tok * top_k + first + slot];
        const unsigned char* blk = records + (long long)id * stride + w2_offset + (long long)rb * p.block_bytes;
        __syncthreads();  // the previous route's xs and sc are read
        const float* hr = h + (long long)(tok * g + slot) * p.k;
        for (int i = threadIdx.x; i < p.k; i += PCIE_THREADS) xs[i] = wt * hr[i];
        pcie_load_scales(blk, p, sc, mn);
        __syncthreads();
        pcie_block_dot(blk, p, xs, sc, mn, acc);
    }
    pcie_reduce(acc, red, sums);
    const int r = 16 * rb + threadIdx.x;
    if (threadIdx.x < 16 && r < p.rows) {
        float* o = y + (long long)tok * p.rows + r;
        *o = (accumulate ? *o : 0.0f) + sums[threadIdx.x];
    }
}
