//! Unit tests of a restart's adoption against an in-process arbiter over simulated
//! devices and a place that keeps its records in memory: kept memory goes to the device
//! of its UUID wherever that is now, a record without a UUID (an earlier version's) to
//! the device of its index, and memory whose device is gone is let go, never given to
//! another device; the report says where the start's time went.

use crate::arbiter::*;
use crate::keeper::records::{
    DrainRecord, HeldPublicationRecord, HeldRecord, ImportRecord, LeaseRecord, LingeringRecord,
    ProcessRecord, PublicationRecord, QuarantineRecord, SessionRecord, RECORD_VERSION,
};
use crate::keeper::{Entry, KeeperError, Place};
use std::os::fd::{BorrowedFd, OwnedFd};

const MIB: u64 = 1 << 20;

/// A place whose records live in memory; what the broker removes or puts is noted.
#[derive(Default)]
pub(in crate::arbiter) struct MemPlace {
    pub(in crate::arbiter) entries: parking_lot::Mutex<Vec<Entry>>,
    pub(in crate::arbiter) removed: Arc<parking_lot::Mutex<Vec<String>>>,
    /// The keys put and not removed since.
    pub(in crate::arbiter) kept: Arc<parking_lot::Mutex<std::collections::BTreeSet<String>>>,
    /// The records put and not removed since, by key.
    pub(in crate::arbiter) records:
        Arc<parking_lot::Mutex<std::collections::BTreeMap<String, serde_json::Value>>>,
}

impl Place for MemPlace {
    fn describe(&self) -> String {
        "memory".into()
    }
    fn dump(&self) -> Result<Vec<Entry>, KeeperError> {
        Ok(std::mem::take(&mut *self.entries.lock()))
    }
    fn put(&self, key: String, record: serde_json::Value, _fd: Option<BorrowedFd<'_>>) {
        self.records.lock().insert(key.clone(), record);
        self.kept.lock().insert(key);
    }
    fn remove(&self, key: String) {
        self.records.lock().remove(&key);
        self.kept.lock().remove(&key);
        self.removed.lock().push(key);
    }
    fn is_broken(&self) -> bool {
        false
    }
    fn sent(&self) -> u64 {
        0
    }
}

fn memfd(bytes: u64) -> OwnedFd {
    crate::device::host::memfd("gpu-broker-adopt-test", bytes).unwrap()
}

/// This process's session of `tenant`, as a previous broker kept it.
fn session_record(id: Uuid, tenant: &str) -> SessionRecord {
    let pid = std::process::id();
    SessionRecord {
        v: RECORD_VERSION,
        id: id.to_string(),
        tenant: tenant.into(),
        name: "w".into(),
        pid: Some(pid),
        uid: None,
        unix: true,
        pid_start: crate::process::start_ticks(pid),
        token_id: None,
        resume_hash: None,
        opened_unix_ms: 0,
    }
}

fn lease_record(session: Uuid, tenant: &str, device: u32, uuid: Option<&str>) -> LeaseRecord {
    LeaseRecord {
        v: RECORD_VERSION,
        id: Uuid::new_v4().to_string(),
        tenant: tenant.into(),
        session: session.to_string(),
        device,
        tier: "device".into(),
        bytes: 2 * MIB,
        requested_bytes: 2 * MIB,
        label: String::new(),
        reclaimable: false,
        created_unix_ms: 0,
        priority: 0,
        block_id: rand::random(),
        kind: "host-memfd".into(),
        reservation: None,
        device_uuid: uuid.map(str::to_string),
        reached: vec![],
        recipients: Vec::new(),
    }
}

pub(in crate::arbiter) fn entry<T: serde::Serialize>(
    key: String,
    r: &T,
    fd: Option<OwnedFd>,
) -> Entry {
    Entry {
        key,
        record: serde_json::to_value(r).unwrap(),
        fd,
    }
}

/// Kept leases land on the device of their UUID (a reordered device too), a record
/// without one on the device of its index, and a lease or quarantine whose device is gone
/// is let go (its record removed) instead of being counted on another device.
#[test]
fn kept_memory_follows_its_device_uuid_and_is_let_go_when_the_device_is_gone() {
    let arb = host_arbiter(64 * MIB, 2, ArbiterConfig::default());
    arb.set_quota("alpha", crate::arbiter::tests::quota(64 * MIB))
        .unwrap();
    let (uuid0, uuid1) = (arb.devices.uuid(0), arb.devices.uuid(1));
    assert_ne!(uuid0, uuid1);
    let session = Uuid::new_v4();
    // Kept when device 1 was index 0 (the GPUs were reordered since).
    let moved = lease_record(session, "alpha", 0, Some(&uuid1));
    // Written by a broker before UUIDs: by index.
    let old = lease_record(session, "alpha", 0, None);
    // Its device is no longer in this broker, though index 1 exists.
    let gone = lease_record(
        session,
        "alpha",
        1,
        Some("HOST-00000000-0000-0000-0000-000000000000"),
    );
    let pid = std::process::id();
    let gone_quarantine = QuarantineRecord {
        v: RECORD_VERSION,
        lease: Uuid::new_v4().to_string(),
        tenant: "alpha".into(),
        device: 0,
        bytes: 2 * MIB,
        block_id: 7,
        kind: "host-memfd".into(),
        pid: Some(pid),
        pid_start: crate::process::start_ticks(pid),
        destroy: false,
        device_uuid: Some("HOST-00000000-0000-0000-0000-000000000001".into()),
        reached: vec![],
        retained_by: None,
    };
    let place = MemPlace::default();
    let removed = place.removed.clone();
    *place.entries.lock() = vec![
        entry(
            format!("session/{session}"),
            &session_record(session, "alpha"),
            None,
        ),
        entry(moved.key(), &moved, Some(memfd(2 * MIB))),
        entry(old.key(), &old, Some(memfd(2 * MIB))),
        entry(gone.key(), &gone, Some(memfd(2 * MIB))),
        entry(
            gone_quarantine.key(),
            &gone_quarantine,
            Some(memfd(2 * MIB)),
        ),
    ];
    let report = arb.restart().adopt_from_keeper(place).unwrap();
    assert_eq!((report.leases_adopted, report.leases_reclaimed), (2, 1));
    let device_of = |id: &str| {
        arb.views()
            .leases(None)
            .into_iter()
            .find(|l| l.id.to_string() == id)
            .map(|l| l.device)
    };
    assert_eq!(device_of(&moved.id), Some(1), "found by its UUID");
    assert_eq!(device_of(&old.id), Some(0), "found by its index");
    assert_eq!(device_of(&gone.id), None, "not given to another device");
    let mut removed = removed.lock().clone();
    removed.sort();
    let mut expected = vec![gone.key(), gone_quarantine.key()];
    expected.sort();
    assert_eq!(removed, expected, "the memory of a gone device is let go");
    assert_eq!(
        arb.views().tenant("alpha").unwrap().usage.held_bytes,
        4 * MIB
    );
    assert!(arb.views().quarantined().is_empty());
}

