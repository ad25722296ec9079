//! Reaching the broker: turning a URI into a tonic [`Channel`] and stamping every
//! request with `authorization: Bearer <token>`. Accepted URIs are
//! `unix:///path/to/broker.sock` (tonic 0.14 dials Unix sockets natively), a bare
//! absolute path (taken as a Unix socket), `http://host:port`, and `host:port`
//! (taken as `http://`), and `https://host:port` (TLS, rustls: the broker's certificate
//! must be signed by the CA of [`ConnectOptions::ca_file`]; with a client certificate for
//! brokers that require one). Channels reconnect on their own after a broken connection.
//! [`Transport`] is what the clients use: for Unix and plain TCP addresses the
//! caller-driven connection of `driven/` (its waiting caller polls the connection: no
//! thread hand-offs per call), for `https://` tonic's channel;
//! `GPU_BROKER_CLIENT_TRANSPORT=channel` picks tonic's channel for every address.

use std::path::{Path, PathBuf};
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::body::Body;
use tonic::codegen::{http, StdError};

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::driven::{Driven, Target};
use crate::error::ClientError;

/// A transport whose requests all carry the bearer token.
pub type AuthChannel = InterceptedService<Transport, AuthInterceptor>;

/// The environment variable choosing the transport: `driven` (the default) or `channel`.
pub const TRANSPORT_ENV: &str = "GPU_BROKER_CLIENT_TRANSPORT";

/// How the clients reach the broker: tonic's [`Channel`] or the caller-driven connection
/// (see the module docs). Cheap to clone (clones share one connection).
#[derive(Clone, Debug)]
pub struct Transport(Kind);

#[derive(Clone, Debug)]
enum Kind {
    Channel(Channel),
    Driven(Driven),
}

impl Transport {
    /// Is this the caller-driven connection (not tonic's channel)?
    pub fn is_caller_driven(&self) -> bool {
        matches!(self.0, Kind::Driven(_))
    }
}

impl From<Channel> for Transport {
    fn from(channel: Channel) -> Self {
        Transport(Kind::Channel(channel))
    }
}

impl tower::Service<http::Request<Body>> for Transport {
    type Response = http::Response<Body>;
    type Error = StdError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match &mut self.0 {
            Kind::Channel(c) => c.poll_ready(cx).map_err(Into::into),
            Kind::Driven(d) => d.poll_ready(cx),
        }
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        match &mut self.0 {
            Kind::Channel(c) => {
                let call = c.call(req);
                Box::pin(async move { call.await.map_err(Into::into) })
            }
            Kind::Driven(d) => d.call(req),
        }
    }
}

/// Which transport [`connect_transport_with`] makes for addresses that allow both.
fn driven_wanted() -> Result<bool, ClientError> {
    match std::env::var(TRANSPORT_ENV).as_deref().map(str::trim) {
        Err(_) | Ok("") | Ok("driven") => Ok(true),
        Ok("channel") => Ok(false),
        Ok(other) => Err(ClientError::InvalidArgument(
            format!("{TRANSPORT_ENV}={other:?}: expected \"driven\" or \"channel\"").into(),
        )),
    }
}

/// Where the caller-driven transport dials for a broker address; `None` for `https://`.
fn driven_target(uri: &str) -> Result<Option<Target>, ClientError> {
    let normalized = normalize(uri)?;
    if let Some(path) = unix_path(&normalized) {
        return Ok(Some(Target::Unix(path)));
    }
    if !normalized.starts_with("http://") {
        return Ok(None);
    }
    let parsed: http::Uri = normalized.parse().map_err(|e| {
        ClientError::InvalidArgument(format!("bad broker address {uri:?}: {e}").into())
    })?;
    let authority = parsed.authority().ok_or_else(|| {
        ClientError::InvalidArgument(format!("broker address {uri:?} names no host").into())
    })?;
    let port = authority.port_u16().unwrap_or(80);
    Ok(Some(Target::Tcp(format!("{}:{port}", authority.host()))))
}

