//! The wire protocol between the host (the VM engine) and the guest agent.
//!
//! Owns: the message types in both directions and the frame format, and
//! (feature `tokio`) the host's async client in the `client` module. Apart from that
//! client it does no I/O of its own beyond reading and writing one frame on
//! a stream the caller gives it; it knows nothing of QEMU, sandboxes or HTTP.
//!
//! # Frames
//!
//! The host and the guest share one byte stream (a virtio-serial port in the
//! guest, a unix socket on the host), so every call is multiplexed on it by a
//! call `id` the host chooses. A frame is:
//!
//! ```text
//! 4 bytes         magic "SHL\x01"
//! u32 big-endian  header length H
//! u32 big-endian  payload length P
//! H bytes         JSON header: {"id": <u64>, "msg": <HostMsg | GuestMsg>}
//! P bytes         raw payload (stdout/stderr chunks, file data, entropy)
//! ```
//!
//! The magic lets a reader find the next frame after a torn one: a guest
//! paused for a fork may have been half-way through a frame, and its child
//! then starts a new connection in the middle of it. Readers skip bytes
//! until the magic, and a new connection begins with a `Hello` whose answer
//! the host waits for, discarding anything before it.
//!
//! Raw payloads keep bulk data out of JSON, so a 1 GiB file moves as 64 KiB
//! chunks without base64 and without being held whole in memory.
//!
//! # Calls
//!
//! Each call starts with one [`HostMsg`] under a fresh id and ends with exactly
//! one terminal [`GuestMsg`] under that id ([`GuestMsg::is_terminal`]).
//! Streams in between:
//! - `Exec`: `Started`, then any number of `Stdout`/`Stderr`, then `Exit`.
//!   The host may send `Stdin`, `Resize` and `Signal` under the exec's id.
//! - `ReadFile`: `FileInfo`, then `Data` chunks, then `End`.
//! - `WriteFile`: the host sends `Data` chunks then `End` under the same id;
//!   the guest answers `Done` (or `Error` at any point).
//!
//! # Flow control
//!
//! The guest never has more than [`STREAM_WINDOW`] bytes of one call's
//! `Stdout`/`Stderr`/`Data` payload unacknowledged; the host returns credit
//! with `Credit { bytes }` under the call's id as it consumes them. One slow
//! reader therefore cannot fill the shared channel and stall other calls.
//! The host holds the agent to it: more stream payload than the credit it
//! granted and has not had back ends the connection (the `client` module),
//! so what the host buffers per call is bounded by the window.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{Read, Write};

/// Bumped on any change to the messages or their meaning. The host refuses
/// an agent that answers `Hello` with a version outside
/// [`OLDEST_PROTOCOL_VERSION`]..=[`PROTOCOL_VERSION`].
///
/// - 2: `Settle`.
pub const PROTOCOL_VERSION: u32 = 2;

/// The oldest agent protocol the host still speaks: snapshots and
/// hibernated sandboxes keep the agent they were made with.
pub const OLDEST_PROTOCOL_VERSION: u32 = 1;

/// Name of the virtio-serial port the agent listens on
/// (`/dev/virtio-ports/<name>` in the guest).
pub const AGENT_PORT_NAME: &str = "org.shoal.agent";

/// The guest's eth0 address, the same in every sandbox: each sandbox has a
/// network namespace of its own on the host, so identical addresses never
/// meet. The agent sets it when the guest boots (before the template is
/// baked); the host's side of the link is [`GUEST_GATEWAY`].
pub const GUEST_ADDRESS: [u8; 4] = [10, 0, 0, 2];
/// The guest's default gateway: the host's end of the guest's tap device.
pub const GUEST_GATEWAY: [u8; 4] = [10, 0, 0, 1];
/// The guest link's netmask (a /30: the guest and its gateway).
pub const GUEST_NETMASK: [u8; 4] = [255, 255, 255, 252];

/// Largest payload of one frame; bulk data is cut into chunks of this size.
pub const MAX_CHUNK: usize = 64 * 1024;

/// Largest JSON header accepted; anything bigger is a protocol error.
pub const MAX_HEADER: usize = 1024 * 1024;

/// Bytes of stream payload one call may have in flight before credit returns.
pub const STREAM_WINDOW: u64 = 1024 * 1024;

/// Marks the start of every frame.
pub const MAGIC: [u8; 4] = *b"SHL\x01";

/// Identifies one call on the shared channel.
pub type CallId = u64;

