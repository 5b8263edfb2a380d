//! The values the store reads and writes: accounts and tiers, sandbox rows and
//! patches, usage samples and reports, snapshots. Plain data; no SQL here.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::StoreError;

/// Sandbox metadata: the caller's string labels (`{"sweep": "run-17"}`).
pub type Metadata = BTreeMap<String, String>;

/// An account's plan; decides its [`TierLimits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Free,
    Pro,
    Team,
}

impl Tier {
    /// The name stored in the database and shown to users.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Free => "free",
            Tier::Pro => "pro",
            Tier::Team => "team",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Tier {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Tier, StoreError> {
        match s {
            "free" => Ok(Tier::Free),
            "pro" => Ok(Tier::Pro),
            "team" => Ok(Tier::Team),
            other => Err(StoreError::UnknownTier(other.to_owned())),
        }
    }
}

/// Quotas checked by [`Store::admit_sandbox`](crate::Store::admit_sandbox).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierLimits {
    /// Live sandboxes (any status but `deleted` and `failed`) at once.
    pub concurrent: u32,
    /// Sandboxes created in any 3600 s window, whatever became of them.
    pub creates_per_hour: u32,
}

impl TierLimits {
    /// Free 5/60, Pro 50/600, Team 500/6000.
    pub fn default_for(tier: Tier) -> TierLimits {
        let (concurrent, creates_per_hour) = match tier {
            Tier::Free => (5, 60),
            Tier::Pro => (50, 600),
            Tier::Team => (500, 6000),
        };
        TierLimits {
            concurrent,
            creates_per_hour,
        }
    }
}

/// An authenticated account.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Account {
    pub id: i64,
    pub name: String,
    pub tier: Tier,
}

/// Sandbox statuses the store itself gives meaning to. Any other string may be
/// stored; every status but [`DELETED`](status::DELETED) and
/// [`FAILED`](status::FAILED) counts as live.
pub mod status {
    /// Set by [`Store::admit_sandbox`](crate::Store::admit_sandbox).
    pub const CREATING: &str = "creating";
    pub const RUNNING: &str = "running";
    pub const DELETED: &str = "deleted";
    pub const FAILED: &str = "failed";
}

/// What the caller decided about a sandbox before it exists.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewSandbox {
    /// Made by the caller; unique across all accounts.
    pub id: String,
    pub template: String,
    pub cpu: u32,
    pub memory_mb: u32,
    pub metadata: Metadata,
    /// Idle time after which the reaper may delete it (unless persistent).
    pub ttl_seconds: u64,
    pub persistent: bool,
    /// Age after which the reaper deletes it whatever it is doing.
    pub max_lifetime_seconds: Option<u64>,
    pub from_snapshot: Option<String>,
    pub parent_id: Option<String>,
    pub tree_id: Option<String>,
}

/// One sandbox as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxRow {
    pub id: String,
    pub account_id: i64,
    pub template: String,
    pub cpu: u32,
    pub memory_mb: u32,
    pub metadata: Metadata,
    pub ttl_seconds: u64,
    pub persistent: bool,
    pub max_lifetime_seconds: Option<u64>,
    pub from_snapshot: Option<String>,
    pub parent_id: Option<String>,
    pub tree_id: Option<String>,
    pub status: String,
    pub host: Option<String>,
    pub guest_ip: Option<String>,
    pub created_at: f64,
    pub last_activity_at: f64,
    pub running_execs: i64,
    pub boot_ms: Option<f64>,
    pub boot_mode: Option<String>,
    pub deleted_at: Option<f64>,
}

impl SandboxRow {
    /// Whether it counts against the concurrency quota and shows in lists.
    pub fn is_live(&self) -> bool {
        self.status != status::DELETED && self.status != status::FAILED
    }
}

/// A change to a sandbox: every `Some` field is written, every `None` left as it is.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SandboxPatch {
    pub status: Option<String>,
    pub host: Option<String>,
    pub guest_ip: Option<String>,
    pub boot_ms: Option<f64>,
    pub boot_mode: Option<String>,
    pub ttl_seconds: Option<u64>,
    pub persistent: Option<bool>,
    pub max_lifetime_seconds: Option<u64>,
    pub deleted_at: Option<f64>,
    /// Apply only while the sandbox has this status (e.g. do not mark a
    /// sandbox `running` that a delete has already marked `deleted`).
    pub if_status: Option<String>,
}

/// Resources one sandbox used during one metering interval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageSample {
    pub sandbox_id: String,
    /// End of the interval.
    pub at: f64,
    pub cpu_seconds: f64,
    /// Memory in GiB times seconds held.
    pub gib_seconds: f64,
    pub interval_s: f64,
}

/// Which usage to add up. Samples count when `from <= at < to`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UsageQuery {
    pub from: Option<f64>,
    pub to: Option<f64>,
    /// Every pair must be in the sandbox's metadata.
    pub metadata: Vec<(String, String)>,
    pub sandbox_id: Option<String>,
}

/// Usage of one sandbox over the queried window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageRow {
    pub sandbox_id: String,
    pub template: String,
    pub metadata: Metadata,
    pub cpu_seconds: f64,
    pub gib_seconds: f64,
    pub cost_usd: f64,
}

/// Sum over the rows of a [`UsageReport`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct UsageTotal {
    pub cpu_seconds: f64,
    pub gib_seconds: f64,
    pub cost_usd: f64,
}

/// The answer to [`Store::usage`](crate::Store::usage): one row per sandbox
/// that used anything in the window, oldest sandbox first.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UsageReport {
    pub rows: Vec<UsageRow>,
    pub total: UsageTotal,
}

/// Prices of usage, in US dollars.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RateCard {
    /// Per vCPU-hour of CPU time used (default 0.054).
    pub cpu_hour_usd: f64,
    /// Per GiB-hour of memory held (default 0.0162).
    pub gib_hour_usd: f64,
}

impl Default for RateCard {
    fn default() -> RateCard {
        RateCard {
            cpu_hour_usd: 0.054,
            gib_hour_usd: 0.0162,
        }
    }
}

impl RateCard {
    pub fn cost(&self, cpu_seconds: f64, gib_seconds: f64) -> f64 {
        cpu_seconds / 3600.0 * self.cpu_hour_usd + gib_seconds / 3600.0 * self.gib_hour_usd
    }
}

/// A snapshot an account took of one of its sandboxes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRow {
    /// Made by the caller; unique across all accounts.
    pub id: String,
    pub account_id: i64,
    /// The sandbox it was taken from.
    pub sandbox_id: Option<String>,
    pub template: String,
    pub size_bytes: Option<i64>,
    /// The host whose disk holds it.
    pub host: Option<String>,
    pub created_at: f64,
}
