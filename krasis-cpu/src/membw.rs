//! Memory-bandwidth probe: read-only streaming over a buffer far larger than the last-level
//! cache, every pinned worker of the pool reading its own contiguous slice that it touched first
//! (and that `mbind` put on its node), all workers released together per repetition.
//!
//! This is the denominator of every GB/s figure Krasis reports, so it tries to be honest: wide
//! loads (AVX-512, AVX2 or scalar, per `KRASIS_ISA`) folded with XOR into a result that is kept
//! (the compiler cannot drop the loads), a buffer at least 8× the last-level cache, one untimed
//! warm-up pass, repetitions of at least 50 ms (several passes if one is quicker), the clock
//! started after all workers have met at a barrier and stopped after the last one finished, best
//! and median over the repetitions. GB/s are decimal (1e9 bytes per second), like STREAM.
//!
//! In VMs the figure moves with the host (other guests, host NUMA balancing): on the GPU box
//! repetitions of one run have differed by 20%, so quote the median next to the best.

use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use krasis_core::hw::SystemReport;
use krasis_core::memory::{advise_huge_pages, bind_to_node, huge_page_bytes, PageBuffer};

use crate::isa::{self, Isa};
use crate::pool::{SyncPtr, WorkerPool};

/// Default probe size: ≥ 30× the L3 of any current socket, so caches cannot flatter the figure.
pub const DEFAULT_PROBE_BYTES: usize = 2 << 30;

/// Slices of at least this much are cut at huge-page (2 MiB) boundaries, so no huge page is
/// shared by two workers (it would sit on one worker's node).
const HUGE_SLICE_MIN: usize = 4 << 20;

/// The probe buffer is at least this many times the last-level cache. On the GPU box (300 MiB
/// L3 shared with other guests) 1 GiB = 3.4× L3 already read at DRAM speed while 256 MiB read at
/// almost twice that; 8× leaves a wide margin.
const LLC_MULTIPLE: usize = 8;

/// Each timed repetition lasts at least this long (the buffer is streamed several times if one
/// pass is quicker), so the start barrier and the last worker's finish are noise, not signal.
const MIN_REP_SECONDS: f64 = 0.05;

/// Most passes over the buffer per repetition (caps the work on tiny test buffers).
const MAX_PASSES: usize = 64;

/// The buffer size to probe with: [`DEFAULT_PROBE_BYTES`] or 8× the last-level cache, whichever
/// is larger, but at most a quarter of available memory.
pub fn default_probe_bytes(r: &SystemReport) -> usize {
    probe_bytes_for(r.mem_available_bytes, llc_bytes())
}

fn probe_bytes_for(mem_available: u64, llc: Option<usize>) -> usize {
    let want = DEFAULT_PROBE_BYTES.max(llc.unwrap_or(0).saturating_mul(LLC_MULTIPLE));
    match usize::try_from(mem_available / 4) {
        Ok(q) if q > 0 => q.min(want),
        _ => want,
    }
}

/// The largest cache of CPU 0 per sysfs (`/sys/devices/system/cpu/cpu0/cache/index*/size`), in
/// bytes. Inside VMs this may be the host's whole L3, shared with other guests.
pub fn llc_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("size")).ok())
        .filter_map(|s| parse_cache_size(&s))
        .max()
}

/// "32768K", "300M", "1G" or plain bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 1 << 10),
        'M' | 'm' => (&s[..s.len() - 1], 1 << 20),
        'G' | 'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mult)
}

/// What the probe measured.
#[derive(Clone, Debug, PartialEq)]
pub struct MembwReport {
    /// Best repetition, GB/s (1e9 B/s).
    pub gb_per_s: f64,
    /// Median repetition, GB/s.
    pub median_gb_per_s: f64,
    /// Buffer size (the request rounded to whole per-worker slices).
    pub bytes: usize,
    /// Passes over the buffer per repetition (so each lasts at least 50 ms).
    pub passes: usize,
    pub threads: usize,
    /// GB/s of each repetition, in order.
    pub per_rep: Vec<f64>,
    pub isa: Isa,
    /// Whether the pool's workers are pinned (a simulated pool's figure is only indicative).
    pub pinned: bool,
    /// Slices whose pages `mbind` put on their worker's node (of `threads`; 0 when unpinned or
    /// the kernel has no NUMA).
    pub slices_bound: usize,
    /// Bytes in transparent huge pages after first touch (`None`: unreadable).
    pub huge_bytes: Option<u64>,
    /// Size of the last-level cache as sysfs reports it (see [`llc_bytes`]).
    pub llc_bytes: Option<usize>,
}

