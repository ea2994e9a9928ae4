//! The GPU router against a CPU twin that mirrors krasis-model's `router::route` (copied by hand
//! in plain loops), over all three top-k methods × both scorings, ragged hidden sizes and
//! t ∈ {1, 3, 9, 64}; both entry points: `forward` (device outputs) and `publish` (the hybrid
//! hand-off: routes and activations into mapped host memory, then a flag set by the device).
//!
//! Gate weights and activations are small multiples of powers of two, chosen so that every f32
//! dot product is exact in any summation order: the GPU's logits equal the twin's bit for bit,
//! and the comparison isolates the routing. Exact ties (equal logits) are kept, since both sides
//! break them by index; tokens whose decisions hinge on two *different* values closer than 1e-6
//! relative (where one rounding of exp may flip the order) are skipped and counted.
//!
//! Without a GPU the device tests print "SKIPPED: no GPU" and pass (`KRASIS_REQUIRE_GPU=1` makes
//! that a failure). The validation tests run everywhere.

#![allow(clippy::needless_range_loop)] // the twin is plain index loops on purpose

mod common;

use common::{down, gpu, rng, up};
use krasis_core::spec::{RoutingRule, ScoringFunc, TopkMethod};
use krasis_gpu::router::{PublishTarget, ROUTER_MAX_EXPERTS, ROUTER_MAX_TOP_K};
use krasis_gpu::{GpuError, GpuRouter, HostFlag, MappedHost};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

// ---------------------------------------------------------------- the twin (krasis-model route)

