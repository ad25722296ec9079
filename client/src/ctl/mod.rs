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

/// A size flag's parser: [`parse_bytes`](gpu_broker_client::units::parse_bytes), and a note
/// on standard error when the size is decimal (`4GB` is 3.7 GiB, not 4), so that a table
/// showing binary units later holds no surprise.
pub fn size_arg(text: &str) -> Result<u64, String> {
    let bytes = gpu_broker_client::units::parse_bytes(text)?;
    if let Some(note) = gpu_broker_client::units::decimal_note(text) {
        eprintln!("note: {note}");
    }
    Ok(bytes)
}

/// Width the default tables fit (`--wide` lifts it).
pub const WIDTH: usize = 100;
