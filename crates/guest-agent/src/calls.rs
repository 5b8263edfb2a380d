//! State shared by the agent's threads: the one writer every frame goes
//! through, per-call flow-control credit, and the table of running calls
//! that routes the host's follow-up frames (stdin, credit, upload data).
//!
//! Does not own: what any call does (see `exec`, `files`), nor reading the
//! channel (see `main`).

use shoal_proto::{write_frame, CallId, Frame, GuestMsg, PtySize, STREAM_WINDOW};
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Locks a mutex, ignoring poisoning: a thread that panicked (a bug) must
/// not take the rest of the agent down with it, least of all as PID 1.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The write side of the channel. One lock, so frames never interleave.
pub struct Outbox {
    writer: Mutex<Box<dyn Write + Send>>,
}

impl Outbox {
    pub fn new(writer: Box<dyn Write + Send>) -> Self {
        Outbox {
            writer: Mutex::new(writer),
        }
    }

    /// Replaces the writer when the channel is reopened.
    pub fn replace(&self, writer: Box<dyn Write + Send>) {
        *lock(&self.writer) = writer;
    }

    pub fn send(&self, frame: Frame<GuestMsg>) {
        let mut writer = lock(&self.writer);
        write_or_log(&mut **writer, &frame);
    }

    /// Sends a frame of a call unless the host cancelled it. The check is
    /// made under the writer lock so that once a new host's `Hello` answer
    /// is written, no frame of an older call can follow it.
    pub fn send_on(&self, stream: &Stream, frame: Frame<GuestMsg>) {
        let mut writer = lock(&self.writer);
        if stream.is_cancelled() {
            return;
        }
        write_or_log(&mut **writer, &frame);
    }
}

fn write_or_log(mut writer: &mut dyn Write, frame: &Frame<GuestMsg>) {
    // A failed write means the host went away; the reader notices that too,
    // and the call's frames are of no use to the next host.
    if let Err(err) = write_frame(&mut writer, frame) {
        crate::log(&format!("writing a frame failed: {err}"));
    }
}

/// Flow-control credit and cancellation of one streaming call.
pub struct Stream {
    state: Mutex<StreamState>,
    changed: Condvar,
}

struct StreamState {
    credit: u64,
    cancelled: bool,
}

impl Stream {
    pub fn new() -> Arc<Self> {
        Arc::new(Stream {
            state: Mutex::new(StreamState {
                credit: STREAM_WINDOW,
                cancelled: false,
            }),
            changed: Condvar::new(),
        })
    }

    pub fn add_credit(&self, bytes: u64) {
        let mut state = lock(&self.state);
        state.credit = state.credit.saturating_add(bytes);
        self.changed.notify_all();
    }

    pub fn cancel(&self) {
        lock(&self.state).cancelled = true;
        self.changed.notify_all();
    }

    pub fn is_cancelled(&self) -> bool {
        lock(&self.state).cancelled
    }

    /// Waits until some credit is available (or `timeout` passes, giving
    /// 0) and returns how many bytes, up to `max`, may be sent now. A
    /// cancelled stream never waits: its output is read and dropped.
    pub fn wait_credit(&self, max: usize, timeout: Option<Duration>) -> usize {
        let give_up = timeout.map(|t| Instant::now() + t);
        let mut state = lock(&self.state);
        loop {
            if state.cancelled {
                return max;
            }
            if state.credit > 0 {
                return usize::try_from(state.credit).unwrap_or(usize::MAX).min(max);
            }
            state = match give_up {
                None => self
                    .changed
                    .wait(state)
                    .unwrap_or_else(|poisoned| poisoned.into_inner()),
                Some(give_up) => {
                    let left = give_up.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return 0;
                    }
                    self.changed
                        .wait_timeout(state, left)
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .0
                }
            };
        }
    }

    pub fn consume(&self, bytes: usize) {
        let mut state = lock(&self.state);
        state.credit = state.credit.saturating_sub(bytes as u64);
    }
}

