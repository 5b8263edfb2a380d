//! Runs one `Exec` call: `/bin/sh -c cmd` in its own session and process
//! group, on pipes or a PTY, streaming its output under flow control until
//! the shell has exited and its output is drained, then reporting `Exit`.
//!
//! Rules worth knowing:
//! - The exec ends when the shell exits and its output pipes reach EOF, or
//!   stay silent for [`DRAIN_IDLE`] after the exit: a daemon started with
//!   `cmd &` that keeps the pipes open does not hold the call, and is not
//!   killed either. Only a timeout kills, and then the whole group.
//! - Processes are forked by hand (not `std::process::Command`) so that the
//!   reaper is the only waiter for children and every fd is close-on-exec.
//!
//! Does not own: reaping (see `reaper`) or routing the host's stdin,
//! signal and resize frames (see `calls`).

use crate::calls::{ExecControl, StdinChunk, Token};
use crate::errors::CallError;
use crate::reaper;
use crate::Agent;
use shoal_proto::{CallId, ErrorKind, Frame, GuestMsg, PtySize, MAX_CHUNK};
use std::collections::BTreeMap;
use std::ffi::{CString, OsString};
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStringExt;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// After the shell exits, output still arriving within this much silence is
/// sent; longer silence means only a background process holds the pipes.
pub const DRAIN_IDLE: Duration = Duration::from_millis(100);

const SHELL: &str = "/bin/sh";

/// The fd on which a warm shell reads its script (see `warm`).
pub(crate) const WARM_SCRIPT_FD: RawFd = 3;

/// What the host asked to run.
#[derive(Debug, Clone, Default)]
pub struct ExecSpec {
    pub cmd: String,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub timeout_ms: Option<u64>,
    /// At the timeout: SIGTERM, then SIGKILL this much later (`None`:
    /// SIGKILL at once).
    pub kill_grace_ms: Option<u64>,
    /// (signal, ms before the timeout): a warning the group may trap.
    pub warn_signal: Option<(i32, u64)>,
    pub pty: Option<PtySize>,
    pub stdin: bool,
    /// Run as this user and group instead of root (the image's `USER`).
    pub ids: Option<Ids>,
}

/// A user and group id to run as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ids {
    pub uid: u32,
    pub gid: u32,
}

/// Runs the exec to its end on the calling thread.
pub fn run(
    agent: &Arc<Agent>,
    id: CallId,
    token: Token,
    mut spec: ExecSpec,
    control: Arc<ExecControl>,
    stdin_rx: Receiver<StdinChunk>,
) {
    let started = Instant::now();
    let oom_kills_before = oom_kills();
    let child = crate::image::apply(&mut spec).and_then(|()| start(agent, &spec, &control));
    match child {
        Err(err) => agent
            .outbox
            .send_on(&control.stream, Frame::new(id, err.into_msg())),
        Ok(child) => {
            control.pgid.store(child.pid, Ordering::SeqCst);
            agent.outbox.send_on(
                &control.stream,
                Frame::new(
                    id,
                    GuestMsg::Started {
                        pid: child.pid as u32,
                    },
                ),
            );
            if let Some(writer) = child.stdin {
                let pty = spec.pty.is_some();
                let spawned = std::thread::Builder::new()
                    .name(format!("stdin-{id}"))
                    .spawn(move || feed_stdin(writer, stdin_rx, pty));
                if let Err(err) = spawned {
                    crate::log(&format!("cannot start a stdin thread: {err}"));
                }
            }
            let stop = Stop::new(started, &spec);
            let mut ended = pump(
                agent,
                id,
                &control,
                child.pid,
                child.outputs,
                &child.waker,
                stop,
            );
            ended.usage.oom_kills = oom_kills().saturating_sub(oom_kills_before);
            agent.outbox.send_on(
                &control.stream,
                Frame::new(id, exit_msg(ended, started.elapsed())),
            );
        }
    }
    // Closing our end of the stdin channel ends the stdin thread.
    *crate::calls::lock(&control.stdin) = None;
    agent.calls.finish(id, token);
    agent.warm.refill_after_exec(agent);
}