/// The report names each step of the adoption in order, with the device's own step.
#[test]
fn the_report_breaks_the_adoption_down() {
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    arb.set_quota("alpha", crate::arbiter::tests::quota(64 * MIB))
        .unwrap();
    let session = Uuid::new_v4();
    let lease = lease_record(session, "alpha", 0, Some(&arb.devices.uuid(0)));
    let place = MemPlace::default();
    *place.entries.lock() = vec![
        entry(
            format!("session/{session}"),
            &session_record(session, "alpha"),
            None,
        ),
        entry(lease.key(), &lease, Some(memfd(2 * MIB))),
    ];
    let report = arb.restart().adopt_from_keeper(place).unwrap();
    let names: Vec<&str> = report.phases.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "keeper dump",
            "parse",
            "sessions",
            "liveness and descriptor checks",
            "device 0 take-back",
            "take-back",
            "adopt under the lock",
            "shared leases",
            "stranded memory",
            "keeper re-armed",
            "drains"
        ]
    );
    assert!(report.phases_line().starts_with("keeper dump "));
    assert_eq!(arb.restart().report().unwrap().phases, report.phases);
}

/// The report's total is the start's wall time: the steps before the adoption and the
/// adoption's own, not the keeper's dump again when it ran while the devices opened; a
/// dump read just before the adoption is its first step.
#[test]
fn the_reports_total_is_wall_time_with_the_dump_counted_once() {
    use crate::keeper::place::Dumped;
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    arb.set_quota("alpha", crate::arbiter::tests::quota(64 * MIB))
        .unwrap();
    let session = Uuid::new_v4();
    let lease = lease_record(session, "alpha", 0, Some(&arb.devices.uuid(0)));
    let place = MemPlace::default();
    *place.entries.lock() = vec![
        entry(
            format!("session/{session}"),
            &session_record(session, "alpha"),
            None,
        ),
        entry(lease.key(), &lease, Some(memfd(2 * MIB))),
    ];
    let dumped = crate::keeper::place::dump(place).unwrap();
    // Read while the devices opened (200 ms), itself 300 ms.
    let dumped = Dumped {
        took: Duration::from_millis(300),
        ..dumped
    };
    let opened = Phase {
        name: "open devices".into(),
        took: Duration::from_millis(200),
    };
    let t = Instant::now();
    let report = arb.restart().adopt_dumped(dumped, vec![opened]);
    let adoption = t.elapsed();
    assert_eq!(report.leases_adopted, 1);
    assert!(
        report.took >= Duration::from_millis(200)
            && report.took <= Duration::from_millis(200) + adoption,
        "{:?} for 200 ms of steps before and {adoption:?} of adoption",
        report.took
    );

    // Without steps before, the dump was the first step.
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    let dumped = Dumped {
        took: Duration::from_millis(300),
        ..crate::keeper::place::dump(MemPlace::default()).unwrap()
    };
    let t = Instant::now();
    let report = arb.restart().adopt_dumped(dumped, Vec::new());
    let adoption = t.elapsed();
    assert!(
        report.took >= Duration::from_millis(300)
            && report.took <= Duration::from_millis(300) + adoption,
        "{:?}",
        report.took
    );
}

/// Two drained devices that swapped indexes since the drains were kept: both stay drained
/// and both drains stay kept (each under its device's index now), so the next restart
/// finds both again.
#[test]
fn drains_of_devices_that_swapped_indexes_are_both_kept() {
    let arb = host_arbiter(64 * MIB, 2, ArbiterConfig::default());
    let (uuid0, uuid1) = (arb.devices.uuid(0), arb.devices.uuid(1));
    let drain = |device: u32, uuid: &str| DrainRecord {
        v: RECORD_VERSION,
        device,
        since_unix_ms: 0,
        deadline_unix_ms: None,
        reason: format!("maintenance of {uuid}"),
        device_uuid: Some(uuid.to_string()),
    };
    // Kept when device 1 was index 0 and device 0 was index 1.
    let (a, b) = (drain(0, &uuid1), drain(1, &uuid0));
    let place = MemPlace::default();
    let kept = place.kept.clone();
    *place.entries.lock() = vec![entry(a.key(), &a, None), entry(b.key(), &b, None)];
    arb.restart().adopt_from_keeper(place).unwrap();
    let avail = arb.avail.read();
    for d in 0..2 {
        assert!(
            avail.device(d).is_some_and(|s| s.drain.is_some()),
            "device {d} drained again"
        );
    }
    drop(avail);
    let kept = kept.lock().clone();
    assert!(
        kept.contains(&a.key()) && kept.contains(&b.key()),
        "both drains kept: {kept:?}"
    );
}

