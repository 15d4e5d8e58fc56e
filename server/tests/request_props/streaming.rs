//! The wire types with several JSON shapes that clients may send large (a custom
//! loss's graph arguments, an OpenAI prompt, a model input's chunks) decode in memory
//! bounded by a small multiple of the body (serde's `untagged`, which they used,
//! buffers the whole value first, and copied nested graph arguments once per level
//! above them). Counted by this binary's allocator, per thread.

use lathe_sdk::types::openai::CompletionPrompt;
use lathe_sdk::types::{GraphArg, ModelInput};

use super::alloc::peak_alloc_during;

#[test]
fn deeply_nested_arguments_decode_in_memory_bounded_by_their_size() {
    // 100 levels of lists around 400,000 zeros: under 1 MB of JSON.
    let depth = 100;
    let zeros = vec!["0"; 400_000].join(",");
    let text = format!("{}{zeros}{}", "[".repeat(depth), "]".repeat(depth));
    let (arg, peak) =
        peak_alloc_during(|| serde_json::from_str::<GraphArg>(&text).expect("decodes"));
    drop(arg);
    // The tree itself is 32-byte values, one per zero (with a vector's doubling); each
    // level's copy of the subtree under it took 100 times that.
    assert!(
        peak < 64 * text.len(),
        "decoding {} bytes took {peak} bytes at once",
        text.len()
    );
}

#[test]
fn a_prompt_of_token_ids_decodes_in_memory_bounded_by_its_size() {
    for text in [
        format!("[{}]", vec!["0"; 1_000_000].join(",")),
        format!("[[{}]]", vec!["0"; 1_000_000].join(",")),
    ] {
        let (prompt, peak) = peak_alloc_during(|| serde_json::from_str::<CompletionPrompt>(&text));
        assert!(prompt.is_ok());
        drop(prompt);
        // `u32`s, 4 bytes for 2 of text, 12 at most while the vector grows.
        assert!(
            peak < 8 * text.len(),
            "decoding {} bytes took {peak} bytes at once",
            text.len()
        );
    }
}

#[test]
fn a_model_input_decodes_in_memory_bounded_by_its_size() {
    let text = format!(
        r#"{{"chunks": [{{"tokens": [{}], "type": "encoded_text"}}]}}"#,
        vec!["0"; 1_000_000].join(",")
    );
    let (input, peak) = peak_alloc_during(|| serde_json::from_str::<ModelInput>(&text));
    assert_eq!(input.unwrap().length(), 1_000_000);
    // `i64`s, 8 bytes for 2 of text, 24 at most while the vector grows.
    assert!(
        peak < 16 * text.len(),
        "decoding {} bytes took {peak} bytes at once",
        text.len()
    );
}
