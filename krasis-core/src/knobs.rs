//! The environment variables the library crates read, in one place.
//!
//! Every variable here is for tests and measurements: each turns one engine choice back to an
//! earlier or simpler form, moves a threshold, or makes a skipped test fail. None is needed to
//! run Krasis, and a choice a user makes is an option of the library (and a flag of the CLI),
//! never a variable. The last four fields are not knobs but where the system keeps things
//! (`HOME`, `XDG_CACHE_HOME`, `CUDA_HOME`, `CUDA_PATH`); they are read here too, so that this
//! file is the only library source that reads the environment (a test in
//! `tests/tests/env_reads.rs` keeps it so). docs/ENVIRONMENT.md lists them all.
//!
//! [`knobs`] reads the process environment once, on first use; a variable set later is not
//! seen. [`Knobs::from_lookup`] parses any lookup, so the parsing is tested without touching the
//! process environment.
//!
//! Parsing never fails: a value that is not one of those documented is ignored (the default
//! stays), silently or with a warning as each field says. The warnings are collected in
//! [`Knobs::warnings`] and logged once by [`knobs`]. A value that is not valid Unicode counts as
//! unset, except for the paths.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::OnceLock;

/// `KRASIS_ISA`: the instruction set the CPU kernels may use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IsaChoice {
    /// `scalar`.
    Scalar,
    /// `avx2`.
    Avx2,
    /// `avx512`: AVX-512 without the AMX tiles.
    Avx512,
    /// `amx`: AVX-512 with the AMX tiles (what an unset variable allows too).
    Amx,
    /// Anything else, as it was given: the detected ISA is used (with a warning, from
    /// `krasis_cpu::isa::active`), and the AMX tiles are off.
    Unknown(String),
}

/// `KRASIS_PREFETCH`'s hint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchHint {
    /// `none`: no software prefetch.
    None,
    /// `nta`: `prefetchnta`.
    Nta,
    /// `t0`: `prefetcht0`.
    T0,
    /// `t1`: `prefetcht1`.
    T1,
}

/// `KRASIS_PREFETCH=hint[:distance]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefetchChoice {
    pub hint: PrefetchHint,
    /// Bytes ahead; `None` (no `:distance`, or not a count) keeps the default distance.
    pub distance: Option<usize>,
}

/// `KRASIS_PREFILL_MATMUL`: which kernels the CPU prefill's matmuls run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillMatmul {
    /// Unset, empty or unknown: the AMX-BF16 tiles where the CPU has them, else INT8.
    Auto,
    /// `int8`: the INT8 kernels.
    Int8,
    /// `bf16`: as `Auto`, with a warning when the tiles are not usable.
    Bf16,
    /// `bf16-emulated`: the tiles' scalar emulation on any CPU (slow; for tests).
    Bf16Emulated,
}

/// `KRASIS_MOE_W2`: how the CPU expert runner's w2 tasks meet the intermediate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeW2 {
    /// `whole`: each task waits for the whole intermediate.
    Whole,
    /// `groups`, unset or anything else: tasks consume it group by group.
    ByGroups,
    /// `major`: group-major tasks.
    GroupMajor,
}

/// `KRASIS_MOE_XQ`: who quantises small activation sets in the CPU expert runner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeXq {
    /// Unset or anything else: shared quantisation tasks.
    Shared,
    /// `local`: every worker for itself, in every dispatch.
    Local,
    /// `local1`: every worker for itself, in one-job dispatches only.
    Local1,
}

/// `KRASIS_MOE_TASKS`: whether expert dispatches shrink their tasks towards each phase's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeTasks {
    /// `guided`: always.
    Guided,
    /// `even`: never.
    Even,
}

/// `KRASIS_FLASH_KERNEL`: the most capable GPU prefill-attention kernel the automatic choice
/// may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashKernelCap {
    /// `simt`.
    Simt,
    /// `mma`.
    Mma,
    /// `fixed`.
    MmaFixed,
}

/// `KRASIS_MLA_PREFILL`: the form of the CPU MLA prefill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlaPrefill {
    /// `absorbed`: always absorbed (the former path).
    Absorbed,
    /// `decompressed`: decompressed for every call of two rows or more.
    Decompressed,
}

/// `KRASIS_CPU_MLA_DECODE`: how a one-token CPU MLA attention with packed `kv_b` is dispatched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuMlaDecode {
    /// `attention`: W_UK to W_UV in one dispatch, `o_proj` in its own.
    AttentionOnly,
    /// `split`: the former separate dispatches.
    Split,
}

/// `KRASIS_STREAM_FROM`: which records a hybrid prefill streams to the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamSource {
    /// `cpu`: the CPU experts' cache.
    CpuCache,
    /// `gpu`: the GPU expert cache (a second copy in RAM).
    GpuCache,
}

/// `KRASIS_CACHE_PAGE_CACHE`: whether loading a cache keeps the file's page-cache copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageCache {
    /// `keep`.
    Keep,
    /// `drop`.
    Drop,
}

