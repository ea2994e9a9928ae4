//! The prefix cache: the state of finished requests' token sequences ([`SavedPrefix`]), found
//! again by the hash of a new prompt's leading blocks, so that a request that starts the same way
//! (the next turn of a conversation, a shared system prompt) prefills only the tokens after the
//! shared part.
//!
//! - **Keys.** Every saved sequence is indexed by the hash of each of its whole
//!   [`BLOCK_TOKENS`]-token prefixes (a chain: block `k`'s hash covers blocks `0..=k`). A lookup
//!   hashes the prompt's blocks once and walks from its longest prefix down, so it costs one hash
//!   per block and one comparison per candidate, however many entries there are.
//! - **Sharing.** An entry is read, never consumed: every request that shares it resumes from a
//!   copy of its state ([`crate::runtime::Engine::resume_prefix`]).
//! - **Eviction.** Entries are dropped least recently used first while their bytes exceed the
//!   budget. An entry whose tokens another entry extends is dropped at once (the longer one
//!   serves every request the shorter one would).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use super::SavedPrefix;

/// Tokens per hashed block: the granularity of a lookup's first match (the match is then
/// extended token by token), and the least reuse worth a lookup: fewer shared tokens cost less to
/// prefill again than the state copy.
pub const BLOCK_TOKENS: usize = 64;

struct Entry {
    tokens: Vec<u32>,
    saved: Box<dyn SavedPrefix>,
    /// Lookup clock of its last use (LRU).
    used: u64,
}

/// What a lookup found: the entry and how many of the prompt's tokens it resumes.
pub struct Hit<'a> {
    pub saved: &'a dyn SavedPrefix,
    pub tokens: usize,
}

/// The cache (owned by the scheduler thread).
pub struct PrefixCache {
    budget: usize,
    bytes: usize,
    entries: HashMap<u64, Entry>,
    /// Chain hash of a block prefix → the entries holding that prefix.
    index: HashMap<u64, Vec<u64>>,
    next_id: u64,
    clock: u64,
}

/// The chain hashes of `tokens`' whole blocks: element `k` covers `tokens[..(k + 1) * BLOCK_TOKENS]`.
fn block_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut prev = 0u64;
    tokens
        .chunks_exact(BLOCK_TOKENS)
        .map(|block| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            prev.hash(&mut h);
            block.hash(&mut h);
            prev = h.finish();
            prev
        })
        .collect()
}

impl PrefixCache {
    /// A cache holding at most `budget` bytes of saved state (0: keeps nothing).
    pub fn new(budget: usize) -> Self {
        PrefixCache { budget, bytes: 0, entries: HashMap::new(), index: HashMap::new(), next_id: 0, clock: 0 }
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry that resumes the most of `prompt`, leaving at least its last `keep` tokens to
    /// run (at least one: the step that samples the reply needs one;
    /// [`crate::runtime::Engine::prefill_min_tokens`]), and at least [`BLOCK_TOKENS`] tokens of
    /// reuse.
    pub fn lookup(&mut self, prompt: &[u32], keep: usize) -> Option<Hit<'_>> {
        let limit = prompt.len().checked_sub(keep.max(1))?;
        let hashes = block_hashes(&prompt[..limit]);
        let mut best: Option<(u64, usize)> = None;
        for (k, h) in hashes.iter().enumerate().rev() {
            let shared_blocks = (k + 1) * BLOCK_TOKENS;
            if best.is_some_and(|(_, n)| n >= shared_blocks + BLOCK_TOKENS) {
                break; // no shorter block prefix can beat what was found
            }
            for id in self.index.get(h).into_iter().flatten() {
                let e = &self.entries[id];
                let common = e.tokens.iter().zip(&prompt[..limit]).take_while(|(a, b)| a == b).count();
                let n = e.saved.resumable(common.min(e.saved.len()));
                if n >= BLOCK_TOKENS && best.is_none_or(|(_, b)| n > b) {
                    best = Some((*id, n));
                }
            }
        }
        let (id, tokens) = best?;
        self.clock += 1;
        let e = self.entries.get_mut(&id).expect("indexed entries exist");
        e.used = self.clock;
        Some(Hit { saved: e.saved.as_ref(), tokens })
    }

    /// Keeps `saved`, the state of `tokens` (its length must be `tokens.len()`), then drops the
    /// least recently used entries over the budget. An entry that is a prefix of these tokens
    /// goes; these are not kept when an entry already extends them or they alone exceed the budget.
    pub fn insert(&mut self, tokens: Vec<u32>, saved: Box<dyn SavedPrefix>) {
        debug_assert_eq!(tokens.len(), saved.len(), "a saved prefix holds its tokens' state");
        if tokens.len() < BLOCK_TOKENS || saved.bytes() > self.budget {
            return;
        }
        let hashes = block_hashes(&tokens);
        let mut covered = false;
        let mut shorter = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for id in hashes.iter().filter_map(|h| self.index.get(h)).flatten() {
            if !seen.insert(*id) {
                continue;
            }
            let e = &self.entries[id];
            let common = e.tokens.iter().zip(&tokens).take_while(|(a, b)| a == b).count();
            // A shorter entry goes only where the new one resumes at its end too (a recurrent
            // model's new entry may hold no snapshot there).
            if common == e.tokens.len() && e.tokens.len() <= tokens.len() && saved.resumable(common) == common {
                shorter.push(*id);
            } else if common == tokens.len() && e.saved.resumable(common) == common {
                covered = true;
            }
        }
        for id in shorter {
            self.remove(id);
        }
        if covered {
            return;
        }
        let id = self.next_id;
        self.next_id += 1;
        for h in hashes {
            self.index.entry(h).or_default().push(id);
        }
        self.clock += 1;
        self.bytes += saved.bytes();
        self.entries.insert(id, Entry { tokens, saved, used: self.clock });
        while self.bytes > self.budget {
            let Some(oldest) = self.entries.iter().min_by_key(|(_, e)| e.used).map(|(id, _)| *id) else { break };
            self.remove(oldest);
        }
    }

