//! The gpu-broker gRPC API (`gpubroker.v1`): the `Broker` service for workers, the
//! `Admin` service for operators, and the messages they share. Generated at build time
//! from `proto/gpubroker/v1/*.proto`; nothing here is written by hand but this file.

#![allow(clippy::all, missing_docs)]

/// Package `gpubroker.v1`.
pub mod v1 {
    tonic::include_proto!("gpubroker.v1");
}

/// Encoded `FileDescriptorSet` of the API, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("gpubroker_descriptor");

pub use v1::*;
