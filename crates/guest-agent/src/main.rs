//! `shoal-guest-agent`: the agent inside every Shoal guest. It serves the
//! host's calls (exec, files, PTY, identity) over one channel: by default
//! the virtio-serial port `org.shoal.agent`, or a unix socket for tests.
//!
//! Owns: the command line, opening the channel, the read loop that
//! dispatches the host's frames, and staying alive (as PID 1 it must never
//! exit or panic out). Does not own: what each call does (`exec`, `files`,
//! `identity`), PID 1 setup (`init`) or reaping (`reaper`).
//!
//! Threads: one reads the channel and dispatches; each exec, download and
//! slow file call gets a thread of its own (`threads`: a few are kept
//! parked), so a long exec never blocks others; one reaper collects every
//! child. All frames go out through one writer.

mod calls;
mod errors;
mod exec;
mod files;
mod identity;
mod image;
mod init;
mod reaper;
mod threads;
mod warm;

use calls::{CallKind, Calls, ExecControl, Outbox, Stream, Upload};
use errors::CallError;
use shoal_proto::{
    read_frame, CallId, Frame, GuestMsg, HostMsg, ProtoError, AGENT_PORT_NAME, PROTOCOL_VERSION,
};
use std::io::{self, BufReader, Read, Write};
use std::path::PathBuf;
use std::sync::atomic::AtomicI32;
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::Duration;

const USAGE: &str = "\
usage: shoal-guest-agent [--init] [--port NAME | --device PATH | --connect SOCKET] [--test-mode]

  --init            run as the guest's PID 1: mount /dev/pts, /dev/shm, /run,
                    /tmp, set PATH and HOME, bring up lo, reap orphans; never exit
  --port NAME       serve the virtio-serial port NAME (default org.shoal.agent),
                    found through /sys/class/virtio-ports
  --device PATH     serve this character device instead
  --connect SOCKET  connect to a unix socket and serve it (tests); exits when
                    the host closes it, unless --init
  --test-mode       Identity only validates and answers Done instead of
                    changing the hostname, clock and RNG (also
                    SHOAL_AGENT_TEST_MODE=1)
  --version         print the version";

/// How long to sleep when the virtio port reads EOF (no host connected).
const IDLE_POLL: Duration = Duration::from_millis(20);
/// How long a `Sync` (before a template is saved) waits for the agent's own
/// background work to settle.
const SETTLE_WITHIN: Duration = Duration::from_secs(10);
/// The same for `Settle`, which a fork point waits for.
const SETTLE_BEFORE_FORK_WITHIN: Duration = Duration::from_secs(2);
const REOPEN_DELAY: Duration = Duration::from_millis(500);

/// Where the host is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Port(String),
    Device(PathBuf),
    Connect(PathBuf),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Args {
    init: bool,
    target: Target,
    test_mode: bool,
}

enum Parsed {
    Run(Args),
    Exit(i32, String),
}

fn parse_args(mut argv: impl Iterator<Item = String>) -> Parsed {
    let mut args = Args {
        init: false,
        target: Target::Port(AGENT_PORT_NAME.to_owned()),
        test_mode: std::env::var("SHOAL_AGENT_TEST_MODE").is_ok_and(|v| v == "1"),
    };
    while let Some(arg) = argv.next() {
        let mut value = |flag: &str| argv.next().ok_or(format!("{flag} needs a value"));
        let target = match arg.as_str() {
            "--init" => {
                args.init = true;
                continue;
            }
            "--test-mode" | "--no-identity" => {
                args.test_mode = true;
                continue;
            }
            "--version" => return Parsed::Exit(0, env!("CARGO_PKG_VERSION").to_owned()),
            "--help" | "-h" => return Parsed::Exit(0, USAGE.to_owned()),
            "--port" => value("--port").map(Target::Port),
            "--device" => value("--device").map(|v| Target::Device(v.into())),
            "--connect" => value("--connect").map(|v| Target::Connect(v.into())),
            other => Err(format!("unknown argument {other:?}")),
        };
        match target {
            Ok(target) => args.target = target,
            Err(message) => return Parsed::Exit(2, format!("{message}\n{USAGE}")),
        }
    }
    Parsed::Run(args)
}

/// Logs to stderr, which is the console when the agent is PID 1.
pub fn log(message: &str) {
    eprintln!("shoal-guest-agent: {message}");
}

