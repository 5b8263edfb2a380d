//! `shoal bench slurm`: the two numbers issue 22 names, measured through
//! the real Slurm bridge on real VMs. Starts a `shoal up` of its own (or
//! uses `--url` and `--token`) and runs `shoal sbatch` as a user would.
//!
//! - Live output: a task prints its own clock (the guest's, set from the
//!   host's at restore) every second; each line's lag is when the line is
//!   first in its `.out` file on this machine minus when it was printed.
//!   Goal: every line within 2 s.
//! - Warm start: an array of `--tasks` tasks of `--task-seconds`, `--throttle`
//!   at a time, after a `--prelude-seconds` prelude, run once as a warm
//!   start (`#SHOAL --prelude`) and once cold (the same lines in every
//!   task, as on Slurm). Goal: about prelude + tasks × task time /
//!   throttle, not tasks × prelude / throttle.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct SlurmBenchArgs {
    /// Where to write the JSON report.
    #[arg(long)]
    json: PathBuf,
    /// Lines the live-output task prints, one a second.
    #[arg(long, default_value_t = 15)]
    lines: usize,
    #[arg(long, default_value_t = 20)]
    prelude_seconds: u64,
    #[arg(long, default_value_t = 6)]
    tasks: u64,
    #[arg(long, default_value_t = 1)]
    task_seconds: u64,
    #[arg(long, default_value_t = 2)]
    throttle: u64,
    /// A running `shoal up` to measure instead of starting one (needs
    /// `--token`).
    #[arg(long)]
    url: Option<String>,
    #[arg(long, env = "PANDASTACK_API_KEY")]
    token: Option<String>,
    /// Template cache for the `shoal up` this starts.
    #[arg(long, env = "SHOAL_CACHE_DIR", default_value = "/var/lib/shoal")]
    cache_dir: PathBuf,
    /// The guest agent for the `shoal up` this starts.
    #[arg(long, env = "SHOAL_GUEST_AGENT")]
    guest_agent: Option<PathBuf>,
}

