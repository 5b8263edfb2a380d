//! The jail every QEMU runs in: an unprivileged uid of its own, an empty
//! root directory, a cgroup with limits, and nothing inherited it did not
//! ask for.
//!
//! QEMU starts as root only to open what the engine names on its command
//! line (guest memory file, disk layers, sockets, the tap in its network
//! namespace, the device state on a descriptor). Then, before the monitor
//! answers or the guest runs a single instruction, it `chroot`s into
//! [`JailConfig::root`] (empty, root-owned, read-only) and drops to
//! uid = gid = [`JailConfig::uid_base`] + its network slot's index, with no
//! capabilities and `no_new_privs`; its seccomp filter forbids spawning
//! processes and changing resource controls. So a guest that escapes into
//! QEMU holds only the descriptors it already had: the state directory, the
//! database, other VMs' files and the host's `/` are not in its root, and a
//! uid of its own stops it from signalling or tracing a neighbour.
//!
//! Owns: the jail's configuration, preparing the root directory, a VM's
//! [`VmJail`] (uid, cgroup) and what its QEMU child does between fork and
//! exec. Does not own: QEMU's flags (`qemu.rs` turns a [`VmJail`] into
//! `-chroot`/`-runas`), the network namespace (`net.rs`).
//!
//! Anything QEMU must open after the drop comes in as a descriptor (QMP
//! `add-fd`, then `/dev/fdset/N`): see [`crate::qemu::save_device_state`].

use crate::cgroup::{Cgroups, Limits, VmCgroup};
use crate::error::{EngineError, IoContext, Result};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// How VMs are contained.
#[derive(Debug, Clone)]
pub struct JailConfig {
    /// VM uids (and gids) are this plus the VM's network slot index (0 to
    /// 16,383): a range no account on the host uses.
    pub uid_base: u32,
    /// The empty directory every QEMU is `chroot`ed into.
    pub root: PathBuf,
    /// What a VM's cgroup may hold beyond its guest RAM: QEMU's heap, its
    /// translation cache (64 MiB under TCG), libraries, the page cache of
    /// the files it reads.
    pub memory_overhead_mib: u32,
    /// Replaces guest RAM + overhead as the memory limit (tests use a small
    /// one to provoke an out-of-memory kill).
    pub memory_limit_mib: Option<u32>,
    /// Tasks beyond one per vCPU: QEMU's own threads (about 5) and its block
    /// thread pool (up to 64).
    pub extra_pids: u32,
    /// CPU weight of each VM (v2 scale: 100 is the default share).
    pub cpu_weight: u32,
    /// Block I/O weight of each VM (v2 scale), where the host supports it.
    pub io_weight: u32,
}

/// The default [`JailConfig::uid_base`].
pub const DEFAULT_UID_BASE: u32 = 1_900_000_000;

impl JailConfig {
    /// The cgroup limits of a VM with `vcpus` and `memory_mib` of RAM.
    pub fn limits(&self, vcpus: u32, memory_mib: u32) -> Limits {
        let memory_mib = self
            .memory_limit_mib
            .unwrap_or(memory_mib + self.memory_overhead_mib);
        Limits {
            memory_bytes: u64::from(memory_mib) << 20,
            pids: vcpus + self.extra_pids,
            cpus: vcpus,
            cpu_weight: self.cpu_weight,
            io_weight: self.io_weight,
        }
    }
}

impl Default for JailConfig {
    fn default() -> Self {
        JailConfig {
            uid_base: DEFAULT_UID_BASE,
            root: PathBuf::from("/run/shoal/jail"),
            memory_overhead_mib: 256,
            memory_limit_mib: None,
            extra_pids: 80,
            cpu_weight: 100,
            io_weight: 100,
        }
    }
}

/// The engine's jail: its configuration and the host's cgroups.
#[derive(Debug)]
pub struct Jail {
    config: JailConfig,
    cgroups: Cgroups,
}

/// One VM's containment, held as long as its QEMU lives.
#[derive(Debug)]
pub struct VmJail {
    pub uid: u32,
    pub gid: u32,
    pub root: PathBuf,
    pub cgroup: VmCgroup,
}

impl Jail {
    /// Prepares the jail's root (made if missing; refused if anyone but
    /// root owns it, anyone may write it, or it holds anything) and the
    /// cgroup parent.
    pub fn open(config: JailConfig) -> Result<Jail> {
        prepare_root(&config.root)?;
        let cgroups = Cgroups::open()?;
        Ok(Jail { config, cgroups })
    }

    pub fn config(&self) -> &JailConfig {
        &self.config
    }

    /// The cgroup version VMs are placed with.
    pub fn cgroup_version(&self) -> u32 {
        self.cgroups.version()
    }

