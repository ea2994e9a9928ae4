//! `--cpu-expert-bits`: the width of each routed-expert projection in the CPU expert cache, and
//! what `auto` means. This is the one place the choice rule lives: the loaders, the RAM estimate,
//! `krasis info` and `krasis convert` all ask here.
//!
//! - **GGUF** (the spec carries each expert tensor's code bits): `auto` gives every projection
//!   INT4 when its source type is 4-bit or narrower (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K) and INT8 when it
//!   is 5/6/8-bit or float (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, F16, BF16, F32): a requantisation should
//!   not keep fewer bits than the source has, nor spend more than it has. The fused gate+up (w13)
//!   is one matrix, so it takes the wider of gate's and up's choice. llama.cpp's Q4_K_M stores
//!   `ffn_down_exps` in Q6_K in some layers and Q4_K in others, so the widths differ per layer.
//! - **safetensors** (no per-tensor types): `auto` is INT4 everywhere, the fast path (the
//!   reference experts over the source weights are the explicit `bf16`).
//!
//! - **4-bit float checkpoints** (ModelOpt NVFP4, OpenAI MXFP4; [`native_fp4`]): `auto` keeps the
//!   stored format in the CPU expert cache (codes and scales as stored, no requantisation, see
//!   `krasis_quant::fp4`); the cache's records are then that format, not INT4.
//!
//! - **GGUF K-quants** ([`ggml_kept`]): when every routed expert tensor is Q4_K, Q6_K, Q5_0 or
//!   Q8_0 (what llama.cpp's Q4_K_M writes: Q5_0 and Q8_0 where a row is no multiple of 256) and
//!   one is Q4_K, Q6_K or Q5_0, `auto` keeps them exactly: Q4_K and Q6_K blocks as stored
//!   (`krasis_quant::kquant`), Q5_0 and Q8_0 as the INT8 g32 of the same values; a fused w13
//!   whose gate and up are different K-quants is requantised to INT8 g32 (and the log says so).
//!
//! Explicit `4`, `8` and `bf16` mean what they always did, whatever the source (on a 4-bit float
//! checkpoint, `4` and `8` requantise from the exactly dequantised weights).
//!
//! The other defaults live here too: `--cpu-dense-bits auto` ([`resolve_dense_bits`]: INT8 on the
//! CPU path) and the GPU experts' default width ([`default_gpu_expert_bits`]).

use krasis_quant::fp4::Fp4Kind;
use krasis_quant::ggml::GgmlType;
use krasis_quant::kquant::KQuant;
use krasis_quant::Bits;

use crate::spec::{ModelSpec, WeightBits};

/// Widest source code (bits per weight) that `auto` keeps as INT4: Q2_K, Q3_K and the 4-bit types
/// carry no more than INT4 holds, while 5-bit and wider sources would lose bits in INT4.
pub const AUTO_INT4_MAX_SOURCE_BITS: u32 = 4;

/// The `auto` rule for one projection stored with `source_code_bits` bits per weight (see
/// `krasis_quant::ggml::GgmlType::code_bits`).
pub fn auto_bits(source_code_bits: u32) -> Bits {
    if source_code_bits <= AUTO_INT4_MAX_SOURCE_BITS {
        Bits::Int4
    } else {
        Bits::Int8
    }
}

/// The widths of one MoE layer's routed experts in the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerBits {
    /// Fused gate+up.
    pub w13: Bits,
    /// Down.
    pub w2: Bits,
}

impl LayerBits {
    pub fn uniform(bits: Bits) -> LayerBits {
        LayerBits { w13: bits, w2: bits }
    }
}

/// The rule that gives each MoE layer of an expert cache its widths ([`LayerBits`]): one width for
/// every projection, or `auto` (the module's rule, per projection from the source's types). Not an
/// option a caller sets: [`expert_width_rule`] derives it from the [`WeightBits`] option.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertWidthRule {
    Uniform(Bits),
    Auto,
    /// Asymmetric INT4 g32 in every projection (`krasis_quant::int4_asym`; its widths read as 4).
    Int4Asym,
}

