//! Sandboxes: create, list, get, delete, fork, fork-tree, promote,
//! lifecycle, pause, resume, hibernate, wake and snapshots.
//!
//! Order in a create: validate, take a host slot (503/507 refusals happen
//! here, before anything exists), admit through the quota (429), then
//! restore. A failure after admission marks the row failed and is a 500.

use crate::error::{ApiError, ApiResult};
use crate::extract::{Body, Caller};
use crate::{now, rfc3339, ControlPlane};
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use shoal_host::{CreateOptions, SandboxInfo, Source, Usage};
use shoal_store::{status, Account, Metadata, NewSandbox, SandboxPatch, SandboxRow, SnapshotRow};
use std::sync::Arc;

pub const DEFAULT_TTL_SECONDS: u64 = 300;
pub(crate) const MAX_METADATA_KEYS: usize = 64;
const MAX_FORK_TREE: usize = 16;

type St = State<Arc<ControlPlane>>;

/// The sandbox JSON of CONTRACT.md 2.1.
pub fn sandbox_json(row: &SandboxRow) -> Value {
    json!({
        "id": row.id,
        "template": row.template,
        "cpu": row.cpu,
        "memory_mb": row.memory_mb,
        "status": row.status,
        "status_reason": row.status_reason,
        "guest_ip": row.guest_ip,
        "created_at": rfc3339(row.created_at),
        "metadata": row.metadata,
        "from_snapshot": row.from_snapshot,
        "boot_ms": row.boot_ms.map(|ms| ms.round() as i64),
        "boot_mode": row.boot_mode,
        "persistent": row.persistent,
        "ttl_seconds": row.ttl_seconds,
        "max_lifetime_seconds": row.max_lifetime_seconds,
        "idle_seconds": idle_seconds(row, crate::now()),
    })
}

/// Whole seconds since the last API activity on the sandbox; none while a
/// command runs in it (a running exec keeps it from idling out too).
fn idle_seconds(row: &SandboxRow, at: f64) -> u64 {
    if row.running_execs > 0 {
        0
    } else {
        (at - row.last_activity_at).max(0.0) as u64
    }
}

impl ControlPlane {
    /// The caller's live sandbox `id`, or 404; counts as activity on it.
    /// A `failed` one is a 409 that says why.
    pub(crate) async fn owned(&self, account: &Account, id: &str) -> ApiResult<SandboxRow> {
        let row = self.owned_or_failed(account, id).await?;
        if row.status == status::FAILED {
            return Err(ApiError::conflict(failed_message(&row)));
        }
        Ok(row)
    }

    /// The caller's sandbox, live or `failed` (what a GET shows and a
    /// DELETE clears), or 404.
    pub(crate) async fn owned_or_failed(
        &self,
        account: &Account,
        id: &str,
    ) -> ApiResult<SandboxRow> {
        match self.store.get_sandbox(account.id, id).await? {
            Some(row)
                if (row.is_live() || row.status == status::FAILED)
                    && row.status != status::CREATING =>
            {
                self.touch(id);
                Ok(row)
            }
            _ => Err(ApiError::sandbox_not_found()),
        }
    }

    /// The caller's sandbox, running: a hibernated one is woken first (the
    /// SDK promises that), a paused one is a 409.
    pub(crate) async fn running(&self, account: &Account, id: &str) -> ApiResult<SandboxRow> {
        let mut row = self.owned(account, id).await?;
        match row.status.as_str() {
            "running" => Ok(row),
            "hibernated" => {
                self.host.wake(id).await?;
                self.set_status(id, "running", "sandbox.woken").await?;
                row.status = "running".into();
                Ok(row)
            }
            other => Err(ApiError::conflict(format!("sandbox is {other}"))),
        }
    }

    /// Records `new` as the sandbox's status and `event` in its log.
    pub(crate) async fn set_status(&self, id: &str, new: &str, event: &str) -> ApiResult<()> {
        self.event(id, event, json!({}));
        self.store
            .update_sandbox(
                id,
                SandboxPatch {
                    status: Some(new.into()),
                    ..SandboxPatch::default()
                },
            )
            .await?;
        Ok(())
    }

