//! The Engine API on a synthesized tiny model: the same ids as the direct `Decoder` path, a
//! batch step equal to each sequence alone, and early stops without errors.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use super::*;
use crate::cpu::Model;
use crate::source::files::ModelFiles;
use crate::spec::WeightBits;
use crate::synth::{synthesize, Preset, SynthOptions};
use crate::text::generate::{generate, generate_with, Decoder, GenerateRequest, StopReason};
use crate::text::sampling::SamplingParams;

fn tiny(dir: &Path) -> PathBuf {
    let out = dir.join("tiny");
    let opts = SynthOptions { layers: Some(2), seed: 7, ..SynthOptions::new(Preset::Tiny, &out) };
    synthesize(&opts).unwrap();
    out
}

/// The CPU reference path (what the direct `Decoder` path below runs).
fn cpu_config() -> EngineConfig {
    let mut c = EngineConfig { device: DevicePolicy::Cpu, ..EngineConfig::default() };
    (c.cpu.expert_bits, c.cpu.dense_bits) = (WeightBits::Bf16, WeightBits::Bf16);
    c
}

fn open_cpu_engine(dir: &Path) -> Opened {
    open_engine(&ModelFiles::open(dir).unwrap(), &cpu_config()).unwrap()
}

const SAMPLED: SamplingParams = SamplingParams { temperature: 0.8, top_k: 20, top_p: 0.9, seed: 3 };

fn request(prompt: &[u32], max_new_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: prompt.to_vec(),
        max_new_tokens,
        sampling: SAMPLED,
        ignore_eos: true,
        record_logits: false,
    }
}

/// The loop `generate` runs, written directly against the concrete `Decoder`.
fn direct_ids(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = Decoder::new_session(model).unwrap();
    let mut sampler = Sampler::new(SAMPLED);
    let (mut id, _) = model.step(&mut s, prompt, &mut sampler, false).unwrap();
    let mut ids = vec![id];
    while ids.len() < n {
        id = model.step(&mut s, &[id], &mut sampler, false).unwrap().0;
        ids.push(id);
    }
    ids
}

#[test]
fn generation_through_the_engine_matches_the_direct_decoder_path() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny(tmp.path());
    let opened = open_cpu_engine(&dir);
    assert_eq!(opened.engine.device(), DevicePath::Cpu);
    assert_eq!(opened.why, "device: cpu (as asked)");
    assert!(opened.memory_estimate.is_some() && !opened.check_rss);
    let prompt = [5u32, 9, 200, 3, 77];
    let out = generate(opened.engine.as_ref(), &request(&prompt, 12), |_| Ok(())).unwrap();
    assert_eq!(out.stop, StopReason::MaxTokens);
    let model = Model::load(&dir).unwrap();
    assert_eq!(out.generated, direct_ids(&model, &prompt, 12));
    // The engine's own session bookkeeping: prompt + 11 decode steps (the 12th id is not run).
    let mut s = opened.engine.new_session().unwrap();
    let mut sampler = Sampler::new(SAMPLED);
    opened.engine.step_one(s.as_mut(), &prompt, &mut sampler, false).unwrap();
    assert_eq!(s.position(), prompt.len());
    assert!(s.kv_bytes() > 0 && s.kv_capacity().is_none());
}

