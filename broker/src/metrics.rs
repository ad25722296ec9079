//! Prometheus metrics. [`Metrics`] is owned by the arbiter (`Arbiter::metrics`, one per
//! arbiter, no globals): counters and histograms of what the broker did (grants, refusals
//! by reason, reclaims, revocations, quarantines, acquire latency, time to grant, store
//! writes), bumped where it happens. [`render`] adds gauges from snapshots of the live state
//! (`views.rs`: devices labelled by index, UUID and model; tenants; sessions; build info)
//! and encodes everything as OpenMetrics text, or as the Prometheus 0.0.4 text format for
//! scrapers that do not ask for OpenMetrics ([`Format`]). This module does not know the
//! arbiter: `Views::metrics_text` (`arbiter/listing.rs`) takes the snapshots and calls [`render`]. The HTTP side
//! is `status_http`.

use crate::error::BrokerError;
use crate::lease::Revocation;
use crate::ledger::Tier;
use crate::views::{DeviceReport, TenantView};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// A device's labels, named as DCGM exporter names them (`gpu` the index, `UUID`,
/// `modelName`, `Hostname`) so that one query joins the broker's series with the node's
/// DCGM series (`* on(UUID) group_left ...`).
#[allow(non_snake_case)]
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    gpu: String,
    UUID: String,
    modelName: String,
    Hostname: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabel {
    tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LineLabels {
    op: &'static str,
    answer: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    backend: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Latency buckets: 100 us to about 100 s, x4 apart.
fn latency_histogram() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        1e-4, 4.0, 11,
    ))
}

