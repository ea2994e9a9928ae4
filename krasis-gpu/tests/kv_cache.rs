//! The GPU KV cache against a scalar CPU twin: BF16 rounding, FP8 quantisation (decoded exactly as
//! krasis-core decodes E4M3), saturation, NaN, capacity checks. Reads are poisoned with NaN first.
//!
//! Without a GPU every test prints "SKIPPED: no GPU" and passes; with `KRASIS_REQUIRE_GPU=1` a
//! missing GPU fails instead.

mod common;

use common::{
    assert_bitwise_eq, down, from_bf16, gpu, poisoned_bf16, poisoned_f32, rng, round_bf16, to_bf16, twin_kv_row, up,
};
use krasis_core::dtype::bf16_to_f32;
use krasis_gpu::kv_cache::{fp8_group_scale, KvLayout};
use krasis_gpu::{GpuDevice, GpuError, GpuKvCache, KvCapacity, KvDtype};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

fn read_f32(d: &GpuDevice, c: &GpuKvCache, layer: usize, plane: usize, start: usize, len: usize) -> Vec<f32> {
    let row = c.layout().row;
    let mut out = poisoned_f32(d, len * row);
    c.read_f32(d, layer, plane, start, len, &mut out).unwrap();
    down(d, &out)
}

fn read_bf16(d: &GpuDevice, c: &GpuKvCache, layer: usize, plane: usize, start: usize, len: usize) -> Vec<u16> {
    let row = c.layout().row;
    let mut out = poisoned_bf16(d, len * row);
    c.read_bf16(d, layer, plane, start, len, &mut out).unwrap();
    down(d, &out)
}

/// Random rows with a spread of magnitudes (so FP8 groups exercise subnormal codes too).
fn rand_rows(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let m: f32 = r.random_range(-1.0f32..1.0);
            m * 10f32.powi(r.random_range(-3..2))
        })
        .collect()
}

#[test]
fn write_then_read_matches_twin() {
    let Some(d) = gpu("write_then_read_matches_twin") else { return };
    let mut r = rng(11);
    // (layers, planes, row, scale_group)
    for &(layers, planes, row, group) in
        &[(2, 1, 576, 64), (3, 2, 512, 128), (1, 1, 40, 8), (2, 2, 72, 24), (1, 2, 7, 7), (1, 1, 1, 1)]
    {
        for dtype in [KvDtype::Bf16, KvDtype::Fp8, KvDtype::F32] {
            let cap = 37;
            let c = GpuKvCache::new(d, dtype, layers, planes, row, group, KvCapacity::Tokens(cap)).unwrap();
            assert_eq!(c.capacity(), cap);
            let mut want = vec![vec![0f32; cap * row]; layers * planes];
            for _ in 0..6 {
                let (layer, plane) = (r.random_range(0..layers), r.random_range(0..planes));
                let t = r.random_range(1..=5);
                let pos = r.random_range(0..=cap - t);
                let src = rand_rows(&mut r, t * row);
                c.write(d, layer, plane, pos, t, &up(d, &src, "test input")).unwrap();
                for i in 0..t {
                    let tw = twin_kv_row(dtype, &src[i * row..(i + 1) * row], group);
                    want[layer * planes + plane][(pos + i) * row..(pos + i + 1) * row].copy_from_slice(&tw);
                }
            }
            // Every plane, whole capacity: written rows match the twin, the rest stayed zero.
            for l in 0..layers {
                for p in 0..planes {
                    let what = format!("{dtype} {layers}x{planes}x{row}/{group} l{l} p{p}");
                    let w = &want[l * planes + p];
                    assert_bitwise_eq(&what, &read_f32(d, &c, l, p, 0, cap), w);
                    let wb = round_bf16(w);
                    let gb = from_bf16(&read_bf16(d, &c, l, p, 0, cap));
                    assert_bitwise_eq(&format!("{what} (bf16 read)"), &gb, &wb);
                    // A sub-range read.
                    assert_bitwise_eq(
                        &format!("{what} (rows 3..8)"),
                        &read_f32(d, &c, l, p, 3, 5),
                        &w[3 * row..8 * row],
                    );
                }
            }
        }
    }
}

