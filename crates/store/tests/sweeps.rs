//! Sweeps against real databases: every case runs on a fresh SQLite file and,
//! when `SHOAL_TEST_DATABASE_URL` names a PostgreSQL server (see
//! `scripts/with-postgres`), on a fresh database of its own there. Under CI
//! the PostgreSQL variants fail rather than skip when no server is given
//! (see `common`).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Db;
use rand::Rng;
use shoal_store::{
    CellEnd, CellFilter, CellOutcome, CellState, NewSweep, RateCard, Renewal, Store, StoreError,
    SweepState, Tier,
};

const T0: f64 = 1_800_000_000.0;
const LEASE: Duration = Duration::from_secs(30);

cases!(
    create_claim_renew_finish,
    a_host_reads_a_sweeps_env_only_once_it_runs_a_cell,
    sweeps_are_private_to_their_account,
    ten_thousand_cells_insert_quickly,
    throttle_holds_under_eight_concurrent_claimers,
    throttle_changes_live,
    no_cell_is_claimed_twice_by_eight_claimers,
    claiming_from_every_sweep_goes_oldest_first,
    a_lost_claim_is_fenced,
    retries_until_max_attempts_then_failed,
    expired_leases_use_attempts_and_release_does_not,
    cancel_stops_claims_and_records_running_cells,
    cancel_racing_retries_leaves_nothing_pending,
    requeue_failed_reopens_the_sweep,
    restart_mid_sweep_finishes_every_cell_once,
    measure_claim_rate,
    job_ids_are_blocks_unique_and_increasing,
    held_sweeps_wait_for_their_dependencies,
    held_by_the_user_or_until_a_begin_time,
    cancelling_single_cells,
    a_restarted_runner_gives_its_claims_back_uncounted,
    runner_fields_round_trip,
);

async fn account_id(store: &Store, name: &str) -> i64 {
    let token = store.create_token(name, Tier::Team).await.unwrap();
    store.authenticate(&token).await.unwrap().unwrap().id
}

fn new_sweep(id: &str, account_id: i64, cells: usize) -> NewSweep {
    NewSweep {
        id: id.to_owned(),
        account_id,
        name: format!("sweep {id}"),
        template: "base".to_owned(),
        command: "python train.py --lr {cell}".to_owned(),
        env: BTreeMap::from([("SEED".to_owned(), "7".to_owned())]),
        cells: (0..cells).map(|i| format!("v{i}")).collect(),
        throttle: cells.max(1) as u32,
        timeout_seconds: 600,
        max_attempts: 1,
        collect: vec!["/out/result.json".to_owned()],
        ..NewSweep::default()
    }
}

fn ok(at: f64) -> CellOutcome {
    CellOutcome::new(CellEnd::Succeeded, at)
}

