//! The arbiter's side of the audit log (`crate::audit` has the records and the log):
//! [`Arbiter::audit`] records an operator change durably and as a structured log line;
//! [`Arbiter::list_audit`] reads them back.

use super::Arbiter;
use crate::audit::{AuditFilter, AuditRecord, Who};
use crate::error::{BrokerError, BrokerResult};

impl Arbiter {
    /// Records an operator change: durably, and as a structured log line. A record that
    /// cannot be written is logged as an error; the change itself stands.
    pub fn audit(
        &self,
        who: &Who,
        action: &str,
        tenant: &str,
        target: &str,
        before: Option<serde_json::Value>,
        after: Option<serde_json::Value>,
    ) {
        let rec = AuditRecord::now(who, action, tenant, target, before, after);
        match self.audit_log.append(self.store.as_ref(), rec) {
            Ok(r) => crate::audit::logged(&r),
            Err(e) => tracing::error!(
                target: "gpu_broker::audit",
                action,
                tenant,
                object = target,
                error = %e,
                "AUDIT RECORD NOT WRITTEN"
            ),
        }
    }

    /// Recorded changes, oldest first.
    pub fn list_audit(&self, filter: &AuditFilter) -> BrokerResult<Vec<AuditRecord>> {
        self.audit_log
            .list(self.store.as_ref(), filter)
            .map_err(|e| BrokerError::Internal(format!("audit log: {e}")))
    }
}
