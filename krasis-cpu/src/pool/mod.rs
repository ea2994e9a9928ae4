//! The decode worker pool: persistent threads, one per physical core (never two SMT siblings),
//! each pinned to its CPU, grouped by NUMA node, with microsecond dispatch.
//!
//! # Model
//! A pool of `threads()` workers. Workers `1..threads()` are threads the pool spawns and pins;
//! **worker 0 is the thread that calls [`WorkerPool::run`]** (it executes tasks too instead of
//! waiting idle, so N workers occupy exactly N cores and no dispatching thread competes with a
//! pinned worker for a core). The pool never changes the caller's affinity behind its back
//! (threads spawned later would inherit it); a decode loop that wants worker 0 pinned as well
//! holds the guard from [`WorkerPool::pin_caller`], which restores the old mask when dropped.
//!
//! # Dispatch protocol
//! The caller writes the job (a type-erased pointer to the caller's closure), resets the task
//! counters, marks the job open (`open = epoch`) and bumps `epoch`. Workers spin on `epoch` for a
//! bounded time ([`SPIN_BEFORE_PARK`]) and then sleep on it with a futex; the caller issues the
//! wake-up syscall only if someone sleeps, so back-to-back jobs cost a few cache-line transfers
//! and no syscalls. A worker that sees the new epoch *enters* (increments the active count in
//! `state`), checks that the job is still open, claims tasks from an atomic counter (one per NUMA
//! node for node-restricted jobs) and *leaves* (decrements the count). The caller runs tasks too;
//! once every task has been claimed (for `broadcast`: every worker has run it) it *closes* the
//! job and waits until no worker is inside. Workers that have not entered by then (parked, or
//! preempted by the OS) skip the job, so a job never waits for a worker that holds no task of it.
//! Nothing is allocated per job.
//!
//! # Soundness of the borrowed closures
//! `run` takes `&(dyn Fn + Sync)` borrowed from the caller's stack and hands the workers a raw
//! pointer with the lifetime erased. That is sound because (1) a worker reads and dereferences
//! the pointer only between entering and leaving, and only after seeing `open` equal to the
//! epoch it woke for; (2) the caller closes the job and then waits for the active count to reach
//! zero; entering and the open check (worker) and closing and the count check (caller) are
//! sequentially consistent, so either the worker sees the job closed and never touches it, or
//! the caller sees it inside and waits; (3) `run` does not return, normally or by unwinding,
//! before that wait is over: the caller's own share of tasks runs under `catch_unwind`, and the
//! wait cannot panic; (4) panics in workers are caught too, so each worker always leaves. The
//! first panic payload is kept, no further tasks are claimed, and once every worker inside has
//! left the payload is re-raised in the caller with `resume_unwind`. The pool stays usable.
//!
//! # Nesting
//! `run` called from inside a task of the same pool executes the inner tasks inline on the
//! current worker (serially; the other workers are busy with the outer job anyway). Nested
//! `run_on_nodes` may only hold tasks for the current worker's node, and nested `broadcast`
//! is refused (both panic, which the outer `run` re-raises). Calls from several threads at once
//! are serialised. Do not cross-nest two pools (A's task waiting on B whose task waits on A).

mod placement;
mod sys;

pub(crate) use placement::SyncPtr;
pub use placement::{place_on_node, Binding, PerNode, PlacementReport};
pub use sys::current_affinity;

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::io;
use std::marker::PhantomData;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use krasis_core::hw::{format_cpulist, SystemReport};

/// How long an idle worker (and a caller waiting for workers) spins before sleeping on a futex.
///
/// Waking a parked worker costs a syscall plus a scheduler wake-up, several microseconds per
/// worker and tens of microseconds for the last of 16; a spinning worker picks a job up in about
/// 0.1 µs. Decode issues jobs in bursts: one or more per layer, separated by the dense part of the
/// layer (tens to a few hundred µs on the GPU or in the CPU path). 1 ms keeps every gap inside a
/// decode step on the spinning path, while a pool that has really gone idle (between requests,
/// or while the GPU runs a long prefill) stops burning its cores after one millisecond.
/// Overridable per pool through [`PoolPlan::spin`].
pub const SPIN_BEFORE_PARK: Duration = Duration::from_micros(1000);

/// How often (in spin iterations) a spinning thread looks at the clock.
const SPINS_PER_CLOCK_CHECK: u32 = 64;

/// Which CPUs the workers run on, grouped by NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolPlan {
    /// CPUs per pool node (each non-empty); worker 0 is `nodes[0][0]`, then the rest in order.
    pub nodes: Vec<Vec<usize>>,
    /// The OS NUMA node id of each pool node (what `mbind` needs). Pool node `j` is the `j`-th
    /// node that got workers, so ids can differ from indices (memory-only nodes are skipped).
    pub node_ids: Vec<usize>,
    /// Pin each worker to its CPU (false for simulated topologies: the ids are fake).
    pub pin: bool,
    /// Spin budget before parking; [`SPIN_BEFORE_PARK`] unless tuned.
    pub spin: Duration,
    /// Spinners call `sched_yield` every few µs (default true). It costs a cheap syscall on a
    /// dedicated core, and when another thread wants the core (an unpinned caller doing serial
    /// work between jobs, a driver or server thread, more threads than cores in tests) that
    /// thread runs now instead of queueing behind a spinner for a whole time slice. The price:
    /// on a box loaded with CPU-bound processes a yielding worker may lose its core for a slice.
    /// [`PoolPlan::from_system`] turns it off with `KRASIS_POOL_YIELD=0` (for measuring).
    pub yield_spin: bool,
}