/// What the broker did, counted where it happens. Cheap to bump (atomics); shared by
/// reference from the arbiter.
pub struct Metrics {
    grants: Family<TierLabel, Counter>,
    refusals: Family<ReasonLabel, Counter>,
    reclaims: Counter,
    revocations: Family<ReasonLabel, Counter>,
    quarantines: Counter,
    acquire_seconds: HistogramFamily<OutcomeLabel>,
    grant_wait_seconds: Histogram,
    store_write_failures: Counter,
    tickets_redeemed: Counter,
    descriptors_pushed: Counter,
    ticket_refusals: Family<ReasonLabel, Counter>,
    /// Requests served on lease lines (`fd/lease_line.rs`), by operation and answer.
    line_requests: Family<LineLabels, Counter>,
    cross_tenant_fresh: Counter,
    /// Leases and sessions a start found with the keeper, by outcome (adopted, reclaimed).
    kept_leases: Family<OutcomeLabel, Counter>,
    kept_sessions: Family<OutcomeLabel, Counter>,
    /// Blocks held for importers, lingering imports and charges of memory kept outside
    /// the broker a start found with the keeper, by outcome (adopted, let_go).
    kept_held: Family<OutcomeLabel, Counter>,
    kept_lingering: Family<OutcomeLabel, Counter>,
    kept_stranded: Family<OutcomeLabel, Counter>,
    sessions_resumed: Counter,
    /// Keepers declared lost (gone, or a write past its deadline).
    keeper_lost: Counter,
    /// Lost keepers reconnected to and filled again.
    keeper_relinked: Counter,
    /// Unix time (s) of the last failed store write, 0 if none; and of the last success.
    store_last_failure: AtomicU64,
    store_last_success: AtomicU64,
    started: SystemTime,
    /// How long the state lock is held (`lock_holds.rs`).
    pub lock_holds: crate::lock_holds::LockHolds,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics::with_lock_holds(crate::lock_holds::LockHolds::default())
    }

    /// Metrics whose state-lock hold counts are `lock_holds` (which clocks they read).
    pub fn with_lock_holds(lock_holds: crate::lock_holds::LockHolds) -> Metrics {
        let m = Metrics {
            grants: Family::default(),
            refusals: Family::default(),
            reclaims: Counter::default(),
            revocations: Family::default(),
            quarantines: Counter::default(),
            acquire_seconds: Family::new_with_constructor(latency_histogram),
            grant_wait_seconds: latency_histogram(),
            store_write_failures: Counter::default(),
            tickets_redeemed: Counter::default(),
            descriptors_pushed: Counter::default(),
            ticket_refusals: Family::default(),
            line_requests: Family::default(),
            cross_tenant_fresh: Counter::default(),
            kept_leases: Family::default(),
            kept_sessions: Family::default(),
            kept_held: Family::default(),
            kept_lingering: Family::default(),
            kept_stranded: Family::default(),
            sessions_resumed: Counter::default(),
            keeper_lost: Counter::default(),
            keeper_relinked: Counter::default(),
            store_last_failure: AtomicU64::new(0),
            store_last_success: AtomicU64::new(0),
            started: SystemTime::now(),
            lock_holds,
        };
        // Every label value exists from the start (at 0), so that rate() and alerts see
        // the first event.
        for tier in ["device", "host"] {
            let _ = m.grants.get_or_create(&TierLabel { tier });
        }
        for reason in REFUSAL_REASONS {
            let _ = m.refusals.get_or_create(&ReasonLabel { reason });
        }
        for reason in ["operator", "reclaim_deadline"] {
            let _ = m.revocations.get_or_create(&ReasonLabel { reason });
        }
        for outcome in ["adopted", "reclaimed"] {
            let _ = m.kept_leases.get_or_create(&OutcomeLabel { outcome });
            let _ = m.kept_sessions.get_or_create(&OutcomeLabel { outcome });
        }
        for outcome in ["adopted", "let_go"] {
            for f in [&m.kept_held, &m.kept_lingering, &m.kept_stranded] {
                let _ = f.get_or_create(&OutcomeLabel { outcome });
            }
        }
        for outcome in ["granted", "refused"] {
            let _ = m.acquire_seconds.get_or_create(&OutcomeLabel { outcome });
        }
        let busy = [TICKET_BUSY, CHANNEL_BUSY, LINE_BUSY, TOO_MANY_RECIPIENTS];
        for reason in TicketRefusal::ALL
            .map(TicketRefusal::as_str)
            .into_iter()
            .chain(busy)
        {
            let _ = m.ticket_refusals.get_or_create(&ReasonLabel { reason });
        }
        m
    }

    /// The ticket server delivered a lease's descriptor.
    pub fn ticket_redeemed(&self) {
        self.tickets_redeemed.inc();
    }

    /// A grant's descriptor was sent on its process's descriptor channel (no ticket).
    pub fn descriptor_pushed(&self) {
        self.descriptors_pushed.inc();
    }

    /// The ticket server refused a ticket (a [`TicketRefusal`] label, [`TICKET_BUSY`],
    /// [`CHANNEL_BUSY`], [`LINE_BUSY`], [`TOO_MANY_RECIPIENTS`] or `lease_gone`).
    pub fn ticket_refused(&self, reason: &'static str) {
        self.ticket_refusals
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// A lease line served request `op` (`acquire`, `release`) with `answer` (`granted`,
    /// `released`, `not_here`).
    pub fn line_request(&self, op: &'static str, answer: &'static str) {
        self.line_requests
            .get_or_create(&LineLabels { op, answer })
            .inc();
    }

    /// A grant got a fresh memory object instead of another tenant's cached block that a
    /// process may still map.
    pub fn cross_tenant_fresh(&self) {
        self.cross_tenant_fresh.inc();
    }

    /// A start took back `adopted` and let go `let_go` of the kept (blocks held for
    /// importers, lingering imports, charges of memory kept outside the broker).
    pub fn count_restart_kept(
        &self,
        held: (usize, usize),
        lingering: (usize, usize),
        stranded: (usize, usize),
    ) {
        for (family, (adopted, let_go)) in [
            (&self.kept_held, held),
            (&self.kept_lingering, lingering),
            (&self.kept_stranded, stranded),
        ] {
            family
                .get_or_create(&OutcomeLabel { outcome: "adopted" })
                .inc_by(adopted as u64);
            family
                .get_or_create(&OutcomeLabel { outcome: "let_go" })
                .inc_by(let_go as u64);
        }
    }

    /// A start took back `adopted` and let go `reclaimed` of the kept (sessions, leases).
    pub fn count_restart(&self, sessions: (usize, usize), leases: (usize, usize)) {
        for (family, (adopted, reclaimed)) in
            [(&self.kept_sessions, sessions), (&self.kept_leases, leases)]
        {
            family
                .get_or_create(&OutcomeLabel { outcome: "adopted" })
                .inc_by(adopted as u64);
            family
                .get_or_create(&OutcomeLabel {
                    outcome: "reclaimed",
                })
                .inc_by(reclaimed as u64);
        }
    }

    /// A worker resumed its session after a restart.
    pub fn count_resumed(&self) {
        self.sessions_resumed.inc();
    }

    /// The keeper was declared lost: leases are no longer kept.
    pub fn count_keeper_lost(&self) {
        self.keeper_lost.inc();
    }

    /// A lost keeper was reconnected to and filled again: leases are kept again.
    pub fn count_keeper_relinked(&self) {
        self.keeper_relinked.inc();
    }

    /// When this broker process started.
    pub fn started(&self) -> SystemTime {
        self.started
    }

    /// A lease was granted.
    pub fn granted(&self, tier: Tier) {
        let tier = match tier {
            Tier::Device => "device",
            Tier::Host => "host",
        };
        self.grants.get_or_create(&TierLabel { tier }).inc();
    }

    /// Device leases granted so far (tests).
    #[cfg(test)]
    pub fn granted_total(&self) -> u64 {
        self.grants
            .get_or_create(&TierLabel { tier: "device" })
            .get()
    }

    /// An `AcquireLease` finished after `took`: its latency, and its refusal reason.
    pub fn acquired<T>(&self, result: &Result<T, BrokerError>, took: Duration) {
        let outcome = match result {
            Ok(_) => "granted",
            Err(e) => {
                let reason = refusal_reason(e);
                self.refusals.get_or_create(&ReasonLabel { reason }).inc();
                "refused"
            }
        };
        self.acquire_seconds
            .get_or_create(&OutcomeLabel { outcome })
            .observe(took.as_secs_f64());
    }

    /// A request that had to wait in the queue was granted after `waited`.
    pub fn granted_after_wait(&self, waited: Duration) {
        self.grant_wait_seconds.observe(waited.as_secs_f64());
    }

    /// A holder was asked to give a lease back.
    pub fn reclaim_requested(&self) {
        self.reclaims.inc();
    }

    /// A lease was taken away: by an operator, or for a missed reclaim deadline.
    pub fn revoked(&self, why: Revocation) {
        let reason = match why {
            Revocation::ReclaimDeadline => "reclaim_deadline",
            Revocation::Operator => "operator",
        };
        self.revocations
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// The memory of an ended lease went to quarantine.
    pub fn quarantined(&self) {
        self.quarantines.inc();
    }

    /// A write to the state store succeeded or failed.
    pub fn store_write(&self, ok: bool) {
        let now = crate::units::unix_ms(SystemTime::now()).max(0) as u64 / 1000;
        if ok {
            self.store_last_success.store(now, Ordering::Relaxed);
        } else {
            self.store_write_failures.inc();
            self.store_last_failure.store(now, Ordering::Relaxed);
        }
    }

    fn register(&self, reg: &mut Registry) {
        self.lock_holds.register(reg);
        reg.register(
            "tickets_redeemed",
            "Lease file descriptors delivered by the ticket server",
            self.tickets_redeemed.clone(),
        );
        reg.register(
            "descriptors_pushed",
            "Lease file descriptors sent with the grant on the worker's descriptor channel",
            self.descriptors_pushed.clone(),
        );
        reg.register(
            "ticket_refusals",
            "Ticket presentations refused (connection closed, nothing sent), by reason",
            self.ticket_refusals.clone(),
        );
        reg.register(
            "lease_line_requests",
            "Requests on sessions' lease lines (retained blocks leased and released without a gRPC call), by operation and answer",
            self.line_requests.clone(),
        );
        reg.register(
            "cross_tenant_fresh_blocks",
            "Grants given a fresh memory object instead of another tenant's cached one",
            self.cross_tenant_fresh.clone(),
        );
        reg.register(
            "restart_kept_leases",
            "Leases a broker start found with the keeper: adopted (live holder) or reclaimed",
            self.kept_leases.clone(),
        );
        reg.register(
            "restart_kept_sessions",
            "Sessions a broker start found with the keeper: adopted (live holder) or reclaimed",
            self.kept_sessions.clone(),
        );
        reg.register(
            "restart_kept_held_blocks",
            "Blocks held for importers a broker start found with the keeper: adopted (an importer lives) or let_go",
            self.kept_held.clone(),
        );
        reg.register(
            "restart_kept_lingering_imports",
            "Lingering imports a broker start found with the keeper: adopted (a process that may map it lives) or let_go",
            self.kept_lingering.clone(),
        );
        reg.register(
            "restart_kept_stranded",
            "Charges of memory kept outside the broker a broker start found with the keeper: adopted (a holder lives) or let_go",
            self.kept_stranded.clone(),
        );
        reg.register(
            "sessions_resumed",
            "Sessions their workers resumed after a broker restart",
            self.sessions_resumed.clone(),
        );
        reg.register(
            "keeper_lost",
            "Keepers declared lost (gone, or stalled past the write deadline): leases made since are not kept",
            self.keeper_lost.clone(),
        );
        reg.register(
            "keeper_relinked",
            "Lost keepers reconnected to (a new one on the socket, or a stalled one reading again), told to forget and given every live record again",
            self.keeper_relinked.clone(),
        );
        reg.register(
            "leases_granted",
            "Leases granted, by memory tier",
            self.grants.clone(),
        );
        reg.register(
            "acquire_refusals",
            "AcquireLease calls refused, by reason",
            self.refusals.clone(),
        );
        reg.register(
            "reclaim_requests",
            "Reclaim requests sent to holders",
            self.reclaims.clone(),
        );
        reg.register(
            "revocations",
            "Leases revoked, by reason (operator, reclaim_deadline)",
            self.revocations.clone(),
        );
        reg.register(
            "quarantines",
            "Ended leases whose memory went to quarantine",
            self.quarantines.clone(),
        );
        reg.register(
            "acquire_duration_seconds",
            "Time an AcquireLease call took, waiting included, by outcome",
            self.acquire_seconds.clone(),
        );
        reg.register(
            "grant_wait_seconds",
            "Time from request to grant of requests that had to wait in the queue",
            self.grant_wait_seconds.clone(),
        );
        reg.register(
            "store_write_failures",
            "Writes to the state store that failed",
            self.store_write_failures.clone(),
        );
        let unix = |a: &AtomicU64| {
            let g = Gauge::<i64>::default();
            g.set(a.load(Ordering::Relaxed) as i64);
            g
        };
        reg.register(
            "store_last_failure_timestamp_seconds",
            "When a state store write last failed (0: never)",
            unix(&self.store_last_failure),
        );
        reg.register(
            "store_last_success_timestamp_seconds",
            "When a state store write last succeeded (0: none yet)",
            unix(&self.store_last_success),
        );
        let started = Gauge::<i64>::default();
        started.set(crate::units::unix_ms(self.started) / 1000);
        reg.register(
            "start_time_seconds",
            "When this broker process started (Unix time)",
            started,
        );
    }
}

/// The `reason` of `ticket_refusals` when a ticket connection is turned away at a
/// connection limit ("busy": its ticket untouched).
pub const TICKET_BUSY: &str = "busy";
/// The `reason` of `ticket_refusals` when a descriptor channel is refused at a channel
/// limit ("busy": the process keeps redeeming tickets).
pub const CHANNEL_BUSY: &str = "channel_busy";
/// The `reason` of `ticket_refusals` when a lease line is refused at a line limit ("busy":
/// the process leases over gRPC).
pub const LINE_BUSY: &str = "line_busy";
/// The `reason` of `ticket_refusals` when a lease's (or an import's) descriptor already
/// reached as many processes outside its session as its record names.
pub const TOO_MANY_RECIPIENTS: &str = "too_many_recipients";

/// Why the ticket server refused a ticket (`fd/tickets.rs`; the `reason` label of
/// `ticket_refusals`). Kept here, below the ticket server, so the metrics import nothing
/// above them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TicketRefusal {
    /// Never issued, already used, or its lease ended.
    Unknown,
    /// Issued but past its TTL.
    Expired,
    /// Presented by a process whose credentials do not match the binding.
    Foreign,
    /// Not `TICKET_LEN` bytes before the connection ended or timed out.
    Malformed,
    /// Presented by its rightful peer after its lease ended (reclaimed, revoked, released
    /// or its session ended): answered "lease ended".
    LeaseEnded,
}

