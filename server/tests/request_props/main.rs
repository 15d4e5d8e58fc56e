//! Property tests of every request body the server decodes, against an untrusted tenant:
//! for random and adversarial bodies, decoding and validation never panic, and never
//! allocate more than a small multiple of the body's own size (plus a fixed slack). Where
//! it is cheap, what validation accepts is also checked against what was sent.
//!
//! Allocation is measured by a counting `#[global_allocator]`, per thread, so proptest's
//! machinery and the other tests running beside these do not count. A `realloc` counts
//! both blocks at its peak, as a moving `realloc` holds both. The bound is
//! [`ALLOC_FACTOR`] per byte of body, [`BUFFERED_FACTOR`] per byte of the fields serde
//! buffers as a value tree, plus [`ALLOC_SLACK`]; the constants say where they come from.
//! One allowance is not proportional to the body: a sparse loss input expands to its
//! declared size, [`EXPANDED_FACTOR`] bytes per declared value of each input the loss
//! reads. What a request may declare is bounded by `--max-tokens-per-request` (checked
//! from the shapes before anything is expanded), so that term is bounded by the operator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use lathe_sdk::types::{
    validate_checkpoint_name, CheckpointUri, CreateModelRequest, CreateSamplingSessionRequest,
    ForwardBackwardRequest, ForwardRequest, LoadWeightsRequest, ModelIdRequest, OptimStepRequest,
    RetrieveFutureRequest, SampleRequest, SaveWeightsForSamplerRequest, SaveWeightsRequest,
    SessionHeartbeatRequest, SetTtlRequest, TensorData, TensorDtype, WeightsInfoRequest,
};
use lathe_server::api::validate;
use lathe_server::engine::{KeyLimits, ModelInfo, Ttl, MAX_TTL_SECONDS};
use lathe_server::train::adamw;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Value};

mod alloc;
mod decoding;
mod generators;
mod streaming;

use alloc::*;
use decoding::*;
use generators::*;

// ---------------------------------------------------------------- properties

