//! The tokenizers GGUF files carry encode llama.cpp's own test vectors exactly: the vocabulary-only
//! `ggml-vocab-*.gguf` files of llama.cpp's `models/` folder, each with its `.gguf.inp` (texts
//! separated by a line `__ggml_vocab_test__`) and `.gguf.out` (one line of space-separated ids per
//! text). llama.cpp made the ids with the model's own Hugging Face tokenizer
//! (`convert_hf_to_gguf_update.py`, `encode(text, add_special_tokens=False)`), and its
//! `tests/test-tokenizer-0.cpp` checks itself against them with `add_special = false` and
//! `parse_special = false`: no BOS. Krasis reads each file through [`TextCodec::from_gguf`] and
//! encodes with [`TextCodec::encode_plain`] (no BOS either); the ids must
//! also decode back to the text.
//!
//! `scripts/fetch-tokenizers.py` fetches the files (llama-cpp-python 0.3.16's source distribution,
//! SHA-256 pinned) into `ggml-vocab/` under `KRASIS_TOKENIZERS`, else `.tokenizers` at the
//! repository root. Where they were not fetched, the test prints its SKIPPED line and passes;
//! `KRASIS_REQUIRE_FIXTURES=1` (set by `.ci/run`, which fetches them) makes that a failure.
//!
//! [`VOCABS`] lists every file of that folder with what is expected of it. A file that the list
//! does not name fails the test, and so does an unsupported one that loads: an unsupported
//! vocabulary never counts as a pass.

use std::path::{Path, PathBuf};

use krasis_model::source::gguf::GgufModel;
use krasis_model::text::tokenizer::TextCodec;

