//! Managed MPS (`gpu-broker --mps`): the broker runs its own NVIDIA MPS control daemon
//! with private pipe and log directories, so that the driver enforces each reserved
//! process's memory limit (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`) and compute share
//! (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`). [`Mps`] is the facade: its state for status,
//! and [`Mps::client_env`], the variables of a reserved process (refused while the
//! daemon is down). The parts: [`control`] drives the control binary, [`supervisor`]
//! keeps the daemon alive, [`env`] builds a client's variables, [`compute_mode`] reads
//! the devices' compute mode, [`status`] is what is shown (the admin service puts it in
//! the device list: `service/mps_report.rs`). `docs/mps.md` says what is enforced by
//! whom.

pub mod compute_mode;
pub mod control;
pub mod env;
pub mod status;
pub mod supervisor;

pub use env::{thread_percentage, MpsEnv};
pub use status::{MpsState, MpsStatus};
pub use supervisor::Timings;

use crate::error::{BrokerError, BrokerResult};
use parking_lot::Mutex;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The broker's MPS flags.
#[derive(Clone, Debug, clap::Args)]
pub struct MpsFlags {
    /// Run a private NVIDIA MPS control daemon and give reserved processes driver-enforced
    /// memory limits and compute shares (docs/mps.md).
    #[arg(long, env = "GPU_BROKER_MPS")]
    pub mps: bool,

    /// The MPS control binary.
    #[arg(
        long,
        env = "GPU_BROKER_MPS_CONTROL",
        default_value = "nvidia-cuda-mps-control"
    )]
    pub mps_control: PathBuf,

    /// Pipe directory of the broker's MPS daemon (default: `mps` beside --socket).
    #[arg(long, env = "GPU_BROKER_MPS_PIPE_DIR")]
    pub mps_pipe_dir: Option<PathBuf>,

    /// Log directory of the broker's MPS daemon (default: `<state-dir>/mps-log`).
    #[arg(long, env = "GPU_BROKER_MPS_LOG_DIR")]
    pub mps_log_dir: Option<PathBuf>,

    /// The MPS control daemon runs in its own unit (`deploy/gpu-broker-mps.service`, same
    /// pipe directory), so that a broker restart or stop leaves it and its servers to the
    /// reserved processes: the broker adopts it and waits for it, and never starts or
    /// quits it (docs/mps.md).
    #[arg(long, env = "GPU_BROKER_MPS_EXTERNAL_DAEMON")]
    pub mps_external_daemon: bool,

    /// How often the MPS daemon is checked (and restarted, with backoff, when it does not
    /// answer).
    #[arg(long, env = "GPU_BROKER_MPS_HEALTH_INTERVAL", default_value = crate::defaults::text(crate::defaults::MPS_HEALTH_INTERVAL), value_parser = crate::units::parse_duration)]
    pub mps_health_interval: Duration,

    /// Device memory a client's CUDA context and libraries take out of its pinned limit
    /// (measured on an H200, driver 580: 0.5-0.75 GiB): added to every reservation under
    /// managed MPS, to its pinned limit and to what the tenant is charged, so the program
    /// can allocate the memory it asked for.
    #[arg(long, env = "GPU_BROKER_MPS_CONTEXT_OVERHEAD", default_value = "768MiB", value_parser = crate::units::parse)]
    pub mps_context_overhead: u64,
}

impl MpsFlags {
    /// The control settings these flags give, with the defaults placed beside `socket`
    /// and in `state_dir`.
    pub fn control(
        &self,
        socket: &Path,
        state_dir: &Path,
        devices: Option<&[u32]>,
    ) -> control::Control {
        let runtime = socket.parent().unwrap_or(Path::new("/run/gpu-broker"));
        control::Control {
            binary: self.mps_control.clone(),
            pipe_dir: self
                .mps_pipe_dir
                .clone()
                .unwrap_or_else(|| runtime.join("mps")),
            log_dir: self
                .mps_log_dir
                .clone()
                .unwrap_or_else(|| state_dir.join("mps-log")),
            visible_devices: devices.map(|d| {
                d.iter()
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            }),
            timeout: Duration::from_secs(5),
            external: self.mps_external_daemon,
        }
    }

