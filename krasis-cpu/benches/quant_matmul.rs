//! Quantised expert matmuls (`krasis_cpu::quant::matmul_packed`): GB/s of packed weight bytes
//! (criterion `Throughput::Bytes` = one matrix per iteration) on DeepSeek-V2-Lite expert shapes —
//! w13 = 2×1408 rows × K 2048, w2 = 2048 rows × K 1408 — INT4 and INT8, per ISA (passed
//! explicitly), M = 1, 8, 32, on 1 thread and on all threads (row blocks split evenly; helper
//! threads spin on a barrier between matrices, as a decode pool would).
//!
//! Every iteration reads the next of enough distinct copies of the matrix (≥ 512 MiB in all, each
//! copy 4 KiB-aligned like a cache record) that the last-level cache cannot hold them: the
//! figures are DRAM streaming. `read/…` is a plain streaming read of the same pool with the same
//! threads (the ceiling the kernels are compared with). `prefetch/…` sweeps the software prefetch
//! and `misaligned32/…` runs the default kernel on copies placed 32 bytes off a cache line (every
//! 64-byte load splits — the cost a per-group scale trailer would put on every other group).
//! `hot/…` reads one copy over and over (cache-resident: the kernel's compute ceiling per core).
//!
//! Quick run: `cargo bench -p krasis-cpu --bench quant_matmul -- --warm-up-time 1 --measurement-time 2`
//! (append a filter such as `w13_int4/avx512/m1` to select).

mod support;
use std::hint::black_box;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use support::rand_f32;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use krasis_cpu::isa::Isa;
use krasis_cpu::quant::{
    isa_supported, matmul_packed_with, quantize_acts, Prefetch, PrefetchHint, QuantizedActs, DEFAULT_PREFETCH,
    ROW_BLOCK,
};
use krasis_quant::cpu_layout::{pack, pack_w13, PackedLayout};
use krasis_quant::group::quantize;
use krasis_quant::Bits;

/// Bytes of distinct matrix copies per case: `KRASIS_BENCH_POOL_MB` (MiB), default 1 GiB (the
/// brief asks ≥ 512 MB; the 16-core device box has a 300 MiB L3, so more is safer there).
fn pool_bytes() -> usize {
    std::env::var("KRASIS_BENCH_POOL_MB").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(1024) << 20
}

/// Many copies of one packed matrix, `stride` apart, the first at `base` (bytes past a 4 KiB
/// boundary of the allocation).
struct Pool {
    buf: Vec<u8>,
    base: usize,
    stride: usize,
    count: usize,
    layout: PackedLayout,
}

impl Pool {
    fn new(packed: &[u8], layout: PackedLayout, misalign: usize) -> Pool {
        Pool::with_count(packed, layout, misalign, None)
    }

    fn with_count(packed: &[u8], layout: PackedLayout, misalign: usize, count: Option<usize>) -> Pool {
        let stride = packed.len().div_ceil(4096) * 4096;
        let count = count.unwrap_or_else(|| pool_bytes().div_ceil(stride));
        let mut buf = vec![0u8; count * stride + 8192];
        let base = (4096 - buf.as_ptr() as usize % 4096) % 4096 + misalign;
        for c in 0..count {
            let o = base + c * stride;
            buf[o..o + packed.len()].copy_from_slice(packed);
        }
        Pool { buf, base, stride, count, layout }
    }

    fn matrix(&self, i: usize) -> &[u8] {
        let o = self.base + (i % self.count) * self.stride;
        &self.buf[o..o + self.layout.bytes()]
    }
}

/// Matrices each thread works through between two barriers: `KRASIS_BENCH_BATCH`, default 1
/// (one barrier per matrix, the finest split a decode pool would use; 6 ≈ one per layer of
/// DeepSeek-V2-Lite's 6 routed experts).
fn batch() -> usize {
    std::env::var("KRASIS_BENCH_BATCH").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(1).max(1)
}

/// A sense-reversing spin barrier for a fixed number of threads.
struct SpinBarrier {
    n: usize,
    count: AtomicUsize,
    gen: AtomicUsize,
}

impl SpinBarrier {
    fn new(n: usize) -> SpinBarrier {
        SpinBarrier { n, count: AtomicUsize::new(0), gen: AtomicUsize::new(0) }
    }

    fn wait(&self) {
        let g = self.gen.load(Ordering::Acquire);
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.count.store(0, Ordering::Relaxed);
            self.gen.store(g + 1, Ordering::Release);
        } else {
            let mut spins = 0u32;
            while self.gen.load(Ordering::Acquire) == g {
                spins += 1;
                if spins < 1 << 14 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now(); // oversubscribed (shared box): let the others run
                }
            }
        }
    }
}

/// Row-block ranges of `nb` blocks over `t` threads.
fn split(nb: usize, t: usize) -> Vec<Range<usize>> {
    (0..t).map(|i| nb * i / t..nb * (i + 1) / t).collect()
}

