//! Attention layers of the reference path. MLA runs in the absorbed form for prefill and decode
//! alike: `W_UK` is folded into the query and `W_UV` applied after attending over the latent.

use krasis_core::spec::{MlaDims, RopePairing};
use krasis_cpu::attention::causal_attention;
use krasis_cpu::isa;
use krasis_cpu::linear::{axpy, dot};
use krasis_cpu::norm::rms_norm_rows;
use krasis_cpu::rope::rotate;

use super::kv::LayerKv;

use crate::build::MlaParts;
use crate::linear::{forward_shared_input, LinearOp};
use crate::packed_ops::PackedKvB;

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

pub trait AttentionLayer: Send + Sync {
    /// `x`: normalised hidden states `[t, hidden]` of every sequence of the batch, `seqs[i].rows`
    /// rows each, at positions `kv.len()..kv.len()+rows` of each sequence's cache. Projections
    /// run once over all `t` rows (each weight read once per call); attention runs per sequence
    /// over its own cache, after appending its rows. Writes the attention output `[t, hidden]`.
    fn forward(&self, x: &[f32], seqs: &mut [SeqKv<'_>], rope: &RopeBatch, out: &mut [f32]);
    fn new_cache(&self) -> LayerKv;
    /// Weight bytes read per token.
    fn weight_bytes(&self) -> usize;
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

pub struct MlaAttention {
    pub dims: MlaDims,
    pub eps: f32,
    pub scale: f32,
    pub w: MlaParts<Box<dyn LinearOp>, Vec<f32>, KvB>,
}

impl AttentionLayer for MlaAttention {
    fn new_cache(&self) -> LayerKv {
        LayerKv::latent(self.dims.latent + self.dims.rope, self.dims.latent)
    }

    fn weight_bytes(&self) -> usize {
        self.w.q_a.as_ref().map_or(0, |(a, _)| a.weight_bytes())
            + self.w.q_b.weight_bytes()
            + self.w.kv_a.weight_bytes()
            + self.w.kv_b.weight_bytes()
            + self.w.o.weight_bytes()
    }

    fn forward(&self, x: &[f32], seqs: &mut [SeqKv<'_>], rope: &RopeBatch, out: &mut [f32]) {
        let MlaDims { heads: h, nope, rope: rd, latent: lat, v_dim: vd } = self.dims;
        let t: usize = seqs.iter().map(|s| s.rows).sum();
        let qk = nope + rd;
        let mut q = vec![0f32; t * h * qk];
        let row = lat + rd;
        let mut kva = vec![0f32; t * row];
        // The projections of x in one dispatch (activations quantised once).
        match &self.w.q_a {
            Some((q_a, norm)) => {
                let mut qa = vec![0f32; t * q_a.out_dim()];
                forward_shared_input(&[q_a.as_ref(), self.w.kv_a.as_ref()], x, t, &mut [&mut qa, &mut kva]);
                rms_norm_rows(&mut qa, norm, self.eps);
                self.w.q_b.forward(&qa, t, &mut q);
            }
            None => forward_shared_input(&[self.w.q_b.as_ref(), self.w.kv_a.as_ref()], x, t, &mut [&mut q, &mut kva]),
        }
        for (i, r) in kva.chunks_exact_mut(row).enumerate() {
            rms_norm_rows(&mut r[..lat], &self.w.kv_a_norm, self.eps);
            rope.rotate(i, &mut r[lat..]);
        }

        // Absorb W_UK: q_lat = W_UKᵀ q_nope, per (token, head); the rope part rotated beside it.
        let isa = isa::active();
        let per_head = nope + vd;
        let mut q_abs = vec![0f32; t * h * row];
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
            KvB::Packed(p) => p.absorb(&q, qk, t, &mut q_abs, row),
        }
        for (idx, qa) in q_abs.chunks_exact_mut(row).enumerate() {
            let (i, hh) = (idx / h, idx % h);
            let pe_part = &mut qa[lat..];
            pe_part.copy_from_slice(&q[(i * h + hh) * qk + nope..(i * h + hh + 1) * qk]);
            rope.rotate(i, pe_part);
        }

        let mut o_lat = vec![0f32; t * h * lat];
        append_each(seqs, &kva, row, None, |off, n, q_start, kv| {
            let q = &q_abs[off * h * row..(off + n) * h * row];
            causal_attention(q, n, h, q_start, &kv.view(), self.scale, &mut o_lat[off * h * lat..(off + n) * h * lat]);
        });

        // Apply W_UV per head.
        let mut o = vec![0f32; t * h * vd];
        match &self.w.kv_b {
            KvB::F32(kv_b) => krasis_cpu::par::for_each_chunk_mut(&mut o, vd, &|idx, ov| {
                let hh = idx % h;
                let ol = &o_lat[idx * lat..(idx + 1) * lat];
                for (j, v) in ov.iter_mut().enumerate() {
                    let r = hh * per_head + nope + j;
                    *v = dot(isa, &kv_b[r * lat..(r + 1) * lat], ol);
                }
            }),
            KvB::Packed(p) => p.apply_uv(&o_lat, t, &mut o),
        }
        self.w.o.forward(&o, t, out);
    }
}

pub struct GqaAttention {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub eps: f32,
    pub scale: f32,
    pub q_proj: Box<dyn LinearOp>,
    pub k_proj: Box<dyn LinearOp>,
    pub v_proj: Box<dyn LinearOp>,
    pub o_proj: Box<dyn LinearOp>,
    /// Per-head RMSNorm weights for q and k (Qwen3's qk-norm).
    pub qk_norm: Option<(Vec<f32>, Vec<f32>)>,
}

impl AttentionLayer for GqaAttention {
    fn new_cache(&self) -> LayerKv {
        LayerKv::separate(self.kv_heads, self.head_dim)
    }

    fn weight_bytes(&self) -> usize {
        self.q_proj.weight_bytes()
            + self.k_proj.weight_bytes()
            + self.v_proj.weight_bytes()
            + self.o_proj.weight_bytes()
    }

    fn forward(&self, x: &[f32], seqs: &mut [SeqKv<'_>], rope: &RopeBatch, out: &mut [f32]) {
        let (h, kvh, hd) = (self.heads, self.kv_heads, self.head_dim);
        let t: usize = seqs.iter().map(|s| s.rows).sum();
        let mut q = vec![0f32; t * h * hd];
        let mut k = vec![0f32; t * kvh * hd];
        let mut v = vec![0f32; t * kvh * hd];
        let ops = [self.q_proj.as_ref(), self.k_proj.as_ref(), self.v_proj.as_ref()];
        forward_shared_input(&ops, x, t, &mut [&mut q, &mut k, &mut v]);
        if let Some((qn, kn)) = &self.qk_norm {
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
        append_each(seqs, &k, kvh * hd, Some((&v, kvh * hd)), |off, n, q_start, kv| {
            causal_attention(
                &q[off * w..(off + n) * w],
                n,
                h,
                q_start,
                &kv.view(),
                self.scale,
                &mut o[off * w..(off + n) * w],
            );
        });
        self.o_proj.forward(&o, t, out);
    }
}
