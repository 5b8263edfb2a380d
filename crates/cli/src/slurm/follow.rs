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
use std::collections::BTreeMap;
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

/// What the follower has written of one task.
#[derive(Debug, Default)]
struct Written {
    /// The attempt whose output is in the files (`None`: none yet).
    epoch: Option<u64>,
    /// The next flush of that attempt's output to read.
    next: u64,
    /// The task is over and everything of it is written.
    done: bool,
}

/// Follows job `id` until it is over, writing each task's output as it
/// grows and its result files when it finishes. `loud`: say on stderr
/// what went wrong with a file.
pub async fn follow(api: &Api, id: &str, loud: bool) -> Result<Outcome> {
    // One live follower per job on this machine: two would both add each
    // line. A second one (`shoal sync --follow` beside sbatch's) waits for
    // the first, then writes everything once more, whole.
    let _lock = lock_job(api, id).await?;
    let mut written = BTreeMap::new();
    let mut last_ok = Instant::now();
    loop {
        match pass(api, id, &mut written, true, loud).await {
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

/// One look at the job: adds what running tasks printed since the last
/// look (when `live`) and writes the whole of tasks finished since. `Some`
/// once the job is over and everything is written.
async fn pass(
    api: &Api,
    id: &str,
    written: &mut BTreeMap<u64, Written>,
    live: bool,
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
        let finished = is_finished_cell(state);
        if finished {
            match (state, cell["exit_code"].as_i64()) {
                ("succeeded" | "failed", Some(code)) => {
                    outcome.max_exit = outcome.max_exit.max(code)
                }
                _ => outcome.abnormal += 1,
            }
        }
        let started = !cell["started_at"].is_null() || !cell["sandbox_id"].is_null();
        if !(finished || live && state == "running" && started) {
            continue;
        }
        let index = cell["index"].as_u64().unwrap_or(0);
        let task = written.entry(index).or_default();
        if task.done {
            continue;
        }
        let files = match task_files(&sweep, cell) {
            Ok(files) => files,
            Err(e) => {
                if loud {
                    eprintln!("sbatch: task {index} of job {id}: {e:#}");
                }
                task.done = finished;
                continue;
            }
        };
        if !started {
            // Cancelled while pending: no files, as in Slurm.
            task.done = true;
            continue;
        }
        if let Err(e) = follow_output(api, id, index, &files, task).await {
            if loud {
                eprintln!("sbatch: task {index} of job {id}: {e:#}");
            }
            if !finished {
                continue;
            }
        }
        if finished {
            let whole = api.cell(id, index).await?;
            if let Err(e) = finish_task(api, &whole, &files, task).await {
                if loud {
                    eprintln!("sbatch: task {index} of job {id}: {e:#}");
                }
            }
            task.done = true;
        }
    }
    Ok(over.then_some(outcome))
}

/// Held while a follower writes a job's files.
struct JobLock(#[allow(dead_code)] std::fs::File);

/// Takes this machine's lock of job `id` of the API, waiting for another
/// follower that holds it.
async fn lock_job(api: &Api, id: &str) -> Result<JobLock> {
    use sha2::Digest as _;
    let api_key = hex::encode(&sha2::Sha256::digest(api.base().as_bytes())[..6]);
    // SAFETY: getuid has no failure mode.
    let uid = unsafe { libc::getuid() };
    let path = std::env::temp_dir().join(format!("shoal-follow-{uid}-{api_key}-{id}.lock"));
    tokio::task::spawn_blocking(move || {
        use std::os::fd::AsRawFd as _;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: flock on an fd this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("locking {}", path.display()));
        }
        Ok(JobLock(file))
    })
    .await?
}

/// `shoal sync`: writes the files of every finished task of the jobs,
/// once (again if they were already written).
pub async fn sync(api: &Api, ids: &[String]) -> Result<()> {
    for id in ids {
        let mut written = BTreeMap::new();
        pass(api, id, &mut written, false, true).await?;
        let done = written.values().filter(|w| w.done).count();
        println!("job {id}: {done} finished task(s) written");
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

/// Where one task's output goes, and how.
struct TaskFiles {
    work_dir: PathBuf,
    submit_dir: Option<PathBuf>,
    paths: shoal_slurm::OutputPaths,
    /// `--open-mode=append`: added to, never truncated.
    append: bool,
    ctx: PatternContext,
}

impl TaskFiles {
    /// Adds to a stream's file.
    fn add(&self, stream: &str, bytes: &[u8]) -> Result<()> {
        let path = if stream == "stderr" {
            &self.paths.stderr
        } else {
            &self.paths.stdout
        };
        append_file(path, bytes)
    }

    /// Starts the files of an attempt: empty, unless appending.
    fn start(&self) -> Result<()> {
        if self.append {
            return append_file(&self.paths.stdout, b"")
                .and_then(|()| append_file(&self.paths.stderr, b""));
        }
        write_file(&self.paths.stdout, b"")?;
        if !self.paths.same_file() {
            write_file(&self.paths.stderr, b"")?;
        }
        Ok(())
    }

    /// Where a file the task left in the sandbox goes here: the same
    /// path, if it is under the working or the submit directory.
    fn local(&self, sandbox_path: &str) -> Option<PathBuf> {
        local_path(&self.work_dir, sandbox_path).or_else(|| {
            self.submit_dir
                .as_deref()
                .and_then(|dir| local_path(dir, sandbox_path))
        })
    }
}

fn task_files(sweep: &Value, cell: &Value) -> Result<TaskFiles> {
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
    Ok(TaskFiles {
        work_dir,
        submit_dir: slurm["submit_dir"].as_str().map(PathBuf::from),
        paths,
        append: slurm["open_mode"].as_str() == Some("append"),
        ctx,
    })
}

/// Adds what the task's attempt printed since the last look to its files;
/// a new attempt starts them over.
async fn follow_output(
    api: &Api,
    id: &str,
    index: u64,
    files: &TaskFiles,
    task: &mut Written,
) -> Result<()> {
    loop {
        let page = api.cell_output(id, index, task.next).await?;
        let Some(epoch) = page["epoch"].as_u64() else {
            return Ok(());
        };
        if task.epoch != Some(epoch) {
            if task.next > 0 {
                // Tried again: its output starts over, from its first flush.
                task.next = 0;
                task.epoch = None;
                continue;
            }
            files.start()?;
            task.epoch = Some(epoch);
        }
        let chunks = page["chunks"].as_array().cloned().unwrap_or_default();
        if chunks.is_empty() {
            return Ok(());
        }
        for chunk in &chunks {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(chunk["data"].as_str().unwrap_or(""))
                .context("the API sent output that is not base64")?;
            files.add(chunk["stream"].as_str().unwrap_or("stdout"), &bytes)?;
        }
        task.next = page["next"]
            .as_u64()
            .unwrap_or(task.next + chunks.len() as u64);
    }
}

/// What ends a finished task's files: its output if none was followed
/// (from the cell's tails), slurmstepd's line for a time limit or a
/// cancel, and the files it made or changed in the submit directory.
async fn finish_task(api: &Api, cell: &Value, files: &TaskFiles, task: &Written) -> Result<()> {
    for (digest, local, path) in finish_locally(cell, files, task)? {
        api.get_blob(&digest, &local)
            .await
            .with_context(|| format!("fetching {path}"))?;
    }
    Ok(())
}

/// [`finish_task`] but for the results kept as blobs, which it returns
/// (digest, where it goes, the sandbox's path) for the caller to fetch.
fn finish_locally(
    cell: &Value,
    files: &TaskFiles,
    task: &Written,
) -> Result<Vec<(String, PathBuf, String)>> {
    if task.epoch.is_none() {
        files.start()?;
        // Output the API did not spool as it came (a server before the
        // live output, or an attempt that printed nothing).
        files.add("stdout", cell["stdout"].as_str().unwrap_or("").as_bytes())?;
        files.add("stderr", cell["stderr"].as_str().unwrap_or("").as_bytes())?;
    }
    let state = cell["state"].as_str().unwrap_or("");
    // A server that spools output writes slurmstepd's lines in it, when
    // they happen; for one that did not, they end the task's file.
    if task.epoch.is_none() && (state == "timeout" || state == "cancelled") {
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
        let line = format!(
            "slurmstepd: error: *** JOB {} ON {} CANCELLED AT {at}{due} ***\n",
            files.ctx.job_id, files.ctx.node
        );
        files.add("stderr", line.as_bytes())?;
    }
    let mut fetch = Vec::new();
    let Some(collected) = cell["collected"].as_object() else {
        return Ok(fetch);
    };
    for (path, content) in collected {
        let Some(local) = files.local(path) else {
            continue;
        };
        match content {
            // A result kept as a blob: any size, fetched as a stream.
            Value::Object(blob) => {
                let digest = blob.get("blob").and_then(Value::as_str).unwrap_or("");
                if let Some(dir) = local.parent() {
                    std::fs::create_dir_all(dir)
                        .with_context(|| format!("creating {}", dir.display()))?;
                }
                fetch.push((digest.to_owned(), local, path.clone()));
            }
            // A collected file inline, base64.
            other => {
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(other.as_str().unwrap_or(""))
                    .with_context(|| format!("collected file {path}"))?;
                write_file(&local, &bytes)?;
            }
        }
    }
    Ok(fetch)
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

    /// What the follower writes of a finished task whose output was not
    /// followed live.
    fn write_task(sweep: &Value, cell: &Value) -> Result<Vec<(String, PathBuf, String)>> {
        let files = task_files(sweep, cell)?;
        finish_locally(cell, &files, &Written::default())
    }

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

    #[test]
    fn followed_output_is_kept_and_blob_results_are_fetched_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("run");
        let sweep = json!({"job_id": 7, "name": "n", "slurm": {
            "job_name": "j", "user": "ada", "work_dir": work.to_str(),
            "submit_dir": dir.path().to_str(), "output": null, "error": null}});
        let cell = json!({"index": 0, "value": "0", "job_id": 7, "state": "timeout",
            "sandbox_id": "sb_9", "started_at": "x", "finished_at": "2026-12-07T01:02:03Z",
            "stdout": "tail only\n", "stderr": "",
            "collected": {
                format!("{}/out/big.bin", work.display()): {"blob": "ab", "size": 3},
                format!("{}/sibling.txt", dir.path().display()): {"blob": "cd", "size": 1},
                "/etc/shadow": {"blob": "ef", "size": 1}}});
        let files = task_files(&sweep, &cell).unwrap();
        // Followed live: the file holds what was printed (the server spooled
        // slurmstepd's line where it happened), nothing is added.
        files.start().unwrap();
        files.add("stdout", b"live 1\n").unwrap();
        let followed = Written {
            epoch: Some(1),
            next: 1,
            done: false,
        };
        let fetch = finish_locally(&cell, &files, &followed).unwrap();
        let out = std::fs::read_to_string(work.join("slurm-7.out")).unwrap();
        assert_eq!(out, "live 1\n");
        // Not followed (an older server): the tail, then slurmstepd's line.
        finish_locally(&cell, &files, &Written::default()).unwrap();
        let out = std::fs::read_to_string(work.join("slurm-7.out")).unwrap();
        assert_eq!(
            out,
            "tail only\nslurmstepd: error: *** JOB 7 ON sb_9 CANCELLED AT 2026-12-07T01:02:03 \
             DUE TO TIME LIMIT ***\n"
        );
        let targets: Vec<(String, PathBuf)> =
            fetch.into_iter().map(|(d, local, _)| (d, local)).collect();
        assert_eq!(
            targets,
            [
                ("ab".to_owned(), work.join("out/big.bin")),
                ("cd".to_owned(), dir.path().join("sibling.txt")),
            ]
        );
        assert!(work.join("out").is_dir());
    }
}
