//! Property test of the arbiter against a simple model of the ledger and the pools.
//!
//! A real [`Arbiter`] over simulated host devices (memfd memory objects) runs random sequences of operations: open session, acquire (no wait),
//! release (by the owner, or by another tenant), end a session as if its worker died,
//! set a quota, revoke a lease. Every request here is made with `wait = 0`, so the queue
//! is always empty between steps and the outcome of each request is fully determined:
//! the model predicts grant or refusal (and the status), and after every step the
//! arbiter's counters (per tenant, per device, the lease list, the files on "the device")
//! must equal the model's. At the end everything is released and every counter must be
//! exactly zero, and after `Process::release_all` (`arb.lifecycle()`) no file is left.

use gpu_broker::arbiter::{AcquireRequest, Arbiter, ArbiterConfig};
use gpu_broker::auth::Authenticator;
use gpu_broker::backend::{open_devices, BackendSpec};
use gpu_broker::config::{BackendChoice, Headroom};
use gpu_broker::device::Handle;
use gpu_broker::error::BrokerError;
use gpu_broker::ledger::{Quota, Tier};
use gpu_broker::session::{Peer, SessionEvent};
use proptest::prelude::*;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedReceiver;
use uuid::Uuid;

const MIB: u64 = 1 << 20;
const GRAN: u64 = 2 * MIB;
const MAX_REQUEST: u64 = 1 << 50;
const TENANTS: [&str; 3] = ["t0", "t1", "t2"];

#[derive(Clone, Debug)]
enum Op {
    Open {
        tenant: usize,
        /// The peer is this (live) process: ended leases are quarantined, not freed.
        live_peer: bool,
    },
    Acquire {
        session: usize,
        bytes: u64,
        device: Option<u32>,
        reclaimable: bool,
    },
    Release {
        lease: usize,
    },
    /// Another tenant tries to release the lease: NOT_FOUND, nothing changes.
    ReleaseForeign {
        lease: usize,
    },
    /// A release of a lease id nobody holds.
    ReleaseUnknown,
    /// The session ends as if its worker died (`Arbiter::end_session`).
    End {
        session: usize,
    },
    SetQuota {
        tenant: usize,
        quota: Quota,
    },
    Revoke {
        lease: usize,
    },
}

fn bytes_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 1u64..=48 * MIB,
        4 => (1u64..=24).prop_map(|n| n * GRAN),
        1 => Just(0u64),
        1 => Just(MAX_REQUEST + 1),
        1 => Just(u64::MAX),
        1 => Just(MAX_REQUEST),
    ]
}

fn quota_strategy() -> impl Strategy<Value = Quota> {
    (
        prop_oneof![3 => (0u64..=80).prop_map(|n| n * GRAN), 1 => 0u64..=160 * MIB],
        0u64..=100,
        -2i32..=2,
        prop_oneof![3 => Just(0u32), 1 => 1u32..=4],
        any::<bool>(),
    )
        .prop_map(|(limit, g_pct, priority, max_leases, over)| Quota {
            limit_bytes: limit,
            max_leases,
            priority,
            // Mostly a guarantee within the limit; sometimes one above it (refused).
            guaranteed_bytes: if over && g_pct > 90 {
                limit + GRAN
            } else {
                (limit / 100 * g_pct) / GRAN * GRAN
            },
            host_limit_bytes: 0,
            device_limit_bytes: Default::default(),
            turn_weight: 1,
        })
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..TENANTS.len(), any::<bool>())
            .prop_map(|(tenant, live_peer)| Op::Open { tenant, live_peer }),
        8 => (
            0usize..8,
            bytes_strategy(),
            prop_oneof![4 => Just(None), 1 => (0u32..3).prop_map(Some)],
            any::<bool>()
        )
            .prop_map(|(session, bytes, device, reclaimable)| Op::Acquire {
                session,
                bytes,
                device,
                reclaimable
            }),
        4 => (0usize..16).prop_map(|lease| Op::Release { lease }),
        1 => (0usize..16).prop_map(|lease| Op::ReleaseForeign { lease }),
        1 => Just(Op::ReleaseUnknown),
        1 => (0usize..8).prop_map(|session| Op::End { session }),
        2 => (0..TENANTS.len(), quota_strategy())
            .prop_map(|(tenant, quota)| Op::SetQuota { tenant, quota }),
        1 => (0usize..16).prop_map(|lease| Op::Revoke { lease }),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Code {
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Other,
}

