//! Unit tests of admission, queueing, reuse, guarantees and reclaim against an in-process
//! arbiter over simulated devices.

use super::*;
use crate::device::Handle;
use crate::error::BrokerError;
use crate::lease::LeaseView;
use crate::ledger::Quota;

const MIB: u64 = 1 << 20;

struct Fixture {
    arb: Arc<Arbiter>,
    _dir: tempfile::TempDir,
}

fn fixture(capacity: u64, devices: u32, cfg: ArbiterConfig) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let arb = host_arbiter(capacity, devices, cfg);
    Fixture { arb, _dir: dir }
}

pub(crate) fn quota(limit: u64) -> Quota {
    Quota {
        limit_bytes: limit,
        ..Quota::default()
    }
}

/// Every open session by id, page by page.
fn sessions(arb: &Arbiter) -> Vec<SessionView> {
    listing::all_pages(|t| {
        arb.views()
            .sessions_page(None, t, listing::DEFAULT_PAGE_SIZE)
    })
}

pub(crate) fn req(tenant: &str, session: Uuid, bytes: u64) -> AcquireRequest {
    AcquireRequest {
        tenant: tenant.into(),
        session,
        bytes,
        device: None,
        wait: Duration::ZERO,
        label: String::new(),
        reclaimable: false,
        fallback_host: false,
    }
}

impl Fixture {
    fn tenant(&self, name: &str, q: Quota) -> Uuid {
        self.arb.set_quota(name, q).unwrap();
        let (id, rx) = self.arb.open_session(name, "t", Peer::default()).unwrap();
        std::mem::forget(rx);
        id
    }
    fn held(&self, name: &str) -> u64 {
        self.arb.views().tenant(name).unwrap().usage.held_bytes
    }
}

/// The memory object behind an fd handle, as a `File` (a dup of the broker's descriptor).
fn file_of(h: &Handle) -> std::fs::File {
    match h {
        Handle::Fd { fd, .. } => std::fs::File::from(fd.0.try_clone().unwrap()),
    }
}

fn block_of(h: &Handle) -> u64 {
    match h {
        Handle::Fd { block_id, .. } => *block_id,
    }
}

/// Maps a handle's memory object shared, as a worker would.
fn map_of(h: &Handle, len: usize) -> memmap2::MmapMut {
    let f = file_of(h);
    // SAFETY: a test-only shared mapping of the lease's memory object.
    unsafe { memmap2::MmapOptions::new().len(len).map_mut(&f).unwrap() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_never_exceed_the_quota() {
    let f = fixture(1 << 30, 1, ArbiterConfig::default());
    let s = f.tenant("a", quota(32 * MIB));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let arb = f.arb.clone();
        tasks.push(tokio::spawn(
            async move { arb.acquire(req("a", s, MIB)).await },
        ));
    }
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => ok += 1,
            Err(e @ BrokerError::QuotaExceeded { .. }) => {
                assert!(e.to_string().contains("limit"), "{e}")
            }
            Err(e) => panic!("unexpected {e:?}"),
        }
    }
    assert_eq!(ok, 16, "32 MiB / 2 MiB granules");
    assert_eq!(f.held("a"), 32 * MIB);
}

#[tokio::test]
async fn released_block_is_reused_without_scrub_by_its_tenant() {
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    let s = f.tenant("a", quota(64 * MIB));
    let l1 = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file_of(&l1.handle), &[7u8; 16], 0).unwrap();
    f.arb.release("a", l1.id).unwrap();
    let l2 = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    assert_eq!(
        block_of(&l2.handle),
        block_of(&l1.handle),
        "same block reused"
    );
    assert_eq!(
        l2.handle, l1.handle,
        "same exported descriptor: no new export"
    );
    let st = f.arb.state.lock().pools()[0].stats();
    assert_eq!((st.hits, st.scrubs), (1, 0));
}

/// The state lock is the broker's one point of contention: a pooled acquire and its
/// release take it once each when no process reservation exists (no look at the caller's
/// process tree, nothing to undo once the answer was received), and a reservation costs a
/// lease request one take more (the lineage is read from `/proc` between two takes).
#[tokio::test]
async fn a_pooled_acquire_and_release_take_the_state_lock_once_each() {
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    let s = f.tenant("a", quota(64 * MIB));
    let warm = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    f.arb.release("a", warm.id).unwrap();
    let holds = || f.arb.metrics.lock_holds.counts().0[0];
    let before = holds();
    let l = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    assert_eq!(holds() - before, 1, "one take for a pooled acquire");
    f.arb.release("a", l.id).unwrap();
    assert_eq!(holds() - before, 2, "one take for its release");
}

/// Every answer goes through the one reply path: a request granted in the hold that
/// offered it (a pooled block of its own tenant) gets a reply channel as one whose grant
/// needs device work or that waits does, and none is left behind once answered.
#[tokio::test]
async fn every_grant_is_answered_through_its_reply_channel() {
    let f = fixture(16 * MIB, 1, ArbiterConfig::default());
    let s = f.tenant("a", quota(16 * MIB));
    let channels = || f.arb.outbox.replies_registered();
    // Fresh memory: device work on a task, the answer through a channel.
    let warm = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    assert_eq!(channels(), 1, "a fresh grant is answered through a channel");
    f.arb.release("a", warm.id).unwrap();
    // The same size again: the tenant's cached block, granted in the offering hold.
    let pooled = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    assert_eq!(
        channels(),
        2,
        "a pooled grant is answered through a channel too"
    );
    assert_eq!(
        f.arb.outbox.replies_len(),
        0,
        "its channel went with the answer"
    );
    assert_eq!(pooled.bytes, 4 * MIB);
    assert_eq!(f.arb.metrics.granted_total(), 2, "both grants are counted");
    // A request that waits for memory held by the pooled lease gets a channel, and its
    // grant once the memory comes back.
    let waiting = {
        let arb = f.arb.clone();
        let mut r = req("a", s, 16 * MIB);
        r.wait = Duration::from_secs(10);
        tokio::spawn(async move { arb.acquire(r).await })
    };
    while f.arb.lock().queue().is_empty() {
        tokio::task::yield_now().await;
    }
    assert_eq!(channels(), 3, "a waiting request has a channel");
    f.arb.release("a", pooled.id).unwrap();
    let big = waiting.await.unwrap().unwrap();
    assert_eq!(big.bytes, 16 * MIB);
    assert_eq!(f.arb.outbox.replies_len(), 0, "no channel is left behind");
}

/// The state lock's holds are counted by the wall clock always, and by the holding
/// thread's CPU clock (a system call at every take) only with `--lock-hold-cpu-clock`.
#[tokio::test]
async fn holds_are_counted_by_the_cpu_clock_only_when_asked() {
    for cpu_clock in [false, true] {
        let cfg = ArbiterConfig {
            lock_hold_cpu_clock: cpu_clock,
            ..ArbiterConfig::default()
        };
        let f = fixture(64 * MIB, 1, cfg);
        let s = f.tenant("a", quota(64 * MIB));
        let (wall0, cpu0) = f.arb.metrics.lock_holds.counts();
        let l = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
        f.arb.release("a", l.id).unwrap();
        let (wall, cpu) = f.arb.metrics.lock_holds.counts();
        assert!(
            wall[0] >= wall0[0] + 2,
            "{cpu_clock}: every hold by the wall clock"
        );
        if cpu_clock {
            assert_eq!(
                cpu[0] - cpu0[0],
                wall[0] - wall0[0],
                "every hold by the CPU clock"
            );
        } else {
            assert_eq!(cpu, [0; 4], "no hold by the CPU clock");
        }
    }
}

