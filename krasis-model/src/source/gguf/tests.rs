use super::header::parse;
use super::writer::{GgufWriter, MetaValue};
use super::*;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A small valid file: two metadata entries and two tensors.
fn small() -> GgufWriter {
    let mut w = GgufWriter::default();
    w.meta("general.architecture", MetaValue::Str("test".into()))
        .meta("tokenizer.ggml.tokens", MetaValue::StrArray(vec!["a".into(), "b".into()]))
        .tensor("a.weight", &[4, 2], GgmlType::F32, f32_bytes(&[1., 2., 3., 4., 5., 6., 7., 8.]))
        .tensor("b.weight", &[32], GgmlType::Q8_0, vec![0u8; 34]);
    w
}

#[test]
fn a_written_file_parses_back() {
    let b = small().to_bytes();
    let h = parse(&b).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.kv["general.architecture"].as_str(&b), Some("test"));
    assert_eq!(h.kv["tokenizer.ggml.tokens"].as_str_array(&b), Some(vec!["a", "b"]));
    assert_eq!(h.tensors[0].shape(), vec![2, 4]);
    assert_eq!(h.tensors[1].ty, GgmlType::Q8_0);
    let a = &b[h.tensors[0].data.clone()];
    assert_eq!(a, &f32_bytes(&[1., 2., 3., 4., 5., 6., 7., 8.])[..]);
    assert_eq!(h.tensors[1].data.start % 32, 0);
}

#[test]
fn split_names_are_recognised() {
    assert_eq!(split_name(Path::new("/m/x-00002-of-00003.gguf")), Some(("x".into(), 2, 3)));
    assert_eq!(split_name(Path::new("/m/a-b-00001-of-00001.gguf")), Some(("a-b".into(), 1, 1)));
    assert_eq!(split_name(Path::new("/m/x-2-of-3.gguf")), None);
    assert_eq!(split_name(Path::new("/m/model.gguf")), None);
}

// ---- hostile headers: each is one clear line, never a panic ----

fn s(out: &mut Vec<u8>, v: &str) {
    out.extend((v.len() as u64).to_le_bytes());
    out.extend(v.as_bytes());
}

/// A file from raw parts: counts as given (they may lie), then the encoded kvs and tensor infos,
/// then `data` at the next 32-byte boundary.
fn raw(n_tensors: u64, n_kv: u64, kvs: &[Vec<u8>], infos: &[Vec<u8>], data: &[u8]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(n_tensors.to_le_bytes());
    out.extend(n_kv.to_le_bytes());
    for k in kvs {
        out.extend(k);
    }
    for t in infos {
        out.extend(t);
    }
    out.resize(out.len().div_ceil(32) * 32, 0);
    out.extend(data);
    out
}

fn info(name: &str, dims: &[u64], ty: u32, offset: u64) -> Vec<u8> {
    let mut out = Vec::new();
    s(&mut out, name);
    out.extend((dims.len() as u32).to_le_bytes());
    for d in dims {
        out.extend(d.to_le_bytes());
    }
    out.extend(ty.to_le_bytes());
    out.extend(offset.to_le_bytes());
    out
}

fn kv_u32(key: &str, v: u32) -> Vec<u8> {
    let mut out = Vec::new();
    s(&mut out, key);
    out.extend(4u32.to_le_bytes());
    out.extend(v.to_le_bytes());
    out
}

/// The parse error, checked to be one line that names `what`.
fn err_of(b: &[u8], what: &str) -> String {
    let e = parse(b).expect_err("hostile input must be refused");
    assert!(!e.contains('\n'), "multi-line error: {e}");
    assert!(e.contains(what), "error `{e}` does not mention `{what}`");
    e
}

#[test]
fn truncation_anywhere_is_an_error() {
    let b = small().to_bytes();
    for len in 0..b.len() {
        assert!(parse(&b[..len]).is_err(), "a file cut at {len} of {} parsed", b.len());
    }
}

#[test]
fn tensor_data_past_the_end_is_refused() {
    let b = raw(1, 0, &[], &[info("w", &[8], 0, 0)], &[0u8; 31]);
    err_of(&b, "runs past the end of the file");
    // An offset that overflows when added to the data start.
    let b = raw(1, 0, &[], &[info("w", &[8], 0, u64::MAX - 31)], &[0u8; 32]);
    err_of(&b, "runs past the end");
}

#[test]
fn an_array_of_2_pow_60_elements_is_refused_before_allocation() {
    let mut kv = Vec::new();
    s(&mut kv, "huge");
    kv.extend(9u32.to_le_bytes());
    kv.extend(0u32.to_le_bytes()); // u8 elements
    kv.extend((1u64 << 60).to_le_bytes());
    err_of(&raw(0, 1, &[kv.clone()], &[], &[]), "1152921504606846976");
    // Strings: each needs at least its 8-byte length.
    let n = kv.len();
    kv[n - 12..n - 8].copy_from_slice(&8u32.to_le_bytes());
    err_of(&raw(0, 1, &[kv], &[], &[]), "metadata `huge`");
}

#[test]
fn a_string_of_2_pow_40_bytes_is_refused() {
    let mut kv = Vec::new();
    s(&mut kv, "general.name");
    kv.extend(8u32.to_le_bytes());
    kv.extend((1u64 << 40).to_le_bytes());
    kv.extend(b"abc");
    err_of(&raw(0, 1, &[kv], &[], &[]), "exceeds");
    // A key whose length runs past the end.
    let mut key = Vec::new();
    key.extend(1000u64.to_le_bytes());
    key.extend(b"k");
    err_of(&raw(0, 1, &[key], &[], &[]), "metadata key 0");
}

