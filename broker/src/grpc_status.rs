//! How a refusal becomes a gRPC status: the one place the broker's errors meet the
//! transport. A [`BrokerError`] becomes a `tonic::Status` ([`From<BrokerError> for
//! Status`]) with its gRPC code ([`code`]), its message (cut by
//! [`crate::error::status_message`]) and, for every typed variant, a `google.rpc.ErrorInfo`
//! in the status details whose `reason` ([`reason`]) clients match on instead of the
//! message text, with the numbers behind it ([`metadata`]). The refusals built outside
//! [`BrokerError`] (rate limits, connection caps, token refusals) get their details here
//! too ([`status_with_reason`], [`status_with_details`]). The reasons themselves, with
//! their codes, are the proto crate's [`Reason`]; the table is in `docs/protocol.md`.

use crate::error::{status_message, BrokerError, ErrorKind, Missing, Queue};
use crate::tier::Tier;
use std::collections::HashMap;
use tonic::{Code, Status};

pub use gpu_broker_proto::reason::{Reason, ERROR_DOMAIN};

/// Longest `ErrorInfo.metadata` value (a tenant name is at most 64 bytes; the rest are
/// numbers and words): status details travel in a header, like the message.
const MAX_METADATA_VALUE: usize = 256;

/// The gRPC code this error becomes.
pub fn code(e: &BrokerError) -> Code {
    match e.kind() {
        ErrorKind::Exhausted => Code::ResourceExhausted,
        ErrorKind::Expired => Code::DeadlineExceeded,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::Precondition => Code::FailedPrecondition,
        ErrorKind::Invalid => Code::InvalidArgument,
        ErrorKind::Denied => Code::PermissionDenied,
        ErrorKind::Unauthenticated => Code::Unauthenticated,
        ErrorKind::Internal => Code::Internal,
    }
}

