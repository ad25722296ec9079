//! Test support: start the real `gpu-broker` binary on a temporary Unix socket (with a
//! private state directory and shared-memory directory), get its admin token, make
//! tenants, and stop it. Mini-redis style: every test gets its own broker.

use anyhow::{bail, Context, Result};
use gpu_broker_client::{AdminClient, Client, QuotaSpec};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub mod systemd;
pub use systemd::FakeSystemd;

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
    /// A command the broker runs under (`unshare ...`), empty for none.
    wrapper: Vec<String>,
    /// Environment of the next [`Broker::spawn`] (e.g. a crash point).
    pub env: Vec<(String, String)>,
    /// The service manager it runs under, if any ([`Broker::start_under`]).
    pub systemd: Option<std::sync::Arc<FakeSystemd>>,
    /// Where the latest start's lines begin in `log` (each start appends to it).
    log_from: usize,
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

impl BrokerOpts {
    /// The host backend's flags for these options (`extra` aside).
    fn host_args(&self) -> Vec<String> {
        vec![
            "--backend".to_string(),
            "host".into(),
            "--host-capacity".into(),
            self.capacity.into(),
            "--host-devices".into(),
            self.devices.to_string(),
            "--headroom".into(),
            self.headroom.into(),
        ]
    }
}

impl Broker {
    /// Starts a host-backend broker with default options (1 GiB, no headroom).
    pub fn start() -> Result<Broker> {
        Broker::start_with(BrokerOpts::default())
    }

    pub fn start_with(opts: BrokerOpts) -> Result<Broker> {
        let host = opts.host_args();
        Broker::start_args(host, opts.extra)
    }

    /// Starts a host-backend broker as a unit of `systemd` (its notify socket and
    /// file-descriptor store): every (re)start gets the store's descriptors back.
    pub fn start_under(systemd: std::sync::Arc<FakeSystemd>, opts: BrokerOpts) -> Result<Broker> {
        let host = opts.host_args();
        let extra = opts.extra;
        Broker::start_args_under(Vec::new(), host, move |_| extra, Some(systemd))
    }

    /// Starts a broker on the real GPUs (`--backend cuda`) with `extra` flags.
    pub fn start_cuda(extra: Vec<String>) -> Result<Broker> {
        Broker::start_args(vec!["--backend".into(), "cuda".into()], extra)
    }

    /// Starts a broker with the flags `args(dir)` returns, after the test's own socket,
    /// state and shared-memory directories (`dir/broker.sock`, `dir/state`): a
    /// `--socket` or `--state-dir` among them must name those same paths.
    pub fn start_raw(args: impl FnOnce(&Path) -> Vec<String>) -> Result<Broker> {
        Broker::start_args_in(Vec::new(), Vec::new(), args)
    }

    /// Starts a host-backend broker whose descriptor limit is `nofile` (soft and hard),
    /// through util-linux's `prlimit` (part of every Linux base system: its absence is a
    /// failure, not a skip).
    pub fn start_with_nofile(nofile: u32, opts: BrokerOpts) -> Result<Broker> {
        Broker::start_wrapped(
            vec!["prlimit".into(), format!("--nofile={nofile}:{nofile}")],
            opts,
        )
    }

    /// Starts a host-backend broker under `wrapper` (e.g. `unshare --pid --fork ...`):
    /// the broker runs as `wrapper... gpu-broker args...`; `pid()` is the wrapper's.
    pub fn start_wrapped(wrapper: Vec<String>, opts: BrokerOpts) -> Result<Broker> {
        let host = opts.host_args();
        let extra = opts.extra;
        Broker::start_args_in(wrapper, host, move |_| extra)
    }

    fn start_args(backend: Vec<String>, extra: Vec<String>) -> Result<Broker> {
        Broker::start_args_in(Vec::new(), backend, move |_| extra)
    }

    fn start_args_in(
        wrapper: Vec<String>,
        backend: Vec<String>,
        extra: impl FnOnce(&Path) -> Vec<String>,
    ) -> Result<Broker> {
        Broker::start_args_under(wrapper, backend, extra, None)
    }

