//! The control plane: PandaStack's HTTP API over one host agent, with
//! accounts, tokens, tier quotas, the idle reaper, metering, the sweep
//! runner, and apps (long-running services, `apps.rs`).
//!
//! Owns: the routes (see `docs/api/CONTRACT.md` and `docs/api/SWEEPS.md`,
//! served as `docs/api/openapi.json`), authentication and tenancy (a token
//! sees only its own account's objects; anything else is a 404), quota
//! admission through the store, volumes (`volumes.rs`: rows through the
//! store, images through the host agent), the background lifecycle and
//! metering loops, and the runner that runs sweep cells (`runner.rs`).
//!
//! Does not touch: QEMU or the guest directly (only through
//! [`shoal_host::HostAgent`]), or SQL (only through [`shoal_store::Store`]).

mod apps;
mod blobs;
mod build_layers;
mod builds;
mod error;
mod events;
mod exec;
mod extract;
mod files;
mod imports;
mod job_data;
mod lifecycle;
mod meta;
pub mod metrics;
mod proxy;
pub mod readiness;
pub mod registry;
mod repl;
mod runner;
mod sandboxes;
mod snapshots;
mod sweeps;
mod templates;
mod tokens;
mod usage;
mod volumes;

pub use apps::AppsConfig;
pub use error::{ApiError, ApiResult};
pub use lifecycle::LifecycleConfig;
pub use runner::RunnerConfig;

use axum::routing::{any, get, post};
use axum::Router;
use shoal_host::HostAgent;
use shoal_store::{Account, SnapshotLimits, Store, Tier, TierLimits, VolumeLimits};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The OpenAPI document, served as is and held to the router by a test.
pub const OPENAPI: &str = include_str!("../../../docs/api/openapi.json");

/// Settings of one control plane.
#[derive(Debug, Clone)]
pub struct ControlConfig {
    /// Name of the host its sandboxes run on (recorded in their rows).
    pub host_name: String,
    /// On a fleet's agent, the header in which fronts name the caller's
    /// account (`shoal_fleet::ACCOUNT_HEADER`): the front checked the token
    /// and only fronts reach an agent, so the host never reads the token
    /// table, which its database role may not. `None`: the bearer token.
    pub account_header: Option<&'static str>,
    pub limits: HashMap<Tier, TierLimits>,
    pub volume_limits: HashMap<Tier, VolumeLimits>,
    pub snapshot_limits: HashMap<Tier, SnapshotLimits>,
    pub lifecycle: LifecycleConfig,
    pub sweeps: RunnerConfig,
    pub apps: AppsConfig,
    /// The registries template imports may pull from (`shoal up
    /// --registry`); none by default.
    pub registries: Vec<registry::Registry>,
    /// The bearer token `/metrics` asks for; `None`: loopback peers only.
    pub metrics_token: Option<String>,
}

impl Default for ControlConfig {
    fn default() -> Self {
        ControlConfig {
            host_name: "local".into(),
            account_header: None,
            limits: [Tier::Free, Tier::Pro, Tier::Team]
                .into_iter()
                .map(|t| (t, TierLimits::default_for(t)))
                .collect(),
            volume_limits: [Tier::Free, Tier::Pro, Tier::Team]
                .into_iter()
                .map(|t| (t, VolumeLimits::default_for(t)))
                .collect(),
            snapshot_limits: [Tier::Free, Tier::Pro, Tier::Team]
                .into_iter()
                .map(|t| (t, SnapshotLimits::default_for(t)))
                .collect(),
            lifecycle: LifecycleConfig::default(),
            sweeps: RunnerConfig::default(),
            apps: AppsConfig::default(),
            registries: Vec::new(),
            metrics_token: None,
        }
    }
}

/// How long a checked token is trusted without asking the database again.
const TOKEN_CACHE_TTL: Duration = Duration::from_secs(10);

pub struct ControlPlane {
    pub store: Store,
    pub host: Arc<HostAgent>,
    pub config: ControlConfig,
    tokens: Mutex<HashMap<String, (Account, Instant)>>,
    meter: lifecycle::Meter,
    runner: runner::Runner,
    apps: apps::Apps,
    builds: builds::Builds,
    events: events::EventLog,
}

impl ControlPlane {
    /// Room on this host for `count` new VMs (creates, forks, sweep
    /// cells, apps); each one reserved counts as a placement in the
    /// fleet page's history.
    pub(crate) async fn reserve(
        &self,
        count: usize,
        memory_mib: u32,
    ) -> Result<shoal_host::Reservation, shoal_host::HostError> {
        let slots = self.host.reserve(count, memory_mib).await?;
        metrics::metrics().placed(count as u64);
        Ok(slots)
    }

    pub fn new(store: Store, host: Arc<HostAgent>, config: ControlConfig) -> Arc<Self> {
        Arc::new(ControlPlane {
            store,
            host,
            config,
            tokens: Mutex::default(),
            meter: lifecycle::Meter::default(),
            runner: runner::Runner::default(),
            apps: apps::Apps::default(),
            builds: builds::Builds::default(),
            events: events::EventLog::default(),
        })
    }

