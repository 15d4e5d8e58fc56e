//! The Rust SDK against a real server in-process on 127.0.0.1:0 with a tiny model.

use std::time::Duration;

use lathe::types::{
    AdamParams, CheckpointKind, Datum, LoraConfig, LossFn, ModelInput, SamplingParams,
};
use lathe::{Error, SamplingSource, ServiceClient};
use lathe_server::model::tiny::tiny_model;
use lathe_server::model::Arch;
use lathe_server::server::{self, RunningServer, ServerConfig};

const KEY: &str = "tml-sdk-test";

async fn start(dir: &std::path::Path) -> RunningServer {
    let model = tiny_model(Arch::Qwen3, 5, &candle_core::Device::Cpu).unwrap();
    let config = ServerConfig {
        port: 0,
        data_dir: dir.to_path_buf(),
        api_keys: vec![KEY.into()],
        poll_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    server::start(model, config).await.unwrap()
}

async fn connect(srv: &RunningServer) -> ServiceClient {
    ServiceClient::builder()
        .base_url(srv.base_url())
        .api_key(KEY)
        .build()
        .await
        .unwrap()
}

fn datum(seed: i64) -> Datum {
    let toks: Vec<i64> = (0..10).map(|i| (seed * 17 + i * 29) % 250 + 3).collect();
    Datum::cross_entropy(
        ModelInput::from_ints(toks[..9].to_vec()),
        toks[1..].to_vec(),
        vec![1.0; 9],
    )
}

fn temp(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("lathe-sdk-{tag}-{}", std::process::id()))
}