    fn start_args_under(
        wrapper: Vec<String>,
        backend: Vec<String>,
        extra: impl FnOnce(&Path) -> Vec<String>,
        systemd: Option<std::sync::Arc<FakeSystemd>>,
    ) -> Result<Broker> {
        let dir = tempfile::Builder::new().prefix("gpb-test-").tempdir()?;
        let extra = extra(dir.path());
        let shm_dir = PathBuf::from("/dev/shm").join(
            dir.path()
                .file_name()
                .context("tempdir name")?
                .to_string_lossy()
                .to_string(),
        );
        let socket = dir.path().join("broker.sock");
        let state_dir = dir.path().join("state");
        let mut args = backend;
        args.extend([
            "--socket".into(),
            socket.display().to_string(),
            "--state-dir".into(),
            state_dir.display().to_string(),
            "--host-shm-dir".into(),
            shm_dir.display().to_string(),
            "--shutdown-grace".into(),
            "1s".into(),
        ]);
        args.extend(extra);
        let log = dir.path().join("broker.log");
        let mut b = Broker {
            child: None,
            shm_dir,
            socket,
            state_dir,
            admin_token: String::new(),
            log,
            args,
            wrapper,
            env: Vec::new(),
            systemd,
            dir,
            log_from: 0,
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
        self.log_from = log.metadata()?.len() as usize;
        // Copies of the store's descriptors, open until the child has them.
        let mut _handed = Vec::new();
        let mut cmd = match (&self.systemd, self.wrapper.split_first()) {
            (Some(sd), _) => {
                let (c, h) = sd.prepare(&bin("gpu-broker"), &self.args)?;
                _handed = h;
                c
            }
            (None, Some((prog, rest))) => {
                let mut c = Command::new(prog);
                c.args(rest).arg(bin("gpu-broker")).args(&self.args);
                c
            }
            (None, None) => {
                let mut c = Command::new(bin("gpu-broker"));
                c.args(&self.args);
                c
            }
        };
        let child = cmd
            .env("GPU_BROKER_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("spawning gpu-broker")?;
        drop(_handed);
        let child = self.child.insert(child);
        let log = self.log.clone();
        wait_until_serving(child, &self.socket, Duration::from_secs(20), || {
            std::fs::read_to_string(&log).unwrap_or_default()
        })?;
        self.admin_token = std::fs::read_to_string(self.state_dir.join("admin.token"))?
            .trim()
            .to_string();
        Ok(())
    }

    /// The flags of the next [`Broker::spawn`].
    pub fn args_mut(&mut self) -> &mut Vec<String> {
        &mut self.args
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

    /// `gpu-brokerctl` aimed at this broker with its admin token (`--broker`,
    /// `--token-file`; the environment's broker and token left out): add the command.
    pub fn ctl(&self) -> Command {
        self.ctl_at(&self.uri())
    }

    /// [`Broker::ctl`] aimed at `uri` (another of its sockets).
    pub fn ctl_at(&self, uri: &str) -> Command {
        let mut cmd = Command::new(bin("gpu-brokerctl"));
        cmd.arg("--broker")
            .arg(uri)
            .arg("--token-file")
            .arg(self.state_dir.join("admin.token"))
            .env_remove("GPU_BROKER_ADMIN_TOKEN")
            .env_remove("GPU_BROKER_ADDR");
        cmd
    }

    /// The address of the metrics listener (`--metrics-listen 127.0.0.1:0`), as the broker
    /// logged it at its latest start (waited for, up to 5 s: an earlier start's listener
    /// is gone).
    pub async fn metrics_addr(&self) -> String {
        let mut addr = None;
        let found = eventually(Duration::from_secs(5), || {
            let log = self.log_text();
            addr = logged_metrics_addr(log.get(self.log_from..).unwrap_or_default());
            let ok = addr.is_some();
            async move { ok }
        })
        .await;
        assert!(found, "no metrics address in the log:\n{}", self.log_text());
        addr.unwrap_or_default()
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

    /// Gives `flag` the value `value` from the next [`Broker::spawn`] on (replaced where
    /// the broker was started with it, added otherwise).
    pub fn set_flag(&mut self, flag: &str, value: &str) {
        match self.args.iter().position(|a| a == flag) {
            Some(i) if i + 1 < self.args.len() => self.args[i + 1] = value.to_string(),
            _ => self.args.extend([flag.to_string(), value.to_string()]),
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

    /// The host memory objects (memfds) this broker process holds open, as
    /// `/proc/<pid>/fd/<n>` paths (`metadata()` gives each one's size). Empty once the
    /// process is gone: memfd memory leaves nothing behind.
    pub fn memfds(&self) -> Vec<PathBuf> {
        let Some(pid) = self.pid() else {
            return Vec::new();
        };
        fd_links(pid)
            .into_iter()
            .filter(|(_, link)| link.starts_with("/memfd:gpu-broker"))
            .map(|(p, _)| p)
            .collect()
    }

    /// How many descriptors this broker process has open (`None` when it is gone or its
    /// fd table cannot be read).
    pub fn open_fds(&self) -> Option<usize> {
        let pid = self.pid()?;
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .ok()
            .map(|rd| rd.count())
    }

    /// Files in the directory the broker was given as `--host-shm-dir` (it must create
    /// none: host memory is memfd memory).
    pub fn shm_dir_files(&self) -> Vec<PathBuf> {
        std::fs::read_dir(&self.shm_dir)
            .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default()
    }
}

/// A keeper process (`gpu-broker keeper`) holding lease descriptors across broker
/// restarts; killed when dropped.
pub struct Keeper {
    pub proc: Proc,
    pub socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Keeper {
    /// Starts one on a socket of its own and waits until it listens.
    pub async fn start() -> Result<Keeper> {
        let dir = tempfile::Builder::new().prefix("gpb-keeper-").tempdir()?;
        let socket = dir.path().join("keeper.sock");
        let proc = Self::listening_on(&socket).await?;
        Ok(Keeper {
            proc,
            socket,
            _dir: dir,
        })
    }

    /// A keeper process listening on `socket`.
    async fn listening_on(socket: &Path) -> Result<Proc> {
        let mut cmd = Command::new(bin("gpu-broker"));
        cmd.arg("keeper").arg("--socket").arg(socket);
        let mut proc = Proc::spawn(cmd)?;
        proc.line_starting(
            "stderr: gpu-broker keeper: listening",
            Duration::from_secs(10),
        )
        .await?;
        Ok(proc)
    }

    /// SIGKILLs this keeper (what it held goes with it) and starts a new, empty one on
    /// the same socket.
    pub async fn restart(&mut self) -> Result<()> {
        self.proc.kill().await?;
        self.proc.wait(Duration::from_secs(10)).await?;
        self.proc = Self::listening_on(&self.socket).await?;
        Ok(())
    }

    /// The broker flags that use it.
    pub fn flags(&self) -> Vec<String> {
        vec!["--keeper".into(), self.socket.display().to_string()]
    }

    /// How many memory descriptors (memfds) it holds.
    pub fn memfds(&self) -> usize {
        fd_links(self.proc.pid)
            .into_iter()
            .filter(|(_, link)| link.starts_with("/memfd:gpu-broker"))
            .count()
    }
}

/// `(/proc/<pid>/fd/<n>, link target)` of every descriptor of `pid`.
pub fn fd_links(pid: u32) -> Vec<(PathBuf, String)> {
    let dir = PathBuf::from(format!("/proc/{pid}/fd"));
    std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let link = std::fs::read_link(e.path()).ok()?;
                    Some((e.path(), link.to_string_lossy().into_owned()))
                })
                .collect()
        })
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

/// The names of the broker's tenants, as `ListTenants` gives them.
pub async fn tenant_names(admin: &AdminClient) -> Vec<String> {
    admin
        .list_tenants()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect()
}

/// Waits, up to `within`, until `socket` accepts a connection from the broker process
/// `child` has started: an error with its log (`log()`) if it exits first or does not
/// serve in time.
pub fn wait_until_serving(
    child: &mut Child,
    socket: &Path,
    within: Duration,
    log: impl Fn() -> String,
) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if std::os::unix::net::UnixStream::connect(socket).is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!("broker exited early ({status}):\n{}", log());
        }
        if Instant::now() > deadline {
            bail!("broker did not start within {within:?}:\n{}", log());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The address the metrics listener logged it serves on (`metrics at /metrics ...
/// addr=HOST:PORT`), in a broker's log text: the last one logged (of its latest start).
pub fn logged_metrics_addr(log: &str) -> Option<String> {
    log.lines()
        .rev()
        .find(|l| l.contains("metrics at /metrics"))
        .and_then(|l| l.split("addr=").nth(1))
        .and_then(|a| a.split_whitespace().next())
        .filter(|a| !a.is_empty())
        .map(str::to_string)
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

/// A child process (a worker, an example, the CLI) whose stdout and stderr lines a test
/// reads as they come. Killed when dropped.
pub struct Proc {
    child: tokio::process::Child,
    stdin: Option<tokio::process::ChildStdin>,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    history: Vec<String>,
    /// Process id.
    pub pid: u32,
    name: String,
}

impl Proc {
    /// Spawns `cmd` with piped stdin/stdout/stderr (needs a tokio runtime).
    pub fn spawn(cmd: Command) -> Result<Proc> {
        let name = format!("{:?}", cmd.get_program());
        let mut cmd = tokio::process::Command::from(cmd);
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().with_context(|| format!("spawning {name}"))?;
        let pid = child.id().context("child has no pid")?;
        let (tx, lines) = tokio::sync::mpsc::unbounded_channel();
        if let Some(out) = child.stdout.take() {
            let tx = tx.clone();
            tokio::spawn(async move {
                use tokio::io::AsyncBufReadExt;
                let mut r = tokio::io::BufReader::new(out).lines();
                while let Ok(Some(l)) = r.next_line().await {
                    let _ = tx.send(l);
                }
            });
        }
        if let Some(err) = child.stderr.take() {
            tokio::spawn(async move {
                use tokio::io::AsyncBufReadExt;
                let mut r = tokio::io::BufReader::new(err).lines();
                while let Ok(Some(l)) = r.next_line().await {
                    let _ = tx.send(format!("stderr: {l}"));
                }
            });
        }
        let stdin = child.stdin.take();
        Ok(Proc {
            child,
            stdin,
            lines,
            history: Vec::new(),
            pid,
            name,
        })
    }

    /// Waits up to `timeout` for the next stdout line starting with `prefix` (earlier
    /// lines are kept in [`Proc::history`]) and returns it.
    pub async fn line_starting(&mut self, prefix: &str, timeout: Duration) -> Result<String> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(l)) => {
                    self.history.push(l.clone());
                    if l.starts_with(prefix) {
                        return Ok(l);
                    }
                }
                Ok(None) => bail!(
                    "{} ended its output before a line {prefix:?}:\n{}",
                    self.name,
                    self.history()
                ),
                Err(_) => bail!(
                    "{}: no line {prefix:?} within {timeout:?}:\n{}",
                    self.name,
                    self.history()
                ),
            }
        }
    }

    /// Every line read so far.
    pub fn history(&self) -> String {
        self.history.join("\n")
    }

    /// Writes one line to the process's stdin.
    pub async fn send(&mut self, line: &str) -> Result<()> {
        use tokio::io::AsyncWriteExt;
        let stdin = self.stdin.as_mut().context("stdin closed")?;
        stdin.write_all(format!("{line}\n").as_bytes()).await?;
        stdin.flush().await?;
        Ok(())
    }

    /// Sends a signal.
    pub fn signal(&self, sig: i32) {
        // SAFETY: plain syscall on our own child.
        unsafe {
            libc::kill(self.pid as libc::pid_t, sig);
        }
    }

    /// SIGKILL and reap.
    pub async fn kill(&mut self) -> Result<()> {
        self.child.start_kill()?;
        tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await??;
        Ok(())
    }

    /// Waits up to `timeout` for the process to exit (SIGKILL after that).
    pub async fn wait(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(s) => Ok(s?),
            Err(_) => {
                let _ = self.kill().await;
                bail!(
                    "{} did not exit within {timeout:?}:\n{}",
                    self.name,
                    self.history()
                )
            }
        }
    }

