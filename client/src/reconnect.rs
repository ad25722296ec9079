//! Automatic reconnection of a [`Session`](crate::Session) (opt-in, see
//! [`SessionBuilder::reconnect`](crate::SessionBuilder::reconnect)). When the session
//! stream breaks (connection lost, broker killed or restarted, broker shut down after
//! `ShuttingDown`, the broker ended the session, no heartbeat for the idle timeout), the
//! session's background task publishes [`SessionEvent::Disconnected`] and first tries to
//! resume the same session with its resume secret (a broker restarted with a keeper kept
//! it and its leases: [`SessionEvent::Resumed`], leases and mappings stay valid, calls
//! made meanwhile waited). When the broker does not have it, it re-opens a session under
//! the same name with exponential [`Backoff`] and jitter, and publishes
//! [`SessionEvent::Reconnected`] with the ids of the leases that died with the old
//! session. A permanent
//! refusal (`UNAUTHENTICATED`, `PERMISSION_DENIED`, `NOT_FOUND`: token revoked, tenant
//! deleted; `INVALID_ARGUMENT`) or the optional give-up limit ends it with
//! [`SessionEvent::Closed`]. The supervisor is a loop over one state enum (`Link`:
//! connected, reconnecting, closed); the stream itself is read by the pump (`pump.rs`).
//!
//! [`SessionEvent::Disconnected`]: crate::SessionEvent::Disconnected
//! [`SessionEvent::Reconnected`]: crate::SessionEvent::Reconnected
//! [`SessionEvent::Resumed`]: crate::SessionEvent::Resumed
//! [`SessionEvent::Closed`]: crate::SessionEvent::Closed

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use gpu_broker_proto::v1 as pb;

use crate::client::Client;
use crate::error::{ClientError, Code};
use crate::events::{EventHub, SessionEvent};
use crate::generation::Generations;
use crate::handshake::{open_stream, ResumeAsk};
use crate::pump;

/// Shortest delay between two attempts, whatever the settings (no busy loop).
const MIN_DELAY: Duration = Duration::from_millis(1);

/// Exponential backoff with jitter: before attempt `n` (0-based) wait
/// `min(max, initial * factor^n)`, reduced by a random fraction of up to `jitter`
/// (`jitter = 0`: exact delays; `0.5`: uniformly within the upper half; `1`: "full
/// jitter", anywhere in `[0, delay]`), and never less than 1 ms. The jitter spreads
/// the reconnects of many workers after a broker restart.
///
/// ```
/// use std::time::Duration;
/// use gpu_broker_client::Backoff;
///
/// let b = Backoff { initial: Duration::from_millis(100), max: Duration::from_secs(5), factor: 2.0, jitter: 0.0 };
/// assert_eq!(b.delay(0), Duration::from_millis(100));
/// assert_eq!(b.delay(3), Duration::from_millis(800));
/// assert_eq!(b.delay(30), Duration::from_secs(5));
/// assert_eq!(Backoff::default(), Backoff::new(Duration::from_millis(100), Duration::from_secs(5)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Delay before the first attempt.
    pub initial: Duration,
    /// Longest delay between attempts.
    pub max: Duration,
    /// Growth per attempt (values below 1, and NaN, count as 1).
    pub factor: f64,
    /// Largest fraction (0 to 1, clamped) a delay is randomly reduced by.
    pub jitter: f64,
}

impl Default for Backoff {
    /// 100 ms doubling up to 5 s, jitter 0.3.
    fn default() -> Self {
        Backoff::new(Duration::from_millis(100), Duration::from_secs(5))
    }
}

