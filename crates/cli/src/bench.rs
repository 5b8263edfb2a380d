//! `shoal bench engine`: measures the engine on the real VM path and writes
//! one JSON object. Every figure comes from real QEMU restores of a baked
//! template; nothing here is simulated.

use anyhow::{Context, Result};
use serde_json::json;
use shoal_engine::Engine;
use shoal_proto::client::ExecRequest;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct EngineBenchArgs {
    #[command(flatten)]
    engine: super::EngineArgs,
    /// Where to write the JSON report.
    #[arg(long)]
    json: PathBuf,
    #[arg(long, default_value = "code-interpreter")]
    template: String,
    /// Samples of create (and of create + first exec).
    #[arg(long, default_value_t = 100)]
    samples: usize,
    /// Exec round trips on one sandbox.
    #[arg(long, default_value_t = 200)]
    exec_samples: usize,
    /// Fork-16 repetitions.
    #[arg(long, default_value_t = 5)]
    fork_samples: usize,
    /// Idle sandboxes held at once for the density figure.
    #[arg(long, default_value_t = 100)]
    idle: usize,
    /// The guest agent binary, for the cold-boot figure.
    #[arg(long, env = "SHOAL_GUEST_AGENT")]
    guest_agent: Option<PathBuf>,
}

/// Pause before each exec-round-trip sample, so each one measures an exec
/// on a sandbox at rest (the guest refills its warm shells between execs);
/// back-to-back execs are reported separately as a burst figure.
const EXEC_SPACING: Duration = Duration::from_millis(100);

/// `{"n","p50","p95","p99","max"}` of samples in milliseconds.
pub fn summary(samples: &[f64]) -> serde_json::Value {
    let mut sorted = samples.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pick = |q: f64| -> f64 {
        if sorted.is_empty() {
            return 0.0;
        }
        let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        round(sorted[rank - 1])
    };
    json!({
        "n": sorted.len(),
        "p50": pick(0.50),
        "p95": pick(0.95),
        "p99": pick(0.99),
        "max": sorted.last().copied().map(round).unwrap_or(0.0),
    })
}

