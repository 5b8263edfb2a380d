//! The sweep runner: turns the sweep rows of the database into commands run
//! in sandboxes, one fresh sandbox per attempt at a cell.
//!
//! Owns: claiming cells (woken at once by a new sweep, a requeue or a raised
//! throttle, else polling), the life of one attempt (sandbox, files,
//! command, lease renewal, collect, usage, delete, outcome), the `fork_from`
//! parents of this control plane, and the periodic pass that expires
//! leases, decides held sweeps and deletes parents of finished sweeps.
//!
//! May not: talk to VMs except through [`shoal_host::HostAgent`], or to the
//! database except through [`shoal_store::Store`]. The store decides which
//! cell runs and what an outcome does to it (retries, cancel, fencing); the
//! runner only reports what happened under the claim it holds.
//!
//! # One attempt
//!
//! 1. Claimed: the cell is `running` under a fresh claim id and a lease,
//!    renewed every third of its length until the attempt ends. At most
//!    `max_starting` attempts do steps 2 and 3 up to the command's start at
//!    once; the others wait their turn.
//! 2. A sandbox: a restore of the template, or a fork of the sweep's parent
//!    (`fork_from`), admitted like any create (host slot first, then the
//!    account's quota) with metadata `sweep=<id>`. A refusal (host full,
//!    memory short, quota) or a lost sandbox gives the claim back uncounted
//!    and backs the runner off: the fleet, not the command, failed.
//! 3. `workdir` made, `files` written, the command run with `{cell}`
//!    replaced, the sweep's and Slurm's environment and the timeout; a
//!    renewal that finds the claim lost or the cell cancelled stops it.
//! 4. `collect` globs read back, usage read, the sandbox deleted, always;
//!    then the outcome is recorded with the claim id (a lost claim records
//!    nothing).

use crate::job_data::{self, InputError};
use crate::{now, ControlPlane};
use base64::Engine as _;
use serde_json::{json, Value};
use shoal_host::{CpuPriority, CreateOptions, EngineError, HostError, Source, Usage};
use shoal_proto::client::{AgentClient, AgentError, ExecEvent, ExecRequest};
use shoal_proto::ErrorKind;
use shoal_store::{
    Account, CellEnd, CellOutcome, CellState, Claim, NewSandbox, Renewal, StoreError, SweepRow,
    SweepState,
};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify, OnceCell};

/// Settings of the runner.
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// Whether `start_background` starts the runner at all.
    pub enabled: bool,
    /// Attempts this control plane runs at once, over all sweeps (each
    /// sweep's throttle applies as well).
    pub max_running: usize,
    /// How often the runner looks for cells when nothing woke it.
    pub poll: Duration,
    /// A claim's lease; renewed every third of it.
    pub lease: Duration,
    /// How often leases are expired, held sweeps decided and parents of
    /// finished sweeps deleted.
    pub housekeeping: Duration,
    /// Attempts starting at once (sandbox create, files, command start);
    /// 0 for no limit. The rest wait their turn, holding their claim.
    pub max_starting: usize,
    /// The CPU priority of a sandbox while its command runs (it is normal
    /// while it starts and while its files are collected).
    pub command_priority: CpuPriority,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        RunnerConfig {
            enabled: true,
            max_running: 32,
            poll: Duration::from_millis(300),
            lease: Duration::from_secs(30),
            housekeeping: Duration::from_secs(2),
            max_starting: default_max_starting(),
            command_priority: CpuPriority::Background,
        }
    }
}

/// One start per two cores (at least one): a restore and the first exec in
/// a fresh guest are CPU-bound (under TCG, mostly code translation), and
/// each keeps about two threads busy (QEMU or the guest's vCPU, and this
/// process). Twenty at once on two cores each take ten times as long and
/// the first command starts only when nearly all of them have; in turns,
/// each start takes about its uncontended time. Measured at throttle 20 on
/// two cores, with commands in the background: per-task overhead p50
/// 358 ms with one turn, 391 ms with two.
pub fn default_max_starting() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

/// stdout and stderr are each kept up to this much (the end).
pub const MAX_OUTPUT: usize = 1 << 20;
/// One collected file at most.
pub const MAX_COLLECT_FILE: u64 = 8 << 20;
/// All of a cell's collected files at most.
pub const MAX_COLLECT_TOTAL: u64 = 32 << 20;
/// Working directory when the sweep names none.
pub const DEFAULT_WORKDIR: &str = "/root";
/// Added to the timeout for a sandbox's hard lifetime: create and collect.
const LIFETIME_MARGIN_SECONDS: u64 = 300;
/// The longest grace between SIGTERM and SIGKILL at a time limit (inside
/// the lifetime margin).
const MAX_KILL_WAIT_SECONDS: u64 = 120;
/// How long the host waits past the guest's own timeout before it gives the
/// command up (a guest too wedged to report its timeout).
const HOST_TIMEOUT_MARGIN: Duration = Duration::from_secs(30);
/// Backoff after a refusal: first, and most.
const BACKOFF_MIN: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Times this runner gives a cell back for a lost sandbox before it counts
/// the loss as a failed attempt (a command that kills its VM every time).
const MAX_LOSSES: u32 = 3;
/// `error` carries at most this much of a failed setup's output.
const SETUP_OUTPUT: usize = 4096;

const GIB: f64 = (1u64 << 30) as f64;

/// What one control plane's runner holds in memory. Nothing here is needed
/// after a crash: the database has the claims, and a restart gives back
/// those this runner held ([`shoal_store::Store::release_runner_claims`]).
#[derive(Default)]
pub struct Runner {
    wake: Notify,
    in_flight: AtomicUsize,
    /// Attempts running here, by claim id: how a cancel reaches them.
    running: Mutex<HashMap<String, watch::Sender<bool>>>,
    /// `fork_from` parents by sweep id.
    parents: Mutex<HashMap<String, Arc<Parent>>>,
    /// What a sweep's attempts need, by sweep id.
    sweeps: Mutex<HashMap<String, Arc<SweepInfo>>>,
    /// No claims before this instant (after a refusal), and the last delay.
    backoff: Mutex<Option<(Instant, Duration)>>,
    /// Sandboxes lost per claimed cell, by "sweep/idx".
    losses: Mutex<HashMap<String, u32>>,
    /// When this control plane last dropped old job data.
    last_garbage: Mutex<Option<Instant>>,
    /// Turns to start an attempt ([`RunnerConfig::max_starting`]), made at
    /// the first attempt.
    starting: std::sync::OnceLock<Option<tokio::sync::Semaphore>>,
}

/// A sweep as its attempts use it, read once.
struct SweepInfo {
    row: SweepRow,
    account: Account,
    /// The array figures of Slurm's environment.
    array: shoal_slurm::ArraySpec,
    /// Whether every cell value is an integer (then it is the task id).
    integer_cells: bool,
    files: Vec<(String, Vec<u8>)>,
    /// What its sandboxes are made from: the template, or the snapshot of
    /// an account's own template (`templates.rs`), at the tasks' size.
    source: Source,
    /// The account's snapshot its template names, for the rows (`source`
    /// may be a sized copy of it, which is the host's, not the account's).
    named_snapshot: Option<String>,
    vcpus: u32,
    memory_mib: u32,
}

impl SweepInfo {
    /// The snapshot its sandboxes restore, for their rows.
    fn restored_snapshot(&self) -> Option<String> {
        self.named_snapshot.clone()
    }
}

/// The VM a task gets: the template's size, or less where the job asked
/// for less (`cpus_per_task`; `mem_mib`, or `mem_per_cpu_mib` times the
/// CPUs), never more, and never under the smallest a guest runs in.
fn task_size(slurm: Option<&Value>, restored: &shoal_host::Manifest) -> crate::sandboxes::VmSize {
    let number = |key: &str| slurm.and_then(|s| s.get(key)).and_then(Value::as_u64);
    let vcpus = number("cpus_per_task").map_or(restored.vcpus, |c| {
        c.clamp(1, u64::from(restored.vcpus)) as u32
    });
    let floor = u64::from(shoal_host::imports::MIN_SIZED_MEMORY_MIB.min(restored.memory_mib));
    let memory_mib = number("mem_mib")
        .filter(|m| *m > 0)
        .or_else(|| number("mem_per_cpu_mib").map(|m| m.saturating_mul(u64::from(vcpus))))
        .map_or(restored.memory_mib, |m| {
            m.clamp(floor, u64::from(restored.memory_mib)) as u32
        });
    crate::sandboxes::VmSize { vcpus, memory_mib }
}

