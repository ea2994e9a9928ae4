use proptest::prelude::*;

use super::*;
use crate::attention::{causal_attention, KvCacheView};
use krasis_quant::cpu_layout::pack;
use krasis_quant::group::{dequantize, quantize};

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0).collect()
}

/// `x` rounded to the nearest BF16 value.
fn bf16_exact(x: f32) -> f32 {
    crate::quant::bf16::bf16_value(crate::quant::bf16::bf16_bits(x))
}

/// Inputs of one test case: q `[t, heads, qk]`, cache rows `[q_start + t, stride]`, `kv_b` rows.
struct Case {
    d: MlaDims,
    t: usize,
    q_start: usize,
    stride: usize,
    q: Vec<f32>,
    cache: Vec<f32>,
    kv_b: Vec<f32>,
    scale: f32,
}

impl Case {
    fn new(d: MlaDims, t: usize, q_start: usize, pad: usize, seed: u32) -> Case {
        let stride = d.latent + d.rope + pad;
        let rows = q_start + t;
        // kv_b small enough that scores stay O(1) (softmax neither flat nor one-hot).
        // Values BF16 holds exactly, so the expansion on the BF16 tiles ([`expand_tiles`]) is
        // held to the same bounds as the f32 one.
        let kv_b: Vec<f32> = data(d.heads * (d.nope + d.v_dim) * d.latent, seed ^ 3)
            .iter()
            .map(|x| bf16_exact(x / (d.latent as f32).sqrt()))
            .collect();
        Case {
            d,
            t,
            q_start,
            stride,
            q: data(t * d.heads * (d.nope + d.rope), seed),
            cache: data(rows * stride, seed ^ 1).into_iter().map(bf16_exact).collect(),
            kv_b,
            scale: 1.0 / ((d.nope + d.rope) as f32).sqrt(),
        }
    }

    fn inputs(&self) -> MlaPrefillInputs<'_> {
        MlaPrefillInputs {
            dims: self.d,
            q: &self.q,
            t: self.t,
            q_start: self.q_start,
            cache: &self.cache,
            stride: self.stride,
            kv_b: KvBWeights::F32(&self.kv_b),
            scale: self.scale,
        }
    }

    /// MLA attention in f64 straight from the definition: expand every key row, then softmax.
    fn reference(&self) -> Vec<f64> {
        self.reference_and_magnitude().0
    }

    /// The f64 attention, and beside each output the size of the sum that made it,
    /// `Σ_p w_p·|v_p|`: a rounding of the probabilities or the values errs in proportion to
    /// that, not to the output, which cancellation can make much smaller.
    fn reference_and_magnitude(&self) -> (Vec<f64>, Vec<f64>) {
        let MlaDims { heads: h, nope, rope, v_dim: vd, latent: lat } = self.d;
        let (qk, per_head, rows) = (nope + rope, nope + vd, self.q_start + self.t);
        let mut out = vec![0f64; self.t * h * vd];
        let mut magnitude = vec![0f64; out.len()];
        for hh in 0..h {
            let expand = |r: usize, c: usize| -> f64 {
                let w = &self.kv_b[(hh * per_head + c) * lat..][..lat];
                let x = &self.cache[r * self.stride..][..lat];
                w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum()
            };
            let k: Vec<Vec<f64>> = (0..rows)
                .map(|r| {
                    let mut k: Vec<f64> = (0..nope).map(|c| expand(r, c)).collect();
                    k.extend((0..rope).map(|d| self.cache[r * self.stride + lat + d] as f64));
                    k
                })
                .collect();
            let v: Vec<Vec<f64>> = (0..rows).map(|r| (0..vd).map(|c| expand(r, nope + c)).collect()).collect();
            for i in 0..self.t {
                let q = &self.q[(i * h + hh) * qk..][..qk];
                let s: Vec<f64> = (0..=self.q_start + i)
                    .map(|p| q.iter().zip(&k[p]).map(|(a, b)| *a as f64 * b).sum::<f64>() * self.scale as f64)
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                let o = &mut out[(i * h + hh) * vd..][..vd];
                let mag = &mut magnitude[(i * h + hh) * vd..][..vd];
                for (p, w) in e.iter().enumerate() {
                    for ((x, a), vv) in o.iter_mut().zip(mag.iter_mut()).zip(&v[p]) {
                        *x += w / z * vv;
                        *a += w / z * vv.abs();
                    }
                }
            }
        }
        (out, magnitude)
    }
}

