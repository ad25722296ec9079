//! The caller-driven transport (the clients' default for Unix sockets) against the
//! in-process fake broker (`fake/`): many callers at once on runtime tasks and in
//! `block_on` threads, callers dropped mid-call (the one driving the connection among
//! them), session events read while no call is in flight (the background driver), and a
//! new connection after the broker went away and came back on the same socket.

mod fake;

use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

use fake::*;
use gpu_broker_client::connect::{connect_transport_with, ConnectOptions};
use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::{Client, Code, SessionEvent};

const LONG: Duration = Duration::from_secs(10);

/// A client on the caller-driven transport (asserted: the test is about it).
async fn driven_client(uri: &str) -> Client {
    let transport = connect_transport_with(uri, &ConnectOptions::default())
        .await
        .unwrap();
    assert!(transport.is_caller_driven(), "{transport:?}");
    Client::from_transport(transport, TENANT_TOKEN).unwrap()
}

fn runtime(threads: usize) -> tokio::runtime::Runtime {
    let mut b = if threads == 0 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    b.enable_all().build().unwrap()
}

async fn usage_ok(client: &Client) {
    let usage = tokio::time::timeout(LONG, client.usage())
        .await
        .expect("a call hung")
        .expect("a call failed");
    assert_eq!(usage.tenant, "team-a");
}