impl ExpertWidthRule {
    /// The widths of every MoE layer of `spec`, in `moe_layers()` order.
    pub fn layer_bits(self, spec: &ModelSpec) -> Vec<LayerBits> {
        let layers = spec.moe_layers().count();
        match self {
            ExpertWidthRule::Uniform(b) => vec![LayerBits::uniform(b); layers],
            ExpertWidthRule::Int4Asym => vec![LayerBits::uniform(Bits::Int4); layers],
            ExpertWidthRule::Auto if ggml_kept(spec).is_some() => ggml_kept(spec)
                .expect("checked")
                .iter()
                .map(|l| LayerBits { w13: l.w13.bits(), w2: l.w2.bits() })
                .collect(),
            ExpertWidthRule::Auto if spec.expert_source_bits.len() == layers => spec
                .expert_source_bits
                .iter()
                .map(|&[gate, up, down]| LayerBits { w13: auto_bits(gate.max(up)), w2: auto_bits(down) })
                .collect(),
            ExpertWidthRule::Auto => vec![LayerBits::uniform(Bits::Int4); layers],
        }
    }
}

/// The width rule a CPU expert width ([`crate::cpu::load::EngineOptions::expert_bits`]) asks the cache
/// for (`None`: the reference experts over the source weights, no cache).
pub fn expert_width_rule(w: WeightBits) -> Option<ExpertWidthRule> {
    match w {
        WeightBits::Bf16 => None,
        WeightBits::Int8 => Some(ExpertWidthRule::Uniform(Bits::Int8)),
        WeightBits::Int4 => Some(ExpertWidthRule::Uniform(Bits::Int4)),
        WeightBits::Int4Asym => Some(ExpertWidthRule::Int4Asym),
        WeightBits::Auto => Some(ExpertWidthRule::Auto),
    }
}

/// The integer width an explicit `8` or `4` names (`None` for `bf16` and `auto`, which name no
/// single integer width, and for `4a`, which is no symmetric width).
pub fn quant_width(w: WeightBits) -> Option<Bits> {
    match w {
        WeightBits::Int8 => Some(Bits::Int8),
        WeightBits::Int4 => Some(Bits::Int4),
        WeightBits::Bf16 | WeightBits::Auto | WeightBits::Int4Asym => None,
    }
}

/// Whether `spec`'s weights carry a type per expert tensor (a GGUF), so `auto` is decided from them.
pub fn has_source_types(spec: &ModelSpec) -> bool {
    spec.moe.is_some() && spec.expert_source_bits.len() == spec.moe_layers().count()
}

/// The 4-bit float format `spec`'s checkpoint stores its quantised linears in (ModelOpt NVFP4,
/// OpenAI MXFP4), which `auto` keeps in the CPU expert cache.
pub fn native_fp4(spec: &ModelSpec) -> Option<Fp4Kind> {
    match spec.source_quant {
        crate::spec::SourceQuant::ModelOptNvfp4 => Some(Fp4Kind::Nvfp4),
        crate::spec::SourceQuant::Mxfp4 => Some(Fp4Kind::Mxfp4),
        _ => None,
    }
}

/// How `auto` holds one projection of a GGUF whose experts it keeps as stored ([`ggml_kept`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeptPart {
    /// Q4_K or Q6_K blocks as stored.
    KQuant(KQuant),
    /// INT8 in groups of 32: exactly the stored values of Q5_0 / Q8_0 blocks (`exact`), or a
    /// requantisation of the exact values (a fused w13 whose gate and up are different K-quants).
    Int8G32 { exact: bool },
}

impl KeptPart {
    /// The width the expert cache header records for it: 4 (Q4_K), 6 (Q6_K) or 8 (INT8 g32).
    pub fn code(self) -> u8 {
        match self {
            KeptPart::KQuant(KQuant::Q4K) => 4,
            KeptPart::KQuant(KQuant::Q6K) => 6,
            KeptPart::Int8G32 { .. } => 8,
        }
    }

    /// The part a header width [`KeptPart::code`] names (`exact` is not recorded: true).
    pub fn from_code(code: u8) -> Option<KeptPart> {
        match code {
            4 => Some(KeptPart::KQuant(KQuant::Q4K)),
            6 => Some(KeptPart::KQuant(KQuant::Q6K)),
            8 => Some(KeptPart::Int8G32 { exact: true }),
            _ => None,
        }
    }