pub(crate) struct Child {
    pub pid: i32,
    pub outputs: Vec<Output>,
    pub stdin: Option<OwnedFd>,
    pub waker: OwnedFd,
}

pub(crate) struct Output {
    fd: OwnedFd,
    is_stderr: bool,
    open: bool,
}

impl Output {
    pub(crate) fn new(fd: OwnedFd, is_stderr: bool) -> Self {
        Output {
            fd,
            is_stderr,
            open: true,
        }
    }
}

/// How the process ended: its raw wait status, what it used, and whether
/// we killed it.
struct Ended {
    status: i32,
    usage: shoal_proto::ProcessUsage,
    timed_out: bool,
}

/// Processes the kernel's out-of-memory killer has killed since boot
/// (`/proc/vmstat`'s `oom_kill`); 0 where the kernel does not say.
fn oom_kills() -> u64 {
    std::fs::read_to_string("/proc/vmstat")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("oom_kill "))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn exit_msg(ended: Ended, elapsed: Duration) -> GuestMsg {
    let status = ended.status;
    let (code, signal) = if libc::WIFSIGNALED(status) {
        (None, Some(libc::WTERMSIG(status)))
    } else {
        (Some(libc::WEXITSTATUS(status)), None)
    };
    GuestMsg::Exit {
        code,
        signal,
        timed_out: ended.timed_out,
        duration_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        usage: Some(ended.usage),
    }
}

/// Steps of the child between fork and exec, reported when one fails.
const STAGE_SETSID: u8 = 1;
const STAGE_CTTY: u8 = 2;
const STAGE_DUP: u8 = 3;
const STAGE_CHDIR: u8 = 4;
const STAGE_EXEC: u8 = 5;
const STAGE_FORK: u8 = 6;
const STAGE_IDS: u8 = 7;

/// Everything the forked child needs, prepared before the fork because a
/// child of a threaded process may not allocate.
/// Pointers in it borrow from the `Launch` it was made from, which outlives it.
struct Plan {
    program: CString,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    cwd: Option<CString>,
    stdin: RawFd,
    stdout: RawFd,
    stderr: RawFd,
    /// Put on fd 3 (warm shells read their script there).
    script: Option<RawFd>,
    controlling_tty: Option<RawFd>,
    ids: Option<Ids>,
    error_pipe: RawFd,
}

fn invalid(message: impl Into<String>) -> CallError {
    CallError::new(ErrorKind::InvalidInput, message)
}

pub(crate) fn cstring(text: impl Into<Vec<u8>>, what: &str) -> Result<CString, CallError> {
    CString::new(text).map_err(|_| invalid(format!("{what} contains a NUL byte")))
}

