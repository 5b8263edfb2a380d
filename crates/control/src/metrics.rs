//! Prometheus metrics of this process, served at `GET /metrics` in the text
//! exposition format (version 0.0.4) by the `prometheus` crate.
//!
//! Counters and histograms move where things happen: [`track`], a
//! middleware around the API's routes (requests by route and status;
//! create, fork and exec latency), [`ApiError`](crate::error::ApiError)'s
//! response (refusals by reason, quota hits), the sweep runner (claims),
//! the service's start (bake progress). Gauges are read at scrape time
//! ([`render`]) from the database and the engine, so they are never stale:
//! sandboxes by state and template, sweep cells by state, the host's
//! capacity.
//!
//! Who may scrape: an operator's bearer token set with `--metrics-token`
//! (`SHOAL_METRICS_TOKEN`), or, with none set, a peer on loopback. The
//! figures name no account; templates other than the first-party ones are
//! counted as `custom`, since an account's template names are its own.
//!
//! Owns: the registry and every metric's name. May not: hold a lock or a
//! database connection across a request's handling (scrapes are
//! serialised among themselves only).

use crate::ControlPlane;
use axum::extract::{ConnectInfo, MatchedPath, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

/// Every metric of this process.
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    operation_seconds: HistogramVec,
    refusals: IntCounterVec,
    quota_hits: IntCounter,
    sweep_claims: IntCounter,
    templates_total: IntGauge,
    templates_ready: IntGauge,
    sandboxes: IntGaugeVec,
    sweep_cells: IntGaugeVec,
    host_sandboxes: IntGauge,
    host_sandboxes_max: IntGauge,
    host_memory_limits_bytes: IntGauge,
    host_memory_total_bytes: IntGauge,
    host_memory_available_bytes: IntGauge,
    /// Scrape-time gauges are reset and refilled: one scrape at a time.
    scrape: tokio::sync::Mutex<()>,
    /// Placements and refusals per minute, for the console's fleet page.
    recent: std::sync::Mutex<Recent>,
}

/// The last [`Recent::MINUTES`] minutes of VMs placed on this host and
/// requests its API refused (every reason `refused` counts), oldest first.
#[derive(Debug, Default)]
struct Recent {
    /// `(minute start, placed, refused)`.
    minutes: std::collections::VecDeque<(u64, u64, u64)>,
}

impl Recent {
    const MINUTES: usize = 60;

    fn count(&mut self, at: f64, placed: u64, refused: u64) {
        let minute = (at.max(0.0) as u64) / 60 * 60;
        match self.minutes.back_mut() {
            Some(last) if last.0 == minute => {
                last.1 += placed;
                last.2 += refused;
            }
            // A clock stepped back: count into the newest minute rather
            // than break the order.
            Some(last) if last.0 > minute => {
                last.1 += placed;
                last.2 += refused;
            }
            _ => self.minutes.push_back((minute, placed, refused)),
        }
        while self.minutes.len() > Self::MINUTES {
            self.minutes.pop_front();
        }
    }

    /// Every minute of the last hour up to `at`'s, empty ones included.
    fn series(&self, at: f64) -> serde_json::Value {
        let now_minute = (at.max(0.0) as u64) / 60 * 60;
        let first = now_minute.saturating_sub(60 * (Self::MINUTES as u64 - 1));
        let (mut minute, mut placed, mut refused) = (vec![], vec![], vec![]);
        for m in (first..=now_minute).step_by(60) {
            let found = self.minutes.iter().find(|(start, ..)| *start == m);
            minute.push(m);
            placed.push(found.map_or(0, |f| f.1));
            refused.push(found.map_or(0, |f| f.2));
        }
        serde_json::json!({ "minute": minute, "placed": placed, "refused": refused })
    }
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

/// This process's metrics.
pub fn metrics() -> &'static Metrics {
    &METRICS
}

