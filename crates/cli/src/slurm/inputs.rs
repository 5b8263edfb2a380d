//! A job's inputs (issue 22's data path): the submit directory, and the
//! other paths named with `--input` or `#SHOAL --input`, sent to the API
//! by content so that every task finds them at the same absolute path as
//! here. A resubmit uploads only the files whose content the API lacks.
//!
//! Owns: which files travel (`.shoalignore` at a directory's root, `.git`
//! never, links never), their bounds (the API's: 20,000 files, 2 GiB),
//! their digests, and the uploads. May not: submit the job (`sbatch.rs`)
//! or write anything on this machine.

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};
use std::path::{Path, PathBuf};

use super::api::Api;
use crate::tree::{TreeFile, Walk, WalkError};

/// The API's bounds on a job's inputs (`control/src/sweeps.rs`).
pub const MAX_INPUT_FILES: usize = 20_000;
pub const MAX_INPUT_BYTES: u64 = 2 << 30;
/// What never travels: a repository's history is not an input.
const ALWAYS_SKIP: &[&str] = &[".git"];

/// One file a job's tasks will read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Input {
    /// Absolute, here and in the sandbox.
    pub path: String,
    pub local: PathBuf,
    pub size: u64,
    pub mode: u32,
}

/// The words of the `#SHOAL` lines of the script's header (its leading
/// comments and blank lines), in order: Shoal's own options.
pub fn shoal_words(script: &str) -> Vec<String> {
    let mut words = Vec::new();
    for line in script.lines().skip(1) {
        let line = line.trim();
        if !line.is_empty() && !line.starts_with('#') {
            break;
        }
        if let Some(rest) = line.strip_prefix("#SHOAL") {
            words.extend(rest.split_whitespace().map(str::to_owned));
        }
    }
    words
}

/// The value of `--name VALUE` / `--name=VALUE` among `words`, each time
/// it is given; `--name` alone gives `""`.
pub fn option_values(words: &[String], name: &str) -> Vec<String> {
    let mut values = Vec::new();
    let flag = format!("--{name}");
    let mut i = 0;
    while i < words.len() {
        if let Some(v) = words[i].strip_prefix(&format!("{flag}=")) {
            values.push(v.to_owned());
        } else if words[i] == flag {
            match words.get(i + 1).filter(|w| !w.starts_with("--")) {
                Some(v) => {
                    values.push(v.clone());
                    i += 1;
                }
                None => values.push(String::new()),
            }
        }
        i += 1;
    }
    values
}

/// The paths of `#SHOAL --input PATH` (or `--input=PATH`) lines of the
/// script's header.
pub fn directive_inputs(script: &str) -> Vec<String> {
    option_values(&shoal_words(script), "input")
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect()
}

/// The files under `dir` (its `.shoalignore` honoured), counted against
/// what is left of the bounds.
fn walk(dir: &Path, files_left: usize, bytes_left: u64) -> Result<Vec<TreeFile>> {
    let walk = Walk {
        ignore_file: ".shoalignore",
        always_skip: ALWAYS_SKIP,
        max_files: files_left,
        max_bytes: bytes_left,
    };
    walk.files(dir).map_err(|e| match e {
        WalkError::TooManyBytes(_) | WalkError::TooManyFiles(_) => anyhow::anyhow!(
            "the job's inputs are over {MAX_INPUT_FILES} files or {} GiB (under {}): name \
             what the job does not read in {}/.shoalignore",
            MAX_INPUT_BYTES >> 30,
            dir.display(),
            dir.display()
        ),
        WalkError::Io(e) => e,
    })
}

/// Every input of a job submitted from `submit_dir`, with `extra` paths
/// (files or directories; relative ones from the submit directory).
pub fn gather(submit_dir: &Path, extra: &[String]) -> Result<Vec<Input>> {
    let mut inputs: Vec<Input> = Vec::new();
    let add = |inputs: &mut Vec<Input>, root: &Path, files: Vec<TreeFile>| -> Result<()> {
        for f in files {
            // A lone file is its own root.
            let path = if f.rel.is_empty() {
                root.to_path_buf()
            } else {
                root.join(&f.rel)
            };
            let Some(text) = path.to_str() else {
                bail!(
                    "{} is not UTF-8: rename it or name it in .shoalignore",
                    path.display()
                );
            };
            if inputs.iter().any(|i| i.path == text) {
                continue;
            }
            inputs.push(Input {
                path: text.to_owned(),
                local: f.path,
                size: f.size,
                mode: f.mode,
            });
        }
        Ok(())
    };
    let files = walk(submit_dir, MAX_INPUT_FILES, MAX_INPUT_BYTES)?;
    add(&mut inputs, submit_dir, files)?;
    for path in extra {
        // Resolved (`..`, links): the sandbox gets it at its real path.
        let path = std::fs::canonicalize(submit_dir.join(path))
            .with_context(|| format!("--input {path}"))?;
        let meta =
            std::fs::metadata(&path).with_context(|| format!("--input {}", path.display()))?;
        let total: u64 = inputs.iter().map(|i| i.size).sum();
        let files_left = MAX_INPUT_FILES.saturating_sub(inputs.len());
        let bytes_left = MAX_INPUT_BYTES.saturating_sub(total);
        if meta.is_dir() {
            let files = walk(&path, files_left, bytes_left)?;
            add(&mut inputs, &path, files)?;
        } else if meta.is_file() {
            use std::os::unix::fs::PermissionsExt as _;
            if files_left == 0 || meta.len() > bytes_left {
                bail!(
                    "--input {}: the job's inputs would pass {MAX_INPUT_FILES} files or {} GiB",
                    path.display(),
                    MAX_INPUT_BYTES >> 30
                );
            }
            let file = TreeFile {
                rel: String::new(),
                path: path.clone(),
                size: meta.len(),
                mode: meta.permissions().mode() & 0o7777,
            };
            add(&mut inputs, &path, vec![file])?;
        } else {
            bail!("--input {}: not a file or a directory", path.display());
        }
    }
    Ok(inputs)
}