#[test]
fn an_unknown_tensor_type_is_refused() {
    let e = err_of(&raw(1, 0, &[], &[info("w", &[32], 99, 0)], &[0u8; 64]), "tensor `w`");
    assert!(e.contains("99"), "{e}");
}

#[test]
fn a_duplicate_tensor_name_or_key_is_refused() {
    let t = info("w", &[8], 0, 0);
    let t2 = info("w", &[8], 0, 32);
    err_of(&raw(2, 0, &[], &[t, t2], &[0u8; 64]), "appears twice");
    err_of(&raw(0, 2, &[kv_u32("a", 1), kv_u32("a", 2)], &[], &[]), "appears twice");
}

#[test]
fn a_misaligned_offset_is_refused() {
    err_of(&raw(1, 0, &[], &[info("w", &[8], 0, 8)], &[0u8; 64]), "not a multiple of the alignment 32");
    // A custom alignment that is not a power of two.
    err_of(&raw(0, 1, &[kv_u32("general.alignment", 24)], &[], &[]), "general.alignment");
}

#[test]
fn other_malformed_headers_are_refused() {
    err_of(b"GGUX\x03\0\0\0", "not a GGUF file");
    let mut b = raw(0, 0, &[], &[], &[]);
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    err_of(&b, "big-endian");
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    err_of(&b, "version 1");
    err_of(&raw(1 << 62, 0, &[], &[], &[]), "tensor_count");
    err_of(&raw(0, 1 << 62, &[], &[], &[]), "metadata_kv_count");
    err_of(&raw(1, 0, &[], &[info("w", &[1, 1, 1, 1, 1], 0, 0)], &[]), "5 dimensions");
    err_of(&raw(1, 0, &[], &[info("w", &[4, 0], 0, 0)], &[]), "dimension 1 is 0");
    err_of(&raw(1, 0, &[], &[info("w", &[1 << 32, 1 << 32], 0, 0)], &[]), "overflows");
    err_of(&raw(1, 0, &[], &[info("w", &[16], 8, 0)], &[0u8; 64]), "block size");
    let mut bad_type = Vec::new();
    s(&mut bad_type, "k");
    bad_type.extend(13u32.to_le_bytes());
    err_of(&raw(0, 1, &[bad_type], &[], &[]), "unknown metadata value type 13");
    let mut nested = Vec::new();
    s(&mut nested, "deep");
    nested.extend(9u32.to_le_bytes()); // the value is an array …
    for _ in 0..3 {
        // … of arrays of one element each
        nested.extend(9u32.to_le_bytes());
        nested.extend(1u64.to_le_bytes());
    }
    err_of(&raw(0, 1, &[nested], &[], &[0u8; 64]), "nested");
}

#[test]
fn names_with_control_characters_keep_the_error_on_one_line() {
    // Found by the fuzz target: a tensor name with a newline split the message.
    let e = err_of(&raw(1, 0, &[], &[info("a\nb", &[8], 0, 8)], &[0u8; 64]), "a\\nb");
    assert!(e.contains("alignment"), "{e}");
    let mut k = Vec::new();
    s(&mut k, "x\ry");
    k.extend(13u32.to_le_bytes());
    err_of(&raw(0, 1, &[k], &[], &[]), "x\\ry");
}

#[test]
fn a_file_error_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("bad.gguf");
    let b = small().to_bytes();
    std::fs::write(&p, &b[..b.len() - 3]).unwrap();
    let e = GgufModel::open(&p).err().expect("truncated").to_string();
    assert!(e.contains("bad.gguf") && e.contains("runs past the end"), "{e}");
    assert!(!e.contains('\n'));
}

#[test]
fn split_files_open_together_and_a_missing_split_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let mut a = GgufWriter::default();
    a.meta("split.no", MetaValue::U32(0)).meta("split.count", MetaValue::U32(2)).tensor(
        "a.weight",
        &[2],
        GgmlType::F32,
        f32_bytes(&[1., 2.]),
    );
    let mut b = GgufWriter::default();
    b.meta("split.no", MetaValue::U32(1)).meta("split.count", MetaValue::U32(2)).tensor(
        "b.weight",
        &[2],
        GgmlType::F32,
        f32_bytes(&[3., 4.]),
    );
    std::fs::write(tmp.path().join("m-00001-of-00002.gguf"), a.to_bytes()).unwrap();
    let e = GgufModel::open(&tmp.path().join("m-00001-of-00002.gguf")).err().expect("second split missing").to_string();
    assert!(e.contains("m-00002-of-00002.gguf") && e.contains("split file missing"), "{e}");
    std::fs::write(tmp.path().join("m-00002-of-00002.gguf"), b.to_bytes()).unwrap();
    // Any split's name opens both.
    let m = GgufModel::open(&tmp.path().join("m-00002-of-00002.gguf")).unwrap();
    assert_eq!(m.tensor_names().collect::<Vec<_>>(), ["a.weight", "b.weight"]);
    let (f, t) = m.tensor_info("b.weight").unwrap();
    assert_eq!(&f.bytes()[t.data.clone()], &f32_bytes(&[3., 4.])[..]);
    // The same tensor in two splits is refused.
    std::fs::write(tmp.path().join("m-00002-of-00002.gguf"), a.to_bytes()).unwrap();
    let e = GgufModel::open(&tmp.path().join("m-00001-of-00002.gguf")).err().expect("duplicate").to_string();
    assert!(e.contains("split.no") || e.contains("also in"), "{e}");
}
