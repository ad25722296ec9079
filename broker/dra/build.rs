//! Compiles the kubelet's plugin protos (vendored under `proto/`, from kubernetes/kubelet
//! `pkg/apis`) with protox, as `proto/` does for the broker's own API: registration
//! (`pluginregistration`) and the DRA node service, v1 and v1beta1.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/pluginregistration/v1/api.proto",
        "proto/dra/v1/api.proto",
        "proto/dra/v1beta1/api.proto",
        "proto/dra-health/v1/api.proto",
        "proto/dra-health/v1alpha1/api.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
