//! The store against real databases: every case runs on a fresh SQLite file
//! and, when `SHOAL_TEST_DATABASE_URL` names a PostgreSQL server (see
//! `scripts/with-postgres`), on a fresh database of its own there, so cases
//! run in parallel. Under CI the PostgreSQL variants fail rather than skip
//! when no server is given (see `common`).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{random_suffix, with_database, Db, Kind};
use shoal_store::{
    status, Account, NewSandbox, RateCard, SandboxPatch, SnapshotRow, Store, StoreError, Tier,
    TierLimits, UsageQuery, UsageSample,
};

const T0: f64 = 1_800_000_000.0;

cases!(
    tokens_are_stored_hashed_and_authenticate,
    tenancy_hides_other_accounts_sandboxes_and_snapshots,
    concurrent_admits_respect_the_concurrency_quota,
    hourly_create_quota_counts_deleted_sandboxes,
    reap_candidates_follow_ttl_persistence_execs_and_lifetime,
    usage_totals_cost_and_filters,
    restart_keeps_last_activity,
    update_patches_fields_and_respects_if_status,
    duplicate_ids_are_refused,
    two_stores_on_one_database_share_the_quota,
);

fn new_sandbox(id: &str) -> NewSandbox {
    NewSandbox {
        id: id.to_owned(),
        template: "base".to_owned(),
        cpu: 2,
        memory_mb: 512,
        metadata: BTreeMap::new(),
        ttl_seconds: 300,
        persistent: false,
        max_lifetime_seconds: None,
        from_snapshot: None,
        parent_id: None,
        tree_id: None,
        host: None,
    }
}

async fn account(store: &Store, name: &str, tier: Tier) -> Account {
    let token = store.create_token(name, tier).await.unwrap();
    store
        .authenticate(&token)
        .await
        .unwrap()
        .expect("a fresh token authenticates")
}

fn free() -> TierLimits {
    TierLimits::default_for(Tier::Free)
}

async fn tokens_are_stored_hashed_and_authenticate(db: Arc<Db>) {
    let store = &db.store;
    let token = store.create_token("alice", Tier::Free).await.unwrap();
    assert!(token.starts_with("sk_") && token.len() >= 40, "{token}");

    let alice = store
        .authenticate(&token)
        .await
        .unwrap()
        .expect("authenticates");
    assert_eq!((alice.name.as_str(), alice.tier), ("alice", Tier::Free));
    assert!(store.authenticate("sk_wrong").await.unwrap().is_none());
    assert!(store.authenticate("").await.unwrap().is_none());

    // A second token for the same account: both work, the tier is updated.
    let second = store.create_token("alice", Tier::Pro).await.unwrap();
    assert_ne!(second, token);
    let again = store.authenticate(&token).await.unwrap().unwrap();
    assert_eq!((again.id, again.tier), (alice.id, Tier::Pro));
    assert_eq!(
        store.authenticate(&second).await.unwrap().unwrap().id,
        alice.id
    );
    assert_eq!(
        store.account_by_name("alice").await.unwrap().unwrap().tier,
        Tier::Pro
    );

    // Only hashes are stored.
    let stored = db.raw_texts("SELECT hash FROM tokens ORDER BY hash").await;
    let mut expected = vec![
        shoal_store::token_hash(&token),
        shoal_store::token_hash(&second),
    ];
    expected.sort();
    assert_eq!(stored, expected);
    if let Kind::Sqlite { path, .. } = &db.kind {
        for file in [path.clone(), path.with_extension("db-wal")] {
            let bytes = std::fs::read(&file).unwrap_or_default();
            for plain in [&token, &second] {
                let found = bytes.windows(plain.len()).any(|w| w == plain.as_bytes());
                assert!(!found, "plaintext token in {}", file.display());
            }
        }
    }

    assert!(store.revoke_token(&token).await.unwrap());
    assert!(store.authenticate(&token).await.unwrap().is_none());
    assert!(store.authenticate(&second).await.unwrap().is_some());
}

