//! Routes about the account and the service rather than one sandbox's
//! guest: health, the OpenAPI document, `/v1/me`, templates, snapshots;
//! and a sandbox's console log and listening ports.
//!
//! What comes from the guest is bounded: the console log answers with its
//! last [`MAX_LOG_TAIL`] bytes, the port table is read up to
//! [`MAX_PORT_TABLE`] bytes.

use crate::error::{ApiError, ApiResult};
use crate::extract::Caller;
use crate::{rfc3339, ControlPlane, OPENAPI};
use axum::extract::{Path, RawQuery, State};
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};
use shoal_proto::client::ExecRequest;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

type St = State<Arc<ControlPlane>>;

/// The most of a console log one `GET .../logs` answers with: its end.
pub const MAX_LOG_TAIL: u64 = 1 << 20;

/// The most of the guest's /proc/net/tcp{,6} read for `GET .../ports`.
pub const MAX_PORT_TABLE: usize = 4 << 20;

/// A query string as name -> value; a malformed one is a 400.
fn query(q: Option<&str>) -> ApiResult<HashMap<String, String>> {
    serde_urlencoded::from_str(q.unwrap_or(""))
        .map_err(|e| ApiError::bad_request(format!("bad query string: {e}")))
}

pub async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// `GET /version` (no token), in PandaStack's shape.
pub async fn version() -> Json<Value> {
    Json(json!({
        "service": "shoal",
        "semver": concat!("v", env!("CARGO_PKG_VERSION")),
        "commit": option_env!("SHOAL_GIT_COMMIT").unwrap_or("unknown"),
        "build_time": option_env!("SHOAL_BUILD_TIME").unwrap_or("unknown"),
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
    }))
}

/// How long `GET .../metrics` watches the QEMU process to measure its CPU.
const METRICS_WINDOW: std::time::Duration = std::time::Duration::from_millis(200);

/// `GET /v1/sandboxes/{id}/metrics`: the sandbox's QEMU process on its
/// host (PandaStack's fields): pid, uptime, CPU over 200 ms as a percentage
/// of one core, resident and virtual size, threads.
pub async fn metrics(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    cp.running(&account, &id).await?;
    let engine = cp.host.engine();
    let unavailable = || {
        ApiError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            format!("sandbox {id} has no VM process now"),
        )
    };
    let first = engine.process_stat(&id)?.ok_or_else(unavailable)?;
    tokio::time::sleep(METRICS_WINDOW).await;
    let second = engine.process_stat(&id)?.ok_or_else(unavailable)?;
    let busy = (second.cpu_seconds - first.cpu_seconds).max(0.0);
    Ok(Json(json!({
        "pid": second.pid,
        "uptime_seconds": second.uptime_seconds as u64,
        "host_cpu_percent": busy / METRICS_WINDOW.as_secs_f64() * 100.0,
        "host_rss_bytes": second.rss_bytes,
        "host_vsz_bytes": second.vsize_bytes,
        "threads": second.threads,
    })))
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
        // What usage costs (`seff` prices what a job asked for and left unused).
        "rates": {
            "cpu_hour_usd": cp.store.rate_card().cpu_hour_usd,
            "gib_hour_usd": cp.store.rate_card().gib_hour_usd,
        },
    }))
}

/// A host heartbeating less recently than this is down (the fronts'
/// `STALE_AFTER`).
const HOST_STALE_SECONDS: f64 = 30.0;

