//! `gpu-brokerctl`: the operator CLI of gpu-broker. Talks to the broker's admin service
//! with the admin token (from `--token`, `GPU_BROKER_ADMIN_TOKEN`, or the token file) to
//! manage tenants, quotas and tokens and to inspect leases, sessions and devices. Sizes
//! go in as `8GiB`, `512MiB`, `1.5GB` or plain bytes and come out in binary units;
//! `--json` prints machine-readable output instead of tables. Failures print one line,
//! `error: CODE: message`, and exit non-zero.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};
use serde::Serialize;

use gpu_broker_client::table::Table;
use gpu_broker_client::units::format_duration;
use gpu_broker_client::units::{format_age, format_bytes};
use gpu_broker_client::{
    AdminClient, AuditEntry, AuditFilter, DeviceInfo, DrainStatus, LeaseInfo, QuotaPatch,
    SessionInfo, TenantInfo, TokenInfo, TokenOptions, TokenScope,
};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

// The parts beyond the one-call-one-table commands: writing secrets to files and the
// operator views built from several admin calls, one module each.
mod address;
mod drain;
mod leaks;
mod run;
mod secret_file;
mod shared;
mod status;
mod top;

/// A size flag's parser: [`parse_bytes`](gpu_broker_client::units::parse_bytes), and a note
/// on standard error when the size is decimal (`4GB` is 3.7 GiB, not 4), so that a table
/// showing binary units later holds no surprise.
fn size_arg(text: &str) -> Result<u64, String> {
    let bytes = gpu_broker_client::units::parse_bytes(text)?;
    if let Some(note) = gpu_broker_client::units::decimal_note(text) {
        eprintln!("note: {note}");
    }
    Ok(bytes)
}

/// Width the default tables fit (`--wide` lifts it).
const WIDTH: usize = 100;

#[derive(Debug, Parser)]
#[command(
    name = "gpu-brokerctl",
    version,
    about = "Operate a gpu-broker: tenants, quotas, tokens, leases, sessions, devices"
)]
struct Cli {
    /// Broker address: unix:///path/to/broker.sock, http://host:port or https://host:port.
    /// Default: the operators' socket unix:///run/gpu-broker/admin.sock where the broker
    /// has one (`run`: always the workers' socket), else unix:///run/gpu-broker/broker.sock.
    #[arg(
        long = "broker",
        global = true,
        help_heading = "Global options",
        env = "GPU_BROKER_ADDR"
    )]
    broker_given: Option<String>,

    /// The address used: `--broker`, or the default for the command.
    #[arg(skip)]
    broker: String,

    /// CA (PEM) that signed the broker's certificate, for https:// addresses.
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "GPU_BROKER_CA_FILE"
    )]
    ca_file: Option<PathBuf>,

    /// Client certificate (PEM) for brokers that require one (mutual TLS).
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "GPU_BROKER_CLIENT_CERT",
        requires = "client_key"
    )]
    client_cert: Option<PathBuf>,

    /// Private key (PEM) of --client-cert.
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "GPU_BROKER_CLIENT_KEY",
        requires = "client_cert"
    )]
    client_key: Option<PathBuf>,

    /// File holding the admin token.
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "GPU_BROKER_ADMIN_TOKEN_FILE",
        default_value = "/var/lib/gpu-broker/admin.token"
    )]
    token_file: PathBuf,

    /// The admin token itself (instead of --token-file).
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "GPU_BROKER_ADMIN_TOKEN",
        hide_env_values = true
    )]
    token: Option<String>,

    /// Print JSON instead of tables.
    #[arg(long, global = true, help_heading = "Global options")]
    json: bool,

    /// Print every column; by default tables fit 100 columns (long names are cut with …).
    #[arg(long, global = true, help_heading = "Global options")]
    wide: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
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
enum TenantsCommand {
    /// Every tenant with its quota and live usage.
    List,
    /// Delete a tenant (refused while it holds leases).
    Delete {
        /// Tenant name.
        tenant: String,
    },
}

