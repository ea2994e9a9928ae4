//! A `krasis serve` process on a synthesized tiny model, and a plain HTTP/1.1 client over
//! `TcpStream` (no client library: the tests see the bytes the server writes).

#![allow(dead_code)] // each test file uses part of it

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// How long a test waits for the server to start or a condition to hold.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// A running `krasis serve`; killed when dropped.
pub struct Server {
    pub child: Child,
    pub addr: String,
    /// Everything the server wrote to stderr so far.
    pub log: Arc<Mutex<String>>,
    _dir: tempfile::TempDir,
}

impl Server {
    /// Synthesizes the tiny model (2 layers) and serves it on the CPU on a free port.
    pub fn start(extra: &[&str]) -> Server {
        Self::start_with_env(extra, &[])
    }

    pub fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Server {
        Self::start_prepared(extra, env, |_| {})
    }

    /// As [`Server::start_with_env`], after `prepare` has changed the synthesized model's
    /// directory (say its chat template).
    pub fn start_prepared(extra: &[&str], env: &[(&str, &str)], prepare: impl FnOnce(&std::path::Path)) -> Server {
        Self::start_built(extra, env, |model| {
            krasis_tests::tiny_model(model);
            prepare(model);
        })
    }

    /// As [`Server::start_with_env`], on the model `build` writes into the directory it is given
    /// (say a synthetic model of another family).
    pub fn start_built(extra: &[&str], env: &[(&str, &str)], build: impl FnOnce(&std::path::Path)) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("tiny");
        build(&model);
        let mut child = Command::new(env!("CARGO_BIN_EXE_krasis"))
            .args(["serve", "--model", model.to_str().unwrap(), "--port", "0", "--device", "cpu", "--threads", "1"])
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start krasis serve");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.split(" at http://").nth(1) {
                    let _ = tx.send(rest.split('/').next().unwrap_or_default().to_string());
                }
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let addr = match rx.recv_timeout(PATIENCE) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!("the server did not start; stderr:\n{}", log.lock().unwrap());
            }
        };
        Server { child, addr, log, _dir: dir }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn get(&self, path: &str) -> Response {
        self.or_log(try_request(&self.addr, "GET", path, &[], None))
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        self.or_log(try_request(&self.addr, "POST", path, &[], Some(body.to_string().as_bytes())))
    }

    /// A request's response, or a panic that shows the server's log when it cannot be reached
    /// (the server is gone: its last lines say why).
    fn or_log(&self, r: std::io::Result<Response>) -> Response {
        r.unwrap_or_else(|e| {
            // The reader thread may still be taking the last lines.
            std::thread::sleep(Duration::from_millis(300));
            panic!("cannot reach the server at {} ({e}); its log:\n{}", self.addr, self.log())
        })
    }

    /// One value of `/metrics` (the first line starting with `name `).
    pub fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").text();
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
    }

    /// Polls `f` until it holds or [`PATIENCE`] runs out.
    pub fn wait_for(&self, what: &str, mut f: impl FnMut(&Server) -> bool) {
        let end = Instant::now() + PATIENCE;
        while Instant::now() < end {
            if f(self) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("timed out waiting for {what}; server log:\n{}", self.log());
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("status {}: body is not JSON ({e}): {}", self.status, self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of an SSE body.
    pub fn sse_data(&self) -> Vec<String> {
        sse_events(&self.text())
    }
}

pub fn sse_events(text: &str) -> Vec<String> {
    text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_string).collect()
}

fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect to the server");
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    s
}

fn send_head(s: &mut TcpStream, addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&[u8]>) {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", b.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    if let Some(b) = body {
        // A server that answers before reading all of an oversize body may close early.
        let _ = s.write_all(b);
    }
}

/// Reads the status line and headers.
fn read_head(r: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    (status, headers)
}

/// One HTTP request on a fresh connection; the whole response.
pub fn request(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&[u8]>) -> Response {
    try_request(addr, method, path, headers, body).expect("connect to the server")
}

