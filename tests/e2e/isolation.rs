//! Tenants cannot see or touch each other's leases.

use gpu_broker_client::Code;
use gpu_broker_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_lease_is_invisible_and_untouchable() {
    let b = Broker::start().unwrap();
    let alice = b.client("alice", GIB).await.unwrap();
    let bob = b.client("bob", GIB).await.unwrap();
    let sa = alice.session("a").await.unwrap();
    let sb = bob.session("b").await.unwrap();
    let la1 = sa.lease(4 * MIB).await.unwrap();
    let la2 = sa.lease(2 * MIB).await.unwrap();
    let lb = sb.lease(6 * MIB).await.unwrap();
    la1.map().unwrap().fill(0xA1);

    // ListLeases shows only the caller's own.
    let mine: Vec<String> = alice
        .list_leases()
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.lease_id)
        .collect();
    assert_eq!(mine.len(), 2);
    assert!(mine.contains(&la1.id().to_string()) && mine.contains(&la2.id().to_string()));
    let bobs = bob.list_leases().await.unwrap();
    assert_eq!(bobs.len(), 1);
    assert_eq!(bobs[0].lease_id, lb.id());
    assert!(bobs.iter().all(|l| l.tenant == "bob"));
    // GetUsage is per tenant too.
    assert_eq!(bob.usage().await.unwrap().usage.held_bytes, 6 * MIB);
    assert_eq!(alice.usage().await.unwrap().usage.held_bytes, 6 * MIB);

    // Bob cannot release alice's lease; it is NOT_FOUND and survives.
    for id in [la1.id(), la2.id()] {
        let e = bob.release_lease(id).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{e}");
    }
    let mine_after = alice.list_leases().await.unwrap();
    assert_eq!(mine_after.len(), 2);
    assert_eq!(alice.usage().await.unwrap().usage.held_bytes, 6 * MIB);
    let all = b
        .admin()
        .await
        .unwrap()
        .list_all_leases(None)
        .await
        .unwrap();
    assert_eq!(all.len(), 3);
    // Its memory is intact and still mapped by alice.
    assert!(la1.map().unwrap().iter().all(|&x| x == 0xA1));
    // There is no path to it: nothing in the shm directory, and bob cannot get a ticket
    // for it (NOT_FOUND, as for any lease that is not his).
    assert!(b.shm_dir_files().is_empty(), "{:?}", b.shm_dir_files());
    let e = bob.lease_fd(la1.id()).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");

    // Alice can still release her own leases.
    la1.release().await.unwrap();
    la2.release().await.unwrap();
    assert!(alice.list_leases().await.unwrap().is_empty());
    assert_eq!(bob.list_leases().await.unwrap().len(), 1);
    lb.release().await.unwrap();
}
