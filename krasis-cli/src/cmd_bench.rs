//! `krasis bench`: the memory-bandwidth probe and CPU decode throughput, in one run so every
//! GB/s figure comes with the machine's own measured bandwidth.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args as ClapArgs;
use krasis_core::memory::PageBuffer;
use krasis_cpu::isa::Isa;
use krasis_cpu::membw::{default_probe_bytes, read_bandwidth, BandwidthProbe, MembwReport};
use krasis_cpu::moe::{ExpertJob, ExpertWeights, PoolExperts, W2Mode};
use krasis_cpu::moe_trace::TraceSummary;
use krasis_cpu::pool::{PoolPlan, WorkerPool};
use krasis_model::runtime::{open_engine, Engine, EngineConfig, ForwardBreakdown, Opened};
use krasis_model::source::files::ModelFiles;
use krasis_model::text::sampling::{Sampler, SamplingParams};
use krasis_quant::cpu_layout::{pack, pack_w13, PackedLayout};
use krasis_quant::group::quantize;
use krasis_quant::Bits;
use serde_json::json;

use crate::cmd_generate::{Device, EngineArgs, GpuArgs};

#[derive(ClapArgs)]
pub struct Args {
    /// Model directory or GGUF file (omit with --membw for the bandwidth probe alone).
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Measure the host's streaming read bandwidth (all physical cores, buffer ≫ L3).
    #[arg(long)]
    membw: bool,
    /// Bytes for the bandwidth probe, e.g. 512MiB (default 2 GiB, less on small machines).
    #[arg(long, value_parser = parse_size)]
    pub(crate) membw_bytes: Option<usize>,
    /// Decode steps to time.
    #[arg(long, default_value_t = 32)]
    pub(crate) decode_tokens: usize,
    /// Prompt length before decoding (random ids).
    #[arg(long, default_value_t = 16)]
    pub(crate) prompt_tokens: usize,
    /// Prefills of the prompt to time on the CPU and hybrid engines, each in a fresh session:
    /// with more than one, the first (cold) is shown apart and the median of the rest is reported.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub(crate) prefill_reps: u32,
    /// Decode runs of --decode-tokens steps to time, each after its own untimed prefill of the
    /// prompt in a fresh session: the median is reported, the per-stage lines are the last run's.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub(crate) decode_reps: u32,
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
    /// Time expert GEMVs (M=1) on V2-Lite expert shapes per ISA and format (INT4 g128, asymmetric
    /// INT4 g32, INT8 g128, MXFP4, NVFP4), cycling over
    /// distinct copies far larger than the last-level cache, against the probe's bandwidth.
    #[arg(long)]
    expert_gemv: bool,
    /// Bytes of distinct expert copies for --expert-gemv, e.g. 512MiB (default 2 GiB).
    #[arg(long, default_value = "2GiB", hide_default_value = true, value_parser = parse_size)]
    gemv_bytes: usize,
    /// Only these ISAs for --expert-gemv (comma-separated: scalar,avx2,avx512; default all this
    /// CPU has).
    #[arg(long, value_delimiter = ',')]
    gemv_isa: Vec<String>,
    /// Pin the calling thread to worker 0's core during --expert-gemv (the engine does not; for
    /// diagnosis).
    #[arg(long)]
    gemv_pin_caller: bool,
    /// After timing --expert-gemv, run one more pass per case with per-task timestamps and print
    /// where the time of a dispatch goes (wake-up, w13/w2 phases, waits, tail, serial sum).
    #[arg(long)]
    gemv_trace: bool,
    /// After timing --expert-gemv, time runner variants (serial/fused sum, shared/per-worker
    /// activation quantisation, even/guided tasks) in interleaved passes, so the machine's drift
    /// affects all alike; best and median GB/s of this many passes each.
    #[arg(long, default_value_t = 0)]
    gemv_compare: usize,
    /// Aggregate decode tok/s of this many concurrent streams through the server's scheduler,
    /// each count in turn (e.g. 1,2,4,8), on --device; --decode-tokens per stream.
    #[arg(long, value_delimiter = ',')]
    streams: Vec<usize>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub(crate) json: bool,
    /// Time the GPU attention kernels at V2-Lite shapes (MLA prefill at 8K tokens, absorbed MLA
    /// decode at 4K context, GQA prefill) against the GPU's peaks.
    #[arg(long)]
    gpu_attention: bool,
    /// Where --model runs: cpu | gpu (whole model on the GPU) | hybrid (experts on the CPU, the
    /// rest on the GPU; also measures the bandwidth probe in the same run) | auto (as `generate`
    /// chooses: the GPU when the whole model fits, else hybrid; the CPU without a GPU)
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    #[command(flatten)]
    pub(crate) gpu: GpuArgs,
}

/// A size flag: a byte count or a size with a binary unit (`2GiB`, `512M`).
fn parse_size(s: &str) -> Result<usize, String> {
    let b = krasis_core::budget::parse_bytes(s).map_err(String::from)?;
    usize::try_from(b).map_err(|_| "too large".to_string())
}

