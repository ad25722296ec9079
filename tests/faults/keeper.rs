//! A broker restart with a keeper (`gpu-broker keeper`, `--keeper`) loses no lease: a
//! live worker's session and leases come back with the same ids, bytes and memory, its
//! mapping stays valid, a call made during the outage goes through once the broker is
//! back, quotas are exact; a worker that died while the broker was down has its memory
//! reclaimed; SIGTERM leaves everything to the keeper too.

use super::*;
use futures::StreamExt;
use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::{Backoff, Client, SessionEvent};

async fn held_bytes(b: &Broker, tenant: &str) -> (u64, u32) {
    let t = b.admin().await.unwrap().get_quota(tenant).await.unwrap();
    (t.usage.held_bytes, t.usage.lease_count)
}

/// A tenant's held and claim/process-reserved bytes.
async fn usage(b: &Broker, tenant: &str) -> (u64, u64) {
    let u = b
        .admin()
        .await
        .unwrap()
        .get_quota(tenant)
        .await
        .unwrap()
        .usage;
    (u.held_bytes, u.process_reserved_bytes)
}

async fn lease_ids(b: &Broker) -> Vec<String> {
    let mut ids: Vec<String> = b
        .admin()
        .await
        .unwrap()
        .list_all_leases(None)
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.lease_id)
        .collect();
    ids.sort();
    ids
}

async fn next_resumed(events: &mut gpu_broker_client::SessionEvents) -> SessionEvent {
    tokio::time::timeout(Duration::from_secs(15), async {
        while let Some(e) = events.next().await {
            if matches!(
                e,
                SessionEvent::Resumed { .. } | SessionEvent::Reconnected { .. }
            ) {
                return e;
            }
        }
        panic!("the session closed")
    })
    .await
    .expect("resumed within 15 s")
}

#[tokio::test]
async fn a_live_workers_session_and_leases_survive_a_broker_sigkill() {
    let keeper = Keeper::start().await.unwrap();
    let mut b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        extra: keeper.flags(),
        ..BrokerOpts::default()
    })
    .unwrap();
    let token = b.tenant("alpha", QuotaSpec::new(64 * MIB)).await.unwrap();
    let client = Client::connect(&b.uri(), token).await.unwrap();
    let session = client
        .session_builder("w")
        .reconnect(Backoff::new(
            Duration::from_millis(20),
            Duration::from_millis(200),
        ))
        .await
        .unwrap();
    let mut events = session.events();
    let a = session.lease(8 * MIB).await.unwrap();
    let c = session.lease(4 * MIB).await.unwrap();
    let mut mapping = a.map().unwrap();
    mapping.as_mut_slice()[..5].copy_from_slice(b"hello");
    let before = lease_ids(&b).await;
    assert_eq!(held_bytes(&b, "alpha").await, (12 * MIB, 2));
    assert!(
        eventually(Duration::from_secs(5), || async { keeper.memfds() == 2 }).await,
        "the keeper holds each lease's memory"
    );

    b.kill().unwrap();
    // A call made while the broker is down waits, and goes through once it is back.
    let during = {
        let s = session.clone();
        tokio::spawn(async move { s.lease(2 * MIB).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    b.spawn().unwrap();
    let resumed = next_resumed(&mut events).await;
    let SessionEvent::Resumed {
        session_id,
        mut kept_leases,
        lost_leases,
    } = resumed
    else {
        panic!("expected Resumed, got {resumed:?}\n{}", b.log_text())
    };
    assert_eq!(session_id, session.id());
    kept_leases.sort();
    let mut mine = vec![a.id().to_string(), c.id().to_string()];
    mine.sort();
    assert_eq!(kept_leases, mine);
    assert!(lost_leases.is_empty());
    assert!(!a.is_lost() && !c.is_lost());
    let d = during
        .await
        .unwrap()
        .expect("the call made during the outage");
    assert_eq!(d.bytes(), 2 * MIB);
    // Operators see what the start took back.
    let status = b.ctl().arg("status").output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains("keeper: took back 2 leases (12.0 MiB) of 1 sessions, reclaimed 0 leases"),
        "{text}"
    );
    // And where the start's time went, from the process's start to serving.
    // (Wrapped to the screen: up to the header's blank line.)
    let phases: String = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("restart phases:"))
        .take_while(|l| !l.is_empty())
        .collect();
    for step in [
        "open devices",
        "keeper dump",
        "device 0 take-back",
        "monitors",
    ] {
        assert!(phases.contains(step), "{step} in {phases}");
    }

    // Same ids, same bytes, same tenant; the kept mapping still reaches the memory.
    let mut after = lease_ids(&b).await;
    after.retain(|l| l != d.id());
    assert_eq!(after, before);
    assert_eq!(held_bytes(&b, "alpha").await, (14 * MIB, 3));
    mapping.as_mut_slice()[5..8].copy_from_slice(b"!!!");
    drop(mapping);
    let again = a.map().unwrap();
    assert_eq!(&again.as_slice()[..8], b"hello!!!");
    drop(again);
    assert_eq!(
        b.memfds().len(),
        3,
        "the broker holds the adopted blocks again"
    );

    // The quota is enforced over the adopted leases.
    let over = session.lease(52 * MIB).await;
    assert_eq!(code_of(&over), Some(Code::ResourceExhausted), "{over:?}");
    a.release().await.unwrap();
    assert_eq!(held_bytes(&b, "alpha").await, (6 * MIB, 2));
    drop((c, d));
    session.close();
    drop(session);
    assert!(
        eventually(Duration::from_secs(5), || async {
            held_bytes(&b, "alpha").await == (0, 0)
        })
        .await
    );
    // What this (live) process may still map is quarantined, and kept: the keeper
    // holds exactly that.
    let admin = b.admin().await.unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            keeper.memfds() == admin.list_quarantined().await.unwrap().len()
        })
        .await,
        "the keeper let go of every released block"
    );
    let log = b.log_text();
    assert!(log.contains("took back what the keeper held"), "{log}");
    assert!(log.contains("serving after a restart"), "{log}");
}

