//! Reaching the broker: turning a URI into a tonic [`Channel`] and stamping every
//! request with `authorization: Bearer <token>`. Accepted URIs are
//! `unix:///path/to/broker.sock` (tonic 0.14 dials Unix sockets natively), a bare
//! absolute path (taken as a Unix socket), `http://host:port`, and `host:port`
//! (taken as `http://`). TLS is not built in: the broker listens on a local socket
//! or a trusted network. Channels reconnect on their own after a broken connection.

use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Channel, Endpoint};

use crate::error::ClientError;

/// A channel whose requests all carry the bearer token.
pub type AuthChannel = InterceptedService<Channel, AuthInterceptor>;

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
            return Err(ClientError::InvalidArgument(format!(
                "broker address {uri:?} names no socket path"
            )));
        }
        return Ok(uri.to_string());
    }
    if uri.starts_with("https://") {
        return Err(ClientError::InvalidArgument(format!(
            "broker address {uri:?}: TLS is not supported, use http:// or unix://"
        )));
    }
    if uri.starts_with("http://") {
        return Ok(uri.to_string());
    }
    if uri.contains("://") {
        return Err(ClientError::InvalidArgument(format!(
            "broker address {uri:?}: scheme must be unix:// or http://"
        )));
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

/// The tonic endpoint for a broker address (see the module docs for accepted forms).
pub fn endpoint(uri: &str) -> Result<Endpoint, ClientError> {
    let normalized = normalize(uri)?;
    let endpoint = Endpoint::from_shared(normalized).map_err(|e| {
        ClientError::InvalidArgument(format!(
            "bad broker address {uri:?}: {}",
            crate::error::error_chain(&e)
        ))
    })?;
    Ok(endpoint.connect_timeout(CONNECT_TIMEOUT))
}

/// Dials the broker now; fails with `Transport` when nothing answers.
pub async fn connect_channel(uri: &str) -> Result<Channel, ClientError> {
    let channel = endpoint(uri)?.connect().await.map_err(|e| {
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

/// Wraps a channel with the bearer-token interceptor.
pub fn authenticated(channel: Channel, token: &str) -> Result<AuthChannel, ClientError> {
    Ok(InterceptedService::new(
        channel,
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
        for bad in ["", "unix://", "https://x:1", "ftp://x"] {
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

    #[tokio::test]
    async fn endpoints_build() {
        assert!(endpoint("unix:///tmp/x.sock").is_ok());
        assert!(endpoint("http://127.0.0.1:1").is_ok());
        assert!(endpoint("http://[bad").is_err());
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
