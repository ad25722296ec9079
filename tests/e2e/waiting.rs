//! Waiting in the queue: granted when memory comes back, FIFO within a tenant, and a
//! caller that goes away leaves the queue.

use gpu_broker_client::{Client, Lease, Session};
use gpu_broker_tests::*;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

async fn waiting(b: &Broker) -> u32 {
    devices(b).await.unwrap()[0].waiting_requests
}

async fn until_waiting(b: &Broker, n: u32) {
    assert!(
        eventually(Duration::from_secs(5), || async { waiting(b).await == n }).await,
        "waiting_requests never reached {n} (now {})",
        waiting(b).await
    );
}

fn small_broker() -> Broker {
    Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        ..Default::default()
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_is_granted_when_another_session_releases() {
    let b = small_broker();
    let holder = b.client("holder", GIB).await.unwrap();
    let hs = holder.session("h").await.unwrap();
    let full = hs.lease(64 * MIB).await.unwrap();
    let c = b.client("waiter", GIB).await.unwrap();
    let s = c.session("w").await.unwrap();

    let releaser = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        full.release().await.unwrap();
    });
    let t0 = Instant::now();
    let l = s
        .lease_request(32 * MIB)
        .wait(Duration::from_secs(5))
        .send()
        .await
        .unwrap();
    let waited = t0.elapsed();
    releaser.await.unwrap();
    assert!(
        waited >= Duration::from_millis(150),
        "granted after {waited:?}"
    );
    assert!(waited < Duration::from_secs(4), "granted after {waited:?}");
    assert_eq!(l.bytes(), 32 * MIB);
    // The freed block was another tenant's: it is handed out zeroed.
    assert!(l.map().unwrap().iter().all(|&x| x == 0));
    assert_eq!(waiting(&b).await, 0);
    assert_eq!(s.usage().await.unwrap().usage.held_bytes, 32 * MIB);
}

