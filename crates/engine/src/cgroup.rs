//! Per-VM cgroups: the memory, task, CPU and block-I/O limits of each QEMU,
//! on cgroup v2 (one unified hierarchy) and v1 (a hierarchy per controller)
//! hosts alike.
//!
//! Owns: finding the hierarchies, the engine's parent group (`shoal`, made
//! under the engine's own cgroup in each hierarchy, so whatever limits the
//! engine's service limits its VMs too), one child group per VM named after
//! its network slot (`slot-N`: host-unique while the slot's lock is held,
//! the same index as the VM's uid, see `jail.rs`), the limits written into
//! it, the descriptors QEMU's child writes itself into before exec (so every
//! page it touches is charged to its own group from the first), the
//! out-of-memory counter read after an exit, and removing the group.
//!
//! Does not own: which limits a VM gets (the engine's `JailConfig`), killing
//! QEMU (the engine does; [`VmCgroup::kill_all`] only serves the reaper).
//!
//! Attaching a task takes the kernel's global threadgroup lock, which waits
//! for an RCU grace period (5-14 ms measured here) unless the cgroup2 mount
//! has `favordynmods`; [`Cgroups::open`] remounts it with that option, which
//! fixes v1 hierarchies too (measured: 0.1-0.2 ms an attach).

use crate::error::{EngineError, IoContext, Result};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The engine's parent group's name, under its own cgroup.
const PARENT: &str = "shoal";

/// The limits of one VM's group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Everything QEMU may charge: guest RAM it dirties, its own heap and
    /// translation cache, the page cache it reads the template through (that
    /// part is reclaimed first).
    pub memory_bytes: u64,
    /// Tasks (threads): vCPUs, QEMU's own threads and its block thread pool.
    pub pids: u32,
    /// CPU time per period, in CPUs: the vCPUs asked for.
    pub cpus: u32,
    /// Relative CPU share (v2's `cpu.weight` scale, 1-10000, 100 default).
    pub cpu_weight: u32,
    /// Relative block I/O share (1-10000 on v2's scale, 100 default; v1 maps
    /// it onto 10-1000), where the host's I/O scheduler supports weights.
    pub io_weight: u32,
}

#[derive(Debug, Clone)]
enum Layout {
    /// One hierarchy: the engine's parent group there.
    V2 { parent: PathBuf },
    /// The parent group in each controller's hierarchy; block I/O only where
    /// the host mounts it.
    V1 {
        memory: PathBuf,
        pids: PathBuf,
        cpu: PathBuf,
        blkio: Option<PathBuf>,
    },
}

/// The engine's view of the host's cgroups.
#[derive(Debug, Clone)]
pub struct Cgroups {
    layout: Layout,
}

/// One VM's group, in every hierarchy. Removed by [`VmCgroup::remove`] once
/// its QEMU is gone (and on drop, as a last resort).
#[derive(Debug)]
pub struct VmCgroup {
    name: String,
    dirs: Vec<PathBuf>,
    memory_dir: PathBuf,
    v2: bool,
    /// `cgroup.procs` of each directory, opened for writing before the fork:
    /// the child writes "0" (itself) into each, which is async-signal-safe.
    procs: Vec<OwnedFd>,
}

