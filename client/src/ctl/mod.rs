//! Parts of `gpu-brokerctl` beyond the one-call-one-table commands: writing secrets to
//! files and the operator views built from several admin calls. Each view lives in its own
//! module; `gpu-brokerctl.rs` only parses the command line and dispatches.

pub mod address;
pub mod drain;
pub mod leaks;
pub mod run;
pub mod secret_file;
pub mod shared;
pub mod status;
pub mod top;

/// Width the default tables fit (`--wide` lifts it).
pub const WIDTH: usize = 100;
