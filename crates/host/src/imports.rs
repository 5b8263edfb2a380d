//! Snapshots this host makes by booting a disk rather than capturing a
//! sandbox: a root filesystem tarball or OCI image archive made into an
//! image (`shoal_image::import`) and booted, or an existing snapshot's or
//! template's disk booted at another size (a snapshot fixes vCPUs and
//! memory, so another size is another boot).
//!
//! The boot is a VM like any other: it takes a capacity slot of its size
//! for as long as it runs, and nothing starts while the state disk is
//! short of room for the image.

use crate::{HostAgent, HostError, Result};
use shoal_engine::{BootDisk, DiskBootSpec, Manifest};
use shoal_image::import::ImportReport;
use std::path::PathBuf;

/// What an imported root filesystem comes from.
#[derive(Debug, Clone)]
pub enum ImportSource {
    /// A root filesystem tarball (plain or gzip).
    RootfsTar(PathBuf),
    /// An OCI image layout or `docker save` output, a tar or a directory.
    OciArchive(PathBuf),
}

/// An import: the source, the disk it gets, and the VM size it is booted
/// (and so restored) at.
#[derive(Debug, Clone)]
pub struct ImportSpec {
    pub source: ImportSource,
    pub disk_mib: u32,
    pub vcpus: u32,
    pub memory_mib: u32,
}

impl HostAgent {
    /// Makes an image of `spec.source` with the guest agent installed, boots
    /// it and saves it as a user snapshot. A source that is not usable is
    /// [`HostError::Import`] (the caller's input); nothing is left behind
    /// on any failure.
    pub async fn import_snapshot(&self, spec: ImportSpec) -> Result<(Manifest, ImportReport)> {
        let agent = self.guest_agent.clone().ok_or_else(|| {
            HostError::Invalid(
                "this host has no guest agent to install into imported images".into(),
            )
        })?;
        self.capacity.check_disk()?;
        self.check_volume_headroom(u64::from(spec.disk_mib))?;
        let work = self
            .engine
            .state_dir()
            .join("imports")
            .join(&shoal_engine::new_sandbox_id()[3..]);
        std::fs::create_dir_all(&work)
            .map_err(|e| HostError::Import(format!("creating {}: {e}", work.display())))?;
        let result = async {
            let image = work.join("rootfs.ext4");
            let (task_work, task_image, disk_mib) = (work.clone(), image.clone(), spec.disk_mib);
            let source = spec.source.clone();
            let report = tokio::task::spawn_blocking(move || match source {
                ImportSource::RootfsTar(tar) => shoal_image::import::image_from_rootfs_tar(
                    &tar,
                    &agent,
                    &task_image,
                    disk_mib,
                    &task_work,
                ),
                ImportSource::OciArchive(archive) => shoal_image::import::image_from_oci_archive(
                    &archive,
                    &agent,
                    &task_image,
                    disk_mib,
                    &task_work,
                ),
            })
            .await
            .map_err(|e| HostError::Import(format!("the import task failed: {e}")))?
            .map_err(|e| match e {
                shoal_image::ImageError::Import(why) => HostError::Import(why),
                other => HostError::Invalid(other.to_string()),
            })?;
            let manifest = self
                .boot_disk(DiskBootSpec {
                    disk: BootDisk::Image(image),
                    vcpus: spec.vcpus,
                    memory_mib: spec.memory_mib,
                    template: "base".into(),
                })
                .await?;
            Ok((manifest, report))
        }
        .await;
        let _ = std::fs::remove_dir_all(&work);
        result
    }

    /// Boots `spec.disk` at `spec`'s size in a capacity slot of that size
    /// and saves it as a user snapshot.
    pub async fn boot_disk(&self, spec: DiskBootSpec) -> Result<Manifest> {
        self.capacity.check_disk()?;
        let _slot = self.reserve(1, spec.memory_mib).await?;
        Ok(self.engine.boot_snapshot(spec).await?)
    }
}
