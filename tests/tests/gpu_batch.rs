//! Batched decode on the GPU engines (`Decoder::step_batch`: one forward pass for one token of
//! each of several sessions, attention per sequence over its own KV cache): every sequence must
//! get what it gets stepping alone. Three sessions with prompts of different lengths (so their
//! positions differ), one of them sampling with temperature, top-p and a seed; four batched steps
//! teacher-forced against the same sessions stepped one by one. Checked on the whole-GPU engine
//! (BF16) and on the hybrid (routed experts INT4 on the CPU, handed over once per MoE layer for
//! all the sequences). The batch reads each weight for all rows at once, so sums may round in
//! another order: the logits must agree to a relative L2 error of 1e-4 per row and the sampled
//! ids exactly.
//!
//! Without a GPU every test prints "SKIPPED: no GPU" and passes; `KRASIS_REQUIRE_GPU=1` fails
//! instead.

use krasis_model::cpu::quantized::WeightBits;
use krasis_model::gpu::{GpuModel, GpuOptions};
use krasis_model::text::generate::{Decoder, DecoderStep};
use krasis_model::text::sampling::{Sampler, SamplingParams};
use krasis_tests::{gpu_fixture, GpuFixture};

/// KV tokens per session: the fixtures' prompts plus the decode steps fit easily.
const TEST_KV_TOKENS: usize = 512;
/// Batched decode steps compared.
const STEPS: usize = 4;
/// Largest relative L2 error between a row's logits batched and alone.
const MAX_REL_L2: f64 = 1e-4;

fn samplers() -> Vec<Sampler> {
    vec![
        Sampler::new(SamplingParams::default()),
        Sampler::new(SamplingParams { temperature: 0.8, top_k: 0, top_p: 0.9, seed: 7 }),
        Sampler::new(SamplingParams::default()),
    ]
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        d += (x as f64 - y as f64).powi(2);
        n += (y as f64).powi(2);
    }
    (d / n.max(1e-30)).sqrt()
}

fn check_model(name: &str, what: &str, m: &GpuModel, prompt: &[u32]) {
    // Prompts of 3, half and all of the fixture's prompt: three different positions.
    let prompts: Vec<&[u32]> = vec![&prompt[..3], &prompt[..prompt.len() / 2], prompt];
    let prefill = |samplers: &mut Vec<Sampler>| {
        let mut sessions = Vec::new();
        let mut next = Vec::new();
        for (p, smp) in prompts.iter().zip(samplers.iter_mut()) {
            let mut s = m.new_session().unwrap();
            let (id, _) = m.step(&mut s, p, smp, false).unwrap();
            sessions.push(s);
            next.push(id);
        }
        (sessions, next)
    };

    // Batched: all three sessions advance in one step_batch call per token.
    let mut b_samplers = samplers();
    let (mut b_sessions, mut b_next) = prefill(&mut b_samplers);
    let syncs0 = m.stats(None).host_syncs.unwrap();
    let mut fed = vec![Vec::new(); prompts.len()];
    let mut batched = vec![Vec::new(); prompts.len()];
    for _ in 0..STEPS {
        let toks: Vec<[u32; 1]> = b_next.iter().map(|&id| [id]).collect();
        let mut steps: Vec<DecoderStep<'_, _>> = b_sessions
            .iter_mut()
            .zip(b_samplers.iter_mut())
            .zip(&toks)
            .map(|((session, sampler), t)| DecoderStep { session, tokens: t, sampler, record: true })
            .collect();
        let out = m.step_batch(&mut steps).unwrap();
        for (i, (id, logits)) in out.into_iter().enumerate() {
            fed[i].push(toks[i][0]);
            batched[i].push((id, logits.expect("recorded")));
            b_next[i] = id;
        }
    }
    let syncs = m.stats(None).host_syncs.unwrap() - syncs0;

    // Alone: the same sessions from scratch, each fed the same tokens one step at a time.
    let mut a_samplers = samplers();
    let (mut a_sessions, a_first) = prefill(&mut a_samplers);
    assert_eq!(a_first, fed.iter().map(|f| f[0]).collect::<Vec<_>>(), "{name} {what}: prefill differs between runs");
    for (i, (s, smp)) in a_sessions.iter_mut().zip(a_samplers.iter_mut()).enumerate() {
        for (k, &tok) in fed[i].iter().enumerate() {
            let (id, logits) = m.step(s, &[tok], smp, true).unwrap();
            let logits = logits.expect("recorded");
            let (b_id, b_logits) = &batched[i][k];
            let err = rel_l2(b_logits, &logits);
            eprintln!("{name} {what}: sequence {i} step {k}: rel L2 {err:.2e}, ids {b_id} / {id}");
            assert!(err <= MAX_REL_L2, "{name} {what}: sequence {i} step {k}: logits rel L2 {err:.3e} > {MAX_REL_L2}");
            assert_eq!(*b_id, id, "{name} {what}: sequence {i} step {k}: batched sampled {b_id}, alone {id}");
        }
        assert_eq!(s.position(), prompts[i].len() + STEPS, "{name} {what}: sequence {i} position");
    }
    for (i, s) in b_sessions.iter().enumerate() {
        assert_eq!(s.position(), prompts[i].len() + STEPS, "{name} {what}: batched sequence {i} position");
    }
    eprintln!("{name} {what}: {STEPS} batched steps of {} sequences: {syncs} host synchronisations", prompts.len());
}

fn check(name: &str) {
    let Some(GpuFixture { dir, reference: r, .. }) = gpu_fixture(name) else { return };
    let gpu = GpuOptions { kv_tokens: Some(TEST_KV_TOKENS), ..GpuOptions::default() };
    let m = GpuModel::load(&dir, &gpu).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    check_model(name, "whole-GPU", &m, &r.prompt_ids);
    drop(m);
    let tmp = tempfile::tempdir().unwrap();
    let cpu = krasis_tests::cpu_experts(WeightBits::Int4, tmp.path());
    let m = GpuModel::load_hybrid(&dir, &gpu, &cpu).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    check_model(name, "hybrid int4", &m, &r.prompt_ids);
}

krasis_tests::per_fixture_tests!(check);

/// A gated-DeltaNet hybrid of `../shared/fixtures-next` (Qwen3-Next): each sequence's DeltaNet
/// states (per layer, constant size) advance in the batch as they do alone.
fn check_deltanet(name: &str) {
    let Some(dir) = krasis_tests::fixture_next(name) else { return };
    if !krasis_tests::gpu_available(name) {
        return;
    }
    let r = krasis_tests::load_reference(&dir);
    let gpu = GpuOptions { kv_tokens: Some(TEST_KV_TOKENS), ..GpuOptions::default() };
    let m = GpuModel::load(&dir, &gpu).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    check_model(name, "whole-GPU", &m, &r.prompt_ids);
    drop(m);
    let tmp = tempfile::tempdir().unwrap();
    let cpu = krasis_tests::cpu_experts(WeightBits::Int4, tmp.path());
    let m = GpuModel::load_hybrid(&dir, &gpu, &cpu).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    check_model(name, "hybrid int4", &m, &r.prompt_ids);
}

#[test]
fn qwen3next_deltanet() {
    check_deltanet("qwen3next-tiny");
}
