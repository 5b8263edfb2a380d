//! Warm shells: `/bin/sh` processes started ahead of need and blocked
//! reading their script from a pipe, so an exec pays neither the agent's
//! fork nor the shell's exec on its own path.
//!
//! Why: under TCG a fork plus the exec of a dynamically linked shell costs
//! about 50 ms of guest time, while handing a waiting shell its script costs
//! about a millisecond. The pool is running when the template is baked, so
//! the first exec after a create is warm too.
//!
//! A warm shell is `sh -c BOOTSTRAP` in its own session, stdin on
//! /dev/null, stdout and stderr on fresh pipes, and its script on fd 3.
//! BOOTSTRAP reads the script to EOF, closes fd 3 and evals it, so what
//! runs is what `sh -c cmd` would run, with the request's environment and
//! working directory set first on the same line (line numbers in error
//! messages match; dash prefixes them with `eval:`). Execs with stdin, a
//! PTY, a long command or an environment name the shell cannot export take
//! the cold path in `exec`.
//!
//! Does not own: running the exec once it has a process (see `exec`).

use crate::calls::lock;
use crate::exec::{self, Child, ExecSpec, Launch, Output};
use crate::Agent;
use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Shells kept waiting: two, so back-to-back execs find one while the
/// previous one's replacement is still starting. Refills start when an exec
/// has ended, not when it starts, so they stay off its path (and
/// [`REFILL_DELAY`] later while a shell is left).
const POOL_SIZE: usize = 2;

/// Longer commands take the cold path: the shell's `read` builtin reads
/// one byte per system call.
const MAX_SCRIPT: usize = 16 * 1024;

/// Reads fd 3 to EOF into `__shoal`, closes it and evals the script. One
/// function keeps the eval on line 1, so line numbers match `sh -c`.
const BOOTSTRAP: &str = "__shoal_run() { eval \"$__shoal\"; }; __shoal_nl='\n'; __shoal=; \
while IFS= read -r __shoal_line <&3 || [ -n \"$__shoal_line\" ]; do \
__shoal=\"$__shoal$__shoal_line$__shoal_nl\"; __shoal_line=; done; exec 3<&-; __shoal_run";

/// How long the refill after an exec waits while the pool still holds a
/// shell. A sandbox whose one command has ended is often deleted within it
/// (the sweep runner collects and deletes), and the shell started for it
/// would have been work thrown away, on a host whose cores other guests
/// need. An empty pool, a `Settle` and a `Sync` cut the wait short.
const REFILL_DELAY: Duration = Duration::from_millis(250);

#[derive(Default)]
pub struct WarmShells {
    ready: Mutex<Vec<WarmShell>>,
    refilling: AtomicBool,
    /// Set to make a waiting refill start at once.
    hurry: Mutex<bool>,
    hurried: Condvar,
}

struct WarmShell {
    pid: i32,
    script: OwnedFd,
    stdout: OwnedFd,
    stderr: OwnedFd,
    waker: OwnedFd,
}

impl WarmShells {
    /// A started child running `spec`, or None when `spec` needs the cold
    /// path or no warm shell is ready (the pool then refills). The caller
    /// calls `refill` once the exec is over.
    pub(crate) fn take_for(&self, agent: &Arc<Agent>, spec: &ExecSpec) -> Option<Child> {
        let script = script_for(spec)?;
        loop {
            let Some(shell) = lock(&self.ready).pop() else {
                self.refill(agent);
                return None;
            };
            // A user's `kill -9 -1` may have taken it.
            if let Some(_status) = agent.reaper.take_status(shell.pid) {
                continue;
            }
            let mut pipe = File::from(shell.script);
            if pipe.write_all(script.as_bytes()).is_err() {
                continue;
            }
            drop(pipe);
            return Some(Child {
                pid: shell.pid,
                outputs: vec![
                    Output::new(shell.stdout, false),
                    Output::new(shell.stderr, true),
                ],
                stdin: None,
                waker: shell.waker,
            });
        }
    }

    /// Starts shells on a background thread until the pool is full.
    pub fn refill(&self, agent: &Arc<Agent>) {
        self.start_refill(agent, Duration::ZERO);
    }

    /// The refill once an exec has ended: at once if the pool is empty,
    /// otherwise after [`REFILL_DELAY`].
    pub fn refill_after_exec(&self, agent: &Arc<Agent>) {
        let delay = if lock(&self.ready).is_empty() {
            Duration::ZERO
        } else {
            REFILL_DELAY
        };
        self.start_refill(agent, delay);
    }

    fn start_refill(&self, agent: &Arc<Agent>, delay: Duration) {
        if self.refilling.swap(true, Ordering::SeqCst) {
            if delay.is_zero() {
                self.hurry();
            }
            return;
        }
        *lock(&self.hurry) = false;
        let agent = agent.clone();
        let started = std::thread::Builder::new()
            .name("warm-shells".into())
            .spawn(move || {
                let warm = &agent.warm;
                let hurry = lock(&warm.hurry);
                drop(
                    warm.hurried
                        .wait_timeout_while(hurry, delay, |hurry| !*hurry)
                        .map(|(guard, _)| guard),
                );
                while lock(&warm.ready).len() < POOL_SIZE {
                    match start(&agent) {
                        Ok(shell) => lock(&warm.ready).push(shell),
                        Err(err) => {
                            crate::log(&format!("cannot start a warm shell: {err}"));
                            break;
                        }
                    }
                }
                warm.refilling.store(false, Ordering::SeqCst);
            });
        if started.is_err() {
            self.refilling.store(false, Ordering::SeqCst);
        }
    }

