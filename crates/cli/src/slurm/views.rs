//! `shoal squeue`, `shoal sacct` and `shoal scancel`: sweeps and cells
//! read through the API, turned into `shoal_slurm::JobRecord`s and printed
//! by `shoal_slurm`'s formatters.
//!
//! Owns: the mapping of a sweep and its cells to job records (state,
//! exit code, times, node, pending reason, cost), and of `ID_TASK` to a
//! cell for scancel.
//! May not: format columns itself or change jobs other than by cancel.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use shoal_slurm::{JobRecord, JobState, SacctOptions, SacctStyle, TimeLimit};
use std::collections::BTreeMap;
use std::time::Duration;

use super::api::Api;

fn unix(v: &Value) -> Option<i64> {
    chrono::DateTime::parse_from_rfc3339(v.as_str()?)
        .ok()
        .map(|t| t.timestamp())
}

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

/// A cell's state in Slurm's spelling.
fn job_state(cell: &Value) -> JobState {
    match cell["state"].as_str().unwrap_or("") {
        "pending" => JobState::Pending,
        "running" => JobState::Running,
        "succeeded" => JobState::Completed,
        "timeout" => JobState::Timeout,
        "cancelled" => JobState::Cancelled,
        // The runner's error for a VM killed for memory (the engine's
        // `OUT_OF_MEMORY`).
        "failed" if cell["error"] == "out of memory" => JobState::OutOfMemory,
        _ => JobState::Failed,
    }
}

/// The records of one sweep's tasks. `vcpus`: template name → vCPUs.
pub fn records(sweep: &Value, cells: &[Value], vcpus: &BTreeMap<String, u32>) -> Vec<JobRecord> {
    let slurm = &sweep["slurm"];
    let is_array = slurm.is_null() || !slurm["array"].is_null();
    let text = |k: &str| slurm[k].as_str().map(str::to_owned);
    let template = sweep["template"].as_str().unwrap_or("").to_owned();
    let alloc_cpus = slurm["vcpus"]
        .as_u64()
        .map(|n| n as u32)
        .or_else(|| vcpus.get(&template).copied())
        .unwrap_or(1);
    let running = sweep["counts"]["running"].as_u64().unwrap_or(0);
    let throttle = sweep["throttle"].as_u64().unwrap_or(u64::MAX);
    let held = sweep["state"] == "held";
    cells
        .iter()
        .map(|cell| {
            let state = job_state(cell);
            let start = unix(&cell["started_at"]);
            let end = unix(&cell["finished_at"]);
            let elapsed = match (start, end, state) {
                (Some(s), Some(e), _) => (e - s).max(0),
                (Some(s), None, JobState::Running) => (now() - s).max(0),
                _ => 0,
            };
            let reason = (state == JobState::Pending).then(|| {
                if held {
                    "Dependency"
                } else if running >= throttle {
                    "JobArrayTaskLimit"
                } else {
                    "Resources"
                }
                .to_owned()
            });
            JobRecord {
                job_id: cell["job_id"].as_u64().unwrap_or(0),
                array_job_id: is_array.then(|| sweep["job_id"].as_u64().unwrap_or(0)),
                task_id: if is_array {
                    cell["value"]
                        .as_str()
                        .and_then(|v| v.parse().ok())
                        .or(cell["index"].as_u64().map(|i| i as u32))
                } else {
                    None
                },
                name: text("job_name")
                    .unwrap_or_else(|| sweep["name"].as_str().unwrap_or("").into()),
                user: text("user").unwrap_or_default(),
                partition: text("partition").unwrap_or_else(|| template.clone()),
                account: text("account"),
                state,
                exit_code: cell["exit_code"].as_i64().unwrap_or(0) as i32,
                signal: cell["signal"].as_i64().unwrap_or(0) as i32,
                elapsed: Duration::from_secs(elapsed as u64),
                alloc_cpus,
                req_mem_mib: slurm["mem_mib"].as_u64(),
                max_rss_bytes: None,
                total_cpu: cell["cpu_seconds"].as_f64().map(Duration::from_secs_f64),
                cost_usd: cell["cost_usd"].as_f64(),
                submit: unix(&sweep["created_at"]),
                start,
                end,
                time_limit: sweep["timeout_seconds"]
                    .as_u64()
                    .map(|s| TimeLimit::Limit(Duration::from_secs(s))),
                node: cell["sandbox_id"].as_str().map(str::to_owned),
                reason,
                restarts: (cell["attempts"].as_u64().unwrap_or(1).max(1) - 1) as u32,
            }
        })
        .collect()
}