#[derive(Debug, Subcommand)]
enum QuotaCommand {
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
enum TokensCommand {
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
enum LeasesCommand {
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
enum SessionsCommand {
    /// List open sessions.
    List {
        /// Only this tenant's sessions.
        #[arg(long)]
        tenant: Option<String>,
    },
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    cli.broker = address::resolve(
        cli.broker_given.as_deref(),
        !matches!(cli.command, Command::Run(_)),
        std::path::Path::new(address::OPERATORS_SOCKET),
        address::WORKERS_SOCKET,
    );
    if let Command::Completions { shell } = cli.command {
        // Needs no broker and no token.
        // Into a buffer first: clap_complete panics on a write error (a closed pipe).
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "gpu-brokerctl", &mut script);
        use std::io::Write;
        let _ = std::io::stdout().write_all(&script);
        return ExitCode::SUCCESS;
    }
    if let Command::Run(args) = &cli.command {
        let target = run::Target {
            broker: cli.broker.clone(),
            tls: gpu_broker_client::ConnectOptions {
                ca_file: cli.ca_file.clone(),
                client_cert: cli.client_cert.clone(),
                client_key: cli.client_key.clone(),
            },
            token: tenant_token(&cli, &matches),
        };
        return run::main(target, args.clone());
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            print_err(&format!("error: cannot start the async runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli, &matches)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let text = format!("{e:#}").replace(['\n', '\r'], " ");
            print_err(&format!("error: {text}"));
            ExitCode::FAILURE
        }
    }
}

/// The admin token: `--token`/`GPU_BROKER_ADMIN_TOKEN`, unless `--token-file` was given on
/// the command line while the token only came from the environment.
fn admin_token(cli: &Cli, matches: &ArgMatches) -> Result<String> {
    let file_on_command_line = matches.value_source("token_file") == Some(ValueSource::CommandLine);
    let token_from_env = matches.value_source("token") == Some(ValueSource::EnvVariable);
    match &cli.token {
        Some(token) if !(file_on_command_line && token_from_env) => Ok(token.trim().to_string()),
        _ => read_token_file(&cli.token_file),
    }
}

/// The tenant token `run` uses: `--token-file` given on the command line, else
/// `GPU_BROKER_TOKEN`, else the file `GPU_BROKER_TOKEN_FILE` names, else `--token`.
fn tenant_token(cli: &Cli, matches: &ArgMatches) -> Result<String> {
    let read = |path: &Path| -> Result<String> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the token file {}", path.display()))?;
        let token = text.trim();
        anyhow::ensure!(!token.is_empty(), "token file {} is empty", path.display());
        Ok(token.to_string())
    };
    if matches.value_source("token_file") == Some(ValueSource::CommandLine) {
        return read(&cli.token_file);
    }
    if let Some(t) = std::env::var("GPU_BROKER_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty())
    {
        return Ok(t.trim().to_string());
    }
    if let Some(p) = std::env::var_os("GPU_BROKER_TOKEN_FILE").filter(|p| !p.is_empty()) {
        return read(Path::new(&p));
    }
    if matches.value_source("token") == Some(ValueSource::CommandLine) {
        if let Some(t) = &cli.token {
            return Ok(t.trim().to_string());
        }
    }
    anyhow::bail!(
        "run needs the tenant's token: --token-file FILE, GPU_BROKER_TOKEN or GPU_BROKER_TOKEN_FILE"
    )
}

fn read_token_file(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "cannot read the admin token file {} (use --token-file, --token or GPU_BROKER_ADMIN_TOKEN)",
            path.display()
        )
    })?;
    let token = text.trim();
    anyhow::ensure!(
        !token.is_empty(),
        "admin token file {} is empty",
        path.display()
    );
    Ok(token.to_string())
}

async fn run(cli: Cli, matches: &ArgMatches) -> Result<()> {
    let token = admin_token(&cli, matches)?;
    let tls = gpu_broker_client::ConnectOptions {
        ca_file: cli.ca_file.clone(),
        client_cert: cli.client_cert.clone(),
        client_key: cli.client_key.clone(),
    };
    let admin = AdminClient::connect_with(&cli.broker, token, &tls).await?;
    // An older broker may not know what this CLI asks: say so once, on stderr.
    let info = admin.broker_info().await;
    if let Some(w) = gpu_broker_client::version_warning(&info) {
        print_err(&format!("warning: {w}"));
    }
    let json = cli.json;
    let width = if cli.wide { None } else { Some(WIDTH) };
    match cli.command {
        Command::Tenants {
            command: TenantsCommand::List,
        } => {
            let tenants = admin.list_tenants().await?;
            emit(json, &tenants, || tenant_table(&tenants, width))
        }
        Command::Tenants {
            command: TenantsCommand::Delete { tenant },
        } => {
            admin.delete_tenant(&tenant).await?;
            emit(
                json,
                &serde_json::json!({ "deleted_tenant": tenant }),
                || format!("deleted tenant {tenant}\n"),
            )
        }
        Command::Quota {
            command:
                QuotaCommand::Set {
                    tenant,
                    limit,
                    max_leases,
                    priority,
                    guaranteed,
                    host_limit,
                    turn_weight,
                    device_limits,
                    clear_device_limits,
                },
        } => {
            let patch = QuotaPatch {
                limit_bytes: limit,
                max_leases,
                priority,
                guaranteed_bytes: guaranteed,
                host_limit_bytes: host_limit,
                turn_weight,
                clear_device_limits,
                device_limits,
            };
            anyhow::ensure!(
                !patch.is_empty(),
                "nothing to change: give --limit, --max-leases, --priority, --guaranteed, --host-limit, --turn-weight, --device-limit or --clear-device-limits"
            );
            let change = admin.patch_quota(&tenant, patch).await?;
            for w in &change.warnings {
                print_err(&format!("warning: {w}"));
            }
            let info = change.tenant;
            emit(json, &info, || {
                tenant_table(std::slice::from_ref(&info), width) + &device_lines(&info)
            })
        }
        Command::Quota {
            command: QuotaCommand::Get { tenant },
        } => {
            let info = admin.get_quota(&tenant).await?;
            emit(json, &info, || {
                tenant_table(std::slice::from_ref(&info), width) + &device_lines(&info)
            })
        }
        Command::Tokens {
            command:
                TokensCommand::Issue {
                    tenant,
                    description,
                    output,
                    scope,
                    ttl,
                    name,
                },
        } => {
            let opts = TokenOptions {
                scope,
                ttl,
                name,
                description,
            };
            let issued = admin.issue_token_with(tenant.as_deref(), &opts).await?;
            if let Some(path) = output {
                secret_file::write(&path, &format!("{}\n", issued.token))?;
                print_err(&format!(
                    "issued {} token {} for {}; wrote it to {} (mode 0600)",
                    issued.scope.as_str(),
                    issued.token_id,
                    if issued.tenant.is_empty() {
                        "the node".to_string()
                    } else {
                        format!("tenant {}", issued.tenant)
                    },
                    path.display()
                ));
                let shown = serde_json::json!({
                    "token_id": issued.token_id,
                    "tenant": issued.tenant,
                    "scope": issued.scope,
                    "name": issued.name,
                    "expires_unix_ms": issued.expires_unix_ms,
                    "file": path,
                });
                return emit(json, &shown, String::new);
            }
            if !json {
                print_err(&format!(
                    "issued {} token {} for {}{} (shown only once)",
                    issued.scope.as_str(),
                    issued.token_id,
                    if issued.tenant.is_empty() {
                        "the node".to_string()
                    } else {
                        format!("tenant {}", issued.tenant)
                    },
                    match issued.expires_unix_ms {
                        Some(ms) => format!(", expires {}", format_time(ms)),
                        None => String::new(),
                    }
                ));
            }
            emit(json, &issued, || format!("{}\n", issued.token))
        }
        Command::Tokens {
            command: TokensCommand::RotateAdmin { grace },
        } => {
            let (token, until) = admin.rotate_admin_token(grace).await?;
            if !json {
                print_err(&format!(
                    "rotated the admin token (the broker rewrote its token file); the old one works until {}",
                    format_time(until)
                ));
            }
            let v = serde_json::json!({ "token": token, "old_valid_until_unix_ms": until });
            emit(json, &v, || format!("{token}\n"))
        }
        Command::Tokens {
            command: TokensCommand::Revoke { id_or_token },
        } => {
            admin.revoke_token(&id_or_token).await?;
            emit(json, &serde_json::json!({ "revoked": true }), || {
                "revoked token\n".to_string()
            })
        }
        Command::Tokens {
            command: TokensCommand::List { tenant },
        } => {
            let tokens = admin.list_tokens(tenant.as_deref()).await?;
            emit(json, &tokens, || token_table(&tokens, width))
        }
        Command::Leases {
            command: LeasesCommand::List { tenant },
        } => {
            let leases = admin.list_all_leases(tenant.as_deref()).await?;
            emit(json, &leases, || lease_table(&leases, width))
        }
        Command::Leases {
            command: LeasesCommand::Revoke { lease_id, reason },
        } => {
            let lease = admin.revoke_lease(&lease_id, &reason).await?;
            emit(json, &lease, || {
                format!("revoked lease {}\n", lease.lease_id)
            })
        }
        Command::Sessions {
            command: SessionsCommand::List { tenant },
        } => {
            let sessions = admin.list_sessions(tenant.as_deref()).await?;
            emit(json, &sessions, || session_table(&sessions, width))
        }
        Command::Devices => {
            let devices = admin.get_devices().await?;
            emit(json, &devices, || device_table(&devices, width))
        }
        Command::Status => {
            let snap = status::Snapshot::fetch(&admin, &cli.broker).await?;
            emit(json, &snap, || {
                status::render(&snap, std::time::SystemTime::now())
            })
        }
        Command::Top { interval } => {
            anyhow::ensure!(!json, "top is interactive; use `status --json` for scripts");
            top::run(
                &admin,
                &cli.broker,
                interval.max(Duration::from_millis(200)),
            )
            .await
        }
        Command::Leaks { older_than } => {
            let snap = status::Snapshot::fetch(&admin, &cli.broker).await?;
            let now = std::time::SystemTime::now();
            let leaks = leaks::find(&snap, older_than, now);
            emit(json, &leaks, || leaks::render(&leaks, older_than, now))
        }
        Command::Shared { tenant, page_size } => {
            let shared = admin
                .list_shared_paged(tenant.as_deref(), page_size)
                .await?;
            emit(json, &shared, || shared::render(&shared, width))
        }
        Command::Drain {
            device,
            deadline,
            reason,
            no_wait,
            poll,
        } => {
            let status = drain::run(&admin, device, deadline, &reason, no_wait, poll).await?;
            emit(json, &status, || drain_table(&status))
        }
        Command::MarkUnhealthy { device, reason } => {
            let changed = admin.set_device_health(device, false, &reason).await?;
            emit(
                json,
                &serde_json::json!({ "device": device, "healthy": false, "changed": changed }),
                || {
                    format!(
                        "device {device} marked unhealthy{}\n",
                        if changed { "" } else { " (already was)" }
                    )
                },
            )
        }
        Command::MarkHealthy { device } => {
            let changed = admin.set_device_health(device, true, "").await?;
            emit(
                json,
                &serde_json::json!({ "device": device, "healthy": true, "changed": changed }),
                || {
                    format!(
                        "device {device} marked healthy{}\n",
                        if changed { "" } else { " (already was)" }
                    )
                },
            )
        }
        Command::Undrain { device } => {
            let status = admin.undrain(device).await?;
            emit(json, &status, || drain_table(&status))
        }
        // Dispatched in `main` before the admin connection (it takes a tenant token).
        Command::Run(_) | Command::Completions { .. } => {
            anyhow::bail!("handled before connecting as admin")
        }
        Command::Info => {
            let i = info?;
            let v = serde_json::json!({
                "broker": i,
                "client_version": env!("CARGO_PKG_VERSION"),
                "client_api_revision": gpu_broker_client::REQUIRED_API_REVISION,
            });
            emit(json, &v, || {
                format!(
                    "broker {} (API revision {}, {} backend, {} device(s))\nfeatures: {}\ngpu-brokerctl {} (needs API revision {})\n",
                    i.version,
                    i.api_revision,
                    i.backend,
                    i.device_count,
                    i.features.join(", "),
                    env!("CARGO_PKG_VERSION"),
                    gpu_broker_client::REQUIRED_API_REVISION
                )
            })
        }
        Command::Audit {
            since,
            tenant,
            limit,
        } => {
            let since_unix_ms = match since {
                None => None,
                Some(s) => Some(parse_since(&s, SystemTime::now())?),
            };
            let entries = admin
                .list_audit(&AuditFilter {
                    since_unix_ms,
                    tenant,
                    limit,
                })
                .await?;
            emit(json, &entries, || audit_table(&entries, width))
        }
    }
}

/// Prints `value` as JSON, or the plain text `text()` builds.
fn emit<T: Serialize + ?Sized>(json: bool, value: &T, text: impl FnOnce() -> String) -> Result<()> {
    if json {
        let mut out = serde_json::to_string_pretty(value).context("cannot encode JSON")?;
        out.push('\n');
        print_out(&out)
    } else {
        print_out(&text())
    }
}

/// Writes a line to stderr; a closed stderr is ignored (never a panic).
fn print_err(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Writes `text` to stdout. A reader that went away (`gpu-brokerctl ... | head`) is not an
/// error: the rest of the output has nowhere to go, so it is dropped quietly.
fn print_out(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(e).context("cannot write to stdout")
        }
        _ => Ok(()),
    }
}