fn code(e: &BrokerError) -> Code {
    match gpu_broker::grpc_status::code(e) {
        tonic::Code::InvalidArgument => Code::InvalidArgument,
        tonic::Code::NotFound => Code::NotFound,
        tonic::Code::ResourceExhausted => Code::ResourceExhausted,
        _ => Code::Other,
    }
}

#[derive(Debug, Default, Clone)]
struct MTenant {
    quota: Quota,
    held: u64,
    count: u32,
    quarantined: u64,
}

impl MTenant {
    /// What the limit and the guarantee are measured against: held and quarantined bytes
    /// (ended leases a live process of the tenant may still map stay in its hands).
    fn committed(&self) -> u64 {
        self.held + self.quarantined
    }
}

#[derive(Debug)]
struct MSession {
    id: Uuid,
    tenant: usize,
    live_peer: bool,
    alive: bool,
    events: UnboundedReceiver<SessionEvent>,
}

#[derive(Debug, Clone)]
struct MLease {
    id: Uuid,
    tenant: usize,
    session: usize,
    device: u32,
    bytes: u64,
}

#[derive(Debug, Default, Clone)]
struct MDevice {
    leasable: u64,
    leased: u64,
    quarantined: u64,
    count: u32,
}

struct Model {
    tenants: Vec<MTenant>,
    sessions: Vec<MSession>,
    leases: Vec<MLease>,
    devices: Vec<MDevice>,
}

impl Model {
    fn unused_guarantee_of_others(&self, t: usize) -> u64 {
        self.tenants
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != t)
            .map(|(_, m)| m.quota.guaranteed_bytes.saturating_sub(m.committed()))
            .sum()
    }

    fn available(&self, d: usize) -> u64 {
        let dev = &self.devices[d];
        dev.leasable.saturating_sub(dev.leased + dev.quarantined)
    }

    /// What an acquire with wait 0 must do: `Ok(fitting devices)` or the refusal code.
    fn predict_acquire(
        &self,
        session: usize,
        bytes: u64,
        device: Option<u32>,
    ) -> Result<Vec<u32>, Code> {
        if bytes == 0 || bytes > MAX_REQUEST {
            return Err(Code::InvalidArgument);
        }
        if device.is_some_and(|d| d as usize >= self.devices.len()) {
            return Err(Code::InvalidArgument);
        }
        let s = &self.sessions[session];
        if !s.alive {
            return Err(Code::NotFound);
        }
        let t = &self.tenants[s.tenant];
        let rounded = bytes.div_ceil(GRAN) * GRAN;
        let candidates: Vec<u32> = match device {
            Some(d) => vec![d],
            None => (0..self.devices.len() as u32).collect(),
        };
        let max_leasable = candidates
            .iter()
            .map(|&d| self.devices[d as usize].leasable)
            .max()
            .unwrap_or(0);
        if rounded > t.quota.limit_bytes || rounded > max_leasable {
            return Err(Code::ResourceExhausted);
        }
        if t.committed() + rounded > t.quota.limit_bytes {
            return Err(Code::ResourceExhausted);
        }
        if t.quota.max_leases > 0 && t.count >= t.quota.max_leases {
            return Err(Code::ResourceExhausted);
        }
        let fitting: Vec<u32> = candidates
            .iter()
            .copied()
            .filter(|&d| self.available(d as usize) >= rounded)
            .collect();
        if fitting.is_empty() {
            return Err(Code::ResourceExhausted);
        }
        let node_free: u64 = (0..self.devices.len()).map(|d| self.available(d)).sum();
        if node_free.saturating_sub(self.unused_guarantee_of_others(s.tenant)) < rounded {
            return Err(Code::ResourceExhausted);
        }
        Ok(fitting)
    }

    /// Ends a lease the way the arbiter does for a session's peer: quarantined when the
    /// peer process lives, destroyed otherwise (host backend, unknown pid).
    fn end_lease(&mut self, idx: usize, forced_release: bool) -> MLease {
        let l = self.leases.remove(idx);
        let t = &mut self.tenants[l.tenant];
        t.held -= l.bytes;
        t.count -= 1;
        let d = &mut self.devices[l.device as usize];
        d.leased -= l.bytes;
        d.count -= 1;
        if !forced_release && self.sessions[l.session].live_peer {
            self.tenants[l.tenant].quarantined += l.bytes;
            self.devices[l.device as usize].quarantined += l.bytes;
        }
        l
    }
}

