//! Memory a process kept after the broker freed it (CUDA VMM memory, which no free can
//! revoke; here a device that keeps freed memory on command): charged to its tenant until
//! that process exits, then let go; with a finder (`kept_holders.rs`, its lister given
//! here), until the processes near it that it may have handed the memory to exit too.

use super::tests::{live_process, quota, req};
use super::*;
use crate::device::faulty::{FaultSwitch, Faults, FaultyDevice};
use crate::error::BrokerError;

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
    arb.views().tenant("a").unwrap().usage.quarantined_bytes
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
        assert_eq!(arb.unverified.of(0), 0);
        assert_eq!(st.pools()[0].stats().leased, 48 * MIB);
    }
    // Operators see why (`ListQuarantined`, `gpu-brokerctl leaks`).
    let listed = arb.views().quarantined();
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
    assert!(arb.views().quarantined().is_empty());
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
    arb.sharing().publish("a", l.id, "w", &[]).unwrap();
    let (mut importer, peer) = live_process();
    let (si, _rxi) = arb.open_session("a", "importer", peer).unwrap();
    let import = arb.sharing().import("a", si, "a", "w").unwrap();
    arb.sharing().release_import("a", import.id).unwrap();
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

/// Tenant `t`'s quarantined bytes.
fn held_by(arb: &Arbiter, t: &str) -> u64 {
    arb.views().tenant(t).unwrap().usage.quarantined_bytes
}

/// Another tenant's importer releases its import and keeps it; the publisher, none of
/// whose processes is alive to have kept it, releases the lease and the block is freed:
/// the memory stays, charged to the importer's tenant (it kept what it was lent) until
/// the importer exits. It used to be counted nowhere.
#[tokio::test]
async fn another_tenants_import_kept_after_its_release_is_charged_to_that_tenant() {
    let switch = FaultSwitch::default();
    let arb = keeping_arbiter(&switch);
    let (sp, _rxp) = arb.open_session("a", "publisher", Peer::default()).unwrap();
    let l = arb.acquire(req("a", sp, 16 * MIB)).await.unwrap();
    arb.sharing()
        .publish("a", l.id, "w", &["b".to_string()])
        .unwrap();
    let (mut importer, peer) = live_process();
    let (si, _rxi) = arb.open_session("b", "importer", peer).unwrap();
    let import = arb.sharing().import("b", si, "a", "w").unwrap();
    arb.sharing().release_import("b", import.id).unwrap();
    drop(import);
    switch.set(Faults {
        keep_freed: true,
        ..Faults::default()
    });
    arb.release("a", l.id).unwrap();
    assert!(
        until(|| held_by(&arb, "b") == 16 * MIB).await,
        "the kept import is charged to b, held {}",
        held_by(&arb, "b")
    );
    assert_eq!(held_by_a(&arb), 0, "the publisher kept nothing");
    let listed = arb.views().quarantined();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        (listed[0].tenant.as_str(), listed[0].holders.clone()),
        ("b", vec![importer.id()])
    );
    arb.lock().check_invariant().unwrap();
    importer.kill().unwrap();
    importer.wait().unwrap();
    assert!(
        until(|| held_by(&arb, "b") == 0).await,
        "let go once the importer exited, held {}",
        held_by(&arb, "b")
    );
    std::mem::forget((_rxp, _rxi));
}

/// The same with a live process of the publisher's that released the lease: it could
/// have kept the memory as well (the driver cannot say who did), and the publisher, who
/// chose its readers, answers for it.
#[tokio::test]
async fn memory_kept_while_the_publishers_process_lives_is_the_publishers() {
    let switch = FaultSwitch::default();
    let arb = keeping_arbiter(&switch);
    let (mut publisher, ppeer) = live_process();
    let (sp, _rxp) = arb.open_session("a", "publisher", ppeer).unwrap();
    let l = arb.acquire(req("a", sp, 16 * MIB)).await.unwrap();
    arb.sharing()
        .publish("a", l.id, "w", &["b".to_string()])
        .unwrap();
    let (mut importer, peer) = live_process();
    let (si, _rxi) = arb.open_session("b", "importer", peer).unwrap();
    let import = arb.sharing().import("b", si, "a", "w").unwrap();
    arb.sharing().release_import("b", import.id).unwrap();
    drop(import);
    switch.set(Faults {
        keep_freed: true,
        ..Faults::default()
    });
    arb.release("a", l.id).unwrap();
    assert!(
        until(|| held_by_a(&arb) == 16 * MIB).await,
        "charged to the publisher, held {}",
        held_by_a(&arb)
    );
    assert_eq!(held_by(&arb, "b"), 0);
    for p in [&mut publisher, &mut importer] {
        p.kill().unwrap();
        p.wait().unwrap();
    }
    assert!(until(|| held_by_a(&arb) == 0).await);
    std::mem::forget((_rxp, _rxi));
}

/// Host backend: this process maps a 32 MiB lease of `peer`'s session (this process's
/// own when `None`: then the session's process is this one), seals its memfd against
/// shrinking (so no free can truncate it: the broker's revocation), keeps the mapping or
/// not as `keep` says, and releases; the session's process then exits when it is
/// another (`peer`); tenant `b` then needs 48 MiB, which frees the cached block. Returns
/// the arbiter, a's quarantined bytes once the free is done, and the mapping (unmapped
/// by the caller). Kept memfds are looked at again every 20 ms.
async fn sealed_then_evicted_with(
    keep: bool,
    peer: Option<(std::process::Child, Peer)>,
) -> (Arc<Arbiter>, u64, Option<(usize, usize)>) {
    sealed_then_evicted_looking(keep, peer, Duration::from_millis(20), true).await
}

