//! Liveness: a worker that exits or is killed without closing its session loses its
//! leases within 1 s; a raw session (no `Keepalive` RPCs) lives on the stream's heartbeats,
//! and ends once its process stops answering; a waiting request whose caller goes away
//! leaves the queue at once.

use super::*;
use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::Client;

async fn lease_whole_device(b: &Broker, token: &str, bytes: u64) {
    let c = Client::connect(&b.uri(), token.to_string()).await.unwrap();
    let s = c.session("reuse").await.unwrap();
    let l = s
        .lease(bytes)
        .await
        .expect("the freed memory is grantable again");
    l.release().await.unwrap();
    s.close();
}

#[tokio::test]
async fn exited_worker_frees_its_leases_within_a_second() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "128MiB",
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let w = b.tenant("w", QuotaSpec::new(128 * MIB)).await.unwrap();
    let other = b.tenant("other", QuotaSpec::new(128 * MIB)).await.unwrap();
    let mut p = Proc::spawn(fault_cmd(
        &b,
        &w,
        "hold",
        &["--count", "4", "--mib", "32", "--exit-when-granted"],
    ))
    .unwrap();
    let evs = events_until(&mut p, "holding", Duration::from_secs(20)).await;
    assert_eq!(evs.iter().filter(|v| v["ev"] == "granted").count(), 4);
    let status = p.wait(Duration::from_secs(10)).await.unwrap();
    assert!(status.success(), "{status}");
    let took = wait_all_zero(&admin, Duration::from_secs(1)).await;
    let took = took.unwrap_or_else(|e| panic!("not freed within 1 s of the exit: {e}"));
    eprintln!("exited worker: everything freed {took:?} after its exit");
    lease_whole_device(&b, &other, 128 * MIB).await;
    assert_broker_alive(&b);
}

#[tokio::test]
async fn killed_worker_frees_its_leases_within_a_second() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "128MiB",
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let w = b.tenant("w", QuotaSpec::new(128 * MIB)).await.unwrap();
    let other = b.tenant("other", QuotaSpec::new(128 * MIB)).await.unwrap();
    let mut h = holder(&b, &w, &["--count", "4", "--mib", "32"]).await;
    assert_eq!(h.leases.len(), 4);
    h.proc.kill().await.unwrap();
    let took = wait_all_zero(&admin, Duration::from_secs(1)).await;
    let took = took.unwrap_or_else(|e| panic!("not freed within 1 s of SIGKILL: {e}"));
    eprintln!("killed worker: everything freed {took:?} after SIGKILL");
    lease_whole_device(&b, &other, 128 * MIB).await;
    assert_broker_alive(&b);
}

/// With `--keepalive-timeout 1s`: a worker that opened its session with raw calls and
/// sends no `Keepalive` keeps it while its stream is open (the broker's heartbeats are
/// stream activity); once the process freezes (SIGSTOP) it stops answering HTTP/2 pings,
/// its session ends within ~2 s and its lease is quarantined while the process exists;
/// SIGKILL lifts the quarantine.
#[tokio::test]
async fn raw_session_lives_on_its_stream_and_ends_when_the_process_freezes() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        extra: vec!["--keepalive-timeout".into(), "1s".into()],
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let w = b.tenant("w", QuotaSpec::new(64 * MIB)).await.unwrap();
    let mut p = Proc::spawn(fault_cmd(&b, &w, "idle-raw", &["--mib", "8"])).unwrap();
    let granted = event(&mut p, "granted", Duration::from_secs(20)).await;
    assert_eq!(granted["keepalive_timeout_ms"], 1000);
    // Three keepalive timeouts without a single Keepalive RPC: still there.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let early = events_for(&mut p, Duration::from_millis(10)).await;
    assert!(
        early.iter().all(|v| v["ev"] != "stream_end"),
        "the broker ended a session whose stream is open: {early:?}"
    );
    let t = tenant(&admin, "w").await;
    assert_eq!((t.usage.session_count, t.usage.held_bytes), (1, 8 * MIB));

    p.signal(libc::SIGSTOP);
    let t0 = Instant::now();
    let ended = eventually(Duration::from_secs(6), || async {
        tenant(&admin, "w").await.usage.session_count == 0
    })
    .await;
    let took = t0.elapsed();
    assert!(ended, "the frozen worker's session did not end");
    assert!(took < Duration::from_millis(3500), "{took:?}");
    eprintln!("frozen raw worker: session ended {took:?} after SIGSTOP");
    // The process still exists (stopped): its lease is quarantined, not reused.
    let u = tenant(&admin, "w").await.usage;
    assert_eq!((u.held_bytes, u.quarantined_bytes), (0, 8 * MIB), "{u:?}");
    assert_eq!(
        admin.get_devices().await.unwrap()[0].quarantined_bytes,
        8 * MIB
    );
    p.signal(libc::SIGKILL);
    let _ = p.wait(Duration::from_secs(5)).await;
    let took = wait_all_zero(&admin, Duration::from_secs(1)).await;
    assert!(took.is_ok(), "quarantine not lifted within 1 s: {took:?}");
    assert_broker_alive(&b);
}

