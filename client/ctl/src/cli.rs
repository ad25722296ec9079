//! The command line of `gpu-brokerctl`: its flags and subcommands as clap parses them, and
//! the parsers of sizes and per-device limits they take.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use gpu_broker_client::TokenScope;

use crate::run;

/// A size flag's parser: [`parse_bytes`](gpu_broker_client::units::parse_bytes), and a note
/// on standard error when the size is decimal (`4GB` is 3.7 GiB, not 4), so that a table
/// showing binary units later holds no surprise.
pub(crate) fn size_arg(text: &str) -> Result<u64, String> {
    let bytes = gpu_broker_client::units::parse_bytes(text)?;
    if let Some(note) = gpu_broker_client::units::decimal_note(text) {
        eprintln!("note: {note}");
    }
    Ok(bytes)
}

#[derive(Debug, Parser)]
#[command(
    name = "gpu-brokerctl",
    version,
    about = "Operate a gpu-broker: tenants, quotas, tokens, leases, sessions, devices"
)]
pub(crate) struct Cli {
    /// Broker address: unix:///path/to/broker.sock, http://host:port or https://host:port.
    /// Default: the operators' socket unix:///run/gpu-broker/admin.sock where the broker
    /// has one (`run`: always the workers' socket), else unix:///run/gpu-broker/broker.sock.
    #[arg(
        long = "broker",
        global = true,
        help_heading = "Global options",
        env = "GPU_BROKER_ADDR"
    )]
    pub(crate) broker_given: Option<String>,

    /// The address used: `--broker`, or the default for the command.
    #[arg(skip)]
    pub(crate) broker: String,

    /// CA (PEM) that signed the broker's certificate, for https:// addresses.
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "GPU_BROKER_CA_FILE"
    )]
    pub(crate) ca_file: Option<PathBuf>,

    /// Client certificate (PEM) for brokers that require one (mutual TLS).
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "GPU_BROKER_CLIENT_CERT",
        requires = "client_key"
    )]
    pub(crate) client_cert: Option<PathBuf>,

    /// Private key (PEM) of --client-cert.
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "GPU_BROKER_CLIENT_KEY",
        requires = "client_cert"
    )]
    pub(crate) client_key: Option<PathBuf>,

    /// File holding the admin token.
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "GPU_BROKER_ADMIN_TOKEN_FILE",
        default_value = "/var/lib/gpu-broker/admin.token"
    )]
    pub(crate) token_file: PathBuf,

    /// The admin token itself (instead of --token-file).
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "GPU_BROKER_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub(crate) token: Option<String>,

    /// Print JSON instead of tables.
    #[arg(long, global = true, help_heading = "Global options")]
    pub(crate) json: bool,

    /// Print every column; by default tables fit 100 columns (long names are cut with …).
    #[arg(long, global = true, help_heading = "Global options")]
    pub(crate) wide: bool,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run a program under a process reservation of a tenant: reserve --memory on a
    /// device, start COMMAND with the broker's environment (token file, CUDA_VISIBLE_DEVICES,
    /// MPS variables), end the reservation when it exits. Takes the TENANT token
    /// (--token-file, GPU_BROKER_TOKEN or GPU_BROKER_TOKEN_FILE), not the admin token.
    Run(run::RunArgs),
    /// List or delete tenants.
    Tenants {
        #[command(subcommand)]
        command: TenantsCommand,
    },
    /// Set or show a tenant's quota.
    Quota {
        #[command(subcommand)]
        command: QuotaCommand,
    },
    /// Issue, revoke or list bearer tokens.
    Tokens {
        #[command(subcommand)]
        command: TokensCommand,
    },
    /// List or revoke leases.
    Leases {
        #[command(subcommand)]
        command: LeasesCommand,
    },
    /// List sessions.
    Sessions {
        #[command(subcommand)]
        command: SessionsCommand,
    },
    /// Show the devices the broker manages.
    Devices,
    /// One screen, like nvidia-smi: devices with usage bars (leased, cached, quarantined,
    /// outside the broker, headroom), tenants against limit and guarantee, the largest and
    /// oldest leases, waiting requests.
    Status,
    /// The status screen, refreshed live (q to quit).
    Top {
        /// Time between refreshes.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
        interval: Duration,
    },
    /// What looks leaked: leases held past a threshold, quarantined memory and the process
    /// holding it, processes whose own GPU memory (NVML) exceeds the allowance.
    Leaks {
        /// Leases older than this are listed.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "24h")]
        older_than: Duration,
    },
    /// Shared read-only leases: publisher, name, size, readers, whether read-only is
    /// enforced, and their importers (process, session, lingering or live).
    Shared {
        /// Only this publishing tenant's.
        #[arg(long)]
        tenant: Option<String>,
        /// Fetch them in pages of this many (0: the broker's default).
        #[arg(long, default_value_t = 0)]
        page_size: u32,
    },
    /// Empty a device (or the node) for maintenance: no new leases there, holders of
    /// reclaimable leases are asked to release; waits until nothing is left (or the deadline).
    Drain {
        /// Only this device (default: every device).
        #[arg(long)]
        device: Option<u32>,
        /// Holders must release within this (e.g. 10m); a reclaimable lease still held then
        /// is revoked. The command fails if memory is left after it.
        #[arg(long, value_parser = humantime::parse_duration)]
        deadline: Option<Duration>,
        /// Why (sent to holders, shown in `devices`, recorded in the audit log).
        #[arg(long, default_value = "maintenance")]
        reason: String,
        /// Start the drain and return at once.
        #[arg(long)]
        no_wait: bool,
        /// How often to check progress.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "500ms")]
        poll: Duration,
    },
    /// Mark a device unhealthy: no new leases there, holders are told; stays until
    /// `mark-healthy`.
    MarkUnhealthy {
        /// Device index.
        device: u32,
        /// Why (shown in `devices`, sent to holders, recorded in the audit log).
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Clear a device's unhealthy mark (the operator's or the health monitor's).
    MarkHealthy {
        /// Device index.
        device: u32,
    },
    /// Reopen a drained device (or every device).
    Undrain {
        /// Only this device (default: every device).
        #[arg(long)]
        device: Option<u32>,
    },
    /// Show the broker's version, API revision and features (and this CLI's).
    Info,
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell), e.g.
    /// `gpu-brokerctl completions bash > /usr/share/bash-completion/completions/gpu-brokerctl`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// List recorded operator changes (quota, tenant, token, revoke, drain, reload).
    Audit {
        /// Only changes since this: an RFC 3339 time (2026-12-01T08:00:00Z) or an age (1h, 30m).
        #[arg(long)]
        since: Option<String>,
        /// Only changes concerning this tenant.
        #[arg(long)]
        tenant: Option<String>,
        /// The newest this many.
        #[arg(long, default_value_t = 1000)]
        limit: u32,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum TenantsCommand {
    /// Every tenant with its quota and live usage.
    List,
    /// Delete a tenant (refused while it holds leases).
    Delete {
        /// Tenant name.
        tenant: String,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum QuotaCommand {
    /// Create a tenant or change its quota: only the options given change, the others
    /// keep their values (a new tenant starts from 0 and needs --limit). Warns when the
    /// tenant already holds more than a new limit (its leases stay; it gets no more).
    Set {
        /// Tenant name.
        tenant: String,
        /// Most device memory the tenant may hold (e.g. 8GiB); required for a new tenant.
        #[arg(long, value_parser = size_arg)]
        limit: Option<u64>,
        /// Most live leases (0: no limit).
        #[arg(long)]
        max_leases: Option<u32>,
        /// Queue priority; higher goes first and may reclaim from lower.
        #[arg(long, allow_negative_numbers = true)]
        priority: Option<i32>,
        /// Device memory kept available for the tenant (<= --limit).
        #[arg(long, value_parser = size_arg)]
        guaranteed: Option<u64>,
        /// Most host-fallback memory (0: no host fallback).
        #[arg(long, value_parser = size_arg)]
        host_limit: Option<u64>,
        /// Share of compute turns relative to other tenants (0 counts as 1).
        #[arg(long)]
        turn_weight: Option<u32>,
        /// Cap on one device, on top of --limit: DEVICE=SIZE (e.g. 0=16GiB; 0=0 keeps the
        /// tenant off device 0), or DEVICE=none to remove it. Repeat for several devices.
        #[arg(long = "device-limit", value_name = "DEVICE=SIZE", value_parser = parse_device_limit)]
        device_limits: Vec<(u32, Option<u64>)>,
        /// Remove every per-device cap first (with --device-limit: those become the whole set).
        #[arg(long)]
        clear_device_limits: bool,
    },
    /// Show a tenant's quota and usage.
    Get {
        /// Tenant name.
        tenant: String,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum TokensCommand {
    /// Issue a token; prints the token alone (shown only once). Worker tokens need a
    /// tenant; read tokens without one are node-wide; admin tokens have none.
    Issue {
        /// Tenant name.
        tenant: Option<String>,
        /// Note shown in `tokens list`.
        #[arg(long, default_value = "")]
        description: String,
        /// Write the token to this file (created mode 0600, replaced atomically) instead
        /// of printing it.
        #[arg(long, short = 'o', value_name = "FILE")]
        output: Option<PathBuf>,
        /// What the token may do: worker (a tenant's workers), read (usage, metrics and
        /// status only) or admin (the admin service).
        #[arg(long, default_value = "worker")]
        scope: TokenScope,
        /// Time to live (e.g. 30d, 12h); past it the token is refused as expired.
        #[arg(long, value_parser = humantime::parse_duration)]
        ttl: Option<Duration>,
        /// Name shown in `tokens list` and the audit log.
        #[arg(long, default_value = "")]
        name: String,
    },
    /// Replace the admin token file's token (the broker writes the file); the old token
    /// keeps working for --grace so running clients can switch. Prints the new token.
    RotateAdmin {
        /// How long the old admin token keeps working.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
        grace: Duration,
    },
    /// Revoke a token by id or by the token itself.
    Revoke {
        /// Token id or token.
        id_or_token: String,
    },
    /// List live tokens (never the secrets).
    List {
        /// Only this tenant's tokens.
        #[arg(long)]
        tenant: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum LeasesCommand {
    /// List leases.
    List {
        /// Only this tenant's leases.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Take a lease away (its memory is quarantined until the holder lets go).
    Revoke {
        /// Lease id.
        lease_id: String,
        /// Reason sent to the holder.
        #[arg(long, default_value = "revoked by operator")]
        reason: String,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum SessionsCommand {
    /// List open sessions.
    List {
        /// Only this tenant's sessions.
        #[arg(long)]
        tenant: Option<String>,
    },
}

/// `--device-limit DEVICE=SIZE` or `DEVICE=none`.
fn parse_device_limit(text: &str) -> Result<(u32, Option<u64>), String> {
    let (device, size) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?}: expected DEVICE=SIZE (e.g. 0=16GiB) or DEVICE=none"))?;
    let device: u32 = device
        .trim()
        .parse()
        .map_err(|_| format!("{device:?} is not a device index (0, 1, ...)"))?;
    match size.trim() {
        "none" => Ok((device, None)),
        s => size_arg(s).map(|b| (device, Some(b))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("gpu-brokerctl").chain(args.iter().copied()))
    }

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_quota_set_with_units() {
        let cli = parse(&[
            "--broker",
            "unix:///tmp/b.sock",
            "quota",
            "set",
            "team-a",
            "--limit",
            "8GiB",
            "--max-leases",
            "4",
            "--priority",
            "-3",
            "--guaranteed",
            "2GiB",
            "--host-limit",
            "1.5GB",
        ])
        .unwrap();
        assert_eq!(cli.broker_given.as_deref(), Some("unix:///tmp/b.sock"));
        match cli.command {
            Command::Quota {
                command:
                    QuotaCommand::Set {
                        tenant,
                        limit,
                        max_leases,
                        priority,
                        guaranteed,
                        host_limit,
                        ..
                    },
            } => {
                assert_eq!(tenant, "team-a");
                assert_eq!(limit, Some(8 << 30));
                assert_eq!(max_leases, Some(4));
                assert_eq!(priority, Some(-3));
                assert_eq!(guaranteed, Some(2 << 30));
                assert_eq!(host_limit, Some(1_500_000_000));
            }
            other => panic!("parsed {other:?}"),
        }
    }

    #[test]
    fn refuses_bad_sizes_and_patches_only_what_is_given() {
        assert!(parse(&["quota", "set", "a", "--limit", "lots"]).is_err());
        match parse(&["quota", "set", "a", "--priority", "5"])
            .unwrap()
            .command
        {
            Command::Quota {
                command:
                    QuotaCommand::Set {
                        limit,
                        priority,
                        guaranteed,
                        ..
                    },
            } => assert_eq!((limit, priority, guaranteed), (None, Some(5), None)),
            other => panic!("parsed {other:?}"),
        }
    }

    #[test]
    fn global_flags_after_subcommand() {
        let cli = parse(&["leases", "list", "--tenant", "b", "--json"]).unwrap();
        assert!(cli.json);
        assert!(matches!(
            cli.command,
            Command::Leases { command: LeasesCommand::List { tenant: Some(ref t) } } if t == "b"
        ));
    }
}
