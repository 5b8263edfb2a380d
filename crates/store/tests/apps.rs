//! App rows against real databases (see `common`).

mod common;

use std::sync::Arc;

use common::Db;
use shoal_store::{
    app_status, AppConfig, AppConfigPatch, AppState, NewApp, Store, StoreError, Tier,
};

const T0: f64 = 1_800_000_000.0;

cases!(
    names_are_unique_per_account_until_deleted,
    state_changes_skip_deleted_apps_and_move_status_at,
    config_patches_and_activity,
    a_host_drives_only_its_own_live_apps,
    a_host_reads_and_changes_only_its_own_apps_env,
);

async fn account(store: &Store, name: &str) -> i64 {
    let token = store.create_token(name, Tier::Free).await.unwrap();
    store.authenticate(&token).await.unwrap().unwrap().id
}

fn new_app(id: &str, name: &str, host: &str) -> NewApp {
    NewApp {
        id: id.into(),
        name: name.into(),
        config: AppConfig {
            template: "code-interpreter".into(),
            start_cmd: "python3 -m http.server 8000".into(),
            port: 8000,
            env: [("GREETING".to_string(), "hi there".to_string())].into(),
            idle_seconds: 300,
        },
        host: Some(host.into()),
    }
}

async fn names_are_unique_per_account_until_deleted(db: Arc<Db>) {
    let store = &db.store;
    let (alice, bob) = (account(store, "alice").await, account(store, "bob").await);
    let first = store
        .insert_app(alice, &new_app("app-1", "web", "local"), T0)
        .await
        .unwrap();
    assert_eq!(first.state.status, app_status::DEPLOYING);
    assert_eq!(store.get_app(alice, "app-1").await.unwrap(), Some(first));
    // Another account's name space is its own; the owner's is not.
    store
        .insert_app(bob, &new_app("app-2", "web", "local"), T0)
        .await
        .unwrap();
    let taken = store
        .insert_app(alice, &new_app("app-3", "web", "local"), T0)
        .await
        .unwrap_err();
    assert!(
        matches!(&taken, StoreError::AlreadyExists { what: "app", id } if id == "web"),
        "{taken:?}"
    );
    assert_eq!(store.get_app(alice, "app-3").await.unwrap(), None);
    // Tenancy: bob does not see alice's app.
    assert_eq!(store.get_app(bob, "app-1").await.unwrap(), None);
    assert!(!store.delete_app(bob, "app-1", T0 + 1.0).await.unwrap());

    assert!(store.delete_app(alice, "app-1", T0 + 1.0).await.unwrap());
    assert!(!store.delete_app(alice, "app-1", T0 + 2.0).await.unwrap());
    let deleted = store.get_app(alice, "app-1").await.unwrap().unwrap();
    assert_eq!(deleted.state.status, app_status::DELETED);
    assert_eq!(deleted.deleted_at, Some(T0 + 1.0));
    assert!(store.list_apps(alice).await.unwrap().is_empty());
    // The name is free again.
    store
        .insert_app(alice, &new_app("app-3", "web", "local"), T0 + 3.0)
        .await
        .unwrap();
    let listed: Vec<String> = store
        .list_apps(alice)
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.id)
        .collect();
    assert_eq!(listed, ["app-3"]);
}

async fn state_changes_skip_deleted_apps_and_move_status_at(db: Arc<Db>) {
    let store = &db.store;
    let alice = account(store, "alice").await;
    store
        .insert_app(alice, &new_app("app-1", "web", "local"), T0)
        .await
        .unwrap();
    let waiting = AppState {
        status: app_status::WAITING_CAPACITY.into(),
        sandbox_id: None,
        attempts: 2,
        next_attempt_at: Some(T0 + 15.0),
        last_error: Some("no compute capacity available".into()),
    };
    assert!(store
        .set_app_state("app-1", &waiting, T0 + 5.0)
        .await
        .unwrap());
    let row = store.app_by_id("app-1").await.unwrap().unwrap();
    assert_eq!(row.state, waiting);
    assert_eq!(row.status_at, T0 + 5.0);
    // Same status: status_at stays.
    let again = AppState {
        attempts: 3,
        ..waiting.clone()
    };
    assert!(store
        .set_app_state("app-1", &again, T0 + 20.0)
        .await
        .unwrap());
    let row = store.app_by_id("app-1").await.unwrap().unwrap();
    assert_eq!((row.state.attempts, row.status_at), (3, T0 + 5.0));
    // A whole state is written: fields are cleared too.
    let running = AppState {
        status: app_status::RUNNING.into(),
        sandbox_id: Some("sb-000000000001".into()),
        ..AppState::default()
    };
    assert!(store
        .set_app_state("app-1", &running, T0 + 30.0)
        .await
        .unwrap());
    let row = store.app_by_id("app-1").await.unwrap().unwrap();
    assert_eq!(row.state, running);
    assert_eq!(row.status_at, T0 + 30.0);

    store.delete_app(alice, "app-1", T0 + 40.0).await.unwrap();
    assert!(!store
        .set_app_state("app-1", &running, T0 + 50.0)
        .await
        .unwrap());
    assert!(!store.set_app_state("nope", &running, T0).await.unwrap());
    let row = store.app_by_id("app-1").await.unwrap().unwrap();
    assert_eq!(row.state.status, app_status::DELETED);
    // The sandbox stays recorded, for whoever stops it.
    assert_eq!(row.state.sandbox_id.as_deref(), Some("sb-000000000001"));
}

