//! Apps on a real `shoal up` over HTTP, with real VMs: a deploy reaches
//! `running` and answers through the app proxy; idle, it hibernates (its
//! QEMU process exits) and the next request wakes it and is answered; with
//! the host full (`--max-sandboxes 1`), a wake and a deploy park in
//! `waiting_capacity` with growing attempts and reach `running` once room is
//! made; a command that exits is `failed` with its output in `last_error`;
//! bad input is a 400 that makes nothing; a delete stops the app's sandbox.
//! Also the plain sandbox proxy route against a real `http.server`.
//!
//! Runs on SQLite and, when `SHOAL_TEST_DATABASE_URL` names a PostgreSQL
//! server (`scripts/with-postgres`), on a fresh database there too (that
//! variant says it was skipped otherwise). `shoal up` runs in its own
//! process group and is stopped by its id; its log is `up.log` in the
//! state directory.

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use shoal_testkit::{ApiClient, Database};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Small, so that the test sees hibernation soon; long enough for the
/// requests made while the app is meant to be awake.
const IDLE_SECONDS: u64 = 6;
/// The start command of the test's web app: a file from its environment
/// in a directory of its own, served by python's http.server.
const WEB: &str = "mkdir -p /srv/web && cd /srv/web && echo \"$GREETING\" > greeting.txt \
                   && exec python3 -m http.server 8000";

/// The API client, with this test's app helpers.
struct Client(ApiClient);

impl std::ops::Deref for Client {
    type Target = ApiClient;
    fn deref(&self) -> &ApiClient {
        &self.0
    }
}

impl Client {
    async fn app(&self, id: &str) -> Value {
        self.ok(Method::GET, &format!("/v1/apps/{id}"), None).await
    }

    async fn deploy(&self, body: Value) -> String {
        let answer = self.call(Method::POST, "/v1/apps", Some(body)).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text);
        assert_eq!(answer.json["status"], "deploying", "{}", answer.text);
        answer.json["id"].as_str().unwrap().to_owned()
    }

    /// Polls the app until `done` holds of it; fails after `limit`.
    async fn wait_app(
        &self,
        id: &str,
        limit: Duration,
        what: &str,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let app = self.app(id).await;
            if done(&app) {
                return app;
            }
            assert!(Instant::now() < deadline, "{what}: the app is still {app}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn wait_status(&self, id: &str, status: &str, limit: Duration) -> Value {
        self.wait_app(id, limit, &format!("waiting for {status}"), |app| {
            assert_ne!(app["status"], "failed", "the app failed: {app}");
            app["status"] == status
        })
        .await
    }

    async fn sandbox_status(&self, id: &str) -> String {
        let answer = self
            .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await;
        match answer.status {
            StatusCode::NOT_FOUND => "gone".into(),
            _ => answer.json["status"].as_str().unwrap().to_owned(),
        }
    }
}

/// QEMU processes of sandbox `id` under `state`.
fn qemu_of(state: &Path, id: &str) -> Vec<u32> {
    shoal_testkit::processes_mentioning(&state.join("vms").join(id).display().to_string())
}

fn web_app(name: &str) -> Value {
    json!({
        "name": name,
        "template": "code-interpreter",
        "start_cmd": WEB,
        "port": 8000,
        "env": {"GREETING": format!("hello from {name}")},
        "idle_seconds": IDLE_SECONDS,
    })
}

