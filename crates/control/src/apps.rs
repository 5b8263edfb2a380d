//! Apps: long-running services, each a command kept running in a persistent
//! sandbox of its own and reached through `/v1/apps/{id}/proxy/...`. An app
//! nobody has requested for `idle_seconds` is hibernated (its QEMU process
//! exits, its memory is freed) and woken by the next request.
//!
//! Owns: the `/v1/apps` routes, the app proxy (waking before forwarding,
//! through `proxy::to_guest`), and the reconciler, one loop per control
//! plane that drives each app of this host from the state in its row:
//!
//! - `deploying`: take a host slot and admit a persistent sandbox (a refusal
//!   for capacity, 503/507, or quota, 429, parks the app in
//!   `waiting_capacity`), restore it, start the command detached
//!   (`setsid`, output to [`LOG`]), wait until the port listens: `running`;
//!   the command exiting first or the port staying closed for
//!   `start_timeout` is `failed`, with the log's end in `last_error`.
//! - `running`: idle for `idle_seconds` → hibernate: `hibernated`. A sandbox
//!   gone (deleted, or lost to a restart) → `deploying` again.
//! - `hibernated`: left alone; a request wakes it (`waking` → `running`).
//! - `waiting_capacity`: at `next_attempt_at` the deploy or wake is tried
//!   again; each refusal doubles the wait (5 s, 10 s, ... at most 5 min).
//!
//! Every step on one app holds that app's lock (in this process: in a
//! fleet only the app's host drives it, and the front sends its requests
//! there), so the reconciler and requests never act on an app at once. A
//! step reads the row under the lock and writes the whole state back; a
//! state write never revives a deleted app.
//!
//! Does not touch: SQL (only through `shoal_store`), QEMU or the guest
//! (only through `shoal_host`).