/// Every environment variable the library crates read, parsed (see the module docs). Values
/// are compared exactly (case and spaces count) unless a field says they are trimmed.
#[derive(Clone, Debug, PartialEq)]
pub struct Knobs {
    // ---- CPU kernels and the worker pool (krasis-cpu) ----
    /// `KRASIS_ISA=scalar|avx2|avx512|amx` (trimmed, any case): lowers the CPU kernels' ISA
    /// below the detected one, for tests and A/B runs; naming anything but `amx` also turns the
    /// AMX tiles off. Default (`None`): the detected ISA, AMX tiles where usable.
    pub isa: Option<IsaChoice>,
    /// `KRASIS_PREFETCH=none|nta|t0|t1[:distance]` (hint and distance trimmed): the quantised
    /// kernels' software prefetch, for tuning on a new machine. Default (`None`; also for an
    /// unknown hint, with a warning): `krasis_cpu::quant::DEFAULT_PREFETCH` (`t0:4096`).
    pub prefetch: Option<PrefetchChoice>,
    /// `KRASIS_AMX_MIN_ROWS=N` (trimmed): the activation-row count (two per token) from which
    /// the AMX-INT8 tiles run, for measurements. Default (`None`; also for a value that is not a
    /// count, with a warning): `krasis_cpu::quant::amx::AMX_MIN_ROWS` (16).
    pub amx_min_rows: Option<usize>,
    /// `KRASIS_PREFILL_MATMUL=int8|bf16|bf16-emulated` (trimmed): the CPU prefill's matmul
    /// kernels, for tests and A/B runs. Default [`PrefillMatmul::Auto`] (also for an unknown
    /// value, with a warning).
    pub prefill_matmul: PrefillMatmul,
    /// `KRASIS_BF16_MIN_TOKENS=N` (trimmed): the tokens per matrix (an expert call: the mean per
    /// expert) from which the BF16 tiles run, for tests and measurements. Default (`None`; also
    /// for a value that is not a count, with a warning): `krasis_cpu::prefill_bf16::BF16_MIN_TOKENS`
    /// (32).
    pub bf16_min_tokens: Option<usize>,
    /// `KRASIS_BF16_PANEL_KB=N` (trimmed, positive): KiB of dequantised panel a BF16 task builds,
    /// for tuning. Default (`None`; also for 0 or a value that is not a count, silently): 512.
    pub bf16_panel_kb: Option<usize>,
    /// `KRASIS_BF16_TASKS=N` (trimmed, positive): the BF16 prefill's tasks per worker, for
    /// tuning. Default (`None`; also for 0 or a value that is not a count, silently): 4.
    pub bf16_tasks: Option<usize>,
    /// `KRASIS_EXPERT_DISPATCH=fused|split` (trimmed): `split` runs the BF16 prefill's expert
    /// conversion, w13 and w2 tasks as three dispatches instead of one, for A/B runs. Default
    /// `false` (fused; also for an unknown value, with a warning).
    pub expert_dispatch_split: bool,
    /// `KRASIS_MLA_EXPAND=f32` (trimmed): keeps the MLA prefill's key/value expansion off the
    /// BF16 tiles, for A/B runs. Default `false`.
    pub mla_expand_f32: bool,
    /// `KRASIS_MLA_ATTEND=f32` (trimmed): keeps the MLA prefill's attention off the BF16 tiles,
    /// for A/B runs. Default `false`.
    pub mla_attend_f32: bool,
    /// `KRASIS_ACT_SPLIT=0` sets it `false`: one INT8 row per token instead of two (value and
    /// residual), half the integer work and less accuracy, to measure what the residual costs.
    /// Default `true` (any other value too).
    pub act_split: bool,
    /// `KRASIS_ATTN_SHARED_KV=0` sets it `false`: the CPU decode attention without its split over
    /// positions (one task per head), to measure the split. Default `true` (any other value too).
    pub attn_shared_kv: bool,
    /// `KRASIS_ATTN_MAX_TASKS=N` (trimmed, positive): chunks per sub-group of the CPU decode
    /// attention's split, for measurements. Default (`None`; also for 0, silently, or a value
    /// that is not a count, with a warning): the measured rule in `krasis_cpu::attention`.
    pub attn_max_tasks: Option<usize>,
    /// `KRASIS_ATTN_MIN_ROWS=N` (trimmed, positive): the fewest positions per chunk of that
    /// split, for measurements. Default as [`Self::attn_max_tasks`].
    pub attn_min_rows: Option<usize>,
    /// `KRASIS_ATTN_TASK_HEADS=N` (trimmed; 0: a whole group): heads per task of that split, for
    /// measurements. Default (`None`; also for a value that is not a count, with a warning): the
    /// measured rule.
    pub attn_task_heads: Option<usize>,
    /// `KRASIS_DENSE_XQ=caller`: dense matmuls quantise their activations on the calling thread
    /// before the dispatch instead of in its first tasks, for A/B runs. Default `false`.
    pub dense_xq_caller: bool,
    /// `KRASIS_MOE_SUM=serial`: the CPU expert runner adds the experts' outputs after the
    /// dispatch on the calling thread (the former runner), for A/B runs. Default `false`.
    pub moe_sum_serial: bool,
    /// `KRASIS_MOE_W2=whole|groups|major`: how the CPU expert runner's w2 tasks meet the
    /// intermediate, for A/B runs. Default [`MoeW2::ByGroups`] (also for any other value).
    pub moe_w2: MoeW2,
    /// `KRASIS_MOE_W2_RUN_K=N` (trimmed, positive): the fewest intermediate columns a w2 task
    /// takes in one kernel call when it consumes the intermediate by groups, for tuning.
    /// Default (`None`; also for 0 or a value that is not a count, silently): the runner's own.
    pub moe_w2_run_k: Option<usize>,
    /// `KRASIS_MOE_XQ=local|local1`: who quantises small activation sets in the CPU expert
    /// runner, for A/B runs. Default [`MoeXq::Shared`] (also for any other value).
    pub moe_xq: MoeXq,
    /// `KRASIS_MOE_TASKS=guided|even`: overrides when expert dispatches shrink their tasks, for
    /// A/B runs. Default (`None`; also for any other value): from two jobs on.
    pub moe_tasks: Option<MoeTasks>,
    /// `KRASIS_TASKS_PER_WORKER=N` (not trimmed, positive): tasks per worker of the CPU expert
    /// runner and of the pooled dense matmuls, for tuning. Default (`None`; also for 0 or a value
    /// that is not a count, silently): each runner's own.
    pub tasks_per_worker: Option<usize>,
    /// `KRASIS_MOE_AFFINE=0` sets it `false`: expert dispatches without per-worker first tasks
    /// (plain dynamic claims), for A/B runs. Default `true` (any other value too).
    pub moe_affine: bool,
    /// `KRASIS_POOL_YIELD=0` sets it `false`: spinning pool workers do not yield their core, for
    /// measurements. Default `true` (any other value too).
    pub pool_yield: bool,
    /// `KRASIS_REQUIRE_AMX=1`: an AMX kernel test that cannot run on this CPU fails instead of
    /// printing a skip line (tests only). Default `false`.
    pub require_amx: bool,

