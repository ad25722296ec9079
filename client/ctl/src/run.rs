//! `gpu-brokerctl run`: runs an unmodified program under a process reservation. It opens
//! a session with the tenant's token, reserves `--memory` on a device (waiting up to
//! `--wait`, under the tenant's quota like a lease request), and starts the program with
//! the environment a worker needs: `GPU_BROKER_ADDR`, `GPU_BROKER_TOKEN_FILE` (a 0600 file
//! in a 0700 directory of the caller's), `GPU_BROKER_SESSION`, `GPU_BROKER_RESERVATION`,
//! `GPU_BROKER_DEVICE`, `CUDA_VISIBLE_DEVICES` (the device's UUID) and, when the broker
//! runs managed MPS, the `CUDA_MPS_*` variables of the reply. The program leads a new
//! process group, which `run` names to the broker (`SetProcessGroup`); `run` forwards
//! signals to the group, exits with the program's status, and ends the session (freeing
//! everything) when the program exits. When the reservation ends — the program exited,
//! the broker ended the session, or `run` itself died — the broker stops what is left of
//! the group (SIGTERM, SIGKILL after its `--process-stop-grace`); if `run` dies, the
//! program itself also gets SIGKILL at once (`PR_SET_PDEATHSIG`). The session reconnects:
//! a broker restarted with a keeper resumes it with the reservation and the program runs
//! on; a broker that comes back without the session, or not within `--resume-wait`, has the
//! program stopped by `run`, and one that comes back with the session but not the
//! reservation stops the program's group itself. A descendant that leaves
//! the group (`setsid`, `setpgid`) escapes this (docs/mps.md). On a terminal the group is
//! made the foreground group while it runs (like a shell's job), so the program reads the
//! terminal and gets its Ctrl-C itself; when Ctrl-Z stops the program, `run` gives the
//! terminal back and stops too, and when it is continued (`fg`) it continues the program.
//!
//! Exit codes of `run`'s own failures (as `timeout(1)` and `env(1)` use them): 125 the
//! broker refused or could not be reached, 126 the program cannot be executed, 127 it was
//! not found.

use std::ffi::OsString;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use gpu_broker_client::{Client, ConnectOptions, ReservationRequest, SessionEvent};
use tokio::signal::unix::{signal, SignalKind};

/// `run`'s own failure: the broker refused, or it could not be reached.
pub const EXIT_REFUSED: u8 = 125;
/// The program exists but cannot be executed.
pub const EXIT_CANNOT_EXECUTE: u8 = 126;
/// The program was not found.
pub const EXIT_NOT_FOUND: u8 = 127;

/// How long the program has to exit after SIGTERM when its session is lost, before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// The `run` subcommand's arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Broker device index to reserve on (default: where it fits best).
    #[arg(long)]
    pub device: Option<u32>,
    /// Device memory to reserve for the program (e.g. 4GiB); the program's own
    /// allocations and the leases it takes on that device must fit in it.
    #[arg(long, value_parser = crate::cli::size_arg)]
    pub memory: u64,
    /// Share of the device's SMs for the program under managed MPS (1-100; default: from
    /// the tenant's turn weight).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub compute: Option<u32>,
    /// How long to wait for the reservation (e.g. 30s; default: do not wait).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
    pub wait: Duration,
    /// How long the program runs on while a broker that keeps sessions (a keeper, the
    /// systemd fd store) is away, waiting for it to come back with the reservation; then
    /// the program is stopped.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
    pub resume_wait: Duration,
    /// Session name shown to operators (default: "run:" and the program's name).
    #[arg(long)]
    pub name: Option<String>,
    /// For a Python program: make `gpubroker.torch.install()` happen before its first
    /// CUDA allocation (a `sitecustomize` put first on PYTHONPATH), if the gpubroker
    /// package is installed.
    #[arg(long)]
    pub torch: bool,
    /// The program and its arguments (after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "COMMAND"
    )]
    pub command: Vec<OsString>,
}

