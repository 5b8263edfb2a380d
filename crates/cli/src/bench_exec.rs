//! `shoal bench exec-output`: what one plain exec of a command that prints
//! a lot costs the server's memory. Starts a `shoal up` of its own (or uses
//! one given by `--url`, `--token` and `--pid`), runs `exec` of `head -c
//! BYTES /dev/zero | tr "\0" a` through `POST /v1/sandboxes/{id}/exec`, and
//! reports the server's peak RSS (VmHWM in /proc/PID/status) before and
//! after, with what the answer held. Issue 19's goal: 2 GB of output grows
//! the peak by less than 64 MiB.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct ExecOutputBenchArgs {
    /// Where to write the JSON report.
    #[arg(long)]
    json: PathBuf,
    /// Bytes the command prints on stdout.
    #[arg(long, default_value_t = 2_000_000_000)]
    bytes: u64,
    #[arg(long, default_value = "base")]
    template: String,
    /// A running `shoal up` to measure instead of starting one (needs
    /// `--token` and `--pid`).
    #[arg(long)]
    url: Option<String>,
    #[arg(long, env = "PANDASTACK_API_KEY")]
    token: Option<String>,
    /// The pid of the `shoal up` serving `--url`.
    #[arg(long)]
    pid: Option<u32>,
    /// Template cache for the `shoal up` this starts.
    #[arg(long, env = "SHOAL_CACHE_DIR", default_value = "/var/lib/shoal")]
    cache_dir: PathBuf,
    /// The guest agent for the `shoal up` this starts.
    #[arg(long, env = "SHOAL_GUEST_AGENT")]
    guest_agent: Option<PathBuf>,
}

/// A `shoal up` this bench started; stopped (SIGTERM) when dropped.
pub(crate) struct Server {
    pub(crate) child: Child,
    state: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM, so it deletes its sandboxes' VMs on the way out.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

/// One `/proc/PID/status` field in KiB (`VmHWM`, `VmRSS`).
pub fn status_kib(pid: u32, field: &str) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    text.lines()
        .find_map(|line| {
            let rest = line.strip_prefix(field)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse().ok()
        })
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Starts a `shoal up` of the bench's own (SQLite, a fresh state dir, the
/// shared template cache) and makes a team token; its URL and the token.
pub(crate) async fn start_server(
    label: &str,
    cache_dir: &std::path::Path,
    guest_agent: Option<&std::path::Path>,
) -> Result<(Server, String, String)> {
    let shoal = std::env::current_exe()?;
    let state = std::env::temp_dir().join(format!("shoal-bench-{label}-{}", std::process::id()));
    std::fs::create_dir_all(&state)?;
    let database = format!("sqlite:{}", state.join("shoal.db").display());
    let port = free_port()?;
    let log = std::fs::File::create(state.join("up.log"))?;
    let mut command = Command::new(&shoal);
    command
        .args(["up", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--state-dir")
        .arg(&state)
        .arg("--cache-dir")
        .arg(cache_dir)
        .args(["--database-url", &database])
        .stdout(Stdio::null())
        .stderr(log);
    if let Some(agent) = guest_agent {
        command.arg("--guest-agent").arg(agent);
    }
    let child = command.spawn().context("starting shoal up")?;
    let server = Server { child, state };
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let ready = http
            .get(format!("{base}/readyz"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "shoal up did not answer /readyz; see {}",
                server.state.join("up.log").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let out = Command::new(&shoal)
        .args(["token", "create", "--account", "bench", "--tier", "team"])
        .args(["--database-url", &database])
        .arg("--state-dir")
        .arg(&server.state)
        .output()?;
    if !out.status.success() {
        bail!(
            "shoal token create: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let token = String::from_utf8(out.stdout)?
        .trim()
        .lines()
        .last()
        .unwrap_or_default()
        .to_owned();
    Ok((server, base, token))
}

/// `shoal bench exec-output`.
pub async fn exec_output(args: ExecOutputBenchArgs) -> Result<()> {
    let (_server, base, token, pid) = match (&args.url, &args.token, args.pid) {
        (Some(url), Some(token), Some(pid)) => (None, url.clone(), token.clone(), pid),
        (None, _, _) => {
            let (server, base, token) =
                start_server("exec", &args.cache_dir, args.guest_agent.as_deref()).await?;
            let pid = server.child.id();
            (Some(server), base, token, pid)
        }
        _ => bail!("--url needs --token and --pid"),
    };
    let report = measure(&args, &base, &token, pid).await?;
    std::fs::write(&args.json, serde_json::to_string_pretty(&report)? + "\n")?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

async fn measure(args: &ExecOutputBenchArgs, base: &str, token: &str, pid: u32) -> Result<Value> {
    let http = reqwest::Client::new();
    let auth = format!("Bearer {token}");
    let hwm_at_start = status_kib(pid, "VmHWM")?;
    let created: Value = http
        .post(format!("{base}/v1/sandboxes"))
        .header("Authorization", &auth)
        .json(&json!({ "template": args.template, "ttl_seconds": 3600 }))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let id = created["id"]
        .as_str()
        .context("create gave no id")?
        .to_owned();
    let exec = |cmd: String| {
        http.post(format!("{base}/v1/sandboxes/{id}/exec"))
            .header("Authorization", &auth)
            .timeout(Duration::from_secs(3 * 3600))
            .json(&json!({ "cmd": cmd }))
            .send()
    };
    // A first small exec, so what it costs once is not counted as growth.
    exec("echo warm".into()).await?.error_for_status()?;
    let hwm_before = status_kib(pid, "VmHWM")?;
    let rss_before = status_kib(pid, "VmRSS")?;
    let cmd = format!("head -c {} /dev/zero | tr \"\\0\" a", args.bytes);
    let started = Instant::now();
    let response = exec(cmd.clone()).await?;
    let status = response.status();
    let body = response.bytes().await?;
    let seconds = started.elapsed().as_secs_f64();
    let hwm_after = status_kib(pid, "VmHWM")?;
    let rss_after = status_kib(pid, "VmRSS")?;
    let answer: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let _ = http
        .delete(format!("{base}/v1/sandboxes/{id}"))
        .header("Authorization", &auth)
        .send()
        .await;
    if !status.is_success() {
        bail!("exec answered {status}: {}", String::from_utf8_lossy(&body));
    }
    let stdout_len = answer["stdout"].as_str().map_or(0, str::len);
    let growth_mib = (hwm_after.saturating_sub(hwm_before)) as f64 / 1024.0;
    Ok(json!({
        "bench": "exec-output",
        "command": cmd,
        "template": args.template,
        "printed_bytes": args.bytes,
        "seconds": seconds,
        "exit_code": answer["exit_code"],
        "answer_bytes": body.len(),
        "stdout_bytes_kept": stdout_len,
        "stdout_truncated": answer["stdout_truncated"],
        "stderr_truncated": answer["stderr_truncated"],
        "server_pid": pid,
        "server_vm_hwm_kib_at_start": hwm_at_start,
        "server_vm_hwm_kib_before": hwm_before,
        "server_vm_hwm_kib_after": hwm_after,
        "server_vm_rss_kib_before": rss_before,
        "server_vm_rss_kib_after": rss_after,
        "peak_rss_growth_mib": growth_mib,
        "goal_mib": 64,
        "within_goal": growth_mib < 64.0,
    }))
}
