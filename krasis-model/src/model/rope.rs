//! Rotary tables from a [`RopeSpec`]: inverse frequencies (default, linear, YaRN) and per-position
//! cos/sin. Mirrors how transformers builds them: inverse frequencies and angles in f32, the
//! YaRN attention factor folded into cos/sin.

use crate::arch::yarn_get_mscale;
use crate::spec::{RopePairing, RopeScaling, RopeSpec};

pub struct RotaryTables {
    inv_freq: Vec<f32>,
    attention_factor: f32,
    pub pairing: RopePairing,
}

impl RotaryTables {
    pub fn new(spec: &RopeSpec) -> Self {
        let dim = spec.dim;
        let half = dim / 2;
        let base = spec.theta;
        let pos_freq = |i: usize| base.powf((2 * i) as f64 / dim as f64);
        let (inv_freq, attention_factor): (Vec<f64>, f64) = match spec.scaling {
            RopeScaling::None => ((0..half).map(|i| 1.0 / pos_freq(i)).collect(), 1.0),
            RopeScaling::Linear { factor } => ((0..half).map(|i| 1.0 / (factor * pos_freq(i))).collect(), 1.0),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let af = attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
                    (Some(m), Some(ma)) if m != 0.0 && ma != 0.0 => {
                        yarn_get_mscale(factor, m) / yarn_get_mscale(factor, ma)
                    }
                    _ => yarn_get_mscale(factor, 1.0),
                });
                let correction_dim =
                    |rot: f64| (dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln());
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let high = high.min(dim as f64 - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                let inv = (0..half)
                    .map(|i| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        let inv_extra = 1.0 / pos_freq(i);
                        let inv_inter = 1.0 / (factor * pos_freq(i));
                        inv_inter * (1.0 - extrapolation) + inv_extra * extrapolation
                    })
                    .collect();
                (inv, af)
            }
        };
        RotaryTables {
            inv_freq: inv_freq.iter().map(|&f| f as f32).collect(),
            attention_factor: attention_factor as f32,
            pairing: spec.pairing,
        }
    }

    pub fn half_dim(&self) -> usize {
        self.inv_freq.len()
    }

    /// cos and sin for position `pos`, each `half_dim` long.
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let angle = (pos as f32 * f) as f64;
            cos[i] = (angle.cos() as f32) * self.attention_factor;
            sin[i] = (angle.sin() as f32) * self.attention_factor;
        }
    }

    /// cos/sin for positions `start..start+n`, laid out `[n, half_dim]`.
    pub fn table(&self, start: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let h = self.half_dim();
        let (mut c, mut s) = (vec![0f32; n * h], vec![0f32; n * h]);
        for p in 0..n {
            self.cos_sin(start + p, &mut c[p * h..(p + 1) * h], &mut s[p * h..(p + 1) * h]);
        }
        (c, s)
    }
}
