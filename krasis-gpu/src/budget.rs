//! The VRAM budget: every device allocation is charged against it before it is made, so going
//! over the budget is a [`GpuError::VramBudget`] with a clear message, never a CUDA OOM crash.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::GpuError;

/// `--vram-budget auto` leaves this much of the device's free memory uncharged: it covers what
/// the budget does not see (module images, cuBLAS workspaces, the allocator's rounding and pool
/// slack, the display on a desktop card).
pub const AUTO_VRAM_SAFETY_MARGIN: u64 = 1 << 30;

/// Allocations are charged in multiples of this (the driver hands out at least 512-byte aligned
/// blocks), so many tiny buffers cannot slip under the budget.
pub const CHARGE_GRANULE: u64 = 512;

/// What the user asked for with `--vram-budget BYTES|auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum VramBudgetSpec {
    /// Free memory at device open minus [`AUTO_VRAM_SAFETY_MARGIN`].
    #[default]
    Auto,
    /// Exactly this many bytes (must not exceed the free memory at device open).
    Bytes(u64),
}

impl VramBudgetSpec {
    /// The budget in bytes for a device with `free` bytes free, or why it cannot be had.
    pub fn resolve(self, free: u64, ordinal: usize, name: &str) -> Result<u64, GpuError> {
        match self {
            VramBudgetSpec::Auto => Ok(free.saturating_sub(AUTO_VRAM_SAFETY_MARGIN)),
            VramBudgetSpec::Bytes(b) if b > free => {
                Err(GpuError::BudgetAboveFree { budget: b, free, ordinal, name: name.to_string() })
            }
            VramBudgetSpec::Bytes(b) => Ok(b),
        }
    }
}

impl fmt::Display for VramBudgetSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VramBudgetSpec::Auto => f.write_str("auto"),
            VramBudgetSpec::Bytes(b) => write!(f, "{b}"),
        }
    }
}

/// Parses `auto` or a size as [`krasis_core::budget::parse_bytes`] does (`17179869184`, `512M`,
/// `24GiB`, `1.5T`).
impl FromStr for VramBudgetSpec {
    type Err = GpuError;

    fn from_str(s: &str) -> Result<Self, GpuError> {
        let bad = |reason: &str| GpuError::BadBudget { value: s.to_string(), reason: reason.to_string() };
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(VramBudgetSpec::Auto);
        }
        let bytes = krasis_core::budget::parse_bytes(s).map_err(|r| bad(&format!("{r}, or auto")))?;
        if bytes == 0 {
            return Err(bad("the budget must be more than 0 bytes"));
        }
        Ok(VramBudgetSpec::Bytes(bytes))
    }
}

/// Bytes charged for an allocation of `bytes` (rounded up to [`CHARGE_GRANULE`]).
pub fn charged_bytes(bytes: u64) -> u64 {
    bytes.div_ceil(CHARGE_GRANULE).saturating_mul(CHARGE_GRANULE)
}

/// The running account of VRAM charged on one device. Shared (`Arc`) by the device and every
/// [`VramCharge`] it hands out; lock-free.
#[derive(Debug)]
pub struct VramBudget {
    budget: u64,
    used: AtomicU64,
    peak: AtomicU64,
}

impl VramBudget {
    /// A budget of `budget` bytes with nothing charged.
    pub fn new(budget: u64) -> Arc<Self> {
        Arc::new(VramBudget { budget, used: AtomicU64::new(0), peak: AtomicU64::new(0) })
    }

    /// The budget in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes charged now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// The most bytes ever charged at once.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }

    /// Bytes that can still be charged.
    pub fn remaining(&self) -> u64 {
        self.budget.saturating_sub(self.used())
    }

    /// Charges `bytes` (rounded up to [`CHARGE_GRANULE`]) for `what`; the charge is released when
    /// the returned [`VramCharge`] drops. Fails, charging nothing, if the budget would be exceeded.
    pub fn charge(self: &Arc<Self>, bytes: u64, what: &str) -> Result<VramCharge, GpuError> {
        let c = charged_bytes(bytes);
        let mut used = self.used.load(Ordering::Acquire);
        loop {
            let next = used.checked_add(c).filter(|&n| n <= self.budget);
            let Some(next) = next else {
                return Err(GpuError::VramBudget {
                    requested: bytes,
                    used,
                    budget: self.budget,
                    what: what.to_string(),
                });
            };
            match self.used.compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::AcqRel);
                    return Ok(VramCharge { budget: Arc::clone(self), bytes: c });
                }
                Err(now) => used = now,
            }
        }
    }
}

