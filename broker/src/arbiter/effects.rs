//! Effects: what a state transition asks the shell to do once it has decided. A transition
//! (a method on `State`, or an arbiter method holding the state lock) never frees device
//! memory, kills a process, spawns a watcher, answers a waiter or tells a session itself:
//! it pushes an [`Effect`] onto `State::fx`. The lock guard ([`Locked`], from
//! `Arbiter::lock`) runs them when it is dropped:
//!
//! 1. the byte-state invariant is checked (debug builds: `State::check_invariant`);
//! 2. device frees are queued on their device threads (a channel send, never a driver call)
//!    *before* the lock is released, so a free always reaches the device ahead of any
//!    allocation admitted after it (the device thread runs jobs in order);
//! 3. the lock is released;
//! 4. everything else runs: kills, watchers, replies, session events, ticket and turn
//!    clean-up, counters.
//!
//! [`Arbiter::execute`] is the one executor: every device free of the broker goes through
//! it (`Effect::Free`, `Effect::FreeHost`).

use super::queue::{Granted, Reply};
use super::{Arbiter, State};
use crate::error::BrokerResult;
use crate::lease::LeaseView;
use crate::ledger::Tier;
use crate::metrics::Revocation;
use crate::pool::Block;
use crate::session::SessionEvent;
use parking_lot::MutexGuard;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// One thing a transition asks the shell to do.
#[derive(Debug)]
pub(crate) enum Effect {
    /// Free a block on device `device` (queued before the lock is released).
    Free { device: u32, block: Block },
    /// Free a host-fallback block (queued before the lock is released).
    FreeHost { block: Block },
    /// Kill the holder of a revoked lease (`--reclaim-policy terminate`).
    Kill { pid: u32 },
    /// Watch quarantined memory: lift it when `pid` exits (or after the quarantine timeout
    /// when the pid is unknown); `stop` ends the watcher.
    WatchQuarantine {
        lease: Uuid,
        pid: Option<u32>,
        stop: CancellationToken,
    },
    /// Answer a waiting `acquire`; a grant nobody receives is released at once.
    Reply {
        to: Reply,
        result: BrokerResult<Granted>,
    },
    /// Tell a session something (its event stream).
    Notify {
        to: mpsc::UnboundedSender<SessionEvent>,
        event: SessionEvent,
    },
    /// A lease ended: its undelivered tickets go.
    ForgetTickets { lease: Uuid },
    /// A session ended: its compute turns and turn requests go.
    EndTurns { session: Uuid },
    /// Count something in the metrics.
    Count(Counted),
    /// Do a grant's device work (allocate, or scrub a reused block) on a task, then commit
    /// it. Runs after the lock is released, so after the frees queued under it.
    Materialize(Box<PendingGrant>),
}

/// A grant whose memory is reserved (ledger and pool) and needs device work.
#[derive(Debug)]
pub(crate) struct PendingGrant {
    pub ask: super::queue::Ask,
    pub priority: i32,
    pub reply: Reply,
    pub device: u32,
    pub source: crate::pool::Source,
}

/// What a transition counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counted {
    Granted(Tier),
    Quarantined,
    Revoked(Revocation),
    ReclaimRequested,
    CrossTenantFresh,
}

/// The effects a transition produced, in the order it produced them.
#[derive(Debug, Default)]
pub(crate) struct Effects(Vec<Effect>);

impl Effects {
    pub fn push(&mut self, e: Effect) {
        self.0.push(e);
    }
    /// Free `block` on device `device`.
    pub fn free(&mut self, device: u32, block: Block) {
        self.0.push(Effect::Free { device, block });
    }
    /// Free a host-fallback block.
    pub fn free_host(&mut self, block: Block) {
        self.0.push(Effect::FreeHost { block });
    }
    /// Send `event` to a session's stream.
    pub fn notify(&mut self, to: &mpsc::UnboundedSender<SessionEvent>, event: SessionEvent) {
        self.0.push(Effect::Notify {
            to: to.clone(),
            event,
        });
    }
    /// Answer a waiter with a lease (or why not).
    pub fn reply(&mut self, to: Reply, result: BrokerResult<LeaseView>) {
        self.0.push(Effect::Reply {
            to,
            result: result.map(Granted::Lease),
        });
    }
    /// Count something.
    pub fn count(&mut self, what: Counted) {
        self.0.push(Effect::Count(what));
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn take(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.0)
    }
}

/// The state lock, held: derefs to [`State`]. Dropping it checks the invariant, releases
/// the lock and runs the effects (see the module doc).
pub(crate) struct Locked<'a> {
    arb: &'a Arbiter,
    st: Option<MutexGuard<'a, State>>,
}

impl std::ops::Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        self.st.as_ref().expect("held until drop")
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.st.as_mut().expect("held until drop")
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let Some(mut st) = self.st.take() else { return };
        #[cfg(debug_assertions)]
        if let Err(e) = st.check_invariant() {
            panic!("byte-state invariant broken: {e}");
        }
        if st.fx.is_empty() {
            return;
        }
        let effects = st.fx.take();
        let mut later = Vec::with_capacity(effects.len());
        for e in effects {
            match e {
                Effect::Free { device, block } => self.arb.free_on_device(device, block),
                Effect::FreeHost { block } => self.arb.free_host(block),
                other => later.push(other),
            }
        }
        drop(st);
        for e in later {
            self.arb.execute(e);
        }
    }
}

impl Arbiter {
    /// Takes the state lock; dropping the guard runs the effects the transitions pushed.
    pub(crate) fn lock(&self) -> Locked<'_> {
        Locked {
            arb: self,
            st: Some(self.state.lock()),
        }
    }

    /// Runs one effect, with no lock held (device frees come here too when they are not
    /// queued under the lock).
    pub(crate) fn execute(&self, e: Effect) {
        match e {
            Effect::Free { device, block } => self.free_on_device(device, block),
            Effect::FreeHost { block } => self.free_host(block),
            Effect::Kill { pid } => {
                if pid != std::process::id() {
                    tracing::warn!(pid, "terminating the holder of a revoked lease");
                    // SAFETY: plain syscall on a pid the kernel told us holds the session.
                    unsafe {
                        libc::kill(pid as libc::pid_t, libc::SIGKILL);
                    }
                }
            }
            Effect::WatchQuarantine { lease, pid, stop } => {
                if let Some(me) = self.me.upgrade() {
                    me.watch_quarantine(lease, pid, stop);
                }
            }
            Effect::Reply { to, result } => {
                if let Err(Ok(Granted::Lease(view))) = to.send(result) {
                    tracing::debug!(lease = %view.id, "caller gone before the grant arrived; releasing");
                    if let Some(me) = self.me.upgrade() {
                        let mut st = me.lock();
                        me.end_lease(&mut st, view.id, super::ending::Ending::Cache);
                        me.drain(&mut st);
                    }
                }
            }
            Effect::Notify { to, event } => {
                let _ = to.send(event);
            }
            Effect::ForgetTickets { lease } => self.tickets.forget_lease(lease),
            Effect::EndTurns { session } => self.scheduler.end_session(session),
            Effect::Materialize(p) => {
                if let Some(me) = self.me.upgrade() {
                    me.spawn_grant(*p);
                }
            }
            Effect::Count(c) => match c {
                Counted::Granted(tier) => self.metrics.granted(tier),
                Counted::Quarantined => self.metrics.quarantined(),
                Counted::Revoked(why) => self.metrics.revoked(why),
                Counted::ReclaimRequested => self.metrics.reclaim_requested(),
                Counted::CrossTenantFresh => self.metrics.cross_tenant_fresh(),
            },
        }
    }
}
