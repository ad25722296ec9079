//! Prometheus metrics: counters of what the broker did (grants, releases, reclaims,
//! revocations) and gauges of what it holds, rendered in the text exposition format by
//! [`render`] and served over HTTP by `server::serve_metrics`.

use crate::arbiter::Arbiter;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::LazyLock;

/// Reclaim requests sent to holders.
pub static RECLAIMS: LazyLock<Counter> = LazyLock::new(Counter::default);
/// Leases granted.
pub static GRANTS: LazyLock<Counter> = LazyLock::new(Counter::default);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabel {
    device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

/// The metrics text for the current state.
pub async fn render(arb: &Arbiter) -> String {
    let mut reg = Registry::with_prefix("gpu_broker");
    reg.register(
        "reclaim_requests",
        "Reclaim requests sent to holders",
        RECLAIMS.clone(),
    );
    reg.register("leases_granted", "Leases granted", GRANTS.clone());
    type Get = fn(&crate::arbiter::DeviceReport) -> u64;
    let gauges: [(&str, &str, Get); 6] = [
        (
            "device_leasable_bytes",
            "Bytes the broker may hand out",
            |d| d.leasable,
        ),
        ("device_leased_bytes", "Bytes in live leases", |d| d.leased),
        ("device_cached_bytes", "Freed bytes kept for reuse", |d| {
            d.cached
        }),
        (
            "device_quarantined_bytes",
            "Bytes a live process may still map",
            |d| d.quarantined,
        ),
        (
            "device_free_bytes",
            "Free bytes as the device reports",
            |d| d.free,
        ),
        (
            "device_external_used_bytes",
            "Bytes used outside the broker",
            |d| d.external_used,
        ),
    ];
    let devices = arb.devices().await;
    for (name, help, get) in gauges {
        let fam = Family::<DeviceLabel, Gauge>::default();
        for d in &devices {
            fam.get_or_create(&DeviceLabel {
                device: d.index.to_string(),
            })
            .set(get(d) as i64);
        }
        reg.register(name, help, fam);
    }
    let held = Family::<TenantLabel, Gauge>::default();
    let limit = Family::<TenantLabel, Gauge>::default();
    for t in arb.list_tenants() {
        let l = TenantLabel {
            tenant: t.name.clone(),
        };
        held.get_or_create(&l).set(t.usage.held_bytes as i64);
        limit.get_or_create(&l).set(t.quota.limit_bytes as i64);
    }
    reg.register("tenant_held_bytes", "Device bytes a tenant holds", held);
    reg.register("tenant_limit_bytes", "A tenant's quota limit", limit);
    let sessions = Gauge::<i64>::default();
    sessions.set(arb.session_count() as i64);
    reg.register("sessions", "Open sessions", sessions);
    let mut out = String::new();
    if encode(&mut out, &reg).is_err() {
        out.clear();
    }
    out
}
