//! `--device hybrid` (everything but the routed experts on the GPU; the routed experts INT8/INT4
//! from the expert cache on the CPU pool) against the HF oracle, every fixture. Rule (issue #8):
//! (1 − mean per-position cosine) ≤ 2 × the ideal quantisation's at those bits plus
//! 3 × (1 − transformers-BF16's mean cosine) plus 1e-4, and top-1 ≥ the ideal's − 0.1, on the
//! prefill logits. The decode steps (teacher-forced over the oracle's greedy ids, one hand-off per
//! MoE layer per token) are checked against the hybrid prefill over the same positions, and with
//! the reference f32 experts (`--cpu-expert-bits bf16`) the hybrid must match the whole-GPU path.
//!
//! Without a GPU every test prints "SKIPPED: no GPU" and passes; `KRASIS_REQUIRE_GPU=1` fails
//! instead.

use std::path::Path;

use krasis_model::cpu::quantized::WeightBits;
use krasis_model::gpu::{GpuExpertCache, GpuModel, GpuOptions, StreamFrom, StreamSplit};
use krasis_model::runtime::{HandoffStats, PinnedExperts, StreamSlots};
use krasis_tests::{cpu_experts, fidelity, gpu_fixture, quant_bound, GpuFixture};

/// KV tokens per session: the fixtures' prompts plus the decode steps fit easily.
const TEST_KV_TOKENS: usize = 512;

