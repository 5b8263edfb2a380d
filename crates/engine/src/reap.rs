//! Start-up reclaim: finds what a previous run left behind and removes it.
//!
//! A VM directory whose `vm.json` names a live QEMU (checked by its command
//! line naming that directory, never by process name) and its network slot
//! is handed back to the engine to adopt (it kills and reaps the VM if
//! that fails); any other QEMU found there gets its process group killed,
//! then the directory goes. Hibernated VMs are kept and handed back to the
//! engine. Half-written captures (`*.tmp`) and fork or hibernate
//! captures that nothing needs any more are deleted; user snapshots stay.
//!
//! Fork memory lives outside the state directory (a RAM-backed directory
//! named after it, see `EngineConfig::fork_memory_dir`), so that directory
//! names its owner: an engine removes it when it closes with nothing left
//! in it, and any engine removes those whose state directory is gone (an
//! engine killed mid-fork whose state directory was then deleted would
//! otherwise hold host RAM until reboot).

use crate::error::{IoContext, Result};
use crate::manifest::{Kind, Manifest};
use crate::vm::{VmRecord, VmState, VM_FILE};
use std::collections::HashSet;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// The file in a fork-memory directory that names the state directory it
/// belongs to.
const FORK_MEMORY_OWNER: &str = "state-dir";

/// Makes `dir` (a fork-memory directory) if it is missing and marks it as
/// `state_dir`'s.
pub(crate) fn claim_fork_memory_dir(dir: &Path, state_dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).io_context(|| format!("creating {}", dir.display()))?;
    let owner = dir.join(FORK_MEMORY_OWNER);
    std::fs::write(&owner, state_dir.as_os_str().as_encoded_bytes())
        .io_context(|| format!("writing {}", owner.display()))
}