/// [`sealed_then_evicted_with`], kept memfds looked at again every `look`, waiting for
/// the charge of a kept mapping when `wait` says so.
async fn sealed_then_evicted_looking(
    keep: bool,
    peer: Option<(std::process::Child, Peer)>,
    look: Duration,
    wait: bool,
) -> (Arc<Arbiter>, u64, Option<(usize, usize)>) {
    let arb = host_arbiter(
        64 * MIB,
        1,
        ArbiterConfig {
            kept_memory_look: look,
            ..ArbiterConfig::default()
        },
    );
    arb.set_quota("a", quota(64 * MIB)).unwrap();
    arb.set_quota("b", quota(64 * MIB)).unwrap();
    let me = Peer {
        pid: Some(std::process::id()),
        // SAFETY: getuid cannot fail.
        uid: Some(unsafe { libc::getuid() }),
        unix: true,
    };
    let (mut other, peer) = match peer {
        Some((child, peer)) => (Some(child), peer),
        None => (None, me),
    };
    let (sa, rxa) = arb.open_session("a", "sealer", peer).unwrap();
    let l = arb.acquire(req("a", sa, 32 * MIB)).await.unwrap();
    let crate::device::Handle::Fd { fd, .. } = &l.handle;
    let len = (32 * MIB) as usize;
    // SAFETY: a shared mapping of the lease's memfd, written once; the caller unmaps it.
    let at = unsafe {
        let at = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.raw(),
            0,
        );
        assert_ne!(at, libc::MAP_FAILED);
        at.cast::<u8>().write(7);
        assert_eq!(
            libc::fcntl(fd.raw(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK),
            0
        );
        at
    };
    let mapping = if keep {
        Some((at as usize, len))
    } else {
        // SAFETY: unmapping what was mapped above.
        unsafe { libc::munmap(at, len) };
        None
    };
    arb.release("a", l.id).unwrap();
    drop(l);
    if let Some(child) = &mut other {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let (sb, rxb) = arb.open_session("b", "other", Peer::default()).unwrap();
    arb.acquire(req("b", sb, 48 * MIB)).await.unwrap();
    // The free was queued before b's allocation: a call after it sees it done.
    arb.devices[0].thread.call(|_| ()).await.unwrap();
    let held = if keep && wait {
        until(|| held_by_a(&arb) > 0).await;
        held_by_a(&arb)
    } else {
        tokio::time::sleep(Duration::from_millis(50)).await;
        held_by_a(&arb)
    };
    std::mem::forget((rxa, rxb));
    (arb, held, mapping)
}

/// [`sealed_then_evicted_with`] by the session's own process (this one).
async fn sealed_then_evicted(keep: bool) -> (Arc<Arbiter>, u64, Option<(usize, usize)>) {
    sealed_then_evicted_with(keep, None).await
}

/// Unmaps a mapping `sealed_then_evicted` returned.
fn unmap((at, len): (usize, usize)) {
    // SAFETY: a mapping made by `sealed_then_evicted_with`, unmapped once.
    unsafe { libc::munmap(at as *mut libc::c_void, len) };
}

/// A memfd its holder sealed against shrinking cannot be revoked at its free; the holder
/// that kept it mapped shows so in `/proc/PID/maps`: the memory is charged to its tenant
/// (`HOLD_REASON_KEPT_AFTER_FREE`, this process named) until that process exits. It used
/// to stay with the holder outside the books.
#[tokio::test]
async fn a_sealed_memfd_kept_mapped_after_its_free_stays_charged() {
    let (arb, held, mapping) = sealed_then_evicted(true).await;
    assert_eq!(held, 32 * MIB, "the kept mapping is charged to a");
    let listed = arb.views().quarantined();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].reason, crate::views::HoldReason::KeptAfterFree);
    assert_eq!(listed[0].holders, vec![std::process::id()]);
    arb.lock().check_invariant().unwrap();
    assert!(
        arb.lock()
            .stranded_memory()
            .all(|(_, s)| s.file_handle.is_some()),
        "its record keeps the memfd's file handle (a restarted broker asks by it)"
    );
    let (at, len) = mapping.unwrap();
    // SAFETY: the mapping made by `sealed_then_evicted`: its pages are still there.
    unsafe {
        assert_eq!(
            *(at as *const u8),
            7,
            "not revoked: the holder still reads it"
        );
    }
    unmap((at, len));
}

/// The same memfd let go of (unmapped, no descriptor) before its free: nobody is charged.
#[tokio::test]
async fn a_sealed_memfd_let_go_before_its_free_is_not_charged() {
    let (arb, held, _) = sealed_then_evicted(false).await;
    assert_eq!(held, 0);
    assert_eq!(arb.lock().stranded_memory().count(), 0);
}

