//! Build and load a synthetic expert cache and print GB/s.
//!
//! `cargo run --release -p krasis-cache --example cache_bench -- [DIR] [MOE_LAYERS]`
//! Records are V2-Lite INT4 sized (hidden 2048, intermediate 1408, group 128: ~4.3 MiB each),
//! 64 experts per layer; 6 layers make ~1.7 GB. The producer is a cheap fill, so the build
//! figure is the cache's own cost (checksum + write + fsync), not quantisation.

use std::path::PathBuf;
use std::time::Instant;

use krasis_cache::*;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).map(PathBuf::from).unwrap_or_else(|| std::env::temp_dir().join("krasis_cache_bench"));
    let layers: u32 = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(6);
    let (hidden, inter, gs) = (2048u64, 1408u64, 128u64);
    // INT4 weights + f16 scales per group of 128 along K.
    let w13 = 2 * inter * hidden / 2 + 2 * inter * (hidden / gs) * 2;
    let w2 = hidden * inter / 2 + hidden * (inter / gs) * 2;
    let header = CacheHeader {
        format_version: FORMAT_VERSION,
        layout: "bench".into(),
        config_hash: 0x1234,
        group_size_hidden: gs as u32,
        group_size_intermediate: gs as u32,
        hidden: hidden as u32,
        intermediate: inter as u32,
        n_experts: 64,
        moe_layers: (1..=layers).collect(),
        parts: vec![LayerParts { w13_bits: 4, w2_bits: 4, w13_bytes: w13, w2_bytes: w2 }; layers as usize],
    };
    let path = dir.join(cache_file_name(Some(4), gs as u32));
    let _ = std::fs::remove_file(&path);
    let len = (w13 + w2) as usize;
    let produce = |l: usize, e: usize| Ok(vec![(l * 64 + e) as u8 | 1; len]);

    let rep = build(&path, &header, &produce, &|_| {}).unwrap();
    println!(
        "build: {:.2} GB in {:.2} s = {:.2} GB/s ({} threads)",
        rep.bytes as f64 / 1e9,
        rep.seconds,
        rep.gb_per_s,
        rayon::current_num_threads()
    );

    // Cold: build dropped the file from the page cache, and so does every load.
    let c = open(&path, &header, LoadOptions::default()).unwrap();
    println!("load (cold, verified): {}", describe(&c));
    drop(c);

    // Warm: read the file into the page cache first (what a just-copied cache looks like).
    let warm = |verify: bool, huge_pages: bool| {
        std::hint::black_box(std::fs::read(&path).unwrap().len());
        let c = open(&path, &header, LoadOptions { verify, huge_pages, ..Default::default() }).unwrap();
        let r = c.load_report().clone();
        println!(
            "load (page cache, verify {verify}, THP advised {huge_pages}): {:.2} s = {:.2} GB/s, THP bytes {:?}",
            r.seconds, r.gb_per_s, r.huge_page_bytes
        );
    };
    warm(true, true);
    warm(false, true);
    warm(true, false);

    let buf = vec![7u8; 256 << 20];
    let t = Instant::now();
    let mut x = 0;
    for _ in 0..4 {
        x ^= xxhash_rust::xxh3::xxh3_64(std::hint::black_box(&buf));
    }
    println!("xxh3-64 one core: {:.1} GB/s ({x:x})", 4.0 * buf.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
    std::fs::remove_file(&path).unwrap();
}
