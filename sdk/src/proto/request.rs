//! `POST /api/v1/forward_backward` as protobuf: what SDK 0.25 and later always send
//! (`forward` arrives as `forward_backward` with `forward_only`).

use std::collections::BTreeMap;

use prost::Message;

use super::arrays::{
    read_bf16, read_f32, read_i32, read_i64, token_i32, write_f32, write_i32, write_i64,
};
use super::{pb, unsupported, ProtoError};
use crate::types::{
    Datum, ForwardBackwardInput, ForwardBackwardRequest, LossConfigValue, ModelInput,
    ModelInputChunk, TensorData, TensorDtype,
};

/// A decoded protobuf `forward_backward` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardBackwardProto {
    /// The same typed request a JSON body gives.
    pub request: ForwardBackwardRequest,
    /// `forward` (no gradient) rather than `forward_backward`.
    pub forward_only: bool,
}

/// Decodes a protobuf `ForwardBackwardRequest` into the typed request.
///
/// `seq_id` must be at least 1 (the SDK numbers a run's operations from 1; 0 is what an
/// unset id encodes to). Loss settings come from `loss_fn_config_v2` when the client sent
/// it (0.38 writes both maps, and only the v2 map holds text such as a custom loss's
/// `loss_id`), else from `loss_fn_config`. Provenance spans are accepted and not used.
pub fn decode_forward_backward(body: &[u8]) -> Result<ForwardBackwardProto, ProtoError> {
    check_structure(body)?;
    let msg = pb::ForwardBackwardRequest::decode(body)?;
    if msg.seq_id < 1 {
        return Err(unsupported(
            "seq_id",
            format!("{} is not a positive operation number", msg.seq_id),
        ));
    }
    let loss_fn_config = loss_config(&msg)?;
    let data = msg
        .data
        .into_iter()
        .enumerate()
        .map(|(i, d)| datum(i, d))
        .collect::<Result<_, _>>()?;
    Ok(ForwardBackwardProto {
        request: ForwardBackwardRequest {
            forward_backward_input: ForwardBackwardInput {
                data,
                loss_fn: msg.loss_fn,
                loss_fn_config,
            },
            model_id: msg.model_id,
            seq_id: Some(msg.seq_id as u64),
        },
        forward_only: msg.forward_only,
    })
}

/// Most datums one protobuf request may hold (the official SDK sends at most 1024).
pub const MAX_DATUMS: usize = 8192;
/// Most of each kind of small message a request may hold in all: model-input chunks,
/// loss-input map entries (and loss settings), tensor dimensions, provenance spans.
pub const MAX_PARTS: usize = 65_536;

/// Counts a request's repeated parts on the wire, before prost builds them. A protobuf
/// body is dense: an empty datum is 2 bytes on the wire and over a hundred in memory,
/// so a body within the size limit could otherwise claim gigabytes while decoding.
fn check_structure(body: &[u8]) -> Result<(), ProtoError> {
    #[derive(Default)]
    struct Parts {
        datums: usize,
        chunks: usize,
        entries: usize,
        dims: usize,
        spans: usize,
    }
    fn add(count: &mut usize, n: usize, limit: usize, what: &str) -> Result<(), ProtoError> {
        *count = count.saturating_add(n);
        if *count > limit {
            let reason = format!("more than {limit} {what} in one request");
            return Err(unsupported("data", reason));
        }
        Ok(())
    }
    let mut p = Parts::default();
    fields(body, &mut |tag, value| match (tag, value) {
        (3, Field::Bytes(datum)) => {
            add(&mut p.datums, 1, MAX_DATUMS, "datums")?;
            fields(datum, &mut |tag, value| match (tag, value) {
                (1, _) => add(&mut p.chunks, 1, MAX_PARTS, "model_input chunks"),
                (3 | 4, _) => add(&mut p.spans, 1, MAX_PARTS, "provenance spans"),
                (2, Field::Bytes(entry)) => {
                    add(&mut p.entries, 1, MAX_PARTS, "map entries")?;
                    fields(entry, &mut |tag, value| match (tag, value) {
                        (2, Field::Bytes(tensor)) => {
                            fields(tensor, &mut |tag, value| match (tag, value) {
                                // Packed: at most one dimension per byte.
                                (4, Field::Bytes(packed)) => {
                                    add(&mut p.dims, packed.len(), MAX_PARTS, "tensor dimensions")
                                }
                                (4, _) => add(&mut p.dims, 1, MAX_PARTS, "tensor dimensions"),
                                _ => Ok(()),
                            })
                        }
                        _ => Ok(()),
                    })
                }
                _ => Ok(()),
            })
        }
        (5 | 7, _) => add(&mut p.entries, 1, MAX_PARTS, "map entries"),
        _ => Ok(()),
    })
}

