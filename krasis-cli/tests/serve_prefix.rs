//! Prefix reuse through `krasis serve` (issue #41 item 1) on the synthesized tiny model: a
//! three-turn greedy conversation, each turn re-sending the whole history. With the prefix cache
//! every turn after the first prefills only the tokens the cache does not hold, which `/metrics`
//! and the log show; with the reference weights the replies equal those of a server without the
//! cache.

mod common;

use common::Server;
use serde_json::{json, Value};

/// The reference weights (BF16 experts and dense weights), with which a resumed request computes
/// what a full prefill does (docs/USAGE.md, "Prefix reuse"). With quantised experts the prefill
/// kernels depend on a call's size: on a CPU with AMX-BF16 a matrix given 32 tokens or more runs
/// on the BF16 tiles and one given fewer on the INT8 kernels, so a resumed turn's short suffix and
/// the same turn sent cold differ by a rounding, which flipped a greedy choice of this random model
/// (`KRASIS_PREFILL_MATMUL=int8` kept the replies equal).
const REFERENCE: &[&str] = &["--cpu-expert-bits", "bf16", "--cpu-dense-bits", "bf16"];

/// The replies of a three-turn conversation, each turn's prompt tokens, and the server.
fn conversation(extra: &[&str]) -> (Vec<String>, Vec<f64>, Server) {
    let s = Server::start(extra);
    let system = "You are a careful assistant. ".repeat(12);
    let mut messages = vec![json!({"role": "system", "content": system})];
    let (mut replies, mut prompts) = (Vec::new(), Vec::new());
    for question in ["Where do the experts live?", "And the attention?", "Why is that fast?"] {
        messages.push(json!({"role": "user", "content": question}));
        let body =
            json!({"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0.0, "ignore_eos": true});
        let r = s.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let v: Value = r.json();
        let text = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        prompts.push(v["usage"]["prompt_tokens"].as_f64().unwrap());
        messages.push(json!({"role": "assistant", "content": text}));
        replies.push(text);
    }
    (replies, prompts, s)
}

#[test]
fn later_turns_resume_the_cached_prefix_with_the_same_replies() {
    let (cached, prompts, s) = conversation(REFERENCE);
    let (plain, _, p) = conversation(&[REFERENCE, &["--prefix-cache-mib", "0"]].concat());
    assert_eq!(cached, plain, "the prefix cache changes no reply");
    assert_eq!(s.metric("krasis_prefix_lookups_total"), 3.0);
    assert_eq!(s.metric("krasis_prefix_hits_total"), 2.0, "turns 2 and 3 resume");
    let reused = s.metric("krasis_prefix_reused_tokens_total");
    let (with, without) = (s.metric("krasis_prompt_tokens_total"), p.metric("krasis_prompt_tokens_total"));
    assert_eq!(with + reused, without, "every prompt token is either reused or prefilled");
    // Each turn's prompt starts with the previous turn's whole prompt (then its reply, which the
    // template may render with other tokens than were sampled).
    eprintln!("prompts {prompts:?}: {reused} tokens reused, {with} prefilled (without the cache {without})");
    assert!(reused >= prompts[0] + prompts[1], "turns 2 and 3 reuse at least the previous prompts");
    assert!(s.metric("krasis_prefix_cache_bytes") > 0.0);
    assert_eq!(p.metric("krasis_prefix_hits_total"), 0.0);
    assert_eq!(p.metric("krasis_prefix_lookups_total"), 0.0, "off: no lookups");
    assert!(s.log().contains("reused from the prefix cache"), "the log says what was reused:\n{}", s.log());
}
