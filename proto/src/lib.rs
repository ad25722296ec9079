//! The gpu-broker gRPC API (`gpubroker.v1`): the `Broker` service for workers, the
//! `Admin` service for operators, and the messages they share. Generated at build time
//! from `proto/gpubroker/v1/*.proto`; nothing here is written by hand but this file and
//! [`reason`]. Also what both sides must spell alike: the refusal reasons ([`reason`]) and
//! the bytes of the ticket socket's replies ([`ticket`]).

#![allow(clippy::all, missing_docs)]

/// Package `gpubroker.v1`.
pub mod v1 {
    tonic::include_proto!("gpubroker.v1");
}

/// Encoded `FileDescriptorSet` of the API, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("gpubroker_descriptor");

/// The gRPC path of every method, one list per service (`ADMIN`, `BROKER`), read from
/// the descriptor set at build time: for checks that must cover every method.
pub mod paths {
    include!(concat!(env!("OUT_DIR"), "/gpubroker_paths.rs"));
}

pub use v1::*;

pub mod reason;

/// The ticket socket's replies: after a worker sends a lease ticket (the bytes of a
/// `FdTicket`), the broker answers one data byte, with the lease's descriptor attached
/// (`SCM_RIGHTS`) only to [`FD_REPLY`](ticket::FD_REPLY).
pub mod ticket {
    /// The one byte (with no descriptor) a connection over a limit gets before it is
    /// closed: its ticket was not looked at, so the client may present it again after a
    /// pause.
    pub const BUSY_REPLY: u8 = 0x00;
    /// The byte that carries the descriptor of a redeemed ticket.
    pub const FD_REPLY: u8 = 0x01;
    /// The one byte (with no descriptor) the rightful holder of a ticket gets when the
    /// ticket's lease ended (reclaimed, revoked, released or its session ended) before it
    /// was redeemed.
    pub const LEASE_ENDED_REPLY: u8 = 0x02;
    /// The one byte (with no descriptor) a refused ticket gets on a kept connection (one
    /// that already brought a descriptor) before it is closed, so that the client tells a
    /// refusal from a kept connection the broker let go. A connection's first ticket is
    /// refused with the bare close, as before.
    pub const REFUSED_REPLY: u8 = 0x03;
}
