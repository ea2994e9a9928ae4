//! Developer tasks: `cargo xtask bench` (criterion microbenchmarks of the kernels, once per ISA
//! the host supports) and `cargo xtask ci` (what `.ci/run` runs, minus the environment set-up and
//! the NVRTC kernel check).

use std::process::Command;

use anyhow::{bail, Context};

fn cargo(args: &[&str], envs: &[(&str, &str)]) -> anyhow::Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!(
        "$ {} cargo {}",
        envs.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "),
        args.join(" ")
    );
    let status = Command::new(cargo).args(args).envs(envs.iter().copied()).status().context("running cargo")?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("bench") => {
            let extra: Vec<&str> = args[1..].iter().map(String::as_str).collect();
            // The quantised kernels take the ISA as a parameter and sweep every one the host
            // has; the pool dispatch bench compares with rayon.
            for bench in ["quant_matmul", "dispatch"] {
                let mut a = vec!["bench", "-p", "krasis-cpu", "--bench", bench, "--"];
                a.extend(&extra);
                cargo(&a, &[])?;
            }
            // MLA attention of one V2-Lite layer, absorbed against decompressed prefill.
            let mut a = vec!["bench", "-p", "krasis-model", "--bench", "mla_prefill", "--"];
            a.extend(&extra);
            cargo(&a, &[])?;
            // The dense f32 reference kernels pick their ISA once per process: one run per ISA.
            for isa in ["scalar", "avx2", "avx512"] {
                let mut a = vec!["bench", "-p", "krasis-cpu", "--bench", "dense", "--"];
                a.extend(&extra);
                cargo(&a, &[("KRASIS_ISA", isa)])?;
            }
            Ok(())
        }
        Some("ci") => {
            cargo(&["fmt", "--all", "--check"], &[])?;
            cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"], &[])?;
            cargo(&["doc", "--no-deps", "--workspace"], &[("RUSTDOCFLAGS", "-D warnings")])?;
            cargo(&["test", "--workspace"], &[])
        }
        _ => {
            eprintln!("usage: cargo xtask <bench [criterion args] | ci>");
            std::process::exit(2);
        }
    }
}