#[test]
fn a_batch_step_of_two_sequences_equals_each_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = open_cpu_engine(&tiny(tmp.path())).engine;
    let prompts: [&[u32]; 2] = [&[5, 9, 200, 3], &[17, 4, 300, 11, 2, 8, 90]];
    let params = [SAMPLED, SamplingParams { seed: 11, temperature: 1.1, ..SAMPLED }];
    let steps = 4;

    // Each alone: prefill, then decode steps, keeping every token and the logits.
    let alone: Vec<Vec<StepOutput>> = (0..2)
        .map(|i| {
            let mut s = engine.new_session().unwrap();
            let mut sampler = Sampler::new(params[i]);
            let mut outs = vec![engine.step_one(s.as_mut(), prompts[i], &mut sampler, true).unwrap()];
            for _ in 1..steps {
                let last = outs.last().unwrap().token;
                outs.push(engine.step_one(s.as_mut(), &[last], &mut sampler, true).unwrap());
            }
            outs
        })
        .collect();

    // Together: one call per step advances both.
    let (mut s0, mut s1) = (engine.new_session().unwrap(), engine.new_session().unwrap());
    let (mut r0, mut r1) = (Sampler::new(params[0]), Sampler::new(params[1]));
    let mut tokens: [Vec<u32>; 2] = [prompts[0].to_vec(), prompts[1].to_vec()];
    let mut together: Vec<Vec<StepOutput>> = vec![Vec::new(), Vec::new()];
    for _ in 0..steps {
        let mut batch = [
            SequenceStep { session: s0.as_mut(), tokens: &tokens[0], sampler: &mut r0, want_logits: true },
            SequenceStep { session: s1.as_mut(), tokens: &tokens[1], sampler: &mut r1, want_logits: true },
        ];
        let outs = engine.step(&mut batch).unwrap();
        assert_eq!(outs.len(), 2);
        tokens = [vec![outs[0].token], vec![outs[1].token]];
        for (seq, o) in together.iter_mut().zip(outs) {
            seq.push(o);
        }
    }
    assert!(together == alone, "a batch step differs from the sequences run alone");
    assert_eq!(s0.position(), prompts[0].len() + steps - 1);
    assert_eq!(s1.position(), prompts[1].len() + steps - 1);
}

/// Sequences that join a batch at different steps (one prefills while the others decode), on
/// the reference experts and on the INT4 pool: each sequence's tokens and logits are bit-for-bit
/// those it gets alone, so a server's concurrent streams equal their solo runs.
#[test]
fn staggered_sequences_in_one_batch_equal_each_alone_reference_and_int4() {
    use crate::cpu::quantized::WeightBits;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny(tmp.path());
    for bits in [WeightBits::Bf16, WeightBits::Int4] {
        let mut config = cpu_config();
        config.cpu.expert_bits = bits;
        config.cpu.cache_dir = Some(tmp.path().join("cache"));
        let engine = open_engine(&ModelFiles::open(&dir).unwrap(), &config).unwrap().engine;
        let prompts: [&[u32]; 3] = [&[5, 9, 200, 3], &[17, 4, 300, 11, 2, 8, 90], &[42]];
        let starts = [0usize, 1, 3];
        let steps = 5;
        let params = |i: usize| SamplingParams { seed: 20 + i as u64, ..SAMPLED };
        let alone: Vec<Vec<StepOutput>> = (0..3)
            .map(|i| {
                let mut s = engine.new_session().unwrap();
                let mut sampler = Sampler::new(params(i));
                let mut tokens = prompts[i].to_vec();
                (0..steps)
                    .map(|_| {
                        let o = engine.step_one(s.as_mut(), &tokens, &mut sampler, true).unwrap();
                        tokens = vec![o.token];
                        o
                    })
                    .collect()
            })
            .collect();
        let mut sessions: Vec<_> = (0..3).map(|_| engine.new_session().unwrap()).collect();
        let mut samplers: Vec<_> = (0..3).map(|i| Sampler::new(params(i))).collect();
        let mut tokens: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
        let mut together: Vec<Vec<StepOutput>> = vec![Vec::new(); 3];
        for step in 0..starts[2] + steps {
            let live: Vec<usize> = (0..3).filter(|&i| step >= starts[i] && step < starts[i] + steps).collect();
            let mut batch: Vec<SequenceStep<'_>> = sessions
                .iter_mut()
                .zip(samplers.iter_mut())
                .zip(&tokens)
                .enumerate()
                .filter(|(i, _)| live.contains(i))
                .map(|(_, ((s, r), t))| SequenceStep { session: s.as_mut(), tokens: t, sampler: r, want_logits: true })
                .collect();
            let outs = engine.step(&mut batch).unwrap();
            drop(batch);
            for (&i, o) in live.iter().zip(outs) {
                tokens[i] = vec![o.token];
                together[i].push(o);
            }
        }
        for i in 0..3 {
            assert!(together[i] == alone[i], "{bits:?}: sequence {i} differs in a batch from alone");
        }
    }
}

