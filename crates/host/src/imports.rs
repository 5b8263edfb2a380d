//! Snapshots this host makes by booting a disk rather than capturing a
//! sandbox: a root filesystem tarball or OCI image archive made into an
//! image (`shoal_image::import`) and booted, or an existing snapshot's or
//! template's disk booted at another size (a snapshot fixes vCPUs and
//! memory, so another size is another boot).
//!
//! The boot is a VM like any other: it takes a capacity slot of its size
//! for as long as it runs, and nothing starts while the state disk is
//! short of room for the image.

use crate::{HostAgent, HostError, Result, Source};
use sha2::{Digest, Sha256};
use shoal_engine::warm_up::WarmUp;
use shoal_engine::{BootDisk, DiskBootSpec, Manifest, SIZED_PREFIX};
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
        let mut tries = 0;
        loop {
            tries += 1;
            match self.import_once(&spec).await {
                Err(e) if tries < BOOT_TRIES && boot_hung(&e) => {
                    tracing::warn!(error = %e, "an imported disk's boot hung; booting it again");
                }
                other => return other,
            }
        }
    }

    async fn import_once(&self, spec: &ImportSpec) -> Result<(Manifest, ImportReport)> {
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
                    id: None,
                    warm_up: None,
                })
                .await?;
            Ok((manifest, report))
        }
        .await;
        let _ = std::fs::remove_dir_all(&work);
        result
    }

    /// Bakes the template `name` of another Debian release
    /// (`shoal_image::release_template`), which `shoal up` does not bake at
    /// start: debootstrap once per cache, then the bake, in a capacity slot
    /// of the template's size. Quick when it is already baked.
    pub async fn bake_release_template(&self, name: &str) -> Result<Manifest> {
        let spec = shoal_image::find_template(name)
            .filter(|spec| spec.suite != shoal_image::SUITE)
            .ok_or_else(|| {
                HostError::Invalid(format!("{name} is not another Debian release's template"))
            })?;
        let agent = self.guest_agent.clone().ok_or_else(|| {
            HostError::Invalid("this host has no guest agent to bake into templates".into())
        })?;
        self.capacity.check_disk()?;
        let _slot = self.reserve(1, spec.memory_mib).await?;
        let hidden =
            shoal_engine::BakeProgress::with_draw_target(indicatif::ProgressDrawTarget::hidden());
        let manifest = self.engine.build_template(name, &agent, &hidden).await?;
        // Hashed now, as at start, so the first restore does not pay for it.
        self.engine.verified_template(name)?;
        Ok(manifest)
    }

    /// Boots `spec.disk` at `spec`'s size in a capacity slot of that size
    /// and saves it as a user snapshot.
    pub async fn boot_disk(&self, spec: DiskBootSpec) -> Result<Manifest> {
        self.capacity.check_disk()?;
        let _slot = self.reserve(1, spec.memory_mib).await?;
        Ok(self.engine.boot_snapshot(spec).await?)
    }
}

/// Boots of a disk before its failure is the answer: a cold boot under TCG
/// with several vCPUs now and then never reaches the agent (the boot
/// deadline ends it), and a second boot of the same disk does.
const BOOT_TRIES: u32 = 2;

/// Whether a disk boot failed because the guest never answered.
fn boot_hung(e: &HostError) -> bool {
    use shoal_engine::EngineError;
    matches!(
        e,
        HostError::Engine(EngineError::Agent(shoal_proto::client::AgentError::Timeout))
            | HostError::Engine(EngineError::Timeout(_))
    )
}

/// The smallest guest memory a sized copy may have: a Debian guest with
/// the agent boots in less, but not with room to run anything.
pub const MIN_SIZED_MEMORY_MIB: u32 = 256;

impl HostAgent {
    /// What a create from `source` restores (its size, its layers).
    pub fn source_manifest(&self, source: &Source) -> Result<Manifest> {
        Ok(match source {
            Source::Template(name) => self.engine.template(name)?,
            Source::Snapshot(id) => self.engine.snapshot_manifest(id)?,
        })
    }

