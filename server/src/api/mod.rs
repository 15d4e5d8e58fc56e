//! The HTTP layer: axum handlers speaking the Tinker protocol, one file per resource.
//! Handlers parse requests into checked types (`validate`), call the engine, and map
//! errors through one table (`error`).

mod answer_budget;
pub mod auth;
mod body;
mod custom_loss;
pub mod error;
mod futures;
pub mod listener;
mod mint;
pub mod openai;
pub mod paced_body;
mod reply;
mod rest;
mod sampling;
mod session;
mod training;
pub mod validate;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, FromRequest, Request};
use axum::routing::{get, post, put};
use axum::Router;

use crate::engine::{EngineHandle, KeyLimits, ModelInfo};
pub use answer_budget::{AnswerBudget, DEFAULT_MAX_ANSWER_BYTES};
pub use auth::{Auth, Owner};
pub use error::ApiError;

/// Shared state of every handler.
#[derive(Clone)]
pub struct AppState {
    /// The engine actor.
    pub engine: EngineHandle,
    /// Keys and JWTs.
    pub auth: Arc<Auth>,
    /// The served model.
    pub model: Arc<ModelInfo>,
    /// How long `retrieve_future` holds a pending request before `try_again`.
    pub poll_timeout: Duration,
    /// Per-key limits (those on one request's shape are checked here).
    pub limits: KeyLimits,
    /// Largest request body, after decompression too (413 beyond).
    pub max_request_bytes: usize,
    /// Advertise zstd-compressed `forward_backward` bodies to the SDK.
    pub zstd_forward_backward: bool,
    /// The slots bounding CPU-heavy request work (protobuf decoding, tokenizing,
    /// interpolation): one per core, one key holding at most all but one.
    pub cpu_slots: Arc<KeySlots>,
    /// The tokenizer and chat template, for the OpenAI-compatible endpoints.
    pub text: Arc<openai::TextModel>,
    /// Answer bytes each key's clients have yet to read.
    pub answer_budget: Arc<AnswerBudget>,
    /// The `lathe/tokenizer` answer, written on first use and shared.
    pub tokenizer_answer: Arc<std::sync::OnceLock<Result<axum::body::Bytes, String>>>,
    /// The slots bounding the index and checkpoint-directory work of listings,
    /// deletes, publishing and TTL changes ([`STORE_SLOTS`], [`STORE_SLOTS_PER_KEY`]).
    pub store_slots: Arc<KeySlots>,
}

/// Listings, deletes, publishing and TTL changes running at once, all keys together:
/// each runs on a blocking thread and takes the index's lock, some across file syncs
/// and removals that the worker's saves wait behind.
pub const STORE_SLOTS: usize = 16;

/// Of [`STORE_SLOTS`], most one key may hold (its other such requests wait).
pub const STORE_SLOTS_PER_KEY: usize = 2;

/// What [`hold_store_slot`] needs: the slots, and the largest body a store request takes.
#[derive(Clone)]
struct StoreGate {
    slots: Arc<KeySlots>,
    body_limit: usize,
}

/// Holds one of the key's store slots while a listing, delete, publish or TTL request
/// runs, to its end: the request runs in a task of its own holding the slot, so a
/// client that hangs up does not free the slot while the work it started goes on. The
/// (small) body is read between the key's place and the slot: a body still arriving
/// holds only its own key's place (so a key keeps at most its share of bodies in
/// memory), never one of the slots all keys share, which a few keys sending bodies
/// slowly would otherwise hold for as long as the body pace allows. This replaces
/// `DefaultBodyLimit` for these routes, with the same limit.
async fn hold_store_slot(
    axum::extract::State(gate): axum::extract::State<StoreGate>,
    req: Request,
    next: axum::middleware::Next,
) -> Result<axum::response::Response, ApiError> {
    let owner = req
        .extensions()
        .get::<Owner>()
        .map(|o| o.0.clone())
        .ok_or_else(|| ApiError::internal("no key on an authenticated request"))?;
    let share = gate.slots.key_share(&owner).await?;
    let (parts, body) = req.into_parts();
    let body = body::buffered(body, gate.body_limit).await?;
    let req = Request::from_parts(parts, axum::body::Body::from(body));
    let slot = gate.slots.with_key_share(share).await?;
    tokio::spawn(async move {
        let _slot = slot;
        next.run(req).await
    })
    .await
    .map_err(|e| ApiError::internal(format!("the request's task failed: {e}")))
}

