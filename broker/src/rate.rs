//! Per-tenant RPC rate limits: one token bucket per tenant (`--tenant-rpc-rate` calls a
//! second, refilled continuously, holding at most `--tenant-rpc-burst`), so one tenant's
//! tight loop cannot crowd out the others' admissions. A call over the limit is
//! `RESOURCE_EXHAUSTED` with the wait in the message and in the standard gRPC retry hint
//! (`grpc-retry-pushback-ms` trailer). Admin and node-wide read tokens are not limited.
//! Checked in the gate (`gate.rs`), before the services see the call, and by the lease
//! lines (`fd/lease_line.rs`), which give a call back when they leave it to gRPC.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The limits. `rate == 0`: off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateConfig {
    /// Calls per second per tenant.
    pub rate: f64,
    /// Most calls in a burst (at least 1).
    pub burst: f64,
}

/// Off, with the burst `--tenant-rpc-burst` defaults to (`defaults.rs`) for when a rate is
/// set.
impl Default for RateConfig {
    fn default() -> Self {
        RateConfig {
            rate: crate::defaults::TENANT_RPC_RATE,
            burst: crate::defaults::TENANT_RPC_BURST,
        }
    }
}

impl RateConfig {
    pub fn is_off(&self) -> bool {
        self.rate <= 0.0
    }
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Most tenants tracked; beyond it idle buckets (full again) are dropped.
const MAX_BUCKETS: usize = 65_536;

/// Every tenant's bucket.
#[derive(Debug)]
pub struct RateLimiter {
    cfg: RateConfig,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl RateLimiter {
    pub fn new(cfg: RateConfig) -> RateLimiter {
        RateLimiter {
            cfg: RateConfig {
                rate: cfg.rate,
                burst: cfg.burst.max(1.0),
            },
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one call for `tenant` at `now`; `Err(wait)`: over the limit, retry after `wait`.
    pub fn take(&self, tenant: &str, now: Instant) -> Result<(), Duration> {
        if self.cfg.is_off() {
            return Ok(());
        }
        let mut b = self.buckets.lock();
        if b.len() >= MAX_BUCKETS && !b.contains_key(tenant) {
            let (rate, burst) = (self.cfg.rate, self.cfg.burst);
            b.retain(|_, x| x.tokens + now.duration_since(x.at).as_secs_f64() * rate < burst);
        }
        let bucket = b.entry(tenant.to_string()).or_insert(Bucket {
            tokens: self.cfg.burst,
            at: now,
        });
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * self.cfg.rate).min(self.cfg.burst);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            let missing = 1.0 - bucket.tokens;
            // A very low rate gives a wait too long for a Duration: the longest one then.
            let wait =
                Duration::try_from_secs_f64(missing / self.cfg.rate).unwrap_or(Duration::MAX);
            Err(wait.max(Duration::from_millis(1)))
        }
    }

    /// Gives back a call taken for `tenant` that was not made after all (a lease line left
    /// it to gRPC, which takes its own): at most up to the burst.
    pub fn give_back(&self, tenant: &str) {
        if let Some(b) = self.buckets.lock().get_mut(tenant) {
            b.tokens = (b.tokens + 1.0).min(self.cfg.burst);
        }
    }

    /// The refusal for a call over the limit.
    pub fn refusal(&self, tenant: &str, wait: Duration) -> tonic::Status {
        let ms = wait.as_millis().max(1);
        let mut s = crate::grpc_status::status_with_details(
            tonic::Code::ResourceExhausted,
            format!(
                "tenant {tenant:?} exceeds its rate limit of {} calls/s (burst {}): retry in {ms} ms",
                self.cfg.rate, self.cfg.burst
            ),
            Some(crate::grpc_status::Reason::RateLimited),
            vec![
                ("tenant", tenant.to_string()),
                ("rate_per_second", self.cfg.rate.to_string()),
                ("burst", self.cfg.burst.to_string()),
                ("retry_after_ms", ms.to_string()),
            ],
            Some(wait),
        );
        if let Ok(v) = ms.to_string().parse() {
            s.metadata_mut().insert("grpc-retry-pushback-ms", v);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_refill_at_the_rate_and_cap_at_the_burst() {
        let l = RateLimiter::new(RateConfig {
            rate: 10.0,
            burst: 3.0,
        });
        let t0 = Instant::now();
        for _ in 0..3 {
            l.take("a", t0).unwrap();
        }
        let wait = l.take("a", t0).unwrap_err();
        assert!(
            wait > Duration::from_millis(90) && wait <= Duration::from_millis(100),
            "{wait:?}"
        );
        // Another tenant is not affected.
        l.take("b", t0).unwrap();
        // 100 ms later one call is back; a long pause refills only up to the burst.
        l.take("a", t0 + Duration::from_millis(100)).unwrap();
        assert!(l.take("a", t0 + Duration::from_millis(100)).is_err());
        let later = t0 + Duration::from_secs(60);
        for _ in 0..3 {
            l.take("a", later).unwrap();
        }
        assert!(l.take("a", later).is_err());
        let s = l.refusal("a", wait);
        assert_eq!(s.code(), tonic::Code::ResourceExhausted);
        assert!(s.message().contains("retry in"), "{}", s.message());
        assert!(s.metadata().get("grpc-retry-pushback-ms").is_some());
        use tonic_types::StatusExt;
        let info = s.get_details_error_info().expect("a reason");
        assert_eq!(info.reason, "RATE_LIMITED");
        assert_eq!(info.metadata["tenant"], "a");
        let retry = s.get_details_retry_info().expect("a retry hint");
        assert_eq!(retry.retry_delay, Some(wait));
    }

    #[test]
    fn a_tiny_rate_refuses_without_panicking() {
        // --tenant-rpc-rate accepts any finite value from 0: the wait may not fit a Duration.
        let l = RateLimiter::new(RateConfig {
            rate: 1e-300,
            burst: 1.0,
        });
        let t = Instant::now();
        l.take("a", t).unwrap();
        let wait = l.take("a", t).unwrap_err();
        assert!(wait > Duration::from_secs(86400 * 365));
        let s = l.refusal("a", wait);
        assert_eq!(s.code(), tonic::Code::ResourceExhausted);
    }

    #[test]
    fn a_call_given_back_can_be_taken_again_but_never_beyond_the_burst() {
        let l = RateLimiter::new(RateConfig {
            rate: 0.001,
            burst: 1.0,
        });
        let now = Instant::now();
        assert!(l.take("a", now).is_ok());
        assert!(l.take("a", now).is_err());
        l.give_back("a");
        assert!(l.take("a", now).is_ok());
        l.give_back("a");
        l.give_back("a");
        assert!(l.take("a", now).is_ok());
        assert!(l.take("a", now).is_err(), "one call, the burst");
        l.give_back("b");
        assert!(l.take("b", now).is_ok(), "a tenant never seen starts full");
    }

    #[test]
    fn off_admits_everything() {
        let l = RateLimiter::new(RateConfig::default());
        let t = Instant::now();
        for _ in 0..10_000 {
            l.take("a", t).unwrap();
        }
    }
}