    /// Drops the least recently used entry (to free memory for a new session); false when empty.
    pub fn evict_one(&mut self) -> bool {
        match self.entries.iter().min_by_key(|(_, e)| e.used).map(|(id, _)| *id) {
            Some(id) => {
                self.remove(id);
                true
            }
            None => false,
        }
    }

    fn remove(&mut self, id: u64) {
        let Some(e) = self.entries.remove(&id) else { return };
        self.bytes -= e.saved.bytes();
        for h in block_hashes(&e.tokens) {
            if let Some(ids) = self.index.get_mut(&h) {
                ids.retain(|&x| x != id);
                if ids.is_empty() {
                    self.index.remove(&h);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A saved prefix of `len` tokens resumable at every length (or only at `points`).
    struct Fake {
        len: usize,
        bytes: usize,
        points: Option<Vec<usize>>,
    }

    impl SavedPrefix for Fake {
        fn len(&self) -> usize {
            self.len
        }
        fn bytes(&self) -> usize {
            self.bytes
        }
        fn resumable(&self, upto: usize) -> usize {
            match &self.points {
                None => upto.min(self.len),
                Some(p) => p.iter().copied().filter(|&x| x <= upto).max().unwrap_or(0),
            }
        }
    }

    fn fake(len: usize) -> Box<dyn SavedPrefix> {
        Box::new(Fake { len, bytes: len, points: None })
    }

    fn seq(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i.wrapping_mul(2654435761).wrapping_add(salt) % 1000).collect()
    }

    #[test]
    fn a_prompt_extending_a_saved_sequence_resumes_all_of_it_but_its_last_token() {
        let mut c = PrefixCache::new(1 << 20);
        let turn1 = seq(300, 1);
        c.insert(turn1.clone(), fake(300));
        let mut turn2 = turn1.clone();
        turn2.extend(seq(50, 7));
        assert_eq!(c.lookup(&turn2, 1).map(|h| h.tokens), Some(300));
        // The same prompt again: everything but the last token.
        assert_eq!(c.lookup(&turn1, 1).map(|h| h.tokens), Some(299));
        // An engine whose prompt steps take two tokens at least (the row-invariant prefill).
        assert_eq!(c.lookup(&turn1, 2).map(|h| h.tokens), Some(298));
        assert_eq!(c.lookup(&turn2, 2).map(|h| h.tokens), Some(300));
        // A prompt that departs at token 200 resumes 200 (not a block multiple).
        let mut other = turn1[..200].to_vec();
        other.extend(seq(100, 9));
        assert_eq!(c.lookup(&other, 1).map(|h| h.tokens), Some(200));
        // Sharing under one block is no hit.
        let mut short = turn1[..40].to_vec();
        short.extend(seq(100, 9));
        assert!(c.lookup(&short, 1).is_none());
        assert!(c.lookup(&seq(500, 3), 1).is_none());
    }

    #[test]
    fn recurrent_models_resume_only_at_their_snapshots() {
        let mut c = PrefixCache::new(1 << 20);
        let t = seq(600, 2);
        c.insert(t.clone(), Box::new(Fake { len: 600, bytes: 10, points: Some(vec![256, 512, 600]) }));
        let mut p = t[..550].to_vec();
        p.extend(seq(20, 5));
        assert_eq!(c.lookup(&p, 1).map(|h| h.tokens), Some(512));
        let mut p = t.clone();
        p.push(1);
        assert_eq!(c.lookup(&p, 1).map(|h| h.tokens), Some(600));
    }

    #[test]
    fn the_longest_match_wins_and_extended_entries_are_replaced() {
        let mut c = PrefixCache::new(1 << 20);
        let a = seq(200, 1);
        let mut b = a.clone();
        b.extend(seq(200, 4));
        c.insert(a.clone(), fake(200));
        c.insert(b.clone(), fake(400));
        assert_eq!(c.len(), 1, "the entry the second one extends is dropped");
        assert_eq!(c.bytes(), 400);
        // Inserting the shorter one again adds nothing.
        c.insert(a.clone(), fake(200));
        assert_eq!(c.len(), 1);
        let mut p = b.clone();
        p.extend(seq(10, 8));
        assert_eq!(c.lookup(&p, 1).map(|h| h.tokens), Some(400));
    }

    #[test]
    fn least_recently_used_entries_go_first_over_the_budget() {
        let mut c = PrefixCache::new(1000);
        let (a, b, d) = (seq(400, 1), seq(400, 2), seq(400, 3));
        c.insert(a.clone(), fake(400));
        c.insert(b.clone(), fake(400));
        let mut pa = a.clone();
        pa.push(5);
        assert!(c.lookup(&pa, 1).is_some()); // a is now the most recent
        c.insert(d.clone(), fake(400));
        assert_eq!(c.len(), 2);
        assert!(c.bytes() <= 1000);
        let mut pb = b.clone();
        pb.push(5);
        assert!(c.lookup(&pb, 1).is_none(), "b was the least recently used");
        assert!(c.lookup(&pa, 1).is_some());
        // Too big alone: not kept. Disabled: nothing kept.
        c.insert(seq(2000, 9), fake(2000));
        assert_eq!(c.len(), 2);
        let mut off = PrefixCache::new(0);
        off.insert(a, fake(400));
        assert!(off.is_empty() && !off.enabled());
        assert!(c.evict_one() && c.evict_one() && !c.evict_one());
        assert_eq!(c.bytes(), 0);
    }
}