#[test]
fn bad_batches_fail_without_advancing_any_sequence() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = open_cpu_engine(&tiny(tmp.path())).engine;
    let vocab = engine.spec().vocab_size as u32;
    let (mut s0, mut s1) = (engine.new_session().unwrap(), engine.new_session().unwrap());
    let (mut r0, mut r1) = (Sampler::new(SAMPLED), Sampler::new(SAMPLED));
    let mut batch = [
        SequenceStep { session: s0.as_mut(), tokens: &[1, 2], sampler: &mut r0, want_logits: false },
        SequenceStep { session: s1.as_mut(), tokens: &[3, vocab], sampler: &mut r1, want_logits: false },
    ];
    let e = engine.step(&mut batch).unwrap_err().to_string();
    assert!(e.contains("outside the vocabulary") && e.contains("position 1"), "{e}");
    let mut batch = [SequenceStep { session: s1.as_mut(), tokens: &[], sampler: &mut r1, want_logits: false }];
    let e = engine.step(&mut batch).unwrap_err().to_string();
    assert!(e.contains("no tokens"), "{e}");
    assert_eq!((s0.position(), s1.position()), (0, 0));

    /// A session of some other engine.
    struct Foreign;
    impl EngineSession for Foreign {
        fn position(&self) -> usize {
            0
        }
        fn kv_capacity(&self) -> Option<usize> {
            None
        }
        fn kv_bytes(&self) -> usize {
            0
        }
    }
    let e = engine.step_one(&mut Foreign, &[1], &mut r0, false).unwrap_err().to_string();
    assert!(e.contains("another kind of engine"), "{e}");
}

#[test]
fn a_callback_stop_and_a_cancel_token_end_generation_without_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = open_cpu_engine(&tiny(tmp.path())).engine;
    let req = request(&[5, 9, 200, 3], 10);
    let full = generate(engine.as_ref(), &req, |_| Ok(())).unwrap();
    assert_eq!(full.generated.len(), 10);

    // The callback asks to stop after the third token.
    let mut seen = 0;
    let never = CancelToken::new();
    let out = generate_with(engine.as_ref(), &req, &never, |_| {
        seen += 1;
        Ok(if seen == 3 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) })
    })
    .unwrap();
    assert_eq!(out.stop, StopReason::StopRequested);
    assert_eq!(out.generated, full.generated[..3]);
    assert!(!out.stopped_at_eos);

    // Another holder of the token cancels after the second token: no further step runs.
    let cancel = CancelToken::new();
    let remote = cancel.clone();
    let mut seen = 0;
    let out = generate_with(engine.as_ref(), &req, &cancel, |_| {
        seen += 1;
        if seen == 2 {
            remote.cancel();
        }
        Ok(ControlFlow::Continue(()))
    })
    .unwrap();
    assert_eq!(out.stop, StopReason::Cancelled);
    assert_eq!(out.generated, full.generated[..2]);
    assert_eq!(out.stop.finish_reason(), None);

    // Cancelled before it starts: nothing runs.
    let out = generate_with(engine.as_ref(), &req, &cancel, |_| Ok(ControlFlow::Continue(()))).unwrap();
    assert_eq!(out.stop, StopReason::Cancelled);
    assert!(out.generated.is_empty());

    // An error from the callback is still an error.
    let e = generate(engine.as_ref(), &req, |_| Err(crate::ModelError::Invalid("client gone".into()))).unwrap_err();
    assert!(e.to_string().contains("client gone"));
}

