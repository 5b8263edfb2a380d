//! Call threads: each exec, download and slow file call runs on a thread of
//! its own, taken from a few kept parked, or started when none is.
//!
//! Why parked threads: under TCG every guest code path is translated on its
//! first use in each QEMU process, and a restored sandbox is a new process.
//! Starting a thread (clone, a stack mapped, TLS set up) is such a path: the
//! first stat after a create took 58 ms, a second one 6 ms, and the first
//! thread start is part of that gap. The parked threads
//! exist when the template is baked, so a restored guest hands its first
//! call to one of them with a futex wake, a path the agent's own replies
//! have already taken by then.
//!
//! Does not own: what a call does (`exec`, `files`), or answering when no
//! thread can be had (the caller's).

use crate::calls::lock;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};

/// Threads kept parked: an exec holds its thread for as long as it runs,
/// so a call made beside it (a file read while a command runs) finds the
/// second one.
const PARKED: usize = 2;

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
pub struct CallThreads {
    parked: Mutex<Vec<SyncSender<Job>>>,
}

impl CallThreads {
    /// Starts the parked threads.
    pub fn start(self: &Arc<Self>) {
        for _ in 0..PARKED {
            if let Err(err) = self.spawn("call".into(), Box::new(|| {})) {
                crate::log(&format!("cannot start a call thread: {err}"));
            }
        }
    }

    /// Runs `job` on a parked thread, or on a new one named `name`.
    pub fn run(
        self: &Arc<Self>,
        name: String,
        job: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<()> {
        let mut job: Job = Box::new(job);
        while let Some(thread) = lock(&self.parked).pop() {
            match thread.send(job) {
                Ok(()) => return Ok(()),
                // That thread is gone (it panicked): try the next.
                Err(returned) => job = returned.0,
            }
        }
        self.spawn(name, job)
    }

    fn spawn(self: &Arc<Self>, name: String, first: Job) -> std::io::Result<()> {
        let threads = self.clone();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || threads.serve(first))
            .map(drop)
    }

    /// Runs `first`, then parks for more while fewer than [`PARKED`] are.
    fn serve(&self, first: Job) {
        first();
        loop {
            let (sender, receiver) = sync_channel::<Job>(1);
            {
                let mut parked = lock(&self.parked);
                if parked.len() >= PARKED {
                    return;
                }
                parked.push(sender);
            }
            match receiver.recv() {
                Ok(job) => job(),
                Err(_) => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;
    use std::time::Duration;

    #[test]
    fn jobs_run_on_parked_threads_and_more_start_when_none_is() {
        let threads = Arc::new(CallThreads::default());
        threads.start();
        let parked = || lock(&threads.parked).len();
        let waited = (0..100).find(|_| {
            std::thread::sleep(Duration::from_millis(10));
            parked() == PARKED
        });
        assert!(waited.is_some(), "the threads never parked");

        // More jobs at once than parked threads: all run, together.
        let (done, finished) = channel();
        let gate = Arc::new(std::sync::Barrier::new(PARKED + 2));
        for n in 0..PARKED + 1 {
            let (done, gate) = (done.clone(), gate.clone());
            threads
                .run(format!("job-{n}"), move || {
                    gate.wait();
                    done.send(n).unwrap();
                })
                .unwrap();
        }
        gate.wait();
        let mut ran: Vec<usize> = (0..PARKED + 1)
            .map(|_| finished.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        ran.sort();
        assert_eq!(ran, (0..PARKED + 1).collect::<Vec<_>>());

        // Afterwards no more than PARKED stay.
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(parked(), PARKED);
    }
}
