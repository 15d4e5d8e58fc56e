//! Streamed answers: server-sent events, one chunk per piece of new text, as the decode
//! picks tokens.
//!
//! A task per request follows the prompts' token watches and sends chunks through a
//! small bounded channel to the response body. A slow reader makes the task wait, never
//! the decode (the watch keeps only the latest tokens); a reader that goes away ends the
//! task, and dropping its [`Submitted`] cancels the requests still running. The final
//! text of each choice comes from the request's result, so chunks add up to the answer
//! the same request gives unstreamed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use lathe_sdk::types::openai::{
    ChatChoice, ChatCompletionResponse, ChatMessageOut, CompletionChoice, CompletionResponse,
    OpenAiErrorBody, OpenAiErrorDetail, Usage,
};
use serde::Serialize;
use tokio::sync::mpsc;

use super::answer::{finish_reason, in_answer, tokenizer_error, usage};
use super::request::Plan;
use super::text::ChoiceText;
use super::{now, Submitted};
use crate::api::{ApiError, AppState};
use crate::model::TextTokenizer;
use crate::sample::SampleOutput;

/// Chunks buffered between the task and the response body.
const CHUNKS_IN_FLIGHT: usize = 16;

/// A chunk that waits this long for room (the reader took none of the buffered ones
/// meanwhile) counts the reader as gone: its request is cancelled and the connection
/// aborted, where a connection left open but never read would otherwise hold them for
/// as long as it stays open. Slow decoding between chunks never counts.
const READER_STALL: Duration = Duration::from_secs(60);

/// Which endpoint's chunk shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `text_completion` chunks.
    Completion,
    /// `chat.completion.chunk` chunks.
    Chat,
}

/// Starts streaming `sent`'s results.
pub fn start(
    s: AppState,
    plan: Plan,
    sent: Submitted,
    kind: Kind,
    model: String,
    include_usage: bool,
) -> Response {
    let (tx, rx) = mpsc::channel::<Event>(CHUNKS_IN_FLIGHT);
    let stalled = Arc::new(AtomicBool::new(false));
    let chunks = Chunks {
        id: match kind {
            Kind::Completion => format!("cmpl-{}", sent.id()),
            Kind::Chat => format!("chatcmpl-{}", sent.id()),
        },
        created: now(),
        kind,
        model,
        tx,
        stalled: stalled.clone(),
    };
    tokio::spawn(follow(s, plan, sent, chunks, include_usage));
    Sse::new(body(rx, stalled))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The response body: the chunks as they come, then its end; after a stall
/// ([`READER_STALL`]) an error instead of a clean end, so that the connection is aborted
/// and a reader that comes back cannot take a cut answer for a whole one.
fn body(
    rx: mpsc::Receiver<Event>,
    stalled: Arc<AtomicBool>,
) -> impl futures::Stream<Item = Result<Event, std::io::Error>> {
    futures::stream::unfold(Some((rx, stalled)), |state| async move {
        let (mut rx, stalled) = state?;
        match rx.recv().await {
            Some(e) => Some((Ok(e), Some((rx, stalled)))),
            None if stalled.load(Ordering::SeqCst) => Some((
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the reader took no chunk for 60 s",
                )),
                None,
            )),
            None => None,
        }
    })
}

/// Writes chunks of one answer.
struct Chunks {
    id: String,
    created: u64,
    kind: Kind,
    model: String,
    tx: mpsc::Sender<Event>,
    /// Set when a chunk waited [`READER_STALL`] for room: the body then ends in an error.
    stalled: Arc<AtomicBool>,
}

/// The reader went away.
struct Gone;

impl Chunks {
    async fn send(&self, body: &impl Serialize) -> Result<(), Gone> {
        let event = Event::default()
            .json_data(body)
            .unwrap_or_else(|_| Event::default().data("{}"));
        self.deliver(event).await
    }

