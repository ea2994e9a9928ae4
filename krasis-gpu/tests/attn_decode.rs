//! Decode attention (MLA absorbed and GQA, BF16 and FP8 caches) and the MLA absorption kernels
//! against f64 CPU twins, on V2-Lite / Qwen3 shapes and ragged ones, with forced split counts
//! (1 and many) that must agree. Inputs are pre-rounded to BF16; outputs are poisoned with NaN.
//!
//! Without a GPU every test prints "SKIPPED: no GPU" and passes; with `KRASIS_REQUIRE_GPU=1` a
//! missing GPU fails instead.

#![allow(clippy::too_many_arguments, clippy::needless_range_loop)]

mod common;

use std::io::Write;

use common::{assert_close, down, gpu, poisoned_f32, rand_bf16_f32, rng, to_bf16, twin_kv_row, up};
use krasis_gpu::{
    bench_mla_decode, bench_mla_decode_kernel, AttnOptions, DecodeWorkspace, DeviceBuffer, GpuDevice, GpuError,
    GpuKvCache, KvCapacity, KvDtype,
};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// f64 causal attention: q [t, heads, kd]; keys of kv head g at k[p*k_stride + g*kd ..]; values at
/// v[p*v_stride + g*vd ..].
fn twin_attention(
    q: &[f32],
    t: usize,
    heads: usize,
    kv_heads: usize,
    kd: usize,
    vd: usize,
    k: &[f32],
    k_stride: usize,
    v: &[f32],
    v_stride: usize,
    q_start: usize,
    scale: f32,
) -> Vec<f32> {
    twin_attention_opts(q, t, heads, kv_heads, kd, vd, k, k_stride, v, v_stride, q_start, scale, None, None)
}

