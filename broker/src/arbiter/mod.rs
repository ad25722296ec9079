//! The arbiter: admission. Every `AcquireLease` ends up here. It checks the tenant's
//! quota (through the ledger), the device's leasable capacity minus headroom minus other
//! tenants' unused guarantees, queues what does not fit (with deadlines and priorities),
//! asks borrowers to give memory back (reclaim), and ends leases and sessions. It holds the
//! broker's state under one lock so racing requests see exact numbers; device work (alloc,
//! scrub, free) runs on the device threads, outside the lock, on memory already reserved.
//!
//! Submodules: [`queue`] (wait order), `admission` (fit checks and grants), `ending`
//! (releases, quarantine, revocation). Each feature beyond those is a type reached by one
//! accessor: `listing` ([`listing::Views`]: operators' read-only views), `audit`, `admin`
//! and `tokens` ([`Changes`]: durable operator changes; `Durable` owns the store, the audit
//! log and their lock), [`restart`] ([`restart::Restart`]: keeping every change, taking
//! back what the keeper held, resuming sessions, relinking a lost keeper; it owns the
//! keeper), `drain` (`Drains`), [`stranded`] ([`stranded::Stranded`]: memory a free left
//! with processes outside the broker), `sessions`, `reservations`, [`claims`], `sharing`,
//! `health` (device health), `turns` (compute turns), `retained` (blocks kept mapped),
//! `tasks` (the loops: keepalive reaper, reclaim deadlines, leasable refresh), run by
//! [`Lifecycle`] (`lifecycle`, reached as [`Process`]: the process's start and stop:
//! workers, runtime, store writer, MPS, shutdown); `effects` is the lock guard (with the
//! turn core's hold) and the one effect executor (`Executor`). The records
//! they work on live below it (the core).

mod admin;
mod admission;
mod audit;
pub mod claims;
mod drain;
mod effects;
mod ending;
mod health;
mod host_direct;
mod lifecycle;
pub mod listing;
mod outbox;
pub use gpu_broker_core::lease::RECLAIM_DEADLINE_MISSED;
pub use gpu_broker_core::request::{AcquireRequest, ValidRequest};
/// The wait queue's records and the state core, at their old paths (`gpu_broker_core`).
pub use gpu_broker_core::{overtaking, queue, state};
mod reservations;
pub mod restart;
mod retained;
mod revocation;
mod sessions;
mod sharing;
pub mod stranded;
pub mod tasks;
pub mod tokens;
mod turns;
mod workers;

pub use crate::backend::DeviceSlot;
pub use admin::{DeviceReport, QuarantineView, QuotaChange, QuotaUpdate, SessionView, TenantView};
pub use audit::Changes;
pub use drain::{DeviceDrain, DrainReport};
pub use lifecycle::{Lifecycle, Process};
pub use restart::{Phase, RestartReport};
pub use retained::{LineSession, Retaining, SessionPeer};
pub use sharing::ImportGrant;
pub use state::Recipient;
pub(crate) use state::{Ending, State};

use crate::auth::Authenticator;
use crate::device::free_check::Returned;
use crate::device::thread::DeviceThread;
use crate::device::BackendKind;
use crate::error::BrokerResult;
pub(crate) use crate::error::{lease_not_found, session_not_found};
use crate::pool::{Block, Pool};
use crate::process::process_gone;
use crate::session::{Peer, SessionEvent};
use crate::store::Store;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::mpsc;
use uuid::Uuid;

pub use crate::reclaim_policy::ReclaimPolicy;

