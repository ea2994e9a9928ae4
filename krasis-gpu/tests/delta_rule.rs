//! The gated-DeltaNet kernels (`krasis_gpu::delta_rule`) against scalar f64 twins written here
//! (the steps of `krasis_cpu::delta_rule::recurrent_f64` and krasis-model's CPU DeltaNet op), on
//! ragged geometries: key and value dims not multiples of 32 (and key dims in each of the rule
//! kernel's three register sizes), 1 to 3 value heads per key head, conv kernels of 2 to 5 taps.
//! Three sequences with random starting states go through calls of every shape the engine
//! makes: a 37-token prompt, two sequences' 5-token prompts at once, batched decode steps of all
//! three (in two orders), single decode steps, and a 2-token call shorter than the conv state.
//! Every stage is checked on the GPU's own input to it (so an error is pinned to its kernel),
//! and the states the GPU kept are checked at the end, beside untouched memory before them.
//! Plus gated attention's output gate on a strided gate.
//!
//! Without a GPU every test prints "SKIPPED: no GPU" and passes; `KRASIS_REQUIRE_GPU=1` fails
//! instead.

mod common;

use common::{assert_close, down, gpu, rand_bf16_bits, rand_f32, rng, time_us_per_call, up};
use krasis_core::dtype::{bf16_to_f32, f32_to_bf16};
use krasis_gpu::cudarc::driver::DevicePtr;
use krasis_gpu::delta_rule::{DeltaDims, DeltaLayerWeights, DeltaSeqs, DeltaStates};
use krasis_gpu::{DeviceBuffer, GpuDevice};
use rand::Rng;

const EPS: f32 = 1e-6;

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// One sequence's state in the twin (f64).
#[derive(Clone)]
struct TwinState {
    conv: Vec<f64>,
    rule: Vec<f64>,
}

/// The layer's weights as the kernels take them (BF16) and as the twin reads them.
struct Layer {
    d: DeltaDims,
    taps: Vec<u16>,
    a_log: Vec<u16>,
    dt_bias: Vec<u16>,
    norm: Vec<u16>,
}

fn f(v: &[u16]) -> Vec<f64> {
    v.iter().map(|&b| bf16_to_f32(b) as f64).collect()
}

fn twin_conv(layer: &Layer, x: &[f32], n: usize, st: &mut TwinState) -> Vec<f64> {
    let d = &layer.d;
    let (ch, k) = (d.channels(), d.conv_kernel);
    let keep = k - 1;
    let taps = f(&layer.taps);
    let mut ext = st.conv.clone();
    ext.extend(x[..n * ch].iter().map(|&v| v as f64));
    let mut out = vec![0f64; n * ch];
    for i in 0..n {
        for c in 0..ch {
            let acc: f64 = (0..k).map(|j| taps[c * k + j] * ext[(i + j) * ch + c]).sum();
            out[i * ch + c] = silu(acc);
        }
    }
    st.conv = ext[n * ch..].to_vec();
    assert_eq!(st.conv.len(), keep * ch);
    out
}

/// q/k normalised in place (from the GPU's conv output), β and g.
fn twin_prep(layer: &Layer, qkv: &mut [f64], b: &[f32], a: &[f32], rows: usize, q_scale: f32) -> (Vec<f64>, Vec<f64>) {
    let d = &layer.d;
    let (ch, nk, dk, nv) = (d.channels(), d.key_heads, d.dk, d.value_heads);
    for r in 0..rows {
        for v in 0..2 * nk {
            let x = &mut qkv[r * ch + v * dk..][..dk];
            let ss: f64 = x.iter().map(|y| y * y).sum();
            let s = if v < nk { q_scale as f64 } else { 1.0 } / (ss + EPS as f64).sqrt();
            x.iter_mut().for_each(|y| *y *= s);
        }
    }
    let (alog, dt) = (f(&layer.a_log), f(&layer.dt_bias));
    let beta = b.iter().map(|&x| 1.0 / (1.0 + (-(x as f64)).exp())).collect();
    let g = a
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let x = x as f64 + dt[i % nv];
            let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
            -alog[i % nv].exp() * sp
        })
        .collect();
    (beta, g)
}

/// The rule over one sequence's `n` rows starting at row `r0` of the call.
#[allow(clippy::too_many_arguments)]
fn twin_rule(d: &DeltaDims, qkv: &[f64], beta: &[f64], g: &[f64], r0: usize, n: usize, s: &mut [f64], out: &mut [f64]) {
    let (ch, nk, nv, dk, dv) = (d.channels(), d.key_heads, d.value_heads, d.dk, d.dv);
    for r in r0..r0 + n {
        for h in 0..nv {
            let kh = h / (nv / nk);
            let q = &qkv[r * ch + kh * dk..][..dk];
            let k = &qkv[r * ch + (nk + kh) * dk..][..dk];
            let v = &qkv[r * ch + 2 * nk * dk + h * dv..][..dv];
            let st = &mut s[h * dk * dv..][..dk * dv];
            let decay = g[r * nv + h].exp();
            st.iter_mut().for_each(|x| *x *= decay);
            for j in 0..dv {
                let kv: f64 = (0..dk).map(|a| st[a * dv + j] * k[a]).sum();
                let delta = beta[r * nv + h] * (v[j] - kv);
                for a in 0..dk {
                    st[a * dv + j] += k[a] * delta;
                }
            }
            for j in 0..dv {
                out[(r * nv + h) * dv + j] = (0..dk).map(|a| st[a * dv + j] * q[a]).sum();
            }
        }
    }
}

