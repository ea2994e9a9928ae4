//! The family checks every fixtures-next suite runs (`families_oracle`, `deltanet_oracle`): the
//! quantised CPU experts and the GPU / hybrid paths against `quant_bounds.json`'s bars.

use krasis_model::cpu::quantized::WeightBits;
use krasis_model::gpu::{GpuExpertCache, GpuModel, GpuOptions};
use krasis_model::text::sampling::argmax;
use krasis_quant::Bits;

use crate::{fidelity, fixture_next, gpu_fixture_next, load_reference, prefill_logits, quant_bound, GpuFixture};

/// The quantised CPU experts (INT8, INT4) of fixture `name` within `quant_bounds.json`'s rule:
/// (1 − mean cos) ≤ 2 × an ideal quantisation's + 1e-4, top-1 ≥ its − 0.1, and at INT8 the first
/// greedy token wherever the ideal keeps it.
pub fn quantised_cpu_experts(name: &str) {
    let Some(dir) = fixture_next(name) else { return };
    let root = dir.parent().unwrap();
    let r = load_reference(&dir);
    let v = r.prefill_logits.len() / r.prompt_ids.len();
    let tmp = tempfile::tempdir().unwrap();
    for (kind, bits) in [("int8", WeightBits::Int8), ("int4", WeightBits::Int4)] {
        let ideal = quant_bound(root, name, kind);
        let logits = prefill_logits(&dir, bits, WeightBits::Bf16, tmp.path(), &r.prompt_ids);
        let f = fidelity(&logits, &r.prefill_logits, v);
        let bar = 2.0 * (1.0 - ideal.mean_cos) + 1e-4;
        eprintln!(
            "{name} cpu experts {kind}: 1-cos {:.3e} (bar {bar:.3e}), top1 {:.2} (ideal {:.2})",
            1.0 - f.mean_cos,
            f.top1,
            ideal.top1
        );
        assert!(1.0 - f.mean_cos <= bar, "{name} {kind}: 1 - mean cos {:.3e} > {bar:.3e}", 1.0 - f.mean_cos);
        assert!(f.top1 >= ideal.top1 - 0.1, "{name} {kind}: top-1 {:.2} < ideal {:.2} - 0.1", f.top1, ideal.top1);
        if kind == "int8" && ideal.first_token_same == Some(true) {
            assert_eq!(argmax(&logits[logits.len() - v..]) as u32, r.greedy_ids[0], "{name} int8: first token");
        }
    }
}

/// The GPU engine and the hybrid, with BF16 and INT4 experts, on fixture `name`: the prefill
/// logits and, with `decode_steps`, the greedy steps after it, teacher-forced (one token each,
/// continuing from the prefill's cache and states), within the transformers-BF16 bar: 1 − mean
/// cos ≤ 3 × transformers' own BF16 error + 1e-4 (plus 2 × an ideal INT4's for INT4 experts),
/// top-1 agreement ≥ the BF16 (and INT4) run's − 0.1, and at BF16 the first greedy token. A
/// family whose hybrid keeps its routed experts on the CPU (gpt-oss's biased experts:
/// `check_hybrid_gpu_experts`) runs its hybrid without streaming them (the CPU's experts at the
/// kind's width for every prompt). Skipped visibly without a GPU.
pub fn gpu_and_hybrid(name: &str, decode_steps: bool) {
    gpu_and_hybrid_on(name, decode_steps, &["gpu", "hybrid"]);
}

