use std::collections::BTreeSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use krasis_core::hw::{probe, CpuTopology, NumaNode, SystemReport};
use krasis_core::memory::PageBuffer;

use super::*;

fn counts(n: usize) -> Vec<AtomicUsize> {
    (0..n).map(|_| AtomicUsize::new(0)).collect()
}

fn assert_once(c: &[AtomicUsize], what: &str) {
    for (i, x) in c.iter().enumerate() {
        assert_eq!(x.load(Ordering::Relaxed), 1, "{what}: task {i} ran {} times", x.load(Ordering::Relaxed));
    }
}

fn plans() -> Vec<PoolPlan> {
    let mut out = Vec::new();
    for (nodes, per) in [(1, 1), (1, 2), (1, 3), (1, 5), (2, 1), (2, 2), (3, 2)] {
        out.push(PoolPlan::simulated(nodes, per));
        // Spin 0: every wait goes through the futex park / wake path.
        out.push(PoolPlan { spin: Duration::ZERO, ..PoolPlan::simulated(nodes, per) });
        if nodes * per <= 2 {
            // Pure spinning (no yield) only where it does not oversubscribe a small CI box much.
            out.push(PoolPlan { yield_spin: false, ..PoolPlan::simulated(nodes, per) });
        }
    }
    out
}

const SIZES: [usize; 11] = [0, 1, 2, 3, 4, 5, 7, 16, 63, 1000, 10_007];

#[test]
fn every_task_runs_exactly_once() {
    for plan in plans() {
        let pool = WorkerPool::new(plan.clone()).unwrap();
        for n in SIZES {
            let c = counts(n);
            pool.run(n, &|i, ctx| {
                assert!(ctx.worker < pool.threads());
                assert_eq!(pool.worker_ctx(ctx.worker).node, ctx.node);
                c[i].fetch_add(1, Ordering::Relaxed);
            });
            assert_once(&c, &format!("{:?} n={n}", plan.nodes));
        }
    }
}

#[test]
fn back_to_back_and_after_parking() {
    for plan in [PoolPlan::simulated(1, 3), PoolPlan { spin: Duration::from_micros(50), ..PoolPlan::simulated(2, 2) }] {
        let pool = WorkerPool::new(plan).unwrap();
        let total = AtomicUsize::new(0);
        for round in 0..5000 {
            let n = round % 9;
            pool.run(n, &|_, _| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), (0..5000).map(|r| r % 9).sum::<usize>());
        // Let the workers park (spin budget 1 ms / 50 µs), then make sure a job still wakes them.
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(3));
            let c = counts(40);
            pool.run(40, &|i, _| {
                c[i].fetch_add(1, Ordering::Relaxed);
            });
            assert_once(&c, "after park");
        }
    }
}

#[test]
fn every_worker_takes_part_when_tasks_wait_for_each_other() {
    // n == threads tasks that each wait until all have started: only completes if all workers
    // (the caller included) run one task each, i.e. no worker is lost or asleep.
    for plan in plans() {
        let pool = WorkerPool::new(plan).unwrap();
        let t = pool.threads();
        let started = AtomicUsize::new(0);
        let workers = Mutex::new(BTreeSet::new());
        pool.run(t, &|_, ctx| {
            started.fetch_add(1, Ordering::SeqCst);
            while started.load(Ordering::SeqCst) < t {
                std::hint::spin_loop();
            }
            workers.lock().unwrap().insert(ctx.worker);
        });
        assert_eq!(workers.into_inner().unwrap(), (0..t).collect::<BTreeSet<_>>());
    }
}

#[test]
fn broadcast_runs_once_per_worker() {
    for plan in plans() {
        let pool = WorkerPool::new(plan).unwrap();
        let c = counts(pool.threads());
        for _ in 0..20 {
            pool.broadcast(&|ctx| {
                c[ctx.worker].fetch_add(1, Ordering::Relaxed);
            });
        }
        assert!(c.iter().all(|x| x.load(Ordering::Relaxed) == 20));
    }
}

