//! Attention layers of the reference path. MLA runs in the absorbed form for prefill and decode
//! alike: `W_UK` is folded into the query and `W_UV` applied after attending over the latent.

use krasis_core::spec::{MlaDims, RopePairing};
use krasis_cpu::attention::causal_attention;
use krasis_cpu::isa;
use krasis_cpu::linear::{axpy, dot};
use krasis_cpu::norm::rms_norm_rows;
use krasis_cpu::rope::rotate;

use super::kv::LayerKv;

/// Tokens per task of MLA's W_UK absorption and W_UV product in long calls: each `kv_b` row
/// (2 KiB) is then read once per 8 tokens instead of once per token and head pair (`kv_b` is
/// 8 MiB of f32 in V2-Lite, far past L2, so per-token tasks re-read it from L3 every time).
const ABSORB_TOKENS: usize = 8;
/// Fewest rows of a call that take the token-blocked form: 16 tasks of [`ABSORB_TOKENS`] (a
/// task per worker of a 16-core pool); shorter calls (decode) keep a task per (token, head) so
/// one token's heads still spread over the pool.
pub(crate) const ABSORB_BLOCK_MIN_ROWS: usize = 16 * ABSORB_TOKENS;
use crate::build::MlaParts;
use crate::linear::LinearOp;

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

pub struct MlaAttention {
    pub dims: MlaDims,
    pub eps: f32,
    pub scale: f32,
    /// `kv_b` is `kv_b_proj` in f32, `[heads · (nope + v_dim), latent]`: per head `W_UK` rows then
    /// `W_UV` rows.
    pub w: MlaParts<Box<dyn LinearOp>, Vec<f32>, Vec<f32>>,
}

impl AttentionLayer for MlaAttention {
    fn new_cache(&self) -> LayerKv {
        LayerKv::latent(self.dims.latent + self.dims.rope, self.dims.latent)
    }

    fn weight_bytes(&self) -> usize {
        self.w.q_a.as_ref().map_or(0, |(a, _)| a.weight_bytes())
            + self.w.q_b.weight_bytes()
            + self.w.kv_a.weight_bytes()
            + self.w.kv_b.len() * 4
            + self.w.o.weight_bytes()
    }

    fn forward(&self, x: &[f32], seqs: &mut [SeqKv<'_>], rope: &RopeBatch, out: &mut [f32]) {
        let MlaDims { heads: h, nope, rope: rd, latent: lat, v_dim: vd } = self.dims;
        let t: usize = seqs.iter().map(|s| s.rows).sum();
        let qk = nope + rd;
        let mut q = vec![0f32; t * h * qk];
        match &self.w.q_a {
            Some((q_a, norm)) => {
                let mut qa = vec![0f32; t * q_a.out_dim()];
                q_a.forward(x, t, &mut qa);
                rms_norm_rows(&mut qa, norm, self.eps);
                self.w.q_b.forward(&qa, t, &mut q);
            }
            None => self.w.q_b.forward(x, t, &mut q),
        }
        let row = lat + rd;
        let mut kva = vec![0f32; t * row];
        self.w.kv_a.forward(x, t, &mut kva);
        for (i, r) in kva.chunks_exact_mut(row).enumerate() {
            rms_norm_rows(&mut r[..lat], &self.w.kv_a_norm, self.eps);
            rope.rotate(i, &mut r[lat..]);
        }

        // Absorb W_UK: q_lat = W_UKᵀ q_nope, per (token, head).
        let isa = isa::active();
        let per_head = nope + vd;
        let mut q_abs = vec![0f32; t * h * row];
        let pe_of = |i: usize, hh: usize, pe: &mut [f32]| {
            pe.copy_from_slice(&q[(i * h + hh) * qk + nope..(i * h + hh + 1) * qk]);
            rope.rotate(i, pe);
        };
        if t >= ABSORB_BLOCK_MIN_ROWS {
            // Tokens in blocks: each W_UK row is read once per block, and every output gets the
            // same axpys in the same order as below.
            krasis_cpu::par::for_each_chunk_mut(&mut q_abs, ABSORB_TOKENS * h * row, &|blk, qa| {
                let (i0, nt) = (blk * ABSORB_TOKENS, qa.len() / (h * row));
                for hh in 0..h {
                    for ti in 0..nt {
                        qa[(ti * h + hh) * row..(ti * h + hh) * row + lat].fill(0.0);
                    }
                    for d in 0..nope {
                        let wrow = &self.w.kv_b[(hh * per_head + d) * lat..(hh * per_head + d + 1) * lat];
                        for ti in 0..nt {
                            let qn = q[((i0 + ti) * h + hh) * qk + d];
                            axpy(isa, qn, wrow, &mut qa[(ti * h + hh) * row..(ti * h + hh) * row + lat]);
                        }
                    }
                    for ti in 0..nt {
                        pe_of(i0 + ti, hh, &mut qa[(ti * h + hh) * row + lat..(ti * h + hh + 1) * row]);
                    }
                }
            });
        } else {
            krasis_cpu::par::for_each_chunk_mut(&mut q_abs, row, &|idx, qa| {
                let (i, hh) = (idx / h, idx % h);
                let qh = &q[(i * h + hh) * qk..(i * h + hh + 1) * qk];
                let (lat_part, pe_part) = qa.split_at_mut(lat);
                lat_part.fill(0.0);
                for (d, &qn) in qh[..nope].iter().enumerate() {
                    axpy(isa, qn, &self.w.kv_b[(hh * per_head + d) * lat..(hh * per_head + d + 1) * lat], lat_part);
                }
                pe_of(i, hh, pe_part);
            });
        }

        let mut o_lat = vec![0f32; t * h * lat];
        append_each(seqs, &kva, row, None, |off, n, q_start, kv| {
            let q = &q_abs[off * h * row..(off + n) * h * row];
            causal_attention(q, n, h, q_start, &kv.view(), self.scale, &mut o_lat[off * h * lat..(off + n) * h * lat]);
        });

        // Apply W_UV per head (in token blocks for long calls, as the absorption above).
        let mut o = vec![0f32; t * h * vd];
        let uv_row = |hh: usize, j: usize| {
            let r = hh * per_head + nope + j;
            &self.w.kv_b[r * lat..(r + 1) * lat]
        };
        if t >= ABSORB_BLOCK_MIN_ROWS {
            krasis_cpu::par::for_each_chunk_mut(&mut o, ABSORB_TOKENS * h * vd, &|blk, ob| {
                let (i0, nt) = (blk * ABSORB_TOKENS, ob.len() / (h * vd));
                for hh in 0..h {
                    for j in 0..vd {
                        let wrow = uv_row(hh, j);
                        for ti in 0..nt {
                            let idx = (i0 + ti) * h + hh;
                            ob[(ti * h + hh) * vd + j] = dot(isa, wrow, &o_lat[idx * lat..(idx + 1) * lat]);
                        }
                    }
                }
            });
        } else {
            krasis_cpu::par::for_each_chunk_mut(&mut o, vd, &|idx, ov| {
                let ol = &o_lat[idx * lat..(idx + 1) * lat];
                for (j, v) in ov.iter_mut().enumerate() {
                    *v = dot(isa, uv_row(idx % h, j), ol);
                }
            });
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
        self.q_proj.forward(x, t, &mut q);
        self.k_proj.forward(x, t, &mut k);
        self.v_proj.forward(x, t, &mut v);
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
