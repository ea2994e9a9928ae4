//! `krasis serve` end to end over plain HTTP on a synthesized tiny model: OpenAI shapes, stream
//! equal to non-stream, concurrent streams equal to their solo runs, disconnects, bad requests,
//! randomised bodies, API keys, graceful shutdown.

mod common;

use std::time::Duration;

use common::{collect_stream, request, EventStream, Server};
use serde_json::{json, Value};

fn chat_body(prompt: &str, seed: u64, max_tokens: u64, stream: bool) -> Value {
    json!({
        "model": "anything",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "seed": seed, "temperature": 0.9, "top_p": 0.95, "top_k": 40,
        "ignore_eos": true, "stream": stream,
    })
}

/// (text, finish_reason, usage) of a non-streamed response, checking its shape.
fn whole(r: &common::Response, chat: bool) -> (String, String, Value) {
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], if chat { "chat.completion" } else { "text_completion" }, "{v}");
    let c = &v["choices"][0];
    let text = if chat {
        assert_eq!(c["message"]["role"], "assistant");
        c["message"]["content"].as_str().unwrap()
    } else {
        c["text"].as_str().unwrap()
    };
    let u = &v["usage"];
    assert_eq!(u["total_tokens"], u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap());
    (text.to_string(), c["finish_reason"].as_str().unwrap().to_string(), u.clone())
}

#[test]
fn models_chat_and_completions_streamed_equal_whole() {
    // The same seeded request is sent several times and must sample the same text: without the
    // prefix cache, whose resumed runs round the quantised experts' last prompt row differently
    // (docs/USAGE.md).
    let s = Server::start(&["--prefix-cache-mib", "0"]);
    let m = s.get("/v1/models");
    assert_eq!(m.status, 200);
    let m = m.json();
    assert_eq!((m["object"].as_str(), m["data"][0]["id"].as_str()), (Some("list"), Some("tiny")), "{m}");
    assert_eq!(s.get("/v1/models/tiny").json()["object"], "model");
    assert_eq!(s.get("/v1/models/gpt-4").status, 404);
    assert_eq!(s.get("/health").json()["status"], "ok");

    for chat in [true, false] {
        let (path, mut body) = if chat {
            ("/v1/chat/completions", chat_body("Tell me about experts", 7, 20, false))
        } else {
            (
                "/v1/completions",
                json!({"prompt": "The experts live in", "max_tokens": 20, "seed": 7,
                "temperature": 0.9, "ignore_eos": true}),
            )
        };
        let (text, finish, usage) = whole(&s.post(path, &body), chat);
        assert_eq!((finish.as_str(), usage["completion_tokens"].as_u64()), ("length", Some(20)), "{usage}");
        assert!(!text.is_empty());
        // The same request again gives the same text (seeded), streamed or not.
        assert_eq!(whole(&s.post(path, &body), chat).0, text, "same seed, same text");
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let r = s.post(path, &body);
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r.header("content-type").is_some_and(|c| c.starts_with("text/event-stream")), "{:?}", r.headers);
        let (streamed, sfinish, susage) = collect_stream(&r.sse_data(), chat);
        assert_eq!(streamed, text, "streamed text equals the non-streamed text for the same seed");
        assert_eq!(sfinish.as_deref(), Some("length"));
        assert_eq!(susage, Some(usage.clone()), "the usage chunk");
        // Without include_usage no chunk carries usage.
        body["stream_options"] = json!({"include_usage": false});
        let events = s.post(path, &body).sse_data();
        assert!(events.iter().all(|e| !e.contains("\"usage\"")), "{events:?}");
        assert_eq!(collect_stream(&events, chat).0, text);

        // A stop string taken from the middle of that text (it may span tokens) ends it there.
        let chars: Vec<char> = text.chars().collect();
        let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
        let first = text.find(&stop).unwrap();
        body["stop"] = json!([stop, "\u{1}never"]);
        body["stream"] = json!(false);
        body.as_object_mut().unwrap().remove("stream_options");
        let (cut, finish, usage) = whole(&s.post(path, &body), chat);
        assert_eq!((cut.as_str(), finish.as_str()), (&text[..first], "stop"), "stop {stop:?} in {text:?}");
        assert!(usage["completion_tokens"].as_u64().unwrap() <= 20);
        body["stream"] = json!(true);
        let (scut, sfinish, _) = collect_stream(&s.post(path, &body).sse_data(), chat);
        assert_eq!((scut.as_str(), sfinish.as_deref()), (&text[..first], Some("stop")));
    }
    // Token-id prompts for completions; an id outside the vocabulary is a 400.
    let r = s.post("/v1/completions", &json!({"prompt": [5, 9, 200], "max_tokens": 3}));
    assert_eq!(whole(&r, false).2["prompt_tokens"], 3);
    let r = s.post("/v1/completions", &json!({"prompt": [5, 100000], "max_tokens": 3}));
    assert_eq!((r.status, r.json()["error"]["param"].as_str()), (400, Some("prompt")));
    let text = s.get("/metrics").text();
    for name in [
        "krasis_requests_total{",
        "krasis_prompt_tokens_total",
        "krasis_decode_tokens_per_second",
        "krasis_queue_depth",
    ] {
        assert!(text.contains(name), "/metrics lacks {name}:\n{text}");
    }
}