impl Cgroups {
    /// Finds the hierarchies this host mounts (through `mountinfo`, whose
    /// root column matters: inside a container a hierarchy's root may be a
    /// subdirectory) and makes the parent group under this process's own
    /// cgroup in each.
    pub fn open() -> Result<Cgroups> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .io_context(|| "reading /proc/self/mountinfo".into())?;
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .io_context(|| "reading /proc/self/cgroup".into())?;
        let mut mounts = parse_mounts(&mountinfo);
        let memberships = parse_memberships(&own);
        let layout = match choose_layout(&mounts, &memberships) {
            Ok(layout) => layout,
            Err(not_mounted) => {
                // `ip netns exec` (and some minimal containers) give the
                // engine a fresh /sys without the host's cgroup mounts: the
                // hierarchies still exist, they are just not visible here.
                let controllers = std::fs::read_to_string("/proc/cgroups").unwrap_or_default();
                if !mount_own_hierarchies(&controllers, &mounts) {
                    return Err(not_mounted);
                }
                let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
                    .io_context(|| "reading /proc/self/mountinfo".into())?;
                mounts = parse_mounts(&mountinfo);
                choose_layout(&mounts, &memberships)?
            }
        };
        if let Some(unified) = mounts.iter().find(|m| m.v2) {
            ensure_favordynmods(unified);
        }
        let cgroups = Cgroups { layout };
        cgroups.prepare_parent()?;
        Ok(cgroups)
    }

    /// Which cgroup version VMs are placed with.
    pub fn version(&self) -> u32 {
        match self.layout {
            Layout::V2 { .. } => 2,
            Layout::V1 { .. } => 1,
        }
    }

    fn parents(&self) -> Vec<PathBuf> {
        match &self.layout {
            Layout::V2 { parent } => vec![parent.clone()],
            Layout::V1 {
                memory,
                pids,
                cpu,
                blkio,
            } => {
                let mut out = vec![memory.clone(), pids.clone(), cpu.clone()];
                out.extend(blkio.clone());
                out
            }
        }
    }

    fn prepare_parent(&self) -> Result<()> {
        for parent in self.parents() {
            std::fs::create_dir_all(&parent)
                .io_context(|| format!("creating cgroup {}", parent.display()))?;
        }
        if let Layout::V2 { parent } = &self.layout {
            enable_v2_controllers(parent)?;
        }
        Ok(())
    }

    /// Makes VM group `slot-<index>` with `limits`. A group of that name
    /// left by an engine that died is emptied (its processes killed: their
    /// slot lock was free, so nothing owns them) and made anew.
    pub fn create(&self, index: u32, limits: &Limits) -> Result<VmCgroup> {
        let name = format!("slot-{index}");
        let dirs: Vec<PathBuf> = self.parents().iter().map(|p| p.join(&name)).collect();
        for dir in &dirs {
            if dir.exists() {
                tracing::warn!(cgroup = %dir.display(), "a VM group was left behind; emptying it");
                kill_members(dir, self.version() == 2);
                remove_dir_patiently(dir);
            }
            std::fs::create_dir(dir).io_context(|| format!("creating cgroup {}", dir.display()))?;
        }
        let group = VmCgroup {
            name,
            memory_dir: dirs[0].clone(),
            v2: self.version() == 2,
            procs: Vec::new(),
            dirs,
        };
        // Limits first, so nothing runs unlimited even for a moment.
        let written = match &self.layout {
            Layout::V2 { .. } => write_v2_limits(&group.dirs[0], limits),
            Layout::V1 { blkio, .. } => write_v1_limits(&group.dirs, blkio.is_some(), limits),
        };
        let mut group = group;
        let opened = written.and_then(|()| {
            group.procs = open_procs(&group.dirs)?;
            Ok(())
        });
        if let Err(e) = opened {
            group.remove();
            return Err(e);
        }
        Ok(group)
    }

    /// Takes over VM group `slot-<index>`, left by an engine that died
    /// while its QEMU `pid` kept running in it: nothing is killed or
    /// rewritten, the group must exist in every hierarchy and hold `pid`.
    pub fn adopt(&self, index: u32, pid: u32) -> Result<VmCgroup> {
        let name = format!("slot-{index}");
        let dirs: Vec<PathBuf> = self.parents().iter().map(|p| p.join(&name)).collect();
        let unadoptable = |why: String| crate::error::EngineError::Qemu {
            message: format!("cannot adopt cgroup {name}: {why}"),
        };
        for dir in &dirs {
            if !members(dir).contains(&pid) {
                return Err(unadoptable(format!(
                    "{} does not hold QEMU {pid}",
                    dir.display()
                )));
            }
        }
        let procs = open_procs(&dirs)?;
        Ok(VmCgroup {
            name,
            memory_dir: dirs[0].clone(),
            v2: self.version() == 2,
            procs,
            dirs,
        })
    }

    /// Removes VM groups under the parent that have no member left and are
    /// not `slot-N` of a slot someone holds (`in_use`): what a crashed
    /// engine left. Members are never killed here; `create` does that for
    /// the one slot it is about to use.
    pub fn reap_empty(&self, in_use: impl Fn(u32) -> bool) {
        for parent in self.parents() {
            let Ok(entries) = std::fs::read_dir(&parent) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some(index) = name.strip_prefix("slot-").and_then(|n| n.parse().ok()) else {
                    continue;
                };
                let dir = entry.path();
                if !in_use(index) && members(&dir).is_empty() {
                    let _ = std::fs::remove_dir(&dir);
                }
            }
        }
    }
}

