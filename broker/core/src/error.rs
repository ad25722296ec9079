//! `BrokerError`: every way a request can fail. Refusals the API promises have a variant
//! that says what happened (quota exceeded, no capacity, a cap reached, something not
//! found, ...) and carries the numbers as fields; the remaining variants are plain
//! messages (invalid argument, failed precondition, unavailable, ...). The domain's error
//! names no transport: `grpc_status.rs` makes a status of it (the gRPC code, the message,
//! the machine-readable reason and its numbers). Every message a client gets is cut to
//! [`MAX_STATUS_MESSAGE_BYTES`] ([`status_message`]), whatever input it quotes.

use crate::memory::DeviceError;
use crate::tier::Tier;
use crate::units::show;
use std::fmt;
use uuid::Uuid;

/// Longest message of a gRPC status the broker sends.
pub const MAX_STATUS_MESSAGE_BYTES: usize = 1024;

/// A request failure.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum BrokerError {
    // ---- RESOURCE_EXHAUSTED
    /// The tenant's byte limit (device or host tier) does not fit the request.
    #[error(
        "quota exceeded for tenant {tenant:?}: requested {}, holding {} of limit {}{}",
        show(*requested),
        show(*held),
        show(*limit),
        if *tier == Tier::Host { " (host fallback)" } else { "" }
    )]
    QuotaExceeded {
        tenant: String,
        tier: Tier,
        requested: u64,
        held: u64,
        limit: u64,
    },
    /// The tenant's cap on one device does not fit the request there (and no other
    /// device the request may use has room under its caps).
    #[error(
        "per-device quota exceeded for tenant {tenant:?} on device {device}: requested {}, holding {} of its limit {} there",
        show(*requested),
        show(*held),
        show(*limit)
    )]
    DeviceQuotaExceeded {
        tenant: String,
        device: u32,
        requested: u64,
        held: u64,
        limit: u64,
    },
    /// The tenant holds `max_leases` leases (device and host together).
    #[error("lease count limit reached for tenant {tenant:?}: {count} of {max}")]
    LeaseCountLimit {
        tenant: String,
        count: u64,
        max: u64,
    },
    /// The request is larger than any candidate device could ever lease.
    #[error(
        "requested {} exceeds the leasable capacity {} of {}",
        show(*requested),
        show(*leasable),
        match device { Some(d) => format!("device {d}"), None => "every device".into() }
    )]
    TooLarge {
        requested: u64,
        leasable: u64,
        device: Option<u32>,
    },
    /// The request fits the quota and a device, but not what is free now.
    #[error(
        "cannot grant {} to tenant {tenant:?} now: {}; {} kept for other tenants' guarantees; tenant holds {} of limit {}; {waiting} other request(s) waiting",
        show(*requested),
        DeviceRoom::list(devices),
        show(*guaranteed),
        show(*held),
        show(*limit)
    )]
    NoCapacity {
        tenant: String,
        requested: u64,
        /// Each candidate device's free and leasable bytes.
        devices: Vec<DeviceRoom>,
        /// Bytes kept free for other tenants' unused guarantees.
        guaranteed: u64,
        held: u64,
        limit: u64,
        /// Requests in the queue (all tenants).
        waiting: usize,
    },
    /// The tenant already has the most waiting requests allowed in a queue.
    #[error(
        "tenant {tenant:?} already has {waiting} {} waiting, the most allowed (--max-waiting-per-tenant)",
        queue.noun()
    )]
    QueueFull {
        tenant: String,
        waiting: usize,
        queue: Queue,
    },
    /// The tenant already has the most open sessions allowed.
    #[error(
        "tenant {tenant:?} has {open} open sessions, the most allowed (--max-sessions-per-tenant)"
    )]
    SessionLimit { tenant: String, open: usize },
    /// Another session holds the compute turn and the caller would not wait.
    #[error("the compute turn on device {device} is held by tenant {holder:?}; {waiting} waiting")]
    TurnBusy {
        device: u32,
        holder: String,
        waiting: u32,
    },
    /// A lease of a reserved process does not fit in what is left of its reservation.
    #[error(
        "a lease of {} does not fit in process reservation {reservation} of pid {pid}: {} reserved, {} drawn by leases, {} left (a reserved process maps its leases within its reservation)",
        show(*requested),
        show(*reserved),
        show(*drawn),
        show(reserved.saturating_sub(*drawn))
    )]
    ReservationExceeded {
        reservation: Uuid,
        pid: u32,
        requested: u64,
        reserved: u64,
        drawn: u64,
    },
    /// Host memory was asked for as a fallback and could not be made.
    #[error("host fallback of {} failed: {cause}", show(*requested))]
    HostFallbackFailed { requested: u64, cause: String },
    /// A shared-lease table limit (publications of a tenant, imports of a publication or
    /// of a session) is reached.
    #[error("{}: {max}, the most allowed", what.noun())]
    SharingLimit { what: SharingCap, max: usize },
    /// A new block needs a descriptor, and the broker keeps the rest of its descriptor
    /// limit for connections and operators (`fd_budget.rs`).
    #[error("the broker is out of file descriptors for memory: it holds {held} for memory and watched processes, of its limit {limit} (RLIMIT_NOFILE) less {reserve} kept for connections and operators; raise the broker's descriptor limit (LimitNOFILE in its systemd unit), or use fewer, larger leases")]
    OutOfDescriptors {
        held: usize,
        limit: usize,
        reserve: usize,
    },

    // ---- DEADLINE_EXCEEDED
    /// A request waited as long as it asked and was not granted; `cause` is what it would
    /// have been refused with had it not waited.
    #[error("waited {waited_ms} ms: {cause}")]
    WaitExpired {
        waited_ms: u64,
        cause: Box<BrokerError>,
    },

    // ---- NOT_FOUND
    /// No such tenant, session, lease, token or turn (also: another tenant's).
    #[error("{0}")]
    NotFound(Missing),

    // ---- UNAVAILABLE
    /// The broker is shutting down.
    #[error("the broker is shutting down; reconnect to its successor")]
    ShuttingDown,
    /// The session was opened before this broker started: its leases are gone.
    #[error(
        "session {session} belongs to an earlier run of the broker, which restarted; its leases are gone: open a new session"
    )]
    BrokerRestarted { session: Uuid },
    /// No device of the node takes new leases (drained or unhealthy), `why` per device.
    #[error("no device on this node takes new leases: {why}; retry later or on another node")]
    NoDeviceOpen { why: String },
    /// A process reservation under `--mps` while the broker's MPS daemon is not running:
    /// `state` is what it is instead (`starting`, `down`, `stopped`), `summary` says more.
    #[error(
        "the broker's MPS daemon is {summary}: MPS reservations are refused until it runs again"
    )]
    MpsNotRunning {
        state: &'static str,
        summary: String,
    },

    // ---- FAILED_PRECONDITION
    /// The pinned device is drained or unhealthy.
    #[error(
        "device {device} is {why}: it takes no new leases; pin another device or wait until it is back"
    )]
    DeviceClosed {
        device: u32,
        /// Unhealthy (otherwise draining).
        unhealthy: bool,
        why: String,
    },
    /// A tenant cannot be deleted while it holds leases.
    #[error(
        "tenant {tenant:?} still holds {leases} leases ({}); release or revoke them first",
        show(*bytes)
    )]
    TenantInUse {
        tenant: String,
        leases: u64,
        bytes: u64,
    },
    /// The session already holds the compute turn on the device.
    #[error("this session already holds the turn on device {device}")]
    TurnAlreadyHeld { device: u32 },
    /// The request accepts only legacy CUDA IPC handles, which the broker no longer serves.
    #[error(
        "this broker no longer serves legacy CUDA IPC handles (HANDLE_KIND_CUDA_IPC): any process on the node could forge one to open other tenants' memory (docs/security.md); accept HANDLE_KIND_FD (the client crate and the Python package do)"
    )]
    LegacyHandlesRemoved,
    /// The session already holds a process reservation (a session reserves once, for its
    /// one process).
    #[error(
        "session {session} already holds process reservation {reservation}; a session reserves once, for its process"
    )]
    ReservationHeld { session: Uuid, reservation: Uuid },
    /// The tenant already publishes a lease under this name.
    #[error("tenant {tenant:?} already publishes a lease named {name:?}; unpublish it first")]
    SharedNameTaken { tenant: String, name: String },
    /// The lease is already published (under another name, or this one).
    #[error("lease {lease} is already published as {name:?}")]
    AlreadyPublished { lease: Uuid, name: String },
    /// A host-fallback lease was asked to be published (only device leases are shared).
    #[error("host-fallback leases cannot be published; publish a device lease")]
    HostLeaseNotShareable { lease: Uuid },
    /// The lease's memory could not be sealed read-only for its importers (its holder
    /// sealed it against further seals, say): `cause` is the kernel's answer.
    #[error("{cause}")]
    SealFailed { lease: Uuid, cause: String },
    /// A host-tier lease was asked of a broker that has no host tier.
    #[error("this broker has no host tier (--host-fallback-capacity 0)")]
    NoHostTier,
    /// Leases are fd handles, which need the ticket server, and this broker runs none.
    #[error("fd handles need the ticket server, which this broker does not run")]
    NoTicketServer,
    /// Leases are fd handles, delivered only over the broker's Unix socket.
    #[error(
        "fd handles are delivered only to callers on the broker's Unix socket (a TCP peer cannot receive SCM_RIGHTS); connect over unix://"
    )]
    FdNeedsUnixSocket,
    /// The request does not accept fd handles, the only kind the broker serves.
    #[error(
        "this broker serves leases as fd handles only and the request does not accept HANDLE_KIND_FD"
    )]
    FdHandlesNotAccepted,
    /// The admin token cannot be rotated: the broker reads it from no file.
    #[error("this broker has no admin token file to rotate; issue an admin-scope token instead")]
    NoAdminTokenFile,
    /// A claim's token leases while the broker holds no reservation for the claim: its
    /// lease would be an ordinary one, on any device, beside what the scheduler placed.
    #[error(
        "claim {claim} has no reservation at this broker (its driver reserves it again); retry shortly"
    )]
    ClaimNotReserved { claim: String },
    /// A claim's token asks for a process reservation: the scheduler placed the claim's
    /// bytes, not more, and its pod leases from them.
    #[error(
        "the token of claim {claim} leases from the claim's reservation; it cannot reserve a process"
    )]
    ClaimTokenCannotReserve { claim: String },

    // ---- INVALID_ARGUMENT
    /// A quota change would make the tenants' guarantees add up to more than the node can
    /// lease.
    #[error(
        "guarantees would add up to {}, more than the leasable capacity {}",
        show(*guarantees),
        show(*leasable)
    )]
    GuaranteesExceedCapacity { guarantees: u64, leasable: u64 },
    /// A device index past the last of `count` devices (the broker's, or those its MPS
    /// daemon serves).
    #[error(
        "unknown device {device}: {} {count} device(s)",
        if *mps { "the MPS daemon serves" } else { "this broker has" }
    )]
    UnknownDevice {
        device: u32,
        count: usize,
        mps: bool,
    },
    /// A request asks to wait longer than the longest wait allowed (`--max-wait`).
    #[error("wait {wait_ms} ms exceeds the maximum {max_ms} ms")]
    WaitTooLong { wait_ms: u64, max_ms: u64 },
    /// A publish names more reader tenants than allowed.
    #[error("{readers} reader tenants, the most allowed is {max}")]
    TooManyReaders { readers: usize, max: usize },
    /// A token name that only the broker gives (`claim/`: claims' tokens, minted with
    /// their reservation by `ReserveClaim`).
    #[error("token names starting with {prefix} belong to ResourceClaims (ReserveClaim)")]
    TokenNameReserved { prefix: &'static str },

    // ---- PERMISSION_DENIED
    /// The session a call names belongs to another user (its uid is not the caller's):
    /// a lease's descriptor goes to the session's user only, and its process reservation
    /// is acted on by that user only.
    #[error("the session belongs to another user")]
    SessionOfAnotherUser,
    /// A process group named for a process reservation is not the reserved process's
    /// (`why`: what the look at it found).
    #[error("process group {pgid}: {why}")]
    ProcessGroupRefused { pgid: u32, why: String },

    // ---- untyped: a message under its code (no reason is sent)
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    Unauthenticated(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// One candidate device's room, in a [`BrokerError::NoCapacity`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRoom {
    pub device: u32,
    pub free: u64,
    pub leasable: u64,
}

impl DeviceRoom {
    fn list(rooms: &[DeviceRoom]) -> String {
        let v: Vec<String> = rooms
            .iter()
            .map(|r| {
                format!(
                    "device {}: {} free of {} leasable",
                    r.device,
                    show(r.free),
                    show(r.leasable)
                )
            })
            .collect();
        v.join(", ")
    }
}

/// Which queue a [`BrokerError::QueueFull`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queue {
    /// Lease requests waiting for memory.
    Lease,
    /// Compute-turn requests.
    Turn,
}

