//! A worker killed with SIGKILL gets its memory back to the pool within a second, and
//! the block is reused.

use gpu_broker_client::QuotaSpec;
use gpu_broker_client::{Client, LeaseHandle};
use gpu_broker_tests::*;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_worker_memory_returns_within_a_second() {
    let b = Broker::start().unwrap();
    let token = b.tenant("crashy", QuotaSpec::new(64 * MIB)).await.unwrap();
    let admin = b.admin().await.unwrap();
    let mut w = hold(
        &b,
        &token,
        &["--bytes", "8MiB", "--count", "2", "--pattern", "0xEE"],
    )
    .await
    .unwrap();
    let blocks: Vec<_> = w.leases.iter().map(|l| l.block.clone()).collect();
    assert_eq!(
        admin.get_quota("crashy").await.unwrap().usage.held_bytes,
        16 * MIB
    );
    let d = &admin.get_devices().await.unwrap()[0];
    assert_eq!((d.leased_bytes, d.lease_count), (16 * MIB, 2));

    let t0 = Instant::now();
    w.proc.signal(libc::SIGKILL);
    let back = eventually(Duration::from_secs(1), || async {
        let t = admin.get_quota("crashy").await.unwrap();
        let d = admin.get_devices().await.unwrap().remove(0);
        t.usage.held_bytes == 0 && t.usage.lease_count == 0 && d.leased_bytes == 0
    })
    .await;
    let took = t0.elapsed();
    assert!(back, "memory not back within 1 s:\n{}", b.log_text());
    println!("memory back {took:?} after SIGKILL");
    w.proc.kill().await.unwrap();

    // The blocks went to the cache (not quarantine: the process is gone), the session
    // ended, and nothing is listed any more.
    assert!(
        eventually(Duration::from_secs(2), || async {
            let d = admin.get_devices().await.unwrap().remove(0);
            d.cached_bytes == 16 * MIB && d.quarantined_bytes == 0
        })
        .await,
        "{:?}",
        admin.get_devices().await
    );
    assert!(admin.list_all_leases(None).await.unwrap().is_empty());
    assert!(admin.list_sessions(None).await.unwrap().is_empty());
    assert_eq!(
        admin
            .get_quota("crashy")
            .await
            .unwrap()
            .usage
            .quarantined_bytes,
        0
    );

    // A new lease of the same size is served from the cache: no new memory object.
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("after-crash").await.unwrap();
    let l = s.lease(8 * MIB).await.unwrap();
    let LeaseHandle::Fd(i) = l.handle().clone() else {
        panic!("{:?}", l.handle())
    };
    let p = format!("fd:{}", i.block_id);
    assert!(blocks.contains(&p), "{p:?} is one of {blocks:?}");
    let d = &admin.get_devices().await.unwrap()[0];
    assert_eq!(d.cached_bytes, 8 * MIB);
    assert_eq!(d.leased_bytes, 8 * MIB);
    assert_eq!(b.memfds().len(), 2, "{:?}", b.memfds());
    l.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_waiting_in_the_queue_leaves_it() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "32MiB",
        ..Default::default()
    })
    .unwrap();
    let token = b.tenant("t", QuotaSpec::new(GIB)).await.unwrap();
    let admin = b.admin().await.unwrap();
    let c = Client::connect(&b.uri(), token.clone()).await.unwrap();
    let s = c.session("holder").await.unwrap();
    let all = s.lease(32 * MIB).await.unwrap();

    let mut waiter = Proc::spawn(worker_cmd(
        &b,
        &token,
        &["hold", "--bytes", "16MiB", "--wait-ms", "30000"],
    ))
    .unwrap();
    waiter
        .line_starting("SESSION", Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            admin.get_devices().await.unwrap()[0].waiting_requests == 1
        })
        .await
    );
    assert_eq!(
        admin.get_quota("t").await.unwrap().usage.waiting_requests,
        1
    );
    waiter.kill().await.unwrap();
    assert!(
        eventually(Duration::from_secs(2), || async {
            admin.get_devices().await.unwrap()[0].waiting_requests == 0
        })
        .await,
        "a dead waiter stays queued"
    );
    // Releasing now grants nothing to the dead waiter.
    all.release().await.unwrap();
    let d = &admin.get_devices().await.unwrap()[0];
    assert_eq!((d.leased_bytes, d.lease_count), (0, 0));
    assert_eq!(admin.list_sessions(None).await.unwrap().len(), 1);
}
