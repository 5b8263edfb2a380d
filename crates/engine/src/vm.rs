//! One running (or hibernated) VM: its QEMU process, QMP session, guest
//! agent connection and directory, and the restore that brings it up.
//!
//! A VM is only ever created by restoring a [`Manifest`]; cold boots happen
//! only while baking a template (`bake.rs`). Restore returns once the guest
//! agent has answered with the VM's new identity.

use crate::accel::Accel;
use crate::error::{EngineError, IoContext, Result};
use crate::jail::{Jail, VmJail};
use crate::manifest::{write_json_atomically, Manifest};
use crate::net::NetSlot;
use crate::qemu::{self, Boot, LaunchSpec};
use crate::volume::VolumeAttachment;
use serde::{Deserialize, Serialize};
use shoal_proto::client::AgentClient;
use shoal_qmp::Qmp;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const VM_FILE: &str = "vm.json";

/// How long a restored guest may take to answer its agent.
const RESTORE_DEADLINE: Duration = Duration::from_secs(20);
/// An agent that answered its connection answers its identity at once; a
/// patched one that does not costs only its own create.
const IDENTITY_DEADLINE: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    Running,
    Paused,
    Hibernated,
}

impl VmState {
    pub fn as_str(self) -> &'static str {
        match self {
            VmState::Running => "running",
            VmState::Paused => "paused",
            VmState::Hibernated => "hibernated",
        }
    }
}

/// What is written to `vm.json`, so a restarted engine can find the process
/// a crashed run left behind, or wake a hibernated VM.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmRecord {
    pub id: String,
    pub pid: Option<u32>,
    pub state: VmState,
    pub source: Manifest,
    pub created_unix_ms: u64,
    /// Whether the guest may open connections to the internet.
    #[serde(default = "yes")]
    pub allow_internet: bool,
    /// The volumes behind its slots, in slot order (a wake puts them back).
    #[serde(default)]
    pub volumes: Vec<VolumeAttachment>,
    /// The network slot its QEMU runs in, while it has one: what a restart
    /// after a crash needs to adopt the process (a record without it, from
    /// an older engine, is reaped instead).
    #[serde(default)]
    pub net_slot: Option<u32>,
}

fn yes() -> bool {
    true
}

/// A VM's QEMU process, as this engine holds it.
pub(crate) enum QemuProcess {
    /// Spawned by this engine, which reaps it.
    Child(tokio::process::Child),
    /// Left running by an engine that died and adopted by this one: not
    /// our child (its parent is now init), so it is held by a pidfd, which
    /// names this process and never a reused pid.
    Adopted(tokio::io::unix::AsyncFd<OwnedFd>),
}

/// How long a kill waits for an adopted QEMU, which it cannot reap, to end.
const ADOPTED_EXIT_PATIENCE: Duration = Duration::from_secs(10);

impl QemuProcess {
    /// Kills the process (a spawned one by its process group) and waits
    /// until it has ended.
    async fn kill_and_wait(&mut self, pid: u32) {
        match self {
            QemuProcess::Child(child) => {
                kill_process_group(pid);
                let _ = child.wait().await;
            }
            QemuProcess::Adopted(pidfd) => {
                // QEMU may spawn nothing (its seccomp filter), so the
                // process is the whole group.
                send_signal(pidfd.get_ref(), libc::SIGKILL);
                let _ = tokio::time::timeout(ADOPTED_EXIT_PATIENCE, pidfd.readable()).await;
            }
        }
    }
}

/// A pidfd of process `pid`, registered to be awaited: it turns readable
/// when the process ends.
fn pidfd_open(pid: u32) -> Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    // SAFETY: pidfd_open(2) takes no pointers; the result is checked.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error())
            .io_context(|| format!("pidfd_open of QEMU {pid}"));
    }
    // SAFETY: a descriptor the kernel just gave us, owned from here on.
    let pidfd = unsafe { OwnedFd::from_raw_fd(raw as RawFd) };
    // SAFETY: the OwnedFd stays open, and the same descriptor, for as long
    // as the AsyncFd that owns it.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
    }
    .map_err(|e| std::io::Error::other(e.to_string()))
    .io_context(|| "registering a pidfd".into())
}