fn twin_norm(o: &[f32], z: &[f32], w: &[u16], dv: usize, eps: f32) -> Vec<f64> {
    let w = f(w);
    let mut out = vec![0f64; o.len()];
    for ((ov, zv), dst) in o.chunks_exact(dv).zip(z.chunks_exact(dv)).zip(out.chunks_exact_mut(dv)) {
        let ss: f64 = ov.iter().map(|&x| (x as f64).powi(2)).sum();
        let inv = 1.0 / (ss / dv as f64 + eps as f64).sqrt();
        for i in 0..dv {
            dst[i] = ov[i] as f64 * inv * w[i] * silu(zv[i] as f64);
        }
    }
    out
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

fn addr(d: &GpuDevice, b: &DeviceBuffer<f32>) -> u64 {
    let (p, _g) = b.device_ptr(d.stream());
    p
}

#[test]
fn delta_net_kernels_match_the_f64_twin_over_prompts_and_batched_decode() {
    let Some(dev) = gpu("delta_net_kernels_match_the_f64_twin_over_prompts_and_batched_decode") else { return };
    let mut r = rng(39);
    // (key heads, value heads, dk, dv, conv kernel)
    for (nk, nv, dk, dv, k) in
        [(2, 4, 32, 32, 4), (1, 3, 40, 24, 4), (2, 6, 72, 56, 3), (1, 2, 200, 40, 2), (3, 3, 17, 70, 5)]
    {
        let d = DeltaDims { key_heads: nk, value_heads: nv, dk, dv, conv_kernel: k };
        let what = format!("{d:?}");
        let ch = d.channels();
        let layer = Layer {
            d,
            taps: rand_bf16_bits(&mut r, ch * k, 0.8),
            a_log: (0..nv).map(|_| f32_to_bf16(r.random_range(0.02f32..2.0).ln())).collect(),
            dt_bias: rand_bf16_bits(&mut r, nv, 0.5),
            norm: (0..dv).map(|_| f32_to_bf16(1.0 + r.random_range(-0.3f32..0.3))).collect(),
        };
        let (taps, a_log, dt_bias, norm) = (
            up(dev, &layer.taps, "taps"),
            up(dev, &layer.a_log, "A_log"),
            up(dev, &layer.dt_bias, "dt_bias"),
            up(dev, &layer.norm, "norm"),
        );
        // Each sequence's block: another layer's part first (must stay as it is), then this one's.
        let offset = d.state_len() + 7;
        let sentinel: Vec<f32> = (0..offset).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut twins = Vec::new();
        let mut blocks = Vec::new();
        for _ in 0..3 {
            let t = TwinState {
                conv: rand_f32(&mut r, d.conv_state_len(), 1.0).iter().map(|&v| v as f64).collect(),
                rule: rand_f32(&mut r, d.rule_state_len(), 0.3).iter().map(|&v| v as f64).collect(),
            };
            let mut host = sentinel.clone();
            host.extend(t.conv.iter().map(|&v| v as f32));
            host.extend(t.rule.iter().map(|&v| v as f32));
            blocks.push(up(dev, &host, "delta state block"));
            twins.push(t);
        }
        let q_scale = (dk as f32).powf(-0.5);
        // (sequences of the call, rows each)
        let calls: [(&[usize], usize); 6] =
            [(&[0], 37), (&[1, 2], 5), (&[0, 1, 2], 1), (&[2, 0], 1), (&[0], 1), (&[1], 2)];
        for (ci, &(which, n)) in calls.iter().enumerate() {
            let what = format!("{what} call {ci} ({} x {n})", which.len());
            let seqs = DeltaSeqs { n_seqs: which.len(), rows_per_seq: n };
            let rows = seqs.rows();
            let table_host: Vec<u64> = which.iter().map(|&s| addr(dev, &blocks[s])).collect();
            let table = up(dev, &table_host, "state table");
            let x = rand_f32(&mut r, rows * ch, 1.0);
            let mut b_in = rand_f32(&mut r, rows * nv, 3.0);
            let mut a_in = rand_f32(&mut r, rows * nv, 3.0);
            a_in[0] = 25.0; // softplus past its threshold
            b_in[rows * nv - 1] = -9.0;
            let z = rand_f32(&mut r, rows * nv * dv, 2.0);

            // Convolution.
            let xb = up(dev, &x, "x");
            let mut conv = up(dev, &vec![f32::NAN; rows * ch], "conv out");
            // SAFETY: every table entry is a live block of offset + state_len floats.
            unsafe { dev.delta_conv_silu(&xb, &mut conv, &taps, &d, DeltaStates::new(dev, &table, offset), seqs) }
                .unwrap();
            let conv_gpu = down(dev, &conv);
            let mut want = Vec::new();
            for (i, &s) in which.iter().enumerate() {
                want.extend(twin_conv(&layer, &x[i * n * ch..(i + 1) * n * ch], n, &mut twins[s]));
            }
            assert_close(&format!("{what}: conv"), &conv_gpu, &f32s(&want), 1e-5, 1e-6);

            // Prep, on the GPU's conv output.
            let mut bb = up(dev, &b_in, "b");
            let mut ab = up(dev, &a_in, "a");
            dev.delta_prep(&mut conv, &mut bb, &mut ab, &a_log, &dt_bias, &d, rows, q_scale).unwrap();
            let mut qkv_twin: Vec<f64> = conv_gpu.iter().map(|&v| v as f64).collect();
            let (beta_t, g_t) = twin_prep(&layer, &mut qkv_twin, &b_in, &a_in, rows, q_scale);
            let qkv_gpu = down(dev, &conv);
            let (beta_gpu, g_gpu) = (down(dev, &bb), down(dev, &ab));
            assert_close(&format!("{what}: prep q/k/v"), &qkv_gpu, &f32s(&qkv_twin), 1e-5, 1e-7);
            assert_close(&format!("{what}: prep beta"), &beta_gpu, &f32s(&beta_t), 1e-6, 1e-7);
            assert_close(&format!("{what}: prep g"), &g_gpu, &f32s(&g_t), 1e-5, 1e-7);

            // The rule, on the GPU's prepared inputs.
            let mut o = up(dev, &vec![f32::NAN; rows * nv * dv], "rule out");
            let rule_states = DeltaStates::new(dev, &table, offset + d.conv_state_len());
            // SAFETY: as above.
            unsafe { dev.delta_rule(&conv, &bb, &ab, &mut o, &d, rule_states, seqs) }.unwrap();
            let o_gpu = down(dev, &o);
            let q64: Vec<f64> = qkv_gpu.iter().map(|&v| v as f64).collect();
            let (b64, g64): (Vec<f64>, Vec<f64>) =
                (beta_gpu.iter().map(|&v| v as f64).collect(), g_gpu.iter().map(|&v| v as f64).collect());
            let mut o_want = vec![0f64; rows * nv * dv];
            for (i, &s) in which.iter().enumerate() {
                twin_rule(&d, &q64, &b64, &g64, i * n, n, &mut twins[s].rule, &mut o_want);
            }
            assert_close(&format!("{what}: rule output"), &o_gpu, &f32s(&o_want), 1e-4, 1e-5);

            // The gated norm, on the GPU's rule output.
            let zb = up(dev, &z, "z");
            dev.delta_gated_norm(&mut o, &zb, &norm, &d, rows, EPS).unwrap();
            let n_want = twin_norm(&o_gpu, &z, &layer.norm, dv, EPS);
            assert_close(&format!("{what}: gated norm"), &down(dev, &o), &f32s(&n_want), 1e-5, 1e-6);
        }
        for (s, (block, t)) in blocks.iter().zip(&twins).enumerate() {
            let got = down(dev, block);
            assert_eq!(&got[..offset], &sentinel[..], "{what}: sequence {s}: memory before the layer's state");
            let conv = &got[offset..offset + d.conv_state_len()];
            assert_eq!(conv, &f32s(&t.conv)[..], "{what}: sequence {s}: conv state (copied inputs)");
            let rule = &got[offset + d.conv_state_len()..];
            assert_close(&format!("{what}: sequence {s}: rule state"), rule, &f32s(&t.rule), 1e-4, 1e-5);
        }
        eprintln!("{what}: 6 calls over 3 sequences match the twin");
    }
}

#[test]
fn output_gate_divides_by_one_plus_exp_of_minus_the_strided_gate() {
    let Some(dev) = gpu("output_gate_divides_by_one_plus_exp_of_minus_the_strided_gate") else { return };
    let mut r = rng(40);
    for (rows, cols) in [(21, 20), (1, 130), (67, 64)] {
        let y = rand_f32(&mut r, rows * cols, 2.0);
        // Per row [query cols | gate cols], as q_proj's output of a gated head.
        let q = rand_f32(&mut r, rows * 2 * cols, 6.0);
        let mut yb = up(dev, &y, "y");
        let qb = up(dev, &q, "q with gates");
        dev.output_gate_rows_f32(&mut yb, rows, cols, &qb, 2 * cols, cols).unwrap();
        let want: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let (rr, c) = (i / cols, i % cols);
                (y[i] as f64 / (1.0 + (-(q[rr * 2 * cols + cols + c] as f64)).exp())) as f32
            })
            .collect();
        assert_close(&format!("output gate {rows}x{cols}"), &down(dev, &yb), &want, 1e-6, 1e-7);
    }
}

