//! A gated-DeltaNet layer on the CPU (Qwen3-Next, Qwen3.5): the input projections, the
//! depthwise causal convolution with SiLU, L2-normalised q and k, the gated delta rule
//! ([`krasis_cpu::delta_rule`]), the gated output norm and `out_proj`. Per sequence the layer
//! keeps a [`DeltaState`] of constant size instead of a KV cache.
//!
//! Per token, with `C` the q, k and v channels and `r = value_heads / key_heads`:
//! `[q | k | v] = silu(conv(in_proj_qkv x))`; `q, k` L2-normalised per head (eps 1e-6), `q` scaled
//! by `dk^-1/2`; `β = σ(in_proj_b x)`; `g = −e^A_log · softplus(in_proj_a x + dt_bias)`; the rule
//! gives `o` per value head; `y = out_proj(rmsnorm(o) · norm · silu(in_proj_z x))`.

use krasis_cpu::activation::silu;
use krasis_cpu::delta_rule::{self, DeltaHeads};

use crate::model::build::DeltaNetParts;
use crate::model::linear::{forward_shared_input, LinearOp};
use crate::spec::DeltaNetSpec;

/// Prompts of at least this many tokens run the chunked form of the rule, shorter ones (decode)
/// the token-by-token form: both give the same numbers (tested), and below a chunk the chunked
/// form's matrix set-up costs more than it saves.
pub const CHUNKED_MIN_TOKENS: usize = 16;

/// Tokens per chunk of the chunked rule: transformers' and the published kernels' chunk size.
pub const CHUNK: usize = 64;

/// The eps of q and k's L2 normalisation (transformers' `l2norm`).
const L2_EPS: f32 = 1e-6;

/// One sequence's state of a gated-DeltaNet layer: the convolution's last `kernel − 1` inputs
/// (oldest first, `[kernel − 1, channels]`) and the rule's state `[value_heads, dk, dv]`, both
/// f32. Empty for a layer that is not DeltaNet.
#[derive(Clone, Debug, Default)]
pub struct DeltaState {
    conv: Vec<f32>,
    rule: Vec<f32>,
}

impl DeltaState {
    /// The zero state of a fresh sequence.
    pub fn new(d: &DeltaNetSpec) -> Self {
        DeltaState { conv: vec![0.0; d.conv_state_len()], rule: vec![0.0; d.rule_state_len()] }
    }

    pub fn bytes(&self) -> usize {
        (self.conv.len() + self.rule.len()) * 4
    }
}

/// One sequence of a batch: its rows and its state.
pub struct SeqDelta<'a> {
    pub rows: usize,
    pub state: &'a mut DeltaState,
}

/// A gated-DeltaNet layer over its weights.
pub struct DeltaNetOp<'w> {
    pub spec: DeltaNetSpec,
    pub eps: f32,
    pub w: &'w DeltaNetParts<Box<dyn LinearOp>, Vec<f32>>,
}