    /// Queues `event` for the reader; `Gone` when it left or stalled ([`READER_STALL`]).
    async fn deliver(&self, event: Event) -> Result<(), Gone> {
        match tokio::time::timeout(READER_STALL, self.tx.send(event)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Gone),
            Err(_) => {
                self.stalled.store(true, Ordering::SeqCst);
                Err(Gone)
            }
        }
    }

    /// A chunk for choice `index`: new text, the assistant role (chat's first chunk),
    /// or the finish reason.
    async fn choice(
        &self,
        index: usize,
        text: String,
        first: bool,
        finish: Option<&str>,
    ) -> Result<(), Gone> {
        let finish_reason = finish.map(str::to_string);
        match self.kind {
            Kind::Completion => {
                self.send(&self.completion(vec![CompletionChoice {
                    index,
                    text,
                    logprobs: None,
                    finish_reason,
                }]))
                .await
            }
            Kind::Chat => {
                let delta = ChatMessageOut {
                    role: first.then(|| "assistant".to_string()),
                    content: (first || !text.is_empty()).then_some(text),
                };
                self.send(&self.chat(vec![ChatChoice {
                    index,
                    message: None,
                    delta: Some(delta),
                    logprobs: None,
                    finish_reason,
                }]))
                .await
            }
        }
    }

    /// The usage chunk (no choices).
    async fn usage(&self, usage: Usage) -> Result<(), Gone> {
        match self.kind {
            Kind::Completion => {
                let mut c = self.completion(Vec::new());
                c.usage = Some(usage);
                self.send(&c).await
            }
            Kind::Chat => {
                let mut c = self.chat(Vec::new());
                c.usage = Some(usage);
                self.send(&c).await
            }
        }
    }

    fn completion(&self, choices: Vec<CompletionChoice>) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: None,
        }
    }

    fn chat(&self, choices: Vec<ChatChoice>) -> ChatCompletionResponse {
        ChatCompletionResponse {
            id: self.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: None,
        }
    }

    /// An error after the stream began: OpenAI's error body as the last event.
    async fn error(&self, e: ApiError) -> Result<(), Gone> {
        self.send(&OpenAiErrorBody {
            error: OpenAiErrorDetail {
                message: e.message,
                kind: e.code.into(),
                param: None,
                code: Some(e.code.into()),
            },
        })
        .await
    }

    async fn done(&self) -> Result<(), Gone> {
        self.deliver(Event::default().data("[DONE]")).await
    }
}

/// One choice being streamed.
struct Live {
    text: ChoiceText,
    /// Tokens of the choice already fed to `text`.
    fed: usize,
}

impl Live {
    /// Feeds the tokens past those already fed; returns the new visible text.
    fn feed(&mut self, tok: &TextTokenizer, tokens: &[u32]) -> Result<String, ApiError> {
        self.feed_new(tok, tokens.get(self.fed..).unwrap_or(&[]))
    }

    /// Feeds `new`, the tokens that follow those already fed.
    fn feed_new(&mut self, tok: &TextTokenizer, new: &[u32]) -> Result<String, ApiError> {
        let mut out = String::new();
        for &id in new {
            self.fed += 1;
            if in_answer(tok, id) {
                out.push_str(&self.text.push(tok, id).map_err(tokenizer_error)?);
            }
        }
        Ok(out)
    }
}

/// Streams every prompt's choices in order, then the usage and `[DONE]`.
async fn follow(s: AppState, plan: Plan, mut sent: Submitted, chunks: Chunks, include_usage: bool) {
    let mut outputs = Vec::new();
    for p in 0..plan.jobs.len() {
        match follow_prompt(&s, &plan, &mut sent, &chunks, p).await {
            Ok(Some(out)) => outputs.push(out),
            Ok(None) => return,
            Err(e) => {
                let _ = chunks.error(e).await;
                return;
            }
        }
    }
    if include_usage && chunks.usage(usage(&plan, &outputs)).await.is_err() {
        return;
    }
    let _ = chunks.done().await;
}