/// A kept publication of a lease taken back is published again (same id and name, a
/// read-only reopen of its sealed memfd for importers) with its kept import of a session
/// taken back; a publication of a lease not taken back and an import of a session not taken
/// back are let go (their records removed).
#[test]
fn kept_publications_and_imports_come_back_with_their_lease_and_session() {
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    arb.set_quota("alpha", crate::arbiter::tests::quota(64 * MIB))
        .unwrap();
    let session = Uuid::new_v4();
    let lease = lease_record(session, "alpha", 0, Some(&arb.devices.uuid(0)));
    let fd = memfd(2 * MIB);
    crate::sharing::seal_read_only(&crate::device::SharedFd::new(fd.try_clone().unwrap())).unwrap();
    let publication = |lease: &str, name: &str| PublicationRecord {
        v: RECORD_VERSION,
        id: Uuid::new_v4().to_string(),
        lease: lease.into(),
        publisher: "alpha".into(),
        name: Some(name.into()),
        readers: vec![],
        published_unix_ms: 1_764_800_000_000,
    };
    let kept_pub = publication(&lease.id, "w");
    let orphan_pub = publication(&Uuid::new_v4().to_string(), "gone");
    let import = |session: Uuid| ImportRecord {
        v: RECORD_VERSION,
        id: Uuid::new_v4().to_string(),
        publication: kept_pub.id.clone(),
        tenant: "alpha".into(),
        session: session.to_string(),
        pid: Some(std::process::id()),
        created_unix_ms: 0,
        recipients: vec![],
    };
    let kept_import = import(session);
    let orphan_import = import(Uuid::new_v4());
    let place = MemPlace::default();
    let removed = place.removed.clone();
    *place.entries.lock() = vec![
        entry(
            format!("session/{session}"),
            &session_record(session, "alpha"),
            None,
        ),
        entry(lease.key(), &lease, Some(fd)),
        entry(kept_pub.key(), &kept_pub, None),
        entry(orphan_pub.key(), &orphan_pub, None),
        entry(kept_import.key(), &kept_import, None),
        entry(orphan_import.key(), &orphan_import, None),
    ];
    arb.restart().adopt_from_keeper(place).unwrap();
    let shared = arb.views().shared(Some("alpha"));
    assert_eq!(shared.len(), 1, "{shared:?}");
    let p = &shared[0];
    assert_eq!(
        (p.id.to_string(), p.name.as_deref(), p.enforced),
        (kept_pub.id.clone(), Some("w"), true)
    );
    let imports: Vec<String> = p.imports.iter().map(|i| i.id.to_string()).collect();
    assert_eq!(imports, std::slice::from_ref(&kept_import.id));
    let mut removed = removed.lock().clone();
    removed.sort();
    let mut expected = vec![orphan_pub.key(), orphan_import.key()];
    expected.sort();
    assert_eq!(removed, expected);
    // A new import finds the name again.
    let st = arb.lock();
    let pid = st.shared().visible("alpha", "w", "alpha").map(|p| p.id);
    drop(st);
    assert_eq!(pid.map(|p| p.to_string()), Some(kept_pub.id.clone()));
}

/// A kept 2 MiB quarantine of tenant "alpha" on device 0 (block `block_id`) for this
/// process, as started at `pid_start`.
fn quarantine_of_this_process(arb: &Arbiter, pid_start: u64, block_id: u64) -> QuarantineRecord {
    QuarantineRecord {
        v: RECORD_VERSION,
        lease: Uuid::new_v4().to_string(),
        tenant: "alpha".into(),
        device: 0,
        bytes: 2 * MIB,
        block_id,
        kind: "host-memfd".into(),
        pid: Some(std::process::id()),
        pid_start: Some(pid_start),
        destroy: false,
        device_uuid: Some(arb.devices.uuid(0)),
        reached: vec![],
        retained_by: None,
    }
}

/// A kept quarantine is taken back only while its process is the one that started when
/// the quarantine was made: the same pid with another start time (a reused pid) is not
/// its holder, and its memory is let go.
#[test]
fn a_quarantine_whose_pid_started_at_another_time_is_let_go() {
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    arb.set_quota("alpha", crate::arbiter::tests::quota(64 * MIB))
        .unwrap();
    let start = crate::process::start_ticks(std::process::id()).unwrap();
    let quarantine = |pid_start| quarantine_of_this_process(&arb, pid_start, rand::random());
    let (same, reused) = (quarantine(start), quarantine(start + 1));
    let place = MemPlace::default();
    let removed = place.removed.clone();
    *place.entries.lock() = vec![
        entry(same.key(), &same, Some(memfd(2 * MIB))),
        entry(reused.key(), &reused, Some(memfd(2 * MIB))),
    ];
    arb.restart().adopt_from_keeper(place).unwrap();
    let held: Vec<String> = arb
        .views()
        .quarantined()
        .into_iter()
        .map(|q| q.lease.to_string())
        .collect();
    assert_eq!(held, std::slice::from_ref(&same.lease));
    assert_eq!(*removed.lock(), [reused.key()]);
    assert_eq!(
        arb.views().tenant("alpha").unwrap().usage.quarantined_bytes,
        2 * MIB
    );
}

