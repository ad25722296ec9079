//! Where operators' calls run: every call of the `Admin` service (reads and changes
//! alike), the Broker-side listings of [`OFFLOADED_BROKER`] and the metrics listener
//! (`/metrics`, `/status`) are served on a small runtime of their own (`--admin-threads`,
//! default 2; 0: on the main runtime), so handling them, encoding their answers and
//! rendering the scrape never take the worker threads that admission's calls (acquire,
//! release, turns, session streams) run on, however large the listing or however often
//! an operator writes.
//!
//! [`ReadsLayer`] is the tower layer in front of the gRPC routes that moves such a call
//! there ([`offloaded`]): the handler runs and its response is encoded on the operators'
//! runtime (the whole body, a bounded page), and the main runtime only forwards the
//! encoded frames. The state lock is the same for both; listings hold it for short chunks
//! (`arbiter/listing.rs`). The optional operators' socket (`--admin-listen`, `server.rs`)
//! is served wholly on this runtime, its HTTP/2 connections included.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tonic::body::Body;
use tonic::codegen::http;

/// The path prefix of the `Admin` service: every one of its calls (all unary) is served on
/// the operators' runtime.
pub const ADMIN_SERVICE: &str = "/gpubroker.v1.Admin/";

/// The Broker-side calls served on the operators' runtime too: unary listings whose
/// answer grows with the number of leases.
pub const OFFLOADED_BROKER: &[&str] = &[
    "/gpubroker.v1.Broker/ListLeases",
    "/gpubroker.v1.Broker/ListSharedLeases",
];

/// Whether the call to `path` is served on the operators' runtime.
pub fn offloaded(path: &str) -> bool {
    path.starts_with(ADMIN_SERVICE) || OFFLOADED_BROKER.contains(&path)
}

/// Name of the operators' runtime's threads.
pub const THREAD_NAME: &str = "gpu-broker-reads";

/// The reads runtime (None with 0 threads: reads run where they arrive).
pub struct ReadPool {
    rt: Option<tokio::runtime::Runtime>,
}

impl ReadPool {
    /// Starts a runtime of `threads` worker threads (0: none).
    pub fn start(threads: usize) -> std::io::Result<ReadPool> {
        let rt = match threads {
            0 => None,
            n => Some(
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(n)
                    .thread_name(THREAD_NAME)
                    .enable_all()
                    .build()?,
            ),
        };
        Ok(ReadPool { rt })
    }

    /// Where to spawn reads (None: on the caller's runtime).
    pub fn handle(&self) -> Option<tokio::runtime::Handle> {
        self.rt.as_ref().map(|rt| rt.handle().clone())
    }

    /// The layer that moves [`offloaded`] calls to this runtime.
    pub fn layer(&self) -> ReadsLayer {
        ReadsLayer {
            handle: self.handle(),
        }
    }
}

/// Tests: a multi-threaded runtime of one worker named "main-worker", standing for the
/// broker's main runtime (one task that blocks it stalls it).
#[cfg(test)]
pub(crate) fn main_runtime_of_one_worker() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("main-worker")
        .enable_all()
        .build()
        .unwrap()
}

impl Drop for ReadPool {
    fn drop(&mut self) {
        // May be dropped from within an async context (a test's runtime): never block.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// The tower layer (see the module doc); without a runtime it passes every call through.
#[derive(Clone, Default)]
pub struct ReadsLayer {
    handle: Option<tokio::runtime::Handle>,
}

impl ReadsLayer {
    /// The runtime calls are moved to (None: they run where they arrive).
    pub fn runtime(&self) -> Option<tokio::runtime::Handle> {
        self.handle.clone()
    }
}

impl<S> tower::Layer<S> for ReadsLayer {
    type Service = Reads<S>;
    fn layer(&self, inner: S) -> Reads<S> {
        Reads {
            inner,
            handle: self.handle.clone(),
        }
    }
}

/// The service of [`ReadsLayer`].
#[derive(Clone)]
pub struct Reads<S> {
    inner: S,
    handle: Option<tokio::runtime::Handle>,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// Runs `call` to its response and reads the whole response body (it is encoded as it is
/// read); the frames, replayed as a body ([`Replay`]).
async fn answered<F, E>(call: F) -> Result<http::Response<Body>, E>
where
    F: Future<Output = Result<http::Response<Body>, E>>,
{
    use http_body_util::BodyExt;
    let (parts, mut body) = call.await?.into_parts();
    let mut replay = Replay::default();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => replay.frames.push_back(frame),
            Err(e) => {
                replay.failed = Some(e);
                break;
            }
        }
    }
    Ok(http::Response::from_parts(parts, Body::new(replay)))
}

/// A read body's frames, replayed. It says it is at its end as soon as nothing is left:
/// a refusal (a trailers-only response, its status in the headers and no frames) then
/// goes out as one HEADERS frame with END_STREAM, as tonic sent it. A body that is never
/// at its end sends an empty DATA frame after those headers, which grpc-core clients
/// (grpcio, C++) read as `UNKNOWN: Stream removed`, losing the status.
#[derive(Default)]
struct Replay {
    frames: std::collections::VecDeque<http_body::Frame<tonic::codegen::Bytes>>,
    /// The error that ended the read, given after the frames.
    failed: Option<tonic::Status>,
}

impl http_body::Body for Replay {
    type Data = tonic::codegen::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let next = match self.frames.pop_front() {
            Some(frame) => Some(Ok(frame)),
            None => self.failed.take().map(Err),
        };
        Poll::Ready(next)
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty() && self.failed.is_none()
    }

