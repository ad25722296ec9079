//! `gpu-broker-dra`: the DRA driver beside a node's broker. `run` serves the kubelet
//! plugin (with the devices' health) and publishes the node's ResourceSlice; `slice --print` prints the slice it
//! would publish.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use gpu_broker_dra::broker::Broker;
use gpu_broker_dra::cdi::CdiLayout;
use gpu_broker_dra::checkpoint::CheckpointFile;
use gpu_broker_dra::driver::{Driver, DriverConfig, TenantMap};
use gpu_broker_dra::health::{watch_devices, HealthService};
use gpu_broker_dra::plugin::{serve, Sockets};
use gpu_broker_dra::publisher::Publisher;
use gpu_broker_dra::DRIVER_NAME;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "gpu-broker-dra",
    version,
    about = "Kubernetes DRA driver for gpu-broker"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the kubelet plugin (registration and DRA) and publish the node's ResourceSlice.
    Run(Box<RunArgs>),
    /// The node's ResourceSlice as the driver would publish it.
    Slice(SliceArgs),
}

#[derive(Args)]
struct Common {
    /// The node's name (the slice's nodeName and pool).
    #[arg(long, env = "NODE_NAME")]
    node: String,
    /// The broker's socket (or an operators' listener's address: unix:// or http://).
    #[arg(
        long,
        env = "GPU_BROKER_ADDR",
        default_value = "/run/gpu-broker/broker.sock"
    )]
    broker: String,
    /// A file holding an admin token of the broker.
    #[arg(long, env = "GPU_BROKER_ADMIN_TOKEN_FILE")]
    admin_token_file: PathBuf,
    /// The API server's URL, without credentials (e.g. `kubectl proxy`'s); absent: the
    /// in-cluster service account or the kubeconfig.
    #[arg(long, env = "GPU_BROKER_DRA_APISERVER")]
    apiserver: Option<String>,
}

#[derive(Args)]
struct SliceArgs {
    #[command(flatten)]
    common: Common,
    /// Print it as JSON (for `kubectl apply -f -`).
    #[arg(long)]
    print: bool,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    common: Common,
    /// The kubelet's plugin registry.
    #[arg(long, default_value = "/var/lib/kubelet/plugins_registry")]
    registry_dir: PathBuf,
    /// The kubelet's plugins directory (the DRA socket goes in `<dir>/gpu-broker.io/`).
    #[arg(long, default_value = "/var/lib/kubelet/plugins")]
    plugins_dir: PathBuf,
    /// Where CDI specs go.
    #[arg(long, default_value = "/var/run/cdi")]
    cdi_dir: PathBuf,
    /// The driver's own state: the checkpoint and the claims' token directories.
    #[arg(long, default_value = "/var/lib/gpu-broker-dra")]
    state_dir: PathBuf,
    /// The host directory of the workers' broker socket (and its ticket socket), mounted
    /// into claims' containers at /run/gpu-broker.
    #[arg(long, default_value = "/run/gpu-broker")]
    broker_socket_dir: PathBuf,
    /// The workers' socket's file name in that directory.
    #[arg(long, default_value = "broker.sock")]
    broker_socket_name: String,
    /// The group that may read claims' token files (mode 0440, directory 0750): a
    /// non-root worker lists it in its pod's `supplementalGroups`, as for the broker's
    /// sockets. Without it, the driver's own group.
    #[arg(long, value_name = "GID")]
    claim_group: Option<u32>,
    /// Charge NAMESPACE's claims to TENANT (repeatable); unmapped namespaces are their
    /// own tenants.
    #[arg(long = "tenant", value_name = "NAMESPACE=TENANT")]
    tenants: Vec<String>,
    /// A CDI kind for the GPU itself, returned beside the claim's device as
    /// `<kind>=<GPU uuid>` (NVIDIA's container toolkit: nvidia.com/gpu); "" for none.
    #[arg(long, default_value = "nvidia.com/gpu")]
    gpu_cdi_kind: String,
    /// How often the broker's devices are read: the slice brought in line with them, and
    /// their health sent to the kubelet.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    slice_interval: Duration,
    /// How often prepared claims whose ResourceClaim is gone are cleaned up, and claims
    /// the broker no longer holds reserved again.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    cleanup_interval: Duration,
    /// Do not publish the ResourceSlice (another process does).
    #[arg(long)]
    no_publish: bool,
}

