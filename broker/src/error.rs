//! `BrokerError`: every way a request can fail. Refusals the API promises have a variant
//! that says what happened (quota exceeded, no capacity, a cap reached, something not
//! found, ...) and carries the numbers as fields; the remaining variants are plain
//! messages under the gRPC code they become. The service layer turns an error into a
//! `tonic::Status` ([`From<BrokerError> for tonic::Status`]) and nothing else does: the
//! code, the human message, and for every typed variant a `google.rpc.ErrorInfo` in the
//! status details whose `reason` ([`BrokerError::reason`]) clients match on instead of the
//! message text. The reasons table is in `docs/protocol.md`. Every status message is cut
//! to [`MAX_STATUS_MESSAGE_BYTES`] ([`status_message`]), whatever input it quotes.

use crate::device::DeviceError;
use crate::tier::Tier;
use crate::units::show;
use std::collections::HashMap;
use std::fmt;
use tonic::Code;
use uuid::Uuid;

/// The `ErrorInfo.domain` of every reason the broker sends.
pub const ERROR_DOMAIN: &str = "gpu-broker";

/// Longest `ErrorInfo.metadata` value (a tenant name is at most 64 bytes; the rest are
/// numbers and words): status details travel in a header, like the message.
const MAX_METADATA_VALUE: usize = 256;

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
    #[error("{what}: {max}, the most allowed")]
    SharingLimit { what: &'static str, max: usize },

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

    fn name(self) -> &'static str {
        match self {
            Queue::Lease => "lease",
            Queue::Turn => "turn",
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
        }
    }
}

impl BrokerError {
    /// A tenant that does not exist.
    pub fn tenant_not_found(name: &str) -> Self {
        BrokerError::NotFound(Missing::Tenant(name.to_string()))
    }

