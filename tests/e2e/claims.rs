//! Kubernetes claims at the broker as its tonic clients see them: a node-wide read token
//! lists them (and changes none); a claim's token that reaches beyond its claim is refused
//! with a reason of its own (a process reservation, a lease while the broker holds no
//! reservation for the claim), as is an operator's token named like a claim's.

use gpu_broker_client::error::Reason;
use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::{
    AdminClient, Client, ClientError, Code, QuotaSpec, TokenOptions, TokenScope,
};
use gpu_broker_tests::*;

const MIB: u64 = 1 << 20;

fn reserve(claim: &str, bytes: u64) -> pb::ReserveClaimRequest {
    pb::ReserveClaimRequest {
        claim: claim.into(),
        tenant: "t".into(),
        bytes,
        device: 0,
        label: "ns/c".into(),
    }
}

/// The refusal's code, reason and `claim` detail.
fn refusal(e: &ClientError) -> (Code, Option<Reason>, Option<String>) {
    (
        e.code(),
        e.reason().cloned(),
        e.detail("claim").map(str::to_string),
    )
}

#[tokio::test]
async fn a_read_token_lists_claims_and_changes_none() {
    let b = Broker::start().unwrap();
    let admin = b.admin().await.unwrap();
    admin
        .set_quota("t", QuotaSpec::new(128 * MIB))
        .await
        .unwrap();
    let got = admin
        .raw()
        .reserve_claim(reserve("uid-1", 32 * MIB))
        .await
        .unwrap()
        .into_inner();
    let read = admin
        .issue_token_with(
            None,
            &TokenOptions {
                scope: TokenScope::Read,
                name: "prometheus".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap()
        .token;
    let reader = AdminClient::connect(&b.uri(), read).await.unwrap();
    let listed = reader
        .raw()
        .list_claims(pb::ListClaimsRequest {})
        .await
        .unwrap()
        .into_inner()
        .claims;
    let reservation = got.reservation.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (
            listed[0].claim.as_str(),
            &listed[0].reservation_id,
            listed[0].bytes
        ),
        ("uid-1", &reservation.reservation_id, 32 * MIB)
    );
    // Reading is all it may do.
    for e in [
        reader
            .raw()
            .reserve_claim(reserve("uid-2", MIB))
            .await
            .unwrap_err(),
        reader
            .raw()
            .release_claim(pb::ReleaseClaimRequest {
                claim: "uid-1".into(),
            })
            .await
            .unwrap_err(),
    ] {
        let e = ClientError::from(e);
        assert_eq!(
            (e.code(), e.reason()),
            (Code::PermissionDenied, Some(&Reason::ScopeDenied)),
            "{e}"
        );
    }
    assert_eq!(
        admin
            .raw()
            .list_claims(pb::ListClaimsRequest {})
            .await
            .unwrap()
            .into_inner()
            .claims
            .len(),
        1
    );
}

#[tokio::test]
async fn a_claims_token_beyond_its_claim_is_refused_with_a_reason() {
    let mut b = Broker::start().unwrap();
    let admin = b.admin().await.unwrap();
    admin
        .set_quota("t", QuotaSpec::new(128 * MIB))
        .await
        .unwrap();
    let got = admin
        .raw()
        .reserve_claim(reserve("uid-1", 64 * MIB))
        .await
        .unwrap()
        .into_inner();
    // An operator's token cannot take a claim's name.
    let e = admin
        .issue_token_with(
            Some("t"),
            &TokenOptions {
                name: "claim/uid-1".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.reason(), e.detail("prefix")),
        (
            Code::InvalidArgument,
            Some(&Reason::TokenNameReserved),
            Some("claim/")
        ),
        "{e}"
    );
    // The claim's token reserves no process.
    let worker = Client::connect(&b.uri(), got.token.clone()).await.unwrap();
    let session = worker.session("pod").await.unwrap();
    let e = gpu_broker_client::ReservationRequest::new(&session, 8 * MIB)
        .send()
        .await
        .unwrap_err();
    assert_eq!(
        refusal(&e),
        (
            Code::FailedPrecondition,
            Some(Reason::ClaimTokenCannotReserve),
            Some("uid-1".into())
        ),
        "{e}"
    );
    drop(session);
    drop(worker);
    // The quota lowered under the claim, the broker restarted: the claim is not taken
    // again, its token still authenticates, and its leases are refused until its driver
    // reserves it again.
    admin
        .set_quota("t", QuotaSpec::new(32 * MIB))
        .await
        .unwrap();
    b.kill().unwrap();
    b.spawn().unwrap();
    let admin = b.admin().await.unwrap();
    assert!(admin
        .raw()
        .list_claims(pb::ListClaimsRequest {})
        .await
        .unwrap()
        .into_inner()
        .claims
        .is_empty());
    let worker = Client::connect(&b.uri(), got.token).await.unwrap();
    let session = worker.session("pod").await.unwrap();
    let e = session.lease(MIB).await.unwrap_err();
    assert_eq!(
        refusal(&e),
        (
            Code::FailedPrecondition,
            Some(Reason::ClaimNotReserved),
            Some("uid-1".into())
        ),
        "{e}"
    );
}