async fn tenancy_hides_other_accounts_sandboxes_and_snapshots(db: Arc<Db>) {
    let store = &db.store;
    let a = account(store, "a", Tier::Free).await;
    let b = account(store, "b", Tier::Free).await;
    assert_ne!(a.id, b.id);

    let row = store
        .admit_sandbox(&a, &new_sandbox("sb-a"), &free(), T0)
        .await
        .unwrap();
    assert_eq!(row.status, status::CREATING);
    assert_eq!(
        store.get_sandbox(a.id, "sb-a").await.unwrap(),
        Some(row.clone())
    );
    assert_eq!(store.list_sandboxes(a.id).await.unwrap(), vec![row.clone()]);
    assert_eq!(store.sandbox_by_id("sb-a").await.unwrap(), Some(row));

    assert_eq!(store.get_sandbox(b.id, "sb-a").await.unwrap(), None);
    assert!(store.list_sandboxes(b.id).await.unwrap().is_empty());

    let snapshot = SnapshotRow {
        id: "snap-a".to_owned(),
        account_id: a.id,
        sandbox_id: Some("sb-a".to_owned()),
        template: "base".to_owned(),
        size_bytes: Some(1 << 30),
        host: Some("h1".to_owned()),
        created_at: T0 + 5.0,
        vcpus: None,
        memory_mib: None,
    };
    store.insert_snapshot(&snapshot).await.unwrap();
    let older = SnapshotRow {
        id: "snap-a0".to_owned(),
        created_at: T0,
        ..snapshot.clone()
    };
    store.insert_snapshot(&older).await.unwrap();
    assert_eq!(
        store.get_snapshot(a.id, "snap-a").await.unwrap(),
        Some(snapshot.clone())
    );
    assert_eq!(
        store.list_snapshots(a.id).await.unwrap(),
        vec![snapshot.clone(), older.clone()]
    );

    assert_eq!(store.get_snapshot(b.id, "snap-a").await.unwrap(), None);
    assert!(store.list_snapshots(b.id).await.unwrap().is_empty());
    assert!(!store.delete_snapshot(b.id, "snap-a").await.unwrap());
    assert!(store.get_snapshot(a.id, "snap-a").await.unwrap().is_some());

    assert!(store.delete_snapshot(a.id, "snap-a").await.unwrap());
    assert_eq!(store.list_snapshots(a.id).await.unwrap(), vec![older]);
}

async fn concurrent_admits_respect_the_concurrency_quota(db: Arc<Db>) {
    let store = &db.store;
    let a = account(store, "busy", Tier::Free).await;
    let other = account(store, "other", Tier::Free).await;

    let tasks: Vec<_> = (0..100)
        .map(|i| {
            let store = store.clone();
            let a = a.clone();
            tokio::spawn(async move {
                store
                    .admit_sandbox(&a, &new_sandbox(&format!("sb-{i}")), &free(), T0)
                    .await
            })
        })
        .collect();
    let mut admitted = 0;
    let mut refused = 0;
    for task in futures::future::join_all(tasks).await {
        match task.unwrap() {
            Ok(_) => admitted += 1,
            Err(StoreError::Quota { message }) => {
                assert_eq!(message, "free tier allows 5 concurrent sandboxes");
                refused += 1;
            }
            Err(e) => panic!("unexpected error: {e:?}"),
        }
    }
    assert_eq!((admitted, refused), (5, 95));
    assert_eq!(store.list_sandboxes(a.id).await.unwrap().len(), 5);

    // Another account is not affected.
    store
        .admit_sandbox(&other, &new_sandbox("other-1"), &free(), T0)
        .await
        .unwrap();

    // A deleted or failed sandbox frees its slot.
    let first = store.list_sandboxes(a.id).await.unwrap().remove(0);
    let patch = SandboxPatch {
        status: Some(status::DELETED.to_owned()),
        deleted_at: Some(T0 + 1.0),
        ..SandboxPatch::default()
    };
    assert!(store.update_sandbox(&first.id, patch).await.unwrap());
    store
        .admit_sandbox(&a, &new_sandbox("sb-late"), &free(), T0 + 2.0)
        .await
        .unwrap();
    let err = store
        .admit_sandbox(&a, &new_sandbox("sb-later"), &free(), T0 + 3.0)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Quota { .. }), "{err:?}");
}