/// [`request`], with a failure to connect returned.
pub fn try_request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> std::io::Result<Response> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    send_head(&mut s, addr, method, path, headers, body);
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r);
    let chunked = headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let mut body = Vec::new();
    if chunked {
        while let Some(c) = read_chunk(&mut r) {
            body.extend_from_slice(&c);
        }
    } else {
        r.read_to_end(&mut body).unwrap();
    }
    Ok(Response { status, headers, body })
}

/// One chunk of a chunked body (`None` at the end).
fn read_chunk(r: &mut BufReader<TcpStream>) -> Option<Vec<u8>> {
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let size = usize::from_str_radix(line.trim(), 16).ok()?;
    let mut buf = vec![0u8; size + 2];
    r.read_exact(&mut buf).ok()?;
    buf.truncate(size);
    (size > 0).then_some(buf)
}

/// A streaming response read event by event (to stop reading mid-stream).
pub struct EventStream {
    pub status: u16,
    reader: BufReader<TcpStream>,
    pending: String,
}

impl EventStream {
    pub fn open(addr: &str, path: &str, body: &Value) -> EventStream {
        let mut s = connect(addr);
        send_head(&mut s, addr, "POST", path, &[], Some(body.to_string().as_bytes()));
        let mut reader = BufReader::new(s);
        let (status, _) = read_head(&mut reader);
        EventStream { status, reader, pending: String::new() }
    }

    /// The next `data:` payload, `None` at the end of the stream.
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.pending.find("\n\n") {
                let event: String = self.pending.drain(..i + 2).collect();
                if let Some(d) = event.trim_end().strip_prefix("data: ") {
                    return Some(d.to_string());
                }
                continue;
            }
            let c = read_chunk(&mut self.reader)?;
            self.pending.push_str(&String::from_utf8_lossy(&c));
        }
    }
}

/// The text and the final usage of a streamed chat or completion, checking each chunk's shape.
pub fn collect_stream(events: &[String], chat: bool) -> (String, Option<String>, Option<Value>) {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "a stream ends with [DONE]: {events:?}");
    let (mut text, mut finish, mut usage) = (String::new(), None, None);
    for (i, e) in events[..events.len() - 1].iter().enumerate() {
        let v: Value = serde_json::from_str(e).unwrap_or_else(|err| panic!("chunk {i} is not JSON ({err}): {e}"));
        assert_eq!(v["object"], if chat { "chat.completion.chunk" } else { "text_completion" }, "{v}");
        assert!(v["id"].as_str().is_some_and(|s| s.starts_with(if chat { "chatcmpl-" } else { "cmpl-" })), "{v}");
        let choices = v["choices"].as_array().expect("choices");
        if choices.is_empty() {
            usage = Some(v["usage"].clone());
            continue;
        }
        let c = &choices[0];
        let piece = if chat {
            if i == 0 {
                assert_eq!(c["delta"]["role"], "assistant", "the first chat chunk carries the role: {v}");
            }
            c["delta"]["content"].as_str().unwrap_or("")
        } else {
            c["text"].as_str().expect("text")
        };
        text.push_str(piece);
        if let Some(f) = c["finish_reason"].as_str() {
            assert!(finish.is_none(), "one finish_reason per stream");
            finish = Some(f.to_string());
        }
    }
    (text, finish, usage)
}

/// A Qwen3-style template: the tools in a system block, calls as `<tool_call>` JSON, results as
/// `<tool_response>`, and Qwen3's `enable_thinking` switch.
pub const QWEN_STYLE: &str = r#"{%- if tools %}{{ '<|im_start|>system\n# Tools\n<tools>' }}{% for t in tools %}{{ '\n' + (t | tojson) }}{% endfor %}{{ '\n</tools><|im_end|>\n' }}{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\n' + m.content }}{% for tc in m.tool_calls or [] %}{{ '\n<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' + (tc.function.arguments | tojson) + '}\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"#;

/// A harmony-style template (gpt-oss's markers): the generation prompt is `<|start|>assistant`.
pub const HARMONY_STYLE: &str = r#"{%- for m in messages %}{{ '<|start|>' + m.role + '<|channel|>final<|message|>' + m.content + '<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"#;

