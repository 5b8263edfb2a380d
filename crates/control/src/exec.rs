//! Exec and exec/stream. An exec in flight counts as activity in the
//! database (`running_execs`), so the idle reaper never takes a sandbox in
//! the middle of a command, however quiet the command is.
//!
//! The plain exec answers with the output in one JSON body, so it keeps at
//! most [`shoal_proto::client::output_limit`] bytes of each stream (16 MiB
//! unless `SHOAL_EXEC_OUTPUT_LIMIT` says otherwise) and flags the rest as
//! truncated; the command still runs to its end. Whole output goes through
//! exec/stream, which holds only what the client has not read yet.

use crate::error::{ApiError, ApiResult};
use crate::extract::{Body, Caller};
use crate::{now, ControlPlane};
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use shoal_proto::client::{ExecEvent, ExecRequest, ExitStatus};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// The longest command timeout accepted: a week (a command can outlive no
/// sandbox anyway, and a bound keeps the seconds a valid duration).
pub const MAX_TIMEOUT_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

/// A timeout from a request, in units of `unit` seconds: `None` for absent
/// or 0, a 400 for anything negative, not finite or past `max` units. A
/// positive timeout under a millisecond counts as one, as the guest counts
/// in milliseconds.
pub(crate) fn timeout_in(
    field: &str,
    value: Option<f64>,
    unit: f64,
    max: f64,
) -> ApiResult<Option<Duration>> {
    match value {
        None => Ok(None),
        Some(0.0) => Ok(None),
        Some(t) if t.is_finite() && t > 0.0 && t <= max => Ok(Some(
            Duration::from_secs_f64(t * unit).max(Duration::from_millis(1)),
        )),
        Some(_) => Err(ApiError::bad_request(format!(
            "{field} must be a positive number of at most {max}"
        ))),
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct ExecBody {
    cmd: Option<String>,
    timeout_seconds: Option<f64>,
    env: Option<BTreeMap<String, String>>,
    cwd: Option<String>,
}

impl ExecBody {
    pub(crate) fn request(self) -> ApiResult<(ExecRequest, Option<f64>)> {
        let cmd = self
            .cmd
            .filter(|c| !c.trim().is_empty())
            .ok_or_else(|| ApiError::bad_request("cmd must be a non-empty string"))?;
        let timeout = timeout_in(
            "timeout_seconds",
            self.timeout_seconds,
            1.0,
            MAX_TIMEOUT_SECONDS,
        )?;
        let mut request = ExecRequest::new(cmd);
        request.env = self.env.unwrap_or_default();
        request.cwd = self.cwd;
        request.timeout = timeout;
        Ok((request, timeout.and(self.timeout_seconds)))
    }
}

/// Holds `running_execs` up for one command (an exec or a repl cell);
/// lowers it when dropped, even when a streaming client goes away
/// mid-command, and records the command in the sandbox's event log with
/// how it ended.
pub(crate) struct Activity {
    cp: Arc<ControlPlane>,
    id: String,
    /// What the event log shows of the command (`None`: no event).
    command: Option<String>,
    outcome: Value,
}

impl Activity {
    pub(crate) async fn start(
        cp: &Arc<ControlPlane>,
        id: &str,
        command: Option<&str>,
    ) -> ApiResult<Activity> {
        cp.store.exec_started(id, now()).await?;
        Ok(Activity {
            cp: cp.clone(),
            id: id.to_string(),
            command: command.map(crate::events::command_summary),
            outcome: json!({ "exit_code": null, "ended": "client gone or guest failed" }),
        })
    }

    /// The command exited.
    pub(crate) fn exited(&mut self, code: i32, duration_ms: u64) {
        self.outcome = json!({ "exit_code": code, "duration_ms": duration_ms });
    }

    pub(crate) fn timed_out(&mut self) {
        self.outcome = json!({ "exit_code": null, "ended": "timed out" });
    }
}

impl Drop for Activity {
    fn drop(&mut self) {
        if let Some(command) = self.command.take() {
            let mut payload = std::mem::take(&mut self.outcome);
            payload["cmd"] = json!(command);
            self.cp.event(&self.id, "sandbox.exec", payload);
        }
        let (cp, id) = (self.cp.clone(), std::mem::take(&mut self.id));
        tokio::spawn(async move {
            if let Err(e) = cp.store.exec_finished(&id, now()).await {
                tracing::error!(id, error = %e, "recording the end of an exec");
            }
            cp.touch(&id);
        });
    }
}

/// How long past a command's timeout the host waits for the guest's answer.
const GUEST_TIMEOUT_MARGIN: std::time::Duration = std::time::Duration::from_secs(10);

fn exit_code(status: &ExitStatus) -> i32 {
    status
        .code
        .unwrap_or_else(|| 128 + status.signal.unwrap_or(0))
}

fn timeout_message(seconds: Option<f64>) -> String {
    format!("command timeout after {}s", seconds.unwrap_or(0.0))
}

/// The plain exec's answer, serialized straight from the collected bytes
/// (valid UTF-8 is borrowed, not copied).
#[derive(Serialize)]
struct ExecReply<'a> {
    stdout: Cow<'a, str>,
    stderr: Cow<'a, str>,
    exit_code: i32,
    duration_ms: u64,
    /// More was printed than the answer holds (the first bytes are kept).
    stdout_truncated: bool,
    stderr_truncated: bool,
}

pub async fn exec(
    State(cp): State<Arc<ControlPlane>>,
    Caller(account): Caller,
    Path(id): Path<String>,
    Body(body): Body<ExecBody>,
) -> ApiResult<Response> {
    let (request, timeout) = body.request()?;
    cp.running(&account, &id).await?;
    let agent = cp.host.engine().agent(&id).await?;
    let mut activity = Activity::start(&cp, &id, Some(&request.cmd)).await?;
    // The guest agent promises the timeout; the host does not rely on it.
    let host_deadline = request.timeout.map(|t| t + GUEST_TIMEOUT_MARGIN);
    let call = agent.exec_collect(request);
    let collected = match host_deadline {
        Some(deadline) => tokio::time::timeout(deadline, call).await.map_err(|_| {
            ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                format!("{} (the guest did not answer)", timeout_message(timeout)),
            )
        })?,
        None => call.await,
    };
    let output = match collected {
        Ok(output) => output,
        Err(e) => return Err(cp.agent_failure(&id, e).await),
    };
    if output.status.timed_out {
        activity.timed_out();
        return Err(ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            timeout_message(timeout),
        ));
    }
    activity.exited(exit_code(&output.status), output.status.duration_ms);
    let reply = ExecReply {
        stdout: String::from_utf8_lossy(&output.stdout),
        stderr: String::from_utf8_lossy(&output.stderr),
        exit_code: exit_code(&output.status),
        duration_ms: output.status.duration_ms,
        stdout_truncated: output.stdout_truncated,
        stderr_truncated: output.stderr_truncated,
    };
    // One buffer sized for the common case (no escapes), handed to the
    // body without a copy: a full answer costs about twice the output.
    let mut body = Vec::with_capacity(reply.stdout.len() + reply.stderr.len() + 160);
    serde_json::to_writer(&mut body, &reply).map_err(|e| ApiError::internal(e.to_string()))?;
    drop(reply);
    drop(output);
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response())
}

