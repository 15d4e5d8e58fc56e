//! Round trips through the protobuf encoding, and what a malformed body gets.

use std::collections::BTreeMap;

use prost::Message;

use super::*;
use crate::types::*;

fn request() -> ForwardBackwardRequest {
    let mut sparse = TensorData::float32(vec![1.0, 2.0]);
    sparse.shape = Some(vec![2, 3]);
    sparse.sparse_crow_indices = Some(vec![0, 1, 2]);
    sparse.sparse_col_indices = Some(vec![0, 2]);
    let mut datum = Datum::cross_entropy(
        ModelInput::from_ints(vec![1, 2, 3]),
        vec![2, 3, 4],
        vec![0.0, 1.0, 0.5],
    );
    datum.loss_fn_inputs.get_mut("target_tokens").unwrap().shape = Some(vec![3]);
    datum.loss_fn_inputs.get_mut("weights").unwrap().shape = Some(vec![3]);
    datum.loss_fn_inputs.insert("extra".into(), sparse);
    ForwardBackwardRequest {
        forward_backward_input: ForwardBackwardInput {
            data: vec![datum],
            loss_fn: "ppo".into(),
            loss_fn_config: Some(BTreeMap::from([("clip_low_threshold".into(), 0.75.into())])),
        },
        model_id: "s:train:0".into(),
        seq_id: Some(7),
    }
}

#[test]
fn forward_backward_requests_round_trip() {
    let req = request();
    let bytes = encode_forward_backward(&req, true).unwrap();
    let back = decode_forward_backward(&bytes).unwrap();
    assert_eq!(back.request, req);
    assert!(back.forward_only);
}

#[test]
fn loss_settings_prefer_the_v2_map_and_keep_text() {
    let mut msg = pb::ForwardBackwardRequest::decode(
        &encode_forward_backward(&request(), false).unwrap()[..],
    )
    .unwrap();
    msg.loss_fn_config.insert("clip_low_threshold".into(), 0.1);
    let got = decode_forward_backward(&msg.encode_to_vec()).unwrap();
    let config = got.request.forward_backward_input.loss_fn_config.unwrap();
    assert_eq!(
        config["clip_low_threshold"],
        LossConfigValue::Number(0.75),
        "v2 wins"
    );
    msg.loss_fn_config_v2.insert(
        "loss_id".into(),
        pb::LossConfigValue {
            value: Some(pb::loss_config_value::Value::Text("x".into())),
        },
    );
    let got = decode_forward_backward(&msg.encode_to_vec()).unwrap();
    let config = got.request.forward_backward_input.loss_fn_config.unwrap();
    assert_eq!(config["loss_id"], LossConfigValue::Text("x".into()));
    // Text round-trips through the encoder too, in the v2 map only.
    let mut text = request();
    text.forward_backward_input.loss_fn_config = Some(BTreeMap::from([(
        "loss_id".into(),
        LossConfigValue::Text("l".into()),
    )]));
    let msg =
        pb::ForwardBackwardRequest::decode(&encode_forward_backward(&text, false).unwrap()[..])
            .unwrap();
    assert!(msg.loss_fn_config.is_empty());
    let back = decode_forward_backward(&msg.encode_to_vec()).unwrap();
    assert_eq!(back.request, text);
    msg.loss_fn_config_v2.get("loss_id").unwrap();
}

