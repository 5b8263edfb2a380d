//! The front (`shoal server`): the API's address for a fleet of hosts.
//!
//! Stateless: everything it knows is in the database (hosts, placements,
//! sandbox rows, tokens), so several fronts may run behind a load balancer.
//! Every tenant route checks the caller first ([`Front::caller`]: the
//! per-address bad-token limit, the token, the account's rate, see
//! [`crate::limits`]) and reads a body only after. Per request it does one
//! of four things:
//!
//! - `POST /v1/sandboxes` and `POST /v1/apps`: authenticate, place on a
//!   live host (a fork is not a create: it goes with the rest to its
//!   parent's host; an app stays on the host it was placed on), record the
//!   placement so a burst does not pile onto one host before its next
//!   heartbeat, and forward the request there; 503 `no compute capacity
//!   available` with `Retry-After: 5` when nothing fits, before anything
//!   exists. A create with volumes or from a snapshot is pinned to their
//!   host (a volume's image and a snapshot's memory are on one host's
//!   disk): 503 `volume host unavailable` or `snapshot host unavailable`,
//!   `Retry-After: 15`, when that host is stale; 409 when they are on two.
//! - `POST /v1/volumes`: placed on the live host placement likes best (no
//!   reservation: a volume takes disk, not memory or CPU) and forwarded;
//!   that agent checks its disk (507) and makes the image. A request about
//!   one volume goes to its host; reading it works from any agent when
//!   that host is stale, anything else is 503 `volume host unavailable`.
//! - a request about a sandbox or an app: forward it to its host; when that
//!   host is stale, reading or deleting the row still works (any live agent
//!   answers from the database), anything else is 503 `sandbox host
//!   unavailable` with `Retry-After: 15`.
//! - a request about one snapshot: to the host that holds its files; a
//!   read works from any agent when that host is stale, a delete is 503.
//! - `POST /v1/templates/build`: to the host of the snapshot its
//!   Dockerfile's `FROM` restores (an account's own or a published
//!   template), else to a live host in turn; a body past 64 MiB (a root
//!   filesystem upload) is streamed on.
//! - a request about one template build: to the host that runs it (its
//!   live log is there); any agent reads it when that host is stale.
//! - the fleet-internal routes (`/v1/fleet/...`, fleet token): heartbeats,
//!   the configuration an agent starts with, the hosts as placement sees
//!   them.
//! - `/v1/me/tokens`: answered here (`tokens`), since an agent's database
//!   role cannot read tokens.
//! - anything else (`/v1/me`, lists, usage, sweeps, templates): forward to
//!   any live agent; they all read the same database.

mod tokens;

use crate::limits::{self, AccountRates, FailedAuths, FrontLimits};
use crate::{
    api_token, bearer, fleet_token_matches, refuse, FleetConfig, JoinRequest, Joined,
    HEARTBEAT_INTERVAL, STALE_AFTER,
};
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use serde_json::json;
use shoal_placement::{HostCapacity, InFlight, PlacementError, Request as PlacementRequest};
use shoal_store::{Account, HostReport, HostRow, JoinRefusal, NewPlacement, Store};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a front runs.
#[derive(Debug, Clone)]
pub struct FrontConfig {
    /// The fronts' own secret: the operators' fleet routes take it, and
    /// each host's front key is derived from it ([`crate::front_key`]).
    pub fleet_token: String,
    /// Handed to agents that start without one of their own.
    pub database_url: String,
    /// The CA agents' certificates chain to, pinned for every request to an
    /// `https://` agent (`None`: the web's roots).
    pub agent_ca: Option<std::path::PathBuf>,
    /// How often the sandboxes of stale hosts are looked for.
    pub lost_check: Duration,
}

/// The host a create must go to, and what of the sandbox's it holds
/// (`"volume"`, `"snapshot"`: named in the 503 when that host is stale).
#[derive(Debug, Clone)]
pub struct Pin {
    pub host: String,
    pub holds: &'static str,
}

/// Host memory a new sandbox is expected to take: its resident size, not
/// its nominal RAM. A restored clone shares the template's pages and holds
/// some 30 MiB of its own when idle (docs/bench); this leaves room to work.
const SANDBOX_RESIDENT_MIB: u64 = 256;
/// Host CPUs a new sandbox is expected to keep busy.
const SANDBOX_CPU_SHARE: f64 = 0.25;
/// How long routing trusts its view of the hosts; placement always reads
/// the database afresh.
const ROUTING_VIEW_TTL: Duration = Duration::from_secs(1);
/// How long an authenticated token is trusted without asking the database.
const TOKEN_CACHE_TTL: Duration = Duration::from_secs(10);

