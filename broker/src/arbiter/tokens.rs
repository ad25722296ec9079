//! Token lifecycle: issuing tokens of a scope (worker, read, admin) with an optional
//! time to live and a name. Every token is durable (store) before it is usable, and only
//! its hash is kept. The admin token file's rotation is `admin_token::rotate`.

use crate::auth::{generate_token, token_id, Scope, TokenEntry};
use crate::error::{BrokerError, BrokerResult};
use std::time::{Duration, SystemTime};

/// Longest time to live a token may be given (10 years): longer is a typo.
pub const MAX_TOKEN_TTL: Duration = Duration::from_secs(10 * 366 * 24 * 3600);

/// What to issue.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenSpec {
    /// Required for `worker`; optional for `read` (absent: node-wide); absent for `admin`.
    pub tenant: Option<String>,
    pub scope: Scope,
    /// `None`: never expires.
    pub ttl: Option<Duration>,
    pub name: String,
    pub description: String,
}

/// A token just issued: the secret is shown only now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IssuedToken {
    pub token: String,
    pub entry: TokenEntry,
}

impl super::Changes<'_> {
    /// Issues a token, durable before it is returned. With `who`, its audit record
    /// (`token.issue`) is committed with the token.
    pub(crate) fn issue_token(
        &self,
        spec: TokenSpec,
        who: Option<&crate::audit::Who>,
    ) -> BrokerResult<IssuedToken> {
        let max = super::MAX_LABEL;
        if spec.description.len() > max || spec.name.len() > max {
            return Err(BrokerError::InvalidArgument(format!(
                "token name and description are limited to {max} bytes"
            )));
        }
        if spec.name.chars().any(char::is_control) {
            return Err(BrokerError::InvalidArgument(
                "token name must not contain control characters".into(),
            ));
        }
        let tenant = spec.tenant.clone().filter(|t| !t.is_empty());
        match (spec.scope, &tenant) {
            (Scope::Worker, None) => {
                return Err(BrokerError::InvalidArgument(
                    "a worker token needs a tenant".into(),
                ))
            }
            (Scope::Admin, Some(t)) => {
                return Err(BrokerError::InvalidArgument(format!(
                    "an admin token belongs to no tenant (got {t:?})"
                )))
            }
            _ => {}
        }
        let expires_unix_ms = match spec.ttl {
            None => None,
            Some(ttl) if ttl.is_zero() || ttl > MAX_TOKEN_TTL => {
                return Err(BrokerError::InvalidArgument(format!(
                    "token ttl must be more than 0 and at most {} days (got {} s)",
                    MAX_TOKEN_TTL.as_secs() / 86400,
                    ttl.as_secs()
                )))
            }
            Some(ttl) => Some(crate::units::unix_ms(SystemTime::now() + ttl)),
        };
        // `Durable::writes` orders this against tenant deletion (a token never outlives its
        // tenant); the store commit runs with no state lock held.
        let _writes = self.arb.durable.writes();
        if let Some(t) = &tenant {
            let st = self.arb.lock();
            if st.ledger().get(t).is_none() || st.ledger().is_closing(t) {
                return Err(BrokerError::tenant_not_found(t));
            }
        }
        let (token, hash) = generate_token();
        let entry = TokenEntry {
            token_id: token_id(&hash),
            tenant: tenant.unwrap_or_default(),
            description: spec.description,
            created_unix_ms: crate::units::unix_ms(SystemTime::now()),
            hash,
            name: spec.name,
            scope: spec.scope,
            expires_unix_ms,
        };
        let rec = who.map(|who| {
            crate::audit::AuditRecord::now(
                who,
                "token.issue",
                &entry.tenant,
                &entry.token_id,
                None,
                Some(crate::audit::token_json(&entry)),
            )
        });
        self.commit_recorded(rec, |store, audit| store.put_token_with(&entry, audit))?;
        self.arb.auth.add(entry.clone());
        tracing::info!(
            tenant = %entry.tenant,
            token_id = %entry.token_id,
            scope = %entry.scope,
            name = %entry.name,
            expires_unix_ms = ?entry.expires_unix_ms,
            "token issued"
        );
        Ok(IssuedToken { token, entry })
    }
}
