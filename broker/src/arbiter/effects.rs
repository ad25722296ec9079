//! The lock guard and the effect executor. A transition of the core (a method on `State`,
//! `gpu_broker_core::state`) pushes what the shell must do as an [`Effect`] (the vocabulary
//! is the core's, `gpu_broker_core::effects`) onto its effect list, private to the core
//! (outside its tests the shell cannot build one: every variant is `non_exhaustive`). The
//! lock guard ([`Locked`], from `Arbiter::lock`; the turn core's hold is `Arbiter::with_turns`,
//! beside it) takes them (`State::take_effects`) and
//! runs them when it is dropped:
//!
//! 1. the queue runs if a transition of the hold asked for it, then the byte-state
//!    invariant is checked (debug builds: `State::check_invariant`);
//! 2. [`Executor::execute`], the one effect executor ([`Arbiter::executor`]), takes each
//!    effect in order with the lock still held: device frees are queued on their device
//!    threads (a channel send, never a driver call), so a free always reaches the device
//!    ahead of any allocation admitted after it (the device thread runs jobs in order);
//!    session events find their mailbox and ended sessions' mailboxes close (`outbox.rs`),
//!    so an event decided before a session's end reaches its stream; watchers and the keeper's records change;
//! 3. the lock is released;
//! 4. what `execute` left for after the unlock runs: replies, events, kills, grants'
//!    device work, ticket and turn clean-up, counters, then the `/proc` looks.
//!
//! Every device free of the broker goes through `execute` (`Effect::Free`,
//! `Effect::FreeHost`). The turn core's effects ([`TurnEffect`]) have their executor here
//! too, [`Executor::execute_turns`]. The state's mutex ([`StateLock`]) and the devices'
//! availability ([`DeviceAvailability`]) are private to this module, so the compiler keeps
//! [`Arbiter::lock`] the one take and [`Locked::change_devices`] the one write.

use super::queue::{Granted, WaiterId};
use super::{Arbiter, State};
use crate::error::BrokerResult;
use crate::scheduler::TurnEffect;
use parking_lot::MutexGuard;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use tokio_util::sync::{CancellationToken, DropGuard};

pub use gpu_broker_core::effects::{Counted, Effect, Keep, PendingGrant, Watch};

/// The running watchers, by key (a leaf lock: taken under the state lock, never holding
/// another). Every key that waits on one process shares one task and one pidfd: a process
/// may stand behind thousands of keys (its sessions, quarantined leases, lingering
/// imports), and a descriptor each would let one client exhaust the broker's descriptors.
#[derive(Default)]
pub(crate) struct Watchers(parking_lot::Mutex<Running>);

#[derive(Default)]
struct Running {
    /// Timeouts (the pid is unknown): a timer task each, stopped by dropping its guard.
    timers: HashMap<Watch, DropGuard>,
    /// Per process: the keys waiting on it and its one watcher.
    procs: HashMap<u32, ProcWatch>,
    /// The last process watcher's generation.
    last: u64,
}

/// What [`Watchers::join`] answers: a new watcher to spawn (its generation and stop), and
/// keys of an earlier process of the same pid to fire now.
type Joined = (Option<(u64, CancellationToken)>, Vec<Watch>);

/// The one watcher of a process and the keys it fires.
struct ProcWatch {
    /// Which task this is: a task that fired takes the keys of its own generation only
    /// (a key added after it fired starts a new one).
    generation: u64,
    /// When the watched process started ([`crate::process::start_ticks`]; None: gone or
    /// unknown when the watcher began): a key for another process of the same pid must
    /// not join it.
    start: Option<u64>,
    /// The watched process by its pidfd (shared with the watcher's task): while it runs,
    /// the pid is still its own, and a key joins with no `/proc` read.
    pinned: Option<Arc<crate::process::Pinned>>,
    keys: HashSet<Watch>,
    _stop: DropGuard,
}

