//! Request extractors that fail the API's way (`{"error"}`, never axum's
//! plain-text rejections): the caller's account, JSON bodies, and the
//! fields of a JSON object body (each refusal a 400 naming the field).

use crate::error::{ApiError, ApiResult};
use crate::ControlPlane;
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};

use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use shoal_store::Account;
use std::collections::BTreeMap;
use std::sync::Arc;

/// JSON request bodies larger than this are refused with 413.
pub const MAX_JSON_BODY: usize = 1 << 20;

/// The account whose bearer token came with the request (or, on a fleet's
/// agent, the one the front named).
pub struct Caller(pub Account);

impl FromRequestParts<Arc<ControlPlane>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &Arc<ControlPlane>) -> ApiResult<Self> {
        let unauthorized =
            || ApiError::new(StatusCode::UNAUTHORIZED, "missing or invalid API token");
        if let Some(header) = state.config.account_header {
            let id = parts
                .headers
                .get(header)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<i64>().ok())
                .ok_or_else(unauthorized)?;
            return state
                .account_named_by_front(id)
                .await?
                .map(Caller)
                .ok_or_else(unauthorized);
        }
        let token = request_token(parts).ok_or_else(unauthorized)?;
        state
            .authenticate(&token)
            .await?
            .map(Caller)
            .ok_or_else(unauthorized)
    }
}

/// The token a request carries (`Authorization: Bearer`, `X-API-Key` or
/// `?access_token=`, as PandaStack's server reads them).
pub(crate) fn request_token(parts: &Parts) -> Option<String> {
    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
    shoal_store::request_token(
        header(header::AUTHORIZATION.as_str()),
        header("x-api-key"),
        parts.uri.query(),
    )
}

/// A JSON body; an empty body reads as `T::default()` (the SDK sends
/// bodiless POSTs without a content type).
pub struct Body<T>(pub T);

impl<T: DeserializeOwned + Default, S: Send + Sync> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> ApiResult<Self> {
        Body::read(req, MAX_JSON_BODY).await
    }
}

impl<T: DeserializeOwned + Default> Body<T> {
    async fn read(req: Request, limit: usize) -> ApiResult<Self> {
        let bytes = read_limited(req, limit).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Body(T::default()));
        }
        // serde_json skips the strings of fields nobody reads without
        // checking them: a body that is not UTF-8 is refused whole.
        std::str::from_utf8(&bytes)
            .map_err(|e| ApiError::bad_request(format!("the body is not UTF-8: {e}")))?;
        // A derived struct also reads from a JSON array (`[]` would be
        // every field's default): the API's bodies are objects.
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(ApiError::bad_request("the body must be a JSON object"));
        }
        serde_json::from_slice(&bytes)
            .map(Body)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
    }
}

/// A JSON object body of at most `limit` bytes; an empty body reads as an
/// empty object, anything else that is not an object is a 400.
pub async fn json_object(req: Request, limit: usize) -> ApiResult<Map<String, Value>> {
    let Body(body) = Body::<Value>::read(req, limit).await?;
    match body {
        Value::Null => Ok(Map::new()),
        Value::Object(map) => Ok(map),
        _ => Err(ApiError::bad_request("the body must be a JSON object")),
    }
}

/// The whole body, refused with 413 past `limit` bytes (by Content-Length
/// before reading when the client sent one).
pub async fn read_limited(req: Request, limit: usize) -> ApiResult<Bytes> {
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

// ---- fields of a JSON object body ----

/// A present, non-null field.
pub(crate) fn field<'a>(body: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    body.get(name).filter(|v| !v.is_null())
}

pub(crate) fn string(body: &Map<String, Value>, name: &str) -> ApiResult<Option<String>> {
    match field(body, name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::bad_request(format!("{name} must be a string"))),
    }
}

pub(crate) fn required_string(body: &Map<String, Value>, name: &str) -> ApiResult<String> {
    match string(body, name)? {
        Some(s) if !s.trim().is_empty() => Ok(s),
        _ => Err(ApiError::bad_request(format!(
            "{name} is required (a non-empty string)"
        ))),
    }
}

/// An integer field within `min..=max`.
pub(crate) fn integer(
    body: &Map<String, Value>,
    name: &str,
    min: u64,
    max: u64,
) -> ApiResult<Option<u64>> {
    match field(body, name) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if (min..=max).contains(&n) => Ok(Some(n)),
            _ => Err(ApiError::bad_request(format!(
                "{name} must be an integer from {min} to {max}"
            ))),
        },
    }
}

pub(crate) fn string_map(
    body: &Map<String, Value>,
    name: &str,
) -> ApiResult<BTreeMap<String, String>> {
    match field(body, name) {
        None => Ok(BTreeMap::new()),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(ApiError::bad_request(format!(
                    "{name}.{k} must be a string"
                ))),
            })
            .collect(),
        Some(_) => Err(ApiError::bad_request(format!(
            "{name} must be an object of strings"
        ))),
    }
}

