//! The gated delta rule of gated-DeltaNet layers (Qwen3-Next, Qwen3.5), per value head `h`
//! with state `S` `[dk, dv]` and, per token, a query `q` and key `k` (of the key head serving
//! `h`, already L2-normalised, `q` scaled), a value `v`, a log decay `g ≤ 0` and a write
//! strength `β`:
//!
//! ```text
//! S ← S · e^g;   S ← S + k ⊗ β (v − Sᵀk);   o = Sᵀq
//! ```
//!
//! Three forms, which agree: [`recurrent_f64`], the scalar twin in f64 that tests hold the others
//! to; [`recurrent`], the same steps in f32 (decode, and prefill of short prompts); and
//! [`chunked`], which processes `chunk` tokens at a time as matrix products (the WY form
//! transformers' `torch_chunk_gated_delta_rule` uses), carrying the state between chunks. A
//! prompt need not be a multiple of the chunk, and either form continues from the state the
//! other left.
//!
//! Layouts: `q`, `k` `[t, key_heads, dk]`; `v`, `out` `[t, value_heads, dv]`; `g`, `beta`
//! `[t, value_heads]`; `state` `[value_heads, dk, dv]`. Value head `h` reads key head
//! `h / (value_heads / key_heads)`.

/// The heads of one gated-DeltaNet layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaHeads {
    pub key_heads: usize,
    pub value_heads: usize,
    pub dk: usize,
    pub dv: usize,
}

impl DeltaHeads {
    /// The key head value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        h / (self.value_heads / self.key_heads)
    }

    /// Floats of the state of all value heads.
    pub fn state_len(&self) -> usize {
        self.value_heads * self.dk * self.dv
    }

    #[allow(clippy::too_many_arguments)]
    fn check(&self, t: usize, q: usize, k: usize, v: usize, g: usize, beta: usize, state: usize, out: usize) {
        assert!(self.key_heads > 0 && self.value_heads.is_multiple_of(self.key_heads), "value heads per key head");
        assert_eq!(q, t * self.key_heads * self.dk, "q is [t, key_heads, dk]");
        assert_eq!(k, q, "k is [t, key_heads, dk]");
        assert_eq!(v, t * self.value_heads * self.dv, "v is [t, value_heads, dv]");
        assert_eq!(out, v, "out is [t, value_heads, dv]");
        assert_eq!(g, t * self.value_heads, "g is [t, value_heads]");
        assert_eq!(beta, g, "beta is [t, value_heads]");
        assert_eq!(state, self.state_len(), "state is [value_heads, dk, dv]");
    }
}

/// The token-by-token rule in f64: the twin the faster forms are tested against.
#[allow(clippy::too_many_arguments)]
pub fn recurrent_f64(
    hd: &DeltaHeads,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    g: &[f64],
    beta: &[f64],
    state: &mut [f64],
    out: &mut [f64],
) {
    let t = g.len() / hd.value_heads.max(1);
    hd.check(t, q.len(), k.len(), v.len(), g.len(), beta.len(), state.len(), out.len());
    let (dk, dv, nk, nv) = (hd.dk, hd.dv, hd.key_heads, hd.value_heads);
    let mut kv = vec![0f64; dv];
    for i in 0..t {
        for h in 0..nv {
            let kh = hd.key_head(h);
            let (qi, ki) = (&q[(i * nk + kh) * dk..][..dk], &k[(i * nk + kh) * dk..][..dk]);
            let vi = &v[(i * nv + h) * dv..][..dv];
            let s = &mut state[h * dk * dv..][..dk * dv];
            let decay = g[i * nv + h].exp();
            s.iter_mut().for_each(|x| *x *= decay);
            kv.iter_mut().for_each(|x| *x = 0.0);
            for (a, row) in s.chunks_exact(dv).enumerate() {
                for (acc, &x) in kv.iter_mut().zip(row) {
                    *acc += x * ki[a];
                }
            }
            let b = beta[i * nv + h];
            for (acc, &x) in kv.iter_mut().zip(vi) {
                *acc = (x - *acc) * b;
            }
            for (a, row) in s.chunks_exact_mut(dv).enumerate() {
                for (x, &d) in row.iter_mut().zip(&kv) {
                    *x += ki[a] * d;
                }
            }
            let o = &mut out[(i * nv + h) * dv..][..dv];
            o.iter_mut().for_each(|x| *x = 0.0);
            for (a, row) in s.chunks_exact(dv).enumerate() {
                for (acc, &x) in o.iter_mut().zip(row) {
                    *acc += x * qi[a];
                }
            }
        }
    }
}

