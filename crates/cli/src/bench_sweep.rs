//! `shoal bench sweep`: the same job array on a real Slurm and on Shoal, and
//! the claim rate of the sweep table alone on SQLite and PostgreSQL.
//!
//! Owns: the task (a short Python script writing a result file), running it
//! as a Slurm array through `sbatch` (against the cluster `SLURM_CONF`
//! names, as `scripts/with-slurm` starts) and as a sweep through a running
//! `shoal up`, and the figures read back from each. Does not start or stop
//! any of them: `scripts/bench-sweep` does.
//!
//! One definition for both systems, every instant on this machine's clock:
//!
//! - **makespan**: from just before the submission (`sbatch` spawned, the
//!   `POST /v1/sweeps` sent) to the last task recorded finished (Slurm:
//!   slurmctld's `_job_complete ... done`; Shoal: the cell's `finished_at`).
//! - **per-task overhead**: how long the system held a task's slot minus how
//!   long the task's command ran. Slurm: from slurmctld's allocation of the
//!   task to its completion, minus the batch script's own stamps around the
//!   command. Shoal: `timings_ms` create + exec + collect + delete (the slot
//!   minus `run`).
//! - **first task**: from the submission to the earliest instant a task's
//!   command started (Slurm: the batch script's first stamp; Shoal: the
//!   cell's claim time plus its create and exec).

use crate::bench::summary;
use anyhow::{bail, ensure, Context, Result};
use base64::Engine as _;
use serde_json::{json, Value};
use shoal_store::{Store, Tier};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct SweepBenchArgs {
    /// Where to write the JSON report.
    #[arg(long)]
    json: PathBuf,
    /// Tasks of the array.
    #[arg(long, default_value_t = 200)]
    tasks: u32,
    /// Tasks running at once (Slurm's `%N`, the sweep's throttle).
    #[arg(long, default_value_t = 20)]
    throttle: u32,
    /// Also run a small array with few tasks at once (tasks:throttle), to
    /// show each system's overhead without CPU contention; "0:0" for none.
    #[arg(long, default_value = "20:2")]
    uncontended: String,
    /// Run the Slurm side (needs `SLURM_CONF` and `SHOAL_SLURM_DIR`, as
    /// `scripts/with-slurm` sets them).
    #[arg(long)]
    slurm: bool,
    /// A running `shoal up`; none skips the Shoal side.
    #[arg(long)]
    url: Option<String>,
    /// An API token of a team account on `--url`.
    #[arg(long, env = "PANDASTACK_API_KEY")]
    token: Option<String>,
    #[arg(long, default_value = "code-interpreter")]
    template: String,
    /// A PostgreSQL URL for the claim rate (a database no control plane
    /// runs on: its runner would take the measured cells).
    #[arg(long)]
    claims_postgres: Option<String>,
    /// Measure the claim rate on a fresh SQLite file as well.
    #[arg(long)]
    claims_sqlite: bool,
    /// Cells of the claim-rate sweep.
    #[arg(long, default_value_t = 5000)]
    claim_cells: usize,
    /// Concurrent claimers.
    #[arg(long, default_value_t = 8)]
    claimers: usize,
    /// Cells asked for per claim (the runner asks for all its free room).
    #[arg(long, default_value_t = 16)]
    claim_batch: u32,
}

/// The task: a little CPU work, then its result file.
const TASK_PY: &str = r#"import os, sys
cell, out = sys.argv[1], sys.argv[2]
total = sum(i * i for i in range(100000))
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, cell + ".txt"), "w") as f:
    f.write("%s %d\n" % (cell, total))
"#;

/// What the task writes for `cell`.
fn expected_result(cell: u32) -> String {
    let total: u64 = (0..100_000u64).map(|i| i * i).sum();
    format!("{cell} {total}\n")
}

/// The figures of one run of the array on one system.
struct Run {
    makespan_s: f64,
    first_task_s: f64,
    overhead_ms: Vec<f64>,
    run_ms: Vec<f64>,
    /// Shoal only: each phase of `timings_ms`.
    phases: BTreeMap<String, Vec<f64>>,
}

