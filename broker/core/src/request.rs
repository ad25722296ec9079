//! What the core is asked for: a request for memory ([`AcquireRequest`]), after the service
//! layer checked its shape.

use std::time::Duration;
use uuid::Uuid;

/// A request for memory, after the service layer checked its shape.
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