/// Pin the calling thread to CPU `cpu` (Linux; best effort), as the decode pool pins its workers,
/// returning the previous affinity for [`unpin`]. `KRASIS_BENCH_PIN=0` turns it off.
#[cfg(target_os = "linux")]
fn pin(cpu: usize) -> Option<libc::cpu_set_t> {
    if std::env::var("KRASIS_BENCH_PIN").map(|v| v == "0").unwrap_or(false) {
        return None;
    }
    // SAFETY: zeroed cpu_set_t values are valid; CPU_SET stays in bounds (cpu < CPU_SETSIZE).
    unsafe {
        let size = std::mem::size_of::<libc::cpu_set_t>();
        let mut old: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size, &mut old) != 0 {
            return None;
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu % libc::CPU_SETSIZE as usize, &mut set);
        libc::sched_setaffinity(0, size, &set);
        Some(old)
    }
}

#[cfg(target_os = "linux")]
fn unpin(old: Option<libc::cpu_set_t>) {
    if let Some(old) = old {
        // SAFETY: restores a mask read by sched_getaffinity.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &old) };
    }
}

#[cfg(not(target_os = "linux"))]
fn pin(_cpu: usize) -> Option<()> {
    None
}

#[cfg(not(target_os = "linux"))]
fn unpin(_old: Option<()>) {}

/// Run `work(thread, iteration)` for `iters` iterations on `threads` threads (barrier between
/// iterations), returning the time of the iterations alone.
fn timed_parallel(threads: usize, iters: u64, work: &(dyn Fn(usize, u64) + Sync)) -> Duration {
    if threads == 1 {
        let t0 = Instant::now();
        for it in 0..iters {
            work(0, it);
        }
        return t0.elapsed();
    }
    let barrier = SpinBarrier::new(threads);
    std::thread::scope(|s| {
        for t in 1..threads {
            let barrier = &barrier;
            s.spawn(move || {
                let _ = pin(t);
                barrier.wait();
                for it in 0..iters {
                    work(t, it);
                    barrier.wait();
                }
            });
        }
        let saved = pin(0);
        barrier.wait();
        let t0 = Instant::now();
        for it in 0..iters {
            work(0, it);
            barrier.wait();
        }
        let dt = t0.elapsed();
        unpin(saved); // the main thread gets its full affinity back (criterion, thread counts)
        dt
    })
}

/// Plain streaming read (the bandwidth ceiling), 64 bytes per step.
fn read_stream(data: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 checked.
        return unsafe { read_stream_avx2(data) };
    }
    data.chunks_exact(8).fold(0u64, |a, c| a ^ u64::from_le_bytes(c.try_into().unwrap()))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn read_stream_avx2(data: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let mut a = [_mm256_setzero_si256(); 4];
    let p = data.as_ptr();
    let mut i = 0;
    while i + 128 <= data.len() {
        for (u, acc) in a.iter_mut().enumerate() {
            *acc = _mm256_xor_si256(*acc, _mm256_loadu_si256(p.add(i + 32 * u) as *const __m256i));
        }
        i += 128;
    }
    let x = _mm256_xor_si256(_mm256_xor_si256(a[0], a[1]), _mm256_xor_si256(a[2], a[3]));
    _mm256_extract_epi64::<0>(x) as u64 ^ _mm256_extract_epi64::<2>(x) as u64
}

struct Case {
    name: &'static str,
    bits: Bits,
    pool: Pool,
    /// The same matrices 32 bytes off a cache line (for the alignment check only).
    pool_mis: Option<Pool>,
    /// One copy, read over and over: cache-resident, so the kernel's compute ceiling.
    pool_hot: Pool,
}

fn build_cases(with_misaligned: bool) -> Vec<Case> {
    let mut cases = Vec::new();
    for bits in [Bits::Int4, Bits::Int8] {
        let (h, inter) = (2048, 1408);
        let g = quantize(&rand_f32(inter * h, 1), inter, h, bits, 128);
        let u = quantize(&rand_f32(inter * h, 2), inter, h, bits, 128);
        let (p13, l13) = pack_w13(&g, &u).unwrap();
        let w2 = quantize(&rand_f32(h * inter, 3), h, inter, bits, 128);
        let (p2, l2) = (pack(&w2), PackedLayout::of(&w2));
        let name13: &'static str = if bits == Bits::Int4 { "w13_int4" } else { "w13_int8" };
        let name2: &'static str = if bits == Bits::Int4 { "w2_int4" } else { "w2_int8" };
        let mis = with_misaligned && bits == Bits::Int4;
        cases.push(Case {
            name: name13,
            bits,
            pool: Pool::new(&p13, l13, 0),
            pool_mis: mis.then(|| Pool::new(&p13, l13, 32)),
            pool_hot: Pool::with_count(&p13, l13, 0, Some(1)),
        });
        cases.push(Case {
            name: name2,
            bits,
            pool: Pool::new(&p2, l2, 0),
            pool_mis: None,
            pool_hot: Pool::with_count(&p2, l2, 0, Some(1)),
        });
    }
    cases
}

