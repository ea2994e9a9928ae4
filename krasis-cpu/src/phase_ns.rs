//! Process-wide nanosecond counters for benches: where a prefill's time goes, by stage. Each
//! counter is one relaxed atomic add per stage and call, cheap enough to stay in release builds;
//! `krasis bench` prints them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// `N` stage counters.
pub struct PhaseNs<const N: usize>([AtomicU64; N]);

impl<const N: usize> PhaseNs<N> {
    pub const fn new() -> Self {
        PhaseNs([const { AtomicU64::new(0) }; N])
    }

    /// Adds the time since `*t` to stage `i` and restarts `*t`.
    pub fn lap(&self, t: &mut Instant, i: usize) {
        let now = Instant::now();
        self.0[i].fetch_add((now - *t).as_nanos() as u64, Ordering::Relaxed);
        *t = now;
    }

    /// Nanoseconds per stage so far.
    pub fn get(&self) -> [u64; N] {
        std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed))
    }
}

impl<const N: usize> Default for PhaseNs<N> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_add_up_per_stage() {
        let p = PhaseNs::<2>::new();
        let mut t = Instant::now() - std::time::Duration::from_millis(3);
        p.lap(&mut t, 1);
        let got = p.get();
        assert_eq!(got[0], 0);
        assert!(got[1] >= 3_000_000, "{got:?}");
        assert!(t.elapsed().as_millis() < 3);
    }
}
