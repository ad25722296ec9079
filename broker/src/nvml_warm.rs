//! NVML kept initialised while the daemon runs when its backend may be CUDA. The start
//! asks NVML several things before serving (compute modes, MIG, faults, the process
//! monitor), each with an `Nvml::init` of its own; NVML counts its initialisations, so
//! while this one lives the later ones find it loaded instead of each loading the
//! driver's state again (and dropping it after). Started beside opening the devices.

use crate::backend::BackendChoice;

/// An NVML initialised on a thread of its own (held in the thread's result until this
/// drops; nothing for the host backend, nor where NVML cannot start: each later user
/// then finds that out as before).
pub struct WarmNvml {
    _held: Option<std::thread::JoinHandle<Option<nvml_wrapper::Nvml>>>,
}

/// Starts initialising NVML; keep the result for as long as the daemon runs.
pub fn start(backend: BackendChoice) -> WarmNvml {
    if backend == BackendChoice::Host {
        return WarmNvml { _held: None };
    }
    let spawned = std::thread::Builder::new()
        .name("nvml-warm".into())
        .spawn(|| nvml_wrapper::Nvml::init().ok());
    match spawned {
        Ok(h) => WarmNvml { _held: Some(h) },
        Err(e) => {
            tracing::debug!(error = %e, "cannot start NVML early");
            WarmNvml { _held: None }
        }
    }
}