/// `GET /v1/capacity`: the fleet's hosts and what they can still take,
/// for `shoal sinfo`. Hosts by name and counts only (never their
/// addresses). A single `shoal up` reports itself.
pub async fn capacity(State(cp): St, Caller(_account): Caller) -> ApiResult<Json<Value>> {
    let at = crate::now();
    let rows = cp.store.hosts(at).await?;
    let hosts: Vec<Value> = if rows.is_empty() {
        let (max_sandboxes, reserve_mib) = cp.host.capacity_limits();
        let held = cp
            .host
            .engine()
            .list()
            .await
            .into_iter()
            .filter(|s| s.state != shoal_host::VmState::Hibernated)
            .count();
        vec![json!({
            "name": cp.config.host_name,
            "state": "up",
            "vcpus": std::thread::available_parallelism().map_or(1, |n| n.get()),
            "cpu_busy": null,
            "memory_mib": shoal_host::meminfo_mib("MemTotal:").unwrap_or(0),
            "available_mib": shoal_host::meminfo_mib("MemAvailable:").unwrap_or(0),
            "reserve_mib": reserve_mib,
            "sandboxes": held,
            "max_sandboxes": max_sandboxes,
            "heartbeat_age_seconds": null,
        })]
    } else {
        rows.iter()
            .map(|h| {
                let r = &h.report;
                let state = if !h.is_fresh(at, HOST_STALE_SECONDS) {
                    "down"
                } else if r.draining {
                    "drain"
                } else {
                    "up"
                };
                json!({
                    "name": r.id,
                    "state": state,
                    "vcpus": r.vcpus,
                    "cpu_busy": r.cpu_busy,
                    "memory_mib": r.memory_mib,
                    "available_mib": r.available_mib,
                    "reserve_mib": r.reserve_mib,
                    "sandboxes": r.sandboxes + h.in_flight_sandboxes,
                    "max_sandboxes": r.max_sandboxes,
                    "heartbeat_age_seconds": (at - h.heartbeat_at).max(0.0),
                })
            })
            .collect()
    };
    Ok(Json(json!({
        "hosts": hosts,
        "history": crate::metrics::metrics().recent_placements(),
    })))
}

pub async fn snapshots(
    State(cp): St,
    Caller(account): Caller,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<Value>> {
    let filter = query(q.as_deref())?;
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

/// The guest console so far (kernel and guest agent output): its last
/// [`MAX_LOG_TAIL`] bytes, from the first whole line among them.
pub async fn logs(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<axum::response::Response> {
    let params = query(q.as_deref())?;
    if let Some(stream) = params.get("stream") {
        if !matches!(stream.as_str(), "stdout" | "stderr" | "both") {
            return Err(ApiError::bad_request(
                "stream must be stdout, stderr or both",
            ));
        }
    }
    let follow = match params.get("follow").map(String::as_str) {
        None | Some("false" | "0") => false,
        Some("true" | "1") => true,
        Some(_) => return Err(ApiError::bad_request("follow must be true or false")),
    };
    cp.owned(&account, &id).await?;
    let path = cp.host.engine().console_log(&id)?;
    let text = log_tail(&path, MAX_LOG_TAIL).await.unwrap_or_default();
    if follow {
        return Ok(follow_log(cp, account, id, path, text).into_response());
    }
    Ok((
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        String::from_utf8_lossy(&text).into_owned(),
    )
        .into_response())
}

/// How often a followed console log is read again.
const LOG_FOLLOW_POLL: std::time::Duration = std::time::Duration::from_millis(250);
/// A followed log line longer than this is sent in pieces.
const LOG_FOLLOW_MAX_LINE: usize = 64 << 10;
/// How often a follower checks that the sandbox still lives.
const LOG_FOLLOW_ALIVE_EVERY: u32 = 20;

/// `logs?follow=true`: server-sent `line` events, `{"line": "..."}` each
/// (what the SDK's `logs(follow=True)` reads), first the log's end, then
/// each line as the guest writes it, until the sandbox is gone or the
/// client leaves. Keep-alive comments every 15 s.
fn follow_log(
    cp: Arc<ControlPlane>,
    account: shoal_store::Account,
    id: String,
    path: std::path::PathBuf,
    tail: Vec<u8>,
) -> impl IntoResponse {
    use axum::response::sse::{Event, KeepAlive, Sse};
    struct Follow {
        cp: Arc<ControlPlane>,
        account: shoal_store::Account,
        id: String,
        path: std::path::PathBuf,
        offset: u64,
        partial: Vec<u8>,
        ready: std::collections::VecDeque<String>,
        polls: u32,
    }
    let offset = std::fs::metadata(&path).map_or(0, |m| m.len());
    let mut state = Follow {
        cp,
        account,
        id,
        path,
        offset,
        partial: Vec::new(),
        ready: Default::default(),
        polls: 0,
    };
    split_lines(&mut state.partial, &tail, &mut state.ready, true);
    let stream = futures::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(line) = s.ready.pop_front() {
                let event = crate::exec::sse("line", json!({ "line": line }));
                return Some((Ok::<Event, std::convert::Infallible>(event), s));
            }
            tokio::time::sleep(LOG_FOLLOW_POLL).await;
            s.polls += 1;
            if s.polls % LOG_FOLLOW_ALIVE_EVERY == 0
                && s.cp
                    .store
                    .get_sandbox(s.account.id, &s.id)
                    .await
                    .ok()
                    .flatten()
                    .is_none_or(|r| !r.is_live())
            {
                return None;
            }
            let len = tokio::fs::metadata(&s.path).await.map_or(0, |m| m.len());
            if len < s.offset {
                s.offset = 0;
            }
            if len == s.offset {
                continue;
            }
            let Ok(mut file) = tokio::fs::File::open(&s.path).await else {
                return None;
            };
            if file.seek(std::io::SeekFrom::Start(s.offset)).await.is_err() {
                return None;
            }
            let mut fresh = Vec::new();
            let want = (len - s.offset).min(MAX_LOG_TAIL);
            if (&mut file)
                .take(want)
                .read_to_end(&mut fresh)
                .await
                .is_err()
            {
                return None;
            }
            s.offset += fresh.len() as u64;
            let Follow { partial, ready, .. } = &mut s;
            split_lines(partial, &fresh, ready, false);
        }
    });
    Sse::new(stream).keep_alive(
        KeepAlive::new()
            .interval(std::time::Duration::from_secs(15))
            .text("keep-alive"),
    )
}

