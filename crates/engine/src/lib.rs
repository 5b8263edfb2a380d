//! The VM engine: microVMs on one host, created by restoring snapshots.
//!
//! Owns: templates baked into snapshots (`bake`), QEMU processes and their
//! command lines (`qemu`, the only module that knows QEMU's flags), restore
//! (`vm`), copy-on-write fork, user snapshots, hibernate and wake (`capture`
//! via `memory`), and reaping what a crashed run left behind (`reap`).
//!
//! Networking (`net`): every VM's QEMU runs in a network namespace of its
//! own, taken from a pool prepared in the background.
//!
//! Volumes (`volume`): images the host agent made, put behind the volume
//! slots baked into every template and mounted in the guest at
//! `/mnt/volumes/<name>`. A sandbox with volumes is never forked or
//! snapshotted (a volume has one writer; a capture would restore a guest
//! that has a file system mounted on a placeholder).
//!
//! Does not own: HTTP, accounts, quotas or placement; the control plane
//! decides which sandbox exists and calls in here. Speaks QMP
//! only through `shoal-qmp` and the guest protocol only through
//! `shoal-proto`. One engine owns one state directory, enforced by a lock.
//!
//! Directory layout. The cache holds what is built once and shared (several
//! engines, e.g. a test run beside `shoal up`, may read one cache); the
//! state directory belongs to exactly one engine:
//! ```text
//! <cache>/images/                  image layers (shoal-image)
//! <cache>/templates/<name>/<hash>/ baked template: memory, devices, disk.qcow2, manifest.json
//! <cache>/templates/<name>/current the hash in use
//! <cache>/overlays/                empty qcow2 layers copied for each VM, the volume-slot placeholder
//! <state>/engine.lock
//! <state>/captures/<id>/           fork points, snapshots, hibernated state
//! <state>/vms/<id>/                one VM: sockets, logs, its disk layer, vm.json
//! <state>/volumes/<account>/      volume images (made by the host agent; opened here)
//! ```

pub mod accel;
mod bake;
mod bake_gc;
mod capture;
pub mod cgroup;
pub mod disk_boot;
pub mod error;
pub mod integrity;
pub mod jail;
pub mod manifest;
pub mod memory;
pub mod net;
pub mod priority;
pub mod qemu;
mod reap;
pub mod vm;
pub mod volume;
pub mod warm_up;

pub use accel::Accel;
pub use bake::BakeProgress;
pub use disk_boot::{BootDisk, DiskBootSpec, SIZED_PREFIX};
pub use error::{EngineError, Result};
pub use manifest::{Kind, Manifest};
pub use priority::CpuPriority;
pub use shoal_proto::client::AgentClient;
pub use vm::VmState;
pub use volume::VolumeAttachment;

use error::IoContext;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use vm::{RestoreContext, Vm, VmInner};

/// How to open an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// This engine's own VMs and captures; locked while the engine runs.
    pub state_dir: PathBuf,
    /// Images, baked templates and empty overlays; shared, built once.
    pub cache_dir: PathBuf,
    pub qemu: PathBuf,
    /// `None` chooses automatically (see [`accel::detect`]).
    pub accel: Option<Accel>,
    /// Root of the proc filesystem (a parameter so tests can fake it).
    pub proc_root: PathBuf,
    /// Where fork points keep their memory: a tmpfs, because a fork copies
    /// the template's memory and a RAM-backed copy is several times faster
    /// than one on disk; fork points live only as long as their children.
    /// `None`: a directory under `/dev/shm` named after the state dir, or
    /// the captures directory where `/dev/shm` is missing.
    pub fork_memory_dir: Option<PathBuf>,
    /// Network namespaces kept prepared, so a create only takes one.
    pub net_pool_size: usize,
    /// Where guests' DNS queries (to their gateway) are sent; `None`: the
    /// host's own resolver ([`net::host_resolver`]).
    pub dns_upstream: Option<std::net::Ipv4Addr>,
    /// How each QEMU is contained: uid range, jail root, cgroup limits.
    pub jail: jail::JailConfig,
    /// Whether running and paused VMs whose QEMU outlived a run that died
    /// are adopted (the service, whose control plane owns their rows) or
    /// reaped (a command that only borrows the state directory).
    pub adopt_survivors: bool,
}

impl EngineConfig {
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        let state_dir = state_dir.into();
        EngineConfig {
            cache_dir: state_dir.clone(),
            state_dir,
            qemu: PathBuf::from("qemu-system-x86_64"),
            accel: None,
            proc_root: PathBuf::from("/proc"),
            fork_memory_dir: None,
            net_pool_size: 4,
            dns_upstream: None,
            jail: jail::JailConfig::default(),
            adopt_survivors: false,
        }
    }

    fn resolved_fork_memory_dir(&self) -> PathBuf {
        if let Some(dir) = &self.fork_memory_dir {
            return dir.clone();
        }
        self.shared_fork_memory_dir()
            .unwrap_or_else(|| self.state_dir.join("captures"))
    }

    /// The default fork-memory directory under `/dev/shm`, shared by every
    /// state directory's engine (each in a directory of its own), when that
    /// is where fork memory goes.
    fn shared_fork_memory_dir(&self) -> Option<PathBuf> {
        let shm = Path::new("/dev/shm");
        if self.fork_memory_dir.is_some() || !shm.is_dir() {
            return None;
        }
        use sha2::Digest;
        let digest = sha2::Sha256::digest(self.absolute_state_dir().as_os_str().as_encoded_bytes());
        Some(shm.join(format!("shoal-{}", &hex::encode(digest)[..12])))
    }

    fn absolute_state_dir(&self) -> PathBuf {
        std::fs::canonicalize(&self.state_dir).unwrap_or_else(|_| self.state_dir.clone())
    }
}

/// How long a delete waits for a VM's guest call to end (see
/// [`Engine::kill`]).
const KILL_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

/// What the engine tells about one sandbox.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SandboxInfo {
    pub id: String,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub state: VmState,
    pub pid: Option<u32>,
    pub created_unix_ms: u64,
    /// Wall time of the restore that made it, until the agent answered.
    pub restore_ms: f64,
    /// The guest's address inside its own namespace (the same in every
    /// sandbox).
    pub guest_ip: String,
    pub allow_internet: bool,
    /// The host end of its veth pair, while it has a QEMU process.
    pub host_veth: Option<String>,
    /// Volume names, in slot order, each mounted at `/mnt/volumes/<name>`.
    pub volumes: Vec<String>,
    /// Why it failed, if its QEMU died ([`vm::OUT_OF_MEMORY`] when the
    /// kernel killed it for memory); a failed sandbox can only be deleted.
    pub failure: Option<String>,
}