/// [`twin_attention`] with a sliding window (query `i` sees rows `q_start + i − w < p ≤
/// q_start + i`) and per-head sink logits (one more softmax column whose probability is dropped).
fn twin_attention_opts(
    q: &[f32],
    t: usize,
    heads: usize,
    kv_heads: usize,
    kd: usize,
    vd: usize,
    k: &[f32],
    k_stride: usize,
    v: &[f32],
    v_stride: usize,
    q_start: usize,
    scale: f32,
    window: Option<usize>,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    let group = heads / kv_heads;
    let mut out = vec![0f32; t * heads * vd];
    for i in 0..t {
        let first = window.map_or(0, |w| (q_start + i + 1).saturating_sub(w));
        for h in 0..heads {
            let g = h / group;
            let qv = &q[(i * heads + h) * kd..][..kd];
            let s: Vec<f64> = (first..=q_start + i)
                .map(|p| {
                    let kr = &k[p * k_stride + g * kd..][..kd];
                    qv.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale as f64
                })
                .collect();
            let sink = sinks.map_or(f64::NEG_INFINITY, |s| s[h] as f64);
            let m = s.iter().cloned().fold(sink, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum::<f64>() + (sink - m).exp();
            for dd in 0..vd {
                let acc: f64 =
                    e.iter().enumerate().map(|(j, w)| w * v[(first + j) * v_stride + g * vd + dd] as f64).sum();
                out[(i * heads + h) * vd + dd] = (acc / z) as f32;
            }
        }
    }
    out
}

/// Output tolerance: f32 scores/sums over up to 5000 rows against the f64 twin.
const RTOL: f32 = 2e-4;
const ATOL: f32 = 2e-5;
/// One split vs many: the kernel's MMAs take f32 operands as BF16 hi + lo (2^-17 relative each)
/// and accumulate in f32 in an order that depends on the split, so two split counts differ by up
/// to ~2^-17 of Σ p|v| / l <= max|v| = 1 (the test's values): 1e-5 absolute (the twin check above
/// allows 2e-5).
const SPLIT_RTOL: f32 = 1e-5;
const SPLIT_ATOL: f32 = 1e-5;

/// Fills `rows` positions of (layer, plane) with random rows; returns what the cache stores.
fn fill(d: &GpuDevice, c: &GpuKvCache, layer: usize, plane: usize, rows: usize, r: &mut ChaCha8Rng) -> Vec<f32> {
    fill_src(d, c, layer, plane, rows, r).1
}

/// [`fill`], also returning the f32 rows written.
fn fill_src(
    d: &GpuDevice,
    c: &GpuKvCache,
    layer: usize,
    plane: usize,
    rows: usize,
    r: &mut ChaCha8Rng,
) -> (Vec<f32>, Vec<f32>) {
    let lay = c.layout();
    let src: Vec<f32> = (0..rows * lay.row).map(|_| r.random_range(-1.0f32..1.0)).collect();
    // Write in uneven chunks, as prefill then decode steps would.
    let mut pos = 0;
    while pos < rows {
        let n = (rows - pos).min(1 + pos % 700);
        c.write(d, layer, plane, pos, n, &up(d, &src[pos * lay.row..(pos + n) * lay.row], "test input")).unwrap();
        pos += n;
    }
    let st = src.chunks(lay.row).flat_map(|row| twin_kv_row(lay.dtype, row, lay.scale_group)).collect();
    (src, st)
}

const CONTEXTS: [usize; 4] = [1, 7, 300, 5000];

/// Every (context length S, queries t) with t ∈ {1, 3} and t <= S, for S in [`CONTEXTS`].
fn context_steps() -> impl Iterator<Item = (usize, usize)> {
    CONTEXTS.into_iter().flat_map(|s| [1usize, 3].into_iter().filter(move |&t| t <= s).map(move |t| (s, t)))
}

/// Runs `launch` into a NaN-poisoned output of `out_len` with the automatic split count, then 1,
/// then `many` forced: each result against the twin's `want` (RTOL/ATOL), and the 1 and `many`
/// results against each other (SPLIT_RTOL/SPLIT_ATOL). Returns the split count of the last run.
fn check_split_counts(
    d: &GpuDevice,
    ws: &mut DecodeWorkspace,
    many: usize,
    out_len: usize,
    want: &[f32],
    what: &str,
    mut launch: impl FnMut(&mut DeviceBuffer<f32>, &mut DecodeWorkspace) -> Result<(), GpuError>,
) -> usize {
    let mut results = Vec::new();
    for force in [None, Some(1), Some(many)] {
        ws.force_splits(force);
        let mut out = poisoned_f32(d, out_len);
        launch(&mut out, ws).unwrap();
        let got = down(d, &out);
        assert_close(&format!("{what} splits {force:?}->{}", ws.last_splits()), &got, want, RTOL, ATOL);
        results.push(got);
    }
    assert_close("splits 1 vs many", &results[2], &results[1], SPLIT_RTOL, SPLIT_ATOL);
    ws.last_splits()
}

#[test]
fn mla_decode_matches_twin() {
    let Some(d) = gpu("mla_decode_matches_twin") else { return };
    let mut r = rng(21);
    // (heads, latent, rope, scale group)
    for &(heads, latent, rope, group) in
        &[(16, 512, 64, 64), (4, 32, 8, 8), (3, 48, 16, 16), (5, 40, 8, 24), (2, 21, 3, 24)]
    {
        let row = latent + rope;
        for dtype in [KvDtype::Bf16, KvDtype::Fp8] {
            let group = if row % group == 0 { group } else { row };
            let layers = 2;
            let cap = *CONTEXTS.last().unwrap();
            let c = GpuKvCache::new(d, dtype, layers, 1, row, group, KvCapacity::Tokens(cap)).unwrap();
            let kv = fill(d, &c, 1, 0, cap, &mut r);
            let mut ws = DecodeWorkspace::new();
            for (s, t) in context_steps() {
                let q_start = s - t;
                let q = rand_bf16_f32(&mut r, t * heads * row, 2.0);
                let scale = 1.0 / ((128 + rope) as f32).sqrt();
                let want = twin_attention(&q, t, heads, 1, row, latent, &kv, row, &kv, row, q_start, scale);
                let q_d = up(d, &q, "q");
                let what = format!("MLA {dtype} h{heads} lat{latent} rope{rope} S{s} t{t}");
                let splits = check_split_counts(d, &mut ws, 37, t * heads * latent, &want, &what, |out, ws| {
                    d.mla_decode_attention(&c, 1, &q_d, t, heads, latent, q_start, scale, out, ws)
                });
                if s >= 300 {
                    assert!(splits > 1, "forced 37 splits used {splits}");
                }
            }
        }
    }
}

/// The one-token MLA kernel (`krasis_gpu::mla_decode`: BF16 cache, the instantiated row shapes,
/// taken by itself for t = 1) against the twin at ragged contexts and head counts (with the
/// automatic, 1 and many splits), and against the general tensor-core kernel on the same inputs.
#[test]
fn mla_one_token_kernel_matches_twin_and_general_kernel() {
    let Some(d) = gpu("mla_one_token_kernel_matches_twin_and_general_kernel") else { return };
    let mut r = rng(23);
    // (heads, latent, rope): V2-Lite, the oracle fixtures, heads not a multiple of 16 or of 2.
    for &(heads, latent, rope) in &[(16, 512, 64), (4, 64, 16), (17, 512, 64), (3, 64, 16), (1, 512, 64)] {
        let row = latent + rope;
        let cap = 2100;
        let c = GpuKvCache::new(d, KvDtype::Bf16, 2, 1, row, row, KvCapacity::Tokens(cap)).unwrap();
        let kv = fill(d, &c, 1, 0, cap, &mut r);
        let mut ws = DecodeWorkspace::new();
        for s in [1usize, 2, 3, 4, 5, 15, 16, 17, 63, 64, 65, 300, 513, 2047] {
            let q_start = s - 1;
            let q = rand_bf16_f32(&mut r, heads * row, 2.0);
            let scale = 1.0 / ((128 + rope) as f32).sqrt();
            let want = twin_attention(&q, 1, heads, 1, row, latent, &kv, row, &kv, row, q_start, scale);
            let q_d = up(d, &q, "q");
            let what = format!("MLA one-token h{heads} lat{latent} rope{rope} S{s}");
            ws.force_general(false);
            check_split_counts(d, &mut ws, 9, heads * latent, &want, &what, |out, ws| {
                d.mla_decode_attention(&c, 1, &q_d, 1, heads, latent, q_start, scale, out, ws)
            });
            ws.force_splits(None);
            let mut fast = poisoned_f32(d, heads * latent);
            d.mla_decode_attention(&c, 1, &q_d, 1, heads, latent, q_start, scale, &mut fast, &mut ws).unwrap();
            ws.force_general(true);
            let mut general = poisoned_f32(d, heads * latent);
            d.mla_decode_attention(&c, 1, &q_d, 1, heads, latent, q_start, scale, &mut general, &mut ws).unwrap();
            assert_close(
                &format!("{what}: one-token vs general"),
                &down(d, &fast),
                &down(d, &general),
                SPLIT_RTOL,
                SPLIT_ATOL,
            );
        }
    }
}

#[test]
fn gqa_decode_matches_twin() {
    let Some(d) = gpu("gqa_decode_matches_twin") else { return };
    let mut r = rng(22);
    // (heads, kv_heads, head_dim)
    for &(heads, kv_heads, hd) in &[(32, 4, 128), (4, 2, 24), (6, 3, 16), (5, 5, 8), (8, 1, 64), (12, 2, 36), (3, 1, 7)]
    {
        let row = kv_heads * hd;
        for dtype in [KvDtype::Bf16, KvDtype::Fp8] {
            let cap = *CONTEXTS.last().unwrap();
            let c = GpuKvCache::new(d, dtype, 1, 2, row, hd, KvCapacity::Tokens(cap)).unwrap();
            let k = fill(d, &c, 0, 0, cap, &mut r);
            let v = fill(d, &c, 0, 1, cap, &mut r);
            let mut ws = DecodeWorkspace::new();
            for (s, t) in context_steps() {
                let q_start = s - t;
                let q = rand_bf16_f32(&mut r, t * heads * hd, 3.0);
                let scale = 1.0 / (hd as f32).sqrt();
                let want = twin_attention(&q, t, heads, kv_heads, hd, hd, &k, row, &v, row, q_start, scale);
                let q_d = up(d, &q, "q");
                let what = format!("GQA {dtype} h{heads}/{kv_heads} hd{hd} S{s} t{t}");
                check_split_counts(d, &mut ws, 50, t * heads * hd, &want, &what, |out, ws| {
                    d.gqa_decode_attention(&c, 0, &q_d, t, heads, kv_heads, hd, q_start, scale, out, ws)
                });
            }
        }
    }
}

/// The twin's options on known answers (runs without a GPU): a window of 1 gives each query its
/// own row's value; a sink equal to the only score halves the output.
#[test]
fn twin_options_have_known_answers() {
    let (k, v) = ([1.0f32, 0.0, 1.0, 0.0], [3.0f32, 5.0]);
    let q = [2.0f32, 4.0];
    let own = twin_attention_opts(&q, 2, 1, 1, 1, 1, &k[..2], 1, &v, 1, 0, 1.0, Some(1), None);
    assert_eq!(own, vec![3.0, 5.0]);
    let half = twin_attention_opts(&q[..1], 1, 1, 1, 1, 1, &k[..1], 1, &v[..1], 1, 0, 1.0, None, Some(&[2.0]));
    assert!((half[0] - 1.5).abs() < 1e-6, "{half:?}");
}

/// gpt-oss's options of the GQA decode kernel against the twin: sliding windows shorter and
/// longer than the context (1 row, a part of a split, a whole tile, many tiles, all of it), with
/// and without sink logits (one far above every score), BF16 and FP8 caches, ragged head shapes,
/// automatic / 1 / many splits.
#[test]
fn gqa_decode_windows_and_sinks_match_twin() {
    let Some(d) = gpu("gqa_decode_windows_and_sinks_match_twin") else { return };
    let mut r = rng(25);
    // (heads, kv_heads, head_dim): gpt-oss's 64 / 8 of 64, ragged ones.
    for &(heads, kv_heads, hd) in &[(64, 8, 64), (4, 2, 24), (6, 3, 16), (3, 1, 7), (8, 1, 64)] {
        let row = kv_heads * hd;
        for dtype in [KvDtype::Bf16, KvDtype::Fp8] {
            let cap = *CONTEXTS.last().unwrap();
            let c = GpuKvCache::new(d, dtype, 1, 2, row, hd, KvCapacity::Tokens(cap)).unwrap();
            let k = fill(d, &c, 0, 0, cap, &mut r);
            let v = fill(d, &c, 0, 1, cap, &mut r);
            let mut ws = DecodeWorkspace::new();
            let mut sinks = rand_bf16_f32(&mut r, heads, 3.0);
            sinks[heads - 1] = 40.0; // far above every score: the output nearly vanishes
            let sinks_d = up(d, &to_bf16(&sinks), "sinks");
            for (s, t) in context_steps() {
                for window in [Some(1usize), Some(5), Some(32), Some(100), Some(4096), Some(10_000), None] {
                    for with_sinks in [false, true] {
                        if window.is_none() && !with_sinks {
                            continue; // gqa_decode_matches_twin
                        }
                        let q_start = s - t;
                        let q = rand_bf16_f32(&mut r, t * heads * hd, 3.0);
                        let scale = 1.0 / (hd as f32).sqrt();
                        let sk = with_sinks.then_some(&sinks[..]);
                        let want = twin_attention_opts(
                            &q, t, heads, kv_heads, hd, hd, &k, row, &v, row, q_start, scale, window, sk,
                        );
                        let q_d = up(d, &q, "q");
                        let opts = AttnOptions { window, sinks: with_sinks.then_some(&sinks_d) };
                        let what = format!(
                            "GQA {dtype} h{heads}/{kv_heads} hd{hd} S{s} t{t} window {window:?} sinks {with_sinks}"
                        );
                        check_split_counts(d, &mut ws, 50, t * heads * hd, &want, &what, |out, ws| {
                            d.gqa_decode_attention_with(
                                &c, 0, &q_d, t, heads, kv_heads, hd, q_start, scale, out, ws, &opts,
                            )
                        });
                    }
                }
            }
        }
    }
    // Bad options are shape errors.
    let c = GpuKvCache::new(d, KvDtype::Bf16, 1, 2, 16, 0, KvCapacity::Tokens(8)).unwrap();
    let mut ws = DecodeWorkspace::new();
    let q = up(d, &[0f32; 2 * 16], "q");
    let mut out = up(d, &[0f32; 2 * 16], "out");
    let three = up(d, &[0u16; 3], "sinks");
    for opts in [AttnOptions { window: Some(0), sinks: None }, AttnOptions { window: None, sinks: Some(&three) }] {
        let e = d.gqa_decode_attention_with(&c, 0, &q, 1, 2, 1, 16, 0, 1.0, &mut out, &mut ws, &opts);
        assert!(matches!(e, Err(GpuError::Shape { .. })), "{opts:?}: {e:?}");
    }
}

/// The cache is read only up to the causal limit: rows past q_start + t hold NaN and must not
/// leak into the output. Also the workspace stops growing after the first calls.
#[test]
fn rows_past_the_queries_are_never_read_and_workspace_settles() {
    let Some(d) = gpu("rows_past_the_queries_are_never_read_and_workspace_settles") else { return };
    let mut r = rng(23);
    let (heads, latent, rope) = (16, 512, 64);
    let row = latent + rope;
    let cap = 3000;
    for dtype in [KvDtype::Bf16, KvDtype::Fp8] {
        let c = GpuKvCache::new(d, dtype, 1, 1, row, 64, KvCapacity::Tokens(cap)).unwrap();
        let (src, kv) = fill_src(d, &c, 0, 0, cap, &mut r);
        let mut ws = DecodeWorkspace::new();
        for s in (1..2000).step_by(97) {
            // Poison the rows the query must not see.
            let poison = vec![f32::NAN; 5 * row];
            c.write(d, 0, 0, s, 5, &up(d, &poison, "test input")).unwrap();
            let q = rand_bf16_f32(&mut r, heads * row, 2.0);
            let scale = 0.07;
            let want = twin_attention(&q, 1, heads, 1, row, latent, &kv, row, &kv, row, s - 1, scale);
            let mut out = poisoned_f32(d, heads * latent);
            d.mla_decode_attention(&c, 0, &up(d, &q, "q"), 1, heads, latent, s - 1, scale, &mut out, &mut ws).unwrap();
            assert_close(&format!("{dtype} S{s}"), &down(d, &out), &want, RTOL, ATOL);
            // Restore the poisoned rows (the same f32 rows store the same bytes).
            c.write(d, 0, 0, s, 5, &up(d, &src[s * row..(s + 5) * row], "test input")).unwrap();
        }
        // One allocation (at the first multi-split call) serves every context length.
        assert_eq!(ws.growths(), 1, "workspace allocations");
    }
}

#[test]
fn shape_errors_are_errors() {
    let Some(d) = gpu("shape_errors_are_errors") else { return };
    let c = GpuKvCache::new(d, KvDtype::Bf16, 1, 1, 40, 0, KvCapacity::Tokens(8)).unwrap();
    let g = GpuKvCache::new(d, KvDtype::Bf16, 1, 2, 32, 0, KvCapacity::Tokens(8)).unwrap();
    let mut ws = DecodeWorkspace::new();
    let q = up(d, &vec![0f32; 2 * 40], "test input");
    let mut out = up(d, &vec![0f32; 2 * 32], "test input");
    let bad = [
        d.mla_decode_attention(&c, 0, &q, 1, 2, 32, 8, 1.0, &mut out, &mut ws), // past capacity
        d.mla_decode_attention(&c, 1, &q, 1, 2, 32, 0, 1.0, &mut out, &mut ws), // no layer 1
        d.mla_decode_attention(&c, 0, &q, 1, 3, 32, 0, 1.0, &mut out, &mut ws), // q size
        d.mla_decode_attention(&c, 0, &q, 1, 2, 40, 0, 1.0, &mut out, &mut ws), // no rope
        d.mla_decode_attention(&g, 0, &q, 1, 2, 32, 0, 1.0, &mut out, &mut ws), // 2-plane cache
        d.gqa_decode_attention(&c, 0, &q, 1, 2, 1, 40, 0, 1.0, &mut out, &mut ws), // 1-plane cache
        d.gqa_decode_attention(&g, 0, &q, 1, 3, 2, 16, 0, 1.0, &mut out, &mut ws), // heads % kv_heads
    ];
    for (i, e) in bad.into_iter().enumerate() {
        assert!(matches!(e, Err(GpuError::Shape { .. })), "case {i}: {e:?}");
    }
}

/// An f32 cache (the precise mode's) is refused by both decode kernels, naming the prefill form.
#[test]
fn an_f32_cache_is_refused_by_the_decode_kernels() {
    let Some(d) = gpu("an_f32_cache_is_refused_by_the_decode_kernels") else { return };
    let c = GpuKvCache::new(d, KvDtype::F32, 1, 1, 40, 0, KvCapacity::Tokens(8)).unwrap();
    let g = GpuKvCache::new(d, KvDtype::F32, 1, 2, 32, 0, KvCapacity::Tokens(8)).unwrap();
    let mut ws = DecodeWorkspace::new();
    let q = up(d, &vec![0f32; 2 * 40], "test input");
    let mut out = up(d, &vec![0f32; 2 * 32], "test input");
    let errs = [
        d.mla_decode_attention(&c, 0, &q, 1, 2, 32, 0, 1.0, &mut out, &mut ws),
        d.gqa_decode_attention(&g, 0, &up(d, &[0f32; 2 * 16], "q"), 1, 2, 2, 16, 0, 1.0, &mut out, &mut ws),
    ];
    for e in errs {
        let e = e.unwrap_err();
        assert!(matches!(e, GpuError::Shape { .. }) && e.to_string().contains("prefill form"), "{e}");
    }
}

fn twin_absorb(
    kv_b: &[f32],
    q: &[f32],
    t: usize,
    heads: usize,
    nope: usize,
    rope: usize,
    vd: usize,
    lat: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; t * heads * (lat + rope)];
    for i in 0..t {
        for h in 0..heads {
            let qh = &q[(i * heads + h) * (nope + rope)..][..nope + rope];
            let o = &mut out[(i * heads + h) * (lat + rope)..][..lat + rope];
            for l in 0..lat {
                o[l] = (0..nope).map(|dd| qh[dd] as f64 * kv_b[(h * (nope + vd) + dd) * lat + l] as f64).sum::<f64>()
                    as f32;
            }
            o[lat..].copy_from_slice(&qh[nope..]);
        }
    }
    out
}

