//! TLS of the TCP listener: turns `--tls-cert`, `--tls-key`, `--tls-client-ca` and
//! `--insecure-tcp` into what `server.rs` serves `--listen` with. TLS is rustls (ring)
//! through tonic; with a client CA every client must present a certificate it signed
//! (mutual TLS). Plain TCP needs `--insecure-tcp`; `--listen` with neither is refused. The
//! Unix socket is never TLS.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::transport::{Certificate, Identity, ServerTlsConfig};

/// Why the TCP listener's security could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(
        "--listen needs TLS: give --tls-cert and --tls-key (PEM files), or --insecure-tcp to \
         serve plain HTTP/2 (tokens then cross the network readable)"
    )]
    NoTls,
    #[error("reading the TLS {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the TLS {what} {path} holds no PEM {expect}")]
    NotPem {
        what: &'static str,
        path: PathBuf,
        expect: &'static str,
    },
    #[error("TLS configuration refused (certificate and key do not fit?): {0}")]
    Config(String),
}

/// How the TCP listener is served.
#[derive(Clone, Debug)]
pub enum TcpSecurity {
    /// TLS; with a client CA when `mtls`.
    Tls { config: ServerTlsConfig, mtls: bool },
    /// Plain HTTP/2 (`--insecure-tcp`).
    Insecure,
}

fn read_pem(what: &'static str, path: &Path, expect: &'static str) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    if !String::from_utf8_lossy(&bytes).contains("-----BEGIN ") {
        return Err(TlsError::NotPem {
            what,
            path: path.to_path_buf(),
            expect,
        });
    }
    Ok(bytes)
}

/// An error and its sources, joined with ": " (rustls says what is wrong in a source).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The TCP listener's security from the flags; `handshake` bounds the TLS handshake.
/// Certificate and key are read and checked now, so a bad file fails at start.
pub fn tcp_security(
    cert: Option<&Path>,
    key: Option<&Path>,
    client_ca: Option<&Path>,
    insecure: bool,
    handshake: Duration,
) -> Result<TcpSecurity, TlsError> {
    let (cert, key) = match (cert, key) {
        (Some(c), Some(k)) => (c, k),
        _ if insecure => return Ok(TcpSecurity::Insecure),
        _ => return Err(TlsError::NoTls),
    };
    let identity = Identity::from_pem(
        read_pem("certificate", cert, "certificate")?,
        read_pem("key", key, "private key")?,
    );
    let mut config = ServerTlsConfig::new().identity(identity).timeout(handshake);
    if let Some(ca) = client_ca {
        config = config.client_ca_root(Certificate::from_pem(read_pem(
            "client CA",
            ca,
            "certificate",
        )?));
    }
    // Build the acceptor once now: a key that does not fit its certificate fails here.
    tonic::transport::Server::builder()
        .tls_config(config.clone())
        .map_err(|e| TlsError::Config(chain(&e)))?;
    Ok(TcpSecurity::Tls {
        config,
        mtls: client_ca.is_some(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_without_tls_or_insecure_is_refused() {
        let e = tcp_security(None, None, None, false, Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, TlsError::NoTls));
        assert!(e.to_string().contains("--insecure-tcp"), "{e}");
        assert!(matches!(
            tcp_security(None, None, None, true, Duration::from_secs(5)),
            Ok(TcpSecurity::Insecure)
        ));
    }

    #[test]
    fn unreadable_or_non_pem_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk");
        std::fs::write(&junk, b"not a certificate").unwrap();
        let missing = dir.path().join("missing");
        let d = Duration::from_secs(5);
        let e = tcp_security(Some(&missing), Some(&junk), None, false, d).unwrap_err();
        assert!(matches!(e, TlsError::Read { .. }), "{e}");
        let e = tcp_security(Some(&junk), Some(&junk), None, false, d).unwrap_err();
        assert!(matches!(e, TlsError::NotPem { .. }), "{e}");
    }
}
