//! `GpuLinear` (BF16 GEMV and cuBLAS, INT8 GEMV and INT8 tiled) against scalar f64 twins on random
//! and ragged shapes. Weights are BF16 by construction; `x` is deliberately *not* pre-rounded in
//! half of the cases, because rounding `x` to BF16 is part of the BF16 path's contract (the twin
//! rounds it the same way, round-to-nearest-even). Outputs are poisoned with NaN before each
//! launch so an unwritten element fails.
//!
//! Without a GPU every test prints "SKIPPED: no GPU" (past the harness's capture) and passes;
//! with `KRASIS_REQUIRE_GPU=1` a missing GPU fails instead.

#![allow(clippy::needless_range_loop)] // the scalar twins are plain index loops on purpose

mod common;

use common::{
    assert_within, dot_est, down, from_bf16, gpu_gemm, poisoned_bf16, poisoned_f32, rand_bf16_bits, rand_f32, rng,
    round_bf16, time_us_per_call, to_bf16, up, U,
};
use krasis_core::dtype::{bf16_to_f32, f32_to_bf16};
use krasis_gpu::cudarc::driver::{DevicePtr, DevicePtrMut};
use krasis_gpu::linear::{
    bf16_gemv_rows_per_warp, int8_gemv_rows_per_warp, Bf16Path, BF16_GEMV_MAX_M, FIXED_ROWS, GEMV_GROUP_MAX,
    INT8_GEMV_MAX_M,
};
use krasis_gpu::{DeviceBuffer, GemmContext, GpuDevice, GpuError, GpuLinear, LinearQuant, VramBudgetSpec};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Tolerance in units of the rounding-error model of `common::dot_est`. A sum of products
/// rounded step by step in f32 has an error close to a random walk of `u·|S_j|` steps over its
/// partial sums `S_j`, i.e. about `u·sqrt(Σ S_j²)`; blocked or tree orders (cuBLAS, the GEMV's
/// lanes + warp reduction) have smaller partial sums. 64× that estimate leaves room for
/// tensor-core accumulation details while a single wrong or missing term (about `|S|/sqrt(k)` or
/// more) still fails.
const TOL_SIGMAS: f64 = 64.0;

/// Independent INT8 quantiser (the twin of `quantize_int8_rows`).
fn twin_quant(w: &[u16], rows: usize, cols: usize) -> (Vec<i8>, Vec<f32>) {
    let mut q = vec![0i8; rows * cols];
    let mut s = vec![0f32; rows];
    for r in 0..rows {
        let amax = (0..cols).map(|c| bf16_to_f32(w[r * cols + c]).abs()).fold(0.0f32, f32::max);
        s[r] = amax / 127.0;
        for c in 0..cols {
            if s[r] > 0.0 {
                q[r * cols + c] = (bf16_to_f32(w[r * cols + c]) / s[r]).round().clamp(-127.0, 127.0) as i8;
            }
        }
    }
    (q, s)
}

/// y = x · Wᵀ with `wv` the weight values as f64 (`[rows, cols]`), each row times `scale[r]`.
/// Returns (y, tolerance) per element.
fn twin_linear(x: &[f32], m: usize, wv: &[f64], scale: &[f64], rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let mut y = vec![0f32; m * rows];
    let mut tol = vec![0f32; m * rows];
    for t in 0..m {
        for r in 0..rows {
            let (s, est) = dot_est(
                x[t * cols..(t + 1) * cols].iter().map(|&v| v as f64),
                wv[r * cols..(r + 1) * cols].iter().copied(),
            );
            let v = s * scale[r];
            y[t * rows + r] = v as f32;
            tol[t * rows + r] = (TOL_SIGMAS * U * (est * scale[r].abs() + 4.0 * v.abs())) as f32 + 1e-30;
        }
    }
    (y, tol)
}

const MS: [usize; 6] = [1, 2, 3, 17, 64, 129];
/// (rows, cols): ragged, odd, not multiples of 4/8/16, plus aligned ones.
const SHAPES: [(usize, usize); 8] =
    [(1, 1), (7, 13), (33, 100), (129, 257), (64, 64), (300, 1000), (1000, 301), (256, 2048)];

fn to_f64<T: Copy + Into<f64>>(v: &[T]) -> Vec<f64> {
    v.iter().map(|&x| x.into()).collect()
}

/// Random `x` for `[m, cols]`, pre-rounded to BF16 in every other case so both the exact and the
/// rounding input paths are covered.
fn rand_x(r: &mut ChaCha8Rng, m: usize, cols: usize, case: usize) -> Vec<f32> {
    let x = rand_f32(r, m * cols, 2.0);
    if (case + m).is_multiple_of(2) {
        round_bf16(&x)
    } else {
        x
    }
}

/// `lin.forward` into a NaN-poisoned `y`, checked element by element against the twin; returns
/// the worst err/tol.
#[allow(clippy::too_many_arguments)]
fn forward_vs_twin(
    d: &GpuDevice,
    ctx: &GemmContext,
    lin: &GpuLinear,
    x: &impl DevicePtr<f32>,
    m: usize,
    want: &[f32],
    tol: &[f32],
    what: &str,
) -> f32 {
    let mut y = poisoned_f32(d, m * lin.rows());
    lin.forward(d, ctx, x, m, &mut y).unwrap();
    assert_within(what, &down(d, &y), want, tol)
}

#[test]
fn bf16_linear_matches_twin() {
    let Some((d, ctx)) = gpu_gemm("bf16_linear_matches_twin") else { return };
    let mut r = rng(11);
    for (case, &(rows, cols)) in SHAPES.iter().enumerate() {
        let w = rand_bf16_bits(&mut r, rows * cols, 0.5);
        let wv = to_f64(&from_bf16(&w));
        let lin = GpuLinear::new(d, "test bf16 linear", &w, rows, cols, LinearQuant::Bf16).unwrap();
        assert_eq!(
            (lin.rows(), lin.cols(), lin.quant(), lin.weight_bytes()),
            (rows, cols, LinearQuant::Bf16, rows * cols * 2)
        );
        for &m in &MS {
            let x = rand_x(&mut r, m, cols, case);
            let (want, tol) = twin_linear(&round_bf16(&x), m, &wv, &vec![1.0; rows], rows, cols);
            let what = format!("bf16 [{rows}x{cols}] m={m}");
            let worst = forward_vs_twin(d, ctx, &lin, &up(d, &x, "x"), m, &want, &tol, &what);
            if m == 129 {
                eprintln!("bf16 [{rows}x{cols}]: worst err/tol {worst:.3}");
            }
        }
    }
}

