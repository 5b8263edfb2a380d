//! PandaStack's server API as its own test script walks it
//! (`scripts/api-tests.sh` in pandastack-io/pandastack-ai: healthz →
//! templates → create → exec → SSE → files → logs → metrics → list →
//! pause/resume → snapshot → events → fork → hibernate/wake), written here
//! as a curl user would send it: raw HTTP, the token in `X-API-Key`, lists
//! read as JSON arrays, a fork of `count` children. On a real `shoal up`
//! with real VMs, on SQLite and on PostgreSQL. Beyond the script: list
//! filters, `start`/`stop`, ports expose/unexpose, tokens made, used and
//! revoked (refused at once), `/version`, `?access_token=`, another
//! account's 404, events by `since`.
//!
//! And the two WebSocket routes (once, on SQLite: they do not touch the
//! database): the terminal (`exec/pty`) resizes and `stty size` sees it,
//! `exit 3` ends with `{"exit": 3}`, another account is refused 404 before
//! the upgrade, and a client that stops reading a flood does not grow the
//! server's memory; the multiplexed exec (`exec/ws`) runs 100 commands in
//! flight on one socket, each answered with its own output and exit code,
//! cancels one, and answers bad JSON with an error while the socket lives
//! on.
//!
//! `shoal up` runs in its own process group and is stopped by its id.

use futures::{SinkExt as _, StreamExt as _};
use reqwest::Method;
use serde_json::{json, Value};
use shoal_testkit::Database;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::{self, Message};

/// A curl-style client: every request carries `X-API-Key`, as the script's.
struct Curl {
    http: reqwest::Client,
    base: String,
    key: String,
}

impl Curl {
    fn new(base: &str, key: &str) -> Curl {
        Curl {
            http: reqwest::Client::new(),
            base: base.to_owned(),
            key: key.to_owned(),
        }
    }

    async fn send(&self, method: Method, path: &str, body: Option<Value>) -> (u16, String) {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .header("X-API-Key", &self.key)
            .timeout(Duration::from_secs(120));
        if let Some(body) = body {
            request = request.body(body.to_string());
        }
        let answer = request.send().await.expect("calling the API");
        let status = answer.status().as_u16();
        (status, answer.text().await.unwrap_or_default())
    }

    /// A request that must succeed (curl `--fail-with-body`); its body as
    /// JSON (Null when it is not).
    async fn ok(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        let (status, text) = self.send(method.clone(), path, body).await;
        assert!(
            (200..300).contains(&status),
            "{method} {path}: {status} {text}"
        );
        serde_json::from_str(&text).unwrap_or(Value::Null)
    }

    async fn get(&self, path: &str) -> Value {
        self.ok(Method::GET, path, None).await
    }

    async fn post(&self, path: &str, body: Option<Value>) -> Value {
        self.ok(Method::POST, path, body).await
    }