/// Dials the broker now with the transport the address and [`TRANSPORT_ENV`] call for;
/// fails with `Transport` when nothing answers.
pub async fn connect_transport_with(
    uri: &str,
    opts: &ConnectOptions,
) -> Result<Transport, ClientError> {
    match driven_target(uri)? {
        Some(target) if driven_wanted()? => {
            let driven = Driven::lazy(target, CONNECT_TIMEOUT);
            driven.connect().await.map_err(|status| {
                ClientError::Transport(format!("cannot connect to {uri}: {}", status.message()))
            })?;
            Ok(Transport(Kind::Driven(driven)))
        }
        _ => Ok(connect_channel_with(uri, opts).await?.into()),
    }
}

/// A transport that dials on first use (errors then surface as `Unavailable`).
pub fn connect_transport_lazy(uri: &str) -> Result<Transport, ClientError> {
    match driven_target(uri)? {
        Some(target) if driven_wanted()? => Ok(Transport(Kind::Driven(Driven::lazy(
            target,
            CONNECT_TIMEOUT,
        )))),
        _ => Ok(connect_channel_lazy(uri)?.into()),
    }
}

/// How long dialing the broker may take before `connect` gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Adds `authorization: Bearer <token>` to every request.
#[derive(Clone)]
pub struct AuthInterceptor {
    value: MetadataValue<Ascii>,
}

impl AuthInterceptor {
    /// Builds the header from a token; surrounding whitespace (a token file's trailing
    /// newline) is ignored. Fails with `InvalidArgument` on an empty token or one that
    /// is not printable ASCII (no spaces).
    pub fn new(token: &str) -> Result<Self, ClientError> {
        let token = token.trim();
        if token.is_empty() {
            return Err(ClientError::InvalidArgument("empty bearer token".into()));
        }
        let bad = || ClientError::InvalidArgument("bearer token must be printable ASCII".into());
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad());
        }
        let mut value = MetadataValue::try_from(format!("Bearer {token}")).map_err(|_| bad())?;
        value.set_sensitive(true);
        Ok(AuthInterceptor { value })
    }
}

impl std::fmt::Debug for AuthInterceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuthInterceptor(Bearer <redacted>)")
    }
}

impl Interceptor for AuthInterceptor {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        request
            .metadata_mut()
            .insert("authorization", self.value.clone());
        Ok(request)
    }
}

/// Normalizes a broker address: `/path` -> `unix:///path`, `host:port` -> `http://host:port`.
fn normalize(uri: &str) -> Result<String, ClientError> {
    let uri = uri.trim();
    if uri.is_empty() {
        return Err(ClientError::InvalidArgument("empty broker address".into()));
    }
    if uri.starts_with('/') {
        return Ok(format!("unix://{uri}"));
    }
    if let Some(path) = uri
        .strip_prefix("unix://")
        .or_else(|| uri.strip_prefix("unix:"))
    {
        if path.is_empty() {
            return Err(ClientError::InvalidArgument(
                format!("broker address {uri:?} names no socket path").into(),
            ));
        }
        return Ok(uri.to_string());
    }
    if uri.starts_with("http://") || uri.starts_with("https://") {
        return Ok(uri.to_string());
    }
    if uri.contains("://") {
        return Err(ClientError::InvalidArgument(
            format!("broker address {uri:?}: scheme must be unix://, http:// or https://").into(),
        ));
    }
    Ok(format!("http://{uri}"))
}

/// The Unix socket path of a broker address, if it names one.
pub fn unix_path(uri: &str) -> Option<std::path::PathBuf> {
    let n = normalize(uri).ok()?;
    n.strip_prefix("unix://")
        .or_else(|| n.strip_prefix("unix:"))
        .map(std::path::PathBuf::from)
}

/// How to reach a broker over TLS (`https://` addresses; other schemes ignore it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConnectOptions {
    /// PEM file of the CA that signed the broker's certificate (required for `https://`).
    pub ca_file: Option<PathBuf>,
    /// PEM certificate this client presents (brokers started with `--tls-client-ca`).
    pub client_cert: Option<PathBuf>,
    /// PEM private key of `client_cert`.
    pub client_key: Option<PathBuf>,
}

