//! The MoE router on the GPU: gate logits (f32) → scores → top-k (expert id, weight) per token,
//! with the same ids, in the same order, and the same weights as krasis-model's CPU `route`.
//!
//! Two kernels (`kernels/router.cu`): `router_logits` computes `logits[t, E] = x · Wᵀ` in f32
//! (one block of 256 threads per (expert, tile of 8 tokens), the hidden dimension split over the
//! block with 16-byte loads, so decode spreads over E blocks), into a
//! scratch buffer the router keeps and grows to the largest `t` seen; `router_topk` runs one block
//! per token and applies the routing rule: softmax (f64 sum) or sigmoid scores, the optional
//! group limit (DeepSeek-V2 group max, DeepSeek-V3 `noaux_tc` top-2 sum of bias-corrected scores,
//! others set to 0.0), the top-k by (value desc, index asc), then weights from the unbiased
//! scores, optionally renormalised (`+1e-20` for sigmoid) and scaled. A router with a bias and any
//! method but `noaux_tc` adds it to its logits first (gpt-oss's `mlp.router.bias`: softmax over
//! every biased logit, top-k, renormalised, which is its softmax over the top k). The kernel file's header
//! says where results may differ from the CPU in the last bit. Up to one tile of tokens (decode)
//! runs both in one launch, `router_publish` (the hybrid hand-off's kernel, with device outputs):
//! the tile's last logits block applies the rule.
//!
//! The rule is krasis-core's [`RoutingRule`], the same value the CPU router takes.

use std::sync::Mutex;

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use krasis_core::spec::{RoutingRule, ScoringFunc, TopkMethod};

use crate::device::kernel_args;
use crate::kernels::{launch_err, KernelSource, HEADERS};
use crate::{DeviceBuffer, GpuDevice, GpuError, HostFlag, MappedHost};

pub const ROUTER: KernelSource = KernelSource {
    name: "router",
    src: include_str!("../kernels/router.cu"),
    headers: HEADERS,
    options: &[],
    functions: &["router_logits", "router_topk", "router_publish", "router_count"],
};

/// Most experts per router: `router_topk` keeps a token's scores in shared-memory arrays of this
/// size (`ROUTER_MAX_E` in router.cu).
pub const ROUTER_MAX_EXPERTS: usize = 512;
/// Most experts per token: thread 0 finalises the weights in a register array of this size
/// (`ROUTER_MAX_K` in router.cu); real models route to ≤ 16.
pub const ROUTER_MAX_TOP_K: usize = 16;
/// Threads of a `router_logits` block (`ROUTER_LOGITS_THREADS` in router.cu): one block per
/// expert and token tile, the hidden dimension split over all of them, so that decode (t = 1)
/// spreads the weight read over E blocks with every load in flight at once.
const LOGITS_THREADS: u32 = 256;
/// Tokens per `router_logits` block row (`ROUTER_TOK_TILE` in router.cu): each weight element
/// loaded serves this many tokens.
const LOGITS_TOK_TILE: usize = 8;
/// Experts a `router_logits` block computes at once (`ROUTER_EXP_GROUP` in router.cu): each
/// thread's x values serve them all, so x crosses from L2 E / 8 times, not E times (measured on an
/// H200 under ncu: 304 µs a V2-Lite layer at 8192 tokens with one expert a block).
const LOGITS_EXPERT_GROUP: usize = 8;
/// Token tiles from which blocks take expert groups: below 16 tiles (128 tokens) x's re-reads are
/// a few MB and one expert a block keeps more loads in flight.
const LOGITS_GROUP_MIN_TILES: usize = 16;
/// Most threads of a `router_topk` block: E ≤ 512 scores, two per thread at most. A block has
/// E rounded up to a warp (32..=256) threads, so a 64-expert router runs 2 warps, not 8 mostly idle.
const TOPK_BLOCK: u32 = 256;

/// A router's gate weight `[n_experts, hidden]` (f32) and optional bias `[n_experts]` on the
/// device, with its rule: the `e_score_correction_bias` of a [`TopkMethod::NoauxTc`] rule (it only
/// chooses), else a logit bias (added to the logits, as krasis-model's CPU router does).
pub struct GpuRouter {
    name: String,
    n_experts: usize,
    hidden: usize,
    cfg: RoutingRule,
    weight: DeviceBuffer<f32>,
    /// `NoauxTc`: the score-correction bias; the other methods: the logit bias.
    bias: Option<DeviceBuffer<f32>>,
    /// `[t, n_experts]` logits, grown to the largest `t` seen. Reuse across calls is safe because
    /// every launch is on the device's compute stream (and a replaced buffer is freed
    /// stream-ordered).
    logits: Mutex<Option<DeviceBuffer<f32>>>,
    /// [`GpuRouter::publish`]'s completion counters (one per token tile, then one for the grid),
    /// zero between launches (the kernel's last blocks reset them).
    counters: Mutex<Option<DeviceBuffer<u32>>>,
}