    async fn status(&self, id: &str) -> String {
        self.get(&format!("/v1/sandboxes/{id}")).await["status"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    async fn event_types(&self, id: &str, query: &str) -> Vec<String> {
        let events = self
            .get(&format!("/v1/sandboxes/{id}/events?{query}"))
            .await;
        events["events"]
            .as_array()
            .unwrap_or_else(|| panic!("events answer {events}"))
            .iter()
            .map(|e| e["type"].as_str().unwrap_or_default().to_owned())
            .collect()
    }
}

fn ids(list: &Value) -> Vec<String> {
    list.as_array()
        .unwrap_or_else(|| panic!("not a JSON array: {list}"))
        .iter()
        .map(|s| s["id"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// A fresh `shoal up` on `database_url` with `state` emptied.
async fn start_up(database_url: &str, state: &std::path::Path) -> shoal_testkit::ShoalUp {
    let _ = std::fs::remove_dir_all(state);
    std::fs::create_dir_all(state).unwrap();
    shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), state)
        .database_url(database_url)
        .ready_within(Duration::from_secs(900))
        .start()
        .await
}

async fn pandastack_walk(database_url: &str, state: PathBuf) {
    let up = start_up(database_url, &state).await;
    let c = Curl::new(up.base(), &up.token("walker"));

    // healthz, version (no token)
    let open = Curl::new(up.base(), "");
    assert_eq!(open.get("/healthz").await["status"], "ok");
    let version = open.get("/version").await;
    assert_eq!(version["service"], "shoal", "{version}");
    assert!(
        version["semver"].as_str().unwrap().starts_with('v'),
        "{version}"
    );

    // templates: an array; the first one by name
    let templates = c.get("/v1/templates").await;
    let first = templates
        .as_array()
        .unwrap_or_else(|| panic!("templates: {templates}"))
        .first()
        .expect("at least one template")
        .clone();
    let template = first["name"].as_str().unwrap().to_owned();
    assert_eq!(
        c.get(&format!("/v1/templates/{template}")).await["name"],
        template
    );

    // create, as the script asks
    let created = c
        .post(
            "/v1/sandboxes",
            Some(json!({"template": template, "cpu": 1, "memory_mb": 256,
                        "metadata": {"suite": "walk"}})),
        )
        .await;
    let id = created["id"].as_str().unwrap().to_owned();
    assert!(created["guest_ip"].is_string(), "{created}");

    // exec: ready at once (a restore, not a boot), uname, a failure
    let ready = c
        .post(
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": "echo ready"})),
        )
        .await;
    assert_eq!(
        ready["stdout"].as_str().unwrap().trim_end(),
        "ready",
        "{ready}"
    );
    let uname = c
        .post(
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": "uname -a"})),
        )
        .await;
    assert!(
        uname["stdout"].as_str().unwrap().contains("Linux"),
        "{uname}"
    );
    let failed = c
        .post(
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": "false"})),
        )
        .await;
    assert_eq!(failed["exit_code"], 1, "{failed}");

    // exec stream (SSE)
    let (status, sse) = c
        .send(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec/stream"),
            Some(json!({"cmd": "for i in 1 2 3; do echo line$i; sleep 0.1; done"})),
        )
        .await;
    assert_eq!(status, 200, "{sse}");
    assert!(sse.contains("event: stdout"), "{sse}");
    assert!(sse.contains("line3"), "{sse}");
    assert!(sse.contains("\"exit_code\":0"), "{sse}");

    // files
    let written = c
        .http
        .put(format!(
            "{}/v1/sandboxes/{id}/fs?path=/tmp/hello.txt",
            c.base
        ))
        .header("X-API-Key", &c.key)
        .header("content-type", "application/octet-stream")
        .body("hello pandastack")
        .send()
        .await
        .unwrap();
    assert!(
        written.status().is_success(),
        "{}",
        written.text().await.unwrap()
    );
    let read = c
        .http
        .get(format!(
            "{}/v1/sandboxes/{id}/fs?path=/tmp/hello.txt",
            c.base
        ))
        .header("X-API-Key", &c.key)
        .send()
        .await
        .unwrap();
    assert_eq!(read.text().await.unwrap(), "hello pandastack");
    let dir = c.get(&format!("/v1/sandboxes/{id}/fs/dir?path=/tmp")).await;
    assert!(
        dir["entries"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "hello.txt"),
        "{dir}"
    );
    let stat = c
        .get(&format!("/v1/sandboxes/{id}/fs/stat?path=/tmp/hello.txt"))
        .await;
    assert_eq!(stat["size"], "hello pandastack".len(), "{stat}");
    c.ok(
        Method::DELETE,
        &format!("/v1/sandboxes/{id}/fs?path=/tmp/hello.txt"),
        None,
    )
    .await;
    let (status, _) = c
        .send(
            Method::GET,
            &format!("/v1/sandboxes/{id}/fs/stat?path=/tmp/hello.txt"),
            None,
        )
        .await;
    assert_eq!(status, 404);

    // logs, metrics
    let (status, _) = c
        .send(Method::GET, &format!("/v1/sandboxes/{id}/logs"), None)
        .await;
    assert_eq!(status, 200);
    let metrics = c.get(&format!("/v1/sandboxes/{id}/metrics")).await;
    assert!(metrics["pid"].as_u64().unwrap() > 0, "{metrics}");
    assert!(metrics["host_rss_bytes"].as_u64().unwrap() > 0, "{metrics}");
    assert!(
        metrics["host_vsz_bytes"].as_u64().unwrap() >= metrics["host_rss_bytes"].as_u64().unwrap(),
        "{metrics}"
    );
    assert!(metrics["threads"].as_u64().unwrap() >= 1, "{metrics}");
    assert!(
        metrics["host_cpu_percent"].as_f64().unwrap() >= 0.0,
        "{metrics}"
    );
    assert!(metrics["uptime_seconds"].is_u64(), "{metrics}");

    // list: an array, filtered by metadata and state
    assert!(ids(&c.get("/v1/sandboxes").await).contains(&id));
    assert_eq!(
        ids(&c.get("/v1/sandboxes?metadata=suite=walk").await),
        vec![id.clone()]
    );
    assert!(ids(&c.get("/v1/sandboxes?metadata=suite=other").await).is_empty());
    assert_eq!(
        ids(&c.get("/v1/sandboxes?state=running").await),
        vec![id.clone()]
    );
    assert!(ids(&c.get("/v1/sandboxes?state=paused,hibernated").await).is_empty());

    // pause / resume / snapshot
    c.post(&format!("/v1/sandboxes/{id}/pause"), None).await;
    assert_eq!(
        ids(&c.get("/v1/sandboxes?state=paused").await),
        vec![id.clone()]
    );
    c.post(&format!("/v1/sandboxes/{id}/resume"), None).await;
    let snapshot = c.post(&format!("/v1/sandboxes/{id}/snapshots"), None).await;
    assert!(snapshot["id"].is_string(), "{snapshot}");

    // events
    let events = c.get(&format!("/v1/sandboxes/{id}/events?tail=100")).await;
    let list = events["events"].as_array().unwrap();
    let types: Vec<&str> = list.iter().map(|e| e["type"].as_str().unwrap()).collect();
    for kind in [
        "sandbox.created",
        "sandbox.running",
        "sandbox.paused",
        "sandbox.resumed",
        "sandbox.snapshot",
    ] {
        assert!(types.contains(&kind), "{kind} missing from {types:?}");
    }
    let failed_exec = list
        .iter()
        .find(|e| e["type"] == "sandbox.exec" && e["payload"]["cmd"] == "false")
        .unwrap_or_else(|| panic!("the failed exec is not in {events}"));
    assert_eq!(failed_exec["payload"]["exit_code"], 1, "{failed_exec}");
    assert_eq!(c.event_types(&id, "tail=2").await.len(), 2);

    // fork {count: 2}: two children, both running
    let fork = c
        .post(
            &format!("/v1/sandboxes/{id}/fork"),
            Some(json!({"count": 2})),
        )
        .await;
    let children: Vec<String> = fork["children"]
        .as_array()
        .unwrap_or_else(|| panic!("fork answer {fork}"))
        .iter()
        .map(|c| c.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(children.len(), 2, "{fork}");
    assert_ne!(children[0], children[1]);
    for child in &children {
        assert_eq!(c.status(child).await, "running");
        let out = c
            .post(
                &format!("/v1/sandboxes/{child}/exec"),
                Some(json!({"cmd": "echo child"})),
            )
            .await;
        assert_eq!(out["stdout"], "child\n");
        assert!(c
            .event_types(child, "tail=10")
            .await
            .contains(&"sandbox.forked".to_owned()));
    }
    assert!(c
        .event_types(&id, "tail=10")
        .await
        .contains(&"sandbox.fork".to_owned()));

    // hibernate / wake, and PandaStack's stop / start
    c.post(&format!("/v1/sandboxes/{id}/hibernate"), None).await;
    assert_eq!(c.status(&id).await, "hibernated");
    let hibernated_at = c.get(&format!("/v1/sandboxes/{id}/events?tail=1")).await["events"][0]
        ["time"]
        .as_str()
        .unwrap()
        .to_owned();
    c.post(&format!("/v1/sandboxes/{id}/wake"), None).await;
    assert_eq!(c.status(&id).await, "running");
    let recent = c.event_types(&id, "tail=10").await;
    assert!(
        recent.contains(&"sandbox.hibernated".to_owned()),
        "{recent:?}"
    );
    assert!(recent.contains(&"sandbox.woken".to_owned()), "{recent:?}");
    let since = c
        .event_types(&id, &format!("since={}", hibernated_at.replace('+', "%2B")))
        .await;
    assert!(!since.contains(&"sandbox.paused".to_owned()), "{since:?}");
    assert!(since.contains(&"sandbox.woken".to_owned()), "{since:?}");
    let (status, _) = c
        .send(
            Method::GET,
            &format!("/v1/sandboxes/{id}/events?since=yesterday"),
            None,
        )
        .await;
    assert_eq!(status, 400);
    c.post(&format!("/v1/sandboxes/{id}/stop"), None).await;
    assert_eq!(c.status(&id).await, "hibernated");
    c.post(&format!("/v1/sandboxes/{id}/start"), None).await;
    assert_eq!(c.status(&id).await, "running");
    let out = c
        .post(
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": "echo back"})),
        )
        .await;
    assert_eq!(out["stdout"], "back\n");

    // ports: expose with a label, list, unexpose
    let exposed = c
        .post(
            &format!("/v1/sandboxes/{id}/ports"),
            Some(json!({"port": 8000, "label": "web"})),
        )
        .await;
    assert_eq!(exposed["port"], 8000, "{exposed}");
    let ports = c.get(&format!("/v1/sandboxes/{id}/ports")).await;
    let web = ports
        .as_array()
        .unwrap_or_else(|| panic!("ports: {ports}"))
        .iter()
        .find(|p| p["port"] == 8000)
        .unwrap_or_else(|| panic!("8000 not in {ports}"))
        .clone();
    assert_eq!(web["label"], "web", "{web}");
    let (status, _) = c
        .send(
            Method::POST,
            &format!("/v1/sandboxes/{id}/ports"),
            Some(json!({"port": 70000})),
        )
        .await;
    assert_eq!(status, 400);
    let (status, _) = c
        .send(
            Method::DELETE,
            &format!("/v1/sandboxes/{id}/ports/8000"),
            None,
        )
        .await;
    assert_eq!(status, 204);
    let ports = c.get(&format!("/v1/sandboxes/{id}/ports")).await;
    assert!(
        !ports.as_array().unwrap().iter().any(|p| p["port"] == 8000),
        "{ports}"
    );

    // tokens: made (shown once), used at once, listed, revoked (refused at once)
    let made = c
        .post("/v1/me/tokens", Some(json!({"label": "walk"})))
        .await;
    let token = made["token"].as_str().unwrap().to_owned();
    let prefix = made["prefix"].as_str().unwrap().to_owned();
    let other_key = Curl::new(up.base(), &token);
    assert_eq!(other_key.status(&id).await, "running");
    let listed = c.get("/v1/me/tokens").await;
    let items = listed["items"].as_array().unwrap();
    assert!(
        items
            .iter()
            .any(|t| t["prefix"] == prefix.as_str() && t["label"] == "walk"),
        "{listed}"
    );
    assert!(
        !listed.to_string().contains(&token),
        "a list shows a secret: {listed}"
    );
    let (status, _) = c
        .send(Method::DELETE, &format!("/v1/me/tokens/{prefix}"), None)
        .await;
    assert_eq!(status, 204);
    let (status, _) = other_key
        .send(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(status, 401);

    // ?access_token= (WebSocket and EventSource clients), another account
    let query = reqwest::get(format!(
        "{}/v1/sandboxes/{id}?access_token={}",
        c.base, c.key
    ))
    .await
    .unwrap();
    assert_eq!(query.status(), 200);
    let stranger = Curl::new(up.base(), &up.token("stranger"));
    for path in [
        format!("/v1/sandboxes/{id}"),
        format!("/v1/sandboxes/{id}/events"),
        format!("/v1/sandboxes/{id}/metrics"),
    ] {
        let (status, _) = stranger.send(Method::GET, &path, None).await;
        assert_eq!(status, 404, "{path}");
    }
    assert!(ids(&stranger.get("/v1/sandboxes").await).is_empty());

    // cleanup, with the parent's events followed: the stream shows the
    // deletion and then ends.
    let follow = tokio::spawn(
        c.http
            .get(format!(
                "{}/v1/sandboxes/{id}/events?follow=1&tail=1",
                c.base
            ))
            .header("X-API-Key", &c.key)
            .timeout(Duration::from_secs(60))
            .send(),
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    for sandbox in children.iter().chain([&id]) {
        let (status, text) = c
            .send(Method::DELETE, &format!("/v1/sandboxes/{sandbox}"), None)
            .await;
        assert!(status == 200 || status == 204, "{status} {text}");
    }
    assert!(ids(&c.get("/v1/sandboxes").await).is_empty());
    let followed = follow.await.unwrap().expect("following events");
    assert_eq!(followed.status(), 200);
    let stream = followed
        .text()
        .await
        .expect("the follow ends after the deletion");
    assert!(stream.contains("event: event"), "{stream}");
    assert!(stream.contains("\"sandbox.deleted\""), "{stream}");
}

#[test]
fn pandastack_api_walk_sqlite() {
    shoal_testkit::with_database(
        Database::Sqlite,
        "vm_pandastack_sqlite",
        |url, state| async move { pandastack_walk(&url, state).await },
    );
}

#[test]
fn pandastack_api_walk_postgres() {
    shoal_testkit::with_database(
        Database::Postgres,
        "vm_pandastack_pg",
        |url, state| async move { pandastack_walk(&url, state).await },
    );
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn connect(base: &str, path: &str, token: &str) -> Result<Socket, tungstenite::Error> {
    let url = format!(
        "{}{path}{}access_token={token}",
        base.replacen("http://", "ws://", 1),
        if path.contains('?') { "&" } else { "?" }
    );
    tokio_tungstenite::connect_async(url)
        .await
        .map(|(socket, _)| socket)
}

/// The next frame within `limit`, pings skipped.
async fn next_frame(socket: &mut Socket, limit: Duration) -> Message {
    loop {
        let frame = tokio::time::timeout(limit, socket.next())
            .await
            .expect("the server went quiet")
            .expect("the socket closed")
            .expect("a socket error");
        if !matches!(frame, Message::Ping(_) | Message::Pong(_)) {
            return frame;
        }
    }
}

/// Terminal bytes until `needle` is among them; the last text frame seen.
async fn read_terminal_until(socket: &mut Socket, needle: &str) -> String {
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        match next_frame(socket, Duration::from_secs(60)).await {
            Message::Binary(bytes) => seen.extend_from_slice(&bytes),
            Message::Text(text) => panic!("a control frame mid-session: {text}"),
            other => panic!("unexpected frame {other:?}"),
        }
        if String::from_utf8_lossy(&seen).contains(needle) {
            return String::from_utf8_lossy(&seen).into_owned();
        }
    }
    panic!(
        "{needle:?} never came; the terminal showed {:?}",
        String::from_utf8_lossy(&seen)
    );
}

/// A guest command that prints `none` when no process is called `name`
/// (from /proc: the base template need not have procps).
fn running_named(name: &str) -> String {
    format!("cat /proc/[0-9]*/comm 2>/dev/null | grep -x {name} || echo none")
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

async fn terminal_and_multiplexed_exec(database_url: &str, state: PathBuf) {
    let up = start_up(database_url, &state).await;
    let token = up.token("terminal");
    let c = Curl::new(up.base(), &token);
    let id = c
        .post(
            "/v1/sandboxes",
            Some(json!({"template": "base", "ttl_seconds": 600})),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();

    // Another account: 404 before any upgrade, on both routes.
    let stranger = up.token("stranger");
    for path in ["exec/pty", "exec/ws"] {
        match connect(up.base(), &format!("/v1/sandboxes/{id}/{path}"), &stranger).await {
            Err(tungstenite::Error::Http(answer)) => assert_eq!(answer.status(), 404, "{path}"),
            Err(e) => panic!("{path}: {e}"),
            Ok(_) => panic!("{path}: another account's token was upgraded"),
        }
    }
    match connect(up.base(), &format!("/v1/sandboxes/{id}/exec/pty"), "wrong").await {
        Err(tungstenite::Error::Http(answer)) => assert_eq!(answer.status(), 401),
        other => panic!("a bad token: {:?}", other.map(|_| ())),
    }

    // The terminal: resize, `stty size` sees it, `exit 3` ends with {"exit": 3}.
    let mut pty = connect(
        up.base(),
        &format!("/v1/sandboxes/{id}/exec/pty?rows=24&cols=80"),
        &token,
    )
    .await
    .unwrap();
    pty.send(Message::Text(
        json!({"resize": {"rows": 40, "cols": 132}})
            .to_string()
            .into(),
    ))
    .await
    .unwrap();
    pty.send(Message::Binary(
        b"stty size; echo shown-$((6*7))\n".to_vec().into(),
    ))
    .await
    .unwrap();
    let shown = read_terminal_until(&mut pty, "shown-42").await;
    assert!(
        shown.contains("40 132"),
        "stty size after a resize showed {shown:?}"
    );
    pty.send(Message::Binary(b"exit 3\n".to_vec().into()))
        .await
        .unwrap();
    let end = loop {
        match next_frame(&mut pty, Duration::from_secs(60)).await {
            Message::Text(text) => break serde_json::from_str::<Value>(&text).unwrap(),
            Message::Binary(_) => continue,
            other => panic!("unexpected frame {other:?}"),
        }
    };
    assert_eq!(end, json!({"exit": 3}));

    // A client that stops reading a flood: the server's memory stays flat.
    let mut flood = connect(
        up.base(),
        &format!(
            "/v1/sandboxes/{id}/exec/pty?cmd={}",
            "yes%20flooding-the-terminal"
        ),
        &token,
    )
    .await
    .unwrap();
    let _ = next_frame(&mut flood, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = rss_kib(up.pid());
    tokio::time::sleep(Duration::from_secs(20)).await;
    let after = rss_kib(up.pid());
    assert!(
        after < before + 32 * 1024,
        "the server grew from {before} KiB to {after} KiB while its client did not read"
    );
    drop(flood);
    // The flood's shell goes with its socket: the guest answers promptly.
    assert!(
        shoal_testkit::wait_until(Duration::from_secs(30), || async {
            let out = c
                .post(
                    &format!("/v1/sandboxes/{id}/exec"),
                    Some(json!({"cmd": running_named("yes")})),
                )
                .await;
            out["stdout"] == "none\n"
        })
        .await,
        "the flood outlived its socket"
    );

    // Multiplexed exec: 100 commands in flight, each its own output and exit.
    let mut ws = connect(up.base(), &format!("/v1/sandboxes/{id}/exec/ws"), &token)
        .await
        .unwrap();
    let commands = 100;
    for i in 0..commands {
        let cmd = format!(
            "sleep 0.{}; echo out-{i}; echo err-{i} >&2; exit {}",
            i % 5,
            i % 7
        );
        ws.send(Message::Text(
            json!({"id": format!("c{i}"), "cmd": cmd})
                .to_string()
                .into(),
        ))
        .await
        .unwrap();
    }
    let mut stdout: BTreeMap<String, String> = BTreeMap::new();
    let mut stderr: BTreeMap<String, String> = BTreeMap::new();
    let mut exits: BTreeMap<String, i64> = BTreeMap::new();
    while exits.len() < commands {
        let Message::Text(text) = next_frame(&mut ws, Duration::from_secs(120)).await else {
            continue;
        };
        let frame: Value = serde_json::from_str(&text).unwrap();
        let request = frame["id"]
            .as_str()
            .unwrap_or_else(|| panic!("{frame}"))
            .to_owned();
        assert!(frame.get("error").is_none(), "{frame}");
        if let Some(code) = frame["exit"].as_i64() {
            assert!(
                exits.insert(request.clone(), code).is_none(),
                "two exits for {request}"
            );
        } else {
            let data = frame["data"].as_str().unwrap();
            match frame["stream"].as_str() {
                Some("stdout") => stdout.entry(request).or_default().push_str(data),
                Some("stderr") => stderr.entry(request).or_default().push_str(data),
                _ => panic!("{frame}"),
            }
        }
    }
    for i in 0..commands {
        let request = format!("c{i}");
        assert_eq!(exits[&request], (i % 7) as i64, "{request}");
        assert_eq!(stdout[&request], format!("out-{i}\n"), "{request}");
        assert_eq!(stderr[&request], format!("err-{i}\n"), "{request}");
    }
    // Bad JSON is answered, and the socket goes on.
    ws.send(Message::Text("not json".into())).await.unwrap();
    let Message::Text(text) = next_frame(&mut ws, Duration::from_secs(30)).await else {
        panic!("no answer to bad JSON");
    };
    assert!(text.contains("bad json"), "{text}");
    // A cancelled command ends; the next one still runs.
    ws.send(Message::Text(
        json!({"id": "long", "cmd": "sleep 300"}).to_string().into(),
    ))
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    ws.send(Message::Text(
        json!({"id": "long", "cancel": true}).to_string().into(),
    ))
    .await
    .unwrap();
    ws.send(Message::Text(
        json!({"id": "after", "cmd": "echo after"})
            .to_string()
            .into(),
    ))
    .await
    .unwrap();
    let mut after_exit = None;
    while after_exit.is_none() {
        let Message::Text(text) = next_frame(&mut ws, Duration::from_secs(60)).await else {
            continue;
        };
        let frame: Value = serde_json::from_str(&text).unwrap();
        assert_ne!(frame["id"], "long", "a cancelled command answered: {frame}");
        if frame["id"] == "after" && frame.get("exit").is_some() {
            after_exit = frame["exit"].as_i64();
        }
    }
    assert_eq!(after_exit, Some(0));
    let out = c
        .post(
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": running_named("sleep")})),
        )
        .await;
    assert_eq!(out["stdout"], "none\n", "the cancelled command still runs");
    drop(ws);
    c.ok(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .await;
}

#[test]
fn terminal_and_multiplexed_exec_sqlite() {
    shoal_testkit::with_database(
        Database::Sqlite,
        "vm_pandastack_ws",
        |url, state| async move { terminal_and_multiplexed_exec(&url, state).await },
    );
}
