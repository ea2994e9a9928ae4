//! Counters the scheduler and the routes keep, rendered as Prometheus text at `/metrics`.

use std::collections::BTreeMap;
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
                format!("{:.3}", rate(self.prefill_tokens.load(Relaxed), self.prefill_ns.load(Relaxed))),
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
