//! cuBLAS loaded with `dlopen` by krasis itself (not through cudarc, whose loader knows only the
//! 12.x sonames), so that `libcublas.so.13` (CUDA 13), `libcublas.so.12`, a toolkit under
//! `$CUDA_HOME` or `/usr/local/cuda`, or an explicit `KRASIS_CUBLAS_LIB` path all work, and a
//! missing library is a one-line error, never a panic. Only the few entry points krasis calls are
//! resolved; their C ABI is the same in cuBLAS 12 and 13.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys::CUstream;

use crate::GpuError;

/// Environment variable naming the libcublas to load (a path, or a name for the dynamic loader).
pub const CUBLAS_LIB_ENV: &str = "KRASIS_CUBLAS_LIB";

/// `cublasStatus_t`.
pub type Status = c_int;
/// `cublasHandle_t`.
pub type Handle = *mut c_void;

/// `cublasOperation_t`.
pub const OP_N: c_int = 0;
pub const OP_T: c_int = 1;
/// `cudaDataType_t`.
pub const R_32F: c_int = 0;
pub const R_16BF: c_int = 14;
/// `cublasComputeType_t::CUBLAS_COMPUTE_32F` (no TF32, no reduced-precision shortcuts).
pub const COMPUTE_32F: c_int = 68;
/// `cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT`.
pub const GEMM_DEFAULT: c_int = -1;

type GemmExFn = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    *mut c_void,
    c_int,
    c_int,
    c_int,
    c_int,
) -> Status;

/// The resolved entry points of one loaded libcublas.
pub struct Cublas {
    create: unsafe extern "C" fn(*mut Handle) -> Status,
    destroy: unsafe extern "C" fn(Handle) -> Status,
    set_stream: unsafe extern "C" fn(Handle, CUstream) -> Status,
    set_workspace: Option<unsafe extern "C" fn(Handle, *mut c_void, usize) -> Status>,
    gemm_ex: GemmExFn,
    get_version: Option<unsafe extern "C" fn(Handle, *mut c_int) -> Status>,
    path: String,
    _lib: libloading::Library,
}

// SAFETY: the struct holds plain function pointers into a library that stays loaded for the life
// of the process (it is kept in a static); cuBLAS entry points are callable from any thread.
unsafe impl Send for Cublas {}
unsafe impl Sync for Cublas {}

static CUBLAS: OnceLock<Result<Cublas, String>> = OnceLock::new();

/// The process-wide libcublas, loaded on first use. The outcome (either way) is cached.
pub fn cublas() -> Result<&'static Cublas, GpuError> {
    CUBLAS.get_or_init(|| Cublas::load(&candidates())).as_ref().map_err(|d| GpuError::NoCublas { detail: d.clone() })
}

/// Where libcublas is looked for, in order: `KRASIS_CUBLAS_LIB` alone when set; otherwise the
/// sonames of cuBLAS 13 and 12 through the dynamic loader's search path, then the same names
/// under `$CUDA_HOME`, `$CUDA_PATH` and `/usr/local/cuda`.
pub fn candidates() -> Vec<String> {
    crate::libsearch::candidates(
        krasis_core::knobs::knobs().cublas_lib.as_deref(),
        &["libcublas.so.13", "libcublas.so.12", "libcublas.so"],
    )
}

/// The name of a `cublasStatus_t`.
pub fn status_name(s: Status) -> &'static str {
    match s {
        0 => "CUBLAS_STATUS_SUCCESS",
        1 => "CUBLAS_STATUS_NOT_INITIALIZED",
        3 => "CUBLAS_STATUS_ALLOC_FAILED",
        7 => "CUBLAS_STATUS_INVALID_VALUE",
        8 => "CUBLAS_STATUS_ARCH_MISMATCH",
        11 => "CUBLAS_STATUS_MAPPING_ERROR",
        13 => "CUBLAS_STATUS_EXECUTION_FAILED",
        14 => "CUBLAS_STATUS_INTERNAL_ERROR",
        15 => "CUBLAS_STATUS_NOT_SUPPORTED",
        16 => "CUBLAS_STATUS_LICENSE_ERROR",
        _ => "unknown cuBLAS status",
    }
}

fn check(op: &'static str, s: Status) -> Result<(), GpuError> {
    if s == 0 {
        Ok(())
    } else {
        Err(GpuError::Cublas { op, detail: format!("{} ({s})", status_name(s)) })
    }
}

impl Cublas {
    /// Tries each candidate in turn; the error names what was tried.
    pub fn load(cands: &[String]) -> Result<Cublas, String> {
        // SAFETY: loading libcublas runs only its initialisers (no CUDA calls until used).
        let errors = match unsafe { crate::libsearch::open_first(cands) } {
            Ok((lib, path)) => return Cublas::from_library(lib, path),
            Err(errors) => errors,
        };
        match cands {
            [one] => Err(format!("cuBLAS not found: tried {one}: {}", errors.join("; "))),
            _ => Err(format!(
                "cuBLAS not found: tried {} names and paths (libcublas.so.13, libcublas.so.12, libcublas.so, \
                 $CUDA_HOME/lib64, /usr/local/cuda/lib64); set {CUBLAS_LIB_ENV}=/path/to/libcublas.so.N",
                cands.len()
            )),
        }
    }

    fn from_library(lib: libloading::Library, path: String) -> Result<Cublas, String> {
        // SAFETY: the symbol types match cublas_api.h of cuBLAS 12.x and 13.x.
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
            Ok(Cublas {
                create: sym!(b"cublasCreate_v2\0"),
                destroy: sym!(b"cublasDestroy_v2\0"),
                set_stream: sym!(b"cublasSetStream_v2\0"),
                set_workspace: opt_sym!(b"cublasSetWorkspace_v2\0"),
                gemm_ex: sym!(b"cublasGemmEx\0"),
                get_version: opt_sym!(b"cublasGetVersion_v2\0"),
                path,
                _lib: lib,
            })
        }
    }

    /// The path or name it was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }
}

