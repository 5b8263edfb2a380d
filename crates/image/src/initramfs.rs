//! The initramfs layer: a newc cpio holding static busybox, the guest's
//! virtio modules and an `/init` that mounts `/dev/vda` and `switch_root`s
//! into the guest agent.
//!
//! Owns the archive format (written here, byte-for-byte reproducible: same
//! inputs, same sha256) and the `/init` script. The archive is left
//! uncompressed: it is about 3 MB, and skipping decompression saves guest
//! time under TCG. Cached under `images/initramfs/<key>/`. Knows nothing of
//! how the VM is started.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use indicatif::MultiProgress;
use serde::{Deserialize, Serialize};

use crate::cache::{self, KeyBuilder};
use crate::cmd;
use crate::error::{ImageError, IoContext};
use crate::host::{self, BUSYBOX};
use crate::kernel::KernelLayer;
use crate::progress::{Step, StepReport};

/// The shell functions of `/init` (testable on their own).
pub const INIT_LIB: &str = include_str!("init/lib.sh");
/// The body of `/init`.
pub const INIT_MAIN: &str = include_str!("init/main.sh");

/// Bump when the archive layout changes in a way the key would not see.
const INITRAMFS_LAYER_VERSION: &str = "1";
const LAYER: &str = "initramfs";
/// File name of the archive inside the layer directory.
pub const INITRAMFS_FILE: &str = "initramfs.cpio";

/// The complete `/init` script.
pub fn init_script() -> String {
    format!("#!/bin/sh\n{INIT_LIB}\n{INIT_MAIN}")
}

/// What `artifacts.json` of an initramfs layer records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitramfsInfo {
    /// sha256 of the archive bytes.
    pub content_sha256: String,
    pub size_bytes: u64,
    pub kernel_version: String,
}

/// A finished initramfs layer.
#[derive(Debug, Clone)]
pub struct InitramfsLayer {
    pub path: PathBuf,
    pub key: String,
    pub info: InitramfsInfo,
}

/// The cache key of the initramfs for `kernel` with busybox `busybox_sha`.
pub fn initramfs_key(kernel: &KernelLayer, busybox_sha: &str) -> String {
    KeyBuilder::new(LAYER)
        .field("layer-version", INITRAMFS_LAYER_VERSION)
        .field("kernel", &kernel.key)
        .field("busybox", busybox_sha)
        .field("init", init_script())
        .finish()
}

/// Returns the cached initramfs for `kernel`, building it if needed.
/// Installs busybox-static on the host if /bin/busybox is missing.
pub fn build_initramfs(
    images_dir: &Path,
    kernel: &KernelLayer,
    progress: &MultiProgress,
) -> Result<(InitramfsLayer, StepReport), ImageError> {
    let step = Step::start(progress, "initramfs", "checking busybox");
    host::ensure_tools(&[], true)?;
    let busybox_sha = cache::sha256_file_cached(images_dir, Path::new(BUSYBOX))?;
    let key = initramfs_key(kernel, &busybox_sha);
    let dir = images_dir.join(LAYER).join(&key[..16]);
    let path = dir.join(INITRAMFS_FILE);
    let detail = |i: &InitramfsInfo| {
        format!(
            "{} KiB, sha256 {}",
            i.size_bytes / 1024,
            &i.content_sha256[..12]
        )
    };
    if let Some(rec) = cache::read_record::<InitramfsInfo>(&dir, LAYER, &key) {
        let report = step.finish(true, detail(&rec.info));
        return Ok((
            InitramfsLayer {
                path,
                key,
                info: rec.info,
            },
            report,
        ));
    }
    step.message("writing cpio archive");
    let rec = cache::build_layer(&dir, LAYER, &key, |tmp| {
        let bytes = initramfs_archive(kernel)?;
        fs::write(tmp.join(INITRAMFS_FILE), &bytes).ctx(|| "writing initramfs".into())?;
        Ok(InitramfsInfo {
            content_sha256: cache::sha256_bytes(&bytes),
            size_bytes: bytes.len() as u64,
            kernel_version: kernel.info.kernel_version.clone(),
        })
    })?;
    let report = step.finish(false, detail(&rec.info));
    Ok((
        InitramfsLayer {
            path,
            key,
            info: rec.info,
        },
        report,
    ))
}

/// The archive bytes: directories, /dev/console, busybox and its applet
/// links, the modules with their load order, and /init.
fn initramfs_archive(kernel: &KernelLayer) -> Result<Vec<u8>, ImageError> {
    let mut cpio = CpioWriter::default();
    for dir in [
        "bin",
        "dev",
        "etc",
        "lib",
        "lib/modules",
        "newroot",
        "proc",
        "run",
        "sbin",
        "sys",
        "tmp",
        "usr",
        "usr/bin",
        "usr/sbin",
    ] {
        cpio.dir(dir, 0o755);
    }
    // The kernel opens /dev/console for /init's stdio before /init runs:
    // without this node /init would start with no output at all.
    cpio.char_device("dev/console", 0o600, 5, 1);

    let busybox = fs::read(BUSYBOX).ctx(|| format!("reading {BUSYBOX}"))?;
    cpio.file("bin/busybox", 0o755, &busybox);
    // `busybox --list-full` gives each applet's conventional path.
    let applets = cmd::run(Command::new(BUSYBOX).arg("--list-full"))?;
    let links: BTreeSet<&str> = applets
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && *l != "bin/busybox")
        .collect();
    for link in links {
        cpio.symlink(link, "/bin/busybox");
    }

    let mut order = String::new();
    for module in &kernel.info.modules {
        let path = kernel.modules_dir().join(module);
        let bytes = fs::read(&path).ctx(|| format!("reading {}", path.display()))?;
        cpio.file(&format!("lib/modules/{module}"), 0o644, &bytes);
        order.push_str(module);
        order.push('\n');
    }
    cpio.file("lib/modules/load-order", 0o644, order.as_bytes());
    cpio.file("init", 0o755, init_script().as_bytes());
    Ok(cpio.finish())
}

