//! Expert backends on the host: who runs the routed experts of a MoE layer. The layer math hands
//! over the normalised hidden states and the routing; the backend adds `Σ w · expert(x)` into the
//! output. Each MoE layer holds its own [`LayerExperts`]: the reference backend runs f32 math on
//! the source weights; a model-wide [`ExpertExecutor`] (the quantised CPU pool over the expert
//! cache) serves every layer through [`ExecutorLayer`]. GPU layers use the same host backends in
//! the hybrid engine (`crate::gpu`).

use std::sync::Arc;

use krasis_cpu::linear::add_bias_rows;

use super::ffn::Mlp;
use crate::cpu::packed_ops::PooledMlp;
use crate::model::linear::forward_shared_input;
use crate::spec::ExpertActivation;

/// Top-k routing of `t` tokens: `ids[t·k + j]`, `weights[t·k + j]`.
/// The routes of `t` tokens, `k` per token: expert ids and weights, token-major. A route whose id
/// is not an expert of the layer (≥ its expert count, e.g. [`Routes::ELSEWHERE`]) contributes
/// nothing: every [`LayerExperts`] skips it (a split hybrid layer hands the GPU's share of the
/// routes to the GPU this way).
pub struct Routes {
    pub k: usize,
    pub ids: Vec<usize>,
    pub weights: Vec<f32>,
}

impl Routes {
    /// An id no layer has: the route is computed elsewhere.
    pub const ELSEWHERE: usize = usize::MAX;

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

/// The routed experts of one MoE layer, on the host.
pub trait LayerExperts: Send + Sync {
    /// Accumulate the routed experts' weighted outputs for `t` tokens into `out` (`[t, hidden]`).
    fn run(&self, x: &[f32], t: usize, routes: &Routes, out: &mut [f32]);
    /// A short description for logs ("reference f32", "cpu int4 g128 avx512", …).
    fn describe(&self) -> String;
    /// A hint: the next call will probably run the experts `ids`. A backend that streams weights
    /// from memory may pull up to `budget` bytes of theirs, in the order the call reads them,
    /// into the caches meanwhile, until `stop()` says the call is due; returns the bytes it
    /// requested. Never required for correctness; the default does nothing.
    fn prefetch(&self, ids: &[usize], budget: usize, stop: &(dyn Fn() -> bool + Sync)) -> usize {
        let _ = (ids, budget, stop);
        0
    }
    /// `out += shared(x)` for every token and [`LayerExperts::run`], both in one dispatch where
    /// the backend can (then it returns true; false: it did nothing, and the caller runs the two
    /// itself). The default cannot.
    fn run_with_shared(&self, x: &[f32], t: usize, routes: &Routes, shared: &PooledMlp, out: &mut [f32]) -> bool {
        let _ = (x, t, routes, shared, out);
        false
    }
}

/// Routed experts of every MoE layer behind one object (the cache-backed CPU pool).
pub trait ExpertExecutor: Send + Sync {
    /// Accumulate the routed experts' weighted outputs for `t` tokens into `out` (`[t, hidden]`).
    fn run(&self, layer: usize, x: &[f32], t: usize, routes: &Routes, out: &mut [f32]);
    /// A short description for logs ("reference f32", "cpu int4 g128 avx512", …).
    fn describe(&self) -> String;
    /// [`LayerExperts::prefetch`] for MoE layer `layer`.
    fn prefetch(&self, layer: usize, ids: &[usize], budget: usize, stop: &(dyn Fn() -> bool + Sync)) -> usize {
        let _ = (layer, ids, budget, stop);
        0
    }
    /// [`LayerExperts::run_with_shared`] for MoE layer `layer`.
    #[allow(clippy::too_many_arguments)]
    fn run_with_shared(
        &self,
        layer: usize,
        x: &[f32],
        t: usize,
        routes: &Routes,
        shared: &PooledMlp,
        out: &mut [f32],
    ) -> bool {
        let _ = (layer, x, t, routes, shared, out);
        false
    }
}

/// A model-wide executor bound after the model that calls it was built: the hybrid engine loads
/// its expert cache on another thread while the GPU takes the rest of the model. Running it
/// before [`LateExecutor::set`] is a bug in the loader (the loader sets it before returning).
#[derive(Default)]
pub struct LateExecutor(std::sync::OnceLock<Arc<dyn ExpertExecutor>>);

impl LateExecutor {
    /// Binds the executor (the first binding wins).
    pub fn set(&self, executor: Arc<dyn ExpertExecutor>) {
        let _ = self.0.set(executor);
    }

    fn get(&self) -> &dyn ExpertExecutor {
        self.0.get().expect("LateExecutor used before the loader set it").as_ref()
    }
}

impl ExpertExecutor for LateExecutor {
    fn run(&self, layer: usize, x: &[f32], t: usize, routes: &Routes, out: &mut [f32]) {
        self.get().run(layer, x, t, routes, out)
    }

    fn describe(&self) -> String {
        self.get().describe()
    }

    fn prefetch(&self, layer: usize, ids: &[usize], budget: usize, stop: &(dyn Fn() -> bool + Sync)) -> usize {
        self.0.get().map_or(0, |e| e.prefetch(layer, ids, budget, stop))
    }