impl MembwReport {
    /// One log line.
    pub fn summary(&self) -> String {
        let huge = match self.huge_bytes {
            Some(b) => format!("{:.2} GiB in huge pages", b as f64 / (1u64 << 30) as f64),
            None => "huge pages unknown".to_owned(),
        };
        let llc = match self.llc_bytes {
            Some(l) if l > 0 => {
                let x = self.bytes as f64 / l as f64;
                let warn = if x < 4.0 { " — TOO SMALL, caches inflate the figure" } else { "" };
                format!(", {x:.1}× the {} MiB last-level cache{warn}", l >> 20)
            }
            _ => String::new(),
        };
        format!(
            "memory read bandwidth: {:.1} GB/s best, {:.1} GB/s median of {} reps × {} passes over {:.2} GiB{llc}, {} \
             {} workers ({}), {}/{} slices node-bound, {huge}",
            self.gb_per_s,
            self.median_gb_per_s,
            self.per_rep.len(),
            self.passes,
            self.bytes as f64 / (1u64 << 30) as f64,
            self.threads,
            if self.pinned { "pinned" } else { "unpinned" },
            self.isa.name(),
            self.slices_bound,
            self.threads,
        )
    }
}

/// Measure read bandwidth with all of `pool`'s workers over a `bytes` buffer, `reps` times, with
/// the active ISA ([`isa::active`]).
pub fn read_bandwidth(pool: &WorkerPool, bytes: usize, reps: usize) -> io::Result<MembwReport> {
    read_bandwidth_with(pool, bytes, reps, isa::active())
}

/// As [`read_bandwidth`] with an explicit ISA (lowered to what the CPU has).
pub fn read_bandwidth_with(pool: &WorkerPool, bytes: usize, reps: usize, isa: Isa) -> io::Result<MembwReport> {
    Ok(BandwidthProbe::new(pool, bytes, isa)?.measure(reps))
}

/// A probe buffer placed and first-touched once, to measure again and again: `krasis bench`
/// measures right before and after each timed decode run, so every run is compared with what
/// the host gave in the same minute (other guests move the figure by tens of percent).
pub struct BandwidthProbe<'p> {
    pool: &'p WorkerPool,
    buf: PageBuffer,
    slice: usize,
    isa: Isa,
    slices_bound: usize,
    huge_bytes: Option<u64>,
}

impl<'p> BandwidthProbe<'p> {
    /// Map about `bytes` (whole per-worker slices), bind each worker's slice to its node and let
    /// each worker touch its own slice first.
    pub fn new(pool: &'p WorkerPool, bytes: usize, isa: Isa) -> io::Result<Self> {
        let isa = isa.min(Isa::detect());
        let threads = pool.threads();
        let per = bytes / threads;
        let align = if per >= HUGE_SLICE_MIN { 2 << 20 } else { 4096 };
        let slice = (per / align * align).max(align);
        let total = slice * threads;

        let buf = PageBuffer::new(total)?;
        advise_huge_pages(buf.as_ptr(), total);
        let mut slices_bound = 0;
        if pool.is_pinned() {
            for w in 0..threads {
                let node = pool.os_node(pool.worker_ctx(w).node);
                // SAFETY of the arithmetic: `w * slice + slice <= total`, inside the mapping.
                let p = buf.as_ptr().wrapping_add(w * slice);
                if let Ok(true) = bind_to_node(p, slice, node) {
                    slices_bound += 1;
                }
            }
        }
        let base = SyncPtr(buf.as_ptr() as *mut u8);
        pool.broadcast(&|ctx| {
            // SAFETY: worker `w` writes only its own slice `[w*slice, (w+1)*slice)` of the buffer,
            // which nothing else accesses during this call.
            unsafe { std::ptr::write_bytes(base.get().add(ctx.worker * slice), (ctx.worker as u8) | 1, slice) };
        });
        let huge_bytes = huge_page_bytes(buf.as_ptr(), total);
        Ok(BandwidthProbe { pool, buf, slice, isa, slices_bound, huge_bytes })
    }

