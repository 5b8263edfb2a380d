//! Whether the service is ready, and what it answers until it is.
//!
//! A service binds its port first and answers at once: `/healthz` (the
//! process is alive: 200 from the first moment), `/readyz` (503 with what
//! it is doing, e.g. baking templates with their progress, until the API
//! is served; then 200) and `/metrics`; every other path is a 503 with
//! Retry-After that says why. Once the host is open, the templates baked
//! and the database reconciled, [`RouterSwitch::serve`] puts the API's
//! router in place, on the same listener.
//!
//! Owns: the start-up phase and the switch between routers. May not: do
//! any of the start-up work itself (`shoal up`, `shoal agent` and `shoal
//! server` do, and report it here).

use crate::error::ApiError;
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

/// What a starting service is doing; shared by whoever does it and the
/// routes that report it.
#[derive(Default)]
pub struct Readiness {
    state: Mutex<Phase>,
}

#[derive(Default)]
struct Phase {
    what: String,
    templates_total: usize,
    templates_ready: usize,
    /// The template being baked or checked, and since when.
    baking: Option<(String, Instant)>,
}

impl Readiness {
    pub fn new(what: &str) -> Arc<Readiness> {
        let readiness = Arc::new(Readiness::default());
        readiness.phase(what);
        readiness
    }

    /// What the service does now (shown by `/readyz` and every 503).
    pub fn phase(&self, what: &str) {
        self.state.lock().unwrap().what = what.to_owned();
    }

    /// Baking starts: `total` templates to build or check.
    pub fn templates(&self, total: usize) {
        let mut state = self.state.lock().unwrap();
        state.templates_total = total;
        state.templates_ready = 0;
        crate::metrics::metrics().templates(0, total);
    }

    /// Template `name` is being built (or checked, when it is current).
    pub fn baking(&self, name: &str) {
        self.state.lock().unwrap().baking = Some((name.to_owned(), Instant::now()));
    }

    /// One more template is ready.
    pub fn template_ready(&self) {
        let mut state = self.state.lock().unwrap();
        state.templates_ready += 1;
        state.baking = None;
        crate::metrics::metrics().templates(state.templates_ready, state.templates_total);
    }

    /// `/readyz`'s answer while starting.
    pub fn report(&self) -> Value {
        let state = self.state.lock().unwrap();
        let mut report = json!({
            "ready": false,
            "reason": state.what,
        });
        if state.templates_total > 0 {
            report["templates"] = json!({
                "ready": state.templates_ready,
                "total": state.templates_total,
                "baking": state.baking.as_ref().map(|(name, _)| name),
                "baking_seconds": state.baking.as_ref().map(|(_, since)| since.elapsed().as_secs()),
            });
        }
        report
    }

    fn sentence(&self) -> String {
        let state = self.state.lock().unwrap();
        match (&state.baking, state.templates_total) {
            (Some((name, _)), total) if total > 0 => format!(
                "{} ({} of {total} templates ready, now {name})",
                state.what, state.templates_ready
            ),
            _ => state.what.clone(),
        }
    }
}

/// What a service answers while it starts.
pub fn starting_router(readiness: Arc<Readiness>) -> Router {
    let for_readyz = readiness.clone();
    Router::new()
        .route("/healthz", get(crate::meta::healthz))
        .route(
            "/readyz",
            get(
                move || async move { (StatusCode::SERVICE_UNAVAILABLE, Json(for_readyz.report())) },
            ),
        )
        .route("/metrics", get(starting_metrics))
        .fallback(move || async move {
            ApiError {
                retry_after: Some(10),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("the service is starting: {}", readiness.sentence()),
                )
            }
        })
}

/// `/metrics` while starting: the counters (bake progress among them);
/// nothing that needs the database. Only to loopback peers: the
/// operator's token is not known before the configuration is read.
async fn starting_metrics(request: Request) -> Response {
    let peer = crate::metrics::peer_of(&request);
    if !crate::metrics::may_scrape(None, request.headers(), peer) {
        return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the service is starting")
            .into_response();
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        crate::metrics::metrics().render_counters(),
    )
        .into_response()
}

/// `/readyz` once the API is served.
pub async fn ready() -> Json<Value> {
    Json(json!({ "ready": true }))
}

/// One listener, the starting router first and the API's once it is
/// ready. Each request is handed to whichever is in place when it
/// arrives (a clone of a router is a reference count).
#[derive(Clone)]
pub struct RouterSwitch {
    current: Arc<RwLock<Router>>,
}

impl RouterSwitch {
    pub fn new(first: Router) -> RouterSwitch {
        RouterSwitch {
            current: Arc::new(RwLock::new(first)),
        }
    }

    /// From now on, requests go to `router`.
    pub fn serve(&self, router: Router) {
        *self.current.write().unwrap() = router;
    }

    /// The router to serve: it forwards to the current one.
    pub fn router(&self) -> Router {
        let current = self.current.clone();
        Router::new().fallback_service(tower::service_fn(move |request: Request| {
            let router = current.read().unwrap().clone();
            async move {
                use tower::ServiceExt as _;
                router.oneshot(request).await
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use tower::ServiceExt as _;

    async fn get_status(router: &Router, path: &str) -> (StatusCode, Value) {
        let response = router
            .clone()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    #[tokio::test]
    async fn a_starting_service_says_why_it_is_not_ready_then_switches() {
        let readiness = Readiness::new("baking templates");
        readiness.templates(3);
        readiness.template_ready();
        readiness.baking("code-interpreter");
        let switch = RouterSwitch::new(starting_router(readiness.clone()));
        let served = switch.router();
        assert_eq!(get_status(&served, "/healthz").await.0, StatusCode::OK);
        let (status, report) = get_status(&served, "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(report["reason"], "baking templates");
        assert_eq!(report["templates"]["ready"], 1);
        assert_eq!(report["templates"]["total"], 3);
        assert_eq!(report["templates"]["baking"], "code-interpreter");
        let (status, body) = get_status(&served, "/v1/sandboxes").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            body["error"]
                .as_str()
                .unwrap()
                .contains("1 of 3 templates ready, now code-interpreter"),
            "{body}"
        );

        switch.serve(Router::new().route("/readyz", get(ready)));
        let (status, report) = get_status(&served, "/readyz").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(report["ready"], true);
    }
}
