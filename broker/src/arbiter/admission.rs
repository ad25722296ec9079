//! Admission, the shell's side: a request is checked (shape, session, devices, what can
//! never fit, a draw from a process reservation), offered to the queue, and its caller
//! waits for the answer. What fits where, in which order, and whose memory is asked back
//! is the core's queue policy (`state/queue.rs`): [`Arbiter::run_queue`], called by the
//! lock guard, reads what the policy needs from outside the state (which devices admit
//! leases, the clocks, the tunables) and runs it. The device work of a grant (allocate,
//! scrub) runs here on a task, outside the lock, on memory already reserved.

use super::effects::PendingGrant;
use super::queue::{Granted, WaiterId};
use super::state::{Clock, Enqueued, QueueEnv};
use super::{session_not_found, AcquireRequest, Arbiter, State, MAX_LABEL};
use crate::error::{BrokerError, BrokerResult};
use crate::lease::LeaseView;
use crate::pool::{Block, Source};
use gpu_broker_core::request::{RequestBounds, ValidRequest};
use std::sync::Arc;
use std::time::Instant;

/// A request offered to the queue, seen from the caller.
enum Offered {
    Waiting {
        rx: tokio::sync::oneshot::Receiver<super::outbox::Answer>,
        id: WaiterId,
        bytes: u64,
        /// Still in the queue after the first pass (it did not fit at once).
        queued: bool,
    },
    Refused {
        bytes: u64,
        err: BrokerError,
    },
    /// A process reservation may cover the request: offer it again with the process tree
    /// of its session's peer (this pid), read from `/proc` outside the lock.
    NeedsLineage(u32),
}

/// Removes a waiter from the queue, and its reply channel, if the acquiring future is
/// dropped (caller gone); a grant already sent but not yet received is given back. Once
/// the answer is received there is nothing to undo (an answered waiter has left the queue
/// and its channel the outbox), and the drop takes no lock.
struct WaiterGuard {
    arb: Arc<Arbiter>,
    id: WaiterId,
    rx: tokio::sync::oneshot::Receiver<super::outbox::Answer>,
    answered: bool,
}

impl Drop for WaiterGuard {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        // Closed first: an answer sent from now on comes back to its sender, which gives
        // it back (`Effect::Reply`); one already sent is taken here.
        self.rx.close();
        let unreceived = self.rx.try_recv().ok();
        {
            let mut st = self.arb.lock();
            self.arb.outbox.forget_reply(self.id);
            st.abandon(self.id);
        }
        if let Some(Ok(granted)) = unreceived {
            self.arb.executor().give_back_grant(granted);
        }
    }
}

impl Arbiter {
    /// Checks `req`'s values ([`Arbiter::validate`]), then [`Arbiter::acquire_validated`].
    pub async fn acquire(self: &Arc<Self>, req: AcquireRequest) -> BrokerResult<LeaseView> {
        match self.validate(req) {
            Ok(req) => self.acquire_validated(req).await,
            Err(e) => {
                let refused = Err(e);
                self.metrics.acquired(&refused, std::time::Duration::ZERO);
                refused
            }
        }
    }

