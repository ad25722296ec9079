//! The metrics with the real Prometheus tools (Debian's `prometheus` package, installed by
//! `scripts/test-deps.sh`): `promtool check metrics` accepts what `/metrics` writes, a
//! Prometheus server started here scrapes the broker (OpenMetrics) and answers a query
//! about a lease, `promtool check rules` and `promtool test rules` accept the shipped
//! alerts, and `/metrics` behind `--metrics-require-token` wants the admin token.

use gpu_broker_tests::*;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A Prometheus tool, or a failure that names the install step.
fn tool(name: &str) -> PathBuf {
    for dir in ["/usr/bin", "/usr/local/bin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return p;
        }
    }
    panic!(
        "{name} not found: install it with scripts/test-deps.sh (apt-get install prometheus), \
         which the README's test command scripts/test.sh runs first"
    );
}

/// One HTTP/1.1 GET: (status line, headers, body), de-chunked.
pub(crate) async fn http_get(
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (String, String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    let body = if headers
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    (status.to_string(), headers.to_ascii_lowercase(), body)
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

fn metered_broker(extra: &[&str]) -> Broker {
    let mut args = vec!["--metrics-listen".to_string(), "127.0.0.1:0".into()];
    args.extend(extra.iter().map(|s| s.to_string()));
    Broker::start_with(BrokerOpts {
        extra: args,
        ..BrokerOpts::default()
    })
    .unwrap()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_the_metrics_and_prometheus_scrapes_them() {
    let promtool = tool("promtool");
    let prometheus = tool("prometheus");
    let b = metered_broker(&[]);
    let addr = b.metrics_addr().await;
    let c = b.client("metered", 256 * MIB).await.unwrap();
    let s = c.session("m").await.unwrap();
    let lease = s.lease(6 * MIB).await.unwrap();
    let refused = s.lease(512 * MIB).await;
    assert!(refused.is_err());

    // The Prometheus text format, for scrapers that do not ask for OpenMetrics.
    let (status, headers, text) = http_get(&addr, "/metrics", &[]).await;
    assert!(status.contains("200"), "{status}");
    assert!(
        headers.contains("content-type: text/plain; version=0.0.4"),
        "{headers}"
    );
    assert!(
        !text.contains("# EOF"),
        "no OpenMetrics terminator in the text format"
    );
    for want in [
        "gpu_broker_build_info{",
        "gpu_broker_mps_control_present ",
        "gpu_broker_tenant_held_bytes{tenant=\"metered\"} 6291456",
        "gpu_broker_tenant_limit_bytes{tenant=\"metered\"} 268435456",
        "gpu_broker_tenant_leases{tenant=\"metered\"} 1",
        "gpu_broker_leases_granted_total{tier=\"device\"} 1",
        "gpu_broker_acquire_refusals_total{reason=\"quota\"} 1",
        "gpu_broker_acquire_duration_seconds_count{outcome=\"granted\"} 1",
    ] {
        assert!(text.contains(want), "{want} missing:\n{text}");
    }
    let device_line = text
        .lines()
        .find(|l| l.starts_with("gpu_broker_device_leased_bytes{"))
        .unwrap_or_else(|| panic!("no device series:\n{text}"));
    assert!(
        device_line.contains("gpu=\"0\"")
            && device_line.contains("UUID=\"")
            && device_line.contains("modelName=\"")
            && device_line.contains("Hostname=\""),
        "{device_line}"
    );
    let mut check = tokio::process::Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    check
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .await
        .unwrap();
    let out = check.wait_with_output().await.unwrap();
    // The one lint allowed: the device series' label names are DCGM exporter's (`UUID`,
    // `modelName`, `Hostname`), on purpose, so that both join in one query. Anything else
    // promtool says fails the test.
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let other: Vec<&str> = said
        .lines()
        .filter(|l| {
            !(l.starts_with("gpu_broker_device_")
                && l.ends_with("label names should be written in 'snake_case' not 'camelCase'"))
        })
        .collect();
    assert!(
        other.is_empty(),
        "promtool check metrics: {}",
        other.join("\n")
    );

    // OpenMetrics, when asked for.
    let (_, headers, om) = http_get(
        &addr,
        "/metrics",
        &[("Accept", "application/openmetrics-text;version=1.0.0")],
    )
    .await;
    assert!(
        headers.contains("content-type: application/openmetrics-text; version=1.0.0"),
        "{headers}"
    );
    assert!(om.trim_end().ends_with("# EOF"), "{om}");

    // A real Prometheus scrapes the broker and answers a query about the lease.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: gpu-broker\n    static_configs:\n      - targets: ['{addr}']\n"
        ),
    )
    .unwrap();
    let web = format!("127.0.0.1:{}", free_port());
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let _prom = tokio::process::Command::new(&prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address={web}"))
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let query = "/api/v1/query?query=gpu_broker_tenant_held_bytes%7Btenant%3D%22metered%22%7D";
    let mut last = String::new();
    let mut answered = false;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !answered && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if tokio::net::TcpStream::connect(&web).await.is_err() {
            continue;
        }
        let (_, _, body) = http_get(&web, query, &[]).await;
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        answered = v["data"]["result"][0]["value"][1] == "6291456";
        last = body;
    }
    assert!(
        answered,
        "Prometheus did not report the lease: {last}\n{}",
        std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default()
    );
    let (_, _, targets) = http_get(&web, "/api/v1/targets", &[]).await;
    assert!(targets.contains("\"health\":\"up\""), "{targets}");
    lease.release().await.unwrap();
}

#[tokio::test]
async fn promtool_accepts_the_shipped_alert_rules() {
    let promtool = tool("promtool");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let rules = root.join("deploy/prometheus/alerts.yml");
    let out = tokio::process::Command::new(&promtool)
        .arg("check")
        .arg("rules")
        .arg(&rules)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "promtool check rules {}: {}{}",
        rules.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let tests = root.join("deploy/prometheus/alerts_test.yml");
    let out = tokio::process::Command::new(&promtool)
        .arg("test")
        .arg("rules")
        .arg(&tests)
        .current_dir(root.join("deploy/prometheus"))
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "promtool test rules {}: {}{}",
        tests.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn metrics_behind_a_token_want_the_admin_token() {
    let b = metered_broker(&["--metrics-require-token"]);
    let addr = b.metrics_addr().await;
    let (status, headers, _) = http_get(&addr, "/metrics", &[]).await;
    assert!(status.contains("401"), "{status}");
    assert!(headers.contains("www-authenticate: bearer"), "{headers}");
    let tenant = b
        .tenant("t", gpu_broker_client::QuotaSpec::new(MIB * 64))
        .await
        .unwrap();
    let (status, _, _) = http_get(
        &addr,
        "/metrics",
        &[("Authorization", &format!("Bearer {tenant}"))],
    )
    .await;
    assert!(
        status.contains("401"),
        "a worker token does not read metrics: {status}"
    );
    let (status, _, body) = http_get(
        &addr,
        "/metrics",
        &[("Authorization", &format!("Bearer {}", b.admin_token))],
    )
    .await;
    assert!(
        status.contains("200") && body.contains("gpu_broker_sessions"),
        "{status}"
    );
    // A read token issued for the node (no tenant) reads the metrics too.
    let out = tokio::process::Command::new(bin("gpu-brokerctl"))
        .args(["--broker", &b.uri(), "--token", &b.admin_token])
        .args(["tokens", "issue", "--scope", "read", "--name", "prometheus"])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read = String::from_utf8(out.stdout).unwrap();
    let (status, _, _) = http_get(
        &addr,
        "/metrics",
        &[("Authorization", &format!("Bearer {}", read.trim()))],
    )
    .await;
    assert!(
        status.contains("200"),
        "a read token reads the metrics: {status}"
    );
    // Probes need no token.
    let (status, _, body) = http_get(&addr, "/healthz", &[]).await;
    assert!(status.contains("200") && body == "ok\n", "{status} {body}");
    let (status, _, _) = http_get(&addr, "/readyz", &[]).await;
    assert!(status.contains("200"), "{status}");
}

/// Every `gpu_broker_*` name in `text` (a file's contents).
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("gpu_broker_") {
        let name: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[i + name.len()..];
        out.insert(name);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_alerts_use_only_exported_metrics() {
    let b = metered_broker(&[]);
    let addr = b.metrics_addr().await;
    let _c = b.client("t", 64 * MIB).await.unwrap();
    let (_, _, text) = http_get(&addr, "/metrics", &[]).await;
    let exported: std::collections::BTreeSet<String> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dashboard = std::fs::read_to_string(root.join("deploy/grafana/gpu-broker.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    assert_eq!(json["uid"], "gpu-broker");
    let panels = json["panels"].as_array().expect("panels");
    assert!(panels.len() >= 8, "{} panels", panels.len());
    let alerts = std::fs::read_to_string(root.join("deploy/prometheus/alerts.yml")).unwrap();
    for (file, text) in [("gpu-broker.json", &dashboard), ("alerts.yml", &alerts)] {
        let used = metric_names(text);
        assert!(!used.is_empty());
        let unknown: Vec<&String> = used.iter().filter(|n| !exported.contains(*n)).collect();
        assert!(
            unknown.is_empty(),
            "{file} uses metrics the broker does not export: {unknown:?}\nexported: {exported:?}"
        );
    }
}

/// What `docs/security.md` says any local user reads by default, and how it is closed:
/// with no token wanted, a request with no token reads `/metrics` (tenant names) and
/// `/status` (tenant names and lease labels); with `--metrics-require-token` both answer
/// 401 to it, while `/healthz` and `/readyz` stay open for probes.
#[tokio::test]
async fn a_tokenless_reader_sees_tenants_and_labels_by_default_and_only_probes_with_a_token_wanted()
{
    for wanted in [false, true] {
        let b = metered_broker(if wanted {
            &["--metrics-require-token"]
        } else {
            &[]
        });
        let token = b
            .tenant(
                "tenant-secret-name",
                gpu_broker_client::QuotaSpec::new(MIB * 64),
            )
            .await
            .unwrap();
        let c = gpu_broker_client::Client::connect(&b.uri(), token)
            .await
            .unwrap();
        let s = c.session("w").await.unwrap();
        let _l = s
            .lease_request(2 * MIB)
            .label("label-secret")
            .send()
            .await
            .unwrap();
        let addr = b.metrics_addr().await;
        let (status, _, body) = http_get(&addr, "/metrics", &[]).await;
        if wanted {
            assert!(status.contains("401"), "{status}");
            assert!(!body.contains("tenant-secret-name"), "{body}");
        } else {
            assert!(status.contains("200"), "{status}");
            assert!(body.contains("tenant-secret-name"), "{body}");
        }
        let (status, _, body) = http_get(&addr, "/status", &[]).await;
        if wanted {
            assert!(status.contains("401"), "{status}");
            assert!(!body.contains("label-secret"), "{body}");
        } else {
            assert!(status.contains("200"), "{status}");
            assert!(
                body.contains("tenant-secret-name") && body.contains("label-secret"),
                "{body}"
            );
        }
        for probe in ["/healthz", "/readyz"] {
            let (status, _, _) = http_get(&addr, probe, &[]).await;
            assert!(
                status.contains("200"),
                "{probe} with wanted={wanted}: {status}"
            );
        }
    }
}
