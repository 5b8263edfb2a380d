//! The Slurm bridge end to end on real VMs: a cluster-style array script
//! runs unchanged through `shoal sbatch` against a real `shoal up`, its
//! `--output` files appear in the submit directory with Slurm's names and
//! the tasks' own output, `shoal squeue` shows it running, `shoal sacct`
//! shows every task COMPLETED with its elapsed time, CPU time and cost, a
//! failing job shows FAILED with its exit code, `--dependency=afterok`
//! holds a job until its parent completed, `shoal scancel` cancels one
//! task and then a whole job, and what the fleet cannot do (`--nodes=2`,
//! `--gres=gpu:1`, `srun --mpi`) is refused before anything is created.
//!
//! Runs on SQLite and, when `SHOAL_TEST_DATABASE_URL` names a PostgreSQL
//! server (`scripts/with-postgres`), on a fresh database there too (that
//! variant says it was skipped otherwise). `shoal up` runs in its own
//! process group and is stopped by its id.

use serde_json::Value;
use shoal_testkit::Database;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const ARRAY_SCRIPT: &str = r#"#!/bin/bash
#SBATCH --job-name=sim
#SBATCH --array=1-6%3
#SBATCH --output=logs/%x_%A_%a.out
#SBATCH --time=00:05:00
#SBATCH --cpus-per-task=1
#SBATCH --mem=256M

module load python/3.11

echo "task $SLURM_ARRAY_TASK_ID of $SLURM_ARRAY_TASK_COUNT job $SLURM_JOB_ID array $SLURM_ARRAY_JOB_ID name $SLURM_JOB_NAME"
mkdir -p results
srun --ntasks=1 -c 1 sh -c 'echo $((SLURM_ARRAY_TASK_ID * SLURM_ARRAY_TASK_ID)) step $SLURM_STEP_ID' > results/$SLURM_ARRAY_TASK_ID.txt
echo "note from $SLURM_ARRAY_TASK_ID" >&2
sleep 4
"#;

const FAIL_SCRIPT: &str = r#"#!/bin/sh
#SBATCH -J broken
#SBATCH -t 2
echo "array=${SLURM_ARRAY_TASK_ID:-none} job=$SLURM_JOB_ID"
echo "bad input" >&2
exit 3
"#;

const AFTER_SCRIPT: &str = r#"#!/bin/bash
#SBATCH --job-name=after
#SBATCH --output=after-%j.log
echo "after ran"
"#;

const LONG_SCRIPT: &str = r#"#!/bin/bash
#SBATCH --job-name=long
#SBATCH --array=0-3%2
echo "long $SLURM_ARRAY_TASK_ID started"
sleep 600
"#;

/// Runs `shoal <args>` as a Slurm user would, in `dir`, with the API in
/// the environment.
struct User {
    dir: PathBuf,
    api: String,
    token: String,
}

impl User {
    fn shoal(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_shoal"))
            .args(args)
            .current_dir(&self.dir)
            .env("SHOAL_API", &self.api)
            .env("SHOAL_API_KEY", &self.token)
            .env("USER", "ada")
            // Exported to the tasks by --export's default, ALL.
            .env("MY_PARAM", "from-the-shell")
            .env("SHOAL_SLURM_CONFIG", self.dir.join("no-config.json"))
            .env_remove("SHOAL_PARTITIONS")
            .output()
            .expect("running shoal")
    }

    /// `shoal <args>`, which must succeed; its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.shoal(args);
        assert!(
            out.status.success(),
            "shoal {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn write(&self, name: &str, text: &str) {
        std::fs::write(self.dir.join(name), text).unwrap();
    }

