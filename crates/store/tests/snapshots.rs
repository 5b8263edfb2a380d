//! Snapshot records and their per-tier quota against real databases (see
//! `common`); and the SQLite writer's durability setting.

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::Db;
use shoal_store::{Account, SnapshotLimits, SnapshotRow, Store, StoreError, TemplateRow, Tier};

const T0: f64 = 1_800_000_000.0;
const MIB: i64 = 1 << 20;

cases!(
    count_quota_refuses_the_next_snapshot,
    byte_quota_counts_the_new_snapshot,
    concurrent_snapshots_never_pass_the_quota,
    get_and_delete_are_the_owners_only,
    writes_are_durable,
    templates_name_an_accounts_snapshots,
);

async fn account(store: &Store, name: &str, tier: Tier) -> Account {
    let token = store.create_token(name, tier).await.unwrap();
    store.authenticate(&token).await.unwrap().unwrap()
}

fn snapshot(account: &Account, id: &str, size_bytes: i64) -> SnapshotRow {
    SnapshotRow {
        id: id.into(),
        account_id: account.id,
        sandbox_id: Some("sb-1".into()),
        template: "base".into(),
        size_bytes: Some(size_bytes),
        host: Some("h1".into()),
        created_at: T0,
        vcpus: Some(2),
        memory_mib: Some(1024),
    }
}

fn quota_message(result: Result<(), StoreError>) -> String {
    match result {
        Err(StoreError::Quota { message }) => message,
        other => panic!("expected a quota refusal, got {other:?}"),
    }
}

async fn count_quota_refuses_the_next_snapshot(db: Arc<Db>) {
    let store = &db.store;
    let acct = account(store, "a", Tier::Free).await;
    let other = account(store, "b", Tier::Free).await;
    let limits = SnapshotLimits {
        count: 2,
        total_bytes: 1 << 40,
        template_disk_mib: 4096,
    };
    for id in ["s1", "s2"] {
        store.check_snapshot_quota(&acct, &limits).await.unwrap();
        store
            .record_snapshot(&acct, &snapshot(&acct, id, MIB), &limits)
            .await
            .unwrap();
    }
    let message = quota_message(store.check_snapshot_quota(&acct, &limits).await);
    assert_eq!(
        message,
        "free tier allows 2 snapshots; delete one to take another"
    );
    let refused = store
        .record_snapshot(&acct, &snapshot(&acct, "s3", MIB), &limits)
        .await;
    assert_eq!(quota_message(refused), message);
    assert!(store.get_snapshot(acct.id, "s3").await.unwrap().is_none());
    // Another account's quota is its own.
    store
        .record_snapshot(&other, &snapshot(&other, "o1", MIB), &limits)
        .await
        .unwrap();
    // Deleting one frees its place.
    assert!(store.delete_snapshot(acct.id, "s1").await.unwrap());
    store
        .record_snapshot(&acct, &snapshot(&acct, "s3", MIB), &limits)
        .await
        .unwrap();
    assert_eq!(store.list_snapshots(acct.id).await.unwrap().len(), 2);
}

async fn byte_quota_counts_the_new_snapshot(db: Arc<Db>) {
    let store = &db.store;
    let acct = account(store, "a", Tier::Pro).await;
    let limits = SnapshotLimits {
        count: 100,
        total_bytes: 100 << 20,
        template_disk_mib: 4096,
    };
    store
        .record_snapshot(&acct, &snapshot(&acct, "s1", 60 * MIB), &limits)
        .await
        .unwrap();
    // 60 + 50 > 100: refused although the count allows it.
    let message = quota_message(
        store
            .record_snapshot(&acct, &snapshot(&acct, "s2", 50 * MIB), &limits)
            .await,
    );
    assert_eq!(
        message,
        "pro tier allows 100 MiB of snapshots in all (60 MiB in use)"
    );
    store.check_snapshot_quota(&acct, &limits).await.unwrap();
    store
        .record_snapshot(&acct, &snapshot(&acct, "s2", 40 * MIB), &limits)
        .await
        .unwrap();
    // Full to the byte: the pre-check refuses before any capture.
    quota_message(store.check_snapshot_quota(&acct, &limits).await);
    let ids: Vec<String> = store
        .list_snapshots(acct.id)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(ids.len(), 2);
    assert!(ids.contains(&"s1".to_string()) && ids.contains(&"s2".to_string()));
}