/// One field's payload, as far as counting needs it.
enum Field<'a> {
    Bytes(&'a [u8]),
    Scalar,
}

/// Calls `f` with each field of one message level (tag and payload), checking lengths.
fn fields<'a>(
    mut buf: &'a [u8],
    f: &mut dyn FnMut(u32, Field<'a>) -> Result<(), ProtoError>,
) -> Result<(), ProtoError> {
    use prost::encoding::{decode_key, decode_varint, WireType};
    while !buf.is_empty() {
        let (tag, wire_type) = decode_key(&mut buf)?;
        let skip = |buf: &mut &'a [u8], n: usize| -> Result<&'a [u8], ProtoError> {
            if n > buf.len() {
                return Err(ProtoError::Decode(
                    "a field runs past the end of the body".into(),
                ));
            }
            let (head, rest) = buf.split_at(n);
            *buf = rest;
            Ok(head)
        };
        match wire_type {
            WireType::LengthDelimited => {
                let len = usize::try_from(decode_varint(&mut buf)?).unwrap_or(usize::MAX);
                let payload = skip(&mut buf, len)?;
                f(tag, Field::Bytes(payload))?;
            }
            WireType::Varint => {
                decode_varint(&mut buf)?;
                f(tag, Field::Scalar)?;
            }
            WireType::SixtyFourBit => {
                skip(&mut buf, 8)?;
                f(tag, Field::Scalar)?;
            }
            WireType::ThirtyTwoBit => {
                skip(&mut buf, 4)?;
                f(tag, Field::Scalar)?;
            }
            WireType::StartGroup | WireType::EndGroup => {
                return Err(ProtoError::Decode(
                    "groups are not part of this schema".into(),
                ))
            }
        }
    }
    Ok(())
}

fn loss_config(
    msg: &pb::ForwardBackwardRequest,
) -> Result<Option<BTreeMap<String, LossConfigValue>>, ProtoError> {
    use pb::loss_config_value::Value;
    let config: BTreeMap<String, LossConfigValue> = if msg.loss_fn_config_v2.is_empty() {
        msg.loss_fn_config
            .iter()
            .map(|(k, v)| (k.clone(), LossConfigValue::Number(*v)))
            .collect()
    } else {
        msg.loss_fn_config_v2
            .iter()
            .map(|(k, v)| match &v.value {
                Some(Value::Number(n)) => Ok((k.clone(), LossConfigValue::Number(*n))),
                Some(Value::Text(t)) => Ok((k.clone(), LossConfigValue::Text(t.clone()))),
                None => Err(unsupported(format!("loss_fn_config.{k}"), "no value")),
            })
            .collect::<Result<_, _>>()?
    };
    Ok((!config.is_empty()).then_some(config))
}

fn datum(i: usize, d: pb::Datum) -> Result<Datum, ProtoError> {
    let chunks = d
        .model_input
        .into_iter()
        .enumerate()
        .map(|(j, c)| chunk(&format!("data[{i}].model_input[{j}]"), c))
        .collect::<Result<_, _>>()?;
    let loss_fn_inputs = d
        .loss_fn_inputs
        .into_iter()
        .map(|(name, t)| {
            let field = format!("data[{i}].loss_fn_inputs.{name}");
            Ok((name, tensor(&field, t)?))
        })
        .collect::<Result<_, ProtoError>>()?;
    Ok(Datum {
        model_input: ModelInput { chunks },
        loss_fn_inputs,
    })
}