impl Common {
    fn broker(&self) -> Result<Broker> {
        let token = std::fs::read_to_string(&self.admin_token_file)
            .with_context(|| format!("reading {}", self.admin_token_file.display()))?;
        Ok(Broker::connect(&self.broker, &token)?)
    }

    async fn kube(&self) -> Result<kube::Client> {
        let config = match &self.apiserver {
            Some(url) => kube::Config::new(url.parse().context("--apiserver")?),
            None => kube::Config::infer()
                .await
                .context("finding the API server")?,
        };
        Ok(kube::Client::try_from(config)?)
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("GPU_BROKER_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Slice(a) => slice(a).await,
        Command::Run(a) => run(*a).await,
    }
}

async fn slice(a: SliceArgs) -> Result<()> {
    if !a.print {
        bail!("nothing to do: give --print");
    }
    let broker = a.common.broker()?;
    let inv = broker
        .inventory()
        .await
        .context("asking the broker for its devices")?;
    let s = gpu_broker_dra::slice::build(DRIVER_NAME, &a.common.node, 1, &inv);
    let mut v = serde_json::to_value(&s)?;
    v["apiVersion"] = "resource.k8s.io/v1".into();
    v["kind"] = "ResourceSlice".into();
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

fn tenant_map(pairs: &[String]) -> Result<TenantMap> {
    let mut m = TenantMap::default();
    for p in pairs {
        let Some((ns, t)) = p.split_once('=') else {
            bail!("--tenant {p:?}: NAMESPACE=TENANT");
        };
        m.0.insert(ns.to_string(), t.to_string());
    }
    Ok(m)
}

async fn run(a: RunArgs) -> Result<()> {
    let broker = a.common.broker()?;
    let kube = a.common.kube().await?;
    let layout = CdiLayout {
        spec_dir: a.cdi_dir.clone(),
        claims_dir: a.state_dir.join("claims"),
        broker_socket_dir: a.broker_socket_dir.clone(),
        broker_socket_name: a.broker_socket_name.clone(),
        claim_group: a.claim_group,
    };
    let cfg = DriverConfig {
        driver_name: DRIVER_NAME.to_string(),
        tenants: tenant_map(&a.tenants)?,
        gpu_cdi_kind: Some(a.gpu_cdi_kind.clone()).filter(|k| !k.is_empty()),
    };
    let file = CheckpointFile::new(a.state_dir.join("checkpoint.json"));
    let driver = Arc::new(Driver::open(cfg, broker.clone(), kube.clone(), layout, file).await?);
    let stop = CancellationToken::new();
    let sockets = Sockets {
        registry_dir: a.registry_dir.clone(),
        plugins_dir: a.plugins_dir.clone(),
    };
    let (health_tx, health_rx) = tokio::sync::watch::channel(None);
    let health = HealthService::new(&a.common.node, health_rx, a.slice_interval, stop.clone());
    let (_registered, served) = serve(driver.clone(), health, DRIVER_NAME, &sockets, stop.clone())?;
    tracing::info!(registration = %sockets.registration(DRIVER_NAME).display(), dra = %sockets.dra(DRIVER_NAME).display(), "serving the kubelet plugin");
    let mut tasks = vec![served];
    tasks.push(tokio::spawn(watch_devices(
        broker.clone(),
        health_tx,
        a.slice_interval,
        stop.clone(),
    )));
    if !a.no_publish {
        let p = Publisher::new(kube.clone(), broker.clone(), DRIVER_NAME, &a.common.node);
        tasks.push(tokio::spawn(p.run(a.slice_interval, stop.clone())));
    }
    let cleaner = {
        let stop = stop.clone();
        let every = a.cleanup_interval;
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                driver.clean_stale().await;
                driver.reserve_lost().await;
            }
        })
    };
    tasks.push(cleaner);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("stopping");
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    Ok(())
}
