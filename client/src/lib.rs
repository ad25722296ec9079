//! Async client for gpu-broker, for workers and operators. A worker connects with its
//! tenant token ([`Client::connect`]), opens a [`Session`] (whose event stream carries
//! reclaim requests, revocations and shutdown notices), acquires [`Lease`]s of device
//! memory through it, maps them ([`Lease::map`] for host shared memory; `Lease::map_cuda`
//! with the `cuda` feature), and releases them. An operator uses [`AdminClient`] with
//! the admin token to set quotas, issue tokens and inspect leases, sessions and devices;
//! the `gpu-brokerctl` binary is a CLI over it. All calls return [`ClientError`], whose
//! variants follow the broker's gRPC status codes.
//!
//! ```no_run
//! # async fn demo() -> Result<(), gpu_broker_client::ClientError> {
//! use std::time::Duration;
//! use gpu_broker_client::Client;
//!
//! let client = Client::connect("unix:///run/gpu-broker/broker.sock", "my-token").await?;
//! let session = client.session("trainer-3").await?;
//! let lease = session
//!     .lease_request(512 << 20)
//!     .wait(Duration::from_secs(5))
//!     .label("kv-cache")
//!     .send()
//!     .await?;
//! if let Ok(mut mapping) = lease.map() {
//!     mapping[0] = 42;
//! }
//! lease.release().await?;
//! # Ok(()) }
//! ```
//!
//! **Latency.** A pooled lease is one gRPC round trip over the Unix socket (~50 us on a
//! 2-core machine). A worker that acquires from one loop gets the lowest latency on a
//! current-thread runtime (`#[tokio::main(flavor = "current_thread")]`): the
//! multi-threaded runtime adds thread wake-ups to every call (see `docs/benchmarks.md`).
//! A session that retains its released blocks mapped ([`Session::retain_mappings`]) leases
//! them again without a gRPC call, on its lease line (a kept connection to the ticket
//! socket): about a third of the round trip.
//!
//! **Reconnection** is opt-in ([`SessionBuilder::reconnect`], module [`reconnect`]): a
//! session the broker loses (restart, crash, shutdown, broken connection) is re-opened
//! with exponential [`Backoff`]; the application hears [`SessionEvent::Disconnected`],
//! then [`SessionEvent::Reconnected`] listing the leases that died with the old session
//! (their [`Lease`] objects are dead: `release()` returns [`ClientError::LeaseLost`],
//! drop sends nothing), or [`SessionEvent::Closed`] when the broker refuses for good
//! (token revoked, tenant deleted). **Reclaim**: register a handler with
//! [`Session::on_reclaim`] (or read [`Session::events`]) and release the requested
//! lease before the deadline; `examples/reclaim_worker.rs` shows both.
//!
//! ```no_run
//! # async fn demo(client: gpu_broker_client::Client) -> Result<(), gpu_broker_client::ClientError> {
//! use futures::StreamExt;
//! use gpu_broker_client::{Backoff, SessionEvent};
//!
//! let session = client.session_builder("trainer-3").reconnect(Backoff::default()).await?;
//! let mut events = session.events();
//! while let Some(event) = events.next().await {
//!     match event {
//!         SessionEvent::Reconnected { lost_leases, .. } => { /* re-acquire */ }
//!         SessionEvent::Closed { reason } => break,
//!         _ => {}
//!     }
//! }
//! # Ok(()) }
//! ```

mod address_range;
pub mod admin;
pub mod audit;
pub mod client;
pub mod connect;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod descriptor_channel;
pub mod device;
pub mod drain;
mod driven;
pub mod error;
pub mod events;
pub mod fd;
mod generation;
mod handshake;
pub mod info;
pub mod lease;
pub mod lease_info;
mod lease_line;
pub mod mapping;
pub mod ordinal;
mod paging;
mod pump;
pub mod quarantine;
pub mod reconnect;
pub mod reservation;
mod retained;
pub mod session;
pub mod session_info;
pub mod shared;
pub mod sleep;
pub mod table;
pub mod tenant;
mod ticket_channel;
pub mod token;
pub mod turn;
pub mod units;

/// The generated gRPC types and clients, for what this crate does not wrap.
pub use gpu_broker_proto as proto;

pub use admin::AdminClient;
pub use audit::{AuditEntry, AuditFilter};
pub use client::Client;
pub use connect::ConnectOptions;
pub use device::DeviceInfo;
pub use drain::{DeviceDrain, DrainStatus};
pub use error::{ClientError, Code};
pub use events::{ReclaimRequest, SessionEvent, SessionEvents};
pub use fd::{FdInfo, MemoryKind};
pub use info::{version_warning, BrokerInfo, RestartInfo, REQUIRED_API_REVISION};
pub use lease::{Lease, LeaseHandle, LeaseInfo, LeaseRequest, LeaseState, Tier};
pub use mapping::HostMapping;
pub use quarantine::{HoldReason, QuarantinedBlock};
pub use reconnect::Backoff;
pub use reservation::{ProcessReservation, ReservationInfo, ReservationRequest};
pub use session::{Session, SessionBuilder};
pub use session_info::SessionInfo;
pub use shared::{ReadOnlyMapping, SharedImport, SharedImportInfo, SharedLeaseInfo};
pub use sleep::{AutoSleep, Contents, Resident, Staging};
pub use tenant::{QuotaChange, QuotaPatch, QuotaSpec, TenantInfo, Usage, UsageCounters};
pub use token::{IssuedToken, TokenInfo, TokenOptions, TokenScope};
pub use turn::{Turn, TurnEnd, TurnRequest};
