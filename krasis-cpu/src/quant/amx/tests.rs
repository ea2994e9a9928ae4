//! The AMX kernel against the scalar twin, bit for bit: on emulated tiles (`super::emu`) on any
//! host with AVX-512, and on the hardware where the CPU has AMX-INT8. Without AMX the hardware
//! tests print a `*** SKIPPED` line and pass; `KRASIS_REQUIRE_AMX=1` makes that a failure.

use std::io::Write;
use std::ops::Range;

use krasis_quant::cpu_layout::{pack, PackedLayout, ROW_BLOCK};
use krasis_quant::group::{group_size_for, quantize};
use krasis_quant::Bits;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use super::emu::EmuTiles;
use super::tiles::{TileConfig, Tiles};
use super::{detect, matmul, HwTiles};
use crate::isa::Isa;
use crate::quant::tests::normal;
use crate::quant::{matmul_packed, quantize_acts, QuantizedActs};

/// Whether the host runs the kernel's AVX-512 parts (epilogue, INT4 unpacking).
fn has_avx512() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

/// Prints the skip line past the harness's capture and returns false when `ok` is false; panics
/// instead under `KRASIS_REQUIRE_AMX=1`.
fn or_skip(ok: bool, test: &str, why: &str) -> bool {
    if !ok {
        if krasis_core::knobs::knobs().require_amx {
            panic!("{test}: KRASIS_REQUIRE_AMX=1 but {why}");
        }
        let _ = writeln!(std::io::stderr(), "*** SKIPPED: {test} checked nothing: {why} ***");
    }
    ok
}

fn amx_or_skip(test: &str) -> bool {
    let why = match detect::support() {
        detect::AmxSupport::Usable if has_avx512() => return true,
        detect::AmxSupport::Usable => "no AVX-512 F/BW".to_string(),
        detect::AmxSupport::Unusable(why) => why.clone(),
    };
    or_skip(false, test, &format!("no AMX ({why})"))
}

/// One random problem: weights, activations, a sub-range of row blocks and cuts of the groups.
#[derive(Debug, Clone)]
struct Case {
    rows: usize,
    k: usize,
    gs: usize,
    m: usize,
    bits: Bits,
    blocks: Range<usize>,
    cuts: Vec<usize>,
    seed: u64,
}

/// Ragged rows and M (every tail of a 16-row tile, one and two tiles per pass, several row
/// chunks, odd block counts), K multiples of 32 with groups of 32/64/128 (tile K 32 and 64),
/// block sub-ranges and group ranges.
fn cases() -> impl Strategy<Value = Case> {
    (
        1usize..70,
        prop::sample::select(vec![1usize, 2, 3, 4, 5, 8, 12, 16]),
        prop::sample::select(vec![32usize, 64, 128]),
        prop_oneof![2 => 1usize..=40, 2 => 1usize..=100, 1 => 120usize..=300],
        any::<bool>(),
        (0.0f64..1.0, 0.0f64..1.0),
        prop::collection::vec(0.0f64..1.0, 0..4),
        any::<u64>(),
    )
        .prop_map(|(rows, k32, gpref, m, int8, cut, splits, seed)| {
            let k = 32 * k32;
            let gs = group_size_for(k, gpref).unwrap();
            let nb = rows.div_ceil(ROW_BLOCK);
            let (mut b0, mut b1) = ((cut.0 * (nb + 1) as f64) as usize, (cut.1 * (nb + 1) as f64) as usize);
            if b0 > b1 {
                std::mem::swap(&mut b0, &mut b1);
            }
            let ng = k / gs;
            let mut cuts: Vec<usize> = splits.iter().map(|f| (f * (ng + 1) as f64) as usize).collect();
            cuts.extend([0, ng]);
            cuts.sort_unstable();
            let bits = if int8 { Bits::Int8 } else { Bits::Int4 };
            Case { rows, k, gs, m, bits, blocks: b0..b1, cuts, seed }
        })
}

