//! `GpuExperts` (grouped BF16 routed experts) against a scalar f64 twin: decode (t = 1), prefill
//! (t ≈ 100), duplicate experts across and within tokens, every token on one expert, ragged
//! shapes (hidden / inter not multiples of the kernel's 64-element chunk or 64-column tile),
//! several passes, out-of-range ids, and bitwise determinism. Every case runs through the default
//! path choice, then forced through the grouped path and the decode (GEMV-style) path, each
//! against the twin. Weights and x are pre-rounded to
//! BF16; outputs are poisoned with NaN before each launch.
//!
//! Without a GPU every test prints "SKIPPED: no GPU" (past the harness's capture) and passes;
//! with `KRASIS_REQUIRE_GPU=1` a missing GPU fails instead.

#![allow(clippy::needless_range_loop)] // the scalar twin is plain index loops on purpose

mod common;

use common::{
    assert_within, bf16_round, dot_est, down, gpu_gemm, poisoned_f32, rand_bf16_bits, rand_bf16_f32, rng,
    time_us_per_call, up, U,
};
use krasis_core::dtype::bf16_to_f32;
use krasis_gpu::moe::DECODE_MAX_PAIRS;
use krasis_gpu::{GemmContext, GpuDevice, GpuError, GpuExperts, VramBudgetSpec};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Tolerance in units of the rounding-error model of the twin (see `twin_moe`): each f32 dot
/// product is modelled as a random walk of `u·|S_j|` steps over its partial sums `S_j`, errors of
/// the intermediate are propagated through the down projection as independent (root sum of
/// squares), and the combine adds its own. 64× that estimate is loose enough for `expf` (≤ 2 ulp)
/// and FMA contraction, while a wrong expert, a dropped k chunk or a missing slot is off by
/// orders of magnitude more.
const TOL_SIGMAS: f64 = 64.0;

struct Expert {
    gate: Vec<u16>,
    up: Vec<u16>,
    down: Vec<u16>,
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// Bound, in units of `U` (2^-24), on what splitting each f32 activation into two BF16 halves
/// adds to a dot product per unit of `Σ |w · a|`: `|a − hi − lo| ≤ 2^-17 |a|` (the grouped
/// path's tensor-core tiles).
const SPLIT_ERR: f64 = 128.0;

/// f64 twin: (out [t, hidden], tolerance per element for f32 activations (the decode path),
/// tolerance per element for activations split into BF16 halves (the grouped path)). Tokens with
/// an id outside the experts give NaN rows.
fn twin_moe(
    experts: &[Expert],
    hidden: usize,
    inter: usize,
    x: &[f32],
    ids: &[i32],
    weights: &[f32],
    top_k: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let t = x.len() / hidden;
    let f = |v: &[u16]| -> Vec<f64> { v.iter().map(|&b| bf16_to_f32(b) as f64).collect() };
    let ew: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> = experts.iter().map(|e| (f(&e.gate), f(&e.up), f(&e.down))).collect();
    let abs_dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x * y).abs()).sum::<f64>();
    let mut out = vec![0f32; t * hidden];
    let mut tol = vec![0f32; t * hidden];
    let mut tol_split = vec![0f32; t * hidden];
    for tok in 0..t {
        let xt: Vec<f64> = x[tok * hidden..(tok + 1) * hidden].iter().map(|&v| v as f64).collect();
        if ids[tok * top_k..(tok + 1) * top_k].iter().any(|&e| e < 0 || e as usize >= experts.len()) {
            out[tok * hidden..(tok + 1) * hidden].fill(f32::NAN);
            continue;
        }
        // Per slot: y[h], its error estimate with f32 activations and what the split adds (in
        // units of u).
        let mut ys = Vec::new();
        for j in 0..top_k {
            let (g_w, u_w, d_w) = &ew[ids[tok * top_k + j] as usize];
            let mut act = vec![0f64; inter];
            let mut act_err = vec![0f64; inter];
            let mut act_split = vec![0f64; inter];
            for i in 0..inter {
                let (gr, ur) = (&g_w[i * hidden..(i + 1) * hidden], &u_w[i * hidden..(i + 1) * hidden]);
                let (g, eg) = dot_est(xt.iter().copied(), gr.iter().copied());
                let (u, eu) = dot_est(xt.iter().copied(), ur.iter().copied());
                act[i] = silu(g) * u;
                // |silu'| <= 1.1; 4u for expf, the division and the product.
                act_err[i] = 1.1 * u.abs() * eg + silu(g).abs() * eu + 4.0 * act[i].abs();
                act_split[i] =
                    SPLIT_ERR * (1.1 * u.abs() * abs_dot(&xt, gr) + silu(g).abs() * abs_dot(&xt, ur) + act[i].abs());
            }
            let mut y = vec![(0f64, 0f64, 0f64); hidden];
            for h in 0..hidden {
                let row = &d_w[h * inter..(h + 1) * inter];
                let (v, e_sum) = dot_est(act.iter().copied(), row.iter().copied());
                let e_prop: f64 = (0..inter).map(|i| (row[i] * act_err[i]).powi(2)).sum::<f64>().sqrt();
                let e_split: f64 = (0..inter).map(|i| (row[i] * act_split[i]).abs()).sum();
                y[h] = (v, e_sum + e_prop, e_split);
            }
            ys.push(y);
        }
        for h in 0..hidden {
            let (mut acc, mut ss, mut e, mut es) = (0f64, 0f64, 0f64, 0f64);
            for j in 0..top_k {
                let w = weights[tok * top_k + j] as f64;
                acc += w * ys[j][h].0;
                ss += acc * acc;
                e += w.abs() * ys[j][h].1;
                es += w.abs() * ys[j][h].2;
            }
            out[tok * hidden + h] = acc as f32;
            let base = e + ss.sqrt() + acc.abs();
            tol[tok * hidden + h] = (TOL_SIGMAS * U * base) as f32 + 1e-30;
            // The split's part is a bound, not an estimate: no sigmas on it, so a tile that
            // dropped the low halves (2^-9 per activation) is far outside.
            tol_split[tok * hidden + h] = (U * (TOL_SIGMAS * base + es)) as f32 + 1e-30;
        }
    }
    (out, tol, tol_split)
}