/// Tunables of the arbiter.
#[derive(Clone, Debug)]
pub struct ArbiterConfig {
    /// How long a holder has to release a lease after a reclaim request.
    pub reclaim_deadline: Duration,
    /// A session with no activity for this long ends (zero: never).
    pub keepalive_timeout: Duration,
    pub reclaim_policy: ReclaimPolicy,
    /// Quarantined memory of a holder whose pid is unknown (TCP) is freed after this.
    pub quarantine_timeout: Duration,
    /// Longest wait a request may ask for.
    pub max_wait: Duration,
    /// Most open sessions per tenant (a runaway worker cannot exhaust the broker).
    pub max_sessions_per_tenant: usize,
    /// Most requests of one tenant waiting in the queue at once.
    pub max_waiting_per_tenant: usize,
    /// How often device memory is re-read to follow processes outside the broker.
    pub refresh_interval: Duration,
    /// Quantum and grace of compute turns.
    pub turns: crate::scheduler::TurnConfig,
    /// Per-tenant RPC rate limit (`rate.rs`; off by default).
    pub rate: crate::rate::RateConfig,
    /// SIGTERM to SIGKILL for what is left of an ended reservation's process group.
    pub process_stop_grace: Duration,
    /// A request blocked by held memory is overtaken by other tenants' requests that fit
    /// only while it has waited less than this (`overtaking.rs`; zero: never).
    pub overtake_age: Duration,
    /// Count the state lock's holds by the holding thread's CPU clock too
    /// (`lock_holds.rs`; a system call on every take).
    pub lock_hold_cpu_clock: bool,
    /// Descriptors kept for connections and operators: a new block that would eat into
    /// them is refused (`fd_budget.rs`; the limit is read when the arbiter starts).
    pub fd_reserve: usize,
    /// First look again at a kept memfd's charge after this (then with backoff:
    /// `stranded/looks.rs`).
    pub kept_memory_look: Duration,
}

impl Default for ArbiterConfig {
    fn default() -> Self {
        ArbiterConfig {
            reclaim_deadline: crate::defaults::RECLAIM_DEADLINE,
            keepalive_timeout: crate::defaults::KEEPALIVE_TIMEOUT,
            reclaim_policy: crate::defaults::RECLAIM_POLICY,
            quarantine_timeout: crate::defaults::QUARANTINE_TIMEOUT,
            max_wait: crate::defaults::MAX_WAIT,
            max_sessions_per_tenant: crate::defaults::MAX_SESSIONS_PER_TENANT,
            max_waiting_per_tenant: crate::defaults::MAX_WAITING_PER_TENANT,
            refresh_interval: crate::defaults::REFRESH_INTERVAL,
            turns: crate::scheduler::TurnConfig::default(),
            rate: crate::rate::RateConfig::default(),
            process_stop_grace: crate::defaults::PROCESS_STOP_GRACE,
            overtake_age: crate::defaults::OVERTAKE_AGE,
            lock_hold_cpu_clock: crate::defaults::LOCK_HOLD_CPU_CLOCK,
            fd_reserve: crate::fd_budget::reserve_for(crate::fd_budget::default_max_connections()),
            kept_memory_look: crate::defaults::KEPT_MEMORY_LOOK,
        }
    }
}

/// Memory the one executor frees on a device ([`Arbiter::free_on_device`]): an exported
/// block, or an allocation that never became one (its zeroing or export failed).
pub(crate) enum Unneeded {
    Block(Block),
    Allocation(crate::device::Allocation),
}

impl Unneeded {
    fn alloc_id(&self) -> u64 {
        match self {
            Unneeded::Block(b) => b.alloc.id,
            Unneeded::Allocation(a) => a.id,
        }
    }
    /// The allocation to free, and the descriptor to close after it (a block's).
    fn split(self) -> (crate::device::Allocation, Option<crate::device::Handle>) {
        match self {
            Unneeded::Block(b) => (b.alloc, Some(b.handle)),
            Unneeded::Allocation(a) => (a, None),
        }
    }
}

impl From<Block> for Unneeded {
    fn from(b: Block) -> Self {
        Unneeded::Block(b)
    }
}

impl From<crate::device::Allocation> for Unneeded {
    fn from(a: crate::device::Allocation) -> Self {
        Unneeded::Allocation(a)
    }
}

