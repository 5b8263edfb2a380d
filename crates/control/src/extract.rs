//! Request extractors that fail the API's way (`{"error"}`, never axum's
//! plain-text rejections): the caller's account, and JSON bodies.

use crate::error::{ApiError, ApiResult};
use crate::ControlPlane;
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};

use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use serde::de::DeserializeOwned;
use shoal_store::Account;
use std::sync::Arc;

/// JSON request bodies larger than this are refused with 413.
pub const MAX_JSON_BODY: usize = 1 << 20;

/// The account whose bearer token came with the request.
pub struct Caller(pub Account);

impl FromRequestParts<Arc<ControlPlane>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &Arc<ControlPlane>) -> ApiResult<Self> {
        let unauthorized =
            || ApiError::new(StatusCode::UNAUTHORIZED, "missing or invalid API token");
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(unauthorized)?;
        state
            .authenticate(token)
            .await?
            .map(Caller)
            .ok_or_else(unauthorized)
    }
}

/// A JSON body; an empty body reads as `T::default()` (the SDK sends
/// bodiless POSTs without a content type).
pub struct Body<T>(pub T);

impl<T: DeserializeOwned + Default, S: Send + Sync> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> ApiResult<Self> {
        let bytes = read_limited(req, state, MAX_JSON_BODY).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Body(T::default()));
        }
        serde_json::from_slice(&bytes)
            .map(Body)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
    }
}

/// The whole body, refused with 413 past `limit` bytes (by Content-Length
/// before reading when the client sent one).
pub async fn read_limited<S: Send + Sync>(
    req: Request,
    _state: &S,
    limit: usize,
) -> ApiResult<Bytes> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body exceeds {limit} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    axum::body::to_bytes(req.into_body(), limit)
        .await
        .map_err(|e| match declared {
            // Without a declared length, the limit is what stopped the read.
            None => too_large(),
            Some(_) => ApiError::bad_request(format!("reading the request body: {e}")),
        })
}