fn failed(at: f64) -> CellOutcome {
    CellOutcome {
        exit_code: Some(1),
        ..CellOutcome::new(CellEnd::Failed, at)
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

async fn create_claim_renew_finish(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "alice").await;
    let mut new = new_sweep("sw-1", acct, 3);
    new.fork_from = Some(serde_json::json!({"setup": "pip install numpy"}));
    new.max_attempts = 2;
    let row = store.create_sweep(&new, T0).await.unwrap();
    assert_eq!(row.state, SweepState::Active);
    assert_eq!((row.created_at, row.finished_at), (T0, None));
    assert_eq!(row.cells, vec!["v0", "v1", "v2"]);
    assert_eq!(
        store.get_sweep(acct, "sw-1").await.unwrap(),
        Some(row.clone())
    );
    assert_eq!(store.sweep_by_id("sw-1").await.unwrap(), Some(row.clone()));
    assert_eq!(store.list_sweeps(acct).await.unwrap(), vec![row.clone()]);
    let counts = store.sweep_counts(acct, "sw-1").await.unwrap();
    assert_eq!(
        (counts.pending, counts.total(), counts.progress()),
        (3, 3, 0.0)
    );

    let claims = store
        .claim_cells("runner-a", Some("sw-1"), 2, LEASE, T0 + 1.0)
        .await
        .unwrap();
    assert_eq!(claims.len(), 2);
    for (i, c) in claims.iter().enumerate() {
        assert_eq!((c.sweep_id.as_str(), c.idx), ("sw-1", i as u32));
        assert_eq!(c.value, format!("v{i}"));
        assert_eq!((c.attempt, c.epoch), (1, 1));
        assert_eq!(c.lease_expires_at, T0 + 31.0);
        assert!(c.claim_id.len() >= 32, "{}", c.claim_id);
    }
    assert_ne!(claims[0].claim_id, claims[1].claim_id);

    let cells = store
        .list_cells(acct, "sw-1", &CellFilter::default())
        .await
        .unwrap();
    assert_eq!(cells.len(), 3);
    assert_eq!(cells[0].state, CellState::Running);
    assert_eq!(
        cells[0].claim_id.as_deref(),
        Some(claims[0].claim_id.as_str())
    );
    assert_eq!(cells[0].claimed_by.as_deref(), Some("runner-a"));
    assert_eq!(cells[0].started_at, Some(T0 + 1.0));
    assert_eq!(cells[0].lease_expires_at, Some(T0 + 31.0));
    assert_eq!(
        (cells[2].state, cells[2].claim_id.as_deref()),
        (CellState::Pending, None)
    );

    let c0 = &claims[0];
    assert_eq!(
        store
            .renew_lease("sw-1", 0, &c0.claim_id, LEASE, T0 + 20.0)
            .await
            .unwrap(),
        Renewal::Renewed
    );
    let cell0 = &store
        .list_cells(
            acct,
            "sw-1",
            &CellFilter {
                limit: Some(1),
                ..Default::default()
            },
        )
        .await
        .unwrap()[0];
    assert_eq!(cell0.lease_expires_at, Some(T0 + 50.0));

    // The sandbox is visible while the cell runs, only under its claim.
    assert!(!store
        .set_cell_sandbox("sw-1", 0, "not-the-claim", "sb-wrong")
        .await
        .unwrap());
    assert!(store
        .set_cell_sandbox("sw-1", 0, &c0.claim_id, "sb-running")
        .await
        .unwrap());
    let cell0 = &store
        .list_cells(acct, "sw-1", &CellFilter::default())
        .await
        .unwrap()[0];
    assert_eq!(cell0.sandbox_id.as_deref(), Some("sb-running"));

    let outcome = CellOutcome {
        exit_code: Some(0),
        elapsed_ms: Some(1234),
        stdout_tail: Some("loss=0.1\n".to_owned()),
        stderr_tail: Some(String::new()),
        collected: Some(serde_json::json!({"/out/result.json": {"bytes": 17}})),
        sandbox_id: Some("sb-1".to_owned()),
        cpu_seconds: 3600.0,
        gib_seconds: 7200.0,
        ..ok(T0 + 25.0)
    };
    assert_eq!(
        store
            .finish_cell("sw-1", 0, &c0.claim_id, &outcome)
            .await
            .unwrap(),
        Some(CellState::Succeeded)
    );
    // Exactly once: the same claim cannot finish it again.
    assert_eq!(
        store
            .finish_cell("sw-1", 0, &c0.claim_id, &failed(T0 + 26.0))
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        store
            .renew_lease("sw-1", 0, &c0.claim_id, LEASE, T0 + 26.0)
            .await
            .unwrap(),
        Renewal::Lost
    );
    let cell0 = store
        .list_cells(
            acct,
            "sw-1",
            &CellFilter {
                state: Some(CellState::Succeeded),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(cell0.len(), 1);
    let cell0 = &cell0[0];
    assert_eq!(cell0.idx, 0);
    assert_eq!(
        (cell0.claim_id.as_deref(), cell0.lease_expires_at),
        (None, None)
    );
    assert_eq!(cell0.finished_at, Some(T0 + 25.0));
    assert_eq!((cell0.exit_code, cell0.elapsed_ms), (Some(0), Some(1234)));
    assert_eq!(cell0.stdout_tail.as_deref(), Some("loss=0.1\n"));
    assert_eq!(cell0.collected, outcome.collected);
    assert_eq!(cell0.sandbox_id.as_deref(), Some("sb-1"));
    assert_eq!((cell0.cpu_seconds, cell0.gib_seconds), (3600.0, 7200.0));
    let card = RateCard::default();
    assert!((cell0.cost_usd - (card.cpu_hour_usd + 2.0 * card.gib_hour_usd)).abs() < 1e-9);
    assert_eq!((cell0.attempts, cell0.claim_epoch), (1, 1));

    // The last cell, then nothing more to claim.
    let rest = store
        .claim_cells("runner-b", Some("sw-1"), 10, LEASE, T0 + 30.0)
        .await
        .unwrap();
    assert_eq!(rest.iter().map(|c| c.idx).collect::<Vec<_>>(), vec![2]);
    assert!(store
        .claim_cells("runner-b", None, 10, LEASE, T0 + 30.0)
        .await
        .unwrap()
        .is_empty());
    for c in claims.iter().skip(1).chain(&rest) {
        assert_eq!(
            store
                .finish_cell("sw-1", c.idx, &c.claim_id, &ok(T0 + 40.0))
                .await
                .unwrap(),
            Some(CellState::Succeeded)
        );
    }
    let done = store.get_sweep(acct, "sw-1").await.unwrap().unwrap();
    assert_eq!(
        (done.state, done.finished_at),
        (SweepState::Done, Some(T0 + 40.0))
    );
    let counts = store.sweep_counts(acct, "sw-1").await.unwrap();
    assert_eq!(
        (counts.succeeded, counts.finished(), counts.progress()),
        (3, 3, 1.0)
    );

    // Ids are unique; a sweep of no cells is done at once.
    assert!(matches!(
        store.create_sweep(&new, T0).await,
        Err(StoreError::AlreadyExists { .. })
    ));
    let empty = store
        .create_sweep(&new_sweep("sw-empty", acct, 0), T0)
        .await
        .unwrap();
    assert_eq!(
        (empty.state, empty.finished_at),
        (SweepState::Done, Some(T0))
    );
    assert_eq!(
        store.get_sweep(acct, "sw-empty").await.unwrap(),
        Some(empty)
    );
    assert_eq!(
        store
            .list_sweeps(acct)
            .await
            .unwrap()
            .iter()
            .map(|s| s.id.as_str())
            .collect::<Vec<_>>(),
        vec!["sw-1", "sw-empty"], // same created_at: by id
    );
}

async fn sweeps_are_private_to_their_account(db: Arc<Db>) {
    let store = &db.store;
    let a = account_id(store, "a").await;
    let b = account_id(store, "b").await;
    store
        .create_sweep(&new_sweep("sw-a", a, 4), T0)
        .await
        .unwrap();
    assert_eq!(store.get_sweep(b, "sw-a").await.unwrap(), None);
    assert!(store.list_sweeps(b).await.unwrap().is_empty());
    assert_eq!(store.sweep_counts(b, "sw-a").await.unwrap().total(), 0);
    assert!(store
        .list_cells(b, "sw-a", &CellFilter::default())
        .await
        .unwrap()
        .is_empty());
    assert!(!store.set_throttle(b, "sw-a", 1).await.unwrap());
    assert_eq!(store.cancel_sweep(b, "sw-a", T0).await.unwrap(), None);
    assert_eq!(store.requeue_failed(b, "sw-a").await.unwrap(), None);
    assert_eq!(store.cancel_sweep(a, "missing", T0).await.unwrap(), None);
    // Nothing of b's calls changed a's sweep.
    let row = store.get_sweep(a, "sw-a").await.unwrap().unwrap();
    assert_eq!((row.state, row.throttle), (SweepState::Active, 4));
    assert_eq!(store.sweep_counts(a, "sw-a").await.unwrap().pending, 4);
}

async fn ten_thousand_cells_insert_quickly(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "big").await;
    let new = new_sweep("sw-big", acct, 10_000);
    let started = Instant::now();
    store.create_sweep(&new, T0).await.unwrap();
    let took = started.elapsed();
    eprintln!(
        "{}: create_sweep of 10,000 cells took {:.1} ms",
        store.backend(),
        took.as_secs_f64() * 1000.0
    );
    // Well under a second in a release build; generous for debug builds on
    // a loaded machine.
    assert!(took < Duration::from_secs(3), "took {took:?}");
    let counts = store.sweep_counts(acct, "sw-big").await.unwrap();
    assert_eq!((counts.pending, counts.total()), (10_000, 10_000));
    let page = store
        .list_cells(
            acct,
            "sw-big",
            &CellFilter {
                after: Some(9_997),
                limit: Some(5),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        page.iter()
            .map(|c| (c.idx, c.value.as_str()))
            .collect::<Vec<_>>(),
        vec![(9_998, "v9998"), (9_999, "v9999")]
    );
    let row = store.get_sweep(acct, "sw-big").await.unwrap().unwrap();
    assert_eq!(row.cells.len(), 10_000);
    assert_eq!(row.cells[1234], "v1234");
}

/// Claims and finishes everything of the sweeps, each claimer checking the
/// database after every claim; a monitor samples running counts throughout.
async fn throttle_holds_under_eight_concurrent_claimers(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "t").await;
    let throttles = [("sw-t5", 5u32, 120usize), ("sw-t3", 3, 60)];
    for (id, throttle, cells) in throttles {
        let new = NewSweep {
            throttle,
            ..new_sweep(id, acct, cells)
        };
        store.create_sweep(&new, T0).await.unwrap();
    }
    let max_seen: Arc<Mutex<BTreeMap<&'static str, u64>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));

    let monitor = {
        let (store, max_seen, stop) = (store.clone(), max_seen.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                for (id, throttle, _) in throttles {
                    let running = store.sweep_counts(acct, id).await.unwrap().running;
                    assert!(running <= u64::from(throttle), "{id}: {running} running");
                    let mut seen = max_seen.lock().unwrap();
                    let max = seen.entry(id).or_default();
                    *max = (*max).max(running);
                }
            }
        })
    };

    let mut tasks = Vec::new();
    for n in 0..8 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            // Half claim from one sweep, half from every sweep.
            let only = match n % 4 {
                0 => Some("sw-t5"),
                1 => Some("sw-t3"),
                _ => None,
            };
            let runner = format!("r{n}");
            let mut finished = 0;
            loop {
                let claims = store
                    .claim_cells(&runner, only, 2, LEASE, T0)
                    .await
                    .unwrap();
                for (id, throttle, _) in throttles {
                    let running = store.sweep_counts(acct, id).await.unwrap().running;
                    assert!(running <= u64::from(throttle), "{id}: {running} running");
                }
                if claims.is_empty() {
                    let left = match only {
                        Some(id) => store.sweep_counts(acct, id).await.unwrap().pending,
                        None => {
                            store.sweep_counts(acct, "sw-t5").await.unwrap().pending
                                + store.sweep_counts(acct, "sw-t3").await.unwrap().pending
                        }
                    };
                    if left == 0 {
                        return finished;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                let pause = Duration::from_millis(rand::thread_rng().gen_range(0..3));
                tokio::time::sleep(pause).await;
                for c in claims {
                    let got = store
                        .finish_cell(&c.sweep_id, c.idx, &c.claim_id, &ok(T0 + 1.0))
                        .await
                        .unwrap();
                    assert_eq!(got, Some(CellState::Succeeded));
                    finished += 1;
                }
            }
        }));
    }
    let mut finished = 0;
    for task in futures::future::join_all(tasks).await {
        finished += task.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    monitor.await.unwrap();
    assert_eq!(finished, 180);
    for (id, throttle, cells) in throttles {
        let counts = store.sweep_counts(acct, id).await.unwrap();
        assert_eq!(counts.succeeded, cells as u64, "{id}");
        assert_eq!(
            store.get_sweep(acct, id).await.unwrap().unwrap().state,
            SweepState::Done
        );
        let max = max_seen.lock().unwrap()[id];
        eprintln!(
            "{}: {id} throttle {throttle}, most running seen {max}",
            store.backend()
        );
        assert!(max <= u64::from(throttle));
    }
}

