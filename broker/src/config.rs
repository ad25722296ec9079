//! Configuration: command-line flags (each also settable through a `GPU_BROKER_*`
//! environment variable) and an optional TOML file (`--config`, keys are the long flag
//! names) parsed into one [`Config`]. Precedence: command line, then environment, then
//! file, then defaults; a bad setting in the file is reported with its line and key.

use crate::arbiter::{ArbiterConfig, ReclaimPolicy};
pub use crate::backend::{BackendChoice, Headroom};
use crate::defaults;
pub(crate) use crate::units::parse_duration;
use clap::{CommandFactory, Parser};
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The `--backend` values (the backend's [`BackendChoice`] knows nothing of clap).
fn backend_choice_parser() -> impl clap::builder::TypedValueParser<Value = BackendChoice> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new([
        PossibleValue::new("auto")
            .help("CUDA when a driver and a GPU are usable, otherwise the host simulation"),
        PossibleValue::new("host").help("The simulated device (shared-memory files)"),
        PossibleValue::new("cuda").help("Real GPUs through the CUDA driver API"),
    ])
    .map(|v| match v.as_str() {
        "host" => BackendChoice::Host,
        "cuda" => BackendChoice::Cuda,
        _ => BackendChoice::Auto,
    })
}

/// The `--reclaim-policy` values (the arbiter's [`ReclaimPolicy`] knows nothing of clap).
fn reclaim_policy_parser() -> impl clap::builder::TypedValueParser<Value = ReclaimPolicy> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new([
        PossibleValue::new(ReclaimPolicy::Cooperative.name())
            .help("Revoke the lease and quarantine its memory until the process lets go or exits"),
        PossibleValue::new(ReclaimPolicy::Terminate.name())
            .help("Kill the holder process (pid from the Unix socket), then reuse the memory"),
    ])
    .map(|v| ReclaimPolicy::from_name(&v).unwrap_or(defaults::RECLAIM_POLICY))
}

/// The `--keep-in` values (the keeper's [`crate::keeper::KeepIn`] knows nothing of clap).
fn keep_in_parser() -> impl clap::builder::TypedValueParser<Value = crate::keeper::KeepIn> {
    use crate::keeper::KeepIn;
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new(
        KeepIn::ALL
            .iter()
            .map(|(_, name, help)| PossibleValue::new(*name).help(*help)),
    )
    .map(|v| KeepIn::from_name(&v).unwrap_or_default())
}

fn parse_headroom(s: &str) -> Result<Headroom, String> {
    if let Some(p) = s.trim().strip_suffix('%') {
        let v: f64 = p
            .trim()
            .parse()
            .map_err(|_| format!("invalid percentage {s:?}"))?;
        if !(0.0..100.0).contains(&v) {
            return Err(format!("headroom {s:?} must be in [0%, 100%)"));
        }
        return Ok(Headroom::Percent(v));
    }
    if !s.trim().is_empty() && s.trim().bytes().all(|b| b.is_ascii_digit()) && s.trim() != "0" {
        return Err(format!(
            "headroom {s:?} has no unit: write {0}% for a share of each device, or a size \
             such as {0}GiB",
            s.trim()
        ));
    }
    crate::units::parse(s).map(Headroom::Bytes)
}

fn parse_size(s: &str) -> Result<u64, String> {
    crate::units::parse(s)
}

/// A rate or burst: a finite number >= 0.
fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=1e9).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a number from 0 to 1e9")),
    }
}

/// A comma-separated list of device indices (`0,1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceList(pub Vec<u32>);

fn parse_devices(s: &str) -> Result<DeviceList, String> {
    s.split(',')
        .map(|d| {
            d.trim()
                .parse::<u32>()
                .map_err(|_| format!("invalid device index {d:?}"))
        })
        .collect::<Result<Vec<u32>, String>>()
        .map(DeviceList)
}

/// The multi-tenant GPU memory broker daemon.
#[derive(Debug, Clone, Parser)]
#[command(name = "gpu-broker", version, about, args_override_self = true)]
pub struct Config {
    /// TOML file of settings; keys are the long flag names (`host-capacity = "8GiB"`).
    /// Flags on the command line override it.
    #[arg(long, env = "GPU_BROKER_CONFIG")]
    pub config: Option<PathBuf>,

