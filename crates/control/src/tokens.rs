//! A user's own API tokens (`/v1/me/tokens`, the SDK's `tokens.*`): make one
//! (shown once, stored hashed), list them by prefix, revoke one. Any of the
//! account's tokens may manage the others (Shoal has no separate login);
//! an account holds at most [`MAX_TOKENS_PER_ACCOUNT`]. A revoked token is
//! refused by this process at once (its cache entry goes with it).

use crate::error::{ApiError, ApiResult};
use crate::extract::{self, Caller};
use crate::{now, ControlPlane};
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};
use shoal_store::{token_list_view, TokenRefusal, TokenRequest, MAX_TOKENS_PER_ACCOUNT};
use std::sync::Arc;

type St = State<Arc<ControlPlane>>;

pub async fn create(
    State(cp): St,
    Caller(account): Caller,
    request: Request,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let body = extract::json_object(request, extract::MAX_JSON_BODY).await?;
    let request = TokenRequest::parse(&body, now()).map_err(ApiError::bad_request)?;
    match cp
        .store
        .create_account_token(account.id, &request.label, request.expires_at)
        .await?
    {
        Ok((token, info)) => {
            let mut answer = info.view();
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
    Ok(Json(token_list_view(&tokens)))
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
