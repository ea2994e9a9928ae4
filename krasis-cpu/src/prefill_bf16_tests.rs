//! The BF16 prefill runners on emulated tiles (any CPU) against f64 references on the same
//! BF16-rounded operands: ragged token counts, row counts and expert loads, outputs added to.

use crate::quant::bf16::panel_len;
use krasis_quant::cpu_layout::{pack, pack_w13, PackedLayout};
use krasis_quant::group::{dequantize, quantize};
use krasis_quant::Bits;
use proptest::prelude::*;

use super::*;
use crate::activation::silu;
use crate::moe::tests::data;
use crate::moe::ExpertWeights;
use crate::pool::PoolPlan;
use crate::quant::bf16::{bf16_bits, bf16_value};

fn r(v: f32) -> f64 {
    bf16_value(bf16_bits(v)) as f64
}

/// `y[i, j] = Σ_k bf16(w[j, k]) · bf16(x[i, k])` in f64, and the magnitude Σ |w·x| per output.
fn reference(w: &[f32], x: &[f32], m: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let n = w.len() / k;
    let (mut y, mut mag) = (vec![0f64; m * n], vec![0f64; m * n]);
    for i in 0..m {
        for j in 0..n {
            for kk in 0..k {
                let p = r(w[j * k + kk]) * r(x[i * k + kk]);
                y[i * n + j] += p;
                mag[i * n + j] += p.abs();
            }
        }
    }
    (y, mag)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// One task's run of row blocks in panels of 1–3 blocks, one after another: the same bits as
    /// one panel holding every block.
    #[test]
    fn panels_in_turn_equal_one_panel(
        m in 1usize..50,
        rows in 17usize..120,
        b0 in 0usize..2,
        per in 1usize..4,
        int4 in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let (gs, bits, k) = (32, if int4 { Bits::Int4 } else { Bits::Int8 }, 128);
        let q = quantize(&data(rows * k, seed), rows, k, bits, gs);
        let (w, l) = (pack(&q), PackedLayout::of(&q));
        let b1 = l.row_blocks();
        let mp = m.div_ceil(16) * 16;
        let mut a = AlignedVec::filled(mp * k, 0u16);
        for (i, row) in data(m * k, seed ^ 9).chunks_exact(k).enumerate() {
            convert_row(row, i, k, &mut a);
        }
        let cols = (b1 - b0) * 16;
        let (mut got, mut want) = (vec![f32::NAN; mp * cols], vec![f32::NAN; mp * cols]);
        let (mut p1, mut p2) = (AlignedVec::new(), AlignedVec::new());
        // SAFETY: a holds pad(m) rows of K with zero padding; outputs pad(m) rows of `cols`.
        unsafe {
            matmul_blocks_with(Bf16Tiles::Emulated, &w, &l, b0, b1, &a, m, got.as_mut_ptr(), cols, &mut p1, per);
            matmul_blocks_with(Bf16Tiles::Emulated, &w, &l, b0, b1, &a, m, want.as_mut_ptr(), cols, &mut p2, b1);
        }
        prop_assert!(got.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()));
    }

    #[test]
    fn matmul_matches_reference(
        m in 1usize..40,
        rows in proptest::collection::vec(1usize..70, 1..3),
        kg in 1usize..4,
        int4 in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let (gs, bits) = (32, if int4 { Bits::Int4 } else { Bits::Int8 });
        let k = kg * 64;
        let pool = WorkerPool::new(PoolPlan::simulated(1, 3)).unwrap();
        let x = data(m * k, seed);
        let qs: Vec<_> = rows.iter().enumerate().map(|(j, &n)| quantize(&data(n * k, seed + 1 + j as u64), n, k, bits, gs)).collect();
        let packed: Vec<(Vec<u8>, PackedLayout)> = qs.iter().map(|q| (pack(q), PackedLayout::of(q))).collect();
        let mats: Vec<(&[u8], &PackedLayout)> = packed.iter().map(|(w, l)| (w.as_slice(), l)).collect();
        let mut ys: Vec<Vec<f32>> = rows.iter().map(|&n| vec![f32::NAN; m * n]).collect();
        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
        run_many(Bf16Tiles::Emulated, &pool, &mats, &x, m, &mut outs);
        // Handing the call buffers back changes nothing for the next call.
        trim(0);
        let mut again: Vec<Vec<f32>> = rows.iter().map(|&n| vec![f32::NAN; m * n]).collect();
        let mut outs2: Vec<&mut [f32]> = again.iter_mut().map(|y| y.as_mut_slice()).collect();
        run_many(Bf16Tiles::Emulated, &pool, &mats, &x, m, &mut outs2);
        prop_assert_eq!(&ys, &again);
        for (j, q) in qs.iter().enumerate() {
            let (want, mag) = reference(&dequantize(q), &x, m, k);
            for (i, (&g, (&w, &a))) in ys[j].iter().zip(want.iter().zip(&mag)).enumerate() {
                prop_assert!((g as f64 - w).abs() <= 1e-5 * a + 1e-30, "matrix {} element {}: {} vs {}", j, i, g, w);
            }
        }
    }

    #[test]
    fn experts_match_reference(
        tokens in 1usize..40,
        loads in proptest::collection::vec(0usize..40, 1..5),
        format in 0usize..5,
        biased in any::<bool>(),
        seed in any::<u64>(),
    ) {
        // INT8, INT4 (symmetric, groups of 32), asymmetric INT4 g32, MXFP4 or NVFP4; SiLU, or
        // gpt-oss's clamped SwiGLU after gate and up biases (limit 1, so the clamp is hit).
        let (h, inter, gs) = (64usize, 96usize, 32);
        let pool = WorkerPool::new(PoolPlan::simulated(1, 3)).unwrap();
        let x = data(tokens * h, seed);
        struct E { w13: Vec<u8>, w2: Vec<u8>, l13: PackedLayout, l2: PackedLayout, f: [Vec<f32>; 3], toks: Vec<(usize, f32)> }
        let experts: Vec<E> = loads.iter().enumerate().map(|(e, &load)| {
            let s = seed.wrapping_add(10 * e as u64 + 1);
            let wts = data(load, s + 3);
            let toks = (0..load.min(tokens)).map(|i| ((i * 7 + e) % tokens, wts[i])).collect();
            if format >= 3 {
                use krasis_quant::fp4::{self, Fp4Kind};
                let kind = if format == 3 { Fp4Kind::Mxfp4 } else { Fp4Kind::Nvfp4 };
                let (gate, up, down) =
                    (fp4::test_matrix(kind, inter, h, s), fp4::test_matrix(kind, inter, h, s + 1), fp4::test_matrix(kind, h, inter, s + 2));
                let mut w13 = vec![0u8; fp4::w13_layout(&gate, &up).unwrap().bytes()];
                let l13 = fp4::pack_w13_into(&gate, &up, &mut w13).unwrap();
                return E { w13, w2: fp4::pack(&down), l13, l2: fp4::layout_of(&down), f: [gate.dequantize(), up.dequantize(), down.dequantize()], toks };
            }
            if format == 2 {
                use krasis_quant::int4_asym as a;
                let q = |w: Vec<f32>, rows, k| a::quantize(&w, rows, k).unwrap();
                let (gate, up, down) = (q(data(inter * h, s), inter, h), q(data(inter * h, s + 1), inter, h), q(data(h * inter, s + 2), h, inter));
                let (w13, l13) = a::pack_w13(&gate, &up).unwrap();
                return E { w13, w2: a::pack(&down), l13, l2: a::layout_of(&down), f: [gate.dequantize(), up.dequantize(), down.dequantize()], toks };
            }
            let bits = if format == 1 { Bits::Int4 } else { Bits::Int8 };
            let gate = quantize(&data(inter * h, s), inter, h, bits, gs);
            let up = quantize(&data(inter * h, s + 1), inter, h, bits, gs);
            let down = quantize(&data(h * inter, s + 2), h, inter, bits, gs);
            let (w13, l13) = pack_w13(&gate, &up).unwrap();
            E { w13, w2: pack(&down), l13, l2: PackedLayout::of(&down), f: [dequantize(&gate), dequantize(&up), dequantize(&down)], toks }
        }).collect();
        let jobs: Vec<ExpertJob> = experts.iter().map(|e| ExpertJob {
            weights: ExpertWeights { w13: &e.w13, w2: &e.w2, node: 0 },
            tokens: &e.toks,
        }).collect();
        let (alpha, limit) = (1.702f32, 1.0f32);
        let biases: Vec<Vec<f32>> =
            (0..experts.len()).map(|e| data(2 * inter, seed ^ (77 + e as u64)).iter().map(|v| 4.0 * v).collect()).collect();
        let bias_refs: Vec<&[f32]> = biases.iter().map(|b| b.as_slice()).collect();
        let act = if biased {
            ExpertAct { activation: ExpertActivation::ClampedSwiglu { alpha, limit }, bias13: Some(&bias_refs) }
        } else {
            ExpertAct::SILU
        };
        let start = data(tokens * h, seed ^ 9);
        let mut out = start.clone();
        run_experts_as(true, Bf16Tiles::Emulated, &pool, &experts[0].l13, &experts[0].l2, &x, h, &jobs, act, &mut out);
        // The same tasks as three dispatches give the same bits (each task's arithmetic is
        // independent of which dispatch runs it).
        let mut split = start.clone();
        run_experts_as(false, Bf16Tiles::Emulated, &pool, &experts[0].l13, &experts[0].l2, &x, h, &jobs, act, &mut split);
        prop_assert!(out.iter().zip(&split).all(|(a, b)| a.to_bits() == b.to_bits()), "fused and split dispatches differ");
        let mut want: Vec<f64> = start.iter().map(|&v| v as f64).collect();
        for (ei, e) in experts.iter().enumerate() {
            let rows: Vec<f32> = e.toks.iter().flat_map(|&(t, _)| x[t * h..(t + 1) * h].to_vec()).collect();
            let m = e.toks.len();
            let (g, _) = reference(&e.f[0], &rows, m, h);
            let (u, _) = reference(&e.f[1], &rows, m, h);
            let act: Vec<f32> = g
                .iter()
                .zip(&u)
                .enumerate()
                .map(|(i, (&g, &u))| {
                    if !biased {
                        return silu(g as f32) * u as f32;
                    }
                    let c = i % inter;
                    let gc = (g as f32 + biases[ei][c]).min(limit);
                    let uc = (u as f32 + biases[ei][inter + c]).clamp(-limit, limit);
                    (uc + 1.0) * (gc / (1.0 + (-alpha * gc).exp()))
                })
                .collect();
            let (y, _) = reference(&e.f[2], &act, m, inter);
            for (i, &(t, w)) in e.toks.iter().enumerate() {
                for j in 0..h {
                    want[t * h + j] += w as f64 * y[i * h + j];
                }
            }
        }
        let num: f64 = out.iter().zip(&want).map(|(&a, &b)| (a as f64 - b).powi(2)).sum();
        let den: f64 = want.iter().zip(&start).map(|(&b, &s)| (b - s as f64).powi(2)).sum();
        prop_assert!(num <= 1e-5 * den.max(1e-12), "relative L2 error² {} over the experts' part", num / den.max(1e-12));
    }
}