#[tokio::test]
async fn memory_of_a_worker_that_died_while_the_broker_was_down_is_reclaimed() {
    let keeper = Keeper::start().await.unwrap();
    let mut b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        extra: keeper.flags(),
        ..BrokerOpts::default()
    })
    .unwrap();
    let token = b.tenant("beta", QuotaSpec::new(64 * MIB)).await.unwrap();
    let mut w = Proc::spawn(fault_cmd(
        &b,
        &token,
        "hold",
        &["--count", "2", "--mib", "8"],
    ))
    .unwrap();
    events_until(&mut w, "holding", Duration::from_secs(10)).await;
    assert_eq!(held_bytes(&b, "beta").await, (16 * MIB, 2));
    assert!(eventually(Duration::from_secs(5), || async { keeper.memfds() == 2 }).await);
    b.kill().unwrap();
    w.kill().await.unwrap();
    b.spawn().unwrap();
    assert_eq!(held_bytes(&b, "beta").await, (0, 0));
    assert!(lease_ids(&b).await.is_empty());
    assert!(b.memfds().is_empty(), "no block left without an owner");
    assert!(
        eventually(Duration::from_secs(5), || async { keeper.memfds() == 0 }).await,
        "the keeper dropped the dead worker's memory"
    );
    let log = b.log_text();
    assert!(log.contains("leases_reclaimed=2"), "{log}");
}

