//! `shoal bench fleet`: a fleet's front measured against real agents.
//!
//! Three figures, each from real work: creates of real VMs through the front
//! and, as the baseline, straight to one agent (the single-host path, same
//! run, same machine); placement decisions per second, each the front's own
//! read of the hosts and its recorded reservation in the real database; and
//! how evenly a burst of creates spreads over the hosts, read back from the
//! sandboxes' rows. `scripts/bench-fleet` starts the fleet this runs against.

use crate::bench::summary;
use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};
use shoal_fleet::front::{Front, FrontConfig};
use shoal_store::Store;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct FleetBenchArgs {
    /// The fleet's front (`shoal server`).
    #[arg(long)]
    url: String,
    /// One agent's own address: the single-host baseline.
    #[arg(long)]
    agent_url: String,
    /// That agent's host name, and the fronts' secret: the bench speaks to
    /// the agent as a front does (agents answer nothing else).
    #[arg(long)]
    agent_name: String,
    #[arg(long, env = "SHOAL_FLEET_TOKEN")]
    fleet_token: String,
    /// An API token (a team account, so quotas do not cut the run).
    #[arg(long, env = "PANDASTACK_API_KEY")]
    token: String,
    /// The fleet's database: where placements are decided and homes read.
    #[arg(long, env = "SHOAL_DATABASE_URL")]
    database_url: String,
    /// Where to write the JSON report.
    #[arg(long)]
    json: PathBuf,
    #[arg(long, default_value = "code-interpreter")]
    template: String,
    /// Creates (each followed by its delete) through the front, and as many
    /// straight to the agent.
    #[arg(long, default_value_t = 50)]
    samples: usize,
    /// Creates held at once for the spread figure.
    #[arg(long, default_value_t = 100)]
    spread: usize,
    /// Creates in flight at once during the spread burst.
    #[arg(long, default_value_t = 10)]
    burst: usize,
    /// Seconds of placement decisions.
    #[arg(long, default_value_t = 5)]
    placement_seconds: u64,
}

struct Api {
    http: reqwest::Client,
    auth: String,
    template: String,
    /// The agent's address and the front key it wants.
    agent: (String, String),
}

impl Api {
    /// A request as a client sends it to the front, or as a front sends it
    /// to the agent.
    fn request(&self, method: reqwest::Method, base: &str, path: &str) -> reqwest::RequestBuilder {
        let request = self
            .http
            .request(method, format!("{base}{path}"))
            .header("Authorization", &self.auth);
        if base == self.agent.0 {
            request.header(shoal_fleet::FRONT_KEY_HEADER, &self.agent.1)
        } else {
            request
        }
    }

    async fn create(&self, base: &str) -> Result<String> {
        let response = self
            .request(reqwest::Method::POST, base, "/v1/sandboxes")
            .json(&json!({ "template": self.template }))
            .send()
            .await?;
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        ensure!(status == 201, "create answered {status}: {body}");
        Ok(body["id"].as_str().unwrap_or_default().to_owned())
    }

    async fn delete(&self, base: &str, id: &str) -> Result<()> {
        let status = self
            .request(
                reqwest::Method::DELETE,
                base,
                &format!("/v1/sandboxes/{id}"),
            )
            .send()
            .await?
            .status();
        ensure!(status == 204, "delete of {id} answered {status}");
        Ok(())
    }

