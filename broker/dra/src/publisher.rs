//! Keeps the node's ResourceSlice current: reads the broker's devices, and creates the
//! slice or replaces it (pool generation + 1) when its devices changed — leasable bytes
//! moved, a device drained or found unhealthy (withdrawn) or back. Polls the broker every
//! interval; a failed round is logged and tried again on the next.

use crate::broker::Broker;
use crate::slice::{build, devices, slice_name};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, PostParams};
use std::time::Duration;
use thiserror::Error;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Error)]
pub enum PublishError {
    #[error("reading the broker's devices: {}: {}", .0.code(), .0.message())]
    Broker(#[from] tonic::Status),
    #[error("the API server: {0}")]
    Kube(#[from] kube::Error),
}

/// What changed in one round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Published {
    Created,
    Replaced { generation: i64 },
    Unchanged,
}

pub struct Publisher {
    api: Api<ResourceSlice>,
    broker: Broker,
    driver: String,
    node: String,
}

impl Publisher {
    pub fn new(kube: kube::Client, broker: Broker, driver: &str, node: &str) -> Publisher {
        Publisher {
            api: Api::all(kube),
            broker,
            driver: driver.to_string(),
            node: node.to_string(),
        }
    }

    /// One round: the slice brought in line with the broker.
    pub async fn publish_once(&self) -> Result<Published, PublishError> {
        let inv = self.broker.inventory().await?;
        let name = slice_name(&self.node, &self.driver);
        let pp = PostParams::default();
        match self.api.get_opt(&name).await? {
            None => {
                self.api
                    .create(&pp, &build(&self.driver, &self.node, 1, &inv))
                    .await?;
                tracing::info!(slice = %name, devices = inv.devices.len(), "ResourceSlice created");
                Ok(Published::Created)
            }
            Some(old) => {
                let want = devices(&inv);
                let same = old.spec.devices.as_deref().unwrap_or_default() == want.as_slice()
                    && old.spec.driver == self.driver
                    && old.spec.node_name.as_deref() == Some(self.node.as_str());
                if same {
                    return Ok(Published::Unchanged);
                }
                let generation = old.spec.pool.generation + 1;
                let mut new = build(&self.driver, &self.node, generation, &inv);
                new.metadata.resource_version = old.metadata.resource_version.clone();
                self.api.replace(&name, &pp, &new).await?;
                tracing::info!(slice = %name, generation, devices = want.len(), "ResourceSlice replaced");
                Ok(Published::Replaced { generation })
            }
        }
    }

    /// Rounds every `interval` until `stop`.
    pub async fn run(self, interval: Duration, stop: CancellationToken) {
        loop {
            if let Err(e) = self.publish_once().await {
                tracing::warn!(error = %e, "publishing the ResourceSlice");
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }
}