impl ConnectOptions {
    /// From `GPU_BROKER_CA_FILE`, `GPU_BROKER_CLIENT_CERT` and `GPU_BROKER_CLIENT_KEY`
    /// (unset or empty: none). [`connect_channel`] and `Client::connect` use these.
    pub fn from_env() -> ConnectOptions {
        let var = |name: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        ConnectOptions {
            ca_file: var("GPU_BROKER_CA_FILE"),
            client_cert: var("GPU_BROKER_CLIENT_CERT"),
            client_key: var("GPU_BROKER_CLIENT_KEY"),
        }
    }

    /// The rustls settings of these options.
    fn tls(&self, uri: &str) -> Result<ClientTlsConfig, ClientError> {
        let read = |what: &str, path: &Path| {
            std::fs::read(path).map_err(|e| {
                ClientError::InvalidArgument(
                    format!("reading the TLS {what} {}: {e}", path.display()).into(),
                )
            })
        };
        let ca = self.ca_file.as_deref().ok_or_else(|| {
            ClientError::InvalidArgument(
                format!(
                "broker address {uri:?} is https://: give the CA file that signed the broker's \
                 certificate (--ca-file or GPU_BROKER_CA_FILE)"
            )
                .into(),
            )
        })?;
        let mut tls =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read("CA file", ca)?));
        match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(key)) => {
                tls = tls.identity(Identity::from_pem(
                    read("client certificate", cert)?,
                    read("client key", key)?,
                ));
            }
            (None, None) => {}
            _ => {
                return Err(ClientError::InvalidArgument(
                    "a client certificate needs both its certificate and its key file".into(),
                ))
            }
        }
        Ok(tls)
    }
}

/// The tonic endpoint for a broker address (see the module docs for accepted forms), with
/// the TLS options of [`ConnectOptions::from_env`].
pub fn endpoint(uri: &str) -> Result<Endpoint, ClientError> {
    endpoint_with(uri, &ConnectOptions::from_env())
}

/// The tonic endpoint for a broker address, `https://` ones with the TLS of `opts`.
pub fn endpoint_with(uri: &str, opts: &ConnectOptions) -> Result<Endpoint, ClientError> {
    let normalized = normalize(uri)?;
    let tls = normalized.starts_with("https://");
    let bad = |e: &tonic::transport::Error| {
        ClientError::InvalidArgument(
            format!(
                "bad broker address {uri:?}: {}",
                crate::error::error_chain(e)
            )
            .into(),
        )
    };
    let mut endpoint = Endpoint::from_shared(normalized).map_err(|e| bad(&e))?;
    if tls {
        endpoint = endpoint.tls_config(opts.tls(uri)?).map_err(|e| bad(&e))?;
    }
    Ok(endpoint.connect_timeout(CONNECT_TIMEOUT))
}

/// Dials the broker now; fails with `Transport` when nothing answers.
pub async fn connect_channel(uri: &str) -> Result<Channel, ClientError> {
    connect_channel_with(uri, &ConnectOptions::from_env()).await
}

/// [`connect_channel`] with explicit TLS options.
pub async fn connect_channel_with(
    uri: &str,
    opts: &ConnectOptions,
) -> Result<Channel, ClientError> {
    // A TLS address reads its certificate files: off the runtime.
    let endpoint = if opts == &ConnectOptions::default() {
        endpoint_with(uri, opts)?
    } else {
        let (u, o) = (uri.to_string(), opts.clone());
        tokio::task::spawn_blocking(move || endpoint_with(&u, &o))
            .await
            .map_err(|e| ClientError::Transport(format!("reading the TLS files: {e}")))??
    };
    let channel = endpoint.connect().await.map_err(|e| {
        // The top-level error only says "transport error"; the cause is in its sources.
        let cause = std::error::Error::source(&e)
            .map(crate::error::error_chain)
            .unwrap_or_else(|| e.to_string());
        ClientError::Transport(format!("cannot connect to {uri}: {cause}"))
    })?;
    Ok(channel)
}

/// A channel that dials on first use (errors then surface as `Unavailable`).
pub fn connect_channel_lazy(uri: &str) -> Result<Channel, ClientError> {
    Ok(endpoint(uri)?.connect_lazy())
}

