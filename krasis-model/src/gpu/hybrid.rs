//! `--device hybrid`: routed experts on the CPU (the expert cache on the pinned pool), everything
//! else on the GPU. The Engine API calls [`open_hybrid`] when the
//! device choice ([`crate::placement::choose_device`]) is hybrid.

use super::GpuModel;
use crate::error::Result;
use crate::files::ModelFiles;
use crate::memory::estimate;
use crate::runtime::{check_ram, device_line, DecoderEngine, DevicePath, EngineConfig, Opened};

/// Opens the hybrid engine on GPU `config.gpu.ordinal`, after checking the host RAM the routed
/// experts take against the budget. `why` goes into the device line.
pub fn open_hybrid(files: &ModelFiles, config: &EngineConfig, why: &str) -> Result<Opened> {
    let mut host_bytes = estimate(files.spec(), config.cpu.expert_bits).expert_bytes;
    // Prefill streaming from the GPU expert cache keeps it in RAM beside the CPU one (streaming
    // the CPU cache's own records adds nothing).
    if let Some(bits) = config.gpu.expert_bits.filter(|_| config.gpu.stream_from == super::StreamFrom::GpuCache) {
        let (h, _) = super::expert_cache::expected_gpu_cache_header(
            files.spec(),
            files.fingerprint(),
            bits,
            config.gpu.expert_group_size,
        )?;
        host_bytes += krasis_cache::format::records_bytes(&h).unwrap_or(0);
    }
    let warnings = check_ram(host_bytes, config)?;
    let mut model = GpuModel::hybrid_from_files(files, &config.gpu, &config.cpu)?;
    model.warm_up()?;
    if config.record_heatmap {
        model.record_heatmap()?;
    }
    let log = std::mem::take(&mut model.log);
    let placement = model.placement_lines(why);
    let expert_bytes = model.host_expert_bytes;
    let mut engine = DecoderEngine::new(model);
    if let Some(b) = expert_bytes {
        engine = engine.with_expert_bytes(b);
    }
    Ok(Opened {
        engine: Box::new(engine),
        log,
        warnings,
        why: device_line(DevicePath::Hybrid, why),
        placement,
        memory_estimate: None,
        check_rss: false,
    })
}
