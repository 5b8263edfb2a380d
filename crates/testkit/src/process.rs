//! Processes a test starts and must stop: a [`Process`] leads a process
//! group of its own and is stopped by that group's id (never by name), and
//! [`ShoalUp`] is a real `shoal up` built on it, started from an
//! [`UpConfig`] (state directory, database, extra flags and environment),
//! ready once it answers `/readyz`, with its URL, API tokens, signals and
//! restarts on the same state. Its stderr goes to `up.log` in the state
//! directory, whose tail is printed when the test fails.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub use libc::{SIGKILL, SIGTERM};

/// Sends `signal` to process `pid` alone (not its group), e.g. to a QEMU
/// process a killed control plane left behind.
pub fn signal_pid(pid: u32, signal: i32) {
    // SAFETY: kill(2) has no memory effects; callers name processes of their
    // own test.
    unsafe { libc::kill(pid as i32, signal) };
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("finding a free port")
        .port()
}

/// Whether `pid` is a live process (a zombie is not).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which may itself hold ") ".
        Ok(stat) => stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .is_some_and(|state| state != "Z"),
        Err(_) => false,
    }
}

/// A child process of the test's, leading a process group of its own so
/// that a signal reaches whatever it runs (`ip netns exec` and the like)
/// and nothing else; SIGTERM to the group when dropped while it runs.
pub struct Process(Child);

impl Process {
    /// Spawns `command` with stdout discarded and stderr appended to `log`
    /// (appended, so that a restarted process adds to its predecessor's).
    pub fn spawn(command: &mut Command, log: &Path) -> Process {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap_or_else(|e| panic!("opening the log {}: {e}", log.display()));
        let child = command
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {:?}: {e}", command.get_program()));
        Process(child)
    }

    pub fn id(&self) -> u32 {
        self.0.id()
    }

    /// Whether it has not exited yet.
    pub fn running(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }

    /// Sends `signal` to its process group and waits for it to exit; does
    /// nothing once it has exited (its group id may be reused by then).
    pub fn signal(&mut self, signal: i32) {
        if self.running() {
            // SAFETY: kill(2) on the process group of a child we spawned
            // and have not reaped.
            unsafe { libc::kill(-(self.0.id() as i32), signal) };
            let _ = self.0.wait();
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.signal(SIGTERM);
    }
}

/// How to start a `shoal up`; [`UpConfig::start`] starts it. Always given:
/// `--listen` on a free loopback port, `--state-dir`, `--cache-dir`
/// ([`crate::cache_dir`]), `--guest-agent` ([`crate::guest_agent`]) and
/// `--database-url` (by default SQLite in the state directory, the
/// product's own default).
#[derive(Clone, Debug)]
pub struct UpConfig {
    shoal: PathBuf,
    state: PathBuf,
    database_url: Option<String>,
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
    ready_within: Duration,
}

impl UpConfig {
    /// `shoal` is the binary under test (`env!("CARGO_BIN_EXE_shoal")`),
    /// `state` its state directory, which must exist.
    pub fn new(shoal: impl Into<PathBuf>, state: impl Into<PathBuf>) -> UpConfig {
        UpConfig {
            shoal: shoal.into(),
            state: state.into(),
            database_url: None,
            args: Vec::new(),
            envs: Vec::new(),
            ready_within: Duration::from_secs(300),
        }
    }

    /// The database (`sqlite:PATH` or `postgres://...`).
    pub fn database_url(mut self, url: &str) -> UpConfig {
        self.database_url = Some(url.to_owned());
        self
    }

    /// More flags for `shoal up` (`--max-sandboxes 1`, `--reap-interval 1`...).
    pub fn args<I, S>(mut self, args: I) -> UpConfig
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// An environment variable for `shoal up` (`RUST_LOG`...).
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> UpConfig {
        self.envs.push((key.into(), value.into()));
        self
    }

    /// How long it may take to answer `/readyz` (default five minutes; a
    /// first start that bakes templates wants more).
    pub fn ready_within(mut self, limit: Duration) -> UpConfig {
        self.ready_within = limit;
        self
    }