/// The BF16 twin: `y = bf16(x) · Wᵀ` (x rounded to nearest even, as every BF16 path does).
fn twin_bf16(x: &[f32], m: usize, wv: &[f64], rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    twin_linear(&round_bf16(x), m, wv, &vec![1.0; rows], rows, cols)
}

/// The BF16 GEMV with each rows-per-warp variant forced, for every m in 1..=BF16_GEMV_MAX_M, on
/// random ragged shapes (rows 1..300, cols 1..700, mostly not multiples of 8: the unaligned
/// weight path) and fixed edges: tiny, odd, multiples of 8 (the 16-byte path), and cols past one
/// staged x tile (2048 columns at m = 8, 16384 at m = 1) so the multi-tile staging runs.
#[test]
fn bf16_gemv_matches_twin() {
    let Some((d, ctx)) = gpu_gemm("bf16_gemv_matches_twin") else { return };
    let mut r = rng(15);
    let mut shapes: Vec<(usize, usize)> =
        vec![(1, 1), (3, 7), (31, 8), (33, 255), (65, 257), (300, 700), (64, 512), (17, 2501), (9, 4104), (5, 16500)];
    for _ in 0..10 {
        shapes.push((r.random_range(1..300), r.random_range(1..700)));
    }
    for (case, &(rows, cols)) in shapes.iter().enumerate() {
        let w = rand_bf16_bits(&mut r, rows * cols, 0.5);
        let wv = to_f64(&from_bf16(&w));
        let mut lin = GpuLinear::new(d, "test bf16 gemv", &w, rows, cols, LinearQuant::Bf16).unwrap();
        for m in 1..=BF16_GEMV_MAX_M {
            let x = rand_x(&mut r, m, cols, case);
            let (want, tol) = twin_bf16(&x, m, &wv, rows, cols);
            let x_d = up(d, &x, "x");
            for rows_per_warp in [1, 4] {
                lin.set_bf16_path(Bf16Path::Gemv { rows_per_warp });
                let what = format!("bf16 gemv r{rows_per_warp} [{rows}x{cols}] m={m}");
                forward_vs_twin(d, ctx, &lin, &x_d, m, &want, &tol, &what);
            }
        }
    }
}

/// x as a view one element into a buffer (not 16-byte aligned: the GEMV stages it with scalar
/// loads even though cols % 4 == 0), and x with NaN/inf/huge values (rounding to BF16 keeps NaN
/// a NaN; a finite value past BF16's range rounds to inf), on both variants.
#[test]
fn bf16_gemv_unaligned_x_and_specials() {
    let Some((d, ctx)) = gpu_gemm("bf16_gemv_unaligned_x_and_specials") else { return };
    let mut r = rng(16);
    let (rows, cols) = (77, 264);
    let w = rand_bf16_bits(&mut r, rows * cols, 1.0);
    let wv = to_f64(&from_bf16(&w));
    let mut lin = GpuLinear::new(d, "unaligned", &w, rows, cols, LinearQuant::Bf16).unwrap();
    for m in [1, 3, 8] {
        let x = rand_f32(&mut r, m * cols + 1, 1.0);
        let (want, tol) = twin_bf16(&x[1..], m, &wv, rows, cols);
        let x_d = up(d, &x, "x");
        for rows_per_warp in [1, 4] {
            lin.set_bf16_path(Bf16Path::Gemv { rows_per_warp });
            let what = format!("bf16 gemv r{rows_per_warp} unaligned x m={m}");
            forward_vs_twin(d, ctx, &lin, &x_d.slice().slice(1..), m, &want, &tol, &what);
        }
    }
    // Token 0 gets a NaN (every output NaN), token 1 a finite value that rounds to +inf in BF16
    // (every output inf with the sign of its weight, NaN for a zero weight); token 2 stays finite.
    let m = 3;
    let mut x = rand_f32(&mut r, m * cols, 1.0);
    x[5] = f32::NAN;
    x[cols + 9] = f32::MAX;
    let x_d = up(d, &x, "x");
    for rows_per_warp in [1, 4] {
        lin.set_bf16_path(Bf16Path::Gemv { rows_per_warp });
        let mut y = poisoned_f32(d, m * rows);
        lin.forward(d, ctx, &x_d, m, &mut y).unwrap();
        let y = down(d, &y);
        assert!(y[..rows].iter().all(|v| v.is_nan()), "r{rows_per_warp}: a NaN in x must give a NaN row");
        for (row, &v) in y[rows..2 * rows].iter().enumerate() {
            let wt = bf16_to_f32(w[row * cols + 9]);
            let ok = if wt == 0.0 { v.is_nan() } else { v.is_infinite() && (v > 0.0) == (wt > 0.0) };
            assert!(ok, "r{rows_per_warp}: row {row}: weight {wt} times inf gave {v}");
        }
        let (want, tol) = twin_bf16(&x[2 * cols..], 1, &wv, rows, cols);
        assert_within(&format!("r{rows_per_warp}: finite token"), &y[2 * rows..], &want, &tol);
    }
}

/// DeepSeek-V2-Lite's dense BF16 linears through `forward`'s own choice (and each variant
/// forced), m = 1, 3, 8; lm_head at m = 1.
#[test]
fn bf16_gemv_v2_lite_shapes() {
    let Some((d, ctx)) = gpu_gemm("bf16_gemv_v2_lite_shapes") else { return };
    let mut r = rng(17);
    let sms = d.info().multiprocessors as usize;
    let shapes: [(&str, usize, usize, &[usize]); 7] = [
        ("q_proj", 3072, 2048, &[1, 3, 8]),
        ("kv_a_proj", 576, 2048, &[1, 3, 8]),
        ("kv_b_proj", 4096, 512, &[1, 3, 8]),
        ("o_proj", 2048, 2048, &[1, 3, 8]),
        ("shared gate_up", 2816, 2048, &[1, 3, 8]),
        ("shared down", 2048, 2816, &[1, 3, 8]),
        ("lm_head", 102400, 2048, &[1]),
    ];
    for (name, rows, cols, ms) in shapes {
        let w = rand_bf16_bits(&mut r, rows * cols, 0.05);
        let wv = to_f64(&from_bf16(&w));
        let mut lin = GpuLinear::new(d, name, &w, rows, cols, LinearQuant::Bf16).unwrap();
        for &m in ms {
            let x = rand_f32(&mut r, m * cols, 1.0);
            let (want, tol) = twin_bf16(&x, m, &wv, rows, cols);
            let x_d = up(d, &x, "x");
            let auto = bf16_gemv_rows_per_warp(rows, m, sms);
            for path in [Bf16Path::Auto, Bf16Path::Gemv { rows_per_warp: 1 }, Bf16Path::Gemv { rows_per_warp: 4 }] {
                lin.set_bf16_path(path);
                let what = format!("{name} [{rows}x{cols}] m={m} {path:?} (auto: r{auto})");
                let worst = forward_vs_twin(d, ctx, &lin, &x_d, m, &want, &tol, &what);
                eprintln!("{what}: worst err/tol {worst:.3}");
            }
        }
    }
}

