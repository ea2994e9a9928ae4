// Quantised experts from the CPU packed layout (cpu-rb16-v1, the CPU expert cache's records) to
// the GPU tile layout (gpu-tile64-v1), on the device: the hybrid engine can then keep one copy of
// the experts in RAM (the CPU's) and stream it to the GPU. Same codes, same f16 scales; only the
// order changes (docs/FORMATS.md has both layouts).
//
// One matrix part per launch, for `experts` experts (grid.y): the source part of expert e starts
// at src + e * src_stride, the destination codes at dst_codes + e * dst_stride and the scales at
// dst_scales + e * dst_stride (bytes). A CPU row block is [scale header][group 0 weights]...; the
// fused w13 interleaves gate and up row blocks, while the GPU w13 is gate rows (zero rows up to
// inter_pad) then up rows. Elements past the matrix get the code of q = 0 and scale 0, as the
// host packer writes them.
#include "krasis_common.cuh"

struct CpuPart {
    int rows;        // logical rows of the GPU matrix's source (hidden for w2; inter for a w13 half)
    int fused;       // 1: w13 (gate, up interleaved by row block; GPU rows 2 * inter_pad)
    int inter_pad;   // fused: the GPU's padded half
    int k;           // logical K
    int gs;          // group size
    int bits;        // 4 or 8
    int block_bytes; // bytes of one CPU row block
    int header_bytes;
    int group_weight_bytes;
};

// The CPU row block and row within it of GPU row r, or -1.
__device__ __forceinline__ int cpu_block_of(const CpuPart& p, int r, int& j) {
    if (p.fused) {
        const bool up = r >= p.inter_pad;
        const int u = up ? r - p.inter_pad : r;
        if (u >= p.rows) return -1;
        j = u & 15;
        return 2 * (u >> 4) + (up ? 1 : 0);
    }
    if (r >= p.rows) return -1;
    j = r & 15;
    return r >> 4;
}

// The 4-bit code of row j of a row block at k = kk of a group whose codes start at w: INT4's chunk
// arrangement (byte 4j + b of chunk kk / 8 holds k 8c + b in its low nibble, 8c + 4 + b in its high).
__device__ __forceinline__ u32 cpu_nibble(const unsigned char* __restrict__ w, int j, int kk) {
    const int b8 = kk & 7;
    const u32 byte = w[(kk >> 3) * 64 + 4 * j + (b8 & 3)];
    return (byte >> (4 * (b8 >> 2))) & 0xfu;
}

// The unsigned code of (GPU row r, k) from the CPU part at src.
__device__ __forceinline__ u32 cpu_code(const unsigned char* __restrict__ src, const CpuPart& p, int r, int k) {
    const u32 zero = p.bits == 4 ? 8u : 128u;
    int j = 0;
    const int rb = cpu_block_of(p, r, j);
    if (rb < 0 || k >= p.k) return zero;
    const int g = k / p.gs, kk = k - g * p.gs;
    const unsigned char* w = src + (long long)rb * p.block_bytes + p.header_bytes + (long long)g * p.group_weight_bytes;
    if (p.bits == 4) return cpu_nibble(w, j, kk);
    return w[(kk >> 2) * 64 + 4 * j + (kk & 3)];
}

// One thread per u32 word of an expert's GPU codes: panel-major (panel, chunk) blocks of 64 x 64,
// words [ks][j][lane] (INT4: j = tile pair, nibble 2 (t % 2) + (k >= 8) + 4 (k % 2); INT8: j = t,
// byte 2 (k >= 8) + k % 2).
extern "C" __global__ void relayout_codes(const unsigned char* __restrict__ src, long long src_stride,
                                          unsigned char* __restrict__ dst, long long dst_stride, CpuPart p,
                                          int chunks, int words) {
    const int w = blockIdx.x * blockDim.x + threadIdx.x;
    if (w >= words) return;
    const unsigned char* s = src + (long long)blockIdx.y * src_stride;
    const int per_block = p.bits == 4 ? 512 : 1024;
    const int blk = w / per_block, wi = w - blk * per_block;
    const int panel = blk / chunks, chunk = blk - panel * chunks;
    const int lane = wi & 31, rest = wi >> 5;
    const int g = lane >> 2, q = lane & 3;
    u32 word = 0;
    if (p.bits == 4) {
        const int ks = rest >> 2, jj = rest & 3;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            const int odd = n >> 2, rem = n & 3;
            const int t = 2 * jj + (rem >> 1), khalf = rem & 1;
            const int r = panel * 64 + 8 * t + g;
            const int k = chunk * 64 + 16 * ks + 8 * khalf + 2 * q + odd;
            word |= cpu_code(s, p, r, k) << (4 * n);
        }
    } else {
        const int ks = rest >> 3, t = rest & 7;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int khalf = b >> 1, odd = b & 1;
            const int r = panel * 64 + 8 * t + g;
            const int k = chunk * 64 + 16 * ks + 8 * khalf + 2 * q + odd;
            word |= cpu_code(s, p, r, k) << (8 * b);
        }
    }
    *(u32*)(dst + (long long)blockIdx.y * dst_stride + 4LL * w) = word;
}