#[tokio::test]
async fn waiting_request_leaves_the_queue_when_its_caller_goes() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let fill = b.tenant("fill", QuotaSpec::new(64 * MIB)).await.unwrap();
    let w = b.tenant("w", QuotaSpec::new(64 * MIB)).await.unwrap();
    let fc = Client::connect(&b.uri(), fill).await.unwrap();
    let fs = fc.session("fill").await.unwrap();
    let full = fs.lease(64 * MIB).await.unwrap();
    let waiting = |n: u32| {
        let admin = admin.clone();
        async move {
            let t = tenant(&admin, "w").await;
            let d = admin.get_devices().await.unwrap()[0].clone();
            t.usage.waiting_requests == n && d.waiting_requests == n
        }
    };

    // 1. The calling task goes away (the RPC is cancelled): the request leaves at once.
    let mut raw = raw::broker(&b.uri(), &w).await;
    let (sid, stream) = raw::open_session(&mut raw, "w").await;
    let call = {
        let mut raw = raw.clone();
        let sid = sid.clone();
        tokio::spawn(async move {
            raw.acquire_lease(pb::AcquireLeaseRequest {
                session_id: sid,
                bytes: 16 * MIB,
                wait_ms: Some(30_000),
                ..Default::default()
            })
            .await
        })
    };
    assert!(eventually(Duration::from_secs(3), || waiting(1)).await);
    call.abort();
    let t0 = Instant::now();
    assert!(eventually(Duration::from_secs(2), || waiting(0)).await);
    let cancelled = t0.elapsed();
    assert!(cancelled < Duration::from_secs(1), "{cancelled:?}");

    // 2. The calling process dies while waiting.
    let mut p = Proc::spawn(fault_cmd(
        &b,
        &w,
        "hold",
        &["--count", "1", "--mib", "16", "--wait-ms", "30000"],
    ))
    .unwrap();
    event(&mut p, "asking", Duration::from_secs(20)).await;
    assert!(eventually(Duration::from_secs(3), || waiting(1)).await);
    p.kill().await.unwrap();
    let t0 = Instant::now();
    assert!(eventually(Duration::from_secs(2), || waiting(0)).await);
    let killed = t0.elapsed();
    assert!(killed < Duration::from_secs(1), "{killed:?}");
    eprintln!("abandoned waiters left the queue {cancelled:?} (cancelled RPC) / {killed:?} (killed process) later");

    // Nobody gets the memory on their behalf when it frees up.
    full.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = tenant(&admin, "w").await;
    assert_eq!((t.usage.held_bytes, t.usage.lease_count), (0, 0));
    let again = fs.lease(64 * MIB).await.unwrap();
    again.release().await.unwrap();
    fs.close();
    drop(stream);
    assert!(wait_all_zero(&admin, Duration::from_secs(2)).await.is_ok());
    assert_broker_alive(&b);
}