#[tokio::test]
async fn sigterm_leaves_sessions_to_the_keeper_and_a_resume_needs_the_secret() {
    let keeper = Keeper::start().await.unwrap();
    let mut b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        extra: keeper.flags(),
        ..BrokerOpts::default()
    })
    .unwrap();
    let token = b.tenant("gamma", QuotaSpec::new(64 * MIB)).await.unwrap();
    let mut raw = raw::broker(&b.uri(), &token).await;
    let mut stream = raw
        .open_session(pb::OpenSessionRequest {
            name: "raw".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let Some(pb::SessionEvent {
        event: Some(pb::session_event::Event::Opened(opened)),
    }) = stream.message().await.unwrap()
    else {
        panic!("no opened event")
    };
    assert_eq!(opened.resume_secret.len(), 64);
    let lease = raw
        .acquire_lease(pb::AcquireLeaseRequest {
            session_id: opened.session_id.clone(),
            bytes: 4 * MIB,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .lease
        .unwrap();
    let status = b.stop(Duration::from_secs(5)).unwrap();
    assert!(status.success(), "{status:?}");
    drop(stream);
    b.spawn().unwrap();
    assert_eq!(held_bytes(&b, "gamma").await, (4 * MIB, 1));
    let resume = |secret: &str, held: Vec<String>| pb::OpenSessionRequest {
        name: "raw".into(),
        resume_session_id: opened.session_id.clone(),
        resume_secret: secret.to_string(),
        held_lease_ids: held,
        ..Default::default()
    };
    let wrong = raw
        .open_session(resume(&"0".repeat(64), vec![lease.lease_id.clone()]))
        .await;
    assert_eq!(wrong.err().map(|s| s.code()), Some(Code::NotFound));
    let bad = raw
        .open_session(pb::OpenSessionRequest {
            let_go_lease_ids: vec!["not-a-lease".into()],
            ..resume(&opened.resume_secret, vec![])
        })
        .await;
    assert_eq!(bad.err().map(|s| s.code()), Some(Code::InvalidArgument));
    let mut stream = raw
        .open_session(resume(&opened.resume_secret, vec![lease.lease_id.clone()]))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    let Some(pb::session_event::Event::Opened(again)) = first.event else {
        panic!("{first:?}")
    };
    assert!(again.resumed);
    assert_eq!(again.session_id, opened.session_id);
    let second = stream.message().await.unwrap().unwrap();
    let Some(pb::session_event::Event::Resumed(r)) = second.event else {
        panic!("{second:?}")
    };
    assert_eq!(r.kept_lease_ids, vec![lease.lease_id.clone()]);
    // Attached now: a second resume is refused.
    let twice = raw
        .open_session(resume(&opened.resume_secret, vec![]))
        .await;
    assert_eq!(twice.err().map(|s| s.code()), Some(Code::NotFound));
    raw.release_lease(pb::ReleaseLeaseRequest {
        lease_id: lease.lease_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(held_bytes(&b, "gamma").await, (0, 0));
}

/// `GET /metrics` of `b`'s latest start (HTTP/1.0: read to the end).
async fn metrics_text(b: &Broker) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(b.metrics_addr().await)
        .await
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).await.unwrap();
    text
}

/// A session of `client` that resumes after a broker restart.
async fn resuming_session(client: &Client) -> gpu_broker_client::Session {
    client
        .session_builder("w")
        .reconnect(Backoff::new(
            Duration::from_millis(20),
            Duration::from_millis(200),
        ))
        .await
        .unwrap()
}

/// SIGKILLs the broker and starts it again; the session's `Resumed` event must keep
/// exactly `held` (and lose nothing), and its tenant holds exactly their bytes.
async fn restart_keeps(
    b: &mut Broker,
    events: &mut gpu_broker_client::SessionEvents,
    tenant: &str,
    held: &[&gpu_broker_client::Lease],
) {
    b.kill().unwrap();
    b.spawn().unwrap();
    let resumed = next_resumed(events).await;
    let SessionEvent::Resumed {
        mut kept_leases,
        lost_leases,
        ..
    } = resumed
    else {
        panic!("expected Resumed, got {resumed:?}\n{}", b.log_text())
    };
    kept_leases.sort();
    let mut want: Vec<String> = held.iter().map(|l| l.id().to_string()).collect();
    want.sort();
    assert_eq!(kept_leases, want, "{}", b.log_text());
    assert!(lost_leases.is_empty(), "{lost_leases:?}");
    assert_eq!(lease_ids(b).await, want);
    let bytes = held.iter().map(|l| l.bytes()).sum::<u64>();
    assert_eq!(held_bytes(b, tenant).await, (bytes, held.len() as u32));
}

/// Keeper writes are made under the state lock: a keeper stopped with SIGSTOP (its queue
/// full) must not wedge the broker. Past the write deadline it is declared lost (logged,
/// counted, `gpu-brokerctl status` says so) and the broker keeps serving. Once the keeper
/// runs again it drops what it held (stale: blocks freed since would stay), the broker
/// reconnects and gives it every live record again, so a broker SIGKILL after that loses
/// no lease.
#[tokio::test]
async fn a_stopped_keeper_is_declared_lost_then_filled_again_once_it_reads() {
    let keeper = Keeper::start().await.unwrap();
    let mut extra = keeper.flags();
    extra.extend(["--metrics-listen".into(), "127.0.0.1:0".into()]);
    let mut b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        extra,
        ..BrokerOpts::default()
    })
    .unwrap();
    let token = b.tenant("delta", QuotaSpec::new(64 * MIB)).await.unwrap();
    let client = Client::connect(&b.uri(), token).await.unwrap();
    let session = resuming_session(&client).await;
    let mut events = session.events();
    let held = session.lease(4 * MIB).await.unwrap();
    assert!(eventually(Duration::from_secs(5), || async { keeper.memfds() == 1 }).await);

    keeper.proc.signal(libc::SIGSTOP);
    // Each acquire and release is a keeper write: enough of them fill its queue. Each
    // must be answered within a few write deadlines, never wait forever.
    let mut rounds = 0;
    while !b.log_text().contains("the keeper is lost") && rounds < 5000 {
        let round = tokio::time::timeout(Duration::from_secs(10), async {
            let l = session.lease(MIB).await.unwrap();
            l.release().await.unwrap();
        })
        .await;
        assert!(
            round.is_ok(),
            "round {rounds} wedged behind the stopped keeper\n{}",
            b.log_text()
        );
        rounds += 1;
    }
    assert!(
        b.log_text().contains("the keeper is lost"),
        "{rounds} rounds and the keeper was not declared lost\n{}",
        b.log_text()
    );
    // The broker serves on, at full speed; a lease made while the keeper is lost is
    // kept once it is back.
    let t0 = Instant::now();
    for _ in 0..50 {
        session.lease(MIB).await.unwrap().release().await.unwrap();
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let during = session.lease(2 * MIB).await.unwrap();
    assert_eq!(held_bytes(&b, "delta").await, (6 * MIB, 2));
    let status = b.ctl().arg("status").output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains("keeper LOST: leases are no longer kept"),
        "{text}"
    );
    let metrics = metrics_text(&b).await;
    assert!(
        metrics.contains("gpu_broker_keeper_lost_total 1"),
        "{metrics}"
    );

    // Running again, the keeper reads what was queued and lets it go; the broker
    // reconnects and gives it exactly the live leases.
    keeper.proc.signal(libc::SIGCONT);
    assert!(
        eventually(Duration::from_secs(30), || async {
            b.log_text().contains("the keeper is back")
        })
        .await,
        "{}",
        b.log_text()
    );
    assert!(
        eventually(Duration::from_secs(5), || async { keeper.memfds() == 2 }).await,
        "the keeper holds {} descriptors, not the 2 live leases'",
        keeper.memfds()
    );
    let status = b.ctl().arg("status").output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(!text.contains("keeper LOST"), "{text}");
    let metrics = metrics_text(&b).await;
    assert!(
        metrics.contains("gpu_broker_keeper_relinked_total 1"),
        "{metrics}"
    );
    restart_keeps(&mut b, &mut events, "delta", &[&held, &during]).await;
}

/// A keeper killed and started again under a running broker: the broker sees its end
/// close, declares it lost, reconnects to the new keeper and gives it every live session
/// and lease (changes after that are kept as usual); a broker SIGKILL then loses nothing:
/// every lease of the live worker is kept (same ids, bytes, memory), the books exact.
#[tokio::test]
async fn a_keeper_restarted_under_the_broker_is_filled_again_and_a_broker_sigkill_loses_nothing() {
    let mut keeper = Keeper::start().await.unwrap();
    let mut extra = keeper.flags();
    extra.extend(["--metrics-listen".into(), "127.0.0.1:0".into()]);
    let mut b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        extra,
        ..BrokerOpts::default()
    })
    .unwrap();
    let token = b.tenant("eps", QuotaSpec::new(64 * MIB)).await.unwrap();
    let client = Client::connect(&b.uri(), token).await.unwrap();
    let session = resuming_session(&client).await;
    let mut events = session.events();
    let a = session.lease(8 * MIB).await.unwrap();
    let c = session.lease(4 * MIB).await.unwrap();
    let mut mapping = a.map().unwrap();
    mapping.as_mut_slice()[..5].copy_from_slice(b"hello");
    assert!(eventually(Duration::from_secs(5), || async { keeper.memfds() == 2 }).await);

    keeper.restart().await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async { keeper.memfds() == 2 }).await,
        "the new keeper holds {} descriptors\n{}",
        keeper.memfds(),
        b.log_text()
    );
    let log = b.log_text();
    assert!(log.contains("the keeper is lost"), "{log}");
    assert!(log.contains("the keeper is back"), "{log}");
    let metrics = metrics_text(&b).await;
    assert!(
        metrics.contains("gpu_broker_keeper_lost_total 1")
            && metrics.contains("gpu_broker_keeper_relinked_total 1"),
        "{metrics}"
    );
    // Kept as usual from here: a release and a new lease reach the new keeper.
    c.release().await.unwrap();
    let d = session.lease(2 * MIB).await.unwrap();
    assert!(eventually(Duration::from_secs(5), || async { keeper.memfds() == 2 }).await);

    restart_keeps(&mut b, &mut events, "eps", &[&a, &d]).await;
    mapping.as_mut_slice()[5..8].copy_from_slice(b"!!!");
    drop(mapping);
    assert_eq!(&a.map().unwrap().as_slice()[..8], b"hello!!!");
    // The quota is enforced over the kept leases.
    let over = session.lease(56 * MIB).await;
    assert_eq!(code_of(&over), Some(Code::ResourceExhausted), "{over:?}");
}