pub struct Front {
    store: Store,
    config: FrontConfig,
    http: reqwest::Client,
    tokens: Mutex<HashMap<String, (Account, Instant)>>,
    /// Placement decisions of this front, one at a time (the database
    /// serialises them across fronts).
    placing: tokio::sync::Mutex<()>,
    routing: Mutex<Option<(Instant, Arc<Vec<HostRow>>)>>,
    next_any: AtomicUsize,
    /// Invalid tokens per source address (`limits`).
    failed_auths: FailedAuths,
    /// Each account's request rate (`limits`).
    account_rates: AccountRates,
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

fn no_capacity() -> Response {
    refuse(
        StatusCode::SERVICE_UNAVAILABLE,
        "no compute capacity available",
        Some(5),
    )
}

fn host_unavailable() -> Response {
    refuse(
        StatusCode::SERVICE_UNAVAILABLE,
        "sandbox host unavailable",
        Some(15),
    )
}

fn volume_host_unavailable() -> Response {
    refuse(
        StatusCode::SERVICE_UNAVAILABLE,
        "volume host unavailable",
        Some(15),
    )
}

fn unauthorized() -> Response {
    refuse(
        StatusCode::UNAUTHORIZED,
        "missing or invalid API token",
        None,
    )
}

fn database_error(e: shoal_store::StoreError) -> Response {
    // As in the agents' API: the details are for the log.
    tracing::error!(error = e.chain(), "database");
    refuse(StatusCode::INTERNAL_SERVER_ERROR, "database error", None)
}

/// Whether a host takes work: heard from recently, not draining and not
/// drained by the operator.
fn is_live(host: &HostRow, now: f64) -> bool {
    host.is_fresh(now, STALE_AFTER.as_secs_f64()) && !host.report.draining && !host.drained
}

/// A host as placement sees it.
pub fn capacity(host: &HostRow, now: f64) -> HostCapacity {
    let report = &host.report;
    HostCapacity {
        id: report.id.clone(),
        live: is_live(host, now),
        vcpus: report.vcpus,
        cpu_busy: report.cpu_busy,
        memory_mib: report.memory_mib,
        available_mib: report.available_mib,
        reserve_mib: report.reserve_mib,
        sandboxes: report.sandboxes,
        max_sandboxes: report.max_sandboxes,
        in_flight: InFlight {
            sandboxes: host.in_flight_sandboxes,
            memory_mib: host.in_flight_memory_mib,
            cpu_share: host.in_flight_cpu_share,
        },
    }
}

/// Headers that belong to one connection, not to the request.
fn hop_by_hop(name: &header::HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

impl Front {
    /// A front with the default limits on tenants; an unreadable agents'
    /// CA is an error.
    pub fn new(store: Store, config: FrontConfig) -> Result<Arc<Front>, crate::tls::TlsError> {
        Front::with_limits(store, config, FrontLimits::default())
    }

    /// A front with other limits on tenants than [`FrontLimits::default`].
    pub fn with_limits(
        store: Store,
        config: FrontConfig,
        limits: FrontLimits,
    ) -> Result<Arc<Front>, crate::tls::TlsError> {
        let http = crate::tls::client(config.agent_ca.as_deref())?;
        Ok(Arc::new(Front {
            store,
            config,
            http,
            tokens: Mutex::default(),
            placing: tokio::sync::Mutex::new(()),
            routing: Mutex::new(None),
            next_any: AtomicUsize::new(0),
            failed_auths: FailedAuths::new(&limits),
            account_rates: AccountRates::new(&limits),
        }))
    }

    /// Marks the sandboxes of stale hosts `lost`, every `lost_check`.
    pub fn spawn_lost_marker(self: &Arc<Self>) {
        let front = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(front.config.lost_check);
            loop {
                tick.tick().await;
                let stale_before = now() - STALE_AFTER.as_secs_f64();
                match front
                    .store
                    .lose_sandboxes_of_stale_hosts(stale_before)
                    .await
                {
                    Ok(lost) if !lost.is_empty() => {
                        tracing::warn!(
                            count = lost.len(),
                            ?lost,
                            "sandboxes of a stale host are lost"
                        );
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "marking lost sandboxes"),
                }
            }
        });
    }

    /// The account whose bearer token came with the request, before its
    /// body is read: 429 for an address past the failed-authentication
    /// limit (before the token is looked at), 401 for a missing or invalid
    /// token (an invalid one counts against the source address), 429 for
    /// an account past its request rate.
    async fn caller(&self, parts: &axum::http::request::Parts) -> Result<Account, Response> {
        let source = limits::source(&parts.extensions);
        if let Some(wait) = source.and_then(|ip| self.failed_auths.blocked(ip, Instant::now())) {
            return Err(limits::address_refused(wait));
        }
        let presented = parts.headers.get(header::AUTHORIZATION);
        let Some(token) = api_token(parts) else {
            if let (Some(ip), Some(_)) = (source, presented) {
                self.failed_auths.failed(ip, Instant::now());
            }
            return Err(unauthorized());
        };
        let key = shoal_store::token_hash(&token);
        let cached = self
            .tokens
            .lock()
            .unwrap()
            .get(&key)
            .filter(|(_, at)| at.elapsed() < TOKEN_CACHE_TTL)
            .map(|(account, _)| account.clone());
        let account = match cached {
            Some(account) => account,
            None => {
                let Some(account) = self
                    .store
                    .authenticate(&token)
                    .await
                    .map_err(database_error)?
                else {
                    if let Some(ip) = source {
                        self.failed_auths.failed(ip, Instant::now());
                    }
                    return Err(unauthorized());
                };
                self.tokens
                    .lock()
                    .unwrap()
                    .insert(key, (account.clone(), Instant::now()));
                account
            }
        };
        self.account_rates
            .take(&account, Instant::now())
            .map_err(limits::account_refused)?;
        Ok(account)
    }

    /// The hosts as routing sees them (at most a second old).
    async fn routing_view(&self) -> Result<Arc<Vec<HostRow>>, Response> {
        if let Some((at, hosts)) = &*self.routing.lock().unwrap() {
            if at.elapsed() < ROUTING_VIEW_TTL {
                return Ok(hosts.clone());
            }
        }
        let hosts = Arc::new(self.store.hosts(now()).await.map_err(database_error)?);
        *self.routing.lock().unwrap() = Some((Instant::now(), hosts.clone()));
        Ok(hosts)
    }

