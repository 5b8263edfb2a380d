//! The sweep runner on real VMs, driven through the HTTP API as a client
//! would: cells run once each within the throttle, with their files,
//! environment and collected outputs; timeouts and retries; cancel; the
//! `fork_from` warm start; `after_ok`; and no sandbox left behind. Also the
//! per-cell overhead figures (`timings_ms`) over a 40-cell sweep.
//!
//! Every test runs on SQLite and, when `SHOAL_TEST_DATABASE_URL` names a
//! PostgreSQL server (`scripts/with-postgres`), the ones marked DB-bound
//! also on a fresh database there. Tests run one at a time: they share the
//! binary's host agent, and the throttle and timing checks need the cores.

use base64::Engine as _;
use serde_json::{json, Value};
use shoal_control::{ControlConfig, ControlPlane};
use shoal_host::HostAgent;
use shoal_store::{Store, Tier};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::OnceCell;

static SERIAL: Mutex<()> = Mutex::new(());

/// Runs one test body alone, on the shared runtime.
fn serial<F: std::future::Future<Output = ()>>(body: F) {
    let _alone = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    shoal_testkit::block_on(body);
}

async fn host() -> Arc<HostAgent> {
    static HOST: OnceCell<Arc<HostAgent>> = OnceCell::const_new();
    HOST.get_or_init(|| shoal_testkit::host_agent("vm_sweeps"))
        .await
        .clone()
}

/// A control plane of its own database over the shared host, served on a
/// free port.
struct Server {
    base: String,
    token: String,
    client: reqwest::Client,
    host: Arc<HostAgent>,
    store: Store,
    serve: tokio::task::JoinHandle<()>,
    db: shoal_testkit::TestDb,
}

impl Server {
    async fn start(db: shoal_testkit::TestDb) -> Server {
        Self::start_with(db, |_| {}).await
    }

    /// [`Server::start`] with the control plane's configuration changed.
    async fn start_with(
        db: shoal_testkit::TestDb,
        change: impl FnOnce(&mut ControlConfig),
    ) -> Server {
        let host = host().await;
        let store = Store::connect(&db.url).await.expect("opening the store");
        let token = store.create_token("sweeper", Tier::Team).await.unwrap();
        let mut config = ControlConfig::default();
        config.sweeps.housekeeping = Duration::from_millis(500);
        change(&mut config);
        let cp = ControlPlane::new(store.clone(), host.clone(), config);
        cp.start_background().await.map_err(|e| e.message).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let serve = tokio::spawn(async move {
            axum::serve(listener, shoal_control::router(cp))
                .await
                .unwrap();
        });
        Server {
            base,
            token,
            client: reqwest::Client::new(),
            host,
            store,
            serve,
            db,
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut request = self
            .client
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    async fn get(&self, path: &str) -> Value {
        let (status, body) = self.call(reqwest::Method::GET, path, None).await;
        assert_eq!(status, 200, "GET {path}: {body}");
        body
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    async fn submit(&self, body: Value) -> Value {
        let (status, sweep) = self.post("/v1/sweeps", body).await;
        assert_eq!(status, 201, "{sweep}");
        sweep
    }

    /// Waits until the sweep has a `finished_at`.
    async fn wait_finished(&self, id: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let sweep = self.get(&format!("/v1/sweeps/{id}")).await;
            if !sweep["finished_at"].is_null() {
                return sweep;
            }
            assert!(
                Instant::now() < deadline,
                "sweep {id} did not finish: {sweep}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn cells(&self, id: &str) -> Vec<Value> {
        let total = self.get(&format!("/v1/sweeps/{id}")).await["total"]
            .as_u64()
            .unwrap();
        let mut cells = Vec::new();
        for index in 0..total {
            cells.push(self.get(&format!("/v1/sweeps/{id}/cells/{index}")).await);
        }
        cells
    }

    /// No VM left on the host, and every sandbox row of the sweep deleted
    /// (a delete kills the VM, then writes the row: both are waited for).
    async fn assert_nothing_left(&self, sweep: &str) {
        let gone = shoal_testkit::wait_until(Duration::from_secs(15), || async {
            self.host.engine().list().await.is_empty()
        })
        .await;
        assert!(
            gone,
            "sandboxes left: {:?}",
            self.host.engine().list().await
        );
        let path = format!("/v1/usage?metadata=sweep={sweep}");
        let all_deleted = |usage: &Value| {
            usage["items"]
                .as_array()
                .unwrap()
                .iter()
                .all(|item| item["status"] == "deleted")
        };
        shoal_testkit::wait_until(Duration::from_secs(5), || async {
            all_deleted(&self.get(&path).await)
        })
        .await;
        let usage = self.get(&path).await;
        for item in usage["items"].as_array().unwrap() {
            assert_eq!(item["status"], "deleted", "{item}");
        }
    }

    async fn stop(self) {
        self.serve.abort();
        self.store.close().await;
        self.db.cleanup().await;
    }
}

fn b64(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

fn unb64(text: &Value) -> String {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text.as_str().unwrap())
        .unwrap();
    String::from_utf8(bytes).unwrap()
}

/// Each case as `sqlite::NAME` and `postgres::NAME`.
macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[test]
                fn $name() {
                    super::serial(async {
                        let server = super::Server::start(shoal_testkit::TestDb::sqlite().await).await;
                        super::$name(&server).await;
                        server.stop().await;
                    });
                }
            )*
        }
        mod postgres {
            $(
                #[test]
                fn $name() {
                    super::serial(async {
                        if let Some(db) = shoal_testkit::TestDb::postgres().await {
                            let server = super::Server::start(db).await;
                            super::$name(&server).await;
                            server.stop().await;
                        }
                    });
                }
            )*
        }
    };
}