/// `forward_group` (up to four matrices of the same columns: one GEMV launch for a gated-DeltaNet
/// layer's input projections, attention's q/k/v or MLA's q and kv_a, or x converted once for the
/// cuBLAS GEMMs) gives bit for bit what one `forward` per matrix gives, on V2-Lite's and Qwen3.6's
/// shapes and ragged ones (parts of any row count; where a part but the last is not a multiple of
/// the launch's rows per warp the GEMV falls back to one launch each), m = 1 ..= BF16_GEMV_MAX_M
/// and cuBLAS's m beyond, and matches the twin.
#[test]
fn bf16_group_equals_one_forward_per_matrix() {
    let Some((d, ctx)) = gpu_gemm("bf16_group_equals_one_forward_per_matrix") else { return };
    let mut r = rng(23);
    let mut shapes: Vec<(Vec<usize>, usize)> = vec![
        (vec![3072, 576], 2048),
        (vec![8192, 4096, 32, 32], 2048),
        (vec![8192, 512, 512], 2048),
        (vec![4, 1], 8),
        (vec![64, 33], 257),
        (vec![300, 7, 5], 700),
        (vec![6, 5, 3, 9], 31),
        (vec![17], 40),
    ];
    for _ in 0..6 {
        let n = r.random_range(1..=GEMV_GROUP_MAX);
        let rows = (0..n)
            .map(|i| if i + 1 < n && r.random_bool(0.8) { 4 * r.random_range(1..200) } else { r.random_range(1..300) })
            .collect();
        shapes.push((rows, r.random_range(1..1200)));
    }
    for (rows, cols) in &shapes {
        let cols = *cols;
        let ws: Vec<Vec<u16>> = rows.iter().map(|&n| rand_bf16_bits(&mut r, n * cols, 0.5)).collect();
        let lins: Vec<GpuLinear> = rows
            .iter()
            .zip(&ws)
            .map(|(&n, w)| GpuLinear::new(d, "group part", w, n, cols, LinearQuant::Bf16).unwrap())
            .collect();
        for m in (1..=BF16_GEMV_MAX_M).chain([BF16_GEMV_MAX_M + 1, 37]) {
            let x = rand_f32(&mut r, m * cols, 1.0);
            let what = format!("group {rows:?}x{cols} m={m}");
            let got = group_equals_each_forward(d, ctx, &lins, &up(d, &x, "x"), m, &what);
            for (i, (got, &n)) in got.iter().zip(rows.iter()).enumerate() {
                let (want, tol) = twin_bf16(&x, m, &to_f64(&from_bf16(&ws[i])), n, cols);
                assert_within(&format!("{what} part {i}"), got, &want, &tol);
            }
        }
    }
}

/// `forward_group` of `lins` on `x` (`m` rows; outputs poisoned first), each part's output
/// asserted bit for bit equal to its own `forward`; returns the outputs.
fn group_equals_each_forward(
    d: &GpuDevice,
    ctx: &GemmContext,
    lins: &[GpuLinear],
    x_d: &DeviceBuffer<f32>,
    m: usize,
    what: &str,
) -> Vec<Vec<f32>> {
    let mut ys: Vec<_> = lins.iter().map(|l| poisoned_f32(d, m * l.rows())).collect();
    {
        let mut parts: Vec<(&GpuLinear, &mut dyn DevicePtrMut<f32>)> =
            lins.iter().zip(ys.iter_mut()).map(|(l, y)| (l, y as &mut dyn DevicePtrMut<f32>)).collect();
        GpuLinear::forward_group(d, ctx, x_d, m, &mut parts).unwrap();
    }
    let mut out = Vec::with_capacity(lins.len());
    for (i, (l, y)) in lins.iter().zip(&ys).enumerate() {
        let mut y1 = poisoned_f32(d, m * l.rows());
        l.forward(d, ctx, x_d, m, &mut y1).unwrap();
        let got = down(d, y);
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            down(d, &y1).iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{what}: part {i} differs from forward"
        );
        out.push(got);
    }
    out
}