/// One V2-Lite-shaped expert (w13 2×1408×2048, w2 2048×1408) packed at `bits`; the GGUF K-quant
/// formats, whose K must be a multiple of 256, at hidden 2048 and width 1536.
fn packed_expert(format: GemvFormat) -> (Vec<u8>, PackedLayout, Vec<u8>, PackedLayout) {
    let (h, i) = (2048usize, 1408usize);
    if let Some((k13, k2)) = format.kquants() {
        // Random Q4_K / Q6_K blocks kept as stored (`--cpu-expert-bits auto` on a Q4_K_M GGUF).
        use krasis_quant::kquant;
        let i = KQUANT_GEMV_INTER;
        let (gate, up) = (kquant::test_matrix(k13, i, h, 1), kquant::test_matrix(k13, i, h, 2));
        let down = kquant::test_matrix(k2, h, i, 3);
        let (w13, l13) = kquant::pack_w13(&gate, &up).expect("shapes");
        return (w13, l13, kquant::pack(&down), kquant::layout_of(&down));
    }
    if let Some(kind) = format.fp4() {
        // The stored FP4 blocks (random codes and scales), packed in their CPU layout.
        use krasis_quant::fp4;
        let (gate, up, down) =
            (fp4::test_matrix(kind, i, h, 1), fp4::test_matrix(kind, i, h, 2), fp4::test_matrix(kind, h, i, 3));
        let l13 = fp4::w13_layout(&gate, &up).expect("shapes");
        let mut w13 = vec![0u8; l13.bytes()];
        fp4::pack_w13_into(&gate, &up, &mut w13).expect("shapes");
        return (w13, l13, fp4::pack(&down), fp4::layout_of(&down));
    }
    let (bits, asym) = (format.bits(), format == GemvFormat::Int4a);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut rnd = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    };
    if asym {
        // Asymmetric INT4 g32 (`--cpu-expert-bits 4a`).
        let q = |w: Vec<f32>, rows, k| krasis_quant::int4_asym::quantize(&w, rows, k).expect("K a multiple of 32");
        let (gate, up, down) = (q(rnd(i * h), i, h), q(rnd(i * h), i, h), q(rnd(h * i), h, i));
        let (w13, l13) = krasis_quant::int4_asym::pack_w13(&gate, &up).expect("shapes");
        return (w13, l13, krasis_quant::int4_asym::pack(&down), krasis_quant::int4_asym::layout_of(&down));
    }
    let gate = quantize(&rnd(i * h), i, h, bits, 128);
    let up = quantize(&rnd(i * h), i, h, bits, 128);
    let down = quantize(&rnd(h * i), h, i, bits, 128);
    let (w13, l13) = pack_w13(&gate, &up).expect("shapes");
    (w13, l13, pack(&down), PackedLayout::of(&down))
}

/// The expert width of the K-quant formats in `--expert-gemv` (V2-Lite's 1408 is no multiple of
/// Q6_K's 256; 1536 is the nearest that is).
const KQUANT_GEMV_INTER: usize = 1536;

/// The expert formats `--expert-gemv` times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GemvFormat {
    Int4,
    Int4a,
    Int8,
    Mxfp4,
    Nvfp4,
    /// w13 and w2 in Q4_K as stored.
    Q4K,
    /// w13 Q4_K, w2 Q6_K (Q4_K_M's layers whose down is Q6_K).
    Q4KM,
    /// w13 and w2 in Q6_K as stored.
    Q6K,
}

impl GemvFormat {
    const ALL: [GemvFormat; 8] = [
        GemvFormat::Int4,
        GemvFormat::Int4a,
        GemvFormat::Int8,
        GemvFormat::Mxfp4,
        GemvFormat::Nvfp4,
        GemvFormat::Q4K,
        GemvFormat::Q4KM,
        GemvFormat::Q6K,
    ];

    fn name(self) -> &'static str {
        match self {
            GemvFormat::Int4 => "int4",
            GemvFormat::Int4a => "int4a",
            GemvFormat::Int8 => "int8",
            GemvFormat::Mxfp4 => "mxfp4",
            GemvFormat::Nvfp4 => "nvfp4",
            GemvFormat::Q4K => "q4_k",
            GemvFormat::Q4KM => "q4_k/q6_k",
            GemvFormat::Q6K => "q6_k",
        }
    }

    /// The K-quants of w13 and w2, for the GGUF formats kept as stored.
    fn kquants(self) -> Option<(krasis_quant::kquant::KQuant, krasis_quant::kquant::KQuant)> {
        use krasis_quant::kquant::KQuant;
        match self {
            GemvFormat::Q4K => Some((KQuant::Q4K, KQuant::Q4K)),
            GemvFormat::Q4KM => Some((KQuant::Q4K, KQuant::Q6K)),
            GemvFormat::Q6K => Some((KQuant::Q6K, KQuant::Q6K)),
            _ => None,
        }
    }

    /// The integer width (FP4 codes are 4 bits; Q6_K's 6 count as 8).
    fn bits(self) -> Bits {
        if matches!(self, GemvFormat::Int8 | GemvFormat::Q6K) {
            Bits::Int8
        } else {
            Bits::Int4
        }
    }

    fn fp4(self) -> Option<krasis_quant::fp4::Fp4Kind> {
        match self {
            GemvFormat::Mxfp4 => Some(krasis_quant::fp4::Fp4Kind::Mxfp4),
            GemvFormat::Nvfp4 => Some(krasis_quant::fp4::Fp4Kind::Nvfp4),
            _ => None,
        }
    }
}

/// `n ≥ 8` distinct copies of one packed expert (w13 then w2, `rec` bytes each) filling `total`
/// bytes of huge-page memory, so the timed loop streams from DRAM rather than cache.
fn expert_copies(
    format: GemvFormat,
    total: usize,
) -> anyhow::Result<(PageBuffer, usize, usize, usize, PackedLayout, PackedLayout)> {
    let (w13, l13, w2, l2) = packed_expert(format);
    let rec = w13.len() + w2.len();
    let n = (total / rec).max(8);
    let mut buf = PageBuffer::new(n * rec)?;
    buf.advise_huge_pages();
    for (e, chunk) in buf.as_mut_slice().chunks_exact_mut(rec).enumerate() {
        chunk[..w13.len()].copy_from_slice(&w13);
        chunk[w13.len()..].copy_from_slice(&w2);
        chunk[0] = e as u8; // distinct pages, same numbers of note
    }
    Ok((buf, n, rec, w13.len(), l13, l2))
}

