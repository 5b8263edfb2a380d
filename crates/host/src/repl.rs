//! Repl sessions of this host's sandboxes: a session id names one kernel
//! process in one sandbox; a run holds its session's lock, so cells of one
//! session run in order while other sessions go on.

use crate::{HostError, Result};
use shoal_proto::client::AgentClient;
use shoal_repl::{CellOutput, ReplError, ReplSession};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// At most this many sessions per sandbox.
pub const MAX_SESSIONS: usize = 8;

#[derive(Default)]
pub struct Sessions {
    by_id: Mutex<HashMap<String, Entry>>,
}

struct Entry {
    sandbox: String,
    session: Arc<tokio::sync::Mutex<Option<ReplSession>>>,
}

impl Sessions {
    pub async fn start(&self, sandbox: &str, agent: &AgentClient) -> Result<String> {
        let open = self
            .by_id
            .lock()
            .unwrap()
            .values()
            .filter(|e| e.sandbox == sandbox)
            .count();
        if open >= MAX_SESSIONS {
            return Err(HostError::Invalid(format!(
                "a sandbox holds at most {MAX_SESSIONS} repl sessions"
            )));
        }
        let session = ReplSession::start(agent).await?;
        let id = format!("ctx-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
        self.by_id.lock().unwrap().insert(
            id.clone(),
            Entry {
                sandbox: sandbox.to_string(),
                session: Arc::new(tokio::sync::Mutex::new(Some(session))),
            },
        );
        Ok(id)
    }

    fn find(
        &self,
        sandbox: &str,
        id: &str,
    ) -> Result<Arc<tokio::sync::Mutex<Option<ReplSession>>>> {
        match self.by_id.lock().unwrap().get(id) {
            Some(entry) if entry.sandbox == sandbox => Ok(entry.session.clone()),
            _ => Err(HostError::NoSuchSession),
        }
    }

    pub async fn run(
        &self,
        sandbox: &str,
        id: &str,
        code: &str,
        timeout: Option<std::time::Duration>,
    ) -> Result<CellOutput> {
        let session = self.find(sandbox, id)?;
        let mut guard = session.lock().await;
        let Some(kernel) = guard.as_mut() else {
            return Err(HostError::NoSuchSession);
        };
        match kernel.run(code, timeout).await {
            Ok(output) => Ok(output),
            Err(e) => {
                let dead = matches!(e, ReplError::Dead | ReplError::Timeout { killed: true });
                if dead {
                    guard.take();
                    self.by_id.lock().unwrap().remove(id);
                }
                Err(e.into())
            }
        }
    }

    pub async fn close(&self, sandbox: &str, id: &str) -> Result<()> {
        let session = self.find(sandbox, id)?;
        self.by_id.lock().unwrap().remove(id);
        if let Some(kernel) = session.lock().await.take() {
            kernel.close().await;
        }
        Ok(())
    }

    /// Forgets every session of `sandbox` (it is going away).
    pub async fn close_all(&self, sandbox: &str) {
        let gone: Vec<Entry> = {
            let mut by_id = self.by_id.lock().unwrap();
            let ids: Vec<String> = by_id
                .iter()
                .filter(|(_, e)| e.sandbox == sandbox)
                .map(|(id, _)| id.clone())
                .collect();
            ids.into_iter().filter_map(|id| by_id.remove(&id)).collect()
        };
        for entry in gone {
            entry.session.lock().await.take();
        }
    }
}