/// Indices of the `k` largest values (ties: lower index first), as krasis-model sorts them.
fn top_k_indices(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

struct Routed {
    ids: Vec<usize>,
    w: Vec<f32>,
    /// Smallest relative gap between two *different-origin* values on which a decision rests
    /// (consecutive choices up to rank top_k, the group boundary); +inf when none.
    margin: f64,
}

fn rel_gap(a: f32, b: f32) -> f64 {
    let (a, b) = (a as f64, b as f64);
    (a - b).abs() / a.abs().max(b.abs()).max(1e-30)
}

/// krasis-model's `route`, plus the decision margin. `bias`: a `noaux_tc` rule's correction bias,
/// or for the other methods a logit bias added to the logits first (krasis-model's CPU router:
/// gpt-oss's `mlp.router.bias`).
fn twin_route(cfg: &RoutingRule, logits: &[f32], bias: Option<&[f32]>) -> Routed {
    let noaux_rule = matches!(cfg.topk, TopkMethod::NoauxTc { .. });
    let biased: Vec<f32>;
    let logits = match bias {
        Some(b) if !noaux_rule => {
            biased = logits.iter().zip(b).map(|(&l, &b)| l + b).collect();
            &biased[..]
        }
        _ => logits,
    };
    let e = logits.len();
    let scores: Vec<f32> = match cfg.scoring {
        ScoringFunc::Softmax => {
            let mut m = f32::NEG_INFINITY;
            for &x in logits {
                m = m.max(x);
            }
            let mut ex = vec![0f64; e];
            for i in 0..e {
                ex[i] = ((logits[i] - m) as f64).exp();
            }
            let mut z = 0f64;
            for i in 0..e {
                z += ex[i];
            }
            (0..e).map(|i| (ex[i] / z) as f32).collect()
        }
        ScoringFunc::Sigmoid => logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect(),
    };
    let mut choice = scores.clone();
    // What each choice value comes from: equal origins are exact ties on both sides.
    let mut origin: Vec<(u32, u32, bool)> = logits.iter().map(|&l| (l.to_bits(), 0, false)).collect();
    let mut margin = f64::INFINITY;
    let groups = match cfg.topk {
        TopkMethod::Greedy => None,
        TopkMethod::GroupLimitedGreedy { n_group, topk_group } => Some((n_group, topk_group, false)),
        TopkMethod::NoauxTc { n_group, topk_group } => Some((n_group, topk_group, true)),
    };
    if let Some((n_group, topk_group, noaux)) = groups {
        if noaux {
            if let Some(b) = bias {
                for i in 0..e {
                    choice[i] += b[i];
                    origin[i].1 = b[i].to_bits();
                }
            }
        }
        let per = e / n_group;
        let mut gs = vec![0f32; n_group];
        for g in 0..n_group {
            let c = &choice[g * per..(g + 1) * per];
            gs[g] = if noaux {
                let t = top_k_indices(c, 2);
                let mut s = 0.0f32;
                for &i in &t {
                    s += c[i];
                }
                s
            } else {
                let mut m = f32::NEG_INFINITY;
                for &v in c {
                    m = m.max(v);
                }
                m
            };
        }
        let keep = top_k_indices(&gs, topk_group);
        if topk_group < n_group {
            let order = top_k_indices(&gs, n_group);
            margin = margin.min(rel_gap(gs[order[topk_group - 1]], gs[order[topk_group]]));
        }
        for g in 0..n_group {
            if !keep.contains(&g) {
                for i in g * per..(g + 1) * per {
                    choice[i] = 0.0;
                    origin[i] = (0, 0, true);
                }
            }
        }
    }
    let order = top_k_indices(&choice, e);
    for j in 0..cfg.top_k.min(e - 1) {
        let (a, b) = (order[j], order[j + 1]);
        if origin[a] != origin[b] {
            margin = margin.min(rel_gap(choice[a], choice[b]));
        }
    }
    let ids = order[..cfg.top_k].to_vec();
    let mut w: Vec<f32> = ids.iter().map(|&i| scores[i]).collect();
    if cfg.norm_topk_prob {
        let mut s = 0.0f32;
        for &x in &w {
            s += x;
        }
        let denom = if cfg.scoring == ScoringFunc::Sigmoid { s + 1e-20 } else { s };
        for x in &mut w {
            *x /= denom;
        }
    }
    for x in &mut w {
        *x *= cfg.routed_scaling_factor;
    }
    Routed { ids, w, margin }
}

fn cfg(scoring: ScoringFunc, topk: TopkMethod, top_k: usize, norm: bool, scale: f32) -> RoutingRule {
    RoutingRule { scoring, topk, top_k, norm_topk_prob: norm, routed_scaling_factor: scale }
}

/// The twin reproduces krasis-model's own router unit tests (so it is a faithful copy).
#[test]
fn twin_reproduces_krasis_model_examples() {
    let r = twin_route(&cfg(ScoringFunc::Softmax, TopkMethod::Greedy, 2, false, 2.0), &[0.0, 2.0, 1.0, -1.0], None);
    assert_eq!(r.ids, vec![1, 2]);
    let z: f32 = [0.0f32, 2.0, 1.0, -1.0].iter().map(|x| x.exp()).sum();
    assert!((r.w[0] - 2.0 * 2f32.exp() / z).abs() < 1e-6);
    let c = cfg(ScoringFunc::Softmax, TopkMethod::GroupLimitedGreedy { n_group: 3, topk_group: 2 }, 3, false, 1.0);
    assert_eq!(twin_route(&c, &[0.9, 0.7, 0.8, 0.79, 0.85, 0.1], None).ids, vec![0, 4, 1]);
    let c = cfg(ScoringFunc::Sigmoid, TopkMethod::NoauxTc { n_group: 2, topk_group: 1 }, 2, true, 2.5);
    let r = twin_route(&c, &[0.0, 0.0, 1.0, 1.0], Some(&[1.0, 0.9, 0.0, 0.0]));
    assert_eq!(r.ids, vec![0, 1]);
    assert!((r.w[0] - 1.25).abs() < 1e-6 && (r.w[1] - 1.25).abs() < 1e-6);
    // gpt-oss: a logit bias (greedy softmax, renormalised) moves expert 0 to the top; the weights
    // are the softmax of the two biased logits.
    let c = cfg(ScoringFunc::Softmax, TopkMethod::Greedy, 2, true, 1.0);
    let r = twin_route(&c, &[0.0, 2.0, 1.0, -1.0], Some(&[3.0, 0.0, 0.0, 0.0]));
    assert_eq!(r.ids, vec![0, 1]);
    let e1 = (-1.0f32).exp();
    assert!((r.w[0] - 1.0 / (1.0 + e1)).abs() < 1e-6 && (r.w[1] - e1 / (1.0 + e1)).abs() < 1e-6, "{:?}", r.w);
}

// ---------------------------------------------------------------- validation (no device)

#[test]
fn validation_rejects_bad_configs() {
    let ok = cfg(ScoringFunc::Sigmoid, TopkMethod::NoauxTc { n_group: 8, topk_group: 4 }, 8, true, 2.5);
    let v =
        |e: usize, h: usize, wl: usize, bl: Option<usize>, c: RoutingRule| GpuRouter::validate("r", wl, e, h, bl, &c);
    assert!(v(256, 7, 256 * 7, Some(256), ok).is_ok());
    assert!(v(256, 7, 256 * 7, None, ok).is_ok(), "noaux_tc without a bias is allowed, as on the CPU");
    /// (rule, n_experts, hidden, weight length, bias length, expected text in the error)
    type Case = (RoutingRule, usize, usize, usize, Option<usize>, &'static str);
    let cases: Vec<Case> = vec![
        (RoutingRule { top_k: 0, ..ok }, 256, 7, 256 * 7, None, "top_k = 0"),
        (RoutingRule { top_k: 17, ..ok }, 256, 7, 256 * 7, None, "top_k = 17"),
        (RoutingRule { top_k: 9, topk: TopkMethod::Greedy, ..ok }, 8, 7, 8 * 7, None, "top_k = 9"),
        (ok, 0, 7, 0, None, "n_experts = 0"),
        (ok, ROUTER_MAX_EXPERTS + 8, 7, (ROUTER_MAX_EXPERTS + 8) * 7, None, "n_experts = 520"),
        (ok, 256, 0, 0, None, "hidden = 0"),
        (ok, 256, 7, 256 * 7 - 1, None, "gate weight has 1791"),
        (ok, 256, 7, 256 * 7, Some(255), "the router bias has 255"),
        (
            RoutingRule { topk: TopkMethod::NoauxTc { n_group: 3, topk_group: 1 }, ..ok },
            256,
            7,
            1792,
            None,
            "n_group = 3",
        ),
        (
            RoutingRule { topk: TopkMethod::GroupLimitedGreedy { n_group: 0, topk_group: 1 }, ..ok },
            256,
            7,
            1792,
            None,
            "n_group = 0",
        ),
        (
            RoutingRule { topk: TopkMethod::NoauxTc { n_group: 8, topk_group: 9 }, ..ok },
            256,
            7,
            1792,
            None,
            "topk_group = 9",
        ),
        (
            RoutingRule { topk: TopkMethod::NoauxTc { n_group: 8, topk_group: 0 }, ..ok },
            256,
            7,
            1792,
            None,
            "topk_group = 0",
        ),
        (
            RoutingRule { topk: TopkMethod::GroupLimitedGreedy { n_group: 64, topk_group: 2 }, top_k: 9, ..ok },
            256,
            7,
            1792,
            None,
            "exceeds the 8 experts",
        ),
        (RoutingRule { routed_scaling_factor: f32::NAN, ..ok }, 256, 7, 1792, None, "routed_scaling_factor"),
    ];
    for (c, e, h, wl, bl, want) in cases {
        let err = v(e, h, wl, bl, c).expect_err(want);
        let msg = err.to_string();
        assert!(matches!(err, GpuError::Shape { .. }) && msg.contains(want) && msg.contains("router r"), "{msg}");
    }
    assert_eq!(ROUTER_MAX_TOP_K, 16);
}

// ---------------------------------------------------------------- device tests

/// Values `k · 2^-exp` with small integer `k`: products and sums stay exact in f32.
fn exact_vals(r: &mut ChaCha8Rng, n: usize, kmax: i32, exp: i32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-kmax..=kmax) as f32 * 2f32.powi(-exp)).collect()
}

