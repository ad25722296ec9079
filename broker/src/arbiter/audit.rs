//! The arbiter's side of the store and the audit log (`crate::audit` has the records and
//! the log): [`Durable`] owns both and the lock that keeps durable operator changes one at
//! a time; [`Changes`] (reached by [`Arbiter::changes`]) owns the durable operator changes:
//! [`Changes::audit`] records an operator change durably and as a structured log line;
//! [`Changes::commit_recorded`] commits a store change and its record as one,
//! [`Changes::commit`] one without a record, [`Changes::run`] runs a change on the store
//! writer; [`Changes::load`] reads tenants and tokens at start; the changes themselves
//! (quotas, tenants, tokens) are in `admin.rs` and `tokens.rs`;
//! [`Durable::list_audit`] reads the records back. Every record is written on the store writer
//! (`store_writer.rs`), in the order of the store's own commits, so the log's order is
//! the store's and no runtime worker waits for an fsync or for the log.
use super::Arbiter;
use crate::audit::{AuditFilter, AuditRecord, Who};
use crate::error::{BrokerError, BrokerResult};
use crate::store::{AlsoWrite, Store, StoreError};
use crate::store_writer::off_the_runtime;
use std::sync::Arc;

/// The state store (None: nothing is durable, records are kept in memory), the audit log
/// in it, and the lock that keeps durable operator changes one at a time.
pub(crate) struct Durable {
    store: Option<Store>,
    log: crate::audit::AuditLog,
    /// Serializes durable operator changes (quotas, tenant deletion, tokens): each
    /// validates under the state lock, commits to the store with no state lock held, then
    /// applies under the state lock. Lock order: this, then the state.
    writes: parking_lot::Mutex<()>,
}

impl Durable {
    pub fn new(store: Option<Store>, log: crate::audit::AuditLog) -> Self {
        Durable {
            store,
            log,
            writes: parking_lot::Mutex::new(()),
        }
    }

    /// The state store, if the broker has one.
    pub fn store(&self) -> Option<&Store> {
        self.store.as_ref()
    }

    /// Holds off other durable operator changes. Waiting for it does not hold up the
    /// worker thread's other tasks.
    pub fn writes(&self) -> parking_lot::MutexGuard<'_, ()> {
        match self.writes.try_lock() {
            Some(g) => g,
            None => off_the_runtime(|| self.writes.lock()),
        }
    }

    fn write_audit(&self, rec: AuditRecord) {
        let (action, tenant, target) = (rec.action.clone(), rec.tenant.clone(), rec.target.clone());
        match self.log.append(self.store(), rec) {
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
        self.log
            .list(self.store(), filter)
            .map_err(|e| BrokerError::Internal(format!("audit log: {e}")))
    }
}

/// The durable operator changes of one arbiter ([`Arbiter::changes`]): each committed to
/// the store (with its audit record) before it takes effect, one at a time. Its fields are
/// [`Durable`] (the store, the log, the lock of changes), which stays the arbiter's: the
/// restart's records go through it too.
#[derive(Clone, Copy)]
pub struct Changes<'a> {
    pub(super) arb: &'a Arc<Arbiter>,
}

