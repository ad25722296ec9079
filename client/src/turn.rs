//! Compute turns for workers: time-slicing a GPU with other workers. Ask with
//! `session.turn(device).wait(d).await`, run kernels while holding the [`Turn`], give it
//! back with [`Turn::release`] (or drop it). Listen for
//! [`crate::SessionEvent::YieldRequested`]: a turn held past the quantum while others
//! wait is taken ([`crate::SessionEvent::TurnRevoked`]) after a grace period.

use crate::client::Client;
use crate::error::ClientError;
use crate::session::Session;
use gpu_broker_proto::v1 as pb;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::time::Duration;

/// A turn request to refine: `.wait(d)`, then `.await` (or `.send().await`).
#[must_use]
pub struct TurnRequest<'s> {
    session: &'s Session,
    device: u32,
    wait: Option<Duration>,
}

impl<'s> TurnRequest<'s> {
    pub(crate) fn new(session: &'s Session, device: u32) -> Self {
        TurnRequest {
            session,
            device,
            wait: None,
        }
    }

    /// Waits up to `wait` for the turn (default: do not wait).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Asks the broker.
    pub async fn send(self) -> Result<Turn, ClientError> {
        let client = self.session.client().clone();
        let reply = client
            .raw()
            .acquire_turn(pb::AcquireTurnRequest {
                session_id: self.session.id(),
                device: self.device,
                wait_ms: self.wait.map(|w| w.as_millis() as u64),
            })
            .await?
            .into_inner();
        Ok(Turn {
            client,
            id: reply.turn_id,
            device: reply.device,
            quantum: Duration::from_millis(reply.quantum_ms),
            released: false,
        })
    }
}

/// Turns are requested through a session; the code lives here so that the session
/// handle (`session.rs`) does not depend on turns.
impl Session {
    /// A compute-turn request on `device`: `.wait(d).await` gives a [`Turn`].
    pub fn turn(&self, device: u32) -> TurnRequest<'_> {
        TurnRequest::new(self, device)
    }
}

impl<'s> IntoFuture for TurnRequest<'s> {
    type Output = Result<Turn, ClientError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 's>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.send())
    }
}

/// How a turn went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnEnd {
    /// How long it was held.
    pub held: Duration,
    /// Time held past the quantum while others waited.
    pub overrun: Duration,
}

/// A held compute turn. Dropping it gives it back (in the background).
#[derive(Debug)]
pub struct Turn {
    client: Client,
    id: String,
    device: u32,
    quantum: Duration,
    released: bool,
}

impl Turn {
    /// The turn's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Its device.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// How long it may last while others wait.
    pub fn quantum(&self) -> Duration {
        self.quantum
    }

    /// Gives the turn back now.
    pub async fn release(mut self) -> Result<TurnEnd, ClientError> {
        self.released = true;
        let reply = self
            .client
            .raw()
            .release_turn(pb::ReleaseTurnRequest {
                turn_id: self.id.clone(),
            })
            .await?
            .into_inner();
        Ok(TurnEnd {
            held: Duration::from_millis(reply.held_ms),
            overrun: Duration::from_millis(reply.overrun_ms),
        })
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut raw = self.client.raw();
        let turn_id = std::mem::take(&mut self.id);
        rt.spawn(async move {
            let _ = raw.release_turn(pb::ReleaseTurnRequest { turn_id }).await;
        });
    }
}
