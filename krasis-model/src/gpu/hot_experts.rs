//! `--cache-strategy hot_cached_static` (#9 item 4, the seeds' HCS): the routed experts a heatmap
//! says are used most stay in VRAM for the model's life, the others on the CPU, and every hybrid
//! MoE layer below the full-streaming length runs both at once — the GPU its pinned experts'
//! routes, the CPU the rest. No copies while serving: decode steps gain whatever share of the
//! routes the pinned experts receive; a short prompt that would stream a share of each layer
//! (the split prefill) takes the pinned experts instead where that leaves the CPU fewer experts to
//! read ([`HotLayer::beats_streaming`]).
//!
//! Which experts: the `(layer, expert)` pairs with the most routes in the heatmap, over every MoE
//! layer at once (the seeds' `static_pin` rule: a layer whose routes concentrate gets more), as
//! many as the VRAM given to pinning holds. A layer's pinned experts are stored renumbered
//! `0..present` ([`krasis_gpu::moe::GpuExperts::new_records_first`]); the routes published for
//! the hand-off are renumbered on the device with the layer's map (pinned experts first, in
//! pinned order, then the others), so the split layer's GPU kernels run exactly as for a
//! streamed share, and the CPU skips the pinned experts' routes.

use std::sync::Arc;

use krasis_gpu::moe::GpuExperts;
use krasis_gpu::{DeviceBuffer, GpuDevice};

use super::expert_stream::ExpertStreamer;
use crate::error::{ModelError, Result};
use crate::placement::heatmap::ExpertHeat;

/// One MoE layer's pinned experts.
pub struct HotLayer {
    /// The pinned experts, renumbered `0..present`.
    pub experts: GpuExperts,
    pub present: usize,
    /// Expert id → its number in `experts` (pinned ones `0..present`, the others after them).
    pub map: DeviceBuffer<i32>,
    /// Per expert id: whether it is pinned (the CPU leaves its routes to the GPU).
    pub on_gpu: Arc<[bool]>,
    /// Per expert id: its share of the layer's heatmap routes.
    pub route_share: Vec<f64>,
}

impl HotLayer {
    /// Whether a call of `t` tokens (`k` routes each) that would stream the layer's first
    /// `streamed` experts (a split prefill, whose copies take as long as the CPU's share) runs
    /// better on the pinned ones, which cost no copies: when the CPU then has no more experts to
    /// read. At a few tokens per expert the CPU's time follows the experts it touches, not the
    /// routes, so both are the expected count of touched experts it keeps, from the heatmap's
    /// route shares. Measured on the H200 box (v2-lite INT4): 16 tokens with 29 % of the experts
    /// pinned (57 % of the routes) 61–65 ms against 74–78 ms split; 64 tokens 134–161 ms against
    /// 116–134 ms split.
    pub fn beats_streaming(&self, streamed: usize, t: usize, k: usize) -> bool {
        pinned_beats_streaming(&self.route_share, &self.on_gpu, streamed, t, k)
    }
}

/// [`HotLayer::beats_streaming`] on a layer's route shares and pinned set.
pub fn pinned_beats_streaming(route_share: &[f64], on_gpu: &[bool], streamed: usize, t: usize, k: usize) -> bool {
    let draws = (t * k) as f64;
    let touched = |p: f64| 1.0 - (1.0 - p).powf(draws);
    let cpu_pinned: f64 = route_share.iter().zip(on_gpu).filter(|(_, &g)| !g).map(|(&p, _)| touched(p)).sum();
    let cpu_split: f64 = route_share.iter().skip(streamed).map(|&p| touched(p)).sum();
    cpu_pinned <= cpu_split
}

/// The pinned experts of every model layer (`None`: a dense layer, or nothing pinned there).
pub struct HotExperts {
    pub layers: Vec<Option<HotLayer>>,
    /// Experts pinned in all, and their VRAM.
    pub pinned: usize,
    pub bytes: usize,
    /// Share of the heatmap's routes that go to pinned experts.
    pub route_share: f64,
}