/// [`gpu_and_hybrid`] on the engines `devices` only (`"gpu"`, `"hybrid"`).
pub fn gpu_and_hybrid_on(name: &str, decode_steps: bool, devices: &[&str]) {
    let Some(GpuFixture { root, dir, reference: r, vocab: v }) = gpu_fixture_next(name) else { return };
    let root = root.as_path();
    let b = quant_bound(root, name, "bf16");
    let i4 = quant_bound(root, name, "int4");
    let tmp = tempfile::tempdir().unwrap();
    let cache = GpuExpertCache::In(Some(tmp.path().to_path_buf()));
    let spec = krasis_model::source::files::ModelFiles::open(&dir).unwrap().spec().clone();
    let hybrid_streams = krasis_model::gpu::check_hybrid_gpu_experts(&spec).is_ok();
    for (kind, bits) in [("bf16", None), ("int4", Some(Bits::Int4))] {
        let bar = 3.0 * (1.0 - b.mean_cos) + 1e-4 + if bits.is_some() { 2.0 * (1.0 - i4.mean_cos) } else { 0.0 };
        let top1 = if bits.is_some() { i4.top1.min(b.top1) } else { b.top1 };
        let gpu = GpuOptions {
            kv_tokens: Some(512),
            expert_bits: bits,
            expert_cache: cache.clone(),
            ..GpuOptions::default()
        };
        let cpu = krasis_model::cpu::load::EngineOptions {
            expert_bits: if bits.is_some() { WeightBits::Int4 } else { WeightBits::Bf16 },
            cache_dir: Some(tmp.path().to_path_buf()),
            threads: Some(2),
            ..Default::default()
        };
        for &device in devices {
            let m = match device {
                "gpu" => GpuModel::load(&dir, &gpu),
                _ if !hybrid_streams => {
                    GpuModel::load_hybrid(&dir, &GpuOptions { expert_bits: None, ..gpu.clone() }, &cpu)
                }
                _ => GpuModel::load_hybrid(&dir, &gpu, &cpu),
            }
            .unwrap_or_else(|e| panic!("{name} {device} {kind}: {e}"));
            let mut s = m.new_session().unwrap();
            let l = m.forward_logits(&mut s, &r.prompt_ids, true).unwrap();
            // greedy_logits[i + 1] chose greedy_ids[i + 1] after greedy_ids[i] was fed.
            let n = if decode_steps { r.greedy_ids.len() } else { 1 };
            let mut steps = Vec::with_capacity((n - 1) * v);
            for &id in &r.greedy_ids[..n - 1] {
                steps.extend(m.forward_logits(&mut s, &[id], false).unwrap());
            }
            let decode = [("decode", &steps, &r.greedy_logits[v..n * v])];
            for (what, got, want) in [("prefill", &l, &r.prefill_logits[..])]
                .into_iter()
                .chain(decode.into_iter().take(usize::from(decode_steps)))
            {
                let f = fidelity(got, want, v);
                eprintln!(
                    "{name} {device} experts {kind} {what}: 1-cos {:.3e} (bar {bar:.3e}), top1 {:.2} (bar {:.2})",
                    1.0 - f.mean_cos,
                    f.top1,
                    top1 - 0.1
                );
                assert!(
                    1.0 - f.mean_cos <= bar,
                    "{name} {device} {kind} {what}: 1 - mean cos {:.3e} > {bar:.3e}",
                    1.0 - f.mean_cos
                );
                assert!(f.top1 >= top1 - 0.1, "{name} {device} {kind} {what}: top-1 {:.2} < {:.2} - 0.1", f.top1, top1);
            }
            if bits.is_none() {
                let first = argmax(&l[l.len() - v..]) as u32;
                assert_eq!(first, r.greedy_ids[0], "{name} {device} bf16: first greedy token");
            }
        }
    }
}

