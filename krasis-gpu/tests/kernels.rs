//! Every kernel against a scalar CPU twin (written here, in plain loops) on random shapes,
//! ragged ones included. Inputs are pre-rounded to BF16 so the comparison isolates the kernel;
//! outputs are poisoned with NaN before each launch so an unwritten element fails.
//!
//! Without a GPU every test prints "SKIPPED: no GPU" (past the harness's capture) and passes;
//! with `KRASIS_REQUIRE_GPU=1` a missing GPU fails instead.

#![allow(clippy::needless_range_loop)] // the scalar twins are plain index loops on purpose

mod common;

use common::{
    assert_bf16_close, assert_close, down, from_bf16, gpu, poisoned_bf16, poisoned_f32, rand_bf16_f32, rng, to_bf16, up,
};
use krasis_core::dtype::bf16_to_f32;
use krasis_gpu::{
    GpuDevice, GpuError, GpuKvCache, GqaShape, KvCapacity, KvDtype, RopeLayout, RopePairing, RowsView, SwiGluLayout,
    VramBudgetSpec, AUTO_VRAM_SAFETY_MARGIN,
};
use rand::Rng;

// ---------------------------------------------------------------- scalar twins

fn twin_embedding(table: &[u16], vocab: usize, hidden: usize, ids: &[i32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(ids.len() * hidden);
    for &id in ids {
        if id < 0 || id as usize >= vocab {
            out.extend(std::iter::repeat_n(f32::NAN, hidden));
        } else {
            let r = id as usize * hidden;
            out.extend(table[r..r + hidden].iter().map(|&b| bf16_to_f32(b)));
        }
    }
    out
}

/// Returns (x after the add, y).
fn twin_rmsnorm(x: &[f32], delta: Option<&[f32]>, w: &[f32], hidden: usize, eps: f32) -> (Vec<f32>, Vec<f32>) {
    let mut xo = x.to_vec();
    if let Some(d) = delta {
        for (a, b) in xo.iter_mut().zip(d) {
            *a += *b;
        }
    }
    let mut y = vec![0.0f32; x.len()];
    for (xr, yr) in xo.chunks(hidden).zip(y.chunks_mut(hidden)) {
        let ss: f64 = xr.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let scale = 1.0 / ((ss / hidden as f64) as f32 + eps).sqrt();
        for i in 0..hidden {
            yr[i] = xr[i] * scale * w[i];
        }
    }
    (xo, y)
}

fn twin_rope(x: &mut [f32], positions: &[i32], cos: &[f32], sin: &[f32], max_pos: usize, l: &RopeLayout) {
    let half = l.rot_dim / 2;
    for t in 0..l.n_tokens {
        let p = positions[t];
        for h in 0..l.n_heads {
            let base = t * l.token_stride + h * l.head_stride + l.rot_offset;
            for i in 0..half {
                let (ia, ib) = match l.pairing {
                    RopePairing::Interleaved => (base + 2 * i, base + 2 * i + 1),
                    RopePairing::Halves => (base + i, base + i + half),
                };
                if p < 0 || p as usize >= max_pos {
                    x[ia] = f32::NAN;
                    x[ib] = f32::NAN;
                    continue;
                }
                let (c, s) = (cos[p as usize * half + i], sin[p as usize * half + i]);
                let (a, b) = (x[ia], x[ib]);
                x[ia] = a * c - b * s;
                x[ib] = b * c + a * s;
            }
        }
    }
}

fn twin_silu_mul(gate: &[f32], up: &[f32], up_offset: usize, l: &SwiGluLayout) -> Vec<f32> {
    let mut out = vec![f32::NAN; if l.rows == 0 { 0 } else { (l.rows - 1) * l.out_stride + l.cols }];
    for r in 0..l.rows {
        for c in 0..l.cols {
            let g = gate[r * l.gate_stride + c];
            let u = up[up_offset + r * l.up_stride + c];
            out[r * l.out_stride + c] = g / (1.0 + (-g).exp()) * u;
        }
    }
    out
}

/// YaRN-like tables: angle = pos · inv_freq_i, scaled by an attention factor as YaRN does.
fn rope_tables(max_pos: usize, rot_dim: usize, mscale: f32) -> (Vec<f32>, Vec<f32>) {
    let half = rot_dim / 2;
    let mut cos = Vec::with_capacity(max_pos * half);
    let mut sin = Vec::with_capacity(max_pos * half);
    for p in 0..max_pos {
        for i in 0..half {
            let inv = 10000f64.powf(-(2.0 * i as f64) / rot_dim as f64);
            let a = p as f64 * inv;
            cos.push((a.cos() as f32) * mscale);
            sin.push((a.sin() as f32) * mscale);
        }
    }
    (cos, sin)
}

// ---------------------------------------------------------------- tests

#[test]
fn embedding_gather_matches_twin() {
    let Some(d) = gpu("embedding_gather_matches_twin") else { return };
    let mut r = rng(1);
    for (case, &(vocab, hidden, tokens)) in
        [(1000, 8, 1), (1000, 7, 5), (517, 64, 33), (3000, 2048, 17), (129, 7168, 9), (50, 4099, 130), (10, 1, 3)]
            .iter()
            .enumerate()
    {
        let table = to_bf16(&rand_bf16_f32(&mut r, vocab * hidden, 2.0));
        let mut ids: Vec<i32> = (0..tokens).map(|_| r.random_range(0..vocab as i32)).collect();
        if tokens >= 5 {
            ids[1] = -1;
            ids[3] = vocab as i32; // out of range: NaN rows
            ids[4] = vocab as i32 - 1;
        }
        let want = twin_embedding(&table, vocab, hidden, &ids);
        let t_d = up(d, &table, "embedding table");
        let ids_d = up(d, &ids, "token ids");
        let mut out_f = poisoned_f32(d, tokens * hidden);
        d.embedding_gather_f32(&t_d, vocab, hidden, &ids_d, &mut out_f).unwrap();
        let got = down(d, &out_f);
        assert_close(&format!("embedding f32 case {case}"), &got, &want, 0.0, 0.0);
        let mut out_b = poisoned_bf16(d, tokens * hidden);
        d.embedding_gather_bf16(&t_d, vocab, hidden, &ids_d, &mut out_b).unwrap();
        let got = from_bf16(&down(d, &out_b));
        assert_close(&format!("embedding bf16 case {case}"), &got, &want, 0.0, 0.0);
    }
    // Shape errors are errors, not launches.
    let t_d = up(d, &[0u16; 12], "t");
    let ids_d = up(d, &[0i32; 2], "ids");
    let mut o = poisoned_f32(d, 5);
    let e = d.embedding_gather_f32(&t_d, 3, 4, &ids_d, &mut o).unwrap_err();
    assert!(matches!(e, GpuError::Shape { .. }), "{e}");
}

#[test]
fn rmsnorm_residual_matches_twin() {
    let Some(d) = gpu("rmsnorm_residual_matches_twin") else { return };
    let mut r = rng(2);
    let eps = 1e-6f32;
    for (case, &(rows, hidden)) in
        [(1, 1), (1, 7), (3, 64), (17, 128), (5, 1000), (64, 2048), (9, 5120), (2, 7168), (33, 4097)].iter().enumerate()
    {
        let n = rows * hidden;
        let x = rand_bf16_f32(&mut r, n, 4.0);
        let delta = rand_bf16_f32(&mut r, n, 1.0);
        let w = rand_bf16_f32(&mut r, hidden, 1.5);
        let w_d = up(d, &to_bf16(&w), "norm weight");

        // Residual add with an f32 delta; both outputs.
        let (x_want, y_want) = twin_rmsnorm(&x, Some(&delta), &w, hidden, eps);
        let mut x_d = up(d, &x, "x");
        let delta_d = up(d, &delta, "delta");
        let mut yf = poisoned_f32(d, n);
        let mut yb = poisoned_bf16(d, n);
        d.rmsnorm_residual(&mut x_d, Some(&delta_d), None, None, &w_d, Some(&mut yf), Some(&mut yb), hidden, eps)
            .unwrap();
        assert_close(&format!("rmsnorm x case {case}"), &down(d, &x_d), &x_want, 0.0, 0.0);
        let worst = assert_close(&format!("rmsnorm y case {case}"), &down(d, &yf), &y_want, 2e-6, 1e-6);
        assert_bf16_close(&format!("rmsnorm y bf16 case {case}"), &down(d, &yb), &y_want, 1e-6);

        // BF16 delta.
        let mut x_d = up(d, &x, "x");
        let delta_b = up(d, &to_bf16(&delta), "delta bf16");
        let mut yf = poisoned_f32(d, n);
        d.rmsnorm_residual(&mut x_d, None, Some(&delta_b), None, &w_d, Some(&mut yf), None, hidden, eps).unwrap();
        assert_close(&format!("rmsnorm x (bf16 delta) case {case}"), &down(d, &x_d), &x_want, 0.0, 0.0);
        assert_close(&format!("rmsnorm y (bf16 delta) case {case}"), &down(d, &yf), &y_want, 2e-6, 1e-6);

        // A device delta then a host delta (mapped memory: the hybrid's CPU expert output), and
        // the host delta alone: x = (x + delta) + host, as the twin adds them.
        let host = rand_bf16_f32(&mut r, n, 1.0);
        let hm = krasis_gpu::MappedHost::<f32>::new(d, n + 3).unwrap();
        // SAFETY: no launch touches hm until the ones below.
        unsafe { std::slice::from_raw_parts_mut(hm.host_ptr(), n).copy_from_slice(&host) };
        let x_plus: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| a + b).collect();
        for (with_device_delta, base) in [(true, &x_plus), (false, &x)] {
            let (x_want, y_want) = twin_rmsnorm(base, Some(&host), &w, hidden, eps);
            let mut x_d = up(d, &x, "x");
            let mut yf = poisoned_f32(d, n);
            let dd: Option<&dyn krasis_gpu::cudarc::driver::DevicePtr<f32>> =
                if with_device_delta { Some(&delta_d) } else { None };
            d.rmsnorm_residual(&mut x_d, dd, None, Some(&hm), &w_d, Some(&mut yf), None, hidden, eps).unwrap();
            let what = format!("case {case}, device delta {with_device_delta}");
            assert_close(&format!("rmsnorm x (host delta) {what}"), &down(d, &x_d), &x_want, 0.0, 0.0);
            assert_close(&format!("rmsnorm y (host delta) {what}"), &down(d, &yf), &y_want, 2e-6, 1e-6);
        }

        // No delta: plain RMSNorm, x untouched.
        let (_, y_plain) = twin_rmsnorm(&x, None, &w, hidden, eps);
        let mut x_d = up(d, &x, "x");
        let mut yf = poisoned_f32(d, n);
        d.rmsnorm_residual(&mut x_d, None, None, None, &w_d, Some(&mut yf), None, hidden, eps).unwrap();
        assert_close(&format!("rmsnorm plain x case {case}"), &down(d, &x_d), &x, 0.0, 0.0);
        assert_close(&format!("rmsnorm plain y case {case}"), &down(d, &yf), &y_plain, 2e-6, 1e-6);
        eprintln!("rmsnorm case {case} rows={rows} hidden={hidden}: worst err/tol {worst:.3}");
    }
}

