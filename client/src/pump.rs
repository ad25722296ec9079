//! The stream/event pump: reads one session stream (after `opened`) until it ends,
//! turning each message into a [`SessionEvent`] for the session's [`EventHub`], while
//! sending `Keepalive` every third of the broker's keepalive timeout. Says why the stream
//! stopped ([`StreamEnd`]); what happens next (close, or reconnect) is the supervisor's
//! decision (`reconnect.rs`).

use std::time::Duration;

use tokio::time::{interval_at, Instant, MissedTickBehavior};

use gpu_broker_proto::v1 as pb;

use crate::client::Client;
use crate::error::{ClientError, Code};
use crate::events::{EventHub, SessionEvent};

/// Why one session stream stopped.
#[derive(Debug)]
pub(crate) enum StreamEnd {
    /// The broker ended the stream (it ended the session); `shutting_down` when it
    /// had sent `ShuttingDown` first.
    Ended {
        /// A `ShuttingDown` event came before the end.
        shutting_down: bool,
    },
    /// The stream failed (connection lost, broker killed, ...).
    Broken {
        /// What the transport said.
        error: ClientError,
        /// A `ShuttingDown` event came before.
        shutting_down: bool,
    },
    /// A keepalive was refused in a way that means the session is gone (`NOT_FOUND`,
    /// `UNAUTHENTICATED`, `PERMISSION_DENIED`); only when `end_on_rejected_keepalive`.
    Rejected(ClientError),
    /// Nothing arrived for this long (only with an idle timeout).
    Idle(Duration),
}

impl StreamEnd {
    /// The reason `Closed` carries when the session does not reconnect.
    pub(crate) fn closed_reason(&self) -> Option<String> {
        match self {
            StreamEnd::Ended { .. } => None,
            StreamEnd::Broken { error: e, .. } | StreamEnd::Rejected(e) => Some(e.to_string()),
            StreamEnd::Idle(_) => Some(self.to_string()),
        }
    }
}

impl std::fmt::Display for StreamEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamEnd::Ended { shutting_down } => {
                if *shutting_down {
                    f.write_str("the broker shut down")
                } else {
                    f.write_str("the broker ended the session")
                }
            }
            StreamEnd::Broken {
                error,
                shutting_down,
            } => {
                if *shutting_down {
                    f.write_str("the broker shut down; ")?;
                }
                write!(f, "session stream broke: {error}")
            }
            StreamEnd::Rejected(e) => write!(f, "the broker no longer knows the session: {e}"),
            StreamEnd::Idle(t) => write!(f, "no message from the broker for {t:?}"),
        }
    }
}

/// Reads one session stream until it ends, publishing events, while sending a
/// keepalive every `keepalive` for `session_id`. With `end_on_rejected_keepalive`, a
/// keepalive refused with `NOT_FOUND`, `UNAUTHENTICATED` or `PERMISSION_DENIED` ends
/// it (the session or its token is gone); otherwise failed keepalives are only logged.
/// With `idle_timeout`, a stream silent for that long counts as broken (the broker
/// sends a heartbeat every 5 s).
pub(crate) async fn pump(
    stream: &mut tonic::Streaming<pb::SessionEvent>,
    hub: &EventHub,
    client: &Client,
    session_id: &str,
    keepalive: Option<Duration>,
    end_on_rejected_keepalive: bool,
    idle_timeout: Option<Duration>,
) -> StreamEnd {
    let read = async {
        let mut shutting_down = false;
        loop {
            let next = match idle_timeout {
                None => stream.message().await,
                Some(limit) => match tokio::time::timeout(limit, stream.message()).await {
                    Ok(next) => next,
                    Err(_) => return StreamEnd::Idle(limit),
                },
            };
            match next {
                Ok(Some(message)) => {
                    if let Some(event) = SessionEvent::from_proto(message.event) {
                        tracing::debug!(session_id, ?event, "session event");
                        shutting_down |= matches!(event, SessionEvent::ShuttingDown { .. });
                        hub.publish(event);
                    }
                }
                Ok(None) => return StreamEnd::Ended { shutting_down },
                Err(status) => {
                    return StreamEnd::Broken {
                        error: ClientError::from(status),
                        shutting_down,
                    }
                }
            }
        }
    };
    let keep = async {
        let Some(period) = keepalive else {
            return std::future::pending::<StreamEnd>().await;
        };
        let period = period.max(Duration::from_millis(1));
        let mut ticks = interval_at(Instant::now() + period, period);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            match client.keepalive(session_id).await {
                Ok(()) => {}
                Err(e)
                    if end_on_rejected_keepalive
                        && matches!(
                            e.code(),
                            Code::NotFound | Code::Unauthenticated | Code::PermissionDenied
                        ) =>
                {
                    return StreamEnd::Rejected(e);
                }
                Err(e) => tracing::warn!(session_id, error = %e, "keepalive failed"),
            }
        }
    };
    tokio::select! {
        end = read => end,
        end = keep => end,
    }
}