use crate::error::{ApiError, ApiResult};
use crate::extract::{
    field, integer, json_object, required_string, string, string_map, Caller, MAX_JSON_BODY,
};
use crate::{now, proxy, rfc3339, ControlPlane};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;
use serde_json::{json, Map, Value};
use shoal_host::{CreateOptions, HostError, Source};
use shoal_proto::client::ExecRequest;
use shoal_store::{
    app_status, Account, AppConfig, AppConfigPatch, AppRow, AppState, Metadata, NewApp, NewSandbox,
    StoreError,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type St = State<Arc<ControlPlane>>;

pub const DEFAULT_IDLE_SECONDS: u64 = 300;
const MAX_IDLE_SECONDS: u64 = 30 * 86400;
const DEFAULT_TEMPLATE: &str = "code-interpreter";
/// The first wait after a refusal; each further refusal doubles it.
const BACKOFF_FIRST: f64 = 5.0;
const BACKOFF_MAX: f64 = 300.0;
/// The start command's stdout and stderr, in the guest.
pub const LOG: &str = "/var/log/shoal-app.log";
/// The start command's pid, in the guest.
const PID_FILE: &str = "/run/shoal-app.pid";
/// What of the log `last_error` shows (its end).
const LOG_TAIL_BYTES: usize = 2000;
/// How often a starting app's port is looked at.
const START_POLL: Duration = Duration::from_millis(250);
/// Fields of the SDK's git-driven apps that Shoal has no use for.
const GIT_FIELDS: [&str; 6] = [
    "git_url",
    "git_branch",
    "framework",
    "install_command",
    "build_command",
    "root_directory",
];

/// How the reconciler runs.
#[derive(Debug, Clone)]
pub struct AppsConfig {
    /// How often every app of this host is looked at.
    pub reconcile_interval: Duration,
    /// How long a started command has to listen on its port.
    pub start_timeout: Duration,
    /// How long a proxied request waits for its app to wake or deploy.
    pub request_wait: Duration,
}

impl Default for AppsConfig {
    fn default() -> Self {
        AppsConfig {
            reconcile_interval: Duration::from_secs(1),
            start_timeout: Duration::from_secs(60),
            request_wait: Duration::from_secs(30),
        }
    }
}

/// What the control plane keeps in memory about apps.
#[derive(Default)]
pub struct Apps {
    /// One lock per app: whoever acts on an app holds it.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Proxied requests not yet written out, by app.
    requests: Mutex<HashMap<String, f64>>,
    /// Wakes the reconciler before its next tick.
    kick: tokio::sync::Notify,
}

impl Apps {
    fn lock_of(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks
            .lock()
            .unwrap()
            .entry(id.to_string())
            .or_default()
            .clone()
    }

    fn note_request(&self, id: &str) {
        self.requests.lock().unwrap().insert(id.to_string(), now());
    }

    fn last_request(&self, id: &str) -> Option<f64> {
        self.requests.lock().unwrap().get(id).copied()
    }
}

/// Wait before attempt `attempts + 1`, after `attempts` refusals.
pub fn backoff_seconds(attempts: u32) -> f64 {
    let doublings = attempts.saturating_sub(1).min(16);
    (BACKOFF_FIRST * f64::from(1u32 << doublings)).min(BACKOFF_MAX)
}

fn not_found() -> ApiError {
    ApiError::not_found("app not found")
}

fn new_id() -> String {
    format!("app-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

/// The app's proxy URL: on the address the caller used (the front passes
/// its own as `X-Forwarded-Host`).
fn proxy_url(headers: &HeaderMap, id: &str) -> String {
    let path = format!("/v1/apps/{id}/proxy/");
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    match header("x-forwarded-host").or_else(|| header("host")) {
        Some(host) => {
            let scheme = header("x-forwarded-proto").unwrap_or("http");
            format!("{scheme}://{host}{path}")
        }
        None => path,
    }
}

/// The AppInfo JSON of CONTRACT.md.
fn app_json(app: &AppRow, headers: &HeaderMap, last_request: Option<f64>) -> Value {
    let state = &app.state;
    let last_request = match (app.last_request_at, last_request) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    let next_attempt = (state.status == app_status::WAITING_CAPACITY)
        .then_some(state.next_attempt_at)
        .flatten();
    json!({
        "id": app.id,
        "name": app.name,
        "template": app.config.template,
        "start_cmd": app.config.start_cmd,
        "start_command": app.config.start_cmd,
        "port": app.config.port,
        "env": app.config.env,
        "idle_seconds": app.config.idle_seconds,
        "status": state.status,
        "sandbox_id": state.sandbox_id,
        "url": proxy_url(headers, &app.id),
        "last_error": state.last_error,
        "attempts": state.attempts,
        "next_attempt_at": next_attempt.map(rfc3339),
        "created_at": rfc3339(app.created_at),
        "status_changed_at": rfc3339(app.status_at),
        "last_request_at": last_request.map(rfc3339),
    })
}

// ---- the routes ----

/// Refuses the SDK's git-driven fields and sizes, which Shoal does not have.
fn refuse_unsupported(body: &Map<String, Value>) -> ApiResult<()> {
    if let Some(name) = GIT_FIELDS.iter().find(|f| field(body, f).is_some()) {
        return Err(ApiError::bad_request(format!(
            "{name} is not supported: Shoal apps are not built from git; give start_cmd \
             (run in a sandbox of template), port and env"
        )));
    }
    if let Some(name) = ["cpu", "memory_mb"]
        .iter()
        .find(|f| field(body, f).is_some())
    {
        return Err(ApiError::bad_request(format!(
            "{name} is not supported: an app's sandbox has its template's size"
        )));
    }
    Ok(())
}

/// `start_cmd`, or the SDK's `start_command`; required or not.
fn start_cmd(body: &Map<String, Value>, required: bool) -> ApiResult<Option<String>> {
    let (a, b) = (string(body, "start_cmd")?, string(body, "start_command")?);
    let cmd =
        match (a, b) {
            (Some(a), Some(b)) if a != b => return Err(ApiError::bad_request(
                "start_cmd and start_command differ (start_command is another name for start_cmd)",
            )),
            (a, b) => a.or(b),
        };
    match cmd {
        Some(c) if !c.trim().is_empty() => Ok(Some(c)),
        None if !required => Ok(None),
        _ => Err(ApiError::bad_request(
            "start_cmd is required (a non-empty string)",
        )),
    }
}

fn port(body: &Map<String, Value>, required: bool) -> ApiResult<Option<u16>> {
    let port = integer(body, "port", 1, 65535)?.map(|p| p as u16);
    if required && port.is_none() {
        return Err(ApiError::bad_request(
            "port is required (an integer from 1 to 65535)",
        ));
    }
    Ok(port)
}

fn template(cp: &ControlPlane, body: &Map<String, Value>) -> ApiResult<Option<String>> {
    string(body, "template")?
        .map(|name| known_template(cp, name))
        .transpose()
}

fn known_template(cp: &ControlPlane, name: String) -> ApiResult<String> {
    if !crate::sandboxes::valid_template_name(&name) || cp.host.engine().template(&name).is_err() {
        return Err(ApiError::bad_request(format!("unknown template: {name}")));
    }
    Ok(name)
}

fn env(body: &Map<String, Value>) -> ApiResult<Option<Metadata>> {
    if field(body, "env").is_none() {
        return Ok(None);
    }
    let env = string_map(body, "env")?;
    if let Some(bad) = env.keys().find(|k| !valid_env_name(k)) {
        return Err(ApiError::bad_request(format!(
            "env: {bad:?} is not a variable name (letters, digits and _, not starting with a digit)"
        )));
    }
    Ok(Some(env))
}

fn valid_env_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn idle_seconds(body: &Map<String, Value>) -> ApiResult<Option<u64>> {
    integer(body, "idle_seconds", 0, MAX_IDLE_SECONDS)
}

pub async fn create(
    State(cp): St,
    Caller(account): Caller,
    request: Request,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let headers = request.headers().clone();
    let body = json_object(request, MAX_JSON_BODY).await?;
    refuse_unsupported(&body)?;
    let name = required_string(&body, "name")?;
    if !crate::sandboxes::valid_template_name(&name) {
        return Err(ApiError::bad_request(
            "name must be 1-63 characters of a-z, 0-9 and -",
        ));
    }
    let config = AppConfig {
        start_cmd: start_cmd(&body, true)?.unwrap_or_default(),
        port: port(&body, true)?.unwrap_or_default(),
        template: match template(&cp, &body)? {
            Some(name) => name,
            None => known_template(&cp, DEFAULT_TEMPLATE.into())?,
        },
        env: env(&body)?.unwrap_or_default(),
        idle_seconds: idle_seconds(&body)?.unwrap_or(DEFAULT_IDLE_SECONDS),
    };
    let new = NewApp {
        id: new_id(),
        name,
        config,
        host: Some(cp.config.host_name.clone()),
    };
    let app = cp
        .store
        .insert_app(account.id, &new, now())
        .await
        .map_err(|e| match e {
            StoreError::AlreadyExists { id, .. } => {
                ApiError::conflict(format!("an app named {id} already exists"))
            }
            other => other.into(),
        })?;
    tokio::spawn(drive(cp.clone(), app.id.clone()));
    Ok((StatusCode::CREATED, Json(app_json(&app, &headers, None))))
}

pub async fn list(
    State(cp): St,
    Caller(account): Caller,
    headers: HeaderMap,
) -> ApiResult<Json<Value>> {
    let items: Vec<Value> = cp
        .store
        .list_apps(account.id)
        .await?
        .iter()
        .map(|app| app_json(app, &headers, cp.apps.last_request(&app.id)))
        .collect();
    Ok(Json(json!({ "items": items })))
}

impl ControlPlane {
    /// The caller's app `id` (not deleted), or 404.
    async fn owned_app(&self, account: &Account, id: &str) -> ApiResult<AppRow> {
        match self.store.get_app(account.id, id).await? {
            Some(app) if app.state.status != app_status::DELETED => Ok(app),
            _ => Err(not_found()),
        }
    }
}

pub async fn get(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> ApiResult<Json<Value>> {
    let app = cp.owned_app(&account, &id).await?;
    Ok(Json(app_json(&app, &headers, cp.apps.last_request(&id))))
}

/// Changes the app's configuration; giving any of `template`, `start_cmd`,
/// `port` or `env` redeploys it (a failed app too).
pub async fn patch(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    request: Request,
) -> ApiResult<Json<Value>> {
    let headers = request.headers().clone();
    let body = json_object(request, MAX_JSON_BODY).await?;
    refuse_unsupported(&body)?;
    if field(&body, "name").is_some() {
        return Err(ApiError::bad_request("an app's name cannot change"));
    }
    let patch = AppConfigPatch {
        template: template(&cp, &body)?,
        start_cmd: start_cmd(&body, false)?,
        port: port(&body, false)?,
        env: env(&body)?,
        idle_seconds: idle_seconds(&body)?,
    };
    let redeploy = patch.template.is_some()
        || patch.start_cmd.is_some()
        || patch.port.is_some()
        || patch.env.is_some();
    crate::sandboxes::detached(async move {
        cp.owned_app(&account, &id).await?;
        // A deploy under way finishes first, so it cannot write `running`
        // over the redeploy asked for here.
        let lock = cp.apps.lock_of(&id);
        let _guard = lock.lock().await;
        if !cp.store.set_app_config(&id, &patch).await? {
            return Err(not_found());
        }
        if redeploy {
            let app = cp.owned_app(&account, &id).await?;
            let state = AppState {
                status: app_status::DEPLOYING.into(),
                sandbox_id: app.state.sandbox_id,
                ..AppState::default()
            };
            cp.store.set_app_state(&id, &state, now()).await?;
            cp.apps.kick.notify_one();
        }
        let app = cp.owned_app(&account, &id).await?;
        Ok(Json(app_json(&app, &headers, cp.apps.last_request(&id))))
    })
    .await
}

/// Marks the app deleted (its name is free at once), then stops its
/// sandbox once no step is acting on it.
pub async fn delete(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    crate::sandboxes::detached(async move {
        cp.owned_app(&account, &id).await?;
        if !cp.store.delete_app(account.id, &id, now()).await? {
            return Err(not_found());
        }
        let lock = cp.apps.lock_of(&id);
        {
            // A deploy under way sees the deletion at its next look and
            // stops; then the sandbox it recorded is stopped here.
            let _guard = lock.lock().await;
            if let Some(app) = cp.store.app_by_id(&id).await? {
                stop_sandbox(&cp, app.state.sandbox_id.as_deref()).await;
            }
        }
        cp.apps.locks.lock().unwrap().remove(&id);
        cp.apps.requests.lock().unwrap().remove(&id);
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}

pub async fn proxy_root(
    state: St,
    caller: Caller,
    Path(id): Path<String>,
    request: Request,
) -> ApiResult<Response> {
    forward(state, caller, id, String::new(), request).await
}

pub async fn proxy_path(
    state: St,
    caller: Caller,
    Path((id, path)): Path<(String, String)>,
    request: Request,
) -> ApiResult<Response> {
    forward(state, caller, id, path, request).await
}

/// Forwards a request to the app's port, waking or waiting for it first.
async fn forward(
    State(cp): St,
    Caller(account): Caller,
    id: String,
    path: String,
    request: Request,
) -> ApiResult<Response> {
    cp.owned_app(&account, &id).await?;
    // Noted before looking at the status, so the reconciler does not
    // hibernate the app between here and the forward.
    cp.apps.note_request(&id);
    let (sandbox, port) = ready(&cp, &id).await?;
    let response = proxy::to_guest(&cp, &sandbox, port, &path, request).await;
    cp.apps.note_request(&id);
    response
}

/// The app's running sandbox and port: a hibernated app is woken, a
/// deploying or waking one waited for (at most `request_wait`).
async fn ready(cp: &Arc<ControlPlane>, id: &str) -> ApiResult<(String, u16)> {
    let deadline = Instant::now() + cp.config.apps.request_wait;
    let not_ready = |status: &str| ApiError {
        retry_after: Some(5),
        ..ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("app is not ready yet ({status})"),
        )
    };
    loop {
        let app = cp.store.app_by_id(id).await?.ok_or_else(not_found)?;
        let state = &app.state;
        match state.status.as_str() {
            app_status::RUNNING => {
                if let Some(sandbox) = &state.sandbox_id {
                    return Ok((sandbox.clone(), app.config.port));
                }
            }
            app_status::WAITING_CAPACITY => return Err(waiting_capacity(state)),
            app_status::FAILED => {
                return Err(ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    format!(
                        "app failed: {}",
                        state.last_error.as_deref().unwrap_or("unknown error")
                    ),
                ))
            }
            app_status::DELETED => return Err(not_found()),
            app_status::HIBERNATED | app_status::WAKING => {
                let lock = cp.apps.lock_of(id);
                let remaining = deadline.saturating_duration_since(Instant::now());
                let Ok(_guard) = tokio::time::timeout(remaining, lock.lock_owned()).await else {
                    return Err(not_ready(&state.status));
                };
                let app = cp.store.app_by_id(id).await?.ok_or_else(not_found)?;
                if matches!(
                    app.state.status.as_str(),
                    app_status::HIBERNATED | app_status::WAKING
                ) {
                    wake(cp, &app).await;
                }
                continue;
            }
            // Deploying: the reconciler is at it.
            _ => {}
        }
        if Instant::now() >= deadline {
            return Err(not_ready(&state.status));
        }
        tokio::time::sleep(START_POLL).await;
    }
}

/// 503 for an app parked in `waiting_capacity`, retry at its next attempt.
fn waiting_capacity(state: &AppState) -> ApiError {
    let wait = state
        .next_attempt_at
        .map_or(BACKOFF_FIRST, |at| (at - now()).max(1.0));
    ApiError {
        retry_after: Some(wait.ceil() as u32),
        ..ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "app is waiting for capacity: {}",
                state.last_error.as_deref().unwrap_or("no compute capacity")
            ),
        )
    }
}

// ---- the reconciler ----

/// Starts the reconciler: every `reconcile_interval` (or when kicked),
/// writes out proxied-request times and drives every app of this host.
pub fn spawn(cp: Arc<ControlPlane>) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(cp.config.apps.reconcile_interval) => {}
                _ = cp.apps.kick.notified() => {}
            }
            reconcile(&cp).await;
        }
    });
}

