//! `krasis generate`. The flag names are a contract with external checks: keep them.

use std::io::Write;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args as ClapArgs, ValueEnum};
use krasis_core::budget::format_bytes;
use krasis_gpu::kv_cache::KvDtype;
use krasis_gpu::linear::LinearQuant;
use krasis_gpu::VramBudgetSpec;
use krasis_model::cpu::load::EngineOptions;
use krasis_model::cpu::quantized::WeightBits;
use krasis_model::gpu::{CachePlan, CacheStrategy, GpuExpertCache, GpuOptions, GpuPrecision, StreamFrom};
use krasis_model::placement::heatmap::ExpertHeat;
use krasis_model::runtime::{
    check_context, context_limit, cpu_memory_estimate, open_engine, spec_context_limit, DevicePath, DevicePolicy,
    Engine, EngineConfig, DEFAULT_CONTEXT_TOKENS,
};
use krasis_model::source::files::ModelFiles;
use krasis_model::text::generate::{generate, GenerateOutput, GenerateRequest};
use krasis_model::text::sampling::SamplingParams;
use krasis_model::text::tokenizer::{TextCodec, TextStream};

/// `--device`: which device policy the engine opens with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    // The values are described in `--device`'s own help, one line like every flag's.
    Cpu,
    Gpu,
    Hybrid,
    Auto,
}

impl From<Device> for DevicePolicy {
    fn from(d: Device) -> Self {
        match d {
            Device::Cpu => DevicePolicy::Cpu,
            Device::Gpu => DevicePolicy::Gpu,
            Device::Hybrid => DevicePolicy::Hybrid,
            Device::Auto => DevicePolicy::Auto,
        }
    }
}

