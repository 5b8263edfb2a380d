//! The values the store reads and writes: accounts and tiers, sandbox rows and
//! patches, usage samples and reports, snapshots, sweeps, hosts, apps. Plain
//! data; no SQL here.

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

/// The largest volume anyone may make, whatever the tier: 64 GiB.
pub const MAX_VOLUME_MB: u64 = 65536;

/// Volume quotas, checked by [`Store::create_volume`](crate::Store::create_volume).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeLimits {
    /// Volumes an account may hold at once.
    pub count: u32,
    /// Size of one volume, in MB (MiB).
    pub size_mb: u64,
    /// Provisioned size of all its volumes together, in MB.
    pub total_mb: u64,
}

impl VolumeLimits {
    /// The SDK's plans: Free 1 × 1 GiB; Pro 10 × 10 GiB, 100 GiB in all;
    /// Team 50 × 50 GiB, 2.5 TiB in all.
    pub fn default_for(tier: Tier) -> VolumeLimits {
        let (count, size_mb, total_mb) = match tier {
            Tier::Free => (1, 1024, 1024),
            Tier::Pro => (10, 10 * 1024, 100 * 1024),
            Tier::Team => (50, 50 * 1024, 2560 * 1024),
        };
        VolumeLimits {
            count,
            size_mb,
            total_mb,
        }
    }
}

/// Snapshot quotas, checked by [`Store::record_snapshot`](crate::Store::record_snapshot):
/// a snapshot holds a copy of its sandbox's memory and disk on a host's
/// state disk until it is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotLimits {
    /// Snapshots an account may hold at once.
    pub count: u32,
    /// Bytes of all its snapshots together (their `size_bytes`: what the
    /// host's disk holds for them).
    pub total_bytes: u64,
    /// The largest disk (`size_mb`) a template imported from a root
    /// filesystem or an image may have, and so the largest upload.
    pub template_disk_mib: u32,
}

impl SnapshotLimits {
    /// Free 5 snapshots, 10 GiB in all, template disks up to 4 GiB; Pro
    /// 50, 100 GiB, 16 GiB; Team 500, 1 TiB, 64 GiB. Templates count as
    /// snapshots (each names one).
    pub fn default_for(tier: Tier) -> SnapshotLimits {
        let (count, total_gib, disk_gib) = match tier {
            Tier::Free => (5, 10, 4),
            Tier::Pro => (50, 100, 16),
            Tier::Team => (500, 1024, 64),
        };
        SnapshotLimits {
            count,
            total_bytes: total_gib << 30,
            template_disk_mib: disk_gib << 10,
        }
    }
}

/// A volume about to be recorded, on the host that makes its image.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewVolume {
    pub name: String,
    pub size_mb: u64,
    pub host: String,
}

/// One volume as stored, with the live sandboxes it is attached to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeRow {
    pub account_id: i64,
    pub name: String,
    pub size_mb: u64,
    pub host: String,
    pub created_at: f64,
    /// Ids of the live sandboxes holding it, oldest attachment first.
    pub attached_to: Vec<String>,
    /// Whether one of them holds it read-write.
    pub attached_read_write: bool,
}

/// A volume a new sandbox asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRequest {
    pub name: String,
    pub read_only: bool,
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
    /// Set by a front for the sandboxes of a host silent too long
    /// ([`Store::lose_sandboxes_of_stale_hosts`](crate::Store::lose_sandboxes_of_stale_hosts))
    /// or revoked.
    pub const LOST: &str = "lost";
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
    /// The host that makes it: recorded at admission, so that host's agent
    /// owns the row from the start (and no other agent touches it).
    pub host: Option<String>,
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
    /// Why it is `failed` ("out of memory", ...), when it is.
    pub status_reason: Option<String>,
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
    pub status_reason: Option<String>,
    /// Replaces the whole metadata object.
    pub metadata: Option<Metadata>,
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

/// An account's own template: a name for one of its snapshots, which new
/// sandboxes restore from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateRow {
    pub account_id: i64,
    pub name: String,
    pub snapshot_id: String,
    /// The first-party template the snapshot's memory image derives from.
    pub base: String,
    /// The process started before the capture (running in every sandbox
    /// of the template), and the command that said it was ready.
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
    /// Every account may create sandboxes from it (an operator's choice).
    pub published: bool,
    pub created_at: f64,
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
    /// The size of the VM it restores (`None` for snapshots recorded
    /// before sizes were).
    pub vcpus: Option<i64>,
    pub memory_mib: Option<i64>,
}

