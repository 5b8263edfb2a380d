//! The host's async client of the guest agent, over one byte stream (the
//! QEMU chardev socket of a VM, or a test socket).
//!
//! Owns: multiplexing calls on the stream (call ids, routing the agent's
//! frames to the call that waits for them), the `Hello` handshake, flow
//! control credit on the host side, and typed calls (exec, files, identity).
//! Does not own: finding or opening the socket, retrying a VM that is not
//! up yet, or any policy about what to run; the VM engine does that.
//!
//! Two background tasks serve one [`AgentClient`]: a reader that routes each
//! frame by id to the per-call channel (frames for ids nobody waits for are
//! dropped), and a writer that owns the write half. Every frame is queued to
//! that writer whole, so frames never interleave and a caller that gives up
//! half-way (a dropped future) can never leave half a frame on the stream.

use crate::{
    asynchronous, encode, CallId, ErrorKind, FileStat, Frame, GuestMsg, HostMsg, ProtoError,
    PtySize, MAX_CHUNK, OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION, STREAM_WINDOW,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;

/// How long [`AgentClient::connect`] waits for the agent's `Hello`.
pub const DEFAULT_HELLO_DEADLINE: Duration = Duration::from_secs(10);

/// A `Hello` is repeated this often until answered: bytes of a frame torn
/// by a snapshot can swallow the first one.
const HELLO_RETRY: Duration = Duration::from_millis(500);

/// Credit goes back in batches rather than per chunk; any batch smaller
/// than the window guarantees the agent never waits for credit we hold.
const CREDIT_BATCH: u64 = STREAM_WINDOW / 4;

/// Bytes of bulk (upload and stdin) frames queued for the writer before
/// callers wait; control frames are never held back.
const BULK_QUEUE_BYTES: usize = 2 * 1024 * 1024;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The agent answered with an error (missing file, bad cwd, ...).
    #[error("{message}")]
    Guest { kind: ErrorKind, message: String },
    /// The connection to the agent is gone.
    #[error("agent connection closed")]
    Closed,
    /// The agent said something that makes no sense for the call.
    #[error("agent protocol error: {0}")]
    Protocol(String),
    /// Reading the caller's data failed (e.g. the source of an upload).
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The agent did not answer in time.
    #[error("agent did not answer in time")]
    Timeout,
}

