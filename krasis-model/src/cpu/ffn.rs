//! Feed-forward blocks: the gated MLP (dense layers, shared experts) and the MoE block
//! (router → expert executor, plus the shared expert).

use krasis_cpu::activation::silu_mul;

use super::experts::Routes;
use super::CpuKinds;
use crate::cpu::packed_ops::PooledMlp;
use crate::model::build::MoeWeights;
use crate::model::linear::{forward_shared_input, LinearOp};
use crate::model::router::route;
use crate::spec::RoutingRule;

pub enum Mlp {
    /// Three linears, one after another (the reference path, or quantised linears).
    Separate { gate: Box<dyn LinearOp>, up: Box<dyn LinearOp>, down: Box<dyn LinearOp> },
    /// Fused gate+up and down from the dense-weight cache, one pool dispatch.
    Pooled(Box<PooledMlp>),
}

impl Mlp {
    pub fn weight_bytes(&self) -> usize {
        match self {
            Mlp::Separate { gate, up, down } => gate.weight_bytes() + up.weight_bytes() + down.weight_bytes(),
            Mlp::Pooled(p) => p.weight_bytes(),
        }
    }

    /// `out[t, hidden] = down(silu(gate(x)) · up(x))`.
    pub fn forward(&self, x: &[f32], t: usize, out: &mut [f32]) {
        match self {
            Mlp::Separate { gate, up, down } => {
                let i = gate.out_dim();
                let mut g = vec![0f32; t * i];
                let mut u = vec![0f32; t * i];
                forward_shared_input(&[gate.as_ref(), up.as_ref()], x, t, &mut [&mut g, &mut u]);
                let mut a = vec![0f32; t * i];
                silu_mul(&g, &u, &mut a);
                down.forward(&a, t, out);
            }
            Mlp::Pooled(p) => {
                out.fill(0.0);
                p.forward_add(x, t, out);
            }
        }
    }

    /// `out[t, hidden] += down(silu(gate(x)) · up(x))`.
    pub fn forward_add(&self, x: &[f32], t: usize, hidden: usize, out: &mut [f32]) {
        match self {
            Mlp::Separate { .. } => {
                let mut s = vec![0f32; t * hidden];
                self.forward(x, t, &mut s);
                for (o, v) in out.iter_mut().zip(&s) {
                    *o += v;
                }
            }
            Mlp::Pooled(p) => p.forward_add(x, t, out),
        }
    }
}

/// A router on the CPU: gate matrix, optional bias, rule. With a
/// [`crate::spec::TopkMethod::NoauxTc`] rule the bias is the score-correction bias (it only
/// chooses); with any other rule it is the router linear's own bias, added to its logits
/// (gpt-oss's `mlp.router.bias`, [`crate::model::tensors::TensorRole::Bias`]).
pub struct CpuRouter {
    pub gate: Box<dyn LinearOp>,
    pub bias: Option<Vec<f32>>,
    pub rule: RoutingRule,
}

impl CpuRouter {
    /// The bias added to the logits, if the router has one.
    fn logit_bias(&self) -> Option<&[f32]> {
        match self.rule.topk {
            crate::spec::TopkMethod::NoauxTc { .. } => None,
            _ => self.bias.as_deref(),
        }
    }
}

