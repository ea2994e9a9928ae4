//! The SentencePiece-style tokenizer a GGUF carries as `tokenizer.ggml.model = llama` (Llama 1/2,
//! Mistral v1, Phi-3 …), encoding as llama.cpp's `llm_tokenizer_spm` does:
//!
//! - **Special tokens** (control and user-defined, `token_type` 3 and 4) are cut out of the text
//!   first, the longest first; each becomes its id.
//! - **Each piece of text between them** gets a leading space when `add_space_prefix` is set
//!   (`tokenizer.ggml.add_space_prefix`, default true) and the piece starts the text or follows a
//!   special token; then every space becomes `▁` (U+2581).
//! - **Merging** starts from the piece's UTF-8 characters and repeatedly joins the adjacent pair
//!   whose concatenation is a token with the highest score (`tokenizer.ggml.scores`), the leftmost
//!   on a tie.
//! - **A symbol that is no token** (a character outside the vocabulary) becomes its UTF-8 bytes as
//!   the byte tokens `<0xXX>`, or the unknown token where a byte token is missing.
//! - **Decoding** turns `▁` back into spaces and byte tokens into bytes (invalid UTF-8 becomes
//!   U+FFFD), drops control tokens, and drops the one leading space the prefix added.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::error::{ModelError, Result};

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const TYPE_CONTROL: i128 = 3;
const TYPE_USER_DEFINED: i128 = 4;
const TYPE_BYTE: i128 = 6;

pub struct SpmTokenizer {
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i128>,
    ids: HashMap<String, u32>,
    /// The `<0xXX>` token of each byte.
    byte_ids: [Option<u32>; 256],
    unk_id: Option<u32>,
    add_space_prefix: bool,
    /// Control and user-defined tokens, the longest first (cut out of the text before merging).
    specials: Vec<u32>,
}

/// A candidate merge of the symbols `left` and its right neighbour.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged text: a stale entry (a side merged since) no longer matches.
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    /// The highest score first; on a tie, the leftmost.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then_with(|| o.left.cmp(&self.left))
    }
}

