//! Quantised dense weights on disk (`--cpu-dense-bits 8|4`): every dense weight the CPU engine
//! quantises — exactly those the build walk hands to [`WeightBuilder::linear`],
//! [`WeightBuilder::gate_up`] (attention projections, shared experts, dense-layer MLPs, the LM
//! head; a gated MLP's gate and up as one fused w13 entry) and [`WeightBuilder::kv_b`] (MLA's
//! `kv_b_proj` per head, INT8) — packed into the dense-weight cache beside the expert cache (`krasis_cache::dense`),
//! keyed by the model's fingerprint, the bits and the group size. A cached start reads the file
//! into one buffer and quantises nothing; a missing, stale or damaged file is rebuilt from the
//! source weights (one matrix in memory at a time) and reported in one line.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use krasis_cache::{CacheOutcome, DenseCache, DenseEntry, DenseHeader};
use krasis_cpu::pool::WorkerPool;
use krasis_quant::cpu_layout::PackedLayout;
use krasis_quant::Bits;

use crate::cpu::packed_ops::{kv_b_layouts, pack_kv_b, pack_w13_dense, w13_fusable, w13_layout, PackedBytes};
use crate::cpu::quantized::{
    cache_error, dense_layout, in_cache_dir, pack_dense, progress_bar, QuantLinear, CPU_LAYOUT_NAME,
};
use crate::cpu::{linear_name, PrebuiltDense};
use crate::error::{ModelError, Result};
use crate::model::build::{build, LinearClass, WeightBuilder, WeightKinds};
use crate::model::linear::LinearOp;
use crate::model::tensors::{MlpTensors, TensorSpec};
use crate::model::weights::WeightLoader;
use crate::source::files::ModelFiles;
use crate::spec::{MlaDims, ModelSpec, RoutingRule};

/// What one dense-weight cache entry holds.
#[derive(Clone, Debug)]
pub enum PlannedKind {
    /// One linear, packed as is.
    Linear(TensorSpec),
    /// A gated MLP's gate and up, packed as one fused w13 ([`crate::cpu::packed_ops::pack_w13_dense`]).
    W13 { gate: TensorSpec, up: TensorSpec },
    /// MLA's `kv_b_proj` per head: `W_UKᵀ` of every head (`uk`), or `W_UV` of every head.
    KvB { t: TensorSpec, dims: MlaDims, uk: bool },
}

/// One entry of the dense-weight cache: the engine's name for it and what it holds.
#[derive(Clone, Debug)]
pub struct Planned {
    pub name: String,
    pub kind: PlannedKind,
}

/// An entry's packed shape: logical `[rows, cols]`, the group size it got and its packed size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryShape {
    pub rows: usize,
    pub cols: usize,
    pub gs: usize,
    pub bytes: usize,
}

impl Planned {
    /// The tensors this entry is made from.
    pub fn tensors(&self) -> Vec<&TensorSpec> {
        match &self.kind {
            PlannedKind::Linear(t) | PlannedKind::KvB { t, .. } => vec![t],
            PlannedKind::W13 { gate, up } => vec![gate, up],
        }
    }

    /// Its packed shape at `bits` and group `group`; `Ok(None)` for a `kv_b` whose shape the
    /// per-head layout cannot take (it then stays f32 and out of the cache).
    pub fn shape(&self, bits: Bits, group: usize) -> Result<Option<EntryShape>> {
        let name = &self.name;
        let of = |l: PackedLayout, rows: usize, count: usize| EntryShape {
            rows,
            cols: l.k,
            gs: l.gs,
            bytes: count * l.bytes(),
        };
        Ok(Some(match &self.kind {
            PlannedKind::Linear(t) => of(dense_layout(t.shape[0], t.shape[1], bits, group, name)?, t.shape[0], 1),
            PlannedKind::W13 { gate, .. } => {
                of(w13_layout(gate.shape[0], gate.shape[1], bits, group, name)?, 2 * gate.shape[0], 1)
            }
            PlannedKind::KvB { dims, uk, .. } => {
                let Some(l) = kv_b_layouts(dims, group) else { return Ok(None) };
                let one = if *uk { l.uk } else { l.uv };
                of(one, dims.heads * one.rows, dims.heads)
            }
        }))
    }