fn send_signal(pidfd: &OwnedFd, signal: libc::c_int) {
    // SAFETY: pidfd_send_signal(2) on a pidfd we hold, no siginfo.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        );
    }
}

pub(crate) struct Live {
    pub process: QemuProcess,
    pub pid: u32,
    pub qmp: Qmp,
    pub agent: AgentClient,
    /// The network namespace QEMU runs in; released with the process.
    pub net: NetSlot,
    /// Its uid and cgroup; the cgroup goes when this is dropped, after the
    /// process is reaped.
    pub jail: VmJail,
    /// Set before the engine itself stops the process, so the exit watcher
    /// (see [`watch_exit`]) tells that from a death.
    pub stopping: Arc<AtomicBool>,
}

impl Live {
    /// Kills QEMU's process group and reaps it; the cgroup goes with `self`.
    pub(crate) async fn terminate(mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.process.kill_and_wait(self.pid).await;
    }
}

/// Why a VM's QEMU ended without the engine asking: the kernel killed it
/// for exceeding its cgroup's memory, or it died some other way.
pub const OUT_OF_MEMORY: &str = "out of memory";

/// Waits (on a pidfd, without reaping) for QEMU `pid` to end; if the engine
/// did not stop it, calls `died` with the reason (out of memory when the
/// VM's cgroup counted a kill). Meanwhile reads the group's memory pressure
/// once a second and kills a QEMU that thrashes at its limit
/// ([`crate::cgroup::ThrashWatch`]), which the kernel would not, and keeps
/// its console log under [`qemu::CONSOLE_LOG_CAP`].
pub(crate) fn watch_exit(
    pid: u32,
    stopping: Arc<AtomicBool>,
    oom: crate::cgroup::OomCounter,
    console: PathBuf,
    died: impl FnOnce(String) + Send + 'static,
) -> Result<()> {
    // Our own child is not reaped before `stopping` is set, and an adopted
    // QEMU is checked to be in its VM's cgroup after this is opened, so the
    // pid names the VM's QEMU.
    let pidfd = pidfd_open(pid)?;
    tokio::spawn(async move {
        let mut thrash = crate::cgroup::ThrashWatch::default();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = pidfd.readable() => break,
                _ = tick.tick() => {
                    if let Err(e) = qemu::cap_console_log(&console) {
                        tracing::debug!(pid, error = %e, "capping the console log");
                    }
                    let Some(reading) = oom.pressure() else { continue };
                    if thrash.observe(reading) && !stopping.load(Ordering::SeqCst) {
                        tracing::warn!(pid, ?reading, "QEMU thrashes at its memory limit: killed");
                        oom.count_thrash_kill();
                        // The pidfd names this QEMU, never a reused pid.
                        send_signal(pidfd.get_ref(), libc::SIGKILL);
                    }
                }
            }
        }
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        let reason = if oom.kills() > 0 {
            OUT_OF_MEMORY.to_string()
        } else {
            "its QEMU process ended unexpectedly".to_string()
        };
        died(reason);
    });
    Ok(())
}

pub struct Vm {
    pub id: String,
    /// Why its QEMU died, once it has (see [`watch_exit`]).
    pub(crate) failure: Mutex<Option<String>>,
    pub dir: PathBuf,
    pub(crate) inner: tokio::sync::Mutex<VmInner>,
    /// Mirrors what `inner` says of it for lock-free reads: listing,
    /// admission, heartbeats and metering never wait behind a call into
    /// this VM's guest (which may hold `inner` up to its deadline).
    pub(crate) now: Mutex<VmNow>,
    pub created_unix_ms: u64,
    pub restore_ms: Mutex<f64>,
    pub allow_internet: bool,
    pub volumes: Vec<VolumeAttachment>,
}

pub(crate) struct VmInner {
    pub state: VmState,
    pub source: Manifest,
    pub live: Option<Live>,
}

/// [`Vm::now`]: what a listing shows of a VM.
#[derive(Debug, Clone)]
pub(crate) struct VmNow {
    pub state: VmState,
    pub pid: Option<u32>,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub host_veth: Option<String>,
}

