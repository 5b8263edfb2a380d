//! The template memory file is the same for every tenant, and QEMU 7.2
//! opens it read-write even for a private map (`share=off`): a QEMU escape
//! could write what other clones read. This module checks it before every
//! restore: a content hash taken at the bake (`Manifest::memory_sha256`),
//! verified in full once per engine and file identity, and after that a
//! `stat` per restore. A write to the file moves its ctime, which no
//! unprivileged process (and every QEMU is one) can set back, so the next
//! create after any change hashes again and refuses a file that differs.
//!
//! May not: open the file for writing, or trust a manifest's hash of a file
//! it cannot read.

use crate::error::{EngineError, IoContext, Result};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// What identifies one version of a file without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl Identity {
    fn of(metadata: &std::fs::Metadata) -> Identity {
        Identity {
            dev: metadata.dev(),
            ino: metadata.ino(),
            size: metadata.size(),
            mtime_ns: i128::from(metadata.mtime()) * 1_000_000_000
                + i128::from(metadata.mtime_nsec()),
            ctime_ns: i128::from(metadata.ctime()) * 1_000_000_000
                + i128::from(metadata.ctime_nsec()),
        }
    }
}

/// Files whose content this engine has hashed, by path, with the identity
/// they had when hashed.
#[derive(Debug, Default)]
pub struct Verified {
    files: Mutex<HashMap<PathBuf, Identity>>,
}

impl Verified {
    /// Checks `path` against `expected` (a hex SHA-256 from
    /// [`memory_sha256`]); cheap when the file is unchanged since it was
    /// last verified.
    pub fn check(&self, path: &Path, expected: &str, template: &str) -> Result<()> {
        let identity = Identity::of(
            &std::fs::metadata(path).io_context(|| format!("reading {}", path.display()))?,
        );
        if self.files.lock().unwrap().get(path) == Some(&identity) {
            return Ok(());
        }
        let actual = memory_sha256(path)?;
        if actual != expected {
            tracing::error!(
                template,
                path = %path.display(),
                expected,
                actual,
                "a template's memory file changed since its bake"
            );
            return Err(EngineError::TemplateTampered {
                name: template.to_owned(),
                path: path.to_owned(),
            });
        }
        // Measured again after the hash: a change during it shows as a new
        // identity and is hashed at the next check.
        let after = Identity::of(
            &std::fs::metadata(path).io_context(|| format!("reading {}", path.display()))?,
        );
        if after == identity {
            self.files.lock().unwrap().insert(path.to_owned(), identity);
        }
        Ok(())
    }
}

/// SHA-256 over the file's pages that are not all zero, each as its offset
/// then its bytes, then the file's length: the logical content, whatever
/// its layout on disk. Memory files are sparse (most of a guest's RAM is a
/// hole), so only the data extents are read; a copy that wrote the holes
/// out as zeros hashes the same.
pub fn memory_sha256(path: &Path) -> Result<String> {
    const PAGE: usize = 4096;
    let context = || format!("hashing {}", path.display());
    let mut file = std::fs::File::open(path).io_context(context)?;
    let len = file.metadata().io_context(context)?.len();
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    while offset < len {
        let Some(data) = seek_data(&file, offset, libc::SEEK_DATA).io_context(context)? else {
            break;
        };
        // Pages are hashed whole: start the extent at its page.
        let data = data - data % PAGE as u64;
        let hole = seek_data(&file, data, libc::SEEK_HOLE)
            .io_context(context)?
            .unwrap_or(len);
        file.seek(SeekFrom::Start(data)).io_context(context)?;
        let mut at = data;
        while at < hole {
            let want = buffer
                .len()
                .min(usize::try_from(hole - at).unwrap_or(usize::MAX));
            let read = read_full(&mut file, &mut buffer[..want]).io_context(context)?;
            if read == 0 {
                break;
            }
            for (index, page) in buffer[..read].chunks(PAGE).enumerate() {
                if page.iter().any(|&b| b != 0) {
                    hasher.update((at + (index * PAGE) as u64).to_le_bytes());
                    hasher.update(page);
                }
            }
            at += read as u64;
        }
        offset = hole.max(at);
    }
    hasher.update(len.to_le_bytes());
    Ok(hex::encode(hasher.finalize()))
}

/// Reads until `buffer` is full or the file ends.
fn read_full(file: &mut std::fs::File, buffer: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buffer.len() {
        match file.read(&mut buffer[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

/// `lseek(fd, offset, whence)` for SEEK_DATA/SEEK_HOLE: `None` at ENXIO
/// (no data past `offset`).
fn seek_data(file: &std::fs::File, offset: u64, whence: i32) -> std::io::Result<Option<u64>> {
    let offset = i64::try_from(offset).map_err(std::io::Error::other)?;
    // SAFETY: lseek(2) on a descriptor the File owns; no memory is passed.
    let at = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
    if at < 0 {
        let e = std::io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    Ok(Some(at as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    fn sparse_file(dir: &Path) -> PathBuf {
        let path = dir.join("memory");
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(64 << 20).unwrap();
        file.write_all_at(b"kernel text", 4096).unwrap();
        file.write_all_at(b"page tables", 40 << 20).unwrap();
        path
    }

    #[test]
    fn a_changed_byte_is_refused_and_an_unchanged_file_is_not_hashed_twice() {
        let dir = std::env::temp_dir().join(format!("shoal-integrity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = sparse_file(&dir);
        let expected = memory_sha256(&path).unwrap();
        // The holes written out as zeros: the same content, the same hash.
        let dense = dir.join("dense");
        let mut out = std::fs::File::create(&dense).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        out.write_all(&bytes).unwrap();
        drop(out);
        assert_eq!(
            memory_sha256(&dense).unwrap(),
            expected,
            "holes or zeros: same content"
        );
        // The same bytes elsewhere are other content: offsets count.
        let moved = dir.join("moved");
        let file = std::fs::File::create(&moved).unwrap();
        file.set_len(64 << 20).unwrap();
        file.write_all_at(b"kernel text", 8192).unwrap();
        file.write_all_at(b"page tables", 40 << 20).unwrap();
        assert_ne!(memory_sha256(&moved).unwrap(), expected);

        let verified = Verified::default();
        verified.check(&path, &expected, "t").unwrap();
        assert!(verified.files.lock().unwrap().contains_key(&path));
        verified.check(&path, &expected, "t").unwrap();

        // What an escaped QEMU could do through its read-write descriptor.
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(b"X", 40 << 20).unwrap();
        drop(file);
        match verified.check(&path, &expected, "t") {
            Err(EngineError::TemplateTampered { name, .. }) => assert_eq!(name, "t"),
            other => panic!("a tampered file passed: {other:?}"),
        }
        // Data written into a hole counts too.
        let path = sparse_file(&dir);
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(b"\x01", 20 << 20).unwrap();
        assert_ne!(memory_sha256(&path).unwrap(), expected);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
