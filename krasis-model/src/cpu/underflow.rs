//! Quantisation underflow over a cache build: weight groups too small for an f16 scale
//! ([`krasis_quant::group::Underflow`]: their precision is lost, down to zeros) counted over every
//! tensor quantised, and reported once, as a warning that counts them and names the first tensor
//! affected (in model order, whatever order the parallel build finished in). Quantisation keeps
//! what f16 can hold (subnormal scales included); only the unquantised (BF16) weights keep such
//! groups exact.

use std::sync::Mutex;

use krasis_quant::cpu_layout::{unpack, unpack_w13, PackedLayout};
use krasis_quant::group::{Underflow, UnderflowAt, MIN_SCALE};
use krasis_quant::{Bits, QuantizedMatrix};

use crate::cpu::dense_cache::{Planned, PlannedKind};
use crate::cpu::packed_ops::{kv_b_layouts, w13_layout};
use crate::cpu::quantized::dense_layout;

/// Counts of clamped groups over a build, with the first tensor affected.
#[derive(Default)]
pub struct UnderflowLog {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    total: Underflow,
    /// Tensors with at least one clamped group.
    tensors: u64,
    /// (order, tensor name, width, where): the affected tensor of the smallest order.
    first: Option<(u64, String, Bits, UnderflowAt)>,
}

impl UnderflowLog {
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts the groups of `m`, the tensor `name`; `order` ranks tensors in model order (the
    /// warning names the affected tensor of the smallest order).
    pub fn record(&self, order: u64, name: &str, m: &QuantizedMatrix) {
        let u = Underflow::of(m);
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.total.add(&u);
        if let Some(at) = u.first {
            s.tensors += 1;
            if s.first.as_ref().is_none_or(|(o, ..)| order < *o) {
                s.first = Some((order, name.to_string(), m.bits, at));
            }
        }
    }

    /// The gate, up and down of one routed expert (tensors `names`, e.g.
    /// `model.layers.3.mlp.experts.5.gate_proj.weight`, …) of MoE layer `li`.
    pub fn record_expert(&self, li: usize, e: usize, names: &[String; 3], q: &[QuantizedMatrix; 3]) {
        for (j, (m, name)) in q.iter().zip(names).enumerate() {
            let order = ((li as u64) << 34) | ((e as u64) << 2) | j as u64;
            self.record(order, name, m);
        }
    }

    /// Counts `count` packed matrices of `layout` laid back to back in `bytes` (a dense-weight
    /// cache entry; `w13` names a fused gate+up entry's two tensors, whose blocks interleave).
    /// Bytes that do not match the layout are not counted (the cache build reports those).
    pub fn record_packed(&self, order: u64, names: &[&str], bytes: &[u8], layout: &PackedLayout, count: usize) {
        let order = order << 34;
        if let [gate, up] = names {
            if let Ok((g, u)) = unpack_w13(bytes, layout) {
                self.record(order, gate, &g);
                self.record(order | 1, up, &u);
            }
            return;
        }
        let name = names.first().copied().unwrap_or("?");
        for (i, b) in bytes.chunks_exact(layout.bytes()).take(count).enumerate() {
            if let Ok(m) = unpack(b, layout) {
                let label = if count > 1 { format!("{name} (head {i})") } else { name.to_string() };
                self.record(order | i as u64, &label, &m);
            }
        }
    }

    /// Counts dense-weight cache entry `p` (number `index` of the plan) as built: `bytes` at
    /// `bits`, preferred group `group`.
    pub fn record_entry(&self, index: usize, p: &Planned, bytes: &[u8], bits: Bits, group: usize) {
        let order = index as u64;
        match &p.kind {
            PlannedKind::Linear(t) => {
                if let Ok(l) = dense_layout(t.shape[0], t.shape[1], bits, group, &p.name) {
                    self.record_packed(order, &[&t.name], bytes, &l, 1);
                }
            }
            PlannedKind::W13 { gate, up } => {
                if let Ok(l) = w13_layout(gate.shape[0], gate.shape[1], bits, group, &p.name) {
                    self.record_packed(order, &[&gate.name, &up.name], bytes, &l, 1);
                }
            }
            PlannedKind::KvB { dims, uk, .. } => {
                if let Some(l) = kv_b_layouts(dims, group) {
                    self.record_packed(order, &[&p.name], bytes, if *uk { &l.uk } else { &l.uv }, dims.heads);
                }
            }
        }
    }

    /// The counts so far.
    pub fn total(&self) -> Underflow {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).total
    }