/// Snapshots recorded at once through separate pools (as separate control
/// planes would) are serialised by the account lock: exactly `count` win.
async fn concurrent_snapshots_never_pass_the_quota(db: Arc<Db>) {
    let acct = account(&db.store, "a", Tier::Team).await;
    let limits = SnapshotLimits {
        count: 3,
        total_bytes: 1 << 40,
        template_disk_mib: 4096,
    };
    let stores = [db.reopen().await, db.reopen().await];
    let attempts = (0..10).map(|i| {
        let store = stores[i % 2].clone();
        let acct = acct.clone();
        async move {
            store
                .record_snapshot(&acct, &snapshot(&acct, &format!("s{i}"), MIB), &limits)
                .await
        }
    });
    let results = futures::future::join_all(attempts).await;
    let won = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(won, 3, "{results:?}");
    assert!(
        results
            .iter()
            .all(|r| matches!(r, Ok(()) | Err(StoreError::Quota { .. }))),
        "{results:?}"
    );
    assert_eq!(db.store.list_snapshots(acct.id).await.unwrap().len(), 3);
    for store in stores {
        store.close().await;
    }
}

async fn get_and_delete_are_the_owners_only(db: Arc<Db>) {
    let store = &db.store;
    let owner = account(store, "a", Tier::Free).await;
    let stranger = account(store, "b", Tier::Free).await;
    let limits = SnapshotLimits::default_for(Tier::Free);
    let row = snapshot(&owner, "s1", 5 * MIB);
    store.record_snapshot(&owner, &row, &limits).await.unwrap();
    assert_eq!(
        store.get_snapshot(owner.id, "s1").await.unwrap(),
        Some(row.clone())
    );
    assert_eq!(store.get_snapshot(stranger.id, "s1").await.unwrap(), None);
    assert!(!store.delete_snapshot(stranger.id, "s1").await.unwrap());
    assert!(store.get_snapshot(owner.id, "s1").await.unwrap().is_some());
    assert!(store.delete_snapshot(owner.id, "s1").await.unwrap());
    assert!(!store.delete_snapshot(owner.id, "s1").await.unwrap());
    assert_eq!(store.get_snapshot(owner.id, "s1").await.unwrap(), None);
    // A duplicate id is refused, not a quota error.
    store.record_snapshot(&owner, &row, &limits).await.unwrap();
    let again = store.record_snapshot(&owner, &row, &limits).await;
    assert!(
        matches!(again, Err(StoreError::AlreadyExists { .. })),
        "{again:?}"
    );
}

