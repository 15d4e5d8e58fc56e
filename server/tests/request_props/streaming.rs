//! The wire types with several JSON shapes that clients may send large (a custom
//! loss's graph arguments, an OpenAI prompt, a model input's chunks) decode in memory
//! bounded by a small multiple of the body (serde's `untagged`, which they used,
//! buffers the whole value first, and copied nested graph arguments once per level
//! above them). Counted by this binary's allocator, per thread.

use lathe_sdk::types::openai::CompletionPrompt;
use lathe_sdk::types::{GraphArg, ModelInput};

use super::alloc::peak_alloc_during;

/// Decodes `text` as a `T`, asserting that the decoding held fewer than `factor` times
/// the text's bytes at once.
fn decode_within<T: serde::de::DeserializeOwned>(
    text: &str,
    factor: usize,
) -> serde_json::Result<T> {
    let (value, peak) = peak_alloc_during(|| serde_json::from_str::<T>(text));
    assert!(
        peak < factor * text.len(),
        "decoding {} bytes took {peak} bytes at once",
        text.len()
    );
    value
}

#[test]
fn deeply_nested_arguments_decode_in_memory_bounded_by_their_size() {
    // 100 levels of lists around 400,000 zeros: under 1 MB of JSON.
    let depth = 100;
    let zeros = vec!["0"; 400_000].join(",");
    let text = format!("{}{zeros}{}", "[".repeat(depth), "]".repeat(depth));
    // The tree itself is 32-byte values, one per zero (with a vector's doubling); each
    // level's copy of the subtree under it took 100 times that.
    decode_within::<GraphArg>(&text, 64).expect("decodes");
}

#[test]
fn a_prompt_of_token_ids_decodes_in_memory_bounded_by_its_size() {
    for text in [
        format!("[{}]", vec!["0"; 1_000_000].join(",")),
        format!("[[{}]]", vec!["0"; 1_000_000].join(",")),
    ] {
        // `u32`s, 4 bytes for 2 of text, 12 at most while the vector grows.
        assert!(decode_within::<CompletionPrompt>(&text, 8).is_ok());
    }
}

#[test]
fn a_model_input_decodes_in_memory_bounded_by_its_size() {
    let text = format!(
        r#"{{"chunks": [{{"tokens": [{}], "type": "encoded_text"}}]}}"#,
        vec!["0"; 1_000_000].join(",")
    );
    // `i64`s, 8 bytes for 2 of text, 24 at most while the vector grows.
    let input = decode_within::<ModelInput>(&text, 16).unwrap();
    assert_eq!(input.length(), 1_000_000);
}
