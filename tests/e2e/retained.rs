//! Retained blocks through the client crate on the host backend: a released lease's block
//! kept mapped by its process comes back to that process with no ticket and its mapping
//! in place, stays counted to its tenant while retained, and goes to nobody else before
//! the process let go (which it does when the broker asks for it).

use crate::observability::metric;
use gpu_broker_client::{Client, Contents, LeaseHandle, QuotaSpec, Resident};
use gpu_broker_tests::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_block_comes_back_mapped_with_no_ticket_and_stays_counted() {
    let b = Broker::start_with(BrokerOpts {
        extra: vec!["--metrics-listen".into(), "127.0.0.1:0".into()],
        ..Default::default()
    })
    .unwrap();
    let token = b.tenant("alice", QuotaSpec::new(64 * MIB)).await.unwrap();
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("w").await.unwrap();
    s.retain_mappings(32 * MIB);

    let mut first = s.lease(16 * MIB).await.unwrap();
    let LeaseHandle::Fd(info) = first.handle().clone() else {
        panic!("{:?}", first.handle())
    };
    assert!(!info.retained, "a fresh block comes with a ticket");
    let m = first.mapped().unwrap();
    m.fill(0x5a);
    let ptr = m.as_ptr();
    first.release().await.unwrap();
    assert_eq!(s.retained_bytes(), 16 * MIB);
    let u = s.usage().await.unwrap().usage;
    assert_eq!(
        (u.held_bytes, u.quarantined_bytes),
        (0, 16 * MIB),
        "a retained block stays counted to its tenant"
    );

    let mut again = s.lease(16 * MIB).await.unwrap();
    let LeaseHandle::Fd(i) = again.handle().clone() else {
        panic!()
    };
    assert!(
        i.retained && i.ticket.is_empty(),
        "granted as the block held: {i:?}"
    );
    assert_eq!(i.block_id, info.block_id);
    assert_eq!(s.retained_bytes(), 0);
    let m = again.mapped().unwrap();
    assert_eq!(m.as_ptr(), ptr, "the same mapping, not a new one");
    assert!(m.iter().all(|&x| x == 0x5a));
    // Another size is not it.
    let other = s.lease(8 * MIB).await.unwrap();
    let LeaseHandle::Fd(o) = other.handle().clone() else {
        panic!()
    };
    assert!(!o.retained);
    other.release().await.unwrap();
    again.release().await.unwrap();
    // The block came back on the session's lease line, not a gRPC call, and both
    // retaining releases after it went there too.
    let line = |op: &str, answer: &str| {
        format!("gpu_broker_lease_line_requests_total{{op=\"{op}\",answer=\"{answer}\"}}")
    };
    assert_eq!(metric(&b, &line("acquire", "granted")).await, 1.0);
    assert_eq!(metric(&b, &line("acquire", "not_here")).await, 0.0);
    assert_eq!(metric(&b, &line("release", "released")).await, 2.0);

    // Let go: confirmed, the memory is the cache's again and counts to nobody.
    s.drop_retained().await;
    let u = s.usage().await.unwrap().usage;
    assert_eq!((u.held_bytes, u.quarantined_bytes), (0, 0));
}