enum Expect {
    /// Every case encodes to its ids exactly.
    Pass,
    /// Krasis refuses the tokenizer (the reason); loading it must fail.
    Unsupported(&'static str),
    /// The file ships without `.inp` / `.out`; it must load (or fail, for the reason given) but
    /// nothing is compared.
    NoVectors(Option<&'static str>),
}

/// Every `ggml-vocab-<name>.gguf` in llama-cpp-python 0.3.16, by name.
const VOCABS: &[(&str, Expect)] = &[
    ("llama-spm", Expect::Pass),
    ("phi-3", Expect::Pass),
    ("llama-bpe", Expect::Pass),
    ("qwen2", Expect::Pass),
    ("deepseek-llm", Expect::Pass),
    ("deepseek-coder", Expect::Pass),
    ("gpt-2", Expect::Pass),
    ("mpt", Expect::Pass),
    ("falcon", Expect::Pass),
    ("starcoder", Expect::Pass),
    ("refact", Expect::Pass),
    ("command-r", Expect::Pass),
    ("bert-bge", Expect::Unsupported("WordPiece (`tokenizer.ggml.model = bert`)")),
    ("aquila", Expect::NoVectors(None)),
    ("baichuan", Expect::NoVectors(None)),
    ("gpt-neox", Expect::NoVectors(None)),
    ("nomic-bert-moe", Expect::NoVectors(Some("Unigram (`tokenizer.ggml.model = t5`)"))),
];

/// How many mismatching cases to show per vocabulary.
const SHOWN: usize = 3;

fn vocab_dir() -> PathBuf {
    std::env::var_os("KRASIS_TOKENIZERS")
        .map(PathBuf::from)
        .unwrap_or_else(|| krasis_tests::workspace_root().join(".tokenizers"))
        .join("ggml-vocab")
}

/// llama.cpp's `read_tests`: the texts split on `\n__ggml_vocab_test__\n`, the ids one line per
/// text.
fn read_cases(gguf: &Path) -> anyhow::Result<Vec<(String, Vec<u32>)>> {
    let inp = std::fs::read_to_string(format!("{}.inp", gguf.display()))?;
    let out = std::fs::read_to_string(format!("{}.out", gguf.display()))?;
    let mut texts = Vec::new();
    let mut rest = inp.as_str();
    while !rest.is_empty() {
        match rest.find("\n__ggml_vocab_test__\n") {
            Some(at) => {
                texts.push(rest[..at].to_string());
                rest = &rest[at + "\n__ggml_vocab_test__\n".len()..];
            }
            None => {
                texts.push(rest.to_string());
                rest = "";
            }
        }
    }
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|l| l.split_whitespace().map(str::parse).collect::<Result<Vec<u32>, _>>())
        .collect::<Result<_, _>>()?;
    anyhow::ensure!(texts.len() == ids.len(), "{} texts but {} id lines", texts.len(), ids.len());
    Ok(texts.into_iter().zip(ids).collect())
}

fn load(path: &Path) -> anyhow::Result<TextCodec> {
    Ok(TextCodec::from_gguf(&GgufModel::open(path)?)?)
}

#[test]
fn gguf_tokenizers_reproduce_llama_cpp_vectors() {
    let dir = vocab_dir();
    if !dir.join("SOURCE").is_file() {
        let msg = format!("{} missing (python3 scripts/fetch-tokenizers.py)", dir.display());
        krasis_tests::missing_fixture(&msg);
        return;
    }
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let n = e.unwrap().file_name().into_string().ok()?;
            Some(n.strip_prefix("ggml-vocab-")?.strip_suffix(".gguf")?.to_string())
        })
        .collect();
    names.sort();
    let mut failures = Vec::new();
    let mut report = Vec::new();
    for name in &names {
        let path = dir.join(format!("ggml-vocab-{name}.gguf"));
        let Some((_, expect)) = VOCABS.iter().find(|(n, _)| n == name) else {
            failures.push(format!("{name}: not in VOCABS (say what is expected of it)"));
            continue;
        };
        match expect {
            Expect::Unsupported(why) | Expect::NoVectors(Some(why)) => match load(&path) {
                Ok(_) => failures.push(format!("{name}: listed as unsupported ({why}) but it loads")),
                Err(e) => report.push(format!("{name}: unsupported, {why} ({e})")),
            },
            Expect::NoVectors(None) => match load(&path) {
                Ok(_) => report.push(format!("{name}: loads; llama.cpp ships no vectors for it")),
                Err(e) => failures.push(format!("{name}: {e}")),
            },
            Expect::Pass => {
                let codec = match load(&path) {
                    Ok(c) => c,
                    Err(e) => {
                        failures.push(format!("{name}: {e}"));
                        continue;
                    }
                };
                let cases = read_cases(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                let mut bad = Vec::new();
                for (text, want) in &cases {
                    match codec.encode_plain(text) {
                        Ok(got) if &got == want => match codec.decode(&got) {
                            Ok(back) if &back == text => {}
                            Ok(back) => bad.push(format!("  {text:?}\n    decodes back to {back:?}")),
                            Err(e) => bad.push(format!("  {text:?}: decoding: {e}")),
                        },
                        Ok(got) => bad.push(format!("  {text:?}\n    want {want:?}\n    got  {got:?}")),
                        Err(e) => bad.push(format!("  {text:?}: {e}")),
                    }
                }
                if bad.is_empty() {
                    report.push(format!("{name}: {} cases pass", cases.len()));
                } else {
                    let shown = bad.iter().take(SHOWN).cloned().collect::<Vec<_>>().join("\n");
                    failures.push(format!(
                        "{name}: {} of {} cases differ; the first:\n{shown}",
                        bad.len(),
                        cases.len()
                    ));
                }
            }
        }
    }
    for (n, _) in VOCABS {
        if !names.iter().any(|m| m == n) {
            failures.push(format!("{n}: listed in VOCABS but {} has no ggml-vocab-{n}.gguf", dir.display()));
        }
    }
    eprintln!("{}", report.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// DeepSeek-V3's and Qwen3's published tokenizers (fetched for `tokenizers_ref`), written into a
/// GGUF as llama.cpp's `convert_hf_to_gguf.py` writes them (`tokenizer.ggml.model = gpt2`, the
/// tokens by id with gaps filled, control = 3 for special added tokens and 4 for the others, the
/// merges, `tokenizer.ggml.pre` = `deepseek-v3` / `qwen2`), encode llama.cpp's texts and the
/// multilingual texts of `tests/data/tokenizers/expected.json` exactly as the `tokenizer.json`
/// does (which `tokenizers_ref` checks against Python's `tokenizers`). llama.cpp ships no
/// `ggml-vocab-deepseek-v3.gguf`; this is the check of that pre-tokenizer.
#[test]
fn gguf_written_from_published_tokenizers_encodes_as_tokenizer_json() {
    let base = vocab_dir().parent().unwrap().to_path_buf();
    let refs: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(krasis_tests::workspace_root().join("tests/data/tokenizers/expected.json")).unwrap(),
    )
    .unwrap();
    let mut texts: Vec<String> = refs["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().into()).collect();
    let inp = base.join("ggml-vocab/ggml-vocab-qwen2.gguf");
    if let Ok(cases) = read_cases(&inp) {
        texts.extend(cases.into_iter().map(|(t, _)| t));
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for (name, pre) in [("deepseek-v3", "deepseek-v3"), ("qwen3", "qwen2")] {
        let dir = base.join(name);
        if !dir.join("tokenizer.json").is_file() {
            let msg = format!("{} missing (python3 scripts/fetch-tokenizers.py)", dir.display());
            krasis_tests::missing_fixture(&msg);
            continue;
        }
        let reference = TextCodec::load(&dir).unwrap();
        let gguf = tmp.path().join(format!("{name}.gguf"));
        std::fs::write(&gguf, gguf_from_tokenizer_json(&dir.join("tokenizer.json"), pre)).unwrap();
        let codec = load(&gguf).unwrap_or_else(|e| panic!("{name}: {e}"));
        for text in &texts {
            let want = reference.encode_plain(text).unwrap();
            let got = codec.encode_plain(text).unwrap();
            assert_eq!(got, want, "{name} (GGUF, pre {pre}) vs its tokenizer.json: {text:?}");
            assert_eq!(codec.decode(&got).unwrap(), reference.decode(&want).unwrap(), "{name}: decoding {text:?}");
            checked += 1;
        }
    }
    eprintln!("{checked} encodings of GGUF-embedded tokenizers checked against their tokenizer.json");
}

/// A vocabulary-only GGUF of a byte-level BPE `tokenizer.json`, laid out as
/// `convert_hf_to_gguf.py`'s `_set_vocab_gpt2` does.
fn gguf_from_tokenizer_json(path: &Path, pre: &str) -> Vec<u8> {
    use krasis_model::source::gguf::writer::{GgufWriter, MetaValue};
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut by_id: Vec<Option<(String, i32)>> = Vec::new();
    let mut put = |id: usize, tok: &str, ty: i32| {
        if by_id.len() <= id {
            by_id.resize(id + 1, None);
        }
        by_id[id] = Some((tok.to_string(), ty));
    };
    for (tok, id) in j["model"]["vocab"].as_object().unwrap() {
        put(id.as_u64().unwrap() as usize, tok, 1);
    }
    for a in j["added_tokens"].as_array().unwrap() {
        let ty = if a["special"].as_bool().unwrap() { 3 } else { 4 };
        put(a["id"].as_u64().unwrap() as usize, a["content"].as_str().unwrap(), ty);
    }
    // Gaps become `[PAD{id}]`, type 5 (unused), as the converter writes them.
    let (tokens, types): (Vec<String>, Vec<i32>) =
        by_id.into_iter().enumerate().map(|(i, t)| t.unwrap_or_else(|| (format!("[PAD{i}]"), 5))).unzip();
    let merges: Vec<String> = j["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => s.clone(),
            m => m.as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect::<Vec<_>>().join(" "),
        })
        .collect();
    let mut w = GgufWriter::default();
    w.meta("general.architecture", MetaValue::Str("llama".into()))
        .meta("tokenizer.ggml.model", MetaValue::Str("gpt2".into()))
        .meta("tokenizer.ggml.pre", MetaValue::Str(pre.into()))
        .meta("tokenizer.ggml.tokens", MetaValue::StrArray(tokens))
        .meta("tokenizer.ggml.token_type", MetaValue::I32Array(types))
        .meta("tokenizer.ggml.merges", MetaValue::StrArray(merges));
    w.to_bytes()
}

/// Without `tokenizer.ggml.add_bos_token`, a SentencePiece (`llama`) GGUF and a Llama-3 one add a
/// BOS, as llama.cpp does; another byte-level BPE does not; the key, where present, decides.
#[test]
fn gguf_add_bos_defaults_as_llama_cpp() {
    use krasis_model::source::gguf::writer::{GgufWriter, MetaValue};
    let tmp = tempfile::tempdir().unwrap();
    let strs = |v: &[&str]| MetaValue::StrArray(v.iter().map(|s| s.to_string()).collect());
    let case = |model: &str, pre: Option<&str>, add_bos: Option<bool>| -> Vec<u32> {
        let mut w = GgufWriter::default();
        w.meta("general.architecture", MetaValue::Str("llama".into()))
            .meta("tokenizer.ggml.model", MetaValue::Str(model.into()))
            .meta("tokenizer.ggml.tokens", strs(&["<s>", "a", "\u{2581}", "\u{2581}a"]))
            .meta("tokenizer.ggml.token_type", MetaValue::I32Array(vec![3, 1, 1, 1]))
            .meta("tokenizer.ggml.bos_token_id", MetaValue::U32(0));
        // No scores: llama.cpp reads them as 0.
        if model == "gpt2" {
            w.meta("tokenizer.ggml.merges", strs(&[]));
        }
        if let Some(p) = pre {
            w.meta("tokenizer.ggml.pre", MetaValue::Str(p.into()));
        }
        if let Some(b) = add_bos {
            w.meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(b));
        }
        let path = tmp.path().join("t.gguf");
        std::fs::write(&path, w.to_bytes()).unwrap();
        load(&path).unwrap().encode("a").unwrap()
    };
    assert_eq!(case("llama", None, None), vec![0, 3]);
    assert_eq!(case("llama", None, Some(false)), vec![3]);
    assert_eq!(case("gpt2", Some("llama-bpe"), None), vec![0, 1]);
    assert_eq!(case("gpt2", Some("qwen2"), None), vec![1]);
    assert_eq!(case("gpt2", Some("qwen2"), Some(true)), vec![0, 1]);
}