fn twin_uv(kv_b: &[f32], o_lat: &[f32], t: usize, heads: usize, nope: usize, vd: usize, lat: usize) -> Vec<f32> {
    let mut out = vec![0f32; t * heads * vd];
    for i in 0..t {
        for h in 0..heads {
            for j in 0..vd {
                let w = &kv_b[(h * (nope + vd) + nope + j) * lat..][..lat];
                let ol = &o_lat[(i * heads + h) * lat..][..lat];
                out[(i * heads + h) * vd + j] =
                    w.iter().zip(ol).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32;
            }
        }
    }
    out
}

#[test]
fn mla_absorb_and_uv_match_twins() {
    let Some(d) = gpu("mla_absorb_and_uv_match_twins") else { return };
    let mut r = rng(24);
    // (t, heads, nope, rope, v_dim, latent)
    for &(t, heads, nope, rope, vd, lat) in &[
        (1, 16, 128, 64, 128, 512),
        (3, 16, 128, 64, 128, 512),
        (2, 3, 24, 8, 16, 32),
        (1, 2, 7, 5, 9, 13),
        (4, 5, 33, 16, 20, 300),
        // The absorb kernel tiles 64 latent columns x 4 tokens per block and splits nope over 8
        // warps: ragged token tiles (5, 9, 66), a partial last column tile (130, 65 odd: unpaired
        // loads), fewer nope rows than warps (3, 7), no rope.
        (5, 3, 40, 8, 16, 130),
        (9, 2, 7, 3, 5, 65),
        (66, 2, 3, 4, 8, 64),
        (1, 4, 129, 0, 8, 200),
    ] {
        let kv_b = rand_bf16_f32(&mut r, heads * (nope + vd) * lat, 0.2);
        let kv_b_d = up(d, &to_bf16(&kv_b), "kv_b");
        let q = rand_bf16_f32(&mut r, t * heads * (nope + rope), 1.0);
        let want = twin_absorb(&kv_b, &q, t, heads, nope, rope, vd, lat);
        let mut dst = poisoned_f32(d, t * heads * (lat + rope));
        d.mla_absorb_q(&kv_b_d, &up(d, &q, "q"), t, heads, nope, rope, vd, lat, &mut dst).unwrap();
        let what = format!("absorb t{t} h{heads} nope{nope} rope{rope} v{vd} lat{lat}");
        assert_close(&what, &down(d, &dst), &want, 1e-5, 1e-6);

        let o_lat = rand_bf16_f32(&mut r, t * heads * lat, 1.0);
        let want = twin_uv(&kv_b, &o_lat, t, heads, nope, vd, lat);
        let mut out = poisoned_f32(d, t * heads * vd);
        d.mla_apply_uv(&kv_b_d, &up(d, &o_lat, "o_lat"), t, heads, nope, vd, lat, &mut out).unwrap();
        assert_close(&format!("uv t{t} h{heads} lat{lat}"), &down(d, &out), &want, 1e-5, 1e-6);
    }
    // Size mismatches are errors.
    let w = up(d, &[0u16; 10], "test input");
    let q = up(d, &[0f32; 10], "test input");
    let mut o = up(d, &[0f32; 10], "test input");
    assert!(matches!(d.mla_absorb_q(&w, &q, 1, 1, 2, 2, 2, 3, &mut o), Err(GpuError::Shape { .. })));
    assert!(matches!(d.mla_apply_uv(&w, &q, 1, 1, 2, 2, 3, &mut o), Err(GpuError::Shape { .. })));
}

