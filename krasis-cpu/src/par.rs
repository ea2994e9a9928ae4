//! Data-parallel loops of the dense ops: on the pinned [`WorkerPool`] once one is installed
//! (the quantised engine installs its pool), else on rayon. One pool for everything in a decode
//! step: rayon's threads waking beside the pool's spinning workers cost tens of microseconds per
//! op (measured: rayon 11–57 µs per dispatch against the pool's 2.5 µs on 16 cores).

use std::sync::{Arc, OnceLock};

use rayon::prelude::*;

use crate::pool::WorkerPool;

static POOL: OnceLock<Arc<WorkerPool>> = OnceLock::new();

/// Route the dense ops through `pool` from now on (first call wins; later calls are ignored and
/// return false).
pub fn install(pool: Arc<WorkerPool>) -> bool {
    POOL.set(pool).is_ok()
}

/// Run `f(i)` for every `i` in `0..n`, in parallel; returns when all are done.
pub fn for_each(n: usize, f: &(dyn Fn(usize) + Sync)) {
    match POOL.get() {
        Some(pool) => pool.run(n, &|i, _| f(i)),
        None => (0..n).into_par_iter().for_each(f),
    }
}

/// Threads a [`for_each`] runs on (the pool's, else rayon's).
pub fn threads() -> usize {
    POOL.get().map_or_else(rayon::current_num_threads, |p| p.threads())
}

struct ChunkPtr<T>(*mut T);
// SAFETY: each task touches its own chunk only (see `for_each_chunk_mut`).
unsafe impl<T: Send> Send for ChunkPtr<T> {}
unsafe impl<T: Send> Sync for ChunkPtr<T> {}

impl<T> ChunkPtr<T> {
    fn get(&self) -> *mut T {
        self.0
    }
}

/// `f(i, chunk_i)` for the `chunk`-sized pieces of `data` (the last may be shorter), in parallel.
pub fn for_each_chunk_mut<T: Send>(data: &mut [T], chunk: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    assert!(chunk > 0, "for_each_chunk_mut: chunk size 0");
    let len = data.len();
    let n = len.div_ceil(chunk);
    let base = ChunkPtr(data.as_mut_ptr());
    for_each(n, &|i| {
        let start = i * chunk;
        let end = (start + chunk).min(len);
        // SAFETY: chunks [start, end) are disjoint for distinct i and inside `data`, which is
        // borrowed mutably for the whole call; `for_each` returns only when every task is done.
        let piece = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
        f(i, piece);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolPlan;

    #[test]
    fn chunks_cover_everything_once_with_and_without_a_pool() {
        let check = || {
            let mut v = vec![0u32; 1003];
            for_each_chunk_mut(&mut v, 10, &|i, c| {
                for x in c.iter_mut() {
                    *x += 1 + i as u32;
                }
            });
            for (j, &x) in v.iter().enumerate() {
                assert_eq!(x, 1 + (j / 10) as u32);
            }
        };
        check();
        install(Arc::new(WorkerPool::new(PoolPlan::simulated(1, 2)).unwrap()));
        check();
    }
}
