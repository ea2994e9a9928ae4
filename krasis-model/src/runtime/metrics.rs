//! Counters the scheduler and the routes keep, rendered as Prometheus text at `/metrics`.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

#[derive(Default)]
pub struct Metrics {
    /// Finished HTTP requests by (route, status).
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Generations ended by a client that went away.
    pub cancelled: AtomicU64,
    /// Requests waiting for a slot.
    pub queued: AtomicU64,
    /// Sequences in the running batch.
    pub active: AtomicU64,
    /// Engine steps run, and the sequences they advanced (mean batch = rows / steps).
    pub steps: AtomicU64,
    pub step_sequences: AtomicU64,
    /// Steps that ran a prompt: tokens and wall time.
    prefill_tokens: AtomicU64,
    prefill_ns: AtomicU64,
    /// Steps that only decoded: tokens and wall time (aggregate over the batch).
    decode_tokens: AtomicU64,
    decode_ns: AtomicU64,
    /// Prefix cache: requests looked up, requests that resumed a cached prefix, the prompt
    /// tokens they did not prefill, and the bytes the cache holds.
    pub prefix_lookups: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub prefix_reused_tokens: AtomicU64,
    pub prefix_cached_bytes: AtomicU64,
    /// From a request's arrival to its first token, and between its tokens.
    first_token: Latencies,
    inter_token: Latencies,
}

/// The latest [`LATENCY_WINDOW`] latencies (for quantiles) and the count and sum of all.
#[derive(Default)]
struct Latencies {
    recent: Mutex<VecDeque<f64>>,
    count: AtomicU64,
    sum_ns: AtomicU64,
}

/// Latencies the quantiles of `/metrics` are taken over: the most recent ones, so that the
/// figures follow the load (4096 is minutes of tokens of a busy server).
const LATENCY_WINDOW: usize = 4096;

/// The quantiles `/metrics` reports.
const QUANTILES: [f64; 3] = [0.5, 0.9, 0.99];

impl Latencies {
    fn record(&self, d: Duration) {
        self.count.fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(d.as_nanos() as u64, Relaxed);
        if let Ok(mut r) = self.recent.lock() {
            if r.len() == LATENCY_WINDOW {
                r.pop_front();
            }
            r.push_back(d.as_secs_f64());
        }
    }

    /// The `q`-quantile of the recent latencies (nearest rank), `None` before any.
    fn quantile(&self, q: f64) -> Option<f64> {
        let mut v: Vec<f64> = self.recent.lock().ok()?.iter().copied().collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
        Some(v[rank - 1])
    }

    /// A Prometheus summary: quantile lines, `_sum` and `_count`.
    fn render(&self, name: &str) -> String {
        let mut lines: Vec<String> = QUANTILES
            .iter()
            .filter_map(|&q| self.quantile(q).map(|v| format!("{name}{{quantile=\"{q}\"}} {v:.6}")))
            .collect();
        lines.push(format!("{name}_sum {:.6}", self.sum_ns.load(Relaxed) as f64 * 1e-9));
        lines.push(format!("{name}_count {}", self.count.load(Relaxed)));
        lines.join("\n")
    }
}