impl Watchers {
    /// Keeps a timeout's handle (a key started again replaces, so stops, the old one).
    fn insert_timer(&self, key: Watch, stop: DropGuard) {
        self.0.lock().timers.insert(key, stop);
    }

    /// Adds `key` to the watcher of process `pid`, which started at `start` (read by the
    /// caller, before this lock). Returns the generation and cancellation token of a new
    /// watcher when the process had none (the caller spawns its task), and the keys of a
    /// watcher of an earlier process of that pid, which exited though its task has not
    /// fired yet: the caller fires them (that task then finds another generation and fires
    /// nothing), and the key does not join them.
    fn join(
        &self,
        key: Watch,
        pid: u32,
        start: Option<u64>,
        pinned: Option<Arc<crate::process::Pinned>>,
    ) -> Joined {
        let mut r = self.0.lock();
        let mut earlier = Vec::new();
        if let Some(p) = r.procs.get_mut(&pid) {
            // Unknown now: the process is gone, and whichever it was, the watch is due.
            if start.is_none() || p.start == start {
                p.keys.insert(key);
                return (None, earlier);
            }
            earlier = r
                .procs
                .remove(&pid)
                .map(|p| p.keys.into_iter().collect())
                .unwrap_or_default();
        }
        r.last += 1;
        let generation = r.last;
        let stop = CancellationToken::new();
        r.procs.insert(
            pid,
            ProcWatch {
                generation,
                start,
                pinned,
                keys: HashSet::from([key]),
                _stop: stop.clone().drop_guard(),
            },
        );
        (Some((generation, stop)), earlier)
    }

    /// Adds `key` to the watcher of process `pid` when that watcher's process still runs
    /// (so still has the pid): what a process's next lease, release or session costs,
    /// with no `/proc` read. `false`: [`Watchers::join`] decides.
    fn join_running(&self, key: Watch, pid: u32) -> bool {
        let mut r = self.0.lock();
        match r.procs.get_mut(&pid) {
            Some(p) if p.pinned.as_ref().is_some_and(|f| f.running()) => {
                p.keys.insert(key);
                true
            }
            _ => false,
        }
    }

    /// Stops waiting for `key`; a process watcher left with no key ends (its pidfd
    /// closes).
    fn stop(&self, key: &Watch) {
        let mut r = self.0.lock();
        // Cancelled once the lock is let go.
        let stopped = match key.pid() {
            Some(pid) => {
                let emptied = r.procs.get_mut(&pid).is_some_and(|p| {
                    p.keys.remove(key);
                    p.keys.is_empty()
                });
                (emptied.then(|| r.procs.remove(&pid)).flatten(), None)
            }
            None => (None, r.timers.remove(key)),
        };
        drop(r);
        drop(stopped);
    }

    /// Process `pid`'s watcher of `generation` saw it exit: its keys, to fire (none when
    /// it was stopped meanwhile).
    fn exited(&self, pid: u32, generation: u64) -> Vec<Watch> {
        let mut r = self.0.lock();
        if r.procs.get(&pid).is_none_or(|p| p.generation != generation) {
            return Vec::new();
        }
        r.procs
            .remove(&pid)
            .map(|p| p.keys.into_iter().collect())
            .unwrap_or_default()
    }

    /// How many keys are watched (tests).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        let r = self.0.lock();
        r.timers.len() + r.procs.values().map(|p| p.keys.len()).sum::<usize>()
    }

    /// How many processes are watched, each by one task with one pidfd (counted against
    /// the descriptor budget).
    pub fn processes(&self) -> usize {
        self.0.lock().procs.len()
    }
}

/// The core behind its one lock. Its mutex is private to this module: outside tests the
/// only take is [`Arbiter::lock`], whose guard checks the invariant, runs the effects and
/// times the hold.
pub(crate) struct StateLock(parking_lot::Mutex<State>);

impl StateLock {
    pub fn new(st: State) -> Self {
        StateLock(parking_lot::Mutex::new(st))
    }

