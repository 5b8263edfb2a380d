//! Capturing a running VM's whole state (memory, devices, disk) into a
//! restorable [`Manifest`]: the one mechanism behind fork, snapshot and
//! hibernate.
//!
//! Order matters: the source memory file is copied while the VM still runs
//! (that file never changes), then the VM is paused, only the pages it
//! changed are written over the copy, its device state is saved
//! (`xen-save-devices-state`, no RAM) and its disk layer copied, all at one
//! instant, so memory and disk agree. The pause is as long as the VM's own
//! writes take to copy.

use crate::error::{EngineError, IoContext, Result};
use crate::manifest::{now_unix_ms, Kind, Manifest};
use crate::memory;
use crate::vm::{Vm, VmInner, VmState};
use crate::Engine;

/// How long a capture waits for the guest agent to settle (it gives up on
/// its own after two seconds).
const SETTLE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(3);

pub(crate) async fn capture(
    engine: &Engine,
    vm: &Vm,
    inner: &mut VmInner,
    kind: Kind,
    keep_running: bool,
) -> Result<Manifest> {
    let id = format!("{}-{}", kind_prefix(kind), &crate::new_sandbox_id()[3..]);
    let final_dir = engine.captures_dir().join(&id);
    let dir = engine.captures_dir().join(format!("{id}.tmp"));
    std::fs::create_dir_all(&dir).io_context(|| format!("creating {}", dir.display()))?;
    let result = capture_into(engine, vm, inner, kind, keep_running, &id, &dir, &final_dir).await;
    match result {
        Ok(manifest) => {
            std::fs::rename(&dir, &final_dir)
                .io_context(|| format!("renaming {}", dir.display()))?;
            engine.record_cache_use(&final_dir, &manifest);
            Ok(manifest)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            let _ = std::fs::remove_file(engine.fork_memory_dir().join(format!("{id}.memory")));
            Err(e)
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn capture_into(
    engine: &Engine,
    vm: &Vm,
    inner: &mut VmInner,
    kind: Kind,
    keep_running: bool,
    id: &str,
    dir: &std::path::Path,
    final_dir: &std::path::Path,
) -> Result<Manifest> {
    let live = inner.live.as_ref().ok_or_else(|| EngineError::WrongState {
        id: vm.id.clone(),
        state: inner.state.as_str(),
        wanted: "running",
    })?;
    let source = inner.source.clone();
    // Fork points are short-lived and on the fork's critical path: their
    // memory goes to the RAM-backed directory (see `EngineConfig`).
    let memory_copy = match kind {
        Kind::Fork => engine.fork_memory_dir().join(format!("{id}.memory")),
        _ => dir.join("memory"),
    };
    let src = source.memory_file.clone();
    let dst = memory_copy.clone();
    let copy = tokio::task::spawn_blocking(move || memory::copy_sparse(&src, &dst));
    let was_running = inner.state == VmState::Running;
    // Meanwhile the guest agent finishes its own background work (a warm
    // shell still starting after the last exec): every clone would
    // otherwise finish it again, with a cold translation cache under TCG.
    let settle = async {
        if was_running {
            match tokio::time::timeout(SETTLE_DEADLINE, live.agent.settle()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(id = %vm.id, error = %e, "agent did not settle"),
                Err(_) => tracing::debug!(id = %vm.id, "agent did not settle in time"),
            }
            // A snapshot's disk may later be booted on its own (a smaller
            // VM of the template it names, `disk_boot.rs`), without the
            // memory that holds the guest's unwritten files: write them.
            if kind == Kind::Snapshot {
                match tokio::time::timeout(SETTLE_DEADLINE, live.agent.sync()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::debug!(id = %vm.id, error = %e, "guest sync failed"),
                    Err(_) => tracing::debug!(id = %vm.id, "guest sync did not end in time"),
                }
            }
        }
    };
    let (copied, ()) = tokio::join!(copy, settle);
    copied.expect("copy task does not panic")?;

    live.qmp.stop().await?;
    let paused = async {
        let proc_root = engine.config.proc_root.clone();
        let pid = live.pid;
        let src = source.memory_file.clone();
        let dst = memory_copy.clone();
        tokio::task::spawn_blocking(move || -> Result<u64> {
            let mappings = memory::find_mappings(&proc_root, pid, &src)?;
            if mappings.is_empty() {
                return Err(EngineError::Qemu {
                    message: format!("guest memory {} is not mapped by QEMU", src.display()),
                });
            }
            let runs = memory::changed_runs(&proc_root, pid, &mappings)?;
            memory::write_changed_pages(&proc_root, pid, &runs, &dst)
        })
        .await
        .expect("page copy task does not panic")?;
        crate::qemu::save_device_state(&live.qmp, &dir.join("devices")).await?;
        // QEMU flushed the disk when it stopped, so the layer file is whole.
        memory::copy_sparse(&vm.dir.join("disk.qcow2"), &dir.join("disk.qcow2"))?;
        Ok::<(), EngineError>(())
    }
    .await;
    if keep_running && was_running {
        live.qmp.cont().await?;
    }
    paused?;

    let mut disk_layers = source.disk_layers.clone();
    disk_layers.push(final_dir.join("disk.qcow2"));
    let mut depends_on = source.captures_needed();
    depends_on.sort();
    depends_on.dedup();
    let manifest = Manifest {
        id: id.to_string(),
        kind,
        template: source.template.clone(),
        vcpus: source.vcpus,
        memory_mib: source.memory_mib,
        memory_file: if memory_copy.starts_with(dir) {
            final_dir.join("memory")
        } else {
            memory_copy.clone()
        },
        devices_file: final_dir.join("devices"),
        disk_layers,
        depends_on,
        qemu_version: source.qemu_version.clone(),
        accel: source.accel,
        kernel_version: source.kernel_version.clone(),
        input_hash: source.input_hash.clone(),
        memory_sha256: None,
        created_unix_ms: now_unix_ms(),
    };
    manifest.store(dir)?;
    Ok(manifest)
}

fn kind_prefix(kind: Kind) -> &'static str {
    match kind {
        Kind::Template => "tpl",
        Kind::Fork => "fork",
        Kind::Snapshot => "snap",
        Kind::Hibernate => "hib",
    }
}
