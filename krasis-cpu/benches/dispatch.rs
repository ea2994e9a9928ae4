//! Dispatch latency of the decode worker pool against rayon, the same number of threads each:
//! an empty job of `threads` tasks, and a tiny realistic one (a 64 KiB-per-task GEMV slice).
//! Under `cargo bench` it also prints the memory-bandwidth probe and the latency of a dispatch
//! that has to wake parked workers (pool past its spin budget, rayon asleep), which criterion's
//! back-to-back loop never sees.

use std::hint::black_box;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use criterion::Criterion;
use krasis_core::hw::probe;
use krasis_cpu::membw;
use krasis_cpu::pool::{PoolPlan, WorkerPool, SPIN_BEFORE_PARK};
use rayon::prelude::*;

/// K of the tiny task's dot products (f32) and rows per task: 16 rows × 1024 × 4 B = 64 KiB.
const K: usize = 1024;
const ROWS_PER_TASK: usize = 16;

struct Setup {
    pool: WorkerPool,
    /// The same plan with `yield_spin: false` (pure spinning), for comparison.
    pool_noyield: WorkerPool,
    rayon: rayon::ThreadPool,
}

fn setup() -> Setup {
    let plan = PoolPlan::from_system(&probe(), None);
    let pool = WorkerPool::new(plan.clone()).expect("worker pool");
    let pool_noyield = WorkerPool::new(PoolPlan { yield_spin: false, ..plan }).expect("worker pool");
    // Built before the caller is pinned, so rayon's threads do not inherit that pinning.
    let rayon = rayon::ThreadPoolBuilder::new().num_threads(pool.threads()).build().expect("rayon pool");
    Setup { pool, pool_noyield, rayon }
}

/// The empty task.
fn noop(i: usize) {
    black_box(i);
}

fn dot(w: &[f32], x: &[f32]) -> f32 {
    w.iter().zip(x).map(|(a, b)| a * b).sum()
}

fn bench_dispatch(c: &mut Criterion, s: &Setup) {
    let (pool, rp) = (&s.pool, &s.rayon);
    let t = pool.threads();

    let mut g = c.benchmark_group(format!("dispatch_empty_{t}t"));
    g.bench_function("krasis_pool_run", |b| b.iter(|| pool.run(t, &|i, _| noop(i))));
    g.bench_function("krasis_pool_run_noyield", |b| b.iter(|| s.pool_noyield.run(t, &|i, _| noop(i))));
    g.bench_function("krasis_pool_broadcast", |b| b.iter(|| pool.broadcast(&|ctx| noop(ctx.worker))));
    g.bench_function("rayon_par_iter", |b| b.iter(|| rp.install(|| (0..t).into_par_iter().for_each(noop))));
    g.bench_function("rayon_scope", |b| {
        b.iter(|| {
            rp.scope(|sc| {
                for i in 0..t {
                    sc.spawn(move |_| noop(i));
                }
            })
        })
    });
    g.finish();

    // Tiny realistic job: 4 tasks per worker, each 16 rows of a GEMV (64 KiB of weights, cache-hot).
    let n = 4 * t;
    let w: Vec<f32> = (0..n * ROWS_PER_TASK * K).map(|i| (i % 17) as f32 * 0.01).collect();
    let x: Vec<f32> = (0..K).map(|i| (i % 5) as f32 * 0.1).collect();
    let y: Vec<AtomicU32> = (0..n * ROWS_PER_TASK).map(|_| AtomicU32::new(0)).collect();
    let task = |i: usize| {
        for r in i * ROWS_PER_TASK..(i + 1) * ROWS_PER_TASK {
            y[r].store(dot(&w[r * K..(r + 1) * K], &x).to_bits(), Ordering::Relaxed);
        }
    };
    let mut g = c.benchmark_group(format!("dispatch_tiny_gemv_{n}x64KiB_{t}t"));
    g.bench_function("serial_one_thread", |b| b.iter(|| (0..n).for_each(task)));
    g.bench_function("krasis_pool_run", |b| b.iter(|| pool.run(n, &|i, _| task(i))));
    g.bench_function("krasis_pool_run_noyield", |b| b.iter(|| s.pool_noyield.run(n, &|i, _| task(i))));
    g.bench_function("rayon_par_iter", |b| b.iter(|| rp.install(|| (0..n).into_par_iter().for_each(task))));
    g.bench_function("rayon_scope", |b| {
        b.iter(|| {
            rp.scope(|sc| {
                for i in 0..n {
                    let task = &task;
                    sc.spawn(move |_| task(i));
                }
            })
        })
    });
    g.finish();
}

/// Median and 90th percentile of `f`'s time when each call comes after `gap` of idleness.
fn cold(gap: Duration, mut f: impl FnMut()) -> (f64, f64) {
    let mut v: Vec<f64> = (0..200)
        .map(|_| {
            std::thread::sleep(gap);
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[v.len() * 9 / 10])
}

fn extras(s: &Setup) {
    let (pool, rp) = (&s.pool, &s.rayon);
    let t = pool.threads();
    println!("pool: {}", pool.describe());
    // KRASIS_MEMBW_MIB=512,2048,8192 probes several sizes (to see where caches stop helping).
    let sizes: Vec<usize> = match std::env::var("KRASIS_MEMBW_MIB") {
        Ok(v) => v.split(',').filter_map(|m| m.trim().parse::<usize>().ok()).map(|m| m << 20).collect(),
        Err(_) => vec![membw::default_probe_bytes(&probe())],
    };
    for bytes in sizes {
        match membw::read_bandwidth(pool, bytes, 7) {
            Ok(r) => println!("{}; per rep GB/s: {:.1?}", r.summary(), r.per_rep),
            Err(e) => println!("membw probe failed: {e}"),
        }
    }
    for gap in [Duration::from_micros(200), SPIN_BEFORE_PARK * 3] {
        let (pm, p9) = cold(gap, || pool.run(t, &|i, _| noop(i)));
        let (nm, n9) = cold(gap, || s.pool_noyield.run(t, &|i, _| noop(i)));
        let (rm, r9) = cold(gap, || rp.install(|| (0..t).into_par_iter().for_each(noop)));
        println!(
            "empty dispatch after {} µs idle ({t} threads), median (p90) µs: krasis pool {pm:.1} ({p9:.1}), \
             without yield {nm:.1} ({n9:.1}), rayon par_iter {rm:.1} ({r9:.1})",
            gap.as_micros()
        );
    }
}

fn main() {
    let s = setup();
    // Decode loops hold this guard: worker 0 is the calling thread, pinned like the others.
    let _pin = s.pool.pin_caller().ok();
    if std::env::args().any(|a| a == "--bench") {
        extras(&s);
    }
    let mut c = Criterion::default().configure_from_args();
    bench_dispatch(&mut c, &s);
    c.final_summary();
}