fn or_dash(n: u64, text: String) -> String {
    if n == 0 {
        "-".into()
    } else {
        text
    }
}

/// The text, or "-" when empty (a field an older broker does not send).
fn or_dash_str(s: &str) -> String {
    if s.is_empty() {
        "-".to_string()
    } else {
        s.to_string()
    }
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

/// One line per device where the tenant has a cap or holds memory:
/// `device 0: 12.0 MiB held of its 16.0 MiB limit`.
fn device_lines(info: &TenantInfo) -> String {
    let (caps, held) = (
        &info.quota.device_limit_bytes,
        &info.usage.device_committed_bytes,
    );
    let devices: std::collections::BTreeSet<u32> =
        caps.keys().chain(held.keys()).copied().collect();
    let mut out = String::new();
    for d in devices {
        let h = format_bytes(held.get(&d).copied().unwrap_or(0));
        match caps.get(&d) {
            Some(c) => out.push_str(&format!(
                "device {d}: {h} held of its {} limit\n",
                format_bytes(*c)
            )),
            None => out.push_str(&format!("device {d}: {h} held (no per-device limit)\n")),
        }
    }
    out
}

fn tenant_table(tenants: &[TenantInfo], width: Option<usize>) -> String {
    if width.is_some() {
        let mut t = Table::new([
            "TENANT",
            "HELD",
            "LIMIT",
            "GUARANTEED",
            "LEASES",
            "PRIORITY",
            "QUARANTINED",
            "SESSIONS",
            "WAITING",
        ])
        .right(&[1, 2, 3, 4, 5, 6, 7, 8])
        .fit(width, &[0]);
        for i in tenants {
            let (q, u) = (&i.quota, &i.usage);
            t.row([
                i.name.clone(),
                format_bytes(u.held_bytes),
                format_bytes(q.limit_bytes),
                format_bytes(q.guaranteed_bytes),
                u.lease_count.to_string(),
                q.priority.to_string(),
                format_bytes(u.quarantined_bytes),
                u.session_count.to_string(),
                u.waiting_requests.to_string(),
            ]);
        }
        return t.render();
    }
    let mut t = Table::new([
        "TENANT",
        "LIMIT",
        "HELD",
        "LEASES",
        "MAX_LEASES",
        "PRIORITY",
        "GUARANTEED",
        "BORROWED",
        "HOST_LIMIT",
        "HOST_HELD",
        "QUARANTINED",
        "PROC_RESERVED",
        "SESSIONS",
        "WAITING",
        "TOKENS",
        "TURNS",
        "COMPUTE",
        "OVERRUN",
    ])
    .right(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]);
    for i in tenants {
        let (q, u) = (&i.quota, &i.usage);
        t.row([
            i.name.clone(),
            format_bytes(q.limit_bytes),
            format_bytes(u.held_bytes),
            u.lease_count.to_string(),
            or_dash(q.max_leases.into(), q.max_leases.to_string()),
            q.priority.to_string(),
            format_bytes(q.guaranteed_bytes),
            format_bytes(u.borrowed_bytes),
            format_bytes(q.host_limit_bytes),
            format_bytes(u.host_held_bytes),
            format_bytes(u.quarantined_bytes),
            format_bytes(u.process_reserved_bytes),
            u.session_count.to_string(),
            u.waiting_requests.to_string(),
            i.token_count.to_string(),
            u.turns.to_string(),
            format!("{} ms", u.compute_ms),
            format!("{} ms", u.overrun_ms),
        ]);
    }
    t.render()
}