/// Largest |a − b| over the largest |b| (1 where b is all zero).
fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    err_over_magnitude(a, b, b)
}

/// Largest |a − b| over the largest |magnitude| (the sums that made `b`, see
/// [`Case::reference_and_magnitude`]; [`rel_err`] takes `b` itself).
fn err_over_magnitude(a: &[f32], b: &[f64], magnitude: &[f64]) -> f64 {
    let scale = magnitude.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((*x as f64 - y).abs())) / scale
}

fn dims() -> impl Strategy<Value = MlaDims> {
    (prop::sample::select(vec![1usize, 3, 16]), 1usize..40, 1usize..20, 1usize..40, 1usize..70)
        .prop_map(|(heads, nope, rope, v_dim, latent)| MlaDims { heads, nope, rope, v_dim, latent })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    /// Ragged shapes (odd row counts, a prefix already cached, 1/3/16 heads, padded cache rows),
    /// tiles of one block up to the whole context, against the f64 definition.
    #[test]
    fn matches_f64_reference(d in dims(), t in 1usize..150, q_start in 0usize..150, pad in 0usize..3,
                             tile_blocks in 1usize..4, seed in any::<u32>()) {
        let c = Case::new(d, t, q_start, pad, seed);
        let mut out = vec![f32::NAN; t * d.heads * d.v_dim];
        run(&c.inputs(), &mut out, tile_blocks * BLOCK_K, None, None);
        let err = rel_err(&out, &c.reference());
        prop_assert!(err < 2e-5, "{:?} t {} q_start {}: error {}", d, t, q_start, err);
        let mut whole = vec![f32::NAN; out.len()];
        mla_prefill_attention(&c.inputs(), &mut whole).unwrap();
        prop_assert!(rel_err(&whole, &c.reference()) < 2e-5);
    }

    /// One call over the whole prompt, or two calls (the second with the first's rows cached),
    /// with any tile size: the same bits.
    #[test]
    fn calls_split_anywhere_give_the_same_bits(d in dims(), t in 2usize..200, cut in 1usize..199,
                                               tile_blocks in 1usize..4, seed in any::<u32>()) {
        let cut = cut.min(t - 1);
        let c = Case::new(d, t, 0, 0, seed);
        let mut whole = vec![0f32; t * d.heads * d.v_dim];
        mla_prefill_attention(&c.inputs(), &mut whole).unwrap();
        let per_row = d.heads * (d.nope + d.rope);
        let first = MlaPrefillInputs { t: cut, q: &c.q[..cut * per_row], ..c.inputs() };
        let second = MlaPrefillInputs { t: t - cut, q_start: cut, q: &c.q[cut * per_row..], ..c.inputs() };
        let mut parts = vec![0f32; whole.len()];
        let split = cut * d.heads * d.v_dim;
        let (tiles, attend) = call_tiles(&c.inputs());
        run(&first, &mut parts[..split], tile_blocks * BLOCK_K, tiles, attend);
        run(&second, &mut parts[split..], (tile_blocks % 3 + 1) * BLOCK_K, tiles, attend);
        prop_assert!(whole.iter().zip(&parts).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

/// The tile configurations to check the BF16 expansion on: the emulation, and the hardware
/// where this CPU has AMX-BF16.
fn expansion_tiles() -> Vec<Bf16Tiles> {
    let mut t = vec![Bf16Tiles::Emulated];
    #[cfg(target_arch = "x86_64")]
    if crate::quant::amx::enabled() && crate::quant::amx::detect::bf16_available() && isa::active() == Isa::Avx512 {
        t.push(Bf16Tiles::Hardware);
    }
    t
}

/// Largest error of the attention on the tiles against the f64 definition: queries, keys,
/// probabilities and values each rounded once to BF16 (2^-9 relative) on O(1) scores. Against
/// random cases it is measured over the size of the sums ([`err_over_magnitude`]): over the
/// largest output it grew without bound where the values cancel (one head, four value columns:
/// outputs 12× smaller than their sums, an error of 0.0101 that is 8.5e-4 of the sums). Over
/// 8,000 random cases of the proptest's shapes the worst was 4.6e-3 of the sums.
const ATTEND_BF16_BOUND: f64 = 1e-2;

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The expansion on the BF16 tiles, alone or with the attention on them too (latent a
    /// multiple of the tile K; ragged per-head, query/key (zero-padded to the tile K) and value
    /// widths, row counts and cached prefixes; tiles of one block up to the whole context), on
    /// inputs BF16 holds exactly: the f64 definition's bound (the expansion alone) or BF16's
    /// rounding of it (with the attention), and a prompt split into two calls (the second with
    /// another tile size) gives the same bits as one call.
    #[test]
    fn tiles_match_f64_reference(heads in prop::sample::select(vec![1usize, 3]), nope in 1usize..50,
                                 rope in 1usize..30, v_dim in 1usize..40, lat_steps in 1usize..4,
                                 t in 2usize..140, q_start in 0usize..80, cut in 1usize..139,
                                 tile_blocks in 1usize..4, attend in any::<bool>(), seed in any::<u32>()) {
        let d = MlaDims { heads, nope, rope, v_dim, latent: 32 * lat_steps };
        let c = Case::new(d, t, q_start, 1, seed);
        let (want, magnitude) = c.reference_and_magnitude();
        let bound = if attend { ATTEND_BF16_BOUND } else { 2e-5 };
        for tiles in expansion_tiles() {
            let on = attend.then_some(tiles);
            let mut out = vec![f32::NAN; t * heads * v_dim];
            run(&c.inputs(), &mut out, tile_blocks * BLOCK_K, Some(tiles), on);
            let err = if attend { err_over_magnitude(&out, &want, &magnitude) } else { rel_err(&out, &want) };
            prop_assert!(err < bound, "{:?} {:?} t {} q_start {}: error {}", tiles, d, t, q_start, err);
            let cut = cut.min(t - 1);
            let per_row = heads * (nope + rope);
            let first = MlaPrefillInputs { t: cut, q: &c.q[..cut * per_row], ..c.inputs() };
            let second = MlaPrefillInputs { t: t - cut, q_start: q_start + cut, q: &c.q[cut * per_row..], ..c.inputs() };
            let mut parts = vec![0f32; out.len()];
            let split = cut * heads * v_dim;
            run(&first, &mut parts[..split], BLOCK_K, Some(tiles), on);
            run(&second, &mut parts[split..], (tile_blocks % 3 + 1) * BLOCK_K, Some(tiles), on);
            prop_assert!(out.iter().zip(&parts).all(|(a, b)| a.to_bits() == b.to_bits()), "{:?} split at {}", tiles, cut);
        }
    }
}

/// The attention on the tiles on V2-Lite's head shapes with INT8 packed `kv_b`: within BF16's
/// rounding of the f32 attention after the same expansion, and not equal to it (the tiles ran).
#[test]
fn tile_attention_rounds_to_bf16() {
    let d = MlaDims { heads: 2, nope: 128, rope: 64, v_dim: 128, latent: 512 };
    let mut c = Case::new(d, 100, 30, 0, 5);
    c.cache = data(c.cache.len(), 13);
    let (uk, lu, uv, lv) = pack_per_head(&c.kv_b, &d, Bits::Int8, 32);
    let packed = KvBWeights::Packed { uk: &uk, uk_layout: lu, uv: &uv, uv_layout: lv };
    let inputs = MlaPrefillInputs { kv_b: packed, ..c.inputs() };
    for tiles in expansion_tiles() {
        let mut f32_out = vec![0f32; 100 * d.heads * d.v_dim];
        run(&inputs, &mut f32_out, 2 * BLOCK_K, Some(tiles), None);
        let want: Vec<f64> = f32_out.iter().map(|&x| x as f64).collect();
        let mut out = vec![0f32; f32_out.len()];
        run(&inputs, &mut out, 2 * BLOCK_K, Some(tiles), Some(tiles));
        let err = rel_err(&out, &want);
        assert!(err > 0.0 && err < ATTEND_BF16_BOUND, "{tiles:?}: attention on the tiles against f32: {err}");
    }
}

/// The BF16 expansion rounds what it multiplies: on inputs BF16 does not hold exactly it stays
/// within BF16's rounding of the f32 expansion (V2-Lite's head shapes, INT8 packed `kv_b`), and
/// it differs from it (the tiles ran).
#[test]
fn tile_expansion_rounds_to_bf16() {
    let d = MlaDims { heads: 2, nope: 128, rope: 64, v_dim: 128, latent: 512 };
    let mut c = Case::new(d, 40, 30, 0, 9);
    c.cache = data(c.cache.len(), 11);
    let (uk, lu, uv, lv) = pack_per_head(&c.kv_b, &d, Bits::Int8, 32);
    let packed = KvBWeights::Packed { uk: &uk, uk_layout: lu, uv: &uv, uv_layout: lv };
    let inputs = MlaPrefillInputs { kv_b: packed, ..c.inputs() };
    let mut f32_out = vec![0f32; 40 * d.heads * d.v_dim];
    run(&inputs, &mut f32_out, 2 * BLOCK_K, None, None);
    let want: Vec<f64> = f32_out.iter().map(|&x| x as f64).collect();
    for tiles in expansion_tiles() {
        let mut out = vec![0f32; f32_out.len()];
        run(&inputs, &mut out, 2 * BLOCK_K, Some(tiles), None);
        let err = rel_err(&out, &want);
        assert!(err > 0.0 && err < 1e-2, "{tiles:?}: BF16 expansion against f32: {err}");
    }
}

/// The decompressed form against the absorbed one (`W_UK` folded into q, attention over the
/// latent, `W_UV` after) on V2-Lite's head shapes.
#[test]
fn equals_the_absorbed_form() {
    let d = MlaDims { heads: 4, nope: 128, rope: 64, v_dim: 128, latent: 512 };
    let (t, q_start) = (70, 33);
    let c = Case::new(d, t, q_start, 0, 7);
    let (per_head, row) = (d.nope + d.v_dim, d.latent + d.rope);
    let mut out = vec![0f32; t * d.heads * d.v_dim];
    mla_prefill_attention(&c.inputs(), &mut out).unwrap();
    let mut q_abs = vec![0f32; t * d.heads * row];
    for (idx, qa) in q_abs.chunks_exact_mut(row).enumerate() {
        let (qn, qr) = c.q[idx * (d.nope + d.rope)..][..d.nope + d.rope].split_at(d.nope);
        let hh = idx % d.heads;
        for (n, &x) in qn.iter().enumerate() {
            let wk = &c.kv_b[(hh * per_head + n) * d.latent..][..d.latent];
            qa[..d.latent].iter_mut().zip(wk).for_each(|(a, b)| *a += x * b);
        }
        qa[d.latent..].copy_from_slice(qr);
    }
    let kv = KvCacheView {
        k: &c.cache,
        k_stride: c.stride,
        v: &c.cache,
        v_stride: c.stride,
        kv_heads: 1,
        k_dim: row,
        v_dim: d.latent,
        len: q_start + t,
    };
    let mut o_lat = vec![0f32; t * d.heads * d.latent];
    causal_attention(&q_abs, t, d.heads, q_start, &kv, c.scale, &mut o_lat);
    let absorbed: Vec<f64> = o_lat
        .chunks_exact(d.latent)
        .enumerate()
        .flat_map(|(idx, ol)| {
            let hh = idx % d.heads;
            (0..d.v_dim)
                .map(|j| {
                    let wv = &c.kv_b[(hh * per_head + d.nope + j) * d.latent..][..d.latent];
                    wv.iter().zip(ol).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let err = rel_err(&out, &absorbed);
    assert!(err < 1e-4, "decompressed vs absorbed: {err}");
    assert!(rel_err(&out, &c.reference()) < 2e-5);
}

#[test]
fn bad_shapes_are_errors() {
    let d = MlaDims { heads: 2, nope: 4, rope: 2, v_dim: 4, latent: 8 };
    let c = Case::new(d, 5, 3, 0, 1);
    let mut out = vec![0f32; 5 * 2 * 4];
    let short = MlaPrefillInputs { cache: &c.cache[..c.stride * 7], ..c.inputs() };
    assert_eq!(mla_prefill_attention(&short, &mut out), Err(MlaPrefillError::Cache { cached: 7, needed: 8 }));
    assert!(matches!(mla_prefill_attention(&c.inputs(), &mut out[..3]), Err(MlaPrefillError::Len { .. })));
    let short_w = MlaPrefillInputs { kv_b: KvBWeights::F32(&c.kv_b[1..]), ..c.inputs() };
    assert!(matches!(mla_prefill_attention(&short_w, &mut out), Err(MlaPrefillError::Len { .. })));
    let d8 = MlaDims { latent: 32, ..d };
    let c8 = Case::new(d8, 5, 3, 0, 1);
    let (uk, lu, uv, lv) = pack_per_head(&c8.kv_b, &d8, Bits::Int8, 32);
    let packed = KvBWeights::Packed { uk: &uk, uk_layout: lu, uv: &uv, uv_layout: lv };
    let ok = MlaPrefillInputs { kv_b: packed, ..c8.inputs() };
    assert_eq!(mla_prefill_attention(&ok, &mut out), Ok(()));
    let wrong = KvBWeights::Packed { uk: &uk, uk_layout: lv, uv: &uv, uv_layout: lv };
    let bad = MlaPrefillInputs { kv_b: wrong, ..c8.inputs() };
    assert!(matches!(mla_prefill_attention(&bad, &mut out), Err(MlaPrefillError::Layout { what: "W_UK", .. })));
    let short = KvBWeights::Packed { uk: &uk, uk_layout: lu, uv: &uv[1..], uv_layout: lv };
    let bad = MlaPrefillInputs { kv_b: short, ..c8.inputs() };
    assert!(matches!(mla_prefill_attention(&bad, &mut out), Err(MlaPrefillError::Layout { what: "W_UV", .. })));
    let narrow = MlaPrefillInputs { stride: 9, ..c.inputs() };
    assert!(matches!(mla_prefill_attention(&narrow, &mut out), Err(MlaPrefillError::Stride { .. })));
}

/// `kv_b` rows quantised per head as the dense-weight cache holds them (`W_UKᵀ` `[latent, nope
/// padded to 32]`, `W_UV` `[v_dim, latent]`, group `gs`), packed back to back.
fn pack_per_head(kv_b: &[f32], d: &MlaDims, bits: Bits, gs: usize) -> (Vec<u8>, PackedLayout, Vec<u8>, PackedLayout) {
    let (per_head, lat) = (d.nope + d.v_dim, d.latent);
    let kp = d.nope.next_multiple_of(32);
    let (mut uk, mut uv) = (Vec::new(), Vec::new());
    let (mut lu, mut lv) = (None, None);
    for h in 0..d.heads {
        let mut wk = vec![0f32; lat * kp];
        for n in 0..d.nope {
            for j in 0..lat {
                wk[j * kp + n] = kv_b[(h * per_head + n) * lat + j];
            }
        }
        let wv = kv_b[(h * per_head + d.nope) * lat..(h + 1) * per_head * lat].to_vec();
        let (qk, qv) = (quantize(&wk, lat, kp, bits, 32), quantize(&wv, d.v_dim, lat, bits, gs));
        lu = Some(PackedLayout::of(&qk));
        lv = Some(PackedLayout::of(&qv));
        uk.extend(pack(&qk));
        uv.extend(pack(&qv));
    }
    (uk, lu.unwrap(), uv, lv.unwrap())
}

/// `kv_b` rows holding exactly what [`pack_per_head`] packed (its dequantised values).
fn dequantised_rows(kv_b: &[f32], d: &MlaDims, bits: Bits, gs: usize) -> Vec<f32> {
    let (per_head, lat) = (d.nope + d.v_dim, d.latent);
    let kp = d.nope.next_multiple_of(32);
    let mut out = kv_b.to_vec();
    for h in 0..d.heads {
        let mut wk = vec![0f32; lat * kp];
        for n in 0..d.nope {
            for j in 0..lat {
                wk[j * kp + n] = kv_b[(h * per_head + n) * lat + j];
            }
        }
        let dk = dequantize(&quantize(&wk, lat, kp, bits, 32));
        for n in 0..d.nope {
            for j in 0..lat {
                out[(h * per_head + n) * lat + j] = dk[j * kp + n];
            }
        }
        let rows = (h * per_head + d.nope) * lat..(h + 1) * per_head * lat;
        let dv = dequantize(&quantize(&kv_b[rows.clone()], d.v_dim, lat, bits, gs));
        out[rows].copy_from_slice(&dv);
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// INT8 and INT4 packed `kv_b`, dequantised per task, give the same bits as f32 rows holding
    /// the dequantised values (the dequantisation is exact).
    #[test]
    fn packed_kv_b_equals_its_dequantised_rows(heads in 1usize..4, nope in 1usize..70, rope in 1usize..10,
                                               v_dim in 1usize..70, lat_groups in 1usize..4, int4 in any::<bool>(),
                                               t in 1usize..100, q_start in 0usize..80, seed in any::<u32>()) {
        let (bits, gs) = if int4 { (Bits::Int4, 64) } else { (Bits::Int8, 32) };
        let d = MlaDims { heads, nope, rope, v_dim, latent: lat_groups * 64 };
        let c = Case::new(d, t, q_start, 1, seed);
        let (uk, lu, uv, lv) = pack_per_head(&c.kv_b, &d, bits, gs);
        let rows = dequantised_rows(&c.kv_b, &d, bits, gs);
        let packed = MlaPrefillInputs { kv_b: KvBWeights::Packed { uk: &uk, uk_layout: lu, uv: &uv, uv_layout: lv }, ..c.inputs() };
        let mut got = vec![0f32; t * heads * v_dim];
        mla_prefill_attention(&packed, &mut got).unwrap();
        // The f32 rows on the kernels the packed call ran on.
        let (expand, attend) = call_tiles(&packed);
        let mut want = vec![0f32; got.len()];
        let cap = tile_rows(&d).min((q_start + t).next_multiple_of(BLOCK_K));
        run(&MlaPrefillInputs { kv_b: KvBWeights::F32(&rows), ..c.inputs() }, &mut want, cap, expand, attend);
        prop_assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

/// The AVX-512 INT8 dequantisation against its scalar twin, bit for bit, on V2-Lite's head
/// shapes and on ragged ones (v_dim not a multiple of 16, a panel narrower than 64).
#[test]
fn head_weights_isas_agree() {
    for d in [
        MlaDims { heads: 2, nope: 128, rope: 64, v_dim: 128, latent: 512 },
        MlaDims { heads: 3, nope: 48, rope: 8, v_dim: 37, latent: 96 },
    ] {
        let c = Case::new(d, 1, 0, 0, 5);
        let (uk, lu, uv, lv) = pack_per_head(&c.kv_b, &d, Bits::Int8, 32);
        let w = KvBWeights::Packed { uk: &uk, uk_layout: lu, uv: &uv, uv_layout: lv };
        for hh in 0..d.heads {
            let n = d.latent * (d.nope + d.v_dim);
            let mut want = vec![f32::NAN; n];
            head_weights(Isa::Scalar, &w, &d, hh, &mut want);
            assert!(want.iter().all(|x| x.is_finite()), "every element written");
            for isa in Isa::available() {
                let mut got = vec![f32::NAN; n];
                head_weights(isa, &w, &d, hh, &mut got);
                assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?} head {hh} {d:?}");
            }
        }
    }
}