/// Two kept quarantines of one block (written by a broker that did not remove the first
/// when the block was leased again) make one block: one is taken back, the other let go;
/// one that cannot (its pid started at another time) does not stand
/// in the way of one that can.
#[test]
fn two_quarantines_of_one_block_make_one() {
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    arb.set_quota("alpha", crate::arbiter::tests::quota(64 * MIB))
        .unwrap();
    let start = crate::process::start_ticks(std::process::id()).unwrap();
    let block_id = rand::random();
    let quarantine = |pid_start| quarantine_of_this_process(&arb, pid_start, block_id);
    let (reused, first, second) = (quarantine(start + 1), quarantine(start), quarantine(start));
    let memory = memfd(2 * MIB);
    let copy = || Some(memory.try_clone().unwrap());
    let place = MemPlace::default();
    let removed = place.removed.clone();
    *place.entries.lock() = vec![
        entry(reused.key(), &reused, copy()),
        entry(first.key(), &first, copy()),
        entry(second.key(), &second, copy()),
    ];
    arb.restart().adopt_from_keeper(place).unwrap();
    let held: Vec<String> = arb
        .views()
        .quarantined()
        .into_iter()
        .map(|q| q.lease.to_string())
        .collect();
    // Whichever of the two came first (records come in no set order).
    let (taken, other) = match held.as_slice() {
        [h] if *h == first.lease => (&first, &second),
        [h] if *h == second.lease => (&second, &first),
        _ => panic!("one of the two is taken back: {held:?}"),
    };
    assert_eq!(taken.block_id, other.block_id);
    let mut gone = removed.lock().clone();
    gone.sort();
    let mut want = vec![reused.key(), other.key()];
    want.sort();
    assert_eq!(gone, want);
    assert_eq!(
        arb.views().tenant("alpha").unwrap().usage.quarantined_bytes,
        2 * MIB
    );
}

/// A kept block held for importers comes back counted to its publisher as quarantined,
/// with its publication (by id, unpublished, a read-only reopen of its sealed memfd),
/// the kept import of a session taken back and the lingering import whose process lives
/// (same pid and start time); a lingering import whose pid started at another time, and a
/// held block no import was taken back for, are let go (records removed, memory freed).
/// When the last importer lets go, the block goes and its record with it.
#[test]
fn kept_held_blocks_come_back_with_their_importers() {
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    for t in ["alpha", "beta"] {
        arb.set_quota(t, crate::arbiter::tests::quota(64 * MIB))
            .unwrap();
    }
    let pid = std::process::id();
    let start = crate::process::start_ticks(pid).unwrap();
    let session = Uuid::new_v4();
    let publication = Uuid::new_v4().to_string();
    let held = |lease: Uuid, publication: Option<&str>| HeldRecord {
        v: RECORD_VERSION,
        lease: lease.to_string(),
        tenant: "alpha".into(),
        device: 0,
        bytes: 2 * MIB,
        block_id: rand::random(),
        kind: "host-memfd".into(),
        publication: publication.map(|id| HeldPublicationRecord {
            id: id.into(),
            readers: vec!["beta".into()],
            published_unix_ms: 1_764_800_000_000,
        }),
        waiters: vec![],
        recipients: vec![],
        timeout: false,
        destroy: true,
        device_uuid: Some(arb.devices.uuid(0)),
        reached: vec![],
    };
    let (lease, idle) = (Uuid::new_v4(), Uuid::new_v4());
    let kept_held = held(lease, Some(&publication));
    let idle_held = held(idle, Some(&Uuid::new_v4().to_string()));
    let sealed = || {
        let fd = memfd(2 * MIB);
        crate::sharing::seal_read_only(&crate::device::SharedFd::new(fd.try_clone().unwrap()))
            .unwrap();
        fd
    };
    let import = ImportRecord {
        v: RECORD_VERSION,
        id: Uuid::new_v4().to_string(),
        publication: publication.clone(),
        tenant: "beta".into(),
        session: session.to_string(),
        pid: Some(pid),
        created_unix_ms: 0,
        recipients: vec![],
    };
    let lingering = |start: u64| LingeringRecord {
        v: RECORD_VERSION,
        id: Uuid::new_v4().to_string(),
        publication: publication.clone(),
        tenant: "beta".into(),
        session: Uuid::new_v4().to_string(),
        pid: Some(pid),
        created_unix_ms: 0,
        waiters: vec![ProcessRecord {
            pid,
            start: Some(start),
        }],
        timeout: false,
    };
    let (live, reused) = (lingering(start), lingering(start + 1));
    let place = MemPlace::default();
    let removed = place.removed.clone();
    *place.entries.lock() = vec![
        entry(
            format!("session/{session}"),
            &session_record(session, "beta"),
            None,
        ),
        entry(kept_held.key(), &kept_held, Some(sealed())),
        entry(idle_held.key(), &idle_held, Some(sealed())),
        entry(import.key(), &import, None),
        entry(live.key(), &live, None),
        entry(reused.key(), &reused, None),
    ];
    let report = arb.restart().adopt_from_keeper(place).unwrap();
    assert_eq!(
        (
            report.held_adopted,
            report.held_let_go,
            report.lingering_adopted,
            report.lingering_ended
        ),
        (1, 1, 1, 1),
        "the report counts held blocks and lingering imports taken back and let go"
    );
    let usage = |t: &str| arb.views().tenant(t).unwrap().usage;
    assert_eq!(
        (
            usage("alpha").quarantined_bytes,
            usage("beta").quarantined_bytes
        ),
        (2 * MIB, 0),
        "held for its importers, counted to the publisher"
    );
    let shared = arb.views().shared(Some("alpha"));
    assert_eq!(shared.len(), 1, "{shared:?}");
    let p = &shared[0];
    assert_eq!(
        (p.id.to_string(), p.name.as_deref(), p.lease, p.enforced),
        (publication.clone(), None, None, true)
    );
    let mut imports: Vec<(String, bool)> = p
        .imports
        .iter()
        .map(|i| (i.id.to_string(), i.lingering))
        .collect();
    imports.sort();
    let mut want = vec![(import.id.clone(), false), (live.id.clone(), true)];
    want.sort();
    assert_eq!(imports, want);
    let mut gone = removed.lock().clone();
    gone.sort();
    let mut want = vec![reused.key(), idle_held.key()];
    want.sort();
    assert_eq!(gone, want);
    arb.lock().check_invariant().unwrap();

    // The importers let go: the block is freed and uncharged, its record removed.
    let (import_id, live_id) = (import.id.parse().unwrap(), live.id.parse().unwrap());
    arb.lock().import_waiter_gone(live_id, Some(pid));
    arb.lock().import_let_go(import_id, Ending::Cache);
    assert_eq!(usage("alpha").quarantined_bytes, 0);
    assert!(arb.views().shared(Some("alpha")).is_empty());
    assert!(removed.lock().contains(&kept_held.key()));
    arb.lock().check_invariant().unwrap();
}

