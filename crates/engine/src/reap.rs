//! Start-up reclaim: finds what a previous run left behind and removes it.
//!
//! A VM directory whose `vm.json` names a live QEMU (checked by its command
//! line naming that directory, never by process name) gets that process
//! group killed; then the directory goes. Hibernated VMs are kept and handed
//! back to the engine. Half-written captures (`*.tmp`) and fork or hibernate
//! captures that nothing needs any more are deleted; user snapshots stay.

use crate::error::{IoContext, Result};
use crate::manifest::{Kind, Manifest};
use crate::vm::{VmRecord, VmState, VM_FILE};
use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

/// Reaps leftovers under `state_dir`; returns the hibernated VMs to adopt.
pub(crate) fn reap_leftovers(state_dir: &Path, proc_root: &Path) -> Result<Vec<VmRecord>> {
    let vms_dir = state_dir.join("vms");
    let mut kept = Vec::new();
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
                kept.push(record.clone());
                continue;
            }
        }
        for pid in qemu_pids_of(proc_root, &dir, record.as_ref().and_then(|r| r.pid)) {
            kill_and_wait(proc_root, pid);
        }
        tracing::info!(dir = %dir.display(), "reaping leftover VM");
        let _ = std::fs::remove_dir_all(&dir);
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

/// Processes whose command line names `dir`: the recorded pid if it still
/// does, or any other (a crash between spawn and writing the pid).
fn qemu_pids_of(proc_root: &Path, dir: &Path, recorded: Option<u32>) -> Vec<u32> {
    let needle = format!("{}/", dir.display());
    let names_dir = |pid: u32| -> bool {
        std::fs::read(proc_root.join(pid.to_string()).join("cmdline"))
            .map(|c| String::from_utf8_lossy(&c).contains(&needle))
            .unwrap_or(false)
    };
    if let Some(pid) = recorded {
        if names_dir(pid) {
            return vec![pid];
        }
    }
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != std::process::id() && names_dir(pid))
        .collect()
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
