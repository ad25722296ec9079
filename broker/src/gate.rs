//! The gate in front of the gRPC services: resolves each request's bearer token to a
//! [`Principal`] once (unknown, revoked and expired tokens stop here), puts it into the
//! request's extensions for the services' interceptors and the audit log, and refuses
//! methods the token's scope does not reach. A `read` token reaches only the methods in
//! [`READ_METHODS`]; everything else it is `PERMISSION_DENIED`. Workers' tokens reach no
//! Admin method and the admin token no Broker method ([`check_scope`]): refused here, so
//! nothing of such a call is moved to the operators' runtime (`read_pool.rs`, the layer
//! after this one). Health and reflection pass without a token, as before.
//!
//! It also applies the per-tenant call rate limit (`rate.rs`).
//!
//! A Kubernetes ServiceAccount token (when the broker accepts them, `token_review.rs`) that
//! is new or whose review is older than the cache time is reviewed by the API server
//! before the call is handed on: that one call waits for the answer.
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
    // Claims' tenants, bytes, devices and labels: no more than the leases and sessions
    // listed above show (no token, only its public id).
    "/gpubroker.v1.Admin/ListClaims",
];

/// Paths that need a token: the broker's own services.
const GUARDED_PREFIX: &str = "/gpubroker.v1.";

/// The path prefix of the `Broker` service (workers' calls).
const BROKER_SERVICE: &str = "/gpubroker.v1.Broker/";

