//! What the front's tests share: stand-in agents, host reports and a front
//! served on a loopback port. The database and HTTP are real; the agents
//! answer with what they were sent, so a test sees where a request went.
#![allow(dead_code)]

use axum::extract::Request;
use axum::routing::any;
use serde_json::json;
use shoal_fleet::front::{self, Front, FrontConfig};
use shoal_store::{HostReport, Store};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// A stand-in agent: answers every request with its name, method, path,
/// X-Forwarded-Host and the number of body bytes it received.
pub async fn stand_in(name: &'static str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new().fallback(any(move |request: Request| async move {
        let method = request.method().as_str().to_owned();
        let path = request.uri().path().to_owned();
        let forwarded = request
            .headers()
            .get("x-forwarded-host")
            .map(|v| v.to_str().unwrap().to_owned());
        let body = axum::body::to_bytes(request.into_body(), usize::MAX)
            .await
            .unwrap();
        axum::Json(json!({
            "host": name,
            "method": method,
            "path": path,
            "forwarded_host": forwarded,
            "body_bytes": body.len(),
        }))
    }));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// A live host's report: 16 GB, `available_mib` of it free.
pub fn report(id: &str, url: &str, available_mib: u64) -> HostReport {
    HostReport {
        id: id.into(),
        url: url.into(),
        vcpus: 2,
        cpu_busy: 0.0,
        memory_mib: 16_000,
        available_mib,
        reserve_mib: 1_024,
        sandboxes: 0,
        max_sandboxes: None,
        pss_mib: 0,
        draining: false,
    }
}

pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// An SQLite store in `dir` (and its URL) with two live stand-in hosts:
/// `h1` with little memory free, `h2` with much, so placement prefers `h2`
/// unless something pins a request to `h1`.
pub async fn two_hosts(dir: &std::path::Path) -> (Store, String) {
    let url = format!("sqlite:{}", dir.join("shoal.db").display());
    let store = Store::connect(&url).await.unwrap();
    for (name, free_mib) in [("h1", 2_000), ("h2", 14_000)] {
        let agent = stand_in(name).await;
        store
            .report_host(&report(name, &agent, free_mib), now())
            .await
            .unwrap();
    }
    (store, url)
}

/// A front over `store` (opened from `database_url`), with the default
/// limits and no lost-marking during the test, serving plain HTTP on a
/// loopback port.
pub async fn serve_front(store: &Store, database_url: &str) -> SocketAddr {
    let front: Arc<Front> = Front::new(
        store.clone(),
        FrontConfig {
            agent_ca: None,
            fleet_token: "fleet".into(),
            database_url: database_url.to_owned(),
            lost_check: Duration::from_secs(3600),
        },
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, front::router(front)).await.unwrap();
    });
    address
}