    /// A raw take, for tests that read the state without running its effects.
    #[cfg(test)]
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock()
    }

    /// A raw try, for tests that check the lock is free.
    #[cfg(test)]
    pub fn try_lock(&self) -> Option<MutexGuard<'_, State>> {
        self.0.try_lock()
    }
}

/// Which devices admit new leases (drain, health). Anyone reads it; only
/// [`Locked::change_devices`] writes it (the field is private to this module), so every
/// change is made under the state lock and the queue runs after one that changed what fits.
pub(crate) struct DeviceAvailability(parking_lot::RwLock<crate::availability::Availability>);

impl DeviceAvailability {
    pub fn new(devices: usize) -> Self {
        DeviceAvailability(parking_lot::RwLock::new(
            crate::availability::Availability::new(devices),
        ))
    }

    /// A read of it: under the state lock (admission, the queue run) or alone (reports).
    pub fn read(&self) -> parking_lot::RwLockReadGuard<'_, crate::availability::Availability> {
        self.0.read()
    }
}

/// What the executor left for after the unlock: the later steps of the hold's effects, in
/// their order, then the `/proc` looks of every `Effect::CheckGone` together.
struct AfterUnlock<'a> {
    steps: Vec<Box<dyn FnOnce() + 'a>>,
    looks: Vec<(super::state::Holding, Vec<u32>)>,
}

impl<'a> AfterUnlock<'a> {
    fn then(&mut self, step: impl FnOnce() + 'a) {
        self.steps.push(Box::new(step));
    }
}

/// The state lock, held: derefs to [`State`]. Dropping it checks the invariant, releases
/// the lock and runs the effects (see the module doc).
pub(crate) struct Locked<'a> {
    arb: &'a Arbiter,
    st: Option<MutexGuard<'a, State>>,
    /// When the lock was taken, by the wall clock and, if holds are counted by it, the
    /// thread's CPU clock (its hold is counted: `lock_holds.rs`).
    since: std::time::Instant,
    cpu_since: Option<std::time::Duration>,
    /// Released with a fair unlock: handed to a thread waiting for it, if any.
    fair: bool,
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

impl<'a> Locked<'a> {
    /// Releases the lock like a drop, but hands it to a thread waiting for it, if any, so
    /// that the caller cannot take it again first (a listing between its chunks: an
    /// acquire waiting behind one chunk does not wait behind the next as well).
    pub(crate) fn unlock_fair(mut self) {
        self.fair = true;
    }

    /// Runs the queue now if a transition of this hold asked for it (the drop would), for
    /// a caller that reads the state after the queue in the same hold (a reply, a report).
    pub(crate) fn settle(&mut self) {
        let st = self.st.as_mut().expect("held until drop");
        if st.take_queue_due() {
            self.arb.run_queue(st);
        }
    }

    /// Changes which devices admit new leases (a drain, a health mark) in this hold, the
    /// one way to write them: when `change` changed what admits (`Some`), the queue runs
    /// before the unlock (`State::devices_changed`): a reopened device may fit waiters,
    /// and those no open device can serve any more are refused. `None`: nothing that
    /// admits changed (a drain's bookkeeping: whom it asked, since when).
    pub(crate) fn change_devices<R>(
        &mut self,
        change: impl FnOnce(&mut crate::availability::Availability) -> Option<R>,
    ) -> Option<R> {
        let changed = change(&mut self.arb.avail.0.write());
        if changed.is_some() {
            self.devices_changed();
        }
        changed
    }

    fn release(&self, st: MutexGuard<'a, State>) {
        if self.fair {
            MutexGuard::unlock_fair(st);
        } else {
            drop(st);
        }
    }