/// Appends `bytes` to `partial` and moves its whole lines (and pieces of
/// [`LOG_FOLLOW_MAX_LINE`]) to `ready`; with `flush`, the rest too.
fn split_lines(
    partial: &mut Vec<u8>,
    bytes: &[u8],
    ready: &mut std::collections::VecDeque<String>,
    flush: bool,
) {
    partial.extend_from_slice(bytes);
    loop {
        let cut = match partial.iter().position(|&b| b == b'\n') {
            Some(newline) if newline <= LOG_FOLLOW_MAX_LINE => newline + 1,
            _ if partial.len() >= LOG_FOLLOW_MAX_LINE => LOG_FOLLOW_MAX_LINE,
            _ => break,
        };
        let line: Vec<u8> = partial.drain(..cut).collect();
        ready.push_back(
            String::from_utf8_lossy(&line)
                .trim_end_matches(['\r', '\n'])
                .to_string(),
        );
    }
    if flush && !partial.is_empty() {
        ready.push_back(String::from_utf8_lossy(partial).into_owned());
        partial.clear();
    }
}

/// The last `max` bytes of a file; when that cuts the file, from the first
/// line that starts among them.
pub(crate) async fn log_tail(path: &std::path::Path, max: u64) -> std::io::Result<Vec<u8>> {
    let mut file = tokio::fs::File::open(path).await?;
    let len = file.metadata().await?.len();
    let start = len.saturating_sub(max);
    file.seek(std::io::SeekFrom::Start(start)).await?;
    let mut out = Vec::with_capacity(usize::try_from(len - start).unwrap_or(0));
    // The file may grow meanwhile: read no more than was measured.
    (&mut file).take(max).read_to_end(&mut out).await?;
    if start > 0 {
        if let Some(newline) = out.iter().position(|&b| b == b'\n') {
            out.drain(..=newline);
        }
    }
    Ok(out)
}

/// TCP ports listening in the guest, read from /proc/net/tcp{,6}.
pub async fn ports(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let row = cp.running(&account, &id).await?;
    let agent = cp.host.engine().agent(&id).await?;
    let out = agent
        .exec_collect_limited(
            ExecRequest::new("cat /proc/net/tcp /proc/net/tcp6 2>/dev/null"),
            MAX_PORT_TABLE,
        )
        .await?;
    let listening = listening_ports(&String::from_utf8_lossy(&out.stdout));
    let labels = port_labels(&row.metadata);
    let mut ports: Vec<u16> = labels.keys().chain(listening.iter()).copied().collect();
    ports.sort_unstable();
    ports.dedup();
    // An array of PandaStack's port objects (the SDK reads an array or
    // `{"ports"}`).
    let ports: Vec<Value> = ports
        .into_iter()
        .map(|port| {
            let label = labels.get(&port);
            json!({
                "port": port,
                "protocol": "tcp",
                "label": label,
                "listening": listening.contains(&port),
                "source": if label.is_some() { "user" } else { "detected" },
                "proxy_url": format!("/v1/sandboxes/{id}/proxy/{port}/"),
            })
        })
        .collect();
    Ok(Json(Value::Array(ports)))
}