fn start(agent: &Arc<Agent>, spec: &ExecSpec, control: &ExecControl) -> Result<Child, CallError> {
    if let Some(cwd) = &spec.cwd {
        match std::fs::metadata(cwd) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => {
                return Err(CallError::new(
                    ErrorKind::NotADirectory,
                    format!("not a directory: {cwd}"),
                ))
            }
            Err(err) => return Err(CallError::io(&err, cwd)),
        }
    }
    if let Some(child) = agent.warm.take_for(agent, spec) {
        return Ok(child);
    }
    let args = vec![
        cstring("sh", "argument")?,
        cstring("-c", "argument")?,
        cstring(spec.cmd.as_bytes(), "the command")?,
    ];
    let env = environment(spec)?;
    let cwd = match &spec.cwd {
        Some(cwd) => Some(cstring(cwd.as_bytes(), "the working directory")?),
        None => None,
    };

    // Parent ends first, child ends second.
    let mut outputs = Vec::new();
    let child_stdin: OwnedFd;
    let child_stdout: OwnedFd;
    let child_stderr: OwnedFd;
    let mut controlling_tty = None;
    let stdin_writer: Option<OwnedFd>;
    if let Some(size) = spec.pty {
        let (master, slave) = open_pty().map_err(|e| io_err("opening a PTY", e))?;
        set_window_size(master.as_raw_fd(), size);
        let dup = |fd: &OwnedFd| fd.try_clone().map_err(|e| io_err("dup", e));
        stdin_writer = Some(dup(&master)?);
        let _ = control.pty.set(dup(&master)?);
        child_stdin = dup(&slave)?;
        child_stdout = dup(&slave)?;
        controlling_tty = Some(slave.as_raw_fd());
        child_stderr = slave;
        outputs.push(Output::new(master, false));
    } else {
        let (out_read, out_write) = pipe().map_err(|e| io_err("pipe", e))?;
        let (err_read, err_write) = pipe().map_err(|e| io_err("pipe", e))?;
        if spec.stdin {
            let (in_read, in_write) = pipe().map_err(|e| io_err("pipe", e))?;
            child_stdin = in_read;
            stdin_writer = Some(in_write);
        } else {
            child_stdin = dev_null()?;
            stdin_writer = None;
        }
        child_stdout = out_write;
        child_stderr = err_write;
        outputs.push(Output::new(out_read, false));
        outputs.push(Output::new(err_read, true));
    }
    let launched = launch(
        agent,
        Launch {
            args,
            env,
            cwd,
            stdio: [child_stdin, child_stdout, child_stderr],
            controlling_tty,
            script: None,
            ids: spec.ids,
        },
    )
    .map_err(|(stage, err)| match stage {
        STAGE_CHDIR => CallError::io(&err, spec.cwd.as_deref().unwrap_or("")),
        STAGE_EXEC => CallError::io(&err, SHELL),
        _ => io_err(stage_name(stage), err),
    })?;
    Ok(Child {
        pid: launched.pid,
        outputs,
        stdin: stdin_writer,
        waker: launched.waker,
    })
}

pub(crate) fn io_err(what: &str, err: io::Error) -> CallError {
    CallError::new(
        ErrorKind::Io,
        format!("cannot start the command: {what}: {err}"),
    )
}

pub(crate) fn dev_null() -> Result<OwnedFd, CallError> {
    Ok(File::open("/dev/null")
        .map_err(|e| io_err("/dev/null", e))?
        .into())
}

fn stage_name(stage: u8) -> &'static str {
    match stage {
        STAGE_SETSID => "setsid",
        STAGE_CTTY => "setting the controlling terminal",
        STAGE_DUP => "dup2",
        STAGE_CHDIR => "chdir",
        STAGE_IDS => "switching to the image's user",
        STAGE_EXEC => "exec",
        STAGE_FORK => "fork",
        _ => "unknown step",
    }
}

/// What to start: `SHELL` with `args`, in a new session, on the given
/// stdio (and a script pipe on fd 3 for warm shells).
pub(crate) struct Launch {
    pub args: Vec<CString>,
    pub env: Vec<CString>,
    pub cwd: Option<CString>,
    pub stdio: [OwnedFd; 3],
    pub controlling_tty: Option<RawFd>,
    pub script: Option<OwnedFd>,
    pub ids: Option<Ids>,
}

pub(crate) struct Launched {
    pub pid: i32,
    /// Woken by the reaper when the process exits.
    pub waker: OwnedFd,
}

