//! The fleet: many hosts behind one API.
//!
//! A fleet is one PostgreSQL database, any number of stateless fronts
//! (`shoal server`, [`front`]) and one agent per host (`shoal agent`). An
//! agent is a host's engine with the control plane over it, exactly as in
//! `shoal up`, writing only its own rows (its `hosts` row through the
//! front's heartbeat route; sandboxes whose `host` is its name). The front
//! owns what needs the whole fleet in view: it authenticates, places
//! creates on hosts ([`shoal_placement`] over the heartbeats plus the
//! placements still in flight), routes every request about a sandbox to
//! the host that runs it, refuses what a gone host cannot answer, and marks
//! the sandboxes of hosts silent for [`STALE_AFTER`] `lost`.
//!
//! Owns: the front's routes and forwarding, the heartbeat protocol and
//! what a heartbeat reports ([`report`]).
//!
//! May not: touch VMs (agents do), shape sandbox JSON or decide quotas
//! (the agents' control planes do, on the shared database), or write SQL
//! (only through [`shoal_store::Store`]).

pub mod front;
pub mod limits;
pub mod report;
pub mod tls;

use std::time::Duration;

/// How often an agent reports.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(10);
/// A host silent for longer is stale: nothing is placed on it and its
/// sandboxes are `lost`.
pub const STALE_AFTER: Duration = Duration::from_secs(30);

/// The bearer check of the operators' fleet routes (`/v1/fleet/hosts`):
/// the fronts' own secret, `--fleet-token`, which no agent holds.
fn fleet_token_matches(headers: &axum::http::HeaderMap, token: &str) -> bool {
    same_secret(bearer(headers).unwrap_or(""), token)
}

/// The API token a tenant's request carries (`Authorization: Bearer`,
/// `X-API-Key` or `?access_token=`).
fn api_token(parts: &axum::http::request::Parts) -> Option<String> {
    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
    shoal_store::request_token(
        header(axum::http::header::AUTHORIZATION.as_str()),
        header("x-api-key"),
        parts.uri.query(),
    )
}

/// The bearer token of a request's `Authorization` header, if any.
fn bearer(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(shoal_store::bearer_token)
}

/// A refusal as the API words one: `{"error": message}`, with
/// `Retry-After` when the client should come back.
fn refuse(
    status: axum::http::StatusCode,
    message: &str,
    retry_after: Option<u32>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut response =
        (status, axum::Json(serde_json::json!({ "error": message }))).into_response();
    if let Some(seconds) = retry_after {
        response.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from(seconds),
        );
    }
    response
}

/// Length first, then every byte: no early exit on the first mismatch.
fn same_secret(given: &str, expected: &str) -> bool {
    given.len() == expected.len()
        && given
            .bytes()
            .zip(expected.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// The header a front proves itself with on every request to an agent.
pub const FRONT_KEY_HEADER: &str = "x-shoal-front-key";

/// The header in which a front names the account it authenticated when it
/// forwards a request to an agent; agents take the caller from it
/// (`ControlConfig::account_header`) and read no token. A client's own
/// header of this name is dropped by the front.
pub const ACCOUNT_HEADER: &str = "x-shoal-account";

/// The key fronts present to host `host_id`: HMAC-SHA256 of the id under
/// the fronts' secret. Each agent learns only its own, so a host that is
/// broken into cannot pass for a front to any other host.
pub fn front_key(fleet_token: &str, host_id: &str) -> String {
    host_key(fleet_token, "shoal front-to-host key", host_id)
}

/// The password of host `host_id`'s database role (see
/// `shoal_store::Store::ensure_host_role`): derived like [`front_key`], so
/// fronts need not store it and any front hands the same one out.
pub fn database_password(fleet_token: &str, host_id: &str) -> String {
    host_key(fleet_token, "shoal host database password", host_id)
}

/// HMAC-SHA256 of `purpose` and the host id under the fronts' secret, in hex.
fn host_key(fleet_token: &str, purpose: &str, host_id: &str) -> String {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(fleet_token.as_bytes())
        .expect("HMAC takes a key of any length");
    mac.update(purpose.as_bytes());
    mac.update(b"\0");
    mac.update(host_id.as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// Wraps an agent's API so that it answers only fronts: every route but
/// `/healthz` and `/readyz` needs [`FRONT_KEY_HEADER`] with this host's key (401
/// otherwise). Tenants reach sandboxes only through a front.
pub fn only_fronts(router: axum::Router, key: String) -> axum::Router {
    let key = std::sync::Arc::new(key);
    router.layer(axum::middleware::from_fn(
        move |request: axum::extract::Request, next: axum::middleware::Next| {
            let key = key.clone();
            async move {
                let given = request
                    .headers()
                    .get(FRONT_KEY_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                if matches!(request.uri().path(), "/healthz" | "/readyz")
                    || same_secret(given, &key)
                {
                    next.run(request).await
                } else {
                    refuse(
                        axum::http::StatusCode::UNAUTHORIZED,
                        "this is a fleet host: send requests to a front (shoal server)",
                        None,
                    )
                }
            }
        },
    ))
}

/// What an agent sends to join the fleet with a one-time join token.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct JoinRequest {
    /// The host id it will speak for.
    pub name: String,
    pub join_token: String,
}

/// What a front answers a join with.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Joined {
    /// The host's own credential: heartbeats and config reads carry it.
    pub host_secret: String,
    pub config: FleetConfig,
}

/// A host id: what `--name` may be (it is a row key and a log field).
pub fn valid_host_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// What a front tells an agent at registration.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct FleetConfig {
    /// The database the agents' control planes share with the fronts.
    pub database_url: String,
    /// The key fronts present to this host ([`front_key`]).
    pub front_key: String,
    pub heartbeat_interval_s: u64,
    pub stale_after_s: u64,
}
