//! `gpu-brokerctl` against a real broker: human units in and out, aligned tables,
//! `--json` for scripts, one-line errors.

use futures::StreamExt;
use gpu_broker_client::{Client, Code, SessionEvent};
use gpu_broker_tests::*;
use serde_json::Value;
use std::time::Duration;

struct Out {
    ok: bool,
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

async fn ctl(b: &Broker, args: &[&str]) -> Out {
    let mut cmd = tokio::process::Command::from(b.ctl());
    cmd.args(args).kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(20), cmd.output())
        .await
        .expect("gpu-brokerctl finished")
        .expect("gpu-brokerctl ran");
    Out {
        ok: out.status.success(),
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn ok(b: &Broker, args: &[&str]) -> String {
    let o = ctl(b, args).await;
    assert!(o.ok, "{args:?} failed:\n{}\n{}", o.stdout, o.stderr);
    o.stdout
}

async fn json(b: &Broker, args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.push("--json");
    let text = ok(b, &a).await;
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?} --json: {e}\n{text}"))
}

/// The row of a table whose first column is `key`, and the table's header.
fn row<'a>(table: &'a str, key: &str) -> (&'a str, &'a str) {
    let header = table.lines().next().expect("a header line");
    let row = table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(key))
        .unwrap_or_else(|| panic!("no row {key:?} in\n{table}"));
    (header, row)
}

