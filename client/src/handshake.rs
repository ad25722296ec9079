//! Opening one broker session: the `OpenSession` call and its first event (`opened`:
//! session id, tenant, broker version, keepalive timeout, peer pid), checked and turned
//! into [`Opened`]. The session handle calls it once, the reconnect supervisor once per
//! re-open; what follows `opened` on the stream belongs to the pump.

use std::time::Duration;

use gpu_broker_proto::v1 as pb;
use pb::session_event::Event;

use crate::client::Client;
use crate::error::ClientError;

/// What one `opened` event said: one broker session behind a session handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Opened {
    /// Session id the broker assigned.
    pub(crate) id: String,
    /// Tenant of the token.
    pub(crate) tenant: String,
    /// The broker's version string.
    pub(crate) broker_version: String,
    /// How long the broker keeps a quiet session (None: no timeout).
    pub(crate) keepalive_timeout: Option<Duration>,
    /// The caller's pid as the broker saw it (0 over TCP).
    pub(crate) peer_pid: u32,
    /// What resumes this session after a broker restart (empty: it cannot be resumed).
    pub(crate) resume_secret: ResumeSecret,
}

/// A session's resume secret: sent back to resume, never printed (`{:?}` shows whether
/// there is one, not what it is).
#[derive(Clone, PartialEq, Eq, Default)]
pub(crate) struct ResumeSecret(pub(crate) String);

impl ResumeSecret {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for ResumeSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_empty() {
            "none"
        } else {
            "<redacted>"
        })
    }
}

/// A request to resume a session after a broker restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResumeAsk {
    pub(crate) session_id: String,
    pub(crate) secret: ResumeSecret,
    /// The leases held on it through `Lease` objects (and those whose retaining release
    /// is under way).
    pub(crate) held: Vec<String>,
    /// The leases whose plain release is under way (unmapped, closed).
    pub(crate) let_go: Vec<String>,
}

/// What the broker said when it resumed a session.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct ResumedLeases {
    /// Leases it kept.
    pub(crate) kept: Vec<String>,
    /// Leases it kept that were not named, ended.
    pub(crate) ended: Vec<String>,
}

/// Opens one `OpenSession` stream named `name` (or resumes a session: `resume`) and reads
/// its `opened` event, and for a resumed session its `resumed` event (heartbeats before
/// them are skipped; anything else is a protocol error).
pub(crate) async fn open_stream(
    client: &Client,
    name: &str,
    resume: Option<&ResumeAsk>,
) -> Result<
    (
        tonic::Streaming<pb::SessionEvent>,
        Opened,
        Option<ResumedLeases>,
    ),
    ClientError,
> {
    let mut stream = client
        .raw()
        .open_session(pb::OpenSessionRequest {
            name: name.to_string(),
            resume_session_id: resume.map(|r| r.session_id.clone()).unwrap_or_default(),
            resume_secret: resume.map(|r| r.secret.0.clone()).unwrap_or_default(),
            held_lease_ids: resume.map(|r| r.held.clone()).unwrap_or_default(),
            let_go_lease_ids: resume.map(|r| r.let_go.clone()).unwrap_or_default(),
        })
        .await?
        .into_inner();
    let opened = loop {
        match stream.message().await? {
            None => {
                return Err(ClientError::Protocol(
                    "session stream ended before its `opened` event".into(),
                ))
            }
            Some(pb::SessionEvent {
                event: Some(Event::Opened(opened)),
            }) => break opened,
            Some(pb::SessionEvent {
                event: Some(Event::Heartbeat(_)),
            }) => continue,
            Some(other) => {
                return Err(ClientError::Protocol(format!(
                    "first session event is {other:?}, expected `opened`"
                )))
            }
        }
    };
    if opened.session_id.is_empty() {
        return Err(ClientError::Protocol(
            "`opened` event carries no session id".into(),
        ));
    }
    tracing::debug!(
        session_id = opened.session_id,
        tenant = opened.tenant,
        "session opened"
    );
    let resumed = if opened.resumed {
        let r = loop {
            match stream.message().await? {
                Some(pb::SessionEvent {
                    event: Some(Event::Resumed(r)),
                }) => break r,
                Some(pb::SessionEvent {
                    event: Some(Event::Heartbeat(_)),
                }) => continue,
                other => {
                    return Err(ClientError::Protocol(format!(
                        "a resumed session's second event is {other:?}, expected `resumed`"
                    )))
                }
            }
        };
        Some(ResumedLeases {
            kept: r.kept_lease_ids,
            ended: r.ended_lease_ids,
        })
    } else {
        None
    };
    let opened = Opened {
        keepalive_timeout: (opened.keepalive_timeout_ms > 0)
            .then(|| Duration::from_millis(opened.keepalive_timeout_ms)),
        id: opened.session_id,
        tenant: opened.tenant,
        broker_version: opened.broker_version,
        peer_pid: opened.peer_pid,
        resume_secret: ResumeSecret(opened.resume_secret),
    };
    Ok((stream, opened, resumed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_secret_is_never_printed() {
        let ask = ResumeAsk {
            session_id: "s".into(),
            secret: ResumeSecret("hunter2-secret".into()),
            held: vec![],
            let_go: vec![],
        };
        let shown = format!("{ask:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
        assert_eq!(format!("{:?}", ResumeSecret::default()), "none");
    }
}
