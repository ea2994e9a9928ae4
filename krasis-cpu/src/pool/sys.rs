//! The few OS calls the pool needs: thread affinity (`sched_setaffinity`/`sched_getaffinity`)
//! and futex wait/wake on a 32-bit atomic. Off Linux, pinning reports `Unsupported` and the
//! futex calls degrade to a short sleep / no-op (every wait sits in a loop that rechecks its
//! condition, so that is slow but correct).

use std::io;
use std::sync::atomic::AtomicU32;

/// CPU ids above this are refused (matches the hardware probe's parser limit).
const MAX_CPU_ID: usize = krasis_core::hw::MAX_CPU_ID;

/// Pin the calling thread to exactly `cpus`.
#[cfg(target_os = "linux")]
pub fn set_affinity(cpus: &[usize]) -> io::Result<()> {
    let word_bits = libc::c_ulong::BITS as usize;
    let max = cpus.iter().copied().max().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty CPU set"))?;
    if max > MAX_CPU_ID {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("CPU id {max} out of range")));
    }
    // At least a cpu_set_t's worth of words: some libcs insist on that size.
    let words = (max / word_bits + 1).max(1024 / word_bits);
    let mut mask: Vec<libc::c_ulong> = vec![0; words];
    for &c in cpus {
        mask[c / word_bits] |= 1 << (c % word_bits);
    }
    let bytes = std::mem::size_of_val(mask.as_slice());
    // SAFETY: `mask` is a readable buffer of `bytes` bytes; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, bytes, mask.as_ptr().cast::<libc::cpu_set_t>()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
pub fn set_affinity(_cpus: &[usize]) -> io::Result<()> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "thread pinning needs Linux"))
}

/// The CPUs the calling thread may run on.
#[cfg(target_os = "linux")]
pub fn current_affinity() -> io::Result<Vec<usize>> {
    let word_bits = libc::c_ulong::BITS as usize;
    let mut words = 1024 / word_bits;
    loop {
        let mut mask: Vec<libc::c_ulong> = vec![0; words];
        let bytes = std::mem::size_of_val(mask.as_slice());
        // SAFETY: `mask` is a writable buffer of `bytes` bytes; the kernel writes at most that.
        let rc = unsafe { libc::sched_getaffinity(0, bytes, mask.as_mut_ptr().cast::<libc::cpu_set_t>()) };
        if rc == 0 {
            return Ok((0..words * word_bits).filter(|&c| mask[c / word_bits] >> (c % word_bits) & 1 == 1).collect());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) || words * word_bits > MAX_CPU_ID {
            return Err(e);
        }
        words *= 2;
    }
}

#[cfg(not(target_os = "linux"))]
pub fn current_affinity() -> io::Result<Vec<usize>> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "thread affinity needs Linux"))
}

/// Sleep while `*word == expected` (or until woken / a spurious wake-up). Callers loop.
#[cfg(target_os = "linux")]
pub fn futex_wait(word: &AtomicU32, expected: u32) {
    // SAFETY: `word` is a live, aligned 32-bit atomic; FUTEX_WAIT only reads it. A null timeout
    // waits indefinitely; EAGAIN (value changed) and EINTR just return to the caller's loop.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

/// Wake every thread sleeping in [`futex_wait`] on `word`.
#[cfg(target_os = "linux")]
pub fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live, aligned 32-bit word touches no memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, i32::MAX);
    }
}

#[cfg(not(target_os = "linux"))]
pub fn futex_wait(word: &AtomicU32, expected: u32) {
    if word.load(std::sync::atomic::Ordering::Acquire) == expected {
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

#[cfg(not(target_os = "linux"))]
pub fn futex_wake_all(_word: &AtomicU32) {}
