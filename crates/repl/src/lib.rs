//! Repl sessions ("code contexts"): a long-lived Python 3 interpreter in a
//! guest that keeps its state between cells, like a Jupyter kernel, and
//! answers each cell with its output and rich results (MIME bundles).
//!
//! Owns: the kernel program (`kernel.py`, embedded and run as
//! `python3 -u -c <source>` through the guest agent's exec with stdin) and
//! its wire protocol: one JSON line per request on the kernel's stdin, one
//! JSON line per reply on its stdout (the kernel keeps both on private
//! descriptors and captures descriptors 1 and 2 per cell, so nothing user
//! code prints can corrupt the protocol); request ids, so a reply to a cell
//! whose caller gave up is never taken for the next cell's; timeouts
//! (SIGINT to the kernel process, then SIGKILL to its process group).
//! Does not own: HTTP, session ids, limits per sandbox, or VM lifecycle;
//! the host and control plane do that.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use shoal_proto::client::{AgentClient, AgentError, ExecEvent, ExecHandle, ExecRequest};
use std::time::Duration;
use tokio::time::Instant;

/// The kernel program, run by `python3 -u -c`.
pub const KERNEL_SOURCE: &str = include_str!("kernel.py");

/// How long the kernel may take to start and say it is ready.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// After a cell's timeout, how long the interrupted cell has to answer
/// before the kernel is killed.
pub const INTERRUPT_GRACE: Duration = Duration::from_secs(2);

/// A reply line longer than this is dropped (the kernel already caps each
/// captured stream at 8 MiB; this bounds the rest, e.g. a huge repr, and
/// what a host holds for one reply of a guest it cannot trust).
pub const MAX_REPLY: usize = 32 * 1024 * 1024;

/// What the start command prints when the guest has no python3.
const NO_PYTHON_MARKER: &str = "shoal-repl: python3 not found";

/// Linux signal numbers (the guest is always Linux).
const SIGINT: i32 = 2;
const SIGKILL: i32 = 9;

/// How much of the kernel's own stderr (Python start-up errors, fatal
/// error dumps) is kept for messages.
const STDERR_TAIL: usize = 4096;

/// Why a repl call failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplError {
    /// The guest has no `python3` (a template without it, like `base`).
    #[error("python3 is not installed in this sandbox")]
    NoPython,
    /// The cell ran past its timeout and was interrupted; `killed` when the
    /// interrupt did not work and the kernel (with its state) is gone.
    #[error("{}", if *.killed { "cell timed out; the kernel did not stop and was killed" } else { "cell timed out and was interrupted" })]
    Timeout { killed: bool },
    /// The kernel exited (or its agent connection ended); the session is over.
    #[error("the repl kernel has exited")]
    Dead,
    #[error("guest agent")]
    Agent(#[from] AgentError),
    /// The kernel said something that is not its protocol, or failed to
    /// start for a reason other than a missing python3.
    #[error("repl kernel: {0}")]
    Protocol(String),
}

/// What one cell did; serializes to the fields of CONTRACT.md 4.16.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellOutput {
    pub stdout: String,
    pub stderr: String,
    /// The formatted traceback when the cell raised (also at the end of
    /// `stderr`).
    pub error: Option<String>,
    /// 0, 1 after an exception, or the code of a `SystemExit`.
    pub exit_code: i32,
    /// Full MIME bundles: the last expression's value, then every
    /// matplotlib figure open at the end of the cell.
    pub results: Vec<Map<String, Value>>,
    /// From sending the cell to its reply, as the host saw it.
    pub duration_ms: u64,
}

/// A kernel's line on the wire (a reply or the ready line).
#[derive(Debug, Deserialize)]
struct Line {
    #[serde(default)]
    ready: bool,
    #[serde(default)]
    pid: Option<u32>,
    #[serde(default)]
    python: Option<String>,
    #[serde(default)]
    id: Option<u64>,
    #[serde(default)]
    protocol_error: Option<String>,
    #[serde(default)]
    stdout: String,
    #[serde(default)]
    stderr: String,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    exit_code: i32,
    #[serde(default)]
    results: Vec<Map<String, Value>>,
}

/// One running kernel. Cells run one at a time (`run` takes `&mut self`).
/// Dropping a session without [`ReplSession::close`] still kills the kernel.
pub struct ReplSession {
    agent: AgentClient,
    exec: ExecHandle,
    /// The kernel's own pid in the guest (from its ready line).
    kernel_pid: u32,
    python_version: String,
    lines: LineBuffer,
    stderr_tail: Vec<u8>,
    next_id: u64,
    /// Requests whose line was cut short by a dropped `run`; each gets one
    /// `protocol_error` reply, which is skipped.
    torn: u32,
    /// A request line is being written (still set if that `run` was dropped
    /// half-way).
    sending: bool,
    /// The kernel is gone: every later run answers `Dead`.
    dead: bool,
    /// SIGKILL was sent; nothing is left for `Drop` to do.
    killed: bool,
}

