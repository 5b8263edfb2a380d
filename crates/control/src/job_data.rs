//! A sweep cell's data path, for the runner (issue 22): the job's inputs
//! written into the sandbox from the account's blobs, the output spooled
//! to the database while the command runs (so a follower sees it grow),
//! and the files the task made or changed under `results_under` kept as
//! blobs when it ends.
//!
//! Everything read here comes from the guest and is bounded: the walk of a
//! directory tree (entries, depth), each result file and a task's total,
//! each chunk's wait, the spool per stream. May not: decide a cell's
//! outcome (the runner's) or touch another account's blobs.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};
use shoal_proto::client::{AgentClient, AgentError};
use shoal_proto::ErrorKind;
use shoal_store::{Claim, DataPath, InputFile, Store, BLOB_CHUNK};
use tokio::io::AsyncWriteExt as _;

use crate::blobs::{BlobRefusal, BlobWriter, MAX_ACCOUNT_BLOB_BYTES, MAX_BLOB_BYTES};

/// A task's result files at most, in number and in bytes.
pub const MAX_RESULT_FILES: usize = 10_000;
pub const MAX_RESULT_BYTES: u64 = 4 << 30;
/// Entries a walk of the result directories visits at most, and how deep.
const MAX_TREE_ENTRIES: usize = 100_000;
const MAX_TREE_DEPTH: usize = 32;
/// The longest a guest may keep one chunk of a result file waiting.
const CHUNK_STALL: Duration = Duration::from_secs(60);
/// What the spool keeps of one stream of one attempt at most; past it
/// the output goes on in the cell's tail only.
pub const MAX_SPOOLED: u64 = 1 << 30;
/// How often the spool writes what the command printed.
pub const SPOOL_EVERY: Duration = Duration::from_millis(500);
/// Written at once when this much is waiting.
const SPOOL_EAGER: usize = 256 << 10;

/// Why inputs could not be written.
pub enum InputError {
    Agent(AgentError),
    /// The job's data is unreadable (a blob gone, the database down).
    Data(String),
}

impl From<AgentError> for InputError {
    fn from(e: AgentError) -> Self {
        InputError::Agent(e)
    }
}

/// Writes one input file from its blob, without write permission.
pub async fn write_input(
    store: &Store,
    agent: &AgentClient,
    account_id: i64,
    input: &InputFile,
) -> Result<(), InputError> {
    let (mut pipe, reader) = tokio::io::duplex(BLOB_CHUNK);
    let feed = async move {
        let mut seq = 0;
        let mut fed = 0u64;
        loop {
            match store.blob_chunk(account_id, &input.digest, seq).await {
                Ok(Some(data)) => {
                    fed += data.len() as u64;
                    // The guest stopped reading: its answer says why.
                    if pipe.write_all(&data).await.is_err() {
                        return Ok(fed);
                    }
                    seq += 1;
                }
                Ok(None) => return Ok(fed),
                Err(e) => return Err(format!("input {}: reading it: {e}", input.path)),
            }
        }
    };
    let (fed, written) = tokio::join!(
        feed,
        agent.write_file(&input.path, Some(input.mode & 0o555), reader)
    );
    let fed = fed.map_err(InputError::Data)?;
    let written = written?;
    if fed != input.size || written != input.size {
        return Err(InputError::Data(format!(
            "input {}: {written} of {} bytes written (is its blob gone?)",
            input.path, input.size
        )));
    }
    Ok(())
}

/// The guest's answer for a path that is not there (or not a directory).
pub fn is_missing(e: &AgentError) -> bool {
    matches!(
        e.guest_kind(),
        Some(ErrorKind::NotFound | ErrorKind::NotADirectory)
    )
}

/// Size and modification time of every regular file under `dirs`.
pub type TreeState = BTreeMap<String, (u64, i64)>;

/// The regular files under `dirs` (not following links), within the walk's
/// bounds: a tree past them is cut, with a note.
pub async fn tree_state(agent: &AgentClient, dirs: &[String]) -> (TreeState, Option<String>) {
    let mut files = TreeState::new();
    let mut note = None;
    let mut visited = 0usize;
    let mut pending: Vec<(String, usize)> = dirs.iter().map(|d| (d.clone(), 0)).collect();
    while let Some((dir, depth)) = pending.pop() {
        let entries = match agent.list_dir(&dir).await {
            Ok(entries) => entries,
            Err(e) if is_missing(&e) => continue,
            Err(e) => {
                note = Some(format!("listing {dir}: {e}"));
                continue;
            }
        };
        for entry in entries {
            visited += 1;
            if visited > MAX_TREE_ENTRIES {
                return (
                    files,
                    Some(format!(
                        "more than {MAX_TREE_ENTRIES} entries; the rest not looked at"
                    )),
                );
            }
            let path = format!("{}/{}", dir.trim_end_matches('/'), entry.name);
            if entry.is_symlink {
                continue;
            }
            if entry.is_dir {
                if depth + 1 < MAX_TREE_DEPTH {
                    pending.push((path, depth + 1));
                }
            } else if entry.mode & 0o170000 == 0o100000 {
                files.insert(path, (entry.size, entry.mtime));
            }
        }
    }
    (files, note)
}