fn token_table(tokens: &[TokenInfo], width: Option<usize>) -> String {
    let now = SystemTime::now();
    let mut t = Table::new([
        "TOKEN_ID",
        "TENANT",
        "NAME",
        "SCOPE",
        "AGE",
        "EXPIRES",
        "LAST_USED",
        "DESCRIPTION",
    ])
    .right(&[4, 5, 6])
    .fit(width, &[1, 2, 7]);
    for k in tokens {
        t.row([
            k.token_id.clone(),
            or_dash_str(&k.tenant),
            or_dash_str(&k.name),
            k.scope.as_str().to_string(),
            format_age(k.created_unix_ms),
            match k.expires_unix_ms {
                None => "never".to_string(),
                Some(ms) => format_until(ms, now),
            },
            match k.last_used_unix_ms {
                None => "-".to_string(),
                Some(ms) => format!("{} ago", format_age(ms)),
            },
            k.description.clone(),
        ]);
    }
    t.render()
}

/// "in 3h02m", or "expired 5m ago".
fn format_until(unix_ms: i64, now: SystemTime) -> String {
    let at = UNIX_EPOCH + Duration::from_millis(unix_ms.max(0).unsigned_abs());
    match at.duration_since(now) {
        Ok(d) => format!("in {}", format_duration(d)),
        Err(e) => format!("expired {} ago", format_duration(e.duration())),
    }
}

