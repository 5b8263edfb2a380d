//! Hosts and placements against real databases (see `common`).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::Db;
use shoal_store::{
    HostReport, JoinRefusal, NewPlacement, NewSandbox, SandboxPatch, Tier, TierLimits,
    PLACEMENT_TIMEOUT_SECONDS,
};

const T0: f64 = 1_800_000_000.0;

cases!(
    reports_register_then_update,
    an_operator_drain_outlives_heartbeats,
    placements_count_until_a_later_report,
    dropped_and_abandoned_placements_stop_counting,
    only_stale_hosts_lose_their_sandboxes,
    two_fronts_placing_at_once_never_overfill_a_host,
    a_join_token_is_spent_once_and_a_credential_speaks_for_its_host,
    a_live_name_cannot_be_joined_again_and_revoking_loses_sandboxes,
    a_host_role_reads_no_credentials_and_writes_only_its_own_rows,
);

fn report(id: &str) -> HostReport {
    HostReport {
        id: id.into(),
        url: format!("http://{id}:7070"),
        vcpus: 2,
        cpu_busy: 0.25,
        memory_mib: 24_000,
        available_mib: 20_000,
        reserve_mib: 1_024,
        sandboxes: 3,
        max_sandboxes: Some(100),
        pss_mib: 300,
        draining: false,
    }
}

fn placement(host: &str, memory_mib: u64) -> NewPlacement {
    NewPlacement {
        host_id: host.into(),
        memory_mib,
        cpu_share: 0.5,
    }
}

async fn reports_register_then_update(db: Arc<Db>) {
    let store = &db.store;
    assert!(store.hosts(T0).await.unwrap().is_empty());
    store.report_host(&report("b"), T0).await.unwrap();
    store.report_host(&report("a"), T0 + 1.0).await.unwrap();
    let hosts = store.hosts(T0 + 1.0).await.unwrap();
    assert_eq!(hosts.len(), 2);
    assert_eq!(hosts[0].report, report("a"));
    assert_eq!(hosts[1].report.id, "b");
    assert_eq!((hosts[1].registered_at, hosts[1].heartbeat_at), (T0, T0));

    let mut changed = report("b");
    changed.available_mib = 10_000;
    changed.sandboxes = 9;
    changed.max_sandboxes = None;
    changed.draining = true;
    store.report_host(&changed, T0 + 10.0).await.unwrap();
    let hosts = store.hosts(T0 + 10.0).await.unwrap();
    assert_eq!(hosts[1].report, changed);
    assert_eq!(
        hosts[1].registered_at, T0,
        "a heartbeat keeps the registration time"
    );
    assert_eq!(hosts[1].heartbeat_at, T0 + 10.0);
    assert!(hosts[1].is_fresh(T0 + 40.0, 30.0));
    assert!(!hosts[1].is_fresh(T0 + 40.1, 30.0));
    assert_eq!(
        hosts[0].report,
        report("a"),
        "another host's row is untouched"
    );
}

async fn an_operator_drain_outlives_heartbeats(db: Arc<Db>) {
    let store = &db.store;
    assert!(!store.set_host_drained("nobody", true).await.unwrap());
    store.report_host(&report("a"), T0).await.unwrap();
    assert!(!store.hosts(T0).await.unwrap()[0].drained);
    assert!(store.set_host_drained("a", true).await.unwrap());
    // The host's own heartbeat (which says it is not draining) does not
    // undo the operator's drain.
    store.report_host(&report("a"), T0 + 5.0).await.unwrap();
    let host = &store.hosts(T0 + 5.0).await.unwrap()[0];
    assert!(host.drained && !host.report.draining);
    assert!(store.set_host_drained("a", false).await.unwrap());
    assert!(!store.hosts(T0 + 5.0).await.unwrap()[0].drained);
}