impl TicketRefusal {
    /// Every reason (each label value exists from the start).
    pub const ALL: [TicketRefusal; 5] = [
        TicketRefusal::Unknown,
        TicketRefusal::Expired,
        TicketRefusal::Foreign,
        TicketRefusal::Malformed,
        TicketRefusal::LeaseEnded,
    ];

    /// Its label value.
    pub fn as_str(self) -> &'static str {
        match self {
            TicketRefusal::Unknown => "unknown_or_used",
            TicketRefusal::Expired => "expired",
            TicketRefusal::Foreign => "foreign_peer",
            TicketRefusal::Malformed => "malformed",
            TicketRefusal::LeaseEnded => "lease_ended",
        }
    }
}

/// Every value of the `reason` label of `acquire_refusals`.
pub const REFUSAL_REASONS: [&str; 11] = [
    "quota",
    "max_leases",
    "max_waiting",
    "too_large",
    "capacity",
    "wait_expired",
    "invalid",
    "not_found",
    "unavailable",
    "precondition",
    "other",
];

/// The refusal reason label of an error (one of [`REFUSAL_REASONS`]): the caps that have a
/// label of their own, then by what kind of refusal the rest are.
pub fn refusal_reason(e: &BrokerError) -> &'static str {
    use crate::error::ErrorKind;
    use BrokerError::*;
    match e {
        QuotaExceeded { .. } | DeviceQuotaExceeded { .. } => "quota",
        LeaseCountLimit { .. } => "max_leases",
        QueueFull { .. } => "max_waiting",
        TooLarge { .. } => "too_large",
        _ => match e.kind() {
            ErrorKind::Exhausted => "capacity",
            ErrorKind::Expired => "wait_expired",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Precondition => "precondition",
            ErrorKind::Invalid => "invalid",
            ErrorKind::Denied | ErrorKind::Unauthenticated | ErrorKind::Internal => "other",
        },
    }
}