/// `forward_group` of INT8 parts (attention's q, k and v under `--attention-quant int8`): one
/// GEMV launch for the decode sizes, four rows per warp or one (by the rows of all the parts and
/// whether they split at multiples of 4), the tiled path part by part above `INT8_GEMV_MAX_M`.
/// Every part's output is bit for bit its own `forward` (whatever rows per warp either takes:
/// a lane sums its columns in one order) and within the twin's tolerance.
#[test]
fn int8_group_equals_one_forward_per_matrix() {
    let Some((d, ctx)) = gpu_gemm("int8_group_equals_one_forward_per_matrix") else { return };
    let mut r = rng(29);
    let sms = d.info().multiprocessors as usize;
    let mut shapes: Vec<(Vec<usize>, usize)> = vec![
        (vec![12288, 1024, 1024], 4096), // GLM-4.5-Air's q, k and v: four rows per warp
        (vec![8192, 4096, 32, 32], 2048),
        (vec![4096, 6, 4096], 512), // a part of 6 rows: one row per warp for the launch
        (vec![4, 1], 8),
        (vec![64, 33], 257),
        (vec![300, 7, 5], 700),
        (vec![6, 5, 3, 9], 31),
    ];
    for _ in 0..6 {
        let n = r.random_range(2..=GEMV_GROUP_MAX);
        let rows = (0..n)
            .map(|i| if i + 1 < n && r.random_bool(0.8) { 4 * r.random_range(1..2000) } else { r.random_range(1..300) })
            .collect();
        shapes.push((rows, r.random_range(1..1200)));
    }
    let mut widths = [0usize; 2];
    for (rows, cols) in &shapes {
        let cols = *cols;
        let all: usize = rows.iter().sum();
        let r4 = int8_gemv_rows_per_warp(all, sms) == 4 && rows[..rows.len() - 1].iter().all(|n| n % 4 == 0);
        widths[usize::from(r4)] += 1;
        let ws: Vec<Vec<u16>> = rows.iter().map(|&n| rand_bf16_bits(&mut r, n * cols, 0.5)).collect();
        let lins: Vec<GpuLinear> = rows
            .iter()
            .zip(&ws)
            .map(|(&n, w)| GpuLinear::new(d, "int8 group part", w, n, cols, LinearQuant::Int8).unwrap())
            .collect();
        for m in [1, 2, 3, 5, INT8_GEMV_MAX_M, INT8_GEMV_MAX_M + 1] {
            let x = rand_f32(&mut r, m * cols, 1.0);
            let what = format!("int8 group {rows:?}x{cols} m={m} (r4 {r4})");
            let got = group_equals_each_forward(d, ctx, &lins, &up(d, &x, "x"), m, &what);
            let x_twin = if m <= INT8_GEMV_MAX_M { x.clone() } else { round_bf16(&x) };
            for (i, (got, &n)) in got.iter().zip(rows.iter()).enumerate() {
                let (q, sc) = twin_quant(&ws[i], n, cols);
                let (want, tol) = twin_linear(&x_twin, m, &to_f64(&q), &to_f64(&sc), n, cols);
                assert_within(&format!("{what} part {i}"), got, &want, &tol);
            }
        }
    }
    assert!(widths[0] > 0 && widths[1] > 0, "the shapes cover one and four rows per warp: {widths:?}");
}

/// `forward_bf16` (cuBLAS rounding the f32 sums to BF16 in its epilogue; MLA prefill's K/V) is
/// `forward` rounded to nearest even, to within one BF16 step where the f32 sums of the two
/// GEMMs differ in their last bits, on V2-Lite's kv_b shape and ragged ones; it refuses where
/// `writes_bf16` says no (GEMV rows, INT8 weights).
#[test]
fn bf16_output_is_forward_rounded() {
    let Some((d, ctx)) = gpu_gemm("bf16_output_is_forward_rounded") else { return };
    let mut r = rng(41);
    let mut exact = (0usize, 0usize);
    for &(rows, cols) in &[(4096, 512), (33, 257), (7, 700), (130, 8)] {
        let w = rand_bf16_bits(&mut r, rows * cols, 0.5);
        let lin = GpuLinear::new(d, "kv_b", &w, rows, cols, LinearQuant::Bf16).unwrap();
        let int8 = GpuLinear::new(d, "kv_b int8", &w, rows, cols, LinearQuant::Int8).unwrap();
        assert!(!lin.writes_bf16(ctx, BF16_GEMV_MAX_M) && !int8.writes_bf16(ctx, 64));
        for m in [BF16_GEMV_MAX_M + 1, 64, 301] {
            let what = format!("[{rows}x{cols}] m={m}");
            assert!(lin.writes_bf16(ctx, m), "{what}");
            let x_d = up(d, &rand_f32(&mut r, m * cols, 1.0), "x");
            let mut y = poisoned_f32(d, m * rows);
            lin.forward(d, ctx, &x_d, m, &mut y).unwrap();
            let mut y16 = poisoned_bf16(d, m * rows);
            lin.forward_bf16(d, ctx, &x_d, m, &mut y16).unwrap();
            let err = int8.forward_bf16(d, ctx, &x_d, m, &mut y16).unwrap_err().to_string();
            assert!(err.contains("no BF16 output"), "{err}");
            let (want, got) = (to_bf16(&down(d, &y)), down(d, &y16));
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                // Adjacent BF16 values of one sign differ by one in their bits.
                let steps = (g as i32 - w as i32).abs();
                assert!(steps <= 1 && (g ^ w) & 0x8000 == 0 || g == w, "{what} [{i}]: {g:#06x} vs {w:#06x}");
                exact.0 += (g == w) as usize;
            }
            exact.1 += got.len();
        }
    }
    eprintln!("bf16 output: {} of {} values equal forward's rounding", exact.0, exact.1);
    assert!(exact.0 * 100 >= exact.1 * 99, "{} of {} equal", exact.0, exact.1);
}