struct Harness {
    rt: tokio::runtime::Runtime,
    arb: Arc<Arbiter>,
    model: Model,
}

impl Harness {
    fn new(ndev: u32, capacity_mib: u64, headroom_mib: u64, quotas: &[Quota]) -> Harness {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let spec = BackendSpec {
            choice: BackendChoice::Host,
            cuda_devices: None,
            host_capacity: capacity_mib * MIB,
            host_devices: ndev,
            headroom: Headroom::Bytes(headroom_mib * MIB),
            host_uuid_seed: None,
        };
        let devices = open_devices(&spec).expect("host devices");
        let arb = Arbiter::new(
            devices,
            None,
            None,
            Arc::new(Authenticator::new("x")),
            ArbiterConfig::default(),
        )
        .expect("arbiter");
        let reports = rt.block_on(arb.views().device_reports());
        let devices = reports
            .iter()
            .map(|r| MDevice {
                leasable: r.leasable,
                ..MDevice::default()
            })
            .collect();
        let mut h = Harness {
            rt,
            arb,
            model: Model {
                tenants: vec![MTenant::default(); TENANTS.len()],
                sessions: vec![],
                leases: vec![],
                devices,
            },
        };
        for (i, q) in quotas.iter().enumerate() {
            h.step(&Op::SetQuota {
                tenant: i,
                quota: q.clone(),
            });
        }
        h
    }

