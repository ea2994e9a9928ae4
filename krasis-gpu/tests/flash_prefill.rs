//! Causal prefill attention (all three kernels) against an f64 twin in plain loops, on random and
//! ragged shapes, MLA two-part and GQA layouts, packed strided views, a continued prefix, and one
//! 10K-token context. Inputs are BF16-exact; outputs are poisoned with NaN before each launch.
//!
//! Tolerances (relative to `vmax = max |v|`, the scale of every output):
//! - SIMT: f32 dot products and an f32 online softmax. Score errors are ~1e-6 and the running sum
//!   over S ≤ 10K keys drifts by ~√S·2⁻²⁴; `1e-4·vmax` leaves a wide margin.
//! - MMA: Q·K and P·V accumulate in f32, but P is rounded to BF16 (relative error ≤ 2⁻⁹ per weight)
//!   before P·V while the denominator sums the unrounded P, so
//!   `|out − exact| ≤ Σ p_s·2⁻⁹·|v_s| / Σ p_s ≤ 2⁻⁹·vmax`. The test allows twice that, `2⁻⁸·vmax`.
//!   Small-T cases (T ≤ 200, few keys per row) still catch a wrong mask or swapped fragment
//!   elements: those move outputs by a sizeable fraction of `vmax`. The fixed-dims MMA kernel
//!   makes the same roundings (its exp2 is the approximate one, ≤ 2 ulp: far inside the bound).
//!
//! Without a GPU every test prints "SKIPPED: no GPU" and passes; `KRASIS_REQUIRE_GPU=1` fails instead.

#![allow(clippy::needless_range_loop)] // the twin is plain index loops on purpose

mod common;

use common::{gpu, poisoned_f32, rand_bf16_f32, rng, round_bf16, to_bf16, up};
use krasis_gpu::cudarc::driver::DevicePtr;
use krasis_gpu::{
    bench_gqa_prefill, bench_mla_prefill, AttnOptions, DeviceBuffer, FlashKernel, FlashPrefillArgs, GpuDevice,
    GpuError, HeadsLayout,
};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// SIMT tolerance as a fraction of max |v| (see the module docs).
const SIMT_TOL: f64 = 1e-4;
/// MMA tolerance: twice the 2⁻⁹·vmax bound of rounding P to BF16.
const MMA_TOL: f64 = 1.0 / 256.0;

/// One input tensor: which host buffer, from which element, with which layout.
#[derive(Clone, Copy, Debug)]
struct Tensor {
    buf: usize,
    offset: usize,
    layout: HeadsLayout,
}

/// A test case: the call's arguments and where each tensor lives.
struct Case {
    name: String,
    args: FlashPrefillArgs,
    /// BF16-exact host buffers.
    bufs: Vec<Vec<f32>>,
    q_a: Tensor,
    q_b: Option<Tensor>,
    k_a: Tensor,
    k_b: Option<Tensor>,
    v: Tensor,
    out_len: usize,
}

/// Separate contiguous buffers; part b's key shared by all heads.
#[allow(clippy::too_many_arguments)]
fn contiguous_case(
    r: &mut ChaCha8Rng,
    name: &str,
    (n_q, q_start, extra_kv): (usize, usize, usize),
    (heads, kv_heads): (usize, usize),
    (da, db, dv): (usize, usize, usize),
    score_gain: f32,
) -> Case {
    let n_kv = q_start + n_q + extra_kv;
    let lay = |h: usize, d: usize| HeadsLayout::contiguous(h, d);
    let mut bufs = vec![
        rand_bf16_f32(r, n_q * heads * da, score_gain),
        rand_bf16_f32(r, n_kv * kv_heads * da, 1.0),
        rand_bf16_f32(r, n_kv * kv_heads * dv, 1.5),
    ];
    let t = |buf, layout| Tensor { buf, offset: 0, layout };
    let (q_b, k_b, lq_b, lk_b) = if db > 0 {
        bufs.push(rand_bf16_f32(r, n_q * heads * db, score_gain));
        bufs.push(rand_bf16_f32(r, n_kv * db, 1.0));
        (Some(t(3, lay(heads, db))), Some(t(4, HeadsLayout::shared(db))), lay(heads, db), HeadsLayout::shared(db))
    } else {
        (None, None, HeadsLayout::none(), HeadsLayout::none())
    };
    let args = FlashPrefillArgs {
        n_q,
        n_kv,
        q_start,
        heads,
        kv_heads,
        scale: 1.0 / ((da + db) as f32).sqrt(),
        q_a: lay(heads, da),
        q_b: lq_b,
        k_a: lay(kv_heads, da),
        k_b: lk_b,
        v: lay(kv_heads, dv),
        out: lay(heads, dv),
    };
    Case {
        name: format!("{name} T={n_q} S={n_kv} q_start={q_start} heads={heads}/{kv_heads} dims={da}+{db}/{dv}"),
        args,
        bufs,
        q_a: t(0, args.q_a),
        q_b,
        k_a: t(1, args.k_a),
        k_b,
        v: t(2, args.v),
        out_len: n_q * heads * dv,
    }
}

