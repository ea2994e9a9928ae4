//! `GpuExperts` with INT4 / INT8 weights in the GPU tile layout against a scalar f64 twin of the
//! arithmetic both paths (tiles and decode) share with the CPU's expert kernels: activations
//! quantised per weight group into a value and a residual INT8 row (the CPU quantiser's steps,
//! written out again here), exact integer sums with the stored q, scaled per group. The twin
//! quantises x the same way (so the sums are exactly the kernel's) and the intermediate from its
//! own value. What it cannot predict (f32 accumulation order, the kernel's intermediate
//! quantising to a neighbour of the twin's) is bounded, not estimated, so a dropped k chunk, a
//! wrong scale group, a swapped nibble or a wrong panel is far outside. Cases: decode (t = 1),
//! prefill, ragged shapes (rows and K not multiples of the 64-row panels or 64-k chunks, group
//! sizes 32 / 64 / 128), the second down panel past the matrix, several passes, one expert for
//! every token, out-of-range ids, and bitwise determinism; each through the default path, the
//! tiles (every compiled shape) and the decode path. The FP4 formats (MXFP4, NVFP4 kept as
//! stored: E2M1 codes, groups of 32 / 16) go through the same cases against the same twin, whose
//! weights are then the kernels' exact `2·E2M1 · (s · f)`.
//!
//! Without a GPU every test prints "SKIPPED: no GPU" and passes; with `KRASIS_REQUIRE_GPU=1` a
//! missing GPU fails instead.

#![allow(clippy::needless_range_loop)] // the scalar twin is plain index loops on purpose

mod common;

use common::{assert_within, bf16_round, down, gpu_gemm, poisoned_f32, rand_bf16_f32, rand_f32, rng, up, U};
use krasis_gpu::moe::DECODE_MAX_PAIRS;
use krasis_gpu::{GemmContext, GpuDevice, GpuError, GpuExperts};
use krasis_quant::fp4::{self, Fp4Kind, Fp4Matrix};
use krasis_quant::group::{group_size_for, quantize, DEFAULT_GROUP_SIZE};
use krasis_quant::{Bits, QuantizedMatrix};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

struct Expert {
    gate: QuantizedMatrix,
    up: QuantizedMatrix,
    down: QuantizedMatrix,
}

/// One activation group as the CPU quantises it (krasis-cpu quant/actq.rs): q =
/// round-half-even(clamp(x · (127 / amax))), scale amax / 127, each an f32 operation.
fn quant_group(xg: &[f32]) -> (Vec<i32>, f32) {
    let amax = xg.iter().fold(0f32, |a, v| a.max(v.abs()));
    if amax == 0.0 {
        return (vec![0; xg.len()], 0.0);
    }
    let inv = 127.0 / amax;
    (xg.iter().map(|&v| (v * inv).clamp(-127.0, 127.0).round_ties_even() as i32).collect(), amax / 127.0)
}

