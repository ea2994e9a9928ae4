//! `krasis generate`. The flag names are a contract with external checks: keep them.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args as ClapArgs, ValueEnum};
use krasis_core::budget::{check_ram_budget, format_bytes};
use krasis_model::config::load_config;
use krasis_model::engine::Model;
use krasis_model::generate::{generate, GenerateRequest};
use krasis_model::memory::{estimate, ExpertFormat};
use krasis_model::sampling::SamplingParams;
use krasis_model::tokenizer::{TextCodec, TextStream};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Cpu,
    Gpu,
    Auto,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExpertBits {
    #[value(name = "bf16")]
    Bf16,
    #[value(name = "8")]
    Int8,
    #[value(name = "4")]
    Int4,
}

#[derive(ClapArgs)]
pub struct Args {
    /// Model directory (HF format: config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Prompt text (tokenized with the model's tokenizer).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids; bypasses the tokenizer and adds no BOS.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Wrap --prompt as a user message with the model's chat template.
    #[arg(long, conflicts_with = "prompt_ids")]
    chat: bool,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sample among the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling mass (1.0 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Precision of the routed experts on the CPU: bf16 = the source weights unquantised.
    #[arg(long, value_enum, default_value_t = ExpertBits::Bf16)]
    cpu_expert_bits: ExpertBits,
    /// Where expert caches live (default: <model>/.krasis_cache).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Write prefill_logits, step_logits and generated_ids to this safetensors file.
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// Load even if the memory estimate exceeds 95% of RAM.
    #[arg(long)]
    force: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    match a.device {
        Device::Cpu => {}
        Device::Gpu => {
            if let Err(e) = krasis_gpu::probe() {
                bail!("--device gpu: {e}");
            }
        }
        Device::Auto => {
            if let Err(e) = krasis_gpu::probe() {
                eprintln!("notice: no GPU in use ({e}); running on the CPU");
            }
        }
    }
    if a.cpu_expert_bits != ExpertBits::Bf16 {
        bail!("--cpu-expert-bits {:?}: INT8/INT4 CPU experts are not supported yet; use bf16", a.cpu_expert_bits);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p {} must be in (0, 1]", a.top_p);
    }
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        bail!("--temperature {} must be a finite number >= 0", a.temperature);
    }
    if let Some(dir) = &a.cache_dir {
        if dir.exists() && !dir.is_dir() {
            bail!("--cache-dir {} exists and is not a directory", dir.display());
        }
    }

    let spec = load_config(&a.model)?;
    let mem_total = krasis_core::hw::probe().mem_total_bytes;
    let est = estimate(&spec, ExpertFormat::Bf16).total(4096);
    if let Some(w) = check_ram_budget(est, mem_total, a.force)? {
        eprintln!("warning: {w}");
    }
    let codec = if a.prompt.is_some() || a.model.join("tokenizer.json").exists() {
        Some(TextCodec::load(&a.model)?)
    } else {
        None
    };
    let prompt_ids = match (&a.prompt, &a.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => {
            let codec = codec.as_ref().expect("loaded for --prompt");
            if a.chat {
                codec.encode_chat(text)?
            } else {
                codec.encode(text)?
            }
        }
        (None, None) => unreachable!("clap requires one"),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to no tokens");
    }

    let t_load = Instant::now();
    let model = Model::load(&a.model)?;
    model.check_tokens(&prompt_ids)?;
    eprintln!(
        "loaded {} ({} layers) in {:.2} s; experts: {}; estimate {}",
        a.model.display(),
        model.spec.num_layers,
        t_load.elapsed().as_secs_f64(),
        model.expert_executor().describe(),
        format_bytes(est)
    );

    let req = GenerateRequest {
        prompt_ids: prompt_ids.clone(),
        max_new_tokens: a.max_new_tokens,
        sampling: SamplingParams { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed: a.seed },
        ignore_eos: a.ignore_eos,
        record_logits: a.dump_logits.is_some(),
    };
    let mut stream = TextStream::new();
    let stdout = std::io::stdout();
    let out = generate(&model, &req, |id| {
        let mut lock = stdout.lock();
        let piece = match &codec {
            Some(c) => stream.push(c, id)?,
            None => format!("{id} "),
        };
        // A closed stdout (e.g. piped into `head`) is not an engine error; stop printing quietly.
        let _ = lock.write_all(piece.as_bytes()).and_then(|_| lock.flush());
        Ok(())
    })?;
    println!();
    eprintln!(
        "prefill: {} tokens in {:.3} s ({:.1} tok/s); decode: {} tokens in {:.3} s ({:.2} tok/s){}",
        prompt_ids.len(),
        out.prefill_time.as_secs_f64(),
        out.prefill_tok_s(prompt_ids.len()),
        out.generated.len(),
        out.decode_time.as_secs_f64(),
        out.decode_tok_s(),
        if out.stopped_at_eos { "; stopped at end-of-sequence" } else { "" }
    );
    if let Some(path) = &a.dump_logits {
        crate::dump::write_logits(path, model.spec.vocab_size, &out.prefill_logits, &out.step_logits, &out.generated)
            .with_context(|| format!("--dump-logits {}", path.display()))?;
        eprintln!("logits written to {}", path.display());
    }
    Ok(())
}
