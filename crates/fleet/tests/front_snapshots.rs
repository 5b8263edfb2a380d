//! The front sends a request about one snapshot to the host whose disk
//! holds it (a delete frees its files there): GET and DELETE by id go to
//! the host in the snapshot's row; another account's or an unknown id stops
//! at the front with 404; while that host is stale a GET goes to any live
//! agent and a DELETE is 503 with Retry-After. An account's template
//! restores a snapshot, so creates naming it, and naming a template, go to
//! that snapshot's host too. The agents are stand-ins that answer with
//! their own name; the database (SQLite) and HTTP are real.

mod common;

use common::now;
use serde_json::{json, Value};
use shoal_store::{SnapshotRow, Tier};

#[tokio::test]
async fn snapshots_are_routed_to_the_host_that_holds_them() {
    let dir = tempfile::tempdir().unwrap();
    let (store, url) = common::two_hosts(dir.path()).await;
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
                vcpus: None,
                memory_mib: None,
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

/// An account's template restores its snapshot, so a create naming it goes
/// to the snapshot's host, as does naming a sandbox or snapshot as a
/// template; another account's name pins nothing and its ids stop at the
/// front.
/// Alice's templates `tools` (its snapshot on h1) and `stranded` (its
/// snapshot on a host that is gone).
async fn templates_on_h1_and_a_gone_host(store: &shoal_store::Store, alice: &shoal_store::Account) {
    for (id, host) in [("snap-on-h1", "h1"), ("snap-on-gone", "h-gone")] {
        store
            .insert_snapshot(&SnapshotRow {
                id: id.into(),
                account_id: alice.id,
                sandbox_id: None,
                template: "base".into(),
                size_bytes: Some(1),
                host: Some(host.into()),
                created_at: now(),
                vcpus: None,
                memory_mib: None,
            })
            .await
            .unwrap();
    }
    for (name, snapshot) in [("tools", "snap-on-h1"), ("stranded", "snap-on-gone")] {
        let row = shoal_store::TemplateRow {
            account_id: alice.id,
            name: name.into(),
            snapshot_id: snapshot.into(),
            base: "base".into(),
            start_cmd: None,
            ready_cmd: None,
            published: false,
            created_at: now(),
        };
        store.insert_template(alice, &row, 10).await.unwrap();
    }
}

#[tokio::test]
async fn an_accounts_templates_go_where_their_snapshot_is() {
    let dir = tempfile::tempdir().unwrap();
    let (store, url) = common::two_hosts(dir.path()).await;
    let token = store.create_token("alice", Tier::Team).await.unwrap();
    let alice = store.authenticate(&token).await.unwrap().unwrap();
    let bob = store.create_token("bob", Tier::Team).await.unwrap();
    templates_on_h1_and_a_gone_host(&store, &alice).await;
    let on_h1 = shoal_store::NewSandbox {
        id: "sb-on-h1".into(),
        template: "base".into(),
        cpu: 1,
        memory_mb: 512,
        metadata: Default::default(),
        ttl_seconds: 300,
        persistent: false,
        max_lifetime_seconds: None,
        from_snapshot: None,
        parent_id: None,
        tree_id: None,
        host: Some("h1".into()),
    };
    let limits = shoal_store::TierLimits {
        concurrent: 10,
        creates_per_hour: 10,
    };
    store
        .admit_sandbox(&alice, &on_h1, &limits, now())
        .await
        .unwrap();

    let address = common::serve_front(&store, &url).await;
    let http = reqwest::Client::new();
    let post = |path: &str, token: &str, body: Value| {
        http.post(format!("http://{address}{path}"))
            .bearer_auth(token)
            .json(&body)
            .send()
    };
    let host_of = |answer: reqwest::Response| async move {
        let status = answer.status();
        let body: Value = answer.json().await.unwrap_or(Value::Null);
        (
            status.as_u16(),
            body["host"].as_str().map(str::to_owned),
            body,
        )
    };
    // Placement would prefer h2; the template's snapshot is on h1.
    let (status, host, body) = host_of(
        post("/v1/sandboxes", &token, json!({"template": "tools"}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, host.as_deref()), (200, Some("h1")), "{body}");
    let (_, host, body) = host_of(
        post("/v1/sandboxes", &token, json!({"template": "base"}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(host.as_deref(), Some("h2"), "{body}");
    // Bob has no template of that name: nothing pins his create.
    let (_, host, body) = host_of(
        post("/v1/sandboxes", &bob, json!({"template": "tools"}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(host.as_deref(), Some("h2"), "{body}");
    // Published, Alice's template pins Bob's create to its snapshot's host.
    assert!(store
        .set_template_published(alice.id, "tools", true)
        .await
        .unwrap());
    let (_, host, body) = host_of(
        post("/v1/sandboxes", &bob, json!({"template": "tools"}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(host.as_deref(), Some("h1"), "{body}");
    // Its snapshot's host gone: 503, as for the snapshot itself.
    let (status, _, body) = host_of(
        post("/v1/sandboxes", &token, json!({"template": "stranded"}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 503, "{body}");

    // Naming a template goes where the sandbox or snapshot is.
    for source in [
        json!({"name": "t1", "from_sandbox": "sb-on-h1"}),
        json!({"name": "t2", "from_snapshot": "snap-on-h1"}),
    ] {
        let (status, host, body) =
            host_of(post("/v1/templates", &token, source.clone()).await.unwrap()).await;
        assert_eq!(
            (status, host.as_deref()),
            (200, Some("h1")),
            "{source}: {body}"
        );
        assert_eq!(body["path"], "/v1/templates");
    }
    for (source, who) in [
        (
            json!({"name": "t3", "from_sandbox": "sb-nope"}),
            token.as_str(),
        ),
        (
            json!({"name": "t4", "from_snapshot": "snap-on-h1"}),
            bob.as_str(),
        ),
    ] {
        let (status, _, body) =
            host_of(post("/v1/templates", who, source.clone()).await.unwrap()).await;
        assert_eq!(status, 404, "{source}: {body}");
    }
    let (status, _, body) = host_of(
        post(
            "/v1/templates",
            &token,
            json!({"name": "t5", "from_snapshot": "snap-on-gone"}),
        )
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(status, 503, "{body}");
}

/// A template build's reads go to the host that runs it (its live log is
/// there), whatever placement prefers; another account's build stops at the
/// front; a build whose host is gone is read from any agent.
#[tokio::test]
async fn builds_are_read_on_the_host_that_runs_them() {
    let dir = tempfile::tempdir().unwrap();
    let (store, url) = common::two_hosts(dir.path()).await;
    let token = store.create_token("alice", Tier::Team).await.unwrap();
    let account = store.authenticate(&token).await.unwrap().unwrap();
    for (id, host) in [("bld-on-h1", "h1"), ("bld-on-gone", "h-gone")] {
        store
            .insert_build(&shoal_store::TemplateBuildRow {
                id: id.into(),
                account_id: account.id,
                name: "analysis".into(),
                status: shoal_store::build_status::BUILDING.into(),
                error: None,
                cache_key: None,
                snapshot_id: None,
                host: Some(host.into()),
                cache_hit: false,
                created_at: now(),
                started_at: Some(now()),
                ended_at: None,
            })
            .await
            .unwrap();
    }
    let address = common::serve_front(&store, &url).await;
    let base = format!("http://{address}");
    let http = reqwest::Client::new();
    let get = |path: &str, token: &str| http.get(format!("{base}{path}")).bearer_auth(token).send();
    for path in [
        "/v1/templates/builds/bld-on-h1",
        "/v1/templates/builds/bld-on-h1/logs?follow=1",
    ] {
        let answer: Value = get(path, &token).await.unwrap().json().await.unwrap();
        assert_eq!(answer["host"], "h1", "{path}: {answer}");
    }
    let bob = store.create_token("bob", Tier::Team).await.unwrap();
    let answer = get("/v1/templates/builds/bld-on-h1/logs", &bob)
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::NOT_FOUND);
    let answer: Value = get("/v1/templates/builds/bld-on-gone", &token)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(answer["host"] == "h1" || answer["host"] == "h2", "{answer}");
}

/// A template build runs where its `FROM` is: a Dockerfile naming the
/// account's own template (multipart, as the SDK sends it, or urlencoded)
/// goes to that template's snapshot's host whatever placement prefers; a
/// first-party base may go anywhere; a body over the front's buffer (a root
/// filesystem upload) is streamed whole to an agent.
#[tokio::test]
async fn builds_go_where_their_from_template_is() {
    let dir = tempfile::tempdir().unwrap();
    let (store, url) = common::two_hosts(dir.path()).await;
    let token = store.create_token("alice", Tier::Team).await.unwrap();
    let alice = store.authenticate(&token).await.unwrap().unwrap();
    templates_on_h1_and_a_gone_host(&store, &alice).await;
    let address = common::serve_front(&store, &url).await;
    let http = reqwest::Client::new();
    let build_url = format!("http://{address}/v1/templates/build");
    let multipart = |dockerfile: &str| {
        reqwest::multipart::Form::new()
            .text("name", "analysis")
            .text("dockerfile", dockerfile.to_owned())
            .part(
                "context",
                reqwest::multipart::Part::bytes(vec![7u8; 3 << 20]).file_name("data.bin"),
            )
    };
    let answer = |response: reqwest::Response| async move {
        let status = response.status().as_u16();
        (
            status,
            response.json::<Value>().await.unwrap_or(Value::Null),
        )
    };

    // Twice each, so that taking turns cannot land on h1 by chance.
    for _ in 0..2 {
        let (status, body) = answer(
            http.post(&build_url)
                .bearer_auth(&token)
                .multipart(multipart("ARG BASE=tools\nFROM ${BASE}\nRUN make\n"))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!((status, body["host"].as_str()), (200, Some("h1")), "{body}");
        assert!(body["body_bytes"].as_u64().unwrap() > 3 << 20, "{body}");
        let (_, body) = answer(
            http.post(&build_url)
                .bearer_auth(&token)
                .form(&[("name", "analysis"), ("dockerfile", "FROM tools\n")])
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(body["host"], "h1", "{body}");
    }
    let mut hosts = std::collections::HashSet::new();
    for _ in 0..4 {
        let (status, body) = answer(
            http.post(&build_url)
                .bearer_auth(&token)
                .multipart(multipart("FROM base\nRUN make\n"))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        hosts.insert(body["host"].as_str().unwrap().to_owned());
    }
    assert_eq!(
        hosts.len(),
        2,
        "a first-party base goes to either host: {hosts:?}"
    );

    // The FROM template's host is gone: 503 to retry, not a build elsewhere.
    let (status, body) = answer(
        http.post(&build_url)
            .bearer_auth(&token)
            .multipart(multipart("FROM stranded\n"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 503, "{body}");

    // A root filesystem upload past the front's 64 MiB buffer arrives whole.
    let upload = reqwest::multipart::Form::new().text("name", "tiny").part(
        "rootfs",
        reqwest::multipart::Part::bytes(vec![0u8; 80 << 20]).file_name("rootfs.tar"),
    );
    let (status, body) = answer(
        http.post(&build_url)
            .bearer_auth(&token)
            .multipart(upload)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body["body_bytes"].as_u64().unwrap() > 80 << 20, "{body}");

    // Another account's token names no template of Alice's.
    let bob = store.create_token("bob", Tier::Team).await.unwrap();
    let (status, _) = answer(
        http.post(&build_url)
            .bearer_auth(&bob)
            .multipart(multipart("FROM stranded\n"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
}