#[test]
fn hybrid_opens_on_a_gpu_and_names_the_missing_gpu_otherwise() {
    let tmp = tempfile::tempdir().unwrap();
    let files = ModelFiles::open(&tiny(tmp.path())).unwrap();
    let config = EngineConfig { device: DevicePolicy::Hybrid, ..EngineConfig::default() };
    match krasis_gpu::probe_ordinal(0) {
        Ok(_) => {
            let opened = open_engine(&files, &config).unwrap();
            assert_eq!(opened.engine.device(), DevicePath::Hybrid);
            assert!(opened.why.starts_with("device: hybrid (as asked"), "{}", opened.why);
        }
        Err(_) => {
            let e = open_engine(&files, &config).err().expect("no GPU").to_string();
            assert!(e.starts_with("`DevicePolicy::Hybrid`: "), "{e}");
        }
    }
}

#[test]
fn auto_without_a_gpu_runs_on_the_cpu_and_says_why() {
    let tmp = tempfile::tempdir().unwrap();
    let files = ModelFiles::open(&tiny(tmp.path())).unwrap();
    let gpu = krasis_gpu::probe_ordinal(0).is_ok();
    let opened = open_engine(&files, &EngineConfig::default()).unwrap();
    if gpu {
        assert_eq!(opened.engine.device(), DevicePath::Gpu, "{}", opened.why);
        assert!(opened.why.starts_with("device: gpu (auto: CUDA device 0 found"), "{}", opened.why);
    } else {
        assert_eq!(opened.engine.device(), DevicePath::Cpu);
        assert!(opened.why.starts_with("device: cpu (auto: no GPU in use"), "{}", opened.why);
        assert!(opened.why.ends_with("running on the CPU)"), "{}", opened.why);
        let config = EngineConfig { device: DevicePolicy::Gpu, ..EngineConfig::default() };
        let e = open_engine(&files, &config).err().expect("no GPU").to_string();
        assert!(e.starts_with("`DevicePolicy::Gpu`: "), "{e}");
    }
}

/// `record_heatmap`: every MoE layer's row counts each token `top_k` times, dense layers none,
/// on the CPU and (where there is a GPU) on the whole-GPU and hybrid engines, whose counts match
/// the CPU's up to routes that flip at near ties; without it an engine reports no counts.
#[test]
fn heatmap_counts_every_route_on_each_device() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny(tmp.path());
    let files = ModelFiles::open(&dir).unwrap();
    let prompt = [5u32, 9, 17, 3, 44, 2, 8];
    let greedy = GenerateRequest {
        sampling: SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 },
        ..request(&prompt, 6)
    };
    let counts = |device: DevicePolicy| -> Vec<u64> {
        let config = EngineConfig { device, record_heatmap: true, ..EngineConfig::default() };
        let opened = open_engine(&files, &config).unwrap();
        let engine = opened.engine.as_ref();
        assert_eq!(engine.expert_counts().unwrap(), Some(vec![0; engine.spec().num_layers * 8]), "{device:?}");
        let out = generate(engine, &greedy, |_| Ok(())).unwrap();
        assert_eq!(out.generated.len(), 6);
        engine.expert_counts().unwrap().expect("recording")
    };
    let spec = files.spec().clone();
    let (e, k) = (spec.moe.as_ref().unwrap().n_routed_experts, spec.moe.as_ref().unwrap().routing.top_k);
    assert_eq!(e, 8);
    let tokens = (prompt.len() + 6 - 1) as u64; // the last sampled token is not run
    let cpu = counts(DevicePolicy::Cpu);
    for (l, row) in cpu.chunks(e).enumerate() {
        let want = if spec.layers[l] == krasis_core::spec::FfnKind::Moe { tokens * k as u64 } else { 0 };
        assert_eq!(row.iter().sum::<u64>(), want, "CPU layer {l}: {row:?}");
    }
    let heat = crate::placement::heatmap::ExpertHeat::from_counts("tiny", spec.num_layers, e, k, &cpu);
    assert_eq!(heat.tokens, tokens);
    let plain = open_engine(&files, &cpu_config()).unwrap();
    assert_eq!(plain.engine.expert_counts().unwrap(), None);

    if krasis_gpu::probe_ordinal(0).is_err() {
        eprintln!("SKIPPED (GPU part): no GPU");
        return;
    }
    for device in [DevicePolicy::Gpu, DevicePolicy::Hybrid] {
        let gpu = counts(device);
        let mut same = 0;
        for (l, (g, c)) in gpu.chunks(e).zip(cpu.chunks(e)).enumerate() {
            assert_eq!(g.iter().sum::<u64>(), c.iter().sum::<u64>(), "{device:?} layer {l}: {g:?} vs CPU {c:?}");
            same += g.iter().zip(c).map(|(a, b)| a.min(b)).sum::<u64>();
        }
        let all: u64 = cpu.iter().sum();
        assert!(same * 10 >= all * 9, "{device:?}: only {same} of {all} routes agree with the CPU's");
    }
}

