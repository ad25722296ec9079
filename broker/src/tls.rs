//! TLS of the TCP listener: turns `--tls-cert`, `--tls-key`, `--tls-client-ca` and
//! `--insecure-tcp` into what `server.rs` serves `--listen` with. TLS is rustls (ring),
//! terminated here rather than inside tonic so that the listener's deadline
//! (`listener::incoming_tls`) covers the handshake *and* the HTTP/2 preface that must
//! follow it: a client that completes the handshake and then sends nothing is closed like
//! any other silent connection. With a client CA every client must present a certificate
//! it signed (mutual TLS). The certificate and key are read again on SIGHUP and whenever
//! their files change ([`reload_loop`]): new connections get the new certificate, open
//! ones keep theirs, and a bad pair is refused and logged while the old one stays. The
//! client CA is read only at start. Plain TCP needs `--insecure-tcp`; `--listen` with
//! neither is refused. The Unix socket is never TLS.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{
    self, crypto::CryptoProvider, server::ClientHello, server::ResolvesServerCert,
    server::WebPkiClientVerifier, sign::CertifiedKey, RootCertStore, ServerConfig,
};
use tokio_util::sync::CancellationToken;

/// Why the TCP listener's security could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(
        "--listen needs TLS: give --tls-cert and --tls-key (PEM files), or --insecure-tcp to \
         serve plain HTTP/2 (tokens then cross the network readable)"
    )]
    NoTls,
    /// Not read: missing, unreadable, not a regular file or too large.
    #[error("reading the TLS {what} {source}")]
    Read {
        what: &'static str,
        #[source]
        source: crate::file_read::FileReadError,
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
    Tls { server: Arc<TlsServer>, mtls: bool },
    /// Plain HTTP/2 (`--insecure-tcp`).
    Insecure,
}

/// The TCP listener's TLS: the rustls configuration and the certificate it serves,
/// which [`TlsServer::reload`] replaces.
#[derive(Debug)]
pub struct TlsServer {
    config: Arc<ServerConfig>,
    cert: Arc<ReloadableCert>,
}

impl TlsServer {
    /// What accepts one connection's handshake.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.config.clone())
    }

    /// Reads the certificate and key again and serves them to new connections; on an
    /// error the old pair stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let fresh = load_certified_key(&self.cert.cert_path, &self.cert.key_path)?;
        *self.cert.current.write() = Arc::new(fresh);
        Ok(())
    }
}

/// The served certificate, swapped on reload.
#[derive(Debug)]
struct ReloadableCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for ReloadableCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().clone())
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Certificate chain and key from PEM files, checked to belong together.
fn load_certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let cert_pem = read_pem("certificate", cert, "certificate")?;
    let key_pem = read_pem("key", key, "private key")?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Config(format!("{}: {e}", cert.display())))?;
    if chain.is_empty() {
        return Err(TlsError::NotPem {
            what: "certificate",
            path: cert.to_path_buf(),
            expect: "certificate",
        });
    }
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsError::NotPem {
        what: "key",
        path: key.to_path_buf(),
        expect: "private key",
    })?;
    CertifiedKey::from_der(chain, key_der, &provider()).map_err(|e| TlsError::Config(chain_of(&e)))
}

fn read_pem(what: &'static str, path: &Path, expect: &'static str) -> Result<Vec<u8>, TlsError> {
    let bytes = crate::file_read::read_regular(path, crate::file_read::MAX_WATCHED_FILE_BYTES)
        .map_err(|source| TlsError::Read { what, source })?;
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
fn chain_of(e: &dyn std::error::Error) -> String {
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
    let _ = handshake; // the listener's deadline covers the handshake (`incoming_tls`)
    let certified = load_certified_key(cert, key)?;
    let resolver = Arc::new(ReloadableCert {
        cert_path: cert.to_path_buf(),
        key_path: key.to_path_buf(),
        current: RwLock::new(Arc::new(certified)),
    });
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(chain_of(&e)))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let pem = read_pem("client CA", ca, "certificate")?;
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(&pem) {
                let c = c.map_err(|e| TlsError::Config(format!("{}: {e}", ca.display())))?;
                roots
                    .add(c)
                    .map_err(|e| TlsError::Config(format!("{}: {}", ca.display(), chain_of(&e))))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider())
                .build()
                .map_err(|e| TlsError::Config(chain_of(&e)))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_cert_resolver(resolver.clone());
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TcpSecurity::Tls {
        server: Arc::new(TlsServer {
            config: Arc::new(config),
            cert: resolver,
        }),
        mtls: client_ca.is_some(),
    })
}

/// Reloads `server`'s certificate on SIGHUP and whenever the certificate or key file
/// changes (checked every `poll`; reads follow symlinks, so a Secret's `..data` swap
/// counts), until `stop`: the loop, for the broker to run as its named worker `tls-reload`
/// (`Lifecycle::spawn_worker`). SIGHUP is registered before returning.
pub fn reload_loop(
    server: Arc<TlsServer>,
    poll: Duration,
    stop: CancellationToken,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    // Read off the runtime, bounded, regular files only (`crate::file_read`): a file
    // swapped for a FIFO or a device cannot hold a runtime thread.
    let files = |s: Arc<TlsServer>| async move {
        let read = |p: &Path| {
            crate::file_read::read_regular(p, crate::file_read::MAX_WATCHED_FILE_BYTES).ok()
        };
        tokio::task::spawn_blocking(move || (read(&s.cert.cert_path), read(&s.cert.key_path)))
            .await
            .unwrap_or_default()
    };
    async move {
        let mut last = files(server.clone()).await;
        loop {
            let why = tokio::select! {
                _ = stop.cancelled() => return,
                _ = async {
                    match hup.as_mut() {
                        Some(h) => { h.recv().await; }
                        None => std::future::pending::<()>().await,
                    }
                } => "SIGHUP",
                _ = tokio::time::sleep(poll) => "certificate file changed",
            };
            let now = files(server.clone()).await;
            if why != "SIGHUP" && now == last {
                continue;
            }
            last = now;
            let s = server.clone();
            let reloaded = tokio::task::spawn_blocking(move || s.reload())
                .await
                .unwrap_or_else(|e| Err(TlsError::Config(e.to_string())));
            match reloaded {
                Ok(()) => {
                    tracing::info!(why, cert = %server.cert.cert_path.display(), "TLS certificate reloaded")
                }
                Err(e) => {
                    tracing::error!(why, error = %e, "TLS certificate not reloaded; the old one stays")
                }
            }
        }
    }
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

    /// A certificate or key swapped for a FIFO (no writer) or a device is refused at once,
    /// not waited on or read.
    #[test]
    fn a_fifo_or_a_device_in_place_of_the_files_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid, NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let d = Duration::from_secs(5);
        let zero = Path::new("/dev/zero");
        for (cert, key) in [(&*fifo, zero), (zero, &*fifo)] {
            let e = tcp_security(Some(cert), Some(key), None, false, d).unwrap_err();
            assert!(matches!(e, TlsError::Read { .. }), "{e}");
            assert!(e.to_string().contains("not a regular file"), "{e}");
        }
    }
}