impl Backoff {
    /// `initial` doubling up to `max`, jitter 0.3.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Backoff {
            initial,
            max,
            factor: 2.0,
            jitter: 0.3,
        }
    }

    /// Sets the growth per attempt.
    pub fn factor(mut self, factor: f64) -> Self {
        self.factor = factor;
        self
    }

    /// Sets the jitter fraction.
    pub fn jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }

    /// The delay before attempt `attempt` (0-based) without jitter:
    /// `min(max, initial * factor^attempt)`, at least 1 ms.
    pub fn delay(&self, attempt: u32) -> Duration {
        let max = self.max.max(MIN_DELAY);
        let factor = if self.factor >= 1.0 { self.factor } else { 1.0 };
        let exp = i32::try_from(attempt).unwrap_or(i32::MAX);
        let secs = self.initial.as_secs_f64() * factor.powi(exp);
        let delay = Duration::try_from_secs_f64(secs).unwrap_or(max);
        delay.clamp(MIN_DELAY, max)
    }

    /// [`Backoff::delay`] reduced by `jitter * unit` of itself, for `unit` in `[0, 1]`
    /// (a random draw; clamped), at least 1 ms.
    pub fn delay_with(&self, attempt: u32, unit: f64) -> Duration {
        let delay = self.delay(attempt);
        let jitter = if self.jitter.is_nan() {
            0.0
        } else {
            self.jitter.clamp(0.0, 1.0)
        };
        let unit = if unit.is_nan() {
            0.0
        } else {
            unit.clamp(0.0, 1.0)
        };
        let scaled = delay.as_secs_f64() * (1.0 - jitter * unit);
        Duration::try_from_secs_f64(scaled)
            .map_or(delay, |d| d.min(delay))
            .max(MIN_DELAY)
    }

    /// [`Backoff::delay_with`] a random draw: what the session waits before attempt
    /// `attempt`.
    pub fn jittered(&self, attempt: u32) -> Duration {
        self.delay_with(attempt, random_unit())
    }
}

/// A uniform draw from `[0, 1)`. Not cryptographic: std's randomly keyed hasher over
/// a counter, enough to de-synchronize workers.
fn random_unit() -> f64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.write_u32(std::process::id());
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// How a session reconnects (built by [`crate::SessionBuilder`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ReconnectPolicy {
    pub(crate) backoff: Backoff,
    /// Stop (with `Closed`) after trying for this long without success.
    pub(crate) give_up_after: Option<Duration>,
    /// Treat a stream with no message (the broker sends a heartbeat every 5 s) for this
    /// long as broken.
    pub(crate) idle_timeout: Option<Duration>,
}

/// Longest one re-open attempt may take (a broker that accepts the connection but
/// does not answer must not stall reconnection).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(15);

/// Default for [`ReconnectPolicy::idle_timeout`]: six missed heartbeats.
pub(crate) const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether a failed re-open is final: the broker will not take this token or tenant
/// again (revoked token, deleted tenant, admin token used as a tenant) or the request
/// itself is refused. Everything else (unavailable, transport errors, ...) is retried.
pub fn is_permanent(err: &ClientError) -> bool {
    matches!(
        err.code(),
        Code::Unauthenticated | Code::PermissionDenied | Code::NotFound | Code::InvalidArgument
    )
}

/// Where a session's background task is: the reconnect supervisor's state.
enum Link {
    /// Pumping the stream of the current broker session.
    Connected(tonic::Streaming<pb::SessionEvent>),
    /// The broker session was lost; re-opening one (one attempt per step).
    Reconnecting(Lost),
    /// Over for good: `Closed` goes out with this reason.
    Closed(Option<String>),
}

/// A lost broker session being resumed or replaced.
struct Lost {
    /// Its session id (for `Reconnected`).
    session_id: String,
    /// Set while it may still be resumed.
    resume: Option<ResumeAsk>,
    /// Ids of the leases that died with it (once it cannot be resumed).
    lost_leases: Vec<String>,
    /// When it was lost (for the give-up limit).
    since: Instant,
    policy: ReconnectPolicy,
}

/// The session's background task: without a policy, pumps the stream once and closes
/// the hub when it ends; with one, reconnects until closed, aborted, refused for good
/// or out of time. Moves between the [`Link`] states and nothing else.
struct Supervisor {
    hub: Arc<EventHub>,
    client: Client,
    name: String,
    generations: Arc<Generations>,
    policy: Option<ReconnectPolicy>,
    /// Consecutive failed attempts; reset once a connection stayed up for
    /// `backoff.max`, so a broker that accepts sessions and drops them at once is not
    /// hammered.
    attempt: u32,
}

/// Runs a session's background task on the stream of its first broker session.
pub(crate) async fn supervise(
    stream: tonic::Streaming<pb::SessionEvent>,
    hub: Arc<EventHub>,
    client: Client,
    name: String,
    generations: Arc<Generations>,
    policy: Option<ReconnectPolicy>,
) {
    let mut supervisor = Supervisor {
        hub,
        client,
        name,
        generations,
        policy,
        attempt: 0,
    };
    let mut link = Link::Connected(stream);
    loop {
        link = match link {
            Link::Connected(stream) => supervisor.connected(stream).await,
            Link::Reconnecting(lost) => supervisor.reconnecting(lost).await,
            Link::Closed(reason) => {
                supervisor.hub.close(reason);
                return;
            }
        };
    }
}

