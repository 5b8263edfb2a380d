//! The front routes apps like sandboxes: a create is placed on a live host
//! and forwarded there; a request about an app goes to the host in its row
//! (with the client's address as `X-Forwarded-Host`). The agents here are
//! stand-ins that answer with their own name and what they were sent; the
//! database (SQLite) and HTTP are real. The real agents' side is
//! `crates/cli/tests/vm_apps.rs`.

use axum::extract::Request;
use axum::routing::any;
use serde_json::{json, Value};
use shoal_fleet::front::{self, Front, FrontConfig};
use shoal_store::{AppConfig, HostReport, NewApp, Store, Tier};
use std::time::Duration;

/// A stand-in agent: answers every request with its name, method, path
/// and X-Forwarded-Host.
async fn stand_in(name: &'static str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new().fallback(any(move |request: Request| async move {
        let forwarded = request
            .headers()
            .get("x-forwarded-host")
            .map(|v| v.to_str().unwrap().to_owned());
        axum::Json(json!({
            "host": name,
            "method": request.method().as_str(),
            "path": request.uri().path(),
            "forwarded_host": forwarded,
        }))
    }));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

fn report(id: &str, url: &str, available_mib: u64) -> HostReport {
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

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[tokio::test]
async fn apps_are_placed_and_then_routed_to_their_host() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("shoal.db").display());
    let store = Store::connect(&url).await.unwrap();
    let (h1, h2) = (stand_in("h1").await, stand_in("h2").await);
    // h2 has far more memory free: placement picks it for a create.
    store
        .report_host(&report("h1", &h1, 2_000), now())
        .await
        .unwrap();
    store
        .report_host(&report("h2", &h2, 14_000), now())
        .await
        .unwrap();
    let token = store.create_token("alice", Tier::Team).await.unwrap();
    let account = store.authenticate(&token).await.unwrap().unwrap();

    let front = Front::new(
        store.clone(),
        FrontConfig {
            agent_ca: None,
            fleet_token: "fleet".into(),
            database_url: url,
            lost_check: Duration::from_secs(3600),
        },
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, front::router(front)).await.unwrap();
    });
    let base = format!("http://{address}");
    let http = reqwest::Client::new();
    let call = |method: reqwest::Method, path: &str| {
        http.request(method, format!("{base}{path}"))
            .bearer_auth(&token)
    };

    let created: Value = call(reqwest::Method::POST, "/v1/apps")
        .json(&json!({"name": "web", "start_cmd": "true", "port": 80}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(created["host"], "h2", "{created}");
    assert_eq!(created["path"], "/v1/apps");

    // An app of h1's (as h1's agent would have recorded it).
    let app = NewApp {
        id: "app-000000000001".into(),
        name: "web".into(),
        config: AppConfig {
            template: "base".into(),
            start_cmd: "true".into(),
            port: 80,
            env: Default::default(),
            idle_seconds: 300,
        },
        host: Some("h1".into()),
    };
    store.insert_app(account.id, &app, now()).await.unwrap();
    for path in [
        "/v1/apps/app-000000000001",
        "/v1/apps/app-000000000001/proxy",
        "/v1/apps/app-000000000001/proxy/",
        "/v1/apps/app-000000000001/proxy/a/b?c=d",
    ] {
        let answer: Value = call(reqwest::Method::GET, path)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(answer["host"], "h1", "{path}: {answer}");
        assert_eq!(answer["forwarded_host"], address.to_string(), "{answer}");
    }
    // Another account's, unknown and deleted apps stop at the front.
    let other = store.create_token("bob", Tier::Team).await.unwrap();
    let answer = http
        .get(format!("{base}/v1/apps/app-000000000001"))
        .bearer_auth(&other)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::NOT_FOUND);
    store
        .delete_app(account.id, "app-000000000001", now())
        .await
        .unwrap();
    let answer = call(reqwest::Method::GET, "/v1/apps/app-000000000001/proxy/")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::NOT_FOUND);
    let list: Value = call(reqwest::Method::GET, "/v1/apps")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["path"], "/v1/apps", "a list goes to any agent");
}
