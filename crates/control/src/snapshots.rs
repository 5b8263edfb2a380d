//! One snapshot: `GET` and `DELETE /v1/snapshots/{id}` (the SDK's
//! `snapshots.get` / `snapshots.delete`), and what a snapshot weighs against
//! its account's quota. Taking one is `POST /v1/sandboxes/{id}/snapshots`
//! (`sandboxes.rs`); the list is `meta.rs`.
//!
//! A snapshot's record (the store) and its files (the engine's capture on
//! the host in the record) go together: a delete demotes the capture first,
//! so no new sandbox can be made from it, then drops the record; the files
//! go once no sandbox restored from it still runs on that host.

use crate::error::{ApiError, ApiResult};
use crate::extract::Caller;
use crate::{rfc3339, ControlPlane};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};
use shoal_host::{EngineError, HostError};
use shoal_store::SnapshotRow;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

type St = State<Arc<ControlPlane>>;

/// A snapshot as the API shows it (the same fields as the list).
pub(crate) fn snapshot_json(row: &SnapshotRow) -> Value {
    json!({
        "id": row.id,
        "sandbox_id": row.sandbox_id,
        "template": row.template,
        "size_bytes": row.size_bytes,
        "created_at": rfc3339(row.created_at),
    })
}

fn not_found() -> ApiError {
    ApiError::not_found("snapshot not found")
}

pub async fn get(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let row = cp
        .store
        .get_snapshot(account.id, &id)
        .await?
        .ok_or_else(not_found)?;
    Ok(Json(snapshot_json(&row)))
}

pub async fn delete(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    crate::sandboxes::detached(async move {
        let row = cp
            .store
            .get_snapshot(account.id, &id)
            .await?
            .ok_or_else(not_found)?;
        // The files are on the host in the row; a fleet's front sends the
        // request there. Dropping only the record would leak them.
        if row
            .host
            .as_deref()
            .is_some_and(|h| h != cp.config.host_name)
        {
            let mut refusal =
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "snapshot host unavailable");
            refusal.retry_after = Some(15);
            return Err(refusal);
        }
        cp.remove_snapshot(&row).await?;
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}

/// Bytes the host's disk holds for the capture `snapshot` (whose manifest
/// is `manifest`): the allocated blocks of its directory's files and of its
/// memory file (sparse files count what they hold, not their length).
pub(crate) fn capture_bytes(
    cp: &ControlPlane,
    snapshot: &str,
    manifest: Option<&shoal_host::Manifest>,
) -> Option<i64> {
    let engine = cp.host.engine();
    let dir = engine.state_dir().join("captures").join(snapshot);
    let mut total: u64 = std::fs::read_dir(&dir)
        .ok()?
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.blocks() * 512)
        .sum();
    if let Some(manifest) = manifest {
        if !manifest.memory_file.starts_with(&dir) {
            total += std::fs::metadata(&manifest.memory_file).map_or(0, |m| m.blocks() * 512);
        }
    }
    i64::try_from(total).ok()
}

impl ControlPlane {
    /// Removes this host's snapshots whose removal an operator asked for
    /// (`shoal snapshot rm`) as a delete through the API does. One that a
    /// template is made from stays (the operator's command refuses those;
    /// a template made since is kept).
    pub(crate) async fn remove_requested_snapshots(&self) {
        let rows = match self.store.snapshots_to_remove(&self.config.host_name).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = e.chain(), "listing snapshots to remove");
                return;
            }
        };
        for row in rows {
            match self.remove_snapshot(&row).await {
                Ok(()) => {
                    tracing::info!(id = row.id, "removed a snapshot at the operator's request")
                }
                Err(e) => tracing::warn!(id = row.id, error = e.message, "removing a snapshot"),
            }
        }
    }

    /// Removes snapshot `row` of this host: its files, then its record.
    /// Refused (409) while a template is made from it.
    async fn remove_snapshot(&self, row: &SnapshotRow) -> ApiResult<()> {
        let id = &row.id;
        let naming = self.store.templates_of_snapshot(id).await?;
        if !naming.is_empty() {
            return Err(ApiError::conflict(format!(
                "snapshot {id} is template {}'s: delete the template first",
                naming.join(", ")
            )));
        }
        match self.host.delete_snapshot(id).await {
            // Files already gone (an earlier delete that lost its record's
            // removal, a wiped state dir): the record goes all the same.
            Ok(()) | Err(HostError::Engine(EngineError::NoSuchSnapshot(_))) => {}
            Err(e) => return Err(e.into()),
        }
        self.store.delete_snapshot(row.account_id, id).await?;
        Ok(())
    }
}