fn softplus(x: f32) -> f32 {
    // torch's softplus (β 1, threshold 20).
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Scales each `dim`-wide row of `x` to unit L2 norm (then by `scale`).
fn l2_normalise_rows(x: &mut [f32], dim: usize, scale: f32) {
    for row in x.chunks_exact_mut(dim) {
        let ss: f32 = row.iter().map(|v| v * v).sum();
        let inv = scale / (ss + L2_EPS).sqrt();
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

/// The depthwise causal convolution of `n` rows of `x` (`[n, channels]`) after the `kernel − 1`
/// rows `state` holds, then SiLU, into `out`; `state` keeps the last `kernel − 1` inputs.
/// `taps` is `[channels, kernel]`: output `i` is `Σ_j taps[c][j] · input[i − (kernel − 1) + j]`.
pub fn causal_conv_silu(x: &[f32], n: usize, taps: &[f32], kernel: usize, state: &mut [f32], out: &mut [f32]) {
    let ch = taps.len() / kernel;
    let keep = kernel - 1;
    let mut ext = Vec::with_capacity((keep + n) * ch);
    ext.extend_from_slice(state);
    ext.extend_from_slice(&x[..n * ch]);
    for i in 0..n {
        let o = &mut out[i * ch..(i + 1) * ch];
        o.iter_mut().for_each(|v| *v = 0.0);
        for j in 0..kernel {
            let src = &ext[(i + j) * ch..(i + j + 1) * ch];
            for ((v, &s), t) in o.iter_mut().zip(src).zip(taps.chunks_exact(kernel)) {
                *v += t[j] * s;
            }
        }
        o.iter_mut().for_each(|v| *v = silu(*v));
    }
    state.copy_from_slice(&ext[n * ch..]);
}

impl DeltaNetOp<'_> {
    /// The layer over the rows `x` `[t, hidden]` of `seqs` (in order), into `out` `[t, hidden]`,
    /// each sequence continuing from its state.
    pub fn forward(&self, x: &[f32], seqs: &mut [SeqDelta<'_>], out: &mut [f32]) {
        let d = &self.spec;
        let t: usize = seqs.iter().map(|s| s.rows).sum();
        let (ch, kw, vw, nv) = (d.conv_channels(), d.key_width(), d.value_width(), d.value_heads);
        let mut mixed = vec![0f32; t * ch];
        let mut z = vec![0f32; t * vw];
        let mut b = vec![0f32; t * nv];
        let mut a = vec![0f32; t * nv];
        let ops = [self.w.qkv.as_ref(), self.w.z.as_ref(), self.w.b.as_ref(), self.w.a.as_ref()];
        forward_shared_input(&ops, x, t, &mut [&mut mixed, &mut z, &mut b, &mut a]);
        let hd = DeltaHeads { key_heads: d.key_heads, value_heads: nv, dk: d.key_dim, dv: d.value_dim };
        let mut o = vec![0f32; t * vw];
        let mut conv = vec![0f32; t * ch];
        let mut off = 0;
        for s in seqs.iter_mut() {
            let n = s.rows;
            let rows = off..off + n;
            causal_conv_silu(
                &mixed[rows.start * ch..],
                n,
                &self.w.conv,
                d.conv_kernel,
                &mut s.state.conv,
                &mut conv[rows.start * ch..rows.end * ch],
            );
            let (mut q, mut k, mut v) =
                (Vec::with_capacity(n * kw), Vec::with_capacity(n * kw), Vec::with_capacity(n * vw));
            for row in conv[rows.start * ch..rows.end * ch].chunks_exact(ch) {
                q.extend_from_slice(&row[..kw]);
                k.extend_from_slice(&row[kw..2 * kw]);
                v.extend_from_slice(&row[2 * kw..]);
            }
            l2_normalise_rows(&mut q, d.key_dim, (d.key_dim as f32).powf(-0.5));
            l2_normalise_rows(&mut k, d.key_dim, 1.0);
            let mut g = vec![0f32; n * nv];
            let mut beta = vec![0f32; n * nv];
            for i in 0..n {
                for h in 0..nv {
                    let r = (off + i) * nv + h;
                    beta[i * nv + h] = 1.0 / (1.0 + (-b[r]).exp());
                    g[i * nv + h] = -self.w.a_log[h].exp() * softplus(a[r] + self.w.dt_bias[h]);
                }
            }
            let o_rows = &mut o[rows.start * vw..rows.end * vw];
            if n >= CHUNKED_MIN_TOKENS {
                delta_rule::chunked(&hd, CHUNK, &q, &k, &v, &g, &beta, &mut s.state.rule, o_rows);
            } else {
                delta_rule::recurrent(&hd, &q, &k, &v, &g, &beta, &mut s.state.rule, o_rows);
            }
            off += n;
        }
        // The gated norm per value head: rmsnorm(o) · w · silu(z).
        krasis_cpu::norm::rms_norm_rows(&mut o, &self.w.norm, self.eps);
        for (v, &zg) in o.iter_mut().zip(&z) {
            *v *= silu(zg);
        }
        self.w.out.forward(&o, t, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The convolution by hand: kernel 3 over one channel, zero state, then continuing from the
    /// state it kept gives what one pass over all rows gives.
    #[test]
    fn causal_conv_runs_over_the_kept_inputs() {
        let taps = [0.5f32, -1.0, 2.0];
        let x = [1.0f32, 2.0, 3.0, 4.0];
        let mut state = vec![0.0f32; 2];
        let mut out = vec![0.0f32; 4];
        causal_conv_silu(&x, 4, &taps, 3, &mut state, &mut out);
        let pre = [2.0, 4.0 - 1.0, 6.0 - 2.0 + 0.5, 8.0 - 3.0 + 1.0];
        for (o, p) in out.iter().zip(pre) {
            assert!((o - silu(p)).abs() < 1e-6, "{o} vs silu({p})");
        }
        assert_eq!(state, [3.0, 4.0]);
        let (mut s2, mut first, mut rest) = (vec![0.0f32; 2], vec![0.0f32; 3], vec![0.0f32; 1]);
        causal_conv_silu(&x[..3], 3, &taps, 3, &mut s2, &mut first);
        causal_conv_silu(&x[3..], 1, &taps, 3, &mut s2, &mut rest);
        assert_eq!([first.as_slice(), rest.as_slice()].concat(), out);
    }

    #[test]
    fn softplus_follows_torch() {
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
        assert!((softplus(-30.0) - (-30f32).exp()).abs() < 1e-20);
    }
}