    fn step(&mut self, op: &Op) {
        let m = &mut self.model;
        match op.clone() {
            Op::Open { tenant, live_peer } => {
                let peer = if live_peer {
                    Peer {
                        pid: Some(std::process::id()),
                        uid: None,
                        unix: true,
                    }
                } else {
                    Peer::default()
                };
                let arb = self.arb.clone();
                let r = self
                    .rt
                    .block_on(async move { arb.open_session(TENANTS[tenant], "model", peer) });
                let (id, events) = r.expect("open session of an existing tenant");
                m.sessions.push(MSession {
                    id,
                    tenant,
                    live_peer,
                    alive: true,
                    events,
                });
            }
            Op::Acquire {
                session,
                bytes,
                device,
                reclaimable,
            } => {
                if m.sessions.is_empty() {
                    return;
                }
                let session = session % m.sessions.len();
                let predicted = m.predict_acquire(session, bytes, device);
                let s = &m.sessions[session];
                let tenant = s.tenant;
                let req = AcquireRequest {
                    tenant: TENANTS[tenant].to_string(),
                    session: s.id,
                    bytes,
                    device,
                    wait: Duration::ZERO,
                    label: "model".into(),
                    reclaimable,
                    fallback_host: false,
                };
                let arb = self.arb.clone();
                let got = self.rt.block_on(async move { arb.acquire(req).await });
                match (predicted, got) {
                    (Ok(fitting), Ok(view)) => {
                        let rounded = bytes.div_ceil(GRAN) * GRAN;
                        assert_eq!(view.bytes, rounded, "granted size");
                        assert_eq!(view.bytes % GRAN, 0, "granted size is whole granules");
                        assert!(view.bytes >= bytes, "granted less than asked");
                        assert_eq!(view.requested_bytes, bytes);
                        assert_eq!(view.tier, Tier::Device);
                        assert_eq!(view.tenant, TENANTS[tenant]);
                        assert!(
                            fitting.contains(&view.device),
                            "granted on device {} which had no room (fitting: {fitting:?})",
                            view.device
                        );
                        let Handle::Fd { size, .. } = &view.handle;
                        assert!(*size >= view.bytes, "memory object too small");
                        let t = &mut m.tenants[tenant];
                        t.held += view.bytes;
                        t.count += 1;
                        assert!(
                            t.committed() <= t.quota.limit_bytes,
                            "tenant {} holds {} (+{} quarantined) above its limit {}",
                            TENANTS[tenant],
                            t.held,
                            t.quarantined,
                            t.quota.limit_bytes
                        );
                        let d = &mut m.devices[view.device as usize];
                        d.leased += view.bytes;
                        d.count += 1;
                        assert!(d.leased + d.quarantined <= d.leasable);
                        m.leases.push(MLease {
                            id: view.id,
                            tenant,
                            session,
                            device: view.device,
                            bytes: view.bytes,
                        });
                    }
                    (Err(want), Err(e)) => {
                        assert_eq!(want, code(&e), "refusal status: {e}");
                    }
                    (Ok(_), Err(e)) => panic!("model grants {bytes} bytes, arbiter refused: {e}"),
                    (Err(want), Ok(view)) => panic!(
                        "model refuses ({want:?}) {bytes} bytes, arbiter granted {} on device {}",
                        view.bytes, view.device
                    ),
                }
            }
            Op::Release { lease } => {
                if m.leases.is_empty() {
                    return;
                }
                let idx = lease % m.leases.len();
                let l = m.leases[idx].clone();
                let arb = self.arb.clone();
                self.rt
                    .block_on(async move { arb.release(TENANTS[l.tenant], l.id) })
                    .expect("owner releases its lease");
                m.end_lease(idx, true);
            }
            Op::ReleaseForeign { lease } => {
                if m.leases.is_empty() {
                    return;
                }
                let l = &m.leases[lease % m.leases.len()];
                let other = TENANTS[(l.tenant + 1) % TENANTS.len()];
                let e = self.arb.release(other, l.id).expect_err("foreign release");
                assert_eq!(code(&e), Code::NotFound, "{e}");
            }
            Op::ReleaseUnknown => {
                let e = self
                    .arb
                    .release(TENANTS[0], Uuid::new_v4())
                    .expect_err("unknown lease");
                assert_eq!(code(&e), Code::NotFound, "{e}");
            }
            Op::End { session } => {
                if m.sessions.is_empty() {
                    return;
                }
                let session = session % m.sessions.len();
                let arb = self.arb.clone();
                let id = m.sessions[session].id;
                self.rt
                    .block_on(async move { arb.end_session(id, "killed (model)") });
                m.sessions[session].alive = false;
                while let Some(idx) = m.leases.iter().position(|l| l.session == session) {
                    m.end_lease(idx, false);
                }
            }
            Op::SetQuota { tenant, quota } => {
                let guarantees: u64 = m
                    .tenants
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != tenant)
                    .map(|(_, t)| t.quota.guaranteed_bytes)
                    .sum::<u64>()
                    + quota.guaranteed_bytes;
                let leasable: u64 = m.devices.iter().map(|d| d.leasable).sum();
                let want_ok = quota.guaranteed_bytes <= quota.limit_bytes && guarantees <= leasable;
                let arb = self.arb.clone();
                let asked = quota.clone();
                let got = self
                    .rt
                    .block_on(async move { arb.set_quota(TENANTS[tenant], asked) });
                match got {
                    Ok((view, _)) => {
                        assert!(want_ok, "quota {quota:?} accepted, model refuses it");
                        assert_eq!(view.quota, quota);
                        m.tenants[tenant].quota = quota;
                    }
                    Err(e) => {
                        assert!(!want_ok, "quota {quota:?} refused: {e}");
                        assert_eq!(code(&e), Code::InvalidArgument, "{e}");
                    }
                }
            }
            Op::Revoke { lease } => {
                if m.leases.is_empty() {
                    return;
                }
                let idx = lease % m.leases.len();
                let l = m.leases[idx].clone();
                let arb = self.arb.clone();
                let view = self
                    .rt
                    .block_on(async move {
                        arb.revoke(
                            l.id,
                            &gpu_broker::arbiter::state::Revoke::Operator("model revoke".into()),
                        )
                    })
                    .expect("revoke a live lease");
                assert_eq!(view.id, l.id);
                assert_eq!(view.bytes, l.bytes);
                m.end_lease(idx, false);
                // The holder was told.
                let events = &mut m.sessions[l.session].events;
                let mut told = false;
                while let Ok(e) = events.try_recv() {
                    if matches!(e, SessionEvent::LeaseRevoked { lease_id, .. } if lease_id == l.id)
                    {
                        told = true;
                    }
                }
                assert!(told, "no LeaseRevoked event for {}", l.id);
            }
        }
    }

    /// Compares every counter the arbiter shows with the model.
    fn check(&self) {
        let m = &self.model;
        let tenants = self.arb.views().tenants();
        assert_eq!(tenants.len(), TENANTS.len());
        for (i, name) in TENANTS.iter().enumerate() {
            let t = tenants
                .iter()
                .find(|t| t.name == *name)
                .expect("tenant listed");
            let mt = &m.tenants[i];
            let live: u64 = m
                .leases
                .iter()
                .filter(|l| l.tenant == i)
                .map(|l| l.bytes)
                .sum();
            assert_eq!(mt.held, live, "model consistency");
            assert_eq!(t.quota, mt.quota, "{name}: quota");
            assert_eq!(t.usage.held_bytes, mt.held, "{name}: held bytes");
            assert_eq!(t.usage.lease_count, mt.count, "{name}: lease count");
            assert_eq!(t.usage.reserved_bytes, 0, "{name}: reserved bytes");
            assert_eq!(t.usage.reserved_count, 0, "{name}: reserved count");
            assert_eq!(
                t.usage.quarantined_bytes, mt.quarantined,
                "{name}: quarantined"
            );
            assert_eq!(t.usage.host_held_bytes, 0);
            assert_eq!(t.waiting, 0, "{name}: nothing may stay queued");
            assert_eq!(
                t.borrowed_bytes,
                mt.committed().saturating_sub(mt.quota.guaranteed_bytes),
                "{name}: borrowed"
            );
            let sessions = m
                .sessions
                .iter()
                .filter(|s| s.alive && s.tenant == i)
                .count();
            assert_eq!(t.sessions as usize, sessions, "{name}: sessions");
        }
        let mut listed: Vec<(Uuid, u64, u32)> = self
            .arb
            .views()
            .leases(None)
            .iter()
            .map(|l| (l.id, l.bytes, l.device))
            .collect();
        let mut want: Vec<(Uuid, u64, u32)> =
            m.leases.iter().map(|l| (l.id, l.bytes, l.device)).collect();
        listed.sort();
        want.sort();
        assert_eq!(listed, want, "lease table");
        let arb = self.arb.clone();
        let reports = self
            .rt
            .block_on(async move { arb.views().device_reports().await });
        // `devices()` ran a job on every device thread after every free queued so far:
        // the device's allocations are now exactly the broker's holdings.
        for (d, r) in reports.iter().enumerate() {
            let md = &m.devices[d];
            let sum: u64 = m
                .leases
                .iter()
                .filter(|l| l.device as usize == d)
                .map(|l| l.bytes)
                .sum();
            assert_eq!(r.leased, sum, "device {d}: leased == sum of leases");
            assert_eq!(r.leased, md.leased, "device {d}: leased");
            assert_eq!(r.lease_count, md.count, "device {d}: lease count");
            assert_eq!(r.quarantined, md.quarantined, "device {d}: quarantined");
            assert_eq!(r.leasable, md.leasable, "device {d}: leasable");
            assert_eq!(r.waiting, 0);
            assert!(
                r.leased + r.quarantined <= r.leasable,
                "device {d}: committed {} above leasable {}",
                r.leased + r.quarantined,
                r.leasable
            );
            assert!(
                r.leased + r.quarantined + r.cached <= r.leasable,
                "device {d}: holdings incl. cache {} above leasable {}",
                r.leased + r.quarantined + r.cached,
                r.leasable
            );
            assert_eq!(
                r.total - r.free,
                r.leased + r.quarantined + r.cached,
                "device {d}: allocated on the device vs leased + quarantined + cached"
            );
        }
    }

    /// Releases everything, then shuts down: every counter must be exactly zero.
    fn finish(mut self) {
        // Release what is still held, by its owner.
        while let Some(l) = self.model.leases.first().cloned() {
            let arb = self.arb.clone();
            self.rt
                .block_on(async move { arb.release(TENANTS[l.tenant], l.id) })
                .expect("final release");
            self.model.end_lease(0, true);
        }
        self.check();
        for t in self.arb.views().tenants() {
            assert_eq!(t.usage.held_bytes, 0);
            assert_eq!(t.usage.lease_count, 0);
        }
        for i in 0..self.model.sessions.len() {
            if self.model.sessions[i].alive {
                self.step(&Op::End { session: i });
            }
        }
        self.check();
        assert_eq!(self.arb.views().session_count(), 0);
        // Quarantined memory stays until its holder (this process) is gone; shutdown
        // frees it with everything cached.
        self.arb.lifecycle().release_all();
        for t in self.arb.views().tenants() {
            assert_eq!(
                t.usage,
                gpu_broker::ledger::Usage::default(),
                "{}: usage after shutdown",
                t.name
            );
        }
        let arb = self.arb.clone();
        let reports = self
            .rt
            .block_on(async move { arb.views().device_reports().await });
        for r in &reports {
            assert_eq!(
                (r.leased, r.quarantined, r.cached, r.lease_count),
                (0, 0, 0, 0),
                "device {} after shutdown: {r:?}",
                r.index
            );
            assert_eq!(r.free, r.total, "device {} still has allocations", r.index);
        }
    }
}