/// BF16 ties round to even; FP8 stays within half an E4M3 step of the input (times the scale),
/// saturates at the group maximum, and keeps NaN.
#[test]
fn rounding_saturation_and_nan() {
    let Some(d) = gpu("rounding_saturation_and_nan") else { return };
    // BF16: exact ties (low half 0x8000) both ways, and a NaN.
    let ties = [
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0xbf80_8000),
        1.0,
        f32::NAN,
        -0.0,
        3e38,
        1e-40,
    ];
    let c = GpuKvCache::new(d, KvDtype::Bf16, 1, 1, ties.len(), 0, KvCapacity::Tokens(1)).unwrap();
    c.write(d, 0, 0, 0, 1, &up(d, &ties, "test input")).unwrap();
    let got = read_bf16(d, &c, 0, 0, 0, 1);
    let want = to_bf16(&ties);
    assert_eq!(got[..4], want[..4]);
    assert_eq!(got[0], 0x3f80);
    assert_eq!(got[1], 0x3f82);
    assert!(bf16_to_f32(got[4]).is_nan());
    assert_eq!(&got[5..], &want[5..]);

    // FP8, groups of 8: a NaN group member, a huge outlier (the others flush towards 0), an
    // all-zero group, a group of one repeated value, random groups.
    let mut r = rng(5);
    let mut x = vec![0f32; 8 * 8];
    x[..8].copy_from_slice(&[1.0, -2.0, f32::NAN, 0.5, 3.0, -7.0, 0.001, 0.0]);
    x[8..16].copy_from_slice(&[1e30, 1.0, -1.0, 1e25, -1e29, 2e-30, 0.0, 5e27]);
    // x[16..24] all zero
    x[24..32].fill(-3.25);
    for v in x[32..].iter_mut() {
        *v = r.random_range(-100.0f32..100.0);
    }
    x[32..40].fill(-1e-44); // amax / 448 underflows to a zero scale: stored as zeros
    let c = GpuKvCache::new(d, KvDtype::Fp8, 1, 1, 64, 8, KvCapacity::Tokens(2)).unwrap();
    c.write(d, 0, 0, 1, 1, &up(d, &x, "test input")).unwrap();
    let got = read_f32(d, &c, 0, 0, 1, 1);
    assert_bitwise_eq("fp8 special groups", &got, &twin_kv_row(KvDtype::Fp8, &x, 8));
    assert!(got[2].is_nan() && !got[0].is_nan());
    assert_eq!(got[8], 448.0 * (1e30f32 / 448.0), "the group maximum maps onto 448·scale");
    assert!(got[16..24].iter().all(|&v| v == 0.0));
    assert!(got[32..40].iter().all(|&v| v == 0.0));
    for (i, (&g, &v)) in got.iter().zip(&x).enumerate() {
        if v.is_nan() {
            continue;
        }
        let grp = &x[i / 8 * 8..i / 8 * 8 + 8];
        let scale = fp8_group_scale(grp);
        let a = if scale == 0.0 { 0.0 } else { (v / scale).abs() };
        // Half a step of the E4M3 grid at |v/scale|: steps are 2^-9 below 2^-6, else 2^(e-3).
        let step = if a < 2f32.powi(-6) { 2f32.powi(-9) } else { 2f32.powi(a.log2().floor() as i32 - 3) };
        let tol = 0.5 * step * scale * (1.0 + 1e-6) + 1e-30;
        if scale == 0.0 {
            continue; // the zero-scale groups, checked above
        }
        assert!((g - v).abs() <= tol, "fp8[{i}]: got {g:e} for {v:e} (tol {tol:e})");
    }
}

#[test]
fn out_of_range_is_an_error_and_writes_nothing() {
    let Some(d) = gpu("out_of_range_is_an_error_and_writes_nothing") else { return };
    for dtype in [KvDtype::Bf16, KvDtype::Fp8, KvDtype::F32] {
        let c = GpuKvCache::new(d, dtype, 2, 2, 16, 8, KvCapacity::Tokens(10)).unwrap();
        let src = up(d, &[1.5f32; 3 * 16], "test input");
        let e = c.write(d, 0, 0, 8, 3, &src).unwrap_err();
        assert!(matches!(e, GpuError::Shape { .. }) && e.to_string().contains("capacity 10"), "{e}");
        assert!(matches!(c.write(d, 2, 0, 0, 3, &src), Err(GpuError::Shape { .. })));
        assert!(matches!(c.write(d, 0, 2, 0, 3, &src), Err(GpuError::Shape { .. })));
        assert!(matches!(c.write(d, 0, 0, 0, 2, &src), Err(GpuError::Shape { .. })), "src length");
        assert!(matches!(c.write(d, 0, 0, usize::MAX, 3, &src), Err(GpuError::Shape { .. })));
        assert!(read_f32(d, &c, 0, 0, 0, 10).iter().all(|&v| v == 0.0), "{dtype}: a refused write wrote");
        let mut dst = up(d, &[0f32; 3 * 16], "test input");
        assert!(matches!(c.read_f32(d, 0, 0, 8, 3, &mut dst), Err(GpuError::Shape { .. })));
        c.write(d, 1, 1, 7, 3, &src).unwrap(); // the last rows are fine
        assert!(read_f32(d, &c, 1, 1, 7, 3).iter().all(|&v| v == 1.5));
    }
}