impl Supervisor {
    /// Pumps `stream` until it ends; then closes, or starts reconnecting.
    async fn connected(&mut self, mut stream: tonic::Streaming<pb::SessionEvent>) -> Link {
        let current = self.generations.current();
        let id = current.id();
        let connected_at = Instant::now();
        let end = pump::pump(
            &mut stream,
            &self.hub,
            &self.client,
            id,
            current.opened().keepalive_timeout.map(|t| t / 3),
            self.policy.is_some(),
            self.policy.and_then(|p| p.idle_timeout),
        )
        .await;
        // Dropping the stream ends the session on the broker if it still has it.
        drop(stream);
        let Some(policy) = self.policy else {
            tracing::debug!(session_id = id, ?end, "session stream ended");
            return Link::Closed(end.closed_reason());
        };
        let reason = end.to_string();
        let secret = current.opened().resume_secret.clone();
        let (resume, lost_leases) = if secret.is_empty() {
            (None, self.generations.disconnect())
        } else {
            let (held, let_go) = self.generations.pause();
            (
                Some(ResumeAsk {
                    session_id: id.to_string(),
                    secret,
                    held,
                    let_go,
                }),
                Vec::new(),
            )
        };
        tracing::warn!(
            session_id = id,
            reason,
            resuming = resume.is_some(),
            "session lost; reconnecting"
        );
        self.hub.publish(SessionEvent::Disconnected {
            session_id: id.to_string(),
            reason,
        });
        if connected_at.elapsed() >= policy.backoff.max {
            self.attempt = 0;
        }
        Link::Reconnecting(Lost {
            session_id: id.to_string(),
            resume,
            lost_leases,
            since: Instant::now(),
            policy,
        })
    }

