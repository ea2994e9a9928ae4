//! Routing rules: router logits → top-k (expert, weight) per token, as each architecture's
//! reference implementation defines them.

use crate::spec::{RoutingRule, ScoringFunc, TopkMethod};

/// Indices of the `k` largest values (ties: lower index first).
fn top_k_indices(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Keep only the experts of the `topk_group` best groups (others' choice scores become 0, as the
/// reference does with `masked_fill(…, 0.0)`).
fn mask_groups(choice: &mut [f32], n_group: usize, topk_group: usize, group_score: impl Fn(&[f32]) -> f32) {
    let per = choice.len() / n_group;
    let scores: Vec<f32> = choice.chunks(per).map(&group_score).collect();
    let keep = top_k_indices(&scores, topk_group);
    for (g, chunk) in choice.chunks_mut(per).enumerate() {
        if !keep.contains(&g) {
            chunk.fill(0.0);
        }
    }
}

/// Route one token. `bias` is `e_score_correction_bias` (noaux_tc only).
/// Returns (expert ids, weights), `rule.top_k` of each.
pub fn route(rule: &RoutingRule, logits: &[f32], bias: Option<&[f32]>) -> (Vec<usize>, Vec<f32>) {
    let scores: Vec<f32> = match rule.scoring {
        ScoringFunc::Softmax => {
            let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f64> = logits.iter().map(|&x| ((x - m) as f64).exp()).collect();
            let z: f64 = e.iter().sum();
            e.iter().map(|&x| (x / z) as f32).collect()
        }
        ScoringFunc::Sigmoid => logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect(),
    };
    let mut choice = scores.clone();
    match rule.topk {
        TopkMethod::Greedy => {}
        TopkMethod::GroupLimitedGreedy { n_group, topk_group } => {
            mask_groups(&mut choice, n_group, topk_group, |g| g.iter().cloned().fold(f32::NEG_INFINITY, f32::max));
        }
        TopkMethod::NoauxTc { n_group, topk_group } => {
            if let Some(b) = bias {
                for (c, &b) in choice.iter_mut().zip(b) {
                    *c += b;
                }
            }
            mask_groups(&mut choice, n_group, topk_group, |g| {
                let t = top_k_indices(g, 2);
                t.iter().map(|&i| g[i]).sum()
            });
        }
    }
    let ids = top_k_indices(&choice, rule.top_k);
    let mut w: Vec<f32> = ids.iter().map(|&i| scores[i]).collect();
    if rule.norm_topk_prob {
        let s: f32 = w.iter().sum();
        let denom = if matches!(rule.scoring, ScoringFunc::Sigmoid) { s + 1e-20 } else { s };
        for x in &mut w {
            *x /= denom;
        }
    }
    for x in &mut w {
        *x *= rule.routed_scaling_factor;
    }
    (ids, w)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(scoring: ScoringFunc, topk: TopkMethod, k: usize, norm: bool, scale: f32) -> RoutingRule {
        RoutingRule { scoring, topk, top_k: k, norm_topk_prob: norm, routed_scaling_factor: scale }
    }

    #[test]
    fn greedy_softmax_scaled() {
        let r = rule(ScoringFunc::Softmax, TopkMethod::Greedy, 2, false, 2.0);
        let (ids, w) = route(&r, &[0.0, 2.0, 1.0, -1.0], None);
        assert_eq!(ids, vec![1, 2]);
        let z: f32 = [0.0f32, 2.0, 1.0, -1.0].iter().map(|x| x.exp()).sum();
        assert!((w[0] - 2.0 * 2f32.exp() / z).abs() < 1e-6);
    }

    #[test]
    fn group_limited_skips_weak_groups() {
        // Groups {0,1}, {2,3}, {4,5}; group maxima 0.9, 0.8, 0.85 → keep groups 0 and 2.
        let r = rule(ScoringFunc::Softmax, TopkMethod::GroupLimitedGreedy { n_group: 3, topk_group: 2 }, 3, false, 1.0);
        let logits = [0.9f32, 0.7, 0.8, 0.79, 0.85, 0.1];
        let (ids, _) = route(&r, &logits, None);
        assert_eq!(ids, vec![0, 4, 1]);
    }

    #[test]
    fn noaux_tc_uses_bias_for_choice_not_weight() {
        let r = rule(ScoringFunc::Sigmoid, TopkMethod::NoauxTc { n_group: 2, topk_group: 1 }, 2, true, 2.5);
        let logits = [0.0f32, 0.0, 1.0, 1.0];
        // The bias pulls group 0 ahead although its raw scores are lower.
        let (ids, w) = route(&r, &logits, Some(&[1.0, 0.9, 0.0, 0.0]));
        assert_eq!(ids, vec![0, 1]);
        assert!((w[0] - 1.25).abs() < 1e-6 && (w[1] - 1.25).abs() < 1e-6);
    }
}
