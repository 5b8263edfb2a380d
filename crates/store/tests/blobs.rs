//! A job's data path against real databases (SQLite, and PostgreSQL when
//! `SHOAL_TEST_DATABASE_URL` names one): blobs committed whole and per
//! account, staged chunks never read, a running task's output in order.

mod common;

use std::sync::Arc;

use common::Db;
use shoal_store::{staging_key, DataPath, InputFile, NewSweep, Store, Tier};

const T0: f64 = 1_800_000_000.0;

cases!(
    a_blob_is_read_only_once_committed_and_only_by_its_account,
    committing_the_same_content_twice_keeps_one_copy,
    output_of_the_latest_attempt_in_order_and_bounded,
    garbage_is_collected_by_age,
    a_sweeps_data_path_round_trips,
);

async fn account_id(store: &Store, name: &str) -> i64 {
    let token = store.create_token(name, Tier::Team).await.unwrap();
    store.authenticate(&token).await.unwrap().unwrap().id
}

async fn a_blob_is_read_only_once_committed_and_only_by_its_account(db: Arc<Db>) {
    let store = &db.store;
    let a = account_id(store, "a").await;
    let b = account_id(store, "b").await;
    let staging = staging_key(T0);
    store
        .put_blob_chunk(a, &staging, 0, b"hello ")
        .await
        .unwrap();
    store
        .put_blob_chunk(a, &staging, 1, b"world")
        .await
        .unwrap();
    // Staged: neither listed nor readable, under either name.
    let digests = vec!["d1".to_owned(), "d2".to_owned()];
    assert_eq!(store.missing_blobs(a, &digests).await.unwrap(), digests);
    assert_eq!(store.blob_chunk(a, &staging, 0).await.unwrap(), None);
    store.commit_blob(a, &staging, "d1", 11, T0).await.unwrap();
    assert_eq!(store.missing_blobs(a, &digests).await.unwrap(), ["d2"]);
    assert_eq!(store.blob_size(a, "d1").await.unwrap(), Some(11));
    assert_eq!(
        store.blob_chunk(a, "d1", 0).await.unwrap().unwrap(),
        b"hello "
    );
    assert_eq!(
        store.blob_chunk(a, "d1", 1).await.unwrap().unwrap(),
        b"world"
    );
    assert_eq!(store.blob_chunk(a, "d1", 2).await.unwrap(), None);
    assert_eq!(store.account_blob_bytes(a).await.unwrap(), 11);
    // Another account knowing the digest gets nothing.
    assert_eq!(store.missing_blobs(b, &digests).await.unwrap(), digests);
    assert_eq!(store.blob_chunk(b, "d1", 0).await.unwrap(), None);
    assert_eq!(store.blob_size(b, "d1").await.unwrap(), None);
    assert_eq!(store.account_blob_bytes(b).await.unwrap(), 0);
    // A discarded upload leaves nothing.
    let dropped = staging_key(T0);
    store.put_blob_chunk(a, &dropped, 0, b"x").await.unwrap();
    store.discard_staged_blob(a, &dropped).await.unwrap();
    store.commit_blob(a, &dropped, "d2", 0, T0).await.unwrap();
    assert_eq!(store.blob_chunk(a, "d2", 0).await.unwrap(), None);
}

async fn committing_the_same_content_twice_keeps_one_copy(db: Arc<Db>) {
    let store = &db.store;
    let a = account_id(store, "a").await;
    let first = staging_key(T0);
    let second = staging_key(T0);
    assert_ne!(first, second);
    for key in [&first, &second] {
        store.put_blob_chunk(a, key, 0, b"same").await.unwrap();
    }
    store.commit_blob(a, &first, "same", 4, T0).await.unwrap();
    store
        .commit_blob(a, &second, "same", 4, T0 + 1.0)
        .await
        .unwrap();
    assert_eq!(
        store.blob_chunk(a, "same", 0).await.unwrap().unwrap(),
        b"same"
    );
    assert_eq!(store.account_blob_bytes(a).await.unwrap(), 4);
    // The second copy's chunks went (collected as staged at once otherwise).
    assert_eq!(store.collect_garbage(0.0, T0 + 10.0, 0.0).await.unwrap(), 0);
    assert_eq!(
        store.blob_chunk(a, "same", 0).await.unwrap().unwrap(),
        b"same"
    );
}