async fn throttle_changes_live(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "t").await;
    let new = NewSweep {
        throttle: 2,
        ..new_sweep("sw", acct, 10)
    };
    store.create_sweep(&new, T0).await.unwrap();
    let claim = |max| store.claim_cells("r", Some("sw"), max, LEASE, T0);
    let first = claim(10).await.unwrap();
    assert_eq!(first.len(), 2);
    assert!(claim(10).await.unwrap().is_empty());
    assert!(store.set_throttle(acct, "sw", 5).await.unwrap());
    assert_eq!(
        store.get_sweep(acct, "sw").await.unwrap().unwrap().throttle,
        5
    );
    assert_eq!(claim(1).await.unwrap().len(), 1);
    assert_eq!(claim(10).await.unwrap().len(), 2);
    // Lowering it stops nothing, and claims wait until running falls below.
    assert!(store.set_throttle(acct, "sw", 1).await.unwrap());
    assert!(claim(10).await.unwrap().is_empty());
    assert_eq!(store.sweep_counts(acct, "sw").await.unwrap().running, 5);
    // 0 pauses.
    assert!(store.set_throttle(acct, "sw", 0).await.unwrap());
    for c in &first {
        store
            .finish_cell("sw", c.idx, &c.claim_id, &ok(T0))
            .await
            .unwrap();
    }
    assert!(claim(10).await.unwrap().is_empty());
    assert!(store.set_throttle(acct, "sw", 4).await.unwrap());
    assert_eq!(claim(10).await.unwrap().len(), 1);
}

/// Eight claimers on two stores (two control planes: two pools, and on
/// SQLite two writer connections) take a 500-cell sweep apart.
async fn no_cell_is_claimed_twice_by_eight_claimers(db: Arc<Db>) {
    let store = &db.store;
    let other = db.reopen().await;
    let acct = account_id(store, "c").await;
    store
        .create_sweep(&new_sweep("sw", acct, 500), T0)
        .await
        .unwrap();
    let finished: Arc<Mutex<Vec<u32>>> = Arc::default();
    let claimed = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for n in 0..8 {
        let store = if n % 2 == 0 {
            store.clone()
        } else {
            other.clone()
        };
        let (finished, claimed) = (finished.clone(), claimed.clone());
        tasks.push(tokio::spawn(async move {
            let runner = format!("r{n}");
            loop {
                let claims = store
                    .claim_cells(&runner, Some("sw"), 1 + n % 4, LEASE, T0)
                    .await
                    .unwrap();
                if claims.is_empty() {
                    return;
                }
                claimed.fetch_add(claims.len() as u64, Ordering::Relaxed);
                for c in claims {
                    if store
                        .finish_cell("sw", c.idx, &c.claim_id, &ok(T0 + 1.0))
                        .await
                        .unwrap()
                        .is_some()
                    {
                        finished.lock().unwrap().push(c.idx);
                    }
                }
            }
        }));
    }
    for task in futures::future::join_all(tasks).await {
        task.unwrap();
    }
    let mut finished = finished.lock().unwrap().clone();
    assert_eq!(claimed.load(Ordering::Relaxed), 500);
    assert_eq!(finished.len(), 500);
    finished.sort_unstable();
    assert_eq!(
        finished,
        (0..500).collect::<Vec<u32>>(),
        "each cell finished exactly once"
    );
    let cells = store
        .list_cells(acct, "sw", &CellFilter::default())
        .await
        .unwrap();
    assert!(cells
        .iter()
        .all(|c| c.state == CellState::Succeeded && c.attempts == 1 && c.claim_epoch == 1));
    let row = store.get_sweep(acct, "sw").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.finished_at),
        (SweepState::Done, Some(T0 + 1.0))
    );
    other.close().await;
}

async fn claiming_from_every_sweep_goes_oldest_first(db: Arc<Db>) {
    let store = &db.store;
    let a = account_id(store, "a").await;
    let b = account_id(store, "b").await;
    let old = NewSweep {
        throttle: 2,
        ..new_sweep("sw-old", b, 5)
    };
    store.create_sweep(&old, T0).await.unwrap();
    store
        .create_sweep(&new_sweep("sw-new", a, 5), T0 + 1.0)
        .await
        .unwrap();
    store
        .create_sweep(&new_sweep("sw-gone", a, 5), T0 - 1.0)
        .await
        .unwrap();
    store.cancel_sweep(a, "sw-gone", T0).await.unwrap().unwrap();

    let claims = store
        .claim_cells("r", None, 4, LEASE, T0 + 2.0)
        .await
        .unwrap();
    let got: Vec<(&str, u32)> = claims
        .iter()
        .map(|c| (c.sweep_id.as_str(), c.idx))
        .collect();
    assert_eq!(
        got,
        vec![("sw-old", 0), ("sw-old", 1), ("sw-new", 0), ("sw-new", 1)]
    );
    let claims = store
        .claim_cells("r", None, 100, LEASE, T0 + 2.0)
        .await
        .unwrap();
    assert_eq!(claims.len(), 3);
    assert!(claims.iter().all(|c| c.sweep_id == "sw-new"));
    assert!(store
        .claim_cells("r", None, 100, LEASE, T0 + 2.0)
        .await
        .unwrap()
        .is_empty());
    assert!(store
        .claim_cells("r", Some("sw-gone"), 100, LEASE, T0)
        .await
        .unwrap()
        .is_empty());
    assert!(store
        .claim_cells("r", Some("missing"), 100, LEASE, T0)
        .await
        .unwrap()
        .is_empty());
    assert!(store
        .claim_cells("r", None, 0, LEASE, T0)
        .await
        .unwrap()
        .is_empty());
}