cases!(
    ten_cells_within_the_throttle,
    cancel_mid_sweep_leaves_no_sandbox
);

mod sqlite_only {
    #[test]
    fn timeouts_and_retries() {
        super::serial(async {
            let server = super::Server::start(shoal_testkit::TestDb::sqlite().await).await;
            super::timeouts_and_retries(&server).await;
            server.stop().await;
        });
    }

    #[test]
    fn fork_from_warm_start() {
        super::serial(async {
            let server = super::Server::start(shoal_testkit::TestDb::sqlite().await).await;
            super::fork_from_warm_start(&server).await;
            server.stop().await;
        });
    }

    #[test]
    fn after_ok_orders_sweeps() {
        super::serial(async {
            let server = super::Server::start(shoal_testkit::TestDb::sqlite().await).await;
            super::after_ok_orders_sweeps(&server).await;
            server.stop().await;
        });
    }

    #[test]
    fn bad_requests_name_the_field() {
        super::serial(async {
            let server = super::Server::start(shoal_testkit::TestDb::sqlite().await).await;
            super::bad_requests_name_the_field(&server).await;
            server.stop().await;
        });
    }

    #[test]
    fn a_sized_boot_outlasts_the_lease() {
        super::serial(async {
            // A lease far shorter than a cold boot: only renewals from the
            // claim on keep the cell.
            let server = super::Server::start_with(shoal_testkit::TestDb::sqlite().await, |c| {
                c.sweeps.lease = std::time::Duration::from_secs(1)
            })
            .await;
            super::a_sized_boot_outlasts_the_lease(&server).await;
            server.stop().await;
        });
    }

    #[test]
    fn overhead_of_forty_cells() {
        super::serial(async {
            let server = super::Server::start(shoal_testkit::TestDb::sqlite().await).await;
            super::overhead_of_forty_cells(&server).await;
            server.stop().await;
        });
    }
}

