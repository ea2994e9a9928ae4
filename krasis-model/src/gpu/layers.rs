//! The GPU engine's ops of the forward walk ([`crate::model::walk`]): attention (MLA, GQA) and
//! feed-forward (dense MLP, MoE with shared experts; a hybrid MoE layer handed to the CPU on the
//! stream), each a sequence of krasis-gpu ops over the session's scratch buffers.

use krasis_gpu::cudarc::driver::{CudaView, CudaViewMut};
use krasis_gpu::flash_prefill::{FlashInput, FlashPrefillArgs, HeadsLayout, MMA_MAX_QK, MMA_MAX_V};
use krasis_gpu::linear::{GemmContext, GpuLinear};
use krasis_gpu::moe::GpuExperts;
use krasis_gpu::router::GpuRouter;
use krasis_gpu::{DeviceBuffer, GpuDevice, GqaShape, RopeLayout, RopePairing, RowsView, SwiGluLayout};

use super::host_experts::{HandoffShape, HostStaging, HostWork};
use super::placed::Site;
use super::profile::Part;
use super::session::{grow, KvRows, StepIo};
use crate::cpu::experts::LayerExperts;
use crate::error::{ModelError, Result};
use crate::model::build::{DeltaNetParts, GqaParts, MlaParts, MoeWeights, WeightKinds};
use crate::model::walk::{LayerOps, NextMoe, NormAt};
use crate::spec::{AttentionSpec, MlaDims, ModelSpec};

/// The types the GPU engine holds its weights in (every dense part in VRAM; the routed experts
/// resident, or on the host behind a CPU backend).
pub(crate) struct GpuKinds;

impl WeightKinds for GpuKinds {
    type Linear = GpuLinear;
    type Mlp = GpuMlp;
    type Vector = DeviceBuffer<u16>;
    type Embedding = DeviceBuffer<u16>;
    type KvB = GpuKvB;
    type Router = GpuRouter;
    type Experts = GpuExpertBackend;
}

/// What every layer of one forward call shares.
pub(crate) struct Ctx<'a> {
    pub dev: &'a GpuDevice,
    pub spec: &'a ModelSpec,
    pub gemm: &'a GemmContext,
    pub cos: &'a DeviceBuffer<f32>,
    pub sin: &'a DeviceBuffer<f32>,
    pub max_pos: usize,
    pub rope_half: usize,
    pub pairing: RopePairing,
    pub eps: f32,
    /// Tokens in this call.
    pub t: usize,
    /// Position of the first of them (tokens already cached).
    pub pos: usize,
    /// Attention in the decode form (absorbed MLA / split-KV GQA).
    pub decode: bool,
    /// The precise mode ([`super::GpuPrecision::F32`]): attention over f32 q, k and v (the
    /// prefill form, every call).
    pub precise: bool,
    /// A row-invariant call ([`super::GpuOptions::invariant_prefill`]): attention reads every
    /// position's keys through the KV cache, this call's own too, so that a position reads the
    /// same rounded rows whichever call wrote them (the GEMMs' fixed rows are set on `gemm`).
    pub invariant: bool,
    /// The placement plan and its resources: who runs each MoE layer's routed experts in this
    /// call ([`super::placed::Placed::site`]).
    pub placed: &'a super::placed::Placed,
    /// Whether this call streams experts to the GPU in some layer (the plan's answer for `t`).
    pub streams: bool,
    /// While recording a heatmap: the device counts `[layers × experts]` and `experts`.
    pub heat: Option<(u64, usize)>,
}

impl Ctx<'_> {
    /// Counts the `n` routes at `ids` (device-readable) in layer `l`'s heatmap row, while
    /// recording.
    fn count_routes(&self, router: &GpuRouter, l: usize, ids: u64, n: usize) -> Result<()> {
        if let Some((counts, experts)) = self.heat {
            let row = counts + (l * experts * std::mem::size_of::<u64>()) as u64;
            // SAFETY: the routes were written by the stream work before this launch and nothing
            // writes them until the layer's experts have read them; the row is the layer's
            // `experts` counters, written only by counting launches.
            unsafe { router.count(self.dev, ids, n, row) }?;
        }
        Ok(())
    }
}

