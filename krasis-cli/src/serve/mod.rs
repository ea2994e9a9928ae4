//! `krasis serve`: an OpenAI-compatible HTTP server over the Engine API, which also speaks
//! Anthropic's Messages API.
//!
//! - `routes`: axum routes, the API-key check, body limits, OpenAI's response and SSE shapes;
//! - `anthropic`: `/v1/messages` (Anthropic's request, response, SSE and error shapes);
//! - `api`: request bodies and their validation; `error`: OpenAI's error JSON;
//! - `scheduler`: the thread that batches every admitted request into one engine step;
//! - `stop`: stop strings across token boundaries; `metrics`: the Prometheus counters.

mod anthropic;
mod api;
mod error;
mod routes;
mod schema;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use clap::Args as ClapArgs;
use krasis_model::runtime::{cpu_memory_estimate, open_engine, Engine, DEFAULT_CONTEXT_TOKENS};
use krasis_model::source::files::ModelFiles;

use crate::cmd_generate::RunArgs;
pub(crate) use krasis_model::runtime::metrics::Metrics;
use krasis_model::runtime::scheduler;

/// Default prefix-cache size: a few 8K-token conversations (DeepSeek-V3's MLA cache of 8K tokens is
/// 1.1 GiB in f32 on the CPU, half that in BF16 on the GPU).
const DEFAULT_PREFIX_CACHE_MIB: usize = 4096;

/// `--prefill-chunk auto|N` (N at least 1).
fn parse_prefill_chunk(s: &str) -> Result<scheduler::PrefillChunk, String> {
    match s.trim() {
        "auto" => Ok(scheduler::PrefillChunk::Measured),
        n => match n.parse::<usize>() {
            Ok(n) if n > 0 => Ok(scheduler::PrefillChunk::Fixed(n)),
            _ => Err(format!("`{s}`: `auto` or a positive number of tokens")),
        },
    }
}

/// How long connections may take to send their last chunks once the grace period has ended
/// every request: a client that reads nothing does not hold the server up.
const DRAIN: Duration = Duration::from_secs(5);
/// Tokio worker threads: the HTTP side only parses, tokenises and forwards text; the engine's
/// own threads (the scheduler and the CPU pool) do the work.
const HTTP_THREADS: usize = 2;