/// A holder that lets go of a sealed memfd after its free (unmaps, no descriptor left)
/// while it lives on: the broker looks again and lifts the charge within its look period.
/// One that keeps it stays charged across many looks. The charge used to last until the
/// holder exited.
#[tokio::test]
async fn a_sealed_memfd_let_go_after_its_free_is_no_longer_charged() {
    let (arb, held, mapping) = sealed_then_evicted(true).await;
    assert_eq!(held, 32 * MIB);
    // Ten looks' worth (20 ms each, doubling): still kept, still charged.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(held_by_a(&arb), 32 * MIB, "kept: still charged");
    unmap(mapping.unwrap());
    assert!(
        until(|| held_by_a(&arb) == 0).await,
        "let go of: the charge is lifted while its holder lives, held {}",
        held_by_a(&arb)
    );
    let st = arb.lock();
    st.check_invariant().unwrap();
    assert_eq!(st.stranded_memory().count(), 0);
    assert_eq!(st.pools()[0].stats().quarantined, 0);
}

/// The session's process released a sealed memfd and exited; a process the broker never
/// recorded (here this one: a child that read the descriptor off its parent's
/// connection is another) keeps it mapped. The kernel says the file still lives: the
/// memory stays charged to the block's tenant, naming nobody, until it is let go. It used
/// to be charged to nobody (only recorded processes were looked at, and none lived).
#[tokio::test]
async fn a_sealed_memfd_kept_by_a_process_the_broker_never_saw_stays_charged() {
    let (arb, held, mapping) = sealed_then_evicted_with(true, Some(live_process())).await;
    if held == 0 && unsafe { libc::geteuid() } != 0 {
        // Without CAP_DAC_READ_SEARCH the kernel cannot be asked: documented as not found.
        unmap(mapping.unwrap());
        return;
    }
    assert_eq!(
        held,
        32 * MIB,
        "kept by an unrecorded process: charged to a"
    );
    let listed = arb.views().quarantined();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].reason, crate::views::HoldReason::KeptAfterFree);
    assert!(listed[0].holders.is_empty(), "{listed:?}");
    arb.lock().check_invariant().unwrap();
    assert!(
        arb.lock()
            .stranded_memory()
            .all(|(_, s)| s.file_handle.is_some()),
        "its record keeps the file handle: a restarted broker asks the kernel by it"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(held_by_a(&arb), 32 * MIB, "still kept, still charged");
    unmap(mapping.unwrap());
    assert!(
        until(|| held_by_a(&arb) == 0).await,
        "lifted once let go, held {}",
        held_by_a(&arb)
    );
    arb.lock().check_invariant().unwrap();
}

/// A sealed memfd that nobody the broker recorded holds, but whose file still lives at
/// its free (here this process's mapping, let go of at once: like a copy of its own the
/// broker is still closing, a keeper's or an undelivered ticket's), is not charged at the
/// free: it stays the broker's, unverified, until the first look, which finds it gone and
/// charges nobody. Charged at the free, the tenant would have been refused for bytes
/// nobody kept until that look.
#[tokio::test]
async fn a_memfd_let_go_before_the_first_look_charges_nobody() {
    let (arb, held, mapping) = sealed_then_evicted_looking(
        true,
        Some(live_process()),
        Duration::from_millis(300),
        false,
    )
    .await;
    assert_eq!(held, 0, "not charged at the free");
    assert!(arb.unverified.of(0) > 0 || unsafe { libc::geteuid() } != 0);
    unmap(mapping.unwrap());
    for _ in 0..60 {
        assert_eq!(held_by_a(&arb), 0, "never charged");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        until(|| arb.unverified.of(0) == 0).await,
        "the look let it go"
    );
    assert_eq!(held_by_a(&arb), 0);
    assert_eq!(arb.lock().stranded_memory().count(), 0);
    arb.lock().check_invariant().unwrap();
}

/// Lists the processes a test says have a context on the device (NVML's place).
#[derive(Default)]
struct OnDevice(parking_lot::Mutex<Vec<u32>>);

impl crate::kept_holders::ContextLister for OnDevice {
    fn processes_on(&self, _uuid: &str) -> Option<Vec<u32>> {
        Some(self.0.lock().clone())
    }
}

/// [`keeping_arbiter`] whose free checks look for holders the broker never recorded
/// among the processes `on_device` lists, nothing excluded (in a test every process
/// shares the broker's cgroup, namespace and uid, which a real broker excludes).
fn keeping_arbiter_finding(switch: &FaultSwitch, on_device: &Arc<OnDevice>) -> Arc<Arbiter> {
    let arb = keeping_arbiter(switch);
    assert!(arb
        .stranded()
        .find_holders_with(crate::kept_holders::HolderFinder::with_own(
            on_device.clone(),
            crate::kept_holders::Place::nowhere(),
        )));
    arb
}

/// A worker (`sh`) with a child (`sleep`) it could hand its descriptor to; returns the
/// worker, the child's pid and the worker as a session's peer.
fn worker_with_child() -> (std::process::Child, u32, Peer) {
    let (sh, child) = crate::kept_holders::tests::sh_with_child();
    let peer = Peer {
        pid: Some(sh.id()),
        uid: None,
        unix: true,
    };
    (sh, child, peer)
}

fn kill_pid(pid: u32) {
    // SAFETY: a process this test started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
}

