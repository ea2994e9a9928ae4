//! NUMA data placement: bind pages to a node before first touch, ask for transparent huge pages,
//! report what the kernel did; node-local copies of small per-token data (the activation).

use std::sync::Mutex;

use krasis_core::memory::{advise_huge_pages, bind_to_node, huge_page_bytes};

use super::{WorkerCtx, WorkerPool};

/// First-touch piece size: a huge page is allocated whole by the thread that touches it first,
/// so pieces smaller than 2 MiB would not place memory any finer.
pub(crate) const TOUCH_PIECE: usize = 2 << 20;

/// A raw pointer that may cross threads; users guarantee disjoint access. Read it through
/// [`SyncPtr::get`] so closures capture the wrapper (which is `Sync`), not the bare pointer.
pub(crate) struct SyncPtr<T>(pub *mut T);

impl<T> SyncPtr<T> {
    pub fn get(&self) -> *mut T {
        self.0
    }
}

// SAFETY: only a pointer value; every use site documents why its accesses are disjoint.
unsafe impl<T> Sync for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Send for SyncPtr<T> {}

/// `[0, len)` cut at the multiples of `piece` of the absolute address `addr + offset`.
pub(crate) struct Pieces {
    len: usize,
    first: usize,
    piece: usize,
}

impl Pieces {
    pub fn new(addr: usize, len: usize, piece: usize) -> Pieces {
        let head = (piece - addr % piece) % piece;
        let first = if head == 0 { piece } else { head }.min(len);
        Pieces { len, first, piece }
    }

    pub fn count(&self) -> usize {
        if self.len == 0 {
            0
        } else {
            1 + (self.len - self.first).div_ceil(self.piece)
        }
    }

    /// Byte range `[start, end)` of piece `i < count()`.
    pub fn range(&self, i: usize) -> (usize, usize) {
        if i == 0 {
            (0, self.first)
        } else {
            let start = self.first + (i - 1) * self.piece;
            (start, (start + self.piece).min(self.len))
        }
    }
}

/// What `mbind` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Binding {
    /// Pages are bound to the node.
    Bound,
    /// The kernel has no NUMA support (one node): nothing to bind, first touch decides.
    NoNuma,
    /// `mbind` refused (e.g. a node id this machine lacks, as in simulated topologies).
    Failed(String),
}

/// Where a buffer's pages were asked to go and what took, for the logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacementReport {
    /// OS NUMA node id.
    pub node: usize,
    pub bytes: usize,
    pub binding: Binding,
    /// `madvise(MADV_HUGEPAGE)` accepted.
    pub thp_advised: bool,
    /// Bytes backed by transparent huge pages after first touch (`None`: not measured or
    /// `/proc/self/smaps` unreadable).
    pub huge_bytes: Option<u64>,
}

/// Ask for huge pages on `[ptr, ptr+len)` and bind its pages to OS NUMA node `node`. Call before
/// first touch (see [`WorkerPool::first_touch`] / [`WorkerPool::place_buffer`]); `huge_bytes` is
/// left unmeasured since untouched pages are not backed by anything yet.
pub fn place_on_node(ptr: *const u8, len: usize, node: usize) -> PlacementReport {
    let thp_advised = advise_huge_pages(ptr, len);
    let binding = match bind_to_node(ptr, len, node) {
        Ok(true) => Binding::Bound,
        Ok(false) => Binding::NoNuma,
        Err(e) => Binding::Failed(e.to_string()),
    };
    PlacementReport { node, bytes: len, binding, thp_advised, huge_bytes: None }
}

impl PlacementReport {
    /// Read how much of `[ptr, ptr+len)` is in huge pages now (after first touch).
    pub fn measure_huge_pages(&mut self, ptr: *const u8, len: usize) {
        self.huge_bytes = huge_page_bytes(ptr, len);
    }

