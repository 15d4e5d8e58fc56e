//! The `forward_backward` body in either encoding: JSON (tinker 0.22–0.24, MinT, the
//! Rust SDK's JSON mode) or protobuf (tinker 0.25 and later always; the Rust SDK by
//! default), the latter optionally zstd-compressed. Both decode into the same typed
//! request, which is then validated once.

use std::io::Read;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::header::{CONTENT_ENCODING, CONTENT_TYPE};
use axum::http::StatusCode;
use lathe_sdk::proto;
use lathe_sdk::types::ForwardBackwardRequest;
use serde::de::DeserializeOwned;

use super::{ApiError, AppState};

/// A decoded `forward_backward` submission.
pub struct ForwardBackwardBody {
    /// The typed request.
    pub request: ForwardBackwardRequest,
    /// `forward` sent as `forward_backward` (protobuf clients do this).
    pub forward_only: bool,
}

impl FromRequest<AppState> for ForwardBackwardBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let media = media_type(&req, CONTENT_TYPE);
        let json = match media.as_deref() {
            Some(proto::CONTENT_TYPE) => false,
            Some(m) if is_json(m) => true,
            // A clear 415 naming both encodings.
            _ => return Err(unsupported_media()),
        };
        let zstd = match media_type(&req, CONTENT_ENCODING).as_deref() {
            None | Some("identity") => false,
            Some("zstd") => true,
            Some(other) => {
                return Err(ApiError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                    format!("Content-Encoding {other} is not supported (use zstd or none)"),
                ))
            }
        };
        let (owner, body) = read(req, state).await?;
        let limit = state.max_request_bytes;
        let slot = state.cpu_slot(&owner).await?;
        // Decompressing and decoding tens of megabytes is CPU work: off the async threads,
        // a bounded number at once.
        let decoded = tokio::task::spawn_blocking(move || {
            let _slot = slot;
            let raw = if zstd {
                std::borrow::Cow::Owned(decompress(&body, limit)?)
            } else {
                std::borrow::Cow::Borrowed(&body[..])
            };
            if json {
                return serde_json::from_slice(&raw)
                    .map(|request| proto::ForwardBackwardProto {
                        request,
                        forward_only: false,
                    })
                    .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")));
            }
            proto::decode_forward_backward(&raw)
                .map_err(|e| ApiError::bad_request(format!("forward_backward: {e}")))
        })
        .await
        .map_err(|e| ApiError::internal(format!("decoding the body: {e}")))??;
        Ok(Self {
            request: decoded.request,
            forward_only: decoded.forward_only,
        })
    }
}

/// A JSON body decoded as `forward_backward`'s is: off the async threads, in one of its
/// key's CPU slots. For the requests whose bodies can be tens of megabytes (`forward`,
/// `sample`, MinT's reverse KL); small ones take [`ApiJson`](super::ApiJson).
pub struct LargeJson<T>(pub T);

impl<T: DeserializeOwned + Send + 'static> FromRequest<AppState> for LargeJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        if !media_type(&req, CONTENT_TYPE).is_some_and(|m| is_json(&m)) {
            return Err(ApiError::not_json());
        }
        let (owner, body) = read(req, state).await?;
        decode_json(state, &owner, body).await.map(LargeJson)
    }
}

/// Decodes a JSON body off the async threads, in one of `owner`'s CPU slots.
pub async fn decode_json<T: DeserializeOwned + Send + 'static>(
    state: &AppState,
    owner: &str,
    body: Bytes,
) -> Result<T, ApiError> {
    let slot = state.cpu_slot(owner).await?;
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
    })
    .await
    .map_err(|e| ApiError::internal(format!("decoding the body: {e}")))?
}

/// The request's key and its whole body (bounded by the server's body limit and pace).
async fn read(req: Request, state: &AppState) -> Result<(String, Bytes), ApiError> {
    let owner = req
        .extensions()
        .get::<super::auth::Owner>()
        .map(|o| o.0.clone())
        .unwrap_or_default();
    let body = Bytes::from_request(req, state)
        .await
        .map_err(|r| match r.status() {
            StatusCode::PAYLOAD_TOO_LARGE => ApiError::too_large(),
            _ => unreadable(&r),
        })?;
    Ok((owner, body))
}