/// Wraps a transport (or a tonic channel) with the bearer-token interceptor.
pub fn authenticated(
    transport: impl Into<Transport>,
    token: &str,
) -> Result<AuthChannel, ClientError> {
    Ok(InterceptedService::new(
        transport.into(),
        AuthInterceptor::new(token)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_addresses() {
        let ok = |s: &str| normalize(s).unwrap_or_else(|e| panic!("{s}: {e}"));
        assert_eq!(
            ok("unix:///run/gpu-broker/broker.sock"),
            "unix:///run/gpu-broker/broker.sock"
        );
        assert_eq!(ok("/tmp/b.sock"), "unix:///tmp/b.sock");
        assert_eq!(ok("http://127.0.0.1:7070"), "http://127.0.0.1:7070");
        assert_eq!(ok("localhost:7070"), "http://localhost:7070");
        assert_eq!(ok("https://broker:7070"), "https://broker:7070");
        for bad in ["", "unix://", "ftp://x"] {
            assert!(
                matches!(normalize(bad), Err(ClientError::InvalidArgument(_))),
                "{bad:?} should be refused"
            );
        }
    }

    #[test]
    fn unix_paths_are_found() {
        let p = |s: &str| unix_path(s).map(|p| p.display().to_string());
        assert_eq!(p("unix:///run/b.sock").as_deref(), Some("/run/b.sock"));
        assert_eq!(p("/run/b.sock").as_deref(), Some("/run/b.sock"));
        assert_eq!(p("unix:/run/b.sock").as_deref(), Some("/run/b.sock"));
        assert_eq!(p("http://127.0.0.1:1"), None);
    }

    #[test]
    fn driven_targets_are_unix_sockets_and_plain_tcp() {
        let t = |s: &str| driven_target(s).unwrap_or_else(|e| panic!("{s}: {e}"));
        assert_eq!(
            t("unix:///run/b.sock"),
            Some(Target::Unix("/run/b.sock".into()))
        );
        assert_eq!(t("/run/b.sock"), Some(Target::Unix("/run/b.sock".into())));
        assert_eq!(
            t("http://127.0.0.1:7070"),
            Some(Target::Tcp("127.0.0.1:7070".into()))
        );
        assert_eq!(t("node1:7070"), Some(Target::Tcp("node1:7070".into())));
        assert_eq!(t("http://node1"), Some(Target::Tcp("node1:80".into())));
        // TLS stays on tonic's channel.
        assert_eq!(t("https://node1:7070"), None);
        assert!(driven_target("ftp://x").is_err());
    }

    #[tokio::test]
    async fn endpoints_build() {
        assert!(endpoint("unix:///tmp/x.sock").is_ok());
        assert!(endpoint("http://127.0.0.1:1").is_ok());
        assert!(endpoint("http://[bad").is_err());
        let none = ConnectOptions::default();
        let e = endpoint_with("https://127.0.0.1:1", &none).unwrap_err();
        assert!(e.to_string().contains("--ca-file"), "{e}");
        let half = ConnectOptions {
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..none
        };
        assert!(matches!(
            endpoint_with("https://127.0.0.1:1", &half),
            Err(ClientError::InvalidArgument(_))
        ));
    }

    #[tokio::test]
    async fn missing_socket_is_a_transport_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nobody.sock");
        let err = connect_channel(&format!("unix://{}", path.display()))
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::Transport(_)), "{err}");
        assert_eq!(err.code(), tonic::Code::Unavailable);
    }

    #[test]
    fn interceptor_adds_bearer_header() {
        let mut icpt = AuthInterceptor::new(" secret-token\n").unwrap();
        let req = icpt.call(tonic::Request::new(())).unwrap();
        let value = req.metadata().get("authorization").unwrap();
        assert_eq!(value.to_str().unwrap(), "Bearer secret-token");
        assert!(!format!("{icpt:?}").contains("secret"));
    }

    #[test]
    fn interceptor_refuses_bad_tokens() {
        assert!(AuthInterceptor::new("").is_err());
        assert!(AuthInterceptor::new("  \n").is_err());
        assert!(AuthInterceptor::new("tok\u{7f}en").is_err());
        assert!(AuthInterceptor::new("tök").is_err());
        assert!(AuthInterceptor::new("two words").is_err());
    }
}
