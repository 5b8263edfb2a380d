//! `shoal template build -f`, `template list` and `template rm` against an
//! API: an account's own templates, built on the server from a Dockerfile.
//!
//! Owns: reading a Dockerfile and its build context from disk (bounded as
//! the server bounds them, so an oversized context fails here, before the
//! upload), sending them as the SDK does, following the build's log with a
//! progress display, and the listing's columns.
//! May not: build anything itself (the server's builder sandbox does), or
//! touch the first-party bakes (`template build` without `-f` does that).

use anyhow::{bail, Context as _, Result};
use futures::StreamExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::slurm::api::Api;
use crate::slurm::config::Config;

/// The server's limits on a build context (SECURITY.md), checked here first.
const MAX_CONTEXT_BYTES: u64 = 50 << 20;
const MAX_CONTEXT_FILES: usize = 10_000;
/// How long the CLI follows a build before giving up on it (the build goes
/// on; `shoal template list` shows how it ended).
const FOLLOW_LIMIT: Duration = Duration::from_secs(3 * 3600);
/// 50 MiB at well under a megabit still fits.
const UPLOAD_LIMIT: Duration = Duration::from_secs(15 * 60);

/// What `shoal template build -f` was given.
pub struct RemoteBuildArgs {
    pub file: PathBuf,
    /// The Dockerfile's directory when not given.
    pub context: Option<PathBuf>,
    /// Print the build's id and return at once instead of following it.
    pub detach: bool,
}

/// The files of a build context, by path relative to its root, skipping
/// what `.dockerignore` names (whole paths or `dir/` prefixes; `#` comments).
fn context_files(root: &Path) -> Result<Vec<(String, PathBuf)>> {
    let walk = crate::tree::Walk {
        ignore_file: ".dockerignore",
        always_skip: &[],
        max_files: MAX_CONTEXT_FILES,
        max_bytes: MAX_CONTEXT_BYTES,
    };
    match walk.files(root) {
        Ok(files) => Ok(files.into_iter().map(|f| (f.rel, f.path)).collect()),
        Err(crate::tree::WalkError::TooManyBytes(_)) => bail!(
            "the build context {} is over 50 MiB (name what the build does not need in \
             .dockerignore)",
            root.display()
        ),
        Err(crate::tree::WalkError::TooManyFiles(n)) => {
            bail!("the build context {} holds over {n} files", root.display())
        }
        Err(crate::tree::WalkError::Io(e)) => Err(e),
    }
}

pub async fn build(name: &str, args: &RemoteBuildArgs) -> Result<std::process::ExitCode> {
    let config = Config::load()?;
    let api = Api::new(&config)?;
    let dockerfile = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let root = match &args.context {
        Some(dir) => dir.clone(),
        None => args
            .file
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(".")),
    };
    let files = context_files(&root)?;
    // Names as they are (`bin/tool`), as Python's requests sends them:
    // reqwest's default percent-encodes them into `name*=`, which the
    // server's multipart reader does not take as the part's name.
    let mut form = reqwest::multipart::Form::new()
        .percent_encode_noop()
        .text("name", name.to_owned())
        .text("dockerfile", dockerfile);
    for (rel, path) in &files {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        form = form.part(
            rel.clone(),
            reqwest::multipart::Part::bytes(bytes).file_name(rel.clone()),
        );
    }
    let build = api
        .send(
            api.request(reqwest::Method::POST, "/v1/templates/build")
                .timeout(UPLOAD_LIMIT)
                .multipart(form),
        )
        .await?;
    let id = build["id"]
        .as_str()
        .context("the API answered no build id")?
        .to_owned();
    if args.detach {
        println!("{id}");
        return Ok(std::process::ExitCode::SUCCESS);
    }
    let progress = indicatif::ProgressBar::new_spinner();
    progress.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {elapsed:>4} {msg}")
            .expect("a valid template"),
    );
    progress.enable_steady_tick(Duration::from_millis(120));
    progress.set_message(format!("{name}: {id} queued"));
    let followed = tokio::time::timeout(FOLLOW_LIMIT, follow_log(&api, &id, &progress)).await;
    progress.finish_and_clear();
    if followed.is_err() {
        bail!("stopped following {id} after {FOLLOW_LIMIT:?}; it goes on on the server");
    }
    followed.expect("checked")?;
    let done = api
        .call(
            reqwest::Method::GET,
            &format!("/v1/templates/builds/{id}"),
            None,
        )
        .await?;
    match done["status"].as_str() {
        Some("done") => {
            let hit = if done["cache_hit"].as_bool() == Some(true) {
                ", unchanged since an earlier build"
            } else {
                ""
            };
            println!(
                "{name}: ready (build {id}, snapshot {}{hit})",
                done["snapshot_id"].as_str().unwrap_or("?")
            );
            Ok(std::process::ExitCode::SUCCESS)
        }
        status => {
            eprintln!(
                "{name}: build {id} {}: {}",
                status.unwrap_or("ended"),
                done["error"].as_str().unwrap_or("no reason given")
            );
            Ok(std::process::ExitCode::FAILURE)
        }
    }
}