/// Where `run` connects, and with which token.
pub struct Target {
    pub broker: String,
    pub tls: ConnectOptions,
    /// The tenant token, or why there is none.
    pub token: Result<String>,
}

/// How the program ended.
enum Outcome {
    Exited(u8),
    Signalled(i32),
}

/// Runs `args` under a reservation; never returns before the program ended.
pub fn main(target: Target, args: RunArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return fail(
                EXIT_REFUSED,
                &format!("cannot start the async runtime: {e}"),
            )
        }
    };
    // The program is spawned from this (the main) thread: PR_SET_PDEATHSIG fires when
    // the thread that forked it ends, and the main thread ends only with the process.
    let outcome = runtime.block_on(supervise(target, args));
    drop(runtime);
    match outcome {
        Ok(Outcome::Exited(code)) => ExitCode::from(code),
        Ok(Outcome::Signalled(sig)) => {
            // Die of the same signal, so a shell sees what the program died of.
            // SAFETY: plain libc calls on this process.
            unsafe {
                libc::signal(sig, libc::SIG_DFL);
                libc::raise(sig);
            }
            ExitCode::from(128u8.saturating_add(sig as u8))
        }
        Err(e) => {
            let code = e
                .downcast_ref::<SpawnError>()
                .map(|s| s.code)
                .unwrap_or(EXIT_REFUSED);
            fail(code, &format!("{e:#}"))
        }
    }
}

fn fail(code: u8, text: &str) -> ExitCode {
    let text = text.replace(['\n', '\r'], " ");
    let _ = writeln!(std::io::stderr(), "error: {text}");
    ExitCode::from(code)
}

/// How soon a queued reservation is first reported, and how often after that.
const FIRST_REPORT: Duration = Duration::from_millis(500);
const REPORT_EVERY: Duration = Duration::from_secs(5);

/// Awaits the reservation; while it is queued, says on standard error what it waits for
/// and what blocks it, soon after the request and then every few seconds: a `run` that
/// waits minutes in silence looks hung.
async fn waiting_aloud<F: std::future::Future>(
    client: &Client,
    request: F,
    args: &RunArgs,
) -> F::Output {
    if args.wait.is_zero() {
        return request.await;
    }
    tokio::pin!(request);
    let start = tokio::time::Instant::now();
    let mut next = start + FIRST_REPORT;
    loop {
        tokio::select! {
            done = &mut request => return done,
            _ = tokio::time::sleep_until(next) => {
                let usage = tokio::time::timeout(Duration::from_secs(1), client.usage()).await;
                let usage = usage.ok().and_then(Result::ok);
                eprintln!("{}", waiting_line(args, start.elapsed(), usage.as_ref()));
                next += REPORT_EVERY;
            }
        }
    }
}

/// `gpu-brokerctl run: waiting 5s of 5m for 4.0 GiB on any device; blocked by ...`.
fn waiting_line(
    args: &RunArgs,
    waited: Duration,
    usage: Option<&gpu_broker_client::Usage>,
) -> String {
    use gpu_broker_client::units::{format_bytes, format_duration};
    let device = args
        .device
        .map_or("any device".to_string(), |d| format!("device {d}"));
    let mut line = format!(
        "gpu-brokerctl run: waiting {} of {} for {} on {device}",
        match waited.as_secs() {
            0 => "0s".to_string(),
            secs => format_duration(Duration::from_secs(secs)),
        },
        format_duration(args.wait),
        format_bytes(args.memory),
    );
    let Some(u) = usage else {
        return line + " (the broker did not say how its queue stands)";
    };
    let held = u.usage.held_bytes + u.usage.process_reserved_bytes;
    let limit = u.quota.limit_bytes;
    let blocker = if held.saturating_add(args.memory) > limit {
        format!(
            "blocked by tenant {:?}'s quota: it holds {} of {}",
            u.tenant,
            format_bytes(held),
            format_bytes(limit)
        )
    } else {
        "blocked by the device: other tenants hold its memory".to_string()
    };
    let position = match u.usage.queue_position {
        0 => String::new(),
        1 => "; next in the node's queue".to_string(),
        n => format!("; {} request(s) ahead in the node's queue", n - 1),
    };
    line += &format!(
        "{position}; {blocker}; {} request(s) of the tenant queued",
        u.usage.waiting_requests
    );
    line
}

