//! The host agent: what one host does for the control plane.
//!
//! Owns this host's [`Engine`] and what lives beside its VMs: the capacity
//! gate (a host that is full or short of memory refuses *before* anything
//! exists, so a refused create can be retried safely), the repl sessions
//! of its sandboxes, and the volume images on its disk (`volumes.rs`).
//!
//! Does not touch: the database, accounts, quotas or HTTP. The control plane
//! decides *whether* a sandbox may exist; the host decides whether it fits.

mod capacity;
pub mod imports;
mod repl;
mod volumes;

pub use capacity::{meminfo_mib, Capacity, Held, Reservation, DEFAULT_MEMORY_OVERCOMMIT};
pub use shoal_engine::error::chain as error_chain;
pub use shoal_engine::net::GUEST_IP;
pub use shoal_engine::qemu::VOLUME_SLOTS;
pub use shoal_engine::vm::OUT_OF_MEMORY;
pub use shoal_engine::volume::valid_name as valid_volume_name;
pub use shoal_engine::warm_up;
pub use shoal_engine::{
    Accel, CpuPriority, CreateOptions, Engine, EngineConfig, EngineError, Fork, Kind, Manifest,
    SandboxInfo, Usage, VmFailure, VmState, VolumeAttachment,
};
pub use shoal_repl::{CellOutput, ReplError};

use std::path::PathBuf;
use std::sync::Arc;

/// How to run a host.
#[derive(Debug, Clone)]
pub struct HostConfig {
    pub engine: EngineConfig,
    /// Sandboxes held in memory at once (running or paused); `None`: no
    /// limit beyond memory.
    pub max_sandboxes: Option<usize>,
    /// Memory the host keeps for itself: a create is refused (507) when
    /// less than this much would be left available.
    pub memory_reserve_mib: u64,
    /// Space (MiB) kept free on the file system of the engine's state dir:
    /// a create, fork, wake, snapshot or hibernation is refused (507) while
    /// less is free. 0: no check.
    pub disk_reserve_mib: u64,
    /// VMs' memory limits may add up to this times the host's memory less
    /// the reserve (503 beyond); 0: no such limit.
    pub memory_overcommit: f64,
    /// The static guest agent installed into imported root filesystems
    /// (`imports.rs`); `None`: imports are refused.
    pub guest_agent: Option<PathBuf>,
}

