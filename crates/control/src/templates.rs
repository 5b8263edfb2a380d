//! Templates: the first-party ones (the image crate's, global) and each
//! account's own, which are names for its snapshots (issue 21):
//! `POST /v1/templates` names a running sandbox (captured now) or a
//! snapshot; `GET /v1/templates[/{name}]` and `DELETE /v1/templates/{name}`
//! answer in the `pandastack` SDK's shapes. A sandbox created with an
//! account's template restores its snapshot.
//!
//! It owns the template routes and the resolution of a template name for a
//! create ([`ControlPlane::template_source`]); the rows are the store's, the
//! captures the engine's.

use crate::error::{ApiError, ApiResult};
use crate::extract::{Body, Caller};
use crate::{now, rfc3339, ControlPlane};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use shoal_host::Source;
use shoal_store::{Account, StoreError, TemplateRow};
use std::sync::Arc;

type St = State<Arc<ControlPlane>>;

fn not_found(name: &str) -> ApiError {
    ApiError::not_found(format!("template not found: {name}"))
}

/// A first-party template as the API shows it, if this host has it built.
fn first_party_json(cp: &ControlPlane, name: &str) -> Option<Value> {
    let spec = shoal_image::find_template(name)?;
    cp.host.engine().template(name).ok()?;
    Some(json!({
        "name": spec.name,
        "cpu": spec.vcpus,
        "memory_mb": spec.memory_mib,
        "is_global": true,
        "base": "debian-bookworm",
        "description": format!("Debian bookworm with {}", spec.packages.join(", ")),
    }))
}

/// An account's template as the API shows it: its size is its base's.
fn own_json(cp: &ControlPlane, account: &Account, row: &TemplateRow) -> Value {
    let manifest = cp.host.engine().template(&row.base).ok();
    json!({
        "name": row.name,
        "cpu": manifest.as_ref().map(|m| m.vcpus),
        "memory_mb": manifest.as_ref().map(|m| m.memory_mib),
        "is_global": false,
        "workspace": account.name,
        "base": row.base,
        "meta": {"snapshot_id": row.snapshot_id, "created_at": rfc3339(row.created_at)},
    })
}

pub async fn list(State(cp): St, Caller(account): Caller) -> ApiResult<Json<Value>> {
    let mut items: Vec<Value> = shoal_image::first_party_templates()
        .iter()
        .filter_map(|spec| first_party_json(&cp, &spec.name))
        .collect();
    for row in cp.store.list_templates(account.id).await? {
        items.push(own_json(&cp, &account, &row));
    }
    Ok(Json(json!({ "items": items })))
}

pub async fn get(
    State(cp): St,
    Caller(account): Caller,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    if let Some(global) = first_party_json(&cp, &name) {
        return Ok(Json(global));
    }
    let row = cp
        .store
        .get_template(account.id, &name)
        .await?
        .ok_or_else(|| not_found(&name))?;
    Ok(Json(own_json(&cp, &account, &row)))
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct CreateBody {
    name: Option<String>,
    /// A running sandbox of the account's, captured now.
    from_sandbox: Option<String>,
    /// A snapshot of the account's.
    from_snapshot: Option<String>,
}

pub async fn create(
    State(cp): St,
    Caller(account): Caller,
    Body(body): Body<CreateBody>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    crate::sandboxes::detached(create_detached(cp, account, body)).await
}

async fn create_detached(
    cp: Arc<ControlPlane>,
    account: Account,
    body: CreateBody,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let name = body
        .name
        .ok_or_else(|| ApiError::bad_request("name is required"))?;
    if !shoal_image::valid_template_name(&name) {
        return Err(ApiError::bad_request(format!(
            "invalid template name {name:?}: 1-63 of a-z, 0-9 and '-', not starting with '-'"
        )));
    }
    if shoal_image::find_template(&name).is_some() {
        return Err(ApiError::conflict(format!(
            "{name} is a first-party template's name"
        )));
    }
    if cp.store.get_template(account.id, &name).await?.is_some() {
        return Err(ApiError::conflict(format!("template {name} exists")));
    }
    let (snapshot, taken_now) = match (body.from_sandbox, body.from_snapshot) {
        (Some(sandbox), None) => (cp.take_snapshot(&account, &sandbox).await?, true),
        (None, Some(snapshot)) => {
            let row = cp
                .store
                .get_snapshot(account.id, &snapshot)
                .await?
                .ok_or_else(|| ApiError::not_found("snapshot not found"))?;
            (row, false)
        }
        _ => {
            return Err(ApiError::bad_request(
                "give one of from_sandbox (a running sandbox) or from_snapshot",
            ))
        }
    };
    let row = TemplateRow {
        account_id: account.id,
        name: name.clone(),
        snapshot_id: snapshot.id.clone(),
        base: snapshot.template.clone(),
        created_at: now(),
    };
    // As many templates as snapshots: each needs one, and this bounds the
    // names that may share one.
    let limit = cp.snapshot_limits(account.tier).count;
    if let Err(e) = cp.store.insert_template(&account, &row, limit).await {
        // The capture made for it would be nobody's to delete.
        if taken_now {
            if let Err(cleanup) = cp.host.delete_snapshot(&snapshot.id).await {
                tracing::warn!(snapshot = snapshot.id, error = %cleanup, "removing a template's capture");
            }
            let _ = cp.store.delete_snapshot(account.id, &snapshot.id).await;
        }
        return Err(match e {
            StoreError::AlreadyExists { .. } => {
                ApiError::conflict(format!("template {name} exists"))
            }
            other => other.into(),
        });
    }
    Ok((StatusCode::CREATED, Json(own_json(&cp, &account, &row))))
}

pub async fn delete(
    State(cp): St,
    Caller(account): Caller,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    if shoal_image::find_template(&name).is_some() {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!("{name} is a first-party template and cannot be deleted"),
        ));
    }
    // Its snapshot stays (the account's, in its list): sandboxes made from
    // the template go on running from it.
    if cp.store.delete_template(account.id, &name).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(not_found(&name))
    }
}

/// What a sandbox created with template `name` is made from (an account
/// template's snapshot, or the first-party template itself) and the
/// first-party template that sizes it. A first-party name is taken as it
/// is (the engine says whether this host has it).
pub(crate) struct TemplateSource {
    pub source: Source,
    pub base: String,
}

impl ControlPlane {
    pub(crate) async fn template_source(
        &self,
        account: &Account,
        name: &str,
    ) -> ApiResult<TemplateSource> {
        if !shoal_image::valid_template_name(name) {
            return Err(ApiError::bad_request(format!("unknown template: {name}")));
        }
        if shoal_image::find_template(name).is_none() {
            if let Some(own) = self.store.get_template(account.id, name).await? {
                return Ok(TemplateSource {
                    source: Source::Snapshot(own.snapshot_id),
                    base: own.base,
                });
            }
        }
        Ok(TemplateSource {
            source: Source::Template(name.to_owned()),
            base: name.to_owned(),
        })
    }
}