pub async fn exec_stream(
    State(cp): State<Arc<ControlPlane>>,
    Caller(account): Caller,
    Path(id): Path<String>,
    Body(body): Body<ExecBody>,
) -> ApiResult<Response> {
    let (request, timeout) = body.request()?;
    cp.running(&account, &id).await?;
    let agent = cp.host.engine().agent(&id).await?;
    let mut activity = Activity::start(&cp, &id, Some(&request.cmd)).await?;
    let mut handle = agent.exec(request).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Event>(16);
    tokio::spawn(async move {
        let (mut stdout, mut stderr) = (Utf8Decoder::default(), Utf8Decoder::default());
        loop {
            // A silent command is killed as soon as its client goes, not
            // at its next output.
            let next = tokio::select! {
                next = handle.next_event() => next,
                _ = tx.closed() => {
                    let _ = handle.signal(9).await;
                    return;
                }
            };
            let event = match next {
                Ok(ExecEvent::Stdout(bytes)) => {
                    sse("stdout", json!({ "chunk": stdout.push(&bytes) }))
                }
                Ok(ExecEvent::Stderr(bytes)) => {
                    sse("stderr", json!({ "chunk": stderr.push(&bytes) }))
                }
                Ok(ExecEvent::Exit(status)) => {
                    let last = if status.timed_out {
                        activity.timed_out();
                        sse("error", json!({ "error": timeout_message(timeout) }))
                    } else {
                        activity.exited(exit_code(&status), status.duration_ms);
                        sse("exit", json!({ "exit_code": exit_code(&status) }))
                    };
                    let _ = tx.send(last).await;
                    return;
                }
                Err(e) => {
                    let _ = tx
                        .send(sse(
                            "error",
                            json!({ "error": format!("guest agent: {e}") }),
                        ))
                        .await;
                    return;
                }
            };
            if tx.send(event).await.is_err() {
                // The client is gone: so is its command.
                let _ = handle.signal(9).await;
                return;
            }
        }
    });
    let events = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|e| (Ok::<_, std::convert::Infallible>(e), rx))
    });
    let mut response = Sse::new(events)
        .keep_alive(
            KeepAlive::new()
                .interval(Duration::from_secs(15))
                .text("keep-alive"),
        )
        .into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    Ok(response)
}

