//! The GPU engine's expert resources (the stream slots, the pinned experts, the expert pool) and
//! the [`PlacementPlan`] that says, per MoE layer and per call, which of them runs the routed
//! experts. The forward step asks [`Placed::site`] and runs what it is given; the plan is the
//! only place where the choice is made.

use std::sync::Arc;

use super::expert_pool::ExpertPool;
use super::expert_stream::ExpertStreamer;
use super::hot_experts::{HotExperts, HotLayer};
use crate::error::{ModelError, Result};
use crate::placement::plan::moe_layers;
use crate::placement::{Beside, ExpertHome, ExpertSite, PlacementPlan};
use crate::ModelSpec;

/// Longest call whose pinned-or-split choice is worked out per length when the plan is made;
/// longer calls keep the choice made at this length (the split streams every expert long before:
/// [`super::expert_stream::split_fraction`]).
const PIN_SCAN_MAX_TOKENS: usize = 4096;

/// The plan and the resources it names.
pub(crate) struct Placed {
    plan: PlacementPlan,
    /// Per model layer: whether it is a MoE layer.
    moe: Vec<bool>,
    /// Top-k of the model's routing.
    top_k: usize,
    /// The reasons the start lines give: the device's, the stream's, what is beside's.
    why: [String; 3],
    /// Hybrid: the routed experts streamed to the GPU for long prefills.
    streamer: Option<Arc<ExpertStreamer>>,
    /// `hot_cached_static`'s pinned experts (hybrid).
    hot: Option<HotExperts>,
    /// `active_only`, `static_pin`, `weighted_pin` or `lru`: the experts kept in VRAM (hybrid).
    pool: Option<Arc<ExpertPool>>,
}