#[test]
fn nested_runs_execute_inline() {
    let pool = WorkerPool::new(PoolPlan::simulated(2, 2)).unwrap();
    let inner = counts(8 * 5);
    pool.run(8, &|i, outer_ctx| {
        pool.run(5, &|j, ctx| {
            assert_eq!(ctx, outer_ctx, "nested tasks run on the outer task's worker");
            inner[i * 5 + j].fetch_add(1, Ordering::Relaxed);
        });
    });
    assert_once(&inner, "nested");

    // Nested node job for the worker's own node runs; for another node it is refused.
    let own = AtomicUsize::new(0);
    pool.run_on_nodes(&[2, 2], &|node, _, _| {
        let mut tasks = [0, 0];
        tasks[node] = 3;
        pool.run_on_nodes(&tasks, &|n2, _, ctx| {
            assert_eq!((n2, ctx.node), (node, node));
            own.fetch_add(1, Ordering::Relaxed);
        });
    });
    assert_eq!(own.load(Ordering::Relaxed), 4 * 3);
    let r = catch_unwind(AssertUnwindSafe(|| {
        pool.run_on_nodes(&[1, 1], &|node, _, _| {
            let mut tasks = [0, 0];
            tasks[1 - node] = 1;
            pool.run_on_nodes(&tasks, &|_, _, _| {});
        })
    }));
    assert!(r.is_err());
    let r = catch_unwind(AssertUnwindSafe(|| pool.run(1, &|_, _| pool.broadcast(&|_| {}))));
    assert!(r.is_err());
    // Still usable.
    let c = counts(100);
    pool.run(100, &|i, _| {
        c[i].fetch_add(1, Ordering::Relaxed);
    });
    assert_once(&c, "after nested panics");
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

#[test]
fn panics_propagate_after_all_workers_stop_and_pool_stays_usable() {
    for plan in plans() {
        let pool = WorkerPool::new(plan).unwrap();
        for round in 0..20 {
            let running = AtomicUsize::new(0);
            let bad = round % 7;
            let r = catch_unwind(AssertUnwindSafe(|| {
                pool.run(50, &|i, _| {
                    running.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_micros(20));
                    if i == bad {
                        panic!("task {i} failed");
                    }
                    running.fetch_sub(1, Ordering::SeqCst);
                });
            }));
            let p = r.expect_err("the panic reaches the caller");
            assert_eq!(panic_message(&p), format!("task {bad} failed"));
            // Only the panicking task is still "running": every other one finished before run
            // returned (no worker was still inside `f`).
            assert_eq!(running.load(Ordering::SeqCst), 1);
            let c = counts(37);
            pool.run(37, &|i, _| {
                c[i].fetch_add(1, Ordering::Relaxed);
            });
            assert_once(&c, "after panic");
        }
        // A panic on a spawned worker only (not the caller) and one on every worker at once.
        if pool.threads() > 1 {
            let r = catch_unwind(AssertUnwindSafe(|| {
                pool.broadcast(&|ctx| {
                    if ctx.worker == pool.threads() - 1 {
                        panic!("last worker");
                    }
                })
            }));
            assert_eq!(panic_message(&r.unwrap_err()), "last worker");
        }
        let r = catch_unwind(AssertUnwindSafe(|| pool.broadcast(&|_| panic!("everyone"))));
        assert_eq!(panic_message(&r.unwrap_err()), "everyone");
        let c = counts(5);
        pool.run(5, &|i, _| {
            c[i].fetch_add(1, Ordering::Relaxed);
        });
        assert_once(&c, "after broadcast panics");
    }
}

#[test]
fn simulated_two_nodes_keep_tasks_on_their_node() {
    for plan in [PoolPlan::simulated(2, 2), PoolPlan { spin: Duration::ZERO, ..PoolPlan::simulated(2, 2) }] {
        let pool = WorkerPool::new(plan).unwrap();
        assert_eq!((pool.threads(), pool.nodes(), pool.node_threads(0), pool.node_threads(1)), (4, 2, 2, 2));
        for tasks in [[5usize, 7], [100, 0], [0, 100], [1, 1], [0, 0], [3, 1000]] {
            let c: [Vec<AtomicUsize>; 2] = [counts(tasks[0]), counts(tasks[1])];
            let workers: [Mutex<BTreeSet<usize>>; 2] = Default::default();
            pool.run_on_nodes(&tasks, &|node, i, ctx| {
                assert_eq!(ctx.node, node, "node-{node} task on a node-{} worker", ctx.node);
                assert!(ctx.node_rank < pool.node_threads(node));
                assert_eq!(pool.worker_ctx(ctx.worker).node, node);
                c[node][i].fetch_add(1, Ordering::Relaxed);
                workers[node].lock().unwrap().insert(ctx.worker);
            });
            assert_once(&c[0], "node 0");
            assert_once(&c[1], "node 1");
            // Node 0 is workers {0 (the caller), 1}; node 1 is {2, 3}.
            assert!(workers[0].lock().unwrap().iter().all(|w| *w < 2));
            assert!(workers[1].lock().unwrap().iter().all(|w| *w >= 2));
        }
        // Short tasks_per_node means zero for the rest; too long is refused.
        let c = counts(9);
        pool.run_on_nodes(&[9], &|node, i, _| {
            assert_eq!(node, 0);
            c[i].fetch_add(1, Ordering::Relaxed);
        });
        assert_once(&c, "short slice");
        assert!(catch_unwind(AssertUnwindSafe(|| pool.run_on_nodes(&[1, 1, 1], &|_, _, _| {}))).is_err());
        assert!(pool.describe().contains("2 simulated NUMA nodes"), "{}", pool.describe());
    }
}

