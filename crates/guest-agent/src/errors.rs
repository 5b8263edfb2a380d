//! Turns OS errors into the protocol's `Error` answers: a kind the host can
//! map to a status, and a message that names the path involved.
//!
//! Does not own: deciding when a call fails; callers bring the error.

use shoal_proto::{ErrorKind, GuestMsg};
use std::io;

/// A failed call, ready to be sent as `GuestMsg::Error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallError {
    pub kind: ErrorKind,
    pub message: String,
}

impl CallError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        CallError {
            kind,
            message: message.into(),
        }
    }

    /// Maps an OS error on `path`, e.g. "no such file or directory: /nope".
    pub fn io(err: &io::Error, path: &str) -> Self {
        let kind = match err.raw_os_error() {
            Some(errno) => kind_of_errno(errno),
            None => match err.kind() {
                io::ErrorKind::NotFound => ErrorKind::NotFound,
                io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
                io::ErrorKind::AlreadyExists => ErrorKind::AlreadyExists,
                io::ErrorKind::InvalidInput => ErrorKind::InvalidInput,
                _ => ErrorKind::Io,
            },
        };
        CallError::new(kind, format!("{}: {path}", describe(err)))
    }

    pub fn into_msg(self) -> GuestMsg {
        GuestMsg::Error {
            kind: self.kind,
            message: self.message,
        }
    }
}

pub fn kind_of_errno(errno: i32) -> ErrorKind {
    match errno {
        libc::ENOENT => ErrorKind::NotFound,
        libc::EACCES | libc::EPERM => ErrorKind::PermissionDenied,
        libc::EROFS => ErrorKind::ReadOnly,
        libc::EISDIR => ErrorKind::IsADirectory,
        libc::ENOTDIR => ErrorKind::NotADirectory,
        libc::EEXIST => ErrorKind::AlreadyExists,
        libc::ENOTEMPTY => ErrorKind::NotEmpty,
        libc::EINVAL | libc::ENAMETOOLONG => ErrorKind::InvalidInput,
        _ => ErrorKind::Io,
    }
}

/// The error's text in lower case and without Rust's "(os error N)".
fn describe(err: &io::Error) -> String {
    let text = match err.raw_os_error() {
        Some(errno) => nix::errno::Errno::from_raw(errno).desc().to_owned(),
        None => err.to_string(),
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_file_reads_naturally() {
        let err = io::Error::from_raw_os_error(libc::ENOENT);
        let mapped = CallError::io(&err, "/nope");
        assert_eq!(mapped.kind, ErrorKind::NotFound);
        assert_eq!(mapped.message, "no such file or directory: /nope");
    }

    #[test]
    fn read_only_filesystem_has_its_own_kind() {
        let err = io::Error::from_raw_os_error(libc::EROFS);
        assert_eq!(CallError::io(&err, "/x").kind, ErrorKind::ReadOnly);
    }
}