/// Parses a precision flag (`bf16`, `8`, `4`), listing the values in `--help`.
pub fn weight_bits_parser(values: &'static [&'static str]) -> impl TypedValueParser<Value = WeightBits> {
    clap::builder::PossibleValuesParser::new(values)
        .map(|s| s.parse::<WeightBits>().expect("every listed value parses"))
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
    /// Precision of the routed experts on the CPU: bf16 = the source weights unquantised (the
    /// reference path); 8 or 4 = INT8/INT4 from the expert cache (built on first use); auto = per
    /// projection from a GGUF's types (INT4 from 4-bit or narrower, INT8 from 5/6/8-bit and
    /// float), except a GGUF whose experts are all Q4_K, Q6_K, Q5_0 or Q8_0 (Q4_K_M), kept
    /// exactly (Q4_K/Q6_K blocks as stored, Q5_0/Q8_0 as INT8 g32); a 4-bit float checkpoint's
    /// (NVFP4, MXFP4) and compressed-tensors INT4 experts as stored; 4a for other safetensors
    /// models when it fits the RAM limit (else 4, with a note); 4a = asymmetric INT4 in groups of
    /// 32 (a scale and a minimum per group, 5.0 bits per weight; the hybrid's prefill streams it
    /// and the GPU requantises it to INT8 g32); 4 = INT4 g128 (4.125 bits per weight, the fastest
    /// decode).
    #[arg(long, default_value = "auto", value_parser = weight_bits_parser(&WeightBits::EXPERT_FLAG_VALUES))]
    pub cpu_expert_bits: WeightBits,
    /// Precision of attention projections, shared experts, dense MLPs and the LM head on the CPU
    /// (--device cpu): bf16 = as stored (the reference path); 8 or 4 = INT8/INT4 from the
    /// dense-weight cache (built on first use); auto = 8.
    #[arg(long, default_value = "auto", value_parser = weight_bits_parser(&WeightBits::SYMMETRIC_FLAG_VALUES))]
    pub cpu_dense_bits: WeightBits,
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
            expert_bits: self.cpu_expert_bits,
            dense_bits: self.cpu_dense_bits,
            group_size: self.group_size,
            cache_dir: self.cache_dir.clone(),
            threads: self.threads,
        })
    }

    /// The library's engine configuration from these flags, `--device` and the GPU flags; the
    /// RAM estimate assumes `context_tokens` of context.
    pub fn config(&self, device: Device, gpu: &GpuArgs, context_tokens: u64) -> anyhow::Result<EngineConfig> {
        // The GPU expert cache follows --cache-dir and --group-size, as the CPU caches do.
        let gpu_options = gpu.options()?;
        let width = gpu.gpu_expert_bits;
        let pin_leftover_vram = gpu.cache_strategy.as_deref() != Some("none");
        let mut gpu = gpu_options;
        gpu.expert_group_size = self.group_size;
        // A KV cache sized from the budget holds at least the context this run says it needs.
        gpu.context_tokens = usize::try_from(context_tokens).ok();
        gpu.expert_cache = GpuExpertCache::In(self.cache_dir.clone());
        Ok(EngineConfig {
            device: device.into(),
            cpu: self.options()?,
            gpu,
            gpu_expert_width: width,
            pin_leftover_vram,
            context_tokens,
            force: self.force,
            record_heatmap: false,
            use_saved_tune: true,
        })
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

/// The GPU flags (`--device gpu`, `hybrid`, `auto`) shared by `generate`, `serve`, `bench` and
/// `tune`.
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
    /// How the GPU computes attention and the dense parts: bf16 (matrix inputs rounded to BF16,
    /// as transformers' BF16 run does), or f32 (nothing rounded but the stored weights, an f32 KV
    /// cache, attention on CUDA cores: several times slower, for checking against an f32
    /// reference).
    #[arg(long, default_value = "bf16", value_parser = one_of::<GpuPrecision>(&["bf16", "f32"]))]
    pub gpu_precision: GpuPrecision,
    /// Row-invariant prompts on the GPU and hybrid paths: every prompt call computes each token
    /// independently of the call's other tokens (fixed-size GEMM calls, attention read through
    /// the KV cache, a hybrid prompt's experts all on the GPU), so a prompt resumed from the
    /// prefix cache or run in chunks gives the logits of one whole-prompt call, bit for bit.
    #[arg(long)]
    pub invariant_prefill: bool,
    /// Hybrid decode: routes of each token whose experts the GPU reads over PCIe from the CPU's
    /// expert records (page-locked RAM) while the CPU reads the others' (default: the count that
    /// ends both reads soonest for the experts' size, for SiLU experts without biases; 0: off).
    #[arg(long)]
    pub pcie_routes: Option<usize>,
    /// Tokens (prompt + generated) each session holds. GPU and hybrid: the KV cache allocated
    /// at load (default: what the VRAM budget leaves, capped at the model's
    /// max_position_embeddings). CPU: a limit the cache grows up to (default:
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
    /// Width of the routed experts on the GPU: resident with --device gpu, streamed for prompts
    /// at or above the streaming length with --device hybrid. 8 or 4: INT8 / INT4 weights per
    /// group of --group-size along K, dequantised inside the tensor-core tiles (read from the GPU
    /// expert cache in --cache-dir, or the CPU's records, built on the first start or by `krasis
    /// convert`); bf16: BF16 resident experts, and a hybrid prefill keeps the experts on the CPU;
    /// auto: the source's width when it is 8-bit, else 4 (hybrid: the CPU experts' width); on a
    /// 4-bit float checkpoint (NVFP4, MXFP4) auto keeps the experts as stored, where 4 and 8
    /// requantise them.
    #[arg(long, default_value = "auto", value_parser = weight_bits_parser(&WeightBits::SYMMETRIC_FLAG_VALUES))]
    pub gpu_expert_bits: WeightBits,
    /// `--device hybrid --gpu-expert-bits 4|8`: which copy of the experts prefill streams to the
    /// GPU. cpu-cache: the CPU experts' own cache, laid out for the GPU on the device (one copy of
    /// the experts in RAM); gpu-cache: the GPU expert cache read into RAM beside it (twice the RAM,
    /// ~17 % faster at 2K tokens).
    #[arg(long, default_value = "cpu-cache", value_parser = ["cpu-cache", "gpu-cache"])]
    pub stream_experts_from: String,
    /// `--device hybrid --gpu-expert-bits 4|8`: which routed experts stay in VRAM beside the CPU
    /// copy, for decode and prompts shorter than the full-streaming length (longer ones stream
    /// every layer). hot_cached_static: the --heatmap-path file's hottest experts pinned, the CPU
    /// running the other routes beside them. active_only: each call copies the experts it touches
    /// and runs every route on the GPU. static_pin / weighted_pin: active_only plus the heatmap's
    /// hottest experts pinned (ranked over all layers / shared out by each layer's skew). lru: a
    /// cross-layer cache of experts, least recently used out. chunked: long prompts stream each
    /// layer's experts in chunks through two slots of --pin-vram (taken by itself when two
    /// layers' experts do not fit the budget). none: the CPU experts alone, with prefill
    /// streaming. Without it: hot_cached_static in the VRAM left after the weights, a 16K-token
    /// KV cache and the prefill reserve, ranked by the heatmap `krasis serve` records beside the
    /// caches (else spread evenly over the layers).
    #[arg(long, value_parser = ["hot_cached_static", "active_only", "static_pin", "weighted_pin", "lru", "chunked", "none"])]
    pub cache_strategy: Option<String>,
    /// A heatmap recorded on this model with `--heatmap-out` (for the pinning strategies; `krasis
    /// tune` then measures them too).
    #[arg(long)]
    pub heatmap_path: Option<PathBuf>,
    /// VRAM for the experts --cache-strategy keeps (bytes; suffixes K/M/G/KiB/MiB/GiB). Default:
    /// what --vram-budget leaves after the weights, the stream slots, a 16K-token KV cache and
    /// 3 GiB for a long prefill's activations (active_only and the pins' copy slots: one layer's
    /// experts; chunked: two whole layers).
    #[arg(long, value_parser = parse_vram)]
    pub pin_vram: Option<u64>,
}

