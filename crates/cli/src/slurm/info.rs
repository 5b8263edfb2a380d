//! `shoal seff` and `shoal sinfo`: how well a job used what it asked for,
//! and what the fleet has, in those commands' words.
//!
//! Owns: choosing the records and the capacity to show. May not: format
//! seff's report (`shoal_slurm::seff`) or decide anything about jobs.

use anyhow::{bail, Result};
use serde_json::Value;
use std::collections::BTreeMap;

use super::api::Api;
use super::views::{records, resolve, vcpus_by_template};

/// `shoal seff JOBID[_TASK]`: one task, or every task of a job.
pub async fn seff(api: &Api, target: &str, cluster: &str) -> Result<()> {
    let job = shoal_slurm::parse_job_ref(target)?;
    let Some((sweep, index)) = resolve(api, job.job_id).await? else {
        bail!("Job not found.");
    };
    let vcpus = vcpus_by_template(api).await;
    let cells = api.cells(sweep["id"].as_str().unwrap_or("")).await?;
    let all = records(&sweep, &cells, &vcpus);
    let chosen: Vec<&shoal_slurm::JobRecord> = all
        .iter()
        .filter(|r| index.is_none() || r.job_id == job.job_id)
        .filter(|r| job.task_id.is_none() || r.task_id == job.task_id)
        .collect();
    if chosen.is_empty() {
        bail!("Job not found.");
    }
    let me = api.call(reqwest::Method::GET, "/v1/me", None).await?;
    let rates = match (
        me["rates"]["cpu_hour_usd"].as_f64(),
        me["rates"]["gib_hour_usd"].as_f64(),
    ) {
        (Some(c), Some(g)) => Some((c, g)),
        _ => None,
    };
    let template_memory = api
        .templates()
        .await
        .unwrap_or_default()
        .iter()
        .find(|t| t["name"] == sweep["template"])
        .and_then(|t| t["memory_mb"].as_u64());
    let prelude_seconds = sweep["prelude_seconds"].as_f64();
    print!(
        "{}",
        shoal_slurm::seff::format_seff(&shoal_slurm::seff::SeffInput {
            records: &chosen,
            cluster,
            rates,
            default_mem_mib: template_memory,
            prelude_seconds,
        })
    );
    Ok(())
}

/// A host as sinfo shows it: `idle` (nothing on it), `mix` (some), `alloc`
/// (full), `drain`, `down`.
fn node_state(host: &Value) -> &'static str {
    match host["state"].as_str() {
        Some("down") => return "down",
        Some("drain") => return "drain",
        _ => {}
    }
    let sandboxes = host["sandboxes"].as_u64().unwrap_or(0);
    let full_by_count = host["max_sandboxes"]
        .as_u64()
        .is_some_and(|max| sandboxes >= max);
    let free = host["available_mib"]
        .as_u64()
        .unwrap_or(0)
        .saturating_sub(host["reserve_mib"].as_u64().unwrap_or(0));
    if full_by_count || free < 256 {
        "alloc"
    } else if sandboxes == 0 {
        "idle"
    } else {
        "mix"
    }
}

/// `shoal sinfo [-N] [-h]`: partitions (templates) by host state, or one
/// line per host with its CPUs and memory.
pub async fn sinfo(api: &Api, nodes: bool, noheader: bool, default_template: &str) -> Result<()> {
    let capacity = api.call(reqwest::Method::GET, "/v1/capacity", None).await?;
    let hosts = capacity["hosts"].as_array().cloned().unwrap_or_default();
    let templates: Vec<String> = api
        .templates()
        .await?
        .iter()
        .filter_map(|t| t["name"].as_str().map(str::to_owned))
        .collect();
    let mut out = String::new();
    if nodes {
        if !noheader {
            out.push_str(&format!(
                "{:<16} {:>5} {:<20} {:>6} {:>13} {:>9} {:>9} {:>9}\n",
                "NODELIST",
                "NODES",
                "PARTITION",
                "STATE",
                "CPUS(A/I/O/T)",
                "MEMORY",
                "FREE_MEM",
                "SANDBOXES"
            ));
        }
        for h in &hosts {
            let total = h["vcpus"].as_u64().unwrap_or(0);
            let busy = h["cpu_busy"]
                .as_f64()
                .map_or(0, |b| (b * total as f64).round() as u64);
            let state = node_state(h);
            let other = if matches!(state, "down" | "drain") {
                total
            } else {
                0
            };
            let (alloc, idle) = if other > 0 {
                (0, 0)
            } else {
                (busy, total - busy.min(total))
            };
            for t in &templates {
                let star = if t == default_template { "*" } else { "" };
                out.push_str(&format!(
                    "{:<16} {:>5} {:<20} {:>6} {:>13} {:>9} {:>9} {:>9}\n",
                    h["name"].as_str().unwrap_or("?"),
                    1,
                    format!("{t}{star}"),
                    state,
                    format!("{alloc}/{idle}/{other}/{total}"),
                    h["memory_mib"].as_u64().unwrap_or(0),
                    h["available_mib"].as_u64().unwrap_or(0),
                    h["sandboxes"].as_u64().unwrap_or(0),
                ));
            }
        }
    } else {
        if !noheader {
            out.push_str(&format!(
                "{:<20} {:>5} {:>12} {:>6} {:>6} NODELIST\n",
                "PARTITION", "AVAIL", "TIMELIMIT", "NODES", "STATE"
            ));
        }
        let mut by_state: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for h in &hosts {
            by_state
                .entry(node_state(h))
                .or_default()
                .push(h["name"].as_str().unwrap_or("?"));
        }
        for t in &templates {
            let star = if t == default_template { "*" } else { "" };
            for (state, names) in &by_state {
                out.push_str(&format!(
                    "{:<20} {:>5} {:>12} {:>6} {:>6} {}\n",
                    format!("{t}{star}"),
                    "up",
                    "30-00:00:00",
                    names.len(),
                    state,
                    names.join(",")
                ));
            }
        }
    }
    print!("{out}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hosts_read_as_sinfo_states() {
        let host = |sandboxes: u64, available: u64, state: &str| {
            json!({"state": state, "sandboxes": sandboxes, "max_sandboxes": 4,
                   "available_mib": available, "reserve_mib": 1024})
        };
        assert_eq!(node_state(&host(0, 8192, "up")), "idle");
        assert_eq!(node_state(&host(2, 8192, "up")), "mix");
        assert_eq!(node_state(&host(4, 8192, "up")), "alloc");
        assert_eq!(node_state(&host(1, 1100, "up")), "alloc");
        assert_eq!(node_state(&host(0, 8192, "drain")), "drain");
        assert_eq!(node_state(&host(0, 8192, "down")), "down");
    }
}