/// One SSE event whose data is ASCII-only JSON (CONTRACT.md 4.6: requests
/// splits lines on U+0085, U+2028 and U+2029 and decodes without a charset
/// as Latin-1, so anything but ASCII may cut the line).
pub fn sse(name: &str, data: Value) -> Event {
    Event::default().event(name).data(ascii_json(&data))
}

pub fn ascii_json(value: &Value) -> String {
    let text = value.to_string();
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

/// Decodes a byte stream as UTF-8 without breaking a character split
/// across chunks; invalid bytes become U+FFFD.
#[derive(Default)]
pub struct Utf8Decoder {
    pending: Vec<u8>,
}

impl Utf8Decoder {
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    out.push_str(text);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).expect("checked"));
                    match e.error_len() {
                        // An incomplete character at the end: wait for the rest.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{fffd}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_out_of_range_are_refused() {
        let body = |t: f64| ExecBody {
            cmd: Some("true".into()),
            timeout_seconds: Some(t),
            ..ExecBody::default()
        };
        for bad in [
            1e30,
            -1.0,
            f64::NAN,
            f64::INFINITY,
            MAX_TIMEOUT_SECONDS + 1.0,
        ] {
            let err = body(bad).request().expect_err("refused");
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{bad}");
            assert!(err.message.contains("timeout_seconds"), "{}", err.message);
        }
        let (request, _) = body(0.0).request().unwrap();
        assert_eq!(request.timeout, None);
        let (request, _) = body(1e-300).request().unwrap();
        assert_eq!(request.timeout, Some(Duration::from_millis(1)));
        let (request, shown) = body(2.5).request().unwrap();
        assert_eq!(request.timeout, Some(Duration::from_millis(2500)));
        assert_eq!(shown, Some(2.5));
    }

    #[test]
    fn sse_data_is_ascii_json() {
        let text = ascii_json(&json!({"chunk": "Å\u{2028}😀"}));
        assert!(text.is_ascii());
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back["chunk"], "Å\u{2028}😀");
    }

    #[test]
    fn characters_split_across_chunks_survive() {
        let mut decoder = Utf8Decoder::default();
        let bytes = "aÅb".as_bytes();
        assert_eq!(decoder.push(&bytes[..2]), "a");
        assert_eq!(decoder.push(&bytes[2..]), "Åb");
        assert_eq!(decoder.push(&[0xff, b'c']), "\u{fffd}c");
    }
}

