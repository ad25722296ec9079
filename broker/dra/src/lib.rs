//! The Kubernetes DRA driver for gpu-broker: a client of the node's broker (its Admin
//! service over gRPC), never inside it.
//!
//! * `plugin.rs` serves the kubelet's plugin API on Unix sockets: registration
//!   (`pluginregistration.Registration`), the DRA node service (v1 and v1beta1) and the
//!   devices' health (`health.rs`, `DRAResourceHealth`).
//! * `driver.rs` prepares and unprepares claims: the allocated ResourceClaim (read from the
//!   API server) becomes a claim reservation at the broker with a token bound to it, handed
//!   to the container through a CDI spec (`cdi.rs`); each step is recorded in the
//!   checkpoint (`checkpoint.rs`) so a restart completes or rolls back nothing twice.
//! * `slice.rs` builds the node's ResourceSlice from the broker's devices; `publisher.rs`
//!   keeps it current in the API server.
//! * `broker.rs` is the broker client; `allocation.rs` reads a claim's allocation;
//!   `quantity.rs` Kubernetes quantities.

pub mod allocation;
pub mod broker;
pub mod cdi;
pub mod checkpoint;
pub mod driver;
pub mod health;
pub mod plugin;
pub mod publisher;
pub mod quantity;
pub mod slice;

/// The driver's name: the ResourceSlices' `spec.driver`, the DeviceClass's selector and the
/// kubelet plugin's registered name.
pub const DRIVER_NAME: &str = "gpu-broker.io";

/// The kubelet's plugin protos (vendored from kubernetes/kubelet `pkg/apis`).
pub mod pb {
    /// `pluginregistration.Registration` (the kubelet's plugin watcher).
    pub mod registration {
        tonic::include_proto!("pluginregistration");
    }
    /// The DRA node service, v1 (kubelet 1.34+).
    pub mod dra_v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    /// The DRA node service, v1beta1 (kubelet 1.32-1.33); the same messages.
    pub mod dra_v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
    /// The device-health service `DRAResourceHealth`, v1 (kubelet 1.37+).
    pub mod health_v1 {
        tonic::include_proto!("v1");
    }
    /// The device-health service, v1alpha1 (kubelet 1.34-1.36); the same messages.
    pub mod health_v1alpha1 {
        tonic::include_proto!("v1alpha1");
    }
}