/// The engine's MLA layout: q `[T, H, da+db]` (nope then rope), kv_b output `[S, H, da+dv]` (k
/// nope then v), rope key inside a latent row `[S, lat+db]` at offset `lat`; optionally a
/// heads-major `[H, T, dv]` output.
#[allow(clippy::too_many_arguments)]
fn packed_mla_case(
    r: &mut ChaCha8Rng,
    name: &str,
    (n_q, q_start): (usize, usize),
    heads: usize,
    (da, db, dv, lat): (usize, usize, usize, usize),
    heads_major_out: bool,
) -> Case {
    let n_kv = q_start + n_q;
    let (qw, kvw, lw) = (da + db, da + dv, lat + db);
    let bufs = vec![
        rand_bf16_f32(r, n_q * heads * qw, 2.0),
        rand_bf16_f32(r, n_kv * heads * kvw, 1.0),
        rand_bf16_f32(r, n_kv * lw, 1.0),
    ];
    let l = |ts, hs, dim| HeadsLayout { token_stride: ts, head_stride: hs, dim };
    let out = if heads_major_out { l(dv, n_q * dv, dv) } else { l(heads * dv, dv, dv) };
    let args = FlashPrefillArgs {
        n_q,
        n_kv,
        q_start,
        heads,
        kv_heads: heads,
        scale: 1.0 / (qw as f32).sqrt(),
        q_a: l(heads * qw, qw, da),
        q_b: l(heads * qw, qw, db),
        k_a: l(heads * kvw, kvw, da),
        k_b: l(lw, 0, db),
        v: l(heads * kvw, kvw, dv),
        out,
    };
    Case {
        name: format!("{name} packed MLA T={n_q} q_start={q_start} heads={heads} dims={da}+{db}/{dv}"),
        args,
        bufs,
        q_a: Tensor { buf: 0, offset: 0, layout: args.q_a },
        q_b: Some(Tensor { buf: 0, offset: da, layout: args.q_b }),
        k_a: Tensor { buf: 1, offset: 0, layout: args.k_a },
        k_b: Some(Tensor { buf: 2, offset: lat, layout: args.k_b }),
        v: Tensor { buf: 1, offset: da, layout: args.v },
        out_len: n_q * heads * dv,
    }
}

fn at(c: &Case, t: &Tensor, tok: usize, head: usize, d: usize) -> f64 {
    c.bufs[t.buf][t.offset + tok * t.layout.token_stride + head * t.layout.head_stride + d] as f64
}

/// The f64 twin for query rows `rows`: `[rows.len(), heads, dv]`.
fn twin(c: &Case, rows: &[usize]) -> Vec<f64> {
    twin_opts(c, rows, None, None)
}

/// [`twin`] with a sliding window (query `i` sees keys `q_start + i − w < s ≤ q_start + i`) and
/// per-head sink logits (one more softmax column whose probability is dropped).
fn twin_opts(c: &Case, rows: &[usize], window: Option<usize>, sinks: Option<&[f32]>) -> Vec<f64> {
    let a = &c.args;
    let (dv, group) = (a.v.dim, a.heads / a.kv_heads);
    let mut out = vec![0.0f64; rows.len() * a.heads * dv];
    let mut scores = Vec::new();
    for (ri, &i) in rows.iter().enumerate() {
        for h in 0..a.heads {
            let g = h / group;
            scores.clear();
            let first = window.map_or(0, |w| (a.q_start + i + 1).saturating_sub(w));
            for s in first..=a.q_start + i {
                let mut dot = 0.0f64;
                for d in 0..a.q_a.dim {
                    dot += at(c, &c.q_a, i, h, d) * at(c, &c.k_a, s, g, d);
                }
                if let (Some(qb), Some(kb)) = (&c.q_b, &c.k_b) {
                    for d in 0..a.q_b.dim {
                        dot += at(c, qb, i, h, d) * at(c, kb, s, g, d);
                    }
                }
                scores.push(dot * a.scale as f64);
            }
            let sink = sinks.map_or(f64::NEG_INFINITY, |s| s[h] as f64);
            let m = scores.iter().cloned().fold(sink, f64::max);
            let z: f64 = scores.iter().map(|x| (x - m).exp()).sum::<f64>() + (sink - m).exp();
            let o = &mut out[(ri * a.heads + h) * dv..][..dv];
            for (j, x) in scores.iter().enumerate() {
                let w = (x - m).exp() / z;
                for d in 0..dv {
                    o[d] += w * at(c, &c.v, first + j, g, d);
                }
            }
        }
    }
    out
}

struct Uploaded {
    bufs: Vec<DeviceBuffer<u16>>,
}

