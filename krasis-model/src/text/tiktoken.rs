//! Kimi-K2's tokenizer: a tiktoken byte-level BPE (`tiktoken.model`) with the split pattern and
//! special tokens of Kimi's `tokenization_kimi.py`, encoding exactly as its
//! `TikTokenTokenizer.encode` does.
//!
//! - **The model file** has one `<base64 token> <rank>` line per token (tiktoken's
//!   `load_tiktoken_bpe` format). The ranks are the token ids and must be exactly `0..N`; every
//!   single byte must have one.
//! - **The split pattern** ([`KIMI_PATTERN`]) is Kimi's string, verbatim. tiktoken compiles it with
//!   the Rust `fancy-regex` crate, and so does this module. Its `&&` is character-class
//!   intersection there (as in the `regex` crate, to which `fancy-regex` hands the classes), so no
//!   rewrite is needed: the pattern is the same text in the same engine family. Python's `regex`
//!   module reads it the same way only in its `VERSION1` mode; its default `VERSION0` takes `&&` and
//!   the nested class literally. The test fixture's splits come from `VERSION1`
//!   (`tests/data/tiktoken/make_fixture.py`).
//! - **Special tokens** take the ids `N..N + 258` (`num_reserved_special_tokens` = 256, plus 2, as
//!   `tokenization_kimi.py` counts them), each named by `tokenizer_config.json`'s
//!   `added_tokens_decoder` where it names that id and `<|reserved_token_{id}|>` otherwise.
//! - **Encoding** cuts the text as `TikTokenTokenizer.encode` does before tiktoken sees it: into
//!   chunks of 400,000 characters, then into runs of at most 25,000 whitespace or non-whitespace
//!   characters (Python's `str.isspace`). Each cut changes the ids of a long run, so it is kept.
//!   Within a chunk, special-token names are matched first (when allowed), the text between them
//!   is split with the pattern, and each piece is merged by rank as tiktoken's `byte_pair_encode`
//!   does (the lowest-ranked adjacent pair first, the leftmost on a tie).
//! - **Decoding** concatenates the tokens' bytes and reads them as UTF-8, with U+FFFD for
//!   invalid sequences (tiktoken's `errors="replace"`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde_json::Value;

use crate::error::{ModelError, Result};

/// Kimi's split pattern, verbatim from `tokenization_kimi.py` (its eight alternatives joined by
/// `|`).
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+",
);

/// `num_reserved_special_tokens` of `tokenization_kimi.py`; it makes `256 + 2` special ids.
pub const NUM_RESERVED_SPECIAL_TOKENS: u32 = 256;
/// How many special ids follow the BPE tokens (`range(N, N + 256 + 2)` in `tokenization_kimi.py`).
pub const NUM_SPECIAL_IDS: u32 = NUM_RESERVED_SPECIAL_TOKENS + 2;
/// `TIKTOKEN_MAX_ENCODE_CHARS` of `TikTokenTokenizer.encode`: the text is encoded in chunks of this
/// many characters.
pub const MAX_ENCODE_CHARS: usize = 400_000;
/// `MAX_NO_WHITESPACES_CHARS` of `TikTokenTokenizer.encode`: no chunk holds a longer run of
/// whitespace or of non-whitespace characters.
pub const MAX_RUN_CHARS: usize = 25_000;
/// The largest `tiktoken.model` read (Kimi-K2's is about 2.8 MB).
pub const MAX_MODEL_FILE_BYTES: u64 = 64 << 20;

/// One special token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecialToken {
    pub id: u32,
    pub content: String,
    /// `special` of its `added_tokens_decoder` entry (true for the reserved names). Decoding that
    /// skips special tokens skips these; the tool-call markers Kimi marks `special: false` stay.
    pub special: bool,
}

/// A tiktoken BPE with Kimi's split pattern and special tokens.
pub struct TiktokenBpe {
    /// Token bytes → rank (= id).
    ranks: HashMap<Vec<u8>, u32>,
    /// Rank → token bytes; `ranks.len()` entries.
    tokens: Vec<Vec<u8>>,
    /// The special tokens, `specials[i].id == tokens.len() + i`.
    specials: Vec<SpecialToken>,
    special_ids: HashMap<String, u32>,
    /// The special-token names as one alternation, longest first.
    special_regex: regex::Regex,
    split: fancy_regex::Regex,
}