async fn bad_input_makes_nothing(client: &Client) {
    let cases = [
        (
            json!({"name": "a", "start_cmd": "true"}),
            "port is required",
        ),
        (
            json!({"name": "a", "start_cmd": "true", "port": 0}),
            "port must be",
        ),
        (
            json!({"name": "a", "start_cmd": "true", "port": 70000}),
            "port must be",
        ),
        (
            json!({"name": "a", "start_cmd": "true", "port": "80"}),
            "port must be",
        ),
        (
            json!({"name": "a", "start_cmd": "true", "port": 80, "template": "nope"}),
            "unknown template",
        ),
        (
            json!({"name": "a", "git_url": "https://github.com/me/site", "port": 80}),
            "git_url is not supported",
        ),
        (json!({"name": "a", "port": 80}), "start_cmd is required"),
        (
            json!({"name": "a", "start_cmd": " ", "port": 80}),
            "start_cmd is required",
        ),
        (
            json!({"name": "Not A Name", "start_cmd": "true", "port": 80}),
            "name must be",
        ),
        (json!({"start_cmd": "true", "port": 80}), "name is required"),
        (
            json!({"name": "a", "start_cmd": "true", "port": 80, "env": {"A": 1}}),
            "env.A must be a string",
        ),
        (
            json!({"name": "a", "start_cmd": "true", "port": 80, "idle_seconds": -1}),
            "idle_seconds must be",
        ),
    ];
    for (body, message) in cases {
        let answer = client
            .call(Method::POST, "/v1/apps", Some(body.clone()))
            .await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{body}: {}",
            answer.text
        );
        let error = answer.json["error"].as_str().unwrap_or_default();
        assert!(error.contains(message), "{body}: {error}");
    }
    let answer = client.call(Method::POST, "/v1/apps", None).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", answer.text);
    let apps = client.ok(Method::GET, "/v1/apps", None).await;
    assert_eq!(apps, json!({"items": []}), "a refused create made an app");
    let sandboxes = client.ok(Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(sandboxes, json!([]), "a refused create made a sandbox");
}

/// The plain proxy route, through HTTP, to a real http.server in a VM.
async fn sandbox_proxy_reaches_a_guest_server(client: &Client) {
    let sandbox = client
        .ok(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "code-interpreter"})),
        )
        .await;
    let id = sandbox["id"].as_str().unwrap();
    let start = "mkdir -p /srv/plain && cd /srv/plain && echo plain-file > plain.txt && \
                 (setsid python3 -m http.server 8000 >/dev/null 2>&1 </dev/null &)";
    let out = client
        .ok(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": start})),
        )
        .await;
    assert_eq!(out["exit_code"], 0, "{out}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let listing = loop {
        let answer = client
            .call(
                Method::GET,
                &format!("/v1/sandboxes/{id}/proxy/8000/"),
                None,
            )
            .await;
        if answer.status == StatusCode::OK {
            break answer.text;
        }
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY, "{}", answer.text);
        assert!(Instant::now() < deadline, "http.server never answered");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(listing.contains("plain.txt"), "{listing}");
    let file = client
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/proxy/8000/plain.txt?x=1"),
            None,
        )
        .await;
    assert_eq!(
        (file.status, file.text.as_str()),
        (StatusCode::OK, "plain-file\n")
    );
    let missing = client
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/proxy/8000/nothing"),
            None,
        )
        .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND, "the guest's own 404");
    let closed = client
        .call(Method::GET, &format!("/v1/sandboxes/{id}/proxy/9/"), None)
        .await;
    assert_eq!(closed.status, StatusCode::BAD_GATEWAY, "{}", closed.text);
    let answer = client
        .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(answer.status, StatusCode::NO_CONTENT);
}

