//! The shipped systemd unit under a real systemd: `systemd` runs as PID 1 of a PID and
//! mount namespace of its own (`unshare`; units in its private `/run/systemd/system`), the
//! unit is `deploy/gpu-broker.service` with a drop-in for this test's binary, paths and
//! the host backend, and a worker (`e2e-worker hold --reconnect`, entered into the
//! namespace so the broker sees its pid) holds leases. SIGKILL the broker: systemd restarts
//! it (`Restart=on-failure`) and hands back its file-descriptor store, and the worker's
//! leases come back with the same ids and bytes, its tenant's books exact; a released lease
//! leaves the store. Needs root and systemd (`/lib/systemd/systemd`), as this project's
//! machines have.

use super::*;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};

const SYSTEMD: &str = "/lib/systemd/systemd";
const UNIT: &str = "gpu-broker.service";

/// A systemd manager in namespaces of its own; killed, with everything it started, on drop.
struct Manager {
    unshare: Child,
    init: u32,
}

impl Manager {
    /// Boots systemd into an empty target of its own and waits until it is running.
    fn boot() -> Manager {
        // The target and the units live in the namespace's own /run: nothing of this
        // machine's /etc changes. No default dependencies anywhere: sysinit.target would
        // run this machine's boot services (systemd-tmpfiles empties /tmp; its own /tmp is
        // a private one anyway).
        let script = "mount -t tmpfs tmpfs /run && mount -t tmpfs tmpfs /tmp && \
            mount -t tmpfs tmpfs /var/tmp && mkdir -p /run/systemd/system && \
            printf '[Unit]\\nDescription=gpu-broker test\\nDefaultDependencies=no\\n' \
            > /run/systemd/system/gpb-test.target && \
            exec /lib/systemd/systemd --system --unit=gpb-test.target --log-target=null";
        let unshare = Command::new("unshare")
            .args([
                "--fork",
                "--pid",
                "--mount",
                "--mount-proc",
                "--propagation",
                "private",
            ])
            .args(["sh", "-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("unshare (util-linux)");
        let children = format!("/proc/{0}/task/{0}/children", unshare.id());
        let mut m = Manager { unshare, init: 0 };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if m.init == 0 {
                m.init = std::fs::read_to_string(&children)
                    .ok()
                    .and_then(|s| s.split_whitespace().next()?.parse().ok())
                    .unwrap_or(0);
            }
            if m.init != 0 {
                let state = m.ctl(&["is-system-running"]);
                let state = String::from_utf8_lossy(&state.stdout).trim().to_string();
                if state == "running" || state == "degraded" {
                    return m;
                }
            }
            assert!(Instant::now() < deadline, "systemd did not come up in 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `cmd` run inside the manager's namespaces.
    fn enter(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg("-t")
            .arg(self.init.to_string())
            .args(["-m", "-p", "--"])
            .arg(program);
        c
    }

    fn ctl(&self, args: &[&str]) -> std::process::Output {
        self.enter("systemctl").args(args).output().unwrap()
    }

    /// `systemctl show -p NAME --value` of the unit.
    fn show(&self, name: &str) -> String {
        let out = self.ctl(&["show", UNIT, "-p", name, "--value"]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Writes a unit file into the manager's own `/run/systemd/system`.
    fn install(&self, rel: &str, text: &str) {
        let path = PathBuf::from(format!("/proc/{}/root/run/systemd/system", self.init)).join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        // Killing PID 1 of the namespace kills every process in it.
        if self.init != 0 {
            // SAFETY: a plain kill of the pid read from the kernel.
            unsafe { libc::kill(self.init as i32, libc::SIGKILL) };
        }
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
    }
}

/// A worker in the manager's namespaces, read line by line.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Worker {
    fn next_with(&mut self, prefix: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.starts_with(prefix) {
                        return l;
                    }
                }
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                    panic!("no {prefix:?} line within {within:?}; saw {:#?}", self.seen)
                }
            }
        }
    }

    /// Its leases' ids (its `LEASE` lines), sorted.
    fn leases(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .seen
            .iter()
            .filter_map(|l| Some(l.strip_prefix("LEASE ")?.split(' ').next()?.to_string()))
            .collect();
        v.sort();
        v
    }

    fn say(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The drop-in that points the shipped unit at this test: no default dependencies (this
/// machine's boot services stay out), its binary, sockets and state in
/// `dir` (outside /tmp: the unit has PrivateTmp=), the host backend, the fd store as the
/// place that keeps leases, a quick restart, and no group to create.
fn drop_in(dir: &Path, shm: &Path) -> String {
    drop_in_with(dir, shm, "")
}

/// [`drop_in`], the broker given the flags `extra` too.
fn drop_in_with(dir: &Path, shm: &Path, extra: &str) -> String {
    let d = dir.display();
    format!(
        "[Unit]\nDefaultDependencies=no\n[Service]\nExecStart=\nExecStart={bin} --backend host --host-capacity 256MiB \
         --host-devices 1 --headroom 0% --socket {d}/broker.sock --state-dir {d}/state \
         --host-shm-dir {shm} --shutdown-grace 1s {extra}\n\
         Group=\nRestartSec=100ms\nProtectHome=no\nReadWritePaths={d} /dev/shm\n\
         StandardOutput=append:{d}/broker.log\nStandardError=inherit\n",
        bin = bin("gpu-broker").display(),
        shm = shm.display(),
    )
}

async fn held(admin: &AdminClient) -> (u64, u32) {
    let t = admin.get_quota("alpha").await.unwrap();
    (t.usage.held_bytes, t.usage.lease_count)
}

async fn lease_ids(admin: &AdminClient) -> Vec<String> {
    let mut ids: Vec<String> = admin
        .list_all_leases(None)
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.lease_id)
        .collect();
    ids.sort();
    ids
}

/// `e2e-worker hold --reconnect` of `count` leases of 8 MiB filled with `pattern`, in the
/// manager's namespaces (so the broker sees its pid), once it is holding them.
fn hold(sd: &Manager, uri: &str, token: &str, count: u32, pattern: &str) -> Worker {
    let mut child = sd
        .enter(bin("e2e-worker"))
        .args(["--broker", uri, "--token", token])
        .args(["hold", "--bytes", "8MiB", "--count", &count.to_string()])
        .args(["--pattern", pattern, "--reconnect"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut w = Worker {
        child,
        stdin,
        lines,
        seen: Vec::new(),
    };
    let session = w.next_with("SESSION ", Duration::from_secs(15));
    assert!(
        !session.ends_with(" 0"),
        "the broker must see the worker's pid: {session}"
    );
    w.next_with("READY", Duration::from_secs(15));
    w
}

/// The ids of `EVENT resumed kept=... lost=...`'s `field`, sorted.
fn ids(line: &str, field: &str) -> Vec<String> {
    let mut v: Vec<String> = line
        .split_whitespace()
        .find_map(|f| f.strip_prefix(field))
        .unwrap_or_else(|| panic!("{field} in {line}"))
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    v.sort();
    v
}

/// The manager's version number (`252` of `252.38-1~deb12u1`).
fn version(sd: &Manager) -> u32 {
    let out = sd.ctl(&["show", "-p", "Version", "--value"]);
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("systemd version {text:?}"))
}

#[tokio::test]
async fn the_shipped_unit_keeps_leases_in_systemds_store_across_restarts() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !Path::new(SYSTEMD).exists() {
        eprintln!("skipped: needs root and {SYSTEMD}");
        return;
    }
    // Outside /tmp, which the unit makes private.
    let dir = tempfile::Builder::new()
        .prefix("gpb-systemd-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap();
    let shm = PathBuf::from("/dev/shm").join(dir.path().file_name().unwrap());
    let log = dir.path().join("broker.log");
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    let sd = Manager::boot();
    let unit = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/gpu-broker.service"),
    )
    .unwrap();
    sd.install(UNIT, &unit);
    sd.install(&format!("{UNIT}.d/test.conf"), &drop_in(dir.path(), &shm));
    assert!(sd.ctl(&["daemon-reload"]).status.success());
    let start = sd.ctl(&["start", UNIT]);
    assert!(
        start.status.success(),
        "systemctl start: {}\n{}\n{}",
        String::from_utf8_lossy(&start.stderr),
        String::from_utf8_lossy(&sd.ctl(&["status", UNIT]).stdout),
        log_text()
    );
    assert_eq!(sd.show("ActiveState"), "active");

    let uri = format!("unix://{}/broker.sock", dir.path().display());
    let token = std::fs::read_to_string(dir.path().join("state/admin.token")).unwrap();
    let token = token.trim().to_string();
    let admin = AdminClient::connect(&uri, token.clone()).await.unwrap();
    admin
        .set_quota("alpha", QuotaSpec::new(64 * MIB))
        .await
        .unwrap();
    let worker_token = admin.issue_token("alpha", "w").await.unwrap().token;
    let mut w = hold(&sd, &uri, &worker_token, 2, "0x5a");
    let mut other = hold(&sd, &uri, &worker_token, 1, "0x33");
    let all = lease_ids(&admin).await;
    assert_eq!(all.len(), 3);
    assert_eq!(held(&admin).await, (24 * MIB, 3));
    let stored: usize = sd.show("NFileDescriptorStore").parse().unwrap();
    assert!(
        stored > 3,
        "systemd's store holds each lease's memory and the records: {stored}\n{}",
        log_text()
    );

    // A crash, then an explicit restart (an upgrade): systemd hands the store back.
    let first_pid = sd.show("MainPID");
    assert!(sd
        .ctl(&["kill", "--kill-who=main", "-s", "SIGKILL", UNIT])
        .status
        .success());
    let resumed = w.next_with("EVENT resumed", Duration::from_secs(30));
    assert_eq!(ids(&resumed, "kept="), w.leases(), "{resumed}");
    assert!(
        ids(&resumed, "lost=").is_empty(),
        "{resumed}\n{}",
        log_text()
    );
    other.next_with("EVENT resumed", Duration::from_secs(30));
    assert_ne!(sd.show("MainPID"), first_pid, "a new broker process");
    assert_eq!(sd.show("NRestarts"), "1");
    assert!(sd.ctl(&["restart", UNIT]).status.success());
    let resumed = w.next_with("EVENT resumed", Duration::from_secs(30));
    assert!(
        ids(&resumed, "lost=").is_empty(),
        "{resumed}\n{}",
        log_text()
    );
    other.next_with("EVENT resumed", Duration::from_secs(30));
    let admin = AdminClient::connect(&uri, token.clone()).await.unwrap();
    assert_eq!(lease_ids(&admin).await, all, "same leases, same ids");
    assert_eq!(held(&admin).await, (24 * MIB, 3), "{}", log_text());
    w.say("check 0x5a");
    assert_eq!(w.next_with("CHECK", Duration::from_secs(10)), "CHECK ok");
    other.say("check 0x33");
    assert_eq!(
        other.next_with("CHECK", Duration::from_secs(10)),
        "CHECK ok"
    );

    // A released lease leaves the store (FDSTOREREMOVE=1).
    other.say("release");
    other.next_with("RELEASED", Duration::from_secs(10));
    assert_eq!(held(&admin).await, (16 * MIB, 2));
    let after: usize = sd.show("NFileDescriptorStore").parse().unwrap();
    assert!(
        after < stored,
        "the released lease left the store: {stored} -> {after}"
    );

    // `systemctl stop`: systemd 254 and later keep the store (FileDescriptorStorePreserve=),
    // older ones empty it, and the next start finds the worker's leases gone, books empty.
    let v = version(&sd);
    assert!(sd.ctl(&["stop", UNIT]).status.success());
    assert!(sd.ctl(&["start", UNIT]).status.success());
    let admin = AdminClient::connect(&uri, token.clone()).await.unwrap();
    if v >= 254 {
        let resumed = w.next_with("EVENT resumed", Duration::from_secs(30));
        assert!(ids(&resumed, "lost=").is_empty(), "{resumed}");
        assert_eq!(held(&admin).await, (16 * MIB, 2));
    } else {
        let line = w.next_with("EVENT other Reconnected", Duration::from_secs(30));
        let mut lost = ids_of(&line);
        lost.sort();
        assert_eq!(lost, w.leases(), "{line}");
        assert_eq!(held(&admin).await, (0, 0), "{}", log_text());
        assert_eq!(sd.show("NFileDescriptorStore"), "1", "only the records");
    }
    eprintln!(
        "systemd {v}: 3 leases kept across a SIGKILL and a restart; store {stored} -> {after} \
         descriptors after a release; a stop {} them",
        if v >= 254 { "kept" } else { "let go of" }
    );
    drop(w);
    drop(other);
    assert!(sd.ctl(&["stop", UNIT]).status.success());
    drop(sd);
    let _ = std::fs::remove_dir_all(&shm);
}

/// The quoted lease ids of a `Reconnected` line's `lost_leases`.
fn ids_of(line: &str) -> Vec<String> {
    let lost = line.split("lost_leases: [").nth(1).unwrap_or_default();
    lost.split(']')
        .next()
        .unwrap_or_default()
        .split(',')
        .map(|s| s.trim().trim_matches('"').to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

const MPS_UNIT: &str = "gpu-broker-mps.service";

/// The drop-in that points the shipped MPS unit at the fake control binary, its pipe and
/// log directories in `dir`, no default dependencies and no group to create.
fn mps_drop_in(dir: &Path) -> String {
    let d = dir.display();
    format!(
        "[Unit]\nDefaultDependencies=no\n[Service]\nExecStart=\nExecStart={fake} -f\nExecStop=\n\
         Environment=CUDA_MPS_PIPE_DIRECTORY={d}/mps\nEnvironment=CUDA_MPS_LOG_DIRECTORY={d}/mps-log\n\
         LogsDirectory=\nGroup=\n",
        fake = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../broker/src/mps/fake-control.sh")
            .display(),
    )
}

/// Managed MPS under the shipped units: the control daemon runs in
/// `deploy/gpu-broker-mps.service` and the broker (`--mps-external-daemon`) adopts it, so a
/// broker SIGKILL, `systemctl restart` and `systemctl stop` end the broker's cgroup but not
/// the daemon (same process, never asked to quit), and each new broker adopts it again.
#[tokio::test]
async fn the_mps_daemon_in_its_own_unit_outlives_broker_restarts() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !Path::new(SYSTEMD).exists() {
        eprintln!("skipped: needs root and {SYSTEMD}");
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("gpb-systemd-mps-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap();
    let shm = PathBuf::from("/dev/shm").join(dir.path().file_name().unwrap());
    let log = dir.path().join("broker.log");
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    let commands = || std::fs::read_to_string(dir.path().join("commands.log")).unwrap_or_default();
    let sd = Manager::boot();
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    sd.install(
        UNIT,
        &std::fs::read_to_string(deploy.join("gpu-broker.service")).unwrap(),
    );
    let mps = format!(
        "--mps --mps-external-daemon --mps-control {} --mps-pipe-dir {d}/mps \
         --mps-log-dir {d}/mps-log --mps-health-interval 100ms",
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../broker/src/mps/fake-control.sh")
            .display(),
        d = dir.path().display()
    );
    sd.install(
        &format!("{UNIT}.d/test.conf"),
        &drop_in_with(dir.path(), &shm, &mps),
    );
    sd.install(
        MPS_UNIT,
        &std::fs::read_to_string(deploy.join(MPS_UNIT)).unwrap(),
    );
    sd.install(&format!("{MPS_UNIT}.d/test.conf"), &mps_drop_in(dir.path()));
    assert!(sd.ctl(&["daemon-reload"]).status.success());
    let show_mps = |name: &str| {
        let out = sd.ctl(&["show", MPS_UNIT, "-p", name, "--value"]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert!(sd.ctl(&["start", MPS_UNIT]).status.success());
    let start = sd.ctl(&["start", UNIT]);
    assert!(
        start.status.success(),
        "systemctl start: {}\n{}",
        String::from_utf8_lossy(&start.stderr),
        log_text()
    );
    let daemon = show_mps("MainPID");
    assert_ne!(daemon, "0", "the MPS unit runs its daemon");
    let adopted = |n: usize| {
        let log_text = &log_text;
        async move {
            eventually(Duration::from_secs(15), || async {
                log_text()
                    .matches("the external MPS control daemon answers: adopted")
                    .count()
                    >= n
            })
            .await
        }
    };
    assert!(adopted(1).await, "{}", log_text());

    // A crash, an explicit restart and a stop of the broker: its cgroup ends each time,
    // the daemon's unit does not.
    assert!(sd
        .ctl(&["kill", "--kill-who=main", "-s", "SIGKILL", UNIT])
        .status
        .success());
    assert!(adopted(2).await, "adopted after the crash\n{}", log_text());
    assert!(sd.ctl(&["restart", UNIT]).status.success());
    assert!(
        adopted(3).await,
        "adopted after the restart\n{}",
        log_text()
    );
    assert!(sd.ctl(&["stop", UNIT]).status.success());
    assert_eq!(show_mps("ActiveState"), "active");
    assert_eq!(show_mps("MainPID"), daemon, "the same daemon throughout");
    assert_eq!(show_mps("NRestarts"), "0");
    let sent = commands();
    assert!(
        !sent.contains(" -d ") && !sent.contains("cmd quit"),
        "the broker neither started nor quit a daemon:\n{sent}"
    );
    assert!(sd.ctl(&["start", UNIT]).status.success());
    assert!(adopted(4).await, "adopted after the stop\n{}", log_text());
    eprintln!("the MPS daemon (pid {daemon} in the namespace) outlived a broker SIGKILL, restart and stop");
    assert!(sd.ctl(&["stop", UNIT]).status.success());
    assert!(sd.ctl(&["stop", MPS_UNIT]).status.success());
    drop(sd);
    let _ = std::fs::remove_dir_all(&shm);
}
