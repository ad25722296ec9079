//! The CDI spec of a prepared claim (Container Device Interface, written as JSON with
//! serde): its container edits give the container the broker's socket directory, the
//! claim's token file (in a directory of its own) and the `GPU_BROKER_*` variables, so the
//! pod spec needs no hostPath, hostPID or hostIPC. One spec file per claim, named by the
//! claim's uid (CDI names are never reused); removing it is idempotent.

use serde::Serialize;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The CDI kind of claim devices: ids are `gpu-broker.io/claim=<claim uid>`.
pub const KIND: &str = "gpu-broker.io/claim";
/// The CDI version written (env and mounts: understood by containerd and CRI-O since 2023).
pub const CDI_VERSION: &str = "0.6.0";
/// Where the container finds the broker's sockets.
pub const CONTAINER_SOCKET_DIR: &str = "/run/gpu-broker";
/// Where the container finds its claim's token.
pub const CONTAINER_CLAIM_DIR: &str = "/run/gpu-broker-claim";

/// Where things are on the node.
#[derive(Clone, Debug)]
pub struct CdiLayout {
    /// Where CDI specs go (`/var/run/cdi`).
    pub spec_dir: PathBuf,
    /// Where claims' token directories go (kept 0700: only the mount reaches inside).
    pub claims_dir: PathBuf,
    /// The host directory holding the broker's sockets.
    pub broker_socket_dir: PathBuf,
    /// The broker socket's file name in it.
    pub broker_socket_name: String,
    /// The group that may read claims' tokens (the workers' group, as for the broker's
    /// sockets); `None`: the driver's own.
    pub claim_group: Option<u32>,
}

