//! Shared helpers for the integration tests: locating the HF oracle fixtures and reading them.

use std::path::{Path, PathBuf};

pub mod family_checks;

use krasis_model::source::SafetensorsFile;
use krasis_model::text::sampling::argmax;

pub const FIXTURE_NAMES: &[&str] =
    &["dsv2-lite-tiny", "dsv2-k256-tiny", "dsv2-grouped-tiny", "dsv3-tiny", "dsv3-fp8-tiny", "qwen3moe-tiny"];

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// Says that the running test checked nothing, and why, on the process's stderr itself: the
/// harness captures `eprintln!` of passing tests, so a skip reported that way never shows. The
/// line starts `*** SKIPPED` (`.ci/run` counts these lines).
pub fn report_skip(why: &str) {
    use std::io::Write;
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    // One write, so parallel tests' output does not split the line.
    let line = format!("*** SKIPPED {test}: {why} — it checked nothing ***\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Where the HF oracle fixtures are looked for: `KRASIS_FIXTURES` alone when set, else
/// `../shared/fixtures` from the workspace root, then `.fixtures` in it (where
/// `scripts/make-fixtures.sh` writes them by default).
pub fn fixture_candidates() -> Vec<PathBuf> {
    candidates_for(std::env::var_os("KRASIS_FIXTURES"))
}

fn candidates_for(krasis_fixtures: Option<std::ffi::OsString>) -> Vec<PathBuf> {
    match krasis_fixtures {
        Some(dir) => vec![PathBuf::from(dir)],
        None => vec![workspace_root().join("../shared/fixtures"), workspace_root().join(".fixtures")],
    }
}

/// A fixture this check needs is missing (`msg` says which and what makes it): a failure under
/// `KRASIS_REQUIRE_FIXTURES=1` (set by `.ci/run`), else a visible [`report_skip`].
pub fn missing_fixture(msg: &str) {
    if std::env::var("KRASIS_REQUIRE_FIXTURES").as_deref() == Ok("1") {
        panic!("KRASIS_REQUIRE_FIXTURES=1 but {msg}");
    }
    report_skip(msg);
}

/// The first of [`fixture_candidates`] that holds the fixtures. `None` (after a visible
/// [`report_skip`]) when none does — unless `KRASIS_REQUIRE_FIXTURES=1` (set by `.ci/run`),
/// which panics.
pub fn fixtures_dir() -> Option<PathBuf> {
    let candidates = fixture_candidates();
    if let Some(dir) = candidates.iter().find(|d| d.join(FIXTURE_NAMES[0]).join("config.json").exists()) {
        return Some(dir.clone());
    }
    let tried = candidates.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(" nor at ");
    if std::env::var("KRASIS_REQUIRE_FIXTURES").as_deref() == Ok("1") {
        panic!("KRASIS_REQUIRE_FIXTURES=1 but no HF oracle fixtures at {tried}");
    }
    report_skip(&format!(
        "HF oracle fixtures not found at {tried} (run scripts/make-fixtures.sh, or set KRASIS_FIXTURES)"
    ));
    None
}

/// Where the fixtures of the next architectures and native formats are looked for
/// (`../shared/fixtures-next`, README there): `KRASIS_FIXTURES_NEXT` alone when set, else
/// `fixtures-next` beside the HF oracle fixtures' directory (`KRASIS_FIXTURES`'s parent), then
/// `../shared/fixtures-next` from the workspace root.
pub fn fixtures_next_candidates() -> Vec<PathBuf> {
    if let Some(dir) = std::env::var_os("KRASIS_FIXTURES_NEXT") {
        return vec![PathBuf::from(dir)];
    }
    let mut v: Vec<PathBuf> = std::env::var_os("KRASIS_FIXTURES")
        .map(PathBuf::from)
        .and_then(|d| d.parent().map(|p| p.join("fixtures-next")))
        .into_iter()
        .collect();
    v.push(workspace_root().join("../shared/fixtures-next"));
    v
}

/// The fixture `name` of [`fixtures_next_candidates`] (its directory holds `config.json`).
/// `None` (after a visible [`report_skip`]) when absent. Not every checkout has these fixtures,
/// so `KRASIS_REQUIRE_FIXTURES=1` makes a missing one fail only where they were asked for: with
/// `KRASIS_FIXTURES_NEXT` set, or with `KRASIS_REQUIRE_FIXTURES_NEXT=1`.
pub fn fixture_next(name: &str) -> Option<PathBuf> {
    let candidates = fixtures_next_candidates();
    if let Some(dir) = candidates.iter().map(|d| d.join(name)).find(|d| d.join("config.json").exists()) {
        return Some(dir);
    }
    let tried = candidates.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(" nor at ");
    let on = |v: &str| std::env::var(v).as_deref() == Ok("1");
    let asked = std::env::var_os("KRASIS_FIXTURES_NEXT").is_some() || on("KRASIS_REQUIRE_FIXTURES_NEXT");
    if asked && (on("KRASIS_REQUIRE_FIXTURES") || on("KRASIS_REQUIRE_FIXTURES_NEXT")) {
        panic!("fixture {name} required but not found at {tried}");
    }
    report_skip(&format!("fixture {name} not found at {tried} (set KRASIS_FIXTURES_NEXT to ../shared/fixtures-next)"));
    None
}

/// Fixtures with a GGUF twin (`scripts/make-gguf-fixtures.sh`): qwen3moe-tiny has a dense layer
/// llama.cpp's qwen3moe cannot express, dsv3-fp8-tiny is FP8.
pub const GGUF_FIXTURE_NAMES: &[&str] = &["dsv2-lite-tiny", "dsv2-k256-tiny", "dsv2-grouped-tiny", "dsv3-tiny"];

/// `KRASIS_GGUF_FIXTURES`, or `.gguf-fixtures` in the checkout (where
/// `scripts/make-gguf-fixtures.sh` writes them). `None` after a visible [`report_skip`] when
/// absent — unless `KRASIS_REQUIRE_FIXTURES=1`, which panics (`.ci/run` makes them first).
pub fn gguf_fixtures_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("KRASIS_GGUF_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".gguf-fixtures"));
    if dir.join(GGUF_FIXTURE_NAMES[0]).join("model-bf16.gguf").exists() {
        return Some(dir);
    }
    if std::env::var("KRASIS_REQUIRE_FIXTURES").as_deref() == Ok("1") {
        panic!(
            "KRASIS_REQUIRE_FIXTURES=1 but no GGUF fixtures at {} (run scripts/make-gguf-fixtures.sh)",
            dir.display()
        );
    }
    report_skip(&format!(
        "GGUF fixtures not found at {} (run scripts/make-gguf-fixtures.sh, or set KRASIS_GGUF_FIXTURES)",
        dir.display()
    ));
    None
}

/// The oracle outputs of one fixture (`reference.safetensors`).
pub struct Reference {
    pub prompt_ids: Vec<u32>,
    pub prefill_logits: Vec<f32>,
    pub hidden_states: Vec<f32>,
    pub hidden_shape: Vec<usize>,
    pub greedy_ids: Vec<u32>,
    pub greedy_logits: Vec<f32>,
}

fn ints(f: &SafetensorsFile, name: &str) -> Vec<u32> {
    let v = f.view(name).unwrap_or_else(|| panic!("reference lacks {name}"));
    v.bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
}

fn floats(f: &SafetensorsFile, name: &str) -> (Vec<f32>, Vec<usize>) {
    let v = f.view(name).unwrap_or_else(|| panic!("reference lacks {name}"));
    (v.to_f32_vec().expect("float tensor"), v.shape.to_vec())
}

pub fn load_reference(dir: &Path) -> Reference {
    load_reference_file(&dir.join("reference.safetensors"))
}

/// A reference file in the layout of `reference.safetensors` (also the GGUF fixtures' own).
pub fn load_reference_file(path: &Path) -> Reference {
    let f = SafetensorsFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (hidden_states, hidden_shape) = floats(&f, "hidden_states");
    Reference {
        prompt_ids: ints(&f, "prompt_ids"),
        prefill_logits: floats(&f, "prefill_logits").0,
        hidden_states,
        hidden_shape,
        greedy_ids: ints(&f, "greedy_ids"),
        greedy_logits: floats(&f, "greedy_logits").0,
    }
}

/// ‖a − b‖ / ‖b‖ in f64.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    (num / den.max(1e-300)).sqrt()
}

/// The reference path's bar against the oracle (relative L2).
pub const ORACLE_TOL: f64 = 1e-4;

/// The CPU reference engine `model` against the oracle outputs `r` of fixture `name`: per-layer
/// hidden states, prefill logits, greedy ids (exact) and the logits each was chosen from, all
/// within [`ORACLE_TOL`]. Returns report lines; panics with the first miss.
pub fn check_against_reference(name: &str, model: &krasis_model::cpu::Model, r: &Reference) -> Vec<String> {
    use krasis_model::cpu::Logits;
    let mut report = Vec::new();

    // Prefill with per-layer hidden states.
    let [layers_plus_one, t, h] = r.hidden_shape[..] else { panic!("hidden_states shape") };
    let mut hidden: Vec<Vec<f32>> = Vec::new();
    let mut session = model.new_session();
    let mut observe = |_: usize, x: &[f32]| hidden.push(x.to_vec());
    let logits = model.forward(&mut session, &r.prompt_ids, Logits::All, Some(&mut observe)).unwrap();
    assert_eq!(hidden.len(), layers_plus_one, "{name}: hidden state count");
    for (l, hs) in hidden.iter().enumerate() {
        let want = &r.hidden_states[l * t * h..(l + 1) * t * h];
        let e = rel_l2(hs, want);
        report.push(format!("{name} hidden[{l}] rel {e:.2e}"));
        assert!(
            e <= ORACLE_TOL,
            "{name}: hidden_states[{l}] relative L2 error {e:.3e} > {ORACLE_TOL:e} (bug at or before layer {l})"
        );
    }
    let e = rel_l2(&logits, &r.prefill_logits);
    report.push(format!("{name} prefill_logits rel {e:.2e}"));
    assert!(e <= ORACLE_TOL, "{name}: prefill logits relative L2 error {e:.3e}");

    // Greedy decode over the cache: ids exact, step logits close.
    let v = model.spec.vocab_size;
    let mut step = logits[(t - 1) * v..].to_vec();
    let mut worst = 0f64;
    for (i, &want_id) in r.greedy_ids.iter().enumerate() {
        let e = rel_l2(&step, &r.greedy_logits[i * v..(i + 1) * v]);
        worst = worst.max(e);
        assert!(e <= ORACLE_TOL, "{name}: step {i} logits relative L2 error {e:.3e}");
        let got = argmax(&step) as u32;
        assert_eq!(got, want_id, "{name}: greedy token {i}");
        if i + 1 < r.greedy_ids.len() {
            step = model.forward(&mut session, &[got], Logits::Last, None).unwrap();
        }
    }
    report.push(format!("{name} greedy {} ids exact, worst step logits rel {worst:.2e}", r.greedy_ids.len()));
    report
}

/// A 128-token prefill of fixture `name` (in `dir`, a 4-bit-expert fixture of
/// `../shared/fixtures-next`) with its experts at `auto` (kept as stored) and BF16 dense weights,
/// against the reference path: rel ≤ 1e-4 on the integer expert kernels; on the BF16 prefill
/// tiles (an AMX-BF16 host, or `KRASIS_PREFILL_MATMUL=bf16-emulated`), which round weights and
/// activations to BF16, within the noise of transformers' own BF16 run of the fixture
/// (`quant_bounds.json`'s `bf16.rel`). Prints and returns (rel, BF16 tile calls, bar).
pub fn long_prefill_within_its_bar(dir: &Path, name: &str) -> (f64, usize, f64) {
    use krasis_model::cpu::quantized::WeightBits;
    use krasis_model::cpu::Model;
    let r = load_reference(dir);
    let ids: Vec<u32> =
        (0..128).map(|i| r.prompt_ids[i % r.prompt_ids.len()] ^ (i / r.prompt_ids.len()) as u32).collect();
    let reference = Model::load(dir).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let loaded = load_quantized(dir, WeightBits::Auto, WeightBits::Bf16, tmp.path());
    let logits = |m: &Model| {
        let mut s = m.new_session();
        m.forward(&mut s, &ids, krasis_model::cpu::Logits::All, None).unwrap()
    };
    let bf16_calls = krasis_cpu::prefill_bf16::calls();
    let (want, got) = (logits(&reference), logits(&loaded.model));
    let tile_calls = krasis_cpu::prefill_bf16::calls() - bf16_calls;
    let rel = rel_l2(&got, &want);
    let bounds: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.parent().unwrap().join("quant_bounds.json")).unwrap())
            .unwrap();
    let bf16_rel = bounds["fixtures"][name]["bf16"]["rel"].as_f64().expect("the fixture's bf16.rel");
    let bar = if tile_calls > 0 { bf16_rel } else { 1e-4 };
    eprintln!("{name}: 128-token prefill, experts as stored vs the reference path: rel {rel:.3e} (BF16 tile calls {tile_calls}; bar {bar:.3e})");
    assert!(rel <= bar, "{name}: rel {rel:.3e} over {bar:.3e} (BF16 tile calls {tile_calls})");
    (rel, tile_calls, bar)
}

