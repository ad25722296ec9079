//! A block that held one tenant's bytes reaches another tenant only zeroed.

use gpu_broker_client::QuotaSpec;
use gpu_broker_client::{LeaseHandle, Session};
use gpu_broker_tests::*;
use std::path::PathBuf;
use std::time::Duration;

fn path_of(l: &gpu_broker_client::Lease) -> PathBuf {
    match l.handle() {
        LeaseHandle::HostShm(p) => p.clone(),
        other => panic!("{other:?}"),
    }
}

async fn lease_filled(s: &Session, bytes: u64, byte: u8) -> (String, PathBuf) {
    let l = s.lease(bytes).await.unwrap();
    l.map().unwrap().fill(byte);
    let path = path_of(&l);
    let id = l.id().to_string();
    l.release().await.unwrap();
    (id, path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_block_is_zeroed_for_another_tenant() {
    let b = Broker::start().unwrap();
    let alice = b.client("alice", GIB).await.unwrap();
    let bob = b.client("bob", GIB).await.unwrap();
    let sa = alice.session("a").await.unwrap();
    let sb = bob.session("b").await.unwrap();

    let (_, path_a) = lease_filled(&sa, 8 * MIB, 0xA5).await;
    let d = &devices(&b).await.unwrap()[0];
    assert_eq!(d.cached_bytes, 8 * MIB);
    assert_eq!(d.leased_bytes, 0);

    let lb = sb.lease(8 * MIB).await.unwrap();
    assert_eq!(path_of(&lb), path_a, "the cached block is reused");
    let d = &devices(&b).await.unwrap()[0];
    assert_eq!(d.cached_bytes, 0, "taken from the cache");
    assert_eq!(b.shm_files().len(), 1);
    {
        let m = lb.map().unwrap();
        assert_eq!(m.len() as u64, 8 * MIB);
        if let Some(i) = m.iter().position(|&x| x != 0) {
            panic!("bob reads alice's byte {:#04x} at {i}", m[i]);
        }
    }
    // Bob's own bytes go back to alice zeroed too.
    lb.map().unwrap().fill(0xB0);
    lb.release().await.unwrap();
    let la = sa.lease(8 * MIB).await.unwrap();
    assert_eq!(path_of(&la), path_a);
    assert!(la.map().unwrap().iter().all(|&x| x == 0));
    la.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_writer_block_is_zeroed_for_another_tenants_process() {
    let b = Broker::start().unwrap();
    let ta = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let tb = b.tenant("bob", QuotaSpec::new(GIB)).await.unwrap();
    let admin = b.admin().await.unwrap();

    let mut a = hold(&b, &ta, &["--bytes", "4MiB", "--pattern", "0x3C"])
        .await
        .unwrap();
    let path_a = a.leases[0].path.clone();
    a.proc.kill().await.unwrap();
    assert!(
        eventually(Duration::from_secs(2), || async {
            admin.get_devices().await.unwrap()[0].cached_bytes == 4 * MIB
        })
        .await
    );

    // Bob's worker checks that every byte of its new lease is zero before writing.
    let mut bw = hold(
        &b,
        &tb,
        &[
            "--bytes",
            "4MiB",
            "--expect-initial",
            "0",
            "--pattern",
            "0x11",
        ],
    )
    .await
    .unwrap();
    assert_eq!(bw.leases[0].path, path_a, "the cached block is reused");
    assert_eq!(admin.get_devices().await.unwrap()[0].cached_bytes, 0);
    bw.proc.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_after_revocation_never_reach_the_next_tenant() {
    let b = Broker::start().unwrap();
    let ta = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let tb = b.tenant("bob", QuotaSpec::new(GIB)).await.unwrap();
    let admin = b.admin().await.unwrap();
    let t = Duration::from_secs(10);

    let mut a = hold(&b, &ta, &["--bytes", "4MiB", "--pattern", "0x3C"])
        .await
        .unwrap();
    let lease = a.leases[0].clone();
    admin.revoke_lease(&lease.id, "test").await.unwrap();
    a.proc
        .line_starting(&format!("EVENT revoked {}", lease.id), t)
        .await
        .unwrap();
    // The revoked holder keeps its mapping and keeps writing.
    a.proc.send("fill 0x99").await.unwrap();
    a.proc.line_starting("FILLED", t).await.unwrap();
    // Meanwhile the block is quarantined: bob gets other memory.
    let mut early = hold(&b, &tb, &["--bytes", "4MiB", "--expect-initial", "0"])
        .await
        .unwrap();
    assert_ne!(early.leases[0].path, lease.path);
    early.proc.kill().await.unwrap();
    assert!(
        eventually(t, || async {
            admin.get_devices().await.unwrap()[0].cached_bytes == 4 * MIB
        })
        .await
    );

    // Alice's process exits: the quarantined block goes to the cache, and reaches bob
    // zeroed.
    a.proc.kill().await.unwrap();
    assert!(
        eventually(t, || async {
            let d = admin.get_devices().await.unwrap().remove(0);
            d.quarantined_bytes == 0 && d.cached_bytes == 8 * MIB
        })
        .await
    );
    let mut w1 = hold(&b, &tb, &["--bytes", "4MiB", "--expect-initial", "0"])
        .await
        .unwrap();
    let mut w2 = hold(&b, &tb, &["--bytes", "4MiB", "--expect-initial", "0"])
        .await
        .unwrap();
    let paths = [w1.leases[0].path.clone(), w2.leases[0].path.clone()];
    assert!(
        paths.contains(&lease.path),
        "{paths:?} reuse {:?}",
        lease.path
    );
    assert_eq!(admin.get_devices().await.unwrap()[0].cached_bytes, 0);
    w1.proc.kill().await.unwrap();
    w2.proc.kill().await.unwrap();
}