/// The set-up sandbox of a `fork_from` sweep, made once by the first
/// attempt that needs it.
#[derive(Default)]
struct Parent {
    state: OnceCell<ParentState>,
    /// Held while forking, and while deleting (never both).
    fork_lock: tokio::sync::Mutex<()>,
}

#[derive(Clone)]
enum ParentState {
    Ready(String),
    /// The setup failed: every cell fails with this as its error.
    SetupFailed(String),
}

/// Why an attempt stopped before its command could run.
enum Refusal {
    /// The fleet said no for now (capacity, memory, quota): give the claim
    /// back and back off.
    Retry(String),
    /// The attempt failed for good (the retries of the sweep apply).
    Fail(String),
}

/// Milliseconds of each phase of an attempt.
#[derive(Default, Clone, Copy)]
struct Timings {
    create: u64,
    exec: u64,
    run: u64,
    collect: u64,
    delete: u64,
}

impl Timings {
    fn json(&self) -> Value {
        json!({
            "create": self.create,
            "exec": self.exec,
            "run": self.run,
            "collect": self.collect,
            "delete": self.delete,
        })
    }
}

fn ms(since: Instant) -> u64 {
    since.elapsed().as_millis() as u64
}

impl Runner {
    /// Makes the runner look for cells now (a new sweep, a requeue, a
    /// raised throttle, a finished attempt).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Stops the attempts of `claims` that run here: their sandboxes are
    /// deleted and the cells recorded as their claims' end says (the store
    /// makes a cancelled cell `cancelled`). Claims held by other control
    /// planes learn it at their next renewal.
    pub fn cancel(&self, claims: &[Claim]) {
        let running = self.running.lock().unwrap();
        for claim in claims {
            if let Some(cancel) = running.get(&claim.claim_id) {
                let _ = cancel.send(true);
            }
        }
    }

    fn backing_off(&self) -> bool {
        matches!(*self.backoff.lock().unwrap(), Some((until, _)) if Instant::now() < until)
    }

    fn back_off(&self) {
        let mut backoff = self.backoff.lock().unwrap();
        let delay = match *backoff {
            Some((_, last)) => (last * 2).min(BACKOFF_MAX),
            None => BACKOFF_MIN,
        };
        *backoff = Some((Instant::now() + delay, delay));
    }

    fn clear_backoff(&self) {
        *self.backoff.lock().unwrap() = None;
    }
}

/// Starts the runner and its housekeeping. First deletes the sandboxes of
/// the attempts and fork parents a previous life of this control plane
/// left (adopted VMs after a crash) and gives back the claims it held.
pub async fn spawn(cp: Arc<ControlPlane>) -> Result<(), StoreError> {
    // After a crash the VMs outlive the last life (the engine adopted
    // them), but its attempts do not: their commands' streams ended with
    // it. Their sandboxes go before their claims are given back, and so do
    // the fork parents it made (this life makes its own).
    let mut stale = cp
        .store
        .runner_claim_sandboxes(&cp.config.host_name)
        .await?;
    for row in cp.store.list_all_live().await? {
        let parent = cp.is_ours(&row)
            && row.metadata.get("sweep_role").map(String::as_str) == Some("parent");
        let of_a_sweep = match row.metadata.get("sweep") {
            Some(sweep) if parent => cp.store.get_sweep(row.account_id, sweep).await?.is_some(),
            _ => false,
        };
        if of_a_sweep {
            stale.push(row.id);
        }
    }
    for id in &stale {
        tracing::info!(
            sandbox = id,
            "deleting a sweep's sandbox of the previous run"
        );
        destroy(&cp, id).await;
    }
    let released = cp
        .store
        .release_runner_claims(&cp.config.host_name, now())
        .await?;
    if released > 0 {
        tracing::info!(
            released,
            "gave back the claims of this control plane's previous run"
        );
    }
    let keeper = cp.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(keeper.config.sweeps.housekeeping);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            housekeeping(&keeper).await;
        }
    });
    tokio::spawn(claim_loop(cp));
    Ok(())
}

async fn claim_loop(cp: Arc<ControlPlane>) {
    let config = cp.config.sweeps.clone();
    let runner = &cp.runner;
    loop {
        let room = config
            .max_running
            .saturating_sub(runner.in_flight.load(Ordering::SeqCst));
        if room > 0 && !runner.backing_off() {
            let claimed = cp
                .store
                .claim_cells(&cp.config.host_name, None, room as u32, config.lease, now())
                .await;
            match claimed {
                Ok(claims) => {
                    crate::metrics::metrics().claimed(claims.len() as u64);
                    for claim in claims {
                        runner.in_flight.fetch_add(1, Ordering::SeqCst);
                        let cp = cp.clone();
                        tokio::spawn(async move {
                            attempt(&cp, claim).await;
                            cp.runner.in_flight.fetch_sub(1, Ordering::SeqCst);
                            cp.runner.wake();
                        });
                    }
                }
                Err(e) => tracing::warn!(error = e.chain(), "claiming sweep cells"),
            }
        }
        let _ = tokio::time::timeout(config.poll, runner.wake.notified()).await;
    }
}

/// Expires leases, decides held sweeps, deletes the parents of finished
/// sweeps and forgets what this runner cached of them.
async fn housekeeping(cp: &Arc<ControlPlane>) {
    match cp.store.expire_leases(now()).await {
        Ok(0) => {}
        Ok(n) => {
            tracing::info!(cells = n, "took back cells whose lease expired");
            cp.runner.wake();
        }
        Err(e) => tracing::warn!(error = e.chain(), "expiring sweep leases"),
    }
    match cp.store.resolve_held(now()).await {
        Ok(resolved) => {
            for id in &resolved.cancelled {
                tracing::info!(sweep = id, "a dependency failed: sweep cancelled");
            }
            if !resolved.activated.is_empty() {
                cp.runner.wake();
            }
        }
        Err(e) => tracing::warn!(error = e.chain(), "deciding held sweeps"),
    }
    collect_job_garbage(cp).await;
    let known: Vec<String> = {
        let parents = cp.runner.parents.lock().unwrap();
        let sweeps = cp.runner.sweeps.lock().unwrap();
        let mut ids: Vec<String> = parents.keys().chain(sweeps.keys()).cloned().collect();
        ids.sort();
        ids.dedup();
        ids
    };
    for id in known {
        let finished = match cp.store.sweep_by_id(&id).await {
            Ok(Some(row)) => row.finished_at.is_some() || row.state == SweepState::Cancelled,
            Ok(None) => true,
            Err(_) => false,
        };
        if !finished {
            continue;
        }
        cp.runner.sweeps.lock().unwrap().remove(&id);
        let parent = cp.runner.parents.lock().unwrap().remove(&id);
        if let Some(parent) = parent {
            let _forks_done = parent.fork_lock.lock().await;
            if let Some(ParentState::Ready(sandbox)) = parent.state.get() {
                tracing::info!(
                    sweep = id,
                    sandbox,
                    "sweep finished: deleting its fork parent"
                );
                if let Err(e) = cp.destroy(sandbox).await {
                    tracing::warn!(sandbox, error = e.message, "deleting a fork parent");
                }
            }
        }
    }
}

/// Job data unused this long goes: longer than a sweep may run, so a
/// running job's inputs stay.
const JOB_DATA_KEPT_SECONDS: f64 = 35.0 * 86400.0;
/// An upload or a result staged this long ago was abandoned.
const STAGED_KEPT_SECONDS: f64 = 86400.0;
/// How often the runner drops old job data.
const GARBAGE_EVERY: Duration = Duration::from_secs(3600);