    pub fn limits(&self, tier: Tier) -> TierLimits {
        self.config
            .limits
            .get(&tier)
            .copied()
            .unwrap_or_else(|| TierLimits::default_for(tier))
    }

    pub fn volume_limits(&self, tier: Tier) -> VolumeLimits {
        self.config
            .volume_limits
            .get(&tier)
            .copied()
            .unwrap_or_else(|| VolumeLimits::default_for(tier))
    }

    pub fn snapshot_limits(&self, tier: Tier) -> SnapshotLimits {
        self.config
            .snapshot_limits
            .get(&tier)
            .copied()
            .unwrap_or_else(|| SnapshotLimits::default_for(tier))
    }

    /// The account of `token`, from a short cache in front of the store (the
    /// cache is keyed by the token's hash, like the store).
    async fn authenticate(&self, token: &str) -> ApiResult<Option<Account>> {
        self.cached_account(shoal_store::token_hash(token), || {
            self.store.authenticate(token)
        })
        .await
    }

    /// Records an event in a sandbox's log (see [`events`]).
    pub(crate) fn event(&self, sandbox_id: &str, kind: &str, payload: serde_json::Value) {
        self.events.record(sandbox_id, kind, payload);
    }

    /// Drops a revoked token's cached account, so it is refused at once.
    pub(crate) fn forget_token(&self, hash: &str) {
        self.tokens.lock().unwrap().remove(hash);
    }

    /// The account a front vouched for, by id, from the same short cache.
    async fn account_named_by_front(&self, id: i64) -> ApiResult<Option<Account>> {
        self.cached_account(format!("front:{id}"), || self.store.account_by_id(id))
            .await
    }

    /// The account cached under `key` for [`TOKEN_CACHE_TTL`], else what
    /// `look_up` finds (cached when there is one).
    async fn cached_account<F>(
        &self,
        key: String,
        look_up: impl FnOnce() -> F,
    ) -> ApiResult<Option<Account>>
    where
        F: std::future::Future<Output = shoal_store::Result<Option<Account>>>,
    {
        if let Some((account, at)) = self.tokens.lock().unwrap().get(&key) {
            if at.elapsed() < TOKEN_CACHE_TTL {
                return Ok(Some(account.clone()));
            }
        }
        let account = look_up().await?;
        if let Some(account) = &account {
            self.tokens
                .lock()
                .unwrap()
                .insert(key, (account.clone(), Instant::now()));
        }
        Ok(account)
    }

    /// Brings the database in line with the host after a restart, then
    /// starts the reaper, the meter, the apps' reconciler and the sweep
    /// runner.
    pub async fn start_background(self: &Arc<Self>) -> ApiResult<()> {
        lifecycle::reconcile(self).await?;
        let woken = self.wake_after_stop().await;
        if woken > 0 {
            tracing::info!(woken, "woke the sandboxes the last stop hibernated");
        }
        builds::fail_abandoned(self).await;
        events::spawn_flusher(self.clone());
        lifecycle::spawn(self.clone());
        apps::spawn(self.clone());
        if self.config.sweeps.enabled {
            runner::spawn(self.clone()).await?;
        }
        Ok(())
    }
}

/// The route of one sandbox, under which its operations are.
pub const SANDBOX_ROUTE: &str = "/v1/sandboxes/{id}";

