//! Session events: what the broker pushes down a session's stream after `opened`,
//! as a domain enum ([`SessionEvent`]), and the background task that reads the stream,
//! fans events out to subscribers through a tokio broadcast channel, and sends
//! `Keepalive` every third of the broker's keepalive timeout. The first subscriber
//! also receives events that arrived before it subscribed; later ones see events from
//! their subscription on. Every subscriber's stream ends with [`SessionEvent::Closed`].

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use futures::Stream;
use parking_lot::Mutex;
use tokio::sync::broadcast;
use tokio::time::{interval_at, Instant, MissedTickBehavior};

use gpu_broker_proto::v1 as pb;
use pb::session_event::Event;

use crate::client::Client;
use crate::error::ClientError;
use crate::lease::unix_ms;

/// Events kept for a subscriber that falls behind; older ones are dropped (and logged).
const EVENT_BUFFER: usize = 256;

/// Something the broker told this session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEvent {
    /// Please release this lease (or shrink and release) before `deadline`.
    ReclaimRequested {
        /// The lease to give back.
        lease_id: String,
        /// Bytes the broker wants back.
        bytes: u64,
        /// When the broker stops asking and revokes.
        deadline: SystemTime,
        /// Why (e.g. a higher-priority tenant is waiting).
        reason: String,
    },
    /// The lease is gone; its memory stays quarantined until the mapping is closed.
    LeaseRevoked {
        /// The revoked lease.
        lease_id: String,
        /// Why (operator revoke, missed reclaim deadline, ...).
        reason: String,
    },
    /// The broker is shutting down; leases end after `grace`.
    ShuttingDown {
        /// Why.
        reason: String,
        /// How long the broker waits before ending sessions.
        grace: Duration,
    },
    /// The session stream ended (broker closed it, connection lost, or the session was
    /// closed or dropped here). Always the last event.
    Closed {
        /// `None` when the broker ended the stream cleanly, else what happened.
        reason: Option<String>,
    },
}

impl SessionEvent {
    /// The domain event for a stream message; `None` for ones the client consumes
    /// itself (`opened`, heartbeats) or that carry nothing.
    pub(crate) fn from_proto(event: Option<Event>) -> Option<Self> {
        match event? {
            Event::ReclaimRequested(r) => Some(SessionEvent::ReclaimRequested {
                lease_id: r.lease_id,
                bytes: r.bytes,
                deadline: unix_ms(r.deadline_unix_ms),
                reason: r.reason,
            }),
            Event::LeaseRevoked(r) => Some(SessionEvent::LeaseRevoked {
                lease_id: r.lease_id,
                reason: r.reason,
            }),
            Event::ShuttingDown(s) => Some(SessionEvent::ShuttingDown {
                reason: s.reason,
                grace: Duration::from_millis(s.grace_ms),
            }),
            Event::Opened(_) | Event::Heartbeat(_) => None,
        }
    }

    /// True for [`SessionEvent::Closed`].
    pub fn is_closed(&self) -> bool {
        matches!(self, SessionEvent::Closed { .. })
    }
}

/// Fan-out of one session's events.
pub(crate) struct EventHub {
    tx: broadcast::Sender<SessionEvent>,
    state: Mutex<HubState>,
}

struct HubState {
    /// Subscribed at creation, handed to the first `subscribe` so it misses nothing.
    first: Option<broadcast::Receiver<SessionEvent>>,
    /// The `Closed` event once sent, for late subscribers.
    closed: Option<SessionEvent>,
}

impl EventHub {
    pub(crate) fn new() -> Arc<Self> {
        let (tx, first) = broadcast::channel(EVENT_BUFFER);
        Arc::new(EventHub {
            tx,
            state: Mutex::new(HubState {
                first: Some(first),
                closed: None,
            }),
        })
    }

    fn publish(&self, event: SessionEvent) {
        // Err only means nobody is subscribed right now.
        let _ = self.tx.send(event);
    }