    /// Unix socket to serve on (created 0660; a stale one is replaced).
    #[arg(
        long,
        env = "GPU_BROKER_SOCKET",
        default_value = "/run/gpu-broker/broker.sock"
    )]
    pub socket: PathBuf,

    /// Also serve on this TCP address (e.g. 127.0.0.1:50051).
    #[arg(long, env = "GPU_BROKER_LISTEN")]
    pub listen: Option<SocketAddr>,

    /// TLS certificate chain (PEM) served on `--listen`.
    #[arg(long, env = "GPU_BROKER_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// Private key (PEM) of `--tls-cert`.
    #[arg(long, env = "GPU_BROKER_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Require client certificates on `--listen`, signed by this CA (PEM).
    #[arg(long, env = "GPU_BROKER_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,

    /// Serve `--listen` as plain HTTP/2 without TLS (tokens cross the network readable).
    #[arg(long, env = "GPU_BROKER_INSECURE_TCP", conflicts_with = "tls_cert")]
    pub insecure_tcp: bool,

    /// Device backend.
    #[arg(long, env = "GPU_BROKER_BACKEND", value_parser = backend_choice_parser(), default_value = "auto")]
    pub backend: BackendChoice,

    /// CUDA devices to own, e.g. `0,1` (default: all).
    #[arg(long, env = "GPU_BROKER_DEVICES", value_parser = parse_devices)]
    pub devices: Option<DeviceList>,

    /// Size of each simulated device (host backend).
    #[arg(long, env = "GPU_BROKER_HOST_CAPACITY", default_value = "8GiB", value_parser = parse_size)]
    pub host_capacity: u64,

    /// Number of simulated devices (host backend).
    #[arg(long, env = "GPU_BROKER_HOST_DEVICES", default_value_t = 1)]
    pub host_devices: u32,

    /// Ignored: host memory (simulated devices, host fallback) is memfd memory with no
    /// files. Still accepted so existing command lines and config files keep working.
    #[arg(
        long,
        env = "GPU_BROKER_HOST_SHM_DIR",
        default_value = "/dev/shm",
        hide = true
    )]
    pub host_shm_dir: PathBuf,

    /// Memory kept free on each device: bytes (`2GiB`) or percent of total (`10%`).
    #[arg(long, env = "GPU_BROKER_HEADROOM", default_value = "10%", value_parser = parse_headroom)]
    pub headroom: Headroom,

    /// Capacity of the host-memory fallback tier (0 disables it).
    #[arg(long, env = "GPU_BROKER_HOST_FALLBACK_CAPACITY", default_value = "8GiB", value_parser = parse_size)]
    pub host_fallback_capacity: u64,

    /// Directory of the durable state (tenants, quotas, token hashes).
    #[arg(
        long,
        env = "GPU_BROKER_STATE_DIR",
        default_value = "/var/lib/gpu-broker"
    )]
    pub state_dir: PathBuf,

    /// File holding the admin token; generated (0600) on first start if missing.
    /// Default: `<state-dir>/admin.token`.
    #[arg(long, env = "GPU_BROKER_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,

    /// Time a holder has to release a lease after a reclaim request.
    #[arg(long, env = "GPU_BROKER_RECLAIM_DEADLINE", default_value = defaults::text(defaults::RECLAIM_DEADLINE), value_parser = parse_duration)]
    pub reclaim_deadline: Duration,

    /// What happens to a holder that misses its reclaim deadline.
    #[arg(
        long,
        env = "GPU_BROKER_RECLAIM_POLICY",
        value_parser = reclaim_policy_parser(),
        default_value = defaults::RECLAIM_POLICY.name()
    )]
    pub reclaim_policy: ReclaimPolicy,

    /// A session with no stream activity and no keepalive for this long ends (0s: never).
    #[arg(long, env = "GPU_BROKER_KEEPALIVE_TIMEOUT", default_value = defaults::text(defaults::KEEPALIVE_TIMEOUT), value_parser = parse_duration)]
    pub keepalive_timeout: Duration,

    /// Quarantined memory of a holder with unknown pid (TCP) is freed after this.
    #[arg(long, env = "GPU_BROKER_QUARANTINE_TIMEOUT", default_value = defaults::text(defaults::QUARANTINE_TIMEOUT), value_parser = parse_duration)]
    pub quarantine_timeout: Duration,

    /// Time sessions get to release their leases on shutdown.
    #[arg(long, env = "GPU_BROKER_SHUTDOWN_GRACE", default_value = defaults::text(defaults::SHUTDOWN_GRACE), value_parser = parse_duration)]
    pub shutdown_grace: Duration,

    /// Serve Prometheus metrics (`/metrics`) and `/healthz`, `/readyz` on this HTTP
    /// address; the flag alone means 127.0.0.1:7478 (loopback: only this node reads it).
    #[arg(
        long,
        env = "GPU_BROKER_METRICS_LISTEN",
        num_args = 0..=1,
        default_missing_value = crate::status_http::DEFAULT_LISTEN
    )]
    pub metrics_listen: Option<SocketAddr>,

    /// `/metrics` answers only requests with `Authorization: Bearer <token>`, a read token
    /// issued without a tenant or an admin token (for a listener others can reach).
    #[arg(long, env = "GPU_BROKER_METRICS_REQUIRE_TOKEN")]
    pub metrics_require_token: bool,

    /// GPU memory a worker process may use beyond its leases (its CUDA context) before
    /// the broker reports it as allocating behind the broker's back (NVML).
    #[arg(long, env = "GPU_BROKER_OWN_ALLOC_ALLOWANCE", default_value = "1GiB", value_parser = parse_size)]
    pub own_alloc_allowance: u64,

    /// Calls per second each tenant may make (token bucket; 0: no limit). Over it a call
    /// is RESOURCE_EXHAUSTED with a retry hint. Admin and node-wide read tokens are exempt.
    #[arg(long, env = "GPU_BROKER_TENANT_RPC_RATE", default_value_t = defaults::TENANT_RPC_RATE, value_parser = parse_rate)]
    pub tenant_rpc_rate: f64,

    /// Threads of the runtime that serves listings, other operator reads and the metrics
    /// listener, apart from the one admission's calls run on (0: the same runtime).
    #[arg(long, env = "GPU_BROKER_ADMIN_THREADS", default_value_t = defaults::ADMIN_THREADS, value_parser = clap::value_parser!(u16).range(0..=64))]
    pub admin_threads: u16,

    /// Also serve the Admin service (and gRPC health) on this Unix socket, wholly on the
    /// operators' runtime (`--admin-threads`), its connections included: an operator's
    /// calls there never touch the runtime admission's calls run on. Created 0660 like
    /// `--socket`; Broker calls there are UNIMPLEMENTED; `--socket` still serves Admin.
    #[arg(long, env = "GPU_BROKER_ADMIN_LISTEN")]
    pub admin_listen: Option<PathBuf>,

    /// Serve the Admin service only on `--admin-listen`: the workers' `--socket` (and
    /// `--listen`) answer Admin calls UNIMPLEMENTED, so a socket every worker pod mounts
    /// offers no admin surface at all.
    #[arg(long, env = "GPU_BROKER_ADMIN_LISTEN_ONLY", requires = "admin_listen")]
    pub admin_listen_only: bool,

    /// Accept Kubernetes ServiceAccount tokens for this audience from workers: checked with
    /// the API server's TokenReview, acting as their namespace's tenant (the config file's
    /// `namespaces`, docs/kubernetes.md). Off without it.
    #[arg(long, env = "GPU_BROKER_TOKEN_REVIEW_AUDIENCE", requires = "config")]
    pub token_review_audience: Option<String>,

    /// The API server asked about ServiceAccount tokens (`https://...`); without it, the
    /// pod's own ServiceAccount in the cluster (or the kubeconfig).
    #[arg(
        long,
        env = "GPU_BROKER_TOKEN_REVIEW_APISERVER",
        requires = "token_review_audience"
    )]
    pub token_review_apiserver: Option<String>,

    /// How long the API server's answer about a ServiceAccount token is trusted (a
    /// refusal too): the next call after it asks again.
    #[arg(long, env = "GPU_BROKER_TOKEN_REVIEW_CACHE", default_value = defaults::text(defaults::TOKEN_REVIEW_CACHE), value_parser = parse_duration)]
    pub token_review_cache: Duration,

    /// Most calls a tenant may make in a burst above its rate.
    #[arg(long, env = "GPU_BROKER_TENANT_RPC_BURST", default_value_t = defaults::TENANT_RPC_BURST, value_parser = parse_rate)]
    pub tenant_rpc_burst: f64,

    /// How often the health monitor checks every device (0s: never). A device that fails
    /// a check (or, with NVML, shows a critical Xid, new uncorrectable ECC errors or pages
    /// pending retirement) takes no new leases until it passes again.
    #[arg(long, env = "GPU_BROKER_HEALTH_INTERVAL", default_value = defaults::text(defaults::HEALTH_INTERVAL), value_parser = parse_duration)]
    pub health_interval: Duration,

    /// A device that does not answer a health check within this is unhealthy.
    #[arg(long, env = "GPU_BROKER_HEALTH_TIMEOUT", default_value = defaults::text(defaults::HEALTH_TIMEOUT), value_parser = parse_duration)]
    pub health_timeout: Duration,

    /// Most open sessions per tenant.
    #[arg(
        long,
        env = "GPU_BROKER_MAX_SESSIONS_PER_TENANT",
        default_value_t = defaults::MAX_SESSIONS_PER_TENANT
    )]
    pub max_sessions_per_tenant: usize,

    /// Most requests of one tenant waiting in the queue at once.
    #[arg(
        long,
        env = "GPU_BROKER_MAX_WAITING_PER_TENANT",
        default_value_t = defaults::MAX_WAITING_PER_TENANT
    )]
    pub max_waiting_per_tenant: usize,

    /// A request waiting for memory that others hold is overtaken by other tenants'
    /// requests of its priority that fit only while it has waited less than this; then
    /// they queue behind it until it is granted (0s: never overtaken).
    #[arg(long, env = "GPU_BROKER_OVERTAKE_AGE", default_value = defaults::text(defaults::OVERTAKE_AGE), value_parser = parse_duration)]
    pub overtake_age: Duration,

    /// How long a compute turn may last while others wait before its holder is asked to
    /// yield.
    #[arg(long, env = "GPU_BROKER_TURN_QUANTUM", default_value = defaults::text(defaults::TURN_QUANTUM), value_parser = parse_duration)]
    pub turn_quantum: Duration,

    /// How long after a yield request a compute turn is taken away.
    #[arg(long, env = "GPU_BROKER_TURN_GRACE", default_value = defaults::text(defaults::TURN_GRACE), value_parser = parse_duration)]
    pub turn_grace: Duration,

    /// Holders of compute turns per device at once: 1 is strict time slicing; N lets N
    /// small models run concurrently (under MPS, each held to its own share).
    #[arg(long, env = "GPU_BROKER_TURN_SLOTS", default_value_t = defaults::TURN_SLOTS, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub turn_slots: u32,

    /// How long a tenant still owed compute (below its weighted share) keeps the turn slot
    /// it gave back, for its next request; 0s: never (the slot goes to the next waiter at
    /// once). Lets weights hold when each tenant asks again right after its step.
    #[arg(long, env = "GPU_BROKER_TURN_ANTICIPATION", default_value = defaults::text(defaults::TURN_ANTICIPATION), value_parser = parse_duration)]
    pub turn_anticipation: Duration,

    /// How long the processes left in the process group of an ended process reservation
    /// (`gpu-brokerctl run`'s program and its descendants) have between SIGTERM and SIGKILL.
    #[arg(long, env = "GPU_BROKER_PROCESS_STOP_GRACE", default_value = defaults::text(defaults::PROCESS_STOP_GRACE), value_parser = parse_duration)]
    pub process_stop_grace: Duration,

    /// Count the state lock's holds by the holding thread's CPU clock as well as by the
    /// wall clock (`state_lock_holds_total{clock="cpu"}`): one system call on every take of
    /// the lock, up to ~5% of the broker's CPU a lease; for telling work under the lock from
    /// preemption on a busy node.
    #[arg(long, env = "GPU_BROKER_LOCK_HOLD_CPU_CLOCK")]
    pub lock_hold_cpu_clock: bool,

    /// Log as JSON lines instead of text.
    #[arg(long, env = "GPU_BROKER_LOG_JSON")]
    pub log_json: bool,

    /// Connection and stream limits (`crate::listener`).
    #[command(flatten)]
    pub limits: crate::listener::LimitFlags,

    /// Managed MPS (`crate::mps`).
    #[command(flatten)]
    pub mps: crate::mps::MpsFlags,

    /// Unix socket of the ticket server that hands lease file descriptors to workers
    /// (default: `<socket stem>.tickets.sock` next to --socket).
    #[arg(long, env = "GPU_BROKER_TICKET_SOCKET")]
    pub ticket_socket: Option<PathBuf>,

    /// How long a lease ticket stays valid.
    #[arg(long, env = "GPU_BROKER_TICKET_TTL", default_value = defaults::text(defaults::TICKET_TTL), value_parser = parse_duration)]
    pub ticket_ttl: Duration,

    /// Socket of a keeper (`gpu-broker keeper --socket PATH`) that holds lease descriptors
    /// and records across broker restarts: a restarted broker adopts the leases of workers
    /// still alive, and SIGTERM leaves them to the keeper (docs/operations.md).
    #[arg(long, env = "GPU_BROKER_KEEPER")]
    pub keeper: Option<PathBuf>,

    /// Where leases wait across a broker restart: `auto` (the keeper when --keeper names
    /// one, else systemd's file-descriptor store when the unit has one), `keeper`,
    /// `fdstore`, or `none` (docs/operations.md).
    #[arg(long, env = "GPU_BROKER_KEEP_IN", value_parser = keep_in_parser(), default_value = "auto")]
    pub keep_in: crate::keeper::KeepIn,
}

