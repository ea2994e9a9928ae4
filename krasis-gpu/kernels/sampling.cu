// Token sampling on the GPU, returning the token krasis-model's CPU `Sampler` returns for the
// same logits and the same uniform draw u. Both kernels are COOPERATIVE launches of G blocks
// (G <= the SM count, so all blocks are resident): block b owns the contiguous slice
// [b * chunk, (b + 1) * chunk) of the row, and the blocks meet at grid barriers (sm_grid_sync).
// Every cross-block total is an integer sum (atomicAdd of u64) or a max, so results do not depend
// on block timing. After each barrier every block redundantly makes the same decision from the
// same global data, so no second barrier is needed to broadcast it.
//
// sample_argmax: the CPU's `argmax`: first index of the largest value; NaNs are skipped, except
//   that a NaN at index 0 wins (the CPU compares `v > logits[best]`, false against a NaN best).
//   Each block packs its best as (order key << 32 | ~index) and atomicMax'es it into the state;
//   one barrier; block 0 reads and resets it.
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
//     bins down. The first digit's histogram does not depend on the target, so it is built once
//     (with the masses) and shared by every select. Equal values share one mass q_v, so the
//     position inside the run of equal values (ordered by index) is integer arithmetic, and the
//     index itself is found at the end by per-block match counts and one ordered scan.
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

#define SM_THREADS 256  // threads per block; sm_choose maps one thread to each of the 256 bins
#define SM_BINS 256
#define SM_MAX_BLOCKS 1024
// Layout of the u64 state buffer (zeroed once at allocation; each kernel leaves its barrier and
// argmax words back at zero-equivalent values and re-zeroes its histograms itself).
#define SM_ST_BAR 0       // barrier arrivals
#define SM_ST_GEN 1       // barrier generation
#define SM_ST_ARGMAX 2    // packed argmax candidate
#define SM_ST_H0 8        // digit-0 histogram: 256 counts, 256 masses
#define SM_ST_HIST (SM_ST_H0 + 2 * SM_BINS)       // 3 rotating histograms of 512 words
#define SM_ST_PMAX (SM_ST_HIST + 6 * SM_BINS)     // per-block max (float bits)
#define SM_ST_BLKCNT (SM_ST_PMAX + SM_MAX_BLOCKS) // per-block match counts

__device__ __forceinline__ float sm_neg_inf() { return __uint_as_float(0xff800000u); }

// Order key: larger float -> larger key; NaN -> 0 (below -inf, whose key is 0x007fffff).
__device__ __forceinline__ u32 sm_key(float s) {
    if (s != s) return 0u;
    if (s == 0.0f) s = 0.0f;  // -0 == +0 on the CPU: same key, so ties go by index
    const u32 u = __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ u64 sm_ldcg(const u64* p) { return __ldcg((const unsigned long long*)p); }

// Grid-wide barrier for a cooperative launch (all blocks resident). Makes every global write
// before it visible to every block after it; cross-block data is then read with sm_ldcg (L2).
__device__ void sm_grid_sync(u64* st) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile u64* v = st;
        const u64 gen = v[SM_ST_GEN];
        __threadfence();
        const u64 arrived = atomicAdd((unsigned long long*)&st[SM_ST_BAR], 1ull);
        if (arrived == (u64)gridDim.x - 1) {
            atomicExch((unsigned long long*)&st[SM_ST_BAR], 0ull);
            __threadfence();
            atomicAdd((unsigned long long*)&st[SM_ST_GEN], 1ull);
        } else {
            while (v[SM_ST_GEN] == gen) __nanosleep(20);
        }
        __threadfence();
    }
    __syncthreads();
}

// Block (contiguous slice) of the row owned by this block.
__device__ __forceinline__ void sm_slice(int n, int& lo, int& hi) {
    const int chunk = (n + (int)gridDim.x - 1) / (int)gridDim.x;
    lo = min(n, (int)blockIdx.x * chunk);
    hi = min(n, lo + chunk);
}

// ---------------------------------------------------------------- argmax

