//! The placement plan of an opened engine: for each MoE layer, and for a call of `t` tokens
//! (a decode step is one token per sequence; a prompt, or a prompt's chunk, is many), who
//! computes the routed experts. Built once when the engine opens, from what the load could set up
//! (the stream slots, the pinned experts or the expert pool), and printed at start as one line
//! per distinct decision with its reason. The GPU step asks it per layer and per call
//! ([`PlacementPlan::site`]); nothing else decides.

use super::{CacheStrategy, StreamSplit};

/// Who runs one MoE layer's routed experts in one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertSite {
    /// The CPU pool runs every route.
    Cpu,
    /// The experts live in VRAM for the model's life (the whole model on the GPU).
    GpuResident,
    /// Every expert of the layer is copied to the GPU for this call, one layer ahead.
    GpuStreamed,
    /// Every expert is copied to the GPU in chunks through two slots (a layer does not fit one).
    GpuStreamedChunks,
    /// The layer's first `gpu` experts are copied to the GPU; the CPU runs the routes to the
    /// others at the same time.
    Split { gpu: usize },
    /// The layer's pinned experts run their routes on the GPU; the CPU runs the others'.
    Pinned,
    /// The experts the call routes to are copied into a VRAM pool (kept by the pool's strategy)
    /// and the GPU runs every route.
    Pool,
    /// A decode step: the GPU runs the last `gpu` routes of each token, reading those experts
    /// over PCIe from the CPU's page-locked records in place; the CPU runs the others' at the
    /// same time, so the two reads of host memory overlap.
    CpuAndPcie { gpu: usize },
}

impl ExpertSite {
    /// The site with its count left out (a split of any share is one decision).
    fn kind(self) -> ExpertSite {
        match self {
            ExpertSite::Split { .. } => ExpertSite::Split { gpu: 0 },
            ExpertSite::CpuAndPcie { .. } => ExpertSite::CpuAndPcie { gpu: 0 },
            s => s,
        }
    }

    /// Whether the call copies experts to the GPU for this layer.
    pub fn streams(self) -> bool {
        matches!(self, ExpertSite::GpuStreamed | ExpertSite::GpuStreamedChunks | ExpertSite::Split { .. })
    }
}

/// When a hybrid call streams experts to the GPU, and how many of each layer's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StreamRule {
    /// Calls of fewer tokens stream nothing (decode steps stay on the CPU).
    pub min_tokens: usize,
    /// The share of each layer a call streams.
    pub split: StreamSplit,
    /// A slot holds a chunk of a layer only: a call that streams, streams whole layers.
    pub chunked: bool,
    /// Routed experts per layer.
    pub n_experts: usize,
    /// Routes of each decode token whose experts the GPU reads over PCIe from the CPU's records
    /// (0: none): [`ExpertSite::CpuAndPcie`].
    pub pcie_routes: usize,
}

/// Longest call that gives the GPU a PCIe share of its routes: a decode step. Longer calls read
/// each expert once for many tokens on the CPU; per-token PCIe reads would multiply.
pub const PCIE_MAX_TOKENS: usize = 1;

impl StreamRule {
    /// Routes of each token a call of `t` tokens gives the GPU over PCIe.
    pub fn pcie_routes(&self, t: usize) -> usize {
        if t <= PCIE_MAX_TOKENS {
            self.pcie_routes
        } else {
            0
        }
    }

    /// How many of each layer's first experts a call of `t` tokens streams (0 below
    /// `min_tokens`; every one for long prompts).
    pub fn gpu_experts(&self, t: usize) -> usize {
        if t < self.min_tokens {
            return 0;
        }
        let n = self.n_experts;
        if self.chunked {
            // Chunks stream whole layers only (a split's copies would not shrink).
            return n;
        }
        let f = match self.split {
            StreamSplit::Measured => crate::gpu::expert_stream::split_fraction(t),
            StreamSplit::Share(f) => f.clamp(0.0, 1.0),
        };
        ((f * n as f64).round() as usize).min(n)
    }
}

