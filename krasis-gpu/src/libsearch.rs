//! Finding a CUDA library we `dlopen` ourselves (NVRTC, cuBLAS): the candidate list and the
//! first one that loads.

use std::path::{Path, PathBuf};

/// `explicit` alone when given (a path from the environment); otherwise `names` through the
/// dynamic loader's search path, then the same names under `$CUDA_HOME`, `$CUDA_PATH` and
/// `/usr/local/cuda`.
pub(crate) fn candidates(explicit: Option<&Path>, names: &[&str]) -> Vec<String> {
    if let Some(p) = explicit {
        return vec![p.to_string_lossy().into_owned()];
    }
    let mut out: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let k = krasis_core::knobs::knobs();
    let mut roots: Vec<PathBuf> = [&k.cuda_home, &k.cuda_path].into_iter().flatten().map(PathBuf::from).collect();
    roots.push(PathBuf::from("/usr/local/cuda"));
    for root in roots {
        for sub in ["lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"] {
            for n in names {
                out.push(root.join(sub).join(n).to_string_lossy().into_owned());
            }
        }
    }
    out
}

/// The first candidate that loads, with its path; else every loader error, in order.
///
/// # Safety
/// Loading runs the library's initialisers: only pass libraries whose initialisers have no
/// side effects beyond their own state (NVRTC, cuBLAS).
pub(crate) unsafe fn open_first(cands: &[String]) -> Result<(libloading::Library, String), Vec<String>> {
    let mut errors = Vec::new();
    for c in cands {
        // SAFETY: the caller vouches for the library's initialisers.
        match unsafe { libloading::Library::new(c) } {
            Ok(lib) => return Ok((lib, c.clone())),
            Err(e) => errors.push(e.to_string()),
        }
    }
    Err(errors)
}
