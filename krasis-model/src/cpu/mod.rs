//! The CPU engine: a loaded model and its forward pass over a session's KV cache. The weights come
//! from the one build walk ([`crate::model::build`]) through a CPU [`WeightBuilder`] as a
//! `Weights<CpuKinds>` tree; the one forward walk ([`crate::model::walk`]) runs over it with the CPU's
//! [`LayerOps`] (`CpuStep`): attention through [`MlaAttention`] / [`GqaAttention`], dense
//! matrices through [`LinearOp`], routed experts through [`LayerExperts`].

pub mod attention;
pub mod deltanet;
pub mod dense_cache;
pub mod experts;
pub mod ffn;
pub mod kv;
pub mod load;
pub mod memory;
pub mod packed_ops;
#[cfg(test)]
mod prefill_tests;
pub mod quantized;
pub mod underflow;

use std::path::Path;
use std::sync::Arc;

use krasis_cpu::norm::{add_assign_par, rms_norm_rows_into_par};

use krasis_cpu::pool::WorkerPool;
use krasis_quant::cpu_layout::PackedLayout;
use krasis_quant::Bits;

use self::attention::{new_layer_cache, GqaAttention, KvB, MlaAttention, RopeBatch, SeqKv};
use self::deltanet::{DeltaNetOp, DeltaState, SeqDelta};
use self::experts::{ExecutorLayer, ExpertExecutor, LayerExperts, ReferenceExperts};
use self::ffn::{CpuRouter, Mlp};
use self::kv::LayerKv;
use crate::cpu::dense_cache::{kv_b_entry_name, w13_entry_name};
use crate::cpu::packed_ops::{kv_b_layouts, w13_layout, PackedBytes, PackedKvB, PooledMlp};
use crate::cpu::quantized::QuantLinear;
use crate::error::{ModelError, Result};
use crate::model::build::{
    build, DeltaNetParts, GqaParts, LinearClass, MlaParts, MoeWeights, WeightBuilder, WeightKinds, Weights,
};
use crate::model::linear::{DenseLinear, LinearOp};
use crate::model::rope::RotaryTables;
use crate::model::tensors::{MlpTensors, TensorRole, TensorSpec};
use crate::model::walk::{for_each_dense_part, LayerOps, NextMoe, NormAt, Part};
use crate::model::weights::WeightLoader;
use crate::runtime::ForwardBreakdown;
use crate::source::files::ModelFiles;
use crate::source::WeightSource;
use crate::spec::{AttentionSpec, MlaDims, ModelSpec, RoutingRule};

/// The types the CPU engine holds its weights in.
pub struct CpuKinds;

impl WeightKinds for CpuKinds {
    type Linear = Box<dyn LinearOp>;
    type Mlp = Mlp;
    type Vector = Vec<f32>;
    type Embedding = DenseLinear;
    type KvB = KvB;
    type Router = CpuRouter;
    type Experts = Box<dyn LayerExperts>;
}

pub struct Model {
    pub spec: ModelSpec,
    weights: Weights<CpuKinds>,
    rope: RotaryTables,
    stats: ForwardStats,
    /// Expert activation counts, while recording ([`Model::record_heatmap`]).
    heat: Option<crate::placement::heatmap::HeatCounter>,
    /// The worker pool the dense ops of every forward call run on ([`Model::set_pool`]); `None`:
    /// rayon.
    pool: Option<Arc<WorkerPool>>,
}

/// Nanoseconds spent so far in the CPU forward's smaller parts (for benches): norms with their
/// copies, residual adds, MoE routers, routing, dense-layer MLPs.
pub fn other_phase_ns() -> [u64; 5] {
    OTHER_NS.get()
}

pub(crate) static OTHER_NS: krasis_cpu::phase_ns::PhaseNs<5> = krasis_cpu::phase_ns::PhaseNs::new();

