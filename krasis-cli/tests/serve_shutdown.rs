//! `krasis serve` starting on a taken port, and stopping with requests in flight: each request
//! running when the grace period ends gets a final `finish_reason: "shutdown"` (streams then
//! `data: [DONE]`), a connection that never finishes does not keep the server up, and a second
//! signal exits at once.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use common::{collect_stream, request, EventStream, Server, PATIENCE};
use serde_json::{json, Value};

fn signal(s: &Server, sig: i32) {
    // SAFETY: signalling the child this test started, by its own pid.
    unsafe { libc::kill(s.child.id() as i32, sig) };
}

/// The server's exit status, once it has exited (panics after [`PATIENCE`]).
fn wait_exit(s: &mut Server) -> ExitStatus {
    let end = Instant::now() + PATIENCE;
    loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            // The stderr reader thread may still hold the last lines.
            std::thread::sleep(Duration::from_millis(100));
            return st;
        }
        assert!(Instant::now() < end, "the server did not exit; log:\n{}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every file under `dir` (none when it does not exist).
fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries
        .flat_map(|e| {
            let p = e.unwrap().path();
            if p.is_dir() {
                files_under(&p)
            } else {
                vec![p]
            }
        })
        .collect()
}

#[test]
fn a_taken_port_is_refused_before_the_caches_are_built() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    krasis_tests::tiny_model(&model);
    let cache = dir.path().join("cache");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_krasis"))
        .args(["serve", "--model", model.to_str().unwrap(), "--host", "127.0.0.1", "--port", &port])
        .args(["--device", "cpu", "--threads", "1", "--cpu-expert-bits", "4"])
        .args(["--cache-dir", cache.to_str().unwrap()])
        .output()
        .expect("run krasis serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("loaded "), "the model was loaded before the port was tried: {err}");
    assert_eq!(files_under(&cache), Vec::<std::path::PathBuf>::new(), "caches were built before the port was tried");
    assert!(
        err.contains(&format!("127.0.0.1:{port} is already in use")) && err.contains("--port"),
        "the error names the address and the way out: {err}"
    );
    drop(taken);
}

fn long_chat(stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": "Go on forever"}],
        "max_tokens": 3000, "seed": 1, "ignore_eos": true, "stream": stream,
    })
}

#[test]
fn shutdown_ends_running_requests_with_a_finish_reason() {
    let mut s = Server::start(&["--max-batch", "2", "--shutdown-grace", "0"]);
    let mut body = long_chat(true);
    body["stream_options"] = json!({"include_usage": true});
    let mut stream = EventStream::open(&s.addr, "/v1/chat/completions", &body);
    assert_eq!(stream.status, 200);
    let mut events: Vec<String> = (0..3).map(|_| stream.next_data().expect("a chunk")).collect();
    let addr = s.addr.clone();
    let post = move |body: Value| {
        let addr = addr.clone();
        std::thread::spawn(move || {
            request(&addr, "POST", "/v1/chat/completions", &[], Some(body.to_string().as_bytes()))
        })
    };
    // A non-streamed request in the second slot, and one waiting for a slot.
    let running = post(long_chat(false));
    s.wait_for("two running requests", |s| s.metric("krasis_active_sequences") == 2.0);
    let waiting = post(long_chat(false));
    s.wait_for("a waiting request", |s| s.metric("krasis_queue_depth") == 1.0);
    signal(&s, libc::SIGINT);

    while let Some(d) = stream.next_data() {
        events.push(d);
    }
    let (text, finish, usage) = collect_stream(&events, true);
    assert_eq!(finish.as_deref(), Some("shutdown"), "the cut stream says why it ended: {events:?}");
    let usage = usage.expect("the usage chunk");
    let generated = usage["completion_tokens"].as_u64().unwrap();
    assert!(generated > 0 && generated < 3000 && !text.is_empty(), "{usage}");

    let r = running.join().unwrap();
    assert_eq!(r.status, 200, "the running non-streamed request gets its partial result: {}", r.text());
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "shutdown", "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() < 3000, "{v}");

    let r = waiting.join().unwrap();
    assert_eq!(r.status, 503, "the request that never started: {}", r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("shut down before"), "{msg}");

    let status = wait_exit(&mut s);
    assert!(status.success(), "exit status {status}; log:\n{}", s.log());
    let log = s.log();
    assert!(log.contains("SIGINT: shutting down") && log.contains("grace period over"), "{log}");
    assert!(log.contains("finish_reason shutdown") && log.contains("server stopped"), "{log}");
}

