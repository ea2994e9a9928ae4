//! The routed experts' options (gpt-oss): gate, up and down biases and the clamped SwiGLU, in
//! every weight format (BF16, INT4, INT8) and path (the default choice, the grouped tiles of every
//! compiled shape, the decode path), against an f64 twin over the same weights (the BF16 values,
//! or the quantised `q · scale`) with the biases and the activation written out again here.
//!
//! Tolerance: a bound relative to the magnitude of every term that reaches an output (`scale` of
//! [`twin`]: the gate and up sums' terms and biases through the activation's slope, then the down
//! products and bias, then the routing weights): [`REL_BF16`] for BF16 weights (f32 sums, the
//! grouped path's activations as two BF16 halves, 2^-17 each), [`REL_QUANT`] for INT4/INT8 (the
//! activations quantised per group into a value and a residual INT8 row, ~2^-16 of a group's
//! largest value, and the intermediate again). A dropped or misplaced bias, a bias of the wrong
//! expert or the plain SiLU in place of the clamped SwiGLU moves outputs by a sizeable fraction of
//! that scale: the biases are of the size of the sums, and the clamp's limit is inside their range.
//!
//! Without a GPU every test prints "SKIPPED: no GPU" and passes; with `KRASIS_REQUIRE_GPU=1` a
//! missing GPU fails instead.

#![allow(clippy::needless_range_loop)] // the twin is plain index loops on purpose

mod common;

use common::{
    assert_within, bf16_round, down, gpu_gemm, poisoned_f32, rand_bf16_bits, rand_bf16_f32, rand_f32, rng, up,
};
use krasis_core::dtype::bf16_to_f32;
use krasis_core::spec::ExpertActivation;
use krasis_gpu::moe::DECODE_MAX_PAIRS;
use krasis_gpu::{GemmContext, GpuDevice, GpuError, GpuExperts};
use krasis_quant::group::{group_size_for, quantize, DEFAULT_GROUP_SIZE};
use krasis_quant::{Bits, QuantizedMatrix};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Tolerance relative to the twin's scale for BF16 weights.
const REL_BF16: f64 = 1e-4;
/// Tolerance relative to the twin's scale for INT4/INT8 weights (activation quantising).
const REL_QUANT: f64 = 2e-3;

/// gpt-oss's activation with a limit inside the sums' range (they are about ±2 here), so the
/// clamps bite on both sides.
const CLAMPED: ExpertActivation = ExpertActivation::ClampedSwiglu { alpha: 1.702, limit: 1.0 };

/// One expert's weights as the kernels compute with them: gate and up `[inter, hidden]`, down
/// `[hidden, inter]`, row-major.
struct Dense {
    gate: Vec<f64>,
    up: Vec<f64>,
    down: Vec<f64>,
}

/// The activation of `g` and `u`, and bounds on its slope in `g` and in `u` (near that point).
fn act(a: ExpertActivation, g: f64, u: f64) -> (f64, f64, f64) {
    let sig = |z: f64| 1.0 / (1.0 + (-z).exp());
    match a {
        ExpertActivation::Silu => {
            let s = g * sig(g);
            (s * u, 1.1 * u.abs(), s.abs())
        }
        ExpertActivation::ClampedSwiglu { alpha, limit } => {
            let (alpha, limit) = (alpha as f64, limit as f64);
            let gc = g.min(limit);
            let uc = u.clamp(-limit, limit);
            let s = gc * sig(alpha * gc);
            ((uc + 1.0) * s, 1.1 * (uc + 1.0).abs(), s.abs())
        }
    }
}

/// The layer's biases: per expert `[gate | up]` (`2 · inter`) and down (`hidden`), flattened as
/// [`GpuExperts::set_biases`] takes them.
struct Biases {
    gate_up: Vec<f32>,
    down: Vec<f32>,
}