#[test]
fn concurrent_callers_are_serialised() {
    let pool = WorkerPool::new(PoolPlan::simulated(1, 3)).unwrap();
    let total = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                for _ in 0..300 {
                    pool.run(17, &|_, _| {
                        total.fetch_add(1, Ordering::Relaxed);
                    });
                }
            });
        }
    });
    assert_eq!(total.load(Ordering::Relaxed), 3 * 300 * 17);
}

#[test]
fn drop_joins_workers_spinning_or_parked() {
    for i in 0..50usize {
        let spin = if i.is_multiple_of(2) { Duration::ZERO } else { SPIN_BEFORE_PARK };
        let pool = WorkerPool::new(PoolPlan { spin, ..PoolPlan::simulated(2, 2) }).unwrap();
        if i.is_multiple_of(3) {
            pool.run(10, &|_, _| {});
        }
        drop(pool);
    }
}

#[test]
fn invalid_plans_are_refused() {
    assert!(WorkerPool::new(PoolPlan { nodes: vec![], ..PoolPlan::simulated(1, 1) }).is_err());
    assert!(WorkerPool::new(PoolPlan { nodes: vec![vec![0], vec![]], ..PoolPlan::simulated(2, 1) }).is_err());
    assert!(WorkerPool::new(PoolPlan { node_ids: vec![0, 1], ..PoolPlan::simulated(1, 2) }).is_err());
}

fn topo(cpu: usize, core: i64) -> CpuTopology {
    CpuTopology { cpu, package_id: Some(0), die_id: Some(0), core_id: Some(core) }
}

#[test]
fn plan_from_a_two_node_report_skips_siblings_and_spreads_a_limit() {
    // 2 nodes × 4 cores × 2 SMT siblings: CPUs 0-7 are cores 0-7, CPUs 8-15 their siblings.
    let cpu_topology: Vec<CpuTopology> = (0..16).map(|c| topo(c, (c % 8) as i64)).collect();
    let report = SystemReport {
        logical_cpus: 16,
        physical_cores: 8,
        smt_active: true,
        cpu_topology,
        numa_nodes: vec![
            NumaNode { id: 0, cpus: vec![0, 1, 2, 3, 8, 9, 10, 11], mem_total_bytes: None },
            NumaNode { id: 1, cpus: vec![4, 5, 6, 7, 12, 13, 14, 15], mem_total_bytes: None },
            NumaNode { id: 2, cpus: vec![], mem_total_bytes: Some(1 << 30) }, // memory only (CXL)
        ],
        ..Default::default()
    };
    let p = PoolPlan::from_system(&report, None);
    assert_eq!(p.nodes, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    assert_eq!(p.node_ids, vec![0, 1]);
    let p = PoolPlan::from_system(&report, Some(3));
    assert_eq!(p.nodes, vec![vec![0, 1], vec![4]]);
    let p = PoolPlan::from_system(&report, Some(1));
    assert_eq!((p.nodes, p.node_ids), (vec![vec![0]], vec![0]));
    let p = PoolPlan::from_system(&report, Some(100));
    assert_eq!(p.threads(), 8);
}

#[test]
fn system_pool_has_one_pinned_worker_per_physical_core() {
    let report = probe();
    let plan = PoolPlan::from_system(&report, None);
    assert_eq!(plan.threads(), report.physical_cores.max(1));
    let pool = WorkerPool::new(plan).unwrap();
    eprintln!("{}", pool.describe());
    let before = current_affinity().unwrap();
    {
        let pin = pool.pin_caller().unwrap();
        assert_eq!(pin.cpu(), pool.worker_ctx(0).cpu);
        // (worker, its ctx.cpu, the affinity it observed)
        type Seen = (usize, Option<usize>, Vec<usize>);
        let seen: Mutex<Vec<Seen>> = Mutex::new(Vec::new());
        pool.broadcast(&|ctx| {
            seen.lock().unwrap().push((ctx.worker, ctx.cpu, current_affinity().unwrap()));
        });
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), pool.threads());
        let mut cpus = BTreeSet::new();
        for (w, cpu, aff) in seen {
            let cpu = cpu.unwrap_or_else(|| panic!("worker {w} is not pinned"));
            assert_eq!(aff, vec![cpu], "worker {w} runs with affinity {aff:?}, not its CPU {cpu}");
            assert!(cpus.insert(cpu), "two workers on CPU {cpu}");
        }
        // Tasks of `run` see the same pinning.
        pool.run(pool.threads() * 8, &|_, ctx| {
            assert_eq!(current_affinity().unwrap(), vec![ctx.cpu.unwrap()]);
        });
    }
    assert_eq!(current_affinity().unwrap(), before, "CallerPin restores the caller's affinity");
    // Without the guard the caller is worker 0 with no CPU of its own.
    pool.broadcast(&|ctx| {
        if ctx.worker == 0 {
            assert_eq!(ctx.cpu, None);
        }
    });
    assert!(pool.describe().contains("pinned to cores"));
}

