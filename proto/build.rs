//! Compiles `gpubroker/v1/*.proto` with protox (pure Rust, no system `protoc`) and
//! generates the prost messages and tonic services from the descriptor set. The encoded
//! descriptor set is written to `OUT_DIR` for gRPC server reflection.

use prost::Message;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "gpubroker/v1/common.proto",
        "gpubroker/v1/broker.proto",
        "gpubroker/v1/admin.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("gpubroker_descriptor.bin"),
        fds.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