extern "C" __global__ void __launch_bounds__(SM_THREADS)
    sample_argmax(const float* __restrict__ logits, int vocab, u64* __restrict__ st, int* __restrict__ out) {
    __shared__ u64 red[SM_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int lo, hi;
    sm_slice(vocab, lo, hi);
    u64 best = 0;  // 0: nothing seen (every real candidate has key >= 0x007fffff)
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float v = logits[i];
        if (v != v) continue;
        const u64 p = ((u64)sm_key(v) << 32) | (u64)(0xffffffffu - (u32)i);  // larger: first index
        best = p > best ? p : best;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 x = __shfl_xor_sync(0xffffffffu, best, o);
        best = x > best ? x : best;
    }
    if (lane == 0) red[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) best = red[w] > best ? red[w] : best;
        if (best) atomicMax((unsigned long long*)&st[SM_ST_ARGMAX], (unsigned long long)best);
    }
    sm_grid_sync(st);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const u64 p = atomicExch((unsigned long long*)&st[SM_ST_ARGMAX], 0ull);
        const float l0 = logits[0];
        out[0] = (l0 != l0 || p == 0) ? 0 : (int)(0xffffffffu - (u32)p);
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
    u64 lc[SM_BINS], lm[SM_BINS];    // this block's histogram
    u64 h0c[SM_BINS], h0m[SM_BINS];  // the row's digit-0 histogram (pass 0 of every select)
    u64 wc[SM_THREADS / 32], wm[SM_THREADS / 32];
    int chosen, fallback;
    u32 prefix;
    u64 before, mbefore, bin_cnt, bin_mass;
    SmSel sel;
    u64 red[32];
    float redf[32];
    int found;
    u64 scan_base;
    u32 wcount[32];
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

// Adds (1, m) to bin `bin` of the block histogram for each lane with `has`; called by all 32
// lanes of a warp. Lanes with the same bin are summed in registers first (one shared atomic per
// distinct bin per warp): values cluster, so most lanes of a warp share a bin.
__device__ __forceinline__ void sm_hist_add(u64* hc, u64* hm, bool has, int bin, u64 m) {
    const int lane = threadIdx.x & 31;
    bool todo = has;
    for (;;) {
        const u32 pending = __ballot_sync(0xffffffffu, todo);
        if (!pending) break;
        const int leader = __ffs(pending) - 1;
        const int b = __shfl_sync(0xffffffffu, bin, leader);
        const bool mine = todo && bin == b;
        const u32 grp = __ballot_sync(0xffffffffu, mine);
        u64 v = mine ? m : 0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == leader) {
            atomicAdd((unsigned long long*)&hc[b], (unsigned long long)__popc(grp));
            atomicAdd((unsigned long long*)&hm[b], (unsigned long long)v);
        }
        if (mine) todo = false;
    }
}

#define SM_COUNT_GE 0  // first position where the running count >= target
#define SM_MASS_GE 1   // first position where the running mass >= target
#define SM_MASS_GT 2   // first position where the running mass > target

// One radix step: from the 256-bin histogram (hc, hm) of the elements matching sh.prefix, picks
// the first non-empty bin (from the top) where the running count/mass reaches the target (the
// last non-empty bin if none does) and extends sh.prefix/before/mbefore. All threads call it
// (blockDim == SM_THREADS == SM_BINS); `global`: the histogram is cross-block data.
__device__ void sm_choose(const u64* hc, const u64* hm, bool global, int shift, int mode, u64 target, SmShared& sh) {
    const int j = threadIdx.x, lane = j & 31, warp = j >> 5;
    const int b = SM_BINS - 1 - j;
    const u64 c = global ? sm_ldcg(hc + b) : hc[b];
    const u64 m = global ? sm_ldcg(hm + b) : hm[b];
    u64 ic = c, im = m;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 oc = __shfl_up_sync(0xffffffffu, ic, o);
        const u64 om = __shfl_up_sync(0xffffffffu, im, o);
        if (lane >= o) {
            ic += oc;
            im += om;
        }
    }
    if (lane == 31) {
        sh.wc[warp] = ic;
        sh.wm[warp] = im;
    }
    if (j == 0) {
        sh.chosen = SM_BINS;
        sh.fallback = -1;
    }
    __syncthreads();
    for (int w = 0; w < warp; w++) {
        ic += sh.wc[w];
        im += sh.wm[w];
    }
    const u64 before = sh.before + ic - c, mbefore = sh.mbefore + im - m;
    const bool hit = c > 0 && (mode == SM_COUNT_GE  ? before + c >= target
                               : mode == SM_MASS_GE ? mbefore + m >= target
                                                    : mbefore + m > target);
    if (hit) atomicMin(&sh.chosen, j);
    if (c > 0) atomicMax(&sh.fallback, j);
    __syncthreads();
    const int pick = sh.chosen < SM_BINS ? sh.chosen : sh.fallback;
    if (j == pick) {
        sh.prefix |= ((u32)b) << shift;
        sh.before = before;
        sh.mbefore = mbefore;
        sh.bin_cnt = c;
        sh.bin_mass = m;
    }
    __syncthreads();
}

