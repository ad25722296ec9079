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

/// The broker's reasons and their domain, defined once in the proto crate.
pub use gpu_broker_proto::reason::{Reason, ERROR_DOMAIN};

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