    // ---- GPU kernels (krasis-gpu) ----
    /// `KRASIS_MLA_DECODE=general`: every MLA decode call takes the general GPU kernel, for
    /// tests and A/B runs. Default `false`.
    pub mla_decode_general: bool,
    /// `KRASIS_FLASH_KERNEL=simt|mma|fixed`: caps the automatic choice of the GPU prefill
    /// attention kernel, to measure or test the slower ones inside a whole model. Default
    /// (`None`; also for any other value): no cap.
    pub flash_kernel: Option<FlashKernelCap>,
    /// `KRASIS_PDL=0` sets it `false`: no programmatic dependent launches on sm_90+, for A/B
    /// runs. Default `true` (any other value too).
    pub pdl: bool,
    /// `KRASIS_MOE_QTILE=N` (not trimmed): the quantised expert tiles' shape variant, for A/B
    /// runs of whole models. Default (`None`; also for a value that is not a count; a count past
    /// the last variant is ignored where it is used): the default variant.
    pub moe_qtile: Option<usize>,
    /// `KRASIS_NVRTC_LIB=path` (non-empty): the libnvrtc to load, alone. Default (`None`): the
    /// usual names and CUDA directories.
    pub nvrtc_lib: Option<PathBuf>,
    /// `KRASIS_CUBLAS_LIB=path` (non-empty): the libcublas to load, alone. Default (`None`): the
    /// usual names and CUDA directories.
    pub cublas_lib: Option<PathBuf>,
    /// `KRASIS_NVRTC_CACHE=dir` (non-empty): where compiled GPU kernels are cached. Default
    /// (`None`): `$XDG_CACHE_HOME/krasis/nvrtc`, else `~/.cache/krasis/nvrtc`.
    pub nvrtc_cache: Option<PathBuf>,

    // ---- Engines (krasis-model) ----
    /// `KRASIS_MLA_PREFILL=absorbed|decompressed`: the CPU MLA prefill's form, for A/B runs.
    /// Default (`None`; also for any other value): decompressed by the measured rule.
    pub mla_prefill: Option<MlaPrefill>,
    /// `KRASIS_CPU_MLA_DECODE=attention|split`: how one-token CPU MLA attention is dispatched,
    /// for A/B runs. Default (`None`; also for any other value): one dispatch with `o_proj`.
    pub cpu_mla_decode: Option<CpuMlaDecode>,
    /// `KRASIS_MLP=linears`: a cached fused gate+up runs as two linears instead of one pooled
    /// expert, for A/B runs. Default `false`.
    pub mlp_linears: bool,
    /// `KRASIS_KV_B=f32`: MLA's `kv_b` stays f32 even when the dense-weight cache has it packed,
    /// for A/B runs. Default `false`.
    pub kv_b_f32: bool,
    /// `KRASIS_SHARED_EXPERTS=beside`: a CPU MoE layer's shared expert runs in its own dispatch
    /// after the routed experts', for A/B runs. Default `false` (inside theirs).
    pub shared_experts_beside: bool,
    /// `KRASIS_SHARED_BESIDE=0` (trimmed) sets it `false`: a GPU prefill's shared expert runs
    /// after the routed experts instead of beside them, for A/B runs. Default `true` (any other
    /// value too).
    pub gpu_shared_beside: bool,
    /// `KRASIS_GPU_PROFILE=1`: GPU sessions record CUDA events between each layer's parts and
    /// `krasis bench` prints the device time per part, for measurements. Default `false`.
    pub gpu_profile: bool,
    /// `KRASIS_EXPERT_PREFETCH_AB=1`: a hybrid pulls the predicted next experts during every
    /// other forward call only, so one bench run times both, for diagnosis. Default `false`.
    pub expert_prefetch_ab: bool,
    /// `KRASIS_EXPERT_PREFETCH_MB=N` (trimmed): MiB of the predicted next experts a hybrid pulls
    /// per hand-off (0: no route prediction and no pull), for measurements. Default (`None`; also
    /// for a value that is not a count, silently): 4.
    pub expert_prefetch_mb: Option<usize>,
    /// `KRASIS_GPU_STREAM_SPLIT=F` (trimmed, clamped to [0, 1]): the share of each layer's
    /// experts a hybrid prefill streams to the GPU, whatever the prompt, for measurements.
    /// Default (`None`; also for a value that is not a number, silently): the measured policy.
    pub gpu_stream_split: Option<f64>,
    /// `KRASIS_GPU_STREAM_MIN_TOKENS=N` (not trimmed): the prompt length from which a hybrid
    /// streams experts to the GPU (at least 2), for measurements. Default (`None`; also for a
    /// value that is not a count, silently): the hybrid's option.
    pub gpu_stream_min_tokens: Option<usize>,
    /// `KRASIS_STREAM_FROM=cpu|gpu`: overrides the hybrid's `stream_from` option, to measure
    /// both. Default (`None`; also for any other value): the option.
    pub stream_from: Option<StreamSource>,
    /// `KRASIS_TEST_SCRIPT=file` (non-empty; test only): the batching scheduler makes each
    /// request's reply the file's text (read when the request is admitted, encoded with no BOS,
    /// special-token names as their ids; then the end-of-sequence token) instead of sampling, so that random
    /// weights can exercise the tool-call parsers. Default (`None`): sampling.
    pub test_script: Option<PathBuf>,