/// The kernel on tiles `t` over the case's group ranges, each call seeing only the groups
/// revealed so far (the rest poisoned, as a w2 task sees a half-quantised intermediate), against
/// the scalar kernel over all of K.
fn check<T: Tiles>(t: &mut T, c: &Case) -> Result<(), TestCaseError> {
    let (k, gs, m) = (c.k, c.gs, c.m);
    let ng = k / gs;
    let qm = quantize(&normal(c.rows * k, c.seed), c.rows, k, c.bits, gs);
    let (p, l) = (pack(&qm), PackedLayout::of(&qm));
    let mut x = normal(m * k, c.seed ^ 0x55);
    if c.seed.is_multiple_of(5) {
        x[..gs].fill(0.0); // an all-zero activation group (scale 0)
    }
    let mut a = QuantizedActs::new();
    quantize_acts(&x, m, k, gs, &mut a);
    let nc = c.blocks.len() * ROW_BLOCK;
    let mut want = vec![f32::NAN; m * nc];
    matmul_packed(Isa::Scalar, &p, &l, &a, c.blocks.clone(), &mut want);
    let mut seen = a.clone();
    seen.scales.fill(f32::NAN);
    seen.sums.fill(12345);
    seen.q.fill(99);
    let mut got = vec![f32::NAN; m * nc];
    for w in c.cuts.windows(2) {
        let (g0, g1) = (w[0], w[1]);
        for i in 0..m {
            let (s, q) = (i * ng + g0..i * ng + g1, i * k + g0 * gs..i * k + g1 * gs);
            seen.scales[s.clone()].copy_from_slice(&a.scales[s.clone()]);
            seen.sums[s.clone()].copy_from_slice(&a.sums[s]);
            seen.q[q.clone()].copy_from_slice(&a.q[q]);
        }
        if !c.blocks.is_empty() && g0 < g1 {
            // SAFETY: the caller checked the CPU (AVX-512 F/BW; AMX for the hardware tiles); the
            // shapes are consistent by construction.
            unsafe { matmul(t, &p, &l, &seen, c.blocks.clone(), g0..g1, &mut got) };
        }
    }
    if c.blocks.is_empty() {
        return Ok(());
    }
    for (e, (g, w)) in got.iter().zip(&want).enumerate() {
        prop_assert!(g.to_bits() == w.to_bits(), "{c:?}: row {} col {}: {g} vs {w}", e / nc, e % nc);
    }
    Ok(())
}

fn run_cases<T: Tiles>(tiles: impl Fn() -> T, cases_n: u32) {
    let mut runner = TestRunner::new(Config { cases: cases_n, ..Config::default() });
    runner.run(&cases(), |c| check(&mut tiles(), &c)).unwrap();
}

#[test]
fn emulated_tiles_match_scalar() {
    if !or_skip(has_avx512(), "emulated_tiles_match_scalar", "no AVX-512 F/BW") {
        return;
    }
    run_cases(EmuTiles::new, 256);
}

#[test]
fn hardware_tiles_match_scalar() {
    if !amx_or_skip("hardware_tiles_match_scalar") {
        return;
    }
    run_cases(|| HwTiles, 512);
}

/// `matmul_packed` itself (the dispatch: AMX from `min_rows` on where enabled) against the
/// scalar twin at prefill sizes, V2-Lite-like K, both widths.
#[test]
fn dispatch_matches_scalar_at_prefill_sizes() {
    if !amx_or_skip("dispatch_matches_scalar_at_prefill_sizes") {
        return;
    }
    assert!(super::enabled(), "AMX is usable but not enabled (KRASIS_ISA set?)");
    for (bits, m) in [(Bits::Int8, 96), (Bits::Int4, 97), (Bits::Int8, super::min_rows()), (Bits::Int4, 1024)] {
        let (rows, k, gs) = (80, 1408, 128);
        let qm = quantize(&normal(rows * k, m as u64), rows, k, bits, gs);
        let (p, l) = (pack(&qm), PackedLayout::of(&qm));
        let mut a = QuantizedActs::new();
        quantize_acts(&normal(m * k, 7), m, k, gs, &mut a);
        let n = m * l.rows_padded;
        let (mut want, mut got) = (vec![0f32; n], vec![0f32; n]);
        matmul_packed(Isa::Scalar, &p, &l, &a, 0..l.row_blocks(), &mut want);
        matmul_packed(Isa::Avx512, &p, &l, &a, 0..l.row_blocks(), &mut got);
        assert!(got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()), "{bits:?} m={m}");
    }
}

