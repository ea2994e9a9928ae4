use proptest::prelude::*;

use super::*;

/// A layer's inputs as the op hands them to the rule: q and k L2-normalised (q also scaled by
/// dk^-1/2), decays g ≤ 0, β in (0, 1), and a non-zero starting state.
struct Case {
    hd: DeltaHeads,
    t: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
}

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn case(key_heads: usize, per_key: usize, dk: usize, dv: usize, t: usize, seed: u64) -> Case {
    let hd = DeltaHeads { key_heads, value_heads: key_heads * per_key, dk, dv };
    let mut s = seed | 1;
    let mut unit = |n: usize, scale: f32| -> Vec<f32> {
        let mut v: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
        for row in v.chunks_exact_mut(dk) {
            let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-3);
            row.iter_mut().for_each(|x| *x *= scale / norm);
        }
        v
    };
    let q = unit(t * key_heads * dk, (dk as f32).powf(-0.5));
    let k = unit(t * key_heads * dk, 1.0);
    let nv = hd.value_heads;
    let mut s2 = seed.wrapping_mul(31) | 1;
    let v = (0..t * nv * dv).map(|_| lcg(&mut s2)).collect();
    let g = (0..t * nv).map(|_| -1.5 * (lcg(&mut s2) + 1.0) / 2.0).collect();
    let beta = (0..t * nv).map(|_| 0.05 + 0.9 * (lcg(&mut s2) + 1.0) / 2.0).collect();
    let state = (0..hd.state_len()).map(|_| 0.5 * lcg(&mut s2)).collect();
    Case { hd, t, q, k, v, g, beta, state }
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// The f64 twin's output and final state.
fn twin(c: &Case) -> (Vec<f64>, Vec<f64>) {
    let mut state = f64s(&c.state);
    let mut out = vec![0f64; c.v.len()];
    recurrent_f64(&c.hd, &f64s(&c.q), &f64s(&c.k), &f64s(&c.v), &f64s(&c.g), &f64s(&c.beta), &mut state, &mut out);
    (out, state)
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(((g as f64) - w).abs() <= 2e-5 * scale + 1e-6, "{what}[{i}]: {g} vs {w} (scale {scale})");
    }
}