async fn hourly_create_quota_counts_deleted_sandboxes(db: Arc<Db>) {
    let store = &db.store;
    let a = account(store, "hourly", Tier::Free).await;
    let limits = TierLimits {
        concurrent: 100,
        creates_per_hour: 3,
    };
    for i in 0..3 {
        let id = format!("h-{i}");
        store
            .admit_sandbox(&a, &new_sandbox(&id), &limits, T0 + f64::from(i))
            .await
            .unwrap();
        let gone = SandboxPatch {
            status: Some(status::DELETED.to_owned()),
            ..Default::default()
        };
        store.update_sandbox(&id, gone).await.unwrap();
    }
    let err = store
        .admit_sandbox(&a, &new_sandbox("h-3"), &limits, T0 + 10.0)
        .await
        .unwrap_err();
    match err {
        StoreError::Quota { message } => {
            assert_eq!(message, "free tier allows 3 sandbox creates per hour")
        }
        other => panic!("{other:?}"),
    }
    // The default Free limits name 60.
    let free_err = {
        let b = account(store, "hourly-b", Tier::Free).await;
        for i in 0..60 {
            let id = format!("hb-{i}");
            store
                .admit_sandbox(&b, &new_sandbox(&id), &free(), T0)
                .await
                .unwrap();
            let gone = SandboxPatch {
                status: Some(status::FAILED.to_owned()),
                ..Default::default()
            };
            store.update_sandbox(&id, gone).await.unwrap();
        }
        store
            .admit_sandbox(&b, &new_sandbox("hb-60"), &free(), T0)
            .await
            .unwrap_err()
    };
    assert_eq!(
        free_err.to_string(),
        "free tier allows 60 sandbox creates per hour"
    );

    // The window slides: an hour after the first create, one slot is back.
    store
        .admit_sandbox(&a, &new_sandbox("h-3"), &limits, T0 + 3600.5)
        .await
        .unwrap();
    let err = store
        .admit_sandbox(&a, &new_sandbox("h-4"), &limits, T0 + 3600.5)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Quota { .. }));
}

