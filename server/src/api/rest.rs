//! REST resources: training runs, checkpoints (list, delete, publish, TTL, archive),
//! sessions.

use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use lathe_sdk::types::{
    CheckpointUri, CheckpointsListResponse, SetTtlRequest, TrainingRun, TrainingRunsResponse,
};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{ApiError, ApiJson, AppState, Owner};
use crate::engine::{parse_checkpoint_id, Ttl};

/// How long an archive download link stays valid.
const ARCHIVE_LINK_LIFETIME: Duration = Duration::from_secs(3600);

#[derive(Deserialize)]
pub struct Page {
    #[serde(default)]
    offset: usize,
    limit: Option<usize>,
}

pub async fn list_runs(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    Query(p): Query<Page>,
) -> Result<Json<TrainingRunsResponse>, ApiError> {
    let limit = p.limit.unwrap_or(20);
    Ok(Json(s.engine.list_runs(owner.0, p.offset, limit).await?))
}

pub async fn get_run(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    Path(run): Path<String>,
) -> Result<Json<TrainingRun>, ApiError> {
    Ok(Json(s.engine.get_run(owner.0, run).await?))
}

pub async fn list_run_checkpoints(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    Path(run): Path<String>,
) -> Result<Json<CheckpointsListResponse>, ApiError> {
    Ok(Json(s.engine.list_run_checkpoints(owner.0, run).await?))
}

pub async fn list_user_checkpoints(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    Query(p): Query<Page>,
) -> Result<Json<CheckpointsListResponse>, ApiError> {
    let limit = p.limit.unwrap_or(100);
    Ok(Json(
        s.engine
            .list_user_checkpoints(owner.0, p.offset, limit)
            .await?,
    ))
}

fn uri(run: &str, kind: &str, name: &str) -> Result<CheckpointUri, ApiError> {
    Ok(parse_checkpoint_id(run, &format!("{kind}/{name}"))?)
}

pub async fn delete_checkpoint(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    Path((run, kind, name)): Path<(String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    let u = uri(&run, &kind, &name)?;
    s.engine.delete_checkpoint(owner.0, u).await?;
    Ok(Json(json!({})))
}

async fn set_public(
    s: AppState,
    owner: Owner,
    path: (String, String, String),
    public: bool,
) -> Result<Json<Value>, ApiError> {
    let u = uri(&path.0, &path.1, &path.2)?;
    s.engine.set_public(owner.0, u, public).await?;
    Ok(Json(json!({})))
}

pub async fn publish(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    Path(path): Path<(String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    set_public(s, owner, path, true).await
}

pub async fn unpublish(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    Path(path): Path<(String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    set_public(s, owner, path, false).await
}

pub async fn set_ttl(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    Path((run, kind, name)): Path<(String, String, String)>,
    ApiJson(req): ApiJson<SetTtlRequest>,
) -> Result<Json<Value>, ApiError> {
    let u = uri(&run, &kind, &name)?;
    let ttl = Ttl::from_wire(req.ttl_seconds)?;
    s.engine.set_ttl(owner.0, u, ttl).await?;
    Ok(Json(json!({})))
}

/// Answers as Tinker does: a 302 to a signed, expiring download link (the link needs no
/// API key, so any HTTP client can fetch it).
pub async fn archive_url(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    headers: HeaderMap,
    Path((run, kind, name)): Path<(String, String, String)>,
) -> Result<Response, ApiError> {
    let u = uri(&run, &kind, &name)?;
    s.engine
        .checkpoint_dir(owner.0.clone(), u.clone())
        .await??;
    let token = s
        .auth
        .archive_token(&owner.0, &u.to_string(), ARCHIVE_LINK_LIFETIME);
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1");
    let location = format!("http://{host}/api/v1/lathe/archive?token={token}");
    let expires = httpdate(std::time::SystemTime::now() + ARCHIVE_LINK_LIFETIME);
    Ok((
        StatusCode::FOUND,
        [(header::LOCATION, location), (header::EXPIRES, expires)],
    )
        .into_response())
}

fn httpdate(t: std::time::SystemTime) -> String {
    // "%a, %d %b %Y %H:%M:%S GMT", as the SDK parses it.
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = secs / 86_400;
    let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    let weekday = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"][(days % 7) as usize];
    let (y, mo, d) = civil_from_days(days as i64);
    let month = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ][mo as usize - 1];
    format!("{weekday}, {d:02} {month} {y} {h:02}:{m:02}:{s:02} GMT")
}

/// Days since 1970-01-01 to (year, month, day) (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[derive(Deserialize)]
pub struct ArchiveQuery {
    token: String,
}

/// The download link: a tar of the checkpoint directory, streamed from disk (at most
/// `ARCHIVE_STREAMS` at once, `ARCHIVE_STREAMS_PER_KEY` per key; past that, 429).
pub async fn download_archive(
    State(s): State<AppState>,
    Query(q): Query<ArchiveQuery>,
) -> Result<Response, ApiError> {
    let (owner, path) = s
        .auth
        .verify_archive_token(&q.token)
        .ok_or_else(|| ApiError::unauthorized("invalid or expired download link"))?;
    let u: CheckpointUri = path.parse().map_err(ApiError::bad_request)?;
    let (len, chunks) = s.engine.checkpoint_archive(owner, u).await?;
    let mut resp = (
        [
            (header::CONTENT_TYPE, "application/x-tar".to_string()),
            (
                header::CONTENT_DISPOSITION,
                "attachment; filename=\"checkpoint.tar\"".to_string(),
            ),
        ],
        axum::body::Body::from_stream(chunks),
    )
        .into_response();
    if let Some(len) = len {
        resp.headers_mut()
            .insert(header::CONTENT_LENGTH, len.into());
    }
    Ok(resp)
}

pub async fn list_sessions(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
) -> Result<Json<Value>, ApiError> {
    let ids = s.engine.list_sessions(owner.0).await?;
    Ok(Json(json!({ "sessions": ids })))
}

pub async fn get_session(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let (runs, samplers) = s.engine.get_session(owner.0, id).await??;
    Ok(Json(
        json!({"training_run_ids": runs, "sampler_ids": samplers}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_dates_match_the_imf_fixdate_format() {
        let t = std::time::UNIX_EPOCH + Duration::from_secs(1_795_000_000);
        // Checked with Python: datetime.utcfromtimestamp(1795000000).
        assert_eq!(httpdate(t), "Wed, 18 Nov 2026 11:06:40 GMT");
    }
}