/// Metadata keys naming an exposed port: `port.<n>` = its label.
const PORT_KEY_PREFIX: &str = "port.";

fn port_labels(metadata: &shoal_store::Metadata) -> std::collections::BTreeMap<u16, String> {
    metadata
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(PORT_KEY_PREFIX)?.parse().ok()?, v.clone())))
        .collect()
}

#[derive(serde::Deserialize, Default)]
#[serde(default)]
pub struct ExposeBody {
    port: i64,
    label: Option<String>,
}

/// `POST /v1/sandboxes/{id}/ports {port, label}`: names a port the
/// sandbox serves (kept in its metadata as `port.<n>`, as PandaStack does);
/// `DELETE .../ports/{port}` forgets it. The proxy serves any port either way.
pub async fn expose_port(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    crate::extract::Body(body): crate::extract::Body<ExposeBody>,
) -> ApiResult<(axum::http::StatusCode, Json<Value>)> {
    let port = u16::try_from(body.port)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::bad_request("port must be 1..65535"))?;
    let label = body
        .label
        .filter(|l| !l.is_empty())
        .unwrap_or_else(|| "service".into());
    if label.len() > 1024 || label.chars().any(char::is_control) {
        return Err(ApiError::bad_request(
            "label is at most 1024 printable characters",
        ));
    }
    let row = cp.owned(&account, &id).await?;
    let mut metadata = row.metadata.clone();
    let key = format!("{PORT_KEY_PREFIX}{port}");
    if !metadata.contains_key(&key) && metadata.len() >= crate::sandboxes::MAX_METADATA_KEYS {
        return Err(ApiError::bad_request(format!(
            "metadata holds at most {} keys",
            crate::sandboxes::MAX_METADATA_KEYS
        )));
    }
    metadata.insert(key, label.clone());
    set_metadata(&cp, &id, metadata).await?;
    Ok((
        axum::http::StatusCode::CREATED,
        Json(json!({
            "port": port,
            "protocol": "tcp",
            "label": label,
            "listening": false,
            "source": "user",
            "proxy_url": format!("/v1/sandboxes/{id}/proxy/{port}/"),
        })),
    ))
}

pub async fn unexpose_port(
    State(cp): St,
    Caller(account): Caller,
    Path((id, port)): Path<(String, String)>,
) -> ApiResult<axum::http::StatusCode> {
    let port: u16 = port
        .parse()
        .map_err(|_| ApiError::bad_request("invalid port"))?;
    let row = cp.owned(&account, &id).await?;
    let mut metadata = row.metadata.clone();
    if metadata
        .remove(&format!("{PORT_KEY_PREFIX}{port}"))
        .is_some()
    {
        set_metadata(&cp, &id, metadata).await?;
    }
    Ok(axum::http::StatusCode::NO_CONTENT)
}

async fn set_metadata(
    cp: &ControlPlane,
    id: &str,
    metadata: shoal_store::Metadata,
) -> ApiResult<()> {
    let patch = shoal_store::SandboxPatch {
        metadata: Some(metadata),
        ..Default::default()
    };
    cp.store.update_sandbox(id, patch).await?;
    Ok(())
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
    #[tokio::test]
    async fn the_log_answers_with_its_last_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let mut text = String::new();
        for i in 0..1000 {
            text.push_str(&format!("line {i}\n"));
        }
        std::fs::write(&path, &text).unwrap();
        let tail = super::log_tail(&path, 100).await.unwrap();
        assert!(tail.len() <= 100);
        let tail = String::from_utf8(tail).unwrap();
        assert!(tail.starts_with("line 9"), "{tail}");
        assert!(tail.ends_with("line 999\n"));
        let whole = super::log_tail(&path, 1 << 20).await.unwrap();
        assert_eq!(whole, text.as_bytes());
    }

    #[test]
    fn listening_ports_come_from_proc_net_tcp() {
        let table = "  sl  local_address rem_address   st\n   0: 00000000:1F90 00000000:0000 0A 00000000\n   1: 0100007F:0035 0100007F:A000 01 0000\n";
        assert_eq!(super::listening_ports(table), vec![8080]);
    }
}