async fn a_lost_claim_is_fenced(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "f").await;
    let new = NewSweep {
        max_attempts: 3,
        ..new_sweep("sw", acct, 1)
    };
    store.create_sweep(&new, T0).await.unwrap();
    let old = store
        .claim_cells("a", None, 1, LEASE, T0)
        .await
        .unwrap()
        .remove(0);
    // Not yet expired: nothing happens; past its lease it goes back.
    assert_eq!(store.expire_leases(T0 + 30.0).await.unwrap(), 0);
    assert_eq!(store.expire_leases(T0 + 31.0).await.unwrap(), 1);
    let cell = store
        .list_cells(acct, "sw", &CellFilter::default())
        .await
        .unwrap()
        .remove(0);
    assert_eq!(
        (cell.state, cell.claim_id.as_deref()),
        (CellState::Pending, None)
    );
    assert_eq!(cell.error.as_deref(), Some("lease expired"));
    // A stale claim cannot renew, finish or release a pending cell...
    assert_eq!(
        store
            .renew_lease("sw", 0, &old.claim_id, LEASE, T0 + 32.0)
            .await
            .unwrap(),
        Renewal::Lost
    );
    assert_eq!(
        store
            .finish_cell("sw", 0, &old.claim_id, &ok(T0 + 32.0))
            .await
            .unwrap(),
        None
    );
    assert!(!store
        .release_cell("sw", 0, &old.claim_id, T0 + 32.0)
        .await
        .unwrap());

    let new_claim = store
        .claim_cells("b", None, 1, LEASE, T0 + 33.0)
        .await
        .unwrap()
        .remove(0);
    assert_ne!(new_claim.claim_id, old.claim_id);
    assert_eq!((new_claim.attempt, new_claim.epoch), (2, 2));
    let before = store
        .list_cells(acct, "sw", &CellFilter::default())
        .await
        .unwrap();

    // ...nor one that another runner holds now: nothing changes.
    assert_eq!(
        store
            .finish_cell("sw", 0, &old.claim_id, &ok(T0 + 34.0))
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        store
            .finish_cell("sw", 0, &old.claim_id, &failed(T0 + 34.0))
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        store
            .renew_lease("sw", 0, &old.claim_id, LEASE, T0 + 34.0)
            .await
            .unwrap(),
        Renewal::Lost
    );
    assert!(!store
        .release_cell("sw", 0, &old.claim_id, T0 + 34.0)
        .await
        .unwrap());
    assert_eq!(
        store
            .finish_cell("sw", 0, "made-up", &ok(T0 + 34.0))
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        store
            .finish_cell("sw", 1, &new_claim.claim_id, &ok(T0))
            .await
            .unwrap(),
        None
    );
    let after = store
        .list_cells(acct, "sw", &CellFilter::default())
        .await
        .unwrap();
    assert_eq!(before, after);
    assert_eq!(after[0].claimed_by.as_deref(), Some("b"));

    // The current claim works.
    assert_eq!(
        store
            .renew_lease("sw", 0, &new_claim.claim_id, LEASE, T0 + 40.0)
            .await
            .unwrap(),
        Renewal::Renewed
    );
    assert_eq!(
        store
            .finish_cell("sw", 0, &new_claim.claim_id, &ok(T0 + 41.0))
            .await
            .unwrap(),
        Some(CellState::Succeeded)
    );
    let cell = store
        .list_cells(acct, "sw", &CellFilter::default())
        .await
        .unwrap()
        .remove(0);
    assert_eq!((cell.state, cell.error), (CellState::Succeeded, None));
    assert_eq!(
        store.get_sweep(acct, "sw").await.unwrap().unwrap().state,
        SweepState::Done
    );
}

async fn retries_until_max_attempts_then_failed(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "r").await;
    let new = NewSweep {
        max_attempts: 3,
        ..new_sweep("sw", acct, 1)
    };
    store.create_sweep(&new, T0).await.unwrap();
    let ends = [CellEnd::Failed, CellEnd::Timeout, CellEnd::Failed];
    for (attempt, end) in ends.into_iter().enumerate() {
        let c = store.claim_cells("r", None, 5, LEASE, T0).await.unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].attempt, attempt as u32 + 1);
        let outcome = CellOutcome {
            exit_code: Some(attempt as i32 + 1),
            cpu_seconds: 10.0,
            error: Some(format!("attempt {attempt}")),
            ..CellOutcome::new(end, T0 + attempt as f64)
        };
        let got = store
            .finish_cell("sw", 0, &c[0].claim_id, &outcome)
            .await
            .unwrap();
        let cell = store
            .list_cells(acct, "sw", &CellFilter::default())
            .await
            .unwrap()
            .remove(0);
        if attempt < 2 {
            assert_eq!(
                got,
                Some(CellState::Pending),
                "attempt {attempt} is retried"
            );
            assert_eq!((cell.state, cell.finished_at), (CellState::Pending, None));
            assert_eq!(
                store.get_sweep(acct, "sw").await.unwrap().unwrap().state,
                SweepState::Active
            );
        } else {
            assert_eq!(got, Some(CellState::Failed));
            assert_eq!(cell.finished_at, Some(T0 + 2.0));
        }
        // The last attempt's outcome, the usage of all.
        assert_eq!(cell.exit_code, Some(attempt as i32 + 1));
        assert_eq!(cell.error, Some(format!("attempt {attempt}")));
        assert_eq!(cell.cpu_seconds, 10.0 * (attempt + 1) as f64);
        assert_eq!(cell.attempts, attempt as u32 + 1);
    }
    assert!(store
        .claim_cells("r", None, 5, LEASE, T0)
        .await
        .unwrap()
        .is_empty());
    let row = store.get_sweep(acct, "sw").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.finished_at),
        (SweepState::Done, Some(T0 + 2.0))
    );

    // A timeout on the last attempt stays a timeout.
    store
        .create_sweep(&new_sweep("sw-t", acct, 1), T0)
        .await
        .unwrap();
    let c = store
        .claim_cells("r", Some("sw-t"), 1, LEASE, T0)
        .await
        .unwrap();
    let timeout = CellOutcome::new(CellEnd::Timeout, T0 + 5.0);
    assert_eq!(
        store
            .finish_cell("sw-t", 0, &c[0].claim_id, &timeout)
            .await
            .unwrap(),
        Some(CellState::Timeout)
    );
    assert_eq!(store.sweep_counts(acct, "sw-t").await.unwrap().timeout, 1);
}

async fn expired_leases_use_attempts_and_release_does_not(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "e").await;
    let new = NewSweep {
        max_attempts: 2,
        ..new_sweep("sw", acct, 2)
    };
    store.create_sweep(&new, T0).await.unwrap();

    // Cell 0: two expired leases exhaust two attempts.
    store.claim_cells("r", None, 1, LEASE, T0).await.unwrap();
    assert_eq!(store.expire_leases(T0 + 100.0).await.unwrap(), 1);
    let c = store
        .claim_cells("r", None, 1, LEASE, T0 + 100.0)
        .await
        .unwrap();
    assert_eq!((c[0].idx, c[0].attempt), (0, 2));
    // Renewed past the first check, then abandoned.
    assert_eq!(
        store
            .renew_lease("sw", 0, &c[0].claim_id, LEASE, T0 + 120.0)
            .await
            .unwrap(),
        Renewal::Renewed
    );
    assert_eq!(store.expire_leases(T0 + 140.0).await.unwrap(), 0);
    assert_eq!(store.expire_leases(T0 + 151.0).await.unwrap(), 1);
    let cells = store
        .list_cells(acct, "sw", &CellFilter::default())
        .await
        .unwrap();
    assert_eq!(cells[0].state, CellState::Failed);
    assert_eq!(cells[0].error.as_deref(), Some("lease expired"));
    assert_eq!(cells[0].finished_at, Some(T0 + 151.0));

    // Cell 1: released twice, uncounted, then run to success.
    for _ in 0..2 {
        let c = store
            .claim_cells("r", None, 5, LEASE, T0 + 200.0)
            .await
            .unwrap();
        assert_eq!((c.len(), c[0].idx, c[0].attempt), (1, 1, 1));
        assert!(store
            .release_cell("sw", 1, &c[0].claim_id, T0 + 201.0)
            .await
            .unwrap());
        assert!(!store
            .release_cell("sw", 1, &c[0].claim_id, T0 + 201.0)
            .await
            .unwrap());
    }
    let c = store
        .claim_cells("r", None, 5, LEASE, T0 + 300.0)
        .await
        .unwrap();
    assert_eq!((c[0].attempt, c[0].epoch), (1, 3));
    store
        .finish_cell("sw", 1, &c[0].claim_id, &ok(T0 + 301.0))
        .await
        .unwrap();
    let row = store.get_sweep(acct, "sw").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.finished_at),
        (SweepState::Done, Some(T0 + 301.0))
    );
}