/// The split pattern compiled (as tiktoken compiles it).
pub fn kimi_split_regex() -> fancy_regex::Regex {
    fancy_regex::Regex::new(KIMI_PATTERN).expect("Kimi's split pattern compiles")
}

/// The pieces `text` splits into under [`KIMI_PATTERN`] (no special tokens, no chunking): what
/// tiktoken's `findall` of the pattern gives.
pub fn split_pieces<'t>(re: &fancy_regex::Regex, text: &'t str) -> Result<Vec<&'t str>> {
    re.find_iter(text)
        .map(|m| m.map(|m| m.as_str()).map_err(|e| ModelError::Tokenizer(format!("split pattern: {e}"))))
        .collect()
}

/// Python's `str.isspace`: Unicode White_Space plus U+001C..U+001F (which Python counts as
/// separators).
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `TikTokenTokenizer.encode`'s cuts: chunks of [`MAX_ENCODE_CHARS`] characters, each cut so that
/// no piece holds more than [`MAX_RUN_CHARS`] consecutive whitespace or non-whitespace characters
/// (`_split_whitespaces_or_nonwhitespaces`, which yields one empty piece for an empty chunk).
pub fn kimi_chunks(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).step_by(MAX_ENCODE_CHARS).collect();
    let mut chunks = Vec::with_capacity(bounds.len());
    for (k, &start) in bounds.iter().enumerate() {
        let end = bounds.get(k + 1).copied().unwrap_or(text.len());
        chunks.push(&text[start..end]);
    }
    if chunks.is_empty() {
        // `range(0, 0, ...)` is empty: an empty text makes no chunk at all.
        return out;
    }
    for s in chunks {
        let mut run_len = 0usize;
        let mut run_is_space = s.chars().next().is_some_and(py_isspace);
        let mut start = 0usize;
        for (i, c) in s.char_indices() {
            let is_space = py_isspace(c);
            if run_is_space != is_space {
                run_len = 1;
                run_is_space = is_space;
            } else {
                run_len += 1;
                if run_len > MAX_RUN_CHARS {
                    out.push(&s[start..i]);
                    start = i;
                    run_len = 1;
                }
            }
        }
        out.push(&s[start..]);
    }
    out
}

impl TiktokenBpe {
    /// Reads `tiktoken.model` at `path`; the special tokens are named by `added_tokens_decoder`
    /// (the object of `tokenizer_config.json`, if any; `config_path` names that file in errors).
    pub fn load(path: &Path, added_tokens_decoder: Option<&Value>, config_path: &Path) -> Result<TiktokenBpe> {
        let len = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?.len();
        if len > MAX_MODEL_FILE_BYTES {
            return Err(ModelError::Tokenizer(format!(
                "{}: {len} bytes, more than the {MAX_MODEL_FILE_BYTES} a tiktoken model is read up to",
                path.display()
            )));
        }
        let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_bytes(&bytes, path, added_tokens_decoder, config_path)
    }

    /// As [`TiktokenBpe::load`], from the file's bytes (`path` only names it in errors).
    pub fn from_bytes(
        bytes: &[u8],
        path: &Path,
        added_tokens_decoder: Option<&Value>,
        config_path: &Path,
    ) -> Result<TiktokenBpe> {
        let (ranks, tokens) = parse_ranks(bytes, path)?;
        let specials = special_tokens(tokens.len() as u32, added_tokens_decoder, config_path)?;
        Self::new(ranks, tokens, specials)
    }

    fn new(ranks: HashMap<Vec<u8>, u32>, tokens: Vec<Vec<u8>>, specials: Vec<SpecialToken>) -> Result<TiktokenBpe> {
        let mut special_ids = HashMap::with_capacity(specials.len());
        for s in &specials {
            special_ids.insert(s.content.clone(), s.id);
        }
        let mut names: Vec<&str> = specials.iter().map(|s| s.content.as_str()).collect();
        // Longest first, so a name that is a prefix of another never hides it.
        names.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
        let alternation = names.iter().map(|n| regex::escape(n)).collect::<Vec<_>>().join("|");
        let special_regex = regex::Regex::new(&alternation)
            .map_err(|e| ModelError::Tokenizer(format!("special-token names do not compile: {e}")))?;
        Ok(TiktokenBpe { ranks, tokens, specials, special_ids, special_regex, split: kimi_split_regex() })
    }