/// A block held for a process the broker could not see into (pid 0: another pid
/// namespace) comes back held for it, as it was before the restart: nothing can tell it
/// has exited, so its memory stays charged rather than freed under it.
#[test]
fn a_block_held_for_a_process_in_another_pid_namespace_comes_back_held() {
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    arb.set_quota("alpha", crate::arbiter::tests::quota(64 * MIB))
        .unwrap();
    let held = HeldRecord {
        v: RECORD_VERSION,
        lease: Uuid::new_v4().to_string(),
        tenant: "alpha".into(),
        device: 0,
        bytes: 2 * MIB,
        block_id: rand::random(),
        kind: "host-memfd".into(),
        publication: None,
        waiters: vec![ProcessRecord {
            pid: 0,
            start: None,
        }],
        recipients: vec![],
        timeout: false,
        destroy: true,
        device_uuid: Some(arb.devices.uuid(0)),
        reached: vec![],
    };
    let place = MemPlace::default();
    let removed = place.removed.clone();
    *place.entries.lock() = vec![entry(held.key(), &held, Some(memfd(2 * MIB)))];
    let report = arb.restart().adopt_from_keeper(place).unwrap();
    assert_eq!((report.held_adopted, report.held_let_go), (1, 0));
    assert_eq!(
        arb.views().tenant("alpha").unwrap().usage.quarantined_bytes,
        2 * MIB
    );
    assert!(removed.lock().is_empty(), "{:?}", removed.lock());
    arb.lock().check_invariant().unwrap();
}

/// A crash between a quarantine's record and its lease's end leaves both records, with
/// one block (the same descriptor): the block is counted once as the broker's device
/// memory at the start, not once per record (else the broker promises bytes the card
/// does not have).
#[tokio::test]
async fn a_block_kept_under_its_lease_and_its_quarantine_is_counted_once() {
    let (arb, _outside, _dir) = crate::arbiter::tests::fake_cuda_fixture(ArbiterConfig::default());
    arb.set_quota("alpha", crate::arbiter::tests::quota(64 * MIB))
        .unwrap();
    let pid = std::process::id();
    let lease = lease_record(Uuid::new_v4(), "alpha", 0, Some(&arb.devices.uuid(0)));
    let quarantine = QuarantineRecord {
        v: RECORD_VERSION,
        lease: lease.id.clone(),
        tenant: "alpha".into(),
        device: 0,
        bytes: 2 * MIB,
        block_id: lease.block_id,
        kind: "host-memfd".into(),
        pid: Some(pid),
        pid_start: crate::process::start_ticks(pid),
        destroy: false,
        device_uuid: Some(arb.devices.uuid(0)),
        reached: vec![],
        retained_by: None,
    };
    let fd = memfd(2 * MIB);
    let place = MemPlace::default();
    *place.entries.lock() = vec![
        entry(lease.key(), &lease, Some(fd.try_clone().unwrap())),
        entry(quarantine.key(), &quarantine, Some(fd)),
    ];
    let report = arb.restart().adopt_from_keeper(place).unwrap();
    assert_eq!(report.leases_reclaimed, 1, "its end was kept");
    assert_eq!(
        arb.lock().pools()[0].leasable(),
        56 * MIB + 2 * MIB,
        "the block is the broker's once"
    );
}

/// A kept lease names the processes outside its session that fetched its descriptor: a
/// restarted broker holds its memory for those that live with the start time recorded
/// (not for a later process of a recorded pid) when the lease ends, charged to its tenant
/// and kept (a held record with their start times), until they exit. A recipient of the
/// restarted broker is named in the lease's record again at once.
#[tokio::test]
async fn a_kept_leases_recipients_that_live_hold_its_memory_when_it_ends() {
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    arb.set_quota("alpha", crate::arbiter::tests::quota(64 * MIB))
        .unwrap();
    let sleeper = || {
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap()
    };
    let (mut live, mut later) = (sleeper(), sleeper());
    let start_of = |c: &std::process::Child| crate::process::start_ticks(c.id()).unwrap();
    let session = Uuid::new_v4();
    let mut lease = lease_record(session, "alpha", 0, Some(&arb.devices.uuid(0)));
    lease.recipients = vec![
        ProcessRecord {
            pid: live.id(),
            start: Some(start_of(&live)),
        },
        // Its pid was another process's when the record was written.
        ProcessRecord {
            pid: later.id(),
            start: Some(start_of(&later) + 1),
        },
    ];
    let place = MemPlace::default();
    let records = place.records.clone();
    *place.entries.lock() = vec![
        entry(
            format!("session/{session}"),
            &session_record(session, "alpha"),
            None,
        ),
        entry(lease.key(), &lease, Some(memfd(2 * MIB))),
    ];
    let report = arb.restart().adopt_from_keeper(place).unwrap();
    assert_eq!(report.leases_adopted, 1);
    let id: Uuid = lease.id.parse().unwrap();
    // The later process fetches the descriptor now: the record names it, as it is.
    assert_eq!(
        arb.fd_delivering(id, Some(later.id())),
        crate::arbiter::Recipient::Added
    );
    let named = |key: &str| -> Vec<(u64, Option<u64>)> {
        let r = records.lock().get(key).cloned().unwrap_or_default();
        let list = r
            .get("recipients")
            .and_then(|l| l.as_array().cloned())
            .unwrap_or_default();
        list.iter()
            .map(|p| (p["pid"].as_u64().unwrap(), p["start"].as_u64()))
            .collect()
    };
    let mut want = vec![
        (u64::from(live.id()), Some(start_of(&live))),
        (u64::from(later.id()), Some(start_of(&later))),
    ];
    want.sort();
    assert_eq!(named(&lease.key()), want);

    arb.release("alpha", id).unwrap();
    let q = arb.views().quarantined();
    assert_eq!(q.len(), 1, "{q:?}");
    let mut holders = vec![live.id(), later.id()];
    holders.sort();
    assert_eq!(
        (q[0].lease, q[0].bytes, &q[0].holders),
        (id, 2 * MIB, &holders)
    );
    assert_eq!(
        arb.views().tenant("alpha").unwrap().usage.quarantined_bytes,
        2 * MIB
    );
    assert_eq!(named(&format!("held/{id}")), want, "the held block is kept");
    assert!(!records.lock().contains_key(&lease.key()));

    for c in [&mut live, &mut later] {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !arb.views().quarantined().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        arb.views().quarantined().is_empty(),
        "let go once they exited"
    );
    assert_eq!(
        arb.views().tenant("alpha").unwrap().usage.quarantined_bytes,
        0
    );
    assert!(!records.lock().contains_key(&format!("held/{id}")));
    arb.lock().check_invariant().unwrap();
}

