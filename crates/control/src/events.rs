//! Sandboxes' event logs: what the API recorded about each sandbox
//! (created, running, paused, hibernated, woken, forked, exec with its
//! exit code, snapshot, reaped, failed with the reason, deleted), kept in
//! the database (`shoal_store::EVENTS_KEPT` a sandbox), and
//! `GET /v1/sandboxes/{id}/events?tail=N&since=T[&follow=1]`.
//!
//! Recording never waits on the database: events queue in memory (at most
//! [`QUEUE_MAX`]; past that they are dropped and counted) and a background
//! task writes them every [`FLUSH_EVERY`]; a read flushes first, so a
//! client sees what it just caused.

use crate::error::{ApiError, ApiResult};
use crate::extract::Caller;
use crate::{now, rfc3339, ControlPlane};
use axum::extract::{Path, RawQuery, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use shoal_store::SandboxEvent;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

type St = State<Arc<ControlPlane>>;

/// Events waiting to be written, across all sandboxes.
pub const QUEUE_MAX: usize = 10_000;
/// How often queued events are written.
pub const FLUSH_EVERY: Duration = Duration::from_millis(250);
/// The most of a command an exec event keeps.
pub const MAX_EVENT_COMMAND: usize = 1024;
/// Events one read answers with at most (and `tail`'s default).
pub const MAX_TAIL: i64 = 1000;
const DEFAULT_TAIL: i64 = 50;
/// How often a followed log is read again.
const FOLLOW_POLL: Duration = Duration::from_millis(500);
/// Followed logs at once on this process (each reads the database every
/// [`FOLLOW_POLL`]); past it a follow is refused 429.
pub const MAX_FOLLOWERS: usize = 256;

pub(crate) struct EventLog {
    queue: Mutex<Vec<SandboxEvent>>,
    /// One flush at a time, so events reach the database in order.
    writing: tokio::sync::Mutex<()>,
    dropped: AtomicU64,
    followers: Arc<tokio::sync::Semaphore>,
}

impl Default for EventLog {
    fn default() -> Self {
        EventLog {
            queue: Mutex::default(),
            writing: tokio::sync::Mutex::default(),
            dropped: AtomicU64::default(),
            followers: Arc::new(tokio::sync::Semaphore::new(MAX_FOLLOWERS)),
        }
    }
}

impl EventLog {
    /// Queues an event; `payload` should be a JSON object.
    pub(crate) fn record(&self, sandbox_id: &str, kind: &str, payload: Value) {
        let mut queue = self.queue.lock().unwrap();
        if queue.len() >= QUEUE_MAX {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        queue.push(SandboxEvent {
            id: 0,
            sandbox_id: sandbox_id.to_string(),
            at: now(),
            kind: kind.to_string(),
            payload: payload.to_string(),
        });
    }

    pub(crate) async fn flush(&self, store: &shoal_store::Store) {
        let _writing = self.writing.lock().await;
        let batch = std::mem::take(&mut *self.queue.lock().unwrap());
        let dropped = self.dropped.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            tracing::warn!(dropped, "sandbox events dropped: the queue was full");
        }
        if let Err(e) = store.append_sandbox_events(&batch).await {
            tracing::warn!(
                error = e.chain(),
                events = batch.len(),
                "writing sandbox events"
            );
        }
    }
}

/// A command as an exec event keeps it: its first [`MAX_EVENT_COMMAND`]
/// bytes (cut on a character boundary).
pub(crate) fn command_summary(cmd: &str) -> String {
    if cmd.len() <= MAX_EVENT_COMMAND {
        return cmd.to_string();
    }
    let mut end = MAX_EVENT_COMMAND;
    while !cmd.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &cmd[..end])
}

pub(crate) fn spawn_flusher(cp: Arc<ControlPlane>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(FLUSH_EVERY);
        loop {
            tick.tick().await;
            cp.events.flush(&cp.store).await;
        }
    });
}

fn event_json(event: &SandboxEvent) -> Value {
    let payload: Value = serde_json::from_str(&event.payload).unwrap_or(Value::Null);
    json!({
        "id": event.id,
        "time": rfc3339(event.at),
        "sandbox_id": event.sandbox_id,
        "type": event.kind,
        "payload": payload,
    })
}

/// The last event of a sandbox's log: a follow ends after it.
const DELETED: &str = "sandbox.deleted";

/// What a read asked for.
struct EventQuery {
    tail: i64,
    since: f64,
    follow: bool,
}

