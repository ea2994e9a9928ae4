//! Scaffolding shared by the GPU integration tests (`mod common;` in each test file): the device
//! getter that skips visibly without a GPU, seeded random data exactly representable in BF16,
//! upload/download and NaN-poisoned outputs, and the closeness assertions.
//!
//! Without a GPU, `gpu(test)` prints "*** SKIPPED: no GPU: ... ***" straight to stderr (past the
//! harness's capture) and returns `None`, so the test passes having checked nothing; with
//! `KRASIS_REQUIRE_GPU=1` a missing GPU panics instead.

// Each test file is its own crate and uses only some of these helpers.
#![allow(dead_code)]

use std::io::Write;
use std::sync::OnceLock;

use krasis_core::dtype::{bf16_to_f32, f32_to_bf16, fp8_e4m3_to_f32};
use krasis_gpu::cudarc::driver::{DevicePtr, DeviceRepr};
use krasis_gpu::kv_cache::{f32_to_fp8_e4m3, fp8_group_scale};
use krasis_gpu::{DeviceBuffer, GemmContext, GpuDevice, KvDtype, VramBudgetSpec};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

// ---------------------------------------------------------------- the device

static DEVICE: OnceLock<Result<GpuDevice, String>> = OnceLock::new();
static GEMM: OnceLock<GemmContext> = OnceLock::new();

/// The GPU (ordinal 0, auto budget), opened once per test binary; `None` (after the visible skip
/// line) when there is none. Panics under `KRASIS_REQUIRE_GPU=1`, or when a GPU is found but will
/// not open.
pub fn gpu(test: &str) -> Option<&'static GpuDevice> {
    let d = DEVICE.get_or_init(|| match krasis_gpu::probe() {
        Ok(info) => {
            let d = GpuDevice::open(0, VramBudgetSpec::Auto)
                .unwrap_or_else(|e| panic!("probe found {info} but open failed: {e}"));
            let _ = writeln!(
                std::io::stderr(),
                "GPU: {}; kernels target {}; NVRTC {:?} from {}; {}",
                d.info(),
                d.target(),
                d.compiler().nvrtc().version(),
                d.compiler().nvrtc().path(),
                d.budget()
            );
            Ok(d)
        }
        Err(e) => Err(e.to_string()),
    });
    match d {
        Ok(d) => Some(d),
        Err(e) => {
            if std::env::var("KRASIS_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("KRASIS_REQUIRE_GPU=1 but {e}");
            }
            // One write, so parallel tests' output does not split the line `.ci/run` counts.
            let line = format!("*** SKIPPED: no GPU: {test} checked nothing: {e} ***\n");
            let _ = std::io::stderr().write_all(line.as_bytes());
            None
        }
    }
}

/// [`gpu`] plus a cuBLAS context on its stream (created once). A GPU without a loadable cuBLAS
/// is a failure, not a skip.
pub fn gpu_gemm(test: &str) -> Option<(&'static GpuDevice, &'static GemmContext)> {
    let d = gpu(test)?;
    let ctx = GEMM.get_or_init(|| {
        let ctx = GemmContext::new(d).unwrap_or_else(|e| panic!("GPU present but no cuBLAS: {e}"));
        let _ = writeln!(std::io::stderr(), "cuBLAS from {}", ctx.cublas_path());
        ctx
    });
    Some((d, ctx))
}

/// Mean microseconds per call of `f` over `reps` calls, timed with CUDA events on `d`'s stream
/// (the caller warms up first).
pub fn time_us_per_call(d: &GpuDevice, reps: usize, mut f: impl FnMut()) -> f64 {
    let (a, b) = (d.new_event(true).unwrap(), d.new_event(true).unwrap());
    a.record(d.stream()).unwrap();
    for _ in 0..reps {
        f();
    }
    b.record(d.stream()).unwrap();
    b.synchronize().unwrap();
    a.elapsed_ms(&b).unwrap() as f64 * 1e3 / reps as f64
}

// ---------------------------------------------------------------- random data and BF16

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Uniform in `[-scale, scale)`, not rounded.
pub fn rand_f32(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-1.0f32..1.0) * scale).collect()
}

/// [`rand_f32`] rounded to BF16, as bits.
pub fn rand_bf16_bits(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<u16> {
    (0..n).map(|_| f32_to_bf16(r.random_range(-1.0f32..1.0) * scale)).collect()
}

/// [`rand_f32`] rounded to BF16, as f32 (exactly representable in BF16).
pub fn rand_bf16_f32(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| bf16_round(r.random_range(-1.0f32..1.0) * scale)).collect()
}

/// `x` rounded to the nearest BF16 (ties to even), as f32.
pub fn bf16_round(x: f32) -> f32 {
    bf16_to_f32(f32_to_bf16(x))
}

/// Every element rounded to the nearest BF16, as f32.
pub fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16_round(x)).collect()
}

pub fn to_bf16(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| f32_to_bf16(x)).collect()
}

pub fn from_bf16(v: &[u16]) -> Vec<f32> {
    v.iter().map(|&x| bf16_to_f32(x)).collect()
}