    /// The data left as a lower bound only: an exact size would have hyper add a
    /// content-length header, which a gRPC answer never carries.
    fn size_hint(&self) -> http_body::SizeHint {
        if self.is_end_stream() {
            return http_body::SizeHint::with_exact(0);
        }
        let left = self
            .frames
            .iter()
            .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
            .sum();
        let mut hint = http_body::SizeHint::new();
        hint.set_lower(left);
        hint
    }
}

impl<S> tower::Service<http::Request<Body>> for Reads<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let Some(rt) = self.handle.clone().filter(|_| offloaded(req.uri().path())) else {
            return Box::pin(self.inner.call(req));
        };
        // The service that was made ready takes the call; a clone stays for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            // Spawned when first polled, inside the call's span (`trace_fn`), which the
            // read keeps, and logging through the caller's dispatcher (the process's
            // global one in the broker; a test's own otherwise). Dropped (the caller went
            // away): the read is aborted at its next await.
            use tracing::instrument::WithSubscriber;
            use tracing::Instrument;
            let call = answered(inner.call(req))
                .instrument(tracing::Span::current())
                .with_current_subscriber();
            let task = tokio_util::task::AbortOnDropHandle::new(rt.spawn(call));
            match task.await {
                Ok(r) => r,
                Err(e) => Ok(tonic::Status::internal(format!("the read failed: {e}")).into_http()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{Layer, Service, ServiceExt};

    /// A service answering with the name of the thread that ran it, as the body, and a
    /// trailer.
    #[derive(Clone)]
    struct WhereRun;

    impl Service<http::Request<Body>> for WhereRun {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: http::Request<Body>) -> Self::Future {
            Box::pin(async {
                tokio::task::yield_now().await;
                let name = std::thread::current().name().unwrap_or("").to_string();
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                let frames: Vec<Result<_, tonic::Status>> = vec![
                    Ok(http_body::Frame::data(tonic::codegen::Bytes::from(name))),
                    Ok(http_body::Frame::trailers(trailers)),
                ];
                Ok(http::Response::new(Body::new(
                    http_body_util::StreamBody::new(futures::stream::iter(frames)),
                )))
            })
        }
    }

    async fn call(layer: &ReadsLayer, path: &str) -> (String, Option<http::HeaderMap>) {
        use http_body_util::BodyExt;
        let req = http::Request::builder()
            .uri(format!("http://x{path}"))
            .body(Body::empty())
            .unwrap();
        let resp = layer.layer(WhereRun).oneshot(req).await.unwrap();
        let collected = resp.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned();
        (
            String::from_utf8(collected.to_bytes().to_vec()).unwrap(),
            trailers,
        )
    }

    #[test]
    fn admin_calls_and_listings_run_on_the_operators_runtime_and_everything_else_where_it_arrives()
    {
        let pool = ReadPool::start(1).unwrap();
        let main = main_runtime_of_one_worker();
        let layer = pool.layer();
        // Every call of the Admin service, changes included, as the proto declares them
        // (a new one is checked without being listed here); the Broker-side listings are
        // calls of the Broker service.
        use gpu_broker_proto::paths::{ADMIN, BROKER};
        assert!(ADMIN.len() >= 20, "{ADMIN:?}");
        for path in OFFLOADED_BROKER {
            assert!(
                BROKER.contains(path),
                "{path} is no call of the Broker service"
            );
        }
        // On a worker of the main runtime, as a served call is.
        main.block_on(main.spawn(async move {
            for path in ADMIN.iter().chain(OFFLOADED_BROKER) {
                let (ran_on, trailers) = call(&layer, path).await;
                assert_eq!(ran_on, THREAD_NAME, "{path}");
                // The body's frames come through whole, trailers (the gRPC status) too.
                assert_eq!(trailers.unwrap()["grpc-status"], "0", "{path}");
            }
            let others = BROKER.iter().filter(|p| !OFFLOADED_BROKER.contains(p));
            for path in others.chain(&[
                "/gpubroker.v1.AdminX/SetQuota",
                "/grpc.health.v1.Health/Check",
            ]) {
                let (ran_on, _) = call(&layer, path).await;
                assert_eq!(ran_on, "main-worker", "{path}");
            }
        }))
        .unwrap();
        // With no reads runtime every call runs where it arrives.
        let inline = ReadPool::start(0).unwrap();
        assert!(inline.handle().is_none());
        let layer = inline.layer();
        main.block_on(main.spawn(async move {
            let (ran_on, _) = call(&layer, "/gpubroker.v1.Admin/SetQuota").await;
            assert_eq!(ran_on, "main-worker");
        }))
        .unwrap();
    }

    /// A service refusing every call as a handler or an interceptor does: a trailers-only
    /// response (the status in the headers, an empty body).
    #[derive(Clone)]
    struct Refuses;

    impl Service<http::Request<Body>> for Refuses {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: http::Request<Body>) -> Self::Future {
            Box::pin(async {
                tokio::task::yield_now().await;
                Ok(tonic::Status::not_found("no such lease").into_http())
            })
        }
    }

    #[test]
    fn a_refusal_moved_to_the_operators_runtime_stays_trailers_only() {
        use http_body::Body as _;
        use http_body_util::BodyExt;
        let pool = ReadPool::start(1).unwrap();
        let main = main_runtime_of_one_worker();
        let layer = pool.layer();
        main.block_on(main.spawn(async move {
            let req = http::Request::builder()
                .uri("http://x/gpubroker.v1.Admin/GetLease")
                .body(Body::empty())
                .unwrap();
            let resp = layer.layer(Refuses).oneshot(req).await.unwrap();
            assert_eq!(resp.headers()["grpc-status"], "5");
            // At its end already: hyper sends the headers with END_STREAM, and no DATA
            // frame a grpc-core client would take for a broken stream.
            let body = resp.into_body();
            assert!(body.is_end_stream());
            assert_eq!(body.size_hint().exact(), Some(0));

            // An answer with a body: its frames, then at its end (and only then).
            let req = http::Request::builder()
                .uri("http://x/gpubroker.v1.Admin/ListTenants")
                .body(Body::empty())
                .unwrap();
            let mut body = layer
                .layer(WhereRun)
                .oneshot(req)
                .await
                .unwrap()
                .into_body();
            assert!(!body.is_end_stream());
            assert_eq!(body.size_hint().lower(), THREAD_NAME.len() as u64);
            assert_eq!(body.size_hint().upper(), None, "no content-length for gRPC");
            let data = body.frame().await.unwrap().unwrap();
            assert_eq!(data.data_ref().unwrap().as_ref(), THREAD_NAME.as_bytes());
            assert!(!body.is_end_stream());
            let trailers = body.frame().await.unwrap().unwrap();
            assert_eq!(trailers.trailers_ref().unwrap()["grpc-status"], "0");
            assert!(body.is_end_stream());
            assert!(body.frame().await.is_none());
        }))
        .unwrap();
    }

    /// A service that logs "served" where it runs, and answers with an empty body. Not
    /// [`WhereRun`] logging too: its callsite must be this test's alone (shared with the
    /// test above, which runs at the same time with no subscriber, its events were lost
    /// now and then: tracing caches a callsite's interest).
    #[derive(Clone)]
    struct Logs;

    impl Service<http::Request<Body>> for Logs {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: http::Request<Body>) -> Self::Future {
            Box::pin(async {
                tokio::task::yield_now().await;
                tracing::info!("served");
                Ok(http::Response::new(Body::empty()))
            })
        }
    }

    /// What a fmt subscriber wrote, line by line.
    #[derive(Clone, Default)]
    struct Captured(std::sync::Arc<parking_lot::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn an_offloaded_call_logs_on_the_operators_runtime_in_the_callers_span() {
        use tracing::instrument::WithSubscriber;
        use tracing::Instrument;
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_thread_names(true)
            .finish();
        let dispatch = tracing::Dispatch::new(subscriber);
        let pool = ReadPool::start(1).unwrap();
        let main = main_runtime_of_one_worker();
        let layer = pool.layer();
        main.block_on(
            main.spawn(
                async move {
                    for path in [
                        "/gpubroker.v1.Admin/SetQuota",
                        "/gpubroker.v1.Broker/GetUsage",
                    ] {
                        let req = http::Request::builder()
                            .uri(format!("http://x{path}"))
                            .body(Body::empty())
                            .unwrap();
                        layer
                            .layer(Logs)
                            .oneshot(req)
                            .instrument(tracing::info_span!("rpc", method = path))
                            .await
                            .unwrap();
                    }
                }
                .with_subscriber(dispatch),
            ),
        )
        .unwrap();
        let text = String::from_utf8(out.0.lock().clone()).unwrap();
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("served")).collect();
        assert_eq!(lines.len(), 2, "{text}");
        // The offloaded call: written on the operators' runtime, in the caller's span.
        assert!(
            lines[0].contains(THREAD_NAME)
                && lines[0].contains("rpc{method=\"/gpubroker.v1.Admin/SetQuota\"}"),
            "{text}"
        );
        // The other where it arrived, in its span too.
        assert!(
            lines[1].contains("main-worker")
                && lines[1].contains("rpc{method=\"/gpubroker.v1.Broker/GetUsage\"}"),
            "{text}"
        );
    }
}
