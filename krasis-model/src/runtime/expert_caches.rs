//! `krasis convert`'s expert caches: the CPU expert cache and the GPU expert cache
//! ([`crate::gpu::expert_cache`]) checked, and those missing, stale or damaged built in one pass
//! over the source weights: each expert is read and quantised once (once per width) and packed
//! into every layout that needs it.

use std::path::PathBuf;
use std::time::Instant;

use krasis_cache::{build_many, CacheHeader, CacheOutcome, LoadOptions};
use krasis_quant::{Bits, QuantizedMatrix};

use crate::cpu::quantized::{
    cache_error, cache_path, cpu_record, expected_cache_header, parts_bits, progress_bar, show_build, ExpertSource,
};
use crate::error::Result;
use crate::gpu::expert_cache::GpuCachePlan;
use crate::model::weights::WeightLoader;
use crate::placement::precision::LayerBits;
use crate::source::files::ModelFiles;

/// The caches `krasis convert` asks for.
pub struct CacheRequest<'a> {
    /// The CPU expert cache at these widths per MoE layer, if asked for.
    pub cpu: Option<&'a [LayerBits]>,
    /// The GPU expert cache at this width, if asked for.
    pub gpu: Option<Bits>,
    pub group: usize,
    pub cache_dir: Option<&'a std::path::Path>,
}

/// One cache after [`convert_expert_caches`].
pub struct ConvertedCache {
    /// "CPU" or "GPU".
    pub kind: &'static str,
    pub path: PathBuf,
    pub outcome: CacheOutcome,
    /// [`krasis_cache::describe`] of the cache as read back (checksums verified).
    pub description: String,
}

/// What a [`convert_expert_caches`] call did.
pub struct ConvertReport {
    pub caches: Vec<ConvertedCache>,
    /// Seconds of the one build pass (`None`: every cache was up to date).
    pub build_seconds: Option<f64>,
}

/// One quantisation of an expert: (w13 bits, w2 bits, group along hidden, group along intermediate).
type QuantKey = (Bits, Bits, u32, u32);

enum Target {
    Cpu(CacheHeader),
    Gpu(Box<GpuCachePlan>),
}

impl Target {
    fn header(&self) -> &CacheHeader {
        match self {
            Target::Cpu(h) => h,
            Target::Gpu(p) => &p.header,
        }
    }

    /// Widths of MoE layer `li`'s (w13, w2).
    fn bits(&self, li: usize) -> Result<(Bits, Bits)> {
        match self {
            Target::Cpu(h) => parts_bits(h, li).map(|b| (b.w13, b.w2)),
            Target::Gpu(p) => Ok((p.bits, p.bits)),
        }
    }
}

/// Checks every requested cache (reading it whole, checksums verified) and builds those that are
/// missing, stale or damaged in one pass; errors a rebuild cannot cure (I/O, a failing source
/// tensor) are returned.
pub fn convert_expert_caches(files: &ModelFiles, req: &CacheRequest<'_>) -> Result<ConvertReport> {
    let spec = files.spec();
    let mut targets: Vec<(&'static str, PathBuf, Target)> = Vec::new();
    if let Some(bits) = req.cpu {
        let header = expected_cache_header(spec, files.fingerprint(), bits, req.group)?;
        targets.push(("CPU", cache_path(files, req.cache_dir, bits, req.group), Target::Cpu(header)));
    }
    if let Some(bits) = req.gpu {
        let plan = GpuCachePlan::new(files, bits, None, req.group, req.cache_dir)?;
        targets.push(("GPU", plan.path.clone(), Target::Gpu(Box::new(plan))));
    }
    let check = LoadOptions { verify: true, placement: None, huge_pages: false };
    // Per target: the description of an up-to-date cache as read, or why it must be built.
    let mut found: Vec<std::result::Result<String, String>> = Vec::with_capacity(targets.len());
    for (_, path, t) in &targets {
        krasis_cache::clean_stale_tmp_files(path);
        found.push(match krasis_cache::open(path, t.header(), check) {
            Ok(cache) => Ok(krasis_cache::describe(&cache)),
            Err(e) if e.is_rebuildable() => Err(e.reason()),
            Err(e) => return Err(cache_error(e)),
        });
    }
    let stale: Vec<usize> = (0..targets.len()).filter(|&i| found[i].is_err()).collect();
    let mut build_seconds = None;
    if !stale.is_empty() {
        let started = Instant::now();
        let loader = WeightLoader::new(files.weights(), &spec.source_quant);
        let first = targets[stale[0]].2.header();
        let underflow = crate::cpu::underflow::UnderflowLog::new();
        let produce = |li: usize, e: usize| -> std::result::Result<Vec<Vec<u8>>, String> {
            let make = || -> Result<Vec<Vec<u8>>> {
                let layer = first.moe_layers[li] as usize;
                let x = ExpertSource::read(&loader, spec, layer, e, first.intermediate as usize)?;
                let what = &x.what;
                // Quantised once per width pair, packed once per cache.
                let mut quantised: Vec<(QuantKey, [QuantizedMatrix; 3])> = Vec::new();
                let mut records = Vec::with_capacity(stale.len());
                for &i in &stale {
                    let t = &targets[i].2;
                    let (w13, w2) = t.bits(li)?;
                    let h = t.header();
                    let key = (w13, w2, h.group_size_hidden, h.group_size_intermediate);
                    let at = match quantised.iter().position(|(k, _)| *k == key) {
                        Some(at) => at,
                        None => {
                            let q = x.quantized(h, w13, w2)?;
                            underflow.record_expert(li, e, &x.names, &q);
                            quantised.push((key, q));
                            quantised.len() - 1
                        }
                    };
                    let q = &quantised[at].1;
                    records.push(match t {
                        Target::Cpu(h) => cpu_record(h, li, q, what)?,
                        Target::Gpu(p) => p.record(q, e, what)?,
                    });
                }
                Ok(records)
            };
            make().map_err(|e| e.to_string())
        };
        let names: Vec<&str> = stale.iter().map(|&i| targets[i].0).collect();
        let bar = progress_bar(&format!(
            "converting experts ({}) {{bar:40}} {{bytes}}/{{total_bytes}} {{msg}} eta {{eta}}",
            names.join(" + ")
        ));
        let progress = |p| show_build(&bar, p);
        let many: Vec<(&std::path::Path, &CacheHeader)> =
            stale.iter().map(|&i| (targets[i].1.as_path(), targets[i].2.header())).collect();
        let built = build_many(&many, &produce, &progress).map_err(cache_error);
        bar.finish_and_clear();
        underflow.warn("the expert caches");
        built?;
        build_seconds = Some(started.elapsed().as_secs_f64());
    }
    // Built caches are read back (checksums verified); up-to-date ones were read above.
    let mut caches = Vec::with_capacity(targets.len());
    for ((kind, path, t), found) in targets.into_iter().zip(found) {
        let (outcome, description) = match found {
            Ok(description) => (CacheOutcome::Hit, description),
            Err(reason) => {
                let cache = krasis_cache::open(&path, t.header(), check).map_err(cache_error)?;
                (CacheOutcome::Built { reason }, krasis_cache::describe(&cache))
            }
        };
        caches.push(ConvertedCache { kind, path, outcome, description });
    }
    Ok(ConvertReport { caches, build_seconds })
}
