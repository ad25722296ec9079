//! Cross-process data visibility: a lease's memory is really shared between processes.

use gpu_broker_client::HostMapping;
use gpu_broker_client::QuotaSpec;
use gpu_broker_tests::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_cross_process_boundaries_both_ways() {
    let b = Broker::start().unwrap();
    let token = b.tenant("alice", QuotaSpec::new(64 * MIB)).await.unwrap();

    // Process A leases 6 MiB and fills it with 0xAB.
    let mut a = hold(&b, &token, &["--bytes", "6MiB", "--pattern", "0xAB"])
        .await
        .unwrap();
    let lease = a.leases[0].clone();
    assert_eq!(lease.bytes, 6 * MIB);
    // The broker reports the same memory object to the operator (no ticket in listings).
    let all = b
        .admin()
        .await
        .unwrap()
        .list_all_leases(None)
        .await
        .unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].lease_id, lease.id);
    match &all[0].handle {
        gpu_broker_client::LeaseHandle::Fd(i) => {
            assert_eq!(format!("fd:{}", i.block_id), lease.block);
            assert!(i.ticket.is_empty());
        }
        other => panic!("{other:?}"),
    }
    // The test process maps it too, with a descriptor fetched with a ticket of its own.
    let c = gpu_broker_client::Client::connect(&b.uri(), token.clone())
        .await
        .unwrap();
    let (_, fd) = c.lease_fd(&lease.id).await.unwrap();
    use std::os::fd::AsFd;
    let mut mine = HostMapping::from_fd(fd.as_fd(), 0, lease.bytes).unwrap();

    // Process B maps the same lease and reads exactly the pattern.
    let reader = Proc::spawn(worker_cmd(
        &b,
        &token,
        &["read", "--lease", &lease.id, "--expect-byte", "0xAB"],
    ))
    .unwrap();
    let (status, out) = reader.finish(T).await.unwrap();
    assert!(status.success(), "{out}");
    assert!(
        out.contains(&format!("SUM {} {}", 6 * MIB, 6 * MIB * 0xAB)),
        "{out}"
    );

    // The test process sees it too.
    assert!(mine.iter().all(|&x| x == 0xAB));

    // Process B writes 0x5C; process A sees it.
    let writer = Proc::spawn(worker_cmd(
        &b,
        &token,
        &["write", "--lease", &lease.id, "--pattern", "0x5C"],
    ))
    .unwrap();
    let (status, out) = writer.finish(T).await.unwrap();
    assert!(status.success(), "{out}");
    a.proc.send("check 0x5C").await.unwrap();
    assert_eq!(a.proc.line_starting("CHECK", T).await.unwrap(), "CHECK ok");

    // A single byte written by the test at the very end is seen by A as well.
    {
        let last = mine.len() - 1;
        mine[last] = 0x01;
    }
    a.proc.send("check 0x5C").await.unwrap();
    assert_eq!(
        a.proc.line_starting("CHECK", T).await.unwrap(),
        format!("CHECK bad {} 0x01", 6 * MIB - 1)
    );

    // A writes, B reads it back.
    a.proc.send("fill 0x77").await.unwrap();
    a.proc.line_starting("FILLED", T).await.unwrap();
    let reader = Proc::spawn(worker_cmd(
        &b,
        &token,
        &["read", "--lease", &lease.id, "--expect-byte", "0x77"],
    ))
    .unwrap();
    let (status, out) = reader.finish(T).await.unwrap();
    assert!(status.success(), "{out}");
    a.proc.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_crate_lease_is_visible_to_a_worker_process() {
    let b = Broker::start().unwrap();
    let token = b.tenant("alice", QuotaSpec::new(64 * MIB)).await.unwrap();
    let c = gpu_broker_client::Client::connect(&b.uri(), token.clone())
        .await
        .unwrap();
    let s = c.session("in-test").await.unwrap();
    let lease = s.lease(MIB + 1).await.unwrap();
    assert_eq!(lease.bytes(), 2 * MIB);
    assert!(
        matches!(lease.handle(), gpu_broker_client::LeaseHandle::Fd(i) if i.memory_kind == gpu_broker_client::MemoryKind::HostMemfd),
        "host backend gives memfd fd leases, got {:?}",
        lease.handle()
    );
    {
        let mut m = lease.map().unwrap();
        assert_eq!(m.len() as u64, 2 * MIB);
        for (i, x) in m.iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
    }
    let expected: u64 = (0..2 * MIB).map(|i| i % 251).sum();
    let reader = Proc::spawn(worker_cmd(&b, &token, &["read", "--lease", lease.id()])).unwrap();
    let (status, out) = reader.finish(T).await.unwrap();
    assert!(status.success(), "{out}");
    assert!(
        out.contains(&format!("SUM {} {expected} 0x00", 2 * MIB)),
        "{out}"
    );
    lease.release().await.unwrap();
}