fn parse_vram(s: &str) -> Result<u64, String> {
    krasis_core::budget::parse_bytes(s).map_err(|e| e.to_string())
}

impl GpuArgs {
    /// `--cache-strategy` with its heatmap and VRAM, checked against each other.
    pub fn cache_plan(&self) -> anyhow::Result<Option<CachePlan>> {
        let Some(name) = self.cache_strategy.as_ref().filter(|n| n.as_str() != "none") else {
            if self.heatmap_path.is_some() || self.pin_vram.is_some() {
                bail!("--heatmap-path and --pin-vram go with --cache-strategy");
            }
            return Ok(None);
        };
        let strategy =
            CacheStrategy::from_name(name).ok_or_else(|| anyhow::anyhow!("unknown --cache-strategy {name}"))?;
        match (strategy.needs_heatmap(), &self.heatmap_path) {
            (true, None) => {
                bail!("--cache-strategy {name} needs --heatmap-path (a heatmap recorded with --heatmap-out)")
            }
            (false, Some(_)) => bail!("--cache-strategy {name} pins nothing from a heatmap; drop --heatmap-path"),
            _ => {}
        }
        Ok(Some(CachePlan { strategy, heatmap: self.heatmap_path.clone(), vram: self.pin_vram }))
    }

    pub fn options(&self) -> anyhow::Result<GpuOptions> {
        if self.kv_tokens == Some(0) {
            bail!("--kv-tokens must be at least 1");
        }
        Ok(GpuOptions {
            ordinal: self.gpu,
            vram_budget: self.vram_budget,
            kv_dtype: self.kv_dtype,
            precision: self.gpu_precision,
            invariant_prefill: self.invariant_prefill,
            pcie_routes: self.pcie_routes,
            attention_quant: self.attention_quant,
            shared_expert_quant: self.shared_expert_quant,
            dense_mlp_quant: self.dense_mlp_quant,
            kv_b_proj_quant: self.kv_b_proj_quant,
            lm_head_quant: self.lm_head_quant,
            kv_tokens: self.kv_tokens,
            // Set from the width by the engine's policy (`EngineConfig::gpu_expert_width`).
            expert_bits: None,
            stream_from: match self.stream_experts_from.as_str() {
                "gpu-cache" => StreamFrom::GpuCache,
                _ => StreamFrom::CpuCache,
            },
            cache: self.cache_plan()?,
            ..GpuOptions::default()
        })
    }
}