/// Terminal size of a PTY.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

/// A signal sent to an exec's process group `before_ms` before its
/// timeout (a job's chance to checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarnSignal {
    pub signal: i32,
    pub before_ms: u64,
}

/// A message from the host to the guest agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum HostMsg {
    /// Answered by `GuestMsg::Hello`.
    Hello { protocol: u32 },
    /// Gives a restored or forked guest its own identity: sets the hostname,
    /// sets the wall clock, mixes the payload (host entropy) into the guest
    /// RNG and forces a reseed. Answered by `Done`.
    Identity { hostname: String, unix_time_ns: u64 },
    /// Runs `cmd` with `/bin/sh -c` in a new session and process group.
    /// A timeout kills the whole process group.
    Exec {
        cmd: String,
        #[serde(default)]
        env: BTreeMap<String, String>,
        #[serde(default)]
        cwd: Option<String>,
        #[serde(default)]
        timeout_ms: Option<u64>,
        /// At the timeout, SIGCONT and SIGTERM the group, and SIGKILL it
        /// this long after (Slurm's KillWait); absent: SIGKILL at once.
        #[serde(default)]
        kill_grace_ms: Option<u64>,
        /// A signal for the group before the timeout (Slurm's `--signal`).
        #[serde(default)]
        warn_signal: Option<WarnSignal>,
        /// Run on a PTY of this size (stdout carries the terminal output,
        /// nothing comes on stderr).
        #[serde(default)]
        pty: Option<PtySize>,
        /// Keep stdin open for `Stdin` messages; otherwise it is /dev/null.
        #[serde(default)]
        stdin: bool,
    },
    /// Payload goes to the exec's stdin; `eof` closes it after the payload.
    Stdin {
        #[serde(default)]
        eof: bool,
    },
    /// Resizes the exec's PTY.
    Resize(PtySize),
    /// Sends a signal to the exec's whole process group.
    Signal { signal: i32 },
    /// Returns credit for `bytes` of stream payload of this call.
    Credit { bytes: u64 },
    /// Streams a file: `FileInfo`, `Data`..., `End`.
    ReadFile { path: String },
    /// Creates or truncates a file (parents are created), then takes `Data`
    /// frames and `End` from the host. Answered by `Done`.
    WriteFile {
        path: String,
        #[serde(default)]
        mode: Option<u32>,
    },
    /// A chunk of an upload (payload).
    Data,
    /// End of an upload.
    End,
    /// Answered by `DirEntries`.
    ListDir { path: String },
    /// Answered by `Stat`.
    Stat { path: String },
    /// Removes a file, or a directory (with its contents when `recursive`).
    Remove {
        path: String,
        #[serde(default)]
        recursive: bool,
    },
    /// Creates a directory and its parents. Answered by `Done`.
    MakeDir { path: String },
    /// Before a snapshot: lets the agent's own background work settle (a
    /// warm shell still starting), then flushes guest filesystems. Answered
    /// by `Done`.
    Sync,
    /// Before a fork point: lets the agent's own background work settle, so
    /// no clone inherits it half done. Answered by `Done`. Protocol 2.
    Settle,
    /// Answered by `Pong`.
    Ping,
    /// The host stopped listening to this call (its handle was dropped):
    /// the guest sends nothing more under the id and never waits for its
    /// credit. An exec keeps running with its output discarded; an upload
    /// is abandoned where it stands (the partial file stays); a download
    /// stops. Ignored for ids that are not running.
    Cancel,
}

/// A message from the guest agent to the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum GuestMsg {
    Hello {
        protocol: u32,
        agent_version: String,
    },
    Done,
    Pong,
    /// The exec's process started.
    Started {
        pid: u32,
    },
    /// A chunk of stdout (payload).
    Stdout,
    /// A chunk of stderr (payload).
    Stderr,
    /// The exec ended. Exactly one of `code` and `signal` is set.
    Exit {
        code: Option<i32>,
        signal: Option<i32>,
        timed_out: bool,
        duration_ms: u64,
        /// What the process and the children it waited for used (absent
        /// from agents before it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<ProcessUsage>,
    },
    FileInfo {
        size: u64,
    },
    /// A chunk of a download (payload).
    Data,
    /// End of a download.
    End,
    DirEntries {
        entries: Vec<FileStat>,
    },
    Stat(FileStat),
    Error {
        kind: ErrorKind,
        message: String,
    },
}

