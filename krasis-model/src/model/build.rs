//! The one build walk: every engine (the CPU reference and quantised engine, the whole-model GPU
//! engine, the hybrid) is built by [`build`] walking [`crate::model::tensors::ModelTensors`] and asking a
//! [`WeightBuilder`] to turn each tensor into what its backend runs. The walk decides which
//! tensors a model has and what part each plays; a builder decides only where a weight lives and
//! in which format. The engines keep the typed [`Weights`] tree, and the one forward walk
//! ([`crate::model::walk`]) runs over it.

use crate::error::Result;
use crate::model::tensors::{
    model_tensors, AttentionTensors, FfnTensors, LayerTensors, MlpTensors, QueryTensors, TensorSpec,
};
use crate::spec::{ModelSpec, RoutingRule};

/// What a dense projection is for: builders choose its precision by class
/// (`--cpu-dense-bits`, `--attention-quant`, …).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearClass {
    /// q / kv_a / o projections (and q_a / q_b), GQA q/k/v/o.
    Attention,
    SharedExpert,
    /// The MLP of a dense (non-MoE) layer.
    DenseMlp,
    LmHead,
}

/// The types one backend holds its weights in: the CPU engine's and the GPU engine's. The built
/// [`Weights`] tree is typed by these alone (not by the builder, which borrows its sources), so
/// an engine keeps the tree itself and the forward walk ([`crate::model::walk`]) runs over it.
pub trait WeightKinds: 'static {
    /// A dense projection as this backend runs it.
    type Linear;
    /// A gated MLP (dense layers, shared experts).
    type Mlp;
    /// A norm weight (or other small vector).
    type Vector;
    type Embedding;
    /// MLA's `kv_b_proj`: the CPU keeps it in f32 for the absorbed form, the GPU as a linear
    /// plus a BF16 copy.
    type KvB;
    type Router;
    /// The routed experts of one MoE layer: the layer's expert backend.
    type Experts;
}

/// A builder's linear type.
pub type Linear<B> = <<B as WeightBuilder>::Kinds as WeightKinds>::Linear;
/// A builder's vector type.
pub type Vector<B> = <<B as WeightBuilder>::Kinds as WeightKinds>::Vector;
/// A builder's MLP type.
pub type Mlp<B> = <<B as WeightBuilder>::Kinds as WeightKinds>::Mlp;

/// Turns the tensors the walk visits into one backend's weights.
pub trait WeightBuilder {
    type Kinds: WeightKinds;
    /// A gated MLP's gate and up projections as built, before [`WeightBuilder::mlp`] joins them
    /// with the down projection (a backend may fuse gate and up into one matrix).
    type GateUp;

    fn embedding(&mut self, t: &TensorSpec) -> Result<<Self::Kinds as WeightKinds>::Embedding>;
    fn linear(&mut self, t: &TensorSpec, class: LinearClass) -> Result<Linear<Self>>;
    fn gate_up(&mut self, gate: &TensorSpec, up: &TensorSpec, class: LinearClass) -> Result<Self::GateUp>;
    /// The MLP of `gate_up` and `down` as the backend runs it.
    fn mlp(&mut self, gate_up: Self::GateUp, down: Linear<Self>) -> Result<Mlp<Self>>;
    fn vector(&mut self, t: &TensorSpec) -> Result<Vector<Self>>;
    fn kv_b(&mut self, t: &TensorSpec) -> Result<<Self::Kinds as WeightKinds>::KvB>;
    fn router(
        &mut self,
        weight: &TensorSpec,
        bias: Option<&TensorSpec>,
        rule: &RoutingRule,
    ) -> Result<<Self::Kinds as WeightKinds>::Router>;
    fn experts(&mut self, layer: usize, experts: &[MlpTensors]) -> Result<<Self::Kinds as WeightKinds>::Experts>;
    /// Called once per layer after it is built (progress, budget logs).
    fn layer_done(&mut self, _layer: usize) {}
}

