//! The family checks every fixtures-next suite runs (`families_oracle`, `deltanet_oracle`): the
//! quantised CPU experts and the GPU / hybrid paths against `quant_bounds.json`'s bars.

use krasis_model::cpu::quantized::WeightBits;
use krasis_model::gpu::{GpuExpertCache, GpuModel, GpuOptions};
use krasis_model::text::sampling::argmax;
use krasis_quant::Bits;

use crate::{fidelity, fixture_next, gpu_available, load_reference, prefill_logits, quant_bound};

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
    let Some(dir) = fixture_next(name) else { return };
    if !gpu_available(name) {
        return;
    }
    let root = dir.parent().unwrap();
    let r = load_reference(&dir);
    let v = r.prefill_logits.len() / r.prompt_ids.len();
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
