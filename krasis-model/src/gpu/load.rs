//! Loading a model onto the GPU: every tensor validated by the same [`WeightLoader`] as the CPU
//! path, converted to BF16 bits (FP8 blocks dequantised first) and uploaded, each allocation
//! charged to the VRAM budget under the tensor's name.

use std::borrow::Cow;
use std::path::Path;
use std::time::Instant;

use krasis_core::budget::format_bytes;
use krasis_core::dtype::f32_to_bf16;
use krasis_cpu::linear::WeightRows;
use krasis_gpu::kv_cache::{KvCapacity, KvLayout};
use krasis_gpu::linear::{GemmContext, GpuLinear, LinearQuant};
use krasis_gpu::moe::GpuExperts;
use krasis_gpu::router::GpuRouter;
use krasis_gpu::sampling::GpuSampler;
use krasis_gpu::{DeviceBuffer, GpuDevice};

use super::layers::{kv_geometry, GpuAttention, GpuFfn, GpuGqa, GpuLayer, GpuMla, GpuMlp, GpuMoe};
use super::{GpuModel, GpuOptions, KV_RESERVE_BYTES};
use crate::error::{ModelError, Result};
use crate::files::ModelFiles;
use crate::linear::{DenseLinear, LinearOp};
use crate::rope::RotaryTables;
use crate::source::WeightSource;
use crate::spec::{AttentionSpec, FfnKind, ModelSpec, TopkMethod};
use crate::weights::WeightLoader;

/// A matrix's elements as BF16 bits (zero-copy when the source is BF16).
fn bf16_bits(l: &DenseLinear) -> Cow<'_, [u16]> {
    match l.weights() {
        WeightRows::Bf16(s) => Cow::Borrowed(s),
        WeightRows::F32(s) => Cow::Owned(s.iter().map(|&v| f32_to_bf16(v)).collect()),
        WeightRows::F16(s) => Cow::Owned(s.iter().map(|&b| f32_to_bf16(half::f16::from_bits(b).to_f32())).collect()),
    }
}

fn f32_values(l: &DenseLinear) -> Vec<f32> {
    let (rows, cols) = (l.out_dim(), l.in_dim());
    let mut out = vec![0f32; rows * cols];
    if cols > 0 {
        for (r, row) in out.chunks_exact_mut(cols).enumerate() {
            l.row_into(r, row);
        }
    }
    out
}

impl GpuModel {
    /// Loads a hub-format directory onto GPU `opts.ordinal` (opens [`ModelFiles`] first).
    pub fn load(dir: &Path, opts: &GpuOptions) -> Result<GpuModel> {
        Self::from_files(&ModelFiles::open(dir)?, opts)
    }

    /// Loads opened model files onto GPU `opts.ordinal`.
    pub fn from_files(files: &ModelFiles, opts: &GpuOptions) -> Result<GpuModel> {
        Self::from_source(files.spec().clone(), files.weights(), opts)
    }