#[test]
fn malformed_requests_are_errors_naming_the_field() {
    assert!(matches!(
        decode_forward_backward(b"\xff\xff\xff"),
        Err(ProtoError::Decode(_))
    ));
    let mut msg = pb::ForwardBackwardRequest::decode(
        &encode_forward_backward(&request(), false).unwrap()[..],
    )
    .unwrap();
    msg.seq_id = 0;
    assert!(decode_forward_backward(&msg.encode_to_vec())
        .unwrap_err()
        .to_string()
        .contains("seq_id"));
    msg.seq_id = 1;
    let Some(pb::chunk::Chunk::EncodedText(t)) = &mut msg.data[0].model_input[0].chunk else {
        panic!()
    };
    t.tokens.truncate(5);
    let err = decode_forward_backward(&msg.encode_to_vec()).unwrap_err();
    assert_eq!(
        err,
        ProtoError::Ragged {
            field: "data[0].model_input[0]".into(),
            len: 5,
            width: 4
        }
    );
    msg.data[0].model_input[0].chunk = Some(pb::chunk::Chunk::Image(Default::default()));
    assert!(decode_forward_backward(&msg.encode_to_vec())
        .unwrap_err()
        .to_string()
        .contains("image"));
    msg.data[0].model_input.clear();
    fn weights(m: &mut pb::ForwardBackwardRequest) -> &mut pb::Tensor {
        m.data[0].loss_fn_inputs.get_mut("weights").unwrap()
    }
    weights(&mut msg).dtype = 99;
    assert!(decode_forward_backward(&msg.encode_to_vec())
        .unwrap_err()
        .to_string()
        .contains("dtype"));
    weights(&mut msg).dtype = pb::DType::DtypeFloat32 as i32;
    weights(&mut msg).shape = vec![-1];
    assert!(decode_forward_backward(&msg.encode_to_vec())
        .unwrap_err()
        .to_string()
        .contains("negative"));
}

fn tensor(values: Vec<f32>, shape: Vec<usize>) -> TensorData {
    let mut t = TensorData::float32(values);
    t.shape = Some(shape);
    t
}

#[test]
fn forward_outputs_round_trip_across_record_layouts() {
    let datum = |t: TensorData| {
        BTreeMap::from([
            ("logprobs".to_string(), t.clone()),
            ("elementwise_loss".to_string(), t),
        ])
    };
    let out = ForwardBackwardOutput {
        loss_fn_output_type: "TorchLossReturn".into(),
        loss_fn_outputs: vec![
            datum(tensor(vec![-1.0, -2.0], vec![2])),
            datum(tensor(vec![-3.0], vec![1])),
            // A [n, k] datum starts a new record.
            datum(tensor(vec![-1.0, -2.0, -3.0, -4.0], vec![2, 2])),
            datum(tensor(vec![], vec![0])),
        ],
        metrics: BTreeMap::from([("loss:sum".into(), 3.5)]),
    };
    let bytes = encode_forward_backward_output(&out).unwrap();
    let msg = pb::ForwardBackwardOutput::decode(&bytes[..]).unwrap();
    assert_eq!(
        msg.loss_fn_outputs.len(),
        3,
        "records: [n] x2, [n,2], [n] again"
    );
    assert_eq!(
        msg.loss_fn_outputs
            .iter()
            .map(|r| r.num_datums)
            .collect::<Vec<_>>(),
        [2, 1, 1]
    );
    assert_eq!(decode_forward_backward_output(&bytes).unwrap(), out);
}

#[test]
fn forward_output_offsets_outside_the_data_are_errors() {
    let out = ForwardBackwardOutput {
        loss_fn_output_type: "TorchLossReturn".into(),
        loss_fn_outputs: vec![BTreeMap::from([(
            "logprobs".to_string(),
            tensor(vec![-1.0], vec![1]),
        )])],
        metrics: BTreeMap::new(),
    };
    let mut msg =
        pb::ForwardBackwardOutput::decode(&encode_forward_backward_output(&out).unwrap()[..])
            .unwrap();
    msg.loss_fn_outputs[0]
        .fields
        .get_mut("logprobs")
        .unwrap()
        .offsets = arrays::write_i64([0, 400]).into();
    assert!(decode_forward_backward_output(&msg.encode_to_vec()).is_err());
    msg.loss_fn_outputs[0].num_datums = 5;
    assert!(decode_forward_backward_output(&msg.encode_to_vec()).is_err());
    // A record with no fields claiming 2^40 datums sizes nothing.
    msg.loss_fn_outputs[0].fields.clear();
    msg.loss_fn_outputs[0].num_datums = 1 << 40;
    assert!(decode_forward_backward_output(&msg.encode_to_vec()).is_err());
    // bfloat16 results widen to float32, as the official SDK reads them.
    let bf16 = pb::BatchedTensor {
        data: vec![0x80, 0x3f, 0x00, 0xc0].into(),
        offsets: arrays::write_i64([0, 4]).into(),
        dtype: pb::DType::DtypeBfloat16 as i32,
        trailing_shape: vec![],
    };
    msg.loss_fn_outputs[0]
        .fields
        .insert("logprobs".into(), bf16);
    msg.loss_fn_outputs[0].num_datums = 1;
    let out = decode_forward_backward_output(&msg.encode_to_vec()).unwrap();
    assert_eq!(out.loss_fn_outputs[0]["logprobs"].data, vec![1.0, -2.0]);
}