/// Drops old blobs, abandoned staged ones and old sweeps' output, at most
/// once every [`GARBAGE_EVERY`] per control plane.
async fn collect_job_garbage(cp: &ControlPlane) {
    {
        let mut last = cp.runner.last_garbage.lock().unwrap();
        if last.is_some_and(|at| at.elapsed() < GARBAGE_EVERY) {
            return;
        }
        *last = Some(Instant::now());
    }
    let t = now();
    match cp
        .store
        .collect_garbage(
            t - JOB_DATA_KEPT_SECONDS,
            t - STAGED_KEPT_SECONDS,
            t - JOB_DATA_KEPT_SECONDS,
        )
        .await
    {
        Ok(0) => {}
        Ok(n) => tracing::info!(blobs = n, "dropped job data unused for 35 days"),
        Err(e) => tracing::warn!(error = e.chain(), "dropping old job data"),
    }
}

/// What the attempts of `sweep_id` need, read once and cached.
async fn sweep_info(cp: &ControlPlane, sweep_id: &str) -> Result<Arc<SweepInfo>, String> {
    if let Some(info) = cp.runner.sweeps.lock().unwrap().get(sweep_id) {
        return Ok(info.clone());
    }
    let mut row = cp
        .store
        .sweep_by_id(sweep_id)
        .await
        .map_err(|e| format!("reading the sweep: {e}"))?
        .ok_or("the sweep is gone")?;
    let account = cp
        .store
        .account_by_id(row.account_id)
        .await
        .map_err(|e| format!("reading the account: {e}"))?
        .ok_or("the sweep's account is gone")?;
    inherit_dependency_results(cp, &mut row).await?;
    let resolved = cp
        .template_source(&account, &row.template)
        .await
        .map_err(|e| format!("template {}: {}", row.template, e.message))?;
    let restored = cp
        .host
        .source_manifest(&resolved.source)
        .map_err(|e| format!("template {}: {e}", row.template))?;
    // `--cpus-per-task` and `--mem` give a VM of at most that size: the
    // template's disk booted at that size once, then restored per task.
    let size = task_size(row.slurm.as_ref(), &restored);
    let source = cp
        .host
        .sized(
            &resolved.source,
            size.vcpus,
            size.memory_mib,
            resolved.warm_up.as_ref(),
        )
        .await
        .map_err(|e| {
            format!(
                "template {} at {} vCPUs and {} MiB: {e}",
                row.template, size.vcpus, size.memory_mib
            )
        })?;
    let numbers: Option<Vec<u32>> = row.cells.iter().map(|v| v.parse::<u32>().ok()).collect();
    let integer_cells = numbers.is_some();
    let mut task_ids = numbers.unwrap_or_else(|| (0..row.cells.len() as u32).collect());
    task_ids.sort_unstable();
    task_ids.dedup();
    let array = shoal_slurm::ArraySpec {
        task_ids,
        throttle: Some(row.throttle),
    };
    let mut files = Vec::new();
    for (path, content) in &row.files {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(content)
            .map_err(|e| format!("file {path}: {e}"))?;
        files.push((path.clone(), bytes));
    }
    let info = Arc::new(SweepInfo {
        row,
        account,
        array,
        integer_cells,
        files,
        named_snapshot: match resolved.source {
            Source::Snapshot(snapshot) => Some(snapshot),
            Source::Template(_) => None,
        },
        source,
        vcpus: size.vcpus,
        memory_mib: size.memory_mib,
    });
    cp.runner
        .sweeps
        .lock()
        .unwrap()
        .insert(sweep_id.to_owned(), info.clone());
    Ok(info)
}

/// A sweep that waited for others (`after_ok`) sees what they left under
/// its result directories, as a job after another sees its files on a
/// shared filesystem: their cells' result blobs join its inputs (a later
/// cell's file over an earlier one's, any over the submit-time copy).
async fn inherit_dependency_results(cp: &ControlPlane, row: &mut SweepRow) -> Result<(), String> {
    let Some(data) = row.data_path.as_mut() else {
        return Ok(());
    };
    if row.after_ok.is_empty() || data.results_under.is_empty() {
        return Ok(());
    }
    let under = |path: &str| {
        data.results_under
            .iter()
            .any(|dir| Path::new(path).starts_with(dir))
    };
    let mut inherited: BTreeMap<String, shoal_store::InputFile> = BTreeMap::new();
    for dep in &row.after_ok {
        let cells = cp
            .store
            .list_cells(row.account_id, dep, &shoal_store::CellFilter::default())
            .await
            .map_err(|e| format!("reading the results of {dep}: {e}"))?;
        for cell in cells {
            let Some(Value::Object(files)) = cell.collected else {
                continue;
            };
            for (path, kept) in files {
                let (Some(digest), Some(size)) = (kept["blob"].as_str(), kept["size"].as_u64())
                else {
                    continue;
                };
                if under(&path) {
                    inherited.insert(
                        path.clone(),
                        shoal_store::InputFile {
                            path,
                            digest: digest.to_owned(),
                            size,
                            mode: 0o644,
                        },
                    );
                }
            }
        }
    }
    data.inputs.retain(|i| !inherited.contains_key(&i.path));
    data.inputs.extend(inherited.into_values());
    Ok(())
}

/// One attempt at a claimed cell, start to end. Never returns early without
/// either recording an outcome or giving the claim back (unless the claim
/// was lost, when nothing may be recorded).
async fn attempt(cp: &Arc<ControlPlane>, claim: Claim) {
    let (cancel_tx, cancel_rx) = watch::channel(false);
    cp.runner
        .running
        .lock()
        .unwrap()
        .insert(claim.claim_id.clone(), cancel_tx);
    // The lease is renewed from the claim to the end of the attempt: the
    // sweep's first attempt may boot the template at the task's size (half
    // a minute on two busy cores, the lease's whole length), a start may
    // wait for its turn, a restore may be slowed by many others; none of it
    // may let the lease lapse (both did: twenty VMs starting on two cores,
    // and three `--mem` jobs booting their sizes at once).
    let (renewal_tx, renewal) = watch::channel(Renewal::Renewed);
    let _renewing = AbortOnDrop(tokio::spawn(renew_lease(
        cp.clone(),
        claim.clone(),
        renewal_tx,
    )));
    let info = match sweep_info(cp, &claim.sweep_id).await {
        Ok(info) => info,
        Err(error) => {
            let outcome = CellOutcome {
                error: Some(error),
                ..CellOutcome::new(CellEnd::Failed, now())
            };
            finish(cp, &claim, &outcome).await;
            cp.runner.running.lock().unwrap().remove(&claim.claim_id);
            return;
        }
    };
    run_attempt(cp, &info, &claim, cancel_rx, renewal).await;
    cp.runner.running.lock().unwrap().remove(&claim.claim_id);
}

async fn finish(cp: &ControlPlane, claim: &Claim, outcome: &CellOutcome) {
    match cp
        .store
        .finish_cell(&claim.sweep_id, claim.idx, &claim.claim_id, outcome)
        .await
    {
        Ok(Some(CellState::Pending)) => cp.runner.wake(),
        Ok(Some(_)) => {}
        Ok(None) => tracing::info!(
            sweep = claim.sweep_id,
            cell = claim.idx,
            "the claim was lost: the outcome is not recorded"
        ),
        Err(e) => {
            tracing::warn!(sweep = claim.sweep_id, cell = claim.idx, error = %e, "recording a cell")
        }
    }
}

async fn release(cp: &ControlPlane, claim: &Claim, why: &str) {
    tracing::info!(
        sweep = claim.sweep_id,
        cell = claim.idx,
        why,
        "giving a cell back"
    );
    if let Err(e) = cp
        .store
        .release_cell(&claim.sweep_id, claim.idx, &claim.claim_id, now())
        .await
    {
        tracing::warn!(sweep = claim.sweep_id, cell = claim.idx, error = %e, "giving a cell back");
    }
    cp.runner.back_off();
}

/// How the command of an attempt ended.
enum Ran {
    Exited(shoal_proto::client::ExitStatus),
    /// The host gave up waiting past the timeout.
    HostTimeout,
    /// Cancelled (by this control plane, or learnt from a renewal).
    Cancelled,
    /// The claim was lost: stop and record nothing.
    Lost,
    /// The sandbox went away under the command.
    SandboxLost(String),
    /// The command could not be started.
    Failed(String),
    /// The sandbox's VM was killed for memory.
    OutOfMemory,
}

