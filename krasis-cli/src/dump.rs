//! `--dump-logits`: a safetensors file with `prefill_logits` F32 `[T, V]`, `step_logits` F32
//! `[N, V]` and `generated_ids` I64 `[N]`, written to `<path>.tmp` beside it and renamed.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use safetensors::tensor::{Dtype, TensorView};

/// Refuse a path the dump could not be written to, before any generation runs: a directory, or
/// one whose parent directory does not exist.
pub fn check_path(path: &Path) -> anyhow::Result<()> {
    check_output_path("--dump-logits", path, "logits.safetensors")
}

/// An output file flag's path: not a directory, in a directory that exists (checked before
/// loading, so a typo fails in a second, not after the run).
pub fn check_output_path(flag: &str, path: &Path, example: &str) -> anyhow::Result<()> {
    if path.is_dir() {
        bail!("{flag} {} is a directory; give a file path such as {}", path.display(), path.join(example).display());
    }
    let parent = parent_dir(path);
    if !parent.is_dir() {
        bail!("{flag} {}: directory {} does not exist", path.display(), parent.display());
    }
    Ok(())
}

/// The directory `path` is in (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// `<path>.tmp`: in the target's own directory, so the rename is atomic.
fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(OsString::from).unwrap_or_default();
    name.push(".tmp");
    parent_dir(path).join(name)
}

pub fn write_logits(
    path: &Path,
    vocab: usize,
    prefill_logits: &[f32],
    step_logits: &[f32],
    generated: &[u32],
) -> anyhow::Result<()> {
    let f32_bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let pre = f32_bytes(prefill_logits);
    let steps = f32_bytes(step_logits);
    let ids: Vec<u8> = generated.iter().flat_map(|&x| (x as i64).to_le_bytes()).collect();
    let mut tensors = HashMap::new();
    tensors.insert("prefill_logits", TensorView::new(Dtype::F32, vec![prefill_logits.len() / vocab, vocab], &pre)?);
    tensors.insert("step_logits", TensorView::new(Dtype::F32, vec![step_logits.len() / vocab, vocab], &steps)?);
    tensors.insert("generated_ids", TensorView::new(Dtype::I64, vec![generated.len()], &ids)?);
    let tmp = tmp_path(path);
    let written = safetensors::serialize_to_file(tensors, None, &tmp)
        .with_context(|| format!("writing {}", tmp.display()))
        .and_then(|()| {
            std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