/// The keeper holds every tenant's memory: it answers its own user only, not root (root in
/// a container is not the host's broker). A keeper of uid 65534 closes root's connection
/// without a word; its socket's missing directory is made 0700.
#[tokio::test]
async fn the_keeper_answers_only_its_own_user() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::chown(dir.path(), Some(65534), Some(65534)).unwrap();
    let socket = dir.path().join("kept").join("keeper.sock");
    let mut cmd = Command::new(bin("gpu-broker"));
    cmd.arg("keeper")
        .arg("--socket")
        .arg(&socket)
        .uid(65534)
        .gid(65534);
    let mut keeper = Proc::spawn(cmd).unwrap();
    keeper
        .line_starting(
            "stderr: gpu-broker keeper: listening",
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    let mode = std::fs::metadata(socket.parent().unwrap())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "the socket's directory: {mode:o}");
    // Root (this test) asks for the dump: the connection closes with nothing sent.
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import socket, sys\n\
             s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n\
             s.settimeout(10)\n\
             s.connect(sys.argv[1])\n\
             try:\n\
             \x20   s.send(b'{\"op\":\"dump\"}')\n\
             \x20   print('closed' if s.recv(65536) == b'' else 'answered')\n\
             except (BrokenPipeError, ConnectionResetError):\n\
             \x20   print('closed')",
        )
        .arg(&socket)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "closed",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    keeper
        .line_starting(
            "stderr: gpu-broker keeper: refused a connection of uid Ok(0)",
            Duration::from_secs(10),
        )
        .await
        .unwrap();
}

