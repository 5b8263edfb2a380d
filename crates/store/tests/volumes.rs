//! Volumes, their quotas and attachments against real databases (see
//! `common`).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::Db;
use shoal_store::{
    Account, NewSandbox, NewVolume, SandboxPatch, Store, StoreError, Tier, TierLimits,
    VolumeLimits, VolumeRequest,
};

const T0: f64 = 1_800_000_000.0;

cases!(
    quotas_count_size_and_total,
    names_are_unique_per_account,
    one_writer_or_many_readers,
    ending_a_sandbox_releases_its_volumes,
    a_missing_volume_admits_nothing,
    a_volume_pins_its_sandboxes_to_its_host,
    concurrent_writers_never_both_attach,
    delete_is_refused_while_attached,
);

async fn account(store: &Store, name: &str, tier: Tier) -> Account {
    let token = store.create_token(name, tier).await.unwrap();
    store.authenticate(&token).await.unwrap().unwrap()
}

fn sandbox_limits() -> TierLimits {
    TierLimits {
        concurrent: 100,
        creates_per_hour: 1000,
    }
}

fn volume(name: &str, size_mb: u64) -> NewVolume {
    NewVolume {
        name: name.into(),
        size_mb,
        host: "h1".into(),
    }
}

fn sandbox(id: &str, host: &str) -> NewSandbox {
    NewSandbox {
        id: id.into(),
        template: "base".into(),
        cpu: 1,
        memory_mb: 512,
        metadata: BTreeMap::new(),
        ttl_seconds: 300,
        persistent: false,
        max_lifetime_seconds: None,
        from_snapshot: None,
        parent_id: None,
        tree_id: None,
        host: Some(host.into()),
    }
}

fn wants(name: &str, read_only: bool) -> Vec<VolumeRequest> {
    vec![VolumeRequest {
        name: name.into(),
        read_only,
    }]
}

async fn admit(
    store: &Store,
    account: &Account,
    id: &str,
    volumes: &[VolumeRequest],
) -> Result<(), StoreError> {
    store
        .admit_sandbox_with_volumes(account, &sandbox(id, "h1"), &sandbox_limits(), volumes, T0)
        .await
        .map(|_| ())
}

async fn end(store: &Store, id: &str, status: &str) {
    let patch = SandboxPatch {
        status: Some(status.into()),
        deleted_at: Some(T0 + 1.0),
        ..SandboxPatch::default()
    };
    assert!(store.update_sandbox(id, patch).await.unwrap());
}

fn quota_message(result: Result<impl std::fmt::Debug, StoreError>) -> String {
    match result {
        Err(StoreError::Quota { message }) => message,
        other => panic!("expected a quota refusal, got {other:?}"),
    }
}

async fn quotas_count_size_and_total(db: Arc<Db>) {
    let store = &db.store;
    let free = account(store, "free", Tier::Free).await;
    let free_limits = VolumeLimits::default_for(Tier::Free);
    assert_eq!(
        quota_message(
            store
                .create_volume(&free, &volume("big", 1025), &free_limits, T0)
                .await
        ),
        "free tier allows volumes of at most 1024 MB"
    );
    store
        .create_volume(&free, &volume("one", 1024), &free_limits, T0)
        .await
        .unwrap();
    assert_eq!(
        quota_message(
            store
                .create_volume(&free, &volume("two", 1), &free_limits, T0)
                .await
        ),
        "free tier allows 1 volume"
    );

    let pro = account(store, "pro", Tier::Pro).await;
    let tight = VolumeLimits {
        count: 10,
        size_mb: 100,
        total_mb: 250,
    };
    for name in ["a", "b"] {
        store
            .create_volume(&pro, &volume(name, 100), &tight, T0)
            .await
            .unwrap();
    }
    assert_eq!(
        quota_message(
            store
                .create_volume(&pro, &volume("c", 51), &tight, T0)
                .await
        ),
        "pro tier allows 250 MB of volumes in all (200 MB in use)"
    );
    store
        .create_volume(&pro, &volume("c", 50), &tight, T0)
        .await
        .unwrap();
    let names: Vec<String> = store
        .list_volumes(pro.id)
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.name)
        .collect();
    assert_eq!(names, ["a", "b", "c"]);
    // A deleted volume gives its room back.
    store.delete_volume(&pro, "a").await.unwrap().unwrap();
    store
        .create_volume(&pro, &volume("d", 100), &tight, T0)
        .await
        .unwrap();
}