/// V2-Lite MLA decode at short contexts with the split count forced (prints): what the split rule
/// (`decode_split_count`) gives against fewer, longer splits, where the per-split work (staging
/// the queries, zeroing the tiles, the combine's reads) is a larger share.
/// V2-Lite MLA decode: the one-token kernel against the general one, and its split counts
/// (prints).
#[test]
fn bench_mla_one_token_kernel() {
    let Some(d) = gpu("bench_mla_one_token_kernel") else { return };
    for context in [64usize, 512, 1024, 2048, 4096, 8192, 16384] {
        let general = bench_mla_decode_kernel(d, context, KvDtype::Bf16, 50, None, true).unwrap();
        let rule = bench_mla_decode_kernel(d, context, KvDtype::Bf16, 50, None, false).unwrap();
        let mut line = format!(
            "bench MLA decode bf16 ctx {context}: general kernel ({} splits) {:.2} us/layer; one-token kernel ({} splits) {:.2}",
            general.splits,
            general.many_layers.seconds_per_call * 1e6,
            rule.splits,
            rule.many_layers.seconds_per_call * 1e6
        );
        for splits in [2usize, 4, 8, 16, 32, 64, 128, 256] {
            if splits > context {
                break;
            }
            let b = bench_mla_decode_kernel(d, context, KvDtype::Bf16, 50, Some(splits), false).unwrap();
            assert!(b.many_layers.seconds_per_call.is_finite() && b.many_layers.seconds_per_call > 0.0);
            line += &format!("; {} splits {:.2}", b.splits, b.many_layers.seconds_per_call * 1e6);
        }
        let _ = writeln!(std::io::stderr(), "{line}");
    }
}

