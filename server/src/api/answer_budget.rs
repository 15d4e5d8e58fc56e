//! A per-key budget of answer bytes not yet taken by the key's clients.
//!
//! An answer built in memory (a retrieved result, a whole OpenAI completion with `echo`
//! and `logprobs`) leaves every engine budget once it is handed to its connection, and
//! stays in memory until the client has read it: a key whose clients read slowly, over
//! many connections, could hold gigabytes, and one finished result retrieved over many
//! connections at once would be encoded once per connection.
//!
//! Each answer of a known size holds its bytes of its key's budget until its body ends.
//! The body hands its bytes to the connection [`FRAME`] bytes at a time, and hyper asks
//! for the next frame only once its write buffer has room, so the body ends (and gives
//! its bytes back) when all but about a write buffer of it has gone to the socket.
//!
//! The budget is checked where an answer can be large, so that no work is lost to it:
//! - `retrieve_future` (which answers almost every large result) checks it before it
//!   takes a result from the table, reserves the result's estimated size before writing
//!   it, and takes its exact size once written: a result that would take a key holding
//!   anything past its budget is refused (429) and stays retrievable (the SDKs retry). A
//!   result larger than the whole budget passes when the key holds nothing else; it
//!   could never pass otherwise.
//! - a listing (runs, checkpoints, sessions: pages of up to 1000 rows) can be asked
//!   again, so it is refused before it runs while the key is at its budget, and after it
//!   ran when its answer would take the key past it, as a result is.
//! - the OpenAI completion endpoints are refused (429) before they run while the key is
//!   at its budget; their answers are the product of work already done, so they are held
//!   even past it: the excess is bounded by the key's requests in progress.
//! - every other answer is held without a check: they are small, and refusing them would
//!   shut a key out of its control calls (heartbeats, cancels, unloads) while a large
//!   answer of its own downloads.

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

/// Largest piece of an answer handed to the connection at once.
const FRAME: usize = 64 << 10;

/// Paths refused before they run while their key is at its budget (`retrieve_future`
/// checks for itself).
const ADMITTED: &[&str] = &["/v1/completions", "/v1/chat/completions"];

/// Whether `path` is a listing (pages of up to 1000 rows, each run with up to 16 KiB of
/// metadata): asked again after a refusal, so refused like a result.
fn is_listing(path: &str) -> bool {
    matches!(
        path,
        "/api/v1/training_runs" | "/api/v1/checkpoints" | "/api/v1/sessions"
    ) || (path.starts_with("/api/v1/training_runs/") && path.ends_with("/checkpoints"))
}