    /// Waits for exit, then returns the status and every line the process printed.
    pub async fn finish(mut self, timeout: Duration) -> Result<(std::process::ExitStatus, String)> {
        self.stdin.take();
        let status = self.wait(timeout).await?;
        // The readers end at EOF, shortly after exit.
        while let Ok(Some(l)) =
            tokio::time::timeout(Duration::from_secs(2), self.lines.recv()).await
        {
            self.history.push(l);
        }
        Ok((status, self.history()))
    }
}

/// A lease held by an `e2e-worker hold` process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldLease {
    pub id: String,
    /// Identifies the memory object (`fd:<block id>`): equal for the same block.
    pub block: String,
    pub bytes: u64,
    pub device: u32,
}

/// An `e2e-worker hold` process that reported `READY`.
pub struct Held {
    pub proc: Proc,
    pub session_id: String,
    /// The pid the broker saw on the socket.
    pub peer_pid: u32,
    pub leases: Vec<HeldLease>,
}

/// The `e2e-worker` command for `broker` and `token` with the given subcommand arguments.
pub fn worker_cmd(broker: &Broker, token: &str, args: &[&str]) -> Command {
    let mut c = Command::new(bin("e2e-worker"));
    c.arg("--broker")
        .arg(broker.uri())
        .arg("--token")
        .arg(token)
        .args(args);
    c
}

