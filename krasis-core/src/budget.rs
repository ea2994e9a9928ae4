//! Memory-budget arithmetic: refuse loads that would not fit in RAM, and check the estimate
//! against the resident set size measured after loading.

/// Refuse to load above this fraction of `MemTotal` unless forced (`EngineConfig::force`).
pub const RAM_REFUSE_FRACTION: f64 = 0.95;
/// Warn when the measured RSS differs from the estimate by more than this fraction.
pub const RSS_ESTIMATE_TOLERANCE: f64 = 0.10;

const KIB: f64 = 1024.0;
const MIB: f64 = KIB * 1024.0;
const GIB: f64 = MIB * 1024.0;
const TIB: f64 = GIB * 1024.0;

/// Why a load was refused.
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    #[error(
        "estimated memory {:.2} GiB exceeds the limit of {:.2} GiB ({:.0}% of {:.2} GiB MemTotal); \
         free memory or choose narrower weights (`EngineOptions::expert_bits`, `EngineOptions::dense_bits`), \
         or load anyway (`EngineConfig::force`)",
        gib(*.estimate_bytes),
        gib(ram_limit_bytes(*.mem_total_bytes)),
        RAM_REFUSE_FRACTION * 100.0,
        gib(*.mem_total_bytes)
    )]
    TooLarge { estimate_bytes: u64, mem_total_bytes: u64 },
}

/// The most bytes a load may need: [`RAM_REFUSE_FRACTION`] of `mem_total_bytes`, rounded to
/// the nearest byte.
pub fn ram_limit_bytes(mem_total_bytes: u64) -> u64 {
    (mem_total_bytes as f64 * RAM_REFUSE_FRACTION).round() as u64
}

/// Checks an estimated load size against RAM. `Ok(None)`: fits. `Ok(Some(warning))`: over the
/// limit but `force` was given, or `MemTotal` is unknown (0). `Err`: over the limit.
pub fn check_ram_budget(estimate_bytes: u64, mem_total_bytes: u64, force: bool) -> Result<Option<String>, BudgetError> {
    if mem_total_bytes == 0 {
        return Ok(Some(format!(
            "total RAM is unknown: cannot check the estimated {} against it",
            format_bytes(estimate_bytes)
        )));
    }
    let limit = ram_limit_bytes(mem_total_bytes);
    if estimate_bytes <= limit {
        return Ok(None);
    }
    if !force {
        return Err(BudgetError::TooLarge { estimate_bytes, mem_total_bytes });
    }
    Ok(Some(format!(
        "`EngineConfig::force`: loading an estimated {:.2} GiB, above the limit of {:.2} GiB ({:.0}% of {:.2} GiB \
         MemTotal); expect swapping or the OOM killer",
        gib(estimate_bytes),
        gib(limit),
        RAM_REFUSE_FRACTION * 100.0,
        gib(mem_total_bytes)
    )))
}

/// A warning when the measured RSS is off the estimate by more than [`RSS_ESTIMATE_TOLERANCE`]
/// (relative to the estimate); `None` when within tolerance.
pub fn rss_deviation_warning(estimate_bytes: u64, measured_rss_bytes: u64) -> Option<String> {
    let diff = estimate_bytes.abs_diff(measured_rss_bytes);
    if diff == 0 {
        return None;
    }
    let direction = if measured_rss_bytes > estimate_bytes { "above" } else { "below" };
    if estimate_bytes == 0 {
        return Some(format!(
            "measured RSS {} but the memory estimate was 0 B; the estimate is wrong",
            format_bytes(measured_rss_bytes)
        ));
    }
    let ratio = diff as f64 / estimate_bytes as f64;
    (ratio > RSS_ESTIMATE_TOLERANCE).then(|| {
        format!(
            "measured RSS {} is {:.1}% {direction} the estimate of {} (tolerance {:.0}%); the \
             memory estimate is off, please report it",
            format_bytes(measured_rss_bytes),
            ratio * 100.0,
            format_bytes(estimate_bytes),
            RSS_ESTIMATE_TOLERANCE * 100.0
        )
    })
}

/// Binary-prefixed size: "12 B", "3.0 KiB", "512.0 MiB", "1.50 GiB", "2.00 TiB".
pub fn format_bytes(b: u64) -> String {
    let x = b as f64;
    if x < KIB {
        format!("{b} B")
    } else if x < MIB {
        format!("{:.1} KiB", x / KIB)
    } else if x < GIB {
        format!("{:.1} MiB", x / MIB)
    } else if x < TIB {
        format!("{:.2} GiB", x / GIB)
    } else {
        format!("{:.2} TiB", x / TIB)
    }
}

