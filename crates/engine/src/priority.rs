//! CPU priority of a sandbox: which VMs get the host's cores first.
//!
//! Owns: the scheduling class of every thread of one QEMU process. A
//! `Background` VM runs its vCPUs in `SCHED_IDLE`: it takes whatever CPU
//! `Normal` work leaves, so the restore, the first exec and the collect of
//! other sandboxes are not slowed by twenty CPU-bound guests on two cores.
//! The sweep runner puts a sandbox in the background while its command runs
//! and back before it collects.
//!
//! Does not own: which sandboxes are background (the caller decides), or
//! the QEMU process itself (`qemu`, `vm`).

use std::collections::HashSet;
use std::io;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuPriority {
    /// The default scheduling class (at the nice value `shoal` runs with):
    /// what every VM starts with.
    Normal,
    /// `SCHED_IDLE`: runs only on CPU that normal work leaves.
    Background,
}

impl std::str::FromStr for CpuPriority {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "normal" => Ok(CpuPriority::Normal),
            "background" => Ok(CpuPriority::Background),
            other => Err(format!(
                "unknown CPU priority {other:?} (normal or background)"
            )),
        }
    }
}

/// Sets `priority` on every thread of `pid`. QEMU starts threads of its own
/// (I/O workers) at any time, and a new thread inherits its creator's class:
/// passes repeat until one finds no thread it had not set.
pub(crate) fn apply(proc_root: &Path, pid: u32, priority: CpuPriority) -> io::Result<()> {
    let mut done = HashSet::new();
    for _ in 0..4 {
        let mut fresh = false;
        for tid in thread_ids(proc_root, pid)? {
            if !done.insert(tid) {
                continue;
            }
            fresh = true;
            match set_thread(tid, priority) {
                Ok(()) => {}
                // The thread ended meanwhile.
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => return Err(e),
            }
        }
        if !fresh {
            break;
        }
    }
    Ok(())
}

/// The ids of the threads of `pid`, as `/proc` lists them now.
fn thread_ids(proc_root: &Path, pid: u32) -> io::Result<Vec<i32>> {
    let mut ids = Vec::new();
    for entry in std::fs::read_dir(proc_root.join(pid.to_string()).join("task"))? {
        if let Some(tid) = entry?.file_name().to_str().and_then(|t| t.parse().ok()) {
            ids.push(tid);
        }
    }
    Ok(ids)
}

fn set_thread(tid: i32, priority: CpuPriority) -> io::Result<()> {
    let policy = match priority {
        CpuPriority::Normal => libc::SCHED_OTHER,
        CpuPriority::Background => libc::SCHED_IDLE,
    };
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param for the duration of the call.
    if unsafe { libc::sched_setscheduler(tid, policy, &param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `Background` when every thread of `pid` runs in `SCHED_IDLE`, else
/// `Normal`.
pub(crate) fn read(proc_root: &Path, pid: u32) -> io::Result<CpuPriority> {
    for tid in thread_ids(proc_root, pid)? {
        match thread_policy(tid) {
            Ok(policy) if policy == libc::SCHED_IDLE => {}
            Ok(_) => return Ok(CpuPriority::Normal),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(CpuPriority::Background)
}

/// The scheduling policy of thread `tid`.
fn thread_policy(tid: i32) -> io::Result<i32> {
    // SAFETY: plain system call on a thread id.
    let policy = unsafe { libc::sched_getscheduler(tid) };
    if policy < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(policy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse() {
        assert_eq!("normal".parse(), Ok(CpuPriority::Normal));
        assert_eq!("background".parse(), Ok(CpuPriority::Background));
        assert!("idle"
            .parse::<CpuPriority>()
            .unwrap_err()
            .contains("normal or background"));
    }

    /// A child process with two threads goes to SCHED_IDLE and back, every
    /// thread of it.
    #[test]
    fn every_thread_moves_and_comes_back() {
        let mut child = std::process::Command::new("python3")
            .args([
                "-c",
                "import threading, time\nthreading.Thread(target=time.sleep, args=(30,)).start()\ntime.sleep(30)",
            ])
            .spawn()
            .expect("python3");
        let pid = child.id();
        let threads = || thread_ids(Path::new("/proc"), pid).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while threads().len() < 2 {
            assert!(std::time::Instant::now() < deadline, "no second thread");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(read(Path::new("/proc"), pid).unwrap(), CpuPriority::Normal);
        apply(Path::new("/proc"), pid, CpuPriority::Background).unwrap();
        assert_eq!(
            read(Path::new("/proc"), pid).unwrap(),
            CpuPriority::Background
        );
        for tid in threads() {
            assert_eq!(
                thread_policy(tid).unwrap(),
                libc::SCHED_IDLE,
                "thread {tid}"
            );
        }
        apply(Path::new("/proc"), pid, CpuPriority::Normal).unwrap();
        for tid in threads() {
            assert_eq!(
                thread_policy(tid).unwrap(),
                libc::SCHED_OTHER,
                "thread {tid}"
            );
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}