    /// The uid of the VM in network slot `index`.
    pub fn uid_of(&self, index: u32) -> u32 {
        self.config.uid_base + index
    }

    /// The jail of a VM with `vcpus` and `memory_mib` of RAM in network slot
    /// `index`: its cgroup is made, with its limits, here.
    pub fn for_vm(&self, index: u32, vcpus: u32, memory_mib: u32) -> Result<VmJail> {
        let limits = self.limits(vcpus, memory_mib);
        let cgroup = self.cgroups.create(index, &limits)?;
        Ok(self.jail_in(index, cgroup))
    }

    fn jail_in(&self, index: u32, cgroup: VmCgroup) -> VmJail {
        let uid = self.uid_of(index);
        VmJail {
            uid,
            gid: uid,
            root: self.config.root.clone(),
            cgroup,
        }
    }

    /// The jail of QEMU `pid`, left running in network slot `index` by an
    /// engine that died: its cgroup is taken over as it is.
    pub fn adopt_vm(&self, index: u32, pid: u32) -> Result<VmJail> {
        Ok(self.jail_in(index, self.cgroups.adopt(index, pid)?))
    }

    pub fn limits(&self, vcpus: u32, memory_mib: u32) -> Limits {
        self.config.limits(vcpus, memory_mib)
    }

    /// Removes VM groups a crashed engine left empty (see
    /// [`Cgroups::reap_empty`]).
    pub fn reap_cgroups(&self, slot_in_use: impl Fn(u32) -> bool) {
        self.cgroups.reap_empty(slot_in_use);
    }
}

fn prepare_root(root: &Path) -> Result<()> {
    std::fs::create_dir_all(root).io_context(|| format!("creating {}", root.display()))?;
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o555))
        .io_context(|| format!("setting the mode of {}", root.display()))?;
    let meta =
        std::fs::symlink_metadata(root).io_context(|| format!("reading {}", root.display()))?;
    let refuse = |why: &str| {
        Err(EngineError::Qemu {
            message: format!(
                "the VM jail {} {why}; it must be an empty directory owned by root with mode 0555",
                root.display()
            ),
        })
    };
    if !meta.is_dir() {
        return refuse("is not a directory");
    }
    if meta.uid() != 0 || meta.gid() != 0 {
        return refuse("is not owned by root");
    }
    if std::fs::read_dir(root)
        .io_context(|| format!("listing {}", root.display()))?
        .next()
        .is_some()
    {
        return refuse("is not empty");
    }
    Ok(())
}

/// What QEMU's child does between fork and exec, after it joined its
/// network namespace: join its cgroup (so its first page is charged there),
/// volunteer to die first when the host runs short of memory, dump no
/// core, and pass on no descriptor above `keep_below`.
///
/// # Safety
/// Async-signal-safe only: raw system calls on descriptors and a path
/// prepared before the fork.
pub(crate) unsafe fn in_child(cgroup_fds: &[i32], keep_below: i32) -> std::io::Result<()> {
    // SAFETY: each call below is a plain system call on values owned by the
    // caller; nothing allocates.
    unsafe {
        crate::cgroup::attach_self(cgroup_fds)?;
        let path = c"/proc/self/oom_score_adj";
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd >= 0 {
            let value = b"500";
            libc::write(fd, value.as_ptr().cast(), value.len());
            libc::close(fd);
        }
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::setrlimit(libc::RLIMIT_CORE, &no_core) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Everything from `keep_below` up closes at exec, whoever opened it
        // without O_CLOEXEC.
        libc::syscall(
            libc::SYS_close_range,
            keep_below as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_must_be_empty_and_roots() {
        let scratch = std::env::temp_dir().join(format!("shoal-jail-{}", std::process::id()));
        let root = scratch.join("jail");
        prepare_root(&root).unwrap();
        let meta = std::fs::metadata(&root).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o555);
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(root.join("db.sqlite"), b"x").unwrap();
        let refused = prepare_root(&root).unwrap_err().to_string();
        assert!(refused.contains("not empty"), "{refused}");
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::remove_dir_all(&scratch).unwrap();
    }

    #[test]
    fn limits_cover_guest_ram_and_qemu() {
        let config = JailConfig::default();
        let limits = config.limits(2, 1024);
        assert_eq!(limits.memory_bytes, (1024 + 256) << 20);
        assert_eq!((limits.pids, limits.cpus), (82, 2));
        let small = JailConfig {
            memory_limit_mib: Some(300),
            ..JailConfig::default()
        };
        assert_eq!(small.limits(8, 4096).memory_bytes, 300 << 20);
    }
}