impl std::fmt::Debug for ReplSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplSession")
            .field("kernel_pid", &self.kernel_pid)
            .field("python_version", &self.python_version)
            .field("dead", &self.dead)
            .finish_non_exhaustive()
    }
}

impl ReplSession {
    /// Starts `python3 -u -c <kernel source>` in the guest and waits (up to
    /// [`START_TIMEOUT`]) for its ready line.
    pub async fn start(agent: &AgentClient) -> Result<ReplSession, ReplError> {
        let cmd = format!(
            "command -v python3 >/dev/null 2>&1 || {{ echo '{NO_PYTHON_MARKER}' >&2; exit 127; }}; \
             exec python3 -u -c {}",
            shell_quote(KERNEL_SOURCE)
        );
        let request = ExecRequest::new(cmd)
            .stdin(true)
            .env("MPLBACKEND", "Agg")
            .env("PYTHONIOENCODING", "utf-8");
        let exec = agent.exec(request).await?;
        let mut session = ReplSession {
            agent: agent.clone(),
            exec,
            kernel_pid: 0,
            python_version: String::new(),
            lines: LineBuffer::new(MAX_REPLY),
            stderr_tail: Vec::new(),
            next_id: 1,
            torn: 0,
            sending: false,
            dead: false,
            killed: false,
        };
        match tokio::time::timeout(START_TIMEOUT, session.read_ready()).await {
            Ok(Ok(())) => Ok(session),
            Ok(Err(e)) => {
                session.kill().await;
                Err(e)
            }
            Err(_) => {
                session.kill().await;
                Err(ReplError::Timeout { killed: true })
            }
        }
    }

    async fn read_ready(&mut self) -> Result<(), ReplError> {
        let line = match self.next_line().await {
            Ok(line) => line,
            Err(ReplError::Dead) => return Err(self.start_failure()),
            Err(e) => return Err(e),
        };
        let line =
            line.map_err(|len| ReplError::Protocol(format!("a start-up line of {len} bytes")))?;
        match serde_json::from_slice::<Line>(&line) {
            Ok(Line {
                ready: true,
                pid: Some(pid),
                python,
                ..
            }) => {
                self.kernel_pid = pid;
                self.python_version = python.unwrap_or_default();
                Ok(())
            }
            _ => Err(ReplError::Protocol(format!(
                "expected the ready line, got {:?}",
                preview(&line)
            ))),
        }
    }

    /// Why the kernel exited before it was ready.
    fn start_failure(&self) -> ReplError {
        let stderr = String::from_utf8_lossy(&self.stderr_tail);
        if stderr.contains(NO_PYTHON_MARKER) {
            return ReplError::NoPython;
        }
        ReplError::Protocol(format!(
            "the kernel exited before it was ready: {}",
            stderr.trim()
        ))
    }

    /// The kernel's pid in the guest.
    pub fn pid(&self) -> u32 {
        self.kernel_pid
    }

    /// The guest's Python version, e.g. `3.11.2`.
    pub fn python_version(&self) -> &str {
        &self.python_version
    }

    /// Whether the kernel is known to be gone.
    pub fn is_dead(&self) -> bool {
        self.dead
    }

    /// Runs one cell. A cell that raises is an `Ok` with `error` set. On
    /// `timeout` the kernel gets SIGINT (the kernel process only, not its
    /// children' group) and [`INTERRUPT_GRACE`] to answer; the answer is
    /// `Timeout { killed: false }` and the session lives on, or, without an
    /// answer, the kernel's process group is killed and the answer is
    /// `Timeout { killed: true }`.
    pub async fn run(
        &mut self,
        code: &str,
        timeout: Option<Duration>,
    ) -> Result<CellOutput, ReplError> {
        if self.dead {
            return Err(ReplError::Dead);
        }
        let id = self.next_id;
        self.next_id += 1;
        let mut request = serde_json::to_vec(&serde_json::json!({ "id": id, "code": code }))
            .map_err(|e| ReplError::Protocol(format!("encoding the request: {e}")))?;
        request.push(b'\n');
        let started = Instant::now();
        self.send(&request).await?;
        let reply = match timeout {
            None => self.read_reply(id).await,
            Some(limit) => {
                match tokio::time::timeout_at(started + limit, self.read_reply(id)).await {
                    Ok(reply) => reply,
                    Err(_) => return Err(self.interrupt(id).await),
                }
            }
        }?;
        Ok(CellOutput {
            stdout: reply.stdout,
            stderr: reply.stderr,
            error: reply.error,
            exit_code: reply.exit_code,
            results: reply.results,
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        })
    }

