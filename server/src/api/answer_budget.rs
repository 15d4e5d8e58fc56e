//! A per-key budget of answer bytes not yet taken by the key's clients. An answer built
//! in memory (a sample's result, a whole OpenAI completion with `echo` and `logprobs`)
//! leaves every engine budget once it is handed to its connection, and stays in memory
//! until the client has read it: a key whose clients read slowly, over many connections,
//! could hold gigabytes. Each answer of a known size holds its bytes of its key's budget
//! until its body is dropped (written out, or its connection closed); past the budget
//! the answer is refused with 429 (a result stays retrievable for a minute after it was
//! taken, so the SDKs' retry gets it).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Body as _, Frame, SizeHint};

use super::{ApiError, AppState, Owner};

/// Answer bytes each key's clients may have yet to read, by default.
pub const DEFAULT_MAX_ANSWER_BYTES: usize = 256 << 20;

/// Answer bytes held per key.
#[derive(Debug)]
pub struct AnswerBudget {
    max: usize,
    held: Mutex<HashMap<String, usize>>,
}

/// One answer's bytes of its key's budget, given back when dropped.
#[derive(Debug)]
pub struct Held {
    budget: Arc<AnswerBudget>,
    owner: String,
    bytes: usize,
}

impl AnswerBudget {
    /// A budget of `max` bytes per key.
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max,
            held: Mutex::default(),
        })
    }

    /// `bytes` of `owner`'s budget, or the 429 naming the limit. An answer larger than
    /// the whole budget passes when the key holds nothing else (it could never pass).
    pub fn take(self: &Arc<Self>, owner: &str, bytes: usize) -> Result<Held, ApiError> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let mine = held.get(owner).copied().unwrap_or(0);
        if mine > 0 && mine.saturating_add(bytes) > self.max {
            return Err(ApiError::limited(
                "max_answer_bytes",
                format!(
                    "this key's clients have {mine} bytes of answers still to read \
                     (--max-answer-bytes {}); read them, or retry later",
                    self.max
                ),
                1,
            ));
        }
        *held.entry(owner.to_string()).or_default() += bytes;
        Ok(Held {
            budget: self.clone(),
            owner: owner.to_string(),
            bytes,
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = self.budget.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = held.get_mut(&self.owner) {
            *n = n.saturating_sub(self.bytes);
            if *n == 0 {
                held.remove(&self.owner);
            }
        }
    }
}

/// Middleware: an answer of a known size holds its bytes of its key's budget until its
/// body is dropped; past the budget it is replaced by a 429.
pub async fn hold_answers(
    axum::extract::State(s): axum::extract::State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let owner = req.extensions().get::<Owner>().map(|o| o.0.clone());
    let resp = next.run(req).await;
    match owner {
        Some(owner) => hold(&s.answer_budget, &owner, resp),
        None => resp,
    }
}

/// `resp` holding its bytes of `owner`'s budget, or the 429 that replaces it.
fn hold(budget: &Arc<AnswerBudget>, owner: &str, resp: Response) -> Response {
    let Some(bytes) = resp.body().size_hint().exact() else {
        // Streamed answers are bounded where they are produced.
        return resp;
    };
    match budget.take(owner, bytes as usize) {
        Ok(held) => resp.map(|body| Body::new(HeldBody { body, _held: held })),
        Err(e) => e.into_response(),
    }
}

/// A body that holds its bytes of a budget until dropped.
struct HeldBody {
    body: Body,
    _held: Held,
}

impl http_body::Body for HeldBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(bytes: usize) -> Response {
        Body::from(vec![b'x'; bytes]).into_response()
    }

    /// A key's unread answers hold its budget until their bodies go; past it the next
    /// answer is a 429 naming the limit; another key is not affected; one answer larger
    /// than the whole budget still passes alone.
    #[tokio::test]
    async fn unread_answers_hold_their_keys_budget_until_dropped() {
        let budget = AnswerBudget::new(1500);
        let first = hold(&budget, "a", answer(1000));
        assert_eq!(first.status(), 200);
        let refused = hold(&budget, "a", answer(1000));
        assert_eq!(refused.status(), 429);
        let body = axum::body::to_bytes(refused.into_body(), 1 << 20)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["limit"], "max_answer_bytes", "{v}");
        assert_eq!(
            hold(&budget, "b", answer(1000)).status(),
            200,
            "another key"
        );
        // Reading the answer to its end and dropping it gives its bytes back.
        let read = axum::body::to_bytes(first.into_body(), 1 << 20)
            .await
            .unwrap();
        assert_eq!(read.len(), 1000);
        let again = hold(&budget, "a", answer(1000));
        assert_eq!(again.status(), 200);
        drop(again);
        assert_eq!(
            hold(&budget, "a", answer(5000)).status(),
            200,
            "alone, too large"
        );
        assert!(budget.held.lock().unwrap().is_empty());
    }
}
