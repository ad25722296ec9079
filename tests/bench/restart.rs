//! `restart`: a broker restart with many live leases kept by a keeper. Starts a keeper
//! (`gpu-broker keeper`) and a host-backend broker on it, has one worker session (this
//! process, so the restarted broker finds its process alive) hold `leases` leases, then
//! SIGKILLs the broker and starts it again `repeat` times. Each time: from the new
//! process's start to its first answered call (`GetInfo`), the broker's own report of
//! what it took back and where its start went (`RestartInfo.phases`), and how long the
//! session took to be resumed. Only a started broker (it is killed).

use anyhow::{bail, Context, Result};
use clap::Args;
use futures::StreamExt;
use gpu_broker_client::units::parse_bytes;
use gpu_broker_client::{AdminClient, Backoff, Client, Lease, QuotaSpec, SessionEvent};
use serde_json::json;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::report::{bytes, count, json_line, note, Table};
use crate::Common;

#[derive(Debug, Clone, Args)]
pub struct RestartArgs {
    /// Live leases the worker holds through each restart.
    #[arg(long, default_value_t = 10_000)]
    pub leases: u32,
    /// Size of each lease.
    #[arg(long, value_parser = parse_bytes, default_value = "2MiB")]
    pub size: u64,
    /// Acquires in flight at once (before the restarts).
    #[arg(long, default_value_t = 32)]
    pub concurrency: u32,
    /// Restarts (each a SIGKILL and a start).
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
    /// Capacity of the started (host) broker.
    #[arg(long, default_value = "32TiB")]
    pub host_capacity: String,
}

