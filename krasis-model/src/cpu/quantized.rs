//! Quantised CPU weights: the routed experts from the on-disk expert cache, and dense matrices
//! (`--cpu-dense-bits`) from the dense-weight cache ([`crate::cpu::dense_cache`]) or quantised at load. Both run through the same packed kernels over the
//! pinned worker pool.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};
use krasis_cache::{open_or_build, CacheHeader, CacheOutcome, DenseCache, ExpertCache, LayerParts, LoadOptions};
use krasis_cpu::isa::{self, Isa};
use krasis_cpu::moe::{ExpertJob, ExpertWeights, ExtraJobs, PoolExperts, PoolMatmul};
use krasis_cpu::pool::WorkerPool;
use krasis_quant::cpu_layout::{pack_into, pack_w13_into, PackedLayout, ROW_BLOCK};
use krasis_quant::fp4::{self, Fp4Kind, Fp4Matrix};
use krasis_quant::group::{group_size_for, quantize};
use krasis_quant::int4_asym::{self, ASYM_GROUP};
use krasis_quant::kquant::{self, KQuant, KQuantMatrix};
use krasis_quant::{Bits, QuantizedMatrix};
use rayon::prelude::*;

use crate::cpu::experts::{ExpertExecutor, Routes};
use crate::cpu::packed_ops::{PackedBytes, PooledMlp};
use crate::error::{ModelError, Result};
use crate::model::linear::{DenseLinear, LinearOp, PackedRef};
use crate::model::weights::WeightLoader;
use crate::placement::precision::{
    describe_kept, describe_layer_bits, ggml_kept, native_fp4, ExpertWidthRule, KeptPart, LayerBits, LayerKept,
};
use crate::source::files::ModelFiles;
use crate::spec::{FfnKind, ModelSpec};

/// Name of the packed layout stored in caches (bump when `krasis_quant::cpu_layout` changes).
pub const CPU_LAYOUT_NAME: &str = "cpu-rb16-v1";

/// Name of an expert cache whose records are the 4-bit float format `kind` as stored, in the FP4
/// CPU layout of `krasis_quant::fp4` (bump when it changes). Its header says 4 bits per
/// projection; this name says which format.
pub fn cpu_fp4_layout_name(kind: Fp4Kind) -> &'static str {
    match kind {
        Fp4Kind::Mxfp4 => "cpu-rb16-mxfp4-v1",
        Fp4Kind::Nvfp4 => "cpu-rb16-nvfp4-v1",
    }
}

/// `spec`'s routed experts, its hidden size and their width, which the fused gate+up layout needs
/// to be a multiple of 16 (an error naming the field otherwise).
fn routed_dims(spec: &ModelSpec) -> Result<(&crate::spec::MoeSpec, usize, usize)> {
    let moe = spec.moe.as_ref().ok_or_else(|| ModelError::Invalid("the model has no routed experts".into()))?;
    let (h, i) = (spec.hidden_size, moe.moe_intermediate_size);
    if !i.is_multiple_of(ROW_BLOCK) {
        return Err(ModelError::Invalid(format!(
            "moe_intermediate_size {i} is not a multiple of {ROW_BLOCK}: the fused gate+up layout needs that"
        )));
    }
    Ok((moe, h, i))
}

/// The 4-bit float format of an expert cache's records (from its layout name), `None` for the
/// INT4/INT8 layout.
pub fn cache_fp4(h: &CacheHeader) -> Option<Fp4Kind> {
    [Fp4Kind::Mxfp4, Fp4Kind::Nvfp4].into_iter().find(|&k| h.layout == cpu_fp4_layout_name(k))
}

/// The expert cache header of `spec`'s routed experts kept in the 4-bit float format `kind`
/// (every MoE layer; groups of `kind.group()` along both K).
pub fn expected_fp4_cache_header(spec: &ModelSpec, config_hash: u64, kind: Fp4Kind) -> Result<CacheHeader> {
    let (moe, h, i) = routed_dims(spec)?;
    let w13 = PackedLayout::new_fp4(2 * i, h, kind).map_err(|e| quant_err("hidden_size", e))?;
    let w2 = PackedLayout::new_fp4(h, i, kind).map_err(|e| quant_err("moe_intermediate_size", e))?;
    let shape =
        ExpertShape { hidden: h, inter: i, n_experts: moe.n_routed_experts, gs_h: kind.group(), gs_i: kind.group() };
    let moe_layers: Vec<u32> = spec.moe_layers().map(|l| l as u32).collect();
    let part = LayerParts { w13_bits: 4, w2_bits: 4, w13_bytes: w13.bytes() as u64, w2_bytes: w2.bytes() as u64 };
    let parts = vec![part; moe_layers.len()];
    Ok(shape.header(cpu_fp4_layout_name(kind), config_hash, moe_layers, parts))
}

/// Name of an expert cache whose records are asymmetric INT4 g32 (`krasis_quant::int4_asym`) in
/// its CPU layout (bump when it changes). Its header says 4 bits per projection and groups of 32;
/// this name says the records hold minimums.
pub const CPU_INT4_ASYM_LAYOUT_NAME: &str = "cpu-rb16-int4a-g32-v1";

/// Whether an expert cache's records are asymmetric INT4 g32 (from its layout name).
pub fn cache_int4_asym(h: &CacheHeader) -> bool {
    h.layout == CPU_INT4_ASYM_LAYOUT_NAME
}

/// The expert cache header of `spec`'s routed experts in asymmetric INT4 g32 (every MoE layer).
pub fn expected_int4_asym_cache_header(spec: &ModelSpec, config_hash: u64) -> Result<CacheHeader> {
    let (moe, h, i) = routed_dims(spec)?;
    let w13 = PackedLayout::new_int4_asym(2 * i, h).map_err(|e| quant_err("hidden_size", e))?;
    let w2 = PackedLayout::new_int4_asym(h, i).map_err(|e| quant_err("moe_intermediate_size", e))?;
    let shape =
        ExpertShape { hidden: h, inter: i, n_experts: moe.n_routed_experts, gs_h: ASYM_GROUP, gs_i: ASYM_GROUP };
    let moe_layers: Vec<u32> = spec.moe_layers().map(|l| l as u32).collect();
    let part = LayerParts { w13_bits: 4, w2_bits: 4, w13_bytes: w13.bytes() as u64, w2_bytes: w2.bytes() as u64 };
    let parts = vec![part; moe_layers.len()];
    Ok(shape.header(CPU_INT4_ASYM_LAYOUT_NAME, config_hash, moe_layers, parts))
}

/// Name of an expert cache whose records keep a GGUF's expert blocks as stored
/// ([`crate::placement::precision::ggml_kept`]): per layer and projection Q4_K or Q6_K in the
/// layout of `krasis_quant::kquant` (header width 4 or 6), or INT8 g32 in `cpu-rb16-v1`'s
/// (width 8). Bump when either changes.
pub const CPU_GGML_LAYOUT_NAME: &str = "cpu-rb16-ggml-v1";