    /// Counts the hold that just ended (`lock_holds.rs`).
    fn record_hold(&self) {
        // The wall clock first: the CPU clock (a system call) is read only for a long hold.
        let wall = self.since.elapsed();
        let holds = &self.arb.metrics.lock_holds;
        match self.cpu_since {
            Some(since) => holds.record_hold(wall, || {
                crate::lock_holds::thread_cpu_now().saturating_sub(since)
            }),
            None => holds.record_wall(wall),
        }
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let Some(mut st) = self.st.take() else { return };
        // A transition that gave memory back (or changed what fits) asked for the queue:
        // it runs here, in the same hold, so no caller can forget it.
        if st.take_queue_due() {
            self.arb.run_queue(&mut st);
        }
        #[cfg(debug_assertions)]
        if let Err(e) = st.check_invariant() {
            panic!("byte-state invariant broken: {e}");
        }
        if !st.has_effects() {
            self.release(st);
            self.record_hold();
            return;
        }
        let effects = st.take_effects().into_vec();
        let mut after = AfterUnlock {
            steps: Vec::with_capacity(effects.len()),
            looks: Vec::new(),
        };
        for e in effects {
            self.arb.executor().execute(e, &mut after);
        }
        self.release(st);
        self.record_hold();
        for step in after.steps {
            step();
        }
        // Last, all together: each process looked at once.
        if !after.looks.is_empty() {
            self.arb.executor().check_gone(after.looks);
        }
    }
}

impl Arbiter {
    /// Locks the turn core, runs `f` on it, unlocks, then carries out the effects `f`
    /// pushed. Returns what `f` returned and how many grants reached their waiters.
    pub(super) fn with_turns<R>(
        &self,
        f: impl FnOnce(&mut super::turns::TurnsHeld<'_>) -> R,
    ) -> (R, u32) {
        let (r, fx) = self.scheduler.hold(f);
        let delivered = if fx.is_empty() {
            0
        } else {
            self.executor().execute_turns(fx)
        };
        (r, delivered)
    }

    /// Takes the state lock; dropping the guard runs the effects the transitions pushed.
    pub(crate) fn lock(&self) -> Locked<'_> {
        // The thread's CPU clock is a system call (the vDSO does not serve it), read only
        // if holds are counted by it (`--lock-hold-cpu-clock`): before the take, so the
        // hold does not grow by it. A thread waiting for the lock parks and uses no CPU (at
        // most parking_lot's few microseconds of spinning), so the hold's CPU is the same
        // to the thresholds (100 us and up).
        let holds = &self.metrics.lock_holds;
        let cpu_since = holds.cpu_clock().then(crate::lock_holds::thread_cpu_now);
        // A take that finds the lock held is timed (`lock_holds.rs`); a free one is not.
        let st = self.state.0.try_lock().unwrap_or_else(|| {
            let t0 = std::time::Instant::now();
            let st = self.state.0.lock();
            self.metrics.lock_holds.record_wait(t0.elapsed());
            st
        });
        let mut st = st;
        // The hold's time, on both clocks: the core reads none of its own.
        let since = std::time::Instant::now();
        st.set_clock(super::state::Clock {
            now: since,
            wall: std::time::SystemTime::now(),
        });
        Locked {
            arb: self,
            st: Some(st),
            since,
            cpu_since,
            fair: false,
        }
    }
}

/// The one effect executor of an arbiter ([`Arbiter::executor`]): carries out the core's
/// effects ([`Effect`], from the lock guard) and the turn core's ([`TurnEffect`]), and
/// the watchers they start. It keeps no fields: what it drives (watchers, outbox, device
/// threads) is the arbiter's, shared with the rest of the shell.
#[derive(Clone, Copy)]
pub(crate) struct Executor<'a> {
    pub(super) arb: &'a Arbiter,
}