impl Metrics {
    fn new() -> Metrics {
        let registry = Registry::new();
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            registered(&registry, IntCounterVec::new(Opts::new(name, help), labels))
        };
        let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            registered(&registry, IntGaugeVec::new(Opts::new(name, help), labels))
        };
        let counter = |name: &str, help: &str| registered(&registry, IntCounter::new(name, help));
        let gauge = |name: &str, help: &str| registered(&registry, IntGauge::new(name, help));
        let operation_seconds = registered(
            &registry,
            HistogramVec::new(
                HistogramOpts::new(
                    "shoal_operation_duration_seconds",
                    "Wall time of successful sandbox operations, from request to answer.",
                )
                .buckets(vec![
                    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                ]),
                &["operation"],
            ),
        );
        Metrics {
            requests: counter_vec(
                "shoal_http_requests_total",
                "API requests answered, by method, route and status code.",
                &["method", "route", "status"],
            ),
            operation_seconds,
            refusals: counter_vec(
                "shoal_refusals_total",
                "Requests refused for want of room or allowance, by reason.",
                &["reason"],
            ),
            quota_hits: counter(
                "shoal_quota_hits_total",
                "Requests refused because an account reached a quota of its tier.",
            ),
            sweep_claims: counter(
                "shoal_sweep_claims_total",
                "Sweep cells claimed by this host's runner.",
            ),
            templates_total: gauge(
                "shoal_templates_total",
                "First-party templates this host bakes at start.",
            ),
            templates_ready: gauge(
                "shoal_templates_ready",
                "First-party templates baked and checked so far.",
            ),
            sandboxes: gauge_vec(
                "shoal_sandboxes",
                "Sandboxes not deleted, by state and template (`custom` for accounts' own).",
                &["state", "template"],
            ),
            sweep_cells: gauge_vec(
                "shoal_sweep_cells",
                "Cells of every sweep, by state.",
                &["state"],
            ),
            host_sandboxes: gauge(
                "shoal_host_sandboxes",
                "VMs with a process on this host (hibernated ones hold nothing).",
            ),
            host_sandboxes_max: gauge(
                "shoal_host_sandboxes_max",
                "The most VMs this host holds at once (0: no limit but memory).",
            ),
            host_memory_limits_bytes: gauge(
                "shoal_host_memory_limits_bytes",
                "The sum of this host's VMs' memory limits.",
            ),
            host_memory_total_bytes: gauge("shoal_host_memory_total_bytes", "The host's memory."),
            host_memory_available_bytes: gauge(
                "shoal_host_memory_available_bytes",
                "The host's available memory (MemAvailable).",
            ),
            registry,
            scrape: tokio::sync::Mutex::new(()),
            recent: std::sync::Mutex::new(Recent::default()),
        }
    }

    /// A refusal the API answered with `status` and `message`.
    pub(crate) fn refused(&self, status: StatusCode, message: &str) {
        let reason = match status {
            StatusCode::TOO_MANY_REQUESTS if message.starts_with("quota exceeded") => {
                self.quota_hits.inc();
                "quota"
            }
            StatusCode::TOO_MANY_REQUESTS => "rate_limit",
            StatusCode::SERVICE_UNAVAILABLE => "no_capacity",
            StatusCode::INSUFFICIENT_STORAGE if message.contains("memory") => "host_memory",
            StatusCode::INSUFFICIENT_STORAGE => "host_storage",
            _ => return,
        };
        self.refusals.with_label_values(&[reason]).inc();
        self.count_recent(0, 1);
    }

    /// VMs placed on this host (creates, forks, sweep cells, apps).
    pub(crate) fn placed(&self, count: u64) {
        self.count_recent(count, 0);
    }

    fn count_recent(&self, placed: u64, refused: u64) {
        self.recent
            .lock()
            .expect("never poisoned: no panic while held")
            .count(crate::now(), placed, refused);
    }

    /// Creates placed and requests refused per minute over the last hour:
    /// `{minute: [unix seconds], placed: [n], refused: [n]}`.
    pub fn recent_placements(&self) -> serde_json::Value {
        self.recent
            .lock()
            .expect("never poisoned: no panic while held")
            .series(crate::now())
    }

    /// Cells the sweep runner claimed.
    pub fn claimed(&self, cells: u64) {
        self.sweep_claims.inc_by(cells);
    }

    /// Bake progress at start: `ready` of `total` first-party templates.
    pub fn templates(&self, ready: usize, total: usize) {
        self.templates_ready.set(ready as i64);
        self.templates_total.set(total as i64);
    }

    /// The text exposition of what is counted so far, without reading the
    /// database or the host (what a service that is still starting shows).
    pub fn render_counters(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding into memory");
        String::from_utf8(out).expect("the text format is UTF-8")
    }

    /// Refreshes the scrape-time gauges from `cp`'s database and host, then
    /// renders everything.
    pub async fn render(&self, cp: &ControlPlane) -> String {
        let _one_at_a_time = self.scrape.lock().await;
        self.sandboxes.reset();
        match cp.store.list_all_live().await {
            Ok(rows) => {
                for row in rows {
                    let template = if shoal_image::find_template(&row.template).is_some() {
                        row.template.as_str()
                    } else {
                        "custom"
                    };
                    self.sandboxes
                        .with_label_values(&[row.status.as_str(), template])
                        .inc();
                }
            }
            Err(e) => tracing::warn!(error = e.chain(), "metrics: listing sandboxes"),
        }
        self.sweep_cells.reset();
        match cp.store.cell_counts_by_state().await {
            Ok(counts) => {
                for (state, n) in counts {
                    self.sweep_cells
                        .with_label_values(&[state.as_str()])
                        .set(n as i64);
                }
            }
            Err(e) => tracing::debug!(error = e.chain(), "metrics: counting sweep cells"),
        }
        let held = cp.host.held().await;
        self.host_sandboxes.set(held.sandboxes as i64);
        self.host_memory_limits_bytes
            .set((held.memory_mib << 20) as i64);
        let (max, _) = cp.host.capacity_limits();
        self.host_sandboxes_max.set(max.unwrap_or(0) as i64);
        let mib = |field| shoal_host::meminfo_mib(field).unwrap_or(0) << 20;
        self.host_memory_total_bytes.set(mib("MemTotal:") as i64);
        self.host_memory_available_bytes
            .set(mib("MemAvailable:") as i64);
        self.render_counters()
    }
}

