//! The OpenAI-compatible endpoints over plain HTTP, against the Tinker protocol's own
//! `asample` on the same server as the reference: same tokens, same log-probabilities,
//! streamed chunks that add up to the whole answer, and the same access rules.

mod common;

use common::http::*;
use lathe_sdk::types::openai::{ChatCompletionResponse, CompletionResponse, ModelList};
use lathe_server::model::tiny::tiny_tokenizer;
use serde_json::{json, Value};

/// `asample` through the Tinker protocol: (tokens, logprobs) per sample, and the
/// prompt's logprobs when asked.
fn tinker_sample(c: &Client, sampler: Value, prompt: &[u32], max_tokens: usize) -> Value {
    let mut body = json!({
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "num_samples": 1,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0},
        "prompt_logprobs": true,
    });
    for (k, v) in sampler.as_object().unwrap() {
        body[k] = v.clone();
    }
    c.call("/api/v1/asample", &body).unwrap()
}

fn completion(c: &Client, body: Value) -> CompletionResponse {
    let (status, v) = c.post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    serde_json::from_value(v).unwrap()
}

/// The `data:` payloads of an event stream.
fn events(c: &Client, path: &str, body: Value) -> Vec<String> {
    let resp = reqwest::blocking::Client::new()
        .post(format!("{}{path}", c.url))
        .bearer_auth(&c.key)
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    resp.text()
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

#[test]
fn completions_are_the_tinker_samplers_tokens_whole_and_streamed() {
    let dir = temp_dir("openai");
    let server = TestServer::start(&dir, |_| {});
    let c = server.client(KEY_A);
    let tok = tiny_tokenizer().unwrap();
    let base = c.base_model();
    let prompt = "The quick brown fox";
    let ids = tok.encode(prompt).unwrap();

    let reference = tinker_sample(&c, json!({"base_model": base}), &ids, 12);
    let seq = &reference["sequences"][0];
    let tokens: Vec<u32> = serde_json::from_value(seq["tokens"].clone()).unwrap();
    let eos = tok.eos_ids().to_vec();
    let answer: Vec<u32> = tokens
        .iter()
        .copied()
        .filter(|t| !eos.contains(t))
        .collect();
    let expected = tok.decode(&answer).unwrap();

    let whole = completion(
        &c,
        json!({"model": base, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0}),
    );
    assert_eq!(whole.object, "text_completion");
    assert_eq!(whole.choices.len(), 1);
    assert_eq!(whole.choices[0].text, expected);
    let usage = whole.usage.unwrap();
    assert_eq!(usage.prompt_tokens, ids.len());
    assert_eq!(usage.completion_tokens, tokens.len());
    let lp = whole.choices[0].logprobs.as_ref().unwrap();
    let want: Vec<Option<f32>> = serde_json::from_value::<Vec<f32>>(seq["logprobs"].clone())
        .unwrap()
        .into_iter()
        .take(answer.len())
        .map(Some)
        .collect();
    assert_eq!(lp.token_logprobs, want, "the sampler's own logprobs");

    // The same prompt as token ids gives the same answer.
    let by_ids = completion(
        &c,
        json!({"model": base, "prompt": ids, "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(by_ids.choices[0].text, expected);

    // Streamed: chunks add up to the whole text, then the finish, usage and [DONE].
    let stream = events(
        &c,
        "/v1/completions",
        json!({"model": base, "prompt": prompt, "max_tokens": 12, "temperature": 0,
               "stream": true, "stream_options": {"include_usage": true}}),
    );
    assert_eq!(stream.last().unwrap(), "[DONE]");
    let chunks: Vec<CompletionResponse> = stream[..stream.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .flat_map(|c| &c.choices)
        .map(|c| c.text.as_str())
        .collect();
    assert_eq!(text, expected);
    assert!(chunks.len() >= 3, "text came in pieces: {stream:?}");
    let finish: Vec<_> = chunks
        .iter()
        .flat_map(|c| &c.choices)
        .filter_map(|c| c.finish_reason.clone())
        .collect();
    assert_eq!(
        finish,
        vec![whole.choices[0].finish_reason.clone().unwrap()]
    );
    assert_eq!(chunks.last().unwrap().usage, Some(usage));
    server.stop();
}

#[test]
fn echo_scores_the_prompt_as_compute_logprobs_does() {
    let dir = temp_dir("openai-echo");
    let server = TestServer::start(&dir, |_| {});
    let c = server.client(KEY_A);
    let tok = tiny_tokenizer().unwrap();
    let base = c.base_model();
    let prompt = "Paris is the capital of France";
    let ids = tok.encode(prompt).unwrap();
    let reference = tinker_sample(&c, json!({"base_model": base}), &ids, 1);
    let want: Vec<Option<f32>> =
        serde_json::from_value(reference["prompt_logprobs"].clone()).unwrap();

    // lm-evaluation-harness's loglikelihood request.
    let r = completion(
        &c,
        json!({"model": base, "prompt": prompt, "max_tokens": 0, "echo": true,
               "logprobs": 1, "temperature": 0}),
    );
    let choice = &r.choices[0];
    assert_eq!(choice.text, prompt, "max_tokens 0 adds nothing");
    let lp = choice.logprobs.as_ref().unwrap();
    assert_eq!(lp.token_logprobs, want);
    assert_eq!(lp.tokens.len(), ids.len());
    assert!(lp.top_logprobs[0].is_none());
    // The most likely token at each later position, with its log-probability at least
    // the actual token's.
    for (top, actual) in lp.top_logprobs[1..].iter().zip(&want[1..]) {
        let top = top.as_ref().unwrap();
        assert_eq!(top.len(), 1);
        assert!(*top.values().next().unwrap() >= actual.unwrap() - 1e-6);
    }
    assert_eq!(lp.text_offset[..3], [0, 1, 2]);
    assert_eq!(r.usage.unwrap().completion_tokens, 0);
    server.stop();
}

#[test]
fn chat_uses_the_template_and_streams_the_same_message() {
    let dir = temp_dir("openai-chat");
    let server = TestServer::start(&dir, |_| {});
    let c = server.client(KEY_A);
    let tok = tiny_tokenizer().unwrap();
    let base = c.base_model();
    // The tiny model's template is ChatML.
    let rendered = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n";
    let reference = tinker_sample(
        &c,
        json!({"base_model": base}),
        &tok.encode(rendered).unwrap(),
        10,
    );
    let tokens: Vec<u32> =
        serde_json::from_value(reference["sequences"][0]["tokens"].clone()).unwrap();
    let answer: Vec<u32> = tokens
        .iter()
        .copied()
        .filter(|t| !tok.eos_ids().contains(t))
        .collect();
    let expected = tok.decode(&answer).unwrap();

    let body = json!({"model": "default", "messages": [{"role": "user", "content": "Hi there"}],
                      "max_tokens": 10, "temperature": 0, "logprobs": true});
    let (status, v) = c.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let whole: ChatCompletionResponse = serde_json::from_value(v).unwrap();
    let msg = whole.choices[0].message.as_ref().unwrap();
    assert_eq!(msg.role.as_deref(), Some("assistant"));
    assert_eq!(msg.content.as_deref(), Some(expected.as_str()));
    let logprobs = &whole.choices[0].logprobs.as_ref().unwrap().content;
    assert_eq!(logprobs.len(), answer.len());

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["logprobs"] = json!(false);
    let stream = events(&c, "/v1/chat/completions", streamed);
    assert_eq!(stream.last().unwrap(), "[DONE]");
    let chunks: Vec<ChatCompletionResponse> = stream[..stream.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(chunks.iter().all(|c| c.object == "chat.completion.chunk"));
    let first = chunks[0].choices[0].delta.as_ref().unwrap();
    assert_eq!(first.role.as_deref(), Some("assistant"));
    let text: String = chunks
        .iter()
        .flat_map(|c| &c.choices)
        .filter_map(|c| c.delta.as_ref()?.content.clone())
        .collect();
    assert_eq!(text, expected);
    server.stop();
}

#[test]
fn adapters_are_models_only_for_keys_that_may_read_them() {
    let dir = temp_dir("openai-adapter");
    let server = TestServer::start(&dir, |_| {});
    let alice = server.client(KEY_A);
    let bob = server.client(KEY_B);
    let session = alice.session();
    let mut t = Trainer::new(&alice, &session, 0, 3);
    t.step(vec![ce_datum(&[1, 2, 3, 4], &[2, 3, 4, 5])], 1e-2);
    let path = t.save_sampler("eval");
    let prompt = [5u32, 6, 7];
    let reference = tinker_sample(&alice, json!({"model_path": path}), &prompt, 8);
    let r = completion(
        &alice,
        json!({"model": path, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0}),
    );
    let want: Vec<f32> =
        serde_json::from_value(reference["sequences"][0]["logprobs"].clone()).unwrap();
    let got: Vec<f32> = r.choices[0]
        .logprobs
        .as_ref()
        .unwrap()
        .token_logprobs
        .iter()
        .map(|l| l.unwrap())
        .collect();
    assert_eq!(
        got,
        want[..got.len()],
        "the adapter samples as asample does"
    );

    let (status, models) = alice.get("/v1/models");
    assert_eq!(status, 200);
    let models: ModelList = serde_json::from_value(models).unwrap();
    let ids: Vec<&str> = models.data.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, vec![alice.base_model().as_str(), path.as_str()]);
    let (_, theirs) = bob.get("/v1/models");
    assert_eq!(theirs["data"].as_array().unwrap().len(), 1, "{theirs}");

    // Another key cannot sample the adapter; errors come in OpenAI's shape.
    let (status, err) = bob.post(
        "/v1/completions",
        &json!({"model": path, "prompt": "x", "max_tokens": 2}),
    );
    assert!(status == 404 || status == 403, "{status} {err}");
    assert!(
        err["error"]["message"].as_str().unwrap().contains("eval"),
        "{err}"
    );
    server.stop();
}

#[test]
fn what_cannot_be_honoured_is_refused_by_name() {
    let dir = temp_dir("openai-refuse");
    let server = TestServer::start(&dir, |_| {});
    let c = server.client(KEY_A);
    let base = c.base_model();
    let cases = [
        (
            "/v1/completions",
            json!({"model": "gpt-4", "prompt": "x"}),
            404,
            "gpt-4",
        ),
        (
            "/v1/completions",
            json!({"model": base, "prompt": "x", "presence_penalty": 0.5}),
            400,
            "presence_penalty",
        ),
        (
            "/v1/completions",
            json!({"model": base, "prompt": "x", "logit_bias": {"1": 5}}),
            400,
            "logit_bias",
        ),
        (
            "/v1/completions",
            json!({"model": base, "prompt": "x", "n": 65}),
            400,
            "n=65",
        ),
        (
            "/v1/completions",
            json!({"model": base, "prompt": "x", "max_tokens": 1000000}),
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            json!({"model": base, "prompt": "x", "stream": true, "logprobs": 1}),
            400,
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"model": base, "prompt": [1, 99999]}),
            400,
            "99999",
        ),
        (
            "/v1/completions",
            json!({"model": base, "prompt": "x", "best_of": 3}),
            400,
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"model": base, "prompt": "x", "logprobs": 2}),
            400,
            "alternatives",
        ),
        // At most OpenAI's 5 alternatives, echoed or not.
        (
            "/v1/completions",
            json!({"model": base, "prompt": "x", "echo": true, "logprobs": 6, "max_tokens": 0}),
            400,
            "at most 5",
        ),
        ("/v1/completions", json!({"model": base}), 400, "prompt"),
        // Refused before anything is encoded: text longer than the context could hold
        // (256 tokens here, 32 bytes each), and more prompts than choices.
        (
            "/v1/completions",
            json!({"model": base, "prompt": "ab ".repeat(3000)}),
            400,
            "bytes of text",
        ),
        // Each of these prompts is over the size limit too: the count is checked first.
        (
            "/v1/completions",
            json!({"model": base, "prompt": vec!["ab ".repeat(3000); 65]}),
            400,
            "65 prompt(s)",
        ),
        (
            "/v1/chat/completions",
            json!({"model": base, "messages": [{"role": "user", "content": "ab ".repeat(3000)}]}),
            400,
            "bytes of text",
        ),
        (
            "/v1/chat/completions",
            json!({"model": base, "messages": []}),
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"model": base, "messages": [{"role": "tool", "content": "x"}]}),
            400,
            "tool",
        ),
        (
            "/v1/chat/completions",
            json!({"model": base, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            400,
            "image_url",
        ),
        (
            "/v1/chat/completions",
            json!({"model": base, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}),
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"model": base, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
            400,
            "tools",
        ),
    ];
    for (path, body, status, needle) in cases {
        let (got, v) = c.post(path, &body);
        assert_eq!(got, status, "{body}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{body}: {v}");
    }
    let anonymous = Client::new(&server.url, "");
    let (status, _) = anonymous.post("/v1/completions", &json!({"model": base, "prompt": "x"}));
    assert_eq!(status, 401);
    server.stop();
}
