//! TLS where Shoal's traffic crosses a network: the HTTPS servers
//! (`shoal server`, `shoal agent`, `shoal up`), the clients that reach them
//! with a CA pinned, and the rule that plain HTTP listens only on loopback.
//!
//! rustls with the ring provider throughout (reqwest, sqlx and axum-server
//! are built on it): no OpenSSL on the host, one crypto library.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {why}")]
    Invalid { path: PathBuf, why: String },
    #[error(
        "{listen} is not a loopback address: serve HTTPS there (--tls-cert and --tls-key), or pass --plain-http to accept plain HTTP on a network"
    )]
    PlainOnNetwork { listen: SocketAddr },
}

/// Makes ring the process's rustls provider (what axum-server uses); a
/// second call is harmless. rustls deprecates ring's provider for lacking
/// post-quantum key exchange; aws-lc-rs, which has it, needs cmake and a
/// longer build, and reqwest and sqlx already bring ring.
#[allow(deprecated)]
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl ServerTls {
    /// Both or neither of `--tls-cert` and `--tls-key`.
    pub fn from_flags(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> Result<Option<ServerTls>, String> {
        match (cert, key) {
            (Some(cert), Some(key)) => Ok(Some(ServerTls { cert, key })),
            (None, None) => Ok(None),
            _ => Err("--tls-cert and --tls-key go together".into()),
        }
    }

    /// The server side, read now (a missing or malformed file is an error
    /// at start, not at the first connection).
    pub async fn config(&self) -> Result<axum_server::tls_rustls::RustlsConfig, TlsError> {
        install_crypto_provider();
        let cert = read(&self.cert)?;
        let key = read(&self.key)?;
        axum_server::tls_rustls::RustlsConfig::from_pem(cert, key)
            .await
            .map_err(|e| TlsError::Invalid {
                path: self.cert.clone(),
                why: format!(
                    "not a usable certificate and key ({}): {e}",
                    self.key.display()
                ),
            })
    }
}

/// Plain HTTP is for loopback: anywhere else it needs TLS or an explicit
/// `--plain-http`.
pub fn check_plain_http(
    listen: SocketAddr,
    tls: Option<&ServerTls>,
    plain_http_allowed: bool,
) -> Result<(), TlsError> {
    if tls.is_some() || plain_http_allowed || listen.ip().is_loopback() {
        Ok(())
    } else {
        Err(TlsError::PlainOnNetwork { listen })
    }
}

/// An HTTP client that trusts only the CA in `ca_file` when given (pinned:
/// the system's roots are not consulted), else the web's roots.
pub fn client_builder(ca_file: Option<&Path>) -> Result<reqwest::ClientBuilder, TlsError> {
    let builder = reqwest::Client::builder().use_rustls_tls();
    let Some(path) = ca_file else {
        return Ok(builder);
    };
    let pem = read(path)?;
    let certificates =
        reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| TlsError::Invalid {
            path: path.to_owned(),
            why: format!("not a PEM certificate bundle: {e}"),
        })?;
    if certificates.is_empty() {
        return Err(TlsError::Invalid {
            path: path.to_owned(),
            why: "holds no certificate".into(),
        });
    }
    let mut builder = builder.tls_built_in_root_certs(false);
    for certificate in certificates {
        builder = builder.add_root_certificate(certificate);
    }
    Ok(builder)
}

/// [`client_builder`], built; requests are small and sent whole, so
/// without Nagle's delay.
pub fn client(ca_file: Option<&Path>) -> Result<reqwest::Client, TlsError> {
    client_builder(ca_file)?
        .tcp_nodelay(true)
        .build()
        .map_err(|e| TlsError::Invalid {
            path: ca_file.map(Path::to_owned).unwrap_or_default(),
            why: e.to_string(),
        })
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_listens_only_on_loopback_unless_told() {
        let loopback: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let network: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let tls = ServerTls {
            cert: "c".into(),
            key: "k".into(),
        };
        assert!(check_plain_http(loopback, None, false).is_ok());
        assert!(check_plain_http("[::1]:8080".parse().unwrap(), None, false).is_ok());
        assert!(matches!(
            check_plain_http(network, None, false),
            Err(TlsError::PlainOnNetwork { .. })
        ));
        assert!(check_plain_http(network, Some(&tls), false).is_ok());
        assert!(check_plain_http(network, None, true).is_ok());
        assert!(ServerTls::from_flags(Some("c".into()), None).is_err());
    }

    #[test]
    fn a_ca_file_must_hold_a_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        assert!(matches!(
            client(Some(&empty)),
            Err(TlsError::Invalid { .. })
        ));
        assert!(matches!(
            client(Some(&dir.path().join("missing.pem"))),
            Err(TlsError::Read { .. })
        ));
        assert!(client(None).is_ok());
    }
}