/// `metric`, registered with `registry` (which keeps a handle to it).
fn registered<M: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    metric: prometheus::Result<M>,
) -> M {
    let metric = metric.expect("valid metric");
    registry
        .register(Box::new(metric.clone()))
        .expect("registered once");
    metric
}

/// The operation a route is, for the latency histogram.
fn operation(method: &Method, route: &str) -> Option<&'static str> {
    let sandbox = crate::SANDBOX_ROUTE;
    match (method, route.strip_prefix(sandbox)) {
        (&Method::POST, _) if route == "/v1/sandboxes" => Some("create"),
        (&Method::POST, Some("/fork")) => Some("fork"),
        (&Method::POST, Some("/exec")) => Some("exec"),
        (&Method::POST, Some("/hibernate")) => Some("hibernate"),
        (&Method::POST, Some("/wake")) => Some("wake"),
        (&Method::POST, Some("/snapshot")) => Some("snapshot"),
        _ => None,
    }
}

/// Counts every answered request by its route (the pattern, never the
/// path, which holds ids) and times the sandbox operations.
pub async fn track(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned());
    let response = next.run(request).await;
    let Some(route) = route else {
        return response;
    };
    let status = response.status();
    let metrics = metrics();
    metrics
        .requests
        .with_label_values(&[method.as_str(), route.as_str(), status.as_str()])
        .inc();
    if status.is_success() {
        if let Some(operation) = operation(&method, &route) {
            metrics
                .operation_seconds
                .with_label_values(&[operation])
                .observe(started.elapsed().as_secs_f64());
        }
    }
    response
}

/// Whether the caller may read the metrics: the operator's metrics token,
/// or a loopback peer when none is set.
pub(crate) fn may_scrape(
    token: Option<&str>,
    headers: &HeaderMap,
    peer: Option<SocketAddr>,
) -> bool {
    match token {
        Some(token) => headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| {
                use sha2::Digest;
                // Compared as digests, so the time taken says nothing of
                // how much of the token matched.
                sha2::Sha256::digest(given.as_bytes()) == sha2::Sha256::digest(token.as_bytes())
            }),
        None => peer.is_some_and(|p| p.ip().is_loopback()),
    }
}

/// The peer's address, where the server recorded it.
pub(crate) fn peer_of(request: &Request) -> Option<SocketAddr> {
    request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|info| info.0)
}

