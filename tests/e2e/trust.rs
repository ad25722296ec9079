//! Token lifecycle and the audit log against a real broker: scopes (worker, read, admin),
//! expiry, names and last use in listings, admin token rotation without downtime, and
//! every operator change recorded durably with who made it.

use gpu_broker_client::{
    AdminClient, AuditFilter, Client, Code, QuotaSpec, TokenOptions, TokenScope,
};
use gpu_broker_tests::*;
use std::time::Duration;

fn opts(scope: TokenScope, name: &str) -> TokenOptions {
    TokenOptions {
        scope,
        name: name.into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scopes_grant_what_they_say_and_nothing_else() {
    let b = Broker::start().unwrap();
    let admin = b.admin().await.unwrap();
    admin.set_quota("alice", QuotaSpec::new(GIB)).await.unwrap();

    // A tenant-bound read token: its tenant's usage and leases, no session, no lease.
    let read = admin
        .issue_token_with(Some("alice"), &opts(TokenScope::Read, "dash"))
        .await
        .unwrap();
    assert_eq!(
        (read.scope, read.tenant.as_str()),
        (TokenScope::Read, "alice")
    );
    let rc = Client::connect(&b.uri(), read.token.clone()).await.unwrap();
    assert_eq!(rc.usage().await.unwrap().usage.held_bytes, 0);
    let e = rc.session("s").await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    assert!(e.message().contains("read token"), "{e}");
    let e = AdminClient::connect(&b.uri(), read.token.clone())
        .await
        .unwrap()
        .get_devices()
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");

    // A node-wide read token: the admin service's read calls, no changes.
    let node = admin
        .issue_token_with(None, &opts(TokenScope::Read, "prometheus"))
        .await
        .unwrap();
    assert_eq!(node.tenant, "");
    let ro = AdminClient::connect(&b.uri(), node.token.clone())
        .await
        .unwrap();
    assert_eq!(ro.get_devices().await.unwrap().len(), 1);
    assert_eq!(ro.list_tenants().await.unwrap().len(), 1);
    for e in [
        ro.set_quota("mallory", QuotaSpec::new(GIB))
            .await
            .unwrap_err(),
        ro.issue_token("alice", "x").await.unwrap_err(),
        ro.list_tokens(None).await.unwrap_err(),
        ro.delete_tenant("alice").await.unwrap_err(),
    ] {
        assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    }
    let e = Client::connect(&b.uri(), node.token.clone())
        .await
        .unwrap()
        .usage()
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");

    // A stored admin token works like the file token, until revoked.
    let adm = admin
        .issue_token_with(None, &opts(TokenScope::Admin, "ci"))
        .await
        .unwrap();
    let a2 = AdminClient::connect(&b.uri(), adm.token.clone())
        .await
        .unwrap();
    a2.set_quota("bob", QuotaSpec::new(GIB)).await.unwrap();
    // Worker tokens still cannot administer, admin tokens cannot work.
    let worker = a2.issue_token("bob", "w").await.unwrap();
    let e = AdminClient::connect(&b.uri(), worker.token.clone())
        .await
        .unwrap()
        .list_tenants()
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    let e = Client::connect(&b.uri(), adm.token.clone())
        .await
        .unwrap()
        .usage()
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    admin.revoke_token(&adm.token_id).await.unwrap();
    let e = a2.list_tenants().await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");

    // Bad combinations are refused precisely.
    for (tenant, scope) in [
        (None, TokenScope::Worker),
        (Some("alice"), TokenScope::Admin),
    ] {
        let e = admin
            .issue_token_with(tenant, &opts(scope, ""))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    }
    let e = admin
        .issue_token_with(Some("nobody"), &opts(TokenScope::Read, ""))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_tokens_are_refused_and_listings_show_lifecycle() {
    let mut b = Broker::start().unwrap();
    let admin = b.admin().await.unwrap();
    admin.set_quota("alice", QuotaSpec::new(GIB)).await.unwrap();
    let short = admin
        .issue_token_with(
            Some("alice"),
            &TokenOptions {
                ttl: Some(Duration::from_millis(600)),
                name: "short".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let expires = short.expires_unix_ms.expect("an expiry");
    let long = admin
        .issue_token_with(
            Some("alice"),
            &TokenOptions {
                ttl: Some(Duration::from_secs(3600)),
                name: "long".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let c = Client::connect(&b.uri(), short.token.clone())
        .await
        .unwrap();
    c.usage().await.unwrap();

    let listed = admin.list_tokens(Some("alice")).await.unwrap();
    let s = listed
        .iter()
        .find(|t| t.token_id == short.token_id)
        .unwrap();
    assert_eq!((s.name.as_str(), s.scope), ("short", TokenScope::Worker));
    assert_eq!(s.expires_unix_ms, Some(expires));
    assert!(s.last_used_unix_ms.is_some(), "{s:?}");
    let l = listed.iter().find(|t| t.token_id == long.token_id).unwrap();
    assert_eq!(l.last_used_unix_ms, None);

    // Past its ttl: UNAUTHENTICATED, and the message says expired.
    assert!(
        eventually(Duration::from_secs(10), || async {
            c.usage().await.is_err_and(|e| {
                e.code() == Code::Unauthenticated && e.message().contains("expired")
            })
        })
        .await,
        "{:?}",
        c.usage().await
    );
    // Its reason tells it from an unknown token, and names it.
    let e = c.usage().await.unwrap_err();
    assert_eq!(
        e.reason(),
        Some(&gpu_broker_client::error::Reason::TokenExpired),
        "{e}"
    );
    assert_eq!(e.detail("token_id"), Some(short.token_id.as_str()), "{e}");
    let at = expires.to_string();
    assert_eq!(e.detail("expired_at_ms"), Some(at.as_str()), "{e}");
    let e = Client::connect(&b.uri(), "gpb_0000000000000000")
        .await
        .unwrap()
        .usage()
        .await
        .unwrap_err();
    assert_eq!(
        e.reason(),
        Some(&gpu_broker_client::error::Reason::TokenUnknown),
        "{e}"
    );
    Client::connect(&b.uri(), long.token.clone())
        .await
        .unwrap()
        .usage()
        .await
        .unwrap();

    // Scope, name and expiry survive a restart.
    b.stop(Duration::from_secs(10)).unwrap();
    b.spawn().unwrap();
    let admin = b.admin().await.unwrap();
    let l = admin.list_tokens(Some("alice")).await.unwrap();
    let l = l.iter().find(|t| t.token_id == long.token_id).unwrap();
    assert_eq!(l.name, "long");
    assert_eq!(l.expires_unix_ms, long.expires_unix_ms);
    let e = Client::connect(&b.uri(), short.token.clone())
        .await
        .unwrap()
        .usage()
        .await
        .unwrap_err();
    assert!(e.message().contains("expired"), "{e}");
    let e = admin
        .issue_token_with(
            Some("alice"),
            &TokenOptions {
                ttl: Some(Duration::from_secs(100 * 365 * 86400)),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_token_rotates_without_downtime() {
    let b = Broker::start().unwrap();
    let old = b.admin_token.clone();
    let admin = b.admin().await.unwrap();
    let (new, until) = admin
        .rotate_admin_token(Duration::from_secs(60))
        .await
        .unwrap();
    assert_ne!(new, old);
    assert!(until > 0);
    // The file holds the new token; both work during the grace.
    let file = std::fs::read_to_string(b.state_dir.join("admin.token")).unwrap();
    assert_eq!(file.trim(), new);
    admin.list_tenants().await.unwrap();
    let fresh = AdminClient::connect(&b.uri(), new.clone()).await.unwrap();
    fresh.list_tenants().await.unwrap();
    // Rotating again with no grace: the previous token stops at once.
    let (newer, _) = fresh.rotate_admin_token(Duration::ZERO).await.unwrap();
    let e = fresh.list_tenants().await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    let e = admin.list_tenants().await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    AdminClient::connect(&b.uri(), newer)
        .await
        .unwrap()
        .list_tenants()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_changes_are_audited_durably_with_who() {
    let mut b = Broker::start().unwrap();
    let admin = b.admin().await.unwrap();
    admin.set_quota("alice", QuotaSpec::new(GIB)).await.unwrap();
    admin
        .set_quota("alice", QuotaSpec::new(2 * GIB))
        .await
        .unwrap();
    admin.set_quota("bob", QuotaSpec::new(GIB)).await.unwrap();
    let t = admin
        .issue_token_with(Some("alice"), &opts(TokenScope::Worker, "trainer"))
        .await
        .unwrap();
    let c = Client::connect(&b.uri(), t.token.clone()).await.unwrap();
    let s = c.session("s").await.unwrap();
    let lease = s.lease(2 * MIB).await.unwrap();
    admin.revoke_lease(lease.id(), "test").await.unwrap();
    admin.revoke_token(&t.token_id).await.unwrap();
    admin.delete_tenant("bob").await.unwrap();
    drop(lease);
    drop(s);

    let all = admin.list_audit(&AuditFilter::default()).await.unwrap();
    let actions: Vec<&str> = all.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(
        actions,
        [
            "quota.set",
            "quota.set",
            "quota.set",
            "token.issue",
            "lease.revoke",
            "token.revoke",
            "tenant.delete"
        ]
    );
    let me = unsafe { libc::getuid() };
    for e in &all {
        assert_eq!(e.token_id, "admin-file", "{e:?}");
        assert_eq!(e.scope, "admin");
        assert_eq!(e.peer_uid, Some(me), "{e:?}");
        assert!(e.peer_pid.is_some(), "{e:?}");
    }
    assert!(all.windows(2).all(|w| w[0].seq < w[1].seq));
    // Before and after of the quota change.
    assert!(all[0].before_json.is_empty());
    assert!(
        all[1].before_json.contains(&GIB.to_string()),
        "{:?}",
        all[1]
    );
    assert!(
        all[1].after_json.contains(&(2 * GIB).to_string()),
        "{:?}",
        all[1]
    );
    assert!(all[3].after_json.contains("trainer"), "{:?}", all[3]);
    assert_eq!((all[4].tenant.as_str(), all[4].target.len()), ("alice", 36));
    // Never the secret.
    assert!(all.iter().all(|e| !e.after_json.contains(&t.token)));
    // A structured log line too.
    assert!(b.log_text().contains("audit"), "no audit log line");

    // Filters: by tenant, since, newest N.
    let bob = admin
        .list_audit(&AuditFilter {
            tenant: Some("bob".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(bob.len(), 2);
    let last = admin
        .list_audit(&AuditFilter {
            limit: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(last[0].action, "tenant.delete");
    let since = admin
        .list_audit(&AuditFilter {
            since_unix_ms: Some(all[4].unix_ms),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(since.iter().all(|e| e.unix_ms >= all[4].unix_ms) && since.len() >= 3);

    // Durable: still there after a restart, numbering continues.
    b.stop(Duration::from_secs(10)).unwrap();
    b.spawn().unwrap();
    let admin = b.admin().await.unwrap();
    admin.set_quota("carol", QuotaSpec::new(GIB)).await.unwrap();
    let after = admin.list_audit(&AuditFilter::default()).await.unwrap();
    assert_eq!(after.len(), all.len() + 1);
    assert_eq!(after.last().unwrap().seq, all.last().unwrap().seq + 1);

    // A read token may list the audit log; a worker token may not.
    let ro = admin
        .issue_token_with(None, &opts(TokenScope::Read, "auditor"))
        .await
        .unwrap();
    let ro = AdminClient::connect(&b.uri(), ro.token).await.unwrap();
    assert!(!ro
        .list_audit(&AuditFilter::default())
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_rate_limited_with_a_retry_hint_and_one_cannot_starve_another() {
    let b = Broker::start_with(BrokerOpts {
        extra: vec![
            "--tenant-rpc-rate".into(),
            "2".into(),
            "--tenant-rpc-burst".into(),
            "5".into(),
        ],
        ..Default::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let busy = b.client("busy", GIB).await.unwrap();
    let calm = b.client("calm", GIB).await.unwrap();
    // Client::connect asked GetInfo once: that used one call of the burst.
    let mut ok = 1;
    let refused = loop {
        match busy.usage().await {
            Ok(_) => ok += 1,
            Err(e) => break e,
        }
        assert!(ok <= 10, "no limit after {ok} calls");
    };
    assert!((5..=6).contains(&ok), "{ok} calls before the limit");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused}");
    assert_eq!(
        refused.reason(),
        Some(&gpu_broker_client::error::Reason::RateLimited),
        "{refused}"
    );
    assert!(refused.detail("retry_after_ms").is_some(), "{refused}");
    assert!(
        refused.message().contains("rate limit") && refused.message().contains("retry in"),
        "{refused}"
    );
    // The standard gRPC retry hint.
    let raw = busy
        .raw()
        .get_usage(gpu_broker_proto::v1::GetUsageRequest {})
        .await
        .unwrap_err();
    let ms: u64 = raw
        .metadata()
        .get("grpc-retry-pushback-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("grpc-retry-pushback-ms");
    assert!(ms > 0 && ms <= 500, "{ms}");
    // Another tenant and the operator are not held back.
    for _ in 0..3 {
        calm.usage().await.unwrap();
    }
    for _ in 0..20 {
        admin.list_tenants().await.unwrap();
    }
    // After the hint, the busy tenant may call again.
    tokio::time::sleep(Duration::from_millis(ms + 50)).await;
    busy.usage().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_reports_its_version_and_api_revision() {
    let b = Broker::start().unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let i = c.broker_info().await.unwrap();
    assert_eq!(i.api_revision, gpu_broker_client::REQUIRED_API_REVISION);
    assert_eq!(i.version, env!("CARGO_PKG_VERSION"));
    assert_eq!((i.backend.as_str(), i.device_count), ("host", 1));
    for f in ["drain", "fd-leases", "process-groups", "paged-listings"] {
        assert!(i.features.iter().any(|g| g == f), "{f}: {:?}", i.features);
    }
    let admin = b.admin().await.unwrap();
    // Workers learn each device's UUID (to find their own CUDA ordinal for it).
    let uuids: Vec<String> = admin
        .get_devices()
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.uuid)
        .collect();
    assert_eq!(i.device_uuids, uuids);
    assert!(
        i.device_uuids[0].starts_with("HOST-"),
        "{:?}",
        i.device_uuids
    );
    assert_eq!(gpu_broker_client::version_warning(&Ok(i)), None);
    // A read token may ask too.
    let ro = admin
        .issue_token_with(None, &opts(TokenScope::Read, "info"))
        .await
        .unwrap();
    let ro = AdminClient::connect(&b.uri(), ro.token).await.unwrap();
    assert_eq!(ro.broker_info().await.unwrap().api_revision, 3);
    let out = b.ctl().args(["info"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        text.contains("API revision 3") && text.contains("features:"),
        "{text}"
    );
    assert!(
        out.stderr.is_empty(),
        "no warning against a current broker: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