/// App statuses (see ARCHITECTURE.md, "Apps"). Only `deleted` frees the
/// app's name; only `deleted` and `failed` are left alone by the reconciler.
pub mod app_status {
    /// Waiting for the reconciler to make its sandbox and start it.
    pub const DEPLOYING: &str = "deploying";
    pub const RUNNING: &str = "running";
    /// Its sandbox is hibernated: no QEMU process, no memory held.
    pub const HIBERNATED: &str = "hibernated";
    pub const WAKING: &str = "waking";
    /// A deploy or wake was refused for capacity or quota; retried at
    /// `next_attempt_at`.
    pub const WAITING_CAPACITY: &str = "waiting_capacity";
    pub const FAILED: &str = "failed";
    pub const DELETED: &str = "deleted";
}

/// What the caller decided about a new app.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewApp {
    /// Made by the caller; unique across all accounts.
    pub id: String,
    /// Unique among the account's apps that are not deleted.
    pub name: String,
    pub config: AppConfig,
    /// The host whose control plane drives it.
    pub host: Option<String>,
}

/// How an app runs: what a redeploy would change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AppConfig {
    pub template: String,
    pub start_cmd: String,
    pub port: u16,
    pub env: Metadata,
    pub idle_seconds: u64,
}

/// Where an app is in its life; written whole by
/// [`Store::set_app_state`](crate::Store::set_app_state).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AppState {
    pub status: String,
    pub sandbox_id: Option<String>,
    /// Refused attempts of the current deploy or wake.
    pub attempts: u32,
    pub next_attempt_at: Option<f64>,
    pub last_error: Option<String>,
}

/// One app as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AppRow {
    pub id: String,
    pub account_id: i64,
    pub name: String,
    pub config: AppConfig,
    pub state: AppState,
    pub host: Option<String>,
    pub created_at: f64,
    /// When `state.status` last changed.
    pub status_at: f64,
    pub last_request_at: Option<f64>,
    pub deleted_at: Option<f64>,
}

/// A change to an app's configuration: every `Some` field is written.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AppConfigPatch {
    pub template: Option<String>,
    pub start_cmd: Option<String>,
    pub port: Option<u16>,
    pub env: Option<Metadata>,
    pub idle_seconds: Option<u64>,
}

/// What a sweep is as a whole. Stored as its lowercase name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SweepState {
    /// Waiting for the sweeps of its `after_ok` to finish well; nothing is
    /// claimed from it. Becomes `active`, or `cancelled` when one of them
    /// ends otherwise ([`Store::resolve_held`](crate::Store::resolve_held)).
    Held,
    /// Its pending cells may be claimed.
    Active,
    /// Cancelled by its owner: nothing more is claimed; cells that were
    /// running end as they end (see [`Store::finish_cell`](crate::Store::finish_cell)).
    Cancelled,
    /// Every cell reached a terminal state while the sweep was active.
    Done,
}

impl SweepState {
    pub fn as_str(self) -> &'static str {
        match self {
            SweepState::Held => "held",
            SweepState::Active => "active",
            SweepState::Cancelled => "cancelled",
            SweepState::Done => "done",
        }
    }
}

impl fmt::Display for SweepState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SweepState {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<SweepState, StoreError> {
        match s {
            "held" => Ok(SweepState::Held),
            "active" => Ok(SweepState::Active),
            "cancelled" => Ok(SweepState::Cancelled),
            "done" => Ok(SweepState::Done),
            other => Err(StoreError::Corrupt(format!("sweep state {other:?}"))),
        }
    }
}

/// Where one cell of a sweep is. Stored as its lowercase name.
///
/// `pending` → `running` (claimed) → `succeeded` | `failed` | `timeout` |
/// `cancelled`, or back to `pending` (a retry, an expired lease, a released
/// claim, a requeue of `failed`/`timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CellState {
    Pending,
    Running,
    Succeeded,
    Failed,
    Timeout,
    Cancelled,
}

impl CellState {
    /// Every state, in the order above.
    pub const ALL: [CellState; 6] = [
        CellState::Pending,
        CellState::Running,
        CellState::Succeeded,
        CellState::Failed,
        CellState::Timeout,
        CellState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CellState::Pending => "pending",
            CellState::Running => "running",
            CellState::Succeeded => "succeeded",
            CellState::Failed => "failed",
            CellState::Timeout => "timeout",
            CellState::Cancelled => "cancelled",
        }
    }

    /// Whether the cell is finished for good (only a requeue reopens
    /// `failed` and `timeout`).
    pub fn is_terminal(self) -> bool {
        !matches!(self, CellState::Pending | CellState::Running)
    }
}

impl fmt::Display for CellState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CellState {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<CellState, StoreError> {
        CellState::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| StoreError::Corrupt(format!("cell state {s:?}")))
    }
}