impl Queue {
    fn noun(self) -> &'static str {
        match self {
            Queue::Lease => "requests",
            Queue::Turn => "turn requests",
        }
    }
}

/// Which shared-lease limit a [`BrokerError::SharingLimit`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharingCap {
    /// Leases a tenant publishes.
    PublicationsOfTenant,
    /// Imports a session holds.
    ImportsOfSession,
    /// Imports of one shared lease.
    ImportsOfPublication,
    /// Imports of one tenant, lingering ones too.
    ImportsOfTenant,
}

impl SharingCap {
    fn noun(self) -> &'static str {
        match self {
            SharingCap::PublicationsOfTenant => "shared leases of a tenant",
            SharingCap::ImportsOfSession => "imports of a session",
            SharingCap::ImportsOfPublication => "imports of a shared lease",
            SharingCap::ImportsOfTenant => {
                "imports of a tenant (those lingering for a live process too)"
            }
        }
    }

    /// Its name in the refusal's metadata (`limit`).
    pub fn name(self) -> &'static str {
        match self {
            SharingCap::PublicationsOfTenant => "publications_per_tenant",
            SharingCap::ImportsOfSession => "imports_per_session",
            SharingCap::ImportsOfPublication => "imports_per_publication",
            SharingCap::ImportsOfTenant => "imports_per_tenant",
        }
    }
}