/// `GET /metrics`.
pub async fn serve(State(cp): State<Arc<ControlPlane>>, request: Request) -> Response {
    if !may_scrape(
        cp.config.metrics_token.as_deref(),
        request.headers(),
        peer_of(&request),
    ) {
        return crate::error::ApiError::new(
            StatusCode::UNAUTHORIZED,
            "metrics need the operator's metrics token (or a loopback peer when none is set)",
        )
        .into_response();
    }
    let text = metrics().render(&cp).await;
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    #[test]
    fn recent_placements_fill_every_minute_of_the_hour_and_forget_older_ones() {
        let mut recent = Recent::default();
        // Minutes start at multiples of 60 s: 600_000 is one.
        recent.count(600_000.0 - 3600.0, 5, 5);
        recent.count(600_000.0, 1, 0);
        recent.count(600_010.0, 1, 2);
        recent.count(600_070.0, 0, 1);
        let series = recent.series(600_090.0);
        let minutes = series["minute"].as_array().unwrap();
        assert_eq!(minutes.len(), Recent::MINUTES);
        assert_eq!(minutes.last().unwrap(), 600_060);
        let placed: Vec<u64> = serde_json::from_value(series["placed"].clone()).unwrap();
        let refused: Vec<u64> = serde_json::from_value(series["refused"].clone()).unwrap();
        assert_eq!(&placed[placed.len() - 2..], &[2, 0]);
        assert_eq!(&refused[refused.len() - 2..], &[2, 1]);
        // The counts of an hour ago are out of the window.
        assert_eq!(placed.iter().sum::<u64>(), 2);
        assert_eq!(refused.iter().sum::<u64>(), 3);
        for minute in 0..100 {
            recent.count(600_090.0 + 60.0 * minute as f64, 1, 0);
        }
        assert!(recent.minutes.len() <= Recent::MINUTES);
    }

    use super::*;

    #[test]
    fn routes_name_their_operations() {
        let sandbox = crate::SANDBOX_ROUTE;
        assert_eq!(operation(&Method::POST, "/v1/sandboxes"), Some("create"));
        assert_eq!(operation(&Method::GET, "/v1/sandboxes"), None);
        assert_eq!(
            operation(&Method::POST, &format!("{sandbox}/fork")),
            Some("fork")
        );
        assert_eq!(
            operation(&Method::POST, &format!("{sandbox}/exec")),
            Some("exec")
        );
        assert_eq!(
            operation(&Method::POST, &format!("{sandbox}/exec/ws")),
            None
        );
    }

    #[test]
    fn refusals_count_by_reason() {
        let m = metrics();
        let quota = m.refusals.with_label_values(&["quota"]).get();
        let hits = m.quota_hits.get();
        let full = m.refusals.with_label_values(&["no_capacity"]).get();
        m.refused(
            StatusCode::TOO_MANY_REQUESTS,
            "quota exceeded: the concurrent sandboxes",
        );
        m.refused(
            StatusCode::SERVICE_UNAVAILABLE,
            "no compute capacity available",
        );
        m.refused(StatusCode::NOT_FOUND, "sandbox not found");
        assert_eq!(m.refusals.with_label_values(&["quota"]).get(), quota + 1);
        assert_eq!(m.quota_hits.get(), hits + 1);
        assert_eq!(
            m.refusals.with_label_values(&["no_capacity"]).get(),
            full + 1
        );
        let text = m.render_counters();
        assert!(
            text.contains("shoal_refusals_total{reason=\"quota\"}"),
            "{text}"
        );
    }

    #[test]
    fn scraping_needs_the_token_or_loopback() {
        let loopback: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let remote: SocketAddr = "192.0.2.7:5000".parse().unwrap();
        let none = HeaderMap::new();
        assert!(may_scrape(None, &none, Some(loopback)));
        assert!(!may_scrape(None, &none, Some(remote)));
        assert!(!may_scrape(None, &none, None));
        let mut bearer = HeaderMap::new();
        bearer.insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert!(may_scrape(Some("s3cret"), &bearer, Some(remote)));
        assert!(!may_scrape(Some("other"), &bearer, Some(loopback)));
        assert!(!may_scrape(Some("s3cret"), &none, Some(loopback)));
    }
}
