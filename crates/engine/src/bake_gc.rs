//! Old template bakes and root filesystem images leave the cache once
//! nothing uses them.
//!
//! The cache is shared by every engine on the host (each with its own
//! state directory, some not running), so use is recorded where the files
//! are: a VM or capture directory that names a bake's or an image's files
//! leaves a note in that directory's `users/`, holding its own path. A
//! note whose path is gone is stale. A bake that is not its template's
//! `current`, has no live note, and was replaced more than a grace period
//! ago is removed; so is a root filesystem no remaining bake names and no
//! live note holds.
//!
//! May not: touch a template's `current` bake, or a bake while its
//! template's `bake.lock` is held.

use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

const USERS: &str = "users";

/// How long after a template's `current` changed its previous bakes stay:
/// a create that read the old `current` just before is still starting.
pub(crate) const GRACE: Duration = Duration::from_secs(600);

/// Records that `user` (a VM's or a capture's directory) uses `files`: a
/// note in the directory of each that lies in a bake or a root filesystem
/// image of the cache.
pub(crate) fn record_use<'a>(
    cache_dir: &Path,
    user: &Path,
    files: impl IntoIterator<Item = &'a Path>,
) {
    for note in notes(cache_dir, user, files) {
        let written = std::fs::create_dir_all(note.parent().unwrap_or(Path::new("/")))
            .and_then(|()| std::fs::write(&note, user.as_os_str().as_encoded_bytes()));
        if let Err(e) = written {
            tracing::warn!(note = %note.display(), error = %e, "recording a use of a cached image");
        }
    }
}

/// Removes the notes [`record_use`] wrote for `user` (a VM being deleted);
/// any it misses are pruned as stale by [`collect`].
pub(crate) fn forget_use<'a>(
    cache_dir: &Path,
    user: &Path,
    files: impl IntoIterator<Item = &'a Path>,
) {
    for note in notes(cache_dir, user, files) {
        let _ = std::fs::remove_file(note);
    }
}

/// The note files of `user`'s use of `files`: one per bake or image
/// directory among their parents.
fn notes<'a>(
    cache_dir: &Path,
    user: &Path,
    files: impl IntoIterator<Item = &'a Path>,
) -> Vec<PathBuf> {
    let templates = cache_dir.join("templates");
    let rootfs = cache_dir.join("images").join("rootfs");
    let key = hex::encode(&Sha256::digest(user.as_os_str().as_encoded_bytes())[..8]);
    let mut owners = HashSet::new();
    let mut out = Vec::new();
    for file in files {
        let Some(owner) = file.parent() else { continue };
        let cached = owner.parent().and_then(Path::parent) == Some(templates.as_path())
            || owner.parent() == Some(rootfs.as_path());
        if cached && owners.insert(owner.to_owned()) {
            out.push(owner.join(USERS).join(&key));
        }
    }
    out
}

/// Whether a live note names a user of `dir`; stale notes are removed.
fn in_use(dir: &Path) -> bool {
    let Ok(notes) = std::fs::read_dir(dir.join(USERS)) else {
        return false;
    };
    let mut used = false;
    for note in notes.flatten() {
        let user = std::fs::read(note.path())
            .ok()
            .map(|bytes| PathBuf::from(String::from_utf8_lossy(&bytes).into_owned()));
        match user {
            Some(user) if user.exists() => used = true,
            _ => {
                let _ = std::fs::remove_file(note.path());
            }
        }
    }
    used
}

fn older_than(path: &Path, age: Duration) -> bool {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| SystemTime::now().duration_since(t).ok())
        .is_some_and(|elapsed| elapsed >= age)
}

/// Removes the bakes and root filesystems nothing uses (see the module
/// doc); returns what it removed.
pub(crate) fn collect(cache_dir: &Path, grace: Duration) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let mut named_rootfs = HashSet::new();
    let templates = std::fs::read_dir(cache_dir.join("templates"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir());
    for template in templates {
        collect_template(&template, grace, &mut removed);
        // What the bakes that stay name (a bake in progress has not named
        // its image yet: the rootfs grace covers it).
        for bake in subdirs(&template) {
            if let Ok(manifest) = crate::manifest::Manifest::load(&bake) {
                named_rootfs.extend(
                    manifest
                        .disk_layers
                        .iter()
                        .filter_map(|l| l.parent().map(Path::to_owned)),
                );
            }
        }
    }
    for image in subdirs(&cache_dir.join("images").join("rootfs")) {
        if named_rootfs.contains(&image) || in_use(&image) || !older_than(&image, grace) {
            continue;
        }
        if std::fs::remove_dir_all(&image).is_ok() {
            tracing::info!(image = %image.display(), "collected an unused root filesystem");
            removed.push(image);
        }
    }
    removed
}