/// Under managed MPS, what the program's reservation means, said before it starts:
/// `gpu-brokerctl run: 4.0 GiB for the program under managed MPS: its pinned limit is
/// 4.8 GiB (768.0 MiB of it for its CUDA context and libraries); the tenant is charged
/// 4.8 GiB`. `None` without MPS.
fn mps_line(memory: u64, info: &gpu_broker_client::ReservationInfo) -> Option<String> {
    use gpu_broker_client::units::format_bytes;
    let env = info.mps_env.as_ref()?;
    let (_, limit) = env
        .iter()
        .find(|(k, _)| k == "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")?;
    // `<ordinal>=<MiB>M`, as the broker writes it.
    let mib: u64 = limit.split_once('=')?.1.strip_suffix('M')?.parse().ok()?;
    let pinned = mib << 20;
    Some(format!(
        "gpu-brokerctl run: {} for the program under managed MPS: its pinned limit is {} ({} of it for its CUDA context and libraries); the tenant is charged {}",
        format_bytes(memory),
        format_bytes(pinned),
        format_bytes(pinned.saturating_sub(memory)),
        format_bytes(info.bytes),
    ))
}

/// The program could not be started.
#[derive(Debug, thiserror::Error)]
#[error("cannot run {program}: {source}")]
struct SpawnError {
    program: String,
    code: u8,
    source: std::io::Error,
}