    // ---- Caches (krasis-cache) ----
    /// `KRASIS_CACHE_PAGE_CACHE=keep|drop`: whether loading a cache keeps the file's page-cache
    /// copy, for measurements of cold and warm starts. Default (`None`; also for any other
    /// value): kept when RAM holds both copies and a reserve.
    pub page_cache: Option<PageCache>,

    // ---- Where the system keeps things (not knobs; raw, possibly empty) ----
    /// `HOME`: the per-user cache directories are under `$HOME/.cache`.
    pub home: Option<OsString>,
    /// `XDG_CACHE_HOME`: the per-user cache directory, before `$HOME/.cache`.
    pub xdg_cache_home: Option<OsString>,
    /// `CUDA_HOME`: a CUDA installation the GPU libraries are looked for in.
    pub cuda_home: Option<OsString>,
    /// `CUDA_PATH`: another CUDA installation the GPU libraries are looked for in.
    pub cuda_path: Option<OsString>,

    /// Warnings about values that were ignored, one sentence each ([`knobs`] logs them).
    pub warnings: Vec<String>,
}

impl Knobs {
    /// Every variable [`Knobs::from_lookup`] reads, in field order.
    pub const VARIABLES: &'static [&'static str] = &[
        "KRASIS_ISA",
        "KRASIS_PREFETCH",
        "KRASIS_AMX_MIN_ROWS",
        "KRASIS_PREFILL_MATMUL",
        "KRASIS_BF16_MIN_TOKENS",
        "KRASIS_BF16_PANEL_KB",
        "KRASIS_BF16_TASKS",
        "KRASIS_EXPERT_DISPATCH",
        "KRASIS_MLA_EXPAND",
        "KRASIS_MLA_ATTEND",
        "KRASIS_ACT_SPLIT",
        "KRASIS_ATTN_SHARED_KV",
        "KRASIS_ATTN_MAX_TASKS",
        "KRASIS_ATTN_MIN_ROWS",
        "KRASIS_ATTN_TASK_HEADS",
        "KRASIS_DENSE_XQ",
        "KRASIS_MOE_SUM",
        "KRASIS_MOE_W2",
        "KRASIS_MOE_W2_RUN_K",
        "KRASIS_MOE_XQ",
        "KRASIS_MOE_TASKS",
        "KRASIS_TASKS_PER_WORKER",
        "KRASIS_MOE_AFFINE",
        "KRASIS_POOL_YIELD",
        "KRASIS_REQUIRE_AMX",
        "KRASIS_MLA_DECODE",
        "KRASIS_FLASH_KERNEL",
        "KRASIS_PDL",
        "KRASIS_MOE_QTILE",
        "KRASIS_NVRTC_LIB",
        "KRASIS_CUBLAS_LIB",
        "KRASIS_NVRTC_CACHE",
        "KRASIS_MLA_PREFILL",
        "KRASIS_CPU_MLA_DECODE",
        "KRASIS_MLP",
        "KRASIS_KV_B",
        "KRASIS_SHARED_EXPERTS",
        "KRASIS_SHARED_BESIDE",
        "KRASIS_GPU_PROFILE",
        "KRASIS_EXPERT_PREFETCH_AB",
        "KRASIS_EXPERT_PREFETCH_MB",
        "KRASIS_GPU_STREAM_SPLIT",
        "KRASIS_GPU_STREAM_MIN_TOKENS",
        "KRASIS_STREAM_FROM",
        "KRASIS_TEST_SCRIPT",
        "KRASIS_CACHE_PAGE_CACHE",
        "HOME",
        "XDG_CACHE_HOME",
        "CUDA_HOME",
        "CUDA_PATH",
    ];

    /// The knobs as `lookup` gives the variables (`None`: unset). Pure: reads nothing else, and
    /// never fails (see the module docs for invalid values).
    pub fn from_lookup<V: Into<OsString>>(lookup: impl Fn(&str) -> Option<V>) -> Knobs {
        let mut r = Reader { lookup: |name: &str| lookup(name).map(Into::into), warnings: Vec::new() };
        let knobs = Knobs {
            isa: r.text("KRASIS_ISA").map(|v| match v.trim().to_ascii_lowercase().as_str() {
                "scalar" => IsaChoice::Scalar,
                "avx2" => IsaChoice::Avx2,
                "avx512" => IsaChoice::Avx512,
                "amx" => IsaChoice::Amx,
                _ => IsaChoice::Unknown(v),
            }),
            prefetch: r.prefetch("KRASIS_PREFETCH"),
            amx_min_rows: r.count("KRASIS_AMX_MIN_ROWS"),
            prefill_matmul: match r.text("KRASIS_PREFILL_MATMUL").as_deref().map(str::trim) {
                None | Some("") => PrefillMatmul::Auto,
                Some("int8") => PrefillMatmul::Int8,
                Some("bf16") => PrefillMatmul::Bf16,
                Some("bf16-emulated") => PrefillMatmul::Bf16Emulated,
                Some(other) => {
                    r.warn(format!(
                        "KRASIS_PREFILL_MATMUL={other:?} is not int8, bf16 or bf16-emulated; using the default"
                    ));
                    PrefillMatmul::Auto
                }
            },
            bf16_min_tokens: r.count("KRASIS_BF16_MIN_TOKENS"),
            bf16_panel_kb: r.positive("KRASIS_BF16_PANEL_KB"),
            bf16_tasks: r.positive("KRASIS_BF16_TASKS"),
            expert_dispatch_split: match r.text("KRASIS_EXPERT_DISPATCH").as_deref().map(str::trim) {
                None | Some("" | "fused") => false,
                Some("split") => true,
                Some(other) => {
                    r.warn(format!("KRASIS_EXPERT_DISPATCH={other:?} is not fused or split; using fused"));
                    false
                }
            },
            mla_expand_f32: r.text("KRASIS_MLA_EXPAND").is_some_and(|v| v.trim() == "f32"),
            mla_attend_f32: r.text("KRASIS_MLA_ATTEND").is_some_and(|v| v.trim() == "f32"),
            act_split: !r.is("KRASIS_ACT_SPLIT", "0"),
            attn_shared_kv: !r.is("KRASIS_ATTN_SHARED_KV", "0"),
            attn_max_tasks: r.count("KRASIS_ATTN_MAX_TASKS").filter(|&v| v > 0),
            attn_min_rows: r.count("KRASIS_ATTN_MIN_ROWS").filter(|&v| v > 0),
            attn_task_heads: r.count("KRASIS_ATTN_TASK_HEADS"),
            dense_xq_caller: r.is("KRASIS_DENSE_XQ", "caller"),
            moe_sum_serial: r.is("KRASIS_MOE_SUM", "serial"),
            moe_w2: match r.text("KRASIS_MOE_W2").as_deref() {
                Some("whole") => MoeW2::Whole,
                Some("major") => MoeW2::GroupMajor,
                _ => MoeW2::ByGroups,
            },
            moe_w2_run_k: r.positive("KRASIS_MOE_W2_RUN_K"),
            moe_xq: match r.text("KRASIS_MOE_XQ").as_deref() {
                Some("local") => MoeXq::Local,
                Some("local1") => MoeXq::Local1,
                _ => MoeXq::Shared,
            },
            moe_tasks: match r.text("KRASIS_MOE_TASKS").as_deref() {
                Some("guided") => Some(MoeTasks::Guided),
                Some("even") => Some(MoeTasks::Even),
                _ => None,
            },
            tasks_per_worker: r.text("KRASIS_TASKS_PER_WORKER").and_then(|v| v.parse().ok()).filter(|&t| t > 0),
            moe_affine: !r.is("KRASIS_MOE_AFFINE", "0"),
            pool_yield: !r.is("KRASIS_POOL_YIELD", "0"),
            require_amx: r.is("KRASIS_REQUIRE_AMX", "1"),

            mla_decode_general: r.is("KRASIS_MLA_DECODE", "general"),
            flash_kernel: match r.text("KRASIS_FLASH_KERNEL").as_deref() {
                Some("simt") => Some(FlashKernelCap::Simt),
                Some("mma") => Some(FlashKernelCap::Mma),
                Some("fixed") => Some(FlashKernelCap::MmaFixed),
                _ => None,
            },
            pdl: !r.is("KRASIS_PDL", "0"),
            moe_qtile: r.text("KRASIS_MOE_QTILE").and_then(|v| v.parse().ok()),
            nvrtc_lib: r.path("KRASIS_NVRTC_LIB"),
            cublas_lib: r.path("KRASIS_CUBLAS_LIB"),
            nvrtc_cache: r.path("KRASIS_NVRTC_CACHE"),

            mla_prefill: match r.text("KRASIS_MLA_PREFILL").as_deref() {
                Some("absorbed") => Some(MlaPrefill::Absorbed),
                Some("decompressed") => Some(MlaPrefill::Decompressed),
                _ => None,
            },
            cpu_mla_decode: match r.text("KRASIS_CPU_MLA_DECODE").as_deref() {
                Some("attention") => Some(CpuMlaDecode::AttentionOnly),
                Some("split") => Some(CpuMlaDecode::Split),
                _ => None,
            },
            mlp_linears: r.is("KRASIS_MLP", "linears"),
            kv_b_f32: r.is("KRASIS_KV_B", "f32"),
            shared_experts_beside: r.is("KRASIS_SHARED_EXPERTS", "beside"),
            gpu_shared_beside: r.text("KRASIS_SHARED_BESIDE").is_none_or(|v| v.trim() != "0"),
            gpu_profile: r.is("KRASIS_GPU_PROFILE", "1"),
            expert_prefetch_ab: r.is("KRASIS_EXPERT_PREFETCH_AB", "1"),
            expert_prefetch_mb: r.text("KRASIS_EXPERT_PREFETCH_MB").and_then(|v| v.trim().parse().ok()),
            gpu_stream_split: r
                .text("KRASIS_GPU_STREAM_SPLIT")
                .and_then(|v| v.trim().parse::<f64>().ok())
                .map(|f| f.clamp(0.0, 1.0)),
            gpu_stream_min_tokens: r.text("KRASIS_GPU_STREAM_MIN_TOKENS").and_then(|v| v.parse().ok()),
            stream_from: match r.text("KRASIS_STREAM_FROM").as_deref() {
                Some("cpu") => Some(StreamSource::CpuCache),
                Some("gpu") => Some(StreamSource::GpuCache),
                _ => None,
            },
            test_script: r.path("KRASIS_TEST_SCRIPT"),

            page_cache: match r.text("KRASIS_CACHE_PAGE_CACHE").as_deref() {
                Some("keep") => Some(PageCache::Keep),
                Some("drop") => Some(PageCache::Drop),
                _ => None,
            },

            home: r.os("HOME"),
            xdg_cache_home: r.os("XDG_CACHE_HOME"),
            cuda_home: r.os("CUDA_HOME"),
            cuda_path: r.os("CUDA_PATH"),

            warnings: Vec::new(),
        };
        Knobs { warnings: r.warnings, ..knobs }
    }
}