async fn reap_candidates_follow_ttl_persistence_execs_and_lifetime(db: Arc<Db>) {
    let store = &db.store;
    let a = account(store, "reap", Tier::Team).await;
    let limits = TierLimits::default_for(Tier::Team);
    let a = &a;
    let admit = |new: NewSandbox| async move {
        store.admit_sandbox(a, &new, &limits, T0).await.unwrap();
    };
    admit(NewSandbox {
        ttl_seconds: 60,
        ..new_sandbox("idle")
    })
    .await;
    admit(NewSandbox {
        ttl_seconds: 60,
        persistent: true,
        ..new_sandbox("persistent")
    })
    .await;
    admit(NewSandbox {
        ttl_seconds: 60,
        ..new_sandbox("busy")
    })
    .await;
    admit(NewSandbox {
        ttl_seconds: 60,
        ..new_sandbox("touched")
    })
    .await;
    admit(NewSandbox {
        ttl_seconds: 600,
        ..new_sandbox("long-ttl")
    })
    .await;
    admit(NewSandbox {
        ttl_seconds: 60,
        ..new_sandbox("deleted")
    })
    .await;
    admit(NewSandbox {
        ttl_seconds: 60,
        persistent: true,
        max_lifetime_seconds: Some(100),
        ..new_sandbox("old")
    })
    .await;

    store.exec_started("busy", T0 + 10.0).await.unwrap();
    store.exec_started("old", T0 + 10.0).await.unwrap();
    store.touch("touched", T0 + 50.0).await.unwrap();
    let gone = SandboxPatch {
        status: Some(status::DELETED.to_owned()),
        ..Default::default()
    };
    store.update_sandbox("deleted", gone).await.unwrap();

    let ids =
        |rows: Vec<shoal_store::SandboxRow>| rows.into_iter().map(|r| r.id).collect::<Vec<_>>();
    assert!(store.reap_candidates(T0 + 59.0).await.unwrap().is_empty());
    assert_eq!(
        ids(store.reap_candidates(T0 + 61.0).await.unwrap()),
        ["idle"]
    );
    // Past the lifetime: reaped though persistent and running an exec.
    assert_eq!(
        ids(store.reap_candidates(T0 + 101.0).await.unwrap()),
        ["idle", "old"]
    );

    // An exec that ended counts as activity; then the TTL runs again.
    assert_eq!(
        store
            .sandbox_by_id("busy")
            .await
            .unwrap()
            .unwrap()
            .running_execs,
        1
    );
    store.exec_finished("busy", T0 + 200.0).await.unwrap();
    let busy = store.sandbox_by_id("busy").await.unwrap().unwrap();
    assert_eq!((busy.running_execs, busy.last_activity_at), (0, T0 + 200.0));
    assert!(!ids(store.reap_candidates(T0 + 250.0).await.unwrap()).contains(&"busy".to_owned()));
    assert!(ids(store.reap_candidates(T0 + 261.0).await.unwrap()).contains(&"busy".to_owned()));

    // Touch never moves activity back; exec_finished never goes below zero.
    store.touch("busy", T0).await.unwrap();
    store.exec_finished("busy", T0).await.unwrap();
    let busy = store.sandbox_by_id("busy").await.unwrap().unwrap();
    assert_eq!((busy.running_execs, busy.last_activity_at), (0, T0 + 200.0));

    assert_eq!(
        ids(store.reap_candidates(T0 + 601.0).await.unwrap()),
        ["busy", "idle", "long-ttl", "old", "touched"]
    );

    // Counters a dead control plane left behind can be cleared.
    assert_eq!(store.clear_running_execs("local").await.unwrap(), 1);
    assert_eq!(
        store
            .sandbox_by_id("old")
            .await
            .unwrap()
            .unwrap()
            .running_execs,
        0
    );
}