/// Writes a cpio archive in the "newc" format the kernel unpacks. Every
/// entry is owned by root with mtime 0, so the bytes depend only on content.
#[derive(Default)]
pub struct CpioWriter {
    out: Vec<u8>,
    next_ino: u32,
}

impl CpioWriter {
    pub fn dir(&mut self, name: &str, perm: u32) {
        self.entry(name, 0o040000 | perm, 0, 0, &[]);
    }
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, 0o100000 | perm, 0, 0, data);
    }
    pub fn symlink(&mut self, name: &str, target: &str) {
        self.entry(name, 0o120777, 0, 0, target.as_bytes());
    }
    pub fn char_device(&mut self, name: &str, perm: u32, major: u32, minor: u32) {
        self.entry(name, 0o020000 | perm, major, minor, &[]);
    }

    fn entry(&mut self, name: &str, mode: u32, rdev_major: u32, rdev_minor: u32, data: &[u8]) {
        self.next_ino += 1;
        let nlink = if mode & 0o170000 == 0o040000 { 2 } else { 1 };
        let fields = [
            self.next_ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            data.len() as u32,
            0, // dev major
            0, // dev minor
            rdev_major,
            rdev_minor,
            name.len() as u32 + 1,
            0, // check
        ];
        self.out.extend_from_slice(b"070701");
        for f in fields {
            self.out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        // newc aligns every header and every file body to 4 bytes.
        while self.out.len() & 3 != 0 {
            self.out.push(0);
        }
    }

    /// Appends the trailer and returns the archive.
    pub fn finish(mut self) -> Vec<u8> {
        self.next_ino = 0;
        self.entry("TRAILER!!!", 0, 0, 0, &[]);
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::process::Stdio;

    fn busybox_sh(script: &str) -> Option<String> {
        if !Path::new(BUSYBOX).exists() {
            eprintln!("skipping: no {BUSYBOX}");
            return None;
        }
        let out = Command::new(BUSYBOX)
            .args(["sh", "-c", script])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(String::from_utf8(out.stdout).unwrap())
    }

    #[test]
    fn cmdline_without_mmio_devices_gives_no_params() {
        let script = format!("{INIT_LIB}\nmmio_params_from_cmdline 'console=ttyS0 quiet panic=-1'");
        if let Some(out) = busybox_sh(&script) {
            assert_eq!(out, "\n");
        }
    }

    #[test]
    fn cmdline_mmio_devices_become_insmod_params() {
        let cmdline = "console=ttyS0 virtio_mmio.device=512@0xfeb00e00:12 reboot=t virtio_mmio.device=512@0xfeb00c00:11";
        let script = format!("{INIT_LIB}\nmmio_params_from_cmdline '{cmdline}'");
        if let Some(out) = busybox_sh(&script) {
            assert_eq!(out, "device=512@0xfeb00e00:12 device=512@0xfeb00c00:11\n");
        }
    }

    #[test]
    fn wait_for_block_gives_up() {
        let script = format!(
            "{INIT_LIB}\nif wait_for_block /nonexistent 2; then echo found; else echo gave-up; fi"
        );
        if let Some(out) = busybox_sh(&script) {
            assert_eq!(out, "gave-up\n");
        }
    }

    #[test]
    fn init_script_parses() {
        if !Path::new(BUSYBOX).exists() {
            return;
        }
        let out = Command::new(BUSYBOX)
            .args(["sh", "-n", "-c", &init_script()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn cpio_is_readable_by_gnu_cpio_and_reproducible() {
        let build = || {
            let mut c = CpioWriter::default();
            c.dir("bin", 0o755);
            c.file("bin/hello", 0o755, b"#!/bin/sh\necho hi\n");
            c.symlink("bin/sh", "/bin/busybox");
            c.char_device("dev/console", 0o600, 5, 1);
            c.finish()
        };
        let bytes = build();
        assert_eq!(bytes, build());
        assert_eq!(bytes.len() % 4, 0);
        if Command::new("cpio").arg("--version").output().is_err() {
            eprintln!("skipping listing check: no cpio");
            return;
        }
        let mut child = Command::new("cpio")
            .args(["-itv", "--quiet"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(&bytes).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        let listing = String::from_utf8(out.stdout).unwrap();
        assert!(listing.contains("bin/hello"), "{listing}");
        assert!(listing.contains("bin/sh -> /bin/busybox"), "{listing}");
        assert!(listing.contains("crw-------"), "{listing}");
    }
}
