//! gpu-broker: a multi-tenant GPU memory broker. Worker processes ask it over gRPC for
//! leases on device memory under per-tenant quotas; operators manage tenants through the
//! admin service. See `docs/architecture.md` for the map; in one line:
//! `service -> arbiter -> (ledger, pool -> device)`, events back through `session`.
//!
//! Where to look: the state machine (quotas, the queue policy, every byte's state) is the
//! core crate, `gpu_broker_core`; admission, queues and reclaim as the daemon runs them in
//! [`arbiter`]; scrubbing in [`pool`]'s callers; hardware in [`device`].
//!
//! The core's modules are re-exported below at their old paths (`crate::ledger`,
//! `crate::lease`, ...), so the daemon's code names them as before; `defaults`, `device`,
//! `fd_budget`, `process_group`, `sharing` and `units` are the daemon's own modules that
//! re-export the core's part of them beside their OS part.

// `broker/clippy.toml`'s rules (who frees device memory, no thread sleeps) are for the
// daemon's code; tests may break them.
#![cfg_attr(test, allow(clippy::disallowed_methods))]

pub mod admin_token;
pub mod arbiter;
pub mod audit;
pub mod auth;
pub mod backend;
pub mod bounds;
pub mod config;
pub mod crash_point;
pub mod defaults;
pub mod device;
pub mod faults;
pub mod fd;
pub mod fd_budget;
pub mod file_read;
pub mod gate;
pub mod gpu_processes;
pub mod grpc_status;
pub mod health;
pub mod http_slots;
pub mod info;
pub mod keeper;
pub mod kept_holders;
pub mod listener;
pub mod lock_holds;
pub mod memfd_alive;
pub mod memfd_holders;
pub mod metrics;
pub mod mps;
pub mod nvml_warm;
pub mod process;
pub mod process_group;
pub mod process_metrics;
pub mod rate;
pub mod read_pool;
pub mod reclaim_policy;
pub mod server;
pub mod service;
pub mod sharing;
pub mod startup;
pub mod status_http;
pub mod status_page;
pub mod store;
pub mod store_writer;
pub mod tenants_config;
pub mod tls;
pub mod token_review;
pub mod tokens_config;
pub mod units;

pub use gpu_broker_core::{
    availability, error, id_map, lease, ledger, pool, quota, reservations, scheduler, session,
    tier, views,
};
