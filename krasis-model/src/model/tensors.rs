//! The tensor inventory a [`ModelSpec`] implies: canonical (HF) names, logical shapes and roles.
//! The loader validates against it, `krasis synth` writes it, `krasis info` counts it.

use crate::source::WeightSource;
use crate::spec::{AttentionSpec, ExpertNaming, FfnKind, ModelSpec, QkNorm, TopkMethod};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorRole {
    Embedding,
    LmHead,
    Norm,
    /// A norm weight stored zero-centred: the norm scales by `1 + w` (Qwen3-Next, Qwen3.5);
    /// loaders add the 1 ([`crate::model::weights::WeightLoader::vector_of`]).
    CentredNorm,
    Attention,
    /// A small parameter of a linear-attention layer, held in f32: DeltaNet's convolution taps,
    /// `A_log` and `dt_bias`.
    MixerParam,
    /// The bias vector of a projection (`[out]`: attention q/k/v/o biases, a routed expert's
    /// gate/up/down biases, a router's logit bias), added after the matrix product; held
    /// unquantised. Attention sinks (one logit per head, gpt-oss) are held as one too.
    Bias,
    /// A router's gate matrix, or a shared expert's one-row sigmoid gate (held unquantised).
    Router,
    RouterBias,
    SharedExpert,
    DenseMlp,
    RoutedExpert {
        layer: usize,
        expert: usize,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: TensorRole,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Whether a tensor is a 2-D projection (an FP8 checkpoint stores those quantised).
pub fn is_matrix(t: &TensorSpec) -> bool {
    t.shape.len() == 2 && !matches!(t.role, TensorRole::Embedding | TensorRole::Router)
}

/// Tensor prefix of layer `l` in the canonical (HF) naming.
pub fn layer_prefix(l: usize) -> String {
    format!("model.layers.{l}")
}

/// A gated MLP's three projections (dense layers, shared experts, each routed expert).
#[derive(Clone, Debug, PartialEq)]
pub struct MlpTensors {
    pub gate: TensorSpec,
    pub up: TensorSpec,
    pub down: TensorSpec,
    /// The gate, up and down projections' biases (`P.bias`, [`TensorRole::Bias`]): a routed
    /// expert's where [`ModelSpec::expert_bias`] (gpt-oss).
    pub bias: Option<[TensorSpec; 3]>,
}

/// MLA's query path: one projection, or a low-rank pair with a norm between.
#[derive(Clone, Debug, PartialEq)]
pub enum QueryTensors {
    Direct(TensorSpec),
    LowRank { a: TensorSpec, norm: TensorSpec, b: TensorSpec },
}

// The GQA variant (with its optional biases) is the larger; one value per layer, built once.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum AttentionTensors {
    Mla {
        q: QueryTensors,
        kv_a: TensorSpec,
        kv_a_norm: TensorSpec,
        kv_b: TensorSpec,
        o: TensorSpec,
    },
    Gqa {
        q: TensorSpec,
        k: TensorSpec,
        v: TensorSpec,
        o: TensorSpec,
        qk_norm: Option<(TensorSpec, TensorSpec)>,
        /// `q_proj.bias`, `k_proj.bias`, `v_proj.bias` ([`crate::spec::AttnBias::qkv`]).
        qkv_bias: Option<[TensorSpec; 3]>,
        /// `o_proj.bias` ([`crate::spec::AttnBias::o`]).
        o_bias: Option<TensorSpec>,
        /// `sinks` `[heads]`: one sink logit per query head ([`ModelSpec::attention_sinks`]).
        sinks: Option<TensorSpec>,
    },
    /// A gated-DeltaNet layer ([`crate::spec::DeltaNetSpec`]), under `linear_attn.`: the input
    /// projections `in_proj_qkv` (q of all key heads, then k, then v of all value heads), `in_proj_z`
    /// (the output gate), `in_proj_b` (β) and `in_proj_a` (the decay's input), the depthwise
    /// `conv1d` over the q, k and v channels, `A_log`, `dt_bias`, the gated output `norm` (a
    /// plain gain) and `out_proj`.
    GatedDeltaNet {
        qkv: TensorSpec,
        z: TensorSpec,
        b: TensorSpec,
        a: TensorSpec,
        conv: TensorSpec,
        a_log: TensorSpec,
        dt_bias: TensorSpec,
        norm: TensorSpec,
        out: TensorSpec,
    },
}

// The MoE variant (with its optional gate) is the larger; one value per layer, built once.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum FfnTensors {
    Dense(MlpTensors),
    Moe {
        router: TensorSpec,
        bias: Option<TensorSpec>,
        experts: Vec<MlpTensors>,
        shared: Option<MlpTensors>,
        /// The shared expert's one-row sigmoid gate `[1, hidden]`
        /// ([`crate::spec::MoeSpec::shared_gate`]).
        shared_gate: Option<TensorSpec>,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayerTensors {
    pub input_norm: TensorSpec,
    pub post_norm: TensorSpec,
    pub attention: AttentionTensors,
    pub ffn: FfnTensors,
}

/// Every tensor a model has, by the part it plays: the one place canonical names are spelled.
/// Builders walk this ([`crate::model::build`]), the loader validates against it, `krasis synth` writes
/// it, `krasis info` counts it.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelTensors {
    pub embed: TensorSpec,
    pub layers: Vec<LayerTensors>,
    pub final_norm: TensorSpec,
    /// The LM head; with tied embeddings it names the embedding matrix.
    pub lm_head: TensorSpec,
    pub tied_lm_head: bool,
}

fn tensor(name: String, shape: Vec<usize>, role: TensorRole) -> TensorSpec {
    TensorSpec { name, shape, role }
}

fn mlp_tensors(prefix: &str, inter: usize, hidden: usize, role: TensorRole) -> MlpTensors {
    MlpTensors {
        gate: tensor(format!("{prefix}.gate_proj.weight"), vec![inter, hidden], role),
        up: tensor(format!("{prefix}.up_proj.weight"), vec![inter, hidden], role),
        down: tensor(format!("{prefix}.down_proj.weight"), vec![hidden, inter], role),
        bias: None,
    }
}

/// The MoE block's prefix in layer `l` (`…mlp` or `…block_sparse_moe`).
pub fn moe_prefix(spec: &ModelSpec, l: usize) -> String {
    match spec.moe.as_ref().map_or(ExpertNaming::Mlp, |m| m.naming) {
        ExpertNaming::Mlp | ExpertNaming::MlpSharedExpert | ExpertNaming::Router => format!("{}.mlp", layer_prefix(l)),
        ExpertNaming::BlockSparse => format!("{}.block_sparse_moe", layer_prefix(l)),
    }
}

/// The prefix of the routed experts of layer `l` (`…mlp.experts`), for messages.
pub fn experts_prefix(spec: &ModelSpec, l: usize) -> String {
    format!("{}.experts", moe_prefix(spec, l))
}

/// Routed expert `e` of MoE layer `l`.
pub fn expert_tensors(spec: &ModelSpec, l: usize, e: usize) -> MlpTensors {
    let inter = spec.moe.as_ref().map_or(0, |m| m.moe_intermediate_size);
    let prefix = format!("{}.{e}", experts_prefix(spec, l));
    let role = TensorRole::RoutedExpert { layer: l, expert: e };
    let mut t = match spec.moe.as_ref().map_or(ExpertNaming::Mlp, |m| m.naming) {
        ExpertNaming::Mlp | ExpertNaming::MlpSharedExpert | ExpertNaming::Router => {
            mlp_tensors(&prefix, inter, spec.hidden_size, role)
        }
        ExpertNaming::BlockSparse => MlpTensors {
            gate: tensor(format!("{prefix}.w1.weight"), vec![inter, spec.hidden_size], role),
            up: tensor(format!("{prefix}.w3.weight"), vec![inter, spec.hidden_size], role),
            down: tensor(format!("{prefix}.w2.weight"), vec![spec.hidden_size, inter], role),
            bias: None,
        },
    };
    if spec.expert_bias {
        let bias = |w: &TensorSpec| {
            let name =
                w.name.strip_suffix(".weight").map_or_else(|| format!("{}.bias", w.name), |p| format!("{p}.bias"));
            tensor(name, vec![w.shape[0]], TensorRole::Bias)
        };
        t.bias = Some([bias(&t.gate), bias(&t.up), bias(&t.down)]);
    }
    t
}

/// The role of the model's norm weights ([`TensorRole::CentredNorm`] when stored zero-centred).
fn norm_role(spec: &ModelSpec) -> TensorRole {
    if spec.norm_plus_one {
        TensorRole::CentredNorm
    } else {
        TensorRole::Norm
    }
}

fn delta_net_tensors(spec: &ModelSpec, l: usize) -> AttentionTensors {
    let d = spec.delta_net.expect("a DeltaNet layer implies the DeltaNet spec");
    let (h, kw, vw) = (spec.hidden_size, d.key_width(), d.value_width());
    let p = format!("{}.linear_attn", layer_prefix(l));
    let w = |name: &str, shape: Vec<usize>, role| tensor(format!("{p}.{name}.weight"), shape, role);
    let param = |name: &str, n: usize| tensor(format!("{p}.{name}"), vec![n], TensorRole::MixerParam);
    AttentionTensors::GatedDeltaNet {
        qkv: w("in_proj_qkv", vec![2 * kw + vw, h], TensorRole::Attention),
        z: w("in_proj_z", vec![vw, h], TensorRole::Attention),
        b: w("in_proj_b", vec![d.value_heads, h], TensorRole::Attention),
        a: w("in_proj_a", vec![d.value_heads, h], TensorRole::Attention),
        conv: w("conv1d", vec![d.conv_channels(), 1, d.conv_kernel], TensorRole::MixerParam),
        a_log: param("A_log", d.value_heads),
        dt_bias: param("dt_bias", d.value_heads),
        norm: w("norm", vec![d.value_dim], TensorRole::Norm),
        out: w("out_proj", vec![h, vw], TensorRole::Attention),
    }
}

fn attention_tensors(spec: &ModelSpec, l: usize) -> AttentionTensors {
    if spec.is_delta_net(l) {
        return delta_net_tensors(spec, l);
    }
    let h = spec.hidden_size;
    let a = format!("{}.self_attn", layer_prefix(l));
    let t = |name: &str, shape: Vec<usize>, role: TensorRole| tensor(format!("{a}.{name}.weight"), shape, role);
    let proj = |name: &str, shape: Vec<usize>| t(name, shape, TensorRole::Attention);
    let bias = |name: &str, out: usize| tensor(format!("{a}.{name}.bias"), vec![out], TensorRole::Bias);
    match spec.attention {
        AttentionSpec::Mla { heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim } => {
            let qk = qk_nope_head_dim + qk_rope_head_dim;
            AttentionTensors::Mla {
                q: match q_lora_rank {
                    Some(r) => QueryTensors::LowRank {
                        a: proj("q_a_proj", vec![r, h]),
                        norm: t("q_a_layernorm", vec![r], TensorRole::Norm),
                        b: proj("q_b_proj", vec![heads * qk, r]),
                    },
                    None => QueryTensors::Direct(proj("q_proj", vec![heads * qk, h])),
                },
                kv_a: proj("kv_a_proj_with_mqa", vec![kv_lora_rank + qk_rope_head_dim, h]),
                kv_a_norm: t("kv_a_layernorm", vec![kv_lora_rank], TensorRole::Norm),
                kv_b: proj("kv_b_proj", vec![heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]),
                o: proj("o_proj", vec![h, heads * v_head_dim]),
            }
        }
        AttentionSpec::Gqa { heads, kv_heads, head_dim, qk_norm, bias: b, output_gate } => AttentionTensors::Gqa {
            q: proj("q_proj", vec![heads * head_dim * if output_gate { 2 } else { 1 }, h]),
            k: proj("k_proj", vec![kv_heads * head_dim, h]),
            v: proj("v_proj", vec![kv_heads * head_dim, h]),
            o: proj("o_proj", vec![h, heads * head_dim]),
            qk_norm: {
                let (qn, kn) = match qk_norm {
                    QkNorm::Whole => (heads * head_dim, kv_heads * head_dim),
                    _ => (head_dim, head_dim),
                };
                qk_norm.on().then(|| (t("q_norm", vec![qn], norm_role(spec)), t("k_norm", vec![kn], norm_role(spec))))
            },
            qkv_bias: b.qkv.then(|| {
                [
                    bias("q_proj", heads * head_dim),
                    bias("k_proj", kv_heads * head_dim),
                    bias("v_proj", kv_heads * head_dim),
                ]
            }),
            o_bias: b.o.then(|| bias("o_proj", h)),
            sinks: spec.attention_sinks.then(|| tensor(format!("{a}.sinks"), vec![heads], TensorRole::Bias)),
        },
    }
}

fn ffn_tensors(spec: &ModelSpec, l: usize, kind: &FfnKind) -> FfnTensors {
    let h = spec.hidden_size;
    let m = format!("{}.mlp", layer_prefix(l));
    match kind {
        FfnKind::Dense { intermediate_size: i } => FfnTensors::Dense(mlp_tensors(&m, *i, h, TensorRole::DenseMlp)),
        FfnKind::Moe => {
            let moe = spec.moe.as_ref().expect("MoE layer implies a MoE spec");
            let e = moe.n_routed_experts;
            let s = moe.shared_intermediate_size;
            let b = moe_prefix(spec, l);
            // MiniMax-M2 keeps the correction bias beside its `block_sparse_moe.gate`, DeepSeek
            // and GLM inside their `mlp.gate`.
            let bias_name = match moe.naming {
                ExpertNaming::BlockSparse => format!("{b}.e_score_correction_bias"),
                ExpertNaming::Mlp | ExpertNaming::MlpSharedExpert | ExpertNaming::Router => {
                    format!("{b}.gate.e_score_correction_bias")
                }
            };
            let shared = match moe.naming {
                ExpertNaming::MlpSharedExpert => format!("{m}.shared_expert"),
                ExpertNaming::Mlp | ExpertNaming::BlockSparse | ExpertNaming::Router => format!("{m}.shared_experts"),
            };
            // A router that is a linear with a bias (`mlp.router`): the bias adds to its logits
            // ([`TensorRole::Bias`]); a correction bias only chooses ([`TensorRole::RouterBias`]).
            let (router, bias) = match moe.naming {
                ExpertNaming::Router => (
                    tensor(format!("{m}.router.weight"), vec![e, h], TensorRole::Router),
                    Some(tensor(format!("{m}.router.bias"), vec![e], TensorRole::Bias)),
                ),
                _ => (
                    tensor(format!("{b}.gate.weight"), vec![e, h], TensorRole::Router),
                    matches!(moe.routing.topk, TopkMethod::NoauxTc { .. })
                        .then(|| tensor(bias_name, vec![e], TensorRole::RouterBias)),
                ),
            };
            FfnTensors::Moe {
                router,
                bias,
                experts: (0..e).map(|x| expert_tensors(spec, l, x)).collect(),
                shared: (s > 0).then(|| mlp_tensors(&shared, s, h, TensorRole::SharedExpert)),
                shared_gate: (s > 0 && moe.shared_gate)
                    .then(|| tensor(format!("{m}.shared_expert_gate.weight"), vec![1, h], TensorRole::Router)),
            }
        }
    }
}

pub fn model_tensors(spec: &ModelSpec) -> ModelTensors {
    let h = spec.hidden_size;
    let embed = tensor("model.embed_tokens.weight".into(), vec![spec.vocab_size, h], TensorRole::Embedding);
    let layers = spec
        .layers
        .iter()
        .enumerate()
        .map(|(l, kind)| LayerTensors {
            input_norm: tensor(format!("{}.input_layernorm.weight", layer_prefix(l)), vec![h], norm_role(spec)),
            post_norm: tensor(format!("{}.post_attention_layernorm.weight", layer_prefix(l)), vec![h], norm_role(spec)),
            attention: attention_tensors(spec, l),
            ffn: ffn_tensors(spec, l, kind),
        })
        .collect();
    let tied = spec.tie_word_embeddings;
    let lm_head_name = if tied { embed.name.clone() } else { "lm_head.weight".into() };
    ModelTensors {
        lm_head: tensor(lm_head_name, vec![spec.vocab_size, h], TensorRole::LmHead),
        embed,
        layers,
        final_norm: tensor("model.norm.weight".into(), vec![h], norm_role(spec)),
        tied_lm_head: tied,
    }
}

impl MlpTensors {
    fn push_into(&self, out: &mut Vec<TensorSpec>) {
        out.extend([self.gate.clone(), self.up.clone(), self.down.clone()]);
        out.extend(self.bias.iter().flatten().cloned());
    }
}

/// The stored tensors, in file order (a tied LM head is not stored twice).
pub fn expected_tensors(spec: &ModelSpec) -> Vec<TensorSpec> {
    let m = model_tensors(spec);
    let mut out = vec![m.embed];
    for layer in m.layers {
        out.push(layer.input_norm);
        out.push(layer.post_norm);
        match layer.attention {
            AttentionTensors::Mla { q, kv_a, kv_a_norm, kv_b, o } => {
                match q {
                    QueryTensors::LowRank { a, norm, b } => out.extend([a, norm, b]),
                    QueryTensors::Direct(q) => out.push(q),
                }
                out.extend([kv_a, kv_a_norm, kv_b, o]);
            }
            AttentionTensors::Gqa { q, k, v, o, qk_norm, qkv_bias, o_bias, sinks } => {
                out.extend([q, k, v, o]);
                out.extend(qkv_bias.into_iter().flatten());
                out.extend(o_bias);
                out.extend(sinks);
                if let Some((qn, kn)) = qk_norm {
                    out.extend([qn, kn]);
                }
            }
            AttentionTensors::GatedDeltaNet { qkv, z, b, a, conv, a_log, dt_bias, norm, out: o } => {
                out.extend([qkv, z, b, a, conv, a_log, dt_bias, norm, o]);
            }
        }
        match layer.ffn {
            FfnTensors::Dense(mlp) => mlp.push_into(&mut out),
            FfnTensors::Moe { router, bias, experts, shared, shared_gate } => {
                out.push(router);
                out.extend(bias);
                for e in &experts {
                    e.push_into(&mut out);
                }
                if let Some(s) = shared {
                    s.push_into(&mut out);
                }
                out.extend(shared_gate);
            }
        }
    }
    out.push(m.final_norm);
    if !m.tied_lm_head {
        out.push(m.lm_head);
    }
    out
}

/// The names of the tensors `spec` needs that `source` lacks, in inventory order. On a
/// compressed-tensors INT4 source a linear `P.weight` may be stored as `P.weight_packed` (with
/// `P.weight_scale` and `P.weight_shape`, checked when read) instead; on an MXFP4 source as
/// `P.weight_blocks` (with `P.weight_scales`).
pub fn missing_tensors(spec: &ModelSpec, source: &dyn WeightSource) -> Vec<String> {
    let packed = match spec.source_quant {
        _ if spec.source_quant.stored_int4_group().is_some() => Some("weight_packed"),
        crate::spec::SourceQuant::Mxfp4 => Some("weight_blocks"),
        _ => None,
    };
    let stored = |n: &str| {
        source.contains(n)
            || packed.is_some_and(|suffix| {
                n.strip_suffix(".weight").is_some_and(|p| source.contains(&format!("{p}.{suffix}")))
            })
    };
    expected_tensors(spec).into_iter().map(|t| t.name).filter(|n| !stored(n)).collect()
}

/// Parameter counts: total, and active per token (routed experts counted `top_k` times per MoE layer).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParamCounts {
    pub total: u64,
    pub active: u64,
    pub routed_expert: u64,
    /// Parameters of one routed expert (gate + up + down).
    pub per_expert: u64,
}

pub fn param_counts(spec: &ModelSpec) -> ParamCounts {
    let mut c = ParamCounts::default();
    for t in expected_tensors(spec) {
        let n = t.numel() as u64;
        c.total += n;
        match t.role {
            TensorRole::RoutedExpert { .. } => c.routed_expert += n,
            TensorRole::Embedding => {} // a gather, not a matmul: one row per token
            _ => c.active += n,
        }
    }
    if let Some(moe) = &spec.moe {
        let i = moe.moe_intermediate_size as u64;
        c.per_expert = 3 * i * spec.hidden_size as u64;
        let moe_layers = spec.moe_layers().count() as u64;
        c.active += moe_layers * moe.routing.top_k as u64 * c.per_expert;
    }
    c.active += spec.hidden_size as u64;
    c
}
