//! The layered build cache (issue 21): after each `RUN` a Dockerfile build
//! captures its builder (the VM keeps running), keyed by everything up to
//! that step: the account, the base and size, each earlier step as parsed
//! and the content of every file a `COPY`/`ADD` placed. A later build of
//! the account whose steps start the same restores the deepest such
//! capture and runs only the steps after it; a whole unchanged build is
//! answered by `builds.rs`'s whole-build cache before any of this.
//!
//! Layers are this host's (files under `<state dir>/build-layers/<key>`
//! naming an engine snapshot), never an account's rows or quota: at most
//! [`MAX_LAYERS`] per host, the oldest deleted first (a template's snapshot
//! made on top of one keeps the files it needs; the engine collects them
//! when nothing uses them). The key names the account, so no account
//! restores another's layer.
//!
//! Owns: the keys, the map from key to snapshot, eviction. Does not own:
//! running the steps (`builds.rs`), the captures (the engine's).

use crate::ControlPlane;
use sha2::{Digest, Sha256};
use shoal_image::dockerfile::Step;
use std::path::PathBuf;

/// Layers kept on one host.
pub(crate) const MAX_LAYERS: usize = 16;

fn dir(cp: &ControlPlane) -> PathBuf {
    cp.host.engine().state_dir().join("build-layers")
}

/// The key of every prefix: `keys[i]` covers steps `0..=i`. `placed(i)`
/// gives the (destination, content) of the files step `i` copies.
pub(crate) fn keys(
    account_id: i64,
    base_identity: &str,
    steps: &[Step],
    placed: impl Fn(usize) -> Vec<(String, Vec<u8>)>,
) -> Vec<String> {
    let mut hash = Sha256::new();
    hash.update(b"shoal-build-layer-v1\0");
    hash.update(account_id.to_le_bytes());
    hash.update(base_identity.as_bytes());
    let mut keys = Vec::with_capacity(steps.len());
    for (index, step) in steps.iter().enumerate() {
        hash.update(b"\0step\0");
        // The parsed action (its argv, build args in force, sources and
        // destination), not the line's text: a comment or a reflowed line
        // does not change it.
        hash.update(format!("{:?}", step.action).as_bytes());
        for (dest, bytes) in placed(index) {
            hash.update(dest.as_bytes());
            hash.update(b"\0");
            hash.update(Sha256::digest(&bytes));
        }
        keys.push(format!("{:x}", hash.clone().finalize()));
    }
    keys
}

/// The deepest cached prefix: how many steps it covers and its snapshot.
pub(crate) fn deepest(cp: &ControlPlane, keys: &[String]) -> Option<(usize, String)> {
    let dir = dir(cp);
    keys.iter().enumerate().rev().find_map(|(index, key)| {
        let snapshot = std::fs::read_to_string(dir.join(key)).ok()?;
        let snapshot = snapshot.trim().to_owned();
        cp.host.engine().snapshot_manifest(&snapshot).ok()?;
        // Used now: the last to be evicted.
        let _ = std::fs::File::options()
            .append(true)
            .open(dir.join(key))
            .and_then(|f| f.set_modified(std::time::SystemTime::now()));
        Some((index + 1, snapshot))
    })
}

/// Captures `sandbox` (it keeps running) as the layer `key`, unless one is
/// there already; then evicts the oldest past [`MAX_LAYERS`]. A failure
/// costs a later build its reuse, never this build.
pub(crate) async fn checkpoint(cp: &ControlPlane, sandbox: &str, key: &str) {
    let dir = dir(cp);
    let path = dir.join(key);
    if path.exists() {
        return;
    }
    let snapshot = match cp.host.snapshot(sandbox).await {
        Ok(snapshot) => snapshot,
        Err(e) => {
            tracing::warn!(sandbox, error = %e, "capturing a build layer");
            return;
        }
    };
    let written = std::fs::create_dir_all(&dir).and_then(|()| {
        let tmp = dir.join(format!("{key}.tmp"));
        std::fs::write(&tmp, &snapshot)?;
        std::fs::rename(&tmp, &path)
    });
    if let Err(e) = written {
        tracing::warn!(error = %e, "recording a build layer");
        let _ = cp.host.delete_snapshot(&snapshot).await;
        return;
    }
    evict(cp).await;
}

async fn evict(cp: &ControlPlane) {
    let mut layers: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(dir(cp))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().ends_with(".tmp"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    if layers.len() <= MAX_LAYERS {
        return;
    }
    layers.sort();
    let excess = layers.len() - MAX_LAYERS;
    for (_, path) in layers.into_iter().take(excess) {
        if let Ok(snapshot) = std::fs::read_to_string(&path) {
            if let Err(e) = cp.host.delete_snapshot(snapshot.trim()).await {
                tracing::debug!(error = %e, "evicting a build layer");
            }
        }
        let _ = std::fs::remove_file(&path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_image::dockerfile;

    fn steps(text: &str) -> Vec<Step> {
        dockerfile::parse(text).unwrap().steps
    }

    #[test]
    fn a_prefix_keeps_its_keys_and_a_change_changes_every_later_one() {
        let none = |_| Vec::new();
        let a = keys(1, "base", &steps("FROM base\nRUN one\nRUN two\n"), none);
        let b = keys(
            1,
            "base",
            &steps("FROM base\n# a comment\nRUN one\nRUN three\n"),
            none,
        );
        assert_eq!(a.len(), 2);
        assert_eq!(a[0], b[0], "an unchanged first step shares its key");
        assert_ne!(a[1], b[1]);
        assert_ne!(
            a[0],
            keys(2, "base", &steps("FROM base\nRUN one\n"), none)[0],
            "another account"
        );
        assert_ne!(
            a[0],
            keys(1, "base:2:1024", &steps("FROM base\nRUN one\n"), none)[0],
            "another base or size"
        );
        let copied = |content: &'static [u8]| move |_| vec![("/a".to_owned(), content.to_vec())];
        let c1 = keys(1, "base", &steps("FROM base\nCOPY a /a\n"), copied(b"1"));
        let c2 = keys(1, "base", &steps("FROM base\nCOPY a /a\n"), copied(b"2"));
        assert_ne!(c1[0], c2[0], "a copied file's content is in the key");
    }
}