async fn reconcile(cp: &Arc<ControlPlane>) {
    let requests: Vec<(String, f64)> = cp
        .apps
        .requests
        .lock()
        .unwrap()
        .iter()
        .map(|(id, at)| (id.clone(), *at))
        .collect();
    for (id, at) in requests {
        if let Err(e) = cp.store.touch_app(&id, at).await {
            tracing::warn!(id, error = %e, "recording an app's last request");
        }
    }
    let apps = match cp.store.apps_of_host(&cp.config.host_name).await {
        Ok(apps) => apps,
        Err(e) => {
            tracing::warn!(error = e.chain(), "listing apps");
            return;
        }
    };
    for app in apps {
        // One task per app: a deploy takes seconds, and must not hold up
        // the others. An app some step is acting on is skipped.
        tokio::spawn(drive(cp.clone(), app.id));
    }
}

/// One step of one app, if no other step is acting on it.
async fn drive(cp: Arc<ControlPlane>, id: String) {
    let lock = cp.apps.lock_of(&id);
    let Ok(_guard) = lock.try_lock() else {
        return;
    };
    let app = match cp.store.app_by_id(&id).await {
        Ok(Some(app)) => app,
        Ok(None) => return,
        Err(e) => {
            tracing::warn!(id, error = %e, "reading an app");
            return;
        }
    };
    let status = app.state.status.as_str();
    let due = app.state.next_attempt_at.is_none_or(|at| now() >= at);
    match status {
        app_status::DEPLOYING => deploy(&cp, &app).await,
        app_status::WAITING_CAPACITY if due => {
            if sandbox_status(&cp, &app).await.as_deref() == Some("hibernated") {
                wake(&cp, &app).await;
            } else {
                deploy(&cp, &app).await;
            }
        }
        // A wake interrupted by a restart.
        app_status::WAKING => wake(&cp, &app).await,
        app_status::RUNNING | app_status::HIBERNATED => follow_sandbox(&cp, &app).await,
        _ => {}
    }
}