/// An instant as RFC 3339 (UTC, seconds).
fn format_time(unix_ms: i64) -> String {
    let at = UNIX_EPOCH + Duration::from_millis(unix_ms.max(0).unsigned_abs());
    humantime::format_rfc3339_seconds(at).to_string()
}

/// `--since`: an RFC 3339 time or an age ("1h": one hour before `now`).
fn parse_since(text: &str, now: SystemTime) -> Result<i64> {
    let at = match humantime::parse_rfc3339_weak(text) {
        Ok(t) => t,
        Err(_) => {
            let age = humantime::parse_duration(text).with_context(|| {
                format!("--since {text:?}: not an RFC 3339 time or an age like 1h")
            })?;
            now.checked_sub(age)
                .with_context(|| format!("--since {text:?} reaches before the epoch"))?
        }
    };
    let ms = at
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    Ok(i64::try_from(ms).unwrap_or(i64::MAX))
}

fn drain_table(status: &DrainStatus) -> String {
    let mut t = Table::new([
        "DEVICE",
        "DRAINING",
        "LEASES",
        "LEFT",
        "ASKED",
        "NOT_RECLAIMABLE",
        "QUARANTINED",
        "DEADLINE",
        "REASON",
    ])
    .right(&[0, 2, 3, 4, 5, 6]);
    for d in &status.devices {
        t.row([
            d.index.to_string(),
            if d.draining { "yes" } else { "no" }.to_string(),
            d.leases.to_string(),
            format_bytes(d.bytes),
            d.reclaim_requested.to_string(),
            d.not_reclaimable.to_string(),
            format_bytes(d.quarantined_bytes),
            d.deadline_unix_ms
                .map(format_time)
                .unwrap_or_else(|| "-".into()),
            or_dash_str(&d.reason),
        ]);
    }
    t.render()
}