/// A pool of its own for the bandwidth probe (`--threads`) and the probe's size
/// (`--membw-bytes`, else [`default_probe_bytes`]).
fn probe_pool(a: &Args) -> anyhow::Result<(WorkerPool, usize)> {
    let sys = krasis_core::hw::probe();
    let pool = WorkerPool::new(PoolPlan::from_system(&sys, a.engine.threads))?;
    Ok((pool, a.membw_bytes.unwrap_or_else(|| default_probe_bytes(&sys))))
}

/// The host's streaming read bandwidth on a pool that is gone before any model loads: the
/// figure every GB/s of a run is compared with.
pub(crate) fn probe_bandwidth(a: &Args) -> anyhow::Result<MembwReport> {
    let (pool, bytes) = probe_pool(a)?;
    Ok(read_bandwidth(&pool, bytes, 5)?)
}

/// `n` pseudo-random token ids in `2..vocab` (a fixed xorshift sequence: runs are comparable).
pub(crate) fn random_prompt(vocab: usize, n: usize) -> Vec<u32> {
    let v = vocab.max(3) as u64;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (2 + x % (v - 2)) as u32
        })
        .collect()
}

/// Opens `dir` as `config` asks: warnings to stderr and, with `text`, the device line and the load
/// log to stdout. Returns the engine and the load time in seconds.
pub(crate) fn open_for_bench(dir: &Path, config: &EngineConfig, text: bool) -> anyhow::Result<(Opened, f64)> {
    let t = Instant::now();
    let opened = ModelFiles::open(dir)
        .and_then(|files| open_engine(&files, config))
        .with_context(|| format!("loading {}", dir.display()))?;
    let load_s = t.elapsed().as_secs_f64();
    for w in &opened.warnings {
        eprintln!("warning: {}", crate::flags::with_flags(w));
    }
    if text {
        println!("{}", crate::flags::with_flags(&opened.why));
        for l in &opened.placement {
            println!("{}", crate::flags::with_flags(l));
        }
        for l in &opened.log {
            println!("{}", crate::flags::with_flags(l));
        }
    }
    Ok((opened, load_s))
}

/// The stage counters the bench prints (MLA prefill, BF16 expert dispatches, the engine's
/// "other" stages, MLA layers), read at one moment.
#[derive(Clone, Copy, Default)]
struct StageCounters {
    mla: [u64; 2],
    experts: [u64; 8],
    other: [u64; 5],
    layer: [u64; 7],
}

impl StageCounters {
    fn now() -> Self {
        StageCounters {
            mla: krasis_cpu::mla_prefill::phase_ns(),
            experts: krasis_cpu::prefill_bf16::expert_phase_ns(),
            other: krasis_model::cpu::other_phase_ns(),
            layer: krasis_model::cpu::attention::mla_phase_ns(),
        }
    }

    /// Counts since `before`.
    fn since(self, before: StageCounters) -> Self {
        fn d<const N: usize>(a: [u64; N], b: [u64; N]) -> [u64; N] {
            std::array::from_fn(|i| a[i].saturating_sub(b[i]))
        }
        StageCounters {
            mla: d(self.mla, before.mla),
            experts: d(self.experts, before.experts),
            other: d(self.other, before.other),
            layer: d(self.layer, before.layer),
        }
    }
}

/// What [`time_greedy_decode`] measured.
struct GreedyTiming {
    /// Seconds of each prefill, in order (the first one cold: fresh scratch, weights first read).
    prefill_s: Vec<f64>,
    /// Where the last prefill's forward time went.
    prefill_parts: ForwardBreakdown,
    /// Stage counters over the last prefill alone.
    prefill_stages: StageCounters,
    /// Seconds of each decode run, in order.
    decode_rep_s: Vec<f64>,
    /// The decode time the bench reports: the median run's.
    decode_s: f64,
    /// Stage counters over the last decode run.
    decode_stages: StageCounters,
    /// Probe GB/s (best repetition) right before each decode run and after the last one: run
    /// `i` lies between `decode_probe_gbs[i]` and `[i + 1]`.
    decode_probe_gbs: Vec<f64>,
}

impl GreedyTiming {
    /// The prefill time the bench reports ([`warm_median`]).
    fn reported_prefill_s(&self) -> f64 {
        warm_median(&self.prefill_s)
    }
}

/// The median of `v` (the upper one of an even count); `v` must not be empty.
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// What a bench reports of repeated runs whose first is cold: the only one, or the median of the
/// warm repeats (what llama-bench reports too, after its warm-up run, is a mean over repeats).
pub(crate) fn warm_median(runs: &[f64]) -> f64 {
    median(if runs.len() > 1 { &runs[1..] } else { runs })
}