    /// The supervision timings these flags give.
    pub fn timings(&self) -> Timings {
        Timings {
            health_interval: self.mps_health_interval.max(Duration::from_millis(10)),
            ..Timings::default()
        }
    }
}

/// The broker's managed MPS daemon.
pub struct Mps {
    shared: Arc<supervisor::Shared>,
    devices: std::sync::atomic::AtomicU32,
    /// Bytes added to every reservation for the client's context (`--mps-context-overhead`).
    context_overhead: std::sync::atomic::AtomicU64,
    stop: CancellationToken,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Mps {
    /// Starts supervising a daemon for `devices` devices (with their compute modes, as
    /// [`compute_mode::read`] gives them). Waits for the first start attempt, so that a
    /// broker that serves after this has a running daemon or a reason why not.
    pub async fn start(
        control: control::Control,
        timings: Timings,
        devices: u32,
        compute_modes: Vec<String>,
    ) -> Arc<Mps> {
        let shared = Arc::new(supervisor::Shared {
            control,
            timings,
            status: Mutex::new(MpsStatus::new(compute_modes)),
        });
        let stop = CancellationToken::new();
        let task = tokio::spawn(supervisor::run(shared.clone(), stop.clone()));
        let mps = Arc::new(Mps {
            shared,
            devices: devices.into(),
            context_overhead: 0.into(),
            stop,
            task: Mutex::new(Some(task)),
        });
        let deadline = tokio::time::Instant::now() + timings.start_timeout + Duration::from_secs(1);
        while mps.status().state == MpsState::Starting && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        mps
    }

    /// What the supervisor knows now.
    pub fn status(&self) -> MpsStatus {
        self.shared.status.lock().clone()
    }

    /// Sets how many devices the daemon serves (once the broker has opened them).
    pub fn set_device_count(&self, devices: u32) {
        self.devices
            .store(devices, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets the bytes a client's CUDA context and libraries take out of its pinned limit;
    /// every reservation gets them on top of what it asked for.
    pub fn set_context_overhead(&self, bytes: u64) {
        self.context_overhead
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// What [`Mps::set_context_overhead`] set (0 by default).
    pub fn context_overhead(&self) -> u64 {
        self.context_overhead
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The pipe directory clients connect through.
    pub fn pipe_dir(&self) -> &Path {
        &self.shared.control.pipe_dir
    }

    /// The variables of a process reserved `limit_bytes` on `device` with `percentage` of
    /// its SMs (see [`thread_percentage`]). `UNAVAILABLE` while the daemon is not
    /// running: a process started then would run outside MPS, without its limit.
    pub fn client_env(
        &self,
        device: u32,
        limit_bytes: u64,
        percentage: u32,
    ) -> BrokerResult<MpsEnv> {
        let devices = self.devices.load(std::sync::atomic::Ordering::Relaxed);
        if device >= devices {
            return Err(BrokerError::unknown_mps_device(device, devices));
        }
        let s = self.status();
        if s.state != MpsState::Running {
            return Err(BrokerError::MpsNotRunning {
                state: s.state.as_str(),
                summary: s.summary(),
            });
        }
        Ok(env::client_env(
            &self.shared.control.pipe_dir,
            &self.shared.control.log_dir,
            limit_bytes,
            percentage,
        ))
    }

    /// Stops supervising and stops the daemon (`quit`; killed if it stays), unless it is
    /// an external one (left running). Idempotent.
    pub async fn shutdown(&self) {
        self.stop.cancel();
        let task = self.task.lock().take();
        if let Some(t) = task {
            let _ = t.await;
        }
    }
}

impl Drop for Mps {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests;
