//! The node's broker, as the driver uses it: its Admin service over the broker's socket
//! (or an operators' listener), authenticated with an admin token. Claim reservations
//! (`ReserveClaim`, `ReleaseClaim`, `ListClaims`) and what the ResourceSlice is made of
//! (`GetDevices`, `GetInfo`).

use gpu_broker_proto::v1 as pb;
use pb::admin_client::AdminClient;
use thiserror::Error;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

/// A failed call to the broker.
#[derive(Debug, Error)]
pub enum BrokerError {
    #[error("broker address {0:?}: {1}")]
    Address(String, String),
    #[error("connecting to the broker at {0}: {1}")]
    Connect(String, tonic::transport::Error),
    #[error("the broker refused: {}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
}

type Authed = InterceptedService<Channel, Bearer>;

/// Adds `authorization: Bearer <token>` to every call.
#[derive(Clone)]
pub struct Bearer(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut().insert("authorization", self.0.clone());
        Ok(req)
    }
}

/// A connection to the broker's Admin service.
#[derive(Clone)]
pub struct Broker {
    admin: AdminClient<Authed>,
}

/// What the broker says about its devices and itself.
#[derive(Clone, Debug, PartialEq)]
pub struct Inventory {
    pub version: String,
    pub devices: Vec<pb::DeviceInfo>,
}

impl Broker {
    /// Connects (lazily: the first call dials) to `addr` (`/path/broker.sock`,
    /// `unix:///path`, `http://host:port`) with the admin `token`.
    pub fn connect(addr: &str, token: &str) -> Result<Broker, BrokerError> {
        let uri = if addr.starts_with('/') {
            format!("unix://{addr}")
        } else {
            addr.to_string()
        };
        let endpoint = Endpoint::from_shared(uri.clone())
            .map_err(|e| BrokerError::Address(addr.into(), e.to_string()))?;
        let channel = endpoint.connect_lazy();
        let value = format!("Bearer {}", token.trim())
            .parse()
            .map_err(|_| BrokerError::Address(addr.into(), "the token is not ASCII".into()))?;
        Ok(Broker {
            admin: AdminClient::with_interceptor(channel, Bearer(value)),
        })
    }

    /// Reserves a claim's memory and mints its token.
    pub async fn reserve_claim(
        &self,
        req: pb::ReserveClaimRequest,
    ) -> Result<pb::ReserveClaimResponse, tonic::Status> {
        Ok(self.admin.clone().reserve_claim(req).await?.into_inner())
    }

    /// Ends a claim's reservation and token: `Ok(false)` when the broker has neither.
    pub async fn release_claim(&self, claim: &str) -> Result<bool, tonic::Status> {
        let req = pb::ReleaseClaimRequest {
            claim: claim.to_string(),
        };
        match self.admin.clone().release_claim(req).await {
            Ok(_) => Ok(true),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(false),
            Err(s) => Err(s),
        }
    }

    /// The claim reservations the broker holds.
    pub async fn list_claims(&self) -> Result<Vec<pb::ClaimReservation>, tonic::Status> {
        let r = self
            .admin
            .clone()
            .list_claims(pb::ListClaimsRequest {})
            .await?;
        Ok(r.into_inner().claims)
    }

    /// The broker's version and devices.
    pub async fn inventory(&self) -> Result<Inventory, tonic::Status> {
        let mut admin = self.admin.clone();
        let info = admin.get_info(pb::GetInfoRequest {}).await?.into_inner();
        let devices = admin
            .get_devices(pb::GetDevicesRequest {})
            .await?
            .into_inner()
            .devices;
        Ok(Inventory {
            version: info.version,
            devices,
        })
    }
}
