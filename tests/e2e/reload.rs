//! Declarative tenants: `[tenants.NAME]` tables of the config file applied at start, after
//! a Kubernetes-style symlink swap of the file, and on SIGHUP; declared fields win over
//! admin changes, undeclared ones keep them; an invalid file is refused with file and line
//! while the running state stays; `gpu-broker check-config` prints the diff.

use gpu_broker_client::QuotaPatch;
use gpu_broker_tests::*;
use std::os::unix::fs::symlink;
use std::path::Path;
use std::time::Duration;

/// A ConfigMap-like layout: `config.toml -> ..data/config.toml`, `..data -> gen-N`.
fn publish(dir: &Path, generation: u32, text: &str) {
    publish_with(dir, generation, |f| std::fs::write(f, text).unwrap());
}

/// [`publish`] with `config.toml` of generation `generation` made by `make`.
fn publish_with(dir: &Path, generation: u32, make: impl FnOnce(&Path)) {
    let gen = dir.join(format!("gen-{generation}"));
    std::fs::create_dir_all(&gen).unwrap();
    make(&gen.join("config.toml"));
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    symlink(format!("gen-{generation}"), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    if !dir.join("config.toml").exists() {
        symlink("..data/config.toml", dir.join("config.toml")).unwrap();
    }
}

async fn limit_of(b: &Broker, tenant: &str) -> Option<u64> {
    let admin = b.admin().await.ok()?;
    admin
        .get_quota(tenant)
        .await
        .ok()
        .map(|t| t.quota.limit_bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_tenants_apply_at_start_on_change_and_on_sighup() {
    let cm = tempfile::tempdir().unwrap();
    publish(
        cm.path(),
        1,
        "[tenants.alpha]\nlimit = \"64MiB\"\npriority = 2\n",
    );
    let file = cm.path().join("config.toml");
    let b = Broker::start_with(BrokerOpts {
        extra: vec!["--config".into(), file.display().to_string()],
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let alpha = admin.get_quota("alpha").await.unwrap();
    assert_eq!(alpha.quota.limit_bytes, 64 * MIB);
    assert_eq!(alpha.quota.priority, 2);

    // An operator changes a declared field (priority) and an undeclared one (max-leases).
    admin
        .patch_quota(
            "alpha",
            QuotaPatch {
                priority: Some(9),
                max_leases: Some(5),
                ..QuotaPatch::default()
            },
        )
        .await
        .unwrap();

    // The ConfigMap is updated: a symlink swap, as the kubelet does it.
    publish(
        cm.path(),
        2,
        "[tenants.alpha]\nlimit = \"128MiB\"\npriority = 2\n\n[tenants.beta]\nlimit = \"32MiB\"\n",
    );
    let b_ref = &b;
    assert!(
        eventually(Duration::from_secs(15), || async move {
            limit_of(b_ref, "alpha").await == Some(128 * MIB)
                && limit_of(b_ref, "beta").await == Some(32 * MIB)
        })
        .await,
        "the swapped file was not applied:\n{}",
        b.log_text()
    );
    let alpha = admin.get_quota("alpha").await.unwrap();
    assert_eq!(
        alpha.quota.priority, 2,
        "the file wins for what it declares"
    );
    assert_eq!(alpha.quota.max_leases, 5, "what it does not declare stays");
    assert_eq!(limit_of(&b, "beta").await, Some(32 * MIB));

    // An invalid file: refused with file and line, nothing changes.
    publish(
        cm.path(),
        3,
        "[tenants.alpha]\nlimit = \"lots\"\n[tenants.beta]\nlimit = \"1GiB\"\n",
    );
    assert!(
        eventually(Duration::from_secs(15), || async move {
            b_ref.log_text().contains("config not reloaded")
        })
        .await,
        "{}",
        b.log_text()
    );
    let log = b.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("config not reloaded"))
        .unwrap();
    assert!(
        line.contains("config.toml:2:") && line.contains("invalid size"),
        "{line}"
    );
    assert_eq!(limit_of(&b, "alpha").await, Some(128 * MIB));
    assert_eq!(limit_of(&b, "beta").await, Some(32 * MIB));

    // check-config shows what the next file would change, and refuses a bad one.
    let next = cm.path().join("next.toml");
    std::fs::write(
        &next,
        "[tenants.alpha]\nlimit = \"512MiB\"\npriority = 2\n[tenants.gamma]\nlimit = \"8MiB\"\n",
    )
    .unwrap();
    let check = |f: &Path| {
        std::process::Command::new(bin("gpu-broker"))
            .arg("check-config")
            .arg(f)
            .args(["--broker", &b.uri()])
            .arg("--token-file")
            .arg(b.state_dir.join("admin.token"))
            .output()
            .unwrap()
    };
    let out = check(&next);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("~ alpha: limit 128.0 MiB -> 512.0 MiB"),
        "{text}"
    );
    assert!(
        text.contains("+ gamma: new tenant: limit 8.0 MiB"),
        "{text}"
    );
    assert!(
        text.contains("not declared (kept as they are): beta"),
        "{text}"
    );
    let bad = cm.path().join("gen-3/config.toml");
    let out = check(&bad);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("config.toml:2:") && err.contains("invalid size"),
        "{err}"
    );

    // SIGHUP reloads (here the valid file again).
    publish(cm.path(), 4, "[tenants.alpha]\nlimit = \"256MiB\"\n");
    b.signal(libc::SIGHUP);
    assert!(
        eventually(Duration::from_secs(15), || async move {
            limit_of(b_ref, "alpha").await == Some(256 * MIB)
        })
        .await,
        "{}",
        b.log_text()
    );
    b.signal(libc::SIGHUP);
    assert!(
        eventually(Duration::from_secs(10), || async move {
            b_ref
                .log_text()
                .lines()
                .any(|l| l.contains("config reloaded") && l.contains("SIGHUP"))
        })
        .await,
        "{}",
        b.log_text()
    );
    assert!(b.pid().is_some(), "SIGHUP does not stop the broker");
    assert_eq!(limit_of(&b, "alpha").await, Some(256 * MIB));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_without_a_config_file_keeps_the_broker_running() {
    let mut b = Broker::start().unwrap();
    b.signal(libc::SIGHUP);
    let b_ref = &b;
    assert!(
        eventually(Duration::from_secs(10), || async move {
            b_ref.log_text().contains("nothing to reload")
        })
        .await,
        "{}",
        b.log_text()
    );
    b.signal(libc::SIGHUP);
    let admin = b.admin().await.unwrap();
    admin.list_tenants().await.unwrap();
    let status = b.stop(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status:?}\n{}", b.log_text());
}

/// The tenants a config file declares are there the moment the broker answers (applied
/// on the store writer before the sockets are bound), each with its `config.reload`
/// record by the broker itself; after a restart with fewer declared, none is deleted and
/// the unchanged ones are not written again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_tenants_are_listed_at_once_and_kept_across_a_restart() {
    let cm = tempfile::tempdir().unwrap();
    let file = cm.path().join("config.toml");
    std::fs::write(
        &file,
        "[tenants.alpha]\nlimit = \"64MiB\"\npriority = 2\n\n[tenants.beta]\nlimit = \"32MiB\"\nmax-leases = 4\n\n[tenants.gamma]\nlimit = \"16MiB\"\n",
    )
    .unwrap();
    let mut b = Broker::start_with(BrokerOpts {
        extra: vec!["--config".into(), file.display().to_string()],
        ..BrokerOpts::default()
    })
    .unwrap();
    // No wait, no retry: listed by the first call.
    let admin = b.admin().await.unwrap();
    let listed = admin.list_tenants().await.unwrap();
    let quotas: Vec<(String, u64, i32, u32)> = listed
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.quota.limit_bytes,
                t.quota.priority,
                t.quota.max_leases,
            )
        })
        .collect();
    assert_eq!(
        quotas,
        [
            ("alpha".to_string(), 64 * MIB, 2, 0),
            ("beta".to_string(), 32 * MIB, 0, 4),
            ("gamma".to_string(), 16 * MIB, 0, 0),
        ]
    );
    let audit = admin
        .list_audit(&gpu_broker_client::AuditFilter::default())
        .await
        .unwrap();
    let records: Vec<(&str, &str, &str, &str)> = audit
        .iter()
        .map(|e| {
            (
                e.action.as_str(),
                e.tenant.as_str(),
                e.token_id.as_str(),
                e.token_name.as_str(),
            )
        })
        .collect();
    assert_eq!(
        records,
        [
            ("config.reload", "alpha", "system", "start"),
            ("config.reload", "beta", "system", "start"),
            ("config.reload", "gamma", "system", "start"),
        ]
    );
    drop(admin);

    // Restarted with gamma no longer declared and the others as they were.
    b.stop(Duration::from_secs(10)).unwrap();
    std::fs::write(
        &file,
        "[tenants.alpha]\nlimit = \"64MiB\"\npriority = 2\n\n[tenants.beta]\nlimit = \"32MiB\"\nmax-leases = 4\n",
    )
    .unwrap();
    b.spawn().unwrap();
    let admin = b.admin().await.unwrap();
    assert_eq!(tenant_names(&admin).await, ["alpha", "beta", "gamma"]);
    assert_eq!(
        admin.get_quota("gamma").await.unwrap().quota.limit_bytes,
        16 * MIB,
        "no longer declared: kept as it was"
    );
    let again = admin
        .list_audit(&gpu_broker_client::AuditFilter::default())
        .await
        .unwrap();
    assert_eq!(
        again.len(),
        3,
        "nothing changed, nothing written: {again:?}"
    );
}

/// Resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// The config file swapped for a FIFO (no writer), a symlink to `/dev/zero` or a sparse
/// file of 10 GiB is refused with a logged reason, without being waited on or read: the
/// broker keeps serving workers and operators, its memory stays small, and the next valid
/// file applies again (the running state stayed meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_file_swapped_for_a_fifo_a_device_or_a_huge_file_is_refused() {
    let cm = tempfile::tempdir().unwrap();
    publish(cm.path(), 1, "[tenants.alpha]\nlimit = \"64MiB\"\n");
    let file = cm.path().join("config.toml");
    let b = Broker::start_with(BrokerOpts {
        extra: vec!["--config".into(), file.display().to_string()],
        ..BrokerOpts::default()
    })
    .unwrap();
    let pid = b.pid().unwrap();
    let token = b
        .tenant("w", gpu_broker_client::QuotaSpec::new(8 * MIB))
        .await
        .unwrap();
    let client = gpu_broker_client::Client::connect(&b.uri(), token)
        .await
        .unwrap();
    let mkfifo = |f: &Path| {
        let c = std::ffi::CString::new(f.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid, NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    };
    let zero = |f: &Path| symlink("/dev/zero", f).unwrap();
    let huge = |f: &Path| {
        std::fs::File::create(f).unwrap().set_len(10 << 30).unwrap();
    };
    type Make<'a> = &'a dyn Fn(&Path);
    let cases: [(&str, Make); 3] = [
        ("a FIFO, not a regular file", &mkfifo),
        ("a character device, not a regular file", &zero),
        ("larger than 1048576 bytes", &huge),
    ];
    for (n, (why, make)) in cases.into_iter().enumerate() {
        publish_with(cm.path(), n as u32 + 2, make);
        let b_ref = &b;
        assert!(
            eventually(Duration::from_secs(15), || async move {
                b_ref
                    .log_text()
                    .lines()
                    .any(|l| l.contains("config not reloaded") && l.contains(why))
            })
            .await,
            "no refusal ({why}) logged:\n{}",
            b.log_text()
        );
        // Workers (the main runtime) and operators are still served.
        let served = tokio::time::timeout(Duration::from_secs(10), async {
            let s = client.session(format!("after-{n}")).await.unwrap();
            s.lease(MIB).await.unwrap().release().await.unwrap();
            b.admin().await.unwrap().list_tenants().await.unwrap();
        })
        .await;
        assert!(served.is_ok(), "the broker stopped serving after {why}");
        assert!(rss(pid) < 512 * MIB, "broker RSS {} after {why}", rss(pid));
        assert_eq!(limit_of(&b, "alpha").await, Some(64 * MIB), "{why}");
    }
    publish(cm.path(), 9, "[tenants.alpha]\nlimit = \"128MiB\"\n");
    let b_ref = &b;
    assert!(
        eventually(Duration::from_secs(15), || async move {
            limit_of(b_ref, "alpha").await == Some(128 * MIB)
        })
        .await,
        "{}",
        b.log_text()
    );
    // Each refusal was logged once, not at every poll.
    let refusals = b
        .log_text()
        .lines()
        .filter(|l| l.contains("config not reloaded"))
        .count();
    assert_eq!(refusals, 3, "{}", b.log_text());
}