async fn usage_totals_cost_and_filters(db: Arc<Db>) {
    let store = &db.store;
    let a = account(store, "metered", Tier::Pro).await;
    let b = account(store, "neighbour", Tier::Pro).await;
    let limits = TierLimits::default_for(Tier::Pro);
    let sweep = |run: &str| BTreeMap::from([("sweep".to_owned(), run.to_owned())]);
    for (id, meta, at) in [
        ("u1", sweep("run-17"), T0),
        ("u2", sweep("run-17"), T0 + 1.0),
        ("u3", sweep("run-18"), T0 + 2.0),
    ] {
        let new = NewSandbox {
            metadata: meta,
            ..new_sandbox(id)
        };
        store.admit_sandbox(&a, &new, &limits, at).await.unwrap();
    }
    store
        .admit_sandbox(&b, &new_sandbox("ub"), &limits, T0)
        .await
        .unwrap();

    let sample = |id: &str, at: f64, cpu: f64, gib: f64| UsageSample {
        sandbox_id: id.to_owned(),
        at,
        cpu_seconds: cpu,
        gib_seconds: gib,
        interval_s: 10.0,
    };
    for s in [
        sample("u1", T0 + 10.0, 3600.0, 7200.0),
        sample("u1", T0 + 20.0, 3600.0, 0.0),
        sample("u2", T0 + 10.0, 1800.0, 3600.0),
        sample("u3", T0 + 30.0, 100.0, 100.0),
        sample("ub", T0 + 10.0, 99999.0, 99999.0),
    ] {
        store.record_usage(&s).await.unwrap();
    }
    let close = |x: f64, y: f64| (x - y).abs() < 1e-9;

    let all = store.usage(a.id, &UsageQuery::default()).await.unwrap();
    let ids: Vec<_> = all.rows.iter().map(|r| r.sandbox_id.as_str()).collect();
    assert_eq!(ids, ["u1", "u2", "u3"]);
    let u1 = &all.rows[0];
    assert_eq!((u1.cpu_seconds, u1.gib_seconds), (7200.0, 7200.0));
    assert!(
        close(u1.cost_usd, 2.0 * 0.054 + 2.0 * 0.0162),
        "{}",
        u1.cost_usd
    );
    assert_eq!(
        (u1.template.as_str(), &u1.metadata),
        ("base", &sweep("run-17"))
    );
    assert!(close(all.total.cpu_seconds, 7200.0 + 1800.0 + 100.0));
    assert!(close(all.total.gib_seconds, 7200.0 + 3600.0 + 100.0));
    let expected_total = (9100.0 / 3600.0) * 0.054 + (10900.0 / 3600.0) * 0.0162;
    assert!(
        close(all.total.cost_usd, expected_total),
        "{}",
        all.total.cost_usd
    );

    let run17 = UsageQuery {
        metadata: vec![("sweep".into(), "run-17".into())],
        ..Default::default()
    };
    let report = store.usage(a.id, &run17).await.unwrap();
    assert_eq!(report.rows.len(), 2);
    assert!(close(report.total.cpu_seconds, 5400.0 + 3600.0));
    let nothing = UsageQuery {
        metadata: vec![
            ("sweep".into(), "run-17".into()),
            ("user".into(), "x".into()),
        ],
        ..Default::default()
    };
    assert!(store.usage(a.id, &nothing).await.unwrap().rows.is_empty());

    // Window: samples with from <= at < to.
    let window = UsageQuery {
        from: Some(T0 + 10.0),
        to: Some(T0 + 20.0),
        ..Default::default()
    };
    let report = store.usage(a.id, &window).await.unwrap();
    assert!(close(report.total.cpu_seconds, 3600.0 + 1800.0));
    let one = UsageQuery {
        sandbox_id: Some("u1".into()),
        ..Default::default()
    };
    assert!(close(
        store.usage(a.id, &one).await.unwrap().total.cpu_seconds,
        7200.0
    ));
    // Another account's sandbox, even named, is not reported.
    let theirs = UsageQuery {
        sandbox_id: Some("ub".into()),
        ..Default::default()
    };
    assert!(store.usage(a.id, &theirs).await.unwrap().rows.is_empty());

    // A different rate card.
    let priced = store.clone().with_rate_card(RateCard {
        cpu_hour_usd: 1.0,
        gib_hour_usd: 0.0,
    });
    assert!(close(
        priced.usage(a.id, &one).await.unwrap().total.cost_usd,
        2.0
    ));
}

async fn restart_keeps_last_activity(db: Arc<Db>) {
    let a = account(&db.store, "restart", Tier::Free).await;
    let row = db
        .store
        .admit_sandbox(&a, &new_sandbox("keep"), &free(), T0)
        .await
        .unwrap();
    db.store.touch("keep", T0 + 123.25).await.unwrap();
    db.store.exec_started("keep", T0 + 100.0).await.unwrap();

    let reopened = db.reopen().await;
    let again = reopened.get_sandbox(a.id, "keep").await.unwrap().unwrap();
    assert_eq!(again.last_activity_at, T0 + 123.25);
    assert_eq!(again.running_execs, 1);
    assert_eq!(again.created_at, row.created_at);
    // Migrations ran once; the account and its quota state carried over.
    assert_eq!(reopened.list_sandboxes(a.id).await.unwrap().len(), 1);
    reopened.close().await;
}