/// Forks and execs, with the reaper watching the pid from the start. Our
/// copies of the child's fds are closed before returning. A failure names
/// the step of the child that failed.
pub(crate) fn launch(agent: &Agent, launch: Launch) -> Result<Launched, (u8, io::Error)> {
    let fork_err = |err| (STAGE_FORK, err);
    let (error_read, error_write) = pipe().map_err(fork_err)?;
    let waker = reaper::new_waker().map_err(fork_err)?;
    let waker_for_reaper = Arc::new(waker.try_clone().map_err(fork_err)?);
    let program = CString::new(SHELL).expect("no NUL in the shell path");
    let argv = null_terminated(&launch.args);
    let envp = null_terminated(&launch.env);
    let plan = Plan {
        program,
        argv,
        envp,
        cwd: launch.cwd.clone(),
        stdin: launch.stdio[0].as_raw_fd(),
        stdout: launch.stdio[1].as_raw_fd(),
        stderr: launch.stdio[2].as_raw_fd(),
        script: launch.script.as_ref().map(|fd| fd.as_raw_fd()),
        controlling_tty: launch.controlling_tty,
        ids: launch.ids,
        error_pipe: error_write.as_raw_fd(),
    };
    let pid = agent
        .reaper
        .spawn_watched(waker_for_reaper, || fork_and_exec(&plan))
        .map_err(fork_err)?;
    // Only the child may hold these now: our copies would keep the pipes
    // (and the PTY) from ever reporting EOF.
    drop((launch, error_write, plan));

    let mut report = [0u8; 5];
    let mut error_file = File::from(error_read);
    if read_fully(&mut error_file, &mut report) == report.len() {
        agent.reaper.forget(pid);
        let errno = i32::from_ne_bytes([report[1], report[2], report[3], report[4]]);
        return Err((report[0], io::Error::from_raw_os_error(errno)));
    }
    Ok(Launched { pid, waker })
}

/// The agent's environment, then the request's, and a TERM for PTYs.
pub(crate) fn environment(spec: &ExecSpec) -> Result<Vec<CString>, CallError> {
    let mut vars: BTreeMap<OsString, OsString> = std::env::vars_os().collect();
    if spec.pty.is_some() && !vars.contains_key(&OsString::from("TERM")) {
        vars.insert("TERM".into(), "xterm-256color".into());
    }
    for (key, value) in &spec.env {
        if key.is_empty() || key.contains('=') {
            return Err(invalid(format!("bad environment variable name: {key:?}")));
        }
        vars.insert(key.into(), value.into());
    }
    vars.into_iter()
        .map(|(key, value)| {
            let mut entry = key.into_vec();
            entry.push(b'=');
            entry.extend(value.into_vec());
            cstring(entry, "the environment")
        })
        .collect()
}

fn null_terminated(strings: &[CString]) -> Vec<*const libc::c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

/// Starts the child the way `posix_spawn` does: `CLONE_VM | CLONE_VFORK`
/// on a stack of its own, so the agent's page tables are not copied (under
/// TCG that copy is most of a fork's cost) and this thread sleeps only
/// until the child has exec'd. Signals stay blocked across the clone so no
/// handler of ours runs in the child while it shares our memory.
fn fork_and_exec(plan: &Plan) -> io::Result<i32> {
    const CHILD_STACK: usize = 64 * 1024;
    let mut stack = vec![0u8; CHILD_STACK];
    // SAFETY: one past the end of the allocation; clone's stack grows down.
    let top = unsafe { stack.as_mut_ptr().add(CHILD_STACK) };
    let top = (top as usize & !15) as *mut libc::c_void;
    // SAFETY: sigset_t is plain data; all-zero is a valid (empty) set.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut previous: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; pthread_sigmask only reads `all` and writes `previous`.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut previous);
    }
    // SAFETY: the child runs `child_entry` on its own stack and only calls
    // async-signal-safe functions on `plan`, which outlives it because
    // CLONE_VFORK suspends us until it execs or exits.
    let pid = unsafe {
        libc::clone(
            child_entry,
            top,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (plan as *const Plan).cast_mut().cast(),
        )
    };
    let err = io::Error::last_os_error();
    // SAFETY: restores the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut()) };
    drop(stack);
    if pid < 0 {
        return Err(err);
    }
    Ok(pid)
}

extern "C" fn child_entry(plan: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `fork_and_exec` passes a valid &Plan that outlives the child.
    unsafe { exec_child(&*(plan as *const Plan)) }
}

