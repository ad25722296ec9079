//! The status page (`GET /status` on the metrics listener): what `gpu-brokerctl status`
//! shows, as one read-only HTML page that reloads itself every few seconds (fitting a
//! 1280 px window) — devices with every state they are in (unhealthy, draining) and
//! usage bars (leased, reserved for processes, cached, quarantined, outside the broker,
//! headroom, free) and, under managed MPS, the daemon's state, clients and the compute mode,
//! tenants against limit and guarantee (on a node of more than
//! [`MAX_TENANT_ROWS`] tenants, those holding the most), the process reservations (`gpu-brokerctl run`),
//! the largest and oldest leases, waiting requests, and quarantined memory with its
//! process. No scripts, no external resources; every value
//! is HTML-escaped. Access is the metrics listener's (`status_http`).

use crate::arbiter::{Arbiter, DeviceReport};
use crate::lease::LeaseView;
use std::fmt::Write;
use std::time::SystemTime;

/// Seconds between the page's reloads.
pub const REFRESH_SECS: u32 = 5;

/// Most tenant rows the page shows. Above it the page shows the tenants holding the most
/// and counts the rest (`gpu-brokerctl tenants list` lists every one), so a node of
/// thousands of tenants gets a page of tens of kilobytes, not megabytes.
pub const MAX_TENANT_ROWS: usize = 200;

fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

fn size(b: u64) -> String {
    crate::units::human(b)
}

fn age(since: SystemTime, now: SystemTime) -> String {
    let s = now.duration_since(since).unwrap_or_default().as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s / 60 % 60),
        _ => format!("{}d{:02}h", s / 86400, s / 3600 % 24),
    }
}

/// The bar of one device: a flex row of coloured segments, widths in percent of total.
fn bar(d: &DeviceReport) -> String {
    let total = d.total.max(1) as f64;
    let parts = [
        ("leased", d.leased),
        ("processes", d.process_reserved),
        ("cached", d.cached),
        ("quarantined", d.quarantined),
        ("outside", d.external_used),
        ("headroom", d.headroom),
    ];
    let mut out = String::from("<div class=\"bar\">");
    for (class, bytes) in parts {
        if bytes > 0 {
            let _ = write!(
                out,
                "<span class=\"{class}\" style=\"width:{:.2}%\" title=\"{class} {}\"></span>",
                bytes as f64 * 100.0 / total,
                size(bytes)
            );
        }
    }
    out.push_str("</div>");
    out
}