/// The processes a kept block's descriptor reached (a lease's, a quarantine's) come back
/// with it while they live with the start time recorded, each with its tenant and where
/// it runs now: a free after the restart checks for them (and charges the tenant that
/// answers) as one before it would. A later process of a recorded pid is not one of them.
#[test]
fn a_kept_blocks_reached_processes_that_live_come_back_with_their_places() {
    use crate::keeper::records::ReachedRecord;
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    for t in ["alpha", "beta"] {
        arb.set_quota(t, crate::arbiter::tests::quota(64 * MIB))
            .unwrap();
    }
    let sleeper = || {
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap()
    };
    let mut kids = [sleeper(), sleeper(), sleeper()];
    let [own, importer, later] = [0, 1, 2].map(|i| kids[i].id());
    let start = |pid: u32| crate::process::start_ticks(pid).unwrap();
    let reached = vec![
        ReachedRecord {
            pid: own,
            start: Some(start(own)),
            tenant: None,
        },
        ReachedRecord {
            pid: later,
            start: Some(start(later) + 1),
            tenant: None,
        },
        ReachedRecord {
            pid: importer,
            start: Some(start(importer)),
            tenant: Some("beta".into()),
        },
    ];
    let session = Uuid::new_v4();
    let mut lease = lease_record(session, "alpha", 0, Some(&arb.devices.uuid(0)));
    lease.reached = reached.clone();
    let pid = std::process::id();
    let quarantine = QuarantineRecord {
        v: RECORD_VERSION,
        lease: Uuid::new_v4().to_string(),
        tenant: "alpha".into(),
        device: 0,
        bytes: 2 * MIB,
        block_id: rand::random(),
        kind: "host-memfd".into(),
        pid: Some(pid),
        pid_start: crate::process::start_ticks(pid),
        destroy: false,
        device_uuid: Some(arb.devices.uuid(0)),
        reached,
        retained_by: None,
    };
    let place = MemPlace::default();
    *place.entries.lock() = vec![
        entry(
            format!("session/{session}"),
            &session_record(session, "alpha"),
            None,
        ),
        entry(lease.key(), &lease, Some(memfd(2 * MIB))),
        entry(quarantine.key(), &quarantine, Some(memfd(2 * MIB))),
    ];
    arb.restart().adopt_from_keeper(place).unwrap();
    let st = arb.lock();
    let lease_id: Uuid = lease.id.parse().unwrap();
    let quarantined: Uuid = quarantine.lease.parse().unwrap();
    for r in [
        &st.leases().get(&lease_id).unwrap().block.reached,
        &st.quarantine().get(&quarantined).unwrap().block.reached,
    ] {
        assert_eq!(r.pids(), [own, importer]);
        let starts: Vec<Option<u64>> = r
            .places()
            .iter()
            .map(|p| p.as_ref().and_then(|p| p.start))
            .collect();
        assert_eq!(starts, [Some(start(own)), Some(start(importer))]);
        // Kept by the importer alone: its tenant answers.
        assert_eq!(r.answers_for(&[importer], "alpha"), "beta");
        assert_eq!(r.answers_for(&[own], "alpha"), "alpha");
    }
    drop(st);
    for k in &mut kids {
        k.kill().unwrap();
        k.wait().unwrap();
    }
}

/// A 2 MiB memfd sealed read-only, as a published lease's block is.
fn sealed_memfd() -> OwnedFd {
    let fd = memfd(2 * MIB);
    crate::sharing::seal_read_only(&crate::device::SharedFd::new(fd.try_clone().unwrap())).unwrap();
    fd
}

/// The records of a lease of tenant alpha on `session`, its publication, and an import of
/// it by this process on the same session whose descriptor reached `recipients`.
fn published_and_imported(
    arb: &Arbiter,
    session: Uuid,
    recipients: Vec<ProcessRecord>,
) -> (LeaseRecord, PublicationRecord, ImportRecord) {
    let lease = lease_record(session, "alpha", 0, Some(&arb.devices.uuid(0)));
    let publication = PublicationRecord {
        v: RECORD_VERSION,
        id: Uuid::new_v4().to_string(),
        lease: lease.id.clone(),
        publisher: "alpha".into(),
        name: Some("w".into()),
        readers: vec![],
        published_unix_ms: 1_764_800_000_000,
    };
    let import = ImportRecord {
        v: RECORD_VERSION,
        id: Uuid::new_v4().to_string(),
        publication: publication.id.clone(),
        tenant: "alpha".into(),
        session: session.to_string(),
        pid: Some(std::process::id()),
        created_unix_ms: 0,
        recipients,
    };
    (lease, publication, import)
}

