//! The queue policy: which waiting request is granted, on which device, which are refused
//! because they can never fit any more, and whose memory is asked back for whom. All of
//! it decided here, in the core, from the state and a [`QueueEnv`] (which devices admit
//! new leases, the clocks, the tunables) that the shell reads for each call.
//!
//! One pass over the queue ([`State::queue_pass`], pure) walks the waiters in order of
//! service (`queue.rs`) and finds the first that fits:
//!
//! * a waiter blocked by its own quota (bytes, lease count, or every per-device cap)
//!   blocks nobody;
//! * one blocked by capacity blocks the devices it wants for everyone ranked after it
//!   (no overtaking), except that while it is younger than the overtake age it lets
//!   requests of *other* tenants of its priority that fit go first (`overtaking.rs`);
//! * a request within its tenant's guarantee is not held back behind such waiters;
//! * memory kept for other tenants' unused guarantees is not free for it.
//!
//! Waiters blocked by capacity or by guarantees ask holders for memory back
//! ([`State::request_reclaim`]). [`State::run_queue`] repeats passes, granting one waiter
//! each, until nothing more fits: that is the whole queue run, one transition.

use super::State;
use crate::availability::Availability;
use crate::effects::{Counted, Effect, PendingGrant};
use crate::error::{BrokerError, BrokerResult, DeviceRoom, Queue};
use crate::lease::LeaseState;
use crate::ledger::Tier;
use crate::pool::Source;
use crate::queue::{Ask, Waiter, WaiterId};
use crate::request::ValidRequest;
use crate::reservations::ProcessAsk;
use crate::session::SessionEvent;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime};
use uuid::Uuid;

/// What the queue policy needs from outside the core, read by the shell for each call.
#[derive(Clone, Copy)]
pub struct QueueEnv<'a> {
    /// Which devices admit new leases (drains, health: `availability.rs`).
    pub avail: &'a Availability,
    /// The clocks, read once for the call.
    pub now: Instant,
    pub wall: SystemTime,
    /// `--overtake-age` (`overtaking.rs`).
    pub overtake_age: Duration,
    /// How long a holder asked for memory back has (`--reclaim-deadline`).
    pub reclaim_deadline: Duration,
    /// `--reclaim-policy terminate`: quarantined memory of holders being killed is on its
    /// way back.
    pub terminating: bool,
    /// The broker is shutting down: grants are not committed.
    pub shutting_down: bool,
}

/// What one pass over the queue decided.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// The first waiter that fits, and where.
    pub grant: Option<(WaiterId, u32)>,
    /// Waiters ahead of it blocked by capacity or guarantees, in order of service: memory
    /// is asked back for them.
    pub reclaim: Vec<WaiterId>,
}

/// Outcome of looking for a device.
#[derive(Debug, PartialEq, Eq)]
enum Fit {
    Device(u32),
    /// No candidate device has that much unpromised memory.
    NoCapacity,
    /// Memory exists but is kept for other tenants' guarantees.
    GuaranteeHeld,
}

/// A request offered to the queue ([`State::enqueue`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Enqueued {
    /// Granted in the same call (`queued` false) or waiting (`queued` true) as `id`.
    Waiting { id: WaiterId, queued: bool },
    /// It can never fit, or (no wait) does not fit now: why.
    Refused(BrokerError),
}

impl State {
    /// Devices a request may use: the one it named, or all; only those `avail` admits.
    pub fn candidates(&self, avail: &Availability, device: Option<u32>) -> Vec<u32> {
        match device {
            Some(d) => vec![d],
            None => (0..self.pools.len() as u32).collect(),
        }
        .into_iter()
        .filter(|&d| avail.admits(d))
        .collect()
    }

    /// Why a request of `bytes` (rounded) of `tenant` for `candidates` can never be
    /// granted, whatever is released: beyond the tenant's limit or its per-device caps, or
    /// larger than any of those devices can lease. `None`: it may fit some day.
    pub fn never_fits(
        &self,
        tenant: &str,
        bytes: u64,
        device: Option<u32>,
        candidates: &[u32],
    ) -> Option<BrokerError> {
        let Some(t) = self.ledger.get(tenant) else {
            return Some(BrokerError::tenant_not_found(tenant));
        };
        if bytes > t.quota.limit_bytes {
            return Some(BrokerError::QuotaExceeded {
                tenant: tenant.to_string(),
                tier: Tier::Device,
                requested: bytes,
                held: t.usage.committed_bytes(),
                limit: t.quota.limit_bytes,
            });
        }
        if let Some(e) = self.ledger.device_caps_never_fit(tenant, candidates, bytes) {
            return Some(e);
        }
        let leasable = candidates
            .iter()
            .map(|&d| self.pools[d as usize].leasable())
            .max()
            .unwrap_or(0);
        (bytes > leasable).then_some(BrokerError::TooLarge {
            requested: bytes,
            leasable,
            device,
        })
    }