/// KV cache geometry `(planes, row, fp8 scale group)` of a model: MLA keeps one latent+rope row
/// per token (the rope part gets its own FP8 scale), GQA a K and a V row (one scale per head).
pub(crate) fn kv_geometry(spec: &ModelSpec) -> (usize, usize, usize) {
    match spec.attention {
        AttentionSpec::Mla { kv_lora_rank, qk_rope_head_dim, .. } => {
            (1, kv_lora_rank + qk_rope_head_dim, gcd(kv_lora_rank, qk_rope_head_dim))
        }
        AttentionSpec::Gqa { kv_heads, head_dim, .. } => (2, kv_heads * head_dim, head_dim),
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

pub(crate) struct GpuMlp {
    /// Gate rows then up rows, `[2·inter, hidden]`.
    pub gate_up: GpuLinear,
    pub down: GpuLinear,
}

impl GpuMlp {
    /// Grows the scratch slots [`GpuMlp::forward`] writes for `t` rows, and the GEMM context's
    /// side lane for its GEMMs (allocations stay on the compute stream: done before work moves
    /// to the side stream).
    fn reserve(&self, c: &Ctx, s: &mut StepIo, t: usize) -> Result<()> {
        let (inter, hidden) = (self.gate_up.rows() / 2, self.down.rows());
        let [gate_up_slot, _, act_slot, shared_out_slot, ..] = &mut s.scratch.f;
        grow(c.dev, gate_up_slot, t * 2 * inter, "mlp gate+up")?;
        grow(c.dev, act_slot, t * inter, "mlp activation")?;
        grow(c.dev, shared_out_slot, t * hidden, "shared expert output")?;
        let gemm = self.gate_up.gemm_scratch_bytes(c.gemm, t).max(self.down.gemm_scratch_bytes(c.gemm, t));
        if gemm > 0 {
            c.gemm.reserve_side(c.dev, gemm)?;
        }
        Ok(())
    }

    /// `out = down(silu(gate(x)) · up(x))` for `x` the session's `xn`, into `y` (`to_y`) or f32
    /// scratch slot 3 (the shared expert's output); slots 0 and 2 are temporaries.
    fn forward(&self, c: &Ctx, s: &mut StepIo, to_y: bool) -> Result<()> {
        let t = c.t;
        let inter = self.gate_up.rows() / 2;
        let hidden = self.down.rows();
        let sc = &mut *s.scratch;
        let [gate_up_slot, _, act_slot, shared_out_slot, ..] = &mut sc.f;
        let gu = grow(c.dev, gate_up_slot, t * 2 * inter, "mlp gate+up")?;
        let a = grow(c.dev, act_slot, t * inter, "mlp activation")?;
        let xn = sc.xn.slice().slice(..t * hidden);
        self.gate_up.forward(c.dev, c.gemm, &xn, t, &mut gu.slice_mut().slice_mut(..t * 2 * inter))?;
        let gu = gu.slice().slice(..t * 2 * inter);
        c.dev.silu_mul_f32(
            &gu,
            &gu,
            inter,
            &mut a.slice_mut().slice_mut(..t * inter),
            &SwiGluLayout::fused(t, inter),
        )?;
        let a = a.slice().slice(..t * inter);
        if to_y {
            self.down.forward(c.dev, c.gemm, &a, t, &mut sc.y.slice_mut().slice_mut(..t * hidden))?;
        } else {
            let o = grow(c.dev, shared_out_slot, t * hidden, "shared expert output")?;
            self.down.forward(c.dev, c.gemm, &a, t, &mut o.slice_mut().slice_mut(..t * hidden))?;
        }
        Ok(())
    }
}

/// A MoE layer's shared expert on the GPU, with its sigmoid gate when it has one.
#[derive(Clone, Copy)]
pub(crate) struct SharedExpert<'w> {
    pub mlp: &'w GpuMlp,
    /// `shared_expert_gate` (BF16 `[hidden]`): the output is scaled per token by σ(xn · gate).
    pub gate: Option<&'w DeviceBuffer<u16>>,
}

impl SharedExpert<'_> {
    fn reserve(&self, c: &Ctx, s: &mut StepIo, t: usize) -> Result<()> {
        self.mlp.reserve(c, s, t)
    }

    /// [`GpuMlp::forward`] into `y` (`to_y`) or f32 scratch slot 3, then the gate's scaling of
    /// that output (on the same stream: inside [`GpuDevice::on_side_stream`] too).
    fn forward(&self, c: &Ctx, s: &mut StepIo, to_y: bool) -> Result<()> {
        self.mlp.forward(c, s, to_y)?;
        let Some(gate) = self.gate else { return Ok(()) };
        let (t, h) = (c.t, c.spec.hidden_size);
        let sc = &mut *s.scratch;
        let out = if to_y { &mut sc.y } else { sc.f[3].as_mut().expect("written by the shared expert") };
        let xn = sc.xn.slice().slice(..t * h);
        c.dev.sigmoid_gate_rows_f32(&mut out.slice_mut().slice_mut(..t * h), h, &xn, gate, t)?;
        Ok(())
    }
}

/// MLA's `kv_b_proj` on the GPU: as a linear (prefill's expansion of the latent,
/// `--kv-b-proj-quant`) and in BF16 for the absorbed decode form.
pub(crate) struct GpuKvB {
    pub linear: GpuLinear,
    pub bf16: DeviceBuffer<u16>,
}

/// One MLA layer on the GPU: its weights and the model's dimensions.
struct GpuMla<'w> {
    dims: MlaDims,
    scale: f32,
    w: &'w MlaParts<GpuLinear, DeviceBuffer<u16>, GpuKvB>,
}

/// One GQA layer on the GPU: its weights and the model's dimensions.
struct GpuGqa<'w> {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    /// Gated attention (Qwen3-Next): `q_proj` yields per head the query and its gate; the output
    /// is divided by `1 + e^−gate` before `o_proj` ([`super::deltanet::gated_query`]).
    output_gate: bool,
    /// The layer's sliding window (gpt-oss's sliding layers), `None` for full attention; the
    /// sinks are in `w`.
    window: Option<usize>,
    w: &'w GqaParts<GpuLinear, DeviceBuffer<u16>>,
}

/// Where a GPU MoE layer's routed experts run: its expert backend.
pub(crate) enum GpuExpertBackend {
    /// Every expert in VRAM (BF16), through the grouped / GEMV MoE kernels.
    Resident(Box<GpuExperts>),
    /// On the host (the hybrid engine): a CPU expert backend behind the hand-off of
    /// [`super::host_experts`].
    Host(std::sync::Arc<dyn LayerExperts>),
}

impl GpuExpertBackend {
    /// The host expert backend, when the routed experts run on the CPU (hybrid).
    pub fn host(&self) -> Option<&std::sync::Arc<dyn LayerExperts>> {
        match self {
            GpuExpertBackend::Host(e) => Some(e),
            GpuExpertBackend::Resident(_) => None,
        }
    }
}

/// The GPU engine's step through the forward walk: one call's context, the session's buffers
/// and the hybrid hand-off staging.
pub(crate) struct GpuStep<'c, 'a, 's, 'io, 'h> {
    pub c: &'c Ctx<'a>,
    pub s: &'s mut StepIo<'io>,
    pub host: &'h mut HostStaging,
}