/// How long a broken channel waits to learn whether its VM died for memory.
const FAILURE_PATIENCE: Duration = Duration::from_secs(3);

async fn run_attempt(
    cp: &Arc<ControlPlane>,
    info: &SweepInfo,
    claim: &Claim,
    mut cancel: watch::Receiver<bool>,
    mut renewal: watch::Receiver<Renewal>,
) {
    let sweep = &info.row;
    let mut timings = Timings::default();
    let started = Instant::now();
    // Held until the command runs (or the attempt stops before): the wait
    // for a turn counts in `create`.
    let starting = cp
        .runner
        .starting
        .get_or_init(|| {
            let n = cp.config.sweeps.max_starting;
            (n > 0).then(|| tokio::sync::Semaphore::new(n))
        })
        .as_ref();
    let mut turn = match starting {
        Some(semaphore) => Some(semaphore.acquire().await.expect("never closed")),
        None => None,
    };
    // When the sandbox's memory starts to count (its row's own creation
    // time is a moment later, inside `make_sandbox`).
    let created_at = now();
    let sandbox = match make_sandbox(cp, info, claim).await {
        Ok(sandbox) => sandbox,
        Err(Refusal::Retry(why)) => return release(cp, claim, &why).await,
        Err(Refusal::Fail(error)) => {
            let outcome = CellOutcome {
                error: Some(error),
                ..CellOutcome::new(CellEnd::Failed, now())
            };
            return finish(cp, claim, &outcome).await;
        }
    };
    cp.runner.clear_backoff();
    timings.create = ms(started);
    // Where the cell runs, visible while it runs (squeue's NODELIST). Not
    // worth failing the attempt over: the outcome records it again. Written
    // while the sandbox is prepared, off the start's path.
    let recording = async {
        if let Err(e) = cp
            .store
            .set_cell_sandbox(&claim.sweep_id, claim.idx, &claim.claim_id, &sandbox)
            .await
        {
            tracing::warn!(error = e.chain(), "recording a cell's sandbox");
        }
    };
    // From here on the sandbox exists: whatever happens, it is deleted.
    let guard = SandboxGuard {
        cp: cp.clone(),
        id: Some(sandbox.clone()),
    };

    let phase = Instant::now();
    let timeout = Duration::from_secs(sweep.timeout_seconds);
    let mut stdout = Tail::default();
    let mut stderr = Tail::default();
    let mut spool = job_data::Spool::new();
    let mut results_before = job_data::TreeState::new();
    let mut results_note = None;
    let mut run_started = None;
    let ran = match cp.host.engine().agent(&sandbox).await {
        Err(e) => {
            recording.await;
            Ran::SandboxLost(format!("guest agent: {e}"))
        }
        Ok(agent) => {
            let forked = sweep.fork_from.is_some();
            let ((), prepared) = tokio::join!(recording, prepare(cp, &agent, info, forked));
            // What the result directories hold before the command: only
            // what it adds or changes comes back.
            let prepared = match (prepared, &sweep.data_path) {
                (Ok(()), Some(data)) if !data.results_under.is_empty() => {
                    let (state, note) = job_data::tree_state(&agent, &data.results_under).await;
                    results_before = state;
                    results_note = note;
                    Ok(())
                }
                (prepared, _) => prepared,
            };
            match prepared {
                Err(e) => classify_input_error(e),
                Ok(()) => {
                    tracing::debug!(sandbox, ms = ms(phase), "sandbox prepared");
                    let stop = time_limit_stop(sweep.slurm.as_ref());
                    let request = ExecRequest {
                        cmd: sweep.command.replace("{cell}", &claim.value),
                        env: cell_environment(info, claim, &sandbox),
                        cwd: Some(workdir(sweep).to_owned()),
                        timeout: Some(timeout),
                        kill_grace: stop.kill_grace,
                        warn_signal: stop.warn_signal,
                        ..ExecRequest::default()
                    };
                    match agent.exec(request).await {
                        Err(e) => classify_agent_error("starting the command", e),
                        Ok(mut handle) => {
                            timings.exec = ms(phase);
                            drop(turn.take());
                            set_priority(cp, &sandbox, cp.config.sweeps.command_priority);
                            run_started = Some(Instant::now());
                            let deadline = tokio::time::Instant::now()
                                + timeout
                                + stop.kill_grace.unwrap_or_default()
                                + HOST_TIMEOUT_MARGIN;
                            let mut spool_tick = tokio::time::interval(job_data::SPOOL_EVERY);
                            // A Slurm job's task says when its time limit
                            // struck, where slurmstepd says it: in its
                            // output, before the task's own answer to SIGTERM.
                            let job_id = sweep.job_id + u64::from(claim.idx);
                            let limit_at = tokio::time::Instant::now() + timeout;
                            let mut limit_told = sweep.slurm.is_none();
                            let ran = loop {
                                tokio::select! {
                                    event = handle.next_event() => match event {
                                        Ok(ExecEvent::Stdout(bytes)) => {
                                            stdout.push(&bytes);
                                            if spool.push("stdout", &bytes) {
                                                spool.write(&cp.store, claim).await;
                                            }
                                        }
                                        Ok(ExecEvent::Stderr(bytes)) => {
                                            stderr.push(&bytes);
                                            if spool.push("stderr", &bytes) {
                                                spool.write(&cp.store, claim).await;
                                            }
                                        }
                                        Ok(ExecEvent::Exit(status)) => break Ran::Exited(status),
                                        Err(e) => break classify_agent_error("running the command", e),
                                    },
                                    // A follower sees the output grow (issue 22).
                                    _ = spool_tick.tick() => spool.write(&cp.store, claim).await,
                                    _ = tokio::time::sleep_until(limit_at), if !limit_told => {
                                        limit_told = true;
                                        let line = stepd_cancelled(job_id, &sandbox, " DUE TO TIME LIMIT");
                                        spool.push("stderr", line.as_bytes());
                                        spool.write(&cp.store, claim).await;
                                    }
                                    // Also sees what a renewal found during the start.
                                    _ = renewal.changed() => match *renewal.borrow_and_update() {
                                        Renewal::Renewed => {}
                                        Renewal::Cancelled => {
                                            if sweep.slurm.is_some() {
                                                spool.push("stderr", stepd_cancelled(job_id, &sandbox, "").as_bytes());
                                            }
                                            break Ran::Cancelled;
                                        }
                                        Renewal::Lost => break Ran::Lost,
                                    },
                                    changed = cancel.changed() => {
                                        if changed.is_ok() && *cancel.borrow() {
                                            if sweep.slurm.is_some() {
                                                spool.push("stderr", stepd_cancelled(job_id, &sandbox, "").as_bytes());
                                            }
                                            break Ran::Cancelled;
                                        }
                                    }
                                    _ = tokio::time::sleep_until(deadline) => break Ran::HostTimeout,
                                }
                            };
                            // The guest's out-of-memory kills, as slurmstepd
                            // reports a step's.
                            if let (Ran::Exited(status), Some(_)) = (&ran, &sweep.slurm) {
                                let kills = status.usage.map_or(0, |u| u.oom_kills);
                                if kills > 0 {
                                    let line = format!(
                                        "slurmstepd: error: Detected {kills} oom-kill event(s) in StepId={job_id}.batch. \
                                         Some of your processes may have been killed by the cgroup out-of-memory handler.\n"
                                    );
                                    spool.push("stderr", line.as_bytes());
                                }
                            }
                            spool.write(&cp.store, claim).await;
                            ran
                        }
                    }
                }
            }
        }
    };
    drop(turn.take());
    // A VM the kernel killed for memory ends its task for good, as Slurm's
    // OUT_OF_MEMORY does: no retry on another sandbox.
    let ran = match ran {
        Ran::SandboxLost(why) => match cp.failure_of(&sandbox, FAILURE_PATIENCE).await {
            Some(reason) if reason == shoal_host::OUT_OF_MEMORY => Ran::OutOfMemory,
            _ => Ran::SandboxLost(why),
        },
        other => other,
    };
    if let Some(at) = run_started {
        timings.run = ms(at);
        set_priority(cp, &sandbox, CpuPriority::Normal);
    }

    // Collect whatever the outcome, unless the attempt is void.
    let phase = Instant::now();
    let collect = matches!(ran, Ran::Exited(_) | Ran::HostTimeout) && !sweep.collect.is_empty();
    let (mut collected, mut collect_note) = if collect {
        match cp.host.engine().agent(&sandbox).await {
            Ok(agent) => collect_files(&agent, &sweep.collect).await,
            Err(e) => (BTreeMap::new(), Some(format!("collect: guest agent: {e}"))),
        }
    } else {
        (BTreeMap::new(), None)
    };
    let keep_results = matches!(ran, Ran::Exited(_) | Ran::HostTimeout);
    if let (true, Some(data)) = (keep_results, &sweep.data_path) {
        if !data.results_under.is_empty() {
            let (kept, note) = match cp.host.engine().agent(&sandbox).await {
                Ok(agent) => {
                    job_data::collect_results(
                        &cp.store,
                        &agent,
                        info.account.id,
                        data,
                        &results_before,
                    )
                    .await
                }
                Err(e) => (BTreeMap::new(), Some(format!("results: guest agent: {e}"))),
            };
            collected.extend(kept);
            let notes: Vec<String> = [collect_note.take(), results_note.take(), note]
                .into_iter()
                .flatten()
                .collect();
            collect_note = (!notes.is_empty()).then(|| notes.join("; "));
        }
    }
    timings.collect = ms(phase);

    // The sandbox goes; its last usage reading, taken for the meter just
    // before the kill, prices the cell (one read of the process's memory
    // map, which costs milliseconds, not two). A failed task's is kept,
    // hibernated, when the job asked (`--keep-failed`).
    let phase = Instant::now();
    let failed_task = match &ran {
        Ran::Exited(status) => {
            status.timed_out
                || !status.success()
                || (sweep.slurm.is_some() && status.usage.is_some_and(|u| u.oom_kills > 0))
        }
        Ran::HostTimeout => true,
        _ => false,
    };
    let keep_for = keep_failed_seconds(sweep.slurm.as_ref()).filter(|_| failed_task);
    let mut kept_until = None;
    let usage = match keep_for {
        Some(seconds) => {
            let usage = cp.host.engine().usage(&sandbox).ok().flatten();
            kept_until = keep_sandbox(cp, guard, created_at, seconds).await;
            usage
        }
        None => guard.delete().await,
    };
    let (cpu_seconds, gib_seconds) = usage.map_or((0.0, 0.0), |usage| {
        let age = (now() - created_at).max(0.0);
        (usage.cpu_seconds, usage.pss_bytes as f64 / GIB * age)
    });
    timings.delete = ms(phase);

    let mut outcome = CellOutcome::new(CellEnd::Failed, now());
    outcome.sandbox_id = Some(sandbox.clone());
    outcome.cpu_seconds = cpu_seconds;
    outcome.gib_seconds = gib_seconds;
    outcome.timings = Some(timings.json());
    outcome.output_truncated = stdout.truncated || stderr.truncated || spool.cut;
    outcome.stdout_tail = Some(stdout.text());
    outcome.stderr_tail = Some(stderr.text());
    outcome.elapsed_ms = Some(timings.run);
    match ran {
        Ran::Exited(status) => {
            outcome.elapsed_ms = Some(status.duration_ms);
            outcome.signal = status.signal;
            outcome.max_rss_kib = status.usage.map(|u| u.max_rss_kib);
            outcome.task_cpu_ms = status.usage.map(|u| u.cpu_ms);
            let oom_killed = status.usage.is_some_and(|u| u.oom_kills > 0);
            if status.timed_out {
                outcome.end = CellEnd::Timeout;
                outcome.error = Some(format!("timeout after {}s", sweep.timeout_seconds));
            } else {
                outcome.exit_code = Some(
                    status
                        .code
                        .unwrap_or_else(|| 128 + status.signal.unwrap_or(0)),
                );
                outcome.end = if status.success() {
                    CellEnd::Succeeded
                } else {
                    CellEnd::Failed
                };
                // A process the guest killed for memory makes a Slurm
                // task OUT_OF_MEMORY, whatever the script did after.
                if oom_killed && sweep.slurm.is_some() {
                    outcome.end = CellEnd::Failed;
                    outcome.error = Some(shoal_host::OUT_OF_MEMORY.to_owned());
                }
            }
        }
        Ran::HostTimeout => {
            outcome.end = CellEnd::Timeout;
            outcome.error = Some(format!(
                "timeout after {}s (the guest did not answer)",
                sweep.timeout_seconds
            ));
        }
        Ran::Cancelled => {
            outcome.end = CellEnd::Cancelled;
            outcome.error = Some("cancelled".to_owned());
        }
        Ran::Lost => {
            tracing::info!(
                sweep = claim.sweep_id,
                cell = claim.idx,
                "lease lost: the attempt is void"
            );
            return;
        }
        Ran::SandboxLost(why) => {
            let key = format!("{}/{}", claim.sweep_id, claim.idx);
            let losses = {
                let mut losses = cp.runner.losses.lock().unwrap();
                let n = losses.entry(key.clone()).or_default();
                *n += 1;
                *n
            };
            if losses <= MAX_LOSSES {
                return release(cp, claim, &format!("sandbox lost: {why}")).await;
            }
            cp.runner.losses.lock().unwrap().remove(&key);
            outcome.error = Some(format!("sandbox lost {losses} times: {why}"));
        }
        Ran::Failed(why) => outcome.error = Some(why),
        Ran::OutOfMemory => outcome.error = Some(shoal_host::OUT_OF_MEMORY.to_owned()),
    }
    if outcome.error.is_none() {
        outcome.error = collect_note;
    }
    if let Some(until) = kept_until {
        let note = format!(
            "sandbox {sandbox} kept, hibernated, until {} for `shoal debug`",
            crate::rfc3339(until)
        );
        outcome.error = Some(match outcome.error.take() {
            Some(e) => format!("{e}; {note}"),
            None => note,
        });
    }
    if !collected.is_empty() {
        outcome.collected = Some(json!(collected));
    }
    finish(cp, claim, &outcome).await;
}