/// Work on the side stream (`GpuDevice::on_side_stream`): a GEMV launched there reads what the
/// compute stream wrote before the fork and, after `join_side_stream`, the compute stream reads
/// what it wrote, bit for bit as on the compute stream; while a long GEMV chain runs on the side,
/// the compute stream's own work goes on. cuBLAS runs there only in the GEMM context's side lane,
/// sized first by `reserve_side` (an error before, not a race), and then gives the compute
/// stream's bits; launches outside the closure go to the compute stream again.
#[test]
fn side_stream_orders_and_runs_cublas_in_its_lane() {
    let Some((d, ctx)) = gpu_gemm("side_stream_orders_and_runs_cublas_in_its_lane") else { return };
    let mut r = rng(31);
    let (rows, cols) = (2816, 2048);
    let w = rand_bf16_bits(&mut r, rows * cols, 0.5);
    let lin = GpuLinear::new(d, "side", &w, rows, cols, LinearQuant::Bf16).unwrap();
    let back = GpuLinear::new(d, "side back", &rand_bf16_bits(&mut r, cols * rows, 0.5), cols, rows, LinearQuant::Bf16)
        .unwrap();
    for round in 0..3 {
        let x = rand_f32(&mut r, cols, 1.0);
        let mut x_d = poisoned_f32(d, cols);
        let mut want = poisoned_f32(d, rows);
        let mut got = poisoned_f32(d, rows);
        let mut other = poisoned_f32(d, cols);
        // The compute stream writes x (a copy) right before the fork: the side must see it.
        d.copy_to_device(&x, &mut x_d).unwrap();
        lin.forward(d, ctx, &x_d, 1, &mut want).unwrap();
        let mut chain = poisoned_f32(d, cols);
        d.on_side_stream(|| -> Result<(), GpuError> {
            // A chain long enough to still run when the compute stream's work below is queued.
            for _ in 0..20 {
                lin.forward(d, ctx, &x_d, 1, &mut got)?;
                back.forward(d, ctx, &got, 1, &mut chain)?;
            }
            Ok(())
        })
        .unwrap();
        back.forward(d, ctx, &want, 1, &mut other).unwrap(); // compute stream, beside the chain
        d.join_side_stream().unwrap();
        let what = format!("side stream round {round}");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&down(d, &got)), bits(&down(d, &want)), "{what}: the side GEMV differs");
        assert_eq!(bits(&down(d, &chain)), bits(&down(d, &other)), "{what}: the side chain differs");
    }
    // cuBLAS on the side stream beyond its lane's reserved scratch is an error, not a race; the
    // closure's end restores the stream.
    let m = 33;
    let x_d = up(d, &rand_f32(&mut r, m * cols, 1.0), "x");
    let mut y = poisoned_f32(d, m * rows);
    assert!(!lin.runs_alone(ctx, m) && lin.runs_alone(ctx, 1) && lin.gemm_scratch_bytes(ctx, 1) == 0);
    let need = lin.gemm_scratch_bytes(ctx, m);
    assert!(need >= m * cols * 2, "{need}");
    let own = GemmContext::new(d).unwrap(); // a context whose side lane does not exist yet
    let on_side = |ctx: &GemmContext| {
        let mut y = poisoned_f32(d, m * rows);
        d.on_side_stream(|| lin.forward(d, ctx, &x_d, m, &mut y)).unwrap_err().to_string()
    };
    let err = on_side(&own);
    assert!(err.contains("side stream") && err.contains("reserve_side"), "{err}");
    own.reserve_side(d, need - 256).unwrap();
    let err = on_side(&own);
    assert!(err.contains("side stream") && err.contains(&format!("{need} needed")), "{err}");
    lin.forward(d, ctx, &x_d, m, &mut y).unwrap();
    // Reserved: the side lane's cuBLAS gives the compute stream's bits, beside its work.
    own.reserve_side(d, need).unwrap();
    let mut y_side = poisoned_f32(d, m * rows);
    let mut y_back = poisoned_f32(d, m * cols);
    d.on_side_stream(|| lin.forward(d, &own, &x_d, m, &mut y_side)).unwrap();
    back.forward(d, ctx, &y, m, &mut y_back).unwrap(); // compute stream cuBLAS meanwhile
    d.join_side_stream().unwrap();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let got = down(d, &y_side);
    assert!(got.iter().all(|v| v.is_finite()), "side cuBLAS left NaNs");
    assert_eq!(bits(&got), bits(&down(d, &y)), "side-lane cuBLAS differs from the compute stream's");
    assert!(down(d, &y_back).iter().all(|v| v.is_finite()), "cuBLAS beside the side stream left NaNs");
}

/// cuBLAS (forced, and `forward`'s own choice above BF16_GEMV_MAX_M) still matches the twin;
/// at m <= BF16_GEMV_MAX_M the same inputs go through the GEMV under Auto.
#[test]
fn bf16_cublas_path_still_matches() {
    let Some((d, ctx)) = gpu_gemm("bf16_cublas_path_still_matches") else { return };
    let mut r = rng(18);
    for (case, &(rows, cols)) in [(129usize, 257usize), (256, 2048), (1000, 301)].iter().enumerate() {
        let w = rand_bf16_bits(&mut r, rows * cols, 0.5);
        let wv = to_f64(&from_bf16(&w));
        let mut lin = GpuLinear::new(d, "test bf16 cublas", &w, rows, cols, LinearQuant::Bf16).unwrap();
        for m in [1, 8, BF16_GEMV_MAX_M + 1, 33] {
            let x = rand_x(&mut r, m, cols, case);
            let (want, tol) = twin_bf16(&x, m, &wv, rows, cols);
            let x_d = up(d, &x, "x");
            for path in [Bf16Path::Cublas, Bf16Path::Auto] {
                lin.set_bf16_path(path);
                let what = format!("bf16 {path:?} [{rows}x{cols}] m={m}");
                forward_vs_twin(d, ctx, &lin, &x_d, m, &want, &tol, &what);
            }
        }
    }
}

#[test]
fn int8_linear_matches_twin() {
    let Some((d, ctx)) = gpu_gemm("int8_linear_matches_twin") else { return };
    let mut r = rng(12);
    // The SHAPES, plus rows enough for the 4-rows-per-warp GEMV on any GPU, and a weight over
    // 32 MiB as BF16 so the tiled path expands it in more than one tile.
    let mut shapes: Vec<(usize, usize, &[usize])> = SHAPES.iter().map(|&(a, b)| (a, b, &MS[..])).collect();
    shapes.push((40_000, 40, &[1, 3, 8, 9]));
    shapes.push((20_000, 1000, &[1, 17]));
    for (case, &(rows, cols, ms)) in shapes.iter().enumerate() {
        let mut wf = rand_f32(&mut r, rows * cols, 0.5);
        wf[..cols.min(3)].fill(0.0); // row 0 partly zero
        if rows > 2 {
            wf[2 * cols..3 * cols].fill(0.0); // an all-zero row: scale 0
        }
        let w = to_bf16(&wf);
        let (q, s) = twin_quant(&w, rows, cols);
        assert_eq!(krasis_gpu::linear::quantize_int8_rows(&w, rows, cols).unwrap(), (q.clone(), s.clone()));
        let (qv, sv) = (to_f64(&q), to_f64(&s));
        let lin = GpuLinear::new(d, "test int8 linear", &w, rows, cols, LinearQuant::Int8).unwrap();
        assert_eq!(lin.quant(), LinearQuant::Int8);
        assert_eq!(lin.weight_bytes(), rows * cols.div_ceil(16) * 16 + rows * 4);
        for &m in ms {
            let x = rand_x(&mut r, m, cols, case);
            // Decode GEMV: f32 x. Tiled: x rounded to BF16, like the BF16 path.
            let x_twin = if m <= INT8_GEMV_MAX_M { x.clone() } else { round_bf16(&x) };
            let (want, tol) = twin_linear(&x_twin, m, &qv, &sv, rows, cols);
            let what = format!("int8 [{rows}x{cols}] m={m}");
            let worst = forward_vs_twin(d, ctx, &lin, &up(d, &x, "x"), m, &want, &tol, &what);
            eprintln!("int8 [{rows}x{cols}] m={m}: worst err/tol {worst:.3}");
        }
    }
}