#[test]
fn a_cpu_kv_token_limit_is_the_context_and_generation_refuses_what_exceeds_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny(tmp.path());
    let files = ModelFiles::open(&dir).unwrap();
    let unlimited = open_engine(&files, &cpu_config()).unwrap().engine;
    assert_eq!(unlimited.kv_capacity(), None);
    assert_eq!(context_limit(unlimited.as_ref()), files.spec().max_position_embeddings);
    let mut config = cpu_config();
    config.gpu.kv_tokens = Some(8);
    let engine = open_engine(&files, &config).unwrap().engine;
    assert_eq!(engine.kv_capacity(), Some(8));
    assert_eq!(context_limit(engine.as_ref()), 8);
    // Within the limit: runs. Past it: refused before anything runs, naming the context.
    let out = generate(engine.as_ref(), &request(&[5, 9, 200], 5), |_| Ok(())).unwrap();
    assert_eq!(out.generated.len(), 5);
    let e = generate(engine.as_ref(), &request(&[5, 9, 200], 6), |_| Ok(())).unwrap_err().to_string();
    assert!(e.contains("context is 8 tokens") && e.contains("3 prompt + 6 to generate"), "{e}");
    // A step past the limit fails without advancing the session.
    let mut s = engine.new_session().unwrap();
    let mut sampler = Sampler::new(SAMPLED);
    engine.step_one(s.as_mut(), &[1, 2, 3, 4, 5, 6], &mut sampler, false).unwrap();
    let e = engine.step_one(s.as_mut(), &[1, 2, 3], &mut sampler, false).unwrap_err().to_string();
    assert!(e.contains("context full") && e.contains("limit of 8 tokens"), "{e}");
    assert_eq!(s.position(), 6);
}

/// Asking for nothing on the CPU gets the fast path: asymmetric INT4 g32 routed experts (on a
/// checkpoint of float experts) and INT8 dense weights, built into the caches on first use; the
/// reference path is an explicit `bf16`.
#[test]
fn the_cpu_default_is_int4a_experts_and_int8_dense() {
    let tmp = tempfile::tempdir().unwrap();
    let files = ModelFiles::open(&tiny(tmp.path())).unwrap();
    let config = EngineConfig { device: DevicePolicy::Cpu, ..EngineConfig::default() };
    let opened = open_engine(&files, &config).unwrap();
    let log = opened.log.join("\n");
    assert!(log.contains("routed experts: cpu INT4 asymmetric g32"), "{log}");
    assert!(log.contains("experts_cpu_int4a_g32.bin"), "{log}");
    // The RSS check holds the engine to the estimate at the width it runs, not the one `auto`
    // resolves to before the device choice (INT4 g128): a run read 15 % over that one.
    let at = |bits| {
        let mut c = EngineConfig { device: DevicePolicy::Cpu, ..EngineConfig::default() };
        c.cpu.expert_bits = bits;
        super::open::cpu_memory_estimate(&files, &c).expert_bytes
    };
    let held = opened.resident_estimate.expect("the CPU engine's estimate").expert_bytes;
    assert_eq!(held, at(WeightBits::Int4Asym));
    assert!(held > at(WeightBits::Int4), "4a holds more than INT4 g128");
    assert!(log.contains("dense-weight cache") && log.contains("dense_cpu_int8"), "{log}");
    let reference = open_engine(&files, &cpu_config()).unwrap();
    let log = reference.log.join("\n");
    assert!(log.contains("routed experts: reference"), "{log}");
}