/// Streams prompt `p`'s choices until its result; `Ok(None)` when the reader left.
async fn follow_prompt(
    s: &AppState,
    plan: &Plan,
    sent: &mut Submitted,
    chunks: &Chunks,
    p: usize,
) -> Result<Option<SampleOutput>, ApiError> {
    let tok = &s.text.tokenizer;
    let n = plan.jobs[p].num_samples;
    let mut live: Vec<Live> = (0..n)
        .map(|_| Live {
            text: ChoiceText::new(plan.stops.clone()),
            fed: 0,
        })
        .collect();
    let index = |i: usize| p * plan.n + i;
    if chunks.kind == Kind::Chat {
        for i in 0..n {
            if chunks
                .choice(index(i), String::new(), true, None)
                .await
                .is_err()
            {
                return Ok(None);
            }
        }
    }
    let mut watch = sent.watches[p].take();
    let id = sent.ids[p].clone();
    let engine = sent.engine.clone();
    let (owner, poll) = (sent.owner.clone(), sent.poll);
    // Wait for the result while publishing each watch update.
    let mut waiting = Box::pin(engine.retrieve(owner.clone(), id.clone(), poll));
    loop {
        let changed = async {
            match watch.as_mut() {
                Some(w) => w.changed().await.is_ok(),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = chunks.tx.closed() => return Ok(None),
            r = &mut waiting => {
                if r?.is_some() {
                    break;
                }
                waiting = Box::pin(engine.retrieve(owner.clone(), id.clone(), poll));
            }
            open = changed => {
                let Some(w) = watch.as_mut().filter(|_| open) else {
                    watch = None;
                    continue;
                };
                // Only each choice's new tokens are copied (the decode waits on the watch
                // while it is borrowed).
                let new: Vec<Vec<u32>> = {
                    let all = w.borrow_and_update();
                    live.iter()
                        .enumerate()
                        .map(|(i, l)| {
                            all.get(i)
                                .and_then(|t| t.get(l.fed..))
                                .map_or_else(Vec::new, <[u32]>::to_vec)
                        })
                        .collect()
                };
                for (i, l) in live.iter_mut().enumerate() {
                    let text = l.feed_new(tok, &new[i])?;
                    if !text.is_empty()
                        && chunks.choice(index(i), text, false, None).await.is_err()
                    {
                        return Ok(None);
                    }
                }
            }
        }
    }
    drop(waiting);
    let out = sent.output(p).await?;
    for (i, (l, seq)) in live.iter_mut().zip(&out.sequences).enumerate() {
        let mut text = l.feed(tok, &seq.tokens)?;
        text.push_str(&l.text.finish(tok).map_err(tokenizer_error)?);
        if !text.is_empty() && chunks.choice(index(i), text, false, None).await.is_err() {
            return Ok(None);
        }
        let reason = finish_reason(plan, &l.text, seq.stop);
        if chunks
            .choice(index(i), String::new(), false, Some(reason))
            .await
            .is_err()
        {
            return Ok(None);
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    /// A reader that leaves its connection open but stops reading is dropped after
    /// [`READER_STALL`], so that what its stream holds is freed and its request ends.
    #[tokio::test(start_paused = true)]
    async fn a_reader_that_stops_reading_is_gone_after_the_stall_limit() {
        let (tx, mut rx) = mpsc::channel(1);
        let flag = Arc::new(AtomicBool::new(false));
        let chunks = Chunks {
            id: "cmpl-1".into(),
            created: 0,
            kind: Kind::Completion,
            model: "m".into(),
            tx,
            stalled: flag.clone(),
        };
        // A reader that reads gets its chunks.
        chunks
            .deliver(Event::default().data("1"))
            .await
            .ok()
            .unwrap();
        assert!(rx.recv().await.is_some());
        // One that stops: the buffer fills, then the next chunk waits out the limit.
        chunks
            .deliver(Event::default().data("2"))
            .await
            .ok()
            .unwrap();
        let start = tokio::time::Instant::now();
        let stalled =
            tokio::time::timeout(2 * READER_STALL, chunks.deliver(Event::default().data("3")))
                .await
                .expect("the send gave up by itself");
        assert!(stalled.is_err(), "the stalled reader counts as gone");
        assert!(start.elapsed() >= READER_STALL);
        // The body gives what was buffered, then an error, not a clean end.
        drop(chunks);
        let events: Vec<_> = body(rx, flag).collect().await;
        assert_eq!(events.len(), 2);
        assert!(events[0].is_ok() && events[1].is_err());
    }

    /// A stream that ends as it should ends cleanly.
    #[tokio::test]
    async fn a_finished_stream_ends_cleanly() {
        let (tx, rx) = mpsc::channel(2);
        tx.send(Event::default().data("[DONE]")).await.unwrap();
        drop(tx);
        let events: Vec<_> = body(rx, Arc::new(AtomicBool::new(false))).collect().await;
        assert_eq!(events.len(), 1);
        assert!(events[0].is_ok());
    }
}
