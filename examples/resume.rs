//! Save training state, then resume it exactly from its URI in a new process.
//!
//! ```text
//! cargo run --release --example resume                 # trains 3 steps, prints a URI
//! cargo run --release --example resume -- <URI>        # resumes from it, 3 more steps
//! ```
//! Uses `LATHE_BASE_URL` / `TINKER_BASE_URL` if set, else an in-process server whose data
//! lives in `lathe-data/examples/` (so the second process finds the checkpoint).

mod common;

use lathe::types::{AdamParams, CheckpointUri, Datum, LoraConfig, LossFn, ModelInput};
use lathe::TrainingClient;

async fn train(trainer: &TrainingClient, datum: &Datum, steps: usize) -> anyhow::Result<()> {
    let adam = AdamParams {
        learning_rate: 5e-4,
        ..Default::default()
    };
    for _ in 0..steps {
        let fb = trainer
            .forward_backward(std::slice::from_ref(datum), LossFn::CrossEntropy, None)
            .await?;
        let opt = trainer.optim_step(adam).await?;
        let loss = fb.result().await?.loss().unwrap_or(f64::NAN);
        opt.result().await?;
        println!("  loss {loss:.4}");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let conn = common::connect().await?;
    let service = &conn.service;
    let trainer = match std::env::args().nth(1) {
        Some(uri) => {
            let uri: CheckpointUri = uri.parse().map_err(anyhow::Error::msg)?;
            println!("resuming from {uri} (weights and optimizer state)");
            service
                .create_training_client_from_state_with_optimizer(&uri)
                .await?
        }
        None => {
            println!("starting a new run");
            service
                .create_lora_training_client(
                    &conn.base_model,
                    LoraConfig {
                        rank: 8,
                        seed: Some(1),
                        ..Default::default()
                    },
                )
                .await?
        }
    };
    let tok = trainer.get_tokenizer().await?;
    let ids = tok.encode("The capital of France is Paris. The capital of Italy is Rome.")?;
    let n = ids.len() - 1;
    let datum = Datum::cross_entropy(
        ModelInput::from_ints(ids[..n].to_vec()),
        ids[1..].to_vec(),
        vec![1.0; n],
    );
    train(&trainer, &datum, 3).await?;
    let name = format!("resume-{}", std::process::id());
    let uri = trainer.save_state(&name).await?.result().await?;
    println!("saved {uri}");
    println!("resume with: cargo run --release --example resume -- {uri}");
    Ok(())
}
