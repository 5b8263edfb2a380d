//! What the control plane does on its own: remembers activity, reaps idle
//! and over-age sandboxes, meters the ones it runs, and records the ones
//! whose VM died on its own (killed for memory) as `failed` with the reason.
//! It also kills the VMs this host still runs for rows it no longer owns
//! (`lost` while the host was silent, deleted or failed elsewhere, or moved
//! to another host), so a sandbox the fleet gave up on never runs twice.
//!
//! A planned stop of the service (SIGTERM: `systemctl stop`, an upgrade)
//! hibernates this host's running and paused sandboxes
//! ([`ControlPlane::hibernate_for_stop`]); the next start wakes them
//! ([`ControlPlane::wake_after_stop`]), with their processes and memory as
//! they were. Hibernated state is on the state disk, so it also survives a
//! reboot of the host.
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

    pub(crate) fn is_ours(&self, row: &SandboxRow) -> bool {
        row.host.as_deref() == Some(self.config.host_name.as_str())
    }

    /// Kills every VM of this host whose sandbox row is no longer live
    /// here: `lost` (a front marked it while this host was silent), deleted
    /// or failed (e.g. deleted through another agent while this host was
    /// partitioned), or naming another host. Such a VM would otherwise keep
    /// its memory, CPU and network slot and could keep doing work (a sweep
    /// cell) the fleet already gave up on and may have run elsewhere.
    ///
    /// Races: the engine's VMs are listed *before* the rows are read. Every
    /// path that makes a VM (create and fork in `sandboxes.rs`, sweep cells
    /// and fork parents in `runner.rs`, app deploys in `apps.rs`) admits its
    /// row, with this host's name, before it asks the engine, so the row of
    /// any listed VM is already committed when it is read. A VM with no row
    /// at all is therefore not one mid-create; it is left alone anyway (a
    /// VM adopted from a state directory whose database was replaced is not
    /// this loop's to judge). A row marked `lost` after it was read is seen
    /// on the next tick. A delete kills before it writes `deleted`, and
    /// failure paths write `failed` and then kill: racing them is harmless,
    /// as only one kill finds the VM (the other is a no-op). Nothing here
    /// holds a lock across a guest call.
    async fn kill_strays(&self) {
        let vms = self.host.engine().list().await;
        if vms.is_empty() {
            return;
        }
        let live: HashMap<String, SandboxRow> = match self.store.list_all_live().await {
            Ok(rows) => rows.into_iter().map(|r| (r.id.clone(), r)).collect(),
            Err(e) => {
                tracing::warn!(error = e.chain(), "listing sandboxes to find stray VMs");
                return;
            }
        };
        for vm in vms {
            let row = match live.get(&vm.id) {
                Some(row) => Some(row.clone()),
                // Not live: deleted, failed, or no row at all.
                None => match self.store.sandbox_by_id(&vm.id).await {
                    Ok(row) => row,
                    Err(e) => {
                        tracing::warn!(id = vm.id, error = %e, "reading a VM's sandbox");
                        continue;
                    }
                },
            };
            let Some(why) = stray_reason(row.as_ref(), &self.config.host_name) else {
                continue;
            };
            tracing::warn!(
                id = vm.id,
                why,
                "killing a VM whose sandbox this host no longer owns"
            );
            if let Err(e) = self.host.kill(&vm.id).await {
                tracing::warn!(id = vm.id, error = %e, "killing a stray VM");
            }
        }
    }

    async fn reap(&self) {
        self.flush_activity().await;
        let candidates = match self.store.reap_candidates(now()).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = e.chain(), "listing idle sandboxes");
                return;
            }
        };
        for row in candidates.into_iter().filter(|r| self.is_ours(r)) {
            tracing::info!(id = row.id, "reaping an idle or over-age sandbox");
            let at = now();
            let over_age = row
                .max_lifetime_seconds
                .is_some_and(|max| at - row.created_at >= max as f64);
            self.event(
                &row.id,
                "sandbox.reaped",
                serde_json::json!({ "reason": if over_age { "max_lifetime" } else { "idle" } }),
            );
            if let Err(e) = self.destroy(&row.id).await {
                tracing::warn!(id = row.id, error = e.message, "reaping");
            }
        }
    }
}

