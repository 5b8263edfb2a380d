//! The engine on real VMs: clone identity, fork semantics, exec, files,
//! lifecycle, leaks and bad input. Every test restores real QEMU guests from
//! the baked `code-interpreter` template (built once into the cache).

use shoal_engine::{CreateOptions, Engine, EngineError, VmState};
use shoal_proto::client::{AgentClient, ExecOutput, ExecRequest};
use shoal_proto::ErrorKind;
use shoal_testkit::{block_on, wait_until, Sandbox};
use std::time::Duration;

const TEMPLATE: &str = "code-interpreter";

fn engine() -> &'static Engine {
    shoal_testkit::engine("vm_engine", &[TEMPLATE])
}

async fn run(agent: &AgentClient, cmd: &str) -> ExecOutput {
    agent
        .exec_collect(ExecRequest {
            cmd: cmd.to_string(),
            timeout: Some(Duration::from_secs(60)),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("exec {cmd:?}: {e}"))
}

async fn stdout(agent: &AgentClient, cmd: &str) -> String {
    let out = run(agent, cmd).await;
    assert_eq!(
        out.status.code,
        Some(0),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

async fn create() -> Sandbox {
    Sandbox::create(engine(), TEMPLATE, CreateOptions::default()).await
}

#[test]
fn clones_of_one_template_get_their_own_identity() {
    block_on(async {
        let a = create().await;
        let b = create().await;
        let (agent_a, agent_b) = (a.agent().await, b.agent().await);
        let random_a = stdout(
            &agent_a,
            "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'",
        )
        .await;
        let random_b = stdout(
            &agent_b,
            "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'",
        )
        .await;
        assert_eq!(random_a.len(), 64);
        assert_ne!(
            random_a, random_b,
            "two clones read the same /dev/urandom bytes"
        );
        assert_eq!(stdout(&agent_a, "hostname").await, a.id);
        assert_eq!(stdout(&agent_b, "hostname").await, b.id);
        for agent in [&agent_a, &agent_b] {
            let guest: f64 = stdout(agent, "date +%s.%N").await.parse().unwrap();
            let host = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs_f64();
            assert!(
                (guest - host).abs() < 1.0,
                "guest clock {guest} vs host {host}"
            );
        }
    });
}

#[test]
fn fork_children_inherit_memory_and_disk_and_diverge() {
    block_on(async {
        let parent = create().await;
        let agent = parent.agent().await;
        stdout(&agent, "echo before-fork > /root/marker").await;
        // A process holding a counter in memory, printing it to a file.
        stdout(
            &agent,
            "nohup python3 -c '\nimport os, time\nn = 0\nwhile True:\n    n += 1\n    open(\"/tmp/count.new\", \"w\").write(str(n))\n    os.replace(\"/tmp/count.new\", \"/tmp/count\")\n    time.sleep(0.05)\n' >/dev/null 2>&1 & for i in $(seq 300); do [ -s /tmp/count ] && break; sleep 0.1; done; cat /tmp/count",
        )
        .await;
        let at_fork: u64 = stdout(&agent, "cat /tmp/count").await.parse().unwrap();
        let fork = engine().fork(&parent.id, 2).await.expect("fork");
        let children: Vec<Sandbox> = fork
            .children
            .iter()
            .map(|c| Sandbox::adopt(engine(), c.id.clone()))
            .collect();
        assert_eq!(children.len(), 2);
        for child in &children {
            let child_agent = child.agent().await;
            assert_eq!(
                stdout(&child_agent, "cat /root/marker").await,
                "before-fork"
            );
            assert_eq!(stdout(&child_agent, "hostname").await, child.id);
            // The counter goes on from where the parent was, in the child.
            let first: u64 = stdout(&child_agent, "cat /tmp/count")
                .await
                .parse()
                .unwrap();
            assert!(
                first >= at_fork,
                "child counter {first} restarted below {at_fork}"
            );
            assert!(
                wait_until(Duration::from_secs(10), || {
                    let child_agent = child_agent.clone();
                    async move {
                        stdout(&child_agent, "cat /tmp/count")
                            .await
                            .parse::<u64>()
                            .unwrap()
                            > first
                    }
                })
                .await,
                "the inherited counter does not advance in the child"
            );
            stdout(
                &child_agent,
                &format!("echo {} > /root/child-file", child.id),
            )
            .await;
        }
        // The parent goes on, and sees none of its children's writes.
        let later: u64 = stdout(&agent, "sleep 0.5; cat /tmp/count")
            .await
            .parse()
            .unwrap();
        assert!(later > at_fork);
        let out = run(&agent, "cat /root/child-file").await;
        assert_ne!(
            out.status.code,
            Some(0),
            "a child's write leaked into the parent"
        );
        // Nor does a sibling.
        let sibling = children[0].agent().await;
        assert_eq!(
            stdout(&sibling, "cat /root/child-file").await,
            children[0].id
        );
        let other = children[1].agent().await;
        assert_eq!(stdout(&other, "cat /root/child-file").await, children[1].id);
    });
}

#[test]
fn exec_reports_codes_signals_timeouts_and_whole_output() {
    block_on(async {
        let sandbox = create().await;
        let agent = sandbox.agent().await;
        assert_eq!(run(&agent, "exit 3").await.status.code, Some(3));
        let killed = run(&agent, "kill -9 $$").await;
        assert_eq!((killed.status.code, killed.status.signal), (None, Some(9)));
        let missing = run(&agent, "no-such-command-here").await;
        assert_eq!(missing.status.code, Some(127));
        assert!(String::from_utf8_lossy(&missing.stderr).contains("not found"));

        let started = std::time::Instant::now();
        let timed = agent
            .exec_collect(ExecRequest {
                cmd: "sleep 300 & sleep 301; echo never".into(),
                timeout: Some(Duration::from_millis(1500)),
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(timed.status.timed_out);
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(!String::from_utf8_lossy(&timed.stdout).contains("never"));
        let survivors = stdout(&agent, "pgrep -f 'sleep 30[01]' | wc -l").await;
        assert_eq!(survivors, "0", "the timeout left children running");

        let big = run(&agent, "head -c 1048576 /dev/zero | tr '\\0' x").await;
        assert_eq!(big.stdout.len(), 1 << 20);
        assert!(big.stdout.iter().all(|&b| b == b'x'));

        let runs = (0..6).map(|i| {
            let agent = agent.clone();
            async move {
                let out = run(
                    &agent,
                    &format!("for n in $(seq 1 200); do echo task{i}-$n; echo err{i}-$n >&2; done"),
                )
                .await;
                (i, out)
            }
        });
        for (i, out) in futures::future::join_all(runs).await {
            let text = String::from_utf8(out.stdout).unwrap();
            let expected: String = (1..=200).map(|n| format!("task{i}-{n}\n")).collect();
            assert_eq!(text, expected, "exec {i} stdout mixed");
            let err = String::from_utf8(out.stderr).unwrap();
            let expected: String = (1..=200).map(|n| format!("err{i}-{n}\n")).collect();
            assert_eq!(err, expected, "exec {i} stderr mixed");
        }
    });
}

#[test]
fn files_move_in_and_out_and_bad_paths_are_clear_errors() {
    block_on(async {
        let sandbox = create().await;
        let agent = sandbox.agent().await;
        let data: Vec<u8> = (0..(8 << 20)).map(|i: u32| (i % 251) as u8).collect();
        let written = agent
            .write_file("/root/data/blob.bin", None, &data[..])
            .await
            .unwrap();
        assert_eq!(written, data.len() as u64);
        assert_eq!(
            agent.read_file_to_vec("/root/data/blob.bin").await.unwrap(),
            data
        );
        assert_eq!(
            stdout(&agent, "sha256sum /root/data/blob.bin | cut -c1-64")
                .await
                .len(),
            64
        );
        let listing = agent.list_dir("/root/data").await.unwrap();
        assert_eq!(listing.len(), 1);
        assert_eq!(listing[0].name, "blob.bin");
        assert_eq!(listing[0].size, data.len() as u64);

        let missing = agent.stat("/does/not/exist").await.unwrap_err();
        assert!(
            matches!(
                missing,
                shoal_proto::client::AgentError::Guest {
                    kind: ErrorKind::NotFound,
                    ..
                }
            ),
            "{missing}"
        );
        assert!(missing.to_string().contains("/does/not/exist"), "{missing}");
        let read_missing = agent.read_file_to_vec("/does/not/exist").await.unwrap_err();
        assert!(read_missing.to_string().contains("/does/not/exist"));
        let read_only = agent
            .write_file("/proc/version", None, &b"x"[..])
            .await
            .unwrap_err();
        assert!(
            matches!(read_only, shoal_proto::client::AgentError::Guest { .. }),
            "{read_only}"
        );
        let bad_cwd = agent
            .exec_collect(ExecRequest {
                cmd: "pwd".into(),
                cwd: Some("/no/such/dir".into()),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(bad_cwd.to_string().contains("/no/such/dir"), "{bad_cwd}");
        agent.remove("/root/data", true).await.unwrap();
        assert!(agent.stat("/root/data").await.is_err());
        // The sandbox is still healthy after the errors.
        assert_eq!(stdout(&agent, "echo ok").await, "ok");
    });
}

#[test]
fn pause_resume_snapshot_hibernate_wake() {
    block_on(async {
        let sandbox = create().await;
        let agent = sandbox.agent().await;
        stdout(&agent, "echo kept > /root/state").await;
        engine().pause(&sandbox.id).await.unwrap();
        assert_eq!(
            engine().get(&sandbox.id).await.unwrap().state,
            VmState::Paused
        );
        assert!(engine().agent(&sandbox.id).await.is_err());
        engine().resume(&sandbox.id).await.unwrap();
        assert_eq!(stdout(&agent, "cat /root/state").await, "kept");

        let snapshot = engine().snapshot(&sandbox.id).await.unwrap();
        stdout(&agent, "echo changed > /root/state").await;
        let restored = engine()
            .create_from_snapshot(&snapshot, None)
            .await
            .unwrap();
        let restored = Sandbox::adopt(engine(), restored.id);
        let restored_agent = restored.agent().await;
        assert_eq!(stdout(&restored_agent, "cat /root/state").await, "kept");
        assert_eq!(stdout(&restored_agent, "hostname").await, restored.id);

        let pid = engine().get(&sandbox.id).await.unwrap().pid.unwrap();
        engine().hibernate(&sandbox.id).await.unwrap();
        assert_eq!(
            engine().get(&sandbox.id).await.unwrap().state,
            VmState::Hibernated
        );
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "QEMU still runs after hibernate"
        );
        engine().wake(&sandbox.id).await.unwrap();
        let woken = sandbox.agent().await;
        assert_eq!(stdout(&woken, "cat /root/state").await, "changed");
        engine().delete_snapshot(&snapshot).await.unwrap();
        assert!(engine()
            .create_from_snapshot(&snapshot, None)
            .await
            .is_err());
    });
}

#[test]
fn bad_input_is_a_clear_error_and_leaves_nothing() {
    block_on(async {
        let before = shoal_testkit::files_under(&engine().state_dir().join("vms"));
        let unknown = engine().create("no-such-template", None).await.unwrap_err();
        assert!(matches!(unknown, EngineError::UnknownTemplate(_)));
        assert_eq!(unknown.to_string(), "unknown template \"no-such-template\"");
        let bad_id = engine()
            .create(TEMPLATE, Some("../escape".into()))
            .await
            .unwrap_err();
        assert!(matches!(bad_id, EngineError::InvalidInput(_)), "{bad_id}");
        let no_snapshot = engine()
            .create_from_snapshot("snap-nothing", None)
            .await
            .unwrap_err();
        assert!(matches!(no_snapshot, EngineError::NoSuchSnapshot(_)));
        assert!(matches!(
            engine().fork("sb-nothing", 2).await.unwrap_err(),
            EngineError::NoSuchSandbox(_)
        ));
        assert_eq!(
            shoal_testkit::files_under(&engine().state_dir().join("vms")),
            before
        );
    });
}

#[test]
fn a_template_baked_by_another_qemu_is_refused() {
    block_on(async {
        let real = engine().template(TEMPLATE).unwrap();
        // A cache whose only template claims another QEMU build.
        let cache = std::env::temp_dir().join(format!("shoal-stale-cache-{}", std::process::id()));
        let state = std::env::temp_dir().join(format!("shoal-stale-state-{}", std::process::id()));
        let bake = cache.join("templates").join(TEMPLATE).join("old");
        std::fs::create_dir_all(&bake).unwrap();
        let mut stale = real.clone();
        stale.qemu_version = "QEMU emulator version 6.0.0".into();
        stale.store(&bake).unwrap();
        std::fs::write(
            cache.join("templates").join(TEMPLATE).join("current"),
            "old",
        )
        .unwrap();
        let mut config = shoal_engine::EngineConfig::new(&state);
        config.cache_dir = cache.clone();
        let other = Engine::open(config).await.unwrap();
        let err = other.create(TEMPLATE, None).await.unwrap_err();
        assert!(matches!(err, EngineError::TemplateStale { .. }), "{err}");
        assert!(
            err.to_string().contains("6.0.0") && err.to_string().contains("shoal template build"),
            "{err}"
        );
        assert!(shoal_testkit::files_under(&state.join("vms")).is_empty());
        drop(other);
        std::fs::remove_dir_all(&cache).unwrap();
        std::fs::remove_dir_all(&state).unwrap();
    });
}

#[test]
fn fifty_create_delete_cycles_leave_nothing() {
    block_on(async {
        let state_dir = engine().state_dir().to_path_buf();
        let mut pids = Vec::new();
        for _ in 0..50 {
            let info = engine().create(TEMPLATE, None).await.unwrap();
            pids.push(info.pid.unwrap());
            let agent = engine().agent(&info.id).await.unwrap();
            assert_eq!(stdout(&agent, "echo hi").await, "hi");
            engine().kill(&info.id).await.unwrap();
            assert!(!state_dir.join("vms").join(&info.id).exists());
        }
        for pid in pids {
            assert!(
                !std::path::Path::new(&format!("/proc/{pid}")).exists(),
                "QEMU {pid} survived its delete"
            );
        }
        // Other tests of this binary may run sandboxes meanwhile; none of
        // these 50 may remain, nor any fork capture nobody uses.
        let live: Vec<String> = engine().list().await.into_iter().map(|s| s.id).collect();
        for entry in shoal_testkit::files_under(&state_dir.join("vms")) {
            let top = entry
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_string_lossy()
                .to_string();
            assert!(live.contains(&top), "leftover {entry:?}");
        }
    });
}

/// A sandbox moves to the background and back with every thread of its
/// QEMU process, still answers there, and a background sandbox is killed
/// as cleanly as any other.
#[test]
fn cpu_priority_moves_a_sandbox_and_back() {
    use shoal_engine::CpuPriority;
    block_on(async {
        let sandbox = create().await;
        let engine = engine();
        assert_eq!(
            engine.cpu_priority(&sandbox.id).unwrap(),
            Some(CpuPriority::Normal)
        );
        engine
            .set_cpu_priority(&sandbox.id, CpuPriority::Background)
            .unwrap();
        assert_eq!(
            engine.cpu_priority(&sandbox.id).unwrap(),
            Some(CpuPriority::Background)
        );
        assert_eq!(stdout(&sandbox.agent().await, "echo up").await, "up");
        engine
            .set_cpu_priority(&sandbox.id, CpuPriority::Normal)
            .unwrap();
        assert_eq!(
            engine.cpu_priority(&sandbox.id).unwrap(),
            Some(CpuPriority::Normal)
        );

        let other = create().await;
        engine
            .set_cpu_priority(&other.id, CpuPriority::Background)
            .unwrap();
        let pid = engine
            .list()
            .await
            .into_iter()
            .find(|s| s.id == other.id)
            .and_then(|s| s.pid)
            .expect("a running sandbox has a QEMU process");
        engine.kill(&other.id).await.unwrap();
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "QEMU {pid} survived its kill"
        );
        assert!(matches!(
            engine.cpu_priority(&other.id),
            Err(EngineError::NoSuchSandbox(_))
        ));
        assert!(matches!(
            engine.set_cpu_priority("sb-000000000000", CpuPriority::Normal),
            Err(EngineError::NoSuchSandbox(_))
        ));
    })
}
