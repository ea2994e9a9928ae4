//! The GPU expert cache (`experts_gpu_int{4|8}_g{gs}.bin`, docs/FORMATS.md): every routed expert
//! quantised by the CPU cache's rule and packed in the GPU tile layout
//! ([`krasis_quant::gpu_layout`]), in the same container as the CPU expert cache (checksummed
//! records, atomic build, rebuilt when missing, stale or damaged). A `--gpu-expert-bits 4|8`
//! start reads and uploads it instead of quantising every expert again; `krasis convert` builds
//! it, in the same pass over the source weights as the CPU cache when both are asked for.
//!
//! On a 4-bit float checkpoint (MXFP4, NVFP4) whose GPU experts keep that format
//! (`GpuOptions::expert_fp4`), the cache is `experts_gpu_{mxfp4|nvfp4}.bin`: every expert's
//! stored codes and scales in the GPU FP4 tile layout, never requantised.

use std::path::{Path, PathBuf};

use krasis_cache::{open_or_build, CacheHeader, CacheOutcome, ExpertCache, LayerParts, LoadOptions};
use krasis_gpu::moe::QuantExpertLayout;
use krasis_quant::fp4::{Fp4Kind, Fp4Matrix};
use krasis_quant::{Bits, QuantizedMatrix};

use crate::cpu::quantized::{
    cache_error, expert_shape, in_cache_dir, progress_bar, quant_err, show_build, ExpertSource,
};
use crate::error::Result;
use crate::model::weights::WeightLoader;
use crate::source::files::ModelFiles;
use crate::spec::ModelSpec;

/// Name of the GPU record layout stored in the header (bump when `krasis_quant::gpu_layout` or
/// [`krasis_gpu::moe::PackedExpert::to_record`] changes).
pub const GPU_LAYOUT_NAME: &str = "gpu-tile64-v1";

/// The header's layout name of GPU records in a 4-bit float format (FP4 tile layout, f32 scales).
pub fn gpu_fp4_layout_name(kind: Fp4Kind) -> &'static str {
    match kind {
        Fp4Kind::Mxfp4 => "gpu-tile64-mxfp4-v1",
        Fp4Kind::Nvfp4 => "gpu-tile64-nvfp4-v1",
    }
}

/// `experts_gpu_int{bits}_g{group}.bin`, or `experts_gpu_{mxfp4|nvfp4}.bin` for experts kept in a
/// 4-bit float format.
pub fn gpu_cache_file_name(bits: Bits, group: usize, fp4: Option<Fp4Kind>) -> String {
    match fp4 {
        Some(kind) => format!("experts_gpu_{kind}.bin"),
        None => format!("experts_gpu_int{}_g{group}.bin", bits.bits()),
    }
}

/// What a GPU expert cache holds and where it lives.
pub struct GpuCachePlan {
    pub path: PathBuf,
    pub header: CacheHeader,
    /// Packs one expert into its record.
    pub layout: QuantExpertLayout,
    pub bits: Bits,
    /// The experts' 4-bit float format kept as stored, or `None`: quantised at `bits`.
    pub fp4: Option<Fp4Kind>,
}

impl GpuCachePlan {
    /// The cache of `files`' routed experts at `bits`, groups of `group` along K (halved to fit,
    /// as the CPU cache), in `cache_dir` or the model's default cache directory; with `fp4`, the
    /// experts as stored in that 4-bit float format (`bits` must then be 4).
    pub fn new(
        files: &ModelFiles,
        bits: Bits,
        fp4: Option<Fp4Kind>,
        group: usize,
        cache_dir: Option<&Path>,
    ) -> Result<Self> {
        let spec = files.spec();
        if let (Some(kind), false) = (fp4, bits == Bits::Int4) {
            return Err(crate::error::ModelError::Invalid(format!(
                "GPU experts kept as stored {kind} are 4-bit, not {bits:?}"
            )));
        }
        let (header, layout) = expected_gpu_cache_header(spec, files.fingerprint(), bits, fp4, group)?;
        let path = in_cache_dir(files, cache_dir, &gpu_cache_file_name(bits, group, fp4));
        Ok(GpuCachePlan { path, header, layout, bits, fp4 })
    }

    /// The record of an expert from its gate, up and down quantised at [`GpuCachePlan::bits`].
    pub fn record(&self, q: &[QuantizedMatrix; 3], e: usize, what: &str) -> Result<Vec<u8>> {
        let packed = self.layout.pack(e, &q[0], &q[1], &q[2]).map_err(|err| quant_err(what, err))?;
        Ok(packed.to_record())
    }

