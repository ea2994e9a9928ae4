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