/// Where forward time goes (for benchmarks): routed-expert execution, attention, shared
/// experts, the LM head and the whole pass, as [`ForwardBreakdown`]s.
#[derive(Default)]
pub struct ForwardStats {
    expert_ns: std::sync::atomic::AtomicU64,
    total_ns: std::sync::atomic::AtomicU64,
    attention_ns: std::sync::atomic::AtomicU64,
    deltanet_ns: std::sync::atomic::AtomicU64,
    shared_ns: std::sync::atomic::AtomicU64,
    head_ns: std::sync::atomic::AtomicU64,
    shared_inside_bytes: std::sync::atomic::AtomicU64,
}

impl ForwardStats {
    /// (routed-expert seconds, total forward seconds) since the last reset.
    pub fn seconds(&self) -> (f64, f64) {
        let b = self.breakdown();
        (b.experts, b.total)
    }

    /// Seconds per part since the last reset.
    pub fn breakdown(&self) -> ForwardBreakdown {
        use std::sync::atomic::Ordering::Relaxed;
        let s = |a: &std::sync::atomic::AtomicU64| a.load(Relaxed) as f64 * 1e-9;
        ForwardBreakdown {
            experts: s(&self.expert_ns),
            attention: s(&self.attention_ns),
            deltanet: s(&self.deltanet_ns),
            shared: s(&self.shared_ns),
            lm_head: s(&self.head_ns),
            total: s(&self.total_ns),
            shared_in_experts_bytes: self.shared_inside_bytes.load(Relaxed),
        }
    }

    pub fn reset(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        for a in [
            &self.expert_ns,
            &self.total_ns,
            &self.attention_ns,
            &self.deltanet_ns,
            &self.shared_ns,
            &self.head_ns,
            &self.shared_inside_bytes,
        ] {
            a.store(0, Relaxed);
        }
    }