    /// The record of an expert from its gate, up and down as stored in [`GpuCachePlan::fp4`].
    pub fn record_fp4(&self, m: &[Fp4Matrix; 3], e: usize, what: &str) -> Result<Vec<u8>> {
        let packed = self.layout.pack_fp4(e, &m[0], &m[1], &m[2]).map_err(|err| quant_err(what, err))?;
        Ok(packed.to_record())
    }
}

/// What the GPU expert cache must contain for this model at `bits` (or kept in `fp4`): one entry
/// per MoE layer, the group sizes the CPU cache would take (the format's for FP4), record parts
/// as [`QuantExpertLayout::record_parts`].
pub fn expected_gpu_cache_header(
    spec: &ModelSpec,
    config_hash: u64,
    bits: Bits,
    fp4: Option<Fp4Kind>,
    group: usize,
) -> Result<(CacheHeader, QuantExpertLayout)> {
    let mut shape = expert_shape(spec, group)?;
    let (layout, name) = match fp4 {
        Some(kind) => {
            (shape.gs_h, shape.gs_i) = (kind.group(), kind.group());
            (
                QuantExpertLayout::new_fp4("GPU expert cache", shape.hidden, shape.inter, kind)?,
                gpu_fp4_layout_name(kind),
            )
        }
        None => (
            QuantExpertLayout::new("GPU expert cache", shape.hidden, shape.inter, bits, shape.gs_h, shape.gs_i)?,
            GPU_LAYOUT_NAME,
        ),
    };
    let (w13_bytes, w2_bytes) = layout.record_parts();
    let moe_layers: Vec<u32> = spec.moe_layers().map(|l| l as u32).collect();
    let b = bits.bits() as u8;
    let parts = LayerParts { w13_bits: b, w2_bits: b, w13_bytes: w13_bytes as u64, w2_bytes: w2_bytes as u64 };
    let header = shape.header(name, config_hash, moe_layers.clone(), vec![parts; moe_layers.len()]);
    Ok((header, layout))
}

/// The layout of the GPU records a cache `header` describes (GPU expert cache headers only:
/// integer or FP4 by its layout name), named `name`.
pub fn gpu_record_layout(header: &CacheHeader, name: &str) -> Result<QuantExpertLayout> {
    let (h, i) = (header.hidden as usize, header.intermediate as usize);
    let fp4 = [Fp4Kind::Mxfp4, Fp4Kind::Nvfp4].into_iter().find(|&k| header.layout == gpu_fp4_layout_name(k));
    Ok(match fp4 {
        Some(kind) => QuantExpertLayout::new_fp4(name, h, i, kind)?,
        None => {
            let bits = match header.parts.first().map(|p| p.w13_bits) {
                Some(8) => Bits::Int8,
                _ => Bits::Int4,
            };
            let gs = (header.group_size_hidden as usize, header.group_size_intermediate as usize);
            QuantExpertLayout::new(name, h, i, bits, gs.0, gs.1)?
        }
    })
}

/// Open the GPU expert cache of `plan`, building it (with a progress bar) from the source
/// weights when missing, stale or damaged. Every record's checksum is verified as it is read.
pub fn open_gpu_expert_cache(files: &ModelFiles, plan: &GpuCachePlan) -> Result<(ExpertCache, CacheOutcome)> {
    let spec = files.spec();
    let loader = WeightLoader::new(files.weights(), &spec.source_quant);
    let header = &plan.header;
    let underflow = crate::cpu::underflow::UnderflowLog::new();
    let produce = |li: usize, e: usize| -> std::result::Result<Vec<u8>, String> {
        let layer = header.moe_layers[li] as usize;
        let record = || {
            if let Some(kind) = plan.fp4 {
                let dims = (header.hidden as usize, header.intermediate as usize);
                let (m, what) = crate::cpu::quantized::stored_fp4_expert(&loader, spec, layer, e, dims, kind)?;
                return plan.record_fp4(&m, e, &what);
            }
            let x = ExpertSource::read(&loader, spec, layer, e, header.intermediate as usize)?;
            let q = x.quantized(header, plan.bits, plan.bits)?;
            underflow.record_expert(li, e, &x.names, &q);
            plan.record(&q, e, &x.what)
        };
        record().map_err(|err| err.to_string())
    };
    let bar = progress_bar("GPU expert cache {bar:40} {bytes}/{total_bytes} {msg} eta {eta}");
    let progress = |p| show_build(&bar, p);
    // Read once, uploaded, then dropped: no huge pages or NUMA placement for a staging copy.
    let load = LoadOptions { verify: true, placement: None, huge_pages: false };
    let r = open_or_build(&plan.path, header, &produce, &progress, load).map_err(cache_error);
    bar.finish_and_clear();
    underflow.warn("the GPU expert cache");
    r
}

#[cfg(test)]
#[path = "expert_cache_tests.rs"]
mod tests;
