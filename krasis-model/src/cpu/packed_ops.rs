//! Dense weights the quantised CPU engine runs as fused pool dispatches rather than one linear at
//! a time: MLA's `kv_b_proj` per head (the absorbed form's `W_UKᵀ · q_nope` and `W_UV · o_lat`,
//! one dispatch each for all heads), and a gated MLP (shared expert, dense layer) as one expert of
//! the routed-expert runner (one dispatch: SiLU(gate)·up, then down as the intermediate's groups
//! complete, added into the layer output). Both come from the dense-weight cache.

use std::sync::{Arc, Mutex};

use krasis_cache::DenseCache;
use krasis_core::spec::MlaDims;
use krasis_cpu::attention::KvCacheView;
use krasis_cpu::heads::{HeadMatmul, HeadStrides};
use krasis_cpu::isa::{self, Isa};
use krasis_cpu::mla_decode::{output_fusable, AbsorbedKvB, MlaDecode, OutputProj};
use krasis_cpu::mla_prefill::KvBWeights;
use krasis_cpu::moe::{ExpertJob, ExpertWeights, PoolExperts};
use krasis_cpu::pool::WorkerPool;
use krasis_quant::cpu_layout::{pack_into, PackedLayout, ROW_BLOCK};
use krasis_quant::group::quantize;
use krasis_quant::Bits;
use rayon::prelude::*;

use crate::cpu::quantized::dense_layout;
use crate::error::Result;
use crate::model::linear::{DenseLinear, LinearOp, PackedRef};

/// Packed bytes of one matrix (or of several packed back to back): owned, or an entry of a loaded
/// dense-weight cache (shared by every op of the model).
pub enum PackedBytes {
    Owned(Vec<u8>),
    Cached { cache: Arc<DenseCache>, index: usize },
}

impl PackedBytes {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            PackedBytes::Owned(v) => v,
            PackedBytes::Cached { cache, index } => cache.entry(*index),
        }
    }
}

/// `kv_b` is quantised to INT8 whatever `--cpu-dense-bits` says: every attention score and value
/// goes through it, and at INT8 it is 1/4 of the f32 bytes the absorbed form read before.
pub const KV_B_BITS: Bits = Bits::Int8;

/// Per-head packed layouts of `kv_b`: `W_UKᵀ` `[latent, nope]` (K padded with zero columns to a
/// multiple of 32, the smallest group) and `W_UV` `[v_dim, latent]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvBLayouts {
    pub uk: PackedLayout,
    pub uv: PackedLayout,
}

/// The smallest group size, to which `W_UKᵀ`'s K (nope) is padded.
const MIN_GROUP: usize = 32;

/// `kv_b`'s per-head layouts at group size `group`, or `None` when `latent` does not split into
/// groups (then `kv_b` stays f32).
pub fn kv_b_layouts(d: &MlaDims, group: usize) -> Option<KvBLayouts> {
    let uk = dense_layout(d.latent, d.nope.next_multiple_of(MIN_GROUP), KV_B_BITS, group, "kv_b_proj").ok()?;
    let uv = dense_layout(d.v_dim, d.latent, KV_B_BITS, group, "kv_b_proj").ok()?;
    Some(KvBLayouts { uk, uv })
}

/// Head `h`'s `W_UKᵀ` (`uk = true`, `[latent, K]`, zero columns past nope) or `W_UV` (`[v_dim,
/// latent]`) from `kv_b` `[heads·(nope + v_dim), latent]`, as f32 rows of `l.k`.
fn head_matrix(kv_b: &DenseLinear, d: &MlaDims, h: usize, uk: bool, l: &PackedLayout) -> Vec<f32> {
    let per_head = d.nope + d.v_dim;
    let mut row = vec![0f32; d.latent];
    let mut w = vec![0f32; l.rows * l.k];
    if uk {
        for n in 0..d.nope {
            kv_b.row_into(h * per_head + n, &mut row);
            for (j, &v) in row.iter().enumerate() {
                w[j * l.k + n] = v;
            }
        }
    } else {
        for (j, out) in w.chunks_exact_mut(l.k).enumerate() {
            kv_b.row_into(h * per_head + d.nope + j, out);
        }
    }
    w
}

/// Every head's `W_UKᵀ` (`uk`) or `W_UV` packed back to back (`heads × l.bytes()`): the dense-weight
/// cache's two `kv_b` entries.
pub fn pack_kv_b(kv_b: &DenseLinear, d: &MlaDims, uk: bool, l: &PackedLayout) -> Vec<u8> {
    let mut out = vec![0u8; d.heads * l.bytes()];
    out.par_chunks_mut(l.bytes()).enumerate().for_each(|(h, o)| {
        let w = head_matrix(kv_b, d, h, uk, l);
        pack_into(&quantize(&w, l.rows, l.k, l.bits, l.gs), o).expect("sized from the layout");
    });
    out
}