#[test]
fn capacity_from_budget_is_charged_and_fits() {
    let Some(d) = gpu("capacity_from_budget_is_charged_and_fits") else { return };
    let remaining = d.budget().remaining();
    let reserve = remaining.saturating_sub(64 << 20); // leave ~64 MiB for the cache
    let cap = KvCapacity::FromBudget { reserve_bytes: reserve, max_tokens: usize::MAX };
    let layout = KvLayout::new(KvDtype::Fp8, 27, 1, 576, 64).unwrap();
    let want = layout.tokens_for(cap, remaining);
    let used0 = d.budget().used();
    let c = GpuKvCache::new(d, KvDtype::Fp8, 27, 1, 576, 64, cap).unwrap();
    assert_eq!(c.capacity(), want);
    assert!(want > 0);
    let charged = d.budget().used() - used0;
    assert_eq!(charged, c.charged_bytes());
    assert!(charged >= (want * c.bytes_per_token()) as u64 && charged <= remaining - reserve, "{charged}");
    // Capped by max_tokens.
    let small =
        GpuKvCache::new(d, KvDtype::Bf16, 1, 2, 64, 0, KvCapacity::FromBudget { reserve_bytes: 0, max_tokens: 100 })
            .unwrap();
    assert_eq!(small.capacity(), 100);
    // A reserve larger than what is left: an error naming the KV cache.
    let e = GpuKvCache::new(
        d,
        KvDtype::Bf16,
        1,
        1,
        64,
        0,
        KvCapacity::FromBudget { reserve_bytes: u64::MAX, max_tokens: 10 },
    )
    .unwrap_err();
    assert!(matches!(e, GpuError::VramBudget { .. }) && e.to_string().contains("KV cache"), "{e}");
    // Bad geometry.
    assert!(GpuKvCache::new(d, KvDtype::Fp8, 1, 1, 576, 100, KvCapacity::Tokens(4)).is_err());
}

/// A prefix saved from one cache and loaded into another of a larger capacity reads back the
/// same codes (and scales) at every position of the prefix, for every layer and plane, BF16 and
/// FP8; a prefix past the capacity and one of another layout are refused.
#[test]
fn a_saved_prefix_loads_into_another_cache_exactly() {
    let Some(d) = gpu("a_saved_prefix_loads_into_another_cache_exactly") else { return };
    let mut r = rng(23);
    for &(layers, planes, row, group) in &[(2, 1, 576, 64), (3, 2, 72, 24), (1, 1, 7, 7)] {
        for dtype in [KvDtype::Bf16, KvDtype::Fp8, KvDtype::F32] {
            let (cap, n) = (29, 17);
            let a = GpuKvCache::new(d, dtype, layers, planes, row, group, KvCapacity::Tokens(cap)).unwrap();
            for layer in 0..layers {
                for plane in 0..planes {
                    let src = rand_rows(&mut r, cap * row);
                    a.write(d, layer, plane, 0, cap, &up(d, &src, "test input")).unwrap();
                }
            }
            let saved = a.save_prefix(d, n).unwrap();
            assert_eq!(saved.tokens(), n);
            let mut b = GpuKvCache::new(d, dtype, layers, planes, row, group, KvCapacity::Tokens(40)).unwrap();
            b.load_prefix(d, &saved).unwrap();
            for layer in 0..layers {
                for plane in 0..planes {
                    let (x, y) = (read_f32(d, &a, layer, plane, 0, n), read_f32(d, &b, layer, plane, 0, n));
                    assert_bitwise_eq(&format!("{dtype:?} layer {layer} plane {plane}"), &y, &x);
                }
            }
            let mut small = GpuKvCache::new(d, dtype, layers, planes, row, group, KvCapacity::Tokens(n - 1)).unwrap();
            assert!(small.load_prefix(d, &saved).is_err(), "a prefix past the capacity");
            let mut other = GpuKvCache::new(d, dtype, layers, planes, row + 1, 1, KvCapacity::Tokens(cap)).unwrap();
            assert!(other.load_prefix(d, &saved).is_err(), "another layout");
            assert!(a.save_prefix(d, cap + 1).is_err(), "more than the capacity");
        }
    }
}
