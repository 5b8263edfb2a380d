//! Volumes inside a VM: which image backs which slot, and what the guest is
//! told to do with it (through the guest agent, as shell run by `exec`).
//!
//! `-M microvm` has no hotplug, so every template is baked with
//! [`qemu::VOLUME_SLOTS`] virtio-blk devices backed by a small placeholder.
//! A restore puts each attached volume's image behind a slot instead (the
//! backing file is not in the migration stream). The guest still holds the
//! placeholder's size and feature bits from the bake, so [`attach`] rebinds
//! the slot's virtio device to its driver: the driver re-reads capacity and
//! features (read-only included, so the guest kernel refuses writes itself),
//! and the disk is mounted at `/mnt/volumes/<name>`.
//!
//! Files are not made here: the host agent owns volume images; the engine
//! only opens the ones it is given. Unused slots get the placeholder,
//! read-only, so no guest can write to a file other VMs open.

use crate::error::{EngineError, IoContext, Result};
use crate::qemu::{self, SlotBacking, VOLUME_SLOTS};
use serde::{Deserialize, Serialize};
use shoal_proto::client::{AgentClient, ExecRequest};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where the guest mounts volume `name`.
pub const GUEST_MOUNT_ROOT: &str = "/mnt/volumes";

/// Size of the placeholder behind unused slots (and every slot at bake).
const PLACEHOLDER_BYTES: u64 = 1 << 20;

/// How long the guest may take to rebind and mount, freeze or thaw.
const GUEST_DEADLINE: Duration = Duration::from_secs(30);

/// How long a delete waits for the guest to unmount: a guest that does not
/// answer leaves its images as a power cut would (ext4's journal replays
/// at the next mount), and the delete goes on.
const DETACH_DEADLINE: Duration = Duration::from_secs(10);

/// The host's own wait beyond the deadline it gives the guest: the guest
/// agent is the tenant's to replace, so its promise to time out is not
/// relied on.
const HOST_MARGIN: Duration = Duration::from_secs(3);

/// A volume attached to a sandbox: an ext4 image on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeAttachment {
    /// The guest mounts it at `/mnt/volumes/<name>`; `[a-z0-9][a-z0-9_-]*`.
    pub name: String,
    pub image: PathBuf,
    pub read_only: bool,
}