/// What a hybrid engine keeps in VRAM beside its CPU experts for calls that do not stream
/// every expert.
#[derive(Clone, Debug, PartialEq)]
pub enum Beside {
    /// Nothing: those calls run on the CPU (or split with the stream).
    Nothing,
    /// Pinned experts (`hot_cached_static`). Per model layer, calls of fewer than `until[l]`
    /// tokens run the layer's pinned experts beside the CPU (0: nothing pinned in that layer);
    /// longer ones stream their split instead, where that leaves the CPU fewer experts to read.
    Pinned { until: Vec<usize> },
    /// An expert pool of this strategy runs every route on the GPU.
    Pool(CacheStrategy),
}

/// Where the routed experts live.
#[derive(Clone, Debug, PartialEq)]
pub enum ExpertHome {
    /// The CPU engine: every route on the CPU pool.
    Cpu,
    /// The whole model on the GPU.
    Resident,
    /// The hybrid engine: the experts in RAM for the CPU, streamed to the GPU by `stream` and
    /// kept beside by `beside`.
    Host { stream: Option<StreamRule>, beside: Beside },
}

/// The plan: where the experts live, which model layers are MoE layers, and the reasons the
/// start line gives.
#[derive(Clone, Debug, PartialEq)]
pub struct PlacementPlan {
    home: ExpertHome,
    /// Per model layer: whether it is a MoE layer.
    moe: Vec<bool>,
    /// Why the experts live where they do, why a stream rule is as it is, why what is beside
    /// (empty: nothing to say).
    why_home: String,
    why_stream: String,
    why_beside: String,
}

/// Per model layer of `spec`, whether it is a MoE layer (the `moe` argument of
/// [`PlacementPlan::new`]).
pub fn moe_layers(spec: &crate::ModelSpec) -> Vec<bool> {
    let moe: std::collections::HashSet<usize> = spec.moe_layers().collect();
    (0..spec.num_layers).map(|l| moe.contains(&l)).collect()
}

/// Longest call the start line's description looks at; every rule is constant beyond it (the
/// measured split streams every expert from [`crate::gpu::expert_stream::SPLIT_MAX_TOKENS`]).
const DESCRIBE_MAX_TOKENS: usize = 4096;

impl PlacementPlan {
    /// The plan of an engine whose experts live at `home`, for a model whose layers are MoE
    /// where `moe` says; `why` is the device choice's reason.
    pub fn new(home: ExpertHome, moe: Vec<bool>, why: impl Into<String>) -> PlacementPlan {
        PlacementPlan { home, moe, why_home: why.into(), why_stream: String::new(), why_beside: String::new() }
    }

    /// The CPU engine's plan for `spec`: every route on the CPU pool.
    pub fn cpu(spec: &crate::ModelSpec, why: impl Into<String>) -> PlacementPlan {
        PlacementPlan::new(ExpertHome::Cpu, moe_layers(spec), why)
    }

    /// The same plan with `why` as the device choice's reason.
    pub fn home_because(mut self, why: impl Into<String>) -> Self {
        self.why_home = why.into();
        self
    }

    /// The reason the stream rule gives in the start line.
    pub fn stream_because(mut self, why: impl Into<String>) -> Self {
        self.why_stream = why.into();
        self
    }

    /// The reason what is kept beside the CPU experts gives in the start line.
    pub fn beside_because(mut self, why: impl Into<String>) -> Self {
        self.why_beside = why.into();
        self
    }

    pub fn home(&self) -> &ExpertHome {
        &self.home
    }

