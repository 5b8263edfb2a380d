//! systemd's readiness protocol (`sd_notify(3)`): the services (`shoal up`,
//! `shoal agent`, `shoal server`) run as `Type=notify` units, which systemd
//! counts as started only when the process sends `READY=1` to the datagram
//! socket named in `NOTIFY_SOCKET`: after the templates are baked, the
//! database reconciled and the listener bound, so that `systemctl start`
//! (and every unit ordered after it) waits for a service that answers.
//! `STATUS=` lines show in `systemctl status`, `STOPPING=1` marks a planned
//! stop.
//!
//! Without `NOTIFY_SOCKET` (not started by systemd) every call does
//! nothing. A message that cannot be sent is logged, never an error: the
//! service runs the same either way.
//!
//! Owns: the socket address (a path, or `@name` for an abstract socket)
//! and the datagram. May not: decide when a service is ready (the
//! commands call it).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::net::UnixDatagram;

/// The service is ready to serve; `status` is shown by `systemctl status`.
pub fn ready(status: &str) {
    notify(&format!("READY=1\nSTATUS={status}"));
}

/// What the service is doing while it starts (or stops).
pub fn status(status: &str) {
    notify(&format!("STATUS={status}"));
}

/// A planned stop has begun (SIGTERM or Ctrl-C).
pub fn stopping() {
    notify("STOPPING=1");
}

fn notify(message: &str) {
    let socket = std::env::var_os("NOTIFY_SOCKET");
    if let Err(e) = send(socket.as_deref(), message) {
        tracing::warn!("telling systemd {message:?}: {e}");
    }
}

/// Sends `message` to the socket `socket` names (`NOTIFY_SOCKET`'s
/// value: a path, or `@` and an abstract name); whether there was one.
pub(crate) fn send(socket: Option<&OsStr>, message: &str) -> std::io::Result<bool> {
    let Some(socket) = socket.filter(|s| !s.is_empty()) else {
        return Ok(false);
    };
    let datagram = UnixDatagram::unbound()?;
    match socket.as_bytes().strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt as _;
            let address = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            datagram.send_to_addr(message.as_bytes(), &address)?;
        }
        None => {
            datagram.send_to(message.as_bytes(), socket)?;
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn received(listener: &UnixDatagram) -> String {
        listener
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut buffer = [0u8; 4096];
        let n = listener.recv(&mut buffer).expect("a notification");
        String::from_utf8_lossy(&buffer[..n]).into_owned()
    }

    #[test]
    fn a_socket_at_a_path_receives_ready() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let listener = UnixDatagram::bind(&path).unwrap();
        assert!(send(Some(path.as_os_str()), "READY=1\nSTATUS=serving").unwrap());
        assert_eq!(received(&listener), "READY=1\nSTATUS=serving");
    }

    #[test]
    fn an_abstract_socket_receives_ready() {
        use std::os::linux::net::SocketAddrExt as _;
        let name = format!("shoal-notify-test-{}", std::process::id());
        let address = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&address).unwrap();
        let variable = format!("@{name}");
        assert!(send(Some(OsStr::new(&variable)), "READY=1").unwrap());
        assert_eq!(received(&listener), "READY=1");
    }

    #[test]
    fn without_a_socket_nothing_is_sent() {
        assert!(!send(None, "READY=1").unwrap());
        assert!(!send(Some(OsStr::new("")), "READY=1").unwrap());
        // Not under systemd (the test runner sets no NOTIFY_SOCKET): the
        // public calls return quietly.
        if std::env::var_os("NOTIFY_SOCKET").is_none() {
            ready("serving");
            status("baking templates");
            stopping();
        }
    }

    #[test]
    fn a_socket_nobody_listens_on_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("gone.sock");
        assert!(send(Some(gone.as_os_str()), "READY=1").is_err());
    }
}