impl Changes<'_> {
    /// Records an operator change that has no store change of its own (a drain, a lease
    /// revoked, a device's health): handed to the store writer, behind the durable
    /// changes asked for before it, and written (and logged) there; await
    /// [`Changes::audits_written`] before answering the operator. A record that cannot be
    /// written is logged as an error; the change itself stands. Call it with no arbiter
    /// lock held (neither the state lock nor `Durable::writes`): with the writer's queue full
    /// it waits for room, and the writer's jobs take those locks.
    pub(crate) fn audit(
        &self,
        who: &Who,
        action: &str,
        tenant: &str,
        target: &str,
        before: Option<serde_json::Value>,
        after: Option<serde_json::Value>,
    ) {
        let rec = AuditRecord::now(who, action, tenant, target, before, after);
        if self.arb.durable.store().is_none() {
            // Kept in memory: nothing to wait for.
            return self.arb.durable.write_audit(rec);
        }
        let handed = self.arb.me.upgrade().is_some_and(|me| {
            self.arb.lifecycle.store_writer().is_ok_and(|w| {
                let rec = rec.clone();
                w.submit(move || me.durable.write_audit(rec)).is_ok()
            })
        });
        if !handed {
            // The writer has stopped (shutdown), or the arbiter is going away: written here.
            off_the_runtime(|| self.arb.durable.write_audit(rec));
        }
    }

    /// Returns once every audit record handed over before has been written.
    pub(crate) async fn audits_written(self) {
        if self.arb.durable.store().is_some() {
            let _ = self.run(|_| Ok(())).await;
        }
    }

    /// Commits a store change (`write`), with `rec` in the same transaction when given:
    /// `write` is then handed what writes the record and must call it in the transaction
    /// it commits. The record is logged once committed. Without a store nothing is
    /// committed and the record is kept in memory. Runs where it is called (on the store
    /// writer, for an RPC's change).
    pub(super) fn commit_recorded<T: Default>(
        &self,
        rec: Option<AuditRecord>,
        write: impl FnOnce(&Store, Option<AlsoWrite<'_>>) -> Result<T, StoreError>,
    ) -> BrokerResult<T> {
        let Some(rec) = rec else {
            return self.commit(|store| write(store, None));
        };
        let store = self.arb.durable.store();
        let (out, rec) = off_the_runtime(|| {
            self.arb
                .durable
                .log
                .append_with(store, rec, |audit| match (store, audit) {
                    (Some(s), Some(audit)) => write(s, Some(audit)),
                    _ => Ok(T::default()),
                })
        })
        .map_err(|e| store_write_failed(&self.arb.metrics, e))?;
        if store.is_some() {
            self.arb.metrics.store_write(true);
        }
        crate::audit::logged(&rec);
        Ok(out)
    }
}

impl Changes<'_> {
    /// Commits a durable change (a redb transaction, fsync included), counted in the
    /// metrics. Callers hold no state lock; on a multi-threaded runtime the commit runs in
    /// `block_in_place`, so the worker thread's other tasks move elsewhere meanwhile.
    pub(super) fn commit<T: Default>(
        &self,
        write: impl FnOnce(&crate::store::Store) -> Result<T, StoreError>,
    ) -> BrokerResult<T> {
        let Some(store) = self.arb.durable.store() else {
            return Ok(T::default());
        };
        off_the_runtime(|| write(store))
            .inspect(|_| self.arb.metrics.store_write(true))
            .map_err(|e| store_write_failed(&self.arb.metrics, e))
    }

    /// Loads tenants, token hashes and claim reservations from the store (start-up).
    pub(super) fn load(&self) -> BrokerResult<()> {
        let Some(store) = self.arb.durable.store() else {
            return Ok(());
        };
        let (tenants, tokens) = store.load().map_err(store_err)?;
        let mut st = self.arb.lock();
        for t in &tenants {
            st.set_quota(&t.name, t.quota.clone())?;
        }
        for t in tokens {
            self.arb.auth.add(t);
        }
        drop(st);
        let claims = self.arb.claims().restore_all(store)?;
        tracing::info!(tenants = tenants.len(), claims, "state loaded");
        Ok(())
    }

    /// Runs `change` on the store writer (started on first use, inside the caller's
    /// runtime), after the durable changes asked for before it: the arbiter's own
    /// operator changes and those made outside it (a configuration reload). Without a
    /// store it runs here: nothing is committed.
    pub async fn run<T: Send + 'static>(
        self,
        change: impl FnOnce(&Arc<Arbiter>) -> BrokerResult<T> + Send + 'static,
    ) -> BrokerResult<T> {
        if self.arb.durable.store().is_none() {
            return change(self.arb);
        }
        let me = self.arb.clone();
        self.arb
            .lifecycle
            .store_writer()?
            .run(move || change(&me))
            .await
            .map_err(|e| match e {
                crate::store_writer::WriterError::Stopped => BrokerError::ShuttingDown,
                crate::store_writer::WriterError::Panicked(why) => {
                    BrokerError::Internal(format!("a durable change panicked: {why}"))
                }
            })?
    }
}

/// A store error as the caller's answer.
pub(super) fn store_err(e: StoreError) -> BrokerError {
    BrokerError::Internal(format!("state store: {e}"))
}

/// A store write failed: counted (the store-unwritable alert watches it), then the error
/// the caller returns.
fn store_write_failed(metrics: &crate::metrics::Metrics, e: StoreError) -> BrokerError {
    metrics.store_write(false);
    store_err(e)
}
