//! Attention layers of the reference path. MLA runs in the absorbed form for decode and short
//! calls (`W_UK` folded into the query, `W_UV` applied after attending over the latent) and in
//! the decompressed form for prefill (keys and values expanded from the latent with `kv_b`, a
//! flash-attention loop per head: `krasis_cpu::mla_prefill`).

use std::cell::RefCell;

use krasis_core::spec::{MlaDims, RopePairing};
use krasis_cpu::attention::{causal_attention, causal_attention_with, AttnOptions};
use krasis_cpu::isa;
use krasis_cpu::linear::{add_bias_rows, axpy, dot};
use krasis_cpu::mla_prefill::{mla_prefill_attention, KvBWeights, MlaPrefillInputs};
use krasis_cpu::norm::rms_norm_rows;
use krasis_cpu::rope::rotate;

use super::kv::LayerKv;

use crate::cpu::packed_ops::PackedKvB;
use crate::model::build::{GqaParts, MlaParts};
use crate::model::linear::{forward_shared_input, LinearOp};
use crate::spec::AttentionSpec;

/// cos/sin for the rows of one forward call, `[t, half_dim]` each: row `i`'s angles are those of
/// its own position in its own sequence (a batch concatenates its sequences' tables).
pub struct RopeBatch {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub half: usize,
    pub pairing: RopePairing,
}

impl RopeBatch {
    fn rotate(&self, token: usize, x: &mut [f32]) {
        let r = token * self.half..(token + 1) * self.half;
        rotate(x, &self.cos[r.clone()], &self.sin[r], self.pairing);
    }
}

/// One sequence's share of a batched attention call: its rows (consecutive in the batch, in
/// sequence order) and its KV cache for this layer.
pub struct SeqKv<'a> {
    pub rows: usize,
    pub kv: &'a mut LayerKv,
}

/// Calls `f(offset, rows, q_start, kv)` per sequence after appending its rows of `fresh` (`width`
/// floats per row; `fresh_v` likewise, for caches with separate values) to its cache; `q_start`
/// is the position of the sequence's first row.
fn append_each(
    seqs: &mut [SeqKv<'_>],
    fresh: &[f32],
    width: usize,
    fresh_v: Option<(&[f32], usize)>,
    mut f: impl FnMut(usize, usize, usize, &LayerKv),
) {
    let mut off = 0;
    for s in seqs.iter_mut() {
        let q_start = s.kv.len();
        let v = fresh_v.map(|(v, w)| &v[off * w..(off + s.rows) * w]);
        s.kv.append(&fresh[off * width..(off + s.rows) * width], v);
        f(off, s.rows, q_start, s.kv);
        off += s.rows;
    }
}

/// An empty KV cache for one layer of `attention`: MLA keeps one latent+rope row per token, GQA
/// a K and a V row.
pub fn new_layer_cache(attention: &AttentionSpec) -> LayerKv {
    match *attention {
        AttentionSpec::Mla { kv_lora_rank, qk_rope_head_dim, .. } => {
            LayerKv::latent(kv_lora_rank + qk_rope_head_dim, kv_lora_rank)
        }
        AttentionSpec::Gqa { kv_heads, head_dim, .. } => LayerKv::separate(kv_heads, head_dim),
    }
}

/// MLA's `kv_b_proj` as the absorbed form reads it.
pub enum KvB {
    /// `[heads · (nope + v_dim), latent]` in f32: per head `W_UK` rows then `W_UV` rows.
    F32(Vec<f32>),
    /// Per head `W_UKᵀ` and `W_UV`, INT8, each product one pool dispatch over all heads.
    Packed(Box<PackedKvB>),
}

impl KvB {
    pub fn weight_bytes(&self) -> usize {
        match self {
            KvB::F32(w) => w.len() * 4,
            KvB::Packed(p) => p.weight_bytes(),
        }
    }
}

/// Fewest query rows of one sequence's call for which MLA attention runs decompressed
/// ([`krasis_cpu::mla_prefill`]): measured on V2-Lite shapes (`mla_threshold` group of `cargo
/// bench -p krasis-model --bench mla_prefill`, 2 threads) a fresh 16-row call ties and a 32-row
/// one is 1.2× faster decompressed; decode (1 row) and short calls keep the absorbed form.
pub const MLA_PREFILL_MIN_ROWS: usize = 32;
/// Most keys per query row for which the decompressed form pays: it expands every cached key
/// row once per call (`heads · (nope + v_dim) · latent` multiply-adds a row), which a short call
/// after a long context does not earn back (measured at 32 rows: 1.2× faster than absorbed at 1
/// key a row, 1.4× slower at 16, level at 32).
pub const MLA_PREFILL_MAX_KEYS_PER_ROW: usize = 8;

/// `KRASIS_MLA_PREFILL=absorbed` keeps MLA prefill in the absorbed form (the former path, for
/// A/B measurements); `decompressed` takes the decompressed form for every call of two rows or
/// more; unset (or anything else), the rule of [`MLA_PREFILL_MIN_ROWS`] and
/// [`MLA_PREFILL_MAX_KEYS_PER_ROW`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlaPrefillMode {
    Auto,
    Absorbed,
    Decompressed,
}