/// A claim's pod keeps its lease across a broker SIGKILL: the claim's reservation comes
/// back from the store and the kept lease of the claim's session is drawn from it again,
/// so the tenant is charged the claim's bytes once (not the claim and the lease beside it).
#[tokio::test]
async fn a_claims_kept_lease_is_drawn_from_the_restored_claim_after_a_sigkill() {
    let keeper = Keeper::start().await.unwrap();
    let mut b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        extra: keeper.flags(),
        ..BrokerOpts::default()
    })
    .unwrap();
    b.tenant("alpha", QuotaSpec::new(64 * MIB)).await.unwrap();
    let granted = b
        .admin()
        .await
        .unwrap()
        .raw()
        .reserve_claim(pb::ReserveClaimRequest {
            claim: "uid-k".into(),
            tenant: "alpha".into(),
            bytes: 32 * MIB,
            device: 0,
            label: "ns/c".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let client = Client::connect(&b.uri(), granted.token).await.unwrap();
    let session = client
        .session_builder("pod")
        .reconnect(Backoff::new(
            Duration::from_millis(20),
            Duration::from_millis(200),
        ))
        .await
        .unwrap();
    let mut events = session.events();
    let lease = session.lease(8 * MIB).await.unwrap();
    assert_eq!(usage(&b, "alpha").await, (8 * MIB, 24 * MIB));
    assert!(eventually(Duration::from_secs(5), || async { keeper.memfds() == 1 }).await);

    b.kill().unwrap();
    b.spawn().unwrap();
    let resumed = next_resumed(&mut events).await;
    assert!(
        matches!(&resumed, SessionEvent::Resumed { kept_leases, .. } if kept_leases.len() == 1),
        "{resumed:?}\n{}",
        b.log_text()
    );
    assert_eq!(
        usage(&b, "alpha").await,
        (8 * MIB, 24 * MIB),
        "charged once"
    );
    // Released, the lease's bytes go back into the claim, and the claim's to the tenant.
    lease.release().await.unwrap();
    assert_eq!(usage(&b, "alpha").await, (0, 32 * MIB));
    drop(session);
    let admin = b.admin().await.unwrap();
    admin
        .raw()
        .release_claim(pb::ReleaseClaimRequest {
            claim: "uid-k".into(),
        })
        .await
        .unwrap();
    assert_eq!(usage(&b, "alpha").await, (0, 0));
}

/// Memory a worker keeps after its free (`fault-worker strand`: a lease's memfd sealed
/// against shrinking, mapped, then released) is charged to its tenant as kept after its
/// free, and that charge survives a broker SIGKILL: the keeper holds its record, the
/// restarted broker charges the same tenant the same bytes again (the start's report and
/// metrics count it) and lifts it once the worker exits, removing the record, so the next
/// restart takes nothing back. Without the record the restart would give the tenant back
/// memory the worker still holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_kept_after_its_free_stays_charged_across_a_broker_sigkill() {
    let keeper = Keeper::start().await.unwrap();
    let mut extra = keeper.flags();
    extra.extend(["--metrics-listen".into(), "127.0.0.1:0".into()]);
    let mut b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        extra,
        ..BrokerOpts::default()
    })
    .unwrap();
    stranded_charge_survives_a_sigkill(&mut b).await;
}

