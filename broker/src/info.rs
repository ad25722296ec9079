//! What the broker says about itself (`GetInfo` on both services): its release, the API
//! revision, the backend, and the optional features it has. Clients compare the revision
//! with [`API_REVISION`] of their own build and warn when the broker is older.

use crate::arbiter::Arbiter;

/// Revision of the gRPC API this build serves. Raised whenever the API gains something a
/// client may rely on. 1: leases, quotas, turns; 2: token scopes and expiry, audit log,
/// drain, device health and identity, rate limits, GetInfo; 3: leases as file descriptors
/// (handle kinds, tickets), shared leases, process reservations and process groups,
/// paginated listings, typed refusals (`google.rpc.ErrorInfo` reasons), device UUIDs.
pub const API_REVISION: u32 = 3;

/// The optional features of this build.
pub const FEATURES: &[&str] = &[
    "token-scopes",
    "token-expiry",
    "audit",
    "drain",
    "device-health",
    "device-uuids",
    "rate-limits",
    "fd-leases",
    "shared-leases",
    "process-reservations",
    "process-groups",
    "paged-listings",
    "error-reasons",
    "descriptor-channels",
];

/// What `GetInfo` reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BrokerInfo {
    pub version: &'static str,
    pub api_revision: u32,
    pub backend: String,
    pub device_count: u32,
    pub features: Vec<&'static str>,
    /// Each device's UUID, by index.
    pub device_uuids: Vec<String>,
    pub started: std::time::SystemTime,
    /// A keeper holds sessions and leases across restarts.
    pub keeper: bool,
    /// What this start took back from the keeper.
    pub restart: Option<crate::arbiter::RestartReport>,
}

impl BrokerInfo {
    /// Broker `arb`'s info.
    pub fn of(arb: &Arbiter) -> BrokerInfo {
        BrokerInfo {
            version: env!("CARGO_PKG_VERSION"),
            api_revision: API_REVISION,
            backend: if arb.devices.any_cuda() {
                "cuda"
            } else {
                "host"
            }
            .to_string(),
            device_count: arb.devices.len() as u32,
            features: FEATURES.to_vec(),
            device_uuids: (0..arb.devices.len() as u32)
                .map(|i| arb.devices.uuid(i))
                .collect(),
            started: arb.metrics().started(),
            keeper: arb.restart().keeps_leases(),
            restart: arb.restart().report(),
        }
    }
}