/// The child side of the fork. Allocates nothing and takes no locks.
unsafe fn exec_child(plan: &Plan) -> ! {
    // SAFETY: only async-signal-safe libc calls, on pointers into `plan`
    // (which the fork copied intact) and on locals.
    unsafe {
        // The agent ignores SIGPIPE and may block signals; commands expect
        // the defaults (e.g. `yes | head` relies on SIGPIPE). Dispositions
        // first: signals are blocked until the mask is cleared.
        for signal in 1..32 {
            if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                libc::signal(signal, libc::SIG_DFL);
            }
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        if libc::setsid() < 0 {
            child_fail(plan, STAGE_SETSID);
        }
        if let Some(tty) = plan.controlling_tty {
            if libc::ioctl(tty, libc::TIOCSCTTY, 0) < 0 {
                child_fail(plan, STAGE_CTTY);
            }
        }
        let script = plan.script.map(|fd| (fd, WARM_SCRIPT_FD));
        for (from, to) in [(plan.stdin, 0), (plan.stdout, 1), (plan.stderr, 2)]
            .into_iter()
            .chain(script)
        {
            // dup2 onto itself would leave close-on-exec set.
            let moved = if from == to {
                libc::fcntl(from, libc::F_SETFD, 0)
            } else {
                libc::dup2(from, to)
            };
            if moved < 0 {
                child_fail(plan, STAGE_DUP);
            }
        }
        if let Some(ids) = plan.ids {
            let groups = [ids.gid as libc::gid_t];
            if libc::setgroups(1, groups.as_ptr()) < 0
                || libc::setgid(ids.gid) < 0
                || libc::setuid(ids.uid) < 0
            {
                child_fail(plan, STAGE_IDS);
            }
        }
        if let Some(cwd) = &plan.cwd {
            if libc::chdir(cwd.as_ptr()) < 0 {
                child_fail(plan, STAGE_CHDIR);
            }
        }
        libc::execve(
            plan.program.as_ptr(),
            plan.argv.as_ptr(),
            plan.envp.as_ptr(),
        );
        child_fail(plan, STAGE_EXEC)
    }
}

unsafe fn child_fail(plan: &Plan, stage: u8) -> ! {
    // SAFETY: errno is thread-local and valid; write and _exit are
    // async-signal-safe.
    unsafe {
        let errno = (*libc::__errno_location()).to_ne_bytes();
        let report = [stage, errno[0], errno[1], errno[2], errno[3]];
        libc::write(plan.error_pipe, report.as_ptr().cast(), report.len());
        libc::_exit(127)
    }
}

/// Reads until `buf` is full or EOF; returns how much was read.
fn read_fully(file: &mut File, buf: &mut [u8]) -> usize {
    use std::io::Read;
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    filled
}

/// How an exec is stopped at its timeout: a warning signal before it,
/// then SIGKILL, or SIGTERM and SIGKILL after a grace (as Slurm ends a job
/// at its time limit).
struct Stop {
    deadline: Option<Instant>,
    warn: Option<(i32, Instant)>,
    grace: Option<Duration>,
    warned: bool,
    timed_out: bool,
    kill_at: Option<Instant>,
}

impl Stop {
    fn new(started: Instant, spec: &ExecSpec) -> Stop {
        let deadline = spec
            .timeout_ms
            .map(|ms| started + Duration::from_millis(ms));
        let warn = match (deadline, spec.warn_signal) {
            // Only a catchable, real signal: 1 to 31 but SIGKILL and SIGSTOP.
            (Some(d), Some((signal, before)))
                if (1..32).contains(&signal)
                    && signal != libc::SIGKILL
                    && signal != libc::SIGSTOP =>
            {
                Some((
                    signal,
                    d.checked_sub(Duration::from_millis(before))
                        .unwrap_or(started),
                ))
            }
            _ => None,
        };
        Stop {
            deadline,
            warn,
            grace: spec.kill_grace_ms.map(Duration::from_millis),
            warned: false,
            timed_out: false,
            kill_at: None,
        }
    }

