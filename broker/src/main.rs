//! `gpu-broker`: the daemon. Wiring only: parse flags, set up logging, open the state
//! store, the admin token and the devices, bind the listeners, serve until SIGINT/SIGTERM.

use anyhow::Context;
use gpu_broker::arbiter::Arbiter;
use gpu_broker::auth::Authenticator;
use gpu_broker::backend::{open_devices, open_host_tier, BackendSpec};
use gpu_broker::config::Config;
use gpu_broker::server::{bind_unix, serve, Listeners};
use gpu_broker::store::Store;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

mod check_config;

fn main() -> anyhow::Result<()> {
    let clock = gpu_broker::startup::StartClock::begin();
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == "check-config")
    {
        std::process::exit(check_config::run(std::env::args_os().skip(1)));
    }
    if std::env::args_os().nth(1).is_some_and(|a| a == "keeper") {
        return run_keeper();
    }
    let cfg = Config::load().unwrap_or_else(|e| e.exit());
    // Before any thread: what systemd's fd store handed back becomes ours (close-on-exec).
    let handed_back = gpu_broker::keeper::fdstore::take_handed_back();
    init_logging(cfg.log_json);
    join_own_mps(&cfg);
    // Admin calls, listings, the operators' socket and the metrics listener run on their own runtime
    // (`read_pool.rs`), kept until the main one has stopped.
    let reads = gpu_broker::read_pool::ReadPool::start(cfg.admin_threads.into())
        .context("starting the runtime of operator reads")?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(run(cfg, &reads, handed_back, clock))
}

/// `gpu-broker keeper --socket PATH`: the process that holds lease descriptors and
/// records across a broker restart (`keeper/serve.rs`).
fn run_keeper() -> anyhow::Result<()> {
    use clap::Parser;
    /// Holds the broker's lease descriptors and records across its restarts.
    #[derive(Parser)]
    #[command(name = "gpu-broker keeper")]
    struct KeeperArgs {
        /// The keeper's socket (the broker's `--keeper`).
        #[arg(long)]
        socket: std::path::PathBuf,
    }
    let args = KeeperArgs::parse_from(std::env::args_os().skip(1));
    // One descriptor per leased block: as many as the broker may hold.
    let nofile = gpu_broker::fd_budget::raise_nofile_limit();
    eprintln!("gpu-broker keeper: descriptor limit {nofile}");
    gpu_broker::keeper::serve::run(&args.socket)
        .with_context(|| format!("keeper on {}", args.socket.display()))
}

fn init_logging(json: bool) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_env("GPU_BROKER_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    use std::io::IsTerminal;
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        // A closed stderr (`gpu-broker ... 2>&1 | head`) must not kill the broker: the
        // default reports a failed write with `eprintln!`, which panics on a broken pipe.
        .log_internal_errors(false);
    if json {
        b.json().init();
    } else {
        b.init();
    }
}

