//! The routes of the metrics listener (plain HTTP/1.1, read-only): `/metrics`
//! (OpenMetrics when the scraper asks for it, else the Prometheus text format), `/status`
//! (the status page, `status_page`; same access as `/metrics`), `/healthz`
//! (the process answers) and `/readyz` (serving, not shutting down), which never need a
//! token so that probes work. `/metrics` needs `Authorization: Bearer <token>` (a `read`
//! token not bound to a tenant, or an admin token) when [`HttpAccess::require_token`] is set; otherwise the listener's address is the access
//! control (it binds 127.0.0.1 unless told otherwise). The accept loop is
//! `server::serve_metrics`.

use crate::arbiter::Arbiter;
use crate::metrics::Format;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};

/// Default address of the metrics listener: loopback only, on a port no common exporter
/// uses (the Prometheus exporter range 9100-9999 is fully allocated).
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7478";

/// Who may read the metrics listener.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HttpAccess {
    /// `/metrics` needs a bearer token: node-wide `read` scope or `admin`.
    pub require_token: bool,
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Does the request carry a token that may read?
fn authorized<B>(arb: &Arbiter, req: &Request<B>) -> bool {
    let Some(value) = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some(token) = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
    else {
        return false;
    };
    // Node-wide readers only: the admin token, or a read token not bound to a tenant
    // (what the metrics show is every tenant's).
    arb.authenticator()
        .authorize_read(token.trim())
        .is_ok_and(|p| p.tenant.is_none())
}

/// Answers one request of the metrics listener.
pub async fn respond<B>(
    arb: &Arbiter,
    access: HttpAccess,
    req: &Request<B>,
) -> Response<Full<Bytes>> {
    if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
    }
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" if arb.lifecycle().is_shutting_down() => {
            text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n")
        }
        "/readyz" => text(StatusCode::OK, "ready\n"),
        "/status" | "/metrics" => {
            if access.require_token && !authorized(arb, req) {
                let mut r = text(
                    StatusCode::UNAUTHORIZED,
                    "send Authorization: Bearer <token> (a read token without a tenant, or an admin token)\n",
                );
                r.headers_mut().insert(
                    hyper::header::WWW_AUTHENTICATE,
                    hyper::header::HeaderValue::from_static("Bearer realm=\"gpu-broker\""),
                );
                return r;
            }
            if req.uri().path() == "/status" {
                let body = crate::status_page::render(arb).await;
                let mut r = Response::new(Full::new(Bytes::from(body)));
                r.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("text/html; charset=utf-8"),
                );
                return r;
            }
            let format = Format::negotiate(
                req.headers()
                    .get(hyper::header::ACCEPT)
                    .and_then(|v| v.to_str().ok()),
            );
            let body = arb.views().metrics_text(format).await;
            let mut r = Response::new(Full::new(Bytes::from(body)));
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(format.content_type()),
            );
            r
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}