impl Default for Knobs {
    /// Every variable unset.
    fn default() -> Knobs {
        Knobs::from_lookup(|_| None::<OsString>)
    }
}

/// The knobs of this process, read from its environment on the first call (and its warnings
/// logged then); every later call returns the same.
pub fn knobs() -> &'static Knobs {
    static KNOBS: OnceLock<Knobs> = OnceLock::new();
    KNOBS.get_or_init(|| {
        let k = Knobs::from_lookup(|name| std::env::var_os(name));
        for w in &k.warnings {
            tracing::warn!("{w}");
        }
        k
    })
}

/// The lookup with the parsing shared by several variables, collecting warnings.
struct Reader<F> {
    lookup: F,
    warnings: Vec<String>,
}

impl<F: Fn(&str) -> Option<OsString>> Reader<F> {
    fn warn(&mut self, w: String) {
        self.warnings.push(w);
    }

    /// The raw value (paths and system variables).
    fn os(&self, name: &str) -> Option<OsString> {
        (self.lookup)(name)
    }

    /// The value as text; `None` when unset or not Unicode (as `std::env::var(..).ok()`).
    fn text(&self, name: &str) -> Option<String> {
        self.os(name).and_then(|v| v.into_string().ok())
    }

    /// A non-empty value as a path.
    fn path(&self, name: &str) -> Option<PathBuf> {
        self.os(name).filter(|v| !v.is_empty()).map(PathBuf::from)
    }