impl LayerOps<GpuKinds> for GpuStep<'_, '_, '_, '_, '_> {
    /// `x += y` (when `add`; with the CPU experts' output of a host MoE layer, see
    /// [`residual_norm`]), `xn = rmsnorm(x) · w`.
    fn residual_norm(&mut self, w: &DeviceBuffer<u16>, add: bool, _at: NormAt) -> Result<()> {
        let c = self.c;
        let h = c.spec.hidden_size;
        residual_norm(c.dev, self.s, w, add, c.t * h, h, c.eps, self.host)
    }

    fn mla(&mut self, l: usize, w: &MlaParts<GpuLinear, DeviceBuffer<u16>, GpuKvB>) -> Result<()> {
        let c = self.c;
        let dims = c.spec.attention.mla_dims().expect("the walk gives MLA weights to an MLA model");
        GpuMla { dims, scale: c.spec.softmax_scale, w }.forward(c, l, self.s)?;
        self.s.mark(c.dev, Part::Attention)
    }

    fn gated_delta_net(&mut self, l: usize, w: &DeltaNetParts<GpuLinear, DeviceBuffer<u16>>) -> Result<()> {
        let c = self.c;
        let spec = c.spec.delta_net.expect("the walk gives DeltaNet weights to a DeltaNet model");
        super::deltanet::GpuDeltaNet { spec, eps: c.eps, w }.forward(c, l, self.s)?;
        self.s.mark(c.dev, Part::Attention)
    }

    fn gqa(&mut self, l: usize, w: &GqaParts<GpuLinear, DeviceBuffer<u16>>) -> Result<()> {
        let c = self.c;
        let AttentionSpec::Gqa { heads, kv_heads, head_dim, output_gate, .. } = c.spec.attention else {
            unreachable!("the walk gives GQA weights to a GQA model")
        };
        let window = c.spec.window(l);
        // The KV cache holds the attention layers only (`super::deltanet::kv_layer`).
        let l = super::deltanet::kv_layer(c.spec, l);
        let scale = c.spec.softmax_scale;
        GpuGqa { heads, kv_heads, head_dim, scale, output_gate, window, w }.forward(c, l, self.s)?;
        self.s.mark(c.dev, Part::Attention)
    }

    fn mlp(&mut self, _l: usize, w: &GpuMlp) -> Result<()> {
        w.forward(self.c, self.s, true)?;
        self.s.mark(self.c.dev, Part::Ffn)
    }

    fn moe(&mut self, l: usize, w: &MoeWeights<GpuKinds>, next: Option<NextMoe<'_, GpuKinds>>) -> Result<()> {
        let (c, s, host) = (self.c, &mut *self.s, &mut *self.host);
        let n = c.t * c.spec.hidden_size;
        let MoeWeights { router, experts, shared, shared_gate } = w;
        let shared = shared.as_ref().map(|mlp| SharedExpert { mlp, gate: shared_gate.as_ref() });
        let (t, k) = (c.t, router.config().top_k);
        let site = c.placed.site(l, t)?;
        match site {
            Site::Resident => {
                let GpuExpertBackend::Resident(experts) = experts else {
                    return Err(ModelError::Invalid(format!("placement: layer {l}'s experts are not resident")));
                };
                gpu_moe(c, s, GpuRoutes::Router(router, l), experts, k, shared, n)?
            }
            Site::StreamedChunks(streamer) => gpu_moe_chunked(c, s, router, l, streamer, k, shared, n)?,
            Site::Streamed(streamer) => streamer.run_layer(c.dev, l, router.n_experts(), |experts| {
                gpu_moe(c, s, GpuRoutes::Router(router, l), experts, k, shared, n)
            })?,
            Site::Pool(pool) => {
                let seq = host.send(c.dev, router, &s.scratch.xn.slice().slice(..n), t, false)?;
                c.count_routes(router, l, host.published_ids(), t * k)?;
                // The launcher waits for the routes, enqueues the missing experts' copies
                // and makes the stream wait for them; then the GPU runs every route.
                host.fetch_into_pool(c.dev, pool, l, seq, t * k)?;
                let map = pool.device_map(c.dev)?;
                let experts = pool.experts();
                let routes = GpuRoutes::Published { host: &*host, present: experts.n_experts(), map: Some(&*map) };
                gpu_moe(c, s, routes, &experts, k, shared, n)?;
            }
            Site::Cpu | Site::Split(..) | Site::Pinned(_) | Site::CpuAndPcie(..) => {
                let shape = HandoffShape { t, hidden: c.spec.hidden_size, k };
                let seq = host.send(c.dev, router, &s.scratch.xn.slice().slice(..n), t, true)?;
                c.count_routes(router, l, host.published_ids(), t * k)?;
                // The GPU's share of a split layer (on the routes the CPU got) and the
                // shared expert go into y while the CPU computes the routed ones, whose
                // sum is then added to y. The GPU's share: the layer's pinned experts, or the
                // streamed first ones.
                let (mut cpu_from, mut cpu_skips) = (0, None);
                match site {
                    Site::Pinned(hl) => {
                        let routes = GpuRoutes::Published { host: &*host, present: hl.present, map: Some(&hl.map) };
                        gpu_moe(c, s, routes, &hl.experts, k, shared, n)?;
                        cpu_skips = Some(hl.on_gpu.clone());
                    }
                    Site::Split(streamer, present) => {
                        let routes = GpuRoutes::Published { host: &*host, present, map: None };
                        streamer
                            .run_layer(c.dev, l, present, |experts| gpu_moe(c, s, routes, experts, k, shared, n))?;
                        cpu_from = present;
                    }
                    _ => {
                        if let Some(sh) = shared {
                            sh.forward(c, s, true)?;
                        }
                    }
                }
                // y so far: the shared expert's part and a split layer's GPU share.
                let y_ready = shared.is_some() || cpu_from > 0 || cpu_skips.is_some();
                // The next layer's routes, predicted for its CPU experts' prefetch: enqueued
                // before a PCIe share, whose long read would leave the prediction too late for
                // the CPU to use.
                let next_host = next.filter(|nx| nx.moe.experts.host().is_some());
                if let Some(NextMoe { moe: MoeWeights { router, .. }, norm, .. }) = next_host {
                    let sc = &*s.scratch;
                    let y = y_ready.then(|| sc.y.slice().slice(..n));
                    host.predict(c.dev, router, norm, &sc.x.slice().slice(..n), y.as_ref(), c.eps, seq)?;
                }
                // Decode's PCIe share: the GPU runs the last routes of each token, adding to y
                // (or writing it, with no shared expert).
                let gpu_routes = match site {
                    Site::CpuAndPcie(streamer, g) => {
                        let routes = (host.published_ids(), host.published_weights());
                        let sc = &mut *s.scratch;
                        let xn = sc.xn.slice().slice(..n);
                        let mut y = sc.y.slice_mut().slice_mut(..n);
                        let h = &mut sc.pcie_h;
                        streamer.run_pcie_share(c.dev, l, &xn, t, routes, (k, g), h, &mut y, y_ready)?;
                        g
                    }
                    _ => 0,
                };
                let y_counts = y_ready || gpu_routes > 0;
                // What the CPU will read of the next layer, for its prefetch: not its pinned
                // experts, nor its PCIe share's routes.
                let (next_skips, next_gpu_routes) = match next_host.map(|nx| c.placed.site(nx.layer, t)).transpose()? {
                    Some(Site::Pinned(hl)) => (Some(hl.on_gpu.clone()), 0),
                    Some(Site::CpuAndPcie(_, g)) => (None, g),
                    _ => (None, 0),
                };
                let n_experts = router.n_experts();
                let work = HostWork {
                    seq,
                    layer: l,
                    n_experts,
                    cpu_from,
                    cpu_skips,
                    next_skips,
                    gpu_routes,
                    next_gpu_routes,
                    shape,
                };
                host.receive(c.dev, work, y_counts)?;
            }
        }
        s.mark(c.dev, Part::Ffn)
    }
}

