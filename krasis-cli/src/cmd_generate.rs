//! `krasis generate`. The flag names are a contract with external checks: keep them.

use std::io::Write;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args as ClapArgs, ValueEnum};
use krasis_core::budget::{check_ram_budget, format_bytes};
use krasis_gpu::kv_cache::KvDtype;
use krasis_gpu::linear::LinearQuant;
use krasis_gpu::VramBudgetSpec;
use krasis_model::config::load_config;
use krasis_model::generate::{generate, Decoder, GenerateOutput, GenerateRequest};
use krasis_model::gpu::{GpuModel, GpuOptions};
use krasis_model::load::{load_model, EngineOptions};
use krasis_model::memory::estimate;
use krasis_model::quantized::WeightBits;
use krasis_model::sampling::SamplingParams;
use krasis_model::tokenizer::{TextCodec, TextStream};
use krasis_model::ModelError;

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
    /// Where expert caches live (default: `<model>/.krasis_cache`, else a per-user cache dir).
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
        if let Some(t) = self.threads {
            let cores = krasis_core::hw::probe().one_cpu_per_core().len();
            if t > cores {
                eprintln!("notice: --threads {t} is more than the {cores} physical cores; using {cores}");
            }
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

/// The names `LinearQuant` parses, listed in `--help`.
const LINEAR_QUANTS: &[&str] = &["bf16", "int8"];

/// A value parser for a library type: accepts exactly `names` (so `--help` lists them) and
/// converts with the type's own `FromStr`.
fn one_of<T>(names: &'static [&'static str]) -> impl TypedValueParser<Value = T>
where
    T: FromStr + Clone + Send + Sync + 'static,
    T::Err: std::fmt::Display,
{
    PossibleValuesParser::new(names).try_map(|s| s.parse::<T>().map_err(|e| e.to_string()))
}

/// `--device gpu` flags shared by `generate` and `bench`.
#[derive(ClapArgs, Clone, Debug)]
pub struct GpuArgs {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// VRAM every allocation is charged against: bytes (suffixes K/M/G/KiB/MiB/GiB) or `auto`
    /// (free memory minus 1 GiB).
    #[arg(long, default_value = "auto")]
    pub vram_budget: VramBudgetSpec,
    /// KV cache precision on the GPU (fp8 holds twice the tokens).
    #[arg(long, default_value = "bf16", value_parser = one_of::<KvDtype>(&["bf16", "fp8"]))]
    pub kv_dtype: KvDtype,
    /// KV cache tokens per session (default: what the VRAM budget leaves, capped at the model's
    /// max_position_embeddings).
    #[arg(long)]
    pub kv_tokens: Option<usize>,
    /// Attention projections on the GPU: bf16, or int8 weight-only per output channel.
    #[arg(long, default_value = "bf16", value_parser = one_of::<LinearQuant>(LINEAR_QUANTS))]
    pub attention_quant: LinearQuant,
    /// Shared experts on the GPU.
    #[arg(long, default_value = "bf16", value_parser = one_of::<LinearQuant>(LINEAR_QUANTS))]
    pub shared_expert_quant: LinearQuant,
    /// Dense (non-MoE) layers' MLP on the GPU.
    #[arg(long, default_value = "bf16", value_parser = one_of::<LinearQuant>(LINEAR_QUANTS))]
    pub dense_mlp_quant: LinearQuant,
    /// MLA kv_b_proj as used by prefill on the GPU.
    #[arg(long, default_value = "bf16", value_parser = one_of::<LinearQuant>(LINEAR_QUANTS))]
    pub kv_b_proj_quant: LinearQuant,
    /// LM head on the GPU.
    #[arg(long, default_value = "bf16", value_parser = one_of::<LinearQuant>(LINEAR_QUANTS))]
    pub lm_head_quant: LinearQuant,
}

impl GpuArgs {
    pub fn options(&self) -> anyhow::Result<GpuOptions> {
        if self.kv_tokens == Some(0) {
            bail!("--kv-tokens must be at least 1");
        }
        Ok(GpuOptions {
            ordinal: self.gpu,
            vram_budget: self.vram_budget,
            kv_dtype: self.kv_dtype,
            attention_quant: self.attention_quant,
            shared_expert_quant: self.shared_expert_quant,
            dense_mlp_quant: self.dense_mlp_quant,
            kv_b_proj_quant: self.kv_b_proj_quant,
            lm_head_quant: self.lm_head_quant,
            kv_tokens: self.kv_tokens,
        })
    }
}