impl AppState {
    /// One of the per-core slots that bound CPU-heavy request work (body decoding,
    /// tokenizing, interpolation) for `owner`'s request; held until dropped.
    pub async fn cpu_slot(&self, owner: &str) -> Result<KeySlot, ApiError> {
        self.cpu_slots.acquire(owner).await
    }
}

/// Slots bounding a kind of request work, in all and per API key, so that one key
/// sending many such requests at once cannot make every other key's wait behind them.
/// The CPU slots (one per core, a key holding at most all but one) bound CPU-heavy work,
/// each holding its request's decoded data, so many at once must not add up; the store
/// slots bound work on the index and the checkpoint directory.
#[derive(Debug)]
pub struct KeySlots {
    all: Arc<tokio::sync::Semaphore>,
    per_key: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Semaphore>>>,
    per_key_max: usize,
}

/// A held [`KeySlots`] slot.
#[derive(Debug)]
pub struct KeySlot {
    _key: tokio::sync::OwnedSemaphorePermit,
    _all: tokio::sync::OwnedSemaphorePermit,
}

impl KeySlots {
    /// `n` slots (at least one); a key may hold `n - 1` of them (one, if `n` is 1).
    pub fn new(n: usize) -> Self {
        let n = n.max(1);
        Self::with_per_key(n, n - 1)
    }

    /// `n` slots (at least one); a key may hold `per_key` of them (at least one).
    pub fn with_per_key(n: usize, per_key: usize) -> Self {
        Self {
            all: Arc::new(tokio::sync::Semaphore::new(n.max(1))),
            per_key: Default::default(),
            per_key_max: per_key.clamp(1, n.max(1)),
        }
    }

    async fn acquire(&self, owner: &str) -> Result<KeySlot, ApiError> {
        let key = self.key_share(owner).await?;
        self.with_key_share(key).await
    }

    /// One of `owner`'s own places, without a slot yet: what a request holds while it
    /// reads its body, so that slow bodies wait on their own key's share alone.
    async fn key_share(&self, owner: &str) -> Result<KeyShare, ApiError> {
        let key = {
            let mut map = self.per_key.lock().unwrap_or_else(|e| e.into_inner());
            map.entry(owner.to_string())
                .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(self.per_key_max)))
                .clone()
        };
        let key = key.acquire_owned().await.map_err(shutting_down)?;
        Ok(KeyShare(key))
    }

    /// The slot of a key's place taken with [`KeySlots::key_share`].
    async fn with_key_share(&self, key: KeyShare) -> Result<KeySlot, ApiError> {
        let all = self
            .all
            .clone()
            .acquire_owned()
            .await
            .map_err(shutting_down)?;
        Ok(KeySlot {
            _key: key.0,
            _all: all,
        })
    }
}

/// One of a key's places in a [`KeySlots`], held before its slot.
struct KeyShare(tokio::sync::OwnedSemaphorePermit);

fn shutting_down(_: tokio::sync::AcquireError) -> ApiError {
    ApiError::internal("the server is shutting down")
}

/// Default request body limit of the requests that carry tokens (`forward_backward`,
/// `forward`, `asample`, MinT's reverse KL; the OpenAI completions at most
/// [`OPENAI_BODY_BYTES`]).
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 32 * 1024 * 1024;

/// Body limit of the OpenAI completions: their sampling settings are a flattened struct,
/// for which serde buffers every field it does not know as a value tree, and a prompt
/// longer than the model's context is refused anyway.
pub const OPENAI_BODY_BYTES: usize = 4 << 20;

/// Body limit of every other request (session, run and checkpoint control, listings):
/// they are a few KB, and are decoded on the async threads every request shares, some
/// with free-form JSON (`create_session`'s `user_metadata`) that serde holds as a tree
/// of 32-byte nodes.
pub const CONTROL_BODY_BYTES: usize = 1 << 20;

/// The body limit of the control requests ([`CONTROL_BODY_BYTES`], within the server's
/// `--max-request-bytes`).
fn control_body_limit(max_request_bytes: usize) -> usize {
    CONTROL_BODY_BYTES.min(max_request_bytes)
}

/// A JSON body whose rejections become [`ApiError`]s (JSON, 4xx).
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    axum::Json<T>: FromRequest<S, Rejection = axum::extract::rejection::JsonRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let axum::Json(v) = axum::Json::<T>::from_request(req, state).await?;
        Ok(ApiJson(v))
    }
}

