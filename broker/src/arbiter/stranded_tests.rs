//! Memory a process kept after the broker freed it (CUDA VMM memory, which no free can
//! revoke; here a device that keeps freed memory on command): charged to its tenant until
//! that process exits, then let go.

use super::tests::{live_process, quota, req};
use super::*;
use crate::device::faulty::{FaultSwitch, Faults, FaultyDevice};

const MIB: u64 = 1 << 20;

/// An arbiter over one 64 MiB device whose freed memory stays on it while `switch` says
/// `keep_freed`, with tenants `a` and `b` of 64 MiB each.
fn keeping_arbiter(switch: &FaultSwitch) -> Arc<Arbiter> {
    let sw = switch.clone();
    let thread = DeviceThread::spawn("keeping".into(), move || {
        let inner = Box::new(crate::device::host::HostDevice::new(0, 64 * MIB)?);
        Ok(Box::new(FaultyDevice::new(inner, sw)) as Box<dyn crate::device::Device>)
    })
    .unwrap();
    let slot = DeviceSlot {
        thread,
        initial_leasable: 64 * MIB,
        external_at_start: 0,
        headroom: 0,
        taken_back: Default::default(),
    };
    let arb = Arbiter::new(
        vec![slot],
        None,
        None,
        Arc::new(Authenticator::new("x")),
        ArbiterConfig::default(),
    )
    .unwrap();
    arb.set_quota("a", quota(64 * MIB)).unwrap();
    arb.set_quota("b", quota(64 * MIB)).unwrap();
    arb
}

/// Tenant `a`'s quarantined bytes (what `GetUsage` shows it holds beyond its leases).
fn held_by_a(arb: &Arbiter) -> u64 {
    arb.get_tenant("a").unwrap().usage.quarantined_bytes
}

/// Waits (up to 5 s) for `done`.
async fn until(mut done: impl FnMut() -> bool) -> bool {
    for _ in 0..500 {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    done()
}

/// `a`'s worker (alive) acquires 32 MiB and releases it, keeping its import; `b` then
/// needs 48 MiB, which evicts `a`'s cached block. Returns the worker.
async fn release_then_evict(arb: &Arc<Arbiter>) -> std::process::Child {
    let (child, peer) = live_process();
    let (sa, _rxa) = arb.open_session("a", "keeper", peer).unwrap();
    let l = arb.acquire(req("a", sa, 32 * MIB)).await.unwrap();
    arb.release("a", l.id).unwrap();
    assert_eq!(arb.lock().pools()[0].stats().cached, 32 * MIB);
    let (sb, _rxb) = arb.open_session("b", "other", Peer::default()).unwrap();
    arb.acquire(req("b", sb, 48 * MIB)).await.unwrap();
    std::mem::forget((_rxa, _rxb));
    child
}

/// The quota escape: a worker keeps its import of a released block, the block is evicted
/// for another tenant, and the memory stays on the device. Its tenant keeps being charged
/// for it until the worker exits; then the charge goes.
#[tokio::test]
async fn memory_kept_after_its_free_stays_charged_to_its_tenant_until_the_holder_exits() {
    let switch = FaultSwitch::default();
    let arb = keeping_arbiter(&switch);
    switch.set(Faults {
        keep_freed: true,
        ..Faults::default()
    });
    let mut worker = release_then_evict(&arb).await;
    assert!(
        until(|| held_by_a(&arb) == 32 * MIB).await,
        "the kept 32 MiB are charged to a, held {}",
        held_by_a(&arb)
    );
    {
        let st = arb.lock();
        st.check_invariant().unwrap();
        // The device's books count it (so the outside-memory estimate does not), once:
        // no longer as bytes whose charge is on its way.
        assert_eq!(st.pools()[0].stats().quarantined, 32 * MIB);
        assert_eq!(arb.unverified_bytes(0), 0);
        assert_eq!(st.pools()[0].stats().leased, 48 * MIB);
    }
    // Operators see why (`ListQuarantined`, `gpu-brokerctl leaks`).
    let listed = arb.list_quarantined();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].reason, crate::views::HoldReason::KeptAfterFree);
    assert_eq!(
        (listed[0].tenant.as_str(), listed[0].bytes),
        ("a", 32 * MIB)
    );
    assert_eq!(listed[0].holders, vec![worker.id()]);
    // Counted against a's quota: 32 MiB more does not fit in its 64 MiB.
    let (sa2, _rx) = arb.open_session("a", "again", Peer::default()).unwrap();
    let err = arb
        .acquire(req("a", sa2, 48 * MIB))
        .await
        .expect_err("a is charged for what it kept");
    assert!(
        matches!(err, BrokerError::QuotaExceeded { held, .. } if held == 32 * MIB),
        "{err}"
    );
    worker.kill().unwrap();
    worker.wait().unwrap();
    assert!(
        until(|| held_by_a(&arb) == 0).await,
        "let go once the holder exited, held {}",
        held_by_a(&arb)
    );
    let st = arb.lock();
    st.check_invariant().unwrap();
    assert_eq!(st.pools()[0].stats().quarantined, 0);
    assert_eq!(st.stranded_memory().count(), 0);
    drop(st);
    assert!(arb.list_quarantined().is_empty());
}