async fn update_patches_fields_and_respects_if_status(db: Arc<Db>) {
    let store = &db.store;
    let a = account(store, "patch", Tier::Free).await;
    let meta = BTreeMap::from([("k".to_owned(), "v \"quoted\" ü".to_owned())]);
    let new = NewSandbox {
        metadata: meta.clone(),
        from_snapshot: Some("snap-1".into()),
        parent_id: Some("p".into()),
        tree_id: Some("t".into()),
        host: None,
        max_lifetime_seconds: Some(9000),
        ..new_sandbox("patched")
    };
    store.admit_sandbox(&a, &new, &free(), T0).await.unwrap();

    let running = SandboxPatch {
        status: Some(status::RUNNING.to_owned()),
        host: Some("host-1".into()),
        guest_ip: Some("10.0.0.2".into()),
        boot_ms: Some(42.5),
        boot_mode: Some("restore".into()),
        if_status: Some(status::CREATING.to_owned()),
        ..Default::default()
    };
    assert!(store
        .update_sandbox("patched", running.clone())
        .await
        .unwrap());
    // Already running: the guarded patch does nothing.
    assert!(!store.update_sandbox("patched", running).await.unwrap());
    assert!(!store
        .update_sandbox("nope", SandboxPatch::default())
        .await
        .unwrap());

    let lifecycle = SandboxPatch {
        ttl_seconds: Some(1200),
        persistent: Some(true),
        ..Default::default()
    };
    assert!(store.update_sandbox("patched", lifecycle).await.unwrap());

    let row = store.get_sandbox(a.id, "patched").await.unwrap().unwrap();
    assert_eq!(row.status, "running");
    assert_eq!(row.host.as_deref(), Some("host-1"));
    assert_eq!(row.guest_ip.as_deref(), Some("10.0.0.2"));
    assert_eq!(row.boot_ms, Some(42.5));
    assert_eq!(row.boot_mode.as_deref(), Some("restore"));
    assert_eq!((row.ttl_seconds, row.persistent), (1200, true));
    assert_eq!(row.metadata, meta);
    assert_eq!(row.from_snapshot.as_deref(), Some("snap-1"));
    assert_eq!(
        (row.parent_id.as_deref(), row.tree_id.as_deref()),
        (Some("p"), Some("t"))
    );
    assert_eq!(row.max_lifetime_seconds, Some(9000));
    assert_eq!((row.cpu, row.memory_mb), (2, 512));
    assert!(row.is_live() && row.deleted_at.is_none());
    assert_eq!(row.status_reason, None);

    let failed = SandboxPatch {
        status: Some(status::FAILED.to_owned()),
        status_reason: Some("out of memory".into()),
        if_status: Some(status::RUNNING.to_owned()),
        ..Default::default()
    };
    assert!(store.update_sandbox("patched", failed).await.unwrap());
    let row = store.get_sandbox(a.id, "patched").await.unwrap().unwrap();
    assert_eq!(
        (row.status.as_str(), row.status_reason.as_deref()),
        ("failed", Some("out of memory"))
    );

    let delete = SandboxPatch {
        status: Some(status::DELETED.to_owned()),
        deleted_at: Some(T0 + 5.0),
        ..Default::default()
    };
    store.update_sandbox("patched", delete).await.unwrap();
    let row = store.get_sandbox(a.id, "patched").await.unwrap().unwrap();
    assert!(!row.is_live());
    assert_eq!(row.deleted_at, Some(T0 + 5.0));
    // A later patch without a reason keeps the one recorded.
    assert_eq!(row.status_reason.as_deref(), Some("out of memory"));
    assert!(store.list_sandboxes(a.id).await.unwrap().is_empty());
}

async fn duplicate_ids_are_refused(db: Arc<Db>) {
    let store = &db.store;
    let a = account(store, "dup", Tier::Free).await;
    store
        .admit_sandbox(&a, &new_sandbox("same"), &free(), T0)
        .await
        .unwrap();
    let err = store
        .admit_sandbox(&a, &new_sandbox("same"), &free(), T0)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::AlreadyExists {
                what: "sandbox",
                ..
            }
        ),
        "{err:?}"
    );
    let snap = SnapshotRow {
        id: "s".into(),
        account_id: a.id,
        sandbox_id: None,
        template: "base".into(),
        size_bytes: None,
        host: None,
        created_at: T0,
        vcpus: None,
        memory_mib: None,
    };
    store.insert_snapshot(&snap).await.unwrap();
    let err = store.insert_snapshot(&snap).await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::AlreadyExists {
                what: "snapshot",
                ..
            }
        ),
        "{err:?}"
    );
}