/// MLA's weights as a backend holds them (`L`: a linear, `V`: a norm weight, `K`: `kv_b_proj`).
/// With a query LoRA `q_a` is `Some((q_a_proj, q_a_layernorm))` and `q_b` is `q_b_proj`; without,
/// `q_a` is `None` and `q_b` is `q_proj`.
pub struct MlaParts<L, V, K> {
    pub q_a: Option<(L, V)>,
    pub q_b: L,
    pub kv_a: L,
    pub kv_a_norm: V,
    pub kv_b: K,
    pub o: L,
}

/// GQA's weights as a backend holds them (`L`: a linear, `V`: a norm weight or bias vector);
/// `qk_norm` is the per-head RMSNorm of q and k (Qwen3, GLM-4.5), `qkv_bias` the biases added
/// after the q, k and v projections (GLM-4.5), `o_bias` the one after `o_proj`, `sinks` one
/// sink logit per query head (gpt-oss).
pub struct GqaParts<L, V> {
    pub q: L,
    pub k: L,
    pub v: L,
    pub o: L,
    pub qk_norm: Option<(V, V)>,
    pub qkv_bias: Option<[V; 3]>,
    pub o_bias: Option<V>,
    pub sinks: Option<V>,
}

/// A gated-DeltaNet layer's weights as a backend holds them (`L`: a linear, `V`: a vector);
/// see [`crate::model::tensors::AttentionTensors::GatedDeltaNet`]. `conv` is `[channels, kernel]`
/// row-major, `a_log` and `dt_bias` one value per value head, `norm` the output norm's gain.
pub struct DeltaNetParts<L, V> {
    pub qkv: L,
    pub z: L,
    pub b: L,
    pub a: L,
    pub conv: V,
    pub a_log: V,
    pub dt_bias: V,
    pub norm: V,
    pub out: L,
}

pub enum AttentionWeights<K: WeightKinds> {
    Mla(MlaParts<K::Linear, K::Vector, K::KvB>),
    Gqa(GqaParts<K::Linear, K::Vector>),
    GatedDeltaNet(DeltaNetParts<K::Linear, K::Vector>),
}

/// A MoE feed-forward block: the router, the routed experts' backend and the optional shared
/// expert, with its optional sigmoid gate (`shared_expert_gate` as a `[hidden]` vector: the
/// shared expert's output is scaled per token by σ(x · gate)).
pub struct MoeWeights<K: WeightKinds> {
    pub router: K::Router,
    pub experts: K::Experts,
    pub shared: Option<K::Mlp>,
    pub shared_gate: Option<K::Vector>,
}

pub enum FfnWeights<K: WeightKinds> {
    Dense(K::Mlp),
    Moe(MoeWeights<K>),
}

pub struct LayerWeights<K: WeightKinds> {
    pub input_norm: K::Vector,
    pub post_norm: K::Vector,
    pub attention: AttentionWeights<K>,
    pub ffn: FfnWeights<K>,
}

impl<K: WeightKinds> LayerWeights<K> {
    /// The MoE block of this layer, if it has one.
    pub fn moe(&self) -> Option<&MoeWeights<K>> {
        match &self.ffn {
            FfnWeights::Moe(m) => Some(m),
            FfnWeights::Dense(_) => None,
        }
    }
}

/// A whole model's weights as one backend holds them.
pub struct Weights<K: WeightKinds> {
    pub embed: K::Embedding,
    pub layers: Vec<LayerWeights<K>>,
    pub final_norm: K::Vector,
    pub lm_head: K::Linear,
}

/// The weights a builder makes.
pub type Built<B> = Weights<<B as WeightBuilder>::Kinds>;

fn mlp<B: WeightBuilder>(b: &mut B, t: &MlpTensors, class: LinearClass) -> Result<Mlp<B>> {
    let gate_up = b.gate_up(&t.gate, &t.up, class)?;
    let down = b.linear(&t.down, class)?;
    b.mlp(gate_up, down)
}

