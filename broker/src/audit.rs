//! The audit log: every operator change (quota, tenant, token, lease revocation, drain,
//! device health override, configuration reload) with when, who (the token's id, name
//! and scope; the peer's uid and pid on the Unix socket), what, and the values before and
//! after. Records live in their own table (`audit`, key: sequence number, value: JSON
//! [`AuditRecord`]) of the state file, each committed with fsync before the operation's
//! reply; each is also logged as a structured line (target `gpu_broker::audit`).
//!
//! Retention: the newest [`DEFAULT_MAX_RECORDS`] records (older ones are dropped as new
//! ones arrive), so the table stays bounded. Without a store (tests) records are kept in
//! memory under the same bound.
//!
//! Other modules record through `Changes::audit` (`arbiter/audit.rs`, `Arbiter::changes`); `Who::system`
//! names changes nobody asked for over the API (a signal-triggered reload, the health
//! monitor).

use crate::error::{BrokerError, BrokerResult};
use crate::store::{AlsoWrite, Store};
use parking_lot::Mutex;
use redb::{ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Records kept (newest); about 0.5 KiB each, so about 25 MiB at most.
pub const DEFAULT_MAX_RECORDS: u64 = 50_000;

/// Most records one listing returns.
pub const MAX_LIST: usize = 10_000;

const AUDIT: TableDefinition<u64, &[u8]> = TableDefinition::new("audit");

/// Who made a change.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Who {
    /// Token id (`admin-file` for the admin token file; `system` for the broker itself).
    pub token_id: String,
    pub name: String,
    pub scope: String,
    /// Peer credentials on the Unix socket (absent over TCP).
    pub peer_uid: Option<u32>,
    pub peer_pid: Option<u32>,
}

impl Who {
    /// The broker itself, for `reason` (e.g. "SIGHUP", "health monitor").
    pub fn system(reason: &str) -> Who {
        Who {
            token_id: "system".into(),
            name: reason.into(),
            scope: "system".into(),
            peer_uid: None,
            peer_pid: None,
        }
    }
}

/// One recorded change.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// Increasing, never reused.
    pub seq: u64,
    /// When (ms since the epoch).
    pub unix_ms: i64,
    pub who: Who,
    /// What, as `noun.verb`: `quota.set`, `tenant.delete`, `token.issue`, `token.revoke`,
    /// `admin_token.rotate`, `lease.revoke`, `drain.start`, `drain.stop`,
    /// `device.health`, `config.reload`, ...
    pub action: String,
    /// The tenant concerned ("" if none).
    pub tenant: String,
    /// The object concerned (token id, lease id, device, ...; "" if none).
    pub target: String,
    pub before: Option<serde_json::Value>,
    pub after: Option<serde_json::Value>,
}

/// Which records to list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AuditFilter {
    /// Only records at or after this instant (ms since the epoch).
    pub since_unix_ms: Option<i64>,
    pub tenant: Option<String>,
    /// The newest this many (capped at [`MAX_LIST`]; 0: the cap).
    pub limit: usize,
}

impl AuditFilter {
    fn keeps(&self, r: &AuditRecord) -> bool {
        self.since_unix_ms.is_none_or(|s| r.unix_ms >= s)
            && self.tenant.as_deref().is_none_or(|t| r.tenant == t)
    }
    fn limit(&self) -> usize {
        if self.limit == 0 {
            MAX_LIST
        } else {
            self.limit.min(MAX_LIST)
        }
    }
}

/// The log: the next sequence number, and the records themselves when there is no store.
#[derive(Debug)]
pub struct AuditLog {
    /// Next sequence number; held while a record is written, so records commit in order.
    next: Mutex<u64>,
    mem: Mutex<VecDeque<AuditRecord>>,
    max_records: u64,
}

impl AuditLog {
    /// Opens the log of `store` (continues its numbering).
    pub fn open(store: Option<&Store>, max_records: u64) -> BrokerResult<AuditLog> {
        let next = match store {
            None => 1,
            Some(s) => s
                .read_with("read audit table", |txn| match txn.open_table(AUDIT) {
                    Ok(t) => Ok(t.last()?.map(|(k, _)| k.value() + 1).unwrap_or(1)),
                    Err(redb::TableError::TableDoesNotExist(_)) => Ok(1),
                    Err(e) => Err(e.into()),
                })
                .map_err(|e| BrokerError::Internal(format!("audit log: {e}")))?,
        };
        Ok(AuditLog {
            next: Mutex::new(next),
            mem: Mutex::new(VecDeque::new()),
            max_records: max_records.max(1),
        })
    }

    /// Appends a record (durable before returning when there is a store).
    pub fn append(
        &self,
        store: Option<&Store>,
        rec: AuditRecord,
    ) -> Result<AuditRecord, crate::store::StoreError> {
        self.append_with(store, rec, |insert| match (store, insert) {
            (Some(s), Some(insert)) => s.write_with("write audit record", insert),
            _ => Ok(()),
        })
        .map(|((), rec)| rec)
    }

    /// Writes `rec` (numbered) in `txn`, dropping the oldest past the bound.
    fn insert(&self, txn: &redb::WriteTransaction, rec: &AuditRecord) -> Result<(), redb::Error> {
        let bytes = serde_json::to_vec(rec).unwrap_or_default();
        let mut t = txn.open_table(AUDIT)?;
        t.insert(rec.seq, bytes.as_slice())?;
        while t.len()? > self.max_records {
            if t.pop_first()?.is_none() {
                break;
            }
        }
        Ok(())
    }