    /// Who runs MoE layer `layer`'s routed experts in a call of `t` tokens; `None` for a dense
    /// layer (or one past the model).
    pub fn site(&self, layer: usize, t: usize) -> Option<ExpertSite> {
        if !self.moe.get(layer).copied().unwrap_or(false) {
            return None;
        }
        Some(match &self.home {
            ExpertHome::Cpu => ExpertSite::Cpu,
            ExpertHome::Resident => ExpertSite::GpuResident,
            ExpertHome::Host { stream, beside } => {
                let present = stream.as_ref().map_or(0, |s| s.gpu_experts(t));
                let n = stream.as_ref().map_or(usize::MAX, |s| s.n_experts);
                if present > 0 && stream.as_ref().is_some_and(|s| s.chunked) {
                    ExpertSite::GpuStreamedChunks
                } else if present >= n {
                    ExpertSite::GpuStreamed
                } else {
                    match beside {
                        Beside::Pool(_) => ExpertSite::Pool,
                        Beside::Pinned { until } if t < until.get(layer).copied().unwrap_or(0) => ExpertSite::Pinned,
                        _ if present > 0 => ExpertSite::Split { gpu: present },
                        _ => match stream.as_ref().map_or(0, |s| s.pcie_routes(t)) {
                            0 => ExpertSite::Cpu,
                            gpu => ExpertSite::CpuAndPcie { gpu },
                        },
                    }
                }
            }
        })
    }

    /// Whether a call of `t` tokens streams experts to the GPU in some layer.
    pub fn streams(&self, t: usize) -> bool {
        (0..self.moe.len()).any(|l| self.site(l, t).is_some_and(ExpertSite::streams))
    }

    /// The start line's lines: one per distinct decision (a range of call lengths over which
    /// every MoE layer's site stays the same), each with its reason.
    pub fn describe(&self) -> Vec<String> {
        let moe: Vec<usize> = (0..self.moe.len()).filter(|&l| self.moe[l]).collect();
        if moe.is_empty() {
            return vec![format!("placement: no MoE layers ({})", self.why_home)];
        }
        let kinds = |t: usize| -> Vec<ExpertSite> {
            moe.iter().filter_map(|&l| self.site(l, t)).map(ExpertSite::kind).collect()
        };
        // The set of kinds a call length uses: a run of lengths over which it stays the same is
        // one decision, even where the layers trade places within it (pins against a split).
        let kind_set = |t: usize| -> Vec<ExpertSite> {
            let mut v = kinds(t);
            v.sort_by_key(|k| format!("{k:?}"));
            v.dedup();
            v
        };
        let mut lines = Vec::new();
        let mut start = 1;
        while start <= DESCRIBE_MAX_TOKENS {
            let first = kind_set(start);
            let mut end = start;
            let mut same_layers = true;
            while end < DESCRIBE_MAX_TOKENS && kind_set(end + 1) == first {
                same_layers &= kinds(end + 1) == kinds(start);
                end += 1;
            }
            let range = match (start, end) {
                (1, 1) => "decode (1 token a call)".to_string(),
                (1, DESCRIBE_MAX_TOKENS) => "every call".to_string(),
                (s, DESCRIBE_MAX_TOKENS) => format!("calls of {s} tokens and more"),
                (1, e) => format!("decode and calls of up to {e} tokens"),
                (s, e) if s == e => format!("calls of {s} tokens"),
                (s, e) => format!("calls of {s}–{e} tokens"),
            };
            let what =
                if same_layers { self.what(&moe, start, end) } else { self.what_mixed(&moe, &first, start, end) };
            lines.push(format!("placement: {range}: {what}"));
            start = end + 1;
        }
        lines
    }

    /// Over calls of `start..=end` tokens whose layers trade places between the kinds `set`
    /// (each layer takes its pinned experts while they leave the CPU fewer experts to read than
    /// the split would): how many layers take each kind, and why.
    fn what_mixed(&self, moe: &[usize], set: &[ExpertSite], start: usize, end: usize) -> String {
        let count = |t: usize, kind: ExpertSite| {
            moe.iter().filter(|&&l| self.site(l, t).map(ExpertSite::kind) == Some(kind)).count()
        };
        let parts: Vec<String> = set
            .iter()
            .map(|&kind| {
                let (a, b) = (count(start, kind), count(end, kind));
                let n = if a == b { format!("{a}") } else { format!("{}–{}", a.min(b), a.max(b)) };
                format!("{}: {n} of {} MoE layers", self.site_words(kind, start, end), moe.len())
            })
            .collect();
        let mut why = vec!["each layer takes what leaves the CPU fewer experts to read"];
        for w in [&self.why_stream, &self.why_beside] {
            if !w.is_empty() {
                why.push(w);
            }
        }
        format!("{} ({})", parts.join("; "), why.join("; "))
    }

