//! What the control plane does on its own: remembers activity, reaps idle
//! and over-age sandboxes, meters the ones it runs, and records the ones
//! whose VM died on its own (killed for memory) as `failed` with the reason.
//!
//! Activity is noted in memory on every request and written to the
//! database every few seconds (a restart loses at most that much); an exec
//! in flight is counted in the database itself (`running_execs`), so the
//! reaper never takes a sandbox in the middle of a command.

use crate::{now, ApiResult, ControlPlane};
use shoal_host::{Usage, VmFailure};
use shoal_store::{status, Account, SandboxPatch, SandboxRow, UsageSample};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct LifecycleConfig {
    /// How often the reaper looks for idle sandboxes.
    pub reap_interval: Duration,
    /// How often every sandbox's CPU time and memory are sampled (at most 15 s).
    pub meter_interval: Duration,
    /// How often remembered activity is written to the database.
    pub activity_flush: Duration,
}

impl Default for LifecycleConfig {
    fn default() -> Self {
        LifecycleConfig {
            reap_interval: Duration::from_secs(30),
            meter_interval: Duration::from_secs(10),
            activity_flush: Duration::from_secs(5),
        }
    }
}

const GIB: f64 = (1u64 << 30) as f64;

impl ControlPlane {
    /// Notes activity on a sandbox (written out by the flush loop).
    pub(crate) fn touch(&self, id: &str) {
        self.meter
            .activity
            .lock()
            .unwrap()
            .insert(id.to_string(), now());
    }

    async fn flush_activity(&self) {
        let pending: Vec<(String, f64)> = self.meter.activity.lock().unwrap().drain().collect();
        for (id, at) in pending {
            if let Err(e) = self.store.touch(&id, at).await {
                tracing::warn!(id, error = %e, "recording activity");
            }
        }
    }

    fn is_ours(&self, row: &SandboxRow) -> bool {
        row.host.as_deref() == Some(self.config.host_name.as_str())
    }

    async fn reap(&self) {
        self.flush_activity().await;
        let candidates = match self.store.reap_candidates(now()).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %e, "listing idle sandboxes");
                return;
            }
        };
        for row in candidates.into_iter().filter(|r| self.is_ours(r)) {
            tracing::info!(id = row.id, "reaping an idle or over-age sandbox");
            if let Err(e) = self.destroy(&row.id).await {
                tracing::warn!(id = row.id, error = e.message, "reaping");
            }
        }
    }
}

/// Last CPU reading per sandbox, and activity not yet written out.
#[derive(Default)]
pub struct Meter {
    last: Mutex<HashMap<String, Reading>>,
    activity: Mutex<HashMap<String, f64>>,
}

#[derive(Clone, Copy)]
struct Reading {
    cpu_seconds: f64,
    at: f64,
}

impl Meter {
    /// Records what `id` used since its last sample, and returns the
    /// reading (none for a sandbox without a process).
    pub async fn sample_one(&self, cp: &ControlPlane, id: &str) -> Option<Usage> {
        let Ok(Some(usage)) = cp.host.engine().usage(id) else {
            return None;
        };
        let at = now();
        let previous = self.last.lock().unwrap().insert(
            id.to_string(),
            Reading {
                cpu_seconds: usage.cpu_seconds,
                at,
            },
        );
        let (cpu, interval) = match previous {
            // A new process (after a wake) starts its CPU time at zero.
            Some(p) if usage.cpu_seconds >= p.cpu_seconds => {
                (usage.cpu_seconds - p.cpu_seconds, at - p.at)
            }
            Some(p) => (usage.cpu_seconds, at - p.at),
            None => {
                let created = cp
                    .store
                    .sandbox_by_id(id)
                    .await
                    .ok()
                    .flatten()
                    .map_or(at, |r| r.created_at);
                (usage.cpu_seconds, (at - created).max(0.0))
            }
        };
        let sample = UsageSample {
            sandbox_id: id.to_string(),
            at,
            cpu_seconds: cpu,
            gib_seconds: usage.pss_bytes as f64 / GIB * interval,
            interval_s: interval,
        };
        if let Err(e) = cp.store.record_usage(&sample).await {
            tracing::warn!(id, error = %e, "recording usage");
        }
        Some(usage)
    }

    async fn sample_rows(&self, cp: &ControlPlane, rows: Vec<SandboxRow>) {
        for row in rows {
            if cp.is_ours(&row) && row.status != status::CREATING {
                self.sample_one(cp, &row.id).await;
            }
        }
    }

    pub async fn sample_all(&self, cp: &ControlPlane) {
        match cp.store.list_all_live().await {
            Ok(rows) => self.sample_rows(cp, rows).await,
            Err(e) => tracing::warn!(error = %e, "listing sandboxes to meter"),
        }
    }