/// Where and how the model runs: `--device` and every engine flag (`generate`, `serve`).
#[derive(ClapArgs, Clone, Debug)]
pub struct RunArgs {
    /// cpu | gpu (whole model on the GPU) | hybrid (experts on the CPU, the rest on the GPU) |
    /// auto (the GPU when the whole model fits its VRAM budget, else hybrid; the CPU without a GPU)
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub gpu: GpuArgs,
}

#[derive(ClapArgs)]
pub struct Args {
    /// Model: an HF directory (config.json, *.safetensors, tokenizer.json) or a GGUF file
    /// (`*.gguf`; any split of a split model).
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
    /// Tokens to generate after the prompt (fewer if the model ends the sequence). The prompt
    /// and these must fit the context (the model's max_position_embeddings, or the KV cache's
    /// tokens where smaller): a prompt that leaves no room is refused, and more tokens than the
    /// room are capped to it with a notice.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Sampling temperature. 0 = greedy: the most likely token every step, which --top-k,
    /// --top-p and --seed do not change (given with it, a notice says so).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// With --temperature > 0: sample among the k most likely tokens (default: all; 0 = all).
    #[arg(long)]
    top_k: Option<usize>,
    /// With --temperature > 0: sample among the most likely tokens whose probabilities add up
    /// to this mass, in (0, 1] (default 1.0: all).
    #[arg(long)]
    top_p: Option<f32>,
    /// With --temperature > 0: the random seed (default 0; the same seed and flags give the
    /// same tokens).
    #[arg(long)]
    seed: Option<u64>,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    #[command(flatten)]
    run: RunArgs,
    /// Write prefill_logits, step_logits and generated_ids to this safetensors file.
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// Count how many (token, slot) routes each routed expert of each layer gets over the prompt
    /// and the generated tokens, and write the counts to this JSON file (docs/FORMATS.md).
    #[arg(long)]
    heatmap_out: Option<PathBuf>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if let Some(path) = &a.dump_logits {
        crate::dump::check_path(path)?;
    }
    if let Some(p) = a.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        bail!("--top-p {p} must be in (0, 1]");
    }
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        bail!("--temperature {} must be a finite number >= 0", a.temperature);
    }
    if let Some(note) = greedy_notice(&a) {
        eprintln!("{note}");
    }
    let mut config = a.run.engine.config(a.run.device, &a.run.gpu, DEFAULT_CONTEXT_TOKENS)?;
    let files = ModelFiles::open(&a.model)?;
    for note in files.notes() {
        eprintln!("note: {note}");
    }
    config.record_heatmap = heatmap_wanted(a.heatmap_out.as_deref(), &files, &a.model)?;
    for w in krasis_core::hw::probe().warnings(cpu_memory_estimate(&files, &config).weight_bytes()) {
        eprintln!("system: {w}");
    }
    let codec = if a.prompt.is_some() || files.has_tokenizer() { Some(files.text_codec()?) } else { None };
    let prompt_ids = match (&a.prompt, &a.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => {
            let codec = codec.as_deref().expect("loaded for --prompt");
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
    // Before loading: the prompt against the model's positions and --kv-tokens.
    let max_pos = files.spec().max_position_embeddings;
    let kv_tokens = config.gpu.kv_tokens;
    let source = match kv_tokens {
        Some(k) if k < max_pos => format!("--kv-tokens {k}"),
        _ => format!("the model's max_position_embeddings {max_pos}"),
    };
    let max_new_tokens =
        fit_context(spec_context_limit(files.spec(), kv_tokens), &source, prompt_ids.len(), a.max_new_tokens)?;
    let defaults = SamplingParams::default();
    let mut req = GenerateRequest {
        prompt_ids,
        max_new_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k.unwrap_or(defaults.top_k),
            top_p: a.top_p.unwrap_or(defaults.top_p),
            seed: a.seed.unwrap_or(defaults.seed),
        },
        ignore_eos: a.ignore_eos,
        record_logits: a.dump_logits.is_some(),
    };

    let t_load = Instant::now();
    let opened = open_engine(&files, &config)?;
    // The engine holds what it needs; the source mapping goes, so weights uploaded to the GPU
    // are not kept in host memory.
    drop(files);
    eprintln!("{}", crate::flags::with_flags(&opened.why));
    for line in &opened.placement {
        eprintln!("{}", crate::flags::with_flags(line));
    }
    for w in &opened.warnings {
        eprintln!("warning: {}", crate::flags::with_flags(w));
    }
    for line in &opened.log {
        eprintln!("{}", crate::flags::with_flags(line));
    }
    let engine = opened.engine.as_ref();
    engine.check_tokens(&req.prompt_ids)?;
    // After loading: the engine's own KV capacity (on the GPU, what the VRAM budget left).
    if let Some(k) = engine.kv_capacity().filter(|&k| k < max_pos && Some(k) != kv_tokens) {
        let source = format!("the KV cache of {k} tokens the VRAM budget leaves (--vram-budget, --kv-dtype fp8)");
        req.max_new_tokens = fit_context(context_limit(engine), &source, req.prompt_ids.len(), req.max_new_tokens)?;
    }
    let place = match engine.device() {
        DevicePath::Cpu => "",
        DevicePath::Gpu => " on the GPU",
        DevicePath::Hybrid => " on the GPU (routed experts on the CPU)",
    };
    let estimate = opened.memory_estimate.map(|e| format!("; memory estimate {}", format_bytes(e)));
    eprintln!(
        "loaded {} ({} layers){place} in {:.2} s{}",
        a.model.display(),
        engine.spec().num_layers,
        t_load.elapsed().as_secs_f64(),
        estimate.unwrap_or_default()
    );

    let out = run_generation(engine, &req, codec.as_deref(), req.prompt_ids.len())?;
    if let Some(r) = out.host_syncs_per_token {
        eprintln!("host synchronisations per decoded token: {r:.2}");
    }
    // Every routed expert is resident after loading the cache and every dense weight has been
    // read by now, so RSS should match the estimate.
    let held = (req.prompt_ids.len() + out.generated.len()) as u64;
    let report = match engine.device() {
        DevicePath::Cpu => opened.rss_report_after(held, req.prompt_ids.len() as u64),
        _ => opened.rss_report(),
    };
    if let Some(line) = report {
        eprintln!("{line}");
    }
    if let Some(path) = &a.heatmap_out {
        save_heatmap(engine, &a.model, path)?;
    }
    dump(&a, engine.spec().vocab_size, &out)
}

