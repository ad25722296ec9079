//! The caller-driven transport: a `tower::Service` for tonic's generated clients over one
//! hyper HTTP/2 connection (Unix socket or plain TCP) that a caller alone on it polls
//! itself while it waits (`link.rs`), instead of tonic's channel, where one call crosses
//! three tasks (request queue, connection, body) and wakes other threads on the way. Dials on first
//! use and again after the connection ended, as tonic's channel does; a failed dial or a
//! connection lost mid-call is `UNAVAILABLE` ("transport error").

mod io;
mod link;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use parking_lot::Mutex;
use tonic::body::Body;
use tonic::codegen::http::{self, uri};
use tonic::codegen::{Bytes, StdError};

pub(crate) use io::Target;
use link::{Exec, Hub, Link};

/// What the transport's calls resolve to.
type CallFuture = Pin<Box<dyn Future<Output = Result<http::Response<Body>, StdError>> + Send>>;

/// A caller-driven HTTP/2 connection to one broker address. Cheap to clone (clones share
/// the connection).
#[derive(Clone)]
pub struct Driven {
    dialer: Arc<Dialer>,
}

struct Dialer {
    target: Target,
    /// `:authority` of every request.
    authority: uri::Authority,
    connect_timeout: Duration,
    /// The live connection, if any.
    current: Mutex<Option<(Arc<Link>, SendRequest<Body>)>>,
    /// One dial at a time (callers arriving meanwhile share its connection).
    dialing: tokio::sync::Mutex<()>,
}

impl Driven {
    /// A transport that dials `target` on first use.
    pub(crate) fn lazy(target: Target, connect_timeout: Duration) -> Driven {
        let authority = match &target {
            Target::Unix(_) => uri::Authority::from_static("localhost"),
            Target::Tcp(addr) => addr
                .parse()
                .unwrap_or_else(|_| uri::Authority::from_static("localhost")),
        };
        Driven {
            dialer: Arc::new(Dialer {
                target,
                authority,
                connect_timeout,
                current: Mutex::new(None),
                dialing: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// Dials now (the connection is then kept for the first calls).
    pub(crate) async fn connect(&self) -> Result<(), tonic::Status> {
        self.dialer.link().await.map(|_| ())
    }
}

impl std::fmt::Debug for Driven {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driven")
            .field("target", &self.dialer.target)
            .finish_non_exhaustive()
    }
}

impl Dialer {
    /// The live connection, dialled if there is none.
    async fn link(&self) -> Result<(Arc<Link>, SendRequest<Body>), tonic::Status> {
        if let Some(live) = self.live() {
            return Ok(live);
        }
        let _one = self.dialing.lock().await;
        if let Some(live) = self.live() {
            return Ok(live);
        }
        let dialled = tokio::time::timeout(self.connect_timeout, self.dial())
            .await
            .unwrap_or_else(|_| Err("timed out".to_string()))
            .map_err(|e| {
                tonic::Status::unavailable(format!(
                    "transport error: cannot connect to the broker ({:?}): {e}",
                    self.target
                ))
            })?;
        *self.current.lock() = Some(dialled.clone());
        Ok(dialled)
    }

    fn live(&self) -> Option<(Arc<Link>, SendRequest<Body>)> {
        let current = self.current.lock();
        current
            .as_ref()
            .filter(|(link, sender)| !link.ended() && !sender.is_closed())
            .cloned()
    }

    /// A new connection and its background driver (on the caller's runtime).
    async fn dial(&self) -> Result<(Arc<Link>, SendRequest<Body>), String> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| "no tokio runtime to drive the connection on".to_string())?;
        let io = self.target.dial().await.map_err(|e| e.to_string())?;
        let hub = Hub::new();
        // Callers drive the connection on whatever thread polls them: no keep-alive or
        // adaptive window is set, so hyper makes no timer there (one would need a tokio
        // context in every caller).
        let (sender, conn) = hyper::client::conn::http2::Builder::new(Exec(hub.clone()))
            .timer(hyper_util::rt::TokioTimer::new())
            .handshake(hyper_util::rt::TokioIo::new(io))
            .await
            .map_err(|e| crate::error::error_chain(&e))?;
        let link = Link::new(hub, Box::pin(conn));
        runtime.spawn(link.clone().background());
        Ok((link, sender))
    }
}

impl tower::Service<http::Request<Body>> for Driven {
    type Response = http::Response<Body>;
    type Error = StdError;
    type Future = CallFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        let dialer = self.dialer.clone();
        Box::pin(async move {
            let (link, sender) = dialer.link().await?;
            let mut parts = std::mem::take(req.uri_mut()).into_parts();
            parts.scheme = Some(uri::Scheme::HTTP);
            parts.authority = Some(dialer.authority.clone());
            *req.uri_mut() = http::Uri::from_parts(parts)
                .map_err(|e| tonic::Status::internal(format!("request URI: {e}")))?;
            let id = link.caller();
            let call = Call {
                link: link.clone(),
                id,
                unsent: Some((sender, req)),
                response: None,
                done: false,
            };
            let response = call.await.map_err(status_of)?;
            Ok(response.map(|body| {
                Body::new(DrivenBody {
                    inner: Some(body),
                    link,
                })
            }))
        })
    }
}

