//! The generation loop: one prefill pass over the prompt, then token-by-token decode reusing the
//! KV cache, sampling each step and streaming ids to a callback.

use std::time::{Duration, Instant};

use crate::engine::{Logits, Model};
use crate::error::{ModelError, Result};
use crate::sampling::{Sampler, SamplingParams};

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub ignore_eos: bool,
    /// Keep logits for `--dump-logits`: every prompt position and every step.
    pub record_logits: bool,
}

#[derive(Clone, Debug, Default)]
pub struct GenerateOutput {
    pub generated: Vec<u32>,
    /// `[prompt_len, vocab]` when recorded.
    pub prefill_logits: Vec<f32>,
    /// `[generated, vocab]` when recorded: the logits each generated token was chosen from.
    pub step_logits: Vec<f32>,
    pub prefill_time: Duration,
    pub decode_time: Duration,
    pub stopped_at_eos: bool,
}

impl GenerateOutput {
    pub fn prefill_tok_s(&self, prompt_len: usize) -> f64 {
        prompt_len as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    /// Decode rate over the steps after the first token (which comes from the prefill).
    pub fn decode_tok_s(&self) -> f64 {
        let steps = self.generated.len().saturating_sub(1);
        if steps == 0 {
            return 0.0;
        }
        steps as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

pub fn generate(
    model: &Model,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<GenerateOutput> {
    if req.prompt_ids.is_empty() {
        return Err(ModelError::Invalid("the prompt is empty: nothing to run".into()));
    }
    model.check_tokens(&req.prompt_ids)?;
    let v = model.spec.vocab_size;
    let mut out = GenerateOutput::default();
    let mut session = model.new_session();
    let mut sampler = Sampler::new(req.sampling);

    let t0 = Instant::now();
    let which = if req.record_logits { Logits::All } else { Logits::Last };
    let logits = model.forward(&mut session, &req.prompt_ids, which, None)?;
    out.prefill_time = t0.elapsed();
    let mut step = logits[logits.len() - v..].to_vec();
    if req.record_logits {
        out.prefill_logits = logits;
    }
    if req.max_new_tokens == 0 {
        return Ok(out);
    }
    let t1 = Instant::now();
    loop {
        let id = sampler.sample(&step);
        if req.record_logits {
            out.step_logits.extend_from_slice(&step);
        }
        out.generated.push(id);
        on_token(id)?;
        if !req.ignore_eos && model.spec.eos_token_ids.contains(&id) {
            out.stopped_at_eos = true;
            break;
        }
        if out.generated.len() >= req.max_new_tokens {
            break;
        }
        step = model.forward(&mut session, &[id], Logits::Last, None)?;
    }
    out.decode_time = t1.elapsed();
    Ok(out)
}
