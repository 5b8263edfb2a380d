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
//! frame by id to the per-call inbox (frames for ids nobody waits for are
//! dropped), and a writer that owns the write half. Every frame is queued to
//! that writer whole, so frames never interleave and a caller that gives up
//! half-way (a dropped future) can never leave half a frame on the stream.
//!
//! The agent is untrusted (a tenant is root in its VM and can replace it), so
//! nothing it sends is buffered without a bound. A call's inbox holds at most
//! [`STREAM_WINDOW`] bytes of stream payload: the credit the host granted and
//! has not had returned. An agent that sends past that credit broke the
//! protocol on purpose or by a bug, and the host drops the whole connection
//! (every call fails, [`AgentClient::broken`] says why) rather than buffer
//! it. Other frames are bounded by count ([`MAX_QUEUED_FRAMES`], small
//! consecutive chunks of one stream are merged first); past it only that call
//! fails. Whole-output helpers ([`AgentClient::exec_collect`],
//! [`AgentClient::read_file_to_vec`]) keep at most a limit in memory.

use crate::{
    asynchronous, encode, CallId, ErrorKind, FileStat, Frame, GuestMsg, HostMsg, ProtoError,
    PtySize, MAX_CHUNK, OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION, STREAM_WINDOW,
};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
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

/// Frames one call may have queued and not yet taken. An honest agent sends
/// a call at most two frames besides its stream, and stream chunks of one
/// kind merge in the inbox, so only a stalled caller of an exec whose output
/// alternates stdout and stderr in tiny writes comes near it; past it that
/// call fails (the connection stays).
pub const MAX_QUEUED_FRAMES: usize = 16 * 1024;

/// What [`AgentClient::exec_collect`] and [`AgentClient::read_file_to_vec`]
/// keep in memory per stream or file unless `SHOAL_EXEC_OUTPUT_LIMIT` (bytes)
/// says otherwise.
pub const DEFAULT_OUTPUT_LIMIT: usize = 16 << 20;

/// The per-stream limit of the whole-output helpers: `SHOAL_EXEC_OUTPUT_LIMIT`
/// (a byte count, read once) or [`DEFAULT_OUTPUT_LIMIT`].
pub fn output_limit() -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::env::var("SHOAL_EXEC_OUTPUT_LIMIT")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(DEFAULT_OUTPUT_LIMIT)
    })
}

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
    /// What the agent sent is more than the caller keeps in memory.
    #[error("more than {limit} bytes")]
    TooLarge { limit: usize },
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
    /// At the timeout, SIGTERM first and SIGKILL this long after (Slurm's
    /// KillWait); `None`: SIGKILL at once.
    pub kill_grace: Option<Duration>,
    /// This signal, this long before the timeout (Slurm's `--signal`).
    pub warn_signal: Option<(i32, Duration)>,
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
    /// Peak memory and CPU time, when the agent reports them.
    pub usage: Option<crate::ProcessUsage>,
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

/// What an exec printed (each stream up to a limit, from its start), and
/// how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub status: ExitStatus,
    /// The command printed more on stdout than was kept.
    pub stdout_truncated: bool,
    /// The command printed more on stderr than was kept.
    pub stderr_truncated: bool,
}

/// The first `limit` bytes of a stream; the rest is counted and dropped.
struct Capped {
    bytes: Vec<u8>,
    limit: usize,
    truncated: bool,
}

impl Capped {
    fn new(limit: usize) -> Self {
        Capped {
            bytes: Vec::new(),
            limit,
            truncated: false,
        }
    }

    fn push(&mut self, chunk: &[u8]) {
        let room = self.limit - self.bytes.len();
        let take = chunk.len().min(room);
        if take < chunk.len() {
            self.truncated = true;
        }
        if take == 0 {
            return;
        }
        let needed = self.bytes.len() + take;
        if needed > self.bytes.capacity() {
            // Doubling as usual, but never past the limit.
            let target = needed.max(self.bytes.capacity() * 2).min(self.limit);
            self.bytes.reserve_exact(target - self.bytes.len());
        }
        self.bytes.extend_from_slice(&chunk[..take]);
    }
}

