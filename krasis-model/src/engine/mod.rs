//! The engine: a loaded model and its forward pass over a session's KV cache. The layer math is
//! written once against [`AttentionLayer`], [`LinearOp`] and [`ExpertExecutor`].

pub mod attention;
pub mod experts;
pub mod ffn;
pub mod kv;

use std::path::Path;

use krasis_cpu::norm::rms_norm_rows;

use self::attention::{AttentionLayer, GqaAttention, MlaAttention, RopeBatch};
use self::experts::{ExpertExecutor, ReferenceExperts};
use self::ffn::{Ffn, Mlp, MoeBlock};
use self::kv::LayerKv;
use crate::error::{ModelError, Result};
use crate::files::ModelFiles;
use crate::linear::{DenseLinear, LinearOp};
use crate::rope::RotaryTables;
use crate::source::WeightSource;
use crate::spec::{AttentionSpec, FfnKind, ModelSpec, TopkMethod};
use crate::weights::WeightLoader;

struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    attention: Box<dyn AttentionLayer>,
    ffn: Ffn,
}

pub struct Model {
    pub spec: ModelSpec,
    embed: DenseLinear,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    lm_head: Box<dyn LinearOp>,
    experts: Box<dyn ExpertExecutor>,
    rope: RotaryTables,
    stats: ForwardStats,
}

/// Where forward time goes (for `krasis bench`): routed-expert execution vs everything.
#[derive(Default)]
pub struct ForwardStats {
    expert_ns: std::sync::atomic::AtomicU64,
    total_ns: std::sync::atomic::AtomicU64,
}

