//! Teach the base model to answer one arithmetic question, sampling before and after.
//!
//! `cargo run --release --example quickstart` (uses `LATHE_BASE_URL` / `TINKER_BASE_URL`
//! if set, else starts a server in-process on the default model).

mod common;

use lathe::types::{AdamParams, Datum, LoraConfig, LossFn, ModelInput, SamplingParams};
use lathe::{Message, SamplingClient, Tokenizer};

const QUESTION: &str = "What is 17 + 25? Answer with only the number.";
const ANSWER: &str = "42";

async fn ask(
    sampler: &SamplingClient,
    tok: &Tokenizer,
    prompt: &ModelInput,
) -> anyhow::Result<String> {
    let params = SamplingParams {
        max_tokens: Some(12),
        temperature: 0.0,
        ..Default::default()
    };
    let out = sampler.sample(prompt, 1, &params).await?.result().await?;
    Ok(tok.decode(&out.sequences[0].tokens)?.trim().to_string())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let conn = common::connect().await?;
    let trainer = conn
        .service
        .create_lora_training_client(
            &conn.base_model,
            LoraConfig {
                rank: 8,
                seed: Some(0),
                ..Default::default()
            },
        )
        .await?;
    let tok = trainer.get_tokenizer().await?;
    let prompt = tok.chat_prompt(&[Message::new("user", QUESTION)])?;
    let before = ask(
        &trainer.save_weights_and_get_sampling_client().await?,
        &tok,
        &prompt,
    )
    .await?;
    println!("before training: {QUESTION} -> {before:?}");

    // One supervised example: the prompt, then the answer and the end-of-turn token.
    let prompt_ids = prompt.to_ints().expect("text prompt");
    let mut answer = tok.encode(ANSWER)?;
    answer.extend(tok.eos_token_id());
    let datum = Datum::supervised(&prompt_ids, &answer);

    let adam = AdamParams {
        learning_rate: 1e-3,
        ..Default::default()
    };
    for step in 1..=15 {
        // Submit both before waiting: the server runs them in order.
        let fb = trainer
            .forward_backward(std::slice::from_ref(&datum), LossFn::CrossEntropy, None)
            .await?;
        let opt = trainer.optim_step(adam).await?;
        let loss = fb.result().await?.loss().unwrap_or(f64::NAN);
        opt.result().await?;
        println!("step {step:2}: loss {loss:.4}");
    }
    let after = ask(
        &trainer.save_weights_and_get_sampling_client().await?,
        &tok,
        &prompt,
    )
    .await?;
    println!("after training:  {QUESTION} -> {after:?}");
    Ok(())
}