async fn run(
    cfg: Config,
    reads: &gpu_broker::read_pool::ReadPool,
    handed_back: Vec<(String, std::os::fd::OwnedFd)>,
    mut clock: gpu_broker::startup::StartClock,
) -> anyhow::Result<()> {
    // The TCP listener's TLS first: a missing or bad certificate fails before anything
    // else is opened.
    let mut tcp_tls = None;
    if let Some(addr) = cfg.listen {
        match gpu_broker::tls::tcp_security(
            cfg.tls_cert.as_deref(),
            cfg.tls_key.as_deref(),
            cfg.tls_client_ca.as_deref(),
            cfg.insecure_tcp,
            cfg.limits.handshake_timeout,
        )? {
            gpu_broker::tls::TcpSecurity::Tls { server, mtls } => {
                tracing::info!(%addr, client_certificates = mtls, "TLS on the TCP listener");
                tcp_tls = Some(server);
            }
            gpu_broker::tls::TcpSecurity::Insecure => tracing::warn!(
                %addr,
                "--insecure-tcp: the TCP listener is plain HTTP/2, tokens cross the network readable; use --tls-cert/--tls-key"
            ),
        }
    }
    let nofile = gpu_broker::fd_budget::raise_nofile_limit();
    tracing::info!(nofile, "descriptor limit");
    let store = Store::open(&cfg.state_dir)
        .with_context(|| format!("opening the state in {}", cfg.state_dir.display()))?;
    clock.step("open store");
    let admin_token =
        gpu_broker::admin_token::load_or_create(&cfg.admin_token_path()).context("admin token")?;
    let auth = Arc::new(Authenticator::new(&admin_token));
    auth.set_admin_file(&cfg.admin_token_path());
    let spec = BackendSpec {
        choice: cfg.backend,
        cuda_devices: cfg.devices.clone().map(|d| d.0),
        host_capacity: cfg.host_capacity,
        host_devices: cfg.host_devices,
        headroom: cfg.headroom,
        host_uuid_seed: Some(
            std::fs::canonicalize(&cfg.state_dir)
                .unwrap_or_else(|_| cfg.state_dir.clone())
                .to_string_lossy()
                .into_owned(),
        ),
    };
    // What the previous broker left is read while the devices open (creating a CUDA
    // context takes a while): the keeper's dump on a thread of its own.
    let kept = read_kept(&cfg, handed_back)?;
    let _nvml = gpu_broker::nvml_warm::start(cfg.backend);
    // Managed MPS starts before the devices open: in the ExclusiveProcess compute mode the
    // broker's own context must be an MPS client (docs/mps.md).
    let mps = if cfg.mps.mps {
        Some(start_mps(&cfg).await)
    } else {
        None
    };
    let devices = open_devices(&spec).context("opening devices")?;
    clock.step("open devices");
    let host_tier =
        open_host_tier(cfg.host_fallback_capacity).context("opening the host fallback tier")?;
    let arb = Arbiter::new(devices, host_tier, Some(store), auth, cfg.arbiter())
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("loading state")?;
    clock.step("load state");
    // Before the take-back: a kept charge whose holder exits right after it is looked for
    // near that holder (`kept_holders.rs`), and sessions taken back get their peers' places.
    let process_monitor = match arb.devices().any_cuda() {
        true => gpu_broker::gpu_processes::ProcessMonitor::open().map(Arc::new),
        false => None,
    };
    if let Some(monitor) = &process_monitor {
        arb.stranded()
            .find_holders_with(gpu_broker::kept_holders::HolderFinder::new(monitor.clone()));
        clock.step("process monitor");
    }
    // Before anything is served: what the previous broker left is taken back first.
    match kept {
        Kept::Keeper(dump) => {
            // Waited for off the runtime.
            let dumped = tokio::task::spawn_blocking(move || dump.join())
                .await?
                .map_err(|_| anyhow::anyhow!("reading the keeper's records panicked"))??;
            clock.step("wait for the keeper's dump");
            arb.restart().adopt_dumped(dumped, clock.steps());
        }
        Kept::FdStore(store) => {
            let dumped = gpu_broker::keeper::place::dump(store)
                .context("taking back what systemd's file-descriptor store holds")?;
            arb.restart().adopt_dumped(dumped, clock.steps());
        }
        Kept::Nothing => {}
    }
    clock.skip();
    if let Some(mps) = mps.clone() {
        mps.set_device_count(arb.devices().len() as u32);
        arb.lifecycle().set_mps(mps);
    } else if arb.devices().any_cuda() {
        use gpu_broker::mps::compute_mode;
        let modes = compute_mode::read(&device_indices(&cfg));
        if compute_mode::broker_must_join(&modes) {
            tracing::warn!(
                compute_modes = ?modes,
                "a device is in the ExclusiveProcess compute mode: the broker's context is the only one it admits, so workers cannot map leases there; run with --mps (docs/mps.md)"
            );
        }
        arb.lifecycle().set_compute_modes(modes);
    }
    clock.step("compute modes");
    let shutdown = CancellationToken::new();
    // The TLS certificate is read again on SIGHUP and when its files change.
    if let Some(server) = &tcp_tls {
        arb.lifecycle().spawn_worker(
            "tls-reload",
            shutdown.clone(),
            gpu_broker::tls::reload_loop(
                server.clone(),
                std::time::Duration::from_secs(2),
                shutdown.clone(),
            ),
        );
    }
    // Declarative tenants: applied before serving, then on SIGHUP and file changes.
    if let Some(path) = &cfg.config {
        let declared = gpu_broker::tenants_config::load(path)?;
        // Its tokens too (one declaration for every node), read before anything applies.
        let tokens =
            gpu_broker::tokens_config::load(path, &gpu_broker::tenants_config::names(&declared))?;
        let n = declared.len();
        arb.authenticator()
            .set_namespace_tenants(gpu_broker::tenants_config::namespace_tenants(&declared));
        // On the store writer, as every durable change.
        let changes = arb
            .changes()
            .run(move |a| Ok(gpu_broker::tenants_config::apply(a, &declared, "start")))
            .await?;
        tracing::info!(path = %path.display(), tenants = n, changed = changes.len(), "config tenants applied");
        // After the tenants they name.
        let applied = gpu_broker::tokens_config::apply(&arb, &tokens, "start");
        tracing::info!(path = %path.display(), tokens = tokens.len(), added = applied.added.len(), "config tokens applied");
        gpu_broker::tenants_config::spawn_watch(
            arb.clone(),
            path.clone(),
            std::time::Duration::from_secs(2),
            shutdown.clone(),
        );
    } else {
        // SIGHUP's default action ends the process: handle it even with nothing to reload.
        spawn_hup_without_config(&arb, shutdown.clone());
    }
    // Kubernetes ServiceAccount tokens, when asked for: before serving.
    if let Some(audience) = &cfg.token_review_audience {
        let kube = match &cfg.token_review_apiserver {
            Some(url) => kube::Config::new(url.parse().context("--token-review-apiserver")?),
            None => kube::Config::infer()
                .await
                .context("--token-review-audience: finding the API server")?,
        };
        let client = kube::Client::try_from(kube).context("the API server's client")?;
        arb.authenticator()
            .set_reviewer(Arc::new(gpu_broker::token_review::TokenReviewer::new(
                client,
                audience,
                cfg.token_review_cache,
            )));
        tracing::info!(audience, cache = ?cfg.token_review_cache, "accepting Kubernetes ServiceAccount tokens (TokenReview)");
    }

    // The operators' socket first: once the main socket answers, both do.
    // A socket of its own: `Config::load` refused one that names another.
    let admin_unix = match &cfg.admin_listen {
        Some(path) => {
            let l = bind_unix(path).await?;
            tracing::info!(socket = %path.display(), on_own_runtime = reads.handle().is_some(), "serving Admin on the operators' socket");
            Some(l)
        }
        None => None,
    };
    let unix = bind_unix(&cfg.socket).await?;
    tracing::info!(socket = %cfg.socket.display(), "serving on the Unix socket");
    // Lease descriptors live in this process: keep other processes of the broker's user
    // from taking them through /proc/<pid>/fd (a non-dumpable process's /proc is root's).
    // SAFETY: plain prctl on this process.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
    }
    let ticket_path = cfg.ticket_socket_path();
    let tickets = gpu_broker::fd::ticket_server::bind(&ticket_path)
        .await
        .with_context(|| format!("binding the ticket socket {}", ticket_path.display()))?;
    arb.tickets().set_ttl(cfg.ticket_ttl);
    arb.tickets().set_socket(&ticket_path);
    tracing::info!(socket = %ticket_path.display(), "serving lease tickets");
    let tickets_stop = CancellationToken::new();
    let ticket_serving = tokio::spawn(gpu_broker::fd::ticket_server::serve(
        tickets,
        arb.clone(),
        tickets_stop.clone(),
    ));
    clock.step("tenants and sockets");
    let tcp = match cfg.listen {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {addr}"))?;
            tracing::info!(addr = %l.local_addr()?, "serving on TCP");
            Some(l)
        }
        None => None,
    };
    if let Some(addr) = cfg.metrics_listen {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding metrics {addr}"))?;
        let access = gpu_broker::status_http::HttpAccess {
            require_token: cfg.metrics_require_token,
        };
        if !addr.ip().is_loopback() && !access.require_token {
            tracing::warn!(%addr, "the metrics listener is reachable from other hosts without a token (--metrics-require-token)");
        }
        tracing::info!(addr = %l.local_addr()?, require_token = access.require_token, "metrics at /metrics");
        gpu_broker::server::spawn_metrics(
            &arb,
            reads.handle(),
            l.into_std()?,
            shutdown.clone(),
            access,
            cfg.limits.limits(),
        );
    }
    clock.step("listeners");
    let mut nvml_faults: Option<Box<dyn gpu_broker::faults::FaultSource>> = None;
    if arb.devices().any_cuda() {
        let uuids: Vec<String> = (0..arb.devices().len() as u32)
            .map(|d| arb.devices().uuid(d))
            .collect();
        if let Some(why) = gpu_broker::health::mig_refusal(&uuids) {
            anyhow::bail!("{why}");
        }
        if let Some(f) = gpu_broker::faults::NvmlFaults::open(uuids) {
            for line in f.describe() {
                tracing::info!("NVML: {line}");
            }
            nvml_faults = Some(Box::new(f));
        }
    }
    gpu_broker::health::spawn_monitor(&arb, cfg.health(), nvml_faults, shutdown.clone());
    if let Some(monitor) = process_monitor {
        arb.tasks()
            .spawn_process_watch(monitor, cfg.own_alloc_allowance, shutdown.clone());
    }
    gpu_broker::server::spawn_signal_wait(
        &arb,
        shutdown.clone(),
        gpu_broker::server::stop_signal(),
    );
    clock.step("monitors");
    arb.restart().steps_to_serving(clock.steps());
    // systemd (Type=notify): every socket is bound, so every connection from here on is
    // answered. Without NOTIFY_SOCKET this does nothing.
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
        tracing::warn!(error = %e, "cannot tell systemd the broker is ready");
    }
    serve(
        arb,
        Listeners {
            unix: Some(unix),
            tcp,
            tcp_tls,
            limits: cfg.limits.limits(),
            reads: reads.layer(),
            admin_unix,
            admin_only_on_admin_unix: cfg.admin_listen_only,
        },
        shutdown,
        cfg.shutdown_grace,
    )
    .await?;
    tickets_stop.cancel();
    // Its accept loop has ended before the socket file goes.
    let _ = tokio::time::timeout(std::time::Duration::from_secs(3), ticket_serving).await;
    if let Some(mps) = &mps {
        // After every session ended: no reserved process is left to need the daemon.
        mps.shutdown().await;
    }
    let _ = std::fs::remove_file(&cfg.socket);
    if let Some(path) = &cfg.admin_listen {
        let _ = std::fs::remove_file(path);
    }
    let _ = std::fs::remove_file(&ticket_path);
    Ok(())
}