/// Renews `claim`'s lease every third of its length until aborted, and
/// says so when a renewal finds the claim lost or the cell cancelled (then
/// stops renewing, keeping the channel open).
async fn renew_lease(cp: Arc<ControlPlane>, claim: Claim, found: watch::Sender<Renewal>) {
    let lease = cp.config.sweeps.lease;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + lease / 3, lease / 3);
    loop {
        tick.tick().await;
        match cp
            .store
            .renew_lease(&claim.sweep_id, claim.idx, &claim.claim_id, lease, now())
            .await
        {
            Ok(Renewal::Renewed) => {}
            Ok(end) => {
                let _ = found.send(end);
                return std::future::pending().await;
            }
            // The database is away: keep going, the next renewal may get
            // through before the lease ends.
            Err(e) => tracing::warn!(error = e.chain(), "renewing a lease"),
        }
    }
}

/// Attempts start, collect and are deleted at normal priority, and their
/// commands run at [`RunnerConfig::command_priority`]: with the default
/// (background), twenty CPU-bound commands on two cores no longer slow the
/// restore and first exec of the next attempt tenfold. A priority that
/// cannot be set costs speed, not the attempt.
fn set_priority(cp: &ControlPlane, sandbox: &str, priority: CpuPriority) {
    if priority == CpuPriority::Normal && cp.config.sweeps.command_priority == CpuPriority::Normal {
        return;
    }
    if let Err(e) = cp.host.engine().set_cpu_priority(sandbox, priority) {
        tracing::warn!(sandbox, error = ?e, "setting a sandbox's CPU priority");
    }
}

/// Aborts a task when dropped: the lease renewal ends with its attempt.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Deletes the sandbox of an attempt when dropped, if [`SandboxGuard::delete`]
/// did not: the sandbox goes even if the attempt's task ends abruptly.
struct SandboxGuard {
    cp: Arc<ControlPlane>,
    id: Option<String>,
}

impl SandboxGuard {
    /// Deletes the sandbox, and returns its last usage reading.
    async fn delete(mut self) -> Option<Usage> {
        let id = self.id.take()?;
        destroy(&self.cp, &id).await
    }
}

impl Drop for SandboxGuard {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let cp = self.cp.clone();
            tokio::spawn(async move {
                destroy(&cp, &id).await;
            });
        }
    }
}

