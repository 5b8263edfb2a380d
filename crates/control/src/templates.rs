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
use std::time::Duration;

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
        "base": format!("debian-{}", spec.suite),
        "description": format!("Debian {} with {}", spec.suite, spec.packages.join(", ")),
    }))
}

/// An account's template as the API shows it to its own account: what
/// every account sees of a published one, plus its owner and snapshot.
async fn own_json(cp: &ControlPlane, account: &Account, row: &TemplateRow) -> Value {
    let mut value = published_json(cp, row).await;
    value["is_global"] = json!(false);
    value["published"] = json!(row.published);
    value["workspace"] = json!(account.name);
    value["meta"]["snapshot_id"] = json!(row.snapshot_id);
    value
}

/// The size (vCPUs, MiB) of the VM a template's sandboxes get: its
/// snapshot's, from the manifest where this host holds it, else as its
/// row recorded it (any host of a fleet), else its base's.
async fn template_size(cp: &ControlPlane, row: &TemplateRow) -> Option<(i64, i64)> {
    let engine = cp.host.engine();
    if let Ok(m) = engine.snapshot_manifest(&row.snapshot_id) {
        return Some((i64::from(m.vcpus), i64::from(m.memory_mib)));
    }
    let recorded = cp
        .store
        .get_snapshot(row.account_id, &row.snapshot_id)
        .await
        .ok()
        .flatten()
        .and_then(|s| s.vcpus.zip(s.memory_mib));
    recorded.or_else(|| {
        let m = engine.template(&row.base).ok()?;
        Some((i64::from(m.vcpus), i64::from(m.memory_mib)))
    })
}

/// A template as another account sees it once an operator published it:
/// usable by name, its snapshot and owner not shown. Its size is its
/// snapshot's ([`template_size`]).
async fn published_json(cp: &ControlPlane, row: &TemplateRow) -> Value {
    let size = template_size(cp, row).await;
    json!({
        "name": row.name,
        "cpu": size.map(|s| s.0),
        "memory_mb": size.map(|s| s.1),
        "is_global": true,
        "published": true,
        "base": row.base,
        "meta": {
            "start_cmd": row.start_cmd,
            "ready_cmd": row.ready_cmd,
            "created_at": rfc3339(row.created_at),
        },
    })
}

pub async fn list(State(cp): St, Caller(account): Caller) -> ApiResult<Json<Value>> {
    // Other Debian releases' templates are listed once this host baked them.
    let releases = shoal_image::OTHER_DEBIAN_RELEASES
        .iter()
        .filter_map(|release| shoal_image::release_template(release));
    let mut items: Vec<Value> = shoal_image::first_party_templates()
        .into_iter()
        .chain(releases)
        .filter_map(|spec| first_party_json(&cp, &spec.name))
        .collect();
    let own = cp.store.list_templates(account.id).await?;
    for row in cp.store.list_published_templates().await? {
        // The account's own of that name is the one it gets.
        if row.account_id != account.id && !own.iter().any(|o| o.name == row.name) {
            items.push(published_json(&cp, &row).await);
        }
    }
    for row in &own {
        items.push(own_json(&cp, &account, row).await);
    }
    // An array, as PandaStack's server answers (the SDK reads either).
    Ok(Json(Value::Array(items)))
}