/// Ten cells over `code-interpreter`, throttle 3: each succeeds exactly
/// once, with its files, environment and collected output, never more than
/// three at once, and nothing is left afterwards.
async fn ten_cells_within_the_throttle(server: &Server) {
    let submitted = Instant::now();
    let sweep = server
        .submit(json!({
            "name": "ten",
            "template": "code-interpreter",
            "command": "cat input.txt; mkdir -p out/a-directory.txt; \
                        echo \"$SLURM_ARRAY_TASK_ID $SLURM_ARRAY_JOB_ID $SLURM_JOB_ID $SHOAL_CELL_INDEX $MODE $SLURM_ARRAY_TASK_COUNT\" > out/{cell}.txt; \
                        python3 -c 'print({cell} * {cell})'",
            "cells": {"start": 10, "end": 19},
            "env": {"MODE": "fast"},
            "workdir": "/work",
            "throttle": 3,
            "timeout_seconds": 120,
            // A directory the glob matches is not a file to collect; a glob
            // may stand for a directory on the way.
            "collect": ["/work/out/*.txt", "/work/missing.txt", "/w*k/input.txt"],
            "files": {"/work/input.txt": b64("hello from the submitter\n")},
        }))
        .await;
    let id = sweep["id"].as_str().unwrap().to_owned();
    let job_id = sweep["job_id"].as_u64().unwrap();
    assert_eq!(sweep["state"], "active");
    assert_eq!(sweep["total"], 10);

    // Sample the running count until the sweep ends.
    let mut most_running = 0;
    let deadline = Instant::now() + Duration::from_secs(300);
    let done = loop {
        let now = server.get(&format!("/v1/sweeps/{job_id}")).await;
        let running = now["counts"]["running"].as_u64().unwrap();
        assert!(running <= 3, "throttle exceeded: {now}");
        most_running = most_running.max(running);
        if !now["finished_at"].is_null() {
            break now;
        }
        assert!(Instant::now() < deadline, "the sweep did not finish: {now}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(done["state"], "done", "{done}");
    assert_eq!(done["counts"]["succeeded"], 10, "{done}");
    assert_eq!(done["progress"], 1.0);
    assert!(
        most_running >= 2,
        "the throttle was never used: at most {most_running} ran"
    );
    assert!(done["cpu_seconds"].as_f64().unwrap() > 0.0, "{done}");
    assert!(done["cost_usd"].as_f64().unwrap() > 0.0, "{done}");

    let cells = server.cells(&id).await;
    let mut first_running = f64::MAX;
    let mut sandboxes = std::collections::BTreeSet::new();
    for (index, cell) in cells.iter().enumerate() {
        let value = 10 + index as u64;
        assert_eq!(cell["state"], "succeeded", "{cell}");
        assert_eq!(cell["attempts"], 1, "{cell}");
        assert_eq!(cell["exit_code"], 0);
        let stdout = cell["stdout"].as_str().unwrap();
        assert_eq!(
            stdout,
            format!("hello from the submitter\n{}\n", value * value),
            "{cell}"
        );
        let collected = cell["collected"].as_object().unwrap();
        assert_eq!(collected.len(), 2, "{cell}");
        assert_eq!(
            unb64(&collected["/work/input.txt"]),
            "hello from the submitter\n"
        );
        assert_eq!(
            unb64(&collected[&format!("/work/out/{value}.txt")]),
            format!(
                "{value} {job_id} {} {index} fast 10\n",
                job_id + index as u64
            )
        );
        assert!(cell["error"].is_null(), "{cell}");
        assert!(
            sandboxes.insert(cell["sandbox_id"].as_str().unwrap().to_owned()),
            "a sandbox ran two cells"
        );
        let timings = &cell["timings_ms"];
        for phase in ["create", "exec", "run", "collect", "delete"] {
            assert!(timings[phase].is_u64(), "{phase}: {cell}");
        }
        let started =
            chrono::DateTime::parse_from_rfc3339(cell["started_at"].as_str().unwrap()).unwrap();
        let running_at = started.timestamp_millis() as f64 / 1000.0
            + (timings["create"].as_u64().unwrap() + timings["exec"].as_u64().unwrap()) as f64
                / 1000.0;
        first_running = first_running.min(running_at);
    }
    let submitted_at = shoal_control::now() - submitted.elapsed().as_secs_f64();
    eprintln!(
        "FIGURE submission to first cell running: {:.3} s",
        first_running - submitted_at
    );
    // The list view: in order, output cut, no files.
    let list = server
        .get(&format!("/v1/sweeps/{id}/cells?limit=4&offset=2"))
        .await;
    assert_eq!(list["total"], 10);
    let listed: Vec<u64> = list["cells"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(listed, vec![2, 3, 4, 5]);
    assert!(list["cells"][0].get("collected").is_none());
    assert!(list["cells"][0]["stdout"].is_string(), "{list}");
    let (status, error) = server
        .call(
            reqwest::Method::GET,
            &format!("/v1/sweeps/{id}/cells?outputs=maybe"),
            None,
        )
        .await;
    assert_eq!(status, 400, "{error}");
    // States only, for the console's grid: no output tails.
    let states = server
        .get(&format!(
            "/v1/sweeps/{id}/cells?outputs=false&limit=4&offset=2"
        ))
        .await;
    assert_eq!(states["cells"][0]["index"], 2);
    assert_eq!(states["cells"][0]["state"], "succeeded");
    assert!(states["cells"][0].get("stdout").is_none(), "{states}");
    assert!(states["cells"][0].get("stderr").is_none(), "{states}");
    server.assert_nothing_left(&id).await;
    let usage = server.get(&format!("/v1/usage?metadata=sweep={id}")).await;
    assert_eq!(usage["items"].as_array().unwrap().len(), 10, "{usage}");
}

/// A command past its timeout is killed and retried, a failing one retried,
/// then both recorded; a requeue runs them again.
async fn timeouts_and_retries(server: &Server) {
    let sweep = server
        .submit(json!({
            "name": "flaky",
            "template": "code-interpreter",
            "command": "case {cell} in slow) sleep 60;; bad) echo oops >&2; exit 3;; *) echo fine;; esac",
            "cells": ["slow", "bad", "good"],
            "throttle": 3,
            "timeout_seconds": 2,
            "retries": 1,
        }))
        .await;
    let id = sweep["id"].as_str().unwrap();
    let done = server.wait_finished(id, Duration::from_secs(180)).await;
    assert_eq!(done["state"], "done");
    let cells = server.cells(id).await;
    assert_eq!(
        (cells[0]["state"].as_str(), cells[0]["attempts"].as_u64()),
        (Some("timeout"), Some(2)),
        "{}",
        cells[0]
    );
    assert!(
        cells[0]["error"].as_str().unwrap().contains("timeout"),
        "{}",
        cells[0]
    );
    assert!(
        cells[0]["elapsed_ms"].as_u64().unwrap() < 10_000,
        "{}",
        cells[0]
    );
    assert_eq!(
        (cells[1]["state"].as_str(), cells[1]["attempts"].as_u64()),
        (Some("failed"), Some(2)),
        "{}",
        cells[1]
    );
    assert_eq!(cells[1]["exit_code"], 3);
    assert_eq!(cells[1]["stderr"], "oops\n");
    assert_eq!(
        (cells[2]["state"].as_str(), cells[2]["attempts"].as_u64()),
        (Some("succeeded"), Some(1))
    );
    assert_eq!(cells[2]["stdout"], "fine\n");
    server.assert_nothing_left(id).await;

    let (status, requeued) = server
        .post(&format!("/v1/sweeps/{id}/requeue"), json!({}))
        .await;
    assert_eq!(status, 200, "{requeued}");
    assert_eq!(requeued["state"], "active");
    let done = server.wait_finished(id, Duration::from_secs(180)).await;
    assert_eq!(
        (
            done["counts"]["timeout"].as_u64(),
            done["counts"]["failed"].as_u64()
        ),
        (Some(1), Some(1)),
        "{done}"
    );
    let cells = server.cells(id).await;
    assert_eq!(
        cells[1]["attempts"], 2,
        "fresh attempts after a requeue: {}",
        cells[1]
    );
    server.assert_nothing_left(id).await;

    // A Slurm job's time limit: its --signal warning first, SIGTERM at the
    // limit (it traps it and checkpoints), SIGKILL only after KillWait.
    let sweep = server
        .submit(json!({
            "name": "checkpointing",
            "template": "base",
            "command": "trap 'echo warned' USR1; trap 'echo saved; exit 0' TERM; \
                        while :; do sleep 0.2; done",
            "cells": [0],
            "timeout_seconds": 3,
            "retries": 0,
            "slurm": {"kill_wait_seconds": 20, "signal": {"signal": 10, "before_seconds": 1}},
        }))
        .await;
    let id = sweep["id"].as_str().unwrap();
    server.wait_finished(id, Duration::from_secs(180)).await;
    let cells = server.cells(id).await;
    assert_eq!(cells[0]["state"], "timeout", "{}", cells[0]);
    assert_eq!(cells[0]["stdout"], "warned\nsaved\n", "{}", cells[0]);
    assert!(
        cells[0]["elapsed_ms"].as_u64().unwrap() < 15_000,
        "it ended at SIGTERM, not at SIGKILL: {}",
        cells[0]
    );
    server.assert_nothing_left(id).await;
}

/// The first attempt of a sweep sized by Slurm's `--cpus-per-task` and
/// `--mem` boots the template at that size (seconds on TCG, half a minute
/// on two busy cores): its lease is renewed through the boot, so the cell
/// runs once and succeeds, not "lease expired" (the corpus's `--mem` jobs
/// failed so when three sizes booted at once).
async fn a_sized_boot_outlasts_the_lease(server: &Server) {
    // A size no earlier run left booted on this host (the test host keeps
    // its state directory, and a sized copy is reused).
    let memory_mib = 300 + rand_u64() % 1000;
    let sweep = server
        .submit(json!({
            "name": "sized",
            "template": "base",
            "command": "nproc; echo ran {cell}",
            "cells": [0],
            "retries": 0,
            "slurm": {"cpus_per_task": 1, "mem_mib": memory_mib},
        }))
        .await;
    let id = sweep["id"].as_str().unwrap();
    let started = Instant::now();
    let done = server.wait_finished(id, Duration::from_secs(300)).await;
    let cells = server.cells(id).await;
    assert_eq!(cells[0]["state"], "succeeded", "{}", cells[0]);
    assert_eq!(cells[0]["attempts"], 1, "{}", cells[0]);
    assert_eq!(cells[0]["stdout"], "1\nran 0\n", "{}", cells[0]);
    assert_eq!(done["state"], "done", "{done}");
    assert!(
        started.elapsed() > Duration::from_secs(3),
        "the boot outlasted three lease lengths (else this test proves nothing): {:?}",
        started.elapsed()
    );
    server.assert_nothing_left(id).await;
}

/// Cancelling one running cell, then the whole sweep mid-way: the running
/// sandboxes are killed, pending cells never start, nothing is left.
async fn cancel_mid_sweep_leaves_no_sandbox(server: &Server) {
    let sweep = server
        .submit(json!({
            "name": "long",
            "template": "code-interpreter",
            "command": "echo started; sleep 120",
            "cells": {"start": 0, "end": 5},
            "throttle": 2,
            "timeout_seconds": 600,
        }))
        .await;
    let id = sweep["id"].as_str().unwrap();
    // Both running cells have started their command.
    let started = shoal_testkit::wait_until(Duration::from_secs(60), || async {
        server.host.engine().list().await.len() >= 2
            && server.get(&format!("/v1/sweeps/{id}")).await["counts"]["running"] == 2
    })
    .await;
    assert!(started, "two cells never ran");
    tokio::time::sleep(Duration::from_secs(2)).await;
    // A running command's sandbox gives the CPU to starts and collects.
    for sandbox in server.host.engine().list().await {
        assert_eq!(
            server.host.engine().cpu_priority(&sandbox.id).unwrap(),
            Some(shoal_host::CpuPriority::Background),
            "sandbox {} runs its command at normal priority",
            sandbox.id
        );
    }
    let (status, after) = server
        .post(&format!("/v1/sweeps/{id}/cancel"), json!({"cells": [0]}))
        .await;
    assert_eq!(status, 200, "{after}");
    let one = shoal_testkit::wait_until(Duration::from_secs(30), || async {
        server.get(&format!("/v1/sweeps/{id}/cells/0")).await["state"] == "cancelled"
    })
    .await;
    assert!(one, "cell 0 was not cancelled");
    assert_eq!(
        server.get(&format!("/v1/sweeps/{id}")).await["state"],
        "active"
    );

    let (status, cancelled) = server
        .post(&format!("/v1/sweeps/{id}/cancel"), json!({}))
        .await;
    assert_eq!(status, 200, "{cancelled}");
    assert_eq!(cancelled["state"], "cancelled");
    let done = server.wait_finished(id, Duration::from_secs(30)).await;
    assert_eq!(done["counts"]["cancelled"], 6, "{done}");
    assert_eq!(done["counts"]["succeeded"], 0, "{done}");
    server.assert_nothing_left(id).await;
}

/// `fork_from`: the setup runs once; every cell's sandbox is a fork of its
/// parent and sees its files and memory; the parent goes with the sweep. A
/// failed setup fails every cell with its output.
async fn fork_from_warm_start(server: &Server) {
    let token = format!("{:016x}", rand_u64());
    let sweep = server
        .submit(json!({
            "name": "warm",
            "template": "code-interpreter",
            "command": "cat /work/state.txt /dev/shm/warm; echo cell {cell}",
            "cells": [1, 2, 3, 4],
            "workdir": "/work",
            "throttle": 2,
            "timeout_seconds": 60,
            "fork_from": {"setup": format!("echo disk-{token} > /work/state.txt; echo ram-{token} > /dev/shm/warm"), "timeout_seconds": 60},
        }))
        .await;
    let id = sweep["id"].as_str().unwrap();
    let done = server.wait_finished(id, Duration::from_secs(240)).await;
    assert_eq!(done["counts"]["succeeded"], 4, "{done}");
    let cells = server.cells(id).await;
    let mut parents = std::collections::BTreeSet::new();
    for (n, cell) in cells.iter().enumerate() {
        assert_eq!(
            cell["stdout"],
            format!("disk-{token}\nram-{token}\ncell {}\n", n + 1),
            "{cell}"
        );
        let row = server
            .store
            .sandbox_by_id(cell["sandbox_id"].as_str().unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.boot_mode.as_deref(), Some("fork"));
        parents.insert(row.parent_id.expect("a fork child has a parent"));
    }
    assert_eq!(parents.len(), 1, "one parent per sweep: {parents:?}");
    server.assert_nothing_left(id).await;

    let broken = server
        .submit(json!({
            "name": "cold",
            "template": "code-interpreter",
            "command": "echo never",
            "cells": [1, 2, 3],
            "retries": 1,
            "fork_from": {"setup": "echo the reference data is missing >&2; exit 4"},
        }))
        .await;
    let id = broken["id"].as_str().unwrap();
    let done = server.wait_finished(id, Duration::from_secs(120)).await;
    assert_eq!(done["counts"]["failed"], 3, "{done}");
    for cell in server.cells(id).await {
        let error = cell["error"].as_str().unwrap();
        assert!(
            error.contains("the reference data is missing") && error.contains("exited with 4"),
            "{cell}"
        );
    }
    server.assert_nothing_left(id).await;
}

/// `after_ok`: a held sweep starts only after its dependency is done with
/// every cell succeeded; one whose dependency failed is cancelled.
async fn after_ok_orders_sweeps(server: &Server) {
    let first = server
        .submit(json!({"name": "first", "template": "code-interpreter", "command": "sleep 2", "cells": [0, 1], "throttle": 2}))
        .await;
    let failing = server
        .submit(json!({"name": "failing", "template": "code-interpreter", "command": "exit 1", "cells": [0]}))
        .await;
    let second = server
        .submit(json!({"name": "second", "template": "code-interpreter", "command": "true", "cells": [0, 1],
                       "after_ok": [first["job_id"]]}))
        .await;
    assert_eq!(
        (second["state"].as_str(), second["reason"].as_str()),
        (Some("held"), Some("Dependency"))
    );
    assert_eq!(second["after_ok"], json!([first["id"]]));
    let doomed = server
        .submit(json!({"name": "doomed", "template": "code-interpreter", "command": "true", "cells": [0],
                       "after_ok": [first["id"], failing["id"]]}))
        .await;

    let second_done = server
        .wait_finished(second["id"].as_str().unwrap(), Duration::from_secs(180))
        .await;
    assert_eq!(second_done["counts"]["succeeded"], 2, "{second_done}");
    let first_done = server
        .get(&format!("/v1/sweeps/{}", first["id"].as_str().unwrap()))
        .await;
    let time = |v: &Value| chrono::DateTime::parse_from_rfc3339(v.as_str().unwrap()).unwrap();
    assert!(
        time(&second_done["started_at"]) >= time(&first_done["finished_at"]),
        "{first_done} {second_done}"
    );
    let doomed_done = server
        .wait_finished(doomed["id"].as_str().unwrap(), Duration::from_secs(60))
        .await;
    assert_eq!(
        (
            doomed_done["state"].as_str(),
            doomed_done["reason"].as_str()
        ),
        (Some("cancelled"), Some("DependencyNeverSatisfied"))
    );
    assert_eq!(doomed_done["counts"]["cancelled"], 1);
    server
        .assert_nothing_left(second["id"].as_str().unwrap())
        .await;
}

/// Wrong input is a 400 naming the field; another account's sweep is a 404.
async fn bad_requests_name_the_field(server: &Server) {
    let good =
        json!({"name": "x", "template": "code-interpreter", "command": "true", "cells": [1]});
    let cases: Vec<(&str, Value)> = vec![
        ("name", json!(null)),
        ("template", json!("no-such-template")),
        ("command", json!("")),
        ("cells", json!({"start": 3, "end": 1})),
        ("throttle", json!(0)),
        ("timeout_seconds", json!(-1)),
        ("retries", json!(11)),
        ("collect", json!(["relative/*.txt"])),
        ("files", json!({"/x": "not base64!"})),
        ("fork_from", json!({"timeout_seconds": 5})),
        ("after_ok", json!(["sw_0000000000000000"])),
        ("env", json!({"A": 1})),
        ("workdir", json!("work")),
    ];
    for (field, value) in cases {
        let mut body = good.clone();
        body[field] = value;
        let (status, error) = server.post("/v1/sweeps", body).await;
        assert_eq!(status, 400, "{field}: {error}");
        assert!(
            error["error"].as_str().unwrap().contains(field),
            "{field}: {error}"
        );
    }
    let (status, _) = server.post("/v1/sweeps", json!("not an object")).await;
    assert_eq!(status, 400);
    for path in [
        "/v1/sweeps/sw_0000000000000000",
        "/v1/sweeps/999999",
        "/v1/sweeps/999999/cells/0",
    ] {
        let (status, error) = server.call(reqwest::Method::GET, path, None).await;
        assert_eq!(
            (status, error["error"].as_str()),
            (404, Some("sweep not found")),
            "{path}"
        );
    }
    let (status, body) = server
        .call(
            reqwest::Method::PATCH,
            "/v1/sweeps/1",
            Some(json!({"throttle": "x"})),
        )
        .await;
    assert_eq!(status, 404, "{body}");
}

/// Per-cell overhead (create + exec start + collect + delete, the
/// command's own run excluded) over 40 short Python cells, from the
/// `timings_ms` the cells report. Prints the figures; asserts only that
/// they are there.
async fn overhead_of_forty_cells(server: &Server) {
    let submitted = Instant::now();
    let sweep = server
        .submit(json!({
            "name": "overhead",
            "template": "code-interpreter",
            "command": "python3 -c 'print({cell})' > /tmp/out.txt",
            "cells": {"start": 0, "end": 39},
            "throttle": 4,
            "collect": ["/tmp/out.txt"],
        }))
        .await;
    let id = sweep["id"].as_str().unwrap();
    let done = server.wait_finished(id, Duration::from_secs(600)).await;
    let makespan = submitted.elapsed().as_secs_f64();
    assert_eq!(done["counts"]["succeeded"], 40, "{done}");
    let list = server
        .get(&format!("/v1/sweeps/{id}/cells?limit=1000"))
        .await;
    let mut phases: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    let mut overheads = Vec::new();
    for cell in list["cells"].as_array().unwrap() {
        let t = &cell["timings_ms"];
        let mut overhead = 0;
        for phase in ["create", "exec", "run", "collect", "delete"] {
            let ms = t[phase].as_u64().unwrap();
            phases.entry(phase).or_default().push(ms);
            if phase != "run" {
                overhead += ms;
            }
        }
        overheads.push(overhead);
    }
    let p50 = |v: &mut Vec<u64>| {
        v.sort_unstable();
        v[v.len() / 2]
    };
    for (phase, values) in phases.iter_mut() {
        eprintln!("FIGURE {phase} p50 {} ms", p50(values));
    }
    eprintln!("FIGURE per-cell overhead p50 {} ms (p90 {} ms); makespan {makespan:.1} s for 40 cells at throttle 4",
        p50(&mut overheads), overheads[overheads.len() * 9 / 10]);
    server.assert_nothing_left(id).await;
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(std::process::id() as u64);
    hasher.finish()
}
