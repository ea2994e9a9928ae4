//! `--dump-logits`: a safetensors file with `prefill_logits` F32 `[T, V]`, `step_logits` F32
//! `[N, V]` and `generated_ids` I64 `[N]`, written to a temp file and renamed.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Context;
use safetensors::tensor::{Dtype, TensorView};

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
    let tmp = path.with_extension("safetensors.tmp");
    safetensors::serialize_to_file(tensors, None, &tmp).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(())
}
