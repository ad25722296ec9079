//! Unit tests of operators' durable changes (quotas, tenant deletion, tokens, config
//! reloads: `tenants_config.rs`; audit-only records) through the store writer: each change and its
//! audit record in one commit, in the order asked for, memory and store agreeing after
//! concurrent changes and after a restart, and the writer's shutdown.

use super::admin::QuotaUpdate::{self, Replace};
use super::tests::{quota, req};
use super::tokens::{IssuedToken, TokenSpec};
use super::*;
use crate::audit::{AuditFilter, AuditLog, Who};
use crate::error::BrokerError;
use crate::ledger::{Quota, QuotaPatch};

const MIB: u64 = 1 << 20;

/// An arbiter over one simulated 1 GiB device whose tenants live in `dir`'s store.
pub(crate) fn stored_arbiter(dir: &std::path::Path) -> Arc<Arbiter> {
    host_arbiter_with_store(
        1024 * MIB,
        1,
        ArbiterConfig::default(),
        Some(Store::open(dir).unwrap()),
    )
}

fn who() -> Who {
    Who::system("test")
}

/// What the store holds once the arbiter is gone: tenants by name, and the audit log.
pub(crate) fn reopened(
    dir: &std::path::Path,
) -> (Vec<(String, u64)>, Vec<crate::audit::AuditRecord>) {
    let store = Store::open(dir).unwrap();
    let (tenants, _) = store.load().unwrap();
    let log = AuditLog::open(Some(&store), 1000).unwrap();
    let records = log.list(Some(&store), &AuditFilter::default()).unwrap();
    let mut t: Vec<_> = tenants
        .into_iter()
        .map(|t| (t.name, t.quota.limit_bytes))
        .collect();
    t.sort();
    (t, records)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_change_and_its_audit_record_commit_together_on_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    let c = change_quota_for(&arb, "a".into(), Replace(quota(64 * MIB)), who())
        .await
        .unwrap();
    assert!(c.created);
    assert_eq!(c.tenant.quota.limit_bytes, 64 * MIB);
    assert!(
        arb.lifecycle().has_store_writer(),
        "ran on the store writer"
    );
    // A patch: only the field given changes; the record has the quota before and after.
    let patch = QuotaPatch {
        max_leases: Some(3),
        ..QuotaPatch::default()
    };
    let c = change_quota_for(&arb, "a".into(), QuotaUpdate::Patch(patch), who())
        .await
        .unwrap();
    assert!(!c.created);
    assert_eq!(
        (c.tenant.quota.limit_bytes, c.tenant.quota.max_leases),
        (64 * MIB, 3)
    );
    let records = arb.durable.list_audit(&AuditFilter::default()).unwrap();
    assert_eq!(records.len(), 2);
    assert_eq!(records[0].action, "quota.set");
    assert_eq!(records[0].tenant, "a");
    assert_eq!(records[0].who, who());
    assert_eq!(records[0].before, None, "created");
    assert_eq!(records[1].before, records[0].after);
    assert_eq!(records[1].after, Some(c.tenant.quota.to_json()));
    assert_eq!(records[1].seq, records[0].seq + 1);
    // A refused change commits nothing: no tenant, no record.
    let e = change_quota_for(&arb, "bad name".into(), Replace(quota(MIB)), who())
        .await
        .unwrap_err();
    assert!(matches!(e, BrokerError::InvalidArgument(_)), "{e:?}");
    let e = change_quota_for(&arb, "g".into(), guaranteed(2048 * MIB), who())
        .await
        .unwrap_err();
    assert!(
        matches!(e, BrokerError::GuaranteesExceedCapacity { .. }),
        "{e:?}"
    );
    assert!(arb.views().tenant("g").is_err());
    assert_eq!(
        arb.durable
            .list_audit(&AuditFilter::default())
            .unwrap()
            .len(),
        2
    );
    arb.lifecycle().join(Duration::from_secs(5)).await;
    drop(arb);
    let (tenants, records) = reopened(dir.path());
    assert_eq!(tenants, vec![("a".to_string(), 64 * MIB)]);
    assert_eq!(records.len(), 2, "both records durable");
}