/// Everything the call threads share.
pub struct Agent {
    pub outbox: Outbox,
    pub calls: Calls,
    pub reaper: Arc<reaper::Reaper>,
    pub warm: warm::WarmShells,
    pub threads: Arc<threads::CallThreads>,
    pub test_mode: bool,
}

fn main() {
    let args = match parse_args(std::env::args().skip(1)) {
        Parsed::Run(args) => args,
        Parsed::Exit(code, message) => {
            if code == 0 {
                println!("{message}");
            } else {
                eprintln!("{message}");
            }
            // PID 1 must not exit over a typo in its command line.
            if std::process::id() != 1 {
                std::process::exit(code);
            }
            Args {
                init: true,
                target: Target::Port(AGENT_PORT_NAME.to_owned()),
                test_mode: false,
            }
        }
    };
    if args.init {
        ensure_stdio(c"/dev/console");
        init::setup();
    } else {
        ensure_stdio(c"/dev/null");
        // Orphans of our execs come to us, as they would to PID 1, so the
        // host-side tests see the same reaping as a guest.
        // SAFETY: prctl with integer arguments only.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    }
    let agent = Arc::new(Agent {
        outbox: Outbox::new(Box::new(io::sink())),
        calls: Calls::default(),
        reaper: reaper::Reaper::start(),
        warm: warm::WarmShells::default(),
        threads: Arc::default(),
        test_mode: args.test_mode,
    });
    agent.threads.start();
    agent.warm.refill(&agent);
    identity::prepare();
    loop {
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve(&agent, &args)));
        if !args.init {
            std::process::exit(if outcome.is_ok() { 0 } else { 101 });
        }
        log("the channel loop stopped; restarting it");
        std::thread::sleep(REOPEN_DELAY);
    }
}

/// Makes sure fds 0-2 are open, so no channel or pipe fd ever lands on
/// them and gets clobbered when a child's stdio is set up.
fn ensure_stdio(fallback: &std::ffi::CStr) {
    for fd in 0..3 {
        // SAFETY: F_GETFD on any number only queries.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0 {
            continue;
        }
        // SAFETY: valid NUL-terminated paths; open returns the lowest free
        // fd, which is `fd` since the lower ones are open.
        unsafe {
            let mut opened = libc::open(fallback.as_ptr(), libc::O_RDWR | libc::O_NOCTTY);
            if opened < 0 {
                opened = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
            }
            if opened >= 0 && opened != fd {
                libc::dup2(opened, fd);
                libc::close(opened);
            }
        }
    }
}

/// An open channel to the host.
struct Channel {
    reader: Box<dyn Read + Send>,
    writer: Box<dyn Write + Send>,
    /// On a virtio port, EOF only means no host is connected right now.
    eof_means_idle: bool,
}

/// Finds the virtio-serial port by name in sysfs (the guest has no udev,
/// so /dev/virtio-ports/<name> does not exist).
fn find_port(name: &str) -> io::Result<PathBuf> {
    for entry in std::fs::read_dir("/sys/class/virtio-ports")? {
        let entry = entry?;
        let port_name = std::fs::read_to_string(entry.path().join("name")).unwrap_or_default();
        if port_name.trim() == name {
            return Ok(PathBuf::from("/dev").join(entry.file_name()));
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("no virtio-serial port named {name}"),
    ))
}

fn open_channel(target: &Target) -> io::Result<Channel> {
    match target {
        Target::Connect(path) => {
            let stream = std::os::unix::net::UnixStream::connect(path)?;
            Ok(Channel {
                reader: Box::new(stream.try_clone()?),
                writer: Box::new(stream),
                eof_means_idle: false,
            })
        }
        Target::Port(_) | Target::Device(_) => {
            let path = match target {
                Target::Port(name) => find_port(name)?,
                Target::Device(path) => path.clone(),
                Target::Connect(_) => unreachable!("handled above"),
            };
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)?;
            Ok(Channel {
                reader: Box::new(file.try_clone()?),
                writer: Box::new(file),
                eof_means_idle: true,
            })
        }
    }
}

