// Token sampling on the GPU, returning the token krasis-model's CPU `Sampler` returns for the
// same logits and the same uniform draw u. Both kernels run as ONE block over one row of logits
// (decode samples one row per step; a single block keeps every reduction in a fixed order).
//
// sample_argmax: the CPU's `argmax`: first index of the largest value; NaNs are skipped, except
//   that a NaN at index 0 wins (the CPU compares `v > logits[best]`, false against a NaN best).
//
// sample_topk_topp: the CPU sorts s_i = l_i / T by (value desc, index asc) ("sigma order"), keeps
//   the first K (top_k), takes p_j = exp((double)(s_j - max)), keeps the shortest sigma prefix
//   whose normalised cumulative sum reaches top_p, and returns the first kept j whose normalised
//   cumulative sum exceeds u (the last kept one if none does). Here no sort happens:
//   * every element gets a 32-bit order key (larger s -> larger key; -0 folded into +0, NaN the
//     lowest) and a fixed-point mass q_i = round(p_i * 2^S), S = 63 - ceil(log2 vocab) chosen on
//     the host so that the sum of all masses fits in 64 bits. Integer sums are exact and
//     order-free, so every total below is deterministic.
//   * "the first sigma position where a running count or mass reaches a target" is a radix
//     select: four passes of 8-bit digits from the top of the key, each a 256-bin histogram of
//     (count, mass) over the elements matching the digits chosen so far, scanned from the high
//     bins down. That gives the value of the element; equal values share one mass q_v, so the
//     position inside the run of equal values (ordered by index) is plain integer arithmetic,
//     and the index itself is found at the end by one ordered scan over the keys.
//   * top-k: count select at rank K-1 -> Z = mass of the first K. top-p: mass select for the
//     first prefix >= ceil(top_p * Z) -> Zp. sample: mass select for the first prefix >
//     floor(u * Zp), else the last kept element.
// Where the GPU may differ from the CPU: the CPU's cumulative sums are f64 sums of normalised
// probabilities; here they are exact sums of masses rounded to 2^-S of the largest one. A
// decision (u against a cumulative boundary, or a cumulative sum against top_p) can differ only
// when it is closer than about vocab * 2^-S (<= 2.3e-9 for a 160K vocabulary, typically far
// less) to the boundary. Rows whose largest s is +-inf or NaN have no finite masses: both sides
// then return the last kept candidate. NaN logits rank lowest here; the CPU's order with NaN is
// unspecified.
#include "krasis_common.cuh"

#define SAMPLE_RADIX_BINS 256

__device__ __forceinline__ float sm_neg_inf() { return __uint_as_float(0xff800000u); }

// Order key: larger float -> larger key; NaN -> 0 (below -inf, whose key is 0x007fffff).
__device__ __forceinline__ u32 sm_key(float s) {
    if (s != s) return 0u;
    if (s == 0.0f) s = 0.0f;  // -0 == +0 on the CPU: same key, so ties go by index
    const u32 u = __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float sm_scaled(const float* logits, int i, float temperature) {
    return logits[i] / temperature;
}

// ---------------------------------------------------------------- argmax

extern "C" __global__ void sample_argmax(const float* __restrict__ logits, int vocab, int* __restrict__ out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    float bv = 0.0f;
    int bi = -1;  // -1: nothing seen (or only NaNs)
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = logits[i];
        if (v != v) continue;
        if (bi < 0 || v > bv) {  // increasing i per thread: equal values keep the earlier index
            bv = v;
            bi = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
            bv = ov;
            bi = oi;
        }
    }
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < nwarps; w++) {
            const float ov = sv[w];
            const int oi = si[w];
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
                bv = ov;
                bi = oi;
            }
        }
        const float l0 = logits[0];
        out[0] = (l0 != l0 || bi < 0) ? 0 : bi;
    }
}

// ---------------------------------------------------------------- radix select

struct SmSel {
    u32 key;     // the selected element's order key
    u64 before;  // elements before its run of equal keys, in sigma order
    u64 mbefore; // their mass
    u64 run;     // elements with this key
    u64 q;       // mass of each of them
    u64 t;       // position of the selected element inside the run
};