/// `--max-new-tokens` against `context` (named by `source`), with the library's check (the
/// server's too): a prompt that leaves no room for one new token is an error; more new tokens
/// than the room are capped to it, with a notice. Returns the tokens to generate.
fn fit_context(context: usize, source: &str, prompt: usize, max_new: usize) -> anyhow::Result<usize> {
    if check_context(context, prompt, Some(max_new)).is_ok() {
        return Ok(max_new);
    }
    match check_context(context, prompt, None) {
        Ok(room) => {
            eprintln!(
                "notice: --max-new-tokens {max_new} capped to {room}: the context is {context} tokens ({source}) and the prompt takes {prompt}"
            );
            Ok(room)
        }
        Err(e) => bail!(
            "the prompt does not fit the context: {e}; the context comes from {source} and must hold the prompt and at least one new token"
        ),
    }
}

/// The notice for sampling flags given at `--temperature 0`, where greedy decoding ignores them.
fn greedy_notice(a: &Args) -> Option<String> {
    if a.temperature > 0.0 {
        return None;
    }
    let given: Vec<&str> =
        [(a.top_k.is_some(), "--top-k"), (a.top_p.is_some(), "--top-p"), (a.seed.is_some(), "--seed")]
            .into_iter()
            .filter_map(|(g, name)| g.then_some(name))
            .collect();
    if given.is_empty() {
        return None;
    }
    Some(format!(
        "notice: {} {} nothing at --temperature 0 (greedy: the most likely token every step); give --temperature above 0 to sample",
        given.join(", "),
        if given.len() == 1 { "does" } else { "do" }
    ))
}

