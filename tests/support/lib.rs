//! Test support: start the real `gpu-broker` binary on a temporary Unix socket (with a
//! private state directory and shared-memory directory), get its admin token, make
//! tenants, and stop it. Mini-redis style: every test gets its own broker.

use anyhow::{bail, Context, Result};
use gpu_broker_client::{AdminClient, Client, QuotaSpec};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Directory of the workspace's built binaries (`target/debug` or `target/release`).
pub fn bin_dir() -> PathBuf {
    // Test executables live in target/<profile>/deps/.
    let exe = std::env::current_exe().expect("current exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// Path of a workspace binary, e.g. `gpu-broker`, `gpu-brokerctl`, `e2e-worker`.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} not built: run `cargo build --workspace --bins` (or the README's test command)",
        p.display()
    );
    p
}

/// A broker process under test.
pub struct Broker {
    child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub shm_dir: PathBuf,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    pub admin_token: String,
    pub log: PathBuf,
    args: Vec<String>,
}

/// Options for starting a broker.
#[derive(Clone, Debug)]
pub struct BrokerOpts {
    pub capacity: &'static str,
    pub devices: u32,
    pub headroom: &'static str,
    pub extra: Vec<String>,
}

impl Default for BrokerOpts {
    fn default() -> Self {
        BrokerOpts {
            capacity: "1GiB",
            devices: 1,
            headroom: "0%",
            extra: vec![],
        }
    }
}

impl Broker {
    /// Starts a host-backend broker with default options (1 GiB, no headroom).
    pub fn start() -> Result<Broker> {
        Broker::start_with(BrokerOpts::default())
    }

    pub fn start_with(opts: BrokerOpts) -> Result<Broker> {
        let dir = tempfile::Builder::new().prefix("gpb-test-").tempdir()?;
        let shm_dir = PathBuf::from("/dev/shm").join(
            dir.path()
                .file_name()
                .context("tempdir name")?
                .to_string_lossy()
                .to_string(),
        );
        let socket = dir.path().join("broker.sock");
        let state_dir = dir.path().join("state");
        let mut args = vec![
            "--backend".into(),
            "host".into(),
            "--socket".into(),
            socket.display().to_string(),
            "--state-dir".into(),
            state_dir.display().to_string(),
            "--host-shm-dir".into(),
            shm_dir.display().to_string(),
            "--host-capacity".into(),
            opts.capacity.into(),
            "--host-devices".into(),
            opts.devices.to_string(),
            "--headroom".into(),
            opts.headroom.into(),
            "--shutdown-grace".into(),
            "1s".into(),
        ];
        args.extend(opts.extra.iter().cloned());
        let log = dir.path().join("broker.log");
        let mut b = Broker {
            child: None,
            shm_dir,
            socket,
            state_dir,
            admin_token: String::new(),
            log,
            args,
            dir,
        };
        b.spawn()?;
        Ok(b)
    }

    /// (Re)starts the process with the same arguments and state.
    pub fn spawn(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(bin("gpu-broker"))
            .args(&self.args)
            .env("GPU_BROKER_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("spawning gpu-broker")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                break;
            }
            if let Some(c) = self.child.as_mut() {
                if let Some(status) = c.try_wait()? {
                    bail!("broker exited early ({status}):\n{}", self.log_text());
                }
            }
            if Instant::now() > deadline {
                bail!("broker did not start:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.admin_token = std::fs::read_to_string(self.state_dir.join("admin.token"))?
            .trim()
            .to_string();
        Ok(())
    }

    pub fn uri(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub async fn admin(&self) -> Result<AdminClient> {
        Ok(AdminClient::connect(&self.uri(), self.admin_token.clone()).await?)
    }

    /// Creates a tenant with `limit` bytes and returns a token for it.
    pub async fn tenant(&self, name: &str, quota: QuotaSpec) -> Result<String> {
        let admin = self.admin().await?;
        admin.set_quota(name, quota).await?;
        Ok(admin.issue_token(name, "test").await?.token)
    }

    /// A client of tenant `name` with `limit` bytes (created now).
    pub async fn client(&self, name: &str, limit: u64) -> Result<Client> {
        let token = self.tenant(name, QuotaSpec::new(limit)).await?;
        Ok(Client::connect(&self.uri(), token).await?)
    }

    /// Sends a signal to the broker process.
    pub fn signal(&self, sig: i32) {
        if let Some(pid) = self.pid() {
            // SAFETY: plain syscall on our own child.
            unsafe {
                libc::kill(pid as libc::pid_t, sig);
            }
        }
    }

    /// SIGTERM, then waits for exit (SIGKILL after `timeout`). Returns the exit status.
    pub fn stop(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let mut child = self.child.take().context("not running")?;
        // SAFETY: plain syscall on our own child.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = child.try_wait()? {
                return Ok(s);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let s = child.wait()?;
                bail!(
                    "broker did not stop within {timeout:?} ({s}):\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// Files left in this broker's shared-memory directory.
    pub fn shm_files(&self) -> Vec<PathBuf> {
        list(&self.shm_dir)
    }
}

fn list(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default()
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.shm_dir);
    }
}

/// Polls `f` every 20 ms until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