/// The machine-readable reason (`ErrorInfo.reason`), `None` for the untyped variants.
/// Each reason belongs to exactly one gRPC code ([`Reason::code`]).
pub fn reason(e: &BrokerError) -> Option<Reason> {
    use BrokerError::*;
    Some(match e {
        QuotaExceeded { .. } => Reason::QuotaExceeded,
        DeviceQuotaExceeded { .. } => Reason::DeviceQuotaExceeded,
        LeaseCountLimit { .. } => Reason::LeaseCountLimit,
        TooLarge { .. } => Reason::RequestTooLarge,
        NoCapacity { .. } => Reason::CapacityExhausted,
        QueueFull { .. } => Reason::QueueFull,
        SessionLimit { .. } => Reason::SessionLimit,
        TurnBusy { .. } => Reason::TurnBusy,
        HostFallbackFailed { .. } => Reason::HostFallbackFailed,
        SharingLimit { .. } => Reason::SharingLimit,
        OutOfDescriptors { .. } => Reason::OutOfDescriptors,
        ReservationExceeded { .. } => Reason::ReservationExceeded,
        WaitExpired { .. } => Reason::WaitExpired,
        NotFound(m) => match m {
            Missing::Tenant(_) | Missing::TenantGone(_) => Reason::TenantNotFound,
            Missing::Session(_) => Reason::SessionNotFound,
            Missing::Lease(_) => Reason::LeaseNotFound,
            Missing::Token => Reason::TokenNotFound,
            Missing::Turn(_) => Reason::TurnNotFound,
            Missing::SharedLease { .. } => Reason::SharedLeaseNotFound,
            Missing::Import(_) => Reason::ImportNotFound,
            Missing::Reservation(_) | Missing::Claim(_) => Reason::ReservationNotFound,
        },
        ShuttingDown => Reason::ShuttingDown,
        BrokerRestarted { .. } => Reason::BrokerRestarted,
        NoDeviceOpen { .. } => Reason::NoDeviceOpen,
        DeviceClosed {
            unhealthy: true, ..
        } => Reason::DeviceUnhealthy,
        DeviceClosed { .. } => Reason::DeviceDraining,
        TenantInUse { .. } => Reason::TenantInUse,
        TurnAlreadyHeld { .. } => Reason::TurnAlreadyHeld,
        LegacyHandlesRemoved => Reason::LegacyHandlesRemoved,
        ReservationHeld { .. } => Reason::ReservationHeld,
        SharedNameTaken { .. } => Reason::SharedNameTaken,
        AlreadyPublished { .. } => Reason::AlreadyPublished,
        GuaranteesExceedCapacity { .. } => Reason::GuaranteesExceedCapacity,
        MpsNotRunning { .. } => Reason::MpsNotRunning,
        HostLeaseNotShareable { .. } => Reason::HostLeaseNotShareable,
        SealFailed { .. } => Reason::SealFailed,
        NoHostTier => Reason::NoHostTier,
        NoTicketServer => Reason::NoTicketServer,
        FdNeedsUnixSocket => Reason::FdNeedsUnixSocket,
        FdHandlesNotAccepted => Reason::FdHandlesNotAccepted,
        NoAdminTokenFile => Reason::NoAdminTokenFile,
        ClaimNotReserved { .. } => Reason::ClaimNotReserved,
        ClaimTokenCannotReserve { .. } => Reason::ClaimTokenCannotReserve,
        TokenNameReserved { .. } => Reason::TokenNameReserved,
        UnknownDevice { .. } => Reason::UnknownDevice,
        WaitTooLong { .. } => Reason::WaitTooLong,
        TooManyReaders { .. } => Reason::TooManyReaders,
        SessionOfAnotherUser => Reason::SessionOfAnotherUser,
        ProcessGroupRefused { .. } => Reason::ProcessGroupRefused,
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
pub fn metadata(e: &BrokerError) -> Vec<(&'static str, String)> {
    use BrokerError::*;
    let s = |v: &dyn ToString| v.to_string();
    match e {
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
            ("queue", queue_name(*queue).into()),
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
        SharingLimit { what, max } => vec![("limit", what.name().into()), ("max", s(max))],
        OutOfDescriptors {
            held,
            limit,
            reserve,
        } => vec![
            ("held", s(held)),
            ("limit", s(limit)),
            ("reserve", s(reserve)),
        ],
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
            if let Some(r) = reason(cause) {
                v.push(("cause", r.to_string()));
            }
            v.extend(metadata(cause));
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
            Missing::Claim(uid) => vec![("claim", uid.clone())],
        },
        BrokerRestarted { session } => vec![("session_id", s(session))],
        ReservationHeld {
            session,
            reservation,
        } => vec![
            ("session_id", s(session)),
            ("reservation_id", s(reservation)),
        ],
        SharedNameTaken { tenant, name } => {
            vec![("tenant", tenant.clone()), ("name", name.clone())]
        }
        AlreadyPublished { lease, name } => {
            vec![("lease_id", s(lease)), ("name", name.clone())]
        }
        GuaranteesExceedCapacity {
            guarantees,
            leasable,
        } => vec![
            ("guaranteed_bytes", s(guarantees)),
            ("leasable_bytes", s(leasable)),
        ],
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
        LegacyHandlesRemoved | FdHandlesNotAccepted => {
            vec![("served_kinds", "HANDLE_KIND_FD".into())]
        }
        MpsNotRunning { state, .. } => vec![("mps_state", state.to_string())],
        HostLeaseNotShareable { lease } => vec![("lease_id", s(lease))],
        SealFailed { lease, .. } => vec![("lease_id", s(lease))],
        UnknownDevice { device, count, mps } => vec![
            ("device", s(device)),
            ("device_count", s(count)),
            ("devices_of", if *mps { "mps" } else { "broker" }.into()),
        ],
        WaitTooLong { wait_ms, max_ms } => {
            vec![("wait_ms", s(wait_ms)), ("max_wait_ms", s(max_ms))]
        }
        TooManyReaders { readers, max } => {
            vec![("readers", s(readers)), ("max_readers", s(max))]
        }
        ProcessGroupRefused { pgid, .. } => vec![("pgid", s(pgid))],
        ClaimNotReserved { claim } | ClaimTokenCannotReserve { claim } => {
            vec![("claim", claim.clone())]
        }
        TokenNameReserved { prefix } => vec![("prefix", (*prefix).into())],
        ShuttingDown
        | SessionOfAnotherUser
        | NoHostTier
        | NoTicketServer
        | FdNeedsUnixSocket
        | NoAdminTokenFile
        | NoDeviceOpen { .. }
        | InvalidArgument(_)
        | FailedPrecondition(_)
        | Unavailable(_)
        | PermissionDenied(_)
        | Unauthenticated(_)
        | Internal(_) => vec![],
    }
}

/// The `queue` metadata of a [`BrokerError::QueueFull`].
fn queue_name(queue: Queue) -> &'static str {
    match queue {
        Queue::Lease => "lease",
        Queue::Turn => "turn",
    }
}

/// A status with `code`, `message` (capped for the header) and, with a reason, an
/// `ErrorInfo` in the details (domain [`ERROR_DOMAIN`]). The one place refusals get
/// their details, also for the refusals built outside [`BrokerError`] (rate limits,
/// connection caps).
pub fn status_with_reason(
    code: Code,
    message: String,
    reason: Option<Reason>,
    metadata: Vec<(&str, String)>,
) -> Status {
    status_with_details(code, message, reason, metadata, None)
}

/// [`status_with_reason`] plus a `google.rpc.RetryInfo` saying when to try again.
pub fn status_with_details(
    code: Code,
    message: String,
    reason: Option<Reason>,
    metadata: Vec<(&str, String)>,
    retry_after: Option<std::time::Duration>,
) -> Status {
    use tonic_types::{ErrorDetails, StatusExt};
    let message = status_message(message);
    let Some(reason) = reason else {
        return Status::new(code, message);
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
    let mut details = ErrorDetails::with_error_info(reason.as_str(), ERROR_DOMAIN, metadata);
    if let Some(after) = retry_after {
        details.set_retry_info(Some(after));
    }
    Status::with_error_details(code, message, details)
}

/// The status a refusal answers with: its code, message, reason and numbers. (A function,
/// not `From`: the error is the core crate's, the status tonic's.)
pub fn status(e: BrokerError) -> Status {
    status_with_reason(code(&e), e.to_string(), reason(&e), metadata(&e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{DeviceRoom, SharingCap};
    use tonic_types::StatusExt;
    use uuid::Uuid;

    #[test]
    fn typed_errors_carry_their_reason_and_numbers_in_the_status() {
        let e = BrokerError::QuotaExceeded {
            tenant: "alice".into(),
            tier: Tier::Device,
            requested: 4 << 20,
            held: 6 << 20,
            limit: 8 << 20,
        };
        let s = status(e.clone());
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
        let s = status(e);
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
                what: SharingCap::ImportsOfSession,
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
            BrokerError::ReservationHeld {
                session: id,
                reservation: id,
            },
            BrokerError::SharedNameTaken {
                tenant: "a".into(),
                name: "w".into(),
            },
            BrokerError::AlreadyPublished {
                lease: id,
                name: "w".into(),
            },
            BrokerError::GuaranteesExceedCapacity {
                guarantees: 2,
                leasable: 1,
            },
        ];
        let mut seen = std::collections::HashMap::new();
        for e in all {
            let r = reason(&e).unwrap();
            assert_eq!(*seen.entry(r.clone()).or_insert(code(&e)), code(&e), "{r}");
            let s = status(e.clone());
            assert_eq!(s.get_details_error_info().unwrap().reason, r.as_str());
        }
        let plain = status(BrokerError::InvalidArgument("bytes".into()));
        assert_eq!(plain.code(), Code::InvalidArgument);
        assert!(plain.get_details_error_info().is_none());
    }

    /// The refusals a client can act on that were plain messages once: each has its
    /// reason, its code as before, and what it is about in the metadata.
    #[test]
    fn refusals_a_client_can_act_on_carry_their_reason_and_what_they_are_about() {
        let id = Uuid::now_v7();
        let lease = id.to_string();
        // The error, its code, its reason and its metadata.
        type Case<'a> = (BrokerError, Code, &'a str, Vec<(&'a str, &'a str)>);
        let cases: Vec<Case> = vec![
            (
                BrokerError::MpsNotRunning {
                    state: "down",
                    summary: "down (control binary missing)".into(),
                },
                Code::Unavailable,
                "MPS_NOT_RUNNING",
                vec![("mps_state", "down")],
            ),
            (
                BrokerError::HostLeaseNotShareable { lease: id },
                Code::FailedPrecondition,
                "HOST_LEASE_NOT_SHAREABLE",
                vec![("lease_id", lease.as_str())],
            ),
            (
                BrokerError::SealFailed {
                    lease: id,
                    cause: "sealing the memfd: Operation not permitted".into(),
                },
                Code::FailedPrecondition,
                "SEAL_FAILED",
                vec![("lease_id", lease.as_str())],
            ),
            (
                BrokerError::NoHostTier,
                Code::FailedPrecondition,
                "NO_HOST_TIER",
                vec![],
            ),
            (
                BrokerError::NoTicketServer,
                Code::FailedPrecondition,
                "NO_TICKET_SERVER",
                vec![],
            ),
            (
                BrokerError::FdNeedsUnixSocket,
                Code::FailedPrecondition,
                "FD_NEEDS_UNIX_SOCKET",
                vec![],
            ),
            (
                BrokerError::FdHandlesNotAccepted,
                Code::FailedPrecondition,
                "FD_HANDLES_NOT_ACCEPTED",
                vec![("served_kinds", "HANDLE_KIND_FD")],
            ),
            (
                BrokerError::NoAdminTokenFile,
                Code::FailedPrecondition,
                "NO_ADMIN_TOKEN_FILE",
                vec![],
            ),
            (
                BrokerError::unknown_device(3, 2),
                Code::InvalidArgument,
                "UNKNOWN_DEVICE",
                vec![
                    ("device", "3"),
                    ("device_count", "2"),
                    ("devices_of", "broker"),
                ],
            ),
            (
                BrokerError::unknown_mps_device(1, 1),
                Code::InvalidArgument,
                "UNKNOWN_DEVICE",
                vec![
                    ("device", "1"),
                    ("device_count", "1"),
                    ("devices_of", "mps"),
                ],
            ),
            (
                BrokerError::wait_too_long(
                    std::time::Duration::from_millis(1500),
                    std::time::Duration::from_secs(1),
                ),
                Code::InvalidArgument,
                "WAIT_TOO_LONG",
                vec![("wait_ms", "1500"), ("max_wait_ms", "1000")],
            ),
            (
                BrokerError::SessionOfAnotherUser,
                Code::PermissionDenied,
                "SESSION_OF_ANOTHER_USER",
                vec![],
            ),
            (
                BrokerError::ProcessGroupRefused {
                    pgid: 4242,
                    why: "its leader is not the reserved process".into(),
                },
                Code::PermissionDenied,
                "PROCESS_GROUP_REFUSED",
                vec![("pgid", "4242")],
            ),
            (
                BrokerError::SharingLimit {
                    what: SharingCap::PublicationsOfTenant,
                    max: 1024,
                },
                Code::ResourceExhausted,
                "SHARING_LIMIT",
                vec![("limit", "publications_per_tenant"), ("max", "1024")],
            ),
            (
                BrokerError::SharingLimit {
                    what: SharingCap::ImportsOfSession,
                    max: 8,
                },
                Code::ResourceExhausted,
                "SHARING_LIMIT",
                vec![("limit", "imports_per_session"), ("max", "8")],
            ),
            (
                BrokerError::SharingLimit {
                    what: SharingCap::ImportsOfPublication,
                    max: 9,
                },
                Code::ResourceExhausted,
                "SHARING_LIMIT",
                vec![("limit", "imports_per_publication"), ("max", "9")],
            ),
            (
                BrokerError::SharingLimit {
                    what: SharingCap::ImportsOfTenant,
                    max: 4096,
                },
                Code::ResourceExhausted,
                "SHARING_LIMIT",
                vec![("limit", "imports_per_tenant"), ("max", "4096")],
            ),
            (
                BrokerError::TooManyReaders {
                    readers: 257,
                    max: 256,
                },
                Code::InvalidArgument,
                "TOO_MANY_READERS",
                vec![("readers", "257"), ("max_readers", "256")],
            ),
        ];
        for (e, want_code, want_reason, want_meta) in cases {
            let s = status(e.clone());
            assert_eq!(s.code(), want_code, "{e:?}");
            assert_eq!(s.message(), e.to_string());
            let info = s.get_details_error_info().expect("an ErrorInfo");
            assert_eq!(info.reason, want_reason, "{e:?}");
            let want: HashMap<String, String> = want_meta
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            assert_eq!(info.metadata, want, "{e:?}");
        }
    }

    #[test]
    fn metadata_values_are_capped() {
        let s = status_with_reason(
            Code::ResourceExhausted,
            "x".into(),
            Some(Reason::QuotaExceeded),
            vec![("k", "é".repeat(1000))],
        );
        let info = s.get_details_error_info().unwrap();
        assert!(info.metadata["k"].len() <= MAX_METADATA_VALUE);
    }

    /// One error of every variant (and both kinds of a closed device).
    fn one_of_each() -> Vec<BrokerError> {
        use BrokerError::*;
        let t = || "a".to_string();
        let id = Uuid::nil();
        vec![
            QuotaExceeded {
                tenant: t(),
                tier: Tier::Host,
                requested: 2,
                held: 0,
                limit: 1,
            },
            DeviceQuotaExceeded {
                tenant: t(),
                device: 1,
                requested: 2,
                held: 0,
                limit: 1,
            },
            LeaseCountLimit {
                tenant: t(),
                count: 1,
                max: 1,
            },
            TooLarge {
                requested: 2,
                leasable: 1,
                device: None,
            },
            NoCapacity {
                tenant: t(),
                requested: 2,
                devices: vec![],
                guaranteed: 0,
                held: 0,
                limit: 1,
                waiting: 0,
            },
            QueueFull {
                tenant: t(),
                waiting: 1,
                queue: Queue::Lease,
            },
            SessionLimit {
                tenant: t(),
                open: 1,
            },
            TurnBusy {
                device: 0,
                holder: t(),
                waiting: 0,
            },
            ReservationExceeded {
                reservation: id,
                pid: 1,
                requested: 2,
                reserved: 1,
                drawn: 0,
            },
            HostFallbackFailed {
                requested: 1,
                cause: "no".into(),
            },
            OutOfDescriptors {
                held: 3,
                limit: 2,
                reserve: 1,
            },
            SharingLimit {
                what: SharingCap::ImportsOfSession,
                max: 1,
            },
            WaitExpired {
                waited_ms: 1,
                cause: Box::new(ShuttingDown),
            },
            NotFound(Missing::Token),
            ShuttingDown,
            BrokerRestarted { session: id },
            NoDeviceOpen {
                why: "drained".into(),
            },
            DeviceClosed {
                device: 0,
                unhealthy: false,
                why: "draining".into(),
            },
            DeviceClosed {
                device: 0,
                unhealthy: true,
                why: "unhealthy".into(),
            },
            TenantInUse {
                tenant: t(),
                leases: 1,
                bytes: 1,
            },
            TurnAlreadyHeld { device: 0 },
            LegacyHandlesRemoved,
            ReservationHeld {
                session: id,
                reservation: id,
            },
            SharedNameTaken {
                tenant: t(),
                name: "w".into(),
            },
            AlreadyPublished {
                lease: id,
                name: "w".into(),
            },
            GuaranteesExceedCapacity {
                guarantees: 2,
                leasable: 1,
            },
            MpsNotRunning {
                state: "down",
                summary: "down (restarting in 1 s)".into(),
            },
            HostLeaseNotShareable { lease: id },
            SealFailed {
                lease: id,
                cause: "no".into(),
            },
            NoHostTier,
            NoTicketServer,
            FdNeedsUnixSocket,
            FdHandlesNotAccepted,
            NoAdminTokenFile,
            UnknownDevice {
                device: 2,
                count: 1,
                mps: false,
            },
            WaitTooLong {
                wait_ms: 2,
                max_ms: 1,
            },
            TooManyReaders { readers: 2, max: 1 },
            ClaimNotReserved { claim: "u".into() },
            ClaimTokenCannotReserve { claim: "u".into() },
            TokenNameReserved { prefix: "claim/" },
            SessionOfAnotherUser,
            ProcessGroupRefused {
                pgid: 7,
                why: "not yours".into(),
            },
            InvalidArgument("x".into()),
            FailedPrecondition("x".into()),
            Unavailable("x".into()),
            PermissionDenied("x".into()),
            Unauthenticated("x".into()),
            Internal("x".into()),
        ]
    }

    /// The variant of `e`, by number: a new variant does not compile here until it gets a
    /// number, and [`one_of_each`] must then hold one of it.
    fn variant(e: &BrokerError) -> usize {
        use BrokerError::*;
        match e {
            QuotaExceeded { .. } => 0,
            DeviceQuotaExceeded { .. } => 1,
            LeaseCountLimit { .. } => 2,
            TooLarge { .. } => 3,
            NoCapacity { .. } => 4,
            QueueFull { .. } => 5,
            SessionLimit { .. } => 6,
            TurnBusy { .. } => 7,
            ReservationExceeded { .. } => 8,
            HostFallbackFailed { .. } => 9,
            SharingLimit { .. } => 10,
            WaitExpired { .. } => 11,
            NotFound(_) => 12,
            ShuttingDown => 13,
            BrokerRestarted { .. } => 14,
            NoDeviceOpen { .. } => 15,
            DeviceClosed { .. } => 16,
            TenantInUse { .. } => 17,
            TurnAlreadyHeld { .. } => 18,
            LegacyHandlesRemoved => 19,
            InvalidArgument(_) => 20,
            FailedPrecondition(_) => 21,
            Unavailable(_) => 22,
            PermissionDenied(_) => 23,
            Unauthenticated(_) => 24,
            Internal(_) => 25,
            ReservationHeld { .. } => 26,
            SharedNameTaken { .. } => 27,
            AlreadyPublished { .. } => 28,
            GuaranteesExceedCapacity { .. } => 29,
            MpsNotRunning { .. } => 30,
            HostLeaseNotShareable { .. } => 31,
            SealFailed { .. } => 32,
            NoHostTier => 33,
            NoTicketServer => 34,
            FdNeedsUnixSocket => 35,
            FdHandlesNotAccepted => 36,
            NoAdminTokenFile => 37,
            UnknownDevice { .. } => 38,
            WaitTooLong { .. } => 39,
            TooManyReaders { .. } => 40,
            SessionOfAnotherUser => 41,
            ProcessGroupRefused { .. } => 42,
            OutOfDescriptors { .. } => 43,
            ClaimNotReserved { .. } => 44,
            ClaimTokenCannotReserve { .. } => 45,
            TokenNameReserved { .. } => 46,
        }
    }

    #[test]
    fn one_of_each_holds_every_variant() {
        let seen: std::collections::BTreeSet<usize> = one_of_each().iter().map(variant).collect();
        assert_eq!(seen, (0..=46).collect());
    }

    #[test]
    fn the_refusal_metrics_follow_the_codes() {
        // The metrics classify errors by their own variants; apart from the caps with a
        // label of their own, the label is the code's.
        use crate::metrics::refusal_reason;
        let own = [
            "quota",
            "max_leases",
            "max_waiting",
            "too_large",
            "wait_expired",
        ];
        let mut seen = std::collections::BTreeSet::new();
        for e in one_of_each() {
            let label = refusal_reason(&e);
            seen.insert(label);
            if own.contains(&label) {
                continue;
            }
            let by_code = match code(&e) {
                Code::ResourceExhausted => "capacity",
                Code::InvalidArgument => "invalid",
                Code::NotFound => "not_found",
                Code::Unavailable => "unavailable",
                Code::FailedPrecondition => "precondition",
                _ => "other",
            };
            assert_eq!(label, by_code, "{e:?}");
        }
        let all: std::collections::BTreeSet<&str> =
            crate::metrics::REFUSAL_REASONS.into_iter().collect();
        assert_eq!(seen, all, "every label is reached by some error");
    }

    #[test]
    fn every_error_becomes_its_code_message_and_reason() {
        for e in one_of_each() {
            let s = status(e.clone());
            assert_eq!(s.code(), code(&e), "{e:?}");
            assert_eq!(s.message(), e.to_string(), "{e:?}");
            let info = s.get_details_error_info();
            assert_eq!(
                info.map(|i| i.reason),
                reason(&e).map(|r| r.to_string()),
                "{e:?}"
            );
            // The reason is one of the list's, with the code the list gives it.
            if let Some(r) = reason(&e) {
                assert!(Reason::KNOWN.contains(&r), "{r}");
                assert_eq!(r.code(), Some(code(&e)), "{e:?}");
            }
        }
    }
}