async fn names_are_unique_per_account(db: Arc<Db>) {
    let store = &db.store;
    let limits = VolumeLimits::default_for(Tier::Team);
    let a = account(store, "a", Tier::Team).await;
    let b = account(store, "b", Tier::Team).await;
    store
        .create_volume(&a, &volume("data", 10), &limits, T0)
        .await
        .unwrap();
    match store
        .create_volume(&a, &volume("data", 10), &limits, T0)
        .await
    {
        Err(StoreError::Conflict { message }) => assert_eq!(message, "volume data already exists"),
        other => panic!("expected a conflict, got {other:?}"),
    }
    store
        .create_volume(&b, &volume("data", 20), &limits, T0)
        .await
        .unwrap();
    assert_eq!(
        store
            .get_volume(a.id, "data")
            .await
            .unwrap()
            .unwrap()
            .size_mb,
        10
    );
    assert_eq!(
        store
            .get_volume(b.id, "data")
            .await
            .unwrap()
            .unwrap()
            .size_mb,
        20
    );
    assert!(store.get_volume(a.id, "nope").await.unwrap().is_none());
    // Another account's volume cannot be attached: it is not found.
    store.delete_volume(&b, "data").await.unwrap().unwrap();
    assert!(matches!(
        admit(store, &b, "sb-b", &wants("data", true)).await,
        Err(StoreError::NotFound { .. })
    ));
}

async fn one_writer_or_many_readers(db: Arc<Db>) {
    let store = &db.store;
    let acct = account(store, "t", Tier::Team).await;
    let limits = VolumeLimits::default_for(Tier::Team);
    store
        .create_volume(&acct, &volume("v", 10), &limits, T0)
        .await
        .unwrap();
    admit(store, &acct, "sb-w", &wants("v", false))
        .await
        .unwrap();
    for (id, read_only) in [("sb-x", false), ("sb-y", true)] {
        match admit(store, &acct, id, &wants("v", read_only)).await {
            Err(StoreError::Conflict { message }) => {
                assert_eq!(message, "volume in use: v is attached to sb-w")
            }
            other => panic!("expected volume in use, got {other:?}"),
        }
        assert!(
            store.sandbox_by_id(id).await.unwrap().is_none(),
            "a refused admission writes no row"
        );
    }
    end(store, "sb-w", "deleted").await;
    admit(store, &acct, "sb-r1", &wants("v", true))
        .await
        .unwrap();
    admit(store, &acct, "sb-r2", &wants("v", true))
        .await
        .unwrap();
    let row = store.get_volume(acct.id, "v").await.unwrap().unwrap();
    assert_eq!(row.attached_to, ["sb-r1", "sb-r2"]);
    assert!(!row.attached_read_write);
    assert!(matches!(
        admit(store, &acct, "sb-w2", &wants("v", false)).await,
        Err(StoreError::Conflict { .. })
    ));
}

async fn ending_a_sandbox_releases_its_volumes(db: Arc<Db>) {
    let store = &db.store;
    let acct = account(store, "t", Tier::Team).await;
    let limits = VolumeLimits::default_for(Tier::Team);
    store
        .create_volume(&acct, &volume("v", 10), &limits, T0)
        .await
        .unwrap();
    // Failed creates and deletes release; a lost sandbox still holds (its
    // VM may still run on a partitioned host).
    for (i, status) in ["failed", "deleted", "lost"].iter().enumerate() {
        let id = format!("sb-{i}");
        admit(store, &acct, &id, &wants("v", false)).await.unwrap();
        let row = store.get_volume(acct.id, "v").await.unwrap().unwrap();
        assert_eq!(row.attached_to, std::slice::from_ref(&id));
        assert!(row.attached_read_write);
        end(store, &id, status).await;
    }
    let row = store.get_volume(acct.id, "v").await.unwrap().unwrap();
    assert_eq!(row.attached_to, ["sb-2"], "only the lost sandbox holds it");
    let listed = store.list_volumes(acct.id).await.unwrap();
    assert_eq!(listed[0].attached_to, ["sb-2"]);
}