proptest! {
    #![proptest_config(cases(256))]

    /// Valid batches are accepted and keep every token and target (the semantic checks
    /// live in `forward_ok`), whichever encoding the targets use.
    #[test]
    fn valid_batches_round_trip((body, plans) in batch()) {
        let bytes = to_body(&body);
        let accepted = run_body(Kind::ForwardBackward, &bytes)?;
        prop_assert_eq!(accepted, Some(true), "{}", String::from_utf8_lossy(&bytes));
        let req: ForwardBackwardRequest = serde_json::from_slice(&bytes).unwrap();
        let input = &req.forward_backward_input;
        let Ok(validate::LossChoice::Builtin(loss)) =
            validate::loss(&input.loss_fn, input.loss_fn_config.as_ref())
        else {
            panic!("the generated losses are built-in");
        };
        let jobs = validate::forward_input(&model(), input, &limits(), loss).unwrap();
        for (job, p) in jobs.iter().zip(&plans) {
            prop_assert_eq!(job.k, p.k);
            let targets: Vec<i64> = job.targets.iter().map(|&t| t as i64).collect();
            prop_assert_eq!(&targets, &p.targets);
            // Weights are read (and kept) by cross-entropy only; RL losses ignore them.
            let w: Vec<f32> = if req.forward_backward_input.loss_fn == "cross_entropy" {
                p.weights.iter().map(|&x| x as f32).collect()
            } else {
                Vec::new()
            };
            prop_assert_eq!(&job.inputs.weights, &w);
        }
    }

    /// Valid batches with hostile edits anywhere: no panic, bounded memory, and whatever
    /// is still accepted is exactly what was sent.
    #[test]
    fn edited_batches_never_panic(
        (body, _) in batch(),
        edits in vec(edit(), 1..4),
        as_forward in any::<bool>(),
    ) {
        let mut body = body;
        for e in &edits {
            apply(&mut body, e);
        }
        if as_forward {
            if let Some(o) = body.as_object_mut() {
                if let Some(v) = o.remove("forward_backward_input") {
                    o.insert("forward_input".into(), v);
                }
            }
        }
        let kind = if as_forward { Kind::Forward } else { Kind::ForwardBackward };
        run_body(kind, &to_body(&body))?;
    }

    /// A sparse `target_tokens` whose shape disagrees with the tokens is refused, however
    /// self-consistent its own indices are and however large its shape.
    #[test]
    fn sparse_targets_of_the_wrong_shape_are_refused(
        n in 1usize..32,
        rows in prop_oneof![0usize..40, Just(1usize << 20)],
        cols in prop_oneof![
            0usize..70, Just(1usize << 32), Just(1 << 50), Just(1 << 63), Just(usize::MAX)
        ],
        nnz in vec(0usize..3, 0..40),
    ) {
        prop_assume!(!(rows == n && (1..=validate::MAX_TARGETS_PER_POSITION).contains(&cols)));
        // Self-consistent CSR for [rows, cols] (only when rows is small enough to write).
        let rows_written = rows.min(64);
        let mut crow = vec![0usize];
        let mut col = vec![];
        for r in 0..rows_written {
            for c in 0..nnz.get(r).copied().unwrap_or(0).min(cols) {
                col.push(c);
            }
            crow.push(col.len());
        }
        let targets = json!({
            "data": vec![1; col.len()], "dtype": "int64", "shape": [rows, cols],
            "sparse_crow_indices": crow, "sparse_col_indices": col,
        });
        let datum = json!({
            "model_input": {"chunks": [{"type": "encoded_text", "tokens": vec![1; n]}]},
            "loss_fn_inputs": {"target_tokens": targets},
        });
        let body = to_body(&json!({
            "forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"},
            "model_id": "m",
        }));
        prop_assert_eq!(run_body(Kind::ForwardBackward, &body)?, Some(false));
    }

    /// Valid and edited sampling bodies.
    #[test]
    fn sampling_bodies_never_panic(body in sample_body(), edits in vec(edit(), 0..4)) {
        let accepted = run_body(Kind::Sample, &to_body(&body))?;
        prop_assert_eq!(accepted, Some(true));
        let mut body = body;
        for e in &edits {
            apply(&mut body, e);
        }
        run_body(Kind::Sample, &to_body(&body))?;
    }

    /// Every other body kind, valid and then edited.
    #[test]
    fn other_bodies_never_panic(pick in any::<Index>(), edits in vec(edit(), 0..5)) {
        let all = other_bodies();
        let (kind, mut body) = all[pick.index(all.len())].clone();
        prop_assert_eq!(run_body(kind, &to_body(&body))?, Some(true), "{:?}", kind);
        for e in &edits {
            apply(&mut body, e);
        }
        run_body(kind, &to_body(&body))?;
    }

    /// Arbitrary JSON, read as every kind.
    #[test]
    fn arbitrary_json_never_panics(v in prop_oneof![4 => any_json(), 1 => deep()]) {
        run_all(&to_body(&v))?;
    }

    /// Arbitrary bytes, and valid bodies with their text damaged, read as every kind.
    #[test]
    fn damaged_text_never_panics(
        (body, _) in batch(),
        noise in vec(any::<u8>(), 0..64),
        at in any::<Index>(),
        cut in any::<Index>(),
        mode in 0u8..4,
    ) {
        let mut text = to_body(&body);
        let i = at.index(text.len() + 1);
        match mode {
            0 => text = noise.clone(),
            1 => { text.splice(i..i, noise.iter().copied()); }
            2 => text.truncate(cut.index(text.len() + 1)),
            _ => {
                let len = text.len().max(1);
                for (j, b) in noise.iter().enumerate() {
                    if let Some(x) = text.get_mut((i + j * 7) % len) {
                        *x ^= b;
                    }
                }
            }
        }
        run_all(&text)?;
    }

    /// The tensor helpers alone: `dims` and `num_elements` never panic, `to_dense` (called
    /// only within the documented contract: a bounded `num_elements`) either refuses
    /// before allocating or returns exactly `num_elements` values.
    #[test]
    fn tensors_expand_exactly_or_refuse(
        data in vec(prop_oneof![Just(0.0f64), any::<f64>()], 0..24),
        shape in prop::option::of(vec(prop_oneof![
            8 => 0usize..8, 1 => Just(1usize << 31), 1 => Just(1 << 50), 1 => Just(usize::MAX)
        ], 0..4)),
        crow in prop::option::of(vec(
            prop_oneof![0i64..10, Just(-1), Just(i64::MIN), Just(i64::MAX)], 0..10
        )),
        col in prop::option::of(vec(prop_oneof![0i64..10, Just(-1), Just(i64::MAX)], 0..24)),
        int in any::<bool>(),
    ) {
        // An int64 tensor holds integers (the SDK refuses to write anything else).
        let data = if int {
            data.into_iter().map(|v| if v.is_nan() { 0.0 } else { v.trunc().clamp(-1e18, 1e18) }).collect()
        } else {
            data
        };
        let t = TensorData {
            data,
            dtype: if int { TensorDtype::Int64 } else { TensorDtype::Float32 },
            shape,
            sparse_crow_indices: crow,
            sparse_col_indices: col,
        };
        let dims = t.dims();
        let size = t.num_elements();
        let product = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        prop_assert_eq!(size, if t.shape.is_some() { product } else { Some(t.data.len()) });
        // The contract: callers bound `num_elements` before expanding.
        let Some(size) = size.filter(|&s| s <= 1 << 16) else {
            return Ok(());
        };
        let body = serde_json::to_vec(&t).unwrap().len();
        let (out, peak) = peak_alloc_during(|| t.to_dense());
        match out {
            // The dense array itself, and nothing else of note.
            Ok(v) => {
                prop_assert_eq!(v.len(), size);
                prop_assert!(peak <= 8 * size + 1024, "{} bytes for {} values", peak, size);
            }
            // Refused before allocating: only the message.
            Err(_) => check_alloc("to_dense (refused)", body, 0, 0, peak)?,
        }
    }

    /// TTLs: `from_wire` refuses exactly what is above the limit, and the wire forms of a
    /// TTL (numbers of every kind) never panic the three bodies that carry one.
    #[test]
    fn ttls_are_bounded(
        s in prop_oneof![any::<u64>(), 0..=MAX_TTL_SECONDS + 10, Just(u64::MAX)],
        wire in wild_scalar(),
    ) {
        let accepted = ttl(Some(s));
        prop_assert_eq!(accepted, s <= MAX_TTL_SECONDS);
        let save = json!({"model_id": "m", "path": "p", "ttl_seconds": wire.clone()});
        for (kind, body) in [
            (Kind::SetTtl, json!({"ttl_seconds": wire})),
            (Kind::SaveWeights, save.clone()),
            (Kind::SaveForSampler, save),
        ] {
            run_body(kind, &to_body(&body))?;
        }
    }
}