/// A whole request body of at most `limit` bytes: 413 past it, 408 when it stalls
/// (`paced_body`), 400 when the connection fails. For middleware that must hold the
/// body before it takes anything shared ([`super::hold_store_slot`]).
pub(super) async fn buffered(body: axum::body::Body, limit: usize) -> Result<Bytes, ApiError> {
    use futures::StreamExt;
    use http_body::Body as _;
    // A declared length is checked before anything is read, and sizes the buffer.
    let declared = usize::try_from(body.size_hint().lower()).unwrap_or(usize::MAX);
    if declared > limit {
        return Err(ApiError::too_large());
    }
    let mut stream = body.into_data_stream();
    let mut whole = Vec::with_capacity(declared);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| unreadable(&e))?;
        if whole.len().saturating_add(chunk.len()) > limit {
            return Err(ApiError::too_large());
        }
        whole.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(whole))
}

/// A body that could not be read: 408 when it stalled (`paced_body`), else 400.
fn unreadable(e: &(dyn std::error::Error + 'static)) -> ApiError {
    ApiError::body_too_slow(e)
        .unwrap_or_else(|| ApiError::bad_request(format!("reading the body: {e}")))
}

/// `application/json`, or a `+json` type.
fn is_json(media: &str) -> bool {
    media == "application/json" || media.ends_with("+json")
}

/// A header's media type, lower-cased, without parameters.
fn media_type(req: &Request, header: axum::http::HeaderName) -> Option<String> {
    let value = req.headers().get(header)?.to_str().ok()?;
    Some(value.split(';').next()?.trim().to_ascii_lowercase())
}

fn unsupported_media() -> ApiError {
    ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
        "expected Content-Type: application/json or application/x-protobuf",
    )
}

/// Largest zstd window a body may declare (2^24 bytes): what the SDK's default level
/// uses is far below it, and the decoder allocates the declared window up front, so a
/// tiny frame declaring zstd's 2 GiB maximum must not be honoured.
const MAX_ZSTD_WINDOW_LOG: u32 = 24;

/// Inflates a zstd body, refusing one that inflates past `limit` bytes (the same limit
/// an uncompressed body has) or declares a window over 2^[`MAX_ZSTD_WINDOW_LOG`] bytes,
/// so a small compressed body cannot claim unbounded memory.
fn decompress(body: &[u8], limit: usize) -> Result<Vec<u8>, ApiError> {
    let zstd_error = |e: std::io::Error| ApiError::bad_request(format!("zstd body: {e}"));
    let mut decoder = zstd::stream::read::Decoder::new(body).map_err(zstd_error)?;
    decoder
        .window_log_max(MAX_ZSTD_WINDOW_LOG)
        .map_err(zstd_error)?;
    let mut out = Vec::new();
    decoder
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| ApiError::bad_request(format!("zstd body: {e}")))?;
    if out.len() > limit {
        return Err(ApiError::too_large());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decompression_is_bounded() {
        let zeros = vec![0u8; 1 << 20];
        let packed = zstd::encode_all(&zeros[..], 3).unwrap();
        assert!(packed.len() < 1024, "a megabyte of zeros packs small");
        assert_eq!(decompress(&packed, 1 << 20).unwrap(), zeros);
        let err = decompress(&packed, (1 << 20) - 1).unwrap_err();
        assert_eq!(err.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            decompress(b"not zstd", 1024).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }

    #[test]
    fn a_frame_declaring_a_huge_window_is_refused() {
        use std::io::Write;
        use zstd::zstd_safe::CParameter;
        let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
        // 2^26: within zstd's own default limit (2^27), so only ours refuses it.
        enc.set_parameter(CParameter::WindowLog(26)).unwrap();
        enc.include_contentsize(false).unwrap();
        enc.write_all(&vec![7u8; 1 << 16]).unwrap();
        let packed = enc.finish().unwrap();
        let err = decompress(&packed, 1 << 20).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST, "{err:?}");
        // The same bytes with the SDK's default window decode.
        let plain = zstd::encode_all(&vec![7u8; 1 << 16][..], 3).unwrap();
        assert_eq!(decompress(&plain, 1 << 20).unwrap().len(), 1 << 16);
    }
}
