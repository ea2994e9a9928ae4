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

/// A raw pointer shared by tasks that each write their own, disjoint part of the buffer (every
/// use argues it); `get` is a method so closures capture the whole `Sync` wrapper.
pub(crate) struct DisjointPtr<T>(pub(crate) *mut T);
// SAFETY: each task touches its own part only (argued at each use).
unsafe impl<T: Send> Send for DisjointPtr<T> {}
unsafe impl<T: Send> Sync for DisjointPtr<T> {}

impl<T> Clone for DisjointPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DisjointPtr<T> {}

impl<T> DisjointPtr<T> {
    pub(crate) fn get(&self) -> *mut T {
        self.0
    }

    /// Element `i` onwards (a method, so closures capture the `Sync` wrapper rather than its raw
    /// field).
    pub(crate) fn at(self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}

/// `f(i, chunk_i)` for the `chunk`-sized pieces of `data` (the last may be shorter), in parallel.
pub fn for_each_chunk_mut<T: Send>(data: &mut [T], chunk: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    assert!(chunk > 0, "for_each_chunk_mut: chunk size 0");
    let len = data.len();
    let n = len.div_ceil(chunk);
    let base = DisjointPtr(data.as_mut_ptr());
    for_each(n, &|i| {
        let start = i * chunk;
        let end = (start + chunk).min(len);
        // SAFETY: chunks [start, end) are disjoint for distinct i and inside `data`, which is
        // borrowed mutably for the whole call; `for_each` returns only when every task is done.
        let piece = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
        f(i, piece);
    });
}

/// A task over one piece of each of two slices (see [`for_each_chunk_pair_mut`]).
pub type PairTask<'a, A, B> = dyn Fn(usize, &mut [A], &mut [B]) + Sync + 'a;

/// `f(i, a_i, b_i)` for the `ca`-sized pieces of `a` and the `cb`-sized pieces of `b` (the same
/// number of pieces; the last of each may be shorter), in parallel.
pub fn for_each_chunk_pair_mut<A: Send, B: Send>(
    a: &mut [A],
    ca: usize,
    b: &mut [B],
    cb: usize,
    f: &PairTask<'_, A, B>,
) {
    assert!(ca > 0 && cb > 0, "for_each_chunk_pair_mut: chunk size 0");
    let n = a.len().div_ceil(ca);
    assert_eq!(n, b.len().div_ceil(cb), "for_each_chunk_pair_mut: the slices split into different piece counts");
    let (la, lb) = (a.len(), b.len());
    let (pa, pb) = (DisjointPtr(a.as_mut_ptr()), DisjointPtr(b.as_mut_ptr()));
    for_each(n, &|i| {
        let (a0, b0) = (i * ca, i * cb);
        // SAFETY: pieces are disjoint for distinct i and inside the slices, borrowed mutably for
        // the whole call; `for_each` returns only when every task is done.
        let (x, y) = unsafe {
            (
                std::slice::from_raw_parts_mut(pa.get().add(a0), (a0 + ca).min(la) - a0),
                std::slice::from_raw_parts_mut(pb.get().add(b0), (b0 + cb).min(lb) - b0),
            )
        };
        f(i, x, y);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolPlan;

    #[test]
    fn pair_chunks_line_up() {
        let (mut a, mut b) = (vec![0usize; 37], vec![0usize; 74]);
        for_each_chunk_pair_mut(&mut a, 4, &mut b, 8, &|i, x, y| {
            assert_eq!(y.len(), 2 * x.len());
            x.iter_mut().for_each(|v| *v = i);
            y.iter_mut().for_each(|v| *v = i);
        });
        assert!(a.iter().enumerate().all(|(j, &v)| v == j / 4));
        assert!(b.iter().enumerate().all(|(j, &v)| v == j / 8));
    }

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
