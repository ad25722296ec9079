//! The server: binds the Unix socket (0660, stale file replaced) and the optional TCP
//! address, serves the `Broker` and `Admin` services plus gRPC health and reflection (v1
//! and v1alpha), and shuts down with a grace period: refuse new work, tell sessions, give
//! them the grace to release, then end them, free every block, and stop. The optional operators'
//! socket (`--admin-listen`) serves `Admin` and health only, wholly on the operators'
//! runtime (`read_pool.rs`): its connections, handlers and encoding never run on the
//! runtime admission's calls run on; with `--admin-listen-only` it is the only one that
//! serves `Admin`.

use crate::arbiter::Arbiter;
use crate::auth::{admin_interceptor, tenant_interceptor};
use crate::service::admin::AdminService;
use crate::service::broker::BrokerService;
use gpu_broker_proto::v1::admin_server::AdminServer;
use gpu_broker_proto::v1::broker_server::BrokerServer;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;

/// Why serving failed.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("socket {path}: {source}")]
    Socket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("another broker is already serving on {0}")]
    InUse(PathBuf),
    /// Something that is not a socket (a mistyped path naming a file) is at the path: it
    /// is left as it is.
    #[error("{0} exists and is not a socket: not replaced")]
    NotASocket(PathBuf),
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("reflection: {0}")]
    Reflection(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// Binds the Unix socket at `path`: creates its directory, replaces a stale socket file
/// (refuses one a live broker still serves), and sets mode 0660.
pub async fn bind_unix(path: &Path) -> Result<UnixListener, ServerError> {
    use crate::listener::BindError;
    crate::listener::bind_unix(path, 0o660)
        .await
        .map_err(|e| match e {
            BindError::InUse(path) => ServerError::InUse(path),
            BindError::Io { path, source } => ServerError::Socket { path, source },
            BindError::NotASocket(path) => ServerError::NotASocket(path),
        })
}

/// The listeners to serve on.
pub struct Listeners {
    pub unix: Option<UnixListener>,
    pub tcp: Option<TcpListener>,
    /// TLS of the TCP listener (`crate::tls`); None: plain HTTP/2 (`--insecure-tcp`).
    pub tcp_tls: Option<Arc<crate::tls::TlsServer>>,
    /// Connection caps, handshake deadline, stream limits (`crate::listener`).
    pub limits: crate::listener::Limits,
    /// Moves Admin calls and listings to the operators' runtime (`crate::read_pool`).
    pub reads: crate::read_pool::ReadsLayer,
    /// The operators' socket (`--admin-listen`, bound with [`bind_unix`]): Admin and health
    /// only, served on the operators' runtime (the main one without it), under the same
    /// connection caps as the other listeners.
    pub admin_unix: Option<UnixListener>,
    /// Admin on `admin_unix` only: the other listeners leave it out (`--admin-listen-only`).
    pub admin_only_on_admin_unix: bool,
}

/// Serves until `shutdown` is cancelled, then shuts down gracefully within `grace`.
pub async fn serve(
    arb: Arc<Arbiter>,
    listeners: Listeners,
    shutdown: CancellationToken,
    grace: Duration,
) -> Result<(), ServerError> {
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<BrokerServer<BrokerService>>()
        .await;
    health_reporter
        .set_serving::<AdminServer<AdminService>>()
        .await;
    // Reflection in both versions clients speak: v1, and v1alpha (older grpcurl,
    // grpcio-reflection); each lists every service, both reflections included.
    let described = || {
        use tonic_reflection::pb;
        tonic_reflection::server::Builder::configure()
            .include_reflection_service(false)
            .register_encoded_file_descriptor_set(gpu_broker_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(pb::v1alpha::FILE_DESCRIPTOR_SET)
    };
    let reflection_error =
        |e: tonic_reflection::server::Error| ServerError::Reflection(e.to_string());
    let reflection = described().build_v1().map_err(reflection_error)?;
    let reflection_v1alpha = described().build_v1alpha().map_err(reflection_error)?;
    let auth = arb.authenticator().clone();
    let broker = BrokerServer::with_interceptor(
        BrokerService::new(arb.clone()),
        tenant_interceptor(auth.clone()),
    );
    let admin =
        AdminServer::with_interceptor(AdminService::new(arb.clone()), admin_interceptor(auth));
    // HTTP/2 pings find dead or frozen peers: a worker whose HTTP/2 stack stops answering
    // for about the keepalive timeout loses its connection, and so its sessions.
    let ka = arb.config().keepalive_timeout;
    let ping = if ka.is_zero() {
        Duration::from_secs(20)
    } else {
        (ka / 2).max(Duration::from_millis(500))
    };
    let gate = crate::gate::GateLayer::new(arb.authenticator().clone())
        .with_rate_limits(arb.rate_limits().cloned());
    let conns = crate::listener::ConnTracker::new(listeners.limits.clone());
    tracing::info!(limits = ?conns.limits(), "connection limits");
    // Each listener gets a server of its own, and so its own count of open calls that
    // need no token: health watches held on one socket (a tenant's on the main one) never
    // take the slots of another (an operator's health check on the operators' socket).
    let server = |reads: crate::read_pool::ReadsLayer| {
        tonic::transport::Server::builder()
            // Every request gets a span named by its method; the services add tenant,
            // session and lease ids to it. At debug level: an enabled span costs every call
            // its formatting (about a tenth of a pooled acquire's round trip, measured).
            .trace_fn(|req| tracing::debug_span!("rpc", method = %req.uri().path()))
            .http2_keepalive_interval(Some(ping))
            .http2_keepalive_timeout(Some(ping))
            // Tokens, expiry and scopes (gate.rs), before any service sees the request.
            .layer(gate.clone())
            // Connection and stream limits (listener.rs): calls per connection, and open
            // calls to the services that need no token.
            .max_concurrent_streams(listeners.limits.max_streams_per_connection)
            .layer(crate::listener::UnauthStreamsLayer::new(&conns))
            // Admin calls and listings run (and are encoded) on the operators' runtime.
            .layer(reads)
    };
    let builder = server(listeners.reads.clone());
    // The TCP listener gets the same server; its TLS is terminated in front of it
    // (`listener::incoming_tls`), after the connection limits and under their deadline.
    let tcp_builder = server(listeners.reads.clone());
    // The operators' socket is served on that runtime already: nothing to move.
    let admin_router = server(crate::read_pool::ReadsLayer::default())
        .add_service(health.clone())
        .add_service(admin.clone());
    // Without Admin (`--admin-listen-only`), an Admin call there is UNIMPLEMENTED.
    let admin_elsewhere = listeners.admin_only_on_admin_unix && listeners.admin_unix.is_some();
    let routes = |mut b: tonic::transport::Server<_>| {
        b.add_service(health.clone())
            .add_service(reflection.clone())
            .add_service(reflection_v1alpha.clone())
            .add_service(broker.clone())
            .add_optional_service((!admin_elsewhere).then(|| admin.clone()))
    };
    let router = routes(builder);
    let tcp_router = routes(tcp_builder);

    let bg_stop = CancellationToken::new();
    arb.tasks().start(bg_stop.clone());
    // The Admin service is NOT_SERVING while the state store is unwritable (a full disk):
    // admin changes fail then. Probed every 2 s until a write commits again.
    if let Some(mut writable) = arb.durable.store().map(|s| s.writable()) {
        let (reporter, me, stop) = (health_reporter.clone(), arb.clone(), bg_stop.clone());
        arb.lifecycle()
            .spawn_worker("admin-writable-health", bg_stop.clone(), async move {
                loop {
                    let ok = *writable.borrow_and_update();
                    if ok {
                        reporter.set_serving::<AdminServer<AdminService>>().await;
                    } else {
                        reporter
                            .set_not_serving::<AdminServer<AdminService>>()
                            .await;
                    }
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        r = writable.changed() => if r.is_err() { return },
                        _ = tokio::time::sleep(Duration::from_secs(2)), if !ok => {
                            let a = me.clone();
                            let _ = tokio::task::spawn_blocking(move || {
                                a.durable.store().map(|s| s.probe())
                            })
                            .await;
                        }
                    }
                }
            });
    }
    // Device health and drains in gRPC health (health.rs).
    arb.lifecycle().spawn_worker(
        "grpc-health",
        shutdown.clone(),
        crate::health::report_grpc_health(arb.clone(), health_reporter.clone(), shutdown.clone()),
    );

    let stop_serving = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    if let Some(l) = listeners.unix {
        let r = router.clone();
        let s = stop_serving.clone();
        let c = conns.clone();
        tasks.spawn(async move {
            r.serve_with_incoming_shutdown(
                crate::listener::incoming_unix(l, c),
                s.cancelled_owned(),
            )
            .await
        });
    }
    if let Some(l) = listeners.admin_unix {
        let s = stop_serving.clone();
        let c = conns.clone();
        let rt = listeners.reads.runtime();
        // Registered again with the runtime it is served on.
        let l = match &rt {
            Some(rt) => {
                let std = l.into_std()?;
                let _in = rt.enter();
                UnixListener::from_std(std)?
            }
            None => l,
        };
        let serving = async move {
            admin_router
                .serve_with_incoming_shutdown(
                    crate::listener::incoming_unix(l, c),
                    s.cancelled_owned(),
                )
                .await
        };
        match &rt {
            Some(rt) => tasks.spawn_on(serving, rt),
            None => tasks.spawn(serving),
        };
    }
    if let Some(l) = listeners.tcp {
        let r = tcp_router;
        let s = stop_serving.clone();
        let c = conns.clone();
        match listeners.tcp_tls {
            Some(tls) => tasks.spawn(async move {
                r.serve_with_incoming_shutdown(
                    crate::listener::incoming_tls(l, c, tls),
                    s.cancelled_owned(),
                )
                .await
            }),
            None => tasks.spawn(async move {
                r.serve_with_incoming_shutdown(
                    crate::listener::incoming_tcp(l, c),
                    s.cancelled_owned(),
                )
                .await
            }),
        };
    }

    // Serve until asked to stop (or a listener fails).
    let early = tokio::select! {
        _ = shutdown.cancelled() => None,
        r = tasks.join_next() => r,
    };
    if let Some(Ok(Err(e))) = early {
        tracing::error!(error = %e, "a listener failed; shutting down");
    }

    tracing::info!(grace = ?grace, sessions = arb.views().session_count(), "shutting down: ending sessions");
    health_reporter
        .set_not_serving::<BrokerServer<BrokerService>>()
        .await;
    arb.lifecycle().begin_shutdown(grace);
    let deadline = Instant::now() + grace;
    while arb.views().session_count() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // End what is left (their streams close) and free every block.
    let a = arb.clone();
    tokio::task::spawn_blocking(move || a.lifecycle().release_all())
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    bg_stop.cancel();
    let stuck = arb.lifecycle().join(Duration::from_secs(3)).await;
    if !stuck.is_empty() {
        tracing::warn!(workers = ?stuck, "background workers did not stop in time");
    }
    stop_serving.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(3), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    tracing::info!("shutdown complete");
    Ok(())
}

/// Serves the metrics listener on `listener` (see [`serve_metrics_with`]) as the named
/// worker `metrics-http` on runtime `rt` (the operators' runtime; else the caller's),
/// until `stop` is cancelled; [`Lifecycle::join`](crate::arbiter::Lifecycle::join) waits for its accept loop to end.
pub fn spawn_metrics(
    arb: &Arc<Arbiter>,
    rt: Option<tokio::runtime::Handle>,
    listener: std::net::TcpListener,
    stop: CancellationToken,
    access: crate::status_http::HttpAccess,
    limits: crate::listener::Limits,
) {
    let rt = rt.unwrap_or_else(tokio::runtime::Handle::current);
    let a = arb.clone();
    arb.lifecycle()
        .spawn_worker_to_end_on(&rt, "metrics-http", async move {
            // Registered with the runtime it is served on.
            let served = match TcpListener::from_std(listener) {
                Ok(l) => serve_metrics_with(a, l, stop, access, limits).await,
                Err(e) => Err(e.into()),
            };
            if let Err(e) = served {
                tracing::error!(error = %e, "the metrics listener failed");
            }
        });
}

/// Starts the named worker `signal-wait`: when `signal` resolves (SIGTERM or SIGINT, see
/// [`stop_signal`]) it cancels `shutdown`, which starts the broker's shutdown; a shutdown
/// begun otherwise ends it.
pub fn spawn_signal_wait(
    arb: &Arbiter,
    shutdown: CancellationToken,
    signal: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let s = shutdown.clone();
    let me = arb.me();
    arb.lifecycle()
        .spawn_worker("signal-wait", shutdown, async move {
            signal.await;
            tracing::info!("signal received");
            if me.upgrade().is_some_and(|a| a.restart().keeps_leases()) {
                // A keeper holds every session and lease as they are now: leave them to it
                // for the next broker (an upgrade, `systemctl restart`), ending nothing. The
                // sockets' files stay; the next broker replaces them.
                tracing::info!("leaving sessions and leases to the keeper for the next broker");
                std::process::exit(0);
            }
            // systemd: the stop has begun (sessions get their grace; no-op without systemd).
            let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
            s.cancel();
        });
}

/// Resolves on the first SIGTERM or SIGINT (never, when their handlers cannot be
/// installed: the broker then runs until killed).
pub async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Serves the metrics listener (`/metrics`, health; routes in `status_http`) until `stop`
/// is cancelled.
pub async fn serve_metrics(
    arb: Arc<Arbiter>,
    listener: TcpListener,
    stop: CancellationToken,
    access: crate::status_http::HttpAccess,
) -> Result<(), ServerError> {
    serve_metrics_with(
        arb,
        listener,
        stop,
        access,
        crate::listener::Limits::default(),
    )
    .await
}

/// [`serve_metrics`] under `limits` (`crate::listener::Limits::for_http`): a capped number
/// of connections where a new one takes the slot of the one idle the longest
/// (`crate::http_slots`: probes are answered whoever holds idle connections), accept
/// back-off, and a request's headers must arrive within the handshake timeout (a half-sent
/// request is not held forever).
pub async fn serve_metrics_with(
    arb: Arc<Arbiter>,
    listener: TcpListener,
    stop: CancellationToken,
    access: crate::status_http::HttpAccess,
    limits: crate::listener::Limits,
) -> Result<(), ServerError> {
    use futures::StreamExt;
    let limits = limits.for_http();
    let header_timeout = limits.handshake_timeout;
    let slots = crate::http_slots::HttpSlots::new(limits.max_connections);
    // The hard bound on descriptors: evicted connections close as their task next runs.
    let hard = crate::listener::Limits {
        max_connections: limits.max_connections * 2,
        ..limits
    };
    let conns = crate::listener::ConnTracker::new(hard);
    let incoming = crate::listener::incoming_tcp(listener, conns);
    futures::pin_mut!(incoming);
    loop {
        let stream = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            c = incoming.next() => match c {
                Some(Ok(c)) => c,
                Some(Err(e)) => return Err(e.into()),
                None => return Ok(()),
            },
        };
        let Some(slot) = slots.admit() else {
            // Every slot is answering a request: closed at once.
            continue;
        };
        // The one evicted for it closes first (its task wakes to its cancellation).
        slots.settle(Duration::from_millis(100)).await;
        let slot = Arc::new(slot);
        let arb = arb.clone();
        tokio::spawn(async move {
            let s = slot.clone();
            let svc =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let (arb, slot) = (arb.clone(), s.clone());
                    async move {
                        slot.busy();
                        let r = crate::status_http::respond(&arb, access, &req).await;
                        slot.idle();
                        Ok::<_, std::convert::Infallible>(r)
                    }
                });
            let io = hyper_util::rt::TokioIo::new(stream);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(io, svc);
            tokio::select! {
                _ = conn => {}
                _ = slot.evicted().cancelled() => {}
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::server::NamedService;

    #[test]
    fn the_operators_runtime_names_the_served_services() {
        assert_eq!(
            crate::read_pool::ADMIN_SERVICE,
            format!("/{}/", AdminServer::<AdminService>::NAME)
        );
        for path in crate::read_pool::OFFLOADED_BROKER {
            assert!(
                path.starts_with(&format!("/{}/", BrokerServer::<BrokerService>::NAME)),
                "{path}"
            );
        }
    }

    #[tokio::test]
    async fn binding_says_what_is_in_the_way() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("state.db");
        std::fs::write(&file, b"x").unwrap();
        let e = bind_unix(&file).await.unwrap_err();
        assert!(
            matches!(&e, ServerError::NotASocket(p) if *p == file),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!(
                "{} exists and is not a socket: not replaced",
                file.display()
            )
        );
        let sock = dir.path().join("b.sock");
        let _live = bind_unix(&sock).await.unwrap();
        let e = bind_unix(&sock).await.unwrap_err();
        assert!(matches!(&e, ServerError::InUse(p) if *p == sock), "{e:?}");
        assert!(e.to_string().contains("already serving"), "{e}");
    }

    /// Listeners with only the workers' Unix socket (`b.sock` in `dir`).
    async fn workers_socket_only(dir: &Path) -> Listeners {
        Listeners {
            unix: Some(bind_unix(&dir.join("b.sock")).await.unwrap()),
            tcp: None,
            tcp_tls: None,
            limits: crate::listener::Limits::default(),
            reads: crate::read_pool::ReadsLayer::default(),
            admin_unix: None,
            admin_only_on_admin_unix: false,
        }
    }

    /// Every background loop of a served broker is a named worker, and the shutdown has
    /// joined them all when `serve` returns.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stop_joins_every_background_loop() {
        let dir = tempfile::tempdir().unwrap();
        let arb = crate::arbiter::durable_tests::stored_arbiter(dir.path());
        let shutdown = CancellationToken::new();
        let listeners = workers_socket_only(dir.path()).await;
        assert!(crate::health::spawn_monitor(
            &arb,
            crate::health::HealthConfig::default(),
            None,
            shutdown.clone()
        ));
        let serving = tokio::spawn(serve(
            arb.clone(),
            listeners,
            shutdown.clone(),
            Duration::from_millis(50),
        ));
        let every = [
            "admin-writable-health",
            "grpc-health",
            "health-monitor",
            "leasable-refresh",
            "ticker",
        ];
        let named = || {
            let mut n = arb.lifecycle().worker_names();
            n.sort();
            n
        };
        let t = std::time::Instant::now();
        while named() != every && t.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(named(), every);
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(30), serving)
            .await
            .expect("serve returns after a stop")
            .unwrap()
            .unwrap();
        assert!(
            arb.lifecycle().worker_names().is_empty(),
            "{:?}",
            arb.lifecycle().worker_names()
        );
    }

    /// The metrics listener and the wait for a stop signal are named workers too: a
    /// "signal" starts the shutdown, which joins both (the metrics port is closed when
    /// `serve` returns).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_metrics_listener_and_the_signal_wait_are_workers_joined_at_stop() {
        let dir = tempfile::tempdir().unwrap();
        let arb = crate::arbiter::durable_tests::stored_arbiter(dir.path());
        let shutdown = CancellationToken::new();
        let listeners = workers_socket_only(dir.path()).await;
        let metrics = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        metrics.set_nonblocking(true).unwrap();
        let addr = metrics.local_addr().unwrap();
        spawn_metrics(
            &arb,
            None,
            metrics,
            shutdown.clone(),
            crate::status_http::HttpAccess {
                require_token: false,
            },
            crate::listener::Limits::default(),
        );
        let (signal, signalled) = tokio::sync::oneshot::channel::<()>();
        spawn_signal_wait(&arb, shutdown.clone(), async move {
            let _ = signalled.await;
        });
        let serving = tokio::spawn(serve(
            arb.clone(),
            listeners,
            shutdown.clone(),
            Duration::from_millis(50),
        ));
        let named = |n: &str| arb.lifecycle().worker_names().contains(&n);
        let t = std::time::Instant::now();
        while !(named("metrics-http") && named("signal-wait") && named("ticker"))
            && t.elapsed() < Duration::from_secs(10)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            named("metrics-http") && named("signal-wait"),
            "{:?}",
            arb.lifecycle().worker_names()
        );
        tokio::net::TcpStream::connect(addr)
            .await
            .expect("the metrics listener accepts");
        assert!(!shutdown.is_cancelled());
        signal.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(30), serving)
            .await
            .expect("serve returns after the signal")
            .unwrap()
            .unwrap();
        assert!(shutdown.is_cancelled(), "the signal started the shutdown");
        assert!(
            arb.lifecycle().worker_names().is_empty(),
            "{:?}",
            arb.lifecycle().worker_names()
        );
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "the metrics listener is closed once joined"
        );
    }

    /// An Admin call with the test arbiter's admin token.
    fn admin_req<T>(msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        r.metadata_mut()
            .insert("authorization", "Bearer x".parse().unwrap());
        r
    }

    #[test]
    fn the_operators_socket_answers_while_the_main_runtime_is_stalled() {
        use gpu_broker_proto::v1 as pb;
        use pb::admin_client::AdminClient;
        let dir = tempfile::tempdir().unwrap();
        let (main_sock, ops_sock) = (dir.path().join("b.sock"), dir.path().join("ops.sock"));
        // The main runtime has one worker: a task that blocks it stalls the runtime.
        let main = crate::read_pool::main_runtime_of_one_worker();
        let pool = crate::read_pool::ReadPool::start(1).unwrap();
        let arb = crate::arbiter::host_arbiter(64 << 20, 1, Default::default());
        let shutdown = CancellationToken::new();
        let listeners = main.block_on(async {
            Listeners {
                unix: Some(bind_unix(&main_sock).await.unwrap()),
                tcp: None,
                tcp_tls: None,
                limits: crate::listener::Limits::default(),
                reads: pool.layer(),
                admin_unix: Some(bind_unix(&ops_sock).await.unwrap()),
                admin_only_on_admin_unix: false,
            }
        });
        main.spawn(serve(
            arb.clone(),
            listeners,
            shutdown.clone(),
            Duration::from_millis(100),
        ));
        let client = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let uri = format!("unix://{}", ops_sock.display());
        let bounded = Duration::from_secs(30); // a failure detector, not a speed limit
        let get_quota = |uri: String| async move {
            let mut ops = AdminClient::connect(uri).await.unwrap();
            let r = ops
                .get_quota(admin_req(pb::GetQuotaRequest { tenant: "t".into() }))
                .await
                .unwrap();
            r.into_inner().tenant.unwrap().quota.unwrap().limit_bytes
        };
        // Served normally first (and serving has started).
        let mut ops = client.block_on(async { AdminClient::connect(uri.clone()).await.unwrap() });
        client.block_on(async {
            ops.set_quota(admin_req(pb::SetQuotaRequest {
                tenant: "t".into(),
                quota: Some(pb::Quota {
                    limit_bytes: 8 << 20,
                    ..Default::default()
                }),
                ..Default::default()
            }))
            .await
            .unwrap();
        });
        // Stall the main runtime's only worker.
        let (blocked, is_blocked) = std::sync::mpsc::channel::<()>();
        let (release, stalled) = std::sync::mpsc::channel::<()>();
        main.spawn(async move {
            blocked.send(()).unwrap();
            let _ = stalled.recv();
        });
        is_blocked.recv().unwrap();
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let r = ran.clone();
        main.spawn(async move { r.store(true, std::sync::atomic::Ordering::SeqCst) });
        // A new connection and the open one are both answered, reads and changes.
        let limit = client
            .block_on(async { tokio::time::timeout(bounded, get_quota(uri.clone())).await })
            .expect("a new connection to the operators' socket is served");
        assert_eq!(limit, 8 << 20);
        client
            .block_on(async {
                let change = ops.set_quota(admin_req(pb::SetQuotaRequest {
                    tenant: "t".into(),
                    quota: Some(pb::Quota {
                        limit_bytes: 16 << 20,
                        ..Default::default()
                    }),
                    ..Default::default()
                }));
                tokio::time::timeout(bounded, change).await
            })
            .expect("the open connection is served")
            .unwrap();
        assert_eq!(arb.views().tenant("t").unwrap().quota.limit_bytes, 16 << 20);
        assert!(
            !ran.load(std::sync::atomic::Ordering::SeqCst),
            "the main runtime ran nothing meanwhile: it was stalled throughout"
        );
        release.send(()).unwrap();
        shutdown.cancel();
        main.shutdown_background();
        drop(pool);
    }
}