/// A sandbox whose QEMU died without the engine asking.
#[derive(Debug, Clone)]
pub struct VmFailure {
    pub id: String,
    pub reason: String,
}

/// What a create may choose besides its source.
#[derive(Debug, Clone)]
pub struct CreateOptions {
    /// Whether the guest may open connections beyond its namespace.
    pub allow_internet: bool,
    /// Volumes to put behind the slots and mount (at most
    /// [`qemu::VOLUME_SLOTS`]); the caller decided they may be attached.
    pub volumes: Vec<VolumeAttachment>,
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions {
            allow_internet: true,
            volumes: Vec::new(),
        }
    }
}

/// The children of a fork, and how long the parent's state took to capture
/// (the children's `restore_ms` count from the end of it).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Fork {
    pub capture_ms: f64,
    pub children: Vec<SandboxInfo>,
}

/// Resource use of one VM process, for metering.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Usage {
    pub cpu_seconds: f64,
    pub pss_bytes: u64,
    pub rss_bytes: u64,
}

pub struct Engine {
    config: EngineConfig,
    accel: Accel,
    qemu_version: String,
    vms: Mutex<HashMap<String, Arc<Vm>>>,
    /// Serialises capture-file garbage collection against new references.
    gc_lock: tokio::sync::Mutex<()>,
    /// Fork points whose children are still being restored: no VM refers to
    /// them yet, but they must not be collected.
    pinned: Mutex<HashMap<String, usize>>,
    pub(crate) net: Arc<net::NetPool>,
    pub(crate) jail: jail::Jail,
    failures: tokio::sync::broadcast::Sender<VmFailure>,
    /// Template memory files hashed and found as baked (see [`integrity`]).
    verified: integrity::Verified,
    _lock: std::fs::File,
}

impl Engine {
    /// Opens the state directory, takes its lock, and reaps whatever a
    /// previous run left behind (QEMU processes, sockets, overlays, unused
    /// fork captures). Hibernated VMs and user snapshots are kept, and
    /// running or paused VMs whose QEMU outlived a run that died are
    /// adopted: their process, network slot, cgroup and sockets.
    pub async fn open(config: EngineConfig) -> Result<Engine> {
        for dir in [
            config.cache_dir.join("templates"),
            config.cache_dir.join("overlays"),
            config.cache_dir.join("images"),
            config.state_dir.join("captures"),
            config.state_dir.join("vms"),
        ] {
            std::fs::create_dir_all(&dir).io_context(|| format!("creating {}", dir.display()))?;
        }
        let lock = lock_file(&config.state_dir.join("engine.lock"), false)
            .map_err(|_| EngineError::StateDirBusy(config.state_dir.clone()))?;
        let accel = config.accel.unwrap_or_else(|| {
            accel::detect(&config.proc_root.join("cpuinfo"), Path::new("/dev/kvm"))
        });
        let qemu_version = qemu::version_id(&config.qemu)?;
        // QEMU processes a crashed run left are killed first (below), which
        // frees their namespaces; the pool reaps veths no engine holds.
        let leftovers =
            reap::reap_leftovers(&config.state_dir, &config.proc_root, config.adopt_survivors)?;
        // Survivors' slots are claimed before the pool opens, which reaps
        // every `shoalh<N>` whose slot nobody holds.
        let mut survivors = Vec::new();
        for survivor in leftovers.survivors {
            match net::adopt_slot(survivor.net_slot, survivor.pid) {
                Ok(slot) => survivors.push((survivor, slot)),
                Err(e) => {
                    tracing::warn!(id = survivor.record.id, error = %error::chain(&e), "a VM that outlived the last run cannot be adopted");
                    let dir = config.state_dir.join("vms").join(&survivor.record.id);
                    reap::reap_vm(&config.proc_root, &dir, Some(survivor.pid));
                }
            }
        }
        // Made only now, under the state dir's lock and with its owner
        // named at once: a directory without an owner is never reaped.
        match config.shared_fork_memory_dir() {
            Some(own) => {
                reap::claim_fork_memory_dir(&own, &config.absolute_state_dir())?;
                if let Some(root) = own.parent() {
                    reap::reap_orphaned_fork_memory(root, &own);
                }
            }
            None => {
                let dir = config.resolved_fork_memory_dir();
                std::fs::create_dir_all(&dir)
                    .io_context(|| format!("creating {}", dir.display()))?;
            }
        }
        let jail = jail::Jail::open(config.jail.clone())?;
        let dns = config.dns_upstream.unwrap_or_else(net::host_resolver);
        let net = net::NetPool::open(config.net_pool_size, dns)?;
        let engine = Engine {
            config,
            accel,
            qemu_version,
            vms: Mutex::new(HashMap::new()),
            gc_lock: tokio::sync::Mutex::new(()),
            pinned: Mutex::new(HashMap::new()),
            net,
            jail,
            failures: tokio::sync::broadcast::channel(256).0,
            verified: integrity::Verified::default(),
            _lock: lock,
        };
        for record in leftovers.hibernated {
            let id = record.id.clone();
            let vm = Arc::new(Vm::from_record(
                record,
                engine.vm_dir(&id),
                VmState::Hibernated,
            ));
            engine.vms.lock().unwrap().insert(id, vm);
        }
        for (survivor, slot) in survivors {
            engine.adopt(survivor, slot).await;
        }
        engine.collect_captures().await;
        engine.collect_old_bakes();
        Ok(engine)
    }