/// A broker with a place to keep records (and `--metrics-listen`): a `fault-worker
/// strand` of alpha's keeps 16 MiB after their free; the charge is there, is there again
/// with the same tenant and bytes after a SIGKILL and restart (report, status, metrics),
/// goes once the worker exits, and the next restart takes nothing back.
pub(crate) async fn stranded_charge_survives_a_sigkill(b: &mut Broker) {
    let token = b.tenant("alpha", QuotaSpec::new(64 * MIB)).await.unwrap();
    let mut worker = Proc::spawn(fault_cmd(b, &token, "strand", &["--mib", "16"])).unwrap();
    let pid = event(&mut worker, "stranded", Duration::from_secs(20)).await["pid"]
        .as_u64()
        .unwrap() as u32;
    let kept = (
        vec![(
            "alpha".to_string(),
            16 * MIB,
            gpu_broker_client::HoldReason::KeptAfterFree,
            vec![pid],
        )],
        16 * MIB,
    );
    eventually(Duration::from_secs(10), || async {
        charges(b).await == kept
    })
    .await;
    assert_eq!(charges(b).await, kept, "charged as kept after its free");

    b.kill().unwrap();
    b.spawn().unwrap();
    assert_eq!(
        charges(b).await,
        kept,
        "charged again after the restart\n{}",
        b.log_text()
    );
    let status = b.ctl().arg("status").output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains("1 charges of memory kept outside the broker (16.0 MiB, lifted 0)"),
        "{text}"
    );
    let metrics = metrics_text(b).await;
    assert!(
        metrics.contains("gpu_broker_restart_kept_stranded_total{outcome=\"adopted\"} 1"),
        "{metrics}"
    );
    assert!(alive(pid), "the worker still holds its memory");

    // The worker exits: the charge is lifted and its record leaves the keeper.
    worker.kill().await.unwrap();
    worker.wait(Duration::from_secs(10)).await.unwrap();
    let none = (Vec::new(), 0);
    eventually(Duration::from_secs(15), || async {
        charges(b).await == none
    })
    .await;
    assert_eq!(charges(b).await, none, "lifted once the worker exited");
    b.kill().unwrap();
    b.spawn().unwrap();
    let status = b.ctl().arg("status").output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        !text.contains("charges of memory kept outside the broker"),
        "the next restart takes nothing back: {text}"
    );
    assert_eq!(charges(b).await, none);
    assert_broker_alive(b);
}

/// Each charge `b` lists (tenant, bytes, reason, holders), and the bytes charged to alpha.
async fn charges(
    b: &Broker,
) -> (
    Vec<(String, u64, gpu_broker_client::HoldReason, Vec<u32>)>,
    u64,
) {
    let admin = b.admin().await.unwrap();
    let listed = admin
        .list_quarantined()
        .await
        .unwrap()
        .into_iter()
        .map(|q| (q.tenant, q.bytes, q.reason, q.holder_pids))
        .collect();
    (
        listed,
        tenant(&admin, "alpha").await.usage.quarantined_bytes,
    )
}

