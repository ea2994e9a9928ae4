//! Tokenizer and chat template on a fixture's `tokenizer.json` / `tokenizer_config.json`.

use krasis_model::files::ModelFiles;
use krasis_model::tokenizer::TextStream;
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