    pub async fn sample_account(&self, cp: &ControlPlane, account: &Account) {
        if let Ok(rows) = cp.store.list_sandboxes(account.id).await {
            self.sample_rows(cp, rows).await;
        }
    }
}

/// After a restart: no exec is running any more, and sandboxes whose VM did
/// not survive (only hibernated ones do) are recorded deleted.
pub async fn reconcile(cp: &ControlPlane) -> ApiResult<()> {
    cp.store.clear_running_execs(&cp.config.host_name).await?;
    for row in cp.store.list_all_live().await? {
        // A row without a host is from before hosts were recorded at
        // admission: only a single-host install has those.
        if !(cp.is_ours(&row) || row.host.is_none() && row.status == status::CREATING) {
            continue;
        }
        match cp.host.engine().get(&row.id).await {
            Ok(info) => cp.set_status(&row.id, info.state.as_str()).await?,
            Err(_) => {
                tracing::info!(id = row.id, "sandbox did not survive the restart");
                let patch = SandboxPatch {
                    status: Some(status::DELETED.into()),
                    deleted_at: Some(now()),
                    ..SandboxPatch::default()
                };
                cp.store.update_sandbox(&row.id, patch).await?;
            }
        }
    }
    Ok(())
}

impl ControlPlane {
    /// Marks the sandbox of a VM that died on its own `failed` with the
    /// reason, then frees what its VM still holds (network slot, files).
    pub(crate) async fn record_failure(&self, failure: &VmFailure) {
        let id = failure.id.as_str();
        tracing::warn!(id, reason = failure.reason, "sandbox failed");
        match self.store.sandbox_by_id(id).await {
            Ok(Some(row)) if row.is_live() && self.is_ours(&row) => {
                let patch = SandboxPatch {
                    status: Some(status::FAILED.into()),
                    status_reason: Some(failure.reason.clone()),
                    deleted_at: Some(now()),
                    ..SandboxPatch::default()
                };
                if let Err(e) = self.store.update_sandbox(id, patch).await {
                    tracing::error!(id, error = %e, "recording a failed sandbox");
                    return;
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::error!(id, error = %e, "reading a failed sandbox");
                return;
            }
        }
        if let Err(e) = self.host.kill(id).await {
            tracing::warn!(id, error = %e, "freeing a failed sandbox");
        }
    }

    /// The answer for a guest call that broke: a 409 saying why when the
    /// VM died under it (killed for memory), else the agent's error.
    pub(crate) async fn agent_failure(
        &self,
        id: &str,
        e: shoal_proto::client::AgentError,
    ) -> crate::error::ApiError {
        if matches!(e, shoal_proto::client::AgentError::Guest { .. }) {
            return e.into();
        }
        match self.failure_of(id, Duration::from_secs(2)).await {
            Some(reason) => {
                crate::error::ApiError::conflict(format!("sandbox {id} has failed: {reason}"))
            }
            None => e.into(),
        }
    }

    /// Why the VM of sandbox `id` died on its own, if it did: asked of the
    /// engine while it still has the VM, else of the row the failure
    /// watcher wrote. A QEMU's exit reaches the engine a moment after its
    /// connections break, so this waits up to `patience` for it.
    pub(crate) async fn failure_of(&self, id: &str, patience: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            match self.host.engine().get(id).await {
                Ok(info) if info.failure.is_some() => return info.failure,
                Ok(_) => {}
                Err(_) => {
                    return self
                        .store
                        .sandbox_by_id(id)
                        .await
                        .ok()
                        .flatten()
                        .and_then(|row| row.status_reason)
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Follows the engine's failures for as long as the control plane runs.
fn watch_failures(cp: Arc<ControlPlane>) {
    let mut failures = cp.host.engine().failures();
    tokio::spawn(async move {
        use tokio::sync::broadcast::error::RecvError;
        loop {
            match failures.recv().await {
                Ok(failure) => cp.record_failure(&failure).await,
                Err(RecvError::Lagged(_)) => {
                    // Missed some: the engine still knows every failed VM.
                    for info in cp.host.engine().list().await {
                        if let Some(reason) = info.failure {
                            let failure = VmFailure {
                                id: info.id,
                                reason,
                            };
                            cp.record_failure(&failure).await;
                        }
                    }
                }
                Err(RecvError::Closed) => return,
            }
        }
    });
}

pub fn spawn(cp: Arc<ControlPlane>) {
    watch_failures(cp.clone());
    let config = cp.config.lifecycle.clone();
    let reaper = cp.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(config.reap_interval);
        loop {
            tick.tick().await;
            reaper.reap().await;
        }
    });
    let meter = cp.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(config.meter_interval);
        loop {
            tick.tick().await;
            meter.meter.sample_all(&meter).await;
        }
    });
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(config.activity_flush);
        loop {
            tick.tick().await;
            cp.flush_activity().await;
        }
    });
}
