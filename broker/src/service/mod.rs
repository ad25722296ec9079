//! The tonic services: [`broker`] for workers and [`admin`] for operators. They translate
//! proto messages to domain types ([`convert`]) and a `BrokerError` to a `tonic::Status`
//! ([`crate::grpc_status`]) and delegate everything else to the arbiter. No business logic
//! lives here.

pub mod admin;
pub mod broker;
pub mod convert;
mod events;
mod mps_report;
pub mod shared;

#[cfg(test)]
mod audit_wait_tests;
#[cfg(test)]
mod runtime_tests;