impl VmNow {
    pub(crate) fn new(state: VmState, source: &Manifest) -> Mutex<VmNow> {
        Mutex::new(VmNow {
            state,
            pid: None,
            template: source.template.clone(),
            vcpus: source.vcpus,
            memory_mib: source.memory_mib,
            host_veth: None,
        })
    }
}

impl Vm {
    /// A VM as `record` describes it, in `state`, with no process yet.
    pub(crate) fn from_record(record: VmRecord, dir: PathBuf, state: VmState) -> Vm {
        Vm {
            now: VmNow::new(state, &record.source),
            id: record.id,
            dir,
            inner: tokio::sync::Mutex::new(VmInner {
                state,
                source: record.source,
                live: None,
            }),
            failure: Mutex::new(None),
            created_unix_ms: record.created_unix_ms,
            restore_ms: Mutex::new(0.0),
            allow_internet: record.allow_internet,
            volumes: record.volumes,
        }
    }

    pub fn state(&self) -> VmState {
        self.now.lock().unwrap().state
    }

    pub fn pid(&self) -> Option<u32> {
        self.now.lock().unwrap().pid
    }

    /// Sets the state and refreshes [`Vm::now`] from `inner`.
    pub(crate) fn set_state(&self, inner: &mut VmInner, state: VmState) {
        inner.state = state;
        *self.now.lock().unwrap() = VmNow {
            state,
            pid: inner.live.as_ref().map(|l| l.pid),
            template: inner.source.template.clone(),
            vcpus: inner.source.vcpus,
            memory_mib: inner.source.memory_mib,
            host_veth: inner.live.as_ref().map(|l| l.net.host_veth()),
        };
    }

    pub(crate) fn record(&self, inner: &VmInner) -> VmRecord {
        VmRecord {
            id: self.id.clone(),
            pid: inner.live.as_ref().map(|l| l.pid),
            state: inner.state,
            source: inner.source.clone(),
            created_unix_ms: self.created_unix_ms,
            allow_internet: self.allow_internet,
            volumes: self.volumes.clone(),
            net_slot: inner.live.as_ref().map(|l| l.net.index),
        }
    }

    pub(crate) fn store_record(&self, inner: &VmInner) -> Result<()> {
        write_json_atomically(&self.dir.join(VM_FILE), &self.record(inner))
    }
}

/// Everything `restore` needs from the engine.
pub(crate) struct RestoreContext<'a> {
    pub qemu: &'a Path,
    pub accel: Accel,
    pub empty_overlay: &'a Path,
    /// Behind the volume slots nothing is attached to.
    pub volume_placeholder: &'a Path,
    pub jail: &'a Jail,
}

/// Starts QEMU on `source`, loads its device state, and gives the guest its
/// identity. On failure the process is killed and nothing of it is left in
/// `dir` but what the caller removes.
pub(crate) async fn restore(
    ctx: &RestoreContext<'_>,
    id: &str,
    dir: &Path,
    source: &Manifest,
    net: NetSlot,
    allow_internet: bool,
    volumes: &[VolumeAttachment],
) -> Result<Live> {
    if allow_internet {
        net.allow_internet()?;
    }
    let disk_top = dir.join("disk.qcow2");
    std::fs::copy(ctx.empty_overlay, &disk_top)
        .io_context(|| format!("creating {}", disk_top.display()))?;
    let jail = ctx
        .jail
        .for_vm(net.index, source.vcpus, source.memory_mib)?;
    let spec = LaunchSpec {
        qemu: ctx.qemu.to_path_buf(),
        accel: ctx.accel,
        vcpus: source.vcpus,
        memory_mib: source.memory_mib,
        memory_file: source.memory_file.clone(),
        memory_shared: false,
        disk_layers: source.disk_layers.clone(),
        disk_top,
        dir: dir.to_path_buf(),
        boot: Boot::Restore,
        net_namespace: net.ns_fd(),
        volume_slots: crate::volume::slots(volumes, ctx.volume_placeholder),
        confinement: qemu::Confinement::of(&jail),
    };
    let devices = std::fs::File::open(&source.devices_file)
        .io_context(|| format!("opening {}", source.devices_file.display()))?;
    let started = Instant::now();
    let mut child = spec.spawn(Some(devices.into()))?;
    let pid = child.id().unwrap_or(0);
    tracing::debug!(
        id,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "qemu spawned"
    );
    match connect_restored(dir, id, pid, &mut child).await {
        Ok((qmp, agent)) => Ok(Live {
            process: QemuProcess::Child(child),
            pid,
            qmp,
            agent,
            net,
            jail,
            stopping: Arc::new(AtomicBool::new(false)),
        }),
        Err(e) => {
            kill_process_group(pid);
            let _ = child.wait().await;
            if jail.cgroup.oom_kills() > 0 {
                return Err(EngineError::OutOfMemory(id.to_string()));
            }
            Err(with_qemu_log(e, dir))
        }
    }
}

