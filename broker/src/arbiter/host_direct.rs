//! Host memory asked for directly (`AcquireLeaseRequest.host_tier`), not as a fallback:
//! where a worker keeps a device lease's contents while it sleeps (the client's
//! sleep/wake). The grant is the host tier's, under the tenant's host limit, like a
//! fallback lease; it never waits (host memory is not queued).

use super::{Arbiter, ValidRequest};
use crate::error::{BrokerError, BrokerResult};
use crate::lease::LeaseView;
use std::sync::Arc;

impl Arbiter {
    /// Grants `req.bytes` of host memory (rounded up to the host tier's granularity).
    pub(crate) async fn acquire_host_tier(
        self: &Arc<Self>,
        req: ValidRequest,
    ) -> BrokerResult<LeaseView> {
        self.lifecycle.refuse_new_work()?;
        let Some(host) = &self.host_tier else {
            return Err(BrokerError::NoHostTier);
        };
        let gran = host.desc().granularity;
        let bytes = crate::units::round_up(req.bytes, gran).ok_or_else(|| {
            BrokerError::InvalidArgument(format!("size {} is too large", req.bytes))
        })?;
        self.sessions().peer(&req.tenant, req.session)?;
        self.acquire_host(&req, bytes).await
    }
}
