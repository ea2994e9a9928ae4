//! Causal softmax attention of new queries over a key/value cache (reference path, f32).
//!
//! One kernel serves both architectures: GQA passes per-head K and V; absorbed MLA passes a
//! single "head" whose key is `[latent ‖ rope key]` and whose value is the latent itself (both
//! views of the same cache rows, hence the separate strides).

use crate::expf::softmax_step;
use crate::group_attention::{group_scores, group_values, Rows};
use crate::isa;
use crate::linear::{axpy, dot};

/// Fewest cache positions per task of one-token attention over shared keys
/// ([`decode_shared_kv`]): short contexts still spread over several workers (64 positions: 8
/// tasks), while a task's fixed work (its partials, their share of the combine) stays small
/// against 8 rows × `group` heads of dot products and value updates.
const SHARED_KV_MIN_ROWS: usize = 8;
/// Most tasks per kv head of one-token attention over shared keys: two per worker of a 16-core
/// pool, so the combine reads at most 32 partial outputs per head.
const SHARED_KV_MAX_TASKS: usize = 32;
/// Visible positions from which one-token attention over shared keys runs whole groups in up to
/// [`SHARED_KV_MAX_TASKS`] chunks; below, sub-groups of [`SHARED_KV_SHORT_HEADS`] heads in
/// rounds of one task per worker (between the measured 576 and 4096 of [`shared_kv_plan`]).
const SHARED_KV_LONG: usize = 2048;
/// Heads per task below [`SHARED_KV_LONG`] positions.
const SHARED_KV_SHORT_HEADS: usize = 8;
/// Below [`SHARED_KV_LONG`], positions per task from which another round of one task per worker
/// is added: measured best at 72 for both V2-Lite MLA (576 positions: 8 chunks × 2 sub-groups)
/// and Qwen3 GQA (576 positions over 4 kv heads: 8 chunks, 38 µs, against 49 µs with 4).
const SHARED_KV_SHORT_ROWS: usize = 72;

/// `KRASIS_ATTN_SHARED_KV=0` turns the position split of [`decode_shared_kv`] off (one task per
/// head, as for several query tokens): a diagnostic knob to measure the split against.
fn shared_kv_split() -> bool {
    krasis_core::knobs::knobs().attn_shared_kv
}

/// Keys and values of `len` cached positions.
#[derive(Clone, Copy, Debug)]
pub struct KvCacheView<'a> {
    pub k: &'a [f32],
    /// Floats between consecutive positions in `k`.
    pub k_stride: usize,
    pub v: &'a [f32],
    pub v_stride: usize,
    pub kv_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub len: usize,
}

/// Options of [`causal_attention_with`], the attention variants of the one kernel (gpt-oss's).
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnOptions<'a> {
    /// A sliding window of `w` positions: the query at position `p` sees keys `j` with
    /// `p − w < j ≤ p` (`None`: every key up to its own position).
    pub window: Option<usize>,
    /// One learned logit per query head (`[heads]`), an extra softmax column that takes its share
    /// of the probability mass and is then dropped (gpt-oss's attention sinks). It is not
    /// multiplied by the softmax scale.
    pub sinks: Option<&'a [f32]>,
}

impl AttnOptions<'_> {
    /// The first cache position the query at absolute position `p` sees.
    pub fn first_visible(&self, p: usize) -> usize {
        self.window.map_or(0, |w| (p + 1).saturating_sub(w))
    }

    /// Head `h`'s sink logit (`-inf`, no extra column, without sinks).
    fn sink(&self, h: usize) -> f32 {
        self.sinks.map_or(f32::NEG_INFINITY, |s| s[h])
    }
}

/// `q`: `[tq, heads, k_dim]`; query `i` sits at absolute position `q_start + i` and sees cache
/// positions `0..=q_start + i`. Writes `out`: `[tq, heads, v_dim]`.
pub fn causal_attention(
    q: &[f32],
    tq: usize,
    heads: usize,
    q_start: usize,
    kv: &KvCacheView<'_>,
    scale: f32,
    out: &mut [f32],
) {
    causal_attention_with(q, tq, heads, q_start, kv, scale, AttnOptions::default(), out)
}