/// The status of the app's sandbox row, if it has one that is live.
async fn sandbox_status(cp: &ControlPlane, app: &AppRow) -> Option<String> {
    let id = app.state.sandbox_id.as_deref()?;
    match cp.store.sandbox_by_id(id).await {
        Ok(Some(row)) if row.is_live() => Some(row.status),
        _ => None,
    }
}

/// Writes `state`, logging a failure (a step's write is retried by the
/// next tick, which reads the row again).
async fn set_state(cp: &ControlPlane, app: &AppRow, state: AppState) -> bool {
    match cp.store.set_app_state(&app.id, &state, now()).await {
        Ok(written) => written,
        Err(e) => {
            tracing::warn!(id = app.id, error = %e, "writing an app's state");
            false
        }
    }
}

/// Parks the app until its next attempt, after a refusal for capacity or
/// quota.
async fn park(cp: &ControlPlane, app: &AppRow, sandbox_id: Option<String>, reason: String) {
    let attempts = app.state.attempts + 1;
    let wait = backoff_seconds(attempts);
    tracing::info!(
        id = app.id,
        attempts,
        wait,
        reason,
        "app waits for capacity"
    );
    let state = AppState {
        status: app_status::WAITING_CAPACITY.into(),
        sandbox_id,
        attempts,
        next_attempt_at: Some(now() + wait),
        last_error: Some(reason),
    };
    set_state(cp, app, state).await;
}

