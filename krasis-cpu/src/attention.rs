//! Causal softmax attention of new queries over a key/value cache (reference path, f32).
//!
//! One kernel serves both architectures: GQA passes per-head K and V; absorbed MLA passes a
//! single "head" whose key is `[latent ‖ rope key]` and whose value is the latent itself (both
//! views of the same cache rows, hence the separate strides).

use crate::isa;
use crate::linear::dot;

/// Keys and values of `len` cached positions.
#[derive(Clone, Copy, Debug)]
pub struct KvCacheView<'a> {
    pub k: &'a [f32],
    /// Floats between consecutive positions in `k`.
    pub k_stride: usize,
    pub v: &'a [f32],
    pub v_stride: usize,
    pub kv_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub len: usize,
}

/// `q`: `[tq, heads, k_dim]`; query `i` sits at absolute position `q_start + i` and sees cache
/// positions `0..=q_start + i`. Writes `out`: `[tq, heads, v_dim]`.
pub fn causal_attention(
    q: &[f32],
    tq: usize,
    heads: usize,
    q_start: usize,
    kv: &KvCacheView<'_>,
    scale: f32,
    out: &mut [f32],
) {
    assert!(heads.is_multiple_of(kv.kv_heads), "heads {heads} not a multiple of kv_heads {}", kv.kv_heads);
    assert_eq!(q.len(), tq * heads * kv.k_dim);
    assert_eq!(out.len(), tq * heads * kv.v_dim);
    assert!(q_start + tq <= kv.len, "queries reach position {} but cache holds {}", q_start + tq, kv.len);
    let group = heads / kv.kv_heads;
    let isa = isa::active();
    crate::par::for_each_chunk_mut(out, kv.v_dim, &|idx, o| {
        SCORES.with_borrow_mut(|scores| {
            let (i, h) = (idx / heads, idx % heads);
            let kvh = h / group;
            let qv = &q[idx * kv.k_dim..(idx + 1) * kv.k_dim];
            let visible = q_start + i + 1;
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for p in 0..visible {
                let k0 = p * kv.k_stride + kvh * kv.k_dim;
                let s = dot(isa, qv, &kv.k[k0..k0 + kv.k_dim]) * scale;
                max = max.max(s);
                scores.push(s);
            }
            let mut denom = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                denom += *s;
            }
            o.fill(0.0);
            for (p, &w) in scores.iter().enumerate() {
                let v0 = p * kv.v_stride + kvh * kv.v_dim;
                let w = w / denom;
                for (a, &b) in o.iter_mut().zip(&kv.v[v0..v0 + kv.v_dim]) {
                    *a += w * b;
                }
            }
        })
    });
}

thread_local! {
    /// Per-thread score buffer (grows to the longest context seen).
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Naive f64 twin.
    fn reference(q: &[f32], tq: usize, heads: usize, q_start: usize, kv: &KvCacheView, scale: f32) -> Vec<f32> {
        let group = heads / kv.kv_heads;
        let mut out = vec![0f32; tq * heads * kv.v_dim];
        for i in 0..tq {
            for h in 0..heads {
                let kvh = h / group;
                let qv = &q[(i * heads + h) * kv.k_dim..][..kv.k_dim];
                let s: Vec<f64> = (0..=q_start + i)
                    .map(|p| {
                        let k = &kv.k[p * kv.k_stride + kvh * kv.k_dim..][..kv.k_dim];
                        qv.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (p, w) in e.iter().enumerate() {
                    let v = &kv.v[p * kv.v_stride + kvh * kv.v_dim..][..kv.v_dim];
                    for d in 0..kv.v_dim {
                        out[(i * heads + h) * kv.v_dim + d] += (w / z * v[d] as f64) as f32;
                    }
                }
            }
        }
        out
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0).collect()
    }

    #[test]
    fn gqa_and_shared_latent_layouts_match_reference() {
        // GQA: 4 heads over 2 kv heads, 3 new queries after 5 cached positions.
        let (heads, kvh, dk, dv, len, tq) = (4, 2, 6, 5, 8, 3);
        let k = data(len * kvh * dk, 1);
        let v = data(len * kvh * dv, 2);
        let kv = KvCacheView {
            k: &k,
            k_stride: kvh * dk,
            v: &v,
            v_stride: kvh * dv,
            kv_heads: kvh,
            k_dim: dk,
            v_dim: dv,
            len,
        };
        let q = data(tq * heads * dk, 3);
        let mut out = vec![0f32; tq * heads * dv];
        causal_attention(&q, tq, heads, len - tq, &kv, 0.3, &mut out);
        let want = reference(&q, tq, heads, len - tq, &kv, 0.3);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        // Absorbed-MLA layout: value is a prefix of the key row.
        let (lat, rope) = (7, 3);
        let rows = data(len * (lat + rope), 4);
        let kv = KvCacheView {
            k: &rows,
            k_stride: lat + rope,
            v: &rows,
            v_stride: lat + rope,
            kv_heads: 1,
            k_dim: lat + rope,
            v_dim: lat,
            len,
        };
        let q = data(tq * heads * (lat + rope), 5);
        let mut out = vec![0f32; tq * heads * lat];
        causal_attention(&q, tq, heads, len - tq, &kv, 0.2, &mut out);
        let want = reference(&q, tq, heads, len - tq, &kv, 0.2);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}
