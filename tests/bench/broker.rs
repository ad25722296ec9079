//! The broker under test: either started here (the real `gpu-broker` binary, host
//! backend, on a private Unix socket, state directory and shared-memory directory) or an
//! existing one reached with `--broker URI --admin-token-file F`. Tenants made by the
//! bench carry a run-unique prefix and are deleted at the end.

use anyhow::{Context, Result};
use gpu_broker_client::{AdminClient, QuotaSpec};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::report::note;

/// How to start a broker (when not connecting to an existing one).
#[derive(Clone, Debug)]
pub struct SpawnOpts {
    pub bin: PathBuf,
    pub capacity: String,
    pub headroom: String,
    pub log: String,
    pub reclaim_deadline: Option<String>,
    /// More flags of the broker; leading `NAME=value` words are its environment instead.
    pub extra: Vec<String>,
}

/// The environment word that has a started broker count its state lock's holds by the
/// CPU clock too (`--lock-hold-cpu-clock`; a broker without that setting ignores it): for
/// the measurements that read those counts.
pub const LOCK_HOLD_CPU_CLOCK: &str = "GPU_BROKER_LOCK_HOLD_CPU_CLOCK=true";

/// `extra` (a broker's environment words, then its flags: [`SpawnOpts::extra`]) for a
/// measurement that reads the broker's state-lock counters: its holds counted by the CPU
/// clock too ([`LOCK_HOLD_CPU_CLOCK`], with the environment words) and a metrics listener
/// on a free loopback port (before the flags).
pub fn counting_lock_holds(extra: &[String]) -> Vec<String> {
    let envs = extra.iter().take_while(|w| env_word(w).is_some()).count();
    let mut words = vec![LOCK_HOLD_CPU_CLOCK.to_string()];
    words.extend(extra[..envs].iter().cloned());
    words.extend(["--metrics-listen".to_string(), "127.0.0.1:0".to_string()]);
    words.extend(extra[envs..].iter().cloned());
    words
}

/// `NAME=value` (an upper-case environment variable name) split in two, else None.
pub fn env_word(w: &str) -> Option<(String, String)> {
    let (name, value) = w.split_once('=')?;
    let first = name.chars().next()?;
    (first.is_ascii_uppercase()
        && name
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
    .then(|| (name.to_string(), value.to_string()))
}

/// A broker started by the bench; stopped (SIGTERM, then SIGKILL) when dropped.
pub struct Spawned {
    child: Option<Child>,
    _dir: tempfile::TempDir,
    pub shm_dir: PathBuf,
    pub log: PathBuf,
    /// How it was started (to start it again).
    command: (PathBuf, Vec<String>, Vec<(String, String)>, String),
}

impl Spawned {
    /// SIGKILLs the broker and starts it again with the same flags, state and sockets
    /// (its log appended to); the new process's id and when it was started.
    pub fn kill_and_start_again(&mut self) -> Result<(u32, Instant)> {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let (bin, args, env, log_level) = &self.command;
        let log_file = std::fs::OpenOptions::new().append(true).open(&self.log)?;
        let t0 = Instant::now();
        let child = Command::new(bin)
            .args(args)
            .env("GPU_BROKER_LOG", log_level)
            .env("NO_COLOR", "1")
            .envs(env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("starting {} again", bin.display()))?;
        let pid = child.id();
        self.child = Some(child);
        Ok((pid, t0))
    }

    /// Host memory objects (memfds) the running broker holds open.
    pub fn memfds(&self) -> usize {
        self.child
            .as_ref()
            .map(|c| {
                gpu_broker_tests::fd_links(c.id())
                    .iter()
                    .filter(|(_, l)| l.starts_with("/memfd:gpu-broker"))
                    .count()
            })
            .unwrap_or(0)
    }

    /// Files in the broker's `--host-shm-dir` (it creates none any more).
    pub fn shm_files(&self) -> usize {
        // Block files only, not the devices' owner locks.
        std::fs::read_dir(&self.shm_dir)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| !e.file_name().to_string_lossy().ends_with("-lock"))
                    .count()
            })
            .unwrap_or(0)
    }

    /// Lines of the broker's log at `level` (e.g. `ERROR`, `WARN`).
    pub fn logged(&self, level: &str) -> Vec<String> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let pat = format!(" {level} ");
        text.lines()
            .filter(|l| l.contains(&pat))
            .map(str::to_string)
            .collect()
    }

    /// SIGTERM and wait (SIGKILL after `timeout`).
    pub fn stop(&mut self, timeout: Duration) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        // SAFETY: plain syscall on our own child.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait()? {
                if !status.success() {
                    note(format!("broker exited with {status}"));
                }
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                note(format!("broker did not stop within {timeout:?}; killed"));
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.stop(Duration::from_secs(20));
        let files = self.shm_files();
        if files > 0 {
            note(format!(
                "the broker left {files} files in {}",
                self.shm_dir.display()
            ));
        }
        let _ = std::fs::remove_dir_all(&self.shm_dir);
        let errors = self.logged("ERROR");
        if !errors.is_empty() {
            note(format!(
                "the broker logged {} ERROR line(s); first:\n  {}",
                errors.len(),
                errors[..errors.len().min(3)].join("\n  ")
            ));
        }
    }
}