/// f64 twin: (out `[t, hidden]`, the scale of each output: the sum of the magnitudes of the terms
/// that reach it, each through the slopes that follow it).
#[allow(clippy::too_many_arguments)]
fn twin(
    experts: &[Dense],
    b: Option<&Biases>,
    a: ExpertActivation,
    hidden: usize,
    inter: usize,
    x: &[f32],
    ids: &[i32],
    weights: &[f32],
    top_k: usize,
) -> (Vec<f32>, Vec<f64>) {
    let t = x.len() / hidden;
    let mut out = vec![0f32; t * hidden];
    let mut scale = vec![0f64; t * hidden];
    for tok in 0..t {
        let xt = &x[tok * hidden..(tok + 1) * hidden];
        let mut acc = vec![0f64; hidden];
        for j in 0..top_k {
            let e = ids[tok * top_k + j] as usize;
            let w = weights[tok * top_k + j] as f64;
            let ex = &experts[e];
            let (mut act_v, mut act_m) = (vec![0f64; inter], vec![0f64; inter]);
            for i in 0..inter {
                let (gr, ur) = (&ex.gate[i * hidden..(i + 1) * hidden], &ex.up[i * hidden..(i + 1) * hidden]);
                let (mut g, mut u, mut gm, mut um) = (0f64, 0f64, 0f64, 0f64);
                for k in 0..hidden {
                    g += gr[k] * xt[k] as f64;
                    u += ur[k] * xt[k] as f64;
                    gm += (gr[k] * xt[k] as f64).abs();
                    um += (ur[k] * xt[k] as f64).abs();
                }
                if let Some(b) = b {
                    let (bg, bu) = (b.gate_up[e * 2 * inter + i] as f64, b.gate_up[e * 2 * inter + inter + i] as f64);
                    g += bg;
                    u += bu;
                    gm += bg.abs();
                    um += bu.abs();
                }
                let (v, dg, du) = act(a, g, u);
                act_v[i] = v;
                act_m[i] = v.abs() + dg * gm + du * um;
            }
            for h in 0..hidden {
                let row = &ex.down[h * inter..(h + 1) * inter];
                let (mut y, mut m) = (0f64, 0f64);
                for i in 0..inter {
                    y += row[i] * act_v[i];
                    m += row[i].abs() * act_m[i];
                }
                if let Some(b) = b {
                    let bd = b.down[e * hidden + h] as f64;
                    y += bd;
                    m += bd.abs();
                }
                acc[h] += w * y;
                scale[tok * hidden + h] += w.abs() * m;
            }
        }
        for h in 0..hidden {
            out[tok * hidden + h] = acc[h] as f32;
        }
    }
    (out, scale)
}

#[derive(Clone, Copy)]
struct Case {
    name: &'static str,
    n_experts: usize,
    hidden: usize,
    inter: usize,
    top_k: usize,
    t: usize,
    pass_tokens: usize,
}

/// Distinct random experts per token.
fn make_ids(r: &mut ChaCha8Rng, c: &Case) -> Vec<i32> {
    let mut ids = Vec::with_capacity(c.t * c.top_k);
    for _ in 0..c.t {
        let mut row: Vec<i32> = Vec::new();
        while row.len() < c.top_k {
            let e = r.random_range(0..c.n_experts as i32);
            if !row.contains(&e) {
                row.push(e);
            }
        }
        ids.extend(row);
    }
    ids
}

fn quantized(r: &mut ChaCha8Rng, rows: usize, k: usize, bits: Bits) -> QuantizedMatrix {
    let w = rand_f32(r, rows * k, 2.0 / (k as f32).sqrt());
    quantize(&w, rows, k, bits, group_size_for(k, DEFAULT_GROUP_SIZE).unwrap())
}

/// The weights `q · scale` (exact), row-major.
fn kernel_weights(m: &QuantizedMatrix) -> Vec<f64> {
    let mut out = Vec::with_capacity(m.rows * m.k);
    for r in 0..m.rows {
        for c in 0..m.k {
            out.push((m.q[r * m.k + c] as f32 * m.scale(r, c / m.gs)) as f64);
        }
    }
    out
}