/// A kept import names the processes outside its session that fetched its descriptor: a
/// restarted broker lets the import linger for the one that lives (same start time) when
/// its holder lets go, kept as lingering, until that process is gone.
#[test]
fn a_kept_imports_recipient_that_lives_keeps_it_lingering_when_let_go() {
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    arb.set_quota("alpha", crate::arbiter::tests::quota(64 * MIB))
        .unwrap();
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let child_pid = child.id();
    let session = Uuid::new_v4();
    let (lease, publication, import) = published_and_imported(
        &arb,
        session,
        vec![ProcessRecord {
            pid: child_pid,
            start: crate::process::start_ticks(child_pid),
        }],
    );
    let fd = sealed_memfd();
    let place = MemPlace::default();
    let records = place.records.clone();
    *place.entries.lock() = vec![
        entry(
            format!("session/{session}"),
            &session_record(session, "alpha"),
            None,
        ),
        entry(lease.key(), &lease, Some(fd)),
        entry(publication.key(), &publication, None),
        entry(import.key(), &import, None),
    ];
    arb.restart().adopt_from_keeper(place).unwrap();
    let id: Uuid = import.id.parse().unwrap();
    // Another process fetches it now: the import's record names it at once.
    let mut other = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    assert_eq!(
        arb.fd_delivering(id, Some(other.id())),
        crate::arbiter::Recipient::Added
    );
    let named: Vec<u64> = records.lock()[&import.key()]["recipients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_u64().unwrap())
        .collect();
    let mut want = vec![u64::from(child_pid), u64::from(other.id())];
    want.sort();
    assert_eq!(named, want);
    other.kill().unwrap();
    other.wait().unwrap();
    arb.lock().import_let_go(id, Ending::Cache);
    let lingering = |arb: &Arbiter| -> Vec<bool> {
        arb.views()
            .shared(Some("alpha"))
            .iter()
            .flat_map(|p| p.imports.iter().map(|i| i.lingering))
            .collect()
    };
    assert_eq!(lingering(&arb), [true], "lingers for the recipient");
    let kept = records.lock()[&format!("lingering/{id}")].clone();
    let waiting: Vec<u64> = kept["waiters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_u64().unwrap())
        .collect();
    assert!(waiting.contains(&u64::from(child_pid)), "{kept}");
    child.kill().unwrap();
    child.wait().unwrap();
    for pid in [child_pid, other.id()] {
        arb.lock().import_waiter_gone(id, Some(pid));
    }
    assert!(lingering(&arb).is_empty(), "ended once they were gone");
    arb.lock().check_invariant().unwrap();
}

/// A lingering import's record names when each process it waits for started, those that
/// fetched its descriptor too: after a restart, a later process given the pid of the one
/// that fetched it does not keep the publisher's held block charged (the same process
/// does). Without the start time, any process of that pid kept it until it exited.
#[test]
fn a_lingering_imports_recipient_whose_pid_was_reused_does_not_keep_it_after_a_restart() {
    let child = KillOnDrop(
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id();
    let start = crate::process::start_ticks(pid).unwrap();
    assert_eq!(lingering_restart(pid, start), 2 * MIB, "the same process");
    assert_eq!(
        lingering_restart(pid, start + 1),
        0,
        "a later process of the pid"
    );
}

/// Kills and reaps a child however the test ends.
struct KillOnDrop(std::process::Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A broker takes back a publication and its import, the import's descriptor reaches
/// process `pid` (recorded as started at `start`), its holder lets go (it lingers for
/// `pid`) and the publisher's lease ends (its block held for the import); a second
/// broker starts from what the first kept. Returns the publisher's quarantined bytes there.
fn lingering_restart(pid: u32, start: u64) -> u64 {
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    arb.set_quota("alpha", crate::arbiter::tests::quota(64 * MIB))
        .unwrap();
    let session = Uuid::new_v4();
    let (lease, publication, import) = published_and_imported(&arb, session, vec![]);
    let mut kept: std::collections::BTreeMap<String, serde_json::Value> = [
        (
            format!("session/{session}"),
            serde_json::to_value(session_record(session, "alpha")).unwrap(),
        ),
        (lease.key(), serde_json::to_value(&lease).unwrap()),
        (
            publication.key(),
            serde_json::to_value(&publication).unwrap(),
        ),
        (import.key(), serde_json::to_value(&import).unwrap()),
    ]
    .into();
    let place = MemPlace::default();
    let (records, removed) = (place.records.clone(), place.removed.clone());
    *place.entries.lock() = kept
        .iter()
        .map(|(k, v)| Entry {
            key: k.clone(),
            record: v.clone(),
            fd: (k == &lease.key()).then(sealed_memfd),
        })
        .collect();
    arb.restart().adopt_from_keeper(place).unwrap();
    let id: Uuid = import.id.parse().unwrap();
    assert_eq!(
        arb.lock().add_recipient(id, pid, Some(start)),
        crate::arbiter::Recipient::Added
    );
    arb.lock().import_let_go(id, Ending::Cache);
    arb.release("alpha", lease.id.parse().unwrap()).unwrap();
    assert_eq!(
        arb.views().tenant("alpha").unwrap().usage.quarantined_bytes,
        2 * MIB,
        "held for the lingering import"
    );
    // What the keeper holds now: what it had, less what was removed, with what was put.
    for k in removed.lock().iter() {
        kept.remove(k);
    }
    kept.extend(records.lock().clone());
    let waiters = &kept[&format!("lingering/{id}")]["waiters"];
    assert_eq!(
        waiters,
        &serde_json::json!([{"pid": pid, "start": start}]),
        "the lingering import names when its recipient started"
    );
    let next = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    next.set_quota("alpha", crate::arbiter::tests::quota(64 * MIB))
        .unwrap();
    let held = format!("held/{}", lease.id);
    kept.get_mut(&held).unwrap()["device_uuid"] = next.devices.uuid(0).into();
    let place = MemPlace::default();
    *place.entries.lock() = kept
        .iter()
        .map(|(k, v)| Entry {
            key: k.clone(),
            record: v.clone(),
            fd: (k == &held).then(sealed_memfd),
        })
        .collect();
    next.restart().adopt_from_keeper(place).unwrap();
    next.lock().check_invariant().unwrap();
    next.views()
        .tenant("alpha")
        .unwrap()
        .usage
        .quarantined_bytes
}

/// A place whose records outlive a start (as a keeper's do): each start reads them all
/// again, and what the broker removes is gone from the next.
#[derive(Clone, Default)]
struct LastingPlace(Arc<parking_lot::Mutex<std::collections::BTreeMap<String, serde_json::Value>>>);

impl Place for LastingPlace {
    fn describe(&self) -> String {
        "lasting memory".into()
    }
    fn dump(&self) -> Result<Vec<Entry>, KeeperError> {
        Ok(self
            .0
            .lock()
            .iter()
            .map(|(key, record)| Entry {
                key: key.clone(),
                record: record.clone(),
                fd: None,
            })
            .collect())
    }
    fn put(&self, key: String, record: serde_json::Value, _fd: Option<BorrowedFd<'_>>) {
        self.0.lock().insert(key, record);
    }
    fn remove(&self, key: String) {
        self.0.lock().remove(&key);
    }
    fn is_broken(&self) -> bool {
        false
    }
    fn sent(&self) -> u64 {
        0
    }
}

/// A damaged record kept under a key that names another record than its own (of every
/// kind) is refused at the start and removed by the key it was read under, so the next
/// start does not read it again. Removals used to go by a key rebuilt from the record,
/// which left it in the keeper for good.
#[test]
fn a_record_kept_under_another_records_key_is_refused_once_and_gone_at_the_next_start() {
    let id = || Uuid::new_v4().to_string();
    let (lease, publication, session) = (id(), id(), id());
    let mib2 = 2 * MIB;
    // Each record, and the key its own fields give it.
    let records = [
        (
            format!("session/{session}"),
            serde_json::json!({"v": 1, "id": session, "tenant": "gone", "name": "w",
                "pid": null, "uid": null, "pid_start": null, "resume_hash": null}),
        ),
        (
            format!("lease/{lease}"),
            serde_json::to_value(LeaseRecord {
                id: lease.clone(),
                ..lease_record(Uuid::new_v4(), "alpha", 0, None)
            })
            .unwrap(),
        ),
        (
            "drain/0".to_string(),
            serde_json::json!({"v": 1, "device": 0, "reason": "damaged"}),
        ),
        (
            format!("quarantine/{lease}"),
            serde_json::json!({"v": 1, "lease": lease, "tenant": "alpha", "device": 0,
                "bytes": mib2, "block_id": 1, "kind": "host-memfd", "pid": null}),
        ),
        (
            format!("publication/{publication}"),
            serde_json::json!({"v": 1, "id": publication, "lease": lease,
                "publisher": "alpha", "name": "w"}),
        ),
        (
            format!("import/{lease}"),
            serde_json::json!({"v": 1, "id": lease, "publication": publication,
                "tenant": "alpha", "session": session, "pid": null}),
        ),
        (
            format!("reservation/{lease}"),
            serde_json::json!({"v": 1, "id": lease, "tenant": "alpha", "session": session,
                "device": 0, "bytes": mib2, "pid": null}),
        ),
        (
            format!("reclaim/{lease}"),
            serde_json::json!({"v": 1, "lease": lease, "deadline_unix_ms": 0}),
        ),
        (
            format!("held/{lease}"),
            serde_json::json!({"v": 1, "lease": lease, "tenant": "alpha", "device": 0,
                "bytes": mib2, "block_id": 1, "kind": "host-memfd"}),
        ),
        (
            format!("lingering/{lease}"),
            serde_json::json!({"v": 1, "id": lease, "publication": publication,
                "tenant": "alpha", "session": session, "pid": null, "waiters": []}),
        ),
        (
            format!("stranded/{lease}"),
            serde_json::json!({"v": 1, "id": lease, "tenant": "alpha", "device": 0,
                "bytes": mib2, "holders": []}),
        ),
    ];
    let place = LastingPlace::default();
    let mut damaged = Vec::new();
    for (own_key, record) in records {
        // Readable under its own key: only the key it is kept under is wrong.
        assert!(
            crate::keeper::records::parse(&own_key, record.clone()).is_ok(),
            "{own_key}"
        );
        let (prefix, _) = own_key.split_once('/').unwrap();
        let key = match prefix {
            "drain" => "drain/1".to_string(),
            _ => format!("{prefix}/{}", Uuid::new_v4()),
        };
        place.put(key.clone(), record, None);
        damaged.push(key);
    }
    let arb = host_arbiter(64 * MIB, 2, ArbiterConfig::default());
    arb.set_quota("alpha", crate::arbiter::tests::quota(64 * MIB))
        .unwrap();
    let report = arb.restart().adopt_from_keeper(place.clone()).unwrap();
    assert_eq!(report.kept_records, damaged.len());
    let left: Vec<String> = place.0.lock().keys().cloned().collect();
    assert!(left.is_empty(), "still kept after the start: {left:?}");
    assert!(arb
        .avail
        .read()
        .device(0)
        .is_some_and(|s| s.drain.is_none()));

    let again = host_arbiter(64 * MIB, 2, ArbiterConfig::default());
    let report = again.restart().adopt_from_keeper(place).unwrap();
    assert_eq!(report.kept_records, 0, "read again at the next start");
}
