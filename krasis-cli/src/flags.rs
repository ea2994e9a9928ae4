//! The library's options by the CLI's flags.
//!
//! A library message names an option as its Rust path in backticks, such as
//! `` `GpuOptions::vram_budget` `` (a field of an options struct) or `` `DevicePolicy::Gpu` `` (one
//! of an option's values), so that a user of the library knows what to change. The CLI prints
//! every library message through [`with_flags`], which writes each such name as the flag that
//! sets it: a CLI user reads `--vram-budget` and `--device gpu`. Backticked text that is not in
//! [`OPTION_FLAGS`] (a file's metadata key, say) is printed as it is.
//!
//! `tests/tests/no_cli_flags.rs` checks that no library string names a flag itself, and that every
//! option a library string names in this form is in [`OPTION_FLAGS`].

use std::borrow::Cow;

/// Each option a library message may name, by its path, and what the CLI prints for it.
pub const OPTION_FLAGS: &[(&str, &str)] = &[
    // krasis_model::runtime::EngineConfig
    ("EngineConfig::device", "--device"),
    ("EngineConfig::gpu_expert_width", "--gpu-expert-bits"),
    ("EngineConfig::force", "--force"),
    ("EngineConfig::record_heatmap", "--heatmap-out"),
    ("DevicePolicy::Cpu", "--device cpu"),
    ("DevicePolicy::Gpu", "--device gpu"),
    ("DevicePolicy::Hybrid", "--device hybrid"),
    ("DevicePolicy::Auto", "--device auto"),
    // krasis_model::EngineOptions (the CPU engine)
    ("EngineOptions::expert_bits", "--cpu-expert-bits"),
    ("EngineOptions::dense_bits", "--cpu-dense-bits"),
    ("EngineOptions::group_size", "--group-size"),
    ("EngineOptions::cache_dir", "--cache-dir"),
    ("EngineOptions::threads", "--threads"),
    // krasis_model::gpu::GpuOptions and its parts
    ("GpuOptions::ordinal", "--gpu"),
    ("GpuOptions::vram_budget", "--vram-budget"),
    ("VramBudgetSpec::Auto", "--vram-budget auto"),
    ("GpuOptions::kv_dtype", "--kv-dtype"),
    ("KvDtype::Fp8", "--kv-dtype fp8"),
    ("GpuOptions::precision", "--gpu-precision"),
    ("GpuPrecision::F32", "--gpu-precision f32"),
    ("GpuOptions::invariant_prefill", "--invariant-prefill"),
    ("GpuOptions::pcie_routes", "--pcie-routes"),
    ("GpuOptions::kv_tokens", "--kv-tokens"),
    ("GpuOptions::expert_bits", "--gpu-expert-bits"),
    ("GpuOptions::expert_group_size", "--group-size"),
    ("GpuOptions::stream_from", "--stream-experts-from"),
    ("GpuOptions::cache", "--cache-strategy"),
    ("CachePlan::strategy", "--cache-strategy"),
    ("CachePlan::heatmap", "--heatmap-path"),
    ("CachePlan::vram", "--pin-vram"),
    // krasis_model::synth::SynthOptions
    ("SynthOptions::layers", "--layers"),
    ("SynthOptions::force", "--force"),
    // krasis_model::text::generate::GenerateRequest and the text codec
    ("GenerateRequest::prompt_ids", "--prompt-ids"),
    ("TextCodec::encode_chat", "--chat"),
];

/// `text` with each `` `Path::name` `` of [`OPTION_FLAGS`] written as its flag.
pub fn with_flags(text: &str) -> Cow<'_, str> {
    if !text.contains('`') {
        return Cow::Borrowed(text);
    }
    let mut out = text.to_string();
    for (option, flag) in OPTION_FLAGS {
        let named = format!("`{option}`");
        if out.contains(&named) {
            out = out.replace(&named, flag);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_become_flags_and_other_backticks_stay() {
        let msg = "the VRAM budget (`GpuOptions::vram_budget`) of 30 GiB is more than the 24 GiB free; \
                   use `VramBudgetSpec::Auto`; metadata `tokenizer.ggml.model` is missing";
        assert_eq!(
            with_flags(msg),
            "the VRAM budget (--vram-budget) of 30 GiB is more than the 24 GiB free; use --vram-budget auto; \
             metadata `tokenizer.ggml.model` is missing"
        );
        assert!(matches!(with_flags("no options here"), Cow::Borrowed(_)));
    }

    #[test]
    fn every_option_is_named_once_and_maps_to_a_flag() {
        for (i, (option, flag)) in OPTION_FLAGS.iter().enumerate() {
            assert!(option.contains("::") && !option.contains('`'), "{option}");
            assert!(flag.starts_with("--"), "{option} maps to {flag}");
            assert!(!OPTION_FLAGS[..i].iter().any(|(o, _)| o == option), "{option} is listed twice");
        }
    }

    /// Every flag of the table is one the CLI takes.
    #[test]
    fn every_flag_is_a_cli_flag() {
        use clap::CommandFactory;
        fn longs(c: &clap::Command, out: &mut Vec<String>) {
            out.extend(c.get_arguments().filter_map(|a| a.get_long().map(|l| format!("--{l}"))));
            c.get_subcommands().for_each(|s| longs(s, out));
        }
        let mut all = Vec::new();
        longs(&crate::Cli::command(), &mut all);
        for (option, flag) in OPTION_FLAGS {
            let name = flag.split(' ').next().expect("a flag");
            assert!(all.iter().any(|l| l == name), "{option} maps to {name}, which no subcommand takes");
        }
    }
}
