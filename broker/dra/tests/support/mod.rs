//! Test support for the driver: a fake API server (a small hyper server answering the
//! ResourceClaim GET and the ResourceSlice GET/create/replace as kube-apiserver does), a
//! fake kubelet speaking the real registration and DRA protos over the plugin's Unix
//! sockets, and the plugin binary as a child process.

#![allow(dead_code)]

use anyhow::{bail, Context, Result};
use gpu_broker_dra::pb::{dra_v1, dra_v1beta1, health_v1, health_v1alpha1, registration as reg};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::{Channel, Endpoint};

pub const DRIVER: &str = "gpu-broker.io";

/// What the fake API server holds.
#[derive(Default)]
pub struct ApiState {
    /// ResourceClaims by (namespace, name).
    pub claims: BTreeMap<(String, String), Value>,
    /// ResourceSlices by name.
    pub slices: BTreeMap<String, Value>,
    next_version: u64,
    /// Every write: (method, path).
    pub writes: Vec<(String, String)>,
}

/// A fake API server on 127.0.0.1.
pub struct FakeApi {
    pub url: String,
    pub state: Arc<Mutex<ApiState>>,
}

const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

fn status(code: StatusCode, reason: &str, message: &str) -> Response<Full<Bytes>> {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16()});
    reply(code, &body)
}

fn reply(code: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

async fn handle(
    state: Arc<Mutex<ApiState>>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let mut st = state.lock();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let answer = match (&method, parts.as_slice()) {
        (
            &Method::GET,
            ["apis", "resource.k8s.io", "v1", "namespaces", ns, "resourceclaims", name],
        ) => match st.claims.get(&(ns.to_string(), name.to_string())) {
            Some(c) => reply(StatusCode::OK, c),
            None => status(
                StatusCode::NOT_FOUND,
                "NotFound",
                "resourceclaims not found",
            ),
        },
        (&Method::GET, ["apis", "resource.k8s.io", "v1", "resourceslices", name]) => {
            match st.slices.get(*name) {
                Some(s) => reply(StatusCode::OK, s),
                None => status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    "resourceslices not found",
                ),
            }
        }
        (&Method::POST, ["apis", "resource.k8s.io", "v1", "resourceslices"]) => {
            let mut s: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let name = s["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            if st.slices.contains_key(&name) {
                status(StatusCode::CONFLICT, "AlreadyExists", "exists")
            } else {
                st.next_version += 1;
                s["metadata"]["resourceVersion"] = st.next_version.to_string().into();
                st.writes.push(("POST".into(), path.clone()));
                st.slices.insert(name, s.clone());
                reply(StatusCode::CREATED, &s)
            }
        }
        (&Method::PUT, ["apis", "resource.k8s.io", "v1", "resourceslices", name]) => {
            let mut s: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let current = st
                .slices
                .get(*name)
                .map(|o| o["metadata"]["resourceVersion"].clone());
            match current {
                None => status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    "resourceslices not found",
                ),
                Some(rv) if rv != s["metadata"]["resourceVersion"] => status(
                    StatusCode::CONFLICT,
                    "Conflict",
                    "the object has been modified",
                ),
                Some(_) => {
                    st.next_version += 1;
                    s["metadata"]["resourceVersion"] = st.next_version.to_string().into();
                    st.writes.push(("PUT".into(), path.clone()));
                    st.slices.insert(name.to_string(), s.clone());
                    reply(StatusCode::OK, &s)
                }
            }
        }
        _ => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("{method} {path}"),
        ),
    };
    let _ = SLICES;
    Ok(answer)
}

impl FakeApi {
    pub async fn start() -> Result<FakeApi> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let state = Arc::new(Mutex::new(ApiState::default()));
        let st = state.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let st = st.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| handle(st.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        Ok(FakeApi { url, state })
    }

