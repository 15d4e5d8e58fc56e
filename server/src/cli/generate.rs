//! `lathe generate`: one completion from the base model or a saved adapter.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use lathe_server::model::{ChatMessage, PrecisionChoice};
use lathe_server::sample::{sample, DecodeMode, Picker, SampleJob};
use lathe_server::store::peft;

/// Options of `lathe generate`.
#[derive(Args)]
pub struct GenerateArgs {
    /// `default`, a `.gguf` file or a Hugging Face model directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// A PEFT adapter directory (as written by `save_state` / `save_weights_for_sampler`).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// The prompt: a user message, or raw text with --raw.
    #[arg(long)]
    prompt: String,
    /// Most new tokens.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Seed for sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Feed the prompt as is, without the chat template.
    #[arg(long)]
    raw: bool,
    /// Element type of the base model's products. f32 by default: generating trains
    /// nothing, and one stream decodes faster with the f32 products than with bf16's
    /// (`auto` chooses as `lathe serve` does).
    #[arg(long, value_enum, default_value_t = PrecisionChoice::F32)]
    precision: PrecisionChoice,
    #[command(flatten)]
    device: super::DeviceArg,
}

/// Runs `lathe generate`.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    if !args.temperature.is_finite() || args.temperature < 0.0 {
        anyhow::bail!("--temperature must be a finite number >= 0");
    }
    let model = super::load_model(&args.model, args.device, args.precision)?;
    let adapter = args
        .adapter
        .as_ref()
        .map(|dir| peft::load_adapter(dir, &model.transformer.config, model.transformer.device()))
        .transpose()
        .context("loading the adapter")?;
    let text = if args.raw {
        args.prompt.clone()
    } else {
        model
            .chat_template
            .as_ref()
            .context("this model has no chat template; use --raw")?
            .render(&[ChatMessage::new("user", &args.prompt)], true)?
    };
    let prompt = model.tokenizer.encode(&text)?;
    let job = SampleJob {
        prompt,
        adapter: adapter.as_ref().map(|_| 0),
        num_samples: 1,
        picker: Picker {
            temperature: args.temperature,
            ..Default::default()
        },
        max_tokens: args.max_tokens,
        stop_strings: vec![],
        stop_tokens: vec![],
        seed: args.seed,
        prompt_logprobs: false,
        topk_prompt_logprobs: 0,
    };
    let adapters: Vec<_> = adapter.iter().collect();
    let out = sample(
        &model.transformer,
        &model.tokenizer,
        &adapters,
        &[job],
        DecodeMode::Fast,
    )?;
    let seq = &out[0].sequences[0];
    let mut tokens = seq.tokens.as_slice();
    if let Some((last, rest)) = tokens.split_last() {
        if model.tokenizer.eos_ids().contains(last) {
            tokens = rest;
        }
    }
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", model.tokenizer.decode(tokens)?)?;
    Ok(())
}
