//! The worker-facing client: a connection to the broker's `Broker` service carrying a
//! tenant token. Cheap to clone (clones share one HTTP/2 connection). Open a
//! [`Session`](crate::Session) to acquire leases (`Client::session`, defined with the
//! session so that this module does not depend on it); usage and lease listings need no
//! session.

use tonic::transport::Channel;

use gpu_broker_proto::v1 as pb;
use pb::broker_client::BrokerClient;

use crate::connect::{self, AuthChannel};
use crate::error::ClientError;
use crate::lease_info::LeaseInfo;
use crate::tenant::Usage;

/// A connection to the broker authenticated with a tenant token.
#[derive(Clone, Debug)]
pub struct Client {
    broker: BrokerClient<AuthChannel>,
    /// The Unix socket this client dialled (to find the ticket socket next to it).
    dialled: Option<std::path::PathBuf>,
}

impl Client {
    /// Connects now to `uri` (`unix:///path/broker.sock` or `http://host:port`); every
    /// request carries `authorization: Bearer <token>`.
    /// `https://` addresses use the TLS options of the environment
    /// ([`connect::ConnectOptions::from_env`]).
    pub async fn connect(uri: &str, token: impl Into<String>) -> Result<Client, ClientError> {
        Client::connect_with(uri, token, &connect::ConnectOptions::from_env()).await
    }

    /// [`Client::connect`] with explicit TLS options (CA file, client certificate).
    pub async fn connect_with(
        uri: &str,
        token: impl Into<String>,
        opts: &connect::ConnectOptions,
    ) -> Result<Client, ClientError> {
        let transport = connect::connect_transport_with(uri, opts).await?;
        let c = Client::from_transport(transport, token)?.dialled(uri);
        if let Some(w) = crate::info::version_warning(&c.broker_info().await) {
            tracing::warn!("{w}");
        }
        Ok(c)
    }

    fn dialled(mut self, uri: &str) -> Client {
        self.dialled = connect::unix_path(uri);
        self
    }

    /// The Unix socket this client dialled, if it dialled one.
    pub fn dialled_socket(&self) -> Option<&std::path::Path> {
        self.dialled.as_deref()
    }

    /// A fresh descriptor of the caller's own fd lease `lease_id` (a new ticket, bound to
    /// this process, redeemed at once): for a process other than the one holding the
    /// [`crate::Lease`] (a child, a helper of the same tenant and user).
    pub async fn lease_fd(
        &self,
        lease_id: &str,
    ) -> Result<(crate::fd::FdInfo, std::os::fd::OwnedFd), ClientError> {
        let reply = self
            .raw()
            .renew_lease_ticket(pb::RenewLeaseTicketRequest {
                lease_id: lease_id.to_string(),
            })
            .await?
            .into_inner();
        let mut info = crate::fd::FdInfo::from(reply.fd.ok_or_else(|| {
            ClientError::Protocol("RenewLeaseTicket reply carries no handle".into())
        })?);
        let fd = crate::fd::fetch(&info.socket_path, &info.ticket, self.dialled_socket()).await?;
        info.ticket.clear();
        Ok((info, fd))
    }

    /// The broker's version, API revision and features.
    pub async fn broker_info(&self) -> Result<crate::info::BrokerInfo, ClientError> {
        let reply = self
            .raw()
            .get_info(gpu_broker_proto::v1::GetInfoRequest {})
            .await?
            .into_inner();
        Ok(crate::info::BrokerInfo::from(reply))
    }

    /// Like [`Client::connect`] but dials on first use (a missing broker then shows up
    /// as `Unavailable` on the first call).
    pub fn connect_lazy(uri: &str, token: impl Into<String>) -> Result<Client, ClientError> {
        Ok(Client::from_transport(connect::connect_transport_lazy(uri)?, token)?.dialled(uri))
    }

    /// Uses an existing tonic channel (custom transports, tests).
    pub fn from_channel(channel: Channel, token: impl Into<String>) -> Result<Client, ClientError> {
        Client::from_transport(channel, token)
    }

    /// Uses an existing transport ([`connect::connect_transport_with`], or a channel).
    pub fn from_transport(
        transport: impl Into<connect::Transport>,
        token: impl Into<String>,
    ) -> Result<Client, ClientError> {
        let token = token.into();
        Ok(Client {
            broker: BrokerClient::new(connect::authenticated(transport, &token)?),
            dialled: None,
        })
    }

    /// The tenant's quota and live usage.
    pub async fn usage(&self) -> Result<Usage, ClientError> {
        let reply = self.raw().get_usage(pb::GetUsageRequest {}).await?;
        Ok(Usage::from(reply.into_inner()))
    }

    /// Every lease of the caller's tenant (all pages, in the order they were granted).
    pub async fn list_leases(&self) -> Result<Vec<LeaseInfo>, ClientError> {
        crate::paging::all_pages(|token| async move { self.list_leases_page(0, &token).await })
            .await
    }

    /// One page of the caller's leases: `page_size` 0 is the broker's default;
    /// `page_token` empty for the first page, else the token the previous page returned.
    pub async fn list_leases_page(
        &self,
        page_size: u32,
        page_token: &str,
    ) -> Result<(Vec<LeaseInfo>, Option<String>), ClientError> {
        let reply = self
            .raw()
            .list_leases(pb::ListLeasesRequest {
                page_size,
                page_token: page_token.to_string(),
            })
            .await?
            .into_inner();
        Ok((
            reply.leases.into_iter().map(LeaseInfo::from).collect(),
            Some(reply.next_page_token).filter(|t| !t.is_empty()),
        ))
    }

    /// Releases a lease by id (for leases not held as a [`crate::Lease`], e.g. detached).
    pub async fn release_lease(&self, lease_id: &str) -> Result<(), ClientError> {
        self.raw()
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: lease_id.to_string(),
                retain_mapping: false,
                may_decline: false,
            })
            .await?;
        Ok(())
    }

    /// Sends one `Keepalive` for a session id.
    pub async fn keepalive(&self, session_id: &str) -> Result<(), ClientError> {
        self.raw()
            .keepalive(pb::KeepaliveRequest {
                session_id: session_id.to_string(),
            })
            .await?;
        Ok(())
    }

    /// The generated gRPC client, authenticated, for calls this crate does not wrap.
    pub fn raw(&self) -> BrokerClient<AuthChannel> {
        self.broker.clone()
    }
}
