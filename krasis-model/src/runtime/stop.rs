//! Stop strings matched across token boundaries: text that could still be the start of a stop
//! string is held back until the next delta decides, so a stop string split over several tokens
//! is cut exactly and never half-emitted.

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;
/// Longest stop string in bytes: bounds the text held back per stream.
pub const MAX_STOP_BYTES: usize = 256;

/// Feeds text deltas through a request's stop strings.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text that may be the beginning of a stop string (emitted once ruled out).
    held: String,
    /// The index in `stops` of the stop string that matched, once one has.
    hit: Option<usize>,
}

/// What one delta produced: text to emit now and whether a stop string ended the generation.
#[derive(Debug, PartialEq, Eq)]
pub struct Matched {
    pub emit: String,
    pub stopped: bool,
}

impl StopMatcher {
    /// `stops` must be non-empty strings (the request checks; empty ones are ignored here).
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new(), hit: None }
    }

    /// Adds a delta. On a match, `emit` is the text before the earliest stop string and the
    /// stop string itself (and anything after it) is dropped.
    pub fn push(&mut self, delta: &str) -> Matched {
        if self.stops.is_empty() {
            return Matched { emit: delta.to_string(), stopped: false };
        }
        self.held.push_str(delta);
        let first =
            self.stops.iter().enumerate().filter_map(|(i, s)| self.held.find(s.as_str()).map(|at| (at, i))).min();
        if let Some((at, i)) = first {
            let emit = self.held[..at].to_string();
            self.held.clear();
            self.hit = Some(i);
            return Matched { emit, stopped: true };
        }
        let keep = self.stops.iter().map(|s| partial_suffix(&self.held, s)).max().unwrap_or(0);
        let emit: String = self.held.drain(..self.held.len() - keep).collect();
        Matched { emit, stopped: false }
    }

    /// The stop string that ended the generation, if one has: its index among the non-empty
    /// strings given to [`StopMatcher::new`] (the earliest in the text; of two starting at the
    /// same place, the first given).
    pub fn hit(&self) -> Option<usize> {
        self.hit
    }

    /// The held-back text at the end of a generation that no stop string ended.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`. Such a suffix
/// starts on a character boundary: it matches `stop`'s own first bytes, which begin a character.
fn partial_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
        .rev()
        .find(|&k| stop.is_char_boundary(k) && text.ends_with(&stop[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for d in deltas {
            let r = m.push(d);
            out.push_str(&r.emit);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_over_tokens_is_cut_exactly() {
        assert_eq!(run(&["END"], &["abc E", "N", "D tail"]), ("abc ".into(), true));
        assert_eq!(run(&["END"], &["abc E", "N", "x"]), ("abc ENx".into(), false));
        // The earliest of several matches wins.
        assert_eq!(run(&["zz", "b"], &["a", "bzz"]), ("a".into(), true));
        // The first stop string to complete ends the generation, even if a longer one that
        // starts earlier would have completed with the next token (proptest found this case).
        assert_eq!(run(&["bac", "a"], &["日b日日ba", "c"]), ("日b日日b".into(), true));
        assert_eq!(run(&["bac", "a"], &["日b日日b", "ac"]), ("日b日日".into(), true));
        // Held text is emitted once it cannot start a stop string.
        let mut m = StopMatcher::new(vec!["</s>".into()]);
        assert_eq!(m.push("x</"), Matched { emit: "x".into(), stopped: false });
        assert_eq!(m.push("b"), Matched { emit: "</b".into(), stopped: false });
        // Multi-byte characters on both sides.
        assert_eq!(run(&["日本"], &["é日", "本語"]), ("é".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn the_matched_stop_string_is_named() {
        let mut m = StopMatcher::new(vec!["zz".into(), "b".into()]);
        assert_eq!(m.push("a"), Matched { emit: "a".into(), stopped: false });
        assert_eq!(m.hit(), None);
        assert!(m.push("bzz").stopped);
        assert_eq!(m.hit(), Some(1), "the earliest in the text, not the first given");
        let mut m = StopMatcher::new(vec!["END".into(), "EN".into()]);
        assert!(m.push("xEND").stopped);
        assert_eq!(m.hit(), Some(0), "of two at the same place, the first given");
    }

    proptest! {
        /// However the text is cut into deltas, generation stops after the first delta that
        /// completes a stop string, and the output is the text so far up to the earliest
        /// occurrence of any stop string in it (all of the text when none occurs). A stop string
        /// that would only complete later never gets the chance: with stops "bac" and "a" and the
        /// deltas "..ba", "c", the "a" ends the generation.
        #[test]
        fn output_is_the_text_before_the_first_stop(
            text in "[abc日]{0,40}",
            stops in proptest::collection::vec("[abc日]{1,3}", 1..4),
            cuts in proptest::collection::vec(0usize..40, 0..10),
        ) {
            let chars: Vec<char> = text.chars().collect();
            let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c.min(chars.len())).collect();
            bounds.push(0);
            bounds.push(chars.len());
            bounds.sort_unstable();
            let deltas: Vec<String> = bounds.windows(2).map(|w| chars[w[0]..w[1]].iter().collect()).collect();
            let refs: Vec<&str> = deltas.iter().map(String::as_str).collect();
            let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            let mut want = (text.clone(), false);
            let mut so_far = String::new();
            for d in &deltas {
                so_far.push_str(d);
                if let Some(i) = stops.iter().filter_map(|s| so_far.find(s.as_str())).min() {
                    want = (so_far[..i].to_string(), true);
                    break;
                }
            }
            prop_assert_eq!(run(&stop_refs, &refs), want);
        }
    }
}