const ADAM: AdamParams = AdamParams {
    learning_rate: 1e-2,
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-12,
    weight_decay: 0.0,
    grad_clip_norm: 0.0,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_flow_with_pipelining_and_exact_resume() {
    let dir = temp("flow");
    let srv = start(&dir).await;
    let service = connect(&srv).await;
    let base = service
        .get_server_capabilities()
        .await
        .unwrap()
        .supported_models[0]
        .model_name
        .clone();
    let lora = LoraConfig {
        rank: 4,
        seed: Some(1),
        ..Default::default()
    };
    let trainer = service
        .create_lora_training_client(&base, lora)
        .await
        .unwrap();
    assert_eq!(trainer.get_info().await.unwrap().lora_rank, 4);

    // Pipelined: submit forward_backward and optim_step, then await both.
    let mut losses = Vec::new();
    for _ in 0..3 {
        let fb = trainer
            .forward_backward(&[datum(1)], LossFn::CrossEntropy, None)
            .await
            .unwrap();
        let step = trainer.optim_step(ADAM).await.unwrap();
        let out = fb.result().await.unwrap();
        assert_eq!(out.logprobs(0).unwrap().len(), 9);
        losses.push(out.loss().unwrap());
        assert!(step.result().await.unwrap().grad_norm().unwrap() > 0.0);
    }
    assert!(losses[2] < losses[0], "{losses:?}");

    let sampler = trainer
        .save_weights_and_get_sampling_client()
        .await
        .unwrap();
    let params = SamplingParams {
        max_tokens: Some(5),
        seed: Some(3),
        ..Default::default()
    };
    let prompt = ModelInput::from_ints(vec![5, 6, 7]);
    let out = sampler
        .sample(&prompt, 2, &params)
        .await
        .unwrap()
        .result()
        .await
        .unwrap();
    assert_eq!(out.sequences.len(), 2);
    let lps = sampler
        .compute_logprobs(&prompt)
        .await
        .unwrap()
        .result()
        .await
        .unwrap();
    assert_eq!(lps.len(), 3);
    assert!(lps[0].is_none() && lps[1].is_some());
    let topk = sampler
        .compute_topk_logprobs(&prompt, 4)
        .await
        .unwrap()
        .result()
        .await
        .unwrap();
    assert_eq!(topk.len(), 3);
    assert!(topk[0].is_none());
    for (row, lp) in topk[1..].iter().zip(&lps[1..]) {
        let row = row.as_ref().unwrap();
        assert_eq!(row.len(), 4);
        assert!(row.windows(2).all(|w| w[0].1 >= w[1].1));
        // The prompt's own token is no more likely than the best alternative.
        assert!(row[0].1 >= lp.unwrap() - 1e-5);
    }
    assert!(sampler.compute_topk_logprobs(&prompt, 0).await.is_err());

    let state = trainer
        .save_state("s1")
        .await
        .unwrap()
        .result()
        .await
        .unwrap();
    assert_eq!(state.kind, CheckpointKind::Training);
    let sampler_uri = trainer
        .save_weights_for_sampler("p1")
        .await
        .unwrap()
        .result()
        .await
        .unwrap();

    // Resume with optimizer: the next step equals the original's.
    let resumed = service
        .create_training_client_from_state_with_optimizer(&state)
        .await
        .unwrap();
    for t in [&trainer, &resumed] {
        t.forward_backward(&[datum(2)], LossFn::CrossEntropy, None)
            .await
            .unwrap()
            .result()
            .await
            .unwrap();
        t.optim_step(ADAM).await.unwrap().result().await.unwrap();
    }
    let a = trainer
        .forward(&[datum(2)], LossFn::CrossEntropy, None)
        .await
        .unwrap()
        .result()
        .await
        .unwrap();
    let b = resumed
        .forward(&[datum(2)], LossFn::CrossEntropy, None)
        .await
        .unwrap()
        .result()
        .await
        .unwrap();
    assert_eq!(a.loss(), b.loss());

    let from_path = service
        .create_sampling_client(SamplingSource::Path(sampler_uri.clone()))
        .await
        .unwrap();
    from_path
        .sample(&prompt, 1, &params)
        .await
        .unwrap()
        .result()
        .await
        .unwrap();

    let rest = service.create_rest_client();
    let runs = rest.list_training_runs(20, 0).await.unwrap();
    assert!(runs
        .training_runs
        .iter()
        .any(|r| r.training_run_id == trainer.model_id()));
    let ckpts = rest.list_checkpoints(trainer.model_id()).await.unwrap();
    assert_eq!(ckpts.checkpoints.len(), 2);
    let tar = dir.join("s1.tar");
    assert!(
        rest.download_checkpoint_archive(&state, &tar)
            .await
            .unwrap()
            > 0
    );
    rest.delete_checkpoint(&sampler_uri).await.unwrap();
    assert_eq!(
        rest.list_checkpoints(trainer.model_id())
            .await
            .unwrap()
            .checkpoints
            .len(),
        1
    );

    // Typed errors: checked client-side, rejected by the server, failed in the future.
    let err = trainer
        .forward_backward(&[], LossFn::CrossEntropy, None)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    let bad = Datum::cross_entropy(
        ModelInput::from_ints(vec![1, 99999]),
        vec![2, 3],
        vec![1.0, 1.0],
    );
    let err = trainer
        .forward_backward(&[bad], LossFn::CrossEntropy, None)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Api { status: 400, .. }), "{err}");
    let err = trainer
        .optim_step(ADAM)
        .await
        .unwrap()
        .result()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::RequestFailed { category, .. } if category == "user"),
        "{err}"
    );

    let tok = trainer.get_tokenizer().await.unwrap();
    assert_eq!(tok.decode(&tok.encode("hello").unwrap()).unwrap(), "hello");
    srv.shutdown(Duration::from_secs(10)).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_at_once_stay_independent() {
    let dir = temp("two");
    let srv = start(&dir).await;
    let base = "tiny-qwen3";
    let run = |seed: i64| {
        let srv_url = srv.base_url();
        async move {
            let service = ServiceClient::builder()
                .base_url(srv_url)
                .api_key(KEY)
                .build()
                .await
                .unwrap();
            let lora = LoraConfig {
                rank: 4,
                seed: Some(seed as u64),
                ..Default::default()
            };
            let t = service
                .create_lora_training_client(base, lora)
                .await
                .unwrap();
            let mut out = Vec::new();
            for _ in 0..3 {
                let fb = t
                    .forward_backward(&[datum(seed)], LossFn::CrossEntropy, None)
                    .await
                    .unwrap();
                let step = t.optim_step(ADAM).await.unwrap();
                out.push(fb.result().await.unwrap().loss().unwrap());
                step.result().await.unwrap();
            }
            out
        }
    };
    let (a, b) = tokio::join!(run(1), run(2));
    let a_alone = run(1).await;
    let b_alone = run(2).await;
    for (x, y) in a.iter().chain(&b).zip(a_alone.iter().chain(&b_alone)) {
        assert!(
            (x - y).abs() <= 1e-4 * y.abs().max(1.0),
            "{a:?} {b:?} vs {a_alone:?} {b_alone:?}"
        );
    }
    srv.shutdown(Duration::from_secs(10)).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// `-(logprobs * weights).sum()` as the torch.fx graph tinker 0.38 uploads.
fn neg_ll_graph() -> lathe::types::CustomLossGraph {
    use lathe::types::{
        CustomLossGraph, CustomLossNode, CustomLossNodeOp as Op, GraphArg, TaggedArg,
    };
    let r = |name: &str| GraphArg::Tagged(TaggedArg::Ref(name.into()));
    let node = |op, name: &str, target: &str, args: Vec<GraphArg>| CustomLossNode {
        op,
        name: name.into(),
        target: target.into(),
        args,
        kwargs: Default::default(),
    };
    let metrics = GraphArg::Tagged(TaggedArg::Dict(
        [("custom/nll:sum".to_string(), r("neg"))].into(),
    ));
    CustomLossGraph {
        format: 1,
        nodes: vec![
            node(Op::Placeholder, "logprobs", "logprobs", vec![]),
            node(Op::Placeholder, "weights", "weights", vec![]),
            node(
                Op::CallFunction,
                "mul",
                "operator.mul",
                vec![r("logprobs"), r("weights")],
            ),
            node(Op::CallMethod, "sum_1", "sum", vec![r("mul")]),
            node(Op::CallFunction, "neg", "operator.neg", vec![r("sum_1")]),
            node(
                Op::Output,
                "output",
                "output",
                vec![GraphArg::Tagged(TaggedArg::Tuple(vec![r("neg"), metrics]))],
            ),
        ],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_losses_train_server_side_like_the_loss_they_spell_out() {
    use lathe::types::CustomLossInput;
    let dir = temp("custom");
    let srv = start(&dir).await;
    let service = connect(&srv).await;
    let base = service
        .get_server_capabilities()
        .await
        .unwrap()
        .supported_models[0]
        .model_name
        .clone();
    let inputs = vec![
        CustomLossInput {
            name: "logprobs".into(),
            rank: 1,
        },
        CustomLossInput {
            name: "weights".into(),
            rank: 1,
        },
    ];
    let loss = service
        .create_custom_loss("neg_ll", inputs.clone(), neg_ll_graph())
        .await
        .unwrap();
    let lora = LoraConfig {
        rank: 4,
        seed: Some(3),
        ..Default::default()
    };
    let builtin = service
        .create_lora_training_client(&base, lora)
        .await
        .unwrap();
    let custom = service
        .create_lora_training_client(&base, lora)
        .await
        .unwrap();
    let data = vec![datum(1), datum(2)];
    for _ in 0..2 {
        let want = builtin
            .forward_backward(&data, LossFn::CrossEntropy, None)
            .await
            .unwrap()
            .result()
            .await
            .unwrap();
        let got = custom
            .forward_backward_custom(&data, &loss)
            .await
            .unwrap()
            .result()
            .await
            .unwrap();
        let (w, g) = (want.metrics["loss:sum"], got.metrics["loss:sum"]);
        assert!((w - g).abs() <= 1e-5 * w.abs(), "{w} vs {g}");
        assert!((got.metrics["custom/nll:sum"] - g).abs() <= 1e-9 * g.abs());
        builtin
            .optim_step(ADAM)
            .await
            .unwrap()
            .result()
            .await
            .unwrap();
        custom
            .optim_step(ADAM)
            .await
            .unwrap()
            .result()
            .await
            .unwrap();
    }
    // Checked before sending: a datum without the input, and another session's loss.
    let bare = Datum {
        model_input: data[0].model_input.clone(),
        loss_fn_inputs: data[0]
            .loss_fn_inputs
            .iter()
            .filter(|(k, _)| k.as_str() == "target_tokens")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    };
    let err = custom
        .forward_backward_custom(&[bare], &loss)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    let other = connect(&srv).await;
    let foreign = other
        .create_custom_loss("neg_ll", inputs.clone(), neg_ll_graph())
        .await
        .unwrap();
    let err = custom
        .forward_backward_custom(&data, &foreign)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("session"), "{err}");
    // The server's allow-list refuses what it does not know, with the node named.
    let mut evil = neg_ll_graph();
    evil.nodes[2].target = "builtins.exec".into();
    let err = service
        .create_custom_loss("evil", inputs, evil)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Api { status: 400, .. }), "{err}");
    assert!(err.to_string().contains("builtins.exec"), "{err}");
}
