//! Developer tasks: `cargo xtask test` (`cargo test --workspace` ending in a one-line summary
//! that also counts the checks that skipped at run time), `cargo xtask bench` (criterion
//! microbenchmarks of the kernels, once per ISA the host supports) and `cargo xtask ci` (what
//! `.ci/run` runs, minus the environment set-up, the fixture builds and the NVRTC kernel check).

mod summary;

use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::process::{Command, Stdio};

use anyhow::{bail, Context};

use summary::Tally;

fn cargo_program() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn show(args: &[&str], envs: &[(&str, &str)]) {
    let envs: Vec<String> = envs.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    eprintln!("$ {}cargo {}", envs.concat(), args.join(" "));
}

fn cargo(args: &[&str], envs: &[(&str, &str)]) -> anyhow::Result<()> {
    show(args, envs);
    let status =
        Command::new(cargo_program()).args(args).envs(envs.iter().copied()).status().context("running cargo")?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Copies `from` to `to` line by line as it arrives, handing each line to `seen`.
fn relay(from: impl Read, mut to: impl Write, mut seen: impl FnMut(&str)) {
    let mut from = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match from.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let _ = to.write_all(&line);
                let _ = to.flush();
                seen(&String::from_utf8_lossy(&line));
            }
        }
    }
}

/// `cargo test --workspace --no-fail-fast <extra>` (without `--workspace` when `extra` picks
/// packages), its output streamed as it comes, then one summary line: tests passed, failed and
/// ignored over every test binary, and the checks that passed having checked nothing
/// (`*** SKIPPED` lines) by reason. Fails when cargo does or any test failed.
fn test(extra: &[&str]) -> anyhow::Result<()> {
    let mut args = vec!["test"];
    if !summary::picks_packages(extra) {
        args.push("--workspace");
    }
    args.push("--no-fail-fast");
    args.extend(extra);
    show(&args, &[]);
    let mut cmd = Command::new(cargo_program());
    // Cargo colours only a terminal, and its output now goes through a pipe to one.
    if std::io::stderr().is_terminal() && std::env::var_os("CARGO_TERM_COLOR").is_none() {
        cmd.env("CARGO_TERM_COLOR", "always");
    }
    let mut child = cmd.args(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().context("running cargo")?;
    let (out, err) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
    let tally = std::sync::Mutex::new(Tally::default());
    std::thread::scope(|s| {
        s.spawn(|| relay(out, std::io::stdout(), |l| tally.lock().unwrap().line(l)));
        s.spawn(|| relay(err, std::io::stderr(), |l| tally.lock().unwrap().line(l)));
    });
    let status = child.wait().context("waiting for cargo")?;
    let tally = tally.into_inner().unwrap();
    // The summary goes to stdout, after everything cargo wrote to either stream, and is the
    // last line whatever the outcome.
    let failed = !status.success() || tally.failed > 0;
    if failed {
        eprintln!("\nxtask: cargo {} failed ({status}; {} tests failed)", args.join(" "), tally.failed);
    }
    let _ = std::io::stderr().flush();
    println!();
    for line in tally.skip_details() {
        println!("{line}");
    }
    println!("{}", tally.summary_line());
    let _ = std::io::stdout().flush();
    if failed {
        std::process::exit(1);
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let extra: Vec<&str> = args.iter().skip(1).map(String::as_str).collect();
    match args.first().map(String::as_str) {
        Some("test") => test(&extra),
        Some("bench") => {
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
            test(&[])
        }
        _ => {
            eprintln!("usage: cargo xtask <test [cargo test args] | bench [criterion args] | ci>");
            std::process::exit(2);
        }
    }
}
