//! Kubernetes ServiceAccount tokens as workers' credentials (off unless
//! `--token-review-audience` is given). A bearer token that is none of the broker's and is
//! shaped like a JWT is sent to the API server's TokenReview (`authentication.k8s.io/v1`,
//! with the audience); once accepted, its ServiceAccount's namespace names the tenant (the
//! config file's `namespaces`, `tenants_config.rs`) and the token acts as a worker token of
//! that tenant (`Authenticator::add_reviewed`) until its own expiry.
//!
//! A review is trusted for the cache time (`--token-review-cache`); the next call after it
//! asks again, so a deleted pod or ServiceAccount (whose tokens the API server then
//! refuses) loses the broker too, its sessions ending on the next sweep. A refusal is
//! remembered as long, so bad tokens cost one API call per cache time. While the API server
//! does not answer, a token it accepted before keeps working and a new one is
//! `UNAVAILABLE`, as is one past the reviews under way at once (64) or whose review takes
//! longer than 10 s. The token's `exp` is read without checking its signature (the API
//! server checks it): only to refuse an expired token without a call and to end the
//! acceptance when the token expires.

use crate::auth::{hash_token, token_id, AuthError, Authenticator, Principal, Scope, TokenEntry};
use base64::Engine;
use dashmap::DashMap;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::{Api, PostParams};
use std::time::{Duration, Instant, SystemTime};

/// The longest token sent for review (projected tokens are ~1 KiB).
const MAX_TOKEN_BYTES: usize = 16 << 10;
/// Remembered reviews past which the stale ones are dropped.
const MAX_REMEMBERED: usize = 10_000;
/// Reviews under way at once: more (a flood of made-up tokens) are `UNAVAILABLE` at once
/// rather than passed on to the API server.
const MAX_IN_FLIGHT: usize = 64;
/// The longest a call waits for the API server's answer.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(10);

/// Asks the API server about ServiceAccount tokens, and remembers its answers briefly.
pub struct TokenReviewer {
    api: Api<TokenReview>,
    audience: String,
    cache: Duration,
    /// Token hash -> when the API server last accepted it.
    accepted: DashMap<[u8; 32], Instant>,
    /// Token hash -> when it was refused, and why.
    refused: DashMap<[u8; 32], (Instant, AuthError)>,
    in_flight: tokio::sync::Semaphore,
}

/// Whether `token` may be a ServiceAccount token (a JWT: three base64url parts, the
/// header a JSON object); the broker's own tokens never are.
pub fn looks_like_jwt(token: &str) -> bool {
    token.len() <= MAX_TOKEN_BYTES
        && token.starts_with("eyJ")
        && token.split('.').count() == 3
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'='))
}

/// The token's `exp` claim in ms since the epoch, if it has one.
fn expiry_ms(token: &str) -> Option<i64> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    claims["exp"].as_i64()?.checked_mul(1000)
}

impl std::fmt::Debug for TokenReviewer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenReviewer")
            .field("audience", &self.audience)
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

impl TokenReviewer {
    /// Reviews through `client` for `audience`, trusting each answer for `cache`.
    pub fn new(client: kube::Client, audience: &str, cache: Duration) -> TokenReviewer {
        TokenReviewer {
            api: Api::all(client),
            audience: audience.to_string(),
            cache,
            accepted: DashMap::new(),
            refused: DashMap::new(),
            in_flight: tokio::sync::Semaphore::new(MAX_IN_FLIGHT),
        }
    }

    /// Whether the API server accepted the token of `hash` within the cache time.
    pub fn fresh(&self, hash: &[u8; 32]) -> bool {
        self.accepted
            .get(hash)
            .is_some_and(|t| t.elapsed() < self.cache)
    }