/// Runs `check` in the guest until it exits 0, or fails after `deadline`.
async fn wait_until(
    agent: &shoal_proto::client::AgentClient,
    check: &str,
    deadline: Duration,
) -> Result<()> {
    let start = Instant::now();
    loop {
        if agent.exec_collect(exec(check)).await?.status.code == Some(0) {
            return Ok(());
        }
        anyhow::ensure!(
            start.elapsed() < deadline,
            "`{check}` did not succeed in the guest within {deadline:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn round(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

pub async fn engine(args: EngineBenchArgs) -> Result<()> {
    let engine = args.engine.open().await?;
    let template = args.template.as_str();
    engine.template(template).with_context(|| {
        format!("template {template} is not ready; run `shoal template build {template}`")
    })?;
    let result = run(&engine, &args).await;
    engine.kill_all().await;
    let report = result?;
    std::fs::write(&args.json, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", args.json.display()))?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

async fn run(engine: &Engine, args: &EngineBenchArgs) -> Result<serde_json::Value> {
    let template = args.template.as_str();
    let progress = indicatif::ProgressBar::new((args.samples * 2) as u64);
    progress.set_message("create");

    let mut create_ms = Vec::new();
    for _ in 0..args.samples {
        let start = Instant::now();
        let sandbox = engine.create(template, None).await?;
        create_ms.push(ms(start));
        engine.kill(&sandbox.id).await?;
        progress.inc(1);
    }

    let mut create_exec_ms = Vec::new();
    for _ in 0..args.samples {
        let start = Instant::now();
        let sandbox = engine.create(template, None).await?;
        let agent = engine.agent(&sandbox.id).await?;
        let out = agent.exec_collect(exec("true")).await?;
        create_exec_ms.push(ms(start));
        anyhow::ensure!(out.status.code == Some(0), "`true` failed in the guest");
        engine.kill(&sandbox.id).await?;
        progress.inc(1);
    }
    progress.finish_and_clear();

    let sandbox = engine.create(template, None).await?;
    let agent = engine.agent(&sandbox.id).await?;
    let mut exec_rtt_ms = Vec::new();
    for _ in 0..args.exec_samples {
        tokio::time::sleep(EXEC_SPACING).await;
        let start = Instant::now();
        let out = agent.exec_collect(exec("true")).await?;
        exec_rtt_ms.push(ms(start));
        anyhow::ensure!(out.status.code == Some(0), "`true` failed in the guest");
    }
    let mut exec_burst_ms = Vec::new();
    for _ in 0..args.exec_samples {
        let start = Instant::now();
        let out = agent.exec_collect(exec("true")).await?;
        exec_burst_ms.push(ms(start));
        anyhow::ensure!(out.status.code == Some(0), "`true` failed in the guest");
    }

    // Fork a sandbox that is doing something: a Python process holding state.
    // The forks start once that process is in its loop: a fork measured
    // while the parent is still starting Python would count the parent's own
    // start-up (under TCG about a second of CPU) as contention.
    agent
        .exec_collect(exec(
            "rm -f /tmp/bench-loop-running; nohup python3 -c 'import time\nopen(\"/tmp/bench-loop-running\", \"w\").close()\nn=0\nwhile True:\n    n+=1\n    time.sleep(0.01)' >/dev/null 2>&1 &",
        ))
        .await?;
    wait_until(
        &agent,
        "test -e /tmp/bench-loop-running",
        Duration::from_secs(60),
    )
    .await?;
    let mut fork_first_ms = Vec::new();
    let mut fork_all_ms = Vec::new();
    for _ in 0..args.fork_samples {
        let start = Instant::now();
        let fork = engine.fork(&sandbox.id, 16).await?;
        fork_all_ms.push(ms(start));
        let first = fork
            .children
            .iter()
            .map(|c| c.restore_ms)
            .fold(f64::INFINITY, f64::min);
        fork_first_ms.push(fork.capture_ms + first);
        for child in fork.children {
            engine.kill(&child.id).await?;
        }
    }
    engine.kill(&sandbox.id).await?;

    let mut idle = Vec::new();
    for _ in 0..args.idle {
        idle.push(engine.create(template, None).await?.id);
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut pss_total = 0u64;
    let mut answered = 0usize;
    for id in &idle {
        if let Some(usage) = engine.usage(id)? {
            pss_total += usage.pss_bytes;
        }
        let agent = engine.agent(id).await?;
        if tokio::time::timeout(Duration::from_secs(10), agent.ping())
            .await
            .is_ok_and(|r| r.is_ok())
        {
            answered += 1;
        }
    }
    for id in &idle {
        engine.kill(id).await?;
    }

    let cold_boot_ms = match super::guest_agent_path(args.guest_agent.clone()) {
        Ok(agent) => Some(engine.measure_cold_boot(template, &agent).await?),
        Err(_) => None,
    };

    Ok(json!({
        "accel": engine.accel().as_str(),
        "template": template,
        "qemu": engine.qemu_version(),
        "create_ms": summary(&create_ms),
        "create_exec_ms": summary(&create_exec_ms),
        "exec_rtt_ms": summary(&exec_rtt_ms),
        "exec_spacing_ms": EXEC_SPACING.as_millis() as u64,
        "exec_burst_rtt_ms": summary(&exec_burst_ms),
        "fork16_first_ms": summary(&fork_first_ms),
        "fork16_all_ms": summary(&fork_all_ms),
        "idle_count": answered,
        "idle_pss_mib": round(pss_total as f64 / idle.len().max(1) as f64 / (1 << 20) as f64),
        "cold_boot_ms": cold_boot_ms.map(round),
    }))
}

fn exec(cmd: &str) -> ExecRequest {
    ExecRequest {
        cmd: cmd.to_string(),
        timeout: Some(Duration::from_secs(60)),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_uses_nearest_rank_percentiles() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = summary(&samples);
        assert_eq!(s["n"], 100);
        assert_eq!(s["p50"], 50.0);
        assert_eq!(s["p95"], 95.0);
        assert_eq!(s["p99"], 99.0);
        assert_eq!(s["max"], 100.0);
    }
}

#[derive(clap::Args)]
pub struct ApiBenchArgs {
    /// Where `shoal up` serves.
    #[arg(long, default_value = "http://127.0.0.1:8080", env = "PANDASTACK_API")]
    url: String,
    /// An API token (a pro or team account, so quotas do not cut the run).
    #[arg(long, env = "PANDASTACK_API_KEY")]
    token: String,
    /// Where to write the JSON report.
    #[arg(long)]
    json: PathBuf,
    #[arg(long, default_value = "code-interpreter")]
    template: String,
    /// Creates through HTTP.
    #[arg(long, default_value_t = 100)]
    samples: usize,
    /// Exec round trips through HTTP on one sandbox.
    #[arg(long, default_value_t = 200)]
    exec_samples: usize,
    /// Seconds of `GET /v1/sandboxes/{id}` load.
    #[arg(long, default_value_t = 10)]
    get_seconds: u64,
    /// Concurrent connections for the GET load.
    #[arg(long, default_value_t = 32)]
    connections: usize,
}

/// `shoal bench api`: create, exec and GET through a running `shoal up`.
pub async fn api(args: ApiBenchArgs) -> Result<()> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.connections * 2)
        .build()?;
    let base = args.url.trim_end_matches('/').to_string();
    let auth = format!("Bearer {}", args.token);
    let create = || async {
        let response = client
            .post(format!("{base}/v1/sandboxes"))
            .header("Authorization", &auth)
            .json(&json!({ "template": args.template }))
            .send()
            .await?;
        anyhow::ensure!(
            response.status() == 201,
            "create answered {}: {}",
            response.status(),
            response.text().await?
        );
        let body: serde_json::Value = response.json().await?;
        let id = body["id"].as_str().unwrap_or_default().to_string();
        Ok::<(String, f64), anyhow::Error>((id, body["boot_ms"].as_f64().unwrap_or(0.0)))
    };
    let delete = |id: String| {
        let request = client
            .delete(format!("{base}/v1/sandboxes/{id}"))
            .header("Authorization", &auth);
        async move {
            let status = request.send().await?.status();
            anyhow::ensure!(status == 204, "delete answered {status}");
            Ok::<(), anyhow::Error>(())
        }
    };

    let progress = indicatif::ProgressBar::new((args.samples + args.exec_samples) as u64);
    // The server reports each create's own restore time (boot_ms); what the
    // client saw beyond it is the API's overhead (HTTP, auth, admission, rows),
    // measured on the same creates rather than against another run.
    let mut create_ms = Vec::new();
    let mut overhead_ms = Vec::new();
    for _ in 0..args.samples {
        let start = Instant::now();
        let (id, boot_ms) = create().await?;
        let took = ms(start);
        create_ms.push(took);
        overhead_ms.push(took - boot_ms);
        delete(id).await?;
        progress.inc(1);
    }

    let (id, _) = create().await?;
    let mut exec_rtt_ms = Vec::new();
    for _ in 0..args.exec_samples {
        tokio::time::sleep(EXEC_SPACING).await;
        let start = Instant::now();
        let response = client
            .post(format!("{base}/v1/sandboxes/{id}/exec"))
            .header("Authorization", &auth)
            .json(&json!({ "cmd": "true" }))
            .send()
            .await?;
        anyhow::ensure!(
            response.status() == 200,
            "exec answered {}",
            response.status()
        );
        let _ = response.bytes().await?;
        exec_rtt_ms.push(ms(start));
        progress.inc(1);
    }
    progress.finish_and_clear();
    let ws = ws_exec_rtt(&base, &args.token, &id, args.exec_samples).await?;

    let deadline = Instant::now() + Duration::from_secs(args.get_seconds);
    let url = reqwest::Url::parse(&format!("{base}/v1/sandboxes/{id}"))?;
    let workers: Vec<_> = (0..args.connections)
        .map(|_| tokio::spawn(get_load(url.clone(), auth.clone(), deadline)))
        .collect();
    let started = Instant::now();
    let mut total = 0u64;
    for worker in workers {
        total += worker.await??;
    }
    let get_rps = total as f64 / started.elapsed().as_secs_f64();
    delete(id).await?;

    let report = json!({
        "url": base,
        "template": args.template,
        "create_ms": summary(&create_ms),
        "create_overhead_ms": summary(&overhead_ms),
        "exec_rtt_ms": summary(&exec_rtt_ms),
        "exec_spacing_ms": EXEC_SPACING.as_millis() as u64,
        "ws_exec_rtt_ms": summary(&ws.rtt_ms),
        "ws_exec_burst": {
            "commands": ws.burst_commands,
            "in_flight": ws.burst_commands,
            "seconds": round(ws.burst_seconds),
            "per_second": round(ws.burst_commands as f64 / ws.burst_seconds),
        },
        "get_rps": round(get_rps),
        "get_connections": args.connections,
    });
    std::fs::write(&args.json, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", args.json.display()))?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

struct WsExec {
    rtt_ms: Vec<f64>,
    burst_commands: usize,
    burst_seconds: f64,
}

/// Exec round trips over one multiplexed WebSocket (`/exec/ws`): `samples`
/// one at a time with the HTTP exec's spacing, then 100 sent at once.
async fn ws_exec_rtt(base: &str, token: &str, id: &str, samples: usize) -> Result<WsExec> {
    use futures::{SinkExt as _, StreamExt as _};
    use tokio_tungstenite::tungstenite::Message;
    let ws_base = base
        .replacen("https://", "wss://", 1)
        .replacen("http://", "ws://", 1);
    let url = format!("{ws_base}/v1/sandboxes/{id}/exec/ws?access_token={token}");
    let (mut socket, _) = tokio_tungstenite::connect_async(url).await?;
    async fn answer(
        socket: &mut (impl futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>>
                  + Unpin),
    ) -> Result<serde_json::Value> {
        loop {
            match socket.next().await {
                Some(Ok(Message::Text(text))) => return Ok(serde_json::from_str(&text)?),
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(e.into()),
                None => anyhow::bail!("the exec socket closed"),
            }
        }
    }
    let mut rtt_ms = Vec::new();
    for i in 0..samples {
        tokio::time::sleep(EXEC_SPACING).await;
        let start = Instant::now();
        let request = json!({ "id": format!("rtt-{i}"), "cmd": "true" });
        socket
            .send(Message::Text(request.to_string().into()))
            .await?;
        let reply = answer(&mut socket).await?;
        anyhow::ensure!(reply["exit"] == 0, "ws exec answered {reply}");
        rtt_ms.push(ms(start));
    }
    let burst_commands = 100;
    let start = Instant::now();
    for i in 0..burst_commands {
        let request = json!({ "id": format!("burst-{i}"), "cmd": "true" });
        socket
            .send(Message::Text(request.to_string().into()))
            .await?;
    }
    let mut exited = 0;
    while exited < burst_commands {
        let reply = answer(&mut socket).await?;
        anyhow::ensure!(reply.get("error").is_none(), "ws exec answered {reply}");
        if reply.get("exit").is_some() {
            exited += 1;
        }
    }
    let burst_seconds = start.elapsed().as_secs_f64();
    let _ = socket.close(None).await;
    Ok(WsExec {
        rtt_ms,
        burst_commands,
        burst_seconds,
    })
}

/// GETs `url` on one kept-alive HTTP/1.1 connection until `deadline`;
/// returns how many answered 200. A bare hyper connection rather than a
/// pooled client: the load generator shares the machine with the server,
/// so its own work per request is kept small.
async fn get_load(url: reqwest::Url, auth: String, deadline: Instant) -> Result<u64> {
    use http_body_util::{BodyExt, Empty};
    let address = format!(
        "{}:{}",
        url.host_str().unwrap_or("127.0.0.1"),
        url.port_or_known_default().unwrap_or(80)
    );
    let stream = tokio::net::TcpStream::connect(&address).await?;
    stream.set_nodelay(true)?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let request = hyper::Request::get(url.path())
        .header(hyper::header::HOST, address.as_str())
        .header(hyper::header::AUTHORIZATION, auth.as_str())
        .body(Empty::<hyper::body::Bytes>::new())?;
    let mut done = 0u64;
    while Instant::now() < deadline {
        sender.ready().await?;
        let response = sender.send_request(request.clone()).await?;
        anyhow::ensure!(
            response.status() == 200,
            "get answered {}",
            response.status()
        );
        response.into_body().collect().await?;
        done += 1;
    }
    Ok(done)
}