/// Two control planes (or processes) on one database: the quota holds across
/// them (SQLite: `BEGIN IMMEDIATE` across connections of different pools).
async fn two_stores_on_one_database_share_the_quota(db: Arc<Db>) {
    let first = db.store.clone();
    let second = db.reopen().await;
    let a = account(&first, "shared", Tier::Free).await;
    let tasks: Vec<_> = (0..60)
        .map(|i| {
            let store = if i % 2 == 0 {
                first.clone()
            } else {
                second.clone()
            };
            let a = a.clone();
            tokio::spawn(async move {
                store
                    .admit_sandbox(&a, &new_sandbox(&format!("s-{i}")), &free(), T0)
                    .await
            })
        })
        .collect();
    let results = futures::future::join_all(tasks).await;
    let mut admitted = 0;
    for result in results {
        match result.unwrap() {
            Ok(_) => admitted += 1,
            Err(StoreError::Quota { .. }) => {}
            Err(e) => panic!("unexpected error: {e:?}"),
        }
    }
    assert_eq!(admitted, 5);
    assert_eq!(second.list_sandboxes(a.id).await.unwrap().len(), 5);
    second.close().await;
}

#[tokio::test]
async fn connect_takes_plain_paths_and_refuses_other_urls() {
    let dir = std::env::temp_dir().join(format!("shoal-store-test-{}", random_suffix()));
    let path = dir.join("a").join("b.db");
    let store = Store::connect(path.to_str().unwrap()).await.unwrap();
    assert_eq!(store.backend(), "sqlite");
    assert!(path.exists());
    store.close().await;
    for bad in [
        "",
        "sqlite:",
        "mysql://x/y",
        "sqlite::memory:",
        "sqlite:/tmp/x.db?mode=ro",
    ] {
        let err = Store::connect(bad).await.err().expect(bad);
        assert!(matches!(err, StoreError::BadUrl(_)), "{bad}: {err:?}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn with_database_replaces_the_path() {
    assert_eq!(
        with_database("postgres://u@h:1/postgres", "x"),
        "postgres://u@h:1/x"
    );
    assert_eq!(
        with_database("postgres://u@h:1/postgres?sslmode=disable", "x"),
        "postgres://u@h:1/x?sslmode=disable"
    );
    assert_eq!(with_database("postgres://u@h:1", "x"), "postgres://u@h:1/x");
}

#[test]
fn tiers_parse_and_print() {
    for tier in [Tier::Free, Tier::Pro, Tier::Team] {
        assert_eq!(tier.to_string().parse::<Tier>().unwrap(), tier);
    }
    assert!("gold".parse::<Tier>().is_err());
    assert_eq!(
        TierLimits::default_for(Tier::Pro),
        TierLimits {
            concurrent: 50,
            creates_per_hour: 600
        }
    );
    assert_eq!(
        TierLimits::default_for(Tier::Team),
        TierLimits {
            concurrent: 500,
            creates_per_hour: 6000
        }
    );
}

/// The database PostgreSQL tests get (scripts/with-postgres) requires TLS:
/// the store's connections are encrypted, and SQLite's is no connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_that_requires_tls_gets_an_encrypted_connection() {
    {
        let sqlite = common::sqlite_db().await;
        assert!(!sqlite.store.encrypted().await.unwrap());
        sqlite.cleanup().await;
        let Some(postgres) = common::postgres_db().await else {
            return;
        };
        if postgres.url.contains("sslmode=require") {
            assert!(
                postgres.store.encrypted().await.unwrap(),
                "sslmode=require without TLS"
            );
        }
        let plain = if postgres.url.contains("sslmode=") {
            postgres.url.replace("sslmode=require", "sslmode=disable")
        } else if postgres.url.contains('?') {
            format!("{}&sslmode=disable", postgres.url)
        } else {
            format!("{}?sslmode=disable", postgres.url)
        };
        let store = shoal_store::Store::connect(&plain).await.unwrap();
        assert!(
            !store.encrypted().await.unwrap(),
            "sslmode=disable with TLS"
        );
        store.close().await;
        postgres.cleanup().await;
    }
}