fn chunk(field: &str, c: pb::Chunk) -> Result<ModelInputChunk, ProtoError> {
    use pb::chunk::Chunk;
    match c.chunk {
        Some(Chunk::EncodedText(t)) => Ok(ModelInputChunk::EncodedText {
            tokens: read_i32(field, &t.tokens)?
                .into_iter()
                .map(i64::from)
                .collect(),
        }),
        Some(Chunk::Image(_)) => Err(unsupported(
            field,
            "image inputs need a vision model; this server's base model reads text",
        )),
        Some(Chunk::Dmel(_)) => Err(unsupported(
            field,
            "audio inputs need an audio model; this server's base model reads text",
        )),
        None => Err(unsupported(field, "an empty chunk")),
    }
}

/// A protobuf tensor as the typed wire tensor. `int32` widens to `int64` and `bfloat16`
/// to `float32`, as the SDK's own decoder does.
pub(super) fn tensor(field: &str, t: pb::Tensor) -> Result<TensorData, ProtoError> {
    use pb::tensor::Encoding;
    let dtype = pb::DType::try_from(t.dtype)
        .map_err(|_| unsupported(field, format!("unknown dtype {}", t.dtype)))?;
    let values = |bytes: &[u8]| -> Result<(Vec<f64>, TensorDtype), ProtoError> {
        Ok(match dtype {
            pb::DType::DtypeFloat32 => (
                read_f32(field, bytes)?.into_iter().map(f64::from).collect(),
                TensorDtype::Float32,
            ),
            pb::DType::DtypeBfloat16 => (
                read_bf16(field, bytes)?
                    .into_iter()
                    .map(f64::from)
                    .collect(),
                TensorDtype::Float32,
            ),
            pb::DType::DtypeInt64 => (
                read_i64(field, bytes)?
                    .into_iter()
                    .map(|v| v as f64)
                    .collect(),
                TensorDtype::Int64,
            ),
            pb::DType::DtypeInt32 => (
                read_i32(field, bytes)?.into_iter().map(f64::from).collect(),
                TensorDtype::Int64,
            ),
            pb::DType::DtypeUnspecified => return Err(unsupported(field, "no dtype")),
        })
    };
    let shape = t
        .shape
        .iter()
        .map(|&d| {
            usize::try_from(d).map_err(|_| unsupported(field, format!("negative dimension {d}")))
        })
        .collect::<Result<Vec<usize>, _>>()?;
    let shape = (!shape.is_empty()).then_some(shape);
    match t.encoding {
        Some(Encoding::Dense(bytes)) => {
            let (data, dtype) = values(&bytes)?;
            Ok(TensorData {
                data,
                dtype,
                shape,
                sparse_crow_indices: None,
                sparse_col_indices: None,
            })
        }
        Some(Encoding::SparseCsr(csr)) => {
            let (data, dtype) = values(&csr.values)?;
            Ok(TensorData {
                data,
                dtype,
                shape,
                sparse_crow_indices: Some(read_i64(
                    &format!("{field}.crow_indices"),
                    &csr.crow_indices,
                )?),
                sparse_col_indices: Some(read_i64(
                    &format!("{field}.col_indices"),
                    &csr.col_indices,
                )?),
            })
        }
        // proto3 drops an empty `bytes` oneof member on the wire: an empty dense tensor.
        None => {
            let (data, dtype) = values(&[])?;
            Ok(TensorData {
                data,
                dtype,
                shape,
                sparse_crow_indices: None,
                sparse_col_indices: None,
            })
        }
    }
}