fn upload(d: &GpuDevice, c: &Case) -> Uploaded {
    Uploaded { bufs: c.bufs.iter().map(|b| up(d, &to_bf16(b), "test input")).collect() }
}

/// Runs `kernel` (or the automatic choice) on a NaN-poisoned output and downloads it.
fn run(d: &GpuDevice, c: &Case, u: &Uploaded, kernel: Option<FlashKernel>) -> Result<Vec<f32>, GpuError> {
    run_opts(d, c, u, kernel, &AttnOptions::default())
}

/// [`run`] with the attention options.
fn run_opts(
    d: &GpuDevice,
    c: &Case,
    u: &Uploaded,
    kernel: Option<FlashKernel>,
    opts: &AttnOptions<'_>,
) -> Result<Vec<f32>, GpuError> {
    let view = |t: &Tensor| u.bufs[t.buf].slice().slice(t.offset..);
    let (q_a, k_a, v) = (view(&c.q_a), view(&c.k_a), view(&c.v));
    let q_b = c.q_b.as_ref().map(view);
    let k_b = c.k_b.as_ref().map(view);
    let qb = q_b.as_ref().map(|x| x as &dyn DevicePtr<u16>);
    let kb = k_b.as_ref().map(|x| x as &dyn DevicePtr<u16>);
    let mut out = poisoned_f32(d, c.out_len);
    match kernel {
        Some(k) => d.flash_prefill_with_opts(k, &c.args, opts, &q_a, qb, &k_a, kb, &v, &mut out)?,
        None => d.flash_prefill_opts(&c.args, opts, &q_a, qb, &k_a, kb, &v, &mut out)?,
    }
    d.download(&out)
}

/// Compares rows `rows` of `got` with the twin; returns the worst err/tol.
fn compare(what: &str, c: &Case, got: &[f32], rows: &[usize], want: &[f64], tol_frac: f64) -> f64 {
    let a = &c.args;
    let vmax = c.bufs[c.v.buf].iter().fold(0.0f64, |m, &x| m.max((x as f64).abs())).max(1e-30);
    let tol = tol_frac * vmax;
    let mut worst = 0.0f64;
    for (ri, &i) in rows.iter().enumerate() {
        for h in 0..a.heads {
            for dd in 0..a.v.dim {
                let g = got[i * a.out.token_stride + h * a.out.head_stride + dd] as f64;
                let w = want[(ri * a.heads + h) * a.v.dim + dd];
                let err = (g - w).abs();
                assert!(
                    err <= tol,
                    "{what}: {}: out[{i}, {h}, {dd}] = {g}, want {w} (err {err:e} > tol {tol:e})",
                    c.name
                );
                worst = worst.max(err / tol);
            }
        }
    }
    worst
}

/// Every kernel (each MMA kernel where it supports the shapes; otherwise forcing it must be a
/// shape error) and the automatic choice, against the twin on `rows` (all rows when `None`). The
/// rule must pick the fastest kernel that ran.
fn check_case(d: &GpuDevice, c: &Case, rows: Option<&[usize]>) {
    let all: Vec<usize> = (0..c.args.n_q).collect();
    let rows = rows.unwrap_or(&all);
    let want = twin(c, rows);
    let u = upload(d, c);
    let got = run(d, c, &u, Some(FlashKernel::Simt)).unwrap_or_else(|e| panic!("{}: {e}", c.name));
    let w_simt = compare("simt", c, &got, rows, &want, SIMT_TOL);
    let auto = d.flash_prefill_kernel(&c.args).unwrap();
    let mut line = format!("{}: simt err/tol {w_simt:.3}", c.name);
    let mut ran = Vec::new();
    let mut misaligned = Vec::new();
    for k in [FlashKernel::Mma, FlashKernel::MmaFixed, FlashKernel::Wgmma] {
        match run(d, c, &u, Some(k)) {
            Ok(got) => {
                let w = compare(&k.to_string(), c, &got, rows, &want, MMA_TOL);
                line += &format!(", {k} err/tol {w:.3}");
                ran.push(k);
            }
            Err(e) => {
                assert!(matches!(e, GpuError::Shape { .. }), "{}: {k}: {e:?}", c.name);
                if k >= FlashKernel::MmaFixed && e.to_string().contains("aligned") {
                    misaligned.push(k);
                }
                line += &format!(", {k} refused ({e})");
            }
        }
    }
    // flash_prefill_kernel assumes aligned buffers; a misaligned view only demotes the fixed-dims
    // kernels (to Mma, inside flash_prefill).
    let fastest = ran.iter().chain(&misaligned).copied().max().unwrap_or(FlashKernel::Simt);
    assert_eq!(auto, fastest, "{}: the rule picks {auto}, the fastest kernel that runs is {fastest}", c.name);
    let got = run(d, c, &u, None).unwrap_or_else(|e| panic!("{}: {e}", c.name));
    compare("auto", c, &got, rows, &want, if auto == FlashKernel::Simt { SIMT_TOL } else { MMA_TOL });
    eprintln!("{line}; auto = {auto}");
}