/// Why the reader refused a frame.
enum Refused {
    /// The agent sent stream payload past the credit it was granted: the
    /// connection goes.
    Credit(String),
    /// The call's queue is full: that call fails.
    Full,
}

/// The frames routed to one call and not yet taken, bounded (see the
/// module doc). Only the call's owner takes from it.
#[derive(Default)]
struct Inbox {
    state: Mutex<InboxState>,
    ready: Notify,
    /// Stays open after a terminal frame: the handshake's, shared by every
    /// `Hello` it sent, where a stale answer must not end the wait.
    shared: bool,
}

#[derive(Default)]
struct InboxState {
    frames: VecDeque<Frame<GuestMsg>>,
    /// Nothing more will come: the call ended or the connection closed.
    closed: bool,
    /// The call failed on the host's side (its queue overflowed).
    failed: Option<String>,
    /// Stream payload received and not yet credited back.
    unacked: u64,
}

fn stream_kind(msg: &GuestMsg) -> bool {
    matches!(msg, GuestMsg::Stdout | GuestMsg::Stderr | GuestMsg::Data)
}

impl Inbox {
    fn state(&self) -> MutexGuard<'_, InboxState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a frame from the reader.
    fn push(&self, frame: Frame<GuestMsg>) -> Result<(), Refused> {
        let mut state = self.state();
        if state.closed || state.failed.is_some() {
            return Ok(());
        }
        if stream_kind(&frame.msg) {
            state.unacked += frame.payload.len() as u64;
            if state.unacked > STREAM_WINDOW {
                return Err(Refused::Credit(format!(
                    "the agent sent {} bytes of call {}'s stream past the {STREAM_WINDOW} \
                     bytes of credit it had",
                    state.unacked - STREAM_WINDOW,
                    frame.id
                )));
            }
            if let Some(back) = state.frames.back_mut() {
                if back.msg == frame.msg && back.payload.len() + frame.payload.len() <= MAX_CHUNK {
                    back.payload.extend_from_slice(&frame.payload);
                    self.ready.notify_one();
                    return Ok(());
                }
            }
        }
        if state.frames.len() >= MAX_QUEUED_FRAMES {
            state.frames = VecDeque::new();
            state.failed = Some(format!(
                "the agent queued more than {MAX_QUEUED_FRAMES} frames for one call"
            ));
            self.ready.notify_one();
            return Err(Refused::Full);
        }
        if frame.msg.is_terminal() && !self.shared {
            state.closed = true;
        }
        state.frames.push_back(frame);
        self.ready.notify_one();
        Ok(())
    }

    fn close(&self) {
        self.state().closed = true;
        self.ready.notify_one();
    }

    /// Credit for `bytes` goes back to the agent: called before the
    /// `Credit` frame is queued, so the agent can never be ahead of it.
    fn credited(&self, bytes: u64) {
        let mut state = self.state();
        state.unacked = state.unacked.saturating_sub(bytes);
    }

    /// The next frame; `None` once nothing more will come.
    async fn recv(&self) -> Option<Result<Frame<GuestMsg>, AgentError>> {
        loop {
            {
                let mut state = self.state();
                if let Some(frame) = state.frames.pop_front() {
                    return Some(Ok(frame));
                }
                if let Some(why) = &state.failed {
                    return Some(Err(AgentError::Protocol(why.clone())));
                }
                if state.closed {
                    return None;
                }
            }
            // A notification between the check and here is kept as a permit.
            self.ready.notified().await;
        }
    }

    fn try_recv(&self) -> Option<Result<Frame<GuestMsg>, AgentError>> {
        let mut state = self.state();
        if let Some(frame) = state.frames.pop_front() {
            return Some(Ok(frame));
        }
        if let Some(why) = &state.failed {
            return Some(Err(AgentError::Protocol(why.clone())));
        }
        None
    }

    fn is_closed(&self) -> bool {
        let state = self.state();
        state.frames.is_empty() && state.closed
    }
}

type Route = Arc<Inbox>;