/// How long an adopted QEMU's QMP monitor and guest agent may take to
/// answer a new connection.
const ADOPT_DEADLINE: Duration = Duration::from_secs(10);

/// Takes over QEMU `pid` of sandbox `id`, which an engine that died left
/// running in `dir`, `net` and `jail`: holds it by a pidfd, connects to its QMP monitor
/// and its guest agent anew (QEMU listens again once the dead engine's
/// connections closed) and returns it with the state QEMU reports. The
/// agent answers a new host as it does after a restore: what the dead
/// engine's calls still had in flight is discarded by the handshake.
pub(crate) async fn adopt(
    id: &str,
    pid: u32,
    dir: &Path,
    net: NetSlot,
    jail: VmJail,
) -> Result<(Live, VmState)> {
    let pidfd = pidfd_open(pid)?;
    // After the pidfd is open, so the pid cannot be a reused one: the
    // process is the VM's QEMU if its cgroup still holds it.
    if !jail.cgroup.members().contains(&pid) {
        return Err(EngineError::Qemu {
            message: format!("QEMU {pid} of sandbox {id} left its cgroup"),
        });
    }
    let mut process = QemuProcess::Adopted(pidfd);
    match connect_adopted(dir, id).await {
        Ok((qmp, agent, state)) => Ok((
            Live {
                process,
                pid,
                qmp,
                agent,
                net,
                jail,
                stopping: Arc::new(AtomicBool::new(false)),
            },
            state,
        )),
        Err(e) => {
            process.kill_and_wait(pid).await;
            Err(e)
        }
    }
}

async fn connect_adopted(dir: &Path, id: &str) -> Result<(Qmp, AgentClient, VmState)> {
    let qmp = Qmp::connect_with_deadline(&qemu::qmp_socket(dir), ADOPT_DEADLINE).await?;
    let status = tokio::time::timeout(ADOPT_DEADLINE, qmp.query_status())
        .await
        .map_err(|_| EngineError::Timeout(format!("asking QEMU of {id} its state")))??;
    // Any other state (a crash mid-hibernation or mid-fork left it
    // migrated out, say) is not one a sandbox can go on from.
    let paused = match (status.running, status.status.as_str()) {
        (true, _) => false,
        (false, "paused") => true,
        (false, other) => {
            return Err(EngineError::Qemu {
                message: format!("QEMU of {id} is {other}, not running or paused"),
            })
        }
    };
    let stream = connect_unix(&qemu::agent_socket(dir), ADOPT_DEADLINE).await?;
    // A paused guest cannot answer: it runs for the handshake only.
    if paused {
        qmp.cont().await?;
    }
    let agent = tokio::time::timeout(
        ADOPT_DEADLINE,
        AgentClient::connect_with_deadline(stream, ADOPT_DEADLINE),
    )
    .await
    .map_err(|_| EngineError::Timeout(format!("waiting for the guest agent of {id}")));
    if paused {
        qmp.stop().await?;
    }
    let agent = agent??;
    let state = if paused {
        VmState::Paused
    } else {
        VmState::Running
    };
    Ok((qmp, agent, state))
}