/// The layer's experts on the GPU in `bits` (`None`: BF16) and as the twin sees them.
fn experts(d: &GpuDevice, r: &mut ChaCha8Rng, c: &Case, bits: Option<Bits>) -> (GpuExperts, Vec<Dense>) {
    let (h, i) = (c.hidden, c.inter);
    let mut dense = Vec::new();
    let ge = match bits {
        None => {
            let mut ge = GpuExperts::new(d, c.name, c.n_experts, h, i).unwrap();
            let f = |v: &[u16]| -> Vec<f64> { v.iter().map(|&b| bf16_to_f32(b) as f64).collect() };
            for e in 0..c.n_experts {
                let g = rand_bf16_bits(r, i * h, 2.0 / (h as f32).sqrt());
                let u = rand_bf16_bits(r, i * h, 2.0 / (h as f32).sqrt());
                let dn = rand_bf16_bits(r, h * i, 2.0 / (i as f32).sqrt());
                ge.upload_expert(d, e, &g, &u, &dn).unwrap();
                dense.push(Dense { gate: f(&g), up: f(&u), down: f(&dn) });
            }
            ge
        }
        Some(bits) => {
            let q: Vec<[QuantizedMatrix; 3]> = (0..c.n_experts)
                .map(|_| [quantized(r, i, h, bits), quantized(r, i, h, bits), quantized(r, h, i, bits)])
                .collect();
            let mut ge = GpuExperts::new_quantized(d, c.name, c.n_experts, h, i, bits, q[0][0].gs, q[0][2].gs).unwrap();
            for (e, [g, u, dn]) in q.iter().enumerate() {
                ge.upload_quantized_expert(d, e, g, u, dn).unwrap();
                dense.push(Dense { gate: kernel_weights(g), up: kernel_weights(u), down: kernel_weights(dn) });
            }
            ge
        }
    };
    (ge, dense)
}

/// Every (biases, activation) combination of `c` in `bits` through every path, against the twin.
fn run_case(d: &GpuDevice, ctx: &GemmContext, c: &Case, bits: Option<Bits>, seed: u64) {
    let mut r = rng(seed);
    let (h, i) = (c.hidden, c.inter);
    let (mut ge, dense) = experts(d, &mut r, c, bits);
    ge.set_max_tokens_per_pass(c.pass_tokens);
    let biases = Biases {
        gate_up: rand_bf16_f32(&mut r, c.n_experts * 2 * i, 1.0),
        down: rand_bf16_f32(&mut r, c.n_experts * h, 1.0),
    };
    let x = rand_bf16_f32(&mut r, c.t * h, 1.5);
    let ids = make_ids(&mut r, c);
    let weights: Vec<f32> = (0..c.t * c.top_k).map(|_| bf16_round(r.random_range(0.0f32..1.0))).collect();
    let (x_d, ids_d, w_d) = (up(d, &x, "x"), up(d, &ids, "ids"), up(d, &weights, "weights"));
    let rel = if bits.is_some() { REL_QUANT } else { REL_BF16 };
    let mut paths = vec![("default".to_string(), DECODE_MAX_PAIRS, 0)];
    let variants = if bits.is_some() { GpuExperts::TILE_VARIANTS } else { 1 };
    paths.extend((0..variants).map(|v| (format!("grouped v{v}"), 0, v)));
    paths.push(("decode".to_string(), usize::MAX, 0));
    // Without biases first: once set, a layer keeps them.
    for (with_biases, a) in [(false, CLAMPED), (true, ExpertActivation::Silu), (true, CLAMPED)] {
        if with_biases {
            ge.set_biases(d, &biases.gate_up, &biases.down).unwrap();
            assert!(ge.has_biases());
        }
        ge.set_activation(a);
        let (want, scale) = twin(&dense, with_biases.then_some(&biases), a, h, i, &x, &ids, &weights, c.top_k);
        let tol: Vec<f32> = scale.iter().map(|&s| (rel * s) as f32 + 1e-30).collect();
        for (path, max_pairs, variant) in &paths {
            ge.set_decode_path_max_pairs(*max_pairs);
            if bits.is_some() {
                ge.set_tile_variant(*variant);
            }
            let name = format!("{} ({bits:?}, {path} path, biases {with_biases}, {a:?})", c.name);
            let mut out = poisoned_f32(d, c.t * h);
            ge.forward(d, ctx, &x_d, c.t, &ids_d, &w_d, c.top_k, &mut out).unwrap();
            let worst = assert_within(&name, &down(d, &out), &want, &tol);
            eprintln!("moe options {name}: worst err/tol {worst:.3}");
        }
    }
}

