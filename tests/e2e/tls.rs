//! TLS on the TCP listener, with certificates made here (rcgen): a client that trusts the
//! broker's CA gets in, one that does not is refused; with `--tls-client-ca` a client
//! without a certificate is refused and one with a certificate the CA signed gets in;
//! `--listen` with neither TLS files nor `--insecure-tcp` does not start; a client that
//! completes the TLS handshake and then sends nothing is closed after the handshake
//! timeout; the certificate is reloaded on SIGHUP without a restart (a bad pair is refused
//! and the old one stays).

use gpu_broker_client::{AdminClient, Client, ConnectOptions, QuotaSpec};
use gpu_broker_tests::*;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use std::path::{Path, PathBuf};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);
const GIB: u64 = 1 << 30;

/// A CA, a server certificate for localhost/127.0.0.1 and a client certificate it signed,
/// and a second CA that signed nothing; PEM files in `dir`.
struct Pki {
    ca: PathBuf,
    other_ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap()
}

fn pki(dir: &Path) -> Pki {
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let issuer = ca("gpu-broker test CA");
    let other = ca("someone else's CA");
    let server_key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
    let client_key = KeyPair::generate().unwrap();
    let mut cp = CertificateParams::new(Vec::<String>::new()).unwrap();
    cp.distinguished_name.push(DnType::CommonName, "worker");
    let client = cp.signed_by(&client_key, &issuer).unwrap();
    Pki {
        ca: write("ca.pem", issuer.pem()),
        other_ca: write("other-ca.pem", other.pem()),
        server_cert: write("server.pem", server.pem()),
        server_key: write("server.key", server_key.serialize_pem()),
        client_cert: write("client.pem", client.pem()),
        client_key: write("client.key", client_key.serialize_pem()),
    }
}

/// Starts a broker serving TLS on a loopback port; returns it and its `https://` address.
async fn tls_broker(pki: &Pki, client_ca: bool) -> (Broker, String) {
    tls_broker_with(pki, client_ca, &[]).await
}

async fn tls_broker_with(pki: &Pki, client_ca: bool, more: &[&str]) -> (Broker, String) {
    let mut extra: Vec<String> = vec![
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--tls-cert".into(),
        pki.server_cert.display().to_string(),
        "--tls-key".into(),
        pki.server_key.display().to_string(),
    ];
    if client_ca {
        extra.extend(["--tls-client-ca".into(), pki.ca.display().to_string()]);
    }
    extra.extend(more.iter().map(|m| m.to_string()));
    let b = Broker::start_with(BrokerOpts {
        extra,
        ..Default::default()
    })
    .unwrap();
    let mut addr = None;
    assert!(
        eventually(T, || {
            addr = crate::admin::tcp_addr(&b.log_text());
            let found = addr.is_some();
            async move { found }
        })
        .await,
        "{}",
        b.log_text()
    );
    assert!(
        b.log_text().contains("TLS on the TCP listener"),
        "{}",
        b.log_text()
    );
    (b, format!("https://{}", addr.unwrap()))
}