    /// Chooses a host for one new sandbox (only the pinned one if given)
    /// and records the placement, in one decision no other front
    /// interleaves with (`Store::place`). Returns the host's id, its
    /// address and the placement's id.
    pub async fn place(&self, pinned: Option<Pin>) -> Result<(String, String, String), Response> {
        let (pinned_to, holds) = match pinned {
            Some(pin) => (Some(pin.host), pin.holds),
            None => (None, "volume"),
        };
        let request = PlacementRequest {
            memory_mib: SANDBOX_RESIDENT_MIB,
            cpu_share: SANDBOX_CPU_SHARE,
            pinned_to,
        };
        // One decision of this front at a time holds a database connection;
        // the others wait here rather than on the database's lock.
        let _one_at_a_time = self.placing.lock().await;
        let at = now();
        let mut url = String::new();
        let mut host_id = String::new();
        let decided = self
            .store
            .place(at, |hosts| {
                let capacities: Vec<HostCapacity> = hosts.iter().map(|h| capacity(h, at)).collect();
                let chosen = shoal_placement::place(&request, &capacities)?;
                url = hosts
                    .iter()
                    .find(|h| h.report.id == chosen.id)
                    .map(|h| h.report.url.clone())
                    .unwrap_or_default();
                host_id = chosen.id.clone();
                Ok(NewPlacement {
                    host_id: chosen.id.clone(),
                    memory_mib: request.memory_mib,
                    cpu_share: request.cpu_share,
                })
            })
            .await
            .map_err(database_error)?;
        match decided {
            Ok((_, placement)) => Ok((host_id, url, placement)),
            Err(PlacementError::NoCapacity) => Err(no_capacity()),
            Err(PlacementError::PinnedHostUnavailable) => Err(refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("{holds} host unavailable"),
                Some(15),
            )),
        }
    }

    /// The host for a new volume: the live host placement would choose for
    /// a sandbox now, without a reservation. Its id and address.
    async fn place_volume(&self) -> Result<(String, String), Response> {
        let at = now();
        let hosts = self.store.hosts(at).await.map_err(database_error)?;
        let capacities: Vec<HostCapacity> = hosts.iter().map(|h| capacity(h, at)).collect();
        let request = PlacementRequest {
            memory_mib: 0,
            cpu_share: 0.0,
            pinned_to: None,
        };
        let chosen = shoal_placement::place(&request, &capacities).map_err(|_| no_capacity())?;
        let url = hosts
            .iter()
            .find(|h| h.report.id == chosen.id)
            .map(|h| h.report.url.clone())
            .unwrap_or_default();
        Ok((chosen.id.clone(), url))
    }

    /// The host a create must run on: that of the volumes its body names
    /// and of the snapshot it restores (their files are on one host's disk):
    /// 404 for one the caller does not have, 409 for two hosts, `None` for a
    /// create that names neither (or a body the agent will refuse anyway).
    async fn pin(&self, account: &Account, body: &[u8]) -> Result<Option<Pin>, Response> {
        let body = create_body(body);
        let mut pinned: Option<Pin> = None;
        // False when `host` is not the one already pinned.
        let mut add = |host: String, holds: &'static str| match &pinned {
            Some(pin) => pin.host == host,
            None => {
                pinned = Some(Pin { host, holds });
                true
            }
        };
        let two_hosts = || {
            refuse(
                StatusCode::CONFLICT,
                "the volumes and the snapshot of one sandbox must live on one host",
                None,
            )
        };
        // An account's own template (or one published to all) restores its
        // snapshot: the same pin. The snapshot is its owner's.
        let template_snapshot = match template_named(&body) {
            Some(name) => self.template_snapshot(account, &name).await?,
            None => None,
        };
        let named_snapshot = snapshot_named(&body).map(|id| (account.id, id));
        if let Some((owner, id)) = named_snapshot.or(template_snapshot) {
            let snapshot = self
                .store
                .get_snapshot(owner, &id)
                .await
                .map_err(database_error)?
                .ok_or_else(|| refuse(StatusCode::NOT_FOUND, "snapshot not found", None))?;
            // A snapshot from before hosts were recorded: any host answers.
            if let Some(host) = snapshot.host {
                add(host, "snapshot");
            }
        }
        for name in volume_names(&body) {
            let volume = self
                .store
                .get_volume(account.id, &name)
                .await
                .map_err(database_error)?
                .ok_or_else(|| {
                    refuse(
                        StatusCode::NOT_FOUND,
                        &format!("volume not found: {name}"),
                        None,
                    )
                })?;
            if !add(volume.host, "volume") {
                return Err(two_hosts());
            }
        }
        Ok(pinned)
    }

    /// Sends the request on to agent `(host_id, base URL)`, streaming both
    /// bodies (exec streams and large files pass through without being
    /// held), with the key that proves to that host a front sent it and
    /// the account the front found for the caller.
    async fn forward(
        &self,
        account: Option<i64>,
        (host_id, base): (&str, &str),
        method: Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: reqwest::Body,
    ) -> Result<Response, reqwest::Error> {
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        let mut request = self.http.request(method, format!("{base}{path}"));
        for (name, value) in headers {
            if !hop_by_hop(name)
                && name.as_str() != crate::FRONT_KEY_HEADER
                && name.as_str() != crate::ACCOUNT_HEADER
            {
                request = request.header(name, value);
            }
        }
        // The agent takes the caller from here, not from the token (it may
        // not read the token table); a client's own header never passes.
        if let Some(account) = account {
            request = request.header(crate::ACCOUNT_HEADER, account.to_string());
        }
        request = request.header(
            crate::FRONT_KEY_HEADER,
            crate::front_key(&self.config.fleet_token, host_id),
        );
        // The agent names URLs on the address the client used (an app's
        // proxy URL), not on its own.
        if let (Some(host), false) = (
            headers.get(header::HOST),
            headers.contains_key("x-forwarded-host"),
        ) {
            request = request.header("x-forwarded-host", host);
        }
        let answer = request.body(body).send().await?;
        let mut response = Response::builder().status(answer.status());
        for (name, value) in answer.headers() {
            if !hop_by_hop(name) {
                response = response.header(name, value);
            }
        }
        Ok(response
            .body(Body::from_stream(answer.bytes_stream()))
            .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response()))
    }

    /// Forwards to any live agent, trying the next one if an agent cannot be
    /// reached.
    async fn forward_to_any(
        &self,
        account: Option<i64>,
        method: Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Response {
        let hosts = match self.routing_view().await {
            Ok(hosts) => hosts,
            Err(response) => return response,
        };
        let at = now();
        let live: Vec<&HostRow> = hosts.iter().filter(|h| is_live(h, at)).collect();
        if live.is_empty() {
            return no_capacity();
        }
        let first = self.next_any.fetch_add(1, Ordering::Relaxed);
        for i in 0..live.len() {
            let host = live[(first + i) % live.len()];
            match self
                .forward(
                    account,
                    (&host.report.id, &host.report.url),
                    method.clone(),
                    uri,
                    headers,
                    body.clone().into(),
                )
                .await
            {
                Ok(response) => return response,
                Err(e) => tracing::warn!(host = host.report.id, error = %e, "agent unreachable"),
            }
        }
        no_capacity()
    }
}

/// The front's routes.
pub fn router(front: Arc<Front>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        // A front is ready once it serves: it bakes nothing.
        .route("/readyz", get(|| async { Json(json!({"ready": true})) }))
        .route("/v1/fleet/join", post(join))
        .route("/v1/fleet/heartbeat", post(heartbeat))
        .route("/v1/fleet/config", get(config))
        .route("/v1/fleet/hosts", get(hosts))
        .route("/v1/me/tokens", get(tokens::list).post(tokens::create))
        .route(
            "/v1/me/tokens/{prefix}",
            axum::routing::delete(tokens::revoke),
        )
        .route("/v1/sandboxes", post(create).fallback(elsewhere))
        .route("/v1/volumes", post(create_volume).fallback(elsewhere))
        .route("/v1/volumes/{name}", any(about_volume))
        .route("/v1/snapshots/{id}", any(about_snapshot))
        .route("/v1/sandboxes/{id}", any(about_sandbox))
        .route("/v1/sandboxes/{id}/{*rest}", any(about_sandbox))
        .route("/v1/apps", post(create).fallback(elsewhere))
        .route("/v1/templates", post(create_template).fallback(elsewhere))
        .route("/v1/templates/build", post(build_template))
        .route("/v1/templates/builds/{id}", any(about_build))
        .route("/v1/templates/builds/{id}/{*rest}", any(about_build))
        .route("/v1/apps/{id}", any(about_app))
        .route("/v1/apps/{id}/{*rest}", any(about_app))
        // The console's pages are the front's own; what they call is
        // forwarded like any client's request.
        .merge(shoal_console::router())
        .fallback(elsewhere)
        .with_state(front)
}

