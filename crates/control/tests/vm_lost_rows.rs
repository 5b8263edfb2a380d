//! A host that comes back after a front marked its sandboxes `lost` kills
//! the VMs of the rows it no longer owns (`lost`, deleted elsewhere, or
//! naming another host) within a lifecycle tick or two, so a sandbox never
//! runs twice; a neighbour whose row is live keeps running. On real VMs,
//! through a control plane served over HTTP.
//!
//! Runs on SQLite and, when `SHOAL_TEST_DATABASE_URL` names a PostgreSQL
//! server (`scripts/with-postgres`), on a fresh database there too. The
//! variants take turns: they share the binary's host agent.

use reqwest::Method;
use serde_json::json;
use shoal_control::{ControlConfig, ControlPlane};
use shoal_host::HostAgent;
use shoal_store::{SandboxPatch, Store, Tier};
use shoal_testkit::{ApiClient, TestDb};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::OnceCell;

const HOST: &str = "host-a";

static SERIAL: Mutex<()> = Mutex::new(());

async fn host() -> Arc<HostAgent> {
    static HOST: OnceCell<Arc<HostAgent>> = OnceCell::const_new();
    HOST.get_or_init(|| shoal_testkit::host_agent("vm_lost_rows"))
        .await
        .clone()
}

async fn stray_vms_are_killed(db: TestDb) {
    let host = host().await;
    let store = Store::connect(&db.url).await.expect("opening the store");
    let token = store.create_token("lost", Tier::Team).await.unwrap();
    let mut config = ControlConfig {
        host_name: HOST.into(),
        ..ControlConfig::default()
    };
    config.sweeps.enabled = false;
    config.lifecycle.reap_interval = Duration::from_millis(500);
    let cp = ControlPlane::new(store.clone(), host.clone(), config);
    cp.start_background().await.map_err(|e| e.message).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api = ApiClient::new(format!("http://{}", listener.local_addr().unwrap()), token);
    let serve = tokio::spawn(async move {
        axum::serve(listener, shoal_control::router(cp))
            .await
            .unwrap();
    });

    let mut ids = Vec::new();
    for _ in 0..4 {
        let made = api
            .ok(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "code-interpreter"})),
            )
            .await;
        ids.push(made["id"].as_str().unwrap().to_owned());
    }
    let [lost, deleted, moved, neighbour] = <[String; 4]>::try_from(ids).unwrap();
    let mut pids = Vec::new();
    for id in [&lost, &deleted, &moved] {
        let info = host.engine().get(id).await.unwrap();
        pids.push(info.pid.expect("a running VM has a QEMU"));
    }

    // What a front and another agent write while this host is silent.
    let set = |id: &str, patch: SandboxPatch| {
        let (store, id) = (store.clone(), id.to_owned());
        async move { assert!(store.update_sandbox(&id, patch).await.unwrap()) }
    };
    set(
        &lost,
        SandboxPatch {
            status: Some("lost".into()),
            ..SandboxPatch::default()
        },
    )
    .await;
    set(
        &deleted,
        SandboxPatch {
            status: Some("deleted".into()),
            deleted_at: Some(shoal_control::now()),
            ..SandboxPatch::default()
        },
    )
    .await;
    set(
        &moved,
        SandboxPatch {
            host: Some("host-b".into()),
            ..SandboxPatch::default()
        },
    )
    .await;

    let started = Instant::now();
    let gone = shoal_testkit::wait_until(Duration::from_secs(5), || async {
        let left = host.engine().list().await;
        [&lost, &deleted, &moved]
            .iter()
            .all(|id| left.iter().all(|vm| &&vm.id != id))
    })
    .await;
    assert!(
        gone,
        "stray VMs left after 5 s: {:?}",
        host.engine().list().await
    );
    eprintln!(
        "stray VMs killed {:?} after their rows changed",
        started.elapsed()
    );
    for pid in pids {
        assert!(
            shoal_testkit::wait_until(Duration::from_secs(5), || async {
                !shoal_testkit::alive(pid)
            })
            .await,
            "QEMU {pid} of a stray VM still runs"
        );
    }
    // The rows are left as the fleet wrote them.
    let status = |id: String| {
        let store = store.clone();
        async move { store.sandbox_by_id(&id).await.unwrap().unwrap() }
    };
    assert_eq!(status(lost.clone()).await.status, "lost");
    assert_eq!(status(moved.clone()).await.host.as_deref(), Some("host-b"));

    // The neighbour is untouched, and still answers after more ticks.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let out = api
        .ok(
            Method::POST,
            &format!("/v1/sandboxes/{neighbour}/exec"),
            Some(json!({"cmd": "hostname"})),
        )
        .await;
    assert_eq!(out["stdout"].as_str(), Some(&*format!("{neighbour}\n")));
    assert_eq!(status(neighbour.clone()).await.status, "running");

    let answer = api
        .call(Method::DELETE, &format!("/v1/sandboxes/{neighbour}"), None)
        .await;
    assert_eq!(answer.status, 204, "{}", answer.text);
    assert!(host.engine().list().await.is_empty());
    serve.abort();
    store.close().await;
    db.cleanup().await;
}

#[test]
fn stray_vms_are_killed_sqlite() {
    let _alone = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    shoal_testkit::block_on(async { stray_vms_are_killed(TestDb::sqlite().await).await });
}

#[test]
fn stray_vms_are_killed_postgres() {
    let _alone = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    shoal_testkit::block_on(async {
        if let Some(db) = TestDb::postgres().await {
            stray_vms_are_killed(db).await;
        }
    });
}