/// Runs `shoal ARGS` in `dir` against the API; its stdout.
fn shoal(dir: &Path, base: &str, token: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(std::env::current_exe()?)
        .args(args)
        .current_dir(dir)
        .env("SHOAL_API", base)
        .env("SHOAL_API_KEY", token)
        .env("SHOAL_SLURM_CONFIG", dir.join("no-config.json"))
        .env_remove("SHOAL_PARTITIONS")
        .output()?;
    if !out.status.success() {
        bail!(
            "shoal {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Submits `script` in `dir`; its job id.
fn submit(dir: &Path, base: &str, token: &str, script: &str, text: &str) -> Result<String> {
    std::fs::write(dir.join(script), text)?;
    Ok(shoal(dir, base, token, &["sbatch", "--parsable", script])?
        .trim()
        .to_owned())
}

/// Waits until every task of `job` is COMPLETED; the seconds since `from`.
fn wait_done(
    dir: &Path,
    base: &str,
    token: &str,
    job: &str,
    tasks: usize,
    from: Instant,
) -> Result<f64> {
    let deadline = Instant::now() + Duration::from_secs(1800);
    loop {
        let rows = shoal(
            dir,
            base,
            token,
            &["sacct", "-j", job, "-P", "-n", "--format=State"],
        )?;
        let states: Vec<&str> = rows.lines().collect();
        if states.len() == tasks && states.iter().all(|s| *s == "COMPLETED") {
            return Ok(from.elapsed().as_secs_f64());
        }
        if states
            .iter()
            .any(|s| !matches!(*s, "COMPLETED" | "PENDING" | "RUNNING"))
        {
            bail!("job {job}: {states:?}");
        }
        if Instant::now() > deadline {
            bail!("job {job} never finished: {states:?}");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `shoal bench slurm`.
pub async fn slurm(args: SlurmBenchArgs) -> Result<()> {
    let (_server, base, token) = match (&args.url, &args.token) {
        (Some(url), Some(token)) => (None, url.clone(), token.clone()),
        (None, _) => {
            let (server, base, token) = crate::bench_exec::start_server(
                "slurm",
                &args.cache_dir,
                args.guest_agent.as_deref(),
            )
            .await?;
            (Some(server), base, token)
        }
        _ => bail!("--url needs --token"),
    };
    let dir = std::env::temp_dir().join(format!("shoal-bench-slurm-submit-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let report = tokio::task::spawn_blocking({
        let (dir, base, token) = (dir.clone(), base.clone(), token.clone());
        move || measure(&args, &dir, &base, &token)
    })
    .await??;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::write(&report.0, serde_json::to_vec_pretty(&report.1)?)
        .with_context(|| format!("writing {}", report.0.display()))?;
    println!("{}", serde_json::to_string_pretty(&report.1)?);
    Ok(())
}

fn measure(args: &SlurmBenchArgs, dir: &Path, base: &str, token: &str) -> Result<(PathBuf, Value)> {
    // Live output.
    let job = submit(
        dir,
        base,
        token,
        "live.sh",
        &format!(
            "#!/bin/bash\n#SBATCH --output=live.out\nfor i in $(seq 1 {}); do date +%s.%N; sleep 1; done\n",
            args.lines
        ),
    )?;
    let out = dir.join("live.out");
    let mut lags = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(600);
    while lags.len() < args.lines {
        if Instant::now() > deadline {
            bail!(
                "live output: {} of {} lines arrived",
                lags.len(),
                args.lines
            );
        }
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        let seen_at = unix_now();
        for line in text.lines().skip(lags.len()) {
            let printed: f64 = line
                .trim()
                .parse()
                .with_context(|| format!("line {line:?}"))?;
            lags.push(seen_at - printed);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_done(dir, base, token, &job, 1, Instant::now())?;
    let mut sorted = lags.clone();
    sorted.sort_by(f64::total_cmp);
    let live = json!({
        "lines": lags.len(),
        "lag_seconds": lags.iter().map(|l| (l * 1000.0).round() / 1000.0).collect::<Vec<_>>(),
        "p50_seconds": sorted[sorted.len() / 2],
        "max_seconds": sorted[sorted.len() - 1],
        "goal_seconds": 2.0,
        "met": sorted[sorted.len() - 1] <= 2.0,
    });
    eprintln!("live output: {live}");

    // Warm start, then cold.
    let header = format!(
        "#!/bin/bash\n#SBATCH --array=1-{}%{}\n#SBATCH --output=/dev/null\n",
        args.tasks, args.throttle
    );
    let prelude = format!("sleep {}\necho loaded > /tmp/model\n", args.prelude_seconds);
    let task = format!("cat /tmp/model\nsleep {}\n", args.task_seconds);
    let warm_script = format!("{header}#SHOAL --prelude\n{prelude}#SHOAL --end-prelude\n{task}");
    let cold_script = format!("{header}{prelude}{task}");
    let started = Instant::now();
    let warm_job = submit(dir, base, token, "warm.sh", &warm_script)?;
    let warm_s = wait_done(dir, base, token, &warm_job, args.tasks as usize, started)?;
    let started = Instant::now();
    let cold_job = submit(dir, base, token, "cold.sh", &cold_script)?;
    let cold_s = wait_done(dir, base, token, &cold_job, args.tasks as usize, started)?;
    let expected_warm = args.prelude_seconds as f64
        + (args.tasks * args.task_seconds) as f64 / args.throttle as f64;
    let expected_cold =
        (args.tasks * (args.prelude_seconds + args.task_seconds)) as f64 / args.throttle as f64;
    let warm = json!({
        "tasks": args.tasks,
        "throttle": args.throttle,
        "prelude_seconds": args.prelude_seconds,
        "task_seconds": args.task_seconds,
        "warm_seconds": warm_s,
        "cold_seconds": cold_s,
        "ideal_warm_seconds": expected_warm,
        "ideal_cold_seconds": expected_cold,
        "speedup": cold_s / warm_s,
        "met": warm_s < expected_cold / 2.0,
    });
    eprintln!("warm start: {warm}");
    let report = json!({
        "bench": "slurm",
        "date": chrono::Utc::now().to_rfc3339(),
        "host": std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim(),
        "cores": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "accelerator": "see shoal up's log (tcg on hosts without KVM)",
        "live_output": live,
        "warm_start": warm,
    });
    Ok((args.json.clone(), report))
}
