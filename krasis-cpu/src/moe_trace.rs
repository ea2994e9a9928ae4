//! Bench-only timeline of [`PoolExperts::run`](crate::moe::PoolExperts::run) dispatches: per
//! task its worker, kind, start, the moment its inputs were ready (after any wait) and its end;
//! per dispatch the caller's entry, the pool dispatch, the caller's return from the pool and the
//! end of `run`. Off unless a runner is built with
//! [`with_trace`](crate::moe::PoolExperts::with_trace); the buffers are preallocated and each
//! worker writes only its own, so tracing costs two clock reads and an uncontended lock per task.

use std::fmt;
use std::sync::Mutex;
use std::time::Instant;

/// What a traced task did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskKind {
    /// Quantise groups of the token activations.
    X,
    /// w13 block pairs (and quantisation of intermediate groups it completes).
    W13,
    /// w2 row blocks (and, fused, the weighted add into the output).
    W2,
}

/// One task; times in ns since the trace was created.
#[derive(Clone, Copy, Debug)]
pub struct TaskSpan {
    pub dispatch: u32,
    pub worker: u16,
    pub kind: TaskKind,
    pub job: u16,
    pub start: u64,
    /// After waiting for its inputs (equal to `start` when nothing had to wait).
    pub ready: u64,
    /// End of the kernel work (before a fused weighted add waits for its turn).
    pub computed: u64,
    pub end: u64,
}

/// One call of `run`; times in ns since the trace was created.
#[derive(Clone, Copy, Debug)]
pub struct DispatchSpan {
    pub jobs: u16,
    /// `run` entered.
    pub call: u64,
    /// Just before the pool dispatch.
    pub dispatch: u64,
    /// The pool dispatch returned to the caller.
    pub back: u64,
    /// `run` returns (after any serial weighted sum).
    pub done: u64,
}

/// Preallocated per-worker span buffers.
pub struct Trace {
    base: Instant,
    cap: usize,
    workers: Vec<Mutex<Vec<TaskSpan>>>,
    dispatches: Mutex<Vec<DispatchSpan>>,
}

impl Trace {
    /// Room for `cap` task spans per worker and `cap` dispatches (later ones are dropped).
    pub fn new(workers: usize, cap: usize) -> Trace {
        Trace {
            base: Instant::now(),
            cap,
            workers: (0..workers).map(|_| Mutex::new(Vec::with_capacity(cap))).collect(),
            dispatches: Mutex::new(Vec::with_capacity(cap)),
        }
    }

    /// ns since the trace was created.
    pub fn now(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }

    /// Index the next dispatch will get.
    pub fn next_dispatch(&self) -> u32 {
        self.dispatches.lock().unwrap_or_else(|e| e.into_inner()).len() as u32
    }

    pub fn task(&self, s: TaskSpan) {
        if let Some(w) = self.workers.get(s.worker as usize) {
            let mut v = w.lock().unwrap_or_else(|e| e.into_inner());
            if v.len() < self.cap {
                v.push(s);
            }
        }
    }

    pub fn dispatch(&self, d: DispatchSpan) {
        let mut v = self.dispatches.lock().unwrap_or_else(|e| e.into_inner());
        if v.len() < self.cap {
            v.push(d);
        }
    }

    /// Drain everything recorded so far into a summary (the buffers keep their capacity).
    pub fn take_summary(&self) -> TraceSummary {
        let ds = std::mem::take(&mut *self.dispatches.lock().unwrap_or_else(|e| e.into_inner()));
        let mut per: Vec<Vec<TaskSpan>> = vec![Vec::new(); ds.len()];
        for w in &self.workers {
            let mut v = w.lock().unwrap_or_else(|e| e.into_inner());
            for s in v.drain(..) {
                if let Some(p) = per.get_mut(s.dispatch as usize) {
                    p.push(s);
                }
            }
        }
        *self.dispatches.lock().unwrap_or_else(|e| e.into_inner()) = Vec::with_capacity(self.cap);
        let rows: Vec<[f64; METRICS]> = ds.iter().zip(&per).filter_map(|(d, t)| metrics(d, t)).collect();
        TraceSummary { dispatches: rows.len(), jobs: ds.first().map_or(0, |d| d.jobs as usize), rows }
    }
}

