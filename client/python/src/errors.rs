//! Client errors as Python exceptions. The exception classes live in
//! `gpubroker/errors.py` (all subclasses of `gpubroker.BrokerError`); this module picks
//! the class for a [`ClientError`]'s gRPC code and builds it with the broker's message,
//! the code's name and the broker's machine-readable reason when it sent one.

use gpu_broker_client::{ClientError, Code};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

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

fn build(class: &str, message: &str, code: &str, reason: Option<&str>) -> PyErr {
    Python::attach(|py| {
        let made = py.import("gpubroker.errors").and_then(|m| {
            let cls = m.getattr(class)?;
            let kwargs = pyo3::types::PyDict::new(py);
            kwargs.set_item("code", code)?;
            kwargs.set_item("reason", reason)?;
            cls.call((message,), Some(&kwargs))
        });
        match made {
            Ok(obj) => PyErr::from_value(obj),
            Err(e) => PyRuntimeError::new_err(format!(
                "{code}: {message} (gpubroker.errors unavailable: {e})"
            )),
        }
    })
}

/// A [`ClientError`] as the matching `gpubroker.errors` exception.
pub fn to_py(err: ClientError) -> PyErr {
    let code = err.code();
    let class = class_for(code);
    let message = err.message();
    // The broker sends no machine-readable reason beyond the status code today; `.reason`
    // is None until the client crate carries one.
    build(
        class,
        &message,
        gpu_broker_client::error::code_name(code),
        None,
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
    build(class, message, code, None)
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
