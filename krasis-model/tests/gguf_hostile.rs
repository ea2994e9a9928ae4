//! Randomised hostile GGUF headers: mutations of a valid file (flipped bytes, counts and lengths
//! overwritten with huge values, truncation) never panic the parser and never make it allocate
//! more than a small multiple of the file's size. A counting global allocator measures the peak
//! heap growth of the parsing thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use krasis_model::source::gguf::header::parse;
use krasis_model::source::gguf::writer::{GgufWriter, MetaValue};
use krasis_quant::ggml::GgmlType;
use proptest::prelude::*;

struct Counting;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn track(delta: isize) {
    // `try_with`: the thread-local may be gone while a thread is torn down.
    let _ = LIVE.try_with(|live| {
        let v = (live.get() as isize + delta).max(0) as usize;
        live.set(v);
        let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        track(l.size() as isize);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        track(-(l.size() as isize));
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        track(new as isize - l.size() as isize);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Bytes the parser may allocate beyond its input: a few containers per entry plus fixed
/// overhead (the parsed header of a valid file is ~10 words per key and tensor).
fn allowed(input: usize) -> usize {
    64 * input + (64 << 10)
}

/// Peak heap growth while parsing `b` (the parse's result is dropped inside), and whether it
/// parsed; an error must be one line.
fn parse_peak(b: &[u8]) -> (bool, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = parse(b);
    let ok = match &r {
        Ok(_) => true,
        Err(e) => {
            assert!(!e.contains('\n'), "multi-line error: {e}");
            false
        }
    };
    drop(r);
    (ok, PEAK.with(Cell::get) - base)
}

fn base_file() -> Vec<u8> {
    let mut w = GgufWriter::default();
    w.meta("general.architecture", MetaValue::Str("deepseek2".into()))
        .meta("deepseek2.block_count", MetaValue::U32(3))
        .meta("deepseek2.rope.freq_base", MetaValue::F32(10000.0))
        .meta("tokenizer.ggml.tokens", MetaValue::StrArray((0..40).map(|i| format!("t{i}")).collect()))
        .meta("tokenizer.ggml.token_type", MetaValue::I32Array(vec![1; 40]))
        .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false))
        .meta("general.size", MetaValue::U64(12345))
        .tensor("token_embd.weight", &[8, 4], GgmlType::F32, vec![0u8; 128])
        .tensor("blk.0.ffn_up_exps.weight", &[256, 2, 2], GgmlType::Q4K, vec![0u8; 4 * 144])
        .tensor("blk.0.attn_q.weight", &[32, 2], GgmlType::Q8_0, vec![0u8; 68]);
    w.to_bytes()
}

/// Values that break naive readers when they land on a count or a length.
const NASTY: [u64; 8] = [0, 1, 0xffff_ffff, 1 << 32, 1 << 40, 1 << 60, u64::MAX, u64::MAX / 3];

#[test]
fn the_base_file_parses_and_stays_within_the_bound() {
    let b = base_file();
    let (ok, peak) = parse_peak(&b);
    assert!(ok);
    assert!(peak <= allowed(b.len()), "{peak} bytes for a {}-byte file", b.len());
    // The counter is live: parsing allocates something (a vacuous bound would pass at 0).
    assert!(peak > 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn mutated_headers_never_panic_or_over_allocate(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        words in proptest::collection::vec((any::<prop::sample::Index>(), 0..NASTY.len()), 0..4),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        let mut b = base_file();
        // Only the header is interesting; the data section is opaque to the parser.
        let header_len = b.len() - 4 * 144 - 128 - 68;
        for (at, v) in flips {
            let i = at.index(header_len);
            b[i] = v;
        }
        for (at, which) in words {
            let i = at.index(header_len - 8);
            b[i..i + 8].copy_from_slice(&NASTY[which].to_le_bytes());
        }
        if let Some(c) = cut {
            b.truncate(c.index(b.len()));
        }
        let (_, peak) = parse_peak(&b);
        prop_assert!(peak <= allowed(b.len()), "{} bytes allocated for a {}-byte file", peak, b.len());
    }
}