#[test]
fn eight_concurrent_streams_each_equal_its_solo_run() {
    // The reference path, whose rows do not depend on the batch: the quantised kernels choose
    // their form by a call's row count (BF16 tiles for a prefill from 32 tokens), so a batch of
    // prompts can round differently from each alone. Each prompt runs whole in one step (no
    // chunk limit), so that the sequence-steps below are exact; the together run resumes the solo
    // runs' cached prefixes, which the reference path does exactly.
    let s = Server::start(&[
        "--max-batch",
        "8",
        "--cpu-expert-bits",
        "bf16",
        "--cpu-dense-bits",
        "bf16",
        "--prefill-chunk",
        "100000",
    ]);
    let bodies: Vec<Value> = (0..8u64)
        .map(|i| {
            let mut b = chat_body(&format!("Stream number {i} says"), 100 + i, 24 + i, true);
            b["stream_options"] = json!({"include_usage": true});
            b
        })
        .collect();
    let solo: Vec<(String, Value)> = bodies
        .iter()
        .map(|b| {
            let (text, _, usage) = collect_stream(&s.post("/v1/chat/completions", b).sse_data(), true);
            (text, usage.unwrap())
        })
        .collect();
    let steps0 = s.metric("krasis_engine_steps_total");
    let seqs0 = s.metric("krasis_step_sequences_total");
    let barrier = std::sync::Barrier::new(8);
    let together: Vec<(String, Value)> = std::thread::scope(|sc| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| {
                let (addr, barrier) = (&s.addr, &barrier);
                sc.spawn(move || {
                    barrier.wait();
                    let r = request(addr, "POST", "/v1/chat/completions", &[], Some(b.to_string().as_bytes()));
                    let (text, finish, usage) = collect_stream(&r.sse_data(), true);
                    assert_eq!(finish.as_deref(), Some("length"));
                    (text, usage.unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, ((t, u), (st, su))) in together.iter().zip(&solo).enumerate() {
        assert_eq!(u["completion_tokens"].as_u64(), Some(24 + i as u64), "stream {i} usage {u}");
        assert_eq!(u, su, "stream {i}: usage with 8 streams equals its solo run");
        assert_eq!(t, st, "stream {i}: text with 8 streams equals its solo run");
    }
    let steps = s.metric("krasis_engine_steps_total") - steps0;
    let seqs = s.metric("krasis_step_sequences_total") - seqs0;
    // 8 streams of 24..31 tokens: 220 sequence-steps; run one at a time they would take 220 steps.
    assert_eq!(seqs, 220.0);
    assert!(steps < seqs, "the streams were never batched: {steps} steps for {seqs} sequence-steps");
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_slot() {
    let s = Server::start(&["--max-batch", "1", "--max-queue", "0"]);
    let body = chat_body("Go on forever", 1, 3000, true);
    let mut stream = EventStream::open(&s.addr, "/v1/chat/completions", &body);
    assert_eq!(stream.status, 200);
    for _ in 0..3 {
        stream.next_data().expect("a chunk");
    }
    s.wait_for("the long request to hold the one slot", |s| s.metric("krasis_active_sequences") == 1.0);
    // The one slot is busy and no request may wait: 429.
    let e = assert_openai_error(&s.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 2})), 429, "busy");
    assert_eq!(e["type"], "rate_limit_error");
    drop(stream);
    s.wait_for("the slot to be freed", |s| {
        s.metric("krasis_active_sequences") == 0.0 && s.metric("krasis_requests_cancelled_total") == 1.0
    });
    // A non-streamed request whose client hangs up before the answer is cancelled too.
    let body = chat_body("Go on forever", 1, 3000, false).to_string();
    let mut conn = std::net::TcpStream::connect(&s.addr).unwrap();
    let head = format!("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", body.len());
    std::io::Write::write_all(&mut conn, format!("{head}{body}").as_bytes()).unwrap();
    s.wait_for("the non-streamed request to take the slot", |s| s.metric("krasis_active_sequences") == 1.0);
    drop(conn);
    s.wait_for("the second slot release", |s| {
        s.metric("krasis_active_sequences") == 0.0 && s.metric("krasis_requests_cancelled_total") == 2.0
    });
    assert!(s.metric("krasis_generation_tokens_total") < 6000.0, "generation went on after the disconnect");
    // The one slot serves the next request.
    let (text, finish, _) = whole(&s.post("/v1/chat/completions", &chat_body("Next", 2, 4, false)), true);
    assert_eq!(finish, "length");
    assert!(!text.is_empty());
    assert!(s.log().contains("cancelled (client went away)"), "{}", s.log());
}

fn assert_openai_error(r: &common::Response, status: u16, what: &str) -> Value {
    assert_eq!(r.status, status, "{what}: {}", r.text());
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {v}");
    assert!(e["type"].as_str().is_some(), "{what}: {v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{what}: {v}");
    e.clone()
}

#[test]
fn bad_requests_get_openai_errors_with_4xx() {
    let s = Server::start(&["--context", "64", "--max-body-bytes", "4096", "--api-key", "sesame"]);
    let auth = [("Authorization", "Bearer sesame")];
    let post = |path: &str, body: &[u8]| request(&s.addr, "POST", path, &auth, Some(body));
    let chat = "/v1/chat/completions";

    let e = assert_openai_error(&post(chat, b"{\"messages\": [{\"role\": "), 400, "malformed JSON");
    assert_eq!(e["type"], "invalid_request_error");
    assert_openai_error(&post(chat, br#"{"messages": "hi"}"#), 400, "messages of the wrong type");
    assert_openai_error(&post(chat, br#"{"messages": [{"role": "user", "content": 5}]}"#), 400, "content type");
    assert_openai_error(
        &post(chat, br#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}"#),
        400,
        "max_tokens type",
    );
    let e = assert_openai_error(
        &post(chat, br#"{"messages": [{"role": "user", "content": "x"}], "temperature": 9}"#),
        400,
        "range",
    );
    assert_eq!(e["param"], "temperature");
    assert_openai_error(&post("/v1/completions", br#"{"max_tokens": 3}"#), 400, "missing prompt");

    let long = "many words in a row ".repeat(40);
    let body = json!({"messages": [{"role": "user", "content": long}]}).to_string();
    let e = assert_openai_error(&post(chat, body.as_bytes()), 400, "prompt over the context");
    assert_eq!(e["code"], "context_length_exceeded");
    let body = json!({"prompt": "hi", "max_tokens": 500}).to_string();
    let e = assert_openai_error(&post("/v1/completions", body.as_bytes()), 400, "max_tokens over the context");
    assert_eq!(e["code"], "context_length_exceeded");
    let body = json!({"prompt": "x".repeat(5000)}).to_string();
    assert_openai_error(&post("/v1/completions", body.as_bytes()), 413, "body over --max-body-bytes");

    let ok = json!({"prompt": "hi", "max_tokens": 2}).to_string();
    let e = assert_openai_error(&request(&s.addr, "POST", "/v1/completions", &[], Some(ok.as_bytes())), 401, "no key");
    assert_eq!(e["type"], "invalid_request_error");
    let wrong = [("Authorization", "Bearer open")];
    let e = assert_openai_error(
        &request(&s.addr, "POST", "/v1/completions", &wrong, Some(ok.as_bytes())),
        401,
        "wrong key",
    );
    assert_eq!(e["code"], "invalid_api_key");
    // The key without its scheme: the header is there but malformed, which is not "no key".
    for value in ["sesame", "Bearer", "Basic c2VzYW1l"] {
        let bare = [("Authorization", value)];
        let e = assert_openai_error(
            &request(&s.addr, "POST", "/v1/completions", &bare, Some(ok.as_bytes())),
            401,
            "a malformed Authorization header",
        );
        let m = e["message"].as_str().unwrap();
        assert!(m.contains("malformed") && m.contains("Bearer <key>") && !m.contains("sesame"), "{value}: {m}");
    }
    // The scheme's name is case-insensitive (RFC 9110).
    let lower = [("Authorization", "bearer sesame")];
    assert_eq!(request(&s.addr, "POST", "/v1/completions", &lower, Some(ok.as_bytes())).status, 200);
    assert_openai_error(&request(&s.addr, "GET", "/v1/models", &[], None), 401, "models without a key");
    assert_eq!(post("/v1/completions", ok.as_bytes()).status, 200, "the right key");
    assert_eq!(s.get("/health").status, 200, "/health needs no key");
    assert_openai_error(&s.get("/v2/nothing"), 404, "unknown route");
    assert_openai_error(&request(&s.addr, "GET", chat, &auth, None), 405, "GET on a POST route");
    assert!(!s.log().contains("panicked"), "{}", s.log());
}

/// A small deterministic generator (xorshift64*), so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn value(&mut self, depth: u32) -> Value {
        match self.below(if depth > 2 { 6 } else { 8 }) {
            0 => Value::Null,
            1 => json!(self.below(2) == 0),
            2 => json!(self.next() as i64),
            3 => json!([-1.0e308, -1.5, 0.0, 0.5, 1.0, 2.0, 1e9, f64::MIN_POSITIVE][self.below(8) as usize]),
            4 => json!(["", "x", "日本", "\u{0}", "user", "assistant", "text"][self.below(7) as usize]),
            5 => json!(self.below(70)),
            6 => Value::Array((0..self.below(4)).map(|_| self.value(depth + 1)).collect()),
            _ => {
                let keys = ["role", "content", "type", "text", "include_usage", "prompt", "max_tokens"];
                Value::Object(
                    (0..self.below(4))
                        .map(|_| (keys[self.below(7) as usize].to_string(), self.value(depth + 1)))
                        .collect(),
                )
            }
        }
    }
}

#[test]
fn randomised_bodies_never_panic_the_server() {
    let s = Server::start(&["--context", "48"]);
    let mut rng = Rng(0x5eed_cafe);
    let fields = [
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "seed",
        "n",
        "stream",
        "stream_options",
        "ignore_eos",
        "echo",
        "model",
    ];
    let base_chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    let base_text = json!({"prompt": "hi", "max_tokens": 4});
    for i in 0..300 {
        let chat = i % 2 == 0;
        let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
        let body: Vec<u8> = match rng.below(5) {
            0 => (0..rng.below(64)).map(|_| rng.next() as u8).collect(),
            1 => {
                let mut t = (if chat { &base_chat } else { &base_text }).to_string().into_bytes();
                let cut = rng.below(t.len() as u64) as usize;
                t.truncate(cut);
                t
            }
            _ => {
                let mut b = if chat { base_chat.clone() } else { base_text.clone() };
                for _ in 0..1 + rng.below(3) {
                    let f = fields[rng.below(fields.len() as u64) as usize];
                    if rng.below(4) == 0 {
                        b.as_object_mut().unwrap().remove(f);
                    } else {
                        b[f] = rng.value(0);
                    }
                }
                b.to_string().into_bytes()
            }
        };
        let r = request(&s.addr, "POST", path, &[], Some(&body));
        assert!(r.status < 500, "body {:?} got {}: {}", String::from_utf8_lossy(&body), r.status, r.text());
        if r.status != 200 {
            assert!(r.json()["error"]["message"].is_string(), "{}", r.text());
        }
    }
    assert_eq!(s.get("/health").status, 200);
    assert!(!s.log().contains("panicked"), "{}", s.log());
}

#[test]
fn sigterm_finishes_running_streams_then_exits_cleanly() {
    // Also the heatmap of what was served, written once the server has stopped.
    let out = tempfile::tempdir().unwrap();
    let heat = out.path().join("heat.json");
    let mut s = Server::start(&["--heatmap-out", heat.to_str().unwrap()]);
    let mut stream = EventStream::open(&s.addr, "/v1/chat/completions", &chat_body("Finish this", 3, 40, true));
    stream.next_data().expect("the stream started");
    // SAFETY: signalling the child this test started, by its own pid.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let mut events = Vec::new();
    while let Some(d) = stream.next_data() {
        events.push(d);
    }
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "the running stream finished: {events:?}");
    let end = std::time::Instant::now() + common::PATIENCE;
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(std::time::Instant::now() < end, "the server did not exit; log:\n{}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status}; log:\n{}", s.log());
    std::thread::sleep(Duration::from_millis(100));
    let log = s.log();
    assert!(log.contains("SIGTERM: shutting down") && log.contains("server stopped"), "{log}");
    assert!(log.contains("expert heatmap of"), "{log}");
    let v: Value = serde_json::from_slice(&std::fs::read(&heat).unwrap()).unwrap();
    assert_eq!(v["format"], "krasis-expert-heatmap");
    assert!(v["tokens"].as_u64().unwrap() > 40, "the prompt and the 40 generated tokens: {v}");
}
