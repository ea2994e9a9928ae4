//! Counts read from `KRASIS_*` environment variables (tuning knobs and thresholds).

/// `name` as a count (surrounding spaces ignored), or `default` when unset; a value that is not
/// a count is reported and gives `default`.
pub(crate) fn count_or(name: &str, default: usize) -> usize {
    count(name).unwrap_or(default)
}

/// `name` as a count, or `None` when unset or not a count (the latter reported): also an
/// override of a value that has no fixed default.
pub(crate) fn count(name: &str) -> Option<usize> {
    let v = std::env::var(name).ok()?;
    let n = v.trim().parse().ok();
    if n.is_none() {
        tracing::warn!("{name}={v:?} is not a count; ignored (the default stays)");
    }
    n
}

/// `name` as a positive count, else `default` (unset, zero or not a count alike).
pub(crate) fn positive_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok()).filter(|&v| v > 0).unwrap_or(default)
}