#[test]
fn rope_matches_twin_for_both_pairings() {
    let Some(d) = gpu("rope_matches_twin_for_both_pairings") else { return };
    let mut r = rng(3);
    let max_pos = 4096;
    // (name, layout, buffer length)
    let mut cases: Vec<(&str, RopeLayout, usize)> = Vec::new();
    for pairing in [RopePairing::Halves, RopePairing::Interleaved] {
        // Qwen3-like q: [T, 32 heads, 128], all dims rotated.
        cases.push(("contiguous 32x128", RopeLayout::contiguous(19, 32, 128, pairing), 19 * 32 * 128));
        // DeepSeek q: heads of 192 = 128 nope + 64 rope at the end.
        let l = RopeLayout {
            n_tokens: 7,
            n_heads: 16,
            token_stride: 16 * 192,
            head_stride: 192,
            rot_offset: 128,
            rot_dim: 64,
            pairing,
        };
        cases.push(("mla q_pe", l, 7 * 16 * 192));
        // DeepSeek k_pe inside the [T, 576] latent row (512 latent + 64 rope).
        let l = RopeLayout {
            n_tokens: 33,
            n_heads: 1,
            token_stride: 576,
            head_stride: 576,
            rot_offset: 512,
            rot_dim: 64,
            pairing,
        };
        cases.push(("mla k_pe", l, 33 * 576));
        // Ragged: 3 heads of 10 with 6 rotated dims starting at 2, 1 token; and 130 tokens of 1x2.
        let l = RopeLayout {
            n_tokens: 5,
            n_heads: 3,
            token_stride: 31,
            head_stride: 10,
            rot_offset: 2,
            rot_dim: 6,
            pairing,
        };
        cases.push(("ragged", l, 5 * 31));
        // GLM-4.5 partial rotary: heads of 48, the first 24 dims rotated (pairs (i, i + 12)),
        // the other 24 untouched.
        let l = RopeLayout {
            n_tokens: 9,
            n_heads: 4,
            token_stride: 4 * 48,
            head_stride: 48,
            rot_offset: 0,
            rot_dim: 24,
            pairing,
        };
        cases.push(("partial 24 of 48", l, 9 * 4 * 48));
        cases.push(("tiny", RopeLayout::contiguous(130, 1, 2, pairing), 130 * 2));
    }
    for (case, (name, l, len)) in cases.iter().enumerate() {
        let (cos, sin) = rope_tables(max_pos, l.rot_dim, 1.0 + 0.1 * (case % 3) as f32);
        let mut positions: Vec<i32> = (0..l.n_tokens).map(|_| r.random_range(0..max_pos as i32)).collect();
        positions[0] = 0;
        if l.n_tokens > 2 {
            positions[l.n_tokens - 1] = max_pos as i32 - 1;
            positions[1] = max_pos as i32; // out of range: NaN in the rotated slice only
        }
        let x = rand_bf16_f32(&mut r, *len, 3.0);
        let mut want = x.clone();
        twin_rope(&mut want, &positions, &cos, &sin, max_pos, l);
        let (cos_d, sin_d, pos_d) = (up(d, &cos, "cos"), up(d, &sin, "sin"), up(d, &positions, "positions"));

        let mut x_d = up(d, &x, "x");
        d.rope_f32(&mut x_d, &pos_d, &cos_d, &sin_d, max_pos, l).unwrap();
        let what = format!("rope f32 {name} {:?}", l.pairing);
        let worst = assert_close(&what, &down(d, &x_d), &want, 1e-6, 4e-6);

        let mut xb_d = up(d, &to_bf16(&x), "x bf16");
        d.rope_bf16(&mut xb_d, &pos_d, &cos_d, &sin_d, max_pos, l).unwrap();
        assert_bf16_close(&format!("rope bf16 {name} {:?}", l.pairing), &down(d, &xb_d), &want, 4e-6);
        eprintln!("{what}: worst err/tol {worst:.3}");
    }
    // A layout that runs past the buffer is refused.
    let mut x_d = up(d, &[0.0f32; 100], "x");
    let (cos, sin) = rope_tables(8, 4, 1.0);
    let (cos_d, sin_d, pos_d) = (up(d, &cos, "cos"), up(d, &sin, "sin"), up(d, &[0i32; 3], "pos"));
    let bad = RopeLayout::contiguous(3, 10, 4, RopePairing::Halves);
    let e = d.rope_f32(&mut x_d, &pos_d, &cos_d, &sin_d, 8, &bad).unwrap_err();
    assert!(matches!(e, GpuError::Shape { .. }), "{e}");
}