impl PoolPlan {
    /// One worker per physical core (the lowest logical CPU of each core), grouped by NUMA node,
    /// pinned. With `max_threads`, that many workers spread evenly over the nodes.
    pub fn from_system(r: &SystemReport, max_threads: Option<usize>) -> PoolPlan {
        let cpus = r.one_cpu_per_core();
        let mut groups: Vec<(usize, Vec<usize>)> = r.numa_nodes.iter().map(|n| (n.id, Vec::new())).collect();
        if groups.is_empty() {
            groups.push((0, Vec::new()));
        }
        for cpu in cpus {
            // A CPU that no node lists (odd sysfs) joins the first node.
            let g = r.numa_nodes.iter().position(|n| n.cpus.binary_search(&cpu).is_ok()).unwrap_or(0);
            groups[g].1.push(cpu);
        }
        let mut groups: Vec<(usize, Vec<usize>)> = groups.into_iter().filter(|(_, c)| !c.is_empty()).collect();
        let total: usize = groups.iter().map(|(_, c)| c.len()).sum();
        if let Some(max) = max_threads {
            let max = max.max(1);
            if max < total {
                // Round-robin over nodes so a limited pool still has workers on every node it can.
                let mut keep = vec![0usize; groups.len()];
                let mut taken = 0;
                'fill: for rank in 0.. {
                    for (g, (_, c)) in groups.iter().enumerate() {
                        if taken == max {
                            break 'fill;
                        }
                        if rank < c.len() {
                            keep[g] += 1;
                            taken += 1;
                        }
                    }
                }
                for (g, k) in keep.into_iter().enumerate() {
                    groups[g].1.truncate(k);
                }
                groups.retain(|(_, c)| !c.is_empty());
            }
        }
        if groups.is_empty() {
            groups.push((0, vec![0]));
        }
        PoolPlan {
            node_ids: groups.iter().map(|(id, _)| *id).collect(),
            nodes: groups.into_iter().map(|(_, c)| c).collect(),
            pin: cfg!(target_os = "linux"),
            spin: SPIN_BEFORE_PARK,
            yield_spin: krasis_core::knobs::knobs().pool_yield,
        }
    }

    /// A fake topology of `nodes` × `per_node` workers, not pinned: for tests of the NUMA-aware
    /// paths on any machine. CPU ids are placeholders, node ids are `0..nodes`.
    pub fn simulated(nodes: usize, per_node: usize) -> PoolPlan {
        let (nodes, per_node) = (nodes.max(1), per_node.max(1));
        PoolPlan {
            nodes: (0..nodes).map(|j| (j * per_node..(j + 1) * per_node).collect()).collect(),
            node_ids: (0..nodes).collect(),
            pin: false,
            spin: SPIN_BEFORE_PARK,
            yield_spin: true,
        }
    }

    /// Total workers.
    pub fn threads(&self) -> usize {
        self.nodes.iter().map(Vec::len).sum()
    }
}

/// Who is running a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerCtx {
    /// `0..threads()`; 0 is the calling thread.
    pub worker: usize,
    /// Pool node index (`0..nodes()`).
    pub node: usize,
    /// Index of this worker within its node (`0..node_threads(node)`).
    pub node_rank: usize,
    /// The CPU this thread is pinned to; `None` in simulated pools, and for worker 0 unless the
    /// calling thread holds a [`CallerPin`] of this pool.
    pub cpu: Option<usize>,
}

type FlatFn = dyn Fn(usize, &WorkerCtx) + Sync;
type NodeFn = dyn Fn(usize, usize, &WorkerCtx) + Sync;
type EachFn = dyn Fn(&WorkerCtx) + Sync;

/// The current job. The pointers borrow the dispatching caller's stack; see the module docs for
/// why they are only dereferenced while that borrow is alive.
#[derive(Clone, Copy)]
enum Job {
    Idle,
    Flat {
        n: usize,
        f: *const FlatFn,
    },
    /// `owned`: per node, the first task of its owned run (see [`WorkerPool::run_on_nodes_affine`]).
    Nodes {
        tasks: *const [usize],
        f: *const NodeFn,
        owned: Option<*const [usize]>,
    },
    Each {
        f: *const EachFn,
    },
}

