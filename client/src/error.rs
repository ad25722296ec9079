//! The one error type of the client crate. Broker refusals arrive as gRPC statuses and
//! are sorted into one variant per status code the broker uses on purpose
//! (`RESOURCE_EXHAUSTED` for quota or capacity, `NOT_FOUND` for unknown or foreign
//! leases, ...), so callers can match on them; anything else keeps its code in
//! [`ClientError::Status`]. Each status variant holds a [`Refusal`]: the broker's message
//! and, where the broker sent one (a `google.rpc.ErrorInfo` in the status details), its
//! machine-readable [`Reason`] and the numbers behind it, so callers match on
//! [`ClientError::reason`] instead of the message text (the table of reasons is in
//! `docs/protocol.md`). Local failures (connecting, I/O, mapping, a broker that breaks
//! the protocol) have variants of their own. [`ClientError::code`] gives every error a
//! gRPC code, and the `Display` form starts with the code's canonical name
//! (`RESOURCE_EXHAUSTED: tenant "a" would hold 9.0 GiB of 8.0 GiB`).

use std::collections::BTreeMap;
use std::error::Error as StdError;
use std::fmt;

pub use tonic::Code;

/// Everything that can go wrong in a client call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// `INVALID_ARGUMENT`: zero or absurd sizes, unknown device, malformed ids.
    #[error("INVALID_ARGUMENT: {0}")]
    InvalidArgument(Refusal),
    /// `UNAUTHENTICATED`: missing, unknown or revoked token.
    #[error("UNAUTHENTICATED: {0}")]
    Unauthenticated(Refusal),
    /// `PERMISSION_DENIED`: e.g. a tenant token calling the admin service.
    #[error("PERMISSION_DENIED: {0}")]
    PermissionDenied(Refusal),
    /// `NOT_FOUND`: unknown tenant, token, session or lease (also another tenant's lease).
    #[error("NOT_FOUND: {0}")]
    NotFound(Refusal),
    /// `RESOURCE_EXHAUSTED`: quota or capacity; the message carries the numbers.
    #[error("RESOURCE_EXHAUSTED: {0}")]
    ResourceExhausted(Refusal),
    /// `DEADLINE_EXCEEDED`: waited in the queue and lost.
    #[error("DEADLINE_EXCEEDED: {0}")]
    DeadlineExceeded(Refusal),
    /// `UNAVAILABLE`: the broker is draining or shutting down, or the connection broke.
    #[error("UNAVAILABLE: {0}")]
    Unavailable(Refusal),
    /// `FAILED_PRECONDITION`: e.g. deleting a tenant that still holds leases.
    #[error("FAILED_PRECONDITION: {0}")]
    FailedPrecondition(Refusal),
    /// `ALREADY_EXISTS`.
    #[error("ALREADY_EXISTS: {0}")]
    AlreadyExists(Refusal),
    /// Any other gRPC status.
    #[error("{}: {message}", code_name(*code))]
    Status {
        /// The status code as received.
        code: Code,
        /// The status message as received.
        message: String,
    },
    /// Could not reach the broker (bad URI, no socket, connection refused, ...).
    #[error("transport error: {0}")]
    Transport(String),
    /// A local I/O error (opening or mapping a shared-memory file, reading a token file).
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The lease's handle cannot be mapped this way (e.g. [`crate::Lease::map`] on CUDA
    /// VMM memory, which needs `Lease::map_cuda` and the `cuda` feature instead).
    #[error("lease handle cannot be mapped this way")]
    NotMappable,
    /// A CUDA driver error while importing or using a CUDA lease (`cuda` feature).
    #[error("CUDA error: {0}")]
    Cuda(String),
    /// The lease belonged to a broker session that was lost (the broker restarted or the
    /// connection broke, and a reconnecting session re-opened a new one): its memory is
    /// gone, and nothing was sent to the broker. Code `NOT_FOUND`.
    #[error("NOT_FOUND: lease {lease_id} was lost with session {session_id} (the broker session ended; the session reconnected or is reconnecting)")]
    LeaseLost {
        /// The lost lease.
        lease_id: String,
        /// The broker session it was acquired on.
        session_id: String,
    },
    /// The ticket server closed the connection without a descriptor: the ticket was wrong,
    /// used, expired, or presented by another process than the one it was issued to.
    /// Ask for a new one (`Lease::fetch_fd`). Code `PERMISSION_DENIED`.
    #[error("PERMISSION_DENIED: lease ticket refused: {0}")]
    TicketRefused(String),
    /// The ticket server said the ticket's lease ended (reclaimed, revoked, released or its
    /// session ended) before its memory was fetched: the lease and its memory are gone, and a
    /// new ticket would not help; ask for a new lease. Code `NOT_FOUND`, as for any lease
    /// the broker no longer has.
    #[error("NOT_FOUND: {0}")]
    LeaseEnded(String),
    /// The broker answered something the protocol does not allow (e.g. a session stream
    /// whose first event is not `opened`, or a reply missing a required field).
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl ClientError {
    /// The gRPC code of this error. Local errors map to the closest code:
    /// `Transport` -> `UNAVAILABLE`, `Io`/`Cuda`/`Protocol` -> `INTERNAL`,
    /// `NotMappable` -> `FAILED_PRECONDITION`, `LeaseLost` and `LeaseEnded` -> `NOT_FOUND`.
    pub fn code(&self) -> Code {
        match self {
            ClientError::InvalidArgument(_) => Code::InvalidArgument,
            ClientError::Unauthenticated(_) => Code::Unauthenticated,
            ClientError::PermissionDenied(_) | ClientError::TicketRefused(_) => {
                Code::PermissionDenied
            }
            ClientError::NotFound(_)
            | ClientError::LeaseLost { .. }
            | ClientError::LeaseEnded(_) => Code::NotFound,
            ClientError::ResourceExhausted(_) => Code::ResourceExhausted,
            ClientError::DeadlineExceeded(_) => Code::DeadlineExceeded,
            ClientError::Unavailable(_) | ClientError::Transport(_) => Code::Unavailable,
            ClientError::FailedPrecondition(_) | ClientError::NotMappable => {
                Code::FailedPrecondition
            }
            ClientError::AlreadyExists(_) => Code::AlreadyExists,
            ClientError::Status { code, .. } => *code,
            ClientError::Io(_) | ClientError::Cuda(_) | ClientError::Protocol(_) => Code::Internal,
        }
    }

    /// The canonical name of [`ClientError::code`], e.g. `"RESOURCE_EXHAUSTED"`.
    pub fn code_name(&self) -> &'static str {
        code_name(self.code())
    }

    /// The broker's status message, or this error's text for local errors.
    pub fn message(&self) -> String {
        match self {
            ClientError::InvalidArgument(Refusal { message: m, .. })
            | ClientError::Unauthenticated(Refusal { message: m, .. })
            | ClientError::PermissionDenied(Refusal { message: m, .. })
            | ClientError::NotFound(Refusal { message: m, .. })
            | ClientError::ResourceExhausted(Refusal { message: m, .. })
            | ClientError::DeadlineExceeded(Refusal { message: m, .. })
            | ClientError::Unavailable(Refusal { message: m, .. })
            | ClientError::FailedPrecondition(Refusal { message: m, .. })
            | ClientError::AlreadyExists(Refusal { message: m, .. })
            | ClientError::Status { message: m, .. } => m.clone(),
            other => other.to_string(),
        }
    }

    /// What the broker said, for errors that came as a status with one of the typed
    /// codes (`None` for [`ClientError::Status`] and local errors).
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            ClientError::InvalidArgument(r)
            | ClientError::Unauthenticated(r)
            | ClientError::PermissionDenied(r)
            | ClientError::NotFound(r)
            | ClientError::ResourceExhausted(r)
            | ClientError::DeadlineExceeded(r)
            | ClientError::Unavailable(r)
            | ClientError::FailedPrecondition(r)
            | ClientError::AlreadyExists(r) => Some(r),
            _ => None,
        }
    }

    /// The broker's machine-readable reason, where it sent one.
    pub fn reason(&self) -> Option<&Reason> {
        self.refusal().and_then(|r| r.reason.as_ref())
    }

    /// One value behind the reason (`ErrorInfo.metadata`, e.g. `"limit_bytes"`).
    pub fn detail(&self, key: &str) -> Option<&str> {
        self.refusal()
            .and_then(|r| r.metadata.get(key))
            .map(String::as_str)
    }

    /// True for errors that came from the broker as a gRPC status (not local ones).
    pub fn is_status(&self) -> bool {
        !matches!(
            self,
            ClientError::Transport(_)
                | ClientError::Io(_)
                | ClientError::NotMappable
                | ClientError::Cuda(_)
                | ClientError::Protocol(_)
                | ClientError::TicketRefused(_)
                | ClientError::LeaseEnded(_)
                | ClientError::LeaseLost { .. }
        )
    }
}

