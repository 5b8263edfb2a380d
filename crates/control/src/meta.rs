//! Routes about the account and the service rather than one sandbox's
//! guest: health, the OpenAPI document, `/v1/me`, templates, snapshots;
//! and a sandbox's console log and listening ports.

use crate::error::ApiResult;
use crate::extract::Caller;
use crate::{rfc3339, ControlPlane, OPENAPI};
use axum::extract::{Path, RawQuery, State};
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};
use shoal_proto::client::ExecRequest;
use std::sync::Arc;

type St = State<Arc<ControlPlane>>;

pub async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

pub async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI)
}

pub async fn me(State(cp): St, Caller(account): Caller) -> Json<Value> {
    let limits = cp.limits(account.tier);
    let volumes = cp.volume_limits(account.tier);
    Json(json!({
        "account": account.name,
        "user_id": account.name,
        "tier": account.tier.as_str(),
        "auth_method": "token",
        "limits": {
            "max_concurrent_sandboxes": limits.concurrent,
            "max_creates_per_hour": limits.creates_per_hour,
            "max_volumes": volumes.count,
            "max_volume_size_mb": volumes.size_mb,
            "max_volume_total_mb": volumes.total_mb,
        },
    }))
}

pub async fn templates(State(cp): St, Caller(_): Caller) -> Json<Value> {
    let items: Vec<Value> = shoal_image::first_party_templates()
        .into_iter()
        .filter(|spec| cp.host.engine().template(&spec.name).is_ok())
        .map(|spec| {
            json!({
                "name": spec.name,
                "cpu": spec.vcpus,
                "memory_mb": spec.memory_mib,
                "is_global": true,
                "base": "debian-bookworm",
                "description": format!("Debian bookworm with {}", spec.packages.join(", ")),
            })
        })
        .collect();
    Json(json!({ "items": items }))
}

pub async fn snapshots(
    State(cp): St,
    Caller(account): Caller,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<Value>> {
    let filter: std::collections::HashMap<String, String> =
        serde_urlencoded::from_str(q.as_deref().unwrap_or("")).unwrap_or_default();
    let mut rows = cp.store.list_snapshots(account.id).await?;
    rows.sort_by(|a, b| b.created_at.total_cmp(&a.created_at));
    let items: Vec<Value> = rows
        .iter()
        .filter(|r| {
            filter
                .get("sandbox_id")
                .is_none_or(|s| r.sandbox_id.as_ref() == Some(s))
        })
        .map(|r| {
            json!({
                "id": r.id,
                "sandbox_id": r.sandbox_id,
                "template": r.template,
                "size_bytes": r.size_bytes,
                "created_at": rfc3339(r.created_at),
            })
        })
        .collect();
    Ok(Json(json!({ "snapshots": items })))
}

/// The guest console so far (kernel and guest agent output).
pub async fn logs(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<impl IntoResponse> {
    cp.owned(&account, &id).await?;
    let path = cp.host.engine().console_log(&id)?;
    let text = tokio::fs::read(&path).await.unwrap_or_default();
    Ok((
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        String::from_utf8_lossy(&text).into_owned(),
    ))
}

/// TCP ports listening in the guest, read from /proc/net/tcp{,6}.
pub async fn ports(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    cp.running(&account, &id).await?;
    let agent = cp.host.engine().agent(&id).await?;
    let out = agent
        .exec_collect(ExecRequest::new(
            "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null",
        ))
        .await?;
    let ports: Vec<Value> = listening_ports(&String::from_utf8_lossy(&out.stdout))
        .into_iter()
        .map(|port| json!({ "port": port, "protocol": "tcp", "listening": true }))
        .collect();
    Ok(Json(json!({ "ports": ports })))
}

pub(crate) fn listening_ports(proc_net_tcp: &str) -> Vec<u16> {
    const LISTEN: &str = "0A";
    let mut ports: Vec<u16> = proc_net_tcp
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (local, state) = (fields.get(1)?, fields.get(3)?);
            if *state != LISTEN {
                return None;
            }
            u16::from_str_radix(local.rsplit(':').next()?, 16).ok()
        })
        .collect();
    ports.sort_unstable();
    ports.dedup();
    ports
}

#[cfg(test)]
mod tests {
    #[test]
    fn listening_ports_come_from_proc_net_tcp() {
        let table = "  sl  local_address rem_address   st\n   0: 00000000:1F90 00000000:0000 0A 00000000\n   1: 0100007F:0035 0100007F:A000 01 0000\n";
        assert_eq!(super::listening_ports(table), vec![8080]);
    }
}