/// A sandbox `id` admitted on `host`.
fn sandbox_on(id: &str, host: &str) -> NewSandbox {
    NewSandbox {
        id: id.into(),
        template: "base".into(),
        cpu: 2,
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

/// Records a placement unconditionally; returns its id.
async fn add_placement(store: &shoal_store::Store, new: NewPlacement, now: f64) -> String {
    store
        .place(now, |_| Ok::<_, ()>(new))
        .await
        .unwrap()
        .unwrap()
        .1
}

async fn placements_count_until_a_later_report(db: Arc<Db>) {
    let store = &db.store;
    store.report_host(&report("a"), T0).await.unwrap();
    store.report_host(&report("b"), T0).await.unwrap();
    let first = add_placement(store, placement("a", 64), T0 + 1.0).await;
    let _second = add_placement(store, placement("a", 100), T0 + 2.0).await;
    let hosts = store.hosts(T0 + 2.0).await.unwrap();
    assert_eq!(hosts[0].in_flight_sandboxes, 2);
    assert_eq!(hosts[0].in_flight_memory_mib, 164);
    assert!((hosts[0].in_flight_cpu_share - 1.0).abs() < 1e-9);
    assert_eq!(hosts[1].in_flight_sandboxes, 0);
    assert_eq!(hosts[1].in_flight_memory_mib, 0);

    // Done, but the host has not reported since: still counted.
    store.placement_done(&first, T0 + 3.0).await.unwrap();
    assert_eq!(
        store.hosts(T0 + 3.0).await.unwrap()[0].in_flight_sandboxes,
        2
    );
    // A report from after it shows the sandbox itself; the create still in
    // flight goes on counting.
    store.report_host(&report("a"), T0 + 4.0).await.unwrap();
    let hosts = store.hosts(T0 + 4.0).await.unwrap();
    assert_eq!(hosts[0].in_flight_sandboxes, 1);
    assert_eq!(hosts[0].in_flight_memory_mib, 100);
}

async fn dropped_and_abandoned_placements_stop_counting(db: Arc<Db>) {
    let store = &db.store;
    store.report_host(&report("a"), T0).await.unwrap();
    let failed = add_placement(store, placement("a", 64), T0 + 1.0).await;
    store.drop_placement(&failed).await.unwrap();
    assert_eq!(
        store.hosts(T0 + 1.0).await.unwrap()[0].in_flight_sandboxes,
        0
    );

    // A create whose control plane died never reports back.
    add_placement(store, placement("a", 64), T0 + 2.0).await;
    let later = T0 + 2.0 + PLACEMENT_TIMEOUT_SECONDS;
    assert_eq!(store.hosts(later).await.unwrap()[0].in_flight_sandboxes, 1);
    assert_eq!(
        store.hosts(later + 1.0).await.unwrap()[0].in_flight_sandboxes,
        0
    );
    store.report_host(&report("a"), later + 1.0).await.unwrap();
    assert_eq!(
        store.hosts(T0).await.unwrap()[0].in_flight_sandboxes,
        0,
        "deleted by the report"
    );
}

async fn only_stale_hosts_lose_their_sandboxes(db: Arc<Db>) {
    let store = &db.store;
    let token = store.create_token("fleet", Tier::Team).await.unwrap();
    let account = store.authenticate(&token).await.unwrap().unwrap();
    let limits = TierLimits {
        concurrent: 100,
        creates_per_hour: 100,
    };
    store.report_host(&report("gone"), T0).await.unwrap();
    store.report_host(&report("alive"), T0).await.unwrap();
    let mut ids = Vec::new();
    for (i, host) in ["gone", "alive", "gone", "alive"].iter().enumerate() {
        let id = format!("sb-{i}");
        let new = sandbox_on(&id, host);
        store
            .admit_sandbox(&account, &new, &limits, T0)
            .await
            .unwrap();
        let patch = SandboxPatch {
            status: Some("running".into()),
            host: Some(host.to_string()),
            ..SandboxPatch::default()
        };
        assert!(store.update_sandbox(&id, patch).await.unwrap());
        ids.push(id);
    }
    let deleted = SandboxPatch {
        status: Some("deleted".into()),
        ..SandboxPatch::default()
    };
    store.update_sandbox("sb-2", deleted).await.unwrap();
    let before = store.sandbox_by_id("sb-1").await.unwrap().unwrap();

    store
        .report_host(&report("alive"), T0 + 35.0)
        .await
        .unwrap();
    let lost = store
        .lose_sandboxes_of_stale_hosts(T0 + 35.0 - 30.0)
        .await
        .unwrap();
    assert_eq!(lost, vec!["sb-0".to_string()]);
    let status = |id: &str| {
        let store = store.clone();
        let id = id.to_string();
        async move { store.sandbox_by_id(&id).await.unwrap().unwrap().status }
    };
    assert_eq!(status("sb-0").await, "lost");
    assert_eq!(
        status("sb-2").await,
        "deleted",
        "a deleted sandbox stays deleted"
    );
    assert_eq!(status("sb-3").await, "running");
    assert_eq!(
        store.sandbox_by_id("sb-1").await.unwrap().unwrap(),
        before,
        "no row of a live host changes"
    );
    assert!(
        store
            .lose_sandboxes_of_stale_hosts(T0 + 5.0)
            .await
            .unwrap()
            .is_empty(),
        "once"
    );
}

/// Two fronts (two connections to one database), 40 decisions at once, a
/// host with room for 10 more: exactly 10 are placed. Each decision sees
/// every placement recorded before it, whichever front made it.
async fn two_fronts_placing_at_once_never_overfill_a_host(db: Arc<Db>) {
    let fronts = [db.reopen().await, db.reopen().await];
    let mut host = report("only");
    host.sandboxes = 0;
    host.max_sandboxes = Some(10);
    fronts[0].report_host(&host, T0).await.unwrap();
    let decisions = (0..40).map(|n| {
        let store = fronts[n % 2].clone();
        async move {
            store
                .place(T0 + 1.0, |hosts| {
                    let h = &hosts[0];
                    let held = h.report.sandboxes + h.in_flight_sandboxes;
                    if Some(held) < h.report.max_sandboxes {
                        Ok(placement(&h.report.id, 256))
                    } else {
                        Err("full")
                    }
                })
                .await
                .unwrap()
        }
    });
    let outcomes = futures::future::join_all(decisions).await;
    let placed = outcomes.iter().filter(|o| o.is_ok()).count();
    let refused = outcomes.iter().filter(|o| o.is_err()).count();
    assert_eq!((placed, refused), (10, 30));
    let hosts = db.store.hosts(T0 + 1.0).await.unwrap();
    assert_eq!(hosts[0].in_flight_sandboxes, 10);
}

async fn a_join_token_is_spent_once_and_a_credential_speaks_for_its_host(db: Arc<Db>) {
    let store = &db.store;
    let token = store.create_join_token(T0, 3600.0).await.unwrap();
    assert!(token.starts_with("sj_"));
    let secret = store
        .join_host(&token, "a", T0, T0 - 30.0)
        .await
        .unwrap()
        .unwrap();
    assert!(secret.starts_with("sh_"));
    assert_eq!(
        store.host_of_secret(&secret).await.unwrap().as_deref(),
        Some("a")
    );
    assert_eq!(store.host_of_secret("sh_forged").await.unwrap(), None);
    assert_eq!(
        store.host_of_secret(&token).await.unwrap(),
        None,
        "a join token is no credential"
    );
    // Spent: not again, for any name.
    assert_eq!(
        store.join_host(&token, "b", T0, T0 - 30.0).await.unwrap(),
        Err(JoinRefusal::BadToken)
    );
    assert_eq!(
        store
            .join_host("sj_unknown", "b", T0, T0 - 30.0)
            .await
            .unwrap(),
        Err(JoinRefusal::BadToken)
    );
    // Expired.
    let old = store.create_join_token(T0, 60.0).await.unwrap();
    assert_eq!(
        store
            .join_host(&old, "b", T0 + 61.0, T0 + 31.0)
            .await
            .unwrap(),
        Err(JoinRefusal::BadToken)
    );
}

async fn a_live_name_cannot_be_joined_again_and_revoking_loses_sandboxes(db: Arc<Db>) {
    let store = &db.store;
    let first = store.create_join_token(T0, 3600.0).await.unwrap();
    let secret = store
        .join_host(&first, "a", T0, T0 - 30.0)
        .await
        .unwrap()
        .unwrap();
    store.report_host(&report("a"), T0 + 1.0).await.unwrap();
    // A second agent under the live name is refused, and its token stays good.
    let second = store.create_join_token(T0, 3600.0).await.unwrap();
    assert_eq!(
        store
            .join_host(&second, "a", T0 + 2.0, T0 + 2.0 - 30.0)
            .await
            .unwrap(),
        Err(JoinRefusal::NameLive)
    );
    let other = store
        .join_host(&second, "b", T0 + 2.0, T0 + 2.0 - 30.0)
        .await
        .unwrap();
    assert!(other.is_ok(), "{other:?}");

    let account_token = store.create_token("revoked", Tier::Team).await.unwrap();
    let account = store.authenticate(&account_token).await.unwrap().unwrap();
    let limits = TierLimits {
        concurrent: 100,
        creates_per_hour: 100,
    };
    let new = sandbox_on("sb-on-a", "a");
    store
        .admit_sandbox(&account, &new, &limits, T0)
        .await
        .unwrap();

    let lost = store.revoke_host("a", T0 + 3.0).await.unwrap();
    assert_eq!(lost, Some(vec!["sb-on-a".to_string()]));
    assert_eq!(
        store
            .sandbox_by_id("sb-on-a")
            .await
            .unwrap()
            .unwrap()
            .status,
        "lost"
    );
    assert_eq!(
        store.host_of_secret(&secret).await.unwrap(),
        None,
        "revoked"
    );
    let a = store
        .hosts(T0 + 3.0)
        .await
        .unwrap()
        .into_iter()
        .find(|h| h.report.id == "a")
        .unwrap();
    assert!(
        !a.is_fresh(T0 + 3.0, 30.0),
        "a revoked host is stale at once"
    );
    assert_eq!(
        store.revoke_host("a", T0 + 4.0).await.unwrap(),
        None,
        "once"
    );
    // A new join token brings the name back with a new credential.
    let again = store.create_join_token(T0, 3600.0).await.unwrap();
    let renewed = store
        .join_host(&again, "a", T0 + 5.0, T0 + 5.0 - 30.0)
        .await
        .unwrap()
        .unwrap();
    assert_ne!(renewed, secret);
    assert_eq!(
        store.host_of_secret(&renewed).await.unwrap().as_deref(),
        Some("a")
    );
}

/// What a host's database role may do (migrations/postgres/0009): on a real
/// PostgreSQL, it reads no credential and writes only its own host's rows;
/// revoking the host closes its role. SQLite has no roles to give.
async fn a_host_role_reads_no_credentials_and_writes_only_its_own_rows(db: Arc<Db>) {
    let store = &db.store;
    let password = "p".repeat(40);
    let Some(role) = store.ensure_host_role("a", &password).await.unwrap() else {
        assert_eq!(store.backend(), "sqlite");
        return;
    };
    // Made again (a restarted agent fetching its configuration): the same role.
    assert_eq!(
        store.ensure_host_role("a", &password).await.unwrap(),
        Some(role.clone())
    );
    let account_token = store.create_token("tenant", Tier::Team).await.unwrap();
    let account = store.authenticate(&account_token).await.unwrap().unwrap();
    store.create_join_token(T0, 3600.0).await.unwrap();
    let limits = TierLimits {
        concurrent: 100,
        creates_per_hour: 100,
    };
    store
        .admit_sandbox(&account, &sandbox_on("sb-on-b", "b"), &limits, T0)
        .await
        .unwrap();

    let url = shoal_store::host_database_url(&db.url, &role, &password).unwrap();
    let host = shoal_store::Store::connect_as_host(&url).await.unwrap();
    let mut raw = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
        .await
        .unwrap();
    let denied = |e: sqlx::Error| match e {
        sqlx::Error::Database(e) => e.code().as_deref() == Some("42501"),
        _ => false,
    };
    for table in ["tokens", "join_tokens", "host_credentials", "host_roles"] {
        let read = sqlx::query(&format!("SELECT * FROM {table}"))
            .fetch_all(&mut raw)
            .await;
        assert!(read.is_err_and(denied), "a host read {table}");
    }
    assert!(
        sqlx::query("UPDATE accounts SET tier = 'team'")
            .execute(&mut raw)
            .await
            .is_err_and(denied),
        "a host changed a tier"
    );
    assert!(
        sqlx::query("UPDATE hosts SET url = 'http://evil' WHERE id = 'b'")
            .execute(&mut raw)
            .await
            .is_err_and(denied),
        "a host wrote the hosts table"
    );
    // Another host's sandbox: readable (listings are answered by any
    // agent), but an update or delete reaches no row, and no row may be
    // made or moved onto another host.
    assert!(host.sandbox_by_id("sb-on-b").await.unwrap().is_some());
    let moved = sqlx::query("UPDATE sandboxes SET status = 'deleted' WHERE id = 'sb-on-b'")
        .execute(&mut raw)
        .await
        .unwrap();
    assert_eq!(moved.rows_affected(), 0);
    let gone = sqlx::query("DELETE FROM sandboxes WHERE id = 'sb-on-b'")
        .execute(&mut raw)
        .await
        .unwrap();
    assert_eq!(gone.rows_affected(), 0);
    assert_eq!(
        store
            .sandbox_by_id("sb-on-b")
            .await
            .unwrap()
            .unwrap()
            .status,
        "creating"
    );
    let forged = host
        .admit_sandbox(&account, &sandbox_on("sb-forged", "b"), &limits, T0)
        .await;
    assert!(forged.is_err(), "a host made a row on another host");
    // Its own rows it makes and changes, through the store as agents do.
    host.admit_sandbox(&account, &sandbox_on("sb-on-a", "a"), &limits, T0)
        .await
        .unwrap();
    let patch = SandboxPatch {
        status: Some("running".into()),
        ..SandboxPatch::default()
    };
    assert!(host.update_sandbox("sb-on-a", patch.clone()).await.unwrap());
    assert!(!host.update_sandbox("sb-on-b", patch).await.unwrap());
    let stolen = sqlx::query("UPDATE sandboxes SET host = 'b' WHERE id = 'sb-on-a'")
        .execute(&mut raw)
        .await;
    assert!(stolen.is_err(), "a host moved its row onto another host");
    // Events (migration 0018): a host writes and trims its own sandboxes'
    // logs, reads every sandbox's, and writes none for another host's.
    let event = |sandbox: &str, kind: &str| shoal_store::SandboxEvent {
        id: 0,
        sandbox_id: sandbox.into(),
        at: T0,
        kind: kind.into(),
        payload: "{}".into(),
    };
    store
        .append_sandbox_events(&[event("sb-on-b", "sandbox.created")])
        .await
        .unwrap();
    host.append_sandbox_events(&[
        event("sb-on-a", "sandbox.created"),
        event("sb-on-a", "sandbox.running"),
    ])
    .await
    .unwrap();
    assert!(
        host.append_sandbox_events(&[event("sb-on-b", "sandbox.deleted")])
            .await
            .is_err(),
        "a host wrote another host's sandbox's events"
    );
    let read = host.sandbox_events("sb-on-b", 10, 0, 0.0).await.unwrap();
    assert_eq!(
        read.iter().map(|e| e.kind.as_str()).collect::<Vec<_>>(),
        ["sandbox.created"]
    );
    assert_eq!(
        host.sandbox_events("sb-on-a", 10, 0, 0.0)
            .await
            .unwrap()
            .len(),
        2
    );
    drop(raw);
    host.close().await;

    // Revoked: the role logs in no more.
    let secret_token = store.create_join_token(T0, 3600.0).await.unwrap();
    store
        .join_host(&secret_token, "a", T0, T0 - 30.0)
        .await
        .unwrap()
        .unwrap();
    store.revoke_host("a", T0 + 1.0).await.unwrap().unwrap();
    assert!(shoal_store::Store::connect_as_host(&url).await.is_err());
}