// Lifetime erasure (transmute between reference types that differ only in lifetimes). Callers
// uphold the protocol in the module docs.
fn erase_flat<'a>(f: &'a (dyn Fn(usize, &WorkerCtx) + Sync + 'a)) -> *const FlatFn {
    // SAFETY: same layout; the result is only dereferenced while `'a` lasts (module docs).
    unsafe { std::mem::transmute::<&'a (dyn Fn(usize, &WorkerCtx) + Sync + 'a), &'static FlatFn>(f) }
}
fn erase_nodes<'a>(f: &'a (dyn Fn(usize, usize, &WorkerCtx) + Sync + 'a)) -> *const NodeFn {
    // SAFETY: as in `erase_flat`.
    unsafe { std::mem::transmute::<&'a (dyn Fn(usize, usize, &WorkerCtx) + Sync + 'a), &'static NodeFn>(f) }
}
fn erase_each<'a>(f: &'a (dyn Fn(&WorkerCtx) + Sync + 'a)) -> *const EachFn {
    // SAFETY: as in `erase_flat`.
    unsafe { std::mem::transmute::<&'a (dyn Fn(&WorkerCtx) + Sync + 'a), &'static EachFn>(f) }
}

/// Keeps hot atomics on their own cache lines (128 B: adjacent-line prefetch pairs lines).
#[repr(align(128))]
struct Padded<T>(T);

/// Value stored into task counters to stop further claims after a panic.
const CLAIMS_CLOSED: usize = usize::MAX / 2;

/// `state` increments: entering adds 1 to the active count (low 16 bits); leaving subtracts 1
/// from it and adds 1 to the exit counter (high 16 bits) in one atomic add.
const ENTER: u32 = 1;
const LEAVE: u32 = (1 << 16) - 1;
const ACTIVE_MASK: u32 = 0xFFFF;
/// Workers the 16-bit active count can hold.
const MAX_THREADS: usize = ACTIVE_MASK as usize;

/// The cache line every spinning worker reads.
struct Gate {
    /// Advanced by 2 per job (so it stays even) and by 2 at shutdown; workers sleep on it.
    epoch: AtomicU32,
    /// The epoch of the job open for joining; `epoch | 1` once the caller has closed it.
    open: AtomicU32,
}

struct Shared {
    gate: Padded<Gate>,
    /// Workers that are (about to be) asleep on `gate.epoch`.
    sleepers: Padded<AtomicU32>,
    /// Active count and exit counter (see [`ENTER`]); the caller may sleep on it.
    state: Padded<AtomicU32>,
    caller_waiting: Padded<AtomicBool>,
    /// Spawned workers that have run the current `broadcast` job.
    each_done: Padded<AtomicU32>,
    /// Next task of a flat job.
    counter: Padded<AtomicUsize>,
    /// Next task of each node for a node job (for an affine job: the next claim, which skips
    /// the node's owned run).
    node_counters: Box<[Padded<AtomicUsize>]>,
    /// Per worker: its owned task of the current affine job has been claimed (by it or, if it
    /// came late, by another worker); set for workers that own none.
    owned_claimed: Box<[Padded<AtomicBool>]>,
    /// Per node: its first worker's index (workers are numbered node by node).
    node_base: Box<[usize]>,
    /// Written only by the dispatching caller while no worker can read it (module docs).
    job: UnsafeCell<Job>,
    panicked: AtomicBool,
    panic_payload: Mutex<Option<Box<dyn Any + Send>>>,
    shutdown: AtomicBool,
    /// Context of every worker; index 0 is the template for the caller.
    ctxs: Box<[WorkerCtx]>,
    spin: Duration,
    yield_spin: bool,
}

// SAFETY: `job` holds raw pointers to `Sync` closures and is accessed under the dispatch
// protocol (written only while no worker is inside a job; read only by a worker inside an open
// job); everything else is atomics, a Mutex, or immutable after construction.
unsafe impl Sync for Shared {}
// SAFETY: as above; the pointed-to closures are `Sync`, so using them from other threads is fine.
unsafe impl Send for Shared {}

thread_local! {
    /// The pool and context of the task this thread is executing (for nested calls).
    static CURRENT: Cell<Option<(*const Shared, *const WorkerCtx)>> = const { Cell::new(None) };
    /// Set while a `CallerPin` is alive on this thread: (pool, CPU).
    static CALLER_PIN: Cell<Option<(*const Shared, usize)>> = const { Cell::new(None) };
}

/// Workers of the pool whose task the calling thread is running, if it runs one (any pool's).
pub(crate) fn running_task_threads() -> Option<usize> {
    // SAFETY: `CURRENT` holds a pool's `Shared` only while this thread runs one of its tasks, and
    // the pool outlives its tasks.
    CURRENT.with(|c| c.get().map(|(shared, _)| unsafe { &*shared }.ctxs.len()))
}

impl Shared {
    /// Wait for `epoch` to move past `seen`: spin for the budget, then sleep.
    fn wait_epoch(&self, seen: u32) -> u32 {
        let epoch = &self.gate.0.epoch;
        let e = epoch.load(Ordering::Acquire);
        if e != seen {
            return e;
        }
        if spin_until(self.spin, self.yield_spin, || epoch.load(Ordering::Acquire) != seen) {
            return epoch.load(Ordering::Acquire);
        }
        loop {
            // Dekker with the caller's `epoch` bump → `sleepers` load (both SeqCst): either the
            // caller sees us and wakes, or we see the new epoch here (and FUTEX_WAIT would also
            // refuse to sleep on a changed value).
            self.sleepers.0.fetch_add(1, Ordering::SeqCst);
            if epoch.load(Ordering::SeqCst) == seen {
                sys::futex_wait(epoch, seen);
            }
            self.sleepers.0.fetch_sub(1, Ordering::SeqCst);
            let e = epoch.load(Ordering::Acquire);
            if e != seen {
                return e;
            }
        }
    }

