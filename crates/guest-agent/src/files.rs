//! File calls: streaming downloads and uploads, listing, stat, remove,
//! make-dir and sync. Files are streamed in chunks, never held whole.
//!
//! Does not own: routing the upload's `Data`/`End` frames (see `main`) or
//! flow-control bookkeeping (see `calls`).

use crate::calls::{Stream, Token};
use crate::errors::CallError;
use crate::Agent;
use shoal_proto::{CallId, ErrorKind, FileStat, Frame, GuestMsg, MAX_CHUNK};
use std::fs::{self, File, Metadata, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

const DEFAULT_FILE_MODE: u32 = 0o644;

/// Streams a file to the host: `FileInfo`, `Data`..., `End` (until EOF,
/// so files whose size is unknown, like those in /proc, come whole).
pub fn download(agent: &Agent, id: CallId, token: Token, path: &str, stream: &Stream) {
    let answer = |msg| agent.outbox.send_on(stream, Frame::new(id, msg));
    match open_for_download(path) {
        Err(err) => answer(err.into_msg()),
        Ok((mut file, size)) => {
            answer(GuestMsg::FileInfo { size });
            let mut buf = vec![0u8; MAX_CHUNK];
            loop {
                let budget = stream.wait_credit(MAX_CHUNK, None);
                match file.read(&mut buf[..budget]) {
                    Ok(0) => {
                        answer(GuestMsg::End);
                        break;
                    }
                    Ok(got) => {
                        stream.consume(got);
                        agent.outbox.send_on(
                            stream,
                            Frame::with_payload(id, GuestMsg::Data, buf[..got].to_vec()),
                        );
                    }
                    Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                    Err(err) => {
                        answer(CallError::io(&err, path).into_msg());
                        break;
                    }
                }
                if stream.is_cancelled() {
                    break;
                }
            }
        }
    }
    agent.calls.finish(id, token);
}

fn open_for_download(path: &str) -> Result<(File, u64), CallError> {
    let file = File::open(path).map_err(|e| CallError::io(&e, path))?;
    let meta = file.metadata().map_err(|e| CallError::io(&e, path))?;
    if meta.is_dir() {
        return Err(CallError::new(
            ErrorKind::IsADirectory,
            format!("is a directory: {path}"),
        ));
    }
    Ok((file, meta.len()))
}

/// Creates or truncates the target of an upload, creating its parents.
pub fn open_for_upload(path: &str, mode: Option<u32>) -> Result<File, CallError> {
    let open = || {
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode.unwrap_or(DEFAULT_FILE_MODE))
            // A FIFO would block the agent's reader until someone opened
            // it; this makes that an error (ENXIO) instead.
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
    };
    let file = match open() {
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            if let Some(parent) = Path::new(path).parent() {
                create_dirs(parent, path)?;
            }
            open()
        }
        other => other,
    }
    .map_err(|e| CallError::io(&e, path))?;
    clear_nonblocking(&file);
    Ok(file)
}

fn clear_nonblocking(file: &File) {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL/F_SETFL on an fd we own take no pointers.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
}

/// `create_dir_all`, reporting a file in the way as "not a directory"
/// (std reports it as "file exists", which misleads).
fn create_dirs(dir: &Path, reported_path: &str) -> Result<(), CallError> {
    match fs::create_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => Err(CallError::new(
            ErrorKind::NotADirectory,
            format!("not a directory: {reported_path}"),
        )),
        Err(err) => Err(CallError::io(&err, reported_path)),
    }
}

pub fn make_dir(path: &str) -> Result<(), CallError> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => return Ok(()),
        Ok(_) => {
            return Err(CallError::new(
                ErrorKind::AlreadyExists,
                format!("file exists: {path}"),
            ))
        }
        Err(_) => {}
    }
    create_dirs(Path::new(path), path)
}

pub fn stat(path: &str) -> Result<FileStat, CallError> {
    let meta = fs::symlink_metadata(path).map_err(|e| CallError::io(&e, path))?;
    let name = Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.to_owned());
    Ok(file_stat(name, path.to_owned(), &meta))
}

fn file_stat(name: String, path: String, meta: &Metadata) -> FileStat {
    FileStat {
        name,
        path,
        is_dir: meta.is_dir(),
        is_symlink: meta.file_type().is_symlink(),
        size: meta.len(),
        mode: meta.permissions().mode(),
        mtime: meta.mtime(),
    }
}

pub fn list_dir(path: &str) -> Result<Vec<FileStat>, CallError> {
    let dir = fs::read_dir(path).map_err(|e| CallError::io(&e, path))?;
    let mut entries = Vec::new();
    for entry in dir {
        let entry = entry.map_err(|e| CallError::io(&e, path))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let full = entry.path().to_string_lossy().into_owned();
        // An entry removed while listing is simply not listed.
        if let Ok(meta) = fs::symlink_metadata(entry.path()) {
            entries.push(file_stat(name, full, &meta));
        }
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(entries)
}

pub fn remove(path: &str, recursive: bool) -> Result<(), CallError> {
    let meta = fs::symlink_metadata(path).map_err(|e| CallError::io(&e, path))?;
    let result = if !meta.is_dir() {
        fs::remove_file(path)
    } else if recursive {
        fs::remove_dir_all(path)
    } else {
        fs::remove_dir(path)
    };
    result.map_err(|e| CallError::io(&e, path))
}

pub fn sync() {
    // SAFETY: sync takes no arguments and cannot fail.
    unsafe { libc::sync() };
}
