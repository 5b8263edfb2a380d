//! Shoal installed as a system service: `scripts/package-deb` builds the
//! Debian package (with the shoal under test and the harness's guest agent,
//! so the packaged agent is the same file and the cached templates stay
//! current), `dpkg-deb` shows what it holds, `dpkg` installs it into a
//! clean root (an empty package database, maintainer scripts run without a
//! chroot, as in an image build), and the installed shoal-up unit's
//! `ExecStart` runs as systemd would run it: a bare environment, the
//! unit's paths resolved inside the root, a `NOTIFY_SOCKET` of the test's.
//! `READY=1` arrives only when the API is served (`/readyz` is 200 at
//! once); a sandbox is created over
//! HTTP and runs a command; SIGTERM (what `systemctl stop` sends) sends
//! `STOPPING=1`, and the process exits by itself with no QEMU of its own
//! left (the unit's `KillMode=process` leaves the VMs to it).
//!
//! The service runs in a process group of its own and is stopped by that
//! group's id.

use reqwest::Method;
use serde_json::json;
use shoal_testkit::ApiClient;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `command`; its stdout, or the test fails with its stderr.
fn output_of(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("running {:?}: {e}", command.get_program()));
    assert!(
        out.status.success(),
        "{command:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// The service as systemd runs it: a process group of its own, SIGTERM to
/// that group and a wait when dropped while it runs.
struct Service {
    child: Child,
    log: PathBuf,
}

impl Service {
    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn signal_group(&self, signal: i32) {
        // SAFETY: kill(2) on the process group of a child we spawned (with
        // process_group(0)) and have not reaped.
        unsafe { libc::kill(-(self.child.id() as i32), signal) };
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        format!(
            "the end of {}:\n{}",
            self.log.display(),
            lines[lines.len().saturating_sub(40)..].join("\n")
        )
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.log_tail());
        }
        if self.running() {
            self.signal_group(libc::SIGTERM);
            let _ = self.child.wait();
        }
    }
}

/// The value of `key=` in a unit file's text (the last one, as systemd).
fn directive<'a>(unit: &'a str, key: &str) -> Option<&'a str> {
    unit.lines()
        .filter_map(|line| line.trim().strip_prefix(key)?.strip_prefix('='))
        .last()
        .map(str::trim)
}

/// The messages that arrive on `socket` within `limit`, until one has
/// `wanted`; fails the test (with the log) if `service` exits first.
fn await_notification(
    socket: &UnixDatagram,
    service: &mut Service,
    wanted: &str,
    limit: Duration,
) -> Vec<String> {
    socket
        .set_read_timeout(Some(Duration::from_millis(250)))
        .unwrap();
    let deadline = Instant::now() + limit;
    let mut seen = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        match socket.recv(&mut buffer) {
            Ok(n) => {
                let message = String::from_utf8_lossy(&buffer[..n]).into_owned();
                let done = message.lines().any(|l| l == wanted);
                seen.push(message);
                if done {
                    return seen;
                }
                continue;
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(e) => panic!("reading the notify socket: {e}"),
        }
        assert!(
            service.running() || wanted == "STOPPING=1",
            "the service exited before sending {wanted} (got {seen:?}); {}",
            service.log_tail()
        );
        assert!(
            Instant::now() < deadline,
            "no {wanted} within {limit:?} (got {seen:?}); {}",
            service.log_tail()
        );
    }
}