#[test]
fn moe_biases_and_clamped_swiglu_match_twin() {
    let Some((d, ctx)) = gpu_gemm("moe_biases_and_clamped_swiglu_match_twin") else { return };
    let m = usize::MAX;
    #[rustfmt::skip]
    let cases = [
        Case { name: "decode", n_experts: 16, hidden: 128, inter: 64, top_k: 4, t: 1, pass_tokens: m },
        Case { name: "decode ragged", n_experts: 9, hidden: 160, inter: 96, top_k: 3, t: 1, pass_tokens: m },
        Case { name: "prefill", n_experts: 32, hidden: 256, inter: 192, top_k: 4, t: 100, pass_tokens: m },
        Case { name: "prefill ragged", n_experts: 6, hidden: 224, inter: 96, top_k: 2, t: 99, pass_tokens: m },
        Case { name: "three passes", n_experts: 12, hidden: 96, inter: 160, top_k: 2, t: 101, pass_tokens: 40 },
    ];
    for (n, c) in cases.iter().enumerate() {
        for (b, bits) in [None, Some(Bits::Int4), Some(Bits::Int8)].into_iter().enumerate() {
            run_case(d, ctx, c, bits, 100 + 10 * n as u64 + b as u64);
        }
    }
    // BF16 rows that are not multiples of the kernels' 64-element chunks.
    let ragged =
        Case { name: "bf16 ragged rows", n_experts: 5, hidden: 200, inter: 77, top_k: 3, t: 17, pass_tokens: m };
    run_case(d, ctx, &ragged, None, 99);
}

/// The twin's activation on known values (runs without a GPU): the clamps, and SiLU.
#[test]
fn twin_activation_has_known_values() {
    let (v, _, _) = act(CLAMPED, 3.0, -5.0); // g clamped to 1, u to -1: (−1 + 1)·…
    assert_eq!(v, 0.0);
    let (v, _, _) = act(CLAMPED, 3.0, 0.5);
    let want = 1.5 * (1.0 / (1.0 + (-1.702f64).exp()));
    assert!((v - want).abs() < 1e-6, "{v} vs {want}");
    let (v, _, _) = act(ExpertActivation::Silu, 0.0, 7.0);
    assert_eq!(v, 0.0);
    // The twin agrees with krasis-core's scalar rule (the CPU experts').
    for (g, u) in [(-4.0f32, 0.3f32), (0.2, 2.0), (1.5, -0.7), (-0.1, -3.0)] {
        for a in [ExpertActivation::Silu, CLAMPED] {
            let (v, _, _) = act(a, g as f64, u as f64);
            assert!((v - a.apply(g, u) as f64).abs() < 1e-6, "{a:?} {g} {u}");
        }
    }
}

#[test]
fn biases_of_the_wrong_shape_are_errors() {
    let Some((d, _)) = gpu_gemm("biases_of_the_wrong_shape_are_errors") else { return };
    let mut ge = GpuExperts::new(d, "layer 3 experts", 4, 64, 32).unwrap();
    let e = ge.set_biases(d, &[0.0; 4 * 2 * 32 - 1], &[0.0; 4 * 64]).unwrap_err();
    assert!(matches!(e, GpuError::Shape { .. }) && e.to_string().contains("gate/up biases have 255"), "{e}");
    let e = ge.set_biases(d, &[0.0; 4 * 2 * 32], &[0.0; 64]).unwrap_err();
    assert!(e.to_string().contains("down biases have 64"), "{e}");
    assert!(!ge.has_biases());
}
