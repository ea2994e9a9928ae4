//! Page placement for large, long-lived buffers (expert weights): NUMA binding with `mbind`,
//! transparent huge pages with `madvise`, and checking what the kernel actually did.

use std::io;

/// Anonymous, page-aligned, zero-filled memory from `mmap`, unmapped on drop. Expert weights
/// live here so they can be bound to NUMA nodes and backed by huge pages before first touch.
pub struct PageBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory; synchronisation of the contents is the users' business (`&`/`&mut`).
unsafe impl Send for PageBuffer {}
unsafe impl Sync for PageBuffer {}

impl PageBuffer {
    /// Map `len` bytes (rounded up to whole pages). Nothing is touched yet.
    pub fn new(len: usize) -> io::Result<PageBuffer> {
        if len == 0 {
            return Ok(PageBuffer { ptr: std::ptr::NonNull::dangling().as_ptr(), len: 0 });
        }
        #[cfg(unix)]
        {
            // SAFETY: a fresh private anonymous mapping; checked for MAP_FAILED.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            Ok(PageBuffer { ptr: p as *mut u8, len })
        }
        #[cfg(not(unix))]
        {
            let _ = len;
            Err(io::Error::new(io::ErrorKind::Unsupported, "PageBuffer needs a Unix mmap"))
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes, readable, alive while `self` is.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Ask for transparent huge pages on the whole buffer. Returns whether the kernel accepted
    /// the advice (whether pages really are huge shows in [`huge_page_bytes`]).
    pub fn advise_huge_pages(&self) -> bool {
        advise_huge_pages(self.ptr, self.len)
    }
}

impl Drop for PageBuffer {
    fn drop(&mut self) {
        #[cfg(unix)]
        if self.len > 0 {
            // SAFETY: unmapping exactly the mapping created in `new`.
            unsafe {
                libc::munmap(self.ptr as *mut libc::c_void, self.len);
            }
        }
    }
}

/// `madvise(MADV_HUGEPAGE)` on the page-aligned part of `[ptr, ptr+len)`.
pub fn advise_huge_pages(ptr: *const u8, len: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        let (start, len) = page_span(ptr, len);
        if len == 0 {
            return false;
        }
        // SAFETY: advice only; the range lies inside a mapping owned by the caller.
        unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (ptr, len);
        false
    }
}

fn page_size() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 {
            return p as usize;
        }
    }
    4096
}

/// The whole pages inside `[ptr, ptr+len)`.
fn page_span(ptr: *const u8, len: usize) -> (usize, usize) {
    let ps = page_size();
    let start = (ptr as usize).div_ceil(ps) * ps;
    let end = ((ptr as usize) + len) / ps * ps;
    (start, end.saturating_sub(start))
}

/// Bind the pages of `[ptr, ptr+len)` to NUMA node `node` (`mbind`, `MPOL_BIND`, moving pages
/// already touched). Call before first touch where possible. `Ok(false)` when the kernel has no
/// NUMA support (single-node kernels without `CONFIG_NUMA` answer ENOSYS).
pub fn bind_to_node(ptr: *const u8, len: usize, node: usize) -> io::Result<bool> {
    #[cfg(target_os = "linux")]
    {
        const MPOL_BIND: libc::c_long = 2;
        const MPOL_MF_MOVE: libc::c_ulong = 1 << 1;
        let (start, len) = page_span(ptr, len);
        if len == 0 {
            return Ok(true);
        }
        let words = node / 64 + 1;
        let mut mask = vec![0u64; words];
        mask[node / 64] |= 1u64 << (node % 64);
        // SAFETY: mbind reads `words` u64s of mask; the range is inside the caller's mapping.
        let r = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                start as *mut libc::c_void,
                len as libc::c_ulong,
                MPOL_BIND,
                mask.as_ptr(),
                (words * 64 + 1) as libc::c_ulong,
                MPOL_MF_MOVE,
            )
        };
        if r == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOSYS) {
            return Ok(false);
        }
        Err(e)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (ptr, len, node);
        Ok(false)
    }
}

/// Hands the heap's free memory back to the OS (glibc's `malloc_trim`: the free chunks of every
/// arena and the main arena's top; a thread arena's top chunk stays): after a start that built
/// its caches in-process, the freed build buffers would otherwise stay resident and the process
/// would hold more than a cached start does. Returns whether anything was released; a no-op
/// elsewhere.
pub fn release_free_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only returns free pages of the allocator's own arenas.
        unsafe { libc::malloc_trim(0) != 0 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Bytes of `[ptr, ptr+len)` currently backed by transparent huge pages, from
/// `/proc/self/smaps` (`AnonHugePages` of the mappings overlapping the range). `None` if unreadable.
pub fn huge_page_bytes(ptr: *const u8, len: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    Some(parse_smaps_huge_bytes(&smaps, ptr as u64, ptr as u64 + len as u64))
}

/// Sum `AnonHugePages` over the mappings of `smaps` that overlap `[lo, hi)`.
pub fn parse_smaps_huge_bytes(smaps: &str, lo: u64, hi: u64) -> u64 {
    let mut total = 0;
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                inside = a < hi && b > lo;
                continue;
            }
        }
        if inside {
            if let Some(rest) = line.strip_prefix("AnonHugePages:") {
                let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
                total += kb * 1024;
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_buffer_is_zeroed_writable_and_bindable() {
        let mut b = PageBuffer::new(3 << 20).unwrap();
        assert!(b.as_slice().iter().all(|&x| x == 0));
        let _ = b.advise_huge_pages();
        // Node 0 exists on every Linux machine; without NUMA support the call says so.
        let bound = bind_to_node(b.as_ptr(), b.len(), 0).unwrap();
        b.as_mut_slice().fill(7);
        assert!(b.as_slice().iter().all(|&x| x == 7));
        eprintln!("mbind node 0: {bound}; THP bytes: {:?}", huge_page_bytes(b.as_ptr(), b.len()));
    }

    #[test]
    fn smaps_parser_sums_overlapping_mappings_only() {
        let smaps = "7f0000000000-7f0000400000 rw-p 00000000 00:00 0\nSize: 4096 kB\nAnonHugePages: 2048 kB\n\
                     7f0000400000-7f0000800000 rw-p 00000000 00:00 0\nAnonHugePages: 4096 kB\n\
                     7f0001000000-7f0001200000 rw-p 00000000 00:00 0\nAnonHugePages: 2048 kB\n";
        assert_eq!(parse_smaps_huge_bytes(smaps, 0x7f0000000000, 0x7f0000800000), 6144 * 1024);
        assert_eq!(parse_smaps_huge_bytes(smaps, 0x7f0000500000, 0x7f0000600000), 4096 * 1024);
        assert_eq!(parse_smaps_huge_bytes(smaps, 0x7f0002000000, 0x7f0002100000), 0);
    }
}