    /// One re-open attempt after its backoff delay: connected, still reconnecting, or
    /// closed (refused for good, or the give-up limit would pass before it).
    async fn reconnecting(&mut self, mut lost: Lost) -> Link {
        let policy = lost.policy;
        let name = &self.name;
        let delay = policy.backoff.jittered(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        let attempt = self.attempt;
        if let Some(limit) = policy.give_up_after {
            if lost.since.elapsed() + delay > limit {
                self.generations.disconnect();
                return Link::Closed(Some(format!(
                    "gave up reconnecting session {name:?} after {:?} ({attempt} attempts)",
                    lost.since.elapsed()
                )));
            }
        }
        tokio::time::sleep(delay).await;
        let opened = tokio::time::timeout(
            ATTEMPT_TIMEOUT,
            open_stream(
                &self.client,
                name,
                lost.resume.as_mut().map(|r| {
                    // As things stand at this try: releases go on, or end, meanwhile.
                    (r.held, r.let_go) = self.generations.named();
                    &*r
                }),
            ),
        )
        .await
        .unwrap_or_else(|_| {
            Err(ClientError::Unavailable(
                format!("no `opened` event within {ATTEMPT_TIMEOUT:?}").into(),
            ))
        });
        match opened {
            Ok((stream, _, Some(resumed))) => {
                let (kept, lost_leases) = self.generations.resumed(&resumed.ended);
                tracing::info!(
                    session_id = lost.session_id,
                    kept = kept.len(),
                    lost = lost_leases.len(),
                    attempt,
                    "session resumed"
                );
                self.attempt = 0;
                self.hub.publish(SessionEvent::Resumed {
                    session_id: lost.session_id,
                    kept_leases: kept,
                    lost_leases,
                });
                Link::Connected(stream)
            }
            Err(e) if lost.resume.is_some() && is_permanent(&e) => {
                // The broker does not have it (restarted without a keeper, or the
                // session ended meanwhile): its leases are gone; open a new one.
                tracing::info!(session = name, error = %e, "session cannot be resumed; opening a new one");
                lost.resume = None;
                lost.lost_leases = self.generations.disconnect();
                self.attempt = 0;
                Link::Reconnecting(lost)
            }
            Ok((stream, opened, None)) => {
                if lost.resume.take().is_some() {
                    // A broker that knows no resume opened a new session.
                    lost.lost_leases = self.generations.disconnect();
                }
                let new_id = opened.id.clone();
                self.generations.connected(opened);
                tracing::info!(
                    old_session_id = lost.session_id,
                    new_session_id = new_id,
                    attempt,
                    "session re-opened"
                );
                self.hub.publish(SessionEvent::Reconnected {
                    old_session_id: lost.session_id,
                    new_session_id: new_id,
                    lost_leases: lost.lost_leases,
                });
                Link::Connected(stream)
            }
            Err(e) if is_permanent(&e) => {
                tracing::warn!(session = name, error = %e, "reconnect refused for good");
                Link::Closed(Some(format!("cannot re-open session {name:?}: {e}")))
            }
            Err(e) => {
                tracing::debug!(session = name, attempt, error = %e, "reconnect attempt failed");
                Link::Reconnecting(lost)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn grows_exponentially_up_to_max() {
        let b = Backoff::new(ms(100), ms(5000)).jitter(0.0);
        let delays: Vec<_> = (0..8).map(|n| b.delay(n)).collect();
        assert_eq!(
            delays,
            [
                ms(100),
                ms(200),
                ms(400),
                ms(800),
                ms(1600),
                ms(3200),
                ms(5000),
                ms(5000)
            ]
        );
        assert_eq!(b.delay(u32::MAX), ms(5000));
        assert_eq!(b.jittered(2), ms(400));
        let triple = b.factor(3.0);
        assert_eq!(triple.delay(2), ms(900));
    }

    #[test]
    fn odd_settings_stay_sane() {
        // factor < 1 (or NaN) counts as 1: constant delay.
        assert_eq!(Backoff::new(ms(50), ms(500)).factor(0.5).delay(10), ms(50));
        assert_eq!(
            Backoff::new(ms(50), ms(500)).factor(f64::NAN).delay(10),
            ms(50)
        );
        // Infinite growth is capped by max.
        let b = Backoff::new(ms(50), ms(500)).factor(f64::INFINITY);
        assert_eq!(b.delay(0), ms(50));
        assert_eq!(b.delay(1), ms(500));
        // Zero initial or max never gives a zero delay (no busy loop).
        assert_eq!(Backoff::new(Duration::ZERO, ms(500)).delay(3), MIN_DELAY);
        assert_eq!(Backoff::new(ms(10), Duration::ZERO).delay(3), MIN_DELAY);
        // initial above max is capped.
        assert_eq!(Backoff::new(ms(900), ms(500)).delay(0), ms(500));
        // Huge durations do not overflow.
        let b = Backoff::new(Duration::MAX, Duration::MAX);
        assert_eq!(b.delay(5), Duration::MAX);
    }

    #[test]
    fn jitter_only_shortens_within_its_fraction() {
        let b = Backoff::new(ms(1000), ms(1000)).jitter(0.25);
        assert_eq!(b.delay_with(0, 0.0), ms(1000));
        assert_eq!(b.delay_with(0, 1.0), ms(750));
        assert_eq!(b.delay_with(0, 0.5), ms(875));
        // Out-of-range inputs are clamped.
        assert_eq!(b.delay_with(0, 7.0), ms(750));
        assert_eq!(b.delay_with(0, -1.0), ms(1000));
        assert_eq!(b.delay_with(0, f64::NAN), ms(1000));
        assert_eq!(b.jitter(3.0).delay_with(0, 1.0), MIN_DELAY);
        assert_eq!(b.jitter(f64::NAN).delay_with(0, 1.0), ms(1000));
        for attempt in 0..20 {
            let d = b.jittered(attempt);
            assert!(d >= ms(750) && d <= ms(1000), "{d:?}");
        }
    }

    #[test]
    fn random_draws_are_spread() {
        let draws: Vec<f64> = (0..1000).map(|_| random_unit()).collect();
        assert!(draws.iter().all(|u| (0.0..1.0).contains(u)));
        let low = draws.iter().filter(|u| **u < 0.5).count();
        assert!((350..650).contains(&low), "{low} of 1000 below 0.5");
        let b = Backoff::new(ms(1000), ms(1000)).jitter(1.0);
        let distinct: std::collections::HashSet<_> = (0..50).map(|_| b.jittered(0)).collect();
        assert!(distinct.len() > 40, "jitter draws repeat: {distinct:?}");
    }

    #[test]
    fn permanent_errors() {
        for code in [
            Code::Unauthenticated,
            Code::PermissionDenied,
            Code::NotFound,
            Code::InvalidArgument,
        ] {
            assert!(is_permanent(&ClientError::from(tonic::Status::new(
                code, "x"
            ))));
        }
        for code in [
            Code::Unavailable,
            Code::Unknown,
            Code::Internal,
            Code::Cancelled,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
        ] {
            assert!(!is_permanent(&ClientError::from(tonic::Status::new(
                code, "x"
            ))));
        }
        assert!(!is_permanent(&ClientError::Transport("refused".into())));
        assert!(!is_permanent(&ClientError::Protocol("odd".into())));
    }
}