/// `x` (a row of `k`) in groups of `gs` as the tiles see it: per element the value part and the
/// residual part (q · s each, exact in f64), and per group the bound on how far a value within
/// `slack` of x can quantise from it (both parts' half steps plus the value step it may cross).
fn quant_row(x: &[f32], gs: usize) -> (Vec<[f64; 2]>, Vec<f64>) {
    let (mut parts, mut step) = (Vec::with_capacity(x.len()), Vec::new());
    for xg in x.chunks(gs) {
        let (qh, sh) = quant_group(xg);
        let resid: Vec<f32> = xg.iter().zip(&qh).map(|(&v, &q)| v - q as f32 * sh).collect();
        let (ql, sl) = quant_group(&resid);
        parts.extend(qh.iter().zip(&ql).map(|(&h, &l)| [h as f64 * sh as f64, l as f64 * sl as f64]));
        step.push(sh as f64 / 127.0 + sl as f64);
    }
    (parts, step)
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

/// An FP4 matrix's weights as the kernels multiply them: `2·E2M1(code) · (s · f)` with the
/// layout's f32 scale (exact in f64), row-major.
fn fp4_kernel_weights(m: &Fp4Matrix) -> Vec<f64> {
    let f = m.row_factor();
    let mut out = Vec::with_capacity(m.rows * m.k);
    for r in 0..m.rows {
        for c in 0..m.k {
            let s = fp4::kernel_scale(m.kind, m.scale_byte(r, c / m.kind.group())) * f;
            out.push(fp4::E2M1_X2[m.code(r, c) as usize] as f64 * s as f64);
        }
    }
    out
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// f64 twin over the experts' exact kernel weights `ew` (gate, up, down) in groups of `gs13`
/// along hidden and `gs2` along inter: (out [t, hidden], tolerance per element); tokens with a bad
/// id give NaN rows.
#[allow(clippy::too_many_arguments)]
fn twin(
    ew: &[[Vec<f64>; 3]],
    (gs13, gs2): (usize, usize),
    hidden: usize,
    inter: usize,
    x: &[f32],
    ids: &[i32],
    weights: &[f32],
    top_k: usize,
) -> (Vec<f32>, Vec<f32>) {
    let t = x.len() / hidden;
    let (mut out, mut tol) = (vec![0f32; t * hidden], vec![0f32; t * hidden]);
    // f32 accumulation over n terms: at most n·u·Σ|terms| (a hard bound, loose on purpose).
    let acc_bound = |n: usize, abs: f64| (n as f64 + 4.0) * U * abs;
    // The sum of row · a, Σ|terms| and the number of f32 roundings the kernel makes: each
    // group's value and residual sums are exact integers, added with a few roundings per k32
    // step at most (the decode path adds every step).
    let dot = |row: &[f64], a: &[[f64; 2]], k: usize| {
        let v: f64 = row.iter().zip(a).map(|(w, p)| w * (p[0] + p[1])).sum();
        let abs: f64 = row.iter().zip(a).map(|(w, p)| (w * p[0]).abs() + (w * p[1]).abs()).sum();
        (v, abs, 3 * k.div_ceil(32) + 4)
    };
    for tok in 0..t {
        let xrow = &x[tok * hidden..(tok + 1) * hidden];
        let xt = quant_row(xrow, gs13).0;
        if ids[tok * top_k..(tok + 1) * top_k].iter().any(|&e| e < 0 || e as usize >= ew.len()) {
            out[tok * hidden..(tok + 1) * hidden].fill(f32::NAN);
            continue;
        }
        let mut ys = Vec::new();
        for j in 0..top_k {
            let [g_w, u_w, d_w] = &ew[ids[tok * top_k + j] as usize];
            let (mut act, mut act_err) = (vec![[0f64; 2]; inter], vec![0f64; inter]);
            let mut act_f32 = vec![0f32; inter];
            for i in 0..inter {
                let (g, abs_g, ng) = dot(&g_w[i * hidden..(i + 1) * hidden], &xt, hidden);
                let (u, abs_u, nu) = dot(&u_w[i * hidden..(i + 1) * hidden], &xt, hidden);
                let (eg, eu) = (acc_bound(ng, abs_g), acc_bound(nu, abs_u));
                let a = silu(g) * u;
                act_f32[i] = a as f32;
                // The kernel's f32 value: within the accumulation bounds, expf a few ulp.
                act_err[i] = 1.1 * u.abs() * eg + silu(g).abs() * eu + 8.0 * U * a.abs();
            }
            // The twin's intermediate quantised; the kernel's, within act_err of it, may quantise
            // to neighbours: at most its distance plus one step of each part.
            let (parts, step) = quant_row(&act_f32, gs2);
            act.copy_from_slice(&parts);
            for (i, e) in act_err.iter_mut().enumerate() {
                *e += step[i / gs2];
            }
            let mut y = vec![(0f64, 0f64); hidden];
            for h in 0..hidden {
                let row = &d_w[h * inter..(h + 1) * inter];
                let (v, abs, n) = dot(row, &act, inter);
                let prop: f64 = row.iter().zip(&act_err).map(|(a, e)| a.abs() * e).sum();
                y[h] = (v, prop + acc_bound(n, abs));
            }
            ys.push(y);
        }
        for h in 0..hidden {
            let (mut acc, mut e, mut abs) = (0f64, 0f64, 0f64);
            for j in 0..top_k {
                let w = weights[tok * top_k + j] as f64;
                acc += w * ys[j][h].0;
                e += w.abs() * ys[j][h].1;
                abs += (w * ys[j][h].0).abs();
            }
            out[tok * hidden + h] = acc as f32;
            tol[tok * hidden + h] = (e + acc_bound(top_k, abs) + U * acc.abs()) as f32 + 1e-30;
        }
    }
    (out, tol)
}

struct Case {
    name: &'static str,
    n_experts: usize,
    hidden: usize,
    inter: usize,
    top_k: usize,
    t: usize,
    /// Pattern of ids: 0 distinct per token, 1 all on expert 0, 2 with repeats, 3 some bad.
    ids: u8,
    pass_tokens: usize,
}

fn make_ids(r: &mut ChaCha8Rng, c: &Case) -> Vec<i32> {
    let mut ids = Vec::with_capacity(c.t * c.top_k);
    for tok in 0..c.t {
        let mut row: Vec<i32> = Vec::new();
        while row.len() < c.top_k {
            let e = match c.ids {
                1 => 0,
                _ => r.random_range(0..c.n_experts as i32),
            };
            if c.ids != 0 && c.ids != 3 || !row.contains(&e) {
                row.push(e);
            }
        }
        if c.ids == 3 && tok % 7 == 3 {
            row[tok % c.top_k] = if tok % 2 == 0 { -1 } else { c.n_experts as i32 + tok as i32 };
        }
        ids.extend(row);
    }
    ids
}

fn quantized(r: &mut ChaCha8Rng, rows: usize, k: usize, bits: Bits) -> QuantizedMatrix {
    let mut w = rand_f32(r, rows * k, 2.0 / (k as f32).sqrt());
    // A few outliers so that groups differ in scale.
    for _ in 0..rows.max(1) {
        let i = r.random_range(0..w.len());
        w[i] *= 6.0;
    }
    quantize(&w, rows, k, bits, group_size_for(k, DEFAULT_GROUP_SIZE).unwrap())
}

/// `n` experts of `ge`'s layout as GPU expert cache records in place (`record(e)`: expert e's
/// record): laid out as the cache lays a layer (w2's part at a 64-byte boundary, records 4 KiB
/// apart), copied in two runs.
fn records_copy(d: &GpuDevice, ge: &GpuExperts, n: usize, record: &dyn Fn(usize) -> Vec<u8>) -> GpuExperts {
    let layout = ge.quant_layout().unwrap();
    let (p13, p2) = layout.record_parts();
    let w2_offset = p13.div_ceil(64) * 64;
    let stride = (w2_offset + p2).div_ceil(4096) * 4096;
    let mut host = vec![0u8; n * stride];
    for e in 0..n {
        let rec = record(e);
        host[e * stride..][..p13].copy_from_slice(&rec[..p13]);
        host[e * stride + w2_offset..][..p2].copy_from_slice(&rec[p13..]);
    }
    let mut gr = GpuExperts::new_records_with_layout(d, &layout, n, n, (stride, w2_offset)).unwrap();
    let mid = n / 2;
    for run in [0..mid, mid..n] {
        let src = &host[run.start * stride..run.end * stride];
        // SAFETY: pageable host memory is a valid source (the driver stages it); it outlives the
        // synchronisation below, and nothing else touches `gr` meanwhile.
        unsafe { gr.copy_record_run_async(d.stream(), run, src) }.unwrap();
    }
    d.stream().synchronize().unwrap();
    gr
}

fn run_case(d: &GpuDevice, ctx: &GemmContext, c: &Case, bits: Bits, seed: u64) {
    let mut r = rng(seed);
    let (h, i) = (c.hidden, c.inter);
    let experts: Vec<Expert> = (0..c.n_experts)
        .map(|_| Expert {
            gate: quantized(&mut r, i, h, bits),
            up: quantized(&mut r, i, h, bits),
            down: quantized(&mut r, h, i, bits),
        })
        .collect();
    let (gs13, gs2) = (experts[0].gate.gs, experts[0].down.gs);
    let mut ge = GpuExperts::new_quantized(d, c.name, c.n_experts, h, i, bits, gs13, gs2).unwrap();
    for (e, ex) in experts.iter().enumerate() {
        ge.upload_quantized_expert(d, e, &ex.gate, &ex.up, &ex.down).unwrap();
    }
    assert_eq!(ge.quant_bits(), Some(bits));
    let layout = ge.quant_layout().unwrap();
    let ex = &experts;
    let gr = records_copy(d, &ge, c.n_experts, &|e| {
        layout.pack(e, &ex[e].gate, &ex[e].up, &ex[e].down).unwrap().to_record()
    });
    let ew: Vec<[Vec<f64>; 3]> =
        experts.iter().map(|e| [kernel_weights(&e.gate), kernel_weights(&e.up), kernel_weights(&e.down)]).collect();
    check_paths(d, ctx, c, &format!("{bits:?}, g{gs13}/g{gs2}"), ge, gr, &ew, (gs13, gs2), &mut r);
}

/// [`run_case`] with experts kept in the 4-bit float format `kind` (codes and scales drawn at
/// random: every code, every scale byte but NaN, a random NVFP4 global).
fn run_case_fp4(d: &GpuDevice, ctx: &GemmContext, c: &Case, kind: Fp4Kind, seed: u64) {
    let mut r = rng(seed);
    let (h, i) = (c.hidden, c.inter);
    let matrix = |r: &mut ChaCha8Rng, rows, k| fp4::test_matrix(kind, rows, k, r.random::<u64>());
    let experts: Vec<[Fp4Matrix; 3]> =
        (0..c.n_experts).map(|_| [matrix(&mut r, i, h), matrix(&mut r, i, h), matrix(&mut r, h, i)]).collect();
    let mut ge = GpuExperts::new_fp4(d, c.name, c.n_experts, h, i, kind).unwrap();
    let layout = ge.quant_layout().unwrap();
    for (e, [g, u, dn]) in experts.iter().enumerate() {
        ge.upload_packed_expert(d, e, &layout.pack_fp4(e, g, u, dn).unwrap()).unwrap();
    }
    assert_eq!((ge.quant_bits(), ge.fp4()), (Some(Bits::Int4), Some(kind)));
    let ex = &experts;
    let gr = records_copy(d, &ge, c.n_experts, &|e| {
        layout.pack_fp4(e, &ex[e][0], &ex[e][1], &ex[e][2]).unwrap().to_record()
    });
    let ew: Vec<[Vec<f64>; 3]> = experts.iter().map(|m| m.each_ref().map(fp4_kernel_weights)).collect();
    let gs = kind.group();
    check_paths(d, ctx, c, &format!("{kind}"), ge, gr, &ew, (gs, gs), &mut r);
}

/// A case's experts `ge` (and the same as records in place, `gr`) against the twin over their
/// exact weights `ew`, through every path.
#[allow(clippy::too_many_arguments)]
fn check_paths(
    d: &GpuDevice,
    ctx: &GemmContext,
    c: &Case,
    format: &str,
    mut ge: GpuExperts,
    mut gr: GpuExperts,
    ew: &[[Vec<f64>; 3]],
    gs: (usize, usize),
    r: &mut ChaCha8Rng,
) {
    let (h, i) = (c.hidden, c.inter);
    ge.set_max_tokens_per_pass(c.pass_tokens);
    gr.set_max_tokens_per_pass(c.pass_tokens);
    let x = rand_bf16_f32(r, c.t * h, 1.5);
    let ids = make_ids(r, c);
    let weights: Vec<f32> = (0..c.t * c.top_k).map(|_| bf16_round(r.random_range(0.0f32..1.0))).collect();
    let (want, tol) = twin(ew, gs, h, i, &x, &ids, &weights, c.top_k);
    let (x_d, ids_d, w_d) = (up(d, &x, "x"), up(d, &ids, "ids"), up(d, &weights, "weights"));
    // The default choice, then forced through the tiles (every compiled shape: panels per block,
    // buffers; FP4 has the one) and the decode (GEMV-style) path: the same arithmetic, so one
    // twin judges all.
    let mut paths = vec![("default".to_string(), DECODE_MAX_PAIRS, 0)];
    paths.extend((0..GpuExperts::TILE_VARIANTS).map(|v| (format!("tiles v{v}"), 0, v)));
    paths.push(("decode".to_string(), usize::MAX, 0));
    for (path, max_pairs, variant) in paths {
        ge.set_decode_path_max_pairs(max_pairs);
        ge.set_tile_variant(variant);
        let name = format!("{} ({format}, {path} path)", c.name);
        let mut out = poisoned_f32(d, c.t * h);
        ge.forward(d, ctx, &x_d, c.t, &ids_d, &w_d, c.top_k, &mut out).unwrap();
        let got = down(d, &out);
        let worst = assert_within(&name, &got, &want, &tol);
        // The same experts as cache records in place: the same bits.
        gr.set_decode_path_max_pairs(max_pairs);
        gr.set_tile_variant(variant);
        let mut rec_out = poisoned_f32(d, c.t * h);
        gr.forward(d, ctx, &x_d, c.t, &ids_d, &w_d, c.top_k, &mut rec_out).unwrap();
        let rec = down(d, &rec_out);
        assert!(got.iter().zip(&rec).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: records layout differs");
        let mut again = poisoned_f32(d, c.t * h);
        ge.forward(d, ctx, &x_d, c.t, &ids_d, &w_d, c.top_k, &mut again).unwrap();
        let got2 = down(d, &again);
        assert!(got.iter().zip(&got2).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: not deterministic");
        // The experts from `present` on are computed elsewhere (a split hybrid layer): the same
        // bits as the whole layer with those routes' weights zeroed.
        let present = c.n_experts / 2 + 1;
        let zeroed: Vec<f32> = ids
            .iter()
            .zip(&weights)
            .map(|(&e, &w)| if e >= present as i32 && (e as usize) < c.n_experts { 0.0 } else { w })
            .collect();
        let mut want_part = poisoned_f32(d, c.t * h);
        ge.forward(d, ctx, &x_d, c.t, &ids_d, &up(d, &zeroed, "zeroed weights"), c.top_k, &mut want_part).unwrap();
        let mut part = poisoned_f32(d, c.t * h);
        ge.forward_part(d, ctx, &x_d, c.t, &ids_d, &w_d, c.top_k, present, &mut part).unwrap();
        let (want_part, part) = (down(d, &want_part), down(d, &part));
        assert!(
            part.iter().zip(&want_part).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: experts [0, {present}) differ from the whole layer with the others' weights zeroed"
        );
        eprintln!(
            "moe_quant {name}: E={} hidden={h} inter={i} top_k={} t={}: worst err/tol {worst:.3}",
            c.n_experts, c.top_k, c.t
        );
    }
}

#[test]
fn quantized_moe_matches_twin() {
    let Some((d, ctx)) = gpu_gemm("quantized_moe_matches_twin") else { return };
    let m = usize::MAX;
    #[rustfmt::skip]
    let cases = [
        Case { name: "decode", n_experts: 16, hidden: 128, inter: 64, top_k: 4, t: 1, ids: 0, pass_tokens: m },
        Case { name: "decode ragged", n_experts: 9, hidden: 160, inter: 96, top_k: 3, t: 1, ids: 0, pass_tokens: m },
        Case { name: "decode long rows", n_experts: 3, hidden: 4128, inter: 1408, top_k: 2, t: 1, ids: 2, pass_tokens: m },
        Case { name: "prefill", n_experts: 64, hidden: 256, inter: 192, top_k: 6, t: 100, ids: 0, pass_tokens: m },
        Case { name: "prefill ragged", n_experts: 6, hidden: 224, inter: 96, top_k: 2, t: 99, ids: 2, pass_tokens: m },
        Case { name: "prefill g128", n_experts: 16, hidden: 128, inter: 384, top_k: 4, t: 90, ids: 0, pass_tokens: m },
        Case { name: "all on one expert", n_experts: 8, hidden: 192, inter: 32, top_k: 4, t: 70, ids: 1, pass_tokens: m },
        Case { name: "three passes", n_experts: 12, hidden: 96, inter: 160, top_k: 2, t: 101, ids: 0, pass_tokens: 40 },
        Case { name: "bad ids", n_experts: 10, hidden: 64, inter: 32, top_k: 4, t: 30, ids: 3, pass_tokens: 8 },
    ];
    for bits in [Bits::Int4, Bits::Int8] {
        for (k, c) in cases.iter().enumerate() {
            run_case(d, ctx, c, bits, 300 + k as u64);
        }
    }
    // The FP4 formats need K a multiple of 32 (every case's is).
    for kind in [Fp4Kind::Mxfp4, Fp4Kind::Nvfp4] {
        for (k, c) in cases.iter().enumerate() {
            run_case_fp4(d, ctx, c, kind, 400 + k as u64);
        }
    }
}

#[test]
fn quantized_moe_shape_errors() {
    let Some((d, _)) = gpu_gemm("quantized_moe_shape_errors") else { return };
    let mut r = rng(1);
    let mut ge = GpuExperts::new_quantized(d, "layer 2 experts", 4, 64, 32, Bits::Int4, 64, 32).unwrap();
    let (g, u, dn) = (
        quantized(&mut r, 32, 64, Bits::Int4),
        quantized(&mut r, 32, 64, Bits::Int4),
        quantized(&mut r, 64, 32, Bits::Int4),
    );
    let e = ge.upload_quantized_expert(d, 4, &g, &u, &dn).unwrap_err();
    assert!(matches!(e, GpuError::Shape { .. }) && e.to_string().contains("expert 4 of 4"), "{e}");
    let g8 = quantized(&mut r, 32, 64, Bits::Int8);
    let e = ge.upload_quantized_expert(d, 0, &g8, &u, &dn).unwrap_err();
    assert!(e.to_string().contains("gate is 32x64 Int8"), "{e}");
    let e = ge.upload_expert(d, 0, &[0; 64 * 32], &[0; 64 * 32], &[0; 64 * 32]).unwrap_err();
    assert!(e.to_string().contains("quantised"), "{e}");
    // Records-layout experts take whole runs of records only, and records that hold the parts.
    let (p13, p2) = ge.quant_layout().unwrap().record_parts();
    let w2_off = p13.div_ceil(64) * 64;
    let stride = (w2_off + p2).div_ceil(4096) * 4096;
    let mut gr =
        GpuExperts::new_records(d, "layer 3 records", 4, 64, 32, Bits::Int4, (64, 32), (stride, w2_off)).unwrap();
    let e = gr.upload_quantized_expert(d, 0, &g, &u, &dn).unwrap_err();
    assert!(e.to_string().contains("records in place"), "{e}");
    // SAFETY: the call fails its size check before any copy.
    let e = unsafe { gr.copy_record_run_async(d.stream(), 0..2, &vec![0u8; stride]) }.unwrap_err();
    assert!(e.to_string().contains("for 2 records"), "{e}");
    let e = GpuExperts::new_records(d, "layer 3 records", 4, 64, 32, Bits::Int4, (64, 32), (stride, 16)).unwrap_err();
    assert!(e.to_string().contains("cannot hold"), "{e}");
    // A group size that does not divide K is refused at creation, naming the layer.
    let e = GpuExperts::new_quantized(d, "layer 9 experts", 4, 96, 32, Bits::Int8, 64, 32).unwrap_err();
    assert!(e.to_string().contains("layer 9 experts"), "{e}");
}

/// Timings for the lead (printed; asserts only that the runs complete): a V2-Lite layer (64
/// experts, hidden 2048, inter 1408, top-6) with BF16, INT8 and INT4 weights, each t through the
/// default path (the decode path up to DECODE_MAX_PAIRS pairs, else the tiles).
#[test]
fn quantized_moe_timings() {
    let Some((d, ctx)) = gpu_gemm("quantized_moe_timings") else { return };
    let (e, h, i, k) = (64usize, 2048usize, 1408usize, 6usize);
    let mut r = rng(9);
    let g = quantized(&mut r, i, h, Bits::Int4);
    let dn = quantized(&mut r, h, i, Bits::Int4);
    let g8 = quantized(&mut r, i, h, Bits::Int8);
    let dn8 = quantized(&mut r, h, i, Bits::Int8);
    let bf = common::rand_bf16_bits(&mut r, i * h, 0.05);
    let mut formats = Vec::new();
    let mut b = GpuExperts::new(d, "bf16", e, h, i).unwrap();
    let mut q4 = GpuExperts::new_quantized(d, "int4", e, h, i, Bits::Int4, g.gs, dn.gs).unwrap();
    let mut q8 = GpuExperts::new_quantized(d, "int8", e, h, i, Bits::Int8, g8.gs, dn8.gs).unwrap();
    for x in 0..e {
        b.upload_expert(d, x, &bf, &bf, &bf).unwrap();
        q4.upload_quantized_expert(d, x, &g, &g, &dn).unwrap();
        q8.upload_quantized_expert(d, x, &g8, &g8, &dn8).unwrap();
    }
    formats.push(("bf16", b, 2.0));
    formats.push(("int8", q8, 1.0));
    formats.push(("int4", q4, 0.5));
    for t in [1usize, 8, 512, 2048] {
        let x = up(d, &vec![0.5f32; t * h], "x");
        let ids: Vec<i32> = (0..t * k).map(|_| r.random_range(0..e as i32)).collect();
        let ids = up(d, &ids, "ids");
        let wts = up(d, &vec![0.125f32; t * k], "weights");
        let mut out = d.alloc_zeros::<f32>(t * h, "out").unwrap();
        for (name, ge, bytes) in formats.iter_mut() {
            let variants = if *name == "bf16" || t * k <= DECODE_MAX_PAIRS { 1 } else { GpuExperts::TILE_VARIANTS };
            for v in 0..variants {
                ge.set_tile_variant(v);
                ge.forward(d, ctx, &x, t, &ids, &wts, k, &mut out).unwrap();
                let us =
                    common::time_us_per_call(d, 20, || ge.forward(d, ctx, &x, t, &ids, &wts, k, &mut out).unwrap());
                let touched = (t * k).min(e) as f64 * 3.0 * (h * i) as f64 * *bytes;
                let tflops = 2.0 * 3.0 * (t * k * h * i) as f64 / (us * 1e-6) / 1e12;
                eprintln!(
                    "moe V2-Lite layer {name} v{v} t={t}: {us:.1} us, {tflops:.1} TFLOP/s, ≥{:.0} GB/s of expert weights",
                    touched / (us * 1e-6) / 1e9
                );
            }
        }
    }
}