/// Why the VM of a sandbox whose row is `row` must not run on `host`, if it
/// must not. A missing row is no reason (see [`ControlPlane::kill_strays`]);
/// nor is a row without a host (single-host rows from before hosts were
/// recorded).
fn stray_reason(row: Option<&SandboxRow>, host: &str) -> Option<String> {
    let row = row?;
    match row.status.as_str() {
        status::DELETED => return Some("its sandbox is deleted".into()),
        status::FAILED => return Some("its sandbox has failed".into()),
        status::LOST => {
            return Some("its sandbox was marked lost while this host was silent".into())
        }
        _ => {}
    }
    match row.host.as_deref() {
        Some(other) if other != host => Some(format!("its sandbox belongs to host {other}")),
        _ => None,
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
            Err(e) => tracing::warn!(error = e.chain(), "listing sandboxes to meter"),
        }
    }

    pub async fn sample_account(&self, cp: &ControlPlane, account: &Account) {
        if let Ok(rows) = cp.store.list_sandboxes(account.id).await {
            self.sample_rows(cp, rows).await;
        }
    }
}

/// The `status_reason` of a sandbox hibernated because the service
/// stopped: a start wakes the sandboxes that carry it.
pub const STOPPED_WITH_THE_SERVICE: &str = "hibernated while the service was stopped";

/// Sandboxes hibernated or woken at once at a stop or start (each writes or
/// reads its memory on the state disk).
const RESTART_PARALLELISM: usize = 4;

impl ControlPlane {
    /// A planned stop: hibernates every running or paused sandbox of this
    /// host (a paused one is resumed first, for its volumes to be frozen by
    /// its agent) and marks it to be woken by the next start. Returns how
    /// many were hibernated; one that could not be is left to be killed
    /// with the process (and is recorded lost at the next start).
    pub async fn hibernate_for_stop(&self) -> usize {
        use futures::StreamExt as _;
        let rows = match self.store.list_all_live().await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::error!(error = e.chain(), "listing sandboxes to hibernate at stop");
                return 0;
            }
        };
        let ours = rows
            .into_iter()
            .filter(|row| self.is_ours(row) && matches!(row.status.as_str(), "running" | "paused"));
        let hibernated = futures::stream::iter(ours)
            .map(|row| async move {
                let engine = self.host.engine();
                if row.status == "paused" {
                    if let Err(e) = engine.resume(&row.id).await {
                        tracing::warn!(id = row.id, error = %e, "resuming to hibernate at stop");
                        return false;
                    }
                }
                if let Err(e) = self.host.hibernate(&row.id).await {
                    tracing::warn!(id = row.id, error = %e, "hibernating at stop");
                    return false;
                }
                self.event(
                    &row.id,
                    "sandbox.hibernated",
                    serde_json::json!({ "reason": "the service stopped" }),
                );
                let patch = SandboxPatch {
                    status: Some("hibernated".into()),
                    status_reason: Some(STOPPED_WITH_THE_SERVICE.into()),
                    ..SandboxPatch::default()
                };
                match self.store.update_sandbox(&row.id, patch).await {
                    Ok(_) => true,
                    Err(e) => {
                        tracing::error!(
                            id = row.id,
                            error = e.chain(),
                            "recording a hibernation at stop"
                        );
                        false
                    }
                }
            })
            .buffer_unordered(RESTART_PARALLELISM)
            .filter(|done| std::future::ready(*done))
            .count()
            .await;
        self.events.flush(&self.store).await;
        hibernated
    }

    /// After [`ControlPlane::reconcile`]: wakes this host's sandboxes that
    /// a planned stop hibernated. Returns how many woke; one that cannot
    /// (no memory for it now) stays hibernated, for its user to wake.
    pub async fn wake_after_stop(&self) -> usize {
        use futures::StreamExt as _;
        let rows = match self.store.list_all_live().await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::error!(error = e.chain(), "listing sandboxes to wake at start");
                return 0;
            }
        };
        let stopped = rows.into_iter().filter(|row| {
            self.is_ours(row)
                && row.status == "hibernated"
                && row.status_reason.as_deref() == Some(STOPPED_WITH_THE_SERVICE)
        });
        futures::stream::iter(stopped)
            .map(|row| async move {
                if let Err(e) = self.host.wake(&row.id).await {
                    tracing::warn!(id = row.id, error = %e, "waking a sandbox the stop hibernated");
                    return false;
                }
                self.event(
                    &row.id,
                    "sandbox.woken",
                    serde_json::json!({ "reason": "the service started" }),
                );
                self.touch(&row.id);
                let patch = SandboxPatch {
                    status: Some("running".into()),
                    // Empty clears the reason (the store keeps NULL).
                    status_reason: Some(String::new()),
                    if_status: Some("hibernated".into()),
                    ..SandboxPatch::default()
                };
                self.store.update_sandbox(&row.id, patch).await.is_ok()
            })
            .buffer_unordered(RESTART_PARALLELISM)
            .filter(|done| std::future::ready(*done))
            .count()
            .await
    }
}