// One thread per f16 scale of an expert's GPU scales [panel][group][g][t] (groups over the padded
// K; padding groups and rows get 0).
extern "C" __global__ void relayout_scales(const unsigned char* __restrict__ src, long long src_stride,
                                           unsigned char* __restrict__ dst, long long dst_stride, CpuPart p,
                                           int groups, int count) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const unsigned char* s = src + (long long)blockIdx.y * src_stride;
    const int t = i & 7, g = (i >> 3) & 7, rest = i >> 6;
    const int grp = rest % groups, panel = rest / groups;
    const int r = panel * 64 + 8 * t + g;
    int j = 0;
    const int rb = cpu_block_of(p, r, j);
    unsigned short v = 0;
    if (rb >= 0 && grp < p.k / p.gs) {
        const unsigned char* h = s + (long long)rb * p.block_bytes + grp * 32 + 2 * j;
        v = (unsigned short)(h[0] | (h[1] << 8));
    }
    *(unsigned short*)(dst + (long long)blockIdx.y * dst_stride + 2LL * i) = v;
}

// f16 bits -> f32 (exact).
__device__ __forceinline__ float relayout_f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
    return f;
}

// The smallest f16 >= t (t >= 0, finite), saturating at the largest finite f16 (0x7bff): round to
// nearest, then one step up when that fell below t. Same as the host's int4_asym::f16_up.
__device__ __forceinline__ unsigned short relayout_f16_up(float t) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(t));
    if (h >= 0x7c00u) return 0x7bffu;
    if (relayout_f16_to_f32(h) < t) h = h == 0x7bffu ? h : (unsigned short)(h + 1);
    return h;
}

// Asymmetric INT4 g32 CPU records (cpu-rb16-int4a-g32-v1: header of 64 bytes a group, the 16 rows'
// f16 scales d then their 16 f16 minimums m; codes 0..15 in INT4's chunk order) to the GPU tile
// layout at INT8 g32, the GPU's form of them (krasis_quant::int4_asym::to_int8_g32, bit for bit):
// per (row, group) w = fma(q, d, m) in f32, s = the smallest f16 >= amax / 127, codes
// rint(w / s) clamped to +-127 and stored + 128. One thread per (GPU row, group), indexed as the
// GPU scales [panel][group][g][t]; it writes its scale and the 8 whole words holding its group's
// 32 codes (a word's 4 bytes are one row's k 2q, 2q + 1, 2q + 8, 2q + 9 of one k16 step). Rows
// and groups past the matrix get code 128 (q = 0) and scale 0, as the host packer writes them.
extern "C" __global__ void relayout_int4a_int8(const unsigned char* __restrict__ src, long long src_stride,
                                               unsigned char* __restrict__ dst_codes,
                                               unsigned char* __restrict__ dst_scales, long long dst_stride,
                                               CpuPart p, int chunks, int groups, int count) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const unsigned char* s = src + (long long)blockIdx.y * src_stride;
    const int t = i & 7, g = (i >> 3) & 7, rest = i >> 6;
    const int grp = rest % groups, panel = rest / groups;
    const int r = panel * 64 + 8 * t + g;
    int j = 0;
    const int rb = cpu_block_of(p, r, j);
    float w[32];
    float amax = 0.0f;
    const bool present = rb >= 0 && grp < p.k / 32;
    if (present) {
        const unsigned char* blk = s + (long long)rb * p.block_bytes;
        const unsigned char* h = blk + grp * 64 + 2 * j;
        const float d = relayout_f16_to_f32((unsigned short)(h[0] | (h[1] << 8)));
        const float m = relayout_f16_to_f32((unsigned short)(h[32] | (h[33] << 8)));
        const unsigned char* c = blk + p.header_bytes + (long long)grp * p.group_weight_bytes;
#pragma unroll
        for (int kk = 0; kk < 32; ++kk) {
            w[kk] = fmaf((float)cpu_nibble(c, j, kk), d, m);
            amax = fmaxf(amax, fabsf(w[kk]));
        }
    }
    unsigned short sh = 0;
    float sf = 0.0f;
    if (present && amax > 0.0f) {
        sh = relayout_f16_up(__fdiv_rn(amax, 127.0f));
        sf = relayout_f16_to_f32(sh);
    }
    unsigned char* dc = dst_codes + (long long)blockIdx.y * dst_stride;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int k0 = grp * 32 + 16 * half;  // this k16 step's first k
        const int chunk = k0 >> 6, ks = (k0 & 63) >> 4;
        const long long blk_at = ((long long)panel * chunks + chunk) * 4096;
#pragma unroll
        for (int qq = 0; qq < 4; ++qq) {
            u32 word = 0;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int kk = 16 * half + 8 * (b >> 1) + 2 * qq + (b & 1);  // k within the group
                u32 code = 128u;
                if (sf > 0.0f) {
                    const float v = fminf(fmaxf(rintf(__fdiv_rn(w[kk], sf)), -127.0f), 127.0f);
                    code = (u32)((int)v + 128);
                }
                word |= code << (8 * b);
            }
            const int lane = 4 * g + qq;
            *(u32*)(dc + blk_at + 4LL * ((ks * 8 + t) * 32 + lane)) = word;
        }
    }
    *(unsigned short*)(dst_scales + (long long)blockIdx.y * dst_stride + 2LL * i) = sh;
}