/// Starts `e2e-worker hold <args>` and waits (up to 10 s) until it holds its leases.
pub async fn hold(broker: &Broker, token: &str, args: &[&str]) -> Result<Held> {
    let mut a = vec!["hold"];
    a.extend_from_slice(args);
    let mut proc = Proc::spawn(worker_cmd(broker, token, &a))?;
    let t = Duration::from_secs(10);
    let session = proc.line_starting("SESSION ", t).await?;
    let mut words = session.split_whitespace().skip(1);
    let session_id = words.next().context("session id")?.to_string();
    let peer_pid = words.next().context("peer pid")?.parse()?;
    let mut leases = Vec::new();
    loop {
        let l = proc.line_starting("", t).await?;
        let w: Vec<&str> = l.split_whitespace().collect();
        match w.first().copied() {
            Some("READY") => break,
            Some("LEASE") if w.len() == 5 => leases.push(HeldLease {
                id: w[1].to_string(),
                block: w[2].to_string(),
                bytes: w[3].parse()?,
                device: w[4].parse()?,
            }),
            Some("ERROR") | Some("BAD_INITIAL") => bail!("worker failed: {l}\n{}", proc.history()),
            _ => {}
        }
    }
    Ok(Held {
        proc,
        session_id,
        peer_pid,
        leases,
    })
}