    /// An id for a request granted without queueing (a draw from a process reservation):
    /// its answer goes to it like a waiter's.
    pub fn next_waiter_id(&mut self) -> WaiterId {
        self.queue.next_id()
    }

    /// Offers request `req` (checked by the shell: its values, session, devices, a draw
    /// from a process reservation) to the queue, as a lease request or (`process`) a
    /// process reservation: its size is rounded up to the largest granularity of the
    /// devices it may use; one that can never fit is refused at once (waiting or not:
    /// [`State::never_fits`]); else [`State::enqueue`]. Returns the rounded size with the
    /// outcome.
    pub fn offer(
        &mut self,
        req: &ValidRequest,
        process: Option<ProcessAsk>,
        max_waiting: usize,
        env: &QueueEnv,
    ) -> BrokerResult<(u64, Enqueued)> {
        let priority = self
            .ledger
            .get(&req.tenant)
            .ok_or_else(|| BrokerError::tenant_not_found(&req.tenant))?
            .quota
            .priority;
        let candidates = self.candidates(env.avail, req.device);
        let gran = candidates
            .iter()
            .map(|&d| self.pools[d as usize].granularity())
            .max()
            .unwrap_or(2 << 20);
        let bytes = crate::units::round_up(req.bytes, gran).ok_or_else(|| {
            BrokerError::InvalidArgument(format!("size {} is too large", req.bytes))
        })?;
        if let Some(err) = self.never_fits(&req.tenant, bytes, req.device, &candidates) {
            return Ok((bytes, Enqueued::Refused(err)));
        }
        let ask = Ask {
            tenant: req.tenant.clone(),
            session: req.session,
            bytes,
            requested_bytes: req.bytes,
            device: req.device,
            label: req.label.clone(),
            reclaimable: req.reclaimable,
            process,
            draw: None,
        };
        let wait_zero = req.wait.is_zero();
        Ok((
            bytes,
            self.enqueue(ask, priority, wait_zero, max_waiting, env)?,
        ))
    }

    /// Offers `ask` (rounded, and checked against what can never fit) to the queue: `QUEUE_FULL` when its tenant has `max_waiting` waiters already; else it is
    /// queued and the queue runs. With `wait_zero`, one that did not fit at once leaves
    /// the queue again, refused with why.
    pub fn enqueue(
        &mut self,
        ask: Ask,
        priority: i32,
        wait_zero: bool,
        max_waiting: usize,
        env: &QueueEnv,
    ) -> BrokerResult<Enqueued> {
        let waiting = self
            .queue
            .iter()
            .filter(|w| w.ask.tenant == ask.tenant)
            .count();
        if waiting >= max_waiting {
            return Err(BrokerError::QueueFull {
                tenant: ask.tenant,
                waiting,
                queue: Queue::Lease,
            });
        }
        let id = self.queue.push(ask, priority, env.now);
        self.run_queue(env);
        let queued = self.queue.contains(id);
        if queued && wait_zero {
            return Ok(match self.give_up(id, env.avail) {
                Some(err) => Enqueued::Refused(err),
                None => Enqueued::Refused(BrokerError::Internal(
                    "a refused request left the queue early".into(),
                )),
            });
        }
        Ok(Enqueued::Waiting { id, queued })
    }

    /// Waiter `id` stops waiting (its wait ran out, or it asked not to wait): it leaves
    /// the queue and this says why it did not fit. `None` when it is not waiting (it was
    /// granted or refused meanwhile: its answer is on its way). Its place may have blocked
    /// others: the queue runs after the hold.
    pub fn give_up(&mut self, id: WaiterId, avail: &Availability) -> Option<BrokerError> {
        let w = self.queue.remove(id)?;
        self.wake_queue();
        Some(self.exhausted(&w.ask, avail))
    }