/// The fused MLA preparation equals the three launches it replaces (q RoPE, kv RoPE, kv latent
/// RMSNorm), bit for bit: both run the same f32 operations per element (the twins of those three
/// are checked above and in `elementwise_ops`). Ragged shapes, both pairings, an out-of-range
/// position (NaN in the rope slices only).
#[test]
fn mla_rope_norm_equals_the_three_launches() {
    let Some(d) = gpu("mla_rope_norm_equals_the_three_launches") else { return };
    let mut r = rng(31);
    let max_pos = 300;
    // (tokens, heads, nope, rope, latent)
    for &(t, hh, nope, rd, lat) in
        &[(1usize, 16usize, 128usize, 64usize, 512usize), (3, 5, 7, 6, 9), (17, 2, 3, 2, 1), (2, 1, 0, 4, 33)]
    {
        for pairing in [RopePairing::Halves, RopePairing::Interleaved] {
            let (qk, row) = (nope + rd, lat + rd);
            let (cos, sin) = rope_tables(max_pos, rd, 1.1);
            let mut positions: Vec<i32> = (0..t).map(|_| r.random_range(0..max_pos as i32)).collect();
            if t > 2 {
                positions[1] = max_pos as i32;
            }
            let q = rand_bf16_f32(&mut r, t * hh * qk, 3.0);
            let kv = rand_bf16_f32(&mut r, t * row, 3.0);
            let w = to_bf16(&rand_bf16_f32(&mut r, lat, 1.5));
            let (cos_d, sin_d, pos_d, w_d) =
                (up(d, &cos, "cos"), up(d, &sin, "sin"), up(d, &positions, "pos"), up(d, &w, "w"));
            let ql = RopeLayout {
                n_tokens: t,
                n_heads: hh,
                token_stride: hh * qk,
                head_stride: qk,
                rot_offset: nope,
                rot_dim: rd,
                pairing,
            };
            let kl = RopeLayout {
                n_tokens: t,
                n_heads: 1,
                token_stride: row,
                head_stride: row,
                rot_offset: lat,
                rot_dim: rd,
                pairing,
            };
            let (mut q1, mut kv1) = (up(d, &q, "q"), up(d, &kv, "kv"));
            d.rope_f32(&mut q1, &pos_d, &cos_d, &sin_d, max_pos, &ql).unwrap();
            d.rope_f32(&mut kv1, &pos_d, &cos_d, &sin_d, max_pos, &kl).unwrap();
            d.rmsnorm_rows_inplace(&mut kv1, RowsView { rows: t, cols: lat, stride: row, offset: 0 }, &w_d, 1e-6)
                .unwrap();
            let what = format!("t{t} h{hh} nope{nope} rope{rd} lat{lat} {pairing:?}");
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            // Without a cache, then writing the rows into a BF16 cache (at layer 1, position 5)
            // as the separate KV write would; an FP8 cache is left to that write.
            let (bf16_cache, fp8_cache) = (
                GpuKvCache::new(d, KvDtype::Bf16, 2, 1, row, row, KvCapacity::Tokens(t + 8)).unwrap(),
                GpuKvCache::new(d, KvDtype::Fp8, 2, 1, row, row, KvCapacity::Tokens(t + 8)).unwrap(),
            );
            for (cache, writes) in [(None, false), (Some(&bf16_cache), true), (Some(&fp8_cache), false)] {
                let (mut q2, mut kv2) = (up(d, &q, "q"), up(d, &kv, "kv"));
                let wrote = d
                    .mla_rope_norm(
                        &mut q2,
                        &ql,
                        &mut kv2,
                        &kl,
                        &w_d,
                        1e-6,
                        &pos_d,
                        &cos_d,
                        &sin_d,
                        max_pos,
                        cache.map(|c| (c, 1, 5)),
                    )
                    .unwrap();
                assert_eq!(wrote, writes, "{what}");
                assert_eq!(bits(down(d, &q2)), bits(down(d, &q1)), "q, {what}");
                assert_eq!(bits(down(d, &kv2)), bits(down(d, &kv1)), "kv row, {what}");
                if writes {
                    let twin = GpuKvCache::new(d, KvDtype::Bf16, 2, 1, row, row, KvCapacity::Tokens(t + 8)).unwrap();
                    twin.write(d, 1, 0, 5, t, &kv1).unwrap();
                    let (mut a, mut b) = (poisoned_f32(d, t * row), poisoned_f32(d, t * row));
                    bf16_cache.read_f32(d, 1, 0, 5, t, &mut a).unwrap();
                    twin.read_f32(d, 1, 0, 5, t, &mut b).unwrap();
                    assert_eq!(bits(down(d, &a)), bits(down(d, &b)), "cache rows, {what}");
                }
            }
        }
    }
    // A norm that reaches into the rope slice is refused.
    let (cos, sin) = rope_tables(8, 2, 1.0);
    let (cos_d, sin_d, pos_d) = (up(d, &cos, "cos"), up(d, &sin, "sin"), up(d, &[0i32; 1], "pos"));
    let (mut q, mut kv, w) = (up(d, &[0f32; 4], "q"), up(d, &[0f32; 4], "kv"), up(d, &[0u16; 3], "w"));
    let l = RopeLayout::contiguous(1, 1, 2, RopePairing::Halves);
    let kl = RopeLayout {
        n_tokens: 1,
        n_heads: 1,
        token_stride: 4,
        head_stride: 4,
        rot_offset: 2,
        rot_dim: 2,
        pairing: RopePairing::Halves,
    };
    let e = d.mla_rope_norm(&mut q, &l, &mut kv, &kl, &w, 1e-6, &pos_d, &cos_d, &sin_d, 8, None).unwrap_err();
    assert!(matches!(e, GpuError::Shape { .. }), "{e}");
}