type St = State<Arc<Front>>;

/// The host a request's bearer credential speaks for: 401 for none, an
/// unknown one or a revoked one.
async fn calling_host(front: &Front, headers: &HeaderMap) -> Result<String, Response> {
    let secret = bearer(headers).ok_or_else(|| host_unauthorized("missing host credential"))?;
    front
        .store
        .host_of_secret(secret)
        .await
        .map_err(database_error)?
        .ok_or_else(|| host_unauthorized("unknown or revoked host credential"))
}

fn host_unauthorized(why: &str) -> Response {
    refuse(
        StatusCode::UNAUTHORIZED,
        &format!("{why}: join with `shoal agent --join-token` (from `shoal host join-token`)"),
        None,
    )
}

impl Front {
    /// What host `host_id` is told: its front key and a database URL with
    /// a role of its own (made or enabled now), never the fronts' own
    /// credentials; an SQLite fleet (one machine, tests) shares its file.
    async fn fleet_config(&self, host_id: &str) -> Result<FleetConfig, Response> {
        let password = crate::database_password(&self.config.fleet_token, host_id);
        let database_url = match self.store.ensure_host_role(host_id, &password).await {
            Ok(Some(role)) => {
                shoal_store::host_database_url(&self.config.database_url, &role, &password)
                    .map_err(database_error)?
            }
            Ok(None) => self.config.database_url.clone(),
            Err(e) => return Err(database_error(e)),
        };
        Ok(FleetConfig {
            database_url,
            front_key: crate::front_key(&self.config.fleet_token, host_id),
            heartbeat_interval_s: HEARTBEAT_INTERVAL.as_secs(),
            stale_after_s: STALE_AFTER.as_secs(),
        })
    }
}

/// A new host spends a one-time join token for a credential of its own.
async fn join(State(front): St, body: Bytes) -> Response {
    let request: JoinRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(e) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                &format!("invalid join request: {e}"),
                None,
            )
        }
    };
    if !crate::valid_host_name(&request.name) {
        return refuse(
            StatusCode::BAD_REQUEST,
            "a host name is 1 to 63 letters, digits, '-', '_' or '.'",
            None,
        );
    }
    let at = now();
    let live_since = at - STALE_AFTER.as_secs_f64();
    match front
        .store
        .join_host(&request.join_token, &request.name, at, live_since)
        .await
    {
        Ok(Ok(host_secret)) => {
            tracing::info!(host = request.name, "host joined the fleet");
            match front.fleet_config(&request.name).await {
                Ok(config) => Json(Joined {
                    host_secret,
                    config,
                })
                .into_response(),
                Err(response) => response,
            }
        }
        Ok(Err(JoinRefusal::BadToken)) => refuse(
            StatusCode::UNAUTHORIZED,
            "invalid, spent or expired join token (make one with `shoal host join-token`)",
            None,
        ),
        Ok(Err(JoinRefusal::NameLive)) => refuse(
            StatusCode::CONFLICT,
            &format!(
                "a live host is already called {}: give this one another --name, or stop that one and wait {} s",
                request.name,
                STALE_AFTER.as_secs()
            ),
            None,
        ),
        Err(e) => database_error(e),
    }
}

async fn heartbeat(State(front): St, headers: HeaderMap, body: Bytes) -> Response {
    let host_id = match calling_host(&front, &headers).await {
        Ok(id) => id,
        Err(response) => return response,
    };
    let report: HostReport = match serde_json::from_slice(&body) {
        Ok(report) => report,
        Err(e) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                &format!("invalid host report: {e}"),
                None,
            )
        }
    };
    if report.id != host_id {
        tracing::warn!(
            host = host_id,
            claimed = report.id,
            "a host reported for another"
        );
        return refuse(
            StatusCode::FORBIDDEN,
            &format!(
                "this credential speaks for host {host_id}, not {}",
                report.id
            ),
            None,
        );
    }
    if !report.url.starts_with("http://") && !report.url.starts_with("https://") {
        return refuse(
            StatusCode::BAD_REQUEST,
            "a host report needs an http(s) url",
            None,
        );
    }
    match front.store.report_host(&report, now()).await {
        Ok(()) => Json(json!({
            "ok": true,
            "heartbeat_interval_s": HEARTBEAT_INTERVAL.as_secs(),
            "stale_after_s": STALE_AFTER.as_secs(),
        }))
        .into_response(),
        Err(e) => database_error(e),
    }
}

/// What a joined host starts with (its credential names it).
async fn config(State(front): St, headers: HeaderMap) -> Response {
    match calling_host(&front, &headers).await {
        Ok(host_id) => match front.fleet_config(&host_id).await {
            Ok(config) => Json(config).into_response(),
            Err(response) => response,
        },
        Err(response) => response,
    }
}

async fn hosts(State(front): St, headers: HeaderMap) -> Response {
    if !fleet_token_matches(&headers, &front.config.fleet_token) {
        return unauthorized();
    }
    let at = now();
    match front.store.hosts(at).await {
        Ok(hosts) => {
            let hosts: Vec<_> = hosts
                .iter()
                .map(|h| {
                    json!({
                        "id": h.report.id,
                        "url": h.report.url,
                        "live": is_live(h, at),
                        "heartbeat_age_s": at - h.heartbeat_at,
                        "report": h.report,
                        "in_flight_sandboxes": h.in_flight_sandboxes,
                    })
                })
                .collect();
            Json(json!({ "hosts": hosts })).into_response()
        }
        Err(e) => database_error(e),
    }
}

async fn create(State(front): St, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let (account, body) = match front.caller_and_body(&parts, body).await {
        Ok(found) => found,
        Err(response) => return response,
    };
    let (method, uri, headers) = (parts.method, parts.uri, parts.headers);
    let pinned = match front.pin(&account, &body).await {
        Ok(pinned) => pinned,
        Err(response) => return response,
    };
    let (host_id, url, placement) = match front.place(pinned).await {
        Ok(chosen) => chosen,
        Err(response) => return response,
    };
    let answer = front
        .forward(
            Some(account.id),
            (&host_id, &url),
            method,
            &uri,
            &headers,
            body.into(),
        )
        .await;
    let created = matches!(&answer, Ok(response) if response.status().is_success());
    let done = if created {
        front.store.placement_done(&placement, now()).await
    } else {
        front.store.drop_placement(&placement).await
    };
    if let Err(e) = done {
        tracing::warn!(error = %e, "recording the end of a placement");
    }
    match answer {
        Ok(response) => response,
        Err(e) => {
            tracing::warn!(host = url, error = %e, "agent unreachable for a create");
            no_capacity()
        }
    }
}