    /// Writes one request line. If a previous `run` was dropped while its
    /// line was half sent, that line is ended first, so the kernel rejects
    /// it alone (and the rejection is skipped).
    async fn send(&mut self, request: &[u8]) -> Result<(), ReplError> {
        if self.sending {
            // Not JSON whatever precedes it, so exactly one rejection.
            self.exec
                .send_stdin(b"\0\n", false)
                .await
                .map_err(|e| self.agent_error(e))?;
            self.torn += 1;
            self.sending = false;
        }
        self.sending = true;
        let sent = self.exec.send_stdin(request, false).await;
        self.sending = false;
        sent.map_err(|e| self.agent_error(e))
    }

    /// Reads lines until the reply to `id`; replies to earlier (abandoned)
    /// requests are skipped.
    async fn read_reply(&mut self, id: u64) -> Result<Line, ReplError> {
        loop {
            let line = self.next_line().await?.map_err(|len| {
                ReplError::Protocol(format!(
                    "a reply of {len} bytes exceeds the limit of {MAX_REPLY}"
                ))
            })?;
            let reply: Line = serde_json::from_slice(&line).map_err(|e| {
                ReplError::Protocol(format!("unreadable reply ({e}): {:?}", preview(&line)))
            })?;
            if let Some(message) = reply.protocol_error {
                if reply.id.is_none() && self.torn > 0 {
                    self.torn -= 1;
                    continue;
                }
                return Err(ReplError::Protocol(message));
            }
            match reply.id {
                Some(got) if got == id => return Ok(reply),
                Some(got) if got < id => continue,
                other => {
                    return Err(ReplError::Protocol(format!(
                        "a reply for request {other:?} while waiting for {id}"
                    )))
                }
            }
        }
    }

    /// After a cell's timeout: SIGINT to the kernel, then SIGKILL to its
    /// group if it does not answer in time. Returns the error to report.
    async fn interrupt(&mut self, id: u64) -> ReplError {
        // Only the kernel: a SIGINT to the whole group would also hit the
        // cell's subprocesses, which the interrupted cell cleans up itself.
        let kill = ExecRequest::new(format!("kill -INT {}", self.kernel_pid))
            .timeout(Duration::from_secs(5));
        let signalled = matches!(
            tokio::time::timeout(INTERRUPT_GRACE, self.agent.exec_collect(kill)).await,
            Ok(Ok(output)) if output.status.success()
        );
        if !signalled {
            let _ = self.exec.signal(SIGINT).await;
        }
        match tokio::time::timeout(INTERRUPT_GRACE, self.read_reply(id)).await {
            Ok(Ok(_)) => ReplError::Timeout { killed: false },
            Ok(Err(ReplError::Dead)) => ReplError::Timeout { killed: true },
            Ok(Err(_)) | Err(_) => {
                self.kill().await;
                ReplError::Timeout { killed: true }
            }
        }
    }

    /// Kills the kernel and its process group and waits (briefly) for the exit.
    async fn kill(&mut self) {
        self.dead = true;
        self.killed = true;
        let _ = self.exec.signal(SIGKILL).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            loop {
                match self.exec.next_event().await {
                    Ok(ExecEvent::Exit(_)) | Err(_) => break,
                    Ok(_) => continue,
                }
            }
        })
        .await;
    }

    /// Kills the kernel (and anything it started in its process group).
    pub async fn close(mut self) {
        self.kill().await;
    }

    /// The next protocol line: `Ok(line)` without its newline, or
    /// `Err(len)` for a line over [`MAX_REPLY`] that was dropped. `Dead`
    /// when the kernel exits.
    async fn next_line(&mut self) -> Result<Result<Vec<u8>, usize>, ReplError> {
        loop {
            if let Some(line) = self.lines.take_line() {
                return Ok(line);
            }
            match self.exec.next_event().await {
                Ok(ExecEvent::Stdout(chunk)) => self.lines.push(&chunk),
                Ok(ExecEvent::Stderr(chunk)) => self.keep_stderr(&chunk),
                Ok(ExecEvent::Exit(status)) => {
                    self.dead = true;
                    tracing::warn!(
                        pid = self.kernel_pid,
                        code = ?status.code,
                        signal = ?status.signal,
                        stderr = %String::from_utf8_lossy(&self.stderr_tail),
                        "repl kernel exited"
                    );
                    return Err(ReplError::Dead);
                }
                Err(e) => return Err(self.agent_error(e)),
            }
        }
    }

    fn agent_error(&mut self, e: AgentError) -> ReplError {
        match e {
            // The stream is gone (the sandbox went away, or another host
            // connected and the agent silenced this exec): so is the session.
            AgentError::Closed => {
                self.dead = true;
                ReplError::Dead
            }
            other => ReplError::Agent(other),
        }
    }

    fn keep_stderr(&mut self, chunk: &[u8]) {
        self.stderr_tail.extend_from_slice(chunk);
        if self.stderr_tail.len() > STDERR_TAIL {
            let cut = self.stderr_tail.len() - STDERR_TAIL;
            self.stderr_tail.drain(..cut);
        }
        tracing::debug!(pid = self.kernel_pid, stderr = %String::from_utf8_lossy(chunk), "repl kernel");
    }
}