impl<'a> Executor<'a> {
    /// Runs `Effect::Watch`: joins the key to its process's watcher, or spawns one (a
    /// task with a pidfd; for a timeout, a timer task) on the main runtime
    /// ([`Lifecycle::effects_runtime`](super::Lifecycle::effects_runtime): not on the operators' one when an operator's call
    /// asked for it). When it fires it runs the transitions its keys name.
    fn start_watch(self, w: Watch) {
        let Some(me) = self.arb.me.upgrade() else {
            return;
        };
        let Some(rt) = self.arb.lifecycle.effects_runtime() else {
            return;
        };
        let me = std::sync::Arc::downgrade(&me);
        match w.pid() {
            Some(pid) => {
                if self.arb.watchers.join_running(w, pid) {
                    return;
                }
                // Pinned first: a start read after it that its process outlived is its own.
                let pinned = crate::process::Pinned::open(pid).map(Arc::new);
                let start = crate::process::start_ticks(pid)
                    .filter(|_| pinned.as_ref().is_none_or(|p| p.running()));
                let (new, earlier) = self.arb.watchers.join(w, pid, start, pinned.clone());
                if !earlier.is_empty() {
                    let me = me.clone();
                    rt.spawn(async move {
                        if let Some(arb) = me.upgrade() {
                            watches_fired(&arb, earlier);
                        }
                    });
                }
                let Some((generation, stop)) = new else {
                    return;
                };
                rt.spawn(async move {
                    let exited = match pinned {
                        Some(p) => crate::process::Pinned::exit_or(p, stop).await,
                        None => crate::process::wait_for_exit_or(pid, stop).await,
                    };
                    if !exited {
                        return;
                    }
                    if let Some(arb) = me.upgrade() {
                        let keys = arb.watchers.exited(pid, generation);
                        watches_fired(&arb, keys);
                    }
                });
            }
            None => {
                let stop = CancellationToken::new();
                self.arb.watchers.insert_timer(w, stop.clone().drop_guard());
                let timeout = self.arb.cfg.quarantine_timeout;
                rt.spawn(async move {
                    tokio::select! {
                        _ = tokio::time::sleep(timeout) => {}
                        _ = stop.cancelled() => return,
                    }
                    if let Some(arb) = me.upgrade() {
                        watches_fired(&arb, vec![w]);
                    }
                });
            }
        }
    }

    /// Every named process of stranded memory `ids` exited: looks (NVML, `/proc`: off the
    /// runtime) for processes near them that may keep it still, named and watched in
    /// turn; none found lets it go (`kept_holders.rs`). One after another on one blocking
    /// thread: one exit may end the names of a tenant's every kept block.
    fn look_again_for_holders(self, ids: Vec<uuid::Uuid>) {
        if ids.is_empty() {
            return;
        }
        let Some(finder) = self.arb.stranded().holders().cloned() else {
            return;
        };
        let me = self.arb.me.clone();
        let look = move || {
            for id in ids {
                let found = finder.look_again(id);
                let starts: Vec<(u32, u64)> = found
                    .iter()
                    .filter_map(|&p| crate::process::start_ticks(p).map(|s| (p, s)))
                    .collect();
                let Some(arb) = me.upgrade() else { return };
                let mut st = arb.lock();
                st.stranded_rechecked(id, found.iter().copied());
                st.stranded_holders_started(id, None, None, starts);
                if !st.is_stranded(id) {
                    finder.forget(id);
                }
                drop(st);
                if !found.is_empty() {
                    tracing::info!(%id, ?found, "memory kept after its free: its named processes exited, processes near them with a context on the device may keep it; still charged");
                }
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(look);
            }
            Err(_) => look(),
        }
    }

