//! Quantised dense weights on disk (`--cpu-dense-bits 8|4`): every dense linear the CPU engine
//! quantises — exactly those the build walk hands to [`WeightBuilder::linear`] and
//! [`WeightBuilder::gate_up`] (attention projections, shared experts, dense-layer MLPs, the LM
//! head) — packed into the dense-weight cache beside the expert cache (`krasis_cache::dense`),
//! keyed by the model's fingerprint, the bits and the group size. A cached start reads the file
//! into one buffer and quantises nothing; a missing, stale or damaged file is rebuilt from the
//! source weights (one matrix in memory at a time) and reported in one line.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use krasis_cache::{CacheOutcome, DenseCache, DenseEntry, DenseHeader};
use krasis_cpu::pool::WorkerPool;
use krasis_quant::cpu_layout::PackedLayout;
use krasis_quant::Bits;

use crate::build::{build, LinearClass, WeightBuilder};
use crate::engine::linear_name;
use crate::error::{ModelError, Result};
use crate::files::ModelFiles;
use crate::linear::LinearOp;
use crate::quantized::{
    dense_layout, in_cache_dir, pack_dense, progress_bar, QuantLinear, CACHE_DIR_HINT, CPU_LAYOUT_NAME,
};
use crate::spec::{ModelSpec, RoutingRule};
use crate::tensors::{MlpTensors, TensorSpec};
use crate::weights::WeightLoader;

/// A build walk that loads nothing and records the dense linears, in the order the engine
/// builds them, under the names the engine gives them.
#[derive(Default)]
struct Planner {
    linears: Vec<(String, TensorSpec)>,
}

impl WeightBuilder for Planner {
    type Linear = ();
    type GateUp = ();
    type Vector = ();
    type Embedding = ();
    type KvB = ();
    type Router = ();
    type Experts = ();

    fn embedding(&mut self, _: &TensorSpec) -> Result<()> {
        Ok(())
    }

    fn linear(&mut self, t: &TensorSpec, class: LinearClass) -> Result<()> {
        self.linears.push((linear_name(t, class), t.clone()));
        Ok(())
    }

    fn gate_up(&mut self, gate: &TensorSpec, up: &TensorSpec, class: LinearClass) -> Result<()> {
        self.linear(gate, class)?;
        self.linear(up, class)
    }

    fn vector(&mut self, _: &TensorSpec) -> Result<()> {
        Ok(())
    }

    fn kv_b(&mut self, _: &TensorSpec) -> Result<()> {
        Ok(())
    }

    fn router(&mut self, _: &TensorSpec, _: Option<&TensorSpec>, _: &RoutingRule) -> Result<()> {
        Ok(())
    }

    fn experts(&mut self, _: usize, _: &[MlpTensors]) -> Result<()> {
        Ok(())
    }
}

/// The dense linears the CPU engine quantises, in build order, with their engine names.
pub fn quantised_linears(spec: &ModelSpec) -> Result<Vec<(String, TensorSpec)>> {
    let mut p = Planner::default();
    build(spec, &mut p)?;
    Ok(p.linears)
}

/// What the dense-weight cache must hold for this model and precision, and each entry's tensor.
pub fn expected_dense_header(
    spec: &ModelSpec,
    config_hash: u64,
    bits: Bits,
    group: usize,
) -> Result<(DenseHeader, Vec<TensorSpec>)> {
    let mut entries = Vec::new();
    let mut tensors = Vec::new();
    for (name, t) in quantised_linears(spec)? {
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let layout = dense_layout(rows, cols, bits, group, &name)?;
        entries.push(DenseEntry {
            name,
            rows: rows as u64,
            cols: cols as u64,
            group_size: layout.gs as u32,
            bytes: layout.bytes() as u64,
        });
        tensors.push(t);
    }
    let header = DenseHeader {
        format_version: krasis_cache::DENSE_FORMAT_VERSION,
        layout: CPU_LAYOUT_NAME.into(),
        config_hash,
        bits: bits.bits() as u8,
        group_size: group as u32,
        entries,
    };
    Ok((header, tensors))
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
    let (header, tensors) = expected_dense_header(spec, files.fingerprint(), bits, group)?;
    let path = dense_cache_path(files, cache_dir, bits, group);
    let loader = WeightLoader::new(files.weights(), &spec.source_quant);
    let produce = |i: usize| -> std::result::Result<Vec<u8>, String> {
        let e = &header.entries[i];
        let m = loader.matrix_of(&tensors[i]).map_err(|err| err.to_string())?;
        let layout = PackedLayout::new(e.rows as usize, e.cols as usize, e.group_size as usize, bits)
            .map_err(|err| err.to_string())?;
        Ok(pack_dense(&m, &layout))
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
    .map_err(|e| {
        let hint = if e.is_location() { CACHE_DIR_HINT } else { "" };
        ModelError::Invalid(format!("{e}{hint}"))
    });
    build_bar.finish_and_clear();
    load_bar.finish_and_clear();
    r
}

/// The cache's entries as the engine's linears, by engine name (for `Model::from_source_with`).
pub fn cached_linears(
    cache: Arc<DenseCache>,
    bits: Bits,
    pool: Arc<WorkerPool>,
) -> impl Fn(&str) -> Option<Result<Box<dyn LinearOp>>> {
    move |name| {
        let i = cache.index_of(name)?;
        let e = &cache.header().entries[i];
        let layout = PackedLayout::new(e.rows as usize, e.cols as usize, e.group_size as usize, bits)
            .map_err(|err| ModelError::Invalid(format!("dense-weight cache entry `{name}`: {err}")));
        Some(layout.and_then(|l| {
            QuantLinear::from_cache(cache.clone(), i, l, pool.clone()).map(|q| Box::new(q) as Box<dyn LinearOp>)
        }))
    }
}

#[cfg(test)]
#[path = "dense_cache_tests.rs"]
mod tests;
