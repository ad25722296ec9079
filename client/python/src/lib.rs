//! `gpubroker._native`: the native half of the `gpubroker` Python package. It wraps the
//! `gpu-broker-client` crate (one implementation of sessions, keepalive, events,
//! reconnection and the CUDA handle cache) in Python classes ([`api`]), maps client
//! errors to the package's exceptions ([`errors`]), runs every call on one tokio runtime
//! without holding the GIL ([`rt`]), and exports the C hooks of the PyTorch allocator
//! ([`torch`]). The Python half (`python/gpubroker/`) adds `connect()`'s defaults, the
//! exception and event classes, and the numpy/torch/CuPy views.

pub mod api;
pub mod errors;
pub mod regions;
pub mod rt;
pub mod share;
pub mod sleep;
pub mod torch;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(api::_connect, m)?)?;
    m.add_class::<api::Broker>()?;
    m.add_class::<api::PySession>()?;
    m.add_class::<api::PyLease>()?;
    m.add_class::<api::Memory>()?;
    m.add_class::<api::EventStream>()?;
    m.add_class::<api::PyUsage>()?;
    m.add_class::<sleep::PyResident>()?;
    m.add_class::<sleep::ResidentMemory>()?;
    m.add_function(wrap_pyfunction!(torch::_torch_install, m)?)?;
    m.add_function(wrap_pyfunction!(torch::_torch_stats, m)?)?;
    m.add_function(wrap_pyfunction!(torch::_torch_empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(torch::_torch_take_last_error, m)?)?;
    m.add_function(wrap_pyfunction!(torch::_torch_lease_ids, m)?)?;
    m.add_function(wrap_pyfunction!(torch::_torch_sleep, m)?)?;
    m.add_function(wrap_pyfunction!(torch::_torch_wake, m)?)?;
    m.add_function(wrap_pyfunction!(torch::_torch_asleep, m)?)?;
    m.add_function(wrap_pyfunction!(torch::_torch_set_stream_block_flush, m)?)?;
    m.add_function(wrap_pyfunction!(regions::_regions_configure, m)?)?;
    m.add_function(wrap_pyfunction!(regions::_region_enter, m)?)?;
    m.add_function(wrap_pyfunction!(regions::_regions_pause, m)?)?;
    m.add_function(wrap_pyfunction!(regions::_regions_resume, m)?)?;
    m.add_function(wrap_pyfunction!(regions::_regions_stats, m)?)?;
    m.add_function(wrap_pyfunction!(share::_torch_share, m)?)?;
    m.add_function(wrap_pyfunction!(share::_torch_import, m)?)?;
    m.add_class::<share::ImportedSegment>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("REASON_CODES", errors::reason_codes())?;
    m.add(
        "REQUIRED_API_REVISION",
        gpu_broker_client::REQUIRED_API_REVISION,
    )?;
    Ok(())
}