    /// Waiter `id`'s caller went away: it leaves the queue (true if it was waiting). Its
    /// place may have blocked others: the queue runs after the hold.
    pub fn abandon(&mut self, id: WaiterId) -> bool {
        let gone = self.queue.remove(id).is_some();
        if gone {
            self.wake_queue();
            tracing::debug!(waiter = id, "waiting request left the queue");
        }
        gone
    }

    /// Every waiter is refused with `err` (the broker shuts down).
    pub(super) fn refuse_all_waiters(&mut self, err: &BrokerError) {
        let ids: Vec<WaiterId> = self.queue.iter().map(|w| w.id).collect();
        for id in ids {
            if let Some(w) = self.queue.remove(id) {
                self.fx.reply(w.id, Err(err.clone()));
            }
        }
    }

    /// Waiters whose reclaim request is older than `older_than` may ask again (what they
    /// asked for was not enough). The queue runs after the hold (and asks again).
    pub fn rearm_reclaim(&mut self, older_than: Duration, now: Instant) {
        self.wake_queue();
        let stale: Vec<WaiterId> = self
            .queue
            .iter()
            .filter(|w| w.reclaim_sent && now.saturating_duration_since(w.since) > older_than)
            .map(|w| w.id)
            .collect();
        for id in stale {
            if let Some(w) = self.queue.get_mut(id) {
                w.reclaim_sent = false;
            }
        }
    }

    /// Runs the queue: refuses the waiters that can never be granted any more, then
    /// grants every waiter that fits, in order of service, asking memory back for those
    /// blocked ahead of them (see the module doc).
    pub fn run_queue(&mut self, env: &QueueEnv) {
        self.refuse_never_fitting(env.avail);
        loop {
            if self.queue.is_empty() {
                return;
            }
            let pass = self.queue_pass(env);
            for id in pass.reclaim {
                self.request_reclaim(id, env);
            }
            match pass
                .grant
                .and_then(|(id, d)| self.queue.remove(id).map(|w| (w, d)))
            {
                Some((w, d)) => self.grant_waiter(w.id, w.ask, w.priority, d, env.shutting_down),
                None => {
                    // Requests wait for memory: blocks that processes retained mapped
                    // (`retained.rs`) are wanted back on the devices they wait for.
                    self.ask_retained_back_for_waiters();
                    return;
                }
            }
        }
    }

    /// Refuses every waiter no admitting device can serve any more (its devices closed:
    /// the refusal a new request gets), and every one that can never fit any more (its
    /// tenant's limit or caps shrank below it, or it is larger than what its devices can
    /// lease now): [`State::never_fits`], the error a new request of its size gets.
    fn refuse_never_fitting(&mut self, avail: &Availability) {
        let mut refused: Vec<(WaiterId, BrokerError)> = Vec::new();
        for w in self.queue.iter() {
            let candidates = self.candidates(avail, w.ask.device);
            let err = if candidates.is_empty() {
                Some(
                    avail
                        .refusal(w.ask.device)
                        .unwrap_or_else(|| BrokerError::NoDeviceOpen {
                            why: "every device it may use is closed".into(),
                        }),
                )
            } else {
                self.never_fits(&w.ask.tenant, w.ask.bytes, w.ask.device, &candidates)
            };
            if let Some(err) = err {
                refused.push((w.id, err));
            }
        }
        for (id, err) in refused {
            if let Some(w) = self.queue.remove(id) {
                tracing::info!(tenant = %w.ask.tenant, error = %err, "waiting request refused: it can no longer be granted");
                self.fx.reply(id, Err(err));
            }
        }
    }