/// gpt-oss's options in every kernel (each where it supports the shapes) and the automatic
/// choice, against the twin: sliding windows of 1 key, shorter than a key tile, across tiles and
/// longer than the context, with and without sink logits (one far above every score), on ragged
/// shapes, gpt-oss's heads (64 over 8 of 64), the fixed-dims and wgmma GQA shape, a continued
/// prefix and MLA's two-part layout.
#[test]
fn flash_prefill_windows_and_sinks_match_twin() {
    let Some(d) = gpu("flash_prefill_windows_and_sinks_match_twin") else { return };
    let mut r = rng(44);
    let cases = [
        // (name, (T, q_start, extra keys), (heads, kv_heads), (da, db, dv))
        ("gpt-oss heads", (200, 0, 0), (64, 8), (64, 0, 64)),
        ("gpt-oss continued", (70, 150, 0), (16, 2), (64, 0, 64)),
        ("fixed gqa", (300, 0, 0), (4, 2), (128, 0, 128)),
        ("fixed gqa late", (1, 260, 0), (2, 1), (128, 0, 128)),
        ("mla two parts", (150, 20, 3), (2, 2), (128, 64, 128)),
        ("ragged", (67, 9, 2), (6, 3), (13, 0, 11)),
        ("ragged two parts", (33, 0, 0), (3, 1), (20, 7, 9)),
        ("one query", (1, 0, 0), (2, 2), (16, 0, 16)),
    ];
    for (name, tq, hh, dims) in cases {
        let c = contiguous_case(&mut r, name, tq, hh, dims, 2.0);
        let u = upload(d, &c);
        let heads = c.args.heads;
        let mut sinks = rand_bf16_f32(&mut r, heads, 3.0);
        sinks[heads - 1] = 40.0; // far above every score
        let sinks_d = up(d, &to_bf16(&sinks), "sinks");
        let rows: Vec<usize> = (0..c.args.n_q).collect();
        for window in [Some(1usize), Some(7), Some(64), Some(100), Some(129), Some(1000), None] {
            for with_sinks in [false, true] {
                if window.is_none() && !with_sinks {
                    continue; // flash_prefill_matches_twin_on_ragged_shapes
                }
                let opts = AttnOptions { window, sinks: with_sinks.then_some(&sinks_d) };
                let want = twin_opts(&c, &rows, window, with_sinks.then_some(&sinks[..]));
                let what = |k: &str| format!("{k} window {window:?} sinks {with_sinks}");
                let got = run_opts(d, &c, &u, Some(FlashKernel::Simt), &opts).unwrap();
                compare(&what("simt"), &c, &got, &rows, &want, SIMT_TOL);
                let mut ran = vec![FlashKernel::Simt];
                for k in [FlashKernel::Mma, FlashKernel::MmaFixed, FlashKernel::Wgmma] {
                    match run_opts(d, &c, &u, Some(k), &opts) {
                        Ok(got) => {
                            compare(&what(&k.to_string()), &c, &got, &rows, &want, MMA_TOL);
                            ran.push(k);
                        }
                        Err(e) => assert!(matches!(e, GpuError::Shape { .. }), "{}: {k}: {e:?}", c.name),
                    }
                }
                let got = run_opts(d, &c, &u, None, &opts).unwrap();
                let auto = d.flash_prefill_kernel(&c.args).unwrap();
                compare(
                    &what("auto"),
                    &c,
                    &got,
                    &rows,
                    &want,
                    if auto == FlashKernel::Simt { SIMT_TOL } else { MMA_TOL },
                );
                eprintln!("{}: window {window:?} sinks {with_sinks}: ran {ran:?}, auto {auto}", c.name);
            }
        }
    }
    // Bad options are shape errors.
    let c = contiguous_case(&mut r, "bad options", (4, 0, 0), (2, 1), (16, 0, 16), 2.0);
    let u = upload(d, &c);
    let three = up(d, &[0u16; 3], "sinks");
    for opts in [AttnOptions { window: Some(0), sinks: None }, AttnOptions { window: None, sinks: Some(&three) }] {
        let e = run_opts(d, &c, &u, None, &opts);
        assert!(matches!(e, Err(GpuError::Shape { .. })), "{opts:?}: {e:?}");
    }
}

/// Tolerance of the SIMT kernel over f32 inputs, as a fraction of max |v|: f32 products and an
/// f32 online softmax (errors ~1e-6 at these context lengths). Rounding the inputs to BF16 moves
/// outputs by ~2⁻⁹·vmax, far outside it (asserted below), so the test sees any rounding.
const F32_TOL: f64 = 1e-5;