async fn cancel_stops_claims_and_records_running_cells(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "x").await;
    let new = NewSweep {
        throttle: 3,
        max_attempts: 5,
        ..new_sweep("sw", acct, 8)
    };
    store.create_sweep(&new, T0).await.unwrap();
    let claims = store.claim_cells("r", None, 10, LEASE, T0).await.unwrap();
    assert_eq!(claims.len(), 3);

    let running = store
        .cancel_sweep(acct, "sw", T0 + 1.0)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        running, claims,
        "the running cells' claims, to kill their sandboxes"
    );
    let row = store.get_sweep(acct, "sw").await.unwrap().unwrap();
    assert_eq!((row.state, row.finished_at), (SweepState::Cancelled, None));
    let counts = store.sweep_counts(acct, "sw").await.unwrap();
    assert_eq!(
        (counts.running, counts.cancelled, counts.pending),
        (3, 5, 0)
    );
    assert!(store
        .claim_cells("r", None, 10, LEASE, T0)
        .await
        .unwrap()
        .is_empty());
    assert!(store
        .claim_cells("r", Some("sw"), 10, LEASE, T0)
        .await
        .unwrap()
        .is_empty());
    // Again: the same claims, nothing else changes.
    assert_eq!(
        store
            .cancel_sweep(acct, "sw", T0 + 2.0)
            .await
            .unwrap()
            .unwrap(),
        claims
    );

    // The runners learn of it when renewing.
    assert_eq!(
        store
            .renew_lease("sw", 0, &claims[0].claim_id, LEASE, T0 + 3.0)
            .await
            .unwrap(),
        Renewal::Cancelled
    );
    // A failure (the kill) is recorded cancelled, not retried; a success stays.
    assert_eq!(
        store
            .finish_cell("sw", 0, &claims[0].claim_id, &failed(T0 + 4.0))
            .await
            .unwrap(),
        Some(CellState::Cancelled)
    );
    assert_eq!(
        store
            .finish_cell("sw", 1, &claims[1].claim_id, &ok(T0 + 5.0))
            .await
            .unwrap(),
        Some(CellState::Succeeded)
    );
    assert_eq!(
        store
            .get_sweep(acct, "sw")
            .await
            .unwrap()
            .unwrap()
            .finished_at,
        None
    );
    // The last one's runner died: its lease expiry records it cancelled.
    assert_eq!(store.expire_leases(T0 + 100.0).await.unwrap(), 1);
    let counts = store.sweep_counts(acct, "sw").await.unwrap();
    assert_eq!(
        (counts.cancelled, counts.succeeded, counts.total()),
        (7, 1, 8)
    );
    let row = store.get_sweep(acct, "sw").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.finished_at),
        (SweepState::Cancelled, Some(T0 + 100.0))
    );
    assert!(store
        .cancel_sweep(acct, "sw", T0 + 101.0)
        .await
        .unwrap()
        .unwrap()
        .is_empty());

    // A sweep with nothing running is finished by the cancel itself; a done
    // sweep stays done.
    store
        .create_sweep(&new_sweep("sw-idle", acct, 3), T0)
        .await
        .unwrap();
    assert!(store
        .cancel_sweep(acct, "sw-idle", T0 + 7.0)
        .await
        .unwrap()
        .unwrap()
        .is_empty());
    let row = store.get_sweep(acct, "sw-idle").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.finished_at),
        (SweepState::Cancelled, Some(T0 + 7.0))
    );
    store
        .create_sweep(&new_sweep("sw-done", acct, 1), T0)
        .await
        .unwrap();
    let c = store
        .claim_cells("r", Some("sw-done"), 1, LEASE, T0)
        .await
        .unwrap();
    store
        .finish_cell("sw-done", 0, &c[0].claim_id, &ok(T0 + 1.0))
        .await
        .unwrap();
    assert!(store
        .cancel_sweep(acct, "sw-done", T0 + 2.0)
        .await
        .unwrap()
        .unwrap()
        .is_empty());
    let row = store.get_sweep(acct, "sw-done").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.finished_at),
        (SweepState::Done, Some(T0 + 1.0))
    );

    // A released claim of a cancelled sweep is cancelled.
    store
        .create_sweep(&new_sweep("sw-rel", acct, 2), T0)
        .await
        .unwrap();
    let c = store
        .claim_cells("r", Some("sw-rel"), 1, LEASE, T0)
        .await
        .unwrap();
    store.cancel_sweep(acct, "sw-rel", T0 + 1.0).await.unwrap();
    assert!(store
        .release_cell("sw-rel", 0, &c[0].claim_id, T0 + 2.0)
        .await
        .unwrap());
    assert_eq!(
        store.sweep_counts(acct, "sw-rel").await.unwrap().cancelled,
        2
    );
    let row = store.get_sweep(acct, "sw-rel").await.unwrap().unwrap();
    assert_eq!(row.finished_at, Some(T0 + 2.0));
}

/// Cells failing with retries left, finished concurrently with a cancel:
/// whichever comes first, none may end up pending in the cancelled sweep.
async fn cancel_racing_retries_leaves_nothing_pending(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "race").await;
    for round in 0..3 {
        let id = format!("sw-{round}");
        let new = NewSweep {
            max_attempts: 10,
            ..new_sweep(&id, acct, 120)
        };
        store.create_sweep(&new, T0).await.unwrap();
        let claims = store
            .claim_cells("r", Some(&id), 120, LEASE, T0)
            .await
            .unwrap();
        assert_eq!(claims.len(), 120);
        let claims = Arc::new(Mutex::new(claims));
        let mut tasks = Vec::new();
        for _ in 0..6 {
            let (store, claims, id) = (store.clone(), claims.clone(), id.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    let Some(c) = claims.lock().unwrap().pop() else {
                        return;
                    };
                    store
                        .finish_cell(&id, c.idx, &c.claim_id, &failed(T0 + 1.0))
                        .await
                        .unwrap();
                }
            }));
        }
        let pause = Duration::from_millis(rand::thread_rng().gen_range(0..20));
        tokio::time::sleep(pause).await;
        store
            .cancel_sweep(acct, &id, T0 + 2.0)
            .await
            .unwrap()
            .unwrap();
        for task in futures::future::join_all(tasks).await {
            task.unwrap();
        }
        let counts = store.sweep_counts(acct, &id).await.unwrap();
        assert_eq!(counts.cancelled, 120, "round {round}: {counts:?}");
        let row = store.get_sweep(acct, &id).await.unwrap().unwrap();
        assert_eq!(row.state, SweepState::Cancelled);
        assert!(row.finished_at.is_some(), "round {round}: not finished");
    }
}

async fn requeue_failed_reopens_the_sweep(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "q").await;
    store
        .create_sweep(&new_sweep("sw", acct, 4), T0)
        .await
        .unwrap();
    let claims = store.claim_cells("r", None, 4, LEASE, T0).await.unwrap();
    let ends = [
        CellEnd::Succeeded,
        CellEnd::Failed,
        CellEnd::Timeout,
        CellEnd::Failed,
    ];
    for (c, end) in claims.iter().zip(ends) {
        store
            .finish_cell("sw", c.idx, &c.claim_id, &CellOutcome::new(end, T0 + 1.0))
            .await
            .unwrap();
    }
    let row = store.get_sweep(acct, "sw").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.finished_at),
        (SweepState::Done, Some(T0 + 1.0))
    );

    assert_eq!(store.requeue_failed(acct, "sw").await.unwrap(), Some(3));
    let row = store.get_sweep(acct, "sw").await.unwrap().unwrap();
    assert_eq!((row.state, row.finished_at), (SweepState::Active, None));
    let counts = store.sweep_counts(acct, "sw").await.unwrap();
    assert_eq!((counts.pending, counts.succeeded), (3, 1));
    let again = store
        .claim_cells("r", None, 10, LEASE, T0 + 2.0)
        .await
        .unwrap();
    assert_eq!(
        again.iter().map(|c| c.idx).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert!(again.iter().all(|c| c.attempt == 1 && c.epoch == 2));
    for c in &again {
        store
            .finish_cell("sw", c.idx, &c.claim_id, &ok(T0 + 3.0))
            .await
            .unwrap();
    }
    let row = store.get_sweep(acct, "sw").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.finished_at),
        (SweepState::Done, Some(T0 + 3.0))
    );
    // Nothing failed: nothing changes.
    assert_eq!(store.requeue_failed(acct, "sw").await.unwrap(), Some(0));
    assert_eq!(
        store.get_sweep(acct, "sw").await.unwrap().unwrap().state,
        SweepState::Done
    );
}