    /// The entry's bytes, made from the source weights.
    pub fn produce(&self, loader: &WeightLoader<'_>, bits: Bits, group: usize) -> Result<Vec<u8>> {
        let name = &self.name;
        Ok(match &self.kind {
            PlannedKind::Linear(t) => {
                pack_dense(&loader.matrix_of(t)?, &dense_layout(t.shape[0], t.shape[1], bits, group, name)?)
            }
            PlannedKind::W13 { gate, up } => {
                let l13 = w13_layout(gate.shape[0], gate.shape[1], bits, group, name)?;
                pack_w13_dense(&loader.matrix_of(gate)?, &loader.matrix_of(up)?, &l13)
            }
            PlannedKind::KvB { t, dims, uk } => {
                let l = kv_b_layouts(dims, group)
                    .ok_or_else(|| ModelError::Invalid(format!("{name}: no per-head layout")))?;
                pack_kv_b(&loader.matrix_of(t)?, dims, *uk, if *uk { &l.uk } else { &l.uv })
            }
        })
    }
}

/// The dense-weight cache's name for `kv_b`'s per-head `W_UKᵀ` (`uk`) or `W_UV` entry.
pub fn kv_b_entry_name(t: &TensorSpec, uk: bool) -> String {
    format!("{} ({} per head)", t.name, if uk { "W_UK^T" } else { "W_UV" })
}

/// The dense-weight cache's name for a gated MLP's fused gate+up entry.
pub fn w13_entry_name(gate: &TensorSpec, up: &TensorSpec) -> String {
    format!("{} + {} (fused w13)", gate.name, up.name)
}

/// A build walk that loads nothing and records the dense-weight cache's entries, in the order the
/// engine builds them, under the names the engine asks for.
struct Planner {
    entries: Vec<Planned>,
    mla: Option<MlaDims>,
}

impl Planner {
    fn linear_entry(&mut self, t: &TensorSpec, class: LinearClass) {
        self.entries.push(Planned { name: linear_name(t, class), kind: PlannedKind::Linear(t.clone()) });
    }
}

/// A plan's weights: nothing is built.
struct Nothing;

impl WeightKinds for Nothing {
    type Linear = ();
    type Mlp = ();
    type Vector = ();
    type Embedding = ();
    type KvB = ();
    type Router = ();
    type Experts = ();
}

impl WeightBuilder for Planner {
    type Kinds = Nothing;
    type GateUp = ();

    fn embedding(&mut self, _: &TensorSpec) -> Result<()> {
        Ok(())
    }

    fn linear(&mut self, t: &TensorSpec, class: LinearClass) -> Result<()> {
        self.linear_entry(t, class);
        Ok(())
    }

    fn gate_up(&mut self, gate: &TensorSpec, up: &TensorSpec, class: LinearClass) -> Result<()> {
        if w13_fusable(gate.shape[0]) {
            let kind = PlannedKind::W13 { gate: gate.clone(), up: up.clone() };
            self.entries.push(Planned { name: w13_entry_name(gate, up), kind });
        } else {
            self.linear_entry(gate, class);
            self.linear_entry(up, class);
        }
        Ok(())
    }

    fn mlp(&mut self, _: (), _: ()) -> Result<()> {
        Ok(())
    }

    fn vector(&mut self, _: &TensorSpec) -> Result<()> {
        Ok(())
    }

    fn kv_b(&mut self, t: &TensorSpec) -> Result<()> {
        if let Some(dims) = self.mla {
            for uk in [true, false] {
                self.entries
                    .push(Planned { name: kv_b_entry_name(t, uk), kind: PlannedKind::KvB { t: t.clone(), dims, uk } });
            }
        }
        Ok(())
    }

    fn router(&mut self, _: &TensorSpec, _: Option<&TensorSpec>, _: &RoutingRule) -> Result<()> {
        Ok(())
    }

    fn experts(&mut self, _: usize, _: &[MlpTensors]) -> Result<()> {
        Ok(())
    }
}

/// The dense-weight cache's candidate entries for this model, in build order, with their engine
/// names (a `kv_b` entry whose shape has no per-head layout is left out by
/// [`expected_dense_header`]).
pub fn planned_entries(spec: &ModelSpec) -> Result<Vec<Planned>> {
    let mut p = Planner { entries: Vec::new(), mla: spec.attention.mla_dims() };
    build(spec, &mut p)?;
    Ok(p.entries)
}