/// What a [`BrokerError::NotFound`] did not find.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Missing {
    Tenant(String),
    /// A tenant that was deleted while a session was being opened for it.
    TenantGone(String),
    Session(Uuid),
    Lease(Uuid),
    Token,
    Turn(String),
    /// A shared lease `name` of `publisher` that does not exist or is not published for
    /// the caller (the two are one answer).
    SharedLease {
        publisher: String,
        name: String,
    },
    /// An import of a shared lease.
    Import(Uuid),
    /// A process reservation (`ReleaseProcessMemory`).
    Reservation(Uuid),
    /// A claim with no reservation and no token (`ReleaseClaim`), by its uid.
    Claim(String),
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Missing::Tenant(t) => write!(f, "tenant {t:?} not found"),
            Missing::TenantGone(t) => write!(f, "tenant {t:?} no longer exists"),
            Missing::Session(id) => write!(f, "session {id} not found"),
            Missing::Lease(id) => write!(f, "lease {id} not found"),
            Missing::Token => f.write_str("token not found"),
            Missing::Turn(id) => write!(f, "turn {id} not found"),
            Missing::SharedLease { publisher, name } => write!(
                f,
                "no shared lease {name:?} of tenant {publisher:?} is published for you"
            ),
            Missing::Import(id) => write!(f, "import {id} not found"),
            Missing::Reservation(id) => write!(f, "process reservation {id} not found"),
            Missing::Claim(uid) => write!(f, "claim {uid:?} has no reservation or token"),
        }
    }
}