fn exact_logits(w: &[f32], x: &[f32], e: usize, h: usize, t: usize) -> Vec<f32> {
    let mut out = vec![0f32; t * e];
    for ti in 0..t {
        for ei in 0..e {
            let mut s = 0f64;
            for i in 0..h {
                s += w[ei * h + i] as f64 * x[ti * h + i] as f64;
            }
            assert_eq!(s as f32 as f64, s, "test data must give exact f32 logits");
            out[ti * e + ei] = s as f32;
        }
    }
    out
}

#[test]
fn router_matches_cpu_twin() {
    let Some(d) = gpu("router_matches_cpu_twin") else { return };
    let mut r = rng(11);
    let (mut tokens, mut skipped, mut cases) = (0usize, 0usize, 0usize);
    let shapes = [(8usize, 7usize), (16, 33), (60, 100), (64, 257), (128, 1029), (256, 64), (512, 129), (64, 2048)];
    for scoring in [ScoringFunc::Softmax, ScoringFunc::Sigmoid] {
        for method in 0..3 {
            for &(e, h) in &shapes {
                // 150 tokens: 19 tiles, so router_logits takes groups of experts.
                for &t in &[1usize, 3, 9, 64, 150] {
                    let divisors: Vec<usize> = (1..=e.min(64)).filter(|g| e % g == 0).collect();
                    let n_group = divisors[r.random_range(0..divisors.len())];
                    let topk_group = r.random_range(1..=n_group);
                    let topk = match method {
                        0 => TopkMethod::Greedy,
                        1 => TopkMethod::GroupLimitedGreedy { n_group, topk_group },
                        _ => TopkMethod::NoauxTc { n_group, topk_group },
                    };
                    let kept = if method == 0 { e } else { topk_group * (e / n_group) };
                    let top_k = r.random_range(1..=kept.min(ROUTER_MAX_TOP_K));
                    let c = cfg(scoring, topk, top_k, r.random_bool(0.5), [1.0, 2.5, 16.0][r.random_range(0..3)]);
                    // |w| ≤ 2^-s·1, |x| ≤ 1 in steps of 1/64: sums of h products stay exact.
                    let s = ((h as f64).sqrt().log2().floor() as i32 - 2).max(0);
                    let w = exact_vals(&mut r, e * h, 64, 6 + s);
                    let x = exact_vals(&mut r, t * h, 64, 6);
                    // A bias of either sign (a negative one makes the masked 0.0 win over kept
                    // experts): noaux_tc's correction bias, or the other methods' logit bias.
                    let bias: Option<Vec<f32>> = r.random_bool(if method == 2 { 0.8 } else { 0.5 }).then(|| {
                        let lo = if r.random_bool(0.5) { -128 } else { -16 };
                        (0..e).map(|_| r.random_range(lo..=16) as f32 / 256.0).collect()
                    });
                    let logits = exact_logits(&w, &x, e, h, t);
                    let router = GpuRouter::new(d, "test", &w, e, h, bias.as_deref(), c).unwrap();
                    let x_d = up(d, &x, "x");
                    let mut ids_d = up(d, &vec![-1i32; t * top_k], "ids");
                    let mut w_d = up(d, &vec![f32::NAN; t * top_k], "weights");
                    router.forward(d, &x_d, t, &mut ids_d, &mut w_d).unwrap();
                    // The hand-off form: the same routes and a copy of x in mapped host memory,
                    // then the flag, all from one launch (twice, so the counters' reset is used).
                    let (hx, hi, hw) = (
                        MappedHost::<f32>::new(d, t * h).unwrap(),
                        MappedHost::<i32>::new(d, t * top_k).unwrap(),
                        MappedHost::<f32>::new(d, t * top_k).unwrap(),
                    );
                    let flag = HostFlag::new(d).unwrap();
                    for seq in [cases as u64 * 2 + 1, cases as u64 * 2 + 2] {
                        let to = PublishTarget { x: Some(&hx), ids: &hi, weights: &hw, flag: &flag, seq };
                        router.publish(d, &x_d, t, &to).unwrap();
                        flag.spin_until_geq(d, seq).unwrap();
                        assert_eq!(flag.load(), seq, "the flag holds the last launch's number");
                    }
                    d.synchronize().unwrap();
                    // SAFETY: the stream is idle; the buffers hold t·h, t·k, t·k elements.
                    let (px, pi, pw) = unsafe {
                        (
                            std::slice::from_raw_parts(hx.host_ptr(), t * h).to_vec(),
                            std::slice::from_raw_parts(hi.host_ptr(), t * top_k).to_vec(),
                            std::slice::from_raw_parts(hw.host_ptr(), t * top_k).to_vec(),
                        )
                    };
                    assert_eq!(px, x, "published activations, E {e}, h {h}, t {t}");
                    let (ids, ws) = (down(d, &ids_d), down(d, &w_d));
                    cases += 1;
                    for (form, ids, ws) in [("forward", &ids, &ws), ("publish", &pi, &pw)] {
                        for ti in 0..t {
                            tokens += 1;
                            let want = twin_route(&c, &logits[ti * e..(ti + 1) * e], bias.as_deref());
                            if want.margin < 1e-6 {
                                skipped += 1;
                                continue;
                            }
                            let got: Vec<usize> =
                                ids[ti * top_k..(ti + 1) * top_k].iter().map(|&i| i as usize).collect();
                            assert_eq!(
                                got,
                                want.ids,
                                "{form}: ids, token {ti}, E {e}, h {h}, t {t}, {c:?}, bias {}",
                                bias.is_some()
                            );
                            for j in 0..top_k {
                                let (g, wv) = (ws[ti * top_k + j], want.w[j]);
                                assert!(
                                    (g - wv).abs() <= 1e-5 * wv.abs() + 1e-30,
                                    "{form}: weight {j}, token {ti}: got {g}, want {wv}; E {e}, h {h}, {c:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    eprintln!("router: {cases} cases, {tokens} tokens, {skipped} skipped for near-ties");
    assert!(skipped * 10 <= tokens, "too many near-ties skipped: {skipped} of {tokens}");
}

#[test]
fn router_rejects_bad_shapes_and_reuses_scratch() {
    let Some(d) = gpu("router_rejects_bad_shapes_and_reuses_scratch") else { return };
    let (e, h) = (16usize, 9usize);
    let c = cfg(ScoringFunc::Softmax, TopkMethod::Greedy, 4, true, 1.0);
    let mut r = rng(3);
    let w = exact_vals(&mut r, e * h, 64, 8);
    let router = GpuRouter::new(d, "shapes", &w, e, h, None, c).unwrap();
    let x_d = up(d, &exact_vals(&mut r, 3 * h, 64, 6), "x");
    let mut ids = up(d, &[0i32; 12], "ids");
    let mut wt = up(d, &[0f32; 12], "w");
    let err = router.forward(d, &x_d, 2, &mut ids, &mut wt).unwrap_err();
    assert!(matches!(err, GpuError::Shape { .. }) && err.to_string().contains("x has 27"), "{err}");
    let mut ids_small = up(d, &[0i32; 11], "ids");
    assert!(router.forward(d, &x_d, 3, &mut ids_small, &mut wt).is_err());
    assert!(GpuRouter::new(d, "bad", &w[1..], e, h, None, c).is_err());
    // t = 3, then t = 1 (scratch reused), then t = 3 again: same answers.
    router.forward(d, &x_d, 3, &mut ids, &mut wt).unwrap();
    let first = (down(d, &ids), down(d, &wt));
    let x1 = up(d, &down(d, &x_d)[..h], "x1");
    let (mut i1, mut w1) = (up(d, &[0i32; 4], "i1"), up(d, &[0f32; 4], "w1"));
    router.forward(d, &x1, 1, &mut i1, &mut w1).unwrap();
    assert_eq!(down(d, &i1), first.0[..4].to_vec());
    router.forward(d, &x_d, 3, &mut ids, &mut wt).unwrap();
    assert_eq!((down(d, &ids), down(d, &wt)), first);
}