async fn apps_deploy_hibernate_wake_and_wait_for_capacity(database_url: &str, state: PathBuf) {
    let _ = std::fs::remove_dir_all(&state);
    std::fs::create_dir_all(&state).unwrap();
    let up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
        .database_url(database_url)
        .args(["--max-sandboxes", "1"])
        .env("RUST_LOG", "info")
        .start()
        .await;
    let client = Client(ApiClient::new(up.base(), up.token("apps")));

    bad_input_makes_nothing(&client).await;
    sandbox_proxy_reaches_a_guest_server(&client).await;

    // A deploy reaches running and answers through the app proxy.
    let web = client.deploy(web_app("web")).await;
    let app = client
        .wait_status(&web, "running", Duration::from_secs(120))
        .await;
    assert_eq!(app["start_cmd"], WEB);
    assert_eq!(app["start_command"], WEB);
    assert_eq!(app["attempts"], 0);
    assert!(
        app["url"]
            .as_str()
            .unwrap()
            .ends_with(&format!("/v1/apps/{web}/proxy/")),
        "{app}"
    );
    let sandbox = app["sandbox_id"].as_str().unwrap().to_owned();
    assert_eq!(client.sandbox_status(&sandbox).await, "running");
    let listing = client
        .call(Method::GET, &format!("/v1/apps/{web}/proxy/"), None)
        .await;
    assert_eq!(listing.status, StatusCode::OK, "{}", listing.text);
    assert!(listing.text.contains("greeting.txt"), "{}", listing.text);
    let bare = client
        .call(Method::GET, &format!("/v1/apps/{web}/proxy"), None)
        .await;
    assert_eq!(bare.status, StatusCode::OK, "{}", bare.text);
    let greeting = client
        .call(
            Method::GET,
            &format!("/v1/apps/{web}/proxy/greeting.txt"),
            None,
        )
        .await;
    assert_eq!(
        greeting.text, "hello from web\n",
        "the app's env reached it"
    );
    let taken = client
        .call(Method::POST, "/v1/apps", Some(web_app("web")))
        .await;
    assert_eq!(taken.status, StatusCode::CONFLICT, "{}", taken.text);

    // Idle: hibernated, and its QEMU process is gone.
    let app = client
        .wait_status(&web, "hibernated", Duration::from_secs(90))
        .await;
    assert!(app["last_request_at"].is_string(), "{app}");
    assert_eq!(app["sandbox_id"], sandbox.as_str());
    assert_eq!(client.sandbox_status(&sandbox).await, "hibernated");
    assert!(
        qemu_of(&state, &sandbox).is_empty(),
        "a hibernated app's QEMU still runs"
    );

    // The next request wakes it and is answered (the network survives).
    let woken = client
        .call(
            Method::GET,
            &format!("/v1/apps/{web}/proxy/greeting.txt"),
            None,
        )
        .await;
    assert_eq!(
        (woken.status, woken.text.as_str()),
        (StatusCode::OK, "hello from web\n")
    );
    assert_eq!(client.app(&web).await["status"], "running");
    assert_eq!(client.sandbox_status(&sandbox).await, "running");
    assert!(!qemu_of(&state, &sandbox).is_empty());

    // Hibernated again, with the host's one slot taken: a request is a 503
    // with Retry-After and the app waits for capacity, retried with growing
    // waits, and wakes once the slot is free.
    client
        .wait_status(&web, "hibernated", Duration::from_secs(90))
        .await;
    let hog = client
        .ok(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "code-interpreter"})),
        )
        .await;
    let hog = hog["id"].as_str().unwrap().to_owned();
    let refused = client
        .call(
            Method::GET,
            &format!("/v1/apps/{web}/proxy/greeting.txt"),
            None,
        )
        .await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        refused.text
    );
    assert!(
        refused
            .retry_after
            .as_deref()
            .and_then(|s| s.parse::<u64>().ok())
            .is_some_and(|s| s >= 1),
        "no Retry-After"
    );
    let app = client.app(&web).await;
    assert_eq!(app["status"], "waiting_capacity", "{app}");
    assert_eq!(app["attempts"], 1, "{app}");
    assert!(app["next_attempt_at"].is_string(), "{app}");
    assert!(
        app["last_error"].as_str().unwrap().contains("capacity"),
        "{app}"
    );
    let first_next = app["next_attempt_at"].clone();
    let app = client
        .wait_app(&web, Duration::from_secs(30), "a second attempt", |app| {
            app["attempts"].as_u64().unwrap() >= 2
        })
        .await;
    assert_eq!(app["status"], "waiting_capacity", "{app}");
    assert_ne!(app["next_attempt_at"], first_next, "{app}");
    let answer = client
        .call(Method::DELETE, &format!("/v1/sandboxes/{hog}"), None)
        .await;
    assert_eq!(answer.status, StatusCode::NO_CONTENT);
    let app = client
        .wait_status(&web, "running", Duration::from_secs(60))
        .await;
    assert_eq!(app["attempts"], 0, "{app}");
    assert!(app["next_attempt_at"].is_null(), "{app}");
    let answer = client
        .call(
            Method::GET,
            &format!("/v1/apps/{web}/proxy/greeting.txt"),
            None,
        )
        .await;
    assert_eq!(
        (answer.status, answer.text.as_str()),
        (StatusCode::OK, "hello from web\n")
    );

    // A deploy while the host is full parks too, and runs once room is
    // made (here by deleting the first app, which stops its sandbox).
    let second = client.deploy(web_app("second")).await;
    let app = client
        .wait_app(
            &second,
            Duration::from_secs(30),
            "a second refused deploy",
            |app| app["attempts"].as_u64().unwrap() >= 2,
        )
        .await;
    assert_eq!(app["status"], "waiting_capacity", "{app}");
    assert!(app["next_attempt_at"].is_string(), "{app}");
    assert!(app["sandbox_id"].is_null(), "{app}");
    let answer = client
        .call(Method::DELETE, &format!("/v1/apps/{web}"), None)
        .await;
    assert_eq!(answer.status, StatusCode::NO_CONTENT, "{}", answer.text);
    let answer = client
        .call(Method::GET, &format!("/v1/apps/{web}"), None)
        .await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    assert_eq!(client.sandbox_status(&sandbox).await, "gone");
    assert!(
        qemu_of(&state, &sandbox).is_empty(),
        "a deleted app's QEMU still runs"
    );
    let app = client
        .wait_status(&second, "running", Duration::from_secs(90))
        .await;
    let answer = client
        .call(
            Method::GET,
            &format!("/v1/apps/{second}/proxy/greeting.txt"),
            None,
        )
        .await;
    assert_eq!(
        (answer.status, answer.text.as_str()),
        (StatusCode::OK, "hello from second\n")
    );
    let second_sandbox = app["sandbox_id"].as_str().unwrap().to_owned();
    let answer = client
        .call(Method::DELETE, &format!("/v1/apps/{second}"), None)
        .await;
    assert_eq!(answer.status, StatusCode::NO_CONTENT);
    assert_eq!(client.sandbox_status(&second_sandbox).await, "gone");

    // A command that exits is failed, with its output; its sandbox goes.
    let broken = client
        .deploy(json!({
            "name": "web",
            "start_command": "echo broken-start; exit 3",
            "port": 8000,
        }))
        .await;
    let app = client
        .wait_app(&broken, Duration::from_secs(120), "failing", |app| {
            app["status"] == "failed"
        })
        .await;
    let error = app["last_error"].as_str().unwrap();
    assert!(
        error.contains("exited") && error.contains("broken-start"),
        "{app}"
    );
    assert_eq!(
        client
            .sandbox_status(app["sandbox_id"].as_str().unwrap())
            .await,
        "gone"
    );
    let answer = client
        .call(Method::GET, &format!("/v1/apps/{broken}/proxy/"), None)
        .await;
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY, "{}", answer.text);
    let answer = client
        .call(Method::DELETE, &format!("/v1/apps/{broken}"), None)
        .await;
    assert_eq!(answer.status, StatusCode::NO_CONTENT);
    assert_eq!(
        client.ok(Method::GET, "/v1/apps", None).await,
        json!({"items": []})
    );

    let vms = shoal_testkit::processes_mentioning(&state.join("vms").display().to_string());
    assert!(
        vms.is_empty(),
        "VMs left after every app was deleted: {vms:?}"
    );
    drop(up);
    let _ = std::fs::remove_dir_all(&state);
}

#[test]
fn apps_on_sqlite() {
    shoal_testkit::with_database(
        Database::Sqlite,
        "vm_apps_sqlite",
        |url, state| async move { apps_deploy_hibernate_wake_and_wait_for_capacity(&url, state).await },
    );
}

#[test]
fn apps_on_postgres() {
    shoal_testkit::with_database(Database::Postgres, "vm_apps_pg", |url, state| async move {
        apps_deploy_hibernate_wake_and_wait_for_capacity(&url, state).await
    });
}