struct SmShared {
    u32 cnt[SAMPLE_RADIX_BINS];
    u64 mass[SAMPLE_RADIX_BINS];
    u32 prefix;
    u64 before, mbefore, bin_cnt, bin_mass;
    SmSel sel;
    u64 red[32];
    float redf[32];
    int found;
    u64 scan_base;
    u32 wc[32];
};

// Block-wide sum of u64 (exact, so order-free). Ends with a barrier.
__device__ u64 sm_block_sum_u64(u64 v, SmShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) sh.red[warp] = v;
    __syncthreads();
    u64 t = 0;
    for (int w = 0; w < nwarps; w++) t += sh.red[w];
    __syncthreads();
    return t;
}

__device__ float sm_block_max(float v, SmShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) sh.redf[warp] = v;
    __syncthreads();
    float t = sm_neg_inf();
    for (int w = 0; w < nwarps; w++) t = fmaxf(t, sh.redf[w]);
    __syncthreads();
    return t;
}

#define SM_COUNT_GE 0  // first position where the running count >= target
#define SM_MASS_GE 1   // first position where the running mass >= target
#define SM_MASS_GT 2   // first position where the running mass > target

// The first sigma position whose running count/mass (including itself) reaches `target`.
// All threads call it; the result is in sh.sel (valid for all threads on return). If no position
// reaches the target (callers avoid this), the last element is chosen.
__device__ void sm_select(const u32* __restrict__ keys, const u64* __restrict__ mass, int n, int mode, u64 target,
                          SmShared& sh) {
    if (threadIdx.x == 0) {
        sh.prefix = 0;
        sh.before = 0;
        sh.mbefore = 0;
    }
    for (int pass = 0; pass < 4; pass++) {
        const int shift = 24 - 8 * pass;
        for (int b = threadIdx.x; b < SAMPLE_RADIX_BINS; b += blockDim.x) {
            sh.cnt[b] = 0;
            sh.mass[b] = 0;
        }
        __syncthreads();
        const u32 hi_mask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
        const u32 want = sh.prefix & hi_mask;
        // Runs of one bin are summed in registers first: values cluster, so the first pass
        // would otherwise put most of the vocabulary on one or two shared-memory addresses.
        int cur = -1;
        u32 cc = 0;
        u64 cm = 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const u32 k = keys[i];
            if ((k & hi_mask) != want) continue;
            const int b = (int)((k >> shift) & 0xffu);
            if (b != cur) {
                if (cur >= 0) {
                    atomicAdd(&sh.cnt[cur], cc);
                    atomicAdd((unsigned long long*)&sh.mass[cur], (unsigned long long)cm);
                }
                cur = b;
                cc = 0;
                cm = 0;
            }
            cc += 1;
            cm += mass[i];
        }
        if (cur >= 0) {
            atomicAdd(&sh.cnt[cur], cc);
            atomicAdd((unsigned long long*)&sh.mass[cur], (unsigned long long)cm);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 before = sh.before, mbefore = sh.mbefore;
            int chosen = -1, last = -1;
            u64 last_before = before, last_mbefore = mbefore;
            for (int b = SAMPLE_RADIX_BINS - 1; b >= 0; b--) {
                const u64 c = sh.cnt[b];
                if (c == 0) continue;
                const u64 m = sh.mass[b];
                const bool hit = mode == SM_COUNT_GE ? before + c >= target
                                 : mode == SM_MASS_GE ? mbefore + m >= target
                                                      : mbefore + m > target;
                if (hit) {
                    chosen = b;
                    break;
                }
                last = b;
                last_before = before;
                last_mbefore = mbefore;
                before += c;
                mbefore += m;
            }
            if (chosen < 0) {  // not reached: fall back to the last non-empty bin
                chosen = last;
                before = last_before;
                mbefore = last_mbefore;
            }
            sh.prefix |= ((u32)chosen) << shift;
            sh.before = before;
            sh.mbefore = mbefore;
            sh.bin_cnt = sh.cnt[chosen];
            sh.bin_mass = sh.mass[chosen];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        SmSel s;
        s.key = sh.prefix;
        s.before = sh.before;
        s.mbefore = sh.mbefore;
        s.run = sh.bin_cnt;
        s.q = sh.bin_cnt ? sh.bin_mass / sh.bin_cnt : 0;  // exact: equal keys have equal masses
        u64 t = 0;
        if (mode == SM_COUNT_GE) {
            t = target > s.before ? target - s.before - 1 : 0;
        } else if (s.q > 0 && target > s.mbefore) {
            const u64 need = target - s.mbefore;
            t = mode == SM_MASS_GE ? (need + s.q - 1) / s.q - 1 : need / s.q;
        }
        if (s.run > 0 && t > s.run - 1) t = s.run - 1;
        s.t = t;
        sh.sel = s;
    }
    __syncthreads();
}