async fn vcpus_by_template(api: &Api) -> BTreeMap<String, u32> {
    api.templates()
        .await
        .unwrap_or_default()
        .iter()
        .filter_map(|t| Some((t["name"].as_str()?.to_owned(), t["cpu"].as_u64()? as u32)))
        .collect()
}

/// The sweep a job id names: the array's own id, or (like Slurm) the job
/// id of one of its tasks. Returns the sweep and, for a task's id, its
/// cell index.
async fn resolve(api: &Api, job_id: u64) -> Result<Option<(Value, Option<u64>)>> {
    if let Some(s) = api.sweep(&job_id.to_string()).await? {
        return Ok(Some((s, None)));
    }
    for s in api.sweeps().await? {
        let first = s["job_id"].as_u64().unwrap_or(0);
        let total = s["total"].as_u64().unwrap_or(0);
        if (first..first + total).contains(&job_id) {
            return Ok(Some((s, Some(job_id - first))));
        }
    }
    Ok(None)
}

/// `shoal squeue`: the caller's pending and running tasks.
/// What `shoal squeue` shows.
pub struct SqueueQuery {
    /// `-j`: jobs (all their tasks) or single tasks; none: all.
    pub jobs: Vec<shoal_slurm::JobRef>,
    /// `-u`.
    pub user: Option<String>,
    /// `-t`; `None`: the pending and running states, as squeue.
    pub states: Option<Vec<shoal_slurm::JobState>>,
    /// `-h`.
    pub noheader: bool,
    /// `-r`: pending array tasks one per line, not folded into `ID_[a-b]`.
    pub one_per_task: bool,
}

/// `shoal squeue`.
pub async fn squeue(api: &Api, query: &SqueueQuery) -> Result<()> {
    let vcpus = vcpus_by_template(api).await;
    let mut all = Vec::new();
    let mut sweeps = api.sweeps().await?;
    sweeps.reverse(); // oldest first, as squeue sorts by job id
    for s in sweeps {
        if !matches!(s["state"].as_str(), Some("held" | "active")) {
            continue;
        }
        let id = s["job_id"].as_u64().unwrap_or(0);
        if let Some(u) = &query.user {
            if s["slurm"]["user"].as_str() != Some(u.as_str()) {
                continue;
            }
        }
        let cells = api.cells(&id.to_string()).await?;
        all.extend(records(&s, &cells, &vcpus));
    }
    all.retain(|r| shoal_slurm::matches_job_refs(r, &query.jobs));
    if let Some(states) = &query.states {
        all.retain(|r| states.contains(&r.state));
    }
    let text = if query.one_per_task {
        shoal_slurm::format_squeue_unfolded(&all)
    } else {
        shoal_slurm::format_squeue(&all)
    };
    if query.noheader {
        print!("{}", text.split_once('\n').map_or("", |(_, rest)| rest));
    } else {
        print!("{text}");
    }
    Ok(())
}

/// How `shoal sacct` prints.
pub struct SacctArgs {
    pub jobs: Vec<String>,
    pub format: Option<String>,
    pub parsable: bool,
    pub parsable2: bool,
    pub noheader: bool,
}