fn lease_rows(out: &mut String, title: &str, leases: &[&LeaseView], now: SystemTime) {
    let _ = write!(
        out,
        "<h2>{title}</h2><table><tr><th>lease</th><th>tenant</th><th>device</th><th>size</th><th>age</th><th>label</th></tr>"
    );
    for l in leases {
        let _ = write!(
            out,
            "<tr><td class=\"id\">{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"text\">{}</td></tr>",
            l.id,
            esc(&l.tenant),
            l.device,
            size(l.bytes),
            age(l.created, now),
            esc(&l.label)
        );
    }
    out.push_str("</table>");
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1em;color:#222}\
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.4em}\
table{border-collapse:collapse}td,th{padding:.2em .6em;border-bottom:1px solid #ddd;text-align:left;white-space:nowrap}\
td.n{text-align:right}td.id{font-family:monospace;font-size:.9em}\
td.text,td.state{white-space:normal;overflow-wrap:anywhere;min-width:10em;max-width:18em}\
.bad{color:#c0392b;font-weight:bold}.warn{color:#b9770e;font-weight:bold}\
.bar{display:flex;width:12em;height:1.1em;background:#eee;border:1px solid #999}\
.bar span{display:block;height:100%}\
.leased{background:#2a9d3a}.cached{background:#3fa7d6}.quarantined{background:#e9b000}\
.outside{background:#d1495b}.headroom{background:#888}.processes{background:#8e44ad}\
.key span{display:inline-block;width:.9em;height:.9em;margin:0 .3em 0 1em;vertical-align:middle}";

/// A device's states, under its name: every state it is in (unhealthy and draining at
/// once, each with its reason), or "open".
fn state_cell(d: &DeviceReport) -> String {
    let mut states = Vec::new();
    if let Some(why) = &d.fault {
        states.push(format!(
            "<span class=\"bad\">unhealthy</span>: {}",
            esc(why)
        ));
    }
    if let Some(why) = &d.drain_reason {
        states.push(format!(
            "<span class=\"warn\">draining</span>: {}",
            esc(why)
        ));
    }
    if states.is_empty() {
        states.push("open".into());
    }
    states.join("<br>")
}

/// The page for the broker's state now.
pub async fn render(arb: &Arbiter) -> String {
    let now = SystemTime::now();
    let devices = arb.views().device_reports().await;
    let tenants = arb.views().tenants();
    let leases = arb.views().leases(None);
    let quarantined = arb.views().quarantined();
    let reservations = arb.views().reservations(None);
    let mps = arb.lifecycle().mps().map(|m| m.status());
    let waiting: u32 = tenants.iter().map(|t| t.waiting).sum();
    let mut out = String::new();
    let _ = write!(
        out,
        "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"{REFRESH_SECS}\">\
         <title>gpu-broker status</title><style>{STYLE}</style></head><body>\
         <h1>gpu-broker</h1><p id=\"summary\">{} devices · {} tenants · {} sessions · {} leases · {} waiting · refreshes every {REFRESH_SECS} s</p>",
        devices.len(),
        tenants.len(),
        arb.views().session_count(),
        leases.len(),
        waiting
    );
    out.push_str("<h2>Devices</h2><p class=\"key\"><span class=\"leased\"></span>leased<span class=\"processes\"></span>reserved for processes<span class=\"cached\"></span>cached<span class=\"quarantined\"></span>quarantined<span class=\"outside\"></span>outside the broker<span class=\"headroom\"></span>headroom</p>");
    out.push_str("<table><tr><th>device</th><th>model</th><th>usage</th><th>leased</th><th>processes</th><th>cached</th><th>quarantined</th><th>outside</th><th>total</th><th>waiting</th></tr>");
    for d in &devices {
        let _ = write!(
            out,
            "<tr><td class=\"state\">{} <span class=\"id\" title=\"{}\">{}</span><br>{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
            d.index,
            esc(&d.uuid),
            esc(&d.uuid.chars().take(12).collect::<String>()),
            state_cell(d),
            esc(if d.model.is_empty() { &d.name } else { &d.model }),
            bar(d),
            size(d.leased),
            size(d.process_reserved),
            size(d.cached),
            size(d.quarantined),
            size(d.external_used),
            size(d.total),
            d.waiting
        );
    }
    out.push_str("</table>");
    let modes = arb.lifecycle().compute_modes();
    if mps.is_none() && !modes.is_empty() {
        let _ = write!(
            out,
            "<p id=\"compute-mode\">compute mode {}</p>",
            esc(&modes.join(", "))
        );
    }
    if let Some(m) = &mps {
        let _ = write!(
            out,
            "<p id=\"mps\">MPS: {} · {} client(s) · compute mode {}</p>",
            esc(&crate::error::status_message(m.summary())),
            m.clients.len(),
            esc(&if m.compute_modes.is_empty() {
                "unknown".to_string()
            } else {
                m.compute_modes.join(", ")
            })
        );
    }
    out.push_str("<h2>Tenants</h2><table><tr><th>tenant</th><th>held</th><th>reserved for processes</th><th>limit</th><th>guaranteed</th><th>quarantined</th><th>leases</th><th>sessions</th><th>waiting</th></tr>");
    let mut shown: Vec<&crate::arbiter::TenantView> = tenants.iter().collect();
    let hidden = shown.len().saturating_sub(MAX_TENANT_ROWS);
    if hidden > 0 {
        shown.sort_by(|a, b| {
            b.usage
                .held_bytes
                .cmp(&a.usage.held_bytes)
                .then_with(|| a.name.cmp(&b.name))
        });
        shown.truncate(MAX_TENANT_ROWS);
    }
    for t in shown {
        let _ = write!(
            out,
            "<tr><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
            esc(&t.name),
            size(t.usage.held_bytes),
            size(t.usage.process_reserved_bytes),
            size(t.quota.limit_bytes),
            size(t.quota.guaranteed_bytes),
            size(t.usage.quarantined_bytes),
            t.usage.lease_count,
            t.sessions,
            t.waiting
        );
    }
    out.push_str("</table>");
    if hidden > 0 {
        let _ = write!(
            out,
            "<p id=\"more-tenants\">the {MAX_TENANT_ROWS} tenants holding the most are shown; {hidden} more are not (<code>gpu-brokerctl tenants list</code> lists every tenant)</p>"
        );
    }
    out.push_str("<h2>Process reservations</h2><table><tr><th>reservation</th><th>tenant</th><th>device</th><th>reserved</th><th>drawn by leases</th><th>pid</th><th>age</th><th>label</th></tr>");
    for r in &reservations {
        let _ = write!(
            out,
            "<tr><td class=\"id\">{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"text\">{}</td></tr>",
            r.id,
            esc(&r.tenant),
            r.device,
            size(r.bytes),
            size(r.drawn_bytes),
            r.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
            r.created.map(|c| age(c, now)).unwrap_or_else(|| "-".into()),
            esc(&r.label)
        );
    }
    out.push_str("</table>");
    let mut largest: Vec<&LeaseView> = leases.iter().collect();
    largest.sort_by_key(|l| std::cmp::Reverse(l.bytes));
    largest.truncate(10);
    lease_rows(&mut out, "Largest leases", &largest, now);
    let mut oldest: Vec<&LeaseView> = leases.iter().collect();
    oldest.sort_by_key(|l| l.created);
    oldest.truncate(10);
    lease_rows(&mut out, "Oldest leases", &oldest, now);
    out.push_str("<h2>Quarantined memory</h2><table><tr><th>lease</th><th>tenant</th><th>device</th><th>size</th><th>for</th><th>pid</th></tr>");
    for q in &quarantined {
        let _ = write!(
            out,
            "<tr><td class=\"id\">{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
            q.lease,
            esc(&q.tenant),
            q.device,
            size(q.bytes),
            age(q.since, now),
            q.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into())
        );
    }
    out.push_str("</table></body></html>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Above the cap the page shows the tenants holding the most and counts the others.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_node_of_many_tenants_gets_a_bounded_page() {
        use crate::quota::Quota;
        let arb = crate::arbiter::host_arbiter(1 << 30, 1, Default::default());
        let q = Quota {
            limit_bytes: 1 << 30,
            ..Quota::default()
        };
        let n = MAX_TENANT_ROWS + 50;
        for i in 0..n {
            arb.set_quota(&format!("t{i:04}"), q.clone()).unwrap();
        }
        // The last tenant by name holds memory: it is shown although it sorts last.
        let holder = format!("t{:04}", n - 1);
        let (session, rx) = arb
            .open_session(&holder, "s", crate::session::Peer::default())
            .unwrap();
        let _lease = arb
            .acquire(crate::arbiter::AcquireRequest {
                tenant: holder.clone(),
                session,
                bytes: 2 << 20,
                device: None,
                wait: std::time::Duration::ZERO,
                label: String::new(),
                reclaimable: false,
                fallback_host: false,
            })
            .await
            .unwrap();
        let page = render(&arb).await;
        let rows = (0..n)
            .filter(|i| page.contains(&format!("<tr><td>t{i:04}</td>")))
            .count();
        assert_eq!(rows, MAX_TENANT_ROWS);
        assert!(page.contains(&format!("<tr><td>{holder}</td>")));
        assert!(page.contains("; 50 more are not"), "{page}");
        // The summary still counts every tenant.
        assert!(page.contains(&format!("{n} tenants")));
        drop(rx);

        // At or below the cap every tenant is shown, and no note.
        let small = crate::arbiter::host_arbiter(1 << 30, 1, Default::default());
        for i in 0..3 {
            small.set_quota(&format!("s{i}"), q.clone()).unwrap();
        }
        let page = render(&small).await;
        assert!((0..3).all(|i| page.contains(&format!("<tr><td>s{i}</td>"))));
        assert!(!page.contains("more-tenants"));
    }

    #[test]
    fn escapes_what_tenants_control() {
        assert_eq!(esc("<b>&\"x'"), "&lt;b&gt;&amp;&quot;x&#39;");
        let t = SystemTime::UNIX_EPOCH;
        assert_eq!(age(t, t + std::time::Duration::from_secs(7260)), "2h01m");
    }
}
