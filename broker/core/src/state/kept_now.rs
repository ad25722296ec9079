//! Everything a keeper holds for this state, as it is now: what a keeper that comes back
//! after it was lost (`keeper/link.rs`) is sent again, under the lock, so it holds exactly
//! what a keeper connected since the start would hold. Each kind of record pushed as an
//! `Effect::Keep` must be made here too (tested: `what_is_kept_now_is_what_the_changes_kept`).

use super::State;
use crate::effects::Keep;
use crate::kept::QuarantineRecord;
use uuid::Uuid;

impl State {
    /// A keep change for every live session, lease and quarantine (sessions first, so a
    /// keeper read back mid-way never holds a lease without its session).
    pub fn kept_now(&self) -> Vec<Keep> {
        let mut out =
            Vec::with_capacity(self.sessions.len() + self.leases.len() + self.quarantine.len());
        out.extend(self.sessions.iter().map(|s| Keep::Session(s.into())));
        out.extend(self.leases.iter().map(|l| self.lease_kept(l)));
        out.extend(
            self.quarantine
                .keys()
                .filter_map(|id| self.quarantine_kept(*id)),
        );
        // After their leases and sessions: publications, blocks held for importers (with
        // their publications), the imports kept (held by their session, or lingering),
        // session reservations, reclaim requests.
        out.extend(
            self.shared
                .pubs
                .keys()
                .filter_map(|id| self.publication_record(*id))
                .map(Keep::Publication),
        );
        out.extend(
            self.shared
                .held
                .keys()
                .filter_map(|lease| self.held_kept(*lease)),
        );
        for p in self.shared.pubs.values() {
            for i in p.imports.values().filter(|i| i.kept) {
                out.push(match i.lingering {
                    None => Keep::Import(self.import_record(p.id, i)),
                    Some(_) => match self.lingering_kept(i.id) {
                        Some(r) => Keep::Lingering(r),
                        None => continue,
                    },
                });
            }
        }
        // Freed memory processes outside the broker keep, charged to a tenant.
        out.extend(
            self.stranded
                .keys()
                .filter_map(|id| self.stranded_record(*id))
                .map(Keep::Stranded),
        );
        out.extend(
            self.reservations
                .iter()
                .filter(|r| r.claim.is_none())
                .map(|r| Keep::Reservation(r.into())),
        );
        out.extend(self.leases.iter().filter_map(|l| match l.state {
            crate::lease::LeaseState::ReclaimRequested { deadline_wall, .. } => {
                Some(Keep::Reclaim(super::reclaim_record(l.id, deadline_wall)))
            }
            crate::lease::LeaseState::Active => None,
        }));
        out
    }

