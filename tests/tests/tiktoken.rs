//! Kimi's tiktoken tokenizer against Python's: the fixture in `tests/data/tiktoken` was made by
//! `make_fixture.py` there (Python `tiktoken` 0.14.0 and `regex` 2026.11.19): a synthetic
//! `tiktoken.model` (256 bytes and 477 merges a tiny BPE learned from a fixed text), Kimi-K2's
//! special tokens moved to its size, the ids Python tiktoken gives for fixed texts through the
//! steps of Kimi's `TikTokenTokenizer.encode`, and the pieces Kimi's split pattern cuts tricky and
//! random strings into under Python's `regex` module (VERSION1, where `&&` is class intersection
//! as in tiktoken's Rust engine; the script checks each split against tiktoken's own ids).

use std::path::PathBuf;

use krasis_model::text::tiktoken::{kimi_split_regex, split_pieces, TiktokenBpe};
use krasis_model::text::tokenizer::TextCodec;
use serde_json::Value;

fn data() -> PathBuf {
    krasis_tests::workspace_root().join("tests/data/tiktoken")
}

fn json(name: &str) -> Value {
    let path = data().join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn bpe() -> TiktokenBpe {
    let cfg_path = data().join("tokenizer_config.json");
    let cfg = json("tokenizer_config.json");
    TiktokenBpe::load(&data().join("tiktoken.model"), cfg.get("added_tokens_decoder"), &cfg_path).unwrap()
}

/// A case's text: `text`, or `text_parts` as [piece, repeat] pairs.
fn case_text(case: &Value) -> String {
    if let Some(t) = case["text"].as_str() {
        return t.to_string();
    }
    case["text_parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_str().unwrap().repeat(p[1].as_u64().unwrap() as usize))
        .collect()
}

/// Ids stored as [id, repeat] runs.
fn run_ids(runs: &Value) -> Vec<u32> {
    let mut ids = Vec::new();
    for r in runs.as_array().unwrap() {
        ids.extend(std::iter::repeat_n(r[0].as_u64().unwrap() as u32, r[1].as_u64().unwrap() as usize));
    }
    ids
}

#[test]
fn kimi_split_pattern_splits_like_python_regex() {
    let re = kimi_split_regex();
    let cases = json("splits.json");
    let cases = cases.as_array().unwrap();
    assert!(cases.len() > 400);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<&str> = case["pieces"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        assert_eq!(split_pieces(&re, text).unwrap(), want, "text {text:?}");
    }
}

#[test]
fn kimi_tiktoken_encodes_and_decodes_like_python_tiktoken() {
    let bpe = bpe();
    let fixture = json("encode.json");
    assert_eq!(bpe.num_base_tokens() as u64, fixture["num_base_tokens"].as_u64().unwrap());
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let text = case_text(case);
        let ids = run_ids(&case["ids"]);
        assert_eq!(bpe.encode(&text, true).unwrap(), ids, "case {name}");
        assert_eq!(bpe.encode(&text, false).unwrap(), run_ids(&case["ids_no_special"]), "case {name}, no specials");
        assert_eq!(bpe.decode(&ids, false).unwrap(), text, "case {name}");
    }
}

/// Without `tokenizer.json` the text codec reads `tiktoken.model` when Kimi's tokenizer is named,
/// and refuses one it cannot name.
#[test]
fn text_codec_reads_kimi_tiktoken_without_tokenizer_json() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::copy(data().join("tiktoken.model"), dir.join("tiktoken.model")).unwrap();
    std::fs::copy(data().join("tokenizer_config.json"), dir.join("tokenizer_config.json")).unwrap();
    let codec = TextCodec::load(dir).unwrap();
    let fixture = json("encode.json");
    let case = &fixture["cases"][0];
    let (text, ids) = (case_text(case), run_ids(&case["ids"]));
    assert_eq!(codec.encode(&text).unwrap(), ids);
    // The codec's decode drops special tokens (`special: true`); Kimi's tool-call markers are not.
    let n = bpe().num_base_tokens();
    let user = n + 3; // <|im_user|>
    let tool = n + 11; // <|tool_calls_section_begin|>, `special: false`
    let mut with_specials = codec.encode("hi").unwrap();
    with_specials.insert(0, user);
    with_specials.push(tool);
    assert_eq!(codec.decode(&with_specials).unwrap(), "hi<|tool_calls_section_begin|>");

    // A tiktoken model nothing names as Kimi's is refused, naming the file.
    let mut cfg = json("tokenizer_config.json");
    cfg.as_object_mut().unwrap().remove("auto_map");
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let e = TextCodec::load(dir).err().expect("refused").to_string();
    assert!(e.contains("tiktoken.model") && e.contains("tokenization_kimi.py"), "{e}");
    // tokenization_kimi.py beside it names it.
    std::fs::write(dir.join("tokenization_kimi.py"), "# Kimi's tokenizer\n").unwrap();
    assert_eq!(TextCodec::load(dir).unwrap().encode(&text).unwrap(), ids);
}