/// The precise mode's attention: the SIMT kernel over f32 q, k and v
/// (`GpuDevice::flash_prefill_f32`, and `flash_prefill_opts` over f32, which takes the same
/// kernel) against the f64 twin on inputs that are not BF16-exact, on ragged shapes, MLA's two
/// parts, GQA groups, a continued prefix, windows and sinks. A forced tensor-core kernel over f32
/// is a shape error.
#[test]
fn flash_prefill_f32_matches_twin_without_rounding() {
    let Some(d) = gpu("flash_prefill_f32_matches_twin_without_rounding") else { return };
    let mut r = rng(47);
    let cases = [
        ("single query", (1, 0, 0), (2, 2), (16, 0, 16)),
        ("decode-like", (1, 37, 5), (4, 1), (24, 8, 16)),
        ("odd dims", (70, 0, 0), (3, 3), (13, 7, 11)),
        ("gqa x4 continued", (130, 64, 3), (8, 2), (40, 0, 40)),
        ("mla", (77, 10, 0), (2, 1), (128, 64, 128)),
        ("wide heads", (40, 3, 0), (4, 2), (256, 0, 256)),
        ("dim 1", (9, 2, 0), (2, 1), (1, 1, 1)),
    ];
    let mut rounding_moves = 0.0f64;
    for (name, tq, hh, dims) in cases {
        let mut c = contiguous_case(&mut r, name, tq, hh, dims, 2.0);
        // Under BF16's last bit: a relative change in (2⁻¹², 2⁻⁸), so BF16 rounding loses it.
        for b in c.bufs.iter_mut() {
            for x in b.iter_mut() {
                *x *= 1.0 + r.random_range(1.0f32..16.0) * (2.0f32).powi(-12);
            }
        }
        let rows: Vec<usize> = (0..c.args.n_q).collect();
        let bufs: Vec<DeviceBuffer<f32>> = c.bufs.iter().map(|b| up(d, b, "test input")).collect();
        let view = |t: &Tensor| bufs[t.buf].slice().slice(t.offset..);
        let (q_a, k_a, v) = (view(&c.q_a), view(&c.k_a), view(&c.v));
        let (q_b, k_b) = (c.q_b.as_ref().map(view), c.k_b.as_ref().map(view));
        let qb = q_b.as_ref().map(|x| x as &dyn DevicePtr<f32>);
        let kb = k_b.as_ref().map(|x| x as &dyn DevicePtr<f32>);
        let heads = c.args.heads;
        let mut sinks = rand_bf16_f32(&mut r, heads, 3.0);
        sinks[heads - 1] = 40.0;
        let sinks_d = up(d, &to_bf16(&sinks), "sinks");
        for (window, with_sinks) in [(None, false), (Some(7), false), (None, true), (Some(64), true)] {
            let opts = AttnOptions { window, sinks: with_sinks.then_some(&sinks_d) };
            let want = twin_opts(&c, &rows, window, with_sinks.then_some(&sinks[..]));
            let mut out = poisoned_f32(d, c.out_len);
            d.flash_prefill_f32(&c.args, &opts, &q_a, qb, &k_a, kb, &v, &mut out).unwrap();
            let what = format!("f32 window {window:?} sinks {with_sinks}");
            let w = compare(&what, &c, &d.download(&out).unwrap(), &rows, &want, F32_TOL);
            let mut out = poisoned_f32(d, c.out_len);
            d.flash_prefill_opts(&c.args, &opts, &q_a, qb, &k_a, kb, &v, &mut out).unwrap();
            compare(&format!("{what} (opts)"), &c, &d.download(&out).unwrap(), &rows, &want, F32_TOL);
            eprintln!("{}: {what}: err/tol {w:.3}", c.name);
        }
        // What BF16 rounding of the same inputs would have cost (the twin on rounded values).
        let rounded = Case { name: c.name.clone(), bufs: c.bufs.iter().map(|b| round_bf16(b)).collect(), ..c };
        let vmax = c.bufs[c.v.buf].iter().fold(0.0f64, |m, &x| m.max((x as f64).abs()));
        let (exact, of_rounded) = (twin(&c, &rows), twin(&rounded, &rows));
        let moved = exact.iter().zip(&of_rounded).fold(0.0f64, |m, (a, b)| m.max((a - b).abs())) / vmax;
        rounding_moves = rounding_moves.max(moved);
        for k in [FlashKernel::Mma, FlashKernel::MmaFixed, FlashKernel::Wgmma] {
            let mut out = poisoned_f32(d, c.out_len);
            let e = d.flash_prefill_with_opts(k, &c.args, &AttnOptions::default(), &q_a, qb, &k_a, kb, &v, &mut out);
            assert!(matches!(e, Err(GpuError::Shape { .. })), "{}: {k} over f32: {e:?}", c.name);
        }
    }
    assert!(rounding_moves > 10.0 * F32_TOL, "BF16 rounding moved outputs by only {rounding_moves:.2e} of vmax");
}

