//! Counts read from `KRASIS_*` environment variables (tuning knobs and thresholds).

/// `name` as a count (surrounding spaces ignored), or `default` when unset; a value that is not
/// a count is reported and gives `default`.
pub(crate) fn count_or(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Err(_) => default,
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!("{name}={v:?} is not a count; using {default}");
            default
        }),
    }
}

/// `name` as a positive count, else `default` (unset, zero or not a count alike).
pub(crate) fn positive_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok()).filter(|&v| v > 0).unwrap_or(default)
}