/// The fused GQA preparation equals the launches it replaces (three bias additions, q and k
/// RoPE, the K and V cache writes), bit for bit: the same f32 operations per element. Ragged
/// shapes, partial rotary, both pairings, with and without biases, an out-of-range position (NaN
/// in the rotated slices), a BF16 cache (written by the launch) and an FP8 one (left to the
/// separate write).
#[test]
fn gqa_prep_equals_the_separate_launches() {
    let Some(d) = gpu("gqa_prep_equals_the_separate_launches") else { return };
    let mut r = rng(37);
    let max_pos = 300;
    // (tokens, q heads, kv heads, head_dim, rot_dim)
    for &(t, hh, kvh, hd, rd) in
        &[(1usize, 96usize, 8usize, 128usize, 64usize), (3, 5, 1, 6, 6), (17, 4, 2, 10, 4), (2, 3, 3, 64, 64)]
    {
        for pairing in [RopePairing::Halves, RopePairing::Interleaved] {
            for biased in [false, true] {
                let (q_row, kv_row) = (hh * hd, kvh * hd);
                let (cos, sin) = rope_tables(max_pos, rd, 1.1);
                let mut positions: Vec<i32> = (0..t).map(|_| r.random_range(0..max_pos as i32)).collect();
                if t > 2 {
                    positions[1] = max_pos as i32;
                }
                let (q, k, v) = (
                    rand_bf16_f32(&mut r, t * q_row, 3.0),
                    rand_bf16_f32(&mut r, t * kv_row, 3.0),
                    rand_bf16_f32(&mut r, t * kv_row, 3.0),
                );
                let bias: Vec<Vec<u16>> =
                    [q_row, kv_row, kv_row].iter().map(|&n| to_bf16(&rand_bf16_f32(&mut r, n, 1.5))).collect();
                let bias_d = [up(d, &bias[0], "qb"), up(d, &bias[1], "kb"), up(d, &bias[2], "vb")];
                let (cos_d, sin_d, pos_d) = (up(d, &cos, "cos"), up(d, &sin, "sin"), up(d, &positions, "pos"));
                let layout = |heads: usize| RopeLayout {
                    n_tokens: t,
                    n_heads: heads,
                    token_stride: heads * hd,
                    head_stride: hd,
                    rot_offset: 0,
                    rot_dim: rd,
                    pairing,
                };
                let (mut q1, mut k1, mut v1) = (up(d, &q, "q"), up(d, &k, "k"), up(d, &v, "v"));
                if biased {
                    d.add_bias_rows_f32(&mut q1, t, &bias_d[0]).unwrap();
                    d.add_bias_rows_f32(&mut k1, t, &bias_d[1]).unwrap();
                    d.add_bias_rows_f32(&mut v1, t, &bias_d[2]).unwrap();
                }
                d.rope_f32(&mut q1, &pos_d, &cos_d, &sin_d, max_pos, &layout(hh)).unwrap();
                d.rope_f32(&mut k1, &pos_d, &cos_d, &sin_d, max_pos, &layout(kvh)).unwrap();
                let what = format!("t{t} h{hh} kv{kvh} hd{hd} rot{rd} {pairing:?} bias {biased}");
                let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
                let shape = GqaShape { n_tokens: t, q_heads: hh, kv_heads: kvh, head_dim: hd, rot_dim: rd, pairing };
                let cache = |dtype| GpuKvCache::new(d, dtype, 2, 2, kv_row, kv_row, KvCapacity::Tokens(t + 8)).unwrap();
                let (bf16_cache, fp8_cache) = (cache(KvDtype::Bf16), cache(KvDtype::Fp8));
                for (c, writes) in [(None, false), (Some(&bf16_cache), true), (Some(&fp8_cache), false)] {
                    let (mut q2, mut k2, mut v2) = (up(d, &q, "q"), up(d, &k, "k"), up(d, &v, "v"));
                    let b = biased.then_some(&bias_d);
                    let wrote = d
                        .gqa_prep(
                            &mut q2,
                            &mut k2,
                            &mut v2,
                            shape,
                            b,
                            &pos_d,
                            &cos_d,
                            &sin_d,
                            max_pos,
                            c.map(|c| (c, 1, 5)),
                        )
                        .unwrap();
                    assert_eq!(wrote, writes, "{what}");
                    assert_eq!(bits(down(d, &q2)), bits(down(d, &q1)), "q, {what}");
                    assert_eq!(bits(down(d, &k2)), bits(down(d, &k1)), "k, {what}");
                    assert_eq!(bits(down(d, &v2)), bits(down(d, &v1)), "v, {what}");
                    if writes {
                        let twin = cache(KvDtype::Bf16);
                        twin.write(d, 1, 0, 5, t, &k1).unwrap();
                        twin.write(d, 1, 1, 5, t, &v1).unwrap();
                        for plane in 0..2 {
                            let (mut a, mut b) = (poisoned_f32(d, t * kv_row), poisoned_f32(d, t * kv_row));
                            bf16_cache.read_f32(d, 1, plane, 5, t, &mut a).unwrap();
                            twin.read_f32(d, 1, plane, 5, t, &mut b).unwrap();
                            assert_eq!(bits(down(d, &a)), bits(down(d, &b)), "cache plane {plane}, {what}");
                        }
                    }
                }
            }
        }
    }
    // Biases of the wrong length are refused, naming them.
    let (cos, sin) = rope_tables(8, 4, 1.0);
    let (cos_d, sin_d, pos_d) = (up(d, &cos, "cos"), up(d, &sin, "sin"), up(d, &[0i32; 1], "pos"));
    let (mut q, mut k, mut v) = (up(d, &[0f32; 8], "q"), up(d, &[0f32; 4], "k"), up(d, &[0f32; 4], "v"));
    let short = [up(d, &[0u16; 8], "qb"), up(d, &[0u16; 3], "kb"), up(d, &[0u16; 4], "vb")];
    let shape =
        GqaShape { n_tokens: 1, q_heads: 2, kv_heads: 1, head_dim: 4, rot_dim: 4, pairing: RopePairing::Halves };
    let e = d.gqa_prep(&mut q, &mut k, &mut v, shape, Some(&short), &pos_d, &cos_d, &sin_d, 8, None).unwrap_err();
    assert!(matches!(e, GpuError::Shape { .. }) && e.to_string().contains("biases"), "{e}");
}