fn trusting(ca: &Path) -> ConnectOptions {
    ConnectOptions {
        ca_file: Some(ca.to_path_buf()),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_listener_serves_clients_that_trust_its_ca_only() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let (b, uri) = tls_broker(&pki, false).await;
    let token = b.tenant("remote", QuotaSpec::new(GIB)).await.unwrap();

    let c = Client::connect_with(&uri, token.clone(), &trusting(&pki.ca))
        .await
        .unwrap();
    let s = c.session("over-tls").await.unwrap();
    assert_eq!(s.peer_pid(), 0, "no pid over TCP");
    let admin = AdminClient::connect_with(&uri, b.admin_token.clone(), &trusting(&pki.ca))
        .await
        .unwrap();
    let sessions = admin.list_sessions(None).await.unwrap();
    assert_eq!(sessions.len(), 1);
    assert_eq!(sessions[0].transport, "tcp");

    // A client that trusts another CA does not get a connection.
    let e = Client::connect_with(&uri, token.clone(), &trusting(&pki.other_ca))
        .await
        .unwrap_err();
    assert_eq!(e.code(), gpu_broker_client::Code::Unavailable, "{e}");
    // Plain HTTP/2 to the TLS port gets nothing either.
    let plain = uri.replace("https://", "http://");
    let served = match Client::connect_with(&plain, token.clone(), &ConnectOptions::default()).await
    {
        Err(_) => false,
        Ok(c) => c.session("plain").await.is_ok(),
    };
    assert!(!served, "plain HTTP/2 was served on the TLS port");
    // https:// without a CA file is refused before dialling, naming the option.
    let e = Client::connect_with(&uri, token, &ConnectOptions::default())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("--ca-file"), "{e}");

    // The CLI connects with --ca-file.
    let out = std::process::Command::new(bin("gpu-brokerctl"))
        .args(["--broker", &uri, "--ca-file"])
        .arg(&pki.ca)
        .args(["--token", &b.admin_token, "sessions", "list"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("over-tls"));
    // The Unix socket stays plain.
    assert!(b.admin().await.unwrap().list_sessions(None).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_client_ca_refuses_clients_without_a_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let (b, uri) = tls_broker(&pki, true).await;
    let token = b.tenant("remote", QuotaSpec::new(GIB)).await.unwrap();

    // Trusting the server is not enough: no client certificate, no calls.
    let e = match Client::connect_with(&uri, token.clone(), &trusting(&pki.ca)).await {
        Err(e) => e,
        Ok(c) => c.session("no-cert").await.unwrap_err(),
    };
    // (The code depends on when the client sees the server's alert: UNAVAILABLE, UNKNOWN
    // or CANCELLED; what matters is that the call never reached the broker.)
    assert!(
        !matches!(
            e.code(),
            gpu_broker_client::Code::Unauthenticated | gpu_broker_client::Code::PermissionDenied
        ),
        "{e}"
    );
    let admin = b.admin().await.unwrap();
    assert!(admin.list_sessions(None).await.unwrap().is_empty());

    let with_cert = ConnectOptions {
        ca_file: Some(pki.ca.clone()),
        client_cert: Some(pki.client_cert.clone()),
        client_key: Some(pki.client_key.clone()),
    };
    let c = Client::connect_with(&uri, token, &with_cert).await.unwrap();
    let _s = c.session("with-cert").await.unwrap();
    let sessions = admin.list_sessions(None).await.unwrap();
    assert_eq!(sessions.len(), 1, "{sessions:?}");
}

#[test]
fn listen_without_tls_or_insecure_tcp_does_not_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(bin("gpu-broker"))
        .args(["--backend", "host", "--listen", "127.0.0.1:0", "--socket"])
        .arg(dir.path().join("broker.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("--tls-cert") && err.contains("--insecure-tcp"),
        "{err}"
    );
    assert!(
        !dir.path().join("broker.sock").exists(),
        "it bound its socket"
    );

    // A key that is not PEM is refused at start too, naming the file.
    let bad = dir.path().join("bad.pem");
    std::fs::write(&bad, "nothing").unwrap();
    let out = std::process::Command::new(bin("gpu-broker"))
        .args(["--backend", "host", "--listen", "127.0.0.1:0", "--socket"])
        .arg(dir.path().join("broker.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--tls-cert")
        .arg(&bad)
        .arg("--tls-key")
        .arg(&bad)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("bad.pem"), "{err}");
}

/// A raw TLS client (rustls) that trusts `ca` and offers HTTP/2.
fn raw_tls_client(ca: &Path) -> tokio_rustls::TlsConnector {
    use tokio_rustls::rustls::{self, pki_types::pem::PemObject, pki_types::CertificateDer};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
}

/// Reads until the peer closes (EOF or an error); returns how long that took.
async fn until_closed<R: tokio::io::AsyncRead + Unpin>(r: &mut R, within: Duration) -> Duration {
    use tokio::io::AsyncReadExt;
    let t0 = std::time::Instant::now();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(within, async {
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => continue, // the server's HTTP/2 SETTINGS
            }
        }
    })
    .await
    .expect("the broker did not close the silent connection");
    t0.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_silent_after_the_tls_handshake_is_closed_at_the_handshake_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let (b, uri) = tls_broker_with(&pki, false, &["--handshake-timeout", "1s"]).await;
    let addr = uri.trim_start_matches("https://").to_string();
    let connector = raw_tls_client(&pki.ca);

    // Completes the handshake (the server's certificate is checked), then says nothing.
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let t0 = std::time::Instant::now();
    let mut tls = connector
        .connect(name, tcp)
        .await
        .expect("the handshake succeeds");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    until_closed(&mut tls, Duration::from_secs(10)).await;
    let closed = t0.elapsed();
    assert!(
        closed >= Duration::from_millis(800),
        "closed after {closed:?}, before the timeout"
    );
    // A TCP connection that never starts the handshake is closed too.
    let mut silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
    until_closed(&mut silent, Duration::from_secs(10)).await;

    // The broker is healthy, and a real client still gets in after the silent ones.
    let token = b.tenant("remote", QuotaSpec::new(GIB)).await.unwrap();
    let c = Client::connect_with(&uri, token, &trusting(&pki.ca))
        .await
        .unwrap();
    c.session("after-silent").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tls_certificate_is_reloaded_on_sighup_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let first = pki(dir.path());
    let (b, uri) = tls_broker(&first, false).await;
    let token = b.tenant("remote", QuotaSpec::new(GIB)).await.unwrap();
    Client::connect_with(&uri, token.clone(), &trusting(&first.ca))
        .await
        .unwrap();
    let pid_before = b.pid();

    // A new CA and server certificate in the same files; SIGHUP.
    let next_dir = tempfile::tempdir().unwrap();
    let next = pki(next_dir.path());
    std::fs::copy(&next.server_key, &first.server_key).unwrap();
    std::fs::copy(&next.server_cert, &first.server_cert).unwrap();
    b.signal(libc::SIGHUP);
    assert!(
        eventually(T, || {
            let (uri, token, o) = (uri.clone(), token.clone(), trusting(&next.ca));
            async move { Client::connect_with(&uri, token, &o).await.is_ok() }
        })
        .await,
        "the new certificate is not served: {}",
        b.log_text()
    );
    assert!(
        b.log_text().contains("TLS certificate reloaded"),
        "{}",
        b.log_text()
    );
    // The old CA no longer gets a new connection; the broker never restarted.
    let e = Client::connect_with(&uri, token.clone(), &trusting(&first.ca))
        .await
        .unwrap_err();
    assert_eq!(e.code(), gpu_broker_client::Code::Unavailable, "{e}");
    assert_eq!(b.pid(), pid_before);

    // A broken file is refused and logged; the current certificate stays.
    std::fs::write(&first.server_cert, "not a certificate").unwrap();
    b.signal(libc::SIGHUP);
    assert!(
        eventually(T, || {
            let log = b.log_text();
            async move { log.contains("TLS certificate not reloaded") }
        })
        .await,
        "{}",
        b.log_text()
    );
    let c = Client::connect_with(&uri, token, &trusting(&next.ca))
        .await
        .unwrap();
    c.session("after-bad-reload").await.unwrap();
}
