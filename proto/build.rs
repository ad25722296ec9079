//! Compiles `gpubroker/v1/*.proto` with protox (pure Rust, no system `protoc`) and
//! generates the prost messages and tonic services from the descriptor set. The encoded
//! descriptor set is written to `OUT_DIR` for gRPC server reflection, and so is the list
//! of every service's method paths (`paths`), read from the same descriptor set.

use prost::Message;
use std::fmt::Write as _;
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
    std::fs::write(out_dir.join("gpubroker_paths.rs"), method_paths(&fds))?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}

/// One constant per service, named as the service in capitals (`Admin`: `ADMIN`): the gRPC
/// path of each of its methods (`/gpubroker.v1.Admin/SetQuota`), in the order declared.
fn method_paths(fds: &prost_types::FileDescriptorSet) -> String {
    let mut out = String::new();
    for file in &fds.file {
        for service in &file.service {
            let full = format!("{}.{}", file.package(), service.name());
            let _ = writeln!(out, "/// Every method of `{full}`, as its gRPC path.");
            let _ = writeln!(
                out,
                "pub const {}: &[&str] = &[",
                service.name().to_uppercase()
            );
            for method in &service.method {
                let _ = writeln!(out, "    \"/{full}/{}\",", method.name());
            }
            let _ = writeln!(out, "];");
        }
    }
    out
}
