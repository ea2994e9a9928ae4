//! The one forward walk: the layer order of a decoder and its attention-kind and FFN-kind
//! branches, spelled once for every engine. An engine is a [`LayerOps`] implementation over its
//! own [`WeightKinds`] (the CPU engine's, the GPU engine's); what a device fuses (the GPU's
//! residual add inside its norm kernel, the hybrid hand-off of a MoE layer to the CPU on the
//! stream) stays inside its ops.
//!
//! A step's state lives in the ops: the residual stream `x`, the normed input `xn` of the next
//! block and the block's output `y`. The walk asks, per layer:
//! `x += y` (the previous layer's FFN) and `xn = norm(x)`, attention into `y`, `x += y` and
//! `xn = norm(x)`, the FFN into `y`; after the last layer, `x += y` and the final norm.

use std::ops::Range;

use crate::error::Result;
use crate::model::build::{
    AttentionWeights, DeltaNetParts, FfnWeights, GqaParts, MlaParts, MoeWeights, WeightKinds, Weights,
};

/// Which norm of the walk a [`LayerOps::residual_norm`] call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormAt {
    /// Layer `l`'s input norm (`x` is then the hidden state entering layer `l`).
    Input(usize),
    /// Layer `l`'s norm between attention and the FFN.
    PostAttention(usize),
    /// The final norm before the LM head (`x` then holds the last layer's output).
    Final,
}

/// The following layer's MoE block, for engines that predict its routes while this layer runs
/// (the hybrid engine prefetches the CPU experts the next layer will read).
pub struct NextMoe<'a, K: WeightKinds> {
    pub layer: usize,
    /// The norm in front of it (its post-attention norm).
    pub norm: &'a K::Vector,
    pub moe: &'a MoeWeights<K>,
}