/// Gives every error answer a JSON body: Tinker's shape (`detail`, `code`), or OpenAI's
/// under `/v1/`. Lathe's handlers answer in JSON already; this catches what axum's
/// extractors reject before a handler runs (a malformed query string or path segment,
/// an oversized body), which axum answers in plain text.
async fn json_errors(req: Request, next: axum::middleware::Next) -> axum::response::Response {
    use axum::response::IntoResponse;
    let openai = req.uri().path().starts_with("/v1/");
    let resp = next.run(req).await;
    let status = resp.status();
    let json = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || json {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    // Rejection texts are short: only the first KiB is read.
    let mut text = Vec::new();
    let mut stream = body.into_data_stream();
    while let Some(Ok(chunk)) = ::futures::StreamExt::next(&mut stream).await {
        text.extend_from_slice(&chunk[..chunk.len().min(1024 - text.len())]);
        if text.len() >= 1024 {
            break;
        }
    }
    let e = ApiError::from_plain(status, &String::from_utf8_lossy(&text));
    let fresh = if openai {
        openai::OpenAiError(e).into_response()
    } else {
        e.into_response()
    };
    // The original headers (such as a 405's `Allow`) stay; the body and its type change.
    let (new_parts, new_body) = fresh.into_parts();
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    parts.headers.extend(new_parts.headers);
    axum::response::Response::from_parts(parts, new_body)
}

/// 404 for paths the server does not serve, logged so that an operator sees which calls
/// a client makes that Lathe lacks; in OpenAI's shape under `/v1/`.
async fn no_such_endpoint(
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    tracing::warn!(%method, path = uri.path(), "no such endpoint");
    let e = ApiError::not_found(format!("no such endpoint: {method} {}", uri.path()));
    if uri.path().starts_with("/v1/") {
        openai::OpenAiError(e).into_response()
    } else {
        e.into_response()
    }
}

/// The whole API.
pub fn router(state: AppState) -> Router {
    let max_request_bytes = state.max_request_bytes;
    // Only the requests that carry tokens take bodies up to --max-request-bytes; the
    // rest are control calls of a few KB, decoded on the async threads.
    let large_bodies = DefaultBodyLimit::max(max_request_bytes);
    let openai_bodies = DefaultBodyLimit::max(OPENAI_BODY_BYTES.min(max_request_bytes));
    // The requests whose work is the index's and the checkpoint directory's.
    let store_routes = Router::new()
        .route("/api/v1/training_runs", get(rest::list_runs))
        .route("/api/v1/training_runs/{run}", get(rest::get_run))
        .route(
            "/api/v1/training_runs/{run}/checkpoints",
            get(rest::list_run_checkpoints),
        )
        .route(
            "/api/v1/training_runs/{run}/checkpoints/{kind}/{name}",
            axum::routing::delete(rest::delete_checkpoint),
        )
        .route(
            "/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/publish",
            post(rest::publish).delete(rest::unpublish),
        )
        .route(
            "/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/ttl",
            put(rest::set_ttl),
        )
        .route(
            "/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/archive",
            get(rest::archive_url),
        )
        .route("/api/v1/checkpoints", get(rest::list_user_checkpoints))
        .route("/api/v1/sessions", get(rest::list_sessions))
        .route("/api/v1/sessions/{id}", get(rest::get_session));
    let store_routes = store_routes.route_layer(axum::middleware::from_fn_with_state(
        StoreGate {
            slots: state.store_slots.clone(),
            body_limit: control_body_limit(state.max_request_bytes),
        },
        hold_store_slot,
    ));
    let protected = Router::new()
        .route("/api/v1/client/config", post(session::client_config))
        .route(
            "/api/v1/client/dynamic_config",
            post(session::dynamic_config),
        )
        .route("/api/v1/auth/token", post(session::auth_token))
        .route("/api/v1/create_session", post(session::create_session))
        .route("/api/v1/session_heartbeat", post(session::heartbeat))
        .route("/api/v1/telemetry", post(session::telemetry))
        .route(
            "/api/v1/get_server_capabilities",
            get(session::capabilities),
        )
        .route("/api/v1/lathe/tokenizer", get(session::tokenizer))
        .route("/api/v1/create_model", post(training::create_model))
        .route("/api/v1/get_info", post(training::get_info))
        .route(
            "/api/v1/forward",
            post(training::forward).layer(large_bodies),
        )
        .route(
            "/api/v1/forward_backward",
            post(training::forward_backward).layer(large_bodies),
        )
        .route(
            "/api/v1/create_custom_loss",
            post(custom_loss::create_custom_loss).layer(DefaultBodyLimit::max(
                custom_loss::MAX_BODY_BYTES.min(max_request_bytes),
            )),
        )
        .route("/api/v1/optim_step", post(training::optim_step))
        .route("/api/v1/save_weights", post(training::save_weights))
        .route("/api/v1/load_weights", post(training::load_weights))
        .route(
            "/api/v1/save_weights_for_sampler",
            post(training::save_weights_for_sampler),
        )
        .route("/api/v1/unload_model", post(training::unload_model))
        .route("/api/v1/weights_info", post(training::weights_info))
        .route(
            "/api/v1/create_sampling_session",
            post(sampling::create_sampling_session),
        )
        .route(
            "/api/v1/asample",
            post(sampling::asample).layer(large_bodies),
        )
        .route("/api/v1/samplers/{id}", get(sampling::get_sampler))
        .route("/api/v1/retrieve_future", post(futures::retrieve_future))
        .route("/api/v1/retrieve_futures", post(sampling::retrieve_futures))
        .route(
            "/api/v1/join_sampling_session",
            post(sampling::join_sampling_session),
        )
        .route("/api/v1/cancel_future", post(futures::cancel_future))
        .merge(store_routes)
        .route(
            "/api/v1/sessions/{id}/finish",
            post(session::finish_session),
        )
        .route(
            "/api/v1/mint/checkpoints/interpolate",
            post(mint::interpolate),
        )
        .route(
            "/api/v1/mint/forward_backward_reverse_kl",
            post(mint::forward_backward_reverse_kl).layer(large_bodies),
        )
        .route(
            "/v1/completions",
            post(openai::completions).layer(openai_bodies),
        )
        .route(
            "/v1/chat/completions",
            post(openai::chat_completions).layer(openai_bodies),
        )
        .route("/v1/models", get(openai::models))
        // Inside the key check, which names the owner.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            answer_budget::hold_answers,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_auth,
        ));
    Router::new()
        .route("/api/v1/healthz", get(session::healthz))
        .route("/api/v1/lathe/archive", get(rest::download_archive))
        .merge(protected)
        .fallback(no_such_endpoint)
        .layer(DefaultBodyLimit::max(control_body_limit(max_request_bytes)))
        .layer(axum::middleware::from_fn(json_errors))
        .with_state(state)
}

