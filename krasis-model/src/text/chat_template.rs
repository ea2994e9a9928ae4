//! Chat templates rendered as transformers' `apply_chat_template` renders them, so a published
//! template gives the text its model was trained on: Jinja with `trim_blocks` and
//! `lstrip_blocks`, `raise_exception`, `strftime_now`, and transformers' `tojson` (Python's
//! `json.dumps` with `ensure_ascii=False`: `", "` and `": "` separators, no HTML escaping). The
//! context is the conversation, the tools, `add_generation_prompt`, the BOS and EOS strings, and
//! any other variable the template reads (a thinking switch such as `enable_thinking`).
//! `tests/tests/chat_templates.rs` checks the published templates against transformers' renders.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value as Json};

/// What a template renders: everything besides the template's text.
#[derive(Clone, Debug, Default)]
pub struct ChatInput<'a> {
    /// The conversation: a JSON array of messages (`role`, `content`, and whatever else the
    /// template reads: `tool_calls`, `name`, `tool_call_id`, ...).
    pub messages: Json,
    /// Tool definitions (OpenAI's `tools` form), when offered.
    pub tools: Option<Json>,
    /// End with the header of the assistant's turn.
    pub add_generation_prompt: bool,
    pub bos_token: &'a str,
    pub eos_token: &'a str,
    /// Further variables, e.g. `enable_thinking`.
    pub extra: Map<String, Json>,
    /// The day `strftime_now` formats, `(year, month, day)`; `None`: today (UTC).
    pub today: Option<(i32, u32, u32)>,
}

/// Renders `template` on `input`; a template error or a `raise_exception` is the message.
pub fn render(template: &str, input: &ChatInput<'_>) -> Result<String, String> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    let today = input.today.unwrap_or_else(today_utc);
    env.add_function("strftime_now", move |format: String| -> Result<String, Error> { Ok(strftime(&format, today)) });
    env.add_filter("tojson", tojson);
    env.add_template("chat", template).map_err(|e| e.to_string())?;
    let mut ctx = Map::new();
    for (k, v) in &input.extra {
        ctx.insert(k.clone(), v.clone());
    }
    ctx.insert("messages".into(), input.messages.clone());
    if let Some(tools) = &input.tools {
        ctx.insert("tools".into(), tools.clone());
    }
    ctx.insert("add_generation_prompt".into(), Json::Bool(input.add_generation_prompt));
    ctx.insert("bos_token".into(), Json::String(input.bos_token.to_string()));
    ctx.insert("eos_token".into(), Json::String(input.eos_token.to_string()));
    let tmpl = env.get_template("chat").map_err(|e| e.to_string())?;
    tmpl.render(Value::from_serialize(&ctx)).map_err(|e| e.to_string())
}