/// Tenant `a`'s worker, which handed its lease's descriptor to a child the broker never
/// saw (listed on the device by `on_device`), releases it; tenant `b` then evicts the
/// cached block, whose memory stays on the device (the child maps it).
/// `worker_exits_first`: the worker exits before the free. Returns both pids.
async fn handed_to_a_child(
    arb: &Arc<Arbiter>,
    on_device: &OnDevice,
    worker_exits_first: bool,
) -> (u32, u32) {
    let (mut worker, child, peer) = worker_with_child();
    on_device.0.lock().push(child);
    let (sa, rxa) = arb.open_session("a", "parent", peer).unwrap();
    let l = arb.acquire(req("a", sa, 32 * MIB)).await.unwrap();
    arb.release("a", l.id).unwrap();
    let parent = worker.id();
    if worker_exits_first {
        worker.kill().unwrap();
        worker.wait().unwrap();
    }
    let (sb, rxb) = arb.open_session("b", "other", Peer::default()).unwrap();
    arb.acquire(req("b", sb, 48 * MIB)).await.unwrap();
    std::mem::forget((rxa, rxb, worker));
    (parent, child)
}

/// The worker lives at the free and exits after it, while its child (which NVML lists
/// on the device) still maps the memory: the charge stays with `a` until the child exits
/// too. It used to go with the worker, leaving the child's memory outside the books.
#[tokio::test]
async fn memory_handed_to_a_child_stays_charged_after_the_recorded_holder_exits() {
    let switch = FaultSwitch::default();
    let on_device = Arc::new(OnDevice::default());
    let arb = keeping_arbiter_finding(&switch, &on_device);
    switch.set(Faults {
        keep_freed: true,
        ..Faults::default()
    });
    let (parent, child) = handed_to_a_child(&arb, &on_device, false).await;
    assert!(
        until(|| held_by_a(&arb) == 32 * MIB).await,
        "the kept 32 MiB are charged to a, held {}",
        held_by_a(&arb)
    );
    kill_pid(parent);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        held_by_a(&arb),
        32 * MIB,
        "the child still maps it: charged to a after the worker exited"
    );
    let listed = arb.views().quarantined();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].holders, vec![child], "the child is named");
    kill_pid(child);
    assert!(
        until(|| held_by_a(&arb) == 0).await,
        "let go once the child exited too, held {}",
        held_by_a(&arb)
    );
    let st = arb.lock();
    st.check_invariant().unwrap();
    assert_eq!(st.stranded_memory().count(), 0);
    drop(st);
    assert_eq!(arb.stranded().holders().unwrap().watching(), 0);
}

/// The worker exited before its block was freed (its place was remembered when its
/// session opened): the free is still checked, the child near it found and charged to
/// `a`; a process the child handed it on to (near it too, listed after the free) keeps
/// the charge when the child exits, until it exits as well. Such memory used to be
/// outside the books from the start.
#[tokio::test]
async fn memory_handed_on_after_its_worker_exited_stays_charged_until_the_last_near_process_exits()
{
    let switch = FaultSwitch::default();
    let on_device = Arc::new(OnDevice::default());
    let arb = keeping_arbiter_finding(&switch, &on_device);
    switch.set(Faults {
        keep_freed: true,
        ..Faults::default()
    });
    let (_parent, child) = handed_to_a_child(&arb, &on_device, true).await;
    assert!(
        until(|| held_by_a(&arb) == 32 * MIB).await,
        "the child's 32 MiB are charged to a, held {}",
        held_by_a(&arb)
    );
    assert_eq!(arb.views().quarantined()[0].holders, vec![child]);
    // The child hands it on to another process, which maps it.
    let (mut next, _) = live_process();
    on_device.0.lock().push(next.id());
    kill_pid(child);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(held_by_a(&arb), 32 * MIB, "the next process may keep it");
    assert_eq!(arb.views().quarantined()[0].holders, vec![next.id()]);
    next.kill().unwrap();
    next.wait().unwrap();
    assert!(
        until(|| held_by_a(&arb) == 0).await,
        "let go once nobody near is left, held {}",
        held_by_a(&arb)
    );
    arb.lock().check_invariant().unwrap();
    assert_eq!(arb.stranded().holders().unwrap().watching(), 0);
}

