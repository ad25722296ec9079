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
        let rec = AuditRecord {
            seq: 0,
            unix_ms: crate::units::unix_ms(std::time::SystemTime::now()),
            who: who.clone(),
            action: action.to_string(),
            tenant: tenant.to_string(),
            target: target.to_string(),
            before,
            after,
        };
        match self.audit_log.append(self.store.as_ref(), rec) {
            Ok(r) => tracing::info!(
                target: "gpu_broker::audit",
                seq = r.seq,
                action = %r.action,
                tenant = %r.tenant,
                object = %r.target,
                token_id = %r.who.token_id,
                token_name = %r.who.name,
                scope = %r.who.scope,
                peer_uid = ?r.who.peer_uid,
                peer_pid = ?r.who.peer_pid,
                before = %r.before.as_ref().map(|v| v.to_string()).unwrap_or_default(),
                after = %r.after.as_ref().map(|v| v.to_string()).unwrap_or_default(),
                "audit"
            ),
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