/// The `capacity` `(layer, expert)` pairs with the most routes in `heat` among `layers`' rows
/// (ties: lower layer, then lower id), as per-layer lists in ranked order; experts that never
/// received a route are not pinned.
pub fn choose_pinned(heat: &ExpertHeat, layers: &[usize], capacity: usize) -> Vec<Vec<usize>> {
    let mut all: Vec<(u64, usize, usize)> = Vec::new();
    for &l in layers {
        if let Some(row) = heat.counts.get(l) {
            all.extend(row.iter().enumerate().filter(|(_, &c)| c > 0).map(|(e, &c)| (c, l, e)));
        }
    }
    all.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut per_layer = vec![Vec::new(); heat.layers];
    for &(_, l, e) in all.iter().take(capacity) {
        per_layer[l].push(e);
    }
    per_layer
}

/// The seeds' `weighted_pin` rule: `capacity` pins shared out over `layers` in proportion to how
/// concentrated each layer's heatmap routes are (its skew, `1 − H / ln n` with `H` the entropy of
/// its route shares: 0 for uniform routes, 1 for one expert taking all), each layer then pinning
/// its own most-routed experts. Layers with equal skew share equally; a layer gets no more pins
/// than it has experts with routes, the rest going to the others. Per-layer lists in ranked order.
pub fn choose_weighted(heat: &ExpertHeat, layers: &[usize], capacity: usize) -> Vec<Vec<usize>> {
    let mut per_layer = vec![Vec::new(); heat.layers];
    let ranked: Vec<(usize, Vec<usize>, f64)> = layers
        .iter()
        .filter_map(|&l| heat.counts.get(l).map(|row| (l, row)))
        .map(|(l, row)| {
            let mut ids: Vec<usize> = (0..row.len()).filter(|&e| row[e] > 0).collect();
            ids.sort_by(|&a, &b| row[b].cmp(&row[a]).then(a.cmp(&b)));
            let total = row.iter().sum::<u64>() as f64;
            let h: f64 = row.iter().filter(|&&c| c > 0).map(|&c| c as f64 / total).map(|p| -p * p.ln()).sum();
            let skew = if row.len() > 1 { (1.0 - h / (row.len() as f64).ln()).max(0.0) } else { 0.0 };
            (l, ids, skew)
        })
        .collect();
    let room: usize = ranked.iter().map(|(_, ids, _)| ids.len()).sum();
    // Equal weights when no layer is skewed (so every layer still gets its share).
    let weight = |skew: f64| if ranked.iter().any(|r| r.2 > 0.0) { skew } else { 1.0 };
    let mut given = vec![0usize; ranked.len()];
    for _ in 0..capacity.min(room) {
        // The next pin goes to the layer furthest below its weighted share.
        let next = (0..ranked.len()).filter(|&i| given[i] < ranked[i].1.len()).max_by(|&a, &b| {
            let need = |i: usize| weight(ranked[i].2) / (given[i] + 1) as f64;
            need(a).total_cmp(&need(b)).then(b.cmp(&a))
        });
        match next {
            Some(i) => given[i] += 1,
            None => break,
        }
    }
    for ((l, ids, _), g) in ranked.into_iter().zip(given) {
        per_layer[l] = ids[..g].to_vec();
    }
    per_layer
}

/// Share of the heatmap's routes over `layers` that go to the `chosen` experts (per model layer,
/// as [`choose_pinned`] and [`choose_weighted`] return them).
pub fn chosen_route_share(heat: &ExpertHeat, layers: &[usize], chosen: &[Vec<usize>]) -> f64 {
    let total: u64 = layers.iter().filter_map(|&l| heat.counts.get(l)).flatten().sum();
    let hot: u64 = layers
        .iter()
        .filter_map(|&l| Some((chosen.get(l)?, heat.counts.get(l)?)))
        .flat_map(|(ids, row)| ids.iter().filter_map(|&e| row.get(e).copied()))
        .sum();
    hot as f64 / total.max(1) as f64
}

/// The id map of a layer of `n` experts whose `pinned` ones come first: `map[e]` is `e`'s number
/// in the renumbered order (the others keep their relative order after the pinned ones).
pub fn renumbering(n: usize, pinned: &[usize]) -> Vec<i32> {
    let mut map = vec![-1i32; n];
    for (j, &e) in pinned.iter().enumerate() {
        map[e] = j as i32;
    }
    for (next, m) in (pinned.len() as i32..).zip(map.iter_mut().filter(|m| **m < 0)) {
        *m = next;
    }
    map
}