/// What kind of failure an error is, decided once per variant: the gRPC status code
/// (`grpc_status.rs`) and the refusal label of the metrics (`metrics.rs`) are read from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// A limit or a resource ran out (quota, capacity, a cap).
    Exhausted,
    /// A wait ran out.
    Expired,
    /// What the request names does not exist.
    NotFound,
    /// The broker (or what it needs) cannot serve now.
    Unavailable,
    /// The request cannot be served in the state things are in.
    Precondition,
    /// The request itself is wrong.
    Invalid,
    /// The caller may not do this.
    Denied,
    /// The caller is not known.
    Unauthenticated,
    /// A fault of the broker's own.
    Internal,
}

impl BrokerError {
    /// What kind of failure this is, said once per variant: the gRPC code
    /// (`grpc_status::code`) and the metrics' refusal label (`metrics::refusal_reason`)
    /// are both read from it.
    pub fn kind(&self) -> ErrorKind {
        use BrokerError::*;
        match self {
            QuotaExceeded { .. }
            | DeviceQuotaExceeded { .. }
            | LeaseCountLimit { .. }
            | TooLarge { .. }
            | NoCapacity { .. }
            | QueueFull { .. }
            | SessionLimit { .. }
            | TurnBusy { .. }
            | HostFallbackFailed { .. }
            | ReservationExceeded { .. }
            | SharingLimit { .. }
            | OutOfDescriptors { .. } => ErrorKind::Exhausted,
            WaitExpired { .. } => ErrorKind::Expired,
            NotFound(_) => ErrorKind::NotFound,
            ShuttingDown
            | BrokerRestarted { .. }
            | NoDeviceOpen { .. }
            | MpsNotRunning { .. }
            | Unavailable(_) => ErrorKind::Unavailable,
            // A device draining, or a caller that cannot receive what it asked for.
            DeviceClosed { .. }
            | TenantInUse { .. }
            | TurnAlreadyHeld { .. }
            | LegacyHandlesRemoved
            | ReservationHeld { .. }
            | SharedNameTaken { .. }
            | AlreadyPublished { .. }
            | HostLeaseNotShareable { .. }
            | SealFailed { .. }
            | NoHostTier
            | NoTicketServer
            | FdNeedsUnixSocket
            | FdHandlesNotAccepted
            | NoAdminTokenFile
            | ClaimNotReserved { .. }
            | ClaimTokenCannotReserve { .. }
            | FailedPrecondition(_) => ErrorKind::Precondition,
            GuaranteesExceedCapacity { .. }
            | UnknownDevice { .. }
            | WaitTooLong { .. }
            | TooManyReaders { .. }
            | TokenNameReserved { .. }
            | InvalidArgument(_) => ErrorKind::Invalid,
            SessionOfAnotherUser | ProcessGroupRefused { .. } | PermissionDenied(_) => {
                ErrorKind::Denied
            }
            Unauthenticated(_) => ErrorKind::Unauthenticated,
            Internal(_) => ErrorKind::Internal,
        }
    }