#[test]
fn silu_mul_matches_twin() {
    let Some(d) = gpu("silu_mul_matches_twin") else { return };
    let mut r = rng(4);
    for (case, &(rows, cols)) in [(1, 1), (3, 7), (17, 1408), (64, 333), (5, 10944), (130, 64)].iter().enumerate() {
        // Separate f32 gate/up -> f32 and -> bf16.
        let l = SwiGluLayout::separate(rows, cols);
        let g = rand_bf16_f32(&mut r, rows * cols, 8.0);
        let u = rand_bf16_f32(&mut r, rows * cols, 2.0);
        let want = twin_silu_mul(&g, &u, 0, &l);
        let (g_d, u_d) = (up(d, &g, "gate"), up(d, &u, "up"));
        let mut o = poisoned_f32(d, rows * cols);
        d.silu_mul_f32(&g_d, &u_d, 0, &mut o, &l).unwrap();
        let worst = assert_close(&format!("silu f32 case {case}"), &down(d, &o), &want, 2e-6, 1e-7);
        let mut ob = poisoned_bf16(d, rows * cols);
        d.silu_mul_f32_to_bf16(&g_d, &u_d, 0, &mut ob, &l).unwrap();
        assert_bf16_close(&format!("silu f32->bf16 case {case}"), &down(d, &ob), &want, 1e-7);

        // Fused BF16 gate_up [rows, 2*cols] -> BF16.
        let l = SwiGluLayout::fused(rows, cols);
        let gu = rand_bf16_f32(&mut r, rows * 2 * cols, 8.0);
        let want = twin_silu_mul(&gu, &gu, cols, &l);
        let gu_d = up(d, &to_bf16(&gu), "gate_up");
        let mut ob = poisoned_bf16(d, rows * cols);
        d.silu_mul_bf16(&gu_d, &gu_d, cols, &mut ob, &l).unwrap();
        assert_bf16_close(&format!("silu fused bf16 case {case}"), &down(d, &ob), &want, 1e-7);
        eprintln!("silu case {case} rows={rows} cols={cols}: worst err/tol {worst:.3}");
    }
}