/// `auto`'s CPU experts on float experts are asymmetric INT4 g32 for the hybrid too, whose prefill
/// then streams them as INT8 g32; a GPU expert width of 4 asked for keeps INT4 g128 on the CPU (its
/// records stream as they are), and 8 takes `4a` (it converts to INT8).
#[test]
fn auto_cpu_experts_are_int4a_unless_the_gpu_width_asked_is_int4() {
    let tmp = tempfile::tempdir().unwrap();
    let files = ModelFiles::open(&tiny(tmp.path())).unwrap();
    let resolved = |gpu_width: WeightBits| {
        let mut c =
            EngineConfig { device: DevicePolicy::Hybrid, gpu_expert_width: gpu_width, ..EngineConfig::default() };
        c.cpu.expert_bits = WeightBits::Int4;
        assert_eq!(super::open::cpu_expert_default(&files, &mut c), None, "the tiny model fits");
        c
    };
    let c = resolved(WeightBits::Auto);
    assert_eq!(c.cpu.expert_bits, WeightBits::Int4Asym);
    let hybrid = crate::placement::device::hybrid_defaults(files.spec(), &c, None);
    assert_eq!(hybrid.gpu.expert_bits, Some(krasis_quant::Bits::Int8), "4a streams as INT8 g32");
    assert_eq!(resolved(WeightBits::Int4).cpu.expert_bits, WeightBits::Int4);
    assert_eq!(resolved(WeightBits::Int8).cpu.expert_bits, WeightBits::Int4Asym);
}

/// The hybrid defaults pin by the heatmap beside the caches when it fits the model, and pass over
/// a damaged one (pins then spread evenly) rather than refuse to start.
#[test]
fn hybrid_pins_by_the_heatmap_beside_the_caches_and_pass_over_a_damaged_one() {
    let tmp = tempfile::tempdir().unwrap();
    let files = ModelFiles::open(&tiny(tmp.path())).unwrap();
    let cache = tmp.path().join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let mut config = EngineConfig { device: DevicePolicy::Hybrid, ..EngineConfig::default() };
    config.cpu.cache_dir = Some(cache.clone());
    config.cpu.expert_bits = WeightBits::Int4;
    let plan = |c: &EngineConfig| super::open::hybrid_defaults(&files, c).gpu.cache.expect("default pins");
    assert_eq!(plan(&config).heatmap, None, "no heatmap recorded: pins spread evenly");
    let path = cache.join(crate::placement::heatmap::DEFAULT_HEATMAP_FILE);
    std::fs::write(&path, b"{ not a heatmap").unwrap();
    assert_eq!(plan(&config).heatmap, None, "a damaged heatmap is passed over");
    let spec = files.spec();
    let (n, k) = (spec.routed_experts(), spec.moe.as_ref().unwrap().routing.top_k);
    crate::placement::heatmap::ExpertHeat::from_counts("tiny", spec.num_layers, n, k, &vec![1; spec.num_layers * n])
        .save(&path)
        .unwrap();
    let p = plan(&config);
    assert_eq!((p.strategy, p.heatmap.as_deref()), (crate::gpu::CacheStrategy::HotCachedStatic, Some(path.as_path())));
    // Pinning off, or the CPU reference experts (nothing to stream or pin from): no plan.
    config.pin_leftover_vram = false;
    assert!(super::open::hybrid_defaults(&files, &config).gpu.cache.is_none());
    config.pin_leftover_vram = true;
    config.cpu.expert_bits = WeightBits::Bf16;
    assert!(super::open::hybrid_defaults(&files, &config).gpu.cache.is_none());
}