/// `grpc.health.v1.Health/Check` for `service` ("" for the whole server); returns the
/// serving status (1 = SERVING, 2 = NOT_SERVING). The health service needs no token.
pub async fn health_check(uri: &str, service: &str) -> Result<i32> {
    let channel = gpu_broker_client::connect::connect_channel(uri).await?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await?;
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/grpc.health.v1.Health/Check");
    let reply: tonic::Response<health::HealthCheckResponse> = grpc
        .unary(
            tonic::Request::new(health::HealthCheckRequest {
                service: service.to_string(),
            }),
            path,
            health::Codec::default(),
        )
        .await?;
    Ok(reply.into_inner().status)
}

/// Just enough of `grpc.health.v1` (and a prost codec) to call `Health/Check`.
/// An open `grpc.health.v1.Health/Watch` stream (needs no token).
pub struct HealthWatch {
    stream: tonic::Streaming<health::HealthCheckResponse>,
}

impl HealthWatch {
    /// Opens a Watch of `service` on `channel`; the first status, or the call's error.
    pub async fn open(
        channel: &tonic::transport::Channel,
        service: &str,
    ) -> Result<(HealthWatch, i32), tonic::Status> {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready()
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let path =
            tonic::codegen::http::uri::PathAndQuery::from_static("/grpc.health.v1.Health/Watch");
        let mut stream = grpc
            .server_streaming(
                tonic::Request::new(health::HealthCheckRequest {
                    service: service.to_string(),
                }),
                path,
                health::Codec::default(),
            )
            .await?
            .into_inner();
        match stream.message().await? {
            Some(first) => Ok((HealthWatch { stream }, first.status)),
            None => Err(tonic::Status::unknown("the watch ended at once")),
        }
    }