#[test]
fn vram_budget_refuses_instead_of_oom() {
    let Some(d) = gpu("vram_budget_refuses_instead_of_oom") else { return };
    let info = d.info();
    let free = info.free_bytes.unwrap();
    // auto = free at open minus the named margin.
    assert_eq!(d.budget().budget(), free.saturating_sub(AUTO_VRAM_SAFETY_MARGIN));

    // A small explicit budget on a second handle to the same GPU.
    let small = GpuDevice::open(info.ordinal, VramBudgetSpec::Bytes(1 << 20)).unwrap();
    let a = small.alloc_zeros::<f32>(200_000, "activations").unwrap(); // 800 KB
    let e = small.alloc_zeros::<f32>(100_000, "the KV cache").unwrap_err(); // +400 KB > 1 MiB
    let msg = e.to_string();
    assert!(matches!(e, GpuError::VramBudget { requested: 400_000, .. }), "{e:?}");
    assert!(msg.contains("the KV cache") && !msg.contains('\n'), "{msg}");
    eprintln!("budget refusal: {msg}");
    drop(a);
    let b = small.alloc_zeros::<f32>(100_000, "the KV cache").unwrap();
    assert_eq!(small.budget().used(), b.charged_bytes());

    // Asking for more than the whole card: refused at open, in one line.
    let e = GpuDevice::open(info.ordinal, VramBudgetSpec::Bytes(info.total_bytes * 2)).unwrap_err();
    assert!(matches!(e, GpuError::BudgetAboveFree { .. }), "{e:?}");
    eprintln!("budget above free: {e}");
    // A huge allocation under auto: a budget error, not a CUDA OOM.
    let e = d.alloc_zeros::<u8>(info.total_bytes as usize + (1 << 30), "a too-large tensor").unwrap_err();
    assert!(matches!(e, GpuError::VramBudget { .. }), "{e:?}");
}

