//! `/v1/me/tokens` at the front. An agent's database role cannot read the
//! tokens table, so the front, which authenticates every request, answers
//! these itself. A revoked token leaves this front's cache at once; other
//! fronts refuse it when their cache entry expires (at most
//! `TOKEN_CACHE_TTL`).

use super::{database_error, Front, St};
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use shoal_store::{token_list_view, TokenRefusal, TokenRequest, MAX_TOKENS_PER_ACCOUNT};

/// A token request's body is a small JSON object.
const TOKEN_BODY_MAX: usize = 64 << 10;

pub(super) async fn create(State(front): St, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let account = match front.caller(&parts).await {
        Ok(account) => account,
        Err(response) => return response,
    };
    let body = match crate::limits::read_bounded(&parts.headers, body, TOKEN_BODY_MAX).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    let fields = if body.iter().all(u8::is_ascii_whitespace) {
        serde_json::Map::new()
    } else {
        match serde_json::from_slice::<Value>(&body) {
            Ok(Value::Object(map)) => map,
            Ok(Value::Null) => serde_json::Map::new(),
            _ => return bad_request("the body must be a JSON object"),
        }
    };
    let request = match TokenRequest::parse(&fields, crate::front::now()) {
        Ok(request) => request,
        Err(message) => return bad_request(&message),
    };
    match front
        .store
        .create_account_token(account.id, &request.label, request.expires_at)
        .await
    {
        Ok(Ok((token, info))) => {
            let mut answer = info.view();
            answer["token"] = json!(token);
            (StatusCode::OK, Json(answer)).into_response()
        }
        Ok(Err(_)) => crate::refuse(
            StatusCode::CONFLICT,
            &format!("an account holds at most {MAX_TOKENS_PER_ACCOUNT} tokens: revoke one first"),
            None,
        ),
        Err(e) => database_error(e),
    }
}

pub(super) async fn list(State(front): St, request: Request) -> Response {
    let (parts, _) = request.into_parts();
    let account = match front.caller(&parts).await {
        Ok(account) => account,
        Err(response) => return response,
    };
    match front.store.account_tokens(account.id).await {
        Ok(tokens) => Json(token_list_view(&tokens)).into_response(),
        Err(e) => database_error(e),
    }
}

pub(super) async fn revoke(
    State(front): St,
    Path(prefix): Path<String>,
    request: Request,
) -> Response {
    let (parts, _) = request.into_parts();
    let account = match front.caller(&parts).await {
        Ok(account) => account,
        Err(response) => return response,
    };
    match front.store.revoke_account_token(account.id, &prefix).await {
        Ok(Ok(hash)) => {
            forget(&front, &hash);
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(Err(TokenRefusal::Ambiguous)) => crate::refuse(
            StatusCode::CONFLICT,
            &format!("more than one token starts with {prefix}"),
            None,
        ),
        Ok(Err(_)) => crate::refuse(StatusCode::NOT_FOUND, &format!("no token {prefix}"), None),
        Err(e) => database_error(e),
    }
}

fn forget(front: &Front, hash: &str) {
    front.tokens.lock().unwrap().remove(hash);
}

fn bad_request(message: &str) -> Response {
    crate::refuse(StatusCode::BAD_REQUEST, message, None)
}