    /// The integer width a requantisation of it keeps (the runner and RAM bookkeeping).
    pub fn bits(self) -> Bits {
        match self {
            KeptPart::KQuant(KQuant::Q4K) => Bits::Int4,
            _ => Bits::Int8,
        }
    }
}

impl std::fmt::Display for KeptPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeptPart::KQuant(k) => write!(f, "{k}"),
            KeptPart::Int8G32 { exact: true } => f.write_str("int8 g32 (exact)"),
            KeptPart::Int8G32 { exact: false } => f.write_str("int8 g32 (requantised)"),
        }
    }
}

/// One MoE layer of a GGUF whose experts `auto` keeps ([`ggml_kept`]): its stored types and how
/// its fused gate+up and its down are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerKept {
    pub types: [GgmlType; 3],
    pub w13: KeptPart,
    pub w2: KeptPart,
}

/// The ggml types whose blocks `auto` keeps exactly (the rule of the module docs).
const KEPT_TYPES: [GgmlType; 4] = [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q5_0, GgmlType::Q8_0];

/// How one stored type is kept.
fn kept_part(ty: GgmlType) -> KeptPart {
    match KQuant::of(ty) {
        Some(k) => KeptPart::KQuant(k),
        None => KeptPart::Int8G32 { exact: true },
    }
}

/// Per MoE layer, how `auto` keeps a GGUF's expert blocks as stored: `Some` when every routed
/// expert tensor is Q4_K, Q6_K, Q5_0 or Q8_0 and one is Q4_K, Q6_K or Q5_0 (see the module
/// docs), else `None` (the widths of [`auto_bits`] then requantise).
pub fn ggml_kept(spec: &ModelSpec) -> Option<Vec<LayerKept>> {
    if !has_source_types(spec) || spec.expert_source_types.len() != spec.expert_source_bits.len() {
        return None;
    }
    let types: Vec<[GgmlType; 3]> = spec
        .expert_source_types
        .iter()
        .map(|t| {
            let [g, u, d] = t.map(|id| GgmlType::from_id(id).ok());
            Some([g?, u?, d?])
        })
        .collect::<Option<_>>()?;
    let all = || types.iter().flatten();
    if !all().all(|t| KEPT_TYPES.contains(t)) || !all().any(|t| *t != GgmlType::Q8_0) {
        return None;
    }
    Some(
        types
            .into_iter()
            .map(|[g, u, d]| {
                let w13 = match (kept_part(g), kept_part(u)) {
                    (a, b) if a == b => a,
                    (KeptPart::Int8G32 { .. }, KeptPart::Int8G32 { .. }) => KeptPart::Int8G32 { exact: true },
                    _ => KeptPart::Int8G32 { exact: false },
                };
                LayerKept { types: [g, u, d], w13, w2: kept_part(d) }
            })
            .collect(),
    )
}

/// The kept layers for logs: `"ggml blocks as stored: w13 Q4_K / w2 Q6_K × 2 layers, …"`.
pub fn describe_kept(kept: &[(KeptPart, KeptPart)]) -> String {
    format!("GGUF blocks as stored: {}", krasis_cache::describe_layer_runs(kept, |(a, b)| format!("w13 {a} / w2 {b}")))
}

/// `--cpu-expert-bits` as an engine runs it on `spec`: `Auto` on weights without per-tensor
/// types (safetensors) becomes `Int4`, except on a 4-bit float checkpoint ([`native_fp4`]); on a
/// GGUF or a 4-bit float checkpoint it stays `Auto` (per projection; the stored format). Every
/// other value is kept.
pub fn resolve_expert_bits(spec: &ModelSpec, requested: WeightBits) -> WeightBits {
    match requested {
        WeightBits::Auto if !has_source_types(spec) && native_fp4(spec).is_none() => WeightBits::Int4,
        w => w,
    }
}

