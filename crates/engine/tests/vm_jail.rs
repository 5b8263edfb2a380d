//! Containment on real VMs: every QEMU runs as an unprivileged uid of its
//! own, chrooted into an empty root, with no capabilities and no new
//! privileges, in a cgroup with memory and pids limits that is gone after
//! the kill; and a guest that touches more memory than its cgroup allows is
//! killed alone, reported as out of memory, while its neighbour answers.
//!
//! And a guest that stops answering costs only itself: listing and
//! a create beside it stay fast while a call into it holds its lock, and
//! its delete ends within its deadline.
//!
//! The engine here runs with a memory limit of [`MEMORY_LIMIT_MIB`] per VM
//! (instead of guest RAM + overhead) so one guest can exceed it quickly.

use shoal_engine::volume::VolumeAttachment;
use shoal_engine::{CreateOptions, Engine, EngineError, VmState};
use shoal_proto::client::{AgentClient, ExecOutput, ExecRequest};
use shoal_testkit::{block_on, wait_until, Sandbox};
use std::ffi::CString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const TEMPLATE: &str = "base";
const MEMORY_LIMIT_MIB: u32 = 256;

fn engine() -> &'static Engine {
    shoal_testkit::engine_with("vm_jail", &[TEMPLATE], |config| {
        config.jail.memory_limit_mib = Some(MEMORY_LIMIT_MIB);
    })
}

fn jail_root() -> PathBuf {
    shoal_engine::jail::JailConfig::default().root
}

async fn create() -> Sandbox {
    Sandbox::create(engine(), TEMPLATE, CreateOptions::default()).await
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

/// `Name:` fields of `/proc/PID/status`, split on whitespace.
fn status_field(pid: u32, name: &str) -> Vec<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// The directory of `pid`'s memory cgroup and the file that holds its limit
/// (v1 `memory.limit_in_bytes` or v2 `memory.max`), and the same for pids.
fn cgroup_files(pid: u32) -> (PathBuf, PathBuf, PathBuf) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let mut v1_memory = None;
    let mut v1_pids = None;
    let mut v2 = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next().unwrap(), parts.next().unwrap());
        let path = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "memory") {
            v1_memory = Some(Path::new("/sys/fs/cgroup/memory").join(path));
        } else if controllers.split(',').any(|c| c == "pids") {
            v1_pids = Some(Path::new("/sys/fs/cgroup/pids").join(path));
        } else if controllers.is_empty() && !path.is_empty() {
            v2 = Some(Path::new("/sys/fs/cgroup").join(path));
        }
    }
    match (v1_memory, v1_pids, v2) {
        (Some(memory), Some(pids), _) => (
            memory.clone(),
            memory.join("memory.limit_in_bytes"),
            pids.join("pids.max"),
        ),
        (_, _, Some(dir)) => (dir.clone(), dir.join("memory.max"), dir.join("pids.max")),
        _ => panic!("QEMU {pid} is in no cgroup of its own: {text}"),
    }
}

/// Whether a process with QEMU `pid`'s uid, gid and groups, chrooted into
/// its root as QEMU is, can open `path` for reading.
fn can_open_as(pid: u32, root: &Path, path: &Path) -> bool {
    let uid: u32 = status_field(pid, "Uid")[0].parse().unwrap();
    let gid: u32 = status_field(pid, "Gid")[0].parse().unwrap();
    let root = CString::new(root.as_os_str().as_encoded_bytes()).unwrap();
    let path = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut command = std::process::Command::new("/bin/true");
    // SAFETY: the closure runs in the forked child and makes only raw
    // system calls (no allocation, no locks) before `_exit`; it reports
    // through its exit status and never execs: after the chroot there is
    // nothing to exec.
    unsafe {
        command.pre_exec(move || {
            let code = if libc::chroot(root.as_ptr()) != 0
                || libc::chdir(c"/".as_ptr()) != 0
                || libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
            {
                3
            } else if libc::open(path.as_ptr(), libc::O_RDONLY) >= 0 {
                0
            } else {
                1
            };
            libc::_exit(code)
        });
    }
    match command.status().unwrap().code() {
        Some(0) => true,
        Some(1) => false,
        other => panic!("could not take QEMU {pid}'s identity: {other:?}"),
    }
}