    /// Marks a sandbox that came up as running, with how it came up.
    pub(crate) async fn came_up(
        &self,
        row: &mut SandboxRow,
        info: &SandboxInfo,
        mode: &str,
    ) -> ApiResult<()> {
        let patch = SandboxPatch {
            status: Some("running".into()),
            host: Some(self.config.host_name.clone()),
            boot_ms: Some(info.restore_ms),
            boot_mode: Some(mode.into()),
            guest_ip: Some(info.guest_ip.clone()),
            if_status: Some(status::CREATING.into()),
            ..SandboxPatch::default()
        };
        self.store.update_sandbox(&row.id, patch).await?;
        self.event(
            &row.id,
            "sandbox.running",
            json!({ "boot_mode": mode, "boot_ms": info.restore_ms, "template": row.template }),
        );
        row.status = "running".into();
        row.host = Some(self.config.host_name.clone());
        row.boot_ms = Some(info.restore_ms);
        row.boot_mode = Some(mode.into());
        row.guest_ip = Some(info.guest_ip.clone());
        Ok(())
    }

    pub(crate) async fn mark_failed(&self, id: &str) {
        self.event(
            id,
            "sandbox.failed",
            json!({ "reason": "its VM did not come up" }),
        );
        let patch = SandboxPatch {
            status: Some(status::FAILED.into()),
            deleted_at: Some(now()),
            ..SandboxPatch::default()
        };
        if let Err(e) = self.store.update_sandbox(id, patch).await {
            tracing::error!(id, error = %e, "marking a sandbox failed");
        }
    }

    /// Stops a sandbox and records it deleted (its usage rows stay).
    /// Returns its last usage reading, taken just before the kill.
    pub(crate) async fn destroy(&self, id: &str) -> ApiResult<Option<Usage>> {
        let last_usage = self.meter.sample_one(self, id).await;
        self.host.kill(id).await?;
        self.event(id, "sandbox.deleted", json!({}));
        let patch = SandboxPatch {
            status: Some(status::DELETED.into()),
            deleted_at: Some(now()),
            ..SandboxPatch::default()
        };
        self.store.update_sandbox(id, patch).await?;
        Ok(last_usage)
    }
}

/// A failure once a sandbox row exists: never a refusal the SDK would retry
/// (503 with Retry-After, 507), which must mean nothing was made.
fn failed_after_admission(e: shoal_host::HostError) -> ApiError {
    let mut error = ApiError::from(e);
    if error.status.is_server_error() {
        error.status = StatusCode::INTERNAL_SERVER_ERROR;
        error.retry_after = None;
    }
    error
}

/// Runs `work` to its end even if the client goes away (axum drops a
/// handler's future then): a create, fork or delete cut off half-way would
/// leave a VM without a row or a row without a VM.
pub(crate) async fn detached<T: Send + 'static>(
    work: impl std::future::Future<Output = ApiResult<T>> + Send + 'static,
) -> ApiResult<T> {
    tokio::spawn(work)
        .await
        .map_err(|e| ApiError::internal(format!("the request's task failed: {e}")))?
}

pub(crate) fn new_id() -> String {
    format!("sb-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct CreateBody {
    template: Option<String>,
    ttl_seconds: Option<i64>,
    max_lifetime_seconds: Option<i64>,
    persistent: Option<bool>,
    metadata: Option<Metadata>,
    from_snapshot: Option<String>,
    volumes: Option<Vec<crate::volumes::VolumeRef>>,
    /// Whether the guest may open connections to the internet (default
    /// true); never to private addresses, the host or other sandboxes.
    allow_internet: Option<bool>,
    /// The VM's size, at most its template's (a smaller one is that
    /// template's disk booted at this size, once, then restored).
    cpu: Option<u32>,
    memory_mb: Option<u32>,
    /// A build's cached layer (`build_layers.rs`) to restore instead of the
    /// template: a snapshot of this host's, not of any account's rows.
    /// Never read from a request.
    #[serde(skip)]
    layer: Option<String>,
}

/// The longest TTL or lifetime a sandbox may ask for (ten years): past it
/// the figures stop meaning anything and risk overflowing the arithmetic
/// done on them.
const MAX_SECONDS: i64 = 10 * 365 * 86400;

/// A field that is present, `null` included (`Some(None)`); absent is
/// `None` by `#[serde(default)]`.
fn present<'de, D, T>(deserializer: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(deserializer).map(Some)
}