#[test]
fn sample_responses_round_trip_with_absent_logprobs_and_ragged_top_k() {
    let r = SampleResponse {
        sequences: vec![
            SampledSequence {
                stop_reason: StopReason::Stop,
                tokens: vec![5, 6],
                logprobs: Some(vec![-0.5, -0.25]),
            },
            SampledSequence {
                stop_reason: StopReason::Length,
                tokens: vec![],
                logprobs: None,
            },
        ],
        prompt_logprobs: Some(vec![None, Some(-1.5), Some(-0.125)]),
        topk_prompt_logprobs: Some(vec![
            None,
            Some(vec![(3, -0.5), (9, -1.0)]),
            Some(vec![(4, -0.25)]),
        ]),
    };
    let bytes = encode_sample_response(&r).unwrap();
    assert_eq!(decode_sample_response(&bytes).unwrap(), r);
    let msg = pb::SampleResponse::decode(&bytes[..]).unwrap();
    let topk = msg.topk_prompt_logprobs.unwrap();
    assert_eq!((topk.k, topk.length), (2, 3));
}

#[test]
fn bodies_with_too_many_small_parts_are_refused_before_decoding() {
    let head = encode_forward_backward(&request(), false).unwrap();
    // Empty datums (field 3, length 0): two bytes each on the wire.
    let mut many = head.clone();
    many.extend(std::iter::repeat_n([0x1a, 0x00], request::MAX_DATUMS + 1).flatten());
    let err = decode_forward_backward(&many).unwrap_err();
    assert!(err.to_string().contains("datums"), "{err}");
    // One datum of empty chunks (field 1 inside field 3).
    let chunks: Vec<u8> = std::iter::repeat_n([0x0a, 0x00], request::MAX_PARTS + 1)
        .flatten()
        .collect();
    let mut datum = vec![0x1a];
    let mut len = chunks.len();
    while len >= 0x80 {
        datum.push((len as u8) | 0x80);
        len >>= 7;
    }
    datum.push(len as u8);
    datum.extend(chunks);
    let mut body = head.clone();
    body.extend(datum);
    let err = decode_forward_backward(&body).unwrap_err();
    assert!(err.to_string().contains("chunks"), "{err}");
    // Within the bounds, the same shapes decode.
    let mut few = head;
    few.extend(std::iter::repeat_n([0x1a, 0x00], 10).flatten());
    assert_eq!(
        decode_forward_backward(&few)
            .unwrap()
            .request
            .forward_backward_input
            .data
            .len(),
        11
    );
}

#[test]
fn an_int64_tensor_holding_a_fraction_is_an_error_in_both_encodings() {
    let mut req = request();
    req.forward_backward_input.data[0]
        .loss_fn_inputs
        .get_mut("target_tokens")
        .unwrap()
        .data[1] = 2.5;
    let err = encode_forward_backward(&req, false).unwrap_err();
    assert!(err.to_string().contains("not an integer"), "{err}");
    assert!(serde_json::to_value(&req).is_err());
}