    /// Run the executor's share of `job`, catching panics.
    fn execute(&self, job: Job, ctx: &WorkerCtx) {
        // SAFETY: called only by a worker inside an open job, or by the caller in `dispatch`
        // before it closes the job: the closures are alive.
        let r = panic::catch_unwind(AssertUnwindSafe(|| unsafe { self.execute_tasks(job, ctx) }));
        if let Err(payload) = r {
            self.record_panic(payload);
        }
    }

    /// # Safety
    /// The pointers in `job` must be alive (see [`Shared::execute`]).
    unsafe fn execute_tasks(&self, job: Job, ctx: &WorkerCtx) {
        match job {
            Job::Idle => {}
            Job::Flat { n, f } => {
                let f = &*f;
                loop {
                    let i = self.counter.0.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    f(i, ctx);
                }
            }
            Job::Nodes { tasks, f, owned } => {
                let (tasks, f) = (&*tasks, &*f);
                let n = tasks.get(ctx.node).copied().unwrap_or(0);
                if n == 0 {
                    return;
                }
                let counter = &self.node_counters[ctx.node].0;
                let Some(owned) = owned else {
                    loop {
                        let i = counter.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            break;
                        }
                        f(ctx.node, i, ctx);
                    }
                    return;
                };
                // Claims before the owned run as usual; then this worker's owned task, then any
                // owned task whose worker has not claimed it yet; then the rest after the run.
                let (start, run) = self.owned_run(&*owned, tasks, ctx.node);
                let mut owned_done = false;
                loop {
                    let c = counter.fetch_add(1, Ordering::Relaxed);
                    if c >= start && !owned_done {
                        owned_done = true;
                        self.claim_owned(ctx.node, start, run, ctx, f);
                    }
                    let i = if c < start { c } else { c + run };
                    if i >= n {
                        break;
                    }
                    f(ctx.node, i, ctx);
                }
                if !owned_done {
                    self.claim_owned(ctx.node, start, run, ctx, f);
                }
            }
            Job::Each { f } => (*f)(ctx),
        }
    }

    /// Node `node`'s owned run of an affine job: its first task and length (one task per
    /// worker of the node, fewer when the node's list ends first).
    fn owned_run(&self, owned: &[usize], tasks: &[usize], node: usize) -> (usize, usize) {
        let n = tasks.get(node).copied().unwrap_or(0);
        let start = owned.get(node).copied().unwrap_or(n).min(n);
        let workers = self.node_base.get(node + 1).copied().unwrap_or(self.ctxs.len()) - self.node_base[node];
        (start, (n - start).min(workers))
    }

    /// Runs `ctx`'s owned task if nobody has claimed it, then every owned task of the node still
    /// unclaimed (a worker that joins late, or never, does not hold up the tasks after the run).
    /// After a panic, tasks are claimed but not run.
    fn claim_owned(&self, node: usize, start: usize, run: usize, ctx: &WorkerCtx, f: &NodeFn) {
        let base = self.node_base[node];
        let ranks = std::iter::once(ctx.node_rank).chain(0..run);
        for q in ranks.filter(|&q| q < run) {
            if !self.owned_claimed[base + q].0.swap(true, Ordering::AcqRel) && !self.panicked.load(Ordering::Relaxed) {
                f(node, start + q, ctx);
            }
        }
    }

    fn record_panic(&self, payload: Box<dyn Any + Send>) {
        // Stop further claims; tasks already running finish.
        self.counter.0.store(CLAIMS_CLOSED, Ordering::Relaxed);
        for c in self.node_counters.iter() {
            c.0.store(CLAIMS_CLOSED, Ordering::Relaxed);
        }
        if !self.panicked.swap(true, Ordering::AcqRel) {
            *self.panic_payload.lock().unwrap_or_else(PoisonError::into_inner) = Some(payload);
        }
    }

    /// A spawned worker leaves the job it entered (after this it must not touch the job).
    fn leave(&self) {
        self.state.0.fetch_add(LEAVE, Ordering::SeqCst);
        if self.caller_waiting.0.load(Ordering::SeqCst) {
            sys::futex_wake_all(&self.state.0);
        }
    }

    /// Caller side: wait until `cond()`, spinning first, then sleeping on `state` (every leave
    /// changes it, and the conditions only become true through work done before a leave).
    /// Never panics.
    fn caller_wait(&self, cond: impl Fn() -> bool) {
        if spin_until(self.spin, self.yield_spin, &cond) {
            return;
        }
        // Dekker with `leave` (both SeqCst): either the leaving worker sees `caller_waiting`
        // and wakes us, or we see its leave in `state` (or in `cond`).
        self.caller_waiting.0.store(true, Ordering::SeqCst);
        loop {
            let st = self.state.0.load(Ordering::SeqCst);
            if cond() {
                break;
            }
            sys::futex_wait(&self.state.0, st);
        }
        self.caller_waiting.0.store(false, Ordering::Relaxed);
    }

    /// Whether every task of `job` has been claimed (for `Each`: every spawned worker ran it).
    ///
    /// # Safety
    /// The pointers in `job` must be alive (the caller's own job, before it returns).
    unsafe fn all_claimed(&self, job: Job, spawned: u32) -> bool {
        match job {
            Job::Idle | Job::Flat { .. } => true, // the caller's own claim loop ran dry
            Job::Nodes { tasks, owned: None, .. } => {
                let tasks = &*tasks;
                tasks.iter().zip(self.node_counters.iter()).all(|(&n, c)| c.0.load(Ordering::Acquire) >= n)
            }
            Job::Nodes { tasks, owned: Some(owned), .. } => {
                let (tasks, owned) = (&*tasks, &*owned);
                let counters_done = tasks.iter().enumerate().all(|(j, &n)| {
                    let (_, run) = self.owned_run(owned, tasks, j);
                    self.node_counters[j].0.load(Ordering::Acquire) + run >= n
                });
                // After a panic nobody may be left to claim an owned task: stop waiting for them.
                self.panicked.load(Ordering::Acquire)
                    || (counters_done && self.owned_claimed.iter().all(|c| c.0.load(Ordering::Acquire)))
            }
            Job::Each { .. } => self.each_done.0.load(Ordering::Acquire) >= spawned,
        }
    }
}