const METRICS: usize = 17;
const NAMES: [&str; METRICS] = [
    "prep: run entered → pool dispatch",
    "wake: dispatch → first task start, fastest worker",
    "wake: dispatch → first task start, median worker",
    "wake: dispatch → first task start, slowest worker",
    "x quantised (last X task end)",
    "w13 wait for x, mean per w13 task",
    "w13 end of the first job (last w13 task end)",
    "w13 end of the last job",
    "w2 first start",
    "w2 wait for its intermediate, mean per w2 task",
    "w2 wait, longest",
    "w2 wait for its turn to add (fused sum), mean",
    "last task end",
    "worker idle after its last task, mean",
    "tail: last task end → caller back from the pool",
    "serial weighted sum (back → run returns)",
    "total: run entered → returns",
];

fn us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// The [`NAMES`] metrics of one dispatch, in µs relative to the pool dispatch (durations as
/// such); `None` when it has no tasks recorded.
fn metrics(d: &DispatchSpan, t: &[TaskSpan]) -> Option<[f64; METRICS]> {
    if t.is_empty() {
        return None;
    }
    let rel = |x: u64| us(x.saturating_sub(d.dispatch));
    let mut first: Vec<(u16, u64)> = Vec::new();
    let mut last: Vec<(u16, u64)> = Vec::new();
    for s in t {
        match first.iter_mut().find(|(w, _)| *w == s.worker) {
            Some(f) => f.1 = f.1.min(s.start),
            None => first.push((s.worker, s.start)),
        }
        match last.iter_mut().find(|(w, _)| *w == s.worker) {
            Some(f) => f.1 = f.1.max(s.end),
            None => last.push((s.worker, s.end)),
        }
    }
    let mut starts: Vec<u64> = first.iter().map(|f| f.1).collect();
    starts.sort_unstable();
    let of = |k: TaskKind| t.iter().filter(move |s| s.kind == k);
    let last_job = t.iter().map(|s| s.job).max().unwrap_or(0);
    let job_end = |j: u16| of(TaskKind::W13).filter(|s| s.job == j).map(|s| s.end).max().unwrap_or(d.dispatch);
    let last_end = t.iter().map(|s| s.end).max().unwrap_or(d.dispatch);
    Some([
        us(d.dispatch - d.call),
        rel(starts[0]),
        rel(starts[starts.len() / 2]),
        rel(starts[starts.len() - 1]),
        rel(of(TaskKind::X).map(|s| s.end).max().unwrap_or(d.dispatch)),
        mean(of(TaskKind::W13).map(|s| us(s.ready - s.start))),
        rel(job_end(0)),
        rel(job_end(last_job)),
        rel(of(TaskKind::W2).map(|s| s.start).min().unwrap_or(d.dispatch)),
        mean(of(TaskKind::W2).map(|s| us(s.ready - s.start))),
        of(TaskKind::W2).map(|s| us(s.ready - s.start)).fold(0.0, f64::max),
        mean(of(TaskKind::W2).map(|s| us(s.end - s.computed))),
        rel(last_end),
        mean(last.iter().map(|l| us(last_end - l.1))),
        us(d.back.saturating_sub(last_end)),
        us(d.done - d.back),
        us(d.done - d.call),
    ])
}

/// Medians (and means) over dispatches of where the time of a dispatch goes.
pub struct TraceSummary {
    pub dispatches: usize,
    pub jobs: usize,
    rows: Vec<[f64; METRICS]>,
}

impl TraceSummary {
    /// (name, median µs, mean µs) per metric.
    pub fn metrics(&self) -> Vec<(&'static str, f64, f64)> {
        (0..METRICS)
            .map(|i| {
                let mut v: Vec<f64> = self.rows.iter().map(|r| r[i]).collect();
                v.sort_by(f64::total_cmp);
                let med = v.get(v.len() / 2).copied().unwrap_or(0.0);
                (NAMES[i], med, mean(v.iter().copied()))
            })
            .collect()
    }
}

impl fmt::Display for TraceSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "  timeline of {} dispatches of {} job(s), µs from the pool dispatch (median / mean):",
            self.dispatches, self.jobs
        )?;
        for (name, med, mn) in self.metrics() {
            writeln!(f, "    {name:<52} {med:8.2} / {mn:8.2}")?;
        }
        Ok(())
    }
}