/// One value head's token-by-token steps over tokens `0..t` in f32, its output rows `[t, dv]`
/// into `out`.
#[allow(clippy::too_many_arguments)]
fn head_recurrent(
    hd: &DeltaHeads,
    h: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    s: &mut [f32],
    out: &mut [f32],
) {
    let (dk, dv, nk, nv) = (hd.dk, hd.dv, hd.key_heads, hd.value_heads);
    let kh = hd.key_head(h);
    let t = g.len() / nv;
    let mut kv = vec![0f32; dv];
    for i in 0..t {
        let (qi, ki) = (&q[(i * nk + kh) * dk..][..dk], &k[(i * nk + kh) * dk..][..dk]);
        let vi = &v[(i * nv + h) * dv..][..dv];
        let decay = g[i * nv + h].exp();
        kv.iter_mut().for_each(|x| *x = 0.0);
        for (a, row) in s.chunks_exact_mut(dv).enumerate() {
            let ka = ki[a];
            for (acc, x) in kv.iter_mut().zip(row.iter_mut()) {
                *x *= decay;
                *acc += *x * ka;
            }
        }
        let b = beta[i * nv + h];
        for (acc, &x) in kv.iter_mut().zip(vi) {
            *acc = (x - *acc) * b;
        }
        let o = &mut out[i * dv..][..dv];
        o.iter_mut().for_each(|x| *x = 0.0);
        for (a, row) in s.chunks_exact_mut(dv).enumerate() {
            let (ka, qa) = (ki[a], qi[a]);
            for ((x, &d), acc) in row.iter_mut().zip(&kv).zip(o.iter_mut()) {
                *x += ka * d;
                *acc += *x * qa;
            }
        }
    }
}

/// The token-by-token rule in f32, value heads in parallel (module docs for the layouts).
#[allow(clippy::too_many_arguments)]
pub fn recurrent(
    hd: &DeltaHeads,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    let t = g.len() / hd.value_heads.max(1);
    hd.check(t, q.len(), k.len(), v.len(), g.len(), beta.len(), state.len(), out.len());
    per_head(hd, t, state, out, &|h, s, o| head_recurrent(hd, h, q, k, v, g, beta, s, o));
}

/// Runs `f(h, state of h, out of h [t, dv])` for every value head in parallel, then puts each
/// head's rows in place in `out` `[t, value_heads, dv]`.
fn per_head(hd: &DeltaHeads, t: usize, state: &mut [f32], out: &mut [f32], f: &crate::par::PairTask<'_, f32, f32>) {
    let (nv, dv) = (hd.value_heads, hd.dv);
    if t == 0 || nv == 0 {
        return;
    }
    let mut heads_out = vec![0f32; nv * t * dv];
    crate::par::for_each_chunk_pair_mut(state, hd.dk * dv, &mut heads_out, t * dv, f);
    for (h, rows) in heads_out.chunks_exact(t * dv).enumerate() {
        for (i, row) in rows.chunks_exact(dv).enumerate() {
            out[(i * nv + h) * dv..][..dv].copy_from_slice(row);
        }
    }
}