    /// Create-then-delete `samples` times; the creates' latencies.
    async fn create_latencies(&self, base: &str, samples: usize) -> Result<Vec<f64>> {
        let mut took = Vec::with_capacity(samples);
        for _ in 0..samples {
            let start = Instant::now();
            let id = self.create(base).await?;
            took.push(start.elapsed().as_secs_f64() * 1000.0);
            self.delete(base, &id).await?;
        }
        Ok(took)
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

pub async fn fleet(args: FleetBenchArgs) -> Result<()> {
    let store = Store::connect(&args.database_url)
        .await
        .with_context(|| format!("opening {}", args.database_url))?;
    let hosts = store.hosts(now()).await?;
    let live: Vec<&str> = hosts
        .iter()
        .filter(|h| h.is_fresh(now(), shoal_fleet::STALE_AFTER.as_secs_f64()))
        .map(|h| h.report.id.as_str())
        .collect();
    ensure!(!live.is_empty(), "no live agent in the fleet");
    let api = Api {
        http: reqwest::Client::builder().tcp_nodelay(true).build()?,
        auth: format!("Bearer {}", args.token),
        template: args.template.clone(),
        agent: (
            args.agent_url.trim_end_matches('/').to_owned(),
            shoal_fleet::front_key(&args.fleet_token, &args.agent_name),
        ),
    };
    let front = args.url.trim_end_matches('/');
    let agent = api.agent.0.as_str();

    // Interleaved in rounds, so neither path has the quieter machine.
    let mut through_front = Vec::new();
    let mut single_host = Vec::new();
    let rounds = args.samples.div_ceil(10);
    for round in 0..rounds {
        let n = (args.samples - round * 10).min(10);
        single_host.extend(api.create_latencies(agent, n).await?);
        through_front.extend(api.create_latencies(front, n).await?);
    }

    let placements_per_s = placement_rate(&store, args.placement_seconds).await?;

    let (per_host, spread_failure) = spread(&api, &store, front, args.spread, args.burst).await;
    if let Some(e) = spread_failure {
        return Err(e);
    }
    let counts: Vec<f64> = live
        .iter()
        .map(|h| *per_host.get(*h).unwrap_or(&0) as f64)
        .collect();
    let mean = counts.iter().sum::<f64>() / counts.len() as f64;
    let max = counts.iter().copied().fold(0.0, f64::max);

    let front_summary = summary(&through_front);
    let single_summary = summary(&single_host);
    let report = json!({
        "hosts": live.len(),
        "template": args.template,
        "backend": store.backend(),
        "create_ms": front_summary,
        "single_host_create_ms": single_summary,
        "create_p50_over_single_host_ms":
            ((front_summary["p50"].as_f64().unwrap_or(0.0)
                - single_summary["p50"].as_f64().unwrap_or(0.0)) * 10.0).round() / 10.0,
        "placements_per_s": placements_per_s.round(),
        "spread_creates": args.spread,
        "spread_burst": args.burst,
        "spread_per_host": per_host,
        "spread_max_over_mean": (max / mean * 1000.0).round() / 1000.0,
    });
    std::fs::write(&args.json, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", args.json.display()))?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    store.close().await;
    Ok(())
}

/// Decisions a front makes per second: each reads the hosts with their
/// in-flight placements and records its own, as a create does. Every
/// reservation is dropped again (untimed), so the fleet never looks full.
async fn placement_rate(store: &Store, seconds: u64) -> Result<f64> {
    let front = Front::new(
        store.clone(),
        FrontConfig {
            agent_ca: None,
            fleet_token: String::new(),
            database_url: String::new(),
            lost_check: Duration::from_secs(3600),
        },
    )?;
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut deciding = Duration::ZERO;
    let mut decisions = 0u64;
    while Instant::now() < deadline {
        let start = Instant::now();
        let (_, _, placement) = front
            .place(None)
            .await
            .map_err(|r| anyhow::anyhow!("placement refused: {}", r.status()))?;
        deciding += start.elapsed();
        decisions += 1;
        store.drop_placement(&placement).await?;
    }
    Ok(decisions as f64 / deciding.as_secs_f64())
}

/// `count` creates through the front, `burst` in flight at a time, then
/// where each landed (from the rows) and every one deleted. The deletes run
/// even when a create failed; the error comes back with what was counted.
async fn spread(
    api: &Api,
    store: &Store,
    front: &str,
    count: usize,
    burst: usize,
) -> (BTreeMap<String, usize>, Option<anyhow::Error>) {
    use futures::stream::{self, StreamExt};
    let results: Vec<Result<String>> = stream::iter(0..count)
        .map(|_| api.create(front))
        .buffer_unordered(burst.max(1))
        .collect()
        .await;
    let mut ids = Vec::new();
    let mut failure = None;
    for result in results {
        match result {
            Ok(id) => ids.push(id),
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    let mut per_host = BTreeMap::new();
    for id in &ids {
        match store.sandbox_by_id(id).await {
            Ok(Some(row)) => {
                *per_host
                    .entry(row.host.unwrap_or_else(|| "(none)".into()))
                    .or_insert(0) += 1
            }
            Ok(None) => failure = failure.or(Some(anyhow::anyhow!("no row for {id}"))),
            Err(e) => failure = failure.or(Some(e.into())),
        }
    }
    let deletes: Vec<Result<()>> = stream::iter(ids.iter())
        .map(|id| api.delete(front, id))
        .buffer_unordered(burst.max(1))
        .collect()
        .await;
    for result in deletes {
        if let Err(e) = result {
            failure = failure.or(Some(e));
        }
    }
    (per_host, failure)
}