/// Another tenant waits for memory a retained block holds: the broker asks the process,
/// its session lets go, and the waiter is granted (fresh memory: another tenant's block is
/// never handed on). Without the ask the waiter would time out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_of_another_tenant_gets_the_memory_once_the_retaining_process_lets_go() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        ..Default::default()
    })
    .unwrap();
    let ta = b.tenant("alice", QuotaSpec::new(64 * MIB)).await.unwrap();
    let tb = b.tenant("bob", QuotaSpec::new(64 * MIB)).await.unwrap();
    let a = Client::connect(&b.uri(), ta).await.unwrap();
    let sa = a.session("a").await.unwrap();
    sa.retain_mappings(64 * MIB);
    let mut l = sa.lease(48 * MIB).await.unwrap();
    l.mapped().unwrap().fill(1);
    l.release().await.unwrap();
    assert_eq!(sa.retained_bytes(), 48 * MIB);

    let bc = Client::connect(&b.uri(), tb).await.unwrap();
    let sb = bc.session("b").await.unwrap();
    let mut got = sb
        .lease_request(32 * MIB)
        .wait(Duration::from_secs(10))
        .send()
        .await
        .expect("granted once alice's process let go");
    assert!(
        got.mapped().unwrap().iter().all(|&x| x == 0),
        "fresh memory"
    );
    assert_eq!(sa.retained_bytes(), 0);
    let u = sa.usage().await.unwrap().usage;
    assert_eq!(u.quarantined_bytes, 0);
    got.release().await.unwrap();
}

/// A `Resident` released while its session retains mappings keeps its range mapped with
/// the block: the next resident of a lease granted from that block is at the same address
/// with the bytes in place (nothing reserved or mapped again). A sleep gives its memory
/// back: never retained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_resident_keeps_its_range_for_the_next_lease_of_its_block_but_a_sleep_retains_nothing(
) {
    let b = Broker::start().unwrap();
    let token = b.tenant("alice", QuotaSpec::new(64 * MIB)).await.unwrap();
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("w").await.unwrap();
    s.retain_mappings(32 * MIB);

    let mut r = Resident::new(s.lease(16 * MIB).await.unwrap()).unwrap();
    r.as_mut_slice().unwrap().fill(0x3c);
    let addr = r.addr();
    r.release().await.unwrap();
    assert_eq!(s.retained_bytes(), 16 * MIB);
    // Were the range unmapped, a new mapping of its size would likely land on it, and the
    // next resident elsewhere.
    // SAFETY: a fresh anonymous mapping, unmapped below.
    let other = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            (16 * MIB) as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_ne!(other, libc::MAP_FAILED);
    assert_ne!(other as u64, addr, "the retained range is still mapped");

    let lease = s.lease(16 * MIB).await.unwrap();
    assert!(matches!(lease.handle(), LeaseHandle::Fd(i) if i.retained));
    let mut r = Resident::new(lease).unwrap();
    assert_eq!(r.addr(), addr, "the same range, mapped already");
    assert!(r.as_slice().unwrap().iter().all(|&x| x == 0x3c));
    // SAFETY: the mapping made above, unmapped once.
    unsafe { libc::munmap(other, (16 * MIB) as usize) };

    // Asleep: nothing held, nothing retained.
    r.sleep(Contents::Discard).await.unwrap();
    assert_eq!(s.retained_bytes(), 0);
    let u = s.usage().await.unwrap().usage;
    assert_eq!((u.held_bytes, u.quarantined_bytes), (0, 0));
    r.wake(None).await.unwrap();
    assert_eq!(r.addr(), addr);
    r.release_unretained().await.unwrap();
    assert_eq!(s.retained_bytes(), 0);
    let u = s.usage().await.unwrap().usage;
    assert_eq!((u.held_bytes, u.quarantined_bytes), (0, 0));
}

/// A release whose retained block pushes the cache over its bound lets the oldest go, and
/// the broker has heard of it when the release returns: the next request of the tenant is
/// not refused for memory this process no longer keeps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_let_go_past_the_bound_is_confirmed_before_the_release_returns() {
    let b = Broker::start().unwrap();
    let token = b.tenant("alice", QuotaSpec::new(32 * MIB)).await.unwrap();
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("w").await.unwrap();
    s.retain_mappings(16 * MIB);
    let first = s.lease(16 * MIB).await.unwrap();
    let second = s.lease(8 * MIB).await.unwrap();
    first.release().await.unwrap();
    second.release().await.unwrap();
    assert_eq!(s.retained_bytes(), 8 * MIB, "the oldest went");
    let u = s.usage().await.unwrap().usage;
    assert_eq!(
        u.quarantined_bytes,
        8 * MIB,
        "and the broker knows it already"
    );
    // The tenant's whole quota but what is retained: granted at once.
    let big = s.lease(24 * MIB).await.unwrap();
    big.release().await.unwrap();
}

