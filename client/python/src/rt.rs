//! The one tokio runtime of the extension, and how Python threads wait on it. Every
//! blocking call releases the GIL (`Python::detach`); calls that may wait long (a lease
//! request with a wait, the next session event) poll in short slices and check for
//! signals between them, so Ctrl-C interrupts them. The runtime's threads do not survive
//! `fork`: in a forked child every call fails with a clear error instead of hanging.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;
use tokio::runtime::{Handle, Runtime};

use crate::errors;

struct Rt {
    runtime: Runtime,
    pid: u32,
}

static RT: OnceLock<Rt> = OnceLock::new();

fn rt() -> &'static Rt {
    RT.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("gpubroker-rt")
            .enable_all()
            .build()
            // Building a runtime fails only when the OS refuses threads; nothing to do then.
            .unwrap_or_else(|e| panic!("gpubroker: cannot start the tokio runtime: {e}"));
        Rt {
            runtime,
            pid: std::process::id(),
        }
    })
}

/// The runtime's handle (started on first use).
pub fn handle() -> Handle {
    rt().runtime.handle().clone()
}

/// True in the process that started the runtime (false in a forked child).
pub fn same_process() -> bool {
    RT.get().is_none_or(|r| r.pid == std::process::id())
}

/// Fails in a forked child: the runtime's threads are not there.
pub fn check_process() -> PyResult<()> {
    if same_process() {
        Ok(())
    } else {
        Err(errors::local(
            "FailedPrecondition",
            "gpubroker objects cannot be used in a forked child process (the broker \
             connection belongs to the parent); call gpubroker.connect() in the child",
        ))
    }
}

/// Runs a short call to completion without the GIL.
pub fn block_on<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    check_process()?;
    let handle = handle();
    Ok(py.detach(|| handle.block_on(fut)))
}

/// Waits for `fut` without the GIL, polling it on the calling thread inside the runtime
/// in 100 ms slices and checking for signals between them (a `KeyboardInterrupt` drops,
/// and so cancels, the call). `None` when `timeout` passed first.
pub fn wait<F>(py: Python<'_>, fut: F, timeout: Option<Duration>) -> PyResult<Option<F::Output>>
where
    F: Future + Send,
    F::Output: Send,
{
    check_process()?;
    let handle = handle();
    let mut fut = Box::pin(fut);
    let deadline = timeout.map(|t| std::time::Instant::now() + t);
    loop {
        let slice = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Ok(None);
                }
                left.min(Duration::from_millis(100))
            }
            None => Duration::from_millis(100),
        };
        let polled = py
            .detach(|| handle.block_on(async { tokio::time::timeout(slice, fut.as_mut()).await }));
        match polled {
            Ok(out) => return Ok(Some(out)),
            Err(_elapsed) => py.check_signals()?,
        }
    }
}

/// Seconds given from Python as a `Duration`: a non-negative number one holds
/// (`InvalidArgument` otherwise: NaN, negative, infinite, or past ~584 billion years).
pub fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    if !value.is_finite() || value < 0.0 {
        return Err(errors::local(
            "InvalidArgument",
            &format!("{name} must be a non-negative number of seconds, got {value}"),
        ));
    }
    Duration::try_from_secs_f64(value)
        .map_err(|e| errors::local("InvalidArgument", &format!("{name} = {value}: {e}")))
}