/// Which exposition format a scraper gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text (what Prometheus asks for).
    OpenMetrics,
    /// The Prometheus text format 0.0.4 (for anything that does not ask for OpenMetrics).
    PrometheusText,
}

impl Format {
    /// The format to answer a request with this `Accept` header.
    pub fn negotiate(accept: Option<&str>) -> Format {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::PrometheusText,
        }
    }

    /// The `Content-Type` of what [`render`] writes in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::PrometheusText => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

fn device_labels(d: &DeviceReport, host: &str) -> DeviceLabels {
    DeviceLabels {
        gpu: d.index.to_string(),
        UUID: d.uuid.clone(),
        modelName: if d.model.is_empty() {
            d.name.clone()
        } else {
            d.model.clone()
        },
        Hostname: host.to_string(),
    }
}

/// The node's name as DCGM exporter reports it: `NODE_NAME` (set from the pod's
/// `spec.nodeName` in Kubernetes), else the host name. Read at each scrape (a rename
/// shows; a file read is nothing next to the scrape).
fn hostname() -> String {
    std::env::var("NODE_NAME")
        .ok()
        .filter(|n| !n.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .unwrap_or_default()
}

type DeviceGet = fn(&DeviceReport) -> u64;
const DEVICE_GAUGES: [(&str, &str, DeviceGet); 13] = [
    (
        "device_healthy",
        "1 while the device is healthy; 0 when marked unhealthy (no new leases there)",
        |d| u64::from(d.fault.is_none()),
    ),
    (
        "device_draining",
        "1 while the device drains for maintenance (no new leases there)",
        |d| u64::from(d.drain_reason.is_some()),
    ),
    ("device_total_bytes", "Memory of the device", |d| d.total),
    (
        "device_free_bytes",
        "Free memory as the device reports it",
        |d| d.free,
    ),
    (
        "device_leasable_bytes",
        "Most the broker may hand out on the device",
        |d| d.leasable,
    ),
    ("device_leased_bytes", "Bytes in live leases", |d| d.leased),
    ("device_cached_bytes", "Freed bytes kept for reuse", |d| {
        d.cached
    }),
    (
        "device_quarantined_bytes",
        "Bytes of ended leases a live process may still map",
        |d| d.quarantined,
    ),
    (
        "device_headroom_bytes",
        "Memory kept free on the device",
        |d| d.headroom,
    ),
    (
        "device_external_used_bytes",
        "Memory used on the device outside the broker",
        |d| d.external_used,
    ),
    (
        "device_process_reserved_bytes",
        "Device bytes kept for reserved processes to allocate themselves",
        |d| d.process_reserved,
    ),
    ("device_leases", "Live leases on the device", |d| {
        d.lease_count.into()
    }),
    (
        "device_waiting_requests",
        "Requests waiting for the device",
        |d| d.waiting.into(),
    ),
];

type TenantGet = fn(&TenantView) -> u64;
const TENANT_GAUGES: [(&str, &str, TenantGet); 12] = [
    ("tenant_held_bytes", "Device bytes the tenant holds", |t| {
        t.usage.held_bytes
    }),
    (
        "tenant_limit_bytes",
        "The tenant's device memory limit",
        |t| t.quota.limit_bytes,
    ),
    (
        "tenant_guaranteed_bytes",
        "Device memory kept available for the tenant",
        |t| t.quota.guaranteed_bytes,
    ),
    (
        "tenant_reserved_bytes",
        "Device bytes admitted for the tenant, allocation in flight",
        |t| t.usage.reserved_bytes,
    ),
    (
        "tenant_quarantined_bytes",
        "Bytes of the tenant's ended leases a live process may still map",
        |t| t.usage.quarantined_bytes,
    ),
    (
        "tenant_borrowed_bytes",
        "Bytes the tenant holds beyond its guarantee",
        |t| t.borrowed_bytes,
    ),
    (
        "tenant_process_reserved_bytes",
        "Device bytes reserved for the tenant's processes, less what their leases drew",
        |t| t.usage.process_reserved_bytes,
    ),
    (
        "tenant_host_held_bytes",
        "Host-fallback bytes the tenant holds",
        |t| t.usage.host_held_bytes,
    ),
    ("tenant_leases", "Live leases of the tenant", |t| {
        u64::from(t.usage.lease_count) + u64::from(t.usage.host_lease_count)
    }),
    ("tenant_sessions", "Open sessions of the tenant", |t| {
        t.sessions.into()
    }),
    (
        "tenant_waiting_requests",
        "Requests of the tenant waiting in the queue",
        |t| t.waiting.into(),
    ),
    ("tenant_tokens", "Live bearer tokens of the tenant", |t| {
        t.tokens.into()
    }),
];

/// The metrics text for `metrics`, what `more` registers (the scheduler's own metrics) and
/// snapshots of the live state (`devices`, `tenants`, the number of open `sessions`), in
/// `format`.
pub fn render(
    metrics: &Metrics,
    more: impl FnOnce(&mut Registry),
    devices: &[DeviceReport],
    tenants: &[TenantView],
    sessions: usize,
    format: Format,
) -> String {
    let mut root = Registry::default();
    crate::process_metrics::register(&mut root);
    let reg = root.sub_registry_with_prefix("gpu_broker");
    metrics.register(reg);
    more(reg);

    let backend = devices
        .first()
        .map(|d| d.backend.clone())
        .unwrap_or_default();
    let build = Family::<BuildLabels, Gauge>::default();
    build
        .get_or_create(&BuildLabels {
            version: env!("CARGO_PKG_VERSION"),
            backend,
        })
        .set(1);
    reg.register("build_info", "Version of the broker and its backend", build);
    let host = hostname();
    for (name, help, get) in DEVICE_GAUGES {
        let fam = Family::<DeviceLabels, Gauge>::default();
        for d in devices {
            fam.get_or_create(&device_labels(d, &host))
                .set(get(d) as i64);
        }
        reg.register(name, help, fam);
    }

    for (name, help, get) in TENANT_GAUGES {
        let fam = Family::<TenantLabel, Gauge>::default();
        for t in tenants {
            fam.get_or_create(&TenantLabel {
                tenant: t.name.clone(),
            })
            .set(get(t) as i64);
        }
        reg.register(name, help, fam);
    }
    let turns = Family::<TenantLabel, Counter>::default();
    let compute = Family::<TenantLabel, Counter<f64, std::sync::atomic::AtomicU64>>::default();
    let overrun = Family::<TenantLabel, Counter<f64, std::sync::atomic::AtomicU64>>::default();
    for t in tenants {
        let l = TenantLabel {
            tenant: t.name.clone(),
        };
        turns.get_or_create(&l).inc_by(t.turns.turns);
        compute
            .get_or_create(&l)
            .inc_by(t.turns.compute.as_secs_f64());
        overrun
            .get_or_create(&l)
            .inc_by(t.turns.overrun.as_secs_f64());
    }
    reg.register(
        "tenant_turns",
        "Compute turns of the tenant that ended",
        turns,
    );
    reg.register(
        "tenant_compute_seconds",
        "Time the tenant held compute turns",
        compute,
    );
    reg.register(
        "tenant_overrun_seconds",
        "Time the tenant held turns past the quantum while others waited",
        overrun,
    );

    let open = Gauge::<i64>::default();
    open.set(sessions as i64);
    reg.register("sessions", "Open sessions", open);
    let mps = Gauge::<i64>::default();
    mps.set(i64::from(mps_control_present()));
    reg.register(
        "mps_control_present",
        "1 when a CUDA MPS control daemon's pipe exists (CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps)",
        mps,
    );

    let mut out = String::new();
    if encode(&mut out, &root).is_err() {
        out.clear();
    }
    match format {
        Format::OpenMetrics => out,
        Format::PrometheusText => to_prometheus_text(&out),
    }
}

/// Is an MPS control daemon running for this node's default (or configured) pipe directory?
fn mps_control_present() -> bool {
    let dir = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/tmp/nvidia-mps"));
    dir.join("control").exists()
}

/// OpenMetrics text as the Prometheus 0.0.4 text format: no `# EOF` or `# UNIT` lines,
/// counter families named by their `_total` samples, OpenMetrics-only types as gauges or
/// untyped.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    use std::collections::HashSet;
    let counters: HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = line
            .strip_prefix("# TYPE ")
            .map(|r| ("# TYPE ", r))
            .or_else(|| line.strip_prefix("# HELP ").map(|r| ("# HELP ", r)));
        if let Some((kind, rest)) = meta {
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            let name = if counters.contains(name) {
                format!("{name}_total")
            } else {
                name.to_string()
            };
            let tail = match (kind, tail) {
                ("# TYPE ", "info" | "stateset") => "gauge",
                ("# TYPE ", "unknown" | "gaugehistogram") => "untyped",
                _ => tail,
            };
            out.push_str(kind);
            out.push_str(&name);
            out.push(' ');
            out.push_str(tail);
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_classified() {
        use crate::error::{DeviceRoom, Queue};
        let t = || "a".to_string();
        for (e, want) in [
            (
                BrokerError::QuotaExceeded {
                    tenant: t(),
                    tier: Tier::Device,
                    requested: 2,
                    held: 0,
                    limit: 1,
                },
                "quota",
            ),
            (
                BrokerError::LeaseCountLimit {
                    tenant: t(),
                    count: 1,
                    max: 1,
                },
                "max_leases",
            ),
            (
                BrokerError::QueueFull {
                    tenant: t(),
                    waiting: 3,
                    queue: Queue::Lease,
                },
                "max_waiting",
            ),
            (
                BrokerError::TooLarge {
                    requested: 2 << 30,
                    leasable: 1 << 30,
                    device: None,
                },
                "too_large",
            ),
            (
                BrokerError::NoCapacity {
                    tenant: t(),
                    requested: 4 << 20,
                    devices: vec![DeviceRoom {
                        device: 0,
                        free: 0,
                        leasable: 1 << 30,
                    }],
                    guaranteed: 0,
                    held: 0,
                    limit: 1 << 30,
                    waiting: 0,
                },
                "capacity",
            ),
            (
                BrokerError::WaitExpired {
                    waited_ms: 1,
                    cause: Box::new(BrokerError::ShuttingDown),
                },
                "wait_expired",
            ),
            (BrokerError::ShuttingDown, "unavailable"),
            (BrokerError::InvalidArgument("bytes".into()), "invalid"),
        ] {
            assert_eq!(refusal_reason(&e), want, "{e:?}");
        }
    }

    #[test]
    fn prometheus_text_names_counters_by_their_samples() {
        let om = "# HELP x_grants Grants.\n# TYPE x_grants counter\nx_grants_total 3\n# TYPE x_up gauge\nx_up 1\n# EOF\n";
        let text = to_prometheus_text(om);
        assert_eq!(
            text,
            "# HELP x_grants_total Grants.\n# TYPE x_grants_total counter\nx_grants_total 3\n# TYPE x_up gauge\nx_up 1\n"
        );
        assert_eq!(Format::negotiate(None), Format::PrometheusText);
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"
            )),
            Format::OpenMetrics
        );
    }

    #[test]
    fn counters_show_in_the_registry() {
        let m = Metrics::new();
        m.granted(Tier::Device);
        m.acquired::<()>(
            &Err(BrokerError::WaitExpired {
                waited_ms: 3,
                cause: Box::new(BrokerError::ShuttingDown),
            }),
            Duration::from_millis(3),
        );
        m.revoked(Revocation::ReclaimDeadline);
        m.store_write(false);
        let mut reg = Registry::with_prefix("gpu_broker");
        m.register(&mut reg);
        let mut out = String::new();
        encode(&mut out, &reg).unwrap();
        for want in [
            "gpu_broker_leases_granted_total{tier=\"device\"} 1",
            "gpu_broker_acquire_refusals_total{reason=\"wait_expired\"} 1",
            "gpu_broker_revocations_total{reason=\"reclaim_deadline\"} 1",
            "gpu_broker_store_write_failures_total 1",
            "gpu_broker_acquire_duration_seconds_count{outcome=\"refused\"} 1",
        ] {
            assert!(out.contains(want), "{want} in\n{out}");
        }
    }
}