    /// What the MoE layers `moe` do over calls of `start..=end` tokens (one kind each), with the
    /// reasons.
    fn what(&self, moe: &[usize], start: usize, end: usize) -> String {
        let at_start: Vec<ExpertSite> = moe.iter().filter_map(|&l| self.site(l, start)).collect();
        // Groups of consecutive MoE layers with the same kind.
        let mut parts = Vec::new();
        let mut i = 0;
        while i < moe.len() {
            let kind = at_start[i].kind();
            let mut j = i;
            while j + 1 < moe.len() && at_start[j + 1].kind() == kind {
                j += 1;
            }
            let layers = if i == 0 && j + 1 == moe.len() {
                "every MoE layer".to_string()
            } else if i == j {
                format!("layer {}", moe[i])
            } else {
                format!("layers {}–{}", moe[i], moe[j])
            };
            parts.push(format!("{layers}: {}", self.site_words(kind, start, end)));
            i = j + 1;
        }
        let mut why: Vec<&str> = Vec::new();
        let kinds: Vec<ExpertSite> = at_start.iter().map(|s| s.kind()).collect();
        match &self.home {
            ExpertHome::Host { .. } => {
                if kinds.iter().any(|k| k.streams()) && !self.why_stream.is_empty() {
                    why.push(&self.why_stream);
                }
                if kinds.iter().any(|k| matches!(k, ExpertSite::Pinned | ExpertSite::Pool))
                    && !self.why_beside.is_empty()
                {
                    why.push(&self.why_beside);
                }
                if why.is_empty() {
                    why.push(&self.why_home);
                }
            }
            _ => why.push(&self.why_home),
        }
        format!("{} ({})", parts.join("; "), why.join("; "))
    }