/// The model at `path` (a directory or a GGUF) with routed experts and dense weights at the given
/// precisions (quantised experts from an expert cache in `cache`), on two worker threads.
pub fn load_quantized(
    path: &Path,
    experts: krasis_model::cpu::quantized::WeightBits,
    dense: krasis_model::cpu::quantized::WeightBits,
    cache: &Path,
) -> krasis_model::cpu::load::Loaded {
    try_load_quantized(path, experts, dense, cache).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// [`load_quantized`] of bad input: the error of opening or loading `path`, as text (panics when
/// it loads).
pub fn load_error(
    path: &Path,
    experts: krasis_model::cpu::quantized::WeightBits,
    dense: krasis_model::cpu::quantized::WeightBits,
    cache: &Path,
) -> String {
    match try_load_quantized(path, experts, dense, cache) {
        Ok(_) => panic!("{}: bad input was accepted", path.display()),
        Err(e) => e.to_string(),
    }
}

fn try_load_quantized(
    path: &Path,
    experts: krasis_model::cpu::quantized::WeightBits,
    dense: krasis_model::cpu::quantized::WeightBits,
    cache: &Path,
) -> krasis_model::Result<krasis_model::cpu::load::Loaded> {
    use krasis_model::cpu::load::{load_model, EngineOptions};
    let opts = EngineOptions {
        expert_bits: experts,
        dense_bits: dense,
        cache_dir: Some(cache.to_path_buf()),
        threads: Some(2),
        ..EngineOptions::default()
    };
    krasis_model::source::files::ModelFiles::open(path).and_then(|files| load_model(&files, &opts))
}

/// Prefill logits `[T, V]` of the model at `path` (a directory or a GGUF) on `prompt`, with
/// routed experts and dense weights at the given precisions (quantised experts from an expert
/// cache in `cache`), on two worker threads.
pub fn prefill_logits(
    path: &Path,
    experts: krasis_model::cpu::quantized::WeightBits,
    dense: krasis_model::cpu::quantized::WeightBits,
    cache: &Path,
    prompt: &[u32],
) -> Vec<f32> {
    let loaded = load_quantized(path, experts, dense, cache);
    let mut s = loaded.model.new_session();
    loaded.model.forward(&mut s, prompt, krasis_model::cpu::Logits::All, None).unwrap()
}

/// The last `steps` positions of `prompt` two ways on one loaded model: by prefill of the whole
/// prompt (`[steps, V]` logits of those positions) and by decode, one token per call after a
/// prefill of the rest (the same positions' step logits, concatenated).
pub fn decode_and_prefill_logits(
    path: &Path,
    experts: krasis_model::cpu::quantized::WeightBits,
    dense: krasis_model::cpu::quantized::WeightBits,
    cache: &Path,
    prompt: &[u32],
    steps: usize,
) -> (Vec<f32>, Vec<f32>) {
    use krasis_model::cpu::Logits;
    let loaded = load_quantized(path, experts, dense, cache);
    let m = &loaded.model;
    let (t, v) = (prompt.len(), m.spec.vocab_size);
    assert!(steps > 0 && steps < t, "{steps} decode steps of a {t}-token prompt");
    let mut s = m.new_session();
    let all = m.forward(&mut s, prompt, Logits::All, None).unwrap();
    let mut s = m.new_session();
    m.forward(&mut s, &prompt[..t - steps], Logits::Last, None).unwrap();
    let mut decoded = Vec::with_capacity(steps * v);
    for &id in &prompt[t - steps..] {
        decoded.extend(m.forward(&mut s, &[id], Logits::Last, None).unwrap());
    }
    (all[(t - steps) * v..].to_vec(), decoded)
}

/// Write a 2-layer `tiny` synthetic model into `dir` (no fixtures needed).
pub fn tiny_model(dir: &Path) {
    use krasis_model::synth::{synthesize, Preset, SynthOptions};
    synthesize(&SynthOptions {
        preset: Preset::Tiny,
        config: None,
        layers: Some(2),
        seed: 7,
        out: dir.to_path_buf(),
        router_skew: 0.0,
        force: true,
    })
    .expect("synthesize tiny");
}

/// The model's weight files, sorted.
pub fn weight_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

/// Rewrite a safetensors file's JSON header in place (the data section is kept byte for byte).
pub fn edit_header(file: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(header.as_object_mut().unwrap());
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(file, out).unwrap();
}

/// Per-position fidelity of `logits` `[T, V]` against the oracle's, as `quant_bounds.json` measures it.
#[derive(Clone, Copy, Debug)]
pub struct Fidelity {
    pub mean_cos: f64,
    pub min_cos: f64,
    pub top1: f64,
}

pub fn fidelity(logits: &[f32], reference: &[f32], vocab: usize) -> Fidelity {
    let rows = reference.len() / vocab;
    let (mut sum, mut min, mut agree) = (0f64, f64::INFINITY, 0usize);
    for r in 0..rows {
        let (a, b) = (&logits[r * vocab..(r + 1) * vocab], &reference[r * vocab..(r + 1) * vocab]);
        let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
        let na: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        let nb: f64 = b.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        let c = dot / (na * nb).max(1e-300);
        sum += c;
        min = min.min(c);
        agree += usize::from(argmax(a) == argmax(b));
    }
    Fidelity { mean_cos: sum / rows as f64, min_cos: min, top1: agree as f64 / rows as f64 }
}

/// One entry of `quant_bounds.json` (`fixtures.<name>.<int8|int4|bf16>`).
pub struct Bound {
    pub mean_cos: f64,
    pub top1: f64,
    pub first_token_same: Option<bool>,
}

pub fn quant_bound(fixtures: &Path, fixture: &str, kind: &str) -> Bound {
    let text = std::fs::read_to_string(fixtures.join("quant_bounds.json")).expect("quant_bounds.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("quant_bounds.json is JSON");
    let e = &v["fixtures"][fixture][kind];
    Bound {
        mean_cos: e["mean_cos"].as_f64().unwrap_or_else(|| panic!("no {fixture}.{kind}.mean_cos")),
        top1: e["top1"].as_f64().unwrap_or_else(|| panic!("no {fixture}.{kind}.top1")),
        first_token_same: e["first_token_same"].as_bool(),
    }
}

/// A fixture opened for a GPU test.
pub struct GpuFixture {
    pub root: PathBuf,
    pub dir: PathBuf,
    pub reference: Reference,
    pub vocab: usize,
}

/// The fixture `name` with its oracle outputs, or `None` (after a visible skip line) when the
/// fixtures or a GPU are missing.
pub fn gpu_fixture(name: &str) -> Option<GpuFixture> {
    let root = fixtures_dir()?;
    if !gpu_available(name) {
        return None;
    }
    let dir = root.join(name);
    let reference = load_reference(&dir);
    let vocab = reference.prefill_logits.len() / reference.prompt_ids.len();
    Some(GpuFixture { root, dir, reference, vocab })
}

/// [`gpu_fixture`] for a fixture of `../shared/fixtures-next` ([`fixture_next`]).
pub fn gpu_fixture_next(name: &str) -> Option<GpuFixture> {
    let dir = fixture_next(name)?;
    if !gpu_available(name) {
        return None;
    }
    let root = dir.parent().expect("a fixture directory has a parent").to_path_buf();
    let reference = load_reference(&dir);
    let vocab = reference.prefill_logits.len() / reference.prompt_ids.len();
    Some(GpuFixture { root, dir, reference, vocab })
}

/// Whether a GPU is usable; without one prints a visible skip line (or panics under
/// `KRASIS_REQUIRE_GPU=1`, as on the GPU box).
pub fn gpu_available(test: &str) -> bool {
    match krasis_gpu::probe() {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("KRASIS_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("KRASIS_REQUIRE_GPU=1 but {e}");
            }
            report_skip(&format!("no GPU ({test}): {e}"));
            false
        }
    }
}

/// One `#[test]` per oracle fixture, each calling `$check(fixture_name)`.
#[macro_export]
macro_rules! per_fixture_tests {
    ($check:path) => {
        #[test]
        fn dsv2_lite() {
            $check($crate::FIXTURE_NAMES[0]);
        }

        #[test]
        fn dsv2_k256() {
            $check($crate::FIXTURE_NAMES[1]);
        }

        #[test]
        fn dsv2_grouped() {
            $check($crate::FIXTURE_NAMES[2]);
        }

        #[test]
        fn dsv3() {
            $check($crate::FIXTURE_NAMES[3]);
        }

        #[test]
        fn dsv3_fp8() {
            $check($crate::FIXTURE_NAMES[4]);
        }

        #[test]
        fn qwen3moe() {
            $check($crate::FIXTURE_NAMES[5]);
        }
    };
}

/// A copy of the fixture `src` (config, tokenizer) into `out` with `model.safetensors` rewritten
/// by `edit(header, data)`: for bad-input tests.
pub fn copy_fixture_with(src: &Path, out: &Path, edit: impl FnOnce(&mut serde_json::Value, &mut Vec<u8>)) {
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), out.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut data = bytes[8 + n..].to_vec();
    edit(&mut header, &mut data);
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&h);
    file.extend_from_slice(&data);
    std::fs::write(out.join("model.safetensors"), file).unwrap();
}

/// The CPU engine options of the hybrid tests: routed experts at `bits`, their cache in `cache`,
/// two worker threads (the dev box's cores).
pub fn cpu_experts(
    bits: krasis_model::cpu::quantized::WeightBits,
    cache: &Path,
) -> krasis_model::cpu::load::EngineOptions {
    krasis_model::cpu::load::EngineOptions {
        expert_bits: bits,
        cache_dir: Some(cache.to_path_buf()),
        threads: Some(2),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without `KRASIS_FIXTURES` the tests also find what `scripts/make-fixtures.sh` writes by
    /// default (`.fixtures` in the checkout), after `../shared/fixtures`; with it, only there.
    #[test]
    fn fixtures_are_looked_for_where_the_script_writes_them() {
        let root = workspace_root();
        assert_eq!(candidates_for(None), vec![root.join("../shared/fixtures"), root.join(".fixtures")]);
        assert_eq!(candidates_for(Some("/x/f".into())), vec![PathBuf::from("/x/f")]);
        let script = std::fs::read_to_string(root.join("scripts/make-fixtures.sh")).unwrap();
        assert!(script.contains("OUT=$ROOT/.fixtures\n"), "make-fixtures.sh's default OUT moved");
    }
}
