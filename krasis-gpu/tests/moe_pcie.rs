//! The GPU's share of a decode step's routed experts, read over PCIe from CPU expert records in
//! mapped page-locked host memory (`krasis_gpu::moe_pcie`), against its scalar twin
//! (`PcieExperts::reference`) on random ragged shapes: INT4 and INT8, group sizes 32 / 64 / 128,
//! asymmetric INT4 g32 (`4a`),
//! 1 to 3 tokens, route ranges at either end of the top-k, a skipped route (id -1), and both
//! output modes (added to y, or y replaced).
//!
//! Without a GPU the test prints "SKIPPED: no GPU" and passes; `KRASIS_REQUIRE_GPU=1` fails instead.

mod common;

use common::{down, gpu, poisoned_f32, rand_f32, rng, up};
use krasis_gpu::cudarc::driver::DevicePtr;
use krasis_gpu::moe_pcie::{records_of, records_of_asym, PcieExperts};
use krasis_gpu::MappedHost;
use krasis_quant::group::{group_size_for, quantize};
use krasis_quant::{Bits, QuantizedMatrix};
use rand::Rng;

#[test]
fn pcie_experts_match_the_twin() {
    let Some(d) = gpu("pcie_experts_match_the_twin") else { return };
    let mut r = rng(41);
    let mut cases = 0;
    for case in 0..30 {
        let bits = if case % 2 == 0 { Bits::Int4 } else { Bits::Int8 };
        // Every fifth case `4a` (groups of 32).
        let asym = case % 5 == 4;
        let gs = if asym { 32 } else { [32, 64, 128][case % 3] };
        let hidden = gs * r.random_range(1..=6);
        let inter = 32 * r.random_range(1..=6);
        let gs2 = group_size_for(inter, gs).unwrap();
        let n = r.random_range(2..=6);
        let (bytes, geometry) = if asym {
            let mut q = |rows: usize, k: usize| {
                krasis_quant::int4_asym::quantize(&rand_f32(&mut r, rows * k, 0.5), rows, k).unwrap()
            };
            let experts: Vec<_> = (0..n).map(|_| [q(inter, hidden), q(inter, hidden), q(hidden, inter)]).collect();
            records_of_asym(&experts).unwrap()
        } else {
            let experts: Vec<[QuantizedMatrix; 3]> = (0..n)
                .map(|_| {
                    [
                        quantize(&rand_f32(&mut r, inter * hidden, 0.5), inter, hidden, bits, gs),
                        quantize(&rand_f32(&mut r, inter * hidden, 0.5), inter, hidden, bits, gs),
                        quantize(&rand_f32(&mut r, hidden * inter, 0.5), hidden, inter, bits, gs2),
                    ]
                })
                .collect();
            records_of(&experts).unwrap()
        };
        let pe = PcieExperts::new(geometry).unwrap();
        let records = MappedHost::<u8>::new(d, bytes.len()).unwrap();
        // SAFETY: the allocation holds `bytes.len()` bytes; no kernel uses it yet.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), records.host_ptr(), bytes.len()) };
        let t = r.random_range(1..=3);
        let top_k = r.random_range(2..=6);
        let g = r.random_range(1..top_k);
        let first = if case % 4 < 2 { top_k - g } else { r.random_range(0..=top_k - g) };
        let mut ids: Vec<i32> = (0..t * top_k).map(|_| r.random_range(0..n) as i32).collect();
        if case % 5 == 0 {
            ids[first] = -1;
        }
        let weights = rand_f32(&mut r, t * top_k, 1.0);
        let x = rand_f32(&mut r, t * hidden, 1.0);
        let y0 = rand_f32(&mut r, t * hidden, 1.0);
        let accumulate = case % 3 != 0;
        let (ids_d, w_d, x_d) = (up(d, &ids, "ids"), up(d, &weights, "weights"), up(d, &x, "x"));
        let mut y_d = up(d, &y0, "y");
        let mut h_d = poisoned_f32(d, pe.scratch_len(t, g));
        let s = d.stream();
        let (ids_p, _gi) = ids_d.slice().device_ptr(s);
        let (w_p, _gw) = w_d.slice().device_ptr(s);
        // SAFETY: records are mapped and outlive the synchronising download below; ids and
        // weights hold t · top_k values.
        unsafe {
            pe.run(
                d,
                records.device_ptr(),
                n,
                &x_d.slice().slice(..),
                t,
                (ids_p, w_p),
                (top_k, first, g),
                &mut h_d.slice_mut().slice_mut(..),
                &mut y_d.slice_mut().slice_mut(..),
                accumulate,
            )
        }
        .unwrap();
        let got = down(d, &y_d);
        let mut want = y0.clone();
        pe.reference(&bytes, n, &x, t, &ids, &weights, (top_k, first, g), &mut want, accumulate).unwrap();
        for tok in 0..t {
            let (gt, wt) = (&got[tok * hidden..][..hidden], &want[tok * hidden..][..hidden]);
            let rms = (wt.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / hidden as f64).sqrt();
            let worst = gt.iter().zip(wt).map(|(a, b)| (*a as f64 - *b as f64).abs()).fold(0.0, f64::max);
            assert!(
                worst <= 1e-5 * rms.max(1e-3),
                "case {case} ({bits:?} g{gs}, 4a {asym}, hidden {hidden}, inter {inter}, t {t}, routes {first}+{g} of {top_k}, accumulate {accumulate}) token {tok}: worst {worst:e}, rms {rms:e}"
            );
        }
        cases += 1;
    }
    eprintln!("pcie_experts_match_the_twin: {cases} cases within 1e-5 of each token's rms");
}