proptest! {
    #![proptest_config(cases(64))]

    /// The tightest dense bodies the format allows (every number one digit), at the
    /// largest sizes validation accepts.
    #[test]
    fn compact_dense_bodies_stay_within_the_bound(
        n in 1usize..=MAX_SEQ,
        k in prop_oneof![Just(1usize), 1usize..=validate::MAX_TARGETS_PER_POSITION],
        datums in 1usize..4,
        inputs in 1usize..=5,
    ) {
        let body = compact_batch(n, k, datums, inputs, Form::Dense);
        prop_assert_eq!(run_body(Kind::ForwardBackward, &body)?, Some(true));
    }

    /// The same bodies with every loss input sparse and all zero: two bytes per row
    /// (`sparse_crow_indices`) however many values a row declares. Only the inputs the
    /// loss reads may be expanded, and only within the declared-size allowance.
    #[test]
    fn compact_sparse_bodies_stay_within_the_bound(
        n in 1usize..=MAX_SEQ,
        k in 1usize..=validate::MAX_TARGETS_PER_POSITION,
        inputs in 1usize..=5,
    ) {
        let body = compact_batch(n, k, 1, inputs, Form::Sparse);
        prop_assert_eq!(run_body(Kind::ForwardBackward, &body)?, Some(true));
    }

    /// Many datums of one token each, valid or not: per-datum overheads (a map node for
    /// `loss_fn_inputs`, the job) against the fewest bytes a datum can take.
    #[test]
    fn many_small_datums_stay_within_the_bound(
        datums in 1usize..3000,
        shape in prop::sample::select(vec![
            json!({"model_input": {"chunks": [{"type": "encoded_text", "tokens": [0]}]},
                   "loss_fn_inputs": {"target_tokens": {"data": [0], "dtype": "int64"},
                                      "weights": {"data": [0], "dtype": "int64"}}}),
            json!({"model_input": {"chunks": []},
                   "loss_fn_inputs": {"": {"data": [], "dtype": "int64"}}}),
            json!({"model_input": {"chunks": []}, "loss_fn_inputs": {}}),
        ]),
    ) {
        let body = json!({
            "forward_input": {"data": vec![shape; datums], "loss_fn": "cross_entropy"},
            "model_id": "m",
        });
        run_body(Kind::Forward, &to_body(&body))?;
    }

    /// Token arrays past the context limit, as a prompt and as a datum, in one chunk or
    /// many: refused, and bounded while being refused.
    #[test]
    fn long_token_arrays_stay_within_the_bound(
        len in MAX_SEQ..40_000,
        chunks in prop_oneof![Just(1usize), 1usize..2000],
    ) {
        let per = len.div_ceil(chunks);
        let chunks: Vec<Value> = vec![0; len]
            .chunks(per)
            .map(|c| json!({"type": "encoded_text", "tokens": c}))
            .collect();
        let input = json!({"chunks": chunks});
        let sample = json!({"prompt": input, "base_model": "base"});
        prop_assert_eq!(run_body(Kind::Sample, &to_body(&sample))?, Some(false));
        let datum = json!({"model_input": input, "loss_fn_inputs": {}});
        let fb = json!({
            "forward_input": {"data": [datum], "loss_fn": "cross_entropy"},
            "model_id": "m",
        });
        prop_assert_eq!(run_body(Kind::Forward, &to_body(&fb))?, Some(false));
    }

    /// Paths (checkpoint URIs) of every shape, as each body that carries one, thousands
    /// of `/` included.
    #[test]
    fn checkpoint_uris_stay_within_the_bound(
        parts in vec(prop_oneof![
            Just(String::new()), Just("weights".to_string()), Just("..".to_string()),
            "[a-z:]{0,6}",
        ], 0..6),
        slashes in 0usize..20_000,
    ) {
        let path = format!("tinker://{}{}", parts.join("/"), "/".repeat(slashes));
        let prompt = json!({"chunks": [{"type": "encoded_text", "tokens": [1]}]});
        for (kind, body) in [
            (Kind::LoadWeights, json!({"model_id": "m", "path": path})),
            (Kind::WeightsInfo, json!({"tinker_path": path})),
            (Kind::CreateSampling, json!({"session_id": "s", "sampling_session_seq_id": 0,
                                          "model_path": path})),
            (Kind::Sample, json!({"prompt": prompt, "model_path": path})),
        ] {
            run_body(kind, &to_body(&body))?;
        }
    }

    /// The fields serde buffers as its `Content` tree (stop conditions, an untagged enum;
    /// model input chunks, internally tagged, unknown fields included): large lists of
    /// every element type, flat and nested.
    #[test]
    fn buffered_fields_stay_within_the_bound(
        len in 0usize..20_000,
        elem in tree_elem(),
        chunk in any::<bool>(),
    ) {
        let list = vec![elem; len];
        let body = if chunk {
            json!({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1], "x": list}]},
                   "base_model": "base"})
        } else {
            json!({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                   "sampling_params": {"stop": list}, "base_model": "base"})
        };
        run_body(Kind::Sample, &to_body(&body))?;
    }

    /// A custom loss's graph arguments nested deep around long lists (serde's `untagged`
    /// copied each level's subtree again), and an OpenAI prompt of token ids.
    #[test]
    fn graph_arguments_and_prompts_stay_within_the_bound(
        depth in 1usize..120,
        len in 0usize..20_000,
    ) {
        let mut arg = json!(vec![0; len]);
        for _ in 0..depth {
            arg = json!([arg]);
        }
        let body = json!({"session_id": "s", "custom_loss_seq_id": 0, "name": "l",
                          "inputs": [{"name": "logprobs", "rank": 1}],
                          "graph": {"nodes": [{"op": "call_function", "name": "n",
                                               "target": "torch.exp", "args": [arg]}]}});
        run_body(Kind::CreateCustomLoss, &to_body(&body))?;
        let body = json!({"model": "base", "prompt": [vec![7; len]]});
        run_body(Kind::Completion, &to_body(&body))?;
    }

    /// `create_session`'s free-form `user_metadata`, which the handler skims without
    /// keeping it: nested one-entry objects, the costliest tree per byte.
    #[test]
    fn session_metadata_stays_within_the_bound(len in 0usize..20_000, elem in tree_elem()) {
        let body = to_body(&json!({"user_metadata": {"k": vec![elem; len]}}));
        run_body(Kind::CreateSession, &body)?;
    }
}