/// One engine's operations, each over the step's state (see the module comment).
pub trait LayerOps<K: WeightKinds> {
    /// `x += y` when `add`, then `xn = rmsnorm(x) · w`.
    fn residual_norm(&mut self, w: &K::Vector, add: bool, at: NormAt) -> Result<()>;
    /// MLA attention of layer `l` over `xn` into `y`, appending to the layer's KV cache.
    fn mla(&mut self, l: usize, w: &MlaParts<K::Linear, K::Vector, K::KvB>) -> Result<()>;
    /// GQA attention of layer `l` over `xn` into `y`, appending to the layer's KV cache.
    fn gqa(&mut self, l: usize, w: &GqaParts<K::Linear, K::Vector>) -> Result<()>;
    /// A gated-DeltaNet layer `l` over `xn` into `y`, advancing the layer's recurrent state.
    fn gated_delta_net(&mut self, l: usize, w: &DeltaNetParts<K::Linear, K::Vector>) -> Result<()>;
    /// A dense layer's MLP over `xn` into `y`.
    fn mlp(&mut self, l: usize, w: &K::Mlp) -> Result<()>;
    /// A MoE layer over `xn` into `y`: routed experts plus the shared expert.
    fn moe(&mut self, l: usize, w: &MoeWeights<K>, next: Option<NextMoe<'_, K>>) -> Result<()>;
}

/// Runs `layers` of `weights` with `ops`. Layer 0 starts from `x` as the embedding left it; a
/// range that starts later continues from the state an earlier range left (`x`, and the last
/// FFN's output in `y`), so ranges run one after another give the same result as the whole
/// (the seam for pipeline stages). When the range ends at the model's last layer the final norm
/// follows, leaving `xn` for the LM head.
pub fn forward<K: WeightKinds, O: LayerOps<K>>(weights: &Weights<K>, ops: &mut O, layers: Range<usize>) -> Result<()> {
    let n = weights.layers.len();
    if layers.start > layers.end || layers.end > n {
        return Err(crate::error::ModelError::Invalid(format!(
            "forward walk over layers {layers:?} of a model with {n}"
        )));
    }
    for l in layers.clone() {
        let w = &weights.layers[l];
        ops.residual_norm(&w.input_norm, l > 0, NormAt::Input(l))?;
        match &w.attention {
            AttentionWeights::Mla(a) => ops.mla(l, a)?,
            AttentionWeights::Gqa(a) => ops.gqa(l, a)?,
            AttentionWeights::GatedDeltaNet(a) => ops.gated_delta_net(l, a)?,
        }
        ops.residual_norm(&w.post_norm, true, NormAt::PostAttention(l))?;
        match &w.ffn {
            FfnWeights::Dense(m) => ops.mlp(l, m)?,
            FfnWeights::Moe(m) => {
                let next = weights.layers.get(l + 1).and_then(|nw| match &nw.ffn {
                    FfnWeights::Moe(moe) => Some(NextMoe { layer: l + 1, norm: &nw.post_norm, moe }),
                    FfnWeights::Dense(_) => None,
                });
                ops.moe(l, m, next)?
            }
        }
    }
    if layers.end == n {
        ops.residual_norm(&weights.final_norm, n > 0, NormAt::Final)?;
    }
    Ok(())
}

/// Calls `f` on every dense part of a layer's weights that a decode step reads once per token
/// (attention projections, `kv_b`, dense MLP, router, shared expert), as the [`Part`] it is: for
/// per-token byte counts and descriptions without matching on the weight enums elsewhere.
pub fn for_each_dense_part<K: WeightKinds>(
    layer: &crate::model::build::LayerWeights<K>,
    f: &mut dyn FnMut(Part<'_, K>),
) {
    match &layer.attention {
        AttentionWeights::Mla(a) => {
            if let Some((q_a, _)) = &a.q_a {
                f(Part::Linear(q_a));
            }
            f(Part::Linear(&a.q_b));
            f(Part::Linear(&a.kv_a));
            f(Part::KvB(&a.kv_b));
            f(Part::Linear(&a.o));
        }
        AttentionWeights::Gqa(a) => {
            for l in [&a.q, &a.k, &a.v, &a.o] {
                f(Part::Linear(l));
            }
        }
        AttentionWeights::GatedDeltaNet(a) => {
            for l in [&a.qkv, &a.z, &a.b, &a.a, &a.out] {
                f(Part::Linear(l));
            }
        }
    }
    match &layer.ffn {
        FfnWeights::Dense(m) => f(Part::Mlp(m)),
        FfnWeights::Moe(m) => {
            f(Part::Router(&m.router));
            if let Some(s) = &m.shared {
                f(Part::Mlp(s));
            }
        }
    }
}

/// One dense part of a layer ([`for_each_dense_part`]).
pub enum Part<'a, K: WeightKinds> {
    Linear(&'a K::Linear),
    KvB(&'a K::KvB),
    Mlp(&'a K::Mlp),
    Router(&'a K::Router),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::build::{LayerWeights, MoeWeights};

    /// Kinds whose weights are names, for a walk that records what it was asked.
    struct Names;
    impl WeightKinds for Names {
        type Linear = &'static str;
        type Mlp = &'static str;
        type Vector = &'static str;
        type Embedding = ();
        type KvB = &'static str;
        type Router = &'static str;
        type Experts = &'static str;
    }

    #[derive(Default)]
    struct Recorder(Vec<String>);
    impl LayerOps<Names> for Recorder {
        fn residual_norm(&mut self, w: &&'static str, add: bool, at: NormAt) -> Result<()> {
            self.0.push(format!("norm {w} add={add} {at:?}"));
            Ok(())
        }
        fn mla(&mut self, l: usize, w: &MlaParts<&'static str, &'static str, &'static str>) -> Result<()> {
            self.0.push(format!("mla {l} {}", w.o));
            Ok(())
        }
        fn gqa(&mut self, l: usize, w: &GqaParts<&'static str, &'static str>) -> Result<()> {
            self.0.push(format!("gqa {l} {}", w.o));
            Ok(())
        }
        fn gated_delta_net(&mut self, l: usize, w: &DeltaNetParts<&'static str, &'static str>) -> Result<()> {
            self.0.push(format!("deltanet {l} {}", w.out));
            Ok(())
        }
        fn mlp(&mut self, l: usize, w: &&'static str) -> Result<()> {
            self.0.push(format!("mlp {l} {w}"));
            Ok(())
        }
        fn moe(&mut self, l: usize, w: &MoeWeights<Names>, next: Option<NextMoe<'_, Names>>) -> Result<()> {
            let next = next.map(|n| format!("{} {}", n.layer, n.moe.router));
            self.0.push(format!("moe {l} {} next={next:?}", w.router));
            Ok(())
        }
    }

    fn model() -> Weights<Names> {
        let gqa = |o| {
            AttentionWeights::Gqa(GqaParts {
                q: "q",
                k: "k",
                v: "v",
                o,
                qk_norm: None,
                qkv_bias: None,
                o_bias: None,
                sinks: None,
            })
        };
        let moe = |r| FfnWeights::Moe(MoeWeights { router: r, experts: "e", shared: None, shared_gate: None });
        let layer = |attention, ffn| LayerWeights { input_norm: "in", post_norm: "post", attention, ffn };
        Weights {
            embed: (),
            layers: vec![
                layer(gqa("o0"), FfnWeights::Dense("mlp0")),
                layer(
                    AttentionWeights::Mla(MlaParts {
                        q_a: None,
                        q_b: "q",
                        kv_a: "kv_a",
                        kv_a_norm: "n",
                        kv_b: "kv_b",
                        o: "o1",
                    }),
                    moe("r1"),
                ),
                layer(gqa("o2"), moe("r2")),
            ],
            final_norm: "final",
            lm_head: "head",
        }
    }

    #[test]
    fn walks_the_layers_in_order_with_their_kinds() {
        let mut r = Recorder::default();
        forward(&model(), &mut r, 0..3).unwrap();
        let want = [
            "norm in add=false Input(0)",
            "gqa 0 o0",
            "norm post add=true PostAttention(0)",
            "mlp 0 mlp0",
            "norm in add=true Input(1)",
            "mla 1 o1",
            "norm post add=true PostAttention(1)",
            "moe 1 r1 next=Some(\"2 r2\")",
            "norm in add=true Input(2)",
            "gqa 2 o2",
            "norm post add=true PostAttention(2)",
            "moe 2 r2 next=None",
            "norm final add=true Final",
        ];
        assert_eq!(r.0, want);
    }

    #[test]
    fn split_ranges_walk_as_the_whole() {
        let (mut whole, mut parts) = (Recorder::default(), Recorder::default());
        forward(&model(), &mut whole, 0..3).unwrap();
        forward(&model(), &mut parts, 0..1).unwrap();
        forward(&model(), &mut parts, 1..3).unwrap();
        assert_eq!(whole.0, parts.0);
        // No final norm before the last layer.
        let mut first = Recorder::default();
        forward(&model(), &mut first, 0..2).unwrap();
        assert!(!first.0.iter().any(|s| s.contains("Final")));
    }

    #[test]
    fn a_range_past_the_model_is_an_error() {
        let err = forward(&model(), &mut Recorder::default(), 1..4).unwrap_err();
        assert!(err.to_string().contains("layers 1..4"), "{err}");
    }

    #[test]
    fn dense_parts_cover_attention_and_ffn() {
        let m = model();
        let mut seen = Vec::new();
        for layer in &m.layers {
            for_each_dense_part(layer, &mut |p| {
                seen.push(match p {
                    Part::Linear(l) => *l,
                    Part::KvB(k) => *k,
                    Part::Mlp(m) => *m,
                    Part::Router(r) => *r,
                })
            });
        }
        assert_eq!(seen, ["q", "k", "v", "o0", "mlp0", "q", "kv_a", "kv_b", "o1", "r1", "q", "k", "v", "o2", "r2"]);
    }
}