// ---- the interactive terminal ----

/// The longest message a terminal client may send (keystrokes and pastes
/// arrive in small frames; a paste is split by the client).
const PTY_MAX_MESSAGE: usize = 64 << 10;
/// How often the server pings an idle terminal, as PandaStack's does.
const PTY_PING: Duration = Duration::from_secs(20);
/// A terminal whose client sends nothing, not even a pong, for this long
/// is closed (its shell is killed).
const PTY_CLIENT_SILENCE: Duration = Duration::from_secs(120);
/// Rows and columns a terminal may have.
const PTY_MAX_SIDE: u16 = 1000;

#[derive(Deserialize)]
pub struct PtyQuery {
    rows: Option<u16>,
    cols: Option<u16>,
    /// The command; a login shell when absent.
    cmd: Option<String>,
    /// Its working directory (absolute).
    cwd: Option<String>,
}

/// A control message from a terminal client (a text frame).
#[derive(Deserialize)]
struct PtyControl {
    resize: Option<shoal_proto::PtySize>,
    stdin: Option<String>,
}

fn pty_size(rows: Option<u16>, cols: Option<u16>) -> ApiResult<shoal_proto::PtySize> {
    let side = |v: Option<u16>, default: u16, name: &str| match v.unwrap_or(default) {
        n @ 1..=PTY_MAX_SIDE => Ok(n),
        n => Err(ApiError::bad_request(format!(
            "{name} must be 1 to {PTY_MAX_SIDE}: {n}"
        ))),
    };
    Ok(shoal_proto::PtySize {
        rows: side(rows, 24, "rows")?,
        cols: side(cols, 80, "cols")?,
    })
}

/// `GET /v1/sandboxes/{id}/exec/pty?rows=&cols=&cmd=&cwd=`: an interactive
/// terminal over a WebSocket, PandaStack's protocol: binary frames are raw
/// bytes both ways; a client's text frame is `{"resize": {"rows", "cols"}}`
/// or `{"stdin": "..."}`; the server ends with the text frame `{"exit":
/// code}` (or `{"error": "..."}`) and closes. Closing the socket kills the
/// shell's process group.
pub async fn pty(
    State(cp): State<Arc<ControlPlane>>,
    Caller(account): Caller,
    Path(id): Path<String>,
    axum::extract::Query(query): axum::extract::Query<PtyQuery>,
    upgrade: axum::extract::ws::WebSocketUpgrade,
) -> ApiResult<Response> {
    let size = pty_size(query.rows, query.cols)?;
    if let Some(cwd) = query.cwd.as_deref().filter(|c| !c.starts_with('/')) {
        return Err(ApiError::bad_request(format!(
            "cwd must be absolute: {cwd:?}"
        )));
    }
    cp.running(&account, &id).await?;
    let agent = cp.host.engine().agent(&id).await?;
    let cmd = query.cmd.unwrap_or_else(|| {
        "if command -v bash >/dev/null 2>&1; then exec bash -l; else exec sh -l; fi".into()
    });
    let mut activity = Activity::start(&cp, &id, Some(&format!("(terminal) {cmd}"))).await?;
    let mut request = ExecRequest::new(cmd).env("TERM", "xterm-256color");
    request.cwd = query.cwd;
    request.pty = Some(size);
    request.stdin = true;
    let handle = agent.exec(request).await?;
    Ok(upgrade
        .max_message_size(PTY_MAX_MESSAGE)
        .max_frame_size(PTY_MAX_MESSAGE)
        .on_upgrade(move |socket| async move {
            if let Some(code) = bridge_pty(socket, handle).await {
                activity.exited(code, 0);
            }
        }))
}