/// The options of the twin on known answers (runs without a GPU): a window of one key gives each
/// row its own value; a sink equal to the row's only score halves it.
#[test]
fn twin_options_have_known_answers() {
    let mut r = rng(45);
    let c = contiguous_case(&mut r, "twin options", (3, 0, 0), (1, 1), (4, 0, 2), 1.0);
    let own = twin_opts(&c, &[0, 1, 2], Some(1), None);
    for i in 0..3 {
        for dd in 0..2 {
            assert!((own[i * 2 + dd] - c.bufs[2][i * 2 + dd] as f64).abs() < 1e-12);
        }
    }
    let s0 = (0..4).map(|dd| c.bufs[0][dd] as f64 * c.bufs[1][dd] as f64).sum::<f64>() * c.args.scale as f64;
    let half = twin_opts(&c, &[0], None, Some(&[s0 as f32]));
    for dd in 0..2 {
        let want = c.bufs[2][dd] as f64 / (1.0 + ((s0 as f32) as f64 - s0).exp());
        assert!((half[dd] - want).abs() < 1e-9, "{} vs {want}", half[dd]);
    }
}

/// The twin itself, on cases with known answers (runs without a GPU): one visible key gives that
/// key's value; equal keys give the mean of the visible values; a dominant key takes all weight.
#[test]
fn twin_has_known_answers() {
    let mut r = rng(40);
    let mut c = contiguous_case(&mut r, "twin", (4, 0, 2), (2, 1), (8, 4, 5), 1.0);
    let (da, db, dv) = (8, 4, 5);
    // Row 0 sees key 0 only.
    let want = twin(&c, &[0]);
    for h in 0..2 {
        for d in 0..dv {
            assert!((want[h * dv + d] - c.bufs[2][d] as f64).abs() < 1e-12);
        }
    }
    // All keys equal: row 3 (keys 0..=3) averages v over those keys, not over keys 4..5.
    let k0a: Vec<f32> = c.bufs[1][..da].to_vec();
    let k0b: Vec<f32> = c.bufs[4][..db].to_vec();
    for s in 0..6 {
        c.bufs[1][s * da..(s + 1) * da].copy_from_slice(&k0a);
        c.bufs[4][s * db..(s + 1) * db].copy_from_slice(&k0b);
    }
    let want = twin(&c, &[3]);
    for d in 0..dv {
        let mean = (0..4).map(|s| c.bufs[2][s * dv + d] as f64).sum::<f64>() / 4.0;
        assert!((want[d] - mean).abs() < 1e-12, "{} vs {mean}", want[d]);
    }
    // Key 2 aligned with a huge query of head 1: row 3's head-1 output is v[2].
    for x in c.bufs[1][2 * da..3 * da].iter_mut() {
        *x = 1.0;
    }
    for x in c.bufs[0][(3 * 2 + 1) * da..(3 * 2 + 2) * da].iter_mut() {
        *x = 512.0;
    }
    let want = twin(&c, &[3]);
    for d in 0..dv {
        assert!((want[dv + d] - c.bufs[2][2 * dv + d] as f64).abs() < 1e-9);
    }
}