async fn fail(cp: &ControlPlane, app: &AppRow, sandbox_id: Option<String>, reason: String) {
    tracing::info!(id = app.id, reason, "app failed");
    let state = AppState {
        status: app_status::FAILED.into(),
        sandbox_id,
        attempts: 0,
        next_attempt_at: None,
        last_error: Some(reason),
    };
    set_state(cp, app, state).await;
}

/// Stops the app's sandbox if it is live.
async fn stop_sandbox(cp: &ControlPlane, sandbox: Option<&str>) {
    let Some(id) = sandbox else { return };
    if let Ok(Some(row)) = cp.store.sandbox_by_id(id).await {
        if row.is_live() {
            if let Err(e) = cp.destroy(id).await {
                tracing::warn!(id, error = e.message, "stopping an app's sandbox");
            }
        }
    }
}

/// Whether the host refused for lack of room (the SDK would retry).
fn is_capacity(e: &HostError) -> bool {
    matches!(
        e,
        HostError::Full | HostError::MemoryShort { .. } | HostError::Overcommitted { .. }
    )
}

/// Makes the app's sandbox, starts its command and waits for its port.
async fn deploy(cp: &Arc<ControlPlane>, app: &AppRow) {
    // What an earlier attempt left (a restart mid-deploy, or a redeploy).
    stop_sandbox(cp, app.state.sandbox_id.as_deref()).await;
    let template = &app.config.template;
    let manifest = match cp.host.engine().template(template) {
        Ok(m) => m,
        Err(e) => {
            return fail(cp, app, None, format!("template {template}: {e}")).await;
        }
    };
    let slot = match cp.reserve(1, manifest.memory_mib).await {
        Ok(slot) => slot,
        Err(e) if is_capacity(&e) => return park(cp, app, None, e.to_string()).await,
        Err(e) => return fail(cp, app, None, e.to_string()).await,
    };
    let Ok(Some(account)) = cp.store.account_by_id(app.account_id).await else {
        tracing::warn!(id = app.id, "reading an app's account");
        return;
    };
    let new = NewSandbox {
        id: crate::sandboxes::new_id(),
        template: template.clone(),
        cpu: manifest.vcpus,
        memory_mb: manifest.memory_mib,
        metadata: [
            ("app_id".to_string(), app.id.clone()),
            ("app_name".to_string(), app.name.clone()),
        ]
        .into(),
        ttl_seconds: crate::sandboxes::DEFAULT_TTL_SECONDS,
        persistent: true,
        max_lifetime_seconds: None,
        from_snapshot: None,
        parent_id: None,
        tree_id: None,
        host: Some(cp.config.host_name.clone()),
    };
    let limits = cp.limits(account.tier);
    let mut row = match cp.store.admit_sandbox(&account, &new, &limits, now()).await {
        Ok(row) => row,
        Err(StoreError::Quota { message }) => {
            return park(cp, app, None, format!("quota exceeded: the {message}")).await;
        }
        Err(e) => {
            tracing::warn!(id = app.id, error = %e, "admitting an app's sandbox");
            return;
        }
    };
    // Recorded before the VM exists, so a delete from now on stops it.
    let deploying = AppState {
        status: app_status::DEPLOYING.into(),
        sandbox_id: Some(row.id.clone()),
        ..app.state.clone()
    };
    if !set_state(cp, app, deploying).await {
        cp.mark_failed(&row.id).await;
        return;
    }
    let sandbox = Some(row.id.clone());
    let info = match cp
        .host
        .create(
            &slot,
            &row.id,
            &Source::Template(template.clone()),
            CreateOptions::default(),
        )
        .await
    {
        Ok(info) => info,
        Err(e) => {
            cp.mark_failed(&row.id).await;
            let reason = format!("creating its sandbox: {}", ApiError::from(e).message);
            return fail(cp, app, sandbox, reason).await;
        }
    };
    drop(slot);
    if let Err(e) = cp.came_up(&mut row, &info, "restore").await {
        tracing::warn!(id = app.id, error = e.message, "recording an app's sandbox");
    }
    match start(cp, app, &row.id).await {
        Ok(()) => {
            let running = AppState {
                status: app_status::RUNNING.into(),
                sandbox_id: sandbox,
                ..AppState::default()
            };
            if !set_state(cp, app, running).await {
                stop_sandbox(cp, Some(&row.id)).await;
            }
        }
        Err(Started::Deleted) => stop_sandbox(cp, Some(&row.id)).await,
        Err(Started::Failed(reason)) => {
            stop_sandbox(cp, Some(&row.id)).await;
            fail(cp, app, sandbox, reason).await;
        }
    }
}