/// Whether `auto` runs `spec`'s routed experts on the CPU (the CPU engine's and the hybrid's) in
/// asymmetric INT4 g32 (`4a`, `krasis_quant::int4_asym`): a checkpoint of float experts (no GGUF
/// types, no 4-bit format kept as stored) whose dimensions that format takes. On the
/// trained-weights test it loses less perplexity than llama.cpp's Q4_K_M where INT4 g128 doubles
/// it, and its kernels stream at the bandwidth probe in decode (docs/BENCHMARKS.md). The hybrid
/// streams its records for prefill and the GPU requantises them to INT8 g32
/// ([`default_stream_bits`]); the whole-model GPU engine keeps INT4 g128 ([`default_gpu_expert_bits`]).
pub fn int4a_by_default(spec: &ModelSpec) -> bool {
    spec.moe.is_some()
        && !has_source_types(spec)
        && native_fp4(spec).is_none()
        && spec.source_quant.stored_int4_group().is_none()
        && crate::cpu::quantized::expected_int4_asym_cache_header(spec, 0).is_ok()
}

/// `--cpu-dense-bits` as the CPU engine runs it: `Auto` is INT8 (the dense weights' fast path;
/// INT8 keeps them within the oracle bounds the INT8 experts meet). Every other value is kept.
pub fn resolve_dense_bits(requested: WeightBits) -> WeightBits {
    match requested {
        WeightBits::Auto => WeightBits::Int8,
        w => w,
    }
}

/// The routed experts' width on the GPU when none is asked for: the source's own when it is 8-bit
/// (every expert projection of a GGUF in an 8-bit type, or FP8 blocks), else INT4 (BF16 sources,
/// 4-bit and mixed GGUF types: INT4 holds a 4-bit source's bits, and a third of BF16's VRAM).
pub fn default_gpu_expert_bits(spec: &ModelSpec) -> Bits {
    let all_8bit = has_source_types(spec) && spec.expert_source_bits.iter().flatten().all(|&b| b == 8);
    let fp8 = matches!(spec.source_quant, crate::spec::SourceQuant::Fp8Block { .. });
    if all_8bit || fp8 {
        Bits::Int8
    } else {
        Bits::Int4
    }
}

/// The width a hybrid prefill streams the experts at when none is asked for: the CPU experts'
/// own (`cpu`, resolved), so the CPU cache's records stream as they are; on a GGUF's per-projection
/// widths, [`default_gpu_expert_bits`]; on a GGUF whose K-quant blocks the CPU keeps
/// ([`ggml_kept`]), INT8, which the GPU cache requantises them to: a prompt's experts then stay
/// within INT8's rounding of the blocks the CPU decodes with (INT4 g128 of a trained model's
/// Q4_K_M cost 2× its perplexity, docs/BENCHMARKS.md), as the streamed INT8 records of Q5_0 / Q6_K
/// did before the blocks were kept; for asymmetric INT4 g32 (`4a`), INT8 g32, the form the device
/// requantises its records to after each copy (`krasis_gpu::relayout`). `None` with the reference
/// CPU experts (nothing to stream from).
pub fn default_stream_bits(spec: &ModelSpec, cpu: WeightBits) -> Option<Bits> {
    if cpu == WeightBits::Auto && ggml_kept(spec).is_some() {
        return Some(Bits::Int8);
    }
    match cpu {
        WeightBits::Int4 => Some(Bits::Int4),
        // The asymmetric records' GPU form: INT8 g32, requantised on the device after each copy
        // (`krasis_gpu::relayout`), so they stream from their one copy.
        WeightBits::Int4Asym => Some(Bits::Int8),
        WeightBits::Int8 => Some(Bits::Int8),
        WeightBits::Auto => Some(default_gpu_expert_bits(spec)),
        WeightBits::Bf16 => None,
    }
}

