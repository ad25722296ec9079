//! `gpu-broker check-config FILE`: validates a config file the way the broker would read it
//! (every setting, and the `[tenants.NAME]` and `[tokens.NAME]` tables with file, line and
//! reason) and prints what applying it would change in the running broker (found through
//! the file's own `socket` and admin token settings unless `--broker`/`--token-file` say
//! otherwise).
//! Exit status: 0 valid, 2 invalid.

use clap::Parser;
use gpu_broker::config::Config;
use gpu_broker::ledger::Quota;
use gpu_broker::tenants_config::{describe_change, diff, load};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "gpu-broker check-config",
    about = "Validate a config file and show what it would change in the running broker"
)]
struct Args {
    /// The config file.
    file: PathBuf,
    /// The running broker (default: the file's `socket`).
    #[arg(long)]
    broker: Option<String>,
    /// Its admin token file (default: the file's `admin-token-file` or `<state-dir>/admin.token`).
    #[arg(long)]
    token_file: Option<PathBuf>,
}

/// Runs the subcommand; returns the exit status.
pub fn run(args: impl Iterator<Item = OsString>) -> i32 {
    let args = match Args::try_parse_from(args) {
        Ok(a) => a,
        Err(e) => e.exit(),
    };
    let cfg = match Config::from_args(vec![
        "gpu-broker".into(),
        "--config".into(),
        args.file.clone().into(),
    ]) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let declared = match load(&args.file) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let tokens = match gpu_broker::tokens_config::load(
        &args.file,
        &gpu_broker::tenants_config::names(&declared),
    ) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    println!(
        "{}: valid ({} tenants declared)",
        args.file.display(),
        declared.len()
    );
    for t in &tokens {
        let whose = t
            .tenant
            .as_deref()
            .map(|t| format!(" of {t}"))
            .unwrap_or_default();
        println!(
            "  token {} ({}{whose}): id {}",
            t.name,
            t.scope,
            gpu_broker::auth::token_id(&t.hash)
        );
    }
    let broker = args
        .broker
        .unwrap_or_else(|| format!("unix://{}", cfg.socket.display()));
    let token_file = args.token_file.unwrap_or_else(|| cfg.admin_token_path());
    let running = match running_tenants(&broker, &token_file) {
        Ok(r) => r,
        Err(e) => {
            println!("cannot ask the running broker at {broker} ({e:#}); against an empty broker:");
            BTreeMap::new()
        }
    };
    println!("changes against {broker}:");
    for c in diff(&declared, &running) {
        println!("  {}", describe_change(&c));
    }
    let undeclared: Vec<&String> = running
        .keys()
        .filter(|n| !declared.iter().any(|d| &d.name == *n))
        .collect();
    if !undeclared.is_empty() {
        println!(
            "  not declared (kept as they are): {}",
            undeclared
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    0
}

fn running_tenants(
    broker: &str,
    token_file: &std::path::Path,
) -> anyhow::Result<BTreeMap<String, Quota>> {
    use anyhow::Context;
    let token = std::fs::read_to_string(token_file)
        .with_context(|| format!("reading {}", token_file.display()))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let admin = gpu_broker_client::AdminClient::connect(broker, token.trim()).await?;
        let tenants = admin.list_tenants().await?;
        Ok(tenants
            .into_iter()
            .map(|t| {
                // Client type -> wire -> broker type: no field copy of our own.
                let wire = gpu_broker_client::proto::v1::Quota::from(t.quota);
                (t.name, gpu_broker::service::convert::quota_from_wire(wire))
            })
            .collect())
    })
}
