//! Expert executors: who runs the routed experts of a MoE layer. The layer math hands over the
//! normalised hidden states and the routing; the executor adds `Σ w · expert(x)` into the output.
//! The reference executor runs f32 math on the source weights; quantised CPU and GPU executors
//! plug in here.

use super::ffn::Mlp;

/// Top-k routing of `t` tokens: `ids[t·k + j]`, `weights[t·k + j]`.
pub struct Routes {
    pub k: usize,
    pub ids: Vec<usize>,
    pub weights: Vec<f32>,
}

impl Routes {
    pub fn with_capacity(t: usize, k: usize) -> Self {
        Routes { k, ids: Vec::with_capacity(t * k), weights: Vec::with_capacity(t * k) }
    }

    pub fn push(&mut self, ids: &[usize], weights: &[f32]) {
        self.ids.extend_from_slice(ids);
        self.weights.extend_from_slice(weights);
    }

    pub fn tokens(&self) -> usize {
        self.ids.len() / self.k.max(1)
    }
}

pub trait ExpertExecutor: Send + Sync {
    /// Accumulate the routed experts' weighted outputs for `t` tokens into `out` (`[t, hidden]`).
    fn run(&self, layer: usize, x: &[f32], t: usize, routes: &Routes, out: &mut [f32]);
    /// A short description for logs ("reference f32", "cpu int4 g128 avx512", …).
    fn describe(&self) -> String;
}

/// Routed experts as gated MLPs over the source weights, tokens grouped per expert.
pub struct ReferenceExperts {
    pub hidden: usize,
    /// `layers[l]` is empty for dense layers.
    pub layers: Vec<Vec<Mlp>>,
}

impl ExpertExecutor for ReferenceExperts {
    fn run(&self, layer: usize, x: &[f32], t: usize, routes: &Routes, out: &mut [f32]) {
        let h = self.hidden;
        let experts = &self.layers[layer];
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts.len()];
        for tok in 0..t {
            for j in 0..routes.k {
                let slot = tok * routes.k + j;
                by_expert[routes.ids[slot]].push((tok, routes.weights[slot]));
            }
        }
        for (e, toks) in by_expert.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let n = toks.len();
            let mut xs = Vec::with_capacity(n * h);
            for &(tok, _) in toks {
                xs.extend_from_slice(&x[tok * h..(tok + 1) * h]);
            }
            let mut y = vec![0f32; n * h];
            experts[e].forward(&xs, n, &mut y);
            for (r, &(tok, w)) in toks.iter().enumerate() {
                for (o, v) in out[tok * h..(tok + 1) * h].iter_mut().zip(&y[r * h..(r + 1) * h]) {
                    *o += w * v;
                }
            }
        }
    }

    fn describe(&self) -> String {
        "reference (f32 math on the source weights)".into()
    }
}