/// The 64-byte `ldtilecfg` operand: palette at byte 0, bytes per row from byte 16, rows from 48.
#[test]
fn tile_config_bytes() {
    let c = TileConfig::new(32);
    assert_eq!(std::mem::size_of::<TileConfig>(), 64);
    // SAFETY: TileConfig is 64 bytes of plain integers.
    let b: &[u8; 64] = unsafe { &*(&c as *const TileConfig as *const [u8; 64]) };
    assert_eq!(b[0], 1);
    assert_eq!(u16::from_le_bytes([b[16], b[17]]), 64); // C tile 0: 16 i32
    assert_eq!(u16::from_le_bytes([b[16 + 2 * 4], b[17 + 2 * 4]]), 32); // A tile 4: kt bytes
    assert_eq!((b[48], b[48 + 4], b[48 + 6], b[48 + 8]), (16, 16, 8, 0)); // C, A, B (kt/4), unused
}

/// The emulated `tdpbsud` on a hand-computed case: A signed, B unsigned, B row r holding k
/// 4r..4r+3 of each of 16 columns.
#[test]
fn emulated_tdpbsud_definition() {
    let mut t = EmuTiles::new();
    let a: Vec<i8> = (0..16 * 32).map(|e| ((e % 7) as i8) - 3).collect(); // 16 rows × 32 k
    let b: Vec<u8> = (0..8 * 64).map(|e| (e * 37 % 256) as u8).collect(); // 8 rows × 16 cols × 4
    let mut c = vec![0i32; 256];
    // SAFETY: the buffers cover the configured tiles.
    unsafe {
        t.configure(&TileConfig::new(32));
        t.zero(0);
        t.load(4, a.as_ptr() as *const u8, 32);
        t.load(6, b.as_ptr(), 64);
        t.dp(0);
        t.dp(0);
        t.store(0, c.as_mut_ptr() as *mut u8, 64);
    }
    for m in 0..16 {
        for n in 0..16 {
            let want: i32 = (0..32).map(|kk| a[m * 32 + kk] as i32 * b[(kk / 4) * 64 + 4 * n + kk % 4] as i32).sum();
            assert_eq!(c[m * 16 + n], 2 * want, "({m}, {n})");
        }
    }
}

/// Not a test: prints, on an AMX machine, single-thread time per call of the AVX-512 VNNI kernel
/// and the AMX kernel on V2-Lite shapes for a range of M, and the crossover (the smallest M from
/// which AMX is faster at every larger M tried), to set `AMX_MIN_ROWS`. Run with
/// `cargo test --release -p krasis-cpu amx_crossover -- --ignored --nocapture`.
#[test]
#[ignore]
fn amx_crossover() {
    // Without AMX it still prints the VNNI column (and says why there is no AMX one).
    let amx_ok = amx_or_skip("amx_crossover (its AMX column)");
    if !has_avx512() {
        return;
    }
    // (name, rows, k): w13 and w2 of a routed expert, a square attention projection.
    let shapes = [("w13 2816x2048", 2816, 2048), ("w2 2048x1408", 2048, 1408), ("dense 2048x2048", 2048, 2048)];
    let ms = [2usize, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024];
    for bits in [Bits::Int8, Bits::Int4] {
        for (name, rows, k) in shapes {
            let qm = quantize(&normal(rows * k, 3), rows, k, bits, 128);
            let (p, l) = (pack(&qm), PackedLayout::of(&qm));
            let mut faster = Vec::new();
            println!("{bits:?} {name}: M, VNNI µs, AMX µs, VNNI/AMX");
            for &m in &ms {
                let mut a = QuantizedActs::new();
                quantize_acts(&normal(m * k, 5), m, k, 128, &mut a);
                let mut y = vec![0f32; m * l.rows_padded];
                let mut time = |f: &mut dyn FnMut(&mut [f32])| {
                    let mut best = f64::MAX;
                    for _ in 0..7 {
                        let t0 = std::time::Instant::now();
                        f(&mut y);
                        best = best.min(t0.elapsed().as_secs_f64());
                    }
                    best * 1e6
                };
                let nb = l.row_blocks();
                let pf = super::super::active_prefetch();
                // SAFETY: the host has AVX-512 (checked above).
                let vnni =
                    time(&mut |y| unsafe { super::super::avx512::matmul(&p, &l, &a, 0..nb, 0..l.groups(), y, pf) });
                if !amx_ok {
                    let gmacs = (m * l.rows_padded * k) as f64 / vnni / 1e3;
                    println!("  {m:5} {vnni:10.1}          - ({gmacs:.1} GMAC/s)");
                    continue;
                }
                // SAFETY: the host has AVX-512 and AMX (checked above).
                let amx = time(&mut |y| unsafe { matmul(&mut HwTiles, &p, &l, &a, 0..nb, 0..l.groups(), y) });
                println!("  {m:5} {vnni:10.1} {amx:10.1} {:6.2}", vnni / amx);
                faster.push((m, amx < vnni));
            }
            if !amx_ok {
                continue;
            }
            let cross = faster.iter().rposition(|&(_, f)| !f).map_or(Some(ms[0]), |i| ms.get(i + 1).copied());
            match cross {
                Some(m) => println!("  crossover {bits:?} {name}: AMX faster from M = {m} on"),
                None => println!("  crossover {bits:?} {name}: AMX never faster"),
            }
        }
    }
}