fn collect_template(template: &Path, grace: Duration, removed: &mut Vec<PathBuf>) {
    let current_file = template.join("current");
    let Ok(current) = std::fs::read_to_string(&current_file) else {
        return;
    };
    if !older_than(&current_file, grace) {
        return;
    }
    // A bake in progress holds the lock: leave the template alone.
    let Ok(_lock) = crate::lock_file(&template.join("bake.lock"), false) else {
        return;
    };
    for bake in subdirs(template) {
        let name = bake.file_name().map(|n| n.to_string_lossy().into_owned());
        let Some(name) = name else { continue };
        if name == current.trim() {
            // Kept whatever its notes say; the stale ones go.
            in_use(&bake);
            continue;
        }
        if name.ends_with(".tmp") || !bake.join("manifest.json").exists() {
            continue;
        }
        if in_use(&bake) {
            continue;
        }
        if std::fs::remove_dir_all(&bake).is_ok() {
            tracing::info!(bake = %bake.display(), "collected an old template bake");
            removed.push(bake);
        }
    }
}

fn subdirs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n != USERS))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bake(cache: &Path, template: &str, hash: &str, rootfs: &str) -> PathBuf {
        let dir = cache.join("templates").join(template).join(hash);
        std::fs::create_dir_all(&dir).unwrap();
        let image = cache.join("images/rootfs").join(rootfs);
        std::fs::create_dir_all(&image).unwrap();
        std::fs::write(image.join("rootfs.ext4"), b"fs").unwrap();
        std::fs::write(dir.join("disk.qcow2"), b"layer").unwrap();
        let manifest = serde_json::json!({
            "id": format!("tpl-{template}"), "kind": "template", "template": template,
            "vcpus": 1, "memory_mib": 64,
            "memory_file": dir.join("memory"), "devices_file": dir.join("devices"),
            "disk_layers": [image.join("rootfs.ext4"), dir.join("disk.qcow2")],
            "qemu_version": "q", "accel": "tcg", "created_unix_ms": 0,
        });
        std::fs::write(dir.join("manifest.json"), manifest.to_string()).unwrap();
        dir
    }

    #[test]
    fn unused_old_bakes_and_their_images_go_and_used_or_current_ones_stay() {
        let root = std::env::temp_dir().join(format!("shoal-bake-gc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let cache = root.join("cache");
        let old = bake(&cache, "t", "old", "t-1");
        let kept = bake(&cache, "t", "kept", "t-2");
        let current = bake(&cache, "t", "new", "t-3");
        std::fs::write(cache.join("templates/t/current"), "new\n").unwrap();
        std::fs::write(cache.join("templates/t/bake.lock"), "").unwrap();

        // A hibernated VM of another engine still uses the "kept" bake; a
        // deleted one used the "old" one.
        let vm = root.join("state/vms/sb-1");
        std::fs::create_dir_all(&vm).unwrap();
        record_use(
            &cache,
            &vm,
            [kept.join("disk.qcow2").as_path(), Path::new("/elsewhere/x")],
        );
        let gone = root.join("state/vms/sb-gone");
        record_use(&cache, &gone, [old.join("disk.qcow2").as_path()]);
        assert_eq!(std::fs::read_dir(old.join(USERS)).unwrap().count(), 1);

        // Within the grace nothing goes.
        assert!(collect(&cache, Duration::from_secs(3600)).is_empty());
        let removed = collect(&cache, Duration::ZERO);
        assert_eq!(removed, [old.clone(), cache.join("images/rootfs/t-1")]);
        assert!(kept.exists() && current.exists());
        assert!(
            cache.join("images/rootfs/t-2").exists() && cache.join("images/rootfs/t-3").exists()
        );

        // Once the VM is gone, its bake goes too; the current one never.
        std::fs::remove_dir_all(&vm).unwrap();
        let removed = collect(&cache, Duration::ZERO);
        assert_eq!(removed, [kept, cache.join("images/rootfs/t-2")]);
        assert!(current.exists());

        // Notes of users gone are pruned from the current bake too, and a
        // deleted VM's own note goes with it.
        record_use(&cache, &gone, [current.join("disk.qcow2").as_path()]);
        let live = root.join("state/vms/sb-live");
        std::fs::create_dir_all(&live).unwrap();
        record_use(&cache, &live, [current.join("disk.qcow2").as_path()]);
        assert_eq!(std::fs::read_dir(current.join(USERS)).unwrap().count(), 2);
        collect(&cache, Duration::ZERO);
        assert_eq!(std::fs::read_dir(current.join(USERS)).unwrap().count(), 1);
        forget_use(&cache, &live, [current.join("disk.qcow2").as_path()]);
        assert_eq!(std::fs::read_dir(current.join(USERS)).unwrap().count(), 0);

        // A bake in progress (its lock held) keeps the template untouched.
        let older = bake(&cache, "t", "older", "t-4");
        let _held = crate::lock_file(&cache.join("templates/t/bake.lock"), false).unwrap();
        let removed = collect(&cache, Duration::ZERO);
        assert!(
            older.exists(),
            "collected under a held bake lock: {removed:?}"
        );
        let _ = std::fs::remove_dir_all(&root);
    }
}