    /// Whether the value is exactly `value`.
    fn is(&self, name: &str, value: &str) -> bool {
        self.text(name).is_some_and(|v| v == value)
    }

    /// The value as a count (surrounding spaces ignored); a value that is not a count is
    /// reported and gives `None`.
    fn count(&mut self, name: &str) -> Option<usize> {
        let v = self.text(name)?;
        let n = v.trim().parse().ok();
        if n.is_none() {
            self.warn(format!("{name}={v:?} is not a count; ignored (the default stays)"));
        }
        n
    }

    /// The value as a positive count (surrounding spaces ignored), else `None` (unset, zero or
    /// not a count alike, silently).
    fn positive(&self, name: &str) -> Option<usize> {
        self.text(name).and_then(|v| v.trim().parse().ok()).filter(|&v| v > 0)
    }

    /// `hint[:distance]`; an unknown hint is reported and gives `None`.
    fn prefetch(&mut self, name: &str) -> Option<PrefetchChoice> {
        let v = self.text(name)?;
        let (hint, dist) = v.split_once(':').unwrap_or((v.as_str(), ""));
        let hint = match hint.trim() {
            "none" => PrefetchHint::None,
            "nta" => PrefetchHint::Nta,
            "t0" => PrefetchHint::T0,
            "t1" => PrefetchHint::T1,
            other => {
                self.warn(format!("{name} hint {other:?} is not none|nta|t0|t1; using the default"));
                return None;
            }
        };
        Some(PrefetchChoice { hint, distance: dist.trim().parse().ok() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Knobs {
        let map: HashMap<&str, &str> = vars.iter().copied().collect();
        Knobs::from_lookup(|name| map.get(name).map(|v| v.to_string()))
    }

    #[test]
    fn unset_gives_every_default() {
        let k = Knobs::default();
        assert_eq!(k.isa, None);
        assert_eq!(k.prefetch, None);
        assert_eq!(k.prefill_matmul, PrefillMatmul::Auto);
        assert!(k.act_split && k.attn_shared_kv && k.moe_affine && k.pool_yield && k.pdl && k.gpu_shared_beside);
        assert!(!k.expert_dispatch_split && !k.mla_expand_f32 && !k.mla_attend_f32 && !k.dense_xq_caller);
        assert!(!k.moe_sum_serial && !k.require_amx && !k.mla_decode_general && !k.mlp_linears && !k.kv_b_f32);
        assert!(!k.shared_experts_beside && !k.gpu_profile && !k.expert_prefetch_ab);
        assert_eq!((k.moe_w2, k.moe_xq, k.moe_tasks), (MoeW2::ByGroups, MoeXq::Shared, None));
        assert_eq!(k.moe_w2_run_k, None);
        assert_eq!(
            (k.flash_kernel, k.mla_prefill, k.cpu_mla_decode, k.stream_from, k.page_cache),
            (None, None, None, None, None)
        );
        assert_eq!(k.nvrtc_lib, None);
        assert_eq!(k.home, None);
        assert!(k.warnings.is_empty());
    }

    #[test]
    fn reads_exactly_the_listed_variables() {
        let asked = RefCell::new(Vec::new());
        Knobs::from_lookup(|name| {
            asked.borrow_mut().push(name.to_string());
            None::<String>
        });
        assert_eq!(asked.into_inner(), Knobs::VARIABLES);
    }

    #[test]
    fn switches_turn_only_on_their_exact_value() {
        let k = parse(&[
            ("KRASIS_ACT_SPLIT", "0"),
            ("KRASIS_ATTN_SHARED_KV", "0"),
            ("KRASIS_MOE_AFFINE", "0"),
            ("KRASIS_POOL_YIELD", "0"),
            ("KRASIS_PDL", "0"),
            ("KRASIS_SHARED_BESIDE", " 0 "),
            ("KRASIS_DENSE_XQ", "caller"),
            ("KRASIS_MOE_SUM", "serial"),
            ("KRASIS_REQUIRE_AMX", "1"),
            ("KRASIS_MLA_DECODE", "general"),
            ("KRASIS_MLP", "linears"),
            ("KRASIS_KV_B", "f32"),
            ("KRASIS_SHARED_EXPERTS", "beside"),
            ("KRASIS_GPU_PROFILE", "1"),
            ("KRASIS_EXPERT_PREFETCH_AB", "1"),
            ("KRASIS_MLA_EXPAND", " f32"),
            ("KRASIS_MLA_ATTEND", "f32 "),
        ]);
        assert!(!k.act_split && !k.attn_shared_kv && !k.moe_affine && !k.pool_yield && !k.pdl && !k.gpu_shared_beside);
        assert!(k.dense_xq_caller && k.moe_sum_serial && k.require_amx && k.mla_decode_general && k.mlp_linears);
        assert!(k.kv_b_f32 && k.shared_experts_beside && k.gpu_profile && k.expert_prefetch_ab);
        assert!(k.mla_expand_f32 && k.mla_attend_f32);
        // Not trimmed where today's reads did not trim; other values keep the default.
        let k = parse(&[
            ("KRASIS_ACT_SPLIT", " 0"),
            ("KRASIS_PDL", "1"),
            ("KRASIS_GPU_PROFILE", "1 "),
            ("KRASIS_MLP", "Linears"),
            ("KRASIS_SHARED_BESIDE", "1"),
        ]);
        assert!(k.act_split && k.pdl && !k.gpu_profile && !k.mlp_linears && k.gpu_shared_beside);
        assert!(k.warnings.is_empty());
    }

    #[test]
    fn choices_parse_and_unknown_values_keep_the_default() {
        let k = parse(&[
            ("KRASIS_MOE_W2", "major"),
            ("KRASIS_MOE_XQ", "local1"),
            ("KRASIS_MOE_TASKS", "even"),
            ("KRASIS_FLASH_KERNEL", "fixed"),
            ("KRASIS_MLA_PREFILL", "absorbed"),
            ("KRASIS_CPU_MLA_DECODE", "attention"),
            ("KRASIS_STREAM_FROM", "gpu"),
            ("KRASIS_CACHE_PAGE_CACHE", "drop"),
            ("KRASIS_PREFILL_MATMUL", " bf16-emulated "),
            ("KRASIS_EXPERT_DISPATCH", "split"),
        ]);
        assert_eq!((k.moe_w2, k.moe_xq, k.moe_tasks), (MoeW2::GroupMajor, MoeXq::Local1, Some(MoeTasks::Even)));
        assert_eq!(k.flash_kernel, Some(FlashKernelCap::MmaFixed));
        assert_eq!((k.mla_prefill, k.cpu_mla_decode), (Some(MlaPrefill::Absorbed), Some(CpuMlaDecode::AttentionOnly)));
        assert_eq!((k.stream_from, k.page_cache), (Some(StreamSource::GpuCache), Some(PageCache::Drop)));
        assert_eq!(k.prefill_matmul, PrefillMatmul::Bf16Emulated);
        assert!(k.expert_dispatch_split);
        assert!(k.warnings.is_empty());

        let k = parse(&[
            ("KRASIS_MOE_W2", "Whole"),
            ("KRASIS_MOE_TASKS", "sometimes"),
            ("KRASIS_STREAM_FROM", " cpu"),
            ("KRASIS_CACHE_PAGE_CACHE", "yes"),
            ("KRASIS_PREFILL_MATMUL", "fp8"),
            ("KRASIS_EXPERT_DISPATCH", "both"),
        ]);
        assert_eq!((k.moe_w2, k.moe_tasks, k.stream_from, k.page_cache), (MoeW2::ByGroups, None, None, None));
        assert_eq!((k.prefill_matmul, k.expert_dispatch_split), (PrefillMatmul::Auto, false));
        assert_eq!(k.warnings.len(), 2, "{:?}", k.warnings);
        assert!(k.warnings[0].contains("KRASIS_PREFILL_MATMUL=\"fp8\""), "{:?}", k.warnings);
        assert!(k.warnings[1].contains("KRASIS_EXPERT_DISPATCH=\"both\""), "{:?}", k.warnings);
    }

    #[test]
    fn isa_is_trimmed_in_any_case_and_keeps_an_unknown_name() {
        assert_eq!(parse(&[("KRASIS_ISA", " AVX2 ")]).isa, Some(IsaChoice::Avx2));
        assert_eq!(parse(&[("KRASIS_ISA", "Amx")]).isa, Some(IsaChoice::Amx));
        assert_eq!(parse(&[("KRASIS_ISA", "sse9")]).isa, Some(IsaChoice::Unknown("sse9".into())));
    }

    #[test]
    fn counts_follow_each_variables_rule() {
        let k = parse(&[
            ("KRASIS_AMX_MIN_ROWS", " 8 "),
            ("KRASIS_BF16_MIN_TOKENS", "many"),
            ("KRASIS_BF16_PANEL_KB", "0"),
            ("KRASIS_BF16_TASKS", " 6"),
            ("KRASIS_ATTN_MAX_TASKS", "0"),
            ("KRASIS_ATTN_MIN_ROWS", "x"),
            ("KRASIS_ATTN_TASK_HEADS", "0"),
            ("KRASIS_TASKS_PER_WORKER", " 3"),
            ("KRASIS_MOE_W2_RUN_K", " 64 "),
            ("KRASIS_MOE_QTILE", "1"),
            ("KRASIS_EXPERT_PREFETCH_MB", " 0 "),
            ("KRASIS_GPU_STREAM_SPLIT", " 1.5"),
            ("KRASIS_GPU_STREAM_MIN_TOKENS", "64"),
        ]);
        assert_eq!(k.amx_min_rows, Some(8));
        assert_eq!(k.bf16_min_tokens, None);
        assert_eq!((k.bf16_panel_kb, k.bf16_tasks), (None, Some(6)));
        assert_eq!((k.attn_max_tasks, k.attn_min_rows, k.attn_task_heads), (None, None, Some(0)));
        assert_eq!(k.tasks_per_worker, None, "not trimmed");
        assert_eq!(k.moe_w2_run_k, Some(64));
        assert_eq!((k.moe_qtile, k.expert_prefetch_mb), (Some(1), Some(0)));
        assert_eq!((k.gpu_stream_split, k.gpu_stream_min_tokens), (Some(1.0), Some(64)));
        // Only the counts that warned before warn now.
        assert_eq!(k.warnings.len(), 2, "{:?}", k.warnings);
        assert!(k.warnings[0].starts_with("KRASIS_BF16_MIN_TOKENS=\"many\" is not a count"), "{:?}", k.warnings);
        assert!(k.warnings[1].starts_with("KRASIS_ATTN_MIN_ROWS=\"x\""), "{:?}", k.warnings);
    }

    #[test]
    fn prefetch_takes_a_hint_and_an_optional_distance() {
        let p = |v: &str| parse(&[("KRASIS_PREFETCH", v)]);
        assert_eq!(p("t1:8192").prefetch, Some(PrefetchChoice { hint: PrefetchHint::T1, distance: Some(8192) }));
        assert_eq!(p(" none ").prefetch, Some(PrefetchChoice { hint: PrefetchHint::None, distance: None }));
        assert_eq!(p("nta:far").prefetch, Some(PrefetchChoice { hint: PrefetchHint::Nta, distance: None }));
        let k = p("t2:64");
        assert_eq!(k.prefetch, None);
        assert_eq!(k.warnings, ["KRASIS_PREFETCH hint \"t2\" is not none|nta|t0|t1; using the default"]);
    }

    #[test]
    fn paths_must_be_non_empty_and_system_variables_stay_raw() {
        let k = parse(&[("KRASIS_NVRTC_LIB", ""), ("KRASIS_CUBLAS_LIB", "/opt/libcublas.so.12"), ("HOME", "")]);
        assert_eq!(k.nvrtc_lib, None);
        assert_eq!(k.cublas_lib, Some(PathBuf::from("/opt/libcublas.so.12")));
        assert_eq!(k.home, Some(OsString::new()));
    }

    #[cfg(unix)]
    #[test]
    fn a_value_that_is_not_unicode_counts_as_unset_except_for_paths() {
        use std::os::unix::ffi::OsStringExt;
        let bad = || Some(OsString::from_vec(vec![0x66, 0xff]));
        let k = Knobs::from_lookup(|name| match name {
            "KRASIS_PDL" | "KRASIS_ISA" | "KRASIS_NVRTC_CACHE" => bad(),
            _ => None,
        });
        assert!(k.pdl);
        assert_eq!(k.isa, None);
        assert_eq!(k.nvrtc_cache, Some(PathBuf::from(OsString::from_vec(vec![0x66, 0xff]))));
    }
}
