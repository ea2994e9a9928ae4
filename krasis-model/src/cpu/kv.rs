//! Per-layer KV cache of the reference path (f32, host memory). MLA caches the normalised latent
//! and the rotated rope key per position (`[kv_lora_rank + rope_dim]`), never expanded K/V.

use krasis_cpu::attention::KvCacheView;

pub struct LayerKv {
    /// Key rows, `k_width` floats per position.
    k: Vec<f32>,
    /// Value rows; empty when values are a prefix of the key rows (MLA).
    v: Vec<f32>,
    k_width: usize,
    v_width: usize,
    kv_heads: usize,
    len: usize,
}

impl LayerKv {
    pub fn separate(kv_heads: usize, head_dim: usize) -> Self {
        LayerKv { k: vec![], v: vec![], k_width: kv_heads * head_dim, v_width: kv_heads * head_dim, kv_heads, len: 0 }
    }

    /// One shared row per position whose first `latent` floats are the value.
    pub fn latent(row_width: usize, latent: usize) -> Self {
        LayerKv { k: vec![], v: vec![], k_width: row_width, v_width: latent, kv_heads: 1, len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn shared(&self) -> bool {
        self.v_width < self.k_width && self.kv_heads == 1 && self.v.is_empty()
    }

    /// Append `t` positions: `k` is `[t, k_width]`; `v` is `[t, v_width]` or `None` for latent rows.
    pub fn append(&mut self, k: &[f32], v: Option<&[f32]>) {
        debug_assert_eq!(k.len() % self.k_width, 0);
        let t = k.len() / self.k_width;
        self.k.extend_from_slice(k);
        if let Some(v) = v {
            debug_assert_eq!(v.len(), t * self.v_width);
            self.v.extend_from_slice(v);
        }
        self.len += t;
    }

    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 4
    }

    /// Gives back the rows' spare capacity (a kept prefix holds what it counts).
    pub fn shrink(&mut self) {
        self.k.shrink_to_fit();
        self.v.shrink_to_fit();
    }

    /// A copy holding positions `0..n` (`n` at most [`LayerKv::len`]).
    pub fn prefix(&self, n: usize) -> LayerKv {
        let n = n.min(self.len);
        let v = if self.v.is_empty() { vec![] } else { self.v[..n * self.v_width].to_vec() };
        LayerKv { k: self.k[..n * self.k_width].to_vec(), v, len: n, ..*self }
    }

    pub fn view(&self) -> KvCacheView<'_> {
        let head_k = self.k_width / self.kv_heads;
        if self.shared() {
            KvCacheView {
                k: &self.k,
                k_stride: self.k_width,
                v: &self.k,
                v_stride: self.k_width,
                kv_heads: 1,
                k_dim: self.k_width,
                v_dim: self.v_width,
                len: self.len,
            }
        } else {
            KvCacheView {
                k: &self.k,
                k_stride: self.k_width,
                v: &self.v,
                v_stride: self.v_width,
                kv_heads: self.kv_heads,
                k_dim: head_k,
                v_dim: self.v_width / self.kv_heads,
                len: self.len,
            }
        }
    }
}