/// Fuzzing the request bodies: any bytes, any JSON, into the extractors and
/// the body types' own checks never panic, and every refusal is a 4xx.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// Any JSON value, biased towards the numbers and strings that break
    /// conversions (huge, negative, fractional, NaN-like text).
    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            prop_oneof![
                Just(1e30),
                Just(-1e30),
                Just(1e308),
                Just(-0.0),
                Just(f64::MIN_POSITIVE),
                Just(1e-300)
            ]
            .prop_map(Value::from),
            prop_oneof![
                Just("NaN".to_string()),
                Just("inf".into()),
                Just("-1".into()),
                Just("true".into()),
                Just("".into()),
                ".{0,24}",
            ]
            .prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map(field_name(), inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// The body fields the API reads, and some it does not.
    fn field_name() -> impl Strategy<Value = String> {
        prop_oneof![
            prop::sample::select(vec![
                "cmd",
                "timeout_seconds",
                "timeout_ms",
                "env",
                "cwd",
                "code",
                "language",
                "name",
                "read_only",
                "size_mb",
                "ttl_seconds",
                "count",
                "port",
                "idle_seconds",
                "throttle",
                "retries",
                "cells",
                "start",
                "end",
                "step",
            ])
            .prop_map(str::to_string),
            "[a-z_]{1,12}",
        ]
    }

    fn request(body: Vec<u8>) -> Request {
        axum::http::Request::builder()
            .method("POST")
            .uri("/")
            .header(header::CONTENT_TYPE, "application/json")
            .body(axum::body::Body::from(body))
            .unwrap()
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    }

    fn assert_client_error(e: &ApiError) {
        assert!(e.status.is_client_error(), "{} {}", e.status, e.message);
        assert!(!e.message.is_empty());
    }

    /// Every body type checked as its route does, from bytes.
    async fn every_body(bytes: &[u8]) {
        use crate::{exec, repl};
        match Body::<exec::ExecBody>::from_request(request(bytes.to_vec()), &()).await {
            Ok(Body(body)) => {
                if let Err(e) = body.request() {
                    assert_client_error(&e);
                }
            }
            Err(e) => assert_client_error(&e),
        }
        match Body::<repl::RunBody>::from_request(request(bytes.to_vec()), &()).await {
            Ok(Body(body)) => {
                if let Err(e) = body.timeout() {
                    assert_client_error(&e);
                }
            }
            Err(e) => assert_client_error(&e),
        }
        if let Err(e) = Body::<repl::CreateBody>::from_request(request(bytes.to_vec()), &()).await {
            assert_client_error(&e);
        }
        match json_object(request(bytes.to_vec()), MAX_JSON_BODY).await {
            Ok(map) => {
                for name in ["port", "count", "throttle", "idle_seconds", "size_mb"] {
                    if let Err(e) = integer(&map, name, 1, 65535) {
                        assert_client_error(&e);
                    }
                }
                for name in ["cmd", "name", "template"] {
                    if let Err(e) = string(&map, name) {
                        assert_client_error(&e);
                    }
                }
                if let Err(e) = string_map(&map, "env") {
                    assert_client_error(&e);
                }
                if let Some(volumes) = map.get("volumes") {
                    // A shape serde refuses is the extractor's 400; one it
                    // takes goes through the route's own check.
                    if let Ok(refs) =
                        serde_json::from_value::<Vec<crate::volumes::VolumeRef>>(volumes.clone())
                    {
                        if let Err(e) = crate::volumes::requests(&refs) {
                            assert!(e.status.is_client_error(), "{}", e.message);
                        }
                    }
                }
            }
            Err(e) => assert_client_error(&e),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn any_json_body_is_accepted_or_a_4xx(value in json()) {
            runtime().block_on(every_body(value.to_string().as_bytes()));
        }

        #[test]
        fn any_object_body_is_accepted_or_a_4xx(
            fields in prop::collection::btree_map(field_name(), json(), 0..8),
        ) {
            let value = Value::Object(fields.into_iter().collect());
            runtime().block_on(every_body(value.to_string().as_bytes()));
        }

        /// With the required strings present, so the numbers are checked
        /// rather than the body refused for a missing `cmd` first.
        #[test]
        fn any_fields_beside_a_command_are_accepted_or_a_4xx(
            fields in prop::collection::btree_map(field_name(), json(), 0..6),
        ) {
            let mut map: Map<String, Value> = fields.into_iter().collect();
            map.insert("cmd".into(), Value::from("true"));
            map.insert("code".into(), Value::from("1"));
            runtime().block_on(every_body(Value::Object(map).to_string().as_bytes()));
        }

        #[test]
        fn any_bytes_are_accepted_or_a_4xx(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            runtime().block_on(every_body(&bytes));
        }
    }

    /// Every number field the routes here read, with each hostile number
    /// (deterministic, beside the random cases above).
    #[test]
    fn hostile_numbers_in_every_number_field_are_a_4xx_or_accepted() {
        let numbers = [
            Value::from(1e30),
            Value::from(-1e30),
            Value::from(1e308),
            Value::from(f64::MAX),
            Value::from(-1),
            Value::from(1e-300),
            Value::from(u64::MAX),
            Value::from(i64::MIN),
            Value::from("NaN"),
        ];
        let rt = runtime();
        for field in ["timeout_seconds", "timeout_ms", "port", "count", "size_mb"] {
            for n in &numbers {
                let body = serde_json::json!({"cmd": "true", "code": "1", field: n});
                rt.block_on(every_body(body.to_string().as_bytes()));
            }
        }
    }

    #[test]
    fn an_oversized_body_is_a_413() {
        let big = vec![b' '; MAX_JSON_BODY + 1];
        let err = runtime()
            .block_on(json_object(request(big), MAX_JSON_BODY))
            .unwrap_err();
        assert_eq!(err.status, StatusCode::PAYLOAD_TOO_LARGE);
    }
}