/// Settings the broker no longer has, each with why it was removed. Naming one (flag,
/// config key or environment variable) stops the broker at start with this reason rather
/// than clap's "unknown argument": an operator who relied on it must learn what changed.
const REMOVED_SETTINGS: &[(&str, &str, &str)] = &[(
    "legacy-ipc-handles",
    "GPU_BROKER_LEGACY_IPC_HANDLES",
    "legacy CUDA IPC handles were removed: any process on the node can forge one to open \
     other tenants' GPU memory, and one exporter process per tenant would not stop it \
     (measured; docs/security.md). Workers get fd handles (CUDA VMM memory); remove this \
     setting and use a client that accepts HANDLE_KIND_FD",
)];

/// The first removed setting that `args` (program name first) or the environment
/// (`env`) still names, as an error.
fn check_removed(
    args: &[OsString],
    env: impl Fn(&str) -> Option<OsString>,
) -> Result<(), ConfigError> {
    for &(flag, var, why) in REMOVED_SETTINGS {
        let long = format!("--{flag}");
        let named = args.iter().skip(1).any(|a| {
            let a = a.to_string_lossy();
            a == long || a.starts_with(&format!("{long}="))
        });
        let setting = if named {
            long
        } else if env(var).is_some() {
            var.to_string()
        } else {
            continue;
        };
        return Err(ConfigError::Removed { setting, why });
    }
    Ok(())
}

