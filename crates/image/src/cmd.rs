//! Running external commands (apt, dpkg-deb, debootstrap, mke2fs...).
//!
//! Owns the policy that a failure names the command and carries its stderr
//! tail, and the line streaming used to feed progress spinners. It knows
//! nothing about what the commands do.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::mpsc;

use crate::error::ImageError;

/// How many trailing stderr lines an error keeps: enough for apt's or
/// debootstrap's explanation, short enough to read in a terminal.
const TAIL_LINES: usize = 30;

/// Renders a command the way a person would type it, for error messages.
pub(crate) fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(TAIL_LINES);
    lines[start..].join("\n")
}

/// Runs `cmd` to completion and returns its stdout as bytes.
pub(crate) fn run_bytes(cmd: &mut Command) -> Result<Vec<u8>, ImageError> {
    let command = describe(cmd);
    tracing::debug!(%command, "running");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|source| ImageError::Spawn {
            command: command.clone(),
            source,
        })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Some tools (debootstrap, apt) explain themselves on stdout.
        let explanation = if stderr.trim().is_empty() {
            String::from_utf8_lossy(&out.stdout).into_owned()
        } else {
            stderr.into_owned()
        };
        return Err(ImageError::Command {
            command,
            status: out.status.to_string(),
            stderr_tail: tail(&explanation),
        });
    }
    Ok(out.stdout)
}

/// Runs `cmd` to completion and returns its stdout as text.
pub(crate) fn run(cmd: &mut Command) -> Result<String, ImageError> {
    run_bytes(cmd).map(|b| String::from_utf8_lossy(&b).into_owned())
}

/// Runs `cmd`, calling `on_line` for every line it prints on stdout or
/// stderr as it prints it (to drive a spinner), and fails with the tail of
/// both streams. `extra_tail` is consulted on failure for a log file the
/// command keeps elsewhere (debootstrap's debootstrap.log).
pub(crate) fn run_streaming(
    cmd: &mut Command,
    mut on_line: impl FnMut(&str),
    extra_tail: impl FnOnce() -> Option<String>,
) -> Result<(), ImageError> {
    let command = describe(cmd);
    tracing::debug!(%command, "running (streamed)");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| ImageError::Spawn {
            command: command.clone(),
            source,
        })?;
    let (tx, rx) = mpsc::channel::<String>();
    let readers: Vec<_> = [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    .map(|stream| {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        })
    })
    .collect();
    drop(tx);
    let mut last = VecDeque::with_capacity(TAIL_LINES);
    for line in rx {
        on_line(&line);
        if last.len() == TAIL_LINES {
            last.pop_front();
        }
        last.push_back(line);
    }
    for r in readers {
        let _ = r.join();
    }
    let status = child
        .wait()
        .map_err(|e| ImageError::io(format!("waiting for `{command}`"), e))?;
    if status.success() {
        return Ok(());
    }
    let mut stderr_tail = Vec::from(last).join("\n");
    if let Some(extra) = extra_tail() {
        stderr_tail.push_str("\n--- log tail ---\n");
        stderr_tail.push_str(&tail(&extra));
    }
    Err(ImageError::Command {
        command,
        status: status.to_string(),
        stderr_tail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_names_command_and_keeps_stderr_tail() {
        let err = run(Command::new("sh").args(["-c", "echo oops >&2; exit 3"])).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("sh -c"), "{msg}");
        assert!(msg.contains("oops"), "{msg}");
        assert!(msg.contains('3'), "{msg}");
    }

    #[test]
    fn missing_program_is_a_spawn_error() {
        let err = run(&mut Command::new("/nonexistent/shoal-tool")).unwrap_err();
        assert!(matches!(err, ImageError::Spawn { .. }));
    }

    #[test]
    fn streaming_sees_both_streams() {
        let mut seen = Vec::new();
        run_streaming(
            Command::new("sh").args(["-c", "echo out; echo err >&2"]),
            |l| seen.push(l.to_string()),
            || None,
        )
        .unwrap();
        seen.sort();
        assert_eq!(seen, ["err", "out"]);
    }
}