    /// A tenant that does not exist.
    pub fn tenant_not_found(name: &str) -> Self {
        BrokerError::NotFound(Missing::Tenant(name.to_string()))
    }

    /// A device index past the last of the broker's `count` devices.
    pub fn unknown_device(device: u32, count: usize) -> Self {
        BrokerError::UnknownDevice {
            device,
            count,
            mps: false,
        }
    }

    /// A device index past the last of the `count` devices the MPS daemon serves.
    pub fn unknown_mps_device(device: u32, count: u32) -> Self {
        BrokerError::UnknownDevice {
            device,
            count: count as usize,
            mps: true,
        }
    }

    /// A request that asks to wait longer than the longest wait allowed (`--max-wait`).
    pub fn wait_too_long(wait: std::time::Duration, max: std::time::Duration) -> Self {
        let ms = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        BrokerError::WaitTooLong {
            wait_ms: ms(wait),
            max_ms: ms(max),
        }
    }
}

impl From<DeviceError> for BrokerError {
    fn from(e: DeviceError) -> Self {
        // A device failure is a broker bug or a sick device, never the caller's fault.
        BrokerError::Internal(e.to_string())
    }
}

/// Shorthand for results of broker operations.
pub type BrokerResult<T> = Result<T, BrokerError>;

/// When this broker process started (sessions are UUIDv7: their id carries their time).
static STARTED: std::sync::LazyLock<std::time::SystemTime> =
    std::sync::LazyLock::new(std::time::SystemTime::now);