/// The admission authority of one broker.
pub struct Arbiter {
    /// The core behind its one lock: taken only by `Arbiter::lock` (`effects.rs`), whose
    /// guard checks the invariant, runs the effects and times the hold.
    state: effects::StateLock,
    pub(crate) devices: crate::backend::Devices,
    pub(crate) host_tier: Option<DeviceThread>,
    pub(crate) auth: Arc<Authenticator>,
    pub(crate) cfg: ArbiterConfig,
    /// Compute turns (time-slicing); separate from memory, with its own lock.
    pub(crate) scheduler: turns::Scheduler,
    /// Tickets that deliver fd leases (served by `ticket_server::serve`).
    pub(crate) tickets: Arc<crate::fd::tickets::TicketTable>,
    /// The state store, the audit log and the lock that keeps durable operator changes
    /// one at a time (`audit.rs`).
    pub(crate) durable: audit::Durable,
    /// Which devices admit new leases (drain, health); changed only through
    /// `Locked::change_devices`.
    pub(crate) avail: effects::DeviceAvailability,
    /// What the broker did (counters, histograms), for `/metrics`.
    pub(crate) metrics: crate::metrics::Metrics,
    /// The process's lifecycle: workers, the main runtime, the store writer, MPS, the
    /// fault source, the shutdown's marks (`lifecycle.rs`).
    lifecycle: Lifecycle,
    /// The keeper, what this start took back from it, and the leases awaiting a resume
    /// (`restart/`).
    restart_state: restart::RestartState,
    /// Where a crash-point test makes this broker die (`crash_point.rs`).
    crash: crate::crash_point::CrashPoint,
    /// This arbiter (effects that outlive a call hold it: watchers, late releases).
    me: std::sync::Weak<Arbiter>,
    /// Per device, bytes freed whose return the device thread found missing and whose
    /// charge (`State::stranded`) is on its way, or still being judged: the leasable
    /// refresh counts them as the broker's, so they are never outside memory meanwhile.
    unverified: UnverifiedBytes,
    /// Memory a free left with processes outside the broker: the looks at kept memfds,
    /// the finder of other holders (`stranded/`).
    stranded_state: stranded::StrandedState,
    /// Running watchers (process exits, timeouts), started and stopped by effects.
    pub(crate) watchers: effects::Watchers,
    /// Sessions' event channels, by session id (`outbox.rs`).
    pub(crate) outbox: outbox::Outbox,
    /// The descriptors held for memory, against the limit less the reserve
    /// (`fd_budget.rs`): counted where a block is made and freed, and for a publication.
    pub(crate) fds: Arc<crate::fd_budget::FdBudget>,
    /// Each tenant's call rate (`rate.rs`; off unless configured), one for every way in:
    /// the gate's gRPC calls and the lease lines' requests draw on the same buckets.
    pub(crate) rate_limits: Option<Arc<crate::rate::RateLimiter>>,
}

/// Longest label accepted.
pub const MAX_LABEL: usize = crate::bounds::MAX_TEXT_BYTES;