fn initial_quotas() -> impl Strategy<Value = Vec<Quota>> {
    prop::collection::vec(quota_strategy(), TENANTS.len()).prop_map(|mut qs| {
        // Every tenant starts valid and creatable (guarantees are checked later by ops).
        for q in &mut qs {
            q.guaranteed_bytes = 0;
        }
        qs
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 64,
        max_shrink_iters: 2000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn arbiter_matches_the_model(
        ndev in 1u32..=2,
        capacity_mib in prop_oneof![Just(64u64), Just(128), Just(100)],
        headroom_mib in prop_oneof![Just(0u64), Just(8), Just(5)],
        quotas in initial_quotas(),
        opens in prop::collection::vec((0..TENANTS.len(), any::<bool>()), 1..4),
        ops in prop::collection::vec(op_strategy(), 1..40),
    ) {
        let mut h = Harness::new(ndev, capacity_mib, headroom_mib, &quotas);
        h.check();
        for (tenant, live_peer) in opens {
            h.step(&Op::Open { tenant, live_peer });
        }
        for op in &ops {
            h.step(op);
            h.check();
        }
        h.finish();
    }
}

/// The model's own sanity: a plain scenario with known numbers.
#[test]
fn scripted_guarantee_and_quarantine() {
    let q = |limit: u64, g: u64, prio: i32| Quota {
        limit_bytes: limit * MIB,
        guaranteed_bytes: g * MIB,
        priority: prio,
        ..Quota::default()
    };
    let mut h = Harness::new(1, 64, 0, &[q(64, 0, 0), q(32, 16, 0), q(64, 0, 1)]);
    h.step(&Op::Open {
        tenant: 0,
        live_peer: true,
    });
    h.step(&Op::Open {
        tenant: 1,
        live_peer: false,
    });
    // t0 may take at most 64 - 16 (t1's unused guarantee) = 48 MiB.
    for _ in 0..3 {
        h.step(&Op::Acquire {
            session: 0,
            bytes: 16 * MIB,
            device: None,
            reclaimable: false,
        });
        h.check();
    }
    assert_eq!(h.model.tenants[0].held, 48 * MIB);
    h.step(&Op::Acquire {
        session: 0,
        bytes: 2 * MIB,
        device: None,
        reclaimable: false,
    });
    assert_eq!(h.model.tenants[0].held, 48 * MIB, "guarantee kept for t1");
    h.step(&Op::Acquire {
        session: 1,
        bytes: 16 * MIB,
        device: Some(0),
        reclaimable: false,
    });
    assert_eq!(h.model.tenants[1].held, 16 * MIB);
    // t0's worker "dies" while its process lives: its memory is quarantined.
    h.step(&Op::End { session: 0 });
    h.check();
    assert_eq!(h.model.tenants[0].quarantined, 48 * MIB);
    assert_eq!(h.model.devices[0].quarantined, 48 * MIB);
    h.finish();
}
