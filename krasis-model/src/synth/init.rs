//! Deterministic weight initialisation: every tensor is cut into fixed-size chunks, and chunk `c`
//! of tensor `name` is drawn from a xoshiro256++ stream seeded by splitmix64 over
//! `(seed, FNV-1a(name), c)`. The bytes therefore depend on nothing but the seed and the tensor
//! (not on threads, batching or shard layout), and any chunk can be generated on its own.
//!
//! # Scales
//! - projections (`[out, in]`, including the router and `lm_head`): uniform with std `1/sqrt(in)`,
//!   so a unit-RMS input gives unit-RMS outputs and activations stay O(1) through depth;
//! - the embedding: uniform with std 1 per element (unit-RMS rows);
//! - RMSNorm weights: 1.0; `e_score_correction_bias`: F32 zeros (plus the skew below).
//!
//! # Router skew
//! With `router_skew = s > 0`, every MoE layer gets a deterministic ranking of its experts (a
//! permutation drawn from `(seed, layer)`, so the hot experts differ from layer to layer) and the
//! expert of rank `r` out of `E` gets the preference
//! `p = s · (1 − ln(1 + r) / ln E)`: `s` for the hottest, falling off like a Zipf law, 0 for the
//! coldest. The preference is in router-logit units and enters as follows:
//! - **noaux_tc routers** (DeepSeek-V3: sigmoid scores + `e_score_correction_bias`): the bias is
//!   `p / 4`, the score shift a logit shift of `p` causes where the sigmoid is steepest. The bias
//!   steers the choice of experts only, as in the real model, not their weights.
//! - **bias-free (softmax) routers**: a fixed dense unit direction `u` (`u_j = ±1/sqrt(h)`, signs
//!   from the seed) is added to every embedding row with magnitude `κ·sqrt(h)` (each element
//!   shifts by `±κ`, κ = 0.5), so every normalised hidden state carries a component
//!   ≈ `κ·sqrt(h)/sqrt(1+κ²)` along `u`; router row `e` gets `a_e·u` with
//!   `a_e = p_e·sqrt(1+κ²)/(κ·sqrt(h))`, adding ≈ `p_e` to expert `e`'s logit. The shift is exact
//!   for the embedding output and weakens with depth as attention and expert outputs grow the
//!   residual stream (each block adds ~unit-RMS noise), but the ranking of hot experts stays.
//!
//! With `s = 0` nothing is added anywhere: the weights are plain i.i.d. uniform.

use std::sync::Arc;

use crate::model::tensors::{TensorRole, TensorSpec};
use crate::spec::{ModelSpec, TopkMethod};

/// Elements per generated chunk (2 MiB of BF16). Part of the format of the random stream:
/// changing it changes the weights of every seed.
pub(crate) const CHUNK_ELEMS: usize = 1 << 20;

/// Magnitude (per element) of the skew direction added to embedding rows.
const SKEW_KAPPA: f32 = 0.5;

