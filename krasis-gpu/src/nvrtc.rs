//! NVRTC loaded with `dlopen` by krasis itself (not through cudarc), so that the library can be
//! any installed major version (12 or 13), a path given in `KRASIS_NVRTC_LIB` (the PyPI wheel in
//! CI), and so that a missing library is an error, never a panic.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};

use crate::GpuError;

/// Environment variable naming the libnvrtc to load (a path, or a name for the dynamic loader).
pub const NVRTC_LIB_ENV: &str = "KRASIS_NVRTC_LIB";

type NvrtcResult = c_int;
type Program = *mut c_void;

struct Fns {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult,
    get_error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
    create_program: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> NvrtcResult,
    destroy_program: unsafe extern "C" fn(*mut Program) -> NvrtcResult,
    compile_program: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult,
    get_program_log_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    get_program_log: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    get_ptx_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    get_ptx: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    get_cubin_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    get_cubin: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    get_num_supported_archs: Option<unsafe extern "C" fn(*mut c_int) -> NvrtcResult>,
    get_supported_archs: Option<unsafe extern "C" fn(*mut c_int) -> NvrtcResult>,
}

/// A loaded libnvrtc.
pub struct Nvrtc {
    fns: Fns,
    path: String,
    version: (i32, i32),
    supported_archs: Vec<i32>,
    /// Serialises compiles on NVRTC releases before 12 (from 12 on, NVRTC is documented
    /// thread-safe and the kernels of a cold start compile in parallel).
    lock: Mutex<()>,
    _lib: libloading::Library,
}

/// What a compile produces: SASS for one real architecture, or PTX for the driver to JIT.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ImageKind {
    Cubin,
    Ptx,
}

/// The one architecture whose SASS is built with its architecture-specific features (`sm_90a`:
/// Hopper's `wgmma`).
pub const ARCH_SPECIFIC_SM: i32 = 90;

/// A compilation target: `sm_XY` (cubin) or `compute_XY` (PTX).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    /// Compute capability as major * 10 + minor (90 for sm_90).
    pub arch: i32,
    pub kind: ImageKind,
}

impl Target {
    /// SASS for `sm_{arch}`.
    pub fn sass(arch: i32) -> Self {
        Target { arch, kind: ImageKind::Cubin }
    }

    /// The `--gpu-architecture` value: `sm_XY` or `compute_XY`, and `sm_90a` for SASS on sm_90:
    /// that image runs on sm_90 devices only (as every image of this kind does) and unlocks the
    /// architecture-specific instructions (`wgmma`) that the flash prefill's fastest kernel uses.
    pub fn arch_flag(&self) -> String {
        match self.kind {
            ImageKind::Cubin if self.arch_specific() => format!("sm_{}a", self.arch),
            ImageKind::Cubin => format!("sm_{}", self.arch),
            ImageKind::Ptx => format!("compute_{}", self.arch),
        }
    }

    /// Whether kernels are built with the architecture-specific features (`sm_90a`), so that code
    /// under `__CUDA_ARCH_FEAT_SM90_ALL` exists.
    pub fn arch_specific(&self) -> bool {
        self.kind == ImageKind::Cubin && self.arch == ARCH_SPECIFIC_SM
    }

    /// The best target for a device of compute capability `arch` given the architectures this
    /// NVRTC supports: SASS for the device's own architecture when NVRTC knows it, otherwise PTX
    /// for the newest architecture it knows that the device can run (the driver JITs it). `None`
    /// when NVRTC knows no architecture the device can run.
    pub fn choose(arch: i32, supported: &[i32]) -> Option<Self> {
        if supported.is_empty() || supported.contains(&arch) {
            return Some(Target::sass(arch));
        }
        supported.iter().copied().filter(|&a| a <= arch).max().map(|a| Target { arch: a, kind: ImageKind::Ptx })
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.arch_flag())
    }
}

/// A header made available to `#include "name"` in kernel sources.
#[derive(Clone, Copy, Debug)]
pub struct Header {
    pub name: &'static str,
    pub src: &'static str,
}

static NVRTC: OnceLock<Result<Nvrtc, String>> = OnceLock::new();

/// The process-wide libnvrtc, loaded on first use.
pub fn nvrtc() -> Result<&'static Nvrtc, GpuError> {
    NVRTC.get_or_init(Nvrtc::load).as_ref().map_err(|detail| GpuError::NoNvrtc { detail: detail.clone() })
}