/// Which engine `--device` picks: `gpu` insists, `auto` takes the GPU when one is usable and no
/// CPU-only precision flag was given, else the CPU with a one-line notice.
pub fn choose_gpu(device: Device, engine: &EngineArgs) -> anyhow::Result<bool> {
    let cpu_flags = engine.cpu_expert_bits != Bits::Bf16 || engine.cpu_dense_bits != Bits::Bf16;
    match device {
        Device::Cpu => Ok(false),
        Device::Gpu => {
            if let Err(e) = krasis_gpu::probe() {
                bail!("--device gpu: {e}");
            }
            if cpu_flags {
                bail!(
                    "--device gpu runs the whole model on the GPU; --cpu-expert-bits/--cpu-dense-bits apply to --device cpu (the hybrid CPU-experts path is not built yet)"
                );
            }
            Ok(true)
        }
        Device::Auto => match krasis_gpu::probe() {
            Err(e) => {
                eprintln!("notice: no GPU in use ({e}); running on the CPU");
                Ok(false)
            }
            Ok(_) if cpu_flags => {
                eprintln!("notice: --cpu-expert-bits/--cpu-dense-bits given; running on the CPU");
                Ok(false)
            }
            Ok(_) => Ok(true),
        },
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
    /// Tokens to generate after the prompt (fewer if the model ends the sequence).
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
    /// Random seed for sampling (the same seed and flags give the same tokens).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Where the model runs: the whole model on the GPU, on the CPU, or `auto` (the GPU when there
    /// is one, else the CPU with a notice).
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    gpu: GpuArgs,
    /// Write prefill_logits, step_logits and generated_ids to this safetensors file.
    #[arg(long)]
    dump_logits: Option<PathBuf>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if let Some(path) = &a.dump_logits {
        crate::dump::check_path(path)?;
    }
    let mut use_gpu = choose_gpu(a.device, &a.engine)?;
    let gpu_opts = a.gpu.options()?;
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p {} must be in (0, 1]", a.top_p);
    }
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        bail!("--temperature {} must be a finite number >= 0", a.temperature);
    }
    let opts = a.engine.options()?;
    let spec = load_config(&a.model)?;
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

    let req = GenerateRequest {
        prompt_ids: prompt_ids.clone(),
        max_new_tokens: a.max_new_tokens,
        sampling: SamplingParams { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed: a.seed },
        ignore_eos: a.ignore_eos,
        record_logits: a.dump_logits.is_some(),
    };
    let t_load = Instant::now();
    let gpu_model = if use_gpu {
        match GpuModel::load(&a.model, &gpu_opts) {
            Ok(m) => Some(m),
            Err(ModelError::Gpu(e)) if a.device == Device::Auto => {
                eprintln!("notice: the GPU could not take the model ({e}); running on the CPU");
                use_gpu = false;
                None
            }
            Err(e) => return Err(e.into()),
        }
    } else {
        None
    };
    if let Some(m) = &gpu_model {
        for line in &m.log {
            eprintln!("{line}");
        }
        m.check_tokens(&prompt_ids)?;
        eprintln!(
            "loaded {} ({} layers) on the GPU in {:.2} s",
            a.model.display(),
            m.spec.num_layers,
            t_load.elapsed().as_secs_f64()
        );
        let out = run_generation(m, &req, codec.as_ref(), prompt_ids.len())?;
        if let Some(r) = out.host_syncs_per_token {
            eprintln!("host synchronisations per decoded token: {r:.2}");
        }
        return dump(&a, m.spec.vocab_size, &out);
    }
    debug_assert!(!use_gpu);
    let est = a.engine.check_budget(&spec, 4096)?;
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

    let out = run_generation(model, &req, codec.as_ref(), prompt_ids.len())?;
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
    dump(&a, model.spec.vocab_size, &out)
}

/// Streams the generated text (or ids) to stdout and prints the timing line.
fn run_generation<D: Decoder>(
    model: &D,
    req: &GenerateRequest,
    codec: Option<&TextCodec>,
    prompt_len: usize,
) -> anyhow::Result<GenerateOutput> {
    let mut stream = TextStream::new();
    let stdout = std::io::stdout();
    let out = generate(model, req, |id| {
        let mut lock = stdout.lock();
        let piece = match codec {
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
        prompt_len,
        out.prefill_time.as_secs_f64(),
        out.prefill_tok_s(prompt_len),
        out.generated.len(),
        out.decode_time.as_secs_f64(),
        out.decode_tok_s(),
        if out.stopped_at_eos { "; stopped at end-of-sequence" } else { "" }
    );
    Ok(out)
}

fn dump(a: &Args, vocab: usize, out: &GenerateOutput) -> anyhow::Result<()> {
    if let Some(path) = &a.dump_logits {
        crate::dump::write_logits(path, vocab, &out.prefill_logits, &out.step_logits, &out.generated)
            .with_context(|| format!("--dump-logits {}", path.display()))?;
        eprintln!("logits written to {}", path.display());
    }
    Ok(())
}