    /// Takes over a VM whose QEMU outlived the engine that started it (see
    /// [`vm::adopt`]); one that cannot be taken over is killed and its
    /// directory removed, as a crash left it before adoption existed.
    async fn adopt(&self, survivor: reap::Survivor, slot: net::NetSlot) {
        let reap::Survivor { record, pid, .. } = survivor;
        let dir = self.vm_dir(&record.id);
        let started = std::time::Instant::now();
        let adopted = match self.jail.adopt_vm(slot.index, pid) {
            Ok(jail) => vm::adopt(&record.id, pid, &dir, slot, jail).await,
            Err(e) => Err(e),
        };
        let (live, state) = match adopted {
            Ok(adopted) => adopted,
            Err(e) => {
                tracing::warn!(id = record.id, error = %error::chain(&e), "a VM that outlived the last run cannot be adopted");
                reap::reap_vm(&self.config.proc_root, &dir, Some(pid));
                return;
            }
        };
        let id = record.id.clone();
        let vm = Arc::new(Vm::from_record(record, dir.clone(), state));
        if let Err(e) = self.watch_for_failure(&vm, &live) {
            tracing::warn!(id, error = %error::chain(&e), "watching an adopted VM");
            live.terminate().await;
            reap::reap_vm(&self.config.proc_root, &dir, Some(pid));
            return;
        }
        let mut inner = vm.inner.lock().await;
        inner.live = Some(live);
        vm.set_state(&mut inner, state);
        if let Err(e) = vm.store_record(&inner) {
            tracing::warn!(id, error = %error::chain(&e), "recording an adopted VM");
        }
        self.record_cache_use(&vm.dir, &inner.source);
        drop(inner);
        tracing::info!(
            id,
            state = state.as_str(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "adopted a VM that outlived the last run"
        );
        self.vms.lock().unwrap().insert(id, vm);
    }

    /// The memory limit (MiB) of a VM with `memory_mib` of guest RAM: what
    /// it may take of the host at most.
    pub fn memory_limit_mib(&self, memory_mib: u32) -> u32 {
        self.config
            .jail
            .memory_limit_mib
            .unwrap_or(memory_mib.saturating_add(self.config.jail.memory_overhead_mib))
    }

    pub fn accel(&self) -> Accel {
        self.accel
    }

    pub fn qemu_version(&self) -> &str {
        &self.qemu_version
    }

    pub fn state_dir(&self) -> &Path {
        &self.config.state_dir
    }

    fn vm_dir(&self, id: &str) -> PathBuf {
        self.config.state_dir.join("vms").join(id)
    }

    fn captures_dir(&self) -> PathBuf {
        self.config.state_dir.join("captures")
    }

    pub(crate) fn fork_memory_dir(&self) -> PathBuf {
        self.config.resolved_fork_memory_dir()
    }

    fn vm(&self, id: &str) -> Result<Arc<Vm>> {
        self.vms
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| EngineError::NoSuchSandbox(id.to_string()))
    }

    /// The baked template `name`, checked against this host's QEMU and
    /// accelerator.
    pub fn template(&self, name: &str) -> Result<Manifest> {
        if shoal_image::find_template(name).is_none() {
            return Err(EngineError::UnknownTemplate(name.to_string()));
        }
        let dir = self.config.cache_dir.join("templates").join(name);
        let current = std::fs::read_to_string(dir.join("current"))
            .map_err(|_| EngineError::TemplateNotBuilt(name.to_string()))?;
        let manifest = Manifest::load(&dir.join(current.trim()))
            .map_err(|_| EngineError::TemplateNotBuilt(name.to_string()))?;
        self.check_compatible(&manifest)?;
        Ok(manifest)
    }

    /// [`Engine::template`], with its memory file checked against its bake
    /// (as every create does).
    pub fn verified_template(&self, name: &str) -> Result<Manifest> {
        let manifest = self.template(name)?;
        self.verify_template_memory(&manifest)?;
        Ok(manifest)
    }

    /// Refuses a template whose memory file is not what its bake wrote
    /// (see [`integrity`]). A bake from before the hash was recorded gets
    /// it now, from the file as it is.
    fn verify_template_memory(&self, manifest: &Manifest) -> Result<()> {
        let expected = match &manifest.memory_sha256 {
            Some(hash) => hash.clone(),
            None => {
                // Written atomically; two engines doing this at once write
                // the same manifest.
                let hash = integrity::memory_sha256(&manifest.memory_file)?;
                let mut recorded = manifest.clone();
                recorded.memory_sha256 = Some(hash.clone());
                if let Some(bake_dir) = manifest.memory_file.parent() {
                    recorded.store(bake_dir)?;
                }
                hash
            }
        };
        self.verified
            .check(&manifest.memory_file, &expected, &manifest.template)
    }

    fn check_compatible(&self, manifest: &Manifest) -> Result<()> {
        let host = format!("{} ({})", self.qemu_version, self.accel);
        let baked_by = format!("{} ({})", manifest.qemu_version, manifest.accel);
        if host != baked_by {
            return Err(EngineError::TemplateStale {
                name: manifest.template.clone(),
                baked_by,
                host,
            });
        }
        Ok(())
    }

    /// Creates a sandbox by restoring template `template`.
    pub async fn create(&self, template: &str, id: Option<String>) -> Result<SandboxInfo> {
        self.create_with(template, id, CreateOptions::default())
            .await
    }

    /// [`Engine::create`] with options.
    pub async fn create_with(
        &self,
        template: &str,
        id: Option<String>,
        options: CreateOptions,
    ) -> Result<SandboxInfo> {
        let source = self.template(template)?;
        self.verify_template_memory(&source)?;
        let id = id.unwrap_or_else(new_sandbox_id);
        self.start_from(id, source, options).await
    }

    /// Creates a sandbox from a user snapshot.
    pub async fn create_from_snapshot(
        &self,
        snapshot: &str,
        id: Option<String>,
    ) -> Result<SandboxInfo> {
        self.create_from_snapshot_with(snapshot, id, CreateOptions::default())
            .await
    }

    /// [`Engine::create_from_snapshot`] with options.
    pub async fn create_from_snapshot_with(
        &self,
        snapshot: &str,
        id: Option<String>,
        options: CreateOptions,
    ) -> Result<SandboxInfo> {
        let source = self.snapshot_manifest(snapshot)?;
        let id = id.unwrap_or_else(new_sandbox_id);
        self.start_from(id, source, options).await
    }