/// A 4-bit float checkpoint (fixture `name`, experts stored in `kind`) run as a user's first start
/// runs it on the GPU and the hybrid: the device choice's defaults (`whole_gpu_defaults`,
/// `hybrid_defaults` over `EngineConfig::default()`) keep the format on the GPU
/// (`GpuOptions::expert_fp4`: codes and scales as stored, the GPU FP4 tile layout), and the CPU
/// experts at `auto` keep it too. Each run's prefill logits and free-running greedy decode
/// against the oracle (computed on the exactly dequantised weights):
/// - the greedy ids identical to the oracle's, every step;
/// - 1 − mean cos within the GPU's BF16 bar (3 × transformers' BF16 error + 1e-4): attention and
///   its KV cache run in BF16 on the GPU whatever the experts' format;
/// - the whole GPU with the format kept no further from the oracle (relative L2, + 1e-4) than the
///   same GPU path with BF16 experts (the exact values rounded to BF16), so the FP4 kernels add
///   nothing to the GPU path's own error;
/// - the GPU and the hybrid with `GpuPrecision::F32` (the format still kept): the reference
///   path's bar ([`precise_run_matches`]).
///
/// Prints every relative L2 error. Skipped visibly without a GPU.
pub fn fp4_native_gpu_and_hybrid(name: &str, kind: krasis_quant::fp4::Fp4Kind) {
    use krasis_model::placement::device::{hybrid_defaults, whole_gpu_defaults};
    use krasis_model::runtime::EngineConfig;
    let Some(GpuFixture { root, dir, reference: r, vocab: v }) = gpu_fixture_next(name) else { return };
    let b = quant_bound(&root, name, "bf16");
    let bar = 3.0 * (1.0 - b.mean_cos) + 1e-4;
    let tmp = tempfile::tempdir().unwrap();
    let spec = krasis_model::source::files::ModelFiles::open(&dir).unwrap().spec().clone();
    let mut config = EngineConfig::default();
    config.cpu.expert_bits = krasis_model::placement::precision::resolve_expert_bits(&spec, WeightBits::Auto);
    config.cpu.cache_dir = Some(tmp.path().to_path_buf());
    config.cpu.threads = Some(2);
    config.gpu.kv_tokens = Some(512);
    config.gpu.expert_cache = GpuExpertCache::In(Some(tmp.path().to_path_buf()));
    let whole = whole_gpu_defaults(&spec, &config);
    assert_eq!((whole.gpu.expert_bits, whole.gpu.expert_fp4), (Some(Bits::Int4), Some(kind)), "{name}: GPU defaults");
    let hybrid = hybrid_defaults(&spec, &config, None);
    // The prefill logits and the free-running greedy steps: (prefill rel, worst step rel, ids).
    let run = |m: &GpuModel, what: &str| -> (f64, f64, Vec<u32>) {
        let mut s = m.new_session().unwrap();
        let l = m.forward_logits(&mut s, &r.prompt_ids, true).unwrap();
        let f = fidelity(&l, &r.prefill_logits, v);
        let rel = crate::rel_l2(&l, &r.prefill_logits);
        assert!(1.0 - f.mean_cos <= bar, "{name} {what}: 1 - mean cos {:.3e} > {bar:.3e}", 1.0 - f.mean_cos);
        let (mut step, mut ids, mut worst) = (l[l.len() - v..].to_vec(), Vec::new(), 0f64);
        for i in 0..r.greedy_ids.len() {
            worst = worst.max(crate::rel_l2(&step, &r.greedy_logits[i * v..(i + 1) * v]));
            let id = argmax(&step) as u32;
            ids.push(id);
            if i + 1 < r.greedy_ids.len() {
                step = m.forward_logits(&mut s, &[id], false).unwrap();
            }
        }
        eprintln!(
            "{name} {what}: prefill rel {rel:.3e}, 1-cos {:.3e} (bar {bar:.3e}), top1 {:.2}; greedy steps worst rel {worst:.3e}",
            1.0 - f.mean_cos,
            f.top1
        );
        (rel, worst, ids)
    };
    let gpu = GpuModel::load(&dir, &whole.gpu).unwrap_or_else(|e| panic!("{name} gpu: {e}"));
    // The GPU expert cache of the format kept (FP4 records), built on this first start.
    let file = format!("experts_gpu_{kind}.bin");
    let found = walkdir(tmp.path()).iter().any(|p| p.file_name().is_some_and(|n| n == file.as_str()));
    assert!(found, "{name}: no {file} under {} ({:?})", tmp.path().display(), gpu.log);
    let (native, native_steps, ids) = run(&gpu, &format!("gpu ({kind} kept)"));
    assert_eq!(ids, r.greedy_ids, "{name} gpu: greedy ids");
    drop(gpu);
    let bf16 = GpuOptions { expert_bits: None, expert_fp4: None, ..whole.gpu.clone() };
    let gpu = GpuModel::load(&dir, &bf16).unwrap_or_else(|e| panic!("{name} gpu bf16: {e}"));
    let (rounded, rounded_steps, _) = run(&gpu, "gpu (experts rounded to BF16)");
    drop(gpu);
    assert!(
        native <= rounded + 1e-4,
        "{name}: the GPU with {kind} kept is at rel {native:.3e}, with BF16 experts {rounded:.3e}"
    );
    assert!(
        native_steps <= rounded_steps + 1e-4,
        "{name}: greedy steps {native_steps:.3e} against {rounded_steps:.3e}"
    );
    let m = GpuModel::load_hybrid(&dir, &hybrid.gpu, &hybrid.cpu).unwrap_or_else(|e| panic!("{name} hybrid: {e}"));
    for line in &m.log {
        eprintln!("{name} hybrid: {line}");
    }
    let (_, _, ids) = run(&m, &format!("hybrid ({kind} kept on both devices)"));
    assert_eq!(ids, r.greedy_ids, "{name} hybrid: greedy ids");
    drop(m);
    // The same runs in the precise mode: the reference path's bar.
    let precise = |g: &GpuOptions| GpuOptions { precision: krasis_model::gpu::GpuPrecision::F32, ..g.clone() };
    let gpu = GpuModel::load(&dir, &precise(&whole.gpu)).unwrap_or_else(|e| panic!("{name} gpu f32: {e}"));
    precise_run_matches(&format!("{name} gpu ({kind} kept)"), &gpu, &r, v);
    drop(gpu);
    let m = GpuModel::load_hybrid(&dir, &precise(&hybrid.gpu), &hybrid.cpu)
        .unwrap_or_else(|e| panic!("{name} hybrid f32: {e}"));
    precise_run_matches(&format!("{name} hybrid ({kind} kept on both devices)"), &m, &r, v);
}