/// A keeper process, killed when dropped (its memory goes with it).
struct Keeper {
    child: Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Keeper {
    fn start(bin: &std::path::Path) -> Result<Keeper> {
        let dir = tempfile::Builder::new()
            .prefix("gpb-bench-keeper-")
            .tempdir()?;
        let socket = dir.path().join("keeper.sock");
        let child = Command::new(bin)
            .arg("keeper")
            .arg("--socket")
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {} keeper", bin.display()))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            if Instant::now() > deadline {
                bail!("the keeper did not listen within 10 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(Keeper {
            child,
            socket,
            _dir: dir,
        })
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One restart's numbers.
struct Measured {
    to_serving: Duration,
    took_ms: u64,
    adopted: u32,
    phases: Vec<(String, u64)>,
    resumed: Duration,
}

pub async fn run(common: &Common, a: &RestartArgs) -> Result<()> {
    if common.broker.is_some() {
        bail!("restart kills its broker: it starts its own (drop --broker)");
    }
    if a.leases == 0 || a.leases > 1_000_000 || a.repeat == 0 || a.repeat > 20 {
        bail!("leases must be 1..=1,000,000 and repeat 1..=20");
    }
    if a.concurrency == 0 || a.concurrency > 1024 {
        bail!("concurrency must be 1..=1024");
    }
    let bin = common
        .broker_bin
        .clone()
        .unwrap_or_else(|| gpu_broker_tests::bin_dir().join("gpu-broker"));
    let keeper = Keeper::start(&bin)?;
    let extra = vec!["--keeper".to_string(), keeper.socket.display().to_string()];
    let mut target = common.target_with(&a.host_capacity, None, extra)?;
    let gran = 2 << 20;
    let need = a.size.div_ceil(gran) * gran * u64::from(a.leases);
    let (_, token) = target.tenant("restart", QuotaSpec::new(need)).await?;
    let client = Client::connect(&target.uri, token).await?;
    let session = client
        .session_builder("bench-restart")
        .reconnect(Backoff::new(
            Duration::from_millis(5),
            Duration::from_millis(50),
        ))
        .await?;
    let mut events = session.events();
    let t = Instant::now();
    let mut tasks = Vec::new();
    for j in 0..a.concurrency {
        let s = session.clone();
        let (n, c, size) = (a.leases, a.concurrency, a.size);
        tasks.push(tokio::spawn(async move {
            let mut held: Vec<Lease> = Vec::new();
            let mut i = j;
            while i < n {
                held.push(s.lease(size).await?);
                i += c;
            }
            anyhow::Ok(held)
        }));
    }
    let mut held = Vec::with_capacity(a.leases as usize);
    for t in tasks {
        held.extend(t.await??);
    }
    note(format!(
        "restart: {} leases of {} held after {:.1} s",
        count(held.len() as u64),
        bytes(a.size),
        t.elapsed().as_secs_f64()
    ));
    let mut runs = Vec::new();
    for rep in 0..a.repeat {
        let spawned = target.spawned.as_mut().context("a started broker")?;
        let (pid, t0) = spawned.kill_and_start_again()?;
        target.pid = Some(pid);
        let admin = first_answer(&target.uri, &target.admin_token).await?;
        let to_serving = t0.elapsed();
        let info = admin.broker_info().await?;
        let r = info
            .restart
            .context("the restarted broker reports no restart")?;
        let resumed = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(e) = events.next().await {
                if let SessionEvent::Resumed { kept_leases, .. } = e {
                    return Ok(kept_leases.len());
                }
                if let SessionEvent::Reconnected { .. } = e {
                    bail!("the session was not resumed: its leases are lost");
                }
            }
            bail!("the session closed")
        })
        .await
        .context("no resume within 60 s")??;
        let m = Measured {
            to_serving,
            took_ms: r.took_ms,
            adopted: r.leases_adopted,
            phases: r.phases.clone(),
            resumed: t0.elapsed(),
        };
        if resumed != held.len() {
            bail!("resumed with {resumed} of {} leases", held.len());
        }
        json_line(
            common.json,
            &json!({
                "mode": "restart", "run": rep, "leases": a.leases,
                "to_serving_ms": m.to_serving.as_secs_f64() * 1e3,
                "took_ms": m.took_ms, "adopted": m.adopted,
                "resumed_ms": m.resumed.as_secs_f64() * 1e3,
                "phases_us": m.phases.iter().map(|(n, us)| json!({"name": n, "us": us})).collect::<Vec<_>>(),
            }),
        );
        runs.push(m);
    }
    let mut headers = vec!["step".to_string()];
    headers.extend((1..=runs.len()).map(|i| format!("run {i}")));
    let header_refs: Vec<&str> = headers.iter().map(String::as_str).collect();
    let mut table = Table::new(
        format!(
            "restart: SIGKILL + start with {} live leases of {} kept by a keeper (ms)",
            count(u64::from(a.leases)),
            bytes(a.size)
        ),
        &header_refs,
    );
    let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
    table.row(
        std::iter::once("start to first answer".to_string())
            .chain(runs.iter().map(|m| ms(m.to_serving)))
            .collect(),
    );
    table.row(
        std::iter::once("start to session resumed".to_string())
            .chain(runs.iter().map(|m| ms(m.resumed)))
            .collect(),
    );
    table.row(
        std::iter::once("start to leases taken back (broker's took)".to_string())
            .chain(runs.iter().map(|m| m.took_ms.to_string()))
            .collect(),
    );
    table.row(
        std::iter::once("leases taken back".to_string())
            .chain(runs.iter().map(|m| count(u64::from(m.adopted))))
            .collect(),
    );
    for (i, (name, _)) in runs[0].phases.iter().enumerate() {
        table.row(
            std::iter::once(format!("  {name}"))
                .chain(runs.iter().map(|m| {
                    m.phases
                        .get(i)
                        .map(|(_, us)| format!("{:.1}", *us as f64 / 1e3))
                        .unwrap_or_else(|| "-".into())
                }))
                .collect(),
        );
    }
    table.print();
    // The broker first (SIGTERM leaves everything to the keeper), then the keeper: nothing
    // is left behind, and the broker never sees its keeper go.
    drop(target);
    drop(keeper);
    drop(held);
    session.close();
    Ok(())
}

/// The restarted broker's first answer to `GetInfo` (asked every 2 ms).
async fn first_answer(uri: &str, admin_token: &str) -> Result<AdminClient> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(admin) = AdminClient::connect(uri, admin_token.to_string()).await {
            if admin.broker_info().await.is_ok() {
                return Ok(admin);
            }
        }
        if Instant::now() > deadline {
            bail!("the broker did not answer within 60 s of its start");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