    /// Grants a lease now, after waiting up to `req.wait`, or fails with the reason.
    /// Counted in the metrics: latency by outcome, refusals by reason, time to grant of
    /// requests that waited.
    pub(crate) async fn acquire_validated(
        self: &Arc<Self>,
        req: ValidRequest,
    ) -> BrokerResult<LeaseView> {
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
    pub(super) async fn acquire_untimed(
        self: &Arc<Self>,
        req: ValidRequest,
        process: Option<crate::reservations::ProcessAsk>,
        waited: &mut bool,
    ) -> BrokerResult<Granted> {
        self.lifecycle.refuse_new_work()?;
        let mut queued = self.enqueue(&req, process, None)?;
        if let Offered::NeedsLineage(pid) = queued {
            // Whose process tree the caller is in, read from /proc outside the state lock.
            let lineage = super::reservations::caller_lineage(pid);
            queued = self.enqueue(&req, None, Some(&lineage))?;
        }
        let (rx, id, bytes) = match queued {
            Offered::Waiting {
                rx,
                id,
                bytes,
                queued,
            } => {
                *waited = queued;
                (rx, id, bytes)
            }
            Offered::Refused { bytes, err } => return self.fallback_or(&req, bytes, err).await,
            Offered::NeedsLineage(_) => {
                return Err(BrokerError::Internal(
                    "a request offered with its process tree asked for it again".into(),
                ))
            }
        };
        let mut guard = WaiterGuard {
            arb: self.clone(),
            id,
            rx,
            answered: false,
        };
        let rx = &mut guard.rx;
        let outcome = if req.wait.is_zero() {
            rx.await
        } else {
            match tokio::time::timeout(req.wait, &mut *rx).await {
                Ok(r) => r,
                Err(_) => {
                    let lost = {
                        let mut st = self.lock();
                        let avail = self.avail.read();
                        let lost = st.give_up(id, &avail);
                        // Before the guard's drop, which runs the queue and reads it too.
                        drop(avail);
                        lost
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
                        None => rx.await,
                    }
                }
            }
        };
        guard.answered = outcome.is_ok();
        outcome.unwrap_or_else(|_| Err(BrokerError::Internal("grant was dropped".into())))
    }

    /// Checks the request against what never fits, queues it and runs the queue once.
    /// A lease request is first looked at against the process reservations: with
    /// `lineage` (its process tree) when the caller has read it, else, while a reservation
    /// exists, the answer is `NeedsLineage` and nothing is queued.
    fn enqueue(
        self: &Arc<Self>,
        req: &ValidRequest,
        process: Option<crate::reservations::ProcessAsk>,
        lineage: Option<&[u32]>,
    ) -> BrokerResult<Offered> {
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
            let lineage = match lineage {
                Some(l) => l,
                None => match super::reservations::lineage_needed(&st, req) {
                    Some(pid) => return Ok(Offered::NeedsLineage(pid)),
                    None => &[],
                },
            };
            if let Some(drawn) = super::reservations::draw_from_reservation(&mut st, req, lineage)?
            {
                let id = st.next_waiter_id();
                let rx = self.outbox.register_reply(&st, id);
                let bytes = drawn.ask.bytes;
                let shutting_down = self.lifecycle.is_shutting_down();
                st.grant_waiter(id, drawn.ask, drawn.priority, drawn.device, shutting_down);
                return Ok(Offered::Waiting {
                    rx,
                    id,
                    bytes,
                    queued: false,
                });
            }
        } else {
            super::reservations::check_process_ask(&st, req)?;
        }
        let (bytes, offered) = {
            let avail = self.avail.read();
            let env = self.queue_env(&avail, st.clock());
            st.offer(req, process, self.cfg.max_waiting_per_tenant, &env)?
        };
        Ok(match offered {
            // Every answer, a grant made in this hold too, goes through the reply channel:
            // it is in place before the lock is released, so before any answer the queue
            // pushed for it runs.
            Enqueued::Waiting { id, queued } => Offered::Waiting {
                rx: self.outbox.register_reply(&st, id),
                id,
                bytes,
                queued,
            },
            Enqueued::Refused(err) => Offered::Refused { bytes, err },
        })
    }

    /// Checks a request's values (sizes, device, wait, label) against this broker's
    /// devices and settings, without looking at state: once per request, where it enters;
    /// every path after takes the [`ValidRequest`].
    pub(crate) fn validate(&self, req: AcquireRequest) -> BrokerResult<ValidRequest> {
        req.validate(&RequestBounds {
            devices: self.devices.len(),
            max_wait: self.cfg.max_wait,
            max_label: MAX_LABEL,
        })
    }