pub(crate) fn fnv1a(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

pub(crate) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// xoshiro256++ (Blackman & Vigna), seeded through splitmix64.
pub(crate) struct Xoshiro256pp {
    s: [u64; 4],
}

impl Xoshiro256pp {
    pub(crate) fn from_keys(keys: &[u64]) -> Self {
        let mut st = 0x6b72_6173_6973_u64; // "krasis"
        for &k in keys {
            st ^= k;
            st = splitmix64(&mut st);
        }
        let s = [splitmix64(&mut st), splitmix64(&mut st), splitmix64(&mut st), splitmix64(&mut st)];
        Xoshiro256pp { s }
    }

    #[inline(always)]
    pub(crate) fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, n)` (n small; the modulo bias is irrelevant here).
    fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() >> 11) % n as u64) as usize
    }
}

/// f32 → BF16 bits, round to nearest even (inputs are finite).
#[inline(always)]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// Stored dtype of a synthetic tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dtype {
    Bf16,
    F32,
    /// FP8 E4M3 codes (block-FP8 checkpoints' weights, NVFP4's group scales).
    F8E4M3,
    /// 32-bit integers (compressed-tensors' packed INT4 words and `weight_shape`).
    I32,
    /// Bytes (MXFP4's and NVFP4's E2M1 code pairs, MXFP4's E8M0 scales).
    U8,
}

impl Dtype {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "BF16",
            Dtype::F32 => "F32",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::I32 => "I32",
            Dtype::U8 => "U8",
        }
    }

    pub(crate) fn size(self) -> usize {
        match self {
            Dtype::Bf16 => 2,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F8E4M3 | Dtype::U8 => 1,
        }
    }

    /// The safetensors dtype.
    pub(crate) fn dtype(self) -> krasis_core::DType {
        match self {
            Dtype::Bf16 => krasis_core::DType::BF16,
            Dtype::F32 => krasis_core::DType::F32,
            Dtype::F8E4M3 => krasis_core::DType::F8E4M3,
            Dtype::I32 => krasis_core::DType::I32,
            Dtype::U8 => krasis_core::DType::U8,
        }
    }
}

/// `x[r, c] += row[r] · dir[c]` on top of the uniform draw.
#[derive(Clone, Debug)]
pub(crate) struct RankOne {
    pub row: Vec<f32>,
    pub dir: Arc<Vec<f32>>,
}

/// How a tensor's values are made.
#[derive(Clone, Debug)]
pub(crate) enum Fill {
    /// Every element the same (RMSNorm weights, quantisation scales). U8 takes the byte `v`
    /// (E8M0 exponents), F8_E4M3 the code nearest `v` (ties to even).
    Const(f32),
    /// i.i.d. uniform on `(-bound, bound)`, optionally plus a rank-one term.
    Uniform { bound: f32, plus: Option<RankOne> },
    /// Explicit values (F32 router biases).
    Values(Arc<Vec<f32>>),
    /// Explicit integers (I32: compressed-tensors' `weight_shape`).
    Ints(Vec<i32>),
    /// Uniformly random codes: every FP8 E4M3 code but the two NaNs (which become zero), every
    /// 32-bit word (eight uniform INT4 codes), or every byte (two uniform E2M1 codes).
    Codes,
}

/// A tensor to write: its inventory entry, stored dtype and recipe.
#[derive(Clone, Debug)]
pub(crate) struct SynthTensor {
    pub spec: TensorSpec,
    pub dtype: Dtype,
    pub fill: Fill,
    /// FNV-1a of the name: the tensor's key in the random stream.
    pub key: u64,
}

impl SynthTensor {
    pub(crate) fn bytes(&self) -> u64 {
        (self.spec.numel() * self.dtype.size()) as u64
    }

    pub(crate) fn chunks(&self) -> usize {
        self.spec.numel().div_ceil(CHUNK_ELEMS).max(1)
    }

    /// Append the bytes of chunk `c` (little-endian) to `out`.
    pub(crate) fn gen_chunk(&self, seed: u64, c: usize, out: &mut Vec<u8>) {
        let n = self.spec.numel();
        let start = (c * CHUNK_ELEMS).min(n);
        let end = ((c + 1) * CHUNK_ELEMS).min(n);
        let len = end - start;
        let base = out.len();
        out.resize(base + len * self.dtype.size(), 0);
        let dst = &mut out[base..];
        match (&self.fill, self.dtype) {
            (Fill::Const(v), Dtype::Bf16) => {
                let b = bf16_bits(*v).to_le_bytes();
                for d in dst.chunks_exact_mut(2) {
                    d.copy_from_slice(&b);
                }
            }
            (Fill::Values(vals), Dtype::F32) => {
                for (d, v) in dst.chunks_exact_mut(4).zip(&vals[start..end]) {
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
            (Fill::Const(v), Dtype::F32) => {
                for d in dst.chunks_exact_mut(4) {
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
            (Fill::Ints(vals), Dtype::I32) => {
                for (d, v) in dst.chunks_exact_mut(4).zip(&vals[start..end]) {
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
            (Fill::Const(v), Dtype::U8) => dst.fill(*v as u8),
            (Fill::Const(v), Dtype::F8E4M3) => dst.fill(krasis_core::dtype::f32_to_fp8_e4m3(*v)),
            (Fill::Codes, Dtype::F8E4M3 | Dtype::I32 | Dtype::U8) => {
                let mut rng = Xoshiro256pp::from_keys(&[seed, self.key, c as u64]);
                for d in dst.chunks_mut(8) {
                    let r = rng.next_u64().to_le_bytes();
                    d.copy_from_slice(&r[..d.len()]);
                }
                if self.dtype == Dtype::F8E4M3 {
                    for b in dst.iter_mut().filter(|b| **b & 0x7f == 0x7f) {
                        *b = 0;
                    }
                }
            }
            (Fill::Uniform { bound, plus }, Dtype::Bf16) => {
                let mut rng = Xoshiro256pp::from_keys(&[seed, self.key, c as u64]);
                // 16 random bits per element: value = (k + 0.5)·step − bound.
                let step = 2.0 * bound / 65536.0;
                let off = 0.5 * step - bound;
                match plus {
                    None => uniform_bf16(&mut rng, dst, step, off),
                    Some(r1) => {
                        let cols = *self.spec.shape.last().expect("matrix");
                        let mut i = start;
                        let mut words = dst.chunks_exact_mut(8);
                        let put = |k: u16, d: &mut [u8], i: usize| {
                            let v = k as f32 * step + off + r1.row[i / cols] * r1.dir[i % cols];
                            d.copy_from_slice(&bf16_bits(v).to_le_bytes());
                        };
                        for w in &mut words {
                            let r = rng.next_u64();
                            for (j, d) in w.chunks_exact_mut(2).enumerate() {
                                put((r >> (16 * j)) as u16, d, i);
                                i += 1;
                            }
                        }
                        let rest = words.into_remainder();
                        if !rest.is_empty() {
                            let r = rng.next_u64();
                            for (j, d) in rest.chunks_exact_mut(2).enumerate() {
                                put((r >> (16 * j)) as u16, d, i);
                                i += 1;
                            }
                        }
                    }
                }
            }
            (fill, dtype) => unreachable!("no {dtype:?} writer for {fill:?}"),
        }
    }
}

/// The hot loop: four BF16 values from each 64-bit draw.
fn uniform_bf16(rng: &mut Xoshiro256pp, dst: &mut [u8], step: f32, off: f32) {
    let mut words = dst.chunks_exact_mut(8);
    for w in &mut words {
        let r = rng.next_u64();
        let mut packed = 0u64;
        for j in 0..4 {
            let k = (r >> (16 * j)) as u16;
            packed |= (bf16_bits(k as f32 * step + off) as u64) << (16 * j);
        }
        w.copy_from_slice(&packed.to_le_bytes());
    }
    let rest = words.into_remainder();
    if !rest.is_empty() {
        let r = rng.next_u64();
        for (j, d) in rest.chunks_exact_mut(2).enumerate() {
            let k = (r >> (16 * j)) as u16;
            d.copy_from_slice(&bf16_bits(k as f32 * step + off).to_le_bytes());
        }
    }
}

/// The per-expert preference of one MoE layer (see the module docs): `p[e]`.
pub(crate) fn expert_preferences(seed: u64, layer: usize, n_experts: usize, skew: f32) -> Vec<f32> {
    if skew == 0.0 || n_experts < 2 {
        return vec![0.0; n_experts];
    }
    let mut rng = Xoshiro256pp::from_keys(&[seed, fnv1a("router_skew"), layer as u64]);
    let mut order: Vec<usize> = (0..n_experts).collect();
    for i in (1..n_experts).rev() {
        order.swap(i, rng.below(i + 1));
    }
    // order[r] is the expert of rank r.
    let ln_e = (n_experts as f32).ln();
    let mut p = vec![0f32; n_experts];
    for (r, &e) in order.iter().enumerate() {
        p[e] = skew * (1.0 - ((1 + r) as f32).ln() / ln_e);
    }
    p
}

/// The skew direction `u` (unit norm, dense, ±1/sqrt(h)).
fn skew_direction(seed: u64, h: usize) -> Vec<f32> {
    let mut rng = Xoshiro256pp::from_keys(&[seed, fnv1a("router_skew_direction")]);
    let mag = 1.0 / (h as f32).sqrt();
    let mut u = Vec::with_capacity(h);
    while u.len() < h {
        let r = rng.next_u64();
        for j in 0..64 {
            if u.len() < h {
                u.push(if (r >> j) & 1 == 1 { mag } else { -mag });
            }
        }
    }
    u
}

/// The layer index of a `model.layers.{l}.…` name (also under a prefix such as
/// `language_model.`).
pub(crate) fn layer_of(name: &str) -> Option<usize> {
    name.split_once("model.layers.")?.1.split('.').next()?.parse().ok()
}

/// Recipes for every tensor of `inventory` (the [`crate::model::tensors::expected_tensors`] list).
pub(crate) fn plan_tensors(spec: &ModelSpec, inventory: Vec<TensorSpec>, seed: u64, skew: f32) -> Vec<SynthTensor> {
    let h = spec.hidden_size;
    let noaux = spec.moe.as_ref().is_some_and(|m| matches!(m.routing.topk, TopkMethod::NoauxTc { .. }));
    // Softmax-style routers get the skew through the embedding direction.
    let dir = (skew > 0.0 && spec.moe.is_some() && !noaux).then(|| Arc::new(skew_direction(seed, h)));
    let kappa_sqrt_h = SKEW_KAPPA * (h as f32).sqrt();
    let router_gain = (1.0 + SKEW_KAPPA * SKEW_KAPPA).sqrt() / kappa_sqrt_h;
    let sqrt3 = 3f32.sqrt();
    inventory
        .into_iter()
        .map(|t| {
            let key = fnv1a(&t.name);
            let uniform_for_input = |t: &TensorSpec| sqrt3 / (t.shape[1] as f32).sqrt();
            let (dtype, fill) = match t.role {
                TensorRole::Norm => (Dtype::Bf16, Fill::Const(1.0)),
                // Stored zero-centred: 0 is a gain of 1.
                TensorRole::CentredNorm => (Dtype::Bf16, Fill::Const(0.0)),
                // DeltaNet's convolution taps, A_log (decay rates e^A_log around 1) and dt_bias.
                TensorRole::MixerParam => (Dtype::Bf16, Fill::Uniform { bound: 0.5, plus: None }),
                // Small against the projections' outputs, non-zero so that dropping one shows.
                TensorRole::Bias => (Dtype::Bf16, Fill::Uniform { bound: 0.1, plus: None }),
                TensorRole::RouterBias => {
                    let layer = layer_of(&t.name).expect("router bias lives in a layer");
                    let p = expert_preferences(seed, layer, t.shape[0], skew);
                    (Dtype::F32, Fill::Values(Arc::new(p.iter().map(|x| x / 4.0).collect())))
                }
                TensorRole::Embedding => {
                    let plus =
                        dir.as_ref().map(|d| RankOne { row: vec![kappa_sqrt_h; t.shape[0]], dir: Arc::clone(d) });
                    (Dtype::Bf16, Fill::Uniform { bound: sqrt3, plus })
                }
                TensorRole::Router => {
                    let plus = dir.as_ref().map(|d| {
                        let layer = layer_of(&t.name).expect("router lives in a layer");
                        let p = expert_preferences(seed, layer, t.shape[0], skew);
                        RankOne { row: p.iter().map(|x| x * router_gain).collect(), dir: Arc::clone(d) }
                    });
                    (Dtype::Bf16, Fill::Uniform { bound: uniform_for_input(&t), plus })
                }
                TensorRole::LmHead
                | TensorRole::Attention
                | TensorRole::SharedExpert
                | TensorRole::DenseMlp
                | TensorRole::RoutedExpert { .. } => {
                    (Dtype::Bf16, Fill::Uniform { bound: uniform_for_input(&t), plus: None })
                }
            };
            SynthTensor { spec: t, dtype, fill, key }
        })
        .collect()
}
