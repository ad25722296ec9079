//! The shortest path through the broker: start, lease, map, release, stop clean.

use gpu_broker_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_round_trip_and_clean_shutdown() {
    let mut b = Broker::start().unwrap();
    let c = b.client("alice", 64 * MIB).await.unwrap();
    let s = c.session("smoke").await.unwrap();
    let lease = s.lease(3 * MIB).await.unwrap();
    assert_eq!(lease.bytes(), 4 * MIB, "rounded up to 2 MiB granules");
    {
        let mut m = lease.map().unwrap();
        m[0] = 42;
    }
    assert_eq!(s.usage().await.unwrap().usage.held_bytes, 4 * MIB);
    lease.release().await.unwrap();
    assert_eq!(s.usage().await.unwrap().usage.held_bytes, 0);
    drop(s);
    let status =
        tokio::task::block_in_place(|| b.stop(std::time::Duration::from_secs(10))).unwrap();
    assert!(status.success(), "{status}\n{}", b.log_text());
    assert!(b.memfds().is_empty(), "left behind: {:?}", b.memfds());
}