// Index of the t-th (0-based) element, in index order, whose key is `key`. All threads call it.
__device__ int sm_index_of(const u32* __restrict__ keys, int n, u32 key, u64 t, SmShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (threadIdx.x == 0) {
        sh.found = -1;
        sh.scan_base = 0;
    }
    __syncthreads();
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const bool hit = i < n && keys[i] == key;
        const u32 ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) sh.wc[warp] = __popc(ballot);
        __syncthreads();
        u64 off = sh.scan_base, total = 0;
        for (int w = 0; w < nwarps; w++) {
            if (w < warp) off += sh.wc[w];
            total += sh.wc[w];
        }
        off += __popc(ballot & ((1u << lane) - 1u));
        if (hit && off == t) sh.found = i;
        __syncthreads();
        if (threadIdx.x == 0) sh.scan_base += total;
        __syncthreads();
        if (sh.found >= 0) break;
    }
    return sh.found;
}

// u in [0, 1). top_k: 0 < top_k < vocab, else 0 (off). top_p >= 1: off. scale_bits: S above.
// keys [vocab] u32 and mass [vocab] u64 are scratch.
extern "C" __global__ void sample_topk_topp(const float* __restrict__ logits, int vocab, float temperature, int top_k,
                                            float top_p, double u, int scale_bits, u32* __restrict__ keys,
                                            u64* __restrict__ mass, int* __restrict__ out) {
    __shared__ SmShared sh;
    const int n = vocab;

    float mx = sm_neg_inf();
    for (int i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, sm_scaled(logits, i, temperature));
    const float m = sm_block_max(mx, sh);
    const double scale = ldexp(1.0, scale_bits);
    u64 part = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float s = sm_scaled(logits, i, temperature);
        double p = exp((double)(s - m));
        if (!(p >= 0.0)) p = 0.0;  // NaN: inf - inf, or NaN logits
        if (p > 1.0) p = 1.0;
        const u64 q = (u64)__double2ull_rn(p * scale);
        keys[i] = sm_key(s);
        mass[i] = q;
        part += q;
    }
    const u64 total = sm_block_sum_u64(part, sh);  // ends with a barrier: keys/mass visible

    // Candidates: the first K in sigma order; z = their mass; `last` = the last one kept so far.
    u64 z = total;
    bool have_last = false;
    SmSel last;
    if (top_k > 0 && top_k < n) {
        sm_select(keys, mass, n, SM_COUNT_GE, (u64)top_k, sh);
        last = sh.sel;
        have_last = true;
        z = last.mbefore + (last.t + 1) * last.q;
    }
    u64 zp = z;
    if (top_p < 1.0f && z > 0) {
        const double tp = (double)top_p * (double)z;
        u64 target = 0;
        if (tp > 0.0) target = tp >= (double)z ? z : (u64)ceil(tp);
        if (target > z) target = z;
        sm_select(keys, mass, n, SM_MASS_GE, target, sh);
        last = sh.sel;
        have_last = true;
        zp = last.mbefore + (last.t + 1) * last.q;
    }
    const u64 r = (u64)(u * (double)zp);
    SmSel pick;
    if (zp > 0 && r < zp) {
        sm_select(keys, mass, n, SM_MASS_GT, r, sh);
        pick = sh.sel;
    } else {
        if (!have_last) {
            sm_select(keys, mass, n, SM_COUNT_GE, (u64)n, sh);
            last = sh.sel;
        }
        pick = last;
    }
    const int idx = sm_index_of(keys, n, pick.key, pick.t, sh);
    if (threadIdx.x == 0) out[0] = idx < 0 ? 0 : idx;
}