/// What a claim's container gets.
#[derive(Clone, Debug, Default)]
pub struct ClaimEdits {
    pub token: String,
    pub reservation_id: String,
    pub device_index: u32,
    pub device_uuid: String,
    /// The broker's managed MPS variables (their directories are mounted too).
    pub mps_env: Vec<(String, String)>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    cdi_version: &'static str,
    kind: &'static str,
    devices: Vec<Device>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Device {
    name: String,
    container_edits: Edits,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Edits {
    env: Vec<String>,
    mounts: Vec<Mount>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Mount {
    host_path: String,
    container_path: String,
    options: Vec<String>,
}

/// The CDI device id of claim `uid`.
pub fn device_id(uid: &str) -> String {
    format!("{KIND}={uid}")
}

impl CdiLayout {
    /// The spec file of claim `uid`.
    pub fn spec_path(&self, uid: &str) -> PathBuf {
        self.spec_dir
            .join(format!("gpu-broker.io-claim_{uid}.json"))
    }

    /// The host directory mounted as the claim's `CONTAINER_CLAIM_DIR`.
    pub fn claim_dir(&self, uid: &str) -> PathBuf {
        self.claims_dir.join(uid)
    }

    /// Writes claim `uid`'s token file and CDI spec; returns the CDI device id.
    pub fn write(&self, uid: &str, e: &ClaimEdits) -> std::io::Result<String> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.claims_dir)?;
        let dir = self.claim_dir(uid);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o750)
            .create(&dir)?;
        // The container sees this directory (not its 0700 parent): only its group's
        // members (the pod's `supplementalGroups`) may enter it and read the token.
        std::os::unix::fs::chown(&dir, None, self.claim_group)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o750))?;
        write_atomic(
            &dir.join("token"),
            e.token.as_bytes(),
            0o440,
            self.claim_group,
        )?;
        let socket = format!("unix://{CONTAINER_SOCKET_DIR}/{}", self.broker_socket_name);
        let mut env = vec![
            format!("GPU_BROKER_ADDR={socket}"),
            format!("GPU_BROKER_TOKEN_FILE={CONTAINER_CLAIM_DIR}/token"),
            format!("GPU_BROKER_RESERVATION={}", e.reservation_id),
            format!("GPU_BROKER_DEVICE={}", e.device_index),
            format!("GPU_BROKER_CLAIM={uid}"),
        ];
        if !e.device_uuid.starts_with("HOST-") {
            env.push(format!("CUDA_VISIBLE_DEVICES={}", e.device_uuid));
        }
        let mut mounts = vec![
            bind(&self.broker_socket_dir, CONTAINER_SOCKET_DIR, "rw"),
            bind(&dir, CONTAINER_CLAIM_DIR, "ro"),
        ];
        for (k, v) in &e.mps_env {
            env.push(format!("{k}={v}"));
            if k.ends_with("_DIRECTORY") && v.starts_with('/') {
                mounts.push(bind(Path::new(v), v, "rw"));
            }
        }
        let spec = Spec {
            cdi_version: CDI_VERSION,
            kind: KIND,
            devices: vec![Device {
                name: uid.to_string(),
                container_edits: Edits { env, mounts },
            }],
        };
        std::fs::create_dir_all(&self.spec_dir)?;
        let body = serde_json::to_vec_pretty(&spec).expect("a CDI spec serializes");
        write_atomic(&self.spec_path(uid), &body, 0o644, None)?;
        Ok(device_id(uid))
    }

    /// Removes claim `uid`'s spec and token; what is already gone is fine.
    pub fn remove(&self, uid: &str) -> std::io::Result<()> {
        for r in [
            std::fs::remove_file(self.spec_path(uid)),
            std::fs::remove_dir_all(self.claim_dir(uid)),
        ] {
            match r {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }
}

fn bind(host: &Path, container: &str, mode: &str) -> Mount {
    Mount {
        host_path: host.display().to_string(),
        container_path: container.to_string(),
        options: vec!["rbind".into(), mode.into()],
    }
}

/// Writes `path` whole (temporary file, sync, rename) with `mode` (and `group`).
fn write_atomic(path: &Path, body: &[u8], mode: u32, group: Option<u32>) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)?;
    f.write_all(body)?;
    std::os::unix::fs::fchown(&f, None, group)?;
    f.set_permissions(std::fs::Permissions::from_mode(mode))?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claims_spec_gives_the_socket_the_token_and_the_variables_and_is_removed_whole() {
        let dir = tempfile::tempdir().unwrap();
        let l = CdiLayout {
            spec_dir: dir.path().join("cdi"),
            claims_dir: dir.path().join("claims"),
            broker_socket_dir: "/run/gpu-broker".into(),
            broker_socket_name: "broker.sock".into(),
            claim_group: None,
        };
        let e = ClaimEdits {
            token: "secret".into(),
            reservation_id: "r1".into(),
            device_index: 1,
            device_uuid: "GPU-abc".into(),
            mps_env: vec![("CUDA_MPS_PIPE_DIRECTORY".into(), "/run/mps".into())],
        };
        assert_eq!(l.write("u1", &e).unwrap(), "gpu-broker.io/claim=u1");
        let spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(l.spec_path("u1")).unwrap()).unwrap();
        assert_eq!(spec["kind"], KIND);
        let d = &spec["devices"][0];
        assert_eq!(d["name"], "u1");
        let env: Vec<&str> = d["containerEdits"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        for want in [
            "GPU_BROKER_ADDR=unix:///run/gpu-broker/broker.sock",
            "GPU_BROKER_TOKEN_FILE=/run/gpu-broker-claim/token",
            "GPU_BROKER_RESERVATION=r1",
            "GPU_BROKER_DEVICE=1",
            "CUDA_VISIBLE_DEVICES=GPU-abc",
            "CUDA_MPS_PIPE_DIRECTORY=/run/mps",
        ] {
            assert!(env.contains(&want), "{want} in {env:?}");
        }
        let mounts = d["containerEdits"]["mounts"].as_array().unwrap();
        let targets: Vec<&str> = mounts
            .iter()
            .map(|m| m["containerPath"].as_str().unwrap())
            .collect();
        assert_eq!(
            targets,
            ["/run/gpu-broker", "/run/gpu-broker-claim", "/run/mps"]
        );
        let token = l.claim_dir("u1").join("token");
        assert_eq!(std::fs::read_to_string(&token).unwrap(), "secret");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&token), 0o440);
        assert_eq!(mode(&l.claim_dir("u1")), 0o750);
        assert_eq!(mode(&l.claims_dir), 0o700);
        l.remove("u1").unwrap();
        assert!(!l.spec_path("u1").exists() && !l.claim_dir("u1").exists());
        l.remove("u1").unwrap();
    }

    /// `cat` of the token as `uid` with `groups`, through the claim's directory alone (an
    /// inherited descriptor of it, as the container's mount of it: the 0700 parent is not
    /// in the way, the directory's and the token's own modes are).
    fn read_token_as(dir: &Path, uid: u32, groups: &str) -> std::process::Output {
        let id = uid.to_string();
        let mut args = vec!["--reuid", &id, "--regid", &id];
        if groups.is_empty() {
            args.push("--clear-groups");
        } else {
            args.extend(["--groups", groups]);
        }
        std::process::Command::new("sh")
            .arg("-c")
            .arg(r#"exec 3<"$1"; shift; exec setpriv "$@" cat /proc/self/fd/3/token"#)
            .arg("sh")
            .arg(dir)
            .args(args)
            .output()
            .unwrap()
    }

    #[test]
    fn a_claims_token_is_readable_by_a_non_root_worker_of_the_claim_group_only() {
        let dir = tempfile::tempdir().unwrap();
        let l = CdiLayout {
            spec_dir: dir.path().join("cdi"),
            claims_dir: dir.path().join("claims"),
            broker_socket_dir: "/run/gpu-broker".into(),
            broker_socket_name: "broker.sock".into(),
            claim_group: Some(2000),
        };
        let e = ClaimEdits {
            token: "secret".into(),
            ..Default::default()
        };
        l.write("u1", &e).unwrap();
        let claim = l.claim_dir("u1");
        let gid = |p: &Path| std::os::unix::fs::MetadataExt::gid(&std::fs::metadata(p).unwrap());
        assert_eq!((gid(&claim), gid(&claim.join("token"))), (2000, 2000));
        let worker = read_token_as(&claim, 65534, "2000");
        assert!(
            worker.status.success(),
            "uid 65534 in group 2000: {}",
            String::from_utf8_lossy(&worker.stderr)
        );
        assert_eq!(worker.stdout, b"secret");
        for (uid, groups) in [(65534, ""), (65533, "65533")] {
            let other = read_token_as(&claim, uid, groups);
            assert!(
                !other.status.success() && other.stdout.is_empty(),
                "uid {uid} (groups {groups:?}) read the token"
            );
        }
    }
}
