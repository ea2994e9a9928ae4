//! `cargo +nightly fuzz run gguf_header`: the GGUF header parser on arbitrary bytes must return
//! (Ok or a one-line error) without panicking, reading out of bounds, or allocating beyond what
//! libFuzzer's `-rss_limit_mb` / `-malloc_limit_mb` allow.
//!
//! The parser is compiled in from its source file rather than through krasis-model, so the fuzz
//! build instruments only it and krasis-quant (krasis-model would pull the whole engine, CUDA
//! bindings and tokenizers into a sanitizer build); it is the same file the library compiles.
#![no_main]

#[path = "../../krasis-model/src/source/gguf/header.rs"]
#[allow(dead_code)]
mod header;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(e) = header::parse(data) {
        assert!(!e.contains('\n'), "multi-line error");
    } else if let Ok(h) = header::parse(data) {
        // Decoding what parsed must not panic either.
        for v in h.kv.values() {
            let _ = v.as_str(data);
            let _ = v.as_str_array(data);
            let _ = v.as_int_array(data);
            let _ = v.as_f64_array(data);
        }
        for t in &h.tensors {
            assert!(t.data.end <= data.len());
        }
    }
});