/// Tokens `range` of a case's per-token inputs.
fn tokens(c: &Case, r: std::ops::Range<usize>) -> [Vec<f32>; 5] {
    let (nk, nv, dk, dv) = (c.hd.key_heads, c.hd.value_heads, c.hd.dk, c.hd.dv);
    [
        c.q[r.start * nk * dk..r.end * nk * dk].to_vec(),
        c.k[r.start * nk * dk..r.end * nk * dk].to_vec(),
        c.v[r.start * nv * dv..r.end * nv * dv].to_vec(),
        c.g[r.start * nv..r.end * nv].to_vec(),
        c.beta[r.start * nv..r.end * nv].to_vec(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The f32 recurrence and the chunked form (any chunk size, prompts that are not a multiple
    /// of it) match the f64 twin, output and final state.
    #[test]
    fn recurrent_and_chunked_match_the_f64_twin(
        key_heads in 1usize..3, per_key in 1usize..3, dk in 1usize..10, dv in 1usize..10,
        t in 0usize..40, chunk in 1usize..17, seed in any::<u64>(),
    ) {
        let c = case(key_heads, per_key, dk, dv, t, seed);
        let (want, want_state) = twin(&c);
        let mut state = c.state.clone();
        let mut out = vec![0f32; c.v.len()];
        recurrent(&c.hd, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut state, &mut out);
        assert_close(&out, &want, "recurrent out");
        assert_close(&state, &want_state, "recurrent state");
        let mut state = c.state.clone();
        let mut out = vec![0f32; c.v.len()];
        chunked(&c.hd, chunk, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut state, &mut out);
        assert_close(&out, &want, "chunked out");
        assert_close(&state, &want_state, "chunked state");
    }

    /// A decode continuing from a chunked prefill (and a chunked run continuing from decoded
    /// tokens) gives what one pass over all tokens gives.
    #[test]
    fn decode_continues_from_a_chunked_prefill(
        dk in 1usize..9, dv in 1usize..9, t in 2usize..30, split in 1usize..29, chunk in 1usize..9,
        seed in any::<u64>(),
    ) {
        let split = split.min(t - 1);
        let c = case(2, 2, dk, dv, t, seed);
        let (want, want_state) = twin(&c);
        let mut state = c.state.clone();
        let mut out = vec![0f32; c.v.len()];
        let cut = split * c.hd.value_heads * dv;
        let [q, k, v, g, b] = tokens(&c, 0..split);
        chunked(&c.hd, chunk, &q, &k, &v, &g, &b, &mut state, &mut out[..cut]);
        for i in split..t {
            let [q, k, v, g, b] = tokens(&c, i..i + 1);
            let at = i * c.hd.value_heads * dv;
            recurrent(&c.hd, &q, &k, &v, &g, &b, &mut state, &mut out[at..at + c.hd.value_heads * dv]);
        }
        assert_close(&out, &want, "prefill then decode");
        assert_close(&state, &want_state, "state after decode");
    }
}

/// A hand-checked step: one head, dk = dv = 1, zero state: S = k β v, o = S q.
#[test]
fn one_step_by_hand() {
    let hd = DeltaHeads { key_heads: 1, value_heads: 1, dk: 1, dv: 1 };
    let (mut state, mut out) = (vec![0.0f32], vec![0.0f32]);
    recurrent(&hd, &[0.5], &[1.0], &[2.0], &[-0.1], &[0.25], &mut state, &mut out);
    assert!((state[0] - 0.5).abs() < 1e-7 && (out[0] - 0.25).abs() < 1e-7, "{state:?} {out:?}");
    // A second token decays the state first: S = 0.5 e^-1 + 1 · 0.25 (2 − 0.5 e^-1).
    let s1 = 0.5 * (-1f32).exp();
    recurrent(&hd, &[1.0], &[1.0], &[2.0], &[-1.0], &[0.25], &mut state, &mut out);
    let want = s1 + 0.25 * (2.0 - s1);
    assert!((state[0] - want).abs() < 1e-6 && (out[0] - want).abs() < 1e-6);
}

/// Value heads read their own key head: with two key heads and two value heads each, heads 0–1
/// use key head 0 and heads 2–3 key head 1.
#[test]
fn value_heads_share_their_key_head() {
    let hd = DeltaHeads { key_heads: 2, value_heads: 4, dk: 2, dv: 1 };
    assert_eq!((0..4).map(|h| hd.key_head(h)).collect::<Vec<_>>(), [0, 0, 1, 1]);
    let c = case(2, 2, 3, 2, 5, 7);
    let (want, _) = twin(&c);
    // Swapping the key heads' inputs swaps the value heads' outputs in pairs.
    let swap = |x: &[f32]| -> Vec<f32> {
        x.chunks_exact(2 * 3).flat_map(|r| r[3..].iter().chain(&r[..3]).copied().collect::<Vec<_>>()).collect()
    };
    let swap_v = |x: &[f32], w: usize| -> Vec<f32> {
        x.chunks_exact(4 * w).flat_map(|r| r[2 * w..].iter().chain(&r[..2 * w]).copied().collect::<Vec<_>>()).collect()
    };
    let swapped = Case {
        hd: c.hd,
        t: c.t,
        q: swap(&c.q),
        k: swap(&c.k),
        v: swap_v(&c.v, 2),
        g: swap_v(&c.g, 1),
        beta: swap_v(&c.beta, 1),
        state: {
            let n = 3 * 2;
            let s = &c.state;
            [&s[2 * n..], &s[..2 * n]].concat()
        },
    };
    let (got, _) = twin(&swapped);
    let back: Vec<f64> =
        got.chunks_exact(8).flat_map(|r| r[4..].iter().chain(&r[..4]).copied().collect::<Vec<_>>()).collect();
    for (a, b) in back.iter().zip(&want) {
        assert!((a - b).abs() < 1e-12);
    }
}