impl GuestMsg {
    /// Whether this message ends its call.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            GuestMsg::Hello { .. }
                | GuestMsg::Done
                | GuestMsg::Pong
                | GuestMsg::Exit { .. }
                | GuestMsg::End
                | GuestMsg::DirEntries { .. }
                | GuestMsg::Stat(_)
                | GuestMsg::Error { .. }
        )
    }
}

/// What kind of failure an `Error` reports, so the host can map it to a
/// user-facing status without parsing messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    NotFound,
    PermissionDenied,
    ReadOnly,
    IsADirectory,
    NotADirectory,
    AlreadyExists,
    NotEmpty,
    InvalidInput,
    Io,
    Protocol,
}

/// One entry of a directory listing, or the answer to `Stat`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    /// File name (the last path component).
    pub name: String,
    pub path: String,
    pub is_dir: bool,
    pub is_symlink: bool,
    pub size: u64,
    /// Permission and type bits, as `st_mode`.
    pub mode: u32,
    /// Seconds since the epoch.
    pub mtime: i64,
}

/// Resources an exec's process used, from `wait4`'s rusage: the largest
/// resident size of it or of any child it waited for, and their CPU time;
/// and the guest's out-of-memory kills meanwhile.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessUsage {
    pub max_rss_kib: u64,
    /// User plus system time.
    pub cpu_ms: u64,
    /// Processes the guest's out-of-memory killer killed while it ran
    /// (Slurm's "oom-kill events" that make a step OUT_OF_MEMORY).
    #[serde(default)]
    pub oom_kills: u64,
}

/// The JSON part of a frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header<M> {
    pub id: CallId,
    pub msg: M,
}

/// A whole frame.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame<M> {
    pub id: CallId,
    pub msg: M,
    pub payload: Vec<u8>,
}

impl<M> Frame<M> {
    pub fn new(id: CallId, msg: M) -> Self {
        Frame {
            id,
            msg,
            payload: Vec::new(),
        }
    }

    pub fn with_payload(id: CallId, msg: M, payload: Vec<u8>) -> Self {
        Frame { id, msg, payload }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("channel closed")]
    Closed,
    #[error("frame header of {0} bytes exceeds the limit")]
    HeaderTooLarge(usize),
    #[error("frame payload of {0} bytes exceeds the limit")]
    PayloadTooLarge(usize),
    #[error("malformed frame header")]
    BadHeader(#[source] serde_json::Error),
    #[error("channel I/O failed")]
    Io(#[source] std::io::Error),
}

/// Encodes a frame into one buffer, so it is written with a single call and
/// frames from concurrent writers never interleave.
pub fn encode<M: Serialize>(frame: &Frame<M>) -> Vec<u8> {
    let header = serde_json::to_vec(&Header {
        id: frame.id,
        msg: &frame.msg,
    })
    .expect("protocol messages always serialize");
    let mut out = Vec::with_capacity(12 + header.len() + frame.payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&(header.len() as u32).to_be_bytes());
    out.extend_from_slice(&(frame.payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(&frame.payload);
    out
}

fn check_lengths(prefix: &[u8; 8]) -> Result<(usize, usize), ProtoError> {
    let header_len = u32::from_be_bytes(prefix[0..4].try_into().unwrap()) as usize;
    let payload_len = u32::from_be_bytes(prefix[4..8].try_into().unwrap()) as usize;
    if header_len > MAX_HEADER {
        return Err(ProtoError::HeaderTooLarge(header_len));
    }
    if payload_len > MAX_CHUNK {
        return Err(ProtoError::PayloadTooLarge(payload_len));
    }
    Ok((header_len, payload_len))
}

fn decode_body<M: for<'de> Deserialize<'de>>(
    body: &[u8],
    header_len: usize,
) -> Result<Frame<M>, ProtoError> {
    let header: Header<M> =
        serde_json::from_slice(&body[..header_len]).map_err(ProtoError::BadHeader)?;
    Ok(Frame {
        id: header.id,
        msg: header.msg,
        payload: body[header_len..].to_vec(),
    })
}

/// Reads one frame from a blocking stream. A clean end of stream before the
/// first byte of a frame is [`ProtoError::Closed`].
pub fn read_frame<M: for<'de> Deserialize<'de>, R: Read>(
    reader: &mut R,
) -> Result<Frame<M>, ProtoError> {
    let mut window = [0u8; 4];
    let mut byte = [0u8; 1];
    while window != MAGIC {
        match reader.read_exact(&mut byte) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(ProtoError::Closed)
            }
            Err(e) => return Err(ProtoError::Io(e)),
        }
        window = [window[1], window[2], window[3], byte[0]];
    }
    let mut prefix = [0u8; 8];
    reader.read_exact(&mut prefix).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => ProtoError::Closed,
        _ => ProtoError::Io(e),
    })?;
    let (header_len, payload_len) = check_lengths(&prefix)?;
    let mut body = vec![0u8; header_len + payload_len];
    reader.read_exact(&mut body).map_err(ProtoError::Io)?;
    decode_body(&body, header_len)
}