async fn supervise(target: Target, args: RunArgs) -> Result<Outcome> {
    let token = target.token?;
    let client = Client::connect_with(&target.broker, token.clone(), &target.tls)
        .await
        .with_context(|| format!("cannot reach the broker at {}", target.broker))?;
    let program = args.command[0].to_string_lossy().into_owned();
    let name = args.name.clone().unwrap_or_else(|| {
        let base = Path::new(&program)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| program.clone());
        format!("run:{base}")
    });
    // Reconnecting, so that a broker restarted with a keeper gives the session and its
    // reservation back (`Resumed`) and the program runs on; a broker that cannot keep it
    // loses the reservation, and the program is stopped as before.
    let session = client
        .session_builder(&name)
        .reconnect(gpu_broker_client::Backoff::new(
            Duration::from_millis(50),
            Duration::from_secs(2),
        ))
        .give_up_after(args.resume_wait)
        .open()
        .await?;
    let mut request = ReservationRequest::new(&session, args.memory)
        .wait(args.wait)
        .label(name.clone());
    if let Some(d) = args.device {
        request = request.device(d);
    }
    if let Some(c) = args.compute {
        request = request.compute_percent(c);
    }
    let reservation = waiting_aloud(&client, request.send(), &args).await?;
    let info = reservation.info().clone();
    if let Some(line) = mps_line(args.memory, &info) {
        eprintln!("{line}");
    }

    // The token goes to the program in a file only its user can read, removed when `run`
    // ends (`secrets` is dropped last).
    let secrets = private_dir()?;
    let token_path = secrets.path().join("token");
    write_private(&token_path, token.as_bytes())?;

    let mut cmd = std::process::Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .env("GPU_BROKER_ADDR", &target.broker)
        .env("GPU_BROKER_TOKEN_FILE", &token_path)
        .env("GPU_BROKER_SESSION", session.id())
        .env("GPU_BROKER_RESERVATION", &info.reservation_id)
        .env("GPU_BROKER_DEVICE", info.device.to_string())
        .env("CUDA_VISIBLE_DEVICES", &info.device_uuid)
        // The program gets the tenant's token file only: never an admin token.
        .env_remove("GPU_BROKER_TOKEN")
        .env_remove("GPU_BROKER_ADMIN_TOKEN")
        .env_remove("GPU_BROKER_ADMIN_TOKEN_FILE");
    for (k, v) in info.mps_env.iter().flatten() {
        cmd.env(k, v);
    }
    if args.torch {
        let dir = secrets.path().join("python");
        std::fs::create_dir(&dir).context("cannot create the sitecustomize directory")?;
        write_private(&dir.join("sitecustomize.py"), SITECUSTOMIZE.as_bytes())?;
        let mut path = OsString::from(&dir);
        if let Some(old) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
            path.push(":");
            path.push(old);
        }
        cmd.env("PYTHONPATH", path);
    }
    let parent = std::process::id();
    // The program leads its own process group (set before the closure below runs).
    cmd.process_group(0);
    let foreground = on_foreground_terminal();
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // `run` died before the line above took effect: do not run unaccounted.
            if libc::getppid() as u32 != parent {
                libc::_exit(EXIT_REFUSED as i32);
            }
            if foreground {
                // Take the terminal before the program can read it (as a shell's child
                // does); `run` does the same after the fork, whichever comes first.
                give_terminal(libc::getpid());
            }
            Ok(())
        });
    }

    // Signal handlers first, so a signal that arrives as the program starts is forwarded.
    let mut sigs = Vec::new();
    for kind in [
        SignalKind::terminate(),
        SignalKind::hangup(),
        SignalKind::interrupt(),
        SignalKind::quit(),
        SignalKind::user_defined1(),
        SignalKind::user_defined2(),
    ] {
        sigs.push((kind.as_raw_value(), signal(kind)?));
    }
    // The program's stops (Ctrl-Z), seen through SIGCHLD.
    let mut child_changed = signal(SignalKind::child())?;
    let mut child = tokio::process::Command::from(cmd)
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| SpawnError {
            code: if source.kind() == std::io::ErrorKind::NotFound {
                EXIT_NOT_FOUND
            } else {
                EXIT_CANNOT_EXECUTE
            },
            program: program.clone(),
            source,
        })?;
    let pid = child.id().unwrap_or(0) as libc::pid_t;
    if foreground {
        // SAFETY: plain libc calls on fd 0 and our child's group.
        unsafe { give_terminal(pid) };
    }
    // The broker stops what is left of the group when the reservation ends.
    if let Err(e) = reservation.set_process_group(pid as u32).await {
        let _ = writeln!(
            std::io::stderr(),
            "gpu-brokerctl run: the broker will not stop {program}'s descendants if run dies ({e})"
        );
    }

    let mut events = session.events();
    let mut session_lost = false;
    let mut kill_at: Option<tokio::time::Instant> = None;
    // While the broker is away: when `run` stops waiting for it (its own bound, whatever
    // the reconnect attempts take).
    let mut resume_by: Option<tokio::time::Instant> = None;
    let status = loop {
        let forwarded = futures::future::select_all(
            sigs.iter_mut()
                .map(|(raw, s)| Box::pin(async move { s.recv().await.map(|_| *raw) })),
        );
        let kill_deadline = async {
            match kill_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => futures::future::pending().await,
            }
        };
        let resume_deadline = async {
            match resume_by {
                Some(t) => tokio::time::sleep_until(t).await,
                None => futures::future::pending().await,
            }
        };
        tokio::select! {
            status = child.wait() => break status?,
            _ = child_changed.recv(), if foreground => {
                if stopped(pid) {
                    // Job control: the terminal's Ctrl-Z stopped the program's group. Stop
                    // `run` too, so the shell gets its terminal back; when `run` is
                    // continued, so is the program, in the foreground again.
                    // SAFETY: plain libc calls on this process and our child's group.
                    unsafe {
                        give_terminal(libc::getpgrp());
                        libc::raise(libc::SIGSTOP);
                        give_terminal(pid);
                        libc::kill(-pid, libc::SIGCONT);
                    }
                }
            }
            (sig, _, _) = forwarded => {
                let Some(sig) = sig else { continue };
                // A terminal's Ctrl-C reaches the program's group itself (it is the
                // foreground group), not `run`: what `run` gets came from elsewhere.
                // SAFETY: plain syscall on our own child's process group.
                unsafe { libc::kill(-pid, sig) };
            }
            ev = events.next(), if !session_lost => {
                let lost = match &ev {
                    // A session the broker keeps across its restart: wait for it.
                    Some(SessionEvent::Disconnected { .. }) if session.resumable() => {
                        let _ = writeln!(
                            std::io::stderr(),
                            "gpu-brokerctl run: the broker went away; {program} runs on while its reservation is kept (up to {}s for the broker to come back)",
                            args.resume_wait.as_secs_f64()
                        );
                        resume_by.get_or_insert(tokio::time::Instant::now() + args.resume_wait);
                        None
                    }
                    // The broker stops the program's group itself if the restart did not
                    // take the reservation back with the session.
                    Some(SessionEvent::Resumed { .. }) => {
                        let _ = writeln!(
                            std::io::stderr(),
                            "gpu-brokerctl run: the broker is back with the session"
                        );
                        resume_by = None;
                        None
                    }
                    // The reconnects gave up while `run` waited for the broker.
                    Some(SessionEvent::Closed { .. }) if resume_by.is_some() => {
                        Some("the broker did not come back in time")
                    }
                    None
                    | Some(
                        SessionEvent::Disconnected { .. }
                        | SessionEvent::Reconnected { .. }
                        | SessionEvent::Closed { .. },
                    ) => Some("the broker ended the session"),
                    Some(_) => None,
                };
                if let Some(why) = lost {
                    stop_lost(pid, &program, why, &mut session_lost, &mut kill_at);
                }
            }
            _ = resume_deadline, if !session_lost => {
                resume_by = None;
                stop_lost(pid, &program, "the broker did not come back in time", &mut session_lost, &mut kill_at);
            }
            _ = kill_deadline => {
                // SAFETY: plain syscall on our own child's process group.
                unsafe { libc::kill(-pid, libc::SIGKILL) };
                kill_at = None;
            }
        }
    };
    if foreground {
        // The terminal back to `run`'s group (the shell's job).
        // SAFETY: plain libc calls on fd 0 and this process.
        unsafe { give_terminal(libc::getpgrp()) };
    }
    // Free the reservation at once (a round trip), then end the session; the broker
    // stops what the program left running in its group.
    let _ = reservation.release().await;
    session.close();
    drop(secrets);
    Ok(match (status.code(), status.signal()) {
        (Some(code), _) => Outcome::Exited(code.clamp(0, 255) as u8),
        (None, Some(sig)) => Outcome::Signalled(sig),
        (None, None) => Outcome::Exited(EXIT_REFUSED),
    })
}

