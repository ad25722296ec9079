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

    /// Sent instead of a ticket as a connection's first 32 bytes: this process asks for
    /// the connection to be its **descriptor channel**, where the broker sends the
    /// descriptors of the leases it grants this process (`AcquireLeaseRequest.push_descriptor`).
    /// No ticket is these bytes (tickets are random); an older broker takes them for an
    /// unknown ticket and closes the connection.
    pub const CHANNEL_HELLO: [u8; 32] = *b"gpu-broker descriptor channel v1";
    /// The one byte a broker answers [`CHANNEL_HELLO`] with when the connection is this
    /// process's descriptor channel from now on (any other answer: it is not).
    pub const CHANNEL_OPEN_REPLY: u8 = 0x04;
    /// The first byte of a descriptor sent on a descriptor channel: it carries the
    /// descriptor (`SCM_RIGHTS`) and is followed by the 16 bytes of the lease's id.
    pub const PUSHED_FD: u8 = 0x05;
    /// Length of one message on a descriptor channel: [`PUSHED_FD`] and the lease id.
    pub const PUSHED_LEN: usize = 17;

    /// Sent instead of a ticket as a connection's first 32 bytes, followed by the 16 bytes
    /// of a session's id: this process asks for the connection to be that session's
    /// **lease line**, where the blocks it retained are leased and released again without
    /// a gRPC call (frames below). Only the session's own process may open it; any answer
    /// but [`LINE_OPEN_REPLY`] (a close, [`BUSY_REPLY`]) means it is not one.
    pub const LINE_HELLO: [u8; 32] = *b"gpu-broker retained lease line 1";
    /// Length of a lease line's hello: [`LINE_HELLO`] and the session id.
    pub const LINE_HELLO_LEN: usize = 48;
    /// The one byte a broker answers [`LINE_HELLO`] with when the connection is the
    /// session's lease line from now on.
    pub const LINE_OPEN_REPLY: u8 = 0x06;
    /// A frame on a lease line, either way: one kind byte, the payload's length (4 bytes,
    /// little-endian), the payload (a protobuf message of this API).
    pub const LINE_FRAME_HEAD: usize = 5;
    /// The longest payload a lease line carries; a longer frame closes the line.
    pub const LINE_MAX_PAYLOAD: usize = 4096;
    /// Request: an `AcquireLeaseRequest` of the line's session.
    pub const LINE_ACQUIRE: u8 = 0x01;
    /// Request: a `ReleaseLeaseRequest` with `retain_mapping` and `may_decline`.
    pub const LINE_RELEASE: u8 = 0x02;
    /// Answer to [`LINE_ACQUIRE`]: an `AcquireLeaseResponse`, a block the process retained.
    pub const LINE_GRANTED: u8 = 0x01;
    /// Answer to [`LINE_RELEASE`]: a `ReleaseLeaseResponse`.
    pub const LINE_RELEASED: u8 = 0x02;
    /// Answer to either, with no payload: nothing was done; ask the same over gRPC, which
    /// answers it whatever it is (no retained block fits, a refusal, a lease unknown).
    pub const LINE_NOT_HERE: u8 = 0x03;

    /// A lease line frame of `kind` carrying `payload` (at most [`LINE_MAX_PAYLOAD`]).
    pub fn line_frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(LINE_FRAME_HEAD + payload.len());
        out.push(kind);
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// The payload length a lease line frame's head announces; `None` past
    /// [`LINE_MAX_PAYLOAD`] (not a frame: the line closes).
    pub fn line_payload_len(head: &[u8; LINE_FRAME_HEAD]) -> Option<usize> {
        let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
        (len <= LINE_MAX_PAYLOAD).then_some(len)
    }
}
