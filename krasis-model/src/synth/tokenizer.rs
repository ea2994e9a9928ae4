//! A byte-level BPE `tokenizer.json` of any vocabulary size, in the layout of the fixtures:
//! ids 0/1 are `<|bos|>`/`<|eos|>`, ids 2..258 the 256 byte symbols (GPT-2's byte→unicode map),
//! then merges learned deterministically from a small built-in English text (`corpus.txt`), then
//! filler tokens up to `vocab_size`: pseudo-words such as `Ġkobe` that decode to " kobe", so a
//! random model's output is printable. Fillers are never produced by encoding (no merge makes
//! them) but every id decodes.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde_json::json;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

use crate::error::{ModelError, Result};

pub(crate) const BOS: &str = "<|bos|>";
pub(crate) const EOS: &str = "<|eos|>";
/// Most merges learned from the corpus (fewer when the vocabulary has no room or pairs run out).
const MAX_MERGES: usize = 400;
/// Special tokens + byte symbols.
pub(crate) const BASE_VOCAB: usize = 2 + 256;

const CORPUS: &str = include_str!("corpus.txt");

/// GPT-2's byte → printable-char map, in its canonical order (printable bytes first).
fn byte_symbols() -> Vec<(u8, char)> {
    let mut bs: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.into_iter().zip(cs).map(|(b, c)| (b as u8, char::from_u32(c).expect("valid char"))).collect()
}

/// The corpus as byte-level words with their counts, split exactly as encoding splits.
fn corpus_words() -> Result<BTreeMap<String, u64>> {
    let mut pts = PreTokenizedString::from(CORPUS);
    ByteLevel::new(false, true, true).pre_tokenize(&mut pts).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut words = BTreeMap::new();
    for (w, _, _) in pts.get_splits(OffsetReferential::Original, OffsetType::Byte) {
        *words.entry(w.to_string()).or_insert(0) += 1;
    }
    Ok(words)
}

/// Learn up to `budget` new tokens by BPE over the corpus. Ties go to the lexicographically
/// smallest pair, so the result is the same on every run and platform.
fn learn_merges(vocab: &mut Vec<String>, index: &mut HashMap<String, u32>, budget: usize) -> Result<Vec<(u32, u32)>> {
    let words = corpus_words()?;
    let mut seqs: Vec<(Vec<u32>, u64)> =
        words.iter().map(|(w, &n)| (w.chars().map(|c| index[c.to_string().as_str()]).collect(), n)).collect();
    let mut merges = Vec::new();
    let mut added = 0;
    while added < budget {
        let mut counts: HashMap<(u32, u32), u64> = HashMap::new();
        for (s, n) in &seqs {
            for p in s.windows(2) {
                *counts.entry((p[0], p[1])).or_insert(0) += n;
            }
        }
        let best = counts.into_iter().filter(|&(_, n)| n >= 2).max_by(|(pa, na), (pb, nb)| {
            na.cmp(nb).then_with(|| {
                let ka = (&vocab[pa.0 as usize], &vocab[pa.1 as usize]);
                let kb = (&vocab[pb.0 as usize], &vocab[pb.1 as usize]);
                kb.cmp(&ka) // smaller pair wins the tie
            })
        });
        let Some(((a, b), _)) = best else { break };
        let merged = format!("{}{}", vocab[a as usize], vocab[b as usize]);
        let id = match index.get(&merged) {
            Some(&id) => id,
            None => {
                let id = vocab.len() as u32;
                index.insert(merged.clone(), id);
                vocab.push(merged);
                added += 1;
                id
            }
        };
        merges.push((a, b));
        for (s, _) in &mut seqs {
            let mut out = Vec::with_capacity(s.len());
            let mut i = 0;
            while i < s.len() {
                if i + 1 < s.len() && s[i] == a && s[i + 1] == b {
                    out.push(id);
                    i += 2;
                } else {
                    out.push(s[i]);
                    i += 1;
                }
            }
            *s = out;
        }
    }
    Ok(merges)
}