    /// One pass over the queue, changing nothing: the first waiter that fits (and where),
    /// and the waiters ahead of it that need memory back (see the module doc).
    pub fn queue_pass(&self, env: &QueueEnv) -> Pass {
        let mut pass = Pass::default();
        let mut blocked: HashSet<u32> = HashSet::new();
        // Heads blocked by capacity that other tenants of their priority may still
        // overtake (younger than the overtake age): (priority, tenant, devices).
        let mut soft: Vec<(i32, &str, Vec<u32>)> = Vec::new();
        for id in self.queue.order(&self.ledger) {
            let Some(w) = self.queue.get(id) else {
                continue;
            };
            if w.ask.check_charge(&self.ledger).is_err() {
                continue;
            }
            // Devices where the tenant's per-device cap leaves room; none: blocked by its
            // own quota (blocks nobody).
            let all: Vec<u32> = self
                .candidates(env.avail, w.ask.device)
                .into_iter()
                .filter(|&d| {
                    self.ledger
                        .check_device(&w.ask.tenant, d, w.ask.bytes)
                        .is_ok()
                })
                .collect();
            if all.is_empty() {
                continue;
            }
            // Memory kept for a guarantee is its owner's: a request within its guarantee
            // is not held back behind others blocked on capacity.
            let guaranteed = self.ledger.within_guarantee(&w.ask.tenant, w.ask.bytes);
            // A head blocked by capacity lets requests of other tenants of its own
            // priority that fit go first while it is young; it keeps blocking its own
            // tenant (FIFO) and lower priorities.
            let soft_blocks = |d: &u32| {
                soft.iter()
                    .any(|(p, t, ds)| ds.contains(d) && (*p != w.priority || *t == w.ask.tenant))
            };
            let open: Vec<u32> = all
                .iter()
                .copied()
                .filter(|d| guaranteed || (!blocked.contains(d) && !soft_blocks(d)))
                .collect();
            if open.is_empty() {
                continue;
            }
            match self.fit(&w.ask, &open) {
                Fit::Device(d) => {
                    pass.grant = Some((id, d));
                    break;
                }
                Fit::NoCapacity => {
                    pass.reclaim.push(id);
                    if crate::overtaking::open_to_overtakers(w.since, env.now, env.overtake_age) {
                        soft.push((w.priority, w.ask.tenant.as_str(), all));
                    } else {
                        blocked.extend(all);
                    }
                }
                Fit::GuaranteeHeld => pass.reclaim.push(id),
            }
        }
        pass
    }

    /// Finds a device for `ask` among `open`: one with a cached block of that exact size
    /// first (no driver call), else the one with the most unpromised memory.
    fn fit(&self, ask: &Ask, open: &[u32]) -> Fit {
        let fitting: Vec<u32> = open
            .iter()
            .copied()
            .filter(|&d| self.pools[d as usize].available() >= ask.bytes)
            .collect();
        if fitting.is_empty() {
            return Fit::NoCapacity;
        }
        let node_free = self
            .pools
            .iter()
            .map(|p| p.available())
            .fold(0, u64::saturating_add);
        let others_guarantees = self.ledger.others_unused_guarantees(&ask.tenant);
        if node_free.saturating_sub(others_guarantees) < ask.bytes {
            return Fit::GuaranteeHeld;
        }
        let best = fitting.iter().copied().max_by_key(|&d| {
            let p = &self.pools[d as usize];
            (p.has_cached(ask.bytes), p.available(), u32::MAX - d)
        });
        best.map(Fit::Device).unwrap_or(Fit::NoCapacity)
    }

