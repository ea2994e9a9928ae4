//! `krasis bench` on the GPU: the attention kernels at V2-Lite shapes (`--gpu-attention`) and a
//! whole model on the GPU (`--model DIR --device gpu`), each figure also given against the GPU's
//! peak (BF16 tensor throughput, DRAM bandwidth).

use std::path::Path;
use std::time::Instant;

use krasis_gpu::flash_prefill::{bench_gqa_prefill, bench_mla_prefill};
use krasis_gpu::kv_cache::KvDtype;
use krasis_gpu::{bench_mla_decode, GpuDevice, VramBudgetSpec};
use krasis_model::runtime::EngineConfig;
use krasis_model::text::generate::{generate, GenerateRequest};
use krasis_model::text::sampling::{Sampler, SamplingParams};
use serde_json::{json, Value};

/// Dense BF16 tensor-core peak (FLOP/s) of the GPUs we measure on, from NVIDIA's data sheets
/// (SXM parts, without sparsity). Unknown GPUs get no ratio rather than a guessed one.
fn bf16_peak_flops(name: &str) -> Option<f64> {
    let n = name.to_ascii_uppercase();
    if n.contains("H100") || n.contains("H200") || n.contains("GH200") {
        Some(989.4e12)
    } else if n.contains("A100") {
        Some(312e12)
    } else {
        None
    }
}

/// Query tokens of the MLA prefill benchmark (the 8K).
const PREFILL_TOKENS: usize = 8192;
/// Context of the decode-attention benchmark (the 4K).
const DECODE_CONTEXT: usize = 4096;

pub fn attention(ordinal: usize, budget: VramBudgetSpec, text: bool) -> anyhow::Result<Value> {
    let dev = GpuDevice::open(ordinal, budget)?;
    dev.warm_up_kernels()?;
    let info = dev.info().clone();
    let peak = bf16_peak_flops(&info.name);
    let hbm = info.dram_peak_bytes_per_s as f64;
    if text {
        println!(
            "{info}; BF16 peak {}; DRAM peak {:.0} GB/s",
            peak.map_or("unknown".into(), |p| format!("{:.0} TFLOP/s", p / 1e12)),
            hbm / 1e9
        );
    }
    let mut prefill = Vec::new();
    for (what, r) in [
        ("mla (V2-Lite: 16 heads, 128+64 / 128)", bench_mla_prefill(&dev, None, PREFILL_TOKENS, 10)?),
        ("gqa (32/4 heads, 128)", bench_gqa_prefill(&dev, None, PREFILL_TOKENS, 10)?),
    ] {
        let frac = peak.map(|p| r.tflops * 1e12 / p);
        if text {
            println!(
                "prefill attention {what}, {} tokens causal: {:.2} ms, {:.1} TFLOP/s{} [{:?}]",
                r.tokens,
                r.seconds * 1e3,
                r.tflops,
                frac.map_or(String::new(), |f| format!(" ({:.1}% of BF16 peak)", 100.0 * f)),
                r.kernel
            );
        }
        prefill.push(json!({ "what": what, "tokens": r.tokens, "seconds": r.seconds, "tflops": r.tflops,
                             "fraction_of_bf16_peak": frac, "kernel": format!("{:?}", r.kernel) }));
    }
    let mut decode = Vec::new();
    for dtype in [KvDtype::Bf16, KvDtype::Fp8] {
        let r = bench_mla_decode(&dev, DECODE_CONTEXT, dtype, 200)?;
        for (what, t) in [("one layer", &r.one_layer), ("27 layers", &r.many_layers)] {
            let frac = (hbm > 0.0).then(|| t.gb_per_s * 1e9 / hbm);
            if text {
                println!(
                    "decode attention MLA absorbed, {} context, {dtype} KV, {what}: {:.1} µs, {:.0} GB/s{} ({} splits)",
                    r.context,
                    t.seconds_per_call * 1e6,
                    t.gb_per_s,
                    frac.map_or(String::new(), |f| format!(" ({:.0}% of DRAM peak)", 100.0 * f)),
                    r.splits
                );
            }
            decode.push(json!({ "kv_dtype": dtype.to_string(), "what": what, "context": r.context, "layers": t.layers,
                                "seconds_per_call": t.seconds_per_call, "gb_per_s": t.gb_per_s,
                                "fraction_of_dram_peak": frac, "splits": r.splits }));
        }
    }
    Ok(json!({ "gpu": info.to_string(), "bf16_peak_flops": peak, "dram_peak_bytes_per_s": hbm,
               "prefill_attention": prefill, "decode_attention": decode }))
}

/// Prefill + greedy decode of random prompt ids on the engine `config` opens (the whole model on
/// the GPU, or what `--device` names).
pub fn model(
    dir: &Path,
    config: &EngineConfig,
    prompt_tokens: usize,
    decode_tokens: usize,
    text: bool,
) -> anyhow::Result<Value> {
    let (opened, load_s) = crate::cmd_bench::open_for_bench(dir, config, text)?;
    let engine = opened.engine.as_ref();
    let prompt = crate::cmd_bench::random_prompt(engine.spec().vocab_size, prompt_tokens);
    let req = GenerateRequest {
        prompt_ids: prompt,
        max_new_tokens: decode_tokens + 1,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        record_logits: false,
    };
    // One untimed run compiles nothing new but settles allocations and clocks.
    generate(engine, &GenerateRequest { max_new_tokens: 2, ..req.clone() }, |_| Ok(()))?;
    let out = generate(engine, &req, |_| Ok(()))?;
    if text && krasis_core::knobs::knobs().gpu_profile {
        // Device time per part (CUDA events), against the wall time of the same steps.
        let mut s = engine.new_session()?;
        let mut sampler = Sampler::new(SamplingParams::default());
        let mut id = engine.step_one(s.as_mut(), &req.prompt_ids, &mut sampler, false)?.token;
        println!("prefill of {prompt_tokens} tokens: {}", engine.stats(Some(s.as_ref())).profile.unwrap_or_default());
        engine.reset_stats(Some(s.as_mut()));
        let t = Instant::now();
        for _ in 0..decode_tokens {
            id = engine.step_one(s.as_mut(), &[id], &mut sampler, false)?.token;
        }
        let wall_ms = t.elapsed().as_secs_f64() * 1e3 / decode_tokens as f64;
        println!(
            "decode: {}; wall {wall_ms:.3} ms per step",
            engine.stats(Some(s.as_ref())).profile.unwrap_or_default()
        );
    }
    let prefill_tps = out.prefill_tok_s(prompt_tokens);
    let decode_tps = out.decode_tok_s();
    let syncs = out.host_syncs_per_token;
    if text {
        println!(
            "{} prefill {prompt_tokens} tokens: {:.3} s ({prefill_tps:.0} tok/s); decode {decode_tokens} tokens: {decode_tps:.1} tok/s ({:.2} ms/token); host syncs per decoded token {}",
            engine.device().name().to_uppercase(),
            out.prefill_time.as_secs_f64(),
            1e3 / decode_tps.max(1e-9),
            syncs.map_or("n/a".into(), |s| format!("{s:.2}"))
        );
    }
    Ok(json!({ "model": dir.display().to_string(), "device": engine.device().name(), "load_s": load_s,
               "kv_tokens": engine.kv_capacity(), "kv_dtype": config.gpu.kv_dtype.to_string(),
               "prefill": { "tokens": prompt_tokens, "seconds": out.prefill_time.as_secs_f64(), "tok_per_s": prefill_tps },
               "decode": { "tokens": decode_tokens, "tok_per_s": decode_tps, "host_syncs_per_token": syncs } }))
}
