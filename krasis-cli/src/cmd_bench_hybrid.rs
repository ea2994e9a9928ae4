//! `krasis bench --model DIR --device hybrid`: the hybrid engine's prefill and decode, with the
//! decode step split into CPU expert time (and its GB/s against the host's bandwidth probe,
//! measured in the same run before the model loads), GPU time as the host waits for it, and the
//! rest; plus load time and resident memory against one copy of the quantised experts.

use std::path::Path;
use std::time::Instant;

use krasis_core::budget::format_bytes;
use krasis_model::runtime::EngineConfig;
use krasis_model::text::sampling::{Sampler, SamplingParams};
use serde_json::{json, Value};

use crate::cmd_bench::Args;

pub fn model(dir: &Path, a: &Args, config: &EngineConfig, text: bool) -> anyhow::Result<Value> {
    let bw = crate::cmd_bench::probe_bandwidth(a)?;
    if text {
        println!(
            "host read bandwidth (in-run probe): {:.1} GB/s on {} threads (median repetition {:.1}: {})",
            bw.gb_per_s,
            bw.threads,
            bw.median_gb_per_s,
            bw.per_rep.iter().map(|g| format!("{g:.1}")).collect::<Vec<_>>().join(" ")
        );
    }
    let (opened, load_s) = crate::cmd_bench::open_for_bench(dir, config, text)?;
    let rss_loaded = krasis_core::hw::current_rss_bytes();
    let m = opened.engine.as_ref();
    let spec = m.spec();
    let moe_layers = spec.moe_layers().count() as u64;
    let (top_k, n_experts) = spec.moe.as_ref().map_or((0, 0), |x| (x.routing.top_k as u64, x.n_routed_experts as u64));
    let expert_bytes = m.stats(None).expert_bytes.unwrap_or(0);
    let prompt = crate::cmd_bench::random_prompt(spec.vocab_size, a.prompt_tokens);
    let mut sampler = Sampler::new(SamplingParams::default());
    // A short warm-up call settles allocations and clocks.
    {
        let mut s = m.new_session()?;
        m.step_one(s.as_mut(), &prompt[..prompt.len().min(8)], &mut sampler, false)?;
    }
    // `--prefill-reps` prefills, each in a fresh session: the first after the warm-up is what a
    // first request sees; with more than one, the reported time is the median of the rest.
    let mut prefill_reps_s = Vec::new();
    let mut prefill_handoffs = Vec::new();
    let (mut s, mut id) = (m.new_session()?, 0);
    for rep in 0..a.prefill_reps.max(1) {
        if rep > 0 {
            // The old session's KV cache and activations go first: a tight --vram-budget holds
            // one session's.
            drop(s);
            s = m.new_session()?;
        }
        let t = Instant::now();
        id = m.step_one(s.as_mut(), &prompt, &mut sampler, false)?.token;
        prefill_reps_s.push(t.elapsed().as_secs_f64());
        prefill_handoffs.push(m.stats(Some(s.as_ref())).handoffs.unwrap_or_default());
    }
    let prefill_s = crate::cmd_bench::warm_median(&prefill_reps_s);
    let h0 = *prefill_handoffs.last().expect("at least one prefill");
    let syncs0 = m.stats(None).host_syncs.unwrap_or(0);
    let t = Instant::now();
    for _ in 0..a.decode_tokens {
        id = m.step_one(s.as_mut(), &[id], &mut sampler, false)?.token;
    }
    let decode_s = t.elapsed().as_secs_f64();
    let after = m.stats(Some(s.as_ref()));
    let h1 = after.handoffs.unwrap_or_default();
    let syncs = (after.host_syncs.unwrap_or(0) - syncs0) as f64 / a.decode_tokens.max(1) as f64;
    let rss_after = krasis_core::hw::current_rss_bytes();
    let n = a.decode_tokens.max(1) as f64;
    let ms = decode_s * 1e3 / n;
    let experts_ms = (h1.experts - h0.experts).as_secs_f64() * 1e3 / n;
    let wait_ms = (h1.wait - h0.wait).as_secs_f64() * 1e3 / n;
    let launch_ms = (h1.launch_wait - h0.launch_wait).as_secs_f64() * 1e3 / n;
    // Prefetching fills the time the CPU would spend waiting for the GPU: both are its share.
    let prefetch_ms = (h1.prefetch - h0.prefetch).as_secs_f64() * 1e3 / n;
    let prefetch_mb = (h1.prefetch_bytes - h0.prefetch_bytes) as f64 / 1e6 / n;
    let predicted = h1.predicted - h0.predicted;
    let hit_rate = (h1.predicted_hits - h0.predicted_hits) as f64 / predicted.max(1) as f64;
    let rest_ms = ms - experts_ms - wait_ms - prefetch_ms - launch_ms;
    // The experts the CPU read (pinned ones run on the GPU): every route's when none is counted.
    let read = h1.experts_read - h0.experts_read;
    let bytes_per_token = match read {
        0 => moe_layers * top_k * expert_bytes,
        r => (r as f64 / n * expert_bytes as f64) as u64,
    };
    let expert_gbs = bytes_per_token as f64 / 1e6 / experts_ms.max(1e-9);
    let one_copy = moe_layers * n_experts * expert_bytes;
    if text {
        println!(
            "hybrid prefill {} tokens: {:.3} s ({:.0} tok/s); decode {} tokens at {}+ context: {:.1} tok/s ({ms:.2} ms/token)",
            a.prompt_tokens,
            prefill_s,
            a.prompt_tokens as f64 / prefill_s,
            a.decode_tokens,
            a.prompt_tokens,
            1e3 / ms
        );
        for (rep, (secs, h)) in prefill_reps_s.iter().zip(&prefill_handoffs).enumerate() {
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            // An expert pool's hand-offs copy experts in instead of computing them.
            let (what, copies) = match h.pool_calls {
                0 => ("CPU experts", String::new()),
                _ => (
                    "enqueueing expert copies",
                    format!("; {} experts copied ({:.1} MB)", h.copied, h.copied_bytes as f64 / 1e6),
                ),
            };
            println!(
                "prefill {}: {:.1} ms; {} hand-offs: {what} {:.1} ms, waiting for the GPU {:.1} ms, for the launches {:.1} ms{copies}",
                rep + 1,
                secs * 1e3,
                h.calls,
                ms(h.experts),
                ms(h.wait),
                ms(h.launch_wait)
            );
        }
        let pooled = h1.pool_calls > h0.pool_calls;
        if pooled {
            println!(
                "per token: enqueueing expert copies {experts_ms:.2} ms, waiting for the routes {:.2} ms, rest {:.2} ms; host syncs per token {syncs:.2}",
                wait_ms,
                ms - experts_ms - wait_ms
            );
        } else {
            println!(
            "per token: CPU experts {experts_ms:.2} ms ({:.1} MB, {expert_gbs:.1} GB/s = {:.0}% of the probe, {:.0}% of its median repetition), waiting for the GPU {:.2} ms (of which prefetching {prefetch_ms:.2} ms, {prefetch_mb:.1} MB), for the launches {launch_ms:.2} ms, rest {rest_ms:.2} ms; host syncs per token {syncs:.2}{}",
            bytes_per_token as f64 / 1e6,
            100.0 * expert_gbs / bw.gb_per_s,
            100.0 * expert_gbs / bw.median_gb_per_s.max(1e-9),
            wait_ms + prefetch_ms,
            match (h1.pcie_routes - h0.pcie_routes) as f64 / n {
                r if r > 0.0 => format!("; the GPU ran {r:.1} routes per token over PCIe"),
                _ => String::new(),
            }
        );
        }
        if h1.copied > h0.copied {
            println!(
                "expert pool: {:.1} of {:.1} touched experts copied per token ({:.1} MB per token over PCIe)",
                (h1.copied - h0.copied) as f64 / n,
                (h1.experts_read - h0.experts_read) as f64 / n,
                (h1.copied_bytes - h0.copied_bytes) as f64 / 1e6 / n
            );
        }
        if predicted > 0 {
            println!("next-layer route prediction: {:.1}% of {predicted} routes right", 100.0 * hit_rate);
        }
        let pulled = h1.pulled_calls - h0.pulled_calls;
        let calls = h1.calls - h0.calls;
        if pulled > 0 && calls > pulled {
            let us = |d: std::time::Duration, n: u64| d.as_secs_f64() * 1e6 / n as f64;
            let with = us(h1.pulled_experts - h0.pulled_experts, pulled);
            let without = us((h1.experts - h0.experts) - (h1.pulled_experts - h0.pulled_experts), calls - pulled);
            println!(
                "CPU experts per hand-off: {with:.1} µs after a pull ({pulled}), {without:.1} µs otherwise ({})",
                calls - pulled
            );
        }
        println!(
            "load {load_s:.2} s; RSS after load {}, after decode {}; one copy of the routed experts {} ({:.2}x)",
            rss_loaded.map_or("n/a".into(), format_bytes),
            rss_after.map_or("n/a".into(), format_bytes),
            format_bytes(one_copy),
            rss_after.map_or(0.0, |r| r as f64 / one_copy.max(1) as f64)
        );
        if krasis_core::knobs::knobs().gpu_profile {
            // Device time per part over as many more (untimed) steps, the hand-off waits inside
            // the FFN part: which GPU work a token's "waiting for the GPU" is.
            m.reset_stats(Some(s.as_mut()));
            for _ in 0..a.decode_tokens {
                id = m.step_one(s.as_mut(), &[id], &mut sampler, false)?.token;
            }
            let profile = m.stats(Some(s.as_ref())).profile.unwrap_or_default();
            println!("decode, {} more steps: {profile}", a.decode_tokens);
        }
    }
    Ok(json!({
        "model": dir.display().to_string(), "device": m.device().name(), "load_s": load_s,
        "membw_gb_per_s": bw.gb_per_s,
        "membw_median_gb_per_s": bw.median_gb_per_s,
        "prefill": { "tokens": a.prompt_tokens, "seconds": prefill_s, "tok_per_s": a.prompt_tokens as f64 / prefill_s,
                     "reps_s": prefill_reps_s,
                     "handoffs": prefill_handoffs.iter().map(|h| json!({ "calls": h.calls,
                         "cpu_experts_s": h.experts.as_secs_f64(), "gpu_wait_s": h.wait.as_secs_f64(),
                         "launch_wait_s": h.launch_wait.as_secs_f64(), "copied_experts": h.copied,
                         "copied_bytes": h.copied_bytes })).collect::<Vec<_>>() },
        "decode": { "tokens": a.decode_tokens, "tok_per_s": 1e3 / ms, "ms_per_token": ms,
                    "cpu_experts_ms_per_token": experts_ms, "gpu_wait_ms_per_token": wait_ms + prefetch_ms, "prefetch_ms_per_token": prefetch_ms, "prefetch_mb_per_token": prefetch_mb, "route_prediction_hit_rate": if predicted > 0 { Some(hit_rate) } else { None }, "launch_wait_ms_per_token": launch_ms, "rest_ms_per_token": rest_ms,
                    "expert_bytes_per_token": bytes_per_token, "expert_gb_per_s": expert_gbs,
                    "expert_fraction_of_membw": expert_gbs / bw.gb_per_s, "host_syncs_per_token": syncs,
                    "copied_experts_per_token": (h1.copied - h0.copied) as f64 / n,
                    "copied_bytes_per_token": (h1.copied_bytes - h0.copied_bytes) as f64 / n },
        "memory": { "rss_after_load": rss_loaded, "rss_after_decode": rss_after, "one_copy_of_experts": one_copy },
    }))
}
