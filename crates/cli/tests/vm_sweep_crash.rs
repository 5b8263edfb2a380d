//! Durable sweeps survive the control plane: a real `shoal up` is killed
//! with SIGKILL in the middle of a sweep, with cells finished, cells running
//! and cells pending, and started again on the same database. The sweep
//! must finish with every cell recorded exactly once: the cells finished
//! before the kill keep their record untouched, the ones interrupted run
//! again in a new sandbox, and no VM of either life is left behind. Nobody
//! watches the sweep from the client side in between.
//!
//! Runs on SQLite and, when `SHOAL_TEST_DATABASE_URL` names a PostgreSQL
//! server (`scripts/with-postgres`), on a fresh database there too. Each
//! `shoal up` runs in its own process group and is stopped by its id.

use serde_json::{json, Value};
use shoal_testkit::{ApiClient, Database};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const CELLS: usize = 8;
const THROTTLE: usize = 2;

/// The API client; every call of this test must succeed.
struct Client(ApiClient);

impl Client {
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        self.0.ok(method, path, body).await
    }

    async fn get(&self, path: &str) -> Value {
        self.call(reqwest::Method::GET, path, None).await
    }
}

/// The QEMU processes running out of `state`.
fn vms_of(state: &Path) -> Vec<u32> {
    shoal_testkit::processes_mentioning(&state.join("vms").display().to_string())
}

async fn sweep_survives_a_sigkill(database_url: &str, state: PathBuf) {
    let _ = std::fs::remove_dir_all(&state);
    std::fs::create_dir_all(&state).unwrap();
    let mut up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
        .database_url(database_url)
        .start()
        .await;
    let client = Client(ApiClient::new(up.base(), up.token("crash")));
    let sweep = client
        .call(
            reqwest::Method::POST,
            "/v1/sweeps",
            Some(json!({
                "name": "crash",
                "template": "code-interpreter",
                "command": "sleep 4; echo cell-{cell}-$SLURM_ARRAY_TASK_ID",
                "cells": {"start": 0, "end": CELLS - 1},
                "throttle": THROTTLE,
                "timeout_seconds": 60,
            })),
        )
        .await;
    let id = sweep["id"].as_str().unwrap().to_owned();

    // Kill in the middle: some cells done, the next ones running.
    let deadline = Instant::now() + Duration::from_secs(240);
    let before = loop {
        let sweep = client.get(&format!("/v1/sweeps/{id}")).await;
        let counts = &sweep["counts"];
        if counts["succeeded"].as_u64().unwrap() >= 2 && counts["running"].as_u64().unwrap() >= 1 {
            break client
                .get(&format!("/v1/sweeps/{id}/cells?limit=100"))
                .await;
        }
        assert!(
            Instant::now() < deadline,
            "the sweep never got going: {sweep}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let orphans = vms_of(&state);
    up.signal(shoal_testkit::SIGKILL);
    assert!(!orphans.is_empty(), "no VM was running at the kill");
    assert!(
        orphans.iter().any(|pid| shoal_testkit::alive(*pid)),
        "the VMs died with the control plane; there is nothing to recover from"
    );
    let cells_before = before["cells"].as_array().unwrap().clone();
    let done_before: Vec<&Value> = cells_before
        .iter()
        .filter(|c| c["state"] == "succeeded")
        .collect();
    let running_before: Vec<&Value> = cells_before
        .iter()
        .filter(|c| c["state"] == "running")
        .collect();

    // A new life on the same database and state directory.
    up.restart().await;
    let client = Client(ApiClient {
        base: up.base().to_owned(),
        ..client.0
    });
    for pid in &orphans {
        assert!(
            !shoal_testkit::alive(*pid),
            "QEMU {pid} of the killed control plane was not reaped"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    let sweep = loop {
        let sweep = client.get(&format!("/v1/sweeps/{id}")).await;
        if sweep["state"] == "done" {
            break sweep;
        }
        assert!(
            Instant::now() < deadline,
            "the sweep did not finish: {sweep}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(sweep["counts"]["succeeded"], CELLS, "{sweep}");
    let after = client
        .get(&format!("/v1/sweeps/{id}/cells?limit=100"))
        .await;
    let cells_after = after["cells"].as_array().unwrap();
    assert_eq!(cells_after.len(), CELLS);
    for cell in cells_after {
        let index = cell["index"].as_u64().unwrap();
        assert_eq!(cell["state"], "succeeded", "{cell}");
        assert_eq!(
            cell["stdout"].as_str().unwrap(),
            format!("cell-{index}-{index}\n"),
            "{cell}"
        );
    }
    // Recorded exactly once: a cell finished before the kill was not run
    // or written again.
    for done in &done_before {
        let now = &cells_after[done["index"].as_u64().unwrap() as usize];
        for field in [
            "sandbox_id",
            "finished_at",
            "attempts",
            "claimed_by",
            "stdout",
        ] {
            assert_eq!(
                now[field], done[field],
                "cell {} changed its {field}",
                done["index"]
            );
        }
    }
    // An interrupted cell ran again, in a new sandbox.
    for running in &running_before {
        let now = &cells_after[running["index"].as_u64().unwrap() as usize];
        if !running["sandbox_id"].is_null() {
            assert_ne!(now["sandbox_id"], running["sandbox_id"], "{now}");
        }
    }
    // Every sandbox the sweep made is gone, from either life.
    let listed = client.get("/v1/sandboxes").await;
    assert_eq!(listed.as_array().map(Vec::len), Some(0), "{listed}");
    assert!(vms_of(&state).is_empty(), "VMs left after the sweep");
    drop(up);
    let _ = std::fs::remove_dir_all(&state);
}

#[test]
fn a_sweep_survives_sigkill_of_the_control_plane_on_sqlite() {
    shoal_testkit::with_database(
        Database::Sqlite,
        "vm_sweep_crash_sqlite",
        |url, state| async move { sweep_survives_a_sigkill(&url, state).await },
    );
}

#[test]
fn a_sweep_survives_sigkill_of_the_control_plane_on_postgres() {
    shoal_testkit::with_database(
        Database::Postgres,
        "vm_sweep_crash_pg",
        |url, state| async move { sweep_survives_a_sigkill(&url, state).await },
    );
}
