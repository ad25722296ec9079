//! Effects: what a state transition asks the shell to do once it has decided. A transition
//! (a method on [`State`](crate::state::State)) never frees device memory, kills a process,
//! spawns a watcher, answers a waiter or tells a session itself: it pushes an [`Effect`]
//! onto the core's effect list (private to `state/`: the shell pushes nothing itself). The
//! shell's lock guard (`gpu_broker::arbiter`, `effects.rs`) takes them and runs them when
//! it is dropped: device frees before the unlock, everything else after it.

use crate::error::BrokerResult;
use crate::lease::{LeaseView, Revocation};
use crate::ledger::Tier;
use crate::pool::Block;
use crate::queue::{Granted, WaiterId};
use crate::session::SessionEvent;
use uuid::Uuid;

/// One thing a transition asks the shell to do. Only the core makes them: every variant is
/// `non_exhaustive`, so the shell matches on them (with `..`) but cannot build one and push
/// or run it in place of a transition (its own tests, under the `testing` feature, can).
#[derive(Debug)]
pub enum Effect {
    /// Free a block on device `device` (queued before the lock is released).
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    Free { device: u32, block: Block },
    /// Free a host-fallback block (queued before the lock is released).
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    FreeHost { block: Block },
    /// Kill the holder of a revoked lease (`--reclaim-policy terminate`).
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    Kill { pid: u32 },
    /// Start a watcher (a task waiting for a process's exit or a timeout); the shell
    /// keeps its cancellation handle under the key. Run before the lock is released, so
    /// it is in place before any later transition can stop it.
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    Watch { watch: Watch },
    /// Stop the watcher of that key (if it still runs). Run before the lock is released.
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    Unwatch { watch: Watch },
    /// Answer a waiting `acquire` (by its id: the shell keeps the channel,
    /// `outbox.rs`); a grant nobody receives is released at once.
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    Reply {
        to: WaiterId,
        result: BrokerResult<Granted>,
    },
    /// Tell a session something (its event stream, through its mailbox in `outbox.rs`).
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    Notify { session: Uuid, event: SessionEvent },
    /// A session ended: its mailbox closes (after the events pushed before this).
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    Hangup { session: Uuid },
    /// Processes that may map an ended lease's (or import's) memory, counted alive under
    /// the lock without a look: after the unlock the shell reads `/proc` and hands those
    /// certainly gone to `State::holders_checked` (a check that cannot decide is alive).
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    CheckGone {
        of: crate::state::Holding,
        pids: Vec<u32>,
    },
    /// A lease ended: its undelivered tickets go.
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    ForgetTickets { lease: Uuid },
    /// A session ended: its compute turns and turn requests go.
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    EndTurns { session: Uuid },
    /// A process reservation ended: stop what is left of its program's process group
    /// (SIGTERM, SIGKILL after `process_stop_grace`).
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    StopGroup {
        group: crate::process_group::ProcessGroup,
    },
    /// Count something in the metrics.
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    Count { what: Counted },
    /// Do a grant's device work (allocate, or scrub a reused block) on a task, then commit
    /// it. Runs after the lock is released, so after the frees queued under it.
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    Materialize { grant: Box<PendingGrant> },
    /// Tell the keeper a session or lease began or ended. Written before the lock is
    /// released, in the order the transitions made them, so no later change overtakes it
    /// and none is answered before it is kept.
    #[cfg_attr(not(feature = "testing"), non_exhaustive)]
    Keep { change: Keep },
}

/// A change of what the keeper holds for a restarted broker (`kept.rs`).
#[derive(Debug)]
pub enum Keep {
    Session(crate::kept::SessionRecord),
    SessionEnded(Uuid),
    /// A lease and a copy of its block's descriptor.
    Lease(crate::kept::LeaseRecord, crate::memory::SharedFd),
    LeaseEnded(Uuid),
    /// An ended lease's memory, quarantined, and a copy of its block's descriptor.
    Quarantine(crate::kept::QuarantineRecord, crate::memory::SharedFd),
    QuarantineLifted(Uuid),
    /// A publication (new, renamed or unpublished); its lease's record has the memory.
    Publication(crate::kept::PublicationRecord),
    PublicationEnded(Uuid),
    /// An import whose descriptor reached a process.
    Import(crate::kept::ImportRecord),
    ImportEnded(Uuid),
    /// A session's process reservation (granted, its group named, its room changed).
    Reservation(crate::kept::ReservationRecord),
    ReservationEnded(Uuid),
    /// A lease's holder was asked for it back by a deadline (wall clock).
    Reclaim(crate::kept::ReclaimRecord),
    ReclaimEnded(Uuid),
    /// An ended lease's block held for its importers, and a copy of its descriptor.
    Held(crate::kept::HeldRecord, crate::memory::SharedFd),
    HeldLetGo(Uuid),
    /// An import let go while processes that may map it live.
    Lingering(crate::kept::LingeringRecord),
    LingeringEnded(Uuid),
    /// Memory a free left with processes outside the broker, charged until they exit.
    Stranded(crate::kept::StrandedRecord),
    StrandedLifted(Uuid),
}