fn seconds(field: &str, value: Option<i64>) -> ApiResult<Option<u64>> {
    match value {
        Some(v) if v < 0 => Err(ApiError::bad_request(format!(
            "{field} must not be negative"
        ))),
        Some(v) if v > MAX_SECONDS => Err(ApiError::bad_request(format!(
            "{field} exceeds tier maximum of {MAX_SECONDS}"
        ))),
        other => Ok(other.map(|v| v as u64)),
    }
}

fn check_metadata(metadata: &Metadata) -> ApiResult<()> {
    if metadata.len() > MAX_METADATA_KEYS {
        return Err(ApiError::bad_request(format!(
            "metadata holds at most {MAX_METADATA_KEYS} keys"
        )));
    }
    for (key, value) in metadata {
        if key.is_empty() || key.len() > 128 || value.len() > 1024 {
            return Err(ApiError::bad_request(
                "metadata keys are 1-128 characters and values at most 1024",
            ));
        }
        if key.starts_with("fork_") {
            return Err(ApiError::bad_request(format!(
                "metadata key {key} is reserved"
            )));
        }
    }
    Ok(())
}

pub(crate) use shoal_image::valid_template_name;

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
    let row = create_sandbox(&cp, &account, body).await?;
    Ok((StatusCode::CREATED, Json(sandbox_json(&row))))
}

impl CreateBody {
    /// What a template build asks for its builder VM: `template` at `size`, with the
    /// internet (package registries), its id in the metadata, and no idle
    /// reaping before the build's own deadline.
    pub(crate) fn builder(
        template: &str,
        layer: Option<String>,
        size: VmSize,
        build_id: &str,
        lifetime_seconds: i64,
    ) -> Self {
        CreateBody {
            layer,
            template: Some(template.to_owned()),
            cpu: Some(size.vcpus),
            memory_mb: Some(size.memory_mib),
            ttl_seconds: Some(lifetime_seconds),
            max_lifetime_seconds: Some(lifetime_seconds),
            metadata: Some([("shoal_build".to_owned(), build_id.to_owned())].into()),
            allow_internet: Some(true),
            ..CreateBody::default()
        }
    }
}