    /// Starts `shoal up` and waits until it answers `/readyz`; fails the
    /// test, with the log's tail, if it exits first or does not answer in
    /// time.
    pub async fn start(self) -> ShoalUp {
        let port = free_port();
        let mut command = Command::new(&self.shoal);
        command
            .args(["up", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--state-dir")
            .arg(&self.state)
            .arg("--cache-dir")
            .arg(crate::cache_dir())
            .arg("--guest-agent")
            .arg(crate::guest_agent())
            .args(["--database-url", &self.effective_database_url()])
            .args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)));
        let mut up = ShoalUp {
            process: Process::spawn(&mut command, &self.state.join("up.log")),
            base: format!("http://127.0.0.1:{port}"),
            config: self,
        };
        up.wait_ready().await;
        up
    }

    fn effective_database_url(&self) -> String {
        self.database_url
            .clone()
            .unwrap_or_else(|| format!("sqlite:{}", self.state.join("shoal.db").display()))
    }
}

/// A running `shoal up` of the test's (see [`UpConfig`]): SIGTERM to its
/// process group when dropped, with its log's tail printed if the test is
/// failing.
pub struct ShoalUp {
    config: UpConfig,
    process: Process,
    base: String,
}

impl ShoalUp {
    /// Its API's URL, `http://127.0.0.1:PORT` (a new port each life).
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Its process id (the leader of its process group).
    pub fn pid(&self) -> u32 {
        self.process.id()
    }

    /// The database it runs on.
    pub fn database_url(&self) -> String {
        self.config.effective_database_url()
    }

    pub fn state(&self) -> &Path {
        &self.config.state
    }

    /// Its stderr, over every life.
    pub fn log(&self) -> PathBuf {
        self.config.state.join("up.log")
    }

    /// A new team-tier API token for `account` (see [`crate::api_token`]).
    pub fn token(&self, account: &str) -> String {
        self.token_of_tier(account, "team")
    }

    /// A new API token for `account` on `tier` (free, pro or team).
    pub fn token_of_tier(&self, account: &str, tier: &str) -> String {
        crate::api_token_of_tier(
            &self.config.shoal,
            &self.database_url(),
            account,
            tier,
            Some(&self.config.state),
        )
    }

    /// Sends `signal` to its process group and waits for it to exit:
    /// [`SIGKILL`] to crash it (QEMU runs in groups of its own and outlives
    /// it), [`SIGTERM`] to stop it.
    pub fn signal(&mut self, signal: i32) {
        self.process.signal(signal);
    }

    /// Stops it if it still runs (SIGTERM), then starts it again with the
    /// same configuration, state directory and database, and waits until it
    /// answers; [`ShoalUp::base`] then names the new life's port.
    pub async fn restart(&mut self) {
        self.signal(SIGTERM);
        *self = self.config.clone().start().await;
    }

    async fn wait_ready(&mut self) {
        let http = reqwest::Client::new();
        let url = format!("{}/readyz", self.base);
        let deadline = Instant::now() + self.config.ready_within;
        loop {
            let answer = http.get(&url).timeout(Duration::from_secs(10)).send().await;
            if answer.is_ok_and(|r| r.status().is_success()) {
                return;
            }
            assert!(
                self.process.running(),
                "shoal up exited before answering /readyz; {}",
                self.log_tail()
            );
            assert!(
                Instant::now() < deadline,
                "shoal up did not answer /readyz within {:?}; {}",
                self.config.ready_within,
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The last lines of its log, for a failure message.
    fn log_tail(&self) -> String {
        const LINES: usize = 40;
        let log = std::fs::read_to_string(self.log()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(LINES)..].join("\n");
        format!("the end of {}:\n{tail}", self.log().display())
    }
}

impl Drop for ShoalUp {
    fn drop(&mut self) {
        // A failing test's assertion says what went wrong; the log says why.
        if std::thread::panicking() {
            eprintln!("{}", self.log_tail());
        }
        // The process's own drop stops it.
    }
}