// The first sigma position whose running count/mass (including itself) reaches `target`, in
// sh.sel on return (all threads call it). If no position reaches the target (callers avoid
// this), the last element is chosen. `pass` counts the rotating global histograms used so far.
__device__ void sm_select(const u32* __restrict__ keys, const u64* __restrict__ mass, int lo, int hi, int mode,
                          u64 target, u64* st, int& pass, SmShared& sh) {
    if (threadIdx.x == 0) {
        sh.prefix = 0;
        sh.before = 0;
        sh.mbefore = 0;
    }
    __syncthreads();
    sm_choose(sh.h0c, sh.h0m, false, 24, mode, target, sh);
    for (int d = 1; d < 4; d++) {
        const int shift = 24 - 8 * d;
        u64* gc = st + SM_ST_HIST + (pass % 3) * 2 * SM_BINS;
        u64* gm = gc + SM_BINS;
        sh.lc[threadIdx.x] = 0;
        sh.lm[threadIdx.x] = 0;
        __syncthreads();
        const u32 hi_mask = 0xffffffffu << (shift + 8);
        const u32 want = sh.prefix & hi_mask;
        for (int base = lo; base < hi; base += blockDim.x) {
            const int i = base + threadIdx.x;
            const u32 k = i < hi ? keys[i] : 0u;
            const bool has = i < hi && (k & hi_mask) == want;
            sm_hist_add(sh.lc, sh.lm, has, (int)((k >> shift) & 0xffu), has ? mass[i] : 0ull);
        }
        __syncthreads();
        if (sh.lc[threadIdx.x] > 0) {
            atomicAdd((unsigned long long*)&gc[threadIdx.x], (unsigned long long)sh.lc[threadIdx.x]);
            atomicAdd((unsigned long long*)&gm[threadIdx.x], (unsigned long long)sh.lm[threadIdx.x]);
        }
        sm_grid_sync(st);
        if (blockIdx.x == 0) {  // nobody reads the histogram of the previous pass any more
            u64* z = st + SM_ST_HIST + ((pass + 2) % 3) * 2 * SM_BINS;
            for (int e = threadIdx.x; e < 2 * SM_BINS; e += blockDim.x) z[e] = 0;
        }
        sm_choose(gc, gm, true, shift, mode, target, sh);
        pass++;
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

// Index of the t-th (0-based) element, in index order, of [lo, hi) whose key is `key` (-1 if
// none). All threads of the block call it.
__device__ int sm_index_in(const u32* __restrict__ keys, int lo, int hi, u32 key, u64 t, SmShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (threadIdx.x == 0) {
        sh.found = -1;
        sh.scan_base = 0;
    }
    __syncthreads();
    for (int base = lo; base < hi; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const bool hit = i < hi && keys[i] == key;
        const u32 ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) sh.wcount[warp] = __popc(ballot);
        __syncthreads();
        u64 off = sh.scan_base, total = 0;
        for (int w = 0; w < nwarps; w++) {
            if (w < warp) off += sh.wcount[w];
            total += sh.wcount[w];
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
// keys [vocab] u32 and mass [vocab] u64 are scratch; st is the state buffer (layout above).
extern "C" __global__ void __launch_bounds__(SM_THREADS)
    sample_topk_topp(const float* __restrict__ logits, int vocab, float temperature, int top_k, float top_p, double u,
                     int scale_bits, u32* __restrict__ keys, u64* __restrict__ mass, u64* __restrict__ st,
                     int* __restrict__ out) {
    __shared__ SmShared sh;
    const int n = vocab;
    int lo, hi;
    sm_slice(n, lo, hi);

    // Zero the digit-0 histogram and the first two rotating ones (the third is zeroed in pass 0).
    if (blockIdx.x == 0)
        for (int e = threadIdx.x; e < 6 * SM_BINS; e += blockDim.x) st[SM_ST_H0 + e] = 0;
    float mx = sm_neg_inf();
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) mx = fmaxf(mx, logits[i] / temperature);
    mx = sm_block_max(mx, sh);
    if (threadIdx.x == 0) st[SM_ST_PMAX + blockIdx.x] = __float_as_uint(mx);
    sm_grid_sync(st);
    mx = sm_neg_inf();
    for (int g = threadIdx.x; g < (int)gridDim.x; g += blockDim.x)
        mx = fmaxf(mx, __uint_as_float((u32)sm_ldcg(st + SM_ST_PMAX + g)));
    const float m = sm_block_max(mx, sh);

    // Keys, masses and the digit-0 histogram.
    const double scale = ldexp(1.0, scale_bits);
    sh.lc[threadIdx.x] = 0;
    sh.lm[threadIdx.x] = 0;
    __syncthreads();
    for (int base = lo; base < hi; base += blockDim.x) {
        const int i = base + threadIdx.x;
        u32 k = 0;
        u64 q = 0;
        if (i < hi) {
            const float s = logits[i] / temperature;
            double p = exp((double)(s - m));
            if (!(p >= 0.0)) p = 0.0;  // NaN: inf - inf, or NaN logits
            if (p > 1.0) p = 1.0;
            q = (u64)__double2ull_rn(p * scale);
            k = sm_key(s);
            keys[i] = k;
            mass[i] = q;
        }
        sm_hist_add(sh.lc, sh.lm, i < hi, (int)(k >> 24), q);
    }
    __syncthreads();
    if (sh.lc[threadIdx.x] > 0) {
        atomicAdd((unsigned long long*)&st[SM_ST_H0 + threadIdx.x], (unsigned long long)sh.lc[threadIdx.x]);
        atomicAdd((unsigned long long*)&st[SM_ST_H0 + SM_BINS + threadIdx.x], (unsigned long long)sh.lm[threadIdx.x]);
    }
    sm_grid_sync(st);
    sh.h0c[threadIdx.x] = sm_ldcg(st + SM_ST_H0 + threadIdx.x);
    sh.h0m[threadIdx.x] = sm_ldcg(st + SM_ST_H0 + SM_BINS + threadIdx.x);
    const u64 total = sm_block_sum_u64(sh.h0m[threadIdx.x], sh);  // ends with a barrier
    int pass = 0;

    // Candidates: the first K in sigma order; z = their mass; `last` = the last one kept so far.
    u64 z = total;
    bool have_last = false;
    SmSel last;
    if (top_k > 0 && top_k < n) {
        sm_select(keys, mass, lo, hi, SM_COUNT_GE, (u64)top_k, st, pass, sh);
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
        sm_select(keys, mass, lo, hi, SM_MASS_GE, target, st, pass, sh);
        last = sh.sel;
        have_last = true;
        zp = last.mbefore + (last.t + 1) * last.q;
    }
    const u64 r = (u64)(u * (double)zp);
    SmSel pick;
    if (zp > 0 && r < zp) {
        sm_select(keys, mass, lo, hi, SM_MASS_GT, r, st, pass, sh);
        pick = sh.sel;
    } else {
        if (!have_last) {
            sm_select(keys, mass, lo, hi, SM_COUNT_GE, (u64)n, st, pass, sh);
            last = sh.sel;
        }
        pick = last;
    }

    // The pick.t-th element with key pick.key in index order: per-block counts, then the one
    // block whose slice holds it scans it in order.
    u64 own = 0;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) own += keys[i] == pick.key;
    own = sm_block_sum_u64(own, sh);
    if (threadIdx.x == 0) {
        st[SM_ST_BLKCNT + blockIdx.x] = own;
        if (blockIdx.x == 0) out[0] = 0;  // overwritten below by the block that finds it
    }
    sm_grid_sync(st);
    u64 prior = 0;
    for (int g = threadIdx.x; g < (int)blockIdx.x; g += blockDim.x) prior += sm_ldcg(st + SM_ST_BLKCNT + g);
    prior = sm_block_sum_u64(prior, sh);
    if (pick.t >= prior && pick.t < prior + own) {
        const int idx = sm_index_in(keys, lo, hi, pick.key, pick.t - prior, sh);
        if (threadIdx.x == 0 && idx >= 0) out[0] = idx;
    }
}