#[test]
fn every_qemu_runs_jailed_in_a_cgroup_of_its_own() {
    block_on(async {
        let a = create().await;
        let b = create().await;
        let (pid_a, pid_b) = (a.pid().await, b.pid().await);
        let b_memory = engine().state_dir().join("vms").join(&b.id);

        let mut uids = Vec::new();
        for pid in [pid_a, pid_b] {
            let uid = status_field(pid, "Uid");
            let gid = status_field(pid, "Gid");
            assert!(
                uid.iter().all(|u| u == &uid[0]) && uid[0] != "0",
                "QEMU {pid} uids: {uid:?}"
            );
            assert!(gid.iter().all(|g| g != "0"), "QEMU {pid} gids: {gid:?}");
            assert_eq!(status_field(pid, "CapEff"), ["0000000000000000"]);
            assert_eq!(status_field(pid, "CapPrm"), ["0000000000000000"]);
            assert_eq!(status_field(pid, "NoNewPrivs"), ["1"]);
            assert_eq!(
                status_field(pid, "Seccomp"),
                ["2"],
                "QEMU {pid} not filtered"
            );
            uids.push(uid[0].clone());

            let root = std::fs::read_link(format!("/proc/{pid}/root")).unwrap();
            assert_eq!(root, jail_root(), "QEMU {pid}'s root");
            let seen: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/root"))
                .unwrap()
                .collect();
            assert!(
                seen.is_empty(),
                "QEMU {pid} sees files in its root: {seen:?}"
            );

            let (dir, memory_limit, pids_limit) = cgroup_files(pid);
            assert!(
                dir.to_string_lossy().contains("shoal/slot-"),
                "QEMU {pid} is in {dir:?}"
            );
            let limit: u64 = std::fs::read_to_string(&memory_limit)
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            assert_eq!(limit, u64::from(MEMORY_LIMIT_MIB) << 20, "{memory_limit:?}");
            let pids: u32 = std::fs::read_to_string(&pids_limit)
                .unwrap()
                .trim()
                .parse()
                .unwrap_or_else(|_| panic!("{pids_limit:?} has no number"));
            assert!(pids > 0 && pids < 1000, "pids.max {pids}");
        }
        assert_ne!(uids[0], uids[1], "two VMs share a uid");

        // What an escaped QEMU A could try: B's files, the engine's state
        // and the database by their host paths; none exist in its root.
        let a_root = jail_root();
        for path in [
            b_memory.join("memory"),
            b_memory.clone(),
            engine().state_dir().to_path_buf(),
            PathBuf::from("/etc/shadow"),
            PathBuf::from("/var/lib/shoal"),
        ] {
            assert!(
                !can_open_as(pid_a, &a_root, &path),
                "QEMU {pid_a} can open {path:?}"
            );
        }
        // The check itself can succeed: its own root directory opens.
        assert!(can_open_as(pid_a, &a_root, Path::new("/")));

        let (dir_a, _, _) = cgroup_files(pid_a);
        engine().kill(&a.id).await.unwrap();
        assert!(
            wait_until(Duration::from_secs(5), || {
                let dir = dir_a.clone();
                async move { !dir.exists() }
            })
            .await,
            "{dir_a:?} is still there after the kill"
        );
        // B keeps its own.
        let (dir_b, _, _) = cgroup_files(pid_b);
        assert!(dir_b.exists());
    });
}

#[test]
fn a_guest_that_exceeds_its_memory_is_killed_alone() {
    block_on(async {
        let greedy = create().await;
        let neighbour = create().await;
        let mut failures = engine().failures();
        let greedy_pid = greedy.pid().await;
        let agent = greedy.agent().await;
        // Writing the guest's tmpfs dirties guest pages: each becomes QEMU's
        // own anonymous memory, far past the cgroup's limit.
        let filled = agent
            .exec_collect(ExecRequest {
                cmd: "dd if=/dev/zero of=/dev/shm/fill bs=1M count=1200".into(),
                timeout: Some(Duration::from_secs(120)),
                ..Default::default()
            })
            .await;
        assert!(filled.is_err(), "the fill finished: {filled:?}");

        let failure = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match failures.recv().await {
                    Ok(f) if f.id == greedy.id => return f,
                    Ok(_) => continue,
                    Err(e) => panic!("failures channel: {e}"),
                }
            }
        })
        .await
        .expect("no failure reported");
        assert_eq!(failure.reason, shoal_engine::vm::OUT_OF_MEMORY);
        assert!(
            !Path::new(&format!("/proc/{greedy_pid}")).exists() || {
                // A zombie until the engine reaps it is fine; it must not run.
                status_field(greedy_pid, "State")[0] == "Z"
            }
        );

        let info = engine().get(&greedy.id).await.unwrap();
        assert_eq!(info.failure.as_deref(), Some("out of memory"), "{info:?}");
        match engine().agent(&greedy.id).await {
            Err(EngineError::OutOfMemory(id)) => assert_eq!(id, greedy.id),
            other => panic!("agent of an OOM-killed sandbox: {other:?}"),
        }

        let out = run(&neighbour.agent().await, "echo alive").await;
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "alive");
        let info = engine().get(&neighbour.id).await.unwrap();
        assert_eq!((info.state, info.failure), (VmState::Running, None));

        engine()
            .kill(&greedy.id)
            .await
            .expect("delete of a failed sandbox");
    });
}

