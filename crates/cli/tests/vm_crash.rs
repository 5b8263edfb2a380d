//! Killing the host process with SIGKILL leaves QEMU processes, sockets,
//! disk layers and fork captures behind; the next start must reap them all.
//! Runs the real `shoal` binary in its own process group.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn leftovers_of_a_sigkilled_host_are_reaped_at_start() {
    let agent = shoal_testkit::guest_agent();
    let state = shoal_testkit::state_dir("vm_crash");
    let _ = std::fs::remove_dir_all(&state);
    let shoal = env!("CARGO_BIN_EXE_shoal");
    let cache = shoal_testkit::cache_dir();
    let build = Command::new(shoal)
        .args(["template", "build", "code-interpreter", "--guest-agent"])
        .arg(agent)
        .arg("--state-dir")
        .arg(&state)
        .arg("--cache-dir")
        .arg(&cache)
        .status()
        .unwrap();
    assert!(build.success());

    let mut holder = Command::new(shoal)
        .args(["hold", "--count", "2", "--fork", "2", "--state-dir"])
        .arg(&state)
        .arg("--cache-dir")
        .arg(&cache)
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    let mut pids = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if line == "holding" {
            break;
        }
        let pid: u32 = line.rsplit(' ').next().unwrap().parse().unwrap();
        pids.push(pid);
    }
    assert_eq!(pids.len(), 4, "two sandboxes and two fork children");
    for pid in &pids {
        assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    }
    let captures = state.join("captures");
    assert!(
        !shoal_testkit::files_under(&captures).is_empty(),
        "the fork left a capture"
    );

    // SIGKILL the holder only (its own group; QEMU runs in groups of its own).
    shoal_testkit::signal_pid(holder.id(), shoal_testkit::SIGKILL);
    let _ = holder.wait();
    for pid in &pids {
        assert!(
            std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "QEMU {pid} died with its host; nothing to reap"
        );
    }

    // A new start on the same state directory reaps everything.
    let started = Instant::now();
    let listed = Command::new(shoal)
        .args(["template", "list", "--local", "--state-dir"])
        .arg(&state)
        .arg("--cache-dir")
        .arg(&cache)
        .output()
        .unwrap();
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    for pid in &pids {
        assert!(!shoal_testkit::alive(*pid), "QEMU {pid} was not reaped");
    }
    assert!(shoal_testkit::processes_mentioning(&state.display().to_string()).is_empty());
    assert!(
        shoal_testkit::files_under(&state.join("vms")).is_empty(),
        "VM directories left"
    );
    assert!(
        shoal_testkit::files_under(&captures).is_empty(),
        "fork captures left"
    );
    let _ = std::fs::remove_dir_all(&state);
}
