//! The files of a directory as a client sends them to the API: a build's
//! context (`.dockerignore`), a Slurm job's submit directory
//! (`.shoalignore`). Links are never followed (one could name anything on
//! this machine) and the walk stops at its bounds before anything is read.
//!
//! Owns: the ignore file's rules (whole paths, `dir/` prefixes, globs, `#`
//! comments) and the bounds. May not: read the files' contents or talk to
//! the API.

use anyhow::{Context as _, Result};
use std::path::{Path, PathBuf};

/// One regular file under the root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeFile {
    /// Relative to the root, `/`-separated.
    pub rel: String,
    pub path: PathBuf,
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
}

/// How a walk was bounded and what it skips.
pub struct Walk<'a> {
    /// The ignore file read at the root (`.dockerignore`, `.shoalignore`).
    pub ignore_file: &'a str,
    /// Always skipped (before the ignore file's rules).
    pub always_skip: &'a [&'a str],
    pub max_files: usize,
    pub max_bytes: u64,
}

/// Why a walk stopped.
#[derive(Debug, thiserror::Error)]
pub enum WalkError {
    #[error("over {0} bytes")]
    TooManyBytes(u64),
    #[error("over {0} files")]
    TooManyFiles(usize),
    #[error(transparent)]
    Io(#[from] anyhow::Error),
}

impl Walk<'_> {
    /// The regular files under `root`, sorted by relative path.
    pub fn files(&self, root: &Path) -> Result<Vec<TreeFile>, WalkError> {
        use std::os::unix::fs::PermissionsExt as _;
        let ignored: Vec<String> = std::fs::read_to_string(root.join(self.ignore_file))
            .unwrap_or_default()
            .lines()
            .map(|l| l.trim().trim_start_matches("./").trim_end_matches('/'))
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_owned)
            .chain(self.always_skip.iter().map(|s| (*s).to_owned()))
            .collect();
        let is_ignored = |rel: &str| {
            ignored.iter().any(|pattern| {
                rel == pattern
                    || rel.starts_with(&format!("{pattern}/"))
                    || glob::Pattern::new(pattern).is_ok_and(|p| p.matches(rel))
            })
        };
        let mut files = Vec::new();
        let mut total = 0u64;
        let mut pending = vec![root.to_path_buf()];
        while let Some(dir) = pending.pop() {
            let entries =
                std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?;
            for entry in entries {
                let entry = entry.with_context(|| format!("reading {}", dir.display()))?;
                let path = entry.path();
                let rel = path
                    .strip_prefix(root)
                    .expect("under the root")
                    .to_string_lossy()
                    .into_owned();
                if is_ignored(&rel) {
                    continue;
                }
                let kind = entry
                    .file_type()
                    .with_context(|| format!("reading {}", path.display()))?;
                if kind.is_dir() {
                    pending.push(path);
                } else if kind.is_file() {
                    let meta = entry
                        .metadata()
                        .with_context(|| format!("reading {}", path.display()))?;
                    total += meta.len();
                    if total > self.max_bytes {
                        return Err(WalkError::TooManyBytes(self.max_bytes));
                    }
                    files.push(TreeFile {
                        rel,
                        path,
                        size: meta.len(),
                        mode: meta.permissions().mode() & 0o7777,
                    });
                    if files.len() > self.max_files {
                        return Err(WalkError::TooManyFiles(self.max_files));
                    }
                }
            }
        }
        files.sort_by(|a, b| a.rel.cmp(&b.rel));
        Ok(files)
    }
}