impl AgentError {
    /// The guest's error kind, when the agent reported the failure.
    pub fn guest_kind(&self) -> Option<ErrorKind> {
        match self {
            AgentError::Guest { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

/// What to run. `cmd` goes to `/bin/sh -c` in the guest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecRequest {
    pub cmd: String,
    /// Added to (and overriding) the agent's environment.
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    /// Kills the whole process group when it passes.
    pub timeout: Option<Duration>,
    /// Runs on a PTY of this size; all output then comes as stdout.
    pub pty: Option<PtySize>,
    /// Keeps stdin open for [`ExecHandle::send_stdin`]; otherwise it is
    /// /dev/null (a PTY always takes input).
    pub stdin: bool,
}

impl ExecRequest {
    pub fn new(cmd: impl Into<String>) -> Self {
        ExecRequest {
            cmd: cmd.into(),
            ..Default::default()
        }
    }

    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    pub fn cwd(mut self, cwd: impl Into<String>) -> Self {
        self.cwd = Some(cwd.into());
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    pub fn pty(mut self, size: PtySize) -> Self {
        self.pty = Some(size);
        self
    }

    pub fn stdin(mut self, stdin: bool) -> Self {
        self.stdin = stdin;
        self
    }
}

/// How an exec ended. Exactly one of `code` and `signal` is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// The timeout passed and the process group was killed.
    pub timed_out: bool,
    pub duration_ms: u64,
}

impl ExitStatus {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// One thing an exec did, in the order the agent saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit(ExitStatus),
}

/// Everything an exec printed, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub status: ExitStatus,
}

type Route = mpsc::UnboundedSender<Frame<GuestMsg>>;

/// Which call waits for which id. `closed` makes new calls fail at once
/// after the connection ended, instead of waiting forever.
#[derive(Default)]
struct Routes {
    by_id: HashMap<CallId, Route>,
    closed: bool,
}

type SharedRoutes = Arc<Mutex<Routes>>;

fn lock(routes: &Mutex<Routes>) -> MutexGuard<'_, Routes> {
    // A panic elsewhere while holding the lock leaves the map consistent.
    routes
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The queue to the writer task.
struct Outbox {
    queue: mpsc::UnboundedSender<(Vec<u8>, Option<OwnedSemaphorePermit>)>,
    bulk_budget: Arc<Semaphore>,
}

impl Outbox {
    /// Queues a small frame; never waits, so it is usable from `Drop`.
    fn send(&self, frame: &Frame<HostMsg>) -> Result<(), AgentError> {
        self.queue
            .send((encode(frame), None))
            .map_err(|_| AgentError::Closed)
    }

    /// Queues a frame with a payload, waiting while too many bulk bytes are
    /// queued so a fast source cannot outrun the stream.
    async fn send_bulk(&self, frame: &Frame<HostMsg>) -> Result<(), AgentError> {
        let bytes = encode(frame);
        let permits = bytes.len().min(BULK_QUEUE_BYTES) as u32;
        let permit = self
            .bulk_budget
            .clone()
            .acquire_many_owned(permits)
            .await
            .map_err(|_| AgentError::Closed)?;
        self.queue
            .send((bytes, Some(permit)))
            .map_err(|_| AgentError::Closed)
    }
}

struct Inner {
    outbox: Outbox,
    routes: SharedRoutes,
    next_id: AtomicU64,
    reader: AbortHandle,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The writer ends by itself once the queue's last sender is gone.
        self.reader.abort();
    }
}

impl Inner {
    fn fresh_id(&self) -> CallId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers a route for a new id, then sends the call's first frame.
    fn start(self: &Arc<Self>, msg: HostMsg, payload: Vec<u8>) -> Result<Call, AgentError> {
        let id = self.fresh_id();
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let mut routes = lock(&self.routes);
            if routes.closed {
                return Err(AgentError::Closed);
            }
            routes.by_id.insert(id, tx);
        }
        let call = Call {
            id,
            rx,
            inner: self.clone(),
            finished: false,
            cancel_on_drop: false,
        };
        self.outbox.send(&Frame::with_payload(id, msg, payload))?;
        Ok(call)
    }
}

/// One call in flight: its id and the frames routed to it. Dropping it
/// removes the route (and, for streams, tells the agent to stop).
struct Call {
    id: CallId,
    rx: mpsc::UnboundedReceiver<Frame<GuestMsg>>,
    inner: Arc<Inner>,
    finished: bool,
    cancel_on_drop: bool,
}

impl Call {
    async fn recv(&mut self) -> Result<Frame<GuestMsg>, AgentError> {
        if self.finished {
            return Err(AgentError::Closed);
        }
        let frame = self.rx.recv().await.ok_or(AgentError::Closed)?;
        if frame.msg.is_terminal() {
            self.finished = true;
        }
        Ok(frame)
    }

    /// A frame that already arrived, without waiting.
    fn try_recv(&mut self) -> Result<Option<Frame<GuestMsg>>, AgentError> {
        match self.rx.try_recv() {
            Ok(frame) => {
                if frame.msg.is_terminal() {
                    self.finished = true;
                }
                Ok(Some(frame))
            }
            Err(mpsc::error::TryRecvError::Empty) => Ok(None),
            Err(mpsc::error::TryRecvError::Disconnected) => Err(AgentError::Closed),
        }
    }

    fn send(&self, msg: HostMsg) -> Result<(), AgentError> {
        self.inner.outbox.send(&Frame::new(self.id, msg))
    }

    async fn send_bulk(&self, msg: HostMsg, payload: Vec<u8>) -> Result<(), AgentError> {
        self.inner
            .outbox
            .send_bulk(&Frame::with_payload(self.id, msg, payload))
            .await
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        lock(&self.inner.routes).by_id.remove(&self.id);
        if self.cancel_on_drop && !self.finished {
            let _ = self.send(HostMsg::Cancel);
        }
    }
}

/// Returns stream credit to the agent in batches as the caller consumes.
#[derive(Default)]
struct CreditReturn {
    unreturned: u64,
}

