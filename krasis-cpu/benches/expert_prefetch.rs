//! Does pulling a MoE call's experts into the caches during an idle gap make the call faster?
//! The hybrid engine's CPU pool idles while the GPU runs the next layer's attention (~60–70 µs);
//! with the next layer's routes predicted, it can pull the start of those experts' weights
//! meanwhile (`PoolExperts::prefetch_first_tasks`: each worker the start of the task it runs
//! first). This bench measures the call that follows the gap. `KRASIS_MOE_AFFINE=0` runs the
//! calls with plain dynamic claims (the pull then does nothing).
//!
//! Setup: `KRASIS_BENCH_EXPERTS` (default 256) V2-Lite INT4 experts (hidden 2048, intermediate
//! 1408, g128; ~4.6 MB each, far more than the last-level cache holds), top-6 decode calls of
//! random expert sets on the whole pool. Per case, per iteration: the gap (spin `GAP_US` µs, with
//! the case's pull running at its start), then one call; printed: the call's mean time, its
//! expert bytes over that time, and the pull's mean time.
//!
//! Run: `cargo bench -p krasis-cpu --bench expert_prefetch` (no criterion: the cases interleave
//! per iteration so that drift of the host hits every case alike).

mod support;
use std::hint::black_box;
use std::time::{Duration, Instant};
use support::rand_f32;

use krasis_core::hw::probe;
use krasis_cpu::isa;
use krasis_cpu::moe::{ExpertJob, ExpertWeights, PoolExperts};
use krasis_cpu::pool::{PoolPlan, WorkerPool};
use krasis_quant::cpu_layout::{pack, pack_w13};
use krasis_quant::group::quantize;
use krasis_quant::Bits;

const HIDDEN: usize = 2048;
const INTER: usize = 1408;
const TOP_K: usize = 6;
const GAP_US: u64 = 70;
const ITERS: usize = 300;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Pull {
    /// No pull.
    None,
    /// `PoolExperts::prefetch_first_tasks` with this budget in MiB.
    FirstTasks(usize),
    /// No pull: the same call run just before (everything the call reads is in some cache).
    Repeat,
}

fn spin_until(t: Instant) {
    while Instant::now() < t {
        std::hint::spin_loop();
    }
}

fn main() {
    let n_experts: usize =
        std::env::var("KRASIS_BENCH_EXPERTS").ok().and_then(|v| v.parse().ok()).unwrap_or(256).max(TOP_K);
    let pool = WorkerPool::new(PoolPlan::from_system(&probe(), None)).expect("worker pool");
    let _pin = pool.pin_caller();
    let isa = isa::active();
    // One quantised expert, copied into distinct allocations (the bytes do not matter to speed).
    let gate = quantize(&rand_f32(INTER * HIDDEN, 1), INTER, HIDDEN, Bits::Int4, 128);
    let up = quantize(&rand_f32(INTER * HIDDEN, 2), INTER, HIDDEN, Bits::Int4, 128);
    let down = quantize(&rand_f32(HIDDEN * INTER, 3), HIDDEN, INTER, Bits::Int4, 128);
    let (w13, l13) = pack_w13(&gate, &up).expect("w13 layout");
    let (w2, l2) = (pack(&down), krasis_quant::cpu_layout::PackedLayout::of(&down));
    // All copies in one huge-page-advised buffer, as the engine's expert cache is (4 KiB pages
    // made this bench's calls several times slower than the engine's on some instances).
    let rec = (w13.len() + w2.len()).next_multiple_of(4096);
    let mut buf = krasis_core::memory::PageBuffer::new(n_experts * rec).expect("expert buffer");
    buf.advise_huge_pages();
    for e in 0..n_experts {
        let d = &mut buf.as_mut_slice()[e * rec..(e + 1) * rec];
        d[..w13.len()].copy_from_slice(&w13);
        d[w13.len()..w13.len() + w2.len()].copy_from_slice(&w2);
    }
    let data = buf.as_slice();
    let experts: Vec<(&[u8], &[u8])> = (0..n_experts)
        .map(|e| (&data[e * rec..e * rec + w13.len()], &data[e * rec + w13.len()..e * rec + w13.len() + w2.len()]))
        .collect();
    let expert_bytes = w13.len() + w2.len();
    let runner = PoolExperts::new(&pool, l13, l2);
    let x = rand_f32(HIDDEN, 4);
    let mut out = vec![0f32; HIDDEN];
    let tokens: Vec<(usize, f32)> = vec![(0, 0.25)];
    println!(
        "{} experts of {:.2} MB, top-{TOP_K}, {} threads, {}; gap {GAP_US} µs; {ITERS} iterations per case",
        n_experts,
        expert_bytes as f64 / 1e6,
        pool.threads(),
        isa.name()
    );
    // CPUID.(7,0):ECX bit 25. (Without it `cldemote` is a NOP: its encoding is a hint NOP.)
    let cases = [Pull::Repeat, Pull::None, Pull::FirstTasks(4), Pull::FirstTasks(8), Pull::FirstTasks(16)];
    let mut call = vec![Duration::ZERO; cases.len()];
    let mut pull = vec![Duration::ZERO; cases.len()];
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for it in 0..ITERS + 10 {
        for (c, &how) in cases.iter().enumerate() {
            let mut ids = [0usize; TOP_K];
            let mut k = 0;
            while k < TOP_K {
                let e = (rng.next() % n_experts as u64) as usize;
                if !ids[..k].contains(&e) {
                    ids[k] = e;
                    k += 1;
                }
            }
            ids.sort_unstable();
            let start = Instant::now();
            let weights: Vec<ExpertWeights<'_>> =
                ids.iter().map(|&e| ExpertWeights { w13: experts[e].0, w2: experts[e].1, node: 0 }).collect();
            if let Pull::FirstTasks(mb) = how {
                black_box(runner.prefetch_first_tasks(&pool, &weights, mb << 20, &|| false));
            }
            let pulled = start.elapsed();
            spin_until(start + Duration::from_micros(GAP_US));
            let jobs: Vec<ExpertJob<'_>> =
                weights.iter().map(|&weights| ExpertJob { weights, tokens: &tokens }).collect();
            if how == Pull::Repeat {
                runner.run(&pool, isa, &x, HIDDEN, &jobs, &mut out);
            }
            let t = Instant::now();
            runner.run(&pool, isa, &x, HIDDEN, &jobs, &mut out);
            let d = t.elapsed();
            if it >= 10 {
                call[c] += d;
                pull[c] += pulled;
            }
        }
    }
    black_box(&out);
    for (c, how) in cases.iter().enumerate() {
        let us = call[c].as_secs_f64() * 1e6 / ITERS as f64;
        println!(
            "{how:?}: call {us:7.1} µs ({:6.1} GB/s of expert bytes), pull {:6.1} µs",
            (TOP_K * expert_bytes) as f64 / 1e3 / us,
            pull[c].as_secs_f64() * 1e6 / ITERS as f64
        );
    }
}
