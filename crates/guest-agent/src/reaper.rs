//! The one place that waits for child processes.
//!
//! As PID 1 (and as a child subreaper on the host) the agent inherits every
//! orphan, so a single thread calls `waitpid(-1)` for all of them; an exec
//! that wants the status of its shell registers the pid and is handed the
//! status (and woken through an eventfd) when the reaper collects it. Other
//! pids are reaped and forgotten. Nothing else in the agent may wait for a
//! child, or it would steal statuses from this thread.
//!
//! Does not own: starting processes (see `exec`), only the registration
//! that must happen atomically with the fork.

use crate::calls::lock;
use shoal_proto::ProcessUsage;
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

pub struct Reaper {
    registry: Mutex<Registry>,
    /// Signalled when a child is started, so an idle reaper resumes.
    spawned: Condvar,
}

#[derive(Default)]
struct Registry {
    watched: HashMap<i32, Watch>,
    /// Counts forks, so the reaper can tell that one happened between its
    /// `ECHILD` and going to sleep.
    spawns: u64,
}

struct Watch {
    status: Option<(i32, ProcessUsage)>,
    waker: Arc<OwnedFd>,
}

impl Reaper {
    pub fn start() -> Arc<Self> {
        let reaper = Arc::new(Reaper {
            registry: Mutex::default(),
            spawned: Condvar::new(),
        });
        let worker = reaper.clone();
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || worker.run())
            .expect("the reaper thread starts");
        reaper
    }

    /// Runs `fork` with the registry locked and watches the pid it returns,
    /// so the reaper cannot collect the child before it is watched.
    pub fn spawn_watched(
        &self,
        waker: Arc<OwnedFd>,
        fork: impl FnOnce() -> io::Result<i32>,
    ) -> io::Result<i32> {
        let mut registry = lock(&self.registry);
        let pid = fork()?;
        registry.watched.insert(
            pid,
            Watch {
                status: None,
                waker,
            },
        );
        registry.spawns += 1;
        self.spawned.notify_all();
        Ok(pid)
    }

    /// The raw wait status of a watched pid once it exited, with what it
    /// and the children it waited for used; the watch ends.
    pub fn take_status(&self, pid: i32) -> Option<(i32, ProcessUsage)> {
        let mut registry = lock(&self.registry);
        let status = registry.watched.get(&pid)?.status?;
        registry.watched.remove(&pid);
        Some(status)
    }

    /// Stops watching a pid (the reaper still collects it).
    pub fn forget(&self, pid: i32) {
        lock(&self.registry).watched.remove(&pid);
    }

    fn run(&self) {
        loop {
            let spawns_before = lock(&self.registry).spawns;
            let mut status = 0;
            // SAFETY: all-zero is a valid rusage.
            let mut rusage: libc::rusage = unsafe { std::mem::zeroed() };
            // SAFETY: wait4 writes only to `status` and `rusage`, valid locals.
            let pid = unsafe { libc::wait4(-1, &mut status, 0, &mut rusage) };
            if pid > 0 {
                let mut registry = lock(&self.registry);
                if let Some(watch) = registry.watched.get_mut(&pid) {
                    watch.status = Some((status, usage_of(&rusage)));
                    wake(&watch.waker);
                }
                continue;
            }
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::ECHILD) => {
                    let registry = lock(&self.registry);
                    if registry.spawns == spawns_before {
                        // The timeout is only a safety net; spawns notify.
                        let _ = self.spawned.wait_timeout(registry, Duration::from_secs(1));
                    }
                }
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

/// Linux's rusage: `ru_maxrss` in KiB, the times as timevals.
fn usage_of(r: &libc::rusage) -> ProcessUsage {
    let ms = |t: libc::timeval| {
        u64::try_from(t.tv_sec).unwrap_or(0) * 1000 + u64::try_from(t.tv_usec).unwrap_or(0) / 1000
    };
    ProcessUsage {
        max_rss_kib: u64::try_from(r.ru_maxrss).unwrap_or(0),
        cpu_ms: ms(r.ru_utime) + ms(r.ru_stime),
        oom_kills: 0,
    }
}

/// Creates the eventfd an exec sleeps on (in `poll`) for its child's exit.
pub fn new_waker() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes no pointers; the result is checked below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor owned by nobody else.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

fn wake(waker: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid local to an eventfd we own.
    unsafe { libc::write(waker.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// Clears a woken eventfd.
pub fn drain_waker(waker: &OwnedFd) {
    let mut value: u64 = 0;
    // SAFETY: reads 8 bytes into a valid local from a nonblocking eventfd.
    unsafe { libc::read(waker.as_raw_fd(), (&mut value as *mut u64).cast(), 8) };
}