/// Records the broker's start (the first arbiter calls it): sessions opened before it are
/// another run's.
pub fn mark_started() {
    std::sync::LazyLock::force(&STARTED);
}

/// A session id that is not open: `UNAVAILABLE` when it was opened before this broker
/// started (the broker restarted and its leases are gone: re-open), else `NOT_FOUND`.
pub fn session_not_found(id: Uuid) -> BrokerError {
    use std::time::SystemTime;
    // UUIDv7 timestamps are milliseconds: compare whole milliseconds, so a session opened
    // in the millisecond the broker started counts as this run's.
    let ms = |t: SystemTime| {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0)
    };
    let opened_ms = id.get_timestamp().map(|t| {
        let (secs, nanos) = t.to_unix();
        u128::from(secs) * 1000 + u128::from(nanos / 1_000_000)
    });
    match opened_ms {
        Some(t) if t < ms(*STARTED) => BrokerError::BrokerRestarted { session: id },
        _ => BrokerError::NotFound(Missing::Session(id)),
    }
}

/// A lease id that is not live (or not the caller's).
pub fn lease_not_found(id: Uuid) -> BrokerError {
    BrokerError::NotFound(Missing::Lease(id))
}

/// `message` cut to [`MAX_STATUS_MESSAGE_BYTES`] on a character boundary.
pub fn status_message(message: String) -> String {
    if message.len() <= MAX_STATUS_MESSAGE_BYTES {
        return message;
    }
    let mut cut = MAX_STATUS_MESSAGE_BYTES - 16;
    while !message.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{} ...(truncated)", &message[..cut])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_messages_are_capped_on_a_char_boundary() {
        let m = status_message("é".repeat(5000));
        assert!(m.len() <= MAX_STATUS_MESSAGE_BYTES, "{}", m.len());
        assert!(m.ends_with("(truncated)"));
        assert_eq!(status_message("ok".into()), "ok");
    }

    #[test]
    fn unknown_devices_and_long_waits_are_invalid_arguments_that_say_the_numbers() {
        use std::time::Duration;
        // Their code (INVALID_ARGUMENT) and reasons: `grpc_status.rs`'s tests.
        let msg = |e: BrokerError| {
            assert!(
                matches!(
                    e,
                    BrokerError::UnknownDevice { .. } | BrokerError::WaitTooLong { .. }
                ),
                "{e:?}"
            );
            e.to_string()
        };
        assert_eq!(
            msg(BrokerError::unknown_device(3, 2)),
            "unknown device 3: this broker has 2 device(s)"
        );
        assert_eq!(
            msg(BrokerError::unknown_mps_device(1, 1)),
            "unknown device 1: the MPS daemon serves 1 device(s)"
        );
        assert_eq!(
            msg(BrokerError::wait_too_long(
                Duration::from_millis(1500),
                Duration::from_secs(1)
            )),
            "wait 1500 ms exceeds the maximum 1000 ms"
        );
    }
}