#[test]
fn bench_mla_decode_split_counts() {
    let Some(d) = gpu("bench_mla_decode_split_counts") else { return };
    for context in [512usize, 2048, 8192] {
        let rule = bench_mla_decode_kernel(d, context, KvDtype::Bf16, 50, None, true).unwrap();
        let mut line = format!(
            "bench MLA decode bf16 ctx {context} (general kernel): rule {} splits {:.2} us/layer",
            rule.splits,
            rule.many_layers.seconds_per_call * 1e6
        );
        for splits in [1usize, 2, 4, 8, 16, 32] {
            let b = bench_mla_decode_kernel(d, context, KvDtype::Bf16, 50, Some(splits), true).unwrap();
            assert!(b.many_layers.seconds_per_call.is_finite() && b.many_layers.seconds_per_call > 0.0);
            line += &format!("; {} splits {:.2}", b.splits, b.many_layers.seconds_per_call * 1e6);
        }
        let _ = writeln!(std::io::stderr(), "{line}");
    }
}

/// V2-Lite MLA decode bandwidth (prints; the lead compares with HBM: H100 3.35 TB/s, H200 4.8 TB/s).
#[test]
fn bench_mla_decode_v2_lite() {
    let Some(d) = gpu("bench_mla_decode_v2_lite") else { return };
    for dtype in [KvDtype::Bf16, KvDtype::Fp8] {
        for context in [4096usize, 32768] {
            let b = bench_mla_decode(d, context, dtype, 50).unwrap();
            let _ = writeln!(
                std::io::stderr(),
                "bench MLA decode {dtype} ctx {context} ({} splits): 1 layer {:.2} us {:.0} GB/s; {} layers {:.2} us/layer {:.0} GB/s",
                b.splits,
                b.one_layer.seconds_per_call * 1e6,
                b.one_layer.gb_per_s,
                b.many_layers.layers,
                b.many_layers.seconds_per_call * 1e6,
                b.many_layers.gb_per_s
            );
            assert!(b.many_layers.gb_per_s.is_finite() && b.many_layers.gb_per_s > 0.0);
        }
    }
}
