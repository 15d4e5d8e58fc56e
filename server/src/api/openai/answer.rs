//! Whole (not streamed) answers: sampling results to OpenAI's response types.

use std::collections::BTreeMap;

use lathe_sdk::types::openai::{
    ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatMessageOut,
    ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
    Usage,
};

use super::request::Plan;
use super::text::ChoiceText;
use super::{now, TextModel};
use crate::api::ApiError;
use crate::model::TextTokenizer;
use crate::sample::{Generated, SampleOutput, Stop};

/// A failure to decode sampled tokens (a server fault: they came from the model).
pub fn tokenizer_error(e: crate::model::ModelError) -> ApiError {
    ApiError::internal(format!("decoding the sampled tokens failed: {e}"))
}

/// One token's own text (lossy where it holds part of a character).
pub fn token_text(tok: &TextTokenizer, id: u32) -> String {
    tok.decode(&[id]).unwrap_or_default()
}

/// Whether a sampled token is part of the answer's text (EOS is not).
pub fn in_answer(tok: &TextTokenizer, id: u32) -> bool {
    !tok.eos_ids().contains(&id)
}

/// A sequence's answer tokens with their log-probabilities.
fn answer_tokens<'a>(
    tok: &'a TextTokenizer,
    seq: &'a Generated,
) -> impl Iterator<Item = (u32, f32)> + 'a {
    seq.tokens
        .iter()
        .copied()
        .zip(seq.logprobs.iter().copied())
        .filter(|&(id, _)| in_answer(tok, id))
}

/// A sequence's text, ended at the first stop string.
fn choice_text(tok: &TextTokenizer, plan: &Plan, seq: &Generated) -> Result<ChoiceText, ApiError> {
    let mut c = ChoiceText::new(plan.stops.clone());
    if !plan.drop_generated {
        for (id, _) in answer_tokens(tok, seq) {
            c.push(tok, id).map_err(tokenizer_error)?;
        }
    }
    c.finish(tok).map_err(tokenizer_error)?;
    Ok(c)
}

/// `stop` when a stop string, a stop token or EOS ended the choice, `length` otherwise.
pub fn finish_reason(plan: &Plan, text: &ChoiceText, stop: Stop) -> &'static str {
    if !plan.drop_generated && (text.stopped() || stop == Stop::Stop) {
        "stop"
    } else {
        "length"
    }
}

/// Token counts: each prompt once, every choice's sampled tokens.
pub fn usage(plan: &Plan, outputs: &[SampleOutput]) -> Usage {
    let prompt_tokens = plan.jobs.iter().map(|j| j.prompt.len()).sum();
    let completion_tokens = if plan.drop_generated {
        0
    } else {
        outputs
            .iter()
            .flat_map(|o| &o.sequences)
            .map(|s| s.tokens.len())
            .sum()
    };
    Usage {
        prompt_tokens,
        completion_tokens,
        total_tokens: prompt_tokens + completion_tokens,
    }
}