    /// The gRPC code this error becomes.
    pub fn code(&self) -> Code {
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
            | SharingLimit { .. } => Code::ResourceExhausted,
            WaitExpired { .. } => Code::DeadlineExceeded,
            NotFound(_) => Code::NotFound,
            ShuttingDown | BrokerRestarted { .. } | NoDeviceOpen { .. } | Unavailable(_) => {
                Code::Unavailable
            }
            DeviceClosed { .. }
            | TenantInUse { .. }
            | TurnAlreadyHeld { .. }
            | LegacyHandlesRemoved
            | FailedPrecondition(_) => Code::FailedPrecondition,
            InvalidArgument(_) => Code::InvalidArgument,
            PermissionDenied(_) => Code::PermissionDenied,
            Unauthenticated(_) => Code::Unauthenticated,
            Internal(_) => Code::Internal,
        }
    }

    /// The machine-readable reason (`ErrorInfo.reason`, upper snake case), `None` for the
    /// untyped variants. Each reason belongs to exactly one gRPC code.
    pub fn reason(&self) -> Option<&'static str> {
        use BrokerError::*;
        Some(match self {
            QuotaExceeded { .. } => "QUOTA_EXCEEDED",
            DeviceQuotaExceeded { .. } => "DEVICE_QUOTA_EXCEEDED",
            LeaseCountLimit { .. } => "LEASE_COUNT_LIMIT",
            TooLarge { .. } => "REQUEST_TOO_LARGE",
            NoCapacity { .. } => "CAPACITY_EXHAUSTED",
            QueueFull { .. } => "QUEUE_FULL",
            SessionLimit { .. } => "SESSION_LIMIT",
            TurnBusy { .. } => "TURN_BUSY",
            HostFallbackFailed { .. } => "HOST_FALLBACK_FAILED",
            SharingLimit { .. } => "SHARING_LIMIT",
            ReservationExceeded { .. } => "RESERVATION_EXCEEDED",
            WaitExpired { .. } => "WAIT_EXPIRED",
            NotFound(m) => match m {
                Missing::Tenant(_) | Missing::TenantGone(_) => "TENANT_NOT_FOUND",
                Missing::Session(_) => "SESSION_NOT_FOUND",
                Missing::Lease(_) => "LEASE_NOT_FOUND",
                Missing::Token => "TOKEN_NOT_FOUND",
                Missing::Turn(_) => "TURN_NOT_FOUND",
                Missing::SharedLease { .. } => "SHARED_LEASE_NOT_FOUND",
                Missing::Import(_) => "IMPORT_NOT_FOUND",
                Missing::Reservation(_) => "RESERVATION_NOT_FOUND",
            },
            ShuttingDown => "SHUTTING_DOWN",
            BrokerRestarted { .. } => "BROKER_RESTARTED",
            NoDeviceOpen { .. } => "NO_DEVICE_OPEN",
            DeviceClosed {
                unhealthy: true, ..
            } => "DEVICE_UNHEALTHY",
            DeviceClosed { .. } => "DEVICE_DRAINING",
            TenantInUse { .. } => "TENANT_IN_USE",
            TurnAlreadyHeld { .. } => "TURN_ALREADY_HELD",
            LegacyHandlesRemoved => "LEGACY_HANDLES_REMOVED",
            InvalidArgument(_)
            | FailedPrecondition(_)
            | Unavailable(_)
            | PermissionDenied(_)
            | Unauthenticated(_)
            | Internal(_) => return None,
        })
    }

    /// The numbers and names behind the reason (`ErrorInfo.metadata`): byte counts in
    /// bytes, as decimal strings. A [`BrokerError::WaitExpired`] adds its cause's reason
    /// as `cause` and the cause's metadata.
    pub fn metadata(&self) -> Vec<(&'static str, String)> {
        use BrokerError::*;
        let s = |v: &dyn ToString| v.to_string();
        match self {
            QuotaExceeded {
                tenant,
                tier,
                requested,
                held,
                limit,
            } => vec![
                ("tenant", tenant.clone()),
                (
                    "tier",
                    match tier {
                        Tier::Device => "device",
                        Tier::Host => "host",
                    }
                    .into(),
                ),
                ("requested_bytes", s(requested)),
                ("held_bytes", s(held)),
                ("limit_bytes", s(limit)),
            ],
            DeviceQuotaExceeded {
                tenant,
                device,
                requested,
                held,
                limit,
            } => vec![
                ("tenant", tenant.clone()),
                ("device", s(device)),
                ("requested_bytes", s(requested)),
                ("held_bytes", s(held)),
                ("limit_bytes", s(limit)),
            ],
            LeaseCountLimit { tenant, count, max } => vec![
                ("tenant", tenant.clone()),
                ("lease_count", s(count)),
                ("max_leases", s(max)),
            ],
            TooLarge {
                requested,
                leasable,
                device,
            } => {
                let mut v = vec![
                    ("requested_bytes", s(requested)),
                    ("leasable_bytes", s(leasable)),
                ];
                if let Some(d) = device {
                    v.push(("device", s(d)));
                }
                v
            }
            NoCapacity {
                tenant,
                requested,
                devices,
                guaranteed,
                held,
                limit,
                waiting,
            } => vec![
                ("tenant", tenant.clone()),
                ("requested_bytes", s(requested)),
                (
                    "free_bytes",
                    s(&devices.iter().map(|d| d.free).max().unwrap_or(0)),
                ),
                (
                    "leasable_bytes",
                    s(&devices.iter().map(|d| d.leasable).max().unwrap_or(0)),
                ),
                ("guaranteed_bytes", s(guaranteed)),
                ("held_bytes", s(held)),
                ("limit_bytes", s(limit)),
                ("waiting_requests", s(waiting)),
            ],
            QueueFull {
                tenant,
                waiting,
                queue,
            } => vec![
                ("tenant", tenant.clone()),
                ("waiting_requests", s(waiting)),
                ("queue", queue.name().into()),
            ],
            SessionLimit { tenant, open } => {
                vec![("tenant", tenant.clone()), ("open_sessions", s(open))]
            }
            TurnBusy {
                device,
                holder,
                waiting,
            } => vec![
                ("device", s(device)),
                ("holder", holder.clone()),
                ("waiting_requests", s(waiting)),
            ],
            HostFallbackFailed { requested, .. } => vec![("requested_bytes", s(requested))],
            SharingLimit { max, .. } => vec![("max", s(max))],
            ReservationExceeded {
                reservation,
                pid,
                requested,
                reserved,
                drawn,
            } => vec![
                ("reservation_id", s(reservation)),
                ("pid", s(pid)),
                ("requested_bytes", s(requested)),
                ("reserved_bytes", s(reserved)),
                ("drawn_bytes", s(drawn)),
            ],
            WaitExpired { waited_ms, cause } => {
                let mut v = vec![("waited_ms", s(waited_ms))];
                if let Some(r) = cause.reason() {
                    v.push(("cause", r.into()));
                }
                v.extend(cause.metadata());
                v
            }
            NotFound(m) => match m {
                Missing::Tenant(t) | Missing::TenantGone(t) => vec![("tenant", t.clone())],
                Missing::Session(id) => vec![("session_id", s(id))],
                Missing::Lease(id) => vec![("lease_id", s(id))],
                Missing::Token => vec![],
                Missing::Turn(id) => vec![("turn_id", id.clone())],
                Missing::SharedLease { publisher, name } => {
                    vec![("publisher", publisher.clone()), ("name", name.clone())]
                }
                Missing::Import(id) => vec![("import_id", s(id))],
                Missing::Reservation(id) => vec![("reservation_id", s(id))],
            },
            BrokerRestarted { session } => vec![("session_id", s(session))],
            DeviceClosed { device, .. } => vec![("device", s(device))],
            TenantInUse {
                tenant,
                leases,
                bytes,
            } => vec![
                ("tenant", tenant.clone()),
                ("lease_count", s(leases)),
                ("held_bytes", s(bytes)),
            ],
            TurnAlreadyHeld { device } => vec![("device", s(device))],
            LegacyHandlesRemoved => vec![("served_kinds", "HANDLE_KIND_FD".into())],
            ShuttingDown
            | NoDeviceOpen { .. }
            | InvalidArgument(_)
            | FailedPrecondition(_)
            | Unavailable(_)
            | PermissionDenied(_)
            | Unauthenticated(_)
            | Internal(_) => vec![],
        }
    }
}