/// The hardware tile kernel over 8 ready row blocks of K = `k` (`panel`) and `m` rows of `a`
/// into `c` (`m × 128`).
#[cfg(target_arch = "x86_64")]
fn hw_tiles_on_panel(panel: &[u16], a: &[u16], k: usize, m: usize, c: &mut [f32]) {
    assert!(panel.len() >= 8 * k * 16 && a.len() >= m * k && c.len() >= m * 128 && m.is_multiple_of(16));
    // SAFETY: extents asserted above; the caller checked that AMX-BF16 is usable.
    unsafe { tiles_on_panel(Bf16Tiles::Hardware, panel, 8, k, a.as_ptr(), m / 16, c.as_mut_ptr(), 128) }
}

/// Where the BF16 prefill's time goes on this CPU (`--ignored --nocapture`; needs AMX-BF16):
/// one thread's panel dequantisation and tile kernel rates, then the runners over all cores at
/// V2-Lite prefill shapes.
#[test]
#[ignore = "timing; run on an AMX-BF16 host with --ignored --nocapture"]
fn bf16_rates() {
    use std::time::Instant;
    #[cfg(target_arch = "x86_64")]
    if !crate::quant::amx::detect::bf16_available() {
        eprintln!("*** SKIPPED: bf16_rates: no AMX-BF16 ***");
        return;
    }
    let best = |f: &mut dyn FnMut()| {
        f();
        (0..5)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min)
    };
    let (h, inter) = (2048usize, 1408usize);
    for bits in [Bits::Int4, Bits::Int8] {
        let q = quantize(&data(2 * inter * h, 3), 2 * inter, h, bits, 128);
        let (w, l) = (pack(&q), PackedLayout::of(&q));
        let mut panel = AlignedVec::filled(8 * panel_len(&l), 0u16);
        let s = best(&mut || {
            for b in 0..8 {
                block_panel(&w, &l, b, &mut panel[b * panel_len(&l)..(b + 1) * panel_len(&l)])
            }
        });
        eprintln!("{bits:?} panel dequant, one thread: {:.2} G weights/s", 8.0 * 16.0 * h as f64 / s / 1e9);
        for m in [16usize, 48, 128, 512] {
            let a: Vec<u16> = data(m * h, 5).iter().map(|&v| crate::quant::bf16::bf16_bits(v)).collect();
            let a = AlignedVec::from(&a[..]);
            let mut c = AlignedVec::filled(m * 128, 0f32);
            let s = best(&mut || hw_tiles_on_panel(&panel, &a, h, m, &mut c));
            let s2 = best(&mut || unsafe {
                matmul_blocks(Bf16Tiles::Hardware, &w, &l, 0, 8, &a, m, c.as_mut_ptr(), 128, &mut AlignedVec::new())
            });
            let macs = (m * 128 * h) as f64;
            eprintln!(
                "  M {m:4}: tiles on a ready panel {:.0} GMAC/s; with its dequantisation {:.0} GMAC/s",
                macs / s / 1e9,
                macs / s2 / 1e9
            );
        }
    }
    // The same tile kernel on private, L2-resident operands in 1..16 threads at once: does the
    // per-core rate hold when every core runs tiles (clock or power limits), or not?
    {
        let q = quantize(&data(8 * 16 * h, 3), 8 * 16, h, Bits::Int4, 128);
        let (w, l) = (pack(&q), PackedLayout::of(&q));
        let mut panel = AlignedVec::filled(8 * panel_len(&l), 0u16);
        for b in 0..8 {
            block_panel(&w, &l, b, &mut panel[b * panel_len(&l)..(b + 1) * panel_len(&l)]);
        }
        let m = 128usize;
        let a: Vec<u16> = data(m * h, 5).iter().map(|&v| crate::quant::bf16::bf16_bits(v)).collect();
        let a = AlignedVec::from(&a[..]);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        for n in [1usize, 4, 8, cores] {
            let rates: Vec<f64> = std::thread::scope(|sc| {
                let hs: Vec<_> = (0..n)
                    .map(|_| {
                        let (panel, a) = (panel.clone(), a.clone());
                        sc.spawn(move || {
                            let _ = crate::quant::amx::detect::support();
                            let mut c = AlignedVec::filled(m * 128, 0f32);
                            let mut run = || hw_tiles_on_panel(&panel, &a, h, m, &mut c);
                            run();
                            let t = Instant::now();
                            for _ in 0..200 {
                                run();
                            }
                            200.0 * (m * 128 * h) as f64 / t.elapsed().as_secs_f64() / 1e9
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let mean = rates.iter().sum::<f64>() / n as f64;
            eprintln!(
                "tiles on private ready panels, {n:2} threads at once: {mean:.0} GMAC/s per thread, {:.0} in all",
                mean * n as f64
            );
        }
    }
    let pool = WorkerPool::new(PoolPlan::from_system(&krasis_core::hw::probe(), None)).unwrap();
    let q = quantize(&data(2 * 2816 * h, 7), 2 * 2816, h, Bits::Int8, 128);
    let (w, l) = (pack(&q), PackedLayout::of(&q));
    for m in [128usize, 512] {
        let x = data(m * h, 9);
        let mut y = vec![0f32; m * l.rows];
        let s = best(&mut || run_many(Bf16Tiles::Hardware, &pool, &[(&w, &l)], &x, m, &mut [&mut y]));
        eprintln!(
            "run_many INT8 {m}×{h}×{} on {} workers: {:.2} ms, {:.0} GMAC/s",
            l.rows,
            pool.threads(),
            s * 1e3,
            (m * l.rows * h) as f64 / s / 1e9
        );
    }
    for bits in [Bits::Int4, Bits::Int8] {
        let experts: Vec<(Vec<u8>, PackedLayout, Vec<u8>, PackedLayout)> = (0..64)
            .map(|e| {
                let g = quantize(&data(inter * h, 20 + e), inter, h, bits, 128);
                let u = quantize(&data(inter * h, 90 + e), inter, h, bits, 128);
                let d = quantize(&data(h * inter, 170 + e), h, inter, bits, 128);
                let (w13, l13) = pack_w13(&g, &u).unwrap();
                (w13, l13, pack(&d), PackedLayout::of(&d))
            })
            .collect();
        let t = 512usize;
        let toks: Vec<Vec<(usize, f32)>> =
            (0..64).map(|e| (0..t).filter(|i| (i * 6 + e) % 64 < 6).map(|i| (i, 0.1)).collect()).collect();
        let jobs: Vec<ExpertJob> = experts
            .iter()
            .zip(&toks)
            .map(|(e, tk)| ExpertJob { weights: ExpertWeights { w13: &e.0, w2: &e.2, node: 0 }, tokens: tk })
            .collect();
        let x = data(t * h, 11);
        let mut out = vec![0f32; t * h];
        let before = expert_phase_ns();
        let s = best(&mut || {
            run_experts(
                Bf16Tiles::Hardware,
                &pool,
                &experts[0].1,
                &experts[0].3,
                &x,
                h,
                &jobs,
                ExpertAct::SILU,
                &mut out,
            )
        });
        let ph: Vec<String> =
            expert_phase_ns().iter().zip(before).take(6).map(|(a, b)| format!("{:.2}", (a - b) as f64 / 6e6)).collect();
        eprintln!(
            "  per call (mean of 6), ms: convert (worker), expert tasks (wall), waiting (worker), sum (wall), \
             dequantise (worker), tiles (worker) = {}",
            ph.join(", ")
        );
        let macs = toks.iter().map(|v| v.len()).sum::<usize>() as f64 * 3.0 * (inter * h) as f64;
        eprintln!("run_experts {bits:?} 64 experts, {t} tokens top-6: {:.2} ms, {:.0} GMAC/s", s * 1e3, macs / s / 1e9);
    }
}
