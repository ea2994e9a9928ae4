//! `krasis info`: what a model is and what it will cost on this machine.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args as ClapArgs;
use krasis_core::budget::{format_bytes, ram_limit_bytes};
use krasis_model::arch::{parse_checkpoint_config, CheckpointConfig};
use krasis_model::cpu::memory::{estimate, format_name, stored_bytes, WeightBits};
use krasis_model::model::tensors::{missing_tensors, param_counts};
use krasis_model::source::files::ModelFiles;
use krasis_model::spec::{AttentionSpec, FfnKind, MixerKind, QkNorm, RopeScaling, SourceQuant};
use krasis_model::synth::stored_tensors;

#[derive(ClapArgs)]
pub struct Args {
    /// Model directory or GGUF file.
    #[arg(long, required_unless_present = "config", conflicts_with = "config")]
    model: Option<PathBuf>,
    /// A config.json alone, no weights (a published one, before downloading the model): the
    /// plan, the published storage and the memory each precision needs for the full model.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

fn billions(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.2} B", n as f64 / 1e9)
    } else {
        format!("{:.2} M", n as f64 / 1e6)
    }
}

/// Checks that the weights are there and whole (headers, byte ranges against file sizes, every
/// tensor the config implies; nothing is read beyond the headers). Returns the report line.
fn check_weights(files: &ModelFiles) -> anyhow::Result<String> {
    let missing = missing_tensors(files.spec(), files.weights());
    if let Some(first) = missing.first() {
        bail!(
            "{}: {} of the tensors config.json implies are missing from the weights (first: {first})",
            files.path().display(),
            missing.len()
        );
    }
    Ok(format!("{}; headers, sizes and tensor names check out", files.weights().describe()))
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let files: ModelFiles;
    let cfg: CheckpointConfig;
    let (spec, notes, gguf) = match (&a.model, &a.config) {
        (Some(model), _) => {
            files = ModelFiles::open(model)?;
            let weights = check_weights(&files)?;
            println!("model        {}", model.display());
            println!("weights      {weights}");
            (files.spec(), files.notes(), files.gguf())
        }
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            cfg = parse_checkpoint_config(&text, path)?;
            let stored = stored_tensors(&cfg)?;
            let bytes: usize = stored.iter().map(|t| t.shape.iter().product::<usize>() * t.dtype.size_bytes()).sum();
            println!("config       {}", path.display());
            println!(
                "weights      none read; as published: {} tensors, {} ({})",
                stored.len(),
                format_bytes(bytes as u64),
                match cfg.spec.source_quant {
                    SourceQuant::None => "BF16",
                    SourceQuant::Fp8Block { .. } => "block FP8 projections, the rest BF16",
                    SourceQuant::CompressedInt4 { .. } => "compressed-tensors INT4 routed experts, the rest BF16",
                    SourceQuant::ModelOptNvfp4 => "ModelOpt NVFP4 routed experts, the rest BF16",
                    SourceQuant::Mxfp4 => "MXFP4 routed experts, the rest BF16",
                }
            );
            (&cfg.spec, cfg.notes.as_slice(), None)
        }
        (None, None) => bail!("give a model (--model) or a config.json (--config)"),
    };
    let counts = param_counts(spec);
    println!("architecture {}", spec.arch.model_type());
    for note in notes {
        println!("note         {note}");
    }
    if let Some(m) = gguf {
        use krasis_model::placement::precision::{ExpertWidthRule, LayerBits};
        use krasis_model::source::gguf::expert_source_types;
        let types = expert_source_types(m, spec);
        let auto = ExpertWidthRule::Auto.layer_bits(spec);
        let mut kinds: Vec<([krasis_quant::ggml::GgmlType; 3], LayerBits)> = Vec::new();
        for (k, b) in types.iter().map(|(_, t)| *t).zip(auto.iter().copied()) {
            if !kinds.contains(&(k, b)) {
                kinds.push((k, b));
            }
        }
        // A 4-bit float format `auto` keeps as stored (every expert projection MXFP4).
        let kept = krasis_model::placement::precision::native_fp4(spec);
        // GGUF blocks `auto` keeps as stored (Q4_K, Q6_K; Q5_0 / Q8_0 as INT8 g32 of their values).
        let ggml = krasis_model::placement::precision::ggml_kept(spec);
        for ([g, u, d], b) in kinds {
            let layers = types.iter().filter(|(_, t)| *t == [g, u, d]).count();
            let as_kept = ggml.as_ref().and_then(|k| k.iter().find(|l| l.types == [g, u, d]));
            let cached = match (kept, as_kept) {
                (Some(kind), _) => format!("{kind} as stored"),
                (None, Some(l)) => format!("as stored: w13 {}, w2 {}", l.w13, l.w2),
                (None, None) => format!("w13 int{}, w2 int{}", b.w13.bits(), b.w2.bits()),
            };
            println!(
                "gguf experts gate {g}, up {u}, down {d} ({layers} MoE layers): --cpu-expert-bits auto caches {cached}"
            );
        }
    }
    // Safetensors routed experts in a 4-bit float format (ModelOpt NVFP4, OpenAI MXFP4): `auto`
    // keeps them as stored rather than requantising, which the GGUF line above says for GGUFs.
    let kept_fp4 = match (gguf, &spec.moe) {
        (None, Some(_)) => krasis_model::placement::precision::native_fp4(spec),
        _ => None,
    };
    if let Some(kind) = kept_fp4 {
        println!("stored       routed experts in {kind}: --cpu-expert-bits auto caches them as {kind}, as stored");
    }
    println!(
        "shape        {} layers, hidden {}, vocab {}, max positions {}",
        spec.num_layers, spec.hidden_size, spec.vocab_size, spec.max_position_embeddings
    );
    match spec.attention {
        AttentionSpec::Mla { heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim } => {
            println!(
                "attention    MLA: {heads} heads, kv_lora {kv_lora_rank}, q_lora {}, qk {qk_nope_head_dim}+{qk_rope_head_dim} (rope), v {v_head_dim}",
                q_lora_rank.map_or("none".to_string(), |r| r.to_string())
            )
        }
        AttentionSpec::Gqa { heads, kv_heads, head_dim, qk_norm, bias, output_gate } => println!(
            "attention    GQA: {heads} heads / {kv_heads} kv heads, head dim {head_dim}{}{}{}{}{}",
            match qk_norm {
                QkNorm::None => "",
                QkNorm::PerHead => ", qk-norm",
                QkNorm::Whole => ", qk-norm over the whole projection",
            },
            if output_gate { ", output gate" } else { "" },
            if bias.qkv { ", q/k/v biases" } else { "" },
            if bias.o { ", o bias" } else { "" },
            if spec.rope.dim < head_dim {
                format!(", rotary on {} of {head_dim} dims", spec.rope.dim)
            } else {
                String::new()
            }
        ),
    }
    if spec.attention_sinks || spec.sliding_windows.iter().any(Option::is_some) {
        let pattern: String = (0..spec.num_layers).map(|l| if spec.window(l).is_some() { 'S' } else { 'F' }).collect();
        let window = spec.sliding_windows.iter().flatten().next().map_or(String::new(), |w| format!(" of {w}"));
        let sinks = if spec.attention_sinks { "; a sink logit per head" } else { "" };
        println!("layers       {pattern} (S sliding window{window}, F full attention){sinks}");
    }
    if let Some(d) = spec.delta_net {
        let pattern: String = spec
            .mixers
            .iter()
            .map(|m| match m {
                MixerKind::Attention => 'A',
                MixerKind::GatedDeltaNet => 'D',
            })
            .collect();
        let n = spec.mixers.iter().filter(|m| **m == MixerKind::GatedDeltaNet).count();
        let state = n * 4 * (d.rule_state_len() + d.conv_state_len());
        println!(
            "deltanet     {n} of {} layers: {} key heads × {}, {} value heads × {}, conv {} taps; state {} per sequence, whatever its length",
            spec.num_layers,
            d.key_heads,
            d.key_dim,
            d.value_heads,
            d.value_dim,
            d.conv_kernel,
            format_bytes(state as u64)
        );
        println!("layers       {pattern} (D gated DeltaNet, A attention)");
    }
    let rope = match &spec.rope.scaling {
        RopeScaling::None => "none".to_string(),
        RopeScaling::Linear { factor } => format!("linear ×{factor}"),
        RopeScaling::Yarn { factor, original_max_position_embeddings, .. } => {
            format!("YaRN ×{factor} from {original_max_position_embeddings}")
        }
    };
    println!("rope         theta {}, dim {}, scaling {rope}", spec.rope.theta, spec.rope.dim);
    let dense = spec.layers.iter().filter(|k| matches!(k, FfnKind::Dense { .. })).count();
    if let Some(moe) = &spec.moe {
        let r = &moe.routing;
        println!(
            "experts      {} MoE layers + {dense} dense; {} routed (top-{}), intermediate {}, shared intermediate {}",
            spec.moe_layers().count(),
            moe.n_routed_experts,
            r.top_k,
            moe.moe_intermediate_size,
            moe.shared_intermediate_size
        );
        println!(
            "routing      {:?} scores, {:?}, norm_topk_prob {}, scale {}",
            r.scoring, r.topk, r.norm_topk_prob, r.routed_scaling_factor
        );
        let act = match spec.expert_activation {
            krasis_model::spec::ExpertActivation::Silu => "SiLU".to_string(),
            krasis_model::spec::ExpertActivation::ClampedSwiglu { alpha, limit } => {
                format!("clamped SwiGLU (alpha {alpha}, limit {limit}, (up + 1) · gate · σ(alpha · gate))")
            }
        };
        let bias = if spec.expert_bias { "; experts and router with biases" } else { "" };
        println!("activation   {act}{bias}");
    }
    println!(
        "parameters   {} total, {} active per token, {} in routed experts",
        billions(counts.total),
        billions(counts.active),
        billions(counts.routed_expert)
    );
    if counts.per_expert > 0 {
        println!(
            "per expert   {} params: bf16 {}, int8 {}, int4 {}, int4a {}",
            counts.per_expert,
            format_bytes(stored_bytes(WeightBits::Bf16, counts.per_expert)),
            format_bytes(stored_bytes(WeightBits::Int8, counts.per_expert)),
            format_bytes(stored_bytes(WeightBits::Int4, counts.per_expert)),
            format_bytes(stored_bytes(WeightBits::Int4Asym, counts.per_expert)),
        );
    }
    let sys = krasis_core::hw::probe();
    println!(
        "memory (CPU reference path, 4K context; limit {} = 95% of RAM):",
        format_bytes(ram_limit_bytes(sys.mem_total_bytes))
    );
    let auto = (gguf.is_some() || kept_fp4.is_some()).then_some(WeightBits::Auto);
    // Asymmetric INT4 g32: `auto`'s width for float experts on the CPU (engine and hybrid).
    let asym = krasis_model::placement::precision::int4a_by_default(spec).then_some(WeightBits::Int4Asym);
    for f in [WeightBits::Bf16, WeightBits::Int8, WeightBits::Int4].into_iter().chain(asym).chain(auto) {
        let e = estimate(spec, f);
        let default = if f == WeightBits::Int4Asym {
            " (the default on the CPU and hybrid where it fits the RAM limit)"
        } else {
            ""
        };
        println!(
            "  experts {:<10} dense {} + experts {} + process {} + KV {}/token → {}{default}",
            format_name(f),
            format_bytes(e.dense_bytes),
            format_bytes(e.expert_bytes),
            format_bytes(e.process_bytes),
            format_bytes(e.kv_bytes_per_token),
            format_bytes(e.total(4096))
        );
    }
    println!(
        "system       {}; {} logical CPUs, {} physical cores, SMT {}, {} NUMA node(s), RAM {} ({} available), THP {}, governor {}",
        sys.cpu_model,
        sys.logical_cpus,
        sys.physical_cores,
        if sys.smt_active { "on" } else { "off" },
        sys.numa_nodes.len(),
        format_bytes(sys.mem_total_bytes),
        format_bytes(sys.mem_available_bytes),
        sys.thp_enabled.as_deref().unwrap_or("unknown"),
        if sys.governors.is_empty() { "unknown".to_string() } else { sys.governors.join(",") }
    );
    // The smallest the weights get (INT4 experts): huge pages matter from there.
    for w in sys.warnings(estimate(spec, WeightBits::Int4).weight_bytes()) {
        println!("warning      {w}");
    }
    Ok(())
}