/// Where [`GpuRouter::publish`] puts a call's routes: mapped host memory, and the flag that
/// announces them.
pub struct PublishTarget<'a> {
    /// `[t, hidden]`: a copy of the routed activations (`None`: the routes only, for a consumer
    /// that does not compute on the host).
    pub x: Option<&'a MappedHost<f32>>,
    /// `[t, top_k]` expert ids and weights.
    pub ids: &'a MappedHost<i32>,
    pub weights: &'a MappedHost<f32>,
    /// Set to `seq` once everything above is visible to the host.
    pub flag: &'a HostFlag,
    pub seq: u64,
}

impl std::fmt::Debug for GpuRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuRouter")
            .field("name", &self.name)
            .field("n_experts", &self.n_experts)
            .field("hidden", &self.hidden)
            .field("cfg", &self.cfg)
            .field("bias", &self.bias.is_some())
            .finish()
    }
}

const OP: &str = "router";

fn bad(name: &str, detail: String) -> GpuError {
    GpuError::shape(OP, format!("router {name}: {detail}"))
}

impl GpuRouter {
    /// Checks the shapes and the rule without a device: what [`GpuRouter::new`] refuses.
    pub fn validate(
        name: &str,
        weight_len: usize,
        n_experts: usize,
        hidden: usize,
        bias_len: Option<usize>,
        cfg: &RoutingRule,
    ) -> Result<(), GpuError> {
        let e = n_experts;
        if e == 0 || e > ROUTER_MAX_EXPERTS {
            return Err(bad(name, format!("n_experts = {e}; must be 1..={ROUTER_MAX_EXPERTS}")));
        }
        if hidden == 0 {
            return Err(bad(name, "hidden = 0".into()));
        }
        if i32::try_from(hidden).is_err() || Some(weight_len) != e.checked_mul(hidden) {
            return Err(bad(name, format!("gate weight has {weight_len} elements, not [{e}, {hidden}]")));
        }
        if let Some(b) = bias_len {
            if b != e {
                return Err(bad(name, format!("the router bias has {b} elements, not {e}")));
            }
        }
        let k = cfg.top_k;
        if k == 0 || k > e || k > ROUTER_MAX_TOP_K {
            return Err(bad(
                name,
                format!(
                    "top_k = {k}; must be 1..={} (n_experts {e}, GPU limit {ROUTER_MAX_TOP_K})",
                    e.min(ROUTER_MAX_TOP_K)
                ),
            ));
        }
        if !cfg.routed_scaling_factor.is_finite() {
            return Err(bad(name, format!("routed_scaling_factor = {} is not finite", cfg.routed_scaling_factor)));
        }
        match cfg.topk {
            TopkMethod::Greedy => {}
            TopkMethod::GroupLimitedGreedy { n_group, topk_group } | TopkMethod::NoauxTc { n_group, topk_group } => {
                if n_group == 0 || !e.is_multiple_of(n_group) {
                    return Err(bad(name, format!("n_group = {n_group} does not divide n_experts = {e}")));
                }
                if topk_group == 0 || topk_group > n_group {
                    return Err(bad(name, format!("topk_group = {topk_group}; must be 1..={n_group} (n_group)")));
                }
                let kept = topk_group * (e / n_group);
                if k > kept {
                    return Err(bad(
                        name,
                        format!(
                            "top_k = {k} exceeds the {kept} experts in the {topk_group} kept groups \
                             ({n_group} groups of {})",
                            e / n_group
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Uploads the gate weight `[n_experts, hidden]` (f32, row-major) and the optional bias (the
    /// `e_score_correction_bias` of a [`TopkMethod::NoauxTc`] rule, else a logit bias; see
    /// [`GpuRouter`]), charged to the budget under `name`.
    pub fn new(
        dev: &GpuDevice,
        name: &str,
        weight: &[f32],
        n_experts: usize,
        hidden: usize,
        bias: Option<&[f32]>,
        cfg: RoutingRule,
    ) -> Result<Self, GpuError> {
        Self::validate(name, weight.len(), n_experts, hidden, bias.map(|b| b.len()), &cfg)?;
        let w = dev.upload(weight, &format!("router {name} gate weight"))?;
        let b = match (bias, cfg.topk) {
            (Some(b), TopkMethod::NoauxTc { .. }) => Some(dev.upload(b, &format!("router {name} score bias"))?),
            (Some(b), _) => Some(dev.upload(b, &format!("router {name} logit bias"))?),
            (None, _) => None,
        };
        Ok(GpuRouter {
            name: name.to_string(),
            n_experts,
            hidden,
            cfg,
            weight: w,
            bias: b,
            logits: Mutex::new(None),
            counters: Mutex::new(None),
        })
    }

    pub fn n_experts(&self) -> usize {
        self.n_experts
    }

    pub fn hidden(&self) -> usize {
        self.hidden
    }

    pub fn config(&self) -> &RoutingRule {
        &self.cfg
    }

    /// Routes `t` tokens of `x [t, hidden]` (f32): writes `ids [t, top_k]` (i32) and
    /// `weights [t, top_k]` (f32), each row in the CPU's order (choice value desc, index asc).
    /// Launches on the compute stream; never synchronises.
    pub fn forward(
        &self,
        dev: &GpuDevice,
        x: &impl DevicePtr<f32>,
        t: usize,
        ids: &mut impl DevicePtrMut<i32>,
        weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        let (e, k) = (self.n_experts, self.cfg.top_k);
        let name = &self.name;
        let call = self.check_call(x, t)?;
        if ids.len() != t * k || weights.len() != t * k {
            return Err(bad(
                name,
                format!("ids/weights have {}/{} elements, not [{t}, {k}]", ids.len(), weights.len()),
            ));
        }
        let Some((tiles, t_i)) = call else { return Ok(()) };
        let s = dev.stream();
        if tiles == 1 {
            // One token tile (decode): logits and rule in one launch.
            let (i_p, _g0) = ids.device_ptr_mut(s);
            let (o_p, _g1) = weights.device_ptr_mut(s);
            return self.route_fused(dev, x, t, (0, i_p, o_p), (0, 0));
        }
        let (e_i, h_i) = (e as i32, self.hidden as i32);
        let mut scratch = self.logits_scratch(dev, t)?;
        let logits = scratch.as_mut().expect("allocated");
        {
            let (w_p, _g0) = self.weight.device_ptr(s);
            let (x_p, _g1) = x.device_ptr(s);
            let (l_p, _g2) = logits.device_ptr_mut(s);
            let f = dev.function(&ROUTER, "router_logits")?;
            let mut b = s.launch_builder(&f);
            let eg = if tiles >= LOGITS_GROUP_MIN_TILES { LOGITS_EXPERT_GROUP } else { 1 };
            let (cfg, eg_i) = (logits_config(e, tiles, eg), eg as i32);
            b.arg(&w_p).arg(&x_p).arg(&l_p).arg(&e_i).arg(&h_i).arg(&t_i).arg(&eg_i);
            // SAFETY: argument list matches the kernel; w is [E, h], x is [t, h], logits ≥ [t, E].
            unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;
        }
        let rule = self.rule_args();
        let (l_p, _g0) = logits.device_ptr(s);
        let (b_p, _g1) = self.bias_ptr(s);
        let (i_p, _g2) = ids.device_ptr_mut(s);
        let (o_p, _g3) = weights.device_ptr_mut(s);
        let f = dev.function(&ROUTER, "router_topk")?;
        let mut b = s.launch_builder(&f);
        b.arg(&l_p).arg(&b_p).arg(&i_p).arg(&o_p).arg(&t_i).arg(&e_i);
        rule.push(&mut b);
        let threads = (e as u32).next_multiple_of(32).clamp(32, TOPK_BLOCK);
        let lc = LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument list matches the kernel; logits [t, E], bias [E] or null, outputs [t, k].
        unsafe { b.launch(lc) }.map_err(launch_err(OP))?;
        Ok(())
    }

    /// [`GpuRouter::forward`] and the hand-off to a host thread in one launch: the routes and a
    /// copy of `x` go straight to mapped host memory (`to`), then `to.flag` is set to `to.seq`
    /// by the device, after a system-wide fence (no copy-engine operation, no stream memory
    /// operation). Same routes as `forward` (the same rule code; the softmax's f64 sum may differ
    /// in its tree shape, see router.cu). Launches on the compute stream; never synchronises.
    pub fn publish(
        &self,
        dev: &GpuDevice,
        x: &impl DevicePtr<f32>,
        t: usize,
        to: &PublishTarget<'_>,
    ) -> Result<(), GpuError> {
        let (h, k) = (self.hidden, self.cfg.top_k);
        let name = &self.name;
        let x_len = to.x.map_or(t * h, |x| x.len());
        if x_len < t * h || to.ids.len() < t * k || to.weights.len() < t * k {
            return Err(bad(
                name,
                format!(
                    "host buffers of {}/{}/{} elements cannot take [{t}, {h}] activations and [{t}, {k}] routes",
                    x_len,
                    to.ids.len(),
                    to.weights.len()
                ),
            ));
        }
        if t == 0 {
            self.check_call(x, t)?;
            to.flag.store(to.seq);
            return Ok(());
        }
        let hx = to.x.map_or(0, |x| x.device_ptr());
        let (hi, hw, fl) = (to.ids.device_ptr(), to.weights.device_ptr(), to.flag.device_ptr());
        self.route_fused(dev, x, t, (hx, hi, hw), (fl, to.seq))
    }

    /// `router_publish`: logits, rule and (with a non-null `x_out`) the copy of `x`, writing the
    /// routes to `ids_out` / `w_out` (device or mapped host memory) and, with a non-null `flag`,
    /// storing `seq` there after a system-wide fence. `t > 0`.
    fn route_fused(
        &self,
        dev: &GpuDevice,
        x: &impl DevicePtr<f32>,
        t: usize,
        (x_out, ids_out, w_out): (u64, u64, u64),
        (flag, seq): (u64, u64),
    ) -> Result<(), GpuError> {
        let (e, h) = (self.n_experts, self.hidden);
        let Some((tiles, t_i)) = self.check_call(x, t)? else { return Ok(()) };
        let s = dev.stream();
        let (e_i, h_i) = (e as i32, h as i32);
        let mut scratch = self.logits_scratch(dev, t)?;
        let logits = scratch.as_mut().expect("allocated");
        let mut counters = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        if counters.as_ref().is_none_or(|c| c.len() < tiles + 1) {
            *counters = None;
            *counters = Some(dev.alloc_zeros::<u32>(tiles + 1, &format!("router {} counters", self.name))?);
        }
        let c = counters.as_mut().expect("allocated");
        let rule = self.rule_args();
        let (w_p, _g0) = self.weight.device_ptr(s);
        let (x_p, _g1) = x.device_ptr(s);
        let (l_p, _g2) = logits.device_ptr_mut(s);
        let (b_p, _g3) = self.bias_ptr(s);
        let (c_p, _g4) = c.device_ptr_mut(s);
        let all_p = c_p + (tiles * std::mem::size_of::<u32>()) as u64;
        let f = dev.function(&ROUTER, "router_publish")?;
        let r = &rule;
        let mut args = kernel_args![
            &w_p,
            &x_p,
            &l_p,
            &e_i,
            &h_i,
            &t_i,
            &b_p,
            &r.scoring,
            &r.method,
            &r.n_group,
            &r.topk_group,
            &r.top_k,
            &r.norm,
            &r.scale,
            &x_out,
            &ids_out,
            &w_out,
            &c_p,
            &all_p,
            &flag,
            &seq
        ];
        // SAFETY: argument list matches the kernel; w [E, h], x [t, h], logits ≥ [t, E], bias [E]
        // or null, outputs ≥ [t, h] / [t, k] (checked by the callers), counters [tiles + 1]
        // zeroed; the kernel waits for the previous one first.
        unsafe { dev.launch_dependent(OP, &f, logits_config(e, tiles, 1), &mut args, true) }
    }

    /// Adds the `n` routes at `ids` (device-readable: device or mapped host memory) to the
    /// heatmap row `counts[0..n_experts]` (ids outside the router's experts are skipped).
    /// Launches on the compute stream.
    ///
    /// # Safety
    /// `ids` must hold `n` i32 that no stream work writes before this launch runs, and `counts`
    /// `n_experts` u64 of device memory only counting launches write.
    pub unsafe fn count(&self, dev: &GpuDevice, ids: u64, n: usize, counts: u64) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let n_i = i32::try_from(n).map_err(|_| bad(&self.name, format!("{n} routes to count in one launch")))?;
        let e_i = self.n_experts as i32;
        let f = dev.function(&ROUTER, "router_count")?;
        let mut args = kernel_args![&ids, &n_i, &counts, &e_i];
        let blocks = n.div_ceil(256).min(1024) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the caller vouches for both pointers; the kernel waits for the previous kernel.
        unsafe { dev.launch_dependent(OP, &f, cfg, &mut args, true) }
    }

    /// Shape checks common to both entry points: `Some((tiles, t))` for a launch, `None` for
    /// `t = 0`.
    fn check_call(&self, x: &impl DevicePtr<f32>, t: usize) -> Result<Option<(usize, i32)>, GpuError> {
        let (h, name) = (self.hidden, &self.name);
        if Some(x.len()) != t.checked_mul(h) {
            return Err(bad(name, format!("x has {} elements, not [{t}, {h}]", x.len())));
        }
        if t == 0 {
            return Ok(None);
        }
        let tiles = t.div_ceil(LOGITS_TOK_TILE);
        let t_i = i32::try_from(t)
            .ok()
            .filter(|_| tiles <= 65535)
            .ok_or_else(|| bad(name, format!("t = {t} tokens exceeds one launch ({} max)", 65535 * LOGITS_TOK_TILE)))?;
        Ok(Some((tiles, t_i)))
    }

    /// The logits scratch, grown to `[t, E]`.
    fn logits_scratch(
        &self,
        dev: &GpuDevice,
        t: usize,
    ) -> Result<std::sync::MutexGuard<'_, Option<DeviceBuffer<f32>>>, GpuError> {
        let e = self.n_experts;
        let mut scratch = self.logits.lock().unwrap_or_else(|p| p.into_inner());
        if scratch.as_ref().is_none_or(|b| b.len() < t * e) {
            *scratch = None; // release the old charge first
                             // SAFETY: the logits kernel writes every element of [t, E] before the rule reads it.
            *scratch = Some(unsafe { dev.alloc_uninit::<f32>(t * e, &format!("router {} logits", self.name))? });
        }
        Ok(scratch)
    }

    fn bias_ptr<'s>(
        &'s self,
        s: &'s std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> (cudarc::driver::sys::CUdeviceptr, Option<cudarc::driver::SyncOnDrop<'s>>) {
        match &self.bias {
            Some(b) => {
                let (p, g) = b.device_ptr(s);
                (p, Some(g))
            }
            None => (0, None),
        }
    }

    fn rule_args(&self) -> RuleArgs {
        let cfg = &self.cfg;
        let scoring: i32 = match cfg.scoring {
            ScoringFunc::Softmax => 0,
            ScoringFunc::Sigmoid => 1,
        };
        let (method, n_group, topk_group): (i32, i32, i32) = match cfg.topk {
            TopkMethod::Greedy => (0, 1, 1),
            TopkMethod::GroupLimitedGreedy { n_group, topk_group } => (1, n_group as i32, topk_group as i32),
            TopkMethod::NoauxTc { n_group, topk_group } => (2, n_group as i32, topk_group as i32),
        };
        RuleArgs {
            scoring,
            method,
            n_group,
            topk_group,
            top_k: cfg.top_k as i32,
            norm: cfg.norm_topk_prob as i32,
            scale: cfg.routed_scaling_factor,
        }
    }
}

/// The routing rule as the kernels' trailing arguments (`scoring .. routed_scaling_factor`).
struct RuleArgs {
    scoring: i32,
    method: i32,
    n_group: i32,
    topk_group: i32,
    top_k: i32,
    norm: i32,
    scale: f32,
}

impl RuleArgs {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(&self.scoring).arg(&self.method).arg(&self.n_group).arg(&self.topk_group);
        b.arg(&self.top_k).arg(&self.norm).arg(&self.scale);
    }
}

/// A logits grid of `eg` experts a block: `router_logits` takes groups of
/// [`LOGITS_EXPERT_GROUP`] once there are [`LOGITS_GROUP_MIN_TILES`] token tiles, else one (more
/// blocks, more loads in flight); `router_publish` one always.
fn logits_config(e: usize, tiles: usize, eg: usize) -> LaunchConfig {
    let grid = (e.div_ceil(eg) as u32, tiles as u32, 1);
    LaunchConfig { grid_dim: grid, block_dim: (LOGITS_THREADS, 1, 1), shared_mem_bytes: 0 }
}