/// One symbol of the piece being merged: a byte range, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl SpmTokenizer {
    /// `tokens`, `scores` and `types` are the GGUF's `tokenizer.ggml.tokens`, `.scores` and
    /// `.token_type` (all of one length); `unk_id` its `tokenizer.ggml.unknown_token_id`.
    pub fn new(
        tokens: Vec<String>,
        scores: Vec<f32>,
        types: Vec<i128>,
        unk_id: Option<u32>,
        add_space_prefix: bool,
    ) -> Result<SpmTokenizer> {
        if scores.len() != tokens.len() || types.len() != tokens.len() {
            return Err(ModelError::Tokenizer(format!(
                "SentencePiece vocabulary: {} tokens, {} scores, {} token types",
                tokens.len(),
                scores.len(),
                types.len()
            )));
        }
        let mut ids = HashMap::with_capacity(tokens.len());
        let mut byte_ids = [None; 256];
        let mut specials = Vec::new();
        for (id, (tok, &ty)) in tokens.iter().zip(&types).enumerate() {
            let id = id as u32;
            // A later duplicate wins, as in llama.cpp's `token_to_id`.
            ids.insert(tok.clone(), id);
            if (ty == TYPE_CONTROL || ty == TYPE_USER_DEFINED) && !tok.is_empty() {
                specials.push(id);
            }
            if let Some(b) = tok.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
                if b.len() == 2 {
                    if let Ok(b) = u8::from_str_radix(b, 16) {
                        byte_ids[b as usize] = Some(id);
                    }
                }
            }
        }
        specials.sort_by(|&a, &b| tokens[b as usize].len().cmp(&tokens[a as usize].len()).then(a.cmp(&b)));
        Ok(SpmTokenizer { tokens, scores, types, ids, byte_ids, unk_id, add_space_prefix, specials })
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.ids.get(token).copied()
    }

    /// The text's ids (no BOS): special tokens cut out, the pieces between them merged.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        // Fragments: Ok(text) or Err(special id), cut by each special token in turn.
        let mut frags: Vec<std::result::Result<&str, u32>> = Vec::new();
        if !text.is_empty() {
            frags.push(Ok(text));
        }
        for &sid in &self.specials {
            let s = self.tokens[sid as usize].as_str();
            let mut next = Vec::with_capacity(frags.len());
            for f in frags {
                match f {
                    Ok(t) if t.contains(s) => {
                        let mut rest = t;
                        while let Some(at) = rest.find(s) {
                            if at > 0 {
                                next.push(Ok(&rest[..at]));
                            }
                            next.push(Err(sid));
                            rest = &rest[at + s.len()..];
                        }
                        if !rest.is_empty() {
                            next.push(Ok(rest));
                        }
                    }
                    other => next.push(other),
                }
            }
            frags = next;
        }
        let mut out = Vec::new();
        let mut prev_special = true;
        for f in frags {
            match f {
                Ok(t) => {
                    let mut piece = String::with_capacity(t.len() + 3);
                    if self.add_space_prefix && prev_special {
                        piece.push(' ');
                    }
                    piece.push_str(t);
                    let piece = piece.replace(' ', "\u{2581}");
                    self.merge(&piece, &mut out)?;
                    prev_special = false;
                }
                Err(id) => {
                    out.push(id);
                    prev_special = true;
                }
            }
        }
        Ok(out)
    }

    /// Merges one piece (spaces already `▁`) and appends its ids.
    fn merge(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let mut syms: Vec<Symbol> = Vec::new();
        for (i, (start, c)) in text.char_indices().enumerate() {
            syms.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: (start + c.len_utf8() < text.len()).then_some(i + 1),
            });
        }
        let mut queue = BinaryHeap::new();
        let bigram = |syms: &[Symbol], left: usize, right: usize| -> Option<Bigram> {
            let (l, r) = (syms[left], syms[right]);
            let id = *self.ids.get(&text[l.start..r.start + r.len])?;
            Some(Bigram { score: self.scores[id as usize], left, right, len: l.len + r.len })
        };
        for i in 1..syms.len() {
            queue.extend(bigram(&syms, i - 1, i));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (syms[b.left], syms[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue;
            }
            syms[b.left].len += r.len;
            syms[b.right].len = 0;
            syms[b.left].next = r.next;
            if let Some(n) = r.next {
                syms[n].prev = Some(b.left);
            }
            if let Some(p) = syms[b.left].prev {
                queue.extend(bigram(&syms, p, b.left));
            }
            if let Some(n) = syms[b.left].next {
                queue.extend(bigram(&syms, b.left, n));
            }
        }
        let mut i = if syms.is_empty() { None } else { Some(0) };
        while let Some(k) = i {
            let s = syms[k];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        let id = self.byte_ids[b as usize].or(self.unk_id).ok_or_else(|| {
                            ModelError::Tokenizer(format!(
                                "SentencePiece vocabulary has no byte token <0x{b:02X}> and no unknown token for \
                                 {piece:?}"
                            ))
                        })?;
                        out.push(id);
                    }
                }
            }
            i = s.next;
        }
        Ok(())
    }

    /// Decodes, dropping control tokens when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let mut bytes = Vec::new();
        for &id in ids {
            let i = id as usize;
            let tok = self
                .tokens
                .get(i)
                .ok_or_else(|| ModelError::Tokenizer(format!("token id {id} is outside the vocabulary")))?;
            match self.types[i] {
                TYPE_CONTROL if skip_special => {}
                TYPE_BYTE => match self.byte_ids.iter().position(|&b| b == Some(id)) {
                    Some(b) => bytes.push(b as u8),
                    None => bytes.extend_from_slice(tok.as_bytes()),
                },
                _ => bytes.extend_from_slice(tok.replace('\u{2581}', " ").as_bytes()),
            }
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        Ok(match text.strip_prefix(' ') {
            Some(rest) if self.add_space_prefix => rest.to_string(),
            _ => text,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small vocabulary; `ab_first` gives `ab` a higher score than `▁a`.
    fn vocab(ab_first: bool) -> SpmTokenizer {
        let toks = [
            ("<unk>", 0.0, 2),
            ("<s>", 0.0, 3),
            ("</s>", 0.0, 3),
            ("<0xC3>", 0.0, 6),
            ("<0xA9>", 0.0, 6),
            ("\u{2581}", -1.0, 1),
            ("a", -2.0, 1),
            ("b", -2.0, 1),
            ("ab", if ab_first { -0.5 } else { -3.0 }, 1),
            ("\u{2581}a", -1.5, 1),
        ];
        SpmTokenizer::new(
            toks.iter().map(|t| t.0.to_string()).collect(),
            toks.iter().map(|t| t.1).collect(),
            toks.iter().map(|t| t.2).collect(),
            Some(0),
            true,
        )
        .unwrap()
    }

    #[test]
    fn merges_the_highest_scoring_pair_first() {
        // "▁ab": the pairs ▁a and ab compete.
        assert_eq!(vocab(true).encode("ab").unwrap(), vec![5, 8]);
        assert_eq!(vocab(false).encode("ab").unwrap(), vec![9, 7]);
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes_and_specials_are_cut_out() {
        let v = vocab(true);
        assert_eq!(v.encode("\u{e9}").unwrap(), vec![5, 3, 4]);
        // After a special token the next piece gets the space prefix again.
        assert_eq!(v.encode("a</s>a").unwrap(), vec![9, 2, 9]);
        assert_eq!(v.encode("").unwrap(), Vec::<u32>::new());
        assert_eq!(v.decode(&[9, 2, 5, 3, 4], true).unwrap(), "a \u{e9}");
        assert_eq!(v.decode(&[5, 8], true).unwrap(), "ab");
    }

    #[test]
    fn without_add_space_prefix_no_space_is_added() {
        let mut v = vocab(true);
        v.add_space_prefix = false;
        assert_eq!(v.encode("ab").unwrap(), vec![8]);
        assert_eq!(v.encode(" a").unwrap(), vec![9]);
    }
}