/// A free that gives the memory back (the worker unmapped) charges nobody.
#[tokio::test]
async fn memory_that_came_back_is_not_charged() {
    let switch = FaultSwitch::default();
    let arb = keeping_arbiter(&switch);
    let mut worker = release_then_evict(&arb).await;
    // The free was queued before b's allocation: a call after it sees it done.
    arb.devices[0].thread.call(|_| ()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(held_by_a(&arb), 0);
    assert_eq!(arb.lock().stranded_memory().count(), 0);
    worker.kill().unwrap();
    worker.wait().unwrap();
}

/// Memory whose holders are all gone is not looked at: nothing to charge.
#[tokio::test]
async fn a_free_whose_holders_are_gone_charges_nobody() {
    let switch = FaultSwitch::default();
    let arb = keeping_arbiter(&switch);
    let (mut child, peer) = live_process();
    let (sa, _rxa) = arb.open_session("a", "w", peer).unwrap();
    let l = arb.acquire(req("a", sa, 32 * MIB)).await.unwrap();
    arb.release("a", l.id).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    switch.set(Faults {
        keep_freed: true,
        ..Faults::default()
    });
    let (sb, _rxb) = arb.open_session("b", "other", Peer::default()).unwrap();
    arb.acquire(req("b", sb, 48 * MIB)).await.unwrap();
    arb.devices[0].thread.call(|_| ()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(held_by_a(&arb), 0);
}

/// An importer of its own tenant's publication releases its import and keeps it; the
/// publisher releases the lease, whose block is freed: the memory stays, charged to the
/// tenant until the importer exits.
#[tokio::test]
async fn an_import_kept_after_its_release_stays_charged_after_the_free() {
    let switch = FaultSwitch::default();
    let arb = keeping_arbiter(&switch);
    let (sp, _rxp) = arb.open_session("a", "publisher", Peer::default()).unwrap();
    let l = arb.acquire(req("a", sp, 16 * MIB)).await.unwrap();
    arb.publish("a", l.id, "w", &[]).unwrap();
    let (mut importer, peer) = live_process();
    let (si, _rxi) = arb.open_session("a", "importer", peer).unwrap();
    let import = arb.import("a", si, "a", "w").unwrap();
    arb.release_import("a", import.id).unwrap();
    drop(import);
    switch.set(Faults {
        keep_freed: true,
        ..Faults::default()
    });
    arb.release("a", l.id).unwrap();
    assert!(
        until(|| held_by_a(&arb) == 16 * MIB).await,
        "the kept import is charged to a, held {}",
        held_by_a(&arb)
    );
    arb.lock().check_invariant().unwrap();
    importer.kill().unwrap();
    importer.wait().unwrap();
    assert!(
        until(|| held_by_a(&arb) == 0).await,
        "let go once the importer exited, held {}",
        held_by_a(&arb)
    );
    std::mem::forget((_rxp, _rxi));
}
