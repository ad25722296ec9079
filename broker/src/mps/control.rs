//! The MPS control binary (`nvidia-cuda-mps-control`) as the broker drives it: start the
//! control daemon (`-d`) with the broker's private pipe and log directories, send it one
//! command on stdin (`get_server_list`, `get_client_list <pid>`, `quit`) and read the
//! answer, and read the daemon's pid from the pid file it writes in its pipe directory.
//! Every call has a deadline; nothing here decides what to do when a call fails.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The pid file the control daemon writes in its pipe directory.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";

/// Why a call of the control binary failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ControlError {
    #[error("cannot run {binary}: {reason}")]
    Spawn { binary: String, reason: String },
    #[error("{binary} {what} did not finish within {ms} ms")]
    Timeout {
        binary: String,
        what: String,
        ms: u128,
    },
    #[error("{binary} {what} failed ({status}): {output}")]
    Failed {
        binary: String,
        what: String,
        status: String,
        output: String,
    },
}

/// How to reach one control daemon.
#[derive(Clone, Debug)]
pub struct Control {
    /// The control binary (a path, or a name looked up in `PATH`).
    pub binary: PathBuf,
    /// `CUDA_MPS_PIPE_DIRECTORY` of the daemon and its clients.
    pub pipe_dir: PathBuf,
    /// `CUDA_MPS_LOG_DIRECTORY` of the daemon and its servers.
    pub log_dir: PathBuf,
    /// `CUDA_VISIBLE_DEVICES` of the daemon (the broker's devices); None: inherited.
    pub visible_devices: Option<String>,
    /// Deadline of each call.
    pub timeout: Duration,
    /// The daemon is started and stopped by someone else (its own systemd unit,
    /// `deploy/gpu-broker-mps.service`), so that it outlives the broker's restarts: the
    /// broker only adopts it, never starts or quits it.
    pub external: bool,
}

/// Longest answer read from one command (a client list of a busy server fits easily).
const MAX_OUTPUT: u64 = 64 * 1024;

impl Control {
    fn command(&self) -> tokio::process::Command {
        let mut c = tokio::process::Command::new(&self.binary);
        c.env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(v) = &self.visible_devices {
            c.env("CUDA_VISIBLE_DEVICES", v);
        }
        c
    }

    fn name(&self) -> String {
        self.binary.display().to_string()
    }

    /// Starts the control daemon in the background (`-d`). The command returns once the
    /// daemon has forked; whether it answers is for [`Control::send`] to find out.
    pub async fn start_daemon(&self) -> Result<(), ControlError> {
        // The daemon inherits the command's descriptors: give it none of ours, so that
        // waiting for the command never waits for the daemon.
        let mut c = self.command();
        c.arg("-d")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut child = c.spawn().map_err(|e| ControlError::Spawn {
            binary: self.name(),
            reason: e.to_string(),
        })?;
        match tokio::time::timeout(self.timeout, child.wait()).await {
            Err(_) => Err(ControlError::Timeout {
                binary: self.name(),
                what: "-d".into(),
                ms: self.timeout.as_millis(),
            }),
            Ok(Ok(s)) if s.success() => Ok(()),
            Ok(Ok(s)) => Err(ControlError::Failed {
                binary: self.name(),
                what: "-d".into(),
                status: s.to_string(),
                output: String::new(),
            }),
            Ok(Err(e)) => Err(ControlError::Spawn {
                binary: self.name(),
                reason: e.to_string(),
            }),
        }
    }

    /// Sends one command line to the running daemon; returns what it printed.
    pub async fn send(&self, line: &str) -> Result<String, ControlError> {
        let what = line;
        let mut child = self.command().spawn().map_err(|e| ControlError::Spawn {
            binary: self.name(),
            reason: e.to_string(),
        })?;
        let mut input = child.stdin.take();
        let mut out = child.stdout.take();
        let mut err = child.stderr.take();
        let text = format!("{line}\n");
        let io = async {
            if let Some(i) = input.as_mut() {
                // A daemon that is gone may close stdin early: the exit status says so.
                let _ = i.write_all(text.as_bytes()).await;
            }
            drop(input.take());
            let mut o = Vec::new();
            let mut e = Vec::new();
            let read_out = async {
                if let Some(s) = out.as_mut() {
                    let _ = s.take(MAX_OUTPUT).read_to_end(&mut o).await;
                }
            };
            let read_err = async {
                if let Some(s) = err.as_mut() {
                    let _ = s.take(MAX_OUTPUT).read_to_end(&mut e).await;
                }
            };
            tokio::join!(read_out, read_err);
            let status = child.wait().await;
            (status, o, e)
        };
        let (status, o, e) = match tokio::time::timeout(self.timeout, io).await {
            Ok(r) => r,
            Err(_) => {
                return Err(ControlError::Timeout {
                    binary: self.name(),
                    what: what.to_string(),
                    ms: self.timeout.as_millis(),
                })
            }
        };
        let stdout = String::from_utf8_lossy(&o).trim().to_string();
        match status {
            Ok(s) if s.success() => Ok(stdout),
            Ok(s) => Err(ControlError::Failed {
                binary: self.name(),
                what: what.to_string(),
                status: s.to_string(),
                output: format!("{stdout} {}", String::from_utf8_lossy(&e).trim())
                    .trim()
                    .chars()
                    .take(512)
                    .collect(),
            }),
            Err(err) => Err(ControlError::Spawn {
                binary: self.name(),
                reason: err.to_string(),
            }),
        }
    }

