//! The front sends a request about one snapshot to the host whose disk
//! holds it (a delete frees its files there): GET and DELETE by id go to
//! the host in the snapshot's row; another account's or an unknown id stops
//! at the front with 404; while that host is stale a GET goes to any live
//! agent and a DELETE is 503 with Retry-After. The agents are stand-ins that
//! answer with their own name; the database (SQLite) and HTTP are real.

mod common;

use common::{now, report, stand_in};
use serde_json::{json, Value};
use shoal_store::{SnapshotRow, Store, Tier};

#[tokio::test]
async fn snapshots_are_routed_to_the_host_that_holds_them() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("shoal.db").display());
    let store = Store::connect(&url).await.unwrap();
    let (h1, h2) = (stand_in("h1").await, stand_in("h2").await);
    store
        .report_host(&report("h1", &h1, 2_000), now())
        .await
        .unwrap();
    store
        .report_host(&report("h2", &h2, 14_000), now())
        .await
        .unwrap();
    let token = store.create_token("alice", Tier::Team).await.unwrap();
    let account = store.authenticate(&token).await.unwrap().unwrap();
    for (id, host) in [("snap-on-h1", "h1"), ("snap-on-gone", "h-gone")] {
        store
            .insert_snapshot(&SnapshotRow {
                id: id.into(),
                account_id: account.id,
                sandbox_id: None,
                template: "base".into(),
                size_bytes: Some(1),
                host: Some(host.into()),
                created_at: now(),
            })
            .await
            .unwrap();
    }

    let address = common::serve_front(&store, &url).await;
    let base = format!("http://{address}");
    let http = reqwest::Client::new();
    let call = |method: reqwest::Method, path: &str, token: &str| {
        http.request(method, format!("{base}{path}"))
            .bearer_auth(token)
            .send()
    };

    // Whatever h2's better placement score, h1 holds the files.
    for method in [reqwest::Method::GET, reqwest::Method::DELETE] {
        let answer: Value = call(method.clone(), "/v1/snapshots/snap-on-h1", &token)
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(answer["host"], "h1", "{method}: {answer}");
        assert_eq!(answer["path"], "/v1/snapshots/snap-on-h1");
        assert_eq!(answer["method"], method.as_str());
    }
    // Another account's and unknown ids stop at the front.
    let bob = store.create_token("bob", Tier::Team).await.unwrap();
    for (path, token) in [
        ("/v1/snapshots/snap-on-h1", bob.as_str()),
        ("/v1/snapshots/nope", token.as_str()),
    ] {
        let answer = call(reqwest::Method::DELETE, path, token).await.unwrap();
        assert_eq!(answer.status(), reqwest::StatusCode::NOT_FOUND, "{path}");
    }
    // Its host is gone: a read from any agent, a delete refused.
    let answer: Value = call(reqwest::Method::GET, "/v1/snapshots/snap-on-gone", &token)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(answer["host"] == "h1" || answer["host"] == "h2", "{answer}");
    let answer = call(
        reqwest::Method::DELETE,
        "/v1/snapshots/snap-on-gone",
        &token,
    )
    .await
    .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.headers()["retry-after"], "15");
    // The list goes to any agent, as before.
    let list: Value = call(reqwest::Method::GET, "/v1/snapshots", &token)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["path"], "/v1/snapshots");

    // A create from a snapshot goes to the host that holds it, whatever
    // placement would prefer; its host gone, 503 naming the snapshot.
    let create = |body: Value| {
        http.post(format!("{base}/v1/sandboxes"))
            .bearer_auth(&token)
            .json(&body)
            .send()
    };
    let answer = create(json!({"from_snapshot": "snap-on-h1"}))
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::OK);
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(answer["host"], "h1", "{answer}");
    let answer: Value = create(json!({"template": "base"}))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        answer["host"], "h2",
        "without a snapshot placement prefers h2: {answer}"
    );
    let answer = create(json!({"from_snapshot": "snap-on-gone"}))
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.headers()["retry-after"], "15");
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(answer["error"], "snapshot host unavailable");
    let answer = create(json!({"from_snapshot": "nope"})).await.unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::NOT_FOUND);
    // A volume on another host than the snapshot: no host has both.
    let limits = shoal_store::VolumeLimits {
        count: 10,
        size_mb: 100,
        total_mb: 1000,
    };
    let new = shoal_store::NewVolume {
        name: "data".into(),
        size_mb: 10,
        host: "h2".into(),
    };
    store
        .create_volume(&account, &new, &limits, now())
        .await
        .unwrap();
    let answer = create(json!({"from_snapshot": "snap-on-h1", "volumes": [{"name": "data"}]}))
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::CONFLICT);
}
