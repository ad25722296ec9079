//! Client errors as Python exceptions. The exception classes live in
//! `gpubroker/errors.py` (all subclasses of `gpubroker.BrokerError`); this module picks
//! the class for a [`ClientError`]'s gRPC code and builds it (through
//! `gpubroker.errors._make`, which picks the reason's subclass) with the broker's message,
//! the code's name, and the broker's machine-readable reason and its values when it sent
//! them.

use gpu_broker_client::{ClientError, Code};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use std::collections::BTreeMap;

/// Every reason the broker sends, with its code's name (`_native.REASON_CODES`): the list
/// `gpubroker.errors.REASONS` is checked against.
pub fn reason_codes() -> BTreeMap<&'static str, &'static str> {
    gpu_broker_client::error::Reason::KNOWN
        .iter()
        .filter_map(|r| Some((r.as_str(), gpu_broker_client::error::code_name(r.code()?))))
        .collect()
}

/// The `gpubroker.errors` class for a gRPC code.
pub fn class_for(code: Code) -> &'static str {
    match code {
        Code::ResourceExhausted => "QuotaExceeded",
        Code::DeadlineExceeded => "WaitTimeout",
        Code::Unauthenticated => "Unauthenticated",
        Code::PermissionDenied => "PermissionDenied",
        Code::NotFound => "NotFound",
        Code::InvalidArgument => "InvalidArgument",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Unavailable => "Unavailable",
        _ => "BrokerError",
    }
}

fn build(
    class: &str,
    message: &str,
    code: &str,
    reason: Option<&str>,
    details: Option<&BTreeMap<String, String>>,
) -> PyErr {
    Python::attach(|py| {
        let made = py.import("gpubroker.errors").and_then(|m| {
            let base = m.getattr(class)?;
            let details = match details {
                Some(d) => d.clone().into_pyobject(py)?.into_any(),
                None => pyo3::types::PyDict::new(py).into_any(),
            };
            m.getattr("_make")?
                .call1((base, message, code, reason, details))
        });
        match made {
            Ok(obj) => PyErr::from_value(obj),
            Err(e) => PyRuntimeError::new_err(format!(
                "{code}: {message} (gpubroker.errors unavailable: {e})"
            )),
        }
    })
}

/// A [`ClientError`] as the matching `gpubroker.errors` exception: the class of its
/// reason where the broker sent one (`gpubroker.errors.REASONS`), else of its code.
pub fn to_py(err: ClientError) -> PyErr {
    let code = err.code();
    let class = class_for(code);
    let message = err.message();
    let refusal = err.refusal();
    build(
        class,
        &message,
        gpu_broker_client::error::code_name(code),
        err.reason().map(|r| r.as_str()),
        refusal.map(|r| &r.metadata),
    )
}

/// A local failure (no broker involved) as a `gpubroker.errors` exception.
pub fn local(class: &str, message: &str) -> PyErr {
    let code = match class {
        "FailedPrecondition" => "FAILED_PRECONDITION",
        "InvalidArgument" => "INVALID_ARGUMENT",
        "Unavailable" => "UNAVAILABLE",
        "NotFound" => "NOT_FOUND",
        "Unauthenticated" => "UNAUTHENTICATED",
        _ => "INTERNAL",
    };
    build(class, message, code, None, None)
}

/// `?`-friendly conversion.
pub trait IntoPyResult<T> {
    /// Maps the client error into its Python exception.
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, ClientError> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