impl MlaPrefillMode {
    pub fn from_env() -> Self {
        match krasis_core::knobs::knobs().mla_prefill {
            Some(krasis_core::knobs::MlaPrefill::Absorbed) => MlaPrefillMode::Absorbed,
            Some(krasis_core::knobs::MlaPrefill::Decompressed) => MlaPrefillMode::Decompressed,
            None => MlaPrefillMode::Auto,
        }
    }

    /// Whether a call of `rows` query rows after `cached` cache rows runs decompressed.
    pub fn decompressed(self, rows: usize, cached: usize) -> bool {
        match self {
            MlaPrefillMode::Absorbed => false,
            MlaPrefillMode::Decompressed => rows >= 2,
            MlaPrefillMode::Auto => {
                rows >= MLA_PREFILL_MIN_ROWS && cached + rows <= rows * MLA_PREFILL_MAX_KEYS_PER_ROW
            }
        }
    }
}

/// How one-token absorbed MLA attention runs with packed `kv_b`: `KRASIS_CPU_MLA_DECODE=split` as
/// separate dispatches (W_UK, the attention's partials, their combine, W_UV, then `o_proj`: the
/// former path, for A/B measurements); `attention`: W_UK to W_UV in one dispatch, `o_proj` in
/// its own; unset (or anything else), `o_proj` inside that dispatch too
/// ([`krasis_cpu::mla_decode`]). Same bits every way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlaDecodeMode {
    Fused,
    AttentionOnly,
    Split,
}

impl MlaDecodeMode {
    pub fn from_env() -> Self {
        match krasis_core::knobs::knobs().cpu_mla_decode {
            Some(krasis_core::knobs::CpuMlaDecode::Split) => MlaDecodeMode::Split,
            Some(krasis_core::knobs::CpuMlaDecode::AttentionOnly) => MlaDecodeMode::AttentionOnly,
            None => MlaDecodeMode::Fused,
        }
    }
}

/// What [`MlaAttention::decode_one`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OneToken {
    NotTaken,
    Attended,
    Projected,
}

/// MLA's weights on the CPU.
pub type CpuMlaParts = MlaParts<Box<dyn LinearOp>, Vec<f32>, KvB>;

/// One MLA layer of the CPU engine: its weights and the model's dimensions.
pub struct MlaAttention<'w> {
    pub dims: MlaDims,
    pub eps: f32,
    pub scale: f32,
    pub w: &'w CpuMlaParts,
    pub prefill: MlaPrefillMode,
}

impl<'w> MlaAttention<'w> {
    pub fn new(dims: MlaDims, eps: f32, scale: f32, w: &'w CpuMlaParts) -> Self {
        MlaAttention { dims, eps, scale, w, prefill: MlaPrefillMode::from_env() }
    }