/// Which call waits for which id. `closed` makes new calls fail at once
/// after the connection ended, instead of waiting forever; `broken` says why
/// the host dropped an agent that broke the protocol.
#[derive(Default)]
struct Routes {
    by_id: HashMap<CallId, Route>,
    closed: bool,
    broken: Option<String>,
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
    /// Why calls end now that the connection has: `Closed`, or a protocol
    /// error naming what the agent broke.
    fn closed_error(&self) -> AgentError {
        match &lock(&self.routes).broken {
            Some(why) => AgentError::Protocol(why.clone()),
            None => AgentError::Closed,
        }
    }

    fn fresh_id(&self) -> CallId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers a route for a new id, then sends the call's first frame.
    fn start(self: &Arc<Self>, msg: HostMsg, payload: Vec<u8>) -> Result<Call, AgentError> {
        let id = self.fresh_id();
        let inbox = Arc::new(Inbox::default());
        {
            let mut routes = lock(&self.routes);
            if routes.closed {
                return Err(match &routes.broken {
                    Some(why) => AgentError::Protocol(why.clone()),
                    None => AgentError::Closed,
                });
            }
            routes.by_id.insert(id, inbox.clone());
        }
        let call = Call {
            id,
            inbox,
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
    inbox: Arc<Inbox>,
    inner: Arc<Inner>,
    finished: bool,
    cancel_on_drop: bool,
}

impl Call {
    async fn recv(&mut self) -> Result<Frame<GuestMsg>, AgentError> {
        if self.finished {
            return Err(AgentError::Closed);
        }
        let frame = match self.inbox.recv().await {
            Some(frame) => frame?,
            None => return Err(self.inner.closed_error()),
        };
        if frame.msg.is_terminal() {
            self.finished = true;
        }
        Ok(frame)
    }

    /// A frame that already arrived, without waiting.
    fn try_recv(&mut self) -> Result<Option<Frame<GuestMsg>>, AgentError> {
        match self.inbox.try_recv() {
            Some(frame) => {
                let frame = frame?;
                if frame.msg.is_terminal() {
                    self.finished = true;
                }
                Ok(Some(frame))
            }
            None if self.inbox.is_closed() => Err(self.inner.closed_error()),
            None => Ok(None),
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
            call.inbox.credited(self.unreturned);
            call.send(HostMsg::Credit {
                bytes: self.unreturned,
            })
            .map_err(|_| call.inner.closed_error())?;
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
        let reader_gone = Arc::new(Notify::new());
        tokio::spawn(write_loop(
            write_half,
            queue_rx,
            routes.clone(),
            reader_gone.clone(),
        ));
        let reader = tokio::spawn(read_loop(read_half, routes.clone(), reader_gone)).abort_handle();
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

    /// Whether the connection has ended (every call now fails with `Closed`,
    /// or with a protocol error when the agent broke the protocol).
    pub fn is_closed(&self) -> bool {
        lock(&self.inner.routes).closed
    }

    /// Why the host dropped this connection, when the agent broke the
    /// protocol (stream payload past its credit).
    pub fn broken(&self) -> Option<String> {
        lock(&self.inner.routes).broken.clone()
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
            kill_grace_ms: req
                .kill_grace
                .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
            warn_signal: req.warn_signal.map(|(signal, before)| crate::WarnSignal {
                signal,
                before_ms: u64::try_from(before.as_millis()).unwrap_or(u64::MAX),
            }),
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

    /// Runs a command to its end and collects its output in memory, at most
    /// [`output_limit`] bytes of each stream (the rest is read and dropped,
    /// so the command ends as usual; the output says it was truncated).
    pub async fn exec_collect(&self, req: ExecRequest) -> Result<ExecOutput, AgentError> {
        self.exec_collect_limited(req, output_limit()).await
    }

    /// [`AgentClient::exec_collect`] keeping at most `limit` bytes of each
    /// stream.
    pub async fn exec_collect_limited(
        &self,
        req: ExecRequest,
        limit: usize,
    ) -> Result<ExecOutput, AgentError> {
        let mut handle = self.exec(req).await?;
        let mut stdout = Capped::new(limit);
        let mut stderr = Capped::new(limit);
        loop {
            match handle.next_event().await? {
                ExecEvent::Stdout(chunk) => stdout.push(&chunk),
                ExecEvent::Stderr(chunk) => stderr.push(&chunk),
                ExecEvent::Exit(status) => {
                    return Ok(ExecOutput {
                        stdout: stdout.bytes,
                        stderr: stderr.bytes,
                        status,
                        stdout_truncated: stdout.truncated,
                        stderr_truncated: stderr.truncated,
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

    /// Reads a whole guest file into memory; a file of more than
    /// [`output_limit`] bytes is [`AgentError::TooLarge`].
    pub async fn read_file_to_vec(&self, path: &str) -> Result<Vec<u8>, AgentError> {
        self.read_file_to_vec_limited(path, output_limit()).await
    }

    /// Reads a whole guest file of at most `limit` bytes into memory; a
    /// longer one (whatever size the agent announced) stops the download
    /// with [`AgentError::TooLarge`].
    pub async fn read_file_to_vec_limited(
        &self,
        path: &str,
        limit: usize,
    ) -> Result<Vec<u8>, AgentError> {
        let mut download = self.read_file(path).await?;
        if download.size() > limit as u64 {
            return Err(AgentError::TooLarge { limit });
        }
        let mut out = Capped::new(limit);
        out.bytes.reserve_exact(download.size() as usize);
        while let Some(chunk) = download.next_chunk().await? {
            out.push(&chunk);
            if out.truncated {
                return Err(AgentError::TooLarge { limit });
            }
        }
        Ok(out.bytes)
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
            let inbox = call.inbox.clone();
            tokio::select! {
                sent = inner.outbox.send_bulk(&frame) => sent?,
                answer = inbox.recv() => {
                    call.finished = true;
                    return Err(match answer {
                        Some(Ok(frame)) => upload_answer(frame.msg),
                        Some(Err(e)) => e,
                        None => inner.closed_error(),
                    });
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
    // One inbox for every Hello sent: the first answer to any of them counts.
    let inbox = Arc::new(Inbox {
        shared: true,
        ..Inbox::default()
    });
    let mut hello_ids = Vec::new();
    let answer = loop {
        let id = inner.fresh_id();
        {
            let mut routes = lock(&inner.routes);
            if routes.closed {
                return Err(AgentError::Closed);
            }
            routes.by_id.insert(id, inbox.clone());
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
                match inbox.recv().await {
                    Some(Ok(Frame {
                        msg:
                            GuestMsg::Hello {
                                protocol,
                                agent_version,
                            },
                        ..
                    })) => return Some((protocol, agent_version)),
                    // A stale answer under a colliding id: keep waiting.
                    Some(Ok(_)) => continue,
                    Some(Err(_)) | None => return None,
                }
            }
        })
        .await;
        match waited {
            Ok(Some(answer)) => break answer,
            Ok(None) => return Err(inner.closed_error()),
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

async fn read_loop(read_half: OwnedReadHalf, routes: SharedRoutes, gone: Arc<Notify>) {
    let mut reader = BufReader::with_capacity(2 * MAX_CHUNK, read_half);
    let broken = loop {
        match asynchronous::read_frame::<GuestMsg, _>(&mut reader).await {
            Ok(frame) => {
                if let Err(why) = route(&routes, frame) {
                    break Some(why);
                }
            }
            // The reader resyncs on the next magic; one bad frame is not fatal.
            Err(
                ProtoError::BadHeader(_)
                | ProtoError::HeaderTooLarge(_)
                | ProtoError::PayloadTooLarge(_),
            ) => continue,
            Err(ProtoError::Closed | ProtoError::Io(_)) => break None,
        }
    };
    if let Some(why) = broken {
        lock(&routes).broken = Some(why);
    }
    close(&routes);
    // The writer drops its half too, so the socket closes and the agent
    // (or QEMU's chardev) sees the host hang up.
    gone.notify_one();
}

/// Hands a frame to the call that waits for it. `Err` when the agent broke
/// the flow-control contract and the connection must go.
fn route(routes: &Mutex<Routes>, frame: Frame<GuestMsg>) -> Result<(), String> {
    let mut routes = lock(routes);
    let id = frame.id;
    let terminal = frame.msg.is_terminal();
    if let Some(inbox) = routes.by_id.get(&id) {
        match inbox.push(frame) {
            // After the terminal frame nothing more belongs to this id, so
            // the entry goes even if its owner has not dropped the call yet
            // (the handshake's shared inbox removes its own).
            Ok(()) if terminal && !inbox.shared => {
                routes.by_id.remove(&id);
            }
            Ok(()) => {}
            Err(Refused::Full) => {
                routes.by_id.remove(&id);
            }
            Err(Refused::Credit(why)) => return Err(why),
        }
    }
    Ok(())
}

/// Ends every pending call (their inboxes close) and makes new calls fail
/// at once.
fn close(routes: &Mutex<Routes>) {
    let mut routes = lock(routes);
    routes.closed = true;
    for (_, inbox) in routes.by_id.drain() {
        inbox.close();
    }
}

async fn write_loop(
    mut write_half: OwnedWriteHalf,
    mut queue: mpsc::UnboundedReceiver<(Vec<u8>, Option<OwnedSemaphorePermit>)>,
    routes: SharedRoutes,
    reader_gone: Arc<Notify>,
) {
    loop {
        let (bytes, _permit) = tokio::select! {
            next = queue.recv() => match next {
                Some(next) => next,
                None => return,
            },
            () = reader_gone.notified() => return,
        };
        // An agent that stops reading must not keep the writer (and the
        // socket) alive after the reader gave up on it.
        let written = tokio::select! {
            written = write_half.write_all(&bytes) => written,
            () = reader_gone.notified() => return,
        };
        if written.is_err() {
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

/// The input side of an exec (stdin, resize, signals), usable while
/// another task reads its events: a terminal bridge writes keystrokes as
/// the output streams.
#[derive(Clone)]
pub struct ExecInput {
    id: CallId,
    inner: Arc<Inner>,
}

impl ExecInput {
    /// [`ExecHandle::send_stdin`].
    pub async fn send_stdin(&self, data: &[u8], eof: bool) -> Result<(), AgentError> {
        for chunk in data.chunks(MAX_CHUNK) {
            self.inner
                .outbox
                .send_bulk(&Frame::with_payload(
                    self.id,
                    HostMsg::Stdin { eof: false },
                    chunk.to_vec(),
                ))
                .await?;
        }
        if eof {
            self.inner
                .outbox
                .send_bulk(&Frame::with_payload(
                    self.id,
                    HostMsg::Stdin { eof },
                    Vec::new(),
                ))
                .await?;
        }
        Ok(())
    }

    /// [`ExecHandle::resize`].
    pub fn resize(&self, size: PtySize) -> Result<(), AgentError> {
        self.inner
            .outbox
            .send(&Frame::new(self.id, HostMsg::Resize(size)))
    }

    /// [`ExecHandle::signal`].
    pub fn signal(&self, signal: i32) -> Result<(), AgentError> {
        self.inner
            .outbox
            .send(&Frame::new(self.id, HostMsg::Signal { signal }))
    }
}

impl ExecHandle {
    /// The guest pid of the shell, which is also its process group.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// A sender of this exec's input, for use beside [`Self::next_event`].
    pub fn input(&self) -> ExecInput {
        ExecInput {
            id: self.call.id,
            inner: self.call.inner.clone(),
        }
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
                    usage,
                } => {
                    return Ok(ExecEvent::Exit(ExitStatus {
                        code,
                        signal,
                        timed_out,
                        duration_ms,
                        usage,
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
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

    /// Starts an exec on the fake agent; its call id.
    async fn started(client: &AgentClient, agent: &mut FakeAgent) -> (ExecHandle, CallId) {
        let fake = async {
            let call = agent.recv().await;
            agent.send(call.id, GuestMsg::Started { pid: 7 }, &[]).await;
            call.id
        };
        let (handle, id) = tokio::join!(client.exec(ExecRequest::new("yes")), fake);
        (handle.unwrap(), id)
    }

    /// Sends `total` bytes of stdout under `id` as an honest agent would:
    /// never more than the credit it holds, waiting for `Credit` frames.
    async fn honest_stdout(agent: &mut FakeAgent, id: CallId, total: usize) {
        let mut credit = STREAM_WINDOW as usize;
        let mut sent = 0;
        let chunk = vec![b'a'; MAX_CHUNK];
        while sent < total {
            while credit == 0 {
                match agent.recv().await {
                    Frame {
                        msg: HostMsg::Credit { bytes },
                        id: got,
                        ..
                    } if got == id => credit += bytes as usize,
                    other => panic!("unexpected {other:?}"),
                }
            }
            let n = (total - sent).min(credit).min(MAX_CHUNK);
            agent.send(id, GuestMsg::Stdout, &chunk[..n]).await;
            credit -= n;
            sent += n;
        }
    }

    fn exited() -> GuestMsg {
        GuestMsg::Exit {
            code: Some(0),
            signal: None,
            timed_out: false,
            duration_ms: 1,
            usage: None,
        }
    }

    #[tokio::test]
    async fn an_agent_that_sends_past_its_credit_is_dropped() {
        let (client, mut agent) = connected().await;
        let (mut handle, id) = started(&client, &mut agent).await;
        // The whole window is allowed while the caller reads nothing ...
        let chunk = vec![b'x'; MAX_CHUNK];
        for _ in 0..STREAM_WINDOW as usize / MAX_CHUNK {
            agent.send(id, GuestMsg::Stdout, &chunk).await;
        }
        agent.send(id, GuestMsg::Stdout, b"").await;
        let ping = tokio::spawn({
            let client = client.clone();
            async move { client.ping().await }
        });
        let asked = agent.recv().await;
        agent.send(asked.id, GuestMsg::Pong, b"").await;
        ping.await.unwrap().unwrap();
        assert!(!client.is_closed());
        // ... one byte more is not.
        agent.send(id, GuestMsg::Stdout, b"!").await;
        let mut end = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), agent.stream.read_to_end(&mut end))
            .await
            .expect("the host hangs up");
        assert!(read.is_ok());
        assert!(client.is_closed());
        let why = client.broken().expect("the reason is kept");
        assert!(why.contains("credit"), "{why}");
        // What was queued before may still come, then the call fails.
        let mut got = 0;
        let err = loop {
            match handle.next_event().await {
                Ok(ExecEvent::Stdout(bytes)) => got += bytes.len(),
                Ok(other) => panic!("unexpected {other:?}"),
                Err(e) => break e,
            }
        };
        assert!(got <= STREAM_WINDOW as usize);
        assert!(
            matches!(&err, AgentError::Protocol(m) if m.contains("credit")),
            "{err:?}"
        );
        assert!(matches!(client.ping().await, Err(AgentError::Protocol(_))));
    }

    #[tokio::test]
    async fn returned_credit_lets_an_honest_agent_go_on() {
        let (client, mut agent) = connected().await;
        let (handle, id) = started(&client, &mut agent).await;
        let total = 5 * STREAM_WINDOW as usize + 123;
        let consumer = tokio::spawn(async move {
            let mut handle = handle;
            let mut got = 0;
            loop {
                match handle.next_event().await.unwrap() {
                    ExecEvent::Stdout(bytes) => got += bytes.len(),
                    ExecEvent::Exit(_) => return got,
                    other => panic!("unexpected {other:?}"),
                }
            }
        });
        honest_stdout(&mut agent, id, total).await;
        agent.send(id, exited(), b"").await;
        assert_eq!(consumer.await.unwrap(), total);
        assert!(client.broken().is_none());
    }

    #[tokio::test]
    async fn exec_collect_keeps_the_limit_and_drains_the_rest() {
        let (client, mut agent) = connected().await;
        let limit = 300_000;
        let total = 3 * STREAM_WINDOW as usize;
        let fake = async {
            let call = agent.recv().await;
            agent.send(call.id, GuestMsg::Started { pid: 7 }, &[]).await;
            agent.send(call.id, GuestMsg::Stderr, b"warning\n").await;
            honest_stdout(&mut agent, call.id, total).await;
            agent.send(call.id, exited(), b"").await;
        };
        let (out, ()) = tokio::join!(
            client.exec_collect_limited(ExecRequest::new("yes"), limit),
            fake
        );
        let out = out.unwrap();
        assert_eq!(out.stdout.len(), limit);
        assert!(out.stdout.capacity() <= limit);
        assert!(out.stdout_truncated);
        assert_eq!(out.stderr, b"warning\n");
        assert!(!out.stderr_truncated);
        assert!(out.status.success());
        assert_eq!(route_count(&client), 0);
    }

    #[tokio::test]
    async fn small_chunks_of_one_stream_merge_while_the_caller_waits() {
        let (client, mut agent) = connected().await;
        let (mut handle, id) = started(&client, &mut agent).await;
        for _ in 0..2 * MAX_QUEUED_FRAMES {
            agent.send(id, GuestMsg::Stdout, b"y").await;
        }
        agent.send(id, exited(), b"").await;
        let mut chunks = 0;
        let mut bytes = 0;
        loop {
            match handle.next_event().await.unwrap() {
                ExecEvent::Stdout(chunk) => {
                    chunks += 1;
                    bytes += chunk.len();
                }
                ExecEvent::Exit(_) => break,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(bytes, 2 * MAX_QUEUED_FRAMES);
        assert!(chunks < 2 * MAX_QUEUED_FRAMES / 100, "{chunks} chunks");
    }

    #[tokio::test]
    async fn too_many_queued_frames_fail_only_their_call() {
        let (client, mut agent) = connected().await;
        let (mut handle, id) = started(&client, &mut agent).await;
        for i in 0..=MAX_QUEUED_FRAMES {
            let msg = if i % 2 == 0 {
                GuestMsg::Stdout
            } else {
                GuestMsg::Stderr
            };
            agent.send(id, msg, b"z").await;
        }
        // The ping is answered after every frame above was read.
        let ping = tokio::spawn({
            let client = client.clone();
            async move { client.ping().await }
        });
        let asked = agent.recv().await;
        agent.send(asked.id, GuestMsg::Pong, b"").await;
        ping.await.unwrap().unwrap();
        let err = handle.next_event().await.unwrap_err();
        assert!(
            matches!(&err, AgentError::Protocol(m) if m.contains("frames")),
            "{err:?}"
        );
        assert!(!client.is_closed());
        drop(handle);
        let cancel = agent.recv().await;
        assert_eq!((cancel.id, cancel.msg), (id, HostMsg::Cancel));
    }

    #[tokio::test]
    async fn read_file_to_vec_refuses_more_than_its_limit() {
        let (client, mut agent) = connected().await;
        // Announced too large: refused before any data.
        let fake = async {
            let call = agent.recv().await;
            agent
                .send(call.id, GuestMsg::FileInfo { size: 1 << 40 }, &[])
                .await;
        };
        let (result, ()) = tokio::join!(client.read_file_to_vec_limited("/big", 1000), fake);
        assert!(matches!(result, Err(AgentError::TooLarge { limit: 1000 })));
        assert_eq!(agent.recv().await.msg, HostMsg::Cancel);
        // Announced small (as /proc files are), then longer.
        let fake = async {
            let call = agent.recv().await;
            agent
                .send(call.id, GuestMsg::FileInfo { size: 0 }, &[])
                .await;
            agent.send(call.id, GuestMsg::Data, &[1u8; 600]).await;
            agent.send(call.id, GuestMsg::Data, &[2u8; 600]).await;
            agent.send(call.id, GuestMsg::End, &[]).await;
        };
        let (result, ()) = tokio::join!(client.read_file_to_vec_limited("/proc/x", 1000), fake);
        assert!(matches!(result, Err(AgentError::TooLarge { limit: 1000 })));
        // Within the limit: whole.
        let fake = async {
            let call = agent.recv().await;
            if call.msg == HostMsg::Cancel {
                let call = agent.recv().await;
                agent
                    .send(call.id, GuestMsg::FileInfo { size: 3 }, &[])
                    .await;
                agent.send(call.id, GuestMsg::Data, b"abc").await;
                agent.send(call.id, GuestMsg::End, &[]).await;
                return;
            }
            agent
                .send(call.id, GuestMsg::FileInfo { size: 3 }, &[])
                .await;
            agent.send(call.id, GuestMsg::Data, b"abc").await;
            agent.send(call.id, GuestMsg::End, &[]).await;
        };
        let (result, ()) = tokio::join!(client.read_file_to_vec_limited("/small", 1000), fake);
        assert_eq!(result.unwrap(), b"abc");
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
