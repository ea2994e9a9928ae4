//! Whether this process may use AMX-INT8: CPUID leaf 7 (EDX bit 24 AMX-TILE, bit 25 AMX-INT8),
//! the OS enabling the tile state in XCR0 (bits 17 XTILECFG and 18 XTILEDATA), and Linux
//! granting the process the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`, Linux ≥ 5.16; without it the first tile instruction is a SIGILL).
//! `is_x86_feature_detected!("amx-int8")` is unstable in Rust 1.95, hence CPUID by hand.

use std::sync::OnceLock;

/// `arch_prctl` code: request permission for a dynamically enabled XSAVE feature.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
/// `arch_prctl` code: the bitmap of permitted XSAVE features.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
/// The XSAVE feature number of the AMX tile data.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
const XFEATURE_XTILEDATA: libc::c_long = 18;
/// XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
const XCR0_AMX: u64 = (1 << 17) | (1 << 18);

/// What the probe found (for the startup log and the tests' skip lines).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AmxSupport {
    /// The CPU has AMX-INT8 and the process may use it.
    Usable,
    /// Why not.
    Unusable(String),
}

/// Probe once per process (the permission request is process-wide).
pub fn support() -> &'static AmxSupport {
    static S: OnceLock<AmxSupport> = OnceLock::new();
    S.get_or_init(probe)
}

/// Whether AMX-INT8 tiles can run in this process.
pub fn hw_available() -> bool {
    *support() == AmxSupport::Usable
}

/// Whether AMX-BF16 tiles (`tdpbf16ps`, CPUID leaf 7 EDX bit 22) and the AVX-512 BF16
/// conversions that feed them can run in this process (on top of [`hw_available`]).
pub fn bf16_available() -> bool {
    static B: OnceLock<bool> = OnceLock::new();
    *B.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            // SAFETY: CPUID exists on every x86_64 CPU; leaf 7 is checked by `hw_available`.
            #[allow(unused_unsafe)]
            let l7 = unsafe { std::arch::x86_64::__cpuid_count(7, 0) };
            hw_available() && (l7.edx >> 22) & 1 == 1 && std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn probe() -> AmxSupport {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    #[allow(unused_unsafe)] // `__cpuid` is a safe fn in newer Rust
    // SAFETY: CPUID exists on every x86_64 CPU.
    let (max, l1, l7) = unsafe {
        let max = __cpuid(0).eax;
        (max, __cpuid(1), if max >= 7 { Some(__cpuid_count(7, 0)) } else { None })
    };
    let Some(l7) = l7 else { return AmxSupport::Unusable(format!("CPUID max leaf {max} < 7")) };
    if (l7.edx >> 24) & 1 == 0 || (l7.edx >> 25) & 1 == 0 {
        return AmxSupport::Unusable("the CPU has no AMX-INT8".into());
    }
    if (l1.ecx >> 27) & 1 == 0 {
        return AmxSupport::Unusable("OSXSAVE is off".into());
    }
    let xcr0 = xgetbv0();
    if xcr0 & XCR0_AMX != XCR0_AMX {
        return AmxSupport::Unusable(format!("the OS does not enable the AMX state (XCR0 = {xcr0:#x})"));
    }
    // SAFETY: arch_prctl with these codes only reads its integer argument.
    let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return AmxSupport::Unusable(format!("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: {e}"));
    }
    let mut perm: u64 = 0;
    // SAFETY: ARCH_GET_XCOMP_PERM writes one u64 through the pointer.
    let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mut perm as *mut u64) };
    if rc != 0 || perm & (1 << XFEATURE_XTILEDATA) == 0 {
        return AmxSupport::Unusable(format!("XTILEDATA not permitted after the request (perm {perm:#x})"));
    }
    AmxSupport::Usable
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn probe() -> AmxSupport {
    AmxSupport::Unusable("AMX is used on x86_64 Linux only".into())
}

/// XCR0 (the caller checked OSXSAVE).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn xgetbv0() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: XGETBV with ECX = 0 is valid whenever OSXSAVE is set.
    unsafe {
        std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags))
    };
    ((hi as u64) << 32) | lo as u64
}