/// The file a socket path names, for comparing two: absolute, its directory resolved
/// component by component, as the bind will walk it (made where missing): `.` is
/// dropped, a directory that exists is resolved (symlinks; after it, `..` is its real
/// parent), one that does not yet is taken as spelled (`..` then goes back up the name).
/// So `/run/x/../gpu.sock` and `/run/gpu.sock` are one socket whether or not `/run/x`
/// exists.
fn socket_identity(p: &std::path::Path) -> PathBuf {
    use std::path::Component;
    let abs = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let (Some(dir), Some(name)) = (abs.parent(), abs.file_name()) else {
        return abs;
    };
    let mut at = PathBuf::new();
    for c in dir.components() {
        match c {
            Component::CurDir => continue,
            Component::ParentDir => {
                at.pop();
                continue;
            }
            other => at.push(other),
        }
        if let Ok(real) = std::fs::canonicalize(&at) {
            at = real;
        }
    }
    at.join(name)
}

/// Why the configuration could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Flags(#[from] clap::Error),
    #[error("config file {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("{setting} is no longer a setting of the broker: {why}")]
    Removed { setting: String, why: &'static str },
    #[error("{flag} {path} is the socket {other} names: each socket must be one of its own")]
    SharedSocket {
        flag: &'static str,
        path: PathBuf,
        other: &'static str,
    },
}

impl ConfigError {
    /// Prints the error (clap's own formatting for flag errors) and exits.
    pub fn exit(self) -> ! {
        match self {
            ConfigError::Flags(e) => e.exit(),
            other => {
                eprintln!("error: {other}");
                std::process::exit(2)
            }
        }
    }
}

impl Config {
    /// Parses the process's arguments (and the `--config` file they name).
    pub fn load() -> Result<Config, ConfigError> {
        Config::from_args(std::env::args_os().collect())
    }

    /// Parses `args` (program name first), reading the TOML file named by `--config` (or
    /// `GPU_BROKER_CONFIG`) and placing its settings before the command-line flags.
    pub fn from_args(args: Vec<OsString>) -> Result<Config, ConfigError> {
        Config::from_args_env(args, |var| std::env::var_os(var))
    }

    /// [`Config::from_args`] with the environment read through `env` (for removed
    /// settings; clap reads the flags' own variables itself).
    fn from_args_env(
        args: Vec<OsString>,
        env: impl Fn(&str) -> Option<OsString>,
    ) -> Result<Config, ConfigError> {
        check_removed(&args, &env)?;
        let first = Config::try_parse_from(&args)?;
        let Some(path) = first.config.clone() else {
            first.check_sockets()?;
            return Ok(first);
        };
        let file_args = file_args(&path, &env)?;
        let mut merged = Vec::with_capacity(args.len() + file_args.len());
        merged.extend(args.first().cloned());
        merged.extend(file_args);
        merged.extend(args.into_iter().skip(1));
        let cfg = Config::try_parse_from(merged)?;
        cfg.check_sockets()?;
        Ok(cfg)
    }

    /// The Unix sockets the broker binds (`--socket`, the ticket socket, `--admin-listen`)
    /// are three different files: binding one would replace another (each bind removes a
    /// stale file first), leaving it dead. Compared as absolute paths with the directory
    /// resolved (`./b.sock`, `dir/../b.sock` and a symlinked directory name one file).
    fn check_sockets(&self) -> Result<(), ConfigError> {
        let mut named: Vec<(&'static str, PathBuf)> = vec![
            ("--socket", self.socket.clone()),
            ("--ticket-socket", self.ticket_socket_path()),
        ];
        if let Some(p) = &self.admin_listen {
            named.push(("--admin-listen", p.clone()));
        }
        for (i, (flag, path)) in named.iter().enumerate() {
            let me = socket_identity(path);
            if let Some((other, _)) = named[..i].iter().find(|(_, p)| socket_identity(p) == me) {
                return Err(ConfigError::SharedSocket {
                    flag,
                    path: path.clone(),
                    other,
                });
            }
        }
        Ok(())
    }