struct Case {
    name: &'static str,
    n_experts: usize,
    hidden: usize,
    inter: usize,
    top_k: usize,
    t: usize,
    /// Id pattern: random distinct per token, all on expert 0, or random with repeats.
    ids: Ids,
    pass_tokens: usize,
}

#[derive(Clone, Copy)]
enum Ids {
    Distinct,
    AllOne,
    Repeats,
    SomeBad,
}

fn make_ids(r: &mut ChaCha8Rng, c: &Case) -> Vec<i32> {
    let mut ids = Vec::with_capacity(c.t * c.top_k);
    for tok in 0..c.t {
        match c.ids {
            Ids::Distinct | Ids::SomeBad => {
                let mut row: Vec<i32> = Vec::new();
                while row.len() < c.top_k {
                    let e = r.random_range(0..c.n_experts as i32);
                    if !row.contains(&e) {
                        row.push(e);
                    }
                }
                ids.extend(row);
            }
            Ids::AllOne => ids.extend(std::iter::repeat_n(0, c.top_k)),
            Ids::Repeats => ids.extend((0..c.top_k).map(|_| r.random_range(0..c.n_experts as i32))),
        }
        if matches!(c.ids, Ids::SomeBad) && tok % 7 == 3 {
            let j = tok % c.top_k;
            ids[tok * c.top_k + j] = if tok % 2 == 0 { -1 } else { c.n_experts as i32 + tok as i32 };
        }
    }
    ids
}

/// Which path `GpuExperts::forward` is made to take.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    Default,
    Grouped,
    Decode,
}