fn audit_table(entries: &[AuditEntry], width: Option<usize>) -> String {
    let mut t = Table::new([
        "SEQ", "TIME", "WHO", "PEER", "ACTION", "TENANT", "TARGET", "BEFORE", "AFTER",
    ])
    .right(&[0])
    .fit(width, &[3, 6, 7, 8]);
    for e in entries {
        // The token id (the name and scope are in --json and the broker's log).
        let who = e.token_id.clone();
        let peer = match (e.peer_uid, e.peer_pid) {
            (Some(u), Some(p)) => format!("uid {u} pid {p}"),
            (Some(u), None) => format!("uid {u}"),
            _ => "-".into(),
        };
        t.row([
            e.seq.to_string(),
            format_time(e.unix_ms),
            who,
            peer,
            e.action.clone(),
            or_dash_str(&e.tenant),
            or_dash_str(&e.target),
            or_dash_str(&e.before_json),
            or_dash_str(&e.after_json),
        ]);
    }
    t.render()
}

fn lease_flags(l: &LeaseInfo) -> String {
    let mut flags = Vec::new();
    if l.reclaimable {
        flags.push("reclaimable");
    }
    if l.borrowed {
        flags.push("borrowed");
    }
    if flags.is_empty() {
        "-".to_string()
    } else {
        flags.join(",")
    }
}