/// slurmstepd's line for a task stopped at its time limit (`why`: " DUE TO
/// TIME LIMIT") or cancelled (`why` empty), at the local time now.
fn stepd_cancelled(job_id: u64, node: &str, why: &str) -> String {
    format!(
        "slurmstepd: error: *** JOB {job_id} ON {node} CANCELLED AT {}{why} ***\n",
        chrono::Local::now().format("%Y-%m-%dT%H:%M:%S")
    )
}

/// `--keep-failed[=TIME]`: how long a failed task's sandbox is kept, from
/// the job's `slurm.keep_failed_seconds` (at most a week).
fn keep_failed_seconds(slurm: Option<&Value>) -> Option<u64> {
    slurm?
        .get("keep_failed_seconds")?
        .as_u64()
        .filter(|s| *s > 0)
        .map(|s| s.min(MAX_KEEP_FAILED_SECONDS))
}

/// The longest a failed task's sandbox is kept.
const MAX_KEEP_FAILED_SECONDS: u64 = 7 * 86400;

/// Hibernates the guard's sandbox instead of deleting it, to be reaped
/// `seconds` from now (its ttl, and its lifetime from `created_at`).
/// Returns when it goes, or `None` when it could not be kept (it is
/// deleted then).
async fn keep_sandbox(
    cp: &Arc<ControlPlane>,
    mut guard: SandboxGuard,
    created_at: f64,
    seconds: u64,
) -> Option<f64> {
    let id = guard.id.take()?;
    let kept = async {
        cp.host.hibernate(&id).await.map_err(|e| e.to_string())?;
        cp.event(
            &id,
            "sandbox.hibernated",
            serde_json::json!({ "reason": "kept for debugging" }),
        );
        let at = now();
        let age = (at - created_at).max(0.0).ceil() as u64;
        cp.store
            .update_sandbox(
                &id,
                shoal_store::SandboxPatch {
                    status: Some("hibernated".into()),
                    ttl_seconds: Some(seconds),
                    max_lifetime_seconds: Some(age + seconds),
                    ..shoal_store::SandboxPatch::default()
                },
            )
            .await
            .map_err(|e| e.to_string())?;
        cp.store.touch(&id, at).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(at + seconds as f64)
    }
    .await;
    match kept {
        Ok(until) => Some(until),
        Err(e) => {
            tracing::warn!(sandbox = id, error = e, "keeping a failed task's sandbox");
            destroy(cp, &id).await;
            None
        }
    }
}

async fn destroy(cp: &ControlPlane, id: &str) -> Option<Usage> {
    cp.destroy(id)
        .await
        .inspect_err(|e| {
            tracing::warn!(
                sandbox = id,
                error = e.message,
                "deleting a sweep's sandbox"
            );
        })
        .ok()
        .flatten()
}

fn workdir(sweep: &SweepRow) -> &str {
    sweep.workdir.as_deref().unwrap_or(DEFAULT_WORKDIR)
}

/// Makes the working directory and writes the sweep's files and inputs (a
/// fork child has them from its parent already).
async fn prepare(
    cp: &ControlPlane,
    agent: &AgentClient,
    info: &SweepInfo,
    forked: bool,
) -> Result<(), InputError> {
    if forked {
        return Ok(());
    }
    // Every template has the default one: a round trip saved, and each one
    // right after a restore costs the guest fresh code translation under TCG.
    // Nor when a file goes into it: an upload makes its parents.
    let workdir = workdir(&info.row);
    let inputs = info
        .row
        .data_path
        .as_ref()
        .map_or(&[][..], |d| &d.inputs[..]);
    let made_by_upload = info
        .files
        .iter()
        .map(|(path, _)| path)
        .chain(inputs.iter().map(|i| &i.path))
        .any(|path| {
            Path::new(path)
                .parent()
                .is_some_and(|dir| dir.starts_with(workdir))
        });
    if workdir != DEFAULT_WORKDIR && !made_by_upload {
        agent.make_dir(workdir).await?;
    }
    for (path, bytes) in &info.files {
        agent.write_file(path, None, &bytes[..]).await?;
    }
    for input in inputs {
        job_data::write_input(&cp.store, agent, info.account.id, input).await?;
    }
    Ok(())
}

/// An input that could not be written: the guest's refusal or a lost
/// channel as any agent error, unreadable job data fails the attempt.
fn classify_input_error(e: InputError) -> Ran {
    match e {
        InputError::Agent(e) => classify_agent_error("preparing the sandbox", e),
        InputError::Data(why) => Ran::Failed(why),
    }
}

/// A guest's own refusal fails the attempt; a broken channel means the
/// sandbox is gone.
fn classify_agent_error(what: &str, e: AgentError) -> Ran {
    match e {
        AgentError::Guest { .. } => Ran::Failed(format!("{what}: {e}")),
        other => Ran::SandboxLost(format!("{what}: {other}")),
    }
}

/// How a Slurm task is stopped at its time limit, from its `slurm` object:
/// SIGTERM and SIGKILL `kill_wait_seconds` (at most 120) later, and the
/// `--signal` warning before. A sweep without them is SIGKILLed at once.
struct TimeLimitStop {
    kill_grace: Option<Duration>,
    warn_signal: Option<(i32, Duration)>,
}

fn time_limit_stop(slurm: Option<&Value>) -> TimeLimitStop {
    let slurm = slurm.unwrap_or(&Value::Null);
    let kill_grace = slurm
        .get("kill_wait_seconds")
        .and_then(Value::as_u64)
        .map(|s| Duration::from_secs(s.min(MAX_KILL_WAIT_SECONDS)));
    let warn_signal = slurm.get("signal").and_then(|w| {
        let signal = i32::try_from(w.get("signal")?.as_u64()?).ok()?;
        let before = w.get("before_seconds")?.as_u64()?;
        Some((signal, Duration::from_secs(before.min(65_535))))
    });
    TimeLimitStop {
        kill_grace,
        warn_signal,
    }
}

/// The environment of one cell's command: the sweep's `env`, then Shoal's
/// and Slurm's variables over it.
fn cell_environment(info: &SweepInfo, claim: &Claim, sandbox: &str) -> BTreeMap<String, String> {
    let sweep = &info.row;
    let slurm = sweep.slurm.clone().unwrap_or(Value::Null);
    let text = |key: &str| slurm.get(key).and_then(Value::as_str).map(str::to_owned);
    let number = |key: &str| slurm.get(key).and_then(Value::as_u64);
    let task_id = if info.integer_cells {
        claim.value.parse().unwrap_or(claim.idx)
    } else {
        claim.idx
    };
    // A Slurm job submitted without --array (its `slurm.array` null or
    // absent) is not an array in Slurm: its task gets no array variables.
    // A sweep with no `slurm` object at all is an array of its cells.
    let is_array = match &slurm {
        Value::Object(map) => map.get("array").is_some_and(|a| !a.is_null()),
        _ => true,
    };
    let task = shoal_slurm::TaskDescription {
        job_id: sweep.job_id + u64::from(claim.idx),
        array: is_array.then(|| shoal_slurm::ArrayTask::new(sweep.job_id, task_id, &info.array)),
        job_name: text("job_name").unwrap_or_else(|| sweep.name.clone()),
        user: text("user").unwrap_or_else(|| info.account.name.clone()),
        partition: text("partition"),
        account: text("account"),
        cpus_per_task: number("cpus_per_task").map(|n| n as u32),
        cpus: info.vcpus,
        mem_per_node_mib: number("mem_mib"),
        mem_per_cpu_mib: number("mem_per_cpu_mib"),
        submit_dir: text("submit_dir").unwrap_or_else(|| workdir(sweep).to_owned()),
        submit_host: text("submit_host").unwrap_or_else(|| "shoal".to_owned()),
        node_name: sandbox.to_owned(),
        cluster_name: text("cluster_name").unwrap_or_else(|| "shoal".to_owned()),
        restart_count: claim.attempt.saturating_sub(1),
    };
    let mut env = sweep.env.clone();
    env.extend(shoal_slurm::task_environment(&task));
    env.insert("SHOAL_SWEEP_ID".into(), sweep.id.clone());
    env.insert("SHOAL_JOB_ID".into(), sweep.job_id.to_string());
    env.insert("SHOAL_CELL".into(), claim.value.clone());
    env.insert("SHOAL_CELL_INDEX".into(), claim.idx.to_string());
    env
}

