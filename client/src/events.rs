//! Session events: what the broker pushes down a session's stream after `opened`,
//! as a domain enum ([`SessionEvent`]), plus the events the client adds itself
//! (`Disconnected` and `Reconnected` for reconnecting sessions, `Closed` at the end),
//! and the session's fan-out of them to subscribers (`EventHub`, a tokio broadcast
//! channel) that the stream pump (`pump.rs`) and the reconnect supervisor publish to.
//! The first subscriber also receives events that arrived before it subscribed; later
//! ones see events from their subscription on. Every subscriber's stream ends with
//! [`SessionEvent::Closed`]. No I/O here.
//!
//! A reclaim handler is either [`crate::Session::on_reclaim`] or a loop over
//! [`crate::Session::events`] using [`SessionEvent::reclaim_request`].

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use futures::Stream;
use parking_lot::Mutex;
use tokio::sync::broadcast;

use gpu_broker_proto::v1 as pb;
use pb::session_event::Event;

use crate::lease_info::unix_ms;

/// Events kept for a subscriber that falls behind; older ones are dropped (and logged).
const EVENT_BUFFER: usize = 256;

/// Something the broker told this session, or a change of the session itself.
/// New kinds of events may be added: match with a `_` arm.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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
    /// The broker wants back a block this process retained mapped when it released
    /// ended lease `lease_id` (`ReleaseLeaseRequest.retain_mapping`): unmap it, close its
    /// descriptor, then confirm with a release of that id. Until then it stays counted to
    /// the tenant.
    DropRetained {
        /// The ended lease whose block was retained.
        lease_id: String,
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
    /// Your compute turn is past its quantum and others wait: release it before
    /// `deadline` or it is taken.
    YieldRequested {
        /// The turn.
        turn_id: String,
        /// Its device.
        device: u32,
        /// When the broker takes it.
        deadline: SystemTime,
    },
    /// Your compute turn was taken (held past quantum + grace while others waited).
    TurnRevoked {
        /// The turn.
        turn_id: String,
        /// Its device.
        device: u32,
        /// Why.
        reason: String,
    },
    /// A device this session holds leases on was marked unhealthy (Xid or ECC errors,
    /// it stopped answering, or an operator said so): nothing new is granted there, and
    /// the memory of the leases there may be unreliable. Checkpoint and release them.
    DeviceUnhealthy {
        /// Device index.
        device: u32,
        /// Device UUID.
        uuid: String,
        /// Why.
        reason: String,
    },
    /// (Reconnecting sessions only.) The session stream broke or ended: the broker has
    /// ended (or lost, if it died) the session `session_id` and every lease it held.
    /// The client is re-opening a session with backoff; `Reconnected` follows on
    /// success (or `Resumed`, when the broker kept the session), `Closed` if it gives up.
    /// Calls made meanwhile fail with `UNAVAILABLE`, unless the session is being resumed
    /// (a broker with a keeper gave it a resume secret): then they wait and go through.
    Disconnected {
        /// The session that was lost.
        session_id: String,
        /// What happened (connection lost, broker shut down, ...).
        reason: String,
    },
    /// (Reconnecting sessions only.) A new session replaces the lost one:
    /// [`crate::Session::id`] now returns `new_session_id`. The broker does not keep
    /// leases across sessions: every lease of the old session is gone, and its
    /// [`crate::Lease`] objects are dead (`release()` returns
    /// [`crate::ClientError::LeaseLost`] and sends nothing; dropping them sends nothing).
    Reconnected {
        /// The session that was lost.
        old_session_id: String,
        /// The session that replaces it.
        new_session_id: String,
        /// Ids of the leases that were held through [`crate::Lease`] objects of the old
        /// session (not released or detached), in acquisition order.
        lost_leases: Vec<String>,
    },
    /// (Reconnecting sessions only.) The broker restarted and kept this session (it runs
    /// with a keeper): the session and its leases are the same (same ids, same memory,
    /// mappings stay valid), [`crate::Session::id`] is unchanged. Calls made while it
    /// was away waited for this and went on.
    Resumed {
        /// The session, resumed.
        session_id: String,
        /// Leases held through [`crate::Lease`] objects that the broker kept.
        kept_leases: Vec<String>,
        /// Leases held through [`crate::Lease`] objects that the broker no longer has
        /// (lost: as in [`SessionEvent::Reconnected`]).
        lost_leases: Vec<String>,
    },
    /// The session is over for good: the stream ended (without reconnection: broker
    /// closed it or connection lost; with it: re-opening was refused for good, e.g.
    /// token revoked or tenant deleted, or it gave up), or the session was closed or
    /// dropped here. Always the last event.
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
            Event::YieldRequested(y) => Some(SessionEvent::YieldRequested {
                turn_id: y.turn_id,
                device: y.device,
                deadline: unix_ms(y.deadline_unix_ms),
            }),
            Event::TurnRevoked(t) => Some(SessionEvent::TurnRevoked {
                turn_id: t.turn_id,
                device: t.device,
                reason: t.reason,
            }),
            Event::DeviceUnhealthy(d) => Some(SessionEvent::DeviceUnhealthy {
                device: d.device,
                uuid: d.uuid,
                reason: d.reason,
            }),
            Event::DropRetained(d) => Some(SessionEvent::DropRetained {
                lease_id: d.lease_id,
            }),
            Event::Opened(_) | Event::Heartbeat(_) | Event::Resumed(_) => None,
        }
    }

    /// True for [`SessionEvent::Closed`].
    pub fn is_closed(&self) -> bool {
        matches!(self, SessionEvent::Closed { .. })
    }

    /// The request of a [`SessionEvent::ReclaimRequested`], `None` for other events.
    pub fn reclaim_request(&self) -> Option<ReclaimRequest> {
        match self {
            SessionEvent::ReclaimRequested {
                lease_id,
                bytes,
                deadline,
                reason,
            } => Some(ReclaimRequest {
                lease_id: lease_id.clone(),
                bytes: *bytes,
                deadline: *deadline,
                reason: reason.clone(),
            }),
            _ => None,
        }
    }
}

/// The broker wants a lease back (a [`SessionEvent::ReclaimRequested`]): release it
/// ([`crate::Lease::release`], after closing its mappings) before `deadline`, or it is
/// revoked and its memory quarantined until this process lets go of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReclaimRequest {
    /// The lease to give back.
    pub lease_id: String,
    /// Bytes the broker wants back.
    pub bytes: u64,
    /// When the broker stops asking and revokes.
    pub deadline: SystemTime,
    /// Why (e.g. a higher-priority tenant is waiting).
    pub reason: String,
}

impl ReclaimRequest {
    /// Time left until the deadline (zero once it passed).
    pub fn time_left(&self) -> Duration {
        self.deadline
            .duration_since(SystemTime::now())
            .unwrap_or_default()
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

    pub(crate) fn publish(&self, event: SessionEvent) {
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