impl VmCgroup {
    /// The descriptors QEMU's child writes "0" into before exec.
    pub fn attach_fds(&self) -> Vec<RawFd> {
        self.procs.iter().map(|fd| fd.as_raw_fd()).collect()
    }

    /// The group's name, `slot-N`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The group's directories, one per hierarchy.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// How many times the kernel killed a task of this group for memory.
    pub fn oom_kills(&self) -> u64 {
        self.oom_counter().kills()
    }

    /// Reads [`VmCgroup::oom_kills`] and the group's memory pressure
    /// without holding the group.
    pub fn oom_counter(&self) -> OomCounter {
        OomCounter {
            dir: self.memory_dir.clone(),
            v2: self.v2,
            thrash_killed: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Pids of the group's members (from the memory hierarchy's group).
    pub fn members(&self) -> Vec<u32> {
        members(&self.memory_dir)
    }

    /// Kills every member (the reaper's path; the engine kills its QEMU
    /// by process group).
    pub fn kill_all(&self) {
        kill_members(&self.memory_dir, self.v2);
    }

    /// Removes the group once its members are gone (a dying QEMU leaves
    /// its group a little after it exits: retried briefly).
    pub fn remove(mut self) {
        self.remove_dirs();
    }

    fn remove_dirs(&mut self) {
        self.procs.clear();
        for dir in std::mem::take(&mut self.dirs) {
            remove_dir_patiently(&dir);
        }
    }
}

impl Drop for VmCgroup {
    fn drop(&mut self) {
        self.remove_dirs();
    }
}

/// A VM group's out-of-memory kills: the kernel's counter (`oom_kill` in
/// v1's `memory.oom_control`, v2's `memory.events`) plus the engine's own
/// kill of a group that thrashes at its limit ([`ThrashWatch`]).
#[derive(Debug, Clone)]
pub struct OomCounter {
    dir: PathBuf,
    v2: bool,
    thrash_killed: Arc<AtomicBool>,
}

impl OomCounter {
    pub fn kills(&self) -> u64 {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        let kernel = std::fs::read_to_string(self.dir.join(file))
            .ok()
            .and_then(|text| counter(&text, "oom_kill"))
            .unwrap_or(0);
        kernel + u64::from(self.thrash_killed.load(Ordering::SeqCst))
    }

    /// Records that the engine killed the group for thrashing at its limit.
    pub fn count_thrash_kill(&self) {
        self.thrash_killed.store(true, Ordering::SeqCst);
    }

    /// The group's memory use, its limit and its major page faults so far.
    pub fn pressure(&self) -> Option<MemoryPressure> {
        let read = |file: &str| std::fs::read_to_string(self.dir.join(file)).ok();
        let (usage, limit) = if self.v2 {
            ("memory.current", "memory.max")
        } else {
            ("memory.usage_in_bytes", "memory.limit_in_bytes")
        };
        Some(MemoryPressure {
            usage_bytes: read(usage)?.trim().parse().ok()?,
            // v2's "max" is no limit: nothing to thrash against.
            limit_bytes: read(limit)?.trim().parse().unwrap_or(u64::MAX),
            major_faults: counter(&read("memory.stat")?, "pgmajfault")?,
        })
    }
}

/// One reading of [`OomCounter::pressure`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryPressure {
    pub usage_bytes: u64,
    pub limit_bytes: u64,
    pub major_faults: u64,
}

/// Tells a group that lives at its memory limit by refaulting its own
/// pages from one that is merely full. Without swap the kernel kills only
/// when it can reclaim nothing; a QEMU whose guest memory is a private map
/// of the template file can always drop a clean template page and read it
/// back, so it would thrash at its limit (measured: 190% CPU and 20,000
/// major faults a minute, never killed) instead of dying. What systemd-oomd
/// does with pressure stall information, done with counters both cgroup
/// versions have.
#[derive(Debug, Default)]
pub struct ThrashWatch {
    last_faults: Option<u64>,
    thrashing_for: u32,
}