/// Input to an exec's stdin: a chunk, and whether to close after it.
pub type StdinChunk = (Vec<u8>, bool);

/// What the main loop needs to steer a running exec.
pub struct ExecControl {
    pub stream: Arc<Stream>,
    /// The shell's pid, which is also its process group; 0 until started.
    pub pgid: AtomicI32,
    pub stdin: Mutex<Option<Sender<StdinChunk>>>,
    /// The PTY master, for resizing.
    pub pty: OnceLock<OwnedFd>,
}

impl ExecControl {
    pub fn send_stdin(&self, data: Vec<u8>, eof: bool) {
        let mut stdin = lock(&self.stdin);
        if let Some(sender) = stdin.as_ref() {
            if sender.send((data, eof)).is_err() || eof {
                // Nothing more may be written after eof.
                *stdin = None;
            }
        }
    }

    pub fn signal(&self, signal: i32) {
        let pgid = self.pgid.load(Ordering::SeqCst);
        if pgid > 0 {
            // SAFETY: kill has no memory effects; a negative pid names the
            // exec's own process group, never pid 0 or -1 (checked above).
            unsafe { libc::kill(-pgid, signal) };
        }
    }

    pub fn resize(&self, size: PtySize) {
        if let Some(master) = self.pty.get() {
            crate::exec::set_window_size(master.as_raw_fd(), size);
        }
    }
}

/// A call that takes follow-up frames from the host.
#[derive(Clone)]
pub enum CallKind {
    Exec(Arc<ExecControl>),
    Download(Arc<Stream>),
    Upload(Arc<Upload>),
}

/// A file being written from the host's `Data` frames.
pub struct Upload {
    pub file: File,
    pub path: String,
}

impl CallKind {
    fn stream(&self) -> Option<&Arc<Stream>> {
        match self {
            CallKind::Exec(control) => Some(&control.stream),
            CallKind::Download(stream) => Some(stream),
            CallKind::Upload(_) => None,
        }
    }
}

struct Entry {
    /// Tells this entry from a later one under the same id, so a finishing
    /// call never removes its successor.
    token: u64,
    kind: CallKind,
}

/// Running calls by id.
#[derive(Default)]
pub struct Calls {
    by_id: Mutex<HashMap<CallId, Entry>>,
    next_token: AtomicU64,
}

/// Proof of registration, used to deregister exactly that entry.
#[derive(Clone, Copy)]
pub struct Token(u64);

impl Calls {
    pub fn insert(&self, id: CallId, kind: CallKind) -> Token {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let old = lock(&self.by_id).insert(id, Entry { token, kind });
        if let Some(old) = old.as_ref().and_then(|entry| entry.kind.stream()) {
            // The host reused a running id; the old call must not speak
            // under it any more.
            old.cancel();
        }
        Token(token)
    }

    pub fn get(&self, id: CallId) -> Option<CallKind> {
        lock(&self.by_id).get(&id).map(|entry| entry.kind.clone())
    }

    /// Removes the entry if it is still the one `token` registered.
    pub fn finish(&self, id: CallId, token: Token) {
        let mut by_id = lock(&self.by_id);
        if by_id.get(&id).is_some_and(|entry| entry.token == token.0) {
            by_id.remove(&id);
        }
    }

    /// Removes an entry on the host's request, silencing its stream.
    pub fn cancel(&self, id: CallId) {
        let removed = lock(&self.by_id).remove(&id);
        if let Some(stream) = removed.as_ref().and_then(|entry| entry.kind.stream()) {
            stream.cancel();
        }
    }

    /// A new host connected: calls of the previous one keep running (an
    /// exec's process is not killed) but go silent and stop waiting for
    /// credit, and their ids are free for the new host.
    pub fn cancel_all(&self) {
        let drained: Vec<Entry> = lock(&self.by_id).drain().map(|(_, entry)| entry).collect();
        for entry in drained {
            if let Some(stream) = entry.kind.stream() {
                stream.cancel();
            }
        }
    }
}
