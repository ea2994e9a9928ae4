//! The temp files of the cache builds in progress in this process, so that an interrupted process
//! (Ctrl-C, SIGTERM) can remove them before it exits instead of leaving files of gigabytes behind
//! until the next run's [`crate::clean_stale_tmp_files`].
//!
//! Every `<cache>.tmp.<pid>` is created through the registry and leaves it when renamed into
//! place or removed. [`remove_temp_files_and_stop`] removes those still there and refuses to
//! create or rename any more: whatever a build thread does after it, no partial file is left and
//! no half-finished one appears. Creation and rename happen under the registry's lock, so a
//! removal never races them.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// A set of temp files being written, and whether new ones may still be made.
pub(crate) struct TempRegistry {
    state: Mutex<State>,
}

struct State {
    paths: Vec<PathBuf>,
    stopped: bool,
}

fn stopped_error() -> io::Error {
    io::Error::new(io::ErrorKind::Interrupted, "the process is exiting (interrupted); no cache file is written")
}

impl TempRegistry {
    pub const fn new() -> TempRegistry {
        TempRegistry { state: Mutex::new(State { paths: Vec::new(), stopped: false }) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Creates (truncating) the temp file `tmp` for reading and writing and records it.
    pub fn create(&self, tmp: &Path) -> io::Result<File> {
        let mut st = self.lock();
        if st.stopped {
            return Err(stopped_error());
        }
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(tmp)?;
        st.paths.push(tmp.to_path_buf());
        Ok(file)
    }

    /// Renames `tmp` to `path` and forgets it.
    pub fn rename(&self, tmp: &Path, path: &Path) -> io::Result<()> {
        let mut st = self.lock();
        if st.stopped {
            return Err(stopped_error());
        }
        std::fs::rename(tmp, path)?;
        st.paths.retain(|p| p != tmp);
        Ok(())
    }

    /// Removes `tmp` (if it is still there) and forgets it.
    pub fn remove(&self, tmp: &Path) {
        let mut st = self.lock();
        let _ = std::fs::remove_file(tmp);
        st.paths.retain(|p| p != tmp);
    }

    /// The temp files recorded now.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.lock().paths.clone()
    }

    /// Removes every recorded temp file, refuses further creates and renames, and returns the
    /// files it removed (those already gone are not listed).
    pub fn remove_all_and_stop(&self) -> Vec<PathBuf> {
        let mut st = self.lock();
        st.stopped = true;
        std::mem::take(&mut st.paths).into_iter().filter(|p| std::fs::remove_file(p).is_ok()).collect()
    }
}

/// The registry of this process's cache builds.
pub(crate) static TEMP_FILES: TempRegistry = TempRegistry::new();

/// The temp files of the cache builds in progress in this process.
pub fn temp_files_in_progress() -> Vec<PathBuf> {
    TEMP_FILES.paths()
}

/// For a process about to exit on a signal: removes the temp file of every cache build in
/// progress and makes every later attempt to create or rename one fail, so nothing partial stays
/// on disk. Returns the files removed. Safe to call from any thread (not from a signal handler:
/// it takes a lock and allocates).
pub fn remove_temp_files_and_stop() -> Vec<PathBuf> {
    TEMP_FILES.remove_all_and_stop()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_files_until_renamed_or_removed_and_removes_the_rest_on_stop() {
        let d = tempfile::tempdir().unwrap();
        let r = TempRegistry::new();
        let (a, b, c) = (d.path().join("a.tmp.1"), d.path().join("b.tmp.1"), d.path().join("c.tmp.1"));
        for p in [&a, &b, &c] {
            r.create(p).unwrap();
        }
        assert_eq!(r.paths(), vec![a.clone(), b.clone(), c.clone()]);
        r.rename(&a, &d.path().join("a")).unwrap();
        r.remove(&b);
        assert_eq!(r.paths(), vec![c.clone()]);
        assert!(d.path().join("a").is_file() && !b.exists());

        // A file someone else removed already is not reported.
        let e = d.path().join("e.tmp.1");
        r.create(&e).unwrap();
        std::fs::remove_file(&e).unwrap();
        assert_eq!(r.remove_all_and_stop(), vec![c.clone()]);
        assert!(!c.exists() && r.paths().is_empty());

        // Stopped: nothing more is created or renamed into place.
        let late = d.path().join("late.tmp.1");
        assert_eq!(r.create(&late).unwrap_err().kind(), io::ErrorKind::Interrupted);
        assert!(!late.exists());
        std::fs::write(&late, b"x").unwrap();
        assert_eq!(r.rename(&late, &d.path().join("late")).unwrap_err().kind(), io::ErrorKind::Interrupted);
        assert!(!d.path().join("late").exists());
    }
}