/// `shoal sacct`: the named jobs, or every job of the last day.
pub async fn sacct(api: &Api, args: &SacctArgs) -> Result<()> {
    let fields = match &args.format {
        Some(f) => shoal_slurm::parse_format(f)?,
        None => shoal_slurm::default_sacct_fields(),
    };
    let vcpus = vcpus_by_template(api).await;
    let mut all = Vec::new();
    if args.jobs.is_empty() {
        let since = now() - 86_400;
        let mut sweeps = api.sweeps().await?;
        sweeps.reverse();
        for s in sweeps {
            if unix(&s["created_at"]).is_some_and(|t| t >= since) {
                let cells = api.cells(s["id"].as_str().unwrap_or("")).await?;
                all.extend(records(&s, &cells, &vcpus));
            }
        }
    }
    for arg in args
        .jobs
        .iter()
        .flat_map(|j| j.split(','))
        .filter(|j| !j.is_empty())
    {
        let job = shoal_slurm::parse_job_ref(arg)?;
        let Some((sweep, index)) = resolve(api, job.job_id).await? else {
            continue; // sacct prints nothing for an unknown job
        };
        let cells = api.cells(sweep["id"].as_str().unwrap_or("")).await?;
        let mut recs = records(&sweep, &cells, &vcpus);
        if let Some(i) = index {
            recs.retain(|r| r.job_id == job.job_id && i < cells.len() as u64);
        }
        if let Some(t) = job.task_id {
            recs.retain(|r| r.task_id == Some(t));
        }
        all.extend(recs);
    }
    let style = if args.parsable2 {
        SacctStyle::Parsable2
    } else if args.parsable {
        SacctStyle::Parsable
    } else {
        SacctStyle::Table
    };
    let opts = SacctOptions {
        style,
        noheader: args.noheader,
        utc_offset_seconds: chrono::Local::now().offset().local_minus_utc(),
    };
    print!("{}", shoal_slurm::format_sacct_with(&all, &fields, &opts));
    Ok(())
}

/// `shoal scancel ID[_TASK]...`.
pub async fn scancel(api: &Api, targets: &[String]) -> Result<()> {
    let mut failed = false;
    for target in targets {
        let refs = shoal_slurm::parse_job_refs(target)?;
        let Some(first) = refs.first() else { continue };
        let Some((sweep, own_index)) = resolve(api, first.job_id).await? else {
            eprintln!(
                "scancel: error: Kill job error on job id {target}: Invalid job id specified"
            );
            failed = true;
            continue;
        };
        let id = sweep["id"].as_str().unwrap_or("").to_owned();
        let tasks: Vec<u32> = refs.iter().filter_map(|r| r.task_id).collect();
        if tasks.is_empty() && own_index.is_none() {
            api.cancel(&id, None)
                .await
                .with_context(|| format!("cancelling job {target}"))?;
            continue;
        }
        let indexes: Vec<u64> = if tasks.is_empty() {
            own_index.into_iter().collect()
        } else {
            let cells = api.cells(&id).await?;
            let mut found = Vec::new();
            for t in &tasks {
                match cells
                    .iter()
                    .find(|c| c["value"].as_str() == Some(&t.to_string()))
                {
                    Some(c) => found.push(c["index"].as_u64().unwrap_or(0)),
                    None => {
                        eprintln!(
                            "scancel: error: Kill job error on job id {}_{t}: Invalid job id specified",
                            first.job_id
                        );
                        failed = true;
                    }
                }
            }
            found
        };
        if !indexes.is_empty() {
            api.cancel(&id, Some(&indexes))
                .await
                .with_context(|| format!("cancelling {target}"))?;
        }
    }
    if failed {
        bail!("some jobs were not cancelled");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn cells_take_slurms_state_names() {
        let state = |state: &str, error: Value| job_state(&json!({"state": state, "error": error}));
        assert_eq!(state("succeeded", Value::Null), JobState::Completed);
        assert_eq!(state("failed", json!("exit 1")), JobState::Failed);
        assert_eq!(
            state("failed", json!("out of memory")),
            JobState::OutOfMemory
        );
        assert_eq!(state("timeout", Value::Null), JobState::Timeout);
        assert_eq!(state("pending", Value::Null), JobState::Pending);
    }
}
