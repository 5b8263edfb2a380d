//! The front routes apps like sandboxes: a create is placed on a live host
//! and forwarded there; a request about an app goes to the host in its row
//! (with the client's address as `X-Forwarded-Host`). The agents here are
//! stand-ins that answer with their own name and what they were sent; the
//! database (SQLite) and HTTP are real. The real agents' side is
//! `crates/cli/tests/vm_apps.rs`.

mod common;

use axum::extract::Request;
use axum::routing::any;
use common::{now, report};
use serde_json::{json, Value};
use shoal_store::{AppConfig, NewApp, Store, Tier};

#[tokio::test]
async fn apps_are_placed_and_then_routed_to_their_host() {
    let dir = tempfile::tempdir().unwrap();
    // h2 has far more memory free: placement picks it for a create.
    let (store, url) = common::two_hosts(dir.path()).await;
    let token = store.create_token("alice", Tier::Team).await.unwrap();
    let account = store.authenticate(&token).await.unwrap().unwrap();

    let address = common::serve_front(&store, &url).await;
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

/// A stand-in agent whose views carry an `env` its database role could
/// not read (`{}`), and the account the front named.
async fn confined_stand_in() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new().fallback(any(|request: Request| async move {
        let account = request
            .headers()
            .get(shoal_fleet::ACCOUNT_HEADER)
            .map(|v| v.to_str().unwrap().to_owned());
        let path = request.uri().path().to_owned();
        let object = |id: &str| json!({"id": id, "env": {}, "account": account});
        axum::Json(match path.as_str() {
            "/v1/apps" => json!({"apps": [object("app-000000000002")]}),
            "/v1/sweeps" => json!({"sweeps": [object("sw-1")]}),
            "/v1/sweeps/sw-1/cells" => json!({"cells": [{"id": "sw-1", "env": {}}]}),
            // /v1/{kind}/{id}[/...]
            _ => object(path.split('/').nth(3).unwrap()),
        })
    }));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// Agents read no token and, for work they do not run, no env: the front
/// names the caller's account (a client's own header of that name never
/// passes) and fills each sweep's and app's stored env into the views.
#[tokio::test]
async fn the_front_names_the_account_and_fills_in_stored_envs() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("shoal.db").display());
    let store = Store::connect(&url).await.unwrap();
    let agent = confined_stand_in().await;
    store
        .report_host(&report("h1", &agent, 8_000), now())
        .await
        .unwrap();
    let token = store.create_token("alice", Tier::Team).await.unwrap();
    let account = store.authenticate(&token).await.unwrap().unwrap();
    let secret = |value: &str| -> shoal_store::Metadata {
        [("API_KEY".to_string(), value.to_string())].into()
    };
    let app = NewApp {
        id: "app-000000000002".into(),
        name: "api".into(),
        config: AppConfig {
            template: "base".into(),
            start_cmd: "true".into(),
            port: 80,
            env: secret("app-secret"),
            idle_seconds: 300,
        },
        host: Some("h1".into()),
    };
    store.insert_app(account.id, &app, now()).await.unwrap();
    let sweep = shoal_store::NewSweep {
        id: "sw-1".into(),
        account_id: account.id,
        name: "grid".into(),
        template: "base".into(),
        command: "true".into(),
        env: secret("sweep-secret"),
        cells: vec!["a".into()],
        throttle: 1,
        timeout_seconds: 60,
        max_attempts: 1,
        ..Default::default()
    };
    store.create_sweep(&sweep, now()).await.unwrap();

    let address = common::serve_front(&store, &url).await;
    let http = reqwest::Client::new();
    let get = |path: &str| {
        let request = http
            .get(format!("http://{address}{path}"))
            .bearer_auth(&token)
            .header(shoal_fleet::ACCOUNT_HEADER, "999999");
        async move { request.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    let me = account.id.to_string();
    let list = get("/v1/apps").await;
    assert_eq!(list["apps"][0]["env"]["API_KEY"], "app-secret", "{list}");
    assert_eq!(list["apps"][0]["account"], me.as_str(), "{list}");
    let one = get("/v1/apps/app-000000000002").await;
    assert_eq!(one["env"]["API_KEY"], "app-secret", "{one}");
    let sweeps = get("/v1/sweeps").await;
    assert_eq!(
        sweeps["sweeps"][0]["env"]["API_KEY"], "sweep-secret",
        "{sweeps}"
    );
    for path in ["/v1/sweeps/sw-1", "/v1/sweeps/sw-1/cancel"] {
        let view = get(path).await;
        assert_eq!(view["env"]["API_KEY"], "sweep-secret", "{path}: {view}");
        assert_eq!(view["account"], me.as_str(), "{view}");
    }
    // Not a view of a sweep: left as the agent said.
    let cells = get("/v1/sweeps/sw-1/cells").await;
    assert_eq!(cells["cells"][0]["env"], json!({}), "{cells}");
    // Another account's object is never filled from this one's.
    let other = store.create_token("bob", Tier::Team).await.unwrap();
    let theirs: Value = http
        .get(format!("http://{address}/v1/sweeps/sw-1"))
        .bearer_auth(&other)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(theirs["env"], json!({}), "{theirs}");
}