impl CreditReturn {
    fn consumed(&mut self, call: &Call, bytes: usize) -> Result<(), AgentError> {
        self.unreturned += bytes as u64;
        if self.unreturned >= CREDIT_BATCH {
            call.send(HostMsg::Credit {
                bytes: self.unreturned,
            })?;
            self.unreturned = 0;
        }
        Ok(())
    }
}

fn guest_error(kind: ErrorKind, message: String) -> AgentError {
    AgentError::Guest { kind, message }
}

fn unexpected(msg: &GuestMsg) -> AgentError {
    AgentError::Protocol(format!("unexpected answer from the agent: {msg:?}"))
}

/// A connected agent. Cheap to clone; all clones share one connection.
#[derive(Clone)]
pub struct AgentClient {
    inner: Arc<Inner>,
    agent_version: Arc<str>,
    protocol: u32,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient")
            .field("agent_version", &self.agent_version)
            .finish_non_exhaustive()
    }
}

impl AgentClient {
    /// Starts serving the stream and shakes hands with the agent, waiting up
    /// to [`DEFAULT_HELLO_DEADLINE`] for it. Anything the agent sent before
    /// its `Hello` answer (a torn frame from before a snapshot, answers to a
    /// previous host) is discarded.
    pub async fn connect(stream: UnixStream) -> Result<Self, AgentError> {
        Self::connect_with_deadline(stream, DEFAULT_HELLO_DEADLINE).await
    }

    /// [`AgentClient::connect`] with an explicit handshake deadline.
    pub async fn connect_with_deadline(
        stream: UnixStream,
        deadline: Duration,
    ) -> Result<Self, AgentError> {
        let (read_half, write_half) = stream.into_split();
        let routes: SharedRoutes = Arc::default();
        let (queue, queue_rx) = mpsc::unbounded_channel();
        tokio::spawn(write_loop(write_half, queue_rx, routes.clone()));
        let reader = tokio::spawn(read_loop(read_half, routes.clone())).abort_handle();
        let inner = Arc::new(Inner {
            outbox: Outbox {
                queue,
                bulk_budget: Arc::new(Semaphore::new(BULK_QUEUE_BYTES)),
            },
            routes,
            next_id: AtomicU64::new(first_call_id()),
            reader,
        });
        let (protocol, agent_version) = handshake(&inner, deadline).await?;
        Ok(AgentClient {
            inner,
            agent_version: agent_version.into(),
            protocol,
        })
    }

    /// The protocol version the agent speaks, from its `Hello`.
    pub fn protocol(&self) -> u32 {
        self.protocol
    }

    /// The agent's crate version, from its `Hello`.
    pub fn agent_version(&self) -> &str {
        &self.agent_version
    }

    /// Whether the connection has ended (every call now fails with `Closed`).
    pub fn is_closed(&self) -> bool {
        lock(&self.inner.routes).closed
    }

    /// Sends one message and waits for its single answer.
    async fn request(&self, msg: HostMsg, payload: Vec<u8>) -> Result<GuestMsg, AgentError> {
        let mut call = self.inner.start(msg, payload)?;
        match call.recv().await?.msg {
            GuestMsg::Error { kind, message } => Err(guest_error(kind, message)),
            other => Ok(other),
        }
    }

