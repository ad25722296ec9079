//! Grants: a device grant reserves its bytes (tenant and pool), is committed into a lease
//! once its memory exists (at once for a cached block of the same tenant, else after the
//! shell's device work: [`State::finish_grant`] commits it and answers its waiter), or is
//! given back; a host-fallback lease is charged while its
//! memory is made, then becomes a lease or is uncharged.

use super::State;
use crate::effects::Counted;
use crate::error::{BrokerError, BrokerResult};
use crate::lease::{Lease, LeaseState, LeaseView};
use crate::ledger::Tier;
use crate::pool::{Block, Source};
use crate::queue::{Ask, WaiterId};
use crate::request::ValidRequest;

/// Why a reserved grant could not become a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotCommitted {
    /// Its session ended (or is another tenant's).
    SessionGone,
    /// The broker is shutting down.
    ShuttingDown,
}

impl NotCommitted {
    /// The error the waiter of a grant of `session` gets.
    pub fn into_error(self, session: uuid::Uuid) -> crate::error::BrokerError {
        match self {
            NotCommitted::ShuttingDown => crate::error::BrokerError::ShuttingDown,
            NotCommitted::SessionGone => crate::error::session_not_found(session),
        }
    }
}

impl State {
    /// Reserves `ask.bytes` for its tenant on device `d` (ledger and pool together) and
    /// says where the memory comes from. Refused (nothing reserved) when the tenant's
    /// quota or device cap does not allow it.
    pub fn reserve_grant(&mut self, ask: &Ask, d: u32) -> BrokerResult<Source> {
        self.ledger.reserve(&ask.tenant, d, ask.bytes)?;
        let pool = &mut self.pools[d as usize];
        Ok(if ask.draw.is_some() {
            // Drawn from a process reservation (`draw`): room the tenant held already.
            pool.reserve_drawn(ask.bytes, &ask.tenant)
        } else {
            pool.reserve(ask.bytes, &ask.tenant)
        })
    }

    /// A reserved grant did not happen: its bytes go back (with the block it had, if any,
    /// into the cache), and a draw from a process reservation goes back into its room.
    pub fn unreserve_grant(&mut self, ask: &Ask, d: u32, block: Option<Block>) {
        self.ledger.unreserve(&ask.tenant, d, ask.bytes);
        self.pools[d as usize].unreserve(ask.bytes, block);
        self.undraw(ask);
    }

    /// A cached block handed to a grant of another tenant was replaced by a fresh one
    /// (`scrubbed`: it was scrubbed first); the block is freed.
    pub fn replace_cached(&mut self, d: u32, block: Block) {
        self.fx.count(Counted::CrossTenantFresh);
        self.pools[d as usize].note_replaced(true);
        self.fx.free(d, block);
    }

    /// Turns a reserved grant into a lease of its session, holding `block`; or, when its
    /// session is gone or the broker shuts down, gives the reservation back (the block into
    /// the cache) and says why.
    pub fn commit_grant(
        &mut self,
        ask: &Ask,
        priority: i32,
        d: u32,
        block: Block,
        shutting_down: bool,
    ) -> Result<LeaseView, NotCommitted> {
        let alive = self
            .sessions
            .get(&ask.session)
            .is_some_and(|s| s.tenant == ask.tenant);
        if !alive || shutting_down {
            self.unreserve_grant(ask, d, Some(block));
            return Err(if alive {
                NotCommitted::ShuttingDown
            } else {
                NotCommitted::SessionGone
            });
        }
        self.ledger.commit(&ask.tenant, ask.bytes);
        self.pools[d as usize].commit(ask.bytes);
        self.fx.count(Counted::Granted(Tier::Device));
        let seq = self.next_seq();
        let lease = Lease {
            id: uuid::Uuid::new_v4(),
            tenant: ask.tenant.clone(),
            session: ask.session,
            device: d,
            tier: Tier::Device,
            requested_bytes: ask.requested_bytes,
            label: ask.label.clone(),
            reclaimable: ask.reclaimable,
            created: self.clock.wall,
            state: LeaseState::Active,
            priority,
            seq,
            block,
            reservation: ask.draw,
            live: crate::lease::LiveMark::default(),
        };
        tracing::debug!(lease = %lease.id, tenant = %ask.tenant, session = %ask.session, device = d, bytes = ask.bytes, "lease granted");
        Ok(self.insert_lease(lease))
    }

    /// The device work of a reserved grant for waiter `to` is done: with its memory
    /// (`made` is `Ok`) the grant is committed ([`State::commit_grant`]); otherwise, or
    /// when it cannot be committed, the reservation goes back. Either way the waiter is
    /// answered. The queue runs after the hold (a grant given back frees its room).
    pub fn finish_grant(
        &mut self,
        ask: &Ask,
        priority: i32,
        d: u32,
        made: BrokerResult<Block>,
        shutting_down: bool,
        to: WaiterId,
    ) {
        self.wake_queue();
        let r = match made {
            Ok(block) => self
                .commit_grant(ask, priority, d, block, shutting_down)
                .map_err(|why| why.into_error(ask.session)),
            Err(e) => {
                self.unreserve_grant(ask, d, None);
                Err(e)
            }
        };
        self.fx.reply(to, r);
    }

    /// A reserved grant for waiter `to` is given up before its device work (`block`: the
    /// cached block it was to reuse, back into the cache): the reservation goes back and
    /// the waiter gets `err`. Does not run the queue.
    pub fn refuse_grant(
        &mut self,
        ask: &Ask,
        d: u32,
        block: Option<Block>,
        to: WaiterId,
        err: BrokerError,
    ) {
        self.unreserve_grant(ask, d, block);
        self.fx.reply(to, Err(err));
    }

    /// Charges `bytes` of host memory to `tenant` while it is being made.
    pub fn charge_host(&mut self, tenant: &str, bytes: u64) -> BrokerResult<()> {
        self.ledger.charge_host(tenant, bytes)?;
        self.host_in_flight(tenant, bytes, true);
        Ok(())
    }

    /// A charged host block was made (`Ok`) or not: it becomes a lease of `ask`'s session,
    /// or is uncharged (and the block freed when its session is gone).
    pub fn commit_host(
        &mut self,
        ask: &ValidRequest,
        bytes: u64,
        made: BrokerResult<Block>,
    ) -> BrokerResult<LeaseView> {
        self.host_in_flight(&ask.tenant, bytes, false);
        let block = match made {
            Ok(b) => b,
            Err(e) => {
                self.ledger.uncharge_host(&ask.tenant, bytes);
                return Err(e);
            }
        };
        let alive = self
            .sessions
            .get(&ask.session)
            .is_some_and(|s| s.tenant == ask.tenant);
        if !alive {
            self.ledger.uncharge_host(&ask.tenant, bytes);
            self.fx.free_host(block);
            return Err(crate::error::session_not_found(ask.session));
        }
        let priority = self
            .ledger
            .get(&ask.tenant)
            .map(|t| t.quota.priority)
            .unwrap_or(0);
        let seq = self.next_seq();
        let lease = Lease {
            id: uuid::Uuid::new_v4(),
            tenant: ask.tenant.clone(),
            session: ask.session,
            device: 0,
            tier: Tier::Host,
            requested_bytes: ask.bytes,
            label: ask.label.clone(),
            reclaimable: ask.reclaimable,
            created: self.clock.wall,
            state: LeaseState::Active,
            priority,
            seq,
            block,
            reservation: None,
            live: crate::lease::LiveMark::default(),
        };
        let view = self.insert_lease(lease);
        self.fx.count(Counted::Granted(Tier::Host));
        Ok(view)
    }
}
