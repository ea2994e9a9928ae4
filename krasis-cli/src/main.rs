//! `krasis`: the command-line front end. Thin: parses flags, calls the library, prints results.

mod cmd_bench;
mod cmd_bench_gpu;
mod cmd_bench_hybrid;
mod cmd_bench_streams;
mod cmd_convert;
mod cmd_generate;
mod cmd_info;
mod cmd_synth;
mod cmd_tune;
mod dump;
mod logging;
mod serve;
mod tuned;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "krasis",
    version,
    about = "Mixture-of-Experts LLM runtime: the whole model on one GPU, hybrid (routed experts on the CPU, the rest on the GPU), or the CPU alone"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Generate(cmd_generate::Args),
    /// Write a random-weight model in HF hub format (for tests and benchmarks).
    Synth(cmd_synth::Args),
    /// Describe a model: architecture, parameters, memory, and system checks.
    Info(cmd_info::Args),
    /// Build the caches ahead of the first run: the CPU expert cache (INT4/INT8), the GPU one with
    /// --gpu-expert-bits, the dense-weight cache with --cpu-dense-bits.
    Convert(cmd_convert::Args),
    /// Benchmarks: memory bandwidth, expert GEMV, prefill and decode throughput on the CPU, the
    /// GPU or hybrid, concurrent streams through the server's scheduler, GPU attention kernels.
    Bench(cmd_bench::Args),
    /// Serve the model over an OpenAI-compatible HTTP API (chat, completions, streaming).
    Serve(serve::Args),
    /// Measure where the routed experts should live on this machine (each strategy's prefill
    /// and decode) and save the choice for `generate` and `serve` under --device auto.
    Tune(cmd_tune::Args),
}

/// The parser, with every value flag taking negative numbers (`--temperature -1`), so that the
/// flag's own check answers rather than clap's "unexpected argument '-1'".
fn command() -> clap::Command {
    Cli::command().mut_subcommands(|sub| {
        sub.mut_args(|a| if a.get_action().takes_values() { a.allow_negative_numbers(true) } else { a })
    })
}

fn main() {
    // Behave like other Unix tools when stdout closes early (`krasis info | head`): end quietly
    // on SIGPIPE instead of panicking inside println!.
    #[cfg(unix)]
    // SAFETY: setting a signal disposition to its default before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    logging::init();
    let cli = Cli::from_arg_matches(&command().get_matches()).unwrap_or_else(|e| e.exit());
    let result = match cli.command {
        Command::Generate(a) => cmd_generate::run(a),
        Command::Synth(a) => cmd_synth::run(a),
        Command::Info(a) => cmd_info::run(a),
        Command::Convert(a) => cmd_convert::run(a),
        Command::Bench(a) => cmd_bench::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Tune(a) => cmd_tune::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