/// A sweep as its owner asked for it, before it exists.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NewSweep {
    /// Made by the caller; unique across all accounts.
    pub id: String,
    pub account_id: i64,
    pub name: String,
    pub template: String,
    /// The command each cell runs (the caller substitutes `{cell}`).
    pub command: String,
    /// Environment of every cell's command.
    pub env: Metadata,
    /// The cell values, in order: cell `idx` is `cells[idx]`.
    pub cells: Vec<String>,
    /// At most this many cells running at once (0 pauses the sweep).
    pub throttle: u32,
    pub timeout_seconds: u64,
    /// Attempts a cell gets before a failure or timeout is final (at least 1
    /// in effect: the first claim is always allowed).
    pub max_attempts: u32,
    /// Paths to collect from each cell's sandbox.
    pub collect: Vec<String>,
    /// How the cells' sandboxes are made from a set-up sandbox, if they are
    /// (e.g. `{"setup": "pip install ..."}`); the store keeps it as given.
    pub fork_from: Option<serde_json::Value>,
    /// Ids of sweeps (any account's: the caller checks ownership) that must
    /// be `done` with every cell `succeeded` first; the sweep is `held`
    /// until then.
    pub after_ok: Vec<String>,
    /// Working directory of the command; None for the runner's default.
    pub workdir: Option<String>,
    /// Path -> base64 content, written into each cell's sandbox.
    pub files: BTreeMap<String, String>,
    /// What the Slurm bridge said of the job; kept as given.
    pub slurm: Option<serde_json::Value>,
    /// Inputs written into each cell's sandbox from the account's blobs,
    /// and the directories whose new files come back as blobs.
    pub data_path: Option<DataPath>,
    /// Held until released (`--hold`).
    pub hold: bool,
    /// Not started before (epoch seconds; `--begin`).
    pub begin_at: Option<f64>,
}

/// A job's data path: the files of its submit directory, by content, and
/// where its tasks' results are looked for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPath {
    pub inputs: Vec<InputFile>,
    /// Absolute directories whose new and changed regular files (any
    /// depth) are kept as blobs when a task ends.
    pub results_under: Vec<String>,
}

/// One input file: where it goes in the sandbox, and its blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputFile {
    pub path: String,
    pub digest: String,
    pub size: u64,
    /// Permission bits; written without write permission.
    pub mode: u32,
}

/// One sweep as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepRow {
    pub id: String,
    pub account_id: i64,
    pub name: String,
    pub template: String,
    pub command: String,
    pub env: Metadata,
    pub cells: Vec<String>,
    pub throttle: u32,
    pub timeout_seconds: u64,
    pub max_attempts: u32,
    pub collect: Vec<String>,
    pub fork_from: Option<serde_json::Value>,
    pub state: SweepState,
    pub created_at: f64,
    /// When the last cell reached a terminal state (also for a cancelled
    /// sweep); None while any cell is pending or running.
    pub finished_at: Option<f64>,
    /// The first of the block of job ids the sweep took (one per cell):
    /// cell `idx` is job `job_id + idx`.
    pub job_id: u64,
    /// Why the sweep is held or was cancelled by the runner
    /// (`Dependency`, `DependencyNeverSatisfied`), else None.
    pub reason: Option<String>,
    pub after_ok: Vec<String>,
    pub workdir: Option<String>,
    pub files: BTreeMap<String, String>,
    pub slurm: Option<serde_json::Value>,
    pub data_path: Option<DataPath>,
    pub user_hold: bool,
    pub begin_at: Option<f64>,
    /// How long its `fork_from` setup took (once it ran).
    pub prelude_seconds: Option<f64>,
    /// When a cell was first claimed.
    pub started_at: Option<f64>,
}

