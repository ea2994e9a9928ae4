//! Asymmetric INT4 g32 expert matmuls (`krasis_cpu::quant::matmul_packed` on the layout of
//! `krasis_quant::int4_asym`, 5.0 bits per weight) beside symmetric INT4 g128 (4.125) and g32
//! (4.5) on the same shapes: GB/s of packed weight bytes (criterion `Throughput::Bytes`, one
//! matrix per iteration) on DeepSeek-V2-Lite's expert shapes — w13 = 2×1408 rows × K 2048, w2 =
//! 2048 rows × K 1408 — per ISA this CPU runs (passed explicitly), M = 1, 2 (a decode token: value and residual rows) and 8, on 1 thread and on
//! all threads (row blocks split evenly, a spin barrier between matrices as a decode pool would
//! have). `read/…` is a plain streaming read of the same bytes with the same threads: the
//! bandwidth probe (issue #38 item 5 asks a new INT4 default to stream at ≥ 85 % of it in
//! decode, M = 1). Tokens per second follow bytes: at equal GB/s, 5.0 bits per weight reads
//! 21 % more bytes per token than 4.125.
//!
//! Every iteration reads the next of enough distinct copies of the matrix
//! (`KRASIS_BENCH_POOL_MB`, default 1024 MiB) that the last-level cache cannot hold them: DRAM
//! streaming. `hot/…` reads one copy over and over (cache-resident: the compute ceiling).
//!
//! Quick run: `cargo bench -p krasis-cpu --bench int4a_matmul -- --warm-up-time 1 --measurement-time 2`
//! (append a filter such as `w13_int4a/avx512/m1` to select).
mod support;
use std::hint::black_box;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use krasis_cpu::isa::Isa;
use krasis_cpu::quant::{isa_supported, matmul_packed_with, quantize_acts, QuantizedActs, DEFAULT_PREFETCH, ROW_BLOCK};
use krasis_quant::cpu_layout::{pack, pack_w13, PackedLayout};
use krasis_quant::group::quantize;
use krasis_quant::int4_asym;
use krasis_quant::Bits;
use support::rand_f32;

fn pool_bytes() -> usize {
    std::env::var("KRASIS_BENCH_POOL_MB").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(1024) << 20
}

/// Many 4 KiB-aligned copies of one packed matrix.
struct Pool {
    buf: Vec<u8>,
    base: usize,
    stride: usize,
    count: usize,
    layout: PackedLayout,
}

impl Pool {
    fn new(packed: &[u8], layout: PackedLayout, count: Option<usize>) -> Pool {
        let stride = packed.len().div_ceil(4096) * 4096;
        let count = count.unwrap_or_else(|| pool_bytes().div_ceil(stride));
        let mut buf = vec![0u8; count * stride + 4096];
        let base = (4096 - buf.as_ptr() as usize % 4096) % 4096;
        for c in 0..count {
            buf[base + c * stride..base + c * stride + packed.len()].copy_from_slice(packed);
        }
        Pool { buf, base, stride, count, layout }
    }

    fn matrix(&self, i: usize) -> &[u8] {
        let o = self.base + (i % self.count) * self.stride;
        &self.buf[o..o + self.layout.bytes()]
    }
}

/// A sense-reversing spin barrier for a fixed number of threads.
struct SpinBarrier {
    n: usize,
    count: AtomicUsize,
    gen: AtomicUsize,
}

impl SpinBarrier {
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
                    std::thread::yield_now();
                }
            }
        }
    }
}

fn split(nb: usize, t: usize) -> Vec<Range<usize>> {
    (0..t).map(|i| nb * i / t..nb * (i + 1) / t).collect()
}

/// `work(thread, iteration)` for `iters` iterations on `threads` threads (barrier between
/// iterations): the time of the iterations alone.
fn timed_parallel(threads: usize, iters: u64, work: &(dyn Fn(usize, u64) + Sync)) -> Duration {
    let barrier = SpinBarrier { n: threads, count: AtomicUsize::new(0), gen: AtomicUsize::new(0) };
    std::thread::scope(|s| {
        for t in 1..threads {
            let barrier = &barrier;
            s.spawn(move || {
                barrier.wait();
                for it in 0..iters {
                    work(t, it);
                    barrier.wait();
                }
            });
        }
        barrier.wait();
        let t0 = Instant::now();
        for it in 0..iters {
            work(0, it);
            barrier.wait();
        }
        t0.elapsed()
    })
}

