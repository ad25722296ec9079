//! The `OpenSession` response stream. It yields the `opened` event first, then the
//! session's events and a periodic heartbeat. When the worker goes away the transport
//! drops this stream, and its guard ends the session (releasing everything it held).

use super::convert::now_ms;
use crate::arbiter::Arbiter;
use crate::session::SessionEvent;
use futures::Stream;
use gpu_broker_proto::v1 as pb;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::Status;
use uuid::Uuid;

/// Ends the session when dropped.
struct SessionGuard {
    arb: Arc<Arbiter>,
    id: Uuid,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.arb.end_session(self.id, "session stream closed");
    }
}

/// Stream of `SessionEvent`s for one session.
pub struct EventStream {
    first: Option<pb::SessionEvent>,
    /// Sent right after the first (a resumed session's `resumed`).
    second: Option<pb::SessionEvent>,
    rx: mpsc::UnboundedReceiver<SessionEvent>,
    heartbeat: tokio::time::Interval,
    /// The session's activity mark: `poll_next` touches it without any lock.
    activity: Option<Arc<crate::session::Activity>>,
    _guard: SessionGuard,
}

impl EventStream {
    pub fn new(
        arb: Arc<Arbiter>,
        id: Uuid,
        opened: pb::SessionOpened,
        rx: mpsc::UnboundedReceiver<SessionEvent>,
        heartbeat: Duration,
    ) -> EventStream {
        let mut hb = tokio::time::interval(heartbeat);
        hb.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        EventStream {
            activity: arb.sessions().activity(id),
            first: Some(pb::SessionEvent {
                event: Some(pb::session_event::Event::Opened(opened)),
            }),
            second: None,
            rx,
            heartbeat: hb,
            _guard: SessionGuard { arb, id },
        }
    }
}

impl EventStream {
    /// The stream with `second` right after its first event.
    pub fn then(mut self, second: pb::SessionEvent) -> EventStream {
        self.second = Some(second);
        self
    }
}

fn to_proto(e: SessionEvent) -> pb::SessionEvent {
    use pb::session_event::Event;
    let event = match e {
        SessionEvent::ReclaimRequested {
            lease_id,
            bytes,
            deadline,
            reason,
        } => Event::ReclaimRequested(pb::ReclaimRequested {
            lease_id: lease_id.to_string(),
            bytes,
            deadline_unix_ms: super::convert::unix_ms(deadline),
            reason,
        }),
        SessionEvent::LeaseRevoked { lease_id, reason } => Event::LeaseRevoked(pb::LeaseRevoked {
            lease_id: lease_id.to_string(),
            reason,
        }),
        SessionEvent::ShuttingDown { reason, grace } => Event::ShuttingDown(pb::ShuttingDown {
            reason,
            grace_ms: grace.as_millis() as u64,
        }),
        SessionEvent::YieldRequested {
            turn_id,
            device,
            deadline,
        } => Event::YieldRequested(pb::YieldRequested {
            turn_id: turn_id.to_string(),
            device,
            deadline_unix_ms: super::convert::unix_ms(deadline),
        }),
        SessionEvent::TurnRevoked {
            turn_id,
            device,
            reason,
        } => Event::TurnRevoked(pb::TurnRevoked {
            turn_id: turn_id.to_string(),
            device,
            reason,
        }),
        SessionEvent::DropRetained { lease_id } => Event::DropRetained(pb::DropRetained {
            lease_id: lease_id.to_string(),
        }),
        SessionEvent::DeviceUnhealthy {
            device,
            uuid,
            reason,
        } => Event::DeviceUnhealthy(pb::DeviceUnhealthy {
            device,
            uuid,
            reason,
        }),
    };
    pb::SessionEvent { event: Some(event) }
}

impl Stream for EventStream {
    type Item = Result<pb::SessionEvent, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(first) = self.first.take() {
            // Consume the immediate first tick so heartbeats start one period later.
            let _ = self.heartbeat.poll_tick(cx);
            return Poll::Ready(Some(Ok(first)));
        }
        if let Some(second) = self.second.take() {
            return Poll::Ready(Some(Ok(second)));
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(e)) => return Poll::Ready(Some(Ok(to_proto(e)))),
            // The broker ended the session: end the stream.
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => {}
        }
        if self.heartbeat.poll_tick(cx).is_ready() {
            // The transport took our last event: the worker's connection is alive.
            if let Some(a) = &self.activity {
                a.touch();
            }
            return Poll::Ready(Some(Ok(pb::SessionEvent {
                event: Some(pb::session_event::Event::Heartbeat(pb::Heartbeat {
                    unix_ms: now_ms(),
                })),
            })));
        }
        Poll::Pending
    }
}
