//! A template's start command and readiness check, run in a guest before
//! its memory is saved, so that every sandbox restored from the snapshot
//! has the process already running (issue 21): a Dockerfile's
//! `CMD`/`HEALTHCHECK`, a promoted template's `start_cmd`/`ready_cmd`, and
//! the smaller copies of such a template (`disk_boot`).
//!
//! The guest may be a tenant's: every call has a host-side deadline over the
//! guest's own, and what it prints is read to at most 4 KiB.
//!
//! Owns: starting a command detached from the agent's exec, and polling a
//! check until it succeeds. Does not own: the snapshot (its callers).

use shoal_proto::client::AgentClient;
use shoal_proto::client::ExecRequest;
use std::time::{Duration, Instant};

/// The longest one try of a readiness check (or a start) may take.
const READY_TRY: Duration = Duration::from_secs(10);
/// The pause between tries.
const READY_PAUSE: Duration = Duration::from_millis(250);
/// What is read of a command's output.
const OUTPUT_LIMIT: usize = 4096;

/// What a template runs before its snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmUp {
    /// Started in its own session and left running.
    pub start: Option<String>,
    /// Run until it exits 0.
    pub ready: Option<String>,
    /// How long `ready` may take to succeed.
    pub patience: Duration,
}

impl WarmUp {
    /// The start command, then the readiness check; the reason otherwise.
    pub async fn run(&self, agent: &AgentClient) -> Result<(), String> {
        if let Some(start) = &self.start {
            start_detached(agent, start).await?;
        }
        if let Some(ready) = &self.ready {
            wait_ready(agent, ready, self.patience).await?;
        }
        Ok(())
    }
}

/// `'...'` for a POSIX shell.
pub fn shell_quoted(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

/// Starts `command` in its own session in the guest, its output to
/// `/var/log/shoal-template-start.log`, and returns once it is started (the
/// exec's own process group ends at once; the session outlives it).
pub async fn start_detached(agent: &AgentClient, command: &str) -> Result<(), String> {
    let request = ExecRequest {
        cmd: format!(
            "(setsid sh -c {} > /var/log/shoal-template-start.log 2>&1 < /dev/null &)",
            shell_quoted(command)
        ),
        timeout: Some(READY_TRY),
        ..ExecRequest::default()
    };
    // The guest's timeout, and the host's own deadline over it.
    let started = tokio::time::timeout(
        READY_TRY * 2,
        agent.exec_collect_limited(request, OUTPUT_LIMIT),
    )
    .await
    .map_err(|_| "starting start_cmd timed out".to_owned())?
    .map_err(|e| format!("starting start_cmd: {e}"))?;
    if !started.status.success() {
        return Err("start_cmd could not be started".into());
    }
    Ok(())
}

/// Runs `command` in the guest until it exits 0, for at most `patience`;
/// the end of its last output otherwise.
pub async fn wait_ready(
    agent: &AgentClient,
    command: &str,
    patience: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + patience;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let one_try = left.min(READY_TRY).max(Duration::from_secs(1));
        let request = ExecRequest {
            cmd: command.to_owned(),
            timeout: Some(one_try),
            ..ExecRequest::default()
        };
        let last = match tokio::time::timeout(
            one_try * 2,
            agent.exec_collect_limited(request, OUTPUT_LIMIT),
        )
        .await
        {
            Ok(Ok(output)) if output.status.success() => return Ok(()),
            Ok(Ok(output)) => {
                let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
                text.push_str(&String::from_utf8_lossy(&output.stderr));
                text
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "the guest did not answer".into(),
        };
        if Instant::now() + READY_PAUSE >= deadline {
            let tail: String = last
                .chars()
                .rev()
                .take(500)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            return Err(format!(
                "ready_cmd did not succeed within {} s; its last output: {}",
                patience.as_secs(),
                tail.trim()
            ));
        }
        tokio::time::sleep(READY_PAUSE).await;
    }
}
