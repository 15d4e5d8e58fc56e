//! The wire types with several shapes that clients may send large (a model input's
//! chunks, a custom loss's graph arguments, an OpenAI prompt) decode to what they encode, in memory bounded by
//! a small multiple of the body (serde's `untagged`, which they used, buffers the whole
//! value first, and copied nested graph arguments once per level above them).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use lathe_sdk::types::openai::CompletionPrompt;
use lathe_sdk::types::{GraphArg, ModelInput, ModelInputChunk, TaggedArg};

/// Counts the bytes each thread holds and their peak (per thread: the tests run at
/// once, each on its own thread).
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

/// Records `alloc` new bytes held alongside the current ones, then `free` released.
fn note(alloc: usize, free: usize) {
    let _ = LIVE.try_with(|live| {
        let high = live.get() + alloc as isize;
        let _ = PEAK.try_with(|p| p.set(p.get().max(high)));
        live.set(high - free as isize);
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note(layout.size(), 0);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        note(0, layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            note(new_size, layout.size());
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn decode(text: &str) -> Result<GraphArg, serde_json::Error> {
    serde_json::from_str(text)
}

#[test]
fn every_form_decodes_to_what_it_encodes() {
    let tagged = |t: TaggedArg| GraphArg::Tagged(t);
    let forms = vec![
        GraphArg::None,
        GraphArg::Bool(true),
        GraphArg::Int(-3),
        GraphArg::Float(0.5),
        GraphArg::Str("x".into()),
        GraphArg::List(vec![GraphArg::Int(1), GraphArg::List(vec![GraphArg::None])]),
        tagged(TaggedArg::Ref("node".into())),
        tagged(TaggedArg::Tuple(vec![
            GraphArg::Int(2),
            GraphArg::Float(1.5),
        ])),
        tagged(TaggedArg::Dict(
            [("dim".to_string(), GraphArg::Int(-1))]
                .into_iter()
                .collect(),
        )),
        tagged(TaggedArg::Slice(vec![
            GraphArg::None,
            GraphArg::Int(4),
            GraphArg::None,
        ])),
        tagged(TaggedArg::Ellipsis(true)),
        tagged(TaggedArg::Float("inf".into())),
        tagged(TaggedArg::Dtype("float32".into())),
        tagged(TaggedArg::Device("cpu".into())),
        tagged(TaggedArg::Layout("strided".into())),
        tagged(TaggedArg::MemoryFormat("contiguous_format".into())),
    ];
    for form in forms {
        let text = serde_json::to_string(&form).unwrap();
        assert_eq!(decode(&text).unwrap(), form, "{text}");
    }
    assert_eq!(decode("1.0").unwrap(), GraphArg::Float(1.0));
    assert_eq!(
        decode("18446744073709551615").unwrap(),
        GraphArg::Float(u64::MAX as f64),
        "an integer past i64 is a float"
    );
    for bad in [
        r#"{}"#,
        r#"{"nope": 1}"#,
        r#"{"ref": 1}"#,
        r#"{"tuple": "a"}"#,
    ] {
        assert!(decode(bad).is_err(), "{bad} is refused");
    }
    let err = decode(r#"{"ref": "a", "tuple": []}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("one key"), "{err}");
}

#[test]
fn deeply_nested_arguments_decode_in_memory_bounded_by_their_size() {
    // 100 levels of lists around 400,000 zeros: under 1 MB of JSON.
    let depth = 100;
    let zeros = vec!["0"; 400_000].join(",");
    let text = format!("{}{zeros}{}", "[".repeat(depth), "]".repeat(depth));
    let (arg, peak) = peak_during(|| decode(&text).expect("decodes"));
    drop(arg);
    // The tree itself is 32-byte values, one per zero (with a vector's doubling); each
    // level's copy of the subtree under it took 100 times that.
    assert!(
        peak < 64 * text.len(),
        "decoding {} bytes took {peak} bytes at once",
        text.len()
    );
}

/// The bytes this thread held at most while `f` ran, above what it held before.
fn peak_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(before));
    let r = f();
    (r, (PEAK.with(Cell::get) - before).max(0) as usize)
}

#[test]
fn every_prompt_form_decodes_to_what_it_encodes() {
    let prompt = |text: &str| serde_json::from_str::<CompletionPrompt>(text);
    assert_eq!(
        prompt(r#""hi""#).unwrap(),
        CompletionPrompt::Text("hi".into())
    );
    assert_eq!(
        prompt(r#"["a", "b"]"#).unwrap(),
        CompletionPrompt::Texts(vec!["a".into(), "b".into()])
    );
    assert_eq!(
        prompt("[1, 2]").unwrap(),
        CompletionPrompt::Tokens(vec![1, 2])
    );
    assert_eq!(
        prompt("[[1], [2, 3], []]").unwrap(),
        CompletionPrompt::TokenLists(vec![vec![1], vec![2, 3], vec![]])
    );
    assert_eq!(prompt("[]").unwrap(), CompletionPrompt::Texts(vec![]));
    for form in [
        CompletionPrompt::Text("x".into()),
        CompletionPrompt::Tokens(vec![7, 4_000_000_000]),
    ] {
        let text = serde_json::to_string(&form).unwrap();
        assert_eq!(prompt(&text).unwrap(), form, "{text}");
    }
    for bad in [
        r#"["a", 1]"#,
        "[1, [2]]",
        r#"[[1], "a"]"#,
        "[-1]",
        "[4294967296]",
        "[[1.5]]",
        "3",
        r#"{"a": 1}"#,
        "[null]",
    ] {
        assert!(prompt(bad).is_err(), "{bad} is refused");
    }
}

#[test]
fn a_prompt_of_token_ids_decodes_in_memory_bounded_by_its_size() {
    for text in [
        format!("[{}]", vec!["0"; 1_000_000].join(",")),
        format!("[[{}]]", vec!["0"; 1_000_000].join(",")),
    ] {
        let (prompt, peak) = peak_during(|| serde_json::from_str::<CompletionPrompt>(&text));
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
fn every_chunk_form_decodes_to_what_it_encodes_wherever_its_tag_is() {
    let chunk = |text: &str| serde_json::from_str::<ModelInputChunk>(text);
    for form in [
        ModelInputChunk::EncodedText {
            tokens: vec![1, -2, 3],
        },
        ModelInputChunk::Image {
            data: "aGk=".into(),
            format: "png".into(),
            expected_tokens: Some(4),
        },
        ModelInputChunk::ImageAssetPointer {
            location: "s3://x".into(),
            format: "jpeg".into(),
            expected_tokens: None,
        },
    ] {
        let text = serde_json::to_string(&form).unwrap();
        assert_eq!(chunk(&text).unwrap(), form, "{text}");
    }
    assert_eq!(
        chunk(r#"{"tokens": [5], "type": "encoded_text", "extra": {"a": [1]}}"#).unwrap(),
        ModelInputChunk::EncodedText { tokens: vec![5] },
        "the tag last (as Python clients write it), unknown fields ignored"
    );
    for (bad, says) in [
        (r#"{"type": "encoded_text"}"#, "needs `tokens`"),
        (r#"{"type": "image", "data": "x"}"#, "needs `format`"),
        (r#"{"type": "video", "tokens": []}"#, "unknown chunk type"),
        (r#"{"tokens": [1]}"#, "type"),
        (
            r#"{"type": "encoded_text", "tokens": [1.5]}"#,
            "invalid type",
        ),
    ] {
        let err = chunk(bad).unwrap_err().to_string();
        assert!(err.contains(says), "{bad}: {err}");
    }
}

#[test]
fn a_model_input_decodes_in_memory_bounded_by_its_size() {
    let text = format!(
        r#"{{"chunks": [{{"tokens": [{}], "type": "encoded_text"}}]}}"#,
        vec!["0"; 1_000_000].join(",")
    );
    let (input, peak) = peak_during(|| serde_json::from_str::<ModelInput>(&text));
    assert_eq!(input.unwrap().length(), 1_000_000);
    // `i64`s, 8 bytes for 2 of text, 24 at most while the vector grows.
    assert!(
        peak < 16 * text.len(),
        "decoding {} bytes took {peak} bytes at once",
        text.len()
    );
}