enum Started {
    /// The app was deleted while it started.
    Deleted,
    Failed(String),
}

/// Starts the command detached in sandbox `id` and waits until its port
/// listens. The agent does not wait for (or kill) what an exec leaves in
/// the background; `setsid` also takes the command out of the exec's
/// process group. The command reaches the shell in a variable, so it needs
/// no quoting, and the variable is dropped before the command runs.
async fn start(cp: &ControlPlane, app: &AppRow, id: &str) -> Result<(), Started> {
    let failed = |what: &str, e: &dyn std::fmt::Display| Started::Failed(format!("{what}: {e}"));
    let agent = cp
        .host
        .engine()
        .agent(id)
        .await
        .map_err(|e| failed("reaching its sandbox", &e))?;
    let mut request = ExecRequest::new(format!(
        "setsid env -u SHOAL_APP_CMD sh -c \"$SHOAL_APP_CMD\" >{LOG} 2>&1 </dev/null & echo $! >{PID_FILE}"
    ));
    request.env = app.config.env.clone();
    request
        .env
        .insert("SHOAL_APP_CMD".into(), app.config.start_cmd.clone());
    request.timeout = Some(Duration::from_secs(30));
    let out = agent
        .exec_collect(request)
        .await
        .map_err(|e| failed("starting the command", &e))?;
    if out.status.code != Some(0) {
        return Err(Started::Failed(format!(
            "starting the command: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let port = app.config.port;
    let deadline = Instant::now() + cp.config.apps.start_timeout;
    let look = format!(
        "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null; \
         kill -0 \"$(cat {PID_FILE})\" 2>/dev/null && echo shoal-app-alive"
    );
    loop {
        let out = agent
            .exec_collect(ExecRequest::new(look.clone()))
            .await
            .map_err(|e| failed("looking at its port", &e))?;
        let text = String::from_utf8_lossy(&out.stdout);
        if crate::meta::listening_ports(&text).contains(&port) {
            return Ok(());
        }
        let reason = if !text.contains("shoal-app-alive") {
            Some(format!(
                "the start command exited before port {port} listened"
            ))
        } else if Instant::now() >= deadline {
            Some(format!(
                "port {port} did not listen within {} s of the start",
                cp.config.apps.start_timeout.as_secs()
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            let tail = agent
                .exec_collect(ExecRequest::new(format!("tail -c {LOG_TAIL_BYTES} {LOG}")))
                .await
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            return Err(Started::Failed(format!("{reason}; {LOG} ends:\n{tail}")));
        }
        match cp.store.app_by_id(&app.id).await {
            Ok(Some(now)) if now.state.status == app_status::DELETED => {
                return Err(Started::Deleted)
            }
            _ => {}
        }
        tokio::time::sleep(START_POLL).await;
    }
}

/// Wakes the app's hibernated sandbox; a capacity refusal parks the app.
async fn wake(cp: &Arc<ControlPlane>, app: &AppRow) {
    let Some(sandbox) = app.state.sandbox_id.clone() else {
        return redeploy(cp, app).await;
    };
    match sandbox_status(cp, app).await.as_deref() {
        Some("hibernated") => {}
        Some("running") => return now_running(cp, app, sandbox).await,
        // Gone (deleted, or lost to a restart): start afresh.
        _ => return redeploy(cp, app).await,
    }
    let waking = AppState {
        status: app_status::WAKING.into(),
        ..app.state.clone()
    };
    if !set_state(cp, app, waking).await {
        return;
    }
    match cp.host.wake(&sandbox).await {
        Ok(_) => {
            if let Err(e) = cp.set_status(&sandbox, "running", "sandbox.woken").await {
                tracing::warn!(id = app.id, error = e.message, "recording a woken sandbox");
            }
            now_running(cp, app, sandbox).await;
        }
        Err(e) if is_capacity(&e) => park(cp, app, Some(sandbox), e.to_string()).await,
        Err(e) => {
            let reason = format!("waking its sandbox: {}", ApiError::from(e).message);
            fail(cp, app, Some(sandbox), reason).await;
        }
    }
}

async fn now_running(cp: &ControlPlane, app: &AppRow, sandbox: String) {
    let running = AppState {
        status: app_status::RUNNING.into(),
        sandbox_id: Some(sandbox),
        attempts: 0,
        next_attempt_at: None,
        last_error: app.state.last_error.clone(),
    };
    set_state(cp, app, running).await;
}

async fn redeploy(cp: &Arc<ControlPlane>, app: &AppRow) {
    let deploying = AppState {
        status: app_status::DEPLOYING.into(),
        ..app.state.clone()
    };
    if set_state(cp, app, deploying.clone()).await {
        let app = AppRow {
            state: deploying,
            ..app.clone()
        };
        deploy(cp, &app).await;
    }
}

/// A running or hibernated app follows its sandbox: idle → hibernated;
/// gone → redeployed (running) or left for the next request (hibernated);
/// woken or hibernated through the sandbox routes → the same status.
async fn follow_sandbox(cp: &Arc<ControlPlane>, app: &AppRow) {
    let sandbox = app.state.sandbox_id.clone();
    match (
        app.state.status.as_str(),
        sandbox_status(cp, app).await.as_deref(),
    ) {
        (app_status::RUNNING, Some("running")) if is_idle(cp, app) => hibernate(cp, app).await,
        (app_status::RUNNING, Some("running")) => {}
        (app_status::RUNNING, Some("hibernated")) => {
            let state = AppState {
                status: app_status::HIBERNATED.into(),
                ..app.state.clone()
            };
            set_state(cp, app, state).await;
        }
        (app_status::RUNNING, None) => {
            tracing::info!(id = app.id, "an app's sandbox is gone: redeploying");
            redeploy(cp, app).await;
        }
        (app_status::HIBERNATED, Some("running")) => {
            if let Some(sandbox) = sandbox {
                now_running(cp, app, sandbox).await;
            }
        }
        _ => {}
    }
}

/// No proxied request (nor the start or wake) for `idle_seconds`; never
/// with `idle_seconds` 0.
fn is_idle(cp: &ControlPlane, app: &AppRow) -> bool {
    let idle = app.config.idle_seconds;
    if idle == 0 {
        return false;
    }
    let last = [
        Some(app.status_at),
        app.last_request_at,
        cp.apps.last_request(&app.id),
    ]
    .into_iter()
    .flatten()
    .fold(f64::MIN, f64::max);
    now() - last >= idle as f64
}

async fn hibernate(cp: &ControlPlane, app: &AppRow) {
    let Some(sandbox) = app.state.sandbox_id.clone() else {
        return;
    };
    tracing::info!(id = app.id, sandbox, "hibernating an idle app");
    if let Err(e) = cp.host.hibernate(&sandbox).await {
        tracing::warn!(id = app.id, error = %e, "hibernating an app");
        return;
    }
    if let Err(e) = cp
        .set_status(&sandbox, "hibernated", "sandbox.hibernated")
        .await
    {
        tracing::warn!(
            id = app.id,
            error = e.message,
            "recording a hibernated sandbox"
        );
    }
    let state = AppState {
        status: app_status::HIBERNATED.into(),
        ..app.state.clone()
    };
    set_state(cp, app, state).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_five_seconds_up_to_five_minutes() {
        let waits: Vec<f64> = (1..=8).map(backoff_seconds).collect();
        assert_eq!(waits, [5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0]);
        assert_eq!(backoff_seconds(u32::MAX), 300.0);
    }

    #[test]
    fn env_names_are_shell_variable_names() {
        assert!(valid_env_name("GREETING"));
        assert!(valid_env_name("_x1"));
        assert!(!valid_env_name("1X"));
        assert!(!valid_env_name("A-B"));
        assert!(!valid_env_name(""));
    }

    #[test]
    fn git_fields_are_refused_by_name() {
        let body = Map::from_iter([("git_url".to_string(), json!("https://x/y"))]);
        let e = refuse_unsupported(&body).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.message.starts_with("git_url is not supported"),
            "{}",
            e.message
        );
        let null = Map::from_iter([("git_url".to_string(), Value::Null)]);
        assert!(refuse_unsupported(&null).is_ok());
    }

    #[test]
    fn the_proxy_url_is_on_the_callers_address() {
        let mut headers = HeaderMap::new();
        assert_eq!(proxy_url(&headers, "app-1"), "/v1/apps/app-1/proxy/");
        headers.insert("host", "agent:7070".parse().unwrap());
        assert_eq!(
            proxy_url(&headers, "app-1"),
            "http://agent:7070/v1/apps/app-1/proxy/"
        );
        headers.insert("x-forwarded-host", "api.example".parse().unwrap());
        headers.insert("x-forwarded-proto", "https".parse().unwrap());
        assert_eq!(
            proxy_url(&headers, "app-1"),
            "https://api.example/v1/apps/app-1/proxy/"
        );
    }
}
