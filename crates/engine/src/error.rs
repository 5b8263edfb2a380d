//! The engine's error type: one enum for every failure a caller can act on.
//!
//! Variants are grouped by what the caller should do (bad input, missing
//! thing, capacity, internal fault), so the control plane can map them to
//! status codes in one exhaustive match without reading messages.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("unknown template {0:?}")]
    UnknownTemplate(String),
    #[error("template {0:?} is not built; run `shoal template build {0}`")]
    TemplateNotBuilt(String),
    #[error("template {name:?} was baked by {baked_by}, but this host runs {host}; rebake it with `shoal template build {name}`")]
    TemplateStale {
        name: String,
        baked_by: String,
        host: String,
    },
    /// The template's memory file is not what its bake wrote (see
    /// [`crate::integrity`]); nothing is restored from it until a rebuild.
    #[error("template {name}'s memory file {path} changed since its bake: refusing to restore it (rebuild the template)")]
    TemplateTampered {
        name: String,
        path: std::path::PathBuf,
    },
    #[error("no sandbox {0}")]
    NoSuchSandbox(String),
    #[error("no snapshot {0}")]
    NoSuchSnapshot(String),
    #[error("sandbox {id} is {state}, not {wanted}")]
    WrongState {
        id: String,
        state: &'static str,
        wanted: &'static str,
    },
    /// Forks and snapshots of a sandbox with volumes are refused.
    #[error("sandbox {0} has volumes attached: it cannot be forked or snapshotted (a volume has one writer)")]
    HasVolumes(String),
    #[error("invalid request: {0}")]
    InvalidInput(String),
    #[error("another engine holds {0}")]
    StateDirBusy(PathBuf),
    #[error("QEMU failed: {message}")]
    Qemu { message: String },
    #[error("QMP")]
    Qmp(#[from] shoal_qmp::QmpError),
    #[error("guest agent")]
    Agent(#[from] shoal_proto::client::AgentError),
    #[error("building the guest image")]
    Image(#[from] shoal_image::ImageError),
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("timed out {0}")]
    Timeout(String),
    /// The kernel killed the VM's QEMU for exceeding its memory limit.
    #[error("sandbox {0} was killed: out of memory")]
    OutOfMemory(String),
    /// The VM's QEMU ended without the engine asking; only delete remains.
    #[error("sandbox {id} has failed: {reason}")]
    Failed { id: String, reason: String },
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Attaches what was being done to an I/O error.
pub(crate) trait IoContext<T> {
    fn io_context(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn io_context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| EngineError::Io {
            context: context(),
            source,
        })
    }
}

/// Prints an error with its chain of sources, joined by ": ".
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        out.push_str(": ");
        out.push_str(&e.to_string());
        source = e.source();
    }
    out
}