/// Decides whether `principal` may call `path`: here, before the call is handed on (an
/// Admin call to the operators' runtime), so a token that may not call a service is
/// refused by the gate and nothing of its call runs elsewhere. Workers' tokens (and
/// tenant-bound read tokens) reach no Admin method, the admin token no Broker method,
/// a node-wide read token no Broker method; a read token only [`READ_METHODS`]. (The
/// services' interceptors check the same again.)
pub fn check_scope(principal: &Principal, path: &str) -> Result<(), AuthError> {
    let refuse = |why: &str| {
        Err(AuthError::Scope {
            scope: principal.scope,
            what: format!("{} ({why})", path.trim_start_matches('/')),
        })
    };
    let admin = path.starts_with(crate::read_pool::ADMIN_SERVICE);
    let broker = path.starts_with(BROKER_SERVICE);
    match (principal.scope, &principal.tenant) {
        (Scope::Worker, _) | (Scope::Read, Some(_)) if admin => {
            refuse("tenant tokens cannot call the Admin service")
        }
        (Scope::Admin, _) if broker => {
            refuse("the admin token is for the Admin service; workers use a tenant token")
        }
        (Scope::Read, None) if broker => {
            refuse("a node-wide read token has no tenant: it reads through the Admin service")
        }
        (Scope::Worker | Scope::Admin, _) => Ok(()),
        (Scope::Read, _) if READ_METHODS.contains(&path) => Ok(()),
        (Scope::Read, _) => refuse("a read token may only read usage, leases, devices and status"),
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

    /// Also limits each tenant's call rate with `limits` (`rate.rs`; the arbiter's, which
    /// the lease lines draw on too); none: off.
    pub fn with_rate_limits(mut self, limits: Option<Arc<crate::rate::RateLimiter>>) -> GateLayer {
        self.limits = limits;
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

/// What the gate made of a request.
enum Admission {
    /// Admitted (its principal in its extensions), or needing no token.
    Admitted,
    /// A ServiceAccount token the API server must be asked about first.
    Review(String),
}

impl<S> Gate<S> {
    /// Resolves and checks a request; on success its principal is in its extensions.
    fn admit<B>(&self, req: &mut http::Request<B>) -> Result<Admission, tonic::Status> {
        let path = req.uri().path();
        if !path.starts_with(GUARDED_PREFIX) {
            return Ok(Admission::Admitted);
        }
        let value = match req.headers().get("authorization") {
            None => None,
            Some(v) => Some(v.to_str().map_err(|_| crate::auth::malformed_header())?),
        };
        let token = bearer(value)?;
        let known = self.auth.authenticate(token);
        if let Some(reviewer) = self.auth.reviewer() {
            let review = match &known {
                Err(AuthError::Unknown) => crate::token_review::looks_like_jwt(token),
                Ok(_) => {
                    let h = crate::auth::hash_token(token);
                    self.auth.is_reviewed(&h) && !reviewer.fresh(&h)
                }
                Err(_) => false,
            };
            if review {
                return Ok(Admission::Review(token.to_string()));
            }
        }
        admit_principal(&self.limits, req, known?)?;
        Ok(Admission::Admitted)
    }
}

/// Checks `principal`'s scope and rate on `req`, then puts it into its extensions.
fn admit_principal<B>(
    limits: &Option<Arc<crate::rate::RateLimiter>>,
    req: &mut http::Request<B>,
    principal: Principal,
) -> Result<(), tonic::Status> {
    check_scope(&principal, req.uri().path())?;
    if let (Some(limits), Some(tenant)) = (limits, &principal.tenant) {
        if principal.scope != Scope::Admin {
            if let Err(wait) = limits.take(tenant, std::time::Instant::now()) {
                return Err(limits.refusal(tenant, wait));
            }
        }
    }
    req.extensions_mut().insert(principal);
    Ok(())
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B, RB> tower::Service<http::Request<B>> for Gate<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
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
            Ok(Admission::Admitted) => Box::pin(self.inner.call(req)),
            Ok(Admission::Review(token)) => {
                // The service made ready is the one called; a clone stays for the next call.
                let ready = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, ready);
                let (auth, limits) = (self.auth.clone(), self.limits.clone());
                Box::pin(async move {
                    let reviewed = match auth.reviewer() {
                        Some(r) => r.review(&auth, &token).await,
                        None => Err(AuthError::Unknown),
                    };
                    let admitted = reviewed
                        .map_err(tonic::Status::from)
                        .and_then(|p| admit_principal(&limits, &mut req, p));
                    match admitted {
                        Ok(()) => inner.call(req).await,
                        Err(status) => {
                            tracing::debug!(path = %req.uri().path(), code = ?status.code(), message = status.message(), "refused at the gate");
                            Ok(status.into_http())
                        }
                    }
                })
            }
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
        // Broker reads with a tenant's read token (a node-wide one has no tenant there).
        assert!(check_scope(&of_tenant(Scope::Read), "/gpubroker.v1.Broker/GetUsage").is_ok());
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

    fn of_tenant(scope: Scope) -> Principal {
        Principal {
            tenant: Some("t".into()),
            ..principal(scope)
        }
    }

    #[test]
    fn each_token_reaches_only_its_service() {
        let denied = |p: &Principal, path: &str| {
            let e = check_scope(p, path).unwrap_err();
            let status = tonic::Status::from(e);
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{path}");
            status.message().to_string()
        };
        // Workers' tokens: no Admin method, reads included.
        let worker = of_tenant(Scope::Worker);
        for path in [
            "/gpubroker.v1.Admin/SetQuota",
            "/gpubroker.v1.Admin/GetQuota",
            "/gpubroker.v1.Admin/ListAllLeases",
            "/gpubroker.v1.Admin/SomethingAddedLater",
        ] {
            let m = denied(&worker, path);
            assert!(
                m.contains("worker token") && m.contains("cannot call the Admin service"),
                "{m}"
            );
        }
        assert!(check_scope(&worker, "/gpubroker.v1.Broker/ListLeases").is_ok());
        // A tenant's read token: its tenant's reads on Broker, nothing on Admin.
        let reader = of_tenant(Scope::Read);
        assert!(check_scope(&reader, "/gpubroker.v1.Broker/GetUsage").is_ok());
        denied(&reader, "/gpubroker.v1.Admin/GetQuota");
        // A node-wide read token: Admin reads, no Broker method.
        let node_reader = principal(Scope::Read);
        assert!(check_scope(&node_reader, "/gpubroker.v1.Admin/GetQuota").is_ok());
        let m = denied(&node_reader, "/gpubroker.v1.Broker/ListLeases");
        assert!(m.contains("node-wide read token"), "{m}");
        // The admin token: no Broker method (the offloaded listings included).
        let admin = principal(Scope::Admin);
        for path in [
            "/gpubroker.v1.Broker/ListLeases",
            "/gpubroker.v1.Broker/AcquireLease",
        ] {
            let m = denied(&admin, path);
            assert!(m.contains("is for the Admin service"), "{m}");
        }
    }

    /// A service that counts the calls it is handed and answers OK.
    #[derive(Clone, Default)]
    struct Counts(Arc<std::sync::atomic::AtomicUsize>);

    impl tower::Service<http::Request<tonic::body::Body>> for Counts {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: http::Request<tonic::body::Body>) -> Self::Future {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Box::pin(async { Ok(http::Response::new(tonic::body::Body::empty())) })
        }
    }

    #[tokio::test]
    async fn a_token_refused_by_its_scope_never_reaches_the_operators_runtime() {
        use tower::{Layer, ServiceExt};
        let (auth, worker) = crate::auth::tests::auth_with_tenant();
        // As served: the gate, then the layer that offloads Admin calls.
        let pool = crate::read_pool::ReadPool::start(1).unwrap();
        let handed = Counts::default();
        let svc = GateLayer::new(auth).layer(pool.layer().layer(handed.clone()));
        let call = |token: &str, path: &str| {
            http::Request::builder()
                .uri(format!("http://x{path}"))
                .header("authorization", format!("Bearer {token}"))
                .body(tonic::body::Body::empty())
                .unwrap()
        };
        for (token, path) in [
            (worker.as_str(), "/gpubroker.v1.Admin/SetQuota"),
            (worker.as_str(), "/gpubroker.v1.Admin/ListTenants"),
            ("admin-secret", "/gpubroker.v1.Broker/ListLeases"),
        ] {
            let resp = svc.clone().oneshot(call(token, path)).await.unwrap();
            let status = tonic::Status::from_header_map(resp.headers()).unwrap();
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{path}");
            assert_eq!(
                handed.0.load(std::sync::atomic::Ordering::SeqCst),
                0,
                "{path}: refused at the gate, never handed on"
            );
        }
        // The right tokens are handed on (and offloaded).
        for (token, path) in [
            ("admin-secret", "/gpubroker.v1.Admin/SetQuota"),
            (worker.as_str(), "/gpubroker.v1.Broker/ListLeases"),
        ] {
            let resp = svc.clone().oneshot(call(token, path)).await.unwrap();
            assert!(tonic::Status::from_header_map(resp.headers()).is_none());
        }
        assert_eq!(handed.0.load(std::sync::atomic::Ordering::SeqCst), 2);
    }
}