#[test]
fn events_time_a_kernel_and_kernels_are_cached() {
    let Some(d) = gpu("events_time_a_kernel_and_kernels_are_cached") else { return };
    d.warm_up_kernels().unwrap();
    let (start, end) = (d.new_event(true).unwrap(), d.new_event(true).unwrap());
    let (rows, cols) = (4096, 4096);
    let mut r = rng(5);
    let g = up(d, &rand_bf16_f32(&mut r, rows * cols, 4.0), "gate");
    let mut o = d.alloc_zeros::<f32>(rows * cols, "out").unwrap();
    start.record(d.stream()).unwrap();
    d.silu_mul_f32(&g, &g, 0, &mut o, &SwiGluLayout::separate(rows, cols)).unwrap();
    end.record(d.stream()).unwrap();
    end.synchronize().unwrap();
    let ms = start.elapsed_ms(&end).unwrap();
    let gbs = (3 * rows * cols * 4) as f64 / (ms as f64 * 1e-3) / 1e9;
    eprintln!("silu_mul_f32 {rows}x{cols} (cold-ish, one launch): {ms:.3} ms, {gbs:.0} GB/s");
    assert!(ms > 0.0);
    // A second device handle finds every kernel in the disk cache.
    let again = GpuDevice::open(d.info().ordinal, VramBudgetSpec::Auto).unwrap();
    again.warm_up_kernels().unwrap();
    let s = again.kernel_cache_stats();
    eprintln!("kernel cache on reopen: {s:?}");
    if d.compiler().cache_dir().is_some() {
        assert_eq!((s.hits, s.misses), (krasis_gpu::kernels::ALL.len() as u64, 0));
    }
}

// ---------------------------------------------------------------- glue ops (elementwise.rs)