/// The answer of `/v1/completions`.
pub fn completion(
    text: &TextModel,
    id: &str,
    plan: &Plan,
    req: &CompletionRequest,
    outputs: Vec<SampleOutput>,
) -> Result<CompletionResponse, ApiError> {
    let tok = &text.tokenizer;
    let mut choices = Vec::new();
    for (p, out) in outputs.iter().enumerate() {
        let echoed = if req.echo {
            Some(echo(tok, &plan.jobs[p].prompt, out)?)
        } else {
            None
        };
        for (i, seq) in out.sequences.iter().enumerate() {
            let ct = choice_text(tok, plan, seq)?;
            let mut body = String::new();
            let mut logprobs = None;
            if let Some((prompt_text, prompt_lp)) = &echoed {
                body.push_str(prompt_text);
                logprobs = Some(prompt_lp.clone());
            }
            body.push_str(ct.visible());
            if req.logprobs.is_some() {
                let lp = logprobs.get_or_insert_with(CompletionLogprobs::default);
                let base = echoed.as_ref().map_or(0, |(t, _)| t.chars().count());
                let answer: Vec<(u32, f32)> = if plan.drop_generated {
                    Vec::new()
                } else {
                    answer_tokens(tok, seq).collect()
                };
                for (j, (id, logprob)) in answer.into_iter().take(ct.visible_tokens()).enumerate() {
                    lp.tokens.push(token_text(tok, id));
                    lp.token_logprobs.push(Some(logprob));
                    // Alternatives are not computed for sampled tokens.
                    lp.top_logprobs.push(None);
                    lp.text_offset.push(base + ct.char_offset(j));
                }
            } else {
                logprobs = None;
            }
            choices.push(CompletionChoice {
                index: p * plan.n + i,
                text: body,
                logprobs,
                finish_reason: Some(finish_reason(plan, &ct, seq.stop).into()),
            });
        }
    }
    Ok(CompletionResponse {
        id: format!("cmpl-{id}"),
        object: "text_completion".into(),
        created: now(),
        model: req.model.clone(),
        usage: Some(usage(plan, &outputs)),
        choices,
    })
}

/// An echoed prompt's text and its log-probabilities (first `null`), with the top
/// alternatives when they were asked for.
fn echo(
    tok: &TextTokenizer,
    prompt: &[u32],
    out: &SampleOutput,
) -> Result<(String, CompletionLogprobs), ApiError> {
    let mut ct = ChoiceText::new(Vec::new());
    for &id in prompt {
        ct.push(tok, id).map_err(tokenizer_error)?;
    }
    ct.finish(tok).map_err(tokenizer_error)?;
    let mut lp = CompletionLogprobs::default();
    for (j, &id) in prompt.iter().enumerate() {
        lp.tokens.push(token_text(tok, id));
        let logprob = out
            .prompt_logprobs
            .as_ref()
            .and_then(|l| l.get(j).copied().flatten());
        lp.token_logprobs.push(logprob);
        let top = out
            .topk_prompt_logprobs
            .as_ref()
            .and_then(|t| t.get(j).cloned().flatten())
            .map(|alts| {
                alts.into_iter()
                    .map(|(id, lp)| (token_text(tok, id), lp))
                    .collect::<BTreeMap<_, _>>()
            });
        lp.top_logprobs.push(top);
        lp.text_offset.push(ct.char_offset(j));
    }
    Ok((ct.visible().to_string(), lp))
}

/// The answer of `/v1/chat/completions`.
pub fn chat(
    text: &TextModel,
    id: &str,
    plan: &Plan,
    req: &ChatCompletionRequest,
    outputs: Vec<SampleOutput>,
) -> Result<ChatCompletionResponse, ApiError> {
    let tok = &text.tokenizer;
    let mut choices = Vec::new();
    for out in &outputs {
        for (i, seq) in out.sequences.iter().enumerate() {
            let ct = choice_text(tok, plan, seq)?;
            let logprobs = req.logprobs.then(|| ChatLogprobs {
                content: answer_tokens(tok, seq)
                    .take(ct.visible_tokens())
                    .map(|(id, logprob)| {
                        let token = token_text(tok, id);
                        ChatTokenLogprob {
                            bytes: token.as_bytes().to_vec(),
                            token,
                            logprob,
                            top_logprobs: Vec::new(),
                        }
                    })
                    .collect(),
            });
            choices.push(ChatChoice {
                index: i,
                message: Some(ChatMessageOut {
                    role: Some("assistant".into()),
                    content: Some(ct.visible().to_string()),
                }),
                delta: None,
                logprobs,
                finish_reason: Some(finish_reason(plan, &ct, seq.stop).into()),
            });
        }
    }
    Ok(ChatCompletionResponse {
        id: format!("chatcmpl-{id}"),
        object: "chat.completion".into(),
        created: now(),
        model: req.model.clone(),
        usage: Some(usage(plan, &outputs)),
        choices,
    })
}
