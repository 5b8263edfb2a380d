//! Volumes: create, list, get, delete (CONTRACT.md 4.17-4.20), and turning
//! a create's `volumes` into what the engine attaches.
//!
//! Order in a create: validate (400), check this host's disk for the whole
//! provisioned size (507, nothing exists yet), record the row under the
//! tier quotas (429; 409 for a name in use), then make the image; if that
//! fails the row goes again (500). A delete removes the row first, refused
//! (409) while a live sandbox holds the volume, then the image.

use crate::error::{ApiError, ApiResult};
use crate::extract::{Body, Caller};
use crate::sandboxes::detached;
use crate::{now, rfc3339, ControlPlane};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use shoal_host::{valid_volume_name, VolumeAttachment};
use shoal_store::{Account, NewVolume, VolumeRequest, VolumeRow, MAX_VOLUME_MB};
use std::sync::Arc;

type St = State<Arc<ControlPlane>>;

/// Volumes one sandbox may attach (the slots baked into every template).
pub const MAX_VOLUMES_PER_SANDBOX: usize = shoal_host::VOLUME_SLOTS;

fn volume_not_found(name: &str) -> ApiError {
    ApiError::not_found(format!("volume not found: {name}"))
}

/// The volume JSON of CONTRACT.md 4.17.
pub fn volume_json(row: &VolumeRow) -> Value {
    json!({
        "name": row.name,
        "size_mb": row.size_mb,
        "created_at": rfc3339(row.created_at),
        "attached_to": row.attached_to,
    })
}

#[derive(Deserialize)]
pub struct VolumeRef {
    name: String,
    #[serde(default)]
    read_only: bool,
}

/// Checks a create's `volumes` (400 for too many or a repeat; a name that
/// cannot exist is a 404 like any missing volume) and returns what the
/// store attaches.
pub(crate) fn requests(volumes: &[VolumeRef]) -> ApiResult<Vec<VolumeRequest>> {
    if volumes.len() > MAX_VOLUMES_PER_SANDBOX {
        return Err(ApiError::bad_request(format!(
            "a sandbox attaches at most {MAX_VOLUMES_PER_SANDBOX} volumes"
        )));
    }
    let mut out: Vec<VolumeRequest> = Vec::new();
    for volume in volumes {
        if !valid_volume_name(&volume.name) {
            return Err(volume_not_found(&volume.name));
        }
        if out.iter().any(|v| v.name == volume.name) {
            return Err(ApiError::bad_request(format!(
                "volume {} is listed twice",
                volume.name
            )));
        }
        out.push(VolumeRequest {
            name: volume.name.clone(),
            read_only: volume.read_only,
        });
    }
    Ok(out)
}

impl ControlPlane {
    /// The engine's view of attachments the store admitted.
    pub(crate) fn attachments(
        &self,
        account: &Account,
        volumes: &[VolumeRequest],
    ) -> Vec<VolumeAttachment> {
        volumes
            .iter()
            .map(|v| VolumeAttachment {
                name: v.name.clone(),
                image: self.host.volume_image(account.id, &v.name),
                read_only: v.read_only,
            })
            .collect()
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct CreateBody {
    name: Option<String>,
    size_mb: Option<i64>,
}

pub async fn create(
    State(cp): St,
    Caller(account): Caller,
    Body(body): Body<CreateBody>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    detached(create_detached(cp, account, body)).await
}

async fn create_detached(
    cp: Arc<ControlPlane>,
    account: Account,
    body: CreateBody,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let name = body
        .name
        .filter(|n| valid_volume_name(n))
        .ok_or_else(|| ApiError::bad_request("name must match [a-z0-9][a-z0-9-_]{0,62}"))?;
    let size_mb = body
        .size_mb
        .filter(|s| (1..=MAX_VOLUME_MB as i64).contains(s))
        .ok_or_else(|| {
            ApiError::bad_request(format!("size_mb must be between 1 and {MAX_VOLUME_MB}"))
        })? as u64;
    cp.host.check_volume_headroom(size_mb)?;
    let new = NewVolume {
        name: name.clone(),
        size_mb,
        host: cp.config.host_name.clone(),
    };
    let row = cp
        .store
        .create_volume(&account, &new, &cp.volume_limits(account.tier), now())
        .await?;
    if let Err(e) = cp.host.make_volume(account.id, &name, size_mb).await {
        if let Err(undo) = cp.store.delete_volume(&account, &name).await {
            tracing::error!(name, error = %undo, "forgetting a volume whose image failed");
        }
        let mut error = ApiError::from(e);
        error.status = StatusCode::INTERNAL_SERVER_ERROR;
        return Err(error);
    }
    Ok((StatusCode::CREATED, Json(volume_json(&row))))
}

pub async fn list(State(cp): St, Caller(account): Caller) -> ApiResult<Json<Value>> {
    let rows = cp.store.list_volumes(account.id).await?;
    let items: Vec<Value> = rows.iter().map(volume_json).collect();
    Ok(Json(json!({ "items": items })))
}

pub async fn get(
    State(cp): St,
    Caller(account): Caller,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    match cp.store.get_volume(account.id, &name).await? {
        Some(row) => Ok(Json(volume_json(&row))),
        None => Err(volume_not_found(&name)),
    }
}

pub async fn delete(
    State(cp): St,
    Caller(account): Caller,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    detached(delete_detached(cp, account, name)).await
}

async fn delete_detached(
    cp: Arc<ControlPlane>,
    account: Account,
    name: String,
) -> ApiResult<StatusCode> {
    let row = cp
        .store
        .get_volume(account.id, &name)
        .await?
        .ok_or_else(|| volume_not_found(&name))?;
    // Only the host whose disk holds the image may delete it (a fleet's
    // front sends the request there).
    if row.host != cp.config.host_name {
        return Err(ApiError::conflict(format!(
            "volume {name} lives on host {}",
            row.host
        )));
    }
    cp.store
        .delete_volume(&account, &name)
        .await?
        .ok_or_else(|| volume_not_found(&name))?;
    cp.host.remove_volume(account.id, &name)?;
    Ok(StatusCode::NO_CONTENT)
}