/// The broker the bench talks to.
pub struct Target {
    pub uri: String,
    pub admin_token: String,
    /// Broker process id, when known (for resident memory).
    pub pid: Option<u32>,
    pub spawned: Option<Spawned>,
    prefix: String,
    tenants: Vec<String>,
}

impl Target {
    /// Starts a fresh host-backend broker.
    pub fn spawn(opts: &SpawnOpts) -> Result<Target> {
        let dir = tempfile::Builder::new().prefix("gpb-bench-").tempdir()?;
        let name = dir
            .path()
            .file_name()
            .context("tempdir name")?
            .to_string_lossy()
            .to_string();
        let shm_dir = PathBuf::from("/dev/shm").join(&name);
        let socket = dir.path().join("broker.sock");
        let state_dir = dir.path().join("state");
        let log = dir.path().join("broker.log");
        let mut args: Vec<String> = vec![
            "--backend".into(),
            "host".into(),
            "--socket".into(),
            socket.display().to_string(),
            "--state-dir".into(),
            state_dir.display().to_string(),
            "--host-shm-dir".into(),
            shm_dir.display().to_string(),
            "--host-capacity".into(),
            opts.capacity.clone(),
            "--headroom".into(),
            opts.headroom.clone(),
            "--shutdown-grace".into(),
            "1s".into(),
        ];
        if let Some(r) = &opts.reclaim_deadline {
            args.push("--reclaim-deadline".into());
            args.push(r.clone());
        }
        // Leading `NAME=value` words of `extra` are the broker's environment, the rest flags.
        let env: Vec<(String, String)> = opts.extra.iter().map_while(|w| env_word(w)).collect();
        args.extend(opts.extra.iter().skip(env.len()).cloned());
        let log_file = std::fs::File::create(&log)?;
        let child = Command::new(&opts.bin)
            .args(&args)
            .env("GPU_BROKER_LOG", &opts.log)
            .env("NO_COLOR", "1")
            .envs(env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("starting {}", opts.bin.display()))?;
        let pid = child.id();
        let mut spawned = Spawned {
            child: Some(child),
            _dir: dir,
            shm_dir,
            log,
            command: (opts.bin.clone(), args, env, opts.log.clone()),
        };
        let Spawned { child, log, .. } = &mut spawned;
        let child = child.as_mut().expect("just started");
        gpu_broker_tests::wait_until_serving(child, &socket, Duration::from_secs(30), || {
            tail(log)
        })?;
        let admin_token = std::fs::read_to_string(state_dir.join("admin.token"))
            .context("reading the started broker's admin token")?
            .trim()
            .to_string();
        Ok(Target {
            uri: format!("unix://{}", socket.display()),
            admin_token,
            pid: Some(pid),
            spawned: Some(spawned),
            prefix: format!("bench-{}", std::process::id()),
            tenants: Vec::new(),
        })
    }

    /// Uses a running broker.
    pub fn connect(uri: &str, admin_token_file: &Path, pid: Option<u32>) -> Result<Target> {
        let admin_token = std::fs::read_to_string(admin_token_file)
            .with_context(|| format!("reading {}", admin_token_file.display()))?
            .trim()
            .to_string();
        let pid = pid.or_else(|| unix_socket_of(uri).and_then(|p| peer_pid(&p)));
        Ok(Target {
            uri: uri.to_string(),
            admin_token,
            pid,
            spawned: None,
            prefix: format!(
                "bench-{}-{}",
                std::process::id(),
                &uuid::Uuid::new_v4().simple().to_string()[..6]
            ),
            tenants: Vec::new(),
        })
    }

