//! The devices' health for the kubelet: the `DRAResourceHealth` service (v1 and v1alpha1,
//! the same messages) on the DRA socket, whose `NodeWatchResources` stream carries every
//! device of the node, each HEALTHY or UNHEALTHY from the broker's own state (unhealthy:
//! its health monitor or an operator; draining: an operator's drain) — UNKNOWN while the
//! broker does not answer.
//!
//! [`watch_devices`] reads the broker every interval into a [`watch`] channel; each stream
//! sends the current list at once and again after every read (the kubelet counts a device
//! it has not heard of within the timeout as unknown, so an unchanged list is sent too).

use crate::allocation::device_name;
use crate::broker::{Broker, Inventory};
use crate::pb::{health_v1 as v1, health_v1alpha1 as v1alpha1};
use futures::{Stream, StreamExt};
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// The names the kubelet looks for in the registration's supported versions.
pub const SERVICES: [&str; 2] = ["v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"];

/// A device's state as the kubelet is told it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    Healthy,
    Unhealthy,
    Unknown,
}

/// One device of the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceHealth {
    /// `gpu-N`, as in the ResourceSlice.
    pub device: String,
    pub health: Health,
    /// Why it is not healthy ("" when it is).
    pub message: String,
}

/// Every device of the node, as last read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub devices: Vec<DeviceHealth>,
    /// When it was read, Unix seconds.
    pub at: i64,
}

/// Each device of the broker's inventory, healthy unless it is marked unhealthy or
/// draining (either takes no new leases, and is withdrawn from the slice).
pub fn of_inventory(inv: &Inventory) -> Vec<DeviceHealth> {
    inv.devices
        .iter()
        .map(|d| {
            let mut why = Vec::new();
            if d.unhealthy {
                why.push(format!("unhealthy: {}", d.health_reason));
            }
            if d.draining {
                why.push(format!("draining: {}", d.drain_reason));
            }
            DeviceHealth {
                device: device_name(d.index),
                health: if why.is_empty() {
                    Health::Healthy
                } else {
                    Health::Unhealthy
                },
                message: why.join("; "),
            }
        })
        .collect()
}

/// The last known devices, each UNKNOWN: the broker did not answer.
fn unknown(last: &[DeviceHealth], error: &str) -> Vec<DeviceHealth> {
    last.iter()
        .map(|d| DeviceHealth {
            device: d.device.clone(),
            health: Health::Unknown,
            message: format!("the broker does not answer: {error}"),
        })
        .collect()
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default()
}

/// Reads the broker's devices every `interval` until `stop`, publishing each read.
pub async fn watch_devices(
    broker: Broker,
    tx: watch::Sender<Option<Report>>,
    interval: Duration,
    stop: CancellationToken,
) {
    loop {
        let devices = match broker.inventory().await {
            Ok(inv) => of_inventory(&inv),
            Err(s) => {
                tracing::debug!(error = %s, "reading the broker's devices for their health");
                let last = tx.borrow().clone().unwrap_or_default();
                unknown(&last.devices, s.message())
            }
        };
        let report = Report { devices, at: now() };
        let changed = tx.borrow().as_ref().map(|r| &r.devices) != Some(&report.devices);
        if changed {
            tracing::info!(devices = ?report.devices, "devices' health");
        }
        tx.send_replace(Some(report));
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

/// The health service (both versions): streams `reports` for the node's pool.
#[derive(Clone)]
pub struct HealthService {
    pool: String,
    reports: watch::Receiver<Option<Report>>,
    /// How long the kubelet may trust a message: a few reads' worth.
    timeout_s: i64,
    stop: CancellationToken,
}

impl HealthService {
    pub fn new(
        pool: &str,
        reports: watch::Receiver<Option<Report>>,
        interval: Duration,
        stop: CancellationToken,
    ) -> HealthService {
        HealthService {
            pool: pool.to_string(),
            reports,
            timeout_s: (interval.as_secs() as i64 * 3).max(30),
            stop,
        }
    }

    /// Every report from the current one on, ending with the plugin (a stream left open
    /// would hold the server's shutdown).
    fn reports(&self) -> impl Stream<Item = Report> + Send + 'static {
        WatchStream::new(self.reports.clone())
            .filter_map(|r| async move { r })
            .take_until(self.stop.clone().cancelled_owned())
    }
}

type ReportStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

macro_rules! health_version {
    ($pb:ident) => {
        #[tonic::async_trait]
        impl $pb::dra_resource_health_server::DraResourceHealth for HealthService {
            type NodeWatchResourcesStream = ReportStream<$pb::NodeWatchResourcesResponse>;

            async fn node_watch_resources(
                &self,
                _req: Request<$pb::NodeWatchResourcesRequest>,
            ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
                let pool = self.pool.clone();
                let timeout = self.timeout_s;
                let stream = self.reports().map(move |r| {
                    let devices = r
                        .devices
                        .into_iter()
                        .map(|d| $pb::DeviceHealth {
                            device: Some($pb::DeviceIdentifier {
                                pool_name: pool.clone(),
                                device_name: d.device,
                            }),
                            health: match d.health {
                                Health::Healthy => $pb::HealthStatus::Healthy,
                                Health::Unhealthy => $pb::HealthStatus::Unhealthy,
                                Health::Unknown => $pb::HealthStatus::Unknown,
                            } as i32,
                            last_updated_time: r.at,
                            health_check_timeout_seconds: timeout,
                            message: d.message,
                        })
                        .collect();
                    Ok($pb::NodeWatchResourcesResponse { devices })
                });
                Ok(Response::new(Box::pin(stream)))
            }
        }
    };
}

health_version!(v1);
health_version!(v1alpha1);

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_broker_proto::v1::DeviceInfo;

    #[test]
    fn a_drained_or_unhealthy_device_is_unhealthy_with_the_brokers_reason() {
        let gpu = |index: u32| DeviceInfo {
            index,
            ..Default::default()
        };
        let mut drained = gpu(1);
        drained.draining = true;
        drained.drain_reason = "maintenance".into();
        let mut sick = gpu(2);
        sick.unhealthy = true;
        sick.health_reason = "Xid 79".into();
        let inv = Inventory {
            version: String::new(),
            devices: vec![gpu(0), drained, sick],
        };
        let h = of_inventory(&inv);
        let got: Vec<(&str, Health, &str)> = h
            .iter()
            .map(|d| (d.device.as_str(), d.health, d.message.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("gpu-0", Health::Healthy, ""),
                ("gpu-1", Health::Unhealthy, "draining: maintenance"),
                ("gpu-2", Health::Unhealthy, "unhealthy: Xid 79"),
            ]
        );
        let u = unknown(&h, "connection refused");
        assert!(u.iter().all(|d| d.health == Health::Unknown));
        assert_eq!(
            u[0].message,
            "the broker does not answer: connection refused"
        );
    }
}