    /// How a kind of site reads in the start line over calls of `start..=end` tokens.
    fn site_words(&self, kind: ExpertSite, start: usize, end: usize) -> String {
        match kind {
            ExpertSite::Cpu => "routed experts on the CPU".into(),
            ExpertSite::GpuResident => "routed experts resident on the GPU".into(),
            ExpertSite::GpuStreamed => "every routed expert streamed to the GPU".into(),
            ExpertSite::GpuStreamedChunks => "every routed expert streamed to the GPU in chunks".into(),
            ExpertSite::Pinned => "pinned experts on the GPU, the rest on the CPU".into(),
            ExpertSite::Pool => "the routed experts copied into the GPU's expert pool and run there".into(),
            ExpertSite::CpuAndPcie { .. } => {
                let g = match &self.home {
                    ExpertHome::Host { stream: Some(s), .. } => s.pcie_routes,
                    _ => 0,
                };
                format!("routed experts on the CPU, but the last {g} routes of each token on the GPU, which reads their experts over PCIe from the CPU's records")
            }
            ExpertSite::Split { .. } => {
                let (n, rule) = match &self.home {
                    ExpertHome::Host { stream: Some(s), .. } => (s.n_experts, *s),
                    _ => return "routed experts split between the GPU and the CPU".into(),
                };
                let (a, b) = (rule.gpu_experts(start), rule.gpu_experts(end));
                let share = if a == b { format!("{a}") } else { format!("{}–{}", a.min(b), a.max(b)) };
                format!("the first {share} of {n} experts streamed to the GPU, the rest on the CPU")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(min: usize, split: f64, chunked: bool) -> StreamRule {
        StreamRule { min_tokens: min, split: StreamSplit::Share(split), chunked, n_experts: 64, pcie_routes: 0 }
    }

    /// Layer 0 dense, layers 1–3 MoE.
    fn moe() -> Vec<bool> {
        vec![false, true, true, true]
    }

    #[test]
    fn dense_layers_have_no_site() {
        let p = PlacementPlan::new(ExpertHome::Cpu, moe(), "as asked");
        assert_eq!(p.site(0, 1), None);
        assert_eq!(p.site(4, 1), None);
        assert_eq!(p.site(1, 1), Some(ExpertSite::Cpu));
        let g = PlacementPlan::new(ExpertHome::Resident, moe(), "fits");
        assert_eq!(g.site(3, 9000), Some(ExpertSite::GpuResident));
        assert!(!g.streams(9000));
    }

    #[test]
    fn hybrid_streams_long_calls_and_splits_short_ones() {
        let home = ExpertHome::Host { stream: Some(stream(16, 0.5, false)), beside: Beside::Nothing };
        let p = PlacementPlan::new(home, moe(), "hybrid");
        assert_eq!(p.site(1, 1), Some(ExpertSite::Cpu));
        assert_eq!(p.site(1, 15), Some(ExpertSite::Cpu));
        assert_eq!(p.site(1, 16), Some(ExpertSite::Split { gpu: 32 }));
        let all = ExpertHome::Host { stream: Some(stream(16, 1.0, false)), beside: Beside::Nothing };
        let p = PlacementPlan::new(all, moe(), "hybrid");
        assert_eq!(p.site(2, 16), Some(ExpertSite::GpuStreamed));
        assert!(p.streams(16) && !p.streams(1));
        let chunks = ExpertHome::Host { stream: Some(stream(16, 0.3, true)), beside: Beside::Nothing };
        let p = PlacementPlan::new(chunks, moe(), "hybrid");
        assert_eq!(p.site(2, 16), Some(ExpertSite::GpuStreamedChunks));
        assert_eq!(p.site(2, 8), Some(ExpertSite::Cpu));
    }

    /// A PCIe share serves decode steps only, where nothing in VRAM does: pins and pools first.
    #[test]
    fn decode_steps_give_the_gpu_its_pcie_share() {
        let rule = StreamRule { pcie_routes: 3, ..stream(16, 0.5, false) };
        let p = PlacementPlan::new(ExpertHome::Host { stream: Some(rule), beside: Beside::Nothing }, moe(), "hybrid");
        assert_eq!(p.site(1, 1), Some(ExpertSite::CpuAndPcie { gpu: 3 }));
        assert_eq!(p.site(1, PCIE_MAX_TOKENS + 1), Some(ExpertSite::Cpu));
        assert_eq!(p.site(1, 16), Some(ExpertSite::Split { gpu: 32 }));
        assert!(!p.streams(1), "a PCIe share copies nothing");
        assert!(
            p.describe().iter().any(|l| l.contains("last 3 routes of each token on the GPU")),
            "{:?}",
            p.describe()
        );
        let pinned = Beside::Pinned { until: vec![0, 8, 0, 0] };
        let p = PlacementPlan::new(ExpertHome::Host { stream: Some(rule), beside: pinned }, moe(), "hybrid");
        assert_eq!(p.site(1, 1), Some(ExpertSite::Pinned));
        assert_eq!(p.site(2, 1), Some(ExpertSite::CpuAndPcie { gpu: 3 }));
        let pool = Beside::Pool(crate::placement::CacheStrategy::Lru);
        let p = PlacementPlan::new(ExpertHome::Host { stream: Some(rule), beside: pool }, moe(), "hybrid");
        assert_eq!(p.site(1, 1), Some(ExpertSite::Pool));
    }

    #[test]
    fn pins_serve_calls_below_their_layers_bound_and_streaming_takes_over() {
        // Layer 1 pinned up to 32 tokens, layer 2 up to 20, layer 3 nothing pinned.
        let beside = Beside::Pinned { until: vec![0, 32, 20, 0] };
        let home = ExpertHome::Host { stream: Some(stream(16, 0.5, false)), beside };
        let p = PlacementPlan::new(home, moe(), "hybrid");
        assert_eq!(p.site(1, 1), Some(ExpertSite::Pinned));
        assert_eq!(p.site(3, 1), Some(ExpertSite::Cpu));
        assert_eq!(p.site(2, 19), Some(ExpertSite::Pinned));
        assert_eq!(p.site(2, 20), Some(ExpertSite::Split { gpu: 32 }));
        assert_eq!(p.site(1, 31), Some(ExpertSite::Pinned));
        // Every expert streamed beats pins whatever their bound.
        let beside = Beside::Pinned { until: vec![0, usize::MAX, usize::MAX, 0] };
        let home = ExpertHome::Host { stream: Some(stream(16, 1.0, false)), beside };
        let p = PlacementPlan::new(home, moe(), "hybrid");
        assert_eq!(p.site(1, 16), Some(ExpertSite::GpuStreamed));
        assert_eq!(p.site(1, 15), Some(ExpertSite::Pinned));
    }

    #[test]
    fn a_pool_runs_every_call_that_does_not_stream_every_expert() {
        let home = ExpertHome::Host { stream: Some(stream(16, 0.5, false)), beside: Beside::Pool(CacheStrategy::Lru) };
        let p = PlacementPlan::new(home, moe(), "hybrid");
        assert_eq!(p.site(1, 1), Some(ExpertSite::Pool));
        assert_eq!(p.site(1, 64), Some(ExpertSite::Pool));
    }

    #[test]
    fn the_start_lines_give_one_line_per_decision_with_its_reason() {
        let beside = Beside::Pinned { until: vec![0, 16, 16, 0] };
        let home = ExpertHome::Host { stream: Some(stream(16, 1.0, false)), beside };
        let p = PlacementPlan::new(home, moe(), "as asked")
            .stream_because("GPU prefill is always on")
            .beside_because("12 of 192 experts pinned in the VRAM left");
        let lines = p.describe();
        assert_eq!(lines.len(), 2, "{lines:#?}");
        assert_eq!(
            lines[0],
            "placement: decode and calls of up to 15 tokens: layers 1–2: pinned experts on the GPU, the rest on \
             the CPU; layer 3: routed experts on the CPU (12 of 192 experts pinned in the VRAM left)"
        );
        assert_eq!(
            lines[1],
            "placement: calls of 16 tokens and more: every MoE layer: every routed expert streamed to the GPU \
             (GPU prefill is always on)"
        );
        // Layers that trade pins for the split at different lengths make one line.
        let beside = Beside::Pinned { until: vec![0, 20, 24, 30] };
        let home = ExpertHome::Host { stream: Some(stream(16, 0.5, false)), beside };
        let lines = PlacementPlan::new(home, moe(), "as asked").describe();
        assert_eq!(lines.len(), 3, "{lines:#?}");
        assert!(lines[0].starts_with("placement: decode and calls of up to 19 tokens: every MoE"), "{}", lines[0]);
        assert!(lines[1].starts_with("placement: calls of 20–29 tokens: "), "{}", lines[1]);
        assert!(
            lines[1].contains("pinned experts on the GPU, the rest on the CPU: 1–2 of 3 MoE layers"),
            "{}",
            lines[1]
        );
        assert!(
            lines[1].contains("the first 32 of 64 experts streamed to the GPU, the rest on the CPU: 1–2 of 3"),
            "{}",
            lines[1]
        );
        assert!(
            lines[2].starts_with("placement: calls of 30 tokens and more: every MoE layer: the first 32"),
            "{}",
            lines[2]
        );
        // A split over a range of lengths is one line, with its range of shares.
        let home = ExpertHome::Host { stream: Some(stream(4, 0.5, false)), beside: Beside::Nothing };
        let lines = PlacementPlan::new(home, moe(), "as asked").stream_because("measured").describe();
        assert_eq!(lines.len(), 2, "{lines:#?}");
        assert_eq!(
            lines[0],
            "placement: decode and calls of up to 3 tokens: every MoE layer: routed experts on the CPU (as asked)"
        );
        assert_eq!(
            lines[1],
            "placement: calls of 4 tokens and more: every MoE layer: the first 32 of 64 experts streamed to the GPU, \
             the rest on the CPU (measured)"
        );
        let cpu = PlacementPlan::new(ExpertHome::Cpu, moe(), "auto: no GPU in use");
        assert_eq!(
            cpu.describe(),
            vec!["placement: every call: every MoE layer: routed experts on the CPU (auto: no GPU in use)"]
        );
    }
}