/// SQLite's writer commits at `synchronous=FULL`; prints what a write costs
/// (sequential token creates: one commit each), the figure the durability
/// note reports.
async fn writes_are_durable(db: Arc<Db>) {
    let store = &db.store;
    let acct = account(store, "w", Tier::Team).await;
    let limits = SnapshotLimits::default_for(Tier::Team);
    let mut times = Vec::new();
    for i in 0..200 {
        let started = Instant::now();
        store
            .record_snapshot(&acct, &snapshot(&acct, &format!("d{i}"), MIB), &limits)
            .await
            .unwrap();
        times.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    eprintln!(
        "{}: 200 sequential quota-checked snapshot records, p50 {:.3} ms, p99 {:.3} ms",
        store.backend(),
        times[100],
        times[197]
    );
    match store.backend() {
        "sqlite" => assert_eq!(store.sqlite_synchronous().await.unwrap(), Some(2)),
        _ => assert_eq!(store.sqlite_synchronous().await.unwrap(), None),
    }
    // Reopened, every acknowledged write is there.
    let reopened = db.reopen().await;
    assert_eq!(reopened.list_snapshots(acct.id).await.unwrap().len(), 200);
    reopened.close().await;
}

/// A template names one of its account's snapshots: the account's only
/// (another gets nothing), one per name, and its snapshot stays until no
/// template names it.
async fn templates_name_an_accounts_snapshots(db: Arc<Db>) {
    let store = &db.store;
    let alice = account(store, "alice", Tier::Pro).await;
    let bob = account(store, "bob", Tier::Pro).await;
    store
        .insert_snapshot(&snapshot(&alice, "snap-1", MIB))
        .await
        .unwrap();
    let tools = TemplateRow {
        account_id: alice.id,
        name: "tools".into(),
        snapshot_id: "snap-1".into(),
        base: "base".into(),
        start_cmd: Some("python3 -m http.server".into()),
        ready_cmd: None,
        published: false,
        created_at: T0,
    };
    store.insert_template(&alice, &tools, 2).await.unwrap();
    assert!(matches!(
        store.insert_template(&alice, &tools, 2).await,
        Err(StoreError::AlreadyExists {
            what: "template",
            ..
        })
    ));
    // Two names for one snapshot are two templates of the limit.
    let again = TemplateRow {
        name: "tools-2".into(),
        ..tools.clone()
    };
    store.insert_template(&alice, &again, 2).await.unwrap();
    let third = TemplateRow {
        name: "tools-3".into(),
        ..tools.clone()
    };
    let refused = store.insert_template(&alice, &third, 2).await;
    assert!(
        matches!(&refused, Err(StoreError::Quota { message }) if message == "pro tier allows 2 templates"),
        "{refused:?}"
    );
    assert!(store.delete_template(alice.id, "tools-2").await.unwrap());
    assert_eq!(
        store.get_template(alice.id, "tools").await.unwrap(),
        Some(tools.clone())
    );
    assert_eq!(store.get_template(bob.id, "tools").await.unwrap(), None);
    assert_eq!(
        store.list_templates(alice.id).await.unwrap(),
        vec![tools.clone()]
    );
    assert!(store.list_templates(bob.id).await.unwrap().is_empty());
    // Bob may use the same name for his own.
    store
        .insert_snapshot(&snapshot(&bob, "snap-2", MIB))
        .await
        .unwrap();
    let bobs = TemplateRow {
        account_id: bob.id,
        snapshot_id: "snap-2".into(),
        ..tools.clone()
    };
    store.insert_template(&bob, &bobs, 2).await.unwrap();
    assert_eq!(
        store.templates_of_snapshot("snap-1").await.unwrap(),
        ["tools"]
    );
    // Published, Alice's is every account's by name; one per name.
    assert_eq!(store.get_published_template("tools").await.unwrap(), None);
    assert!(store
        .set_template_published(alice.id, "tools", true)
        .await
        .unwrap());
    assert!(!store
        .set_template_published(alice.id, "nothing", true)
        .await
        .unwrap());
    assert!(matches!(
        store.set_template_published(bob.id, "tools", true).await,
        Err(StoreError::AlreadyExists { .. })
    ));
    let published = TemplateRow {
        published: true,
        ..tools.clone()
    };
    assert_eq!(
        store.get_published_template("tools").await.unwrap(),
        Some(published.clone())
    );
    assert_eq!(
        store.list_published_templates().await.unwrap(),
        vec![published]
    );
    assert!(store
        .set_template_published(alice.id, "tools", false)
        .await
        .unwrap());
    assert!(store.list_published_templates().await.unwrap().is_empty());
    // The snapshot outlives no template that names it.
    assert!(store.delete_snapshot(alice.id, "snap-1").await.is_err());
    assert!(!store.delete_template(bob.id, "nothing").await.unwrap());
    assert!(store.delete_template(alice.id, "tools").await.unwrap());
    assert!(store
        .templates_of_snapshot("snap-1")
        .await
        .unwrap()
        .is_empty());
    assert!(store.delete_snapshot(alice.id, "snap-1").await.unwrap());
    assert_eq!(
        store.get_template(bob.id, "tools").await.unwrap(),
        Some(bobs)
    );
}