#[test]
fn first_touch_and_placement_zero_the_buffer_from_the_node() {
    for pool in [
        WorkerPool::new(PoolPlan::from_system(&probe(), None)).unwrap(),
        WorkerPool::new(PoolPlan::simulated(2, 2)).unwrap(),
    ] {
        for node in 0..pool.nodes() {
            let mut buf = PageBuffer::new((5 << 20) + 12345).unwrap();
            buf.as_mut_slice().fill(7);
            let report = pool.place_buffer(&mut buf, node);
            assert!(buf.as_slice().iter().all(|&b| b == 0));
            assert_eq!(report.node, pool.os_node(node));
            eprintln!("{}", report.summary());
            if pool.is_pinned() {
                assert!(!matches!(report.binding, Binding::Failed(_)), "{}", report.summary());
            }
            // Unaligned sub-slices too.
            let s = &mut buf.as_mut_slice()[3..(3 << 20) + 5];
            s.fill(9);
            pool.first_touch(node, s);
            assert!(buf.as_slice().iter().all(|&b| b == 0));
        }
    }
}

#[test]
fn pieces_cover_the_range_once_at_absolute_boundaries() {
    let p = 1 << 12;
    for addr in [0usize, 1, 4095, 4096, 10_000] {
        for len in [0usize, 1, 100, 4095, 4096, 4097, 3 * 4096 + 17] {
            let pieces = placement::Pieces::new(addr, len, p);
            let mut next = 0;
            for i in 0..pieces.count() {
                let (s, e) = pieces.range(i);
                assert_eq!(s, next);
                assert!(e > s && e <= len);
                if e < len {
                    assert!((addr + e).is_multiple_of(p));
                }
                next = e;
            }
            assert_eq!(next, len);
        }
    }
}

#[test]
fn per_node_copies_are_made_and_filled_on_their_node() {
    let pool = WorkerPool::new(PoolPlan::simulated(2, 2)).unwrap();
    let mut act: PerNode<Vec<f32>> = PerNode::new_on(&pool, |ctx| vec![ctx.node as f32; 16]);
    assert_eq!(act.nodes(), 2);
    assert_eq!(act.get(1)[0], 1.0);
    let src: Vec<f32> = (0..10).map(|i| i as f32).collect();
    act.fill_from(&pool, &src);
    for node in 0..2 {
        assert_eq!(&act.get(node)[..10], &src[..]);
        assert_eq!(act.get(node)[10], node as f32);
    }
    assert!(catch_unwind(AssertUnwindSafe(|| act.fill_from(&pool, &[0.0; 17]))).is_err());

    let one = WorkerPool::new(PoolPlan::simulated(1, 2)).unwrap();
    let mut a: PerNode<Vec<u8>> = PerNode::new_on(&one, |_| vec![0; 4]);
    a.fill_from(&one, &[1, 2, 3]);
    assert_eq!(a.iter().next().unwrap(), &vec![1, 2, 3, 0]);
}