#[test]
fn callers_on_tasks_and_in_block_on_threads_all_get_answers() {
    let rt = runtime(2);
    let h = rt.block_on(start(0));
    let client = rt.block_on(driven_client(&h.uri));
    // Some calls take a while, so that callers queue behind the one driving.
    h.fake.state.lock().usage_delay = Some(Duration::from_millis(1));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let c = client.clone();
            rt.spawn(async move {
                for _ in 0..50 {
                    usage_ok(&c).await;
                }
            })
        })
        .collect();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (c, handle) = (client.clone(), rt.handle().clone());
            std::thread::spawn(move || {
                for _ in 0..50 {
                    handle.block_on(usage_ok(&c));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    rt.block_on(async {
        for t in tasks {
            t.await.unwrap();
        }
    });
}

#[test]
fn a_current_thread_runtime_drives_its_own_calls() {
    let rt = runtime(0);
    rt.block_on(async {
        let h = start(0).await;
        let client = driven_client(&h.uri).await;
        let calls = (0..32).map(|_| {
            let c = client.clone();
            async move { usage_ok(&c).await }
        });
        futures::future::join_all(calls).await;
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_dropped_mid_call_leave_the_connection_working() {
    let h = start(0).await;
    let client = driven_client(&h.uri).await;
    // Long enough that the first call is still in flight when it is dropped, however slow
    // the machine.
    h.fake.state.lock().usage_delay = Some(Duration::from_secs(2));
    // The first drives the connection (alone when it started), the others are answered
    // by its polls; it is dropped.
    let first = {
        let c = client.clone();
        tokio::spawn(async move { c.usage().await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let queued: Vec<_> = (0..4)
        .map(|_| {
            let c = client.clone();
            tokio::spawn(async move { c.usage().await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    for q in queued {
        let usage = tokio::time::timeout(LONG, q)
            .await
            .expect("a queued caller hung after the driver was dropped")
            .unwrap()
            .unwrap();
        assert_eq!(usage.tenant, "team-a");
    }

    // A caller in `block_on` dropped by its timeout, then every caller dropped at once.
    let (c, handle) = (client.clone(), tokio::runtime::Handle::current());
    tokio::task::spawn_blocking(move || {
        let r = handle.block_on(tokio::time::timeout(Duration::from_millis(30), c.usage()));
        assert!(r.is_err(), "the slow call should have timed out");
    })
    .await
    .unwrap();
    let mut many: futures::stream::FuturesUnordered<_> =
        (0..8).map(|_| Box::pin(client.usage())).collect();
    let _ = tokio::time::timeout(Duration::from_millis(30), many.next()).await;
    drop(many);

    h.fake.state.lock().usage_delay = None;
    usage_ok(&client).await;
    let (c, handle) = (client.clone(), tokio::runtime::Handle::current());
    tokio::task::spawn_blocking(move || handle.block_on(usage_ok(&c)))
        .await
        .unwrap();
}

/// Session events reach the session while the caller makes no call: the background
/// driver reads them (on both kinds of runtime).
#[test]
fn session_events_arrive_while_no_call_is_in_flight() {
    for threads in [0, 2] {
        let rt = runtime(threads);
        rt.block_on(async {
            let h = start(0).await;
            let client = driven_client(&h.uri).await;
            let session = client.session("idle").await.unwrap();
            let mut events = session.events();
            for (i, bytes) in [1u64 << 20, 2 << 20, 3 << 20].into_iter().enumerate() {
                tokio::time::sleep(Duration::from_millis(30)).await;
                h.fake.push(
                    &session.id(),
                    pb::session_event::Event::ReclaimRequested(pb::ReclaimRequested {
                        lease_id: format!("l-{i}"),
                        bytes,
                        deadline_unix_ms: 10_000,
                        reason: "priority".into(),
                    }),
                );
                let ev = tokio::time::timeout(LONG, events.next())
                    .await
                    .expect("no event while idle")
                    .unwrap();
                assert!(
                    matches!(ev, SessionEvent::ReclaimRequested { bytes: b, .. } if b == bytes),
                    "{ev:?}"
                );
            }
        });
    }
}

/// A call kept but not polled (its owner awaits something else, as `gpu-brokerctl run`
/// does while it prints its progress) after it started driving the connection holds up
/// neither session events nor other calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driving_call_left_unpolled_holds_nothing_up() {
    let h = start(0).await;
    let client = driven_client(&h.uri).await;
    let session = client.session("patient").await.unwrap();
    let mut events = session.events();
    h.fake.state.lock().usage_delay = Some(Duration::from_millis(300));
    let slow = client.usage();
    tokio::pin!(slow);
    // Alone in flight, its first poll sends it and makes it the connection's driver.
    assert!(futures::poll!(&mut slow).is_pending());
    h.fake.state.lock().usage_delay = None;

    h.fake.push(
        &session.id(),
        pb::session_event::Event::ReclaimRequested(pb::ReclaimRequested {
            lease_id: "l-1".into(),
            bytes: 1 << 20,
            deadline_unix_ms: 10_000,
            reason: "priority".into(),
        }),
    );
    let ev = tokio::time::timeout(LONG, events.next())
        .await
        .expect("an event held up by a call nobody polls")
        .unwrap();
    assert!(
        matches!(ev, SessionEvent::ReclaimRequested { .. }),
        "{ev:?}"
    );
    usage_ok(&client).await;
    let usage = tokio::time::timeout(LONG, slow).await.unwrap().unwrap();
    assert_eq!(usage.tenant, "team-a");
}

/// Serves the fake on `path` until `stop` fires (then a graceful shutdown: GOAWAY).
fn serve(fake: &Fake, path: &Path) -> tokio::sync::oneshot::Sender<()> {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tonic::transport::Server::builder()
        .add_service(pb::broker_server::BrokerServer::new(fake.clone()))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
            let _ = stopped.await;
        });
    tokio::spawn(server);
    stop
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_gone_and_back_gets_a_new_connection() {
    let h = start(0).await;
    let path = h._dir.path().join("again.sock");
    let uri = format!("unix://{}", path.display());
    let stop = serve(&h.fake, &path);
    let client = driven_client(&uri).await;
    usage_ok(&client).await;

    stop.send(()).unwrap();
    // Away: calls fail with UNAVAILABLE (once the old connection has closed).
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        match client.usage().await {
            Ok(_) => {
                assert!(tokio::time::Instant::now() < deadline, "still connected");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => {
                assert_eq!(e.code(), Code::Unavailable, "{e}");
                break;
            }
        }
    }

    let _stop = serve(&h.fake, &path);
    let deadline = tokio::time::Instant::now() + LONG;
    while let Err(e) = client.usage().await {
        assert_eq!(e.code(), Code::Unavailable, "{e}");
        assert!(tokio::time::Instant::now() < deadline, "no reconnect: {e}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // And it stays connected, from a block_on thread too.
    usage_ok(&client).await;
    let (c, handle) = (client.clone(), tokio::runtime::Handle::current());
    tokio::task::spawn_blocking(move || handle.block_on(usage_ok(&c)))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_tcp_addresses_are_caller_driven_too() {
    let h = start(0).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tonic::transport::Server::builder()
        .add_service(pb::broker_server::BrokerServer::new(h.fake.clone()))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    tokio::spawn(server);
    for uri in [
        format!("http://127.0.0.1:{port}"),
        format!("127.0.0.1:{port}"),
    ] {
        let client = driven_client(&uri).await;
        usage_ok(&client).await;
    }
}

#[tokio::test]
async fn no_broker_is_a_transport_error_then_unavailable_calls() {
    let dir = tempfile::tempdir().unwrap();
    let uri = format!("unix://{}", dir.path().join("nobody.sock").display());
    let err = connect_transport_with(&uri, &ConnectOptions::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    let lazy = Client::connect_lazy(&uri, TENANT_TOKEN).unwrap();
    let err = lazy.usage().await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(err.to_string().contains("cannot connect"), "{err}");
}

/// A server that turns a call away before taking it (an HTTP/2 GOAWAY that names no stream,
/// as a broker shutting down sends one racing a new call) answers that call with
/// `UNAVAILABLE`: it never ran, and the caller may try again.
#[tokio::test]
async fn a_call_turned_away_by_goaway_is_unavailable() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const HEADERS: u8 = 0x1;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("goaway.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let (answered, closing) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        // An empty SETTINGS frame: the server's preface.
        sock.write_all(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0])
            .await
            .unwrap();
        let mut preface = [0u8; 24];
        sock.read_exact(&mut preface).await.unwrap();
        assert_eq!(&preface, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        loop {
            let mut head = [0u8; 9];
            sock.read_exact(&mut head).await.unwrap();
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0u8; len];
            sock.read_exact(&mut payload).await.unwrap();
            if head[3] == HEADERS {
                break;
            }
        }
        // GOAWAY: last stream 0 (the call was not taken), NO_ERROR. The socket stays open
        // until the call is answered (a close could reach the client first).
        let goaway = [0, 0, 8, 0x7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        sock.write_all(&goaway).await.unwrap();
        let _ = closing.await;
    });
    let client = driven_client(&format!("unix://{}", path.display())).await;
    let e = tokio::time::timeout(LONG, client.usage())
        .await
        .expect("a call hung")
        .expect_err("a call turned away succeeded");
    let _ = answered.send(());
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(e.message().contains("turned the call away"), "{e}");
    server.await.unwrap();
}