async fn about_sandbox(
    State(front): St,
    Path(params): Path<HashMap<String, String>>,
    request: Request,
) -> Response {
    let (parts, body) = request.into_parts();
    let account = match front.caller(&parts).await {
        Ok(account) => account,
        Err(response) => return response,
    };
    let id = params.get("id").cloned().unwrap_or_default();
    let home = match front.store.get_sandbox(account.id, &id).await {
        Ok(Some(row)) => row.host,
        Ok(None) => return refuse(StatusCode::NOT_FOUND, "sandbox not found", None),
        Err(e) => return database_error(e),
    };
    let whole_row = !params.contains_key("rest");
    if whole_row && parts.method == Method::DELETE {
        match front.live_host(home.as_deref()).await {
            Ok(Some(_)) => {}
            // No other host may write the row of a gone one (its database
            // role is confined to its own rows): the front closes it.
            Ok(None) => return front.delete_orphan(&id).await,
            Err(response) => return response,
        }
    }
    front
        .forward_home(account.id, home.as_deref(), whole_row, parts, body)
        .await
}

/// A request about one snapshot goes to the host whose disk holds it (a
/// delete frees its files there); reading it works from any agent when that
/// host is stale, deleting it is 503 `sandbox host unavailable`.
async fn about_snapshot(State(front): St, Path(id): Path<String>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let account = match front.caller(&parts).await {
        Ok(account) => account,
        Err(response) => return response,
    };
    let home = match front.store.get_snapshot(account.id, &id).await {
        Ok(Some(row)) => row.host,
        Ok(None) => return refuse(StatusCode::NOT_FOUND, "snapshot not found", None),
        Err(e) => return database_error(e),
    };
    let readable = parts.method == Method::GET;
    front
        .forward_home(account.id, home.as_deref(), readable, parts, body)
        .await
}

/// A request about one template build goes to the host whose process
/// accepted it: that process runs it and holds its live log (`logs?follow`
/// tails it there). When that host is stale, any agent answers from the
/// database (the row, the stored log).
async fn about_build(
    State(front): St,
    Path(params): Path<HashMap<String, String>>,
    request: Request,
) -> Response {
    let (parts, body) = request.into_parts();
    let account = match front.caller(&parts).await {
        Ok(account) => account,
        Err(response) => return response,
    };
    let id = params.get("id").cloned().unwrap_or_default();
    let home = match front.store.get_build(account.id, &id).await {
        Ok(Some(row)) => row.host,
        Ok(None) => return refuse(StatusCode::NOT_FOUND, "build not found", None),
        Err(e) => return database_error(e),
    };
    front
        .forward_home(account.id, home.as_deref(), true, parts, body)
        .await
}

/// A request about an app goes to its host (the one whose control plane
/// drives it), like one about a sandbox.
async fn about_app(
    State(front): St,
    Path(params): Path<HashMap<String, String>>,
    request: Request,
) -> Response {
    let (parts, body) = request.into_parts();
    let account = match front.caller(&parts).await {
        Ok(account) => account,
        Err(response) => return response,
    };
    let id = params.get("id").cloned().unwrap_or_default();
    let home = match front.store.get_app(account.id, &id).await {
        Ok(Some(app)) if app.state.status != shoal_store::app_status::DELETED => app.host,
        Ok(_) => return refuse(StatusCode::NOT_FOUND, "app not found", None),
        Err(e) => return database_error(e),
    };
    let whole_row = !params.contains_key("rest");
    if whole_row && parts.method == Method::DELETE {
        match front.live_host(home.as_deref()).await {
            Ok(Some(_)) => {}
            // As for a sandbox: no other host may write the app's row.
            Ok(None) => {
                return match front.store.delete_app(account.id, &id, now()).await {
                    Ok(true) => StatusCode::NO_CONTENT.into_response(),
                    Ok(false) => refuse(StatusCode::NOT_FOUND, "app not found", None),
                    Err(e) => database_error(e),
                }
            }
            Err(response) => return response,
        }
    }
    let path = parts.uri.path().to_owned();
    let answer = front
        .forward_home(account.id, home.as_deref(), whole_row, parts, body)
        .await;
    front.with_stored_env(account.id, &path, answer).await
}

impl Front {
    /// The caller, then its body up to `limits::CREATE_BODY_MAX`: in that
    /// order, so no body is read for a caller without a valid token.
    async fn caller_and_body(
        &self,
        parts: &axum::http::request::Parts,
        body: Body,
    ) -> Result<(Account, Bytes), Response> {
        let account = self.caller(parts).await?;
        let body = limits::read_bounded(&parts.headers, body, limits::CREATE_BODY_MAX).await?;
        Ok((account, body))
    }

    /// `home`'s row, when that host is live.
    /// The snapshot (its owner, its id) an account's template `name`
    /// restores: its own of that name, else one published to all; `None`
    /// for a first-party template or no such template.
    async fn template_snapshot(
        &self,
        account: &Account,
        name: &str,
    ) -> Result<Option<(i64, String)>, Response> {
        if shoal_image::find_template(name).is_some() {
            return Ok(None);
        }
        let own = self
            .store
            .get_template(account.id, name)
            .await
            .map_err(database_error)?;
        let found = match own {
            Some(own) => Some(own),
            None => self
                .store
                .get_published_template(name)
                .await
                .map_err(database_error)?,
        };
        Ok(found.map(|t| (t.account_id, t.snapshot_id)))
    }