/// Carries a terminal between a WebSocket and a guest exec until either
/// ends; yields the shell's exit code when it exited.
async fn bridge_pty(
    socket: axum::extract::ws::WebSocket,
    mut handle: shoal_proto::client::ExecHandle,
) -> Option<i32> {
    use axum::extract::ws::Message;
    use futures::{SinkExt as _, StreamExt as _};
    let input = handle.input();
    let (mut to_client, mut from_client) = socket.split();
    let mut ping = tokio::time::interval(PTY_PING);
    let mut heard = tokio::time::Instant::now();
    let mut exit = None;
    let ended = loop {
        tokio::select! {
            event = handle.next_event() => match event {
                Ok(ExecEvent::Stdout(bytes)) | Ok(ExecEvent::Stderr(bytes)) => {
                    // A client that stops reading holds this send (and so
                    // the guest's output, by the agent's flow control), not
                    // the server's memory; one that never reads again is
                    // dropped.
                    let sent = tokio::time::timeout(
                        PTY_CLIENT_SILENCE,
                        to_client.send(Message::Binary(bytes.into())),
                    )
                    .await;
                    if !matches!(sent, Ok(Ok(()))) {
                        break None;
                    }
                }
                Ok(ExecEvent::Exit(status)) => {
                    exit = Some(exit_code(&status));
                    break Some(json!({ "exit": exit_code(&status) }));
                }
                Err(e) => break Some(json!({ "error": format!("guest agent: {e}") })),
            },
            message = from_client.next() => {
                heard = tokio::time::Instant::now();
                let sent = match message {
                    None | Some(Err(_)) | Some(Ok(Message::Close(_))) => break None,
                    Some(Ok(Message::Binary(bytes))) => input.send_stdin(&bytes, false).await,
                    Some(Ok(Message::Text(text))) => match serde_json::from_str::<PtyControl>(&text) {
                        Ok(control) => {
                            let mut result = Ok(());
                            if let Some(size) = control.resize {
                                if let Ok(size) = pty_size(Some(size.rows), Some(size.cols)) {
                                    result = input.resize(size);
                                }
                            }
                            if let (Ok(()), Some(text)) = (&result, control.stdin) {
                                result = input.send_stdin(text.as_bytes(), false).await;
                            }
                            result
                        }
                        // Not a control message: ignored, as PandaStack does.
                        Err(_) => Ok(()),
                    },
                    Some(Ok(_)) => Ok(()),
                };
                if let Err(e) = sent {
                    break Some(json!({ "error": format!("guest agent: {e}") }));
                }
            }
            _ = ping.tick() => {
                if heard.elapsed() > PTY_CLIENT_SILENCE
                    || to_client.send(Message::Ping(Vec::new().into())).await.is_err()
                {
                    break None;
                }
            }
        }
    };
    match ended {
        Some(last) => {
            let _ = to_client.send(Message::Text(last.to_string().into())).await;
            let _ = to_client.send(Message::Close(None)).await;
        }
        // The client went: so does the shell.
        None => {
            let _ = input.signal(9);
        }
    }
    exit
}

// ---- many commands over one WebSocket ----

/// Commands one multiplexed socket may have in flight at once.
pub const WS_MAX_IN_FLIGHT: usize = 256;
/// The longest message a multiplexed-exec client may send (one command).
const WS_MAX_MESSAGE: usize = 1 << 20;
/// The longest request id a client may tag a command with.
const WS_MAX_ID: usize = 128;
/// Answers waiting for a slow client: past this, commands wait (and so, by
/// the agent's flow control, does their output in the guest).
const WS_OUTBOX: usize = 64;

/// A client's message on the multiplexed socket.
#[derive(Deserialize)]
struct WsRequest {
    id: Option<String>,
    cmd: Option<String>,
    timeout_seconds: Option<f64>,
    #[serde(default)]
    cancel: bool,
}

