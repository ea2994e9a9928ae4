//! Feed-forward blocks: the gated MLP (dense layers, shared experts) and the MoE block
//! (router → expert executor, plus the shared expert).

use krasis_cpu::activation::silu_mul;

use super::experts::{LayerExperts, Routes};
use crate::linear::{forward_shared_input, LinearOp};
use crate::packed_ops::PooledMlp;
use crate::router::route;
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

pub struct MoeBlock {
    pub router: Box<dyn LinearOp>,
    pub bias: Option<Vec<f32>>,
    pub rule: RoutingRule,
    pub shared: Option<Mlp>,
    /// This layer's expert backend.
    pub experts: Box<dyn LayerExperts>,
}

impl MoeBlock {
    pub fn forward(&self, stats: &super::ForwardStats, x: &[f32], t: usize, hidden: usize, out: &mut [f32]) {
        let e = self.router.out_dim();
        let mut logits = vec![0f32; t * e];
        self.router.forward(x, t, &mut logits);
        let mut routes = Routes::with_capacity(t, self.rule.top_k);
        for row in logits.chunks_exact(e) {
            let (ids, w) = route(&self.rule, row, self.bias.as_deref());
            routes.push(&ids, &w);
        }
        out.fill(0.0);
        let started = std::time::Instant::now();
        self.experts.run(x, t, &routes, out);
        stats.add_expert(started.elapsed());
        if let Some(shared) = &self.shared {
            let started = std::time::Instant::now();
            shared.forward_add(x, t, hidden, out);
            stats.add_shared(started.elapsed());
        }
    }
}

pub enum Ffn {
    Dense(Mlp),
    Moe(MoeBlock),
}
