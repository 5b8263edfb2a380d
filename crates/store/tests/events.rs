//! Sandboxes' event logs against real databases (see `common`): the newest
//! `EVENTS_KEPT` of each sandbox are kept, read oldest first by `tail`,
//! after an id and from a time; one sandbox's trim leaves the others'.

mod common;

use std::sync::Arc;

use common::Db;
use shoal_store::{SandboxEvent, EVENTS_KEPT};

const T0: f64 = 1_800_000_000.0;

cases!(the_newest_events_are_kept_and_read_in_order);

fn event(sandbox: &str, n: i64) -> SandboxEvent {
    SandboxEvent {
        id: 0,
        sandbox_id: sandbox.into(),
        at: T0 + n as f64,
        kind: format!("sandbox.test{n}"),
        payload: format!("{{\"n\":{n}}}"),
    }
}

async fn the_newest_events_are_kept_and_read_in_order(db: Arc<Db>) {
    let store = &db.store;
    let total = EVENTS_KEPT + 5;
    let all: Vec<SandboxEvent> = (0..total).map(|n| event("sb-a", n)).collect();
    for batch in all.chunks(300) {
        store.append_sandbox_events(batch).await.unwrap();
    }
    store
        .append_sandbox_events(&[event("sb-b", 0), event("sb-b", 1)])
        .await
        .unwrap();
    let kept = store.sandbox_events("sb-a", 10_000, 0, 0.0).await.unwrap();
    assert_eq!(kept.len() as i64, EVENTS_KEPT);
    assert_eq!(kept[0].kind, "sandbox.test5", "the oldest five went");
    assert_eq!(
        kept.last().unwrap().kind,
        format!("sandbox.test{}", total - 1)
    );
    assert!(kept.windows(2).all(|w| w[0].id < w[1].id), "oldest first");
    assert_eq!(kept[0].payload, "{\"n\":5}");
    let tail = store.sandbox_events("sb-a", 2, 0, 0.0).await.unwrap();
    let kinds: Vec<&str> = tail.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            format!("sandbox.test{}", total - 2),
            format!("sandbox.test{}", total - 1)
        ]
    );
    let since = store
        .sandbox_events("sb-a", 10_000, 0, T0 + (total - 3) as f64)
        .await
        .unwrap();
    assert_eq!(since.len(), 3);
    let after = store
        .sandbox_events("sb-a", 10_000, kept[kept.len() - 2].id, 0.0)
        .await
        .unwrap();
    assert_eq!(after.len(), 1);
    assert_eq!(
        store
            .sandbox_events("sb-b", 50, 0, 0.0)
            .await
            .unwrap()
            .len(),
        2
    );
    assert!(store
        .sandbox_events("sb-none", 50, 0, 0.0)
        .await
        .unwrap()
        .is_empty());
}
