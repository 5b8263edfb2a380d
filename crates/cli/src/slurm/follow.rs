//! Writing a job's output files on the submitting machine, as Slurm's
//! nodes write them on a shared filesystem: each task's `--output` and
//! `--error` files (default `slurm-%A_%a.out` / `slurm-%j.out` in the
//! working directory), and the files the task left in its working
//! directory.
//!
//! Owns: the follower (`sbatch --wait`, the background follower `sbatch`
//! starts, and `shoal sync --follow`), and `shoal sync` (write what has
//! finished, once). A task's files are written when it finishes, whole:
//! stdout, then stderr when both go to one file.
//!
//! May not: submit or cancel jobs; decide names (that is
//! `shoal_slurm::output_paths`).

use anyhow::{Context, Result};
use base64::Engine as _;
use serde_json::Value;
use shoal_slurm::PatternContext;
use std::collections::BTreeSet;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::api::Api;

/// How often the follower looks at the job.
const POLL: Duration = Duration::from_millis(1000);
/// The follower gives up after the API has not answered for this long.
const GIVE_UP_AFTER: Duration = Duration::from_secs(600);

/// What a followed job ended as.
#[derive(Debug, Default)]
pub struct Outcome {
    /// The highest exit code of its tasks.
    pub max_exit: i64,
    /// Tasks that failed without an exit code, timed out or were cancelled.
    pub abnormal: usize,
}

impl Outcome {
    /// `sbatch --wait`'s exit code: the job's highest exit code, at least
    /// 1 when a task ended without one.
    pub fn exit_code(&self) -> u8 {
        let code = self.max_exit.clamp(0, 255) as u8;
        if code == 0 && self.abnormal > 0 {
            1
        } else {
            code
        }
    }
}

fn is_finished_cell(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "timeout" | "cancelled")
}

fn is_finished_sweep(state: &str) -> bool {
    matches!(state, "done" | "cancelled")
}

