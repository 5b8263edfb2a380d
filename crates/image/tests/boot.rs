//! Boots the real kernel and initramfs this crate builds under QEMU TCG,
//! with a tiny hand-made root filesystem whose "guest agent" is a busybox
//! script, and checks that /init hands over to it with the virtio devices
//! present; and that /init fails loudly and stops the VM when it cannot.
//!
//! Downloads Debian's cloud kernel package (about 27 MB). Skips when not
//! root or when qemu-system-x86_64 is missing.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shoal_image::{
    build_initramfs, build_kernel, install_agent, make_ext4_image, resolve_kernel_package,
    tcg_kernel_cmdline, MultiProgress,
};

const QEMU: &str = "qemu-system-x86_64";
const DEADLINE: Duration = Duration::from_secs(60);

/// The stand-in agent: proves it runs as PID 1 on a writable root, lists
/// the virtio-serial ports and the hardware RNG, then powers off.
const FAKE_AGENT: &str = r#"#!/bin/busybox sh
bb=/bin/busybox
$bb echo "FAKE-AGENT pid=$$ args=$*"
$bb echo "VPORTS: $($bb ls /dev/vport* 2>&1)"
$bb echo "PORT-NAMES: $($bb cat /sys/class/virtio-ports/*/name 2>&1)"
$bb echo "RNG: $($bb cat /sys/class/misc/hw_random/rng_current 2>&1)"
$bb touch /written && $bb echo "ROOT-WRITABLE"
$bb echo SHOAL-BOOT-OK > /dev/console
$bb poweroff -f
"#;

fn prerequisites_met() -> bool {
    let root = nix::unistd::geteuid().is_root();
    let qemu = Command::new(QEMU).arg("--version").output().is_ok();
    if !root || !qemu {
        eprintln!("skipping boot test: root={root} qemu={qemu}");
    }
    root && qemu
}

struct Boot {
    output: String,
    exited: bool,
    elapsed: Duration,
}