async fn output_of_the_latest_attempt_in_order_and_bounded(db: Arc<Db>) {
    let store = &db.store;
    assert_eq!(store.cell_output("sw", 0, 0, 1 << 20).await.unwrap(), None);
    store
        .append_cell_output("sw", 0, 1, 0, "stdout", b"old")
        .await
        .unwrap();
    for (seq, stream, data) in [
        (0, "stdout", "a"),
        (1, "stderr", "bb"),
        (2, "stdout", "ccc"),
    ] {
        store
            .append_cell_output("sw", 0, 2, seq, stream, data.as_bytes())
            .await
            .unwrap();
    }
    // Another cell's output is its own.
    store
        .append_cell_output("sw", 1, 1, 0, "stdout", b"other")
        .await
        .unwrap();
    let (epoch, chunks) = store
        .cell_output("sw", 0, 0, 1 << 20)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(epoch, 2);
    let got: Vec<(u64, &str, &[u8])> = chunks
        .iter()
        .map(|c| (c.seq, c.stream.as_str(), c.data.as_slice()))
        .collect();
    assert_eq!(
        got,
        [
            (0, "stdout", &b"a"[..]),
            (1, "stderr", b"bb"),
            (2, "stdout", b"ccc")
        ]
    );
    // From a later flush; and at most max_bytes, but always one flush.
    let (_, later) = store
        .cell_output("sw", 0, 2, 1 << 20)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(later.len(), 1);
    let (_, bounded) = store.cell_output("sw", 0, 0, 2).await.unwrap().unwrap();
    assert_eq!(bounded.len(), 1);
    let (_, one) = store.cell_output("sw", 0, 2, 0).await.unwrap().unwrap();
    assert_eq!(one.len(), 1);
    // A new attempt starts clean.
    store
        .append_cell_output("sw", 0, 3, 0, "stdout", b"new")
        .await
        .unwrap();
    let (epoch, chunks) = store
        .cell_output("sw", 0, 0, 1 << 20)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((epoch, chunks.len()), (3, 1));
}

async fn garbage_is_collected_by_age(db: Arc<Db>) {
    let store = &db.store;
    let a = account_id(store, "a").await;
    for (name, at) in [("old", T0), ("new", T0 + 100.0)] {
        let key = staging_key(at);
        store
            .put_blob_chunk(a, &key, 0, name.as_bytes())
            .await
            .unwrap();
        store.commit_blob(a, &key, name, 3, at).await.unwrap();
    }
    let abandoned = staging_key(T0);
    store
        .put_blob_chunk(a, &abandoned, 0, b"half")
        .await
        .unwrap();
    let live = staging_key(T0 + 100.0);
    store.put_blob_chunk(a, &live, 0, b"half").await.unwrap();
    // Naming "old" in a job keeps it.
    store
        .touch_blobs(a, &["old".to_owned()], T0 + 60.0)
        .await
        .unwrap();
    assert_eq!(
        store
            .collect_garbage(T0 + 50.0, T0 + 50.0, 0.0)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        store
            .collect_garbage(T0 + 70.0, T0 + 50.0, 0.0)
            .await
            .unwrap(),
        1
    );
    assert_eq!(store.blob_size(a, "old").await.unwrap(), None);
    assert_eq!(
        store.blob_chunk(a, "new", 0).await.unwrap().unwrap(),
        b"new"
    );
    // The live upload still commits; the abandoned one is gone.
    store
        .commit_blob(a, &live, "live", 4, T0 + 100.0)
        .await
        .unwrap();
    assert_eq!(
        store.blob_chunk(a, "live", 0).await.unwrap().unwrap(),
        b"half"
    );
    store
        .commit_blob(a, &abandoned, "abandoned", 4, T0 + 100.0)
        .await
        .unwrap();
    assert_eq!(store.blob_chunk(a, "abandoned", 0).await.unwrap(), None);
}

async fn a_sweeps_data_path_round_trips(db: Arc<Db>) {
    let store = &db.store;
    let a = account_id(store, "a").await;
    let data_path = DataPath {
        inputs: vec![InputFile {
            path: "/home/ada/run/samples.txt".into(),
            digest: "abc".into(),
            size: 12,
            mode: 0o644,
        }],
        results_under: vec!["/home/ada/run".into()],
    };
    let new = NewSweep {
        id: "sw-data".into(),
        account_id: a,
        name: "data".into(),
        template: "base".into(),
        command: "true".into(),
        cells: vec!["0".into()],
        throttle: 1,
        timeout_seconds: 60,
        max_attempts: 1,
        data_path: Some(data_path.clone()),
        ..NewSweep::default()
    };
    store.create_sweep(&new, T0).await.unwrap();
    let row = store.get_sweep(a, "sw-data").await.unwrap().unwrap();
    assert_eq!(row.data_path, Some(data_path));
    let plain = NewSweep {
        id: "sw-plain".into(),
        data_path: None,
        ..new
    };
    store.create_sweep(&plain, T0).await.unwrap();
    assert_eq!(
        store
            .get_sweep(a, "sw-plain")
            .await
            .unwrap()
            .unwrap()
            .data_path,
        None
    );
}
