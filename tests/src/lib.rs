//! Shared helpers for the integration tests: locating the HF oracle fixtures and reading them.

use std::path::{Path, PathBuf};

use krasis_model::source::SafetensorsFile;

pub const FIXTURE_NAMES: &[&str] =
    &["dsv2-lite-tiny", "dsv2-k256-tiny", "dsv2-grouped-tiny", "dsv3-tiny", "dsv3-fp8-tiny", "qwen3moe-tiny"];

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// `KRASIS_FIXTURES`, or `../shared/fixtures` from the workspace root. `None` (after a loud
/// message) when absent — unless `KRASIS_REQUIRE_FIXTURES=1` (set by `.ci/run`), which panics.
pub fn fixtures_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("KRASIS_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared/fixtures"));
    if dir.join(FIXTURE_NAMES[0]).join("config.json").exists() {
        return Some(dir);
    }
    if std::env::var("KRASIS_REQUIRE_FIXTURES").as_deref() == Ok("1") {
        panic!("KRASIS_REQUIRE_FIXTURES=1 but no HF oracle fixtures at {}", dir.display());
    }
    eprintln!(
        "\n*** SKIPPED: HF oracle fixtures not found at {} (set KRASIS_FIXTURES) — this test checked nothing ***\n",
        dir.display()
    );
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
    let f = SafetensorsFile::open(&dir.join("reference.safetensors")).expect("reference.safetensors");
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

/// Write a 2-layer `tiny` synthetic model into `dir` (no fixtures needed).
pub fn tiny_model(dir: &Path) {
    use krasis_model::synth::{synthesize, Preset, SynthOptions};
    synthesize(&SynthOptions {
        preset: Preset::Tiny,
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
