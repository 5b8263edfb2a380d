//! Drives [`ReplSession`] against the real guest agent running on this host
//! (`--connect <socket> --test-mode`, as `crates/guest-agent/tests` does),
//! with the host's python3 as the guest's: start, state, output, errors,
//! timeouts (interrupted, and killed), a dead kernel, close and drop.

use shoal_proto::client::AgentClient;
use shoal_repl::{CellOutput, ReplError, ReplSession};
use shoal_testkit::{alive, LocalAgent};
use std::time::{Duration, Instant};

/// The real guest agent as a host process; the kernels the test registered
/// are killed (by their groups) when it is dropped, then the agent.
struct Agent {
    kernels: Vec<u32>,
    _agent: LocalAgent,
}

impl Agent {
    async fn start() -> (Agent, AgentClient) {
        Agent::start_with_path(None).await
    }

    /// `path` replaces the agent's (and so its execs') PATH.
    async fn start_with_path(path: Option<&str>) -> (Agent, AgentClient) {
        let binary = tokio::task::spawn_blocking(shoal_testkit::guest_agent)
            .await
            .unwrap();
        let (agent, stream) = LocalAgent::spawn(binary, path).await;
        let client = AgentClient::connect(stream).await.unwrap();
        let agent = Agent {
            kernels: Vec::new(),
            _agent: agent,
        };
        (agent, client)
    }

    async fn session(&mut self, client: &AgentClient) -> ReplSession {
        let session = ReplSession::start(client).await.unwrap();
        self.kernels.push(session.pid());
        session
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Kernels the test left behind (it failed half-way): each leads its
        // own process group, which the agent made.
        for &pid in &self.kernels {
            if alive(pid) {
                // SAFETY: kill has no memory effects; the group is one this
                // test's agent started.
                unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
            }
        }
    }
}

async fn gone(pid: u32) -> bool {
    shoal_testkit::wait_until(Duration::from_secs(5), || async move { !alive(pid) }).await
}

fn value(out: &CellOutput) -> &str {
    out.results[0]["text/plain"].as_str().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_run_keep_state_and_close() {
    let (mut agent, client) = Agent::start().await;
    let mut session = agent.session(&client).await;
    let pid = session.pid();
    assert!(alive(pid));
    assert!(session.python_version().starts_with("3."), "{session:?}");

    let out = session.run("x = 6 * 7\nprint('hi')", None).await.unwrap();
    assert_eq!(out.stdout, "hi\n");
    assert_eq!((out.exit_code, out.error.as_deref()), (0, None));
    assert!(out.results.is_empty());

    let out = session.run("x", None).await.unwrap();
    assert_eq!(value(&out), "42");

    let out = session
        .run("1/0", Some(Duration::from_secs(10)))
        .await
        .unwrap();
    assert_eq!(out.exit_code, 1);
    assert!(out
        .error
        .unwrap()
        .ends_with("ZeroDivisionError: division by zero"));

    let out = session.run("", None).await.unwrap();
    assert_eq!(
        out,
        CellOutput {
            duration_ms: out.duration_ms,
            ..empty()
        }
    );

    // Replies far larger than the agent's stream window and frames.
    let out = session
        .run("print('y' * 3_000_000)\n'z' * 1_000_000", None)
        .await
        .unwrap();
    assert_eq!(out.stdout.len(), 3_000_001);
    assert_eq!(value(&out).len(), 1_000_002);

    // The serialized form is the contract's.
    let json = serde_json::to_value(session.run("x + 1", None).await.unwrap()).unwrap();
    assert_eq!(json["results"][0]["text/plain"], "43");
    assert_eq!(json["exit_code"], 0);
    assert!(json["duration_ms"].is_u64());

    session.close().await;
    assert!(gone(pid).await, "the kernel is killed by close");
}

fn empty() -> CellOutput {
    CellOutput {
        stdout: String::new(),
        stderr: String::new(),
        error: None,
        exit_code: 0,
        results: Vec::new(),
        duration_ms: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_interrupts_the_cell_and_the_session_goes_on() {
    let (mut agent, client) = Agent::start().await;
    let mut session = agent.session(&client).await;
    session.run("kept = 'old'", None).await.unwrap();

    let started = Instant::now();
    let result = session
        .run("while True:\n    pass", Some(Duration::from_secs(1)))
        .await;
    let took = started.elapsed();
    assert!(
        matches!(result, Err(ReplError::Timeout { killed: false })),
        "{result:?}"
    );
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(3),
        "{took:?}"
    );

    let out = session
        .run("kept", Some(Duration::from_secs(10)))
        .await
        .unwrap();
    assert_eq!(value(&out), "'old'");

    // A cell waiting on a subprocess is interrupted too, and the
    // subprocess goes with it.
    let result = session
        .run(
            "import subprocess\nsubprocess.run(['sleep', '60'])",
            Some(Duration::from_millis(500)),
        )
        .await;
    assert!(
        matches!(result, Err(ReplError::Timeout { killed: false })),
        "{result:?}"
    );
    let out = session.run("kept * 2", None).await.unwrap();
    assert_eq!(value(&out), "'oldold'");
    session.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cell_that_ignores_the_interrupt_gets_its_kernel_killed() {
    let (mut agent, client) = Agent::start().await;
    let mut session = agent.session(&client).await;
    let pid = session.pid();
    let started = Instant::now();
    let result = session
        .run(
            "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass",
            Some(Duration::from_secs(1)),
        )
        .await;
    assert!(
        matches!(result, Err(ReplError::Timeout { killed: true })),
        "{result:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(6));
    assert!(session.is_dead());
    assert!(matches!(session.run("1", None).await, Err(ReplError::Dead)));
    assert!(gone(pid).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_that_exits_is_dead() {
    let (mut agent, client) = Agent::start().await;
    let mut session = agent.session(&client).await;
    let result = session.run("import os\nos._exit(5)", None).await;
    assert!(matches!(result, Err(ReplError::Dead)), "{result:?}");
    assert!(matches!(session.run("1", None).await, Err(ReplError::Dead)));
    // Sessions are independent: another one starts and runs.
    let mut other = agent.session(&client).await;
    assert_eq!(value(&other.run("2 + 2", None).await.unwrap()), "4");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reply_of_an_abandoned_run_is_not_taken_for_the_next() {
    let (mut agent, client) = Agent::start().await;
    let mut session = agent.session(&client).await;
    let abandoned = tokio::time::timeout(
        Duration::from_millis(200),
        session.run("import time\ntime.sleep(0.5)\n'first'", None),
    )
    .await;
    assert!(abandoned.is_err());
    let out = session.run("'second'", None).await.unwrap();
    assert_eq!(value(&out), "'second'");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_session_kills_its_kernel() {
    let (mut agent, client) = Agent::start().await;
    let session = agent.session(&client).await;
    let pid = session.pid();
    drop(session);
    assert!(gone(pid).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_without_python_says_so() {
    let empty = std::env::temp_dir().join(format!("shoal-repl-empty-path-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let (_agent, client) = Agent::start_with_path(Some(empty.to_str().unwrap())).await;
    let result = ReplSession::start(&client).await;
    assert!(matches!(result, Err(ReplError::NoPython)), "{result:?}");
    let _ = std::fs::remove_dir(&empty);
}
