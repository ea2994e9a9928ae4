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
mod flags;
mod logging;
mod serve;

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
    // `serve` handles Ctrl-C itself (tokio), so a graceful shutdown drains its requests.
    if !matches!(cli.command, Command::Serve(_)) {
        remove_partial_caches_on_interrupt();
    }
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
        // The library names its options (`GpuOptions::vram_budget`); the user reads the flags.
        eprintln!("error: {}", flags::with_flags(&format!("{e:#}")));
        std::process::exit(1);
    }
}

/// On SIGINT or SIGTERM, remove the temp files of the cache builds in progress (a first
/// `generate` or a `convert` writes `<cache>.tmp.<pid>` files of gigabytes), say which, and exit
/// with 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM).
///
/// The two signals are blocked in this thread before any other thread starts, so every thread
/// inherits the mask, and one thread takes them with `sigwait`: the cleanup runs as ordinary
/// code, not in a signal handler. Child processes start with an empty mask (std resets it).
fn remove_partial_caches_on_interrupt() {
    // SAFETY: sigset_t is plain data, filled by sigemptyset/sigaddset before use; the mask is
    // changed before this process starts any other thread.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return;
        }
        set
    };
    let waiter = move || loop {
        let mut signal: libc::c_int = 0;
        // SAFETY: waits for one of the signals of an initialised set, all blocked.
        if unsafe { libc::sigwait(&set, &mut signal) } != 0 {
            continue;
        }
        let removed = krasis_cache::remove_temp_files_and_stop();
        let name = if signal == libc::SIGINT { "interrupted" } else { "terminated" };
        if removed.is_empty() {
            eprintln!("\n{name}");
        } else {
            let shown: Vec<String> = removed.iter().map(|p| p.display().to_string()).collect();
            eprintln!("\n{name}: removed the partial cache file(s) {}", shown.join(", "));
        }
        std::process::exit(128 + signal);
    };
    if std::thread::Builder::new().name("krasis-signals".into()).spawn(waiter).is_err() {
        // No thread to take them: let the signals act as before.
        // SAFETY: unblocking the signals blocked above.
        unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
    }
}