    /// Appends `rec` in the write transaction that `commit` runs, so that a change and
    /// its record are one commit: with a store, `commit` is given what writes the
    /// (numbered) record into a transaction and must call it in the transaction it
    /// commits; without one it gets None and the record is kept in memory once `commit`
    /// returns Ok. Numbers are taken in order and only by records that committed.
    pub fn append_with<T>(
        &self,
        store: Option<&Store>,
        mut rec: AuditRecord,
        commit: impl FnOnce(Option<AlsoWrite<'_>>) -> Result<T, crate::store::StoreError>,
    ) -> Result<(T, AuditRecord), crate::store::StoreError> {
        let mut next = self.next.lock();
        rec.seq = *next;
        let out = match store {
            Some(_) => commit(Some(&|txn: &redb::WriteTransaction| self.insert(txn, &rec)))?,
            None => {
                let out = commit(None)?;
                let mut m = self.mem.lock();
                m.push_back(rec.clone());
                while m.len() as u64 > self.max_records {
                    m.pop_front();
                }
                out
            }
        };
        *next += 1;
        Ok((out, rec))
    }

    /// Matching records, oldest first (the newest `filter.limit`).
    pub fn list(
        &self,
        store: Option<&Store>,
        filter: &AuditFilter,
    ) -> Result<Vec<AuditRecord>, crate::store::StoreError> {
        let limit = filter.limit();
        let mut out: Vec<AuditRecord> = match store {
            None => self
                .mem
                .lock()
                .iter()
                .rev()
                .filter(|r| filter.keeps(r))
                .take(limit)
                .cloned()
                .collect(),
            Some(s) => s.read_with("read audit table", |txn| {
                let t = match txn.open_table(AUDIT) {
                    Ok(t) => t,
                    Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                    Err(e) => return Err(e.into()),
                };
                let mut v = Vec::new();
                for item in t.iter()?.rev() {
                    let (_, value) = item?;
                    // A record this build cannot read is skipped, not fatal: the log
                    // must stay listable.
                    let Ok(r) = serde_json::from_slice::<AuditRecord>(value.value()) else {
                        continue;
                    };
                    if filter.since_unix_ms.is_some_and(|since| r.unix_ms < since) {
                        break; // older from here on
                    }
                    if filter.keeps(&r) {
                        v.push(r);
                        if v.len() >= limit {
                            break;
                        }
                    }
                }
                Ok(v)
            })?,
        };
        out.reverse();
        Ok(out)
    }
}

/// A token's public fields as the audit log records them.
pub fn token_json(t: &crate::auth::TokenEntry) -> serde_json::Value {
    serde_json::json!({
        "token_id": t.token_id,
        "name": t.name,
        "scope": t.scope.as_str(),
        "tenant": t.tenant,
        "expires_unix_ms": t.expires_unix_ms,
    })
}

impl AuditRecord {
    /// A record of a change made now (numbered when appended).
    pub fn now(
        who: &Who,
        action: &str,
        tenant: &str,
        target: &str,
        before: Option<serde_json::Value>,
        after: Option<serde_json::Value>,
    ) -> AuditRecord {
        AuditRecord {
            seq: 0,
            unix_ms: crate::units::unix_ms(std::time::SystemTime::now()),
            who: who.clone(),
            action: action.to_string(),
            tenant: tenant.to_string(),
            target: target.to_string(),
            before,
            after,
        }
    }
}

/// The structured log line of a record written (target `gpu_broker::audit`).
pub(crate) fn logged(r: &AuditRecord) {
    tracing::info!(
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
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(tenant: &str, unix_ms: i64) -> AuditRecord {
        AuditRecord {
            seq: 0,
            unix_ms,
            who: Who::system("test"),
            action: "quota.set".into(),
            tenant: tenant.into(),
            target: String::new(),
            before: None,
            after: Some(serde_json::json!({"limit_bytes": 1})),
        }
    }

    #[test]
    fn durable_ordered_bounded_and_filtered() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(dir.path()).unwrap();
            let log = AuditLog::open(Some(&store), 3).unwrap();
            for (i, t) in ["a", "b", "a", "b"].iter().enumerate() {
                let r = log.append(Some(&store), rec(t, 100 + i as i64)).unwrap();
                assert_eq!(r.seq, i as u64 + 1);
            }
            // Bounded: the oldest went.
            let all = log.list(Some(&store), &AuditFilter::default()).unwrap();
            assert_eq!(all.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![2, 3, 4]);
        }
        // Reopened: records are still there and numbering continues.
        let store = Store::open(dir.path()).unwrap();
        let log = AuditLog::open(Some(&store), 3).unwrap();
        assert_eq!(log.append(Some(&store), rec("a", 200)).unwrap().seq, 5);
        let a = log
            .list(
                Some(&store),
                &AuditFilter {
                    tenant: Some("a".into()),
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(a.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![3, 5]);
        let recent = log
            .list(
                Some(&store),
                &AuditFilter {
                    since_unix_ms: Some(103),
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(recent.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![4, 5]);
        let newest = log
            .list(
                Some(&store),
                &AuditFilter {
                    limit: 1,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(newest[0].seq, 5);
        assert_eq!(newest[0].after, Some(serde_json::json!({"limit_bytes": 1})));
    }

    #[test]
    fn in_memory_without_a_store() {
        let log = AuditLog::open(None, 2).unwrap();
        for i in 0..3 {
            log.append(None, rec("a", i)).unwrap();
        }
        let all = log.list(None, &AuditFilter::default()).unwrap();
        assert_eq!(all.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![2, 3]);
    }
}