/// The BF16 tile kernel against its scalar twin on random panels and activations: ragged row
/// blocks (odd counts) and row tiles, K from one tile step up.
fn check_bf16<T: Tiles>(t: &mut T, mtiles: usize, nb: usize, ksteps: usize, seed: u64) -> Result<(), TestCaseError> {
    use crate::moe::tests::data;
    use crate::quant::bf16::{bf16_bits, bf16_value};
    let k = ksteps * super::bf16::TILE_K;
    let m = mtiles * 16;
    let x: Vec<u16> = data(m * k, seed).iter().map(|&v| bf16_bits(v)).collect();
    let panel: Vec<u16> = data(nb * k * 16, seed ^ 0x55).iter().map(|&v| bf16_bits(v)).collect();
    let os = nb * 16 + 3;
    let (mut got, mut want) = (vec![f32::NAN; m * os], vec![f32::NAN; m * os]);
    // SAFETY: extents as the kernel documents them.
    unsafe {
        super::bf16::matmul(t, panel.as_ptr(), nb, k, x.as_ptr(), mtiles, got.as_mut_ptr(), os);
        super::bf16::matmul_scalar(panel.as_ptr(), nb, k, x.as_ptr(), mtiles, want.as_mut_ptr(), os);
    }
    for i in 0..m {
        for c in 0..nb * 16 {
            let (b, n) = (c / 16, c % 16);
            let mag: f32 = (0..k)
                .map(|kk| {
                    (bf16_value(x[super::bf16::tiled_index(i, kk, ksteps)])
                        * bf16_value(panel[b * k * 16 + (kk / 2) * 32 + 2 * n + kk % 2]))
                    .abs()
                })
                .sum();
            let (g, w) = (got[i * os + c], want[i * os + c]);
            prop_assert!((g - w).abs() <= 1e-5 * mag + 1e-30, "row {i} col {c}: tiles {g} scalar {w}");
        }
        prop_assert!(got[i * os + nb * 16..(i + 1) * os].iter().all(|v| v.is_nan()), "row {i}: wrote past the blocks");
    }
    Ok(())
}

fn run_bf16_cases<T: Tiles>(tiles: impl Fn() -> T, n: u32) {
    let mut runner = TestRunner::new(Config { cases: n, ..Config::default() });
    runner
        .run(&(1usize..5, 1usize..6, 1usize..6, any::<u64>()), |(mt, nb, ks, seed)| {
            check_bf16(&mut tiles(), mt, nb, ks, seed)
        })
        .unwrap();
}

#[test]
fn emulated_bf16_tiles_match_scalar() {
    run_bf16_cases(EmuTiles::new, 24);
}

#[test]
fn hardware_bf16_tiles_match_scalar() {
    if amx_or_skip("hardware_bf16_tiles_match_scalar")
        && or_skip(detect::bf16_available(), "hardware_bf16_tiles_match_scalar", "no AMX-BF16 or AVX-512 BF16")
    {
        run_bf16_cases(|| HwTiles, 64);
    }
}
