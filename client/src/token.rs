//! Bearer tokens as the admin service reports them: [`IssuedToken`] (the secret, shown
//! once at issue time) and [`TokenInfo`] (the public record: id, tenant, note, age).

use serde::Serialize;

use gpu_broker_proto::v1 as pb;

/// A freshly issued token. The broker keeps only its hash: this is the one chance to
/// read `token`.
#[derive(Clone, PartialEq, Eq, Serialize)]
pub struct IssuedToken {
    /// The bearer token (secret).
    pub token: String,
    /// Public id (for revoking and listing).
    pub token_id: String,
    /// Tenant the token authenticates as.
    pub tenant: String,
}

impl std::fmt::Debug for IssuedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedToken")
            .field("token", &"<redacted>")
            .field("token_id", &self.token_id)
            .field("tenant", &self.tenant)
            .finish()
    }
}

impl From<pb::IssueTokenResponse> for IssuedToken {
    fn from(t: pb::IssueTokenResponse) -> Self {
        IssuedToken {
            token: t.token,
            token_id: t.token_id,
            tenant: t.tenant,
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
}

impl From<pb::TokenInfo> for TokenInfo {
    fn from(t: pb::TokenInfo) -> Self {
        TokenInfo {
            token_id: t.token_id,
            tenant: t.tenant,
            description: t.description,
            created_unix_ms: t.created_unix_ms,
        }
    }
}