/// Fits OpenAI-form messages to what `template` reads, as servers in front of transformers'
/// templates do:
/// - a tool call's `arguments` (a JSON string in OpenAI's API) become the object they encode,
///   as transformers' tool-use templates expect (`arguments.items()`, `arguments | tojson`),
///   unless the template joins them as a string (`['arguments'] +`, DeepSeek's);
/// - a `null` content becomes `""`, unless the template tests for none (DeepSeek-V3 tells a
///   tool-call turn by `content is none`); Qwen3's `'</think>' in content` fails on none.
pub fn fit_messages(template: &str, messages: &mut [Json]) {
    let string_args = template.contains("['arguments'] +") || template.contains(".arguments +");
    let none_content = template.contains("content'] is none") || template.contains("content is none");
    for m in messages.iter_mut() {
        let Some(m) = m.as_object_mut() else { continue };
        if !none_content && m.get("content").is_none_or(Json::is_null) {
            m.insert("content".into(), Json::String(String::new()));
        }
        if string_args {
            continue;
        }
        let Some(Json::Array(calls)) = m.get_mut("tool_calls") else { continue };
        for call in calls {
            let f = if call.get("function").is_some() { &mut call["function"] } else { call };
            if let Some(args) = f.get_mut("arguments") {
                if let Some(parsed) = args.as_str().and_then(|s| serde_json::from_str::<Json>(s).ok()) {
                    *args = parsed;
                }
            }
        }
    }
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent, separators=...,
/// sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings")),
        // Python's defaults: `", "` without indent, `","` with it.
        None => (if indent.is_some() { ",".into() } else { ", ".into() }, ": ".into()),
    };
    let style = PyJson {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps` formatting.
struct PyJson {
    indent: Option<usize>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ascii: bool,
}

impl PyJson {
    fn write(&self, v: &Json, depth: usize, out: &mut String) {
        match v {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => out.push_str(&py_number(n)),
            Json::String(s) => self.string(s, out),
            Json::Array(a) if a.is_empty() => out.push_str("[]"),
            Json::Object(o) if o.is_empty() => out.push_str("{}"),
            Json::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.write(x, depth + 1, out);
                }
                self.close(depth, out);
                out.push(']');
            }
            Json::Object(o) => {
                out.push('{');
                let mut entries: Vec<(&String, &Json)> = o.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key_sep);
                    self.write(x, depth + 1, out);
                }
                self.close(depth, out);
                out.push('}');
            }
        }
    }

    /// Before item `i` of a container at `depth`: the item separator, then the indentation.
    fn separate(&self, i: usize, depth: usize, out: &mut String) {
        if i > 0 {
            out.push_str(&self.item_sep);
        }
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    }

    fn close(&self, depth: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ascii && !c.is_ascii()) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A JSON number as Python prints it: integers as they are, floats by `repr` (`1.0`, `0.5`,
/// `1e-05`).
fn py_number(n: &serde_json::Number) -> String {
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    let f = n.as_f64().unwrap_or(f64::NAN);
    if f.is_finite() && f == f.trunc() && f.abs() < 1e16 {
        return format!("{f:.1}");
    }
    let s = format!("{f:?}");
    // Rust prints `1e-5`; Python `1e-05`.
    match s.split_once('e') {
        Some((m, e)) => {
            let (sign, digits) = e.strip_prefix('-').map_or(("+", e), |d| ("-", d));
            format!("{m}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// Today's date in UTC, `(year, month, day)`.
fn today_utc() -> (i32, u32, u32) {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    civil_from_days((secs / 86_400) as i64)
}

/// The proleptic Gregorian date of `days` since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i32, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    ((if m <= 2 { y + 1 } else { y }) as i32, m, d)
}

/// `strftime` of a date at midnight: `%Y %m %d %e %B %b %A %a %j %y %H %M %S %%` (the codes chat
/// templates use); other codes are kept as written.
fn strftime(format: &str, (y, m, d): (i32, u32, u32)) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = days_from_civil(y, m, d);
    // 1970-01-01 was a Thursday.
    let weekday = DAYS[((days + 3).rem_euclid(7)) as usize];
    let month = MONTHS[(m as usize).clamp(1, 12) - 1];
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') | Some('M') | Some('S') => out.push_str("00"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 of a proleptic Gregorian date.
fn days_from_civil(y: i32, m: u32, d: u32) -> i64 {
    let y = i64::from(if m <= 2 { y - 1 } else { y });
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip_and_format_as_strftime_does() {
        for days in [-1_000_000i64, -1, 0, 1, 20_000, 20_785, 2_000_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(strftime("%Y-%m-%d %A %b %j %%", (2026, 11, 28)), "2026-11-28 Saturday Nov 332 %");
        assert_eq!(strftime("%d %B %Y", (2024, 2, 29)), "29 February 2024");
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let input =
            ChatInput { messages: serde_json::json!([{"role": "user", "content": "x"}]), ..ChatInput::default() };
        let t = r#"{{ {"a": [1, 2.5, "é<&>\"\n"], "b": none, "c": 1e-5} | tojson }}|{{ [1, {"k": true}] | tojson(indent=2) }}"#;
        assert_eq!(
            render(t, &input).unwrap(),
            "{\"a\": [1, 2.5, \"é<&>\\\"\\n\"], \"b\": null, \"c\": 1e-05}|[\n  1,\n  {\n    \"k\": true\n  }\n]"
        );
        let ascii = r#"{{ "é" | tojson(ensure_ascii=true) }}"#;
        assert_eq!(render(ascii, &input).unwrap(), "\"\\u00e9\"");
    }

    #[test]
    fn blocks_trim_as_transformers_does_and_exceptions_are_errors() {
        let input = ChatInput {
            messages: serde_json::json!([{"role": "user", "content": "Hi"}]),
            add_generation_prompt: true,
            ..ChatInput::default()
        };
        let t = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}>{% endif %}";
        assert_eq!(render(t, &input).unwrap(), "[Hi]\n>");
        let e = render("{{ raise_exception('no system role') }}", &input).unwrap_err();
        assert!(e.contains("no system role"), "{e}");
    }
}