impl Keep {
    /// Its name at the daemon's crash points (`crash_point.rs`).
    pub fn name(&self) -> &'static str {
        match self {
            Keep::Session(_) => "session",
            Keep::SessionEnded(_) => "session-ended",
            Keep::Lease(..) => "lease",
            Keep::LeaseEnded(_) => "lease-ended",
            Keep::Quarantine(..) => "quarantine",
            Keep::QuarantineLifted(_) => "quarantine-lifted",
            Keep::Publication(_) => "publication",
            Keep::PublicationEnded(_) => "publication-ended",
            Keep::Import(_) => "import",
            Keep::ImportEnded(_) => "import-ended",
            Keep::Reservation(_) => "reservation",
            Keep::ReservationEnded(_) => "reservation-ended",
            Keep::Reclaim(_) => "reclaim-asked",
            Keep::ReclaimEnded(_) => "reclaim-ended",
            Keep::Held(..) => "held",
            Keep::HeldLetGo(_) => "held-let-go",
            Keep::Lingering(_) => "lingering",
            Keep::LingeringEnded(_) => "lingering-ended",
            Keep::Stranded(_) => "stranded",
            Keep::StrandedLifted(_) => "stranded-lifted",
        }
    }
}

/// What a watcher waits for, and its key: the state names what it waits on, the shell
/// ([`Watchers`]) keeps the task's cancellation handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Watch {
    /// Quarantined memory of an ended lease: lift it when `pid` exits, or free it after
    /// the quarantine timeout when the pid is unknown.
    Quarantine { lease: Uuid, pid: Option<u32> },
    /// A shared block held for others (`sharing.rs`): process `pid` that may map it
    /// exited, or (`None`) the quarantine timeout passed.
    Held { lease: Uuid, pid: Option<u32> },
    /// A lingering import: likewise.
    Import { import: Uuid, pid: Option<u32> },
    /// A session's peer process: the session ends when it exits.
    Session { session: Uuid, pid: u32 },
    /// Memory freed by the broker that a process outside it kept (`state/stranded.rs`):
    /// process `pid` that may hold it exited.
    Stranded { id: Uuid, pid: u32 },
}

impl Watch {
    /// The process it waits on (`None`: a timeout).
    pub fn pid(&self) -> Option<u32> {
        match *self {
            Watch::Quarantine { pid, .. } | Watch::Held { pid, .. } | Watch::Import { pid, .. } => {
                pid
            }
            Watch::Session { pid, .. } | Watch::Stranded { pid, .. } => Some(pid),
        }
    }
}

/// A grant whose memory is reserved (ledger and pool) and needs device work.
#[derive(Debug)]
pub struct PendingGrant {
    pub ask: crate::queue::Ask,
    pub priority: i32,
    /// The waiter its answer goes to.
    pub to: WaiterId,
    pub device: u32,
    pub source: crate::pool::Source,
}

/// What a transition counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counted {
    Granted(Tier),
    Quarantined,
    Revoked(Revocation),
    ReclaimRequested,
    CrossTenantFresh,
}

/// The effects a transition produced, in the order it produced them.
#[derive(Debug, Default)]
pub struct Effects(Vec<Effect>);

impl Effects {
    /// Pushes `e` as a transition would (the daemon's tests of the effect executor).
    #[cfg(feature = "testing")]
    pub fn push_for_test(&mut self, e: Effect) {
        self.0.push(e);
    }
    pub(crate) fn push(&mut self, e: Effect) {
        self.0.push(e);
    }
    /// Free `block` on device `device`.
    pub(crate) fn free(&mut self, device: u32, block: Block) {
        self.0.push(Effect::Free { device, block });
    }
    /// Free a host-fallback block.
    pub(crate) fn free_host(&mut self, block: Block) {
        self.0.push(Effect::FreeHost { block });
    }
    /// Send `event` to session `session`'s stream.
    pub(crate) fn notify(&mut self, session: Uuid, event: SessionEvent) {
        self.0.push(Effect::Notify { session, event });
    }
    /// Answer a waiter with a lease (or why not).
    pub(crate) fn reply(&mut self, to: WaiterId, result: BrokerResult<LeaseView>) {
        self.0.push(Effect::Reply {
            to,
            result: result.map(Granted::Lease),
        });
    }
    /// Answer a waiting process reservation (or why not).
    pub(crate) fn reply_process(
        &mut self,
        to: WaiterId,
        result: BrokerResult<crate::reservations::ReservationView>,
    ) {
        self.0.push(Effect::Reply {
            to,
            result: result.map(Granted::Process),
        });
    }
    /// Start a watcher.
    pub(crate) fn watch(&mut self, w: Watch) {
        self.0.push(Effect::Watch { watch: w });
    }
    /// Stop a watcher.
    pub(crate) fn unwatch(&mut self, w: Watch) {
        self.0.push(Effect::Unwatch { watch: w });
    }
    /// Stop what is left of an ended reservation's process group.
    pub(crate) fn stop_group(&mut self, g: crate::process_group::ProcessGroup) {
        self.0.push(Effect::StopGroup { group: g });
    }
    /// Count something.
    pub(crate) fn count(&mut self, what: Counted) {
        self.0.push(Effect::Count { what });
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// The effects, in order.
    pub fn into_vec(self) -> Vec<Effect> {
        self.0
    }
}