/// Processes that share only the broker's own places (its cgroup, namespace, uid) and
/// descend from no live holder are not taken for a holder's: a real broker's finder
/// names none of them, and memory only they keep stays outside the books.
#[tokio::test]
async fn processes_sharing_only_the_brokers_places_are_not_charged() {
    let switch = FaultSwitch::default();
    let on_device = Arc::new(OnDevice::default());
    let arb = keeping_arbiter(&switch);
    assert!(arb
        .stranded()
        .find_holders_with(crate::kept_holders::HolderFinder::new(on_device.clone())));
    switch.set(Faults {
        keep_freed: true,
        ..Faults::default()
    });
    let (_parent, child) = handed_to_a_child(&arb, &on_device, true).await;
    arb.devices[0].thread.call(|_| ()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(held_by_a(&arb), 0);
    assert_eq!(arb.unverified.of(0), 0);
    kill_pid(child);
}

/// Another tenant's importer handed its import to a child and exited before the
/// publisher's lease was freed: the child found near it is charged to the importer's
/// tenant (the one that kept what it was lent), not to the publisher's.
#[tokio::test]
async fn a_child_of_another_tenants_importer_is_charged_to_that_tenant() {
    let switch = FaultSwitch::default();
    let on_device = Arc::new(OnDevice::default());
    let arb = keeping_arbiter_finding(&switch, &on_device);
    let (sp, _rxp) = arb.open_session("a", "publisher", Peer::default()).unwrap();
    let l = arb.acquire(req("a", sp, 16 * MIB)).await.unwrap();
    arb.sharing()
        .publish("a", l.id, "w", &["b".to_string()])
        .unwrap();
    let (mut importer, child, peer) = worker_with_child();
    on_device.0.lock().push(child);
    let (si, _rxi) = arb.open_session("b", "importer", peer).unwrap();
    let import = arb.sharing().import("b", si, "a", "w").unwrap();
    arb.sharing().release_import("b", import.id).unwrap();
    drop(import);
    importer.kill().unwrap();
    importer.wait().unwrap();
    switch.set(Faults {
        keep_freed: true,
        ..Faults::default()
    });
    arb.release("a", l.id).unwrap();
    assert!(
        until(|| held_by(&arb, "b") == 16 * MIB).await,
        "the child's import is charged to b, held {}",
        held_by(&arb, "b")
    );
    assert_eq!(held_by_a(&arb), 0, "the publisher kept nothing");
    assert_eq!(arb.views().quarantined()[0].holders, vec![child]);
    kill_pid(child);
    assert!(
        until(|| held_by(&arb, "b") == 0).await,
        "let go once the child exited, held {}",
        held_by(&arb, "b")
    );
    arb.lock().check_invariant().unwrap();
    std::mem::forget((_rxp, _rxi));
}

/// Counts how many lists run at once; each takes a while (NVML on a busy node).
#[derive(Default)]
struct SlowLister {
    running: std::sync::atomic::AtomicUsize,
    most: std::sync::atomic::AtomicUsize,
}

impl crate::kept_holders::ContextLister for SlowLister {
    fn processes_on(&self, _uuid: &str) -> Option<Vec<u32>> {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(30));
        self.running.fetch_sub(1, Ordering::SeqCst);
        Some(Vec::new())
    }
}

/// One process named by many blocks' kept memory exits: the looks for processes near it
/// run one after another on one blocking thread, not one thread each (a tenant's one
/// exit must not occupy the blocking pool with NVML and `/proc` work); every block is let
/// go.
#[tokio::test]
async fn one_exit_ending_many_blocks_names_looks_for_them_on_one_thread() {
    let switch = FaultSwitch::default();
    let lister = Arc::new(SlowLister::default());
    let arb = keeping_arbiter(&switch);
    let finder = crate::kept_holders::HolderFinder::with_own(
        lister.clone(),
        crate::kept_holders::Place::nowhere(),
    );
    assert!(arb.stranded().find_holders_with(finder));
    let (mut holder, _) = live_process();
    let place = Arc::new(crate::kept_holders::read_place(holder.id()).unwrap());
    for _ in 0..8 {
        let id = arb
            .lock()
            .stranded_rechecking("a", 0, MIB, [holder.id()])
            .unwrap();
        arb.stranded()
            .holders()
            .unwrap()
            .watch(id, "GPU-x", vec![place.clone()]);
    }
    assert_eq!(held_by_a(&arb), 8 * MIB);
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(
        until(|| held_by_a(&arb) == 0).await,
        "every block let go, held {}",
        held_by_a(&arb)
    );
    assert_eq!(lister.most.load(Ordering::SeqCst), 1, "looks ran at once");
    assert_eq!(arb.stranded().holders().unwrap().watching(), 0);
    arb.lock().check_invariant().unwrap();
}

/// Between the worker's exit and its block's free, more other processes than the broker
/// ever remembered places of (4,096, newest kept) open sessions: the worker's place is
/// kept with its block, so the child near it is still found and charged. A tenant could
/// flush it so, leaving the child's memory outside the books.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_processes_seen_meanwhile_never_make_a_dead_holders_place_forgotten() {
    const OTHERS: usize = 4200;
    let switch = FaultSwitch::default();
    let on_device = Arc::new(OnDevice::default());
    let arb = keeping_arbiter_finding(&switch, &on_device);
    switch.set(Faults {
        keep_freed: true,
        ..Faults::default()
    });
    let (mut worker, child, peer) = worker_with_child();
    on_device.0.lock().push(child);
    let (sa, rxa) = arb.open_session("a", "parent", peer).unwrap();
    let l = arb.acquire(req("a", sa, 32 * MIB)).await.unwrap();
    arb.release("a", l.id).unwrap();
    worker.kill().unwrap();
    worker.wait().unwrap();
    // Other processes: threads, each its own pid in /proc while it lives.
    let (tx, tids) = std::sync::mpsc::channel::<u32>();
    let done = Arc::new(std::sync::Barrier::new(OTHERS + 1));
    let threads: Vec<_> = (0..OTHERS)
        .map(|_| {
            let (tx, done) = (tx.clone(), done.clone());
            std::thread::Builder::new()
                .stack_size(64 * 1024)
                .spawn(move || {
                    // SAFETY: gettid cannot fail.
                    tx.send(unsafe { libc::gettid() } as u32).unwrap();
                    done.wait();
                })
                .unwrap()
        })
        .collect();
    for _ in 0..OTHERS {
        let other = Peer {
            pid: Some(tids.recv().unwrap()),
            uid: None,
            unix: true,
        };
        let (s, _rx) = arb.open_session("b", "passer-by", other).unwrap();
        arb.end_session(s, "gone");
    }
    done.wait();
    for t in threads {
        t.join().unwrap();
    }
    let (sb, rxb) = arb.open_session("b", "other", Peer::default()).unwrap();
    arb.acquire(req("b", sb, 48 * MIB)).await.unwrap();
    std::mem::forget((rxa, rxb));
    assert!(
        until(|| held_by_a(&arb) == 32 * MIB).await,
        "the child's 32 MiB are charged to a, held {}",
        held_by_a(&arb)
    );
    assert_eq!(arb.views().quarantined()[0].holders, vec![child]);
    kill_pid(child);
    assert!(
        until(|| held_by_a(&arb) == 0).await,
        "let go once the child exited, held {}",
        held_by_a(&arb)
    );
    arb.lock().check_invariant().unwrap();
}