impl Run {
    fn json(&self, tasks: u32, throttle: u32) -> Value {
        let overhead = summary(&self.overhead_ms);
        let mut report = json!({
            "tasks": tasks,
            "throttle": throttle,
            "makespan_s": round3(self.makespan_s),
            "overhead_ms_p50": overhead["p50"],
            "first_task_s": round3(self.first_task_s),
            "overhead_ms": overhead,
            "run_ms": summary(&self.run_ms),
        });
        if !self.phases.is_empty() {
            report["phases_ms"] = self
                .phases
                .iter()
                .map(|(k, v)| (k.clone(), summary(v)))
                .collect::<serde_json::Map<_, _>>()
                .into();
        }
        report
    }
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn parse_uncontended(text: &str) -> Result<Option<(u32, u32)>> {
    let (tasks, throttle) = text
        .split_once(':')
        .context("--uncontended is TASKS:THROTTLE")?;
    let (tasks, throttle): (u32, u32) = (tasks.parse()?, throttle.parse()?);
    Ok((tasks > 0 && throttle > 0).then_some((tasks, throttle)))
}

pub async fn sweep(args: SweepBenchArgs) -> Result<()> {
    ensure!(
        args.tasks > 0 && args.throttle > 0,
        "--tasks and --throttle must be at least 1"
    );
    let uncontended = parse_uncontended(&args.uncontended)?;
    let mut report = json!({
        "task": "python3 task.py CELL OUTDIR: sum of squares below 100,000, then OUTDIR/CELL.txt",
        "tasks": args.tasks,
        "throttle": args.throttle,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
    });
    let mut runs = Vec::new();
    runs.push(("", args.tasks, args.throttle));
    if let Some((tasks, throttle)) = uncontended {
        runs.push(("uncontended", tasks, throttle));
    }

    // Claims first: nothing else runs on the machine meanwhile.
    let mut claims = json!({});
    let mut claim_detail = json!({});
    if args.claims_sqlite {
        let dir = tempfile_dir("shoal-bench-claims")?;
        let url = format!("sqlite:{}", dir.join("claims.db").display());
        let rate = claim_rate(&url, &args).await;
        let _ = std::fs::remove_dir_all(&dir);
        let rate = rate?;
        claims["sqlite"] = json!(rate.claims_per_second.round());
        claim_detail["sqlite"] = serde_json::to_value(&rate)?;
    }
    if let Some(url) = &args.claims_postgres {
        let rate = claim_rate(url, &args).await?;
        claims["postgres"] = json!(rate.claims_per_second.round());
        claim_detail["postgres"] = serde_json::to_value(&rate)?;
    }
    report["claims_per_s"] = claims;
    report["claims"] = claim_detail;

    if args.slurm {
        let slurm = SlurmRun::new()?;
        for (label, tasks, throttle) in &runs {
            eprintln!("slurm: {tasks} tasks, throttle {throttle}");
            let run = slurm.run(*tasks, *throttle).await?;
            put(&mut report, label, "slurm", run.json(*tasks, *throttle));
        }
        report["slurm_version"] = json!(slurm.version);
    }
    if let Some(url) = &args.url {
        let token = args.token.clone().context("--token is needed with --url")?;
        let shoal = ShoalRun {
            http: reqwest::Client::new(),
            base: url.trim_end_matches('/').to_owned(),
            auth: format!("Bearer {token}"),
            template: args.template.clone(),
        };
        for (label, tasks, throttle) in &runs {
            eprintln!("shoal: {tasks} tasks, throttle {throttle}");
            let run = shoal.run(*tasks, *throttle).await?;
            put(&mut report, label, "shoal", run.json(*tasks, *throttle));
        }
    }
    std::fs::write(&args.json, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", args.json.display()))?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// `report[system]`, or `report[label][system]`.
fn put(report: &mut Value, label: &str, system: &str, value: Value) {
    if label.is_empty() {
        report[system] = value;
    } else {
        if report.get(label).is_none() {
            report[label] = json!({});
        }
        report[label][system] = value;
    }
}

fn tempfile_dir(prefix: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "{prefix}.{}.{}",
        std::process::id(),
        (unix_now() * 1e6) as u64
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

async fn claim_rate(url: &str, args: &SweepBenchArgs) -> Result<shoal_store::ClaimRate> {
    let store = Store::connect(url)
        .await
        .with_context(|| format!("connecting to {url}"))?;
    let token = store.create_token("bench-claims", Tier::Team).await?;
    let account = store
        .authenticate(&token)
        .await?
        .context("the fresh token does not authenticate")?;
    let rate = shoal_store::measure_claims(
        &store,
        account.id,
        args.claim_cells,
        args.claimers,
        args.claim_batch,
    )
    .await;
    crate::up::close_store(store).await;
    let rate = rate?;
    eprintln!(
        "claims on {}: {:.0}/s ({} cells, {} claimers, batch {})",
        rate.backend, rate.claims_per_second, rate.cells, rate.claimers, rate.batch
    );
    Ok(rate)
}

/// The Slurm cluster of `SLURM_CONF`, with its controller's log.
struct SlurmRun {
    dir: PathBuf,
    version: String,
}

impl SlurmRun {
    fn new() -> Result<Self> {
        std::env::var_os("SLURM_CONF")
            .context("SLURM_CONF is not set: run under scripts/with-slurm")?;
        let dir = PathBuf::from(
            std::env::var_os("SHOAL_SLURM_DIR")
                .context("SHOAL_SLURM_DIR is not set: run under scripts/with-slurm")?,
        );
        let version = std::process::Command::new("sbatch")
            .arg("--version")
            .output()
            .context("running sbatch --version")?;
        Ok(SlurmRun {
            dir,
            version: String::from_utf8_lossy(&version.stdout).trim().to_owned(),
        })
    }

    async fn run(&self, tasks: u32, throttle: u32) -> Result<Run> {
        let work = tempfile_dir("shoal-bench-slurm")?;
        let result = self.run_in(&work, tasks, throttle).await;
        let _ = std::fs::remove_dir_all(&work);
        result
    }

    async fn run_in(&self, work: &Path, tasks: u32, throttle: u32) -> Result<Run> {
        std::fs::write(work.join("task.py"), TASK_PY)?;
        std::fs::create_dir_all(work.join("stamps"))?;
        // The stamps bracket the command as Shoal's `run` phase does.
        let script = format!(
            "#!/bin/sh\n\
             s=$(date +%s.%N)\n\
             python3 {work}/task.py \"$SLURM_ARRAY_TASK_ID\" {work}/out\n\
             rc=$?\n\
             e=$(date +%s.%N)\n\
             echo \"$s $e\" > {work}/stamps/$SLURM_ARRAY_TASK_ID\n\
             exit $rc\n",
            work = work.display()
        );
        std::fs::write(work.join("job.sh"), script)?;
        let submitted = unix_now();
        let output = tokio::process::Command::new("sbatch")
            .arg("--parsable")
            .arg(format!("--array=0-{}%{throttle}", tasks - 1))
            .arg("--job-name=shoal-bench")
            .arg(format!("--output={}/slurm-%a.out", work.display()))
            .arg(format!("--chdir={}", work.display()))
            .arg(work.join("job.sh"))
            .output()
            .await
            .context("running sbatch")?;
        ensure!(
            output.status.success(),
            "sbatch failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let array_id = String::from_utf8_lossy(&output.stdout)
            .trim()
            .split(';')
            .next()
            .unwrap_or_default()
            .to_owned();
        ensure!(!array_id.is_empty(), "sbatch printed no job id");

        // Done when every task's completion is in the controller's log.
        let deadline = Instant::now() + Duration::from_secs(3600);
        let (allocated, completed) = loop {
            let log = std::fs::read_to_string(self.dir.join("slurmctld.log"))?;
            let (allocated, completed) = slurm_events(&log, &array_id)?;
            if completed.len() as u32 >= tasks {
                break (allocated, completed);
            }
            ensure!(
                Instant::now() < deadline,
                "the Slurm array did not finish in an hour"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        };

        let mut overhead_ms = Vec::new();
        let mut run_ms = Vec::new();
        let mut first_start = f64::MAX;
        for task in 0..tasks {
            let stamps = std::fs::read_to_string(work.join(format!("stamps/{task}")))
                .with_context(|| format!("task {task} left no stamps"))?;
            let mut parts = stamps.split_whitespace().map(str::parse::<f64>);
            let (Some(Ok(start)), Some(Ok(end))) = (parts.next(), parts.next()) else {
                bail!("task {task}: stamps {stamps:?}");
            };
            let result = std::fs::read_to_string(work.join(format!("out/{task}.txt")))
                .with_context(|| format!("task {task} wrote no result"))?;
            ensure!(
                result == expected_result(task),
                "task {task} wrote {result:?}"
            );
            let slot = completed[&task] - allocated.get(&task).context("no allocation")?;
            run_ms.push((end - start) * 1000.0);
            overhead_ms.push((slot - (end - start)) * 1000.0);
            first_start = first_start.min(start);
        }
        let last_end = completed.values().cloned().fold(f64::MIN, f64::max);
        Ok(Run {
            makespan_s: last_end - submitted,
            first_task_s: first_start - submitted,
            overhead_ms,
            run_ms,
            phases: BTreeMap::new(),
        })
    }
}

/// From slurmctld's log: when each task of `array_id` was allocated and when
/// it completed, by task id (Unix seconds, millisecond stamps).
fn slurm_events(log: &str, array_id: &str) -> Result<(BTreeMap<u32, f64>, BTreeMap<u32, f64>)> {
    let mut allocated = BTreeMap::new();
    let mut completed = BTreeMap::new();
    let needle = format!("JobId={array_id}_");
    for line in log.lines() {
        let Some(at) = line.find(&needle) else {
            continue;
        };
        let started = line.contains("sched: Allocate ") || line.contains("Started JobId=");
        let done = line.contains("_job_complete: ") && line.trim_end().ends_with(" done");
        if !started && !done {
            continue;
        }
        let rest = &line[at + needle.len()..];
        let task: u32 = rest
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap_or_default()
            .parse()
            .with_context(|| format!("task id in {line:?}"))?;
        let stamp = line
            .strip_prefix('[')
            .and_then(|l| l.split_once(']'))
            .map(|(t, _)| t)
            .with_context(|| format!("no time in {line:?}"))?;
        let time = chrono::NaiveDateTime::parse_from_str(stamp, "%Y-%m-%dT%H:%M:%S%.3f")
            .with_context(|| format!("time {stamp:?}"))?
            .and_local_timezone(chrono::Local)
            .single()
            .with_context(|| format!("ambiguous local time {stamp:?}"))?;
        let seconds = time.timestamp_millis() as f64 / 1000.0;
        // A requeued task: its last allocation and completion count.
        if started {
            allocated.insert(task, seconds);
        } else {
            completed.insert(task, seconds);
        }
    }
    Ok((allocated, completed))
}

/// A running `shoal up`.
struct ShoalRun {
    http: reqwest::Client,
    base: String,
    auth: String,
    template: String,
}

impl ShoalRun {
    async fn get(&self, path: &str) -> Result<Value> {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
            .header("Authorization", &self.auth)
            .send()
            .await?;
        let status = response.status();
        let body: Value = response.json().await?;
        ensure!(status == 200, "GET {path} answered {status}: {body}");
        Ok(body)
    }

    async fn run(&self, tasks: u32, throttle: u32) -> Result<Run> {
        let body = json!({
            "name": "shoal-bench",
            "template": self.template,
            "command": "python3 /work/task.py {cell} /work/out",
            "cells": {"start": 0, "end": tasks - 1, "step": 1},
            "workdir": "/work",
            "throttle": throttle,
            "timeout_seconds": 600,
            "collect": ["/work/out/*.txt"],
            "files": {"/work/task.py": base64::engine::general_purpose::STANDARD.encode(TASK_PY)},
        });
        let submitted = unix_now();
        let response = self
            .http
            .post(format!("{}/v1/sweeps", self.base))
            .header("Authorization", &self.auth)
            .json(&body)
            .send()
            .await?;
        let status = response.status();
        let sweep: Value = response.json().await?;
        ensure!(status == 201, "POST /v1/sweeps answered {status}: {sweep}");
        let id = sweep["id"].as_str().context("no sweep id")?.to_owned();

        let deadline = Instant::now() + Duration::from_secs(3600);
        loop {
            let sweep = self.get(&format!("/v1/sweeps/{id}")).await?;
            match sweep["state"].as_str() {
                Some("done") => break,
                Some("active" | "held") => {}
                other => bail!("sweep {id} ended {other:?}: {sweep}"),
            }
            ensure!(
                Instant::now() < deadline,
                "sweep {id} did not finish in an hour"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }

        let mut run = Run {
            makespan_s: 0.0,
            first_task_s: f64::MAX,
            overhead_ms: Vec::new(),
            run_ms: Vec::new(),
            phases: BTreeMap::new(),
        };
        let mut last_end = f64::MIN;
        for index in 0..tasks {
            let cell = self.get(&format!("/v1/sweeps/{id}/cells/{index}")).await?;
            ensure!(
                cell["state"] == "succeeded",
                "cell {index} ended {}: {}",
                cell["state"],
                cell["error"]
            );
            let path = format!("/work/out/{index}.txt");
            let result = cell["collected"][&path]
                .as_str()
                .with_context(|| format!("cell {index} collected no {path}"))?;
            let result = base64::engine::general_purpose::STANDARD.decode(result)?;
            ensure!(
                result == expected_result(index).as_bytes(),
                "cell {index} wrote {:?}",
                String::from_utf8_lossy(&result)
            );
            let timings = &cell["timings_ms"];
            let phase = |name: &str| timings[name].as_f64().unwrap_or(0.0);
            for name in ["create", "exec", "run", "collect", "delete"] {
                run.phases
                    .entry(name.to_owned())
                    .or_default()
                    .push(phase(name));
            }
            run.overhead_ms
                .push(phase("create") + phase("exec") + phase("collect") + phase("delete"));
            run.run_ms.push(phase("run"));
            let started = rfc3339(&cell["started_at"])?;
            run.first_task_s = run
                .first_task_s
                .min(started + (phase("create") + phase("exec")) / 1000.0 - submitted);
            last_end = last_end.max(rfc3339(&cell["finished_at"])?);
        }
        run.makespan_s = last_end - submitted;
        Ok(run)
    }
}

fn rfc3339(value: &Value) -> Result<f64> {
    let text = value
        .as_str()
        .with_context(|| format!("not a time: {value}"))?;
    let time =
        chrono::DateTime::parse_from_rfc3339(text).with_context(|| format!("time {text:?}"))?;
    Ok(time.timestamp_micros() as f64 / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_allocations_and_completions_of_one_array() {
        let log = "\
[2026-12-04T03:56:10.002] sched: Allocate JobId=1_0(2) NodeList=vm #CPUs=1 Partition=bench
[2026-12-04T03:56:10.004] sched: Allocate JobId=7_1(9) NodeList=vm #CPUs=1 Partition=bench
[2026-12-04T03:56:10.346] _job_complete: JobId=1_0(2) WEXITSTATUS 0
[2026-12-04T03:56:10.346] _job_complete: JobId=1_0(2) done
[2026-12-04T03:56:11.500] sched/backfill: _start_job: Started JobId=1_12(14) in bench on vm
[2026-12-04T03:56:12.000] _job_complete: JobId=1_12(14) done
";
        let (allocated, completed) = slurm_events(log, "1").unwrap();
        assert_eq!(allocated.keys().collect::<Vec<_>>(), [&0, &12]);
        assert_eq!(completed.keys().collect::<Vec<_>>(), [&0, &12]);
        let slot = completed[&0] - allocated[&0];
        assert!((slot - 0.344).abs() < 1e-6, "{slot}");
        assert!((completed[&12] - allocated[&12] - 0.5).abs() < 1e-6);
    }

    #[test]
    fn the_expected_result_is_the_pythons() {
        assert_eq!(expected_result(3), "3 333328333350000\n");
    }
}
