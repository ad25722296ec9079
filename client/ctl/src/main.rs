//! `gpu-brokerctl`: the operator CLI of gpu-broker. Talks to the broker's admin service
//! with the admin token (from `--token`, `GPU_BROKER_ADMIN_TOKEN`, or the token file) to
//! manage tenants, quotas and tokens and to inspect leases, sessions and devices. Sizes
//! go in as `8GiB`, `512MiB`, `1.5GB` or plain bytes and come out in binary units;
//! `--json` prints machine-readable output instead of tables. Failures print one line,
//! `error: CODE: message`, and exit non-zero. This file owns the start: which token, the
//! connection, and each command's admin call and output.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches};
use serde::Serialize;

use gpu_broker_client::{AdminClient, AuditFilter, QuotaPatch, TokenOptions};

// The command line and the tables of the one-call-one-table commands; then the parts
// beyond them: writing secrets to files and the operator views built from several admin
// calls, one module each.
mod cli;
mod tables;

mod address;
mod drain;
mod leaks;
mod run;
mod secret_file;
mod shared;
mod status;
mod top;

use cli::*;
use tables::*;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
