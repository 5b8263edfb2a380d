//! Volume images on this host: `<state>/volumes/<account id>/<name>.ext4`,
//! sparse files with an ext4 file system, made and removed here. The store
//! owns the rows that say which exist and who may attach them; the engine
//! only opens the images it is given.
//!
//! A create checks for headroom first: the file system holding the images
//! must have the volume's whole provisioned size free (sparse images grow
//! as they are written, so this is what a full volume would need), else
//! [`HostError::StorageShort`] before anything exists.

use crate::{HostAgent, HostError, Result};
use std::path::PathBuf;
use std::process::Command;

impl HostAgent {
    fn volumes_dir(&self) -> PathBuf {
        self.engine.state_dir().join("volumes")
    }

    /// Where the image of `account`'s volume `name` lives on this host.
    /// `name` must already be checked (`[a-z0-9][a-z0-9_-]{0,62}`).
    pub fn volume_image(&self, account: i64, name: &str) -> PathBuf {
        self.volumes_dir()
            .join(account.to_string())
            .join(format!("{name}.ext4"))
    }

    /// Refuses a volume of `size_mb` that the host's disk could not hold.
    pub fn check_volume_headroom(&self, size_mb: u64) -> Result<()> {
        let dir = self.volumes_dir();
        std::fs::create_dir_all(&dir).map_err(|e| io_error("creating", &dir, e))?;
        let available_mb = available_bytes(&dir)? >> 20;
        if available_mb < size_mb {
            return Err(HostError::StorageShort {
                available_mb,
                wanted_mb: size_mb,
            });
        }
        Ok(())
    }

    /// Makes the image: a sparse file of `size_mb` MiB with an empty ext4
    /// file system, written under a temporary name and renamed when whole
    /// (an image left from an earlier volume of that name is replaced).
    pub async fn make_volume(&self, account: i64, name: &str, size_mb: u64) -> Result<PathBuf> {
        let path = self.volume_image(account, name);
        let task_path = path.clone();
        tokio::task::spawn_blocking(move || make_image(&task_path, size_mb))
            .await
            .map_err(|e| HostError::Volume(format!("the mkfs task failed: {e}")))??;
        Ok(path)
    }

    /// Removes the image; a missing one is not an error.
    pub fn remove_volume(&self, account: i64, name: &str) -> Result<()> {
        let path = self.volume_image(account, name);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_error("removing", &path, e)),
        }
    }
}

fn make_image(path: &std::path::Path, size_mb: u64) -> Result<()> {
    let dir = path.parent().expect("an image path has a directory");
    std::fs::create_dir_all(dir).map_err(|e| io_error("creating", dir, e))?;
    let tmp = path.with_extension("ext4.tmp");
    let made = (|| {
        std::fs::File::create(&tmp)
            .and_then(|f| f.set_len(size_mb << 20))
            .map_err(|e| io_error("creating", &tmp, e))?;
        // No reserved blocks (no root daemons write here); inode tables and
        // the journal are initialised lazily, so a 64 GiB volume takes a
        // moment, not minutes, and stays sparse.
        let output = Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-m",
                "0",
                "-E",
                "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
            ])
            .arg(&tmp)
            .output()
            .map_err(|e| io_error("running mkfs.ext4 on", &tmp, e))?;
        if !output.status.success() {
            return Err(HostError::Volume(format!(
                "mkfs.ext4 failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            )));
        }
        // On the disk before it has its name, and the name on the disk
        // before the create is acknowledged: a power cut leaves either no
        // image or a whole one.
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| io_error("syncing", &tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_error("renaming", &tmp, e))?;
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_error("syncing", dir, e))
    })();
    if made.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    made
}

fn available_bytes(dir: &std::path::Path) -> Result<u64> {
    let stat = nix::sys::statvfs::statvfs(dir).map_err(|e| {
        io_error(
            "reading free space of",
            dir,
            std::io::Error::from_raw_os_error(e as i32),
        )
    })?;
    Ok(stat.blocks_available() as u64 * stat.fragment_size() as u64)
}

fn io_error(what: &str, path: &std::path::Path, e: std::io::Error) -> HostError {
    HostError::Volume(format!("{what} {}: {e}", path.display()))
}