    /// Adds a ResourceClaim allocated `memory` on device `device` of this driver.
    pub fn add_claim(&self, ns: &str, name: &str, uid: &str, device: &str, memory: &str) {
        let c = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": ns, "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": DRIVER, "capacity": {"requests": {"memory": memory}}}}]}},
            "status": {"allocation": {"devices": {"results": [{
                "request": "gpu", "driver": DRIVER, "pool": "node-a", "device": device,
                "shareID": format!("share-{uid}"), "consumedCapacity": {"memory": memory}}]}}}
        });
        self.state.lock().claims.insert((ns.into(), name.into()), c);
    }

    pub fn remove_claim(&self, ns: &str, name: &str) {
        self.state.lock().claims.remove(&(ns.into(), name.into()));
    }

    pub fn slice(&self, name: &str) -> Option<Value> {
        self.state.lock().slices.get(name).cloned()
    }

    /// Waits until the slice `name` satisfies `ok`.
    pub async fn wait_slice(&self, name: &str, ok: impl Fn(&Value) -> bool) -> Result<Value> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = self.slice(name).filter(|s| ok(s)) {
                return Ok(s);
            }
            if Instant::now() > deadline {
                bail!(
                    "slice {name} never became as expected: {:?}",
                    self.slice(name)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The plugin binary, started against a broker and a fake API server, with its own
/// kubelet directories under `dir`.
pub struct Plugin {
    child: Option<Child>,
    args: Vec<String>,
    pub dir: PathBuf,
    pub log: PathBuf,
}

impl Plugin {
    pub fn start(
        dir: &Path,
        broker_socket: &Path,
        admin_token_file: &Path,
        api: &str,
    ) -> Result<Plugin> {
        let d = |s: &str| dir.join(s).display().to_string();
        let args = vec![
            "run".to_string(),
            "--node".into(),
            "node-a".into(),
            "--broker".into(),
            broker_socket.display().to_string(),
            "--broker-socket-dir".into(),
            broker_socket.parent().unwrap().display().to_string(),
            "--broker-socket-name".into(),
            broker_socket
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned(),
            "--admin-token-file".into(),
            admin_token_file.display().to_string(),
            "--apiserver".into(),
            api.into(),
            "--registry-dir".into(),
            d("plugins_registry"),
            "--plugins-dir".into(),
            d("plugins"),
            "--cdi-dir".into(),
            d("cdi"),
            "--state-dir".into(),
            d("state"),
            "--slice-interval".into(),
            "100ms".into(),
            "--cleanup-interval".into(),
            "200ms".into(),
        ];
        let mut p = Plugin {
            child: None,
            args,
            dir: dir.to_path_buf(),
            log: dir.join("plugin.log"),
        };
        p.spawn()?;
        Ok(p)
    }

    pub fn spawn(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(env!("CARGO_BIN_EXE_gpu-broker-dra"))
            .args(&self.args)
            .env("GPU_BROKER_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("spawning gpu-broker-dra")?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL: a crash, nothing cleaned up.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then how long it took to exit (`None`: not within `within`; then killed).
    pub fn terminate(&mut self, within: Duration) -> Option<Duration> {
        let mut c = self.child.take()?;
        let started = Instant::now();
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        while started.elapsed() < within {
            if let Ok(Some(_)) = c.try_wait() {
                return Some(started.elapsed());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
        None
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn registration_socket(&self) -> PathBuf {
        self.dir
            .join("plugins_registry")
            .join(format!("{DRIVER}-reg.sock"))
    }

    pub fn cdi_spec(&self, uid: &str) -> PathBuf {
        self.dir
            .join("cdi")
            .join(format!("gpu-broker.io-claim_{uid}.json"))
    }

    pub fn checkpoint(&self) -> PathBuf {
        self.dir.join("state").join("checkpoint.json")
    }

    pub fn token_file(&self, uid: &str) -> PathBuf {
        self.dir
            .join("state")
            .join("claims")
            .join(uid)
            .join("token")
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn unix_channel(path: &Path) -> Result<Channel> {
    Ok(Endpoint::from_shared(format!("unix://{}", path.display()))?
        .connect()
        .await?)
}

/// The kubelet, as far as a DRA plugin sees it.
pub struct Kubelet {
    pub info: reg::PluginInfo,
    pub v1: dra_v1::dra_plugin_client::DraPluginClient<Channel>,
    pub v1beta1: dra_v1beta1::dra_plugin_client::DraPluginClient<Channel>,
    pub health: health_v1::dra_resource_health_client::DraResourceHealthClient<Channel>,
    pub health_v1alpha1:
        health_v1alpha1::dra_resource_health_client::DraResourceHealthClient<Channel>,
}

impl Kubelet {
    /// Does what the kubelet's plugin watcher does with a new socket in its registry:
    /// `GetInfo`, then `NotifyRegistrationStatus`, then dials the endpoint it was given.
    pub async fn register(plugin: &Plugin) -> Result<Kubelet> {
        let sock = plugin.registration_socket();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut client = loop {
            if sock.exists() {
                if let Ok(ch) = unix_channel(&sock).await {
                    break reg::registration_client::RegistrationClient::new(ch);
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "the plugin never served {}: {}",
                    sock.display(),
                    plugin.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let info = client.get_info(reg::InfoRequest {}).await?.into_inner();
        client
            .notify_registration_status(reg::RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            })
            .await?;
        let ch = unix_channel(Path::new(&info.endpoint)).await?;
        Ok(Kubelet {
            info,
            v1: dra_v1::dra_plugin_client::DraPluginClient::new(ch.clone()),
            v1beta1: dra_v1beta1::dra_plugin_client::DraPluginClient::new(ch.clone()),
            health: health_v1::dra_resource_health_client::DraResourceHealthClient::new(ch.clone()),
            health_v1alpha1:
                health_v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(ch),
        })
    }

    pub async fn prepare(
        &self,
        claims: &[(&str, &str, &str)],
    ) -> Result<dra_v1::NodePrepareResourcesResponse> {
        let claims = claims
            .iter()
            .map(|(ns, name, uid)| dra_v1::Claim {
                namespace: ns.to_string(),
                name: name.to_string(),
                uid: uid.to_string(),
            })
            .collect();
        Ok(self
            .v1
            .clone()
            .node_prepare_resources(dra_v1::NodePrepareResourcesRequest { claims })
            .await?
            .into_inner())
    }

    pub async fn unprepare(
        &self,
        claims: &[(&str, &str, &str)],
    ) -> Result<dra_v1::NodeUnprepareResourcesResponse> {
        let claims = claims
            .iter()
            .map(|(ns, name, uid)| dra_v1::Claim {
                namespace: ns.to_string(),
                name: name.to_string(),
                uid: uid.to_string(),
            })
            .collect();
        Ok(self
            .v1
            .clone()
            .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest { claims })
            .await?
            .into_inner())
    }
}