async fn config_patches_and_activity(db: Arc<Db>) {
    let store = &db.store;
    let alice = account(store, "alice").await;
    let before = store
        .insert_app(alice, &new_app("app-1", "web", "local"), T0)
        .await
        .unwrap();
    let patch = AppConfigPatch {
        port: Some(9000),
        env: Some([("A".to_string(), "b".to_string())].into()),
        ..AppConfigPatch::default()
    };
    assert!(store.set_app_config("app-1", &patch).await.unwrap());
    let row = store.app_by_id("app-1").await.unwrap().unwrap();
    assert_eq!(row.config.port, 9000);
    assert_eq!(row.config.env.get("A").map(String::as_str), Some("b"));
    assert_eq!(row.config.start_cmd, before.config.start_cmd);
    assert_eq!(row.config.idle_seconds, 300);

    assert_eq!(row.last_request_at, None);
    store.touch_app("app-1", T0 + 10.0).await.unwrap();
    store.touch_app("app-1", T0 + 5.0).await.unwrap();
    let row = store.app_by_id("app-1").await.unwrap().unwrap();
    assert_eq!(row.last_request_at, Some(T0 + 10.0));

    store.delete_app(alice, "app-1", T0 + 20.0).await.unwrap();
    assert!(!store.set_app_config("app-1", &patch).await.unwrap());
}

async fn a_host_drives_only_its_own_live_apps(db: Arc<Db>) {
    let store = &db.store;
    let alice = account(store, "alice").await;
    for (id, name, host) in [
        ("app-1", "a", "h1"),
        ("app-2", "b", "h2"),
        ("app-3", "c", "h1"),
        ("app-4", "d", "h1"),
    ] {
        store
            .insert_app(alice, &new_app(id, name, host), T0)
            .await
            .unwrap();
    }
    let failed = AppState {
        status: app_status::FAILED.into(),
        last_error: Some("exited".into()),
        ..AppState::default()
    };
    store.set_app_state("app-3", &failed, T0).await.unwrap();
    store.delete_app(alice, "app-4", T0).await.unwrap();
    let ids: Vec<String> = store
        .apps_of_host("h1")
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.id)
        .collect();
    assert_eq!(ids, ["app-1"]);
}

/// An app's env is a tenant's secret: a host's role reads it only for the
/// apps it drives, cannot move another host's app onto itself to read it,
/// and still patches its own app's env.
async fn a_host_reads_and_changes_only_its_own_apps_env(db: Arc<Db>) {
    let store = &db.store;
    let Some(host_a) = db.as_host("host-a").await else {
        return;
    };
    let alice = account(store, "alice").await;
    store
        .insert_app(alice, &new_app("app-b", "on-b", "host-b"), T0)
        .await
        .unwrap();
    let on_b = host_a.app_by_id("app-b").await.unwrap().unwrap();
    assert!(on_b.config.env.is_empty(), "{:?}", on_b.config.env);
    assert!(host_a.list_apps(alice).await.unwrap()[0]
        .config
        .env
        .is_empty());
    let patch = AppConfigPatch {
        env: Some([("GREETING".to_string(), "stolen".to_string())].into()),
        ..AppConfigPatch::default()
    };
    assert!(!host_a.set_app_config("app-b", &patch).await.unwrap());
    assert!(!host_a.delete_app(alice, "app-b", T0).await.unwrap());
    let forged = host_a
        .insert_app(alice, &new_app("app-forged", "forged", "host-b"), T0)
        .await;
    assert!(forged.is_err(), "a host made an app on another host");

    let own = host_a
        .insert_app(alice, &new_app("app-a", "on-a", "host-a"), T0)
        .await
        .unwrap();
    assert_eq!(own.config.env["GREETING"], "hi there");
    let patch = AppConfigPatch {
        env: Some([("GREETING".to_string(), "hello".to_string())].into()),
        port: Some(9000),
        ..AppConfigPatch::default()
    };
    assert!(host_a.set_app_config("app-a", &patch).await.unwrap());
    let read = host_a.app_by_id("app-a").await.unwrap().unwrap();
    assert_eq!(
        (read.config.env["GREETING"].as_str(), read.config.port),
        ("hello", 9000)
    );
    assert_eq!(
        store
            .get_app(alice, "app-b")
            .await
            .unwrap()
            .unwrap()
            .config
            .env["GREETING"],
        "hi there"
    );
    host_a.close().await;
}