impl fmt::Display for VramBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use krasis_core::budget::format_bytes as fb;
        write!(f, "{} of {} VRAM budget in use (peak {})", fb(self.used()), fb(self.budget), fb(self.peak()))
    }
}

/// A charge against a [`VramBudget`], released on drop.
#[derive(Debug)]
pub struct VramCharge {
    budget: Arc<VramBudget>,
    bytes: u64,
}

impl VramCharge {
    /// The bytes this charge holds (after rounding).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for VramCharge {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_budget_specs() {
        assert_eq!("auto".parse::<VramBudgetSpec>().unwrap(), VramBudgetSpec::Auto);
        assert_eq!("AUTO".parse::<VramBudgetSpec>().unwrap(), VramBudgetSpec::Auto);
        assert_eq!("123".parse::<VramBudgetSpec>().unwrap(), VramBudgetSpec::Bytes(123));
        assert_eq!("24G".parse::<VramBudgetSpec>().unwrap(), VramBudgetSpec::Bytes(24 << 30));
        assert_eq!("24GiB".parse::<VramBudgetSpec>().unwrap(), VramBudgetSpec::Bytes(24 << 30));
        assert_eq!("512 MiB".parse::<VramBudgetSpec>().unwrap(), VramBudgetSpec::Bytes(512 << 20));
        assert_eq!("1.5T".parse::<VramBudgetSpec>().unwrap(), VramBudgetSpec::Bytes(3 << 39));
        for bad in ["", "0", "G", "12X", "-5", "1.5", "abc"] {
            let e = bad.parse::<VramBudgetSpec>().unwrap_err();
            assert!(matches!(e, GpuError::BadBudget { .. }), "{bad:?} gave {e}");
            assert!(!e.to_string().contains('\n'));
        }
    }

    #[test]
    fn auto_subtracts_margin_and_explicit_must_fit() {
        let free = 80u64 << 30;
        assert_eq!(VramBudgetSpec::Auto.resolve(free, 0, "x").unwrap(), free - AUTO_VRAM_SAFETY_MARGIN);
        assert_eq!(VramBudgetSpec::Auto.resolve(100, 0, "x").unwrap(), 0);
        assert_eq!(VramBudgetSpec::Bytes(1 << 30).resolve(free, 0, "x").unwrap(), 1 << 30);
        let e = VramBudgetSpec::Bytes(200 << 30).resolve(free, 1, "NVIDIA H100").unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("200.00 GiB") && msg.contains("GPU 1 (NVIDIA H100)"), "{msg}");
    }

    #[test]
    fn charges_and_releases() {
        let b = VramBudget::new(4096);
        let c1 = b.charge(1000, "a").unwrap();
        assert_eq!(c1.bytes(), 1024);
        assert_eq!(b.used(), 1024);
        let c2 = b.charge(3072, "b").unwrap();
        assert_eq!(b.used(), 4096);
        let e = b.charge(1, "the KV cache").unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, GpuError::VramBudget { requested: 1, used: 4096, budget: 4096, .. }));
        assert!(
            msg.contains("the KV cache") && msg.contains("(`GpuOptions::vram_budget`)") && !msg.contains('\n'),
            "{msg}"
        );
        drop(c1);
        assert_eq!(b.used(), 3072);
        let _c3 = b.charge(1024, "c").unwrap();
        drop(c2);
        assert_eq!(b.used(), 1024);
        assert_eq!(b.peak(), 4096);
        assert_eq!(b.remaining(), 3072);
        assert!(b.charge(u64::MAX, "huge").is_err());
        assert_eq!(b.used(), 1024);
    }

    #[test]
    fn concurrent_charges_never_exceed_budget() {
        let b = VramBudget::new(512 * 100);
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let b = Arc::clone(&b);
                std::thread::spawn(move || {
                    let mut held = Vec::new();
                    for _ in 0..50 {
                        if let Ok(c) = b.charge(512, "t") {
                            held.push(c);
                        }
                        assert!(b.used() <= b.budget());
                    }
                    held
                })
            })
            .collect();
        let held: Vec<Vec<VramCharge>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let total: usize = held.iter().map(Vec::len).sum();
        assert_eq!(total, 100);
        assert_eq!(b.peak(), 512 * 100);
    }
}