    /// The one effect executor: what each effect does. The lock guard calls it for every
    /// effect of its hold, in order, with the lock still held: an effect whose order with
    /// the state matters runs at once (a device free reaches its thread ahead of any
    /// allocation admitted after it; a session's mailbox is found before a `Hangup` of the
    /// same hold closes it; watchers and the keeper's records change with the state); the
    /// rest is left in `after`, run once the lock is released.
    fn execute(self, e: Effect, after: &mut AfterUnlock<'a>) {
        match e {
            Effect::Free { device, block, .. } => self.arb.free_on_device(device, block),
            Effect::FreeHost { block, .. } => self.arb.free_host(block),
            Effect::Keep { change, .. } => self.arb.restart().keep(change),
            Effect::Watch { watch: w, .. } => self.start_watch(w),
            Effect::Unwatch { watch: w, .. } => self.arb.watchers.stop(&w),
            Effect::Hangup { session, .. } => self.arb.outbox.close(&session),
            Effect::Notify { session, event, .. } => {
                if let Some(to) = self.arb.outbox.sender(&session) {
                    after.then(move || {
                        let _ = to.send(event);
                    });
                }
            }
            Effect::CheckGone { of, pids, .. } => after.looks.push((of, pids)),
            Effect::Reply { to, mut result, .. } => after.then(move || {
                // The core leaves a reservation's device UUID to the shell.
                if let Ok(Granted::Process(v)) = &mut result {
                    v.device_uuid = self.arb.devices.uuid(v.device);
                }
                self.answer(to, result)
            }),
            Effect::Kill { pid, .. } => after.then(move || {
                if pid != std::process::id() {
                    tracing::warn!(pid, "terminating the holder of a revoked lease");
                    // SAFETY: plain syscall on a pid the kernel told us holds the session.
                    unsafe {
                        libc::kill(pid as libc::pid_t, libc::SIGKILL);
                    }
                }
            }),
            Effect::ForgetTickets { lease, .. } => {
                after.then(move || self.arb.tickets.forget_lease(lease))
            }
            Effect::EndTurns { session, .. } => after.then(move || {
                // Its turn requests are answered, its turns end.
                self.arb
                    .with_turns(|t| t.end_session(session, std::time::Instant::now()));
            }),
            Effect::StopGroup { group: g, .. } => after.then(move || {
                let grace = self.arb.cfg.process_stop_grace;
                match self.arb.lifecycle.effects_runtime() {
                    Some(rt) => {
                        rt.spawn(crate::process_group::stop(g, grace));
                    }
                    None => tracing::warn!(pgid = g.pgid, "no runtime to stop a process group"),
                }
            }),
            Effect::Materialize { grant: p, .. } => after.then(move || {
                if let Some(me) = self.arb.me.upgrade() {
                    me.spawn_grant(*p);
                }
            }),
            // Counted once the state lock is let go: the crash-point matrix stops here.
            Effect::Count { what: c, .. } => after.then(move || match c {
                Counted::Granted(tier) => self.arb.metrics.granted(tier),
                Counted::Quarantined => {
                    self.arb.metrics.quarantined();
                    self.arb.crash.pass("after", "quarantine");
                }
                Counted::Revoked(why) => {
                    self.arb.metrics.revoked(why);
                    if why == crate::lease::Revocation::ReclaimDeadline {
                        self.arb.crash.pass("after", "reclaim-revoke");
                    }
                }
                Counted::ReclaimRequested => {
                    self.arb.metrics.reclaim_requested();
                    self.arb.crash.pass("after", "reclaim");
                }
                Counted::CrossTenantFresh => self.arb.metrics.cross_tenant_fresh(),
            }),
        }
    }

    /// The turn core's effect executor (`turns.rs` calls it after the scheduler's lock is
    /// released, and after the state lock when both were held). A grant whose waiter is
    /// gone goes back to the core (and what that decides is carried out in turn). Returns
    /// how many grants reached their waiters.
    pub(super) fn execute_turns(self, fx: Vec<TurnEffect>) -> u32 {
        let mut todo: std::collections::VecDeque<TurnEffect> = fx.into();
        let mut delivered = 0;
        while let Some(e) = todo.pop_front() {
            match e {
                TurnEffect::Reply { to, result } => {
                    let ok = result.is_ok();
                    match self.arb.outbox.reply_turn(to, result) {
                        None => delivered += u32::from(ok),
                        Some(Ok(grant)) => {
                            tracing::debug!(turn = %grant.turn_id, "caller gone before it received the turn; giving it back");
                            let (_, more) = self
                                .arb
                                .scheduler
                                .hold(|t| t.give_back(&grant, std::time::Instant::now()));
                            todo.extend(more);
                        }
                        Some(Err(_)) => {} // a refusal for nobody
                    }
                }
                TurnEffect::Notify { session, event } => self.arb.outbox.send(&session, event),
                TurnEffect::WakeAt(at) => self.wake_turns_at(at),
            }
        }
        delivered
    }