/// `kv_b` packed per head ([`pack_kv_b`]) and run over the pool, one dispatch per product.
pub struct PackedKvB {
    uk: PackedBytes,
    uv: PackedBytes,
    layouts: KvBLayouts,
    dims: MlaDims,
    pool: Arc<WorkerPool>,
    matmul: HeadMatmul,
    decode: MlaDecode,
    /// `q_nope` zero-padded to the packed K when nope is not a multiple of 32.
    padded: Mutex<Vec<f32>>,
    isa: Isa,
}

impl PackedKvB {
    pub fn new(uk: PackedBytes, uv: PackedBytes, layouts: KvBLayouts, dims: MlaDims, pool: Arc<WorkerPool>) -> Self {
        PackedKvB {
            matmul: HeadMatmul::new(&pool),
            decode: MlaDecode::new(&pool),
            uk,
            uv,
            layouts,
            dims,
            pool,
            padded: Mutex::new(Vec::new()),
            isa: isa::active(),
        }
    }

    pub fn weight_bytes(&self) -> usize {
        self.uk.as_slice().len() + self.uv.as_slice().len()
    }

    /// `out[i, h, ..latent] = W_UK,hᵀ · q[i, h, ..nope]` for `t` tokens: `q` is `[t, heads, qk]`
    /// (nope then rope per head), `out` `[t, heads, row]` (only the first `latent` of each row is
    /// written).
    pub fn absorb(&self, q: &[f32], qk: usize, t: usize, out: &mut [f32], row: usize) {
        let (h, nope) = (self.dims.heads, self.dims.nope);
        let k = self.layouts.uk.k;
        let ys = HeadStrides { token: h * row, head: row };
        let mut run = |x: &[f32], xs| {
            self.matmul.run(&self.pool, self.isa, self.uk.as_slice(), &self.layouts.uk, h, x, xs, t, out, ys)
        };
        if k == nope {
            return run(q, HeadStrides { token: h * qk, head: qk });
        }
        let mut p = self.padded.lock().unwrap_or_else(|e| e.into_inner());
        p.clear();
        p.resize(t * h * k, 0.0);
        for (dst, src) in p.chunks_exact_mut(k).zip(q.chunks_exact(qk)) {
            dst[..nope].copy_from_slice(&src[..nope]);
        }
        run(&p, HeadStrides { token: h * k, head: k });
    }

    /// Whether the packed output projection `r` can run inside [`PackedKvB::attend_one`]'s
    /// dispatch (the same pool and ISA, K the heads' values).
    pub fn can_project(&self, r: &PackedRef<'_>) -> bool {
        std::ptr::eq(r.pool, &*self.pool) && r.isa == self.isa && output_fusable(&self.dims, r.layout)
    }

    /// Absorbed attention of one token at the cache's last position, W_UK to W_UV in one
    /// dispatch ([`MlaDecode`]): `q` `[heads, nope + rope]` (rope rotated), `kv` the latent cache
    /// with the token's row appended, `o` `[heads, v_dim]`; with `proj` (packed bytes, layout,
    /// output; [`PackedKvB::can_project`]), `o_proj` in the same dispatch.
    pub fn attend_one(
        &self,
        q: &[f32],
        kv: &KvCacheView<'_>,
        scale: f32,
        o: &mut [f32],
        proj: Option<(&[u8], PackedLayout, &mut [f32])>,
    ) {
        let w = AbsorbedKvB {
            uk: self.uk.as_slice(),
            uk_layout: self.layouts.uk,
            uv: self.uv.as_slice(),
            uv_layout: self.layouts.uv,
        };
        let proj = proj.map(|(w, layout, y)| OutputProj { w, layout, y });
        self.decode.run(&self.pool, self.isa, &self.dims, q, kv, scale, &w, o, proj);
    }

    /// The packed bytes as the decompressed prefill reads them (each task dequantises one head's
    /// weights into its scratch: no f32 copy is kept).
    pub fn prefill_weights(&self) -> KvBWeights<'_> {
        KvBWeights::Packed {
            uk: self.uk.as_slice(),
            uk_layout: self.layouts.uk,
            uv: self.uv.as_slice(),
            uv_layout: self.layouts.uv,
        }
    }

    /// `o[i, h, ..] = W_UV,h · o_lat[i, h, ..]`: `o_lat` is `[t, heads, latent]`, `o` `[t, heads,
    /// v_dim]`.
    pub fn apply_uv(&self, o_lat: &[f32], t: usize, o: &mut [f32]) {
        let MlaDims { heads: h, latent, v_dim, .. } = self.dims;
        let (xs, ys) = (HeadStrides { token: h * latent, head: latent }, HeadStrides { token: h * v_dim, head: v_dim });
        self.matmul.run(&self.pool, self.isa, self.uv.as_slice(), &self.layouts.uv, h, o_lat, xs, t, o, ys);
    }
}