fn acts_for(m: usize, k: usize, gs: usize) -> QuantizedActs {
    let mut a = QuantizedActs::new();
    quantize_acts(&rand_f32(m * k, 7 + m as u64), m, k, gs, &mut a);
    a
}

#[allow(clippy::too_many_arguments)]
fn bench_one(
    c: &mut Criterion,
    group: &str,
    id: String,
    isa: Isa,
    pool: &Pool,
    m: usize,
    threads: usize,
    pf: Prefetch,
) {
    let l = pool.layout;
    let acts = acts_for(m, l.k, l.gs);
    let ranges = split(l.row_blocks(), threads);
    let outs: Vec<std::sync::Mutex<Vec<f32>>> =
        ranges.iter().map(|r| std::sync::Mutex::new(vec![0f32; m * r.len() * ROW_BLOCK])).collect();
    let next = AtomicUsize::new(0);
    let nbatch = batch();
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Bytes((nbatch * l.bytes()) as u64));
    g.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let start = next.fetch_add(iters as usize * nbatch, Ordering::Relaxed);
            timed_parallel(threads, iters, &|t, it| {
                let mut out = outs[t].lock().unwrap();
                for j in 0..nbatch {
                    let w = pool.matrix(start + it as usize * nbatch + j);
                    matmul_packed_with(isa, w, &l, &acts, ranges[t].clone(), &mut out, pf);
                }
                black_box(&mut *out);
            })
        })
    });
    g.finish();
}

fn thread_counts() -> Vec<usize> {
    static ALL: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let all = *ALL.get_or_init(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    if all > 1 {
        vec![1, all]
    } else {
        vec![1]
    }
}

fn isas() -> Vec<Isa> {
    Isa::available().into_iter().filter(|&i| isa_supported(i)).collect()
}

fn bench_quant_matmul(c: &mut Criterion) {
    let cases = build_cases(true);
    let best = *isas().last().unwrap();
    for case in &cases {
        // Streaming-read ceiling over the same pool.
        if case.bits == Bits::Int4 && case.name.starts_with("w13") {
            for &t in &thread_counts() {
                let l = case.pool.layout;
                let next = AtomicUsize::new(0);
                let nbatch = batch();
                let mut g = c.benchmark_group("read");
                g.throughput(Throughput::Bytes((nbatch * l.bytes()) as u64));
                g.bench_function(format!("t{t}"), |b| {
                    b.iter_custom(|iters| {
                        let start = next.fetch_add(iters as usize * nbatch, Ordering::Relaxed);
                        let nb = l.bytes();
                        timed_parallel(t, iters, &|ti, it| {
                            for j in 0..nbatch {
                                let w = case.pool.matrix(start + it as usize * nbatch + j);
                                let r = nb * ti / t..nb * (ti + 1) / t;
                                black_box(read_stream(&w[r]));
                            }
                        })
                    })
                });
                g.finish();
            }
        }
        for isa in isas() {
            for m in [1usize, 8, 32] {
                for &t in &thread_counts() {
                    bench_one(
                        c,
                        case.name,
                        format!("{}/m{m}/t{t}", isa.name()),
                        isa,
                        &case.pool,
                        m,
                        t,
                        DEFAULT_PREFETCH,
                    );
                }
            }
        }
        for isa in isas() {
            bench_one(
                c,
                "hot",
                format!("{}/{}/m1/t1", case.name, isa.name()),
                isa,
                &case.pool_hot,
                1,
                1,
                DEFAULT_PREFETCH,
            );
        }
        if let Some(mis) = &case.pool_mis {
            for &t in &thread_counts() {
                bench_one(
                    c,
                    "misaligned32",
                    format!("{}/{}/m1/t{t}", case.name, best.name()),
                    best,
                    mis,
                    1,
                    t,
                    DEFAULT_PREFETCH,
                );
            }
        }
        // Prefetch sweep on the main decode case.
        if case.name == "w13_int4" {
            for &t in &thread_counts() {
                let mut settings = vec![Prefetch::OFF];
                for hint in [PrefetchHint::Nta, PrefetchHint::T0, PrefetchHint::T1] {
                    for d in [1024usize, 2048, 4096, 8192, 16384] {
                        settings.push(Prefetch { hint, distance: d });
                    }
                }
                for pf in settings {
                    let hint = match pf.hint {
                        PrefetchHint::None => "none",
                        PrefetchHint::Nta => "nta",
                        PrefetchHint::T0 => "t0",
                        PrefetchHint::T1 => "t1",
                    };
                    bench_one(
                        c,
                        "prefetch",
                        format!("{}/{}/{hint}{}/t{t}", case.name, best.name(), pf.distance),
                        best,
                        &case.pool,
                        1,
                        t,
                        pf,
                    );
                }
            }
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));
    targets = bench_quant_matmul
}
criterion_main!(benches);