fn lease_table(leases: &[LeaseInfo], width: Option<usize>) -> String {
    if width.is_some() {
        let mut t = Table::new(["LEASE", "TENANT", "DEVICE", "SIZE", "STATE", "AGE", "LABEL"])
            .right(&[2, 3, 5])
            .fit(width, &[1, 6]);
        for l in leases {
            t.row([
                l.lease_id.clone(),
                l.tenant.clone(),
                l.device.to_string(),
                format_bytes(l.bytes),
                l.state.as_str().to_string(),
                format_age(l.created_unix_ms),
                l.label.clone(),
            ]);
        }
        return t.render();
    }
    let mut t = Table::new([
        "LEASE",
        "TENANT",
        "SESSION",
        "DEVICE",
        "TIER",
        "SIZE",
        "REQUESTED",
        "STATE",
        "FLAGS",
        "AGE",
        "LABEL",
    ])
    .right(&[3, 5, 6, 9]);
    for l in leases {
        t.row([
            l.lease_id.clone(),
            l.tenant.clone(),
            l.session_id.clone(),
            l.device.to_string(),
            l.tier.as_str().to_string(),
            format_bytes(l.bytes),
            format_bytes(l.requested_bytes),
            l.state.as_str().to_string(),
            lease_flags(l),
            format_age(l.created_unix_ms),
            l.label.clone(),
        ]);
    }
    t.render()
}

fn session_table(sessions: &[SessionInfo], width: Option<usize>) -> String {
    if width.is_some() {
        let mut t = Table::new(["SESSION", "TENANT", "NAME", "PID", "LEASES", "HELD", "AGE"])
            .right(&[3, 4, 5, 6])
            .fit(width, &[1, 2]);
        for s in sessions {
            t.row([
                s.session_id.clone(),
                s.tenant.clone(),
                s.name.clone(),
                or_dash(s.peer_pid.into(), s.peer_pid.to_string()),
                s.lease_count.to_string(),
                format_bytes(s.held_bytes),
                format_age(s.opened_unix_ms),
            ]);
        }
        return t.render();
    }
    let mut t = Table::new([
        "SESSION",
        "TENANT",
        "NAME",
        "PID",
        "UID",
        "TRANSPORT",
        "LEASES",
        "HELD",
        "GPU_USED",
        "OWN_ALLOC",
        "PROC_RESERVED",
        "AGE",
    ])
    .right(&[3, 4, 6, 7, 8, 9, 10, 11]);
    for s in sessions {
        t.row([
            s.session_id.clone(),
            s.tenant.clone(),
            s.name.clone(),
            or_dash(s.peer_pid.into(), s.peer_pid.to_string()),
            if s.transport == "unix" {
                s.peer_uid.to_string()
            } else {
                "-".to_string()
            },
            s.transport.clone(),
            s.lease_count.to_string(),
            format_bytes(s.held_bytes),
            or_dash(s.gpu_used_bytes, format_bytes(s.gpu_used_bytes)),
            if s.over_allowance {
                format!("{} (!)", format_bytes(s.own_alloc_bytes))
            } else {
                or_dash(s.gpu_used_bytes, format_bytes(s.own_alloc_bytes))
            },
            or_dash(
                s.process_reserved_bytes,
                format_bytes(s.process_reserved_bytes),
            ),
            format_age(s.opened_unix_ms),
        ]);
    }
    t.render()
}

/// "open", "draining", "unhealthy" or "draining,unhealthy".
fn device_state(d: &DeviceInfo) -> String {
    match (d.draining, d.unhealthy) {
        (false, false) => "open".into(),
        (true, false) => "draining".into(),
        (false, true) => "unhealthy".into(),
        (true, true) => "draining,unhealthy".into(),
    }
}

