//! gpu-broker: a multi-tenant GPU memory broker. Worker processes ask it over gRPC for
//! leases on device memory under per-tenant quotas; operators manage tenants through the
//! admin service. See `docs/architecture.md` for the map; in one line:
//! `service -> arbiter -> (ledger, pool -> device)`, events back through `session`.
//!
//! Where to look: quotas are enforced in [`ledger`]; admission, queues and reclaim in
//! [`arbiter`]; the block cache and scrubbing in [`pool`]; hardware in [`device`].

pub mod admin_token;
pub mod arbiter;
pub mod audit;
pub mod auth;
pub mod availability;
pub mod backend;
pub mod bounds;
pub mod config;
pub mod crash_point;
pub mod defaults;
pub mod device;
pub mod error;
pub mod faults;
pub mod fd_budget;
pub mod file_read;
pub mod gate;
pub mod gpu_processes;
pub mod grpc_status;
pub mod health;
pub mod http_slots;
pub mod id_map;
pub mod info;
pub mod keeper;
pub mod lease;
pub mod ledger;
pub mod listener;
pub mod lock_holds;
pub mod metrics;
pub mod mps;
pub mod pool;
pub mod process;
pub mod process_group;
pub mod process_metrics;
pub mod quota;
pub mod rate;
pub mod read_pool;
pub mod reclaim_policy;
pub mod reservations;
pub mod scheduler;
pub mod server;
pub mod service;
pub mod session;
pub mod sharing;
pub mod status_http;
pub mod status_page;
pub mod store;
pub mod store_writer;
pub mod tenants_config;
pub mod ticket_read;
pub mod ticket_server;
pub mod tickets;
pub mod tier;
pub mod tls;
pub mod units;
pub mod views;