    /// The manifest of user snapshot `snapshot`, restorable here:
    /// [`EngineError::NoSuchSnapshot`] when this host does not hold it (a
    /// fleet's snapshots live on the host that took them). One file read,
    /// where [`Engine::snapshots`] reads them all.
    pub fn snapshot_manifest(&self, snapshot: &str) -> Result<Manifest> {
        if !valid_id(snapshot) {
            return Err(EngineError::NoSuchSnapshot(snapshot.to_string()));
        }
        let manifest = Manifest::load(&self.captures_dir().join(snapshot))
            .map_err(|_| EngineError::NoSuchSnapshot(snapshot.to_string()))?;
        if manifest.kind != Kind::Snapshot {
            return Err(EngineError::NoSuchSnapshot(snapshot.to_string()));
        }
        self.check_compatible(&manifest)?;
        Ok(manifest)
    }

    async fn start_from(
        &self,
        id: String,
        source: Manifest,
        options: CreateOptions,
    ) -> Result<SandboxInfo> {
        if !valid_id(&id) {
            return Err(EngineError::InvalidInput(format!(
                "sandbox id {id:?} must be 1-64 of [a-z0-9-]"
            )));
        }
        volume::validate(&options.volumes)?;
        let dir = self.vm_dir(&id);
        let vm = Arc::new(Vm {
            id: id.clone(),
            dir: dir.clone(),
            inner: tokio::sync::Mutex::new(VmInner {
                state: VmState::Running,
                source: source.clone(),
                live: None,
            }),
            now: vm::VmNow::new(VmState::Running, &source),
            failure: Mutex::new(None),
            created_unix_ms: manifest::now_unix_ms(),
            restore_ms: Mutex::new(0.0),
            allow_internet: options.allow_internet,
            volumes: options.volumes,
        });
        {
            let mut vms = self.vms.lock().unwrap();
            if vms.contains_key(&id) {
                return Err(EngineError::InvalidInput(format!(
                    "sandbox {id} already exists"
                )));
            }
            vms.insert(id.clone(), vm.clone());
        }
        let started = std::time::Instant::now();
        match self.bring_up(&vm, &source).await {
            Ok(()) => {
                *vm.restore_ms.lock().unwrap() = started.elapsed().as_secs_f64() * 1000.0;
                Ok(self.info_of(&vm))
            }
            Err(e) => {
                self.vms.lock().unwrap().remove(&id);
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    async fn bring_up(&self, vm: &Arc<Vm>, source: &Manifest) -> Result<()> {
        std::fs::create_dir_all(&vm.dir).io_context(|| format!("creating {}", vm.dir.display()))?;
        let mut inner = vm.inner.lock().await;
        // vm.json goes first with no pid, so a crash mid-restore is reaped.
        vm.store_record(&inner)?;
        self.record_cache_use(&vm.dir, source);
        let live = self.restore_vm(vm, source, volume::Step::Mount).await?;
        inner.live = Some(live);
        inner.source = source.clone();
        vm.set_state(&mut inner, VmState::Running);
        vm.store_record(&inner)?;
        Ok(())
    }

    /// Restores `vm` from `source` with its volumes behind their slots, then
    /// has the guest mount them (a new sandbox) or thaw them (a wake). On
    /// failure the process is killed.
    async fn restore_vm(
        &self,
        vm: &Arc<Vm>,
        source: &Manifest,
        step: volume::Step,
    ) -> Result<vm::Live> {
        let overlay = self.empty_overlay(source)?;
        let placeholder = self.volume_placeholder()?;
        let ctx = RestoreContext {
            qemu: &self.config.qemu,
            accel: self.accel,
            empty_overlay: &overlay,
            volume_placeholder: &placeholder,
            jail: &self.jail,
        };
        let net = self.net.take().await?;
        let live = vm::restore(
            &ctx,
            &vm.id,
            &vm.dir,
            source,
            net,
            vm.allow_internet,
            &vm.volumes,
        )
        .await?;
        if let Err(e) = volume::after_restore(&live.agent, &vm.volumes, step).await {
            live.terminate().await;
            return Err(e);
        }
        if let Err(e) = self.watch_for_failure(vm, &live) {
            live.terminate().await;
            return Err(e);
        }
        Ok(live)
    }

    /// Reports `vm` failed (see [`Engine::failures`]) if `live`'s QEMU
    /// ends without the engine stopping it.
    fn watch_for_failure(&self, vm: &Arc<Vm>, live: &vm::Live) -> Result<()> {
        let failures = self.failures.clone();
        let dead = Arc::downgrade(vm);
        vm::watch_exit(
            live.pid,
            live.stopping.clone(),
            live.jail.cgroup.oom_counter(),
            qemu::console_log(&vm.dir),
            move |reason| {
                let Some(vm) = dead.upgrade() else { return };
                tracing::warn!(sandbox = vm.id, reason, "sandbox failed");
                *vm.failure.lock().unwrap() = Some(reason.clone());
                let _ = failures.send(VmFailure {
                    id: vm.id.clone(),
                    reason,
                });
            },
        )
    }

    /// Sandboxes whose QEMU dies from now on, as it happens (the control
    /// plane marks their rows `failed` with the reason).
    pub fn failures(&self) -> tokio::sync::broadcast::Receiver<VmFailure> {
        self.failures.subscribe()
    }

    /// The file behind unused volume slots, made once in the cache.
    fn volume_placeholder(&self) -> Result<PathBuf> {
        volume::placeholder(&self.config.cache_dir.join("overlays"))
    }

    /// An empty qcow2 layer the size of `source`'s disk, made once and copied.
    fn empty_overlay(&self, source: &Manifest) -> Result<PathBuf> {
        let base = source
            .disk_layers
            .first()
            .ok_or_else(|| EngineError::InvalidInput("snapshot has no disk".into()))?;
        self.empty_overlay_over(base)
    }

    /// [`Engine::empty_overlay`] of a chain whose bottom layer is `base`.
    fn empty_overlay_over(&self, base: &Path) -> Result<PathBuf> {
        let size = std::fs::metadata(base)
            .io_context(|| format!("reading size of {}", base.display()))?
            .len();
        let path = self
            .config
            .cache_dir
            .join("overlays")
            .join(format!("empty-{size}.qcow2"));
        if !path.exists() {
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            let output = std::process::Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2", "-o", "compat=1.1"])
                .arg(&tmp)
                .arg(size.to_string())
                .output()
                .io_context(|| "running qemu-img create".into())?;
            if !output.status.success() {
                return Err(EngineError::Qemu {
                    message: format!(
                        "qemu-img create failed: {}",
                        String::from_utf8_lossy(&output.stderr).trim()
                    ),
                });
            }
            std::fs::rename(&tmp, &path).io_context(|| format!("renaming {}", tmp.display()))?;
        }
        Ok(path)
    }

    /// Takes no async lock: a VM whose guest call holds `inner` does not
    /// delay a listing (see [`Vm::now`]).
    fn info_of(&self, vm: &Vm) -> SandboxInfo {
        let now = vm.now.lock().unwrap().clone();
        SandboxInfo {
            id: vm.id.clone(),
            template: now.template,
            vcpus: now.vcpus,
            memory_mib: now.memory_mib,
            state: now.state,
            pid: now.pid,
            created_unix_ms: vm.created_unix_ms,
            restore_ms: *vm.restore_ms.lock().unwrap(),
            guest_ip: net::GUEST_IP.to_string(),
            allow_internet: vm.allow_internet,
            host_veth: now.host_veth,
            volumes: vm.volumes.iter().map(|v| v.name.clone()).collect(),
            failure: vm.failure.lock().unwrap().clone(),
        }
    }

    /// The guest's console output (kernel and guest agent), as a file.
    pub fn console_log(&self, id: &str) -> Result<PathBuf> {
        let vm = self.vm(id)?;
        Ok(qemu::console_log(&vm.dir))
    }

    pub async fn get(&self, id: &str) -> Result<SandboxInfo> {
        let vm = self.vm(id)?;
        Ok(self.info_of(&vm))
    }

    pub async fn list(&self) -> Vec<SandboxInfo> {
        let vms: Vec<Arc<Vm>> = self.vms.lock().unwrap().values().cloned().collect();
        let mut out = Vec::with_capacity(vms.len());
        for vm in vms {
            out.push(self.info_of(&vm));
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// The guest agent of a running sandbox, for exec and files.
    pub async fn agent(&self, id: &str) -> Result<AgentClient> {
        let vm = self.vm(id)?;
        failed(&vm)?;
        let inner = vm.inner.lock().await;
        match (&inner.live, inner.state) {
            (Some(live), VmState::Running) => Ok(live.agent.clone()),
            _ => Err(EngineError::WrongState {
                id: id.to_string(),
                state: inner.state.as_str(),
                wanted: "running",
            }),
        }
    }

    pub async fn pause(&self, id: &str) -> Result<()> {
        let vm = self.vm(id)?;
        let mut inner = vm.inner.lock().await;
        let live = running(&vm, &inner)?;
        live.qmp.stop().await?;
        vm.set_state(&mut inner, VmState::Paused);
        vm.store_record(&inner)
    }

    pub async fn resume(&self, id: &str) -> Result<()> {
        let vm = self.vm(id)?;
        let mut inner = vm.inner.lock().await;
        if inner.state != VmState::Paused {
            return Err(EngineError::WrongState {
                id: id.to_string(),
                state: inner.state.as_str(),
                wanted: "paused",
            });
        }
        let live = inner.live.as_ref().expect("a paused VM has a process");
        live.qmp.cont().await?;
        vm.set_state(&mut inner, VmState::Running);
        vm.store_record(&inner)
    }

    /// Forks a running sandbox into `count` children that start from its
    /// memory and disk as they are now. The parent goes on running.
    pub async fn fork(&self, id: &str, count: usize) -> Result<Fork> {
        self.fork_into(id, (0..count).map(|_| new_sandbox_id()).collect())
            .await
    }

    /// [`Engine::fork`] with the children's ids chosen by the caller.
    pub async fn fork_into(&self, id: &str, child_ids: Vec<String>) -> Result<Fork> {
        let count = child_ids.len();
        if count == 0 || count > 64 {
            return Err(EngineError::InvalidInput(format!(
                "fork count {count} must be between 1 and 64"
            )));
        }
        let vm = self.vm(id)?;
        refuse_capture_with_volumes(&vm)?;
        let capture_started = std::time::Instant::now();
        let (point, pin) = {
            let _gc = self.gc_lock.lock().await;
            let mut inner = vm.inner.lock().await;
            running(&vm, &inner)?;
            let point = capture::capture(self, &vm, &mut inner, Kind::Fork, true).await?;
            // Pinned before the collector can run again; the children refer
            // to the point only once they are registered.
            let pin = Pin::new(&self.pinned, &point.id);
            (point, pin)
        };
        let capture_ms = capture_started.elapsed().as_secs_f64() * 1000.0;
        // A restore is CPU-bound (QEMU start-up, then translating the guest's
        // code afresh), so more at once than there are cores only makes every
        // child late; in waves, the first children answer early.
        let slots = tokio::sync::Semaphore::new(restore_parallelism());
        let children = futures::future::join_all(child_ids.into_iter().map(|child| async {
            let _slot = slots
                .acquire()
                .await
                .expect("the semaphore is never closed");
            let options = CreateOptions {
                allow_internet: vm.allow_internet,
                volumes: Vec::new(),
            };
            let started = self.start_from(child, point.clone(), options).await;
            // A child that answers goes on running the parent's programs;
            // until every sibling has answered, it takes only the CPU their
            // restores leave (see `priority`).
            if let (Ok(info), true) = (&started, count > 1) {
                let _ = self.set_cpu_priority(&info.id, CpuPriority::Background);
            }
            started
        }))
        .await;
        drop(pin);
        if count > 1 {
            for child in children.iter().flatten() {
                if let Err(e) = self.set_cpu_priority(&child.id, CpuPriority::Normal) {
                    tracing::warn!(sandbox = child.id, error = %error::chain(&e), "a fork child stays in the background");
                }
            }
        }
        let mut out = Vec::new();
        let mut first_error = None;
        for child in children {
            match child {
                Ok(info) => out.push(info),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            // All or nothing: a fork that returns an error leaves no child.
            for info in &out {
                let _ = self.kill(&info.id).await;
            }
            self.collect_captures().await;
            return Err(e);
        }
        Ok(Fork {
            capture_ms,
            children: out,
        })
    }

    /// Saves a running sandbox's memory, devices and disk as a snapshot that
    /// new sandboxes can be created from. Returns its id.
    pub async fn snapshot(&self, id: &str) -> Result<String> {
        let vm = self.vm(id)?;
        refuse_capture_with_volumes(&vm)?;
        let _gc = self.gc_lock.lock().await;
        let mut inner = vm.inner.lock().await;
        running(&vm, &inner)?;
        let manifest = capture::capture(self, &vm, &mut inner, Kind::Snapshot, true).await?;
        Ok(manifest.id)
    }

    /// Ids of the user snapshots on this host.
    pub fn snapshots(&self) -> Vec<Manifest> {
        let mut out: Vec<Manifest> = std::fs::read_dir(self.captures_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| Manifest::load(&entry.path()).ok())
            .filter(|m| m.kind == Kind::Snapshot)
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Marks the snapshot as used now (what [`Engine::snapshot_used_at`]
    /// reads): eviction of derived copies goes by it.
    pub fn touch_snapshot(&self, snapshot: &str) {
        let marker = self.captures_dir().join(snapshot).join("used");
        let touched = std::fs::File::create(&marker)
            .and_then(|f| f.set_modified(std::time::SystemTime::now()));
        if let Err(e) = touched {
            tracing::debug!(snapshot, error = %e, "marking a snapshot used");
        }
    }

    /// When the snapshot was last marked used, or else made.
    pub fn snapshot_used_at(&self, snapshot: &str) -> std::time::SystemTime {
        let dir = self.captures_dir().join(snapshot);
        std::fs::metadata(dir.join("used"))
            .or_else(|_| std::fs::metadata(&dir))
            .and_then(|m| m.modified())
            .unwrap_or(std::time::UNIX_EPOCH)
    }

    pub async fn delete_snapshot(&self, snapshot: &str) -> Result<()> {
        self.snapshot_manifest(snapshot)?;
        let _gc = self.gc_lock.lock().await;
        let dir = self.captures_dir().join(snapshot);
        // Demote to a fork capture: its files go once nothing restored from it
        // still uses them.
        let mut manifest = Manifest::load(&dir)?;
        manifest.kind = Kind::Fork;
        manifest.store(&dir)?;
        // Its sized copies (booted from its disk at another size) go with
        // it; snapshots users took of sandboxes restored from it stay.
        for derived in self.snapshots() {
            if derived.id.starts_with(SIZED_PREFIX)
                && derived.depends_on.iter().any(|d| d == snapshot)
            {
                let dir = self.captures_dir().join(&derived.id);
                let demoted = Manifest {
                    kind: Kind::Fork,
                    ..derived
                };
                demoted.store(&dir)?;
            }
        }
        drop(_gc);
        self.collect_captures().await;
        Ok(())
    }

    /// Saves the sandbox's whole state to disk and stops its QEMU process,
    /// freeing its memory. [`Engine::wake`] brings it back.
    pub async fn hibernate(&self, id: &str) -> Result<()> {
        let vm = self.vm(id)?;
        {
            let _gc = self.gc_lock.lock().await;
            let mut inner = vm.inner.lock().await;
            if inner.state == VmState::Hibernated {
                return Ok(());
            }
            // Frozen first, so the images are clean should the sandbox be
            // deleted without waking; a wake thaws them.
            if let Some(live) = &inner.live {
                volume::freeze(&live.agent, &vm.volumes).await?;
            }
            let captured = capture::capture(self, &vm, &mut inner, Kind::Hibernate, false).await;
            let manifest = match captured {
                Ok(manifest) => manifest,
                Err(e) => {
                    if let Some(live) = &inner.live {
                        let _ = live.qmp.cont().await;
                        let _ = volume::thaw(&live.agent, &vm.volumes).await;
                    }
                    return Err(e);
                }
            };
            if let Some(live) = inner.live.take() {
                live.stopping
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                let _ = live.qmp.quit().await;
                live.terminate().await;
            }
            for leftover in ["disk.qcow2", "qmp.sock", "agent.sock"] {
                let _ = std::fs::remove_file(vm.dir.join(leftover));
            }
            inner.source = manifest;
            vm.set_state(&mut inner, VmState::Hibernated);
            vm.store_record(&inner)?;
        }
        self.collect_captures().await;
        Ok(())
    }

    /// Restores a hibernated sandbox under the same id.
    pub async fn wake(&self, id: &str) -> Result<SandboxInfo> {
        let vm = self.vm(id)?;
        {
            let mut inner = vm.inner.lock().await;
            if inner.state != VmState::Hibernated {
                return Err(EngineError::WrongState {
                    id: id.to_string(),
                    state: inner.state.as_str(),
                    wanted: "hibernated",
                });
            }
            self.check_compatible(&inner.source)?;
            let source = inner.source.clone();
            let live = self.restore_vm(&vm, &source, volume::Step::Thaw).await?;
            inner.live = Some(live);
            vm.set_state(&mut inner, VmState::Running);
            vm.store_record(&inner)?;
        }
        Ok(self.info_of(&vm))
    }

    /// Kills a sandbox: its process, and every file, socket and disk layer
    /// it owned. Capture files only it used go too.
    pub async fn kill(&self, id: &str) -> Result<()> {
        let vm = self
            .vms
            .lock()
            .unwrap()
            .remove(id)
            .ok_or_else(|| EngineError::NoSuchSandbox(id.to_string()))?;
        let held_captures = {
            let mut inner = self.lock_to_kill(&vm).await;
            if let Some(live) = &inner.live {
                if !vm.volumes.is_empty() {
                    // A paused guest cannot unmount: let it run for that.
                    if inner.state == VmState::Paused {
                        let _ = live.qmp.cont().await;
                    }
                    if let Err(e) = volume::detach(&live.agent, &vm.volumes).await {
                        tracing::warn!(id, error = %error::chain(&e), "volumes not left clean");
                    }
                }
            }
            if let Some(live) = inner.live.take() {
                // A dying process still needs CPU to free its memory: in
                // the background that waits behind every busy guest.
                let _ = priority::apply(&self.config.proc_root, live.pid, CpuPriority::Normal);
                live.terminate().await;
            }
            self.forget_cache_use(&vm.dir, &inner.source);
            !inner.source.captures_needed().is_empty()
        };
        std::fs::remove_dir_all(&vm.dir).io_context(|| format!("removing {}", vm.dir.display()))?;
        // Only a VM that held captures can have freed one. The collection
        // waits for every other VM's lock, a restore in progress included:
        // run for a plain template VM, it made each delete wait for the
        // slowest create under way (seconds, with twenty restores at once).
        if held_captures {
            self.collect_captures().await;
        }
        Ok(())
    }

    /// `vm`'s state for a kill. A call into its guest (freezing volumes for
    /// a hibernation, say) may hold it up to that call's deadline; a delete
    /// waits [`KILL_PATIENCE`], then ends the QEMU, which ends the call.
    async fn lock_to_kill<'a>(&self, vm: &'a Vm) -> tokio::sync::MutexGuard<'a, VmInner> {
        if let Ok(inner) = tokio::time::timeout(KILL_PATIENCE, vm.inner.lock()).await {
            return inner;
        }
        if let Some(pid) = vm.pid() {
            tracing::warn!(
                id = vm.id,
                pid,
                "a guest call holds the sandbox: killing its QEMU"
            );
            // The QEMU is our unreaped child while `inner.live` holds it,
            // and only the holder of `inner` reaps it.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        vm.inner.lock().await
    }

    /// Kills every VM with a QEMU process and keeps the hibernated ones,
    /// whose state is on disk for the next engine on this state directory
    /// to wake: what a stop of the service does after hibernating what it
    /// could.
    pub async fn kill_running(&self) {
        let vms: Vec<(String, Arc<Vm>)> = self
            .vms
            .lock()
            .unwrap()
            .iter()
            .map(|(id, vm)| (id.clone(), vm.clone()))
            .collect();
        for (id, vm) in vms {
            let hibernated = vm.inner.lock().await.state == VmState::Hibernated;
            if !hibernated {
                let _ = self.kill(&id).await;
            }
        }
    }

    /// Kills every sandbox, hibernated ones too.
    pub async fn kill_all(&self) {
        let ids: Vec<String> = self.vms.lock().unwrap().keys().cloned().collect();
        for id in ids {
            let _ = self.kill(&id).await;
        }
    }

    /// A TCP connection to `port` of a running sandbox's guest, opened from
    /// inside its network namespace (the host has no route to the guest).
    pub async fn connect(&self, id: &str, port: u16) -> Result<tokio::net::TcpStream> {
        let socket = {
            let vm = self.vm(id)?;
            let inner = vm.inner.lock().await;
            let live = running(&vm, &inner)?;
            live.net.tcp_socket()?
        };
        let socket = tokio::net::TcpSocket::from_std_stream(socket);
        let address = std::net::SocketAddr::from((net::GUEST_IP, port));
        socket
            .connect(address)
            .await
            .io_context(|| format!("connecting to {address} in sandbox {id}"))
    }

    /// Network namespaces prepared and waiting for a create.
    pub fn net_pool_ready(&self) -> usize {
        self.net.ready_count()
    }

    /// CPU time and memory of a sandbox's QEMU process.
    pub fn usage(&self, id: &str) -> Result<Option<Usage>> {
        let vm = self.vm(id)?;
        Ok(vm
            .pid()
            .and_then(|pid| process_usage(&self.config.proc_root, pid)))
    }

    /// Its QEMU process as `/proc` shows it; None while it has none
    /// (hibernated).
    pub fn process_stat(&self, id: &str) -> Result<Option<ProcessStat>> {
        let vm = self.vm(id)?;
        Ok(vm
            .pid()
            .and_then(|pid| process_stat(&self.config.proc_root, pid)))
    }

    /// Moves every thread of a sandbox's QEMU process to `priority` (see
    /// [`priority`]). A sandbox without a process (hibernated) has none to
    /// move.
    pub fn set_cpu_priority(&self, id: &str, priority: CpuPriority) -> Result<()> {
        let vm = self.vm(id)?;
        let Some(pid) = vm.pid() else {
            return Ok(());
        };
        priority::apply(&self.config.proc_root, pid, priority)
            .io_context(|| format!("setting the CPU priority of sandbox {id}"))
    }

    /// The CPU priority of a sandbox's QEMU process, or None when it has
    /// no process.
    pub fn cpu_priority(&self, id: &str) -> Result<Option<CpuPriority>> {
        let vm = self.vm(id)?;
        let Some(pid) = vm.pid() else {
            return Ok(None);
        };
        priority::read(&self.config.proc_root, pid)
            .map(Some)
            .io_context(|| format!("reading the CPU priority of sandbox {id}"))
    }

    /// Deletes fork and hibernate captures no VM or snapshot still needs.
    /// Notes what this engine's hibernated VMs and captures use in the
    /// shared cache (bakes from before notes were kept had none), then
    /// removes old bakes and images nothing uses (see [`bake_gc`]).
    fn collect_old_bakes(&self) {
        let cache = &self.config.cache_dir;
        let state = self.config.absolute_state_dir();
        for vm in self.vms.lock().unwrap().values() {
            if let Ok(inner) = vm.inner.try_lock() {
                let user = state.join("vms").join(&vm.id);
                bake_gc::record_use(
                    cache,
                    &user,
                    inner.source.disk_layers.iter().map(PathBuf::as_path),
                );
            }
        }
        for entry in std::fs::read_dir(self.captures_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Ok(manifest) = Manifest::load(&entry.path()) {
                let user = state.join("captures").join(entry.file_name());
                bake_gc::record_use(
                    cache,
                    &user,
                    manifest.disk_layers.iter().map(PathBuf::as_path),
                );
            }
        }
        bake_gc::collect(cache, bake_gc::GRACE);
    }

    /// Notes that `user` (a VM or capture directory) uses `source`'s files.
    pub(crate) fn record_cache_use(&self, user: &Path, source: &Manifest) {
        let user = std::path::absolute(user).unwrap_or_else(|_| user.to_owned());
        let layers = source.disk_layers.iter().map(PathBuf::as_path);
        bake_gc::record_use(&self.config.cache_dir, &user, layers);
    }

    /// Removes what [`Engine::record_cache_use`] noted for `user`.
    fn forget_cache_use(&self, user: &Path, source: &Manifest) {
        let user = std::path::absolute(user).unwrap_or_else(|_| user.to_owned());
        let layers = source.disk_layers.iter().map(PathBuf::as_path);
        bake_gc::forget_use(&self.config.cache_dir, &user, layers);
    }

    async fn collect_captures(&self) {
        let _gc = self.gc_lock.lock().await;
        let mut needed: std::collections::HashSet<String> = std::collections::HashSet::new();
        let vms: Vec<Arc<Vm>> = self.vms.lock().unwrap().values().cloned().collect();
        for vm in vms {
            let inner = vm.inner.lock().await;
            needed.extend(inner.source.captures_needed());
        }
        needed.extend(self.pinned.lock().unwrap().keys().cloned());
        reap::collect_captures(&self.captures_dir(), &self.fork_memory_dir(), needed);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.net.close();
        if let Some(dir) = self.config.shared_fork_memory_dir() {
            reap::release_fork_memory_dir(&dir);
        }
    }
}

/// A capture of a sandbox with volumes would restore a guest with a file
/// system mounted on a placeholder, and fork children would be second
/// writers: refused.
fn refuse_capture_with_volumes(vm: &Vm) -> Result<()> {
    if vm.volumes.is_empty() {
        return Ok(());
    }
    Err(EngineError::HasVolumes(vm.id.clone()))
}

/// A sandbox whose QEMU died answers nothing but a delete.
fn failed(vm: &Vm) -> Result<()> {
    match vm.failure.lock().unwrap().clone() {
        Some(reason) if reason == vm::OUT_OF_MEMORY => Err(EngineError::OutOfMemory(vm.id.clone())),
        Some(reason) => Err(EngineError::Failed {
            id: vm.id.clone(),
            reason,
        }),
        None => Ok(()),
    }
}

fn running<'a>(vm: &Vm, inner: &'a VmInner) -> Result<&'a vm::Live> {
    failed(vm)?;
    match (&inner.live, inner.state) {
        (Some(live), VmState::Running) => Ok(live),
        _ => Err(EngineError::WrongState {
            id: vm.id.clone(),
            state: inner.state.as_str(),
            wanted: "running",
        }),
    }
}

/// Keeps a capture from garbage collection while it lives.
struct Pin<'a> {
    pinned: &'a Mutex<HashMap<String, usize>>,
    id: String,
}

impl<'a> Pin<'a> {
    fn new(pinned: &'a Mutex<HashMap<String, usize>>, id: &str) -> Self {
        *pinned.lock().unwrap().entry(id.to_string()).or_default() += 1;
        Pin {
            pinned,
            id: id.to_string(),
        }
    }
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        let mut pinned = self.pinned.lock().unwrap();
        if let Some(count) = pinned.get_mut(&self.id) {
            *count -= 1;
            if *count == 0 {
                pinned.remove(&self.id);
            }
        }
    }
}

/// Restores run at once during a fork: one per host core.
fn restore_parallelism() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

/// Sandbox ids: `sb-` and 12 hex digits.
pub fn new_sandbox_id() -> String {
    use rand::Rng;
    format!(
        "sb-{:012x}",
        rand::thread_rng().gen::<u64>() & 0xffff_ffff_ffff
    )
}

pub(crate) fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Takes an exclusive `flock` on `path`, waiting for it when `wait`.
fn lock_file(path: &Path, wait: bool) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .io_context(|| format!("opening {}", path.display()))?;
    let mode = if wait {
        libc::LOCK_EX
    } else {
        libc::LOCK_EX | libc::LOCK_NB
    };
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), mode) } != 0 {
        return Err(std::io::Error::last_os_error())
            .io_context(|| format!("locking {}", path.display()));
    }
    Ok(file)
}