/// Where the previous broker's records and descriptors are, read back as far as can be
/// before the devices open.
enum Kept {
    /// The keeper's dump, read on a thread of its own.
    Keeper(
        std::thread::JoinHandle<
            anyhow::Result<gpu_broker::keeper::place::Dumped<gpu_broker::keeper::KeeperLink>>,
        >,
    ),
    FdStore(gpu_broker::keeper::FdStore),
    Nothing,
}

/// Picks where kept things wait ([`gpu_broker::keeper::choose`]) and starts reading them
/// back: a keeper's dump starts on a thread of its own now.
fn read_kept(
    cfg: &Config,
    handed_back: Vec<(String, std::os::fd::OwnedFd)>,
) -> anyhow::Result<Kept> {
    use gpu_broker::keeper::{choose, fdstore, place, Choice, FdStore, SystemdEnv};
    let systemd = SystemdEnv::from_env();
    Ok(
        match choose(
            cfg.keep_in,
            cfg.keeper.as_deref(),
            &systemd,
            !handed_back.is_empty(),
        )? {
            Choice::Keeper(path) => {
                fdstore::let_go(handed_back);
                let dump = std::thread::Builder::new()
                    .name("keeper-dump".into())
                    .spawn(move || {
                        let link = connect_keeper(&path)?;
                        place::dump(link).with_context(|| {
                            format!("taking back what the keeper at {} holds", path.display())
                        })
                    })
                    .context("starting the keeper's reader")?;
                Kept::Keeper(dump)
            }
            Choice::FdStore => Kept::FdStore(
                FdStore::open(handed_back, systemd.fdstore_max)
                    .context("opening systemd's file-descriptor store")?,
            ),
            Choice::Nothing => {
                fdstore::let_go(handed_back);
                Kept::Nothing
            }
        },
    )
}

