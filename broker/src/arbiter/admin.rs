//! Operator operations: quotas, tenants, tokens (their views: `listing.rs`). Every change is committed to the store (`audit.rs`) before it takes effect in
//! memory, and before the RPC returns.

use super::{Arbiter, State};
use crate::error::{BrokerError, BrokerResult};
use crate::ledger::{validate_tenant_name, Ledger, Quota, QuotaPatch, Tenant};
use crate::store::TenantRecord;
pub use crate::views::{DeviceReport, QuarantineView, SessionView, TenantView};
use std::sync::Arc;
use uuid::Uuid;

/// A quota change: the whole quota, or only some fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QuotaUpdate {
    Replace(Quota),
    Patch(QuotaPatch),
}

/// What a quota change did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaChange {
    pub tenant: TenantView,
    pub created: bool,
    /// What the new quota means for what the tenant holds now (see
    /// `Tenant::over_quota_warnings`).
    pub warnings: Vec<String>,
}

impl Arbiter {
    /// Creates or updates a tenant's quota. Returns the tenant and whether it was created.
    pub fn set_quota(
        self: &Arc<Self>,
        name: &str,
        quota: Quota,
    ) -> BrokerResult<(TenantView, bool)> {
        let c = self
            .changes()
            .change_quota(name, QuotaUpdate::Replace(quota), None)?;
        Ok((c.tenant, c.created))
    }
}

