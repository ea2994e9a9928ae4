//! `krasis generate`. The flag names are a contract with external checks: keep them.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args as ClapArgs, ValueEnum};
use krasis_core::budget::{check_ram_budget, format_bytes};
use krasis_model::config::load_config;
use krasis_model::generate::{generate, GenerateRequest};
use krasis_model::load::{load_model, EngineOptions};
use krasis_model::memory::estimate;
use krasis_model::quantized::WeightBits;
use krasis_model::sampling::SamplingParams;
use krasis_model::tokenizer::{TextCodec, TextStream};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Cpu,
    Gpu,
    Auto,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Bits {
    #[value(name = "bf16")]
    Bf16,
    #[value(name = "8")]
    Int8,
    #[value(name = "4")]
    Int4,
}

impl Bits {
    pub fn weight_bits(self) -> WeightBits {
        match self {
            Bits::Bf16 => WeightBits::Bf16,
            Bits::Int8 => WeightBits::Int8,
            Bits::Int4 => WeightBits::Int4,
        }
    }
}

/// `--group-size`: a multiple of the smallest group the layout takes, up to the largest.
pub fn check_group_size_flag(gs: usize) -> anyhow::Result<()> {
    use krasis_quant::group::{MAX_GROUP_SIZE, MIN_GROUP_SIZE};
    if !(MIN_GROUP_SIZE..=MAX_GROUP_SIZE).contains(&gs) || !gs.is_multiple_of(MIN_GROUP_SIZE) {
        bail!("--group-size {gs} must be a multiple of {MIN_GROUP_SIZE} between {MIN_GROUP_SIZE} and {MAX_GROUP_SIZE}");
    }
    Ok(())
}

/// Precision and placement flags shared by `generate`, `bench` and `convert`.
#[derive(ClapArgs, Clone, Debug)]
pub struct EngineArgs {
    /// Precision of the routed experts on the CPU: bf16 = the source weights unquantised;
    /// 8 or 4 = INT8/INT4 from the expert cache (built on first use).
    #[arg(long, value_enum, default_value_t = Bits::Bf16)]
    pub cpu_expert_bits: Bits,
    /// Precision of attention projections, shared experts, dense MLPs and the LM head on the CPU.
    #[arg(long, value_enum, default_value_t = Bits::Bf16)]
    pub cpu_dense_bits: Bits,
    /// Quantisation group along K (halved while a dimension is not divisible, down to 32).
    #[arg(long, default_value_t = 128)]
    pub group_size: usize,
    /// Where expert caches live (default: <model>/.krasis_cache, else a per-user cache dir).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// CPU worker threads (default: one per physical core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Load even if the memory estimate exceeds 95% of RAM.
    #[arg(long)]
    pub force: bool,
}

impl EngineArgs {
    pub fn options(&self) -> anyhow::Result<EngineOptions> {
        check_group_size_flag(self.group_size)?;
        if let Some(dir) = &self.cache_dir {
            if dir.exists() && !dir.is_dir() {
                bail!("--cache-dir {} exists and is not a directory", dir.display());
            }
        }
        if self.threads == Some(0) {
            bail!("--threads must be at least 1");
        }
        Ok(EngineOptions {
            expert_bits: self.cpu_expert_bits.weight_bits(),
            dense_bits: self.cpu_dense_bits.weight_bits(),
            group_size: self.group_size,
            cache_dir: self.cache_dir.clone(),
            threads: self.threads,
        })
    }

    /// Refuse (unless --force) when the estimate exceeds the RAM budget; returns the estimate.
    pub fn check_budget(&self, spec: &krasis_model::ModelSpec, context: u64) -> anyhow::Result<u64> {
        let est = estimate(spec, self.cpu_expert_bits.weight_bits()).total(context);
        let mem_total = krasis_core::hw::probe().mem_total_bytes;
        if let Some(w) = check_ram_budget(est, mem_total, self.force)? {
            eprintln!("warning: {w}");
        }
        Ok(est)
    }
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
    #[command(flatten)]
    engine: EngineArgs,
    /// Write prefill_logits, step_logits and generated_ids to this safetensors file.
    #[arg(long)]
    dump_logits: Option<PathBuf>,
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
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p {} must be in (0, 1]", a.top_p);
    }
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        bail!("--temperature {} must be a finite number >= 0", a.temperature);
    }
    let opts = a.engine.options()?;
    let spec = load_config(&a.model)?;
    let est = a.engine.check_budget(&spec, 4096)?;
    for w in krasis_core::hw::probe().warnings() {
        eprintln!("system: {w}");
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
    let loaded = load_model(&a.model, &opts)?;
    for line in &loaded.log {
        eprintln!("{line}");
    }
    let model = &loaded.model;
    model.check_tokens(&prompt_ids)?;
    eprintln!(
        "loaded {} ({} layers) in {:.2} s; memory estimate {}",
        a.model.display(),
        model.spec.num_layers,
        t_load.elapsed().as_secs_f64(),
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
    let out = generate(model, &req, |id| {
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
    if a.engine.cpu_expert_bits != Bits::Bf16 {
        // Every routed expert is resident after loading the cache and every dense weight has been
        // read by now, so RSS should match the estimate.
        if let Some(rss) = krasis_core::hw::current_rss_bytes() {
            match krasis_core::budget::rss_deviation_warning(est, rss) {
                Some(w) => eprintln!("warning: {w}"),
                None => eprintln!("memory: RSS {} within 10% of the estimate {}", format_bytes(rss), format_bytes(est)),
            }
        }
    }
    if let Some(path) = &a.dump_logits {
        crate::dump::write_logits(path, model.spec.vocab_size, &out.prefill_logits, &out.step_logits, &out.generated)
            .with_context(|| format!("--dump-logits {}", path.display()))?;
        eprintln!("logits written to {}", path.display());
    }
    Ok(())
}