impl HotExperts {
    /// Pins the experts `heat` ranks hottest into at most `vram` bytes, from `streamer`'s records.
    pub fn pin(
        dev: &GpuDevice,
        streamer: &ExpertStreamer,
        heat: &ExpertHeat,
        moe_layers: &[usize],
        vram: u64,
    ) -> Result<Self> {
        let Some(record) = streamer.record_bytes() else {
            return Err(ModelError::Invalid(
                "the cache strategy hot_cached_static (`CachePlan::strategy`): the GPU expert cache's layers differ in record geometry, so experts cannot be pinned one by one".into(),
            ));
        };
        let capacity = (vram / record.max(1) as u64) as usize;
        let chosen = choose_pinned(heat, moe_layers, capacity);
        let mut layers = Vec::with_capacity(heat.layers);
        let (mut pinned, mut bytes) = (0, 0);
        for (l, ids) in chosen.iter().enumerate() {
            let Some(li) = streamer.moe_layer(l).filter(|_| !ids.is_empty()) else {
                layers.push(None);
                continue;
            };
            let experts = streamer.pin(dev, li, ids)?;
            let n = heat.experts;
            let map = dev.upload(&renumbering(n, ids), &format!("pinned expert map of layer {l}"))?;
            let mut on_gpu = vec![false; n];
            ids.iter().for_each(|&e| on_gpu[e] = true);
            pinned += ids.len();
            bytes += experts.weight_bytes();
            let layer_all = heat.counts[l].iter().sum::<u64>().max(1) as f64;
            let route_share = heat.counts[l].iter().map(|&c| c as f64 / layer_all).collect();
            layers.push(Some(HotLayer { experts, present: ids.len(), map, on_gpu: on_gpu.into(), route_share }));
        }
        Ok(HotExperts { layers, pinned, bytes, route_share: chosen_route_share(heat, moe_layers, &chosen) })
    }