/// `GET /v1/sandboxes/{id}/exec/ws`: many commands over one WebSocket,
/// PandaStack's protocol. A client sends `{"id", "cmd", "timeout_seconds"}`
/// to start a command and `{"id", "cancel": true}` to kill it; the server
/// answers `{"id", "stream": "stdout"|"stderr", "data"}` as output comes,
/// then `{"id", "exit": code}` or `{"id", "error": "..."}`. Commands run at
/// once, each on its own; closing the socket kills those still running.
pub async fn exec_ws(
    State(cp): State<Arc<ControlPlane>>,
    Caller(account): Caller,
    Path(id): Path<String>,
    upgrade: axum::extract::ws::WebSocketUpgrade,
) -> ApiResult<Response> {
    cp.running(&account, &id).await?;
    Ok(upgrade
        .max_message_size(WS_MAX_MESSAGE)
        .max_frame_size(WS_MAX_MESSAGE)
        .on_upgrade(move |socket| serve_exec_ws(cp, id, socket)))
}

async fn serve_exec_ws(cp: Arc<ControlPlane>, id: String, socket: axum::extract::ws::WebSocket) {
    use axum::extract::ws::Message;
    use futures::{SinkExt as _, StreamExt as _};
    let (mut to_client, mut from_client) = socket.split();
    let (outbox, mut outgoing) = tokio::sync::mpsc::channel::<Value>(WS_OUTBOX);
    let writer = tokio::spawn(async move {
        let mut ping = tokio::time::interval(PTY_PING);
        loop {
            let message = tokio::select! {
                answer = outgoing.recv() => match answer {
                    Some(answer) => Message::Text(answer.to_string().into()),
                    None => break,
                },
                _ = ping.tick() => Message::Ping(Vec::new().into()),
            };
            let sent = tokio::time::timeout(PTY_CLIENT_SILENCE, to_client.send(message)).await;
            if !matches!(sent, Ok(Ok(()))) {
                break;
            }
        }
    });
    // Request id -> the kill switch of its command.
    let live: Arc<std::sync::Mutex<BTreeMap<String, tokio::sync::oneshot::Sender<()>>>> =
        Arc::default();
    let mut heard = tokio::time::Instant::now();
    let mut silence = tokio::time::interval(PTY_PING);
    loop {
        let message = tokio::select! {
            message = from_client.next() => message,
            _ = silence.tick() => {
                if heard.elapsed() > PTY_CLIENT_SILENCE || writer.is_finished() {
                    break;
                }
                continue;
            }
        };
        heard = tokio::time::Instant::now();
        let text = match message {
            None | Some(Err(_)) | Some(Ok(Message::Close(_))) => break,
            Some(Ok(Message::Text(text))) => text,
            Some(Ok(_)) => continue,
        };
        let request: WsRequest = match serde_json::from_str(&text) {
            Ok(request) => request,
            Err(e) => {
                let _ = outbox
                    .send(json!({ "error": format!("bad json: {e}") }))
                    .await;
                continue;
            }
        };
        let Some(request_id) = request.id.filter(|i| !i.is_empty() && i.len() <= WS_MAX_ID) else {
            let _ = outbox
                .send(json!({ "error": format!("id required (1 to {WS_MAX_ID} characters)") }))
                .await;
            continue;
        };
        if request.cancel {
            let kill = live.lock().unwrap().remove(&request_id);
            if let Some(kill) = kill {
                let _ = kill.send(());
            }
            continue;
        }
        let refusal = |message: String| json!({ "id": request_id, "error": message });
        let exec = ExecBody {
            cmd: request.cmd,
            timeout_seconds: request.timeout_seconds,
            ..ExecBody::default()
        };
        let (exec, shown_timeout) = match exec.request() {
            Ok(parsed) => parsed,
            Err(e) => {
                let _ = outbox.send(refusal(e.message)).await;
                continue;
            }
        };
        let (kill, killed) = tokio::sync::oneshot::channel();
        let refused = {
            let mut live = live.lock().unwrap();
            if live.contains_key(&request_id) {
                Some(format!("command {request_id} is already running"))
            } else if live.len() >= WS_MAX_IN_FLIGHT {
                Some(format!(
                    "at most {WS_MAX_IN_FLIGHT} commands in flight on one socket"
                ))
            } else {
                live.insert(request_id.clone(), kill);
                None
            }
        };
        if let Some(message) = refused {
            let _ = outbox.send(refusal(message)).await;
            continue;
        }
        let (cp, id, outbox, live) = (cp.clone(), id.clone(), outbox.clone(), live.clone());
        tokio::spawn(async move {
            let last =
                run_ws_command(&cp, &id, &request_id, exec, shown_timeout, killed, &outbox).await;
            live.lock().unwrap().remove(&request_id);
            if let Some(last) = last {
                let _ = outbox.send(last).await;
            }
        });
    }
    // The client went: every command still running goes with it.
    for (_, kill) in std::mem::take(&mut *live.lock().unwrap()) {
        let _ = kill.send(());
    }
    writer.abort();
}

