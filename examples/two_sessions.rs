//! Two adapters trained side by side on one base model: each session learns its own
//! answer to the same question, and their requests share the server's batches.
//!
//! `cargo run --release --example two_sessions`

mod common;

use lathe::types::{AdamParams, Datum, LoraConfig, LossFn, SamplingParams};
use lathe::{Message, ServiceClient, Tokenizer};

const QUESTION: &str = "What is your favourite colour? Answer with one word.";

async fn teach(
    service: &ServiceClient,
    base: &str,
    tok: &Tokenizer,
    answer: &str,
) -> anyhow::Result<String> {
    let trainer = service
        .create_lora_training_client(
            base,
            LoraConfig {
                rank: 8,
                seed: Some(7),
                ..Default::default()
            },
        )
        .await?;
    let prompt = tok.chat_prompt(&[Message::new("user", QUESTION)])?;
    let p = prompt.to_ints().expect("text prompt");
    let mut a = tok.encode(answer)?;
    a.extend(tok.eos_token_id());
    let datum = Datum::supervised(&p, &a);
    let adam = AdamParams {
        learning_rate: 1e-3,
        ..Default::default()
    };
    for step in 1..=12 {
        let fb = trainer
            .forward_backward(std::slice::from_ref(&datum), LossFn::CrossEntropy, None)
            .await?;
        let opt = trainer.optim_step(adam).await?;
        let loss = fb.result().await?.loss().unwrap_or(f64::NAN);
        opt.result().await?;
        println!("[{answer}] step {step:2}: loss {loss:.4}");
    }
    let sampler = trainer.save_weights_and_get_sampling_client().await?;
    let params = SamplingParams {
        max_tokens: Some(8),
        temperature: 0.0,
        ..Default::default()
    };
    let out = sampler.sample(&prompt, 1, &params).await?.result().await?;
    Ok(tok.decode(&out.sequences[0].tokens)?.trim().to_string())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let conn = common::connect().await?;
    let tok = conn.service.get_tokenizer(&conn.base_model).await?;
    let (blue, green) = tokio::join!(
        teach(&conn.service, &conn.base_model, &tok, "Blue"),
        teach(&conn.service, &conn.base_model, &tok, "Green"),
    );
    println!("session 1 answers {:?}", blue?);
    println!("session 2 answers {:?}", green?);
    Ok(())
}