    /// Sends what is due to group `pid` by now.
    fn act(&mut self, pid: i32) {
        let now = Instant::now();
        if let Some((signal, at)) = self.warn {
            if !self.warned && now >= at {
                signal_group(pid, signal);
                self.warned = true;
            }
        }
        if !self.timed_out && self.deadline.is_some_and(|d| now >= d) {
            self.timed_out = true;
            match self.grace {
                // As Slurm stops a batch step: SIGTERM to the shell alone
                // (its trap runs; the commands it runs are not cut short),
                // SIGKILL to everything when the grace ends.
                Some(grace) => {
                    signal_group(pid, libc::SIGCONT);
                    // SAFETY: kill has no memory effects; pid is the shell.
                    unsafe { libc::kill(pid, libc::SIGTERM) };
                    self.kill_at = Some(now + grace);
                }
                None => signal_group(pid, libc::SIGKILL),
            }
        }
        if self.kill_at.is_some_and(|at| now >= at) {
            signal_group(pid, libc::SIGKILL);
            self.kill_at = None;
        }
    }

    /// How long until the next thing is due (`None`: nothing is).
    fn next(&self) -> Option<Duration> {
        let warn = self.warn.filter(|_| !self.warned).map(|(_, at)| at);
        let deadline = self.deadline.filter(|_| !self.timed_out);
        [warn, deadline, self.kill_at]
            .into_iter()
            .flatten()
            .min()
            .map(|at| at.saturating_duration_since(Instant::now()))
    }
}

/// Sends `signal` to the process group `pgid`.
fn signal_group(pgid: i32, signal: i32) {
    // SAFETY: kill has no memory effects; -pgid is the exec's group.
    unsafe { libc::kill(-pgid, signal) };
}