/// The CPU engine's stats: the forward-time split (started over by `reset_stats`), the bytes a
/// token reads, nothing a GPU path reports, nothing per session; a foreign session counts as none.
#[test]
fn cpu_engine_stats_report_the_forward_split_and_reset_starts_it_over() {
    let tmp = tempfile::tempdir().unwrap();
    let files = ModelFiles::open(&tiny(tmp.path())).unwrap();
    // The default CPU path: INT4 experts (an expert size to report) and INT8 dense weights.
    let config = EngineConfig { device: DevicePolicy::Cpu, ..EngineConfig::default() };
    let engine = open_engine(&files, &config).unwrap().engine;
    let fresh = engine.stats(None);
    assert!(fresh.expert_bytes.is_some_and(|b| b > 0), "{fresh:?}");
    assert!(fresh.dense_bytes_per_token.is_some_and(|b| b > 0), "{fresh:?}");
    let none_on_the_cpu = EngineStats {
        expert_bytes: fresh.expert_bytes,
        dense_bytes_per_token: fresh.dense_bytes_per_token,
        forward: fresh.forward,
        ..EngineStats::default()
    };
    assert_eq!(fresh, none_on_the_cpu, "no host syncs, hand-offs, profile or VRAM experts on the CPU");

    let mut s = engine.new_session().unwrap();
    let mut sampler = Sampler::new(SAMPLED);
    engine.step_one(s.as_mut(), &[5, 9, 200, 3], &mut sampler, false).unwrap();
    let ran = engine.stats(Some(s.as_ref()));
    let f = ran.forward.expect("the CPU engine times its forward calls");
    assert!(f.total > 0.0 && f.experts > 0.0 && f.attention > 0.0 && f.total >= f.experts + f.attention, "{f:?}");
    assert_eq!((ran.handoffs, ran.profile.as_deref()), (None, None), "nothing per session on the CPU");

    engine.reset_stats(Some(s.as_mut()));
    assert_eq!(engine.stats(None).forward, Some(ForwardBreakdown::default()), "reset starts the split over");

    struct Foreign;
    impl EngineSession for Foreign {
        fn position(&self) -> usize {
            0
        }
        fn kv_capacity(&self) -> Option<usize> {
            None
        }
        fn kv_bytes(&self) -> usize {
            0
        }
    }
    assert_eq!(engine.stats(Some(&Foreign)), engine.stats(None));
    engine.reset_stats(Some(&mut Foreign));
}

/// Two CPU engines in one process, stepped from two threads at the same time, each run their
/// dense ops on their own worker pool (the forward calls' `krasis_cpu::par` sees it).
#[test]
fn two_cpu_engines_in_one_process_each_run_on_their_own_pool() {
    use std::sync::Arc;

    use krasis_cpu::pool::{PoolPlan, WorkerPool};

    use crate::cpu::Logits;

    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny(tmp.path());
    // Neither size is rayon's on a small machine, so a call on rayon would show.
    let engines: Vec<(Model, usize)> = [5usize, 7]
        .into_iter()
        .map(|workers| {
            let mut m = Model::load(&dir).unwrap();
            m.set_pool(Arc::new(WorkerPool::new(PoolPlan::simulated(1, workers)).unwrap()));
            (m, workers)
        })
        .collect();
    let start = std::sync::Barrier::new(engines.len());
    std::thread::scope(|scope| {
        for (model, workers) in &engines {
            let start = &start;
            scope.spawn(move || {
                start.wait();
                for _ in 0..3 {
                    let mut s = model.new_session();
                    let mut seen = Vec::new();
                    let mut observe = |_: usize, _: &[f32]| seen.push(krasis_cpu::par::threads());
                    model.forward(&mut s, &[5, 9, 200, 3], Logits::Last, Some(&mut observe)).unwrap();
                    assert!(!seen.is_empty() && seen.iter().all(|t| t == workers), "{workers} workers: {seen:?}");
                }
            });
        }
    });
    // Outside the engines' calls no pool is current.
    assert_eq!(krasis_cpu::par::threads(), rayon::current_num_threads());
}