/// Memory kept after its free survives a broker restart: its charge is kept
/// (`stranded/<id>`, naming the worker by pid and start time), a restarted broker reading
/// that record charges it again to the same tenant and lifts it when the worker exits; a
/// record whose holder is gone (here: the pid with another start time) is lifted at once.
#[tokio::test]
async fn memory_kept_after_its_free_stays_charged_across_a_restart_until_its_holder_exits() {
    use super::restart::adopt_tests::{entry, MemPlace};
    let switch = FaultSwitch::default();
    let arb = keeping_arbiter(&switch);
    let place = MemPlace::default();
    let records = place.records.clone();
    arb.restart().adopt_from_keeper(place).unwrap();
    switch.set(Faults {
        keep_freed: true,
        ..Faults::default()
    });
    let mut worker = release_then_evict(&arb).await;
    assert!(until(|| held_by_a(&arb) == 32 * MIB).await);
    let kept: Vec<(String, serde_json::Value)> = records
        .lock()
        .iter()
        .filter(|(k, _)| k.starts_with(crate::keeper::records::STRANDED_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let (key, record) = kept[0].clone();
    assert_eq!(record["tenant"], "a");
    assert_eq!(record["bytes"], 32 * MIB);
    assert_eq!(record["kind"], "host-memfd");
    let start = crate::process::start_ticks(worker.id()).unwrap();
    assert_eq!(
        record["holders"],
        serde_json::json!([{"pid": worker.id(), "start": start}])
    );

    // A restarted broker (a fresh arbiter over the same device) takes the charge back;
    // a record naming the worker's pid with another start is another process's: lifted.
    let restarted = keeping_arbiter(&FaultSwitch::default());
    assert_eq!(record["device_uuid"], arb.devices.uuid(0));
    // The same device (simulated ones get a new UUID each).
    let mut record = record;
    record["device_uuid"] = restarted.devices.uuid(0).into();
    let mut reused: crate::keeper::records::StrandedRecord =
        serde_json::from_value(record.clone()).unwrap();
    reused.id = uuid::Uuid::new_v4().to_string();
    reused.holders[0].start = Some(start + 1);
    let place = MemPlace::default();
    let removed = place.removed.clone();
    *place.entries.lock() = vec![
        crate::keeper::Entry {
            key: key.clone(),
            record: record.clone(),
            fd: None,
        },
        entry(reused.key(), &reused, None),
    ];
    let report = restarted.restart().adopt_from_keeper(place).unwrap();
    assert_eq!(report.unreadable, 0);
    assert_eq!(
        (
            report.stranded_adopted,
            report.stranded_bytes,
            report.stranded_lifted
        ),
        (1, 32 * MIB, 1),
        "the report counts what was charged again and lifted"
    );
    let metrics = restarted
        .views()
        .metrics_text(crate::metrics::Format::PrometheusText)
        .await;
    for line in [
        "gpu_broker_restart_kept_stranded_total{outcome=\"adopted\"} 1",
        "gpu_broker_restart_kept_stranded_total{outcome=\"let_go\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
    assert_eq!(
        held_by_a(&restarted),
        32 * MIB,
        "charged again to a; lifted: {:?}",
        removed.lock()
    );
    assert_eq!(
        removed.lock().clone(),
        vec![reused.key()],
        "the reused pid's is lifted"
    );
    {
        let st = restarted.lock();
        st.check_invariant().unwrap();
        assert_eq!(st.pools()[0].stats().quarantined, 32 * MIB);
    }
    let listed = restarted.views().quarantined();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].reason, crate::views::HoldReason::KeptAfterFree);
    assert_eq!(listed[0].holders, vec![worker.id()]);
    // Counted against a's quota after the restart too.
    let (sa, _rx) = restarted
        .open_session("a", "again", Peer::default())
        .unwrap();
    let err = restarted
        .acquire(req("a", sa, 48 * MIB))
        .await
        .expect_err("a is charged for what it kept");
    assert!(
        matches!(err, BrokerError::QuotaExceeded { held, .. } if held == 32 * MIB),
        "{err}"
    );

    worker.kill().unwrap();
    worker.wait().unwrap();
    assert!(
        until(|| held_by_a(&restarted) == 0).await,
        "let go once the holder exited, held {}",
        held_by_a(&restarted)
    );
    assert!(
        removed.lock().contains(&key),
        "its record leaves the keeper"
    );
    assert!(until(|| held_by_a(&arb) == 0).await);
    assert!(!records.lock().contains_key(&key), "{:?}", records.lock());
    let st = restarted.lock();
    st.check_invariant().unwrap();
    assert_eq!(st.pools()[0].stats().quarantined, 0);
    assert_eq!(st.stranded_memory().count(), 0);
}

/// A kept memfd's record keeps its file handle: a restarted broker asks the kernel by it,
/// so the charge stays after its named holder exited while a process it never named
/// (here this test's) still holds the file, and lifts once nobody does.
#[tokio::test]
async fn a_kept_memfd_stays_charged_across_a_restart_while_anyone_holds_its_file() {
    use super::restart::adopt_tests::{entry, MemPlace};
    use crate::keeper::records::{ProcessRecord, StrandedRecord};
    use crate::memfd_alive::{Alive, FileHandle, Prober};
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: memfd_create with a static name; checked below.
    let fd = unsafe { libc::memfd_create(c"kept-across".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let handle = FileHandle::of(&fd).expect("memfds have handles");
    if Prober::new().unwrap().alive(&handle) == Alive::Unknown {
        eprintln!("skipped: the kernel may not be asked (no CAP_DAC_READ_SEARCH)");
        return;
    }
    let (mut worker, _) = live_process();
    let restarted = host_arbiter(
        64 * MIB,
        1,
        ArbiterConfig {
            kept_memory_look: Duration::from_millis(20),
            ..ArbiterConfig::default()
        },
    );
    restarted.set_quota("a", quota(64 * MIB)).unwrap();
    let record = StrandedRecord {
        v: crate::keeper::RECORD_VERSION,
        id: uuid::Uuid::new_v4().to_string(),
        tenant: "a".into(),
        device: 0,
        bytes: 32 * MIB,
        kind: Some("host-memfd".into()),
        holders: vec![ProcessRecord {
            pid: worker.id(),
            start: crate::process::start_ticks(worker.id()),
        }],
        watched: false,
        recheck: false,
        stranded_unix_ms: 0,
        device_uuid: Some(restarted.devices.uuid(0)),
        file_handle: Some(handle.record()),
    };
    // Another, whose file nobody holds any more (its named holder lives): lifted at
    // the start.
    // SAFETY: memfd_create with a static name; checked below.
    let gone = unsafe { libc::memfd_create(c"kept-gone".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(gone >= 0);
    // SAFETY: a fresh descriptor we own, closed at once.
    let gone = unsafe { OwnedFd::from_raw_fd(gone) };
    let gone_handle = FileHandle::of(&gone).unwrap();
    drop(gone);
    let let_go = StrandedRecord {
        id: uuid::Uuid::new_v4().to_string(),
        file_handle: Some(gone_handle.record()),
        ..record.clone()
    };
    // One charged for a process the broker never named (none recorded): the file's
    // life alone keeps it.
    let unnamed = StrandedRecord {
        id: uuid::Uuid::new_v4().to_string(),
        bytes: 8 * MIB,
        holders: Vec::new(),
        ..record.clone()
    };
    let place = MemPlace::default();
    let removed = place.removed.clone();
    *place.entries.lock() = vec![
        entry(record.key(), &record, None),
        entry(let_go.key(), &let_go, None),
        entry(unnamed.key(), &unnamed, None),
    ];
    let report = restarted.restart().adopt_from_keeper(place).unwrap();
    assert_eq!((report.stranded_adopted, report.stranded_lifted), (2, 1));
    assert_eq!(held_by_a(&restarted), 40 * MIB);
    assert_eq!(removed.lock().clone(), vec![let_go.key()]);

    // The named holder exits; the file lives on with this process: still charged.
    worker.kill().unwrap();
    worker.wait().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        held_by_a(&restarted),
        40 * MIB,
        "still charged while the file lives; lifted: {:?}",
        removed.lock()
    );
    assert_eq!(removed.lock().clone(), vec![let_go.key()]);

    // Nobody holds it any more: lifted, its record gone.
    drop(fd);
    assert!(
        until(|| held_by_a(&restarted) == 0).await,
        "lifted once let go, held {}",
        held_by_a(&restarted)
    );
    assert!(until(|| removed.lock().contains(&record.key())).await);
    assert!(until(|| removed.lock().contains(&unnamed.key())).await);
    let st = restarted.lock();
    st.check_invariant().unwrap();
    assert_eq!(st.pools()[0].stats().quarantined, 0);
    assert_eq!(st.stranded_memory().count(), 0);
}

/// A kept charge that was to be looked at again near its holders (`recheck`, CUDA) taken
/// back by a broker that has no finder (NVML gone since, or a holder exiting before the
/// finder is set): nobody can look, so its last holder's exit lifts it, as it would
/// memory never looked at near its holders; else its tenant stays charged forever.
#[tokio::test]
async fn a_kept_charge_to_look_at_again_is_lifted_by_a_broker_without_a_finder() {
    use super::restart::adopt_tests::{entry, MemPlace};
    let arb = keeping_arbiter(&FaultSwitch::default());
    let (mut worker, _) = live_process();
    let r = crate::keeper::records::StrandedRecord {
        v: 1,
        id: uuid::Uuid::new_v4().to_string(),
        tenant: "a".into(),
        device: 0,
        bytes: 8 * MIB,
        kind: Some("cuda-vmm".into()),
        holders: vec![crate::keeper::records::ProcessRecord {
            pid: worker.id(),
            start: crate::process::start_ticks(worker.id()),
        }],
        watched: true,
        recheck: true,
        stranded_unix_ms: 1,
        device_uuid: Some(arb.devices.uuid(0)),
        file_handle: None,
    };
    let place = MemPlace::default();
    let removed = place.removed.clone();
    *place.entries.lock() = vec![entry(r.key(), &r, None)];
    let report = arb.restart().adopt_from_keeper(place).unwrap();
    assert_eq!(report.stranded_adopted, 1);
    assert_eq!(held_by_a(&arb), 8 * MIB);
    assert!(arb.stranded().holders().is_none());
    worker.kill().unwrap();
    worker.wait().unwrap();
    assert!(
        until(|| held_by_a(&arb) == 0).await,
        "lifted once its holder exited, held {}",
        held_by_a(&arb)
    );
    assert!(
        removed.lock().contains(&r.key()),
        "its record leaves the keeper"
    );
    let st = arb.lock();
    st.check_invariant().unwrap();
    assert_eq!(st.stranded_memory().count(), 0);
}

/// The start sets the finder before it takes kept charges back (`main`): a charge to be
/// looked at again near its holders (`recheck`) whose holder exits right after the
/// take-back is looked for near it, and stays while a process near it (its child, on the
/// device) lives; a session taken back has its peer's place read. Charges taken back
/// before the finder was set were lifted at such an exit without a look.
#[tokio::test]
async fn a_kept_charge_taken_back_after_the_finder_is_set_is_looked_for_near_its_holder() {
    use super::restart::adopt_tests::{entry, MemPlace};
    let on_device = Arc::new(OnDevice::default());
    let arb = keeping_arbiter_finding(&FaultSwitch::default(), &on_device);
    let (mut worker, child, _) = worker_with_child();
    on_device.0.lock().push(child);
    let r = crate::keeper::records::StrandedRecord {
        v: 1,
        id: uuid::Uuid::new_v4().to_string(),
        tenant: "a".into(),
        device: 0,
        bytes: 8 * MIB,
        kind: Some("cuda-vmm".into()),
        holders: vec![crate::keeper::records::ProcessRecord {
            pid: worker.id(),
            start: crate::process::start_ticks(worker.id()),
        }],
        watched: true,
        recheck: true,
        stranded_unix_ms: 1,
        device_uuid: Some(arb.devices.uuid(0)),
        file_handle: None,
    };
    let session = uuid::Uuid::new_v4();
    let me = std::process::id();
    let s = crate::keeper::records::SessionRecord {
        v: 1,
        id: session.to_string(),
        tenant: "a".into(),
        name: "w".into(),
        pid: Some(me),
        uid: None,
        unix: true,
        pid_start: crate::process::start_ticks(me),
        token_id: None,
        resume_hash: None,
        opened_unix_ms: 0,
    };
    let place = MemPlace::default();
    let removed = place.removed.clone();
    *place.entries.lock() = vec![entry(r.key(), &r, None), entry(s.key(), &s, None)];
    let report = arb.restart().adopt_from_keeper(place).unwrap();
    assert_eq!((report.stranded_adopted, report.sessions_adopted), (1, 1));
    assert_eq!(arb.stranded().holders().unwrap().watching(), 1);
    assert!(
        arb.lock()
            .sessions()
            .get(&session)
            .is_some_and(|s| s.place.is_some()),
        "the session taken back has its peer's place"
    );
    worker.kill().unwrap();
    worker.wait().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        held_by_a(&arb),
        8 * MIB,
        "its holder's child may keep it; lifted: {:?}",
        removed.lock()
    );
    assert_eq!(arb.views().quarantined()[0].holders, vec![child]);
    kill_pid(child);
    assert!(
        until(|| held_by_a(&arb) == 0).await,
        "lifted once the child exited too, held {}",
        held_by_a(&arb)
    );
    assert!(removed.lock().contains(&r.key()));
    arb.lock().check_invariant().unwrap();
    assert_eq!(arb.stranded().holders().unwrap().watching(), 0);
}

/// A kept charge on a CUDA device is counted as the broker's device memory at the start
/// only when it is charged again: one whose tenant is gone is lifted, and the memory its
/// holder keeps stays outside memory, not leasable (else the broker would promise bytes
/// the card does not have).
#[tokio::test]
async fn a_kept_charge_not_taken_back_is_not_counted_as_the_brokers_memory() {
    use super::restart::adopt_tests::{entry, MemPlace};
    let (arb, _outside, _dir) = super::tests::fake_cuda_fixture(ArbiterConfig::default());
    arb.set_quota("a", quota(64 * MIB)).unwrap();
    let (mut worker, _) = live_process();
    let record = |tenant: &str, bytes: u64| crate::keeper::records::StrandedRecord {
        v: 1,
        id: uuid::Uuid::new_v4().to_string(),
        tenant: tenant.into(),
        device: 0,
        bytes,
        kind: Some("cuda-vmm".into()),
        holders: vec![crate::keeper::records::ProcessRecord {
            pid: worker.id(),
            start: crate::process::start_ticks(worker.id()),
        }],
        watched: true,
        recheck: false,
        stranded_unix_ms: 1,
        device_uuid: Some(arb.devices.uuid(0)),
        file_handle: None,
    };
    let (kept, gone) = (record("a", 4 * MIB), record("nobody", 8 * MIB));
    let place = MemPlace::default();
    *place.entries.lock() = vec![
        entry(kept.key(), &kept, None),
        entry(gone.key(), &gone, None),
    ];
    let report = arb.restart().adopt_from_keeper(place).unwrap();
    assert_eq!((report.stranded_adopted, report.stranded_lifted), (1, 1));
    assert_eq!(
        arb.lock().pools()[0].leasable(),
        56 * MIB + 4 * MIB,
        "only the charge taken back is the broker's"
    );
    worker.kill().unwrap();
    worker.wait().unwrap();
}
