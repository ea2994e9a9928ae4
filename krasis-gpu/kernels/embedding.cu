// Embedding gather: out[t, :] = table[ids[t], :] for a BF16 table [vocab, hidden].
// An id outside [0, vocab) yields a row of NaN (loud, never a silent wrong row); the host checks ids.
// One block per token; 16-byte vector copies when the row and pointers allow it.
#include "krasis_common.cuh"

extern "C" __global__ void embedding_gather_bf16_f32(const bf16_t* __restrict__ table, const int* __restrict__ ids,
                                                     float* __restrict__ out, int n_tokens, int hidden, int vocab) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const int id = ids[t];
    float* o = out + (long long)t * hidden;
    if (id < 0 || id >= vocab) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = krasis_nan();
        return;
    }
    const bf16_t* r = table + (long long)id * hidden;
    if ((hidden & 7) == 0 && ((((u64)table) | ((u64)out)) & 15) == 0) {
        const uint4* r8 = (const uint4*)r;
        float4* o4 = (float4*)o;
        for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) {
            uint4 v = r8[i];
            o4[2 * i] = make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                                    __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
            o4[2 * i + 1] = make_float4(__uint_as_float(v.z << 16), __uint_as_float(v.z & 0xffff0000u),
                                        __uint_as_float(v.w << 16), __uint_as_float(v.w & 0xffff0000u));
        }
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = bf16_to_f32(r[i]);
    }
}

extern "C" __global__ void embedding_gather_bf16_bf16(const bf16_t* __restrict__ table, const int* __restrict__ ids,
                                                      bf16_t* __restrict__ out, int n_tokens, int hidden, int vocab) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const int id = ids[t];
    bf16_t* o = out + (long long)t * hidden;
    if (id < 0 || id >= vocab) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = (bf16_t)0x7fc0u;
        return;
    }
    const bf16_t* r = table + (long long)id * hidden;
    if ((hidden & 7) == 0 && ((((u64)table) | ((u64)out)) & 15) == 0) {
        const uint4* r8 = (const uint4*)r;
        uint4* o8 = (uint4*)o;
        for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) o8[i] = r8[i];
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = r[i];
    }
}