/// [`causal_attention`] with a sliding window and attention sinks ([`AttnOptions`]); without
/// either, the same bits as [`causal_attention`].
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_with(
    q: &[f32],
    tq: usize,
    heads: usize,
    q_start: usize,
    kv: &KvCacheView<'_>,
    scale: f32,
    opts: AttnOptions<'_>,
    out: &mut [f32],
) {
    assert!(heads.is_multiple_of(kv.kv_heads), "heads {heads} not a multiple of kv_heads {}", kv.kv_heads);
    assert_eq!(q.len(), tq * heads * kv.k_dim);
    assert_eq!(out.len(), tq * heads * kv.v_dim);
    assert!(q_start + tq <= kv.len, "queries reach position {} but cache holds {}", q_start + tq, kv.len);
    if let Some(s) = opts.sinks {
        assert_eq!(s.len(), heads, "one sink logit per head");
    }
    assert!(opts.window != Some(0), "a sliding window of 0 positions");
    let group = heads / kv.kv_heads;
    if tq == 1 && group > 1 && shared_kv_split() {
        // The window as a view of the cache that starts at its first visible position.
        let first = opts.first_visible(q_start);
        let view = KvCacheView {
            k: &kv.k[first * kv.k_stride..],
            v: &kv.v[first * kv.v_stride..],
            len: kv.len - first,
            ..*kv
        };
        return decode_shared_kv(q, heads, q_start - first, &view, scale, opts.sinks, out);
    }
    let isa = isa::active();
    let (k_dim, v_dim) = (kv.k_dim, kv.v_dim);
    // One task per (query token, kv head) for the whole head group: each cached row is read once
    // for the group's heads while it is in L1 (one task per head read the visible cache once per
    // head: 16 times for MLA's shared latent). Each head's arithmetic, and its order, is what a
    // task per head did, so the results are the same bits.
    crate::par::for_each_chunk_mut(out, group * v_dim, &|idx, o| {
        SCORES.with_borrow_mut(|scores| {
            let (i, g) = (idx / kv.kv_heads, idx % kv.kv_heads);
            let first = opts.first_visible(q_start + i);
            let visible = q_start + i + 1 - first;
            let q0 = (i * heads + g * group) * k_dim;
            scores.clear();
            scores.resize(group * (visible + 1), 0.0);
            let (scores, denoms) = scores.split_at_mut(group * visible);
            for p in 0..visible {
                let k0 = (first + p) * kv.k_stride + g * k_dim;
                let krow = &kv.k[k0..k0 + k_dim];
                for h in 0..group {
                    scores[h * visible + p] = dot(isa, &q[q0 + h * k_dim..q0 + (h + 1) * k_dim], krow) * scale;
                }
            }
            for (h, (s, denom)) in scores.chunks_exact_mut(visible).zip(denoms.iter_mut()).enumerate() {
                let sink = opts.sink(g * group + h);
                let max = s.iter().fold(sink, |m, &v| m.max(v));
                *denom = 0.0;
                for v in s.iter_mut() {
                    *v = (*v - max).exp();
                    *denom += *v;
                }
                if sink != f32::NEG_INFINITY {
                    *denom += (sink - max).exp();
                }
            }
            o.fill(0.0);
            for p in 0..visible {
                let v0 = (first + p) * kv.v_stride + g * v_dim;
                let vrow = &kv.v[v0..v0 + v_dim];
                for (h, oh) in o.chunks_exact_mut(v_dim).enumerate() {
                    axpy(isa, scores[h * visible + p] / denoms[h], vrow, oh);
                }
            }
        })
    });
}