/// Spin until `done()` or `budget` has passed; true if `done()`. Every
/// [`SPINS_PER_CLOCK_CHECK`] spins it reads the clock and, with `yield_spin`, yields the core
/// (see [`PoolPlan::yield_spin`]).
fn spin_until(budget: Duration, yield_spin: bool, done: impl Fn() -> bool) -> bool {
    if budget.is_zero() {
        return done();
    }
    let start = Instant::now();
    let mut i = 0u32;
    loop {
        if done() {
            return true;
        }
        std::hint::spin_loop();
        i = i.wrapping_add(1);
        if i.is_multiple_of(SPINS_PER_CLOCK_CHECK) {
            if yield_spin {
                std::thread::yield_now();
            }
            if start.elapsed() >= budget {
                return done();
            }
        }
    }
}

fn worker_main(shared: Arc<Shared>, w: usize) {
    let s = &*shared;
    let ctx = &s.ctxs[w];
    CURRENT.with(|c| c.set(Some((s as *const Shared, ctx as *const WorkerCtx))));
    // The epoch is 0 until `WorkerPool::new` has returned, which waits for this thread's start.
    let mut seen = 0u32;
    loop {
        seen = s.wait_epoch(seen);
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        s.state.0.fetch_add(ENTER, Ordering::SeqCst);
        if s.gate.0.open.load(Ordering::SeqCst) == seen {
            // SAFETY: the job of epoch `seen` is open and we are inside it: the caller wrote it
            // before publishing `seen` and will not touch it or return before we leave.
            let job = unsafe { *s.job.get() };
            s.execute(job, ctx);
            if let Job::Each { .. } = job {
                s.each_done.0.fetch_add(1, Ordering::Release);
            }
        }
        s.leave();
    }
}

/// Persistent pinned workers; see the module docs.
pub struct WorkerPool {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    plan: PoolPlan,
    /// Serialises dispatches from different threads.
    run_lock: Mutex<()>,
}

