//! The GPU expert cache without a GPU: built in one pass with the CPU cache it holds the same
//! quantised numbers in the other layout, byte for byte what it holds built alone; damage is
//! rebuilt, never uploaded.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::*;
use crate::placement::precision::LayerBits;
use crate::runtime::expert_caches::{convert_expert_caches, CacheRequest};
use crate::synth::{synthesize, Preset, SynthOptions};
use krasis_quant::cpu_layout::{unpack, unpack_w13, PackedLayout};

fn tiny(dir: &Path) -> ModelFiles {
    let out = dir.join("tiny");
    // Three layers: a dense MLP layer, then two MoE layers.
    synthesize(&SynthOptions { layers: Some(3), seed: 13, ..SynthOptions::new(Preset::Tiny, &out) }).unwrap();
    ModelFiles::open(&out).unwrap()
}

fn convert(files: &ModelFiles, cpu: Option<&[LayerBits]>, gpu: Option<Bits>, dir: &Path) -> Vec<PathBuf> {
    let req = CacheRequest { cpu, gpu, group: 128, cache_dir: Some(dir) };
    let report = convert_expert_caches(files, &req).unwrap();
    report.caches.into_iter().map(|c| c.path).collect()
}

#[test]
fn one_pass_gpu_cache_holds_the_cpu_cache_numbers() {
    let d = tempfile::tempdir().unwrap();
    let files = tiny(d.path());
    let layers = files.spec().moe_layers().count();
    for (cpu_bits, gpu_bits) in [(Bits::Int4, Bits::Int4), (Bits::Int8, Bits::Int8), (Bits::Int4, Bits::Int8)] {
        let (both, alone) = (d.path().join(format!("both{cpu_bits:?}{gpu_bits:?}")), d.path().join("alone"));
        let cpu = vec![LayerBits::uniform(cpu_bits); layers];
        let paths = convert(&files, Some(&cpu), Some(gpu_bits), &both);
        assert_eq!(paths.len(), 2);
        let gpu_alone = convert(&files, None, Some(gpu_bits), &alone);
        assert_eq!(std::fs::read(&paths[1]).unwrap(), std::fs::read(&gpu_alone[0]).unwrap(), "one pass = alone");
        std::fs::remove_dir_all(&alone).unwrap();
        if cpu_bits != gpu_bits {
            continue;
        }
        let plan = GpuCachePlan::new(&files, gpu_bits, None, 128, Some(&both)).unwrap();
        let (gpu, outcome) = open_gpu_expert_cache(&files, &plan).unwrap();
        assert_eq!(outcome, CacheOutcome::Hit);
        let cpu_header =
            crate::cpu::quantized::expected_cache_header(files.spec(), files.fingerprint(), &cpu, 128).unwrap();
        let cpu_cache = krasis_cache::open(&paths[0], &cpu_header, LoadOptions::default()).unwrap();
        let h = cpu_cache.header();
        let (hid, i) = (h.hidden as usize, h.intermediate as usize);
        let (gs_h, gs_i) = (h.group_size_hidden as usize, h.group_size_intermediate as usize);
        let l13 = PackedLayout::new(2 * i, hid, gs_h, cpu_bits).unwrap();
        let l2 = PackedLayout::new(hid, i, gs_i, cpu_bits).unwrap();
        for li in 0..layers {
            for e in 0..h.n_experts as usize {
                let [g, u, dn] = plan.layout.unpack_record(gpu.w13(li, e), gpu.w2(li, e)).unwrap();
                let (cg, cu) = unpack_w13(cpu_cache.w13(li, e), &l13).unwrap();
                assert_eq!((g, u), (cg, cu), "gate/up of ({li}, {e})");
                assert_eq!(dn, unpack(cpu_cache.w2(li, e), &l2).unwrap(), "down of ({li}, {e})");
            }
        }
    }
}

#[test]
fn a_damaged_gpu_cache_is_rebuilt_not_uploaded() {
    let d = tempfile::tempdir().unwrap();
    let files = tiny(d.path());
    let plan = GpuCachePlan::new(&files, Bits::Int4, None, 128, Some(d.path())).unwrap();
    let (_, outcome) = open_gpu_expert_cache(&files, &plan).unwrap();
    assert!(matches!(outcome, CacheOutcome::Built { .. }), "{outcome:?}");
    let good = std::fs::read(&plan.path).unwrap();
    let f = OpenOptions::new().read(true).write(true).open(&plan.path).unwrap();
    let off = good.len() as u64 - 5000;
    f.write_all_at(&[good[off as usize] ^ 0x40], off).unwrap();
    let (cache, outcome) = open_gpu_expert_cache(&files, &plan).unwrap();
    match outcome {
        CacheOutcome::Built { reason } => assert!(reason.contains("checksum"), "{reason}"),
        CacheOutcome::Hit => panic!("a damaged cache was used"),
    }
    assert_eq!(cache.header().layout, GPU_LAYOUT_NAME);
    assert_eq!(std::fs::read(&plan.path).unwrap(), good);
    // Another width or group is another file, never a stale hit.
    let other = GpuCachePlan::new(&files, Bits::Int8, None, 64, Some(d.path())).unwrap();
    assert_ne!(other.path, plan.path);
    assert!(other.path.ends_with("experts_gpu_int8_g64.bin"));
}
