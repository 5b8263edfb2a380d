//! Snapshots from a disk: cold-boot a root filesystem (a raw ext4 image a
//! caller made, or the disk chain of an existing capture) with this host's
//! guest kernel, at a size the caller picks, and save the booted state as a
//! user snapshot, restorable like any other.
//!
//! This is how a template comes from a root filesystem tarball or an OCI
//! image (whatever its distribution: the guest agent is static), and how a
//! template gets a VM of another size than the one it was captured at (a
//! snapshot fixes vCPUs and memory, so another size is another boot).
//!
//! Owns: the boot and the capture directory it writes. Does not own: making
//! the image (`shoal_image`), naming the snapshot (the control plane).

use crate::bake::cold_boot;
use crate::error::{EngineError, IoContext, Result};
use crate::manifest::{now_unix_ms, Kind, Manifest};
use crate::vm::with_qemu_log;
use crate::Engine;
use std::path::PathBuf;
use std::time::Duration;

/// How long a disk's boot may take before it counts as hung: a TCG cold
/// boot now and then never reaches the agent (about one in ten boots of
/// several vCPUs on two cores), and the callers boot it once more
/// (`shoal_host::imports`); five times a healthy boot under load, so the
/// second try still fits a client's five minutes.
const DISK_BOOT_DEADLINE: Duration = Duration::from_secs(150);

/// How long the guest agent may take to finish its own start-up work before
/// the save (a fresh root filesystem has nothing cached).
const SETTLE_DEADLINE: Duration = Duration::from_secs(10);

/// The id prefix of a snapshot that is another snapshot's or a template's
/// disk booted at another size: deleted with the snapshot it came from.
pub const SIZED_PREFIX: &str = "size-";

/// The disk a [`Engine::boot_snapshot`] boots.
#[derive(Debug, Clone)]
pub enum BootDisk {
    /// A raw ext4 image with the guest agent installed; it is moved into
    /// the snapshot, which owns it from then on.
    Image(PathBuf),
    /// The disk of user snapshot `id` as it was captured (its layers stay
    /// read-only; the new snapshot depends on it).
    SnapshotDisk(String),
    /// The disk of first-party template `name`'s current bake.
    TemplateDisk(String),
}

/// What to boot and at what size.
#[derive(Debug, Clone)]
pub struct DiskBootSpec {
    pub disk: BootDisk,
    pub vcpus: u32,
    pub memory_mib: u32,
    /// The first-party template the snapshot counts as derived from (for
    /// listings and sizing defaults).
    pub template: String,
    /// The snapshot's id; `None`: a new `snap-` one.
    pub id: Option<String>,
    /// What the guest runs before it is saved (a template's start command
    /// and readiness check), so that restores have it running.
    pub warm_up: Option<crate::warm_up::WarmUp>,
}

impl Engine {
    /// Boots `spec.disk` and saves the running guest as a new user snapshot;
    /// returns its manifest. On failure nothing is left.
    pub async fn boot_snapshot(&self, spec: DiskBootSpec) -> Result<Manifest> {
        if spec.vcpus == 0 || spec.memory_mib < 128 {
            return Err(EngineError::InvalidInput(format!(
                "a VM needs at least 1 vCPU and 128 MiB (asked for {} and {} MiB)",
                spec.vcpus, spec.memory_mib
            )));
        }
        let artifacts = shoal_image::current_artifacts(&self.config.cache_dir, "base")
            .ok_or_else(|| EngineError::UnknownTemplate("base".into()))?;
        let id = match &spec.id {
            Some(id) if crate::valid_id(id) => id.clone(),
            Some(id) => return Err(EngineError::InvalidInput(format!("bad snapshot id {id:?}"))),
            None => format!("snap-{}", &crate::new_sandbox_id()[3..]),
        };
        if self.captures_dir().join(&id).exists() {
            return Err(EngineError::InvalidInput(format!("snapshot {id} exists")));
        }
        let final_dir = self.captures_dir().join(&id);
        let dir = self.captures_dir().join(format!("{id}.tmp"));
        std::fs::create_dir_all(&dir).io_context(|| format!("creating {}", dir.display()))?;
        let result = self
            .boot_snapshot_into(&spec, &artifacts, &id, &dir, &final_dir)
            .await;
        match result {
            Ok(manifest) => {
                std::fs::rename(&dir, &final_dir)
                    .io_context(|| format!("renaming {}", dir.display()))?;
                self.record_cache_use(&final_dir, &manifest);
                Ok(manifest)
            }
            Err(e) => {
                let e = with_qemu_log(e, &dir);
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    async fn boot_snapshot_into(
        &self,
        spec: &DiskBootSpec,
        artifacts: &shoal_image::Artifacts,
        id: &str,
        dir: &std::path::Path,
        final_dir: &std::path::Path,
    ) -> Result<Manifest> {
        // Paths while booting (in `dir`) and as the manifest records them
        // (in `final_dir`, where `dir` is renamed to once whole).
        let (boot_layers, kept_layers, depends_on) = match &spec.disk {
            BootDisk::Image(image) => {
                let own = dir.join("rootfs.ext4");
                std::fs::rename(image, &own)
                    .io_context(|| format!("moving {} into the snapshot", image.display()))?;
                (vec![own], vec![final_dir.join("rootfs.ext4")], Vec::new())
            }
            BootDisk::SnapshotDisk(snapshot) => {
                let source = self.snapshot_manifest(snapshot)?;
                let mut needed = source.captures_needed();
                needed.sort();
                needed.dedup();
                (source.disk_layers.clone(), source.disk_layers, needed)
            }
            BootDisk::TemplateDisk(name) => {
                let source = self.template(name)?;
                (source.disk_layers.clone(), source.disk_layers, Vec::new())
            }
        };
        let mut manifest = Manifest {
            id: id.to_string(),
            kind: Kind::Snapshot,
            template: spec.template.clone(),
            vcpus: spec.vcpus,
            memory_mib: spec.memory_mib,
            memory_file: final_dir.join("memory"),
            devices_file: final_dir.join("devices"),
            disk_layers: kept_layers,
            depends_on,
            qemu_version: self.qemu_version.clone(),
            accel: self.accel,
            kernel_version: artifacts.kernel_version.clone(),
            input_hash: String::new(),
            memory_sha256: None,
            created_unix_ms: now_unix_ms(),
        };
        let launch = self.cold_boot_launch(
            dir,
            boot_layers,
            spec.vcpus,
            spec.memory_mib,
            artifacts,
            &self.kernel_cmdline(),
        )?;
        let booted = cold_boot(
            &launch,
            self.net.take().await?,
            &self.jail,
            DISK_BOOT_DEADLINE,
        )
        .await?;
        tracing::info!(
            snapshot = id,
            boot_ms = booted.boot_ms,
            "booted a disk for a snapshot"
        );
        // A fresh root filesystem has nothing cached: let the agent finish
        // its own start-up work here rather than in every restore.
        if tokio::time::timeout(SETTLE_DEADLINE, booted.agent.settle())
            .await
            .is_err()
        {
            tracing::debug!(snapshot = id, "agent did not settle in time");
        }
        if let Some(warm_up) = &spec.warm_up {
            if let Err(why) = warm_up.run(&booted.agent).await {
                booted.kill().await;
                return Err(EngineError::InvalidInput(format!(
                    "the template's start command: {why}"
                )));
            }
        }
        booted.save(dir).await?;
        manifest.disk_layers.push(final_dir.join("disk.qcow2"));
        manifest.created_unix_ms = now_unix_ms();
        manifest.store(dir)?;
        Ok(manifest)
    }
}