/// A fresh ext4 image to attach as a writable volume.
fn volume_image(name: &str) -> VolumeAttachment {
    let dir = shoal_testkit::state_dir("vm_jail").join("test-volumes");
    std::fs::create_dir_all(&dir).unwrap();
    let image = dir.join(name);
    let _ = std::fs::remove_file(&image);
    std::fs::File::create(&image)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let made = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&image)
        .status()
        .unwrap();
    assert!(made.success());
    VolumeAttachment {
        name: name.to_owned(),
        image,
        read_only: false,
    }
}

#[test]
fn a_guest_that_stops_answering_costs_only_its_own_vm() {
    block_on(async {
        let options = CreateOptions {
            volumes: vec![volume_image("silent")],
            ..CreateOptions::default()
        };
        let silent = Sandbox::create(engine(), TEMPLATE, options).await;
        // The guest stops answering: its QEMU is stopped, as a guest that
        // hangs (or an agent the tenant replaced with a silent one) looks
        // from the host. Nothing in it answers from now on.
        let pid = silent.pid().await;
        shoal_testkit::signal_pid(pid, libc::SIGSTOP);

        // A hibernation freezes the volume in the guest, holding the VM
        // until the guest answers or the host's deadline passes.
        let id = silent.id.clone();
        let hibernating = tokio::spawn(async move { engine().hibernate(&id).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !hibernating.is_finished(),
            "the silent guest answered the freeze"
        );

        let started = std::time::Instant::now();
        let listed = engine().list().await;
        assert!(listed.iter().any(|i| i.id == silent.id));
        engine().get(&silent.id).await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "listing waited {:?} behind the silent guest",
            started.elapsed()
        );

        let started = std::time::Instant::now();
        let beside = create().await;
        let created = started.elapsed();
        let out = run(&beside.agent().await, "echo beside").await;
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "beside");
        assert!(
            created < Duration::from_secs(5),
            "a create beside the silent guest took {created:?}"
        );

        let started = std::time::Instant::now();
        engine()
            .kill(&silent.id)
            .await
            .expect("delete of the silent sandbox");
        let deleted = started.elapsed();
        assert!(
            deleted < Duration::from_secs(15),
            "the delete of a silent sandbox took {deleted:?}"
        );
        let hibernated = tokio::time::timeout(Duration::from_secs(10), hibernating)
            .await
            .expect("the hibernation never ended")
            .unwrap();
        assert!(
            hibernated.is_err(),
            "a silent guest hibernated: {hibernated:?}"
        );
        println!("create beside: {created:?}, delete: {deleted:?}, hibernate: {hibernated:?}");
    });
}

#[test]
fn a_guest_cannot_grow_its_console_log_past_the_cap() {
    block_on(async {
        let chatty = create().await;
        let log = engine().console_log(&chatty.id).unwrap();
        // 3 MiB through the serial console, more than the cap.
        let out = run(
            &chatty.agent().await,
            "head -c 2400000 /dev/urandom | base64 -w 1000 > /dev/ttyS0; echo written",
        )
        .await;
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "written",
            "{out:?}"
        );
        // The engine looks once a second.
        let capped = wait_until(Duration::from_secs(5), || {
            let log = log.clone();
            async move {
                std::fs::metadata(&log)
                    .is_ok_and(|m| m.len() <= shoal_engine::qemu::CONSOLE_LOG_CAP)
            }
        })
        .await;
        let text = std::fs::read(&log).unwrap();
        assert!(capped, "the console log is {} bytes", text.len());
        assert!(
            text.windows(23).any(|w| w == b"[shoal: console log cut"),
            "the log was never cut: {} bytes",
            text.len()
        );
    });
}