#[test]
fn stress_mixed_jobs_with_late_joining_workers() {
    // Tiny spin budgets make workers park and wake constantly, so many arrive after the caller
    // closed a job (they must skip it without touching the then-dead closure).
    for spin in [Duration::ZERO, Duration::from_micros(2), Duration::from_micros(30)] {
        let pool = WorkerPool::new(PoolPlan { spin, ..PoolPlan::simulated(2, 2) }).unwrap();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..3000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            // Fresh stack data each round: a worker using a stale job would hit the wrong counts.
            match rng % 3 {
                0 => {
                    let n = (rng >> 8) as usize % 12;
                    let c = counts(n);
                    pool.run(n, &|i, _| {
                        c[i].fetch_add(1, Ordering::Relaxed);
                    });
                    assert_once(&c, "stress run");
                }
                1 => {
                    let tasks = [(rng >> 8) as usize % 5, (rng >> 16) as usize % 5];
                    let c = [counts(tasks[0]), counts(tasks[1])];
                    pool.run_on_nodes(&tasks, &|node, i, ctx| {
                        assert_eq!(ctx.node, node);
                        c[node][i].fetch_add(1, Ordering::Relaxed);
                    });
                    assert_once(&c[0], "stress node 0");
                    assert_once(&c[1], "stress node 1");
                }
                _ => {
                    let c = counts(pool.threads());
                    pool.broadcast(&|ctx| {
                        c[ctx.worker].fetch_add(1, Ordering::Relaxed);
                    });
                    assert_once(&c, "stress broadcast");
                }
            }
        }
    }
}

#[test]
fn affine_jobs_run_every_task_once() {
    // Shapes: node task counts, owned-run starts inside, at and past the end of each list.
    for plan in plans() {
        let pool = WorkerPool::new(plan).unwrap();
        let nodes = pool.nodes();
        for round in 0..24usize {
            let tasks: Vec<usize> = (0..nodes).map(|j| SIZES[(round * 5 + j * 3) % SIZES.len()].min(300)).collect();
            let owned: Vec<usize> = tasks.iter().enumerate().map(|(j, &n)| (round * 7 + j) % (n + 2)).collect();
            let c: Vec<Vec<AtomicUsize>> = tasks.iter().map(|&n| counts(n)).collect();
            pool.run_on_nodes_affine(&tasks, &owned, &|node, i, ctx| {
                assert_eq!(ctx.node, node);
                c[node][i].fetch_add(1, Ordering::Relaxed);
            });
            for cj in &c {
                assert_once(cj, "affine");
            }
        }
        // A plain node job after affine ones is unaffected.
        let c = counts(40);
        pool.run_on_nodes(&[40], &|_, i, _| {
            c[i].fetch_add(1, Ordering::Relaxed);
        });
        assert_once(&c, "plain after affine");
    }
}

#[test]
fn affine_owned_tasks_run_on_their_workers_when_all_join() {
    // `pre` tasks first that each wait until `t` of them have started (so every worker, caller
    // included, joined and holds exactly one), then the owned run, whose tasks wait until all
    // of them have started (so no worker can finish its own and take another's): each owned
    // task must then run on the worker of its rank.
    for plan in plans() {
        let pool = WorkerPool::new(plan).unwrap();
        let t = pool.node_threads(0);
        if pool.nodes() != 1 {
            continue;
        }
        for extra in [0usize, 1, 5] {
            let n = 2 * t + extra;
            let (pre, owned_start) = (t, t);
            let phase1 = AtomicUsize::new(0);
            let phase2 = AtomicUsize::new(0);
            let ran_on: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(usize::MAX)).collect();
            pool.run_on_nodes_affine(&[n], &[owned_start], &|_, i, ctx| {
                ran_on[i].store(ctx.node_rank, Ordering::SeqCst);
                let gate = if i < pre {
                    Some((&phase1, pre))
                } else if i < owned_start + t {
                    Some((&phase2, t))
                } else {
                    None
                };
                if let Some((g, want)) = gate {
                    g.fetch_add(1, Ordering::SeqCst);
                    while g.load(Ordering::SeqCst) < want {
                        std::thread::yield_now();
                    }
                }
            });
            for q in 0..t {
                assert_eq!(ran_on[owned_start + q].load(Ordering::SeqCst), q, "owned task {q} of {t} workers");
            }
            assert!(ran_on.iter().all(|r| r.load(Ordering::SeqCst) < t));
        }
    }
}

#[test]
fn affine_panics_propagate_and_the_pool_stays_usable() {
    for plan in plans() {
        let pool = WorkerPool::new(plan).unwrap();
        for bad in [0usize, 3, 9] {
            let r = catch_unwind(AssertUnwindSafe(|| {
                pool.run_on_nodes_affine(&[12], &[2], &|_, i, _| {
                    if i == bad {
                        panic!("task {i} failed");
                    }
                })
            }));
            assert_eq!(panic_message(&r.expect_err("the panic reaches the caller")), format!("task {bad} failed"));
            let c = counts(12);
            pool.run_on_nodes_affine(&[12], &[2], &|_, i, _| {
                c[i].fetch_add(1, Ordering::Relaxed);
            });
            assert_once(&c, "affine after panic");
        }
    }
}