impl From<DeviceError> for BrokerError {
    fn from(e: DeviceError) -> Self {
        // A device failure is a broker bug or a sick device, never the caller's fault.
        BrokerError::Internal(e.to_string())
    }
}

/// A status with `code`, `message` (capped for the header) and, with a reason, an
/// `ErrorInfo` in the details (domain [`ERROR_DOMAIN`]). The one place refusals get
/// their details, also for the refusals built outside [`BrokerError`] (rate limits,
/// connection caps).
pub fn status_with_reason(
    code: Code,
    message: String,
    reason: Option<&str>,
    metadata: Vec<(&str, String)>,
) -> tonic::Status {
    status_with_details(code, message, reason, metadata, None)
}

/// [`status_with_reason`] plus a `google.rpc.RetryInfo` saying when to try again.
pub fn status_with_details(
    code: Code,
    message: String,
    reason: Option<&str>,
    metadata: Vec<(&str, String)>,
    retry_after: Option<std::time::Duration>,
) -> tonic::Status {
    use tonic_types::{ErrorDetails, StatusExt};
    let message = status_message(message);
    let Some(reason) = reason else {
        return tonic::Status::new(code, message);
    };
    let metadata: HashMap<String, String> = metadata
        .into_iter()
        .map(|(k, mut v)| {
            if v.len() > MAX_METADATA_VALUE {
                let mut cut = MAX_METADATA_VALUE;
                while !v.is_char_boundary(cut) {
                    cut -= 1;
                }
                v.truncate(cut);
            }
            (k.to_string(), v)
        })
        .collect();
    let mut details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata);
    if let Some(after) = retry_after {
        details.set_retry_info(Some(after));
    }
    tonic::Status::with_error_details(code, message, details)
}

