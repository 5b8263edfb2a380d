//! A typed client for QEMU's machine protocol (QMP) over a unix socket.
//!
//! Owns: the QMP handshake, command/response matching by id, events, and
//! passing file descriptors to QEMU (`getfd` with `SCM_RIGHTS`), which the
//! engine uses because QEMU runs under its seccomp sandbox with `spawn=deny`
//! and so cannot open `exec:` migration targets itself.
//!
//! Knows nothing of sandboxes, templates or snapshots: it speaks the protocol
//! and leaves every decision to the engine. Human-readable monitor output is
//! never parsed.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::{broadcast, oneshot};

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("QMP connection failed")]
    Connect(#[source] std::io::Error),
    #[error("QMP I/O failed")]
    Io(#[source] std::io::Error),
    #[error("QMP connection closed")]
    Closed,
    #[error("QMP handshake failed: {0}")]
    Handshake(String),
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("QMP reply to {command} did not have the expected shape")]
    Decode {
        command: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("QMP command {0} timed out")]
    Timeout(String),
}

/// An asynchronous event QEMU sent (`STOP`, `RESUME`, `MIGRATION`, ...).
#[derive(Debug, Clone, Deserialize)]
pub struct Event {
    pub event: String,
    #[serde(default)]
    pub data: Value,
}

/// State of an outgoing or incoming migration, from `query-migrate`.
#[derive(Debug, Clone, Deserialize)]
pub struct MigrationInfo {
    #[serde(default)]
    pub status: Option<String>,
    #[serde(rename = "error-desc", default)]
    pub error_desc: Option<String>,
}

/// The VM's run state, from `query-status`.
#[derive(Debug, Clone, Deserialize)]
pub struct StatusInfo {
    pub running: bool,
    pub status: String,
}

#[derive(Serialize)]
struct Command<'a> {
    execute: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    arguments: Option<Value>,
    id: u64,
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value, QmpError>>>>>;

/// A connected QMP session. Cheap to clone; commands may be issued
/// concurrently and are matched to their replies by id.
#[derive(Clone)]
pub struct Qmp {
    inner: Arc<Inner>,
}

struct Inner {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Pending,
    next_id: AtomicU64,
    events: broadcast::Sender<Event>,
    command_timeout: Duration,
}

impl Qmp {
    /// Connects to QEMU's QMP socket, reads the greeting and leaves
    /// capability negotiation mode.
    pub async fn connect(path: &Path) -> Result<Qmp, QmpError> {
        let stream = UnixStream::connect(path).await.map_err(QmpError::Connect)?;
        Self::handshake(stream).await
    }