/// The reservation is gone with the session (`why`): the program must not run on
/// unaccounted, so its group gets SIGTERM now and SIGKILL after [`STOP_GRACE`].
fn stop_lost(
    pid: libc::pid_t,
    program: &str,
    why: &str,
    session_lost: &mut bool,
    kill_at: &mut Option<tokio::time::Instant>,
) {
    *session_lost = true;
    let _ = writeln!(
        std::io::stderr(),
        "gpu-brokerctl run: {why}; stopping {program} (SIGTERM, SIGKILL after {}s)",
        STOP_GRACE.as_secs()
    );
    // SAFETY: plain syscall on our own child's process group.
    unsafe { libc::kill(-pid, libc::SIGTERM) };
    *kill_at = Some(tokio::time::Instant::now() + STOP_GRACE);
}

/// Makes `pgrp` the foreground process group of the terminal on fd 0, ignoring the
/// SIGTTOU that a background caller would get meanwhile. Async-signal-safe.
///
/// # Safety
/// Plain libc calls; safe to call between fork and exec.
unsafe fn give_terminal(pgrp: libc::pid_t) {
    let old = libc::signal(libc::SIGTTOU, libc::SIG_IGN);
    libc::tcsetpgrp(0, pgrp);
    libc::signal(libc::SIGTTOU, old);
}