impl From<tonic::Status> for ClientError {
    fn from(status: tonic::Status) -> Self {
        let message = if status.code() == Code::Unavailable {
            unavailable_message(&status)
        } else {
            status.message().to_string()
        };
        let r = Refusal::from_status(&status, message);
        match status.code() {
            Code::InvalidArgument => ClientError::InvalidArgument(r),
            Code::Unauthenticated => ClientError::Unauthenticated(r),
            Code::PermissionDenied => ClientError::PermissionDenied(r),
            Code::NotFound => ClientError::NotFound(r),
            Code::ResourceExhausted => ClientError::ResourceExhausted(r),
            Code::DeadlineExceeded => ClientError::DeadlineExceeded(r),
            Code::Unavailable => ClientError::Unavailable(r),
            Code::FailedPrecondition => ClientError::FailedPrecondition(r),
            Code::AlreadyExists => ClientError::AlreadyExists(r),
            code => ClientError::Status {
                code,
                message: r.message,
            },
        }
    }
}

impl From<tonic::transport::Error> for ClientError {
    fn from(err: tonic::transport::Error) -> Self {
        ClientError::Transport(error_chain(&err))
    }
}

/// The `ErrorInfo.domain` of the broker's reasons.
pub const ERROR_DOMAIN: &str = "gpu-broker";

