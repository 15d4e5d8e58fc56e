//! Request bodies exactly as the official tinker SDK writes them (captured by
//! `scripts/compat/capture-wire.py` from tinker 0.22.0 and 0.38.0) decode into the typed
//! requests they were made from, and the typed requests write them back.

use std::collections::BTreeMap;
use std::path::PathBuf;

use lathe_sdk::proto;
use lathe_sdk::types::*;
use serde_json::Value;

fn capture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/captures")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn json(name: &str) -> Value {
    serde_json::from_slice(&capture(name)).unwrap()
}

/// Typed from the captured JSON, and back to JSON holding every field the SDK sent with
/// the same value (bar the `type` tag, which the server ignores).
fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(name: &str) -> T {
    let mut body = json(name);
    let typed: T = serde_json::from_value(body.clone()).unwrap();
    let mut back = serde_json::to_value(&typed).unwrap();
    for v in [&mut body, &mut back] {
        v.as_object_mut().unwrap().remove("type");
    }
    // Every field the official SDK sent survives: none is dropped on the way in.
    for (k, sent) in body.as_object().unwrap() {
        assert_eq!(back.get(k), Some(sent), "{name}: field {k}");
    }
    typed
}

/// The datum both captures were made from.
fn datum() -> Datum {
    let shaped = |mut t: TensorData| {
        t.shape = Some(vec![3]);
        t
    };
    Datum {
        model_input: ModelInput::from_ints(vec![1, 2, 3]),
        loss_fn_inputs: BTreeMap::from([
            (
                "target_tokens".into(),
                shaped(TensorData::int64(vec![2, 3, 4])),
            ),
            (
                "logprobs".into(),
                shaped(TensorData::float32(vec![-0.5, -1.0, -1.5])),
            ),
            (
                "advantages".into(),
                shaped(TensorData::float32(vec![1.0, 0.0, -1.0])),
            ),
        ]),
    }
}

fn forward_backward() -> ForwardBackwardRequest {
    ForwardBackwardRequest {
        forward_backward_input: ForwardBackwardInput {
            data: vec![datum()],
            loss_fn: "ppo".into(),
            loss_fn_config: Some(BTreeMap::from([("clip_low_threshold".into(), 0.75.into())])),
        },
        model_id: "s:train:0".into(),
        seq_id: Some(3),
    }
}

#[test]
fn forward_backward_in_json_from_0_22_and_protobuf_from_0_38() {
    let from_json: ForwardBackwardRequest = round_trip("0.22.0-forward_backward.json");
    assert_eq!(from_json, forward_backward());
    let from_proto =
        proto::decode_forward_backward(&capture("0.38.0-forward_backward.pb")).unwrap();
    assert_eq!(from_proto.request, forward_backward());
    assert!(from_proto.forward_only);
}

#[test]
fn sampling_requests_of_both_versions() {
    for version in ["0.22.0", "0.38.0"] {
        let r: SampleRequest = round_trip(&format!("{version}-sample.json"));
        assert_eq!(r.num_samples, 2);
        assert_eq!(r.prompt.to_ints(), Some(vec![5, 6]));
        assert_eq!(r.sampling_params.max_tokens, Some(4));
        assert_eq!(r.sampling_params.seed, Some(9));
        assert_eq!(r.sampling_params.temperature, 0.5);
        assert_eq!(
            r.sampling_params.stop,
            Some(StopCondition::Texts(vec!["\n".into()]))
        );
        assert_eq!(r.sampling_session_id.as_deref(), Some("s:sample:0"));
        assert!(r.prompt_logprobs);
        assert_eq!(r.topk_prompt_logprobs, 2);
        assert_eq!((r.topk_sample_logprobs, r.prompt_alt_tokens_k), (0, 0));
    }
}

#[test]
fn training_operations_of_both_versions() {
    for version in ["0.22.0", "0.38.0"] {
        let o: OptimStepRequest = round_trip(&format!("{version}-optim_step.json"));
        assert_eq!(o.adam_params.learning_rate, 1e-3);
        assert_eq!(o.adam_params.beta1, 0.8);
        assert_eq!(o.seq_id, Some(4));
        let s: SaveWeightsRequest = round_trip(&format!("{version}-save_weights.json"));
        assert_eq!((s.path.as_deref(), s.seq_id), (Some("step-4"), Some(5)));
    }
    let l: LoadWeightsRequest = round_trip("0.38.0-load_weights_create.json");
    assert_eq!(l.model_id, None);
    assert_eq!(
        (l.session_id.as_deref(), l.model_seq_id),
        (Some("s"), Some(1))
    );
    assert!(l.optimizer);
}