/// After a restart: VMs that survived (only hibernated ones do) but whose
/// rows this host no longer owns are killed, no exec is running any more,
/// and sandboxes whose VM did not survive are recorded deleted.
pub async fn reconcile(cp: &ControlPlane) -> ApiResult<()> {
    // First, so a `lost` row's VM is gone before the loop below would
    // write the VM's state over `lost`.
    cp.kill_strays().await;
    cp.store.clear_running_execs(&cp.config.host_name).await?;
    for row in cp.store.list_all_live().await? {
        // A row without a host is from before hosts were recorded at
        // admission: only a single-host install has those.
        if !(cp.is_ours(&row) || row.host.is_none() && row.status == status::CREATING) {
            continue;
        }
        match cp.host.engine().get(&row.id).await {
            // A `lost` row whose VM could not be killed stays `lost`; and
            // a row marked `lost` since it was read keeps that mark.
            Ok(_) if row.status == status::LOST => {}
            Ok(info) => {
                let patch = SandboxPatch {
                    status: Some(info.state.as_str().into()),
                    if_status: Some(row.status.clone()),
                    ..SandboxPatch::default()
                };
                cp.store.update_sandbox(&row.id, patch).await?;
            }
            Err(_) => {
                tracing::info!(id = row.id, "sandbox did not survive the restart");
                cp.event(
                    &row.id,
                    "sandbox.lost",
                    serde_json::json!({ "reason": "its VM did not survive a restart of the service" }),
                );
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
                self.event(
                    id,
                    "sandbox.failed",
                    serde_json::json!({ "reason": failure.reason }),
                );
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
            reaper.kill_strays().await;
            reaper.reap().await;
            reaper.remove_requested_snapshots().await;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn row(status: &str, host: Option<&str>) -> SandboxRow {
        SandboxRow {
            id: "sb-1".into(),
            account_id: 1,
            template: "code-interpreter".into(),
            cpu: 1,
            memory_mb: 512,
            metadata: Default::default(),
            ttl_seconds: 300,
            persistent: false,
            max_lifetime_seconds: None,
            from_snapshot: None,
            parent_id: None,
            tree_id: None,
            status: status.into(),
            host: host.map(str::to_owned),
            guest_ip: None,
            created_at: 0.0,
            last_activity_at: 0.0,
            running_execs: 0,
            boot_ms: None,
            boot_mode: None,
            deleted_at: None,
            status_reason: None,
        }
    }

    #[test]
    fn strays_are_vms_of_rows_not_live_here() {
        let here = Some("a");
        for status in ["creating", "running", "paused", "hibernated"] {
            assert_eq!(stray_reason(Some(&row(status, here)), "a"), None);
            // Single-host rows from before hosts were recorded.
            assert_eq!(stray_reason(Some(&row(status, None)), "a"), None);
            assert!(stray_reason(Some(&row(status, Some("b"))), "a").is_some());
        }
        for status in [status::DELETED, status::FAILED, status::LOST] {
            assert!(stray_reason(Some(&row(status, here)), "a").is_some());
            assert!(stray_reason(Some(&row(status, None)), "a").is_some());
        }
        // A VM without a row is left alone.
        assert_eq!(stray_reason(None, "a"), None);
    }
}