/// Removes the fork-memory directories under `root` (named `shoal-*`, other
/// than `own`) whose owning state directory no longer exists, with whatever
/// memory files they still hold. A directory that names no owner is left
/// alone: it cannot be told from one an engine is opening right now.
pub(crate) fn reap_orphaned_fork_memory(root: &Path, own: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        if dir == own || !entry.file_name().to_string_lossy().starts_with("shoal-") {
            continue;
        }
        let Ok(owner) = std::fs::read(dir.join(FORK_MEMORY_OWNER)) else {
            continue;
        };
        let state_dir = Path::new(std::ffi::OsStr::from_bytes(&owner));
        if !state_dir.exists() {
            tracing::info!(dir = %dir.display(), state_dir = %state_dir.display(), "reaping fork memory of a state directory that is gone");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Removes `dir` (this engine's fork-memory directory) if nothing but its
/// owner file is left in it.
pub(crate) fn release_fork_memory_dir(dir: &Path) {
    let only_owner = std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .all(|entry| entry.file_name() == FORK_MEMORY_OWNER)
    });
    if only_owner {
        let _ = std::fs::remove_file(dir.join(FORK_MEMORY_OWNER));
        let _ = std::fs::remove_dir(dir);
    }
}

/// What a previous run left that a new engine takes over.
#[derive(Default)]
pub(crate) struct Leftovers {
    /// Hibernated VMs, whose state is on disk.
    pub hibernated: Vec<VmRecord>,
    /// Running or paused VMs whose QEMU outlived the engine that started
    /// it (a crash, a SIGKILL): adopted, or reaped with [`reap_vm`] if that
    /// fails.
    pub survivors: Vec<Survivor>,
}

/// A running or paused VM whose recorded QEMU still runs in its directory.
pub(crate) struct Survivor {
    pub record: VmRecord,
    pub pid: u32,
    pub net_slot: u32,
}

/// Reaps leftovers under `state_dir` but the VMs a new engine may take
/// over: hibernated ones, and running or paused ones whose recorded QEMU
/// still runs in its directory and whose record names its network slot.
pub(crate) fn reap_leftovers(
    state_dir: &Path,
    proc_root: &Path,
    adopt_survivors: bool,
) -> Result<Leftovers> {
    let vms_dir = state_dir.join("vms");
    let mut kept = Leftovers::default();
    for entry in
        std::fs::read_dir(&vms_dir).io_context(|| format!("listing {}", vms_dir.display()))?
    {
        let Ok(entry) = entry else { continue };
        let dir = entry.path();
        let record: Option<VmRecord> = std::fs::read(dir.join(VM_FILE))
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok());
        if let Some(record) = &record {
            if record.state == VmState::Hibernated && record.source.memory_file.exists() {
                kept.hibernated.push(record.clone());
                continue;
            }
            if let (true, Some(pid), Some(net_slot)) =
                (adopt_survivors, record.pid, record.net_slot)
            {
                if record.state != VmState::Hibernated && names_dir(proc_root, pid, &dir) {
                    kept.survivors.push(Survivor {
                        record: record.clone(),
                        pid,
                        net_slot,
                    });
                    continue;
                }
            }
        }
        reap_vm(proc_root, &dir, record.as_ref().and_then(|r| r.pid));
    }
    let captures = state_dir.join("captures");
    if let Ok(entries) = std::fs::read_dir(&captures) {
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().ends_with(".tmp") {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    Ok(kept)
}

/// Kills whatever QEMU runs in VM directory `dir` (`recorded` first) and
/// removes the directory.
pub(crate) fn reap_vm(proc_root: &Path, dir: &Path, recorded: Option<u32>) {
    for pid in qemu_pids_of(proc_root, dir, recorded) {
        kill_and_wait(proc_root, pid);
    }
    tracing::info!(dir = %dir.display(), "reaping leftover VM");
    let _ = std::fs::remove_dir_all(dir);
}

/// Kills the QEMU of every bake that died half-way in `template_dir` (a
/// process whose command line names a `<hash>.tmp` directory there) and
/// removes those directories. Called with the template's bake lock held, so
/// no bake of it is running: a `shoal` killed mid-bake leaves its QEMU
/// running, as every QEMU is in a process group of its own.
pub(crate) fn reap_unfinished_bakes(proc_root: &Path, template_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(template_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        if !entry.file_name().to_string_lossy().ends_with(".tmp") || !dir.is_dir() {
            continue;
        }
        for pid in qemu_pids_of(proc_root, &dir, None) {
            tracing::info!(pid, dir = %dir.display(), "killing the QEMU of an unfinished bake");
            kill_and_wait(proc_root, pid);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Processes whose command line names `dir`: the recorded pid if it still
/// does, or any other (a crash between spawn and writing the pid).
fn qemu_pids_of(proc_root: &Path, dir: &Path, recorded: Option<u32>) -> Vec<u32> {
    if let Some(pid) = recorded {
        if names_dir(proc_root, pid, dir) {
            return vec![pid];
        }
    }
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != std::process::id() && names_dir(proc_root, pid, dir))
        .collect()
}

/// Whether process `pid`'s command line names VM directory `dir`.
fn names_dir(proc_root: &Path, pid: u32, dir: &Path) -> bool {
    let needle = format!("{}/", dir.display());
    std::fs::read(proc_root.join(pid.to_string()).join("cmdline"))
        .map(|c| String::from_utf8_lossy(&c).contains(&needle))
        .unwrap_or(false)
}

fn kill_and_wait(proc_root: &Path, pid: u32) {
    crate::vm::kill_process_group(pid);
    // SAFETY: kill(2) on a single pid we identified by its command line.
    unsafe {
        libc::kill(pid as i32, libc::SIGKILL);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while proc_root.join(pid.to_string()).exists() && Instant::now() < deadline {
        // The process is not our child, so its zombie is reaped by its parent
        // (init, after our previous run died); wait until it is gone.
        let stat = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat"))
            .unwrap_or_default();
        if stat.contains(") Z ") {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Deletes every fork or hibernate capture not in `needed` (and not needed
/// by a kept snapshot), with fork memory kept outside its capture's
/// directory, and fork memory whose capture is gone.
pub(crate) fn collect_captures(
    captures_dir: &Path,
    fork_memory_dir: &Path,
    mut needed: HashSet<String>,
) {
    let Ok(entries) = std::fs::read_dir(captures_dir) else {
        return;
    };
    let manifests: Vec<(std::path::PathBuf, Manifest)> = entries
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().ends_with(".tmp"))
        .filter_map(|e| Manifest::load(&e.path()).ok().map(|m| (e.path(), m)))
        .collect();
    for (_, manifest) in &manifests {
        if manifest.kind == Kind::Snapshot {
            needed.extend(manifest.captures_needed());
        }
    }
    let mut kept_memory = HashSet::new();
    for (path, manifest) in manifests {
        if matches!(manifest.kind, Kind::Fork | Kind::Hibernate) && !needed.contains(&manifest.id) {
            tracing::debug!(capture = %manifest.id, "deleting unused capture");
            if !manifest.memory_file.starts_with(&path) {
                let _ = std::fs::remove_file(&manifest.memory_file);
            }
            let _ = std::fs::remove_dir_all(path);
        } else {
            kept_memory.insert(manifest.memory_file);
        }
    }
    if fork_memory_dir == captures_dir {
        return;
    }
    for entry in std::fs::read_dir(fork_memory_dir)
        .into_iter()
        .flatten()
        .flatten()
    {
        let path = entry.path();
        // Only fork memory: the owner file stays.
        if path.extension().is_none_or(|ext| ext != "memory") {
            continue;
        }
        let in_progress = captures_dir
            .join(format!(
                "{}.tmp",
                path.file_stem().unwrap_or_default().to_string_lossy()
            ))
            .exists();
        if !kept_memory.contains(&path) && !in_progress {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fork_memory_of_a_state_dir_that_is_gone_is_reaped_and_nothing_else() {
        let scratch = std::env::temp_dir().join(format!("shoal-reap-{}", std::process::id()));
        let root = scratch.join("shm");
        let live_state = scratch.join("live-state");
        std::fs::create_dir_all(&live_state).unwrap();
        let dir = |name: &str| {
            let dir = root.join(name);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("fork-1.memory"), b"pages").unwrap();
            dir
        };
        let own = dir("shoal-own");
        claim_fork_memory_dir(&own, &scratch.join("deleted-too")).unwrap();
        let orphan = dir("shoal-orphan");
        claim_fork_memory_dir(&orphan, &scratch.join("deleted-state")).unwrap();
        let alive = dir("shoal-alive");
        claim_fork_memory_dir(&alive, &live_state).unwrap();
        let unclaimed = dir("shoal-unclaimed");
        let other = dir("other-program");
        claim_fork_memory_dir(&other, &scratch.join("deleted-state")).unwrap();

        reap_orphaned_fork_memory(&root, &own);
        // The collector deletes fork memory no capture needs, never the owner.
        let captures = scratch.join("captures");
        std::fs::create_dir_all(&captures).unwrap();
        std::fs::write(own.join("fork-2.memory"), b"pages").unwrap();
        collect_captures(&captures, &own, HashSet::new());
        assert!(!own.join("fork-2.memory").exists());
        assert!(own.join(FORK_MEMORY_OWNER).exists());
        std::fs::write(own.join("fork-1.memory"), b"pages").unwrap();

        assert!(!orphan.exists(), "the orphan's memory is freed");
        for kept in [&own, &alive, &unclaimed, &other] {
            assert!(
                kept.join("fork-1.memory").exists(),
                "{} kept",
                kept.display()
            );
        }

        // Released only once nothing but the owner file is left.
        release_fork_memory_dir(&alive);
        assert!(alive.exists());
        std::fs::remove_file(alive.join("fork-1.memory")).unwrap();
        release_fork_memory_dir(&alive);
        assert!(!alive.exists());
        std::fs::remove_dir_all(&scratch).unwrap();
    }

    #[test]
    fn a_bake_left_half_way_loses_its_process_and_directory() {
        use std::os::unix::process::{CommandExt, ExitStatusExt};
        let template_dir =
            std::env::temp_dir().join(format!("shoal-reap-bake-{}", std::process::id()));
        let unfinished = template_dir.join("0123456789abcdef.tmp");
        let finished = template_dir.join("fedcba9876543210");
        std::fs::create_dir_all(&unfinished).unwrap();
        std::fs::create_dir_all(&finished).unwrap();
        std::fs::write(template_dir.join("current.tmp"), b"x").unwrap();
        // Stands in for the bake's QEMU: its own process group, a command
        // line naming the bake directory.
        let spawn = |dir: &Path| {
            std::process::Command::new("sh")
                .arg("-c")
                .arg("sleep 30; exit 0")
                .arg(dir.join("qmp.sock"))
                .process_group(0)
                .spawn()
                .unwrap()
        };
        let mut orphan = spawn(&unfinished);
        let mut bystander = spawn(&finished);
        // Until the shell has exec'd, its command line is still ours.
        assert!(wait_for_cmdline(orphan.id(), &unfinished));

        reap_unfinished_bakes(Path::new("/proc"), &template_dir);

        assert!(
            orphan.wait().unwrap().signal().is_some(),
            "the bake's process is killed"
        );
        assert!(!unfinished.exists());
        assert!(
            bystander.try_wait().unwrap().is_none(),
            "other processes are left alone"
        );
        assert!(finished.exists() && template_dir.join("current.tmp").exists());
        bystander.kill().unwrap();
        bystander.wait().unwrap();
        std::fs::remove_dir_all(&template_dir).unwrap();
    }

    fn wait_for_cmdline(pid: u32, dir: &Path) -> bool {
        let needle = format!("{}/", dir.display());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }
}