/// Whether a gated MLP of intermediate size `inter` can run as one expert (fused w13 blocks need
/// whole row blocks and w2's K whole groups).
pub fn w13_fusable(inter: usize) -> bool {
    inter.is_multiple_of(MIN_GROUP.max(2 * ROW_BLOCK))
}

/// The fused gate+up layout of a gated MLP `[inter, hidden]` at `bits` and group `group`.
pub fn w13_layout(inter: usize, hidden: usize, bits: Bits, group: usize, name: &str) -> Result<PackedLayout> {
    let one = dense_layout(inter, hidden, bits, group, name)?;
    PackedLayout::new(2 * inter, hidden, one.gs, bits).map_err(|e| crate::cpu::quantized::quant_err(name, e))
}

/// `gate` and `up` packed with their row blocks interleaved (`krasis_quant::cpu_layout`'s fused
/// w13): the same bytes as packing each alone, block by block.
pub fn pack_w13_dense(gate: &DenseLinear, up: &DenseLinear, l13: &PackedLayout) -> Vec<u8> {
    let one = PackedLayout::new(l13.rows / 2, l13.k, l13.gs, l13.bits).expect("half of a valid w13 layout");
    let (g, u) = (crate::cpu::quantized::pack_dense(gate, &one), crate::cpu::quantized::pack_dense(up, &one));
    let bb = one.block_bytes();
    let mut out = vec![0u8; l13.bytes()];
    for (b, pair) in out.chunks_exact_mut(2 * bb).enumerate() {
        pair[..bb].copy_from_slice(&g[b * bb..(b + 1) * bb]);
        pair[bb..].copy_from_slice(&u[b * bb..(b + 1) * bb]);
    }
    out
}

/// A gated MLP run as one expert of weight 1 over every token ([`PoolExperts`]): one dispatch
/// that adds `down(SiLU(gate(x))·up(x))` into the output.
pub struct PooledMlp {
    w13: PackedBytes,
    down: Box<dyn LinearOp>,
    runner: PoolExperts,
    pool: Arc<WorkerPool>,
    isa: Isa,
    hidden: usize,
}

impl PooledMlp {
    /// `down` must be packed ([`LinearOp::packed`]) with K = `l13.rows / 2`.
    pub fn new(w13: PackedBytes, l13: PackedLayout, down: Box<dyn LinearOp>, pool: Arc<WorkerPool>) -> Option<Self> {
        let l2 = *down.packed()?.layout;
        (l2.k == l13.rows / 2 && l2.rows == l13.k).then(|| PooledMlp {
            runner: PoolExperts::new(&pool, l13, l2),
            hidden: l13.k,
            w13,
            down,
            pool,
            isa: isa::active(),
        })
    }

    pub fn weight_bytes(&self) -> usize {
        self.w13.as_slice().len() + self.down.weight_bytes()
    }

    pub fn intermediate(&self) -> usize {
        self.runner.w13_layout().rows / 2
    }

    /// `out[t, hidden] += down(SiLU(gate(x)) · up(x))`.
    pub fn forward_add(&self, x: &[f32], t: usize, out: &mut [f32]) {
        let tokens = Self::every_token(t);
        let job = ExpertJob { weights: self.expert_weights(), tokens: &tokens };
        self.runner.run(&self.pool, self.isa, x, self.hidden, &[job], out);
    }

    /// The job's token list: every one of `t` tokens at weight 1.
    pub fn every_token(t: usize) -> Vec<(usize, f32)> {
        (0..t).map(|i| (i, 1.0)).collect()
    }

    /// Its weights as one expert's ([`PoolExperts`] job weights, on pool node 0).
    pub fn expert_weights(&self) -> ExpertWeights<'_> {
        let w2 = self.down.packed().expect("checked in new").bytes;
        ExpertWeights { w13: self.w13.as_slice(), w2, node: 0 }
    }

    /// Its fused gate+up and down layouts.
    pub fn layouts(&self) -> (&PackedLayout, &PackedLayout) {
        (self.runner.w13_layout(), self.runner.w2_layout())
    }

    /// Whether it runs on `pool` with `isa` (so it may join another runner's dispatch there).
    pub fn runs_on(&self, pool: &WorkerPool, isa: Isa) -> bool {
        std::ptr::eq(pool, &*self.pool) && isa == self.isa
    }
}

#[cfg(test)]
#[path = "packed_ops_tests.rs"]
mod tests;
