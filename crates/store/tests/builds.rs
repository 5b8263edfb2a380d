//! Template builds' rows, logs and cache against real databases (see
//! `common`): every read names its account, an unchanged rebuild finds the
//! snapshot only while it exists, a restarted host fails what it left.

mod common;

use std::sync::Arc;

use common::Db;
use shoal_store::{build_status, Account, SnapshotRow, Store, TemplateBuildRow, Tier};

const T0: f64 = 1_800_000_000.0;

cases!(
    builds_are_the_accounts_own,
    the_cache_names_a_done_build_whose_snapshot_exists,
    a_restarted_host_fails_its_unfinished_builds,
);

async fn account(store: &Store, name: &str) -> Account {
    let token = store.create_token(name, Tier::Free).await.unwrap();
    store.authenticate(&token).await.unwrap().unwrap()
}

fn build(account: &Account, id: &str, at: f64) -> TemplateBuildRow {
    TemplateBuildRow {
        id: id.into(),
        account_id: account.id,
        name: "analysis".into(),
        status: build_status::QUEUED.into(),
        error: None,
        cache_key: Some("key-1".into()),
        snapshot_id: None,
        host: Some("h1".into()),
        cache_hit: false,
        created_at: at,
        started_at: None,
        ended_at: None,
    }
}

async fn builds_are_the_accounts_own(db: Arc<Db>) {
    let store = &db.store;
    let owner = account(store, "owner").await;
    let stranger = account(store, "stranger").await;
    store
        .insert_build(&build(&owner, "bld-1", T0))
        .await
        .unwrap();
    store
        .insert_build(&build(&owner, "bld-2", T0 + 1.0))
        .await
        .unwrap();
    assert!(store
        .insert_build(&build(&owner, "bld-1", T0))
        .await
        .is_err());
    store
        .set_build_log("bld-1", "Step 1/2 : FROM base\nline two")
        .await
        .unwrap();

    let listed: Vec<String> = store
        .list_builds(owner.id)
        .await
        .unwrap()
        .into_iter()
        .map(|b| b.id)
        .collect();
    assert_eq!(listed, ["bld-2", "bld-1"], "newest first");
    assert_eq!(
        store
            .get_build(owner.id, "bld-1")
            .await
            .unwrap()
            .unwrap()
            .name,
        "analysis"
    );
    assert_eq!(
        store.build_log(owner.id, "bld-1").await.unwrap().as_deref(),
        Some("Step 1/2 : FROM base\nline two")
    );
    assert!(store
        .get_build(stranger.id, "bld-1")
        .await
        .unwrap()
        .is_none());
    assert!(store
        .build_log(stranger.id, "bld-1")
        .await
        .unwrap()
        .is_none());
    assert!(store.list_builds(stranger.id).await.unwrap().is_empty());

    let mut done = store.get_build(owner.id, "bld-2").await.unwrap().unwrap();
    done.status = build_status::FAILED.into();
    done.error = Some("Dockerfile line 2: RUN exited with status 3".into());
    done.started_at = Some(T0 + 2.0);
    done.ended_at = Some(T0 + 3.0);
    done.cache_hit = true;
    store.update_build(&done).await.unwrap();
    assert_eq!(
        store.get_build(owner.id, "bld-2").await.unwrap().unwrap(),
        done
    );
}

async fn the_cache_names_a_done_build_whose_snapshot_exists(db: Arc<Db>) {
    let store = &db.store;
    let owner = account(store, "owner").await;
    let stranger = account(store, "stranger").await;
    let mut row = build(&owner, "bld-1", T0);
    store.insert_build(&row).await.unwrap();
    store
        .insert_snapshot(&SnapshotRow {
            id: "snap-1".into(),
            account_id: owner.id,
            sandbox_id: None,
            template: "code-interpreter".into(),
            size_bytes: Some(1 << 20),
            host: Some("h1".into()),
            created_at: T0,
            vcpus: None,
            memory_mib: None,
        })
        .await
        .unwrap();
    row.snapshot_id = Some("snap-1".into());
    row.status = build_status::BUILDING.into();
    store.update_build(&row).await.unwrap();
    assert_eq!(
        store.cached_build(owner.id, "key-1").await.unwrap(),
        None,
        "not done yet"
    );
    row.status = build_status::DONE.into();
    row.ended_at = Some(T0 + 5.0);
    store.update_build(&row).await.unwrap();
    assert_eq!(
        store
            .cached_build(owner.id, "key-1")
            .await
            .unwrap()
            .as_deref(),
        Some("snap-1")
    );
    assert_eq!(store.cached_build(owner.id, "key-2").await.unwrap(), None);
    assert_eq!(
        store.cached_build(stranger.id, "key-1").await.unwrap(),
        None
    );
    assert!(store
        .snapshot_made_by_build(owner.id, "snap-1")
        .await
        .unwrap());
    assert!(!store
        .snapshot_made_by_build(stranger.id, "snap-1")
        .await
        .unwrap());
    assert!(!store
        .snapshot_made_by_build(owner.id, "snap-2")
        .await
        .unwrap());

    assert!(store.delete_snapshot(owner.id, "snap-1").await.unwrap());
    assert_eq!(
        store.cached_build(owner.id, "key-1").await.unwrap(),
        None,
        "its snapshot is gone"
    );
}

async fn a_restarted_host_fails_its_unfinished_builds(db: Arc<Db>) {
    let store = &db.store;
    let owner = account(store, "owner").await;
    for (id, status, host) in [
        ("bld-q", build_status::QUEUED, "h1"),
        ("bld-b", build_status::BUILDING, "h1"),
        ("bld-d", build_status::DONE, "h1"),
        ("bld-other", build_status::BUILDING, "h2"),
    ] {
        let mut row = build(&owner, id, T0);
        row.status = status.into();
        row.host = Some(host.into());
        store.insert_build(&row).await.unwrap();
    }
    assert_eq!(
        store.fail_abandoned_builds("h1", T0 + 9.0).await.unwrap(),
        2
    );
    let status = |id: &'static str| async move {
        let b = store.get_build(owner.id, id).await.unwrap().unwrap();
        (b.status, b.ended_at)
    };
    assert_eq!(status("bld-q").await, ("failed".into(), Some(T0 + 9.0)));
    assert_eq!(status("bld-b").await, ("failed".into(), Some(T0 + 9.0)));
    assert_eq!(status("bld-d").await.0, "done");
    assert_eq!(status("bld-other").await.0, "building");
    assert!(store
        .get_build(owner.id, "bld-b")
        .await
        .unwrap()
        .unwrap()
        .error
        .unwrap()
        .contains("stopped during the build"));
}