impl From<BrokerError> for tonic::Status {
    fn from(e: BrokerError) -> Self {
        status_with_reason(e.code(), e.to_string(), e.reason(), e.metadata())
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
    use tonic_types::StatusExt;

    #[test]
    fn typed_errors_carry_their_reason_and_numbers_in_the_status() {
        let e = BrokerError::QuotaExceeded {
            tenant: "alice".into(),
            tier: Tier::Device,
            requested: 4 << 20,
            held: 6 << 20,
            limit: 8 << 20,
        };
        let s = tonic::Status::from(e.clone());
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(s.message(), e.to_string());
        assert!(s.message().contains("4194304"), "{}", s.message());
        let info = s.get_details_error_info().expect("an ErrorInfo");
        assert_eq!(info.reason, "QUOTA_EXCEEDED");
        assert_eq!(info.domain, ERROR_DOMAIN);
        assert_eq!(info.metadata["tenant"], "alice");
        assert_eq!(info.metadata["requested_bytes"], "4194304");
        assert_eq!(info.metadata["held_bytes"], "6291456");
        assert_eq!(info.metadata["limit_bytes"], "8388608");
        assert_eq!(info.metadata["tier"], "device");
    }

    #[test]
    fn a_lost_wait_names_its_cause() {
        let e = BrokerError::WaitExpired {
            waited_ms: 300,
            cause: Box::new(BrokerError::NoCapacity {
                tenant: "a".into(),
                requested: 8 << 20,
                devices: vec![DeviceRoom {
                    device: 0,
                    free: 0,
                    leasable: 64 << 20,
                }],
                guaranteed: 0,
                held: 64 << 20,
                limit: 1 << 30,
                waiting: 0,
            }),
        };
        let s = tonic::Status::from(e);
        assert_eq!(s.code(), Code::DeadlineExceeded);
        assert!(s
            .message()
            .starts_with("waited 300 ms: cannot grant 8.0 MiB"));
        let info = s.get_details_error_info().unwrap();
        assert_eq!(info.reason, "WAIT_EXPIRED");
        assert_eq!(info.metadata["cause"], "CAPACITY_EXHAUSTED");
        assert_eq!(info.metadata["waited_ms"], "300");
        assert_eq!(info.metadata["free_bytes"], "0");
        assert_eq!(info.metadata["leasable_bytes"], "67108864");
    }

    #[test]
    fn every_reason_belongs_to_one_code() {
        let id = Uuid::nil();
        let all = [
            BrokerError::LeaseCountLimit {
                tenant: "a".into(),
                count: 1,
                max: 1,
            },
            BrokerError::TooLarge {
                requested: 2,
                leasable: 1,
                device: Some(0),
            },
            BrokerError::QueueFull {
                tenant: "a".into(),
                waiting: 3,
                queue: Queue::Turn,
            },
            BrokerError::SessionLimit {
                tenant: "a".into(),
                open: 2,
            },
            BrokerError::NotFound(Missing::Lease(id)),
            BrokerError::NotFound(Missing::Session(id)),
            BrokerError::NotFound(Missing::Import(id)),
            BrokerError::NotFound(Missing::SharedLease {
                publisher: "a".into(),
                name: "w".into(),
            }),
            BrokerError::SharingLimit {
                what: "imports of a session",
                max: 1,
            },
            BrokerError::NotFound(Missing::Reservation(id)),
            BrokerError::ReservationExceeded {
                reservation: id,
                pid: 1,
                requested: 4,
                reserved: 8,
                drawn: 6,
            },
            BrokerError::ShuttingDown,
            BrokerError::BrokerRestarted { session: id },
            BrokerError::DeviceClosed {
                device: 1,
                unhealthy: true,
                why: "unhealthy (Xid 79)".into(),
            },
            BrokerError::TenantInUse {
                tenant: "a".into(),
                leases: 1,
                bytes: 2,
            },
            BrokerError::LegacyHandlesRemoved,
        ];
        let mut seen = std::collections::HashMap::new();
        for e in all {
            let r = e.reason().unwrap();
            assert!(
                r.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'),
                "{r}"
            );
            assert_eq!(*seen.entry(r).or_insert(e.code()), e.code(), "{r}");
            let s = tonic::Status::from(e.clone());
            assert_eq!(s.get_details_error_info().unwrap().reason, r);
        }
        let plain = tonic::Status::from(BrokerError::InvalidArgument("bytes".into()));
        assert_eq!(plain.code(), Code::InvalidArgument);
        assert!(plain.get_details_error_info().is_none());
    }

    #[test]
    fn metadata_values_are_capped() {
        let s = status_with_reason(
            Code::ResourceExhausted,
            "x".into(),
            Some("R"),
            vec![("k", "é".repeat(1000))],
        );
        let info = s.get_details_error_info().unwrap();
        assert!(info.metadata["k"].len() <= MAX_METADATA_VALUE);
    }

    #[test]
    fn status_messages_are_capped_on_a_char_boundary() {
        let m = status_message("é".repeat(5000));
        assert!(m.len() <= MAX_STATUS_MESSAGE_BYTES, "{}", m.len());
        assert!(m.ends_with("(truncated)"));
        assert_eq!(status_message("ok".into()), "ok");
    }
}