    pub(crate) fn add_expert(&self, d: std::time::Duration) {
        self.expert_ns.fetch_add(d.as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn add_shared(&self, d: std::time::Duration) {
        self.shared_ns.fetch_add(d.as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn add_shared_inside(&self, bytes: usize) {
        self.shared_inside_bytes.fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One conversation's state: the KV cache of every attention layer, the recurrent state of
/// every DeltaNet layer, and how many tokens it holds.
pub struct Session {
    kv: Vec<LayerKv>,
    delta: Vec<DeltaState>,
    pos: usize,
    /// DeltaNet states kept at earlier positions for the prefix cache (oldest first, at most
    /// [`crate::runtime::DELTA_SNAPSHOTS`]); empty for attention-only models.
    snapshots: Vec<(usize, Vec<DeltaState>)>,
}

impl Session {
    pub fn position(&self) -> usize {
        self.pos
    }

    fn has_recurrent_state(&self) -> bool {
        self.delta.iter().any(|d| d.bytes() > 0)
    }

    /// Keeps the DeltaNet states at the current position (the oldest snapshot goes past
    /// [`crate::runtime::DELTA_SNAPSHOTS`]); nothing for attention-only models.
    pub fn snapshot(&mut self) {
        if self.has_recurrent_state() {
            let delta = &self.delta;
            let kept = crate::runtime::keep_snapshot(&mut self.snapshots, self.pos, || Ok(delta.clone()));
            debug_assert!(kept.is_ok(), "a clone cannot fail");
        }
    }

    /// This session as a saved prefix: its KV rows, and its DeltaNet states at its snapshots and
    /// its end.
    pub fn into_prefix(mut self) -> CpuPrefix {
        self.snapshot();
        self.kv.iter_mut().for_each(LayerKv::shrink);
        let bytes = self.kv_bytes() + self.snapshots.iter().flat_map(|(_, d)| d).map(|d| d.bytes()).sum::<usize>();
        let layers = self.delta.len();
        CpuPrefix { kv: self.kv, points: self.snapshots, len: self.pos, bytes, layers }
    }

    /// A session holding the first `n` tokens of `saved` (`n` must be
    /// [`SavedPrefix::resumable`](crate::runtime::SavedPrefix::resumable)).
    pub fn from_prefix(saved: &CpuPrefix, n: usize) -> Result<Session> {
        use crate::runtime::SavedPrefix;
        if n > saved.len || saved.resumable(n) != n {
            return Err(ModelError::Invalid(format!(
                "a saved prefix of {} tokens holds no state at {n} tokens",
                saved.len
            )));
        }
        let delta = match saved.points.iter().find(|(p, _)| *p == n) {
            Some((_, d)) => d.clone(),
            None => vec![DeltaState::default(); saved.layers], // attention-only: no state
        };
        Ok(Session {
            kv: saved.kv.iter().map(|k| k.prefix(n)).collect(),
            delta,
            pos: n,
            snapshots: saved.points.iter().filter(|(p, _)| *p == n).cloned().collect(),
        })
    }

    /// Bytes of the KV caches and the DeltaNet states.
    pub fn kv_bytes(&self) -> usize {
        self.kv.iter().map(|k| k.bytes()).sum::<usize>() + self.delta.iter().map(|d| d.bytes()).sum::<usize>()
    }
}

/// A CPU session's state kept by the prefix cache ([`Session::into_prefix`]).
pub struct CpuPrefix {
    kv: Vec<LayerKv>,
    /// DeltaNet states by position (ascending; the last at `len`); empty for attention-only models.
    points: Vec<(usize, Vec<DeltaState>)>,
    len: usize,
    bytes: usize,
    layers: usize,
}

impl crate::runtime::SavedPrefix for CpuPrefix {
    fn len(&self) -> usize {
        self.len
    }

    fn bytes(&self) -> usize {
        self.bytes
    }

    fn resumable(&self, upto: usize) -> usize {
        crate::runtime::resumable_at(self.len, &self.points, upto)
    }
}

/// One sequence of [`Model::forward_batch`]: its session, the tokens to run after what the
/// session holds, and which positions get logits.
pub struct BatchSeq<'a> {
    pub session: &'a mut Session,
    pub tokens: &'a [u32],
    pub which: Logits,
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

/// Dense weights already in their run-time form, by name (the dense-weight cache): `Some` skips
/// the source tensor altogether, `None` loads it through the [`DenseFactory`] (a linear) or
/// keeps it in f32 (`kv_b`) or as two linears (gate and up).
pub trait PrebuiltDense {
    /// The linear named [`linear_name`].
    fn linear(&self, name: &str) -> Option<Result<Box<dyn LinearOp>>>;
    /// The packed bytes of a fused entry (`crate::cpu::dense_cache::w13_entry_name`,
    /// `crate::cpu::dense_cache::kv_b_entry_name`).
    fn packed(&self, name: &str) -> Option<PackedBytes>;
    /// The width of the packed linears.
    fn bits(&self) -> Bits;
    /// The group size asked for when packing (what fused entries' layouts derive from).
    fn group(&self) -> usize;
    fn pool(&self) -> &Arc<WorkerPool>;
}

/// `KRASIS_MLP=linears` runs a cached fused gate+up as two linears (one dispatch for both,
/// then down) instead of one pooled expert (read once; for measuring what the one-dispatch
/// runner saves).
fn mlp_linears_env() -> bool {
    static L: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *L.get_or_init(|| krasis_core::knobs::knobs().mlp_linears)
}

/// `KRASIS_KV_B=f32` keeps MLA's `kv_b` in f32 even when the dense-weight cache has it packed
/// (read once; for measuring what the INT8 form saves).
fn kv_b_f32_env() -> bool {
    static F: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *F.get_or_init(|| krasis_core::knobs::knobs().kv_b_f32)
}

/// The name a dense linear goes by in logs, errors and the dense-weight cache: its tensor's, or
/// for an LM head tied to the embedding `lm_head.weight (tied to <embedding>)`.
pub fn linear_name(t: &TensorSpec, class: LinearClass) -> String {
    match (class, t.role) {
        (LinearClass::LmHead, TensorRole::LmHead) if t.name != "lm_head.weight" => {
            format!("lm_head.weight (tied to {})", t.name)
        }
        _ => t.name.clone(),
    }
}

/// Builds the CPU engine's weights: dense matrices through the [`DenseFactory`], routers and MLA's
/// `kv_b_proj` in their source precision, routed experts from a model-wide executor (quantised
/// pool) or, without one, the reference experts over the source weights.
struct CpuBuilder<'a> {
    w: WeightLoader<'a>,
    dense: &'a DenseFactory<'a>,
    prebuilt: Option<&'a dyn PrebuiltDense>,
    executor: Option<Arc<dyn ExpertExecutor>>,
    hidden: usize,
    mla: Option<MlaDims>,
    activation: crate::spec::ExpertActivation,
}

/// A gated MLP's gate and up as the CPU builder got them.
pub enum CpuGateUp {
    Separate(Box<dyn LinearOp>, Box<dyn LinearOp>),
    /// One fused w13 from the dense-weight cache.
    Fused {
        w13: PackedBytes,
        layout: PackedLayout,
        pool: Arc<WorkerPool>,
    },
}

impl WeightBuilder for CpuBuilder<'_> {
    type Kinds = CpuKinds;
    type GateUp = CpuGateUp;

    fn embedding(&mut self, t: &TensorSpec) -> Result<DenseLinear> {
        self.w.matrix_of(t)
    }

    fn linear(&mut self, t: &TensorSpec, class: LinearClass) -> Result<Box<dyn LinearOp>> {
        let name = linear_name(t, class);
        if let Some(op) = self.prebuilt.and_then(|p| p.linear(&name)) {
            return op;
        }
        (self.dense)(self.w.matrix_of(t)?, &name)
    }

    fn gate_up(&mut self, gate: &TensorSpec, up: &TensorSpec, class: LinearClass) -> Result<Self::GateUp> {
        if let Some(p) = self.prebuilt {
            if let Some(w13) = p.packed(&w13_entry_name(gate, up)) {
                let (name, bits) = (w13_entry_name(gate, up), p.bits());
                let layout = w13_layout(gate.shape[0], gate.shape[1], bits, p.group(), &name)?;
                if w13.as_slice().len() != layout.bytes() {
                    return Err(ModelError::Invalid(format!("dense-weight cache: `{name}` does not fit its layout")));
                }
                return Ok(CpuGateUp::Fused { w13, layout, pool: p.pool().clone() });
            }
        }
        Ok(CpuGateUp::Separate(self.linear(gate, class)?, self.linear(up, class)?))
    }

    fn mlp(&mut self, gate_up: CpuGateUp, down: Box<dyn LinearOp>) -> Result<Mlp> {
        cpu_mlp(gate_up, down)
    }

    fn vector(&mut self, t: &TensorSpec) -> Result<Vec<f32>> {
        self.w.vector_of(t)
    }

    fn kv_b(&mut self, t: &TensorSpec) -> Result<KvB> {
        let packed = |p: &dyn PrebuiltDense| {
            let dims = self.mla?;
            let layouts = kv_b_layouts(&dims, p.group())?;
            let (uk, uv) = (p.packed(&kv_b_entry_name(t, true))?, p.packed(&kv_b_entry_name(t, false))?);
            let fits = uk.as_slice().len() == dims.heads * layouts.uk.bytes()
                && uv.as_slice().len() == dims.heads * layouts.uv.bytes();
            fits.then(|| PackedKvB::new(uk, uv, layouts, dims, p.pool().clone()))
        };
        if let Some(k) = self.prebuilt.filter(|_| !kv_b_f32_env()).and_then(packed) {
            return Ok(KvB::Packed(Box::new(k)));
        }
        let m = self.w.matrix_of(t)?;
        let cols = m.in_dim();
        let mut f = vec![0f32; m.out_dim() * cols];
        for (r, row) in f.chunks_exact_mut(cols).enumerate() {
            m.row_into(r, row);
        }
        Ok(KvB::F32(f))
    }

    fn router(&mut self, weight: &TensorSpec, bias: Option<&TensorSpec>, rule: &RoutingRule) -> Result<CpuRouter> {
        // Read whole at every token: held in memory of its own, not through the mapping, whose
        // page-cache folio around it (up to 2 MiB) would otherwise become resident.
        Ok(CpuRouter {
            gate: boxed(self.w.matrix_of(weight)?.resident()),
            bias: bias.map(|b| self.w.vector_of(b)).transpose()?,
            rule: *rule,
        })
    }

    fn experts(&mut self, layer: usize, experts: &[MlpTensors]) -> Result<Box<dyn LayerExperts>> {
        if let Some(executor) = &self.executor {
            return Ok(Box::new(ExecutorLayer { executor: executor.clone(), layer }));
        }
        Ok(Box::new(ReferenceExperts::load(&self.w, self.hidden, experts)?.with_activation(self.activation)))
    }
}

fn cpu_mlp(gate_up: CpuGateUp, down: Box<dyn LinearOp>) -> Result<Mlp> {
    match gate_up {
        CpuGateUp::Separate(gate, up) => Ok(Mlp::Separate { gate, up, down }),
        // The one-expert runner keeps its tasks on one NUMA node; with several, the halves run
        // as two linears over the whole pool (and with `KRASIS_MLP=linears`, for A/B runs).
        CpuGateUp::Fused { w13, layout, pool } if pool.nodes() > 1 || mlp_linears_env() => {
            let (gate, up) = split_w13(w13.as_slice(), &layout, &pool);
            Ok(Mlp::Separate { gate, up, down })
        }
        CpuGateUp::Fused { w13, layout, pool } => PooledMlp::new(w13, layout, down, pool)
            .map(|p| Mlp::Pooled(Box::new(p)))
            .ok_or_else(|| ModelError::Invalid("a fused gate+up whose down projection is not packed to match".into())),
    }
}

/// A fused w13's gate and up row blocks as two packed linears.
pub(crate) fn split_w13(
    w13: &[u8],
    l13: &PackedLayout,
    pool: &Arc<WorkerPool>,
) -> (Box<dyn LinearOp>, Box<dyn LinearOp>) {
    let one = PackedLayout::new(l13.rows / 2, l13.k, l13.gs, l13.bits).expect("half of a valid w13 layout");
    let bb = one.block_bytes();
    let half = |which: usize| -> Box<dyn LinearOp> {
        let bytes: Vec<u8> = w13.chunks_exact(2 * bb).flat_map(|p| p[which * bb..(which + 1) * bb].to_vec()).collect();
        Box::new(QuantLinear::from_packed(PackedBytes::Owned(bytes), one, pool.clone()))
    };
    (half(0), half(1))
}

impl Model {
    /// Load a hub-format directory for the CPU reference path.
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
        experts: Option<Arc<dyn ExpertExecutor>>,
    ) -> Result<Model> {
        Self::from_source_with(spec, source, dense, None, experts)
    }

    /// [`Model::from_source`], taking the dense weights `prebuilt` has (the dense-weight cache)
    /// from it without reading their source tensors.
    pub fn from_source_with(
        spec: ModelSpec,
        source: &dyn WeightSource,
        dense: &DenseFactory<'_>,
        prebuilt: Option<&dyn PrebuiltDense>,
        experts: Option<Arc<dyn ExpertExecutor>>,
    ) -> Result<Model> {
        let quant = spec.source_quant.clone(); // the built tree's type borrows it, not `spec`
        let mut builder = CpuBuilder {
            w: WeightLoader::new(source, &quant),
            dense,
            prebuilt,
            executor: experts,
            hidden: spec.hidden_size,
            mla: spec.attention.mla_dims(),
            activation: spec.expert_activation,
        };
        let weights = build(&spec, &mut builder)?;
        Ok(Model {
            rope: RotaryTables::new(&spec.rope),
            stats: ForwardStats::default(),
            heat: None,
            pool: None,
            spec,
            weights,
        })
    }

    /// Weight bytes a decode step reads outside the routed experts: attention, dense MLPs,
    /// shared experts, routers, one embedding row and the LM head.
    pub fn dense_bytes_per_token(&self) -> u64 {
        let mut layers = 0;
        for l in &self.weights.layers {
            for_each_dense_part(l, &mut |p| {
                layers += match p {
                    Part::Linear(l) => l.weight_bytes(),
                    Part::KvB(k) => k.weight_bytes(),
                    Part::Mlp(m) => m.weight_bytes(),
                    Part::Router(r) => r.gate.weight_bytes(),
                }
            });
        }
        let w = &self.weights;
        let embed_row = w.embed.weight_bytes() / self.spec.vocab_size.max(1);
        (layers + w.lm_head.weight_bytes() + embed_row) as u64
    }

    /// Where forward time went since the last reset.
    pub fn forward_stats(&self) -> &ForwardStats {
        &self.stats
    }

    /// Runs the dense ops of every forward call (norms, attention, the reference linears) on
    /// `pool` ([`krasis_cpu::par::with_pool`]): the engine's own pool, not a process-wide one, so
    /// two engines in one process each use theirs.
    pub fn set_pool(&mut self, pool: Arc<WorkerPool>) {
        self.pool = Some(pool);
    }

    /// Counts every MoE layer's routes from now on ([`Model::heatmap`]).
    pub fn record_heatmap(&mut self) {
        self.heat =
            Some(crate::placement::heatmap::HeatCounter::new(self.weights.layers.len(), self.spec.routed_experts()));
    }

    /// The counts so far, `[layers × experts]`, while recording.
    pub fn heatmap(&self) -> Option<Vec<u64>> {
        self.heat.as_ref().map(|h| h.snapshot())
    }

    /// How the routed experts run (the first MoE layer's backend), for logs.
    pub fn experts_description(&self) -> String {
        self.weights
            .layers
            .iter()
            .find_map(|l| l.moe().map(|m| m.experts.describe()))
            .unwrap_or_else(|| "none (no MoE layers)".into())
    }

    pub fn new_session(&self) -> Session {
        let delta = |l| match self.spec.delta_net {
            Some(d) if self.spec.is_delta_net(l) => DeltaState::new(&d),
            _ => DeltaState::default(),
        };
        Session {
            kv: (0..self.spec.num_layers).map(|_| new_layer_cache(&self.spec.attention)).collect(),
            delta: (0..self.spec.num_layers).map(delta).collect(),
            pos: 0,
            snapshots: Vec::new(),
        }
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
        observe: Option<&mut HiddenObserver<'_>>,
    ) -> Result<Vec<f32>> {
        let mut batch = [BatchSeq { session, tokens, which }];
        let mut out = self.forward_seqs(&mut batch, observe)?;
        Ok(out.pop().expect("one sequence in, one out"))
    }

    /// [`Model::forward`] for several sequences at once, each after its own session: one pass
    /// whose rows are every sequence's tokens, so each dense weight and each routed expert is read
    /// once for the whole batch (the experts see all sequences' tokens grouped per expert);
    /// attention runs per sequence over its own cache. Returns each sequence's logits, in order.
    /// A row's result does not depend on the other rows of the batch.
    pub fn forward_batch(&self, seqs: &mut [BatchSeq<'_>]) -> Result<Vec<Vec<f32>>> {
        self.forward_seqs(seqs, None)
    }

    /// The one entry of every forward call: `forward_pass` on the model's pool.
    fn forward_seqs(
        &self,
        seqs: &mut [BatchSeq<'_>],
        observe: Option<&mut HiddenObserver<'_>>,
    ) -> Result<Vec<Vec<f32>>> {
        match &self.pool {
            Some(pool) => krasis_cpu::par::with_pool(pool, || self.forward_pass(seqs, observe)),
            None => self.forward_pass(seqs, observe),
        }
    }

    fn forward_pass(
        &self,
        seqs: &mut [BatchSeq<'_>],
        mut observe: Option<&mut HiddenObserver<'_>>,
    ) -> Result<Vec<Vec<f32>>> {
        let started = std::time::Instant::now();
        for s in seqs.iter() {
            self.check_tokens(s.tokens)?;
            if s.tokens.is_empty() {
                return Err(ModelError::Invalid("forward called with no tokens".into()));
            }
        }
        let t: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        if t == 0 {
            return Err(ModelError::Invalid("forward called with no sequences".into()));
        }
        let h = self.spec.hidden_size;
        let mut x = vec![0f32; t * h];
        // Read from the file, not the mapping: the rows read leave no pages resident.
        let mut row = Vec::new();
        for (i, &id) in seqs.iter().flat_map(|s| s.tokens).enumerate() {
            self.weights.embed.gather_row(id as usize, &mut x[i * h..(i + 1) * h], &mut row);
        }
        // Each row rotates by its own position in its own sequence.
        let (mut cos, mut sin) = (Vec::with_capacity(t * self.rope.half_dim()), Vec::new());
        for s in seqs.iter() {
            let (c, si) = self.rope.table(s.session.position(), s.tokens.len());
            cos.extend_from_slice(&c);
            sin.extend_from_slice(&si);
        }
        let rope = RopeBatch { cos, sin, half: self.rope.half_dim(), pairing: self.rope.pairing };
        let mut step = CpuStep {
            model: self,
            seqs: &mut *seqs,
            t,
            rope,
            xn: vec![0f32; t * h],
            y: vec![0f32; t * h],
            x,
            observe: observe.take(),
        };
        crate::model::walk::forward(&self.weights, &mut step, 0..self.weights.layers.len())?;
        let x = step.xn;
        for s in seqs.iter_mut() {
            s.session.pos += s.tokens.len();
        }
        // The rows that get logits, gathered so the LM head reads its weights once.
        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(seqs.len());
        let mut off = 0;
        for s in seqs.iter() {
            let n = s.tokens.len();
            let keep = match s.which {
                Logits::All => off..off + n,
                Logits::Last => off + n - 1..off + n,
            };
            rows.extend_from_slice(&x[keep.start * h..keep.end * h]);
            counts.push(keep.len());
            off += n;
        }
        let m = rows.len() / h;
        let v = self.spec.vocab_size;
        let mut logits = vec![0f32; m * v];
        let head_started = std::time::Instant::now();
        self.weights.lm_head.forward(&rows, m, &mut logits);
        self.stats.head_ns.fetch_add(head_started.elapsed().as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
        let mut out = Vec::with_capacity(seqs.len());
        let mut at = 0;
        for n in counts {
            out.push(logits[at * v..(at + n) * v].to_vec());
            at += n;
        }
        self.stats.total_ns.fetch_add(started.elapsed().as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
        krasis_cpu::prefill_bf16::trim_after_forward(t);
        attention::trim_scratch(krasis_cpu::prefill_bf16::KEEP_BYTES);
        Ok(out)
    }
}

/// The CPU engine's step: the batch's rows through the forward walk ([`LayerOps`]). `x` is the
/// residual stream, `xn` the normed input of the next block, `y` a block's output, all
/// `[t, hidden]`.
struct CpuStep<'m, 's, 'b, 'o, 'p> {
    model: &'m Model,
    seqs: &'s mut [BatchSeq<'b>],
    t: usize,
    rope: RopeBatch,
    x: Vec<f32>,
    xn: Vec<f32>,
    y: Vec<f32>,
    observe: Option<&'o mut HiddenObserver<'p>>,
}

/// Each sequence's rows and its KV cache of layer `l`.
fn layer_kv<'a>(seqs: &'a mut [BatchSeq<'_>], l: usize) -> Vec<SeqKv<'a>> {
    seqs.iter_mut().map(|s| SeqKv { rows: s.tokens.len(), kv: &mut s.session.kv[l] }).collect()
}

impl Model {
    fn attention_done(&self, started: std::time::Instant) {
        let ns = started.elapsed().as_nanos() as u64;
        self.stats.attention_ns.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
    }
}

impl LayerOps<CpuKinds> for CpuStep<'_, '_, '_, '_, '_> {
    fn residual_norm(&mut self, w: &Vec<f32>, add: bool, at: NormAt) -> Result<()> {
        let eps = self.model.spec.rms_norm_eps;
        if add {
            let mut clock = std::time::Instant::now();
            add_assign_par(&mut self.x, &self.y);
            OTHER_NS.lap(&mut clock, 1);
        }
        // The observer sees the hidden state entering each layer, and the final normed output.
        if let (NormAt::Input(l), Some(f)) = (at, self.observe.as_mut()) {
            f(l, &self.x);
        }
        let mut clock = std::time::Instant::now();
        rms_norm_rows_into_par(&self.x, &mut self.xn, w, eps);
        OTHER_NS.lap(&mut clock, 0);
        if let (NormAt::Final, Some(f)) = (at, self.observe.as_mut()) {
            f(self.model.spec.num_layers, &self.xn);
        }
        Ok(())
    }

    fn mla(&mut self, l: usize, w: &MlaParts<Box<dyn LinearOp>, Vec<f32>, KvB>) -> Result<()> {
        let spec = &self.model.spec;
        let dims = spec.attention.mla_dims().expect("the walk gives MLA weights to an MLA model");
        let a = MlaAttention::new(dims, spec.rms_norm_eps, spec.softmax_scale, w);
        let started = std::time::Instant::now();
        a.forward(&self.xn, &mut layer_kv(self.seqs, l), &self.rope, &mut self.y);
        self.model.attention_done(started);
        Ok(())
    }

    fn gqa(&mut self, l: usize, w: &GqaParts<Box<dyn LinearOp>, Vec<f32>>) -> Result<()> {
        let spec = &self.model.spec;
        let AttentionSpec::Gqa { heads, kv_heads, head_dim, output_gate, .. } = spec.attention else {
            unreachable!("the walk gives GQA weights to a GQA model")
        };
        let a = GqaAttention {
            heads,
            kv_heads,
            head_dim,
            eps: spec.rms_norm_eps,
            scale: spec.softmax_scale,
            output_gate,
            window: spec.window(l),
            w,
        };
        let started = std::time::Instant::now();
        a.forward(&self.xn, &mut layer_kv(self.seqs, l), &self.rope, &mut self.y);
        self.model.attention_done(started);
        Ok(())
    }

    fn gated_delta_net(&mut self, l: usize, w: &DeltaNetParts<Box<dyn LinearOp>, Vec<f32>>) -> Result<()> {
        let spec = &self.model.spec;
        let d = spec.delta_net.expect("the walk gives DeltaNet weights to a DeltaNet model");
        let op = DeltaNetOp { spec: d, eps: spec.rms_norm_eps, w };
        let started = std::time::Instant::now();
        let mut seqs: Vec<SeqDelta<'_>> =
            self.seqs.iter_mut().map(|s| SeqDelta { rows: s.tokens.len(), state: &mut s.session.delta[l] }).collect();
        op.forward(&self.xn, &mut seqs, &mut self.y);
        let ns = started.elapsed().as_nanos() as u64;
        self.model.stats.deltanet_ns.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn mlp(&mut self, _l: usize, w: &Mlp) -> Result<()> {
        let mut clock = std::time::Instant::now();
        w.forward(&self.xn, self.t, &mut self.y);
        OTHER_NS.lap(&mut clock, 4);
        Ok(())
    }

    fn moe(&mut self, l: usize, w: &MoeWeights<CpuKinds>, _next: Option<NextMoe<'_, CpuKinds>>) -> Result<()> {
        let m = self.model;
        w.forward(&m.stats, m.heat.as_ref(), l, &self.xn, self.t, m.spec.hidden_size, &mut self.y);
        Ok(())
    }
}
