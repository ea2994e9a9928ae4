//! What the packed-matmul benches of new expert formats share (`fp4_matmul`, `int4a_matmul`):
//! pools of 4 KiB-aligned copies of a packed matrix (far larger than the last-level cache, or one
//! copy for the hot case), a spin-barrier timer over several threads, a plain streaming read as
//! the ceiling, and the one Criterion loop over cases, ISAs, M and thread counts.

use std::hint::black_box;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use krasis_cpu::isa::Isa;
use krasis_cpu::quant::{isa_supported, matmul_packed_with, quantize_acts, QuantizedActs, DEFAULT_PREFETCH, ROW_BLOCK};
use krasis_quant::cpu_layout::PackedLayout;

use crate::support::rand_f32;

fn pool_bytes() -> usize {
    std::env::var("KRASIS_BENCH_POOL_MB").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(1024) << 20
}

/// Many 4 KiB-aligned copies of one packed matrix.
pub struct Pool {
    buf: Vec<u8>,
    base: usize,
    stride: usize,
    count: usize,
    layout: PackedLayout,
}

impl Pool {
    pub fn new(packed: &[u8], layout: PackedLayout, count: Option<usize>) -> Pool {
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

/// One matrix to time: cold (many copies) and hot (one).
pub struct Case {
    pub name: String,
    pub pool: Pool,
    pub hot: Pool,
}

impl Case {
    /// `packed` under `name`, cold and hot.
    pub fn new(name: String, packed: &[u8], layout: PackedLayout) -> Case {
        Case { name, pool: Pool::new(packed, layout, None), hot: Pool::new(packed, layout, Some(1)) }
    }
}

fn acts_for(m: usize, l: &PackedLayout) -> QuantizedActs {
    let mut a = QuantizedActs::new();
    quantize_acts(&rand_f32(m * l.k, 7 + m as u64), m, l.k, l.gs, &mut a);
    a
}

/// Criterion group `group` over `cases`: per case, a plain read of its bytes and `matmul_packed`
/// on each ISA this CPU runs (not scalar) at each M of `ms`, on one thread and on all, cold (the
/// pool of copies) and hot (one copy).
pub fn bench_cases(c: &mut Criterion, group: &str, cases: &[Case], ms: &[usize]) {
    let threads_all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let isas: Vec<Isa> = Isa::available().into_iter().filter(|&i| i != Isa::Scalar && isa_supported(i)).collect();
    let mut g = c.benchmark_group(group);
    for case in cases {
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
                for &m in ms {
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