/// The `n`-th filler word: `Ġ` + syllables of `n` in bijective base 70.
fn filler(n: usize) -> String {
    const CONS: &[u8] = b"bdfgklmnprstvz";
    const VOWELS: &[u8] = b"aeiou";
    let syl = CONS.len() * VOWELS.len();
    let mut s = String::from("\u{120}");
    let mut m = n;
    loop {
        let k = m % syl;
        s.push(CONS[k / VOWELS.len()] as char);
        s.push(VOWELS[k % VOWELS.len()] as char);
        m /= syl;
        if m == 0 {
            break;
        }
        m -= 1;
    }
    s
}

/// The complete `tokenizer.json` text for a vocabulary of exactly `vocab_size` ids.
pub(crate) fn tokenizer_json(vocab_size: usize) -> Result<String> {
    if vocab_size < BASE_VOCAB {
        return Err(ModelError::Invalid(format!(
            "vocab_size {vocab_size} is too small for a byte-level tokenizer (needs at least {BASE_VOCAB})"
        )));
    }
    let mut vocab: Vec<String> = vec![BOS.into(), EOS.into()];
    vocab.extend(byte_symbols().into_iter().map(|(_, c)| c.to_string()));
    let mut index: HashMap<String, u32> = vocab.iter().enumerate().map(|(i, s)| (s.clone(), i as u32)).collect();
    let merges = learn_merges(&mut vocab, &mut index, MAX_MERGES.min(vocab_size - BASE_VOCAB))?;
    let taken: HashSet<String> = vocab.iter().cloned().collect();
    let mut n = 0;
    while vocab.len() < vocab_size {
        let w = filler(n);
        n += 1;
        if !taken.contains(&w) {
            vocab.push(w);
        }
    }

    let q = |s: &str| serde_json::to_string(s).expect("string serialises");
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    let byte_level = |add_prefix_space: bool, trim_offsets: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": trim_offsets,
               "use_regex": true})
    };
    let mut out = String::with_capacity(vocab_size * 24 + merges.len() * 24 + 4096);
    out.push_str("{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n");
    out.push_str(&format!("  \"added_tokens\": [\n    {},\n    {}\n  ],\n", special(0, BOS), special(1, EOS)));
    out.push_str("  \"normalizer\": null,\n");
    out.push_str(&format!("  \"pre_tokenizer\": {},\n", byte_level(false, true)));
    out.push_str(&format!("  \"post_processor\": {},\n", byte_level(true, false)));
    out.push_str(&format!("  \"decoder\": {},\n", byte_level(true, true)));
    out.push_str(
        "  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n    \"unk_token\": null,\n    \
         \"continuing_subword_prefix\": null,\n    \"end_of_word_suffix\": null,\n    \"fuse_unk\": false,\n    \
         \"byte_fallback\": false,\n    \"ignore_merges\": false,\n    \"vocab\": {\n",
    );
    for (i, tok) in vocab.iter().enumerate() {
        let sep = if i + 1 < vocab.len() { "," } else { "" };
        out.push_str(&format!("      {}: {i}{sep}\n", q(tok)));
    }
    out.push_str("    },\n    \"merges\": [\n");
    for (i, &(a, b)) in merges.iter().enumerate() {
        let sep = if i + 1 < merges.len() { "," } else { "" };
        out.push_str(&format!("      [{}, {}]{sep}\n", q(&vocab[a as usize]), q(&vocab[b as usize])));
    }
    out.push_str("    ]\n  }\n}\n");
    Ok(out)
}

/// `tokenizer_config.json`, in the shape of the fixtures' (no automatic BOS, a plain template).
pub(crate) fn tokenizer_config_json(model_max_length: usize) -> String {
    let v = json!({
        "add_bos_token": false,
        "add_eos_token": false,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    });
    serde_json::to_string_pretty(&v).expect("json serialises") + "\n"
}