    async fn request_done(&self, msg: HostMsg) -> Result<(), AgentError> {
        match self.request(msg, Vec::new()).await? {
            GuestMsg::Done => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn ping(&self) -> Result<(), AgentError> {
        match self.request(HostMsg::Ping, Vec::new()).await? {
            GuestMsg::Pong => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Gives the guest its hostname, wall clock and fresh entropy (at most
    /// [`MAX_CHUNK`] bytes), and makes its RNG reseed.
    pub async fn identity(
        &self,
        hostname: &str,
        unix_time_ns: u64,
        entropy: &[u8],
    ) -> Result<(), AgentError> {
        if entropy.len() > MAX_CHUNK {
            return Err(AgentError::Protocol(format!(
                "entropy of {} bytes exceeds the frame limit of {MAX_CHUNK}",
                entropy.len()
            )));
        }
        let msg = HostMsg::Identity {
            hostname: hostname.to_owned(),
            unix_time_ns,
        };
        match self.request(msg, entropy.to_vec()).await? {
            GuestMsg::Done => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Starts a command and returns once the guest process runs.
    pub async fn exec(&self, req: ExecRequest) -> Result<ExecHandle, AgentError> {
        let msg = HostMsg::Exec {
            cmd: req.cmd,
            env: req.env,
            cwd: req.cwd,
            timeout_ms: req
                .timeout
                .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
            pty: req.pty,
            stdin: req.stdin,
        };
        let mut call = self.inner.start(msg, Vec::new())?;
        call.cancel_on_drop = true;
        let frame = call.recv().await?;
        match frame.msg {
            GuestMsg::Started { pid } => Ok(ExecHandle {
                call,
                pid,
                credit: CreditReturn::default(),
            }),
            GuestMsg::Error { kind, message } => Err(guest_error(kind, message)),
            other => Err(unexpected(&other)),
        }
    }

    /// Runs a command to its end and collects all its output in memory.
    pub async fn exec_collect(&self, req: ExecRequest) -> Result<ExecOutput, AgentError> {
        let mut handle = self.exec(req).await?;
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        loop {
            match handle.next_event().await? {
                ExecEvent::Stdout(chunk) => stdout.extend_from_slice(&chunk),
                ExecEvent::Stderr(chunk) => stderr.extend_from_slice(&chunk),
                ExecEvent::Exit(status) => {
                    return Ok(ExecOutput {
                        stdout,
                        stderr,
                        status,
                    })
                }
            }
        }
    }

    /// Opens a guest file for streaming download.
    pub async fn read_file(&self, path: &str) -> Result<FileDownload, AgentError> {
        let msg = HostMsg::ReadFile {
            path: path.to_owned(),
        };
        let mut call = self.inner.start(msg, Vec::new())?;
        call.cancel_on_drop = true;
        match call.recv().await?.msg {
            GuestMsg::FileInfo { size } => Ok(FileDownload {
                call,
                size,
                credit: CreditReturn::default(),
            }),
            GuestMsg::Error { kind, message } => Err(guest_error(kind, message)),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads a whole guest file into memory.
    pub async fn read_file_to_vec(&self, path: &str) -> Result<Vec<u8>, AgentError> {
        let mut download = self.read_file(path).await?;
        let mut out =
            Vec::with_capacity(usize::try_from(download.size()).unwrap_or(0).min(1 << 26));
        while let Some(chunk) = download.next_chunk().await? {
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    }

    /// Creates or truncates a guest file (and its parents) with `mode`
    /// (default 0644) and streams `data` into it. Returns the bytes written.
    pub async fn write_file<R: AsyncRead + Unpin>(
        &self,
        path: &str,
        mode: Option<u32>,
        mut data: R,
    ) -> Result<u64, AgentError> {
        let msg = HostMsg::WriteFile {
            path: path.to_owned(),
            mode,
        };
        let mut call = self.inner.start(msg, Vec::new())?;
        call.cancel_on_drop = true;
        let mut total = 0u64;
        let mut chunk = vec![0u8; MAX_CHUNK];
        loop {
            // The agent answers at once when it cannot create the file.
            if let Some(frame) = call.try_recv()? {
                return Err(upload_answer(frame.msg));
            }
            let filled = read_up_to(&mut data, &mut chunk).await?;
            if filled == 0 {
                break;
            }
            // An answer now can only be the agent's refusal; take it even
            // while waiting for queue space, which a stalled channel would
            // never give.
            let frame = Frame::with_payload(call.id, HostMsg::Data, chunk[..filled].to_vec());
            let inner = call.inner.clone();
            tokio::select! {
                sent = inner.outbox.send_bulk(&frame) => sent?,
                answer = call.rx.recv() => {
                    call.finished = true;
                    return Err(answer.map_or(AgentError::Closed, |f| upload_answer(f.msg)));
                }
            }
            total += filled as u64;
        }
        call.send(HostMsg::End)?;
        match call.recv().await?.msg {
            GuestMsg::Done => Ok(total),
            other => Err(upload_answer(other)),
        }
    }

    /// Lists a directory, sorted by name.
    pub async fn list_dir(&self, path: &str) -> Result<Vec<FileStat>, AgentError> {
        let msg = HostMsg::ListDir {
            path: path.to_owned(),
        };
        match self.request(msg, Vec::new()).await? {
            GuestMsg::DirEntries { entries } => Ok(entries),
            other => Err(unexpected(&other)),
        }
    }

    /// Stats a path without following a final symlink.
    pub async fn stat(&self, path: &str) -> Result<FileStat, AgentError> {
        let msg = HostMsg::Stat {
            path: path.to_owned(),
        };
        match self.request(msg, Vec::new()).await? {
            GuestMsg::Stat(stat) => Ok(stat),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn remove(&self, path: &str, recursive: bool) -> Result<(), AgentError> {
        self.request_done(HostMsg::Remove {
            path: path.to_owned(),
            recursive,
        })
        .await
    }

    /// Creates a directory and its parents.
    pub async fn make_dir(&self, path: &str) -> Result<(), AgentError> {
        self.request_done(HostMsg::MakeDir {
            path: path.to_owned(),
        })
        .await
    }

    /// Lets the agent's background work settle and flushes the guest's
    /// filesystems: what a snapshot needs first.
    pub async fn sync(&self) -> Result<(), AgentError> {
        self.request_done(HostMsg::Sync).await
    }

    /// Lets the agent's background work settle. An agent older than
    /// protocol 2 has no such call and is not asked.
    pub async fn settle(&self) -> Result<(), AgentError> {
        if self.protocol < 2 {
            return Ok(());
        }
        self.request_done(HostMsg::Settle).await
    }
}

fn upload_answer(msg: GuestMsg) -> AgentError {
    match msg {
        GuestMsg::Error { kind, message } => guest_error(kind, message),
        other => unexpected(&other),
    }
}

/// Fills `buf` as far as the source allows, so uploads go in whole chunks.
async fn read_up_to<R: AsyncRead + Unpin>(
    source: &mut R,
    buf: &mut [u8],
) -> Result<usize, AgentError> {
    let mut filled = 0;
    while filled < buf.len() {
        let n = source.read(&mut buf[filled..]).await?;
        if n == 0 {
            break;
        }
        filled += n;
    }
    Ok(filled)
}

/// Ids start at a time-derived base so a new host connection does not
/// reuse the ids of calls a previous one left running in the guest.
fn first_call_id() -> CallId {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    // Kept below 2^53 so the ids survive any JSON tooling exactly.
    (nanos & ((1 << 52) - 1)) | 1
}

/// Shakes hands; the agent's protocol version and crate version.
async fn handshake(inner: &Arc<Inner>, deadline: Duration) -> Result<(u32, String), AgentError> {
    let give_up = tokio::time::Instant::now() + deadline;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut hello_ids = Vec::new();
    let answer = loop {
        let id = inner.fresh_id();
        {
            let mut routes = lock(&inner.routes);
            if routes.closed {
                return Err(AgentError::Closed);
            }
            routes.by_id.insert(id, tx.clone());
        }
        hello_ids.push(id);
        inner.outbox.send(&Frame::new(
            id,
            HostMsg::Hello {
                protocol: PROTOCOL_VERSION,
            },
        ))?;
        let retry_at = (tokio::time::Instant::now() + HELLO_RETRY).min(give_up);
        let waited = tokio::time::timeout_at(retry_at, async {
            loop {
                match rx.recv().await {
                    Some(Frame {
                        msg:
                            GuestMsg::Hello {
                                protocol,
                                agent_version,
                            },
                        ..
                    }) => return Some((protocol, agent_version)),
                    // A stale answer under a colliding id: keep waiting.
                    Some(_) => continue,
                    None => return None,
                }
            }
        })
        .await;
        match waited {
            Ok(Some(answer)) => break answer,
            Ok(None) => return Err(AgentError::Closed),
            Err(_) if retry_at >= give_up => {
                remove_routes(inner, &hello_ids);
                return Err(if lock(&inner.routes).closed {
                    AgentError::Closed
                } else {
                    AgentError::Timeout
                });
            }
            Err(_) => continue,
        }
    };
    remove_routes(inner, &hello_ids);
    let (protocol, agent_version) = answer;
    if !(OLDEST_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&protocol) {
        return Err(AgentError::Protocol(format!(
            "agent {agent_version} speaks protocol {protocol}, this host speaks \
             {OLDEST_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"
        )));
    }
    Ok((protocol, agent_version))
}

fn remove_routes(inner: &Inner, ids: &[CallId]) {
    let mut routes = lock(&inner.routes);
    for id in ids {
        routes.by_id.remove(id);
    }
}

async fn read_loop(read_half: OwnedReadHalf, routes: SharedRoutes) {
    let mut reader = BufReader::with_capacity(2 * MAX_CHUNK, read_half);
    loop {
        match asynchronous::read_frame::<GuestMsg, _>(&mut reader).await {
            Ok(frame) => route(&routes, frame),
            // The reader resyncs on the next magic; one bad frame is not fatal.
            Err(
                ProtoError::BadHeader(_)
                | ProtoError::HeaderTooLarge(_)
                | ProtoError::PayloadTooLarge(_),
            ) => continue,
            Err(ProtoError::Closed | ProtoError::Io(_)) => break,
        }
    }
    close(&routes);
}

fn route(routes: &Mutex<Routes>, frame: Frame<GuestMsg>) {
    let mut routes = lock(routes);
    let id = frame.id;
    let terminal = frame.msg.is_terminal();
    if let Some(route) = routes.by_id.get(&id) {
        // After the terminal frame nothing more belongs to this id, so the
        // entry goes even if its owner has not dropped the call yet.
        if route.send(frame).is_err() || terminal {
            routes.by_id.remove(&id);
        }
    }
}

/// Ends every pending call with `Closed` (their channels close) and makes
/// new calls fail at once.
fn close(routes: &Mutex<Routes>) {
    let mut routes = lock(routes);
    routes.closed = true;
    routes.by_id.clear();
}

async fn write_loop(
    mut write_half: OwnedWriteHalf,
    mut queue: mpsc::UnboundedReceiver<(Vec<u8>, Option<OwnedSemaphorePermit>)>,
    routes: SharedRoutes,
) {
    while let Some((bytes, _permit)) = queue.recv().await {
        if write_half.write_all(&bytes).await.is_err() {
            close(&routes);
            return;
        }
    }
}

/// A running exec. Dropping it before `Exit` leaves the process running
/// but tells the agent to discard its output.
pub struct ExecHandle {
    call: Call,
    pid: u32,
    credit: CreditReturn,
}

impl std::fmt::Debug for ExecHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecHandle")
            .field("id", &self.call.id)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl ExecHandle {
    /// The guest pid of the shell, which is also its process group.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The next chunk of output, or the exit. After `Exit` it returns
    /// `Err(Closed)`.
    pub async fn next_event(&mut self) -> Result<ExecEvent, AgentError> {
        loop {
            let frame = self.call.recv().await?;
            match frame.msg {
                GuestMsg::Stdout => {
                    self.credit.consumed(&self.call, frame.payload.len())?;
                    return Ok(ExecEvent::Stdout(frame.payload));
                }
                GuestMsg::Stderr => {
                    self.credit.consumed(&self.call, frame.payload.len())?;
                    return Ok(ExecEvent::Stderr(frame.payload));
                }
                GuestMsg::Exit {
                    code,
                    signal,
                    timed_out,
                    duration_ms,
                } => {
                    return Ok(ExecEvent::Exit(ExitStatus {
                        code,
                        signal,
                        timed_out,
                        duration_ms,
                    }))
                }
                GuestMsg::Error { kind, message } => return Err(guest_error(kind, message)),
                other if other.is_terminal() => return Err(unexpected(&other)),
                // Nothing else belongs to a running exec; skip it.
                _ => continue,
            }
        }
    }

    /// Feeds the process's stdin; `eof` closes it after `data` (on a PTY it
    /// sends ^D instead, which ends input at the start of a line).
    pub async fn send_stdin(&self, data: &[u8], eof: bool) -> Result<(), AgentError> {
        let mut chunks = data.chunks(MAX_CHUNK).peekable();
        if chunks.peek().is_none() {
            return self
                .call
                .send_bulk(HostMsg::Stdin { eof }, Vec::new())
                .await;
        }
        while let Some(chunk) = chunks.next() {
            let last = chunks.peek().is_none();
            self.call
                .send_bulk(HostMsg::Stdin { eof: eof && last }, chunk.to_vec())
                .await?;
        }
        Ok(())
    }

    /// Resizes the exec's PTY (ignored without one).
    pub async fn resize(&self, size: PtySize) -> Result<(), AgentError> {
        self.call.send(HostMsg::Resize(size))
    }

    /// Sends a signal to the exec's whole process group.
    pub async fn signal(&self, signal: i32) -> Result<(), AgentError> {
        self.call.send(HostMsg::Signal { signal })
    }
}

/// A guest file being streamed to the host.
pub struct FileDownload {
    call: Call,
    size: u64,
    credit: CreditReturn,
}

impl std::fmt::Debug for FileDownload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileDownload")
            .field("id", &self.call.id)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl FileDownload {
    /// The size the file had when opened (0 for many /proc files, which
    /// still have content).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The next chunk, or `None` at the end of the file.
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, AgentError> {
        if self.call.finished {
            return Ok(None);
        }
        loop {
            let frame = self.call.recv().await?;
            match frame.msg {
                GuestMsg::Data => {
                    self.credit.consumed(&self.call, frame.payload.len())?;
                    return Ok(Some(frame.payload));
                }
                GuestMsg::End => return Ok(None),
                GuestMsg::Error { kind, message } => return Err(guest_error(kind, message)),
                other if other.is_terminal() => return Err(unexpected(&other)),
                _ => continue,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// The agent's end of a socket pair, driven by hand.
    struct FakeAgent {
        stream: UnixStream,
    }

    impl FakeAgent {
        async fn recv(&mut self) -> Frame<HostMsg> {
            asynchronous::read_frame(&mut self.stream).await.unwrap()
        }

        async fn send(&mut self, id: CallId, msg: GuestMsg, payload: &[u8]) {
            let frame = Frame::with_payload(id, msg, payload.to_vec());
            self.stream.write_all(&encode(&frame)).await.unwrap();
        }

        /// Answers the client's Hello with `protocol`.
        async fn hello(&mut self, protocol: u32) {
            let hello = self.recv().await;
            assert!(matches!(hello.msg, HostMsg::Hello { .. }));
            let msg = GuestMsg::Hello {
                protocol,
                agent_version: "9.9.9".into(),
            };
            self.send(hello.id, msg, &[]).await;
        }
    }

    async fn connected() -> (AgentClient, FakeAgent) {
        let (host, guest) = UnixStream::pair().unwrap();
        let mut agent = FakeAgent { stream: guest };
        let (client, ()) = tokio::join!(AgentClient::connect(host), agent.hello(PROTOCOL_VERSION));
        (client.unwrap(), agent)
    }

    fn route_count(client: &AgentClient) -> usize {
        lock(&client.inner.routes).by_id.len()
    }

    #[tokio::test]
    async fn handshake_discards_what_came_before_the_hello() {
        let (host, guest) = UnixStream::pair().unwrap();
        let mut agent = FakeAgent { stream: guest };
        let fake = async {
            agent
                .stream
                .write_all(b"torn tail of an old frame")
                .await
                .unwrap();
            agent.send(12345, GuestMsg::Stdout, b"stale").await;
            agent.hello(PROTOCOL_VERSION).await;
        };
        let (client, ()) = tokio::join!(AgentClient::connect(host), fake);
        let client = client.unwrap();
        assert_eq!(client.agent_version(), "9.9.9");
        assert_eq!(route_count(&client), 0);
    }

    #[tokio::test]
    async fn another_protocol_version_is_refused() {
        let (host, guest) = UnixStream::pair().unwrap();
        let mut agent = FakeAgent { stream: guest };
        let (client, ()) = tokio::join!(
            AgentClient::connect(host),
            agent.hello(PROTOCOL_VERSION + 1)
        );
        assert!(matches!(client, Err(AgentError::Protocol(_))));
    }

    #[tokio::test]
    async fn an_agent_of_the_oldest_protocol_is_served_and_not_asked_to_settle() {
        let (host, guest) = UnixStream::pair().unwrap();
        let mut agent = FakeAgent { stream: guest };
        let (client, ()) = tokio::join!(
            AgentClient::connect(host),
            agent.hello(OLDEST_PROTOCOL_VERSION)
        );
        let client = client.unwrap();
        assert_eq!(client.protocol(), OLDEST_PROTOCOL_VERSION);
        // Answered at once, without a frame the old agent could not read.
        tokio::time::timeout(Duration::from_secs(1), client.settle())
            .await
            .expect("settle does not wait for an old agent")
            .unwrap();
        // The next frame the agent sees is the ping sent after it.
        let ping = tokio::spawn({
            let client = client.clone();
            async move { client.ping().await }
        });
        let next = agent.recv().await;
        assert!(matches!(next.msg, HostMsg::Ping), "{:?}", next.msg);
        agent.send(next.id, GuestMsg::Pong, b"").await;
        ping.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_silent_agent_times_out_after_repeated_hellos() {
        let (host, guest) = UnixStream::pair().unwrap();
        let mut agent = FakeAgent { stream: guest };
        let result = AgentClient::connect_with_deadline(host, Duration::from_millis(1200)).await;
        assert!(matches!(result, Err(AgentError::Timeout)), "{result:?}");
        // The Hello was repeated rather than sent once.
        agent.recv().await;
        agent.recv().await;
    }

    #[tokio::test]
    async fn pending_and_later_calls_fail_with_closed() {
        let (client, mut agent) = connected().await;
        let pending = tokio::spawn({
            let client = client.clone();
            async move { client.ping().await }
        });
        agent.recv().await;
        drop(agent);
        assert!(matches!(pending.await.unwrap(), Err(AgentError::Closed)));
        assert!(matches!(client.ping().await, Err(AgentError::Closed)));
        assert!(client.is_closed());
    }

    #[tokio::test]
    async fn guest_errors_carry_kind_and_message() {
        let (client, mut agent) = connected().await;
        let fake = async {
            let call = agent.recv().await;
            let msg = GuestMsg::Error {
                kind: ErrorKind::NotFound,
                message: "no such file or directory: /nope".into(),
            };
            agent.send(call.id, msg, &[]).await;
        };
        let (result, ()) = tokio::join!(client.stat("/nope"), fake);
        let err = result.unwrap_err();
        assert_eq!(err.guest_kind(), Some(ErrorKind::NotFound));
        assert_eq!(err.to_string(), "no such file or directory: /nope");
    }

    #[tokio::test]
    async fn exec_streams_return_credit_and_dropping_cancels() {
        let (client, mut agent) = connected().await;
        let fake = async {
            let call = agent.recv().await;
            agent
                .send(call.id, GuestMsg::Started { pid: 42 }, &[])
                .await;
            call.id
        };
        let (handle, id) = tokio::join!(client.exec(ExecRequest::new("yes")), fake);
        let mut handle = handle.unwrap();
        assert_eq!(handle.pid(), 42);
        let chunk = vec![b'y'; MAX_CHUNK];
        let chunks = (CREDIT_BATCH as usize).div_ceil(MAX_CHUNK);
        for _ in 0..chunks {
            agent.send(id, GuestMsg::Stdout, &chunk).await;
        }
        for _ in 0..chunks {
            assert_eq!(
                handle.next_event().await.unwrap(),
                ExecEvent::Stdout(chunk.clone())
            );
        }
        let credit = agent.recv().await;
        assert_eq!(credit.id, id);
        assert_eq!(
            credit.msg,
            HostMsg::Credit {
                bytes: (chunks * MAX_CHUNK) as u64
            }
        );
        assert_eq!(route_count(&client), 1);
        drop(handle);
        assert_eq!(route_count(&client), 0);
        let cancel = agent.recv().await;
        assert_eq!((cancel.id, cancel.msg), (id, HostMsg::Cancel));
    }

    #[tokio::test]
    async fn upload_stops_at_the_agents_error() {
        let (client, mut agent) = connected().await;
        let fake = async {
            let call = agent.recv().await;
            let msg = GuestMsg::Error {
                kind: ErrorKind::ReadOnly,
                message: "read-only file system: /ro/x".into(),
            };
            agent.send(call.id, msg, &[]).await;
        };
        let data = vec![0u8; 64 * MAX_CHUNK];
        let (result, ()) = tokio::join!(client.write_file("/ro/x", None, &data[..]), fake);
        assert_eq!(result.unwrap_err().guest_kind(), Some(ErrorKind::ReadOnly));
        assert_eq!(route_count(&client), 0);
    }
}