impl ThrashWatch {
    /// Within this of the limit counts as at it.
    pub const AT_LIMIT_SLACK_BYTES: u64 = 4 << 20;
    /// Major faults per reading (one a second) that count as thrashing.
    pub const FAULTS_PER_READING: u64 = 100;
    /// Readings in a row at the limit and thrashing before the kill.
    pub const READINGS: u32 = 5;

    /// Takes one reading; true when the group has thrashed long enough to
    /// be killed for memory.
    pub fn observe(&mut self, reading: MemoryPressure) -> bool {
        let faults = reading
            .major_faults
            .saturating_sub(self.last_faults.unwrap_or(reading.major_faults));
        self.last_faults = Some(reading.major_faults);
        let at_limit = reading.usage_bytes + Self::AT_LIMIT_SLACK_BYTES >= reading.limit_bytes;
        if at_limit && faults >= Self::FAULTS_PER_READING {
            self.thrashing_for += 1;
        } else {
            self.thrashing_for = 0;
        }
        self.thrashing_for >= Self::READINGS
    }
}

/// Writes "0" (the calling process) into each descriptor: called between
/// fork and exec, so only `write(2)`.
///
/// # Safety
/// Async-signal-safe; the descriptors must be open `cgroup.procs` files.
pub(crate) unsafe fn attach_self(fds: &[RawFd]) -> std::io::Result<()> {
    for &fd in fds {
        // SAFETY: writing a static byte to a descriptor the caller owns.
        if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } != 1 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn write_v2_limits(dir: &Path, limits: &Limits) -> Result<()> {
    write(dir, "memory.max", &limits.memory_bytes.to_string())?;
    // Guest memory swapped out would only hide the limit; QEMU's pages are
    // the guest's RAM.
    write_optional(dir, "memory.swap.max", "0")?;
    // A kill takes the whole QEMU, never one of its threads.
    write_optional(dir, "memory.oom.group", "1")?;
    write(dir, "pids.max", &limits.pids.to_string())?;
    write(
        dir,
        "cpu.max",
        &format!("{} {CFS_PERIOD_US}", u64::from(limits.cpus) * CFS_PERIOD_US),
    )?;
    write(
        dir,
        "cpu.weight",
        &limits.cpu_weight.clamp(1, 10_000).to_string(),
    )?;
    write_optional(
        dir,
        "io.weight",
        &format!("default {}", limits.io_weight.clamp(1, 10_000)),
    )?;
    Ok(())
}

const CFS_PERIOD_US: u64 = 100_000;

fn write_v1_limits(dirs: &[PathBuf], has_blkio: bool, limits: &Limits) -> Result<()> {
    let (memory, pids, cpu) = (&dirs[0], &dirs[1], &dirs[2]);
    write(
        memory,
        "memory.limit_in_bytes",
        &limits.memory_bytes.to_string(),
    )?;
    // With swap accounting, memory plus swap gets the same cap: no swap.
    write_optional(
        memory,
        "memory.memsw.limit_in_bytes",
        &limits.memory_bytes.to_string(),
    )?;
    write(pids, "pids.max", &limits.pids.to_string())?;
    write(cpu, "cpu.cfs_period_us", &CFS_PERIOD_US.to_string())?;
    write(
        cpu,
        "cpu.cfs_quota_us",
        &(u64::from(limits.cpus) * CFS_PERIOD_US).to_string(),
    )?;
    // v1 shares are 1024 for v2's weight of 100.
    let shares = (u64::from(limits.cpu_weight.clamp(1, 10_000)) * 1024 / 100).max(2);
    write(cpu, "cpu.shares", &shares.to_string())?;
    if has_blkio {
        // 10-1000 on v1 (BFQ's `blkio.bfq.weight` first); hosts without a
        // weighting scheduler have neither file, and nothing to share.
        let weight = (limits.io_weight.clamp(1, 10_000) * 10).clamp(10, 1000);
        let blkio = &dirs[3];
        if blkio.join("blkio.bfq.weight").exists() {
            write(blkio, "blkio.bfq.weight", &weight.to_string())?;
        } else {
            write_optional(blkio, "blkio.weight", &weight.to_string())?;
        }
    }
    Ok(())
}

fn write(dir: &Path, file: &str, value: &str) -> Result<()> {
    let path = dir.join(file);
    std::fs::write(&path, value).io_context(|| format!("writing {value:?} to {}", path.display()))
}

/// Writes a file that some kernels or configurations lack.
fn write_optional(dir: &Path, file: &str, value: &str) -> Result<()> {
    if dir.join(file).exists() {
        write(dir, file, value)
    } else {
        Ok(())
    }
}

fn counter(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (name, value) = line.split_once(' ')?;
        (name == key).then(|| value.trim().parse().ok())?
    })
}