/// Whether `pid` (our child) has stopped since last asked; consumes that stop report only
/// (an exit stays for `wait`).
fn stopped(pid: libc::pid_t) -> bool {
    // SAFETY: waitid on our own child into a zeroed siginfo.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WSTOPPED | libc::WNOHANG,
        ) == 0
            && info.si_pid() == pid
            && info.si_code == libc::CLD_STOPPED
    }
}

/// Is `run` in the foreground process group of its controlling terminal?
fn on_foreground_terminal() -> bool {
    // SAFETY: plain libc queries on fd 0 and this process.
    unsafe { libc::isatty(0) == 1 && libc::tcgetpgrp(0) == libc::getpgrp() }
}

/// A fresh 0700 directory of the caller's for the program's token (the per-user runtime
/// directory when there is one, else the temporary directory).
fn private_dir() -> Result<tempfile::TempDir> {
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_dir())
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::Builder::new()
        .prefix("gpu-broker-run-")
        .tempdir_in(&base)
        .with_context(|| format!("cannot create a private directory in {}", base.display()))?;
    // Before anything is written into it.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("cannot make {} private", dir.path().display()))?;
    Ok(dir)
}

/// Writes `bytes` to a new file only the caller can read.
fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Put first on PYTHONPATH by `--torch`: Python imports it at start-up, before the program.
const SITECUSTOMIZE: &str = r#"# Written by `gpu-brokerctl run --torch`: routes this program's CUDA memory
# through gpu-broker leases, drawn from the run's process reservation.
def _gpu_broker_install():
    import sys
    try:
        import gpubroker.torch
    except ImportError as e:
        sys.stderr.write(
            "gpu-brokerctl run --torch: gpubroker is not importable (%s); "
            "CUDA memory is not routed through leases\n" % (e,)
        )
        return
    try:
        gpubroker.torch.install()
    except Exception as e:  # the program runs on, within its reservation
        sys.stderr.write(
            "gpu-brokerctl run --torch: gpubroker.torch.install() failed (%s); "
            "CUDA memory is not routed through leases\n" % (e,)
        )


_gpu_broker_install()
del _gpu_broker_install
"#;

#[cfg(test)]
mod tests {
    use super::*;

    fn info(env: Option<Vec<(String, String)>>) -> gpu_broker_client::ReservationInfo {
        gpu_broker_client::ReservationInfo {
            reservation_id: "r".into(),
            session_id: "s".into(),
            tenant: "t".into(),
            device: 0,
            device_uuid: "GPU-x".into(),
            bytes: (4 << 30) + (768 << 20),
            requested_bytes: (4 << 30) + (768 << 20),
            drawn_bytes: 0,
            pid: 1,
            mps_env: env,
        }
    }

    #[test]
    fn under_mps_the_line_states_the_pinned_limit_the_context_share_and_the_charge() {
        let env = vec![(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_string(),
            "0=4864M".to_string(),
        )];
        let line = mps_line(4 << 30, &info(Some(env))).unwrap();
        assert!(line.contains("4.0 GiB for the program"), "{line}");
        assert!(line.contains("pinned limit is 4.8 GiB"), "{line}");
        assert!(
            line.contains("768.0 MiB of it for its CUDA context"),
            "{line}"
        );
        assert!(line.contains("charged 4.8 GiB"), "{line}");
        assert_eq!(
            mps_line(4 << 30, &info(None)),
            None,
            "nothing to say without MPS"
        );
    }
}