impl Drop for ReplSession {
    fn drop(&mut self) {
        if !self.killed {
            // Dropping the exec handle would leave the kernel running in the
            // guest; the signal frame is queued without waiting.
            use futures::FutureExt;
            let _ = self.exec.signal(SIGKILL).now_or_never();
        }
    }
}

/// Splits the kernel's stdout into lines, dropping any longer than `max`.
struct LineBuffer {
    max: usize,
    buf: Vec<u8>,
    /// Bytes of `buf` known to hold no newline.
    scanned: usize,
    /// Bytes dropped of an overlong line still being received.
    dropping: Option<usize>,
}

impl LineBuffer {
    fn new(max: usize) -> Self {
        LineBuffer {
            max,
            buf: Vec::new(),
            scanned: 0,
            dropping: None,
        }
    }

    fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    fn take_line(&mut self) -> Option<Result<Vec<u8>, usize>> {
        match self.buf[self.scanned..].iter().position(|&b| b == b'\n') {
            Some(at) => {
                let end = self.scanned + at;
                let mut line: Vec<u8> = self.buf.drain(..=end).collect();
                line.pop();
                self.scanned = 0;
                match self.dropping.take() {
                    Some(dropped) => Some(Err(dropped + line.len())),
                    None => Some(Ok(line)),
                }
            }
            None => {
                self.scanned = self.buf.len();
                if self.buf.len() > self.max {
                    *self.dropping.get_or_insert(0) += self.buf.len();
                    self.buf.clear();
                    self.scanned = 0;
                }
                None
            }
        }
    }
}

/// `text` as one single-quoted `sh` word.
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The start of a line, for error messages.
fn preview(line: &[u8]) -> String {
    let text = String::from_utf8_lossy(line);
    let mut end = text.len().min(200);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_across_chunks_and_overlong_ones_are_dropped() {
        let mut lines = LineBuffer::new(100);
        lines.push(b"{\"a\":");
        assert!(lines.take_line().is_none());
        lines.push(b"1}\n{\"b\"");
        assert_eq!(lines.take_line(), Some(Ok(b"{\"a\":1}".to_vec())));
        assert!(lines.take_line().is_none());
        lines.push(b":2}\n\n");
        assert_eq!(lines.take_line(), Some(Ok(b"{\"b\":2}".to_vec())));
        assert_eq!(lines.take_line(), Some(Ok(Vec::new())));
        assert!(lines.take_line().is_none());

        let big = vec![b'x'; 51];
        lines.push(&big);
        assert!(lines.take_line().is_none());
        lines.push(&big);
        assert!(lines.take_line().is_none());
        assert!(lines.buf.is_empty());
        lines.push(b"tail\n{}\n");
        assert_eq!(lines.take_line(), Some(Err(big.len() * 2 + 4)));
        assert_eq!(lines.take_line(), Some(Ok(b"{}".to_vec())));
    }

    #[test]
    fn shell_quoting_survives_quotes() {
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn errors_read_well() {
        assert_eq!(
            ReplError::Timeout { killed: true }.to_string(),
            "cell timed out; the kernel did not stop and was killed"
        );
        assert_eq!(
            ReplError::NoPython.to_string(),
            "python3 is not installed in this sandbox"
        );
    }

    #[test]
    fn cell_output_serializes_the_contract_fields() {
        let out = CellOutput {
            stdout: "hi\n".into(),
            stderr: String::new(),
            error: None,
            exit_code: 0,
            results: vec![],
            duration_ms: 3,
        };
        let value = serde_json::to_value(&out).unwrap();
        for key in [
            "stdout",
            "stderr",
            "error",
            "exit_code",
            "results",
            "duration_ms",
        ] {
            assert!(value.get(key).is_some(), "{key}");
        }
    }
}