/// Encodes a typed request as the protobuf body SDK 0.25+ sends.
pub fn encode_forward_backward(
    request: &ForwardBackwardRequest,
    forward_only: bool,
) -> Result<Vec<u8>, ProtoError> {
    let input = &request.forward_backward_input;
    let seq_id = match request.seq_id {
        Some(s) => {
            i32::try_from(s).map_err(|_| unsupported("seq_id", format!("{s} exceeds int32")))?
        }
        None => {
            return Err(unsupported(
                "seq_id",
                "the protobuf request needs an operation number",
            ))
        }
    };
    let data = input
        .data
        .iter()
        .enumerate()
        .map(|(i, d)| encode_datum(i, d))
        .collect::<Result<_, _>>()?;
    let config = input.loss_fn_config.clone().unwrap_or_default();
    let msg = pb::ForwardBackwardRequest {
        model_id: request.model_id.clone(),
        seq_id,
        data,
        loss_fn: input.loss_fn.clone(),
        loss_fn_config_v2: config
            .iter()
            .map(|(k, v)| {
                let value = match v {
                    LossConfigValue::Number(n) => pb::loss_config_value::Value::Number(*n),
                    LossConfigValue::Text(t) => pb::loss_config_value::Value::Text(t.clone()),
                };
                (k.clone(), pb::LossConfigValue { value: Some(value) })
            })
            .collect(),
        // The numeric map is what 0.25 servers read; 0.38 writes both, as here.
        loss_fn_config: config
            .iter()
            .filter_map(|(k, v)| match v {
                LossConfigValue::Number(n) => Some((k.clone(), *n)),
                LossConfigValue::Text(_) => None,
            })
            .collect(),
        forward_only,
    };
    Ok(msg.encode_to_vec())
}

fn encode_datum(i: usize, d: &Datum) -> Result<pb::Datum, ProtoError> {
    let model_input = d
        .model_input
        .chunks
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let field = format!("data[{i}].model_input[{j}]");
            match c {
                ModelInputChunk::EncodedText { tokens } => Ok(pb::Chunk {
                    chunk: Some(pb::chunk::Chunk::EncodedText(pb::EncodedTextChunk {
                        tokens: write_i32(
                            tokens
                                .iter()
                                .map(|&t| token_i32(&field, t))
                                .collect::<Result<Vec<_>, _>>()?,
                        )
                        .into(),
                    })),
                }),
                _ => Err(unsupported(
                    field,
                    "only token chunks travel as protobuf here",
                )),
            }
        })
        .collect::<Result<_, _>>()?;
    let loss_fn_inputs = d
        .loss_fn_inputs
        .iter()
        .map(|(name, t)| {
            Ok((
                name.clone(),
                encode_tensor(&format!("data[{i}].{name}"), t)?,
            ))
        })
        .collect::<Result<_, ProtoError>>()?;
    Ok(pb::Datum {
        model_input,
        loss_fn_inputs,
        ..Default::default()
    })
}

fn encode_tensor(field: &str, t: &TensorData) -> Result<pb::Tensor, ProtoError> {
    let (dtype, values) = match t.dtype {
        TensorDtype::Float32 => (
            pb::DType::DtypeFloat32,
            write_f32(t.data.iter().map(|&v| v as f32)),
        ),
        TensorDtype::Int64 => {
            if let Some(v) = t.data.iter().find(|v| !crate::types::is_int64(**v)) {
                let reason = format!("an int64 tensor holds {v}, which is not an integer");
                return Err(unsupported(field, reason));
            }
            (
                pb::DType::DtypeInt64,
                write_i64(t.data.iter().map(|&v| v as i64)),
            )
        }
    };
    let encoding = match (&t.sparse_crow_indices, &t.sparse_col_indices) {
        (Some(crow), Some(col)) => pb::tensor::Encoding::SparseCsr(pb::SparseCsr {
            values: values.into(),
            crow_indices: write_i64(crow.iter().copied()).into(),
            col_indices: write_i64(col.iter().copied()).into(),
        }),
        _ => pb::tensor::Encoding::Dense(values.into()),
    };
    Ok(pb::Tensor {
        encoding: Some(encoding),
        dtype: dtype as i32,
        shape: t
            .shape
            .iter()
            .flatten()
            .map(|&d| i64::try_from(d).unwrap_or(i64::MAX))
            .collect(),
    })
}
