//! Memory that held one tenant's bytes never reaches another tenant while a process may
//! still map it: another tenant gets a fresh memory object (zero), and a mapping kept by
//! the former holder (after release, after a revocation, in a helper or forked process
//! that outlived the holder) never sees the new tenant's bytes: it keeps the old pages
//! while the broker counts them, and holds none once the broker freed (and so revoked)
//! the old object. A tenant's own released blocks are reused (pooled) as before.

use gpu_broker_client::{HostMapping, LeaseHandle, QuotaSpec, Session};
use gpu_broker_tests::*;
use std::os::fd::AsFd;
use std::time::Duration;

fn block_of(l: &gpu_broker_client::Lease) -> String {
    match l.handle() {
        LeaseHandle::Fd(i) => format!("fd:{}", i.block_id),
        other => panic!("{other:?}"),
    }
}

/// A mapping of a lease made from a descriptor of its own: it outlives the lease, as a
/// worker's mapping does when it releases without unmapping.
async fn kept_mapping(l: &gpu_broker_client::Lease) -> HostMapping<'static> {
    let fd = l.fetch_fd().await.unwrap();
    HostMapping::from_fd(fd.as_fd(), 0, l.bytes()).unwrap()
}

/// Pages of `m` in memory (`mincore`), read without touching the mapping.
fn resident_pages(m: &HostMapping<'_>) -> usize {
    let page = 4096;
    let mut vec = vec![0u8; m.len().div_ceil(page)];
    // SAFETY: mincore over a live mapping into a vector of one byte per page.
    let rc = unsafe { libc::mincore(m.as_ptr() as *mut _, m.len(), vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    vec.iter().filter(|&&v| v & 1 == 1).count()
}

async fn lease_filled(s: &Session, bytes: u64, byte: u8) -> String {
    let l = s.lease(bytes).await.unwrap();
    l.map().unwrap().fill(byte);
    let block = block_of(&l);
    l.release().await.unwrap();
    block
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_but_still_mapped_lease_never_shows_the_next_tenants_bytes() {
    let b = Broker::start().unwrap();
    let alice = b.client("alice", GIB).await.unwrap();
    let bob = b.client("bob", GIB).await.unwrap();
    let sa = alice.session("a").await.unwrap();
    let sb = bob.session("b").await.unwrap();

    let la = sa.lease(8 * MIB).await.unwrap();
    let block_a = block_of(&la);
    let mut kept = kept_mapping(&la).await;
    kept.fill(0xA5);
    assert_eq!(resident_pages(&kept), (8 * MIB / 4096) as usize);
    la.release().await.unwrap();
    let d = &devices(&b).await.unwrap()[0];
    assert_eq!((d.cached_bytes, d.leased_bytes), (8 * MIB, 0));

    let lb = sb.lease(8 * MIB).await.unwrap();
    assert_ne!(block_of(&lb), block_a, "another tenant gets a fresh object");
    let d = &devices(&b).await.unwrap()[0];
    assert_eq!(d.cached_bytes, 0, "alice's block was freed, not handed on");
    assert_eq!(b.memfds().len(), 1, "{:?}", b.memfds());
    {
        let mut m = lb.map().unwrap();
        if let Some(i) = m.iter().position(|&x| x != 0) {
            panic!("bob reads byte {:#04x} at {i}", m[i]);
        }
        m.fill(0xB0);
    }
    // Alice's block was freed for bob, and its memfd truncated: her kept mapping holds
    // no page (a touch would fault), so it neither sees bob's bytes nor keeps memory the
    // books no longer count.
    assert!(
        eventually(Duration::from_secs(5), || async {
            resident_pages(&kept) == 0
        })
        .await,
        "alice's kept mapping still holds {} pages",
        resident_pages(&kept)
    );
    // Same-tenant reuse stays pooled: bob's block comes back to bob (no new object).
    let block_b = block_of(&lb);
    lb.release().await.unwrap();
    let lb2 = sb.lease(8 * MIB).await.unwrap();
    assert_eq!(block_of(&lb2), block_b, "own block reused");
    assert!(lb2.map().unwrap().iter().all(|&x| x == 0xB0));
    lb2.release().await.unwrap();
    // And bob's bytes never go back to alice.
    let la2 = sa.lease(8 * MIB).await.unwrap();
    assert_ne!(block_of(&la2), block_b);
    assert!(la2.map().unwrap().iter().all(|&x| x == 0));
    la2.release().await.unwrap();
    // Same-tenant reuse of a block with a pattern written before release.
    assert_eq!(
        lease_filled(&sa, 8 * MIB, 1).await,
        lease_filled(&sa, 8 * MIB, 2).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapping_that_outlives_its_killed_holder_never_shows_the_next_tenants_bytes() {
    let b = Broker::start().unwrap();
    let ta = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let tb = b.tenant("bob", QuotaSpec::new(GIB)).await.unwrap();
    let admin = b.admin().await.unwrap();

    let mut a = hold(&b, &ta, &["--bytes", "4MiB", "--pattern", "0x3C"])
        .await
        .unwrap();
    let held = a.leases[0].clone();
    // Another process of alice's (this one, as a forked child or helper would) maps the
    // lease with a descriptor of its own, then the holder dies.
    let alice = gpu_broker_client::Client::connect(&b.uri(), ta.clone())
        .await
        .unwrap();
    let (_, fd) = alice.lease_fd(&held.id).await.unwrap();
    let keeper = HostMapping::from_fd(fd.as_fd(), 0, held.bytes).unwrap();
    drop(fd);
    assert!(keeper.iter().all(|&x| x == 0x3C));
    a.proc.kill().await.unwrap();
    // This process still maps it: the block stays counted (quarantined), not cached.
    assert!(
        eventually(Duration::from_secs(2), || async {
            let d = &admin.get_devices().await.unwrap()[0];
            d.quarantined_bytes == 4 * MIB && d.cached_bytes == 0
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
    assert_ne!(bw.leases[0].block, held.block, "a fresh object for bob");
    assert_eq!(admin.get_devices().await.unwrap()[0].cached_bytes, 0);
    assert_eq!(
        admin.get_devices().await.unwrap()[0].quarantined_bytes,
        4 * MIB
    );
    assert!(
        keeper.iter().all(|&x| x == 0x3C),
        "the surviving mapping sees bob's bytes"
    );
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
    assert_ne!(early.leases[0].block, lease.block);
    early.proc.kill().await.unwrap();
    assert!(
        eventually(t, || async {
            admin.get_devices().await.unwrap()[0].cached_bytes == 4 * MIB
        })
        .await
    );

    // Alice's process exits: the quarantined block goes to the cache, but never to bob.
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
    let blocks = [w1.leases[0].block.clone(), w2.leases[0].block.clone()];
    assert!(
        !blocks.contains(&lease.block),
        "{blocks:?} reuse alice's block"
    );
    w1.proc.kill().await.unwrap();
    w2.proc.kill().await.unwrap();
}