/// Where libnvrtc is looked for, in order: `KRASIS_NVRTC_LIB` alone when set; otherwise the
/// sonames of NVRTC 13/12/11.2 through the dynamic loader's search path, then the same names under
/// `$CUDA_HOME`, `$CUDA_PATH` and `/usr/local/cuda`.
pub fn candidates() -> Vec<String> {
    crate::libsearch::candidates(
        krasis_core::knobs::knobs().nvrtc_lib.as_deref(),
        &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so", "libnvrtc.so.11.2"],
    )
}

impl Nvrtc {
    fn load() -> Result<Nvrtc, String> {
        let cands = candidates();
        // SAFETY: loading libnvrtc runs only its (side-effect free) initialisers.
        let errors = match unsafe { crate::libsearch::open_first(&cands) } {
            Ok((lib, path)) => return Nvrtc::from_library(lib, path),
            Err(errors) => errors,
        };
        if krasis_core::knobs::knobs().nvrtc_lib.is_some() {
            Err(format!("{NVRTC_LIB_ENV}={} not loadable: {}", cands[0], errors.join("; ")))
        } else {
            Err(format!("tried {} names and paths, e.g. libnvrtc.so.12 and /usr/local/cuda/lib64", cands.len()))
        }
    }

    fn from_library(lib: libloading::Library, path: String) -> Result<Nvrtc, String> {
        // SAFETY: the symbol types match nvrtc.h (NVRTC 11.2 through 13.x).
        unsafe {
            macro_rules! sym {
                ($name:literal) => {
                    *lib.get($name).map_err(|e| format!("{path}: missing {}: {e}", String::from_utf8_lossy($name)))?
                };
            }
            macro_rules! opt_sym {
                ($name:literal) => {
                    lib.get($name).ok().map(|s| *s)
                };
            }
            let fns = Fns {
                version: sym!(b"nvrtcVersion\0"),
                get_error_string: sym!(b"nvrtcGetErrorString\0"),
                create_program: sym!(b"nvrtcCreateProgram\0"),
                destroy_program: sym!(b"nvrtcDestroyProgram\0"),
                compile_program: sym!(b"nvrtcCompileProgram\0"),
                get_program_log_size: sym!(b"nvrtcGetProgramLogSize\0"),
                get_program_log: sym!(b"nvrtcGetProgramLog\0"),
                get_ptx_size: sym!(b"nvrtcGetPTXSize\0"),
                get_ptx: sym!(b"nvrtcGetPTX\0"),
                get_cubin_size: sym!(b"nvrtcGetCUBINSize\0"),
                get_cubin: sym!(b"nvrtcGetCUBIN\0"),
                get_num_supported_archs: opt_sym!(b"nvrtcGetNumSupportedArchs\0"),
                get_supported_archs: opt_sym!(b"nvrtcGetSupportedArchs\0"),
            };
            let (mut major, mut minor) = (0, 0);
            let r = (fns.version)(&mut major, &mut minor);
            if r != 0 {
                return Err(format!("{path}: nvrtcVersion failed ({r})"));
            }
            let mut supported_archs = Vec::new();
            if let (Some(num), Some(get)) = (fns.get_num_supported_archs, fns.get_supported_archs) {
                let mut n = 0;
                if num(&mut n) == 0 && n > 0 {
                    supported_archs = vec![0; n as usize];
                    if get(supported_archs.as_mut_ptr()) != 0 {
                        supported_archs.clear();
                    }
                }
            }
            Ok(Nvrtc { fns, path, version: (major, minor), supported_archs, lock: Mutex::new(()), _lib: lib })
        }
    }

    /// The path or name it was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `(major, minor)`, e.g. `(12, 9)`.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// The `sm_XY` architectures this NVRTC can compile for, as `XY` (empty when it cannot say).
    pub fn supported_archs(&self) -> &[i32] {
        &self.supported_archs
    }