    /// The host a template build must run on: the host of the snapshot its
    /// Dockerfile's `FROM` restores (an account's own or a published
    /// template), `None` when any host will do (a first-party or Debian
    /// base, an upload, an image reference, or a body the agent will refuse).
    async fn build_home(
        &self,
        account: &Account,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Option<String>, Response> {
        let Some(text) = dockerfile_of(headers, body).await else {
            return Ok(None);
        };
        let Ok(parsed) = shoal_image::dockerfile::parse(&text) else {
            return Ok(None);
        };
        let shoal_image::dockerfile::Base::Template(name) = parsed.base else {
            return Ok(None);
        };
        let Some((owner, id)) = self.template_snapshot(account, &name).await? else {
            return Ok(None);
        };
        Ok(self
            .store
            .get_snapshot(owner, &id)
            .await
            .map_err(database_error)?
            .and_then(|snapshot| snapshot.host))
    }

    /// A live host, in turn: where a build that may run anywhere goes.
    async fn any_live_host(&self) -> Result<Option<String>, Response> {
        let hosts = self.routing_view().await?;
        let at = now();
        let live: Vec<&HostRow> = hosts.iter().filter(|h| is_live(h, at)).collect();
        if live.is_empty() {
            return Ok(None);
        }
        let turn = self.next_any.fetch_add(1, Ordering::Relaxed);
        Ok(Some(live[turn % live.len()].report.id.clone()))
    }

    async fn live_host(&self, home: Option<&str>) -> Result<Option<HostRow>, Response> {
        let hosts = self.routing_view().await?;
        let at = now();
        Ok(home
            .and_then(|name| hosts.iter().find(|h| h.report.id == name))
            .filter(|h| is_live(h, at))
            .cloned())
    }

    /// Deletes the row of a sandbox whose host is gone (its VM went with
    /// it, or is killed when the host comes back: `lost`).
    async fn delete_orphan(&self, id: &str) -> Response {
        let patch = shoal_store::SandboxPatch {
            status: Some(shoal_store::status::DELETED.into()),
            deleted_at: Some(now()),
            ..Default::default()
        };
        match self.store.update_sandbox(id, patch).await {
            Ok(_) => StatusCode::NO_CONTENT.into_response(),
            Err(e) => database_error(e),
        }
    }

    /// Forwards a request about one object to `home`, the host in its row.
    /// When that host is stale, a GET or DELETE of the `whole_row` still
    /// works (any live agent answers from the database); anything else is
    /// 503 `sandbox host unavailable`.
    async fn forward_home(
        &self,
        account: i64,
        home: Option<&str>,
        whole_row: bool,
        parts: axum::http::request::Parts,
        body: Body,
    ) -> Response {
        let home = match self.live_host(home).await {
            Ok(home) => home,
            Err(response) => return response,
        };
        match home {
            Some(host) => {
                let body = reqwest::Body::wrap_stream(body.into_data_stream());
                match self
                    .forward(
                        Some(account),
                        (&host.report.id, &host.report.url),
                        parts.method,
                        &parts.uri,
                        &parts.headers,
                        body,
                    )
                    .await
                {
                    Ok(response) => response,
                    Err(e) => {
                        tracing::warn!(host = host.report.id, error = %e, "sandbox host unreachable");
                        host_unavailable()
                    }
                }
            }
            // The row outlives its host: any agent reads or deletes it.
            None if whole_row && matches!(parts.method, Method::GET | Method::DELETE) => {
                let body = match axum::body::to_bytes(body, 1 << 20).await {
                    Ok(body) => body,
                    Err(_) => return refuse(StatusCode::PAYLOAD_TOO_LARGE, "body too large", None),
                };
                self.forward_to_any(
                    Some(account),
                    parts.method,
                    &parts.uri,
                    &parts.headers,
                    body,
                )
                .await
            }
            None => host_unavailable(),
        }
    }
}

/// A create's JSON body, or `null` for one that is not JSON (it names
/// nothing to pin; the agent answers it).
fn create_body(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body).unwrap_or(serde_json::Value::Null)
}

/// The snapshot a create's body restores, if it names one.
fn snapshot_named(body: &serde_json::Value) -> Option<String> {
    body.get("from_snapshot")?.as_str().map(str::to_string)
}

/// The template a create's body names, if it names one.
fn template_named(body: &serde_json::Value) -> Option<String> {
    body.get("template")?.as_str().map(str::to_string)
}

