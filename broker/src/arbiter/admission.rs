//! Admission: does a request fit now, on which device, and the grant itself. A request
//! fits when its tenant's quota allows it (ledger), a device has that much leasable memory
//! not yet promised (pool), and granting it leaves other tenants' unused guarantees intact.
//! Requests that do not fit wait in the queue; every release re-runs [`Arbiter::drain`].

use super::effects::{Effect, PendingGrant};
use super::queue::{Ask, Granted, Reply};
use super::state::NotCommitted;
use super::{session_not_found, AcquireRequest, Arbiter, State, MAX_LABEL};
use crate::error::{BrokerError, BrokerResult, DeviceRoom, Queue};
use crate::lease::LeaseView;
use crate::ledger::Tier;
use crate::pool::{Block, Source};
use crate::units::show;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

/// Largest single request accepted at all (1 PiB): anything above is malformed.
pub const MAX_REQUEST_BYTES: u64 = 1 << 50;

/// Outcome of looking for a device.
enum Fit {
    Device(u32),
    /// No candidate device has that much unpromised memory.
    NoCapacity,
    /// Memory exists but is kept for other tenants' guarantees.
    GuaranteeHeld,
}

/// Result of queueing a request.
enum Enqueued {
    Waiting {
        rx: oneshot::Receiver<BrokerResult<Granted>>,
        id: u64,
        bytes: u64,
        /// Still in the queue after the first pass (it did not fit at once).
        queued: bool,
    },
    Refused {
        bytes: u64,
        err: BrokerError,
    },
}

/// Removes a waiter from the queue if the acquiring future is dropped (caller gone).
struct WaiterGuard {
    arb: Arc<Arbiter>,
    id: u64,
}

impl Drop for WaiterGuard {
    fn drop(&mut self) {
        let mut st = self.arb.lock();
        if st.queue_mut().remove(self.id).is_some() {
            tracing::debug!(waiter = self.id, "waiting request left the queue");
            // Its place may have blocked others.
            self.arb.drain(&mut st);
        }
    }
}

impl Arbiter {
    /// Grants a lease now, after waiting up to `req.wait`, or fails with the reason.
    /// Counted in the metrics: latency by outcome, refusals by reason, time to grant of
    /// requests that waited.
    pub async fn acquire(self: &Arc<Self>, req: AcquireRequest) -> BrokerResult<LeaseView> {
        let started = Instant::now();
        let mut waited = false;
        let r = self
            .acquire_untimed(req, None, &mut waited)
            .await
            .and_then(|g| match g {
                Granted::Lease(v) => Ok(v),
                Granted::Process(_) => Err(BrokerError::Internal(
                    "a lease request was granted a process reservation".into(),
                )),
            });
        self.metrics.acquired(&r, started.elapsed());
        if waited && r.is_ok() {
            self.metrics.granted_after_wait(started.elapsed());
        }
        r
    }

    /// Queues a lease request (`process` None) or a process reservation and waits for
    /// its grant.
    pub(crate) async fn acquire_untimed(
        self: &Arc<Self>,
        req: AcquireRequest,
        process: Option<crate::reservations::ProcessAsk>,
        waited: &mut bool,
    ) -> BrokerResult<Granted> {
        self.check_not_draining()?;
        self.validate(&req)?;
        // Whose process tree the caller is in, read from /proc before the state lock.
        let lineage = match process {
            None => self.caller_lineage(&req),
            Some(_) => Vec::new(),
        };
        let queued = self.enqueue(&req, process, &lineage)?;
        let (mut rx, id, bytes) = match queued {
            Enqueued::Waiting {
                rx,
                id,
                bytes,
                queued,
            } => {
                *waited = queued;
                (rx, id, bytes)
            }
            Enqueued::Refused { bytes, err } => return self.fallback_or(&req, bytes, err).await,
        };
        let _guard = WaiterGuard {
            arb: self.clone(),
            id,
        };
        let outcome = if req.wait.is_zero() {
            (&mut rx).await
        } else {
            match tokio::time::timeout(req.wait, &mut rx).await {
                Ok(r) => r,
                Err(_) => {
                    let lost = {
                        let mut st = self.lock();
                        let w = st.queue_mut().remove(id);
                        w.map(|w| self.exhausted(&st, &w.ask))
                    };
                    match lost {
                        Some(cause) => {
                            let err = BrokerError::WaitExpired {
                                waited_ms: u64::try_from(req.wait.as_millis()).unwrap_or(u64::MAX),
                                cause: Box::new(cause),
                            };
                            return self.fallback_or(&req, bytes, err).await;
                        }
                        // Granted just as the wait ran out: the result is on its way.
                        None => (&mut rx).await,
                    }
                }
            }
        };
        outcome.unwrap_or_else(|_| Err(BrokerError::Internal("grant was dropped".into())))
    }

