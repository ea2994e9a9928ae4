//! Whether a load keeps the cache file's page-cache copy behind it.
//!
//! A loaded cache lives in its own anonymous buffer (huge pages, NUMA placement), so the kernel's
//! page-cache copy of the file is a second copy of the same bytes. It is not in the process's
//! RSS and the kernel reclaims it under pressure, but until then it holds RAM the model may
//! need. Kept, it makes the next start read the cache at memory speed instead of disk speed
//! (on the GPU box: v2-lite's 6.9 GiB INT4 expert cache in ~4 s from disk). So a load keeps it
//! when RAM has room for both copies with a margin, and drops it behind its reads otherwise
//! (the model nearly fills RAM: the copy would only be evicted, after pushing other pages out).
//! `KRASIS_CACHE_PAGE_CACHE=keep|drop` overrides the rule.

/// RAM that must stay available beside the two copies for a load to keep the page-cache copy:
/// room for activations, KV cache and the rest of the system (a few GiB on the boxes we run).
pub const KEEP_PAGE_CACHE_RESERVE_BYTES: u64 = 4 << 30;

/// The environment override of [`keep_page_cache`] (read through [`krasis_core::knobs`]).
pub const PAGE_CACHE_ENV: &str = "KRASIS_CACHE_PAGE_CACHE";

/// Whether a load of a `bytes`-byte cache keeps the file's page-cache copy: `keep`/`drop` from
/// [`PAGE_CACHE_ENV`], else the rule on `MemAvailable` before the load ([`keep_with_available`]).
pub fn keep_page_cache(bytes: u64) -> bool {
    match krasis_core::knobs::knobs().page_cache {
        Some(krasis_core::knobs::PageCache::Keep) => true,
        Some(krasis_core::knobs::PageCache::Drop) => false,
        None => keep_with_available(bytes, krasis_core::hw::mem_available_bytes()),
    }
}

/// The rule: keep when `available` (before the load allocates its buffer) holds the buffer, the
/// page-cache copy and [`KEEP_PAGE_CACHE_RESERVE_BYTES`]; drop when unknown.
pub fn keep_with_available(bytes: u64, available: Option<u64>) -> bool {
    available.is_some_and(|a| a >= bytes.saturating_mul(2).saturating_add(KEEP_PAGE_CACHE_RESERVE_BYTES))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_with_room_for_both_copies_and_the_reserve() {
        let g = 1u64 << 30;
        assert!(keep_with_available(7 * g, Some(18 * g)));
        assert!(!keep_with_available(7 * g, Some(18 * g - 1)));
        assert!(!keep_with_available(7 * g, None));
        assert!(!keep_with_available(u64::MAX, Some(u64::MAX - 1)));
        assert!(keep_with_available(0, Some(KEEP_PAGE_CACHE_RESERVE_BYTES)));
    }
}