    /// `TurnEffect::WakeAt`: a kept slot's window ends at `at`; if its session has not
    /// asked again by then, the slot goes to the next waiter then (not at the next tick).
    fn wake_turns_at(self, at: std::time::Instant) {
        let Some(rt) = self.arb.lifecycle.effects_runtime() else {
            return; // no runtime (tests of the core): the tick expires it
        };
        let me = self.arb.me.clone();
        rt.spawn(async move {
            tokio::time::sleep_until(at.into()).await;
            if let Some(arb) = me.upgrade() {
                arb.with_turns(|t| t.expire_kept(std::time::Instant::now()));
            }
        });
    }

    /// Runs the `Effect::CheckGone`s of one hold together: each process is looked at once
    /// (a session that ends with a thousand imports names its process a thousand times),
    /// then the state learns which are gone, a chunk of looks per lock hold.
    fn check_gone(self, looks: Vec<(super::state::Holding, Vec<u32>)>) {
        const PER_HOLD: usize = 256;
        let mut seen: HashMap<u32, bool> = HashMap::new();
        let looks: Vec<_> = looks
            .into_iter()
            .map(|(of, pids)| {
                let gone: Vec<u32> = pids
                    .into_iter()
                    .filter(|&p| {
                        *seen
                            .entry(p)
                            .or_insert_with(|| crate::process::process_gone(p))
                    })
                    .collect();
                (of, gone)
            })
            .collect();
        let Some(me) = self.arb.me.upgrade() else {
            return;
        };
        for chunk in looks.chunks(PER_HOLD) {
            let mut st = me.lock();
            for (of, gone) in chunk {
                st.holders_checked(*of, gone);
            }
        }
    }

    /// Runs `Effect::Reply`: the answer goes to the waiter's channel; a grant nobody
    /// receives (the caller went away) is given back at once.
    fn answer(self, to: WaiterId, result: BrokerResult<Granted>) {
        if let Some(Ok(g)) = self.arb.outbox.reply(to, result) {
            if let Some(me) = self.arb.me.upgrade() {
                me.executor().give_back_grant(g);
            }
        }
    }

    /// Ends a grant its caller never received (it went away before or just as the answer
    /// arrived): a lease is released as by its holder, a reservation ended. Locks the state.
    pub(super) fn give_back_grant(self, granted: Granted) {
        let mut st = self.arb.lock();
        match granted {
            Granted::Lease(view) => {
                tracing::debug!(lease = %view.id, "caller gone before it received the grant; releasing");
                st.end_lease(view.id, super::Ending::Cache);
            }
            Granted::Process(view) => {
                tracing::debug!(reservation = %view.id, "caller gone before it received the reservation; ending it");
                st.end_reservation(view.id);
            }
        }
    }
}

