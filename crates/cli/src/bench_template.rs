//! `shoal bench template`: what a custom template costs and gives (issue
//! 21). Starts a `shoal up` of its own (or uses `--url` and `--token`),
//! builds a Dockerfile equal to the code-interpreter template (`FROM
//! base`, the same Debian packages with apt, the same warm-up import),
//! times the build, an unchanged rebuild (the cache: goal under a second)
//! and `--creates` creates (each then deleted) from the custom template
//! and from code-interpreter, interleaved, and writes a JSON report. Real
//! VMs only: this is the product's own path through its HTTP API.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The code-interpreter template as a Dockerfile: its packages on `base`,
/// and its bake's warm-up import.
pub const CODE_INTERPRETER_DOCKERFILE: &str = "\
FROM base
RUN apt-get update \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
      python3 python3-matplotlib python3-munkres python3-numpy python3-pandas \\
 && rm -rf /var/lib/apt/lists/*
RUN python3 -c 'import numpy, pandas'
";

#[derive(clap::Args)]
pub struct TemplateBenchArgs {
    /// Where to write the JSON report.
    #[arg(long)]
    json: PathBuf,
    /// Creates measured from each template.
    #[arg(long, default_value_t = 20)]
    creates: usize,
    /// The custom template's name.
    #[arg(long, default_value = "bench-ci")]
    name: String,
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

/// `shoal bench template`.
pub async fn template(args: TemplateBenchArgs) -> Result<()> {
    let (_server, base, token) = match (&args.url, &args.token) {
        (Some(url), Some(token)) => (None, url.clone(), token.clone()),
        (None, _) => {
            let (server, base, token) = crate::bench_exec::start_server(
                "template",
                &args.cache_dir,
                args.guest_agent.as_deref(),
            )
            .await?;
            (Some(server), base, token)
        }
        _ => bail!("--url needs --token"),
    };
    let api = Api {
        http: reqwest::Client::new(),
        base,
        auth: format!("Bearer {token}"),
    };
    let (build_s, build) = api.build(&args.name).await?;
    eprintln!("build: {build_s:.1} s ({})", build["status"]);
    let (rebuild_s, rebuild) = api.build(&args.name).await?;
    eprintln!(
        "unchanged rebuild: {rebuild_s:.2} s (cache hit: {})",
        rebuild["cache_hit"]
    );
    let mut custom = Vec::new();
    let mut first_party = Vec::new();
    for _ in 0..args.creates {
        custom.push(api.create_ms(&args.name).await?);
        first_party.push(api.create_ms("code-interpreter").await?);
    }
    let report = json!({
        "bench": "template",
        "dockerfile": CODE_INTERPRETER_DOCKERFILE,
        "build_seconds": build_s,
        "build_status": build["status"],
        "rebuild_seconds": rebuild_s,
        "rebuild_cache_hit": rebuild["cache_hit"],
        "rebuild_goal_seconds": 1.0,
        "creates": args.creates,
        "create_ms_custom": summary(&custom),
        "create_ms_code_interpreter": summary(&first_party),
        "custom_over_first_party_p50": percentile(&custom, 50.0) / percentile(&first_party, 50.0),
    });
    std::fs::write(&args.json, serde_json::to_string_pretty(&report)? + "\n")?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

struct Api {
    http: reqwest::Client,
    base: String,
    auth: String,
}

impl Api {
    /// Submits the Dockerfile as `name` and waits for the build; its
    /// seconds from submission to done, and the build.
    async fn build(&self, name: &str) -> Result<(f64, Value)> {
        let started = Instant::now();
        let submitted: Value = self
            .http
            .post(format!("{}/v1/templates/build", self.base))
            .header("Authorization", &self.auth)
            .form(&[("name", name), ("dockerfile", CODE_INTERPRETER_DOCKERFILE)])
            .send()
            .await?
            .error_for_status()
            .context("submitting the build")?
            .json()
            .await?;
        let id = submitted["id"].as_str().context("the build has no id")?;
        let deadline = started + Duration::from_secs(3600);
        loop {
            let build: Value = self
                .http
                .get(format!("{}/v1/templates/builds/{id}", self.base))
                .header("Authorization", &self.auth)
                .send()
                .await?
                .error_for_status()?
                .json()
                .await?;
            match build["status"].as_str() {
                Some("done") => return Ok((started.elapsed().as_secs_f64(), build)),
                Some("failed") => bail!("the build failed: {}", build["error"]),
                _ if Instant::now() > deadline => bail!("the build took over an hour"),
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// One create from `template`, timed to its 201; the sandbox is deleted.
    async fn create_ms(&self, template: &str) -> Result<f64> {
        let started = Instant::now();
        let created: Value = self
            .http
            .post(format!("{}/v1/sandboxes", self.base))
            .header("Authorization", &self.auth)
            .json(&json!({ "template": template }))
            .send()
            .await?
            .error_for_status()
            .with_context(|| format!("creating from {template}"))?
            .json()
            .await?;
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        let id = created["id"].as_str().context("create gave no id")?;
        self.http
            .delete(format!("{}/v1/sandboxes/{id}", self.base))
            .header("Authorization", &self.auth)
            .send()
            .await?
            .error_for_status()?;
        Ok(ms)
    }
}

fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn summary(values: &[f64]) -> Value {
    json!({
        "p50": percentile(values, 50.0),
        "p90": percentile(values, 90.0),
        "min": values.iter().copied().fold(f64::INFINITY, f64::min),
        "max": values.iter().copied().fold(0.0, f64::max),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dockerfile_parses_and_percentiles_pick_ranks() {
        let parsed = shoal_image::dockerfile::parse(CODE_INTERPRETER_DOCKERFILE).unwrap();
        assert_eq!(parsed.steps.len(), 2);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50.0), 2.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0, 5.0], 90.0), 5.0);
    }
}
