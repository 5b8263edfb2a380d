//! The sandbox filesystem: read and write whole files (streamed through the
//! guest agent), delete, list a directory, stat a path.

use crate::error::{ApiError, ApiResult};
use crate::extract::Caller;
use crate::ControlPlane;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use shoal_proto::FileStat;
use std::sync::Arc;

/// Uploads larger than this are refused with 413 (streamed to the guest,
/// never held whole).
pub const MAX_UPLOAD: u64 = 1 << 30;

type St = State<Arc<ControlPlane>>;

#[derive(Deserialize)]
struct PathQuery {
    path: Option<String>,
}

/// The absolute `path` of the query string (form-decoded, as requests sends it).
fn query_path(query: Option<String>) -> ApiResult<String> {
    let parsed: PathQuery = serde_urlencoded::from_str(query.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::bad_request(format!("bad query string: {e}")))?;
    match parsed.path {
        Some(p) if p.starts_with('/') => Ok(p),
        Some(p) => Err(ApiError::bad_request(format!(
            "path must be absolute: {p:?}"
        ))),
        None => Err(ApiError::bad_request(
            "the path query parameter is required",
        )),
    }
}

pub fn stat_json(stat: &FileStat) -> Value {
    json!({
        "name": stat.name,
        "path": stat.path,
        "is_dir": stat.is_dir,
        "size": stat.size,
        "mode": format!("{:04o}", stat.mode & 0o7777),
        "mtime": stat.mtime,
    })
}

pub async fn read(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let path = query_path(q)?;
    cp.running(&account, &id).await?;
    let agent = cp.host.engine().agent(&id).await?;
    let download = agent.read_file(&path).await?;
    let size = download.size();
    let chunks = futures::stream::unfold(download, |mut download| async move {
        match download.next_chunk().await {
            Ok(Some(chunk)) => Some((Ok(axum::body::Bytes::from(chunk)), download)),
            Ok(None) => None,
            Err(e) => Some((Err(std::io::Error::other(e.to_string())), download)),
        }
    });
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, size.to_string()),
        ],
        axum::body::Body::from_stream(chunks),
    )
        .into_response())
}

pub async fn write(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
    request: Request,
) -> ApiResult<Json<Value>> {
    use futures::TryStreamExt as _;
    use tokio::io::AsyncReadExt as _;
    let path = query_path(q)?;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("upload exceeds {MAX_UPLOAD} bytes"),
        )
    };
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_UPLOAD) {
        return Err(too_large());
    }
    cp.running(&account, &id).await?;
    let agent = cp.host.engine().agent(&id).await?;
    let body = request
        .into_body()
        .into_data_stream()
        .map_err(std::io::Error::other);
    // One byte past the limit tells an undeclared upload that is too large.
    let reader = tokio_util::io::StreamReader::new(body).take(MAX_UPLOAD + 1);
    let written = agent.write_file(&path, None, reader).await?;
    if written > MAX_UPLOAD {
        // Nothing half-written stays behind a refusal.
        let _ = agent.remove(&path, false).await;
        return Err(too_large());
    }
    Ok(Json(json!({ "path": path, "bytes": written })))
}

pub async fn remove(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<StatusCode> {
    let path = query_path(q)?;
    cp.running(&account, &id).await?;
    cp.host
        .engine()
        .agent(&id)
        .await?
        .remove(&path, true)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn list_dir(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<Value>> {
    let path = query_path(q.or_else(|| Some("path=/".into())))?;
    cp.running(&account, &id).await?;
    let entries = cp.host.engine().agent(&id).await?.list_dir(&path).await?;
    let entries: Vec<Value> = entries.iter().map(stat_json).collect();
    Ok(Json(json!({ "path": path, "entries": entries })))
}

pub async fn stat(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<Value>> {
    let path = query_path(q)?;
    cp.running(&account, &id).await?;
    let stat = cp.host.engine().agent(&id).await?.stat(&path).await?;
    Ok(Json(stat_json(&stat)))
}