/// One cell as stored. The outcome fields (`exit_code` to `error`) describe
/// the last attempt that finished; the usage fields add up every attempt.
/// `claim_id` and `lease_expires_at` are set exactly while the cell is
/// `running`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellRow {
    pub sweep_id: String,
    pub idx: u32,
    pub value: String,
    pub state: CellState,
    /// Claims so far (reset by a requeue).
    pub attempts: u32,
    pub claim_id: Option<String>,
    /// Raised by every claim, never reset: a fencing token that orders claims.
    pub claim_epoch: u64,
    pub lease_expires_at: Option<f64>,
    /// The runner of the last claim.
    pub claimed_by: Option<String>,
    /// When the last claim was made.
    pub started_at: Option<f64>,
    /// When the cell reached its terminal state.
    pub finished_at: Option<f64>,
    pub exit_code: Option<i32>,
    pub elapsed_ms: Option<u64>,
    pub stdout_tail: Option<String>,
    pub stderr_tail: Option<String>,
    pub collected: Option<serde_json::Value>,
    pub sandbox_id: Option<String>,
    pub cpu_seconds: f64,
    pub gib_seconds: f64,
    pub cost_usd: f64,
    pub error: Option<String>,
    /// The signal that ended the last attempt's command.
    pub signal: Option<i32>,
    /// Whether stdout or stderr of the last attempt was cut to its end.
    pub output_truncated: bool,
    /// Peak resident KiB and CPU milliseconds of the last attempt's command.
    pub max_rss_kib: Option<u64>,
    pub task_cpu_ms: Option<u64>,
    /// The last attempt's phases in milliseconds, as the runner gave them.
    pub timings: Option<serde_json::Value>,
    /// This cell alone was cancelled while it ran.
    pub cancel_requested: bool,
}

/// A cell a runner claimed: it must run it, renew the lease while it runs,
/// and finish (or release) it with `claim_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claim {
    pub sweep_id: String,
    pub idx: u32,
    pub value: String,
    /// Random and fresh for every claim; every later write about this
    /// attempt must present it.
    pub claim_id: String,
    /// The cell's `claim_epoch` after this claim.
    pub epoch: u64,
    /// Which attempt this is, from 1.
    pub attempt: u32,
    pub lease_expires_at: f64,
}

/// How an attempt at a cell ended, as the runner saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CellEnd {
    Succeeded,
    Failed,
    Timeout,
    Cancelled,
}

impl CellEnd {
    /// The state the cell takes if the attempt is final.
    pub fn state(self) -> CellState {
        match self {
            CellEnd::Succeeded => CellState::Succeeded,
            CellEnd::Failed => CellState::Failed,
            CellEnd::Timeout => CellState::Timeout,
            CellEnd::Cancelled => CellState::Cancelled,
        }
    }
}

/// What [`Store::finish_cell`](crate::Store::finish_cell) records of one attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellOutcome {
    pub end: CellEnd,
    pub exit_code: Option<i32>,
    pub elapsed_ms: Option<u64>,
    pub stdout_tail: Option<String>,
    pub stderr_tail: Option<String>,
    /// What was collected of the sweep's `collect` paths, as the runner
    /// describes it (the store keeps it as given).
    pub collected: Option<serde_json::Value>,
    pub sandbox_id: Option<String>,
    /// Usage of this attempt; the store prices it with its rate card.
    pub cpu_seconds: f64,
    pub gib_seconds: f64,
    pub error: Option<String>,
    pub finished_at: f64,
    pub signal: Option<i32>,
    pub output_truncated: bool,
    /// The attempt's phases in milliseconds (kept as given).
    pub timings: Option<serde_json::Value>,
    /// Peak resident KiB and CPU milliseconds of the command's process.
    pub max_rss_kib: Option<u64>,
    pub task_cpu_ms: Option<u64>,
}

impl CellOutcome {
    /// An outcome with `end` at `finished_at` and nothing else recorded.
    pub fn new(end: CellEnd, finished_at: f64) -> CellOutcome {
        CellOutcome {
            end,
            exit_code: None,
            elapsed_ms: None,
            stdout_tail: None,
            stderr_tail: None,
            collected: None,
            sandbox_id: None,
            cpu_seconds: 0.0,
            gib_seconds: 0.0,
            error: None,
            finished_at,
            signal: None,
            output_truncated: false,
            timings: None,
            max_rss_kib: None,
            task_cpu_ms: None,
        }
    }
}

/// What [`Store::renew_lease`](crate::Store::renew_lease) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Renewal {
    /// The claim holds and its lease was extended.
    Renewed,
    /// The claim holds and its lease was extended, but the sweep (or this
    /// cell alone) was cancelled: kill the sandbox, then finish the cell (it records
    /// `cancelled` unless the attempt succeeded).
    Cancelled,
    /// The claim was lost (its lease expired and was swept, or the cell was
    /// finished): stop, kill the sandbox, record nothing.
    Lost,
}

impl Renewal {
    /// Whether the claim still holds.
    pub fn is_held(self) -> bool {
        self != Renewal::Lost
    }
}

/// Cells of one sweep per state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SweepCounts {
    pub pending: u64,
    pub running: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub timeout: u64,
    pub cancelled: u64,
}

impl SweepCounts {
    pub fn get(&self, state: CellState) -> u64 {
        match state {
            CellState::Pending => self.pending,
            CellState::Running => self.running,
            CellState::Succeeded => self.succeeded,
            CellState::Failed => self.failed,
            CellState::Timeout => self.timeout,
            CellState::Cancelled => self.cancelled,
        }
    }

