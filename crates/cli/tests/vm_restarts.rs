//! Sandboxes outlive the service, on a real `shoal up` with real VMs. A
//! crash (SIGKILL) leaves the VMs running and the next start adopts them:
//! the same QEMU process, a counter that never stopped, an app that
//! answers. A planned stop, SIGTERM (what `systemctl stop` and an upgrade send),
//! hibernates a persistent sandbox running a counter and an app's sandbox;
//! the next start wakes both before it answers, the counter's process goes
//! on from the value it had (its memory came back, not a new boot) and the
//! app answers through its proxy. The events say why each was hibernated
//! and woken. On SQLite and PostgreSQL.
//!
//! `shoal up` runs in its own process group and is stopped by its id.

use reqwest::Method;
use serde_json::{json, Value};
use shoal_testkit::{ApiClient, Database};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A counter in the guest: a shell loop whose only state is in memory,
/// written out every 100 ms (renamed into place, so a read never sees a
/// half-written file), in a session of its own so the exec that
/// starts it can end.
const COUNTER: &str = "setsid sh -c 'echo $$ > /tmp/counter.pid; i=0; \
                       while :; do i=$((i+1)); echo $i > /tmp/count.new; \
                       mv /tmp/count.new /tmp/count; sleep 0.1; done' \
                       </dev/null >/dev/null 2>&1 &";

/// QEMU processes of sandbox `id` under `state`.
fn qemu_of(state: &std::path::Path, id: &str) -> Vec<u32> {
    shoal_testkit::processes_mentioning(&state.join("vms").join(id).display().to_string())
}

async fn run(api: &ApiClient, id: &str, cmd: &str) -> String {
    let out = api
        .ok(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({ "cmd": cmd })),
        )
        .await;
    assert_eq!(out["exit_code"], 0, "{cmd}: {out}");
    out["stdout"].as_str().unwrap().trim().to_owned()
}

async fn count(api: &ApiClient, id: &str) -> u64 {
    run(api, id, "cat /tmp/count").await.parse().unwrap()
}

