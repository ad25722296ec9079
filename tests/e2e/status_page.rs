//! The status page on the metrics listener, in headless Chromium (Debian's `chromium`,
//! installed by `scripts/test-deps.sh`): loaded against a broker with tenants and leases,
//! its content checked in the DOM Chromium built (also a process reservation: per device,
//! per tenant and in its own table), and a screenshot saved
//! (`target/status-page.png`).

use gpu_broker_tests::*;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn chromium() -> PathBuf {
    for p in [
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
    ] {
        if Path::new(p).exists() {
            return PathBuf::from(p);
        }
    }
    panic!(
        "chromium not found: install it with scripts/test-deps.sh (apt-get install chromium), \
         which the README's test command scripts/test.sh runs first"
    );
}

async fn headless(profile: &Path, args: &[String]) -> std::process::Output {
    let mut cmd = tokio::process::Command::new(chromium());
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--hide-scrollbars",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(args)
    .kill_on_drop(true);
    tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("chromium finished")
        .expect("chromium ran")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_devices_tenants_and_leases_in_chromium() {
    let b = Broker::start_with(BrokerOpts {
        extra: vec!["--metrics-listen".into(), "127.0.0.1:0".into()],
        ..BrokerOpts::default()
    })
    .unwrap();
    let addr = b.metrics_addr().await;
    let training = b.client("training", 512 * MIB).await.unwrap();
    let inference = b.client("inference", 256 * MIB).await.unwrap();
    let st = training.session("trainer").await.unwrap();
    let si = inference.session("server").await.unwrap();
    let big = st
        .lease_request(300 * MIB)
        .label("weights")
        .send()
        .await
        .unwrap();
    let small = si
        .lease_request(64 * MIB)
        .label("kv-<cache>")
        .send()
        .await
        .unwrap();
    let gone = si.lease(32 * MIB).await.unwrap();
    let gone_id = gone.id().to_string();
    b.admin()
        .await
        .unwrap()
        .revoke_lease(&gone_id, "test")
        .await
        .unwrap();
    let _ = gone.detach();
    // A process reservation (what `gpu-brokerctl run` takes) of another session.
    let sr = inference.session("run:serve").await.unwrap();
    let reservation = gpu_broker_client::ReservationRequest::new(&sr, 96 * MIB)
        .label("run:<serve>")
        .await
        .unwrap();
    let rid = reservation.info().reservation_id.clone();

    let profile = tempfile::tempdir().unwrap();
    let url = format!("http://{addr}/status");
    let out = headless(profile.path(), &["--dump-dom".into(), url.clone()]).await;
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        dom.contains("<h1>gpu-broker</h1>"),
        "chromium did not load the page: {}\n{dom}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "1 devices · 2 tenants · 3 sessions · 2 leases · 0 waiting",
        "host simulation",
        "training",
        "inference",
        big.id(),
        small.id(),
        "weights",
        "kv-&lt;cache&gt;",
        &gone_id,
        "300.0 MiB",
        "class=\"leased\"",
        "http-equiv=\"refresh\"",
        "<h2>Process reservations</h2>",
        &rid,
        "run:&lt;serve&gt;",
        "96.0 MiB",
        "class=\"processes\"",
        "reserved for processes",
    ] {
        assert!(dom.contains(want), "{want:?} missing from the page:\n{dom}");
    }

    let shot = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/status-page.png");
    let out = headless(
        profile.path(),
        &[
            "--window-size=1280,1000".into(),
            format!("--screenshot={}", shot.display()),
            url.clone(),
        ],
    )
    .await;
    let png = std::fs::read(&shot).unwrap_or_else(|e| {
        panic!(
            "no screenshot at {}: {e}\n{}",
            shot.display(),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
    // A device both unhealthy and draining, each with its reason, and a long label: the
    // page names both states and still fits a 1280 px window (measured by Chromium's own
    // layout: the page, with a line that records its scroll width, loaded from a file).
    let long = st
        .lease_request(2 * MIB)
        .label("a-rather-long-lease-label-".repeat(4))
        .send()
        .await
        .unwrap();
    let admin = b.admin().await.unwrap();
    admin
        .set_device_health(0, false, "Xid 79: fell off the bus")
        .await
        .unwrap();
    admin
        .drain(Some(0), None, "node maintenance")
        .await
        .unwrap();
    let out = headless(profile.path(), &["--dump-dom".into(), url.clone()]).await;
    let page = String::from_utf8_lossy(&out.stdout).to_string();
    for want in [
        "<span class=\"bad\">unhealthy</span>: Xid 79: fell off the bus",
        "<span class=\"warn\">draining</span>: node maintenance",
    ] {
        assert!(
            page.contains(want),
            "{want:?} missing from the page:\n{page}"
        );
    }
    let measured = profile.path().join("measured.html");
    std::fs::write(
        &measured,
        page.replace(
            "</body>",
            "<script>document.body.setAttribute('data-scroll-width', \
             document.documentElement.scrollWidth)</script></body>",
        ),
    )
    .unwrap();
    let out = headless(
        profile.path(),
        &[
            "--window-size=1280,1000".into(),
            "--dump-dom".into(),
            format!("file://{}", measured.display()),
        ],
    )
    .await;
    let dom_measured = String::from_utf8_lossy(&out.stdout);
    let width: u32 = dom_measured
        .split("data-scroll-width=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no measured width in:\n{dom_measured}"));
    let shot = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/status-page-1280.png");
    headless(
        profile.path(),
        &[
            "--window-size=1280,1000".into(),
            format!("--screenshot={}", shot.display()),
            url.clone(),
        ],
    )
    .await;

    assert!(
        width <= 1280,
        "the page is {width} px wide in a 1280 px window (screenshot: {})",
        shot.display()
    );

    // The inference tenant's row shows its reservation beside its held bytes.
    let row = dom
        .split("<tr>")
        .find(|r| r.starts_with("<td>inference</td>"))
        .expect("the inference tenant's row");
    assert!(row.contains("96.0 MiB"), "{row}");
    big.release().await.unwrap();
    small.release().await.unwrap();
    long.release().await.unwrap();
    reservation.release().await.unwrap();
}