    /// How many BPE tokens (ranks) the model file has; the special ids follow.
    pub fn num_base_tokens(&self) -> u32 {
        self.tokens.len() as u32
    }

    /// All ids: the BPE tokens and the special ids.
    pub fn vocab_size(&self) -> u32 {
        self.num_base_tokens() + self.specials.len() as u32
    }

    /// The special tokens, by id.
    pub fn special_tokens(&self) -> &[SpecialToken] {
        &self.specials
    }

    /// The id of a token string: a special token's name, or a BPE token whose bytes are that
    /// string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.special_ids.get(token).copied().or_else(|| self.ranks.get(token.as_bytes()).copied())
    }

    /// Encodes `text` as `TikTokenTokenizer.encode(text, allow_special_tokens)`: with
    /// `allow_special` a special token's name in the text becomes its id; without, it is plain
    /// text.
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        for chunk in kimi_chunks(text) {
            if allow_special {
                self.encode_with_specials(chunk, &mut ids)?;
            } else {
                self.encode_ordinary(chunk, &mut ids)?;
            }
        }
        Ok(ids)
    }

    /// tiktoken's `CoreBPE::encode` with every special token allowed.
    fn encode_with_specials(&self, text: &str, ids: &mut Vec<u32>) -> Result<()> {
        let mut start = 0;
        loop {
            let next = self.special_regex.find_at(text, start);
            let end = next.map_or(text.len(), |m| m.start());
            self.encode_ordinary(&text[start..end], ids)?;
            match next {
                Some(m) => {
                    ids.push(self.special_ids[m.as_str()]);
                    start = m.end();
                }
                None => return Ok(()),
            }
        }
    }

    /// tiktoken's `encode_ordinary`: split, then merge each piece.
    fn encode_ordinary(&self, text: &str, ids: &mut Vec<u32>) -> Result<()> {
        for piece in split_pieces(&self.split, text)? {
            let piece = piece.as_bytes();
            match self.ranks.get(piece) {
                Some(&id) => ids.push(id),
                None => self.byte_pair_encode(piece, ids),
            }
        }
        Ok(())
    }

    /// tiktoken's `byte_pair_encode`: repeatedly merge the adjacent pair whose concatenation has
    /// the lowest rank (the leftmost of equal ones) until no pair has a rank.
    fn byte_pair_encode(&self, piece: &[u8], ids: &mut Vec<u32>) {
        let rank_of = |bytes: &[u8]| self.ranks.get(bytes).copied().unwrap_or(u32::MAX);
        if piece.len() == 1 {
            ids.push(rank_of(piece));
            return;
        }
        // (start of part, rank of the part merged with the next one).
        let mut parts: Vec<(usize, u32)> = Vec::with_capacity(piece.len() + 1);
        let mut min = (u32::MAX, usize::MAX);
        for i in 0..piece.len() - 1 {
            let r = rank_of(&piece[i..i + 2]);
            if r < min.0 {
                min = (r, i);
            }
            parts.push((i, r));
        }
        parts.push((piece.len() - 1, u32::MAX));
        parts.push((piece.len(), u32::MAX));
        let pair_rank = |parts: &[(usize, u32)], i: usize| {
            if i + 3 < parts.len() {
                rank_of(&piece[parts[i].0..parts[i + 3].0])
            } else {
                u32::MAX
            }
        };
        while min.0 != u32::MAX {
            let i = min.1;
            if i > 0 {
                parts[i - 1].1 = pair_rank(&parts, i - 1);
            }
            parts[i].1 = pair_rank(&parts, i);
            parts.remove(i + 1);
            min = (u32::MAX, usize::MAX);
            for (i, &(_, r)) in parts[..parts.len() - 1].iter().enumerate() {
                if r < min.0 {
                    min = (r, i);
                }
            }
        }
        // Every part is a ranked token: single bytes all have ranks (checked on load) and a merge
        // only joins parts whose concatenation has one.
        ids.extend(parts.windows(2).map(|w| rank_of(&piece[w[0].0..w[1].0])));
    }

    /// The bytes of `ids` (special tokens as their names, unless `skip_special` and the token is
    /// special), read as UTF-8 with U+FFFD for invalid sequences. An id outside the vocabulary is
    /// an error.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let mut bytes = Vec::new();
        for &id in ids {
            if let Some(t) = self.tokens.get(id as usize) {
                bytes.extend_from_slice(t);
            } else if let Some(s) = id.checked_sub(self.num_base_tokens()).and_then(|i| self.specials.get(i as usize)) {
                if !(skip_special && s.special) {
                    bytes.extend_from_slice(s.content.as_bytes());
                }
            } else {
                return Err(ModelError::Tokenizer(format!(
                    "token id {id} is outside the vocabulary ({} ids)",
                    self.vocab_size()
                )));
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// Token bytes → rank.
type Ranks = HashMap<Vec<u8>, u32>;

/// A model-file error at 1-based `line`.
fn line_err(path: &Path, line: usize, msg: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(format!("{}:{line}: {msg}", path.display()))
}

/// Parses `<base64> <rank>` lines (blank lines skipped, as `load_tiktoken_bpe` does) into
/// bytes → rank and rank → bytes. The ranks must be exactly `0..N` and every single byte must
/// have one. Nothing is allocated by a number read from the file: the tables grow by line.
fn parse_ranks(bytes: &[u8], path: &Path) -> Result<(Ranks, Vec<Vec<u8>>)> {
    let mut ranks: HashMap<Vec<u8>, u32> = HashMap::new();
    let mut by_rank: Vec<(u32, usize)> = Vec::new();
    let mut token_bytes: Vec<Vec<u8>> = Vec::new();
    // `bytes.splitlines()`: \n, \r\n and \r end a line.
    let mut lines = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\n' => {
                lines.push(&bytes[start..i]);
                start = i + 1;
            }
            b'\r' => {
                lines.push(&bytes[start..i]);
                if bytes.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    if start < bytes.len() {
        lines.push(&bytes[start..]);
    }
    for (n, line) in lines.iter().enumerate() {
        let line_no = n + 1;
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&[u8]> = line.split(|b| b.is_ascii_whitespace()).filter(|f| !f.is_empty()).collect();
        let [token, rank] = fields[..] else {
            return Err(line_err(
                path,
                line_no,
                format!("expected `<base64 token> <rank>`, found {} fields", fields.len()),
            ));
        };
        let token = base64::engine::general_purpose::STANDARD
            .decode(token)
            .map_err(|e| line_err(path, line_no, format!("token is not base64: {e}")))?;
        if token.is_empty() {
            return Err(line_err(path, line_no, "empty token"));
        }
        let rank: u32 = std::str::from_utf8(rank).ok().and_then(|r| r.parse().ok()).ok_or_else(|| {
            line_err(path, line_no, format!("rank `{}` is not an integer", String::from_utf8_lossy(rank)))
        })?;
        if let Some(&earlier) = ranks.get(&token) {
            let b64 = String::from_utf8_lossy(fields[0]);
            return Err(line_err(
                path,
                line_no,
                format!("token `{b64}` again (an earlier line gave it rank {earlier})"),
            ));
        }
        ranks.insert(token.clone(), rank);
        by_rank.push((rank, line_no));
        token_bytes.push(token);
    }
    let n = token_bytes.len();
    if n == 0 {
        return Err(ModelError::Tokenizer(format!("{}: no tokens", path.display())));
    }
    // Ranks must be 0..n: each below n and none twice.
    let mut tokens: Vec<Vec<u8>> = vec![Vec::new(); n];
    let mut seen = vec![0usize; n];
    for ((rank, line_no), token) in by_rank.into_iter().zip(token_bytes) {
        let r = rank as usize;
        if r >= n {
            return Err(line_err(path, line_no, format!("rank {rank} with {n} tokens: the ranks must be 0..{n}")));
        }
        if seen[r] != 0 {
            return Err(line_err(path, line_no, format!("rank {rank} again (line {} has it)", seen[r])));
        }
        seen[r] = line_no;
        tokens[r] = token;
    }
    if let Some(b) = (0..=255u8).find(|&b| !ranks.contains_key(&[b][..])) {
        return Err(ModelError::Tokenizer(format!(
            "{}: byte 0x{b:02x} has no token (a byte-level BPE ranks every single byte)",
            path.display()
        )));
    }
    Ok((ranks, tokens))
}

/// The special tokens `n..n + 258`, named as `tokenization_kimi.py` names them: by
/// `added_tokens_decoder` where it has the id, `<|reserved_token_{id}|>` otherwise. Entries of
/// `added_tokens_decoder` outside that range are ignored, as there.
fn special_tokens(n: u32, added_tokens_decoder: Option<&Value>, config_path: &Path) -> Result<Vec<SpecialToken>> {
    let err = |msg: String| ModelError::Json {
        path: PathBuf::from(config_path),
        msg: format!("`added_tokens_decoder`: {msg}"),
    };
    let mut named: HashMap<u32, (String, bool)> = HashMap::new();
    match added_tokens_decoder {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => {
            for (key, entry) in map {
                let id: u32 = key.parse().map_err(|_| err(format!("key `{key}` is not a token id")))?;
                let content = entry
                    .get("content")
                    .and_then(Value::as_str)
                    .ok_or_else(|| err(format!("entry {key} has no string `content`")))?;
                let special = entry.get("special").and_then(Value::as_bool).unwrap_or(true);
                named.insert(id, (content.to_string(), special));
            }
        }
        Some(_) => return Err(err("not an object".into())),
    }
    let mut out = Vec::with_capacity(NUM_SPECIAL_IDS as usize);
    let mut seen: HashMap<String, u32> = HashMap::new();
    for id in n..n + NUM_SPECIAL_IDS {
        let (content, special) = named.remove(&id).unwrap_or_else(|| (format!("<|reserved_token_{id}|>"), true));
        if content.is_empty() {
            return Err(err(format!("entry {id} has an empty `content`")));
        }
        if let Some(other) = seen.insert(content.clone(), id) {
            return Err(err(format!("ids {other} and {id} are both `{content}`")));
        }
        out.push(SpecialToken { id, content, special });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model file of the 256 bytes (rank = byte) and `merges` after them.
    fn model_file(merges: &[&str]) -> String {
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let mut s = String::new();
        for b in 0..=255u8 {
            s += &format!("{} {b}\n", b64(&[b]));
        }
        for (k, m) in merges.iter().enumerate() {
            s += &format!("{} {}\n", b64(m.as_bytes()), 256 + k);
        }
        s
    }

    fn load(text: &str) -> Result<TiktokenBpe> {
        TiktokenBpe::from_bytes(text.as_bytes(), Path::new("dir/tiktoken.model"), None, Path::new("cfg.json"))
    }

    #[test]
    fn merges_by_rank_and_round_trips() {
        let bpe = load(&model_file(&["he", "ll", "hell", "hello", " w"])).unwrap();
        assert_eq!(bpe.num_base_tokens(), 261);
        assert_eq!(bpe.vocab_size(), 261 + 258);
        // "hello" is one piece and one token; " world" merges " w" then leaves bytes.
        let ids = bpe.encode("hello world", true).unwrap();
        assert_eq!(ids, vec![259, 260, b'o' as u32, b'r' as u32, b'l' as u32, b'd' as u32]);
        assert_eq!(bpe.decode(&ids, false).unwrap(), "hello world");
        // Two equal pairs: the leftmost merges.
        assert_eq!(bpe.encode("lll", true).unwrap(), vec![257, b'l' as u32]);
    }

    #[test]
    fn special_tokens_follow_the_scheme_and_the_config() {
        let decoder = serde_json::json!({
            "256": { "content": "[BOS]", "special": true },
            "258": { "content": "<|tool|>", "special": false },
            "9999": { "content": "ignored" },
        });
        let bpe = TiktokenBpe::from_bytes(
            model_file(&[]).as_bytes(),
            Path::new("tiktoken.model"),
            Some(&decoder),
            Path::new("cfg.json"),
        )
        .unwrap();
        assert_eq!(bpe.token_to_id("[BOS]"), Some(256));
        assert_eq!(bpe.token_to_id("<|reserved_token_257|>"), Some(257));
        assert_eq!(bpe.token_to_id("<|reserved_token_513|>"), Some(513));
        assert_eq!(bpe.token_to_id("<|reserved_token_514|>"), None);
        assert_eq!(bpe.token_to_id("ignored"), None);
        let ids = bpe.encode("a[BOS]<|tool|>", true).unwrap();
        assert_eq!(ids, vec![b'a' as u32, 256, 258]);
        assert_eq!(bpe.encode("[BOS]", false).unwrap().len(), 5);
        assert_eq!(bpe.decode(&ids, true).unwrap(), "a<|tool|>");
        assert_eq!(bpe.decode(&ids, false).unwrap(), "a[BOS]<|tool|>");
        let e = bpe.decode(&[514], false).unwrap_err().to_string();
        assert!(e.contains("514") && e.contains("514 ids"), "{e}");
    }

    #[test]
    fn a_bad_model_file_names_file_and_line() {
        let good = model_file(&["ab"]);
        let with_line = |extra: &str| format!("{good}{extra}\n");
        let cases = [
            (with_line("YWJj"), "dir/tiktoken.model:258: expected `<base64 token> <rank>`, found 1 fields"),
            (with_line("!!!! 257"), "dir/tiktoken.model:258: token is not base64"),
            (with_line("YWJj x"), "dir/tiktoken.model:258: rank `x` is not an integer"),
            (with_line("YWJj 4000000000"), "dir/tiktoken.model:258: rank 4000000000 with 258 tokens"),
            (with_line("YWJj 256"), "dir/tiktoken.model:258: rank 256 again (line 257 has it)"),
            (with_line("YWI= 257"), "dir/tiktoken.model:258: token `YWI=` again (an earlier line gave it rank 256)"),
            (String::new(), "dir/tiktoken.model: no tokens"),
            (good.replacen("AA== 0\n", "", 1).replace(" 256\n", " 0\n"), "byte 0x00 has no token"),
        ];
        for (text, want) in cases {
            let e = load(&text).err().expect("refused").to_string();
            assert!(e.contains(want), "{e}\nwanted: {want}");
        }
    }

    #[test]
    fn a_config_naming_one_token_twice_is_refused() {
        let decoder = serde_json::json!({ "256": { "content": "<|reserved_token_257|>" } });
        let e =
            TiktokenBpe::from_bytes(model_file(&[]).as_bytes(), Path::new("m"), Some(&decoder), Path::new("cfg.json"))
                .err()
                .expect("refused")
                .to_string();
        assert!(e.contains("cfg.json") && e.contains("ids 256 and 257"), "{e}");
    }

    #[test]
    fn chunks_cut_long_runs_as_kimi_does() {
        assert!(kimi_chunks("").is_empty());
        assert_eq!(kimi_chunks("a b"), vec!["a b"]);
        let text = format!("{}{}", "x".repeat(MAX_RUN_CHARS + 3), " ".repeat(2));
        let chunks = kimi_chunks(&text);
        assert_eq!(chunks.iter().map(|c| c.len()).collect::<Vec<_>>(), vec![MAX_RUN_CHARS, 5]);
        // U+001C is a space to Python (not to Unicode's White_Space).
        let text = format!("{}\u{1c}{}", "x".repeat(MAX_RUN_CHARS), "y".repeat(MAX_RUN_CHARS));
        assert_eq!(kimi_chunks(&text).len(), 1);
    }

    /// The `regex` crate reads the `&&` intersections itself; only the lookahead of `\s+(?!\S)` needs
    /// `fancy-regex`.
    #[test]
    #[allow(clippy::invalid_regex)] // The failure is the point.
    fn only_the_lookahead_needs_fancy_regex() {
        let e = regex::Regex::new(KIMI_PATTERN).unwrap_err().to_string();
        assert!(e.contains("look-around"), "{e}");
        let without = KIMI_PATTERN.replace(r"|\s+(?!\S)", "");
        assert_ne!(without, KIMI_PATTERN);
        let re = regex::Regex::new(&without).unwrap();
        // Han is taken out of the letter classes: "abc中文def" is three pieces.
        let pieces: Vec<&str> = re.find_iter("abc中文def").map(|m| m.as_str()).collect();
        assert_eq!(pieces, vec!["abc", "中文", "def"]);
    }
}