impl WorkerPool {
    /// Start the workers of `plan` (each pins itself before this returns).
    pub fn new(plan: PoolPlan) -> io::Result<WorkerPool> {
        let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
        if plan.nodes.is_empty() || plan.nodes.iter().any(Vec::is_empty) {
            return Err(invalid(format!("pool plan needs at least one CPU in every node: {:?}", plan.nodes)));
        }
        if plan.node_ids.len() != plan.nodes.len() {
            return Err(invalid(format!(
                "pool plan has {} nodes but {} node ids",
                plan.nodes.len(),
                plan.node_ids.len()
            )));
        }
        if plan.threads() > MAX_THREADS {
            return Err(invalid(format!("pool plan has {} workers; at most {MAX_THREADS}", plan.threads())));
        }
        let mut ctxs = Vec::with_capacity(plan.threads());
        for (node, cpus) in plan.nodes.iter().enumerate() {
            for (node_rank, &cpu) in cpus.iter().enumerate() {
                let worker = ctxs.len();
                ctxs.push(WorkerCtx { worker, node, node_rank, cpu: plan.pin.then_some(cpu) });
            }
        }
        let threads = ctxs.len();
        let shared = Arc::new(Shared {
            gate: Padded(Gate { epoch: AtomicU32::new(0), open: AtomicU32::new(1) }),
            sleepers: Padded(AtomicU32::new(0)),
            state: Padded(AtomicU32::new(0)),
            caller_waiting: Padded(AtomicBool::new(false)),
            each_done: Padded(AtomicU32::new(0)),
            counter: Padded(AtomicUsize::new(0)),
            node_counters: (0..plan.nodes.len()).map(|_| Padded(AtomicUsize::new(0))).collect(),
            owned_claimed: (0..threads).map(|_| Padded(AtomicBool::new(true))).collect(),
            node_base: plan.nodes.iter().scan(0, |acc, c| Some(std::mem::replace(acc, *acc + c.len()))).collect(),
            job: UnsafeCell::new(Job::Idle),
            panicked: AtomicBool::new(false),
            panic_payload: Mutex::new(None),
            shutdown: AtomicBool::new(false),
            ctxs: ctxs.into_boxed_slice(),
            spin: plan.spin,
            yield_spin: plan.yield_spin,
        });
        let mut pool = WorkerPool { shared, handles: Vec::with_capacity(threads), plan, run_lock: Mutex::new(()) };
        let (tx, rx) = mpsc::channel::<io::Result<()>>();
        let mut first_err: Option<io::Error> = None;
        for w in 1..threads {
            let shared = Arc::clone(&pool.shared);
            let tx = tx.clone();
            let cpu = pool.shared.ctxs[w].cpu;
            let spawned = std::thread::Builder::new().name(format!("krasis-w{w}")).spawn(move || {
                let pinned = match cpu {
                    Some(cpu) => sys::set_affinity(&[cpu])
                        .map_err(|e| io::Error::new(e.kind(), format!("pinning worker {w} to CPU {cpu}: {e}"))),
                    None => Ok(()),
                };
                let ok = pinned.is_ok();
                let _ = tx.send(pinned);
                drop(tx);
                if ok {
                    worker_main(shared, w);
                }
            });
            match spawned {
                Ok(h) => pool.handles.push(h),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        drop(tx);
        for _ in 0..pool.handles.len() {
            match rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    first_err.get_or_insert_with(|| io::Error::other("a pool worker exited during start-up"));
                }
            }
        }
        match first_err {
            None => Ok(pool),
            Some(e) => Err(e), // dropping `pool` stops and joins the workers that did start
        }
    }

    /// Total workers, the calling thread (worker 0) included.
    pub fn threads(&self) -> usize {
        self.shared.ctxs.len()
    }

    /// Pool nodes (NUMA nodes with workers).
    pub fn nodes(&self) -> usize {
        self.plan.nodes.len()
    }

    /// Workers on pool node `node`.
    pub fn node_threads(&self, node: usize) -> usize {
        self.plan.nodes.get(node).map_or(0, Vec::len)
    }

    /// The OS NUMA node id of pool node `node` (for `mbind`).
    pub fn os_node(&self, node: usize) -> usize {
        self.plan.node_ids[node]
    }

    /// Whether workers are pinned (false for simulated topologies).
    pub fn is_pinned(&self) -> bool {
        self.plan.pin
    }

    pub fn plan(&self) -> &PoolPlan {
        &self.plan
    }

    /// The context worker `worker` runs with (worker 0's `cpu` as when the caller is pinned).
    pub fn worker_ctx(&self, worker: usize) -> WorkerCtx {
        self.shared.ctxs[worker]
    }

