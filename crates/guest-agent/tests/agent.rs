//! Runs the real `shoal-guest-agent` binary on this host, connected to a
//! unix socket (`--connect`, `--test-mode`), and drives it with the real
//! host client (`shoal_proto::client`): exec, PTY, stdin, timeouts, flow
//! control, files, and garbage on the channel.
//!
//! Does not cover what only a guest can show (PID 1 setup, the virtio
//! port, the real effect of Identity); those run inside VMs.

use shoal_proto::client::{AgentClient, AgentError, ExecEvent, ExecRequest};
use shoal_proto::{
    encode, ErrorKind, Frame, GuestMsg, HostMsg, PtySize, MAX_CHUNK, PROTOCOL_VERSION,
    STREAM_WINDOW,
};
use shoal_testkit::LocalAgent;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

/// The agent under test, built with this crate, as a host process.
struct Agent(LocalAgent);

impl Agent {
    /// Spawns the agent and returns it with the accepted host end.
    async fn spawn() -> (Agent, UnixStream) {
        let binary = Path::new(env!("CARGO_BIN_EXE_shoal-guest-agent"));
        let (agent, stream) = LocalAgent::spawn(binary, None).await;
        (Agent(agent), stream)
    }

    async fn client() -> (Agent, AgentClient) {
        let (agent, stream) = Agent::spawn().await;
        let client = AgentClient::connect(stream).await.unwrap();
        (agent, client)
    }

    fn path(&self, name: &str) -> String {
        self.0.dir.join(name).to_string_lossy().into_owned()
    }
}

async fn run(client: &AgentClient, cmd: &str) -> shoal_proto::client::ExecOutput {
    tokio::time::timeout(
        Duration::from_secs(30),
        client.exec_collect(ExecRequest::new(cmd)),
    )
    .await
    .expect("the exec finishes")
    .unwrap()
}

/// One process of the host as `/proc/PID/stat` shows it.
struct Process {
    dir: std::path::PathBuf,
    /// The whole stat line.
    stat: String,
    pid: u32,
    command: String,
    /// The fields after the parenthesised command: state ppid pgrp ...
    fields: Vec<String>,
}

fn processes() -> Vec<Process> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let Ok(pid) = stat[..open].trim().parse() else {
            continue;
        };
        found.push(Process {
            dir: entry.path(),
            pid,
            command: stat[open + 1..close].to_string(),
            fields: stat[close + 2..].split(' ').map(str::to_string).collect(),
            stat,
        });
    }
    found
}

/// Live (not zombie) processes whose process group is `pgid`.
fn live_members(pgid: u32) -> Vec<String> {
    processes()
        .into_iter()
        .filter(|p| p.fields.len() > 2 && p.fields[2] == pgid.to_string() && p.fields[0] != "Z")
        .map(|p| p.stat)
        .collect()
}