    pub async fn admin(&self) -> Result<AdminClient> {
        Ok(AdminClient::connect(&self.uri, self.admin_token.clone()).await?)
    }

    /// Creates (or replaces) tenant `<prefix>-<suffix>` and returns its name and a token.
    pub async fn tenant(&mut self, suffix: &str, quota: QuotaSpec) -> Result<(String, String)> {
        let name = format!("{}-{suffix}", self.prefix);
        let admin = self.admin().await?;
        admin
            .set_quota(&name, quota)
            .await
            .with_context(|| format!("SetQuota {name}"))?;
        let token = admin.issue_token(&name, "gpu-broker-bench").await?.token;
        if !self.tenants.contains(&name) {
            self.tenants.push(name.clone());
        }
        Ok((name, token))
    }

    /// Deletes the tenants this run created (best effort: waits briefly for sessions to end).
    pub async fn cleanup(&mut self) {
        let Ok(admin) = self.admin().await else {
            return;
        };
        for name in std::mem::take(&mut self.tenants) {
            let deadline = Instant::now() + Duration::from_secs(3);
            loop {
                match admin.delete_tenant(&name).await {
                    Ok(()) => break,
                    Err(_) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => {
                        note(format!("could not delete tenant {name}: {e}"));
                        break;
                    }
                }
            }
        }
    }

    /// Resident memory of the broker process, if its pid is known and readable.
    pub fn rss(&self) -> Option<Mem> {
        self.pid.and_then(proc_mem)
    }
}

/// Resident memory of a process, in bytes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Mem {
    pub rss: u64,
    pub hwm: u64,
}

/// Reads `VmRSS` and `VmHWM` from `/proc/<pid>/status`.
pub fn proc_mem(pid: u32) -> Option<Mem> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    };
    Some(Mem {
        rss: field("VmRSS:")?,
        hwm: field("VmHWM:").unwrap_or(0),
    })
}

/// The socket path of a `unix://` (or bare path) address.
fn unix_socket_of(uri: &str) -> Option<PathBuf> {
    if let Some(p) = uri.strip_prefix("unix://") {
        return Some(PathBuf::from(p));
    }
    if let Some(p) = uri.strip_prefix("unix:") {
        return Some(PathBuf::from(p));
    }
    uri.starts_with('/').then(|| PathBuf::from(uri))
}

/// The pid of the process serving a Unix socket (SO_PEERCRED).
fn peer_pid(socket: &Path) -> Option<u32> {
    use std::os::fd::AsRawFd;
    let stream = std::os::unix::net::UnixStream::connect(socket).ok()?;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt on a valid socket fd into a correctly sized ucred.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some(cred.pid as u32)
}

/// Free inodes of the filesystem holding `dir` (tmpfs limits the number of files).
pub fn free_inodes(dir: &Path) -> Option<u64> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let probe = if dir.exists() {
        dir.to_path_buf()
    } else {
        dir.parent()?.to_path_buf()
    };
    let c = CString::new(probe.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs into a zeroed struct with a valid NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return None;
    }
    // tmpfs mounted with nr_inodes=0 reports 0 files: unlimited.
    if st.f_files == 0 {
        return Some(u64::MAX);
    }
    Some(st.f_favail as u64)
}

/// The last 20 lines of the log at `path`.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counting_lock_holds_puts_every_environment_word_before_the_first_flag() {
        let words = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let got = counting_lock_holds(&words(&["GPU_BROKER_X=1", "--admin-listen", "/a.sock"]));
        assert_eq!(
            got,
            words(&[
                LOCK_HOLD_CPU_CLOCK,
                "GPU_BROKER_X=1",
                "--metrics-listen",
                "127.0.0.1:0",
                "--admin-listen",
                "/a.sock",
            ])
        );
        let envs: Vec<_> = got.iter().map_while(|w| env_word(w)).collect();
        assert_eq!(envs.len(), 2, "both environment words are read as such");
        assert_eq!(
            env_word(LOCK_HOLD_CPU_CLOCK),
            Some(("GPU_BROKER_LOCK_HOLD_CPU_CLOCK".into(), "true".into()))
        );
    }
}