/// Connects to the keeper at `path`, waiting up to 10 s for it to listen (a keeper
/// started alongside the broker, a sidecar container). On the keeper's reader thread,
/// off the runtime.
#[allow(
    clippy::disallowed_methods,
    reason = "the keeper's reader thread waits for the keeper to listen, before anything serves"
)]
fn connect_keeper(path: &std::path::Path) -> anyhow::Result<gpu_broker::keeper::KeeperLink> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match gpu_broker::keeper::KeeperLink::connect(path) {
            Ok(l) => return Ok(l),
            Err(e) if std::time::Instant::now() > deadline => {
                return Err(e).context("no keeper (start `gpu-broker keeper --socket PATH` first)")
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
        }
    }
}

/// The CUDA device indices the broker will own (for NVML, before the devices open).
fn device_indices(cfg: &Config) -> Vec<u32> {
    match &cfg.devices {
        Some(d) => d.0.clone(),
        None => match nvml_wrapper::Nvml::init().and_then(|n| n.device_count()) {
            Ok(n) => (0..n).collect(),
            Err(_) => (0..cfg.host_devices).collect(),
        },
    }
}

/// With `--mps` on a device in the ExclusiveProcess compute mode, the broker's own CUDA
/// context must be a client of its MPS daemon (the server holds the one context the
/// device admits): point this process at the daemon's pipe directory before any thread
/// or CUDA call exists. The daemon itself starts in `start_mps`, before the devices open.
fn join_own_mps(cfg: &Config) {
    use gpu_broker::mps::compute_mode;
    if !cfg.mps.mps || !compute_mode::broker_must_join(&compute_mode::read(&device_indices(cfg))) {
        return;
    }
    let control = cfg.mps.control(&cfg.socket, &cfg.state_dir, None);
    // Before the runtime starts: this process has one thread, so nothing reads the
    // environment concurrently.
    #[allow(clippy::disallowed_methods)]
    std::env::set_var("CUDA_MPS_PIPE_DIRECTORY", &control.pipe_dir);
}