#[test]
fn glue_ops_match_twins() {
    let Some(d) = gpu("glue_ops_match_twins") else { return };
    let mut r = rng(41);
    // iota
    let mut pos = up(d, &[-1i32; 37], "positions");
    d.iota_i32(&mut pos, 1000, 33).unwrap();
    let got = down(d, &pos);
    assert!(got[..33].iter().enumerate().all(|(i, &p)| p == 1000 + i as i32), "{got:?}");
    assert!(got[33..].iter().all(|&p| p == -1), "iota wrote past n: {got:?}");
    // remap_ids: a permutation of 0..m applied to ragged id lists with out-of-range ids kept
    for (m, n) in [(1usize, 1usize), (6, 7), (64, 4097), (160, 300)] {
        let mut perm: Vec<i32> = (0..m as i32).collect();
        for i in (1..m).rev() {
            perm.swap(i, r.random_range(0..=i));
        }
        let ids: Vec<i32> = (0..n + 5).map(|_| r.random_range(-2..m as i32 + 2)).collect();
        let mut want = ids.clone();
        for id in &mut want[..n] {
            if (0..m as i32).contains(id) {
                *id = perm[*id as usize];
            }
        }
        let mut dids = up(d, &ids, "ids");
        d.remap_ids_i32(&mut dids, &up(d, &perm, "map"), n).unwrap();
        assert_eq!(down(d, &dids), want, "remap_ids m={m} n={n}");
    }
    // add_inplace on a ragged length
    for n in [1usize, 255, 1023, 70_001] {
        let a = rand_bf16_f32(&mut r, n, 3.0);
        let b = rand_bf16_f32(&mut r, n, 3.0);
        let mut ya = up(d, &a, "y");
        d.add_inplace_f32(&mut ya, &up(d, &b, "x"), n).unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        assert_close("add_inplace", &down(d, &ya), &want, 0.0, 0.0);
    }
    // a projection's bias added to every row (rows x cols of a larger buffer; the rest untouched)
    for (rows, cols) in [(1usize, 1usize), (1, 192), (7, 96), (300, 1024), (33, 4097)] {
        let y = rand_bf16_f32(&mut r, rows * cols + 5, 3.0);
        let bias = rand_bf16_f32(&mut r, cols, 1.0);
        let mut want = y.clone();
        for i in 0..rows {
            for j in 0..cols {
                want[i * cols + j] = y[i * cols + j] + bias[j];
            }
        }
        let mut yd = up(d, &y, "y");
        d.add_bias_rows_f32(&mut yd, rows, &up(d, &to_bf16(&bias), "bias")).unwrap();
        assert_close(&format!("add_bias_rows {rows}x{cols}"), &down(d, &yd), &want, 0.0, 0.0);
    }
    let e = d.add_bias_rows_f32(&mut up(d, &[0f32; 10], "y"), 3, &up(d, &[0u16; 4], "bias")).unwrap_err();
    assert!(e.to_string().contains("3 rows of 4"), "{e}");
    // strided row copies, f32 and to bf16
    for (rows, cols, stride, offset) in
        [(1usize, 1usize, 1usize, 0usize), (7, 13, 29, 5), (300, 576, 576, 0), (5, 64, 576, 512)]
    {
        let src = rand_bf16_f32(&mut r, offset + (rows - 1) * stride + cols + 3, 2.0);
        let from = RowsView { rows, cols, stride, offset };
        let to = RowsView { rows, cols, stride: cols + 2, offset: 1 };
        let n_dst = 1 + rows * (cols + 2);
        let mut want = vec![f32::NAN; n_dst];
        for i in 0..rows {
            for j in 0..cols {
                want[1 + i * (cols + 2) + j] = src[offset + i * stride + j];
            }
        }
        let s = up(d, &src, "src");
        let mut df = poisoned_f32(d, n_dst);
        d.copy_rows_f32(&s, from, &mut df, to).unwrap();
        assert_close("copy_rows_f32", &down(d, &df), &want, 0.0, 0.0);
        let mut db = poisoned_bf16(d, n_dst);
        d.copy_rows_to_bf16(&s, from, &mut db, to).unwrap();
        assert_bf16_close("copy_rows_to_bf16", &down(d, &db), &want, 0.0);
    }
    // a view past the end is a shape error, not a launch
    let s = up(d, &[0f32; 10], "src");
    let mut df = poisoned_f32(d, 10);
    let e =
        d.copy_rows_f32(&s, RowsView { rows: 2, cols: 6, stride: 6, offset: 0 }, &mut df, RowsView::contiguous(2, 6));
    assert!(matches!(e, Err(GpuError::Shape { .. })), "{e:?}");
    // in-place RMSNorm over a prefix of strided rows
    for (rows, cols, stride) in [(1usize, 1usize, 1usize), (3, 48, 56), (17, 512, 576), (64, 24, 24)] {
        let mut x = rand_bf16_f32(&mut r, rows * stride, 4.0);
        let w = rand_bf16_f32(&mut r, cols, 1.5);
        let mut xb = up(d, &x, "x");
        d.rmsnorm_rows_inplace(&mut xb, RowsView { rows, cols, stride, offset: 0 }, &up(d, &to_bf16(&w), "w"), 1e-6)
            .unwrap();
        for i in 0..rows {
            let row = &mut x[i * stride..i * stride + cols];
            let ss: f64 = row.iter().map(|&v| (v as f64).powi(2)).sum();
            let inv = (1.0 / (ss / cols as f64 + 1e-6).sqrt()) as f32;
            for (v, &wv) in row.iter_mut().zip(&w) {
                *v = *v * inv * wv;
            }
        }
        assert_close("rmsnorm_rows_inplace", &down(d, &xb), &x, 2e-6, 1e-6);
    }
}