/// A release asking to retain memory the broker will not retain (here a published lease)
/// is declined with nothing released; the client then unmaps, closes and releases it
/// plainly, so the lease ends all the same and nothing stays held, retained, or charged
/// as memory this process kept after its free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declined_retain_is_released_plainly_after_the_mapping_is_gone() {
    let b = Broker::start().unwrap();
    let token = b.tenant("alice", QuotaSpec::new(64 * MIB)).await.unwrap();
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("w").await.unwrap();
    s.retain_mappings(32 * MIB);
    let mut lease = s.lease(16 * MIB).await.unwrap();
    lease.mapped().unwrap().fill(1);
    lease.publish("weights", &[]).await.unwrap();
    lease.release().await.unwrap();
    assert_eq!(s.retained_bytes(), 0, "published memory is never retained");
    // Time for the device thread to free the sealed block and look for its holders (it
    // found this process mapping it when the broker released under the mapping).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let u = s.usage().await.unwrap().usage;
    assert_eq!(
        (u.held_bytes, u.quarantined_bytes, u.lease_count),
        (0, 0, 0),
        "released after the decline"
    );
}

/// At the wire: a retaining release of published memory from a client that handles
/// declines is declined with the lease still the caller's; from one that does not
/// (`may_decline` unset, as clients before declines send) it is a plain release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retaining_release_is_declined_only_for_a_client_that_handles_it() {
    use gpu_broker_client::proto as pb;
    let b = Broker::start().unwrap();
    let token = b.tenant("alice", QuotaSpec::new(64 * MIB)).await.unwrap();
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("w").await.unwrap();
    for may_decline in [true, false] {
        let lease = s.lease(16 * MIB).await.unwrap();
        lease
            .publish(&format!("w-{may_decline}"), &[])
            .await
            .unwrap();
        let id = lease.detach().lease_id;
        let reply = c
            .raw()
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: id.clone(),
                retain_mapping: true,
                may_decline,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!reply.retained);
        assert_eq!(reply.declined, may_decline);
        let u = s.usage().await.unwrap().usage;
        assert_eq!(
            u.lease_count,
            u32::from(may_decline),
            "declined: still leased"
        );
        if may_decline {
            c.release_lease(&id).await.unwrap();
        }
        assert_eq!(s.usage().await.unwrap().usage.lease_count, 0);
    }
}

/// `GPU_BROKER_CLIENT_LEASE_LINE=off` sends a retaining client's leases over gRPC (what the
/// GPU harness's side-by-side runs rest on); by default they take the lease line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_switch_sends_retained_leases_over_grpc() {
    let b = Broker::start_with(BrokerOpts {
        extra: vec!["--metrics-listen".into(), "127.0.0.1:0".into()],
        ..Default::default()
    })
    .unwrap();
    let token_file = b.state_dir.join("admin.token");
    let granted = "gpu_broker_lease_line_requests_total{op=\"acquire\",answer=\"granted\"}";
    let mut seen = Vec::new();
    for line in ["off", "on"] {
        let out = std::process::Command::new(bin("gpu-broker-bench"))
            .args(["--broker", &b.uri(), "--admin-token-file"])
            .arg(&token_file)
            .args(["latency", "--retain", "--sizes", "2MiB"])
            .args(["--iterations", "20", "--warmup", "2", "--repeat", "1"])
            .env("GPU_BROKER_CLIENT_LEASE_LINE", line)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        seen.push(metric(&b, granted).await);
    }
    assert_eq!(seen[0], 0.0, "off: none on a line");
    assert!(
        seen[1] >= 20.0,
        "on: every measured acquire on the line: {seen:?}"
    );
}