/// A process outside the lease's session that fetched its descriptor (`e2e-worker read
/// --hold`: a renewed ticket) and maps it: the lease's record names it, so after a broker
/// SIGKILL and restart the lease's release still holds the memory for it, charged to the
/// tenant (listed, quarantined bytes) until it exits; then the charge goes. Without it in
/// the record the restarted broker frees (revokes) the memory at the release and the
/// tenant is charged nothing while that process may keep it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_ticket_recipient_keeps_the_lease_charged_after_a_broker_sigkill() {
    use gpu_broker_client::HoldReason;
    let keeper = Keeper::start().await.unwrap();
    let mut b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        extra: keeper.flags(),
        ..BrokerOpts::default()
    })
    .unwrap();
    let token = b.tenant("alpha", QuotaSpec::new(64 * MIB)).await.unwrap();
    let client = Client::connect(&b.uri(), token.clone()).await.unwrap();
    let session = resuming_session(&client).await;
    let mut events = session.events();
    let lease = session.lease(2 * MIB).await.unwrap();
    lease.map().unwrap().fill(0x44);
    let id = lease.id().to_string();
    let mut child =
        Proc::spawn(worker_cmd(&b, &token, &["read", "--lease", &id, "--hold"])).unwrap();
    let sum = child
        .line_starting("SUM ", Duration::from_secs(20))
        .await
        .unwrap();
    assert!(sum.ends_with("0x44"), "{sum}");

    b.kill().unwrap();
    b.spawn().unwrap();
    let resumed = next_resumed(&mut events).await;
    assert!(
        matches!(&resumed, SessionEvent::Resumed { kept_leases, .. } if kept_leases == std::slice::from_ref(&id)),
        "{resumed:?}\n{}",
        b.log_text()
    );
    lease.release().await.unwrap();
    let held = (
        vec![(
            "alpha".to_string(),
            2 * MIB,
            HoldReason::Recipients,
            vec![child.pid],
        )],
        2 * MIB,
    );
    assert_eq!(
        charges(&b).await,
        held,
        "held for the recipient after the restart\n{}",
        b.log_text()
    );
    assert!(alive(child.pid), "the recipient still maps the memory");

    child.signal(libc::SIGKILL);
    let _ = child.wait(Duration::from_secs(10)).await;
    let none = (Vec::new(), 0);
    eventually(Duration::from_secs(15), || async {
        charges(&b).await == none
    })
    .await;
    assert_eq!(charges(&b).await, none, "let go once the recipient exited");
    assert_broker_alive(&b);
}

/// The same recipient, but the lease is released before the SIGKILL: the block held for
/// it is kept, so the restarted broker charges it again until that process exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_held_for_a_renewed_ticket_recipient_stays_charged_across_a_broker_sigkill() {
    use gpu_broker_client::HoldReason;
    let keeper = Keeper::start().await.unwrap();
    let mut b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        extra: keeper.flags(),
        ..BrokerOpts::default()
    })
    .unwrap();
    let token = b.tenant("alpha", QuotaSpec::new(64 * MIB)).await.unwrap();
    let client = Client::connect(&b.uri(), token.clone()).await.unwrap();
    let session = resuming_session(&client).await;
    let lease = session.lease(2 * MIB).await.unwrap();
    let id = lease.id().to_string();
    let mut child =
        Proc::spawn(worker_cmd(&b, &token, &["read", "--lease", &id, "--hold"])).unwrap();
    child
        .line_starting("SUM ", Duration::from_secs(20))
        .await
        .unwrap();
    lease.release().await.unwrap();
    let held = (
        vec![(
            "alpha".to_string(),
            2 * MIB,
            HoldReason::Recipients,
            vec![child.pid],
        )],
        2 * MIB,
    );
    assert!(
        eventually(Duration::from_secs(10), || async {
            charges(&b).await == held
        })
        .await,
        "held for the recipient: {:?}",
        charges(&b).await
    );

    b.kill().unwrap();
    b.spawn().unwrap();
    assert_eq!(
        charges(&b).await,
        held,
        "held again after the restart\n{}",
        b.log_text()
    );
    child.signal(libc::SIGKILL);
    let _ = child.wait(Duration::from_secs(10)).await;
    let none = (Vec::new(), 0);
    eventually(Duration::from_secs(15), || async {
        charges(&b).await == none
    })
    .await;
    assert_eq!(charges(&b).await, none, "let go once the recipient exited");
    assert_broker_alive(&b);
}