/// Prints the build's log lines above the spinner until the server ends it.
async fn follow_log(api: &Api, id: &str, progress: &indicatif::ProgressBar) -> Result<()> {
    let response = api
        .open(
            api.request(
                reqwest::Method::GET,
                &format!("/v1/templates/builds/{id}/logs?follow=1"),
            )
            .timeout(FOLLOW_LIMIT),
        )
        .await?;
    let mut body = response.bytes_stream();
    let mut pending: Vec<u8> = Vec::new();
    while let Some(chunk) = body.next().await {
        pending.extend_from_slice(&chunk.context("reading the build's log")?);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim_end_matches(['\r', '\n']).strip_prefix("data:") else {
                continue;
            };
            let data = data.strip_prefix(' ').unwrap_or(data);
            if data == "end" {
                return Ok(());
            }
            if data.starts_with("Step ") {
                progress.set_message(data.to_owned());
            }
            // Piped (no terminal, so no spinner): the lines as they are.
            if progress.is_hidden() {
                eprintln!("{data}");
            } else {
                progress.println(data);
            }
        }
        // A line longer than the server sends is not a log line.
        if pending.len() > 64 * 1024 {
            pending.clear();
        }
    }
    Ok(())
}

pub async fn list() -> Result<std::process::ExitCode> {
    let api = Api::new(&Config::load()?)?;
    let templates = api.templates().await?;
    println!(
        "{:<24} {:>4} {:>7}  {:<9} {:<18} SNAPSHOT",
        "NAME", "CPUS", "MEM_MB", "OWNER", "BASE"
    );
    for t in templates {
        let text = |key: &str| t[key].as_str().unwrap_or("-").to_owned();
        let owner = if t["is_global"].as_bool().unwrap_or(true) {
            "all"
        } else {
            "account"
        };
        println!(
            "{:<24} {:>4} {:>7}  {:<9} {:<18} {}",
            text("name"),
            t["cpu"].as_u64().unwrap_or(0),
            t["memory_mb"].as_u64().unwrap_or(0),
            owner,
            text("base"),
            t["meta"]["snapshot_id"].as_str().unwrap_or("-"),
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}

pub async fn remove(names: &[String]) -> Result<std::process::ExitCode> {
    let api = Api::new(&Config::load()?)?;
    let mut code = std::process::ExitCode::SUCCESS;
    for name in names {
        match api
            .call(
                reqwest::Method::DELETE,
                &format!("/v1/templates/{name}"),
                None,
            )
            .await
        {
            Ok(_) => println!("{name}: deleted"),
            Err(e) => {
                eprintln!("{name}: {e}");
                code = std::process::ExitCode::FAILURE;
            }
        }
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_context_skips_what_dockerignore_names_and_links() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("data/raw")).unwrap();
        std::fs::create_dir_all(root.join(".git")).unwrap();
        std::fs::write(root.join("Dockerfile"), "FROM base\n").unwrap();
        std::fs::write(root.join("data/a.txt"), "a").unwrap();
        std::fs::write(root.join("data/raw/big.bin"), "b").unwrap();
        std::fs::write(root.join(".git/HEAD"), "c").unwrap();
        std::fs::write(root.join("notes.log"), "d").unwrap();
        std::fs::write(
            root.join(".dockerignore"),
            "# not needed\n.git\ndata/raw/\n*.log\n",
        )
        .unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("passwd")).unwrap();
        let names: Vec<String> = context_files(root)
            .unwrap()
            .into_iter()
            .map(|(rel, _)| rel)
            .collect();
        assert_eq!(names, [".dockerignore", "Dockerfile", "data/a.txt"]);
    }

    #[test]
    fn an_oversized_context_fails_before_the_upload() {
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::File::create(dir.path().join("blob")).unwrap();
        file.set_len(MAX_CONTEXT_BYTES + 1).unwrap();
        let error = context_files(dir.path()).unwrap_err().to_string();
        assert!(error.contains("over 50 MiB"), "{error}");
    }
}