/// Opens the channel and serves it; returns only when a `--connect` host
/// hung up (and we are not PID 1).
fn serve(agent: &Arc<Agent>, args: &Args) {
    let mut reported = false;
    loop {
        let channel = match open_channel(&args.target) {
            Ok(channel) => channel,
            Err(err) => {
                if !reported {
                    log(&format!(
                        "cannot open the host channel {:?}: {err}",
                        args.target
                    ));
                    reported = true;
                }
                if matches!(args.target, Target::Connect(_)) && !args.init {
                    return;
                }
                std::thread::sleep(REOPEN_DELAY);
                continue;
            }
        };
        reported = false;
        agent.outbox.replace(channel.writer);
        read_loop(agent, channel.reader, channel.eof_means_idle);
        if matches!(args.target, Target::Connect(_)) && !args.init {
            return;
        }
        std::thread::sleep(REOPEN_DELAY);
    }
}

/// Reads and dispatches frames until the channel fails for good.
fn read_loop(agent: &Arc<Agent>, reader: Box<dyn Read + Send>, eof_means_idle: bool) {
    let mut reader = BufReader::with_capacity(256 * 1024, reader);
    loop {
        match read_frame::<HostMsg, _>(&mut reader) {
            Ok(frame) => dispatch(agent, frame),
            Err(ProtoError::Closed) if eof_means_idle => std::thread::sleep(IDLE_POLL),
            Err(ProtoError::Io(err))
                if eof_means_idle && err.kind() == io::ErrorKind::UnexpectedEof =>
            {
                // The host went away mid-frame; the rest of it is lost.
                std::thread::sleep(IDLE_POLL);
            }
            Err(ProtoError::Closed) => return,
            Err(ProtoError::Io(err)) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(ProtoError::Io(err)) => {
                log(&format!("reading the host channel failed: {err}"));
                return;
            }
            // The reader finds the next frame by its magic.
            Err(
                err @ (ProtoError::BadHeader(_)
                | ProtoError::HeaderTooLarge(_)
                | ProtoError::PayloadTooLarge(_)),
            ) => {
                log(&format!("skipping a bad frame: {err}"));
            }
        }
    }
}

fn spawn_call(agent: &Arc<Agent>, id: CallId, name: &str, work: impl FnOnce() + Send + 'static) {
    if let Err(err) = agent.threads.run(format!("{name}-{id}"), work) {
        let msg = CallError::new(
            shoal_proto::ErrorKind::Io,
            format!("cannot start a thread for {name}: {err}"),
        );
        agent.outbox.send(Frame::new(id, msg.into_msg()));
    }
}

/// Runs `work` on its own thread and sends its single answer.
fn answer_later(
    agent: &Arc<Agent>,
    id: CallId,
    name: &str,
    work: impl FnOnce() -> Result<GuestMsg, CallError> + Send + 'static,
) {
    let worker = agent.clone();
    spawn_call(agent, id, name, move || {
        let msg = work().unwrap_or_else(CallError::into_msg);
        worker.outbox.send(Frame::new(id, msg));
    });
}