    /// Grants `ask` (waiter `to`) on device `d`: a process reservation at once; a lease by
    /// reserving its memory, then committing it at once for a cached block of its own
    /// tenant, else leaving the device work to the shell (`Effect::Materialize`). The
    /// answer goes to `to` (`Effect::Reply`).
    pub fn grant_waiter(
        &mut self,
        to: WaiterId,
        ask: Ask,
        priority: i32,
        d: u32,
        shutting_down: bool,
    ) {
        if ask.process.is_some() {
            let r = self.grant_process(&ask, d).and_then(|id| {
                self.reservations
                    .get(&id)
                    // The shell fills in the device's UUID when it answers.
                    .map(|r| r.view(String::new()))
                    .ok_or_else(|| BrokerError::Internal("reservation vanished".into()))
            });
            self.fx.reply_process(to, r);
            return;
        }
        let source = match self.reserve_grant(&ask, d) {
            Ok(source) => source,
            Err(e) => {
                self.undraw(&ask);
                self.fx.reply(to, Err(e));
                return;
            }
        };
        let mut source = match source {
            // Another tenant's block: a process may still map it (the broker cannot know
            // who the holder passed the descriptor to: fork, `SCM_RIGHTS`), so it never
            // reaches this tenant. Free it (a surviving mapping keeps its old pages,
            // reaching nobody else) and give a fresh memory object of the same size.
            Source::Cached { block, scrub: true } => {
                tracing::debug!(device = d, tenant = %ask.tenant, "cached block of another tenant may still be mapped; allocating fresh");
                self.replace_cached(d, block);
                Source::Fresh {
                    evicted: Vec::new(),
                }
            }
            // Sealed by its holder (before or after its release, through a descriptor it
            // kept; a release does not look): the tenant's next lease must get memory it
            // can write and publish. Freed, and fresh memory given instead.
            Source::Cached {
                block,
                scrub: false,
            } if !self.pristine(&block) => {
                tracing::warn!(device = d, tenant = %ask.tenant, "a cached memfd was sealed; allocating fresh");
                self.pools[d as usize].note_replaced(false);
                self.fx.free(d, block);
                Source::Fresh {
                    evicted: Vec::new(),
                }
            }
            other => other,
        };
        if let Source::Cached {
            block,
            scrub: false,
        } = source
        {
            let r = self
                .commit_grant(&ask, priority, d, block, shutting_down)
                .map_err(|why| why.into_error(ask.session));
            self.fx.reply(to, r);
            return;
        }
        // Evicted blocks are freed before the lock is released (`effects.rs`): the device
        // thread runs jobs in order, so these frees happen before any allocation admitted
        // after this one.
        if let Source::Fresh { evicted } = &mut source {
            for b in std::mem::take(evicted) {
                self.fx.free(d, b);
            }
        }
        // The device work starts once the lock is released, after the frees above were
        // queued.
        self.fx.push(Effect::Materialize {
            grant: Box::new(PendingGrant {
                ask,
                priority,
                to,
                device: d,
                source,
            }),
        });
    }

    /// Why `ask` does not fit now, with the numbers.
    pub fn exhausted(&self, ask: &Ask, avail: &Availability) -> BrokerError {
        // The tenant's own limits first (bytes or lease count): they say it precisely.
        if let Err(e) = ask.check_charge(&self.ledger) {
            return e;
        }
        // Its caps on every device it may use: the first device's refusal says it.
        let open = self.candidates(avail, ask.device);
        let capped: Vec<BrokerError> = open
            .iter()
            .filter_map(|&d| self.ledger.check_device(&ask.tenant, d, ask.bytes).err())
            .collect();
        if !open.is_empty() && capped.len() == open.len() {
            if let Some(e) = capped.into_iter().next() {
                return e;
            }
        }
        let (held, limit) = self
            .ledger
            .get(&ask.tenant)
            .map(|t| (t.usage.committed_bytes(), t.quota.limit_bytes))
            .unwrap_or((0, 0));
        let devices = open
            .iter()
            .map(|&d| {
                let p = &self.pools[d as usize];
                DeviceRoom {
                    device: d,
                    free: p.available(),
                    leasable: p.leasable(),
                }
            })
            .collect();
        BrokerError::NoCapacity {
            tenant: ask.tenant.clone(),
            requested: ask.bytes,
            devices,
            guaranteed: self.ledger.others_unused_guarantees(&ask.tenant),
            held,
            limit,
            waiting: self.queue.len(),
        }
    }

    /// Asks holders of memory that waiter `id` is entitled to for it back: borrowed leases
    /// (when the waiter is within its guarantee) and reclaimable leases of lower priority,
    /// lowest priority and newest first, only as much as needed. Once per waiter (until
    /// [`State::rearm_reclaim`]).
    pub fn request_reclaim(&mut self, id: WaiterId, env: &QueueEnv) {
        let Some(w) = self.queue.get(id) else { return };
        if w.reclaim_sent {
            return;
        }
        let Some(victims) = self.reclaim_victims(w, env) else {
            return;
        };
        let (tenant, bytes, priority) = (w.ask.tenant.clone(), w.ask.bytes, w.priority);
        let deadline = env.now + env.reclaim_deadline;
        let deadline_wall = env.wall + env.reclaim_deadline;
        for (lid, lease_bytes, owner) in victims {
            let Some(session) = self.leases.get(&lid).map(|l| l.session) else {
                continue;
            };
            self.set_lease_state(
                &lid,
                LeaseState::ReclaimRequested {
                    deadline,
                    deadline_wall,
                },
            );
            if self.sessions.get(&session).is_some() {
                self.fx.notify(
                    session,
                    SessionEvent::ReclaimRequested {
                        lease_id: lid,
                        bytes: lease_bytes,
                        deadline: deadline_wall,
                        reason: format!(
                            "tenant {tenant:?} (priority {priority}) is waiting for {}",
                            crate::units::show(bytes)
                        ),
                    },
                );
            }
            self.fx.count(Counted::ReclaimRequested);
            tracing::info!(lease = %lid, owner = %owner, for_tenant = %tenant, "reclaim requested");
        }
        if let Some(w) = self.queue.get_mut(id) {
            w.reclaim_sent = true;
        }
    }