/// A worker that released a lease but kept its mapping (or whose forked child did) never
/// sees the next tenant's bytes: another tenant gets a fresh memory object, and the old
/// one, freed, is revoked (truncated): the kept mapping holds no page of it any more.
#[tokio::test]
async fn another_tenant_gets_a_fresh_memory_object_not_a_mapped_one() {
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    let a = f.tenant("a", quota(64 * MIB));
    let b = f.tenant("b", quota(64 * MIB));
    let l1 = f.arb.acquire(req("a", a, 2 * MIB)).await.unwrap();
    let mut kept = map_of(&l1.handle, 2 * MIB as usize);
    kept.fill(0xAB);
    f.arb.release("a", l1.id).unwrap();
    let l2 = f.arb.acquire(req("b", b, 2 * MIB)).await.unwrap();
    assert_ne!(block_of(&l2.handle), block_of(&l1.handle), "fresh object");
    let mut m2 = map_of(&l2.handle, 2 * MIB as usize);
    assert!(m2.iter().all(|&x| x == 0), "fresh memory is zero");
    m2.fill(0xCD);
    // The free runs on the device thread: it is done once a later job ran there.
    f.arb.devices[0].thread.call_blocking(|_| ()).unwrap();
    let old = file_of(&l1.handle).metadata().unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        (old.len(), old.blocks()),
        (0, 0),
        "the old object was revoked"
    );
    assert_eq!(resident_pages(&kept), 0, "the kept mapping holds no page");
    // Accounting: one lease of 2 MiB, the old block freed (not cached).
    let st = f.arb.state.lock().pools()[0].stats();
    assert_eq!((st.leased, st.cached), (2 * MIB, 0));
}

