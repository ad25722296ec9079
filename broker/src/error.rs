//! `BrokerError`: every way a request can fail, one variant per gRPC status the API
//! promises. The service layer turns it into a `tonic::Status` and nothing else does.

use crate::device::DeviceError;

/// A request failure, named by the gRPC status it becomes.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum BrokerError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    DeadlineExceeded(String),
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

impl From<DeviceError> for BrokerError {
    fn from(e: DeviceError) -> Self {
        // A device failure is a broker bug or a sick device, never the caller's fault.
        BrokerError::Internal(e.to_string())
    }
}

impl From<BrokerError> for tonic::Status {
    fn from(e: BrokerError) -> Self {
        use tonic::Status;
        // No message may grow past what a client's header limit takes.
        let cap = crate::bounds::status_message;
        match e {
            BrokerError::InvalidArgument(m) => Status::invalid_argument(cap(m)),
            BrokerError::NotFound(m) => Status::not_found(cap(m)),
            BrokerError::ResourceExhausted(m) => Status::resource_exhausted(cap(m)),
            BrokerError::DeadlineExceeded(m) => Status::deadline_exceeded(cap(m)),
            BrokerError::FailedPrecondition(m) => Status::failed_precondition(cap(m)),
            BrokerError::Unavailable(m) => Status::unavailable(cap(m)),
            BrokerError::PermissionDenied(m) => Status::permission_denied(cap(m)),
            BrokerError::Unauthenticated(m) => Status::unauthenticated(cap(m)),
            BrokerError::Internal(m) => Status::internal(cap(m)),
        }
    }
}

/// Shorthand for results of broker operations.
pub type BrokerResult<T> = Result<T, BrokerError>;