async fn a_missing_volume_admits_nothing(db: Arc<Db>) {
    let store = &db.store;
    let acct = account(store, "t", Tier::Team).await;
    let limits = VolumeLimits::default_for(Tier::Team);
    store
        .create_volume(&acct, &volume("here", 10), &limits, T0)
        .await
        .unwrap();
    let both = vec![
        VolumeRequest {
            name: "here".into(),
            read_only: false,
        },
        VolumeRequest {
            name: "missing".into(),
            read_only: false,
        },
    ];
    match admit(store, &acct, "sb-1", &both).await {
        Err(StoreError::NotFound { message }) => assert_eq!(message, "volume not found: missing"),
        other => panic!("expected not found, got {other:?}"),
    }
    assert!(store.sandbox_by_id("sb-1").await.unwrap().is_none());
    assert!(store.list_sandboxes(acct.id).await.unwrap().is_empty());
    let row = store.get_volume(acct.id, "here").await.unwrap().unwrap();
    assert!(
        row.attached_to.is_empty(),
        "the first attachment rolled back"
    );
}

/// The store half of pinning: a sandbox admitted on another host than its
/// volume's is refused (the front pins creates so this does not happen).
async fn a_volume_pins_its_sandboxes_to_its_host(db: Arc<Db>) {
    let store = &db.store;
    let acct = account(store, "t", Tier::Team).await;
    let limits = VolumeLimits::default_for(Tier::Team);
    let row = store
        .create_volume(&acct, &volume("v", 10), &limits, T0)
        .await
        .unwrap();
    assert_eq!(row.host, "h1");
    let elsewhere = store
        .admit_sandbox_with_volumes(
            &acct,
            &sandbox("sb-2", "h2"),
            &sandbox_limits(),
            &wants("v", true),
            T0,
        )
        .await;
    match elsewhere {
        Err(StoreError::Conflict { message }) => {
            assert_eq!(message, "volume v lives on host h1, not on h2")
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert!(store.sandbox_by_id("sb-2").await.unwrap().is_none());
    store
        .admit_sandbox_with_volumes(
            &acct,
            &sandbox("sb-1", "h1"),
            &sandbox_limits(),
            &wants("v", true),
            T0,
        )
        .await
        .unwrap();
}

/// Eight read-write attaches at once, over two connections: exactly one
/// wins.
async fn concurrent_writers_never_both_attach(db: Arc<Db>) {
    let acct = account(&db.store, "t", Tier::Team).await;
    let limits = VolumeLimits::default_for(Tier::Team);
    db.store
        .create_volume(&acct, &volume("v", 10), &limits, T0)
        .await
        .unwrap();
    let stores = [db.reopen().await, db.reopen().await];
    let attempts = (0..8).map(|i| {
        let store = stores[i % 2].clone();
        let acct = acct.clone();
        async move { admit(&store, &acct, &format!("sb-{i}"), &wants("v", false)).await }
    });
    let results = futures::future::join_all(attempts).await;
    let won = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(won, 1, "{results:?}");
    assert!(results
        .iter()
        .filter_map(|r| r.as_ref().err())
        .all(|e| matches!(e, StoreError::Conflict { .. })));
    for store in stores {
        store.close().await;
    }
}

async fn delete_is_refused_while_attached(db: Arc<Db>) {
    let store = &db.store;
    let acct = account(store, "t", Tier::Team).await;
    let limits = VolumeLimits::default_for(Tier::Team);
    store
        .create_volume(&acct, &volume("v", 10), &limits, T0)
        .await
        .unwrap();
    admit(store, &acct, "sb-1", &wants("v", true))
        .await
        .unwrap();
    match store.delete_volume(&acct, "v").await {
        Err(StoreError::Conflict { message }) => assert_eq!(message, "volume in use by sb-1"),
        other => panic!("expected a conflict, got {other:?}"),
    }
    end(store, "sb-1", "deleted").await;
    let deleted = store.delete_volume(&acct, "v").await.unwrap().unwrap();
    assert_eq!(deleted.name, "v");
    assert!(store.get_volume(acct.id, "v").await.unwrap().is_none());
    assert!(store.delete_volume(&acct, "v").await.unwrap().is_none());
}
