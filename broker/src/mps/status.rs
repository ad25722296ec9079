//! What the broker knows about its MPS control daemon at a moment: its state, pid,
//! servers and clients, restarts, and the last failure. Shown by `GetDevices`,
//! `gpu-brokerctl status` and the metrics.

use std::time::SystemTime;

/// The control daemon's state as the supervisor last saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MpsState {
    /// Being started (or adopted) and not yet answering.
    Starting,
    /// Answers its control commands: MPS reservations are admitted.
    Running,
    /// Not answering (died, failed to start); restarted after a backoff. MPS reservations
    /// are refused meanwhile.
    Down,
    /// Being stopped, or stopped, at shutdown.
    Stopped,
}

impl MpsState {
    /// The lower-case name shown to operators.
    pub fn as_str(self) -> &'static str {
        match self {
            MpsState::Starting => "starting",
            MpsState::Running => "running",
            MpsState::Down => "down",
            MpsState::Stopped => "stopped",
        }
    }
}

/// A snapshot of the supervisor's view.
#[derive(Clone, Debug)]
pub struct MpsStatus {
    pub state: MpsState,
    /// The control daemon's pid (from its pid file), when known.
    pub daemon_pid: Option<u32>,
    /// Pids of the MPS servers (one per uid being served).
    pub servers: Vec<u32>,
    /// Pids of the client processes connected to those servers.
    pub clients: Vec<u32>,
    /// Times the daemon was started again after it went down.
    pub restarts: u32,
    /// Why it last went down or failed to start ("" if never).
    pub last_error: String,
    /// When the state last changed.
    pub since: SystemTime,
    /// Compute mode of each device ("Default", "ExclusiveProcess", ... or "unknown").
    pub compute_modes: Vec<String>,
}

impl MpsStatus {
    pub(crate) fn new(compute_modes: Vec<String>) -> MpsStatus {
        MpsStatus {
            state: MpsState::Starting,
            daemon_pid: None,
            servers: Vec::new(),
            clients: Vec::new(),
            restarts: 0,
            last_error: String::new(),
            since: SystemTime::now(),
            compute_modes,
        }
    }

    /// One line for operators: `running (pid 123, 2 clients)`, `down: why`.
    pub fn summary(&self) -> String {
        match self.state {
            MpsState::Running => format!(
                "running (pid {}, {} server(s), {} client(s), {} restart(s))",
                self.daemon_pid
                    .map(|p| p.to_string())
                    .unwrap_or_else(|| "?".into()),
                self.servers.len(),
                self.clients.len(),
                self.restarts
            ),
            MpsState::Down => format!("down: {}", self.last_error),
            s => s.as_str().to_string(),
        }
    }
}