/// Admits and makes the sandbox of an attempt: a restore of the template,
/// or a fork of the sweep's parent.
async fn make_sandbox(
    cp: &Arc<ControlPlane>,
    info: &SweepInfo,
    claim: &Claim,
) -> Result<String, Refusal> {
    let sweep = &info.row;
    held_here(cp, info)?;
    let mut metadata = shoal_store::Metadata::new();
    metadata.insert("sweep".into(), sweep.id.clone());
    metadata.insert("sweep_cell".into(), claim.idx.to_string());
    let (parent, parent_id) = match &sweep.fork_from {
        Some(_) => match parent_of(cp, info).await? {
            (parent, ParentState::Ready(id)) => (Some(parent), Some(id)),
            (_, ParentState::SetupFailed(error)) => return Err(Refusal::Fail(error)),
        },
        None => (None, None),
    };
    let slot = cp.reserve(1, info.memory_mib).await.map_err(refusal)?;
    let lifetime = sweep.timeout_seconds + LIFETIME_MARGIN_SECONDS;
    let new = NewSandbox {
        id: crate::sandboxes::new_id(),
        template: sweep.template.clone(),
        cpu: info.vcpus,
        memory_mb: info.memory_mib,
        metadata,
        ttl_seconds: lifetime,
        persistent: false,
        max_lifetime_seconds: Some(lifetime),
        from_snapshot: info.restored_snapshot(),
        parent_id: parent_id.clone(),
        tree_id: None,
        host: Some(cp.config.host_name.clone()),
    };
    let mut row = cp
        .store
        .admit_sandbox(&info.account, &new, &cp.limits(info.account.tier), now())
        .await
        .map_err(|e| match e {
            StoreError::Quota { message } => Refusal::Retry(format!("quota: {message}")),
            other => Refusal::Retry(format!("database: {other}")),
        })?;
    let made = match (&parent, &parent_id) {
        (Some(parent), Some(parent_id)) => {
            // One fork of a parent at a time; and none while it is deleted.
            let _forking = parent.fork_lock.lock().await;
            cp.host
                .fork(&slot, parent_id, vec![row.id.clone()])
                .await
                .map(|mut fork| (fork.children.remove(0), "fork"))
        }
        _ => cp
            .host
            .create(&slot, &row.id, &info.source, CreateOptions::default())
            .await
            .map(|info| (info, "restore")),
    };
    match made {
        Ok((made, mode)) => {
            if let Err(e) = cp.came_up(&mut row, &made, mode).await {
                destroy(cp, &row.id).await;
                return Err(Refusal::Retry(format!(
                    "recording the sandbox: {}",
                    e.message
                )));
            }
            Ok(row.id)
        }
        Err(e) => {
            cp.mark_failed(&row.id).await;
            let _ = cp.host.kill(&row.id).await;
            if parent.is_some()
                && matches!(
                    &e,
                    HostError::Engine(shoal_host::EngineError::NoSuchSandbox(_))
                )
            {
                // The parent itself is gone: make a new one next time.
                cp.runner.parents.lock().unwrap().remove(&sweep.id);
                return Err(Refusal::Retry(format!("fork parent lost: {e}")));
            }
            Err(refusal(e))
        }
    }
}

/// Host refusals are for later; anything else fails the attempt.
/// An account template's snapshot is on the host that took it: another
/// host of a fleet gives the claim back (one that holds it takes it)
/// instead of failing the attempt.
fn held_here(cp: &ControlPlane, info: &SweepInfo) -> Result<(), Refusal> {
    match &info.source {
        Source::Snapshot(snapshot)
            if matches!(
                cp.host.engine().snapshot_manifest(snapshot),
                Err(EngineError::NoSuchSnapshot(_))
            ) =>
        {
            Err(Refusal::Retry(format!(
                "template {}'s snapshot is on another host",
                info.row.template
            )))
        }
        _ => Ok(()),
    }
}

fn refusal(e: HostError) -> Refusal {
    match e {
        HostError::Full | HostError::MemoryShort { .. } | HostError::Overcommitted { .. } => {
            Refusal::Retry(e.to_string())
        }
        other => Refusal::Fail(format!(
            "creating the sandbox: {}",
            crate::error::ApiError::from(other).message
        )),
    }
}

/// The sweep's `fork_from` parent, made (and set up) by the first caller.
async fn parent_of(
    cp: &Arc<ControlPlane>,
    info: &SweepInfo,
) -> Result<(Arc<Parent>, ParentState), Refusal> {
    let parent = cp
        .runner
        .parents
        .lock()
        .unwrap()
        .entry(info.row.id.clone())
        .or_default()
        .clone();
    let state = parent
        .state
        .get_or_try_init(|| make_parent(cp, info))
        .await?
        .clone();
    Ok((parent, state))
}

async fn make_parent(cp: &Arc<ControlPlane>, info: &SweepInfo) -> Result<ParentState, Refusal> {
    let sweep = &info.row;
    let fork_from = sweep.fork_from.clone().unwrap_or(Value::Null);
    let setup = fork_from
        .get("setup")
        .and_then(Value::as_str)
        .unwrap_or("true")
        .to_owned();
    let timeout = fork_from
        .get("timeout_seconds")
        .and_then(Value::as_u64)
        .unwrap_or(sweep.timeout_seconds);
    held_here(cp, info)?;
    let slot = cp.reserve(1, info.memory_mib).await.map_err(refusal)?;
    let mut metadata = shoal_store::Metadata::new();
    metadata.insert("sweep".into(), sweep.id.clone());
    metadata.insert("sweep_role".into(), "parent".into());
    let new = NewSandbox {
        id: crate::sandboxes::new_id(),
        template: sweep.template.clone(),
        cpu: info.vcpus,
        memory_mb: info.memory_mib,
        metadata,
        // Deleted by the runner when the sweep ends; a crash leaves it to
        // the restart's reconciliation.
        ttl_seconds: 7 * 86400,
        persistent: false,
        max_lifetime_seconds: None,
        from_snapshot: info.restored_snapshot(),
        parent_id: None,
        tree_id: None,
        host: Some(cp.config.host_name.clone()),
    };
    let mut row = cp
        .store
        .admit_sandbox(&info.account, &new, &cp.limits(info.account.tier), now())
        .await
        .map_err(|e| Refusal::Retry(format!("fork parent: {e}")))?;
    let made = match cp
        .host
        .create(&slot, &row.id, &info.source, CreateOptions::default())
        .await
    {
        Ok(made) => made,
        Err(e) => {
            cp.mark_failed(&row.id).await;
            let _ = cp.host.kill(&row.id).await;
            return Err(refusal(e));
        }
    };
    drop(slot);
    if let Err(e) = cp.came_up(&mut row, &made, "restore").await {
        destroy(cp, &row.id).await;
        return Err(Refusal::Retry(format!(
            "recording the fork parent: {}",
            e.message
        )));
    }
    let failed = |why: String| ParentState::SetupFailed(why);
    let outcome = async {
        let agent = cp
            .host
            .engine()
            .agent(&row.id)
            .await
            .map_err(|e| e.to_string())?;
        prepare(cp, &agent, info, false)
            .await
            .map_err(|e| match e {
                InputError::Agent(e) => e.to_string(),
                InputError::Data(why) => why,
            })?;
        let mut env = sweep.env.clone();
        env.insert("SHOAL_SWEEP_ID".into(), sweep.id.clone());
        env.insert("SHOAL_JOB_ID".into(), sweep.job_id.to_string());
        let request = ExecRequest {
            cmd: setup,
            env,
            cwd: Some(workdir(sweep).to_owned()),
            timeout: Some(Duration::from_secs(timeout)),
            ..ExecRequest::default()
        };
        // Only the end of a failed setup's output is kept (SETUP_OUTPUT);
        // reading the first MAX_OUTPUT bytes of each stream is plenty.
        let setup_started = Instant::now();
        let output = agent
            .exec_collect_limited(request, MAX_OUTPUT)
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>((output, setup_started.elapsed().as_secs_f64()))
    }
    .await;
    let state = match outcome {
        Ok((output, took)) if output.status.success() => {
            tracing::info!(sweep = sweep.id, parent = row.id, "fork parent set up");
            // What each forked cell did not run again (seff's warm start).
            if let Err(e) = cp.store.set_prelude_seconds(&sweep.id, took).await {
                tracing::warn!(error = e.chain(), "recording the setup's time");
            }
            ParentState::Ready(row.id.clone())
        }
        Ok((output, _)) => {
            let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
            text.push_str(&String::from_utf8_lossy(&output.stderr));
            let how = if output.status.timed_out {
                format!("timed out after {timeout}s")
            } else {
                format!(
                    "exited with {}",
                    output
                        .status
                        .code
                        .unwrap_or_else(|| 128 + output.status.signal.unwrap_or(0))
                )
            };
            failed(format!(
                "fork_from setup {how}: {}",
                tail_text(&text, SETUP_OUTPUT)
            ))
        }
        Err(e) => failed(format!("fork_from setup: {e}")),
    };
    if let ParentState::SetupFailed(_) = &state {
        destroy(cp, &row.id).await;
    }
    Ok(state)
}