    /// One token of one sequence with packed `kv_b`: appends its cache row and runs W_UK, the
    /// attention and W_UV in one dispatch ([`krasis_cpu::mla_decode`]), with `o_proj` into `out`
    /// inside it where it is packed on the same pool. Returns what it did
    /// ([`OneToken::NotTaken`]: nothing, the call is not such a token or
    /// `KRASIS_CPU_MLA_DECODE=split`; then [`MlaAttention::attend_into`] runs it, with the same
    /// bits).
    fn decode_one(&self, q: &[f32], kva: &[f32], seqs: &mut [SeqKv<'_>], o: &mut [f32], out: &mut [f32]) -> OneToken {
        let mode = MlaDecodeMode::from_env();
        let (KvB::Packed(p), [s]) = (&self.w.kv_b, &mut *seqs) else { return OneToken::NotTaken };
        if s.rows != 1 || mode == MlaDecodeMode::Split {
            return OneToken::NotTaken;
        }
        s.kv.append(kva, None);
        let proj = self.w.o.packed().filter(|r| mode == MlaDecodeMode::Fused && p.can_project(r));
        let done = if proj.is_some() { OneToken::Projected } else { OneToken::Attended };
        p.attend_one(q, &s.kv.view(), self.scale, o, proj.map(|r| (r.bytes, *r.layout, out)));
        done
    }

    /// The attention core after the projections: `q` `[t, heads, nope + rope]` with its rope
    /// parts rotated, `kva` `[t, latent + rope]` the new cache rows (normalised latent, rotated
    /// rope key), appended to each sequence's cache here. Returns the per-head values
    /// `[t, heads, v_dim]` (`o_proj`'s input). Each sequence runs decompressed or absorbed by
    /// its own rows ([`MlaPrefillMode::decompressed`]), so batching does not change its numbers.
    pub fn attend(&self, q: &[f32], kva: &[f32], seqs: &mut [SeqKv<'_>]) -> Vec<f32> {
        let t: usize = seqs.iter().map(|s| s.rows).sum();
        let mut o = vec![0f32; t * self.dims.heads * self.dims.v_dim];
        self.attend_into(q, kva, seqs, &mut o);
        o
    }

    /// [`MlaAttention::attend`] into `o` (`[t, heads, v_dim]`, every element written).
    pub fn attend_into(&self, q: &[f32], kva: &[f32], seqs: &mut [SeqKv<'_>], o: &mut [f32]) {
        let MlaDims { heads: h, nope, rope: rd, latent: lat, v_dim: vd } = self.dims;
        let t: usize = seqs.iter().map(|s| s.rows).sum();
        let (qk, row) = (nope + rd, lat + rd);
        let mut clock = std::time::Instant::now();
        let dec: Vec<bool> = seqs.iter().map(|s| self.prefill.decompressed(s.rows, s.kv.len())).collect();
        let any_absorbed = dec.iter().any(|d| !d);
        // The decompressed form dequantises `kv_b` per task from the form held here.
        let kv_b = match &self.w.kv_b {
            KvB::F32(w) => KvBWeights::F32(w),
            KvB::Packed(p) => p.prefill_weights(),
        };

        // Absorb W_UK: q_lat = W_UKᵀ q_nope, per (token, head); the rope part beside it.
        let isa = isa::active();
        let per_head = nope + vd;
        let mut q_abs = vec![0f32; if any_absorbed { t * h * row } else { 0 }];
        if any_absorbed {
            match &self.w.kv_b {
                KvB::F32(kv_b) => krasis_cpu::par::for_each_chunk_mut(&mut q_abs, row, &|idx, qa| {
                    let (i, hh) = (idx / h, idx % h);
                    let qh = &q[(i * h + hh) * qk..(i * h + hh + 1) * qk];
                    let lat_part = &mut qa[..lat];
                    lat_part.fill(0.0);
                    for (d, &qn) in qh[..nope].iter().enumerate() {
                        axpy(isa, qn, &kv_b[(hh * per_head + d) * lat..(hh * per_head + d + 1) * lat], lat_part);
                    }
                }),
                KvB::Packed(p) => p.absorb(q, qk, t, &mut q_abs, row),
            }
            for (qa, qh) in q_abs.chunks_exact_mut(row).zip(q.chunks_exact(qk)) {
                qa[lat..].copy_from_slice(&qh[nope..]);
            }
        }

        assert_eq!(o.len(), t * h * vd, "attend_into: o must hold [t, heads, v_dim]");
        MLA_NS.lap(&mut clock, 4);
        let mut o_lat = vec![0f32; if any_absorbed { t * h * lat } else { 0 }];
        let mut seq = 0;
        append_each(seqs, kva, row, None, |off, n, q_start, kv| {
            let view = kv.view();
            if dec[seq] {
                let inputs = MlaPrefillInputs {
                    dims: self.dims,
                    q: &q[off * h * qk..(off + n) * h * qk],
                    t: n,
                    q_start,
                    cache: view.k,
                    stride: view.k_stride,
                    kv_b,
                    scale: self.scale,
                };
                mla_prefill_attention(&inputs, &mut o[off * h * vd..(off + n) * h * vd])
                    .expect("the layer sizes q, its cache and kv_b from its own dims");
            } else {
                let q = &q_abs[off * h * row..(off + n) * h * row];
                causal_attention(q, n, h, q_start, &view, self.scale, &mut o_lat[off * h * lat..(off + n) * h * lat]);
            }
            seq += 1;
        });
        MLA_NS.lap(&mut clock, 5);
        if !any_absorbed {
            return;
        }

        // Apply W_UV per head (into `o` itself when no sequence ran decompressed).
        let any_decompressed = dec.iter().any(|&d| d);
        let mut mixed = vec![0f32; if any_decompressed { t * h * vd } else { 0 }];
        let o_abs: &mut [f32] = if any_decompressed { &mut mixed } else { &mut *o };
        o_abs.fill(0.0);
        match &self.w.kv_b {
            KvB::F32(kv_b) => krasis_cpu::par::for_each_chunk_mut(o_abs, vd, &|idx, ov| {
                let hh = idx % h;
                let ol = &o_lat[idx * lat..(idx + 1) * lat];
                for (j, v) in ov.iter_mut().enumerate() {
                    let r = hh * per_head + nope + j;
                    *v = dot(isa, &kv_b[r * lat..(r + 1) * lat], ol);
                }
            }),
            KvB::Packed(p) => p.apply_uv(&o_lat, t, o_abs),
        }
        MLA_NS.lap(&mut clock, 6);
        if !any_decompressed {
            return;
        }
        let mut off = 0;
        for (s, &d) in seqs.iter().zip(&dec) {
            let r = off * h * vd..(off + s.rows) * h * vd;
            if !d {
                o[r.clone()].copy_from_slice(&mixed[r]);
            }
            off += s.rows;
        }
    }
}

impl MlaAttention<'_> {
    /// An empty KV cache for this layer.
    pub fn new_cache(&self) -> LayerKv {
        LayerKv::latent(self.dims.latent + self.dims.rope, self.dims.latent)
    }

    /// `x`: normalised hidden states `[t, hidden]` of every sequence of the batch, `seqs[i].rows`
    /// rows each, at positions `kv.len()..kv.len()+rows` of each sequence's cache. Projections
    /// run once over all `t` rows (each weight read once per call); attention runs per sequence
    /// over its own cache, after appending its rows. Writes the attention output `[t, hidden]`.
    pub fn forward(&self, x: &[f32], seqs: &mut [SeqKv<'_>], rope: &RopeBatch, out: &mut [f32]) {
        let mut clock = std::time::Instant::now();
        let MlaDims { heads: h, nope, rope: rd, latent: lat, .. } = self.dims;
        let t: usize = seqs.iter().map(|s| s.rows).sum();
        let qk = nope + rd;
        let row = lat + rd;
        // Reused buffers (taken out of the thread's scratch for the call, put back after).
        let [mut qb, mut kvb, mut ob] = MLA_SCRATCH.with_borrow_mut(std::mem::take);
        let (q, kva, o) =
            (grown(&mut qb, t * h * qk), grown(&mut kvb, t * row), grown(&mut ob, t * h * self.dims.v_dim));
        // The projections of x in one dispatch (activations quantised once).
        match &self.w.q_a {
            Some((q_a, norm)) => {
                let mut qa = vec![0f32; t * q_a.out_dim()];
                forward_shared_input(&[q_a.as_ref(), self.w.kv_a.as_ref()], x, t, &mut [&mut qa, &mut *kva]);
                rms_norm_rows(&mut qa, norm, self.eps);
                self.w.q_b.forward(&qa, t, q);
            }
            None => forward_shared_input(&[self.w.q_b.as_ref(), self.w.kv_a.as_ref()], x, t, &mut [&mut *q, &mut *kva]),
        }
        MLA_NS.lap(&mut clock, 0);
        // Per token: the latent normed, the rope key and each head's rope part of q rotated.
        let norm_rope = |first: usize, kv_rows: &mut [f32], q_rows: &mut [f32]| {
            for (j, (r, qt)) in kv_rows.chunks_exact_mut(row).zip(q_rows.chunks_exact_mut(h * qk)).enumerate() {
                rms_norm_rows(&mut r[..lat], &self.w.kv_a_norm, self.eps);
                rope.rotate(first + j, &mut r[lat..]);
                for qh in qt.chunks_exact_mut(qk) {
                    rope.rotate(first + j, &mut qh[nope..]);
                }
            }
        };
        if t <= NORM_ROPE_TOKENS_PER_TASK {
            norm_rope(0, kva, q);
        } else {
            krasis_cpu::par::for_each_chunk_pair_mut(
                kva,
                NORM_ROPE_TOKENS_PER_TASK * row,
                q,
                NORM_ROPE_TOKENS_PER_TASK * h * qk,
                &|c, kv_rows, q_rows| norm_rope(c * NORM_ROPE_TOKENS_PER_TASK, kv_rows, q_rows),
            );
        }
        MLA_NS.lap(&mut clock, 1);
        let mut core = clock;
        let one = self.decode_one(q, kva, seqs, o, out);
        if one == OneToken::NotTaken {
            self.attend_into(q, kva, seqs, o);
        } else {
            // The one dispatch counts as the attention core (o_proj included when projected).
            MLA_NS.lap(&mut core, 5);
        }
        MLA_NS.lap(&mut clock, 2);
        if one != OneToken::Projected {
            self.w.o.forward(o, t, out);
        }
        MLA_NS.lap(&mut clock, 3);
        MLA_SCRATCH.with_borrow_mut(|s| *s = [qb, kvb, ob]);
    }
}

thread_local! {
    /// The MLA layers' per-call q, latent-and-rope-key and per-head value buffers: grown to the
    /// largest call and reused by every layer (a 512-token V2-Lite prefill's are ~11 MB, which
    /// fresh zeroed vectors cleared again in every layer); [`trim_scratch`] hands them back.
    static MLA_SCRATCH: RefCell<[Vec<f32>; 3]> = const { RefCell::new([Vec::new(), Vec::new(), Vec::new()]) };
}

/// The first `n` elements of `v`, grown (zeroed) when shorter; what it held before is left as it
/// was (every user writes all `n` before reading).
fn grown(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Frees this thread's MLA buffers when they hold more than `keep` bytes (after a long prompt).
pub fn trim_scratch(keep: usize) {
    MLA_SCRATCH.with_borrow_mut(|s| {
        if s.iter().map(|v| v.capacity() * 4).sum::<usize>() > keep {
            *s = Default::default();
        }
    });
}

/// Tokens per pool task of the MLA layers' latent norm and RoPE (a prefill's 512 tokens make 32
/// tasks; decode's one token stays on the calling thread: a dispatch would cost more than it).
const NORM_ROPE_TOKENS_PER_TASK: usize = 16;

/// Nanoseconds spent so far in MLA layers' forward, by stage: projections, norm and RoPE,
/// attention (cache append included), output projection; then the attention's parts: the W_UK
/// absorption of q, the attention over the cache (append included) and W_UV (for benches).
pub fn mla_phase_ns() -> [u64; 7] {
    MLA_NS.get()
}

static MLA_NS: krasis_cpu::phase_ns::PhaseNs<7> = krasis_cpu::phase_ns::PhaseNs::new();

/// One GQA layer of the CPU engine: its weights (with the per-head qk-norm and the projections'
/// biases when present) and the model's dimensions. The rotary tables cover the first
/// `rope.half · 2` dims of each head (all of it, or a prefix: partial rotary).
pub struct GqaAttention<'w> {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub eps: f32,
    pub scale: f32,
    /// `q_proj` yields per head the query and then an output gate of the same width; the
    /// attention output is multiplied by σ(gate) before `o_proj` (Qwen3-Next).
    pub output_gate: bool,
    /// The layer's sliding window ([`crate::spec::ModelSpec::window`]; `None`: full attention).
    /// The attention sinks, when the layer has them, are in `w`.
    pub window: Option<usize>,
    pub w: &'w GqaParts<Box<dyn LinearOp>, Vec<f32>>,
}

impl GqaAttention<'_> {
    /// As [`MlaAttention::forward`].
    pub fn forward(&self, x: &[f32], seqs: &mut [SeqKv<'_>], rope: &RopeBatch, out: &mut [f32]) {
        let (h, kvh, hd) = (self.heads, self.kv_heads, self.head_dim);
        let t: usize = seqs.iter().map(|s| s.rows).sum();
        let gated = if self.output_gate { 2 } else { 1 };
        let mut q = vec![0f32; t * h * hd * gated];
        let mut k = vec![0f32; t * kvh * hd];
        let mut v = vec![0f32; t * kvh * hd];
        let ops = [self.w.q.as_ref(), self.w.k.as_ref(), self.w.v.as_ref()];
        forward_shared_input(&ops, x, t, &mut [&mut q, &mut k, &mut v]);
        // Per head [query | gate]: the queries go on, the gates wait for the output.
        let gate = self.output_gate.then(|| {
            let mut gate = Vec::with_capacity(t * h * hd);
            let mut query = Vec::with_capacity(t * h * hd);
            for head in q.chunks_exact(2 * hd) {
                query.extend_from_slice(&head[..hd]);
                gate.extend_from_slice(&head[hd..]);
            }
            q = query;
            gate
        });
        if let Some([qb, kb, vb]) = &self.w.qkv_bias {
            add_bias_rows(&mut q, qb);
            add_bias_rows(&mut k, kb);
            add_bias_rows(&mut v, vb);
        }
        if let Some((qn, kn)) = &self.w.qk_norm {
            rms_norm_rows(&mut q, qn, self.eps);
            rms_norm_rows(&mut k, kn, self.eps);
        }
        for (idx, head) in q.chunks_exact_mut(hd).enumerate() {
            rope.rotate(idx / h, head);
        }
        for (idx, head) in k.chunks_exact_mut(hd).enumerate() {
            rope.rotate(idx / kvh, head);
        }
        let mut o = vec![0f32; t * h * hd];
        let w = h * hd;
        let opts = AttnOptions { window: self.window, sinks: self.w.sinks.as_deref() };
        append_each(seqs, &k, kvh * hd, Some((&v, kvh * hd)), |off, n, q_start, kv| {
            causal_attention_with(
                &q[off * w..(off + n) * w],
                n,
                h,
                q_start,
                &kv.view(),
                self.scale,
                opts,
                &mut o[off * w..(off + n) * w],
            );
        });
        if let Some(gate) = gate {
            for (x, g) in o.iter_mut().zip(gate) {
                *x /= 1.0 + (-g).exp();
            }
        }
        self.w.o.forward(&o, t, out);
        if let Some(ob) = &self.w.o_bias {
            add_bias_rows(&mut out[..t * ob.len()], ob);
        }
    }
}