/// A control plane dies mid-sweep holding claims; another store opened on
/// the same database takes the cells back once the leases expire and
/// finishes the sweep; every cell is recorded exactly once.
async fn restart_mid_sweep_finishes_every_cell_once(db: Arc<Db>) {
    let acct = account_id(&db.store, "k").await;
    let new = NewSweep {
        throttle: 6,
        max_attempts: 2,
        ..new_sweep("sw", acct, 20)
    };
    db.store.create_sweep(&new, T0).await.unwrap();
    let lost = db
        .store
        .claim_cells("old", None, 6, LEASE, T0)
        .await
        .unwrap();
    let mut recorded = BTreeSet::new();
    for c in &lost[..2] {
        let got = db
            .store
            .finish_cell("sw", c.idx, &c.claim_id, &ok(T0 + 1.0))
            .await;
        assert_eq!(got.unwrap(), Some(CellState::Succeeded));
        assert!(recorded.insert(c.idx));
    }
    // "kill -9": the old process's store goes away with 4 claims held.
    db.store.close().await;

    let store = db.reopen().await;
    // Before the leases run out the held cells stay running (and count
    // against the throttle).
    assert_eq!(store.expire_leases(T0 + 10.0).await.unwrap(), 0);
    let early = store
        .claim_cells("new", None, 100, LEASE, T0 + 10.0)
        .await
        .unwrap();
    assert_eq!(early.len(), 2);
    assert!(early.iter().all(|c| c.idx >= 6));
    assert_eq!(store.expire_leases(T0 + 31.0).await.unwrap(), 4);

    let mut finishes = 0;
    let mut at = T0 + 31.0;
    let mut pending = early;
    loop {
        for c in pending.drain(..) {
            let got = store
                .finish_cell("sw", c.idx, &c.claim_id, &ok(at))
                .await
                .unwrap();
            assert_eq!(got, Some(CellState::Succeeded));
            assert!(recorded.insert(c.idx), "cell {} recorded twice", c.idx);
            finishes += 1;
        }
        at += 1.0;
        pending = store
            .claim_cells("new", None, 100, LEASE, at)
            .await
            .unwrap();
        if pending.is_empty() {
            break;
        }
    }
    assert_eq!(finishes, 18);
    // The dead process's claims, if it came back, change nothing.
    for c in &lost[2..] {
        assert_eq!(
            store
                .finish_cell("sw", c.idx, &c.claim_id, &failed(at))
                .await
                .unwrap(),
            None
        );
    }
    assert_eq!(recorded, (0..20).collect());
    let counts = store.sweep_counts(acct, "sw").await.unwrap();
    assert_eq!(counts.succeeded, 20);
    let cells = store
        .list_cells(acct, "sw", &CellFilter::default())
        .await
        .unwrap();
    for c in &cells {
        let expected = if lost[2..].iter().any(|l| l.idx == c.idx) {
            2
        } else {
            1
        };
        assert_eq!(c.attempts, expected, "cell {}", c.idx);
    }
    let row = store.get_sweep(acct, "sw").await.unwrap().unwrap();
    assert_eq!(row.state, SweepState::Done);
    store.close().await;
}

/// Prints the claim rate (not asserted: it depends on the machine and the
/// build); `shoal bench sweep` reports the same measurement.
async fn measure_claim_rate(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "bench").await;
    for (claimers, batch) in [(8, 1), (8, 16)] {
        let started = now();
        let rate = shoal_store::measure_claims(store, acct, 2_000, claimers, batch)
            .await
            .unwrap();
        eprintln!(
            "{}: {} cells, {} claimers, batch {}: {:.0} claims/s (claim + finish; {:.2} s)",
            rate.backend,
            rate.cells,
            rate.claimers,
            rate.batch,
            rate.claims_per_second,
            rate.seconds
        );
        assert_eq!(rate.cells, 2_000);
        let sweeps = store.list_sweeps(acct).await.unwrap();
        let sweep = &sweeps[0];
        assert!(sweep.created_at >= started - 1.0);
        assert_eq!(sweep.state, SweepState::Done);
        assert_eq!(
            store.sweep_counts(acct, &sweep.id).await.unwrap().succeeded,
            2_000
        );
    }
}

/// Job ids: the first sweep gets 1000, each takes a block of as many ids as
/// it has cells (one if none), concurrent creates never overlap, and a sweep
/// is found by its job id only by its owner.
async fn job_ids_are_blocks_unique_and_increasing(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "j").await;
    let other = account_id(store, "j2").await;
    let first = store
        .create_sweep(&new_sweep("a", acct, 5), T0)
        .await
        .unwrap();
    assert_eq!(first.job_id, 1000);
    let empty = store
        .create_sweep(&new_sweep("b", acct, 0), T0)
        .await
        .unwrap();
    assert_eq!(empty.job_id, 1005);
    let third = store
        .create_sweep(&new_sweep("c", acct, 2), T0)
        .await
        .unwrap();
    assert_eq!(third.job_id, 1006);

    // Eight creators at once, from two stores on the same database.
    let second_store = db.reopen().await;
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..8usize {
        let store = if n % 2 == 0 {
            store.clone()
        } else {
            second_store.clone()
        };
        tasks.spawn(async move {
            let row = store
                .create_sweep(&new_sweep(&format!("par{n}"), acct, n + 1), T0)
                .await
                .unwrap();
            (row.job_id, n as u64 + 1)
        });
    }
    let mut blocks = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        blocks.push(joined.unwrap());
    }
    blocks.sort();
    assert_eq!(blocks[0].0, 1008);
    for pair in blocks.windows(2) {
        assert_eq!(
            pair[0].0 + pair[0].1,
            pair[1].0,
            "blocks {blocks:?} overlap or leave gaps"
        );
    }
    let found = store.sweep_by_job_id(acct, 1006).await.unwrap().unwrap();
    assert_eq!(found.id, "c");
    assert!(store.sweep_by_job_id(other, 1006).await.unwrap().is_none());
    assert!(
        store.sweep_by_job_id(acct, 1007).await.unwrap().is_none(),
        "a task's id, not a sweep's"
    );
    second_store.close().await;
}

