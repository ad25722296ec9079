//! What the core is asked for: a request for memory ([`AcquireRequest`]), and the same
//! request once its values were checked ([`ValidRequest`]), which is what the transitions
//! take: a request is checked once, where it enters, and never again after.

use crate::error::{BrokerError, BrokerResult};
use crate::units::show;
use std::time::Duration;
use uuid::Uuid;

/// Largest single request accepted at all (1 PiB): anything above is malformed.
pub const MAX_REQUEST_BYTES: u64 = 1 << 50;

/// A request for memory, as the service layer read it.
#[derive(Clone, Debug)]
pub struct AcquireRequest {
    pub tenant: String,
    pub session: Uuid,
    pub bytes: u64,
    pub device: Option<u32>,
    pub wait: Duration,
    pub label: String,
    pub reclaimable: bool,
    pub fallback_host: bool,
}

/// What a request's values are checked against: the broker's devices and settings.
#[derive(Clone, Copy, Debug)]
pub struct RequestBounds {
    /// How many devices the broker serves (a named device must be one of them).
    pub devices: usize,
    /// Longest wait a request may ask for.
    pub max_wait: Duration,
    /// Longest label, in bytes.
    pub max_label: usize,
}

/// An [`AcquireRequest`] whose values were checked ([`AcquireRequest::validate`], the only
/// way to make one): its size is neither zero nor absurd, its device exists, its wait and
/// label are within bounds. It reads as the request (`Deref`) and cannot be changed.
#[derive(Clone, Debug)]
pub struct ValidRequest(AcquireRequest);

impl std::ops::Deref for ValidRequest {
    type Target = AcquireRequest;
    fn deref(&self) -> &AcquireRequest {
        &self.0
    }
}

impl AcquireRequest {
    /// Checks the request's values (sizes, device, wait, label) without looking at state.
    pub fn validate(self, bounds: &RequestBounds) -> BrokerResult<ValidRequest> {
        if self.bytes == 0 {
            return Err(BrokerError::InvalidArgument("bytes must be > 0".into()));
        }
        if self.bytes > MAX_REQUEST_BYTES {
            return Err(BrokerError::InvalidArgument(format!(
                "bytes {} is absurd (more than {})",
                self.bytes,
                show(MAX_REQUEST_BYTES)
            )));
        }
        if let Some(d) = self.device {
            if d as usize >= bounds.devices {
                return Err(BrokerError::unknown_device(d, bounds.devices));
            }
        }
        if self.wait > bounds.max_wait {
            return Err(BrokerError::wait_too_long(self.wait, bounds.max_wait));
        }
        if self.label.len() > bounds.max_label {
            return Err(BrokerError::InvalidArgument(format!(
                "label longer than {} bytes",
                bounds.max_label
            )));
        }
        Ok(ValidRequest(self))
    }
}

#[cfg(test)]
impl AcquireRequest {
    /// The request checked against bounds that refuse only its size (the core's tests,
    /// which make their own devices).
    pub(crate) fn checked(self) -> ValidRequest {
        let any = RequestBounds {
            devices: usize::MAX,
            max_wait: Duration::MAX,
            max_label: usize::MAX,
        };
        self.validate(&any).expect("a valid request")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: RequestBounds = RequestBounds {
        devices: 2,
        max_wait: Duration::from_secs(60),
        max_label: 8,
    };

    fn request(bytes: u64) -> AcquireRequest {
        AcquireRequest {
            tenant: "a".into(),
            session: Uuid::nil(),
            bytes,
            device: Some(1),
            wait: Duration::from_secs(60),
            label: "12345678".into(),
            reclaimable: false,
            fallback_host: false,
        }
    }

    #[test]
    fn a_request_within_every_bound_is_valid_and_reads_as_itself() {
        let v = request(MAX_REQUEST_BYTES).validate(&BOUNDS).unwrap();
        assert_eq!(
            (v.bytes, v.device, v.label.as_str()),
            (1 << 50, Some(1), "12345678")
        );
    }

    #[test]
    fn each_bound_refuses_with_its_reason() {
        let refused = |r: AcquireRequest| r.validate(&BOUNDS).unwrap_err().to_string();
        assert!(refused(request(0)).contains("bytes must be > 0"));
        assert!(refused(request(MAX_REQUEST_BYTES + 1)).contains("absurd"));
        let mut r = request(1);
        r.device = Some(2);
        assert!(matches!(
            r.validate(&BOUNDS),
            Err(BrokerError::UnknownDevice {
                device: 2,
                count: 2,
                ..
            })
        ));
        let mut r = request(1);
        r.wait = Duration::from_secs(61);
        assert!(matches!(
            r.validate(&BOUNDS),
            Err(BrokerError::WaitTooLong {
                wait_ms: 61_000,
                max_ms: 60_000
            })
        ));
        let mut r = request(1);
        r.label = "123456789".into();
        assert!(refused(r).contains("label longer than 8 bytes"));
    }
}