/// Each group directory's `cgroup.procs`, opened for writing (a new
/// QEMU's child joins its groups by writing "0" into them).
fn open_procs(dirs: &[PathBuf]) -> Result<Vec<OwnedFd>> {
    dirs.iter()
        .map(|dir| {
            let path = dir.join("cgroup.procs");
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .map(OwnedFd::from)
                .io_context(|| format!("opening {}", path.display()))
        })
        .collect()
}

fn members(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

fn kill_members(dir: &Path, v2: bool) {
    if v2 && dir.join("cgroup.kill").exists() {
        let _ = std::fs::write(dir.join("cgroup.kill"), "1");
    }
    for pid in members(dir) {
        // SAFETY: kill(2) of a process that is a member of our own VM group.
        unsafe {
            libc::kill(pid as i32, libc::SIGKILL);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while !members(dir).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn remove_dir_patiently(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) if Instant::now() >= deadline => {
                tracing::warn!(cgroup = %dir.display(), error = %e, "a VM group could not be removed");
                return;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}

/// v2 only delegates a controller to a group's children once the group's
/// `cgroup.subtree_control` names it, and a group with member processes may
/// not do so (the "no internal processes" rule), so the chain from the
/// mount's root down to the parent must be enabled step by step.
fn enable_v2_controllers(parent: &Path) -> Result<()> {
    let wanted = ["memory", "pids", "cpu", "io"];
    let available = std::fs::read_to_string(parent.join("cgroup.controllers")).unwrap_or_default();
    let enable: Vec<String> = wanted
        .iter()
        .filter(|c| available.split_whitespace().any(|a| a == **c))
        .map(|c| format!("+{c}"))
        .collect();
    for required in ["memory", "pids", "cpu"] {
        if !available.split_whitespace().any(|a| a == required) {
            return Err(EngineError::Qemu {
                message: format!(
                    "the cgroup v2 controller {required} is not available at {} (cgroup.controllers: {:?}); enable it in the parent's cgroup.subtree_control",
                    parent.display(),
                    available.trim()
                ),
            });
        }
    }
    write(parent, "cgroup.subtree_control", &enable.join(" "))
}

#[derive(Debug, Clone)]
struct Mount {
    /// Where it is mounted.
    point: PathBuf,
    /// The hierarchy's directory shown at the mount point (`/` on a host).
    root: String,
    v2: bool,
    /// v1 controllers of the hierarchy.
    controllers: Vec<String>,
    options: String,
}

fn parse_mounts(mountinfo: &str) -> Vec<Mount> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let right: Vec<&str> = right.split(' ').collect();
            let fstype = *right.first()?;
            if fstype != "cgroup" && fstype != "cgroup2" {
                return None;
            }
            let super_options = right.get(2).copied().unwrap_or("");
            Some(Mount {
                point: PathBuf::from(unescape_mount_path(left.get(4)?)),
                root: unescape_mount_path(left.get(3)?),
                v2: fstype == "cgroup2",
                controllers: super_options
                    .split(',')
                    .filter(|o| ["memory", "pids", "cpu", "blkio"].contains(o))
                    .map(str::to_string)
                    .collect(),
                options: super_options.to_string(),
            })
        })
        .collect()
}

fn unescape_mount_path(raw: &str) -> String {
    raw.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\134", "\\")
}

/// `/proc/self/cgroup`: controller list (empty for v2) → path.
fn parse_memberships(text: &str) -> Vec<(Vec<String>, String)> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let _id = parts.next()?;
            let controllers = parts.next()?;
            let path = parts.next()?;
            Some((
                controllers
                    .split(',')
                    .filter(|c| !c.is_empty())
                    .map(str::to_string)
                    .collect(),
                path.to_string(),
            ))
        })
        .collect()
}