    /// The daemon's pid from its pid file, if the file is there and the process lives.
    pub fn daemon_pid(&self) -> Option<u32> {
        read_live_pid(&self.pipe_dir.join(PID_FILE))
    }
}

/// The pid in `path` if it names a live process. The pipe directory is its group's too
/// (workers reach the daemon there), so a worker could put a file of its own, a FIFO or a
/// link to another file in the daemon's place: only a small regular file (not a link) of
/// the broker's own user (who started the daemon) counts, read without waiting on a FIFO
/// (`crate::file_read`). The pid is the one killed when a quit does not take, and then only
/// if it runs the MPS control binary ([`is_mps_control`]).
fn read_live_pid(path: &Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let (bytes, meta) = crate::file_read::read_regular_no_symlink(path, 64).ok()?;
    // SAFETY: geteuid cannot fail.
    if meta.uid() != unsafe { libc::geteuid() } {
        tracing::warn!(path = %path.display(), owner = meta.uid(), "MPS pid file not written by the broker's user: ignored");
        return None;
    }
    let pid: i32 = std::str::from_utf8(&bytes).ok()?.trim().parse().ok()?;
    if pid <= 0 {
        return None;
    }
    crate::process::process_alive(pid as u32).then_some(pid as u32)
}

/// Whether process `pid` runs the MPS control daemon's binary: the last check before it is
/// killed, so that a pid file naming another process (pid reuse, a planted file) kills
/// nothing else.
pub fn is_mps_control(pid: u32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .and_then(|exe| exe.file_name().map(|n| n.to_string_lossy().into_owned()))
        .is_some_and(|name| name.starts_with("nvidia-cuda-mps-control"))
}

/// Pids in a command's answer (one per line; other lines are ignored).
pub fn parse_pids(answer: &str) -> Vec<u32> {
    answer
        .lines()
        .filter_map(|l| l.trim().parse::<u32>().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pids_are_read_one_per_line() {
        assert_eq!(parse_pids("12\n 34 \nno server\n\n56"), vec![12, 34, 56]);
        assert!(parse_pids("").is_empty());
    }

    #[test]
    fn a_pid_file_of_a_dead_or_bogus_process_is_no_daemon() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(PID_FILE);
        assert_eq!(read_live_pid(&p), None, "no file");
        std::fs::write(&p, "garbage").unwrap();
        assert_eq!(read_live_pid(&p), None);
        std::fs::write(&p, "-1").unwrap();
        assert_eq!(read_live_pid(&p), None);
        std::fs::write(&p, format!("{}\n", std::process::id())).unwrap();
        assert_eq!(read_live_pid(&p), Some(std::process::id()));
    }

    /// The pipe directory is the group's: a FIFO put in the pid file's place is not waited
    /// on, and a pid file another user wrote names no daemon (its pid would be killed).
    #[test]
    fn a_fifo_or_another_users_pid_file_is_no_daemon() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(PID_FILE);
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid, NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
        assert_eq!(read_live_pid(&p), None, "a FIFO");
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, "1\n").unwrap();
        assert_eq!(read_live_pid(&p), Some(1), "pid 1 lives");
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIP (the other user's file): needs root to chown");
            return;
        }
        std::os::unix::fs::chown(&p, Some(65534), Some(65534)).unwrap();
        assert_eq!(read_live_pid(&p), None, "written by another user");
    }

    /// A link in the pid file's place (to a file of the broker's user that holds a live
    /// pid) counts for nothing, and a live process that is not the control daemon is not
    /// taken for it.
    #[test]
    fn a_link_in_the_pid_files_place_or_another_binary_is_no_daemon() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere.pid");
        std::fs::write(&target, format!("{}\n", std::process::id())).unwrap();
        assert_eq!(read_live_pid(&target), Some(std::process::id()));
        let p = dir.path().join(PID_FILE);
        std::os::unix::fs::symlink(&target, &p).unwrap();
        assert_eq!(read_live_pid(&p), None, "a symbolic link");
        assert!(
            !is_mps_control(std::process::id()),
            "this test is no MPS daemon"
        );
        assert!(!is_mps_control(u32::MAX), "no such process");
    }
}