/// A cuBLAS handle bound to one stream. The CUDA context that owns the stream must be current on
/// the calling thread for every call (the owner, [`crate::GemmContext`], binds it).
pub struct CublasHandle {
    lib: &'static Cublas,
    handle: Handle,
}

// SAFETY: a cuBLAS handle may be used from any thread as long as calls are not concurrent;
// `GemmContext` serialises them behind a mutex.
unsafe impl Send for CublasHandle {}

impl CublasHandle {
    /// Creates a handle (in the current context) and binds it to `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of the current context that outlives the handle.
    pub unsafe fn new(lib: &'static Cublas, stream: CUstream) -> Result<Self, GpuError> {
        let mut handle: Handle = std::ptr::null_mut();
        check("cublasCreate", (lib.create)(&mut handle))?;
        let h = CublasHandle { lib, handle };
        check("cublasSetStream", (lib.set_stream)(h.handle, stream))?;
        Ok(h)
    }

    /// The library version, e.g. 130100 (13.1.0), when the library can say.
    pub fn version(&self) -> Option<i32> {
        let f = self.lib.get_version?;
        let mut v = 0;
        // SAFETY: writes one int.
        (unsafe { f(self.handle, &mut v) } == 0).then_some(v)
    }

    /// Gives cuBLAS a workspace of our own (charged to the VRAM budget by the caller) instead of
    /// one it allocates itself. Returns false when the library lacks `cublasSetWorkspace`.
    ///
    /// # Safety
    /// `ptr` must stay valid device memory of `bytes` bytes for the life of the handle.
    pub unsafe fn set_workspace(&self, ptr: u64, bytes: usize) -> Result<bool, GpuError> {
        let Some(f) = self.lib.set_workspace else { return Ok(false) };
        check("cublasSetWorkspace", f(self.handle, ptr as *mut c_void, bytes))?;
        Ok(true)
    }

    /// `C = alpha · op(A) · op(B) + beta · C` in column-major terms (cuBLAS's), with f32 `alpha`
    /// and `beta` and compute type `CUBLAS_COMPUTE_32F`.
    ///
    /// # Safety
    /// The pointers must be device memory large enough for the given shapes and leading
    /// dimensions, on the handle's stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_ex_f32_compute(
        &self,
        (trans_a, trans_b): (c_int, c_int),
        (m, n, k): (c_int, c_int, c_int),
        alpha: f32,
        (a, a_type, lda): (u64, c_int, c_int),
        (b, b_type, ldb): (u64, c_int, c_int),
        beta: f32,
        (c, c_type, ldc): (u64, c_int, c_int),
    ) -> Result<(), GpuError> {
        let s = (self.lib.gemm_ex)(
            self.handle,
            trans_a,
            trans_b,
            m,
            n,
            k,
            &alpha as *const f32 as *const c_void,
            a as *const c_void,
            a_type,
            lda,
            b as *const c_void,
            b_type,
            ldb,
            &beta as *const f32 as *const c_void,
            c as *mut c_void,
            c_type,
            ldc,
            COMPUTE_32F,
            GEMM_DEFAULT,
        );
        check("cublasGemmEx", s)
    }
}

impl Drop for CublasHandle {
    fn drop(&mut self) {
        // SAFETY: the handle came from cublasCreate and is destroyed once; errors are ignored.
        unsafe { (self.lib.destroy)(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A path that does not exist is a clean one-line error naming it, never a panic. Uses
    /// `Cublas::load` directly (not the env var or the process-wide static), so it behaves the
    /// same on a GPU box that has cuBLAS.
    #[test]
    fn missing_library_is_a_clean_error() {
        let e = Cublas::load(&["/nonexistent/libcublas.so.13".to_string()]).err().expect("must fail");
        assert!(e.starts_with("cuBLAS not found: tried /nonexistent/libcublas.so.13"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        let many: Vec<String> = (0..3).map(|i| format!("/nonexistent/{i}/libcublas.so")).collect();
        let e = Cublas::load(&many).err().expect("must fail");
        assert!(e.starts_with("cuBLAS not found: tried 3 names and paths") && e.contains(CUBLAS_LIB_ENV), "{e}");
        let g = GpuError::NoCublas { detail: e };
        assert!(!g.to_string().contains('\n'), "{g}");
        // A library that loads but is not cuBLAS: a missing-symbol error, not a panic.
        if let Ok(lib) = unsafe { libloading::Library::new("libc.so.6") } {
            let e = Cublas::from_library(lib, "libc.so.6".into()).err().expect("libc is not cuBLAS");
            assert!(e.contains("missing cublasCreate_v2"), "{e}");
        }
    }

    #[test]
    fn candidates_order_and_status_names() {
        let c = candidates();
        if krasis_core::knobs::knobs().cublas_lib.is_none() {
            assert_eq!(&c[..3], ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]);
            assert!(c.iter().any(|p| p == "/usr/local/cuda/lib64/libcublas.so.13"), "{c:?}");
        } else {
            assert_eq!(c.len(), 1);
        }
        assert_eq!(status_name(7), "CUBLAS_STATUS_INVALID_VALUE");
        assert_eq!(check("x", 13).unwrap_err().to_string(), "cuBLAS error in x: CUBLAS_STATUS_EXECUTION_FAILED (13)");
    }
}