/// File name of that cache.
pub const CPU_GGML_CACHE_FILE: &str = "experts_cpu_ggml.bin";

/// Group of the INT8 parts of a [`CPU_GGML_LAYOUT_NAME`] cache (ggml's 32-element blocks).
const GGML_INT8_GROUP: usize = 32;

/// Whether an expert cache's records keep GGUF blocks as stored (from its layout name).
pub fn cache_ggml(h: &CacheHeader) -> bool {
    h.layout == CPU_GGML_LAYOUT_NAME
}

/// The packed layout of one part of a [`CPU_GGML_LAYOUT_NAME`] record: `[rows, k]` as `part`.
fn ggml_part_layout(rows: usize, k: usize, part: KeptPart, what: &str) -> Result<PackedLayout> {
    match part {
        KeptPart::KQuant(kind) => PackedLayout::new_kquant(rows, k, kind).map_err(|e| quant_err(what, e)),
        KeptPart::Int8G32 { .. } => {
            PackedLayout::new(rows, k, GGML_INT8_GROUP, Bits::Int8).map_err(|e| quant_err(what, e))
        }
    }
}

/// The expert cache header of `spec`'s routed experts kept as `kept` (one entry per MoE layer).
pub fn expected_ggml_cache_header(spec: &ModelSpec, config_hash: u64, kept: &[LayerKept]) -> Result<CacheHeader> {
    let (moe, h, i) = routed_dims(spec)?;
    let moe_layers: Vec<u32> = spec.moe_layers().map(|l| l as u32).collect();
    if kept.len() != moe_layers.len() {
        return Err(ModelError::Invalid(format!("{} kept layers for {} MoE layers", kept.len(), moe_layers.len())));
    }
    let parts = kept
        .iter()
        .map(|k| {
            let w13 = ggml_part_layout(2 * i, h, k.w13, "w13")?;
            let w2 = ggml_part_layout(h, i, k.w2, "w2")?;
            Ok(LayerParts {
                w13_bits: k.w13.code(),
                w2_bits: k.w2.code(),
                w13_bytes: w13.bytes() as u64,
                w2_bytes: w2.bytes() as u64,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let shape = ExpertShape {
        hidden: h,
        inter: i,
        n_experts: moe.n_routed_experts,
        gs_h: GGML_INT8_GROUP,
        gs_i: GGML_INT8_GROUP,
    };
    Ok(shape.header(CPU_GGML_LAYOUT_NAME, config_hash, moe_layers, parts))
}

/// The kept parts of MoE layer `li` of a [`CPU_GGML_LAYOUT_NAME`] header.
fn ggml_parts(h: &CacheHeader, li: usize) -> Result<(KeptPart, KeptPart)> {
    let p = &h.parts[li];
    let part = |code: u8| {
        KeptPart::from_code(code).ok_or_else(|| {
            ModelError::Invalid(format!(
                "expert cache ({}): width {code} at layer {} (4: Q4_K, 6: Q6_K or 8: INT8 g32 expected)",
                h.layout, h.moe_layers[li]
            ))
        })
    };
    Ok((part(p.w13_bits)?, part(p.w2_bits)?))
}

pub use krasis_core::spec::WeightBits;

/// The packed-kernel format of a `--cpu-dense-bits` value (`None` for the unquantised source
/// weights); `auto` is for routed experts only.
pub fn dense_quant_bits(w: WeightBits) -> Result<Option<Bits>> {
    match w {
        WeightBits::Bf16 => Ok(None),
        WeightBits::Int8 => Ok(Some(Bits::Int8)),
        WeightBits::Int4 => Ok(Some(Bits::Int4)),
        WeightBits::Int4Asym => Err(ModelError::Invalid(
            "dense weights take bf16, 8 or 4; asymmetric INT4 (`4a`) applies to routed experts only".into(),
        )),
        WeightBits::Auto => {
            Err(ModelError::Invalid("dense weights take bf16, 8 or 4; `auto` applies to routed experts only".into()))
        }
    }
}

pub(crate) fn quant_err(what: &str, e: impl std::fmt::Display) -> ModelError {
    ModelError::Invalid(format!("{what}: {e}"))
}

/// Rows of `m` converted to f32, in parallel.
fn rows_f32(m: &DenseLinear) -> Vec<f32> {
    let k = m.in_dim();
    let mut out = vec![0f32; m.out_dim() * k];
    out.par_chunks_mut(k).enumerate().for_each(|(r, row)| m.row_into(r, row));
    out
}

/// A dense matrix in the packed CPU layout: quantised at load, or a dense-weight cache entry.
pub struct QuantLinear {
    layout: PackedLayout,
    packed: PackedBytes,
    pool: Arc<WorkerPool>,
    matmul: PoolMatmul,
    isa: Isa,
}

/// Rows quantised and packed per task (whole row blocks, so chunks concatenate to the full pack).
const QUANTIZE_ROWS_PER_TASK: usize = 64 * ROW_BLOCK;

/// `m` quantised and packed for `layout`. Rows are converted, quantised and packed per task, so
/// the f32 copy in memory at once is a few tasks' rows, never the whole matrix.
pub fn pack_dense(m: &DenseLinear, layout: &PackedLayout) -> Vec<u8> {
    let (rows, k) = (layout.rows, layout.k);
    let mut packed = vec![0u8; layout.bytes()];
    let chunk_bytes = QUANTIZE_ROWS_PER_TASK / ROW_BLOCK * layout.block_bytes();
    packed.par_chunks_mut(chunk_bytes).enumerate().for_each(|(ci, out)| {
        let r0 = ci * QUANTIZE_ROWS_PER_TASK;
        let n = QUANTIZE_ROWS_PER_TASK.min(rows - r0);
        let mut w = vec![0f32; n * k];
        for (r, row) in w.chunks_exact_mut(k).enumerate() {
            m.row_into(r0 + r, row);
        }
        pack_into(&quantize(&w, n, k, layout.bits, layout.gs), out).expect("chunk sized from the layout");
    });
    packed
}

/// The packed layout of a `[rows, k]` dense matrix at `bits` and preferred group `group`.
pub fn dense_layout(rows: usize, k: usize, bits: Bits, group: usize, name: &str) -> Result<PackedLayout> {
    let gs = group_size_for(k, group).map_err(|e| quant_err(name, e))?;
    PackedLayout::new(rows, k, gs, bits).map_err(|e| quant_err(name, e))
}

impl QuantLinear {
    pub fn from_dense(m: &DenseLinear, bits: Bits, group: usize, pool: Arc<WorkerPool>, name: &str) -> Result<Self> {
        let layout = dense_layout(m.out_dim(), m.in_dim(), bits, group, name)?;
        let packed = PackedBytes::Owned(pack_dense(m, &layout));
        Ok(QuantLinear { matmul: PoolMatmul::new(&pool), layout, packed, pool, isa: isa::active() })
    }

    /// Entry `index` of a loaded dense-weight cache, without a copy; its size must be `layout`'s.
    pub fn from_cache(
        cache: Arc<DenseCache>,
        index: usize,
        layout: PackedLayout,
        pool: Arc<WorkerPool>,
    ) -> Result<Self> {
        let (found, name) = (cache.entry(index).len(), &cache.header().entries[index].name);
        if found != layout.bytes() {
            return Err(ModelError::Invalid(format!(
                "dense-weight cache {}: `{name}` holds {found} bytes, its layout needs {}",
                cache.path().display(),
                layout.bytes()
            )));
        }
        let packed = PackedBytes::Cached { cache, index };
        Ok(QuantLinear { matmul: PoolMatmul::new(&pool), layout, packed, pool, isa: isa::active() })
    }

    /// Packed bytes already in `layout`'s form (e.g. one half of a fused w13).
    pub fn from_packed(packed: PackedBytes, layout: PackedLayout, pool: Arc<WorkerPool>) -> Self {
        assert_eq!(packed.as_slice().len(), layout.bytes(), "QuantLinear::from_packed: size");
        QuantLinear { matmul: PoolMatmul::new(&pool), layout, packed, pool, isa: isa::active() }
    }

    fn bytes(&self) -> &[u8] {
        self.packed.as_slice()
    }
}

impl LinearOp for QuantLinear {
    fn in_dim(&self) -> usize {
        self.layout.k
    }

    fn out_dim(&self) -> usize {
        self.layout.rows
    }

    fn forward(&self, x: &[f32], m: usize, y: &mut [f32]) {
        self.matmul.run(&self.pool, self.isa, self.bytes(), &self.layout, x, m, y);
    }

    fn weight_bytes(&self) -> usize {
        self.bytes().len()
    }

    fn packed(&self) -> Option<PackedRef<'_>> {
        Some(PackedRef {
            bytes: self.bytes(),
            layout: &self.layout,
            pool: &self.pool,
            matmul: &self.matmul,
            isa: self.isa,
        })
    }
}

/// What the expert cache must contain for this model at these per-layer widths (one entry per
/// MoE layer, in order).
pub fn expected_cache_header(
    spec: &ModelSpec,
    config_hash: u64,
    bits: &[LayerBits],
    group: usize,
) -> Result<CacheHeader> {
    routed_dims(spec)?;
    let shape = expert_shape(spec, group)?;
    let ExpertShape { hidden: h, inter: i, gs_h, gs_i, .. } = shape;
    let moe_layers: Vec<u32> = spec.moe_layers().map(|l| l as u32).collect();
    if bits.len() != moe_layers.len() {
        return Err(ModelError::Invalid(format!("{} expert widths for {} MoE layers", bits.len(), moe_layers.len())));
    }
    let parts = bits
        .iter()
        .map(|b| {
            let w13 = PackedLayout::new(2 * i, h, gs_h, b.w13).map_err(|e| quant_err("w13", e))?;
            let w2 = PackedLayout::new(h, i, gs_i, b.w2).map_err(|e| quant_err("w2", e))?;
            Ok(LayerParts {
                w13_bits: b.w13.bits() as u8,
                w2_bits: b.w2.bits() as u8,
                w13_bytes: w13.bytes() as u64,
                w2_bytes: w2.bytes() as u64,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(shape.header(CPU_LAYOUT_NAME, config_hash, moe_layers, parts))
}

/// The routed experts' sizes and group sizes along K, as both expert caches quantise them.
#[derive(Clone, Copy)]
pub(crate) struct ExpertShape {
    pub hidden: usize,
    pub inter: usize,
    pub n_experts: usize,
    pub gs_h: usize,
    pub gs_i: usize,
}

/// The expert shape of `spec` at preferred group `group` (halved to fit K).
pub(crate) fn expert_shape(spec: &ModelSpec, group: usize) -> Result<ExpertShape> {
    let moe = spec.moe.as_ref().ok_or_else(|| ModelError::Invalid("the model has no routed experts".into()))?;
    let (hidden, inter) = (spec.hidden_size, moe.moe_intermediate_size);
    // Experts stored group-quantised (compressed-tensors INT4) keep their groups: the stored
    // INT4 then goes into the caches as it is, and a wider width uses the same groups.
    let group = spec.source_quant.stored_int4_group().unwrap_or(group);
    let gs_h = group_size_for(hidden, group).map_err(|e| quant_err("hidden_size", e))?;
    let gs_i = group_size_for(inter, group).map_err(|e| quant_err("moe_intermediate_size", e))?;
    Ok(ExpertShape { hidden, inter, n_experts: moe.n_routed_experts, gs_h, gs_i })
}

impl ExpertShape {
    /// An expert cache header of these experts: `layout`'s records, `parts` per MoE layer.
    pub(crate) fn header(
        &self,
        layout: &str,
        config_hash: u64,
        moe_layers: Vec<u32>,
        parts: Vec<LayerParts>,
    ) -> CacheHeader {
        CacheHeader {
            format_version: krasis_cache::FORMAT_VERSION,
            layout: layout.into(),
            config_hash,
            group_size_hidden: self.gs_h as u32,
            group_size_intermediate: self.gs_i as u32,
            hidden: self.hidden as u32,
            intermediate: self.inter as u32,
            n_experts: self.n_experts as u32,
            moe_layers,
            parts,
        }
    }
}

/// The widths of MoE layer `li` of a cache header.
pub(crate) fn parts_bits(h: &CacheHeader, li: usize) -> Result<LayerBits> {
    if cache_ggml(h) {
        let (a, b) = ggml_parts(h, li)?;
        return Ok(LayerBits { w13: a.bits(), w2: b.bits() });
    }
    let p = &h.parts[li];
    let bits = |b: u8| {
        Bits::from_bits(b as u32).ok_or_else(|| {
            ModelError::Invalid(format!(
                "expert cache: {b}-bit weights at layer {} (4 or 8 expected)",
                h.moe_layers[li]
            ))
        })
    };
    Ok(LayerBits { w13: bits(p.w13_bits)?, w2: bits(p.w2_bits)? })
}

/// The packed layouts of MoE layer `li`'s w13 and w2.
fn layouts(h: &CacheHeader, li: usize) -> Result<(PackedLayout, PackedLayout)> {
    let (hid, i) = (h.hidden as usize, h.intermediate as usize);
    if let Some(kind) = cache_fp4(h) {
        let l13 = PackedLayout::new_fp4(2 * i, hid, kind).map_err(|e| quant_err("w13", e))?;
        let l2 = PackedLayout::new_fp4(hid, i, kind).map_err(|e| quant_err("w2", e))?;
        return Ok((l13, l2));
    }
    if cache_ggml(h) {
        let (a, b) = ggml_parts(h, li)?;
        return Ok((ggml_part_layout(2 * i, hid, a, "w13")?, ggml_part_layout(hid, i, b, "w2")?));
    }
    if cache_int4_asym(h) {
        let l13 = PackedLayout::new_int4_asym(2 * i, hid).map_err(|e| quant_err("w13", e))?;
        let l2 = PackedLayout::new_int4_asym(hid, i).map_err(|e| quant_err("w2", e))?;
        return Ok((l13, l2));
    }
    let b = parts_bits(h, li)?;
    let l13 = PackedLayout::new(2 * i, hid, h.group_size_hidden as usize, b.w13).map_err(|e| quant_err("w13", e))?;
    let l2 = PackedLayout::new(hid, i, h.group_size_intermediate as usize, b.w2).map_err(|e| quant_err("w2", e))?;
    Ok((l13, l2))
}

/// Expert `e` of model layer `layer` as f32: gate and up `[i, hidden]`, down `[hidden, i]`, and
/// its tensor prefix (for messages).
pub(crate) fn expert_f32(
    loader: &WeightLoader<'_>,
    spec: &ModelSpec,
    layer: usize,
    e: usize,
    i: usize,
) -> Result<([Vec<f32>; 3], String)> {
    let hid = spec.hidden_size;
    let t = crate::model::tensors::expert_tensors(spec, layer, e);
    let gate = rows_f32(&loader.matrix(&t.gate.name, i, hid)?);
    let up = rows_f32(&loader.matrix(&t.up.name, i, hid)?);
    let down = rows_f32(&loader.matrix(&t.down.name, hid, i)?);
    Ok(([gate, up, down], format!("{}.{e}", crate::model::tensors::experts_prefix(spec, layer))))
}

/// One routed expert as the expert caches read it: on a compressed-tensors INT4 source its
/// stored INT4 groups ([`WeightLoader::stored_int4`]), and its f32 values, read only when a
/// projection is not kept as stored.
pub(crate) struct ExpertSource<'a> {
    loader: &'a WeightLoader<'a>,
    spec: &'a ModelSpec,
    layer: usize,
    e: usize,
    inter: usize,
    /// Gate, up and down as stored INT4 (each `None` when stored otherwise).
    stored: [Option<QuantizedMatrix>; 3],
    f32: std::cell::OnceCell<[Vec<f32>; 3]>,
    /// The expert's tensor prefix, for messages.
    pub what: String,
    /// The names of its gate, up and down tensors.
    pub names: [String; 3],
}

impl<'a> ExpertSource<'a> {
    /// Expert `e` of model layer `layer` (intermediate size `inter`).
    pub(crate) fn read(
        loader: &'a WeightLoader<'a>,
        spec: &'a ModelSpec,
        layer: usize,
        e: usize,
        inter: usize,
    ) -> Result<Self> {
        let what = format!("{}.{e}", crate::model::tensors::experts_prefix(spec, layer));
        let t = crate::model::tensors::expert_tensors(spec, layer, e);
        let hid = spec.hidden_size;
        let stored = [
            loader.stored_int4(&t.gate.name, inter, hid)?,
            loader.stored_int4(&t.up.name, inter, hid)?,
            loader.stored_int4(&t.down.name, hid, inter)?,
        ];
        let names = [t.gate.name, t.up.name, t.down.name];
        Ok(ExpertSource { loader, spec, layer, e, inter, stored, f32: Default::default(), what, names })
    }

    fn f32(&self) -> Result<&[Vec<f32>; 3]> {
        if let Some(f) = self.f32.get() {
            return Ok(f);
        }
        let (f, _) = expert_f32(self.loader, self.spec, self.layer, self.e, self.inter)?;
        Ok(self.f32.get_or_init(|| f))
    }

    /// Gate, up and down at `w13` / `w2` bits in the groups of `h`: a projection stored as INT4
    /// in exactly those groups is kept as stored (codes and scales unchanged, no
    /// requantisation); every other one is quantised from its f32 values.
    pub(crate) fn quantized(&self, h: &CacheHeader, w13: Bits, w2: Bits) -> Result<[QuantizedMatrix; 3]> {
        let (hid, i) = (h.hidden as usize, h.intermediate as usize);
        let (gs_h, gs_i) = (h.group_size_hidden as usize, h.group_size_intermediate as usize);
        let want = [(i, hid, w13, gs_h), (i, hid, w13, gs_h), (hid, i, w2, gs_i)];
        let mut out = Vec::with_capacity(3);
        for (j, &(rows, k, bits, gs)) in want.iter().enumerate() {
            match &self.stored[j] {
                Some(m) if m.bits == bits && m.gs == gs && m.rows == rows && m.k == k => out.push(m.clone()),
                _ => out.push(quantize(&self.f32()?[j], rows, k, bits, gs)),
            }
        }
        Ok(out.try_into().expect("three projections"))
    }
}

/// A CPU expert cache record of MoE layer `li` (`w13` then `w2`, at the layer's widths) from the
/// quantised gate, up and down.
pub(crate) fn cpu_record(h: &CacheHeader, li: usize, q: &[QuantizedMatrix; 3], what: &str) -> Result<Vec<u8>> {
    record_of_parts(h, li, |a, b| {
        pack_w13_into(&q[0], &q[1], a).map_err(|e| quant_err(what, e))?;
        pack_into(&q[2], b).map_err(|e| quant_err(what, e))
    })
}

/// A record of MoE layer `li` of the cache `h`: zeroed to the layer's `w13` and `w2` part sizes,
/// then each part filled by `fill(w13, w2)` (what it returns besides success is dropped: the
/// packers return the layout they wrote).
fn record_of_parts<T>(
    h: &CacheHeader,
    li: usize,
    fill: impl FnOnce(&mut [u8], &mut [u8]) -> Result<T>,
) -> Result<Vec<u8>> {
    let parts = h.parts[li];
    let mut rec = vec![0u8; (parts.w13_bytes + parts.w2_bytes) as usize];
    let (a, b) = rec.split_at_mut(parts.w13_bytes as usize);
    fill(a, b)?;
    Ok(rec)
}

/// Quantise and pack one expert of MoE layer `li` (model layer `layer`) into a cache record
/// (`w13` then `w2`, at the layer's widths).
fn expert_record(
    loader: &WeightLoader<'_>,
    spec: &ModelSpec,
    h: &CacheHeader,
    li: usize,
    layer: usize,
    e: usize,
    underflow: &crate::cpu::underflow::UnderflowLog,
) -> Result<Vec<u8>> {
    if let Some(kind) = cache_fp4(h) {
        return fp4_expert_record(loader, spec, h, li, layer, e, kind);
    }
    if cache_int4_asym(h) {
        return int4_asym_expert_record(loader, spec, h, li, layer, e);
    }
    if cache_ggml(h) {
        return ggml_expert_record(loader, spec, h, li, layer, e);
    }
    let bits = parts_bits(h, li)?;
    let x = ExpertSource::read(loader, spec, layer, e, h.intermediate as usize)?;
    let q = x.quantized(h, bits.w13, bits.w2)?;
    underflow.record_expert(li, e, &x.names, &q);
    cpu_record(h, li, &q, &x.what)
}

/// Expert `e` of model layer `layer` (`(hidden, inter)`) as stored in the 4-bit float format
/// `kind`: its gate, up and down, and its tensor prefix (for messages). A projection not stored in
/// that format is an error naming it.
pub(crate) fn stored_fp4_expert(
    loader: &WeightLoader<'_>,
    spec: &ModelSpec,
    layer: usize,
    e: usize,
    (hid, i): (usize, usize),
    kind: Fp4Kind,
) -> Result<([Fp4Matrix; 3], String)> {
    let t = crate::model::tensors::expert_tensors(spec, layer, e);
    let stored = |name: &str, rows: usize, cols: usize| -> Result<Fp4Matrix> {
        let m = loader.stored_fp4(name, rows, cols)?;
        m.filter(|m| m.kind == kind).ok_or_else(|| {
            ModelError::Invalid(format!(
                "routed expert `{name}` is not stored as {kind}: the expert cache keeps {kind} experts as stored only \
                 when every routed expert is (run the experts at width 4 or 8 to requantise, or bf16)"
            ))
        })
    };
    let (gate, up, down) = (stored(&t.gate.name, i, hid)?, stored(&t.up.name, i, hid)?, stored(&t.down.name, hid, i)?);
    Ok(([gate, up, down], format!("{}.{e}", crate::model::tensors::experts_prefix(spec, layer))))
}

/// One expert of MoE layer `li` (model layer `layer`) kept in the 4-bit float format `kind` as
/// stored: its gate, up and down blocks packed in the FP4 CPU layout (bytes reordered, never
/// requantised). A projection not stored in that format is an error naming it.
fn fp4_expert_record(
    loader: &WeightLoader<'_>,
    spec: &ModelSpec,
    h: &CacheHeader,
    li: usize,
    layer: usize,
    e: usize,
    kind: Fp4Kind,
) -> Result<Vec<u8>> {
    let (hid, i) = (h.hidden as usize, h.intermediate as usize);
    let ([gate, up, down], what) = stored_fp4_expert(loader, spec, layer, e, (hid, i), kind)?;
    record_of_parts(h, li, |a, b| {
        fp4::pack_w13_into(&gate, &up, a).map_err(|e| quant_err(&what, e))?;
        fp4::pack_into(&down, b).map_err(|e| quant_err(&what, e))
    })
}

/// One expert of MoE layer `li` (model layer `layer`) quantised to asymmetric INT4 g32 from its
/// f32 values (`krasis_quant::int4_asym::quantize`) and packed in its CPU layout.
fn int4_asym_expert_record(
    loader: &WeightLoader<'_>,
    spec: &ModelSpec,
    h: &CacheHeader,
    li: usize,
    layer: usize,
    e: usize,
) -> Result<Vec<u8>> {
    let (hid, i) = (h.hidden as usize, h.intermediate as usize);
    let x = ExpertSource::read(loader, spec, layer, e, i)?;
    let [gate, up, down] = x.f32()?;
    let q = |w: &[f32], rows: usize, k: usize| int4_asym::quantize(w, rows, k).map_err(|err| quant_err(&x.what, err));
    let (gate, up, down) = (q(gate, i, hid)?, q(up, i, hid)?, q(down, hid, i)?);
    record_of_parts(h, li, |a, b| {
        int4_asym::pack_w13_into(&gate, &up, a).map_err(|err| quant_err(&x.what, err))?;
        int4_asym::pack_into(&down, b).map_err(|err| quant_err(&x.what, err))
    })
}

/// One expert of MoE layer `li` (model layer `layer`) with its GGUF blocks kept
/// ([`ggml_kept`]): Q4_K / Q6_K blocks packed as stored, Q5_0 / Q8_0 as INT8 g32 of the same
/// values, a w13 of two different K-quants requantised to INT8 g32 from the exact values. A
/// projection stored otherwise than the plan says, or whose blocks disagree with its shape, is an
/// error naming the tensor.
fn ggml_expert_record(
    loader: &WeightLoader<'_>,
    spec: &ModelSpec,
    h: &CacheHeader,
    li: usize,
    layer: usize,
    e: usize,
) -> Result<Vec<u8>> {
    let (hid, i) = (h.hidden as usize, h.intermediate as usize);
    let kept = ggml_kept(spec).and_then(|k| k.get(li).copied()).ok_or_else(|| {
        ModelError::Invalid(format!("expert cache {CPU_GGML_LAYOUT_NAME}: layer {layer} is not kept"))
    })?;
    let x = ExpertSource::read(loader, spec, layer, e, i)?;
    let shapes = [(i, hid), (i, hid), (hid, i)];
    let blocks = |j: usize| -> Result<(krasis_quant::ggml::GgmlType, crate::source::SharedBytes)> {
        let name = &x.names[j];
        let found = loader.source.ggml_blocks(name)?;
        match found {
            Some((ty, b)) if ty == kept.types[j] => Ok((ty, b)),
            other => Err(ModelError::Invalid(format!(
                "routed expert `{name}` in {}: stored as {}, the expert cache plan says {}",
                loader.source.location().display(),
                other.map_or("floats".to_string(), |(t, _)| t.to_string()),
                kept.types[j]
            ))),
        }
    };
    let bad = |j: usize, err: &dyn std::fmt::Display| {
        ModelError::Invalid(format!("routed expert `{}` in {}: {err}", x.names[j], loader.source.location().display()))
    };
    let kmatrix = |j: usize, kind: KQuant| -> Result<KQuantMatrix> {
        let (_, b) = blocks(j)?;
        let (rows, k) = shapes[j];
        KQuantMatrix::from_ggml(kind, b.as_slice(), rows, k).map_err(|err| bad(j, &err))
    };
    let int8 = |j: usize, exact: bool| -> Result<QuantizedMatrix> {
        let (rows, k) = shapes[j];
        if !exact {
            return Ok(quantize(&x.f32()?[j], rows, k, Bits::Int8, GGML_INT8_GROUP));
        }
        let (ty, b) = blocks(j)?;
        kquant::ggml_int8_g32(ty, b.as_slice(), rows, k).map_err(|err| bad(j, &err))
    };
    record_of_parts(h, li, |a, b| {
        match kept.w13 {
            KeptPart::KQuant(kind) => {
                kquant::pack_w13_into(&kmatrix(0, kind)?, &kmatrix(1, kind)?, a)
                    .map_err(|err| quant_err(&x.what, err))?;
            }
            KeptPart::Int8G32 { exact } => {
                pack_w13_into(&int8(0, exact)?, &int8(1, exact)?, a).map_err(|err| quant_err(&x.what, err))?;
            }
        }
        match kept.w2 {
            KeptPart::KQuant(kind) => {
                kquant::pack_into(&kmatrix(2, kind)?, b).map_err(|err| quant_err(&x.what, err))?;
            }
            KeptPart::Int8G32 { exact } => {
                pack_into(&int8(2, exact)?, b).map_err(|err| quant_err(&x.what, err))?;
            }
        }
        Ok(())
    })
}

/// Appended to errors that another cache directory would cure.
pub(crate) const CACHE_DIR_HINT: &str = "; choose a writable cache directory (`EngineOptions::cache_dir`)";

/// Shows an expert cache build's progress on `bar`: bytes written, rate and layers done.
pub(crate) fn show_build(bar: &ProgressBar, p: krasis_cache::BuildProgress) {
    bar.set_length(p.bytes_total);
    bar.set_position(p.bytes_done);
    bar.set_message(format!("{:.2} GB/s, layer {}/{}", p.gb_per_s, p.layers_done, p.layers_total));
}

/// A cache error as the model's, with [`CACHE_DIR_HINT`] where another directory would cure it.
pub(crate) fn cache_error(e: krasis_cache::CacheError) -> ModelError {
    let hint = if e.is_location() { CACHE_DIR_HINT } else { "" };
    ModelError::Invalid(format!("{e}{hint}"))
}

/// A byte-counting progress bar (drawn on stderr, hidden when it is not a terminal).
pub(crate) fn progress_bar(template: &str) -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar
}

/// Where the cache of these per-layer widths lives: named by its width when all projections
/// share one (so `auto` on an all-Q8_0 GGUF and `8` share a cache), `…_mixed_…` otherwise.
pub fn cache_path(files: &ModelFiles, cache_dir: Option<&Path>, bits: &[LayerBits], group: usize) -> PathBuf {
    let uniform = bits.first().map(|b| b.w13).filter(|&b| bits.iter().all(|l| *l == LayerBits::uniform(b)));
    in_cache_dir(files, cache_dir, &krasis_cache::cache_file_name(uniform.map(|b| b.bits() as u8), group as u32))
}

/// `name` in `--cache-dir`, else in the model's default cache directory.
pub(crate) fn in_cache_dir(files: &ModelFiles, cache_dir: Option<&Path>, name: &str) -> PathBuf {
    cache_dir.map(Path::to_path_buf).unwrap_or_else(|| files.default_cache_dir()).join(name)
}

/// Open the expert cache, building it (with a progress bar) when missing, stale or damaged.
/// The widths per layer come from `bits` ([`crate::placement::precision`]); the cache is keyed by
/// [`ModelFiles::fingerprint`].
pub fn open_expert_cache(
    files: &ModelFiles,
    bits: ExpertWidthRule,
    group: usize,
    cache_dir: Option<&Path>,
    pool: &WorkerPool,
) -> Result<(ExpertCache, CacheOutcome)> {
    if let (ExpertWidthRule::Auto, Some(kind)) = (bits, native_fp4(files.spec())) {
        let header = expected_fp4_cache_header(files.spec(), files.fingerprint(), kind)?;
        let name = format!("experts_cpu_{kind}_g{}.bin", kind.group());
        return open_with_header(files, header, in_cache_dir(files, cache_dir, &name), pool);
    }
    if let (ExpertWidthRule::Auto, Some(kept)) = (bits, ggml_kept(files.spec())) {
        let header = expected_ggml_cache_header(files.spec(), files.fingerprint(), &kept)?;
        return open_with_header(files, header, in_cache_dir(files, cache_dir, CPU_GGML_CACHE_FILE), pool);
    }
    if bits == ExpertWidthRule::Int4Asym {
        let header = expected_int4_asym_cache_header(files.spec(), files.fingerprint())?;
        let name = format!("experts_cpu_int4a_g{ASYM_GROUP}.bin");
        return open_with_header(files, header, in_cache_dir(files, cache_dir, &name), pool);
    }
    open_expert_cache_with(files, &bits.layer_bits(files.spec()), group, cache_dir, pool)
}

/// [`open_expert_cache`] at the given widths of each MoE layer (in order).
pub fn open_expert_cache_with(
    files: &ModelFiles,
    layer_bits: &[LayerBits],
    group: usize,
    cache_dir: Option<&Path>,
    pool: &WorkerPool,
) -> Result<(ExpertCache, CacheOutcome)> {
    let header = expected_cache_header(files.spec(), files.fingerprint(), layer_bits, group)?;
    open_with_header(files, header, cache_path(files, cache_dir, layer_bits, group), pool)
}

/// Open the expert cache at `path`, building it to `header` when missing, stale or damaged.
fn open_with_header(
    files: &ModelFiles,
    header: CacheHeader,
    path: PathBuf,
    pool: &WorkerPool,
) -> Result<(ExpertCache, CacheOutcome)> {
    let spec = files.spec();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| {
            ModelError::Invalid(format!(
                "cannot create the expert cache directory {}: {e}{CACHE_DIR_HINT}",
                dir.display()
            ))
        })?;
    }
    let loader = WeightLoader::new(files.weights(), &spec.source_quant);
    let layers = header.moe_layers.clone();
    let underflow = crate::cpu::underflow::UnderflowLog::new();
    let produce = |li: usize, e: usize| -> std::result::Result<Vec<u8>, String> {
        expert_record(&loader, spec, &header, li, layers[li] as usize, e, &underflow).map_err(|err| err.to_string())
    };
    let bar = progress_bar("converting experts {bar:40} {bytes}/{total_bytes} {msg} eta {eta}");
    let progress = |p| show_build(&bar, p);
    let nodes = pool.nodes();
    let placement = |_li: usize, e: usize| -> Option<usize> { (nodes > 1).then(|| pool.os_node(e % nodes)) };
    let load = LoadOptions { placement: Some(&placement), ..LoadOptions::default() };
    let r = open_or_build(&path, &header, &produce, &progress, load).map_err(cache_error);
    bar.finish_and_clear();
    underflow.warn("the CPU expert cache");
    r
}

/// Routed experts from the cache, on the pinned pool (INT4/INT8, per projection and layer as the
/// cache header says).
pub struct CpuQuantExperts {
    cache: ExpertCache,
    pool: Arc<WorkerPool>,
    /// One runner per distinct (w13, w2) layout pair of the cache's layers (a few).
    runners: Vec<PoolExperts>,
    /// Per MoE layer index: its runner in `runners`.
    runner_of: Vec<usize>,
    /// Model layer → index into the cache's MoE layers.
    moe_index: Vec<Option<usize>>,
    hidden: usize,
    isa: Isa,
    bits: Vec<LayerBits>,
    /// A step's (token, weight) pairs grouped by expert (counting sort), reused across calls so a
    /// decode step allocates nothing but the job list.
    grouping: std::sync::Mutex<RouteGrouping>,
    /// The model's experts carry biases ([`ModelSpec::expert_bias`]): calls need `biases`.
    biased: bool,
    /// Per MoE layer index, per expert: `[gate | up]` biases (`2 · inter`) and the down bias
    /// (`hidden`), once [`CpuQuantExperts::load_biases`] has read them.
    biases: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
}

/// Counting-sort buffers: `pairs[offsets[e]..offsets[e + 1]]` are expert `e`'s (token, weight).
#[derive(Default)]
struct RouteGrouping {
    offsets: Vec<usize>,
    next: Vec<usize>,
    pairs: Vec<(usize, f32)>,
}

impl RouteGrouping {
    fn group(&mut self, n_experts: usize, t: usize, routes: &Routes) {
        let o = &mut self.offsets;
        o.clear();
        o.resize(n_experts + 1, 0);
        // Ids past the layer's experts (routes computed elsewhere) are left out.
        for &e in &routes.ids[..t * routes.k] {
            if e < n_experts {
                o[e + 1] += 1;
            }
        }
        for e in 0..n_experts {
            o[e + 1] += o[e];
        }
        self.pairs.clear();
        self.pairs.resize(o[n_experts], (0, 0.0));
        self.next.clear();
        self.next.extend_from_slice(&o[..n_experts]);
        // Stable: each expert's pairs stay in (token, slot) order, as the reference groups them.
        for s in 0..t * routes.k {
            let e = routes.ids[s];
            if e >= n_experts {
                continue;
            }
            self.pairs[self.next[e]] = (s / routes.k, routes.weights[s]);
            self.next[e] += 1;
        }
    }
}

impl CpuQuantExperts {
    pub fn new(cache: ExpertCache, spec: &ModelSpec, pool: Arc<WorkerPool>) -> Result<Self> {
        let h = cache.header().clone();
        let mut bits = Vec::with_capacity(h.moe_layers.len());
        let (mut runners, mut runner_of) = (Vec::new(), Vec::new());
        let mut kinds = Vec::<(PackedLayout, PackedLayout)>::new();
        for li in 0..h.moe_layers.len() {
            bits.push(parts_bits(&h, li)?);
            let lay = layouts(&h, li)?;
            let k = match kinds.iter().position(|k| *k == lay) {
                Some(k) => k,
                None => {
                    runners.push(PoolExperts::new(&pool, lay.0, lay.1).with_activation(spec.expert_activation));
                    kinds.push(lay);
                    kinds.len() - 1
                }
            };
            runner_of.push(k);
        }
        let mut moe_index = vec![None; spec.num_layers];
        for (li, &l) in h.moe_layers.iter().enumerate() {
            moe_index[l as usize] = Some(li);
        }
        debug_assert!(spec.layers.iter().enumerate().all(|(l, k)| matches!(k, FfnKind::Moe) == moe_index[l].is_some()));
        Ok(CpuQuantExperts {
            runners,
            runner_of,
            cache,
            pool,
            moe_index,
            hidden: spec.hidden_size,
            isa: isa::active(),
            bits,
            grouping: Default::default(),
            biased: spec.expert_bias,
            biases: Vec::new(),
        })
    }

    /// Reads every routed expert's gate, up and down biases from `files` (a model whose experts
    /// have them, [`ModelSpec::expert_bias`]; the cache holds the weights only). Nothing for
    /// other models.
    pub fn load_biases(&mut self, files: &ModelFiles) -> Result<()> {
        let spec = files.spec();
        if !spec.expert_bias {
            return Ok(());
        }
        let loader = WeightLoader::new(files.weights(), &spec.source_quant);
        let tensors = crate::model::tensors::model_tensors(spec);
        self.biases = spec
            .moe_layers()
            .map(|l| match &tensors.layers[l].ffn {
                crate::model::tensors::FfnTensors::Moe { experts, .. } => experts
                    .iter()
                    .map(|m| {
                        let [g, u, d] = m.bias.as_ref().expect("a model with expert biases names them");
                        let mut gu = loader.vector_of(g)?;
                        gu.extend(loader.vector_of(u)?);
                        Ok((gu, loader.vector_of(d)?))
                    })
                    .collect::<Result<Vec<_>>>(),
                crate::model::tensors::FfnTensors::Dense(_) => unreachable!("moe_layers are MoE"),
            })
            .collect::<Result<_>>()?;
        Ok(())
    }

    pub fn cache(&self) -> &ExpertCache {
        &self.cache
    }

    /// Bytes of one expert record (w13 + w2) read per activation: the mean over MoE layers
    /// when their widths differ.
    pub fn expert_bytes(&self) -> u64 {
        let parts = &self.cache.header().parts;
        parts.iter().map(|p| p.w13_bytes + p.w2_bytes).sum::<u64>() / parts.len().max(1) as u64
    }

    /// Expert `e` of MoE layer index `li` and the pool node its jobs run on.
    fn weights(&self, li: usize, e: usize) -> ExpertWeights<'_> {
        ExpertWeights { w13: self.cache.w13(li, e), w2: self.cache.w2(li, e), node: e % self.pool.nodes() }
    }

    /// One job per expert that `routes` sends tokens to, in expert order (grouped in `g`).
    fn routed_jobs<'a>(&'a self, li: usize, t: usize, routes: &Routes, g: &'a mut RouteGrouping) -> Vec<ExpertJob<'a>> {
        let n = self.cache.header().n_experts as usize;
        g.group(n, t, routes);
        let g = &*g;
        (0..n)
            .filter(|&e| g.offsets[e + 1] > g.offsets[e])
            .map(|e| ExpertJob { weights: self.weights(li, e), tokens: &g.pairs[g.offsets[e]..g.offsets[e + 1]] })
            .collect()
    }

    /// The CPU record geometry of MoE layer `li` (its w13 and w2 packed layouts).
    pub fn record_layouts(&self, li: usize) -> Result<(PackedLayout, PackedLayout)> {
        layouts(self.cache.header(), li)
    }

    /// The widths of each MoE layer, in order (4 for the 4-bit float formats, see
    /// [`CpuQuantExperts::fp4`]).
    pub fn layer_bits(&self) -> &[LayerBits] {
        &self.bits
    }

    /// Whether the records keep a GGUF's blocks as stored ([`CPU_GGML_LAYOUT_NAME`]).
    pub fn ggml_kept(&self) -> bool {
        cache_ggml(self.cache.header())
    }

    /// The kept parts per layer, as [`describe_kept`] words them.
    fn ggml_description(&self) -> String {
        let h = self.cache.header();
        let parts: Vec<(KeptPart, KeptPart)> =
            (0..h.moe_layers.len()).filter_map(|li| ggml_parts(h, li).ok()).collect();
        describe_kept(&parts)
    }

    /// The 4-bit float format the records hold, if any (every MoE layer then holds it).
    pub fn fp4(&self) -> Option<Fp4Kind> {
        cache_fp4(self.cache.header())
    }
}

/// `KRASIS_SHARED_EXPERTS=beside` runs a MoE layer's shared expert in its own dispatch after the
/// routed experts' (the former path, for A/B measurements); unset (or anything else), inside
/// theirs ([`PoolExperts::run_with`]). Same bits either way.
fn shared_inside() -> bool {
    !krasis_core::knobs::knobs().shared_experts_beside
}

impl ExpertExecutor for CpuQuantExperts {
    fn run(&self, layer: usize, x: &[f32], t: usize, routes: &Routes, out: &mut [f32]) {
        let li = self.moe_index[layer].expect("routed experts requested for a dense layer");
        let mut g = self.grouping.lock().unwrap_or_else(|p| p.into_inner());
        let runner = &self.runners[self.runner_of[li]];
        if !self.biased {
            let jobs = self.routed_jobs(li, t, routes, &mut g);
            return runner.run(&self.pool, self.isa, x, self.hidden, &jobs, out);
        }
        assert!(!self.biases.is_empty(), "experts with biases run before CpuQuantExperts::load_biases");
        // The jobs as `routed_jobs` makes them (the routed experts in order), with their ids.
        g.group(self.cache.header().n_experts as usize, t, routes);
        let g = &*g;
        let ids: Vec<usize> = (0..g.offsets.len() - 1).filter(|&e| g.offsets[e + 1] > g.offsets[e]).collect();
        let jobs: Vec<ExpertJob<'_>> = ids
            .iter()
            .map(|&e| ExpertJob { weights: self.weights(li, e), tokens: &g.pairs[g.offsets[e]..g.offsets[e + 1]] })
            .collect();
        let bias13: Vec<&[f32]> = ids.iter().map(|&e| &self.biases[li][e].0[..]).collect();
        runner.run_biased(&self.pool, self.isa, x, self.hidden, &jobs, &bias13, out);
        // Σ w · (y + b_down) = Σ w · y + Σ w · b_down, per token.
        for (job, &e) in jobs.iter().zip(&ids) {
            let bd = &self.biases[li][e].1;
            for &(tok, w) in job.tokens {
                for (o, &b) in out[tok * self.hidden..(tok + 1) * self.hidden].iter_mut().zip(bd) {
                    *o += w * b;
                }
            }
        }
    }

    /// `shared` over every token at weight 1 and the routed jobs in one dispatch
    /// ([`PoolExperts::run_with`]): the bits of `shared.forward_add` followed by
    /// [`ExpertExecutor::run`] (the shared expert's sum comes first). Not for calls the shared
    /// expert alone would run on the BF16 tiles.
    fn run_with_shared(
        &self,
        layer: usize,
        x: &[f32],
        t: usize,
        routes: &Routes,
        shared: &PooledMlp,
        out: &mut [f32],
    ) -> bool {
        // Calls the BF16 tiles take (a prefill's) keep their own dispatches: there each set's
        // mean tokens per matrix picks its kernel, and one dispatch would not save a barrier.
        let bf16 = krasis_cpu::prefill_bf16::applies(self.isa, t, self.hidden).is_some();
        if bf16 || self.biased || !shared_inside() || !shared.runs_on(&self.pool, self.isa) {
            return false;
        }
        let li = self.moe_index[layer].expect("routed experts requested for a dense layer");
        let mut g = self.grouping.lock().unwrap_or_else(|p| p.into_inner());
        let jobs = self.routed_jobs(li, t, routes, &mut g);
        let every = PooledMlp::every_token(t);
        let shared_job = [ExpertJob { weights: shared.expert_weights(), tokens: &every }];
        let (l13, l2) = shared.layouts();
        let extra = ExtraJobs { w13_layout: l13, w2_layout: l2, jobs: &shared_job };
        self.runners[self.runner_of[li]].run_with(&self.pool, self.isa, x, self.hidden, &jobs, Some(extra), out);
        true
    }

    /// Pulls each worker's first task of a one-token call of `ids` into its cache (see
    /// [`PoolExperts::prefetch_first_tasks`]); the jobs in the order `run` makes them.
    fn prefetch(&self, layer: usize, ids: &[usize], budget: usize, stop: &(dyn Fn() -> bool + Sync)) -> usize {
        let Some(li) = self.moe_index.get(layer).copied().flatten() else { return 0 };
        let n = self.cache.header().n_experts as usize;
        let mut sorted: Vec<usize> = ids.iter().copied().filter(|&e| e < n).collect();
        sorted.sort_unstable();
        sorted.dedup();
        let experts: Vec<ExpertWeights<'_>> = sorted.iter().map(|&e| self.weights(li, e)).collect();
        self.runners[self.runner_of[li]].prefetch_first_tasks(&self.pool, &experts, budget, stop)
    }

    fn describe(&self) -> String {
        let widths = match self.fp4() {
            Some(kind) => format!("{kind} (as stored)"),
            None if cache_int4_asym(self.cache.header()) => "INT4 asymmetric".to_string(),
            None if cache_ggml(self.cache.header()) => self.ggml_description(),
            None => describe_layer_bits(&self.bits),
        };
        format!(
            "cpu {} g{}/{} {} on {}",
            widths,
            self.cache.header().group_size_hidden,
            self.cache.header().group_size_intermediate,
            self.isa.name(),
            self.pool.describe()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::precision::expert_width_rule;

    #[test]
    fn auto_is_for_routed_experts_only() {
        assert!(dense_quant_bits(WeightBits::Auto).unwrap_err().to_string().contains("routed experts only"));
        assert_eq!(dense_quant_bits(WeightBits::Int8).unwrap(), Some(Bits::Int8));
        assert_eq!(expert_width_rule(WeightBits::Auto), Some(ExpertWidthRule::Auto));
        assert_eq!(expert_width_rule(WeightBits::Bf16), None);
    }

    #[test]
    fn route_grouping_is_a_stable_counting_sort() {
        let routes = Routes { k: 2, ids: vec![3, 0, 0, 3, 2, 3], weights: vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6] };
        let mut g = RouteGrouping::default();
        for _ in 0..2 {
            // reused buffers give the same answer
            g.group(5, 3, &routes);
            let of = |e: usize| &g.pairs[g.offsets[e]..g.offsets[e + 1]];
            assert_eq!(of(0), &[(0, 0.2), (1, 0.3)]);
            assert!(of(1).is_empty() && of(4).is_empty());
            assert_eq!(of(2), &[(2, 0.5)]);
            assert_eq!(of(3), &[(0, 0.1), (1, 0.4), (2, 0.6)]);
        }
        // Routes computed elsewhere are left out.
        let mut split = routes;
        split.ids[3] = Routes::ELSEWHERE;
        split.ids[1] = 7;
        g.group(5, 3, &split);
        assert_eq!(g.pairs.len(), 4);
        assert_eq!(&g.pairs[g.offsets[0]..g.offsets[1]], &[(1, 0.3)]);
        assert_eq!(&g.pairs[g.offsets[3]..g.offsets[4]], &[(0, 0.1), (2, 0.6)]);
        assert_eq!(g.offsets[5], 4);
    }
}