    /// Quarantine `id`'s record and its block's descriptor, with the start time of its
    /// process as it was when the quarantine was made (never read again later: the pid
    /// may be another process's by then).
    pub(super) fn quarantine_kept(&self, id: Uuid) -> Option<Keep> {
        let q = self.quarantine.get(&id)?;
        let crate::memory::Handle::Fd {
            fd, block_id, kind, ..
        } = &q.block.handle;
        let record = QuarantineRecord {
            v: crate::kept::RECORD_VERSION,
            lease: id.to_string(),
            tenant: q.tenant.clone(),
            device: q.device,
            bytes: q.block.bytes(),
            block_id: *block_id,
            kind: match kind {
                crate::memory::MemoryKind::CudaVmm => "cuda-vmm",
                crate::memory::MemoryKind::HostMemfd => "host-memfd",
            }
            .into(),
            pid: q.pid,
            pid_start: q.pid_start,
            destroy: q.destroy,
            device_uuid: None,
            reached: q.block.reached.records(),
            retained_by: q.retained_by.map(|s| s.to_string()),
        };
        Some(Keep::Quarantine(record, fd.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::queue_tests::{quota, Core};
    use super::super::tests::ask;
    use super::super::Ending;
    use crate::effects::{Effect, Keep};
    use crate::kept;
    use crate::pool::Source;
    use crate::session::{Peer, Session};
    use std::collections::BTreeMap;
    use uuid::Uuid;

    const MIB: u64 = 1 << 20;

    /// What a keeper holds: records by key.
    type Mirror = BTreeMap<String, serde_json::Value>;

    /// Applies `changes` as a keeper does. No wildcard: a new kind of record must be
    /// handled here, and by `kept_now`.
    fn apply(kept: &mut Mirror, changes: impl IntoIterator<Item = Keep>) {
        for k in changes {
            match k {
                Keep::Session(r) => {
                    kept.insert(r.key(), serde_json::to_value(&r).unwrap());
                }
                Keep::SessionEnded(id) => {
                    kept.remove(&kept::session_key(&id));
                }
                Keep::Lease(r, _) => {
                    kept.insert(r.key(), serde_json::to_value(&r).unwrap());
                }
                Keep::LeaseEnded(id) => {
                    kept.remove(&kept::lease_key(&id));
                }
                Keep::Quarantine(r, _) => {
                    kept.insert(r.key(), serde_json::to_value(&r).unwrap());
                }
                Keep::QuarantineLifted(id) => {
                    kept.remove(&kept::quarantine_key(&id));
                }
                Keep::Publication(r) => {
                    kept.insert(r.key(), serde_json::to_value(&r).unwrap());
                }
                Keep::PublicationEnded(id) => {
                    kept.remove(&kept::publication_key(&id));
                }
                Keep::Import(r) => {
                    kept.insert(r.key(), serde_json::to_value(&r).unwrap());
                }
                Keep::ImportEnded(id) => {
                    kept.remove(&kept::import_key(&id));
                }
                Keep::Reservation(r) => {
                    kept.insert(r.key(), serde_json::to_value(&r).unwrap());
                }
                Keep::ReservationEnded(id) => {
                    kept.remove(&kept::reservation_key(&id));
                }
                Keep::Reclaim(r) => {
                    kept.insert(r.key(), serde_json::to_value(&r).unwrap());
                }
                Keep::ReclaimEnded(id) => {
                    kept.remove(&kept::reclaim_key(&id));
                }
                Keep::Held(r, _) => {
                    kept.insert(r.key(), serde_json::to_value(&r).unwrap());
                }
                Keep::HeldLetGo(id) => {
                    kept.remove(&kept::held_key(&id));
                }
                Keep::Lingering(r) => {
                    kept.insert(r.key(), serde_json::to_value(&r).unwrap());
                }
                Keep::LingeringEnded(id) => {
                    kept.remove(&kept::lingering_key(&id));
                }
                Keep::Stranded(r) => {
                    kept.insert(r.key(), serde_json::to_value(&r).unwrap());
                }
                Keep::StrandedLifted(id) => {
                    kept.remove(&kept::stranded_key(&id));
                }
            }
        }
    }

    fn keeps(effects: Vec<Effect>) -> Vec<Keep> {
        effects
            .into_iter()
            .filter_map(|e| match e {
                Effect::Keep { change } => Some(change),
                _ => None,
            })
            .collect()
    }

    fn open(c: &mut Core, tenant: &str, pid: u32) -> Uuid {
        let mut s = Session::new(
            Uuid::now_v7(),
            tenant,
            "w",
            Peer {
                pid: Some(pid),
                uid: Some(1000),
                unix: true,
            },
            None,
        );
        s.peer_start = Some(1000 + u64::from(pid));
        let id = s.id;
        c.st.open_session(s, 16).unwrap();
        id
    }

    fn grant(c: &mut Core, tenant: &str, session: Uuid, bytes: u64) -> Uuid {
        let a = ask(tenant, session, bytes, Some(0));
        let block = match c.st.reserve_grant(&a, 0).unwrap() {
            Source::Cached { block, .. } => block,
            Source::Fresh { .. } => c.block(bytes),
        };
        c.st.commit_grant(&a, 0, 0, block, false).unwrap().id
    }

    /// Sessions, leases (fresh and from the cache), quarantines and their lifts, a
    /// session's end: a keeper that applied every change holds exactly what `kept_now`
    /// makes at the end, record for record.
    #[test]
    fn what_is_kept_now_is_what_the_changes_kept() {
        let mut c = Core::new(1, 64 * MIB);
        c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
        c.st.set_quota("b", quota(64 * MIB, 0)).unwrap();
        c.st.set_keeping(true);
        let mut mirror = Mirror::new();
        let s1 = open(&mut c, "a", 7);
        let s2 = open(&mut c, "b", 8);
        let s3 = open(&mut c, "a", 9);
        let l1 = grant(&mut c, "a", s1, 4 * MIB);
        let l2 = grant(&mut c, "a", s1, 2 * MIB);
        let _l3 = grant(&mut c, "b", s2, 8 * MIB);
        let l4 = grant(&mut c, "a", s3, 2 * MIB);
        c.st.end_lease(l1, Ending::Quarantine { pid: Some(7) });
        c.st.end_lease(l2, Ending::Cache);
        // From the cache.
        let l5 = grant(&mut c, "a", s3, 2 * MIB);
        c.st.end_lease(l4, Ending::Quarantine { pid: Some(9) });
        c.st.lift_quarantine(l4, false);
        c.st.end_session(s2, None, true);
        // A publication, an import whose descriptor left (kept) and one whose did not, a
        // process reservation, a reclaim request.
        let fd = {
            let crate::memory::Handle::Fd { fd, .. } =
                &c.st.leases().get(&l5).unwrap().block.handle;
            fd.clone()
        };
        let wall = c.st.clock().wall;
        let p =
            c.st.publish(super::super::NewPublication {
                lease: l5,
                publisher: "a".into(),
                name: "w".into(),
                readers: Default::default(),
                published_at: wall,
                fd,
                enforced: false,
                fd_counted: None,
            })
            .unwrap();
        let i = c.st.import(p, "a", s1, Some(7)).unwrap();
        c.st.import_delivered(i);
        c.st.import(p, "a", s3, Some(9)).unwrap();
        let mut r = ask("a", s3, 4 * MIB, Some(0));
        r.process = Some(Default::default());
        c.st.grant_process(&r, 0).unwrap();
        assert!(c
            .st
            .adopt_reclaim(l5, wall + std::time::Duration::from_secs(30)));
        apply(&mut mirror, keeps(c.st.take_effects().into_vec()));
        c.st.check_invariant().unwrap();
        assert!(
            mirror
                .keys()
                .any(|k| k.starts_with(kept::QUARANTINE_PREFIX)),
            "{mirror:?}"
        );
        let mut now = Mirror::new();
        apply(&mut now, c.st.kept_now());
        assert_eq!(now, mirror);
        assert_eq!(
            now.len(),
            2 + 1 + 1 + 4,
            "two sessions, a lease, a quarantine, a publication, an import, a reservation, a reclaim request"
        );
    }

    /// A quarantine keeps the start time its process had when it was made (its session's
    /// record): the push at the session's end and a relinked keeper's refill both carry
    /// it, so neither leaves it to a later look at `/proc`, where a reused pid would be
    /// taken for the holder.
    #[test]
    fn a_quarantine_keeps_its_process_start_from_when_it_was_made() {
        let mut c = Core::new(1, 64 * MIB);
        c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
        c.st.set_keeping(true);
        let s = open(&mut c, "a", 7);
        let l = grant(&mut c, "a", s, 4 * MIB);
        let revoked = grant(&mut c, "a", s, 4 * MIB);
        // Revoked while its session lives, then the session ends with its process alive.
        c.st.end_lease(revoked, Ending::Quarantine { pid: Some(7) });
        c.st.end_session(s, None, false);
        let pushed: Vec<kept::QuarantineRecord> = keeps(c.st.take_effects().into_vec())
            .into_iter()
            .filter_map(|k| match k {
                Keep::Quarantine(r, _) => Some(r),
                _ => None,
            })
            .collect();
        let starts = |rs: &[kept::QuarantineRecord]| {
            let mut v: Vec<(String, Option<u32>, Option<u64>)> = rs
                .iter()
                .map(|r| (r.lease.clone(), r.pid, r.pid_start))
                .collect();
            v.sort();
            v
        };
        let mut want = vec![
            (l.to_string(), Some(7), Some(1007)),
            (revoked.to_string(), Some(7), Some(1007)),
        ];
        want.sort();
        assert_eq!(starts(&pushed), want, "pushed as they were made");
        let refilled: Vec<kept::QuarantineRecord> =
            c.st.kept_now()
                .into_iter()
                .filter_map(|k| match k {
                    Keep::Quarantine(r, _) => Some(r),
                    _ => None,
                })
                .collect();
        assert_eq!(starts(&refilled), want, "a relinked keeper gets the same");
    }

    /// A published lease ends while imported: its block is held for the importers and
    /// kept (`held/`, with its publication and a copy of its descriptor) before the lease's
    /// end is; an importer's session ends while its process lives: its import lingers and
    /// is kept (`lingering/`, the process's start from its session) before its `import/`
    /// record goes. A keeper that applied every change holds what `kept_now` makes at
    /// each step, and nothing of them once the last importer let go.
    #[test]
    fn held_blocks_and_lingering_imports_are_kept_until_let_go() {
        let mut c = Core::new(1, 64 * MIB);
        c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
        c.st.set_quota("b", quota(64 * MIB, 0)).unwrap();
        c.st.set_keeping(true);
        let mut mirror = Mirror::new();
        let s1 = open(&mut c, "a", 7);
        let s2 = open(&mut c, "b", 8);
        let s3 = open(&mut c, "b", 9);
        let l1 = grant(&mut c, "a", s1, 4 * MIB);
        let fd = {
            let crate::memory::Handle::Fd { fd, .. } =
                &c.st.leases().get(&l1).unwrap().block.handle;
            fd.clone()
        };
        let wall = c.st.clock().wall;
        let p =
            c.st.publish(super::super::NewPublication {
                lease: l1,
                publisher: "a".into(),
                name: "w".into(),
                readers: ["b".to_string()].into_iter().collect(),
                published_at: wall,
                fd,
                enforced: false,
                fd_counted: None,
            })
            .unwrap();
        let i2 = c.st.import(p, "b", s2, Some(8)).unwrap();
        c.st.import_delivered(i2);
        let i3 = c.st.import(p, "b", s3, Some(9)).unwrap();
        c.st.import_delivered(i3);
        apply(&mut mirror, keeps(c.st.take_effects().into_vec()));

        // The publisher lets go: held for the importers, kept before the lease's end.
        c.st.end_lease(l1, Ending::Cache);
        let changes = keeps(c.st.take_effects().into_vec());
        let names: Vec<&str> = changes.iter().map(|k| k.name()).collect();
        assert_eq!(names, ["held", "lease-ended", "publication-ended"]);
        apply(&mut mirror, changes);
        let held = &mirror[&kept::held_key(&l1)];
        assert_eq!(held["publication"]["id"], p.to_string());
        assert_eq!(held["publication"]["readers"][0], "b");
        assert_eq!(held["bytes"], 4 * MIB);
        let mut now = Mirror::new();
        apply(&mut now, c.st.kept_now());
        assert_eq!(now, mirror);
        c.st.check_invariant().unwrap();

        // An importer's session ends while its process lives: the import lingers, kept.
        c.st.end_session(s2, None, false);
        let changes = keeps(c.st.take_effects().into_vec());
        let names: Vec<&str> = changes.iter().map(|k| k.name()).collect();
        assert_eq!(names, ["lingering", "import-ended", "session-ended"]);
        apply(&mut mirror, changes);
        let l = &mirror[&kept::lingering_key(&i2)];
        assert_eq!(l["waiters"], serde_json::json!([{"pid": 8, "start": 1008}]));
        let mut now = Mirror::new();
        apply(&mut now, c.st.kept_now());
        assert_eq!(now, mirror);

        // Its process exits, then the other importer's session ends with its process:
        // everything is let go, and the keeper holds none of it.
        c.st.import_waiter_gone(i2, Some(8));
        c.st.end_session(s3, None, true);
        let changes = keeps(c.st.take_effects().into_vec());
        let names: Vec<&str> = changes.iter().map(|k| k.name()).collect();
        assert_eq!(
            names,
            [
                "lingering-ended",
                // Its importer's process is gone, but the block names it until its free.
                "held",
                "import-ended",
                "held-let-go",
                "session-ended"
            ]
        );
        apply(&mut mirror, changes);
        assert!(
            !mirror.keys().any(|k| k.starts_with(kept::HELD_PREFIX)
                || k.starts_with(kept::LINGERING_PREFIX)
                || k.starts_with(kept::IMPORT_PREFIX)),
            "{mirror:?}"
        );
        let mut now = Mirror::new();
        apply(&mut now, c.st.kept_now());
        assert_eq!(now, mirror);
        assert_eq!(c.st.ledger().get("a").unwrap().usage.quarantined_bytes, 0);
        c.st.check_invariant().unwrap();
    }
    /// Memory a free left with processes outside the broker is kept while charged
    /// (`stranded/`, its holders' start times as the shell read them), changed as its
    /// holders exit, gone when lifted; a keeper that applied every change holds what
    /// `kept_now` makes at each step. The record read back is taken back by a restarted
    /// state: charged to the same tenant, watched, and lifted when its last holder exits.
    #[test]
    fn stranded_memory_is_kept_until_lifted_and_taken_back() {
        use super::super::stranded::AdoptedStranded;
        use crate::effects::Watch;
        use crate::memory::MemoryKind;
        let mut c = Core::new(1, 64 * MIB);
        c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
        c.st.set_keeping(true);
        let mut mirror = Mirror::new();
        let id = c.st.stranded("a", 0, 4 * MIB, [7, 8]).unwrap();
        let handle = kept::FileHandleRecord {
            handle_type: 1,
            bytes: vec![9; 12],
        };
        c.st.stranded_holders_started(
            id,
            Some(MemoryKind::HostMemfd),
            Some(handle.clone()),
            [(7, 1007), (8, 1008)],
        );
        let changes = keeps(c.st.take_effects().into_vec());
        let names: Vec<&str> = changes.iter().map(|k| k.name()).collect();
        assert_eq!(names, ["stranded", "stranded"]);
        apply(&mut mirror, changes);
        let r = &mirror[&kept::stranded_key(&id)];
        assert_eq!(r["tenant"], "a");
        assert_eq!(r["bytes"], 4 * MIB);
        assert_eq!(r["kind"], "host-memfd");
        assert_eq!(
            r["holders"],
            serde_json::json!([{"pid": 7, "start": 1007}, {"pid": 8, "start": 1008}])
        );
        assert_eq!(
            r["file_handle"],
            serde_json::json!({"handle_type": 1, "bytes": vec![9; 12]})
        );
        let mut now = Mirror::new();
        apply(&mut now, c.st.kept_now());
        assert_eq!(now, mirror);

        // One holder exits: the record names the other only.
        assert!(!c.st.stranded_holder_gone(id, 7));
        apply(&mut mirror, keeps(c.st.take_effects().into_vec()));
        assert_eq!(
            mirror[&kept::stranded_key(&id)]["holders"],
            serde_json::json!([{"pid": 8, "start": 1008}])
        );
        let mut now = Mirror::new();
        apply(&mut now, c.st.kept_now());
        assert_eq!(now, mirror);

        // A restarted state reads the record back and charges it again.
        let Ok(kept::Kept::Stranded(r)) = kept::parse(
            &kept::stranded_key(&id),
            mirror[&kept::stranded_key(&id)].clone(),
        ) else {
            panic!("{mirror:?}")
        };
        let mut d = Core::new(1, 64 * MIB);
        d.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
        let adopted = AdoptedStranded {
            id: r.id.parse().unwrap(),
            tenant: r.tenant.clone(),
            device: r.device,
            bytes: r.bytes,
            holders: r.holders.iter().map(|p| (p.pid, p.start)).collect(),
            recheck: r.recheck,
            kind: Some(MemoryKind::HostMemfd),
            stranded_at: std::time::UNIX_EPOCH
                + std::time::Duration::from_millis(r.stranded_unix_ms),
            file_handle: r.file_handle.clone(),
            watched: true,
        };
        assert_eq!(r.file_handle, Some(handle));
        let adopted_again = adopted.clone();
        d.st.adopt_stranded(adopted.clone()).unwrap();
        assert_eq!(
            d.st.ledger().get("a").unwrap().usage.quarantined_bytes,
            4 * MIB
        );
        let fx = d.st.take_effects().into_vec();
        assert!(
            fx.iter().any(|e| matches!(e, Effect::Watch { watch: Watch::Stranded { id: i, pid: 8 } } if *i == id)),
            "{fx:?}"
        );
        assert!(
            !fx.iter().any(|e| matches!(e, Effect::Keep { .. })),
            "{fx:?}"
        );
        assert!(d.st.adopt_stranded(adopted).is_err(), "taken back once");
        let mut again = Mirror::new();
        d.st.set_keeping(true);
        apply(&mut again, d.st.kept_now());
        assert_eq!(again, mirror, "a relinked keeper gets the same record");
        d.st.check_invariant().unwrap();
        assert!(d.st.stranded_holder_gone(id, 8));
        let changes = keeps(d.st.take_effects().into_vec());
        let names: Vec<&str> = changes.iter().map(|k| k.name()).collect();
        assert_eq!(names, ["stranded-lifted"]);
        assert_eq!(d.st.ledger().get("a").unwrap().usage.quarantined_bytes, 0);
        d.st.check_invariant().unwrap();

        // Taken back unwatched (the shell asks the kernel by its file handle): its
        // holder's exit leaves it charged; only the shell's word lifts it.
        let mut e = Core::new(1, 64 * MIB);
        e.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
        e.st.adopt_stranded(AdoptedStranded {
            watched: false,
            ..adopted_again
        })
        .unwrap();
        let fx = e.st.take_effects().into_vec();
        assert!(
            !fx.iter().any(|e| matches!(e, Effect::Watch { .. })),
            "{fx:?}"
        );
        assert!(!e.st.stranded_holder_gone(id, 8));
        assert_eq!(
            e.st.ledger().get("a").unwrap().usage.quarantined_bytes,
            4 * MIB
        );
        assert!(e.st.stranded_released(id));
        assert_eq!(e.st.ledger().get("a").unwrap().usage.quarantined_bytes, 0);
        e.st.check_invariant().unwrap();

        // The first state's last holder exits too: lifted, the keeper holds nothing.
        assert!(c.st.stranded_holder_gone(id, 8));
        apply(&mut mirror, keeps(c.st.take_effects().into_vec()));
        assert!(mirror.is_empty(), "{mirror:?}");
        c.st.check_invariant().unwrap();
    }

    /// A kept charge larger than its device (a damaged record: no free leaves more on a
    /// device than it has) is not taken back: charging it would wrap the tenant's and the
    /// device's counts, or leave the tenant unable to lease until a holder exits.
    #[test]
    fn a_kept_charge_larger_than_its_device_is_not_taken_back() {
        use super::super::stranded::AdoptedStranded;
        let mut d = Core::new(1, 64 * MIB);
        d.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
        let charge = |bytes: u64| AdoptedStranded {
            id: Uuid::new_v4(),
            tenant: "a".into(),
            device: 0,
            bytes,
            holders: [(7, Some(1007))].into_iter().collect(),
            recheck: false,
            kind: None,
            stranded_at: std::time::UNIX_EPOCH,
            file_handle: None,
            watched: true,
        };
        assert!(d.st.adopt_stranded(charge(u64::MAX)).is_err());
        assert!(d.st.adopt_stranded(charge(64 * MIB + 1)).is_err());
        assert_eq!(d.st.ledger().get("a").unwrap().usage.quarantined_bytes, 0);
        d.st.adopt_stranded(charge(64 * MIB)).unwrap();
        assert_eq!(
            d.st.ledger().get("a").unwrap().usage.quarantined_bytes,
            64 * MIB
        );
        d.st.check_invariant().unwrap();
    }
}