async fn wait_app_running(api: &ApiClient, app: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let answer = api.ok(Method::GET, &format!("/v1/apps/{app}"), None).await;
        assert_ne!(answer["status"], "failed", "{answer}");
        if answer["status"] == "running" {
            return answer;
        }
        assert!(Instant::now() < deadline, "the app is still {answer}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The app's sandbox runs and the app answers through its proxy.
async fn app_answers(api: &ApiClient, app: &str, app_sandbox: &str) {
    let sandbox = api
        .ok(Method::GET, &format!("/v1/sandboxes/{app_sandbox}"), None)
        .await;
    assert_eq!(sandbox["status"], "running", "{sandbox}");
    let hello = api
        .call(
            Method::GET,
            &format!("/v1/apps/{app}/proxy/hello.txt"),
            None,
        )
        .await;
    assert_eq!(hello.text, "kept\n", "{}", hello.status);
}

async fn restarts_keep_sandboxes(database_url: &str, state: PathBuf) {
    let _ = std::fs::remove_dir_all(&state);
    std::fs::create_dir_all(&state).unwrap();
    let mut up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
        .database_url(database_url)
        .ready_within(Duration::from_secs(900))
        .start()
        .await;
    let api = ApiClient::new(up.base(), up.token("keeper"));
    let created = api
        .ok(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "base", "persistent": true})),
        )
        .await;
    let id = created["id"].as_str().unwrap().to_owned();
    run(&api, &id, COUNTER).await;
    let pid = run(&api, &id, "sleep 0.5; cat /tmp/counter.pid").await;
    let app = api
        .ok(
            Method::POST,
            "/v1/apps",
            Some(json!({
                "name": "kept",
                "template": "code-interpreter",
                "start_cmd": "mkdir -p /srv && cd /srv && echo kept > hello.txt \
                              && exec python3 -m http.server 8000",
                "port": 8000,
                "idle_seconds": 3600,
            })),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let app_sandbox = wait_app_running(&api, &app).await["sandbox_id"]
        .as_str()
        .unwrap()
        .to_owned();

    let qemu_pid = qemu_of(&state, &id);
    assert_eq!(qemu_pid.len(), 1, "{qemu_pid:?}");

    // A crash: the service is killed, its VMs are not. The next start
    // adopts them (the same QEMU), and the counter never stopped.
    let before = count(&api, &id).await;
    up.signal(shoal_testkit::SIGKILL);
    assert_eq!(
        qemu_of(&state, &id),
        qemu_pid,
        "the sandbox's QEMU died with the service"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let starting = Instant::now();
    up.restart().await;
    println!(
        "start after SIGKILL: {:.1} s",
        starting.elapsed().as_secs_f64()
    );
    let api = ApiClient {
        base: up.base().to_owned(),
        ..api
    };
    assert_eq!(qemu_of(&state, &id), qemu_pid, "the VM was not adopted");
    let row = api
        .ok(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(row["status"], "running", "{row}");
    let after = count(&api, &id).await;
    assert!(
        after >= before + 5,
        "the counter went from {before} to only {after} across a second without the service"
    );
    assert_eq!(
        run(&api, &id, "cat /tmp/counter.pid").await,
        pid,
        "the counter's process did not survive"
    );
    app_answers(&api, &app, &app_sandbox).await;
    // What the adopted VM does next works as before: a pause and a resume
    // over the new QMP connection, a file in and out over the new agent one.
    api.ok(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None)
        .await;
    api.ok(Method::POST, &format!("/v1/sandboxes/{id}/resume"), None)
        .await;
    assert_eq!(
        run(&api, &id, "echo adopted > /tmp/a; cat /tmp/a").await,
        "adopted"
    );

    // A planned stop: hibernated, then woken by the next start.
    let before = count(&api, &id).await;
    let stopping = Instant::now();
    up.signal(shoal_testkit::SIGTERM);
    let stop_seconds = stopping.elapsed().as_secs_f64();
    let starting = Instant::now();
    up.restart().await;
    let start_seconds = starting.elapsed().as_secs_f64();
    println!("planned stop: {stop_seconds:.1} s, start: {start_seconds:.1} s");
    let api = ApiClient {
        base: up.base().to_owned(),
        ..api
    };

    // Woken before the server answered: running, no reason left over.
    let row = api
        .ok(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(row["status"], "running", "{row}");
    assert!(row["status_reason"].is_null(), "{row}");
    let after = count(&api, &id).await;
    assert!(
        after >= before,
        "the counter went back from {before} to {after}: not the same memory"
    );
    assert_eq!(
        run(&api, &id, "cat /tmp/counter.pid").await,
        pid,
        "the counter's process did not survive"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let later = count(&api, &id).await;
    assert!(later > after, "the counter stopped at {after}");

    let events = api
        .ok(
            Method::GET,
            &format!("/v1/sandboxes/{id}/events?tail=10"),
            None,
        )
        .await;
    let list = events["events"].as_array().unwrap();
    let reason = |kind: &str| {
        list.iter()
            .rev()
            .find(|e| e["type"] == kind)
            .map(|e| e["payload"]["reason"].clone())
    };
    assert_eq!(
        reason("sandbox.hibernated"),
        Some(json!("the service stopped")),
        "{events}"
    );
    assert_eq!(
        reason("sandbox.woken"),
        Some(json!("the service started")),
        "{events}"
    );
    app_answers(&api, &app, &app_sandbox).await;

    api.ok(Method::DELETE, &format!("/v1/apps/{app}"), None)
        .await;
    api.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .await;
}

#[test]
fn restarts_keep_sandboxes_sqlite() {
    shoal_testkit::with_database(
        Database::Sqlite,
        "vm_restarts_sqlite",
        |url, state| async move { restarts_keep_sandboxes(&url, state).await },
    );
}

#[test]
fn restarts_keep_sandboxes_postgres() {
    shoal_testkit::with_database(
        Database::Postgres,
        "vm_restarts_pg",
        |url, state| async move { restarts_keep_sandboxes(&url, state).await },
    );
}

/// The configuration file and the environment, on a real `shoal up`: a
/// tier's limit set in the file is the one admission holds to (the second
/// sandbox of a team account whose file limit is 1 is a 429), and `shoal
/// config show` names each value's source.
#[test]
fn the_configuration_file_sets_tier_limits() {
    shoal_testkit::block_on(async {
        let state = shoal_testkit::state_dir("vm_restarts_config");
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state).unwrap();
        let file = state.join("shoal.toml");
        std::fs::write(
            &file,
            "[up]\nreap-interval = 7\n\n[tiers.team]\nconcurrent = 1\n\n[rates]\ncpu_hour_usd = 1.5\n",
        )
        .unwrap();
        let shown = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
            .args(["config", "show", "up", "--config"])
            .arg(&file)
            .env("SHOAL_MAX_SANDBOXES", "3")
            .output()
            .unwrap();
        assert!(shown.status.success(), "{shown:?}");
        let shown = String::from_utf8(shown.stdout).unwrap();
        let file_name = file.display().to_string();
        for line in [
            format!("reap-interval = \"7\"  # file {file_name}"),
            "max-sandboxes = \"3\"  # environment SHOAL_MAX_SANDBOXES".to_string(),
            "listen = \"127.0.0.1:8080\"  # default".to_string(),
        ] {
            assert!(shown.contains(&line), "{line:?} not in {shown}");
        }
        let bad = state.join("bad.toml");
        std::fs::write(&bad, "[up]\nlisen = \"0.0.0.0:1\"\n").unwrap();
        let refused = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
            .arg("--config")
            .arg(&bad)
            .args(["config", "show"])
            .output()
            .unwrap();
        assert!(!refused.status.success());
        assert!(
            String::from_utf8_lossy(&refused.stderr).contains("no command reads up.lisen"),
            "{refused:?}"
        );

        let up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
            .args([std::ffi::OsString::from("--config"), file.into_os_string()])
            .args(["--log-format", "json"])
            .ready_within(Duration::from_secs(900))
            .start()
            .await;
        let api = ApiClient::new(up.base(), up.token("limited"));
        let ready = reqwest::get(format!("{}/readyz", up.base())).await.unwrap();
        assert_eq!(ready.status(), 200);
        let before = scrape(up.base()).await;
        let first = api
            .call(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "base"})),
            )
            .await;
        assert_eq!(first.status.as_u16(), 201, "{}", first.text);
        let second = api
            .call(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "base"})),
            )
            .await;
        assert_eq!(second.status.as_u16(), 429, "{}", second.text);

        // The metrics moved: one more create timed, one more quota refusal,
        // the sandbox counted by state and template.
        let after = scrape(up.base()).await;
        let create = [("operation", "create")];
        assert_eq!(
            value(&after, "shoal_operation_duration_seconds_count", &create),
            value(&before, "shoal_operation_duration_seconds_count", &create) + 1.0
        );
        let quota = [("reason", "quota")];
        assert_eq!(
            value(&after, "shoal_refusals_total", &quota),
            value(&before, "shoal_refusals_total", &quota) + 1.0
        );
        assert_eq!(
            value(&after, "shoal_quota_hits_total", &[]),
            value(&before, "shoal_quota_hits_total", &[]) + 1.0
        );
        assert_eq!(
            value(
                &after,
                "shoal_sandboxes",
                &[("state", "running"), ("template", "base")]
            ),
            1.0
        );
        let templates = value(&after, "shoal_templates_total", &[]);
        assert!(templates >= 2.0);
        assert_eq!(value(&after, "shoal_templates_ready", &[]), templates);
        assert!(value(&after, "shoal_host_memory_total_bytes", &[]) > 0.0);
        let created = [
            ("method", "POST"),
            ("route", "/v1/sandboxes"),
            ("status", "201"),
        ];
        assert_eq!(
            value(&after, "shoal_http_requests_total", &created),
            value(&before, "shoal_http_requests_total", &created) + 1.0
        );
        // Every answer names its request, and so does its JSON log line.
        let answered = reqwest::Client::new()
            .get(format!("{}/v1/me", up.base()))
            .header("x-request-id", "test-request-7")
            .bearer_auth(&api.token)
            .send()
            .await
            .unwrap();
        assert_eq!(answered.headers()["x-request-id"], "test-request-7");
        let fresh = reqwest::get(format!("{}/version", up.base()))
            .await
            .unwrap();
        assert_eq!(fresh.headers()["x-request-id"].len(), 36, "a UUID");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let log = std::fs::read_to_string(up.log()).unwrap();
        let logged = log
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .find(|line| line["span"]["id"] == "test-request-7")
            .unwrap_or_else(|| panic!("no JSON log line of the request in {log}"));
        assert_eq!(logged["span"]["path"], "/v1/me", "{logged}");
        assert_eq!(logged["fields"]["status"], 200, "{logged}");
        let me = api.ok(Method::GET, "/v1/me", None).await;
        assert_eq!(me["limits"]["max_concurrent_sandboxes"], 1, "{me}");
        // The operator lists every account's sandboxes and kills one: the
        // API sees it gone at once, its QEMU goes at the host's next tick.
        let id = first.json["id"].as_str().unwrap().to_owned();
        let database = format!("sqlite:{}", state.join("shoal.db").display());
        let operator = |args: &[&str]| {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
                .args(args)
                .args(["--database-url", &database])
                .output()
                .unwrap();
            assert!(out.status.success(), "{args:?}: {out:?}");
            String::from_utf8(out.stdout).unwrap()
        };
        let listed = operator(&["sandbox", "list"]);
        assert!(
            listed
                .lines()
                .any(|l| l.starts_with(&id) && l.contains("limited") && l.contains("running")),
            "{listed}"
        );
        assert!(!qemu_of(&state, &id).is_empty(), "no QEMU for {id}");
        // The operator removes an account's snapshot: its account no
        // longer sees it at once, its files go at the host's next tick.
        let snapshot = api
            .ok(Method::POST, &format!("/v1/sandboxes/{id}/snapshots"), None)
            .await["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let capture = state.join("captures").join(&snapshot);
        assert!(capture.is_dir(), "{}", capture.display());
        let listed = operator(&["snapshot", "list", "--account", "limited"]);
        assert!(
            listed
                .lines()
                .any(|l| l.starts_with(&snapshot) && l.contains(&id) && l.ends_with("kept")),
            "{listed}"
        );
        operator(&["snapshot", "rm", &snapshot]);
        let hidden = api
            .call(Method::GET, &format!("/v1/snapshots/{snapshot}"), None)
            .await;
        assert_eq!(hidden.status.as_u16(), 404, "{}", hidden.text);
        assert!(
            shoal_testkit::wait_until(Duration::from_secs(30), || async { !capture.exists() })
                .await,
            "the removed snapshot's files are still there"
        );
        assert!(!operator(&["snapshot", "list"]).contains(&snapshot));

        operator(&["sandbox", "kill", &id]);
        let gone = api
            .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await;
        assert_eq!(gone.status.as_u16(), 404, "{}", gone.text);
        assert!(
            shoal_testkit::wait_until(Duration::from_secs(30), || async {
                qemu_of(&state, &id).is_empty()
            })
            .await,
            "the killed sandbox's QEMU still runs"
        );
        let third = api
            .call(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "base"})),
            )
            .await;
        assert_eq!(
            third.status.as_u16(),
            201,
            "room again after the kill: {}",
            third.text
        );
        let third = third.json["id"].as_str().unwrap().to_owned();
        api.call(Method::DELETE, &format!("/v1/sandboxes/{third}"), None)
            .await;
    });
}

/// `/metrics` of the `shoal up` at `base` (a loopback peer, no token set),
/// parsed as Prometheus' text format.
async fn scrape(base: &str) -> prometheus_parse::Scrape {
    let answer = reqwest::get(format!("{base}/metrics")).await.unwrap();
    assert_eq!(answer.status(), 200);
    let text = answer.text().await.unwrap();
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    prometheus_parse::Scrape::parse(lines).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// The value of `name` with exactly `labels` (0 when there is none).
fn value(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .find(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => f64::NAN,
        })
        .unwrap_or(0.0)
}