impl super::Changes<'_> {
    /// Creates a tenant or changes its quota: replaced whole, or patched (only the fields
    /// given change, read and written under one lock so racing patches both apply). With
    /// `(who, action, target)`, its audit record (`action` on `target`, the quota before,
    /// read under the same locks, and after) is committed in the same transaction as the
    /// quota, and logged. An operator's change runs on the store writer
    /// ([`super::Changes::run`]) and answers once both are durable and the change applied.
    pub(crate) fn change_quota(
        &self,
        name: &str,
        update: QuotaUpdate,
        who: Option<(&crate::audit::Who, &str, &str)>,
    ) -> BrokerResult<QuotaChange> {
        validate_tenant_name(name)?;
        let _writes = self.arb.durable.writes();
        let st = self.arb.lock();
        let before = st.ledger().get(name).map(|t| t.quota.to_json());
        let quota = match update {
            QuotaUpdate::Replace(q) => q,
            QuotaUpdate::Patch(p) => p.apply(st.ledger().get(name).map(|t| &t.quota))?,
        };
        Ledger::validate_quota(&quota)?;
        quota.validate_devices(self.arb.devices.len())?;
        let guarantees = st.ledger().guarantees_with(name, quota.guaranteed_bytes);
        let leasable = leasable_total(&st);
        if guarantees > leasable {
            return Err(BrokerError::GuaranteesExceedCapacity {
                guarantees,
                leasable,
            });
        }
        drop(st);
        // Committed first, with no state lock held (acquires and heartbeats go on); then
        // applied. Other durable changes wait for `Durable::writes`, so nothing changes this
        // tenant's quota in between.
        let record = TenantRecord {
            name: name.to_string(),
            quota: quota.clone(),
        };
        let rec = who.map(|(who, action, target)| {
            crate::audit::AuditRecord::now(who, action, name, target, before, Some(quota.to_json()))
        });
        self.commit_recorded(rec, |store, audit| store.put_tenant_with(&record, audit))?;
        tracing::info!(tenant = name, ?quota, "quota set");
        let mut st = self.arb.lock();
        let created = st.set_quota(name, quota)?;
        // The reply shows the tenant after the queue ran for it.
        st.settle();
        let t = st
            .ledger()
            .get(name)
            .ok_or_else(|| BrokerError::Internal("tenant vanished".into()))?;
        let warnings = t.over_quota_warnings();
        for w in &warnings {
            tracing::warn!(tenant = name, "{w}");
        }
        let view = tenant_view(&st, t);
        drop(st);
        Ok(QuotaChange {
            tenant: self.arb.views().finish_tenant(view),
            created,
            warnings,
        })
    }

    /// Deletes a tenant that holds nothing; its tokens go too and its sessions end. With
    /// `who`, its audit record (`tenant.delete`, the quota before) is committed with it.
    pub(crate) fn delete_tenant(
        &self,
        name: &str,
        who: Option<&crate::audit::Who>,
    ) -> BrokerResult<()> {
        let _writes = self.arb.durable.writes();
        // Check and close the tenant (it takes no new charge), commit the deletion to the
        // store with no state lock held, then apply it (or reopen the tenant). What it was
        // is read under the same locks.
        let before = {
            let mut st = self.arb.lock();
            st.close_tenant(name)?;
            st.ledger().get(name).map(|t| t.quota.to_json())
        };
        let rec = who.map(|who| {
            crate::audit::AuditRecord::now(who, "tenant.delete", name, "", before, None)
        });
        if let Err(e) =
            self.commit_recorded(rec, |store, audit| store.delete_tenant_with(name, audit))
        {
            self.arb.lock().reopen_tenant(name);
            return Err(e);
        }
        let sessions: Vec<Uuid> = {
            let mut st = self.arb.lock();
            st.delete_tenant(name)?;
            self.arb.auth.remove_tenant(name);
            st.sessions()
                .iter()
                .filter(|s| s.tenant == name)
                .map(|s| s.id)
                .collect()
        };
        for s in sessions {
            self.arb.end_session(s, "tenant deleted");
        }
        // After its sessions ended (their turns are booked): a tenant created again under
        // the name must not inherit the counters.
        self.arb.with_turns(|t| t.forget_tenant(name));
        tracing::info!(tenant = name, "tenant deleted");
        Ok(())
    }

    /// Revokes a token given its id or the token itself. With `who`, its audit record
    /// (`token.revoke`, the token before) is committed with it.
    pub(crate) fn revoke_token(
        &self,
        id_or_token: &str,
        who: Option<&crate::audit::Who>,
    ) -> BrokerResult<()> {
        let _writes = self.arb.durable.writes();
        let entry = self
            .arb
            .auth
            .find(id_or_token)
            .ok_or(BrokerError::NotFound(crate::error::Missing::Token))?;
        if self.arb.auth.is_declared(&entry.hash) {
            return Err(BrokerError::FailedPrecondition(format!(
                "token {} ({}) is declared in the config file: remove its [tokens.{}] table \
                 there (the ConfigMap, for every node)",
                entry.token_id, entry.name, entry.name
            )));
        }
        let rec = who.map(|who| {
            crate::audit::AuditRecord::now(
                who,
                "token.revoke",
                &entry.tenant,
                &entry.token_id,
                Some(crate::audit::token_json(&entry)),
                None,
            )
        });
        self.commit_recorded(rec, |store, audit| {
            store.delete_token_with(&entry.token_id, audit)
        })?;
        self.arb.auth.remove(&entry.hash);
        tracing::info!(tenant = %entry.tenant, token_id = %entry.token_id, "token revoked");
        if let Some(me) = self.arb.me.upgrade() {
            me.sessions()
                .end_of_token(&entry.token_id, "the session's token was revoked");
        }
        Ok(())
    }
}

/// A tenant's view from the state (under its lock); its token count and compute-turn
/// usage come from their own tables after the lock is released ([`super::listing::Views::finish_tenant`]).
pub(super) fn tenant_view(st: &State, t: &Tenant) -> TenantView {
    let waiting = st.queue().iter().filter(|w| w.ask.tenant == t.name).count() as u32;
    let mut v = TenantView::of(t, st.sessions().count_of(&t.name) as u32, waiting);
    if waiting > 0 {
        v.queue_position = st.queue().position_of(&t.name, st.ledger());
    }
    v
}

/// Total leasable bytes of every device.
fn leasable_total(st: &State) -> u64 {
    st.pools()
        .iter()
        .map(|p| p.leasable())
        .fold(0, u64::saturating_add)
}