#[test]
fn flash_prefill_matches_twin_on_ragged_shapes() {
    let Some(d) = gpu("flash_prefill_matches_twin_on_ragged_shapes") else { return };
    let mut r = rng(41);
    let cases = [
        // (name, (T, q_start, extra keys), (heads, kv_heads), (da, db, dv), score gain)
        ("single query", (1, 0, 0), (2, 2), (16, 0, 16), 2.0),
        ("decode-like", (1, 37, 5), (4, 1), (24, 8, 16), 2.0),
        ("three", (3, 0, 0), (4, 4), (8, 0, 8), 2.0),
        ("three continued", (3, 5, 2), (8, 2), (48, 16, 24), 2.0),
        ("dim 1", (9, 2, 0), (2, 1), (1, 1, 1), 2.0),
        ("odd dims", (70, 0, 0), (3, 3), (13, 7, 11), 2.0),
        ("gqa x8", (200, 0, 0), (8, 1), (24, 0, 48), 2.0),
        ("gqa x4", (130, 64, 3), (8, 2), (40, 0, 40), 2.0),
        ("sharp softmax", (65, 0, 0), (2, 2), (64, 0, 32), 12.0),
        ("mma max qk", (77, 10, 0), (2, 1), (192, 64, 128), 2.0),
        ("simt only qk", (33, 0, 0), (2, 2), (200, 56, 64), 2.0),
        ("simt only v", (40, 3, 0), (4, 2), (256, 0, 256), 2.0),
        ("fixed mla", (77, 10, 0), (2, 1), (128, 64, 128), 2.0),
        ("fixed mla two tiles", (200, 0, 0), (4, 4), (128, 64, 128), 2.0),
        ("fixed zero-filled dims", (131, 5, 2), (4, 2), (120, 56, 112), 2.0),
        ("fixed gqa", (257, 0, 0), (8, 2), (128, 0, 128), 2.0),
        ("fixed small dims", (129, 64, 1), (2, 2), (8, 8, 8), 2.0),
        ("fixed sharp", (129, 0, 0), (2, 2), (64, 0, 32), 12.0),
        ("fixed one query late", (1, 300, 0), (2, 1), (128, 0, 128), 2.0),
        // Three 128-key tiles of the wgmma GQA kernel in one query block, a late query over two.
        ("gqa key tiles", (300, 0, 0), (2, 1), (128, 0, 128), 2.0),
        ("gqa late query", (1, 200, 0), (2, 1), (128, 0, 128), 2.0),
    ];
    for (name, tq, hh, dims, gain) in cases {
        check_case(d, &contiguous_case(&mut r, name, tq, hh, dims, gain), None);
    }
    // Random shapes.
    for k in 0..16 {
        let heads = [1, 2, 4, 8][r.random_range(0..4)];
        let divisors: Vec<usize> = [1, 2, 4, 8].into_iter().filter(|&g| heads % g == 0).collect();
        let kv_heads = divisors[r.random_range(0..divisors.len())];
        let n_q = [1, 2, 3, 17, 63, 64, 65, 130][r.random_range(0..8)];
        let q_start = if r.random_bool(0.5) { 0 } else { r.random_range(0..100) };
        let db = if r.random_bool(0.5) { 0 } else { r.random_range(1..=40) };
        let dims: (usize, usize, usize) = (r.random_range(1..=80), db, r.random_range(1..=72));
        // Half the cases in multiples of 8 (the fixed-dims kernel's domain).
        let dims = if r.random_bool(0.5) {
            (dims.0.div_ceil(8) * 8, dims.1.div_ceil(8) * 8, dims.2.div_ceil(8) * 8)
        } else {
            dims
        };
        let extra = r.random_range(0..4);
        let c = contiguous_case(&mut r, &format!("random {k}"), (n_q, q_start, extra), (heads, kv_heads), dims, 2.0);
        check_case(d, &c, None);
    }
}

#[test]
fn flash_prefill_engine_layouts() {
    let Some(d) = gpu("flash_prefill_engine_layouts") else { return };
    let mut r = rng(42);
    // DeepSeek-V2-Lite: 16 heads, nope 128 + rope 64, v 128, rope key inside the 512+64 latent row.
    check_case(d, &packed_mla_case(&mut r, "V2-Lite", (200, 0), 16, (128, 64, 128, 512), false), None);
    // Continuing a 300-token prefix, heads-major output.
    check_case(d, &packed_mla_case(&mut r, "V2-Lite prefix", (77, 300), 16, (128, 64, 128, 512), true), None);
    // Ragged fixture-sized MLA (not 16-byte aligned: the plain-load path).
    check_case(d, &packed_mla_case(&mut r, "tiny MLA", (50, 7), 4, (12, 6, 10, 5), false), None);
    check_case(d, &packed_mla_case(&mut r, "tiny MLA aligned", (90, 0), 4, (16, 8, 24, 8), true), None);
    // Qwen3 GQA: 32 q heads over 4 kv heads of 128.
    check_case(d, &contiguous_case(&mut r, "Qwen3 GQA", (130, 0, 0), (32, 4), (128, 0, 128), 2.0), None);
    // A non-positive scale: both MMA kernels fold the scale into the exp2, so only SIMT runs it.
    let mut neg = contiguous_case(&mut r, "negative scale", (70, 0, 0), (2, 2), (128, 0, 128), 2.0);
    neg.args.scale = -neg.args.scale;
    check_case(d, &neg, None);
}

#[test]
fn flash_prefill_long_context_10k_tokens() {
    let Some(d) = gpu("flash_prefill_long_context_10k_tokens") else { return };
    let mut r = rng(43);
    let t = 10_240;
    let c = contiguous_case(&mut r, "10K", (t, 0, 0), (4, 2), (32, 16, 32), 2.0);
    // Rows at tile edges, the very end, and a few random ones.
    let mut rows = vec![0, 1, 63, 64, 65, 127, 4095, 4096, 8191, 10_175, 10_176, t - 2, t - 1];
    rows.extend((0..12).map(|_| r.random_range(0..t)));
    let want = twin(&c, &rows);
    let u = upload(d, &c);
    // Warm up (module load) before measuring: the op itself must allocate nothing.
    run(d, &c, &u, Some(FlashKernel::Simt)).unwrap();
    let used = d.budget().used();
    let mut line = format!("{}:", c.name);
    for k in [FlashKernel::Simt, FlashKernel::Mma, FlashKernel::MmaFixed, FlashKernel::Wgmma] {
        let got = match run(d, &c, &u, Some(k)) {
            Ok(got) => got,
            Err(e) if k == FlashKernel::Wgmma && !d.target().arch_specific() => {
                line += &format!(" {k} refused ({e})");
                continue;
            }
            Err(e) => panic!("{k}: {e}"),
        };
        // The only extra allocation is the test's own poisoned output (freed on return).
        assert_eq!(d.budget().used(), used, "{k}: flash_prefill allocated device memory");
        let w =
            compare(&k.to_string(), &c, &got, &rows, &want, if k == FlashKernel::Simt { SIMT_TOL } else { MMA_TOL });
        assert!(got.iter().all(|x| x.is_finite()), "{k}: unwritten or non-finite outputs");
        line += &format!(" {k} err/tol {w:.3}");
    }
    eprintln!("{line}");
}