/// A refusal as the broker sent it: its message, and where it sent a
/// `google.rpc.ErrorInfo`, the reason and the values behind it (byte counts in bytes, as
/// decimal strings). Reads as its message (`Deref<Target = str>`, `Display`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Refusal {
    /// The status message.
    pub message: String,
    /// The machine-readable reason, if the broker sent one.
    pub reason: Option<Reason>,
    /// `ErrorInfo.metadata`: e.g. `requested_bytes`, `limit_bytes`, `tenant`.
    pub metadata: BTreeMap<String, String>,
}

impl Refusal {
    fn from_status(status: &tonic::Status, message: String) -> Self {
        use tonic_types::StatusExt;
        match status.get_details_error_info() {
            Some(info) => Refusal {
                message,
                reason: Some(Reason::parse(&info.domain, &info.reason)),
                metadata: info.metadata.into_iter().collect(),
            },
            None => Refusal {
                message,
                ..Refusal::default()
            },
        }
    }
}

impl From<String> for Refusal {
    fn from(message: String) -> Self {
        Refusal {
            message,
            ..Refusal::default()
        }
    }
}

impl From<&str> for Refusal {
    fn from(message: &str) -> Self {
        message.to_string().into()
    }
}

impl std::ops::Deref for Refusal {
    type Target = str;
    fn deref(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl PartialEq<str> for Refusal {
    fn eq(&self, other: &str) -> bool {
        self.message == other
    }
}

impl PartialEq<&str> for Refusal {
    fn eq(&self, other: &&str) -> bool {
        self.message == *other
    }
}

macro_rules! reasons {
    ($($(#[$doc:meta])* $variant:ident = $name:literal,)*) => {
        /// The broker's machine-readable reason for a refusal (`ErrorInfo.reason` in the
        /// `gpu-broker` domain). A reason this client does not know (a newer broker, or
        /// another domain) is [`Reason::Unknown`] with the reason as sent.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Reason {
            $($(#[$doc])* $variant,)*
            /// A reason this client does not know, as sent.
            Unknown(String),
        }

        impl Reason {
            /// Every reason this client knows.
            pub const KNOWN: &'static [Reason] = &[$(Reason::$variant,)*];

            /// The reason as the broker spells it (`"QUOTA_EXCEEDED"`).
            pub fn as_str(&self) -> &str {
                match self {
                    $(Reason::$variant => $name,)*
                    Reason::Unknown(s) => s,
                }
            }

            /// The reason a broker sent in `domain`.
            pub fn parse(domain: &str, reason: &str) -> Reason {
                match (domain == ERROR_DOMAIN, reason) {
                    $((true, $name) => Reason::$variant,)*
                    _ => Reason::Unknown(reason.to_string()),
                }
            }
        }
    };
}

reasons! {
    /// `RESOURCE_EXHAUSTED`: the tenant's byte limit (`tier` says device or host).
    QuotaExceeded = "QUOTA_EXCEEDED",
    /// `RESOURCE_EXHAUSTED`: the tenant's cap on a device does not fit the request on any
    /// device it may use (`device` names it).
    DeviceQuotaExceeded = "DEVICE_QUOTA_EXCEEDED",
    /// `RESOURCE_EXHAUSTED`: the tenant holds `max_leases` leases.
    LeaseCountLimit = "LEASE_COUNT_LIMIT",
    /// `RESOURCE_EXHAUSTED`: larger than any device could ever lease.
    RequestTooLarge = "REQUEST_TOO_LARGE",
    /// `RESOURCE_EXHAUSTED`: fits the quota, not what is free now.
    CapacityExhausted = "CAPACITY_EXHAUSTED",
    /// `RESOURCE_EXHAUSTED`: the tenant has the most waiting requests allowed.
    QueueFull = "QUEUE_FULL",
    /// `RESOURCE_EXHAUSTED`: the tenant has the most open sessions allowed.
    SessionLimit = "SESSION_LIMIT",
    /// `RESOURCE_EXHAUSTED`: another session holds the compute turn.
    TurnBusy = "TURN_BUSY",
    /// `RESOURCE_EXHAUSTED`: host memory asked for as a fallback could not be made.
    HostFallbackFailed = "HOST_FALLBACK_FAILED",
    /// `RESOURCE_EXHAUSTED`: a shared-lease limit (publications, imports) is reached.
    SharingLimit = "SHARING_LIMIT",
    /// `RESOURCE_EXHAUSTED`: the broker keeps no descriptor for another block (the rest of
    /// its descriptor limit is kept for connections); its operator raises the limit.
    OutOfDescriptors = "OUT_OF_DESCRIPTORS",
    /// `RESOURCE_EXHAUSTED`: a lease of a reserved process does not fit in what is left
    /// of its process reservation.
    ReservationExceeded = "RESERVATION_EXCEEDED",
    /// `RESOURCE_EXHAUSTED`: over the tenant's call rate; the status has a retry hint.
    RateLimited = "RATE_LIMITED",
    /// `RESOURCE_EXHAUSTED`: too many calls open to the unauthenticated services.
    StreamLimit = "STREAM_LIMIT",
    /// `DEADLINE_EXCEEDED`: waited and lost; `cause` names the reason it would have had.
    WaitExpired = "WAIT_EXPIRED",
    /// `NOT_FOUND`: no such tenant.
    TenantNotFound = "TENANT_NOT_FOUND",
    /// `NOT_FOUND`: no such session (or another tenant's).
    SessionNotFound = "SESSION_NOT_FOUND",
    /// `NOT_FOUND`: no such lease (or another tenant's).
    LeaseNotFound = "LEASE_NOT_FOUND",
    /// `NOT_FOUND`: no such token.
    TokenNotFound = "TOKEN_NOT_FOUND",
    /// `NOT_FOUND`: no such compute turn.
    TurnNotFound = "TURN_NOT_FOUND",
    /// `NOT_FOUND`: no such shared lease published for the caller's tenant.
    SharedLeaseNotFound = "SHARED_LEASE_NOT_FOUND",
    /// `NOT_FOUND`: no such import.
    ImportNotFound = "IMPORT_NOT_FOUND",
    /// `NOT_FOUND`: no such process reservation (or another tenant's).
    ReservationNotFound = "RESERVATION_NOT_FOUND",
    /// `UNAVAILABLE`: the broker is shutting down.
    ShuttingDown = "SHUTTING_DOWN",
    /// `UNAVAILABLE`: the session belongs to an earlier run of the broker.
    BrokerRestarted = "BROKER_RESTARTED",
    /// `UNAVAILABLE`: no device of the node takes new leases.
    NoDeviceOpen = "NO_DEVICE_OPEN",
    /// `FAILED_PRECONDITION`: the pinned device is draining.
    DeviceDraining = "DEVICE_DRAINING",
    /// `FAILED_PRECONDITION`: the pinned device is unhealthy.
    DeviceUnhealthy = "DEVICE_UNHEALTHY",
    /// `FAILED_PRECONDITION`: the tenant still holds leases.
    TenantInUse = "TENANT_IN_USE",
    /// `FAILED_PRECONDITION`: the session already holds the compute turn.
    TurnAlreadyHeld = "TURN_ALREADY_HELD",
    /// `FAILED_PRECONDITION`: the request accepts only legacy CUDA IPC handles, which the
    /// broker no longer serves (`docs/security.md`).
    LegacyHandlesRemoved = "LEGACY_HANDLES_REMOVED",
    /// `FAILED_PRECONDITION`: the session already holds a process reservation.
    ReservationHeld = "RESERVATION_HELD",
    /// `FAILED_PRECONDITION`: the tenant already publishes a lease under that name.
    SharedNameTaken = "SHARED_NAME_TAKEN",
    /// `FAILED_PRECONDITION`: the lease is already published.
    AlreadyPublished = "ALREADY_PUBLISHED",
    /// `INVALID_ARGUMENT`: the tenants' guarantees would exceed the leasable capacity.
    GuaranteesExceedCapacity = "GUARANTEES_EXCEED_CAPACITY",
    /// `UNAVAILABLE`: an MPS reservation while the broker's MPS daemon is not running.
    MpsNotRunning = "MPS_NOT_RUNNING",
    /// `FAILED_PRECONDITION`: a host-fallback lease cannot be published.
    HostLeaseNotShareable = "HOST_LEASE_NOT_SHAREABLE",
    /// `FAILED_PRECONDITION`: the lease's memory could not be sealed for its importers.
    SealFailed = "SEAL_FAILED",
    /// `FAILED_PRECONDITION`: the broker has no host tier.
    NoHostTier = "NO_HOST_TIER",
    /// `FAILED_PRECONDITION`: fd handles need the ticket server, which the broker does not
    /// run.
    NoTicketServer = "NO_TICKET_SERVER",
    /// `FAILED_PRECONDITION`: fd handles reach only callers on the broker's Unix socket.
    FdNeedsUnixSocket = "FD_NEEDS_UNIX_SOCKET",
    /// `FAILED_PRECONDITION`: the request does not accept fd handles, the only kind served.
    FdHandlesNotAccepted = "FD_HANDLES_NOT_ACCEPTED",
    /// `FAILED_PRECONDITION`: the broker has no admin token file to rotate.
    NoAdminTokenFile = "NO_ADMIN_TOKEN_FILE",
    /// `INVALID_ARGUMENT`: no such device index.
    UnknownDevice = "UNKNOWN_DEVICE",
    /// `INVALID_ARGUMENT`: the wait asked for is longer than the broker's `--max-wait`.
    WaitTooLong = "WAIT_TOO_LONG",
    /// `INVALID_ARGUMENT`: a publish names more reader tenants than allowed.
    TooManyReaders = "TOO_MANY_READERS",
    /// `UNAUTHENTICATED`: no `authorization` header.
    TokenMissing = "TOKEN_MISSING",
    /// `UNAUTHENTICATED`: the header is not `Bearer <token>`.
    TokenMalformed = "TOKEN_MALFORMED",
    /// `UNAUTHENTICATED`: no such token (never issued, or revoked).
    TokenUnknown = "TOKEN_UNKNOWN",
    /// `UNAUTHENTICATED`: the token is past its expiry: issue a new one.
    TokenExpired = "TOKEN_EXPIRED",
    /// `PERMISSION_DENIED`: the token's scope does not reach this call.
    ScopeDenied = "SCOPE_DENIED",
    /// `PERMISSION_DENIED`: the session belongs to another user.
    SessionOfAnotherUser = "SESSION_OF_ANOTHER_USER",
    /// `PERMISSION_DENIED`: the process group is not the reserved process's.
    ProcessGroupRefused = "PROCESS_GROUP_REFUSED",
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An `UNAVAILABLE` raised by the channel itself (broken connection) carries the cause
/// only in its source chain; keep it in the message.
fn unavailable_message(status: &tonic::Status) -> String {
    match status.source() {
        Some(source)
            if status.message().is_empty() || status.message() == "error trying to connect" =>
        {
            let chain = error_chain(source);
            if status.message().is_empty() {
                chain
            } else {
                format!("{}: {chain}", status.message())
            }
        }
        _ => status.message().to_string(),
    }
}

/// `err` and its sources joined with `": "`, skipping repeats (hyper and tonic often
/// wrap an error in one with the same text).
pub(crate) fn error_chain(err: &(dyn StdError + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = next {
        let text = e.to_string();
        if !text.is_empty() && parts.last() != Some(&text) {
            parts.push(text);
        }
        next = e.source();
    }
    parts.join(": ")
}

/// The canonical upper-case name of a gRPC code (`"NOT_FOUND"`).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_variants_and_back() {
        let cases = [
            (Code::InvalidArgument, "INVALID_ARGUMENT"),
            (Code::Unauthenticated, "UNAUTHENTICATED"),
            (Code::PermissionDenied, "PERMISSION_DENIED"),
            (Code::NotFound, "NOT_FOUND"),
            (Code::ResourceExhausted, "RESOURCE_EXHAUSTED"),
            (Code::DeadlineExceeded, "DEADLINE_EXCEEDED"),
            (Code::Unavailable, "UNAVAILABLE"),
            (Code::FailedPrecondition, "FAILED_PRECONDITION"),
            (Code::AlreadyExists, "ALREADY_EXISTS"),
            (Code::Internal, "INTERNAL"),
            (Code::Aborted, "ABORTED"),
            (Code::Unimplemented, "UNIMPLEMENTED"),
        ];
        for (code, name) in cases {
            let err = ClientError::from(tonic::Status::new(code, "quota 8.0 GiB"));
            assert_eq!(err.code(), code);
            assert_eq!(err.code_name(), name);
            assert_eq!(err.message(), "quota 8.0 GiB");
            assert_eq!(err.to_string(), format!("{name}: quota 8.0 GiB"));
            assert!(err.is_status());
        }
    }

    #[test]
    fn specific_variants() {
        let err = ClientError::from(tonic::Status::resource_exhausted("over quota"));
        assert!(matches!(err, ClientError::ResourceExhausted(ref m) if m == "over quota"));
        assert_eq!(err.reason(), None, "a status without details has no reason");
        let err = ClientError::from(tonic::Status::not_found("no lease"));
        assert!(matches!(err, ClientError::NotFound(_)));
        let err = ClientError::from(tonic::Status::new(Code::DataLoss, "x"));
        assert!(matches!(
            err,
            ClientError::Status {
                code: Code::DataLoss,
                ..
            }
        ));
    }

    #[test]
    fn reasons_come_from_error_info_in_the_details() {
        use tonic_types::{ErrorDetails, StatusExt};
        let status = tonic::Status::with_error_details(
            Code::ResourceExhausted,
            "quota exceeded for tenant \"a\"",
            ErrorDetails::with_error_info(
                "QUOTA_EXCEEDED",
                ERROR_DOMAIN,
                [("limit_bytes".to_string(), "8388608".to_string())],
            ),
        );
        let err = ClientError::from(status);
        assert!(matches!(err, ClientError::ResourceExhausted(_)));
        assert_eq!(err.reason(), Some(&Reason::QuotaExceeded));
        assert_eq!(err.detail("limit_bytes"), Some("8388608"));
        assert_eq!(err.message(), "quota exceeded for tenant \"a\"");
        // An unknown reason, or one of another domain, is kept as sent.
        for (domain, reason) in [
            (ERROR_DOMAIN, "SOMETHING_NEW"),
            ("other.example", "QUOTA_EXCEEDED"),
        ] {
            let status = tonic::Status::with_error_details(
                Code::ResourceExhausted,
                "x",
                ErrorDetails::with_error_info(
                    reason,
                    domain,
                    Vec::<(String, String)>::new()
                        .into_iter()
                        .collect::<std::collections::HashMap<_, _>>(),
                ),
            );
            assert_eq!(
                ClientError::from(status).reason(),
                Some(&Reason::Unknown(reason.into()))
            );
        }
        for r in Reason::KNOWN {
            assert_eq!(&Reason::parse(ERROR_DOMAIN, r.as_str()), r);
        }
    }

    #[test]
    fn local_errors_have_codes() {
        assert_eq!(ClientError::NotMappable.code(), Code::FailedPrecondition);
        assert_eq!(ClientError::Transport("x".into()).code(), Code::Unavailable);
        assert_eq!(ClientError::Protocol("x".into()).code(), Code::Internal);
        assert!(!ClientError::Protocol("x".into()).is_status());
        let io = ClientError::from(std::io::Error::other("boom"));
        assert_eq!(io.code(), Code::Internal);
        assert_eq!(io.to_string(), "I/O error: boom");
        let lost = ClientError::LeaseLost {
            lease_id: "l-1".into(),
            session_id: "s-1".into(),
        };
        assert_eq!(lost.code(), Code::NotFound);
        assert!(!lost.is_status());
        assert!(lost
            .to_string()
            .starts_with("NOT_FOUND: lease l-1 was lost with session s-1"));
    }
}