/// Every file under `dir`, recursively.
fn walkdir(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walkdir(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// The precise GPU mode's bar: relative L2 of the prefill logits and of every free-running greedy
/// step's logits against the oracle (the reference path's own bar).
pub const PRECISE_REL: f64 = 1e-4;

/// `m` (a model loaded with `GpuPrecision::F32`) against the oracle `r` (`v` logits per row): the
/// prefill logits and every free-running greedy step's logits within [`PRECISE_REL`], the greedy
/// ids identical. Prints the errors; returns the worst relative L2 (prefill or step).
pub fn precise_run_matches(what: &str, m: &GpuModel, r: &crate::Reference, v: usize) -> f64 {
    let mut s = m.new_session().unwrap_or_else(|e| panic!("{what}: {e}"));
    let l = m.forward_logits(&mut s, &r.prompt_ids, true).unwrap_or_else(|e| panic!("{what}: {e}"));
    let rel = crate::rel_l2(&l, &r.prefill_logits);
    let (mut step, mut ids, mut worst) = (l[l.len() - v..].to_vec(), Vec::new(), 0f64);
    let mut steps = Vec::new();
    // Some oracles record fewer step logits than greedy ids: those steps' ids are still checked.
    let logged = r.greedy_logits.len() / v;
    for i in 0..r.greedy_ids.len() {
        if i < logged {
            let e = crate::rel_l2(&step, &r.greedy_logits[i * v..(i + 1) * v]);
            steps.push(format!("{e:.1e}"));
            worst = worst.max(e);
        }
        let id = argmax(&step) as u32;
        ids.push(id);
        if i + 1 < r.greedy_ids.len() {
            step = m.forward_logits(&mut s, &[id], false).unwrap_or_else(|e| panic!("{what}: step {i}: {e}"));
        }
    }
    if worst > PRECISE_REL {
        eprintln!("{what} (GPU precision f32): every step's rel: {}", steps.join(" "));
    }
    eprintln!(
        "{what} (GPU precision f32): prefill rel {rel:.3e}, greedy steps worst rel {worst:.3e} ({} steps, {} ids)",
        logged.min(r.greedy_ids.len()),
        r.greedy_ids.len()
    );
    assert!(rel <= PRECISE_REL, "{what}: prefill rel {rel:.3e} > {PRECISE_REL:e}");
    assert!(worst <= PRECISE_REL, "{what}: a greedy step's rel {worst:.3e} > {PRECISE_REL:e}");
    assert_eq!(ids, r.greedy_ids, "{what}: greedy ids");
    rel.max(worst)
}