/// A request whose body never arrives whole: it keeps a graceful shutdown waiting. `Expect:
/// 100-continue` tells when the server has taken the request and is reading its body.
fn stuck_request(s: &Server) -> TcpStream {
    let mut conn = TcpStream::connect(&s.addr).unwrap();
    conn.set_read_timeout(Some(PATIENCE)).unwrap();
    conn.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\nExpect: 100-continue\r\n\r\n",
    )
    .unwrap();
    let mut line = String::new();
    BufReader::new(conn.try_clone().unwrap()).read_line(&mut line).unwrap();
    assert!(line.contains(" 100 "), "{line:?}");
    conn.write_all(b"{\"prompt\": ").unwrap();
    conn
}

#[test]
fn a_connection_that_never_finishes_does_not_hold_the_shutdown() {
    let mut s = Server::start(&["--shutdown-grace", "0"]);
    let conn = stuck_request(&s);
    signal(&s, libc::SIGTERM);
    let status = wait_exit(&mut s);
    assert!(status.success(), "exit status {status}; log:\n{}", s.log());
    let log = s.log();
    assert!(log.contains("connections still open") && log.contains("server stopped"), "{log}");
    drop(conn);
}

#[test]
fn a_second_signal_exits_at_once() {
    // A grace period no test waits for: only the second signal can end this server soon.
    let mut s = Server::start(&["--shutdown-grace", "600"]);
    let conn = stuck_request(&s);

    signal(&s, libc::SIGINT);
    s.wait_for("the graceful shutdown to begin", |s| s.log().contains("SIGINT: shutting down"));
    assert!(s.child.try_wait().unwrap().is_none(), "the first signal waits for the running request");
    signal(&s, libc::SIGINT);
    let status = wait_exit(&mut s);
    assert_eq!(status.code(), Some(130), "exit status {status}; log:\n{}", s.log());
    assert!(s.log().contains("second SIGINT: exiting now"), "{}", s.log());
    drop(conn);
}

/// Without `--heatmap-out`, a server that stops adds its routes to `heatmap.json` beside the
/// caches (what the next hybrid start pins experts by): written on the first stop, added to on
/// the next.
#[test]
fn a_stopped_server_adds_its_routes_to_the_heatmap_beside_the_caches() {
    let cache = tempfile::tempdir().unwrap();
    let heatmap = cache.path().join("heatmap.json");
    let tokens_after_a_run = || -> u64 {
        let mut s = Server::start(&["--cpu-expert-bits", "4", "--cache-dir", cache.path().to_str().unwrap()]);
        let body = json!({"prompt": "Count the routes", "max_tokens": 4, "seed": 1, "ignore_eos": true});
        assert_eq!(s.post("/v1/completions", &body).status, 200, "{}", s.log());
        signal(&s, libc::SIGINT);
        assert!(wait_exit(&mut s).success(), "{}", s.log());
        assert!(s.log().contains("heatmap.json"), "the server says where the heatmap went: {}", s.log());
        let heat: Value = serde_json::from_slice(&std::fs::read(&heatmap).expect("heatmap beside the caches")).unwrap();
        heat["tokens"].as_u64().unwrap()
    };
    let first = tokens_after_a_run();
    assert!(first > 0, "routes were counted");
    let second = tokens_after_a_run();
    assert!(second > first, "the second run's routes were added: {first} then {second}");
}