/// Spawns a waiting request that records its label in `order` when granted.
fn waiter(
    s: &Session,
    bytes: u64,
    label: &'static str,
    order: &Arc<Mutex<Vec<&'static str>>>,
) -> tokio::task::JoinHandle<Lease> {
    let s = s.clone();
    let order = order.clone();
    tokio::spawn(async move {
        let l = s
            .lease_request(bytes)
            .label(label)
            .wait(Duration::from_secs(20))
            .send()
            .await
            .unwrap();
        order.lock().await.push(label);
        l
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_one_tenant_are_served_in_order_without_overtaking() {
    let b = small_broker();
    let holder = b.client("holder", GIB).await.unwrap();
    let hs = holder.session("h").await.unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(hs.lease(16 * MIB).await.unwrap());
    }
    let c = b.client("w", GIB).await.unwrap();
    let s1 = c.session("first").await.unwrap();
    let s2 = c.session("second").await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));

    // First a big request, then a small one that would fit earlier.
    let big = waiter(&s1, 48 * MIB, "big", &order);
    until_waiting(&b, 1).await;
    let small = waiter(&s2, 16 * MIB, "small", &order);
    until_waiting(&b, 2).await;

    // 16 MiB free: enough for the small request, but it must not overtake the big one.
    held.pop().unwrap().release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let granted = order.lock().await.clone();
    assert!(granted.is_empty(), "{granted:?}");
    assert_eq!(waiting(&b).await, 2);

    // 48 MiB free: the big one goes first; the small one still waits.
    held.pop().unwrap().release().await.unwrap();
    held.pop().unwrap().release().await.unwrap();
    let big = tokio::time::timeout(Duration::from_secs(5), big)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(big.bytes(), 48 * MIB);
    assert_eq!(*order.lock().await, vec!["big"]);
    until_waiting(&b, 1).await;

    held.pop().unwrap().release().await.unwrap();
    let small = tokio::time::timeout(Duration::from_secs(5), small)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(*order.lock().await, vec!["big", "small"]);
    assert_eq!(waiting(&b).await, 0);
    assert_eq!(c.usage().await.unwrap().usage.held_bytes, 64 * MIB);
    drop((big, small));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_waiters_are_first_come_first_served() {
    let b = small_broker();
    let c = b.client("t", GIB).await.unwrap();
    let hs = c.session("h").await.unwrap();
    let a = hs.lease(32 * MIB).await.unwrap();
    let bb = hs.lease(32 * MIB).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let w1 = waiter(&hs, 32 * MIB, "one", &order);
    until_waiting(&b, 1).await;
    let w2 = waiter(&hs, 32 * MIB, "two", &order);
    until_waiting(&b, 2).await;
    a.release().await.unwrap();
    let one = tokio::time::timeout(Duration::from_secs(5), w1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(one.label(), "one");
    assert_eq!(*order.lock().await, vec!["one"]);
    bb.release().await.unwrap();
    let two = tokio::time::timeout(Duration::from_secs(5), w2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(two.label(), "two");
    assert_eq!(*order.lock().await, vec!["one", "two"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_waiting_request_leaves_the_queue() {
    let b = small_broker();
    let c = b.client("t", GIB).await.unwrap();
    let s = c.session("s").await.unwrap();
    let full = s.lease(64 * MIB).await.unwrap();

    // The caller gives up: its future is dropped while the broker still queues it.
    let s2 = s.clone();
    let gave_up = tokio::spawn(async move {
        s2.lease_request(16 * MIB)
            .wait(Duration::from_secs(30))
            .send()
            .await
    });
    until_waiting(&b, 1).await;
    assert_eq!(s.usage().await.unwrap().usage.waiting_requests, 1);
    gave_up.abort();
    until_waiting(&b, 0).await;

    // Same through a timeout on the client side.
    let r = tokio::time::timeout(
        Duration::from_millis(300),
        s.lease_request(16 * MIB)
            .wait(Duration::from_secs(30))
            .send(),
    )
    .await;
    assert!(r.is_err(), "still waiting when the client gave up");
    until_waiting(&b, 0).await;

    // A session that ends takes its waiting requests with it.
    let other = Client::connect(&b.uri(), {
        b.admin()
            .await
            .unwrap()
            .issue_token("t", "second")
            .await
            .unwrap()
            .token
    })
    .await
    .unwrap();
    let so = other.session("ends").await.unwrap();
    let so2 = so.clone();
    let pending = tokio::spawn(async move {
        so2.lease_request(16 * MIB)
            .wait(Duration::from_secs(30))
            .send()
            .await
    });
    until_waiting(&b, 1).await;
    so.close();
    until_waiting(&b, 0).await;
    let r = tokio::time::timeout(Duration::from_secs(5), pending)
        .await
        .unwrap()
        .unwrap();
    assert!(r.is_err(), "{r:?}");

    // Nothing was granted to the ghosts.
    full.release().await.unwrap();
    let d = &devices(&b).await.unwrap()[0];
    assert_eq!((d.leased_bytes, d.lease_count), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_bound_by_its_own_quota_is_granted_when_the_tenant_releases() {
    let b = Broker::start().unwrap();
    let c = b.client("t", 16 * MIB).await.unwrap();
    let s1 = c.session("holder").await.unwrap();
    let s2 = c.session("waiter").await.unwrap();
    let held = s1.lease(12 * MIB).await.unwrap();
    // The device has room; the tenant's quota does not (12 + 8 > 16).
    let w = {
        let s2 = s2.clone();
        tokio::spawn(async move {
            s2.lease_request(8 * MIB)
                .wait(Duration::from_secs(10))
                .send()
                .await
        })
    };
    assert!(
        eventually(Duration::from_secs(5), || async {
            c.usage().await.unwrap().usage.waiting_requests == 1
        })
        .await
    );
    // Another tenant is not held up behind it.
    let other = b.client("o", GIB).await.unwrap();
    let so = other.session("o").await.unwrap();
    so.lease(32 * MIB).await.unwrap().release().await.unwrap();
    assert!(!w.is_finished());
    held.release().await.unwrap();
    let l = tokio::time::timeout(Duration::from_secs(5), w)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(l.bytes(), 8 * MIB);
    let u = c.usage().await.unwrap();
    assert_eq!((u.usage.held_bytes, u.usage.waiting_requests), (8 * MIB, 0));
}

/// A waiting acquire whose token is revoked meanwhile (its session ends with the token)
/// is refused for its token, as every call with that token now is, not as though it had
/// named a session that does not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_token_is_revoked_is_refused_for_its_token() {
    use gpu_broker_client::QuotaSpec;
    let b = small_broker();
    let holder = b.client("holder", GIB).await.unwrap();
    let hs = holder.session("h").await.unwrap();
    let _full = hs.lease(64 * MIB).await.unwrap();
    let token = b.tenant("waiter", QuotaSpec::new(GIB)).await.unwrap();
    let c = Client::connect(&b.uri(), token.clone()).await.unwrap();
    let s = c.session("w").await.unwrap();
    let waiter = tokio::spawn(async move {
        s.lease_request(32 * MIB)
            .wait(Duration::from_secs(20))
            .send()
            .await
    });
    until_waiting(&b, 1).await;
    revoked_while_waiting(&b, &token, waiter).await;
    // The refusal any call with the token gets now.
    let now = c.usage().await.unwrap_err();
    assert_eq!(
        now.reason(),
        Some(&gpu_broker_client::error::Reason::TokenUnknown),
        "{now}"
    );
    assert_eq!(waiting(&b).await, 0);
    // The holder's lease and the broker are untouched.
    assert_eq!(hs.usage().await.unwrap().usage.held_bytes, 64 * MIB);
}