    /// Makes a refill that waits start at once.
    fn hurry(&self) {
        *lock(&self.hurry) = true;
        self.hurried.notify_all();
    }

    /// Waits, at most `within`, until the pool is full and every shell in it
    /// is blocked reading its script. A snapshot taken earlier catches a
    /// shell half started, and every clone of it then finishes that start
    /// (fork, exec, the dynamic linker) with a cold translation cache under
    /// TCG: about as much guest code as the whole rest of a restore.
    pub fn settle(&self, within: Duration) {
        let give_up = Instant::now() + within;
        let settled = || {
            !self.refilling.load(Ordering::SeqCst)
                && lock(&self.ready)
                    .iter()
                    .all(|shell| waits_for_script(shell.pid))
        };
        while !settled() && Instant::now() < give_up {
            // A refill that waits would otherwise start in a clone.
            self.hurry();
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Whether `pid` sleeps in read(2): the one thing a warm shell does once it
/// is ready. (`/proc/PID/syscall` starts with the number of the system call
/// a sleeping process is in, or says `running`.)
fn waits_for_script(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/syscall"))
        .is_ok_and(|call| call.split_whitespace().next() == Some("0"))
}

/// The script for `spec`, or None when it must take the cold path.
fn script_for(spec: &ExecSpec) -> Option<String> {
    // Warm shells run as root: another user's exec takes the cold path.
    if spec.ids.is_some()
        || spec.pty.is_some()
        || spec.stdin
        || spec.cmd.len() > MAX_SCRIPT
        || spec.cmd.contains('\0')
    {
        return None;
    }
    let mut script = String::new();
    for (key, value) in &spec.env {
        if !is_shell_name(key) || value.contains('\0') {
            return None;
        }
        script.push_str(&format!("export {key}={}; ", quote(value)));
    }
    if let Some(cwd) = &spec.cwd {
        script.push_str(&format!("cd -- {} || exit 1; ", quote(cwd)));
    }
    script.push_str(&spec.cmd);
    Some(script)
}

fn is_shell_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// Single-quotes `text` for the shell.
fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

fn start(agent: &Agent) -> std::io::Result<WarmShell> {
    let fail = |what: &'static str| move |e| std::io::Error::other(format!("{what}: {e:?}"));
    let (out_read, out_write) = exec::pipe()?;
    let (err_read, err_write) = exec::pipe()?;
    let (script_read, script_write) = exec::pipe()?;
    let args = ["sh", "-c", BOOTSTRAP]
        .into_iter()
        .map(|a| exec::cstring(a, "argument"))
        .collect::<Result<Vec<_>, _>>()
        .map_err(fail("arguments"))?;
    let env = exec::environment(&ExecSpec::default()).map_err(fail("environment"))?;
    let launched = exec::launch(
        agent,
        Launch {
            args,
            env,
            cwd: None,
            stdio: [
                exec::dev_null().map_err(fail("/dev/null"))?,
                out_write,
                err_write,
            ],
            controlling_tty: None,
            script: Some(script_read),
            ids: None,
        },
    )
    .map_err(|(stage, err)| std::io::Error::other(format!("step {stage}: {err}")))?;
    Ok(WarmShell {
        pid: launched.pid,
        script: script_write,
        stdout: out_read,
        stderr: err_read,
        waker: launched.waker,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_set_environment_and_directory_on_the_command_line() {
        let mut spec = ExecSpec {
            cmd: "echo \"$A\"".into(),
            cwd: Some("/tmp/it's".into()),
            ..ExecSpec::default()
        };
        spec.env.insert("A".into(), "x y".into());
        assert_eq!(
            script_for(&spec).unwrap(),
            "export A='x y'; cd -- '/tmp/it'\\''s' || exit 1; echo \"$A\""
        );
    }

    #[test]
    fn a_shell_blocked_reading_counts_as_waiting_and_a_busy_one_does_not() {
        use std::process::{Command, Stdio};
        let mut reading = Command::new("sh")
            .args(["-c", "read line"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        let mut busy = Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        let waited = (0..200).find(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            waits_for_script(reading.id() as i32)
        });
        let busy_seen_waiting = waits_for_script(busy.id() as i32);
        for child in [&mut reading, &mut busy] {
            let _ = child.kill();
            let _ = child.wait();
        }
        assert!(
            waited.is_some(),
            "a shell in read(2) was never seen waiting"
        );
        assert!(
            !busy_seen_waiting,
            "a spinning shell was taken for a waiting one"
        );
    }

    #[test]
    fn what_a_warm_shell_cannot_do_takes_the_cold_path() {
        let plain = ExecSpec {
            cmd: "true".into(),
            ..ExecSpec::default()
        };
        assert!(script_for(&plain).is_some());
        assert!(script_for(&ExecSpec {
            stdin: true,
            ..plain.clone()
        })
        .is_none());
        assert!(script_for(&ExecSpec {
            cmd: "x".repeat(MAX_SCRIPT + 1),
            ..plain.clone()
        })
        .is_none());
        let mut odd_env = plain.clone();
        odd_env.env.insert("NOT-A-NAME".into(), "1".into());
        assert!(script_for(&odd_env).is_none());
    }
}