    fn run_with_shared(
        &self,
        layer: usize,
        x: &[f32],
        t: usize,
        routes: &Routes,
        shared: &PooledMlp,
        out: &mut [f32],
    ) -> bool {
        self.get().run_with_shared(layer, x, t, routes, shared, out)
    }
}

/// Layer `layer` of a model-wide executor.
pub struct ExecutorLayer {
    pub executor: Arc<dyn ExpertExecutor>,
    pub layer: usize,
}

impl LayerExperts for ExecutorLayer {
    fn run(&self, x: &[f32], t: usize, routes: &Routes, out: &mut [f32]) {
        self.executor.run(self.layer, x, t, routes, out)
    }

    fn describe(&self) -> String {
        self.executor.describe()
    }

    fn prefetch(&self, ids: &[usize], budget: usize, stop: &(dyn Fn() -> bool + Sync)) -> usize {
        self.executor.prefetch(self.layer, ids, budget, stop)
    }

    fn run_with_shared(&self, x: &[f32], t: usize, routes: &Routes, shared: &PooledMlp, out: &mut [f32]) -> bool {
        self.executor.run_with_shared(self.layer, x, t, routes, shared, out)
    }
}

/// One layer's routed experts as gated MLPs over the source weights, tokens grouped per expert:
/// `down(act(gate(x) + b_gate, up(x) + b_up)) + b_down` (the biases where the experts have them,
/// gpt-oss), `act` the model's [`ExpertActivation`].
pub struct ReferenceExperts {
    pub hidden: usize,
    pub experts: Vec<Mlp>,
    /// Per expert, the gate, up and down biases (empty: no biases).
    pub biases: Vec<[Vec<f32>; 3]>,
    pub activation: ExpertActivation,
}

impl ReferenceExperts {
    /// One layer's experts over the source weights (zero-copy where the stored bytes allow), with
    /// their biases when the inventory names them; SiLU until [`ReferenceExperts::with_activation`].
    pub fn load(
        w: &crate::model::weights::WeightLoader<'_>,
        hidden: usize,
        experts: &[crate::model::tensors::MlpTensors],
    ) -> crate::Result<Self> {
        let mlp = |m: &crate::model::tensors::MlpTensors| -> crate::Result<Mlp> {
            Ok(Mlp::Separate {
                gate: Box::new(w.matrix_of(&m.gate)?),
                up: Box::new(w.matrix_of(&m.up)?),
                down: Box::new(w.matrix_of(&m.down)?),
            })
        };
        let biases = experts
            .iter()
            .filter_map(|m| m.bias.as_ref())
            .map(|[g, u, d]| Ok([w.vector_of(g)?, w.vector_of(u)?, w.vector_of(d)?]))
            .collect::<crate::Result<Vec<_>>>()?;
        Ok(ReferenceExperts {
            hidden,
            experts: experts.iter().map(mlp).collect::<crate::Result<Vec<_>>>()?,
            biases,
            activation: ExpertActivation::Silu,
        })
    }

    /// The experts with `activation` in place of SiLU.
    pub fn with_activation(mut self, activation: ExpertActivation) -> Self {
        self.activation = activation;
        self
    }

    /// Expert `e` over `n` rows `xs` into `y` (`[n, hidden]`).
    fn expert(&self, e: usize, xs: &[f32], n: usize, y: &mut [f32]) {
        let bias = self.biases.get(e);
        let (Mlp::Separate { gate, up, down }, false) =
            (&self.experts[e], bias.is_none() && self.activation == ExpertActivation::Silu)
        else {
            return self.experts[e].forward(xs, n, y);
        };
        let i = gate.out_dim();
        let (mut g, mut u) = (vec![0f32; n * i], vec![0f32; n * i]);
        forward_shared_input(&[gate.as_ref(), up.as_ref()], xs, n, &mut [&mut g, &mut u]);
        if let Some([bg, bu, _]) = bias {
            add_bias_rows(&mut g, bg);
            add_bias_rows(&mut u, bu);
        }
        let a: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| self.activation.apply(g, u)).collect();
        down.forward(&a, n, y);
        if let Some([_, _, bd]) = bias {
            add_bias_rows(y, bd);
        }
    }
}

impl LayerExperts for ReferenceExperts {
    fn run(&self, x: &[f32], t: usize, routes: &Routes, out: &mut [f32]) {
        let h = self.hidden;
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.experts.len()];
        for tok in 0..t {
            for j in 0..routes.k {
                let slot = tok * routes.k + j;
                if let Some(toks) = by_expert.get_mut(routes.ids[slot]) {
                    toks.push((tok, routes.weights[slot]));
                }
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
            self.expert(e, &xs, n, &mut y);
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

#[cfg(test)]
mod tests {
    use super::*;

    struct AddOne;

    impl ExpertExecutor for AddOne {
        fn run(&self, layer: usize, _x: &[f32], _t: usize, _routes: &Routes, out: &mut [f32]) {
            out.iter_mut().for_each(|o| *o += 1.0 + layer as f32);
        }

        fn describe(&self) -> String {
            "add one".into()
        }
    }

    #[test]
    fn late_executor_delegates_once_bound() {
        let late = LateExecutor::default();
        late.set(Arc::new(AddOne));
        let layer = ExecutorLayer { executor: Arc::new(late), layer: 2 };
        let mut out = [0.0f32; 3];
        layer.run(&[0.0; 3], 1, &Routes::with_capacity(1, 1), &mut out);
        assert_eq!(out, [3.0; 3]);
        assert_eq!(layer.describe(), "add one");
    }

    #[test]
    #[should_panic(expected = "before the loader set it")]
    fn late_executor_unbound_is_a_loud_bug() {
        LateExecutor::default().describe();
    }
}
