//! A CPU expert cache whose layers mix widths (`--cpu-expert-bits auto` on a GGUF: w13 INT4 and
//! w2 INT8 in one layer, other widths in others), run through the CPU expert backend that the
//! CPU and hybrid engines share. No fixtures needed: a synthesized model.

use std::sync::Arc;

use krasis_cpu::pool::{PoolPlan, WorkerPool};
use krasis_model::cpu::experts::{ExpertExecutor, LayerExperts, ReferenceExperts, Routes};
use krasis_model::cpu::quantized::{open_expert_cache_with, CpuQuantExperts};
use krasis_model::model::weights::WeightLoader;
use krasis_model::placement::precision::LayerBits;
use krasis_model::source::files::ModelFiles;
use krasis_model::synth::{synthesize, Preset, SynthOptions};
use krasis_quant::Bits;
use krasis_tests::rel_l2;

/// A cache whose layers mix widths (w13 INT4 / w2 INT8, the reverse, both INT4) holds, per
/// layer and projection, exactly the bytes of the uniform cache of that width; each layer
/// runs on its own runner: bit for bit the uniform executor's output where the layer's
/// widths are uniform, and between the all-INT8 and the all-INT4 error against the f32
/// reference experts where they are mixed.
#[test]
fn mixed_width_cache_runs_each_layer_at_its_widths() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    synthesize(&SynthOptions { layers: Some(4), seed: 3, ..SynthOptions::new(Preset::Tiny, &model) }).unwrap();
    let files = ModelFiles::open(&model).unwrap();
    let spec = files.spec().clone();
    let layers: Vec<usize> = spec.moe_layers().collect();
    assert_eq!(layers.len(), 3);
    let pool = Arc::new(WorkerPool::new(PoolPlan::simulated(1, 2)).unwrap());
    let (i4, i8) = (Bits::Int4, Bits::Int8);
    let mixed = [LayerBits { w13: i4, w2: i8 }, LayerBits { w13: i8, w2: i4 }, LayerBits::uniform(i4)];
    let open = |bits: &[LayerBits]| {
        let (c, _) = open_expert_cache_with(&files, bits, 128, Some(dir.path()), &pool).unwrap();
        CpuQuantExperts::new(c, &spec, pool.clone()).unwrap()
    };
    let (mx, u4, u8) = (open(&mixed), open(&[LayerBits::uniform(i4); 3]), open(&[LayerBits::uniform(i8); 3]));
    assert!(mx.cache().path().ends_with("experts_cpu_mixed_g128.bin"), "{}", mx.cache().path().display());
    assert_eq!(mx.layer_bits(), &mixed);
    assert!(mx.describe().contains("w13 int4 / w2 int8 × 1 layer"), "{}", mx.describe());
    let of = |b: Bits| if b == i4 { &u4 } else { &u8 };
    for (li, b) in mixed.iter().enumerate() {
        for e in 0..8 {
            assert_eq!(mx.cache().w13(li, e), of(b.w13).cache().w13(li, e), "w13 of layer {li} expert {e}");
            assert_eq!(mx.cache().w2(li, e), of(b.w2).cache().w2(li, e), "w2 of layer {li} expert {e}");
        }
    }

    let (h, t, k) = (spec.hidden_size, 5, 2);
    let x: Vec<f32> = (0..t * h).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.5).collect();
    let mut routes = Routes::with_capacity(t, k);
    for tok in 0..t {
        routes.push(&[tok % 8, (3 * tok + 1) % 8], &[0.6, 0.4]);
    }
    let loader = WeightLoader::new(files.weights(), &spec.source_quant);
    let tensors = krasis_model::model::tensors::model_tensors(&spec);
    for (li, &layer) in layers.iter().enumerate() {
        let run = |ex: &CpuQuantExperts| {
            let mut out = vec![0f32; t * h];
            ex.run(layer, &x, t, &routes, &mut out);
            out
        };
        let got = run(&mx);
        let krasis_model::model::tensors::FfnTensors::Moe { experts, .. } = &tensors.layers[layer].ffn else {
            panic!("layer {layer} is not a MoE layer")
        };
        let reference = ReferenceExperts::load(&loader, h, experts).unwrap();
        let mut want = vec![0f32; t * h];
        reference.run(&x, t, &routes, &mut want);
        let err = rel_l2(&got, &want);
        let (e4, e8) = (rel_l2(&run(&u4), &want), rel_l2(&run(&u8), &want));
        eprintln!("layer {layer} {:?}: relative error {err:.3e} (all INT4 {e4:.3e}, all INT8 {e8:.3e})", mixed[li]);
        if mixed[li].w13 == mixed[li].w2 {
            assert_eq!(got, run(of(mixed[li].w13)), "layer {layer}: the uniform cache's output, bit for bit");
        } else {
            // One projection at INT8 and one at INT4: better than all INT4, worse than all INT8.
            assert!(e8 < err && err < e4, "layer {layer}: {err:.3e} is not between {e8:.3e} and {e4:.3e}");
        }
    }
}