    /// What the core's queue policy reads from outside the state, at the hold's time
    /// (`clock`: read when the lock was taken).
    fn queue_env<'a>(
        &self,
        avail: &'a crate::availability::Availability,
        clock: Clock,
    ) -> QueueEnv<'a> {
        QueueEnv {
            avail,
            now: clock.now,
            wall: clock.wall,
            overtake_age: self.cfg.overtake_age,
            reclaim_deadline: self.cfg.reclaim_deadline,
            terminating: self.cfg.reclaim_policy == super::ReclaimPolicy::Terminate,
            shutting_down: self.lifecycle.is_shutting_down(),
        }
    }

    /// Runs the queue (`State::run_queue`): grants what fits, refuses what never can,
    /// asks memory back for the rest. The lock guard calls it when a transition of the
    /// hold asked for it (`State::take_queue_due`): every release and every change that
    /// may let a waiter in.
    pub(super) fn run_queue(&self, st: &mut State) {
        if st.queue().is_empty() {
            return;
        }
        let avail = self.avail.read();
        let env = self.queue_env(&avail, st.clock());
        st.run_queue(&env);
    }

    /// Runs `Effect::Materialize`: the device work of a grant on a task of the main
    /// runtime ([`Lifecycle::effects_runtime`](super::Lifecycle::effects_runtime), whichever runtime ran the queue), then the
    /// grant is committed (or rolled back) under the lock and the caller answered.
    pub(super) fn spawn_grant(self: &Arc<Self>, p: PendingGrant) {
        let arb = self.clone();
        let PendingGrant {
            ask,
            priority,
            to,
            device: d,
            source,
        } = p;
        let Some(rt) = self.lifecycle.effects_runtime() else {
            // No runtime to do the device work on: the reservation is rolled back.
            tracing::error!(device = d, tenant = %ask.tenant, "no runtime for a grant's device work");
            let mut st = self.lock();
            let block = match source {
                Source::Cached { block, .. } => Some(block),
                Source::Fresh { .. } => None,
            };
            st.refuse_grant(
                &ask,
                d,
                block,
                to,
                BrokerError::Internal("no runtime for the grant's device work".into()),
            );
            return;
        };
        rt.spawn(async move {
            let made = arb.materialize(d, ask.bytes, source).await;
            match &made {
                // Logged by the budget (the first and one in a thousand).
                Ok(_) | Err(BrokerError::OutOfDescriptors { .. }) => {}
                Err(e) => {
                    tracing::error!(device = d, tenant = %ask.tenant, error = %e, "device work for a grant failed")
                }
            }
            let mut st = arb.lock();
            st.finish_grant(&ask, priority, d, made, arb.lifecycle().is_shutting_down(), to);
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
                        reached: Default::default(),
                        ..block
                    }),
                    Err(e) => {
                        self.free_on_device(d, block);
                        Err(e.into())
                    }
                }
            }
            // Evicted blocks were already queued for freeing by `grant`, in order.
            Source::Fresh { .. } => match self.fresh_counted(d, bytes).await {
                // Cached blocks keep descriptors only to be reused: freed, they make room.
                Err(BrokerError::OutOfDescriptors { .. })
                    if self.evict_for_descriptors(d, bytes).await =>
                {
                    self.fresh_counted(d, bytes).await
                }
                made => made,
            },
        }
    }

    /// A fresh block on device `d`, its descriptor counted: refused when it would eat into
    /// the descriptors kept for connections (`fd_budget.rs`). Counted on the device thread,
    /// so the frees queued before it (evicted blocks) have given theirs back.
    async fn fresh_counted(&self, d: u32, bytes: u64) -> BrokerResult<Block> {
        let job = counted_fresh(self.fds.clone(), self.watchers.processes(), bytes);
        match self.devices[d as usize].thread.call(job).await? {
            Ok(block) => Ok(block),
            Err(unmade) => {
                let (e, unmade) = *unmade;
                if let Some(a) = unmade {
                    self.free_on_device(d, a);
                }
                Err(e)
            }
        }
    }

    /// Out of descriptors: frees cached blocks (`bytes` of them, of device `d` first, else
    /// of the others) and waits until their descriptors are closed. True when any were.
    async fn evict_for_descriptors(&self, d: u32, bytes: u64) -> bool {
        let others: Vec<u32> = {
            let mut st = self.lock();
            if st.evict_cached(d, bytes) > 0 {
                // Their frees run on `d`'s thread before the next job there.
                return true;
            }
            // The first other device that frees something: no more is evicted than needed.
            (0..self.devices.len() as u32)
                .find(|&i| i != d && st.evict_cached(i, bytes) > 0)
                .into_iter()
                .collect()
        };
        for &i in &others {
            // A job queued after the frees: done once they are.
            let _ = self.devices[i as usize].thread.call(|_| ()).await;
        }
        !others.is_empty()
    }

    async fn fallback_or(
        self: &Arc<Self>,
        req: &ValidRequest,
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
    pub(super) async fn acquire_host(
        self: &Arc<Self>,
        req: &ValidRequest,
        bytes: u64,
    ) -> BrokerResult<LeaseView> {
        let Some(host) = self.host_tier.clone() else {
            return Err(BrokerError::HostFallbackFailed {
                requested: bytes,
                cause: "this broker has no host tier".into(),
            });
        };
        self.lock().charge_host(&req.tenant, bytes)?;
        let job = counted_fresh(self.fds.clone(), self.watchers.processes(), bytes);
        let made = host
            .call(job)
            .await
            .map_err(BrokerError::from)
            .and_then(|r| {
                r.map_err(|unmade| {
                    let (e, unmade) = *unmade;
                    if let Some(a) = unmade {
                        self.free_host(a);
                    }
                    e
                })
            })
            .map_err(|e| match e {
                e @ BrokerError::OutOfDescriptors { .. } => e,
                e => BrokerError::HostFallbackFailed {
                    requested: bytes,
                    cause: e.to_string(),
                },
            });
        self.lock().commit_host(req, bytes, made)
    }

    /// Queues a free of host-fallback memory on the host tier's thread: the one place it is
    /// freed (reached through `Effect::FreeHost`, and by a host grant whose device work failed).
    pub(super) fn free_host(&self, what: impl Into<super::Unneeded>) {
        if let Some(h) = &self.host_tier {
            let what = what.into();
            let counted = matches!(what, super::Unneeded::Block(_)).then(|| self.fds.adopt());
            let revoke = self.lifecycle.frees_revoke();
            let _ = h.submit(move |dev| {
                let _counted = counted;
                // A block's file closes here, after the free.
                let (alloc, _handle) = what.split();
                if revoke {
                    // Host-tier memfds refuse every seal: the truncation always holds.
                    super::revoke_before_free(dev, &alloc, u32::MAX);
                }
                #[allow(clippy::disallowed_methods, reason = "the host tier's executor")]
                let freed = dev.free(alloc);
                if let Err(e) = freed {
                    tracing::error!(error = %e, "freeing a host-fallback block failed");
                }
            });
        }
    }
}