/// Starts the managed MPS daemon (`--mps`), reading the devices' compute mode first; in
/// the ExclusiveProcess mode the broker itself becomes a client of its daemon.
async fn start_mps(cfg: &Config) -> Arc<gpu_broker::mps::Mps> {
    use gpu_broker::mps::{compute_mode, Mps};
    let indices = device_indices(cfg);
    let modes = compute_mode::read(&indices);
    let control = cfg.mps.control(
        &cfg.socket,
        &cfg.state_dir,
        cfg.devices.as_ref().map(|d| d.0.as_slice()),
    );
    let pipe = control.pipe_dir.clone();
    let mps = Mps::start(
        control,
        cfg.mps.timings(),
        indices.len() as u32,
        modes.clone(),
    )
    .await;
    mps.set_context_overhead(cfg.mps.mps_context_overhead);
    let status = mps.status();
    tracing::info!(
        pipe = %pipe.display(),
        context_overhead = cfg.mps.mps_context_overhead,
        compute_modes = ?modes,
        status = %status.summary(),
        "managed MPS"
    );
    if compute_mode::broker_must_join(&modes) {
        tracing::info!(
            "ExclusiveProcess compute mode: the broker's own CUDA context goes through its MPS daemon"
        );
    } else if modes.iter().any(|m| m == compute_mode::DEFAULT) {
        tracing::warn!(
            "compute mode Default: a program that drops the MPS variables runs outside MPS and its limits; ExclusiveProcess (set by the operator) prevents that (docs/mps.md)"
        );
    }
    mps
}

/// Without `--config`, SIGHUP is logged as having nothing to reload (never the default
/// action, which would end the broker). Registered before returning; the worker `sighup`,
/// joined at shutdown.
fn spawn_hup_without_config(arb: &Arbiter, stop: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("SIGHUP handler not installed");
        return;
    };
    arb.lifecycle()
        .spawn_worker("sighup", stop.clone(), async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    r = hup.recv() => {
                        if r.is_none() {
                            return;
                        }
                        tracing::info!("SIGHUP: nothing to reload (no --config file)");
                    }
                }
            }
        });
}