fn load(dir: &Path, bits: WeightBits, cache: &Path) -> GpuModel {
    let gpu = GpuOptions { kv_tokens: Some(TEST_KV_TOKENS), ..GpuOptions::default() };
    GpuModel::load_hybrid(dir, &gpu, &cpu_experts(bits, cache)).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// Prefill logits of the prompt, then teacher-forced decode steps, then the same positions by
/// one prefill call.
fn run(m: &GpuModel, prompt: &[u32], greedy: &[u32], steps: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let v = m.spec.vocab_size;
    let mut s = m.new_session().unwrap();
    let prefill = m.forward_logits(&mut s, prompt, true).unwrap();
    let mut decoded = prefill[prefill.len() - v..].to_vec();
    for &id in &greedy[..steps - 1] {
        decoded.extend(m.forward_logits(&mut s, &[id], false).unwrap());
    }
    let stats = s.handoff_stats();
    let moe_layers = m.spec.moe_layers().count() as u64;
    assert_eq!(stats.calls, moe_layers * steps as u64, "one hand-off per MoE layer per call");
    check_route_prediction(m, &stats, steps, moe_layers);
    let mut s2 = m.new_session().unwrap();
    let mut all = prompt.to_vec();
    all.extend_from_slice(&greedy[..steps - 1]);
    let l = m.forward_logits(&mut s2, &all, true).unwrap();
    (prefill, decoded, l[(prompt.len() - 1) * v..].to_vec())
}

/// The next-layer route prediction behind the expert pull: at most one per decode hand-off after
/// a call's first MoE layer (none with `KRASIS_EXPERT_PREFETCH_MB=0`), counted only when the
/// GPU's prediction was in before the CPU finished the layer before (tiny fixtures' CPU experts
/// can beat it), and, where any were made, right more often than chance. It only ever steers a
/// cache pull, but a broken one would silently cost that pull's benefit.
fn check_route_prediction(m: &GpuModel, stats: &HandoffStats, steps: usize, moe_layers: u64) {
    let Some(moe) = m.spec.moe.as_ref() else { return };
    let (k, e) = (moe.routing.top_k as u64, moe.n_routed_experts as u64);
    let off = std::env::var("KRASIS_EXPERT_PREFETCH_MB").is_ok_and(|v| v.trim() == "0");
    let most = if off { 0 } else { (steps as u64 - 1) * moe_layers.saturating_sub(1) * k };
    assert!(stats.predicted <= most, "{} routes predicted, at most {most} possible", stats.predicted);
    assert!(stats.predicted_hits <= stats.predicted);
    if stats.predicted > 0 {
        let rate = stats.predicted_hits as f64 / stats.predicted as f64;
        let chance = k as f64 / e as f64;
        eprintln!(
            "route prediction: {:.1}% of {} routes right (of {most} possible; chance {:.1}%)",
            100.0 * rate,
            stats.predicted,
            100.0 * chance
        );
        assert!(rate > chance, "route prediction {rate:.3} no better than chance {chance:.3}");
    } else {
        eprintln!("route prediction: none made in time (of {most} possible)");
    }
}

fn check(name: &str) {
    let Some(GpuFixture { root, dir, reference: r, vocab }) = gpu_fixture(name) else { return };
    let steps = r.greedy_logits.len() / vocab;
    let bf16 = quant_bound(&root, name, "bf16");
    let tmp = tempfile::tempdir().unwrap();
    for (kind, bits) in [("int8", WeightBits::Int8), ("int4", WeightBits::Int4)] {
        let ideal = quant_bound(&root, name, kind);
        let bar = 2.0 * (1.0 - ideal.mean_cos) + 3.0 * (1.0 - bf16.mean_cos) + 1e-4;
        let m = load(&dir, bits, tmp.path());
        let (prefill, decoded, by_prefill) = run(&m, &r.prompt_ids, &r.greedy_ids, steps);
        let f = fidelity(&prefill, &r.prefill_logits, vocab);
        let d = fidelity(&decoded, &by_prefill, vocab);
        let g = fidelity(&decoded, &r.greedy_logits, vocab);
        let p = fidelity(&by_prefill, &r.greedy_logits, vocab);
        eprintln!(
            "{name} hybrid {kind}: 1-cos {:.3e} (bar {bar:.3e}, ideal {:.3e}), top1 {:.2} (ideal {:.2}), min cos {:.5}; decode vs prefill path: mean cos {:.6}, top1 {:.2}; the oracle's greedy steps: decode 1-cos {:.3e} top1 {:.2}, prefill path 1-cos {:.3e} top1 {:.2}",
            1.0 - f.mean_cos,
            1.0 - ideal.mean_cos,
            f.top1,
            ideal.top1,
            f.min_cos,
            d.mean_cos,
            d.top1,
            1.0 - g.mean_cos,
            g.top1,
            1.0 - p.mean_cos,
            p.top1
        );
        assert!(1.0 - f.mean_cos <= bar, "{name} {kind}: 1 - mean cos {:.3e} > {bar:.3e}", 1.0 - f.mean_cos);
        assert!(f.top1 >= ideal.top1 - 0.1, "{name} {kind}: top-1 {:.2} < ideal {:.2} - 0.1", f.top1, ideal.top1);
        // The decode steps against the oracle's own greedy steps (HF, teacher-forced over the same
        // ids): no farther from them than this engine's prefill path over the same positions.
        let decode_bar = 2.0 * (1.0 - p.mean_cos) + bar;
        assert!(
            1.0 - g.mean_cos <= decode_bar,
            "{name} {kind}: decode vs the oracle's greedy steps 1 - mean cos {:.3e} > {decode_bar:.3e}",
            1.0 - g.mean_cos
        );
        assert!(
            g.top1 >= p.top1 - 0.1,
            "{name} {kind}: decode top-1 {:.2} < prefill path's {:.2} - 0.1",
            g.top1,
            p.top1
        );
        // The two attention forms (absorbed decode, expanded prefill) round differently, and a
        // near-tied route can flip between them at a position: dsv3-tiny INT4 0.9975; dsv2-grouped
        // INT8 0.9932 with the one-token decode kernel, whose steps are the *closer* to the
        // oracle's (1 - cos 1.4e-4 against 6.9e-3 with the general kernel, which agrees with the
        // prefill path's rounding). So this is a sanity bound; the check above is the fidelity one.
        assert!(d.mean_cos >= 0.99, "{name} {kind}: decode vs prefill path mean cos {:.6} < 0.99", d.mean_cos);
    }
    // The hand-off itself is exact: reference f32 experts on the host vs the whole model on the GPU.
    let hybrid = load(&dir, WeightBits::Bf16, tmp.path());
    let mut s = hybrid.new_session().unwrap();
    let h = hybrid.forward_logits(&mut s, &r.prompt_ids, true).unwrap();
    drop(hybrid);
    let gpu = GpuModel::load(&dir, &GpuOptions { kv_tokens: Some(TEST_KV_TOKENS), ..GpuOptions::default() }).unwrap();
    let mut s = gpu.new_session().unwrap();
    let g = gpu.forward_logits(&mut s, &r.prompt_ids, true).unwrap();
    let f = fidelity(&h, &g, vocab);
    let rel = krasis_tests::rel_l2(&h, &g);
    eprintln!(
        "{name} hybrid (reference experts) vs whole-GPU: mean cos {:.7}, top1 {:.2}, relative error {rel:.2e}",
        f.mean_cos, f.top1
    );
    assert!(f.mean_cos >= 0.999, "{name}: hybrid with reference experts vs whole-GPU mean cos {:.6}", f.mean_cos);
}

krasis_tests::per_fixture_tests!(check);

/// Hybrid prefill with the routed experts streamed to the GPU (`--gpu-expert-bits`, every prompt
/// long enough here) runs the same kernels on the same bytes as the whole model on the GPU with
/// those experts resident: the prefill logits must be identical, on a second prompt too (which
/// starts from the slot the first one prefetched). Decode stays on the CPU experts. Both sources
/// of streamed records: the GPU expert cache, and the CPU expert cache laid out on the device.
fn check_streamed(name: &str) {
    let Some(GpuFixture { dir, reference: r, vocab, .. }) = gpu_fixture(name) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let widths = [(krasis_quant::Bits::Int4, WeightBits::Int4), (krasis_quant::Bits::Int8, WeightBits::Int8)];
    for ((bits, cpu_bits), from) in
        widths.into_iter().flat_map(|w| [StreamFrom::GpuCache, StreamFrom::CpuCache].map(move |f| (w, f)))
    {
        let gpu = GpuOptions {
            kv_tokens: Some(TEST_KV_TOKENS),
            expert_bits: Some(bits),
            expert_cache: GpuExpertCache::In(Some(tmp.path().to_path_buf())),
            stream_min_tokens: 2,
            stream_split: StreamSplit::Share(1.0),
            stream_from: from,
            ..GpuOptions::default()
        };
        let cpu = cpu_experts(cpu_bits, tmp.path());
        let hybrid = GpuModel::load_hybrid(&dir, &gpu, &cpu).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        assert!(hybrid.log.iter().any(|l| l.contains("stream the routed experts")), "{:?}", hybrid.log);
        let from_cpu = hybrid.log.iter().any(|l| l.contains("from the CPU expert cache"));
        assert_eq!(from_cpu, from == StreamFrom::CpuCache, "{:?}", hybrid.log);
        let resident = GpuModel::load(&dir, &gpu).unwrap();
        let prompt = &r.prompt_ids;
        let second: Vec<u32> = prompt.iter().rev().copied().collect();
        for p in [prompt, &second, prompt] {
            let mut s = hybrid.new_session().unwrap();
            let streamed = hybrid.forward_logits(&mut s, p, true).unwrap();
            assert_eq!(s.handoff_stats().calls, 0, "{name}: a streamed prefill hands nothing to the CPU");
            let mut s2 = resident.new_session().unwrap();
            let want = resident.forward_logits(&mut s2, p, true).unwrap();
            assert_eq!(streamed.len(), p.len() * vocab);
            assert!(streamed == want, "{name} {bits:?} {from:?}: streamed prefill differs from resident experts");
            // A decode step after it runs the CPU experts (one hand-off per MoE layer).
            hybrid.forward_logits(&mut s, &[p[0]], false).unwrap();
            assert_eq!(s.handoff_stats().calls, hybrid.spec.moe_layers().count() as u64);
        }
        eprintln!("{name} {bits:?} from {from:?}: streamed prefill = resident experts, bit for bit");
    }
}

/// A split prefill (`StreamSplit::Share`): the GPU runs the first experts of every layer from the
/// streamed slots while the CPU runs the routes to the others. Both halves are the same quantised
/// experts computed the same way, so the logits must agree with the whole model on the GPU
/// (resident experts) and with the hybrid on CPU experts alone (relative error ≤ 1e-3, #9's bar
/// for a strategy; f32 summation order apart, the devices' expert outputs are the same); the CPU
/// must have served
/// every MoE layer of the prefill. A share of 0 is the plain CPU-expert prefill, bit for bit.
fn check_split(name: &str) {
    let Some(GpuFixture { dir, reference: r, vocab, .. }) = gpu_fixture(name) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cpu = cpu_experts(WeightBits::Int4, tmp.path());
    let opts = |split: StreamSplit| GpuOptions {
        kv_tokens: Some(TEST_KV_TOKENS),
        expert_bits: Some(krasis_quant::Bits::Int4),
        expert_cache: GpuExpertCache::In(Some(tmp.path().to_path_buf())),
        stream_min_tokens: 2,
        stream_split: split,
        ..GpuOptions::default()
    };
    let run = |m: &GpuModel| {
        let mut s = m.new_session().unwrap();
        let logits = m.forward_logits(&mut s, &r.prompt_ids, true).unwrap();
        (logits, s.handoff_stats().calls)
    };
    let moe_layers = |m: &GpuModel| m.spec.moe_layers().count() as u64;
    let resident = run(&GpuModel::load(&dir, &opts(StreamSplit::Share(1.0))).unwrap()).0;
    let cpu_only = {
        let m = GpuModel::load_hybrid(&dir, &GpuOptions { expert_bits: None, ..opts(StreamSplit::Measured) }, &cpu)
            .unwrap();
        run(&m).0
    };
    let rel = krasis_tests::rel_l2(&cpu_only, &resident);
    eprintln!("{name} CPU experts vs resident GPU experts: relative error {rel:.2e}");
    // #9's bar for a strategy: the logits of `persistent` within 1e-3 (the GPU's quantised
    // experts compute what the CPU's do).
    assert!(rel <= 1e-3, "{name}: CPU experts vs resident GPU experts: relative error {rel:.2e}");
    for share in [0.25, 0.5, 0.75] {
        let m = GpuModel::load_hybrid(&dir, &opts(StreamSplit::Share(share)), &cpu).unwrap();
        let (split, calls) = run(&m);
        assert_eq!(calls, moe_layers(&m), "{name} share {share}: the CPU serves every MoE layer of a split prefill");
        agrees_with_either(&format!("{name} split {share}"), &split, &resident, &cpu_only, vocab);
    }
    let m = GpuModel::load_hybrid(&dir, &opts(StreamSplit::Share(0.0)), &cpu).unwrap();
    assert!(run(&m).0 == cpu_only, "{name}: a share of 0 is the CPU-expert prefill");
}

/// GPU options with INT4 GPU experts from a cache under `cache` (resident on `--device gpu`).
fn int4_gpu_experts(cache: &Path) -> GpuOptions {
    GpuOptions {
        kv_tokens: Some(TEST_KV_TOKENS),
        expert_bits: Some(krasis_quant::Bits::Int4),
        expert_cache: GpuExpertCache::In(Some(cache.to_path_buf())),
        ..GpuOptions::default()
    }
}

/// Prefill logits of every position of the fixture's prompt, then three teacher-forced decode
/// steps' logits, and the session's hand-off counters.
fn prefill_and_three_steps(m: &GpuModel, r: &krasis_tests::Reference) -> (Vec<f32>, HandoffStats) {
    let mut s = m.new_session().unwrap();
    let mut l = m.forward_logits(&mut s, &r.prompt_ids, true).unwrap();
    for &id in &r.greedy_ids[..3] {
        l.extend(m.forward_logits(&mut s, &[id], false).unwrap());
    }
    (l, s.handoff_stats())
}

/// `logits` agree with both devices' runs of the same calls (mean cos ≥ 0.999, top-1 ≥ 0.9,
/// relative error ≤ 1e-3: #9's bar for a strategy): the resident GPU experts' and the CPU
/// experts'.
fn agrees_with_either(label: &str, logits: &[f32], resident: &[f32], cpu_only: &[f32], vocab: usize) {
    for (what, other) in [("resident GPU experts", resident), ("CPU experts", cpu_only)] {
        let f = fidelity(logits, other, vocab);
        let rel = krasis_tests::rel_l2(logits, other);
        eprintln!("{label} vs {what}: mean cos {:.6}, top1 {:.2}, relative error {rel:.2e}", f.mean_cos, f.top1);
        assert!(f.mean_cos >= 0.999 && f.top1 >= 0.9, "{label} vs {what}: {f:?}");
        assert!(rel <= 1e-3, "{label} vs {what}: relative error {rel:.2e}");
    }
}

/// `hot_cached_static`: the experts a heatmap ranks hottest pinned in VRAM, the CPU running the
/// others' routes beside them in every MoE layer, prefill and decode. Every expert pinned, the
/// logits are the resident GPU experts' (relative error ≤ 1e-3, #9's bar for a strategy); about
/// half of them, they agree with both devices within the same bar, as a split prefill does.
fn check_hot(name: &str) {
    use krasis_model::gpu::{CachePlan, CacheStrategy};
    use krasis_model::placement::heatmap::ExpertHeat;
    let Some(GpuFixture { dir, reference: r, vocab, .. }) = gpu_fixture(name) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cpu = cpu_experts(WeightBits::Int4, tmp.path());
    let resident_opts = int4_gpu_experts(tmp.path());
    let run = |m: &GpuModel| {
        let (l, h) = prefill_and_three_steps(m, &r);
        (l, h.calls)
    };
    let resident = run(&GpuModel::load(&dir, &resident_opts).unwrap()).0;
    let spec = GpuModel::load(&dir, &resident_opts).unwrap().spec.clone();
    // A skewed heatmap: expert e of layer l got (7e + 3l) mod 11 + 1 routes.
    let n = spec.routed_experts();
    let moe: Vec<usize> = spec.moe_layers().collect();
    let mut flat = vec![0u64; spec.num_layers * n];
    for &l in &moe {
        for e in 0..n {
            flat[l * n + e] = ((7 * e + 3 * l) % 11 + 1) as u64;
        }
    }
    let heat_path = tmp.path().join("heat.json");
    ExpertHeat::from_counts(name, spec.num_layers, n, 2, &flat).save(&heat_path).unwrap();
    let hot = |vram: Option<u64>| GpuOptions {
        cache: Some(CachePlan { strategy: CacheStrategy::HotCachedStatic, heatmap: Some(heat_path.clone()), vram }),
        stream_min_tokens: 1 << 20,
        ..resident_opts.clone()
    };
    let all = GpuModel::load_hybrid(&dir, &hot(None), &cpu).unwrap();
    let PinnedExperts { experts: pinned, bytes } = all.stats(None).pinned_experts.expect("hot_cached_static pins");
    assert_eq!(pinned, moe.len() * n, "{name}: the whole budget pins every expert");
    let (logits, calls) = run(&all);
    let rel = krasis_tests::rel_l2(&logits, &resident);
    eprintln!("{name} every expert pinned vs resident: relative error {rel:.2e}");
    assert!(rel <= 1e-3, "{name}: every expert pinned vs resident: relative error {rel:.2e}");
    assert_eq!(calls, 4 * moe.len() as u64, "{name}: the CPU is still handed every MoE layer");
    drop(all);
    let half = GpuModel::load_hybrid(&dir, &hot(Some(bytes as u64 / 2)), &cpu).unwrap();
    let p = half.stats(None).pinned_experts.unwrap().experts;
    assert!(p > 0 && p <= pinned / 2, "{name}: half the VRAM pins at most half ({p} of {pinned})");
    let cpu_only =
        run(&GpuModel::load_hybrid(&dir, &GpuOptions { expert_bits: None, ..resident_opts.clone() }, &cpu).unwrap()).0;
    let split = run(&half).0;
    agrees_with_either(&format!("{name} {p} of {pinned} pinned"), &split, &resident, &cpu_only, vocab);
}

#[test]
fn pinned_experts_agree_with_either_device() {
    for name in krasis_tests::FIXTURE_NAMES {
        check_hot(name);
    }
}

/// Decode's PCIe share (`GpuOptions::pcie_routes`): the GPU runs the last routes of each decode
/// token, reading those experts over PCIe from the CPU's page-locked INT4 records, while the CPU
/// runs the others. Every route that way, and one route, the prefill and three decode
/// steps agree with the resident GPU experts and with the CPU experts (relative error ≤ 1e-3,
/// top-1 ≥ 0.9, as a split prefill); the counters say the GPU ran exactly its routes of the
/// decode steps and none of the prefill's; a share of 0 is the CPU experts' run. `4a` records
/// the same, against the CPU's `4a` experts.
fn check_pcie(name: &str) {
    let Some(GpuFixture { dir, reference: r, vocab, .. }) = gpu_fixture(name) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cpu = cpu_experts(WeightBits::Int4, tmp.path());
    let resident_opts = int4_gpu_experts(tmp.path());
    let resident = prefill_and_three_steps(&GpuModel::load(&dir, &resident_opts).unwrap(), &r).0;
    let opts =
        |routes: Option<usize>| GpuOptions { pcie_routes: routes, stream_min_tokens: 1 << 20, ..resident_opts.clone() };
    let off = GpuModel::load_hybrid(&dir, &opts(Some(0)), &cpu).unwrap();
    let (cpu_only, h) = prefill_and_three_steps(&off, &r);
    assert_eq!(h.pcie_routes, 0, "{name}: pcie_routes 0 gives the GPU no routes");
    let k = off.spec.moe.as_ref().unwrap().routing.top_k;
    let moe = off.spec.moe_layers().count() as u64;
    drop(off);
    let default = GpuModel::load_hybrid(&dir, &opts(None), &cpu).unwrap();
    assert!(
        default.log.iter().any(|l| l.contains("PCIe share: the CPU alone is faster for experts this small")),
        "{name}: the default share of tiny experts is none, and the log says why: {:?}",
        default.log
    );
    drop(default);
    // Every route, and one (the tiny experts are far below the size the default share starts at).
    for g in [k, 1] {
        if g == 1 && k == 1 {
            continue;
        }
        let routes = Some(g);
        let m = GpuModel::load_hybrid(&dir, &opts(routes), &cpu).unwrap();
        assert!(m.log.iter().any(|l| l.contains("over PCIe from those records")), "{name}: {:?}", m.log);
        let (logits, h) = prefill_and_three_steps(&m, &r);
        assert_eq!(h.pcie_routes, 3 * moe * g as u64, "{name} {g} routes: the GPU's routes of three decode steps");
        agrees_with_either(&format!("{name} {g} of {k} routes over PCIe"), &logits, &resident, &cpu_only, vocab);
    }
    // `4a` records (asymmetric INT4 g32, the default for float checkpoints; prefill streams them
    // as INT8): the same routes over PCIe against the same hybrid with its CPU `4a` experts alone.
    let cpu4a = cpu_experts(WeightBits::Int4Asym, tmp.path());
    let asym = |routes: Option<usize>| GpuOptions {
        kv_tokens: Some(TEST_KV_TOKENS),
        expert_bits: Some(krasis_quant::Bits::Int8),
        expert_cache: GpuExpertCache::Off,
        stream_min_tokens: 1 << 20,
        pcie_routes: routes,
        ..GpuOptions::default()
    };
    let base = prefill_and_three_steps(&GpuModel::load_hybrid(&dir, &asym(Some(0)), &cpu4a).unwrap(), &r).0;
    for g in [k, 1] {
        let m = GpuModel::load_hybrid(&dir, &asym(Some(g)), &cpu4a).unwrap();
        assert!(m.log.iter().any(|l| l.contains("over PCIe from those records")), "{name} 4a: {:?}", m.log);
        let (logits, h) = prefill_and_three_steps(&m, &r);
        assert_eq!(h.pcie_routes, 3 * moe * g as u64, "{name} 4a {g} routes: the GPU's routes of three decode steps");
        let f = fidelity(&logits, &base, vocab);
        let rel = krasis_tests::rel_l2(&logits, &base);
        eprintln!("{name} 4a {g} of {k} routes over PCIe vs the CPU's 4a: mean cos {:.6}, top1 {:.2}, relative error {rel:.2e}", f.mean_cos, f.top1);
        assert!(
            f.mean_cos >= 0.999 && f.top1 >= 0.9 && rel <= 1e-3,
            "{name} 4a {g} routes over PCIe: {f:?}, rel {rel:.2e}"
        );
    }
}

#[test]
fn pcie_share_agrees_with_either_device() {
    for name in krasis_tests::FIXTURE_NAMES {
        check_pcie(name);
    }
}

#[test]
fn split_prefill_agrees_with_either_device() {
    for name in krasis_tests::FIXTURE_NAMES {
        check_split(name);
    }
}

#[test]
fn streamed_prefill_experts_equal_resident_ones() {
    for name in krasis_tests::FIXTURE_NAMES {
        check_streamed(name);
    }
}

/// `--cpu-expert-bits 4a` on the hybrid (the default on float experts): prefill streams the CPU
/// expert cache's own asymmetric records (one copy in RAM: the GPU expert cache is off here, so
/// nothing else could serve), requantised on the device to INT8 g32 (`krasis_gpu::relayout`),
/// while decode runs the `4a` records on the CPU. Against the same hybrid's prefill on the CPU's
/// `4a` experts, on every fixture:
/// - each position's logits within twice the relative error an ideal INT8 rounding of the experts
///   costs on that fixture (`√(2 (1 − cos))` of its quant_bounds entry) plus 5e-3 for the
///   devices' f32 orders, except at most a tenth of the positions: a route on a near tie may flip
///   (dsv3-tiny, on the H200: one position of 20 at 0.3, the others 5e-3 to 9e-3); a misplaced code
///   or scale moves every position;
/// - top-1 ≥ 0.9;
/// - no further from the oracle than the CPU's `4a` prefill plus 5 % (measured: 0.1 % to 1.2 %
///   further on five fixtures, closer on dsv3-tiny), and within the hybrid rule at INT4's bounds.
fn check_int4a_streamed(name: &str) {
    let Some(GpuFixture { root, dir, reference: r, vocab }) = gpu_fixture(name) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cpu = cpu_experts(WeightBits::Int4Asym, tmp.path());
    let gpu = GpuOptions {
        kv_tokens: Some(TEST_KV_TOKENS),
        expert_bits: Some(krasis_quant::Bits::Int8),
        expert_cache: GpuExpertCache::Off,
        stream_min_tokens: 2,
        stream_split: StreamSplit::Share(1.0),
        ..GpuOptions::default()
    };
    let hybrid = GpuModel::load_hybrid(&dir, &gpu, &cpu).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert!(hybrid.log.iter().any(|l| l.contains("from the CPU expert cache")), "{name}: {:?}", hybrid.log);
    let plain = GpuOptions { kv_tokens: Some(TEST_KV_TOKENS), ..GpuOptions::default() };
    let on_cpu = GpuModel::load_hybrid(&dir, &plain, &cpu).unwrap();
    let p = &r.prompt_ids;
    let mut s = hybrid.new_session().unwrap();
    let streamed = hybrid.forward_logits(&mut s, p, true).unwrap();
    assert_eq!(s.handoff_stats().calls, 0, "{name}: a streamed prefill hands nothing to the CPU");
    let mut s2 = on_cpu.new_session().unwrap();
    let want = on_cpu.forward_logits(&mut s2, p, true).unwrap();
    let f = fidelity(&streamed, &want, vocab);
    let int8 = quant_bound(&root, name, "int8");
    let rel_bar = 2.0 * (2.0 * (1.0 - int8.mean_cos)).sqrt() + 5e-3;
    let rows: Vec<f64> =
        streamed.chunks(vocab).zip(want.chunks(vocab)).map(|(a, b)| krasis_tests::rel_l2(a, b)).collect();
    let over = rows.iter().filter(|&&x| x > rel_bar).count();
    let worst = rows.iter().cloned().fold(0.0, f64::max);
    let (o, oc) = (fidelity(&streamed, &r.prefill_logits, vocab), fidelity(&want, &r.prefill_logits, vocab));
    eprintln!(
        "{name} 4a streamed as int8 g32 vs 4a on the CPU: {over} of {} positions over rel {rel_bar:.2e} (worst {worst:.2e}), \
         top-1 {:.3}; 1 - mean cos vs the oracle {:.3e} (the CPU's 4a {:.3e})",
        rows.len(),
        f.top1,
        1.0 - o.mean_cos,
        1.0 - oc.mean_cos
    );
    assert!(
        10 * over <= rows.len() && f.top1 >= 0.9,
        "{name}: {over} positions over rel {rel_bar:.2e}, top-1 {:.3}",
        f.top1
    );
    assert!(
        1.0 - o.mean_cos <= 1.05 * (1.0 - oc.mean_cos) + 1e-6,
        "{name}: the streamed 4a is further from the oracle ({:.3e}) than the CPU's 4a ({:.3e}) by over 5 %",
        1.0 - o.mean_cos,
        1.0 - oc.mean_cos
    );
    let (ideal, bf16) = (quant_bound(&root, name, "int4"), quant_bound(&root, name, "bf16"));
    let bar = 2.0 * (1.0 - ideal.mean_cos) + 3.0 * (1.0 - bf16.mean_cos) + 1e-4;
    assert!(1.0 - o.mean_cos <= bar, "{name}: 1 - mean cos {:.3e} vs the oracle, bar {bar:.3e}", 1.0 - o.mean_cos);
    // A decode step after it runs the CPU's 4a experts (one hand-off per MoE layer).
    hybrid.forward_logits(&mut s, &[p[0]], false).unwrap();
    assert_eq!(s.handoff_stats().calls, hybrid.spec.moe_layers().count() as u64);
}

#[test]
fn int4a_prefill_streams_its_one_copy_as_int8() {
    for name in krasis_tests::FIXTURE_NAMES {
        check_int4a_streamed(name);
    }
}

/// Streaming from the CPU expert cache (the default) needs the CPU experts at the GPU's width:
/// INT8 CPU experts with INT4 GPU experts stream the GPU expert cache instead, and say so, with
/// the same logits as the resident INT4 experts.
#[test]
fn cpu_records_at_another_width_stream_the_gpu_cache() {
    let name = krasis_tests::FIXTURE_NAMES[0];
    let Some(GpuFixture { dir, reference: r, .. }) = gpu_fixture(name) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let gpu = GpuOptions {
        kv_tokens: Some(TEST_KV_TOKENS),
        expert_bits: Some(krasis_quant::Bits::Int4),
        expert_cache: GpuExpertCache::In(Some(tmp.path().to_path_buf())),
        stream_min_tokens: 2,
        stream_split: StreamSplit::Share(1.0),
        ..GpuOptions::default()
    };
    assert_eq!(gpu.stream_from, StreamFrom::CpuCache, "the CPU cache is the default source");
    let hybrid = GpuModel::load_hybrid(&dir, &gpu, &cpu_experts(WeightBits::Int8, tmp.path())).unwrap();
    assert!(hybrid.log.iter().any(|l| l.contains("streaming the GPU expert cache instead")), "{:?}", hybrid.log);
    assert!(hybrid.log.iter().any(|l| l.contains("records in place")), "{:?}", hybrid.log);
    let mut s = hybrid.new_session().unwrap();
    let streamed = hybrid.forward_logits(&mut s, &r.prompt_ids, true).unwrap();
    let resident = GpuModel::load(&dir, &gpu).unwrap();
    let mut s = resident.new_session().unwrap();
    assert!(streamed == resident.forward_logits(&mut s, &r.prompt_ids, true).unwrap(), "{name}");
    // With the GPU expert cache off (library use), the CPU cache still streams at its own width,
    // and another width keeps prefill on the CPU with a line saying why.
    let off = GpuOptions { expert_cache: GpuExpertCache::Off, ..gpu.clone() };
    let m = GpuModel::load_hybrid(&dir, &off, &cpu_experts(WeightBits::Int4, tmp.path())).unwrap();
    assert!(m.log.iter().any(|l| l.contains("from the CPU expert cache")), "{:?}", m.log);
    let m = GpuModel::load_hybrid(&dir, &off, &cpu_experts(WeightBits::Int8, tmp.path())).unwrap();
    assert!(
        m.log.iter().any(|l| l.contains("prefill keeps the routed experts on the CPU") && l.contains("is off")),
        "{:?}",
        m.log
    );
}

/// `active_only`, `static_pin`, `weighted_pin` and `lru`: every route of a call below the
/// full-streaming length runs on the GPU from a pool of VRAM slots that the expert thread fills
/// with the experts the routes touch. Same kernels and records as the resident GPU experts, so the
/// logits must be theirs (#9's bar for a strategy: relative error ≤ 1e-3), prefill and decode,
/// also when a small `lru` pool evicts between layers; and the copies must be what each strategy
/// promises.
fn check_pool(name: &str) {
    use krasis_model::gpu::{CachePlan, CacheStrategy};
    use krasis_model::placement::heatmap::ExpertHeat;
    let Some(GpuFixture { dir, reference: r, .. }) = gpu_fixture(name) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cpu = cpu_experts(WeightBits::Int4, tmp.path());
    let resident_opts = int4_gpu_experts(tmp.path());
    let run = |m: &GpuModel| prefill_and_three_steps(m, &r);
    let resident_model = GpuModel::load(&dir, &resident_opts).unwrap();
    let resident = run(&resident_model).0;
    let spec = resident_model.spec.clone();
    drop(resident_model);
    let n = spec.routed_experts();
    let moe: Vec<usize> = spec.moe_layers().collect();
    let mut flat = vec![0u64; spec.num_layers * n];
    for &l in &moe {
        for e in 0..n {
            flat[l * n + e] = ((5 * e + l) % 9 + 1) as u64 * if e % 3 == 0 { 10 } else { 1 };
        }
    }
    let heat_path = tmp.path().join("heat.json");
    ExpertHeat::from_counts(name, spec.num_layers, n, 2, &flat).save(&heat_path).unwrap();
    let opts = |strategy: CacheStrategy, vram: Option<u64>| GpuOptions {
        cache: Some(CachePlan { strategy, heatmap: strategy.needs_heatmap().then(|| heat_path.clone()), vram }),
        stream_min_tokens: 1 << 20,
        ..resident_opts.clone()
    };
    let calls = 4 * moe.len() as u64;
    let mut record = 0;
    for (strategy, small) in [
        (CacheStrategy::ActiveOnly, false),
        (CacheStrategy::StaticPin, false),
        (CacheStrategy::WeightedPin, false),
        (CacheStrategy::Lru, false),
        (CacheStrategy::Lru, true),
    ] {
        // The pins: half of the experts (plus the copy slots). The small pool: one layer's experts
        // and two more, so layers evict each other.
        let half = moe.len() * n / 2;
        let vram = match strategy {
            CacheStrategy::StaticPin | CacheStrategy::WeightedPin => Some(((n + half) * record) as u64),
            _ => small.then_some(((n + 2) * record) as u64),
        };
        let m = GpuModel::load_hybrid(&dir, &opts(strategy, vram), &cpu)
            .unwrap_or_else(|e| panic!("{name} {}: {e}", strategy.name()));
        let pool = m.stats(None).expert_pool.expect("a pool strategy keeps a pool");
        record = pool.bytes / pool.slots;
        let (logits, h) = run(&m);
        let rel = krasis_tests::rel_l2(&logits, &resident);
        eprintln!(
            "{name} {}{}: {} slots ({} pinned), {} of {} touched experts copied; vs resident: relative error {rel:.2e}",
            strategy.name(),
            if small { " (small pool)" } else { "" },
            pool.slots,
            pool.pinned,
            h.copied,
            h.experts_read
        );
        assert!(rel <= 1e-3, "{name} {}: relative error {rel:.2e} against the resident experts", strategy.name());
        assert_eq!(h.calls, calls, "{name} {}: one hand-off per MoE layer per call", strategy.name());
        assert!(h.copied <= h.experts_read && h.experts_read > 0, "{name} {}: {h:?}", strategy.name());
        match strategy {
            CacheStrategy::ActiveOnly => {
                assert_eq!(pool.pinned, 0);
                assert_eq!(h.copied, h.experts_read, "{name}: active_only copies every touched expert every call");
            }
            CacheStrategy::StaticPin | CacheStrategy::WeightedPin => {
                assert_eq!(pool.pinned, half, "{name} {}: half the experts pinned", strategy.name());
                assert!(h.copied < h.experts_read, "{name} {}: pinned experts are not copied", strategy.name());
            }
            _ if !small => {
                assert!(pool.slots >= moe.len() * n, "{name}: the default budget holds every expert");
                // Each expert crosses PCIe at most once.
                assert!(h.copied <= (moe.len() * n) as u64, "{name} lru: {h:?}");
            }
            _ => assert_eq!(pool.slots, n + 2, "{name}: the small pool"),
        }
    }
}

#[test]
fn pooled_strategies_equal_the_resident_experts() {
    for name in krasis_tests::FIXTURE_NAMES {
        check_pool(name);
    }
}

/// `--cache-strategy chunked`: long prompts stream each layer's experts through two slots that
/// hold only a chunk of the layer (for GPUs that cannot hold two layers), the chunks' parts summed
/// into the layer's output. Chunks of one expert and of three (ragged: 16 = 5 × 3 + 1, 4 = 3 + 1)
/// must give the resident GPU experts' prefill logits within #9's 1e-3 (only the order of the
/// top-k sum differs).
fn check_chunked(name: &str) {
    use krasis_model::gpu::{CachePlan, CacheStrategy};
    let Some(GpuFixture { dir, reference: r, .. }) = gpu_fixture(name) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cpu = cpu_experts(WeightBits::Int4, tmp.path());
    let resident_opts = int4_gpu_experts(tmp.path());
    let prefill = |m: &GpuModel| {
        let mut s = m.new_session().unwrap();
        m.forward_logits(&mut s, &r.prompt_ids, true).unwrap()
    };
    let resident = prefill(&GpuModel::load(&dir, &resident_opts).unwrap());
    let chunked = |vram: u64| GpuOptions {
        cache: Some(CachePlan { strategy: CacheStrategy::Chunked, heatmap: None, vram: Some(vram) }),
        stream_min_tokens: 2,
        ..resident_opts.clone()
    };
    let one = GpuModel::load_hybrid(&dir, &chunked(1), &cpu).unwrap();
    let StreamSlots { experts_per_slot: per_slot, record_bytes: record } =
        one.stats(None).stream_slots.expect("the experts stream");
    assert_eq!(per_slot, 1, "{name}: a budget below one expert streams one at a time");
    let record = record.expect("records layout") as u64;
    let three = GpuModel::load_hybrid(&dir, &chunked(2 * 3 * record), &cpu).unwrap();
    assert_eq!(three.stats(None).stream_slots.unwrap().experts_per_slot, 3.min(three.spec.routed_experts()));
    for (what, m) in [("1-expert chunks", &one), ("3-expert chunks", &three)] {
        let rel = krasis_tests::rel_l2(&prefill(m), &resident);
        eprintln!("{name} {what}: prefill vs resident: relative error {rel:.2e}");
        assert!(rel <= 1e-3, "{name} {what}: relative error {rel:.2e} against the resident experts");
    }
}

#[test]
fn chunked_streaming_equals_the_resident_experts() {
    for name in krasis_tests::FIXTURE_NAMES {
        check_chunked(name);
    }
}