/// One query token whose heads share keys and values in groups (absorbed MLA: all 16 heads over one
/// latent row; GQA with several heads per kv head): tasks split the visible positions (and below
/// [`SHARED_KV_LONG`] positions the group into sub-groups of 8 heads), so each cached row is read
/// once per group or sub-group (one task per head read the whole cache once per head: 16 reads of
/// every row for MLA), and each task keeps flash-decoding partials per head (running max, sum,
/// unnormalised output) that a second pass combines. The split depends only on the visible
/// length and the pool's size ([`shared_kv_plan`]), so a sequence gets the same result alone or
/// batched.
/// `sinks`: as [`AttnOptions::sinks`].
fn decode_shared_kv(
    q: &[f32],
    heads: usize,
    q_start: usize,
    kv: &KvCacheView<'_>,
    scale: f32,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    let plan = shared_kv_plan(q_start + 1, heads / kv.kv_heads, kv.kv_heads, crate::par::threads());
    decode_shared_kv_sinks(isa::active(), q, heads, q_start, kv, scale, sinks, out, plan)
}

/// [`decode_shared_kv`] with its split given: `(rows per task, chunks, heads per task)` with
/// `rows · chunks ≥ visible` and the heads per task dividing the group.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_shared_kv_planned(
    isa: isa::Isa,
    q: &[f32],
    heads: usize,
    q_start: usize,
    kv: &KvCacheView<'_>,
    scale: f32,
    out: &mut [f32],
    plan: (usize, usize, usize),
) {
    decode_shared_kv_sinks(isa, q, heads, q_start, kv, scale, None, out, plan)
}

/// [`decode_shared_kv_planned`] with attention sinks ([`AttnOptions::sinks`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_shared_kv_sinks(
    isa: isa::Isa,
    q: &[f32],
    heads: usize,
    q_start: usize,
    kv: &KvCacheView<'_>,
    scale: f32,
    sinks: Option<&[f32]>,
    out: &mut [f32],
    (rows, chunks, hs): (usize, usize, usize),
) {
    let group = heads / kv.kv_heads;
    let (k_dim, v_dim) = (kv.k_dim, kv.v_dim);
    let visible = q_start + 1;
    assert!(hs > 0 && group.is_multiple_of(hs) && rows * chunks >= visible && (chunks - 1) * rows < visible);
    let subs = group / hs;
    // Per task (kv head g, sub-group u, chunk c): per head of the sub-group its max, sum and output.
    let part = shared_kv_part_len(hs, v_dim);
    // Reused across calls (every element is written before it is read): a fresh 0.25–1 MB
    // vector per layer and token was mapped, faulted in and unmapped each time.
    let mut partials = PARTIALS.with_borrow_mut(std::mem::take);
    partials.resize(kv.kv_heads * subs * chunks * part, 0.0);
    crate::par::for_each_chunk_mut(&mut partials, part, &|task, p| {
        let (gu, c) = (task / chunks, task % chunks);
        let (g, u) = (gu / subs, gu % subs);
        let h0 = g * group + u * hs;
        let positions = c * rows..((c + 1) * rows).min(visible);
        shared_kv_partial(isa, &q[h0 * k_dim..(h0 + hs) * k_dim], hs, kv, g, positions, scale, p);
    });
    crate::par::for_each_chunk_mut(out, v_dim, &|hh, o| {
        let gu = hh / hs;
        let sink = sinks.map_or(f32::NEG_INFINITY, |s| s[hh]);
        let of_chunk = |c: usize| &partials[(gu * chunks + c) * part..][..part];
        shared_kv_combine_sink(isa, &of_chunk, chunks, hh % hs, hs, sink, o);
    });
    PARTIALS.with_borrow_mut(|p| *p = partials);
}

/// Floats of one task's flash-decoding partials for `hs` heads of `v_dim` values: per head its
/// running max and sum, then per head its unnormalised output.
pub(crate) fn shared_kv_part_len(hs: usize, v_dim: usize) -> usize {
    hs * (v_dim + 2)
}