    /// The principal of ServiceAccount `token`, asking the API server unless a refusal of
    /// it is remembered; an accepted token is added to `auth` (see the module doc).
    pub async fn review(&self, auth: &Authenticator, token: &str) -> Result<Principal, AuthError> {
        let hash = hash_token(token);
        if let Some(r) = self.refused.get(&hash) {
            if r.0.elapsed() < self.cache {
                return Err(r.1.clone());
            }
        }
        let now = crate::units::unix_ms(SystemTime::now());
        let expires = expiry_ms(token);
        if let Some(exp) = expires.filter(|exp| *exp <= now) {
            return self.refuse(
                auth,
                hash,
                AuthError::Expired {
                    token_id: token_id(&hash),
                    name: "Kubernetes ServiceAccount token".into(),
                    expired_at: exp,
                },
            );
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_string(),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..Default::default()
        };
        let asked = match self.in_flight.try_acquire() {
            Ok(_permit) => {
                let pp = PostParams::default();
                let call = self.api.create(&pp, &review);
                match tokio::time::timeout(REVIEW_TIMEOUT, call).await {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(_) => Err(format!("no answer within {REVIEW_TIMEOUT:?}")),
                }
            }
            Err(_) => Err(format!("{MAX_IN_FLIGHT} reviews are under way already")),
        };
        let status = match asked {
            Ok(r) => r.status.unwrap_or_default(),
            Err(e) => {
                tracing::warn!(error = %e, "TokenReview failed");
                // Accepted before: still accepted (asked again on the next call).
                if let Ok(p) = auth.authenticate(token) {
                    if auth.is_reviewed(&hash) {
                        return Ok(p);
                    }
                }
                return Err(AuthError::ReviewUnavailable { why: e });
            }
        };
        if !status.authenticated.unwrap_or(false) {
            let why = status
                .error
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "not authenticated".into());
            return self.refuse(auth, hash, AuthError::ServiceAccountRefused { why });
        }
        if let Some(audiences) = status.audiences.filter(|a| !a.is_empty()) {
            if !audiences.contains(&self.audience) {
                let why = format!("it is for audiences {audiences:?}, not {:?}", self.audience);
                return self.refuse(auth, hash, AuthError::ServiceAccountRefused { why });
            }
        }
        let username = status.user.and_then(|u| u.username).unwrap_or_default();
        let account = username
            .strip_prefix("system:serviceaccount:")
            .and_then(|rest| rest.split_once(':'));
        let Some((namespace, name)) = account else {
            let why = format!("{username:?} is no ServiceAccount");
            return self.refuse(auth, hash, AuthError::ServiceAccountRefused { why });
        };
        let Some(tenant) = auth.tenant_of_namespace(namespace) else {
            let e = AuthError::NoTenantForNamespace {
                namespace: namespace.to_string(),
                account: name.to_string(),
            };
            return self.refuse(auth, hash, e);
        };
        auth.add_reviewed(TokenEntry {
            token_id: token_id(&hash),
            tenant: tenant.clone(),
            hash,
            description: "Kubernetes ServiceAccount token (TokenReview)".into(),
            created_unix_ms: now,
            name: format!("serviceaccount:{namespace}/{name}"),
            scope: Scope::Worker,
            expires_unix_ms: expires,
        });
        self.refused.remove(&hash);
        self.remember(&self.accepted, hash, Instant::now());
        tracing::debug!(
            namespace,
            account = name,
            tenant,
            "ServiceAccount token accepted"
        );
        auth.authenticate(token)
    }

    fn refuse(
        &self,
        auth: &Authenticator,
        hash: [u8; 32],
        e: AuthError,
    ) -> Result<Principal, AuthError> {
        auth.forget_reviewed(&hash);
        self.accepted.remove(&hash);
        self.remember(&self.refused, hash, (Instant::now(), e.clone()));
        Err(e)
    }

    /// Inserts into a bounded map: past [`MAX_REMEMBERED`], answers older than the cache
    /// time go first.
    fn remember<V>(&self, map: &DashMap<[u8; 32], V>, hash: [u8; 32], v: V)
    where
        V: Stamped,
    {
        if map.len() >= MAX_REMEMBERED {
            map.retain(|_, v| v.at().elapsed() < self.cache);
        }
        map.insert(hash, v);
    }
}

/// An answer with its time.
trait Stamped {
    fn at(&self) -> Instant;
}

impl Stamped for Instant {
    fn at(&self) -> Instant {
        *self
    }
}

impl Stamped for (Instant, AuthError) {
    fn at(&self) -> Instant {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jwt(claims: &str) -> String {
        let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        format!("{}.{}.c2ln", b(r#"{"alg":"RS256"}"#), b(claims))
    }

    #[test]
    fn a_jwt_is_told_from_the_brokers_tokens_and_its_expiry_read() {
        let t = jwt(r#"{"exp":1700000000,"sub":"system:serviceaccount:a:b"}"#);
        assert!(looks_like_jwt(&t));
        assert_eq!(expiry_ms(&t), Some(1_700_000_000_000));
        assert_eq!(expiry_ms(&jwt(r#"{"sub":"x"}"#)), None);
        let (broker_token, _) = crate::auth::generate_token();
        for not in [broker_token.as_str(), "eyJ.a", "eyJa.b.c d", ""] {
            assert!(!looks_like_jwt(not), "{not}");
        }
        assert!(!looks_like_jwt(&format!(
            "{t}{}",
            "a".repeat(MAX_TOKEN_BYTES)
        )));
    }
}