/// What a KV cache of `dtype` stores for the row `x` and gives back on an f32 read (the twin of
/// `GpuKvCache::write`): BF16 rounding, or per-`group` FP8 E4M3 with a zero scale storing zeros.
pub fn twin_kv_row(dtype: KvDtype, x: &[f32], group: usize) -> Vec<f32> {
    match dtype {
        KvDtype::Bf16 => round_bf16(x),
        KvDtype::F32 => x.to_vec(),
        KvDtype::Fp8 => x
            .chunks(group)
            .flat_map(|g| {
                let scale = fp8_group_scale(g);
                g.iter().map(move |&v| {
                    let code = if scale == 0.0 { 0 } else { f32_to_fp8_e4m3(v / scale) };
                    fp8_e4m3_to_f32(code) * scale
                })
            })
            .collect(),
    }
}

// ---------------------------------------------------------------- device buffers

pub fn up<T: DeviceRepr>(d: &GpuDevice, v: &[T], what: &str) -> DeviceBuffer<T> {
    d.upload(v, what).unwrap_or_else(|e| panic!("{e}"))
}

pub fn down<T: DeviceRepr + Default + Clone>(d: &GpuDevice, b: &impl DevicePtr<T>) -> Vec<T> {
    d.download(b).unwrap_or_else(|e| panic!("{e}"))
}

/// A buffer of `n` NaNs (f32) so that unwritten outputs fail the comparison.
pub fn poisoned_f32(d: &GpuDevice, n: usize) -> DeviceBuffer<f32> {
    up(d, &vec![f32::NAN; n], "poisoned output")
}

/// A buffer of `n` BF16 NaNs (`0x7fc0`) so that unwritten outputs fail the comparison.
pub fn poisoned_bf16(d: &GpuDevice, n: usize) -> DeviceBuffer<u16> {
    up(d, &vec![0x7fc0u16; n], "poisoned output")
}

// ---------------------------------------------------------------- comparisons

/// Every element within `atol + rtol·|want|`; NaN only where NaN is expected. Returns the worst
/// relative-to-tolerance error for the log.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], rtol: f32, atol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = 0.0f32;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
            continue;
        }
        let tol = atol + rtol * w.abs();
        let err = (g - w).abs();
        assert!(err <= tol, "{what}[{i}]: got {g}, want {w} (err {err:e} > tol {tol:e})");
        worst = worst.max(err / tol);
    }
    worst
}

/// Every element within its own tolerance `tol[i]` (from a rounding-error model of the twin);
/// NaN only where NaN is expected. Returns the worst err/tol for the log.
pub fn assert_within(what: &str, got: &[f32], want: &[f32], tol: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    assert_eq!(tol.len(), want.len(), "{what}: tolerance lengths");
    let mut worst = 0.0f32;
    for (i, ((&g, &w), &t)) in got.iter().zip(want).zip(tol).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
            continue;
        }
        let err = (g - w).abs();
        assert!(err <= t, "{what}[{i}]: got {g}, want {w} (err {err:e} > tol {t:e})");
        worst = worst.max(err / t);
    }
    worst
}

/// Bit-for-bit equality (so `-0.0 != 0.0`), any NaN matching any NaN.
pub fn assert_bitwise_eq(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()), "{what}[{i}]: got {g:e}, want {w:e}");
    }
}

/// BF16 outputs against the twin's f32 value: each within `atol` plus one BF16 ulp (the kernel
/// and the twin can round last-bit-different f32 values across a rounding boundary), and at most
/// 5% not bit-identical to the twin rounded (a truncating or otherwise wrong rounding differs in
/// about half of all elements).
pub fn assert_bf16_close(what: &str, got: &[u16], want_f32: &[f32], atol: f32) {
    assert_eq!(got.len(), want_f32.len(), "{what}: lengths");
    let mut inexact = 0;
    for (i, (&g, &w)) in got.iter().zip(want_f32).enumerate() {
        let gf = bf16_to_f32(g);
        if w.is_nan() {
            assert!(gf.is_nan(), "{what}[{i}]: got {gf}, want NaN");
            continue;
        }
        if g != f32_to_bf16(w) {
            let tol = atol + w.abs() / 128.0;
            assert!((gf - w).abs() <= tol, "{what}[{i}]: got {gf} ({g:#06x}), want {w} (tol {tol:e})");
            inexact += 1;
        }
    }
    assert!(inexact * 20 <= got.len().max(20), "{what}: {inexact} of {} elements not the twin rounded", got.len());
}

// ---------------------------------------------------------------- f32 rounding-error model

/// Unit roundoff of f32.
pub const U: f64 = 1.0 / (1u64 << 24) as f64;

/// `Σ a_i b_i` in f64 and the rounding-error estimate `sqrt(Σ S_j²)` (over the partial sums `S_j`)
/// of accumulating it step by step in f32: multiplied by [`U`], about the size of a random walk of
/// `u·|S_j|` steps.
pub fn dot_est(a: impl Iterator<Item = f64>, b: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut s, mut ss) = (0.0f64, 0.0f64);
    for (x, y) in a.zip(b) {
        s += x * y;
        ss += s * s;
    }
    (s, ss.sqrt())
}