/// The directory of this process's own group in `mount`.
fn own_dir(mount: &Mount, own_path: &str) -> PathBuf {
    let relative = own_path
        .strip_prefix(mount.root.trim_end_matches('/'))
        .unwrap_or(own_path);
    mount.point.join(relative.trim_start_matches('/'))
}

fn choose_layout(mounts: &[Mount], memberships: &[(Vec<String>, String)]) -> Result<Layout> {
    let v1_dir = |controller: &str| -> Option<PathBuf> {
        let mount = mounts
            .iter()
            .find(|m| !m.v2 && m.controllers.iter().any(|c| c == controller))?;
        let own = memberships
            .iter()
            .find(|(cs, _)| cs.iter().any(|c| c == controller))
            .map(|(_, p)| p.as_str())
            .unwrap_or("/");
        Some(own_dir(mount, own).join(PARENT))
    };
    if let (Some(memory), Some(pids), Some(cpu)) = (v1_dir("memory"), v1_dir("pids"), v1_dir("cpu"))
    {
        return Ok(Layout::V1 {
            memory,
            pids,
            cpu,
            blkio: v1_dir("blkio"),
        });
    }
    let unified = mounts
        .iter()
        .find(|m| m.v2)
        .ok_or_else(|| EngineError::Qemu {
            message: "no cgroup hierarchy with the memory, pids and cpu controllers is mounted"
                .into(),
        })?;
    let own = memberships
        .iter()
        .find(|(cs, _)| cs.is_empty())
        .map(|(_, p)| p.as_str())
        .unwrap_or("/");
    Ok(Layout::V2 {
        parent: v2_parent(&own_dir(unified, own))?,
    })
}

/// The v2 parent: `shoal` beside the engine. If the engine's own group is
/// not the root and holds processes, it cannot delegate controllers to a
/// child (no internal processes), so the engine first moves itself into a
/// leaf of its own (`<own>/engine`), as a delegated service must.
fn v2_parent(own: &Path) -> Result<PathBuf> {
    let is_root = !own.join("cgroup.type").exists();
    if !is_root && !members(own).is_empty() {
        let leaf = own.join("engine");
        std::fs::create_dir_all(&leaf)
            .io_context(|| format!("creating cgroup {}", leaf.display()))?;
        for pid in members(own) {
            // Whole thread groups: every process of ours in the group.
            let _ = std::fs::write(leaf.join("cgroup.procs"), pid.to_string());
        }
        enable_v2_controllers(own)?;
    } else if !is_root {
        enable_v2_controllers(own)?;
    }
    Ok(own.join(PARENT))
}

/// Where the engine mounts hierarchies it cannot see (see [`Cgroups::open`]).
const OWN_MOUNTS: &str = "/run/shoal/cgroup";

/// Mounts the hierarchies that hold memory, pids, cpu and blkio under
/// [`OWN_MOUNTS`], one per v1 hierarchy (with every controller bound to it,
/// as the kernel requires: `/proc/cgroups` says which are bound together)
/// or the unified one when no controller is on v1. Returns whether anything
/// new was mounted.
fn mount_own_hierarchies(proc_cgroups: &str, mounts: &[Mount]) -> bool {
    let mut mounted = false;
    for (name, fstype, options) in hierarchies_to_mount(proc_cgroups) {
        let point = Path::new(OWN_MOUNTS).join(&name);
        if mounts.iter().any(|m| m.point == point) || std::fs::create_dir_all(&point).is_err() {
            continue;
        }
        let (Ok(target), Ok(fstype), Ok(data)) = (
            std::ffi::CString::new(point.as_os_str().as_encoded_bytes()),
            std::ffi::CString::new(fstype),
            std::ffi::CString::new(options),
        ) else {
            continue;
        };
        // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::mount(
                fstype.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                data.as_ptr().cast(),
            )
        };
        if rc == 0 {
            tracing::info!(mount = %point.display(), "mounted a cgroup hierarchy this mount namespace did not show");
            mounted = true;
        } else {
            tracing::warn!(mount = %point.display(), error = %std::io::Error::last_os_error(), "could not mount a cgroup hierarchy");
        }
    }
    mounted
}