fn device_table(devices: &[DeviceInfo], width: Option<usize>) -> String {
    if width.is_some() {
        let mut t = Table::new([
            "DEVICE",
            "NAME",
            "TOTAL",
            "LEASABLE",
            "LEASED",
            "CACHED",
            "QUARANTINED",
            "EXTERNAL",
            "WAITING",
            "STATE",
        ])
        .right(&[0, 2, 3, 4, 5, 6, 7, 8])
        .fit(width, &[1]);
        for d in devices {
            t.row([
                d.index.to_string(),
                d.name.clone(),
                format_bytes(d.total_bytes),
                format_bytes(d.leasable_bytes),
                format_bytes(d.leased_bytes),
                format_bytes(d.cached_bytes),
                format_bytes(d.quarantined_bytes),
                format_bytes(d.external_used_bytes),
                d.waiting_requests.to_string(),
                device_state(d),
            ]);
        }
        return t.render();
    }
    let mut t = Table::new([
        "DEVICE",
        "NAME",
        "BACKEND",
        "TOTAL",
        "FREE",
        "LEASABLE",
        "LEASED",
        "CACHED",
        "QUARANTINED",
        "HEADROOM",
        "EXTERNAL",
        "PROC_RESERVED",
        "GRANULARITY",
        "LEASES",
        "WAITING",
        "TURN",
        "MODEL",
        "UUID",
        "STATE",
    ])
    .right(&[0, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]);
    for d in devices {
        t.row([
            d.index.to_string(),
            d.name.clone(),
            d.backend.clone(),
            format_bytes(d.total_bytes),
            format_bytes(d.free_bytes),
            format_bytes(d.leasable_bytes),
            format_bytes(d.leased_bytes),
            format_bytes(d.cached_bytes),
            format_bytes(d.quarantined_bytes),
            format_bytes(d.headroom_bytes),
            format_bytes(d.external_used_bytes),
            format_bytes(d.process_reserved_bytes),
            format_bytes(d.granularity_bytes),
            d.lease_count.to_string(),
            d.waiting_requests.to_string(),
            if d.turn_holder.is_empty() {
                "-".to_string()
            } else {
                format!("{} (+{} waiting)", d.turn_holder, d.turns_waiting)
            },
            or_dash_str(&d.model),
            or_dash_str(&d.uuid),
            device_state(d),
        ]);
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn token_file_is_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("admin.token");
        std::fs::write(&path, "s3cret\n").unwrap();
        assert_eq!(read_token_file(&path).unwrap(), "s3cret");
        std::fs::write(&path, "\n").unwrap();
        assert!(read_token_file(&path).is_err());
        let err = read_token_file(&dir.path().join("missing")).unwrap_err();
        assert!(format!("{err:#}").contains("missing"));
    }

    #[test]
    fn tables_render() {
        let tenants = vec![TenantInfo {
            name: "a".into(),
            quota: gpu_broker_client::QuotaSpec::new(8 << 30),
            ..Default::default()
        }];
        let text = tenant_table(&tenants, None);
        let mut lines = text.lines();
        assert!(lines.next().unwrap().starts_with("TENANT    LIMIT"));
        assert!(lines.next().unwrap().starts_with("a       8.0 GiB"));
    }

    #[test]
    fn default_tables_fit_100_columns() {
        let long = "a-tenant-with-a-rather-long-name-for-a-team".to_string();
        let tenants = vec![TenantInfo {
            name: long.clone(),
            quota: gpu_broker_client::QuotaSpec::new(1023 << 30),
            ..Default::default()
        }];
        let lease = LeaseInfo::from(gpu_broker_client::proto::v1::Lease {
            lease_id: uuid::Uuid::nil().to_string(),
            tenant: long.clone(),
            label: "kv-cache-for-the-biggest-model-we-have".into(),
            bytes: 1000 << 30,
            state: 2,
            ..Default::default()
        });
        let session = SessionInfo {
            session_id: uuid::Uuid::nil().to_string(),
            tenant: long.clone(),
            name: "trainer-with-a-long-name-too".into(),
            peer_pid: 4_000_000,
            held_bytes: 1000 << 30,
            lease_count: 1000,
            ..Default::default()
        };
        let device = DeviceInfo {
            name: "NVIDIA H200 NVL with a long model name".into(),
            total_bytes: 1000 << 30,
            leasable_bytes: 1000 << 30,
            ..Default::default()
        };
        let token = TokenInfo {
            token_id: "0123456789abcdef".into(),
            tenant: long.clone(),
            description: "a description that goes on and on and on and on and on and on and on"
                .into(),
            created_unix_ms: 1,
            ..Default::default()
        };
        let w = Some(WIDTH);
        for text in [
            tenant_table(&tenants, w),
            lease_table(std::slice::from_ref(&lease), w),
            session_table(std::slice::from_ref(&session), w),
            device_table(std::slice::from_ref(&device), w),
            token_table(std::slice::from_ref(&token), w),
        ] {
            for line in text.lines() {
                assert!(
                    line.chars().count() <= 100,
                    "{} wide:\n{text}",
                    line.chars().count()
                );
            }
        }
        assert!(lease_table(std::slice::from_ref(&lease), w).contains(&lease.lease_id));
        assert!(lease_table(std::slice::from_ref(&lease), None).contains(&lease.label));
    }
}