/// The precise mode's exact input (`set_exact_input`): BF16 and INT8 weights, every path (the
/// BF16 GEMV sizes now on cuBLAS, the INT8 GEMV and tiled path), x *not* BF16-exact, against the
/// twin on the unrounded x. The tolerance adds four times the split's own bound to the
/// summation-order model: `|x − hi − lo| ≤ 2⁻¹⁷|x|` (hi rounds x at 2⁻⁸ of its binade, lo the
/// remainder, under 2⁻⁹ of it, likewise), so `2⁻¹⁷·Σ|x·w|` per output. Rounding x to BF16 would
/// move outputs far past it (asserted: the BF16 twin fails the same tolerance somewhere). A group
/// of exact parts equals one forward per part, bit for bit.
#[test]
fn exact_input_matches_the_unrounded_twin() {
    let Some((d, ctx)) = gpu_gemm("exact_input_matches_the_unrounded_twin") else { return };
    let mut r = rng(29);
    let mut rounding_fails = 0usize;
    for &(rows, cols) in SHAPES.iter().chain(&[(40_000, 40), (2048, 4096)]) {
        let w = rand_bf16_bits(&mut r, rows * cols, 0.5);
        let wv = to_f64(&from_bf16(&w));
        let (q, sc) = twin_quant(&w, rows, cols);
        let (qv, sv) = (to_f64(&q), to_f64(&sc));
        for quant in [LinearQuant::Bf16, LinearQuant::Int8] {
            let mut lin = GpuLinear::new(d, "exact input", &w, rows, cols, quant).unwrap();
            lin.set_exact_input(true);
            assert!(lin.exact_input() && !lin.writes_bf16(ctx, 129));
            for &m in &[1usize, 2, 8, 9, 64] {
                let x = rand_f32(&mut r, m * cols, 2.0);
                let (wvals, scale) = match quant {
                    LinearQuant::Bf16 => (&wv, vec![1.0; rows]),
                    LinearQuant::Int8 => (&qv, sv.clone()),
                };
                let (want, mut tol) = twin_linear(&x, m, wvals, &scale, rows, cols);
                for t in 0..m {
                    for o in 0..rows {
                        let abs: f64 = (0..cols).map(|c| (x[t * cols + c] as f64 * wvals[o * cols + c]).abs()).sum();
                        tol[t * rows + o] += (2.0 * abs * scale[o].abs() * (2.0f64).powi(-16)) as f32;
                    }
                }
                let what = format!("exact {quant} [{rows}x{cols}] m={m}");
                let x_d = up(d, &x, "x");
                let mut y = poisoned_f32(d, m * rows);
                lin.forward(d, ctx, &x_d, m, &mut y).unwrap();
                let got = down(d, &y);
                assert_within(&what, &got, &want, &tol);
                let (rounded, _) = twin_linear(&round_bf16(&x), m, wvals, &scale, rows, cols);
                rounding_fails +=
                    rounded.iter().zip(&want).zip(&tol).filter(|((a, b), t)| (*a - *b).abs() > **t).count();
                // Exact parts in a group: one forward per part.
                let mut twin_lin = GpuLinear::new(d, "exact part", &w, rows, cols, quant).unwrap();
                twin_lin.set_exact_input(true);
                let (mut y1, mut y2) = (poisoned_f32(d, m * rows), poisoned_f32(d, m * rows));
                {
                    let mut parts: Vec<(&GpuLinear, &mut dyn DevicePtrMut<f32>)> =
                        vec![(&lin, &mut y1), (&twin_lin, &mut y2)];
                    GpuLinear::forward_group(d, ctx, &x_d, m, &mut parts).unwrap();
                }
                for (i, yy) in [&y1, &y2].into_iter().enumerate() {
                    let bits: Vec<u32> = down(d, yy).iter().map(|v| v.to_bits()).collect();
                    assert_eq!(bits, got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{what}: group part {i}");
                }
            }
        }
    }
    assert!(rounding_fails > 0, "rounding x to BF16 stayed inside every exact tolerance: the test could not fail");
    eprintln!("BF16-rounded x fell outside the exact tolerance at {rounding_fails} outputs");
}

/// x as a view one element into a buffer: not 16-byte aligned, so the GEMV must take its scalar
/// x path even when cols % 4 == 0.
/// Fixed rows (`GemmContext::set_fixed_rows`, the row-invariant prefill): a row's outputs are the
/// same bits whichever call computes it. BF16 and INT8 weights on ragged shapes (the LM head's
/// width among them): one call over all `m` rows, then the same rows in calls of other sizes and
/// offsets (single rows, GEMV sizes, a block and a half, a padded last block), and a group of
/// parts, all equal bit for bit; every result within the twin's tolerance (x rounded to BF16, as
/// the cuBLAS paths do). The same calls without fixed rows differ somewhere (the GEMVs' order is
/// not cuBLAS's), so the equality is not a property the default already had.
#[test]
fn fixed_rows_give_each_row_the_same_bits_in_any_call() {
    let Some((d, _)) = gpu_gemm("fixed_rows_give_each_row_the_same_bits_in_any_call") else { return };
    // A context of its own: the setting would reach the other tests' shared one.
    let own = GemmContext::new(d).unwrap();
    let ctx = &own;
    let mut r = rng(53);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let mut default_differs = false;
    for &(rows, cols) in &[(300usize, 200usize), (576, 2048), (33, 257), (102_400, 64), (7, 1408)] {
        let w = rand_bf16_bits(&mut r, rows * cols, 0.5);
        let (q, sc) = twin_quant(&w, rows, cols);
        for quant in [LinearQuant::Bf16, LinearQuant::Int8] {
            let lin = GpuLinear::new(d, "fixed rows", &w, rows, cols, quant).unwrap();
            let m = 2 * FIXED_ROWS + 37;
            let x = rand_f32(&mut r, m * cols, 2.0);
            let x_d = up(d, &x, "x");
            ctx.set_fixed_rows(Some(FIXED_ROWS));
            assert!(!lin.runs_alone(ctx, 1) && !lin.writes_bf16(ctx, m));
            let mut y = poisoned_f32(d, m * rows);
            lin.forward(d, ctx, &x_d, m, &mut y).unwrap();
            let whole = down(d, &y);
            let (wvals, scale) = match quant {
                LinearQuant::Bf16 => (to_f64(&from_bf16(&w)), vec![1.0; rows]),
                LinearQuant::Int8 => (to_f64(&q), to_f64(&sc)),
            };
            let what = format!("{quant:?} [{rows}x{cols}]");
            let (want, tol) = twin_linear(&round_bf16(&x), m, &wvals, &scale, rows, cols);
            assert_within(&what, &whole, &want, &tol);
            for (a, b) in [(0, 1), (5, 7), (3, 11), (37, 37 + FIXED_ROWS + 64), (m - 1, m), (1, m)] {
                let n = b - a;
                let xs = up(d, &x[a * cols..b * cols], "x rows");
                let mut ys = poisoned_f32(d, n * rows);
                lin.forward(d, ctx, &xs, n, &mut ys).unwrap();
                assert_eq!(bits(&down(d, &ys)), bits(&whole[a * rows..b * rows]), "{what}: rows {a}..{b}");
                ctx.set_fixed_rows(None);
                let mut yd = poisoned_f32(d, n * rows);
                lin.forward(d, ctx, &xs, n, &mut yd).unwrap();
                default_differs |= bits(&down(d, &yd)) != bits(&whole[a * rows..b * rows]);
                ctx.set_fixed_rows(Some(FIXED_ROWS));
            }
            // A group of parts (the GEMV's fused launch is off) equals one forward each.
            let other =
                GpuLinear::new(d, "fixed rows part", &w[..cols * rows.min(9)], rows.min(9), cols, quant).unwrap();
            for n in [1usize, 3, 9] {
                let xs = up(d, &x[..n * cols], "x rows");
                let (mut y1, mut y2) = (poisoned_f32(d, n * rows), poisoned_f32(d, n * rows.min(9)));
                GpuLinear::forward_group(d, ctx, &xs, n, &mut [(&lin, &mut y1), (&other, &mut y2)]).unwrap();
                assert_eq!(bits(&down(d, &y1)), bits(&whole[..n * rows]), "{what}: group, {n} rows");
            }
            ctx.set_fixed_rows(None);
        }
    }
    assert!(default_differs, "without fixed rows every split gave the same bits: the test shows nothing");
}

#[test]
fn int8_gemv_handles_unaligned_x() {
    let Some((d, ctx)) = gpu_gemm("int8_gemv_handles_unaligned_x") else { return };
    let mut r = rng(13);
    let (rows, cols, m) = (77, 256, 3);
    let w = rand_bf16_bits(&mut r, rows * cols, 1.0);
    let (q, s) = twin_quant(&w, rows, cols);
    let lin = GpuLinear::new(d, "unaligned", &w, rows, cols, LinearQuant::Int8).unwrap();
    let x = rand_f32(&mut r, m * cols + 1, 1.0);
    let (want, tol) = twin_linear(&x[1..], m, &to_f64(&q), &to_f64(&s), rows, cols);
    let x_d = up(d, &x, "x");
    forward_vs_twin(d, ctx, &lin, &x_d.slice().slice(1..), m, &want, &tol, "int8 unaligned x");
}

#[test]
fn linear_shape_errors_and_zero_m() {
    let Some((d, ctx)) = gpu_gemm("linear_shape_errors_and_zero_m") else { return };
    let w = vec![f32_to_bf16(1.0); 12];
    let e = GpuLinear::new(d, "bad", &w, 5, 3, LinearQuant::Bf16).unwrap_err();
    assert!(matches!(e, GpuError::Shape { .. }) && e.to_string().contains("bad"), "{e}");
    let e = GpuLinear::new(d, "empty", &[], 0, 3, LinearQuant::Int8).unwrap_err();
    assert!(matches!(e, GpuError::Shape { .. }), "{e}");
    let mut nan_w = w.clone();
    nan_w[7] = 0x7fc0;
    let e = GpuLinear::new(d, "nan", &nan_w, 4, 3, LinearQuant::Int8).unwrap_err();
    assert!(e.to_string().contains("row 2"), "{e}");
    for quant in [LinearQuant::Bf16, LinearQuant::Int8] {
        let lin = GpuLinear::new(d, "ok", &w, 4, 3, quant).unwrap();
        let x = up(d, &[1.0f32; 6], "x");
        let mut y = poisoned_f32(d, 8);
        let e = lin.forward(d, ctx, &x, 3, &mut y).unwrap_err();
        assert!(matches!(e, GpuError::Shape { .. }) && e.to_string().contains("x has 6"), "{e}");
        let mut y_bad = poisoned_f32(d, 7);
        let e = lin.forward(d, ctx, &x, 2, &mut y_bad).unwrap_err();
        assert!(e.to_string().contains("y has 7"), "{e}");
        // m = 0: nothing to do, not an error (empty views, no zero-byte allocation).
        let mut y0 = poisoned_f32(d, 1);
        lin.forward(d, ctx, &x.slice().slice(0..0), 0, &mut y0.slice_mut().slice_mut(0..0)).unwrap();
        lin.forward(d, ctx, &x, 2, &mut y).unwrap();
        for v in down(d, &y) {
            assert!((v - 3.0).abs() <= 1e-6, "{quant}: all-ones 4x3 weight times ones gave {v}");
        }
    }
    // A context belongs to its device handle's stream.
    let other = GpuDevice::open(d.info().ordinal, VramBudgetSpec::Auto).unwrap();
    let lin = GpuLinear::new(&other, "ok", &w, 4, 3, LinearQuant::Bf16).unwrap();
    let (x, mut y) = (up(&other, &[1.0f32; 3], "x"), up(&other, &[0.0f32; 4], "y"));
    let e = lin.forward(&other, ctx, &x, 1, &mut y).unwrap_err();
    assert!(e.to_string().contains("another GpuDevice"), "{e}");
}

#[test]
fn linear_over_budget_is_a_budget_error() {
    let Some((d, _)) = gpu_gemm("linear_over_budget_is_a_budget_error") else { return };
    let small = GpuDevice::open(d.info().ordinal, VramBudgetSpec::Bytes(64 << 20)).unwrap();
    let ctx = GemmContext::new(&small).unwrap(); // takes the 32 MiB cuBLAS workspace
    let (rows, cols) = (12288, 4096); // 96 MiB BF16, 48 MiB INT8: both over the remaining ~32 MiB
    let w = vec![f32_to_bf16(0.25); rows * cols];
    for quant in [LinearQuant::Bf16, LinearQuant::Int8] {
        let e = GpuLinear::new(&small, "lm_head", &w, rows, cols, quant).unwrap_err();
        assert!(matches!(e, GpuError::VramBudget { .. }), "{quant}: {e:?}");
        assert!(e.to_string().contains("lm_head"), "{e}");
        eprintln!("{quant}: {e}");
    }
    // A fitting layer still works, and a scratch that would not fit is a budget error too.
    let lin = GpuLinear::new(&small, "small", &w[..64 * 64], 64, 64, LinearQuant::Bf16).unwrap();
    let m = 40_000; // 40k x 64 BF16 x = 5 MiB scratch: fits
    let x = up(&small, &vec![1.0f32; m * 64], "x"); // 10 MiB
    let mut y = up(&small, &vec![0.0f32; m * 64], "y"); // 10 MiB
    lin.forward(&small, &ctx, &x, m, &mut y).unwrap();
    let e = ctx.reserve(&small, 1 << 30).unwrap_err();
    assert!(matches!(e, GpuError::VramBudget { .. }), "{e:?}");
    assert_eq!(down(&small, &y)[..4], [16.0f32; 4]);
}

/// BF16 decode timings for the lead on DeepSeek-V2-Lite's and GLM-4.5-Air's shapes: the GEMV
/// (each variant, and `forward`'s own choice) against the old conversion + cuBLAS path, then the
/// INT8 GEMV of the same weights, m = 1, 2, 4, 8. Printed as µs per call and weight GB/s; asserts
/// only that the runs complete.
#[test]
fn bf16_gemv_timings() {
    let Some((d, ctx)) = gpu_gemm("bf16_gemv_timings") else { return };
    let mut r = rng(19);
    let sms = d.info().multiprocessors as usize;
    let shapes = [
        ("q_proj", 3072usize, 2048usize),
        ("kv_a_proj", 576, 2048),
        ("kv_b_proj", 4096, 512),
        ("o_proj", 2048, 2048),
        ("shared gate_up", 2816, 2048),
        ("shared down", 2048, 2816),
        ("lm_head", 102400, 2048),
        // GLM-4.5-Air: q/k/v as one launch, o_proj (K = 96 heads x 128), the dense layer's down.
        ("glm qkv", 14336, 4096),
        ("glm o_proj", 4096, 12288),
        ("glm dense down", 4096, 10944),
    ];
    for (name, rows, cols) in shapes {
        let w = rand_bf16_bits(&mut r, rows * cols, 0.1);
        let mut lin = GpuLinear::new(d, name, &w, rows, cols, LinearQuant::Bf16).unwrap();
        for m in [1usize, 2, 4, 8] {
            let x = up(d, &rand_f32(&mut r, m * cols, 1.0), "x");
            let mut y = d.alloc_zeros::<f32>(m * rows, "y").unwrap();
            let auto = bf16_gemv_rows_per_warp(rows, m, sms);
            let mut line = format!("bf16 {name:<14} [{rows}x{cols}] m={m} (auto r{auto}):");
            for (label, path) in [
                ("cublas", Bf16Path::Cublas),
                ("gemv r1", Bf16Path::Gemv { rows_per_warp: 1 }),
                ("gemv r4", Bf16Path::Gemv { rows_per_warp: 4 }),
                ("auto", Bf16Path::Auto),
            ] {
                lin.set_bf16_path(path);
                lin.forward(d, ctx, &x, m, &mut y).unwrap(); // warm-up: compiles, scratch
                let us = time_us_per_call(d, 50, || lin.forward(d, ctx, &x, m, &mut y).unwrap());
                let gbs = lin.weight_bytes() as f64 / (us * 1e-6) / 1e9;
                line += &format!("  {label} {us:.1} us {gbs:.0} GB/s");
            }
            eprintln!("{line}");
        }
        let lin = GpuLinear::new(d, name, &w, rows, cols, LinearQuant::Int8).unwrap();
        for m in [1usize, 2, 4, 8] {
            let x = up(d, &rand_f32(&mut r, m * cols, 1.0), "x");
            let mut y = d.alloc_zeros::<f32>(m * rows, "y").unwrap();
            lin.forward(d, ctx, &x, m, &mut y).unwrap(); // warm-up: compiles
            let us = time_us_per_call(d, 50, || lin.forward(d, ctx, &x, m, &mut y).unwrap());
            let gbs = lin.weight_bytes() as f64 / (us * 1e-6) / 1e9;
            let auto = int8_gemv_rows_per_warp(rows, sms);
            eprintln!("int8 {name:<14} [{rows}x{cols}] m={m} (r{auto}): {us:.1} us {gbs:.0} GB/s");
        }
    }
}

/// Timings for the lead (printed; asserts only that the runs complete).
#[test]
fn linear_timings() {
    let Some((d, ctx)) = gpu_gemm("linear_timings") else { return };
    let mut r = rng(14);
    for &(rows, cols) in &[(4096usize, 4096usize), (7168, 2048), (2048, 7168)] {
        let w = rand_bf16_bits(&mut r, rows * cols, 0.1);
        for quant in [LinearQuant::Bf16, LinearQuant::Int8] {
            let lin = GpuLinear::new(d, "timed", &w, rows, cols, quant).unwrap();
            for m in [1usize, 8, 512] {
                let x = up(d, &rand_f32(&mut r, m * cols, 1.0), "x");
                let mut y = d.alloc_zeros::<f32>(m * rows, "y").unwrap();
                lin.forward(d, ctx, &x, m, &mut y).unwrap(); // warm-up: compiles, scratch
                let us = time_us_per_call(d, 20, || lin.forward(d, ctx, &x, m, &mut y).unwrap());
                let gbs = lin.weight_bytes() as f64 / (us * 1e-6) / 1e9;
                let tflops = 2.0 * (m * rows * cols) as f64 / (us * 1e-6) / 1e12;
                eprintln!("{quant} [{rows}x{cols}] m={m}: {us:.1} us, weights {gbs:.0} GB/s, {tflops:.2} TFLOP/s");
            }
        }
    }
}