#[test]
fn flash_prefill_rejects_bad_arguments() {
    let Some(d) = gpu("flash_prefill_rejects_bad_arguments") else { return };
    let mut r = rng(44);
    let c = contiguous_case(&mut r, "errors", (5, 0, 0), (2, 2), (16, 8, 16), 1.0);
    let u = upload(d, &c);
    let shape_err = |c: &Case| match run(d, c, &u, None) {
        Err(e @ GpuError::Shape { .. }) => e.to_string(),
        other => panic!("{}: expected a shape error, got {other:?}", c.name),
    };
    // A buffer shorter than its layout needs.
    let mut bad = contiguous_case(&mut r, "errors", (5, 0, 0), (2, 2), (16, 8, 16), 1.0);
    bad.args.n_q = 6;
    bad.args.n_kv = 6;
    assert!(shape_err(&bad).contains("q_a"), "{}", shape_err(&bad));
    // S < q_start + T.
    let mut bad = contiguous_case(&mut r, "errors", (5, 0, 0), (2, 2), (16, 8, 16), 1.0);
    bad.args.q_start = 1;
    assert!(shape_err(&bad).contains("n_kv"));
    // Part b dims without buffers.
    let mut bad = contiguous_case(&mut r, "errors", (5, 0, 0), (2, 2), (16, 8, 16), 1.0);
    bad.q_b = None;
    assert!(shape_err(&bad).contains("q_b is None"));
    // Forcing MMA on a 256-wide v.
    let big = contiguous_case(&mut r, "big v", (4, 0, 0), (1, 1), (16, 0, 256), 1.0);
    let ub = upload(d, &big);
    let e = run(d, &big, &ub, Some(FlashKernel::Mma)).unwrap_err();
    assert!(matches!(e, GpuError::Shape { .. }) && e.to_string().contains("MMA"), "{e}");
    let e = run(d, &big, &ub, Some(FlashKernel::MmaFixed)).unwrap_err();
    assert!(matches!(e, GpuError::Shape { .. }) && e.to_string().contains("no compiled shape"), "{e}");
    // Forcing the fixed-dims kernel on a misaligned view names the tensor.
    let mut r2 = rng(45);
    let odd = packed_mla_case(&mut r2, "odd", (20, 0), 2, (16, 8, 16, 5), false);
    let uo = upload(d, &odd);
    let e = run(d, &odd, &uo, Some(FlashKernel::MmaFixed)).unwrap_err();
    assert!(matches!(e, GpuError::Shape { .. }) && e.to_string().contains("k_b"), "{e}");
    // ... while the automatic choice runs it on the generic MMA kernel.
    let want = twin(&odd, &(0..20).collect::<Vec<_>>());
    compare("auto misaligned", &odd, &run(d, &odd, &uo, None).unwrap(), &(0..20).collect::<Vec<_>>(), &want, MMA_TOL);
    // T = 0 is a no-op: the (poisoned) output stays untouched.
    let mut empty = contiguous_case(&mut r, "empty", (5, 0, 0), (2, 2), (16, 8, 16), 1.0);
    empty.args.n_q = 0;
    empty.out_len = 1;
    assert!(run(d, &empty, &u, None).unwrap()[0].is_nan());
}

#[test]
fn flash_prefill_bench_v2_lite_and_qwen3() {
    let Some(d) = gpu("flash_prefill_bench_v2_lite_and_qwen3") else { return };
    for t in [1024, 2048, 8192] {
        for k in [FlashKernel::Mma, FlashKernel::MmaFixed, FlashKernel::Wgmma] {
            if k == FlashKernel::Wgmma && !d.target().arch_specific() {
                eprintln!("{k}: not built for {} (needs sm_90a)", d.target());
                continue;
            }
            let b = bench_mla_prefill(d, Some(k), t, 5).unwrap();
            assert!(b.seconds > 0.0 && b.tflops > 0.0, "{b}");
            let pct = b.tflops / 989.0 * 100.0;
            eprintln!("MLA {b} ({pct:.1}% of 989 TFLOP/s dense BF16)");
            let b = bench_gqa_prefill(d, Some(k), t, 5).unwrap();
            eprintln!("GQA {b} ({:.1}% of 989 TFLOP/s dense BF16)", b.tflops / 989.0 * 100.0);
        }
    }
}
