//! The layer cache under `<state_dir>/images/`.
//!
//! Owns: cache keys (sha256 over labelled inputs), the `artifacts.json`
//! record that marks a layer finished, building a layer in a temporary
//! directory and renaming it into place (so an interrupted build never
//! leaves something that looks finished), and the lock that serialises
//! builds sharing one state directory. It does not know what a layer holds.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{ImageError, IoContext};

/// Name of the record written into every finished layer directory.
pub const RECORD_FILE: &str = "artifacts.json";

/// sha256 of a file, hex.
pub fn sha256_file(path: &Path) -> Result<String, ImageError> {
    let mut f = fs::File::open(path).ctx(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .ctx(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// [`sha256_file`], remembered in `<images_dir>/file-hashes.json` keyed by
/// the file's identity and change stamps (device, inode, size, mtime,
/// ctime: what git's index trusts too). Hashing a 20 MB debug agent in an
/// unoptimised build takes about a second, which a no-op build cannot pay.
pub fn sha256_file_cached(images_dir: &Path, path: &Path) -> Result<String, ImageError> {
    use std::collections::BTreeMap;
    use std::os::unix::fs::MetadataExt;
    let m = fs::metadata(path).ctx(|| format!("stat {}", path.display()))?;
    let stamp = format!(
        "{}:{}:{}:{}.{}:{}.{}",
        m.dev(),
        m.ino(),
        m.len(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec()
    );
    let memo_path = images_dir.join("file-hashes.json");
    let mut memo: BTreeMap<String, (String, String)> = fs::read_to_string(&memo_path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let name = path.to_string_lossy().into_owned();
    if let Some((s, hash)) = memo.get(&name) {
        if *s == stamp {
            return Ok(hash.clone());
        }
    }
    let hash = sha256_file(path)?;
    memo.insert(name, (stamp, hash.clone()));
    // Best effort: a memo that cannot be written only costs time later.
    if fs::create_dir_all(images_dir).is_ok() {
        let _ = write_json_atomic(&memo_path, &memo);
    }
    Ok(hash)
}

/// sha256 of bytes, hex.
pub fn sha256_bytes(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// A cache key: sha256 over named inputs. Each input is length-prefixed so
/// no two different input lists can produce the same byte stream.
#[derive(Default)]
pub struct KeyBuilder {
    hasher: Sha256,
}

impl KeyBuilder {
    pub fn new(layer: &str) -> Self {
        KeyBuilder::default().field("layer", layer)
    }

    pub fn field(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        let value = value.as_ref();
        self.hasher.update((name.len() as u64).to_le_bytes());
        self.hasher.update(name.as_bytes());
        self.hasher.update((value.len() as u64).to_le_bytes());
        self.hasher.update(value);
        self
    }

    pub fn finish(self) -> String {
        hex::encode(self.hasher.finalize())
    }
}

/// What every `artifacts.json` holds: which layer, which key, and a
/// layer-specific body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayerRecord<T> {
    pub layer: String,
    pub key: String,
    /// Unix seconds when the layer was finished.
    pub built_at: u64,
    /// How long building it took, for the curious.
    pub build_seconds: f64,
    pub info: T,
}

/// Reads the record of a finished layer, or `None` if the directory is not
/// a finished layer with exactly this key (missing, unreadable, or built
/// from other inputs: all mean "build it").
pub fn read_record<T: DeserializeOwned>(
    dir: &Path,
    layer: &str,
    key: &str,
) -> Option<LayerRecord<T>> {
    let text = fs::read_to_string(dir.join(RECORD_FILE)).ok()?;
    let rec: LayerRecord<T> = serde_json::from_str(&text).ok()?;
    (rec.layer == layer && rec.key == key).then_some(rec)
}

/// Writes `value` as pretty JSON to `path` via a temporary file and rename.
pub fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> Result<(), ImageError> {
    let tmp = path.with_extension(format!("json.tmp-{}", std::process::id()));
    let text = serde_json::to_string_pretty(value).expect("records always serialise");
    {
        let mut f = fs::File::create(&tmp).ctx(|| format!("creating {}", tmp.display()))?;
        f.write_all(text.as_bytes())
            .and_then(|_| f.write_all(b"\n"))
            .and_then(|_| f.sync_all())
            .ctx(|| format!("writing {}", tmp.display()))?;
    }
    fs::rename(&tmp, path).ctx(|| format!("renaming {} into place", path.display()))?;
    sync_parent(path)
}

/// Puts a rename into `path`'s directory on the disk.
fn sync_parent(path: &Path) -> Result<(), ImageError> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .ctx(|| format!("syncing {}", dir.display()))
}

/// Builds a layer directory atomically: `fill` populates a fresh temporary
/// sibling of `dir`; only when it succeeds is the record written and the
/// directory renamed to `dir`. A stale `dir` without a matching record is
/// removed first. On failure the temporary directory is removed.
pub fn build_layer<T: Serialize>(
    dir: &Path,
    layer: &str,
    key: &str,
    fill: impl FnOnce(&Path) -> Result<T, ImageError>,
) -> Result<LayerRecord<T>, ImageError> {
    let started = std::time::Instant::now();
    let parent = dir.parent().expect("layer dirs live under images/");
    fs::create_dir_all(parent).ctx(|| format!("creating {}", parent.display()))?;
    let tmp = tmp_sibling(dir);
    remove_path(&tmp)?;
    fs::create_dir(&tmp).ctx(|| format!("creating {}", tmp.display()))?;
    let info = match fill(&tmp) {
        Ok(info) => info,
        Err(e) => {
            let _ = remove_path(&tmp);
            return Err(e);
        }
    };
    let record = LayerRecord {
        layer: layer.to_string(),
        key: key.to_string(),
        built_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        build_seconds: started.elapsed().as_secs_f64(),
        info,
    };
    write_json_atomic(&tmp.join(RECORD_FILE), &record)?;
    // The layer's files are on the disk before the directory takes its
    // name: a power cut must not leave a record over half-written files,
    // which later bakes would take as a cache hit. One syncfs, not a walk:
    // a bake is rare and its files are large.
    let handle = fs::File::open(&tmp).ctx(|| format!("opening {}", tmp.display()))?;
    nix::unistd::syncfs(std::os::fd::AsRawFd::as_raw_fd(&handle))
        .map_err(std::io::Error::from)
        .ctx(|| format!("syncing {}", tmp.display()))?;
    drop(handle);
    remove_path(dir)?;
    fs::rename(&tmp, dir).ctx(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
    sync_parent(dir)?;
    Ok(record)
}

/// The temporary name a layer is built under. Only one build runs per state
/// dir at a time (see [`StateLock`]), so any such directory found while
/// holding the lock is debris of an interrupted build.
fn tmp_sibling(dir: &Path) -> PathBuf {
    let name = dir
        .file_name()
        .expect("layer dir has a name")
        .to_string_lossy();
    dir.with_file_name(format!(".{name}.partial"))
}

/// Removes the debris of interrupted builds: every `.<name>.partial` one
/// level below `images_dir`. Only call while holding the [`StateLock`].
pub fn sweep_partials(images_dir: &Path) -> Result<Vec<PathBuf>, ImageError> {
    let mut removed = Vec::new();
    let Ok(layers) = fs::read_dir(images_dir) else {
        return Ok(removed);
    };
    for layer in layers.flatten().filter(|e| e.path().is_dir()) {
        for entry in fs::read_dir(layer.path()).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name.ends_with(".partial") {
                remove_path(&entry.path())?;
                removed.push(entry.path());
            }
        }
    }
    Ok(removed)
}

/// Removes a file or directory tree if it exists.
pub fn remove_path(path: &Path) -> Result<(), ImageError> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(ImageError::io(format!("inspecting {}", path.display()), e)),
        Ok(m) if m.is_dir() => {
            fs::remove_dir_all(path).ctx(|| format!("removing {}", path.display()))
        }
        Ok(_) => fs::remove_file(path).ctx(|| format!("removing {}", path.display())),
    }
}

/// An exclusive lock on `<state_dir>/images/.lock`, held for a whole build
/// so two `shoal template build` runs never write the same layer at once.
pub struct StateLock {
    _lock: nix::fcntl::Flock<fs::File>,
}

impl StateLock {
    pub fn acquire(images_dir: &Path) -> Result<Self, ImageError> {
        fs::create_dir_all(images_dir).ctx(|| format!("creating {}", images_dir.display()))?;
        let path = images_dir.join(".lock");
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .ctx(|| format!("opening {}", path.display()))?;
        // flock (not fcntl) locks: released when the file is closed, even
        // if the process is killed, so a crashed build never wedges the cache.
        let lock = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).map_err(
            |(_, errno)| ImageError::io(format!("locking {}", path.display()), errno.into()),
        )?;
        Ok(StateLock { _lock: lock })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_changes_with_any_input_and_only_then() {
        let k = |a: &str, b: &str| KeyBuilder::new("l").field("a", a).field("b", b).finish();
        assert_eq!(k("x", "y"), k("x", "y"));
        assert_ne!(k("x", "y"), k("x", "z"));
        assert_ne!(k("x", "y"), k("y", "x"));
        // Length prefixes: moving a byte between fields changes the key.
        assert_ne!(k("ab", "c"), k("a", "bc"));
        assert_ne!(
            KeyBuilder::new("l1").finish(),
            KeyBuilder::new("l2").finish()
        );
    }

    #[test]
    fn layer_is_only_visible_when_finished() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("layer");
        let err = build_layer::<()>(&dir, "t", "k1", |tmp| {
            fs::write(tmp.join("half"), b"x").unwrap();
            Err(ImageError::Host("interrupted".into()))
        });
        assert!(err.is_err());
        assert!(!dir.exists());
        assert!(!tmp_sibling(&dir).exists());

        let rec = build_layer(&dir, "t", "k1", |tmp| {
            fs::write(tmp.join("file"), b"x").unwrap();
            Ok(42u32)
        })
        .unwrap();
        assert_eq!(rec.info, 42);
        assert!(dir.join("file").exists());
        assert_eq!(read_record::<u32>(&dir, "t", "k1").unwrap().info, 42);
        assert!(read_record::<u32>(&dir, "t", "k2").is_none());
        assert!(read_record::<u32>(&dir, "other", "k1").is_none());

        // Rebuilding replaces the old content entirely.
        build_layer(&dir, "t", "k2", |tmp| {
            fs::write(tmp.join("new"), b"y").unwrap();
            Ok(1u32)
        })
        .unwrap();
        assert!(!dir.join("file").exists());
        assert!(read_record::<u32>(&dir, "t", "k2").is_some());
    }

    #[test]
    fn partial_builds_are_swept_and_finished_layers_kept() {
        let root = tempfile::tempdir().unwrap();
        let images = root.path();
        let done = images.join("kernel/done");
        build_layer(&done, "kernel", "k", |_| Ok(())).unwrap();
        let partial = tmp_sibling(&images.join("kernel/other"));
        fs::create_dir_all(partial.join("deep")).unwrap();
        let removed = sweep_partials(images).unwrap();
        assert_eq!(removed, vec![partial.clone()]);
        assert!(!partial.exists());
        assert!(read_record::<()>(&done, "kernel", "k").is_some());
    }

    #[test]
    fn cached_hash_follows_content_changes() {
        let root = tempfile::tempdir().unwrap();
        let p = root.path().join("f");
        fs::write(&p, b"one").unwrap();
        assert_eq!(
            sha256_file_cached(root.path(), &p).unwrap(),
            sha256_bytes(b"one")
        );
        assert_eq!(
            sha256_file_cached(root.path(), &p).unwrap(),
            sha256_bytes(b"one")
        );
        fs::write(&p, b"two").unwrap();
        assert_eq!(
            sha256_file_cached(root.path(), &p).unwrap(),
            sha256_bytes(b"two")
        );
    }

    #[test]
    fn file_hash_matches_bytes_hash() {
        let root = tempfile::tempdir().unwrap();
        let p = root.path().join("f");
        fs::write(&p, b"hello").unwrap();
        assert_eq!(sha256_file(&p).unwrap(), sha256_bytes(b"hello"));
    }
}