/// (directory name, file system type, mount options) of each hierarchy
/// to mount, from `/proc/cgroups` (`name hierarchy-id cgroups enabled`).
fn hierarchies_to_mount(proc_cgroups: &str) -> Vec<(String, &'static str, String)> {
    let mut by_hierarchy: std::collections::BTreeMap<u32, Vec<String>> = Default::default();
    for line in proc_cgroups.lines().filter(|l| !l.starts_with('#')) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(name), Some(Ok(id)), Some(&"1")) = (
            fields.first(),
            fields.get(1).map(|f| f.parse::<u32>()),
            fields.get(3),
        ) else {
            continue;
        };
        by_hierarchy
            .entry(id)
            .or_default()
            .push((*name).to_string());
    }
    let wanted = ["memory", "pids", "cpu", "blkio"];
    let v1: Vec<(String, &'static str, String)> = by_hierarchy
        .iter()
        .filter(|(id, names)| **id != 0 && names.iter().any(|n| wanted.contains(&n.as_str())))
        .map(|(_, names)| (names.join(","), "cgroup", names.join(",")))
        .collect();
    let v1_has_all = ["memory", "pids", "cpu"].iter().all(|c| {
        v1.iter()
            .any(|(_, _, names)| names.split(',').any(|n| n == *c))
    });
    if v1_has_all {
        v1
    } else {
        vec![("unified".to_string(), "cgroup2", String::new())]
    }
}