impl EventQuery {
    fn parse(query: Option<&str>) -> ApiResult<Self> {
        let params: HashMap<String, String> = serde_urlencoded::from_str(query.unwrap_or(""))
            .map_err(|e| ApiError::bad_request(format!("bad query string: {e}")))?;
        let tail = match params.get("tail") {
            None => DEFAULT_TAIL,
            Some(v) => v
                .parse::<i64>()
                .ok()
                .filter(|n| (0..=MAX_TAIL).contains(n))
                .ok_or_else(|| {
                    ApiError::bad_request(format!("tail must be an integer from 0 to {MAX_TAIL}"))
                })?,
        };
        let since = match params.get("since") {
            None => 0.0,
            Some(v) => parse_time(v).ok_or_else(|| {
                ApiError::bad_request("since must be an RFC 3339 time or epoch seconds")
            })?,
        };
        let follow = match params.get("follow").map(String::as_str) {
            None | Some("0" | "false") => false,
            Some("1" | "true") => true,
            Some(_) => return Err(ApiError::bad_request("follow must be 1 or 0")),
        };
        Ok(EventQuery {
            tail,
            since,
            follow,
        })
    }
}

fn parse_time(text: &str) -> Option<f64> {
    if let Ok(seconds) = text.parse::<f64>() {
        return seconds.is_finite().then_some(seconds);
    }
    chrono::DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|t| t.timestamp_millis() as f64 / 1000.0)
}

/// `GET /v1/sandboxes/{id}/events`: `{"events": [...]}` oldest first, or
/// with `follow=1` a server-sent stream of `event` frames that goes on with
/// new events until the sandbox is deleted or the client leaves. A deleted or failed sandbox's log
/// is still read.
pub async fn list(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> ApiResult<Response> {
    let query = EventQuery::parse(query.as_deref())?;
    if cp.store.get_sandbox(account.id, &id).await?.is_none() {
        return Err(ApiError::sandbox_not_found());
    }
    cp.events.flush(&cp.store).await;
    let past = cp
        .store
        .sandbox_events(&id, query.tail, 0, query.since)
        .await?;
    if !query.follow {
        let events: Vec<Value> = past.iter().map(event_json).collect();
        return Ok(Json(json!({ "events": events })).into_response());
    }
    let Ok(follower) = cp.events.followers.clone().try_acquire_owned() else {
        return Err(ApiError::new(
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            format!("at most {MAX_FOLLOWERS} event logs are followed at once; try again later"),
        ));
    };
    let last_id = past.last().map_or(0, |e| e.id);
    let ended = past.iter().any(|e| e.kind == DELETED);
    // The stream holds `follower` until it ends; it ends after the
    // sandbox's deletion, or when the client goes.
    let stream = futures::stream::unfold(
        (cp, id, past, last_id, ended, follower),
        |(cp, id, mut pending, mut last_id, mut ended, follower)| async move {
            loop {
                if !pending.is_empty() {
                    let event = pending.remove(0);
                    ended |= event.kind == DELETED;
                    let frame = Event::default()
                        .event("event")
                        .data(event_json(&event).to_string());
                    return Some((
                        Ok::<_, std::convert::Infallible>(frame),
                        (cp, id, pending, last_id, ended, follower),
                    ));
                }
                if ended {
                    return None;
                }
                tokio::time::sleep(FOLLOW_POLL).await;
                cp.events.flush(&cp.store).await;
                match cp.store.sandbox_events(&id, MAX_TAIL, last_id, 0.0).await {
                    Ok(new) => {
                        if let Some(last) = new.last() {
                            last_id = last.id;
                        }
                        pending = new;
                    }
                    Err(e) => {
                        tracing::warn!(id, error = e.chain(), "following events");
                        return None;
                    }
                }
            }
        },
    );
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_is_bounded() {
        let log = EventLog::default();
        for _ in 0..QUEUE_MAX + 10 {
            log.record("sb-1", "sandbox.exec", json!({}));
        }
        assert_eq!(log.queue.lock().unwrap().len(), QUEUE_MAX);
        assert_eq!(log.dropped.load(Ordering::Relaxed), 10);
    }

    #[test]
    fn a_command_is_kept_up_to_its_limit_on_a_character_boundary() {
        assert_eq!(command_summary("echo hi"), "echo hi");
        let long = "é".repeat(MAX_EVENT_COMMAND);
        let kept = command_summary(&long);
        assert!(
            kept.len() <= MAX_EVENT_COMMAND + "…".len(),
            "{}",
            kept.len()
        );
        assert!(kept.ends_with('…'));
    }

    #[test]
    fn queries_are_checked() {
        let q = EventQuery::parse(None).unwrap();
        assert_eq!((q.tail, q.since, q.follow), (DEFAULT_TAIL, 0.0, false));
        let q = EventQuery::parse(Some("tail=7&since=2026-12-07T10:00:00Z&follow=1")).unwrap();
        assert_eq!(q.tail, 7);
        assert_eq!(q.since, 1_765_101_600.0 + 365.0 * 86_400.0);
        assert!(q.follow);
        assert_eq!(
            EventQuery::parse(Some("since=1800000000.5")).unwrap().since,
            1_800_000_000.5
        );
        for bad in [
            "tail=1001",
            "tail=-1",
            "tail=x",
            "since=yesterday",
            "since=inf",
            "follow=maybe",
            "tail=%ZZ",
        ] {
            assert!(EventQuery::parse(Some(bad)).is_err(), "{bad}");
        }
    }
}