/// `after_ok`: a held sweep is never claimed; it becomes active when every
/// dependency is done with all cells succeeded, and cancelled (its cells
/// too) when one ends otherwise.
async fn held_sweeps_wait_for_their_dependencies(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "h").await;
    store
        .create_sweep(&new_sweep("good", acct, 2), T0)
        .await
        .unwrap();
    store
        .create_sweep(&new_sweep("bad", acct, 1), T0 + 0.1)
        .await
        .unwrap();
    let waits_good = NewSweep {
        after_ok: vec!["good".to_owned()],
        ..new_sweep("after-good", acct, 2)
    };
    let row = store.create_sweep(&waits_good, T0 + 0.2).await.unwrap();
    assert_eq!(
        (row.state, row.reason.as_deref()),
        (SweepState::Held, Some("Dependency"))
    );
    let waits_both = NewSweep {
        after_ok: vec!["good".to_owned(), "bad".to_owned()],
        ..new_sweep("after-both", acct, 3)
    };
    store.create_sweep(&waits_both, T0 + 0.3).await.unwrap();
    assert_eq!(
        store
            .get_sweep(acct, "after-both")
            .await
            .unwrap()
            .unwrap()
            .after_ok,
        vec!["good".to_owned(), "bad".to_owned()]
    );

    // Nothing resolves while the dependencies run; held cells are never claimed.
    assert_eq!(
        store.resolve_held(T0 + 1.0).await.unwrap(),
        Default::default()
    );
    let claims = store
        .claim_cells("r", None, 100, LEASE, T0 + 1.0)
        .await
        .unwrap();
    assert!(
        claims
            .iter()
            .all(|c| c.sweep_id == "good" || c.sweep_id == "bad"),
        "{claims:?}"
    );
    assert_eq!(claims.len(), 3);
    for c in &claims {
        let outcome = if c.sweep_id == "bad" {
            failed(T0 + 2.0)
        } else {
            ok(T0 + 2.0)
        };
        store
            .finish_cell(&c.sweep_id, c.idx, &c.claim_id, &outcome)
            .await
            .unwrap();
    }
    let resolved = store.resolve_held(T0 + 3.0).await.unwrap();
    assert_eq!(resolved.activated, vec!["after-good".to_owned()]);
    assert_eq!(resolved.cancelled, vec!["after-both".to_owned()]);
    let row = store.get_sweep(acct, "after-both").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.reason.as_deref(), row.finished_at),
        (
            SweepState::Cancelled,
            Some("DependencyNeverSatisfied"),
            Some(T0 + 3.0)
        )
    );
    assert_eq!(
        store
            .sweep_counts(acct, "after-both")
            .await
            .unwrap()
            .cancelled,
        3
    );
    let row = store.get_sweep(acct, "after-good").await.unwrap().unwrap();
    assert_eq!((row.state, row.reason), (SweepState::Active, None));
    let claims = store
        .claim_cells("r", None, 100, LEASE, T0 + 4.0)
        .await
        .unwrap();
    assert_eq!(claims.len(), 2);
    assert!(claims.iter().all(|c| c.sweep_id == "after-good"));
    // Resolving again changes nothing.
    assert_eq!(
        store.resolve_held(T0 + 5.0).await.unwrap(),
        Default::default()
    );

    // A held sweep can be cancelled by its owner like any other.
    let waits = NewSweep {
        after_ok: vec!["after-good".to_owned()],
        ..new_sweep("later", acct, 2)
    };
    store.create_sweep(&waits, T0 + 6.0).await.unwrap();
    assert_eq!(
        store.cancel_sweep(acct, "later", T0 + 7.0).await.unwrap(),
        Some(vec![])
    );
    let row = store.get_sweep(acct, "later").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.finished_at),
        (SweepState::Cancelled, Some(T0 + 7.0))
    );
}

/// Cancelling some cells: pending ones at once, running ones through their
/// runner (told by the renewal), recorded `cancelled` unless they
/// succeeded; a requeue runs them again.
async fn cancelling_single_cells(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "c").await;
    store
        .create_sweep(&new_sweep("sw", acct, 6), T0)
        .await
        .unwrap();
    let claims = store.claim_cells("r", None, 3, LEASE, T0).await.unwrap();
    assert_eq!(
        claims.iter().map(|c| c.idx).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert!(store
        .cancel_cells(acct + 1000, "sw", &[0], T0)
        .await
        .unwrap()
        .is_none());
    let running = store
        .cancel_cells(acct, "sw", &[0, 1, 4, 99], T0 + 1.0)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        running.iter().map(|c| c.idx).collect::<Vec<_>>(),
        vec![0, 1]
    );
    let cell = |idx| store.get_cell(acct, "sw", idx);
    assert_eq!(cell(4).await.unwrap().unwrap().state, CellState::Cancelled);
    assert!(cell(0).await.unwrap().unwrap().cancel_requested);
    assert_eq!(
        store
            .renew_lease("sw", 0, &claims[0].claim_id, LEASE, T0 + 2.0)
            .await
            .unwrap(),
        Renewal::Cancelled
    );
    assert_eq!(
        store
            .renew_lease("sw", 2, &claims[2].claim_id, LEASE, T0 + 2.0)
            .await
            .unwrap(),
        Renewal::Renewed
    );
    // Killed: cancelled. Finished before the kill: succeeded.
    let end = store
        .finish_cell("sw", 0, &claims[0].claim_id, &failed(T0 + 3.0))
        .await
        .unwrap();
    assert_eq!(end, Some(CellState::Cancelled));
    let end = store
        .finish_cell("sw", 1, &claims[1].claim_id, &ok(T0 + 3.0))
        .await
        .unwrap();
    assert_eq!(end, Some(CellState::Succeeded));
    let counts = store.sweep_counts(acct, "sw").await.unwrap();
    assert_eq!(
        (
            counts.cancelled,
            counts.succeeded,
            counts.running,
            counts.pending
        ),
        (2, 1, 1, 2)
    );
    assert_eq!(
        store.get_sweep(acct, "sw").await.unwrap().unwrap().state,
        SweepState::Active
    );

    // A requeue runs the cancelled cells again, no longer marked.
    assert_eq!(store.requeue_failed(acct, "sw").await.unwrap(), Some(2));
    let c0 = cell(0).await.unwrap().unwrap();
    assert_eq!(
        (c0.state, c0.cancel_requested, c0.attempts),
        (CellState::Pending, false, 0)
    );
    assert!(cell(999).await.unwrap().is_none());
    assert!(store
        .get_cell(acct + 1000, "sw", 0)
        .await
        .unwrap()
        .is_none());
}

/// A runner that crashed and starts again gives back what it held, without
/// using up attempts; another runner's claims stay.
async fn a_restarted_runner_gives_its_claims_back_uncounted(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "r").await;
    store
        .create_sweep(&new_sweep("sw", acct, 4), T0)
        .await
        .unwrap();
    let mine = store
        .claim_cells("host-a", None, 2, LEASE, T0)
        .await
        .unwrap();
    let theirs = store
        .claim_cells("host-b", None, 1, LEASE, T0)
        .await
        .unwrap();
    assert_eq!(
        store
            .release_runner_claims("host-a", T0 + 1.0)
            .await
            .unwrap(),
        2
    );
    for c in &mine {
        let row = store.get_cell(acct, "sw", c.idx).await.unwrap().unwrap();
        assert_eq!(
            (row.state, row.attempts, row.claim_id),
            (CellState::Pending, 0, None)
        );
        // The old claim is fenced off.
        assert_eq!(
            store
                .finish_cell("sw", c.idx, &c.claim_id, &ok(T0 + 2.0))
                .await
                .unwrap(),
            None
        );
    }
    let row = store
        .get_cell(acct, "sw", theirs[0].idx)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.state, CellState::Running);
    assert_eq!(
        store
            .release_runner_claims("host-a", T0 + 3.0)
            .await
            .unwrap(),
        0
    );
}