    pub(crate) fn get_mut(&mut self, state: CellState) -> &mut u64 {
        match state {
            CellState::Pending => &mut self.pending,
            CellState::Running => &mut self.running,
            CellState::Succeeded => &mut self.succeeded,
            CellState::Failed => &mut self.failed,
            CellState::Timeout => &mut self.timeout,
            CellState::Cancelled => &mut self.cancelled,
        }
    }

    pub fn total(&self) -> u64 {
        CellState::ALL.into_iter().map(|s| self.get(s)).sum()
    }

    /// Cells in a terminal state.
    pub fn finished(&self) -> u64 {
        self.succeeded + self.failed + self.timeout + self.cancelled
    }

    /// Finished cells as a fraction of all (1.0 for a sweep of no cells).
    pub fn progress(&self) -> f64 {
        match self.total() {
            0 => 1.0,
            total => self.finished() as f64 / total as f64,
        }
    }
}

/// Which cells [`Store::list_cells`](crate::Store::list_cells) returns, in
/// index order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CellFilter {
    /// Only cells in this state.
    pub state: Option<CellState>,
    /// Only cells after this index (a page cursor).
    pub after: Option<u32>,
    /// At most this many.
    pub limit: Option<u32>,
    /// Skipping this many of those that pass first.
    pub offset: Option<u32>,
}

/// Cells of one sweep per state, and what all their attempts used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SweepSummary {
    pub counts: SweepCounts,
    pub cpu_seconds: f64,
    pub gib_seconds: f64,
    pub cost_usd: f64,
}

/// What [`Store::resolve_held`](crate::Store::resolve_held) changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldResolution {
    /// Sweeps whose dependencies all finished well: now `active`.
    pub activated: Vec<String>,
    /// Sweeps a dependency of which ended otherwise: now `cancelled`.
    pub cancelled: Vec<String>,
}

/// What a host agent reports when it registers and at every heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostReport {
    /// The host's name, unique in the fleet.
    pub id: String,
    /// Where the control plane reaches the agent.
    pub url: String,
    pub vcpus: u32,
    /// Fraction of CPU time busy since the previous report, 0.0 to 1.0.
    pub cpu_busy: f64,
    pub memory_mib: u64,
    /// `MemAvailable`: what new sandboxes may still take.
    pub available_mib: u64,
    /// Memory the host keeps for itself.
    pub reserve_mib: u64,
    /// Sandboxes held (running, paused).
    pub sandboxes: u32,
    pub max_sandboxes: Option<u32>,
    /// Pss of all its VM processes.
    pub pss_mib: u64,
    /// A draining host takes no new sandboxes.
    pub draining: bool,
}

/// A host as the control planes see it: its last report, when it came, and
/// what was placed on it since.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostRow {
    pub report: HostReport,
    /// Drained by the operator (`shoal host drain`): no new sandboxes.
    #[serde(default)]
    pub drained: bool,
    pub registered_at: f64,
    pub heartbeat_at: f64,
    /// Creates placed on the host that its last report does not show.
    pub in_flight_sandboxes: u32,
    pub in_flight_memory_mib: u64,
    pub in_flight_cpu_share: f64,
}

impl HostRow {
    /// Whether its last heartbeat is at most `stale_after` seconds old.
    pub fn is_fresh(&self, now: f64, stale_after: f64) -> bool {
        now - self.heartbeat_at <= stale_after
    }
}

/// A create placed on a host, to be marked done or dropped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewPlacement {
    pub host_id: String,
    pub memory_mib: u64,
    pub cpu_share: f64,
}

/// Template build statuses, in the order a build goes through them.
pub mod build_status {
    pub const QUEUED: &str = "queued";
    pub const BUILDING: &str = "building";
    pub const DONE: &str = "done";
    pub const FAILED: &str = "failed";
}

/// A template build (issue 21): a Dockerfile on its way to an account's
/// template.
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateBuildRow {
    pub id: String,
    pub account_id: i64,
    /// The template it makes.
    pub name: String,
    /// One of [`build_status`].
    pub status: String,
    pub error: Option<String>,
    /// Digest of the base and the instructions with what they read.
    pub cache_key: Option<String>,
    /// The snapshot the template names, once done.
    pub snapshot_id: Option<String>,
    /// The host whose process accepted it, holds its live log and runs it.
    pub host: Option<String>,
    /// Done by naming an identical earlier build's snapshot.
    pub cache_hit: bool,
    pub created_at: f64,
    pub started_at: Option<f64>,
    pub ended_at: Option<f64>,
}
