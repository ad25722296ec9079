//! Unit tests of operators' durable changes whose commit fails (the store's test hook
//! `Store::fail_commits`, an I/O error at commit): a quota change, a tenant deletion and
//! token changes each return a clear error (INTERNAL, naming the state store's commit), change
//! nothing in memory, write no audit record and count the failure in the metrics; the
//! store reads unwritable meanwhile, and once it works again the next change commits and
//! a broker started on the store sees exactly the changes that succeeded.

use super::admin::QuotaUpdate;
use super::durable_tests::{
    change_quota_for, delete_tenant_for, issue_for, reopened, revoke_token_for, stored_arbiter,
};
use super::tokens::TokenSpec;
use super::*;
use crate::audit::{AuditFilter, Who};
use crate::error::BrokerError;
use crate::ledger::Quota;

const MIB: u64 = 1 << 20;

fn limit(bytes: u64) -> QuotaUpdate {
    QuotaUpdate::Replace(Quota {
        limit_bytes: bytes,
        ..Quota::default()
    })
}

fn who() -> Who {
    Who::system("test")
}

fn worker_token(tenant: &str) -> TokenSpec {
    TokenSpec {
        tenant: Some(tenant.to_string()),
        description: "test".into(),
        ..Default::default()
    }
}

/// `gpu_broker_store_write_failures_total` as `/metrics` shows it.
async fn failures(arb: &Arbiter) -> u64 {
    let text = arb
        .views()
        .metrics_text(crate::metrics::Format::PrometheusText)
        .await;
    text.lines()
        .find_map(|l| l.strip_prefix("gpu_broker_store_write_failures_total "))
        .unwrap_or_else(|| panic!("no store failure counter in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

fn records(arb: &Arbiter) -> usize {
    arb.durable
        .list_audit(&AuditFilter::default())
        .unwrap()
        .len()
}

/// The refusal an operator gets for a failed commit: `Internal` (INTERNAL on the wire,
/// `grpc_status.rs`), saying it was the store's commit.
fn assert_store_failure(e: BrokerError) {
    match &e {
        BrokerError::Internal(m) => assert!(
            m.starts_with("state store") && m.contains("commit"),
            "{e:?}"
        ),
        other => panic!("{other:?}"),
    }
}

fn writable(arb: &Arbiter) -> bool {
    *arb.durable.store().unwrap().writable().borrow()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_changes_nothing_records_nothing_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    change_quota_for(&arb, "a".into(), limit(64 * MIB), who())
        .await
        .unwrap();
    let kept = issue_for(&arb, worker_token("a"), who()).await.unwrap();
    assert_eq!((records(&arb), failures(&arb).await), (2, 0));
    let store = arb.durable.store().unwrap();
    store.fail_commits(true);

    // A quota change of a tenant, and a new tenant.
    let e = change_quota_for(&arb, "a".into(), limit(128 * MIB), who())
        .await
        .unwrap_err();
    assert_store_failure(e);
    assert_eq!(arb.views().tenant("a").unwrap().quota.limit_bytes, 64 * MIB);
    assert!(!writable(&arb), "the store reads unwritable");
    let e = change_quota_for(&arb, "b".into(), limit(MIB), who())
        .await
        .unwrap_err();
    assert_store_failure(e);
    assert!(arb.views().tenant("b").is_err(), "no tenant was created");
    assert_eq!((records(&arb), failures(&arb).await), (2, 2));

    // A deletion: the tenant stays, reopened (it takes charges again).
    let e = delete_tenant_for(&arb, "a".into(), who())
        .await
        .unwrap_err();
    assert_store_failure(e);
    assert_eq!(arb.views().tenant("a").unwrap().quota.limit_bytes, 64 * MIB);
    let (session, _events) = arb.open_session("a", "t", Default::default()).unwrap();
    let lease = arb
        .acquire(AcquireRequest {
            tenant: "a".into(),
            session,
            bytes: 8 * MIB,
            device: None,
            wait: Duration::ZERO,
            label: String::new(),
            reclaimable: false,
            fallback_host: false,
        })
        .await
        .expect("a tenant whose deletion failed takes charges again");
    arb.release("a", lease.id).unwrap();
    assert_eq!(arb.auth.list(Some("a")).len(), 1, "its token stayed");

    // Token changes: none issued, none revoked.
    let e = issue_for(&arb, worker_token("a"), who()).await.unwrap_err();
    assert_store_failure(e);
    assert_eq!(arb.auth.list(Some("a")).len(), 1, "no token issued");
    let e = revoke_token_for(&arb, kept.entry.token_id.clone(), who())
        .await
        .unwrap_err();
    assert_store_failure(e);
    assert!(
        arb.auth.find(&kept.token).is_some(),
        "the token still authenticates"
    );
    assert_eq!((records(&arb), failures(&arb).await), (2, 5), "no record");

    // The store works again: the next change reopens it and commits, with its record.
    store.fail_commits(false);
    change_quota_for(&arb, "a".into(), limit(32 * MIB), who())
        .await
        .unwrap();
    assert!(writable(&arb));
    assert_eq!(arb.views().tenant("a").unwrap().quota.limit_bytes, 32 * MIB);
    let log = arb.durable.list_audit(&AuditFilter::default()).unwrap();
    assert_eq!(log.len(), 3);
    assert_eq!(log[2].seq, log[1].seq + 1, "no sequence number was used up");
    assert_eq!(
        log[2].before, log[0].after,
        "the quota before was the committed one"
    );
    revoke_token_for(&arb, kept.entry.token_id.clone(), who())
        .await
        .unwrap();
    assert!(arb.auth.find(&kept.token).is_none());
    assert_eq!(failures(&arb).await, 5);

    // What is durable is exactly what succeeded.
    arb.lifecycle().join(Duration::from_secs(5)).await;
    drop(arb);
    let (tenants, durable) = reopened(dir.path());
    assert_eq!(tenants, vec![("a".to_string(), 32 * MIB)]);
    let actions: Vec<&str> = durable.iter().map(|r| r.action.as_str()).collect();
    assert_eq!(
        actions,
        ["quota.set", "token.issue", "quota.set", "token.revoke"]
    );
    let arb = stored_arbiter(dir.path());
    assert_eq!(arb.views().tenant("a").unwrap().quota.limit_bytes, 32 * MIB);
    assert!(arb.auth.list(Some("a")).is_empty());
}