    pub fn from_source(spec: ModelSpec, source: &dyn WeightSource, opts: &GpuOptions) -> Result<GpuModel> {
        let started = Instant::now();
        let dev = GpuDevice::open(opts.ordinal, opts.vram_budget)?;
        let mut log = vec![format!("GPU {}: {}; kernels {}", opts.ordinal, dev.info(), dev.target())];
        dev.warm_up_kernels()?;
        let gemm = GemmContext::new(&dev)?;
        let w = WeightLoader::new(source, &spec.source_quant);
        let h = spec.hidden_size;
        let vec16 = |name: &str, len: usize| -> Result<DeviceBuffer<u16>> {
            let v: Vec<u16> = w.vector(name, len)?.iter().map(|&x| f32_to_bf16(x)).collect();
            Ok(dev.upload(&v, name)?)
        };
        let lin = |name: &str, rows: usize, cols: usize, q: LinearQuant| -> Result<GpuLinear> {
            let m = w.matrix(name, rows, cols)?;
            Ok(GpuLinear::new(&dev, name, &bf16_bits(&m), rows, cols, q)?)
        };
        let mlp = |prefix: &str, inter: usize, q: LinearQuant| -> Result<GpuMlp> {
            Ok(GpuMlp {
                gate: lin(&format!("{prefix}.gate_proj.weight"), inter, h, q)?,
                up: lin(&format!("{prefix}.up_proj.weight"), inter, h, q)?,
                down: lin(&format!("{prefix}.down_proj.weight"), h, inter, q)?,
            })
        };
        let embed_m = w.matrix("model.embed_tokens.weight", spec.vocab_size, h)?;
        let embed = dev.upload(&bf16_bits(&embed_m), "model.embed_tokens.weight")?;
        let aq = opts.attention_quant;
        let mut layers = Vec::with_capacity(spec.num_layers);
        for (l, kind) in spec.layers.iter().enumerate() {
            let p = crate::tensors::layer_prefix(l);
            let a = format!("{p}.self_attn");
            let attention = match spec.attention {
                AttentionSpec::Mla {
                    heads,
                    q_lora_rank,
                    kv_lora_rank,
                    qk_nope_head_dim,
                    qk_rope_head_dim,
                    v_head_dim,
                } => {
                    let qk = qk_nope_head_dim + qk_rope_head_dim;
                    let (q_a, q_b) = match q_lora_rank {
                        Some(r) => (
                            Some((
                                lin(&format!("{a}.q_a_proj.weight"), r, h, aq)?,
                                vec16(&format!("{a}.q_a_layernorm.weight"), r)?,
                            )),
                            lin(&format!("{a}.q_b_proj.weight"), heads * qk, r, aq)?,
                        ),
                        None => (None, lin(&format!("{a}.q_proj.weight"), heads * qk, h, aq)?),
                    };
                    let kv_b_name = format!("{a}.kv_b_proj.weight");
                    let kv_b_rows = heads * (qk_nope_head_dim + v_head_dim);
                    let kv_b_m = w.matrix(&kv_b_name, kv_b_rows, kv_lora_rank)?;
                    let kv_b_bits = bf16_bits(&kv_b_m);
                    GpuAttention::Mla(Box::new(GpuMla {
                        heads,
                        nope: qk_nope_head_dim,
                        rope: qk_rope_head_dim,
                        v_dim: v_head_dim,
                        latent: kv_lora_rank,
                        scale: spec.softmax_scale,
                        q_a,
                        q_b,
                        kv_a: lin(&format!("{a}.kv_a_proj_with_mqa.weight"), kv_lora_rank + qk_rope_head_dim, h, aq)?,
                        kv_a_norm: vec16(&format!("{a}.kv_a_layernorm.weight"), kv_lora_rank)?,
                        kv_b: GpuLinear::new(
                            &dev,
                            &kv_b_name,
                            &kv_b_bits,
                            kv_b_rows,
                            kv_lora_rank,
                            opts.kv_b_proj_quant,
                        )?,
                        kv_b_bf16: dev.upload(&kv_b_bits, &format!("{kv_b_name} (absorbed, bf16)"))?,
                        o_proj: lin(&format!("{a}.o_proj.weight"), h, heads * v_head_dim, aq)?,
                    }))
                }
                AttentionSpec::Gqa { heads, kv_heads, head_dim, qk_norm } => GpuAttention::Gqa(Box::new(GpuGqa {
                    heads,
                    kv_heads,
                    head_dim,
                    scale: spec.softmax_scale,
                    q: lin(&format!("{a}.q_proj.weight"), heads * head_dim, h, aq)?,
                    k: lin(&format!("{a}.k_proj.weight"), kv_heads * head_dim, h, aq)?,
                    v: lin(&format!("{a}.v_proj.weight"), kv_heads * head_dim, h, aq)?,
                    o: lin(&format!("{a}.o_proj.weight"), h, heads * head_dim, aq)?,
                    qk_norm: if qk_norm {
                        Some((
                            vec16(&format!("{a}.q_norm.weight"), head_dim)?,
                            vec16(&format!("{a}.k_norm.weight"), head_dim)?,
                        ))
                    } else {
                        None
                    },
                })),
            };
            let m = format!("{p}.mlp");
            let ffn = match kind {
                FfnKind::Dense { intermediate_size } => {
                    GpuFfn::Dense(Box::new(mlp(&m, *intermediate_size, opts.dense_mlp_quant)?))
                }
                FfnKind::Moe => {
                    let moe = spec.moe.as_ref().expect("MoE layer implies a MoE spec");
                    let e = moe.n_routed_experts;
                    let inter = moe.moe_intermediate_size;
                    let r = moe.routing;
                    let bias = match r.topk {
                        TopkMethod::NoauxTc { .. } => Some(w.vector(&format!("{m}.gate.e_score_correction_bias"), e)?),
                        _ => None,
                    };
                    let gate_name = format!("{m}.gate.weight");
                    let gate = f32_values(&w.matrix(&gate_name, e, h)?);
                    let router = GpuRouter::new(&dev, &gate_name, &gate, e, h, bias.as_deref(), r)?;
                    let mut experts = GpuExperts::new(&dev, &format!("{m}.experts"), e, h, inter)?;
                    for x in 0..e {
                        let ep = format!("{m}.experts.{x}");
                        let g = w.matrix(&format!("{ep}.gate_proj.weight"), inter, h)?;
                        let u = w.matrix(&format!("{ep}.up_proj.weight"), inter, h)?;
                        let d = w.matrix(&format!("{ep}.down_proj.weight"), h, inter)?;
                        experts.upload_expert(&dev, x, &bf16_bits(&g), &bf16_bits(&u), &bf16_bits(&d))?;
                    }
                    let shared = if moe.shared_intermediate_size > 0 {
                        Some(mlp(
                            &format!("{m}.shared_experts"),
                            moe.shared_intermediate_size,
                            opts.shared_expert_quant,
                        )?)
                    } else {
                        None
                    };
                    GpuFfn::Moe(Box::new(GpuMoe { router, experts, top_k: r.top_k, shared }))
                }
            };
            layers.push(GpuLayer {
                hidden: h,
                input_norm: vec16(&format!("{p}.input_layernorm.weight"), h)?,
                post_norm: vec16(&format!("{p}.post_attention_layernorm.weight"), h)?,
                attention,
                ffn,
            });
        }
        let final_norm = vec16("model.norm.weight", h)?;
        let lm_head = if spec.tie_word_embeddings {
            GpuLinear::new(&dev, "lm_head.weight (tied)", &bf16_bits(&embed_m), spec.vocab_size, h, opts.lm_head_quant)?
        } else {
            lin("lm_head.weight", spec.vocab_size, h, opts.lm_head_quant)?
        };
        let weights_bytes = dev.budget().used();

        // KV capacity: asked for, or what the budget leaves (minus the activation reserve).
        let (planes, row, group) = kv_geometry(&spec);
        let max_ctx = spec.max_position_embeddings.max(1);
        let capacity = match opts.kv_tokens {
            Some(n) => KvCapacity::Tokens(n),
            None => KvCapacity::FromBudget { reserve_bytes: KV_RESERVE_BYTES, max_tokens: max_ctx },
        };
        // Sized by arithmetic on the layout (sessions allocate their own caches): nothing is
        // allocated here, but an explicit --kv-tokens that cannot fit is refused now, at load.
        let kv_layout = KvLayout::new(opts.kv_dtype, spec.num_layers, planes, row, group)?;
        let remaining = dev.budget().remaining();
        let kv_tokens = kv_layout.tokens_for(capacity, remaining);
        let kv_bytes = kv_tokens as u64 * kv_layout.bytes_per_token() as u64;
        if kv_tokens == 0 {
            return Err(ModelError::Invalid(format!(
                "the VRAM budget {} leaves no room for a KV cache after {} of weights",
                format_bytes(dev.budget().budget()),
                format_bytes(weights_bytes)
            )));
        }
        if kv_bytes > remaining {
            return Err(krasis_gpu::GpuError::VramBudget {
                requested: kv_bytes,
                used: dev.budget().used(),
                budget: dev.budget().budget(),
                what: format!("the KV cache ({kv_tokens} tokens)"),
            }
            .into());
        }
        log.push(format!(
            "KV cache: {kv_tokens} tokens × {} per token ({}, {})",
            format_bytes(kv_layout.bytes_per_token() as u64),
            opts.kv_dtype,
            format_bytes(kv_bytes)
        ));
        let rope = RotaryTables::new(&spec.rope);
        let (cos, sin) = rope.table(0, kv_tokens);
        let cos = dev.upload(&cos, "rope cos table")?;
        let sin = dev.upload(&sin, "rope sin table")?;
        let sampler = GpuSampler::new(&dev, spec.vocab_size)?;
        log.push(format!(
            "weights on GPU: {} in {:.2} s; VRAM budget {}",
            format_bytes(weights_bytes),
            started.elapsed().as_secs_f64(),
            dev.budget()
        ));
        Ok(GpuModel {
            rope_half: rope.half_dim(),
            rope_pairing: rope.pairing,
            max_pos: kv_tokens,
            spec,
            dev,
            gemm,
            embed,
            layers,
            final_norm,
            lm_head,
            cos,
            sin,
            sampler,
            kv_layout,
            kv_tokens,
            log,
        })
    }
}