/// Pages of `m` that are in memory (`mincore`; a mapping of a truncated memfd has none),
/// read without touching the mapping.
fn resident_pages(m: &memmap2::MmapMut) -> usize {
    let page = 4096;
    let mut vec = vec![0u8; m.len().div_ceil(page)];
    // SAFETY: mincore over our own mapping into a vector of one byte per page.
    let rc = unsafe { libc::mincore(m.as_ptr() as *mut _, m.len(), vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    vec.iter().filter(|&&v| v & 1 == 1).count()
}

#[tokio::test]
async fn waiter_is_granted_when_memory_is_released() {
    let f = fixture(8 * MIB, 1, ArbiterConfig::default());
    let s = f.tenant("a", quota(64 * MIB));
    let l1 = f.arb.acquire(req("a", s, 8 * MIB)).await.unwrap();
    let arb = f.arb.clone();
    let waiting = tokio::spawn(async move {
        let mut r = req("a", s, 4 * MIB);
        r.wait = Duration::from_secs(5);
        arb.acquire(r).await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(f.arb.views().device_reports().await[0].waiting, 1);
    f.arb.release("a", l1.id).unwrap();
    let l2 = waiting.await.unwrap().unwrap();
    assert_eq!(l2.bytes, 4 * MIB);
}

#[tokio::test]
async fn losing_a_wait_is_deadline_exceeded_with_numbers() {
    let f = fixture(8 * MIB, 1, ArbiterConfig::default());
    let s = f.tenant("a", quota(64 * MIB));
    let _l = f.arb.acquire(req("a", s, 8 * MIB)).await.unwrap();
    let mut r = req("a", s, 2 * MIB);
    r.wait = Duration::from_millis(50);
    match f.arb.acquire(r).await {
        Err(e @ BrokerError::WaitExpired { .. }) => {
            let m = e.to_string();
            assert!(
                m.contains("2.0 MiB (2097152 bytes)") && m.contains("free"),
                "{m}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        f.arb.views().device_reports().await[0].waiting,
        0,
        "waiter left the queue"
    );
    let r = req("a", s, 2 * MIB);
    assert!(matches!(
        f.arb.acquire(r).await,
        Err(BrokerError::NoCapacity { .. })
    ));
}

#[tokio::test]
async fn waiters_of_one_tenant_are_served_in_order() {
    let f = fixture(4 * MIB, 1, ArbiterConfig::default());
    let s = f.tenant("a", quota(64 * MIB));
    let l = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    let mut handles = Vec::new();
    for i in 0..3u64 {
        let arb = f.arb.clone();
        handles.push(tokio::spawn(async move {
            let mut r = req("a", s, 4 * MIB);
            r.wait = Duration::from_secs(5);
            r.label = i.to_string();
            let l = arb.acquire(r).await.unwrap();
            arb.release("a", l.id).unwrap();
            (i, std::time::Instant::now())
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f.arb.release("a", l.id).unwrap();
    let mut done = Vec::new();
    for h in handles {
        done.push(h.await.unwrap());
    }
    done.sort_by_key(|(_, t)| *t);
    let order: Vec<u64> = done.iter().map(|(i, _)| *i).collect();
    assert_eq!(order, vec![0, 1, 2]);
}

#[tokio::test]
async fn unused_guarantees_are_kept_from_borrowers() {
    let f = fixture(16 * MIB, 1, ArbiterConfig::default());
    let g = f.tenant(
        "g",
        Quota {
            limit_bytes: 16 * MIB,
            guaranteed_bytes: 8 * MIB,
            ..Quota::default()
        },
    );
    let b = f.tenant("b", quota(16 * MIB));
    let _l = f.arb.acquire(req("b", b, 8 * MIB)).await.unwrap();
    // 8 MiB free, all of it guaranteed to g.
    assert!(matches!(
        f.arb.acquire(req("b", b, 2 * MIB)).await,
        Err(BrokerError::NoCapacity { .. })
    ));
    f.arb.acquire(req("g", g, 8 * MIB)).await.unwrap();
}

#[tokio::test]
async fn guarantees_cannot_exceed_capacity() {
    let f = fixture(16 * MIB, 1, ArbiterConfig::default());
    let q = Quota {
        limit_bytes: 16 * MIB,
        guaranteed_bytes: 10 * MIB,
        ..Quota::default()
    };
    f.arb.set_quota("a", q.clone()).unwrap();
    assert!(matches!(
        f.arb.set_quota("b", q),
        Err(BrokerError::GuaranteesExceedCapacity {
            guarantees,
            leasable
        }) if guarantees == 20 * MIB && leasable == 16 * MIB
    ));
}

#[tokio::test]
async fn higher_priority_waiter_triggers_reclaim_of_lowest_newest() {
    let f = fixture(8 * MIB, 1, ArbiterConfig::default());
    f.arb.set_quota("low", quota(8 * MIB)).unwrap();
    let (low, mut events) = f.arb.open_session("low", "l", Peer::default()).unwrap();
    let mut r = req("low", low, 4 * MIB);
    r.reclaimable = true;
    let old = f.arb.acquire(r.clone()).await.unwrap();
    let new = f.arb.acquire(r).await.unwrap();
    let high = f.tenant(
        "high",
        Quota {
            limit_bytes: 8 * MIB,
            priority: 10,
            ..Quota::default()
        },
    );
    let arb = f.arb.clone();
    let waiting = tokio::spawn(async move {
        let mut r = req("high", high, 4 * MIB);
        r.wait = Duration::from_secs(5);
        arb.acquire(r).await
    });
    let ev = tokio::time::timeout(Duration::from_secs(2), events.recv())
        .await
        .unwrap()
        .unwrap();
    match ev {
        SessionEvent::ReclaimRequested { lease_id, .. } => assert_eq!(lease_id, new.id),
        other => panic!("{other:?}"),
    }
    f.arb.release("low", new.id).unwrap();
    assert_eq!(waiting.await.unwrap().unwrap().bytes, 4 * MIB);
    // Only as much as needed: the older lease was left alone.
    assert!(f
        .arb
        .views()
        .leases(Some("low"))
        .iter()
        .any(|l| l.id == old.id && l.reclaim_deadline.is_none()));
}

#[tokio::test]
async fn session_of_an_exited_process_returns_memory_to_the_pool() {
    let f = fixture(8 * MIB, 1, ArbiterConfig::default());
    f.arb.set_quota("a", quota(8 * MIB)).unwrap();
    let (mut child, peer) = live_process();
    let (s, _events) = f.arb.open_session("a", "w", peer).unwrap();
    f.arb.acquire(req("a", s, 8 * MIB)).await.unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    // The pid watcher ends the session on its own.
    for _ in 0..100 {
        if f.arb.views().session_count() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        f.arb.views().session_count(),
        0,
        "session did not end on process exit"
    );
    assert_eq!(f.held("a"), 0);
    let d = &f.arb.views().device_reports().await[0];
    assert_eq!((d.leased, d.cached, d.quarantined), (0, 8 * MIB, 0));
}

#[tokio::test]
async fn revoked_lease_of_a_live_process_is_quarantined() {
    let f = fixture(8 * MIB, 1, ArbiterConfig::default());
    f.arb.set_quota("a", quota(8 * MIB)).unwrap();
    let me = Peer {
        pid: Some(std::process::id()),
        uid: None,
        unix: true,
    };
    let (s, mut events) = f.arb.open_session("a", "x", me).unwrap();
    let l = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    f.arb
        .revoke(l.id, &state::Revoke::Operator("test".into()))
        .unwrap();
    assert!(matches!(
        events.recv().await,
        Some(SessionEvent::LeaseRevoked { .. })
    ));
    let d = &f.arb.views().device_reports().await[0];
    assert_eq!((d.leased, d.quarantined), (0, 4 * MIB));
    assert_eq!(
        f.arb.views().tenant("a").unwrap().usage.quarantined_bytes,
        4 * MIB
    );
    // Quarantined memory is not available to anyone.
    assert!(f.arb.acquire(req("a", s, 6 * MIB)).await.is_err());
}

#[tokio::test]
async fn unpinned_requests_go_where_they_fit_and_pinned_stay() {
    let f = fixture(8 * MIB, 2, ArbiterConfig::default());
    let s = f.tenant("a", quota(64 * MIB));
    let a = f.arb.acquire(req("a", s, 6 * MIB)).await.unwrap();
    let b = f.arb.acquire(req("a", s, 6 * MIB)).await.unwrap();
    assert_ne!(
        a.device, b.device,
        "second lease goes to the emptier device"
    );
    let mut r = req("a", s, 2 * MIB);
    r.device = Some(1);
    assert_eq!(f.arb.acquire(r).await.unwrap().device, 1);
    let mut r = req("a", s, 2 * MIB);
    r.device = Some(2);
    assert!(matches!(
        f.arb.acquire(r).await,
        Err(BrokerError::UnknownDevice {
            device: 2,
            count: 2,
            mps: false
        })
    ));
}

#[tokio::test]
async fn eviction_keeps_holdings_under_leasable() {
    let f = fixture(8 * MIB, 1, ArbiterConfig::default());
    let s = f.tenant("a", quota(64 * MIB));
    for size in [2, 4, 6, 8] {
        let l = f.arb.acquire(req("a", s, size * MIB)).await.unwrap();
        let st = f.arb.state.lock().pools()[0].stats();
        assert!(st.leased + st.cached <= 8 * MIB, "{st:?}");
        f.arb.release("a", l.id).unwrap();
    }
}

#[tokio::test]
async fn process_memory_beyond_leases_is_reported() {
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    f.arb.set_quota("a", quota(64 * MIB)).unwrap();
    let pid = std::process::id();
    let peer = Peer {
        pid: Some(pid),
        uid: None,
        unix: true,
    };
    let (s, _events) = f.arb.open_session("a", "w", peer).unwrap();
    f.arb.acquire(req("a", s, 8 * MIB)).await.unwrap();
    let usage = std::collections::HashMap::from([(pid, 3 * MIB)]);
    f.arb.sessions().apply_process_usage(&usage, 4 * MIB);
    let g = sessions(&f.arb)[0].gpu.unwrap();
    assert_eq!((g.used, g.own, g.over), (3 * MIB, 3 * MIB, false));
    let usage = std::collections::HashMap::from([(pid, 20 * MIB)]);
    f.arb.sessions().apply_process_usage(&usage, 4 * MIB);
    let g = sessions(&f.arb)[0].gpu.unwrap();
    assert_eq!((g.own, g.over), (20 * MIB, true));
    // A session whose process NVML does not list uses nothing of its own.
    f.arb
        .sessions()
        .apply_process_usage(&Default::default(), 4 * MIB);
    assert!(!sessions(&f.arb)[0].gpu.unwrap().over);
}

#[tokio::test]
async fn memory_within_a_guarantee_is_not_reclaimed_for_a_higher_priority() {
    let f = fixture(8 * MIB, 1, ArbiterConfig::default());
    let q = Quota {
        limit_bytes: 8 * MIB,
        guaranteed_bytes: 8 * MIB,
        ..Quota::default()
    };
    f.arb.set_quota("low", q).unwrap();
    let (low, mut events) = f.arb.open_session("low", "l", Peer::default()).unwrap();
    let mut r = req("low", low, 8 * MIB);
    r.reclaimable = true;
    f.arb.acquire(r).await.unwrap();
    let high = f.tenant(
        "high",
        Quota {
            limit_bytes: 8 * MIB,
            priority: 10,
            ..Quota::default()
        },
    );
    let mut r = req("high", high, 2 * MIB);
    r.wait = Duration::from_millis(200);
    assert!(matches!(
        f.arb.acquire(r).await,
        Err(BrokerError::WaitExpired { .. })
    ));
    assert!(
        events.try_recv().is_err(),
        "guaranteed memory was asked back"
    );
}

/// A device that reports itself as CUDA and whose free memory also drops by what an
/// "outside process" takes (`outside`), to test the leasable refresh.
struct OutsideDevice {
    inner: crate::device::host::HostDevice,
    desc: crate::device::DeviceDesc,
    outside: Arc<std::sync::atomic::AtomicU64>,
}

impl crate::device::Device for OutsideDevice {
    fn desc(&self) -> &crate::device::DeviceDesc {
        &self.desc
    }
    fn mem_info(&mut self) -> Result<crate::device::MemInfo, crate::device::DeviceError> {
        let m = self.inner.mem_info()?;
        let taken = self.outside.load(std::sync::atomic::Ordering::SeqCst);
        Ok(crate::device::MemInfo {
            free: m.free.saturating_sub(taken),
            total: m.total,
        })
    }
    fn fresh_is_zeroed(&self) -> bool {
        true
    }
    fn alloc(&mut self, b: u64) -> Result<crate::device::Allocation, crate::device::DeviceError> {
        self.inner.alloc(b)
    }
    fn free(&mut self, a: crate::device::Allocation) -> Result<(), crate::device::DeviceError> {
        self.inner.free(a)
    }
    fn export(
        &mut self,
        a: &crate::device::Allocation,
    ) -> Result<Handle, crate::device::DeviceError> {
        self.inner.export(a)
    }
    fn scrub(&mut self, a: &crate::device::Allocation) -> Result<(), crate::device::DeviceError> {
        self.inner.scrub(a)
    }
    fn read(
        &mut self,
        a: &crate::device::Allocation,
        o: u64,
        l: usize,
    ) -> Result<Vec<u8>, crate::device::DeviceError> {
        self.inner.read(a, o, l)
    }
    fn write(
        &mut self,
        a: &crate::device::Allocation,
        o: u64,
        d: &[u8],
    ) -> Result<(), crate::device::DeviceError> {
        self.inner.write(a, o, d)
    }
}

/// An arbiter over one fake CUDA device of 64 MiB (8 MiB headroom, 56 MiB leasable) whose
/// free memory also drops by what the returned counter says another process took.
fn outside_fixture(
    cfg: ArbiterConfig,
) -> (
    Arc<Arbiter>,
    Arc<std::sync::atomic::AtomicU64>,
    tempfile::TempDir,
) {
    fake_cuda_fixture(cfg)
}

/// Like `outside_fixture`.
pub(super) fn fake_cuda_fixture(
    cfg: ArbiterConfig,
) -> (
    Arc<Arbiter>,
    Arc<std::sync::atomic::AtomicU64>,
    tempfile::TempDir,
) {
    use crate::device::thread::DeviceThread;
    let dir = tempfile::tempdir().unwrap();
    let outside = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (o, d) = (outside.clone(), dir.path().to_path_buf());
    let thread = DeviceThread::spawn("fake-cuda".into(), move || {
        let _ = &d;
        let inner = crate::device::host::HostDevice::new(0, 64 * MIB)?;
        let desc = crate::device::DeviceDesc {
            backend: crate::device::BackendKind::Cuda,
            ..crate::device::Device::desc(&inner).clone()
        };
        Ok(Box::new(OutsideDevice {
            inner,
            desc,
            outside: o,
        }) as Box<dyn crate::device::Device>)
    })
    .unwrap();
    let slot = DeviceSlot {
        thread,
        initial_leasable: 56 * MIB,
        external_at_start: 0,
        taken_back: Default::default(),
        headroom: 8 * MIB,
    };
    let arb = Arbiter::new(
        vec![slot],
        None,
        None,
        Arc::new(Authenticator::new("x")),
        cfg,
    )
    .unwrap();
    (arb, outside, dir)
}

#[tokio::test]
async fn memory_taken_outside_the_broker_shrinks_leasable_and_trims_the_cache() {
    let (arb, outside, _dir) = outside_fixture(ArbiterConfig::default());
    arb.set_quota("a", quota(64 * MIB)).unwrap();
    let (s, _rx) = arb.open_session("a", "w", Peer::default()).unwrap();
    let l = arb.acquire(req("a", s, 16 * MIB)).await.unwrap();
    arb.release("a", l.id).unwrap();
    // Another process takes 40 MiB: 8 MiB stay free (= headroom), the broker may now
    // hand out only 56 - 40 = 16 MiB, which its cached block still fits in.
    outside.store(40 * MIB, std::sync::atomic::Ordering::SeqCst);
    arb.tasks().refresh_leasable().await;
    let dev = &arb.views().device_reports().await[0];
    assert_eq!(
        (dev.leasable, dev.cached, dev.external_used),
        (16 * MIB, 16 * MIB, 40 * MIB),
        "{dev:?}"
    );
    assert_eq!(dev.headroom, 8 * MIB);
    assert!(matches!(
        arb.acquire(req("a", s, 18 * MIB)).await,
        Err(BrokerError::TooLarge { .. })
    ));
    // It takes 4 MiB more, eating into the headroom: the unused cached block goes back.
    outside.store(44 * MIB, std::sync::atomic::Ordering::SeqCst);
    arb.tasks().refresh_leasable().await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let dev = &arb.views().device_reports().await[0];
    assert_eq!((dev.leasable, dev.cached), (12 * MIB, 0), "{dev:?}");
    assert_eq!(dev.free, 20 * MIB, "the block was freed on the device");
    // They give it all back: leasable grows again.
    outside.store(0, std::sync::atomic::Ordering::SeqCst);
    arb.tasks().refresh_leasable().await;
    assert_eq!(arb.views().device_reports().await[0].leasable, 56 * MIB);
    arb.acquire(req("a", s, 40 * MIB)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_background_refresh_follows_outside_memory_both_ways() {
    let cfg = ArbiterConfig {
        refresh_interval: Duration::from_millis(50),
        ..ArbiterConfig::default()
    };
    let (arb, outside, _dir) = outside_fixture(cfg);
    let stop = tokio_util::sync::CancellationToken::new();
    arb.tasks().start(stop.clone());
    for (taken, want) in [
        (20 * MIB, 36 * MIB),
        (0, 56 * MIB),
        (30 * MIB, 26 * MIB),
        (0, 56 * MIB),
    ] {
        outside.store(taken, std::sync::atomic::Ordering::SeqCst);
        let mut got = 0;
        for _ in 0..100 {
            got = arb.views().device_reports().await[0].leasable;
            if got == want {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(got, want, "after another process took {taken}");
    }
    stop.cancel();
}

#[tokio::test]
async fn a_runaway_tenant_cannot_open_unbounded_sessions_or_waiters() {
    let cfg = ArbiterConfig {
        max_sessions_per_tenant: 2,
        max_waiting_per_tenant: 2,
        ..ArbiterConfig::default()
    };
    let f = fixture(4 * MIB, 1, cfg);
    let s = f.tenant("a", quota(64 * MIB));
    f.arb.open_session("a", "2", Peer::default()).unwrap();
    assert!(matches!(
        f.arb.open_session("a", "3", Peer::default()),
        Err(BrokerError::SessionLimit { .. })
    ));
    let _l = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    let mut waiters = Vec::new();
    for _ in 0..2 {
        let arb = f.arb.clone();
        waiters.push(tokio::spawn(async move {
            let mut r = req("a", s, 2 * MIB);
            r.wait = Duration::from_secs(2);
            arb.acquire(r).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(f.arb.views().device_reports().await[0].waiting, 2);
    let mut r = req("a", s, 2 * MIB);
    r.wait = Duration::from_secs(2);
    match f.arb.acquire(r).await {
        Err(e @ BrokerError::QueueFull { .. }) => assert!(e.to_string().contains("waiting"), "{e}"),
        other => panic!("{other:?}"),
    }
    for w in waiters {
        w.abort();
    }
}

/// Makes every waiting request of `tenant` look `by` older (the overtaking rule's clock is
/// the waiter's `since`: moving it is a controllable clock).
fn age_waiters(f: &Fixture, tenant: &str, by: Duration) {
    let mut st = f.arb.state.lock();
    let ids: Vec<u64> = st
        .queue()
        .iter()
        .filter(|w| w.ask.tenant == tenant)
        .map(|w| w.id)
        .collect();
    for id in ids {
        let w = st.queue_mut().get_mut(id).unwrap();
        w.since = w.since.checked_sub(by).expect("an instant that far back");
    }
}

/// `n` requests of 8 MiB (no wait) from `tenant`'s session, each released at once when
/// granted; how many were granted (the others must be NO_CAPACITY).
async fn small_grants(f: &Fixture, tenant: &str, s: Uuid, n: u32) -> u32 {
    let mut granted = 0;
    for _ in 0..n {
        match f.arb.acquire(req(tenant, s, 8 * MIB)).await {
            Ok(l) => {
                granted += 1;
                f.arb.release(tenant, l.id).unwrap();
            }
            Err(e) => assert!(matches!(e, BrokerError::NoCapacity { .. }), "{e:?}"),
        }
    }
    granted
}

/// A big request blocked by held memory lets other tenants' requests of its priority that
/// fit go first while it is younger than the overtake age, however many they are; once it
/// is that old they queue behind it (it cannot starve), and it is granted first when the
/// memory comes back.
#[tokio::test]
async fn a_blocked_big_request_is_overtaken_only_while_younger_than_the_overtake_age() {
    let age = Duration::from_secs(3600);
    let f = fixture(
        64 * MIB,
        1,
        ArbiterConfig {
            overtake_age: age,
            ..ArbiterConfig::default()
        },
    );
    let hs = f.tenant("holder", quota(64 * MIB));
    let bs = f.tenant("big", quota(64 * MIB));
    let ss = f.tenant("small", quota(64 * MIB));
    let held = f.arb.acquire(req("holder", hs, 32 * MIB)).await.unwrap();
    let big = {
        let arb = f.arb.clone();
        tokio::spawn(async move {
            let mut r = req("big", bs, 48 * MIB);
            r.wait = Duration::from_secs(60);
            arb.acquire(r).await
        })
    };
    while f.arb.views().tenant("big").unwrap().waiting == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Young: 32 MiB free, and every small request that fits is granted (no count limit).
    assert_eq!(small_grants(&f, "small", ss, 100).await, 100);
    // The big request's own tenant never overtakes it (first come, first served).
    let e = f.arb.acquire(req("big", bs, 8 * MIB)).await.unwrap_err();
    assert!(matches!(e, BrokerError::NoCapacity { .. }), "{e:?}");
    // Old: the small requests are refused, the memory is kept for the big one.
    age_waiters(&f, "big", age);
    assert_eq!(small_grants(&f, "small", ss, 8).await, 0);
    // A small request that waits queues behind it: when the memory comes back the big
    // request is granted first, then the small one from what is left.
    let waiting_small = {
        let arb = f.arb.clone();
        tokio::spawn(async move {
            let mut r = req("small", ss, 8 * MIB);
            r.wait = Duration::from_secs(60);
            let l = arb.acquire(r).await;
            (
                l,
                arb.views().tenant("big").map(|t| t.usage.committed_bytes()),
            )
        })
    };
    while f.arb.views().tenant("small").unwrap().waiting == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    f.arb.release("holder", held.id).unwrap();
    let l = tokio::time::timeout(Duration::from_secs(10), big)
        .await
        .expect("the big request is granted once memory comes back")
        .unwrap()
        .unwrap();
    assert_eq!(l.bytes, 48 * MIB);
    let (small, big_held) = tokio::time::timeout(Duration::from_secs(10), waiting_small)
        .await
        .expect("the waiting small request is granted from what is left")
        .unwrap();
    assert_eq!(small.unwrap().bytes, 8 * MIB);
    assert_eq!(big_held.unwrap(), 48 * MIB, "the big request went first");
}

/// `--overtake-age 0s`: a request blocked by held memory is never overtaken; requests
/// of its priority that would fit are refused while it waits, and granted once it is.
#[tokio::test]
async fn with_a_zero_overtake_age_a_blocked_request_is_never_overtaken() {
    let (f, held, _, bs, ss) = zero_age_fixture().await;
    let big = spawn_acquire(&f.arb, "big", bs, 48 * MIB, Duration::from_secs(60));
    while f.arb.views().tenant("big").unwrap().waiting == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(small_grants(&f, "small", ss, 4).await, 0);
    f.arb.release("holder", held.id).unwrap();
    let l = tokio::time::timeout(Duration::from_secs(10), big)
        .await
        .expect("granted once memory comes back")
        .unwrap()
        .unwrap();
    assert_eq!(l.bytes, 48 * MIB);
    assert_eq!(small_grants(&f, "small", ss, 2).await, 2, "16 MiB left");
}

#[tokio::test]
async fn the_invariant_check_catches_bytes_in_no_state() {
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    let s = f.tenant("a", quota(64 * MIB));
    let l = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    assert_eq!(f.arb.lock().check_invariant(), Ok(()));
    // Behind the guard's back, take the bytes off the ledger but not off the pool (what a
    // transition pairing its updates by hand could get wrong): the check names it.
    let mut st = f.arb.state.lock();
    st.ledger_behind_the_back().uncharge("a", 0, 4 * MIB);
    let e = st.check_invariant().unwrap_err();
    assert!(e.contains("tenant \"a\""), "{e}");
    st.ledger_behind_the_back()
        .reserve("a", 0, 4 * MIB)
        .unwrap();
    st.ledger_behind_the_back().commit("a", 4 * MIB);
    assert_eq!(st.check_invariant(), Ok(()));
    drop(st);
    f.arb.release("a", l.id).unwrap();
    let st = f.arb.lock();
    assert_eq!(st.check_invariant(), Ok(()));
    assert_eq!(st.pools()[0].stats().cached, 4 * MIB);
}

#[tokio::test]
async fn a_tenant_being_deleted_takes_no_new_charge_or_session() {
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    let s = f.tenant("a", quota(64 * MIB));
    f.arb.lock().close_tenant("a").unwrap();
    let e = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap_err();
    assert!(matches!(e, BrokerError::NotFound(_)), "{e:?}");
    let e = f.arb.open_session("a", "t", Peer::default()).unwrap_err();
    assert!(matches!(e, BrokerError::NotFound(_)), "{e:?}");
    assert_eq!(f.held("a"), 0);
    // The store refused the deletion: the tenant is back.
    f.arb.lock().reopen_tenant("a");
    let l = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    assert_eq!(f.held("a"), 4 * MIB);
    // A tenant holding memory cannot start closing.
    assert!(f.arb.lock().close_tenant("a").is_err());
    f.arb.release("a", l.id).unwrap();
    f.arb.changes().delete_tenant("a", None).unwrap();
    assert!(f.arb.views().tenant("a").is_err());
}

#[tokio::test]
async fn effects_run_after_the_lock_is_released() {
    // A revoked lease's holder is told, its memory quarantined (a watcher started) and
    // the revocation counted: all effects, run once the guard dropped.
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    f.arb.set_quota("a", quota(64 * MIB)).unwrap();
    let me = Peer {
        pid: Some(std::process::id()),
        uid: None,
        unix: true,
    };
    let (s, mut rx) = f.arb.open_session("a", "t", me).unwrap();
    let l = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    f.arb
        .revoke(l.id, &state::Revoke::Operator("operator test".into()))
        .unwrap();
    match rx.try_recv() {
        Ok(SessionEvent::LeaseRevoked { lease_id, .. }) => assert_eq!(lease_id, l.id),
        other => panic!("expected LeaseRevoked, got {other:?}"),
    }
    let st = f.arb.lock();
    assert!(!st.has_effects());
    assert_eq!(st.quarantine().len(), 1);
    assert_eq!(st.pools()[0].stats().quarantined, 4 * MIB);
}

#[tokio::test]
async fn each_take_of_the_lock_sets_the_cores_clock_and_a_lease_is_stamped_in_its_acquire() {
    // The core reads no clock: Arbiter::lock hands it both clocks as it takes the lock,
    // and what a transition stamps (a lease's creation) carries that time.
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    f.arb.set_quota("a", quota(64 * MIB)).unwrap();
    let (s, _rx) = f.arb.open_session("a", "t", Peer::default()).unwrap();
    let (before, t0) = (SystemTime::now(), Instant::now());
    let l = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    let st = f.arb.lock();
    let (wall, at) = (SystemTime::now(), Instant::now());
    let created = st.leases().get(&l.id).unwrap().created;
    assert!(before <= created && created <= wall, "{created:?}");
    let clock = st.clock();
    assert!(t0 <= clock.now && clock.now <= at);
    assert!(created <= clock.wall && clock.wall <= wall);
}

#[tokio::test]
async fn session_events_go_through_the_outbox_and_its_end_closes_the_stream() {
    // The core names sessions by id; the shell keeps each one's channel. Events decided
    // in the same lock hold as the session's end still arrive, then the stream ends.
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    f.arb.set_quota("a", quota(64 * MIB)).unwrap();
    let (s, mut rx) = f.arb.open_session("a", "t", Peer::default()).unwrap();
    let (other, mut other_rx) = f.arb.open_session("a", "u", Peer::default()).unwrap();
    assert_eq!(f.arb.outbox.len(), 2);
    let l = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    {
        let mut st = f.arb.lock();
        st.fx_behind_the_back()
            .push_for_test(effects::Effect::Notify {
                session: s,
                event: SessionEvent::LeaseRevoked {
                    lease_id: l.id,
                    reason: "told, then ended".into(),
                },
            });
        st.end_session(s, Some(Ending::Cache), false);
    }
    match rx.try_recv() {
        Ok(SessionEvent::LeaseRevoked { lease_id, reason }) => {
            assert_eq!((lease_id, reason.as_str()), (l.id, "told, then ended"));
        }
        other => panic!("expected LeaseRevoked, got {other:?}"),
    }
    assert_eq!(
        rx.try_recv(),
        Err(tokio::sync::mpsc::error::TryRecvError::Disconnected)
    );
    assert_eq!(f.arb.outbox.len(), 1);
    // The other session heard nothing, and an event to the ended one reaches nobody.
    f.arb
        .lock()
        .fx_behind_the_back()
        .push_for_test(effects::Effect::Notify {
            session: s,
            event: SessionEvent::ShuttingDown {
                reason: "late".into(),
                grace: Duration::ZERO,
            },
        });
    assert_eq!(
        other_rx.try_recv(),
        Err(tokio::sync::mpsc::error::TryRecvError::Empty)
    );
    f.arb.end_session(other, "test");
    assert_eq!(f.arb.outbox.len(), 0);
}

/// Publishing seals memory with no lock held, then checks again: of publishes racing for
/// one name, or for one lease, exactly one wins and the others are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_publishes_leave_one_publication_per_name_and_per_lease() {
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    f.arb.set_quota("a", quota(64 * MIB)).unwrap();
    let (s, _rx) = f.arb.open_session("a", "t", Peer::default()).unwrap();
    let mut leases = Vec::new();
    for _ in 0..6 {
        leases.push(f.arb.acquire(req("a", s, 2 * MIB)).await.unwrap().id);
    }
    let race = |jobs: Vec<(Uuid, String)>| {
        let threads: Vec<_> = jobs
            .into_iter()
            .map(|(l, name)| {
                let arb = f.arb.clone();
                std::thread::spawn(move || arb.sharing().publish("a", l, &name, &[]))
            })
            .collect();
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let won = results.iter().filter(|r| r.is_ok()).count();
        for e in results.into_iter().filter_map(Result::err) {
            assert!(
                matches!(
                    e,
                    // A loser never sees the winner's seal as its own failure.
                    BrokerError::SharedNameTaken { .. } | BrokerError::AlreadyPublished { .. }
                ),
                "{e}"
            );
        }
        won
    };
    // Five leases, one name.
    let one_name = leases[..5]
        .iter()
        .map(|l| (*l, "same".to_string()))
        .collect();
    assert_eq!(race(one_name), 1);
    // The sixth lease, five names.
    let one_lease = (0..5).map(|i| (leases[5], format!("n{i}"))).collect();
    assert_eq!(race(one_lease), 1);
    let shared = f.arb.views().shared(None);
    assert_eq!(shared.len(), 2, "{shared:?}");
    assert_eq!(
        shared.iter().filter(|p| p.lease == Some(leases[5])).count(),
        1
    );
}

/// Device 0's quarantined and cached bytes.
async fn quarantined_and_cached(f: &Fixture) -> (u64, u64) {
    let d = &f.arb.views().device_reports().await[0];
    (d.quarantined, d.cached)
}

/// Processes that fetched a lease's descriptor are looked at after the unlock: one that
/// already exited lets the memory back before `release` returns, one alive keeps it held
/// until it exits, and one the broker cannot decide about (pid 0: another PID namespace)
/// counts as alive.
#[tokio::test]
async fn fd_recipients_are_looked_at_after_the_unlock_and_undecided_counts_alive() {
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    f.arb.set_quota("a", quota(64 * MIB)).unwrap();
    let (s, _rx) = f.arb.open_session("a", "t", Peer::default()).unwrap();
    let mut dead = std::process::Command::new("true").spawn().unwrap();
    dead.wait().unwrap();
    let mut live = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    // Only a recipient that exited: cached as if nobody else had it.
    let l = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    assert_eq!(
        f.arb.fd_delivering(l.id, Some(dead.id())),
        crate::arbiter::Recipient::Added
    );
    f.arb.release("a", l.id).unwrap();
    // Before anything awaits (a watcher could run then): the look already let it go.
    assert!(f.arb.views().quarantined().is_empty());
    assert_eq!(quarantined_and_cached(&f).await, (0, 4 * MIB));
    assert_eq!(f.arb.lock().unlooked(), 0);
    // The exited one and a live one: held for the live one only.
    let l = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    assert_eq!(
        f.arb.fd_delivering(l.id, Some(dead.id())),
        crate::arbiter::Recipient::Added
    );
    assert_eq!(
        f.arb.fd_delivering(l.id, Some(live.id())),
        crate::arbiter::Recipient::Added
    );
    f.arb.release("a", l.id).unwrap();
    let q = f.arb.views().quarantined();
    assert_eq!(q.len(), 1, "{q:?}");
    assert_eq!((q[0].lease, q[0].bytes), (l.id, 4 * MIB));
    assert_eq!(q[0].holders, vec![live.id()]);
    assert_eq!(quarantined_and_cached(&f).await, (4 * MIB, 0));
    // An undecidable pid keeps memory held too.
    let l0 = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    assert_eq!(
        f.arb.fd_delivering(l0.id, Some(0)),
        crate::arbiter::Recipient::Added
    );
    f.arb.release("a", l0.id).unwrap();
    assert_eq!(quarantined_and_cached(&f).await, (8 * MIB, 0));
    assert_eq!(f.arb.lock().unlooked(), 0);
    // The live one exits: its watcher lets the memory go.
    live.kill().unwrap();
    live.wait().unwrap();
    for _ in 0..200 {
        if quarantined_and_cached(&f).await == (4 * MIB, 4 * MIB) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(quarantined_and_cached(&f).await, (4 * MIB, 4 * MIB));
    let q = f.arb.views().quarantined();
    assert_eq!(
        (q.len(), q[0].lease, q[0].holders.clone()),
        (1, l0.id, vec![0])
    );
}

#[tokio::test]
async fn watchers_are_kept_by_the_shell_and_stopped_with_what_they_watch() {
    let f = fixture(8 * MIB, 1, ArbiterConfig::default());
    f.arb.set_quota("a", quota(8 * MIB)).unwrap();
    let (mut child, peer) = live_process();
    // A session of a live process: its peer is watched.
    let (s, _events) = f.arb.open_session("a", "w", peer).unwrap();
    assert_eq!(f.arb.watchers.len(), 1);
    f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    // It ends while the process lives: the session's watcher stops, the quarantine's starts.
    f.arb.end_session(s, "test");
    assert_eq!(f.arb.watchers.len(), 1);
    assert_eq!(f.arb.views().device_reports().await[0].quarantined, 4 * MIB);
    // A session closed at once leaves no watcher behind.
    let (s2, _e2) = f.arb.open_session("a", "w2", peer).unwrap();
    assert_eq!(f.arb.watchers.len(), 2);
    f.arb.end_session(s2, "test");
    assert_eq!(f.arb.watchers.len(), 1);
    // The process exits: its quarantine is lifted by the watcher, which is then dropped.
    child.kill().unwrap();
    child.wait().unwrap();
    for _ in 0..200 {
        if f.arb.watchers.len() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(f.arb.watchers.len(), 0);
    let d = &f.arb.views().device_reports().await[0];
    assert_eq!((d.quarantined, d.cached), (0, 4 * MIB));
}

/// Pages come from the lease table's indexes: a page larger than one lock hold's chunk is
/// whole and in grant order, a tenant filter yields exactly that tenant's leases in order,
/// and releases leave no gap or repeat between pages.
#[tokio::test]
async fn lease_pages_follow_the_indexes_across_chunks_and_releases() {
    let f = fixture(4096 * MIB, 1, ArbiterConfig::default());
    let sa = f.tenant("a", quota(4096 * MIB));
    let sb = f.tenant("b", quota(4096 * MIB));
    let mut a = Vec::new();
    let mut b = Vec::new();
    for i in 0..700 {
        let (t, s, v) = if i % 3 == 0 {
            ("b", sb, &mut b)
        } else {
            ("a", sa, &mut a)
        };
        v.push(f.arb.acquire(req(t, s, 2 * MIB)).await.unwrap().id);
    }
    // One page of 650 spans two chunks of the state lock.
    let p = f.arb.views().leases_page(None, "", 650).unwrap();
    assert_eq!(p.items.len(), 650);
    let rest = f
        .arb
        .views()
        .leases_page(None, p.next.as_deref().unwrap(), 650)
        .unwrap();
    assert_eq!(rest.items.len(), 50);
    assert_eq!(rest.next, None);
    let all: Vec<Uuid> = p.items.iter().chain(&rest.items).map(|l| l.id).collect();
    let mut want: Vec<Uuid> = Vec::new();
    let (mut ia, mut ib) = (a.iter(), b.iter());
    for i in 0..700 {
        want.push(*if i % 3 == 0 { ib.next() } else { ia.next() }.unwrap());
    }
    assert_eq!(all, want, "every lease once, in grant order");
    // Release every other lease of b, then walk b's leases in pages of 7.
    for id in b.iter().step_by(2) {
        f.arb.release("b", *id).unwrap();
    }
    let kept: Vec<Uuid> = b.iter().skip(1).step_by(2).copied().collect();
    let mut walked = Vec::new();
    let mut token = String::new();
    loop {
        let p = f.arb.views().leases_page(Some("b"), &token, 7).unwrap();
        assert!(p.items.iter().all(|l| l.tenant == "b"));
        walked.extend(p.items.iter().map(|l| l.id));
        match p.next {
            Some(t) => token = t,
            None => break,
        }
    }
    assert_eq!(walked, kept);
    assert_eq!(f.arb.views().leases(Some("a")).len(), a.len());
    assert!(f
        .arb
        .views()
        .leases_page(Some("nobody"), "", 10)
        .unwrap()
        .items
        .is_empty());
    assert_eq!(f.arb.lock().check_invariant(), Ok(()));
}

/// A page of tenants larger than one lock hold's chunk is whole, in name order, with
/// each tenant's session count and token count.
#[tokio::test]
async fn tenant_pages_span_chunks_in_name_order() {
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    for i in 0..620 {
        f.arb.set_quota(&format!("t{i:04}"), quota(MIB)).unwrap();
    }
    f.tenant("t0600", quota(MIB));
    let spec = super::tokens::TokenSpec {
        tenant: Some("t0601".into()),
        ..Default::default()
    };
    f.arb.changes().issue_token(spec, None).unwrap();
    let p = f.arb.views().tenants_page("", 610).unwrap();
    assert_eq!(p.items.len(), 610);
    assert_eq!(p.next.as_deref(), Some("t0609"));
    let rest = f.arb.views().tenants_page("t0609", 610).unwrap();
    let names: Vec<String> = p
        .items
        .iter()
        .chain(&rest.items)
        .map(|t| t.name.clone())
        .collect();
    let want: Vec<String> = (0..620).map(|i| format!("t{i:04}")).collect();
    assert_eq!(names, want);
    assert_eq!(rest.next, None);
    let t600 = p.items.iter().find(|t| t.name == "t0600").unwrap();
    assert_eq!(t600.sessions, 1);
    let t601 = p.items.iter().find(|t| t.name == "t0601").unwrap();
    assert_eq!(t601.tokens, 1);
}

/// `bytes` asked for on a task by `tenant`'s session `s`, waiting up to `wait`.
fn spawn_acquire(
    arb: &Arc<Arbiter>,
    tenant: &'static str,
    s: Uuid,
    bytes: u64,
    wait: Duration,
) -> tokio::task::JoinHandle<BrokerResult<LeaseView>> {
    let arb = arb.clone();
    tokio::spawn(async move {
        let mut r = req(tenant, s, bytes);
        r.wait = wait;
        arb.acquire(r).await
    })
}

/// One device of 64 MiB, `--overtake-age 0s`, tenants `holder`, `big` and `small` (64 MiB
/// each; their sessions, in that order) and 32 MiB held by `holder`.
async fn zero_age_fixture() -> (Fixture, LeaseView, Uuid, Uuid, Uuid) {
    let f = fixture(
        64 * MIB,
        1,
        ArbiterConfig {
            overtake_age: Duration::ZERO,
            ..ArbiterConfig::default()
        },
    );
    let hs = f.tenant("holder", quota(64 * MIB));
    let bs = f.tenant("big", quota(64 * MIB));
    let ss = f.tenant("small", quota(64 * MIB));
    let held = f.arb.acquire(req("holder", hs, 32 * MIB)).await.unwrap();
    (f, held, hs, bs, ss)
}

/// Waits until `tenant` has `n` requests in the queue.
async fn until_waiting(f: &Fixture, tenant: &str, n: u32) {
    while f.arb.views().tenant(tenant).unwrap().waiting != n {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A queued request that can no longer fit anywhere (memory used outside the broker made
/// the device's leasable amount smaller than it) is refused at once, with the error a new
/// request of that size gets, instead of waiting out its wait.
#[tokio::test]
async fn a_waiting_request_larger_than_what_is_leasable_now_is_refused_at_once() {
    let (arb, outside, _dir) = outside_fixture(ArbiterConfig::default());
    arb.set_quota("a", quota(64 * MIB)).unwrap();
    arb.set_quota("b", quota(64 * MIB)).unwrap();
    let (sa, _ra) = arb.open_session("a", "w", Peer::default()).unwrap();
    let (sb, _rb) = arb.open_session("b", "w", Peer::default()).unwrap();
    let _held = arb.acquire(req("a", sa, 32 * MIB)).await.unwrap();
    let waiting = spawn_acquire(&arb, "b", sb, 30 * MIB, Duration::from_secs(60));
    while arb.views().tenant("b").unwrap().waiting == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Another process takes 30 MiB: 26 MiB leasable, less than the 30 MiB asked for.
    outside.store(30 * MIB, std::sync::atomic::Ordering::SeqCst);
    arb.tasks().refresh_leasable().await;
    let got = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("refused at once, not after its wait")
        .unwrap();
    let new = arb.acquire(req("b", sb, 30 * MIB)).await;
    match (&got, &new) {
        (Err(e @ BrokerError::TooLarge { leasable, .. }), Err(n)) => {
            assert_eq!(*leasable, 26 * MIB);
            assert_eq!(e, n, "the error a new request of that size gets");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(arb.views().tenant("b").unwrap().waiting, 0);
}

/// Likewise when the tenant's limit is lowered below the request, and when the only
/// device large enough drains: refused at once with the new request's error.
#[tokio::test]
async fn a_waiting_request_that_its_devices_or_quota_can_never_serve_is_refused_at_once() {
    let f = fixture(64 * MIB, 2, ArbiterConfig::default());
    f.arb.lock().set_leasable(0, 16 * MIB);
    let hs = f.tenant("holder", quota(64 * MIB));
    let bs = f.tenant("big", quota(64 * MIB));
    let cs = f.tenant("capped", quota(64 * MIB));
    for (bytes, d) in [(40 * MIB, 1), (16 * MIB, 0)] {
        let mut r = req("holder", hs, bytes);
        r.device = Some(d);
        f.arb.acquire(r).await.unwrap();
    }
    // Device 0: 16 MiB leasable, all held; device 1: 24 MiB free.
    let minute = Duration::from_secs(60);
    let big = spawn_acquire(&f.arb, "big", bs, 32 * MIB, minute);
    let capped = spawn_acquire(&f.arb, "capped", cs, 28 * MIB, minute);
    until_waiting(&f, "big", 1).await;
    until_waiting(&f, "capped", 1).await;
    // The capped tenant's limit goes below its request.
    f.arb.set_quota("capped", quota(16 * MIB)).unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), capped)
        .await
        .expect("refused at once")
        .unwrap();
    let new = f.arb.acquire(req("capped", cs, 28 * MIB)).await;
    assert!(
        matches!(&got, Err(BrokerError::QuotaExceeded { limit, .. }) if *limit == 16 * MIB),
        "{got:?}"
    );
    assert_eq!(got.unwrap_err(), new.unwrap_err());
    // Device 1, the only one with 32 MiB leasable, drains.
    f.arb
        .drains()
        .start(Some(1), None, "kernel update")
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), big)
        .await
        .expect("refused at once")
        .unwrap();
    let new = f.arb.acquire(req("big", bs, 32 * MIB)).await;
    assert!(
        matches!(&got, Err(BrokerError::TooLarge { leasable, .. }) if *leasable == 16 * MIB),
        "{got:?}"
    );
    assert_eq!(got.unwrap_err(), new.unwrap_err());
    assert!(f.arb.lock().queue().is_empty());
    assert_eq!(
        f.arb.outbox.replies_len(),
        0,
        "no reply channel left behind"
    );
}

/// A head that held its device for everyone after it (older than the overtake age) and
/// whose wait ran out lets them in at once: its leaving runs the queue.
#[tokio::test]
async fn a_blocking_head_whose_wait_ran_out_lets_the_others_in_at_once() {
    let (f, _held, _, bs, ss) = zero_age_fixture().await;
    let big = spawn_acquire(&f.arb, "big", bs, 48 * MIB, Duration::from_secs(1));
    let small = loop {
        // Queued behind the big one (on a machine so slow that the big one's wait ran out
        // first, the small one is granted at once and the test proves nothing, but passes).
        if f.arb.views().tenant("big").unwrap().waiting == 1 || big.is_finished() {
            break spawn_acquire(&f.arb, "small", ss, 8 * MIB, Duration::from_secs(60));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    while f.arb.views().tenant("small").unwrap().waiting == 0 && !small.is_finished() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(matches!(
        big.await.unwrap(),
        Err(BrokerError::WaitExpired { .. })
    ));
    let l = tokio::time::timeout(Duration::from_secs(10), small)
        .await
        .expect("granted when the head left, not after its own wait")
        .unwrap()
        .unwrap();
    assert_eq!(l.bytes, 8 * MIB);
}

/// A caller that goes away while waiting leaves the queue and its reply channel behind
/// neither in the core nor in the shell; a grant made as it went is given back.
#[tokio::test]
async fn an_abandoned_waiter_leaves_no_queue_entry_and_no_reply_channel() {
    let f = fixture(16 * MIB, 1, ArbiterConfig::default());
    let a = f.tenant("a", quota(64 * MIB));
    let held = f.arb.acquire(req("a", a, 16 * MIB)).await.unwrap();
    let waiting = spawn_acquire(&f.arb, "a", a, 8 * MIB, Duration::from_secs(60));
    until_waiting(&f, "a", 1).await;
    assert_eq!(f.arb.outbox.replies_len(), 1);
    waiting.abort();
    let _ = waiting.await;
    until_waiting(&f, "a", 0).await;
    assert_eq!(f.arb.outbox.replies_len(), 0);
    f.arb.release("a", held.id).unwrap();
    assert_eq!(f.held("a"), 0, "nothing was granted to the gone caller");
}

/// A published lease whose importer let go (it may keep the descriptor) is revoked while
/// its publisher's process lives: quarantined, and when that process exits its memfd is
/// freed, never cached for the publisher's next lease.
#[tokio::test]
async fn a_published_lease_revoked_is_freed_not_cached_when_its_process_exits() {
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    f.arb.set_quota("a", quota(64 * MIB)).unwrap();
    let b = f.tenant("b", quota(64 * MIB));
    let (mut child, peer) = live_process();
    let (s, _rx) = f.arb.open_session("a", "t", peer).unwrap();
    let l = f.arb.acquire(req("a", s, 4 * MIB)).await.unwrap();
    f.arb
        .sharing()
        .publish("a", l.id, "weights", &["b".into()])
        .unwrap();
    let i = f.arb.sharing().import("b", b, "a", "weights").unwrap();
    f.arb.sharing().release_import("b", i.id).unwrap();
    // The publisher's and the importer's descriptors close (this process's copies would
    // keep the sealed memfd alive past its free, and the kernel says so: charged as kept).
    let lease = l.id;
    drop((i, l));
    f.arb
        .revoke(lease, &state::Revoke::Operator("test".into()))
        .unwrap();
    assert_eq!(quarantined_and_cached(&f).await, (4 * MIB, 0));
    child.kill().unwrap();
    child.wait().unwrap();
    for _ in 0..200 {
        if quarantined_and_cached(&f).await.0 == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(quarantined_and_cached(&f).await, (0, 0));
    // Nobody kept the freed memfd: nothing is charged once the free's look is done.
    f.arb.devices[0].thread.call(|_| ()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        f.arb.views().tenant("a").unwrap().usage.quarantined_bytes,
        0
    );
}

/// A lingering import (its holder let go while a process that fetched its descriptor may
/// still map it) delivers its descriptor to nobody else: a new recipient would not be
/// waited for, and its memory would be counted free while that process maps it.
#[tokio::test]
async fn a_lingering_import_delivers_its_descriptor_to_nobody_else() {
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    f.arb.set_quota("a", quota(64 * MIB)).unwrap();
    f.arb.set_quota("b", quota(64 * MIB)).unwrap();
    let (sa, _ra) = f.arb.open_session("a", "t", Peer::default()).unwrap();
    let (sb, _rb) = f.arb.open_session("b", "t", Peer::default()).unwrap();
    let l = f.arb.acquire(req("a", sa, 4 * MIB)).await.unwrap();
    f.arb
        .sharing()
        .publish("a", l.id, "weights", &["b".to_string()])
        .unwrap();
    let import = f.arb.sharing().import("b", sb, "a", "weights").unwrap();
    let mut live = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    // Another process of the reader fetched the import's descriptor, then the reader lets go.
    assert_eq!(
        f.arb.fd_delivering(import.id, Some(live.id())),
        crate::arbiter::Recipient::Added
    );
    f.arb.sharing().release_import("b", import.id).unwrap();
    // The import lingers for that process; a second fetch (a ticket already being redeemed)
    // gets nothing.
    assert_eq!(
        f.arb.fd_delivering(import.id, Some(std::process::id())),
        crate::arbiter::Recipient::Gone
    );
    assert_eq!(
        f.arb.fd_delivering(import.id, None),
        crate::arbiter::Recipient::Gone
    );
    live.kill().unwrap();
    live.wait().unwrap();
}

/// A caller that goes away after its grant was sent but before it received it (a client
/// deadline, a dropped connection) leaves nothing charged: the grant is given back.
#[tokio::test]
async fn a_grant_sent_to_a_caller_gone_before_receiving_it_is_given_back() {
    use std::future::Future;
    let f = fixture(64 * MIB, 1, ArbiterConfig::default());
    let a = f.tenant("a", quota(64 * MIB));
    // A fresh block: the grant is answered from the device work's task, after this poll.
    let mut acquiring = Box::pin(f.arb.acquire(req("a", a, 4 * MIB)));
    let first =
        std::future::poll_fn(|cx| std::task::Poll::Ready(acquiring.as_mut().poll(cx))).await;
    assert!(first.is_pending(), "the grant needs device work");
    for _ in 0..2000 {
        if f.arb.outbox.replies_len() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(f.arb.outbox.replies_len(), 0, "the answer was sent");
    assert_eq!(f.held("a"), 4 * MIB, "granted, not yet received");
    drop(acquiring);
    assert_eq!(f.held("a"), 0, "the unreceived grant was given back");
    assert!(f.arb.lock().leases().is_empty());
}

/// A host-fallback lease whose descriptor went to a process outside its session ends
/// with nothing of it left in the shared table (the lock guard checks the invariant after
/// every transition in debug builds), and its file is freed.
#[tokio::test]
async fn a_host_fallback_lease_given_to_another_process_leaves_no_recipient_behind() {
    let spec = crate::backend::BackendSpec {
        choice: crate::backend::BackendChoice::Host,
        cuda_devices: None,
        host_capacity: 8 * MIB,
        host_devices: 1,
        headroom: crate::backend::Headroom::Bytes(0),
        host_uuid_seed: None,
    };
    let slots = crate::backend::open_devices(&spec).unwrap();
    let host = crate::backend::open_host_tier(64 * MIB).unwrap();
    let arb = Arbiter::new(
        slots,
        host,
        None,
        Arc::new(Authenticator::new("x")),
        ArbiterConfig::default(),
    )
    .unwrap();
    let q = Quota {
        limit_bytes: 8 * MIB,
        host_limit_bytes: 16 * MIB,
        ..Quota::default()
    };
    arb.set_quota("a", q).unwrap();
    let (s, _rx) = arb.open_session("a", "t", Peer::default()).unwrap();
    arb.acquire(req("a", s, 8 * MIB)).await.unwrap();
    let mut r = req("a", s, 4 * MIB);
    r.fallback_host = true;
    let l = arb.acquire(r).await.unwrap();
    assert_eq!(l.tier, crate::ledger::Tier::Host);
    let mut other = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    assert_eq!(
        arb.fd_delivering(l.id, Some(other.id())),
        crate::arbiter::Recipient::Added
    );
    arb.release("a", l.id).unwrap();
    {
        let st = arb.lock();
        assert!(st.shared().recipients.is_empty());
        st.check_invariant().unwrap();
    }
    assert_eq!(arb.views().tenant("a").unwrap().usage.host_held_bytes, 0);
    other.kill().unwrap();
    other.wait().unwrap();
}

/// A fresh block whose export fails is freed on the device through the one executor
/// (`Arbiter::free_on_device`): the grant fails, the device ends with nothing allocated,
/// and the memory is grantable again once exports work.
#[tokio::test]
async fn a_fresh_block_whose_export_failed_is_freed_on_the_device() {
    use crate::device::faulty::{FaultSwitch, Faults, FaultyDevice};
    use crate::device::thread::DeviceThread;
    let switch = FaultSwitch::default();
    let sw = switch.clone();
    let thread = DeviceThread::spawn("faulty-export".into(), move || {
        let inner = Box::new(crate::device::host::HostDevice::new(0, 64 * MIB)?);
        Ok(Box::new(FaultyDevice::new(inner, sw)) as Box<dyn crate::device::Device>)
    })
    .unwrap();
    let slot = DeviceSlot {
        thread: thread.clone(),
        initial_leasable: 64 * MIB,
        external_at_start: 0,
        taken_back: Default::default(),
        headroom: 0,
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
    let (s, _rx) = arb.open_session("a", "w", Peer::default()).unwrap();
    switch.set(Faults {
        fail_export: true,
        ..Faults::default()
    });
    let err = arb.acquire(req("a", s, 16 * MIB)).await.unwrap_err();
    assert!(err.to_string().contains("export"), "{err}");
    // The free was queued before the answer: a call after it sees the device empty.
    let free = thread
        .call(|dev| dev.mem_info().unwrap().free)
        .await
        .unwrap();
    assert_eq!(free, 64 * MIB, "the failed block's allocation was freed");
    assert_eq!(arb.lock().pools()[0].committed(), 0);
    switch.heal();
    let l = arb.acquire(req("a", s, 64 * MIB)).await.unwrap();
    assert_eq!(l.bytes, 64 * MIB);
}

/// A `sleep` child: a live process sessions can belong to, and its peer credentials.
pub(crate) fn live_process() -> (std::process::Child, Peer) {
    let child = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let peer = Peer {
        pid: Some(child.id()),
        uid: None,
        unix: true,
    };
    (child, peer)
}