async fn connect_restored(
    dir: &Path,
    id: &str,
    pid: u32,
    child: &mut tokio::process::Child,
) -> Result<(Qmp, AgentClient)> {
    let qmp_path = qemu::qmp_socket(dir);
    let qmp = tokio::select! {
        qmp = Qmp::connect_with_deadline(&qmp_path, Duration::from_secs(10)) => qmp?,
        status = child.wait() => return Err(exited(status)),
    };
    // The agent's socket must be connected before the device state loads, so
    // the guest sees the same "host connected" state it was saved with.
    let started = Instant::now();
    tracing::debug!(id, "qmp connected");
    if tracing::enabled!(tracing::Level::DEBUG) {
        let mut events = qmp.events();
        let id = id.to_string();
        tokio::spawn(async move {
            while let Ok(event) = events.recv().await {
                tracing::debug!(
                    id,
                    ms = started.elapsed().as_secs_f64() * 1e3,
                    event = event.event,
                    "qmp event"
                );
            }
        });
    }
    let stream = connect_unix(&qemu::agent_socket(dir), Duration::from_secs(5)).await?;
    qmp.migrate_incoming(&format!("fd:{}", qemu::INCOMING_FD))
        .await?;
    tracing::debug!(
        id,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "migrate-incoming sent"
    );
    let agent = tokio::select! {
        agent = tokio::time::timeout(RESTORE_DEADLINE, AgentClient::connect_with_deadline(stream, RESTORE_DEADLINE)) => match agent {
            Ok(agent) => agent?,
            Err(_) => return Err(EngineError::Timeout("waiting for the guest agent after restore".into())),
        },
        status = child.wait() => return Err(exited(status)),
    };
    tracing::debug!(
        id,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "agent answered"
    );
    tokio::time::timeout(IDENTITY_DEADLINE, give_identity(&agent, id))
        .await
        .map_err(|_| EngineError::Timeout("giving the guest its identity".into()))??;
    // QEMU's CPU time against the wall time tells a start slowed by waiting
    // for a core from one that had more to do.
    tracing::debug!(
        id,
        ms = started.elapsed().as_secs_f64() * 1e3,
        qemu_cpu_ms = crate::process_cpu_seconds(Path::new("/proc"), pid).map(|s| s * 1e3),
        "identity given"
    );
    Ok((qmp, agent))
}

/// Hostname, wall clock and fresh entropy: what clones of one snapshot must
/// never share.
pub(crate) async fn give_identity(agent: &AgentClient, id: &str) -> Result<()> {
    let mut entropy = [0u8; 64];
    getrandom(&mut entropy);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    agent.identity(id, now, &entropy).await?;
    Ok(())
}

fn getrandom(buffer: &mut [u8]) {
    use rand::RngCore;
    rand::rngs::OsRng.fill_bytes(buffer);
}

pub(crate) async fn connect_unix(
    path: &Path,
    deadline: Duration,
) -> Result<tokio::net::UnixStream> {
    let start = Instant::now();
    loop {
        match tokio::net::UnixStream::connect(path).await {
            Ok(stream) => return Ok(stream),
            Err(e) if start.elapsed() > deadline => {
                return Err(e).io_context(|| format!("connecting to {}", path.display()))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
}

fn exited(status: std::io::Result<std::process::ExitStatus>) -> EngineError {
    EngineError::Qemu {
        message: match status {
            Ok(s) => format!("QEMU exited early ({s})"),
            Err(e) => format!("QEMU exited early ({e})"),
        },
    }
}

/// Adds the tail of QEMU's own log to a failure, where QEMU says why.
pub(crate) fn with_qemu_log(error: EngineError, dir: &Path) -> EngineError {
    let log = std::fs::read_to_string(qemu::qemu_log(dir)).unwrap_or_default();
    let tail: Vec<&str> = log.lines().rev().take(5).collect();
    if tail.is_empty() {
        return error;
    }
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    EngineError::Qemu {
        message: format!(
            "{}; QEMU said: {}",
            crate::error::chain(&error),
            tail.join(" | ")
        ),
    }
}

/// Kills QEMU's whole process group (it is its own group leader).
pub(crate) fn kill_process_group(pid: u32) {
    if pid > 1 {
        // SAFETY: kill(2) with a negative pid signals that process group only.
        unsafe {
            libc::kill(-(pid as i32), libc::SIGKILL);
        }
    }
}