/// Replaces the chat template in `model`'s tokenizer_config.json.
pub fn set_chat_template(model: &Path, template: &str) {
    let path = model.join("tokenizer_config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["chat_template"] = json!(template);
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
}

/// The Python that runs the official `openai` package: `KRASIS_PYTHON` (`.ci/run` points it at
/// a venv with `openai`), else `python3`; `None` after a visible skip line when the package is
/// not importable (`KRASIS_REQUIRE_OPENAI=1` makes that a failure).
pub fn openai_python() -> Option<String> {
    sdk_python("openai", "KRASIS_REQUIRE_OPENAI")
}

/// As [`openai_python`], for the `anthropic` package (`KRASIS_REQUIRE_ANTHROPIC=1` makes its
/// absence a failure).
pub fn anthropic_python() -> Option<String> {
    sdk_python("anthropic", "KRASIS_REQUIRE_ANTHROPIC")
}

/// The Python (`KRASIS_PYTHON`, else `python3`) that imports `package`; `None` after a visible
/// skip line when it cannot, or a panic when `require_var` is `1`.
pub fn sdk_python(package: &str, require_var: &str) -> Option<String> {
    let python = std::env::var("KRASIS_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python).args(["-c", &format!("import {package}")]).output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        let why = match &probe {
            Ok(o) => String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("").to_string(),
            Err(e) => e.to_string(),
        };
        if std::env::var(require_var).as_deref() == Ok("1") {
            panic!("{require_var}=1 but `{python} -c 'import {package}'` failed: {why}");
        }
        krasis_tests::report_skip(&format!(
            "the {package} Python package is not importable by {python} ({why}); `pip install {package}` or set KRASIS_PYTHON"
        ));
        return None;
    }
    Some(python)
}

/// Runs a client script under `tests/` with `python` and `args`; its stdout, after checking it
/// exited 0 and printed `passed` (on failure: its output and the server's log).
pub fn run_client(python: &str, script: &str, args: &[&str], server: &Server) -> String {
    let path = format!("{}/tests/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(python).arg(&path).args(args).output().expect("run the client script");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{stderr}\nserver log:\n{}", server.log());
    assert!(stdout.contains("passed"), "{stdout}");
    stdout.into_owned()
}

/// A server whose every reply is a scripted text (`KRASIS_TEST_SCRIPT`), with `template` as its
/// chat template, so that random weights write a family's tool calls and think blocks.
pub struct Scripted {
    pub server: Server,
    pub script: std::path::PathBuf,
    /// The model's tokenizer, to count the tokens of an expected prompt.
    pub codec: krasis_model::text::tokenizer::TextCodec,
    _dir: tempfile::TempDir,
}

impl Scripted {
    pub fn start(template: &str) -> Scripted {
        Self::start_with(template, &[])
    }

    /// As [`Scripted::start`], with further `krasis serve` flags.
    pub fn start_with(template: &str, extra: &[&str]) -> Scripted {
        Self::start_built(template, extra, krasis_tests::tiny_model)
    }

    /// As [`Scripted::start_with`], on the model `build` writes into the directory it is given.
    pub fn start_built(template: &str, extra: &[&str], build: impl FnOnce(&Path)) -> Scripted {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("reply.txt");
        std::fs::write(&script, "").unwrap();
        let mut codec = None;
        let server = Server::start_built(extra, &[("KRASIS_TEST_SCRIPT", script.to_str().unwrap())], |model| {
            build(model);
            set_chat_template(model, template);
            codec = Some(krasis_model::text::tokenizer::TextCodec::load(model).unwrap());
        });
        Scripted { server, script, codec: codec.unwrap(), _dir: dir }
    }

    /// Sets the text of the following replies.
    pub fn reply(&self, text: &str) {
        std::fs::write(&self.script, text).unwrap();
    }

    /// A chat request whose reply is `reply`.
    pub fn chat(&self, reply: &str, body: &Value) -> Response {
        self.reply(reply);
        self.server.post("/v1/chat/completions", body)
    }

    /// The tokens of `text` (no BOS).
    pub fn tokens(&self, text: &str) -> u64 {
        self.codec.encode_plain(text).unwrap().len() as u64
    }
}