#[test]
fn the_debian_package_installs_and_runs_as_a_notify_service() {
    let started = Instant::now();
    let work = tempfile::tempdir().unwrap();
    let agent = shoal_testkit::guest_agent();

    // The package, from the binary under test and the harness's agent.
    let deb = PathBuf::from(
        output_of(
            Command::new(shoal_testkit::workspace_root().join("scripts/package-deb"))
                .env("SHOAL_BINARY", env!("CARGO_BIN_EXE_shoal"))
                .env("SHOAL_GUEST_AGENT", agent)
                .env("SHOAL_DEB_DIR", work.path().join("deb"))
                // xz takes 25 s of one core here for the same package.
                .env("SHOAL_DEB_COMPRESSION", "gzip")
                .stderr(Stdio::inherit()),
        )
        .trim(),
    );
    let packaged = started.elapsed();
    let name = deb.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("shoal_") && name.ends_with(".deb"),
        "{name}"
    );
    let info = output_of(Command::new("dpkg-deb").arg("--info").arg(&deb));
    for expected in [
        "Package: shoal",
        "Architecture: amd64",
        "qemu-system-x86",
        "qemu-utils",
        "nftables",
        "iproute2",
        "debootstrap",
        "busybox-static",
        "libc6 (>= ",
        "conffiles",
        "postinst",
    ] {
        assert!(info.contains(expected), "no {expected:?} in\n{info}");
    }
    let version = format!("Version: {}", env!("CARGO_PKG_VERSION"));
    assert!(info.contains(&version), "no {version:?} in\n{info}");
    let conffiles = output_of(
        Command::new("dpkg-deb")
            .arg("--info")
            .arg(&deb)
            .arg("conffiles"),
    );
    assert_eq!(conffiles.trim(), "/etc/shoal/shoal.toml");
    let contents = output_of(Command::new("dpkg-deb").arg("--contents").arg(&deb));
    for path in [
        "./usr/bin/shoal",
        "./usr/lib/shoal/shoal-guest-agent",
        "./lib/systemd/system/shoal-up.service",
        "./lib/systemd/system/shoal-agent.service",
        "./lib/systemd/system/shoal-server.service",
        "./etc/shoal/shoal.toml",
        "./usr/share/man/man1/shoal-up.1.gz",
    ] {
        assert!(
            contents.lines().any(|l| l.ends_with(path)),
            "no {path} in\n{contents}"
        );
    }

    // A clean root with an empty package database; dpkg installs into it
    // and runs the maintainer scripts outside a chroot with DPKG_ROOT set
    // (they must leave the host's systemd alone).
    let root = work.path().join("root");
    let admin = root.join("var/lib/dpkg");
    std::fs::create_dir_all(admin.join("info")).unwrap();
    std::fs::create_dir_all(admin.join("updates")).unwrap();
    std::fs::write(admin.join("status"), "").unwrap();
    output_of(
        Command::new("dpkg")
            .arg(format!("--root={}", root.display()))
            .args([
                "--force-depends",
                "--force-not-root",
                "--force-script-chrootless",
                "--log=/dev/null",
                "-i",
            ])
            .arg(&deb),
    );
    let status = output_of(
        Command::new("dpkg-query")
            .arg(format!("--admindir={}", admin.display()))
            .args(["-W", "-f=${Status} ${Conffiles}", "shoal"]),
    );
    assert!(status.starts_with("install ok installed"), "{status}");
    assert!(status.contains("/etc/shoal/shoal.toml"), "{status}");
    assert_eq!(
        std::fs::read(root.join("usr/lib/shoal/shoal-guest-agent")).unwrap(),
        std::fs::read(agent).unwrap(),
        "the packaged agent is not the harness's: the cached templates would be baked again"
    );
    let installed = started.elapsed();

    // The unit, as systemd reads it.
    let unit = std::fs::read_to_string(root.join("lib/systemd/system/shoal-up.service")).unwrap();
    for (key, value) in [
        ("Type", "notify"),
        ("NotifyAccess", "main"),
        ("StateDirectory", "shoal"),
        ("KillMode", "process"),
        ("Restart", "on-failure"),
        ("Delegate", "yes"),
    ] {
        assert_eq!(directive(&unit, key), Some(value), "{key} in\n{unit}");
    }
    assert!(directive(&unit, "TimeoutStartSec").is_some(), "{unit}");
    assert!(directive(&unit, "TimeoutStopSec").is_some(), "{unit}");
    let exec_start: Vec<&str> = directive(&unit, "ExecStart")
        .expect("an ExecStart")
        .split_whitespace()
        .collect();
    assert_eq!(
        exec_start,
        ["/usr/bin/shoal", "--config", "/etc/shoal/shoal.toml", "up"]
    );
    // Where systemd is installed, it reads the three units without a
    // complaint (copies, with the packaged binary's path inside the root).
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok()
    {
        let copies = work.path().join("units");
        std::fs::create_dir_all(&copies).unwrap();
        let installed_shoal = root.join("usr/bin/shoal");
        let mut paths = Vec::new();
        for name in ["shoal-up", "shoal-agent", "shoal-server"] {
            let text =
                std::fs::read_to_string(root.join(format!("lib/systemd/system/{name}.service")))
                    .unwrap()
                    .replace("/usr/bin/shoal", &installed_shoal.display().to_string());
            let copy = copies.join(format!("{name}.service"));
            std::fs::write(&copy, text).unwrap();
            paths.push(copy);
        }
        let verified = Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .args(&paths)
            .output()
            .unwrap();
        let complaints = String::from_utf8_lossy(&verified.stderr);
        assert!(
            verified.status.success() && complaints.trim().is_empty(),
            "systemd-analyze verify: {}\n{complaints}",
            verified.status
        );
    }
    // The packaged paths, inside the clean root. The guest agent is found
    // the packaged way too: ../lib/shoal/ from the binary's directory.
    let argv: Vec<PathBuf> = exec_start
        .iter()
        .map(|word| match word.strip_prefix('/') {
            Some(rest) if word.starts_with("/usr/") || word.starts_with("/etc/shoal/") => {
                root.join(rest)
            }
            _ => PathBuf::from(word),
        })
        .collect();

    // Run as systemd would: a bare environment, the notify socket, and the
    // SHOAL_* variables (which win over the file) for a state directory of
    // the test's, the harness's template cache and a free port.
    let state = work.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let notify_path = work.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    let port = shoal_testkit::free_port();
    let log = state.join("service.log");
    let mut command = Command::new(&argv[0]);
    command
        .args(&argv[1..])
        .env_clear()
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .env("LANG", "C.UTF-8")
        .env("NOTIFY_SOCKET", &notify_path)
        .env("STATE_DIRECTORY", &state)
        .env("SHOAL_STATE_DIR", &state)
        .env("SHOAL_CACHE_DIR", shoal_testkit::cache_dir())
        .env("SHOAL_LISTEN", format!("127.0.0.1:{port}"));
    // What picks this host's QEMU and accelerator for the harness picks
    // them for the service (the templates were baked with them).
    for passed in ["SHOAL_QEMU", "SHOAL_ACCEL", "RUST_LOG"] {
        if let Some(value) = std::env::var_os(passed) {
            command.env(passed, value);
        }
    }
    let log_file = std::fs::File::create(&log).unwrap();
    let child = command
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .process_group(0)
        .spawn()
        .expect("starting the unit's ExecStart");
    let mut service = Service { child, log };

    let seen = await_notification(&notify, &mut service, "READY=1", Duration::from_secs(1800));
    let ready = started.elapsed();
    let ready_message = seen.last().unwrap();
    assert!(
        ready_message.contains(&format!("STATUS=serving on 127.0.0.1:{port}")),
        "{seen:?}"
    );
    assert!(
        seen.iter().any(|m| m.starts_with("STATUS=")),
        "no status while starting: {seen:?}"
    );
    let base = format!("http://127.0.0.1:{port}");

    shoal_testkit::block_on(async {
        // Ready means serving: the first request says so, no retries.
        let ready = reqwest::Client::new()
            .get(format!("{base}/readyz"))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .expect("the API answers once READY=1 is sent");
        assert!(ready.status().is_success(), "{}", ready.status());

        let token = shoal_testkit::api_token(
            &argv[0],
            &format!("sqlite:{}", state.join("shoal.db").display()),
            "installed",
            Some(&state),
        );
        let api = ApiClient::new(&base, token);
        let created = api
            .ok(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "base"})),
            )
            .await;
        let id = created["id"].as_str().expect("a sandbox id").to_owned();
        let out = api
            .ok(
                Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                Some(json!({"cmd": "echo installed as a service"})),
            )
            .await;
        assert_eq!(out["exit_code"], 0, "{out}");
        assert_eq!(out["stdout"], "installed as a service\n", "{out}");
        let qemu =
            shoal_testkit::processes_mentioning(&state.join("vms").join(&id).display().to_string());
        assert_eq!(qemu.len(), 1, "the sandbox's QEMU: {qemu:?}");
    });
    let served = started.elapsed();

    // systemctl stop: SIGTERM; the service stops its own VMs and exits.
    let stopping = Instant::now();
    service.signal_group(libc::SIGTERM);
    await_notification(&notify, &mut service, "STOPPING=1", Duration::from_secs(60));
    let deadline = Instant::now() + Duration::from_secs(300);
    let exit = loop {
        if let Some(exit) = service.child.try_wait().unwrap() {
            break exit;
        }
        assert!(
            Instant::now() < deadline,
            "still running 300 s after SIGTERM; {}",
            service.log_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let stop_seconds = stopping.elapsed().as_secs_f64();
    assert!(exit.success(), "{exit}; {}", service.log_tail());
    let left = shoal_testkit::processes_mentioning(&state.join("vms").display().to_string());
    assert!(left.is_empty(), "QEMUs outlived the service: {left:?}");

    println!(
        "package {:.1} s, install {:.1} s, READY=1 after {:.1} s, sandbox + exec {:.1} s, stop {stop_seconds:.1} s",
        packaged.as_secs_f64(),
        (installed - packaged).as_secs_f64(),
        (ready - installed).as_secs_f64(),
        (served - ready).as_secs_f64(),
    );
}