/// Admits and starts a sandbox for `account`: its row is running when this
/// returns, or marked failed with nothing left running.
pub(crate) async fn create_sandbox(
    cp: &Arc<ControlPlane>,
    account: &Account,
    body: CreateBody,
) -> ApiResult<SandboxRow> {
    let ttl = seconds("ttl_seconds", body.ttl_seconds)?.unwrap_or(DEFAULT_TTL_SECONDS);
    let max_lifetime = seconds("max_lifetime_seconds", body.max_lifetime_seconds)?;
    let metadata = body.metadata.unwrap_or_default();
    check_metadata(&metadata)?;
    let volumes = crate::volumes::requests(&body.volumes.unwrap_or_default())?;
    // What it restores from and the template its row names.
    let (source, template, mode, warm_up) = match (&body.layer, &body.from_snapshot) {
        (Some(layer), _) => (
            Source::Snapshot(layer.clone()),
            body.template.clone().unwrap_or_default(),
            "restore",
            None,
        ),
        (None, from_snapshot) => match from_snapshot {
            Some(snapshot) => {
                let row = cp
                    .store
                    .get_snapshot(account.id, snapshot)
                    .await?
                    .ok_or_else(|| ApiError::not_found("snapshot not found"))?;
                (Source::Snapshot(row.id), row.template, "snapshot", None)
            }
            None => {
                let name = body.template.unwrap_or_else(|| "code-interpreter".into());
                let resolved = cp.template_source(account, &name).await?;
                (resolved.source, name, "restore", resolved.warm_up)
            }
        },
    };
    let restored = cp.host.source_manifest(&source)?;
    let size = VmSize {
        vcpus: body.cpu.unwrap_or(restored.vcpus),
        memory_mib: body.memory_mb.unwrap_or(restored.memory_mib),
    };
    size.check_within(&restored)?;
    let slot = cp.reserve(1, size.memory_mib).await?;
    let new = NewSandbox {
        id: new_id(),
        template,
        cpu: size.vcpus,
        memory_mb: size.memory_mib,
        metadata,
        ttl_seconds: ttl,
        persistent: body.persistent.unwrap_or(false),
        max_lifetime_seconds: max_lifetime,
        from_snapshot: match &source {
            Source::Snapshot(_) if body.layer.is_some() => None,
            Source::Snapshot(snapshot) => Some(snapshot.clone()),
            Source::Template(_) => None,
        },
        parent_id: None,
        tree_id: None,
        host: Some(cp.config.host_name.clone()),
    };
    // Volumes are attached with the admission: a missing one (404) or one
    // held in a way this cannot share (409) leaves nothing behind.
    let mut row = cp
        .store
        .admit_sandbox_with_volumes(account, &new, &cp.limits(account.tier), &volumes, now())
        .await?;
    cp.event(
        &row.id,
        "sandbox.created",
        json!({ "template": row.template, "from_snapshot": row.from_snapshot,
                "cpu": row.cpu, "memory_mb": row.memory_mb }),
    );
    let options = CreateOptions {
        allow_internet: body.allow_internet.unwrap_or(true),
        volumes: cp.attachments(account, &volumes),
    };
    let sized = match cp
        .host
        .sized(&source, size.vcpus, size.memory_mib, warm_up.as_ref())
        .await
    {
        Ok(sized) => sized,
        Err(e) => {
            cp.mark_failed(&row.id).await;
            return Err(failed_after_admission(e));
        }
    };
    match cp.host.create(&slot, &row.id, &sized, options).await {
        Ok(info) => {
            cp.came_up(&mut row, &info, mode).await?;
            Ok(row)
        }
        Err(e) => {
            cp.mark_failed(&row.id).await;
            Err(failed_after_admission(e))
        }
    }
}

/// The vCPUs and memory a sandbox's VM gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct VmSize {
    pub(crate) vcpus: u32,
    pub(crate) memory_mib: u32,
}

impl VmSize {
    /// A 422 unless this size fits in `restored`'s (a VM is at most its
    /// template's size; a smaller one is booted once at that size).
    pub(crate) fn check_within(&self, restored: &shoal_host::Manifest) -> ApiResult<()> {
        let min = shoal_host::imports::MIN_SIZED_MEMORY_MIB;
        if self.vcpus == 0
            || self.vcpus > restored.vcpus
            || self.memory_mib > restored.memory_mib
            || (self.memory_mib < min && self.memory_mib != restored.memory_mib)
        {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!(
                    "cpu must be from 1 to {} and memory_mb from {min} to {}: a sandbox is at most its template's size",
                    restored.vcpus, restored.memory_mib
                ),
            ));
        }
        Ok(())
    }
}

/// `GET /v1/sandboxes`: the caller's live sandboxes as a JSON array (as
/// PandaStack's server answers; the SDK reads an array or `{"items"}`),
/// narrowed by `?metadata=key=value` (repeatable: every pair must match)
/// and `?state=` (or `status=`; comma-separated states, any may match).
pub async fn list(
    State(cp): St,
    Caller(account): Caller,
    RawQuery(query): RawQuery,
) -> ApiResult<Json<Value>> {
    let filter = ListFilter::parse(query.as_deref())?;
    let rows = cp.store.list_sandboxes(account.id).await?;
    let items: Vec<Value> = rows
        .iter()
        .filter(|r| r.status != status::CREATING && filter.admits(r))
        .map(sandbox_json)
        .collect();
    Ok(Json(Value::Array(items)))
}

/// What `GET /v1/sandboxes` was asked to narrow its list to.
#[derive(Debug, Default, PartialEq)]
struct ListFilter {
    metadata: Vec<(String, String)>,
    states: Vec<String>,
}

impl ListFilter {
    /// At most this many `metadata` pairs and states in one query.
    const MAX_TERMS: usize = 64;

