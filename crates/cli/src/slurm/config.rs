//! Where the Slurm commands find the API and how partitions map to
//! templates.
//!
//! Owns: reading `SHOAL_API` / `SHOAL_API_KEY` (falling back to
//! `PANDASTACK_API` / `PANDASTACK_API_KEY`), `SHOAL_CA_FILE`, the optional JSON config file
//! (`$SHOAL_SLURM_CONFIG`, else `~/.config/shoal/slurm.json`) and the
//! `SHOAL_PARTITIONS` override. The environment wins over the file.
//!
//! May not: call the API or read job scripts.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The template a job runs on when it names no partition and asks for
/// nothing the template lacks.
pub const DEFAULT_TEMPLATE: &str = "code-interpreter";

/// The Slurm bridge's settings.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Config {
    /// Base URL of the API (`http://host:8080`, with or without `/v1`).
    pub api: Option<String>,
    pub api_key: Option<String>,
    /// A CA (PEM) to trust alone for an `https://` API, e.g. a fleet's own.
    pub ca_file: Option<PathBuf>,
    /// Partition name → template name.
    pub partitions: BTreeMap<String, String>,
    /// The template of jobs that name no partition.
    pub default_template: Option<String>,
    /// `SLURM_CLUSTER_NAME`.
    pub cluster_name: Option<String>,
}

impl Config {
    /// The file (if present), then the environment over it.
    pub fn load() -> Result<Config> {
        let mut config = match config_path() {
            Some(path) if path.exists() => {
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                serde_json::from_str(&text)
                    .with_context(|| format!("{} is not a valid config", path.display()))?
            }
            _ => Config::default(),
        };
        let env = |names: [&str; 2]| {
            names
                .iter()
                .find_map(|n| std::env::var(n).ok().filter(|v| !v.is_empty()))
        };
        if let Some(api) = env(["SHOAL_API", "PANDASTACK_API"]) {
            config.api = Some(api);
        }
        if let Some(key) = env(["SHOAL_API_KEY", "PANDASTACK_API_KEY"]) {
            config.api_key = Some(key);
        }
        if let Some(ca) = std::env::var_os("SHOAL_CA_FILE").filter(|v| !v.is_empty()) {
            config.ca_file = Some(PathBuf::from(ca));
        }
        if let Ok(map) = std::env::var("SHOAL_PARTITIONS") {
            config.partitions = parse_partitions(&map)?;
        }
        Ok(config)
    }

    /// The API's base URL without a trailing `/` or `/v1`.
    pub fn base_url(&self) -> Result<String> {
        let Some(api) = &self.api else {
            bail!(
                "no API address: set SHOAL_API (or PANDASTACK_API), or \"api\" in {}",
                shown_path()
            )
        };
        let trimmed = api.trim_end_matches('/');
        Ok(trimmed.strip_suffix("/v1").unwrap_or(trimmed).to_owned())
    }

    pub fn token(&self) -> Result<String> {
        match &self.api_key {
            Some(key) => Ok(key.clone()),
            None => bail!(
                "no API token: set SHOAL_API_KEY (or PANDASTACK_API_KEY), or \"api_key\" in {}",
                shown_path()
            ),
        }
    }

    pub fn default_template(&self) -> &str {
        self.default_template.as_deref().unwrap_or(DEFAULT_TEMPLATE)
    }

    pub fn cluster_name(&self) -> &str {
        self.cluster_name.as_deref().unwrap_or("shoal")
    }
}

/// `short=code-interpreter,long=python-data`.
fn parse_partitions(text: &str) -> Result<BTreeMap<String, String>> {
    let mut map = BTreeMap::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some((partition, template)) = item.split_once('=') else {
            bail!("SHOAL_PARTITIONS: {item:?} is not partition=template");
        };
        map.insert(partition.trim().to_owned(), template.trim().to_owned());
    }
    Ok(map)
}

fn config_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SHOAL_SLURM_CONFIG") {
        return Some(PathBuf::from(p));
    }
    let home = std::env::var_os("HOME")?;
    Some(PathBuf::from(home).join(".config/shoal/slurm.json"))
}

fn shown_path() -> String {
    config_path()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "~/.config/shoal/slurm.json".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_from_the_environment_form() {
        let map = parse_partitions("short=code-interpreter, big = python-data").unwrap();
        assert_eq!(map["short"], "code-interpreter");
        assert_eq!(map["big"], "python-data");
        assert!(parse_partitions("short").is_err());
    }

    #[test]
    fn base_url_drops_v1_and_slashes() {
        let c = Config {
            api: Some("http://h:8080/v1/".into()),
            ..Default::default()
        };
        assert_eq!(c.base_url().unwrap(), "http://h:8080");
    }
}