    /// The leases to ask back for waiter `w` (lease, bytes, owner), changing nothing;
    /// `None` when nothing needs asking (it fits once memory already on its way is back,
    /// or its tenant is gone).
    fn reclaim_victims(&self, w: &Waiter, env: &QueueEnv) -> Option<Vec<(Uuid, u64, String)>> {
        let ask = &w.ask;
        self.ledger.get(&ask.tenant)?;
        let within_guarantee = self.ledger.within_guarantee(&ask.tenant, ask.bytes);
        let devices = self.candidates(env.avail, ask.device);
        // Free for this tenant: unpromised memory minus what is kept for others' guarantees.
        let node_free = self
            .pools
            .iter()
            .map(|p| p.available())
            .fold(0, u64::saturating_add);
        let for_tenant =
            node_free.saturating_sub(self.ledger.others_unused_guarantees(&ask.tenant));
        let best_free = devices
            .iter()
            .map(|&d| self.pools[d as usize].available())
            .max()
            .unwrap_or(0)
            .min(for_tenant);
        // Memory already on its way back counts: leases asked to go, and (with the
        // terminate policy) quarantine of holders being killed.
        let pending: u64 = self
            .leases
            .iter()
            .filter(|l| devices.contains(&l.device) && l.tier == Tier::Device)
            .filter(|l| matches!(l.state, LeaseState::ReclaimRequested { .. }))
            .map(|l| l.bytes())
            .chain(
                devices
                    .iter()
                    .filter(|_| env.terminating)
                    .map(|&d| self.pools[d as usize].stats().quarantined),
            )
            .fold(0, u64::saturating_add);
        // Under the cooperative policy, a holder that already ignored a reclaim (its
        // revoked memory sits in quarantine) frees nothing by losing more leases: ask others.
        let uncooperative: HashSet<u32> = if env.terminating {
            HashSet::new()
        } else {
            self.quarantine.values().filter_map(|q| q.pid).collect()
        };
        let mut need = ask.bytes.saturating_sub(best_free.saturating_add(pending));
        if need == 0 {
            return None;
        }
        // Asking for memory back changes no charge: what each tenant borrowed, read once.
        let borrowed: HashMap<&str, u64> = self
            .ledger
            .tenants()
            .map(|t| (t.name.as_str(), t.borrowed_bytes()))
            .collect();
        let borrowed_of = |t: &str| borrowed.get(t).copied().unwrap_or(0);
        let mut candidates: Vec<(i32, u64, Uuid, u64, &str)> = self
            .leases
            .iter()
            .filter(|l| l.tier == Tier::Device && devices.contains(&l.device))
            .filter(|l| matches!(l.state, LeaseState::Active))
            .filter(|l| l.tenant != ask.tenant)
            .filter(|l| {
                self.sessions
                    .get(&l.session)
                    .and_then(|s| s.peer.pid)
                    .is_none_or(|pid| !uncooperative.contains(&pid))
            })
            .filter(|l| {
                (within_guarantee && borrowed_of(&l.tenant) > 0)
                    || (l.reclaimable && l.priority < w.priority)
            })
            .map(|l| (l.priority, l.seq, l.id, l.bytes(), l.tenant.as_str()))
            .collect();
        candidates.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut taken_from: HashMap<&str, u64> = HashMap::new();
        let mut victims = Vec::new();
        for (_, _, lid, bytes, owner) in candidates {
            if need == 0 {
                break;
            }
            // Take no more than the owner borrowed: memory within a guarantee is never
            // reclaimed, not even for a higher priority (it would only become the owner's
            // unused guarantee, kept from the waiter anyway).
            let taken = taken_from.entry(owner).or_default();
            if *taken >= borrowed_of(owner) {
                continue;
            }
            *taken += bytes;
            victims.push((lid, bytes, owner.to_string()));
            need = need.saturating_sub(bytes);
        }
        Some(victims)
    }
}