fn kill_group(pgid: u32) {
    // SAFETY: kill has no memory effects; the group is one our test made.
    unsafe { libc::kill(-(pgid as i32), libc::SIGKILL) };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_output_and_exit_codes() {
    let (_agent, client) = Agent::client().await;
    assert!(!client.agent_version().is_empty());
    client.ping().await.unwrap();

    let out = run(&client, "echo hello; echo oops >&2").await;
    assert_eq!(out.stdout, b"hello\n");
    assert_eq!(out.stderr, b"oops\n");
    assert_eq!(out.status.code, Some(0));
    assert!(out.status.success());

    let out = run(&client, "exit 3").await;
    assert_eq!((out.status.code, out.status.signal), (Some(3), None));

    let out = run(&client, "definitely-not-a-command-xyz").await;
    assert_eq!(out.status.code, Some(127));

    let out = run(&client, "kill -9 $$").await;
    assert_eq!((out.status.code, out.status.signal), (None, Some(9)));
    assert!(!out.status.timed_out);

    let req = ExecRequest::new("echo \"$GREETING\"; pwd")
        .env("GREETING", "hi there")
        .cwd("/");
    let out = client.exec_collect(req).await.unwrap();
    assert_eq!(out.stdout, b"hi there\n/\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exit_reports_the_peak_memory_and_cpu_of_the_process_and_its_children() {
    let (_agent, client) = Agent::client().await;
    // A child that holds ~64 MiB and one that spins: both waited for by
    // the shell, so both in its rusage.
    let out = run(
        &client,
        "python3 -c 'x = bytearray(64 << 20); x[::4096] = b\"1\" * len(x[::4096]); print(len(x))'; \
         awk 'BEGIN { for (i = 0; i < 20000000; i++) x += i; print \"spun\" }'",
    )
    .await;
    assert_eq!(out.stdout, b"67108864\nspun\n");
    let usage = out.status.usage.expect("the agent reports usage");
    assert!(
        usage.max_rss_kib >= 60 << 10,
        "peak {} KiB for a 64 MiB string",
        usage.max_rss_kib
    );
    assert!(
        usage.cpu_ms >= 50,
        "cpu {} ms for a busy loop",
        usage.cpu_ms
    );
    let idle = run(&client, "sleep 0.3").await.status.usage.unwrap();
    assert!(idle.max_rss_kib < 60 << 10 && idle.cpu_ms < 200, "{idle:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_cwd_is_not_found() {
    let (_agent, client) = Agent::client().await;
    let err = client
        .exec(ExecRequest::new("true").cwd("/no/such/dir"))
        .await
        .unwrap_err();
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotFound), "{err}");
    assert!(err.to_string().contains("/no/such/dir"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_kills_the_whole_group() {
    let (_agent, client) = Agent::client().await;
    let started = Instant::now();
    let mut handle = client
        .exec(ExecRequest::new("sleep 30 & sleep 30").timeout(Duration::from_millis(500)))
        .await
        .unwrap();
    let pgid = handle.pid();
    let status = loop {
        if let ExecEvent::Exit(status) = handle.next_event().await.unwrap() {
            break status;
        }
    };
    assert!(status.timed_out);
    assert_eq!(status.signal, Some(9));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(status.duration_ms >= 500, "{status:?}");
    let give_up = Instant::now() + Duration::from_secs(3);
    loop {
        let live = live_members(pgid);
        if live.is_empty() {
            break;
        }
        assert!(Instant::now() < give_up, "survivors: {live:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // After Exit nothing more comes.
    assert!(matches!(handle.next_event().await, Err(AgentError::Closed)));
}

/// As Slurm ends a job at its time limit: the `--signal` warning before,
/// SIGTERM at the timeout (a job traps it to checkpoint), SIGKILL after the
/// grace for what ignores it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_with_a_grace_warns_then_terms_then_kills() {
    let (_agent, client) = Agent::client().await;
    let started = Instant::now();
    let script = "trap 'echo warned' USR1; trap 'echo checkpoint; exit 0' TERM; \
                  i=0; while [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done";
    let out = client
        .exec_collect(ExecRequest {
            timeout: Some(Duration::from_millis(1500)),
            kill_grace: Some(Duration::from_secs(5)),
            warn_signal: Some((10, Duration::from_millis(1000))),
            ..ExecRequest::new(script)
        })
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout, "warned\ncheckpoint\n", "{out:?}");
    // It exited by itself within the grace, and is still a timeout.
    assert!(
        out.status.timed_out && out.status.code == Some(0),
        "{:?}",
        out.status
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );

    // What ignores SIGTERM is killed when the grace ends.
    let started = Instant::now();
    let out = client
        .exec_collect(ExecRequest {
            timeout: Some(Duration::from_millis(500)),
            kill_grace: Some(Duration::from_millis(1000)),
            ..ExecRequest::new("trap '' TERM; sleep 30 & wait; sleep 30")
        })
        .await
        .unwrap();
    assert!(
        out.status.timed_out && out.status.signal == Some(9),
        "{:?}",
        out.status
    );
    let took = started.elapsed();
    assert!(
        (Duration::from_millis(1400)..Duration::from_secs(5)).contains(&took),
        "{took:?}"
    );

    // SIGTERM goes to the shell alone (a child that traps it hears
    // nothing); what the shell leaves running goes with it.
    let out = client
        .exec_collect(ExecRequest {
            timeout: Some(Duration::from_millis(500)),
            kill_grace: Some(Duration::from_secs(10)),
            ..ExecRequest::new(
                "trap 'echo shell got TERM; exit 0' TERM; \
                 sh -c 'trap \"echo child got TERM\" TERM; while true; do sleep 0.1; done' & \
                 while true; do sleep 0.1; done",
            )
        })
        .await
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "shell got TERM\n",
        "{out:?}"
    );
    assert!(
        out.status.timed_out && out.status.code == Some(0),
        "{:?}",
        out.status
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_daemons_do_not_hold_the_exec() {
    let (_agent, client) = Agent::client().await;
    for cmd in [
        "nohup sleep 100 >/dev/null 2>&1 &",
        // Keeps the output pipes open: the exec ends after a short silence.
        "echo started; sleep 100 &",
    ] {
        let started = Instant::now();
        let mut handle = client.exec(ExecRequest::new(cmd)).await.unwrap();
        let pgid = handle.pid();
        let mut stdout = Vec::new();
        let status = loop {
            match handle.next_event().await.unwrap() {
                ExecEvent::Stdout(chunk) => stdout.extend(chunk),
                ExecEvent::Stderr(_) => {}
                ExecEvent::Exit(status) => break status,
            }
        };
        assert_eq!(status.code, Some(0), "{cmd}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{cmd} took {:?}",
            started.elapsed()
        );
        if cmd.starts_with("echo") {
            assert_eq!(stdout, b"started\n");
        }
        // The daemon is still alive: only a timeout kills the group.
        assert!(!live_members(pgid).is_empty(), "{cmd}: the daemon died");
        kill_group(pgid);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mebibyte_of_output_arrives_whole() {
    let (_agent, client) = Agent::client().await;
    let out = run(&client, "head -c 1048576 /dev/zero | tr '\\0' x").await;
    assert_eq!(out.status.code, Some(0));
    assert_eq!(out.stdout.len(), 1_048_576);
    assert!(out.stdout.iter().all(|&b| b == b'x'));
    // More than the window, so credit must flow back for it to finish.
    let out = run(&client, "head -c 5000000 /dev/zero").await;
    assert_eq!(out.stdout.len(), 5_000_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_execs_do_not_mix() {
    let (_agent, client) = Agent::client().await;
    let mut tasks = Vec::new();
    for n in 0..8 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let cmd =
                format!("for i in $(seq 1 300); do echo exec-{n}-line-$i; done; echo err-{n} >&2");
            let out = client.exec_collect(ExecRequest::new(cmd)).await.unwrap();
            let expected: String = (1..=300).map(|i| format!("exec-{n}-line-{i}\n")).collect();
            assert_eq!(String::from_utf8(out.stdout).unwrap(), expected);
            assert_eq!(out.stderr, format!("err-{n}\n").into_bytes());
        }));
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .unwrap()
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_reaches_the_command() {
    let (_agent, client) = Agent::client().await;
    let mut handle = client
        .exec(ExecRequest::new("cat; echo done").stdin(true))
        .await
        .unwrap();
    handle.send_stdin(b"hello ", false).await.unwrap();
    let big = vec![b'y'; 3 * MAX_CHUNK + 7];
    handle.send_stdin(&big, false).await.unwrap();
    handle.send_stdin(b"\nbye\n", true).await.unwrap();
    let mut stdout = Vec::new();
    loop {
        match handle.next_event().await.unwrap() {
            ExecEvent::Stdout(chunk) => stdout.extend(chunk),
            ExecEvent::Stderr(_) => {}
            ExecEvent::Exit(status) => {
                assert_eq!(status.code, Some(0));
                break;
            }
        }
    }
    let mut expected = b"hello ".to_vec();
    expected.extend(&big);
    expected.extend(b"\nbye\ndone\n");
    assert_eq!(stdout, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_exec_has_a_terminal_of_the_requested_size() {
    let (_agent, client) = Agent::client().await;
    let req = ExecRequest::new("tty; stty size").pty(PtySize {
        rows: 40,
        cols: 100,
    });
    let out = client.exec_collect(req).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("/dev/pts/"), "{text:?}");
    assert!(text.contains("40 100"), "{text:?}");
    assert!(out.stderr.is_empty());
    assert_eq!(out.status.code, Some(0));

    // Resize while running, and type into the terminal.
    let mut handle = client
        .exec(
            ExecRequest::new("read line; echo \"got $line\"; stty size")
                .pty(PtySize { rows: 24, cols: 80 }),
        )
        .await
        .unwrap();
    handle
        .resize(PtySize {
            rows: 50,
            cols: 120,
        })
        .await
        .unwrap();
    handle.send_stdin(b"typed\n", false).await.unwrap();
    let mut stdout = Vec::new();
    loop {
        match handle.next_event().await.unwrap() {
            ExecEvent::Stdout(chunk) => stdout.extend(chunk),
            ExecEvent::Stderr(_) => panic!("a PTY has no separate stderr"),
            ExecEvent::Exit(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&stdout);
    assert!(text.contains("got typed"), "{text:?}");
    assert!(text.contains("50 120"), "{text:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_reach_the_group() {
    let (_agent, client) = Agent::client().await;
    let mut handle = client.exec(ExecRequest::new("sleep 30")).await.unwrap();
    handle.signal(libc::SIGTERM).await.unwrap();
    let event = tokio::time::timeout(Duration::from_secs(5), handle.next_event())
        .await
        .unwrap()
        .unwrap();
    let ExecEvent::Exit(status) = event else {
        panic!("expected exit, got {event:?}")
    };
    assert_eq!(status.signal, Some(libc::SIGTERM));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_round_trip_and_report_clear_errors() {
    let (agent, client) = Agent::client().await;
    let data: Vec<u8> = (0..10 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let path = agent.path("sub/dir/big.bin");
    let written = client.write_file(&path, None, &data[..]).await.unwrap();
    assert_eq!(written, data.len() as u64);

    let mut download = client.read_file(&path).await.unwrap();
    assert_eq!(download.size(), data.len() as u64);
    let mut offset = 0;
    while let Some(chunk) = download.next_chunk().await.unwrap() {
        assert!(chunk.len() <= MAX_CHUNK);
        assert_eq!(chunk[..], data[offset..offset + chunk.len()]);
        offset += chunk.len();
    }
    assert_eq!(offset, data.len());

    let stat = client.stat(&path).await.unwrap();
    assert_eq!(stat.size, data.len() as u64);
    assert_eq!(stat.name, "big.bin");
    assert_eq!(stat.mode & 0o777, 0o644);
    assert!(!stat.is_dir);

    client
        .write_file(&agent.path("sub/dir/a.txt"), Some(0o600), &b"alpha"[..])
        .await
        .unwrap();
    assert_eq!(
        client
            .read_file_to_vec(&agent.path("sub/dir/a.txt"))
            .await
            .unwrap(),
        b"alpha"
    );
    assert_eq!(
        client
            .stat(&agent.path("sub/dir/a.txt"))
            .await
            .unwrap()
            .mode
            & 0o777,
        0o600
    );
    // Truncates an existing file.
    client
        .write_file(&agent.path("sub/dir/a.txt"), None, &b"b"[..])
        .await
        .unwrap();
    assert_eq!(
        client
            .read_file_to_vec(&agent.path("sub/dir/a.txt"))
            .await
            .unwrap(),
        b"b"
    );
    client
        .make_dir(&agent.path("sub/dir/zdir/inner"))
        .await
        .unwrap();
    let names: Vec<String> = client
        .list_dir(&agent.path("sub/dir"))
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["a.txt", "big.bin", "zdir"]);
    assert!(
        client
            .stat(&agent.path("sub/dir/zdir"))
            .await
            .unwrap()
            .is_dir
    );

    let err = client.stat(&agent.path("missing")).await.unwrap_err();
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotFound));
    assert_eq!(
        err.to_string(),
        format!("no such file or directory: {}", agent.path("missing"))
    );

    let err = client
        .write_file(&agent.path("sub/dir/a.txt/child"), None, &b"x"[..])
        .await
        .unwrap_err();
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotADirectory), "{err}");
    assert!(err.to_string().contains("a.txt/child"), "{err}");

    let err = client
        .write_file("/proc/shoal-no-such/file", None, &data[..])
        .await
        .unwrap_err();
    assert!(err.guest_kind().is_some(), "{err}");
    assert!(
        err.to_string().contains("/proc/shoal-no-such/file"),
        "{err}"
    );

    let err = client.read_file(&agent.path("sub")).await.unwrap_err();
    assert_eq!(err.guest_kind(), Some(ErrorKind::IsADirectory), "{err}");
    let err = client.read_file(&agent.path("nope")).await.unwrap_err();
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotFound), "{err}");

    let err = client.remove(&agent.path("sub"), false).await.unwrap_err();
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotEmpty), "{err}");
    client
        .remove(&agent.path("sub/dir/a.txt"), false)
        .await
        .unwrap();
    client.remove(&agent.path("sub"), true).await.unwrap();
    let err = client.stat(&agent.path("sub")).await.unwrap_err();
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotFound));
    client.sync().await.unwrap();

    // A /proc file has size 0 but content: it streams to EOF.
    let status = client.read_file_to_vec("/proc/self/status").await.unwrap();
    assert!(String::from_utf8_lossy(&status).contains("Pid:"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_in_test_mode_only_validates() {
    let (_agent, client) = Agent::client().await;
    client
        .identity("sbx-test", 1_700_000_000_000_000_000, &[7u8; 64])
        .await
        .unwrap();
    let err = client.identity("bad name!", 0, &[]).await.unwrap_err();
    assert_eq!(err.guest_kind(), Some(ErrorKind::InvalidInput));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_before_hello_is_skipped() {
    let (_agent, mut stream) = Agent::spawn().await;
    let mut garbage = b"random junk \x00\xff SH".to_vec();
    // A frame with a header that is not JSON.
    garbage.extend(b"SHL\x01\x00\x00\x00\x05\x00\x00\x00\x00{bad}");
    // A torn frame whose header length swallows what follows, including
    // the client's first Hello (which the client then repeats).
    garbage.extend(b"SHL\x01\x00\x00\x00\x78\x00\x00\x00\x00");
    stream.write_all(&garbage).await.unwrap();
    let client = AgentClient::connect(stream).await.unwrap();
    client.ping().await.unwrap();
    assert_eq!(run(&client, "echo ok").await.stdout, b"ok\n");
}

/// Speaks the protocol by hand, to see what the agent itself does.
struct RawHost {
    stream: UnixStream,
}

impl RawHost {
    async fn send(&mut self, id: u64, msg: HostMsg, payload: &[u8]) {
        let bytes = encode(&Frame::with_payload(id, msg, payload.to_vec()));
        self.stream.write_all(&bytes).await.unwrap();
    }

    async fn recv(&mut self) -> Frame<GuestMsg> {
        shoal_proto::asynchronous::read_frame(&mut self.stream)
            .await
            .unwrap()
    }

    /// The next frame, or None after `quiet` of silence.
    async fn recv_within(&mut self, quiet: Duration) -> Option<Frame<GuestMsg>> {
        tokio::time::timeout(quiet, self.recv()).await.ok()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_respects_the_credit_window() {
    let (_agent, stream) = Agent::spawn().await;
    let mut host = RawHost { stream };
    host.send(
        1,
        HostMsg::Hello {
            protocol: PROTOCOL_VERSION,
        },
        &[],
    )
    .await;
    assert!(matches!(
        host.recv().await.msg,
        GuestMsg::Hello {
            protocol: PROTOCOL_VERSION,
            ..
        }
    ));
    // Frames for ids nobody runs are ignored.
    host.send(77, HostMsg::Credit { bytes: 5 }, &[]).await;
    host.send(78, HostMsg::Data, b"stray").await;
    host.send(79, HostMsg::End, &[]).await;

    let exec = HostMsg::Exec {
        cmd: "head -c 3000000 /dev/zero".into(),
        env: Default::default(),
        cwd: None,
        timeout_ms: None,
        kill_grace_ms: None,
        warn_signal: None,
        pty: None,
        stdin: false,
    };
    host.send(2, exec, &[]).await;
    let mut received = 0u64;
    while let Some(frame) = host.recv_within(Duration::from_millis(700)).await {
        assert_eq!(frame.id, 2);
        match frame.msg {
            GuestMsg::Started { .. } => {}
            GuestMsg::Stdout => received += frame.payload.len() as u64,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(received, STREAM_WINDOW, "the agent stops at the window");

    // Other calls are not blocked by the stalled one.
    host.send(3, HostMsg::Ping, &[]).await;
    let pong = host.recv().await;
    assert_eq!((pong.id, pong.msg), (3, GuestMsg::Pong));

    host.send(
        2,
        HostMsg::Credit {
            bytes: u64::MAX / 2,
        },
        &[],
    )
    .await;
    loop {
        let frame = host.recv().await;
        match frame.msg {
            GuestMsg::Stdout => received += frame.payload.len() as u64,
            GuestMsg::Exit { code, .. } => {
                assert_eq!(code, Some(0));
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(received, 3_000_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_hello_silences_the_previous_hosts_calls() {
    let (_agent, stream) = Agent::spawn().await;
    let mut host = RawHost { stream };
    host.send(
        1,
        HostMsg::Hello {
            protocol: PROTOCOL_VERSION,
        },
        &[],
    )
    .await;
    host.recv().await;
    let exec = HostMsg::Exec {
        cmd: "echo first; sleep 0.5; echo late; sleep 0.2".into(),
        env: Default::default(),
        cwd: None,
        timeout_ms: None,
        kill_grace_ms: None,
        warn_signal: None,
        pty: None,
        stdin: false,
    };
    host.send(2, exec, &[]).await;
    assert!(matches!(host.recv().await.msg, GuestMsg::Started { .. }));
    assert_eq!(host.recv().await.payload, b"first\n");
    host.send(
        3,
        HostMsg::Hello {
            protocol: PROTOCOL_VERSION,
        },
        &[],
    )
    .await;
    let hello = host.recv().await;
    assert_eq!(hello.id, 3);
    // Neither "late" nor the Exit of call 2 may reach the new host.
    assert!(host
        .recv_within(Duration::from_millis(1500))
        .await
        .is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_handle_leaves_the_connection_usable() {
    let (_agent, client) = Agent::client().await;
    let mut handle = client.exec(ExecRequest::new("yes")).await.unwrap();
    let pgid = handle.pid();
    assert!(matches!(
        handle.next_event().await.unwrap(),
        ExecEvent::Stdout(_)
    ));
    drop(handle);
    let mut download = client.read_file("/dev/zero").await.unwrap();
    download.next_chunk().await.unwrap().unwrap();
    drop(download);
    client.ping().await.unwrap();
    assert_eq!(run(&client, "echo still").await.stdout, b"still\n");
    kill_group(pgid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_calls_fail_with_closed_when_the_agent_dies() {
    let (mut agent, client) = Agent::client().await;
    let mut handle = client.exec(ExecRequest::new("sleep 30")).await.unwrap();
    let pgid = handle.pid();
    agent.0.child.kill().unwrap();
    let result = tokio::time::timeout(Duration::from_secs(5), handle.next_event())
        .await
        .unwrap();
    assert!(matches!(result, Err(AgentError::Closed)), "{result:?}");
    assert!(matches!(client.ping().await, Err(AgentError::Closed)));
    kill_group(pgid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_exits_when_the_host_hangs_up() {
    let (mut agent, stream) = Agent::spawn().await;
    drop(stream);
    let give_up = Instant::now() + Duration::from_secs(5);
    while agent.0.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < give_up, "the agent is still running");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The agent's `sh` children and whether each sleeps in read(2).
fn warm_shells(agent_pid: u32) -> Vec<(u32, bool)> {
    processes()
        .into_iter()
        .filter(|p| p.command == "sh" && p.fields.get(1) == Some(&agent_pid.to_string()))
        .map(|p| {
            let syscall = std::fs::read_to_string(p.dir.join("syscall")).unwrap_or_default();
            (p.pid, syscall.split_whitespace().next() == Some("0"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_returns_once_the_warm_shells_wait_for_their_scripts() {
    let (agent, client) = Agent::client().await;
    let agent_pid = agent.0.child.id();
    for _ in 0..3 {
        // Each exec uses a warm shell; the pool refills after it ends.
        assert_eq!(run(&client, "true").await.status.code, Some(0));
        client.settle().await.unwrap();
        let shells = warm_shells(agent_pid);
        assert_eq!(shells.len(), 2, "{shells:?}");
        assert!(shells.iter().all(|(_, waiting)| *waiting), "{shells:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_refill_after_an_exec_waits_while_a_shell_is_left() {
    let (agent, client) = Agent::client().await;
    let agent_pid = agent.0.child.id();
    client.settle().await.unwrap();
    assert_eq!(run(&client, "true").await.status.code, Some(0));
    // A shell starts in a few milliseconds here; the refill waits 250.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let shells = warm_shells(agent_pid);
    assert_eq!(shells.len(), 1, "{shells:?}");
    let refilled = (0..200).find(|_| {
        std::thread::sleep(Duration::from_millis(50));
        let shells = warm_shells(agent_pid);
        shells.len() == 2 && shells.iter().all(|(_, waiting)| *waiting)
    });
    assert!(refilled.is_some(), "{:?}", warm_shells(agent_pid));
    // With the pool emptied by two execs at once, the refill does not wait.
    let (a, b) = tokio::join!(run(&client, "sleep 0.3"), run(&client, "sleep 0.3"));
    assert_eq!((a.status.code, b.status.code), (Some(0), Some(0)));
    let refilled = (0..20).find(|_| {
        std::thread::sleep(Duration::from_millis(10));
        warm_shells(agent_pid).len() == 2
    });
    assert!(refilled.is_some(), "{:?}", warm_shells(agent_pid));
}