/// What the runner and the bridge store comes back as stored: workdir,
/// files, slurm, started_at at the first claim, signal, truncation and
/// timings of an attempt, and the usage summed per sweep.
async fn runner_fields_round_trip(db: Arc<Db>) {
    let store = &db.store.clone().with_rate_card(RateCard::default());
    let acct = account_id(store, "f").await;
    let new = NewSweep {
        workdir: Some("/work".to_owned()),
        files: BTreeMap::from([("/work/a.py".to_owned(), "cHJpbnQoMSk=".to_owned())]),
        slurm: Some(serde_json::json!({"job_name": "x", "array": "0-2%1"})),
        ..new_sweep("sw", acct, 3)
    };
    let row = store.create_sweep(&new, T0).await.unwrap();
    assert_eq!(row.started_at, None);
    let fetched = store.get_sweep(acct, "sw").await.unwrap().unwrap();
    assert_eq!(fetched, row);
    let claims = store
        .claim_cells("r", None, 3, LEASE, T0 + 5.0)
        .await
        .unwrap();
    store
        .claim_cells("r", None, 3, LEASE, T0 + 9.0)
        .await
        .unwrap();
    assert_eq!(
        store
            .get_sweep(acct, "sw")
            .await
            .unwrap()
            .unwrap()
            .started_at,
        Some(T0 + 5.0)
    );
    let timings =
        serde_json::json!({"create": 120, "exec": 30, "run": 500, "collect": 4, "delete": 20});
    for (n, c) in claims.iter().enumerate() {
        let outcome = CellOutcome {
            exit_code: Some(137),
            signal: Some(9),
            output_truncated: true,
            timings: Some(timings.clone()),
            stdout_tail: Some("x".repeat(1 << 20)),
            cpu_seconds: 1.0 + n as f64,
            gib_seconds: 2.0,
            ..CellOutcome::new(CellEnd::Failed, T0 + 6.0)
        };
        store
            .finish_cell("sw", c.idx, &c.claim_id, &outcome)
            .await
            .unwrap();
    }
    let cell = store.get_cell(acct, "sw", 1).await.unwrap().unwrap();
    assert_eq!((cell.signal, cell.output_truncated), (Some(9), true));
    assert_eq!(cell.timings, Some(timings));
    assert_eq!(cell.stdout_tail.map(|s| s.len()), Some(1 << 20));
    let summary = store.sweep_summary(acct, "sw").await.unwrap();
    assert_eq!(summary.counts.failed, 3);
    assert!((summary.cpu_seconds - 6.0).abs() < 1e-9);
    assert!((summary.gib_seconds - 6.0).abs() < 1e-9);
    assert!(summary.cost_usd > 0.0);
    assert_eq!(
        store.sweep_summary(acct + 1000, "sw").await.unwrap(),
        Default::default()
    );
}

/// A sweep's env is a tenant's secret: a host's role reads it (through the
/// store, as the runner does) only once it has claimed a cell of the sweep,
/// and never from the column itself.
async fn a_host_reads_a_sweeps_env_only_once_it_runs_a_cell(db: Arc<Db>) {
    let store = &db.store;
    let Some(host) = db.as_host("host-a").await else {
        return;
    };
    let acct = account_id(store, "alice").await;
    store
        .create_sweep(&new_sweep("sw-env", acct, 2), T0)
        .await
        .unwrap();
    let seen = host.sweep_by_id("sw-env").await.unwrap().unwrap();
    assert!(seen.env.is_empty(), "{:?}", seen.env);
    assert_eq!(seen.command, "python train.py --lr {cell}");
    assert!(host.list_sweeps(acct).await.unwrap()[0].env.is_empty());
    let url = {
        let password = "hostapassword0123456789abcdef0123456789";
        let role = store
            .ensure_host_role("host-a", password)
            .await
            .unwrap()
            .unwrap();
        shoal_store::host_database_url(&db.url, &role, password).unwrap()
    };
    let mut raw = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
        .await
        .unwrap();
    let column = sqlx::query("SELECT env FROM sweeps")
        .fetch_all(&mut raw)
        .await;
    assert!(column.is_err(), "a host read sweeps.env");
    // Another host's claim shows host-a nothing; its own shows the env.
    store
        .claim_cells("host-b", Some("sw-env"), 1, LEASE, T0 + 1.0)
        .await
        .unwrap();
    assert!(host
        .sweep_by_id("sw-env")
        .await
        .unwrap()
        .unwrap()
        .env
        .is_empty());
    let claims = host
        .claim_cells("host-a", Some("sw-env"), 1, LEASE, T0 + 1.0)
        .await
        .unwrap();
    assert_eq!(claims.len(), 1);
    let runs = host.sweep_by_id("sw-env").await.unwrap().unwrap();
    assert_eq!(runs.env.get("SEED").map(String::as_str), Some("7"));
    // The fronts' own role reads it whole.
    assert_eq!(
        store
            .get_sweep(acct, "sw-env")
            .await
            .unwrap()
            .unwrap()
            .env
            .len(),
        1
    );
    host.close().await;
}

async fn held_by_the_user_or_until_a_begin_time(db: Arc<Db>) {
    let store = &db.store;
    let acct = account_id(store, "h").await;
    let other = account_id(store, "o").await;
    let state = |id: &'static str| async move {
        let row = store.get_sweep(acct, id).await.unwrap().unwrap();
        (row.state, row.reason)
    };
    // --hold: held until released, whatever the time.
    let held = NewSweep {
        hold: true,
        ..new_sweep("held", acct, 2)
    };
    let row = store.create_sweep(&held, T0).await.unwrap();
    assert_eq!(
        (row.state, row.reason.as_deref()),
        (SweepState::Held, Some("JobHeldUser"))
    );
    assert!(row.user_hold);
    store.resolve_held(T0 + 1000.0).await.unwrap();
    assert_eq!(state("held").await.0, SweepState::Held);
    let claims = store
        .claim_cells("runner", Some("held"), 2, LEASE, T0 + 1.0)
        .await
        .unwrap();
    assert!(claims.is_empty(), "a held sweep's cell was claimed");
    // Another account can neither release nor hold it.
    assert!(!store.release_sweep(other, "held", T0 + 2.0).await.unwrap());
    assert!(store.release_sweep(acct, "held", T0 + 2.0).await.unwrap());
    assert_eq!(state("held").await, (SweepState::Active, None));
    assert!(!store.release_sweep(acct, "held", T0 + 2.0).await.unwrap());

    // --begin: held until the time, then active.
    let later = NewSweep {
        begin_at: Some(T0 + 100.0),
        ..new_sweep("later", acct, 1)
    };
    let row = store.create_sweep(&later, T0).await.unwrap();
    assert_eq!(
        (row.state, row.reason.as_deref()),
        (SweepState::Held, Some("BeginTime"))
    );
    store.resolve_held(T0 + 50.0).await.unwrap();
    assert_eq!(state("later").await.0, SweepState::Held);
    store.resolve_held(T0 + 100.0).await.unwrap();
    assert_eq!(state("later").await.0, SweepState::Active);
    // A begin time already past is no hold.
    let past = NewSweep {
        begin_at: Some(T0 - 1.0),
        ..new_sweep("past", acct, 1)
    };
    assert_eq!(
        store.create_sweep(&past, T0).await.unwrap().state,
        SweepState::Active
    );

    // scontrol hold on an active sweep: its running cell goes on (and may
    // be retried), nothing new starts; release starts the rest.
    let running = NewSweep {
        max_attempts: 2,
        ..new_sweep("running", acct, 3)
    };
    store.create_sweep(&running, T0).await.unwrap();
    let first = store
        .claim_cells("runner", Some("running"), 1, LEASE, T0 + 1.0)
        .await
        .unwrap();
    assert_eq!(first.len(), 1);
    assert!(!store.hold_sweep(other, "running").await.unwrap());
    assert!(store.hold_sweep(acct, "running").await.unwrap());
    assert_eq!(
        state("running").await,
        (SweepState::Held, Some("JobHeldUser".to_owned()))
    );
    let none = store
        .claim_cells("runner", Some("running"), 3, LEASE, T0 + 2.0)
        .await
        .unwrap();
    assert!(none.is_empty(), "a held sweep started a cell");
    let after = store
        .finish_cell(
            "running",
            first[0].idx,
            &first[0].claim_id,
            &failed(T0 + 3.0),
        )
        .await
        .unwrap();
    assert_eq!(
        after,
        Some(CellState::Pending),
        "the failed cell is retried later"
    );
    assert!(store
        .release_sweep(acct, "running", T0 + 4.0)
        .await
        .unwrap());
    let rest = store
        .claim_cells("runner", Some("running"), 3, LEASE, T0 + 5.0)
        .await
        .unwrap();
    assert_eq!(rest.len(), 3);
}