fn read_stream(data: &[u8]) -> u64 {
    data.chunks_exact(64).fold(0u64, |a, c| a ^ u64::from_le_bytes(c[..8].try_into().unwrap()) ^ c[63] as u64)
}

struct Case {
    name: String,
    pool: Pool,
    hot: Pool,
}

fn build_cases() -> Vec<Case> {
    let (h, inter) = (2048, 1408);
    let mut cases = Vec::new();
    let (gw, uw, dw) = (rand_f32(inter * h, 1), rand_f32(inter * h, 2), rand_f32(h * inter, 3));
    let q = |w: &[f32], rows, k| int4_asym::quantize(w, rows, k).unwrap();
    let (g, u, d) = (q(&gw, inter, h), q(&uw, inter, h), q(&dw, h, inter));
    let (p13, l13) = int4_asym::pack_w13(&g, &u).unwrap();
    let (p2, l2) = (int4_asym::pack(&d), int4_asym::layout_of(&d));
    for (n, p, l) in [("w13", &p13, l13), ("w2", &p2, l2)] {
        cases.push(Case { name: format!("{n}_int4a"), pool: Pool::new(p, l, None), hot: Pool::new(p, l, Some(1)) });
    }
    for gs in [128, 32] {
        let g = quantize(&gw, inter, h, Bits::Int4, gs);
        let u = quantize(&uw, inter, h, Bits::Int4, gs);
        let (p13, l13) = pack_w13(&g, &u).unwrap();
        let d = quantize(&dw, h, inter, Bits::Int4, gs);
        let (p2, l2) = (pack(&d), PackedLayout::of(&d));
        for (n, p, l) in [("w13", &p13, l13), ("w2", &p2, l2)] {
            cases.push(Case {
                name: format!("{n}_int4g{gs}"),
                pool: Pool::new(p, l, None),
                hot: Pool::new(p, l, Some(1)),
            });
        }
    }
    cases
}

fn acts_for(m: usize, l: &PackedLayout) -> QuantizedActs {
    let mut a = QuantizedActs::new();
    quantize_acts(&rand_f32(m * l.k, 7 + m as u64), m, l.k, l.gs, &mut a);
    a
}

fn bench(c: &mut Criterion) {
    let threads_all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cases = build_cases();
    let isas: Vec<Isa> = Isa::available().into_iter().filter(|&i| i != Isa::Scalar && isa_supported(i)).collect();
    let mut g = c.benchmark_group("int4a_matmul");
    for case in &cases {
        let l = case.pool.layout;
        g.throughput(Throughput::Bytes(l.bytes() as u64));
        for threads in [1, threads_all] {
            let parts = split(l.row_blocks(), threads);
            g.bench_function(format!("read/{}/t{threads}", case.name), |b| {
                b.iter_custom(|iters| {
                    timed_parallel(threads, iters, &|t, it| {
                        let w = case.pool.matrix(it as usize);
                        let bb = l.block_bytes();
                        black_box(read_stream(&w[parts[t].start * bb..parts[t].end * bb]));
                    })
                })
            });
            for &isa in &isas {
                for m in [1usize, 2, 8] {
                    let acts = acts_for(m, &l);
                    for (pool, tag) in [(&case.pool, ""), (&case.hot, "hot/")] {
                        let outs: Vec<std::sync::Mutex<Vec<f32>>> =
                            parts.iter().map(|r| std::sync::Mutex::new(vec![0f32; m * r.len() * ROW_BLOCK])).collect();
                        g.bench_function(format!("{tag}{}/{}/m{m}/t{threads}", case.name, isa.name()), |b| {
                            b.iter_custom(|iters| {
                                timed_parallel(threads, iters, &|t, it| {
                                    let mut out = outs[t].lock().unwrap();
                                    let w = pool.matrix(it as usize);
                                    matmul_packed_with(isa, w, &l, &acts, parts[t].clone(), &mut out, DEFAULT_PREFETCH);
                                    black_box(&out);
                                })
                            })
                        });
                    }
                }
            }
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