    /// The warning for `what` (e.g. "the CPU expert cache"), or `None` when no group lost
    /// precision.
    pub fn warning(&self, what: &str) -> Option<String> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (_, name, bits, at) = s.first.as_ref()?;
        let t = &s.total;
        let qmax = bits.qmax();
        Some(format!(
            "{what}: {} of {} weight groups ({} tensors) are too small for an f16 scale (largest |w| below \
             {:.1e} at INT{}) and keep fewer than {qmax} levels; {} of them quantised to all zeros. First: \
             `{name}` row {} group {} keeps {} of {qmax} levels. Only unquantised (BF16) weights keep them exact",
            t.clamped,
            t.groups,
            s.tensors,
            qmax as f32 * MIN_SCALE.to_f32(),
            bits.bits(),
            t.zeroed,
            at.row,
            at.group,
            at.levels,
        ))
    }

    /// Emits [`UnderflowLog::warning`] as a `tracing` warning, when there is one.
    pub fn warn(&self, what: &str) {
        if let Some(w) = self.warning(what) {
            tracing::warn!("{w}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_quant::cpu_layout::{pack, pack_w13};
    use krasis_quant::group::{quantize, test_data};

    /// `rows × 64` weights of amplitude 0.5 with row `tiny_row`'s second group at `amp`.
    fn matrix(rows: usize, tiny_row: Option<usize>, amp: f32, bits: Bits, seed: u64) -> QuantizedMatrix {
        let mut w = test_data(rows * 64, seed, 0.5);
        if let Some(r) = tiny_row {
            w[r * 64 + 32..r * 64 + 64].copy_from_slice(&test_data(32, seed + 1, amp));
        }
        quantize(&w, rows, 64, bits, 32)
    }

    /// The gate, up and down names under `prefix`.
    fn names(prefix: &str) -> [String; 3] {
        ["gate_proj", "up_proj", "down_proj"].map(|p| format!("{prefix}.{p}.weight"))
    }

    #[test]
    fn warning_counts_groups_and_names_the_first_tensor_in_model_order() {
        let log = UnderflowLog::new();
        let clean = matrix(16, None, 0.0, Bits::Int8, 1);
        assert_eq!(log.warning("x"), None);
        // Recorded out of order, as parallel builders finish: layer 1 first, then layer 0.
        let q1 = [clean.clone(), matrix(16, Some(3), 1e-8, Bits::Int4, 2), clean.clone()];
        log.record_expert(1, 0, &names("model.layers.2.mlp.experts.0"), &q1);
        let q0 = [clean.clone(), clean.clone(), matrix(16, Some(5), 2e-7, Bits::Int8, 3)];
        log.record_expert(0, 7, &names("model.layers.1.mlp.experts.7"), &q0);
        let t = log.total();
        assert_eq!((t.groups, t.clamped, t.zeroed), (6 * 32, 2, 1));
        let w = log.warning("the CPU expert cache").expect("a warning");
        assert!(w.starts_with("the CPU expert cache: 2 of 192 weight groups (2 tensors)"), "{w}");
        assert!(w.contains("1 of them quantised to all zeros"), "{w}");
        assert!(w.contains("`model.layers.1.mlp.experts.7.down_proj.weight` row 5 group 1 keeps"), "{w}");
        assert!(w.contains("7.6e-6 at INT8"), "{w}");
    }

    /// Subnormal f16 scales (ideal scales between 2^-24 and 2^-14: groups of largest |w| from
    /// about 8e-6 to 8e-3 at INT8) reach the packed kernels intact: through [`QuantLinear`] (the
    /// active ISA's kernels, one row and a prompt-sized call) the product is that of the
    /// dequantised weights, not zeros.
    #[test]
    fn subnormal_scales_survive_the_packed_kernels() {
        use crate::cpu::quantized::QuantLinear;
        use crate::model::linear::{DenseLinear, LinearOp, MatrixData};
        use krasis_cpu::pool::{PoolPlan, WorkerPool};
        use krasis_quant::group::dequantize;
        let (rows, k) = (32, 256);
        // Row r has largest |w| about 2^-(9 + r % 8): scales 2^-16 .. 2^-23 at INT8.
        let w: Vec<f32> = test_data(rows * k, 21, 1.0)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 2f32.powi(-9 - (i / k % 8) as i32))
            .collect();
        let m = quantize(&w, rows, k, Bits::Int8, 128);
        let subnormal = m.scales.iter().filter(|s| s.to_f32() > 0.0 && s.to_f32() < 6.1e-5).count();
        assert!(subnormal >= m.scales.len() / 2, "{subnormal} subnormal scales");
        assert_eq!(Underflow::of(&m).clamped, 0);
        let deq = dequantize(&m);
        let pool = std::sync::Arc::new(WorkerPool::new(PoolPlan::simulated(1, 2)).expect("pool"));
        let lin = QuantLinear::from_dense(&DenseLinear::new(rows, k, MatrixData::Owned(w)), Bits::Int8, 128, pool, "w")
            .expect("packed");
        for t in [1usize, 64] {
            let x = test_data(t * k, 5, 1.0);
            let mut y = vec![0f32; t * rows];
            lin.forward(&x, t, &mut y);
            for i in 0..t {
                for r in 0..rows {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for c in 0..k {
                        let p = deq[r * k + c] as f64 * x[i * k + c] as f64;
                        want += p;
                        mag += p.abs();
                    }
                    let got = y[i * rows + r] as f64;
                    assert!(
                        mag > 0.0 && (got - want).abs() <= 0.02 * mag,
                        "t {t} token {i} row {r}: {got} vs {want} (Σ|·| {mag})"
                    );
                }
            }
        }
    }

    #[test]
    fn packed_entries_are_read_back() {
        let log = UnderflowLog::new();
        let m = matrix(32, Some(17), 2e-7, Bits::Int8, 4);
        let l = PackedLayout::of(&m);
        let two: Vec<u8> = [pack(&m), pack(&matrix(32, None, 0.0, Bits::Int8, 5))].concat();
        log.record_packed(4, &["kv_b"], &two, &l, 2);
        let (g, u) = (matrix(16, None, 0.0, Bits::Int4, 6), matrix(16, Some(9), 1e-8, Bits::Int4, 7));
        let (fused, l13) = pack_w13(&g, &u).expect("w13");
        log.record_packed(2, &["gate", "up"], &fused, &l13, 1);
        let t = log.total();
        assert_eq!((t.groups, t.clamped, t.zeroed), (64 + 64 + 32 + 32, 2, 1));
        let w = log.warning("the dense-weight cache").expect("a warning");
        assert!(w.contains("First: `up` row 9 group 1 keeps 0 of 7 levels"), "{w}");
    }
}