/// Runs QEMU in its own process group, collecting the serial console until
/// it exits or the deadline passes (then kills exactly that QEMU, by pid).
fn boot(kernel: &Path, initrd: &Path, disk: Option<&Path>, machine: &str, sock: &Path) -> Boot {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(QEMU);
    cmd.args([
        "-M",
        machine,
        "-accel",
        "tcg,tb-size=64",
        "-cpu",
        "max",
        "-m",
        "512",
    ])
    .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"])
    .args(["-serial", "stdio"])
    .arg("-kernel")
    .arg(kernel)
    .arg("-initrd")
    .arg(initrd)
    .arg("-append")
    .arg(tcg_kernel_cmdline());
    if let Some(disk) = disk {
        cmd.args(["-device", "virtio-blk-device,drive=d"])
            .arg("-drive")
            .arg(format!("id=d,file={},format=raw,if=none", disk.display()));
    }
    cmd.args(["-device", "virtio-serial-device"])
        .args(["-device", "virtserialport,name=org.shoal.agent,chardev=c"])
        .arg("-chardev")
        .arg(format!(
            "socket,id=c,path={},server=on,wait=off",
            sock.display()
        ))
        .args(["-device", "virtio-rng-device"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let started = Instant::now();
    let mut child = cmd.spawn().expect("starting qemu");
    let output = Arc::new(Mutex::new(String::new()));
    let readers: Vec<_> = [
        Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
        Box::new(child.stderr.take().unwrap()),
    ]
    .into_iter()
    .map(|mut stream| {
        let output = Arc::clone(&output);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stream.read(&mut buf) {
                if n == 0 {
                    break;
                }
                output
                    .lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    })
    .collect();
    let exited = loop {
        if child.try_wait().unwrap().is_some() {
            break true;
        }
        if started.elapsed() > DEADLINE {
            child.kill().expect("killing our qemu"); // by pid: only the QEMU we started
            child.wait().unwrap();
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let elapsed = started.elapsed();
    for r in readers {
        r.join().unwrap();
    }
    let output = output.lock().unwrap().clone();
    eprintln!(
        "--- serial ({machine}, {:.2} s, exited={exited}) ---\n{output}",
        elapsed.as_secs_f64()
    );
    Boot {
        output,
        exited,
        elapsed,
    }
}

#[test]
fn kernel_and_initramfs_boot_into_the_agent() {
    if !prerequisites_met() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let images = tmp.path().join("images");
    let quiet = MultiProgress::with_draw_target(indicatif_hidden());

    let pkg = resolve_kernel_package().unwrap();
    let (kernel, report) = build_kernel(&images, &pkg, &quiet).unwrap();
    assert!(!report.cached);
    let (initramfs, _) = build_initramfs(&images, &kernel, &quiet).unwrap();

    // Second calls find everything cached and are fast.
    let again = Instant::now();
    let (kernel2, r1) = build_kernel(&images, &pkg, &quiet).unwrap();
    let (initramfs2, r2) = build_initramfs(&images, &kernel2, &quiet).unwrap();
    assert!(r1.cached && r2.cached);
    assert_eq!(
        initramfs2.info.content_sha256,
        initramfs.info.content_sha256
    );
    assert!(
        again.elapsed() < Duration::from_secs(1),
        "{:?}",
        again.elapsed()
    );

    // A tiny root: busybox plus the fake agent at the real agent's path.
    let root = tmp.path().join("root");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    let agent = tmp.path().join("fake-agent");
    std::fs::write(&agent, FAKE_AGENT).unwrap();
    install_agent(&root, &agent).unwrap();
    let disk = tmp.path().join("root.ext4");
    make_ext4_image(&root, &disk, 32).unwrap();
    let sock = tmp.path().join("agent.sock");

    let ok = boot(
        &kernel.vmlinuz(),
        &initramfs.path,
        Some(&disk),
        "microvm",
        &sock,
    );
    assert!(ok.exited, "QEMU did not power off within {DEADLINE:?}");
    assert!(ok.output.contains("SHOAL-BOOT-OK"), "no SHOAL-BOOT-OK");
    assert!(
        ok.output.contains("FAKE-AGENT pid=1 args=--init"),
        "agent is not PID 1 with --init"
    );
    assert!(
        ok.output.contains("VPORTS: /dev/vport"),
        "no /dev/vport* in the guest"
    );
    assert!(ok.output.contains("PORT-NAMES: org.shoal.agent"));
    assert!(
        ok.output.contains("RNG: virtio_rng"),
        "virtio-rng not the active hwrng"
    );
    assert!(ok.output.contains("ROOT-WRITABLE"));
    assert!(!ok.output.contains("FATAL"));
    eprintln!(
        "boot to agent and poweroff: {:.2} s",
        ok.elapsed.as_secs_f64()
    );

    // No disk: /init must say why and power the VM off by itself.
    let nodisk = boot(&kernel.vmlinuz(), &initramfs.path, None, "microvm", &sock);
    assert!(nodisk.exited, "QEMU kept running without a disk");
    assert!(nodisk
        .output
        .contains("shoal-init: FATAL: /dev/vda did not appear"));

    // With acpi=off the devices are only on the command line, which this
    // kernel (no CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES) ignores: /init fails
    // cleanly and, with no ACPI poweroff, reboots into -no-reboot's exit.
    let noacpi = boot(
        &kernel.vmlinuz(),
        &initramfs.path,
        Some(&disk),
        "microvm,acpi=off",
        &sock,
    );
    assert!(noacpi.exited, "QEMU kept running with acpi=off");
    assert!(noacpi
        .output
        .contains("shoal-init: FATAL: /dev/vda did not appear"));
    assert!(noacpi.output.contains("rebooting (no ACPI poweroff)"));
    assert!(!noacpi.output.contains("SHOAL-BOOT-OK"));
}

fn indicatif_hidden() -> indicatif::ProgressDrawTarget {
    indicatif::ProgressDrawTarget::hidden()
}
