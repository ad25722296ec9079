//! Bearer tokens as the admin service reports them: [`IssuedToken`] (the secret, shown
//! once at issue time) and [`TokenInfo`] (the public record: id, tenant, name, scope,
//! note, age, expiry, last use); [`TokenScope`] and [`TokenOptions`] say what to issue.

use serde::Serialize;
use std::time::Duration;

use gpu_broker_proto::v1 as pb;

/// A freshly issued token. The broker keeps only its hash: this is the one chance to
/// read `token`.
#[derive(Clone, PartialEq, Eq, Serialize)]
pub struct IssuedToken {
    /// The bearer token (secret).
    pub token: String,
    /// Public id (for revoking and listing).
    pub token_id: String,
    /// Tenant the token authenticates as ("" for admin and node-wide read tokens).
    pub tenant: String,
    /// What it may do.
    pub scope: TokenScope,
    /// Name given at issue time.
    pub name: String,
    /// Expiry, milliseconds since the Unix epoch; `None`: never.
    pub expires_unix_ms: Option<i64>,
}

/// What a token may do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenScope {
    /// A tenant's workers: the worker-facing service.
    #[default]
    Worker,
    /// Usage, leases, devices, metrics and status; nothing that changes anything.
    Read,
    /// The admin service.
    Admin,
}

impl TokenScope {
    /// `"worker"`, `"read"` or `"admin"`.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenScope::Worker => "worker",
            TokenScope::Read => "read",
            TokenScope::Admin => "admin",
        }
    }

    pub(crate) fn to_proto(self) -> pb::TokenScope {
        match self {
            TokenScope::Worker => pb::TokenScope::Worker,
            TokenScope::Read => pb::TokenScope::Read,
            TokenScope::Admin => pb::TokenScope::Admin,
        }
    }

    pub(crate) fn from_proto(v: i32) -> TokenScope {
        match pb::TokenScope::try_from(v) {
            Ok(pb::TokenScope::Read) => TokenScope::Read,
            Ok(pb::TokenScope::Admin) => TokenScope::Admin,
            _ => TokenScope::Worker,
        }
    }
}

impl std::str::FromStr for TokenScope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "worker" => Ok(TokenScope::Worker),
            "read" => Ok(TokenScope::Read),
            "admin" => Ok(TokenScope::Admin),
            _ => Err(format!("unknown scope {s:?}: worker, read or admin")),
        }
    }
}

/// How to issue a token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenOptions {
    pub scope: TokenScope,
    /// Time to live; `None`: never expires.
    pub ttl: Option<Duration>,
    /// Name shown in listings and the audit log.
    pub name: String,
    /// Free-form note.
    pub description: String,
}

impl std::fmt::Debug for IssuedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedToken")
            .field("token", &"<redacted>")
            .field("token_id", &self.token_id)
            .field("tenant", &self.tenant)
            .field("scope", &self.scope)
            .field("name", &self.name)
            .field("expires_unix_ms", &self.expires_unix_ms)
            .finish()
    }
}

impl From<pb::IssueTokenResponse> for IssuedToken {
    fn from(t: pb::IssueTokenResponse) -> Self {
        IssuedToken {
            token: t.token,
            token_id: t.token_id,
            tenant: t.tenant,
            scope: TokenScope::from_proto(t.scope),
            name: t.name,
            expires_unix_ms: (t.expires_unix_ms != 0).then_some(t.expires_unix_ms),
        }
    }
}

/// A live token (never the secret itself).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TokenInfo {
    /// Public id.
    pub token_id: String,
    /// Tenant it authenticates as.
    pub tenant: String,
    /// Free-form note given at issue time.
    pub description: String,
    /// Issue time, milliseconds since the Unix epoch.
    pub created_unix_ms: i64,
    /// Name given at issue time.
    pub name: String,
    /// What it may do.
    pub scope: TokenScope,
    /// Expiry, milliseconds since the Unix epoch; `None`: never.
    pub expires_unix_ms: Option<i64>,
    /// Last accepted since the broker started; `None`: not since then.
    pub last_used_unix_ms: Option<i64>,
}

impl From<pb::TokenInfo> for TokenInfo {
    fn from(t: pb::TokenInfo) -> Self {
        TokenInfo {
            token_id: t.token_id,
            tenant: t.tenant,
            description: t.description,
            created_unix_ms: t.created_unix_ms,
            name: t.name,
            scope: TokenScope::from_proto(t.scope),
            expires_unix_ms: (t.expires_unix_ms != 0).then_some(t.expires_unix_ms),
            last_used_unix_ms: (t.last_used_unix_ms != 0).then_some(t.last_used_unix_ms),
        }
    }
}