pub fn router(state: Arc<ControlPlane>) -> Router {
    let sandbox = SANDBOX_ROUTE;
    let sweep = "/v1/sweeps/{id}";
    let app = "/v1/apps/{id}";
    Router::new()
        .route("/healthz", get(meta::healthz))
        .route("/readyz", get(readiness::ready))
        .route("/metrics", get(metrics::serve))
        .route("/version", get(meta::version))
        .route("/v1/openapi.json", get(meta::openapi))
        .route("/v1/me", get(meta::me))
        .route("/v1/capacity", get(meta::capacity))
        .route("/v1/me/tokens", get(tokens::list).post(tokens::create))
        .route(
            "/v1/me/tokens/{prefix}",
            axum::routing::delete(tokens::revoke),
        )
        .route(
            "/v1/templates",
            get(templates::list).post(templates::create),
        )
        .route("/v1/templates/build", post(builds::submit))
        .route("/v1/templates/builds", get(builds::list))
        .route("/v1/templates/builds/{id}", get(builds::get))
        .route("/v1/templates/builds/{id}/logs", get(builds::logs))
        .route(
            "/v1/templates/{name}",
            get(templates::get).delete(templates::delete),
        )
        .route("/v1/snapshots", get(meta::snapshots))
        .route(
            "/v1/snapshots/{id}",
            get(snapshots::get).delete(snapshots::delete),
        )
        .route("/v1/volumes", post(volumes::create).get(volumes::list))
        .route(
            "/v1/volumes/{name}",
            get(volumes::get).delete(volumes::delete),
        )
        .route("/v1/usage", get(usage::account_usage))
        .route(
            "/v1/sandboxes",
            post(sandboxes::create).get(sandboxes::list),
        )
        .route(sandbox, get(sandboxes::get).delete(sandboxes::delete))
        .route(&format!("{sandbox}/exec"), post(exec::exec))
        .route(&format!("{sandbox}/exec/stream"), post(exec::exec_stream))
        .route(&format!("{sandbox}/exec/pty"), get(exec::pty))
        .route(&format!("{sandbox}/exec/ws"), get(exec::exec_ws))
        .route(
            &format!("{sandbox}/fs"),
            get(files::read).put(files::write).delete(files::remove),
        )
        .route(&format!("{sandbox}/fs/dir"), get(files::list_dir))
        .route(&format!("{sandbox}/fs/stat"), get(files::stat))
        .route(&format!("{sandbox}/fork"), post(sandboxes::fork))
        .route(&format!("{sandbox}/fork-tree"), post(sandboxes::fork_tree))
        .route(&format!("{sandbox}/promote"), post(sandboxes::promote))
        .route(
            &format!("{sandbox}/lifecycle"),
            get(sandboxes::lifecycle).patch(sandboxes::set_lifecycle),
        )
        .route(&format!("{sandbox}/pause"), post(sandboxes::pause))
        .route(&format!("{sandbox}/resume"), post(sandboxes::resume))
        .route(&format!("{sandbox}/hibernate"), post(sandboxes::hibernate))
        .route(&format!("{sandbox}/wake"), post(sandboxes::wake))
        // PandaStack's public names for hibernate and wake.
        .route(&format!("{sandbox}/stop"), post(sandboxes::hibernate))
        .route(&format!("{sandbox}/start"), post(sandboxes::wake))
        .route(&format!("{sandbox}/snapshots"), post(sandboxes::snapshot))
        .route(&format!("{sandbox}/logs"), get(meta::logs))
        .route(
            &format!("{sandbox}/ports"),
            get(meta::ports).post(meta::expose_port),
        )
        .route(
            &format!("{sandbox}/ports/{{port}}"),
            axum::routing::delete(meta::unexpose_port),
        )
        .route(&format!("{sandbox}/metrics"), get(meta::metrics))
        .route(&format!("{sandbox}/events"), get(events::list))
        .route(&format!("{sandbox}/proxy/{{port}}"), any(proxy::proxy_root))
        // A wildcard matches no empty path: `/proxy/8000/` needs its own route.
        .route(
            &format!("{sandbox}/proxy/{{port}}/"),
            any(proxy::proxy_root),
        )
        .route(
            &format!("{sandbox}/proxy/{{port}}/{{*path}}"),
            any(proxy::proxy_path),
        )
        .route(&format!("{sandbox}/usage"), get(usage::sandbox_usage))
        .route(&format!("{sandbox}/repl/sessions"), post(repl::create))
        .route(
            &format!("{sandbox}/repl/sessions/{{session_id}}"),
            axum::routing::delete(repl::close),
        )
        .route(
            &format!("{sandbox}/repl/sessions/{{session_id}}/run"),
            post(repl::run),
        )
        .route("/v1/apps", post(apps::create).get(apps::list))
        .route(app, get(apps::get).patch(apps::patch).delete(apps::delete))
        .route(&format!("{app}/proxy"), any(apps::proxy_root))
        .route(&format!("{app}/proxy/"), any(apps::proxy_root))
        .route(&format!("{app}/proxy/{{*path}}"), any(apps::proxy_path))
        .route("/v1/sweeps", post(sweeps::create).get(sweeps::list))
        .route(sweep, get(sweeps::get).patch(sweeps::patch))
        .route(&format!("{sweep}/cancel"), post(sweeps::cancel))
        .route(&format!("{sweep}/requeue"), post(sweeps::requeue))
        .route(&format!("{sweep}/hold"), post(sweeps::hold))
        .route(&format!("{sweep}/release"), post(sweeps::release))
        .route(&format!("{sweep}/cells"), get(sweeps::cells_list))
        .route(&format!("{sweep}/cells/{{index}}"), get(sweeps::cell))
        .route(
            &format!("{sweep}/cells/{{index}}/output"),
            get(sweeps::cell_output),
        )
        .route("/v1/blobs/missing", post(blobs::missing))
        .route(
            "/v1/blobs/{digest}",
            get(blobs::download).put(blobs::upload),
        )
        // Around matched routes only, where the route's pattern is known.
        .route_layer(axum::middleware::from_fn(metrics::track))
        // Static pages, added after the API's layers so none of them runs
        // on an API request because of the console, nor on the console's.
        .merge(shoal_console::router())
        .fallback(|| async { ApiError::not_found("not found") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                axum::http::StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed",
            )
        })
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(state)
}

/// Seconds since the epoch, as the store keeps time.
pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// RFC 3339 UTC with milliseconds, as the API shows time.
pub fn rfc3339(seconds: f64) -> String {
    chrono::DateTime::from_timestamp_millis((seconds * 1000.0) as i64)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}
