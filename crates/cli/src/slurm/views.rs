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
                // The script's own run time when the runner measured it
                // (not the wait for a sandbox or a warm-start prelude).
                (Some(_), Some(_), _) if cell["elapsed_ms"].is_u64() => {
                    (cell["elapsed_ms"].as_u64().unwrap_or(0) as i64 + 500) / 1000
                }
                (Some(s), Some(e), _) => (e - s).max(0),
                (Some(s), None, JobState::Running) => (now() - s).max(0),
                _ => 0,
            };
            let reason = (state == JobState::Pending).then(|| {
                if held {
                    // Dependency, JobHeldUser or BeginTime, as the API says.
                    sweep["reason"].as_str().unwrap_or("Dependency")
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
                // Slurm's OUT_OF_MEMORY is `0:125`, whatever the script's code.
                exit_code: if state == JobState::OutOfMemory {
                    0
                } else {
                    cell["exit_code"].as_i64().unwrap_or(0) as i32
                },
                signal: if state == JobState::OutOfMemory {
                    125
                } else {
                    cell["signal"].as_i64().unwrap_or(0) as i32
                },
                elapsed: Duration::from_secs(elapsed as u64),
                alloc_cpus,
                req_mem_mib: slurm["mem_mib"].as_u64(),
                // The task's processes' peak and CPU time, as the guest
                // agent measured them; a cell run by an older agent has
                // only its VM's CPU time.
                max_rss_bytes: cell["max_rss_kib"].as_u64().map(|k| k * 1024),
                total_cpu: cell["task_cpu_ms"]
                    .as_u64()
                    .map(Duration::from_millis)
                    .or_else(|| cell["cpu_seconds"].as_f64().map(Duration::from_secs_f64)),
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

pub(super) async fn vcpus_by_template(api: &Api) -> BTreeMap<String, u32> {
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
pub(super) async fn resolve(api: &Api, job_id: u64) -> Result<Option<(Value, Option<u64>)>> {
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

/// Whether a sweep is still in the queue (held or active): what squeue,
/// `scontrol show job` and scancel's filters look at.
fn is_queued(sweep: &Value) -> bool {
    matches!(sweep["state"].as_str(), Some("held" | "active"))
}

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
    /// `-o`/`-O`: the columns asked for; `None`: squeue's default.
    pub columns: Option<Vec<shoal_slurm::squeue_format::Piece>>,
}

/// `shoal squeue`.
pub async fn squeue(api: &Api, query: &SqueueQuery) -> Result<()> {
    let vcpus = vcpus_by_template(api).await;
    let mut all = Vec::new();
    let mut sweeps = api.sweeps().await?;
    sweeps.reverse(); // oldest first, as squeue sorts by job id
    for s in sweeps {
        if !is_queued(&s) {
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
    let text = match (&query.columns, query.one_per_task) {
        (Some(columns), unfolded) => shoal_slurm::format_squeue_custom(&all, columns, !unfolded),
        (None, true) => shoal_slurm::format_squeue_unfolded(&all),
        (None, false) => shoal_slurm::format_squeue(&all),
    };
    if query.noheader {
        print!("{}", text.split_once('\n').map_or("", |(_, rest)| rest));
    } else {
        print!("{text}");
    }
    Ok(())
}

/// How `shoal sacct` chooses and prints.
pub struct SacctArgs {
    pub jobs: Vec<String>,
    pub format: Option<String>,
    pub parsable: bool,
    pub parsable2: bool,
    pub noheader: bool,
    pub starttime: Option<String>,
    pub endtime: Option<String>,
    pub state: Option<String>,
    pub name: Option<String>,
    pub long: bool,
}

/// A time as sacct's `-S`/`-E` take it, in unix seconds (local time):
/// `YYYY-MM-DD[THH:MM[:SS]]`, `HH:MM[:SS]` (today), `now[-N[unit]]`
/// (`now-2hours`, `now-3days`; a bare number is seconds), `today`,
/// `midnight` (00:00 today), `noon`.
pub fn parse_sacct_time(value: &str, now: chrono::DateTime<chrono::Local>) -> Result<i64> {
    use chrono::{Local, NaiveDate, NaiveDateTime, NaiveTime, TimeZone};
    let v = value.trim();
    let lower = v.to_ascii_lowercase();
    let at_today = |t: NaiveTime| {
        Local
            .from_local_datetime(&now.date_naive().and_time(t))
            .earliest()
            .map(|d| d.timestamp())
    };
    let found = match lower.as_str() {
        "now" => Some(now.timestamp()),
        "today" | "midnight" => at_today(NaiveTime::MIN),
        "noon" => at_today(NaiveTime::from_hms_opt(12, 0, 0).expect("noon")),
        _ if lower.starts_with("now-") || lower.starts_with("now+") => {
            let sign = if lower.as_bytes()[3] == b'-' { -1 } else { 1 };
            let rest = &lower[4..];
            let digits = rest
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len());
            let n: i64 = rest[..digits].parse().ok().unwrap_or(-1);
            let unit = match &rest[digits..] {
                "" | "s" | "sec" | "secs" | "second" | "seconds" => Some(1),
                "m" | "min" | "mins" | "minute" | "minutes" => Some(60),
                "h" | "hour" | "hours" => Some(3600),
                "d" | "day" | "days" => Some(86_400),
                "w" | "week" | "weeks" => Some(7 * 86_400),
                _ => None,
            };
            unit.filter(|_| n >= 0)
                .map(|u| now.timestamp() + sign * n * u)
        }
        _ => {
            let datetime = ["%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M"]
                .iter()
                .find_map(|f| NaiveDateTime::parse_from_str(v, f).ok())
                .or_else(|| {
                    NaiveDate::parse_from_str(v, "%Y-%m-%d")
                        .ok()
                        .map(|d| d.and_time(NaiveTime::MIN))
                });
            match datetime {
                Some(dt) => Local
                    .from_local_datetime(&dt)
                    .earliest()
                    .map(|d| d.timestamp()),
                None => ["%H:%M:%S", "%H:%M"]
                    .iter()
                    .find_map(|f| NaiveTime::parse_from_str(v, f).ok())
                    .and_then(at_today),
            }
        }
    };
    found.with_context(|| {
        format!(
            "sacct: error: invalid time {value:?}: use YYYY-MM-DD[THH:MM[:SS]], HH:MM[:SS], \
             now[-N{{seconds|minutes|hours|days|weeks}}], today, midnight or noon"
        )
    })
}

/// `shoal sacct`: the named jobs, or every job of the last day.
pub async fn sacct(api: &Api, args: &SacctArgs) -> Result<()> {
    let fields = match (&args.format, args.long) {
        (Some(f), _) => shoal_slurm::parse_format(f)?,
        (None, true) => shoal_slurm::long_sacct_fields(),
        (None, false) => shoal_slurm::default_sacct_fields(),
    };
    let local_now = chrono::Local::now();
    let start = args
        .starttime
        .as_deref()
        .map(|t| parse_sacct_time(t, local_now))
        .transpose()?;
    let end = args
        .endtime
        .as_deref()
        .map(|t| parse_sacct_time(t, local_now))
        .transpose()?;
    let states = args
        .state
        .as_deref()
        .map(shoal_slurm::parse_states)
        .transpose()?;
    let names: Option<Vec<&str>> = args.name.as_deref().map(|n| n.split(',').collect());
    let vcpus = vcpus_by_template(api).await;
    let mut all = Vec::new();
    if args.jobs.is_empty() {
        // sacct's default window: from 00:00 today.
        let since = match start {
            Some(s) => s,
            None => parse_sacct_time("midnight", local_now)?,
        };
        let mut sweeps = api.sweeps().await?;
        sweeps.reverse();
        for s in sweeps {
            let finished = unix(&s["finished_at"]);
            if finished.is_none_or(|t| t >= since) {
                let cells = api.cells(s["id"].as_str().unwrap_or("")).await?;
                all.extend(records(&s, &cells, &vcpus));
            }
        }
        all.retain(|r| shoal_slurm::within_window(r, Some(since), end, local_now.timestamp()));
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
    if !args.jobs.is_empty() && (start.is_some() || end.is_some()) {
        all.retain(|r| shoal_slurm::within_window(r, start, end, local_now.timestamp()));
    }
    if let Some(states) = &states {
        all.retain(|r| states.contains(&r.state));
    }
    if let Some(names) = &names {
        all.retain(|r| names.contains(&r.name.as_str()));
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

/// `shoal scontrol`: `show job ID[_TASK]`, `requeue ID`, `update JobId=ID
/// ArrayTaskThrottle=N`, `hold ID` and `release ID` (whole jobs).
pub async fn scontrol(api: &Api, words: &[String]) -> Result<()> {
    let lower: Vec<String> = words.iter().map(|w| w.to_ascii_lowercase()).collect();
    let words_of = |from: usize| words[from..].to_vec();
    match lower
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["show", "job" | "jobs", rest @ ..] => {
            let vcpus = vcpus_by_template(api).await;
            let targets = if rest.is_empty() {
                api.sweeps()
                    .await?
                    .iter()
                    .filter(|s| is_queued(s))
                    .filter_map(|s| s["job_id"].as_u64().map(|j| j.to_string()))
                    .collect()
            } else {
                words_of(2)
            };
            let offset = chrono::Local::now().offset().local_minus_utc();
            for target in targets {
                let job = shoal_slurm::parse_job_ref(&target)?;
                let Some((sweep, index)) = resolve(api, job.job_id).await? else {
                    bail!("slurm_load_jobs error: Invalid job id specified");
                };
                let cells = api.cells(sweep["id"].as_str().unwrap_or("")).await?;
                let mut recs = records(&sweep, &cells, &vcpus);
                if index.is_some() {
                    recs.retain(|r| r.job_id == job.job_id);
                }
                if let Some(t) = job.task_id {
                    recs.retain(|r| r.task_id == Some(t));
                }
                let slurm = &sweep["slurm"];
                let text = |v: &Value| v.as_str().unwrap_or("(null)").to_owned();
                let extra = [
                    ("Command", text(&sweep["command"])),
                    ("WorkDir", text(&slurm["work_dir"])),
                    ("StdOut", text(&slurm["output"])),
                    ("StdErr", text(&slurm["error"])),
                ];
                print!(
                    "{}",
                    shoal_slurm::format_scontrol_job(&recs, &extra, offset)
                );
            }
            Ok(())
        }
        ["requeue", ..] if words.len() > 1 => {
            for target in words_of(1) {
                let job = shoal_slurm::parse_job_ref(&target)?;
                let Some((sweep, _)) = resolve(api, job.job_id).await? else {
                    bail!("Invalid job id specified: {target}");
                };
                api.requeue(sweep["id"].as_str().unwrap_or(""))
                    .await
                    .with_context(|| format!("requeueing job {target}"))?;
            }
            Ok(())
        }
        ["update", ..] => {
            let mut job = None;
            let mut throttle = None;
            for word in words_of(1) {
                let (key, value) = word
                    .split_once('=')
                    .with_context(|| format!("Invalid input: {word}: expected KEY=VALUE"))?;
                match key.to_ascii_lowercase().as_str() {
                    "jobid" => job = Some(shoal_slurm::parse_job_ref(value)?),
                    "arraytaskthrottle" => {
                        throttle = Some(value.parse::<u64>().with_context(|| {
                            format!("Invalid ArrayTaskThrottle {value:?}: a number of tasks")
                        })?)
                    }
                    _ => bail!(
                        "scontrol update {key}=... is not supported on Shoal: only \
                         ArrayTaskThrottle (the --array %N) can change"
                    ),
                }
            }
            let job = job.context("scontrol update needs JobId=ID")?;
            let throttle = throttle.context("scontrol update needs ArrayTaskThrottle=N")?;
            let Some((sweep, _)) = resolve(api, job.job_id).await? else {
                bail!("Invalid job id specified: {}", job.job_id);
            };
            api.set_throttle(sweep["id"].as_str().unwrap_or(""), throttle)
                .await
                .context("updating the throttle")?;
            Ok(())
        }
        ["hold" | "release", ..] if words.len() > 1 => {
            for target in words_of(1) {
                let job = shoal_slurm::parse_job_ref(&target)?;
                if job.task_id.is_some() {
                    bail!(
                        "scontrol {}: Shoal holds whole jobs: use {}, not {target}",
                        lower[0],
                        job.job_id
                    );
                }
                let Some((sweep, _)) = resolve(api, job.job_id).await? else {
                    bail!("Invalid job id specified: {target}");
                };
                api.hold(sweep["id"].as_str().unwrap_or(""), &lower[0])
                    .await
                    .with_context(|| format!("scontrol {} {target}", lower[0]))?;
            }
            Ok(())
        }
        _ => bail!(
            "scontrol: {}: Shoal's scontrol knows `show job [ID]`, `hold ID`, `release ID`, \
             `requeue ID` and `update JobId=ID ArrayTaskThrottle=N`",
            words.join(" ")
        ),
    }
}

/// `scancel` without job ids: the filters choose (`-u`, `-n`, `-t`).
pub struct ScancelFilter {
    pub user: Option<String>,
    pub name: Option<String>,
    pub states: Option<Vec<shoal_slurm::JobState>>,
}

/// `shoal scancel -u USER / -n NAME / -t STATES`: every queued job that
/// matches all the filters given, or, with `-t`, only its tasks in those
/// states (`scancel -t PENDING` leaves running tasks be).
pub async fn scancel_matching(api: &Api, filter: &ScancelFilter) -> Result<()> {
    if filter.user.is_none() && filter.name.is_none() && filter.states.is_none() {
        bail!("scancel: error: No job identification provided");
    }
    let vcpus = vcpus_by_template(api).await;
    for s in api.sweeps().await? {
        if !is_queued(&s) {
            continue;
        }
        if filter
            .user
            .as_ref()
            .is_some_and(|u| s["slurm"]["user"].as_str() != Some(u.as_str()))
        {
            continue;
        }
        let name = s["slurm"]["job_name"].as_str().or(s["name"].as_str());
        if filter
            .name
            .as_ref()
            .is_some_and(|n| name != Some(n.as_str()))
        {
            continue;
        }
        let id = s["id"].as_str().unwrap_or("").to_owned();
        let Some(states) = &filter.states else {
            api.cancel(&id, None)
                .await
                .with_context(|| format!("cancelling job {}", s["job_id"]))?;
            continue;
        };
        let first = s["job_id"].as_u64().unwrap_or(0);
        let cells = api.cells(&id).await?;
        let indexes: Vec<u64> = records(&s, &cells, &vcpus)
            .iter()
            .filter(|r| states.contains(&r.state))
            .map(|r| r.job_id - first)
            .collect();
        if !indexes.is_empty() {
            api.cancel(&id, Some(&indexes))
                .await
                .with_context(|| format!("cancelling tasks of job {first}"))?;
        }
    }
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

/// `scancel --signal=SIG`: sends SIG to every process of each running task
/// the ids (or, without ids, the filters) name, instead of cancelling. The
/// signal goes through the sandbox's exec route (`kill -s SIG -1`: every
/// process but the guest's init), so the task's batch shell gets it too,
/// as with scancel's `--full`. Returns how many tasks were signalled.
pub async fn signal_tasks(
    api: &Api,
    targets: &[String],
    filter: &ScancelFilter,
    signal: &str,
) -> Result<usize> {
    let (_, name) = shoal_slurm::signal_number(signal)?;
    let mut chosen: Vec<(Value, Vec<Value>)> = Vec::new();
    if targets.is_empty() {
        for s in api.sweeps().await? {
            if !is_queued(&s) {
                continue;
            }
            let user_ok = filter
                .user
                .as_ref()
                .is_none_or(|u| s["slurm"]["user"].as_str() == Some(u.as_str()));
            let job_name = s["slurm"]["job_name"].as_str().or(s["name"].as_str());
            let name_ok = filter
                .name
                .as_ref()
                .is_none_or(|n| job_name == Some(n.as_str()));
            if user_ok && name_ok {
                let cells = api.cells(s["id"].as_str().unwrap_or("")).await?;
                chosen.push((s, cells));
            }
        }
    } else {
        for target in targets {
            let refs = shoal_slurm::parse_job_refs(target)?;
            let Some(first) = refs.first() else { continue };
            let Some((sweep, own_index)) = resolve(api, first.job_id).await? else {
                bail!(
                    "scancel: error: Kill job error on job id {target}: Invalid job id specified"
                );
            };
            let tasks: Vec<String> = refs
                .iter()
                .filter_map(|r| r.task_id.map(|t| t.to_string()))
                .collect();
            let cells = api
                .cells(sweep["id"].as_str().unwrap_or(""))
                .await?
                .into_iter()
                .filter(|c| {
                    own_index.is_none_or(|i| c["index"].as_u64() == Some(i))
                        && (tasks.is_empty()
                            || tasks.iter().any(|t| c["value"].as_str() == Some(t)))
                })
                .collect();
            chosen.push((sweep, cells));
        }
    }
    let mut signalled = 0;
    for (_, cells) in chosen {
        for cell in cells {
            let (Some("running"), Some(sandbox)) =
                (cell["state"].as_str(), cell["sandbox_id"].as_str())
            else {
                continue;
            };
            api.call(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{sandbox}/exec"),
                Some(&serde_json::json!({ "cmd": format!("kill -s {name} -- -1"), "timeout_seconds": 30 })),
            )
            .await
            .with_context(|| format!("signalling task {} ({sandbox})", cell["job_id"]))?;
            signalled += 1;
        }
    }
    Ok(signalled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sacct_times_take_sacct_s_forms() {
        use chrono::TimeZone as _;
        let now = chrono::Local
            .with_ymd_and_hms(2026, 12, 7, 15, 30, 0)
            .single()
            .unwrap();
        let at = |y, mo, d, h, mi, s| {
            chrono::Local
                .with_ymd_and_hms(y, mo, d, h, mi, s)
                .single()
                .unwrap()
                .timestamp()
        };
        let t = |v: &str| parse_sacct_time(v, now).unwrap();
        assert_eq!(t("now"), now.timestamp());
        assert_eq!(t("now-2hours"), now.timestamp() - 7200);
        assert_eq!(t("now-3days"), now.timestamp() - 3 * 86_400);
        assert_eq!(t("now-90"), now.timestamp() - 90);
        assert_eq!(t("midnight"), at(2026, 12, 7, 0, 0, 0));
        assert_eq!(t("today"), at(2026, 12, 7, 0, 0, 0));
        assert_eq!(t("noon"), at(2026, 12, 7, 12, 0, 0));
        assert_eq!(t("2026-12-01"), at(2026, 12, 1, 0, 0, 0));
        assert_eq!(t("2026-12-01T08:15"), at(2026, 12, 1, 8, 15, 0));
        assert_eq!(t("2026-12-01T08:15:09"), at(2026, 12, 1, 8, 15, 9));
        assert_eq!(t("09:45"), at(2026, 12, 7, 9, 45, 0));
        for bad in ["yesterday-ish", "now-3fortnights", "2026-13-01", "25:00"] {
            let e = parse_sacct_time(bad, now).unwrap_err().to_string();
            assert!(e.contains("invalid time"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_sacct_window_keeps_what_overlaps_it() {
        let job = |submit, start, end| shoal_slurm::JobRecord {
            submit: Some(submit),
            start,
            end,
            ..Default::default()
        };
        let within = |r: &shoal_slurm::JobRecord, s, e| shoal_slurm::within_window(r, s, e, 1000);
        let ran = job(100, Some(110), Some(200));
        assert!(within(&ran, Some(150), None));
        assert!(!within(&ran, Some(201), None), "ended before the window");
        assert!(!within(&ran, None, Some(105)), "started after the window");
        let running = job(100, Some(110), None);
        assert!(
            within(&running, Some(900), None),
            "still running: until now"
        );
        let pending = job(500, None, None);
        assert!(
            within(&pending, Some(600), Some(700)),
            "waiting through the window"
        );
        assert!(
            !within(&pending, None, Some(400)),
            "submitted after the window"
        );
    }
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
