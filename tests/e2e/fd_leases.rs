//! fd leases: the descriptor behind a lease reaches only the process its ticket was issued
//! to, once; every misuse gets the connection closed with nothing sent, is counted, and
//! leaves the lease as it was. Descriptors do not leak on either side over many cycles.

use crate::observability::metric;
use gpu_broker_client::error::Reason;
use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::{Client, LeaseHandle, QuotaSpec};
use gpu_broker_tests::*;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A fresh ticket for `lease`, bound to this process, not yet redeemed.
async fn ticket(c: &Client, lease: &str) -> pb::FdHandle {
    c.raw()
        .renew_lease_ticket(pb::RenewLeaseTicketRequest {
            lease_id: lease.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .fd
        .unwrap()
}

/// Presents raw bytes at the ticket socket; returns (data bytes, got a descriptor).
fn present(socket: &str, bytes: &[u8]) -> (usize, bool) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s.write_all(bytes).unwrap();
    if bytes.len() < 32 {
        // Say we are done: a short ticket must be refused, not waited for.
        s.shutdown(std::net::Shutdown::Write).unwrap();
    }
    use std::os::fd::AsFd;
    let got = gpu_broker_client::fd::recv_with_fd(s.as_fd()).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    (got.len + rest.len(), got.fd.is_some())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_ticket_misuse_is_refused_counted_and_leaves_the_lease_alone() {
    let b = Broker::start_with(BrokerOpts {
        extra: vec![
            "--metrics-listen".into(),
            "127.0.0.1:0".into(),
            "--ticket-ttl".into(),
            "300ms".into(),
        ],
        ..Default::default()
    })
    .unwrap();
    let token = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let c = Client::connect(&b.uri(), token.clone()).await.unwrap();
    let s = c.session("w").await.unwrap();
    let lease = s.lease(4 * MIB).await.unwrap();
    lease.map().unwrap().fill(0x42);
    let LeaseHandle::Fd(info) = lease.handle().clone() else {
        panic!("{:?}", lease.handle())
    };
    assert_eq!(info.memory_kind, gpu_broker_client::MemoryKind::HostMemfd);
    assert!(info.ticket.is_empty(), "the client used its ticket");
    let socket = info.socket_path.display().to_string();
    assert_eq!(
        PathBuf::from(&socket),
        b.socket.with_file_name("broker.tickets.sock")
    );

    // The right ticket: one byte and one descriptor, once.
    let h = ticket(&c, lease.id()).await;
    assert_eq!(h.ticket.len(), 32);
    assert_eq!(present(&socket, &h.ticket), (1, true));
    // Reused.
    assert_eq!(present(&socket, &h.ticket), (0, false));
    // Wrong (never issued).
    assert_eq!(present(&socket, &[0x5a; 32]), (0, false));
    // Malformed (too short).
    assert_eq!(present(&socket, &h.ticket[..7]), (0, false));
    // Expired.
    let late = ticket(&c, lease.id()).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(present(&socket, &late.ticket), (0, false));
    // Foreign: another process of the same user presents this process's ticket.
    let stolen = ticket(&c, lease.id()).await;
    let out = Proc::spawn(worker_cmd(
        &b,
        &token,
        &[
            "redeem",
            "--socket",
            &socket,
            "--ticket",
            &hex(&stolen.ticket),
        ],
    ))
    .unwrap()
    .finish(T)
    .await
    .unwrap()
    .1;
    assert!(out.contains("REFUSED"), "{out}");
    // ... which does not use it up for its rightful holder.
    assert_eq!(present(&socket, &stolen.ticket), (1, true));

    // A ticket of a lease that ended before it was redeemed (a foreign peer learns
    // nothing of it: the table's unit tests; this broker's TTL is too short to spawn one):
    let gone = s.lease(2 * MIB).await.unwrap();
    let h2 = ticket(&c, gone.id()).await;
    gone.release().await.unwrap();
    // its rightful holder is told "lease ended" (one byte, no descriptor), once...
    assert_eq!(present(&socket, &h2.ticket), (1, false));
    assert_eq!(present(&socket, &h2.ticket), (0, false));
    // ...and the client reports it as such, not as a refused ticket.
    let revoked = s.lease(2 * MIB).await.unwrap();
    let h4 = ticket(&c, revoked.id()).await;
    b.admin()
        .await
        .unwrap()
        .revoke_lease(revoked.id(), "test")
        .await
        .unwrap();
    let e = gpu_broker_client::fd::fetch(std::path::Path::new(&socket), &h4.ticket, None)
        .await
        .unwrap_err();
    assert!(
        matches!(e, gpu_broker_client::ClientError::LeaseEnded(_)),
        "{e}"
    );
    assert_eq!(e.code_name(), "NOT_FOUND");
    assert!(e.to_string().contains("lease ended"), "{e}");
    // The lease that was not revoked still gives its descriptor (a ticket minted now: this
    // broker's TTL is shorter than the steps above take on a loaded machine).
    let h3 = ticket(&c, lease.id()).await;
    assert_eq!(present(&socket, &h3.ticket), (1, true));

    // Counted by reason, and logged.
    let refused = |r: &str| format!("gpu_broker_ticket_refusals_total{{reason=\"{r}\"}}");
    assert_eq!(metric(&b, &refused("unknown_or_used")).await, 3.0);
    assert_eq!(metric(&b, &refused("lease_ended")).await, 2.0);
    assert_eq!(metric(&b, &refused("expired")).await, 1.0);
    assert_eq!(metric(&b, &refused("foreign_peer")).await, 1.0);
    assert_eq!(metric(&b, &refused("malformed")).await, 1.0);
    // Delivered: the three grants (the first with its ticket, the next two sent with the
    // grant on the client's descriptor channel, opened after the first), and the three good
    // tickets.
    assert_eq!(metric(&b, "gpu_broker_tickets_redeemed_total").await, 4.0);
    assert_eq!(metric(&b, "gpu_broker_descriptors_pushed_total").await, 2.0);
    assert_eq!(b.log_text().matches("ticket refused").count(), 6);

    // The lease is as it was: listed, mapped, its bytes intact.
    assert_eq!(c.list_leases().await.unwrap().len(), 1);
    assert!(lease.map().unwrap().iter().all(|&x| x == 0x42));
    lease.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_presented_by_another_uid_is_refused() {
    // SAFETY: plain getter.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: needs root to run a child as nobody");
        return;
    }
    let b = Broker::start().unwrap();
    // Let nobody reach the ticket socket (the test directory is private otherwise).
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(b.dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let token = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let c = Client::connect(&b.uri(), token.clone()).await.unwrap();
    let s = c.session("w").await.unwrap();
    let lease = s.lease(2 * MIB).await.unwrap();
    let h = ticket(&c, lease.id()).await;
    let out = Proc::spawn(worker_cmd(
        &b,
        &token,
        &[
            "--as-uid",
            "65534",
            "redeem",
            "--socket",
            &h.socket_path,
            "--ticket",
            &hex(&h.ticket),
        ],
    ))
    .unwrap()
    .finish(T)
    .await
    .unwrap()
    .1;
    assert!(out.contains("REFUSED"), "{out}");
    assert!(b.log_text().contains("foreign_peer"), "{}", b.log_text());
    // The rightful process still gets it.
    assert_eq!(present(&h.socket_path, &h.ticket), (1, true));
    lease.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(deprecated)] // asks for the removed legacy kind
async fn handle_kinds_are_negotiated() {
    let b = Broker::start().unwrap();
    let token = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("w").await.unwrap();
    // An old worker that names no kinds gets the safest the broker serves: an fd.
    let raw = |accept: Vec<i32>| pb::AcquireLeaseRequest {
        session_id: s.id().to_string(),
        bytes: MIB,
        accept_handles: accept,
        ..Default::default()
    };
    let l = c
        .raw()
        .acquire_lease(raw(vec![]))
        .await
        .unwrap()
        .into_inner();
    let lease = l.lease.unwrap();
    assert!(
        matches!(&lease.handle, Some(pb::lease::Handle::Fd(h)) if h.ticket.len() == 32),
        "{:?}",
        lease.handle
    );
    c.release_lease(&lease.lease_id).await.unwrap();
    // Only legacy kinds: refused before anything is granted (the broker serves fd only).
    // Naming the removed legacy CUDA IPC kind says so with its own reason.
    for (kinds, reason) in [
        (
            vec![pb::HandleKind::CudaIpc as i32],
            Some(Reason::LegacyHandlesRemoved),
        ),
        (
            vec![
                pb::HandleKind::CudaIpc as i32,
                pb::HandleKind::HostShm as i32,
            ],
            Some(Reason::LegacyHandlesRemoved),
        ),
        (
            vec![pb::HandleKind::HostShm as i32],
            Some(Reason::FdHandlesNotAccepted),
        ),
    ] {
        let e = c.raw().acquire_lease(raw(kinds)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("HANDLE_KIND_FD"), "{e:?}");
        let e = gpu_broker_client::ClientError::from(e);
        assert_eq!(e.reason(), reason.as_ref(), "{e}");
        assert_eq!(e.detail("served_kinds"), Some("HANDLE_KIND_FD"), "{e}");
        if reason == Some(Reason::LegacyHandlesRemoved) {
            assert!(e.message().contains("docs/security.md"), "{e}");
        }
    }
    let e = c.raw().acquire_lease(raw(vec![77])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert_eq!(c.usage().await.unwrap().usage.held_bytes, 0);
    // Renewing a ticket of another tenant's lease, or of no lease, is NOT_FOUND.
    let e = c
        .raw()
        .renew_lease_ticket(pb::RenewLeaseTicketRequest {
            lease_id: uuid::Uuid::new_v4().to_string(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
}

/// After a worker's first lease (its descriptor fetched with a ticket), the descriptors of
/// its next leases come with their grants on its descriptor channel: no ticket is minted or
/// redeemed, and each descriptor is its own lease's memory, also for grants made at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_leases_come_with_their_descriptors_and_no_ticket() {
    use std::os::fd::AsRawFd;
    let b = Broker::start_with(BrokerOpts {
        extra: vec!["--metrics-listen".into(), "127.0.0.1:0".into()],
        ..Default::default()
    })
    .unwrap();
    let token = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("w").await.unwrap();
    let first = s.lease(4 * MIB).await.unwrap();
    let pushed = |l: &gpu_broker_client::Lease| match l.handle() {
        LeaseHandle::Fd(i) => i.pushed,
        h => panic!("{h:?}"),
    };
    assert!(
        !pushed(&first),
        "the first lease's descriptor came with a ticket"
    );
    let leases: Vec<_> = futures::future::join_all((0..8).map(|_| s.lease(4 * MIB)))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let inode = |l: &gpu_broker_client::Lease| {
        // SAFETY: fstat into a zeroed local.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        assert_eq!(
            unsafe { libc::fstat(l.fd().unwrap().as_raw_fd(), &mut st) },
            0
        );
        st.st_ino
    };
    let mut seen = std::collections::HashSet::from([inode(&first)]);
    for (i, l) in leases.iter().enumerate() {
        assert!(pushed(l), "lease {i} came with a ticket");
        assert!(
            seen.insert(inode(l)),
            "lease {i} got another lease's memory"
        );
        l.map().unwrap().fill(i as u8);
    }
    for (i, l) in leases.iter().enumerate() {
        assert!(l.map().unwrap().as_slice().iter().all(|&x| x == i as u8));
    }
    assert_eq!(metric(&b, "gpu_broker_tickets_redeemed_total").await, 1.0);
    assert_eq!(metric(&b, "gpu_broker_descriptors_pushed_total").await, 8.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_descriptor_leaks_after_10000_acquire_map_release_cycles() {
    let b = Broker::start().unwrap();
    let token = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    // A worker process of its own (this test process runs other tests at the same time):
    // 10,000 cycles over 8 sessions, opened and warmed up (first connections, a pooled
    // block each) before either side counts.
    let mut w = Proc::spawn(worker_cmd(
        &b,
        &token,
        &["cycles", "--count", "10000", "--sessions", "8"],
    ))
    .unwrap();
    w.line_starting("WARM ", T).await.unwrap();
    // Not counting the pooled blocks' memfds (at most one per session).
    let others = |n: usize| n - b.memfds().len();
    let Some(broker_before) = b.open_fds().map(others) else {
        println!("skipped: cannot read the broker's fd table");
        return;
    };
    w.send("go").await.unwrap();
    let fds = w
        .line_starting("FDS ", Duration::from_secs(300))
        .await
        .unwrap();
    let broker_after = others(b.open_fds().unwrap());
    let n: Vec<usize> = fds
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap())
        .collect();
    // The client keeps a ticket connection per concurrent fetch (8 sessions: at most 8),
    // and the broker keeps its end of each for up to a second: bounded, not a leak (a leak
    // over 10,000 cycles is thousands).
    let kept = 8;
    assert!(n[1] <= n[0] + kept, "worker fds {} -> {}", n[0], n[1]);
    // (+2: a ticket connection the broker may not have finished closing yet.)
    assert!(
        broker_after <= broker_before + kept + 2,
        "broker fds {broker_before} -> {broker_after}"
    );
    assert!(
        b.memfds().len() <= 8,
        "pooled blocks only: {:?}",
        b.memfds()
    );
    assert_eq!(
        devices(&b).await.unwrap()[0].cached_bytes,
        2 * MIB * b.memfds().len() as u64
    );
    w.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_workers_memfd_memory_leaves_nothing_behind() {
    let b = Broker::start().unwrap();
    let ta = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let tb = b.tenant("bob", QuotaSpec::new(GIB)).await.unwrap();
    let admin = b.admin().await.unwrap();
    let mut w = hold(
        &b,
        &ta,
        &["--bytes", "4MiB", "--count", "2", "--pattern", "0x77"],
    )
    .await
    .unwrap();
    let pid = w.proc.pid;
    let worker_memfds = || {
        fd_links(pid)
            .iter()
            .filter(|(_, l)| l.starts_with("/memfd:"))
            .count()
    };
    assert_eq!(
        worker_memfds(),
        2,
        "the worker holds one descriptor per lease"
    );
    w.proc.signal(libc::SIGKILL);
    w.proc.kill().await.unwrap();
    assert!(
        eventually(T, || async {
            admin.list_all_leases(None).await.unwrap().is_empty()
                && admin.get_devices().await.unwrap()[0].cached_bytes == 8 * MIB
        })
        .await
    );
    // Nothing on any filesystem; the broker keeps only its two pooled objects...
    assert!(b.shm_dir_files().is_empty());
    assert_eq!(b.memfds().len(), 2);
    // ... which another tenant never gets: its leases are fresh objects, and alice's old
    // ones are freed for them (the broker then holds only bob's).
    let mut bw = hold(
        &b,
        &tb,
        &["--bytes", "4MiB", "--count", "2", "--expect-initial", "0"],
    )
    .await
    .unwrap();
    assert_eq!(admin.get_devices().await.unwrap()[0].cached_bytes, 0);
    assert_eq!(b.memfds().len(), 2, "{:?}", b.memfds());
    bw.proc.kill().await.unwrap();
}

/// A ticket socket at its connection limit says "busy" rather than refusing: the client
/// presents its (untouched) ticket again and gets its descriptor once a slot frees, so a
/// burst of workers never sees a spurious "ticket refused".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_ticket_socket_delays_a_lease_instead_of_refusing_it() {
    let b = Broker::start_with(BrokerOpts {
        extra: vec!["--metrics-listen".into(), "127.0.0.1:0".into()],
        ..Default::default()
    })
    .unwrap();
    let token = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("w").await.unwrap();
    let socket = b.socket.with_file_name("broker.tickets.sock");
    // Take every slot this user has (the per-uid cap plus the reserve of the broker's own
    // user, which this test is): connections that send nothing hold a slot for up to 5 s.
    let mut held = Vec::new();
    while held.len() < 64 {
        let h = UnixStream::connect(&socket).unwrap();
        held.push(h);
    }
    // Wait until the broker answers a further connection "busy".
    let deadline = std::time::Instant::now() + T;
    loop {
        let mut probe = UnixStream::connect(&socket).unwrap();
        probe.set_read_timeout(Some(T)).unwrap();
        let mut byte = [9u8; 1];
        if probe.read(&mut byte).unwrap() == 1 && byte[0] == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never busy");
    }
    let lease = tokio::spawn(async move {
        let lease = s.lease(4 * MIB).await;
        (s, lease)
    });
    // The lease waits on the busy socket (its fetch retries)...
    tokio::time::sleep(Duration::from_millis(300)).await;
    if lease.is_finished() {
        let (_s, l) = lease.await.unwrap();
        panic!(
            "the lease got past a full ticket socket: {:?}",
            l.map(|l| l.id().to_string())
        );
    }
    // ...and gets its descriptor once the slots free.
    drop(held);
    let (_s, lease) = tokio::time::timeout(T, lease).await.unwrap().unwrap();
    let lease = lease.unwrap();
    lease.map().unwrap().fill(7);
    let busy = metric(&b, "gpu_broker_ticket_refusals_total{reason=\"busy\"}").await;
    assert!(busy >= 1.0, "busy answers are counted: {busy}");
}

/// The removed legacy CUDA IPC handles setting, as a flag or in a config file, stops the
/// broker at start with why (and where to read more), before it serves anything.
#[test]
fn the_broker_refuses_to_start_with_the_removed_legacy_handles_setting() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("broker.toml");
    std::fs::write(&config, "backend = \"host\"\nlegacy-ipc-handles = true\n").unwrap();
    let socket = dir.path().join("b.sock");
    for extra in [
        vec!["--legacy-ipc-handles".to_string()],
        vec!["--config".to_string(), config.display().to_string()],
    ] {
        let out = std::process::Command::new(bin("gpu-broker"))
            .args(["--backend", "host", "--socket"])
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(&extra)
            .env_remove("GPU_BROKER_LEGACY_IPC_HANDLES")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(
            err.contains("legacy-ipc-handles") && err.contains("is no longer a setting"),
            "{extra:?}: {err}"
        );
        assert!(err.contains("docs/security.md"), "{err}");
        assert!(!err.contains("unknown setting") && !err.contains("unexpected argument"));
        assert!(!socket.exists(), "it served nothing");
    }
}
