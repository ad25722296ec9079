//! The kubelet plugin API on Unix sockets: `pluginregistration.Registration` on
//! `<registry>/<driver>-reg.sock` (the kubelet's plugin watcher finds it there, asks
//! `GetInfo` and reports with `NotifyRegistrationStatus`), and the DRA node service, v1 and
//! v1beta1, with the devices' health (`DRAResourceHealth`, v1 and v1alpha1, listed in the
//! supported versions as the kubelet expects) on `<plugins>/<driver>/dra.sock` (the endpoint
//! `GetInfo` names). The services are thin: claims go to [`Driver`], health to
//! [`HealthService`].

use crate::checkpoint::PreparedDevice;
use crate::driver::{ClaimRef, Driver};
use crate::health::{self, HealthService};
use crate::pb::{dra_v1 as v1, dra_v1beta1 as v1beta1, registration as reg};
use crate::pb::{health_v1, health_v1alpha1};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// The versions of the DRA service offered (the kubelet picks the highest it knows), then
/// those of the health service (likewise; a kubelet that knows none ignores them).
pub const SUPPORTED_VERSIONS: [&str; 4] = [
    "v1.DRAPlugin",
    "v1beta1.DRAPlugin",
    health::SERVICES[0],
    health::SERVICES[1],
];
/// The plugin type of a DRA driver.
pub const PLUGIN_TYPE: &str = "DRAPlugin";

/// What the kubelet last said about the registration: `None` before it said anything,
/// else `Ok` or its error.
pub type Registered = Option<Result<(), String>>;

/// The registration service.
pub struct RegistrationService {
    driver_name: String,
    endpoint: PathBuf,
    status: watch::Sender<Registered>,
}

#[tonic::async_trait]
impl reg::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _req: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: PLUGIN_TYPE.into(),
            name: self.driver_name.clone(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let r = req.into_inner();
        if r.plugin_registered {
            tracing::info!("registered with the kubelet");
            self.status.send_replace(Some(Ok(())));
        } else {
            tracing::error!(error = %r.error, "the kubelet refused the registration");
            self.status.send_replace(Some(Err(r.error)));
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

fn claim_ref(namespace: String, name: String, uid: String) -> ClaimRef {
    ClaimRef {
        namespace,
        name,
        uid,
    }
}

/// The DRA node service (both versions).
pub struct DraService {
    driver: Arc<Driver>,
}

macro_rules! dra_version {
    ($pb:ident, $share:expr) => {
        #[tonic::async_trait]
        impl $pb::dra_plugin_server::DraPlugin for DraService {
            async fn node_prepare_resources(
                &self,
                req: Request<$pb::NodePrepareResourcesRequest>,
            ) -> Result<Response<$pb::NodePrepareResourcesResponse>, Status> {
                let claims: Vec<ClaimRef> = req
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| claim_ref(c.namespace, c.name, c.uid))
                    .collect();
                let answers = self.driver.prepare(&claims).await;
                let claims = answers
                    .into_iter()
                    .map(|(uid, r)| {
                        let one = match r {
                            Ok(d) => $pb::NodePrepareResourceResponse {
                                devices: vec![$share(d)],
                                error: String::new(),
                            },
                            Err(error) => $pb::NodePrepareResourceResponse {
                                devices: Vec::new(),
                                error,
                            },
                        };
                        (uid, one)
                    })
                    .collect();
                Ok(Response::new($pb::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                req: Request<$pb::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$pb::NodeUnprepareResourcesResponse>, Status> {
                let claims: Vec<ClaimRef> = req
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| claim_ref(c.namespace, c.name, c.uid))
                    .collect();
                let answers = self.driver.unprepare(&claims).await;
                let claims = answers
                    .into_iter()
                    .map(|(uid, r)| {
                        let error = r.err().unwrap_or_default();
                        (uid, $pb::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(Response::new($pb::NodeUnprepareResourcesResponse {
                    claims,
                }))
            }
        }
    };
}

dra_version!(v1, |d: PreparedDevice| v1::Device {
    request_names: vec![d.request],
    pool_name: d.pool,
    device_name: d.device,
    cdi_device_ids: d.cdi_ids,
    share_id: d.share_id,
});
dra_version!(v1beta1, |d: PreparedDevice| v1beta1::Device {
    request_names: vec![d.request],
    pool_name: d.pool,
    device_name: d.device,
    cdi_device_ids: d.cdi_ids,
});

/// Where the plugin's sockets go.
#[derive(Clone, Debug)]
pub struct Sockets {
    /// The kubelet's plugin registry (`/var/lib/kubelet/plugins_registry`).
    pub registry_dir: PathBuf,
    /// The kubelet's plugins directory (`/var/lib/kubelet/plugins`).
    pub plugins_dir: PathBuf,
}

impl Sockets {
    pub fn registration(&self, driver: &str) -> PathBuf {
        self.registry_dir.join(format!("{driver}-reg.sock"))
    }
    pub fn dra(&self, driver: &str) -> PathBuf {
        self.plugins_dir.join(driver).join("dra.sock")
    }
}

/// Binds a Unix socket at `path`, replacing a stale one.
fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    UnixListener::bind(path)
}

/// Serves both sockets until `stop`; the DRA socket first, so the endpoint exists when the
/// kubelet learns of it. Returns the registration status the kubelet reports and the task
/// that ends when both servers have stopped (their sockets removed).
pub fn serve(
    driver: Arc<Driver>,
    health: HealthService,
    driver_name: &str,
    sockets: &Sockets,
    stop: CancellationToken,
) -> std::io::Result<(watch::Receiver<Registered>, tokio::task::JoinHandle<()>)> {
    let dra_path = sockets.dra(driver_name);
    let reg_path = sockets.registration(driver_name);
    let dra = bind(&dra_path)?;
    let registration = bind(&reg_path)?;
    let (tx, rx) = watch::channel(None);
    let reg_service = RegistrationService {
        driver_name: driver_name.to_string(),
        endpoint: dra_path.clone(),
        status: tx,
    };
    let dra_server = tonic::transport::Server::builder()
        .add_service(v1::dra_plugin_server::DraPluginServer::new(DraService {
            driver: driver.clone(),
        }))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(
            DraService { driver },
        ))
        .add_service(
            health_v1::dra_resource_health_server::DraResourceHealthServer::new(health.clone()),
        )
        .add_service(
            health_v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(health),
        )
        .serve_with_incoming_shutdown(UnixListenerStream::new(dra), stop.clone().cancelled_owned());
    let reg_server = tonic::transport::Server::builder()
        .add_service(reg::registration_server::RegistrationServer::new(
            reg_service,
        ))
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(registration),
            stop.cancelled_owned(),
        );
    let task = tokio::spawn(async move {
        let (a, b) = tokio::join!(dra_server, reg_server);
        for (what, r) in [("DRA", a), ("registration", b)] {
            if let Err(e) = r {
                tracing::error!(error = %e, "the {what} server stopped");
            }
        }
        // The kubelet's watcher sees the registration socket go and unregisters us.
        let _ = std::fs::remove_file(&reg_path);
        let _ = std::fs::remove_file(&dra_path);
    });
    Ok((rx, task))
}
