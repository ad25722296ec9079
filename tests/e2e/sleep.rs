//! Sleep and wake (host backend): a resident lease keeps its addresses across sleep and
//! wake, its contents when saved to a host-tier lease, and its quota is released while it
//! sleeps and charged again on wake; a wake waits or is refused exactly like an acquire;
//! a resident that sleeps on reclaim requests gives its memory back to a waiting tenant
//! by itself.

use gpu_broker_client::{Client, Code, Contents, QuotaSpec, Resident};
use gpu_broker_tests::*;
use std::time::Duration;

async fn usage(c: &Client) -> (u64, u64) {
    let u = c.usage().await.unwrap();
    (u.usage.held_bytes, u.usage.host_held_bytes)
}

async fn tenant(b: &Broker, name: &str, limit: u64, host_limit: u64) -> Client {
    let token = b
        .tenant(
            name,
            QuotaSpec {
                host_limit_bytes: host_limit,
                ..QuotaSpec::new(limit)
            },
        )
        .await
        .unwrap();
    Client::connect(&b.uri(), token).await.unwrap()
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 12)) as u8
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleep_and_wake_keep_the_addresses_and_saved_contents_and_release_the_quota() {
    let b = Broker::start().unwrap();
    let c = tenant(&b, "alice", GIB, GIB).await;
    let s = c.session("sleeper").await.unwrap();
    let lease = s
        .lease_request(8 * MIB)
        .label("weights")
        .send()
        .await
        .unwrap();
    let mut r = Resident::new(lease).unwrap();
    let addr = r.addr();
    for (i, b) in r.as_mut_slice().unwrap().iter_mut().enumerate() {
        *b = pattern(i);
    }
    assert_eq!(usage(&c).await, (8 * MIB, 0));

    // Asleep with contents: no device bytes charged, the host copy is.
    r.sleep(Contents::Save).await.unwrap();
    assert!(!r.is_awake() && r.has_saved_contents());
    assert!(r.as_slice().is_none());
    assert_eq!(usage(&c).await, (0, 8 * MIB));
    // Another tenant's worker could take the memory now; the address is still ours.
    // SAFETY: a read-only query of our own address range.
    let mut vec = [0u8; 1];
    let rc = unsafe { libc::mincore(addr as *mut libc::c_void, 4096, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "the range stays reserved while asleep");

    r.wake(None).await.unwrap();
    assert_eq!(r.addr(), addr, "the same addresses");
    assert!(r.is_awake() && !r.has_saved_contents());
    let m = r.as_slice().unwrap();
    assert_eq!(m.len(), 8 * MIB as usize);
    assert!(
        m.iter().enumerate().all(|(i, &b)| b == pattern(i)),
        "contents restored"
    );
    assert_eq!(usage(&c).await, (8 * MIB, 0));
    assert_eq!(r.lease().unwrap().label(), "weights");

    // Without contents: nothing charged at all while asleep; the address stays.
    r.sleep(Contents::Discard).await.unwrap();
    assert_eq!(usage(&c).await, (0, 0));
    r.sleep(Contents::Discard).await.unwrap();
    r.wake(None).await.unwrap();
    assert_eq!(r.addr(), addr);
    r.as_mut_slice().unwrap()[0] = 7;
    assert_eq!(usage(&c).await, (8 * MIB, 0));
    drop(r);
    assert!(
        eventually(Duration::from_secs(10), || async {
            usage(&c).await == (0, 0)
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waking_waits_or_is_refused_like_an_acquire() {
    let b = Broker::start().unwrap();
    let c = tenant(&b, "alice", 8 * MIB, 8 * MIB).await;
    let s = c.session("sleeper").await.unwrap();
    let mut r = Resident::new(s.lease(8 * MIB).await.unwrap()).unwrap();
    r.as_mut_slice().unwrap().fill(0x5c);
    r.sleep(Contents::Save).await.unwrap();
    // While it sleeps the tenant uses its quota for something else.
    let other = s.lease(8 * MIB).await.unwrap();
    let e = r.wake(None).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(
        !r.is_awake() && r.has_saved_contents(),
        "still asleep, contents kept"
    );
    let e = r.wake(Some(Duration::from_millis(200))).await.unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
    // A waiting wake is granted when the memory comes back.
    let addr = r.addr();
    let waker =
        tokio::spawn(async move { r.wake(Some(Duration::from_secs(20))).await.map(|()| r) });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waker.is_finished());
    other.release().await.unwrap();
    let r = waker.await.unwrap().unwrap();
    assert_eq!(r.addr(), addr);
    assert!(r.as_slice().unwrap().iter().all(|&x| x == 0x5c));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_the_host_limit_refuses_leaves_the_lease_awake() {
    let b = Broker::start().unwrap();
    let c = tenant(&b, "alice", GIB, 0).await;
    let s = c.session("sleeper").await.unwrap();
    let mut r = Resident::new(s.lease(4 * MIB).await.unwrap()).unwrap();
    r.as_mut_slice().unwrap().fill(0x21);
    let e = r.sleep(Contents::Save).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(r.is_awake());
    assert!(r.as_slice().unwrap().iter().all(|&x| x == 0x21));
    assert_eq!(usage(&c).await, (4 * MIB, 0));
    // Host-tier leases asked for directly are fd memfd leases of the host tier.
    let c2 = tenant(&b, "bob", GIB, 16 * MIB).await;
    let s2 = c2.session("h").await.unwrap();
    let h = s2
        .lease_request(3 * MIB)
        .host_tier(true)
        .send()
        .await
        .unwrap();
    assert_eq!(h.tier(), gpu_broker_client::Tier::Host);
    assert!(h.bytes() >= 3 * MIB);
    h.map().unwrap().fill(1);
    assert_eq!(usage(&c2).await, (0, h.bytes()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_tier_lease_wakes_as_host_memory() {
    let b = Broker::start().unwrap();
    let c = tenant(&b, "alice", GIB, 64 * MIB).await;
    let s = c.session("h").await.unwrap();
    let h = s
        .lease_request(4 * MIB)
        .host_tier(true)
        .send()
        .await
        .unwrap();
    let mut r = Resident::new(h).unwrap();
    r.as_mut_slice().unwrap().fill(0x42);
    let addr = r.addr();
    r.sleep(Contents::Save).await.unwrap();
    assert_eq!(usage(&c).await, (0, 4 * MIB), "only the saved copy");
    r.wake(None).await.unwrap();
    assert_eq!(r.addr(), addr);
    assert_eq!(r.lease().unwrap().tier(), gpu_broker_client::Tier::Host);
    assert!(r.as_slice().unwrap().iter().all(|&x| x == 0x42));
    assert_eq!(
        usage(&c).await,
        (0, 4 * MIB),
        "host memory again, not device memory"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reclaim_request_puts_an_auto_sleeping_resident_to_sleep() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        extra: vec!["--reclaim-deadline".into(), "20s".into()],
        ..BrokerOpts::default()
    })
    .unwrap();
    let quota = |priority| QuotaSpec {
        priority,
        host_limit_bytes: 64 * MIB,
        ..QuotaSpec::new(64 * MIB)
    };
    let low = Client::connect(&b.uri(), b.tenant("low", quota(0)).await.unwrap())
        .await
        .unwrap();
    let high = Client::connect(&b.uri(), b.tenant("high", quota(10)).await.unwrap())
        .await
        .unwrap();
    let ls = low.session("sleeper").await.unwrap();
    let lease = ls
        .lease_request(48 * MIB)
        .reclaimable(true)
        .label("kv")
        .send()
        .await
        .unwrap();
    let first_id = lease.id().to_string();
    let mut r = Resident::new(lease).unwrap();
    let addr = r.addr();
    for (i, b) in r.as_mut_slice().unwrap().iter_mut().enumerate() {
        *b = pattern(i);
    }
    let auto = r.sleep_on_reclaim(Contents::Save);

    // A higher-priority tenant waits for memory only the sleeper's lease can give.
    let hs = high.session("high").await.unwrap();
    let want = tokio::spawn(async move {
        let l = hs
            .lease_request(32 * MIB)
            .wait(Duration::from_secs(20))
            .send()
            .await;
        (hs, l)
    });
    // The reclaim request puts it to sleep by itself: contents saved, lease released.
    assert_eq!(auto.reclaimed_after(0, Duration::from_secs(20)).await, 1);
    assert_eq!(auto.last_error(), None);
    let (hs, granted) = want.await.unwrap();
    let granted = granted.expect("the waiting tenant is granted");
    assert_eq!(granted.bytes(), 32 * MIB);
    {
        let g = auto.lock().await;
        assert!(!g.is_awake() && g.has_saved_contents());
        assert_eq!(g.addr(), addr);
    }
    assert_eq!(
        usage(&low).await,
        (0, 48 * MIB),
        "only the host copy is charged"
    );
    let admin = b.admin().await.unwrap();
    let leases = admin.list_all_leases(Some("low")).await.unwrap();
    assert!(
        leases.iter().all(|l| l.lease_id != first_id),
        "the reclaimed lease is gone, not revoked and quarantined"
    );
    assert!(admin.list_quarantined().await.unwrap().is_empty());

    // The other tenant is done: wake at the same address with the contents back.
    granted.release().await.unwrap();
    drop(hs);
    {
        let mut g = auto.lock().await;
        g.wake(Some(Duration::from_secs(10))).await.unwrap();
        assert_eq!(g.addr(), addr, "the same addresses");
        let m = g.as_slice().unwrap();
        assert!(
            m.iter().enumerate().all(|(i, &b)| b == pattern(i)),
            "contents restored"
        );
        assert!(g.lease().unwrap().info().reclaimable);
        assert_ne!(g.lease().unwrap().id(), first_id);
    }
    assert_eq!(usage(&low).await, (48 * MIB, 0));
    // The watcher follows the new lease: the next reclaim puts it to sleep again.
    let hs = high.session("high-2").await.unwrap();
    let again = hs
        .lease_request(32 * MIB)
        .wait(Duration::from_secs(20))
        .send()
        .await
        .unwrap();
    assert_eq!(auto.reclaimed_after(1, Duration::from_secs(20)).await, 2);
    again.release().await.unwrap();
    // Stopping the watcher gives the resident back, asleep, contents kept.
    let mut r = auto.into_inner().await;
    assert!(!r.is_awake() && r.has_saved_contents());
    r.wake(None).await.unwrap();
    assert_eq!(r.as_slice().unwrap()[12345], pattern(12345));
    r.release().await.unwrap();
    assert_eq!(usage(&low).await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reclaim_sleep_that_cannot_save_keeps_the_memory_and_says_why() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        extra: vec!["--reclaim-deadline".into(), "20s".into()],
        ..BrokerOpts::default()
    })
    .unwrap();
    // No host limit: the contents cannot be saved.
    let low = Client::connect(
        &b.uri(),
        b.tenant("low", QuotaSpec::new(64 * MIB)).await.unwrap(),
    )
    .await
    .unwrap();
    let high = Client::connect(
        &b.uri(),
        b.tenant(
            "high",
            QuotaSpec {
                priority: 10,
                ..QuotaSpec::new(64 * MIB)
            },
        )
        .await
        .unwrap(),
    )
    .await
    .unwrap();
    let ls = low.session("sleeper").await.unwrap();
    let lease = ls
        .lease_request(48 * MIB)
        .reclaimable(true)
        .send()
        .await
        .unwrap();
    let mut r = Resident::new(lease).unwrap();
    r.as_mut_slice().unwrap().fill(0x77);
    let auto = r.sleep_on_reclaim(Contents::Save);
    let hs = high.session("high").await.unwrap();
    let want = tokio::spawn(async move {
        hs.lease_request(32 * MIB)
            .wait(Duration::from_millis(1500))
            .send()
            .await
            .map(|_| ())
    });
    // The save is refused: the resident stays awake with its bytes, and says why.
    assert_eq!(auto.reclaimed_after(0, Duration::from_secs(20)).await, 0);
    let why = auto.last_error().expect("the failed sleep is reported");
    assert!(why.to_lowercase().contains("host"), "{why}");
    {
        let g = auto.lock().await;
        assert!(g.is_awake() && !g.has_saved_contents());
        assert!(g.as_slice().unwrap().iter().all(|&x| x == 0x77));
    }
    assert_eq!(usage(&low).await, (48 * MIB, 0));
    assert_eq!(
        want.await.unwrap().unwrap_err().code(),
        Code::DeadlineExceeded
    );
}