    /// Where the ticket server listens.
    pub fn ticket_socket_path(&self) -> PathBuf {
        self.ticket_socket.clone().unwrap_or_else(|| {
            let stem = self
                .socket
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "broker".into());
            self.socket.with_file_name(format!("{stem}.tickets.sock"))
        })
    }

    /// Where the admin token lives.
    pub fn admin_token_path(&self) -> PathBuf {
        self.admin_token_file
            .clone()
            .unwrap_or_else(|| self.state_dir.join("admin.token"))
    }

    /// The health monitor's part of the configuration.
    pub fn health(&self) -> crate::health::HealthConfig {
        crate::health::HealthConfig {
            interval: self.health_interval,
            timeout: self.health_timeout,
        }
    }

    /// The arbiter's part of the configuration.
    pub fn arbiter(&self) -> ArbiterConfig {
        ArbiterConfig {
            reclaim_deadline: self.reclaim_deadline,
            keepalive_timeout: self.keepalive_timeout,
            reclaim_policy: self.reclaim_policy,
            quarantine_timeout: self.quarantine_timeout,
            max_sessions_per_tenant: self.max_sessions_per_tenant,
            max_waiting_per_tenant: self.max_waiting_per_tenant,
            overtake_age: self.overtake_age,
            turns: crate::scheduler::TurnConfig {
                quantum: self.turn_quantum,
                grace: self.turn_grace,
                slots: self.turn_slots,
                anticipation: self.turn_anticipation,
            },
            rate: crate::rate::RateConfig {
                rate: self.tenant_rpc_rate,
                burst: self.tenant_rpc_burst,
            },
            process_stop_grace: self.process_stop_grace,
            lock_hold_cpu_clock: self.lock_hold_cpu_clock,
            fd_reserve: crate::fd_budget::reserve_for(self.limits.limits().max_connections),
            ..ArbiterConfig::default()
        }
    }
}

/// The settings of a TOML file as `--flag value` arguments, each checked by its flag's own
/// parser first so that a bad one is reported with the file, line and key. A setting whose
/// flag's `GPU_BROKER_*` variable is set (non-empty) in `env` is left out: the environment
/// overrides the file, as the command line (whose flags come after these) overrides both.
fn file_args(
    path: &std::path::Path,
    env: &impl Fn(&str) -> Option<OsString>,
) -> Result<Vec<OsString>, ConfigError> {
    use toml::Spanned;
    let err = |reason: String| ConfigError::File {
        path: path.to_path_buf(),
        reason,
    };
    // A regular file of at most 1 MiB (a FIFO or a device is refused, not waited on).
    let bytes = crate::file_read::read_regular(path, crate::file_read::MAX_WATCHED_FILE_BYTES)
        .map_err(|e| err(e.to_string()))?;
    let text = String::from_utf8(bytes).map_err(|_| err("not UTF-8 text".into()))?;
    let table: std::collections::BTreeMap<Spanned<String>, Spanned<toml::Value>> =
        toml::from_str(&text).map_err(|e: toml::de::Error| {
            let at = e.span().map(|s| s.start).unwrap_or(0);
            err(format!("line {}: {}", line_of(&text, at), e.message()))
        })?;
    let cmd = Config::command();
    let mut out = Vec::new();
    for (key, value) in table {
        let line = line_of(&text, key.span().start);
        let key = key.into_inner();
        let at = |reason: String| err(format!("line {line}: {key}: {reason}"));
        // `[tenants.NAME]` and `[tokens.NAME]` tables are declarations (`tenants_config`,
        // `tokens_config`), not flags.
        if key == "tenants" || key == "tokens" {
            continue;
        }
        if let Some((_, _, why)) = REMOVED_SETTINGS.iter().find(|(k, _, _)| *k == key) {
            return Err(at(format!("is no longer a setting of the broker: {why}")));
        }
        let Some(arg) = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(key.as_str()) && key != "config")
        else {
            return Err(at(
                "unknown setting (settings are the long flag names, e.g. host-capacity)".into(),
            ));
        };
        let from_env = arg
            .get_env()
            .and_then(|var| env(&var.to_string_lossy()))
            .is_some_and(|v| !v.is_empty());
        if from_env {
            continue;
        }
        let flag = OsString::from(format!("--{key}"));
        let takes_value = arg.get_action().takes_values();
        let text_value = match value.into_inner() {
            toml::Value::Boolean(on) if !takes_value => {
                if on {
                    out.push(flag);
                }
                continue;
            }
            _ if !takes_value => return Err(at("an on/off setting: write true or false".into())),
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    toml::Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect::<Vec<_>>()
                .join(","),
            other => return Err(at(format!("unsupported value {other}"))),
        };
        // The flag's own parser, through a parse of this one setting: only a refusal of
        // its value counts here (a missing companion flag is the merged parse's to report).
        if let Err(e) = Config::command().try_get_matches_from([
            OsString::from("gpu-broker"),
            flag.clone(),
            text_value.clone().into(),
        ]) {
            use clap::error::{ContextKind, ContextValue, ErrorKind};
            // This setting's refusal only (clap reads the real environment here too: a bad
            // variable of another flag is the merged parse's to report, with its name).
            let ours = matches!(
                e.get(ContextKind::InvalidArg),
                Some(ContextValue::String(a)) if a == &format!("--{key}") || a.starts_with(&format!("--{key} "))
            );
            if ours
                && matches!(
                    e.kind(),
                    ErrorKind::ValueValidation | ErrorKind::InvalidValue
                )
            {
                use std::error::Error;
                let why = e
                    .source()
                    .map(|s| s.to_string())
                    .unwrap_or_else(|| e.kind().to_string());
                return Err(at(format!("{text_value:?}: {why}")));
            }
        }
        out.extend([flag, text_value.into()]);
    }
    Ok(out)
}