#[cfg(test)]
mod store_gate_tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::AsyncWriteExt;

    const WAIT: Duration = Duration::from_secs(10);

    /// A server of two routes behind the store gate (bodies up to 1 KiB): `/held`
    /// counts itself in `entered`, then answers once it gets one of `release`'s permits
    /// (a permit, unlike a notification, also waits for a handler that starts late);
    /// `/quick` answers at once (a PUT once it has read its body, as the store's
    /// handlers do). The key is the `x-key` header. Returns the server's address.
    async fn gated(
        slots: KeySlots,
        release: Arc<tokio::sync::Semaphore>,
        entered: Arc<AtomicUsize>,
    ) -> String {
        let gate = StoreGate {
            slots: Arc::new(slots),
            body_limit: 1024,
        };
        let app = Router::new()
            .route(
                "/held",
                get(move || async move {
                    entered.fetch_add(1, Ordering::SeqCst);
                    release.acquire().await.unwrap().forget();
                    "done"
                }),
            )
            .route(
                "/quick",
                get(|| async { "ok" }).put(|_body: axum::body::Bytes| async { "ok" }),
            )
            .route_layer(axum::middleware::from_fn_with_state(gate, hold_store_slot))
            .layer(axum::middleware::map_request(
                |mut req: Request| async move {
                    let key = req
                        .headers()
                        .get("x-key")
                        .map(|v| v.to_str().unwrap().to_string());
                    req.extensions_mut().insert(Owner(key.unwrap_or_default()));
                    req
                },
            ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr.to_string()
    }

    fn client() -> reqwest::Client {
        reqwest::Client::builder().no_proxy().build().unwrap()
    }

    /// `GET http://{addr}{path}` as `key`: the answer's text.
    async fn get_as(addr: String, path: &'static str, key: &'static str) -> String {
        let resp = client()
            .get(format!("http://{addr}{path}"))
            .header("x-key", key)
            .send()
            .await
            .unwrap();
        resp.text().await.unwrap()
    }

    /// A request whose body (of `len` bytes, declared) has only begun to arrive.
    async fn slow_put(addr: &str, key: &str, len: usize) -> tokio::net::TcpStream {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "PUT /quick HTTP/1.1\r\nHost: t\r\nx-key: {key}\r\nContent-Length: {len}\r\n\r\n{{"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s
    }

    /// A key's requests past its share wait while they run, another key's do not, and
    /// the waiting one goes on as soon as one of the key's ends.
    #[tokio::test]
    async fn a_keys_requests_past_its_share_wait_for_one_to_end() {
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let entered = Arc::new(AtomicUsize::new(0));
        let addr = gated(
            KeySlots::with_per_key(4, 2),
            release.clone(),
            entered.clone(),
        )
        .await;
        let held: Vec<_> = (0..2)
            .map(|_| tokio::spawn(get_as(addr.clone(), "/held", "a")))
            .collect();
        tokio::time::timeout(WAIT, async {
            while entered.load(Ordering::SeqCst) < 2 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("both held requests run");
        let waiting = tokio::spawn(get_as(addr.clone(), "/quick", "a"));
        let other = tokio::time::timeout(WAIT, get_as(addr.clone(), "/quick", "b")).await;
        assert_eq!(other.expect("another key is not kept waiting"), "ok");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !waiting.is_finished(),
            "a third request of key a ran past its two slots"
        );
        release.add_permits(2);
        for h in held {
            let done = tokio::time::timeout(WAIT, h).await.expect("released");
            assert_eq!(done.unwrap(), "done");
        }
        let answered = tokio::time::timeout(WAIT, waiting).await;
        assert_eq!(
            answered.expect("answered once a slot is free").unwrap(),
            "ok"
        );
    }

    /// Bodies still arriving hold only their own key's places: with two slots, keys a
    /// and b each sending a body slowly leave both slots free for key c (before, they
    /// held both), while a's next request waits behind its own slow body (a key keeps
    /// at most its share of bodies in memory). A body declared past the limit is
    /// refused with 413 before it is read.
    #[tokio::test]
    async fn bodies_still_arriving_hold_no_shared_slot() {
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let addr = gated(KeySlots::with_per_key(2, 1), release, Arc::default()).await;
        let slow = [
            slow_put(&addr, "a", 10).await,
            slow_put(&addr, "b", 10).await,
        ];
        tokio::time::sleep(Duration::from_millis(200)).await;
        let c = tokio::time::timeout(WAIT, get_as(addr.clone(), "/quick", "c")).await;
        assert_eq!(
            c.expect("key c waited behind other keys' slow bodies"),
            "ok"
        );
        let a = tokio::spawn(get_as(addr.clone(), "/quick", "a"));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !a.is_finished(),
            "key a ran past its one place, held by its slow body"
        );
        let big = client()
            .put(format!("http://{addr}/quick"))
            .header("x-key", "c")
            .body(vec![b' '; 2048])
            .send();
        let big = tokio::time::timeout(WAIT, big)
            .await
            .expect("answered")
            .unwrap();
        assert_eq!(big.status(), reqwest::StatusCode::PAYLOAD_TOO_LARGE);
        drop(slow);
        let a = tokio::time::timeout(WAIT, a).await;
        assert_eq!(
            a.expect("a goes on once its slow body is gone").unwrap(),
            "ok"
        );
    }
}

#[cfg(test)]
mod cpu_slot_tests {
    use super::*;

    /// With two slots, a key holding one waits for its second, while another key gets
    /// the other at once.
    #[tokio::test]
    async fn one_key_cannot_take_every_slot() {
        let slots = KeySlots::new(2);
        let _a1 = slots.acquire("a").await.unwrap();
        let second = tokio::time::timeout(Duration::from_millis(50), slots.acquire("a")).await;
        assert!(second.is_err(), "a second slot for the same key waits");
        let b = tokio::time::timeout(Duration::from_millis(50), slots.acquire("b")).await;
        assert!(b.is_ok(), "another key is not kept waiting");
    }

    /// The store's slots: a key holds at most its share, the server at most all.
    #[tokio::test]
    async fn a_key_holds_at_most_its_store_slots() {
        let slots = KeySlots::with_per_key(3, STORE_SLOTS_PER_KEY);
        let wait = Duration::from_millis(50);
        let mut held = Vec::new();
        for _ in 0..STORE_SLOTS_PER_KEY {
            held.push(slots.acquire("a").await.unwrap());
        }
        assert!(
            tokio::time::timeout(wait, slots.acquire("a"))
                .await
                .is_err(),
            "a's next waits"
        );
        held.push(slots.acquire("b").await.unwrap());
        assert!(
            tokio::time::timeout(wait, slots.acquire("c"))
                .await
                .is_err(),
            "all three are held"
        );
        held.remove(0);
        assert!(tokio::time::timeout(wait, slots.acquire("c")).await.is_ok());
    }
}
