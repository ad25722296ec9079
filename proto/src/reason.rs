//! The broker's refusal reasons, defined once: the `reason` of the `google.rpc.ErrorInfo`
//! (domain [`ERROR_DOMAIN`]) in a refused call's status details, each with the one gRPC
//! code it comes with. The broker sends a [`Reason`], the Rust client parses one
//! ([`Reason::parse`]); `docs/protocol.md`'s table and the Python package's `REASONS` are
//! checked against [`Reason::KNOWN`] by the tests (`tests/e2e/errors.rs`).

use std::fmt;
use tonic::Code;

/// The `ErrorInfo.domain` of every reason the broker sends.
pub const ERROR_DOMAIN: &str = "gpu-broker";

macro_rules! reasons {
    ($($(#[$doc:meta])* $variant:ident = $name:literal in $code:ident,)*) => {
        /// The broker's machine-readable reason for a refusal (`ErrorInfo.reason` in the
        /// [`ERROR_DOMAIN`] domain), matched on instead of the message. A reason this
        /// build does not know (a newer broker's, or another domain's) is
        /// [`Reason::Unknown`] with the reason as sent.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Reason {
            $($(#[$doc])* $variant,)*
            /// A reason this build does not know, as sent.
            Unknown(String),
        }

        impl Reason {
            /// Every reason the broker sends, in the order of `docs/protocol.md`'s table.
            pub const KNOWN: &'static [Reason] = &[$(Reason::$variant,)*];

            /// The reason as it travels (`"QUOTA_EXCEEDED"`).
            pub fn as_str(&self) -> &str {
                match self {
                    $(Reason::$variant => $name,)*
                    Reason::Unknown(s) => s,
                }
            }

            /// The gRPC code a status with this reason has (each reason belongs to one);
            /// `None` for [`Reason::Unknown`].
            pub fn code(&self) -> Option<Code> {
                match self {
                    $(Reason::$variant => Some(Code::$code),)*
                    Reason::Unknown(_) => None,
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
    /// The tenant's byte limit (`tier` says device or host).
    QuotaExceeded = "QUOTA_EXCEEDED" in ResourceExhausted,
    /// The tenant's cap on a device does not fit the request on any
    /// device it may use (`device` names it).
    DeviceQuotaExceeded = "DEVICE_QUOTA_EXCEEDED" in ResourceExhausted,
    /// The tenant holds `max_leases` leases.
    LeaseCountLimit = "LEASE_COUNT_LIMIT" in ResourceExhausted,
    /// Larger than any device could ever lease.
    RequestTooLarge = "REQUEST_TOO_LARGE" in ResourceExhausted,
    /// Fits the quota, not what is free now.
    CapacityExhausted = "CAPACITY_EXHAUSTED" in ResourceExhausted,
    /// The tenant has the most waiting requests allowed.
    QueueFull = "QUEUE_FULL" in ResourceExhausted,
    /// The tenant has the most open sessions allowed.
    SessionLimit = "SESSION_LIMIT" in ResourceExhausted,
    /// Another session holds the compute turn.
    TurnBusy = "TURN_BUSY" in ResourceExhausted,
    /// Host memory asked for as a fallback could not be made.
    HostFallbackFailed = "HOST_FALLBACK_FAILED" in ResourceExhausted,
    /// A shared-lease limit (publications, imports) is reached.
    SharingLimit = "SHARING_LIMIT" in ResourceExhausted,
    /// The broker keeps no descriptor for another block (the rest of
    /// its descriptor limit is kept for connections); its operator raises the limit.
    OutOfDescriptors = "OUT_OF_DESCRIPTORS" in ResourceExhausted,
    /// A lease of a reserved process does not fit in what is left
    /// of its process reservation.
    ReservationExceeded = "RESERVATION_EXCEEDED" in ResourceExhausted,
    /// Over the tenant's call rate; the status has a retry hint.
    RateLimited = "RATE_LIMITED" in ResourceExhausted,
    /// Too many calls open to the unauthenticated services.
    StreamLimit = "STREAM_LIMIT" in ResourceExhausted,
    /// Waited and lost; `cause` names the reason it would have had.
    WaitExpired = "WAIT_EXPIRED" in DeadlineExceeded,
    /// No such tenant.
    TenantNotFound = "TENANT_NOT_FOUND" in NotFound,
    /// No such session (or another tenant's).
    SessionNotFound = "SESSION_NOT_FOUND" in NotFound,
    /// No such lease (or another tenant's).
    LeaseNotFound = "LEASE_NOT_FOUND" in NotFound,
    /// No such token.
    TokenNotFound = "TOKEN_NOT_FOUND" in NotFound,
    /// No such compute turn.
    TurnNotFound = "TURN_NOT_FOUND" in NotFound,
    /// No such shared lease published for the caller's tenant.
    SharedLeaseNotFound = "SHARED_LEASE_NOT_FOUND" in NotFound,
    /// No such import.
    ImportNotFound = "IMPORT_NOT_FOUND" in NotFound,
    /// No such process reservation (or another tenant's).
    ReservationNotFound = "RESERVATION_NOT_FOUND" in NotFound,
    /// The broker is shutting down.
    ShuttingDown = "SHUTTING_DOWN" in Unavailable,
    /// The session belongs to an earlier run of the broker.
    BrokerRestarted = "BROKER_RESTARTED" in Unavailable,
    /// No device of the node takes new leases.
    NoDeviceOpen = "NO_DEVICE_OPEN" in Unavailable,
    /// The pinned device is draining.
    DeviceDraining = "DEVICE_DRAINING" in FailedPrecondition,
    /// The pinned device is unhealthy.
    DeviceUnhealthy = "DEVICE_UNHEALTHY" in FailedPrecondition,
    /// The tenant still holds leases.
    TenantInUse = "TENANT_IN_USE" in FailedPrecondition,
    /// The session already holds the compute turn.
    TurnAlreadyHeld = "TURN_ALREADY_HELD" in FailedPrecondition,
    /// The request accepts only legacy CUDA IPC handles, which the
    /// broker no longer serves (`docs/security.md`).
    LegacyHandlesRemoved = "LEGACY_HANDLES_REMOVED" in FailedPrecondition,
    /// The session already holds a process reservation.
    ReservationHeld = "RESERVATION_HELD" in FailedPrecondition,
    /// The tenant already publishes a lease under that name.
    SharedNameTaken = "SHARED_NAME_TAKEN" in FailedPrecondition,
    /// The lease is already published.
    AlreadyPublished = "ALREADY_PUBLISHED" in FailedPrecondition,
    /// The tenants' guarantees would exceed the leasable capacity.
    GuaranteesExceedCapacity = "GUARANTEES_EXCEED_CAPACITY" in InvalidArgument,
    /// An MPS reservation while the broker's MPS daemon is not running.
    MpsNotRunning = "MPS_NOT_RUNNING" in Unavailable,
    /// A host-fallback lease cannot be published.
    HostLeaseNotShareable = "HOST_LEASE_NOT_SHAREABLE" in FailedPrecondition,
    /// The lease's memory could not be sealed for its importers.
    SealFailed = "SEAL_FAILED" in FailedPrecondition,
    /// The broker has no host tier.
    NoHostTier = "NO_HOST_TIER" in FailedPrecondition,
    /// Fd handles need the ticket server, which the broker does not
    /// run.
    NoTicketServer = "NO_TICKET_SERVER" in FailedPrecondition,
    /// Fd handles reach only callers on the broker's Unix socket.
    FdNeedsUnixSocket = "FD_NEEDS_UNIX_SOCKET" in FailedPrecondition,
    /// The request does not accept fd handles, the only kind served.
    FdHandlesNotAccepted = "FD_HANDLES_NOT_ACCEPTED" in FailedPrecondition,
    /// The broker has no admin token file to rotate.
    NoAdminTokenFile = "NO_ADMIN_TOKEN_FILE" in FailedPrecondition,
    /// A claim's token leases while the broker holds no reservation
    /// for the claim (its DRA driver reserves it again).
    ClaimNotReserved = "CLAIM_NOT_RESERVED" in FailedPrecondition,
    /// A claim's token asks for a process reservation: it leases
    /// from its claim's reservation only.
    ClaimTokenCannotReserve = "CLAIM_TOKEN_CANNOT_RESERVE" in FailedPrecondition,
    /// No such device index.
    UnknownDevice = "UNKNOWN_DEVICE" in InvalidArgument,
    /// The wait asked for is longer than the broker's `--max-wait`.
    WaitTooLong = "WAIT_TOO_LONG" in InvalidArgument,
    /// A publish names more reader tenants than allowed.
    TooManyReaders = "TOO_MANY_READERS" in InvalidArgument,
    /// A token name starting with `claim/`: those are minted by
    /// `ReserveClaim` alone.
    TokenNameReserved = "TOKEN_NAME_RESERVED" in InvalidArgument,
    /// No `authorization` header.
    TokenMissing = "TOKEN_MISSING" in Unauthenticated,
    /// The header is not `Bearer <token>`.
    TokenMalformed = "TOKEN_MALFORMED" in Unauthenticated,
    /// No such token (never issued, or revoked).
    TokenUnknown = "TOKEN_UNKNOWN" in Unauthenticated,
    /// The token is past its expiry: issue a new one.
    TokenExpired = "TOKEN_EXPIRED" in Unauthenticated,
    /// A Kubernetes ServiceAccount token the API server's TokenReview
    /// did not accept (invalid, expired, another audience).
    ServiceAccountRefused = "SERVICE_ACCOUNT_REFUSED" in Unauthenticated,
    /// A ServiceAccount token of a namespace no tenant lists.
    NamespaceHasNoTenant = "NAMESPACE_HAS_NO_TENANT" in Unauthenticated,
    /// The API server could not be asked about a ServiceAccount token.
    TokenReviewUnavailable = "TOKEN_REVIEW_UNAVAILABLE" in Unavailable,
    /// The token's scope does not reach this call.
    ScopeDenied = "SCOPE_DENIED" in PermissionDenied,
    /// The session belongs to another user.
    SessionOfAnotherUser = "SESSION_OF_ANOTHER_USER" in PermissionDenied,
    /// The process group is not the reserved process's.
    ProcessGroupRefused = "PROCESS_GROUP_REFUSED" in PermissionDenied,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_parses_back_and_is_upper_snake_case() {
        for r in Reason::KNOWN {
            assert_eq!(&Reason::parse(ERROR_DOMAIN, r.as_str()), r);
            assert!(r.code().is_some(), "{r}");
            assert!(
                r.as_str()
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b == b'_'),
                "{r}"
            );
        }
        let names: std::collections::BTreeSet<_> =
            Reason::KNOWN.iter().map(Reason::as_str).collect();
        assert_eq!(names.len(), Reason::KNOWN.len(), "a reason named twice");
        // Another domain's reason, or one this build does not know, is kept as sent.
        assert_eq!(
            Reason::parse("other", "QUOTA_EXCEEDED"),
            Reason::Unknown("QUOTA_EXCEEDED".into())
        );
        assert_eq!(Reason::parse(ERROR_DOMAIN, "NEW").code(), None);
        assert_eq!(Reason::QuotaExceeded.code(), Some(Code::ResourceExhausted));
    }
}