/// Where a GPU MoE step's routes come from, and which of the layer's experts it runs.
#[derive(Clone, Copy)]
enum GpuRoutes<'a> {
    /// The layer's router (of layer `.1`), every expert.
    Router(&'a GpuRouter, usize),
    /// The routes published to the host for a split layer's CPU share
    /// ([`HostStaging::routes_to_device`]), renumbered on the device with `map` when given; the
    /// GPU runs experts `[0, present)` (of the renumbered ids).
    Published { host: &'a HostStaging, present: usize, map: Option<&'a DeviceBuffer<i32>> },
}

/// A MoE layer on the GPU with `experts` in VRAM (resident, or a streamed slot): the routes into
/// the scratch, the routed experts (all, or a split layer's GPU share) into `y`, plus the shared
/// expert.
fn gpu_moe(
    c: &Ctx,
    s: &mut StepIo,
    routes: GpuRoutes<'_>,
    experts: &GpuExperts,
    k: usize,
    shared: Option<SharedExpert<'_>>,
    n: usize,
) -> Result<()> {
    let t = c.t;
    // The shared expert runs on the side stream beside the router and the routed experts. In a
    // decode step both chains are a few latency-bound launches at one token; in a prefill with
    // the experts resident the shared expert's GEMMs fill the SMs the routing kernels and the
    // grouped tiles' tails leave idle (KRASIS_SHARED_BESIDE=0: after them, for A/B). A streamed
    // layer's prefill waits on its copies instead, in a budget with no room for the side lane's
    // GEMM scratch (measured: a 10K prompt in 6 GiB ran out of VRAM). A resident layer in a tight
    // budget keeps it after them too (SHARED_BESIDE_MIN_FREE_BYTES).
    let prefill_beside =
        !c.streams && shared_beside_prefill() && c.dev.budget().remaining() >= SHARED_BESIDE_MIN_FREE_BYTES;
    let beside = match shared {
        Some(sh) if matches!(routes, GpuRoutes::Router(..)) && (c.decode || prefill_beside) => Some(sh),
        _ => None,
    };
    if let Some(sh) = beside {
        sh.reserve(c, s, t)?;
        c.dev.on_side_stream(|| sh.forward(c, s, false))?;
    }
    let present = match routes {
        GpuRoutes::Router(router, l) => {
            router_routes(c, s, router, l, k, n)?;
            experts.n_experts()
        }
        GpuRoutes::Published { host, present, map } => {
            let sc = &mut *s.scratch;
            let ids = grow(c.dev, &mut sc.route_ids, t * k, "routed expert ids")?;
            let w = grow(c.dev, &mut sc.route_w, t * k, "routing weights")?;
            let (mut ids_out, mut w_out) = (ids.slice_mut().slice_mut(..t * k), w.slice_mut().slice_mut(..t * k));
            host.routes_to_device(c.dev, t * k, &mut ids_out, &mut w_out)?;
            if let Some(map) = map {
                c.dev.remap_ids_i32(&mut ids_out, map, t * k)?;
            }
            present
        }
    };
    let sc = &mut *s.scratch;
    let (ids, w) = (sc.route_ids.as_ref().expect("grown"), sc.route_w.as_ref().expect("grown"));
    let xn = sc.xn.slice().slice(..n);
    experts.forward_part(
        c.dev,
        c.gemm,
        &xn,
        t,
        &ids.slice().slice(..t * k),
        &w.slice().slice(..t * k),
        k,
        present,
        &mut sc.y.slice_mut().slice_mut(..n),
    )?;
    if let Some(sh) = shared {
        if beside.is_some() {
            c.dev.join_side_stream()?;
        } else {
            sh.forward(c, s, false)?;
        }
        add_shared_output(c, s, n)?;
    }
    Ok(())
}

/// The layer's router over the `c.t` rows of `xn`: `k` routes each into the scratch's route
/// buffers, counted in layer `l`'s heatmap row while recording.
fn router_routes(c: &Ctx, s: &mut StepIo, router: &GpuRouter, l: usize, k: usize, n: usize) -> Result<()> {
    let t = c.t;
    let sc = &mut *s.scratch;
    let ids = grow(c.dev, &mut sc.route_ids, t * k, "routed expert ids")?;
    let w = grow(c.dev, &mut sc.route_w, t * k, "routing weights")?;
    let xn = sc.xn.slice().slice(..n);
    let (mut ids_out, mut w_out) = (ids.slice_mut().slice_mut(..t * k), w.slice_mut().slice_mut(..t * k));
    router.forward(c.dev, &xn, t, &mut ids_out, &mut w_out)?;
    let (ids_p, _g) = krasis_gpu::cudarc::driver::DevicePtr::device_ptr(&ids_out, c.dev.stream());
    c.count_routes(router, l, ids_p, t * k)
}

/// VRAM budget a prefill must have left for its shared expert to run beside the routed experts:
/// the side lane's cuBLAS workspace (32 MiB) and GEMM scratch (58 MB at a 10K-token V2-Lite
/// prompt) with room to spare for what the prefill grows after them; below it the shared expert
/// runs after the routed experts and needs no side lane.
const SHARED_BESIDE_MIN_FREE_BYTES: u64 = 1 << 30;

/// Whether a prefill's shared expert runs beside the routed experts (the default; set
/// `KRASIS_SHARED_BESIDE=0` to run it after them).
fn shared_beside_prefill() -> bool {
    static BESIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *BESIDE.get_or_init(|| krasis_core::knobs::knobs().gpu_shared_beside)
}

/// `y += ` the shared expert's output (its MLP left it in the scratch's `f[3]`).
fn add_shared_output(c: &Ctx, s: &mut StepIo, n: usize) -> Result<()> {
    let sc = &mut *s.scratch;
    let o = sc.f[3].as_ref().expect("written by the shared expert");
    c.dev.add_inplace_f32(&mut sc.y.slice_mut().slice_mut(..n), &o.slice().slice(..n), n)?;
    Ok(())
}

