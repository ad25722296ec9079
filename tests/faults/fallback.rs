//! Host-memory fallback: when the device is full, a request that allows it gets a lease of
//! host shared memory (tier HOST) within the tenant's host limit; beyond that limit, or for
//! a tenant without one, RESOURCE_EXHAUSTED.

use super::*;
use gpu_broker_client::{Client, Tier};

#[tokio::test]
async fn host_fallback_within_the_host_limit() {
    let mut b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        extra: vec!["--host-fallback-capacity".into(), "256MiB".into()],
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let fill = b.tenant("fill", QuotaSpec::new(64 * MIB)).await.unwrap();
    let t = b
        .tenant(
            "t",
            QuotaSpec {
                limit_bytes: 64 * MIB,
                host_limit_bytes: 32 * MIB,
                ..QuotaSpec::default()
            },
        )
        .await
        .unwrap();
    let none = b.tenant("none", QuotaSpec::new(64 * MIB)).await.unwrap();
    let fc = Client::connect(&b.uri(), fill).await.unwrap();
    let fs = fc.session("fill").await.unwrap();
    let full = fs.lease(64 * MIB).await.unwrap();
    let files_full = b.memfds().len();

    let tc = Client::connect(&b.uri(), t).await.unwrap();
    let ts = tc.session("t").await.unwrap();
    // Without fallback: refused.
    let r = ts.lease(16 * MIB).await;
    assert_eq!(code_of(&r), Some(Code::ResourceExhausted), "{r:?}");
    // With fallback and no wait: host memory at once.
    let h1 = ts
        .lease_request(16 * MIB)
        .fallback_host(true)
        .send()
        .await
        .unwrap();
    assert_eq!(h1.tier(), Tier::Host);
    assert_eq!(h1.bytes(), 16 * MIB);
    // With a wait: host memory once the wait is over.
    let t0 = Instant::now();
    let h2 = ts
        .lease_request(15 * MIB)
        .wait(Duration::from_millis(300))
        .fallback_host(true)
        .send()
        .await
        .unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(h2.tier(), Tier::Host);
    assert!(h2.bytes() >= 15 * MIB);
    // The host leases map and hold data like device leases.
    for (l, byte) in [(&h1, 7u8), (&h2, 9u8)] {
        let mut m = l.map().unwrap();
        let n = m.len();
        m[0] = byte;
        m[n - 1] = byte;
    }
    let infos = ts.list_leases().await.unwrap();
    assert_eq!(infos.len(), 2);
    assert!(infos.iter().all(|i| i.tier == Tier::Host), "{infos:?}");
    let u = tenant(&admin, "t").await.usage;
    assert_eq!(u.host_held_bytes, h1.bytes() + h2.bytes());
    assert_eq!((u.held_bytes, u.lease_count), (0, 0), "{u:?}");
    let dev = &admin.get_devices().await.unwrap()[0];
    assert_eq!(
        dev.leased_bytes,
        64 * MIB,
        "host leases are not device memory"
    );

    // Beyond the host limit (32 MiB): RESOURCE_EXHAUSTED, with and without a wait.
    let r = ts.lease_request(2 * MIB).fallback_host(true).send().await;
    assert_eq!(code_of(&r), Some(Code::ResourceExhausted), "{r:?}");
    let msg = r.unwrap_err().message();
    assert!(msg.contains("host"), "{msg}");
    let r = ts
        .lease_request(2 * MIB)
        .wait(Duration::from_millis(100))
        .fallback_host(true)
        .send()
        .await;
    assert_eq!(code_of(&r), Some(Code::ResourceExhausted), "{r:?}");
    // A tenant without a host limit gets none.
    let nc = Client::connect(&b.uri(), none).await.unwrap();
    let ns = nc.session("none").await.unwrap();
    let r = ns.lease_request(2 * MIB).fallback_host(true).send().await;
    assert_eq!(code_of(&r), Some(Code::ResourceExhausted), "{r:?}");
    // When the device has room, fallback is not used.
    full.release().await.unwrap();
    let d = ts
        .lease_request(8 * MIB)
        .fallback_host(true)
        .send()
        .await
        .unwrap();
    assert_eq!(d.tier(), Tier::Device);

    // Releasing host leases frees them (and their files) at once.
    h1.release().await.unwrap();
    h2.release().await.unwrap();
    d.release().await.unwrap();
    let u = tenant(&admin, "t").await.usage;
    assert_eq!(u.host_held_bytes, 0, "{u:?}");
    let gone = eventually(Duration::from_secs(1), || async {
        b.memfds().len() <= files_full
    })
    .await;
    assert!(gone, "host fallback files left: {:?}", b.memfds());
    ts.close();
    fs.close();
    ns.close();
    assert!(wait_all_zero(&admin, Duration::from_secs(2)).await.is_ok());
    let status = b.stop(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status}");
    assert!(b.memfds().is_empty(), "left: {:?}", b.memfds());
}
