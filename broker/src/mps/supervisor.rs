//! Keeps the broker's MPS control daemon alive: starts it (or adopts one of ours that
//! still answers in our pipe directory, after a broker restart), checks every interval
//! that it answers, records its servers and clients, starts it again with exponential
//! backoff when it stops answering, and at shutdown sends `quit` and makes sure the
//! daemon is gone. An external daemon (`--mps-external-daemon`, its own systemd unit) is
//! only adopted and watched: never started, restarted or quit. The state it records is what [`super::Mps`] shows and admits by.

use super::control::{parse_pids, Control};
use super::status::{MpsState, MpsStatus};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio_util::sync::CancellationToken;

/// Timings of the supervision.
#[derive(Clone, Copy, Debug)]
pub struct Timings {
    /// How often the daemon is asked whether it answers.
    pub health_interval: Duration,
    /// Wait before the first restart; doubles with each failed attempt.
    pub backoff_initial: Duration,
    /// Longest wait between restarts. A daemon healthy this long resets the backoff.
    pub backoff_max: Duration,
    /// How long a fresh daemon gets to answer.
    pub start_timeout: Duration,
}

impl Default for Timings {
    fn default() -> Self {
        Timings {
            health_interval: crate::defaults::MPS_HEALTH_INTERVAL,
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
            start_timeout: Duration::from_secs(10),
        }
    }
}

/// The shared state the loop writes and the facade reads.
pub(crate) struct Shared {
    pub(crate) control: Control,
    pub(crate) timings: Timings,
    pub(crate) status: Mutex<MpsStatus>,
}

impl Shared {
    fn set(&self, state: MpsState, error: Option<String>) {
        let mut s = self.status.lock();
        if s.state != state {
            s.since = SystemTime::now();
        }
        s.state = state;
        if let Some(e) = error {
            s.last_error = e;
        }
        if state != MpsState::Running {
            s.servers.clear();
            s.clients.clear();
        }
    }

    /// Asks the daemon for its servers and their clients. Err: it does not answer.
    async fn probe(&self) -> Result<(Option<u32>, Vec<u32>, Vec<u32>), String> {
        let servers = parse_pids(
            &self
                .control
                .send("get_server_list")
                .await
                .map_err(|e| e.to_string())?,
        );
        let mut clients = Vec::new();
        for s in &servers {
            // A server that ended between the two calls has no clients to list.
            if let Ok(a) = self.control.send(&format!("get_client_list {s}")).await {
                clients.extend(parse_pids(&a));
            }
        }
        Ok((self.control.daemon_pid(), servers, clients))
    }

    fn record(&self, pid: Option<u32>, servers: Vec<u32>, clients: Vec<u32>) {
        let mut s = self.status.lock();
        s.daemon_pid = pid;
        s.servers = servers;
        s.clients = clients;
    }

    /// Starts a daemon (unless one of ours answers already) and waits until it answers;
    /// an external one is only looked for.
    async fn start(&self) -> Result<(), String> {
        if self.control.external {
            let (pid, servers, clients) = self.probe().await.map_err(|e| {
                format!(
                    "no MPS control daemon answers in {} (its own unit starts it: systemctl status gpu-broker-mps): {e}",
                    self.control.pipe_dir.display()
                )
            })?;
            tracing::info!(?pid, "the external MPS control daemon answers: adopted");
            self.record(pid, servers, clients);
            return Ok(());
        }
        for dir in [&self.control.pipe_dir, &self.control.log_dir] {
            let d = dir.clone();
            tokio::task::spawn_blocking(move || make_private_dir(&d))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        if let Ok((pid, servers, clients)) = self.probe().await {
            tracing::info!(
                ?pid,
                "an MPS control daemon already answers in the broker's pipe directory: adopted"
            );
            self.record(pid, servers, clients);
            return Ok(());
        }
        self.control
            .start_daemon()
            .await
            .map_err(|e| e.to_string())?;
        let deadline = Instant::now() + self.timings.start_timeout;
        let mut last = String::new();
        while Instant::now() < deadline {
            match self.probe().await {
                Ok((pid, servers, clients)) => {
                    self.record(pid, servers, clients);
                    return Ok(());
                }
                Err(e) => last = e,
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!(
            "started, but it did not answer within {} ms: {last}",
            self.timings.start_timeout.as_millis()
        ))
    }

    /// Sends `quit` and waits (up to the start timeout) for the daemon to go; kills it if
    /// it stays.
    pub(crate) async fn quit(&self) {
        if self.control.external {
            // Its own unit's: it serves the reserved processes on after the broker.
            tracing::info!("the external MPS control daemon is left running");
            self.set(MpsState::Stopped, None);
            return;
        }
        let pid = self.control.daemon_pid();
        match self.control.send("quit").await {
            Ok(_) => tracing::info!(?pid, "MPS control daemon: quit sent"),
            Err(e) => tracing::warn!(error = %e, "MPS control daemon: quit failed"),
        }
        if let Some(pid) = pid {
            let deadline = Instant::now() + self.timings.start_timeout;
            while Instant::now() < deadline && alive(pid) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if alive(pid) && super::control::is_mps_control(pid) {
                tracing::warn!(
                    pid,
                    "MPS control daemon still running after quit: killing it"
                );
                // SAFETY: a plain kill of a pid that runs the MPS control binary.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            } else if alive(pid) {
                tracing::warn!(
                    pid,
                    "the MPS pid file names a process that is not the control daemon: not killed"
                );
            }
        }
        self.set(MpsState::Stopped, None);
    }
}

use crate::process::process_alive as alive;

/// Creates `dir` (and parents) and makes it 01770: the broker's user and group (who may
/// use the broker's socket) reach the daemon; nobody else on the node becomes a client;
/// the sticky bit keeps the group from removing or replacing the daemon's own files.
fn make_private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1770))
}

/// The supervision loop; returns (after `quit`) when `stop` is cancelled.
pub(crate) async fn run(shared: Arc<Shared>, stop: CancellationToken) {
    let t = shared.timings;
    let mut backoff = t.backoff_initial;
    let mut first = true;
    loop {
        if !first {
            shared.status.lock().restarts += 1;
        }
        shared.set(MpsState::Starting, None);
        let started = tokio::select! {
            _ = stop.cancelled() => break,
            r = shared.start() => r,
        };
        first = false;
        match started {
            Ok(()) => {
                let up_since = Instant::now();
                shared.set(MpsState::Running, None);
                tracing::info!(status = %shared.status.lock().summary(), "MPS control daemon");
                let why = loop {
                    tokio::select! {
                        _ = stop.cancelled() => break None,
                        _ = tokio::time::sleep(t.health_interval) => {}
                    }
                    if up_since.elapsed() >= t.backoff_max {
                        backoff = t.backoff_initial;
                    }
                    match shared.probe().await {
                        Ok((pid, servers, clients)) => shared.record(pid, servers, clients),
                        Err(e) => break Some(e),
                    }
                };
                let Some(why) = why else { break };
                tracing::warn!(error = %why, "MPS control daemon stopped answering; restarting");
                shared.set(MpsState::Down, Some(format!("stopped answering: {why}")));
            }
            Err(e) => {
                tracing::warn!(error = %e, backoff_ms = backoff.as_millis() as u64, "MPS control daemon failed to start");
                shared.set(MpsState::Down, Some(format!("failed to start: {e}")));
            }
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(t.backoff_max);
    }
    shared.quit().await;
}
