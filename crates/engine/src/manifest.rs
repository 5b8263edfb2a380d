//! What a restorable state is made of, as written next to its files.
//!
//! A template bake, a fork point, a user snapshot and a hibernated sandbox
//! are all the same thing on disk: a guest memory file, a device state file
//! and a chain of disk layers, described by a [`Manifest`]. One restore path
//! serves them all.

use crate::accel::Accel;
use crate::error::{IoContext, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const MANIFEST_FILE: &str = "manifest.json";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A baked template; lives under `templates/`.
    Template,
    /// The state children of a fork restore from; deleted with its last user.
    Fork,
    /// A snapshot a user asked for; kept until deleted.
    Snapshot,
    /// A hibernated sandbox's state; deleted with the sandbox.
    Hibernate,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub id: String,
    pub kind: Kind,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub memory_file: PathBuf,
    pub devices_file: PathBuf,
    /// Read-only disk layers, bottom first.
    pub disk_layers: Vec<PathBuf>,
    /// Captures (by id) whose files this one uses, so they outlive it.
    #[serde(default)]
    pub depends_on: Vec<String>,
    pub qemu_version: String,
    pub accel: Accel,
    #[serde(default)]
    pub kernel_version: String,
    /// For templates: the hash of every input of the bake.
    #[serde(default)]
    pub input_hash: String,
    /// For templates: [`crate::integrity::memory_sha256`] of the memory
    /// file as the bake wrote it (older bakes have none: taken at their
    /// first load).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_sha256: Option<String>,
    pub created_unix_ms: u64,
}

impl Manifest {
    pub fn load(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read(&path).io_context(|| format!("reading {}", path.display()))?;
        serde_json::from_slice(&text).map_err(|e| crate::EngineError::Io {
            context: format!("parsing {}", path.display()),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        })
    }

    pub fn store(&self, dir: &Path) -> Result<()> {
        write_json_atomically(&dir.join(MANIFEST_FILE), self)
    }

    /// Every capture this state needs to stay on disk, itself included.
    pub fn captures_needed(&self) -> Vec<String> {
        let mut ids = self.depends_on.clone();
        if self.kind != Kind::Template {
            ids.push(self.id.clone());
        }
        ids
    }
}

/// Writes `value` to `path` so that after a power cut `path` holds either
/// the old value or the new one, whole: the temporary file is on the disk
/// before it takes the name, and the name is on the disk before this
/// returns.
pub fn write_json_atomically<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    use std::io::Write as _;
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec_pretty(value).expect("manifests always serialize");
    std::fs::File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(&bytes)?;
            f.sync_all()
        })
        .io_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).io_context(|| format!("renaming {}", tmp.display()))?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .io_context(|| format!("syncing {}", dir.display()))
}

pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