fn dispatch(agent: &Arc<Agent>, frame: Frame<HostMsg>) {
    let id = frame.id;
    let reply = |msg: GuestMsg| agent.outbox.send(Frame::new(id, msg));
    match frame.msg {
        HostMsg::Hello { .. } => {
            agent.calls.cancel_all();
            reply(GuestMsg::Hello {
                protocol: PROTOCOL_VERSION,
                agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            });
        }
        HostMsg::Ping => reply(GuestMsg::Pong),
        HostMsg::Identity {
            hostname,
            unix_time_ns,
        } => {
            let result = if agent.test_mode {
                identity::check_hostname(&hostname)
            } else {
                identity::apply(&hostname, unix_time_ns, &frame.payload)
            };
            reply(match result {
                Ok(()) => GuestMsg::Done,
                Err(err) => err.into_msg(),
            });
        }
        HostMsg::Exec {
            cmd,
            env,
            cwd,
            timeout_ms,
            kill_grace_ms,
            warn_signal,
            pty,
            stdin,
        } => {
            let (stdin_tx, stdin_rx) = mpsc::channel();
            let takes_input = stdin || pty.is_some();
            let control = Arc::new(ExecControl {
                stream: Stream::new(),
                pgid: AtomicI32::new(0),
                stdin: Mutex::new(takes_input.then_some(stdin_tx)),
                pty: OnceLock::new(),
            });
            let token = agent.calls.insert(id, CallKind::Exec(control.clone()));
            let spec = exec::ExecSpec {
                cmd,
                env,
                cwd,
                timeout_ms,
                kill_grace_ms,
                warn_signal: warn_signal.map(|w| (w.signal, w.before_ms)),
                pty,
                stdin,
                ids: None,
            };
            let worker = agent.clone();
            spawn_call(agent, id, "exec", move || {
                exec::run(&worker, id, token, spec, control, stdin_rx)
            });
        }
        HostMsg::Stdin { eof } => {
            if let Some(CallKind::Exec(control)) = agent.calls.get(id) {
                control.send_stdin(frame.payload, eof);
            }
        }
        HostMsg::Resize(size) => {
            if let Some(CallKind::Exec(control)) = agent.calls.get(id) {
                control.resize(size);
            }
        }
        HostMsg::Signal { signal } => {
            if let Some(CallKind::Exec(control)) = agent.calls.get(id) {
                control.signal(signal);
            }
        }
        HostMsg::Credit { bytes } => match agent.calls.get(id) {
            Some(CallKind::Exec(control)) => control.stream.add_credit(bytes),
            Some(CallKind::Download(stream)) => stream.add_credit(bytes),
            _ => {}
        },
        HostMsg::Cancel => agent.calls.cancel(id),
        HostMsg::ReadFile { path } => {
            let stream = Stream::new();
            let token = agent.calls.insert(id, CallKind::Download(stream.clone()));
            let worker = agent.clone();
            spawn_call(agent, id, "read", move || {
                files::download(&worker, id, token, &path, &stream)
            });
        }
        HostMsg::WriteFile { path, mode } => match files::open_for_upload(&path, mode) {
            Ok(file) => {
                agent
                    .calls
                    .insert(id, CallKind::Upload(Arc::new(Upload { file, path })));
            }
            Err(err) => reply(err.into_msg()),
        },
        HostMsg::Data => {
            if let Some(CallKind::Upload(upload)) = agent.calls.get(id) {
                if let Err(err) = (&upload.file).write_all(&frame.payload) {
                    // The rest of this upload's frames find no entry and
                    // are ignored.
                    agent.calls.cancel(id);
                    reply(CallError::io(&err, &upload.path).into_msg());
                }
            }
        }
        HostMsg::End => {
            if let Some(CallKind::Upload(_)) = agent.calls.get(id) {
                agent.calls.cancel(id);
                reply(GuestMsg::Done);
            }
        }
        HostMsg::ListDir { path } => answer_later(agent, id, "list", move || {
            files::list_dir(&path).map(|entries| GuestMsg::DirEntries { entries })
        }),
        HostMsg::Stat { path } => answer_later(agent, id, "stat", move || {
            files::stat(&path).map(GuestMsg::Stat)
        }),
        HostMsg::Remove { path, recursive } => answer_later(agent, id, "remove", move || {
            files::remove(&path, recursive).map(|()| GuestMsg::Done)
        }),
        HostMsg::MakeDir { path } => answer_later(agent, id, "mkdir", move || {
            files::make_dir(&path).map(|()| GuestMsg::Done)
        }),
        HostMsg::Settle => answer_later(agent, id, "settle", {
            let agent = agent.clone();
            move || {
                agent.warm.settle(SETTLE_BEFORE_FORK_WITHIN);
                Ok(GuestMsg::Done)
            }
        }),
        HostMsg::Sync => answer_later(agent, id, "sync", {
            let agent = agent.clone();
            move || {
                agent.warm.settle(SETTLE_WITHIN);
                files::sync();
                Ok(GuestMsg::Done)
            }
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Parsed {
        parse_args(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn defaults_to_the_agent_port() {
        let Parsed::Run(args) = parse(&[]) else {
            panic!("should run")
        };
        assert_eq!(args.target, Target::Port(AGENT_PORT_NAME.to_owned()));
        assert!(!args.init);
    }

    #[test]
    fn connect_and_init_flags_parse() {
        let Parsed::Run(args) = parse(&["--init", "--connect", "/tmp/s", "--test-mode"]) else {
            panic!("should run")
        };
        assert!(args.init && args.test_mode);
        assert_eq!(args.target, Target::Connect("/tmp/s".into()));
    }

    #[test]
    fn unknown_flags_are_refused() {
        assert!(matches!(parse(&["--bogus"]), Parsed::Exit(2, _)));
        assert!(matches!(parse(&["--connect"]), Parsed::Exit(2, _)));
    }
}