/// A MoE layer whose experts stream in chunks ([`super::expert_stream::ExpertStreamer::run_layer_chunks`]):
/// the router's routes, then per chunk the routes renumbered so the chunk's experts come first
/// and the others are left out, that chunk's part into `y` (the first) or added to it, then the
/// shared expert. Each pair's product is computed as for resident experts; only the top-k sum of
/// a token is taken in chunk order.
#[allow(clippy::too_many_arguments)]
fn gpu_moe_chunked(
    c: &Ctx,
    s: &mut StepIo,
    router: &GpuRouter,
    l: usize,
    streamer: &super::expert_stream::ExpertStreamer,
    k: usize,
    shared: Option<SharedExpert<'_>>,
    n: usize,
) -> Result<()> {
    let t = c.t;
    router_routes(c, s, router, l, k, n)?;
    grow(c.dev, &mut s.scratch.chunk_ids, t * k, "chunk expert ids")?;
    grow(c.dev, &mut s.scratch.chunk_out, n, "chunk expert output")?;
    streamer.run_layer_chunks(c.dev, l, |experts, first, count, map| {
        let sc = &mut *s.scratch;
        let (ids, w) = (sc.route_ids.as_ref().expect("grown"), sc.route_w.as_ref().expect("grown"));
        let chunk_ids = sc.chunk_ids.as_mut().expect("grown");
        let mut cid = chunk_ids.slice_mut().slice_mut(..t * k);
        c.dev.copy_device(&ids.slice().slice(..t * k), &mut cid)?;
        c.dev.remap_ids_i32(&mut cid, map, t * k)?;
        let xn = sc.xn.slice().slice(..n);
        let out = if first == 0 { &mut sc.y } else { sc.chunk_out.as_mut().expect("grown") };
        experts.forward_part(
            c.dev,
            c.gemm,
            &xn,
            t,
            &chunk_ids.slice().slice(..t * k),
            &w.slice().slice(..t * k),
            k,
            count,
            &mut out.slice_mut().slice_mut(..n),
        )?;
        if first > 0 {
            let part = sc.chunk_out.as_ref().expect("grown");
            c.dev.add_inplace_f32(&mut sc.y.slice_mut().slice_mut(..n), &part.slice().slice(..n), n)?;
        }
        Ok(())
    })?;
    if let Some(sh) = shared {
        sh.forward(c, s, false)?;
        add_shared_output(c, s, n)?;
    }
    Ok(())
}

/// The residual norm between layers: `x += y` (when `add`), plus the CPU experts' output when the
/// last FFN was a host MoE layer (then `y` counts only if it holds the shared expert's part), then
/// `xn = rmsnorm(x) · w`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn residual_norm(
    dev: &GpuDevice,
    s: &mut StepIo,
    w: &DeviceBuffer<u16>,
    add: bool,
    n: usize,
    hidden: usize,
    eps: f32,
    host: &mut HostStaging,
) -> Result<()> {
    let sc = &mut *s.scratch;
    let mut x = sc.x.slice_mut().slice_mut(..n);
    let y = sc.y.slice().slice(..n);
    let mut xn = sc.xn.slice_mut().slice_mut(..n);
    let (use_y, from_host) = match host.take_pending() {
        Some((out, y_holds_shared)) => (y_holds_shared, Some(out)),
        None => (add, None),
    };
    let delta: Option<&dyn krasis_gpu::cudarc::driver::DevicePtr<f32>> = if use_y { Some(&y) } else { None };
    dev.rmsnorm_residual(&mut x, delta, None, from_host, w, Some(&mut xn), None, hidden, eps)?;
    Ok(())
}

fn rope_layout(c: &Ctx, heads: usize, token_stride: usize, head_stride: usize, offset: usize) -> RopeLayout {
    RopeLayout {
        n_tokens: c.t,
        n_heads: heads,
        token_stride,
        head_stride,
        rot_offset: offset,
        rot_dim: 2 * c.rope_half,
        pairing: c.pairing,
    }
}

