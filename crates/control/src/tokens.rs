//! A user's own API tokens (`/v1/me/tokens`, the SDK's `tokens.*`): make one
//! (shown once, stored hashed), list them by prefix, revoke one. Any of the
//! account's tokens may manage the others (Shoal has no separate login);
//! an account holds at most [`MAX_TOKENS_PER_ACCOUNT`]. A revoked token is
//! refused by this process at once (its cache entry goes with it).

use crate::error::{ApiError, ApiResult};
use crate::extract::{self, Caller};
use crate::{now, rfc3339, ControlPlane};
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};
use shoal_store::{TokenInfo, TokenRefusal, MAX_TOKENS_PER_ACCOUNT, MAX_TOKEN_LABEL};
use std::sync::Arc;

type St = State<Arc<ControlPlane>>;

/// The longest life a token may be given.
pub const MAX_TOKEN_DAYS: u64 = 3650;

fn token_json(token: &TokenInfo) -> Value {
    json!({
        "prefix": token.prefix,
        "label": token.label,
        "name": token.label,
        "created_at": rfc3339(token.created_at),
        "expires_at": token.expires_at.map(rfc3339),
    })
}

pub async fn create(
    State(cp): St,
    Caller(account): Caller,
    request: Request,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let body = extract::json_object(request, extract::MAX_JSON_BODY).await?;
    let label = match extract::string(&body, "label")? {
        Some(label) => Some(label),
        None => extract::string(&body, "name")?,
    }
    .unwrap_or_default();
    if label.chars().count() > MAX_TOKEN_LABEL || label.chars().any(char::is_control) {
        return Err(ApiError::bad_request(format!(
            "label must be at most {MAX_TOKEN_LABEL} printable characters"
        )));
    }
    let days = extract::integer(&body, "expires_in_days", 1, MAX_TOKEN_DAYS)?;
    let expires_at = days.map(|d| now() + d as f64 * 86_400.0);
    match cp
        .store
        .create_account_token(account.id, &label, expires_at)
        .await?
    {
        Ok((token, info)) => {
            let mut answer = token_json(&info);
            answer["token"] = json!(token);
            Ok((StatusCode::OK, Json(answer)))
        }
        Err(_) => Err(ApiError::conflict(format!(
            "an account holds at most {MAX_TOKENS_PER_ACCOUNT} tokens: revoke one first"
        ))),
    }
}

pub async fn list(State(cp): St, Caller(account): Caller) -> ApiResult<Json<Value>> {
    let tokens = cp.store.account_tokens(account.id).await?;
    let items: Vec<Value> = tokens.iter().map(token_json).collect();
    Ok(Json(json!({ "items": items })))
}

pub async fn revoke(
    State(cp): St,
    Caller(account): Caller,
    Path(prefix): Path<String>,
) -> ApiResult<StatusCode> {
    match cp.store.revoke_account_token(account.id, &prefix).await? {
        Ok(hash) => {
            cp.forget_token(&hash);
            Ok(StatusCode::NO_CONTENT)
        }
        Err(TokenRefusal::Ambiguous) => Err(ApiError::conflict(format!(
            "more than one token starts with {prefix}"
        ))),
        Err(_) => Err(ApiError::not_found(format!("no token {prefix}"))),
    }
}