/// Runs `c` through each path against the twin; returns whether the default choice took the
/// decode path for (the first pass of) the case.
fn run_case(d: &GpuDevice, ctx: &GemmContext, c: &Case, seed: u64) -> bool {
    let mut r = rng(seed);
    let (h, i) = (c.hidden, c.inter);
    let experts: Vec<Expert> = (0..c.n_experts)
        .map(|_| Expert {
            gate: rand_bf16_bits(&mut r, i * h, 2.0 / (h as f32).sqrt()),
            up: rand_bf16_bits(&mut r, i * h, 2.0 / (h as f32).sqrt()),
            down: rand_bf16_bits(&mut r, h * i, 2.0 / (i as f32).sqrt()),
        })
        .collect();
    let mut ge = GpuExperts::new(d, c.name, c.n_experts, h, i).unwrap();
    for (e, ex) in experts.iter().enumerate() {
        ge.upload_expert(d, e, &ex.gate, &ex.up, &ex.down).unwrap();
    }
    ge.set_max_tokens_per_pass(c.pass_tokens);
    assert!(ge.weight_bytes() >= c.n_experts * 3 * h * i * 2);
    let x = rand_bf16_f32(&mut r, c.t * h, 1.5);
    let ids = make_ids(&mut r, c);
    let weights: Vec<f32> = (0..c.t * c.top_k).map(|_| bf16_round(r.random_range(0.0f32..1.0))).collect();
    let (want, tol_f32, tol_split) = twin_moe(&experts, h, i, &x, &ids, &weights, c.top_k);

    let (x_d, ids_d, w_d) = (up(d, &x, "x"), up(d, &ids, "ids"), up(d, &weights, "weights"));
    let default_decode = ge.uses_decode_path(c.t.min(c.pass_tokens), c.top_k);
    for path in [Path::Default, Path::Grouped, Path::Decode] {
        match path {
            Path::Default => ge.set_decode_path_max_pairs(DECODE_MAX_PAIRS),
            Path::Grouped => ge.set_decode_path_max_pairs(0),
            Path::Decode => ge.set_decode_path_max_pairs(usize::MAX),
        }
        let name = format!("{} ({path:?} path)", c.name);
        let first_pass = c.t.min(c.pass_tokens);
        match path {
            Path::Grouped => assert!(!ge.uses_decode_path(first_pass, c.top_k), "{name}"),
            Path::Decode => assert!(ge.uses_decode_path(first_pass, c.top_k), "{name}"),
            Path::Default => {}
        }
        // The grouped path's tolerance covers the default too (its passes may take either path).
        let tol = if path == Path::Decode { &tol_f32 } else { &tol_split };
        let mut out = poisoned_f32(d, c.t * h);
        ge.forward(d, ctx, &x_d, c.t, &ids_d, &w_d, c.top_k, &mut out).unwrap();
        let got = down(d, &out);
        let worst = assert_within(&name, &got, &want, tol);
        // Deterministic: a second run (fresh poison) is bitwise identical.
        let mut again = poisoned_f32(d, c.t * h);
        ge.forward(d, ctx, &x_d, c.t, &ids_d, &w_d, c.top_k, &mut again).unwrap();
        let got2 = down(d, &again);
        assert!(got.iter().zip(&got2).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: not deterministic");
        eprintln!(
            "moe {name}: E={} hidden={h} inter={i} top_k={} t={}: worst err/tol {worst:.3}",
            c.n_experts, c.top_k, c.t
        );
    }
    default_decode
}

#[test]
fn moe_matches_twin() {
    let Some((d, ctx)) = gpu_gemm("moe_matches_twin") else { return };
    let m = usize::MAX;
    let cases = [
        Case {
            name: "decode",
            n_experts: 16,
            hidden: 128,
            inter: 64,
            top_k: 4,
            t: 1,
            ids: Ids::Distinct,
            pass_tokens: m,
        },
        Case {
            name: "decode ragged",
            n_experts: 9,
            hidden: 200,
            inter: 77,
            top_k: 3,
            t: 1,
            ids: Ids::Distinct,
            pass_tokens: m,
        },
        Case {
            name: "eight tokens at the threshold",
            n_experts: 32,
            hidden: 192,
            inter: 96,
            top_k: 8,
            t: 8,
            ids: Ids::Distinct,
            pass_tokens: m,
        },
        Case {
            name: "decode long rows",
            n_experts: 3,
            hidden: 4133,
            inter: 4111,
            top_k: 2,
            t: 1,
            ids: Ids::Repeats,
            pass_tokens: m,
        },
        Case {
            name: "decode bad ids",
            n_experts: 10,
            hidden: 64,
            inter: 32,
            top_k: 4,
            t: 8,
            ids: Ids::SomeBad,
            pass_tokens: 1,
        },
        Case { name: "tiny", n_experts: 5, hidden: 7, inter: 3, top_k: 3, t: 17, ids: Ids::Repeats, pass_tokens: m },
        Case {
            name: "prefill",
            n_experts: 64,
            hidden: 256,
            inter: 96,
            top_k: 8,
            t: 100,
            ids: Ids::Distinct,
            pass_tokens: m,
        },
        Case {
            name: "prefill ragged",
            n_experts: 6,
            hidden: 257,
            inter: 70,
            top_k: 2,
            t: 99,
            ids: Ids::Repeats,
            pass_tokens: m,
        },
        Case {
            name: "all on one expert",
            n_experts: 8,
            hidden: 130,
            inter: 40,
            top_k: 4,
            t: 64,
            ids: Ids::AllOne,
            pass_tokens: m,
        },
        Case {
            name: "three passes",
            n_experts: 12,
            hidden: 96,
            inter: 33,
            top_k: 2,
            t: 101,
            ids: Ids::Distinct,
            pass_tokens: 40,
        },
        Case {
            name: "bad ids",
            n_experts: 10,
            hidden: 64,
            inter: 32,
            top_k: 4,
            t: 30,
            ids: Ids::SomeBad,
            pass_tokens: 8,
        },
    ];
    // Decode-sized cases (at most DECODE_MAX_PAIRS pairs per pass) must take the decode path by
    // default, the rest the grouped one.
    let decode_by_default = [
        "decode",
        "decode ragged",
        "eight tokens at the threshold",
        "decode long rows",
        "decode bad ids",
        "tiny",
        "bad ids",
    ];
    for (k, c) in cases.iter().enumerate() {
        let took_decode = run_case(d, ctx, c, 100 + k as u64);
        assert_eq!(took_decode, decode_by_default.contains(&c.name), "{}: default path", c.name);
    }
}

#[test]
fn moe_shape_errors() {
    let Some((d, ctx)) = gpu_gemm("moe_shape_errors") else { return };
    let mut ge = GpuExperts::new(d, "layer 3 experts", 4, 8, 4).unwrap();
    let e = ge.upload_expert(d, 4, &[0; 32], &[0; 32], &[0; 32]).unwrap_err();
    assert!(matches!(e, GpuError::Shape { .. }) && e.to_string().contains("expert 4 of 4"), "{e}");
    let e = ge.upload_expert(d, 0, &[0; 32], &[0; 31], &[0; 32]).unwrap_err();
    assert!(e.to_string().contains("up has 31"), "{e}");
    let (x, ids, w) = (up(d, &[0.0f32; 16], "x"), up(d, &[0i32; 4], "ids"), up(d, &[0.0f32; 4], "w"));
    let mut out = up(d, &[0.0f32; 16], "out");
    let e = ge.forward(d, ctx, &x, 2, &ids, &w, 3, &mut out).unwrap_err();
    assert!(e.to_string().contains("ids has 4"), "{e}");
    let e = ge.forward(d, ctx, &x, 2, &ids, &w, 0, &mut out).unwrap_err();
    assert!(e.to_string().contains("top_k = 0"), "{e}");
    assert!(GpuExperts::new(d, "none", 0, 8, 4).is_err());
    // Over the budget: a clean budget error naming the layer.
    let small = GpuDevice::open(d.info().ordinal, VramBudgetSpec::Bytes(16 << 20)).unwrap();
    let e = GpuExperts::new(&small, "layer 7 experts", 64, 1024, 512).unwrap_err();
    assert!(matches!(e, GpuError::VramBudget { .. }) && e.to_string().contains("layer 7 experts"), "{e:?}");
}

/// Timings for the lead (printed; asserts only that the runs complete): a Qwen3-30B-A3B-like
/// layer (128 experts, hidden 2048, inter 768, top-8), each small t through both paths.
#[test]
fn moe_timings() {
    let Some((d, ctx)) = gpu_gemm("moe_timings") else { return };
    let (e, h, i, k) = (128usize, 2048usize, 768usize, 8usize);
    let mut r = rng(7);
    let mut ge = GpuExperts::new(d, "timed experts", e, h, i).unwrap();
    let w = rand_bf16_bits(&mut r, i * h, 0.05);
    for x in 0..e {
        ge.upload_expert(d, x, &w, &w, &w).unwrap();
    }
    for t in [1usize, 2, 4, 8, 16, 32, 512] {
        let x = up(d, &vec![0.5f32; t * h], "x");
        let ids: Vec<i32> = (0..t * k).map(|_| r.random_range(0..e as i32)).collect();
        let ids = up(d, &ids, "ids");
        let wts = up(d, &vec![0.125f32; t * k], "weights");
        let mut out = d.alloc_zeros::<f32>(t * h, "out").unwrap();
        let paths: &[(&str, usize)] =
            if t * k <= 256 { &[("grouped", 0), ("decode", usize::MAX)] } else { &[("grouped", 0)] };
        for &(path, max_pairs) in paths {
            ge.set_decode_path_max_pairs(max_pairs);
            ge.forward(d, ctx, &x, t, &ids, &wts, k, &mut out).unwrap();
            let us = time_us_per_call(d, 20, || ge.forward(d, ctx, &x, t, &ids, &wts, k, &mut out).unwrap());
            let touched = (t * k).min(e) * 3 * h * i * 2;
            eprintln!(
                "moe E={e} h={h} i={i} top{k} t={t} {path}: {us:.1} us, ≥{:.0} GB/s of expert weights",
                touched as f64 / (us * 1e-6) / 1e9
            );
        }
    }
}