/// The SHA-256 of a file, as lowercase hex.
fn digest_of(path: &Path) -> Result<String> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).with_context(|| format!("reading {}", path.display()))?;
    Ok(hex::encode(hasher.finalize()))
}

/// What an upload did.
pub struct Sent {
    /// The sweep's `inputs`.
    pub inputs: Vec<Value>,
    pub files: usize,
    pub bytes: u64,
    /// Files the API had already (by content).
    pub unchanged: usize,
}

/// Uploads the inputs the API lacks and returns the sweep's `inputs`.
pub async fn send(api: &Api, inputs: &[Input]) -> Result<Sent> {
    let mut described = Vec::with_capacity(inputs.len());
    let mut digests = Vec::with_capacity(inputs.len());
    for input in inputs {
        let local = input.local.clone();
        let digest = tokio::task::spawn_blocking(move || digest_of(&local)).await??;
        described.push(json!({
            "path": input.path,
            "digest": digest,
            "size": input.size,
            "mode": input.mode,
        }));
        digests.push(digest);
    }
    let missing = api.missing_blobs(&digests).await?;
    let mut sent = Sent {
        inputs: described,
        files: 0,
        bytes: 0,
        unchanged: 0,
    };
    let mut uploaded = std::collections::BTreeSet::new();
    for (input, digest) in inputs.iter().zip(&digests) {
        if missing.binary_search(digest).is_err() {
            sent.unchanged += 1;
            continue;
        }
        if !uploaded.insert(digest.clone()) {
            continue;
        }
        api.put_blob(digest, &input.local)
            .await
            .with_context(|| format!("uploading {}", input.path))?;
        sent.files += 1;
        sent.bytes += input.size;
    }
    Ok(sent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shoal_directives_name_inputs_in_the_header_only() {
        let script = "#!/bin/bash\n#SBATCH -J x\n#SHOAL --input ../shared/ref.fa\n\
                      #SHOAL --input=/data/genome --other\n\necho hi\n#SHOAL --input late\n";
        assert_eq!(
            directive_inputs(script),
            ["../shared/ref.fa", "/data/genome"]
        );
    }

    #[test]
    fn the_submit_dir_travels_without_git_links_or_what_shoalignore_names() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("data/raw")).unwrap();
        std::fs::create_dir_all(root.join(".git")).unwrap();
        std::fs::write(root.join("samples.txt"), "a\nb\n").unwrap();
        std::fs::write(root.join("data/x.csv"), "1,2").unwrap();
        std::fs::write(root.join("data/raw/huge.bin"), "b").unwrap();
        std::fs::write(root.join(".git/HEAD"), "c").unwrap();
        std::fs::write(root.join(".shoalignore"), "data/raw/\n").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("passwd")).unwrap();
        let other = tempfile::tempdir().unwrap();
        std::fs::write(other.path().join("ref.fa"), ">chr1\n").unwrap();
        let extra = [other.path().join("ref.fa").to_str().unwrap().to_owned()];
        let inputs = gather(root, &extra).unwrap();
        let paths: Vec<String> = inputs.iter().map(|i| i.path.clone()).collect();
        let at = |rel: &str| root.join(rel).to_str().unwrap().to_owned();
        assert_eq!(
            paths,
            [
                at(".shoalignore"),
                at("data/x.csv"),
                at("samples.txt"),
                extra[0].clone()
            ]
        );
        assert_eq!(inputs[2].size, 4);
        assert!(gather(root, &["missing".to_owned()]).is_err());
    }

    #[test]
    fn the_digest_is_sha256_hex() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "abc").unwrap();
        assert_eq!(
            digest_of(&file).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