/// Watchers fired (a process exited, or a timeout passed): the transitions their keys
/// stand for. A session ends through `end_session` (it looks at its process first), a
/// quarantine is lifted in a hold of its own; shared blocks' and imports' waiters go a
/// chunk per hold, so a process behind thousands of lingering imports costs a few
/// holds, none of them long.
fn watches_fired(arb: &Arc<Arbiter>, keys: Vec<Watch>) {
    const PER_HOLD: usize = 256;
    let mut shared = Vec::new();
    for w in keys {
        match w {
            Watch::Session { session, .. } => arb.end_session(session, "peer process exited"),
            Watch::Quarantine { lease, pid } => arb.unquarantine(lease, pid.is_none()),
            Watch::Held { .. } | Watch::Import { .. } | Watch::Stranded { .. } => shared.push(w),
        }
    }
    let finder = arb.stranded().holders().cloned();
    let mut look_again = Vec::new();
    for chunk in shared.chunks(PER_HOLD) {
        let mut st = arb.lock();
        for &w in chunk {
            match w {
                Watch::Held { lease, pid } => st.held_waiter_gone(lease, pid),
                Watch::Import { import, pid } => st.import_waiter_gone(import, pid),
                Watch::Stranded { id, pid } => {
                    let gone = st.stranded_holder_gone(id, pid);
                    if let Some(f) = &finder {
                        f.exited(id, pid);
                    }
                    match (&finder, st.stranded_awaits_recheck(id)) {
                        (Some(_), true) => look_again.push(id),
                        // Nobody can look (a charge taken back by a broker without
                        // NVML): let go as memory never looked at near its holders.
                        (None, true) => {
                            st.stranded_rechecked(id, std::iter::empty());
                        }
                        (_, false) => {}
                    }
                    gone
                }
                Watch::Session { .. } | Watch::Quarantine { .. } => false,
            };
        }
    }
    arb.executor().look_again_for_holders(look_again);
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    /// A key for another process that got the pid of a watched one (which exited, its
    /// task not fired yet) does not join that watcher: the earlier keys are handed back to
    /// fire now, the new key gets a watcher of its own, and the earlier task fires nothing.
    #[test]
    fn a_later_process_of_the_same_pid_gets_a_watcher_of_its_own() {
        let w = Watchers::default();
        let key = |n: u128| Watch::Session {
            session: Uuid::from_u128(n),
            pid: 42,
        };
        let (first, earlier) = w.join(key(1), 42, Some(100), None);
        let (first_gen, _stop1) = first.expect("a new watcher");
        assert!(earlier.is_empty());
        let (joined, earlier) = w.join(key(2), 42, Some(100), None);
        assert!(
            joined.is_none() && earlier.is_empty(),
            "the same process: joined"
        );
        let (unknown, earlier) = w.join(key(3), 42, None, None);
        assert!(
            unknown.is_none() && earlier.is_empty(),
            "gone now: due with the rest"
        );
        let (second, earlier) = w.join(key(4), 42, Some(200), None);
        let (second_gen, _stop2) = second.expect("a watcher of its own");
        let earlier: HashSet<Watch> = earlier.into_iter().collect();
        assert_eq!(earlier, HashSet::from([key(1), key(2), key(3)]));
        assert!(
            w.exited(42, first_gen).is_empty(),
            "the earlier task fires nothing"
        );
        assert_eq!(w.exited(42, second_gen), vec![key(4)]);
    }

    /// A key joins the watcher of a process that still runs by its pidfd alone; once that
    /// process exited (its task not fired yet) it does not, and the start decides.
    #[test]
    fn a_key_joins_the_watcher_of_a_running_process_by_its_pidfd() {
        /// Killed however the test ends.
        struct Child(std::process::Child);
        impl Drop for Child {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let mut child = Child(
            std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap(),
        );
        let pid = child.0.id();
        let Some(pinned) = crate::process::Pinned::open(pid).map(Arc::new) else {
            eprintln!("skipped: no pidfds on this kernel");
            return;
        };
        let w = Watchers::default();
        let key = |n: u128| Watch::Session {
            session: Uuid::from_u128(n),
            pid,
        };
        assert!(!w.join_running(key(1), pid), "no watcher yet");
        assert!(pinned.running());
        let start = crate::process::start_ticks(pid);
        let (first, _) = w.join(key(1), pid, start, Some(pinned.clone()));
        let (generation, _stop) = first.expect("a new watcher");
        assert!(w.join_running(key(2), pid), "joined while it runs");
        child.0.kill().unwrap();
        child.0.wait().unwrap();
        assert!(!pinned.running());
        assert!(
            !w.join_running(key(3), pid),
            "exited: not joined on its pidfd"
        );
        let mut fired = w.exited(pid, generation);
        fired.sort_by_key(|k| format!("{k:?}"));
        assert_eq!(fired, vec![key(1), key(2)]);
    }
}