/// Marks an answer whose handler already holds its bytes.
#[derive(Debug, Clone, Copy)]
struct AnswerHeld;

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

    fn held_by(&self, owner: &str) -> usize {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.get(owner).copied().unwrap_or(0)
    }

    fn refusal(&self, mine: usize) -> ApiError {
        ApiError::limited(
            "max_answer_bytes",
            format!(
                "this key's clients have {mine} bytes of answers still to read \
                 (--max-answer-bytes {}); read them, or retry later",
                self.max
            ),
            1,
        )
    }

    /// Whether `owner` may start a request: the 429 when its answers already fill its
    /// budget.
    pub fn admit(&self, owner: &str) -> Result<(), ApiError> {
        let mine = self.held_by(owner);
        if mine >= self.max {
            return Err(self.refusal(mine));
        }
        Ok(())
    }

    /// `bytes` of `owner`'s budget. With `refusable`, the 429 instead when they would
    /// take a key that holds anything past its budget; otherwise held in any case.
    fn take(
        self: &Arc<Self>,
        owner: &str,
        bytes: usize,
        refusable: bool,
    ) -> Result<Held, ApiError> {
        self.change(owner, 0, bytes, refusable)?;
        Ok(Held {
            budget: self.clone(),
            owner: owner.to_string(),
            bytes,
        })
    }

    /// Turns `from` bytes that `owner` holds into `to`. With `refusable`, the 429
    /// instead when growing would take a key that holds anything else past its budget
    /// (an answer larger than the whole budget passes alone: it could never pass
    /// otherwise).
    fn change(&self, owner: &str, from: usize, to: usize, refusable: bool) -> Result<(), ApiError> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let mine = held.get(owner).copied().unwrap_or(0);
        let others = mine.saturating_sub(from);
        if refusable && to > from && others > 0 && others.saturating_add(to) > self.max {
            return Err(self.refusal(mine));
        }
        held.insert(owner.to_string(), others.saturating_add(to));
        Ok(())
    }

    /// `bytes` of `owner`'s budget for an answer about to be written that stays
    /// retrievable if refused; the 429 when they would take a key that holds anything
    /// past its budget.
    pub fn reserve(self: &Arc<Self>, owner: &str, bytes: usize) -> Result<Held, ApiError> {
        self.take(owner, bytes, true)
    }

    /// `resp`, the answer `held` was reserved for, holding its exact size instead of the
    /// estimate until its body ends; the 429 when its size past the estimate would take a
    /// key that holds anything else past its budget (a JSON answer is several times the
    /// estimate, which counts the values' bytes).
    pub fn hold_reserved(&self, resp: Response, mut held: Held) -> Result<Response, ApiError> {
        let Some(bytes) = exact_size(&resp) else {
            return Ok(resp);
        };
        self.change(&held.owner, held.bytes, bytes, true)?;
        held.bytes = bytes;
        let mut resp = holding(resp, held);
        resp.extensions_mut().insert(AnswerHeld);
        Ok(resp)
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

/// Middleware: listings and the OpenAI completions of a key at its budget are refused
/// before they run, and every answer of a known size that its handler does not hold
/// already holds its bytes of its key's budget until its body ends (a listing's is
/// refused instead when it would take the key past its budget).
pub async fn hold_answers(
    axum::extract::State(s): axum::extract::State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let Some(owner) = req.extensions().get::<Owner>().map(|o| o.0.clone()) else {
        return next.run(req).await;
    };
    let path = req.uri().path();
    let again = req.method() == axum::http::Method::GET && is_listing(path);
    if again || ADMITTED.contains(&path) {
        if let Err(e) = s.answer_budget.admit(&owner) {
            return e.into_response();
        }
    }
    let resp = next.run(req).await;
    if resp.extensions().get::<AnswerHeld>().is_some() {
        return resp;
    }
    hold(&s.answer_budget, &owner, resp, again)
}

/// `resp` holding its bytes of `owner`'s budget; with `refusable`, the 429 instead when
/// they would take a key that holds anything past its budget.
fn hold(budget: &Arc<AnswerBudget>, owner: &str, resp: Response, refusable: bool) -> Response {
    let Some(bytes) = exact_size(&resp) else {
        // Streamed answers are bounded where they are produced.
        return resp;
    };
    match budget.take(owner, bytes, refusable) {
        Ok(held) => holding(resp, held),
        Err(e) => e.into_response(),
    }
}

/// The size of `resp`'s body when it is known.
fn exact_size(resp: &Response) -> Option<usize> {
    let bytes = resp.body().size_hint().exact()?;
    Some(usize::try_from(bytes).unwrap_or(usize::MAX))
}

/// `resp` with its body handed out in pieces and holding `held` until it ends.
fn holding(resp: Response, held: Held) -> Response {
    resp.map(|body| {
        Body::new(HeldBody {
            body,
            rest: Bytes::new(),
            _held: held,
        })
    })
}

/// A body handed out at most [`FRAME`] bytes at a time, holding its bytes of a budget
/// until it is dropped (the connection drops it after its last frame).
struct HeldBody {
    body: Body,
    /// What is left of the inner body's current frame.
    rest: Bytes,
    _held: Held,
}

impl HeldBody {
    /// The next piece of `data`, keeping the rest for the next poll.
    fn piece(&mut self, mut data: Bytes) -> Frame<Bytes> {
        if data.len() > FRAME {
            self.rest = data.split_off(FRAME);
        }
        Frame::data(data)
    }
}

impl http_body::Body for HeldBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        if !this.rest.is_empty() {
            let rest = std::mem::take(&mut this.rest);
            return Poll::Ready(Some(Ok(this.piece(rest))));
        }
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => Poll::Ready(Some(Ok(this.piece(data)))),
                Err(other) => Poll::Ready(Some(Ok(other))),
            },
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.body.size_hint();
        let rest = self.rest.len() as u64;
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower().saturating_add(rest));
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(rest));
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(bytes: usize) -> Response {
        Body::from(vec![b'x'; bytes]).into_response()
    }

    fn held(budget: &AnswerBudget, owner: &str) -> usize {
        budget.held_by(owner)
    }

    /// A key's answers hold its budget until their bodies end; a key at its budget is
    /// not admitted; past it a retrievable answer is refused with a 429 naming the
    /// limit, another answer is held anyway; another key is not affected; one
    /// retrievable answer larger than the whole budget still passes alone.
    #[tokio::test]
    async fn answers_hold_their_keys_budget_until_their_bodies_end() {
        let budget = AnswerBudget::new(1500);
        let estimate = budget.reserve("a", 900).unwrap();
        assert_eq!(held(&budget, "a"), 900);
        let first = budget.hold_reserved(answer(1000), estimate).unwrap();
        assert_eq!(held(&budget, "a"), 1000, "the estimate becomes the size");
        assert!(first.extensions().get::<AnswerHeld>().is_some());
        assert!(budget.admit("a").is_ok(), "1000 of 1500 held");
        let refused = budget.reserve("a", 1000).unwrap_err().into_response();
        assert_eq!(refused.status(), 429);
        let body = axum::body::to_bytes(refused.into_body(), 1 << 20)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["limit"], "max_answer_bytes", "{v}");
        assert_eq!(
            hold(&budget, "a", answer(1000), true).status(),
            429,
            "a GET"
        );
        let done_work = hold(&budget, "a", answer(1000), false);
        assert_eq!(done_work.status(), 200, "work already done is held anyway");
        assert_eq!(held(&budget, "a"), 2000);
        let at_budget = budget.admit("a").unwrap_err().into_response();
        assert_eq!(at_budget.status(), 429);
        assert!(at_budget.headers().contains_key("retry-after"));
        // An estimate that passes, and an answer four times it that would not.
        let small = budget.reserve("b", 100).unwrap();
        let alone = budget.hold_reserved(answer(400), small).unwrap();
        let estimate = budget.reserve("b", 200).unwrap();
        assert_eq!(held(&budget, "b"), 600);
        let grown = budget.hold_reserved(answer(1200), estimate).unwrap_err();
        assert_eq!(grown.into_response().status(), 429);
        assert_eq!(
            held(&budget, "b"),
            400,
            "the refused reservation is given back"
        );
        drop(alone);
        // Reading an answer to its end and dropping it gives its bytes back.
        let read = axum::body::to_bytes(first.into_body(), 1 << 20)
            .await
            .unwrap();
        assert_eq!(read.len(), 1000);
        drop(done_work);
        assert_eq!(held(&budget, "a"), 0);
        let too_large = budget.reserve("a", 5000).unwrap();
        assert_eq!(held(&budget, "a"), 5000, "alone, too large");
        drop(too_large);
        assert!(budget.held.lock().unwrap().is_empty());
    }

    /// Listings are told from the other reads, which are never refused.
    #[test]
    fn listings_are_told_apart() {
        for listing in [
            "/api/v1/training_runs",
            "/api/v1/checkpoints",
            "/api/v1/sessions",
            "/api/v1/training_runs/s:train:0/checkpoints",
        ] {
            assert!(is_listing(listing), "{listing}");
        }
        for other in [
            "/api/v1/get_server_capabilities",
            "/api/v1/samplers/s:sample:0",
            "/api/v1/training_runs/s:train:0",
            "/api/v1/sessions/s",
            "/api/v1/lathe/tokenizer",
        ] {
            assert!(!is_listing(other), "{other}");
        }
    }

    /// A large answer goes out in pieces of at most [`FRAME`] bytes, announces its whole
    /// length, and holds its bytes until its last piece has been taken.
    #[tokio::test]
    async fn a_large_answer_goes_out_in_pieces_and_holds_its_bytes_until_the_last() {
        let budget = AnswerBudget::new(1 << 30);
        let len = 5 * FRAME + 123;
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let resp = hold(
            &budget,
            "a",
            Body::from(data.clone()).into_response(),
            false,
        );
        let mut body = resp.into_body();
        assert_eq!(body.size_hint().exact(), Some(len as u64));
        let mut got = Vec::new();
        let mut pieces = 0;
        while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
        {
            let piece = frame.unwrap().into_data().unwrap();
            assert!(piece.len() <= FRAME, "a piece of {}", piece.len());
            got.extend_from_slice(&piece);
            pieces += 1;
            if got.len() < len {
                assert_eq!(held(&budget, "a"), len, "held while pieces remain");
                assert_eq!(body.size_hint().exact(), Some((len - got.len()) as u64));
            }
        }
        assert_eq!(pieces, 6);
        assert_eq!(got, data);
        assert!(body.is_end_stream());
        drop(body);
        assert_eq!(held(&budget, "a"), 0);
    }
}