/// User plus system CPU time of a process, from `/proc/PID/stat` alone
/// (cheap, unlike the memory figures of [`process_usage`]).
pub fn process_cpu_seconds(proc_root: &Path, pid: u32) -> Option<f64> {
    process_stat(proc_root, pid).map(|s| s.cpu_seconds)
}

/// A process as `/proc/<pid>/stat` shows it (what `GET .../metrics`
/// reports of a sandbox's QEMU).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessStat {
    pub pid: u32,
    /// User + system time.
    pub cpu_seconds: f64,
    pub vsize_bytes: u64,
    pub rss_bytes: u64,
    pub threads: u64,
    /// Since the process started.
    pub uptime_seconds: f64,
}

pub fn process_stat(proc_root: &Path, pid: u32) -> Option<ProcessStat> {
    let stat = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    // Fields after the command name, which may itself hold spaces; field
    // n of proc(5) is fields[n - 3].
    let after = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let number = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let booted_for: f64 = std::fs::read_to_string(proc_root.join("uptime"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(ProcessStat {
        pid,
        cpu_seconds: (number(14)? + number(15)?) as f64 / hz,
        threads: number(20)?,
        uptime_seconds: (booted_for - number(22)? as f64 / hz).max(0.0),
        vsize_bytes: number(23)?,
        rss_bytes: number(24)? * page,
    })
}

/// CPU seconds (user + system, from `stat`) and Pss/Rss (from
/// `smaps_rollup`, which walks the process's page tables: milliseconds for
/// a QEMU process) of a process.
pub fn process_usage(proc_root: &Path, pid: u32) -> Option<Usage> {
    let dir = proc_root.join(pid.to_string());
    let cpu_seconds = process_cpu_seconds(proc_root, pid)?;
    let rollup = std::fs::read_to_string(dir.join("smaps_rollup")).ok()?;
    let field = |name: &str| -> u64 {
        rollup
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    Some(Usage {
        cpu_seconds,
        pss_bytes: field("Pss:"),
        rss_bytes: field("Rss:"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked() {
        assert!(valid_id(&new_sandbox_id()));
        assert!(!valid_id("../etc"));
        assert!(!valid_id(""));
        assert!(!valid_id("UPPER"));
    }

    #[test]
    fn stat_reads_this_process() {
        let stat = process_stat(Path::new("/proc"), std::process::id()).unwrap();
        assert_eq!(stat.pid, std::process::id());
        assert!(stat.threads >= 1 && stat.rss_bytes > 0 && stat.vsize_bytes >= stat.rss_bytes);
        assert!(stat.uptime_seconds >= 0.0 && stat.uptime_seconds < 86_400.0 * 365.0);
    }

    #[test]
    fn usage_reads_this_process() {
        let usage = process_usage(Path::new("/proc"), std::process::id()).unwrap();
        assert!(usage.pss_bytes > 0 && usage.rss_bytes >= usage.pss_bytes / 2);
    }
}