impl Arbiter {
    /// The broker process's start and stop: its background machinery (workers, store
    /// writer, MPS, fault source) and its shutdown (`lifecycle.rs`).
    pub fn lifecycle(&self) -> lifecycle::Process<'_> {
        lifecycle::Process { arb: self }
    }

    /// The operators' read-only views (`listing.rs`).
    pub fn views(&self) -> listing::Views<'_> {
        listing::Views { arb: self }
    }

    /// The process reservations (`reservations.rs`).
    pub(crate) fn reservations(self: &Arc<Self>) -> reservations::Reservations<'_> {
        reservations::Reservations { arb: self }
    }

    /// The durable operator changes: quotas, tenants, tokens, audit records (`audit.rs`).
    pub fn changes(self: &Arc<Self>) -> Changes<'_> {
        Changes { arb: self }
    }

    /// The shared read-only leases: publish, import, let go (`sharing.rs`).
    pub(crate) fn sharing(&self) -> sharing::Sharing<'_> {
        sharing::Sharing { arb: self }
    }

    /// The sessions: open, keep alive, end by token, their GPU use (`sessions.rs`).
    pub(crate) fn sessions(self: &Arc<Self>) -> sessions::Sessions<'_> {
        sessions::Sessions { arb: self }
    }

    /// The background loops: keepalive reaper, reclaim deadlines, leasable refresh, NVML
    /// process watch (`tasks.rs`).
    pub fn tasks(self: &Arc<Self>) -> tasks::Tasks<'_> {
        tasks::Tasks { arb: self }
    }

    /// Device health: marked by the health monitor or an operator (`health.rs`).
    pub(crate) fn device_health(self: &Arc<Self>) -> health::DeviceHealth<'_> {
        health::DeviceHealth { arb: self }
    }

    /// The devices' drains: start, undrain, progress (`drain.rs`).
    pub(crate) fn drains(&self) -> drain::Drains<'_> {
        drain::Drains { arb: self }
    }

    /// Memory a free left with processes outside the broker: its charge, the looks at a
    /// kept memfd, the finder of other holders (`stranded/`).
    pub fn stranded(&self) -> stranded::Stranded<'_> {
        stranded::Stranded {
            arb: self,
            state: &self.stranded_state,
        }
    }

    /// A restart that loses no lease: keeping every change, taking back what the keeper
    /// held, resuming sessions, relinking a lost keeper (`restart/`).
    pub fn restart(&self) -> restart::Restart<'_> {
        restart::Restart {
            arb: self,
            state: &self.restart_state,
        }
    }

    /// This arbiter, weakly (a task that must not keep it alive).
    pub(crate) fn me(&self) -> std::sync::Weak<Arbiter> {
        self.me.clone()
    }

    /// The one effect executor (`effects.rs`).
    pub(crate) fn executor(&self) -> effects::Executor<'_> {
        effects::Executor { arb: self }
    }

    /// Retained blocks: a release that keeps its mapping, an acquire answered with one
    /// (`retained.rs`).
    pub(crate) fn retained(self: &Arc<Self>) -> retained::Retained<'_> {
        retained::Retained { arb: self }
    }

    /// Compute turns: asking for a device's turn and giving it back (`turns.rs`).
    pub(crate) fn turns(self: &Arc<Self>) -> turns::ComputeTurns<'_> {
        turns::ComputeTurns { arb: self }
    }

    /// The Kubernetes claims' reservations (`claims.rs`).
    pub(crate) fn claims(self: &Arc<Self>) -> claims::Claims<'_> {
        claims::Claims { arb: self }
    }

    /// An arbiter over `devices`; tenants and tokens are loaded from `store` if given.
    pub fn new(
        devices: Vec<DeviceSlot>,
        host_tier: Option<DeviceThread>,
        store: Option<Store>,
        auth: Arc<Authenticator>,
        cfg: ArbiterConfig,
    ) -> BrokerResult<Arc<Arbiter>> {
        let mut pools = Vec::with_capacity(devices.len());
        let mut host_backed = Vec::with_capacity(devices.len());
        for d in &devices {
            let desc = d.thread.desc();
            let mut pool = Pool::new(
                desc.index,
                desc.granularity,
                desc.total_bytes,
                d.initial_leasable,
            );
            pool.set_headroom(d.headroom);
            pools.push(pool);
            host_backed.push(desc.backend == BackendKind::Host);
        }
        // The core asks the kernel about a memfd's seals through the shell's look.
        let seals = state::SealCheck::new(crate::sharing::untouched);
        let clock = state::Clock {
            now: Instant::now(),
            wall: SystemTime::now(),
        };
        let st = State::new(pools, host_backed, seals, clock);
        crate::error::mark_started();
        let scheduler = turns::Scheduler::new(devices.len(), cfg.turns);
        let audit_log =
            crate::audit::AuditLog::open(store.as_ref(), crate::audit::DEFAULT_MAX_RECORDS)?;
        let metrics = crate::metrics::Metrics::with_lock_holds(crate::lock_holds::LockHolds::new(
            cfg.lock_hold_cpu_clock,
        ));
        let fds = crate::fd_budget::FdBudget::new(crate::fd_budget::nofile_limit(), cfg.fd_reserve);
        tracing::info!(
            descriptor_limit = fds.limit(),
            reserved = cfg.fd_reserve,
            "descriptors for memory: the limit less the reserve"
        );
        let unverified = UnverifiedBytes(devices.iter().map(|_| AtomicU64::new(0)).collect());
        let rate_limits =
            (!cfg.rate.is_off()).then(|| Arc::new(crate::rate::RateLimiter::new(cfg.rate)));
        let arb = Arc::new_cyclic(|me| Arbiter {
            me: me.clone(),
            rate_limits,
            unverified,
            stranded_state: stranded::StrandedState::default(),
            lifecycle: Lifecycle::default(),
            watchers: effects::Watchers::default(),
            outbox: outbox::Outbox::default(),
            fds,
            durable: audit::Durable::new(store, audit_log),
            avail: effects::DeviceAvailability::new(devices.len()),
            restart_state: restart::RestartState::default(),
            crash: crate::crash_point::CrashPoint::from_env(),
            scheduler,
            state: effects::StateLock::new(st),
            devices: devices.into(),
            host_tier,
            auth,
            cfg,
            tickets: Arc::default(),
            metrics,
        });
        arb.changes().load()?;
        Ok(arb)
    }

    /// The broker's counters and histograms.
    pub(crate) fn metrics(&self) -> &crate::metrics::Metrics {
        &self.metrics
    }

    /// The arbiter's configuration.
    pub(crate) fn config(&self) -> &ArbiterConfig {
        &self.cfg
    }

    /// The broker's devices (slots, indexes, UUIDs).
    pub fn devices(&self) -> &crate::backend::Devices {
        &self.devices
    }

    /// The lease tickets (the ticket server redeems them).
    pub fn tickets(&self) -> &Arc<crate::fd::tickets::TicketTable> {
        &self.tickets
    }

    /// Where a crash-point test makes this broker die (`crash_point.rs`).
    pub(crate) fn crash_point(&self) -> &crate::crash_point::CrashPoint {
        &self.crash
    }

    /// The tenants' call rate limits, when configured (`rate.rs`).
    pub fn rate_limits(&self) -> Option<&Arc<crate::rate::RateLimiter>> {
        self.rate_limits.as_ref()
    }

    /// The authenticator shared with the service layer.
    pub fn authenticator(&self) -> &Arc<Authenticator> {
        &self.auth
    }

    /// Opens a session for `tenant`; returns its id and the event receiver.
    pub fn open_session(
        self: &Arc<Self>,
        tenant: &str,
        name: &str,
        peer: Peer,
    ) -> BrokerResult<(Uuid, mpsc::UnboundedReceiver<SessionEvent>)> {
        self.sessions()
            .open(tenant, name, peer, None)
            .map(|(id, rx, _)| (id, rx))
    }

    /// Queues a free of `what` on its device thread: the one place device memory is freed
    /// (reached through `Effect::Free`, and by the grant path when device work failed: a
    /// block whose scrub failed, an allocation whose zeroing or export failed).
    fn free_on_device(&self, device: u32, what: impl Into<Unneeded>) {
        if let Some(d) = self.devices.get(device as usize) {
            let what = what.into();
            let id = what.alloc_id();
            // A block's descriptor is counted until it closes (or the job is dropped).
            let counted = matches!(what, Unneeded::Block(_)).then(|| self.fds.adopt());
            let revoke = self.lifecycle.frees_revoke();
            // Processes outside the broker its descriptor reached may keep it (not at the
            // shutdown: nobody is charged any more then).
            let reached = match &what {
                Unneeded::Block(b) if revoke && !b.reached.is_empty() => b
                    .last_tenant
                    .clone()
                    .map(|tenant| (tenant, b.reached.clone())),
                _ => None,
            };
            let kind = match &what {
                Unneeded::Block(b) => {
                    let crate::device::Handle::Fd { kind, .. } = b.handle;
                    Some(kind)
                }
                _ => None,
            };
            let report = reached.is_some().then(|| self.stranded().reporter(kind));
            // Made with the first memfd a process may keep (never for CUDA memory).
            let memfd_block = kind == Some(crate::device::MemoryKind::HostMemfd);
            let prober = reached
                .as_ref()
                .filter(|_| memfd_block)
                .and_then(|_| self.stranded().prober());
            let unverified = self.unverified.clone();
            // Who else may keep memory the free check finds kept (`kept_holders.rs`; set
            // on CUDA nodes, where a free is checked so), with the device to ask.
            let finder = reached
                .as_ref()
                .and_then(|_| self.stranded().holders().cloned())
                .map(|f| (f, d.thread.desc().uuid.clone()));
            let r = d.thread.submit(move |dev| {
                let _counted = counted;
                // A block's descriptor closes here, after the free, on the device thread.
                let (alloc, handle) = what.split();
                let revoked = !revoke || revoke_before_free(dev, &alloc, device);
                let bytes = alloc.bytes;
                let alive: Vec<u32> = reached
                    .as_ref()
                    .map(|(_, pids)| {
                        pids.pids()
                            .iter()
                            .copied()
                            .filter(|&p| !process_gone(p))
                            .collect()
                    })
                    .unwrap_or_default();
                // Who answers for memory kept: the block's tenant, or another tenant's
                // importer when only such importers could keep it.
                let answering = |keepers: &[u32]| {
                    reached
                        .as_ref()
                        .map(|(own, r)| r.answers_for(keepers, own))
                        .unwrap_or_default()
                };
                let pending = &unverified[device as usize];
                // A memfd that could not be revoked (sealed against shrinking): the kernel
                // says whether anyone still holds it, the recorded processes who.
                let memfd = handle
                    .as_ref()
                    .filter(|_| !revoked && report.is_some())
                    .and_then(|h| dev.held_as_file(h));
                match (report, memfd) {
                    // With a finder, even when every recorded process is gone: one it
                    // handed the memory to may live.
                    (Some(report), None) if !alive.is_empty() || finder.is_some() => {
                        pending.fetch_add(bytes, Ordering::SeqCst);
                        #[allow(clippy::disallowed_methods, reason = "the executor")]
                        let freed = dev.free_checked(alloc, handle);
                        match freed {
                            Ok(Returned::No) => {
                                let (found, recheck) = match (finder, &reached) {
                                    (Some((finder, uuid)), Some((_, recorded))) => {
                                        let crate::kept_holders::Finding { found, places } =
                                            finder.find(&uuid, recorded, &alive);
                                        (found, Some(stranded::Recheck { finder, uuid, places }))
                                    }
                                    _ => (Vec::new(), None),
                                };
                                // A process found answers as the recorded one it is near.
                                let mut keepers = alive.clone();
                                keepers.extend(found.iter().map(|f| f.near));
                                let mut pids = alive;
                                pids.extend(found.iter().map(|f| f.pid));
                                if pids.is_empty() {
                                    pending.fetch_sub(bytes, Ordering::SeqCst);
                                    tracing::warn!(device, bytes, "freed memory stayed on the device, kept by no process the broker can name: outside the books");
                                } else {
                                    report(device, answering(&keepers), bytes, pids, stranded::Kept::Cuda(recheck));
                                }
                            }
                            Ok(Returned::Yes | Returned::Unknown) => {
                                pending.fetch_sub(bytes, Ordering::SeqCst);
                            }
                            Err(e) => {
                                pending.fetch_sub(bytes, Ordering::SeqCst);
                                tracing::error!(device, alloc = id, error = %e, "free failed");
                            }
                        }
                    }
                    (report, memfd) => {
                        if memfd.is_some() {
                            pending.fetch_add(bytes, Ordering::SeqCst);
                        }
                        #[allow(clippy::disallowed_methods, reason = "the executor")]
                        let freed = dev.free(alloc);
                        drop(handle);
                        if let Err(e) = &freed {
                            tracing::error!(device, alloc = id, error = %e, "free failed");
                        }
                        let (Some(report), Some(file)) = (report, memfd) else {
                            return;
                        };
                        let kept = freed.ok().and_then(|()| {
                            crate::device::free_check::memfd_kept(&file, &alive, prober.as_deref())
                        });
                        match kept {
                            Some(kept) => {
                                let tenant = answering(&kept.answering);
                                let looks = stranded::MemfdKept {
                                    file,
                                    by_handle: kept.by_handle,
                                };
                                report(device, tenant, bytes, kept.pids, stranded::Kept::Memfd(looks));
                            }
                            None => {
                                pending.fetch_sub(bytes, Ordering::SeqCst);
                            }
                        }
                    }
                }
            });
            if let Err(e) = r {
                tracing::error!(device, error = %e, "cannot queue free");
            }
        }
    }
}