/// The last `max` bytes of `text`, on a character boundary.
fn tail_text(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// The end of a stream, at most [`MAX_OUTPUT`] bytes.
#[derive(Default)]
struct Tail {
    bytes: std::collections::VecDeque<u8>,
    truncated: bool,
}

impl Tail {
    fn push(&mut self, chunk: &[u8]) {
        self.bytes.extend(chunk);
        if self.bytes.len() > MAX_OUTPUT {
            let cut = self.bytes.len() - MAX_OUTPUT;
            self.bytes.drain(..cut);
            self.truncated = true;
        }
    }

    /// As text; a character cut at the start becomes U+FFFD.
    fn text(&self) -> String {
        let (a, b) = self.bytes.as_slices();
        let mut all = Vec::with_capacity(a.len() + b.len());
        all.extend_from_slice(a);
        all.extend_from_slice(b);
        String::from_utf8_lossy(&all).into_owned()
    }
}

/// Reads back the paths of `patterns` (globs allowed) within the limits.
/// Returns path -> base64 (a JSON string), and a note of what was left out.
async fn collect_files(
    agent: &AgentClient,
    patterns: &[String],
) -> (BTreeMap<String, Value>, Option<String>) {
    let mut collected = BTreeMap::new();
    let mut notes = Vec::new();
    let mut total = 0u64;
    for pattern in patterns {
        let paths = match expand(agent, pattern).await {
            Ok(paths) => paths,
            Err(e) => {
                notes.push(format!("{pattern}: {e}"));
                continue;
            }
        };
        for (path, size) in paths {
            if collected.contains_key(&path) {
                continue;
            }
            if size > MAX_COLLECT_FILE {
                notes.push(format!(
                    "{path}: larger than {MAX_COLLECT_FILE} bytes, not collected"
                ));
                continue;
            }
            if total + size > MAX_COLLECT_TOTAL {
                notes.push(format!(
                    "{path}: past {MAX_COLLECT_TOTAL} bytes in all, not collected"
                ));
                continue;
            }
            // The size is the guest's word: the read holds it to the limits.
            let room = MAX_COLLECT_FILE.min(MAX_COLLECT_TOTAL - total);
            match agent
                .read_file_to_vec_limited(&path, usize::try_from(room).unwrap_or(usize::MAX))
                .await
            {
                Ok(bytes) => {
                    total += bytes.len() as u64;
                    collected.insert(
                        path,
                        json!(base64::engine::general_purpose::STANDARD.encode(bytes)),
                    );
                }
                Err(e) => notes.push(format!("{path}: {e}")),
            }
        }
    }
    let note = (!notes.is_empty()).then(|| format!("collect: {}", notes.join("; ")));
    (collected, note)
}

/// The regular files `pattern` names in the guest, with their sizes: a
/// plain path as is (nothing if missing), a glob by listing the directories
/// its components match, without running anything in the guest.
async fn expand(agent: &AgentClient, pattern: &str) -> Result<Vec<(String, u64)>, String> {
    let is_glob = |s: &str| s.contains(['*', '?', '[']);
    let stat_file = |path: String| async move {
        match agent.stat(&path).await {
            Ok(stat) if !stat.is_dir => Ok(Some((path, stat.size))),
            Ok(_) => Ok(None),
            Err(e) if e.guest_kind() == Some(ErrorKind::NotFound) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    };
    if !is_glob(pattern) {
        return Ok(stat_file(pattern.to_owned()).await?.into_iter().collect());
    }
    let components: Vec<&str> = pattern.split('/').filter(|c| !c.is_empty()).collect();
    // Directories matched so far, from the root.
    let mut dirs = vec![String::new()];
    // Files the last component matched in a listing, with the listing's
    // sizes: a stat of each would be a round trip (and, right after a
    // restore, fresh guest code to translate) for what is known already.
    let mut files = Vec::new();
    for (n, component) in components.iter().enumerate() {
        let last = n + 1 == components.len();
        let mut next = Vec::new();
        for dir in &dirs {
            if !is_glob(component) {
                next.push(format!("{dir}/{component}"));
                continue;
            }
            let matcher = glob::Pattern::new(component).map_err(|e| e.to_string())?;
            let listing = match agent.list_dir(if dir.is_empty() { "/" } else { dir }).await {
                Ok(entries) => entries,
                Err(e) if job_data::is_missing(&e) => continue,
                Err(e) => return Err(e.to_string()),
            };
            for entry in listing {
                if !matcher.matches(&entry.name) {
                    continue;
                }
                let path = format!("{dir}/{}", entry.name);
                if !last {
                    if entry.is_dir {
                        next.push(path);
                    }
                } else if !entry.is_dir {
                    files.push((path, entry.size));
                }
            }
        }
        dirs = next;
    }
    // Paths whose last component was plain: they may or may not exist.
    for path in dirs {
        if let Some(file) = stat_file(path).await? {
            files.push(file);
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template_of(vcpus: u32, memory_mib: u32) -> shoal_host::Manifest {
        shoal_host::Manifest {
            id: "tpl-x".into(),
            kind: shoal_host::Kind::Template,
            template: "x".into(),
            vcpus,
            memory_mib,
            memory_file: "m".into(),
            devices_file: "d".into(),
            disk_layers: Vec::new(),
            depends_on: Vec::new(),
            qemu_version: String::new(),
            accel: shoal_host::Accel::Tcg,
            kernel_version: String::new(),
            input_hash: String::new(),
            memory_sha256: None,
            created_unix_ms: 0,
        }
    }

    #[test]
    fn a_task_gets_what_it_asked_for_up_to_the_template() {
        let t = template_of(8, 2048);
        let size = |slurm: Value| {
            let s = task_size(Some(&slurm), &t);
            (s.vcpus, s.memory_mib)
        };
        assert_eq!(size(json!({})), (8, 2048), "nothing asked: the template's");
        assert_eq!(task_size(None, &t).vcpus, 8);
        assert_eq!(
            size(json!({"cpus_per_task": 2, "mem_mib": 1024})),
            (2, 1024)
        );
        assert_eq!(
            size(json!({"cpus_per_task": 64, "mem_mib": 65536})),
            (8, 2048),
            "at most the template"
        );
        assert_eq!(
            size(json!({"cpus_per_task": 2, "mem_per_cpu_mib": 300})),
            (2, 600)
        );
        assert_eq!(
            size(json!({"mem_mib": 16})),
            (8, 256),
            "never under a guest's floor"
        );
        assert_eq!(
            size(json!({"mem_mib": null, "cpus_per_task": null})),
            (8, 2048)
        );
    }

    #[test]
    fn tails_keep_the_end() {
        let mut tail = Tail::default();
        tail.push(&vec![b'a'; MAX_OUTPUT]);
        assert!(!tail.truncated);
        tail.push(b"xyz");
        assert!(tail.truncated);
        let text = tail.text();
        assert_eq!(text.len(), MAX_OUTPUT);
        assert!(text.ends_with("axyz"));
        assert_eq!(tail_text("héllo", 4), "llo");
    }
}
