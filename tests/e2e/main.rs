//! End-to-end tests: the real `gpu-broker` binary, driven by the client crate and by
//! separate worker processes (`e2e-worker`, the examples, `gpu-brokerctl`). Every test
//! starts its own broker on a temporary socket with a private state directory and
//! shared-memory directory. One module per theme.

mod admin;
mod claims;
mod cli;
mod crash;
mod data;
mod deploy;
mod descriptors;
mod device_quota;
mod devices;
mod drain;
mod errors;
mod examples;
mod fd_leases;
mod fleet;
mod gpu_harness;
mod isolation;
mod k8s_scheduling;
mod mps;
mod observability;
mod operators_socket;
mod prometheus;
mod quota;
mod readme;
mod reload;
mod retained;
mod run;
mod scrub;
mod shared;
mod shutdown;
mod sleep;
mod smoke;
mod status_page;
mod tls;
mod token_review;
mod trust;
mod turns;
mod waiting;