    /// One log line, e.g. "2.00 GiB on node 0: mbind ok, THP advised, 2.00 GiB in huge pages".
    pub fn summary(&self) -> String {
        let bind = match &self.binding {
            Binding::Bound => "mbind ok".to_owned(),
            Binding::NoNuma => "no NUMA in kernel (first touch places pages)".to_owned(),
            Binding::Failed(e) => format!("mbind failed ({e})"),
        };
        let thp = if self.thp_advised { "THP advised" } else { "THP advice refused" };
        let huge = match self.huge_bytes {
            Some(b) => format!("{} in huge pages", gib(b as usize)),
            None => "huge pages not measured".to_owned(),
        };
        format!("{} on node {}: {bind}, {thp}, {huge}", gib(self.bytes), self.node)
    }
}

pub(crate) fn gib(bytes: usize) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// One copy of `T` per pool node, e.g. the token's activation vector, so the workers of each
/// node read a node-local copy instead of pulling the same lines across the interconnect for
/// every expert. Copies are created and refilled by a worker of their node (first touch and the
/// cache lines written land on that node).
#[derive(Debug)]
pub struct PerNode<T> {
    copies: Vec<T>,
}

impl<T: Send> PerNode<T> {
    /// Build copy `j` with `init(ctx)` on a worker of pool node `j`.
    pub fn new_on(pool: &WorkerPool, init: impl Fn(&WorkerCtx) -> T + Sync) -> PerNode<T> {
        let slots: Vec<Mutex<Option<T>>> = (0..pool.nodes()).map(|_| Mutex::new(None)).collect();
        let tasks = vec![1usize; pool.nodes()];
        pool.run_on_nodes(&tasks, &|node, _, ctx| {
            let v = init(ctx);
            *slots[node].lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(v);
        });
        let copies = slots
            .into_iter()
            .map(|m| {
                m.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner).expect("every node ran its task")
            })
            .collect();
        PerNode { copies }
    }

    /// Copy `src` into the front of every node's copy, each by a worker of that node (inline on
    /// the calling thread, which is node 0's worker 0, when there is one node).
    ///
    /// # Panics
    /// If a copy is shorter than `src`.
    pub fn fill_from<E: Copy + Sync>(&mut self, pool: &WorkerPool, src: &[E])
    where
        T: AsMut<[E]>,
    {
        for c in self.copies.iter_mut() {
            let have = c.as_mut().len();
            assert!(have >= src.len(), "PerNode copy holds {have} elements, source has {}", src.len());
        }
        if self.copies.len() == 1 {
            self.copies[0].as_mut()[..src.len()].copy_from_slice(src);
            return;
        }
        assert!(self.copies.len() <= pool.nodes(), "PerNode has more copies than the pool has nodes");
        let base = SyncPtr(self.copies.as_mut_ptr());
        let tasks = [1usize; 64];
        let n = self.copies.len();
        let run = |tasks: &[usize]| {
            pool.run_on_nodes(tasks, &|node, _, _| {
                // SAFETY: task `node` is the only one touching copy `node` (one task per node), and
                // `&mut self` keeps everyone else out until `run_on_nodes` returns.
                let copy = unsafe { &mut *base.get().add(node) };
                copy.as_mut()[..src.len()].copy_from_slice(src);
            })
        };
        if n <= tasks.len() {
            run(&tasks[..n]);
        } else {
            run(&vec![1usize; n]);
        }
    }
}

impl<T> PerNode<T> {
    /// Copies made elsewhere (copy `j` belongs to pool node `j`).
    pub fn from_vec(copies: Vec<T>) -> PerNode<T> {
        PerNode { copies }
    }

    pub fn nodes(&self) -> usize {
        self.copies.len()
    }

    /// The copy for pool node `node` (what a task reads via `ctx.node`).
    pub fn get(&self, node: usize) -> &T {
        &self.copies[node]
    }

    pub fn get_mut(&mut self, node: usize) -> &mut T {
        &mut self.copies[node]
    }

    pub fn iter(&self) -> std::slice::Iter<'_, T> {
        self.copies.iter()
    }
}