    /// One untimed warm-up pass, then `reps` timed repetitions of at least 50 ms each.
    pub fn measure(&self, reps: usize) -> MembwReport {
        let (pool, slice, isa) = (self.pool, self.slice, self.isa);
        let threads = pool.threads();
        let total = slice * threads;
        let reps = reps.max(1);
        // Worker 0 is the calling thread: pin it for the measurement (restored on return).
        let _pin = pool.pin_caller().ok();
        let data = self.buf.as_slice();
        let clock = Instant::now();
        // One timed pass: all workers meet at a barrier, worker 0 starts the clock, each streams
        // its slice `passes` times; the clock stops when the last one is done.
        let timed = |passes: usize| -> f64 {
            let arrived = AtomicUsize::new(0);
            let t0 = AtomicU64::new(0);
            pool.broadcast(&|ctx| {
                arrived.fetch_add(1, Ordering::AcqRel);
                while arrived.load(Ordering::Acquire) < threads {
                    std::hint::spin_loop();
                }
                if ctx.worker == 0 {
                    t0.store(clock.elapsed().as_nanos() as u64, Ordering::Release);
                }
                let mine = &data[ctx.worker * slice..(ctx.worker + 1) * slice];
                for _ in 0..passes {
                    std::hint::black_box(read_stream(isa, std::hint::black_box(mine)));
                }
            });
            let t1 = clock.elapsed().as_nanos() as u64;
            (t1.saturating_sub(t0.load(Ordering::Acquire))).max(1) as f64 * 1e-9
        };
        // Untimed warm-up (TLB, page-table and host-side effects in VMs), which also sizes the reps.
        let warm = timed(1);
        let passes = ((MIN_REP_SECONDS / warm).ceil() as usize).clamp(1, MAX_PASSES);
        let per_rep: Vec<f64> = (0..reps).map(|_| (total * passes) as f64 / timed(passes) / 1e9).collect();
        let mut sorted = per_rep.clone();
        sorted.sort_by(f64::total_cmp);
        let median = if !sorted.len().is_multiple_of(2) {
            sorted[sorted.len() / 2]
        } else {
            0.5 * (sorted[sorted.len() / 2 - 1] + sorted[sorted.len() / 2])
        };
        MembwReport {
            gb_per_s: *sorted.last().unwrap_or(&0.0),
            median_gb_per_s: median,
            bytes: total,
            passes,
            threads,
            per_rep,
            isa,
            pinned: pool.is_pinned(),
            slices_bound: self.slices_bound,
            huge_bytes: self.huge_bytes,
            llc_bytes: llc_bytes(),
        }
    }
}

