//! The gate in front of the gRPC services: resolves each request's bearer token to a
//! [`Principal`] once (unknown, revoked and expired tokens stop here), puts it into the
//! request's extensions for the services' interceptors and the audit log, and refuses
//! methods the token's scope does not reach. A `read` token reaches only the methods in
//! [`READ_METHODS`]; everything else it is `PERMISSION_DENIED`. Health and reflection pass
//! without a token, as before.
//!
//! It also applies the per-tenant call rate limit (`rate.rs`).
//!
//! It is a tower layer (`tonic::transport::Server::layer`) because it needs the method
//! path, which tonic interceptors do not see.

use crate::auth::{bearer, AuthError, Authenticator, Principal, Scope};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::codegen::http;

/// The methods a `read` token may call: usage, leases and status, nothing that changes
/// anything. A new read-only method must be added here to be reachable with one.
pub const READ_METHODS: &[&str] = &[
    "/gpubroker.v1.Broker/GetUsage",
    "/gpubroker.v1.Broker/ListLeases",
    "/gpubroker.v1.Admin/GetQuota",
    "/gpubroker.v1.Admin/ListTenants",
    "/gpubroker.v1.Admin/ListAllLeases",
    "/gpubroker.v1.Admin/ListSessions",
    "/gpubroker.v1.Admin/GetDevices",
    "/gpubroker.v1.Admin/ListAudit",
    "/gpubroker.v1.Admin/GetDrain",
    "/gpubroker.v1.Admin/ListQuarantined",
    "/gpubroker.v1.Admin/GetInfo",
    "/gpubroker.v1.Broker/GetInfo",
    "/gpubroker.v1.Admin/ListSharedLeases",
];

/// Paths that need a token: the broker's own services.
const GUARDED_PREFIX: &str = "/gpubroker.v1.";

/// Decides whether `principal` may call `path`.
pub fn check_scope(principal: &Principal, path: &str) -> Result<(), AuthError> {
    match principal.scope {
        // The services' interceptors keep workers out of Admin and admins out of Broker.
        Scope::Worker | Scope::Admin => Ok(()),
        Scope::Read if READ_METHODS.contains(&path) => Ok(()),
        Scope::Read => Err(AuthError::Scope {
            scope: Scope::Read,
            what: format!(
                "{} (a read token may only read usage, leases, devices and status)",
                path.trim_start_matches('/')
            ),
        }),
    }
}

/// The layer: wraps the router.
#[derive(Clone)]
pub struct GateLayer {
    auth: Arc<Authenticator>,
    limits: Option<Arc<crate::rate::RateLimiter>>,
}

impl GateLayer {
    pub fn new(auth: Arc<Authenticator>) -> GateLayer {
        GateLayer { auth, limits: None }
    }

    /// Also limits each tenant's call rate (`rate.rs`); off when `cfg` is.
    pub fn with_rate_limit(mut self, cfg: crate::rate::RateConfig) -> GateLayer {
        self.limits = (!cfg.is_off()).then(|| Arc::new(crate::rate::RateLimiter::new(cfg)));
        self
    }
}

impl<S> tower::Layer<S> for GateLayer {
    type Service = Gate<S>;
    fn layer(&self, inner: S) -> Gate<S> {
        Gate {
            inner,
            auth: self.auth.clone(),
            limits: self.limits.clone(),
        }
    }
}

/// The gate service (see the module doc).
#[derive(Clone)]
pub struct Gate<S> {
    inner: S,
    auth: Arc<Authenticator>,
    limits: Option<Arc<crate::rate::RateLimiter>>,
}

impl<S> Gate<S> {
    /// Resolves and checks a request; on success its principal is in its extensions.
    fn admit<B>(&self, req: &mut http::Request<B>) -> Result<(), tonic::Status> {
        let path = req.uri().path();
        if !path.starts_with(GUARDED_PREFIX) {
            return Ok(());
        }
        let value =
            match req.headers().get("authorization") {
                None => None,
                Some(v) => Some(v.to_str().map_err(|_| {
                    tonic::Status::unauthenticated("malformed authorization header")
                })?),
            };
        let principal = self.auth.authenticate(bearer(value)?)?;
        check_scope(&principal, path)?;
        if let (Some(limits), Some(tenant)) = (&self.limits, &principal.tenant) {
            if principal.scope != Scope::Admin {
                if let Err(wait) = limits.take(tenant, std::time::Instant::now()) {
                    return Err(limits.refusal(tenant, wait));
                }
            }
        }
        req.extensions_mut().insert(principal);
        Ok(())
    }
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B, RB> tower::Service<http::Request<B>> for Gate<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        match self.admit(&mut req) {
            Ok(()) => Box::pin(self.inner.call(req)),
            Err(status) => {
                tracing::debug!(path = %req.uri().path(), code = ?status.code(), message = status.message(), "refused at the gate");
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn principal(scope: Scope) -> Principal {
        Principal {
            token_id: "t".into(),
            name: String::new(),
            scope,
            tenant: None,
        }
    }

    #[test]
    fn read_scope_reaches_only_read_methods() {
        let r = principal(Scope::Read);
        assert!(check_scope(&r, "/gpubroker.v1.Broker/GetUsage").is_ok());
        assert!(check_scope(&r, "/gpubroker.v1.Admin/GetDevices").is_ok());
        for write in [
            "/gpubroker.v1.Broker/AcquireLease",
            "/gpubroker.v1.Broker/OpenSession",
            "/gpubroker.v1.Admin/SetQuota",
            "/gpubroker.v1.Admin/IssueToken",
            "/gpubroker.v1.Admin/ListTokens",
            "/gpubroker.v1.Admin/SomethingAddedLater",
        ] {
            let e = check_scope(&r, write).unwrap_err();
            assert_eq!(tonic::Status::from(e).code(), tonic::Code::PermissionDenied);
        }
        assert!(check_scope(
            &principal(Scope::Worker),
            "/gpubroker.v1.Broker/AcquireLease"
        )
        .is_ok());
        assert!(check_scope(&principal(Scope::Admin), "/gpubroker.v1.Admin/SetQuota").is_ok());
    }
}