/// Per device, bytes a free left on the device whose charge is on its way or still being
/// judged (`Arbiter::unverified`): shared with the device threads' frees and their reporters.
#[derive(Clone)]
struct UnverifiedBytes(Arc<[AtomicU64]>);

impl UnverifiedBytes {
    /// Bytes freed on device `i` that stayed there and are not charged yet.
    fn of(&self, i: usize) -> u64 {
        self.0.get(i).map_or(0, |b| b.load(Ordering::SeqCst))
    }
}

impl std::ops::Deref for UnverifiedBytes {
    type Target = [AtomicU64];
    fn deref(&self) -> &[AtomicU64] {
        &self.0
    }
}

/// Takes memory about to be freed back from whoever may still map it (a memfd is
/// truncated). Only the broker's frees of memory that nobody it counts may map come here,
/// so a process that still maps it kept it past its release, its session or its tenant's
/// cache. Memory the device cannot revoke (CUDA; a memfd sealed against shrinking) stays
/// with such a process, outside the books.
pub(crate) fn revoke_before_free(
    dev: &mut dyn crate::device::Device,
    alloc: &crate::device::Allocation,
    device: u32,
) -> bool {
    match dev.revoke(alloc) {
        Ok(()) => true,
        Err(e) => {
            // A published memfd (sealed against shrinking for its importers) or one its
            // holder so sealed: a mapping kept of it keeps its pages (the free then looks
            // for who keeps it). The usual case is a once-published memfd, freed with
            // nobody mapping it: no alarm.
            tracing::debug!(device, alloc = alloc.id, error = %e, "memory could not be revoked before its free (sealed against shrinking); a process that kept it mapped keeps it");
            false
        }
    }
}

