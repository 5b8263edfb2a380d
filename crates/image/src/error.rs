//! The one error type of `shoal-image`.
//!
//! Every failure of an external command names the command and carries the
//! tail of what it wrote to stderr, because the builds shell out to apt,
//! debootstrap and mke2fs and their own words are the only useful diagnosis.

use std::path::PathBuf;

/// Everything that can go wrong while building template artifacts.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A filesystem operation failed; `context` says which and on what path.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// An external command could not be started at all (usually: not installed).
    #[error("could not start `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },

    /// An external command ran and failed.
    #[error("`{command}` failed ({status}); stderr tail:\n{stderr_tail}")]
    Command {
        command: String,
        status: String,
        stderr_tail: String,
    },

    /// The Debian kernel package could not be resolved or does not hold what
    /// a guest needs.
    #[error("kernel: {0}")]
    Kernel(String),

    /// A module the guest needs is neither built into the kernel nor shipped
    /// as a loadable module, or modules.dep is inconsistent.
    #[error("kernel module: {0}")]
    Module(String),

    /// The guest agent binary to install is missing or unreadable.
    #[error("guest agent binary {0} does not exist or is not a regular file")]
    AgentMissing(PathBuf),

    /// The template specification cannot be built (bad name, empty sizes...).
    #[error("invalid template: {0}")]
    InvalidTemplate(String),

    /// An imported root filesystem or image archive is not usable (the
    /// tenant's input, not the host's fault).
    #[error("{0}")]
    Import(String),

    /// Something on the host is not as the builder needs it (not root, a
    /// required tool missing after trying to install it...).
    #[error("host: {0}")]
    Host(String),
}

impl ImageError {
    /// Wraps an `io::Error` with a description of what was being done.
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        ImageError::Io {
            context: context.into(),
            source,
        }
    }
}

/// Adds `.ctx("doing what")` to io results, so every io error says where it happened.
pub(crate) trait IoContext<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, ImageError>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, ImageError> {
        self.map_err(|e| ImageError::io(context(), e))
    }
}