// ---------------------------------------------------------------- the chunked rule

/// The rule's inputs for `rows` rows as `delta_prep` leaves them: `qkv` `[rows, channels]` with q
/// and k L2-normalised (q also scaled by dk^-1/2), v in (−1, 1); β in (0.02, 0.98); g ≤ 0, mostly
/// in (−3, 0], with some exact zeros (no decay) and some −30 (the state wiped).
fn rule_inputs(r: &mut impl Rng, d: &DeltaDims, rows: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (ch, nk, dk, nv) = (d.channels(), d.key_heads, d.dk, d.value_heads);
    let mut qkv: Vec<f32> = (0..rows * ch).map(|_| r.random_range(-1.0f32..1.0)).collect();
    for row in qkv.chunks_exact_mut(ch) {
        for v in 0..2 * nk {
            let x = &mut row[v * dk..][..dk];
            let norm = x.iter().map(|y| y * y).sum::<f32>().sqrt().max(1e-3);
            let s = if v < nk { (dk as f32).powf(-0.5) } else { 1.0 } / norm;
            x.iter_mut().for_each(|y| *y *= s);
        }
    }
    let beta = (0..rows * nv).map(|_| r.random_range(0.02f32..0.98)).collect();
    let g = (0..rows * nv)
        .map(|_| match r.random_range(0..50) {
            0 => -30.0,
            1 | 2 => 0.0,
            _ => -3.0 * r.random_range(0.0f32..1.0).powi(2),
        })
        .collect();
    (qkv, beta, g)
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// `got` within `tol · scale` of `want` element by element, `scale` the largest |want| (at least
/// 1e-3): a relative error of the whole tensor, as the chunked form's sums (over products of
/// many terms) are not each close to their own value's size. Prints and returns the worst
/// |got − want| / scale.
fn assert_scaled(what: &str, got: &[f32], want: &[f64], tol: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
    let mut worst = (0.0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = if g.is_finite() { (g as f64 - w).abs() / scale } else { f64::INFINITY };
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let (err, i) = worst;
    eprintln!("  {what}: max rel error {err:.2e} (at {i}; scale {scale:.3e}, tolerance {tol:.0e})");
    assert!(
        err <= tol,
        "{what}[{i}]: got {}, want {} (error {err:.2e} of scale {scale:.3e} > {tol:.0e})",
        got[i],
        want[i]
    );
    err
}

/// Relative error bound (of the tensor's scale) for the chunked and recurrent GPU forms against
/// the f64 twin: f32 sums over chunks of 64 and dk terms, and the chunk's triangular inverse.
const RULE_TOL: f64 = 5e-4;

/// One geometry through the chunked rule: `n_seqs` sequences (random starting states, in blocks
/// behind another layer's part) through a prompt of `rows` rows (chunked), three batched decode
/// steps (the recurrence, continuing from the chunked prefill), then a second prompt of `rows2`
/// rows (chunked, continuing from the decode). Outputs after every call and the final states
/// against the f64 twin; the memory before the layer's state untouched.
fn chunked_case(dev: &GpuDevice, r: &mut impl Rng, d: DeltaDims, n_seqs: usize, rows: usize, rows2: usize) {
    let what = format!("{d:?} x {n_seqs} sequences, {rows} then 3 decode then {rows2} rows");
    eprintln!("{what}:");
    let (nv, dv) = (d.value_heads, d.dv);
    let offset = 5 + d.conv_state_len();
    let sentinel: Vec<f32> = (0..offset).map(|i| i as f32 * 0.25 - 1.0).collect();
    let mut twins = Vec::new();
    let mut blocks = Vec::new();
    for _ in 0..n_seqs {
        let s: Vec<f32> = (0..d.rule_state_len()).map(|_| r.random_range(-0.3f32..0.3)).collect();
        let mut host = sentinel.clone();
        host.extend(&s);
        blocks.push(up(dev, &host, "delta state block"));
        twins.push(f64s(&s));
    }
    let table_host: Vec<u64> = blocks.iter().map(|b| addr(dev, b)).collect();
    let table = up(dev, &table_host, "state table");
    let states = DeltaStates::new(dev, &table, offset);
    for (ci, (n, chunked)) in [(rows, true), (1, false), (1, false), (1, false), (rows2, true)].into_iter().enumerate()
    {
        let seqs = DeltaSeqs { n_seqs, rows_per_seq: n };
        let rows = seqs.rows();
        let (qkv, beta, g) = rule_inputs(r, &d, rows);
        let (qb, bb, gb) = (up(dev, &qkv, "qkv"), up(dev, &beta, "beta"), up(dev, &g, "g"));
        let mut o = up(dev, &vec![f32::NAN; rows * nv * dv], "rule out");
        if chunked {
            let mut scratch = up(dev, &vec![f32::NAN; d.chunk_scratch_len(seqs)], "chunk scratch");
            // SAFETY: every table entry is a live block of offset + rule_state_len floats.
            unsafe { dev.delta_rule_chunked(&qb, &bb, &gb, &mut scratch, &mut o, &d, states, seqs) }.unwrap();
        } else {
            // SAFETY: as above.
            unsafe { dev.delta_rule(&qb, &bb, &gb, &mut o, &d, states, seqs) }.unwrap();
        }
        let (q64, b64, g64) = (f64s(&qkv), f64s(&beta), f64s(&g));
        let mut want = vec![0f64; rows * nv * dv];
        for (s, twin) in twins.iter_mut().enumerate() {
            twin_rule(&d, &q64, &b64, &g64, s * n, n, twin, &mut want);
        }
        let form = if chunked { "chunked" } else { "recurrent" };
        assert_scaled(&format!("call {ci} ({form}, {n} rows) output"), &down(dev, &o), &want, RULE_TOL);
    }
    for (s, (block, twin)) in blocks.iter().zip(&twins).enumerate() {
        let got = down(dev, block);
        assert_eq!(&got[..offset], &sentinel[..], "{what}: sequence {s}: memory before the layer's state");
        assert_scaled(&format!("sequence {s}: final state"), &got[offset..], twin, RULE_TOL);
    }
}

/// The chunked rule against the f64 twin on fixed ragged geometries: key dims in each of the
/// state kernel's three sizes and not multiples of 32, value dims not multiples of the 32-column
/// tile, 1 to 3 value heads per key head, prompts shorter than a chunk, exactly one, one plus a
/// row, several plus a remainder, and several sequences at once.
#[test]
fn chunked_rule_matches_the_f64_twin_on_ragged_shapes() {
    let Some(dev) = gpu("chunked_rule_matches_the_f64_twin_on_ragged_shapes") else { return };
    let mut r = rng(391);
    // (key heads, value heads, dk, dv, sequences, rows, second prompt's rows)
    for (nk, nv, dk, dv, n_seqs, rows, rows2) in [
        (1, 1, 16, 16, 1, 64, 1),
        (2, 4, 32, 32, 1, 65, 63),
        (1, 3, 40, 24, 2, 7, 128),
        (2, 6, 72, 56, 1, 130, 64),
        (1, 2, 200, 40, 1, 100, 3),
        (3, 3, 17, 70, 3, 64, 65),
        (2, 4, 128, 128, 1, 191, 129),
        (1, 1, 256, 33, 2, 129, 1),
        (2, 2, 64, 96, 1, 300, 2),
        (1, 2, 128, 130, 1, 65, 200),
        (1, 1, 1, 1, 1, 70, 5),
    ] {
        let d = DeltaDims { key_heads: nk, value_heads: nv, dk, dv, conv_kernel: 4 };
        chunked_case(dev, &mut r, d, n_seqs, rows, rows2);
    }
}

/// The same over seeded random geometries and lengths.
#[test]
fn chunked_rule_matches_the_f64_twin_on_random_shapes() {
    let Some(dev) = gpu("chunked_rule_matches_the_f64_twin_on_random_shapes") else { return };
    let mut r = rng(392);
    for _ in 0..16 {
        let nk = r.random_range(1..=3);
        let nv = nk * r.random_range(1..=3);
        let d = DeltaDims {
            key_heads: nk,
            value_heads: nv,
            dk: r.random_range(1..=160),
            dv: r.random_range(1..=100),
            conv_kernel: 4,
        };
        let (n_seqs, rows, rows2) = (r.random_range(1..=3), r.random_range(1..=200), r.random_range(1..=140));
        chunked_case(dev, &mut r, d, n_seqs, rows, rows2);
    }
}

/// A scratch smaller than `chunk_scratch_len`, or a state table shorter than the call's
/// sequences, is an error, not a launch.
#[test]
fn chunked_rule_rejects_a_short_scratch() {
    let Some(dev) = gpu("chunked_rule_rejects_a_short_scratch") else { return };
    let d = DeltaDims { key_heads: 1, value_heads: 2, dk: 32, dv: 32, conv_kernel: 4 };
    let seqs = DeltaSeqs { n_seqs: 1, rows_per_seq: 65 };
    assert_eq!(d.chunk_scratch_len(seqs), 2 * 2 * 2 * 64 * 64);
    let rows = seqs.rows();
    let block = up(dev, &vec![0f32; d.rule_state_len()], "state");
    let table = up(dev, &[addr(dev, &block)], "table");
    let qkv = up(dev, &vec![0f32; rows * d.channels()], "qkv");
    let bg = up(dev, &vec![0f32; rows * d.value_heads], "beta and g");
    let mut o = up(dev, &vec![0f32; rows * d.value_heads * d.dv], "out");
    let mut short = up(dev, &vec![0f32; d.chunk_scratch_len(seqs) - 1], "scratch");
    // SAFETY: the block holds the rule state; the calls are refused before any launch.
    let e = unsafe {
        dev.delta_rule_chunked(&qkv, &bg, &bg, &mut short, &mut o, &d, DeltaStates::new(dev, &table, 0), seqs)
    }
    .unwrap_err();
    assert!(e.to_string().contains("scratch"), "{e}");
    let mut scratch = up(dev, &vec![0f32; d.chunk_scratch_len(seqs)], "scratch");
    let two = DeltaSeqs { n_seqs: 2, rows_per_seq: 1 };
    let e = unsafe {
        dev.delta_rule_chunked(&qkv, &bg, &bg, &mut scratch, &mut o, &d, DeltaStates::new(dev, &table, 0), two)
    }
    .unwrap_err();
    assert!(e.to_string().contains("state table"), "{e}");
}

/// Qwen3.6-35B's DeltaNet shapes (16 key heads, 32 value heads, dims 128): the chunked rule
/// against the GPU's recurrence (itself held to the twin above) over an 8192-token prompt from
/// the same random state, output and state; then the two forms' times per layer call at several
/// prompt lengths, printed for the lead (asserts only the agreement).
#[test]
fn chunked_rule_matches_the_recurrence_at_qwen36_shapes_and_timings() {
    let Some(dev) = gpu("chunked_rule_matches_the_recurrence_at_qwen36_shapes_and_timings") else { return };
    let mut r = rng(393);
    let d = DeltaDims { key_heads: 16, value_heads: 32, dk: 128, dv: 128, conv_kernel: 4 };
    let (nv, dv) = (d.value_heads, d.dv);
    let start: Vec<f32> = (0..d.rule_state_len()).map(|_| r.random_range(-0.3f32..0.3)).collect();
    let t = 8192;
    let seqs = DeltaSeqs { n_seqs: 1, rows_per_seq: t };
    let (qkv, beta, g) = rule_inputs(&mut r, &d, t);
    let (qb, bb, gb) = (up(dev, &qkv, "qkv"), up(dev, &beta, "beta"), up(dev, &g, "g"));
    let mut scratch = dev.alloc_zeros::<f32>(d.chunk_scratch_len(seqs), "chunk scratch").unwrap();
    let mut results = Vec::new();
    for chunked in [false, true] {
        let block = up(dev, &start, "state");
        let table = up(dev, &[addr(dev, &block)], "table");
        let mut o = up(dev, &vec![f32::NAN; t * nv * dv], "out");
        let st = DeltaStates::new(dev, &table, 0);
        // SAFETY: the block holds the rule state.
        unsafe {
            if chunked {
                dev.delta_rule_chunked(&qb, &bb, &gb, &mut scratch, &mut o, &d, st, seqs)
            } else {
                dev.delta_rule(&qb, &bb, &gb, &mut o, &d, st, seqs)
            }
        }
        .unwrap();
        results.push((down(dev, &o), down(dev, &block)));
    }
    let (rec_o, rec_s) = &results[0];
    let (chk_o, chk_s) = &results[1];
    eprintln!("Qwen3.6 shapes, {t} tokens, chunked against the GPU recurrence:");
    assert_scaled("output", chk_o, &f64s(rec_o), RULE_TOL);
    assert_scaled("state", chk_s, &f64s(rec_s), RULE_TOL);

    for t in [64usize, 256, 1024, 4096, 8192] {
        let seqs = DeltaSeqs { n_seqs: 1, rows_per_seq: t };
        let block = up(dev, &start, "state");
        let table = up(dev, &[addr(dev, &block)], "table");
        let st = DeltaStates::new(dev, &table, 0);
        let mut o = dev.alloc_zeros::<f32>(t * nv * dv, "out").unwrap();
        let mut line = format!("delta rule, Qwen3.6 layer, {t} tokens:");
        for chunked in [false, true] {
            let mut call = || unsafe {
                // SAFETY: as above.
                if chunked {
                    dev.delta_rule_chunked(&qb, &bb, &gb, &mut scratch, &mut o, &d, st, seqs)
                } else {
                    dev.delta_rule(&qb, &bb, &gb, &mut o, &d, st, seqs)
                }
                .unwrap()
            };
            call(); // warm-up: compiles
            let reps = if t >= 4096 { 3 } else { 10 };
            let us = time_us_per_call(dev, reps, &mut call);
            let form = if chunked { "chunked" } else { "recurrent" };
            line += &format!("  {form} {:.1} us ({:.0} tok/s)", us, t as f64 / (us * 1e-6));
        }
        eprintln!("{line}");
    }
}

// ---------------------------------------------------------------- the decode step

/// The decode step kernel (conv, prep, rule and gated norm of one row per sequence in two launches)
/// against the f64 twins chained (conv, prep, rule, norm) and against the separate kernels run
/// on a copy of the states: three sequences with random states through batched steps (in two
/// orders) and single steps. Geometries: ragged dims, value dims over one 128-column pass,
/// conv kernels of 1 to 5 taps, and Qwen3.6's (16 key heads, 32 value heads, dims 128).
#[test]
fn decode_step_matches_the_chained_twins_and_the_separate_kernels() {
    let Some(dev) = gpu("decode_step_matches_the_chained_twins_and_the_separate_kernels") else { return };
    let mut r = rng(394);
    for (nk, nv, dk, dv, k) in [
        (2, 4, 32, 32, 4),
        (1, 3, 40, 24, 4),
        (2, 6, 72, 56, 3),
        (1, 2, 200, 40, 2),
        (3, 3, 17, 70, 5),
        (1, 1, 16, 200, 1),
        (2, 2, 256, 130, 4),
        (16, 32, 128, 128, 4),
    ] {
        let d = DeltaDims { key_heads: nk, value_heads: nv, dk, dv, conv_kernel: k };
        assert!(d.decode_step_fits(), "{d:?}");
        eprintln!("{d:?}:");
        let ch = d.channels();
        let layer = Layer {
            d,
            taps: rand_bf16_bits(&mut r, ch * k, 0.8),
            a_log: (0..nv).map(|_| f32_to_bf16(r.random_range(0.02f32..2.0).ln())).collect(),
            dt_bias: rand_bf16_bits(&mut r, nv, 0.5),
            norm: (0..dv).map(|_| f32_to_bf16(1.0 + r.random_range(-0.3f32..0.3))).collect(),
        };
        let (taps, a_log, dt_bias, norm) = (
            up(dev, &layer.taps, "taps"),
            up(dev, &layer.a_log, "A_log"),
            up(dev, &layer.dt_bias, "dt_bias"),
            up(dev, &layer.norm, "norm"),
        );
        let w = DeltaLayerWeights { taps: &taps, a_log: &a_log, dt_bias: &dt_bias, norm: &norm };
        let offset = d.state_len() + 3;
        let sentinel: Vec<f32> = (0..offset).map(|i| i as f32 * 0.5 - 3.0).collect();
        let (mut twins, mut fused, mut separate) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..3 {
            let t = TwinState {
                conv: rand_f32(&mut r, d.conv_state_len(), 1.0).iter().map(|&v| v as f64).collect(),
                rule: rand_f32(&mut r, d.rule_state_len(), 0.3).iter().map(|&v| v as f64).collect(),
            };
            let mut host = sentinel.clone();
            host.extend(t.conv.iter().map(|&v| v as f32));
            host.extend(t.rule.iter().map(|&v| v as f32));
            fused.push(up(dev, &host, "state block (fused)"));
            separate.push(up(dev, &host, "state block (separate kernels)"));
            twins.push(t);
        }
        let q_scale = (dk as f32).powf(-0.5);
        let calls: [&[usize]; 5] = [&[0, 1, 2], &[2, 0, 1], &[1], &[0, 2], &[0, 1, 2]];
        for (ci, which) in calls.into_iter().enumerate() {
            let seqs = DeltaSeqs { n_seqs: which.len(), rows_per_seq: 1 };
            let rows = seqs.rows();
            let table_of = |blocks: &[DeviceBuffer<f32>]| {
                let host: Vec<u64> = which.iter().map(|&s| addr(dev, &blocks[s])).collect();
                up(dev, &host, "state table")
            };
            let (tf, ts) = (table_of(&fused), table_of(&separate));
            let x = rand_f32(&mut r, rows * ch, 1.0);
            let mut b_in = rand_f32(&mut r, rows * nv, 3.0);
            let mut a_in = rand_f32(&mut r, rows * nv, 3.0);
            a_in[0] = 25.0; // softplus past its threshold
            b_in[rows * nv - 1] = -9.0;
            let z = rand_f32(&mut r, rows * nv * dv, 2.0);
            let (xb, zb) = (up(dev, &x, "x"), up(dev, &z, "z"));
            // The decode step's inputs are its scratch: copies of x, b and a.
            let (mut xd, mut bd, mut ad) = (up(dev, &x, "x"), up(dev, &b_in, "b"), up(dev, &a_in, "a"));

            // The fused step.
            let mut o = up(dev, &vec![f32::NAN; rows * nv * dv], "decode out");
            // SAFETY: every table entry is a live block of offset + state_len floats.
            unsafe {
                dev.delta_decode_step(
                    &mut xd,
                    &zb,
                    &mut bd,
                    &mut ad,
                    w,
                    &mut o,
                    &d,
                    DeltaStates::new(dev, &tf, offset),
                    seqs,
                    q_scale,
                    EPS,
                )
            }
            .unwrap();
            let o_fused = down(dev, &o);

            // The separate kernels, on the other copy of the states.
            let mut conv = up(dev, &vec![f32::NAN; rows * ch], "conv out");
            let (mut bs, mut as_) = (up(dev, &b_in, "b"), up(dev, &a_in, "a"));
            let mut os = up(dev, &vec![f32::NAN; rows * nv * dv], "rule out");
            // SAFETY: as above.
            unsafe {
                dev.delta_conv_silu(&xb, &mut conv, &taps, &d, DeltaStates::new(dev, &ts, offset), seqs).unwrap();
                dev.delta_prep(&mut conv, &mut bs, &mut as_, &a_log, &dt_bias, &d, rows, q_scale).unwrap();
                let rule_states = DeltaStates::new(dev, &ts, offset + d.conv_state_len());
                dev.delta_rule(&conv, &bs, &as_, &mut os, &d, rule_states, seqs).unwrap();
            }
            dev.delta_gated_norm(&mut os, &zb, &norm, &d, rows, EPS).unwrap();
            let o_separate = down(dev, &os);

            // The twins chained, in f64 from the same inputs.
            let mut qkv = Vec::new();
            for (i, &s) in which.iter().enumerate() {
                qkv.extend(twin_conv(&layer, &x[i * ch..(i + 1) * ch], 1, &mut twins[s]));
            }
            let (beta, g) = twin_prep(&layer, &mut qkv, &b_in, &a_in, rows, q_scale);
            let mut rule_out = vec![0f64; rows * nv * dv];
            for (i, &s) in which.iter().enumerate() {
                twin_rule(&d, &qkv, &beta, &g, i, 1, &mut twins[s].rule, &mut rule_out);
            }
            let want = twin_norm(&f32s(&rule_out), &z, &layer.norm, dv, EPS);

            let what = format!("call {ci} ({} sequences)", which.len());
            assert_scaled(&format!("{what}: output against the twins"), &o_fused, &want, 1e-4);
            assert_scaled(&format!("{what}: output against the separate kernels"), &o_fused, &f64s(&o_separate), 1e-5);
        }
        for (s, t) in twins.iter().enumerate() {
            let (got, sep) = (down(dev, &fused[s]), down(dev, &separate[s]));
            assert_eq!(&got[..offset], &sentinel[..], "{d:?}: sequence {s}: memory before the layer's state");
            let cs = offset + d.conv_state_len();
            assert_eq!(&got[offset..cs], &f32s(&t.conv)[..], "{d:?}: sequence {s}: conv state (copied inputs)");
            assert_eq!(
                &got[offset..cs],
                &sep[offset..cs],
                "{d:?}: sequence {s}: conv state against the separate kernels"
            );
            assert_scaled(&format!("sequence {s}: rule state against the twin"), &got[cs..], &t.rule, 1e-4);
            assert_scaled(
                &format!("sequence {s}: rule state against the separate kernels"),
                &got[cs..],
                &f64s(&sep[cs..]),
                1e-5,
            );
        }
    }
}

/// The decode step refuses a call of more than one row per sequence.
#[test]
fn decode_step_refuses_more_than_one_row() {
    let Some(dev) = gpu("decode_step_refuses_more_than_one_row") else { return };
    let d = DeltaDims { key_heads: 1, value_heads: 1, dk: 8, dv: 8, conv_kernel: 2 };
    let seqs = DeltaSeqs { n_seqs: 1, rows_per_seq: 2 };
    let w16 = |n: usize| up(dev, &vec![0u16; n], "weights");
    let (taps, one, norm) = (w16(d.channels() * 2), w16(1), w16(8));
    let w = DeltaLayerWeights { taps: &taps, a_log: &one, dt_bias: &one, norm: &norm };
    let block = up(dev, &vec![0f32; d.state_len()], "state");
    let table = up(dev, &[addr(dev, &block)], "table");
    let f = |n: usize| up(dev, &vec![0f32; n], "input");
    let (mut x, z, mut b, mut a, mut o) = (f(2 * d.channels()), f(16), f(2), f(2), f(16));
    // SAFETY: the block holds the layer's state; the call is refused before any launch.
    let e = unsafe {
        let st = DeltaStates::new(dev, &table, 0);
        dev.delta_decode_step(&mut x, &z, &mut b, &mut a, w, &mut o, &d, st, seqs, 1.0, EPS)
    }
    .unwrap_err();
    assert!(e.to_string().contains("rows per sequence"), "{e}");
}

/// Qwen3.6 shapes: one decode step's time (one sequence, and a batch of 16), the decode step's two
/// kernels against the five separate launches, printed for the lead (asserts only that the runs
/// complete).
#[test]
fn decode_step_timings_at_qwen36_shapes() {
    let Some(dev) = gpu("decode_step_timings_at_qwen36_shapes") else { return };
    let mut r = rng(395);
    let d = DeltaDims { key_heads: 16, value_heads: 32, dk: 128, dv: 128, conv_kernel: 4 };
    let (ch, nv, vw) = (d.channels(), d.value_heads, d.value_heads * d.dv);
    let taps = up(dev, &rand_bf16_bits(&mut r, ch * 4, 0.8), "taps");
    let a_log = up(dev, &rand_bf16_bits(&mut r, nv, 0.5), "A_log");
    let dt_bias = up(dev, &rand_bf16_bits(&mut r, nv, 0.5), "dt_bias");
    let norm = up(dev, &rand_bf16_bits(&mut r, d.dv, 1.0), "norm");
    let w = DeltaLayerWeights { taps: &taps, a_log: &a_log, dt_bias: &dt_bias, norm: &norm };
    for n in [1usize, 16] {
        let seqs = DeltaSeqs { n_seqs: n, rows_per_seq: 1 };
        let blocks: Vec<_> = (0..n).map(|_| up(dev, &rand_f32(&mut r, d.state_len(), 0.3), "state")).collect();
        let host: Vec<u64> = blocks.iter().map(|b| addr(dev, b)).collect();
        let table = up(dev, &host, "table");
        let st = DeltaStates::new(dev, &table, 0);
        let rule_st = DeltaStates::new(dev, &table, d.conv_state_len());
        let x = up(dev, &rand_f32(&mut r, n * ch, 1.0), "x");
        let z = up(dev, &rand_f32(&mut r, n * vw, 1.0), "z");
        // The decode step's inputs are its scratch (left prepared: a timing needs no fresh ones).
        let (mut xd, mut bd, mut ad) = (
            up(dev, &rand_f32(&mut r, n * ch, 1.0), "x"),
            up(dev, &rand_f32(&mut r, n * nv, 1.0), "b"),
            up(dev, &rand_f32(&mut r, n * nv, 1.0), "a"),
        );
        let mut o = dev.alloc_zeros::<f32>(n * vw, "out").unwrap();
        let mut conv = dev.alloc_zeros::<f32>(n * ch, "conv").unwrap();
        let (mut bs, mut as_) =
            (up(dev, &rand_f32(&mut r, n * nv, 1.0), "b"), up(dev, &rand_f32(&mut r, n * nv, 1.0), "a"));
        let q_scale = 128f32.powf(-0.5);
        // SAFETY: the blocks hold the layer's state.
        let mut fused = || unsafe {
            dev.delta_decode_step(&mut xd, &z, &mut bd, &mut ad, w, &mut o, &d, st, seqs, q_scale, EPS).unwrap()
        };
        fused();
        let us_fused = time_us_per_call(dev, 200, &mut fused);
        let mut separate = || unsafe {
            // SAFETY: as above.
            dev.delta_conv_silu(&x, &mut conv, &taps, &d, st, seqs).unwrap();
            dev.delta_prep(&mut conv, &mut bs, &mut as_, &a_log, &dt_bias, &d, n, q_scale).unwrap();
            dev.delta_rule(&conv, &bs, &as_, &mut o, &d, rule_st, seqs).unwrap();
            dev.delta_gated_norm(&mut o, &z, &norm, &d, n, EPS).unwrap();
        };
        separate();
        let us_sep = time_us_per_call(dev, 200, &mut separate);
        eprintln!("DeltaNet decode step, Qwen3.6 layer, {n} sequences: the step {us_fused:.1} us, separate kernels {us_sep:.1} us");
    }
}