impl Metrics {
    pub fn record_request(&self, route: &str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((route.to_string(), status)).or_insert(0) += 1;
        }
    }

    /// One engine step of `sequences` sequences: `prompt_tokens` of prefill (0 for a step that
    /// only decoded) and `decoded` sequences advanced by one token.
    pub fn record_step(&self, sequences: usize, prompt_tokens: usize, decoded: usize, took: Duration) {
        self.steps.fetch_add(1, Relaxed);
        self.step_sequences.fetch_add(sequences as u64, Relaxed);
        let ns = took.as_nanos() as u64;
        if prompt_tokens > 0 {
            self.prefill_tokens.fetch_add(prompt_tokens as u64, Relaxed);
            self.prefill_ns.fetch_add(ns, Relaxed);
        } else {
            self.decode_tokens.fetch_add(decoded as u64, Relaxed);
            self.decode_ns.fetch_add(ns, Relaxed);
        }
    }

    /// A request's first token, `d` after it arrived.
    pub fn record_first_token(&self, d: Duration) {
        self.first_token.record(d);
    }

    /// A token `d` after the same request's previous one.
    pub fn record_inter_token(&self, d: Duration) {
        self.inter_token.record(d);
    }

    /// The `q`-quantiles of the recent times to first token and inter-token latencies, in
    /// seconds (`None` before any).
    pub fn latency_quantiles(&self, q: f64) -> (Option<f64>, Option<f64>) {
        (self.first_token.quantile(q), self.inter_token.quantile(q))
    }

    /// Prompt tokens per second of the steps that ran prompts so far (0 before any).
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prefill_tokens.load(Relaxed), self.prefill_ns.load(Relaxed))
    }

    /// Tokens per second over all decode-only steps so far (every stream of the batch counted).
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.decode_tokens.load(Relaxed), self.decode_ns.load(Relaxed))
    }

    /// Decode tokens and seconds so far (for a benchmark's before/after difference).
    pub fn decode_totals(&self) -> (u64, f64) {
        (self.decode_tokens.load(Relaxed), self.decode_ns.load(Relaxed) as f64 * 1e-9)
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{value}");
        };
        let requests = self.requests.lock().map(|m| m.clone()).unwrap_or_default();
        let lines: Vec<String> = requests
            .iter()
            .map(|((route, status), n)| format!("krasis_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"))
            .collect();
        let lines = if lines.is_empty() { "krasis_requests_total 0".to_string() } else { lines.join("\n") };
        metric("krasis_requests_total", "counter", "HTTP requests answered, by route and status.", lines);
        let plain = |name: &str, v: String| format!("{name} {v}");
        let c = |a: &AtomicU64| a.load(Relaxed).to_string();
        for (name, kind, help, v) in [
            ("krasis_prompt_tokens_total", "counter", "Prompt tokens prefilled.", c(&self.prompt_tokens)),
            ("krasis_generation_tokens_total", "counter", "Tokens generated.", c(&self.generated_tokens)),
            (
                "krasis_requests_cancelled_total",
                "counter",
                "Generations stopped because the client went away.",
                c(&self.cancelled),
            ),
            (
                "krasis_prefix_lookups_total",
                "counter",
                "Requests looked up in the prefix cache.",
                c(&self.prefix_lookups),
            ),
            (
                "krasis_prefix_hits_total",
                "counter",
                "Requests that resumed a cached prompt prefix.",
                c(&self.prefix_hits),
            ),
            (
                "krasis_prefix_reused_tokens_total",
                "counter",
                "Prompt tokens taken from the prefix cache instead of prefilled.",
                c(&self.prefix_reused_tokens),
            ),
            (
                "krasis_prefix_cache_bytes",
                "gauge",
                "Bytes of saved state the prefix cache holds.",
                c(&self.prefix_cached_bytes),
            ),
            ("krasis_queue_depth", "gauge", "Requests waiting for a batch slot.", c(&self.queued)),
            ("krasis_active_sequences", "gauge", "Sequences in the running batch.", c(&self.active)),
            ("krasis_engine_steps_total", "counter", "Engine steps run.", c(&self.steps)),
            (
                "krasis_step_sequences_total",
                "counter",
                "Sequences advanced, summed over steps (mean batch size = this / steps).",
                c(&self.step_sequences),
            ),
            (
                "krasis_prefill_tokens_per_second",
                "gauge",
                "Prompt tokens per second of the steps that ran prompts, since start.",
                format!("{:.3}", self.prefill_tok_s()),
            ),
            (
                "krasis_decode_tokens_per_second",
                "gauge",
                "Tokens per second of the decode-only steps, all streams together, since start.",
                format!("{:.3}", self.decode_tok_s()),
            ),
        ] {
            metric(name, kind, help, plain(name, v));
        }
        metric(
            "krasis_time_to_first_token_seconds",
            "summary",
            "From a request's arrival (queue wait included) to its first token; quantiles of the latest 4096.",
            self.first_token.render("krasis_time_to_first_token_seconds"),
        );
        metric(
            "krasis_inter_token_latency_seconds",
            "summary",
            "Between two tokens of one request; quantiles of the latest 4096.",
            self.inter_token.render("krasis_inter_token_latency_seconds"),
        );
        s
    }
}

fn rate(tokens: u64, ns: u64) -> f64 {
    if ns == 0 {
        0.0
    } else {
        tokens as f64 / (ns as f64 * 1e-9)
    }
}