    /// The next status change.
    pub async fn next(&mut self) -> Result<Option<i32>, tonic::Status> {
        Ok(self.stream.message().await?.map(|r| r.status))
    }
}

mod health {
    use std::marker::PhantomData;
    use tonic::codec::{DecodeBuf, Decoder, EncodeBuf, Encoder};
    use tonic::Status;

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct HealthCheckRequest {
        #[prost(string, tag = "1")]
        pub service: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct HealthCheckResponse {
        #[prost(int32, tag = "1")]
        pub status: i32,
    }

    pub struct Codec<E, D>(PhantomData<(E, D)>);

    impl<E, D> Default for Codec<E, D> {
        fn default() -> Self {
            Codec(PhantomData)
        }
    }

    pub struct Enc<E>(PhantomData<E>);
    pub struct Dec<D>(PhantomData<D>);

    impl<E, D> tonic::codec::Codec for Codec<E, D>
    where
        E: prost::Message + Send + 'static,
        D: prost::Message + Default + Send + 'static,
    {
        type Encode = E;
        type Decode = D;
        type Encoder = Enc<E>;
        type Decoder = Dec<D>;

        fn encoder(&mut self) -> Enc<E> {
            Enc(PhantomData)
        }

        fn decoder(&mut self) -> Dec<D> {
            Dec(PhantomData)
        }
    }

    impl<E: prost::Message + Send + 'static> Encoder for Enc<E> {
        type Item = E;
        type Error = Status;

        fn encode(&mut self, item: E, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
            item.encode(buf)
                .map_err(|e| Status::internal(e.to_string()))
        }
    }

    impl<D: prost::Message + Default + Send + 'static> Decoder for Dec<D> {
        type Item = D;
        type Error = Status;

        fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<D>, Status> {
            D::decode(buf)
                .map(Some)
                .map_err(|e| Status::internal(e.to_string()))
        }
    }
}

/// The devices as the admin service reports them now.
pub async fn devices(b: &Broker) -> Result<Vec<gpu_broker_client::DeviceInfo>> {
    Ok(b.admin().await?.get_devices().await?)
}

/// Revokes `token` and expects the call `waiter` is waiting in (a lease or a turn asked
/// with that token) to be answered at once with the token's refusal: UNAUTHENTICATED,
/// `TOKEN_UNKNOWN`, not the session's disappearance.
pub async fn revoked_while_waiting<T: std::fmt::Debug>(
    b: &Broker,
    token: &str,
    waiter: tokio::task::JoinHandle<Result<T, gpu_broker_client::ClientError>>,
) {
    b.admin().await.unwrap().revoke_token(token).await.unwrap();
    let e = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter is answered when its token is revoked")
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code(), gpu_broker_client::Code::Unauthenticated, "{e}");
    assert_eq!(
        e.reason(),
        Some(&gpu_broker_client::error::Reason::TokenUnknown),
        "{e}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log of two starts (a restart appends to the same file) gives the latest start's
    /// metrics address: the first start's listener is gone.
    #[test]
    fn the_metrics_address_is_the_latest_starts() {
        let log = "INFO gpu_broker: metrics at /metrics addr=127.0.0.1:4001 require_token=false\n\
                   INFO gpu_broker: stopped\n\
                   INFO gpu_broker: metrics at /metrics addr=127.0.0.1:4002 require_token=false\n";
        assert_eq!(logged_metrics_addr(log).as_deref(), Some("127.0.0.1:4002"));
        assert_eq!(logged_metrics_addr("INFO gpu_broker: serving\n"), None);
    }
}