/// XOR of every 8-byte word of `data` (plus the tail bytes), read with the widest loads `isa`
/// allows. Only the loads matter; the fold keeps them observable.
pub fn read_stream(isa: Isa, data: &[u8]) -> u64 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` is only chosen when the CPU has AVX-512F (see `Isa::detect`).
        Isa::Avx512 if is_x86_feature_detected!("avx512f") => unsafe { read_avx512(data) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: checked right here.
        Isa::Avx2 | Isa::Avx512 if is_x86_feature_detected!("avx2") => unsafe { read_avx2(data) },
        _ => read_scalar(data),
    }
}

fn read_scalar(data: &[u8]) -> u64 {
    let mut acc = [0u64; 8];
    let mut chunks = data.chunks_exact(64);
    for c in &mut chunks {
        for (k, a) in acc.iter_mut().enumerate() {
            *a ^= u64::from_le_bytes(c[8 * k..8 * k + 8].try_into().unwrap());
        }
    }
    acc.iter().fold(0, |x, a| x ^ a) ^ tail(chunks.remainder())
}

fn tail(rest: &[u8]) -> u64 {
    rest.iter().enumerate().fold(0, |x, (i, &b)| x ^ (u64::from(b) << (8 * (i % 8))))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn read_avx2(data: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let p = data.as_ptr();
    let n = data.len() / 128 * 128;
    let (mut a0, mut a1, mut a2, mut a3) =
        (_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256());
    let mut i = 0;
    while i < n {
        let q = p.add(i);
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(q.cast()));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(q.add(32).cast()));
        a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(q.add(64).cast()));
        a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(q.add(96).cast()));
        i += 128;
    }
    let acc = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    let mut lanes = [0u64; 4];
    _mm256_storeu_si256(lanes.as_mut_ptr().cast(), acc);
    lanes.iter().fold(0, |x, a| x ^ a) ^ read_scalar(&data[n..])
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn read_avx512(data: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let p = data.as_ptr();
    let n = data.len() / 256 * 256;
    let (mut a0, mut a1, mut a2, mut a3) =
        (_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512());
    let mut i = 0;
    while i < n {
        let q = p.add(i);
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(q.cast()));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(q.add(64).cast()));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(q.add(128).cast()));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(q.add(192).cast()));
        i += 256;
    }
    let acc = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    let mut lanes = [0u64; 8];
    _mm512_storeu_si512(lanes.as_mut_ptr().cast(), acc);
    lanes.iter().fold(0, |x, a| x ^ a) ^ read_scalar(&data[n..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolPlan;
    use krasis_core::hw::probe;

    #[test]
    fn every_isa_folds_the_same_value() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [0, 1, 7, 63, 64, 65, 127, 128, 255, 256, 257, 4096 + 77, 100_000] {
            for off in [0, 1, 5] {
                let d = &data[off..(off + len).min(data.len())];
                let want = read_scalar(d);
                for isa in Isa::available() {
                    assert_eq!(read_stream(isa, d), want, "isa {} len {len} off {off}", isa.name());
                }
            }
        }
    }

    #[test]
    fn probe_runs_on_small_buffers_and_reports_positive_figures() {
        for pool in [
            WorkerPool::new(PoolPlan::from_system(&probe(), None)).unwrap(),
            WorkerPool::new(PoolPlan::simulated(2, 2)).unwrap(),
        ] {
            for (bytes, reps) in [(16 << 20, 3), (100_000, 2), (0, 1)] {
                let r = read_bandwidth(&pool, bytes, reps).unwrap();
                eprintln!("{}", r.summary());
                assert_eq!(r.per_rep.len(), reps);
                assert!((1..=MAX_PASSES).contains(&r.passes));
                assert_eq!(r.threads, pool.threads());
                assert!(r.bytes >= bytes.min(4096 * pool.threads()) && r.bytes.is_multiple_of(pool.threads()));
                assert!(r.gb_per_s > 0.0 && r.median_gb_per_s > 0.0 && r.median_gb_per_s <= r.gb_per_s);
                assert!(r.per_rep.iter().all(|&g| g > 0.0 && g <= r.gb_per_s));
            }
        }
    }

    #[test]
    fn one_probe_buffer_measures_again_and_again() {
        let pool = WorkerPool::new(PoolPlan::simulated(2, 2)).unwrap();
        let probe = BandwidthProbe::new(&pool, 8 << 20, isa::active()).unwrap();
        let (a, b) = (probe.measure(1), probe.measure(3));
        assert_eq!((a.per_rep.len(), b.per_rep.len()), (1, 3));
        assert_eq!(a.bytes, b.bytes);
        assert!(a.bytes >= 8 << 20 && a.gb_per_s > 0.0 && b.gb_per_s > 0.0);
    }

    #[test]
    fn cache_sizes_parse() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("300M"), Some(300 << 20));
        assert_eq!(parse_cache_size("1G"), Some(1 << 30));
        assert_eq!(parse_cache_size("4096"), Some(4096));
        assert_eq!(parse_cache_size("x"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    #[test]
    fn default_size_scales_with_the_cache_and_is_capped_by_free_memory() {
        assert_eq!(probe_bytes_for(64 << 30, None), DEFAULT_PROBE_BYTES);
        assert_eq!(probe_bytes_for(64 << 30, Some(32 << 20)), DEFAULT_PROBE_BYTES);
        assert_eq!(probe_bytes_for(64 << 30, Some(300 << 20)), 2400 << 20);
        assert_eq!(probe_bytes_for(4 << 30, Some(300 << 20)), 1 << 30);
        assert_eq!(probe_bytes_for(0, None), DEFAULT_PROBE_BYTES);
        let r = SystemReport { mem_available_bytes: 1 << 30, ..Default::default() };
        assert_eq!(default_probe_bytes(&r), 256 << 20);
    }
}