fn gib(b: u64) -> f64 {
    b as f64 / GIB
}

/// Parses a byte count (`17179869184`) or a size with a binary unit: `512M`, `24G`, `24GiB`,
/// `1.5T` (K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024; `B` is optional). The error says why
/// not, without the value.
pub fn parse_bytes(s: &str) -> Result<u64, &'static str> {
    const EXPECTED: &str = "expected a byte count or a size such as 24G or 512MiB";
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(EXPECTED),
    };
    if num.is_empty() {
        return Err(EXPECTED);
    }
    if mult == 1 {
        return num.parse::<u64>().map_err(|_| "a byte count must be a whole number");
    }
    let x: f64 = num.parse().map_err(|_| "not a number")?;
    let b = x * mult as f64;
    if !(b.is_finite() && b < u64::MAX as f64) {
        return Err("too large");
    }
    Ok(b.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB_U: u64 = 1 << 30;

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_bytes("2147483648"), Ok(2 << 30));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes(" 64 m "), Ok(64 << 20));
        assert_eq!(parse_bytes("0.5K"), Ok(512));
        for bad in ["", "G", "12X", "-5", "1.5", "1e400G"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn limit_is_95_percent() {
        assert_eq!(ram_limit_bytes(100), 95);
        assert_eq!(ram_limit_bytes(100 * GIB_U), 95 * GIB_U);
        assert_eq!(ram_limit_bytes(0), 0);
    }

    #[test]
    fn ram_budget_boundaries() {
        let total = 100 * GIB_U;
        let limit = 95 * GIB_U;
        assert!(matches!(check_ram_budget(0, total, false), Ok(None)));
        assert!(matches!(check_ram_budget(limit, total, false), Ok(None)));
        assert!(matches!(
            check_ram_budget(limit + 1, total, false),
            Err(BudgetError::TooLarge {
                estimate_bytes,
                mem_total_bytes,
            }) if estimate_bytes == limit + 1 && mem_total_bytes == total
        ));
        assert!(check_ram_budget(2 * total, total, false).is_err());
    }

    #[test]
    fn ram_budget_forced() {
        let total = 100 * GIB_U;
        let warning = check_ram_budget(99 * GIB_U, total, true)
            .expect("forced load is allowed")
            .expect("forced load past the limit warns");
        assert!(warning.starts_with("`EngineConfig::force`: "), "{warning}");
        assert!(warning.contains("99.00 GiB") && warning.contains("95.00 GiB"), "{warning}");
        // Forcing a load that fits changes nothing.
        assert!(matches!(check_ram_budget(GIB_U, total, true), Ok(None)));
    }

    #[test]
    fn ram_budget_unknown_total_warns() {
        let warning = check_ram_budget(GIB_U, 0, false).expect("unknown total is not an error");
        assert!(warning.is_some_and(|w| w.contains("unknown")));
    }

    #[test]
    fn error_message_has_numbers() {
        let err = check_ram_budget(120 * GIB_U, 100 * GIB_U, false).unwrap_err();
        let msg = err.to_string();
        for needle in
            ["120.00 GiB", "95.00 GiB", "100.00 GiB", "95%", "`EngineOptions::expert_bits`", "`EngineConfig::force`"]
        {
            assert!(msg.contains(needle), "{needle:?} missing from {msg:?}");
        }
    }

    #[test]
    fn rss_deviation() {
        assert_eq!(rss_deviation_warning(1000, 1000), None);
        assert_eq!(rss_deviation_warning(1000, 1100), None); // exactly +10%
        assert_eq!(rss_deviation_warning(1000, 900), None); // exactly -10%
        assert_eq!(rss_deviation_warning(0, 0), None);

        let above = rss_deviation_warning(1000, 1101).expect("+10.1% warns");
        assert!(above.contains("above"), "{above}");
        let below = rss_deviation_warning(10 * GIB_U, 8 * GIB_U).expect("-20% warns");
        assert!(below.contains("20.0% below") && below.contains("10.00 GiB"), "{below}");
        assert!(rss_deviation_warning(0, 4096).is_some());
    }

    #[test]
    fn bytes_formatting() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(12), "12 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1024), "1.0 KiB");
        assert_eq!(format_bytes(512 << 20), "512.0 MiB");
        assert_eq!(format_bytes(3 << 29), "1.50 GiB");
        assert_eq!(format_bytes(2 << 40), "2.00 TiB");
        assert_eq!(format_bytes(u64::MAX), "16777216.00 TiB");
    }
}