/// Times `prefill_reps` prefills of one random prompt (each in a fresh session), then
/// `decode_tokens` greedy steps after the last one. The engine's `ForwardStats` then hold the
/// decode alone. `probe` measures the host's bandwidth right before every decode run and after
/// the last one.
fn time_greedy_decode(
    engine: &dyn Engine,
    prompt_tokens: usize,
    decode_tokens: usize,
    prefill_reps: usize,
    decode_reps: usize,
    probe: &mut dyn FnMut() -> f64,
) -> anyhow::Result<GreedyTiming> {
    let prompt = random_prompt(engine.spec().vocab_size, prompt_tokens);
    let mut greedy = Sampler::new(SamplingParams::default());
    let mut prefill_s = Vec::new();
    let mut before = StageCounters::now();
    let mut session = engine.new_session()?;
    let mut next = 0;
    for rep in 0..prefill_reps.max(1) {
        if rep > 0 {
            drop(session);
            session = engine.new_session()?;
            before = StageCounters::now();
        }
        engine.reset_stats(None);
        let t = Instant::now();
        next = engine.step_one(session.as_mut(), &prompt, &mut greedy, false)?.token;
        prefill_s.push(t.elapsed().as_secs_f64());
    }
    let prefill_stages = StageCounters::now().since(before);
    let prefill_parts = engine.stats(None).forward.unwrap_or_default();
    let (mut decode_rep_s, mut decode_stages) = (Vec::new(), StageCounters::now());
    let mut decode_probe_gbs = Vec::new();
    for rep in 0..decode_reps.max(1) {
        if rep > 0 {
            // The same context lengths as the first run: a fresh session and the same prompt.
            drop(session);
            session = engine.new_session()?;
            next = engine.step_one(session.as_mut(), &prompt, &mut greedy, false)?.token;
        }
        decode_probe_gbs.push(probe());
        engine.reset_stats(None);
        let (t, before) = (Instant::now(), StageCounters::now());
        for _ in 0..decode_tokens {
            next = engine.step_one(session.as_mut(), &[next], &mut greedy, false)?.token;
        }
        decode_rep_s.push(t.elapsed().as_secs_f64());
        decode_stages = StageCounters::now().since(before);
    }
    decode_probe_gbs.push(probe());
    Ok(GreedyTiming {
        prefill_s,
        prefill_parts,
        prefill_stages,
        decode_s: median(&decode_rep_s),
        decode_rep_s,
        decode_stages,
        decode_probe_gbs,
    })
}

/// Timed repetitions of each probe around a decode run: two of ≥ 50 ms each (about 0.15 s with
/// the warm-up on the GPU box), short beside a 64-token run; the best is kept, as for the probe
/// before the load.
const PROBE_AROUND_REPS: usize = 2;

/// Pause between the engine's work and a probe (and back): the pools' idle workers spin for
/// [`krasis_cpu::pool::SPIN_BEFORE_PARK`] (1 ms) before they sleep; 10 ms leaves every spinner
/// of one pool parked before the other pool streams.
const PROBE_SETTLE: std::time::Duration = std::time::Duration::from_millis(10);

/// All weights' GB/s of each decode run against the probe around it: the better (higher) of the
/// probes right before and right after the run, so a run is never flattered by a dip.
fn bracketed_fractions(rep_gbs: &[f64], probes: &[f64]) -> Vec<f64> {
    rep_gbs.iter().zip(probes.windows(2)).map(|(g, w)| g / w[0].max(w[1]).max(1e-9)).collect()
}

/// The same strict test applied to the probe itself: each probe against the higher of its
/// neighbours (one neighbour at either end). A pure streaming loop scores this, so values well
/// below 100 % are the host's noise, not the engine's.
fn probe_self_fractions(probes: &[f64]) -> Vec<f64> {
    if probes.len() < 2 {
        return Vec::new();
    }
    (0..probes.len())
        .map(|i| {
            let before = if i > 0 { probes[i - 1] } else { 0.0 };
            let after = probes.get(i + 1).copied().unwrap_or(0.0);
            probes[i] / before.max(after).max(1e-9)
        })
        .collect()
}

/// GB/s of expert weights streamed by M=1 expert forwards over `pool`: one expert per dispatch
/// pair, and the top-6 of a token per dispatch pair.
/// Also returns the bytes of one expert.
/// With `trace`, also the timelines of one traced pass per case (one expert, top-6).
fn expert_gemv(
    pool: &WorkerPool,
    isa: Isa,
    format: GemvFormat,
    total: usize,
    trace: bool,
) -> anyhow::Result<(f64, f64, usize, Option<[TraceSummary; 2]>)> {
    let (buf, n, rec, w13_len, l13, l2) = expert_copies(format, total)?;
    let runner = PoolExperts::new(pool, l13, l2);
    // Room for every task of one traced pass (at most one per row block, pair or group).
    let traced =
        trace.then(|| PoolExperts::new(pool, l13, l2).with_trace(pool, 3 * n * (l13.row_blocks() + l2.row_blocks())));
    let x: Vec<f32> = (0..l13.k).map(|k| ((k * 7919) % 101) as f32 / 50.0 - 1.0).collect();
    let mut out = vec![0f32; l13.k];
    let data = buf.as_slice();
    let expert = |e: usize| ExpertWeights {
        w13: &data[e * rec..e * rec + w13_len],
        w2: &data[e * rec + w13_len..(e + 1) * rec],
        node: 0,
    };
    let tok = [(0usize, 1.0f32)];
    let mut pass = |runner: &PoolExperts, group: usize| -> f64 {
        let t = Instant::now();
        for start in (0..n - n % group).step_by(group) {
            let jobs: Vec<ExpertJob> =
                (start..start + group).map(|e| ExpertJob { weights: expert(e), tokens: &tok }).collect();
            runner.run(pool, isa, &x, l13.k, &jobs, &mut out);
        }
        ((n - n % group) * rec) as f64 / 1e9 / t.elapsed().as_secs_f64()
    };
    let mut time = |group: usize| (0..3).map(|_| pass(&runner, group)).fold(0f64, f64::max);
    let one = time(1);
    let six = time(6);
    let summaries = traced.map(|r| {
        [1, 6].map(|group| {
            pass(&r, group);
            r.take_trace_summary().expect("traced runner")
        })
    });
    Ok((one, six, rec, summaries))
}