/// The widths `requested` gives every MoE layer of `spec` (`None`: no cache), for logs.
pub fn describe_expert_bits(spec: &ModelSpec, requested: WeightBits) -> String {
    match expert_width_rule(resolve_expert_bits(spec, requested)) {
        None => "reference (the source weights)".into(),
        Some(ExpertWidthRule::Auto) if native_fp4(spec).is_some() => {
            format!("{} (as stored)", native_fp4(spec).expect("checked"))
        }
        Some(ExpertWidthRule::Auto) if ggml_kept(spec).is_some() => {
            let kept = ggml_kept(spec).expect("checked");
            describe_kept(&kept.iter().map(|l| (l.w13, l.w2)).collect::<Vec<_>>())
        }
        Some(ExpertWidthRule::Int4Asym) => "int4a g32 (asymmetric)".into(),
        Some(c) => describe_layer_bits(&c.layer_bits(spec)),
    }
}

/// The per-layer widths for logs (`krasis_cache::describe_widths`: `"int4"`, or `"w13 int4 / w2
/// int8 × 10 layers, w13 int4 / w2 int4 × 16 layers"`).
pub fn describe_layer_bits(bits: &[LayerBits]) -> String {
    let widths: Vec<(u8, u8)> = bits.iter().map(|b| (b.w13.bits() as u8, b.w2.bits() as u8)).collect();
    krasis_cache::describe_widths(&widths)
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_quant::ggml::GgmlType;

    #[test]
    fn the_rule_follows_the_source_code_bits() {
        for ty in [GgmlType::Q2K, GgmlType::Q3K, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4K] {
            assert_eq!(auto_bits(ty.code_bits()), Bits::Int4, "{ty}");
        }
        for ty in [
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q5K,
            GgmlType::Q6K,
            GgmlType::Q8_0,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::F32,
        ] {
            assert_eq!(auto_bits(ty.code_bits()), Bits::Int8, "{ty}");
        }
    }

    /// Each option value names its kernel width, or none (`bf16`, and `auto` decided later), and
    /// the width rule of the CPU expert cache follows it.
    #[test]
    fn option_values_map_to_widths_and_rules() {
        assert_eq!(quant_width(WeightBits::Int8), Some(Bits::Int8));
        assert_eq!(quant_width(WeightBits::Int4), Some(Bits::Int4));
        assert_eq!(quant_width(WeightBits::Bf16), None);
        assert_eq!(quant_width(WeightBits::Auto), None);
        assert_eq!(expert_width_rule(WeightBits::Int8), Some(ExpertWidthRule::Uniform(Bits::Int8)));
        assert_eq!(expert_width_rule(WeightBits::Int4), Some(ExpertWidthRule::Uniform(Bits::Int4)));
        assert_eq!(expert_width_rule(WeightBits::Auto), Some(ExpertWidthRule::Auto));
        assert_eq!(expert_width_rule(WeightBits::Bf16), None);
    }

    fn tiny_spec() -> ModelSpec {
        let config = crate::synth::preset_config(crate::synth::Preset::Tiny, Some(4)).to_string();
        crate::arch::parse_config(&config, std::path::Path::new("config.json")).unwrap()
    }

    /// On a 4-bit float checkpoint `auto` stays `auto` (the CPU expert cache keeps the stored
    /// format); explicit widths are kept (they requantise).
    #[test]
    fn auto_keeps_a_native_fp4_format() {
        let mut spec = tiny_spec();
        for (q, kind) in [
            (crate::spec::SourceQuant::ModelOptNvfp4, Fp4Kind::Nvfp4),
            (crate::spec::SourceQuant::Mxfp4, Fp4Kind::Mxfp4),
        ] {
            spec.source_quant = q;
            assert_eq!(native_fp4(&spec), Some(kind));
            assert_eq!(resolve_expert_bits(&spec, WeightBits::Auto), WeightBits::Auto);
            assert_eq!(expert_width_rule(resolve_expert_bits(&spec, WeightBits::Auto)), Some(ExpertWidthRule::Auto));
            for w in [WeightBits::Bf16, WeightBits::Int8, WeightBits::Int4] {
                assert_eq!(resolve_expert_bits(&spec, w), w, "explicit values are kept");
            }
            assert_eq!(describe_expert_bits(&spec, WeightBits::Auto), format!("{kind} (as stored)"));
        }
    }

    /// `auto`'s CPU experts are asymmetric INT4 g32 on float experts only: not on a GGUF (its
    /// types decide), a 4-bit float or compressed-tensors INT4 checkpoint (kept as stored), a
    /// dense model, or widths the format's groups of 32 do not divide.
    #[test]
    fn int4a_is_the_cpu_default_on_float_experts_only() {
        let spec = tiny_spec();
        assert!(int4a_by_default(&spec));
        let with = |f: &dyn Fn(&mut ModelSpec)| {
            let mut s = tiny_spec();
            f(&mut s);
            int4a_by_default(&s)
        };
        assert!(!with(&|s| s.expert_source_bits = vec![[4, 4, 6]; 3]));
        assert!(!with(&|s| s.source_quant = crate::spec::SourceQuant::Mxfp4));
        assert!(!with(&|s| s.source_quant = crate::spec::SourceQuant::ModelOptNvfp4));
        assert!(!with(&|s| s.source_quant = crate::spec::SourceQuant::CompressedInt4 { group_size: 32 }));
        assert!(with(&|s| s.source_quant = crate::spec::SourceQuant::Fp8Block { block_rows: 128, block_cols: 128 }));
        assert!(!with(&|s| s.moe = None));
        assert!(!with(&|s| s.moe.as_mut().expect("MoE").moe_intermediate_size = 120));
        assert_eq!(describe_expert_bits(&spec, WeightBits::Int4Asym), "int4a g32 (asymmetric)");
    }

    /// On safetensors `auto` is INT4; on a GGUF it is per layer and projection, and the RAM
    /// estimate counts exactly the widths chosen.
    #[test]
    fn auto_follows_the_source() {
        let mut spec = tiny_spec();
        assert_eq!(spec.moe_layers().count(), 3);
        let (i4, i8) = (Bits::Int4, Bits::Int8);
        assert!(!has_source_types(&spec));
        assert_eq!(resolve_expert_bits(&spec, WeightBits::Auto), WeightBits::Int4);
        for w in [WeightBits::Bf16, WeightBits::Int8, WeightBits::Int4] {
            assert_eq!(resolve_expert_bits(&spec, w), w, "explicit values are kept");
        }
        assert_eq!(ExpertWidthRule::Auto.layer_bits(&spec), vec![LayerBits::uniform(i4); 3]);
        assert_eq!(describe_expert_bits(&spec, WeightBits::Auto), "int4");
        assert_eq!(describe_expert_bits(&spec, WeightBits::Bf16), "reference (the source weights)");
        let est = |spec: &ModelSpec, w| crate::cpu::memory::estimate(spec, w).expert_bytes;
        assert_eq!(est(&spec, WeightBits::Auto), est(&spec, WeightBits::Int4));

        // Q4_K_M-like: gate/up Q4_K, down Q6_K in the first MoE layer and Q4_K after; then a
        // layer whose gate is 4-bit but up 5-bit (w13 is one matrix: the wider wins).
        spec.expert_source_bits = vec![[4, 4, 6], [4, 4, 4], [4, 5, 4]];
        assert!(has_source_types(&spec));
        assert_eq!(resolve_expert_bits(&spec, WeightBits::Auto), WeightBits::Auto);
        assert_eq!(resolve_expert_bits(&spec, WeightBits::Int4), WeightBits::Int4);
        let want = vec![LayerBits { w13: i4, w2: i8 }, LayerBits::uniform(i4), LayerBits { w13: i8, w2: i4 }];
        assert_eq!(ExpertWidthRule::Auto.layer_bits(&spec), want);
        assert_eq!(ExpertWidthRule::Uniform(i8).layer_bits(&spec), vec![LayerBits::uniform(i8); 3]);
        assert_eq!(
            describe_expert_bits(&spec, WeightBits::Auto),
            "w13 int4 / w2 int8 × 1 layer, w13 int4 / w2 int4 × 1 layer, w13 int8 / w2 int4 × 1 layer"
        );
        // Estimate: per expert, w13 = 2·128·256 and w2 = 256·128 weights, each with one f16
        // scale per 128, in one record padded to 4 KiB (what the cache holds resident); 8 experts
        // per layer.
        let (w13, w2) = (2 * 128 * 256u64, 256 * 128u64);
        let int = |bits: u64, n: u64| n * bits / 8 + n / 128 * 2;
        let layer = |a: u64, b: u64| 8 * (int(a, w13) + int(b, w2)).next_multiple_of(4096);
        assert_eq!(est(&spec, WeightBits::Auto), layer(4, 8) + layer(4, 4) + layer(8, 4));
        assert!(est(&spec, WeightBits::Int4) < est(&spec, WeightBits::Auto));
        assert!(est(&spec, WeightBits::Auto) < est(&spec, WeightBits::Int8));
    }

    /// `auto` keeps a Q4_K_M file's experts: Q4_K / Q6_K as stored, Q5_0 / Q8_0 as exact INT8 g32,
    /// a w13 of two K-quants requantised; any other type (or Q8_0 alone) keeps the widths rule.
    #[test]
    fn auto_keeps_q4_k_m_types() {
        use GgmlType::{Q4K, Q4_0, Q5_0, Q6K, Q8_0};
        let mut spec = tiny_spec();
        let set = |spec: &mut ModelSpec, t: [[GgmlType; 3]; 3]| {
            spec.expert_source_types = t.iter().map(|l| l.map(GgmlType::id)).collect();
            spec.expert_source_bits = t.iter().map(|l| l.map(GgmlType::code_bits)).collect();
        };
        set(&mut spec, [[Q4K, Q4K, Q6K], [Q5_0, Q5_0, Q4K], [Q4K, Q6K, Q8_0]]);
        let kept = ggml_kept(&spec).expect("kept");
        let (q4, q6) = (KeptPart::KQuant(KQuant::Q4K), KeptPart::KQuant(KQuant::Q6K));
        let exact = KeptPart::Int8G32 { exact: true };
        let got: Vec<_> = kept.iter().map(|l| (l.w13, l.w2)).collect();
        assert_eq!(got, vec![(q4, q6), (exact, q4), (KeptPart::Int8G32 { exact: false }, exact)]);
        assert_eq!(
            describe_expert_bits(&spec, WeightBits::Auto),
            "GGUF blocks as stored: w13 Q4_K / w2 Q6_K × 1 layer, w13 int8 g32 (exact) / w2 Q4_K × 1 layer, \
             w13 int8 g32 (requantised) / w2 int8 g32 (exact) × 1 layer"
        );
        for p in [q4, q6, exact] {
            assert_eq!(KeptPart::from_code(p.code()), Some(p));
        }
        // The hybrid streams kept blocks' GPU cache at INT8 by default; explicit widths stream as themselves.
        assert_eq!(default_stream_bits(&spec, WeightBits::Auto), Some(Bits::Int8));
        assert_eq!(default_stream_bits(&spec, WeightBits::Int4), Some(Bits::Int4));
        assert_eq!(default_stream_bits(&spec, WeightBits::Int4Asym), Some(Bits::Int8), "4a streams as INT8 g32");
        assert_eq!(default_stream_bits(&spec, WeightBits::Bf16), None);
        set(&mut spec, [[Q4K, Q4K, Q6K], [Q4K, Q4K, Q4_0], [Q4K, Q4K, Q4K]]);
        assert!(ggml_kept(&spec).is_none(), "Q4_0 is not kept");
        assert_eq!(default_stream_bits(&spec, WeightBits::Auto), Some(Bits::Int4), "a mixed GGUF not kept: INT4");
        set(&mut spec, [[Q8_0; 3]; 3]);
        assert!(ggml_kept(&spec).is_none(), "all Q8_0 shares the INT8 cache");
        spec.expert_source_types.clear();
        assert!(ggml_kept(&spec).is_none(), "no types, nothing kept");
    }

    #[test]
    fn describe_counts_runs_of_layers() {
        let (i4, i8) = (LayerBits::uniform(Bits::Int4), LayerBits { w13: Bits::Int4, w2: Bits::Int8 });
        assert_eq!(describe_layer_bits(&[i4, i4]), "int4");
        assert_eq!(describe_layer_bits(&[LayerBits::uniform(Bits::Int8)]), "int8");
        assert_eq!(describe_layer_bits(&[i8, i4, i8]), "w13 int4 / w2 int8 × 2 layers, w13 int4 / w2 int4 × 1 layer");
    }
}