/// `[a-z0-9][a-z0-9_-]{0,62}`: a volume's name is also its image's file
/// name and the guest's mount directory, so nothing else may pass.
pub fn valid_name(name: &str) -> bool {
    name.len() <= 63
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// Checks what a create asks for before anything starts.
pub(crate) fn validate(volumes: &[VolumeAttachment]) -> Result<()> {
    if volumes.len() > VOLUME_SLOTS {
        return Err(EngineError::InvalidInput(format!(
            "at most {VOLUME_SLOTS} volumes per sandbox"
        )));
    }
    for (i, volume) in volumes.iter().enumerate() {
        if !valid_name(&volume.name) {
            return Err(EngineError::InvalidInput(format!(
                "volume name {:?} must be [a-z0-9][a-z0-9_-]{{0,62}}",
                volume.name
            )));
        }
        if volumes[..i].iter().any(|v| v.name == volume.name) {
            return Err(EngineError::InvalidInput(format!(
                "volume {} is attached twice",
                volume.name
            )));
        }
        if !volume.image.is_file() {
            return Err(EngineError::InvalidInput(format!(
                "volume {} has no image at {}",
                volume.name,
                volume.image.display()
            )));
        }
    }
    Ok(())
}

/// The placeholder file, made once in `dir` and never written afterwards.
pub(crate) fn placeholder(dir: &Path) -> Result<PathBuf> {
    let path = dir.join("volume-slot.raw");
    if !path.exists() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::File::create(&tmp)
            .and_then(|f| f.set_len(PLACEHOLDER_BYTES))
            .io_context(|| format!("creating {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).io_context(|| format!("renaming {}", tmp.display()))?;
    }
    Ok(path)
}

/// The backing of every slot: the volumes in order, then the placeholder
/// (read-only) behind the rest.
pub(crate) fn slots(volumes: &[VolumeAttachment], placeholder: &Path) -> Vec<SlotBacking> {
    (0..VOLUME_SLOTS)
        .map(|index| match volumes.get(index) {
            Some(volume) => SlotBacking {
                file: volume.image.clone(),
                read_only: volume.read_only,
            },
            None => SlotBacking {
                file: placeholder.to_path_buf(),
                read_only: true,
            },
        })
        .collect()
}

/// The slots of a bake: a writable placeholder of the bake's own in each
/// (the guest negotiates a writable disk, so a restore may attach either
/// way: a read-only backing only adds a feature bit).
pub(crate) fn bake_slots(dir: &Path) -> Result<Vec<SlotBacking>> {
    (0..VOLUME_SLOTS)
        .map(|index| {
            let file = dir.join(format!("volume-slot-{index}.raw"));
            std::fs::File::create(&file)
                .and_then(|f| f.set_len(PLACEHOLDER_BYTES))
                .io_context(|| format!("creating {}", file.display()))?;
            Ok(SlotBacking {
                file,
                read_only: false,
            })
        })
        .collect()
}

/// Shell that finds the disk of slot `index` by its serial into `$dev`.
fn find_disk(index: usize) -> String {
    format!(
        "dev=; for b in /sys/block/vd*; do \
           [ \"$(cat \"$b/serial\" 2>/dev/null)\" = {serial} ] && dev=${{b##*/}}; \
         done; \
         [ -n \"$dev\" ] || {{ echo 'no disk with serial {serial}' >&2; exit 1; }}; ",
        serial = qemu::volume_slot_serial(index)
    )
}

fn mount_point(volume: &VolumeAttachment) -> String {
    format!("{GUEST_MOUNT_ROOT}/{}", volume.name)
}

/// The guest script that makes the slots' new backing visible and mounts
/// each volume. A read-only volume is mounted `noload`: its journal is not
/// replayed (the device refuses writes), so only a writer's clean unmount
/// or freeze (see [`detach_script`]) shows its last writes to readers.
fn attach_script(volumes: &[VolumeAttachment]) -> String {
    let mut script = String::from("set -e; ");
    for (index, volume) in volumes.iter().enumerate() {
        let options = if volume.read_only { "ro,noload" } else { "rw" };
        script.push_str(&find_disk(index));
        script.push_str(&format!(
            "virtio=$(basename \"$(readlink -f /sys/block/$dev/device)\"); \
             echo \"$virtio\" > /sys/bus/virtio/drivers/virtio_blk/unbind; \
             echo \"$virtio\" > /sys/bus/virtio/drivers/virtio_blk/bind; \
             dev=$(ls /sys/bus/virtio/devices/$virtio/block); \
             mkdir -p {mount}; \
             mount -t ext4 -o {options} /dev/$dev {mount}; ",
            mount = mount_point(volume),
        ));
    }
    script
}

/// Unmounts every writable volume, or, if something in the guest holds it
/// open, freezes it: either way its journal is flushed and the image is
/// clean on the host before the VM goes.
fn detach_script(volumes: &[VolumeAttachment]) -> String {
    let mut script = String::from("status=0; sync; ");
    for volume in volumes.iter().filter(|v| !v.read_only) {
        script.push_str(&format!(
            "umount {m} 2>/dev/null || fsfreeze --freeze {m} || status=1; ",
            m = mount_point(volume)
        ));
    }
    script.push_str("exit $status");
    script
}

/// Freezes (or thaws) every writable volume: before a hibernation the image
/// is made clean, so deleting the hibernated sandbox loses nothing.
fn freeze_script(volumes: &[VolumeAttachment], freeze: bool) -> String {
    let flag = if freeze { "--freeze" } else { "--unfreeze" };
    let mut script = String::from("status=0; ");
    for volume in volumes.iter().filter(|v| !v.read_only) {
        script.push_str(&format!(
            "fsfreeze {flag} {} || status=1; ",
            mount_point(volume)
        ));
    }
    script.push_str("exit $status");
    script
}

async fn run(agent: &AgentClient, what: &str, script: String, deadline: Duration) -> Result<()> {
    let call = agent.exec_collect(ExecRequest {
        cmd: script,
        timeout: Some(deadline),
        ..ExecRequest::default()
    });
    let output = tokio::time::timeout(deadline + HOST_MARGIN, call)
        .await
        .map_err(|_| EngineError::Timeout(format!("{what}: the guest did not answer")))??;
    if output.status.code != Some(0) {
        return Err(EngineError::Qemu {
            message: format!(
                "{what} in the guest failed ({:?}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        });
    }
    Ok(())
}

/// What a restored guest does with its volumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// A new sandbox: rebind the slots and mount (see the module doc).
    Mount,
    /// A wake: the mounts came back with the memory; thaw what the
    /// hibernation froze.
    Thaw,
}

pub(crate) async fn after_restore(
    agent: &AgentClient,
    volumes: &[VolumeAttachment],
    step: Step,
) -> Result<()> {
    match step {
        Step::Mount if !volumes.is_empty() => {
            run(
                agent,
                "attaching volumes",
                attach_script(volumes),
                GUEST_DEADLINE,
            )
            .await
        }
        Step::Mount => Ok(()),
        Step::Thaw => thaw(agent, volumes).await,
    }
}

/// Leaves the writable volumes clean on the host (see [`detach_script`]).
pub(crate) async fn detach(agent: &AgentClient, volumes: &[VolumeAttachment]) -> Result<()> {
    if !volumes.iter().any(|v| !v.read_only) {
        return Ok(());
    }
    run(
        agent,
        "detaching volumes",
        detach_script(volumes),
        DETACH_DEADLINE,
    )
    .await
}

pub(crate) async fn freeze(agent: &AgentClient, volumes: &[VolumeAttachment]) -> Result<()> {
    if !volumes.iter().any(|v| !v.read_only) {
        return Ok(());
    }
    run(
        agent,
        "freezing volumes",
        freeze_script(volumes, true),
        GUEST_DEADLINE,
    )
    .await
}

pub(crate) async fn thaw(agent: &AgentClient, volumes: &[VolumeAttachment]) -> Result<()> {
    if !volumes.iter().any(|v| !v.read_only) {
        return Ok(());
    }
    run(
        agent,
        "thawing volumes",
        freeze_script(volumes, false),
        GUEST_DEADLINE,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(name: &str, read_only: bool) -> VolumeAttachment {
        VolumeAttachment {
            name: name.into(),
            image: "/nonexistent".into(),
            read_only,
        }
    }

    #[test]
    fn unused_slots_get_the_placeholder_read_only() {
        let slots = slots(&[volume("data", false)], Path::new("/c/p"));
        assert_eq!(slots.len(), VOLUME_SLOTS);
        assert_eq!(slots[0].file, Path::new("/nonexistent"));
        assert!(!slots[0].read_only);
        assert_eq!(slots[1].file, Path::new("/c/p"));
        assert!(slots[1].read_only);
    }

    #[test]
    fn names_and_counts_are_checked() {
        let too_many = vec![volume("a", true), volume("b", true), volume("c", true)];
        assert!(validate(&too_many).is_err());
        assert!(validate(&[volume("../x", true)]).is_err());
        assert!(validate(&[volume("-x", true)]).is_err());
        // A missing image is refused too.
        assert!(validate(&[volume("ok_name-1", true)]).is_err());
    }

    #[test]
    fn read_only_volumes_mount_without_journal_replay() {
        let script = attach_script(&[volume("a", false), volume("b", true)]);
        assert!(script.contains("mount -t ext4 -o rw /dev/$dev /mnt/volumes/a"));
        assert!(script.contains("mount -t ext4 -o ro,noload /dev/$dev /mnt/volumes/b"));
        assert!(script.contains("= shoal-vol1 ]"));
        let detach = detach_script(&[volume("a", false), volume("b", true)]);
        assert!(detach.contains("umount /mnt/volumes/a"));
        assert!(!detach.contains("/mnt/volumes/b"));
    }
}