/// What the dense-weight cache must hold for this model and precision, and each entry's plan.
pub fn expected_dense_header(
    spec: &ModelSpec,
    config_hash: u64,
    bits: Bits,
    group: usize,
) -> Result<(DenseHeader, Vec<Planned>)> {
    let mut entries = Vec::new();
    let mut plans = Vec::new();
    for p in planned_entries(spec)? {
        let Some(s) = p.shape(bits, group)? else { continue };
        entries.push(DenseEntry {
            name: p.name.clone(),
            rows: s.rows as u64,
            cols: s.cols as u64,
            group_size: s.gs as u32,
            bytes: s.bytes as u64,
        });
        plans.push(p);
    }
    let header = DenseHeader {
        format_version: krasis_cache::DENSE_FORMAT_VERSION,
        layout: CPU_LAYOUT_NAME.into(),
        config_hash,
        bits: bits.bits() as u8,
        group_size: group as u32,
        entries,
    };
    Ok((header, plans))
}

/// Where the dense-weight cache of this precision lives (beside the expert cache).
pub fn dense_cache_path(files: &ModelFiles, cache_dir: Option<&Path>, bits: Bits, group: usize) -> PathBuf {
    in_cache_dir(files, cache_dir, &krasis_cache::dense_cache_file_name(bits.bits() as u8, group as u32))
}

/// Opens the dense-weight cache, building it (with a progress bar) when missing, stale or
/// damaged; the load shows a progress bar too. Keyed by [`ModelFiles::fingerprint`].
pub fn open_dense_cache(
    files: &ModelFiles,
    bits: Bits,
    group: usize,
    cache_dir: Option<&Path>,
) -> Result<(DenseCache, CacheOutcome)> {
    let spec = files.spec();
    let (header, plans) = expected_dense_header(spec, files.fingerprint(), bits, group)?;
    let path = dense_cache_path(files, cache_dir, bits, group);
    let loader = WeightLoader::new(files.weights(), &spec.source_quant);
    let underflow = crate::cpu::underflow::UnderflowLog::new();
    let produce = |i: usize| -> std::result::Result<Vec<u8>, String> {
        let bytes = plans[i].produce(&loader, bits, group).map_err(|err| err.to_string())?;
        underflow.record_entry(i, &plans[i], &bytes, bits, group);
        Ok(bytes)
    };
    let build_bar = progress_bar("quantising dense weights {bar:40} {bytes}/{total_bytes} eta {eta}");
    let load_bar = progress_bar("loading dense weights {bar:40} {bytes}/{total_bytes} {bytes_per_sec}");
    let show = |bar: &indicatif::ProgressBar, done: u64, total: u64| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let r = krasis_cache::open_or_build_dense(&path, &header, &produce, &|d, t| show(&build_bar, d, t), &|d, t| {
        show(&load_bar, d, t)
    })
    .map_err(cache_error);
    build_bar.finish_and_clear();
    load_bar.finish_and_clear();
    underflow.warn("the dense-weight cache");
    r
}

/// A loaded dense-weight cache serving the engine its packed weights by name (for
/// `Model::from_source_with`).
pub struct CachedDense {
    cache: Arc<DenseCache>,
    bits: Bits,
    pool: Arc<WorkerPool>,
}

/// The cache's entries as the engine's linears and packed weights.
pub fn cached_linears(cache: Arc<DenseCache>, bits: Bits, pool: Arc<WorkerPool>) -> CachedDense {
    CachedDense { cache, bits, pool }
}

impl PrebuiltDense for CachedDense {
    fn linear(&self, name: &str) -> Option<Result<Box<dyn LinearOp>>> {
        let i = self.cache.index_of(name)?;
        let e = &self.cache.header().entries[i];
        let layout = PackedLayout::new(e.rows as usize, e.cols as usize, e.group_size as usize, self.bits)
            .map_err(|err| ModelError::Invalid(format!("dense-weight cache entry `{name}`: {err}")));
        Some(layout.and_then(|l| {
            QuantLinear::from_cache(self.cache.clone(), i, l, self.pool.clone())
                .map(|q| Box::new(q) as Box<dyn LinearOp>)
        }))
    }

    fn packed(&self, name: &str) -> Option<PackedBytes> {
        let index = self.cache.index_of(name)?;
        Some(PackedBytes::Cached { cache: self.cache.clone(), index })
    }

    fn bits(&self) -> Bits {
        self.bits
    }

    fn group(&self) -> usize {
        self.cache.header().group_size as usize
    }

    fn pool(&self) -> &Arc<WorkerPool> {
        &self.pool
    }
}

#[cfg(test)]
#[path = "dense_cache_tests.rs"]
mod tests;