/// One value head's chunked rule (the WY form) over tokens `0..t`, `chunk` at a time, its
/// output rows `[t, dv]` into `out`.
#[allow(clippy::too_many_arguments)]
fn head_chunked(
    hd: &DeltaHeads,
    h: usize,
    chunk: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    s: &mut [f32],
    out: &mut [f32],
) {
    let (dk, dv, nk, nv) = (hd.dk, hd.dv, hd.key_heads, hd.value_heads);
    let kh = hd.key_head(h);
    let t = g.len() / nv;
    let mut gc = vec![0f32; chunk]; // cumulative log decay within the chunk
    let mut a = vec![0f32; chunk * chunk]; // the (I + strictly-lower)⁻¹ system, then scores
    let mut u = vec![0f32; chunk * dv]; // β·v corrected by the chunk's own writes
    let mut w = vec![0f32; chunk * dk]; // decayed β·k, corrected likewise
    let mut vnew = vec![0f32; chunk * dv];
    let mut start = 0;
    while start < t {
        let c = chunk.min(t - start);
        let kr = |i: usize| &k[((start + i) * nk + kh) * dk..][..dk];
        let qr = |i: usize| &q[((start + i) * nk + kh) * dk..][..dk];
        let vr = |i: usize| &v[((start + i) * nv + h) * dv..][..dv];
        let at = |i: usize| (start + i) * nv + h;
        let mut acc = 0f32;
        for i in 0..c {
            acc += g[at(i)];
            gc[i] = acc;
        }
        // A[i][j] = −β_i (k_i · k_j) e^(G_i − G_j) for j < i; then forward substitution turns
        // the rows into (I − A)⁻¹'s, as transformers' loop does.
        for i in 0..c {
            for j in 0..i {
                let dot: f32 = kr(i).iter().zip(kr(j)).map(|(x, y)| x * y).sum();
                a[i * chunk + j] = -beta[at(i)] * dot * (gc[i] - gc[j]).exp();
            }
        }
        for i in 1..c {
            for j in 0..i {
                let mut add = 0f32;
                for m in j + 1..i {
                    add += a[i * chunk + m] * a[m * chunk + j];
                }
                a[i * chunk + j] += add;
            }
        }
        // u = T (β v), w = T (β k e^G), with T = A + I.
        for i in 0..c {
            let (bi, ei) = (beta[at(i)], gc[i].exp());
            let ui = &mut u[i * dv..][..dv];
            ui.iter_mut().zip(vr(i)).for_each(|(x, &y)| *x = bi * y);
            let wi = &mut w[i * dk..][..dk];
            wi.iter_mut().zip(kr(i)).for_each(|(x, &y)| *x = bi * y * ei);
            for j in 0..i {
                let (aij, bj, ej) = (a[i * chunk + j], beta[at(j)], gc[j].exp());
                let ui = &mut u[i * dv..][..dv];
                ui.iter_mut().zip(vr(j)).for_each(|(x, &y)| *x += aij * bj * y);
                let wi = &mut w[i * dk..][..dk];
                wi.iter_mut().zip(kr(j)).for_each(|(x, &y)| *x += aij * bj * y * ej);
            }
        }
        // v_new = u − w S; out = (q e^G) S + tril(q kᵀ e^(G_i − G_j)) v_new.
        for i in 0..c {
            let vn = &mut vnew[i * dv..][..dv];
            vn.copy_from_slice(&u[i * dv..][..dv]);
            let o = &mut out[(start + i) * dv..][..dv];
            o.iter_mut().for_each(|x| *x = 0.0);
            let (wi, qi, ei) = (&w[i * dk..][..dk], qr(i), gc[i].exp());
            for (r, row) in s.chunks_exact(dv).enumerate() {
                let (wr, qe) = (wi[r], qi[r] * ei);
                for ((x, acc), &sv) in vn.iter_mut().zip(o.iter_mut()).zip(row) {
                    *x -= wr * sv;
                    *acc += qe * sv;
                }
            }
        }
        for i in 0..c {
            for j in 0..=i {
                let dot: f32 = qr(i).iter().zip(kr(j)).map(|(x, y)| x * y).sum();
                let sc = dot * (gc[i] - gc[j]).exp();
                let o = &mut out[(start + i) * dv..][..dv];
                o.iter_mut().zip(&vnew[j * dv..][..dv]).for_each(|(x, &y)| *x += sc * y);
            }
        }
        // S ← S e^(G_last) + Σ_j k_j e^(G_last − G_j) ⊗ v_new_j.
        let last = gc[c - 1];
        let e = last.exp();
        s.iter_mut().for_each(|x| *x *= e);
        for j in 0..c {
            let kj = kr(j);
            let f = (last - gc[j]).exp();
            for (r, row) in s.chunks_exact_mut(dv).enumerate() {
                let kf = kj[r] * f;
                row.iter_mut().zip(&vnew[j * dv..][..dv]).for_each(|(x, &y)| *x += kf * y);
            }
        }
        start += c;
    }
}

/// The chunked rule in f32, `chunk` tokens at a time, value heads in parallel (module docs).
///
/// # Panics
/// If `chunk` is 0 or the slices disagree with `hd`.
#[allow(clippy::too_many_arguments)]
pub fn chunked(
    hd: &DeltaHeads,
    chunk: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    assert!(chunk > 0, "chunk must be positive");
    let t = g.len() / hd.value_heads.max(1);
    hd.check(t, q.len(), k.len(), v.len(), g.len(), beta.len(), state.len(), out.len());
    per_head(hd, t, state, out, &|h, s, o| head_chunked(hd, h, chunk, q, k, v, g, beta, s, o));
}

#[cfg(test)]
#[path = "delta_rule_tests.rs"]
mod tests;