    /// `source` at `vcpus` and `memory_mib`: `source` itself when it has
    /// that size, else its disk booted at that size, saved once as a
    /// snapshot (`size-<hash>`) and reused by every later create of that
    /// size. A size above the source's is [`HostError::Invalid`]: a VM is
    /// at most its template's size. A template with a start command has it
    /// run (`warm_up`) before the copy is saved, as its own bake did.
    pub async fn sized(
        &self,
        source: &Source,
        vcpus: u32,
        memory_mib: u32,
        warm_up: Option<&WarmUp>,
    ) -> Result<Source> {
        let manifest = self.source_manifest(source)?;
        if (vcpus, memory_mib) == (manifest.vcpus, manifest.memory_mib) {
            return Ok(source.clone());
        }
        if vcpus == 0
            || vcpus > manifest.vcpus
            || memory_mib < MIN_SIZED_MEMORY_MIB
            || memory_mib > manifest.memory_mib
        {
            return Err(HostError::Invalid(format!(
                "a sandbox of {} may have 1 to {} vCPUs and {MIN_SIZED_MEMORY_MIB} to {} MiB \
                 (asked for {vcpus} and {memory_mib} MiB)",
                manifest.template, manifest.vcpus, manifest.memory_mib
            )));
        }
        let mut hasher = Sha256::new();
        for part in [
            manifest.id.as_str(),
            &manifest.created_unix_ms.to_string(),
            &manifest.input_hash,
            &vcpus.to_string(),
            &memory_mib.to_string(),
        ] {
            hasher.update((part.len() as u64).to_le_bytes());
            hasher.update(part.as_bytes());
        }
        if let Some(warm_up) = warm_up {
            for part in [&warm_up.start, &warm_up.ready] {
                let part = part.as_deref().unwrap_or("");
                hasher.update((part.len() as u64).to_le_bytes());
                hasher.update(part.as_bytes());
            }
        }
        let id = format!(
            "{SIZED_PREFIX}{}",
            &format!("{:x}", hasher.finalize())[..16]
        );
        // One boot per copy at a time; a second create of that size waits
        // for it and restores what it saved. Per copy, not per host: a
        // tenant's slow disk delays only the copies of its own snapshot.
        let lock = self
            .sizing
            .lock()
            .await
            .entry(id.clone())
            .or_default()
            .clone();
        let _one = lock.lock().await;
        if self.engine.snapshot_manifest(&id).is_ok() {
            self.engine.touch_snapshot(&id);
            return Ok(Source::Snapshot(id));
        }
        let disk = match source {
            Source::Template(name) => BootDisk::TemplateDisk(name.clone()),
            Source::Snapshot(snapshot) => BootDisk::SnapshotDisk(snapshot.clone()),
        };
        let boot = || {
            self.boot_disk(DiskBootSpec {
                disk: disk.clone(),
                vcpus,
                memory_mib,
                template: manifest.template.clone(),
                id: Some(id.clone()),
                warm_up: warm_up.cloned(),
            })
        };
        let mut booted = boot().await;
        if booted.as_ref().is_err_and(boot_hung) {
            tracing::warn!(copy = id, "a sized copy's boot hung; booting it again");
            booted = boot().await;
        }
        self.sizing.lock().await.remove(&id);
        booted?;
        self.evict_sized_copies(&id).await;
        Ok(Source::Snapshot(id))
    }

    /// Keeps at most [`MAX_SIZED_COPIES`] sized copies on this host: past
    /// it the least recently used go (their files once no sandbox restored
    /// from them runs), so asking for many sizes cannot fill the disk, and
    /// copies of a template since rebaked do not stay forever. A copy used
    /// in the last [`SIZED_COPY_GRACE`] stays: a create may be about to
    /// restore it.
    async fn evict_sized_copies(&self, keep: &str) {
        let copies: Vec<(String, std::time::SystemTime)> = self
            .engine
            .snapshots()
            .into_iter()
            .filter(|m| m.id.starts_with(SIZED_PREFIX))
            .map(|m| {
                let used = self.engine.snapshot_used_at(&m.id);
                (m.id, used)
            })
            .collect();
        let now = std::time::SystemTime::now();
        for id in copies_to_evict(copies, keep, MAX_SIZED_COPIES, now) {
            if let Err(e) = self.engine.delete_snapshot(&id).await {
                tracing::warn!(copy = id, error = %e, "evicting a sized copy");
            }
        }
    }
}

/// Sized copies a host keeps (each up to its template's memory on disk).
pub const MAX_SIZED_COPIES: usize = 16;
/// How recently used a copy must not be to be evicted.
const SIZED_COPY_GRACE: std::time::Duration = std::time::Duration::from_secs(120);

/// Which of `copies` (id, last use) go so that at most `max` stay: the
/// least recently used first, never `keep` nor one used within the grace.
fn copies_to_evict(
    mut copies: Vec<(String, std::time::SystemTime)>,
    keep: &str,
    max: usize,
    now: std::time::SystemTime,
) -> Vec<String> {
    if copies.len() <= max {
        return Vec::new();
    }
    let excess = copies.len() - max;
    copies.sort_by_key(|(_, used)| *used);
    copies
        .into_iter()
        .filter(|(id, used)| {
            id != keep
                && now
                    .duration_since(*used)
                    .is_ok_and(|age| age >= SIZED_COPY_GRACE)
        })
        .take(excess)
        .map(|(id, _)| id)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    #[test]
    fn only_a_boot_that_never_answered_is_booted_again() {
        use shoal_engine::EngineError;
        use shoal_proto::client::AgentError;
        assert!(boot_hung(&HostError::Engine(EngineError::Agent(
            AgentError::Timeout
        ))));
        assert!(boot_hung(&HostError::Engine(EngineError::Timeout(
            "boot".into()
        ))));
        assert!(!boot_hung(&HostError::Import("leaves the root".into())));
        assert!(!boot_hung(&HostError::Full));
    }

    #[test]
    fn the_least_recently_used_copies_go_but_not_the_new_one_nor_a_fresh_one() {
        let now = SystemTime::now();
        let ago = |s: u64| now - Duration::from_secs(s);
        let copies = |n: usize| -> Vec<(String, SystemTime)> {
            (0..n)
                .map(|i| (format!("size-{i}"), ago(1000 - i as u64)))
                .collect()
        };
        assert!(copies_to_evict(copies(3), "size-0", 3, now).is_empty());
        // Five over three: the two oldest, size-0 and size-1.
        assert_eq!(
            copies_to_evict(copies(5), "size-4", 3, now),
            ["size-0", "size-1"]
        );
        // The one just made is never evicted, even when oldest by its clock.
        assert_eq!(
            copies_to_evict(copies(5), "size-0", 3, now),
            ["size-1", "size-2"]
        );
        // One used within the grace stays; the cap is then exceeded for now.
        let mut fresh = copies(5);
        fresh[1].1 = ago(5);
        assert_eq!(
            copies_to_evict(fresh, "size-4", 3, now),
            ["size-0", "size-2"]
        );
        let all_fresh: Vec<_> = (0..5).map(|i| (format!("size-{i}"), ago(1))).collect();
        assert!(copies_to_evict(all_fresh, "size-4", 3, now).is_empty());
    }
}