/// Streams output until the exec is over (see the module doc), stopping
/// the group at its timeout (`Stop`).
#[allow(clippy::too_many_arguments)]
fn pump(
    agent: &Agent,
    id: CallId,
    control: &ExecControl,
    pid: i32,
    mut outputs: Vec<Output>,
    waker: &OwnedFd,
    mut stop: Stop,
) -> Ended {
    let stream = &control.stream;
    let mut status = None;
    let mut buf = vec![0u8; MAX_CHUNK];
    loop {
        if status.is_none() {
            status = agent.reaper.take_status(pid);
        }
        if status.is_none() {
            stop.act(pid);
        }
        let timed_out = stop.timed_out;
        // A shell that ended after its time limit takes what it left
        // running with it, as Slurm ends a step whose script returned.
        if status.is_some() && stop.kill_at.take().is_some() {
            signal_group(pid, libc::SIGKILL);
        }
        let any_open = outputs.iter().any(|o| o.open);
        if let (Some((status, usage)), false) = (status, any_open) {
            return Ended {
                status,
                usage,
                timed_out,
            };
        }
        // How long we may sleep before the exit or the deadline needs us.
        let wait_limit = if status.is_some() {
            Some(DRAIN_IDLE)
        } else {
            stop.next()
        };

        let mut budget = if any_open {
            // Waiting for credit is not silence: it does not count toward
            // DRAIN_IDLE, so nothing printed is ever dropped for slowness.
            let credit_limit = if status.is_some() { None } else { wait_limit };
            let budget = stream.wait_credit(MAX_CHUNK, credit_limit);
            if budget == 0 {
                continue;
            }
            budget
        } else {
            0
        };

        let mut fds: Vec<libc::pollfd> = outputs
            .iter()
            .filter(|o| o.open)
            .map(|o| libc::pollfd {
                fd: o.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let watching_exit = status.is_none();
        if watching_exit {
            fds.push(libc::pollfd {
                fd: waker.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let timeout_ms =
            wait_limit.map_or(-1, |d| i32::try_from(d.as_millis()).unwrap_or(i32::MAX));
        // SAFETY: fds is a valid array of fds.len() pollfd structs.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if ready < 0 {
            if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        }
        if ready == 0 {
            if let Some((status, usage)) = status {
                return Ended {
                    status,
                    usage,
                    timed_out,
                };
            }
            continue;
        }
        if watching_exit && fds.last().is_some_and(|w| w.revents != 0) {
            reaper::drain_waker(waker);
        }
        for output in outputs.iter_mut().filter(|o| o.open) {
            let Some(polled) = fds.iter().find(|p| p.fd == output.fd.as_raw_fd()) else {
                continue;
            };
            if polled.revents == 0 || budget == 0 {
                continue;
            }
            // SAFETY: reads at most budget <= buf.len() bytes into buf.
            let got = unsafe { libc::read(output.fd.as_raw_fd(), buf.as_mut_ptr().cast(), budget) };
            if got > 0 {
                let got = got as usize;
                let msg = if output.is_stderr {
                    GuestMsg::Stderr
                } else {
                    GuestMsg::Stdout
                };
                stream.consume(got);
                budget -= got;
                agent
                    .outbox
                    .send_on(stream, Frame::with_payload(id, msg, buf[..got].to_vec()));
            } else if got == 0 {
                output.open = false;
            } else {
                let err = io::Error::last_os_error();
                // EIO is how a PTY master says every slave is closed.
                if !matches!(
                    err.kind(),
                    io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
                ) {
                    output.open = false;
                }
            }
        }
    }
}

fn feed_stdin(writer: OwnedFd, chunks: Receiver<StdinChunk>, pty: bool) {
    let mut writer = File::from(writer);
    for (data, eof) in chunks {
        if writer.write_all(&data).is_err() {
            return;
        }
        if eof {
            if pty {
                // A PTY cannot be closed for input alone: ^D ends input for
                // a program reading a line, as a user at a terminal would.
                let _ = writer.write_all(&[4]);
            } else {
                return;
            }
        }
    }
}

pub(crate) fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two fds into the valid array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds are fresh and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn check(result: libc::c_int) -> io::Result<libc::c_int> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

/// Opens a PTY pair, both ends close-on-exec from the start so no other
/// exec forked meanwhile can inherit them.
fn open_pty() -> io::Result<(OwnedFd, OwnedFd)> {
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
    // SAFETY: the path is a valid NUL-terminated string.
    let master = check(unsafe { libc::open(c"/dev/ptmx".as_ptr(), flags) })?;
    // SAFETY: master is a fresh fd owned by nobody else.
    let master = unsafe { OwnedFd::from_raw_fd(master) };
    // SAFETY: grantpt/unlockpt take an fd and no pointers.
    check(unsafe { libc::grantpt(master.as_raw_fd()) })?;
    // SAFETY: as above.
    check(unsafe { libc::unlockpt(master.as_raw_fd()) })?;
    // SAFETY: TIOCGPTPEER takes open flags by value and returns a new fd.
    let peer = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, flags) };
    let slave = if peer >= 0 {
        peer
    } else {
        // Kernels before 4.13 lack TIOCGPTPEER: open the slave by name.
        let mut name = [0 as libc::c_char; 128];
        // SAFETY: ptsname_r writes at most name.len() bytes into name.
        let rc = unsafe { libc::ptsname_r(master.as_raw_fd(), name.as_mut_ptr(), name.len()) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        // SAFETY: ptsname_r NUL-terminated the name.
        check(unsafe { libc::open(name.as_ptr(), flags) })?
    };
    // SAFETY: slave is a fresh fd owned by nobody else.
    Ok((master, unsafe { OwnedFd::from_raw_fd(slave) }))
}

/// Sets a PTY's size; the kernel tells the foreground group (SIGWINCH).
pub fn set_window_size(fd: RawFd, size: PtySize) {
    let winsize = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize from the valid pointer.
    unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &winsize) };
}