/// One task of the position split of one-token attention over shared keys: the `hs` heads of
/// `q` (`[hs, k_dim]`, the sub-group starting at some head of kv head `g`) over cache
/// `positions`, written into `p` ([`shared_kv_part_len`] floats) as flash-decoding partials.
#[allow(clippy::too_many_arguments)]
pub(crate) fn shared_kv_partial(
    isa: isa::Isa,
    q: &[f32],
    hs: usize,
    kv: &KvCacheView<'_>,
    g: usize,
    positions: std::ops::Range<usize>,
    scale: f32,
    p: &mut [f32],
) {
    let (k_dim, v_dim) = (kv.k_dim, kv.v_dim);
    let (p0, n) = (positions.start, positions.len());
    SCORES.with_borrow_mut(|scores| {
        scores.clear();
        scores.resize(hs * n, 0.0);
        let keys = Rows { data: kv.k, start: p0 * kv.k_stride + g * k_dim, stride: kv.k_stride, width: k_dim };
        group_scores(isa, q, hs, keys, n, scores);
        let (ml, o) = p[..shared_kv_part_len(hs, v_dim)].split_at_mut(2 * hs);
        for (h, s) in scores.chunks_exact_mut(n).enumerate() {
            let (max, sum) = softmax_step(isa, s, n, scale, f32::NEG_INFINITY);
            ml[2 * h] = max;
            ml[2 * h + 1] = sum;
        }
        let values = Rows { data: kv.v, start: p0 * kv.v_stride + g * v_dim, stride: kv.v_stride, width: v_dim };
        group_values(isa, scores, hs, n, values, o);
    })
}

/// Head `h` (of `hs` per task) of one sub-group: its `chunks` partials (`part(c)`, as
/// [`shared_kv_partial`] wrote them) combined into `o` (`v_dim` floats):
/// `o = Σ e^(m_c − M) o_c / Σ e^(m_c − M) l_c`.
pub(crate) fn shared_kv_combine<'a>(
    isa: isa::Isa,
    part: &dyn Fn(usize) -> &'a [f32],
    chunks: usize,
    h: usize,
    hs: usize,
    o: &mut [f32],
) {
    shared_kv_combine_sink(isa, part, chunks, h, hs, f32::NEG_INFINITY, o)
}

/// [`shared_kv_combine`] with the head's sink logit `sink` as one more softmax column that adds
/// to the denominator only (`-inf`: none, the same bits as without).
pub(crate) fn shared_kv_combine_sink<'a>(
    isa: isa::Isa,
    part: &dyn Fn(usize) -> &'a [f32],
    chunks: usize,
    h: usize,
    hs: usize,
    sink: f32,
    o: &mut [f32],
) {
    let v_dim = o.len();
    let m = (0..chunks).map(|c| part(c)[2 * h]).fold(sink, f32::max);
    o.fill(0.0);
    let mut denom = if sink == f32::NEG_INFINITY { 0f32 } else { (sink - m).exp() };
    for c in 0..chunks {
        let p = part(c);
        let w = (p[2 * h] - m).exp();
        denom += w * p[2 * h + 1];
        axpy(isa, w, &p[2 * hs + h * v_dim..][..v_dim], o);
    }
    let inv = 1.0 / denom;
    for v in o.iter_mut() {
        *v *= inv;
    }
}

/// How [`decode_shared_kv`] splits `visible` positions of `kv_heads` groups of `group` heads over
/// `workers`: `(rows per task, chunks per sub-group, heads per task)`.
///
/// Measured on the GPU box's 16 Xeon cores (`attention_decode` bench, V2-Lite MLA, µs):
/// at 576 positions, sub-groups of 8 heads with one task per worker 42, whole group 16 tasks 52,
/// whole group 32 tasks 63 (the previous split); at 4096 positions, whole group 32 tasks 219,
/// sub-groups of 8 with 16–64 tasks 258–266. A task's partial output (heads × v_dim floats) is
/// written by one core and read by another: short contexts pay more for those than for reading
/// each row once per sub-group, long ones the other way round. Below 2048 positions the chunks
/// come in rounds of one task per worker, as many rounds as keep a task near 72 positions
/// (`-attention-s8.log`, `-attention-rounds.log`, µs, noisy instances): Qwen3 GQA (4 kv heads) at
/// 576 positions 38 with two rounds against 49 with one; at 1536 positions, V2-Lite MLA 110 with
/// three rounds against 127 with one, Qwen3 GQA 89 with six against 120 with one.
pub(crate) fn shared_kv_plan(visible: usize, group: usize, kv_heads: usize, workers: usize) -> (usize, usize, usize) {
    let o = shared_kv_overrides();
    let short = visible < SHARED_KV_LONG;
    let want = o.heads.unwrap_or(if short { SHARED_KV_SHORT_HEADS } else { 0 });
    let hs = if want > 0 && want < group && group.is_multiple_of(want) { want } else { group };
    let short_chunks = || {
        // Whole rounds of one task per worker, enough that a task has at most ~SHARED_KV_SHORT_ROWS
        // positions.
        let per_round = (workers / (kv_heads * (group / hs))).max(1);
        per_round * visible.div_ceil(per_round * SHARED_KV_SHORT_ROWS).max(1)
    };
    let max_chunks = o.max_tasks.unwrap_or_else(|| if short { short_chunks() } else { SHARED_KV_MAX_TASKS });
    let rows = visible.div_ceil(max_chunks).max(o.min_rows.unwrap_or(SHARED_KV_MIN_ROWS));
    (rows, visible.div_ceil(rows), hs)
}