fn attention<B: WeightBuilder>(b: &mut B, t: &AttentionTensors) -> Result<AttentionWeights<B::Kinds>> {
    let a = LinearClass::Attention;
    Ok(match t {
        AttentionTensors::Mla { q, kv_a, kv_a_norm, kv_b, o } => {
            let (q_a, q_b) = match q {
                QueryTensors::Direct(q) => (None, b.linear(q, a)?),
                QueryTensors::LowRank { a: qa, norm, b: qb } => {
                    (Some((b.linear(qa, a)?, b.vector(norm)?)), b.linear(qb, a)?)
                }
            };
            AttentionWeights::Mla(MlaParts {
                q_a,
                q_b,
                kv_a: b.linear(kv_a, a)?,
                kv_a_norm: b.vector(kv_a_norm)?,
                kv_b: b.kv_b(kv_b)?,
                o: b.linear(o, a)?,
            })
        }
        AttentionTensors::Gqa { q, k, v, o, qk_norm, qkv_bias, o_bias, sinks } => AttentionWeights::Gqa(GqaParts {
            q: b.linear(q, a)?,
            k: b.linear(k, a)?,
            v: b.linear(v, a)?,
            o: b.linear(o, a)?,
            qk_norm: match qk_norm {
                Some((qn, kn)) => Some((b.vector(qn)?, b.vector(kn)?)),
                None => None,
            },
            qkv_bias: match qkv_bias {
                Some([qb, kb, vb]) => Some([b.vector(qb)?, b.vector(kb)?, b.vector(vb)?]),
                None => None,
            },
            o_bias: o_bias.as_ref().map(|t| b.vector(t)).transpose()?,
            sinks: sinks.as_ref().map(|t| b.vector(t)).transpose()?,
        }),
        AttentionTensors::GatedDeltaNet { qkv, z, b: beta, a: alpha, conv, a_log, dt_bias, norm, out } => {
            AttentionWeights::GatedDeltaNet(DeltaNetParts {
                qkv: b.linear(qkv, a)?,
                z: b.linear(z, a)?,
                b: b.linear(beta, a)?,
                a: b.linear(alpha, a)?,
                conv: b.vector(conv)?,
                a_log: b.vector(a_log)?,
                dt_bias: b.vector(dt_bias)?,
                norm: b.vector(norm)?,
                out: b.linear(out, a)?,
            })
        }
    })
}

fn layer<B: WeightBuilder>(b: &mut B, spec: &ModelSpec, l: usize, t: &LayerTensors) -> Result<LayerWeights<B::Kinds>> {
    let attention = attention(b, &t.attention)?;
    let ffn = match &t.ffn {
        FfnTensors::Dense(m) => FfnWeights::Dense(mlp(b, m, LinearClass::DenseMlp)?),
        FfnTensors::Moe { router, bias, experts, shared, shared_gate } => {
            let rule = spec.moe.as_ref().expect("MoE layer implies a MoE spec").routing;
            FfnWeights::Moe(MoeWeights {
                router: b.router(router, bias.as_ref(), &rule)?,
                experts: b.experts(l, experts)?,
                shared: match shared {
                    Some(s) => Some(mlp(b, s, LinearClass::SharedExpert)?),
                    None => None,
                },
                shared_gate: shared_gate.as_ref().map(|g| b.vector(g)).transpose()?,
            })
        }
    };
    Ok(LayerWeights { input_norm: b.vector(&t.input_norm)?, post_norm: b.vector(&t.post_norm)?, attention, ffn })
}

/// Builds every weight of `spec` with `b`, layer by layer.
pub fn build<B: WeightBuilder>(spec: &ModelSpec, b: &mut B) -> Result<Built<B>> {
    let t = model_tensors(spec);
    let embed = b.embedding(&t.embed)?;
    let mut layers = Vec::with_capacity(t.layers.len());
    for (l, lt) in t.layers.iter().enumerate() {
        layers.push(layer(b, spec, l, lt)?);
        b.layer_done(l);
    }
    let final_norm = b.vector(&t.final_norm)?;
    let lm_head = b.linear(&t.lm_head, LinearClass::LmHead)?;
    Ok(Weights { embed, layers, final_norm, lm_head })
}
