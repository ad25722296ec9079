//! Durable state: admin changes survive SIGKILL of the broker; a corrupt state file stops
//! start-up with a clear error and is left exactly as it was.

use super::*;
use gpu_broker_client::Client;

fn qs(
    limit_mib: u64,
    guaranteed_mib: u64,
    priority: i32,
    max_leases: u32,
    host_mib: u64,
) -> QuotaSpec {
    QuotaSpec {
        limit_bytes: limit_mib * MIB,
        max_leases,
        priority,
        guaranteed_bytes: guaranteed_mib * MIB,
        host_limit_bytes: host_mib * MIB,
        turn_weight: 0,
        device_limit_bytes: Default::default(),
    }
}

#[tokio::test]
async fn admin_changes_survive_sigkill_of_the_broker() {
    let mut b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    admin.set_quota("alpha", qs(64, 16, 2, 3, 8)).await.unwrap();
    admin.set_quota("beta", qs(32, 0, -1, 0, 0)).await.unwrap();
    admin.set_quota("gamma", qs(10, 0, 0, 0, 0)).await.unwrap();
    // Updates replace the whole quota.
    let alpha = qs(96, 32, 7, 0, 0);
    admin.set_quota("alpha", alpha.clone()).await.unwrap();
    let a1 = admin.issue_token("alpha", "one").await.unwrap();
    let a2 = admin.issue_token("alpha", "two").await.unwrap();
    let b1 = admin.issue_token("beta", "b").await.unwrap();
    let g1 = admin.issue_token("gamma", "g").await.unwrap();
    admin.revoke_token_id(&a2.token_id).await.unwrap();
    admin.delete_tenant("gamma").await.unwrap();
    let mut tenants_before: Vec<(String, QuotaSpec)> = admin
        .list_tenants()
        .await
        .unwrap()
        .into_iter()
        .map(|t| (t.name, t.quota))
        .collect();
    tenants_before.sort_by(|a, b| a.0.cmp(&b.0));
    let tokens_before = admin.list_tokens(None).await.unwrap();
    drop(admin);

    // SIGKILL right after the last RPC returned: each change was committed before it did.
    b.kill().unwrap();
    b.spawn().unwrap();

    let admin = b.admin().await.unwrap();
    let mut tenants_after: Vec<(String, QuotaSpec)> = admin
        .list_tenants()
        .await
        .unwrap()
        .into_iter()
        .map(|t| (t.name, t.quota))
        .collect();
    tenants_after.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(tenants_after, tenants_before);
    assert_eq!(
        tenants_after,
        vec![
            ("alpha".to_string(), alpha.clone()),
            ("beta".to_string(), qs(32, 0, -1, 0, 0))
        ]
    );
    assert_eq!(tenant(&admin, "alpha").await.quota, alpha, "quota exact");
    let gone = admin.get_quota("gamma").await;
    assert_eq!(code_of(&gone), Some(Code::NotFound), "{gone:?}");
    assert_eq!(admin.list_tokens(None).await.unwrap(), tokens_before);
    let ids: Vec<String> = tokens_before.iter().map(|t| t.token_id.clone()).collect();
    assert!(ids.contains(&a1.token_id) && ids.contains(&b1.token_id));
    assert!(!ids.contains(&a2.token_id) && !ids.contains(&g1.token_id));

    // Issued tokens work...
    for (token, name) in [(&a1.token, "alpha"), (&b1.token, "beta")] {
        let c = Client::connect(&b.uri(), token.clone()).await.unwrap();
        let u = c.usage().await.unwrap();
        assert_eq!(u.tenant, name);
        let s = c.session("after-restart").await.unwrap();
        let l = s.lease(3 * MIB).await.unwrap();
        assert_eq!(l.bytes(), 4 * MIB);
        l.release().await.unwrap();
        s.close();
    }
    // ...the revoked one and the deleted tenant's do not.
    for token in [&a2.token, &g1.token] {
        let c = Client::connect(&b.uri(), token.clone()).await.unwrap();
        let r = c.usage().await;
        assert_eq!(code_of(&r), Some(Code::Unauthenticated), "{r:?}");
    }
    // And the restarted broker keeps committing.
    admin.set_quota("delta", qs(4, 0, 0, 0, 0)).await.unwrap();
    b.kill().unwrap();
    b.spawn().unwrap();
    let admin = b.admin().await.unwrap();
    assert_eq!(tenant(&admin, "delta").await.quota, qs(4, 0, 0, 0, 0));
    assert_eq!(tenant(&admin, "alpha").await.quota, alpha);
    assert_broker_alive(&b);
}

fn garbage(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

#[tokio::test]
async fn corrupt_state_file_refuses_start_and_is_left_untouched() {
    let mut b = Broker::start().unwrap();
    b.admin()
        .await
        .unwrap()
        .set_quota("alpha", qs(64, 0, 1, 0, 0))
        .await
        .unwrap();
    let status = b.stop(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status}");
    let path = b.state_dir.join("state.redb");
    let good = std::fs::read(&path).unwrap();
    assert!(!good.is_empty());

    let files = |dir: &std::path::Path| {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .collect();
        v.sort();
        v
    };
    let files_before = files(&b.state_dir);
    let half = good[..good.len() / 2].to_vec();
    for (what, bad) in [("garbage", garbage(64 * 1024)), ("truncated", half)] {
        std::fs::write(&path, &bad).unwrap();
        let log_len = b.log_text().len();
        let t0 = Instant::now();
        let err = b
            .spawn()
            .expect_err("a corrupt state file must stop start-up");
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{what}: took {:?} to fail",
            t0.elapsed()
        );
        let msg = format!("{err:#}");
        assert!(msg.contains("exited early"), "{what}: {msg}");
        let log = b.log_text()[log_len..].to_string();
        assert!(
            log.contains("state.redb") && log.to_lowercase().contains("corrupt"),
            "{what}: the log should name the file and say it is corrupt:\n{log}"
        );
        assert!(!log.contains("panicked"), "{what}: broker panicked:\n{log}");
        assert_eq!(
            std::fs::read(&path).unwrap(),
            bad,
            "{what}: the state file was modified"
        );
        assert_eq!(
            files(&b.state_dir),
            files_before,
            "{what}: files of the state dir changed"
        );
    }

    // Put the good file back: the broker starts with its state.
    std::fs::write(&path, &good).unwrap();
    b.spawn().unwrap();
    let admin = b.admin().await.unwrap();
    assert_eq!(tenant(&admin, "alpha").await.quota, qs(64, 0, 1, 0, 0));
}