    /// Run `f(task)` for every task in `0..n` across all workers (claimed dynamically from an
    /// atomic counter, the calling thread included); returns when all are done. A panic in any
    /// task stops further tasks and is re-raised here after every worker has stopped.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize, &WorkerCtx) + Sync)) {
        if n == 0 {
            return;
        }
        if let Some(ctx) = self.nested_ctx() {
            for i in 0..n {
                f(i, &ctx);
            }
            return;
        }
        self.dispatch(Job::Flat { n, f: erase_flat(f) });
    }

    /// NUMA-aware: `tasks_per_node[j]` tasks that only node `j`'s workers execute, as
    /// `f(node, task, ctx)` with `ctx.node == node`. Missing trailing entries mean 0 tasks.
    ///
    /// # Panics
    /// If `tasks_per_node` is longer than `nodes()` (those tasks could never run), and in a
    /// nested call holding tasks for another node than the current worker's.
    pub fn run_on_nodes(&self, tasks_per_node: &[usize], f: &(dyn Fn(usize, usize, &WorkerCtx) + Sync)) {
        self.node_job(tasks_per_node, None, f)
    }

    /// `run_on_nodes`, with an owned run per node when `owned` is given.
    fn node_job(
        &self,
        tasks_per_node: &[usize],
        owned: Option<&[usize]>,
        f: &(dyn Fn(usize, usize, &WorkerCtx) + Sync),
    ) {
        assert!(
            tasks_per_node.len() <= self.nodes(),
            "run_on_nodes got tasks for {} nodes but the pool has {}",
            tasks_per_node.len(),
            self.nodes()
        );
        if tasks_per_node.iter().all(|&n| n == 0) {
            return;
        }
        if let Some(ctx) = self.nested_ctx() {
            // Inline, in list order (owned runs included: one worker runs everything).
            if let Some(j) = tasks_per_node.iter().enumerate().position(|(j, &n)| n > 0 && j != ctx.node) {
                panic!("nested run_on_nodes from a node-{} worker holds tasks for node {j}", ctx.node);
            }
            for i in 0..tasks_per_node[ctx.node] {
                f(ctx.node, i, &ctx);
            }
            return;
        }
        self.dispatch(Job::Nodes {
            tasks: tasks_per_node as *const [usize],
            f: erase_nodes(f),
            owned: owned.map(|o| o as *const [usize]),
        });
    }

    /// [`WorkerPool::run_on_nodes`], except that node `j`'s tasks `owned[j]..owned[j] + w` (`w`
    /// its workers, or fewer where the list ends) are *owned*: task `owned[j] + q` runs on the
    /// node's worker of rank `q`, right after the claims before the run are taken. A worker that
    /// has not joined by the time another finishes its own owned task loses it to that worker,
    /// so no task waits on a late worker for long. Two affine dispatches with the same
    /// plan therefore run each owned task on the same core: one can warm that core's caches for
    /// the other. Claims are otherwise in list order, as in `run_on_nodes`, with each node's owned
    /// run claimed before any task after it. A missing entry of `owned` means no owned run.
    ///
    /// # Panics
    /// As [`WorkerPool::run_on_nodes`].
    pub fn run_on_nodes_affine(
        &self,
        tasks_per_node: &[usize],
        owned: &[usize],
        f: &(dyn Fn(usize, usize, &WorkerCtx) + Sync),
    ) {
        self.node_job(tasks_per_node, Some(owned), f)
    }

    /// Run `f(ctx)` exactly once on every worker (the calling thread as worker 0): per-worker
    /// setup, first touch of per-worker memory, bandwidth probes.
    ///
    /// # Panics
    /// When called from inside a task of this pool.
    pub fn broadcast(&self, f: &(dyn Fn(&WorkerCtx) + Sync)) {
        assert!(self.nested_ctx().is_none(), "broadcast called from inside a task of the same pool");
        self.dispatch(Job::Each { f: erase_each(f) });
    }

    /// Pin the calling thread to worker 0's CPU until the guard drops (which restores the old
    /// affinity). A no-op guard for unpinned (simulated) pools.
    pub fn pin_caller(&self) -> io::Result<CallerPin> {
        let cpu = match self.shared.ctxs[0].cpu {
            Some(cpu) if self.plan.pin => cpu,
            _ => return Ok(CallerPin { cpu: None, restore: None, prev_tag: None, _not_send: PhantomData }),
        };
        let prev = sys::current_affinity()?;
        sys::set_affinity(&[cpu])?;
        let prev_tag = CALLER_PIN.with(|c| c.replace(Some((Arc::as_ptr(&self.shared), cpu))));
        Ok(CallerPin { cpu: Some(cpu), restore: Some(prev), prev_tag: Some(prev_tag), _not_send: PhantomData })
    }

    /// Zero-fill `buf` from the workers of pool node `node`, in 2 MiB-aligned pieces, so each
    /// page is first touched (and so allocated, unless `mbind` says otherwise) on that node.
    pub fn first_touch(&self, node: usize, buf: &mut [u8]) {
        assert!(node < self.nodes(), "first_touch on node {node} of a {}-node pool", self.nodes());
        let len = buf.len();
        if len == 0 {
            return;
        }
        let base = placement::SyncPtr(buf.as_mut_ptr());
        let pieces = placement::Pieces::new(base.get() as usize, len, placement::TOUCH_PIECE);
        let mut tasks = vec![0usize; self.nodes()];
        tasks[node] = pieces.count();
        self.run_on_nodes(&tasks, &|_, i, _| {
            let (start, end) = pieces.range(i);
            // SAFETY: `[start, end)` lies inside `buf`, exclusively borrowed for this call, and
            // the pieces are disjoint.
            unsafe { std::ptr::write_bytes(base.get().add(start), 0, end - start) };
        });
    }

    /// Place a page buffer on pool node `node`: THP advice and `mbind` before first touch, then
    /// first touch (zero-fill) by that node's workers; reports what took, for the logs.
    pub fn place_buffer(&self, buf: &mut krasis_core::memory::PageBuffer, node: usize) -> PlacementReport {
        let mut report = place_on_node(buf.as_ptr(), buf.len(), self.os_node(node));
        self.first_touch(node, buf.as_mut_slice());
        report.measure_huge_pages(buf.as_ptr(), buf.len());
        report
    }

    /// One line for the logs, e.g. "16 workers pinned to cores 0-15 on 1 NUMA node (worker 0
    /// is the calling thread)".
    pub fn describe(&self) -> String {
        let n = self.threads();
        let k = self.nodes();
        let nodes_word = if k == 1 { "node" } else { "nodes" };
        if !self.plan.pin {
            let sizes: Vec<String> = self.plan.nodes.iter().map(|c| c.len().to_string()).collect();
            return format!("{n} workers on {k} simulated NUMA {nodes_word} ({}), not pinned", sizes.join("+"));
        }
        let cores = if k == 1 {
            format_cpulist(&self.plan.nodes[0])
        } else {
            let parts: Vec<String> = self
                .plan
                .nodes
                .iter()
                .zip(&self.plan.node_ids)
                .map(|(c, id)| format!("{} (node {id})", format_cpulist(c)))
                .collect();
            parts.join(", ")
        };
        format!(
            "{n} workers pinned to cores {cores} on {k} NUMA {nodes_word}, one per physical core (worker 0 is the calling thread)"
        )
    }

    /// The context of the task of this pool that the calling thread is running, if any (`None`
    /// outside this pool's tasks, also inside another pool's).
    pub fn current_task(&self) -> Option<WorkerCtx> {
        self.nested_ctx()
    }

    /// The context of the task this thread is running for this pool, if any.
    fn nested_ctx(&self) -> Option<WorkerCtx> {
        let me = Arc::as_ptr(&self.shared);
        CURRENT.with(|c| match c.get() {
            // SAFETY: the pointer is set only while that context is alive (a worker's, for the
            // thread's life; the caller's, for the duration of its share of a job).
            Some((pool, ctx)) if pool == me => Some(unsafe { *ctx }),
            _ => None,
        })
    }

    fn dispatch(&self, job: Job) {
        let guard = self.run_lock.lock().unwrap_or_else(PoisonError::into_inner);
        let s = &*self.shared;
        let gate = &s.gate.0;
        // Only dispatch (under `run_lock`) and Drop (with `&mut self`) write the epoch.
        let e = gate.epoch.load(Ordering::Relaxed).wrapping_add(2);
        // SAFETY: the previous job was closed with no worker inside; a worker reads `job` only
        // inside an open job, and this one opens below, after the write.
        unsafe { *s.job.get() = job };
        s.counter.0.store(0, Ordering::Relaxed);
        for c in s.node_counters.iter() {
            c.0.store(0, Ordering::Relaxed);
        }
        s.each_done.0.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        if let Job::Nodes { tasks, owned: Some(owned), .. } = job {
            // SAFETY: the caller's own slices, alive for this call.
            let (tasks, owned) = unsafe { (&*tasks, &*owned) };
            for (j, &base) in s.node_base.iter().enumerate() {
                let run = if j < tasks.len() { s.owned_run(owned, tasks, j).1 } else { 0 };
                let end = s.node_base.get(j + 1).copied().unwrap_or(s.ctxs.len());
                for q in 0..end - base {
                    // Published to the workers by the job's opening below (SeqCst).
                    s.owned_claimed[base + q].0.store(q >= run, Ordering::Relaxed);
                }
            }
        }
        gate.open.store(e, Ordering::SeqCst);
        // Publishes everything above (SeqCst ⊇ Release); pairs with the sleepers check.
        gate.epoch.store(e, Ordering::SeqCst);
        if s.sleepers.0.load(Ordering::SeqCst) > 0 {
            sys::futex_wake_all(&gate.epoch);
        }

        let me = Arc::as_ptr(&self.shared);
        let caller_cpu = CALLER_PIN.with(|c| c.get()).and_then(|(pool, cpu)| (pool == me).then_some(cpu));
        let ctx = WorkerCtx { cpu: caller_cpu, ..s.ctxs[0] };
        let prev = CURRENT.with(|c| c.replace(Some((me, &ctx as *const WorkerCtx))));
        s.execute(job, &ctx);
        CURRENT.with(|c| c.set(prev));

        let spawned = self.handles.len() as u32;
        // SAFETY: `job` is this call's own job; its closures live until we return.
        s.caller_wait(|| unsafe { s.all_claimed(job, spawned) });
        gate.open.store(e | 1, Ordering::SeqCst);
        s.caller_wait(|| s.state.0.load(Ordering::SeqCst) & ACTIVE_MASK == 0);
        // SAFETY: the job is closed and no worker is inside; leave no dangling pointer behind.
        unsafe { *s.job.get() = Job::Idle };
        let payload = if s.panicked.load(Ordering::Acquire) {
            s.panic_payload.lock().unwrap_or_else(PoisonError::into_inner).take()
        } else {
            None
        };
        drop(guard);
        if let Some(p) = payload {
            panic::resume_unwind(p);
        }
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, Ordering::SeqCst);
        s.gate.0.epoch.fetch_add(2, Ordering::SeqCst);
        sys::futex_wake_all(&s.gate.0.epoch);
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// Keeps the calling thread pinned to worker 0's CPU; restores the previous affinity on drop.
/// Not `Send`: it must drop on the thread it pinned.
#[must_use = "the caller is unpinned again when the guard drops"]
pub struct CallerPin {
    cpu: Option<usize>,
    restore: Option<Vec<usize>>,
    prev_tag: Option<Option<(*const Shared, usize)>>,
    _not_send: PhantomData<*const ()>,
}

impl CallerPin {
    /// The CPU the caller is pinned to (`None` for a no-op guard).
    pub fn cpu(&self) -> Option<usize> {
        self.cpu
    }
}

impl Drop for CallerPin {
    fn drop(&mut self) {
        if let Some(prev) = self.restore.take() {
            let _ = sys::set_affinity(&prev);
        }
        if let Some(tag) = self.prev_tag.take() {
            CALLER_PIN.with(|c| c.set(tag));
        }
    }
}

#[cfg(test)]
mod tests;
