//! A custom loss's graph arguments decode to what they encode, and in memory bounded by
//! a small multiple of the body, however deeply they nest (serde's `untagged`, which
//! they used, copied every subtree once per level above it).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use lathe_sdk::types::{GraphArg, TaggedArg};

/// Counts the bytes allocated and not yet freed, and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
        PEAK.fetch_max(live, Ordering::SeqCst);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
        unsafe { System.dealloc(ptr, layout) }
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
        r#"{"ref": "a", "tuple": []}"#,
        r#"{"ref": 1}"#,
        r#"{"tuple": "a"}"#,
    ] {
        assert!(decode(bad).is_err(), "{bad} is refused");
    }
}

#[test]
fn deeply_nested_arguments_decode_in_memory_bounded_by_their_size() {
    // 100 levels of lists around 400,000 zeros: under 1 MB of JSON.
    let depth = 100;
    let zeros = vec!["0"; 400_000].join(",");
    let text = format!("{}{zeros}{}", "[".repeat(depth), "]".repeat(depth));
    let before = LIVE.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let arg = decode(&text).expect("decodes");
    let peak = PEAK.load(Ordering::SeqCst) - before;
    drop(arg);
    // The tree itself is 32-byte values, one per zero (with a vector's doubling); each
    // level's copy of the subtree under it took 100 times that.
    assert!(
        peak < 64 * text.len(),
        "decoding {} bytes took {peak} bytes at once",
        text.len()
    );
}