    /// `shoal sbatch <args>`: the job id it printed, and its stderr.
    fn sbatch(&self, args: &[&str]) -> (u64, String) {
        let mut all = vec!["sbatch"];
        all.extend_from_slice(args);
        let out = self.shoal(&all);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "sbatch {args:?}: {stdout}{stderr}");
        let id = stdout
            .trim()
            .strip_prefix("Submitted batch job ")
            .unwrap_or_else(|| panic!("sbatch printed {stdout:?}"))
            .parse()
            .unwrap();
        (id, stderr)
    }

    /// `sacct -j ID -P` with the fields, as rows of cells (header first).
    fn sacct(&self, job: u64, format: &str) -> Vec<Vec<String>> {
        self.ok(&[
            "sacct",
            "-j",
            &job.to_string(),
            "-P",
            &format!("--format={format}"),
        ])
        .lines()
        .map(|l| l.split('|').map(str::to_owned).collect())
        .collect()
    }

    /// Waits until every task of `job` is in one of `states` (sacct).
    fn wait_states(
        &self,
        job: u64,
        count: usize,
        states: &[&str],
        limit: Duration,
    ) -> Vec<Vec<String>> {
        let deadline = Instant::now() + limit;
        loop {
            let rows = self.sacct(job, "JobID,JobName,State,ExitCode,Elapsed,CPUTime,Cost");
            let done = rows.len() == count + 1
                && rows[1..].iter().all(|r| states.contains(&r[2].as_str()));
            if done {
                return rows;
            }
            assert!(
                Instant::now() < deadline,
                "job {job} never reached {states:?}: {rows:?}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

/// `[DD-]HH:MM:SS` in seconds.
fn seconds(t: &str) -> u64 {
    let (days, hms) = match t.split_once('-') {
        Some((d, rest)) => (d.parse::<u64>().unwrap(), rest),
        None => (0, t),
    };
    let parts: Vec<u64> = hms.split(':').map(|p| p.parse().unwrap()).collect();
    assert_eq!(parts.len(), 3, "{t}");
    days * 86_400 + parts[0] * 3_600 + parts[1] * 60 + parts[2]
}

fn wait_for_file(path: &Path, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn vms_of(state: &Path) -> Vec<u32> {
    shoal_testkit::processes_mentioning(&state.join("vms").display().to_string())
}

async fn sweeps_of(api: &str, token: &str) -> Vec<Value> {
    let v: Value = reqwest::Client::new()
        .get(format!("{api}/v1/sweeps"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["sweeps"].as_array().cloned().unwrap()
}

async fn slurm_scripts_run_unchanged(database_url: &str, state: PathBuf) {
    let _ = std::fs::remove_dir_all(&state);
    std::fs::create_dir_all(&state).unwrap();
    let up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
        .database_url(database_url)
        .start()
        .await;
    let submit = state.join("submit");
    std::fs::create_dir_all(&submit).unwrap();
    let user = User {
        dir: submit.clone(),
        api: up.base().to_owned(),
        token: up.token("slurm"),
    };

    // Refusals: a message that says why, a failure, and nothing created.
    for (name, text, expect) in [
        (
            "nodes.sh",
            "#!/bin/bash\n#SBATCH --nodes=2\necho hi\n",
            "--nodes",
        ),
        (
            "gpu.sh",
            "#!/bin/bash\n#SBATCH --gres=gpu:1\necho hi\n",
            "gpu",
        ),
        (
            "mpi.sh",
            "#!/bin/bash\n#SBATCH -n 4\nsrun --mpi=pmix ./solver\n",
            "mpi",
        ),
    ] {
        user.write(name, text);
        let out = user.shoal(&["sbatch", name]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name} was accepted");
        assert!(
            stderr.contains("cannot run on Shoal") && stderr.contains(expect),
            "{name}: {stderr}"
        );
        println!("refused {name}: {}", stderr.trim());
    }
    // A command-line option overrides the script's, refusals included.
    user.write("ok.sh", "#!/bin/bash\n#SBATCH --nodes=1\necho hi\n");
    let out = user.shoal(&["sbatch", "--nodes=3", "ok.sh"]);
    assert!(
        !out.status.success(),
        "--nodes=3 on the command line was accepted"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("--nodes"));
    assert!(
        sweeps_of(&user.api, &user.token).await.is_empty(),
        "a refused job created a sweep"
    );

    // The array job, unchanged, plus a dependent job and a failing one.
    user.write("job.sh", ARRAY_SCRIPT);
    let started = Instant::now();
    let (job, stderr) = user.sbatch(&["job.sh"]);
    assert!(
        stderr.contains("module load python/3.11"),
        "module line not reported: {stderr}"
    );
    user.write("after.sh", AFTER_SCRIPT);
    let (after, _) = user.sbatch(&[&format!("--dependency=afterok:{job}"), "after.sh"]);
    user.write("fail.sh", FAIL_SCRIPT);
    let (fail, _) = user.sbatch(&["fail.sh"]);
    println!("submitted array {job}, dependent {after}, failing {fail}");

    // squeue while it runs: running tasks on their sandboxes, at most 3
    // (the %3 throttle), and the dependent job pending on its dependency.
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut max_running = 0;
    let mut saw = String::new();
    loop {
        let q = user.ok(&["squeue"]);
        let running: Vec<&str> = q
            .lines()
            .filter(|l| l.contains(&format!("{job}_")) && l.split_whitespace().nth(4) == Some("R"))
            .collect();
        max_running = max_running.max(running.len());
        if !running.is_empty() && running.iter().all(|l| l.contains("sb-")) && saw.is_empty() {
            saw = q.clone();
            assert!(
                q.lines()
                    .any(|l| l.contains(&after.to_string()) && l.contains("(Dependency)")),
                "the dependent job is not shown pending on its dependency:\n{q}"
            );
        }
        if q.lines().all(|l| !l.contains(&format!("{job}_"))) {
            break;
        }
        assert!(Instant::now() < deadline, "the array never finished:\n{q}");
        std::thread::sleep(Duration::from_millis(500));
    }
    println!("squeue while running:\n{saw}");
    assert!(
        !saw.is_empty(),
        "squeue never showed a running task with its sandbox"
    );
    assert!(max_running <= 3, "more than 3 tasks ran at once");

    // `--cpus-per-task=1`: each task's VM has one vCPU (the template has
    // more), and CPUTime counts that one.
    let vcpus = 1;

    // sacct: every task COMPLETED, exit 0:0, elapsed ≥ the 4 s sleep, a cost.
    let rows = user.wait_states(job, 6, &["COMPLETED"], Duration::from_secs(60));
    println!(
        "array done in {:.1} s\n{}",
        started.elapsed().as_secs_f64(),
        rows.iter()
            .map(|r| r.join("|"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(
        rows[0],
        ["JobID", "JobName", "State", "ExitCode", "Elapsed", "CPUTime", "Cost"]
    );
    for (i, row) in rows[1..].iter().enumerate() {
        let task = i + 1;
        assert_eq!(row[0], format!("{job}_{task}"));
        assert_eq!(row[1], "sim");
        assert_eq!(row[3], "0:0");
        assert!((4..120).contains(&seconds(&row[4])), "elapsed {row:?}");
        assert_eq!(
            seconds(&row[5]),
            seconds(&row[4]) * vcpus,
            "CPUTime is Elapsed times the vCPUs: {row:?}"
        );
        let cost: f64 = row[6].parse().unwrap_or_else(|_| panic!("cost {row:?}"));
        assert!(cost > 0.0, "{row:?}");
    }

    // Output files: Slurm's names, each task's own output then its stderr;
    // the results the tasks wrote, back in the submit directory.
    for task in 1..=6u64 {
        let log = wait_for_file(
            &submit.join(format!("logs/sim_{job}_{task}.out")),
            Duration::from_secs(60),
        );
        let task_job = job + task - 1;
        assert_eq!(
            log,
            format!("task {task} of 6 job {task_job} array {job} name sim\nnote from {task}\n"),
            "task {task}"
        );
        let result = wait_for_file(
            &submit.join(format!("results/{task}.txt")),
            Duration::from_secs(10),
        );
        // Written by an `srun` step: the task's first (step 0).
        assert_eq!(result.trim(), format!("{} step 0", task * task));
    }

    // The dependent job ran after, and its output file is named by %j.
    user.wait_states(after, 1, &["COMPLETED"], Duration::from_secs(180));
    assert_eq!(
        wait_for_file(
            &submit.join(format!("after-{after}.log")),
            Duration::from_secs(60)
        ),
        "after ran\n"
    );

    // The failing job: FAILED 3:0; not an array, so no array variables and
    // Slurm's slurm-%j.out.
    let rows = user.wait_states(fail, 1, &["FAILED"], Duration::from_secs(180));
    assert_eq!(rows[1][0], fail.to_string());
    assert_eq!(rows[1][3], "3:0");
    let log = wait_for_file(
        &submit.join(format!("slurm-{fail}.out")),
        Duration::from_secs(60),
    );
    assert_eq!(log, format!("array=none job={fail}\nbad input\n"));

    // --wrap, with the shell's variables (--export=ALL) or none of them.
    let (wrapped, _) = user.sbatch(&[
        "--wrap",
        "echo wrapped $MY_PARAM $SLURM_JOB_NAME",
        "--output=wrap.out",
    ]);
    let (bare, _) = user.sbatch(&[
        "--export=NONE",
        "--output=none.out",
        "--wrap=echo \"[${MY_PARAM:-unset}]\"",
    ]);
    user.wait_states(wrapped, 1, &["COMPLETED"], Duration::from_secs(180));
    user.wait_states(bare, 1, &["COMPLETED"], Duration::from_secs(180));
    assert_eq!(
        wait_for_file(&submit.join("wrap.out"), Duration::from_secs(60)),
        "wrapped from-the-shell wrap\n"
    );
    assert_eq!(
        wait_for_file(&submit.join("none.out"), Duration::from_secs(60)),
        "[unset]\n"
    );

    // A sandbox promoted to a template is a partition; `--cpus-per-task`
    // and `--mem` give the task a VM of that size, not the template's.
    let api = shoal_testkit::ApiClient::new(&user.api, &user.token);
    let sandbox = api
        .ok(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(serde_json::json!({"template": "base"})),
        )
        .await;
    let id = sandbox["id"].as_str().unwrap().to_owned();
    api.ok(
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(serde_json::json!({"cmd": "mkdir -p /opt/tools && echo promoted-tools > /opt/tools/marker"})),
    )
    .await;
    api.ok(
        reqwest::Method::POST,
        "/v1/templates",
        Some(serde_json::json!({"name": "mytools", "from_sandbox": id})),
    )
    .await;
    api.call(
        reqwest::Method::DELETE,
        &format!("/v1/sandboxes/{id}"),
        None,
    )
    .await;
    user.write(
        "sized.sh",
        "#!/bin/bash\n#SBATCH --partition=mytools\n#SBATCH --cpus-per-task=2\n#SBATCH --mem=1G\n\
         #SBATCH --output=sized.out\nnproc\nawk '/MemTotal/ {print $2}' /proc/meminfo\ncat /opt/tools/marker\n",
    );
    let (sized, _) = user.sbatch(&["sized.sh"]);
    let rows = user.wait_states(sized, 1, &["COMPLETED"], Duration::from_secs(300));
    let out = wait_for_file(&submit.join("sized.out"), Duration::from_secs(60));
    let lines: Vec<&str> = out.lines().collect();
    println!(
        "a 2-CPU 1 GiB task on a promoted template: {lines:?}, {:?}",
        rows[1]
    );
    assert_eq!(lines[0], "2", "nproc in the task: {out}");
    let mem_kib: u64 = lines[1].parse().unwrap();
    assert!(
        (850_000..=1_048_576).contains(&mem_kib),
        "MemTotal {mem_kib} kB is not about 1 GiB"
    );
    assert_eq!(lines[2], "promoted-tools");
    assert_eq!(
        seconds(&rows[1][5]),
        seconds(&rows[1][4]) * 2,
        "CPUTime counts 2 CPUs: {:?}",
        rows[1]
    );

    // scancel: one task of a running array, then the whole job.
    user.write("long.sh", LONG_SCRIPT);
    let (long, _) = user.sbatch(&["long.sh"]);
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let q = user.ok(&["squeue", "-j", &long.to_string()]);
        if q.lines()
            .filter(|l| l.split_whitespace().nth(4) == Some("R"))
            .count()
            == 2
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the long job never ran 2 tasks:\n{q}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    user.ok(&["scancel", &format!("{long}_1")]);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let rows = user.sacct(long, "JobID,State");
        let task1 = rows
            .iter()
            .find(|r| r[0] == format!("{long}_1"))
            .unwrap()
            .clone();
        if task1[1] == "CANCELLED" {
            let others: Vec<&str> = rows[1..]
                .iter()
                .filter(|r| r[0] != task1[0])
                .map(|r| r[1].as_str())
                .collect();
            assert!(
                others.iter().all(|s| *s == "RUNNING" || *s == "PENDING"),
                "{rows:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{long}_1 was not cancelled: {rows:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // scontrol and squeue's own options on the running job.
    let shown = user.ok(&["scontrol", "show", "job", &format!("{long}_0")]);
    assert!(
        shown.starts_with(&format!(
            "JobId={long} ArrayJobId={long} ArrayTaskId=0 JobName=long"
        )) && shown.contains("JobState=RUNNING"),
        "{shown}"
    );
    let running = user.ok(&["squeue", "-h", "-t", "R", "-j", &format!("{long}_0")]);
    assert_eq!(running.lines().count(), 1, "{running}");
    assert!(
        !running.contains("JOBID"),
        "squeue -h prints no header: {running}"
    );
    // The filters without ids: the pending tasks of job "long" only, then
    // the rest of that user's job by name.
    user.ok(&["scancel", "-t", "PENDING", "-n", "long"]);
    user.ok(&["scancel", "-u", "ada", "-n", "long"]);
    let rows = user.wait_states(long, 4, &["CANCELLED"], Duration::from_secs(120));
    println!(
        "after scancel:\n{}",
        rows.iter()
            .map(|r| r.join("|"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let q = user.ok(&["squeue"]);
    assert_eq!(q.lines().count(), 1, "squeue still shows jobs:\n{q}");

    // Nothing left running.
    let gone = shoal_testkit::wait_until(Duration::from_secs(60), || async {
        vms_of(&state).is_empty()
    })
    .await;
    assert!(gone, "VMs left after every job ended");
    drop(up);
    let _ = std::fs::remove_dir_all(&state);
}

#[test]
fn slurm_scripts_run_unchanged_on_sqlite() {
    shoal_testkit::with_database(
        Database::Sqlite,
        "vm_sbatch_sqlite",
        |url, state| async move { slurm_scripts_run_unchanged(&url, state).await },
    );
}

#[test]
fn slurm_scripts_run_unchanged_on_postgres() {
    shoal_testkit::with_database(
        Database::Postgres,
        "vm_sbatch_pg",
        |url, state| async move { slurm_scripts_run_unchanged(&url, state).await },
    );
}

/// A lab's array job: reads its inputs from the submit directory, writes
/// results there (one of 20 MiB), and prints a line a second.
const LAB_SCRIPT: &str = r#"#!/bin/bash
#SBATCH --job-name=lab
#SBATCH --array=1-3
#SBATCH --output=logs/%x_%A_%a.out
#SHOAL --input ../shared/ref.txt
cd "$SLURM_SUBMIT_DIR"
sample=$(sed -n "${SLURM_ARRAY_TASK_ID}p" samples.txt)
mkdir -p out
{ cat data/header.txt; echo "$sample"; cat ../shared/ref.txt; } > "out/$sample.txt"
echo "mode $(stat -c %a samples.txt) scratch $(test -e scratch/huge.bin && echo travelled || echo absent)"
if [ "$SLURM_ARRAY_TASK_ID" = 1 ]; then
  head -c 20971520 /dev/urandom > out/big.bin
  sha256sum out/big.bin | cut -d' ' -f1 > out/big.sha
  for i in 1 2 3 4 5 6 7 8; do echo "tick $i"; sleep 1; done
fi
"#;

/// Lines of `path` as they appear, each with when it was first seen.
fn watch_lines(path: &Path, until: &str, limit: Duration) -> Vec<(String, Instant)> {
    let deadline = Instant::now() + limit;
    let mut seen: Vec<(String, Instant)> = Vec::new();
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            for line in text.lines().skip(seen.len()) {
                seen.push((line.to_owned(), Instant::now()));
            }
            if seen.iter().any(|(l, _)| l == until) {
                return seen;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} never showed {until:?}: {seen:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

async fn lab_jobs_carry_their_data(database_url: &str, state: PathBuf) {
    use sha2::Digest as _;
    let _ = std::fs::remove_dir_all(&state);
    std::fs::create_dir_all(&state).unwrap();
    let up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
        .database_url(database_url)
        .start()
        .await;
    let project = state.join("project");
    let submit = project.join("run");
    std::fs::create_dir_all(submit.join("data")).unwrap();
    std::fs::create_dir_all(submit.join("scratch")).unwrap();
    std::fs::create_dir_all(project.join("shared")).unwrap();
    std::fs::write(submit.join("samples.txt"), "alpha\nbeta\ngamma\n").unwrap();
    std::fs::write(submit.join("data/header.txt"), "# header\n").unwrap();
    std::fs::write(submit.join("scratch/huge.bin"), "not an input").unwrap();
    std::fs::write(submit.join(".shoalignore"), "scratch/\n").unwrap();
    std::fs::write(project.join("shared/ref.txt"), "ref-1\n").unwrap();
    let user = User {
        dir: submit.clone(),
        api: up.base().to_owned(),
        token: up.token("lab"),
    };
    user.write("lab.sh", LAB_SCRIPT);

    let (job, stderr) = user.sbatch(&["lab.sh"]);
    assert!(
        stderr.contains("sent 5 input file(s)"),
        "samples, header, .shoalignore, lab.sh and ../shared/ref.txt travel, scratch does not: {stderr}"
    );
    // Live: task 1's ticks reach its file a second apart, while it runs,
    // each within 2 s of when it was printed (measured from the first).
    let log = submit.join(format!("logs/lab_{job}_1.out"));
    let lines = watch_lines(&log, "tick 8", Duration::from_secs(300));
    let first = lines
        .iter()
        .position(|(l, _)| l == "tick 1")
        .expect("tick 1");
    let t1 = lines[first].1;
    let mut worst = 0.0f64;
    for (k, (line, at)) in lines[first..].iter().enumerate() {
        assert_eq!(line, &format!("tick {}", k + 1));
        let lag = at.duration_since(t1).as_secs_f64() - k as f64;
        worst = worst.max(lag.abs());
    }
    println!("live output: 8 ticks, worst lag against the first {worst:.2} s");
    assert!(
        worst <= 2.0,
        "a line reached the .out file {worst:.2} s late: {lines:?}"
    );
    user.wait_states(job, 3, &["COMPLETED"], Duration::from_secs(300));

    // Results, back at their paths: built from the inputs; the 20 MiB
    // file whole (its digest as the task computed it).
    for (task, sample) in [(1, "alpha"), (2, "beta"), (3, "gamma")] {
        let out = wait_for_file(
            &submit.join(format!("out/{sample}.txt")),
            Duration::from_secs(60),
        );
        assert_eq!(out, format!("# header\n{sample}\nref-1\n"), "task {task}");
        let log = wait_for_file(
            &submit.join(format!("logs/lab_{job}_{task}.out")),
            Duration::from_secs(60),
        );
        assert!(
            log.starts_with("mode 444 scratch absent\n"),
            "inputs are read-only and ignored files stay home: {log}"
        );
    }
    let want = wait_for_file(&submit.join("out/big.sha"), Duration::from_secs(60));
    let big = std::fs::read(submit.join("out/big.bin")).unwrap();
    assert_eq!(big.len(), 20 << 20);
    assert_eq!(hex::encode(sha2::Sha256::digest(&big)), want.trim());
    // Inputs unchanged by the job are not written back.
    assert_eq!(
        std::fs::read_to_string(submit.join("samples.txt")).unwrap(),
        "alpha\nbeta\ngamma\n"
    );

    // A resubmit sends only what changed: nothing, then one file. (Each
    // job's output file is in place before the next submit: it is an
    // input of the next, known by content.)
    let (again, _) = user.sbatch(&["--wrap", "cat data/header.txt", "--output=again.out"]);
    user.wait_states(again, 1, &["COMPLETED"], Duration::from_secs(180));
    wait_for_file(&submit.join("again.out"), Duration::from_secs(60));
    let (same, stderr) = user.sbatch(&["--wrap", "cat data/header.txt", "--output=same.out"]);
    assert!(!stderr.contains("sent"), "nothing changed, yet: {stderr}");
    user.wait_states(same, 1, &["COMPLETED"], Duration::from_secs(180));
    wait_for_file(&submit.join("same.out"), Duration::from_secs(60));
    std::fs::write(submit.join("data/header.txt"), "# header 2\n").unwrap();
    let (changed, stderr) = user.sbatch(&["--wrap", "cat data/header.txt", "--output=changed.out"]);
    assert!(stderr.contains("sent 1 input file(s)"), "{stderr}");
    user.wait_states(changed, 1, &["COMPLETED"], Duration::from_secs(180));
    assert_eq!(
        wait_for_file(&submit.join("changed.out"), Duration::from_secs(60)),
        "# header 2\n"
    );

    // --hold: pending (JobHeldUser) until scontrol release; --begin:
    // pending (BeginTime) until its time.
    let (held, _) = user.sbatch(&["--hold", "--wrap", "echo held", "--output=held.out"]);
    let begin_submitted = Instant::now();
    let (later, _) = user.sbatch(&[
        "--begin=now+8",
        "--wrap",
        "echo later",
        "--output=later.out",
    ]);
    let q = user.ok(&["squeue", "-h", "-o", "%i %t %r"]);
    assert!(q.contains(&format!("{held} PD JobHeldUser")), "{q}");
    assert!(q.contains(&format!("{later} PD BeginTime")), "{q}");
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(user.sacct(held, "State")[1][0], "PENDING");
    user.ok(&["scontrol", "release", &held.to_string()]);
    user.wait_states(held, 1, &["COMPLETED"], Duration::from_secs(180));
    user.wait_states(later, 1, &["COMPLETED"], Duration::from_secs(180));
    assert!(begin_submitted.elapsed() >= Duration::from_secs(8));
    let started = user.sacct(later, "Start,Submit");
    println!("--begin=now+8: {started:?}");
    assert_eq!(
        wait_for_file(&submit.join("held.out"), Duration::from_secs(60)),
        "held\n"
    );
    // scontrol hold on a queued job, then release.
    let (waiting, _) = user.sbatch(&["--begin=now+600", "--wrap", "true"]);
    user.ok(&["scontrol", "hold", &waiting.to_string()]);
    let q = user.ok(&["squeue", "-h", "-j", &waiting.to_string(), "-o", "%t %r"]);
    assert_eq!(q.trim(), "PD JobHeldUser");
    user.ok(&["scontrol", "release", &waiting.to_string()]);
    let q = user.ok(&["squeue", "-h", "-j", &waiting.to_string(), "-o", "%t %r"]);
    assert_eq!(
        q.trim(),
        "PD BeginTime",
        "released, still waiting for its time"
    );
    user.ok(&["scancel", &waiting.to_string()]);

    // Hostile: an upload whose content is not its name, a blob of another
    // account, inputs that were never uploaded.
    let http = reqwest::Client::new();
    let named = hex::encode(sha2::Sha256::digest(b"what it claims"));
    let answer = http
        .put(format!("{}/v1/blobs/{named}", user.api))
        .bearer_auth(&user.token)
        .body("something else")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 422);
    let theirs = up.token("intruder");
    let answer = http
        .get(format!("{}/v1/blobs/{}", user.api, want.trim()))
        .bearer_auth(&theirs)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 404, "another account read a blob");
    let api = shoal_testkit::ApiClient::new(&user.api, &theirs);
    let answer = api
        .call(
            reqwest::Method::POST,
            "/v1/sweeps",
            Some(serde_json::json!({
                "name": "steal", "template": "base", "command": "cat /x", "cells": [0],
                "inputs": [{"path": "/x", "digest": named, "size": 3}],
            })),
        )
        .await;
    assert_eq!(answer.status, 422, "{}", answer.text);
    assert!(answer.text.contains("not uploaded"), "{}", answer.text);

    drop(up);
    let _ = std::fs::remove_dir_all(&state);
}

#[test]
fn lab_jobs_carry_their_data_on_sqlite() {
    shoal_testkit::with_database(
        Database::Sqlite,
        "vm_sbatch_data_sqlite",
        |url, state| async move { lab_jobs_carry_their_data(&url, state).await },
    );
}

#[test]
fn lab_jobs_carry_their_data_on_postgres() {
    shoal_testkit::with_database(
        Database::Postgres,
        "vm_sbatch_data_pg",
        |url, state| async move { lab_jobs_carry_their_data(&url, state).await },
    );
}

/// The commands people type beyond submitting: MaxRSS and TotalCPU in
/// sacct and seff, sinfo, scancel --signal, a warm-start array, and a
/// failed task's kept sandbox entered with shoal debug (a command, and the
/// WebSocket terminal it is built on).
async fn the_commands_people_type(database_url: &str, state: PathBuf) {
    let _ = std::fs::remove_dir_all(&state);
    std::fs::create_dir_all(&state).unwrap();
    let up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
        .database_url(database_url)
        .start()
        .await;
    let submit = state.join("submit");
    std::fs::create_dir_all(&submit).unwrap();
    let user = User {
        dir: submit.clone(),
        api: up.base().to_owned(),
        token: up.token("ops"),
    };

    // MaxRSS and TotalCPU: the task's processes' peak and CPU time.
    let (hungry, _) = user.sbatch(&[
        "--cpus-per-task=1",
        "--mem=512M",
        "--wrap",
        "dd if=/dev/zero of=/dev/null bs=96M count=4 2>/dev/null; \
         dd if=/dev/zero of=/dev/null bs=1M count=3000 2>/dev/null",
    ]);
    // A task that traps USR1 for scancel --signal, and a failed one kept.
    let (trapper, _) = user.sbatch(&[
        "--output=trap.out",
        "--wrap",
        "trap 'echo got USR1; exit 0' USR1; echo ready; while true; do sleep 1; done",
    ]);
    let (broken, _) = user.sbatch(&[
        "--keep-failed=10m",
        "--wrap",
        "echo half-done > state.txt; exit 3",
    ]);
    let rows = user.wait_states(hungry, 1, &["COMPLETED"], Duration::from_secs(300));
    let usage = user.sacct(hungry, "JobID,MaxRSS,TotalCPU,CPUTime,AllocCPUS");
    println!("sacct of a 96 MiB, CPU-bound task: {usage:?} {rows:?}");
    let rss = &usage[1][1];
    let scale = match rss.chars().last() {
        Some('K') => 1.0,
        Some('M') => 1024.0,
        Some('G') => 1024.0 * 1024.0,
        _ => 1.0 / 1024.0,
    };
    let number: f64 = rss.trim_end_matches(['K', 'M', 'G']).parse().unwrap();
    let max_rss_kib = (number * scale) as u64;
    assert!(
        (96 << 10..200 << 10).contains(&max_rss_kib),
        "MaxRSS {} for a 96 MiB buffer",
        usage[1][1]
    );
    assert_ne!(usage[1][2], "", "TotalCPU is blank");
    assert_eq!(usage[1][4], "1");
    let seff = user.ok(&["seff", &hungry.to_string()]);
    println!("{seff}");
    assert!(seff.contains(&format!("Job ID: {hungry}")), "{seff}");
    assert!(seff.contains("State: COMPLETED (exit code 0)"), "{seff}");
    assert!(
        seff.contains("Memory Efficiency: ") && seff.contains("of 512.00 MB"),
        "{seff}"
    );
    assert!(seff.contains("Unused allocation:"), "{seff}");

    // sinfo: the templates as partitions on this host.
    let info = user.ok(&["sinfo"]);
    println!("{info}");
    assert!(info.starts_with("PARTITION"), "{info}");
    assert!(
        info.lines()
            .any(|l| l.starts_with("base") && l.contains(" up ")),
        "{info}"
    );
    let nodes = user.ok(&["sinfo", "-N", "-h"]);
    assert!(!nodes.is_empty() && !nodes.contains("NODELIST"), "{nodes}");

    // scancel --signal: the task traps it and ends on its own.
    let lines = watch_lines(&submit.join("trap.out"), "ready", Duration::from_secs(300));
    assert_eq!(lines[0].0, "ready");
    user.ok(&["scancel", "--signal=USR1", &trapper.to_string()]);
    user.wait_states(trapper, 1, &["COMPLETED"], Duration::from_secs(120));
    let lines = watch_lines(
        &submit.join("trap.out"),
        "got USR1",
        Duration::from_secs(60),
    );
    let lines: Vec<&str> = lines.iter().map(|(l, _)| l.as_str()).collect();
    // Every process got it (`--full`): bash may also report (on stderr,
    // before or after) that its `sleep` ended.
    assert_eq!(lines[0], "ready");
    assert!(lines.contains(&"got USR1"), "{lines:?}");

    // --keep-failed: the failed task's sandbox, hibernated, entered with a
    // command in the task's directory.
    user.wait_states(broken, 1, &["FAILED"], Duration::from_secs(180));
    let out = user.shoal(&["debug", &broken.to_string(), "--", "cat", "state.txt"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "half-done\n");
    // The terminal itself: a shell of the size asked, its exit code; and
    // refusals (no token, a bad size).
    let api = shoal_testkit::ApiClient::new(&user.api, &user.token);
    let cells = api
        .ok(
            reqwest::Method::GET,
            &format!("/v1/sweeps/{broken}/cells"),
            None,
        )
        .await;
    let sandbox = cells["cells"][0]["sandbox_id"].as_str().unwrap().to_owned();
    let ws = user.api.replacen("http://", "ws://", 1);
    let url = format!(
        "{ws}/v1/sandboxes/{sandbox}/exec/pty?rows=30&cols=100&cwd={}",
        submit.display()
    );
    use futures::{SinkExt as _, StreamExt as _};
    use tokio_tungstenite::tungstenite::{client::IntoClientRequest as _, Message};
    let mut request = url.clone().into_client_request().unwrap();
    request.headers_mut().insert(
        "authorization",
        format!("Bearer {}", user.token).parse().unwrap(),
    );
    let (mut socket, _) = tokio_tungstenite::connect_async(request).await.unwrap();
    socket
        .send(Message::Binary(
            b"stty size; cat state.txt; exit 7\n".to_vec().into(),
        ))
        .await
        .unwrap();
    let mut screen = Vec::new();
    let mut exit = None;
    let deadline = Instant::now() + Duration::from_secs(120);
    while exit.is_none() && Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(60), socket.next()).await {
            Ok(Some(Ok(Message::Binary(bytes)))) => screen.extend_from_slice(&bytes),
            Ok(Some(Ok(Message::Text(text)))) => {
                let v: Value = serde_json::from_str(&text).unwrap();
                exit = Some(v["exit"].as_i64().unwrap_or_else(|| panic!("{text}")));
            }
            Ok(Some(Ok(_))) => {}
            other => panic!("the terminal ended early: {other:?}"),
        }
    }
    let screen = String::from_utf8_lossy(&screen);
    println!("terminal: {screen:?}");
    assert_eq!(exit, Some(7));
    assert!(screen.contains("30 100"), "{screen}");
    assert!(screen.contains("half-done"), "{screen}");
    let refused = tokio_tungstenite::connect_async(url.as_str()).await;
    assert!(refused.is_err(), "a terminal without a token");
    let mut bad = format!("{ws}/v1/sandboxes/{sandbox}/exec/pty?rows=0")
        .into_client_request()
        .unwrap();
    bad.headers_mut().insert(
        "authorization",
        format!("Bearer {}", user.token).parse().unwrap(),
    );
    assert!(tokio_tungstenite::connect_async(bad).await.is_err());
    let mut theirs = url.into_client_request().unwrap();
    theirs.headers_mut().insert(
        "authorization",
        format!("Bearer {}", up.token("stranger")).parse().unwrap(),
    );
    assert!(
        tokio_tungstenite::connect_async(theirs).await.is_err(),
        "another account's terminal"
    );

    // Warm start: a 20 s prelude once, six 1 s tasks two at a time.
    user.write(
        "warm.sh",
        "#!/bin/bash\n#SBATCH --array=1-6%2\n#SBATCH --output=warm_%a.out\n\
         #SHOAL --prelude\nsleep 20\necho loaded > /tmp/model\n#SHOAL --end-prelude\n\
         cat /tmp/model\nsleep 1\n",
    );
    let started = Instant::now();
    let (warm, _) = user.sbatch(&["warm.sh"]);
    let rows = user.wait_states(warm, 6, &["COMPLETED"], Duration::from_secs(300));
    let took = started.elapsed().as_secs_f64();
    println!("warm start: 6 tasks of 1 s, 2 at a time, after a 20 s prelude: {took:.1} s (cold: about 66 s)\n{rows:?}");
    for (i, row) in rows[1..].iter().enumerate() {
        assert!(
            seconds(&row[4]) < 15,
            "task {i} ran the prelude itself: {row:?}"
        );
    }
    for task in 1..=6 {
        assert_eq!(
            wait_for_file(
                &submit.join(format!("warm_{task}.out")),
                Duration::from_secs(60)
            ),
            "loaded\n"
        );
    }
    assert!(took < 55.0, "the warm array took {took:.1} s");
    let seff = user.ok(&["seff", &warm.to_string()]);
    assert!(seff.contains("Warm start: the 2"), "{seff}");
    println!("{seff}");

    drop(up);
    let _ = std::fs::remove_dir_all(&state);
}

#[test]
fn the_commands_people_type_on_sqlite() {
    shoal_testkit::with_database(
        Database::Sqlite,
        "vm_sbatch_commands_sqlite",
        |url, state| async move { the_commands_people_type(&url, state).await },
    );
}

#[test]
fn the_commands_people_type_on_postgres() {
    shoal_testkit::with_database(
        Database::Postgres,
        "vm_sbatch_commands_pg",
        |url, state| async move { the_commands_people_type(&url, state).await },
    );
}