/// Remounts the cgroup2 hierarchy with `favordynmods` if it lacks it (see
/// the module doc); a host that refuses keeps working, with slower attaches.
fn ensure_favordynmods(unified: &Mount) {
    if unified.options.split(',').any(|o| o == "favordynmods") {
        return;
    }
    let Ok(target) = std::ffi::CString::new(unified.point.as_os_str().as_encoded_bytes()) else {
        return;
    };
    let data = c"favordynmods";
    // SAFETY: remount of an existing mount point with a NUL-terminated
    // option string; no pointers are kept.
    let rc = unsafe {
        libc::mount(
            std::ptr::null(),
            target.as_ptr(),
            std::ptr::null(),
            libc::MS_REMOUNT,
            data.as_ptr().cast(),
        )
    };
    if rc == 0 {
        tracing::info!(mount = %unified.point.display(), "cgroup2 remounted with favordynmods (cheap cgroup attaches)");
    } else {
        tracing::warn!(mount = %unified.point.display(), error = %std::io::Error::last_os_error(), "cgroup2 could not be remounted with favordynmods: each VM start may wait 5-15 ms to join its cgroup");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
38 31 0:35 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn hidden_hierarchies_are_mounted_as_the_kernel_binds_them() {
        let hybrid = "#subsys_name\thierarchy\tnum_cgroups\tenabled\n\
            cpuset\t3\t1\t1\ncpu\t1\t6\t1\ncpuacct\t1\t1\t1\nblkio\t7\t6\t1\n\
            memory\t4\t27\t1\npids\t8\t6\t1\nhugetlb\t0\t1\t1\n";
        let names: Vec<String> = hierarchies_to_mount(hybrid)
            .into_iter()
            .map(|(name, fstype, options)| {
                assert_eq!(fstype, "cgroup");
                assert_eq!(name, options);
                name
            })
            .collect();
        assert_eq!(names, ["cpu,cpuacct", "memory", "blkio", "pids"]);
        let unified = "#subsys_name\thierarchy\tnum_cgroups\tenabled\n\
            cpu\t0\t6\t1\nmemory\t0\t27\t1\npids\t0\t6\t1\n";
        assert_eq!(
            hierarchies_to_mount(unified),
            [("unified".to_string(), "cgroup2", String::new())]
        );
    }

    #[test]
    fn v1_groups_nest_under_the_engines_own_group_per_controller() {
        let own = "8:pids:/\n4:memory:/process_api/abc\n1:cpu:/\n7:blkio:/\n0::/\n";
        let layout = choose_layout(&parse_mounts(HYBRID), &parse_memberships(own)).unwrap();
        let Layout::V1 {
            memory,
            pids,
            cpu,
            blkio,
        } = layout
        else {
            panic!("a hybrid host is v1: {layout:?}");
        };
        assert_eq!(
            memory,
            Path::new("/sys/fs/cgroup/memory/process_api/abc/shoal")
        );
        assert_eq!(pids, Path::new("/sys/fs/cgroup/pids/shoal"));
        assert_eq!(cpu, Path::new("/sys/fs/cgroup/cpu/shoal"));
        assert_eq!(blkio.unwrap(), Path::new("/sys/fs/cgroup/blkio/shoal"));
    }

    #[test]
    fn combined_v1_controllers_and_container_roots_are_read() {
        let mounts = "\
40 31 0:29 /docker/x /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
41 31 0:30 /docker/x /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
42 31 0:31 /docker/x /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids
";
        let own = "3:cpu,cpuacct:/docker/x\n2:memory:/docker/x/svc\n1:pids:/docker/x\n";
        let Layout::V1 {
            memory, cpu, blkio, ..
        } = choose_layout(&parse_mounts(mounts), &parse_memberships(own)).unwrap()
        else {
            panic!("v1 expected");
        };
        assert_eq!(memory, Path::new("/sys/fs/cgroup/memory/svc/shoal"));
        assert_eq!(cpu, Path::new("/sys/fs/cgroup/cpu,cpuacct/shoal"));
        assert!(blkio.is_none());
    }

    #[test]
    fn thrashing_at_the_limit_for_five_readings_is_a_kill_and_nothing_else_is() {
        let limit = 256 << 20;
        let reading = |usage: u64, faults: u64| MemoryPressure {
            usage_bytes: usage,
            limit_bytes: limit,
            major_faults: faults,
        };
        let mut watch = ThrashWatch::default();
        assert!(
            !watch.observe(reading(limit, 1000)),
            "a first reading has no rate"
        );
        for n in 1..ThrashWatch::READINGS {
            assert!(!watch.observe(reading(limit, 1000 + 500 * u64::from(n))));
        }
        assert!(watch.observe(reading(limit, 10_000)));

        // Full but not faulting (a guest that filled its memory and idles),
        // or faulting below the limit (reading its template for the first
        // time): never.
        let mut full = ThrashWatch::default();
        let mut fresh = ThrashWatch::default();
        for n in 0..20 {
            assert!(!full.observe(reading(limit, 7)));
            assert!(!fresh.observe(reading(limit / 2, 1000 * n)));
        }
        // A quiet reading starts the count again.
        let mut bursty = ThrashWatch::default();
        let mut total = 0;
        for n in 0..20 {
            total += if n % 4 == 3 { 0 } else { 500 };
            assert!(!bursty.observe(reading(limit, total)));
        }
    }

    #[test]
    fn oom_counters_are_read_from_either_version() {
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n";
        let v2 = "low 0\nhigh 0\nmax 17\noom 3\noom_kill 1\noom_group_kill 1\n";
        assert_eq!(counter(v1, "oom_kill"), Some(2));
        assert_eq!(counter(v2, "oom_kill"), Some(1));
        assert_eq!(counter(v2, "missing"), None);
    }

    #[test]
    fn v2_limits_are_written_in_v2_units() {
        let dir = std::env::temp_dir().join(format!("shoal-cg2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for file in [
            "memory.max",
            "memory.swap.max",
            "memory.oom.group",
            "pids.max",
            "cpu.max",
            "cpu.weight",
        ] {
            std::fs::write(dir.join(file), "").unwrap();
        }
        let limits = Limits {
            memory_bytes: 1 << 30,
            pids: 88,
            cpus: 2,
            cpu_weight: 100,
            io_weight: 100,
        };
        write_v2_limits(&dir, &limits).unwrap();
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
        assert_eq!(read("memory.max"), "1073741824");
        assert_eq!(read("memory.swap.max"), "0");
        assert_eq!(read("memory.oom.group"), "1");
        assert_eq!(read("pids.max"), "88");
        assert_eq!(read("cpu.max"), "200000 100000");
        assert!(!dir.join("io.weight").exists(), "absent files are not made");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