/// Measurement overrides of [`shared_kv_plan`]: `KRASIS_ATTN_MAX_TASKS` (chunks per sub-group),
/// `KRASIS_ATTN_MIN_ROWS`, `KRASIS_ATTN_TASK_HEADS` (0: whole group).
#[derive(Clone, Copy, Debug)]
struct SharedKvOverrides {
    max_tasks: Option<usize>,
    min_rows: Option<usize>,
    heads: Option<usize>,
}

fn shared_kv_overrides() -> SharedKvOverrides {
    let k = krasis_core::knobs::knobs();
    SharedKvOverrides { max_tasks: k.attn_max_tasks, min_rows: k.attn_min_rows, heads: k.attn_task_heads }
}

thread_local! {
    /// Per-thread score buffer (grows to the longest context seen).
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The calling thread's flash-decoding partials of [`decode_shared_kv`] (per head at most the
    /// larger of `SHARED_KV_MAX_TASKS` and the pool's workers + `SHARED_KV_LONG /
    /// SHARED_KV_SHORT_ROWS` chunks, so bounded by the head shapes and the pool, not the context).
    static PARTIALS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Naive f64 twin.
    fn reference(q: &[f32], tq: usize, heads: usize, q_start: usize, kv: &KvCacheView, scale: f32) -> Vec<f32> {
        reference_with(q, tq, heads, q_start, kv, scale, AttnOptions::default())
    }

    /// Naive f64 twin with a window and sinks: the scores of positions `first..=p` and, per head,
    /// the sink logit as one more softmax column whose probability is dropped.
    fn reference_with(
        q: &[f32],
        tq: usize,
        heads: usize,
        q_start: usize,
        kv: &KvCacheView,
        scale: f32,
        opts: AttnOptions,
    ) -> Vec<f32> {
        let group = heads / kv.kv_heads;
        let mut out = vec![0f32; tq * heads * kv.v_dim];
        for i in 0..tq {
            for h in 0..heads {
                let kvh = h / group;
                let qv = &q[(i * heads + h) * kv.k_dim..][..kv.k_dim];
                let first = opts.window.map_or(0, |w| (q_start + i + 1).saturating_sub(w));
                let s: Vec<f64> = (first..=q_start + i)
                    .map(|p| {
                        let k = &kv.k[p * kv.k_stride + kvh * kv.k_dim..][..kv.k_dim];
                        qv.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64
                    })
                    .collect();
                let sink = opts.sinks.map_or(f64::NEG_INFINITY, |s| s[h] as f64);
                let m = s.iter().cloned().fold(sink, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum::<f64>() + (sink - m).exp();
                for (j, w) in e.iter().enumerate() {
                    let p = first + j;
                    let v = &kv.v[p * kv.v_stride + kvh * kv.v_dim..][..kv.v_dim];
                    for d in 0..kv.v_dim {
                        out[(i * heads + h) * kv.v_dim + d] += (w / z * v[d] as f64) as f32;
                    }
                }
            }
        }
        out
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0).collect()
    }

    #[test]
    fn gqa_and_shared_latent_layouts_match_reference() {
        // GQA: 4 heads over 2 kv heads, 3 new queries after 5 cached positions.
        let (heads, kvh, dk, dv, len, tq) = (4, 2, 6, 5, 8, 3);
        let k = data(len * kvh * dk, 1);
        let v = data(len * kvh * dv, 2);
        let kv = KvCacheView {
            k: &k,
            k_stride: kvh * dk,
            v: &v,
            v_stride: kvh * dv,
            kv_heads: kvh,
            k_dim: dk,
            v_dim: dv,
            len,
        };
        let q = data(tq * heads * dk, 3);
        let mut out = vec![0f32; tq * heads * dv];
        causal_attention(&q, tq, heads, len - tq, &kv, 0.3, &mut out);
        let want = reference(&q, tq, heads, len - tq, &kv, 0.3);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        // Absorbed-MLA layout: value is a prefix of the key row.
        let (lat, rope) = (7, 3);
        let rows = data(len * (lat + rope), 4);
        let kv = KvCacheView {
            k: &rows,
            k_stride: lat + rope,
            v: &rows,
            v_stride: lat + rope,
            kv_heads: 1,
            k_dim: lat + rope,
            v_dim: lat,
            len,
        };
        let q = data(tq * heads * (lat + rope), 5);
        let mut out = vec![0f32; tq * heads * lat];
        causal_attention(&q, tq, heads, len - tq, &kv, 0.2, &mut out);
        let want = reference(&q, tq, heads, len - tq, &kv, 0.2);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    /// One query token over shared keys (the position-split path): GQA groups and the
    /// absorbed-MLA layout, contexts from one row to several chunks of rows (ragged last chunk),
    /// against the f64 twin, on the active ISA (`KRASIS_ISA` lowers it; `axpy` and `dot` are
    /// checked on every ISA against their scalar twins).
    #[test]
    fn one_token_over_shared_keys_matches_reference() {
        use proptest::prelude::*;
        let cfg = ProptestConfig { cases: 48, ..ProptestConfig::default() };
        proptest!(cfg, |(kvh in 1usize..3, group in 2usize..18, dk in 1usize..40, dv in 1usize..40,
                          len in 1usize..300, mla in any::<bool>(), seed in any::<u32>(),
                          rows_pick in 1usize..400, hs_pick in 0usize..8)| {
            let heads = kvh * group;
            let (k, v, kv_owned);
            let kv = if mla {
                // Value = the first dv elements of the key row (dv <= dk).
                let dv = dv.min(dk);
                kv_owned = data(len * kvh * dk, seed);
                KvCacheView { k: &kv_owned, k_stride: kvh * dk, v: &kv_owned, v_stride: kvh * dk, kv_heads: kvh,
                              k_dim: dk, v_dim: dv, len }
            } else {
                k = data(len * kvh * dk, seed);
                v = data(len * kvh * dv, seed ^ 7);
                KvCacheView { k: &k, k_stride: kvh * dk, v: &v, v_stride: kvh * dv, kv_heads: kvh, k_dim: dk,
                              v_dim: dv, len }
            };
            let q = data(heads * kv.k_dim, seed ^ 11);
            let want = reference(&q, 1, heads, len - 1, &kv, 0.25);
            let mut out = vec![f32::NAN; heads * kv.v_dim];
            causal_attention(&q, 1, heads, len - 1, &kv, 0.25, &mut out);
            for (a, b) in out.iter().zip(&want) {
                prop_assert!((a - b).abs() < 1e-5, "len {} heads {} ({} kv): {} vs {}", len, heads, kvh, a, b);
            }
            // Any split: rows per task, and heads per task a divisor of the group.
            let divisors: Vec<usize> = (1..=group).filter(|d| group % d == 0).collect();
            let hs = divisors[hs_pick % divisors.len()];
            let rows = 1 + rows_pick % len;
            let plan = (rows, len.div_ceil(rows), hs);
            let mut split = vec![f32::NAN; heads * kv.v_dim];
            decode_shared_kv_planned(isa::active(), &q, heads, len - 1, &kv, 0.25, &mut split, plan);
            for (a, b) in split.iter().zip(&want) {
                prop_assert!((a - b).abs() < 1e-5, "plan {:?} len {} heads {}: {} vs {}", plan, len, heads, a, b);
            }
        });
    }

    /// Sliding windows and attention sinks (gpt-oss) against the f64 twin: prefill rows and one
    /// token (the position-split path), windows shorter and longer than the context, with and
    /// without sinks; without either option the bits are those of [`causal_attention`].
    #[test]
    fn windows_and_sinks_match_reference() {
        use proptest::prelude::*;
        let cfg = ProptestConfig { cases: 64, ..ProptestConfig::default() };
        proptest!(cfg, |(kvh in 1usize..3, group in 1usize..5, dk in 1usize..20, len in 1usize..60,
                          tq_pick in 0usize..60, window in proptest::option::of(1usize..20),
                          sinks_on in any::<bool>(), seed in any::<u32>())| {
            let heads = kvh * group;
            let tq = 1 + tq_pick % len;
            let k = data(len * kvh * dk, seed);
            let v = data(len * kvh * dk, seed ^ 3);
            let kv = KvCacheView { k: &k, k_stride: kvh * dk, v: &v, v_stride: kvh * dk, kv_heads: kvh, k_dim: dk,
                                   v_dim: dk, len };
            let q = data(tq * heads * dk, seed ^ 5);
            let sinks: Vec<f32> = data(heads, seed ^ 9).iter().map(|x| 2.0 * x).collect();
            let opts = AttnOptions { window, sinks: sinks_on.then_some(&sinks[..]) };
            let want = reference_with(&q, tq, heads, len - tq, &kv, 0.3, opts);
            let mut out = vec![f32::NAN; tq * heads * dk];
            causal_attention_with(&q, tq, heads, len - tq, &kv, 0.3, opts, &mut out);
            for (a, b) in out.iter().zip(&want) {
                prop_assert!((a - b).abs() < 1e-5, "tq {} len {} {:?}: {} vs {}", tq, len, window, a, b);
            }
            if window.is_none() && !sinks_on {
                let mut plain = vec![f32::NAN; tq * heads * dk];
                causal_attention(&q, tq, heads, len - tq, &kv, 0.3, &mut plain);
                prop_assert_eq!(plain, out);
            }
        });
    }

    /// The sink takes probability mass: one key and a sink of the same logit give the value half.
    #[test]
    fn a_sink_equal_to_the_only_score_halves_the_output() {
        let (k, v) = ([0.0f32; 2], [1.0f32, -2.0]);
        let kv = KvCacheView { k: &k, k_stride: 2, v: &v, v_stride: 2, kv_heads: 1, k_dim: 2, v_dim: 2, len: 1 };
        let mut out = [0f32; 2];
        let opts = AttnOptions { window: None, sinks: Some(&[0.0]) };
        causal_attention_with(&[1.0, 1.0], 1, 1, 0, &kv, 1.0, opts, &mut out);
        assert_eq!(out, [0.5, -1.0]);
    }

    /// The default split is a valid one for every context, group and pool size (both regimes).
    #[test]
    fn default_split_is_valid() {
        for visible in [1usize, 2, 7, 8, 9, 63, 64, 575, 576, 2047, 2048, 4096, 100_000] {
            for (group, kv_heads) in [(1, 1), (2, 4), (8, 4), (16, 1), (12, 1), (24, 2)] {
                for workers in [1, 2, 16, 64] {
                    let (rows, chunks, hs) = shared_kv_plan(visible, group, kv_heads, workers);
                    assert!(hs > 0 && group % hs == 0, "{visible} {group} {workers}: heads {hs}");
                    assert!(rows * chunks >= visible && (chunks - 1) * rows < visible, "{visible}: {rows} x {chunks}");
                    let bound = SHARED_KV_MAX_TASKS.max(workers + SHARED_KV_LONG.div_ceil(SHARED_KV_SHORT_ROWS));
                    assert!(chunks <= bound, "{visible} {workers}: {chunks} chunks");
                }
            }
        }
    }
}
