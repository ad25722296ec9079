//! Compute turns through the arbiter: checks the session, hands the request to the
//! [`crate::scheduler`], waits for the grant with a deadline, and never leaves a turn held
//! by a caller that went away.

use super::{session_not_found, Arbiter};
use crate::error::{BrokerError, BrokerResult};
use crate::scheduler::{Requester, TurnEnd, TurnGrant};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use uuid::Uuid;

/// Cancels a turn request whose caller went away; a grant that arrived for nobody is
/// released at once.
struct TurnWait {
    arb: Arc<Arbiter>,
    device: u32,
    waiter: u64,
    rx: Option<oneshot::Receiver<BrokerResult<TurnGrant>>>,
    tenant: String,
}

impl Drop for TurnWait {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        if !self.arb.scheduler.cancel(self.device, self.waiter) {
            if let Ok(Ok(grant)) = rx.try_recv() {
                let _ = self.arb.scheduler.release(&self.tenant, grant.turn_id);
            }
        }
    }
}

impl Arbiter {
    /// Grants the compute turn on `device` now, after waiting up to `wait`, or says why not.
    pub async fn acquire_turn(
        self: &Arc<Self>,
        tenant: &str,
        session: Uuid,
        device: u32,
        wait: Duration,
    ) -> BrokerResult<TurnGrant> {
        self.check_not_draining()?;
        if wait > self.cfg.max_wait {
            return Err(BrokerError::InvalidArgument(format!(
                "wait {} ms exceeds the maximum {} ms",
                wait.as_millis(),
                self.cfg.max_wait.as_millis()
            )));
        }
        let who = {
            let mut st = self.lock();
            let weight = st
                .ledger()
                .get(tenant)
                .map(|t| t.quota.turn_weight.max(1))
                .unwrap_or(1);
            let s = st
                .session_mut(&session)
                .filter(|s| s.tenant == tenant)
                .ok_or_else(|| session_not_found(session))?;
            s.last_seen.touch();
            // Open while the session is (its mailbox closes under the state lock).
            let events = self
                .outbox
                .sender(&session)
                .ok_or_else(|| session_not_found(session))?;
            Requester {
                tenant: tenant.to_string(),
                session,
                weight,
                events,
            }
        };
        let pending =
            self.scheduler
                .request_capped(device, who, self.cfg.max_waiting_per_tenant)?;
        let mut guard = TurnWait {
            arb: self.clone(),
            device,
            waiter: pending.waiter,
            rx: Some(pending.rx),
            tenant: tenant.to_string(),
        };
        let busy = |arb: &Arbiter| {
            let (holder, waiting) = arb.scheduler.device_state(device);
            BrokerError::TurnBusy {
                device,
                holder: holder.unwrap_or_default(),
                waiting,
            }
        };
        let Some(rx) = guard.rx.as_mut() else {
            return Err(BrokerError::Internal("turn request lost".into()));
        };
        let outcome = if wait.is_zero() {
            rx.try_recv().ok()
        } else {
            tokio::time::timeout(wait, &mut *rx).await.ok().map(|r| {
                r.unwrap_or_else(|_| Err(BrokerError::Internal("turn grant dropped".into())))
            })
        };
        match outcome {
            Some(r) => {
                guard.rx = None;
                r
            }
            None => {
                if self.scheduler.cancel(device, pending.waiter) {
                    guard.rx = None;
                    let busy = busy(self);
                    Err(if wait.is_zero() {
                        busy
                    } else {
                        BrokerError::WaitExpired {
                            waited_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                            cause: Box::new(busy),
                        }
                    })
                } else {
                    // Granted just now: the grant is in the channel.
                    let rx = guard.rx.take();
                    match rx {
                        Some(rx) => rx.await.unwrap_or_else(|_| {
                            Err(BrokerError::Internal("turn grant dropped".into()))
                        }),
                        None => Err(BrokerError::Internal("turn request lost".into())),
                    }
                }
            }
        }
    }

    /// The holder gives its compute turn back.
    pub fn release_turn(&self, tenant: &str, turn_id: Uuid) -> BrokerResult<TurnEnd> {
        self.scheduler.release(tenant, turn_id)
    }

    /// The holder gives its compute turn back; its `ReleaseTurn` arrived at `received`
    /// (the start of the hand-off to the next waiter).
    pub fn release_turn_received(
        self: &Arc<Self>,
        tenant: &str,
        turn_id: Uuid,
        received: Instant,
    ) -> BrokerResult<TurnEnd> {
        let end = self.scheduler.release_received(tenant, turn_id, received)?;
        if let Some(until) = end.kept_until {
            // The slot is kept for the releaser's next request; if none comes in time it
            // goes to the next waiter then (not at the next tick).
            let arb = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep_until(until.into()).await;
                arb.scheduler.expire_kept();
            });
        }
        Ok(end)
    }

    /// A turn grant is being sent: its hand-off time, if a release freed its slot.
    pub fn observe_turn_handoff(&self, grant: &TurnGrant) {
        self.scheduler.observe_handoff(grant);
    }

    /// Holders of compute turns on `device` now.
    pub fn turn_holders(&self, device: u32) -> u32 {
        self.scheduler.holders(device)
    }
}