/// Runs one command of a multiplexed socket, sending its output to
/// `outbox`; yields its last answer (`exit` or `error`), or None when it
/// was cancelled or the client is gone.
async fn run_ws_command(
    cp: &Arc<ControlPlane>,
    id: &str,
    request_id: &str,
    exec: ExecRequest,
    shown_timeout: Option<f64>,
    mut killed: tokio::sync::oneshot::Receiver<()>,
    outbox: &tokio::sync::mpsc::Sender<Value>,
) -> Option<Value> {
    let error = |message: String| Some(json!({ "id": request_id, "error": message }));
    let agent = match cp.host.engine().agent(id).await {
        Ok(agent) => agent,
        Err(e) => return error(e.to_string()),
    };
    let mut activity = match Activity::start(cp, id, Some(&exec.cmd)).await {
        Ok(activity) => activity,
        Err(e) => return error(e.message),
    };
    let host_deadline = exec.timeout.map(|t| t + GUEST_TIMEOUT_MARGIN);
    let mut handle = match agent.exec(exec).await {
        Ok(handle) => handle,
        Err(e) => return error(format!("guest agent: {e}")),
    };
    let deadline = async {
        match host_deadline {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(deadline);
    let (mut stdout, mut stderr) = (Utf8Decoder::default(), Utf8Decoder::default());
    loop {
        let event = tokio::select! {
            event = handle.next_event() => event,
            _ = &mut killed => {
                let _ = handle.signal(9).await;
                return None;
            }
            _ = &mut deadline => {
                let _ = handle.signal(9).await;
                activity.timed_out();
                return error(format!("{} (the guest did not answer)", timeout_message(shown_timeout)));
            }
        };
        let (stream, data) = match event {
            Ok(ExecEvent::Stdout(bytes)) => ("stdout", stdout.push(&bytes)),
            Ok(ExecEvent::Stderr(bytes)) => ("stderr", stderr.push(&bytes)),
            Ok(ExecEvent::Exit(status)) if status.timed_out => {
                activity.timed_out();
                return error(timeout_message(shown_timeout));
            }
            Ok(ExecEvent::Exit(status)) => {
                activity.exited(exit_code(&status), status.duration_ms);
                return Some(json!({ "id": request_id, "exit": exit_code(&status) }));
            }
            Err(e) => return error(format!("guest agent: {e}")),
        };
        if data.is_empty() {
            continue;
        }
        let answer = json!({ "id": request_id, "stream": stream, "data": data });
        if outbox.send(answer).await.is_err() {
            let _ = handle.signal(9).await;
            return None;
        }
    }
}