/// What runs one MoE layer's routed experts in one call, with the resource it uses.
pub(crate) enum Site<'a> {
    /// Resident in VRAM (the layer's weights hold them).
    Resident,
    /// On the CPU (the hand-off), nothing of the layer on the GPU but the shared expert.
    Cpu,
    /// Every expert streamed through the slots, whole layers.
    Streamed(&'a ExpertStreamer),
    /// Every expert streamed in chunks.
    StreamedChunks(&'a ExpertStreamer),
    /// The first `.1` experts streamed, the rest on the CPU.
    Split(&'a ExpertStreamer, usize),
    /// The layer's pinned experts on the GPU, the rest on the CPU.
    Pinned(&'a HotLayer),
    /// Every route on the GPU from the expert pool.
    Pool(&'a Arc<ExpertPool>),
    /// The last `.1` routes of each token on the GPU, read over PCIe from the CPU's records; the
    /// rest on the CPU.
    CpuAndPcie(&'a ExpertStreamer, usize),
}

impl Placed {
    /// The whole model on the GPU (`resident`), or the hybrid engine before its stream and
    /// pins are set up.
    pub fn new(spec: &ModelSpec, resident: bool) -> Placed {
        let home =
            if resident { ExpertHome::Resident } else { ExpertHome::Host { stream: None, beside: Beside::Nothing } };
        let moe = moe_layers(spec);
        Placed {
            plan: PlacementPlan::new(home, moe.clone(), ""),
            moe,
            top_k: spec.moe.as_ref().map_or(1, |m| m.routing.top_k),
            why: Default::default(),
            streamer: None,
            hot: None,
            pool: None,
        }
    }

    pub fn plan(&self) -> &PlacementPlan {
        &self.plan
    }

    pub fn streamer(&self) -> Option<&Arc<ExpertStreamer>> {
        self.streamer.as_ref()
    }

    pub fn hot(&self) -> Option<&HotExperts> {
        self.hot.as_ref()
    }

    pub fn pool(&self) -> Option<&Arc<ExpertPool>> {
        self.pool.as_ref()
    }

    /// The device choice's reason, for the start lines.
    pub fn because(&mut self, why: &str) {
        self.why[0] = why.to_string();
        // Only the reason changes: the sites stay as the resources made them.
        self.plan = self.plan.clone().home_because(why);
    }

    /// Sets the stream slots; `why` is the reason the start lines give.
    pub fn set_streamer(&mut self, streamer: Arc<ExpertStreamer>, why: String) {
        self.streamer = Some(streamer);
        self.why[1] = why;
        self.remake();
    }

    /// Sets the pinned experts (no pool beside them).
    pub fn set_hot(&mut self, hot: HotExperts, why: String) {
        (self.hot, self.pool) = (Some(hot), None);
        self.why[2] = why;
        self.remake();
    }

    /// Sets the expert pool (no pins beside it).
    pub fn set_pool(&mut self, pool: Arc<ExpertPool>, why: String) {
        (self.pool, self.hot) = (Some(pool), None);
        self.why[2] = why;
        self.remake();
    }

    /// The plan over the resources set so far.
    fn remake(&mut self) {
        let home = match self.plan.home() {
            ExpertHome::Host { .. } => {
                let stream = self.streamer.as_ref().map(|s| s.rule());
                let beside = match (&self.hot, &self.pool) {
                    (_, Some(pool)) => Beside::Pool(pool.strategy()),
                    (Some(hot), None) => Beside::Pinned {
                        until: hot
                            .layers
                            .iter()
                            .map(|hl| hl.as_ref().map_or(0, |hl| pinned_until(hl, stream.as_ref(), self.top_k)))
                            .collect(),
                    },
                    (None, None) => Beside::Nothing,
                };
                ExpertHome::Host { stream, beside }
            }
            home => home.clone(),
        };
        let [device, stream, beside] = self.why.clone();
        self.plan = PlacementPlan::new(home, self.moe.clone(), device).stream_because(stream).beside_because(beside);
    }

    /// The site of MoE layer `l` in a call of `t` tokens, with its resource.
    pub fn site(&self, l: usize, t: usize) -> Result<Site<'_>> {
        let missing = |what: &str| {
            ModelError::Invalid(format!("placement: layer {l} is planned on {what}, which this engine does not hold"))
        };
        let Some(site) = self.plan.site(l, t) else {
            return Err(ModelError::Invalid(format!("placement: layer {l} is not a MoE layer")));
        };
        let streamer = || self.streamer.as_deref().ok_or_else(|| missing("the stream slots"));
        Ok(match site {
            ExpertSite::GpuResident => Site::Resident,
            ExpertSite::Cpu => Site::Cpu,
            ExpertSite::GpuStreamed => Site::Streamed(streamer()?),
            ExpertSite::GpuStreamedChunks => Site::StreamedChunks(streamer()?),
            ExpertSite::Split { gpu } => Site::Split(streamer()?, gpu),
            ExpertSite::Pinned => Site::Pinned(
                self.hot
                    .as_ref()
                    .and_then(|h| h.layers.get(l))
                    .and_then(Option::as_ref)
                    .ok_or_else(|| missing("pinned experts"))?,
            ),
            ExpertSite::Pool => Site::Pool(self.pool.as_ref().ok_or_else(|| missing("the expert pool"))?),
            ExpertSite::CpuAndPcie { gpu } => Site::CpuAndPcie(streamer()?, gpu),
        })
    }
}

/// The shortest call from which a layer with pins `hl` streams its split instead (the pinned
/// experts leave the CPU more experts to read, [`super::hot_experts::pinned_beats_streaming`]);
/// `usize::MAX` when the pins serve every call that does not stream every expert.
fn pinned_until(hl: &HotLayer, stream: Option<&crate::placement::StreamRule>, k: usize) -> usize {
    let Some(rule) = stream else { return usize::MAX };
    (rule.min_tokens.max(1)..=PIN_SCAN_MAX_TOKENS)
        .find(|&t| {
            let present = rule.gpu_experts(t);
            present >= rule.n_experts || (present > 0 && !hl.beats_streaming(present, t, k))
        })
        .unwrap_or(usize::MAX)
}