    /// Sends `Closed` once; later calls do nothing.
    pub(crate) fn close(&self, reason: Option<String>) {
        let mut state = self.state.lock();
        if state.closed.is_none() {
            let event = SessionEvent::Closed { reason };
            state.closed = Some(event.clone());
            let _ = self.tx.send(event);
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.state.lock().closed.is_some()
    }

    pub(crate) fn subscribe(&self) -> SessionEvents {
        let mut state = self.state.lock();
        if let Some(rx) = state.first.take() {
            return SessionEvents::from_receiver(rx);
        }
        if let Some(closed) = state.closed.clone() {
            return SessionEvents {
                inner: Box::pin(futures::stream::iter([closed])),
            };
        }
        SessionEvents::from_receiver(self.tx.subscribe())
    }
}

/// A stream of one session's events, ending after [`SessionEvent::Closed`].
pub struct SessionEvents {
    inner: Pin<Box<dyn Stream<Item = SessionEvent> + Send>>,
}

impl SessionEvents {
    fn from_receiver(rx: broadcast::Receiver<SessionEvent>) -> Self {
        let stream = futures::stream::unfold(Some(rx), |rx| async move {
            let mut rx = rx?;
            loop {
                match rx.recv().await {
                    Ok(event) => {
                        let next = if event.is_closed() { None } else { Some(rx) };
                        return Some((event, next));
                    }
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        tracing::warn!(missed, "session event subscriber fell behind");
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        });
        SessionEvents {
            inner: Box::pin(stream),
        }
    }
}

impl Stream for SessionEvents {
    type Item = SessionEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<SessionEvent>> {
        self.inner.as_mut().poll_next(cx)
    }
}

impl std::fmt::Debug for SessionEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionEvents")
    }
}

/// Reads the session stream until it ends, publishing events, while sending keepalives;
/// then publishes `Closed`. Aborting the task drops the stream, which ends the session
/// on the broker.
pub(crate) async fn run(
    mut stream: tonic::Streaming<pb::SessionEvent>,
    hub: Arc<EventHub>,
    client: Client,
    session_id: String,
    keepalive: Option<Duration>,
) {
    let pump = async {
        loop {
            match stream.message().await {
                Ok(Some(message)) => {
                    if let Some(event) = SessionEvent::from_proto(message.event) {
                        tracing::debug!(session_id, ?event, "session event");
                        hub.publish(event);
                    }
                }
                Ok(None) => return None,
                Err(status) => return Some(ClientError::from(status).to_string()),
            }
        }
    };
    let keep = async {
        match keepalive {
            None => std::future::pending::<()>().await,
            Some(period) => {
                let period = period.max(Duration::from_millis(1));
                let mut ticks = interval_at(Instant::now() + period, period);
                ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
                loop {
                    ticks.tick().await;
                    if let Err(e) = client.keepalive(&session_id).await {
                        tracing::warn!(session_id, error = %e, "keepalive failed");
                    }
                }
            }
        }
    };
    let reason = tokio::select! {
        reason = pump => reason,
        () = keep => None,
    };
    tracing::debug!(session_id, ?reason, "session stream ended");
    hub.close(reason);
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[tokio::test]
    async fn first_subscriber_sees_early_events_and_all_end_with_closed() {
        let hub = EventHub::new();
        hub.publish(SessionEvent::LeaseRevoked {
            lease_id: "a".into(),
            reason: "r".into(),
        });
        let first = hub.subscribe();
        let second = hub.subscribe();
        hub.publish(SessionEvent::ShuttingDown {
            reason: "bye".into(),
            grace: Duration::from_secs(1),
        });
        hub.close(Some("gone".into()));
        hub.close(Some("twice".into()));
        let first: Vec<_> = first.collect().await;
        let second: Vec<_> = second.collect().await;
        assert_eq!(first.len(), 3);
        assert!(matches!(first[0], SessionEvent::LeaseRevoked { .. }));
        assert_eq!(second.len(), 2);
        assert_eq!(
            second[1],
            SessionEvent::Closed {
                reason: Some("gone".into())
            }
        );
        let late: Vec<_> = hub.subscribe().collect().await;
        assert_eq!(
            late,
            vec![SessionEvent::Closed {
                reason: Some("gone".into())
            }]
        );
        assert!(hub.is_closed());
    }

    #[test]
    fn converts_proto_events() {
        let ev = SessionEvent::from_proto(Some(Event::ReclaimRequested(pb::ReclaimRequested {
            lease_id: "l".into(),
            bytes: 10,
            deadline_unix_ms: 2_000,
            reason: "prio".into(),
        })));
        assert_eq!(
            ev,
            Some(SessionEvent::ReclaimRequested {
                lease_id: "l".into(),
                bytes: 10,
                deadline: SystemTime::UNIX_EPOCH + Duration::from_secs(2),
                reason: "prio".into(),
            })
        );
        assert_eq!(
            SessionEvent::from_proto(Some(Event::Heartbeat(pb::Heartbeat { unix_ms: 1 }))),
            None
        );
        assert_eq!(SessionEvent::from_proto(None), None);
        let ev = SessionEvent::from_proto(Some(Event::ShuttingDown(pb::ShuttingDown {
            reason: "x".into(),
            grace_ms: 1500,
        })));
        assert_eq!(
            ev,
            Some(SessionEvent::ShuttingDown {
                reason: "x".into(),
                grace: Duration::from_millis(1500)
            })
        );
    }
}
