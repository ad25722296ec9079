//! NVML kept initialised for the daemon's life when its backend may be CUDA. The start
//! asks NVML several things before serving (compute modes, MIG, faults, the process
//! monitor), each with an `Nvml::init` of its own; NVML counts its initialisations, so
//! while this one lives the later ones find it loaded instead of each loading the
//! driver's state again (and dropping it after). Started beside opening the devices.

use crate::backend::BackendChoice;
use std::sync::OnceLock;

static HELD: OnceLock<Option<nvml_wrapper::Nvml>> = OnceLock::new();

/// Initialises NVML on a thread of its own and keeps it (nothing for the host backend,
/// nor where NVML cannot start: each later user then finds that out as before).
pub fn start(backend: BackendChoice) {
    if backend == BackendChoice::Host {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("nvml-warm".into())
        .spawn(|| {
            HELD.get_or_init(|| nvml_wrapper::Nvml::init().ok());
        });
    if let Err(e) = spawned {
        tracing::debug!(error = %e, "cannot start NVML early");
    }
}
