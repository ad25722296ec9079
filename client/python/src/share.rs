//! CUDA tensors on leases through `torch.multiprocessing`: the sending process publishes
//! the lease of the tensor's segment for its own tenant (once per segment lease), and the
//! receiving process imports that publication through the broker (its own ticket, its own
//! descriptor) and maps it read-write. The publisher stays charged, once; the import
//! keeps the memory alive while the receiver maps it.

use std::collections::HashMap;
use std::sync::OnceLock;

use parking_lot::Mutex;
use pyo3::prelude::*;

use gpu_broker_client::cuda::CudaMapping;
use gpu_broker_client::SharedImport;

use crate::api::PySession;
use crate::errors;
use crate::rt;
use crate::torch::{installed_allocator, segment_of};

/// Publications made, by segment lease id: the name.
fn published() -> &'static Mutex<HashMap<String, String>> {
    static P: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    P.get_or_init(Default::default)
}

/// Shares the segment holding device address `ptr` with the other processes of this
/// tenant: `(tenant, publication name, offset of ptr in it)`.
#[pyfunction]
pub fn _torch_share(py: Python<'_>, ptr: u64) -> PyResult<(String, String, u64)> {
    let a = installed_allocator()
        .ok_or_else(|| errors::local("FailedPrecondition", "gpubroker.torch is not installed"))?;
    rt::check_process()?;
    let tenant = a.backend().tenant();
    let handle = rt::handle();
    py.detach(|| {
        segment_of(ptr, |lease, base| {
            let lease = lease.ok_or_else(|| {
                errors::local(
                    "FailedPrecondition",
                    "the tensor's memory is asleep or paused: wake it before sharing",
                )
            })?;
            let id = lease.id().to_string();
            let mut names = published().lock();
            if let Some(name) = names.get(&id) {
                return Ok((tenant.clone(), name.clone(), ptr - base));
            }
            let name = format!("gpubroker.torch/{}/{id}", std::process::id());
            handle
                .block_on(lease.publish(&name, &[]))
                .map_err(errors::to_py)?;
            names.insert(id, name.clone());
            Ok((tenant.clone(), name, ptr - base))
        })
        .unwrap_or_else(|| {
            Err(errors::local(
                "InvalidArgument",
                &format!("{ptr:#x} is not in a segment of gpubroker.torch"),
            ))
        })
    })
}

/// A publication of this tenant imported and mapped read-write in this process: `ptr`,
/// `nbytes`, `device` (what `__cuda_array_interface__` views need). Unmapped and the
/// import released when the last view is gone.
#[pyclass(weakref, name = "ImportedSegment", module = "gpubroker._native")]
pub struct ImportedSegment {
    #[pyo3(get)]
    ptr: u64,
    #[pyo3(get)]
    nbytes: u64,
    #[pyo3(get)]
    device: u32,
    mapping: Mutex<Option<CudaMapping>>,
    import: Mutex<Option<SharedImport>>,
}

impl Drop for ImportedSegment {
    fn drop(&mut self) {
        // Unmap first; dropping the import releases it in the background.
        drop(self.mapping.lock().take());
        drop(self.import.lock().take());
    }
}

/// Imports `tenant`'s publication `name` on `session` and maps it read-write.
#[pyfunction]
pub fn _torch_import(
    py: Python<'_>,
    session: &PySession,
    tenant: String,
    name: String,
) -> PyResult<ImportedSegment> {
    rt::check_process()?;
    let session = session.client_session()?;
    let handle = rt::handle();
    py.detach(|| {
        let import = handle
            .block_on(session.import(&tenant, &name))
            .map_err(errors::to_py)?;
        let mapping = import.map_cuda_writable().map_err(errors::to_py)?;
        Ok(ImportedSegment {
            ptr: mapping.device_ptr(),
            nbytes: import.bytes(),
            device: mapping.device(),
            mapping: Mutex::new(Some(mapping)),
            import: Mutex::new(Some(import)),
        })
    })
}