/// A test arbiter over `devices` simulated (host-backend) devices of `capacity` bytes
/// each, with the admin token `x` and no store.
#[cfg(test)]
pub(crate) fn host_arbiter(capacity: u64, devices: u32, cfg: ArbiterConfig) -> Arc<Arbiter> {
    host_arbiter_with_store(capacity, devices, cfg, None)
}

/// [`host_arbiter`], with its tenants and tokens in `store`.
#[cfg(test)]
pub(crate) fn host_arbiter_with_store(
    capacity: u64,
    devices: u32,
    cfg: ArbiterConfig,
    store: Option<Store>,
) -> Arc<Arbiter> {
    let spec = crate::backend::BackendSpec {
        choice: crate::backend::BackendChoice::Host,
        cuda_devices: None,
        host_capacity: capacity,
        host_devices: devices,
        headroom: crate::backend::Headroom::Bytes(0),
        host_uuid_seed: None,
    };
    let slots = crate::backend::open_devices(&spec).unwrap();
    Arbiter::new(slots, None, store, Arc::new(Authenticator::new("x")), cfg).unwrap()
}

#[cfg(test)]
mod claims_tests;
#[cfg(test)]
mod descriptor_tests;
#[cfg(test)]
pub(crate) mod durable_tests;
#[cfg(test)]
mod lingering_tests;
#[cfg(test)]
mod store_fault_tests;
#[cfg(test)]
mod stranded_tests;
#[cfg(test)]
pub(crate) mod tests;