    /// Checks the request against what never fits, queues it and runs the queue once.
    fn enqueue(
        self: &Arc<Self>,
        req: &AcquireRequest,
        process: Option<crate::reservations::ProcessAsk>,
        lineage: &[u32],
    ) -> BrokerResult<Enqueued> {
        let mut st = self.lock();
        let session = st
            .sessions()
            .get(&req.session)
            .filter(|s| s.tenant == req.tenant)
            .ok_or_else(|| session_not_found(req.session))?;
        session.last_seen.touch();
        // A drained or unhealthy device takes nothing new (checked under the state lock,
        // which drains and health changes also hold).
        if let Some(e) = self.avail.read().refusal(req.device) {
            return Err(e);
        }
        // A lease of a reserved process is drawn from its reservation: no queue, the
        // memory is already set aside (`reservations.rs`).
        if process.is_none() {
            if let Some(drawn) = self.draw_from_reservation(&mut st, req, lineage)? {
                let (tx, rx) = oneshot::channel();
                let bytes = drawn.ask.bytes;
                self.grant(&mut st, drawn.ask, drawn.priority, tx, drawn.device);
                return Ok(Enqueued::Waiting {
                    rx,
                    id: 0,
                    bytes,
                    queued: false,
                });
            }
        } else {
            self.check_process_ask(&st, req)?;
        }
        let tenant = st
            .ledger()
            .get(&req.tenant)
            .ok_or_else(|| BrokerError::tenant_not_found(&req.tenant))?;
        let (limit, priority) = (tenant.quota.limit_bytes, tenant.quota.priority);
        let candidates = self.candidates(req.device);
        let gran = candidates
            .iter()
            .map(|&d| st.pools()[d as usize].granularity())
            .max()
            .unwrap_or(2 << 20);
        let bytes = crate::units::round_up(req.bytes, gran).ok_or_else(|| {
            BrokerError::InvalidArgument(format!("size {} is too large", req.bytes))
        })?;
        let max_leasable = candidates
            .iter()
            .map(|&d| st.pools()[d as usize].leasable())
            .max()
            .unwrap_or(0);
        // Requests that can never fit fail at once, waiting or not.
        let device_caps = st
            .ledger()
            .device_caps_never_fit(&req.tenant, &candidates, bytes);
        let never = if bytes > limit {
            Some(BrokerError::QuotaExceeded {
                tenant: req.tenant.clone(),
                tier: Tier::Device,
                requested: bytes,
                held: tenant.usage.committed_bytes(),
                limit,
            })
        } else if device_caps.is_some() {
            device_caps
        } else if bytes > max_leasable {
            Some(BrokerError::TooLarge {
                requested: bytes,
                leasable: max_leasable,
                device: req.device,
            })
        } else {
            None
        };
        if let Some(err) = never {
            return Ok(Enqueued::Refused { bytes, err });
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
        let waiting = st
            .queue()
            .iter()
            .filter(|w| w.ask.tenant == req.tenant)
            .count();
        if waiting >= self.cfg.max_waiting_per_tenant {
            return Err(BrokerError::QueueFull {
                tenant: req.tenant.clone(),
                waiting,
                queue: Queue::Lease,
            });
        }
        let (tx, rx) = oneshot::channel();
        let id = st.queue_mut().push(ask, priority, tx);
        self.drain(&mut st);
        let queued = st.queue().contains(id);
        if queued && req.wait.is_zero() {
            let w = st.queue_mut().remove(id);
            let err = w.map(|w| self.exhausted(&st, &w.ask)).unwrap_or_else(|| {
                BrokerError::Internal("a refused request left the queue early".into())
            });
            return Ok(Enqueued::Refused { bytes, err });
        }
        Ok(Enqueued::Waiting {
            rx,
            id,
            bytes,
            queued,
        })
    }

    /// Checks a request's values (sizes, device, wait, label) without looking at state.
    pub fn validate(&self, req: &AcquireRequest) -> BrokerResult<()> {
        if req.bytes == 0 {
            return Err(BrokerError::InvalidArgument("bytes must be > 0".into()));
        }
        if req.bytes > MAX_REQUEST_BYTES {
            return Err(BrokerError::InvalidArgument(format!(
                "bytes {} is absurd (more than {})",
                req.bytes,
                show(MAX_REQUEST_BYTES)
            )));
        }
        if let Some(d) = req.device {
            if d as usize >= self.devices.len() {
                return Err(BrokerError::InvalidArgument(format!(
                    "unknown device {d}: this broker has {} device(s)",
                    self.devices.len()
                )));
            }
        }
        if req.wait > self.cfg.max_wait {
            return Err(BrokerError::InvalidArgument(format!(
                "wait {} ms exceeds the maximum {} ms",
                req.wait.as_millis(),
                self.cfg.max_wait.as_millis()
            )));
        }
        if req.label.len() > MAX_LABEL {
            return Err(BrokerError::InvalidArgument(format!(
                "label longer than {MAX_LABEL} bytes"
            )));
        }
        Ok(())
    }

    /// Devices a request may use: the one it named, or all; only those that admit new
    /// leases (not draining, not unhealthy: `availability.rs`).
    pub(crate) fn candidates(&self, device: Option<u32>) -> Vec<u32> {
        let avail = self.avail.read();
        match device {
            Some(d) => vec![d],
            None => (0..self.devices.len() as u32).collect(),
        }
        .into_iter()
        .filter(|&d| avail.admits(d))
        .collect()
    }

    /// Grants every waiting request that fits, in queue order. A request blocked by
    /// capacity blocks the devices it wants for everyone ranked after it (no overtaking);
    /// one blocked by its own quota blocks nobody.
    pub(crate) fn drain(self: &Arc<Self>, st: &mut State) {
        loop {
            st.queue_mut().remove_abandoned();
            if st.queue().is_empty() {
                return;
            }
            let order = st.queue().order(st.ledger());
            let mut blocked: HashSet<u32> = HashSet::new();
            // Heads blocked by capacity that other tenants of their priority may still
            // overtake (younger than the overtake age: `overtaking.rs`):
            // (waiter, priority, tenant, devices).
            let mut soft: Vec<(u64, i32, String, Vec<u32>)> = Vec::new();
            let mut granted = None;
            let mut reclaim_for = Vec::new();
            let now = Instant::now();
            for id in order {
                let Some(w) = st.queue().get(id) else {
                    continue;
                };
                if w.ask.check_charge(st.ledger()).is_err() {
                    continue;
                }
                // Devices where the tenant's per-device cap leaves room; none: blocked by
                // its own quota (blocks nobody).
                let all: Vec<u32> = self
                    .candidates(w.ask.device)
                    .into_iter()
                    .filter(|&d| {
                        st.ledger()
                            .check_device(&w.ask.tenant, d, w.ask.bytes)
                            .is_ok()
                    })
                    .collect();
                if all.is_empty() {
                    continue;
                }
                // Memory kept for a guarantee is its owner's: a request within its
                // guarantee is not held back behind others blocked on capacity.
                let guaranteed = st.ledger().within_guarantee(&w.ask.tenant, w.ask.bytes);
                // A head blocked by capacity lets requests of other tenants of its own
                // priority that fit go first while it is young; it keeps blocking its own
                // tenant (FIFO) and lower priorities.
                let soft_blocks = |d: &u32| {
                    soft.iter().any(|(_, p, t, ds)| {
                        ds.contains(d) && (*p != w.priority || *t == w.ask.tenant)
                    })
                };
                let open: Vec<u32> = all
                    .iter()
                    .copied()
                    .filter(|d| guaranteed || (!blocked.contains(d) && !soft_blocks(d)))
                    .collect();
                if open.is_empty() {
                    continue;
                }
                match fit(st, &w.ask, &open) {
                    Fit::Device(d) => {
                        granted = Some((id, d));
                        break;
                    }
                    Fit::NoCapacity => {
                        reclaim_for.push(id);
                        if super::overtaking::open_to_overtakers(
                            w.since,
                            now,
                            self.cfg.overtake_age,
                        ) {
                            soft.push((id, w.priority, w.ask.tenant.clone(), all));
                        } else {
                            blocked.extend(all);
                        }
                    }
                    Fit::GuaranteeHeld => reclaim_for.push(id),
                }
            }
            for id in reclaim_for {
                self.request_reclaim(st, id);
            }
            match granted.and_then(|(id, d)| st.queue_mut().remove(id).map(|w| (w, d))) {
                Some((w, d)) => self.grant(st, w.ask, w.priority, w.reply, d),
                None => return,
            }
        }
    }

    /// Reserves memory for `ask` on device `d` and finishes the grant: at once for a
    /// cached block that needs no device work, else on a task that does the device work.
    fn grant(self: &Arc<Self>, st: &mut State, ask: Ask, priority: i32, reply: Reply, d: u32) {
        if ask.process.is_some() {
            self.grant_process(st, ask, reply, d);
            return;
        }
        let source = match st.reserve_grant(&ask, d) {
            Ok(source) => source,
            Err(e) => {
                st.undraw(&ask);
                st.fx().reply(reply, Err(e));
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
                st.replace_cached(d, block);
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
            let r = self.commit_grant(st, &ask, priority, d, block);
            st.fx().reply(reply, r);
            return;
        }
        // Evicted blocks are freed before the lock is released (`effects.rs`): the device
        // thread runs jobs in order, so these frees happen before any allocation admitted
        // after this one. (Leaving them to the spawned task let a later grant's allocation
        // overtake them.)
        if let Source::Fresh { evicted } = &mut source {
            for b in std::mem::take(evicted) {
                st.fx().free(d, b);
            }
        }
        // The device work starts once the lock is released, after the frees above were
        // queued (`Effect::Materialize`).
        st.fx().push(Effect::Materialize(Box::new(PendingGrant {
            ask,
            priority,
            reply,
            device: d,
            source,
        })));
    }

    /// Runs `Effect::Materialize`: the device work of a grant on a task, then the grant is
    /// committed (or rolled back) under the lock and the caller answered.
    pub(super) fn spawn_grant(self: &Arc<Self>, p: PendingGrant) {
        let arb = self.clone();
        let PendingGrant {
            ask,
            priority,
            reply,
            device: d,
            source,
        } = p;
        tokio::spawn(async move {
            let made = arb.materialize(d, ask.bytes, source).await;
            let mut st = arb.lock();
            let r = match made {
                Ok(block) => arb.commit_grant(&mut st, &ask, priority, d, block),
                Err(e) => {
                    tracing::error!(device = d, tenant = %ask.tenant, error = %e, "device work for a grant failed");
                    st.unreserve_grant(&ask, d, None);
                    Err(e)
                }
            };
            st.fx().reply(reply, r);
            arb.drain(&mut st);
        });
    }

    /// Does the device work a reservation needs: scrub a reused block of another tenant,
    /// or allocate, zero (if needed) and export a fresh one.
    async fn materialize(&self, d: u32, bytes: u64, source: Source) -> BrokerResult<Block> {
        let thread = &self.devices[d as usize].thread;
        match source {
            Source::Cached { block, .. } => {
                let (block, r) = thread
                    .call(move |dev| {
                        let r = dev.scrub(&block.alloc);
                        (block, r)
                    })
                    .await?;
                match r {
                    Ok(()) => Ok(Block {
                        last_tenant: None,
                        ..block
                    }),
                    Err(e) => {
                        self.free_on_device(d, block);
                        Err(e.into())
                    }
                }
            }
            // Evicted blocks were already queued for freeing by `grant`, in order.
            Source::Fresh { .. } => thread
                .call(move |dev| fresh_block(dev, bytes))
                .await?
                .map_err(BrokerError::from),
        }
    }

    /// Turns a reservation into a lease of the session (or gives it back if the session
    /// ended meanwhile, or the broker drains): `State::commit_grant`.
    fn commit_grant(
        self: &Arc<Self>,
        st: &mut State,
        ask: &Ask,
        priority: i32,
        d: u32,
        block: Block,
    ) -> BrokerResult<LeaseView> {
        st.commit_grant(ask, priority, d, block, self.is_draining())
            .map_err(|why| match why {
                NotCommitted::Draining => BrokerError::ShuttingDown,
                NotCommitted::SessionGone => session_not_found(ask.session),
            })
    }

    /// Why `ask` does not fit now, with the numbers.
    pub(crate) fn exhausted(&self, st: &State, ask: &Ask) -> BrokerError {
        // The tenant's own limits first (bytes or lease count): they say it precisely.
        if let Err(e) = ask.check_charge(st.ledger()) {
            return e;
        }
        // Its caps on every device it may use: the first device's refusal says it.
        let open = self.candidates(ask.device);
        let capped: Vec<BrokerError> = open
            .iter()
            .filter_map(|&d| st.ledger().check_device(&ask.tenant, d, ask.bytes).err())
            .collect();
        if !open.is_empty() && capped.len() == open.len() {
            if let Some(e) = capped.into_iter().next() {
                return e;
            }
        }
        let tenant = st.ledger().get(&ask.tenant);
        let (held, limit) = tenant
            .map(|t| (t.usage.committed_bytes(), t.quota.limit_bytes))
            .unwrap_or((0, 0));
        let devices = self
            .candidates(ask.device)
            .iter()
            .map(|&d| {
                let p = &st.pools()[d as usize];
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
            guaranteed: st.ledger().others_unused_guarantees(&ask.tenant),
            held,
            limit,
            waiting: st.queue().len(),
        }
    }

    async fn fallback_or(
        self: &Arc<Self>,
        req: &AcquireRequest,
        bytes: u64,
        err: BrokerError,
    ) -> BrokerResult<Granted> {
        if req.fallback_host && self.host_tier.is_some() {
            self.acquire_host(req, bytes).await.map(Granted::Lease)
        } else {
            Err(err)
        }
    }

    /// Grants host shared memory instead of device memory, under the host limit.
    pub(crate) async fn acquire_host(
        self: &Arc<Self>,
        req: &AcquireRequest,
        bytes: u64,
    ) -> BrokerResult<LeaseView> {
        let Some(host) = self.host_tier.clone() else {
            return Err(BrokerError::HostFallbackFailed {
                requested: bytes,
                cause: "this broker has no host tier".into(),
            });
        };
        self.lock().charge_host(&req.tenant, bytes)?;
        let made = host
            .call(move |dev| fresh_block(dev, bytes))
            .await
            .map_err(BrokerError::from)
            .and_then(|r| r.map_err(BrokerError::from))
            .map_err(|e| BrokerError::HostFallbackFailed {
                requested: bytes,
                cause: e.to_string(),
            });
        self.lock().commit_host(req, bytes, made)
    }

    pub(crate) fn free_host(&self, block: Block) {
        if let Some(h) = &self.host_tier {
            let _ = h.submit(move |dev| {
                if let Err(e) = dev.free(block.alloc) {
                    tracing::error!(error = %e, "freeing a host-fallback block failed");
                }
            });
        }
    }
}

/// Allocates a block, zeroes it unless the device guarantees fresh memory reads as zeros
/// (a new `cuMemAlloc` block may hold an earlier owner's bytes), and exports it. Nothing
/// leaks on failure. Runs on the device thread.
fn fresh_block(
    dev: &mut dyn crate::device::Device,
    bytes: u64,
) -> Result<Block, crate::device::DeviceError> {
    let a = dev.alloc(bytes)?;
    let zeroed = if dev.fresh_is_zeroed() {
        Ok(())
    } else {
        dev.scrub(&a)
    };
    match zeroed.and_then(|()| dev.export(&a)) {
        Ok(handle) => Ok(Block {
            alloc: a,
            handle,
            last_tenant: None,
        }),
        Err(e) => {
            let _ = dev.free(a);
            Err(e)
        }
    }
}

/// Finds a device for `ask` among `open`: one with a cached block of that exact size
/// first (no driver call), else the one with the most unpromised memory.
fn fit(st: &State, ask: &Ask, open: &[u32]) -> Fit {
    let fitting: Vec<u32> = open
        .iter()
        .copied()
        .filter(|&d| st.pools()[d as usize].available() >= ask.bytes)
        .collect();
    if fitting.is_empty() {
        return Fit::NoCapacity;
    }
    let node_free = st
        .pools()
        .iter()
        .map(|p| p.available())
        .fold(0, u64::saturating_add);
    let others_guarantees = st.ledger().others_unused_guarantees(&ask.tenant);
    if node_free.saturating_sub(others_guarantees) < ask.bytes {
        return Fit::GuaranteeHeld;
    }
    let best = fitting.iter().copied().max_by_key(|&d| {
        let p = &st.pools()[d as usize];
        (p.has_cached(ask.bytes), p.available(), u32::MAX - d)
    });
    best.map(Fit::Device).unwrap_or(Fit::NoCapacity)
}