/// Runner variants of `--gemv-compare`: (name, per-worker x rows, guided tasks, w2 tasks per
/// worker (group ranges when group-major), how w2 consumes the intermediate); all with the
/// weighted sum inside the dispatch.
const VARIANTS: [(&str, usize, bool, usize, W2Mode); 9] = [
    ("even, w2 by groups, 2", 0, false, 2, W2Mode::ByGroups),
    ("even, w2 group-major, 2 ranges", 0, false, 2, W2Mode::GroupMajor),
    ("even, w2 group-major, 3 ranges", 0, false, 3, W2Mode::GroupMajor),
    ("even, w2 group-major, 4 ranges", 0, false, 4, W2Mode::GroupMajor),
    ("guided, w2 by groups, 2", 0, true, 2, W2Mode::ByGroups),
    ("guided, w2 group-major, 2 ranges", 0, true, 2, W2Mode::GroupMajor),
    ("guided, w2 group-major, 3 ranges", 0, true, 3, W2Mode::GroupMajor),
    ("even, w2 by groups, 2, local x", 2, false, 2, W2Mode::ByGroups),
    ("even, w2 group-major, 2 ranges, local x", 2, false, 2, W2Mode::GroupMajor),
];

/// `--gemv-compare`: per variant, (best, median) GB/s one expert and top-6 per dispatch, over
/// `reps` interleaved passes.
fn expert_gemv_compare(
    pool: &WorkerPool,
    isa: Isa,
    bits: Bits,
    total: usize,
    reps: usize,
) -> anyhow::Result<Vec<(&'static str, [f64; 4])>> {
    let format = if bits == Bits::Int8 { GemvFormat::Int8 } else { GemvFormat::Int4 };
    let (buf, n, rec, w13_len, l13, l2) = expert_copies(format, total)?;
    let runners: Vec<PoolExperts> = VARIANTS
        .iter()
        .map(|&(_, local, guided, tpw2, mode)| {
            PoolExperts::new(pool, l13, l2)
                .with_fused_sum(true)
                .with_local_x_rows(local)
                .with_guided_tasks(guided)
                .with_w2_tasks_per_worker(tpw2)
                .with_w2_mode(mode)
        })
        .collect();
    let x: Vec<f32> = (0..l13.k).map(|k| ((k * 7919) % 101) as f32 / 50.0 - 1.0).collect();
    let mut out = vec![0f32; l13.k];
    let data = buf.as_slice();
    let tok = [(0usize, 1.0f32)];
    let mut samples = vec![[Vec::new(), Vec::new()]; VARIANTS.len()];
    for _ in 0..reps.max(1) {
        for (gi, group) in [1usize, 6].into_iter().enumerate() {
            for (v, runner) in runners.iter().enumerate() {
                let t = Instant::now();
                for start in (0..n - n % group).step_by(group) {
                    let jobs: Vec<ExpertJob> = (start..start + group)
                        .map(|e| ExpertJob {
                            weights: ExpertWeights {
                                w13: &data[e * rec..e * rec + w13_len],
                                w2: &data[e * rec + w13_len..(e + 1) * rec],
                                node: 0,
                            },
                            tokens: &tok,
                        })
                        .collect();
                    runner.run(pool, isa, &x, l13.k, &jobs, &mut out);
                }
                samples[v][gi].push(((n - n % group) * rec) as f64 / 1e9 / t.elapsed().as_secs_f64());
            }
        }
    }
    let stats = |s: &mut Vec<f64>| {
        s.sort_by(f64::total_cmp);
        (s[s.len() - 1], s[s.len() / 2])
    };
    Ok(VARIANTS
        .iter()
        .zip(samples.iter_mut())
        .map(|(&(name, ..), [one, six])| {
            let (ob, om) = stats(one);
            let (sb, sm) = stats(six);
            (name, [ob, om, sb, sm])
        })
        .collect())
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.model.is_none() && !a.membw && !a.expert_gemv && !a.gpu_attention {
        bail!("give --model DIR (decode benchmark), --membw (bandwidth probe), --expert-gemv and/or --gpu-attention");
    }
    if a.decode_tokens == 0 || a.prompt_tokens == 0 {
        bail!("--decode-tokens and --prompt-tokens must be at least 1");
    }
    // `auto` benchmarks the engine the library's device choice opens, as `generate` runs it: the
    // CPU benchmark when that is the CPU, else the GPU one (whole model or hybrid, as chosen).
    // The engine is still opened with `auto`, so its device line says why.
    let device = match (a.device, &a.model) {
        (Device::Auto, Some(dir)) => {
            let config = a.engine.config(a.device, &a.gpu, (a.prompt_tokens + a.decode_tokens) as u64)?;
            let files = krasis_model::source::files::ModelFiles::open(dir)?;
            let choice = krasis_model::runtime::device_choice(&files, &config)?;
            match choice.path {
                krasis_model::runtime::DevicePath::Cpu => {
                    eprintln!("notice: {}", crate::flags::with_flags(&choice.why));
                    Device::Cpu
                }
                _ => Device::Auto,
            }
        }
        (Device::Auto, None) if krasis_gpu::probe().is_err() => {
            eprintln!("notice: no GPU in use; running on the CPU");
            Device::Cpu
        }
        (d, _) => d,
    };
    if !a.streams.is_empty() {
        let dir = a.model.as_ref().context("--streams needs --model")?;
        let config = a.engine.config(a.device, &a.gpu, (a.prompt_tokens + a.decode_tokens) as u64)?;
        let out =
            crate::cmd_bench_streams::streams(dir, &config, &a.streams, a.prompt_tokens, a.decode_tokens, !a.json)?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
        return Ok(());
    }
    if a.gpu_attention || device != Device::Cpu {
        if a.membw || a.expert_gemv {
            bail!("--membw/--expert-gemv are CPU benchmarks; run them separately from --gpu-attention / --device gpu");
        }
        if let Err(e) = krasis_gpu::probe() {
            bail!("GPU benchmark: {e}");
        }
        let mut out = json!({});
        if a.gpu_attention {
            out["attention"] = crate::cmd_bench_gpu::attention(a.gpu.gpu, a.gpu.vram_budget, !a.json)?;
        }
        if let Some(dir) = &a.model {
            let config = a.engine.config(device, &a.gpu, (a.prompt_tokens + a.decode_tokens) as u64)?;
            out["model"] = if device == Device::Hybrid {
                crate::cmd_bench_hybrid::model(dir, &a, &config, !a.json)?
            } else {
                crate::cmd_bench_gpu::model(dir, &config, a.prompt_tokens, a.decode_tokens, !a.json)?
            };
        }
        if a.json {
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
        return Ok(());
    }
    let sys = krasis_core::hw::probe();
    let bw = probe_bandwidth(&a)?;
    let mut out = json!({
        "membw": { "gb_per_s": bw.gb_per_s, "median_gb_per_s": bw.median_gb_per_s, "bytes": bw.bytes,
                   "threads": bw.threads, "isa": bw.isa.name(), "pinned": bw.pinned },
        "cpu": sys.cpu_model, "physical_cores": sys.physical_cores,
    });
    if !a.json {
        println!("{}", bw.summary());
    }
    if a.expert_gemv {
        let pool = WorkerPool::new(PoolPlan::from_system(&sys, a.engine.threads))?;
        let _pin = if a.gemv_pin_caller { Some(pool.pin_caller()?) } else { None };
        let mut isas = Isa::available();
        if !a.gemv_isa.is_empty() {
            let mut want = Vec::new();
            for name in &a.gemv_isa {
                match krasis_cpu::isa::parse_isa(name) {
                    Some(i) => want.push(i),
                    None => bail!("--gemv-isa: unknown ISA {name:?} (scalar, avx2, avx512)"),
                }
            }
            isas.retain(|i| want.contains(i));
        }
        let mut rows = Vec::new();
        for isa in isas {
            for fmt in GemvFormat::ALL {
                let (one, six, rec, traces) = expert_gemv(&pool, isa, fmt, a.gemv_bytes, a.gemv_trace)?;
                let (format, bits) = (fmt.name(), fmt.bits());
                let plain = matches!(fmt, GemvFormat::Int4 | GemvFormat::Int8);
                let us = |gbps: f64, experts: usize| (rec * experts) as f64 / gbps / 1e3;
                if !a.json {
                    println!(
                        "expert GEMV M=1 {:<6} {format:<9}: {one:6.1} GB/s one expert per dispatch ({:.0}% of membw, {:.1} µs), {six:6.1} GB/s top-6 per dispatch ({:.0}%, {:.1} µs)",
                        isa.name(),
                        100.0 * one / bw.gb_per_s,
                        us(one, 1),
                        100.0 * six / bw.gb_per_s,
                        us(six, 6)
                    );
                    for t in traces.iter().flatten() {
                        print!("{t}");
                    }
                }
                if a.gemv_compare > 0 && plain {
                    let rows = expert_gemv_compare(&pool, isa, bits, a.gemv_bytes, a.gemv_compare)?;
                    println!(
                        "  variants, {} interleaved passes each: GB/s one expert best / median, top-6 best / median",
                        a.gemv_compare
                    );
                    for (name, [ob, om, sb, sm]) in rows {
                        println!("    {name:<40} {ob:6.1} / {om:6.1}   {sb:6.1} / {sm:6.1}");
                    }
                }
                rows.push(json!({ "isa": isa.name(), "bits": bits.bits(), "format": format, "one_expert_gb_per_s": one,
                                  "top6_gb_per_s": six, "one_fraction": one / bw.gb_per_s, "top6_fraction": six / bw.gb_per_s }));
            }
        }
        out["expert_gemv"] = json!(rows);
    }
    if let Some(dir) = &a.model {
        // `--device cpu`, or `auto` without a GPU (see above).
        let config = a.engine.config(a.device, &a.gpu, (a.prompt_tokens + a.decode_tokens) as u64)?;
        let (opened, load_s) = open_for_bench(dir, &config, !a.json)?;
        let engine = opened.engine.as_ref();
        // The probe again around every decode run, on a pool of its own (the engine's workers
        // are parked by then), so each run meets the host as it was in the same seconds.
        let (around_pool, probe_bytes) = probe_pool(&a)?;
        let around = BandwidthProbe::new(&around_pool, probe_bytes, krasis_cpu::isa::active())?;
        let mut measure = || {
            std::thread::sleep(PROBE_SETTLE);
            let g = around.measure(PROBE_AROUND_REPS).gb_per_s;
            std::thread::sleep(PROBE_SETTLE);
            g
        };
        let timing = time_greedy_decode(
            engine,
            a.prompt_tokens,
            a.decode_tokens,
            a.prefill_reps as usize,
            a.decode_reps as usize,
            &mut measure,
        )?;
        let (prefill_s, decode_s, pp) = (timing.reported_prefill_s(), timing.decode_s, timing.prefill_parts);
        let stats = engine.stats(None);
        let parts = stats.forward.unwrap_or_default();
        let expert_s = parts.experts;
        let n = a.decode_tokens as f64;
        let spec = engine.spec();
        let moe_layers = spec.moe_layers().count() as u64;
        let top_k = spec.moe.as_ref().map_or(0, |m| m.routing.top_k as u64);
        let expert_bytes = moe_layers * top_k * stats.expert_bytes.unwrap_or(0);
        let dense_bytes = stats.dense_bytes_per_token.unwrap_or(0);
        // Shared experts run inside the routed experts' dispatch: their bytes stream in the
        // experts' time (they stay counted in the dense bytes too).
        let shared_inside = (parts.shared_in_experts_bytes as f64 / n) as u64;
        let ms = decode_s * 1e3 / n;
        let expert_ms = expert_s * 1e3 / n;
        // The per-stage times are the last decode run's: split that run's time, not the median's.
        let last_s = timing.decode_rep_s.last().copied().unwrap_or(decode_s);
        let last_ms = last_s * 1e3 / n;
        let expert_gbs = (expert_bytes + shared_inside) as f64 / 1e9 / (expert_s / n).max(1e-12);
        let total_gbs = (expert_bytes + dense_bytes) as f64 / 1e9 / (decode_s / n);
        let rep_gbs: Vec<f64> =
            timing.decode_rep_s.iter().map(|&t| (expert_bytes + dense_bytes) as f64 / 1e9 / (t / n)).collect();
        let bracketed = bracketed_fractions(&rep_gbs, &timing.decode_probe_gbs);
        let probe_self = probe_self_fractions(&timing.decode_probe_gbs);
        // Median run against the median probe around the runs: both central, so a burst of the
        // host's on either side moves neither.
        let (run_median, probe_median) = (median(&rep_gbs), median(&timing.decode_probe_gbs));
        let around_median = run_median / probe_median;
        out["model"] = json!(dir.display().to_string());
        out["engine"] = json!({ "cpu_expert_bits": format!("{:?}", a.engine.cpu_expert_bits),
                                "cpu_dense_bits": format!("{:?}", a.engine.cpu_dense_bits),
                                "experts": engine.describe() });
        out["load_s"] = json!(load_s);
        out["prefill"] = json!({ "tokens": a.prompt_tokens, "seconds": prefill_s, "tok_per_s": a.prompt_tokens as f64 / prefill_s,
                    "rep_seconds": timing.prefill_s,
                    "experts_s": pp.experts, "attention_s": pp.attention, "deltanet_s": pp.deltanet, "shared_experts_s": pp.shared,
                    "lm_head_s": pp.lm_head, "forward_s": pp.total });
        out["decode"] = json!({
            "tokens": a.decode_tokens, "tok_per_s": n / decode_s, "ms_per_token": ms,
            "rep_seconds": timing.decode_rep_s,
            "experts_ms_per_token": expert_ms, "rest_ms_per_token": last_ms - expert_ms,
            "expert_bytes_per_token": expert_bytes, "dense_bytes_per_token": dense_bytes,
            "shared_expert_bytes_in_expert_dispatch_per_token": shared_inside,
            "expert_gb_per_s": expert_gbs, "expert_fraction_of_membw": expert_gbs / bw.gb_per_s,
            "total_gb_per_s": total_gbs, "total_fraction_of_membw": total_gbs / bw.gb_per_s,
            "attention_ms_per_token": parts.attention * 1e3 / n, "deltanet_ms_per_token": parts.deltanet * 1e3 / n,
            "shared_experts_ms_per_token": parts.shared * 1e3 / n,
            "lm_head_ms_per_token": parts.lm_head * 1e3 / n,
            "rep_total_gb_per_s": rep_gbs, "probe_gb_per_s_around_reps": timing.decode_probe_gbs,
            "rep_total_fraction_of_probe_around": bracketed,
            "median_total_fraction_of_probe_around": median(&bracketed),
            "median_run_over_median_probe_around": around_median,
            "probe_self_fraction_around": probe_self,
        });
        if !a.json {
            println!(
                "prefill {} tokens: {:.1} tok/s; decode {} tokens: {:.2} tok/s, {ms:.1} ms/token{} = experts {expert_ms:.1} + rest {:.1}",
                a.prompt_tokens,
                a.prompt_tokens as f64 / prefill_s,
                a.decode_tokens,
                n / decode_s,
                if timing.decode_rep_s.len() > 1 { format!(" (median; last run {last_ms:.1} ms/token)") } else { String::new() },
                last_ms - expert_ms
            );
            if timing.prefill_s.len() > 1 {
                let tps: Vec<String> =
                    timing.prefill_s.iter().map(|&t| format!("{:.1}", a.prompt_tokens as f64 / t)).collect();
                println!(
                    "prefill runs (tok/s, first cold): {}; reported: median of the {} warm runs",
                    tps.join(", "),
                    tps.len() - 1
                );
            }
            if timing.decode_rep_s.len() > 1 {
                let tps: Vec<String> = timing.decode_rep_s.iter().map(|&t| format!("{:.2}", n / t)).collect();
                println!(
                    "decode runs (tok/s): {}; reported: their median; the stage lines below are the last run's",
                    tps.join(", ")
                );
            }
            println!(
                "prefill (last run): experts {:.3} s + attention {:.3} s{} + shared experts {:.3} s + LM head {:.3} s + other {:.3} s (norms, routers, dense-layer MLPs) + sampling and step overhead {:.3} s",
                pp.experts,
                pp.attention,
                if pp.deltanet > 0.0 { format!(" + DeltaNet {:.3} s", pp.deltanet) } else { String::new() },
                pp.shared,
                pp.lm_head,
                pp.total - pp.experts - pp.attention - pp.deltanet - pp.shared - pp.lm_head,
                timing.prefill_s.last().copied().unwrap_or(prefill_s) - pp.total
            );
            let st = timing.prefill_stages;
            let (mla, ex, o) = (st.mla, st.experts, st.other);
            if o.iter().any(|&v| v > 0) {
                let s = |v: u64| v as f64 / 1e9;
                println!(
                    "other (last prefill): norms and copies {:.3} s, residual adds {:.3} s, routers {:.3} s, routing {:.3} s, dense-layer MLPs {:.3} s",
                    s(o[0]), s(o[1]), s(o[2]), s(o[3]), s(o[4])
                );
            }
            let layer = st.layer;
            if layer.iter().any(|&v| v > 0) {
                let s = |v: u64| v as f64 / 1e9;
                println!(
                    "MLA layers (last prefill): projections {:.3} s, norm+rope {:.3} s, attention {:.3} s (absorb {:.3}, core {:.3}, W_UV {:.3}), o_proj {:.3} s",
                    s(layer[0]), s(layer[1]), s(layer[2]), s(layer[4]), s(layer[5]), s(layer[6]), s(layer[3])
                );
            }
            let od = timing.decode_stages.other;
            if od.iter().any(|&v| v > 0) {
                let ms = |v: u64| v as f64 / 1e6 / n;
                println!(
                    "other (decode, per token): norms and copies {:.2} ms, residual adds {:.2} ms, routers {:.2} ms, routing {:.2} ms, dense-layer MLPs {:.2} ms",
                    ms(od[0]), ms(od[1]), ms(od[2]), ms(od[3]), ms(od[4])
                );
            }
            let dl = timing.decode_stages.layer;
            if dl.iter().any(|&v| v > 0) {
                let ms = |v: u64| v as f64 / 1e6 / n;
                println!(
                    "MLA layers (decode, per token): projections {:.2} ms, norm+rope {:.2} ms, attention {:.2} ms (absorb {:.2}, core {:.2}, W_UV {:.2}), o_proj {:.2} ms",
                    ms(dl[0]), ms(dl[1]), ms(dl[2]), ms(dl[4]), ms(dl[5]), ms(dl[6]), ms(dl[3])
                );
            }
            if mla.iter().chain(&ex).any(|&v| v > 0) {
                let s = |v: u64| v as f64 / 1e9;
                println!(
                    "prefill detail (last prefill): MLA prefill expand {:.3} s + attend {:.3} s; BF16 expert tasks {:.3} s wall + weighted sum {:.3} s; their worker time: convert {:.3} s, w13 {:.3} s, w2 {:.3} s, waiting for inputs {:.3} s (of which BF16 matmuls: dequantise {:.3} s, tiles {:.3} s)",
                    s(mla[0]), s(mla[1]), s(ex[1]), s(ex[3]), s(ex[0]), s(ex[6]), s(ex[7]), s(ex[2]), s(ex[4]), s(ex[5])
                );
            }
            let other = parts.total - parts.experts - parts.attention - parts.deltanet - parts.shared - parts.lm_head;
            println!(
                "rest per token: attention {:.2} ms{} + shared experts {:.2} ms + LM head {:.2} ms + other {:.2} ms (norms, routers, dense-layer MLPs) + sampling and step overhead {:.2} ms",
                parts.attention * 1e3 / n,
                if parts.deltanet > 0.0 { format!(" + DeltaNet {:.2} ms", parts.deltanet * 1e3 / n) } else { String::new() },
                parts.shared * 1e3 / n,
                parts.lm_head * 1e3 / n,
                other * 1e3 / n,
                (last_s - parts.total) * 1e3 / n
            );
            let inside = if shared_inside > 0 {
                format!(
                    " (the shared experts' {:.1} MB of it in the experts' dispatch and time)",
                    shared_inside as f64 / 1e6
                )
            } else {
                String::new()
            };
            println!(
                "bytes/token: experts {:.1} MB + dense {:.1} MB{inside}; experts {expert_gbs:.1} GB/s ({:.0}% of membw), all weights {total_gbs:.1} GB/s ({:.0}%)",
                expert_bytes as f64 / 1e6,
                dense_bytes as f64 / 1e6,
                100.0 * expert_gbs / bw.gb_per_s,
                100.0 * total_gbs / bw.gb_per_s
            );
            let pct = |v: &[f64]| v.iter().map(|f| format!("{:.0}%", 100.0 * f)).collect::<Vec<_>>().join(", ");
            let probes: Vec<String> = timing.decode_probe_gbs.iter().map(|g| format!("{g:.1}")).collect();
            println!(
                "all weights against the probes taken right before and after each decode run ({} GB/s): median run {:.1} GB/s over median probe {:.1} GB/s = {:.0}%; each run against the higher of its two probes: {} (median {:.0}%); each probe against the higher of its neighbours (the host's own noise): {}",
                probes.join(", "),
                run_median,
                probe_median,
                100.0 * around_median,
                pct(&bracketed),
                100.0 * median(&bracketed),
                pct(&probe_self)
            );
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::bracketed_fractions;

    #[test]
    fn each_run_is_judged_against_the_higher_of_its_two_probes() {
        let f = bracketed_fractions(&[90.0, 100.0, 80.0], &[100.0, 120.0, 80.0, 100.0]);
        assert_eq!(f, vec![0.75, 100.0 / 120.0, 0.8]);
        assert!(bracketed_fractions(&[90.0], &[]).is_empty());
    }

    #[test]
    fn each_probe_is_judged_against_the_higher_of_its_neighbours() {
        assert_eq!(super::probe_self_fractions(&[100.0, 50.0, 80.0]), vec![2.0, 0.5, 1.6]);
        assert!(super::probe_self_fractions(&[100.0]).is_empty());
    }
}