/// The default of [`HostConfig::disk_reserve_mib`]: room for a few
/// snapshots' memory files and the database's growth.
pub const DEFAULT_DISK_RESERVE_MIB: u64 = 1024;

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// Every slot is taken: retry later.
    #[error("no compute capacity available")]
    Full,
    /// Too little memory is available on the host: retry later.
    #[error("insufficient host memory for sandbox: {available_mib} MiB available, {reserve_mib} MiB reserved")]
    MemoryShort {
        available_mib: u64,
        reserve_mib: u64,
    },
    /// The host's disk cannot hold a new volume: nothing was made.
    #[error(
        "insufficient host storage for volume: {available_mb} MiB free, {wanted_mb} MiB wanted"
    )]
    StorageShort { available_mb: u64, wanted_mb: u64 },
    /// The VMs placed (and being placed) may already take as much memory as
    /// the host commits: retry later.
    #[error("no compute capacity available: {committed_mib} MiB of VM memory committed, {wanted_mib} MiB more wanted, {limit_mib} MiB allowed")]
    Overcommitted {
        committed_mib: u64,
        wanted_mib: u64,
        limit_mib: u64,
    },
    /// The state disk has less free than its reserve: nothing was written.
    #[error("insufficient host storage: {available_mib} MiB free on the state disk, {reserve_mib} MiB reserved")]
    DiskShort {
        available_mib: u64,
        reserve_mib: u64,
    },
    /// Making or removing a volume image failed.
    #[error("volume image: {0}")]
    Volume(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Repl(#[from] ReplError),
    #[error("session not found")]
    NoSuchSession,
    #[error("{0}")]
    Invalid(String),
    /// An imported root filesystem or image is not usable: the caller's
    /// input, not the host's fault.
    #[error("{0}")]
    Import(String),
}

pub type Result<T, E = HostError> = std::result::Result<T, E>;

/// Where a new sandbox comes from.
#[derive(Debug, Clone)]
pub enum Source {
    Template(String),
    Snapshot(String),
}

pub struct HostAgent {
    engine: Engine,
    capacity: Capacity,
    sessions: repl::Sessions,
    guest_agent: Option<PathBuf>,
    /// One lock per sized copy being booted (`imports.rs`).
    sizing: tokio::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl HostAgent {
    pub async fn open(config: HostConfig) -> Result<Arc<HostAgent>> {
        let engine = Engine::open(config.engine.clone()).await?;
        Ok(Arc::new(HostAgent {
            engine,
            capacity: Capacity::new(config.max_sandboxes, config.memory_reserve_mib)
                .with_overcommit(config.memory_overcommit)
                .with_disk_reserve(&config.engine.state_dir, config.disk_reserve_mib),
            sessions: repl::Sessions::default(),
            guest_agent: config.guest_agent.clone(),
            sizing: tokio::sync::Mutex::default(),
        }))
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The most sandboxes this host holds, and the memory it keeps.
    pub fn capacity_limits(&self) -> (Option<usize>, u64) {
        self.capacity.limits()
    }

    /// Takes `count` slots for sandboxes of `memory_mib` of guest RAM each,
    /// about to be made (see [`Capacity`]).
    /// A refusal caused only by creates in flight waits for them, up to
    /// [`capacity::PENDING_WAIT`].
    pub async fn reserve(&self, count: usize, memory_mib: u32) -> Result<Reservation> {
        let each = u64::from(self.engine.memory_limit_mib(memory_mib));
        let deadline = tokio::time::Instant::now() + capacity::PENDING_WAIT;
        let released = self.capacity.released();
        loop {
            // Registered before the check, so a release between the check
            // and the wait is not missed.
            let woken = released.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let held = self.held().await;
            match self.capacity.try_reserve(held, count, each) {
                Ok(reservation) => return Ok(reservation),
                Err(refusal) if refusal.in_flight_only => {
                    if tokio::time::timeout_at(deadline, woken).await.is_err() {
                        return Err(refusal.error);
                    }
                }
                Err(refusal) => return Err(refusal.error),
            }
        }
    }

    /// What the VMs on this host hold now.
    pub async fn held(&self) -> Held {
        let mut held = Held::default();
        for vm in self.engine.list().await {
            if vm.state != VmState::Hibernated {
                held.sandboxes += 1;
                held.memory_mib += u64::from(self.engine.memory_limit_mib(vm.memory_mib));
            }
        }
        held
    }

    /// Makes a sandbox in a slot taken by [`HostAgent::reserve`].
    pub async fn create(
        &self,
        _slot: &Reservation,
        id: &str,
        source: &Source,
        options: CreateOptions,
    ) -> Result<SandboxInfo> {
        let id = Some(id.to_string());
        let info = match source {
            Source::Template(name) => self.engine.create_with(name, id, options).await?,
            Source::Snapshot(snapshot) => {
                self.engine
                    .create_from_snapshot_with(snapshot, id, options)
                    .await?
            }
        };
        Ok(info)
    }

    /// Forks `parent` into children with the given ids, in slots taken by
    /// [`HostAgent::reserve`].
    pub async fn fork(
        &self,
        _slots: &Reservation,
        parent: &str,
        child_ids: Vec<String>,
    ) -> Result<Fork> {
        Ok(self.engine.fork_into(parent, child_ids).await?)
    }

    /// Wakes a hibernated sandbox, which takes a slot again.
    pub async fn wake(&self, id: &str) -> Result<SandboxInfo> {
        let info = self.engine.get(id).await?;
        if info.state != VmState::Hibernated {
            return Ok(info);
        }
        let _slot = self.reserve(1, info.memory_mib).await?;
        Ok(self.engine.wake(id).await?)
    }

    pub async fn kill(&self, id: &str) -> Result<()> {
        self.sessions.close_all(id).await;
        match self.engine.kill(id).await {
            Ok(()) | Err(EngineError::NoSuchSandbox(_)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn hibernate(&self, id: &str) -> Result<()> {
        // The sandbox keeps running when its memory cannot be written.
        self.capacity.check_disk()?;
        // A kernel's process survives hibernation, but its channel does not.
        self.sessions.close_all(id).await;
        Ok(self.engine.hibernate(id).await?)
    }

    /// Takes a snapshot of a running sandbox (its memory and disk, written
    /// to the state disk), refused (507) while that disk is short. Returns
    /// the snapshot's id.
    pub async fn snapshot(&self, id: &str) -> Result<String> {
        self.capacity.check_disk()?;
        Ok(self.engine.snapshot(id).await?)
    }

    /// Deletes a snapshot of this host: new sandboxes can no longer be made
    /// from it, and its files go once no sandbox restored from it still
    /// runs. A snapshot this host does not hold is
    /// [`EngineError::NoSuchSnapshot`].
    pub async fn delete_snapshot(&self, snapshot: &str) -> Result<()> {
        Ok(self.engine.delete_snapshot(snapshot).await?)
    }

    pub async fn start_session(&self, sandbox: &str) -> Result<String> {
        let agent = self.engine.agent(sandbox).await?;
        self.sessions.start(sandbox, &agent).await
    }

    pub async fn run_cell(
        &self,
        sandbox: &str,
        session: &str,
        code: &str,
        timeout: Option<std::time::Duration>,
    ) -> Result<CellOutput> {
        self.sessions.run(sandbox, session, code, timeout).await
    }

    pub async fn close_session(&self, sandbox: &str, session: &str) -> Result<()> {
        self.sessions.close(sandbox, session).await
    }
}