    fn parse(query: Option<&str>) -> ApiResult<Self> {
        let mut filter = ListFilter::default();
        let pairs: Vec<(String, String)> = serde_urlencoded::from_str(query.unwrap_or(""))
            .map_err(|e| ApiError::bad_request(format!("bad query string: {e}")))?;
        for (name, value) in pairs {
            match name.as_str() {
                "metadata" => {
                    let (key, wanted) = value.split_once('=').ok_or_else(|| {
                        ApiError::bad_request(format!(
                            "metadata filter {value:?} must be key=value"
                        ))
                    })?;
                    filter.metadata.push((key.to_string(), wanted.to_string()));
                }
                "state" | "status" => filter.states.extend(
                    value
                        .split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(String::from),
                ),
                _ => {}
            }
        }
        if filter.metadata.len() + filter.states.len() > Self::MAX_TERMS {
            return Err(ApiError::bad_request(format!(
                "at most {} metadata and state filters",
                Self::MAX_TERMS
            )));
        }
        Ok(filter)
    }

    fn admits(&self, row: &SandboxRow) -> bool {
        (self.states.is_empty() || self.states.iter().any(|s| *s == row.status))
            && self
                .metadata
                .iter()
                .all(|(k, v)| row.metadata.get(k).is_some_and(|have| have == v))
    }
}

pub async fn get(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    Ok(Json(sandbox_json(
        &cp.owned_or_failed(&account, &id).await?,
    )))
}

fn failed_message(row: &SandboxRow) -> String {
    format!(
        "sandbox {} has failed: {}",
        row.id,
        row.status_reason.as_deref().unwrap_or("its VM ended")
    )
}

pub async fn delete(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    detached(delete_detached(cp, account, id)).await
}