    /// One line for the load log.
    pub fn describe(&self, of: usize) -> String {
        if self.pinned == 0 {
            return "warning: hot_cached_static pinned no experts: the VRAM budget leaves no room for them after the weights, the stream slots, the KV cache and the prefill reserve (give the pinned experts' VRAM, `CachePlan::vram`, or raise the VRAM budget, `GpuOptions::vram_budget`)".into();
        }
        format!(
            "hot_cached_static: {} of {of} routed experts pinned in VRAM ({}), {:.1}% of the heatmap's routes; the CPU runs the rest beside them",
            self.pinned,
            krasis_core::budget::format_bytes(self.bytes as u64),
            100.0 * self.route_share
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heat(counts: Vec<Vec<u64>>) -> ExpertHeat {
        let (layers, experts) = (counts.len(), counts[0].len());
        let flat: Vec<u64> = counts.into_iter().flatten().collect();
        ExpertHeat::from_counts("m", layers, experts, 2, &flat)
    }

    #[test]
    fn pins_the_hottest_pairs_across_layers() {
        // Layer 0 is dense (zero row); layer 2 concentrates its routes.
        let h = heat(vec![vec![0, 0, 0, 0], vec![5, 9, 1, 0], vec![30, 2, 2, 2]]);
        assert_eq!(choose_pinned(&h, &[1, 2], 3), vec![vec![], vec![1, 0], vec![0]]);
        // Ties go to the lower layer, then the lower id; unused experts are never pinned.
        assert_eq!(choose_pinned(&h, &[1, 2], 6), vec![vec![], vec![1, 0], vec![0, 1, 2, 3]]);
        assert_eq!(choose_pinned(&h, &[1, 2], 100), vec![vec![], vec![1, 0, 2], vec![0, 1, 2, 3]]);
        assert_eq!(choose_pinned(&h, &[1, 2], 0), vec![Vec::<usize>::new(); 3]);
        // Only the layers asked for.
        assert_eq!(choose_pinned(&h, &[1], 2), vec![vec![], vec![1, 0], vec![]]);
        // Layer 1's 9 + 5 and layer 2's 30 of the 15 + 36 routes.
        let share = chosen_route_share(&h, &[1, 2], &choose_pinned(&h, &[1, 2], 3));
        assert!((share - 44.0 / 51.0).abs() < 1e-12, "{share}");
        assert_eq!(chosen_route_share(&h, &[1, 2], &[]), 0.0);
    }

    /// The measured cases (v2-lite, 64 experts, top-6): 18 of 64 experts pinned with 57 % of the
    /// routes beat the 16-token split (22 streamed) and lose to the 64-token one (33 streamed);
    /// 31 pinned with 77 % of the routes break even at 64 tokens; decode-sized calls never split.
    #[test]
    fn pinning_beats_streaming_where_the_cpu_keeps_fewer_experts() {
        let layer = |pinned: usize, share: f64| {
            let n = 64;
            let p: Vec<f64> = (0..n)
                .map(|e| if e < pinned { share / pinned as f64 } else { (1.0 - share) / (n - pinned) as f64 })
                .collect();
            // The pinned experts are the last ids, so the split's streamed prefix is not them.
            let on_gpu: Vec<bool> = (0..n).map(|e| e < pinned).rev().collect();
            let p: Vec<f64> = p.into_iter().rev().collect();
            (p, on_gpu)
        };
        let (p, g) = layer(18, 0.57);
        assert!(pinned_beats_streaming(&p, &g, 22, 16, 6));
        assert!(!pinned_beats_streaming(&p, &g, 33, 64, 6));
        let (p, g) = layer(31, 0.775);
        assert!(pinned_beats_streaming(&p, &g, 22, 16, 6));
        let (p, g) = layer(9, 0.36);
        assert!(!pinned_beats_streaming(&p, &g, 33, 64, 6));
        // Nothing pinned never beats a split that streams something; everything pinned always does.
        let (p, g) = layer(0, 0.0);
        assert!(!pinned_beats_streaming(&p, &g, 10, 64, 6));
        let (p, g) = layer(64, 1.0);
        assert!(pinned_beats_streaming(&p, &g, 60, 256, 6));
    }

    #[test]
    fn weighted_pins_follow_each_layers_skew() {
        // Layer 1 uniform (skew 0), layer 2 concentrated: it takes the pins.
        let h = heat(vec![vec![0, 0, 0, 0], vec![5, 5, 5, 5], vec![40, 3, 1, 0]]);
        assert_eq!(choose_weighted(&h, &[1, 2], 2), vec![vec![], vec![], vec![0, 1]]);
        // Layer 2 has only 3 experts with routes: the rest of the capacity goes to layer 1.
        let w = choose_weighted(&h, &[1, 2], 5);
        assert_eq!(w[2], vec![0, 1, 2]);
        assert_eq!(w[1].len(), 2);
        assert_eq!(choose_weighted(&h, &[1, 2], 100).iter().map(Vec::len).sum::<usize>(), 7);
        // Equally skewed layers share equally, and nothing is pinned without capacity.
        let h = heat(vec![vec![9, 1, 0, 0], vec![0, 0, 1, 9]]);
        assert_eq!(choose_weighted(&h, &[0, 1], 2), vec![vec![0], vec![3]]);
        assert_eq!(choose_weighted(&h, &[0, 1], 0), vec![Vec::<usize>::new(); 2]);
        // Uniform everywhere: equal shares rather than nothing.
        let h = heat(vec![vec![2, 2], vec![3, 3]]);
        assert_eq!(choose_weighted(&h, &[0, 1], 2).iter().map(Vec::len).collect::<Vec<_>>(), vec![1, 1]);
    }

    #[test]
    fn renumbering_puts_pinned_first_and_is_a_permutation() {
        let m = renumbering(6, &[4, 1]);
        assert_eq!(m, vec![2, 1, 3, 4, 0, 5]);
        let mut sorted = m.clone();
        sorted.sort();
        assert_eq!(sorted, (0..6).collect::<Vec<i32>>());
        assert_eq!(renumbering(3, &[]), vec![0, 1, 2]);
    }
}