fn guaranteed(bytes: u64) -> QuotaUpdate {
    Replace(Quota {
        guaranteed_bytes: bytes,
        ..quota(bytes)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_changes_leave_memory_store_and_audit_agreeing() {
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    let mut changes = Vec::new();
    for i in 0..40u64 {
        let arb = arb.clone();
        changes.push(tokio::spawn(async move {
            change_quota_for(
                &arb,
                format!("t{}", i % 4),
                Replace(quota((i + 1) * MIB)),
                who(),
            )
            .await
        }));
    }
    for c in changes {
        c.await.unwrap().unwrap();
    }
    let records = arb.durable.list_audit(&AuditFilter::default()).unwrap();
    assert_eq!(records.len(), 40);
    let seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
    assert_eq!(
        seqs,
        (seqs[0]..seqs[0] + 40).collect::<Vec<_>>(),
        "in order, no gap"
    );
    // The last record of each tenant is what memory holds, and each record's `before`
    // is the `after` of the tenant's record before it.
    let mut in_memory = Vec::new();
    for t in 0..4 {
        let name = format!("t{t}");
        let mine: Vec<_> = records.iter().filter(|r| r.tenant == name).collect();
        assert_eq!(mine.len(), 10);
        for w in mine.windows(2) {
            assert_eq!(w[1].before, w[0].after, "{name}");
        }
        let q = arb.views().tenant(&name).unwrap().quota;
        assert_eq!(mine.last().unwrap().after, Some(q.to_json()));
        in_memory.push((name, q.limit_bytes));
    }
    arb.lifecycle().join(Duration::from_secs(5)).await;
    drop(arb);
    let (tenants, durable) = reopened(dir.path());
    assert_eq!(tenants, in_memory, "the store agrees with memory");
    assert_eq!(durable, records);
    // And a broker started on it again loads the same.
    let arb = stored_arbiter(dir.path());
    for (name, bytes) in &in_memory {
        assert_eq!(arb.views().tenant(name).unwrap().quota.limit_bytes, *bytes);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_writer_stops_a_change_is_refused_and_nothing_changes() {
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    change_quota_for(&arb, "a".into(), Replace(quota(8 * MIB)), who())
        .await
        .unwrap();
    assert!(arb
        .lifecycle()
        .join(Duration::from_secs(5))
        .await
        .is_empty());
    let e = change_quota_for(&arb, "a".into(), Replace(quota(16 * MIB)), who())
        .await
        .unwrap_err();
    assert!(matches!(e, BrokerError::ShuttingDown), "{e:?}");
    assert_eq!(arb.views().tenant("a").unwrap().quota.limit_bytes, 8 * MIB);
    assert_eq!(
        arb.durable
            .list_audit(&AuditFilter::default())
            .unwrap()
            .len(),
        1
    );
    // The synchronous path (configuration reloads, start-up) still works.
    arb.changes()
        .change_quota("a", Replace(quota(32 * MIB)), None)
        .unwrap();
    assert_eq!(arb.views().tenant("a").unwrap().quota.limit_bytes, 32 * MIB);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_after_shutdown_is_refused_though_none_came_before() {
    // No change started the writer before the workers were joined: none starts after.
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    assert!(arb
        .lifecycle()
        .join(Duration::from_secs(5))
        .await
        .is_empty());
    let e = change_quota_for(&arb, "a".into(), Replace(quota(16 * MIB)), who())
        .await
        .unwrap_err();
    assert!(matches!(e, BrokerError::ShuttingDown), "{e:?}");
    assert!(arb.views().tenant("a").is_err(), "nothing applied");
    assert!(arb
        .durable
        .list_audit(&AuditFilter::default())
        .unwrap()
        .is_empty());
    drop(arb);
    assert_eq!(reopened(dir.path()).0, vec![], "nothing committed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_whose_caller_went_away_is_committed_and_applied_both() {
    // The caller (an RPC past its deadline) stops waiting once the change is handed over:
    // the change still runs whole, so memory and the store agree.
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    let writes = arb.durable.writes();
    // Polled once (the change is handed over, and waits for `writes`), then dropped.
    let asked = change_quota_for(&arb, "a".into(), Replace(quota(8 * MIB)), who());
    assert!(futures::FutureExt::now_or_never(asked).is_none());
    drop(writes);
    let mut waited = 0;
    while arb.views().tenant("a").is_err() {
        assert!(waited < 1000, "the change was not applied");
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += 1;
    }
    assert_eq!(arb.views().tenant("a").unwrap().quota.limit_bytes, 8 * MIB);
    assert!(arb
        .lifecycle()
        .join(Duration::from_secs(5))
        .await
        .is_empty());
    let records = arb.durable.list_audit(&AuditFilter::default()).unwrap();
    drop(arb);
    let (tenants, durable) = reopened(dir.path());
    assert_eq!(tenants, vec![("a".to_string(), 8 * MIB)]);
    assert_eq!((records.len(), durable), (1, records));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raised_quota_on_the_writer_lets_a_waiter_in() {
    // The queue run after a change spawns the grant's task from the writer thread.
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    change_quota_for(&arb, "a".into(), Replace(quota(8 * MIB)), who())
        .await
        .unwrap();
    let (s, _rx) = arb.open_session("a", "w", Peer::default()).unwrap();
    let held = arb.acquire(req("a", s, 8 * MIB)).await.unwrap();
    let waiter = {
        let arb = arb.clone();
        tokio::spawn(async move {
            arb.acquire(AcquireRequest {
                wait: Duration::from_secs(30),
                ..req("a", s, 8 * MIB)
            })
            .await
        })
    };
    while arb.views().tenant("a").unwrap().waiting == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    change_quota_for(&arb, "a".into(), Replace(quota(16 * MIB)), who())
        .await
        .unwrap();
    let l = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("granted once the quota grew")
        .unwrap()
        .unwrap();
    assert_eq!(l.bytes, 8 * MIB);
    arb.release("a", held.id).unwrap();
    arb.release("a", l.id).unwrap();
}

fn actions(records: &[crate::audit::AuditRecord]) -> Vec<&str> {
    records.iter().map(|r| r.action.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_racing_a_quota_change_is_recorded_in_the_stores_order() {
    // SetQuota(a) and DeleteTenant(a) asked at once, in both orders: the audit log reads
    // in the order the store committed them, and each record's `before` is what the
    // store held then.
    for delete_first in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let arb = stored_arbiter(dir.path());
        change_quota_for(&arb, "a".into(), Replace(quota(8 * MIB)), who())
            .await
            .unwrap();
        let writes = arb.durable.writes();
        let mut set = Box::pin(change_quota_for(
            &arb,
            "a".into(),
            Replace(quota(16 * MIB)),
            who(),
        ));
        let mut delete = Box::pin(delete_tenant_for(&arb, "a".into(), who()));
        // Each polled once: handed to the writer in this order (both wait for `writes`).
        if delete_first {
            assert!(futures::FutureExt::now_or_never(&mut delete).is_none());
            assert!(futures::FutureExt::now_or_never(&mut set).is_none());
        } else {
            assert!(futures::FutureExt::now_or_never(&mut set).is_none());
            assert!(futures::FutureExt::now_or_never(&mut delete).is_none());
        }
        drop(writes);
        set.await.unwrap();
        delete.await.unwrap();
        let records = arb.durable.list_audit(&AuditFilter::default()).unwrap();
        arb.lifecycle().join(Duration::from_secs(5)).await;
        drop(arb);
        let (tenants, durable) = reopened(dir.path());
        assert_eq!(durable, records, "every record durable");
        let q = |bytes| {
            Some(
                Quota {
                    limit_bytes: bytes,
                    ..Quota::default()
                }
                .to_json(),
            )
        };
        if delete_first {
            assert_eq!(tenants, vec![("a".to_string(), 16 * MIB)], "set again");
            assert_eq!(
                actions(&records),
                ["quota.set", "tenant.delete", "quota.set"]
            );
            assert_eq!(records[1].before, q(8 * MIB));
            assert_eq!(records[2].before, None, "created again");
        } else {
            assert_eq!(tenants, vec![], "deleted last");
            assert_eq!(
                actions(&records),
                ["quota.set", "quota.set", "tenant.delete"]
            );
            assert_eq!(records[2].before, q(16 * MIB), "what the store held");
            assert_eq!(records[2].after, None);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_deletion_commits_no_record() {
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    let e = delete_tenant_for(&arb, "nobody".into(), who())
        .await
        .unwrap_err();
    assert!(matches!(e, BrokerError::NotFound(_)), "{e:?}");
    assert!(arb
        .durable
        .list_audit(&AuditFilter::default())
        .unwrap()
        .is_empty());
    arb.lifecycle().join(Duration::from_secs(5)).await;
    drop(arb);
    assert_eq!(reopened(dir.path()).1, vec![]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_issued_and_revoked_commit_with_their_records_on_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    change_quota_for(&arb, "a".into(), Replace(quota(8 * MIB)), who())
        .await
        .unwrap();
    let spec = TokenSpec {
        tenant: Some("a".into()),
        name: "ci".into(),
        ..Default::default()
    };
    let issued = issue_for(&arb, spec.clone(), who()).await.unwrap();
    let kept = issue_for(&arb, spec, who()).await.unwrap();
    revoke_token_for(&arb, issued.entry.token_id.clone(), who())
        .await
        .unwrap();
    let e = revoke_token_for(&arb, issued.entry.token_id.clone(), who())
        .await
        .unwrap_err();
    assert!(matches!(e, BrokerError::NotFound(_)), "{e:?}");
    let records = arb.durable.list_audit(&AuditFilter::default()).unwrap();
    assert_eq!(
        actions(&records),
        ["quota.set", "token.issue", "token.issue", "token.revoke"]
    );
    let json = crate::audit::token_json(&issued.entry);
    assert_eq!(records[1].after, Some(json.clone()));
    assert_eq!(records[1].target, issued.entry.token_id);
    assert_eq!(records[3].before, Some(json), "the token as it was");
    assert_eq!(records[3].tenant, "a");
    arb.lifecycle().join(Duration::from_secs(5)).await;
    drop(arb);
    let store = Store::open(dir.path()).unwrap();
    let (_, tokens) = store.load().unwrap();
    let ids: Vec<_> = tokens.iter().map(|t| t.token_id.clone()).collect();
    assert_eq!(ids, vec![kept.entry.token_id], "the revoked one is gone");
    drop(store);
    assert_eq!(reopened(dir.path()).1, records, "every record durable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_audit_only_record_is_written_on_the_writer_in_the_order_asked() {
    // A record with no store change of its own (a drain, a lease revoked) waits behind
    // the durable changes asked for before it, on the writer: the runtime worker that
    // asks neither commits nor waits for the log.
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    let writes = arb.durable.writes();
    let mut set = Box::pin(change_quota_for(
        &arb,
        "a".into(),
        Replace(quota(8 * MIB)),
        who(),
    ));
    assert!(futures::FutureExt::now_or_never(&mut set).is_none());
    arb.changes()
        .audit(&who(), "drain.start", "", "node", None, None);
    assert!(
        arb.durable
            .list_audit(&AuditFilter::default())
            .unwrap()
            .is_empty(),
        "not written in place"
    );
    drop(writes);
    set.await.unwrap();
    arb.changes().audits_written().await;
    let records = arb.durable.list_audit(&AuditFilter::default()).unwrap();
    assert_eq!(actions(&records), ["quota.set", "drain.start"]);
    arb.lifecycle().join(Duration::from_secs(5)).await;
    // After shutdown a record is still written (in place).
    arb.changes()
        .audit(&who(), "drain.stop", "", "node", None, None);
    arb.changes().audits_written().await;
    let records = arb.durable.list_audit(&AuditFilter::default()).unwrap();
    assert_eq!(
        actions(&records),
        ["quota.set", "drain.start", "drain.stop"]
    );
    drop(arb);
    assert_eq!(reopened(dir.path()).1, records, "every record durable");
}

/// The operator's RPCs as the admin service makes them: on the store writer, with their
/// audit records (`quota.set`, `tenant.delete`, `token.issue`, `token.revoke`).
pub(crate) async fn change_quota_for(
    arb: &Arc<Arbiter>,
    name: String,
    update: QuotaUpdate,
    who: Who,
) -> BrokerResult<QuotaChange> {
    arb.changes()
        .run(move |arb| {
            arb.changes()
                .change_quota(&name, update, Some((&who, "quota.set", "")))
        })
        .await
}

pub(crate) async fn delete_tenant_for(
    arb: &Arc<Arbiter>,
    name: String,
    who: Who,
) -> BrokerResult<()> {
    arb.changes()
        .run(move |arb| arb.changes().delete_tenant(&name, Some(&who)))
        .await
}

pub(crate) async fn issue_for(
    arb: &Arc<Arbiter>,
    spec: TokenSpec,
    who: Who,
) -> BrokerResult<IssuedToken> {
    arb.changes()
        .run(move |arb| arb.changes().issue_token(spec, Some(&who)))
        .await
}

pub(crate) async fn revoke_token_for(arb: &Arc<Arbiter>, id: String, who: Who) -> BrokerResult<()> {
    arb.changes()
        .run(move |arb| arb.changes().revoke_token(&id, Some(&who)))
        .await
}