impl GpuMla<'_> {
    fn forward(&self, c: &Ctx, l: usize, s: &mut StepIo) -> Result<()> {
        let MlaDims { heads: hh, nope, rope: rd, latent: lat, v_dim: vd } = self.dims;
        let t = c.t;
        let hidden = self.w.o.rows();
        let qk = nope + rd;
        let row = lat + rd;
        let dev = c.dev;
        let sc = &mut *s.scratch;
        let [q_slot, q_a_slot, kv_a_slot, absorbed_q_or_kv_slot, latent_out_slot, out_slot, cached_rows_slot, latent_slot] =
            &mut sc.f;
        let xn = sc.xn.slice().slice(..t * hidden);

        // q (with the optional LoRA), and the latent row from kv_a; without the LoRA q and kv_a
        // read the same x, so a decode step computes both in one GEMV launch.
        let q = grow(dev, q_slot, t * hh * qk, "mla q")?;
        let kva = grow(dev, kv_a_slot, t * row, "mla kv_a")?;
        match &self.w.q_a {
            Some((q_a, norm)) => {
                let r = q_a.rows();
                let qa = grow(dev, q_a_slot, t * r, "mla q_a")?;
                q_a.forward(dev, c.gemm, &xn, t, &mut qa.slice_mut().slice_mut(..t * r))?;
                dev.rmsnorm_rows_inplace(qa, RowsView::contiguous(t, r), norm, c.eps)?;
                self.w.q_b.forward(
                    dev,
                    c.gemm,
                    &qa.slice().slice(..t * r),
                    t,
                    &mut q.slice_mut().slice_mut(..t * hh * qk),
                )?;
            }
            None => GpuLinear::forward_group(
                dev,
                c.gemm,
                &xn,
                t,
                &mut [
                    (&self.w.q_b, &mut q.slice_mut().slice_mut(..t * hh * qk)),
                    (&self.w.kv_a, &mut kva.slice_mut().slice_mut(..t * row)),
                ],
            )?,
        }
        if self.w.q_a.is_some() {
            self.w.kv_a.forward(dev, c.gemm, &xn, t, &mut kva.slice_mut().slice_mut(..t * row))?;
        }

        // RoPE on q's heads and on the latent row's rope part, RMSNorm on its latent part (one
        // launch) → cache (in the same launch for one sequence's BF16 cache).
        let cache_out = match s.kv {
            KvRows::Seq(kv) => Some((kv, l, c.pos)),
            KvRows::PerRow(_) => None,
        };
        let cached = dev.mla_rope_norm(
            q,
            &rope_layout(c, hh, hh * qk, qk, nope),
            kva,
            &rope_layout(c, 1, row, row, lat),
            &self.w.kv_a_norm,
            c.eps,
            &sc.positions.slice().slice(..t),
            c.cos,
            c.sin,
            c.max_pos,
            cache_out,
        )?;
        if !cached {
            s.kv.for_each_seq(c, |kv, pos, r0, n| {
                Ok(kv.write(dev, l, 0, pos, n, &kva.slice().slice(r0 * row..(r0 + n) * row))?)
            })?;
        }

        let o = grow(dev, out_slot, t * hh * vd, "mla attention output")?;
        if c.decode {
            // Absorbed: q_lat = W_UKᵀ q_nope per head, attend over the latent rows, W_UV after.
            let q_abs = grow(dev, absorbed_q_or_kv_slot, t * hh * row, "mla absorbed q")?;
            dev.mla_absorb_q(
                &self.w.kv_b.bf16,
                &q.slice().slice(..t * hh * qk),
                t,
                hh,
                nope,
                rd,
                vd,
                lat,
                &mut q_abs.slice_mut().slice_mut(..t * hh * row),
            )?;
            let o_lat = grow(dev, latent_out_slot, t * hh * lat, "mla latent output")?;
            let ws = &mut *s.ws;
            s.kv.for_each_seq(c, |kv, pos, r0, n| {
                Ok(dev.mla_decode_attention(
                    kv,
                    l,
                    &q_abs.slice().slice(r0 * hh * row..(r0 + n) * hh * row),
                    n,
                    hh,
                    lat,
                    pos,
                    self.scale,
                    &mut o_lat.slice_mut().slice_mut(r0 * hh * lat..(r0 + n) * hh * lat),
                    ws,
                )?)
            })?;
            dev.mla_apply_uv(
                &self.w.kv_b.bf16,
                &o_lat.slice().slice(..t * hh * lat),
                t,
                hh,
                nope,
                vd,
                lat,
                &mut o.slice_mut().slice_mut(..t * hh * vd),
            )?;
        } else {
            // Expanded: the whole latent cache through kv_b into per-head K_nope/V, then flash.
            // Past positions from the cache (BF16 or FP8), this call's own positions from the
            // fresh f32 rows: a prompt's tokens attend to each other at full precision and only
            // what later calls read goes through the cache's rounding.
            let kv = s.kv.seq("MLA prefill attention")?;
            let n_kv = c.pos + t;
            let lat_rows = grow(dev, cached_rows_slot, n_kv * row, "mla cached latent rows")?;
            // A row-invariant call reads its own rows back through the cache as well.
            let from_cache = if c.invariant { n_kv } else { c.pos };
            if from_cache > 0 {
                kv.read_f32(dev, l, 0, 0, from_cache, &mut lat_rows.slice_mut().slice_mut(..from_cache * row))?;
            }
            if !c.invariant {
                dev.copy_rows_f32(
                    kva,
                    RowsView::contiguous(t, row),
                    lat_rows,
                    RowsView { rows: t, cols: row, stride: row, offset: c.pos * row },
                )?;
            }
            let cmat = grow(dev, latent_slot, n_kv * lat, "mla latent")?;
            dev.copy_rows_f32(
                lat_rows,
                RowsView { rows: n_kv, cols: lat, stride: row, offset: 0 },
                cmat,
                RowsView::contiguous(n_kv, lat),
            )?;
            let kvb_cols = hh * (nope + vd);
            let args = FlashPrefillArgs {
                n_q: t,
                n_kv,
                q_start: c.pos,
                heads: hh,
                kv_heads: hh,
                scale: self.scale,
                q_a: HeadsLayout { token_stride: hh * qk, head_stride: qk, dim: nope },
                q_b: HeadsLayout { token_stride: hh * qk, head_stride: qk, dim: rd },
                k_a: HeadsLayout { token_stride: kvb_cols, head_stride: nope + vd, dim: nope },
                k_b: HeadsLayout { token_stride: rd, head_stride: 0, dim: rd },
                v: HeadsLayout { token_stride: kvb_cols, head_stride: nope + vd, dim: vd },
                out: HeadsLayout { token_stride: hh * vd, head_stride: vd, dim: vd },
            };
            let latent = cmat.slice().slice(..n_kv * lat);
            let kv_b = &self.w.kv_b.linear;
            if c.precise {
                // Everything in f32: the rope keys, the expanded K/V and q as they are.
                let kpe = grow(dev, latent_out_slot, n_kv * rd, "mla rope keys")?;
                dev.copy_rows_f32(
                    lat_rows,
                    RowsView { rows: n_kv, cols: rd, stride: row, offset: lat },
                    kpe,
                    RowsView::contiguous(n_kv, rd),
                )?;
                let kvb = grow(dev, absorbed_q_or_kv_slot, n_kv * kvb_cols, "mla expanded k/v")?;
                kv_b.forward(dev, c.gemm, &latent, n_kv, &mut kvb.slice_mut().slice_mut(..n_kv * kvb_cols))?;
                dev.flash_prefill_f32(
                    &args,
                    &krasis_gpu::AttnOptions::default(),
                    &q.slice().slice(..t * hh * qk),
                    Some(&q.slice().slice(nope..t * hh * qk)),
                    &kvb.slice().slice(..n_kv * kvb_cols),
                    Some(&kpe.slice().slice(..n_kv * rd)),
                    &kvb.slice().slice(nope..n_kv * kvb_cols),
                    &mut o.slice_mut().slice_mut(..t * hh * vd),
                )?;
                return self.project_out(c, &mut sc.y, o, t * hh * vd);
            }
            let [rope_key_slot, kv16_slot, q16_slot, ..] = &mut sc.b;
            let kpe = grow(dev, rope_key_slot, n_kv * rd, "mla rope keys (bf16)")?;
            dev.copy_rows_to_bf16(
                lat_rows,
                RowsView { rows: n_kv, cols: rd, stride: row, offset: lat },
                kpe,
                RowsView::contiguous(n_kv, rd),
            )?;
            let kvb16 = grow(dev, kv16_slot, n_kv * kvb_cols, "mla expanded k/v (bf16)")?;
            if kv_b.writes_bf16(c.gemm, n_kv) {
                // The GEMM rounds to BF16 itself: no f32 K/V round trip.
                kv_b.forward_bf16(dev, c.gemm, &latent, n_kv, &mut kvb16.slice_mut().slice_mut(..n_kv * kvb_cols))?;
            } else {
                let kvb = grow(dev, absorbed_q_or_kv_slot, n_kv * kvb_cols, "mla expanded k/v")?;
                kv_b.forward(dev, c.gemm, &latent, n_kv, &mut kvb.slice_mut().slice_mut(..n_kv * kvb_cols))?;
                dev.copy_rows_to_bf16(
                    kvb,
                    RowsView::contiguous(n_kv, kvb_cols),
                    kvb16,
                    RowsView::contiguous(n_kv, kvb_cols),
                )?;
            }
            let q16 = grow(dev, q16_slot, t * hh * qk, "mla q (bf16)")?;
            dev.copy_rows_to_bf16(q, RowsView::contiguous(t, hh * qk), q16, RowsView::contiguous(t, hh * qk))?;
            let q_a = q16.slice().slice(..t * hh * qk);
            let q_b = q16.slice().slice(nope..t * hh * qk);
            let k_a = kvb16.slice().slice(..n_kv * kvb_cols);
            let v = kvb16.slice().slice(nope..n_kv * kvb_cols);
            let k_b = kpe.slice().slice(..n_kv * rd);
            dev.flash_prefill(
                &args,
                &q_a,
                Some(&q_b),
                &k_a,
                Some(&k_b),
                &v,
                &mut o.slice_mut().slice_mut(..t * hh * vd),
            )?;
        }
        self.project_out(c, &mut sc.y, o, t * hh * vd)
    }

    /// `y = o · W_oᵀ` over the first `n` elements of the attention output `o`.
    fn project_out(&self, c: &Ctx, y: &mut DeviceBuffer<f32>, o: &DeviceBuffer<f32>, n: usize) -> Result<()> {
        let t = c.t;
        let hidden = self.w.o.rows();
        self.w.o.forward(c.dev, c.gemm, &o.slice().slice(..n), t, &mut y.slice_mut().slice_mut(..t * hidden))?;
        Ok(())
    }
}