/// Keeps as blobs the files under the job's `results_under` that are new
/// or changed since `before`. Returns path -> `{"blob", "size"}` and a note
/// of what was left out.
pub async fn collect_results(
    store: &Store,
    agent: &AgentClient,
    account_id: i64,
    data: &DataPath,
    before: &TreeState,
) -> (BTreeMap<String, Value>, Option<String>) {
    let mut kept = BTreeMap::new();
    let mut notes = Vec::new();
    let (after, walk_note) = tree_state(agent, &data.results_under).await;
    notes.extend(walk_note);
    let used = store.account_blob_bytes(account_id).await.unwrap_or(0);
    let mut room = MAX_ACCOUNT_BLOB_BYTES
        .saturating_sub(used)
        .min(MAX_RESULT_BYTES);
    for (path, (size, mtime)) in after {
        if before.get(&path) == Some(&(size, mtime)) {
            continue;
        }
        if kept.len() >= MAX_RESULT_FILES {
            notes.push(format!(
                "more than {MAX_RESULT_FILES} result files; the rest not kept"
            ));
            break;
        }
        if size > MAX_BLOB_BYTES {
            notes.push(format!(
                "{path}: larger than {MAX_BLOB_BYTES} bytes, not kept"
            ));
            continue;
        }
        if size > room {
            notes.push(format!(
                "{path}: past the task's {MAX_RESULT_BYTES} bytes or the account's stored \
                 job data ({MAX_ACCOUNT_BLOB_BYTES} bytes), not kept"
            ));
            continue;
        }
        // The size is the guest's word: the writer holds the read to it.
        match keep_file(store, agent, account_id, &path, size.min(room)).await {
            Ok((digest, size)) => {
                room -= size;
                kept.insert(path, json!({ "blob": digest, "size": size }));
            }
            Err(e) => notes.push(format!("{path}: {e}")),
        }
    }
    let note = (!notes.is_empty()).then(|| format!("results: {}", notes.join("; ")));
    (kept, note)
}

async fn keep_file(
    store: &Store,
    agent: &AgentClient,
    account_id: i64,
    path: &str,
    limit: u64,
) -> Result<(String, u64), String> {
    let mut download = agent.read_file(path).await.map_err(|e| e.to_string())?;
    let mut writer = BlobWriter::new(store.clone(), account_id, limit);
    let outcome = async {
        loop {
            let chunk = tokio::time::timeout(CHUNK_STALL, download.next_chunk())
                .await
                .map_err(|_| format!("the guest sent nothing for {CHUNK_STALL:?}"))?
                .map_err(|e| e.to_string())?;
            let Some(chunk) = chunk else {
                return Ok(());
            };
            writer.write(&chunk).await.map_err(|e| match e {
                BlobRefusal::TooLarge(_) => "grew past its size while read".to_owned(),
                other => other.to_string(),
            })?;
        }
    }
    .await;
    if let Err(e) = outcome {
        writer.discard().await;
        return Err(e);
    }
    let size = writer.size();
    let digest = writer.commit().await.map_err(|e| e.to_string())?;
    Ok((digest, size))
}

/// What the command printed since the last write to the database, in
/// order, and how much of each stream was written.
pub struct Spool {
    pending: Vec<(&'static str, Vec<u8>)>,
    pending_bytes: usize,
    next_seq: u64,
    spooled: [u64; 2],
    /// Past [`MAX_SPOOLED`] in a stream (or the database refused).
    pub cut: bool,
}

impl Spool {
    pub fn new() -> Spool {
        Spool {
            pending: Vec::new(),
            pending_bytes: 0,
            next_seq: 0,
            spooled: [0, 0],
            cut: false,
        }
    }

    /// Takes what a stream printed; true when it is time to write.
    pub fn push(&mut self, stream: &'static str, bytes: &[u8]) -> bool {
        let which = usize::from(stream == "stderr");
        let room = MAX_SPOOLED.saturating_sub(self.spooled[which]);
        let take = bytes.len().min(usize::try_from(room).unwrap_or(usize::MAX));
        if take < bytes.len() {
            self.cut = true;
        }
        if take == 0 {
            return false;
        }
        self.spooled[which] += take as u64;
        match self.pending.last_mut() {
            Some((s, data)) if *s == stream => data.extend_from_slice(&bytes[..take]),
            _ => self.pending.push((stream, bytes[..take].to_vec())),
        }
        self.pending_bytes += take;
        self.pending_bytes >= SPOOL_EAGER
    }

    /// Writes what is pending as the claim's attempt's next flushes.
    pub async fn write(&mut self, store: &Store, claim: &Claim) {
        for (stream, data) in std::mem::take(&mut self.pending) {
            if let Err(e) = store
                .append_cell_output(
                    &claim.sweep_id,
                    claim.idx,
                    claim.epoch,
                    self.next_seq,
                    stream,
                    &data,
                )
                .await
            {
                tracing::warn!(error = %e, sweep = claim.sweep_id, cell = claim.idx, "spooling output");
                self.cut = true;
            }
            self.next_seq += 1;
        }
        self.pending_bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spool_keeps_order_merges_runs_and_stops_at_its_bound() {
        let mut spool = Spool::new();
        assert!(!spool.push("stdout", b"a"));
        spool.push("stdout", b"b");
        spool.push("stderr", b"c");
        spool.push("stdout", b"d");
        let got: Vec<(&str, &[u8])> = spool
            .pending
            .iter()
            .map(|(s, d)| (*s, d.as_slice()))
            .collect();
        assert_eq!(
            got,
            [("stdout", &b"ab"[..]), ("stderr", b"c"), ("stdout", b"d")]
        );
        assert!(spool.push("stderr", &vec![0; SPOOL_EAGER]));
        spool.spooled[0] = MAX_SPOOLED - 1;
        spool.push("stdout", b"xyz");
        assert!(spool.cut);
        assert_eq!(spool.spooled[0], MAX_SPOOLED);
    }
}