/// Whether `--heatmap-out` (of `generate` and `serve`) asks for expert counts: its path is
/// checked and the model must have routed experts, both before the engine loads.
pub(crate) fn heatmap_wanted(
    out: Option<&std::path::Path>,
    files: &ModelFiles,
    model: &std::path::Path,
) -> anyhow::Result<bool> {
    let Some(path) = out else { return Ok(false) };
    crate::dump::check_output_path("--heatmap-out", path, "heatmap.json")?;
    if files.spec().moe.is_none() {
        bail!("--heatmap-out: {} has no routed experts to count", model.display());
    }
    Ok(true)
}

/// Writes the engine's expert counts as a heatmap file (`--heatmap-out` of `generate` and
/// `serve`).
pub(crate) fn save_heatmap(engine: &dyn Engine, model: &std::path::Path, path: &std::path::Path) -> anyhow::Result<()> {
    let spec = engine.spec();
    let moe = spec.moe.as_ref().context("--heatmap-out: the model has no routed experts")?;
    let counts = engine.expert_counts()?.context("--heatmap-out: the engine recorded no expert counts")?;
    let heat = ExpertHeat::from_counts(
        &model.display().to_string(),
        spec.num_layers,
        moe.n_routed_experts,
        moe.routing.top_k,
        &counts,
    );
    heat.save(path).with_context(|| format!("--heatmap-out {}", path.display()))?;
    eprintln!("expert heatmap of {} tokens written to {}", heat.tokens, path.display());
    Ok(())
}

/// Adds the engine's expert counts to the heatmap at `path` beside the model's caches (`krasis
/// serve` without `--heatmap-out`): a heatmap there that fits the model is added to, anything
/// else replaced. Nothing is written when no token was counted or the cache directory does not
/// exist (no cache was built, so nothing pins experts by it).
pub(crate) fn add_to_heatmap(
    engine: &dyn Engine,
    model: &std::path::Path,
    path: &std::path::Path,
) -> anyhow::Result<()> {
    let spec = engine.spec();
    let (Some(moe), Some(counts)) = (spec.moe.as_ref(), engine.expert_counts()?) else { return Ok(()) };
    if counts.iter().all(|&c| c == 0) || !path.parent().is_some_and(|d| d.is_dir()) {
        return Ok(());
    }
    let (layers, experts, k) = (spec.num_layers, moe.n_routed_experts, moe.routing.top_k);
    let mut heat = ExpertHeat::from_counts(&model.display().to_string(), layers, experts, k, &counts);
    if let Ok(old) = ExpertHeat::load(path, layers, experts) {
        for (row, old_row) in heat.counts.iter_mut().zip(&old.counts) {
            row.iter_mut().zip(old_row).for_each(|(c, o)| *c = c.saturating_add(*o));
        }
        heat.tokens = heat.tokens.saturating_add(old.tokens);
    }
    heat.save(path).with_context(|| format!("the heatmap beside the caches, {}", path.display()))?;
    eprintln!(
        "expert heatmap ({} tokens in all) written to {}; the next hybrid start pins experts by it",
        heat.tokens,
        path.display()
    );
    Ok(())
}

/// Streams the generated text (or ids) to stdout and prints the timing line.
fn run_generation(
    engine: &dyn Engine,
    req: &GenerateRequest,
    codec: Option<&TextCodec>,
    prompt_len: usize,
) -> anyhow::Result<GenerateOutput> {
    let mut stream = TextStream::new();
    let stdout = std::io::stdout();
    let out = generate(engine, req, |id| {
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