impl MoeWeights<CpuKinds> {
    /// The layer's MoE output for `x`; with `heat`, its routes are counted as layer `layer`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        stats: &super::ForwardStats,
        heat: Option<&crate::placement::heatmap::HeatCounter>,
        layer: usize,
        x: &[f32],
        t: usize,
        hidden: usize,
        out: &mut [f32],
    ) {
        let mut clock = std::time::Instant::now();
        let e = self.router.gate.out_dim();
        let mut logits = vec![0f32; t * e];
        self.router.gate.forward(x, t, &mut logits);
        if let Some(b) = self.router.logit_bias() {
            krasis_cpu::linear::add_bias_rows(&mut logits, b);
        }
        super::OTHER_NS.lap(&mut clock, 2);
        let routes = self.route_rows(&logits, t, e);
        if let Some(h) = heat {
            h.record(layer, &routes.ids);
        }
        if t >= PARALLEL_ZERO_TOKENS {
            // A prefill's output (4 MB at 512 V2-Lite tokens): one core writes it at ~10 GB/s, ~0.4 ms a layer.
            krasis_cpu::par::for_each_chunk_mut(out, ZERO_CHUNK, &|_, c| c.fill(0.0));
        } else {
            out.fill(0.0);
        }
        super::OTHER_NS.lap(&mut clock, 3);
        let started = std::time::Instant::now();
        // A pooled shared expert runs inside the routed experts' dispatch where the backend can
        // (not a gated one: its output is scaled before it is added).
        let inside = match (&self.shared, &self.shared_gate) {
            (Some(Mlp::Pooled(p)), None) => self.experts.run_with_shared(x, t, &routes, p, out),
            _ => false,
        };
        if !inside {
            self.experts.run(x, t, &routes, out);
        }
        stats.add_expert(started.elapsed());
        if inside {
            stats.add_shared_inside(self.shared.as_ref().map_or(0, Mlp::weight_bytes));
        } else if let Some(shared) = &self.shared {
            let started = std::time::Instant::now();
            match &self.shared_gate {
                None => shared.forward_add(x, t, hidden, out),
                Some(gate) => {
                    let mut s = vec![0f32; t * hidden];
                    shared.forward(x, t, &mut s);
                    add_sigmoid_gated(gate, x, &s, hidden, out);
                }
            }
            stats.add_shared(started.elapsed());
        }
    }
}

/// `out[r] += σ(x[r] · gate) · s[r]` for each row `r` of `x` (`[t, gate.len()]`), `s` and `out`
/// (`[t, hidden]`): a shared expert's output `s` through its one-logit sigmoid gate (Qwen2-MoE's
/// `shared_expert_gate`; the dot product in f64).
pub fn add_sigmoid_gated(gate: &[f32], x: &[f32], s: &[f32], hidden: usize, out: &mut [f32]) {
    let rows = x.chunks_exact(gate.len()).zip(s.chunks_exact(hidden)).zip(out.chunks_exact_mut(hidden));
    for ((xr, sr), or) in rows {
        let logit: f64 = xr.iter().zip(gate).map(|(&a, &b)| a as f64 * b as f64).sum();
        let g = (1.0 / (1.0 + (-logit).exp())) as f32;
        for (o, &v) in or.iter_mut().zip(sr) {
            *o += g * v;
        }
    }
}

/// Tokens from which the MoE output is zeroed over the pool (below, one core does it sooner than
/// a dispatch).
const PARALLEL_ZERO_TOKENS: usize = 32;
/// Floats per task of that zeroing (256 KiB).
const ZERO_CHUNK: usize = 64 << 10;

/// Tokens per task of the parallel routing (each token's top-k is a few µs of scalar work).
const ROUTE_TOKENS_PER_TASK: usize = 16;

impl MoeWeights<CpuKinds> {
    /// Each token's top-k of its `e` router logits, over the pool for many tokens (the same
    /// routes as one after another: every token alone).
    fn route_rows(&self, logits: &[f32], t: usize, e: usize) -> Routes {
        let k = self.router.rule.top_k;
        let mut routes = Routes { k, ids: vec![0; t * k], weights: vec![0.0; t * k] };
        let one = |row: &[f32], ids: &mut [usize], ws: &mut [f32]| {
            let (i, w) = route(&self.router.rule, row, self.router.bias.as_deref());
            ids.copy_from_slice(&i);
            ws.copy_from_slice(&w);
        };
        if t < 2 * ROUTE_TOKENS_PER_TASK || k == 0 {
            for ((row, ids), ws) in
                logits.chunks_exact(e).zip(routes.ids.chunks_exact_mut(k)).zip(routes.weights.chunks_exact_mut(k))
            {
                one(row, ids, ws);
            }
            return routes;
        }
        let n = ROUTE_TOKENS_PER_TASK;
        krasis_cpu::par::for_each_chunk_pair_mut(&mut routes.ids, n * k, &mut routes.weights, n * k, &|c, ids, ws| {
            for r in 0..ids.len() / k {
                let tok = c * n + r;
                one(&logits[tok * e..(tok + 1) * e], &mut ids[r * k..(r + 1) * k], &mut ws[r * k..(r + 1) * k]);
            }
        });
        routes
    }
}
