//! Data-parallel loops of the dense ops: on the [`WorkerPool`] the calling thread runs under
//! ([`with_pool`]; an engine wraps its forward calls in its own pool), else on rayon. One pool
//! for everything in a decode step: rayon's threads waking beside the pool's spinning workers cost
//! tens of microseconds per op (measured: rayon 11–57 µs per dispatch against the pool's 2.5 µs
//! on 16 cores). The pool is per call, not per process, so two engines in one process each run
//! their ops on their own pool.

use std::cell::Cell;
use std::ptr::NonNull;

use rayon::prelude::*;

use crate::pool::{running_task_threads, WorkerPool};

thread_local! {
    /// The pool of the innermost [`with_pool`] on this thread; it borrows that call's argument,
    /// so it is only set while the call runs.
    static CURRENT: Cell<Option<NonNull<WorkerPool>>> = const { Cell::new(None) };
}

/// Puts the previous pool back when dropped, also when `f` unwinds.
struct Restore(Option<NonNull<WorkerPool>>);

impl Drop for Restore {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.0));
    }
}

/// Runs `f` with the dense ops of this thread ([`for_each`] and the loops over it) on `pool`,
/// then puts back the pool that was current before (also when `f` panics). Calls nest: the
/// innermost pool is the one used. Other threads are not affected.
pub fn with_pool<R>(pool: &WorkerPool, f: impl FnOnce() -> R) -> R {
    let prev = CURRENT.with(|c| c.replace(Some(NonNull::from(pool))));
    let _restore = Restore(prev);
    f()
}

/// Calls `f` with the pool of the innermost [`with_pool`] running on this thread.
fn on_current<R>(f: impl FnOnce(Option<&WorkerPool>) -> R) -> R {
    let p = CURRENT.with(Cell::get);
    // SAFETY: `CURRENT` holds a pointer only while the `with_pool` call that borrowed it runs on
    // this thread; that call outlives this one, and `f` cannot keep the reference.
    f(p.map(|p| unsafe { p.as_ref() }))
}

/// Run `f(i)` for every `i` in `0..n`, in parallel; returns when all are done. On this thread's
/// pool ([`with_pool`]); inside a pool's task without one (a worker thread), inline, as the pool
/// runs nested calls; else on rayon.
pub fn for_each(n: usize, f: &(dyn Fn(usize) + Sync)) {
    on_current(|pool| match pool {
        Some(pool) => pool.run(n, &|i, _| f(i)),
        None if running_task_threads().is_some() => (0..n).for_each(f),
        None => (0..n).into_par_iter().for_each(f),
    })
}

/// Threads a [`for_each`] runs on: this thread's pool's (or, inside a pool's task, that pool's),
/// else rayon's.
pub fn threads() -> usize {
    on_current(|pool| match pool {
        Some(pool) => pool.threads(),
        None => running_task_threads().unwrap_or_else(rayon::current_num_threads),
    })
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
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Barrier;

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
        with_pool(&WorkerPool::new(PoolPlan::simulated(1, 2)).unwrap(), check);
    }

    /// Runs `n` tasks through [`for_each`] and counts, per pool of `pools`, the tasks that ran as
    /// one of its tasks; the last entry counts the tasks that ran on none of them.
    fn run_counted(n: usize, pools: &[&WorkerPool]) -> Vec<usize> {
        let counts: Vec<AtomicUsize> = (0..=pools.len()).map(|_| AtomicUsize::new(0)).collect();
        for_each(n, &|_| {
            let at = pools.iter().position(|p| p.current_task().is_some()).unwrap_or(pools.len());
            counts[at].fetch_add(1, Ordering::Relaxed);
        });
        counts.into_iter().map(AtomicUsize::into_inner).collect()
    }

    #[test]
    fn two_threads_each_run_their_work_on_their_own_pool() {
        let a = WorkerPool::new(PoolPlan::simulated(1, 2)).unwrap();
        let b = WorkerPool::new(PoolPlan::simulated(1, 3)).unwrap();
        let start = Barrier::new(2);
        const ROUNDS: usize = 200;
        const TASKS: usize = 17;
        std::thread::scope(|s| {
            for (mine, other) in [(&a, &b), (&b, &a)] {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    with_pool(mine, || {
                        assert_eq!(threads(), mine.threads());
                        for _ in 0..ROUNDS {
                            assert_eq!(
                                run_counted(TASKS, &[mine, other]),
                                [TASKS, 0, 0],
                                "every task on this thread's pool, none on the other's or elsewhere"
                            );
                        }
                    });
                });
            }
        });
        // Outside `with_pool` the ops run on rayon, on neither pool.
        assert_eq!(run_counted(TASKS, &[&a, &b]), [0, 0, TASKS]);
    }

    #[test]
    fn nested_with_pool_restores_the_outer_pool() {
        let outer = WorkerPool::new(PoolPlan::simulated(1, 2)).unwrap();
        let inner = WorkerPool::new(PoolPlan::simulated(1, 2)).unwrap();
        let pools = [&outer, &inner];
        with_pool(&outer, || {
            assert_eq!(run_counted(9, &pools), [9, 0, 0]);
            with_pool(&inner, || assert_eq!(run_counted(9, &pools), [0, 9, 0]));
            assert_eq!(run_counted(9, &pools), [9, 0, 0], "back on the outer pool after the inner call");
            // A panic inside the inner call restores the outer pool too.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                with_pool(&inner, || panic!("inside the inner pool"));
            }));
            assert!(r.is_err());
            assert_eq!(run_counted(9, &pools), [9, 0, 0], "back on the outer pool after a panic");
        });
        assert_eq!(run_counted(9, &pools), [0, 0, 9], "no pool after the outer call");
    }

    #[test]
    fn loops_inside_a_pool_task_stay_on_that_task() {
        let pool = WorkerPool::new(PoolPlan::simulated(1, 3)).unwrap();
        let inner = AtomicUsize::new(0);
        with_pool(&pool, || {
            for_each(12, &|_| {
                // On a worker thread no pool is current: the nested loop runs inline in the task,
                // as the pool runs nested calls, not on rayon.
                let here = pool.current_task().expect("a task of the pool");
                assert_eq!(threads(), pool.threads());
                for_each(5, &|_| {
                    assert_eq!(pool.current_task(), Some(here));
                    inner.fetch_add(1, Ordering::Relaxed);
                });
            });
        });
        assert_eq!(inner.into_inner(), 60);
    }
}
