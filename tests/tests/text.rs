//! Tokenizer and chat template on a fixture's `tokenizer.json` / `tokenizer_config.json`.

use krasis_model::source::files::ModelFiles;
use krasis_model::text::tokenizer::TextStream;
use krasis_tests::fixtures_dir;

#[test]
fn encode_decode_round_trip_and_chat_template() {
    let Some(root) = fixtures_dir() else { return };
    let files = ModelFiles::open(&root.join("dsv2-lite-tiny")).unwrap();
    let codec = files.text_codec().unwrap();
    let text = "Hello, world! The experts live in RAM.";
    let ids = codec.encode(text).unwrap();
    assert!(!ids.is_empty());
    assert_ne!(ids[0], 0, "add_bos_token is false in this tokenizer_config");
    assert_eq!(codec.decode(&ids).unwrap(), text);

    let rendered = codec.render_chat("Hi").unwrap();
    assert_eq!(rendered, "<|user|>Hi\n<|assistant|>");
    let chat_ids = codec.encode_chat("Hi").unwrap();
    assert!(chat_ids.len() > 2);

    // Streaming yields the same text as a one-shot decode.
    let mut stream = TextStream::new();
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&stream.push(&codec, id).unwrap());
    }
    assert_eq!(streamed, text);
}

/// Multi-byte characters split over byte-level tokens: no delta carries half a character or a
/// replacement character, the deltas add up to the one-shot decode, and a generation cut inside a
/// character hands the held-back bytes over at `finish`.
#[test]
fn streamed_deltas_never_split_a_character() {
    let tmp = tempfile::tempdir().unwrap();
    krasis_tests::tiny_model(tmp.path());
    let codec = ModelFiles::open(tmp.path()).unwrap().text_codec().unwrap();
    let text = "héllo wörld — 日本語 🦀 done";
    let ids = codec.encode(text).unwrap();
    assert!(ids.len() > text.chars().count() / 2, "byte-level tokens: {ids:?}");
    let mut stream = TextStream::new();
    let mut streamed = String::new();
    let mut held = 0;
    for &id in &ids {
        let d = stream.push(&codec, id).unwrap();
        assert!(!d.contains('\u{fffd}'), "a delta carries a replacement character: {d:?}");
        held += usize::from(d.is_empty());
        streamed.push_str(&d);
    }
    streamed.push_str(&stream.finish(&codec).unwrap());
    assert_eq!(streamed, text);
    assert!(held > 0, "some ids complete no character, so some pushes must hold back");

    // Cut inside the crab's four bytes: nothing of it is emitted until finish.
    let crab = codec.encode("🦀").unwrap();
    assert!(crab.len() > 1, "the crab takes several byte tokens: {crab:?}");
    let mut stream = TextStream::new();
    let mut out = String::new();
    for &id in &crab[..crab.len() - 1] {
        out.push_str(&stream.push(&codec, id).unwrap());
    }
    assert_eq!(out, "");
    assert!(stream.finish(&codec).unwrap().contains('\u{fffd}'));
}

/// A whole conversation goes through the chat template in order, ending with the generation
/// prompt (the server's chat endpoint renders every message this way).
#[test]
fn a_conversation_renders_through_the_chat_template() {
    use krasis_model::text::tokenizer::ChatMessage;
    let tmp = tempfile::tempdir().unwrap();
    krasis_tests::tiny_model(tmp.path());
    let codec = ModelFiles::open(tmp.path()).unwrap().text_codec().unwrap();
    assert!(codec.has_chat_template());
    let conversation = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("assistant", "Hello."),
        ChatMessage::new("user", "Again"),
    ];
    let text = codec.render_messages(&conversation).unwrap();
    assert_eq!(text, "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>Hello.\n<|user|>Again\n<|assistant|>");
    let ids = codec.encode_messages(&conversation).unwrap();
    assert_eq!(codec.decode(&ids).unwrap(), text);
    assert_eq!(codec.render_chat("Hi").unwrap(), "<|user|>Hi\n<|assistant|>");
}