/// A hyper error as the status a caller sees: the server's reset codes as tonic maps them;
/// a connection that broke, closed, went away (GOAWAY: tonic says `INTERNAL` for its
/// `NO_ERROR`, gRPC says `UNAVAILABLE`) or could not take the request is `UNAVAILABLE`.
fn status_of(e: hyper::Error) -> StdError {
    let went_away = std::error::Error::source(&e)
        .and_then(|s| s.downcast_ref::<h2::Error>())
        .filter(|h2| h2.is_go_away())
        .map(|_| crate::error::error_chain(&e));
    if let Some(cause) = went_away {
        return Box::new(tonic::Status::unavailable(format!(
            "transport error: the broker turned the call away: {cause}"
        )));
    }
    let status = tonic::Status::from_error(Box::new(e));
    match status.code() {
        tonic::Code::Unknown | tonic::Code::Cancelled => {
            let cause = std::error::Error::source(&status)
                .map(crate::error::error_chain)
                .unwrap_or_else(|| status.message().to_string());
            Box::new(tonic::Status::unavailable(format!(
                "transport error: {cause}"
            )))
        }
        _ => Box::new(status),
    }
}

type Responding = Pin<Box<dyn Future<Output = hyper::Result<http::Response<Incoming>>> + Send>>;

/// One call waiting for its response headers, driving the connection while it waits if it
/// is the only call in flight.
struct Call {
    link: Arc<Link>,
    id: u64,
    /// Until the first poll: the request is sent once this call knows whether it drives,
    /// so that the connection's wake for it does not go to another thread.
    unsent: Option<(SendRequest<Body>, http::Request<Body>)>,
    response: Option<Responding>,
    done: bool,
}

impl Call {
    fn finish(&mut self) {
        self.response = None;
        self.done = true;
        self.link.leave(self.id);
    }

    fn poll_response(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<hyper::Result<http::Response<Incoming>>> {
        let Some(response) = self.response.as_mut() else {
            return Poll::Pending;
        };
        let r = response.as_mut().poll(cx);
        if r.is_ready() {
            self.finish();
        }
        r
    }
}

impl Future for Call {
    type Output = hyper::Result<http::Response<Incoming>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Poll::Ready(r) = this.poll_response(cx) {
            return Poll::Ready(r);
        }
        let drives = this.link.take(this.id, cx.waker());
        match this.unsent.take() {
            Some((mut sender, req)) => {
                let response = &mut this.response;
                let send = move || *response = Some(Box::pin(sender.send_request(req)));
                if drives {
                    this.link.drive(send);
                } else {
                    send();
                }
            }
            None if drives => {
                this.link.drive(|| ());
            }
            None => return Poll::Pending,
        }
        this.poll_response(cx)
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if !self.done {
            // The response first: its cancellation (a reset) is work for the next driver.
            self.response = None;
            self.link.leave(self.id);
        }
    }
}

/// A response body that drives the connection while it waits for frames and nobody else
/// drives, and when it is dropped (h2 wakes the connection to forget the stream).
struct DrivenBody {
    /// `None` once dropped.
    inner: Option<Incoming>,
    link: Arc<Link>,
}

impl DrivenBody {
    fn inner(&mut self) -> Pin<&mut Incoming> {
        Pin::new(
            self.inner
                .as_mut()
                .expect("a body is polled only before it is dropped"),
        )
    }
}

impl Drop for DrivenBody {
    fn drop(&mut self) {
        let inner = self.inner.take();
        self.link.drive_if_idle(None, move || drop(inner));
    }
}

impl http_body::Body for DrivenBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, hyper::Error>>> {
        if let Poll::Ready(frame) = self.inner().poll_frame(cx) {
            return Poll::Ready(frame);
        }
        self.link.drive_if_idle(Some(cx.waker()), || ());
        self.inner().poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| http_body::SizeHint::with_exact(0), |b| b.size_hint())
    }
}
