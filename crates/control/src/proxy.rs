//! `/v1/sandboxes/{id}/proxy/{port}/{*path}`: HTTP forwarded to a service
//! listening on `port` inside the sandbox (for example `python3 -m
//! http.server`).
//!
//! The host has no route to a guest (every guest is 10.0.0.2 in a network
//! namespace of its own), so the connection is opened from inside the
//! sandbox's namespace by the engine (`Engine::connect`), and the request
//! goes over it as HTTP/1.1 with hop-by-hop headers and the caller's
//! `Authorization` dropped (the Shoal token never enters a sandbox).
//! Bodies stream both ways. Does not own: which ports listen (see
//! `meta::ports`) or upgrades (WebSocket) — not forwarded.

use crate::error::{ApiError, ApiResult};
use crate::extract::Caller;
use crate::ControlPlane;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderName, StatusCode, Uri};
use axum::response::Response;
use hyper_util::rt::TokioIo;
use std::sync::Arc;

type St = State<Arc<ControlPlane>>;

const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

pub async fn proxy_root(
    state: St,
    caller: Caller,
    Path((id, port)): Path<(String, String)>,
    request: Request,
) -> ApiResult<Response> {
    forward(state, caller, id, port, String::new(), request).await
}

pub async fn proxy_path(
    state: St,
    caller: Caller,
    Path((id, port, path)): Path<(String, String, String)>,
    request: Request,
) -> ApiResult<Response> {
    forward(state, caller, id, port, path, request).await
}

async fn forward(
    State(cp): St,
    Caller(account): Caller,
    id: String,
    port: String,
    path: String,
    request: Request,
) -> ApiResult<Response> {
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::bad_request(format!("invalid port: {port}")))?;
    cp.running(&account, &id).await?;
    to_guest(&cp, &id, port, &path, request).await
}

/// Sends `request` to `port` of running sandbox `id` as `/{path}` (with
/// the request's query string), and its answer back. Also the apps' proxy
/// (`apps.rs`), once it has a running sandbox.
pub(crate) async fn to_guest(
    cp: &ControlPlane,
    id: &str,
    port: u16,
    path: &str,
    request: Request,
) -> ApiResult<Response> {
    let stream = cp.host.engine().connect(id, port).await.map_err(|_| {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!("nothing answers on port {port} in sandbox {id}"),
        )
    })?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, format!("proxy: {e}")))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });

    let (mut parts, body) = request.into_parts();
    let target = match parts.uri.query() {
        Some(query) => format!("/{path}?{query}"),
        None => format!("/{path}"),
    };
    parts.uri = target
        .parse::<Uri>()
        .map_err(|_| ApiError::bad_request("invalid path"))?;
    parts.version = axum::http::Version::HTTP_11;
    for name in HOP_BY_HOP {
        parts.headers.remove(HeaderName::from_static(name));
    }
    parts.headers.remove(header::AUTHORIZATION);
    let host = format!("{}:{port}", shoal_host::GUEST_IP);
    parts.headers.insert(
        header::HOST,
        host.parse()
            .expect("an address and port are a valid header"),
    );
    let response = sender
        .send_request(axum::http::Request::from_parts(parts, body))
        .await
        .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, format!("proxy: {e}")))?;
    let (mut parts, body) = response.into_parts();
    for name in HOP_BY_HOP {
        parts.headers.remove(HeaderName::from_static(name));
    }
    Ok(Response::from_parts(parts, Body::new(body)))
}