async fn delete_detached(
    cp: Arc<ControlPlane>,
    account: Account,
    id: String,
) -> ApiResult<StatusCode> {
    let row = cp.owned_or_failed(&account, &id).await?;
    if row.status == status::FAILED {
        // Its VM is gone or going (the failure watcher kills it); the row
        // keeps `failed` and its reason, only leaving the GET.
        cp.host.kill(&id).await?;
        let patch = SandboxPatch {
            status: Some(status::DELETED.into()),
            if_status: Some(status::FAILED.into()),
            ..SandboxPatch::default()
        };
        cp.store.update_sandbox(&id, patch).await?;
        return Ok(StatusCode::NO_CONTENT);
    }
    cp.destroy(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct ForkBody {
    metadata: Option<Metadata>,
    count: Option<i64>,
}

/// Forks `parent` into `count` children admitted one by one (each is a
/// create for the quota); all or nothing.
async fn fork_children(
    cp: &ControlPlane,
    account: &Account,
    parent: &SandboxRow,
    count: usize,
    extra: Metadata,
    tree_id: Option<String>,
) -> ApiResult<Vec<SandboxRow>> {
    check_metadata(&extra)?;
    // Refused before any child is admitted (the engine refuses too).
    let info = cp.host.engine().get(&parent.id).await?;
    if !info.volumes.is_empty() {
        return Err(shoal_host::EngineError::HasVolumes(parent.id.clone()).into());
    }
    let slots = cp.reserve(count, info.memory_mib).await?;
    let mut metadata = parent.metadata.clone();
    metadata.extend(extra);
    metadata.insert("fork_parent_id".into(), parent.id.clone());
    if let Some(tree) = &tree_id {
        metadata.insert("fork_tree_id".into(), tree.clone());
    }
    let mut rows = Vec::new();
    for _ in 0..count {
        let new = NewSandbox {
            id: new_id(),
            template: parent.template.clone(),
            cpu: parent.cpu,
            memory_mb: parent.memory_mb,
            metadata: metadata.clone(),
            ttl_seconds: parent.ttl_seconds,
            persistent: false,
            max_lifetime_seconds: parent.max_lifetime_seconds,
            from_snapshot: None,
            parent_id: Some(parent.id.clone()),
            tree_id: tree_id.clone(),
            host: Some(cp.config.host_name.clone()),
        };
        match cp
            .store
            .admit_sandbox(account, &new, &cp.limits(account.tier), now())
            .await
        {
            Ok(row) => rows.push(row),
            Err(e) => {
                // Refused part-way: the children admitted so far never ran
                // and must not count as creates (all or nothing).
                let ids: Vec<String> = rows.iter().map(|r| r.id.clone()).collect();
                if let Err(withdrawn) = cp.store.withdraw_admissions(&ids).await {
                    tracing::error!(error = %withdrawn, "withdrawing a refused fork's children");
                    for row in &rows {
                        cp.mark_failed(&row.id).await;
                    }
                }
                return Err(e.into());
            }
        }
    }
    let ids = rows.iter().map(|r| r.id.clone()).collect();
    match cp.host.fork(&slots, &parent.id, ids).await {
        Ok(fork) => {
            for (row, info) in rows.iter_mut().zip(&fork.children) {
                cp.event(&row.id, "sandbox.forked", json!({ "parent": parent.id }));
                cp.came_up(row, info, "fork").await?;
            }
            let children: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
            cp.event(&parent.id, "sandbox.fork", json!({ "children": children }));
            Ok(rows)
        }
        Err(e) => {
            for row in &rows {
                cp.mark_failed(&row.id).await;
            }
            Err(failed_after_admission(e))
        }
    }
}

pub async fn fork(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    Body(body): Body<ForkBody>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    detached(fork_detached(cp, account, id, body)).await
}

async fn fork_detached(
    cp: Arc<ControlPlane>,
    account: Account,
    id: String,
    body: ForkBody,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let count = body.count.unwrap_or(1);
    if !(1..=MAX_FORK_TREE as i64).contains(&count) {
        return Err(ApiError::bad_request(format!(
            "count must be between 1 and {MAX_FORK_TREE}"
        )));
    }
    let parent = cp.running(&account, &id).await?;
    let children = fork_children(
        &cp,
        &account,
        &parent,
        count as usize,
        body.metadata.unwrap_or_default(),
        None,
    )
    .await?;
    Ok((StatusCode::CREATED, Json(fork_answer(&id, &children))))
}

/// What `POST .../fork` answers, read alike by PandaStack's clients and
/// the SDK: PandaStack's `{parent_id, children: [ids], at}`, the first
/// child as `sandbox` (what the SDK reads first) and as the object itself
/// (what Shoal answered before `count`), and every child's view.
fn fork_answer(parent_id: &str, children: &[SandboxRow]) -> Value {
    let mut answer = sandbox_json(&children[0]);
    answer["sandbox"] = sandbox_json(&children[0]);
    answer["parent_id"] = json!(parent_id);
    answer["children"] = children.iter().map(|c| json!(c.id)).collect();
    answer["sandboxes"] = children.iter().map(sandbox_json).collect();
    answer["at"] = json!(rfc3339(now()));
    answer
}

pub async fn fork_tree(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    Body(body): Body<ForkBody>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    detached(fork_tree_detached(cp, account, id, body)).await
}

async fn fork_tree_detached(
    cp: Arc<ControlPlane>,
    account: Account,
    id: String,
    body: ForkBody,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let count = body.count.unwrap_or(2);
    if !(1..=MAX_FORK_TREE as i64).contains(&count) {
        return Err(ApiError::bad_request(format!(
            "count must be between 1 and {MAX_FORK_TREE}"
        )));
    }
    let parent = cp.running(&account, &id).await?;
    let tree_id = format!("tree-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
    let children = fork_children(
        &cp,
        &account,
        &parent,
        count as usize,
        body.metadata.unwrap_or_default(),
        Some(tree_id.clone()),
    )
    .await?;
    let children: Vec<Value> = children.iter().map(sandbox_json).collect();
    Ok((
        StatusCode::CREATED,
        Json(json!({ "tree_id": tree_id, "parent_id": id, "children": children })),
    ))
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct PromoteBody {
    cleanup_siblings: bool,
    tree_id: Option<String>,
}

pub async fn promote(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    Body(body): Body<PromoteBody>,
) -> ApiResult<Json<Value>> {
    detached(promote_detached(cp, account, id, body)).await
}

async fn promote_detached(
    cp: Arc<ControlPlane>,
    account: Account,
    id: String,
    body: PromoteBody,
) -> ApiResult<Json<Value>> {
    let winner = cp.owned(&account, &id).await?;
    let tree = body.tree_id.clone().or_else(|| winner.tree_id.clone());
    let mut deleted = Vec::new();
    let mut failures = serde_json::Map::new();
    if body.cleanup_siblings {
        let Some(tree) = tree
            .clone()
            .filter(|t| winner.tree_id.as_deref() == Some(t.as_str()))
        else {
            return Err(ApiError::bad_request(
                "this sandbox is not a child of that fork tree",
            ));
        };
        for sibling in cp.store.list_sandboxes(account.id).await? {
            if sibling.id != winner.id && sibling.tree_id.as_deref() == Some(tree.as_str()) {
                match cp.destroy(&sibling.id).await {
                    Ok(_) => deleted.push(sibling.id),
                    Err(e) => {
                        failures.insert(sibling.id, Value::String(e.message));
                    }
                }
            }
        }
    }
    Ok(Json(
        json!({ "winner": id, "tree_id": tree, "deleted": deleted, "failures": failures }),
    ))
}

fn lifecycle_json(row: &SandboxRow, last_activity: f64) -> Value {
    let now = now();
    let idle = (now - last_activity).max(0.0);
    let expires = (!row.persistent && row.ttl_seconds > 0)
        .then(|| rfc3339(last_activity + row.ttl_seconds as f64));
    json!({
        "id": row.id,
        "ttl_seconds": row.ttl_seconds,
        "persistent": row.persistent,
        "idle_seconds": idle.floor() as i64,
        "status": row.status,
        "expires_at": expires,
        "max_lifetime_seconds": row.max_lifetime_seconds,
    })
}

pub async fn lifecycle(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let row = cp.owned(&account, &id).await?;
    Ok(Json(lifecycle_json(&row, now())))
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct LifecycleBody {
    /// `Some(None)`: an explicit `null`, the server's default again.
    #[serde(deserialize_with = "present")]
    ttl_seconds: Option<Option<i64>>,
    persistent: Option<bool>,
    max_lifetime_seconds: Option<i64>,
}

pub async fn set_lifecycle(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    Body(body): Body<LifecycleBody>,
) -> ApiResult<Json<Value>> {
    let ttl = match body.ttl_seconds {
        Some(None) => Some(DEFAULT_TTL_SECONDS),
        Some(Some(v)) => seconds("ttl_seconds", Some(v))?,
        None => None,
    };
    let max_lifetime = seconds("max_lifetime_seconds", body.max_lifetime_seconds)?;
    cp.owned(&account, &id).await?;
    let patch = SandboxPatch {
        ttl_seconds: ttl,
        persistent: body.persistent,
        max_lifetime_seconds: max_lifetime,
        ..SandboxPatch::default()
    };
    cp.store.update_sandbox(&id, patch).await?;
    let row = cp.owned(&account, &id).await?;
    cp.event(
        &id,
        "sandbox.lifecycle",
        json!({ "ttl_seconds": row.ttl_seconds, "persistent": row.persistent,
                "max_lifetime_seconds": row.max_lifetime_seconds }),
    );
    Ok(Json(lifecycle_json(&row, now())))
}

async fn transition(
    cp: &ControlPlane,
    account: &Account,
    id: &str,
    action: &str,
) -> ApiResult<Json<Value>> {
    let row = cp.owned(account, id).await?;
    let engine = cp.host.engine();
    let target = match (action, row.status.as_str()) {
        ("pause", "paused")
        | ("resume", "running")
        | ("hibernate", "hibernated")
        | ("wake", "running") => None,
        ("pause", "running") => Some(("paused", engine.pause(id).await.map_err(ApiError::from))),
        ("resume", "paused") => Some(("running", engine.resume(id).await.map_err(ApiError::from))),
        ("hibernate", "running") => Some((
            "hibernated",
            cp.host.hibernate(id).await.map_err(ApiError::from),
        )),
        ("wake", "hibernated") => Some((
            "running",
            cp.host.wake(id).await.map(|_| ()).map_err(ApiError::from),
        )),
        (_, state) => {
            return Err(ApiError::conflict(format!(
                "cannot {action} a sandbox that is {state}"
            )))
        }
    };
    if let Some((new_status, outcome)) = target {
        outcome?;
        let event = match action {
            "pause" => "sandbox.paused",
            "resume" => "sandbox.resumed",
            "hibernate" => "sandbox.hibernated",
            _ => "sandbox.woken",
        };
        cp.set_status(id, new_status, event).await?;
    }
    Ok(Json(sandbox_json(&cp.owned(account, id).await?)))
}

pub async fn pause(
    State(cp): St,
    Caller(a): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    detached(async move { transition(&cp, &a, &id, "pause").await }).await
}
pub async fn resume(
    State(cp): St,
    Caller(a): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    detached(async move { transition(&cp, &a, &id, "resume").await }).await
}
pub async fn hibernate(
    State(cp): St,
    Caller(a): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    detached(async move { transition(&cp, &a, &id, "hibernate").await }).await
}
pub async fn wake(
    State(cp): St,
    Caller(a): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    detached(async move { transition(&cp, &a, &id, "wake").await }).await
}

pub async fn snapshot(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    detached(snapshot_detached(cp, account, id)).await
}

async fn snapshot_detached(
    cp: Arc<ControlPlane>,
    account: Account,
    id: String,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let row = cp.take_snapshot(&account, &id).await?;
    cp.event(&id, "sandbox.snapshot", json!({ "snapshot_id": row.id }));
    Ok((
        StatusCode::CREATED,
        Json(crate::snapshots::snapshot_json(&row)),
    ))
}

impl ControlPlane {
    /// Captures the account's running sandbox `id` and records the
    /// snapshot under its quota; no record, no files. The record names the
    /// first-party template the memory image derives from (what a restore
    /// sizes the VM by), whatever template the sandbox was made from.
    pub(crate) async fn take_snapshot(
        &self,
        account: &Account,
        id: &str,
    ) -> ApiResult<SnapshotRow> {
        self.owned(account, id).await?;
        // Refused before the capture, which writes the sandbox's whole
        // memory; checked again, atomically, when the record is written.
        let limits = self.snapshot_limits(account.tier);
        self.store.check_snapshot_quota(account, &limits).await?;
        let row = self.running(account, id).await?;
        let snapshot = self.host.snapshot(id).await?;
        self.record_capture(account, &snapshot, Some(id), &row.template)
            .await
    }

    /// Records snapshot `snapshot`, just made on this host (from sandbox
    /// `sandbox`, or booted from a disk), as `account`'s; when the record
    /// cannot be written (a concurrent snapshot took the last place, or the
    /// database failed) its files are removed, so nothing is left unrecorded.
    pub(crate) async fn record_capture(
        &self,
        account: &Account,
        snapshot: &str,
        sandbox: Option<&str>,
        fallback_template: &str,
    ) -> ApiResult<SnapshotRow> {
        let limits = self.snapshot_limits(account.tier);
        let manifest = self.host.engine().snapshot_manifest(snapshot).ok();
        let record = SnapshotRow {
            id: snapshot.to_owned(),
            account_id: account.id,
            sandbox_id: sandbox.map(str::to_owned),
            template: manifest
                .as_ref()
                .map_or(fallback_template.to_owned(), |m| m.template.clone()),
            size_bytes: crate::snapshots::capture_bytes(self, snapshot, manifest.as_ref()),
            host: Some(self.config.host_name.clone()),
            created_at: now(),
            vcpus: manifest.as_ref().map(|m| i64::from(m.vcpus)),
            memory_mib: manifest.as_ref().map(|m| i64::from(m.memory_mib)),
        };
        if let Err(e) = self.store.record_snapshot(account, &record, &limits).await {
            if let Err(cleanup) = self.host.delete_snapshot(snapshot).await {
                tracing::warn!(snapshot, error = %cleanup, "removing an unrecorded snapshot");
            }
            return Err(e.into());
        }
        Ok(record)
    }
}
