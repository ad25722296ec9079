//! Tests of the Admin calls whose change has no store write of its own (RevokeLease,
//! RotateAdminToken, Drain, Undrain, SetDeviceHealth): the change is made, its audit
//! record is handed to the store writer, and the call answers only once the record is
//! written. Each test holds the writer busy with a change asked for first: the call must
//! not answer meanwhile, and its record is there to read the moment it does.

use crate::arbiter::durable_tests::{change_quota_for, reopened, stored_arbiter};
use crate::arbiter::tests::{quota, req};
use crate::arbiter::{Arbiter, QuotaUpdate};
use crate::audit::{AuditFilter, AuditRecord, Who};
use crate::service::admin::AdminService;
use crate::session::Peer;
use gpu_broker_proto::v1 as pb;
use gpu_broker_proto::v1::admin_server::Admin;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// The audit log, oldest first.
fn records(arb: &Arbiter) -> Vec<AuditRecord> {
    arb.durable.list_audit(&AuditFilter::default()).unwrap()
}

/// Runs `call` while the store writer is busy with a change asked for before it: the
/// call must still be waiting when the writer is let go (its record cannot be written
/// before); once it answers, its record is the last one. Returns that record.
async fn answers_once_its_record_is_written<T, F>(arb: &Arc<Arbiter>, call: F) -> AuditRecord
where
    F: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let before = records(arb).len();
    let (release, held) = std::sync::mpsc::channel::<()>();
    let (busy, is_busy) = tokio::sync::oneshot::channel::<()>();
    let a = arb.clone();
    let first = tokio::spawn(async move {
        a.changes()
            .run(move |_| {
                let _ = busy.send(());
                let _ = held.recv_timeout(Duration::from_secs(30));
                Ok(())
            })
            .await
    });
    is_busy.await.unwrap();
    let mut call = Box::pin(call);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), &mut call)
            .await
            .is_err(),
        "answered before its audit record was written"
    );
    assert_eq!(
        records(arb).len(),
        before,
        "nothing written while the writer is busy"
    );
    release.send(()).unwrap();
    first.await.unwrap().unwrap();
    call.await.unwrap();
    let after = records(arb);
    assert_eq!(
        after.len(),
        before + 1,
        "its record, read right after the answer"
    );
    after.last().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_calls_without_a_store_change_answer_once_their_audit_record_is_durable() {
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    arb.authenticator()
        .set_admin_file(&dir.path().join("admin.token"));
    let svc = AdminService::new(arb.clone());
    change_quota_for(
        &arb,
        "a".into(),
        QuotaUpdate::Replace(quota(64 * MIB)),
        Who::system("test"),
    )
    .await
    .unwrap();
    let (session, _events) = arb.open_session("a", "t", Peer::default()).unwrap();
    let lease = arb.acquire(req("a", session, 8 * MIB)).await.unwrap();

    let r = answers_once_its_record_is_written(
        &arb,
        svc.revoke_lease(tonic::Request::new(pb::RevokeLeaseRequest {
            lease_id: lease.id.to_string(),
            reason: "maintenance".into(),
        })),
    )
    .await;
    assert_eq!(
        (r.action.as_str(), r.tenant.as_str(), r.target.clone()),
        ("lease.revoke", "a", lease.id.to_string())
    );
    assert_eq!(r.after.unwrap()["reason"], "maintenance");

    let r = answers_once_its_record_is_written(
        &arb,
        svc.rotate_admin_token(tonic::Request::new(pb::RotateAdminTokenRequest {
            grace_ms: 1000,
        })),
    )
    .await;
    assert_eq!(
        (r.action.as_str(), r.target.as_str()),
        ("admin_token.rotate", crate::auth::ADMIN_FILE_TOKEN_ID)
    );
    assert_eq!(r.after.unwrap()["old_token_grace_ms"], 1000);

    let r = answers_once_its_record_is_written(
        &arb,
        svc.drain(tonic::Request::new(pb::DrainRequest {
            device: Some(0),
            deadline_ms: None,
            reason: "firmware".into(),
        })),
    )
    .await;
    assert_eq!((r.action.as_str(), r.target.as_str()), ("drain.start", "0"));
    assert_eq!(r.after.unwrap()["draining"], serde_json::json!([0]));

    let r = answers_once_its_record_is_written(
        &arb,
        svc.undrain(tonic::Request::new(pb::UndrainRequest { device: Some(0) })),
    )
    .await;
    assert_eq!((r.action.as_str(), r.target.as_str()), ("drain.stop", "0"));
    assert_eq!(r.before.unwrap()["draining"], serde_json::json!([0]));

    let r = answers_once_its_record_is_written(
        &arb,
        svc.set_device_health(tonic::Request::new(pb::SetDeviceHealthRequest {
            device: 0,
            healthy: false,
            reason: "bad fan".into(),
        })),
    )
    .await;
    assert_eq!(
        (r.action.as_str(), r.target.as_str()),
        ("device.health", "0")
    );
    assert_eq!(
        r.after.unwrap(),
        serde_json::json!({"healthy": false, "reason": "bad fan"})
    );
    let r = answers_once_its_record_is_written(
        &arb,
        svc.set_device_health(tonic::Request::new(pb::SetDeviceHealthRequest {
            device: 0,
            healthy: true,
            reason: String::new(),
        })),
    )
    .await;
    assert_eq!(r.after.unwrap(), serde_json::json!({"healthy": true}));

    // Durable: the store holds every record once the broker is gone.
    let written = records(&arb);
    assert_eq!(
        written
            .iter()
            .map(|r| r.action.as_str())
            .collect::<Vec<_>>(),
        [
            "quota.set",
            "lease.revoke",
            "admin_token.rotate",
            "drain.start",
            "drain.stop",
            "device.health",
            "device.health"
        ]
    );
    arb.lifecycle().join(Duration::from_secs(5)).await;
    drop(svc);
    drop(arb);
    assert_eq!(reopened(dir.path()).1, written);
}