#[derive(ClapArgs)]
pub struct Args {
    /// Model: an HF directory (config.json, *.safetensors, tokenizer.json) or a GGUF file
    /// (`*.gguf`; any split of a split model).
    #[arg(long)]
    model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the startup line says which).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer <KEY>` on /v1 routes (default: no key; KRASIS_API_KEY
    /// gives it without showing it in the process list).
    #[arg(long)]
    api_key: Option<String>,
    /// The model id /v1/models lists and responses carry (default: the model directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Requests decoded together in one engine step (batch slots).
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Requests that may wait while every batch slot is busy; beyond that the server answers 429.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Memory (MiB) for finished requests' state that later requests starting with the same
    /// tokens resume instead of prefilling (the next turn of a conversation). Kept where the
    /// sessions live: host memory for the CPU engine, VRAM (within the budget) for the GPU
    /// paths. 0 turns prefix reuse off.
    #[arg(long, default_value_t = DEFAULT_PREFIX_CACHE_MIB)]
    prefix_cache_mib: usize,
    /// Prompt tokens one engine step runs beside the decoding streams (continuous batching):
    /// `auto` sizes it so that a step takes about a quarter second at the prefill rate measured
    /// so far (2.5 × the recent decode step while streams decode, if shorter); a number fixes it (smaller: steadier inter-token latency while long prompts
    /// arrive; larger: faster prompts).
    #[arg(long, default_value = "auto", value_parser = parse_prefill_chunk)]
    prefill_chunk: scheduler::PrefillChunk,
    /// Context per request: prompt + generated tokens (default: the engine's KV capacity, else
    /// 4096, never above the model's max_position_embeddings).
    #[arg(long)]
    context: Option<usize>,
    /// Largest request body accepted (bytes); larger ones get 413.
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    /// Count how many (token, slot) routes each routed expert of each layer gets over every
    /// request served, and write the counts to this JSON file when the server stops
    /// (docs/FORMATS.md). Without it the counts are added to `heatmap.json` in the model's cache
    /// directory, which the next hybrid start pins experts by.
    #[arg(long)]
    heatmap_out: Option<PathBuf>,
    /// Seconds running requests may go on after SIGINT/SIGTERM; then each ends with
    /// finish_reason "shutdown". A second signal exits at once.
    #[arg(long, default_value_t = 10, value_name = "SECONDS")]
    shutdown_grace: u64,
    #[command(flatten)]
    run: RunArgs,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    if a.context == Some(0) {
        bail!("--context must be at least 1");
    }
    let api_key = a.api_key.clone().or_else(|| std::env::var("KRASIS_API_KEY").ok());
    if api_key.as_deref().is_some_and(str::is_empty) {
        bail!("--api-key is empty");
    }
    let context_estimate = a.context.map_or(DEFAULT_CONTEXT_TOKENS, |c| c as u64) * a.max_batch as u64;
    // Every session of the GPU paths holds a KV cache of `--kv-tokens`; left to itself the GPU
    // loader sizes it to all the VRAM left, which would fit one session, not `--max-batch`.
    let mut gpu = a.run.gpu.clone();
    if gpu.kv_tokens.is_none() {
        gpu.kv_tokens = Some(a.context.unwrap_or(DEFAULT_CONTEXT_TOKENS as usize));
    }
    let mut config = a.run.engine.config(a.run.device, &gpu, context_estimate)?;
    // The VRAM plan keeps room for every batch slot's cache and the prefix cache before it pins
    // experts into what is left.
    config.gpu.sessions = a.max_batch.max(1);
    config.gpu.prefix_cache_bytes = (a.prefix_cache_mib as u64) << 20;
    let files = ModelFiles::open(&a.model)?;
    // Before the RAM estimate of `--context` × `--max-batch` tokens can refuse it as too large.
    let max_pos = files.spec().max_position_embeddings;
    if let Some(c) = a.context.filter(|&c| c > max_pos) {
        bail!("--context {c} exceeds the model's max_position_embeddings {max_pos}");
    }
    config.record_heatmap = crate::cmd_generate::heatmap_wanted(a.heatmap_out.as_deref(), &files, &a.model)?;
    // Without --heatmap-out the server still counts routes, for the heatmap beside the caches
    // that the next hybrid start pins experts by (written when it stops).
    let beside_caches = match &a.heatmap_out {
        None if files.spec().moe.is_some() => {
            Some(krasis_model::runtime::default_heatmap_path(&files, a.run.engine.cache_dir.as_deref()))
        }
        _ => None,
    };
    config.record_heatmap |= beside_caches.is_some();
    for w in krasis_core::hw::probe().warnings(cpu_memory_estimate(&files, &config).weight_bytes()) {
        tracing::warn!("system: {w}");
    }
    if !files.has_tokenizer() {
        bail!("{} has no tokenizer.json: the server needs one to turn text into tokens", a.model.display());
    }
    // Bound before the model loads (a first start builds its caches, which can take minutes), so
    // that a taken port is reported at once; connections made meanwhile wait in the backlog.
    let listener = bind(&a.host, a.port)?;
    let codec = files.text_codec()?;
    let tool_format =
        krasis_model::text::tool_calls::ToolFormat::choose(Some(files.spec().arch.model_type()), codec.chat_template());
    match tool_format {
        Some(f) => tracing::info!("tool calls and reasoning are read in the {} format", f.name()),
        None => tracing::info!("no tool-call format known for this model: chat replies are plain text"),
    }
    let t_load = Instant::now();
    let opened = open_engine(&files, &config)?;
    drop(files);
    tracing::info!("{}", opened.why);
    for line in &opened.placement {
        tracing::info!("{line}");
    }
    for w in &opened.warnings {
        tracing::warn!("{w}");
    }
    for line in &opened.log {
        tracing::info!("{line}");
    }
    let engine: Arc<dyn Engine> = Arc::from(opened.engine);
    let spec = engine.spec();
    let limit = engine.kv_capacity().unwrap_or(DEFAULT_CONTEXT_TOKENS as usize).min(spec.max_position_embeddings);
    let context = match a.context {
        Some(c) if c > spec.max_position_embeddings => {
            bail!("--context {c} exceeds the model's max_position_embeddings {}", spec.max_position_embeddings)
        }
        Some(c) => c.min(engine.kv_capacity().unwrap_or(c)),
        None => limit,
    };
    tracing::info!(
        "loaded {} ({} layers, {}) in {:.2} s; context {context} tokens per request, {} batch slots",
        a.model.display(),
        spec.num_layers,
        engine.describe(),
        t_load.elapsed().as_secs_f64(),
        a.max_batch
    );
    let model_id = a.served_model_name.clone().unwrap_or_else(|| {
        a.model.file_name().map_or_else(|| a.model.display().to_string(), |n| n.to_string_lossy().into_owned())
    });
    let metrics = Arc::new(Metrics::default());
    let (scheduler, worker) = scheduler::Scheduler::start(
        engine.clone(),
        codec.clone(),
        scheduler::Config {
            max_batch: a.max_batch,
            max_queue: a.max_queue,
            serial: false,
            prefill_chunk: a.prefill_chunk,
            prefix_cache_bytes: a.prefix_cache_mib << 20,
        },
        metrics.clone(),
    )
    .context("starting the scheduler thread")?;
    let state = Arc::new(routes::AppState {
        scheduler: scheduler.clone(),
        codec,
        metrics,
        model_id,
        context,
        vocab: spec.vocab_size,
        api_key,
        started: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        shutting_down: AtomicBool::new(false),
        next_id: AtomicU64::new(0),
        tool_format,
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(HTTP_THREADS)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = rt.block_on(serve(&a, listener, state));
    scheduler.shutdown();
    let _ = worker.join();
    // The heatmap is written even after a failed server; the server's error comes first.
    let saved = match (&a.heatmap_out, &beside_caches) {
        (Some(path), _) => crate::cmd_generate::save_heatmap(engine.as_ref(), &a.model, path),
        (None, Some(path)) => crate::cmd_generate::add_to_heatmap(engine.as_ref(), &a.model, path),
        (None, None) => Ok(()),
    };
    result.and(saved)
}

/// Listens on the first address `host` resolves to.
fn bind(host: &str, port: u16) -> anyhow::Result<std::net::TcpListener> {
    use std::net::ToSocketAddrs;
    let addr: SocketAddr = (host, port)
        .to_socket_addrs()
        .with_context(|| format!("--host {host}"))?
        .next()
        .with_context(|| format!("--host {host} resolves to no address"))?;
    let listener = std::net::TcpListener::bind(addr).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            anyhow!("{addr} is already in use (another server?): choose another --port, or --port 0 for any free port")
        } else {
            anyhow::Error::new(e).context(format!("listening on {addr}"))
        }
    })?;
    listener.set_nonblocking(true).with_context(|| format!("listening on {addr}"))?;
    Ok(listener)
}

async fn serve(a: &Args, listener: std::net::TcpListener, state: Arc<routes::AppState>) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::from_std(listener).context("listening")?;
    let bound = listener.local_addr()?;
    // Before the address is announced: from then on a signal means a graceful shutdown.
    let mut signals = ShutdownSignals::install()?;
    tracing::info!(
        "serving `{}` at http://{bound}/v1 (OpenAI API, Anthropic Messages API{}); /health, /metrics",
        state.model_id,
        if state.api_key.is_some() { ", API key required" } else { "" }
    );
    let app = routes::router(state.clone(), a.max_body_bytes);
    let grace = Duration::from_secs(a.shutdown_grace);
    let (signalled_tx, signalled_rx) = tokio::sync::watch::channel(false);
    // The first signal begins the graceful shutdown; a second one exits at once. (A task of its
    // own: it still listens while `run` writes the heatmap after the server has stopped.)
    let listening = state.clone();
    tokio::spawn(async move {
        let first = signals.recv().await;
        listening.shutting_down.store(true, Relaxed);
        tracing::info!(
            "{first}: shutting down (no new requests; running ones get up to {} s; a second signal exits at once)",
            grace.as_secs()
        );
        let _ = signalled_tx.send(true);
        let second = signals.recv().await;
        let m = &listening.metrics;
        let cut = m.active.load(Relaxed) + m.queued.load(Relaxed);
        tracing::warn!("second {second}: exiting now; {cut} request(s) end without a final chunk");
        std::process::exit(second.exit_code());
    });
    let server = axum::serve(listener, app).with_graceful_shutdown(signalled(signalled_rx.clone()));
    // After the grace period the scheduler ends what is still running (finish_reason
    // "shutdown"), which ends the streams and lets the graceful shutdown finish; connections
    // still open `DRAIN` later are closed.
    let scheduler = state.scheduler.clone();
    let cutoff = async move {
        signalled(signalled_rx).await;
        tokio::time::sleep(grace).await;
        tracing::info!("grace period over: ending the requests still running");
        scheduler.shutdown();
        tokio::time::sleep(DRAIN).await;
        tracing::warn!("connections still open {} s after the grace period: closing them", DRAIN.as_secs());
    };
    tokio::select! {
        r = server => r.context("the HTTP server failed")?,
        () = cutoff => {}
    }
    tracing::info!("server stopped");
    Ok(())
}

/// Resolves once the shutdown has begun (never, if the signal task is gone).
async fn signalled(mut rx: tokio::sync::watch::Receiver<bool>) {
    if rx.wait_for(|&s| s).await.is_err() {
        std::future::pending::<()>().await
    }
}

/// A signal [`ShutdownSignals`] caught.
#[derive(Clone, Copy)]
enum Caught {
    Interrupt,
    Terminate,
}

impl Caught {
    /// The shell's status for a process the signal ended: 128 + its number.
    fn exit_code(self) -> i32 {
        match self {
            Caught::Interrupt => 130,
            Caught::Terminate => 143,
        }
    }
}

impl std::fmt::Display for Caught {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Caught::Interrupt => "SIGINT",
            Caught::Terminate => "SIGTERM",
        })
    }
}

/// The SIGINT and SIGTERM handlers, installed when made: a signal that arrives after
/// [`ShutdownSignals::install`] is never the default "terminate at once". (Installed lazily, on
/// the first poll of a spawned task, a SIGTERM sent just after the server announced its address
/// could still kill it mid-stream on a busy machine.)
struct ShutdownSignals {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    fn install() -> anyhow::Result<ShutdownSignals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(ShutdownSignals {
                int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
                term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            })
        }
        #[cfg(not(unix))]
        Ok(ShutdownSignals {})
    }

    /// Waits for the next SIGINT (Ctrl-C) or SIGTERM; returns which.
    async fn recv(&mut self) -> Caught {
        #[cfg(unix)]
        {
            tokio::select! {
                Some(()) = self.int.recv() => Caught::Interrupt,
                Some(()) = self.term.recv() => Caught::Terminate,
                else => std::future::pending().await,
            }
        }
        #[cfg(not(unix))]
        {
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await
            }
            Caught::Interrupt
        }
    }
}