pub async fn get(
    State(cp): St,
    Caller(account): Caller,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    if let Some(global) = first_party_json(&cp, &name) {
        return Ok(Json(global));
    }
    if let Some(row) = cp.store.get_template(account.id, &name).await? {
        return Ok(Json(own_json(&cp, &account, &row).await));
    }
    let row = cp
        .store
        .get_published_template(&name)
        .await?
        .ok_or_else(|| not_found(&name))?;
    Ok(Json(published_json(&cp, &row).await))
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct CreateBody {
    name: Option<String>,
    /// A running sandbox of the account's, captured now.
    from_sandbox: Option<String>,
    /// A snapshot of the account's.
    from_snapshot: Option<String>,
    /// With `from_sandbox`: a shell command started (detached) in the
    /// sandbox before the capture, so it runs in every sandbox of the
    /// template.
    start_cmd: Option<String>,
    /// Run until it exits 0 before the capture (default: none).
    ready_cmd: Option<String>,
    /// How long `ready_cmd` may take to succeed (default 60, at most 600).
    ready_timeout_seconds: Option<u64>,
}

/// Default and longest wait for a template's ready command.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
const MAX_READY_TIMEOUT_SECONDS: u64 = 600;
/// How long a copy of a template at another size waits for its ready
/// command (a Dockerfile's HEALTHCHECK gets as long in its build).
const COPY_READY_PATIENCE: Duration = Duration::from_secs(300);
/// The longest start or ready command accepted.
const MAX_COMMAND_BYTES: usize = 16 << 10;

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
    let ready_timeout = match body.ready_timeout_seconds {
        Some(s) if s == 0 || s > MAX_READY_TIMEOUT_SECONDS => {
            return Err(ApiError::bad_request(format!(
                "ready_timeout_seconds must be 1 to {MAX_READY_TIMEOUT_SECONDS}"
            )))
        }
        Some(s) => Duration::from_secs(s),
        None => READY_TIMEOUT,
    };
    for (field, command) in [
        ("start_cmd", &body.start_cmd),
        ("ready_cmd", &body.ready_cmd),
    ] {
        if command
            .as_ref()
            .is_some_and(|c| c.trim().is_empty() || c.len() > MAX_COMMAND_BYTES)
        {
            return Err(ApiError::bad_request(format!(
                "{field} must be a non-empty command of at most {MAX_COMMAND_BYTES} bytes"
            )));
        }
    }
    let starts = body.start_cmd.is_some() || body.ready_cmd.is_some();
    if starts && body.from_sandbox.is_none() {
        return Err(ApiError::bad_request(
            "start_cmd and ready_cmd need from_sandbox (a snapshot cannot start anything)",
        ));
    }
    let (snapshot, taken_now) = match (body.from_sandbox, body.from_snapshot) {
        (Some(sandbox), None) => {
            if starts {
                // The account's own and running, before anything runs in
                // it (`take_snapshot` checks the same for a plain capture).
                cp.running(&account, &sandbox).await?;
            }
            if let Some(start) = &body.start_cmd {
                start_detached(&cp, &sandbox, start).await?;
            }
            if let Some(ready) = &body.ready_cmd {
                wait_ready(&cp, &sandbox, ready, ready_timeout).await?;
            }
            (cp.take_snapshot(&account, &sandbox).await?, true)
        }
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
        start_cmd: body.start_cmd,
        ready_cmd: body.ready_cmd,
        published: false,
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
    Ok((
        StatusCode::CREATED,
        Json(own_json(&cp, &account, &row).await),
    ))
}

pub(crate) use shoal_host::warm_up::shell_quoted;

/// Starts `command` detached in the sandbox (`warm_up::start_detached`).
pub(crate) async fn start_detached(
    cp: &ControlPlane,
    sandbox: &str,
    command: &str,
) -> ApiResult<()> {
    let agent = cp.host.engine().agent(sandbox).await?;
    shoal_host::warm_up::start_detached(&agent, command)
        .await
        .map_err(|why| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, why))
}

/// Runs `command` in the sandbox until it exits 0, for at most `patience`;
/// 422 with the end of its last output otherwise.
pub(crate) async fn wait_ready(
    cp: &ControlPlane,
    sandbox: &str,
    command: &str,
    patience: Duration,
) -> ApiResult<()> {
    let agent = cp.host.engine().agent(sandbox).await?;
    shoal_host::warm_up::wait_ready(&agent, command, patience)
        .await
        .map_err(|why| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, why))
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
    let snapshot = cp
        .store
        .get_template(account.id, &name)
        .await?
        .map(|t| t.snapshot_id);
    // Its snapshot stays (the account's, in its list) unless a build made
    // it for this template alone; either way sandboxes made from the
    // template go on running (the engine keeps the files they use).
    if !cp.store.delete_template(account.id, &name).await? {
        return Err(not_found(&name));
    }
    if let Some(snapshot) = snapshot {
        crate::builds::collect_snapshot(&cp, &account, &snapshot).await;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// What a sandbox created with template `name` is made from (an account
/// template's snapshot, or the first-party template itself) and the
/// first-party template that sizes it. A first-party name is taken as it
/// is (the engine says whether this host has it).
pub(crate) struct TemplateSource {
    pub source: Source,
    pub base: String,
    /// The template's start command and readiness check: running in its
    /// snapshot, and run again in a copy of another size before it is saved.
    pub warm_up: Option<shoal_host::warm_up::WarmUp>,
}

/// A template row's start and ready commands, as a copy's bake runs them.
fn warm_up_of(row: &TemplateRow) -> Option<shoal_host::warm_up::WarmUp> {
    (row.start_cmd.is_some() || row.ready_cmd.is_some()).then(|| shoal_host::warm_up::WarmUp {
        start: row.start_cmd.clone(),
        ready: row.ready_cmd.clone(),
        patience: COPY_READY_PATIENCE,
    })
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
            let own = self.store.get_template(account.id, name).await?;
            let found = match own {
                Some(own) => Some(own),
                None => self.store.get_published_template(name).await?,
            };
            if let Some(row) = found {
                return Ok(TemplateSource {
                    warm_up: warm_up_of(&row),
                    source: Source::Snapshot(row.snapshot_id),
                    base: row.base,
                });
            }
        }
        Ok(TemplateSource {
            source: Source::Template(name.to_owned()),
            base: name.to_owned(),
            warm_up: None,
        })
    }
}
