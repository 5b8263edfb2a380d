//! The real guest agent run as a host process for tests that need no VM:
//! `--connect <socket> --test-mode`, in a private temp directory, killed
//! by its pid when dropped (its execs lead groups of their own, which the
//! tests that leave any behind kill by group).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio::net::{UnixListener, UnixStream};

pub struct LocalAgent {
    /// For tests of what the host sees when the agent dies or exits.
    pub child: Child,
    /// The test's own directory; the agent's socket is in it.
    pub dir: PathBuf,
}

impl LocalAgent {
    /// Starts `binary` and returns it with the host end of its channel, once
    /// it has connected. `path` replaces the agent's (and so its execs')
    /// PATH.
    pub async fn spawn(binary: &Path, path: Option<&str>) -> (LocalAgent, UnixStream) {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "shoal-agent-test-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("agent.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let mut command = Command::new(binary);
        command
            .arg("--connect")
            .arg(&socket)
            .arg("--test-mode")
            .process_group(0);
        if let Some(path) = path {
            command.env("PATH", path);
        }
        let agent = LocalAgent {
            child: command.spawn().unwrap(),
            dir,
        };
        let (stream, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
            .await
            .expect("the agent connects")
            .unwrap();
        (agent, stream)
    }
}

impl Drop for LocalAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