    /// Retries `connect` until QEMU has created its socket or the deadline passes.
    pub async fn connect_with_deadline(path: &Path, deadline: Duration) -> Result<Qmp, QmpError> {
        let start = tokio::time::Instant::now();
        loop {
            match UnixStream::connect(path).await {
                Ok(stream) => return Self::handshake(stream).await,
                Err(e) if start.elapsed() >= deadline => return Err(QmpError::Connect(e)),
                Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        }
    }

    async fn handshake(stream: UnixStream) -> Result<Qmp, QmpError> {
        let (read_half, write_half) = stream.into_split();
        let mut reader = BufReader::new(read_half);
        let mut line = String::new();
        let n = reader.read_line(&mut line).await.map_err(QmpError::Io)?;
        if n == 0 {
            return Err(QmpError::Closed);
        }
        let greeting: Value = serde_json::from_str(&line)
            .map_err(|e| QmpError::Handshake(format!("bad greeting: {e}")))?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Handshake(format!("unexpected greeting {line}")));
        }
        let pending: Pending = Arc::new(Mutex::new(HashMap::new()));
        let (events, _) = broadcast::channel(64);
        let qmp = Qmp {
            inner: Arc::new(Inner {
                writer: tokio::sync::Mutex::new(write_half),
                pending: pending.clone(),
                next_id: AtomicU64::new(1),
                events: events.clone(),
                command_timeout: Duration::from_secs(30),
            }),
        };
        tokio::spawn(read_loop(reader, pending, events));
        qmp.execute_value("qmp_capabilities", None).await?;
        Ok(qmp)
    }

    /// Subscribes to events sent from now on.
    pub fn events(&self) -> broadcast::Receiver<Event> {
        self.inner.events.subscribe()
    }

    /// Runs a command and returns its raw `return` value.
    pub async fn execute_value(
        &self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        self.execute_inner(command, arguments, None).await
    }

    /// Runs a command and decodes its `return` value.
    pub async fn execute<T: DeserializeOwned>(
        &self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<T, QmpError> {
        let value = self.execute_value(command, arguments).await?;
        serde_json::from_value(value).map_err(|source| QmpError::Decode {
            command: command.to_string(),
            source,
        })
    }

    async fn execute_inner(
        &self,
        command: &str,
        arguments: Option<Value>,
        fd: Option<RawFd>,
    ) -> Result<Value, QmpError> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.inner.pending.lock().unwrap().insert(id, tx);
        let mut line = serde_json::to_vec(&Command {
            execute: command,
            arguments,
            id,
        })
        .expect("QMP commands always serialize");
        line.push(b'\n');
        let write_result = {
            let mut writer = self.inner.writer.lock().await;
            match fd {
                Some(fd) => send_with_fd(&writer, &line, fd).await,
                None => writer.write_all(&line).await,
            }
        };
        if let Err(e) = write_result {
            self.inner.pending.lock().unwrap().remove(&id);
            return Err(QmpError::Io(e));
        }
        match tokio::time::timeout(self.inner.command_timeout, rx).await {
            Ok(Ok(result)) => result.map_err(|e| match e {
                QmpError::Command { class, desc, .. } => QmpError::Command {
                    command: command.to_string(),
                    class,
                    desc,
                },
                other => other,
            }),
            Ok(Err(_)) => Err(QmpError::Closed),
            Err(_) => {
                self.inner.pending.lock().unwrap().remove(&id);
                Err(QmpError::Timeout(command.to_string()))
            }
        }
    }

    /// Pauses the guest's vCPUs. QEMU drains and flushes block devices
    /// before it answers, so disk images are consistent afterwards.
    pub async fn stop(&self) -> Result<(), QmpError> {
        self.execute_value("stop", None).await.map(drop)
    }

    /// Resumes the guest's vCPUs.
    pub async fn cont(&self) -> Result<(), QmpError> {
        self.execute_value("cont", None).await.map(drop)
    }

    pub async fn query_status(&self) -> Result<StatusInfo, QmpError> {
        self.execute("query-status", None).await
    }

    pub async fn query_migrate(&self) -> Result<MigrationInfo, QmpError> {
        self.execute("query-migrate", None).await
    }

    /// Turns migration capabilities on or off (`x-ignore-shared`, ...).
    pub async fn set_migration_capability(&self, name: &str, on: bool) -> Result<(), QmpError> {
        self.execute_value(
            "migrate-set-capabilities",
            Some(json!({"capabilities": [{"capability": name, "state": on}]})),
        )
        .await
        .map(drop)
    }

    /// Hands QEMU an open file descriptor under `name`, for `fd:<name>` URIs.
    pub async fn getfd(&self, name: &str, fd: &impl AsRawFd) -> Result<(), QmpError> {
        self.execute_inner(
            "getfd",
            Some(json!({ "fdname": name })),
            Some(fd.as_raw_fd()),
        )
        .await
        .map(drop)
    }

    /// Puts an open file descriptor into a new fd set and returns the set's
    /// id: QEMU then opens `/dev/fdset/<id>` (with the descriptor's access
    /// mode) where a command wants a path, which is how a QEMU that has
    /// dropped privileges and `chroot`ed writes a file the engine chose.
    pub async fn add_fd(&self, fd: &impl AsRawFd) -> Result<u64, QmpError> {
        let value = self
            .execute_inner("add-fd", None, Some(fd.as_raw_fd()))
            .await?;
        value
            .get("fdset-id")
            .and_then(Value::as_u64)
            .ok_or_else(|| QmpError::Command {
                command: "add-fd".into(),
                class: "UnexpectedReply".into(),
                desc: format!("no fdset-id in {value}"),
            })
    }

    /// Closes QEMU's copies of the descriptors in fd set `fdset_id`.
    pub async fn remove_fd(&self, fdset_id: u64) -> Result<(), QmpError> {
        self.execute_value("remove-fd", Some(json!({ "fdset-id": fdset_id })))
            .await
            .map(drop)
    }

    /// Starts an outgoing migration to `uri`.
    pub async fn migrate(&self, uri: &str) -> Result<(), QmpError> {
        self.execute_value("migrate", Some(json!({ "uri": uri })))
            .await
            .map(drop)
    }

    /// Starts an incoming migration from `uri` on a QEMU started with
    /// `-incoming defer`.
    pub async fn migrate_incoming(&self, uri: &str) -> Result<(), QmpError> {
        self.execute_value("migrate-incoming", Some(json!({ "uri": uri })))
            .await
            .map(drop)
    }

    /// Polls `query-migrate` until the migration completes or fails.
    pub async fn wait_for_migration(&self, deadline: Duration) -> Result<(), QmpError> {
        let start = tokio::time::Instant::now();
        let mut delay = Duration::from_micros(500);
        loop {
            let info = self.query_migrate().await?;
            match info.status.as_deref() {
                Some("completed") => return Ok(()),
                Some("failed") | Some("cancelled") => {
                    return Err(QmpError::Command {
                        command: "migrate".into(),
                        class: "MigrationFailed".into(),
                        desc: info.error_desc.unwrap_or_else(|| "migration failed".into()),
                    })
                }
                _ => {}
            }
            if start.elapsed() > deadline {
                return Err(QmpError::Timeout("migrate".into()));
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(10));
        }
    }

    /// Asks QEMU to exit.
    pub async fn quit(&self) -> Result<(), QmpError> {
        match self.execute_value("quit", None).await {
            Ok(_) | Err(QmpError::Closed) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

async fn send_with_fd(writer: &OwnedWriteHalf, bytes: &[u8], fd: RawFd) -> std::io::Result<()> {
    let stream: &UnixStream = writer.as_ref();
    loop {
        stream.writable().await?;
        let result = stream.try_io(tokio::io::Interest::WRITABLE, || {
            sendmsg_fd(stream.as_raw_fd(), bytes, fd)
        });
        match result {
            Ok(sent) if sent == bytes.len() => return Ok(()),
            Ok(sent) => {
                // The descriptor went with the first byte; the rest is plain data.
                let mut rest = &bytes[sent..];
                while !rest.is_empty() {
                    stream.writable().await?;
                    match stream.try_write(rest) {
                        Ok(n) => rest = &rest[n..],
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                        Err(e) => return Err(e),
                    }
                }
                return Ok(());
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

fn sendmsg_fd(socket: RawFd, bytes: &[u8], fd: RawFd) -> std::io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: msghdr is plain data; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space;
    // SAFETY: msg_control points at a buffer of CMSG_SPACE(sizeof(int)) bytes,
    // so the first header and its data fit.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut RawFd, fd);
    }
    // SAFETY: socket is a valid descriptor owned by the stream; msg is fully initialised.
    let sent = unsafe { libc::sendmsg(socket, &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(sent as usize)
    }
}

async fn read_loop(
    mut reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    pending: Pending,
    events: broadcast::Sender<Event>,
) {
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let Ok(message) = serde_json::from_str::<Value>(&line) else {
            tracing::warn!(line = %line.trim(), "unparseable QMP message");
            continue;
        };
        if message.get("event").is_some() {
            if let Ok(event) = serde_json::from_value::<Event>(message) {
                let _ = events.send(event);
            }
            continue;
        }
        let Some(id) = message.get("id").and_then(Value::as_u64) else {
            continue;
        };
        let Some(waiter) = pending.lock().unwrap().remove(&id) else {
            continue;
        };
        let result = if let Some(ret) = message.get("return") {
            Ok(ret.clone())
        } else if let Some(err) = message.get("error") {
            Err(QmpError::Command {
                command: String::new(),
                class: err["class"].as_str().unwrap_or("GenericError").to_string(),
                desc: err["desc"].as_str().unwrap_or("").to_string(),
            })
        } else {
            Ok(Value::Null)
        };
        let _ = waiter.send(result);
    }
    for (_, waiter) in pending.lock().unwrap().drain() {
        let _ = waiter.send(Err(QmpError::Closed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::UnixListener;

    /// A scripted QMP peer: answers each command with the reply the test
    /// gives for it, and reports the commands it saw.
    async fn fake_qemu(listener: UnixListener, replies: Vec<Value>) -> Vec<Value> {
        let (stream, _) = listener.accept().await.unwrap();
        let (read_half, mut write_half) = stream.into_split();
        let mut reader = BufReader::new(read_half);
        write_half
            .write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
            .await
            .unwrap();
        let mut seen = Vec::new();
        let mut replies = replies.into_iter();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).await.unwrap() == 0 {
                break;
            }
            let command: Value = serde_json::from_str(&line).unwrap();
            let id = command["id"].clone();
            seen.push(command);
            write_half
                .write_all(b"{\"event\": \"STOP\", \"data\": {}}\n")
                .await
                .unwrap();
            let mut reply = replies.next().unwrap_or(json!({"return": {}}));
            reply["id"] = id;
            let mut bytes = serde_json::to_vec(&reply).unwrap();
            bytes.push(b'\n');
            write_half.write_all(&bytes).await.unwrap();
        }
        let mut rest = Vec::new();
        let _ = reader.read_to_end(&mut rest).await;
        seen
    }

    #[tokio::test]
    async fn commands_match_replies_and_errors_carry_qemus_message() {
        let dir = std::env::temp_dir().join(format!("shoal-qmp-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("qmp.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let peer = tokio::spawn(fake_qemu(
            listener,
            vec![
                json!({"return": {}}),
                json!({"return": {"running": false, "status": "paused"}}),
                json!({"error": {"class": "GenericError", "desc": "no such capability"}}),
            ],
        ));
        let qmp = Qmp::connect(&path).await.unwrap();
        let status = qmp.query_status().await.unwrap();
        assert!(!status.running);
        assert_eq!(status.status, "paused");
        let err = qmp
            .set_migration_capability("x-bogus", true)
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "QMP command migrate-set-capabilities failed: GenericError: no such capability"
        );
        drop(qmp);
        let seen = peer.await.unwrap();
        let names: Vec<_> = seen
            .iter()
            .map(|c| c["execute"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            names,
            [
                "qmp_capabilities",
                "query-status",
                "migrate-set-capabilities"
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