impl GpuGqa<'_> {
    fn forward(&self, c: &Ctx, l: usize, s: &mut StepIo) -> Result<()> {
        let (t, hh, kvh, hd) = (c.t, self.heads, self.kv_heads, self.head_dim);
        let hidden = self.w.o.rows();
        let dev = c.dev;
        let sc = &mut *s.scratch;
        let [q_slot, k_slot, v_slot, out_slot, gate_slot, k_all_slot, v_all_slot, _] = &mut sc.f;
        let xn = sc.xn.slice().slice(..t * hidden);
        let q = grow(dev, q_slot, t * hh * hd, "gqa q")?;
        let k = grow(dev, k_slot, t * kvh * hd, "gqa k")?;
        let v = grow(dev, v_slot, t * kvh * hd, "gqa v")?;
        // q (with its gates, when gated, into the gate slot), k and v: one GEMV launch in decode.
        let q_rows = if self.output_gate { 2 * hh * hd } else { hh * hd };
        let q_out = if self.output_gate { grow(dev, gate_slot, t * q_rows, "gqa q and gates")? } else { &mut *q };
        GpuLinear::forward_group(
            dev,
            c.gemm,
            &xn,
            t,
            &mut [
                (&self.w.q, &mut q_out.slice_mut().slice_mut(..t * q_rows)),
                (&self.w.k, &mut k.slice_mut().slice_mut(..t * kvh * hd)),
                (&self.w.v, &mut v.slice_mut().slice_mut(..t * kvh * hd)),
            ],
        )?;
        if self.output_gate {
            let full = gate_slot.as_ref().expect("grown above");
            super::deltanet::split_gated_query(c, full, hh, hd, q)?;
        }
        let pos = sc.positions.slice().slice(..t);
        let row = kvh * hd;
        let written = match &self.w.qk_norm {
            // Biases, RoPE on the first `2 · rope_half` dims of each head (all of it, or partial
            // rotary) and, for one sequence in a BF16 cache, the K and V rows: one launch.
            None => {
                let shape = GqaShape {
                    n_tokens: t,
                    q_heads: hh,
                    kv_heads: kvh,
                    head_dim: hd,
                    rot_dim: 2 * c.rope_half,
                    pairing: c.pairing,
                };
                let cache = match &s.kv {
                    KvRows::Seq(kv) => Some((*kv, l, c.pos)),
                    KvRows::PerRow(_) => None,
                };
                let bias = self.w.qkv_bias.as_ref();
                dev.gqa_prep(q, k, v, shape, bias, &pos, c.cos, c.sin, c.max_pos, cache)?
            }
            // The norm comes between the biases and the rotation: each run of a norm weight's
            // length, a head (per-head qk-norm) or a token's whole projection (MiniMax-M2's).
            Some((qn, kn)) => {
                if let Some([qb, kb, vb]) = &self.w.qkv_bias {
                    dev.add_bias_rows_f32(q, t, qb)?;
                    dev.add_bias_rows_f32(k, t, kb)?;
                    dev.add_bias_rows_f32(v, t, vb)?;
                }
                let (qw, kw) = (qn.len(), kn.len());
                dev.rmsnorm_rows_inplace(q, RowsView::contiguous(t * hh * hd / qw, qw), qn, c.eps)?;
                dev.rmsnorm_rows_inplace(k, RowsView::contiguous(t * kvh * hd / kw, kw), kn, c.eps)?;
                dev.rope_f32(q, &pos, c.cos, c.sin, c.max_pos, &rope_layout(c, hh, hh * hd, hd, 0))?;
                dev.rope_f32(k, &pos, c.cos, c.sin, c.max_pos, &rope_layout(c, kvh, kvh * hd, hd, 0))?;
                false
            }
        };
        if !written {
            s.kv.for_each_seq(c, |kv, pos, r0, n| {
                kv.write(dev, l, 0, pos, n, &k.slice().slice(r0 * row..(r0 + n) * row))?;
                Ok(kv.write(dev, l, 1, pos, n, &v.slice().slice(r0 * row..(r0 + n) * row))?)
            })?;
        }
        let o = grow(dev, out_slot, t * hh * hd, "gqa attention output")?;
        let opts = krasis_gpu::AttnOptions { window: self.window, sinks: self.w.sinks.as_ref() };
        if c.decode {
            let ws = &mut *s.ws;
            let q_row = hh * hd;
            s.kv.for_each_seq(c, |kv, pos, r0, n| {
                Ok(dev.gqa_decode_attention_with(
                    kv,
                    l,
                    &q.slice().slice(r0 * q_row..(r0 + n) * q_row),
                    n,
                    hh,
                    kvh,
                    hd,
                    pos,
                    self.scale,
                    &mut o.slice_mut().slice_mut(r0 * q_row..(r0 + n) * q_row),
                    ws,
                    &opts,
                )?)
            })?;
        } else {
            let kv = s.kv.seq("GQA prefill attention")?;
            let n_kv = c.pos + t;
            let shape =
                FlashShape { t, n_kv, q_start: c.pos, heads: hh, kv_heads: kvh, head_dim: hd, scale: self.scale };
            // Past positions from the cache, this call's own from the fresh rows (as for MLA).
            let fresh = RowsView { rows: t, cols: row, stride: row, offset: c.pos * row };
            if c.precise {
                // f32 keys and values (the cache holds f32 rows) and q as it is.
                let k_all = grow(dev, k_all_slot, n_kv * row, "gqa keys")?;
                let v_all = grow(dev, v_all_slot, n_kv * row, "gqa values")?;
                if c.pos > 0 {
                    kv.read_f32(dev, l, 0, 0, c.pos, &mut k_all.slice_mut().slice_mut(..c.pos * row))?;
                    kv.read_f32(dev, l, 1, 0, c.pos, &mut v_all.slice_mut().slice_mut(..c.pos * row))?;
                }
                dev.copy_rows_f32(k, RowsView::contiguous(t, row), k_all, fresh)?;
                dev.copy_rows_f32(v, RowsView::contiguous(t, row), v_all, fresh)?;
                shape.run(
                    dev,
                    &opts,
                    &q.slice().slice(..),
                    &k_all.slice().slice(..),
                    &v_all.slice().slice(..),
                    &mut o.slice_mut().slice_mut(..),
                )?;
            } else {
                let [k16_slot, v16_slot, q16_slot, ..] = &mut sc.b;
                let k16 = grow(dev, k16_slot, n_kv * row, "gqa keys (bf16)")?;
                let v16 = grow(dev, v16_slot, n_kv * row, "gqa values (bf16)")?;
                // A row-invariant call reads its own rows back through the cache as well.
                let from_cache = if c.invariant { n_kv } else { c.pos };
                if from_cache > 0 {
                    kv.read_bf16(dev, l, 0, 0, from_cache, &mut k16.slice_mut().slice_mut(..from_cache * row))?;
                    kv.read_bf16(dev, l, 1, 0, from_cache, &mut v16.slice_mut().slice_mut(..from_cache * row))?;
                }
                if !c.invariant {
                    dev.copy_rows_to_bf16(k, RowsView::contiguous(t, row), k16, fresh)?;
                    dev.copy_rows_to_bf16(v, RowsView::contiguous(t, row), v16, fresh)?;
                }
                let q16 = grow(dev, q16_slot, t * hh * hd, "gqa q (bf16)")?;
                dev.copy_rows_to_bf16(q, RowsView::contiguous(t, hh * hd), q16, RowsView::contiguous(t, hh * hd))?;
                shape.run(
                    dev,
                    &opts,
                    &q16.slice().slice(..),
                    &k16.slice().slice(..),
                    &v16.slice().slice(..),
                    &mut o.slice_mut().slice_mut(..),
                )?;
            }
        }
        if self.output_gate {
            super::deltanet::apply_output_gate(c, o, gate_slot, hh, hd)?;
        }
        self.w.o.forward(
            dev,
            c.gemm,
            &o.slice().slice(..t * hh * hd),
            t,
            &mut sc.y.slice_mut().slice_mut(..t * hidden),
        )?;
        if let Some(ob) = &self.w.o_bias {
            dev.add_bias_rows_f32(&mut sc.y.slice_mut().slice_mut(..t * hidden), t, ob)?;
        }
        Ok(())
    }
}