/// Right-aligned column: `value` ends where the header's `column` ends.
fn assert_right_aligned(table: &str, key: &str, column: &str, value: &str) {
    let (header, row) = row(table, key);
    let end = header
        .find(column)
        .unwrap_or_else(|| panic!("{column} in {header}"))
        + column.len();
    assert!(
        row.len() >= end && row[..end].ends_with(value),
        "{column} of {key} should be {value:?}, right-aligned:\n{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokerctl_drives_a_real_broker() {
    let b = Broker::start().unwrap();

    // quota set with human units; the reply is a table in binary units.
    let out = ok(
        &b,
        &[
            "quota",
            "set",
            "team-a",
            "--limit",
            "64MiB",
            "--max-leases",
            "4",
            "--priority",
            "-1",
        ],
    )
    .await;
    assert_right_aligned(&out, "team-a", "LIMIT", "64.0 MiB");
    ok(&b, &["quota", "set", "team-b", "--limit", "1.5GiB"]).await;
    let q = json(&b, &["quota", "get", "team-a"]).await;
    assert_eq!(q["name"], "team-a");
    assert_eq!(q["quota"]["limit_bytes"], 64 * MIB);
    assert_eq!(q["quota"]["max_leases"], 4);
    assert_eq!(q["quota"]["priority"], -1);
    let q = json(&b, &["quota", "get", "team-b"]).await;
    assert_eq!(q["quota"]["limit_bytes"], 3 * GIB / 2);

    // tokens issue prints the token alone, and it works.
    let o = ctl(&b, &["tokens", "issue", "team-a", "--description", "cli"]).await;
    assert!(o.ok, "{}", o.stderr);
    let token = o.stdout.trim().to_string();
    assert_eq!(o.stdout.lines().count(), 1, "{}", o.stdout);
    assert!(o.stderr.contains("shown only once"), "{}", o.stderr);
    let c = Client::connect(&b.uri(), token.clone()).await.unwrap();
    let s = c.session("cli-session").await.unwrap();
    let mut events = s.events();
    let lease = s
        .lease_request(3 * MIB)
        .label("from-cli-test")
        .send()
        .await
        .unwrap();
    let issued = json(&b, &["tokens", "issue", "team-b"]).await;
    assert!(issued["token"].as_str().unwrap().len() > 16);
    assert_eq!(issued["tenant"], "team-b");
    let tokens = json(&b, &["tokens", "list"]).await;
    let tokens = tokens.as_array().unwrap();
    assert_eq!(tokens.len(), 2);
    assert!(
        !tokens.iter().any(|t| t.to_string().contains(&token)),
        "no secrets"
    );

    // tenants list with live usage.
    let table = ok(&b, &["tenants", "list"]).await;
    assert_right_aligned(&table, "team-a", "HELD", "4.0 MiB");
    assert_right_aligned(&table, "team-a", "LEASES", "1");
    assert_right_aligned(&table, "team-b", "LIMIT", "1.5 GiB");
    let tenants = json(&b, &["tenants", "list"]).await;
    let a = tenants
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "team-a")
        .unwrap();
    assert_eq!(a["usage"]["held_bytes"], 4 * MIB);
    assert_eq!(a["usage"]["session_count"], 1);

    // leases list.
    let table = ok(&b, &["leases", "list", "--wide"]).await;
    assert_right_aligned(&table, lease.id(), "SIZE", "4.0 MiB");
    assert_right_aligned(&table, lease.id(), "REQUESTED", "3.0 MiB");
    let (_, r) = row(&table, lease.id());
    assert!(
        r.contains("team-a") && r.contains("from-cli-test") && r.contains("active"),
        "{r}"
    );
    let leases = json(&b, &["leases", "list", "--tenant", "team-a"]).await;
    assert_eq!(leases.as_array().unwrap().len(), 1);
    assert_eq!(leases[0]["lease_id"], lease.id());
    assert_eq!(leases[0]["bytes"], 4 * MIB);
    assert_eq!(leases[0]["handle"]["fd"]["memory_kind"], "host_memfd");
    assert!(
        leases[0]["handle"]["fd"].get("ticket").is_none(),
        "no ticket in listings"
    );
    let none = json(&b, &["leases", "list", "--tenant", "team-b"]).await;
    assert_eq!(none, Value::Array(vec![]));

    // sessions list shows this process's pid.
    let table = ok(&b, &["sessions", "list", "--wide"]).await;
    let (_, r) = row(&table, &s.id());
    assert!(r.contains(&std::process::id().to_string()), "{r}");
    assert!(r.contains("cli-session") && r.contains("unix"), "{r}");
    let sessions = json(&b, &["sessions", "list", "--tenant", "team-a"]).await;
    assert_eq!(sessions[0]["peer_pid"], std::process::id());

    // devices.
    let table = ok(&b, &["devices", "--wide"]).await;
    assert_right_aligned(&table, "0", "TOTAL", "1.0 GiB");
    assert_right_aligned(&table, "0", "LEASED", "4.0 MiB");
    assert_right_aligned(&table, "0", "GRANULARITY", "2.0 MiB");
    assert!(table.contains("host-sim-0"), "{table}");
    let table = ok(&b, &["devices"]).await;
    assert_right_aligned(&table, "0", "LEASED", "4.0 MiB");
    let devices = json(&b, &["devices"]).await;
    assert_eq!(devices[0]["total_bytes"], GIB);
    assert_eq!(devices[0]["leased_bytes"], 4 * MIB);
    assert_eq!(devices[0]["backend"], "host");

    // leases revoke: the holder is told.
    let out = ok(
        &b,
        &["leases", "revoke", lease.id(), "--reason", "cli test"],
    )
    .await;
    assert!(out.contains(lease.id()), "{out}");
    let ev = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .unwrap();
    assert!(
        matches!(&ev, Some(SessionEvent::LeaseRevoked { lease_id, reason })
            if lease_id == lease.id() && reason == "cli test"),
        "{ev:?}"
    );
    let _ = lease.detach();

    // Errors: one line, the code first, non-zero exit.
    let o = ctl(&b, &["tenants", "delete", "team-a"]).await;
    assert!(!o.ok);
    assert!(
        o.stderr.starts_with("error: FAILED_PRECONDITION"),
        "{}",
        o.stderr
    );
    assert_eq!(o.stderr.trim_end().lines().count(), 1, "{}", o.stderr);
    let o = ctl(&b, &["quota", "get", "nobody"]).await;
    assert!(!o.ok);
    assert!(o.stderr.starts_with("error: NOT_FOUND"), "{}", o.stderr);
    let o = ctl(&b, &["quota", "set", "x", "--limit", "lots"]).await;
    assert!(
        !o.ok && o.code == Some(2),
        "usage error: {:?} {}",
        o.code,
        o.stderr
    );
    let o = ctl(&b, &["--token", "wrong", "tenants", "list"]).await;
    assert!(
        o.stderr.starts_with("error: UNAUTHENTICATED"),
        "{}",
        o.stderr
    );
    let o = ctl(&b, &["--token", &token, "tenants", "list"]).await;
    assert!(
        o.stderr.starts_with("error: PERMISSION_DENIED"),
        "{}",
        o.stderr
    );

    // tokens revoke (by the token itself): it stops working.
    ok(&b, &["tokens", "revoke", &token]).await;
    assert_eq!(c.usage().await.unwrap_err().code(), Code::Unauthenticated);

    // tenants delete of a tenant holding nothing.
    let out = ok(&b, &["tenants", "delete", "team-b"]).await;
    assert!(out.contains("team-b"), "{out}");
    let tenants = json(&b, &["tenants", "list"]).await;
    assert_eq!(tenants.as_array().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_set_changes_only_what_is_given_and_warns_below_usage() {
    let b = Broker::start().unwrap();
    ok(
        &b,
        &[
            "quota",
            "set",
            "t",
            "--limit",
            "64MiB",
            "--max-leases",
            "8",
            "--priority",
            "3",
            "--guaranteed",
            "16MiB",
            "--turn-weight",
            "2",
        ],
    )
    .await;
    // Only --limit given: priority, guarantee, max-leases and turn weight stay.
    ok(&b, &["quota", "set", "t", "--limit", "128MiB"]).await;
    let q = json(&b, &["quota", "get", "t"]).await;
    assert_eq!(q["quota"]["limit_bytes"], 128 * MIB);
    assert_eq!(q["quota"]["max_leases"], 8);
    assert_eq!(q["quota"]["priority"], 3);
    assert_eq!(q["quota"]["guaranteed_bytes"], 16 * MIB);
    assert_eq!(q["quota"]["turn_weight"], 2);
    ok(&b, &["quota", "set", "t", "--priority", "-2"]).await;
    let q = json(&b, &["quota", "get", "t"]).await;
    assert_eq!(q["quota"]["limit_bytes"], 128 * MIB);
    assert_eq!(q["quota"]["priority"], -2);

    // A new tenant needs a limit; an empty change is refused before any call.
    let o = ctl(&b, &["quota", "set", "fresh", "--priority", "1"]).await;
    assert!(
        !o.ok && o.stderr.contains("INVALID_ARGUMENT") && o.stderr.contains("limit"),
        "{}",
        o.stderr
    );
    let o = ctl(&b, &["quota", "set", "t"]).await;
    assert!(
        !o.ok && o.stderr.contains("nothing to change"),
        "{}",
        o.stderr
    );

    // A limit below what the tenant holds: accepted, with a warning saying the leases stay.
    let token = b
        .admin()
        .await
        .unwrap()
        .issue_token("t", "w")
        .await
        .unwrap()
        .token;
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("w").await.unwrap();
    let lease = s.lease(32 * MIB).await.unwrap();
    let o = ctl(
        &b,
        &["quota", "set", "t", "--limit", "16MiB", "--guaranteed", "0"],
    )
    .await;
    assert!(o.ok, "{}", o.stderr);
    assert!(
        o.stderr.contains("warning:")
            && o.stderr.contains("32.0 MiB")
            && o.stderr.contains("leases stay"),
        "{}",
        o.stderr
    );
    assert_eq!(
        c.usage().await.unwrap().usage.held_bytes,
        32 * MIB,
        "nothing was revoked"
    );
    let refused = s.lease(2 * MIB).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    let o = ctl(&b, &["quota", "set", "t", "--limit", "64MiB"]).await;
    assert!(o.ok && !o.stderr.contains("warning"), "{}", o.stderr);
    lease.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sizes_need_their_unit_and_decimal_ones_are_explained() {
    let b = Broker::start().unwrap();
    let o = ctl(&b, &["quota", "set", "u", "--limit", "4096"]).await;
    assert!(
        !o.ok && o.stderr.contains("has no unit") && o.stderr.contains("4096B"),
        "a bare number is refused with a hint: {}",
        o.stderr
    );
    let o = ctl(&b, &["quota", "set", "u", "--limit", "4GB"]).await;
    assert!(o.ok, "{}", o.stderr);
    assert!(
        o.stderr
            .contains("4GB is a decimal size: 4000000000 bytes (3.7 GiB)"),
        "a decimal size says what it is: {}",
        o.stderr
    );
    let quota = b.admin().await.unwrap().get_quota("u").await.unwrap();
    assert_eq!(quota.quota.limit_bytes, 4_000_000_000);
    let o = ctl(&b, &["quota", "set", "u", "--limit", "4GiB"]).await;
    assert!(o.ok && !o.stderr.contains("note:"), "{}", o.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_go_to_private_files_and_unknown_tenants_are_errors() {
    use std::os::unix::fs::PermissionsExt;
    let b = Broker::start().unwrap();
    ok(&b, &["quota", "set", "t", "--limit", "64MiB"]).await;
    let path = b.dir.path().join("t.token");
    let o = ctl(
        &b,
        &["tokens", "issue", "t", "--output", path.to_str().unwrap()],
    )
    .await;
    assert!(o.ok, "{}", o.stderr);
    assert!(
        o.stdout.is_empty(),
        "the token is not printed: {}",
        o.stdout
    );
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let token = std::fs::read_to_string(&path).unwrap().trim().to_string();
    let c = Client::connect(&b.uri(), token).await.unwrap();
    assert_eq!(c.usage().await.unwrap().quota.limit_bytes, 64 * MIB);

    for args in [
        &["leases", "list", "--tenant", "nobody"][..],
        &["sessions", "list", "--tenant", "nobody"],
        &["tokens", "list", "--tenant", "nobody"],
    ] {
        let o = ctl(&b, args).await;
        assert!(!o.ok, "{args:?}: {}", o.stdout);
        assert!(
            o.stderr.starts_with("error: NOT_FOUND") && o.stderr.contains("nobody"),
            "{args:?}: {}",
            o.stderr
        );
    }
    assert_eq!(
        json(&b, &["leases", "list", "--tenant", "t"]).await,
        Value::Array(vec![])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokerctl_token_lifecycle_and_audit() {
    let b = Broker::start().unwrap();
    ok(&b, &["quota", "set", "team-a", "--limit", "64MiB"]).await;
    // A named read token with a ttl: the token alone on stdout, details on stderr.
    let o = ctl(
        &b,
        &[
            "tokens", "issue", "team-a", "--scope", "read", "--ttl", "2h", "--name", "dash",
        ],
    )
    .await;
    assert!(o.ok, "{}", o.stderr);
    let token = o.stdout.trim().to_string();
    assert!(token.starts_with("gpb_"), "{}", o.stdout);
    assert!(
        o.stderr.contains("read token") && o.stderr.contains("expires"),
        "{}",
        o.stderr
    );
    let c = Client::connect(&b.uri(), token).await.unwrap();
    assert_eq!(c.usage().await.unwrap().usage.held_bytes, 0);
    // A node-wide read token and an admin token (no tenant).
    let node = json(
        &b,
        &["tokens", "issue", "--scope", "read", "--name", "scrape"],
    )
    .await;
    assert_eq!(node["scope"], "read");
    assert_eq!(node["tenant"], "");
    let o = ctl(&b, &["tokens", "issue", "--scope", "worker"]).await;
    assert!(
        !o.ok && o.stderr.contains("INVALID_ARGUMENT"),
        "{}",
        o.stderr
    );

    // tokens list: name, scope, expiry, last use.
    let table = ok(&b, &["tokens", "list"]).await;
    let header = table.lines().next().unwrap();
    for col in ["NAME", "SCOPE", "EXPIRES", "LAST_USED"] {
        assert!(header.contains(col), "{table}");
    }
    let dash = table.lines().find(|l| l.contains("dash")).unwrap();
    assert!(
        dash.contains("read") && dash.contains("in 1h59m") && dash.contains("ago"),
        "{table}"
    );
    let scrape = table.lines().find(|l| l.contains("scrape")).unwrap();
    assert!(scrape.contains("never"), "{table}");

    // audit: every change above, newest last, with who.
    let entries = json(&b, &["audit", "--since", "1h"]).await;
    let actions: Vec<&str> = entries
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["quota.set", "token.issue", "token.issue"]);
    assert_eq!(entries[0]["token_id"], "admin-file");
    let table = ok(&b, &["audit", "--tenant", "team-a"]).await;
    assert_eq!(table.lines().count(), 3, "{table}");
    assert!(
        table.contains("quota.set") && table.contains("admin-file"),
        "{table}"
    );
    let o = ctl(&b, &["audit", "--since", "yesterday-ish"]).await;
    assert!(!o.ok && o.stderr.contains("--since"), "{}", o.stderr);

    // rotate-admin: prints the new token; the CLI then reads it from the file.
    let o = ctl(&b, &["tokens", "rotate-admin", "--grace", "0s"]).await;
    assert!(o.ok, "{}", o.stderr);
    let file = std::fs::read_to_string(b.state_dir.join("admin.token")).unwrap();
    assert_eq!(o.stdout.trim(), file.trim());
    ok(&b, &["tenants", "list"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_leaks_show_a_real_broker() {
    let b = Broker::start().unwrap();
    let c = b.client("team", 256 * MIB).await.unwrap();
    let s = c.session("worker-a").await.unwrap();
    let kept = s.lease_request(8 * MIB).label("kv").send().await.unwrap();
    let gone = s.lease(4 * MIB).await.unwrap();
    let gone_id = gone.id().to_string();
    // Revoked while this (live) process holds it: quarantined, with our pid.
    ok(&b, &["leases", "revoke", &gone_id]).await;
    let _ = gone.detach();

    let text = ok(&b, &["status"]).await;
    for line in text.lines() {
        assert!(line.chars().count() <= 100, "{line:?}");
    }
    for want in [
        "GPU 0",
        "# leased 8.0 MiB",
        "q quarantined 4.0 MiB",
        "team",
        kept.id(),
        "LARGEST LEASES",
        "WAITING REQUESTS: none",
    ] {
        assert!(text.contains(want), "{want:?} in\n{text}");
    }
    let snap = json(&b, &["status"]).await;
    assert_eq!(snap["quarantined"][0]["pid"], std::process::id());

    let text = ok(&b, &["leaks", "--older-than", "0s"]).await;
    assert!(text.contains(kept.id()), "{text}");
    let q = text.split("QUARANTINED MEMORY").nth(1).unwrap();
    assert!(
        q.contains(&gone_id) && q.contains(&std::process::id().to_string()),
        "{text}"
    );
    let text = ok(&b, &["leaks"]).await;
    assert!(text.contains("LONGER THAN 1d00h (0)"), "{text}");
    kept.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_lists_publications_and_their_importers() {
    let b = Broker::start().unwrap();
    assert_eq!(ok(&b, &["shared"]).await, "no shared leases\n");
    let alice = b.client("alice", GIB).await.unwrap();
    let bob = b.client("bob", GIB).await.unwrap();
    let sa = alice.session("p").await.unwrap();
    let lease = sa.lease(8 * MIB).await.unwrap();
    lease.publish("weights", &["bob"]).await.unwrap();
    let sb = bob.session("r").await.unwrap();
    let import = sb.import("alice", "weights").await.unwrap();
    let text = ok(&b, &["shared"]).await;
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("PUBLISHER"), "{text}");
    assert!(
        lines[1].contains("alice")
            && lines[1].contains("weights")
            && lines[1].contains("8.0 MiB")
            && lines[1].contains("bob")
            && lines[1].contains("enforced"),
        "{text}"
    );
    assert!(
        lines[2].contains("<- bob") && lines[2].contains("live"),
        "{text}"
    );
    let json: Value = serde_json::from_str(&ok(&b, &["--json", "shared"]).await).unwrap();
    assert_eq!(json[0]["publisher"], "alice");
    assert_eq!(json[0]["imports"][0]["tenant"], "bob");
    assert_eq!(json[0]["imports"][0]["import_id"], import.id());
    assert_eq!(
        ok(&b, &["shared", "--tenant", "bob"]).await,
        "no shared leases\n"
    );
}