impl ForwardStats {
    /// (routed-expert seconds, total forward seconds) since the last reset.
    pub fn seconds(&self) -> (f64, f64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.expert_ns.load(Relaxed) as f64 * 1e-9, self.total_ns.load(Relaxed) as f64 * 1e-9)
    }

    pub fn reset(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.expert_ns.store(0, Relaxed);
        self.total_ns.store(0, Relaxed);
    }

    pub(crate) fn add_expert(&self, d: std::time::Duration) {
        self.expert_ns.fetch_add(d.as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One conversation's state: the KV cache of every layer.
pub struct Session {
    kv: Vec<LayerKv>,
}

impl Session {
    pub fn position(&self) -> usize {
        self.kv.first().map_or(0, |k| k.len())
    }

    pub fn kv_bytes(&self) -> usize {
        self.kv.iter().map(|k| k.bytes()).sum()
    }
}

/// Sees `(layer index, hidden states [t, hidden])` during a forward pass (tests, debugging).
pub type HiddenObserver<'a> = dyn FnMut(usize, &[f32]) + 'a;

/// Which positions get logits from a forward call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
}

fn boxed(l: DenseLinear) -> Box<dyn LinearOp> {
    Box::new(l)
}

/// Turns a loaded dense matrix into the op that runs it: the reference op itself, or a
/// quantised copy (`--cpu-dense-bits`). Called for attention projections, shared experts, dense
/// MLPs and the LM head; routers, `kv_b_proj` (used in f32 by absorbed MLA) and embeddings stay
/// in their source precision.
pub type DenseFactory<'a> = dyn Fn(DenseLinear, &str) -> Result<Box<dyn LinearOp>> + 'a;

/// The reference choice: every dense matrix as stored.
pub fn reference_dense(l: DenseLinear, _name: &str) -> Result<Box<dyn LinearOp>> {
    Ok(boxed(l))
}

impl Model {
    /// Load a hub-format directory for the CPU reference path (opens [`ModelFiles`] first).
    pub fn load(dir: &Path) -> Result<Model> {
        Self::from_files(&ModelFiles::open(dir)?)
    }

    /// The CPU reference path over opened model files.
    pub fn from_files(files: &ModelFiles) -> Result<Model> {
        Self::from_source(files.spec().clone(), files.weights(), &reference_dense, None)
    }

    /// Build a model from `source`. `dense` chooses how dense matrices run; `experts` runs the
    /// routed experts (`None`: the reference executor over the source weights).
    pub fn from_source(
        spec: ModelSpec,
        source: &dyn WeightSource,
        dense: &DenseFactory<'_>,
        experts: Option<Box<dyn ExpertExecutor>>,
    ) -> Result<Model> {
        let w = WeightLoader::new(source, &spec.source_quant);
        let h = spec.hidden_size;
        let eps = spec.rms_norm_eps;
        let embed = w.matrix("model.embed_tokens.weight", spec.vocab_size, h)?;
        let lin = |name: &str, rows: usize, cols: usize| -> Result<Box<dyn LinearOp>> {
            dense(w.matrix(name, rows, cols)?, name)
        };
        let mlp = |prefix: &str, inter: usize| -> Result<Mlp> {
            Ok(Mlp {
                gate: lin(&format!("{prefix}.gate_proj.weight"), inter, h)?,
                up: lin(&format!("{prefix}.up_proj.weight"), inter, h)?,
                down: lin(&format!("{prefix}.down_proj.weight"), h, inter)?,
            })
        };
        let expert_mlp = |prefix: &str, inter: usize| -> Result<Mlp> {
            Ok(Mlp {
                gate: boxed(w.matrix(&format!("{prefix}.gate_proj.weight"), inter, h)?),
                up: boxed(w.matrix(&format!("{prefix}.up_proj.weight"), inter, h)?),
                down: boxed(w.matrix(&format!("{prefix}.down_proj.weight"), h, inter)?),
            })
        };
        let reference_experts = experts.is_none();
        let mut layers = Vec::with_capacity(spec.num_layers);
        let mut expert_layers = Vec::with_capacity(spec.num_layers);
        for (l, kind) in spec.layers.iter().enumerate() {
            let p = crate::tensors::layer_prefix(l);
            let a = format!("{p}.self_attn");
            let attention: Box<dyn AttentionLayer> = match spec.attention {
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
                                lin(&format!("{a}.q_a_proj.weight"), r, h)?,
                                w.vector(&format!("{a}.q_a_layernorm.weight"), r)?,
                            )),
                            lin(&format!("{a}.q_b_proj.weight"), heads * qk, r)?,
                        ),
                        None => (None, lin(&format!("{a}.q_proj.weight"), heads * qk, h)?),
                    };
                    let kv_b_rows = heads * (qk_nope_head_dim + v_head_dim);
                    let kv_b = w.matrix(&format!("{a}.kv_b_proj.weight"), kv_b_rows, kv_lora_rank)?;
                    let mut kv_b_f32 = vec![0f32; kv_b_rows * kv_lora_rank];
                    for (r, row) in kv_b_f32.chunks_exact_mut(kv_lora_rank).enumerate() {
                        kv_b.row_into(r, row);
                    }
                    Box::new(MlaAttention {
                        heads,
                        nope: qk_nope_head_dim,
                        rope: qk_rope_head_dim,
                        v_dim: v_head_dim,
                        latent: kv_lora_rank,
                        eps,
                        scale: spec.softmax_scale,
                        q_a,
                        q_b,
                        kv_a: lin(&format!("{a}.kv_a_proj_with_mqa.weight"), kv_lora_rank + qk_rope_head_dim, h)?,
                        kv_a_norm: w.vector(&format!("{a}.kv_a_layernorm.weight"), kv_lora_rank)?,
                        kv_b: kv_b_f32,
                        o_proj: lin(&format!("{a}.o_proj.weight"), h, heads * v_head_dim)?,
                    })
                }
                AttentionSpec::Gqa { heads, kv_heads, head_dim, qk_norm } => Box::new(GqaAttention {
                    heads,
                    kv_heads,
                    head_dim,
                    eps,
                    scale: spec.softmax_scale,
                    q_proj: lin(&format!("{a}.q_proj.weight"), heads * head_dim, h)?,
                    k_proj: lin(&format!("{a}.k_proj.weight"), kv_heads * head_dim, h)?,
                    v_proj: lin(&format!("{a}.v_proj.weight"), kv_heads * head_dim, h)?,
                    o_proj: lin(&format!("{a}.o_proj.weight"), h, heads * head_dim)?,
                    qk_norm: if qk_norm {
                        Some((
                            w.vector(&format!("{a}.q_norm.weight"), head_dim)?,
                            w.vector(&format!("{a}.k_norm.weight"), head_dim)?,
                        ))
                    } else {
                        None
                    },
                }),
            };
            let m = format!("{p}.mlp");
            let (ffn, experts) = match kind {
                FfnKind::Dense { intermediate_size } => (Ffn::Dense(mlp(&m, *intermediate_size)?), Vec::new()),
                FfnKind::Moe => {
                    let moe = spec.moe.as_ref().expect("MoE layer implies a MoE spec");
                    let e = moe.n_routed_experts;
                    let bias = match moe.routing.topk {
                        TopkMethod::NoauxTc { .. } => Some(w.vector(&format!("{m}.gate.e_score_correction_bias"), e)?),
                        _ => None,
                    };
                    let experts = if reference_experts {
                        (0..e)
                            .map(|x| expert_mlp(&format!("{m}.experts.{x}"), moe.moe_intermediate_size))
                            .collect::<Result<Vec<_>>>()?
                    } else {
                        Vec::new()
                    };
                    let shared = if moe.shared_intermediate_size > 0 {
                        Some(mlp(&format!("{m}.shared_experts"), moe.shared_intermediate_size)?)
                    } else {
                        None
                    };
                    let block = MoeBlock {
                        layer: l,
                        router: boxed(w.matrix(&format!("{m}.gate.weight"), e, h)?),
                        bias,
                        rule: moe.routing,
                        shared,
                    };
                    (Ffn::Moe(block), experts)
                }
            };
            layers.push(Layer {
                input_norm: w.vector(&format!("{p}.input_layernorm.weight"), h)?,
                post_norm: w.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
                attention,
                ffn,
            });
            expert_layers.push(experts);
        }
        let final_norm = w.vector("model.norm.weight", h)?;
        let lm_head: Box<dyn LinearOp> = if spec.tie_word_embeddings {
            let tied = w.matrix("model.embed_tokens.weight", spec.vocab_size, h)?;
            dense(tied, "lm_head.weight (tied to model.embed_tokens.weight)")?
        } else {
            lin("lm_head.weight", spec.vocab_size, h)?
        };
        Ok(Model {
            rope: RotaryTables::new(&spec.rope),
            experts: experts.unwrap_or_else(|| Box::new(ReferenceExperts { hidden: h, layers: expert_layers })),
            stats: ForwardStats::default(),
            spec,
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// Weight bytes a decode step reads outside the routed experts: attention, dense MLPs,
    /// shared experts, routers, one embedding row and the LM head.
    pub fn dense_bytes_per_token(&self) -> u64 {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attention.weight_bytes()
                    + match &l.ffn {
                        Ffn::Dense(m) => m.weight_bytes(),
                        Ffn::Moe(b) => b.router.weight_bytes() + b.shared.as_ref().map_or(0, |s| s.weight_bytes()),
                    }
            })
            .sum();
        let embed_row = self.embed.weight_bytes() / self.spec.vocab_size.max(1);
        (layers + self.lm_head.weight_bytes() + embed_row) as u64
    }

    pub fn stats(&self) -> &ForwardStats {
        &self.stats
    }

    pub fn expert_executor(&self) -> &dyn ExpertExecutor {
        self.experts.as_ref()
    }

    pub fn new_session(&self) -> Session {
        Session { kv: self.layers.iter().map(|l| l.attention.new_cache()).collect() }
    }

    /// Check token ids against the vocabulary.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        for (pos, &id) in tokens.iter().enumerate() {
            if id as usize >= self.spec.vocab_size {
                return Err(ModelError::TokenOutOfRange { id: id as u64, pos, vocab: self.spec.vocab_size });
            }
        }
        Ok(())
    }

    /// Run `tokens` through the model after what `session` already holds, extending its cache.
    /// Returns logits `[positions, vocab]` for the requested positions. `observe(i, h)` sees the
    /// hidden states `[t, hidden]` entering layer `i` (i = 0 is the embedding output) and, at
    /// `i = num_layers`, the final-normed output.
    pub fn forward(
        &self,
        session: &mut Session,
        tokens: &[u32],
        which: Logits,
        mut observe: Option<&mut HiddenObserver<'_>>,
    ) -> Result<Vec<f32>> {
        let started = std::time::Instant::now();
        self.check_tokens(tokens)?;
        let t = tokens.len();
        if t == 0 {
            return Err(ModelError::Invalid("forward called with no tokens".into()));
        }
        let h = self.spec.hidden_size;
        let eps = self.spec.rms_norm_eps;
        let mut x = vec![0f32; t * h];
        for (i, &id) in tokens.iter().enumerate() {
            self.embed.row_into(id as usize, &mut x[i * h..(i + 1) * h]);
        }
        let (cos, sin) = self.rope.table(session.position(), t);
        let rope = RopeBatch { cos, sin, half: self.rope.half_dim(), pairing: self.rope.pairing };
        let mut xn = vec![0f32; t * h];
        let mut y = vec![0f32; t * h];
        for (l, layer) in self.layers.iter().enumerate() {
            if let Some(f) = observe.as_mut() {
                f(l, &x);
            }
            xn.copy_from_slice(&x);
            rms_norm_rows(&mut xn, &layer.input_norm, eps);
            layer.attention.forward(&xn, t, &mut session.kv[l], &rope, &mut y);
            for (a, b) in x.iter_mut().zip(&y) {
                *a += b;
            }
            xn.copy_from_slice(&x);
            rms_norm_rows(&mut xn, &layer.post_norm, eps);
            match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(&xn, t, &mut y),
                Ffn::Moe(block) => block.forward(self.experts.as_ref(), &self.stats, &xn, t, h, &mut y),
            }
            for (a, b) in x.iter_mut().zip(&y) {
                *a += b;
            }
        }
        rms_norm_rows(&mut x, &self.final_norm, eps);
        if let Some(f) = observe.as_mut() {
            f(self.layers.len(), &x);
        }
        let rows: &[f32] = match which {
            Logits::All => &x,
            Logits::Last => &x[(t - 1) * h..],
        };
        let m = rows.len() / h;
        let v = self.spec.vocab_size;
        let mut logits = vec![0f32; m * v];
        self.lm_head.forward(rows, m, &mut logits);
        self.stats.total_ns.fetch_add(started.elapsed().as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(logits)
    }
}