/// Writes one frame to a blocking stream.
pub fn write_frame<M: Serialize, W: Write>(
    writer: &mut W,
    frame: &Frame<M>,
) -> Result<(), ProtoError> {
    writer.write_all(&encode(frame)).map_err(ProtoError::Io)?;
    writer.flush().map_err(ProtoError::Io)
}

/// The host's async client of the agent, over one stream.
#[cfg(feature = "tokio")]
pub mod client;

/// Async counterparts of [`read_frame`] and [`write_frame`] for the host.
#[cfg(feature = "tokio")]
pub mod asynchronous {
    use super::*;
    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

    pub async fn read_frame<M: for<'de> Deserialize<'de>, R: AsyncRead + Unpin>(
        reader: &mut R,
    ) -> Result<Frame<M>, ProtoError> {
        let mut window = [0u8; 4];
        while window != MAGIC {
            let byte = match reader.read_u8().await {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    return Err(ProtoError::Closed)
                }
                Err(e) => return Err(ProtoError::Io(e)),
            };
            window = [window[1], window[2], window[3], byte];
        }
        let mut prefix = [0u8; 8];
        reader
            .read_exact(&mut prefix)
            .await
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => ProtoError::Closed,
                _ => ProtoError::Io(e),
            })?;
        let (header_len, payload_len) = check_lengths(&prefix)?;
        let mut body = vec![0u8; header_len + payload_len];
        reader.read_exact(&mut body).await.map_err(ProtoError::Io)?;
        decode_body(&body, header_len)
    }

    pub async fn write_frame<M: Serialize, W: AsyncWrite + Unpin>(
        writer: &mut W,
        frame: &Frame<M>,
    ) -> Result<(), ProtoError> {
        writer
            .write_all(&encode(frame))
            .await
            .map_err(ProtoError::Io)?;
        writer.flush().await.map_err(ProtoError::Io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trips_with_payload() {
        let frame = Frame::with_payload(7, GuestMsg::Stdout, b"hello".to_vec());
        let bytes = encode(&frame);
        let back: Frame<GuestMsg> = read_frame(&mut &bytes[..]).unwrap();
        assert_eq!(back, frame);
    }

    #[test]
    fn reader_skips_a_torn_frame_to_the_next_magic() {
        let first = encode(&Frame::with_payload(1, GuestMsg::Stdout, b"torn".to_vec()));
        let second = Frame::new(2, GuestMsg::Pong);
        let mut bytes = first[first.len() / 2..].to_vec();
        bytes.extend_from_slice(&encode(&second));
        let back: Frame<GuestMsg> = read_frame(&mut &bytes[..]).unwrap();
        assert_eq!(back, second);
    }

    #[test]
    fn end_of_stream_is_closed() {
        let empty: &[u8] = &[];
        let err = read_frame::<HostMsg, _>(&mut &empty[..]).unwrap_err();
        assert!(matches!(err, ProtoError::Closed));
    }

    #[test]
    fn oversized_payload_is_refused() {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&MAGIC);
        bytes.extend_from_slice(&2u32.to_be_bytes());
        bytes.extend_from_slice(&((MAX_CHUNK + 1) as u32).to_be_bytes());
        let err = read_frame::<HostMsg, _>(&mut &bytes[..]).unwrap_err();
        assert!(matches!(err, ProtoError::PayloadTooLarge(_)));
    }

    #[test]
    fn exec_defaults_fill_in() {
        let msg: Header<HostMsg> =
            serde_json::from_str(r#"{"id":1,"msg":{"op":"exec","cmd":"true"}}"#).unwrap();
        assert_eq!(
            msg.msg,
            HostMsg::Exec {
                cmd: "true".into(),
                env: BTreeMap::new(),
                cwd: None,
                timeout_ms: None,
                kill_grace_ms: None,
                warn_signal: None,
                pty: None,
                stdin: false
            }
        );
    }
}