/// Why a fresh block was not made, and the allocation to free if one was made.
type Unmade = Box<(BrokerError, Option<crate::device::Allocation>)>;

/// The device job of a fresh block whose descriptor is counted in `fds` (with `watched`
/// pidfds counted elsewhere): refused before anything is allocated when it would eat into
/// the reserve; given back when nothing was made.
fn counted_fresh(
    fds: Arc<crate::fd_budget::FdBudget>,
    watched: usize,
    bytes: u64,
) -> impl FnOnce(&mut dyn crate::device::Device) -> Result<Block, Unmade> + Send + 'static {
    move |dev| {
        fds.take(watched)
            .map_err(|refused| Box::new((refused, None)))?;
        fresh_block(dev, bytes).map_err(|(e, unmade)| {
            fds.give_back();
            Box::new((BrokerError::from(e), unmade))
        })
    }
}

/// Allocates a block, zeroes it unless the device guarantees fresh memory reads as zeros
/// (a new `cuMemAlloc` block may hold an earlier owner's bytes), and exports it. Runs on
/// the device thread. When the zeroing or the export fails the allocation comes back with
/// the error, for the caller to free through the one executor (nothing frees here).
fn fresh_block(
    dev: &mut dyn crate::device::Device,
    bytes: u64,
) -> Result<
    Block,
    (
        crate::device::DeviceError,
        Option<crate::device::Allocation>,
    ),
> {
    // Nothing allocated: nothing to free.
    let a = dev.alloc(bytes).map_err(|e| (e, None))?;
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
            reached: Default::default(),
        }),
        Err(e) => Err((e, Some(a))),
    }
}