/// Follows job `id` until it is over, writing each task's files as it
/// finishes. `loud`: say on stderr what went wrong with a file.
pub async fn follow(api: &Api, id: &str, loud: bool) -> Result<Outcome> {
    let mut written = BTreeSet::new();
    let mut last_ok = Instant::now();
    loop {
        match pass(api, id, &mut written, loud).await {
            Ok(Some(outcome)) => return Ok(outcome),
            Ok(None) => last_ok = Instant::now(),
            Err(e) if last_ok.elapsed() > GIVE_UP_AFTER => return Err(e),
            Err(e) => {
                if loud {
                    eprintln!("sbatch: {e:#}; retrying");
                }
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

/// One look at the job: writes the files of tasks finished since the last
/// look. `Some` once the job is over and everything is written.
async fn pass(
    api: &Api,
    id: &str,
    written: &mut BTreeSet<u64>,
    loud: bool,
) -> Result<Option<Outcome>> {
    let sweep = api
        .sweep(id)
        .await?
        .with_context(|| format!("Invalid job id specified: {id}"))?;
    let over = is_finished_sweep(sweep["state"].as_str().unwrap_or(""));
    let cells = api.cells(id).await?;
    let mut outcome = Outcome::default();
    for cell in &cells {
        let state = cell["state"].as_str().unwrap_or("");
        if !is_finished_cell(state) {
            continue;
        }
        match (state, cell["exit_code"].as_i64()) {
            ("succeeded" | "failed", Some(code)) => outcome.max_exit = outcome.max_exit.max(code),
            _ => outcome.abnormal += 1,
        }
        let index = cell["index"].as_u64().unwrap_or(0);
        if written.contains(&index) {
            continue;
        }
        let whole = api.cell(id, index).await?;
        if let Err(e) = write_task(&sweep, &whole) {
            if loud {
                eprintln!("sbatch: task {index} of job {id}: {e:#}");
            }
        }
        written.insert(index);
    }
    Ok(over.then_some(outcome))
}

/// `shoal sync`: writes the files of every finished task of the jobs,
/// once (again if they were already written).
pub async fn sync(api: &Api, ids: &[String]) -> Result<()> {
    for id in ids {
        let mut written = BTreeSet::new();
        pass(api, id, &mut written, true).await?;
        println!("job {id}: {} finished task(s) written", written.len());
    }
    Ok(())
}

/// Starts `shoal sync --follow JOB` detached from this terminal (its own
/// process group, no stdin/stdout/stderr), so `sbatch` returns at once as
/// Slurm's does and the files still appear as tasks finish.
pub fn spawn_background(job_id: u64) -> Result<()> {
    let exe = std::env::current_exe().context("locating the shoal binary")?;
    std::process::Command::new(exe)
        .args(["sync", "--follow", "--quiet", &job_id.to_string()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .context("starting the output follower")?;
    Ok(())
}

/// The pattern context of one task.
pub fn task_context(sweep: &Value, cell: &Value) -> PatternContext {
    let slurm = &sweep["slurm"];
    let is_array = !slurm["array"].is_null();
    PatternContext {
        job_id: cell["job_id"].as_u64().unwrap_or(0),
        array_job_id: is_array.then(|| sweep["job_id"].as_u64().unwrap_or(0)),
        task_id: if is_array {
            cell["value"].as_str().and_then(|v| v.parse().ok())
        } else {
            None
        },
        job_name: slurm["job_name"]
            .as_str()
            .or(sweep["name"].as_str())
            .unwrap_or("")
            .to_owned(),
        user: slurm["user"].as_str().unwrap_or("").to_owned(),
        node: cell["sandbox_id"].as_str().unwrap_or("").to_owned(),
    }
}

/// Writes one finished task's output files and collected files. A task
/// that never started (cancelled while pending) has none, as in Slurm.
fn write_task(sweep: &Value, cell: &Value) -> Result<()> {
    if cell["started_at"].is_null() && cell["sandbox_id"].is_null() {
        return Ok(());
    }
    let slurm = &sweep["slurm"];
    let work_dir = PathBuf::from(
        slurm["work_dir"]
            .as_str()
            .context("this job was not submitted by shoal sbatch (no slurm.work_dir)")?,
    );
    let ctx = task_context(sweep, cell);
    let paths = shoal_slurm::output_paths(
        slurm["output"].as_str(),
        slurm["error"].as_str(),
        &ctx,
        &work_dir,
    );
    let stdout = cell["stdout"].as_str().unwrap_or("");
    let mut stderr = cell["stderr"].as_str().unwrap_or("").to_owned();
    // slurmstepd's own line, which Slurm writes to the task's stderr.
    let state = cell["state"].as_str().unwrap_or("");
    if state == "timeout" || state == "cancelled" {
        let due = if state == "timeout" {
            " DUE TO TIME LIMIT"
        } else {
            ""
        };
        let at = cell["finished_at"]
            .as_str()
            .unwrap_or("")
            .get(..19)
            .unwrap_or("");
        stderr.push_str(&format!(
            "slurmstepd: error: *** JOB {} ON {} CANCELLED AT {at}{due} ***\n",
            ctx.job_id, ctx.node
        ));
    }
    // --open-mode=append: every task adds to the file (a shared `-o all.out`).
    let append = slurm["open_mode"].as_str() == Some("append");
    let output = |path: &Path, bytes: &[u8]| {
        if append {
            append_file(path, bytes)
        } else {
            write_file(path, bytes)
        }
    };
    if paths.same_file() {
        output(&paths.stdout, format!("{stdout}{stderr}").as_bytes())?;
    } else {
        output(&paths.stdout, stdout.as_bytes())?;
        output(&paths.stderr, stderr.as_bytes())?;
    }
    if let Some(files) = cell["collected"].as_object() {
        for (path, content) in files {
            let Some(local) = local_path(&work_dir, path) else {
                continue;
            };
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(content.as_str().unwrap_or(""))
                .with_context(|| format!("collected file {path}"))?;
            write_file(&local, &bytes)?;
        }
    }
    Ok(())
}

/// The local path of a file collected from the sandbox's working directory
/// (same absolute path); `None` for anything outside it or climbing out.
fn local_path(work_dir: &Path, sandbox_path: &str) -> Option<PathBuf> {
    let rel = Path::new(sandbox_path).strip_prefix(work_dir).ok()?;
    let safe = rel
        .components()
        .all(|c| matches!(c, std::path::Component::Normal(_)));
    (safe && !rel.as_os_str().is_empty()).then(|| work_dir.join(rel))
}

/// Writes a file whole, making its directory if missing (Slurm would leave
/// the task without output; a missing `logs/` here is made).
fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// Appends to a file, making it (and its directory) if missing.
fn append_file(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write as _;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(bytes))
        .with_context(|| format!("appending to {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn collected_files_stay_inside_the_work_dir() {
        let w = Path::new("/home/a/run");
        assert_eq!(
            local_path(w, "/home/a/run/out/1.txt"),
            Some(w.join("out/1.txt"))
        );
        assert_eq!(local_path(w, "/etc/passwd"), None);
        assert_eq!(local_path(w, "/home/a/run/../x"), None);
    }

    #[test]
    fn task_files_are_named_as_slurm_names_them() {
        let dir = std::env::temp_dir().join(format!("shoal-follow-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let sweep = json!({"job_id": 1000, "name": "n", "slurm": {
            "array": "1-2", "job_name": "sim", "user": "ada",
            "work_dir": dir.to_str(), "output": "logs/%x_%A_%a.out", "error": null}});
        let cell = json!({"index": 1, "value": "2", "job_id": 1001, "state": "failed",
            "sandbox_id": "sb_1", "started_at": "x", "stdout": "out\n", "stderr": "err\n",
            "collected": {format!("{}/res/2.txt", dir.display()): "NDI="}});
        write_task(&sweep, &cell).unwrap();
        let log = std::fs::read_to_string(dir.join("logs/sim_1000_2.out")).unwrap();
        assert_eq!(log, "out\nerr\n");
        assert_eq!(
            std::fs::read_to_string(dir.join("res/2.txt")).unwrap(),
            "42"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn open_mode_append_adds_each_task_to_a_shared_file() {
        let dir = tempfile::tempdir().unwrap();
        let sweep = |mode: &str| {
            json!({"job_id": 1000, "name": "n", "slurm": {
                "array": "1-2", "job_name": "sim", "user": "ada", "open_mode": mode,
                "work_dir": dir.path().to_str(), "output": "all.out", "error": null}})
        };
        let cell = |i: u64| {
            json!({"index": i, "value": (i + 1).to_string(), "job_id": 1000 + i,
                "state": "succeeded", "sandbox_id": "sb_1", "started_at": "x",
                "stdout": format!("task {}\n", i + 1), "stderr": ""})
        };
        for i in 0..2 {
            write_task(&sweep("append"), &cell(i)).unwrap();
        }
        let all = std::fs::read_to_string(dir.path().join("all.out")).unwrap();
        assert_eq!(all, "task 1\ntask 2\n");
        // Slurm's default, truncate: the last task's output only.
        for i in 0..2 {
            write_task(&sweep("truncate"), &cell(i)).unwrap();
        }
        let all = std::fs::read_to_string(dir.path().join("all.out")).unwrap();
        assert_eq!(all, "task 2\n");
    }
}