/// A model directory with `tiktoken.model` and no `tokenizer.json` has a tokenizer.
#[test]
fn model_files_find_tiktoken_model() {
    use krasis_model::source::files::ModelFiles;
    let tmp = tempfile::tempdir().unwrap();
    krasis_tests::tiny_model(tmp.path());
    std::fs::remove_file(tmp.path().join("tokenizer.json")).unwrap();
    std::fs::copy(data().join("tiktoken.model"), tmp.path().join("tiktoken.model")).unwrap();
    std::fs::copy(data().join("tokenizer_config.json"), tmp.path().join("tokenizer_config.json")).unwrap();
    let files = ModelFiles::open(tmp.path()).unwrap();
    assert!(files.has_tokenizer());
    let fixture = json("encode.json");
    let case = &fixture["cases"][0];
    assert_eq!(files.text_codec().unwrap().encode(&case_text(case)).unwrap(), run_ids(&case["ids"]));
}

/// Kimi-K2-Instruct's published `tokenizer_config.json` and `tokenization_kimi.py` (in
/// `../shared/real-configs`) over a stand-in `tiktoken.model` of the real size, 163,584 ranks:
/// the special ids are those the published files give, 163,584 to 163,841.
#[test]
fn kimi_k2_published_special_ids() {
    let real = krasis_tests::workspace_root().join("../shared/real-configs");
    let (cfg, py) = (
        real.join("Kimi-K2-Instruct/tokenizer_config.json-reconstructed"),
        real.join("Kimi-tokenizer/tokenization_kimi.py"),
    );
    if !cfg.is_file() || !py.is_file() {
        if std::env::var("KRASIS_REQUIRE_REAL_CONFIGS").as_deref() == Ok("1") {
            panic!("KRASIS_REQUIRE_REAL_CONFIGS=1 but no published Kimi tokenizer files at {}", real.display());
        }
        krasis_tests::report_skip(&format!("published Kimi tokenizer files not found at {}", real.display()));
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::copy(&cfg, dir.join("tokenizer_config.json")).unwrap();
    std::fs::copy(&py, dir.join("tokenization_kimi.py")).unwrap();
    // The 256 bytes, then distinct stand-ins for the merged tokens.
    let mut model = String::new();
    for r in 0..163_584u32 {
        let token = if r < 256 { vec![r as u8] } else { format!("t{r}").into_bytes() };
        model += &format!("{} {r}\n", b64(&token));
    }
    std::fs::write(dir.join("tiktoken.model"), model).unwrap();
    let bpe = TiktokenBpe::load(
        &dir.join("tiktoken.model"),
        json_at(&dir.join("tokenizer_config.json")).get("added_tokens_decoder"),
        &dir.join("tokenizer_config.json"),
    )
    .unwrap();
    assert_eq!((bpe.num_base_tokens(), bpe.vocab_size()), (163_584, 163_842));
    for (name, id) in [
        ("[BOS]", 163_584),
        ("[EOS]", 163_585),
        ("<|im_end|>", 163_586),
        ("<|im_user|>", 163_587),
        ("<|im_assistant|>", 163_588),
        ("<|reserved_token_163589|>", 163_589),
        ("<|im_system|>", 163_594),
        ("<|tool_calls_section_begin|>", 163_595),
        ("<|im_middle|>", 163_601),
        ("[UNK]", 163_838),
        ("[PAD]", 163_839),
        ("<|reserved_token_163841|>", 163_841),
    ] {
        assert_eq!(bpe.token_to_id(name), Some(id), "{name}");
    }
    let codec = TextCodec::load(dir).unwrap();
    let ids = codec.encode("<|im_user|>user<|im_middle|>hi<|im_end|>").unwrap();
    assert_eq!(
        ids,
        vec![163_587, b'u' as u32, b's' as u32, b'e' as u32, b'r' as u32, 163_601, b'h' as u32, b'i' as u32, 163_586]
    );
}

fn json_at(path: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Standard base64 with padding (what `tiktoken.model` lines hold).
fn b64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..4 {
            out.push(if i <= chunk.len() { ABC[(n >> (18 - 6 * i) & 63) as usize] as char } else { '=' });
        }
    }
    out
}