    fn err_string(&self, r: NvrtcResult) -> String {
        // SAFETY: nvrtcGetErrorString returns a static string for any code.
        let p = unsafe { (self.fns.get_error_string)(r) };
        if p.is_null() {
            format!("NVRTC error {r}")
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    /// Compiles `src` (named `name` in diagnostics) for `target` with the given extra options.
    /// Returns the image: cubin bytes, or NUL-terminated PTX text. A rejected program is
    /// [`GpuError::Compile`] carrying NVRTC's log.
    pub fn compile(
        &self,
        name: &str,
        src: &str,
        headers: &[Header],
        target: Target,
        extra_opts: &[&str],
    ) -> Result<Vec<u8>, GpuError> {
        let nv = |op: &'static str, r: NvrtcResult| GpuError::Nvrtc { op, detail: self.err_string(r) };
        let cstr = |s: &str| {
            CString::new(s).map_err(|_| GpuError::Nvrtc { op: "nvrtcCreateProgram", detail: "NUL in source".into() })
        };
        let c_src = cstr(src)?;
        let c_name = cstr(&format!("{name}.cu"))?;
        let h_src: Vec<CString> = headers.iter().map(|h| cstr(h.src)).collect::<Result<_, _>>()?;
        let h_name: Vec<CString> = headers.iter().map(|h| cstr(h.name)).collect::<Result<_, _>>()?;
        let h_src_p: Vec<*const c_char> = h_src.iter().map(|c| c.as_ptr()).collect();
        let h_name_p: Vec<*const c_char> = h_name.iter().map(|c| c.as_ptr()).collect();
        let mut opts: Vec<CString> = vec![cstr(&format!("--gpu-architecture={}", target.arch_flag()))?];
        for o in extra_opts {
            opts.push(cstr(o)?);
        }
        let opts_p: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();

        let _guard = (self.version.0 < 12).then(|| self.lock.lock().unwrap_or_else(|p| p.into_inner()));
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the duration of the calls; the program is destroyed
        // on every path below.
        unsafe {
            let r = (self.fns.create_program)(
                &mut prog,
                c_src.as_ptr(),
                c_name.as_ptr(),
                headers.len() as c_int,
                if headers.is_empty() { std::ptr::null() } else { h_src_p.as_ptr() },
                if headers.is_empty() { std::ptr::null() } else { h_name_p.as_ptr() },
            );
            if r != 0 {
                return Err(nv("nvrtcCreateProgram", r));
            }
            let result = (|| {
                let rc = (self.fns.compile_program)(prog, opts_p.len() as c_int, opts_p.as_ptr());
                if rc != 0 {
                    let mut log = self.program_log(prog);
                    if log.trim().is_empty() {
                        log = self.err_string(rc);
                    }
                    return Err(GpuError::Compile { kernel: name.to_string(), arch: target.arch_flag(), log });
                }
                let (size_fn, get_fn, what) = match target.kind {
                    ImageKind::Cubin => (self.fns.get_cubin_size, self.fns.get_cubin, "nvrtcGetCUBIN"),
                    ImageKind::Ptx => (self.fns.get_ptx_size, self.fns.get_ptx, "nvrtcGetPTX"),
                };
                let mut size = 0usize;
                let r = size_fn(prog, &mut size);
                if r != 0 {
                    return Err(nv(what, r));
                }
                let mut buf = vec![0u8; size];
                let r = get_fn(prog, buf.as_mut_ptr() as *mut c_char);
                if r != 0 {
                    return Err(nv(what, r));
                }
                if buf.is_empty() {
                    return Err(GpuError::Nvrtc { op: what, detail: "empty image".into() });
                }
                Ok(buf)
            })();
            (self.fns.destroy_program)(&mut prog);
            result
        }
    }

    unsafe fn program_log(&self, prog: Program) -> String {
        let mut size = 0usize;
        if (self.fns.get_program_log_size)(prog, &mut size) != 0 || size == 0 {
            return String::new();
        }
        let mut buf = vec![0u8; size];
        if (self.fns.get_program_log)(prog, buf.as_mut_ptr() as *mut c_char) != 0 {
            return String::new();
        }
        while buf.last() == Some(&0) {
            buf.pop();
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_choice() {
        let sup = [75, 80, 86, 89, 90];
        assert_eq!(Target::choose(90, &sup), Some(Target::sass(90)));
        assert_eq!(Target::choose(120, &sup), Some(Target { arch: 90, kind: ImageKind::Ptx }));
        assert_eq!(Target::choose(70, &sup), None);
        assert_eq!(Target::choose(90, &[]), Some(Target::sass(90)));
        assert_eq!(Target::sass(89).arch_flag(), "sm_89");
        assert_eq!(Target::sass(90).arch_flag(), "sm_90a");
        assert!(Target::sass(90).arch_specific() && !Target::sass(89).arch_specific());
        assert!(!Target { arch: 90, kind: ImageKind::Ptx }.arch_specific());
        assert_eq!(Target { arch: 90, kind: ImageKind::Ptx }.to_string(), "compute_90");
    }
}