/// The 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_file_settings_apply_and_flags_override_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("broker.toml");
        std::fs::write(
            &path,
            "backend = \"host\"\nhost-capacity = \"2GiB\"\nhost-devices = 2\ndevices = [0, 1]\nlog-json = true\nheadroom = \"5%\"\n",
        )
        .unwrap();
        let args = |extra: &[&str]| {
            let mut v: Vec<OsString> =
                vec!["gpu-broker".into(), "--config".into(), path.clone().into()];
            v.extend(extra.iter().map(OsString::from));
            v
        };
        let c = Config::from_args(args(&[])).unwrap();
        assert_eq!(c.backend, BackendChoice::Host);
        assert_eq!(c.host_capacity, 2 << 30);
        assert_eq!(c.host_devices, 2);
        assert_eq!(c.devices, Some(DeviceList(vec![0, 1])));
        assert!(c.log_json);
        let c = Config::from_args(args(&["--host-capacity", "1GiB"])).unwrap();
        assert_eq!(c.host_capacity, 1 << 30, "the command line wins");
    }

    #[test]
    fn the_lock_hold_cpu_clock_is_off_unless_asked_for() {
        let off = Config::from_args(vec!["gpu-broker".into()]).unwrap();
        assert!(!off.arbiter().lock_hold_cpu_clock);
        let on =
            Config::from_args(vec!["gpu-broker".into(), "--lock-hold-cpu-clock".into()]).unwrap();
        assert!(on.arbiter().lock_hold_cpu_clock);
    }

    #[test]
    fn the_command_lines_defaults_are_the_components_defaults() {
        let c = Config::from_args(vec!["gpu-broker".into()]).unwrap();
        let (got, want) = (c.arbiter(), ArbiterConfig::default());
        assert_eq!(
            (
                got.reclaim_deadline,
                got.keepalive_timeout,
                got.quarantine_timeout,
                got.max_sessions_per_tenant,
                got.max_waiting_per_tenant,
                got.overtake_age,
                (got.turns.quantum, got.turns.grace, got.turns.slots),
                got.process_stop_grace,
                got.lock_hold_cpu_clock,
            ),
            (
                want.reclaim_deadline,
                want.keepalive_timeout,
                want.quarantine_timeout,
                want.max_sessions_per_tenant,
                want.max_waiting_per_tenant,
                want.overtake_age,
                (want.turns.quantum, want.turns.grace, want.turns.slots),
                want.process_stop_grace,
                want.lock_hold_cpu_clock,
            )
        );
        assert_eq!(c.health(), crate::health::HealthConfig::default());
        assert_eq!(c.reclaim_deadline, defaults::RECLAIM_DEADLINE);
        // The reclaim policy, the tenant rate limit (off, with its burst for when a rate
        // is set) and the tickets' TTL: each once, in defaults.rs.
        assert_eq!(got.reclaim_policy, want.reclaim_policy);
        assert_eq!(got.reclaim_policy, ReclaimPolicy::Cooperative);
        assert_eq!(got.rate, want.rate);
        assert_eq!(got.rate, crate::rate::RateConfig::default());
        assert_eq!(
            c.ticket_ttl,
            crate::fd::tickets::TicketTable::default().ttl()
        );
        assert_eq!(c.shutdown_grace, defaults::SHUTDOWN_GRACE);
    }

    /// What `--help` shows as each default is what a user who sets nothing gets.
    #[test]
    fn help_shows_the_defaults_a_user_gets() {
        let cmd = Config::command();
        let shown = |long: &str| -> String {
            let a = cmd
                .get_arguments()
                .find(|a| a.get_long() == Some(long))
                .unwrap_or_else(|| panic!("no --{long}"));
            let v: Vec<String> = a
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().to_string())
                .collect();
            v.join(",")
        };
        assert_eq!(shown("tenant-rpc-burst"), "100");
        assert_eq!(shown("tenant-rpc-rate"), "0");
        assert_eq!(shown("reclaim-policy"), "cooperative");
        assert_eq!(shown("ticket-ttl"), "30s");
        assert_eq!(shown("shutdown-grace"), "5s");
        let c = Config::from_args(vec!["gpu-broker".into()]).unwrap();
        let rate = c.arbiter().rate;
        assert_eq!(rate.burst.to_string(), shown("tenant-rpc-burst"));
        assert_eq!(rate.rate.to_string(), shown("tenant-rpc-rate"));
        assert_eq!(
            crate::units::parse_duration(&shown("ticket-ttl")),
            Ok(c.ticket_ttl)
        );
        // A user who sets only a rate gets bursts of the burst --help shows: 100 calls at
        // once, then a refusal.
        let limiter = crate::rate::RateLimiter::new(crate::rate::RateConfig { rate: 1.0, ..rate });
        let now = std::time::Instant::now();
        for _ in 0..100 {
            assert!(limiter.take("t", now).is_ok());
        }
        assert!(limiter.take("t", now).is_err());
        // And so does a component built with the library's defaults.
        let limiter = crate::rate::RateLimiter::new(crate::rate::RateConfig {
            rate: 1.0,
            ..ArbiterConfig::default().rate
        });
        for _ in 0..100 {
            assert!(limiter.take("t", now).is_ok());
        }
        assert!(limiter.take("t", now).is_err());
    }

    /// The connection limits' flags, left at their defaults, are `Limits::default()`: both
    /// come from `defaults.rs`.
    #[test]
    fn the_limit_flags_defaults_are_the_limits_default() {
        let flags = Config::from_args(vec!["gpu-broker".into()]).unwrap().limits;
        assert_eq!(
            (
                flags.max_connections,
                flags.max_connections_per_uid,
                flags.admin_connection_reserve,
                flags.handshake_timeout,
                flags.max_streams_per_connection,
                flags.max_unauthenticated_streams,
            ),
            (
                defaults::MAX_CONNECTIONS,
                defaults::MAX_CONNECTIONS_PER_UID,
                defaults::ADMIN_CONNECTION_RESERVE,
                defaults::HANDSHAKE_TIMEOUT,
                defaults::MAX_STREAMS_PER_CONNECTION,
                defaults::MAX_UNAUTHENTICATED_STREAMS,
            )
        );
        assert_eq!(flags.limits(), crate::listener::Limits::default());
    }

    #[test]
    fn the_shipped_example_config_is_valid() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config.toml");
        let args: Vec<OsString> = vec!["gpu-broker".into(), "--config".into(), path.into()];
        let c = Config::from_args(args).unwrap();
        assert_eq!(c.reclaim_policy, ReclaimPolicy::Cooperative);
        assert_eq!(c.headroom, Headroom::Percent(10.0));
    }

    #[test]
    fn the_shipped_config_lists_every_setting_and_uses_cuda() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        let missing: Vec<String> = Config::command()
            .get_arguments()
            // Hidden ones are accepted and ignored: the shipped file leaves them out.
            .filter(|a| !a.is_hide_set())
            .filter_map(|a| a.get_long().map(str::to_string))
            .filter(|l| l != "config" && l != "help" && l != "version")
            .filter(|l| {
                !text.lines().any(|line| {
                    let line = line.trim_start_matches(['#', ' ']);
                    line.starts_with(&format!("{l} =")) || line.starts_with(&format!("{l}="))
                })
            })
            .collect();
        assert!(
            missing.is_empty(),
            "deploy/config.toml lacks {missing:?}: it lists every setting (commented if it has no default)"
        );
        let args: Vec<OsString> = vec!["gpu-broker".into(), "--config".into(), path.into()];
        let c = Config::from_args(args).unwrap();
        assert_eq!(
            c.backend,
            BackendChoice::Cuda,
            "production fails loudly without a GPU"
        );
    }

    #[test]
    fn the_environment_overrides_the_file_and_the_command_line_overrides_both() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("broker.toml");
        std::fs::write(&path, "host-capacity = \"2GiB\"\nhost-devices = 2\n").unwrap();
        let args = |extra: &[&str]| -> Vec<OsString> {
            let mut v: Vec<OsString> =
                vec!["gpu-broker".into(), "--config".into(), path.clone().into()];
            v.extend(extra.iter().map(OsString::from));
            v
        };
        // The closure stands for the process environment in the file step; clap reads the
        // real one, so the variable's value must not differ from the file's for that test.
        let env_says = |var: &str| (var == "GPU_BROKER_HOST_CAPACITY").then(|| "3GiB".into());
        let c = Config::from_args_env(args(&[]), env_says).unwrap();
        assert_eq!(
            c.host_capacity,
            8 << 30,
            "a setting whose variable is set is not taken from the file (clap reads the real, \
             unset variable here: the default)"
        );
        assert_eq!(c.host_devices, 2, "the others are");
        let c = Config::from_args_env(args(&["--host-capacity", "1GiB"]), env_says).unwrap();
        assert_eq!(c.host_capacity, 1 << 30, "the command line wins over both");
        let empty = |var: &str| (var == "GPU_BROKER_HOST_CAPACITY").then(OsString::new);
        let c = Config::from_args_env(args(&[]), empty).unwrap();
        assert_eq!(c.host_capacity, 2 << 30, "an empty variable is unset");
    }

    #[test]
    fn a_bad_setting_names_the_file_its_line_and_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("broker.toml");
        for (text, line, want) in [
            (
                "backend = \"host\"\n\nheadroom = 10\n",
                3,
                "headroom: \"10\": headroom \"10\" has no unit: write 10%",
            ),
            (
                "# c\nhost-capacity = \"4096\"\n",
                2,
                "host-capacity: \"4096\": size \"4096\" has no unit",
            ),
            ("log-json = \"yes\"\n", 1, "log-json: an on/off setting"),
            (
                "\n\nhost-capasity = \"1GiB\"",
                3,
                "host-capasity: unknown setting",
            ),
            ("headroom = \"150%\"", 1, "must be in [0%, 100%)"),
            ("x = = 1", 1, "line 1"),
        ] {
            std::fs::write(&path, text).unwrap();
            let args: Vec<OsString> =
                vec!["gpu-broker".into(), "--config".into(), path.clone().into()];
            let e = Config::from_args_env(args, |_: &str| None)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&path.display().to_string()) && e.contains(&format!("line {line}")),
                "{text:?}: {e}"
            );
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn headroom_takes_a_percentage_or_a_size_with_its_unit() {
        let parse = |h: &str| Config::try_parse_from(["gpu-broker", "--headroom", h]);
        assert_eq!(parse("10%").unwrap().headroom, Headroom::Percent(10.0));
        assert_eq!(parse("2GiB").unwrap().headroom, Headroom::Bytes(2 << 30));
        let e = parse("10").unwrap_err().to_string();
        assert!(e.contains("has no unit"), "{e}");
    }

    #[test]
    fn bad_config_files_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("broker.toml");
        for (text, want) in [
            ("host-capasity = \"1GiB\"", "unknown setting"),
            ("host-capacity = ", "config file"),
            ("host-capacity = \"lots\"", "invalid size"),
        ] {
            std::fs::write(&path, text).unwrap();
            let args: Vec<OsString> =
                vec!["gpu-broker".into(), "--config".into(), path.clone().into()];
            let e = Config::from_args(args).unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        let missing: Vec<OsString> = vec![
            "gpu-broker".into(),
            "--config".into(),
            "/nonexistent.toml".into(),
        ];
        assert!(Config::from_args(missing).is_err());
    }

    #[test]
    fn a_removed_setting_stops_the_broker_saying_why() {
        let none = |_: &str| None;
        let args = |extra: &[&str]| -> Vec<OsString> {
            std::iter::once("gpu-broker")
                .chain(extra.iter().copied())
                .map(OsString::from)
                .collect()
        };
        for flag in ["--legacy-ipc-handles", "--legacy-ipc-handles=true"] {
            let e = Config::from_args_env(args(&[flag]), none).unwrap_err();
            assert!(matches!(e, ConfigError::Removed { .. }), "{e:?}");
            let text = e.to_string();
            assert!(
                text.starts_with("--legacy-ipc-handles is no longer"),
                "{text}"
            );
            assert!(
                text.contains("forge") && text.contains("docs/security.md"),
                "{text}"
            );
        }
        let env = |v: &str| (v == "GPU_BROKER_LEGACY_IPC_HANDLES").then(|| OsString::from("1"));
        let e = Config::from_args_env(args(&[]), env)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("GPU_BROKER_LEGACY_IPC_HANDLES is no longer"),
            "{e}"
        );
        // In a config file: the same reason, not "unknown setting".
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("broker.toml");
        for value in ["true", "false"] {
            std::fs::write(&path, format!("legacy-ipc-handles = {value}\n")).unwrap();
            let a = args(&["--config", path.to_str().unwrap()]);
            let e = Config::from_args_env(a, none).unwrap_err().to_string();
            assert!(!e.contains("unknown setting"), "{e}");
            assert!(e.contains("legacy-ipc-handles: is no longer"), "{e}");
            assert!(e.contains("docs/security.md"), "{e}");
        }
        // A similar name is still just unknown; the broker's own flags still parse.
        let e = Config::from_args_env(args(&["--legacy-ipc"]), none).unwrap_err();
        assert!(matches!(e, ConfigError::Flags(_)), "{e:?}");
        assert!(Config::from_args_env(args(&["--backend", "host"]), none).is_ok());
    }

    #[test]
    fn parses_flags_with_units() {
        let c = Config::try_parse_from([
            "gpu-broker",
            "--backend",
            "host",
            "--host-capacity",
            "512MiB",
            "--headroom",
            "5%",
            "--reclaim-deadline",
            "250ms",
            "--devices",
            "0,1",
        ])
        .unwrap();
        assert_eq!(c.host_capacity, 512 << 20);
        assert_eq!(c.headroom.of(1000), 50);
        assert_eq!(c.reclaim_deadline, Duration::from_millis(250));
        assert_eq!(c.devices, Some(DeviceList(vec![0, 1])));
        assert_eq!(
            c.admin_token_path(),
            PathBuf::from("/var/lib/gpu-broker/admin.token")
        );
    }

    #[test]
    fn rejects_bad_values() {
        for args in [
            ["gpu-broker", "--headroom", "150%"],
            ["gpu-broker", "--host-capacity", "lots"],
            ["gpu-broker", "--devices", "0,x"],
        ] {
            assert!(Config::try_parse_from(args).is_err(), "{args:?}");
        }
        assert_eq!(parse_headroom("1GiB").unwrap(), Headroom::Bytes(1 << 30));
    }

    #[test]
    fn metrics_are_off_by_default_and_the_bare_flag_binds_loopback_only() {
        let c = Config::from_args(vec!["gpu-broker".into()]).unwrap();
        assert_eq!(c.metrics_listen, None);
        assert!(!c.metrics_require_token);
        let c = Config::from_args(vec!["gpu-broker".into(), "--metrics-listen".into()]).unwrap();
        let addr = c.metrics_listen.unwrap();
        assert!(addr.ip().is_loopback(), "{addr}");
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config.toml");
        let c =
            Config::from_args(vec!["gpu-broker".into(), "--config".into(), path.into()]).unwrap();
        assert!(
            c.metrics_listen.is_some_and(|a| a.ip().is_loopback()),
            "the shipped config serves metrics on loopback only: {:?}",
            c.metrics_listen
        );
    }

    #[test]
    fn a_socket_named_twice_is_refused_whatever_its_spelling() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::os::unix::fs::symlink(d, d.join("link")).unwrap();
        let parse = |args: &[&str]| {
            let mut v: Vec<OsString> = vec!["gpu-broker".into(), "--socket".into()];
            v.push(d.join("b.sock").into());
            v.extend(args.iter().map(OsString::from));
            Config::from_args(v)
        };
        let p = |rel: &str| d.join(rel).display().to_string();
        std::fs::create_dir_all(d.join("x")).unwrap();
        for same in [
            p("b.sock"),
            p("./b.sock"),
            p("x/../b.sock"),
            p("link/b.sock"),
        ] {
            match parse(&["--admin-listen", &same]) {
                Err(e @ ConfigError::SharedSocket { flag, other, .. }) => {
                    assert_eq!((flag, other), ("--admin-listen", "--socket"), "{same}");
                    let text = e.to_string();
                    assert!(
                        text.contains(&same) && text.contains("one of its own"),
                        "{text}"
                    );
                }
                other => panic!("{same}: {other:?}"),
            }
        }
        // The ticket socket (given, or the default beside --socket) is a socket too.
        let ticket = p("b.tickets.sock");
        assert!(matches!(
            parse(&["--admin-listen", &ticket]),
            Err(ConfigError::SharedSocket {
                other: "--ticket-socket",
                ..
            })
        ));
        assert!(matches!(
            parse(&["--ticket-socket", &p("./b.sock")]),
            Err(ConfigError::SharedSocket {
                flag: "--ticket-socket",
                other: "--socket",
                ..
            })
        ));
        // A directory that does not exist yet (the bind makes it): `..` still goes back up,
        // through a symlinked directory after it too.
        for same in [
            p("not-yet/../b.sock"),
            p("not-yet/deeper/../../b.sock"),
            p("./not-yet/./.././b.sock"),
            p("not-yet/../link/b.sock"),
        ] {
            assert!(!d.join("not-yet").exists());
            assert!(
                matches!(
                    parse(&["--admin-listen", &same]),
                    Err(ConfigError::SharedSocket { .. })
                ),
                "{same}"
            );
        }
        parse(&["--admin-listen", &p("not-yet/b.sock")]).unwrap();
        // Three sockets of their own are fine; so is a relative name of another file.
        let c = parse(&["--admin-listen", &p("admin.sock")]).unwrap();
        assert_eq!(c.admin_listen, Some(d.join("admin.sock")));
        parse(&["--admin-listen", "admin.sock"]).unwrap();
        // A config file's settings are checked too.
        let file = d.join("broker.toml");
        std::fs::write(
            &file,
            format!("socket = \"{0}\"\nadmin-listen = \"{0}\"\n", p("c.sock")),
        )
        .unwrap();
        let e = Config::from_args(vec!["gpu-broker".into(), "--config".into(), file.into()])
            .unwrap_err();
        assert!(matches!(e, ConfigError::SharedSocket { .. }), "{e:?}");
    }
}
