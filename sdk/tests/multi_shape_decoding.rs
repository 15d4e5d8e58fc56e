//! The wire types with several JSON shapes (a custom loss's graph arguments, an OpenAI
//! prompt, a model input's chunks), decoded by visitors of their own, decode to what
//! they encode and refuse what serde's derive refused (the memory they take is counted
//! in the server's request property tests, `server/tests/request_props/streaming.rs`).

use lathe_sdk::types::openai::CompletionPrompt;
use lathe_sdk::types::{GraphArg, ModelInputChunk, TaggedArg};

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