/// The volume names a create's body lists.
fn volume_names(body: &serde_json::Value) -> Vec<String> {
    body.get("volumes")
        .and_then(|v| v.as_array())
        .map(|volumes| {
            volumes
                .iter()
                .filter_map(|v| v.get("name")?.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

async fn create_volume(State(front): St, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let (account, body) = match front.caller_and_body(&parts, body).await {
        Ok(found) => found,
        Err(response) => return response,
    };
    let (method, uri, headers) = (parts.method, parts.uri, parts.headers);
    let (host_id, url) = match front.place_volume().await {
        Ok(chosen) => chosen,
        Err(response) => return response,
    };
    match front
        .forward(
            Some(account.id),
            (&host_id, &url),
            method,
            &uri,
            &headers,
            body.into(),
        )
        .await
    {
        Ok(response) => response,
        Err(e) => {
            tracing::warn!(host = url, error = %e, "agent unreachable for a volume create");
            no_capacity()
        }
    }
}

/// Naming a sandbox or a snapshot as a template: to the host that holds
/// it (the capture is made and kept there); 503 while that host is stale.
/// A template build runs on one host, which must hold what its `FROM`
/// restores: a Dockerfile naming an account's own (or a published)
/// template goes to that template's snapshot's host (503 while it is
/// stale); anything else to a live host in turn. The body is read to
/// [`limits::FORWARDED_BODY_MAX`] to find the Dockerfile (a Dockerfile and
/// its context are at most 50 MiB); a larger one (a root filesystem
/// tarball) is streamed on, what was read included, and bounded by the
/// agent (its tier's largest template disk).
async fn build_template(State(front): St, request: Request) -> Response {
    use futures::StreamExt as _;
    let (parts, body) = request.into_parts();
    let account = match front.caller(&parts).await {
        Ok(account) => account,
        Err(response) => return response,
    };
    let mut rest = body.into_data_stream();
    let mut head = Vec::new();
    let mut whole = true;
    while let Some(chunk) = rest.next().await {
        match chunk {
            Ok(chunk) => head.extend_from_slice(&chunk),
            Err(_) => return refuse(StatusCode::BAD_REQUEST, "reading the request body", None),
        }
        if head.len() > limits::FORWARDED_BODY_MAX {
            whole = false;
            break;
        }
    }
    let head = Bytes::from(head);
    let home = if whole {
        match front
            .build_home(&account, &parts.headers, head.clone())
            .await
        {
            Ok(Some(host)) => Some(host),
            Ok(None) => None,
            Err(response) => return response,
        }
    } else {
        None
    };
    let home = match home {
        Some(host) => host,
        None => match front.any_live_host().await {
            Ok(Some(host)) => host,
            Ok(None) => return no_capacity(),
            Err(response) => return response,
        },
    };
    let body = if whole {
        Body::from(head)
    } else {
        let first = futures::stream::once(async move { Ok::<_, axum::Error>(head) });
        Body::from_stream(first.chain(rest))
    };
    front
        .forward_home(account.id, Some(&home), false, parts, body)
        .await
}

/// The `dockerfile` field of a build's form (multipart, as the SDK sends
/// it, or urlencoded), if it has one.
async fn dockerfile_of(headers: &HeaderMap, body: Bytes) -> Option<String> {
    let content_type = headers.get(header::CONTENT_TYPE)?.to_str().ok()?.to_owned();
    if content_type.starts_with("application/x-www-form-urlencoded") {
        let fields: Vec<(String, String)> = serde_urlencoded::from_bytes(&body).ok()?;
        return fields
            .into_iter()
            .find(|(k, _)| k == "dockerfile")
            .map(|(_, v)| v);
    }
    let boundary = multer::parse_boundary(&content_type).ok()?;
    let mut form = multer::Multipart::new(
        futures::stream::once(async move { Ok::<_, std::convert::Infallible>(body) }),
        boundary,
    );
    while let Ok(Some(field)) = form.next_field().await {
        if field.name() == Some("dockerfile") {
            return field.text().await.ok();
        }
    }
    None
}

async fn create_template(State(front): St, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let (account, body) = match front.caller_and_body(&parts, body).await {
        Ok(found) => found,
        Err(response) => return response,
    };
    let named = create_body(&body);
    let text = |key: &str| named.get(key).and_then(|v| v.as_str()).map(str::to_owned);
    let home = if let Some(id) = text("from_sandbox") {
        match front.store.get_sandbox(account.id, &id).await {
            Ok(Some(row)) => row.host,
            Ok(None) => return refuse(StatusCode::NOT_FOUND, "sandbox not found", None),
            Err(e) => return database_error(e),
        }
    } else if let Some(id) = text("from_snapshot") {
        match front.store.get_snapshot(account.id, &id).await {
            Ok(Some(row)) => row.host,
            Ok(None) => return refuse(StatusCode::NOT_FOUND, "snapshot not found", None),
            Err(e) => return database_error(e),
        }
    } else {
        // Nothing to pin: any agent answers (and refuses it).
        return front
            .forward_to_any(
                Some(account.id),
                parts.method,
                &parts.uri,
                &parts.headers,
                body,
            )
            .await;
    };
    front
        .forward_home(account.id, home.as_deref(), false, parts, Body::from(body))
        .await
}

/// A request about one volume: to its host, which holds the image; a read
/// works from any agent when that host is stale.
async fn about_volume(State(front): St, Path(name): Path<String>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let (account, body) = match front.caller_and_body(&parts, body).await {
        Ok(found) => found,
        Err(response) => return response,
    };
    let (method, uri, headers) = (parts.method, parts.uri, parts.headers);
    let volume = match front.store.get_volume(account.id, &name).await {
        Ok(Some(volume)) => volume,
        Ok(None) => {
            return refuse(
                StatusCode::NOT_FOUND,
                &format!("volume not found: {name}"),
                None,
            )
        }
        Err(e) => return database_error(e),
    };
    let hosts = match front.routing_view().await {
        Ok(hosts) => hosts,
        Err(response) => return response,
    };
    let at = now();
    let home = hosts
        .iter()
        .find(|h| h.report.id == volume.host)
        .filter(|h| h.is_fresh(at, STALE_AFTER.as_secs_f64()));
    match home {
        Some(host) => front
            .forward(
                Some(account.id),
                (&host.report.id, &host.report.url),
                method,
                &uri,
                &headers,
                body.into(),
            )
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(host = host.report.id, error = %e, "volume host unreachable");
                volume_host_unavailable()
            }),
        None if method == Method::GET => {
            front
                .forward_to_any(Some(account.id), method, &uri, &headers, body)
                .await
        }
        None => volume_host_unavailable(),
    }
}

/// Routes that are not about one sandbox: any agent answers, once the
/// caller is known (the routes agents serve without a token, `limits::is_open`,
/// go without one); the body is held up to `limits::FORWARDED_BODY_MAX`.
async fn elsewhere(State(front): St, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let account = if limits::is_open(parts.uri.path()) {
        None
    } else {
        match front.caller(&parts).await {
            Ok(account) => Some(account.id),
            Err(response) => return response,
        }
    };
    let body = match limits::read_bounded(&parts.headers, body, limits::FORWARDED_BODY_MAX).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    let answer = front
        .forward_to_any(account, parts.method, &parts.uri, &parts.headers, body)
        .await;
    match account {
        Some(account) => {
            front
                .with_stored_env(account, parts.uri.path(), answer)
                .await
        }
        None => answer,
    }
}

/// The objects whose views carry a tenant's `env`, which an agent's
/// database role may not read for work it does not run.
#[derive(Clone, Copy)]
enum EnvView {
    Sweep,
    App,
}

impl EnvView {
    /// Which kind of view `path` answers with, if it carries an env:
    /// `/v1/sweeps[/{id}[/cancel|/requeue]]` and `/v1/apps[/{id}]` (never
    /// cells, and never an app's proxied traffic).
    fn of(path: &str) -> Option<EnvView> {
        let segments: Vec<&str> = path.trim_end_matches('/').split('/').collect();
        match segments.as_slice() {
            ["", "v1", "sweeps"] | ["", "v1", "sweeps", _] => Some(EnvView::Sweep),
            ["", "v1", "sweeps", _, "cancel" | "requeue" | "hold" | "release"] => {
                Some(EnvView::Sweep)
            }
            ["", "v1", "apps"] | ["", "v1", "apps", _] => Some(EnvView::App),
            _ => None,
        }
    }

    fn list_key(self) -> &'static str {
        match self {
            EnvView::Sweep => "sweeps",
            EnvView::App => "apps",
        }
    }
}

/// Largest view of sweeps or apps the front reads to fill envs in.
const ENV_VIEW_MAX: usize = 64 << 20;

impl Front {
    /// The stored env of each object of `view` by id: the account's whole
    /// list for a list view, else the one object's.
    async fn stored_envs(
        &self,
        kind: EnvView,
        account: i64,
        view: &serde_json::Value,
        is_list: bool,
    ) -> Result<HashMap<String, shoal_store::Metadata>, shoal_store::StoreError> {
        let id = view.get("id").and_then(|v| v.as_str());
        Ok(match (kind, is_list, id) {
            (EnvView::Sweep, true, _) => self
                .store
                .list_sweeps(account)
                .await?
                .into_iter()
                .map(|row| (row.id, row.env))
                .collect(),
            (EnvView::App, true, _) => self
                .store
                .list_apps(account)
                .await?
                .into_iter()
                .map(|row| (row.id, row.config.env))
                .collect(),
            (EnvView::Sweep, false, Some(id)) => self
                .store
                .get_sweep(account, id)
                .await?
                .map(|row| (row.id, row.env))
                .into_iter()
                .collect(),
            (EnvView::App, false, Some(id)) => self
                .store
                .get_app(account, id)
                .await?
                .map(|row| (row.id, row.config.env))
                .into_iter()
                .collect(),
            (_, false, None) => HashMap::new(),
        })
    }

    /// An agent's answer with each sweep's or app's `env` as stored: the
    /// agent's role sees `{}` for work it does not run (migrations/postgres/
    /// 0010), the front's own role reads it.
    async fn with_stored_env(&self, account: i64, path: &str, answer: Response) -> Response {
        let Some(kind) = EnvView::of(path) else {
            return answer;
        };
        let json = answer
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json"));
        if !answer.status().is_success() || !json {
            return answer;
        }
        let (mut parts, body) = answer.into_parts();
        let Ok(bytes) = axum::body::to_bytes(body, ENV_VIEW_MAX).await else {
            return refuse(
                StatusCode::BAD_GATEWAY,
                "the host's answer is too large",
                None,
            );
        };
        let Ok(mut view) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
            return Response::from_parts(parts, Body::from(bytes));
        };
        let is_list = matches!(view.get(kind.list_key()), Some(serde_json::Value::Array(_)));
        // A list's envs in one query, not one per object.
        let stored = match self.stored_envs(kind, account, &view, is_list).await {
            Ok(stored) => stored,
            Err(e) => return database_error(e),
        };
        let objects: Vec<&mut serde_json::Value> = if is_list {
            view[kind.list_key()]
                .as_array_mut()
                .map(|list| list.iter_mut().collect())
                .unwrap_or_default()
        } else {
            vec![&mut view]
        };
        for object in objects {
            let env = object
                .get("id")
                .and_then(|v| v.as_str())
                .and_then(|id| stored.get(id));
            if let (Some(env), true) = (env, object.get("env").is_some()) {
                object["env"] = json!(env);
            }
        }
        let filled = serde_json::to_vec(&view).unwrap_or_else(|_| bytes.to_vec());
        parts.headers.remove(header::CONTENT_LENGTH);
        Response::from_parts(parts, Body::from(filled))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_views_of_sweeps_and_apps_get_their_env_filled() {
        let kind = |path| EnvView::of(path).map(EnvView::list_key);
        for path in [
            "/v1/sweeps",
            "/v1/sweeps/",
            "/v1/sweeps/sw-1",
            "/v1/sweeps/sw-1/cancel",
        ] {
            assert_eq!(kind(path), Some("sweeps"), "{path}");
        }
        assert_eq!(kind("/v1/sweeps/sw-1/requeue"), Some("sweeps"));
        assert_eq!(kind("/v1/apps"), Some("apps"));
        assert_eq!(kind("/v1/apps/app-1"), Some("apps"));
        for path in [
            "/v1/sweeps/sw-1/cells",
            "/v1/sweeps/sw-1/cells/3",
            "/v1/apps/app-1/proxy",
            "/v1/apps/app-1/proxy/sweeps",
            "/v1/sandboxes",
            "/v1/usage",
        ] {
            assert_eq!(kind(path), None, "{path}");
        }
    }

    #[test]
    fn a_create_names_its_volumes_in_its_body() {
        let body = br#"{"template": "base", "volumes": [{"name": "data"}, {"name": "cache", "read_only": true}]}"#;
        let volume_names = |body: &[u8]| volume_names(&create_body(body));
        assert_eq!(volume_names(body), ["data", "cache"]);
        assert!(volume_names(br#"{"template": "base"}"#).is_empty());
        assert!(volume_names(b"not json").is_empty());
        assert!(volume_names(br#"{"volumes": "data"}"#).is_empty());
    }

    #[test]
    fn a_drained_or_draining_host_takes_no_work() {
        let fresh = host("a", 100.0);
        assert!(is_live(&fresh, 101.0));
        let mut drained = fresh.clone();
        drained.drained = true;
        assert!(!is_live(&drained, 101.0));
        let mut draining = fresh.clone();
        draining.report.draining = true;
        assert!(!is_live(&draining, 101.0));
    }

    fn host(id: &str, heartbeat_at: f64) -> HostRow {
        HostRow {
            report: HostReport {
                id: id.into(),
                url: format!("http://{id}"),
                vcpus: 2,
                cpu_busy: 0.0,
                memory_mib: 8192,
                available_mib: 8192,
                reserve_mib: 0,
                sandboxes: 0,
                max_sandboxes: None,
                pss_mib: 0,
                draining: false,
            },
            drained: false,
            registered_at: heartbeat_at,
            heartbeat_at,
            in_flight_sandboxes: 0,
            in_flight_memory_mib: 0,
            in_flight_cpu_share: 0.0,
        }
    }

    /// A create with a volume goes to the volume's host even when another
    /// is emptier, and nowhere when that host is stale.
    #[test]
    fn a_volume_pins_the_create_to_its_host() {
        let at = 1000.0;
        let mut busy = host("with-volume", at);
        busy.report.cpu_busy = 0.9;
        let hosts = [busy, host("idle", at)];
        let capacities: Vec<HostCapacity> = hosts.iter().map(|h| capacity(h, at)).collect();
        let request = |pinned: Option<&str>| PlacementRequest {
            memory_mib: SANDBOX_RESIDENT_MIB,
            cpu_share: SANDBOX_CPU_SHARE,
            pinned_to: pinned.map(str::to_string),
        };
        assert_eq!(
            shoal_placement::place(&request(None), &capacities)
                .unwrap()
                .id,
            "idle"
        );
        assert_eq!(
            shoal_placement::place(&request(Some("with-volume")), &capacities)
                .unwrap()
                .id,
            "with-volume"
        );
        let stale = [host("with-volume", at - 60.0), host("idle", at)];
        let capacities: Vec<HostCapacity> = stale.iter().map(|h| capacity(h, at)).collect();
        assert_eq!(
            shoal_placement::place(&request(Some("with-volume")), &capacities),
            Err(PlacementError::PinnedHostUnavailable)
        );
    }
}