/// One GQA prefill attention call's shapes (contiguous `[tokens, heads, head_dim]` q and output,
/// `[tokens, kv_heads · head_dim]` keys and values), over BF16 or f32 inputs alike.
struct FlashShape {
    t: usize,
    n_kv: usize,
    q_start: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
}

impl FlashShape {
    /// The flash prefill over `q`, `k` and `v` into `out`. Heads wider than the tensor-core
    /// kernel's output (Qwen3-Next's 256) run as two calls: the q·k product in two parts of half
    /// the head, the values in two halves, one call each; both calls compute the same scores,
    /// each writes its half of the output.
    fn run<T: FlashInput>(
        &self,
        dev: &GpuDevice,
        opts: &krasis_gpu::AttnOptions<'_>,
        q: &CudaView<'_, T>,
        k: &CudaView<'_, T>,
        v: &CudaView<'_, T>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let (t, n_kv, hh, kvh, hd) = (self.t, self.n_kv, self.heads, self.kv_heads, self.head_dim);
        let row = kvh * hd;
        let base = |dim: usize, with_b: bool| FlashPrefillArgs {
            n_q: t,
            n_kv,
            q_start: self.q_start,
            heads: hh,
            kv_heads: kvh,
            scale: self.scale,
            q_a: HeadsLayout { token_stride: hh * hd, head_stride: hd, dim },
            q_b: if with_b { HeadsLayout { token_stride: hh * hd, head_stride: hd, dim } } else { HeadsLayout::none() },
            k_a: HeadsLayout { token_stride: row, head_stride: hd, dim },
            k_b: if with_b { HeadsLayout { token_stride: row, head_stride: hd, dim } } else { HeadsLayout::none() },
            v: HeadsLayout { token_stride: row, head_stride: hd, dim },
            out: HeadsLayout { token_stride: hh * hd, head_stride: hd, dim },
        };
        if hd > MMA_MAX_V && hd <= MMA_MAX_QK && hd % 32 == 0 {
            let half = hd / 2;
            let args = base(half, true);
            for part in 0..2 {
                let at = part * half;
                dev.flash_prefill_opts(
                    &args,
                    opts,
                    &q.slice(..t * hh * hd),
                    Some(&q.slice(half..t * hh * hd)),
                    &k.slice(..n_kv * row),
                    Some(&k.slice(half..n_kv * row)),
                    &v.slice(at..n_kv * row),
                    &mut out.slice_mut(at..t * hh * hd),
                )?;
            }
        } else {
            dev.flash_prefill_opts(
                &base(hd, false),
                opts,
                &q.slice(..t * hh * hd),
                None,
                &k.slice(..n_kv * row),
                None,
                &v.slice(..n_kv * row),
                &mut out.slice_mut(..t * hh * hd),
            )?;
        }
        Ok(())
    }
}
