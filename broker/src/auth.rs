//! Authentication: bearer token -> caller. Tenant tokens are kept only as SHA-256 hashes;
//! the admin token is compared in constant time. Two tonic interceptors put the resolved
//! [`Caller`] into each request's extensions: the `Broker` service admits tenants only,
//! the `Admin` service the admin only (a tenant there is `PERMISSION_DENIED`; no token or
//! an unknown one is `UNAUTHENTICATED` everywhere).
//!
//! Every token has a [`Scope`]: `worker` (a tenant's workers: the `Broker` service),
//! `read` (usage, metrics and status only; bound to a tenant or node-wide) and `admin`
//! (the `Admin` service; the admin token file is one, stored admin tokens are others). A
//! token may expire: past its expiry it is `UNAUTHENTICATED` with "expired" in the
//! message. Which methods a scope reaches is decided per method in `gate.rs`.

use crate::grpc_status::Reason;
use dashmap::DashMap;
use rand::RngCore;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tonic::{Request, Status};

/// Who is calling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    Admin,
    Tenant(String),
    /// A `read` token: of one tenant, or node-wide (`None`).
    Reader(Option<String>),
}

/// What a token may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Scope {
    /// A tenant's workers: the whole `Broker` service.
    #[default]
    Worker,
    /// Usage, metrics and status, nothing else.
    Read,
    /// The `Admin` service.
    Admin,
}

impl Scope {
    /// `"worker"`, `"read"` or `"admin"` (also the stored form).
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Worker => "worker",
            Scope::Read => "read",
            Scope::Admin => "admin",
        }
    }

    /// The stored form back; "" (records written before scopes existed) is `worker`.
    pub fn parse(s: &str) -> Option<Scope> {
        match s {
            "" | "worker" => Some(Scope::Worker),
            "read" => Some(Scope::Read),
            "admin" => Some(Scope::Admin),
            _ => None,
        }
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A token, as kept (never the token itself), and as the state file stores it (the
/// store's `tokens` table holds this record's serde form: the hash as `hash_hex`, the
/// scope as its name; fields absent in older files take their defaults).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TokenEntry {
    pub token_id: String,
    /// The tenant; "" for admin and node-wide read tokens.
    pub tenant: String,
    #[serde(rename = "hash_hex", with = "hash_hex")]
    pub hash: [u8; 32],
    pub description: String,
    pub created_unix_ms: i64,
    /// Operator-chosen name (may be empty; absent in files written before token
    /// lifecycles).
    #[serde(default)]
    pub name: String,
    /// Absent or "" in files written before scopes: `worker`.
    #[serde(default)]
    pub scope: Scope,
    /// Past this instant (ms since the epoch) the token is refused; `None`: never.
    #[serde(default)]
    pub expires_unix_ms: Option<i64>,
}

/// A token that authenticates, as [`Authenticator::live_by_id`] finds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveToken {
    pub name: String,
    pub hash: [u8; 32],
    /// Past this instant (ms since the epoch) it is refused; `None`: never.
    pub expires_unix_ms: Option<i64>,
}

/// A SHA-256 as 64 hex digits.
mod hash_hex {
    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(hash: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(hash))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let text = String::deserialize(d)?;
        let mut hash = [0u8; 32];
        hex::decode_to_slice(&text, &mut hash)
            .map_err(|e| D::Error::custom(format!("bad token hash: {e}")))?;
        Ok(hash)
    }
}

/// Stored as its name (`"worker"`, `"read"`, `"admin"`).
impl serde::Serialize for Scope {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Scope {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Scope, D::Error> {
        let text = String::deserialize(d)?;
        Scope::parse(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown scope {text:?}")))
    }
}

/// The authenticated identity behind a request: which token, what it may do. Put into
/// each request's extensions by the gate (`gate.rs`); the audit log records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// Public id of the token (`admin-file` for the admin token file).
    pub token_id: String,
    pub name: String,
    pub scope: Scope,
    /// The tenant of a worker or tenant-bound read token.
    pub tenant: Option<String>,
}

impl Principal {
    /// The [`Caller`] this principal acts as.
    pub fn caller(&self) -> Caller {
        match (self.scope, &self.tenant) {
            (Scope::Admin, _) => Caller::Admin,
            (Scope::Worker, Some(t)) => Caller::Tenant(t.clone()),
            (Scope::Worker, None) => Caller::Reader(None),
            (Scope::Read, t) => Caller::Reader(t.clone()),
        }
    }
}

/// Why a token was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("missing authorization: Bearer <token>")]
    Missing,
    #[error("authorization must be: Bearer <token>")]
    Malformed,
    #[error("unknown or revoked token")]
    Unknown,
    #[error(
        "token {token_id} ({name}) expired at {expired_at} (ms since the epoch): issue a new one"
    )]
    Expired {
        token_id: String,
        name: String,
        expired_at: i64,
    },
    #[error("a {scope} token may not do this: {what}")]
    Scope { scope: Scope, what: String },
    /// A Kubernetes ServiceAccount token the API server's TokenReview did not accept
    /// (`why`: what it said: invalid, expired, of another audience, ...).
    #[error("the Kubernetes API server refused this ServiceAccount token: {why}")]
    ServiceAccountRefused { why: String },
    /// A ServiceAccount token of a namespace that no tenant lists.
    #[error(
        "ServiceAccount {account:?} is of namespace {namespace:?}, which no tenant's `namespaces` lists (the config file's [tenants.NAME] tables)"
    )]
    NoTenantForNamespace { namespace: String, account: String },
    /// The API server could not be asked about a ServiceAccount token.
    #[error("the Kubernetes API server could not review this ServiceAccount token: {why}; retry")]
    ReviewUnavailable { why: String },
}

impl AuthError {
    /// The machine-readable reason (`ErrorInfo.reason`): an expired token and an unknown
    /// one are told apart without reading the message.
    pub fn reason(&self) -> Reason {
        match self {
            AuthError::Missing => Reason::TokenMissing,
            AuthError::Malformed => Reason::TokenMalformed,
            AuthError::Unknown => Reason::TokenUnknown,
            AuthError::Expired { .. } => Reason::TokenExpired,
            AuthError::Scope { .. } => Reason::ScopeDenied,
            AuthError::ServiceAccountRefused { .. } => Reason::ServiceAccountRefused,
            AuthError::NoTenantForNamespace { .. } => Reason::NamespaceHasNoTenant,
            AuthError::ReviewUnavailable { .. } => Reason::TokenReviewUnavailable,
        }
    }

    /// What the refusal is about (`ErrorInfo.metadata`).
    pub fn metadata(&self) -> Vec<(&'static str, String)> {
        match self {
            AuthError::Expired {
                token_id,
                expired_at,
                ..
            } => vec![
                ("token_id", token_id.clone()),
                ("expired_at_ms", expired_at.to_string()),
            ],
            AuthError::Scope { scope, .. } => vec![("scope", scope.as_str().into())],
            AuthError::NoTenantForNamespace { namespace, .. } => {
                vec![("namespace", namespace.clone())]
            }
            AuthError::Missing
            | AuthError::Malformed
            | AuthError::Unknown
            | AuthError::ServiceAccountRefused { .. }
            | AuthError::ReviewUnavailable { .. } => vec![],
        }
    }
}

impl From<AuthError> for Status {
    fn from(e: AuthError) -> Status {
        let code = match e {
            AuthError::Scope { .. } => tonic::Code::PermissionDenied,
            AuthError::ReviewUnavailable { .. } => tonic::Code::Unavailable,
            _ => tonic::Code::Unauthenticated,
        };
        crate::grpc_status::status_with_reason(code, e.to_string(), Some(e.reason()), e.metadata())
    }
}

/// An `authorization` header that is not text: `UNAUTHENTICATED`, reason
/// `TOKEN_MALFORMED`.
pub fn malformed_header() -> Status {
    crate::grpc_status::status_with_reason(
        tonic::Code::Unauthenticated,
        "malformed authorization header".into(),
        Some(Reason::TokenMalformed),
        vec![],
    )
}

/// A token refused on a service its scope does not reach (`why` says which it is for):
/// `PERMISSION_DENIED`, reason `SCOPE_DENIED`.
fn wrong_service(scope: Scope, why: &str) -> Status {
    crate::grpc_status::status_with_reason(
        tonic::Code::PermissionDenied,
        why.to_string(),
        Some(Reason::ScopeDenied),
        vec![("scope", scope.as_str().into())],
    )
}

/// Principal of the admin token file.
pub const ADMIN_FILE_TOKEN_ID: &str = "admin-file";

/// The admin token file's hash, and the previous one during a rotation's grace.
#[derive(Debug)]
struct AdminKeys {
    current: [u8; 32],
    previous: Option<([u8; 32], std::time::Instant)>,
}

/// SHA-256 of a token.
pub fn hash_token(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Public id of a token: the first 12 hex digits of its hash.
pub fn token_id(hash: &[u8; 32]) -> String {
    hex::encode(&hash[..6])
}

/// A new random token (`gpb_` + 64 hex digits, 256 bits) with its hash.
pub fn generate_token() -> (String, [u8; 32]) {
    let mut raw = [0u8; 32];
    rand::rng().fill_bytes(&mut raw);
    let token = format!("gpb_{}", hex::encode(raw));
    let hash = hash_token(&token);
    (token, hash)
}

/// The admin token's hash and the tenant token table.
#[derive(Debug)]
pub struct Authenticator {
    admin: parking_lot::RwLock<AdminKeys>,
    /// Token hash -> entry; read on every request, without the arbiter's lock.
    tokens: DashMap<[u8; 32], TokenEntry>,
    /// Token hash -> when it was last accepted (ms since the epoch; since this start).
    last_used: DashMap<[u8; 32], i64>,
    /// Where the admin token file lives (for rotation); `None` in tests.
    admin_file: parking_lot::Mutex<Option<std::path::PathBuf>>,
    /// The declared tokens (`tokens_config`): in `tokens` too, never in the store.
    declared: parking_lot::Mutex<std::collections::HashMap<[u8; 32], TokenEntry>>,
    /// Kubernetes ServiceAccount tokens the API server accepted (`token_review.rs`), as
    /// worker tokens of their namespace's tenant until their own expiry; never stored,
    /// never listed.
    reviewed: DashMap<[u8; 32], TokenEntry>,
    /// When expired reviewed tokens were last dropped (projected tokens rotate: each pod
    /// brings a new one every hour or so).
    reviewed_pruned: parking_lot::Mutex<std::time::Instant>,
    /// Namespace -> tenant (the config file's `namespaces`).
    namespaces: parking_lot::RwLock<std::collections::HashMap<String, String>>,
    /// Asks the API server about ServiceAccount tokens (`--token-review-audience`).
    reviewer: std::sync::OnceLock<Arc<crate::token_review::TokenReviewer>>,
}

impl Authenticator {
    pub fn new(admin_token: &str) -> Authenticator {
        Authenticator {
            admin: parking_lot::RwLock::new(AdminKeys {
                current: hash_token(admin_token),
                previous: None,
            }),
            tokens: DashMap::new(),
            last_used: DashMap::new(),
            admin_file: parking_lot::Mutex::new(None),
            declared: parking_lot::Mutex::new(std::collections::HashMap::new()),
            reviewed: DashMap::new(),
            reviewed_pruned: parking_lot::Mutex::new(std::time::Instant::now()),
            namespaces: parking_lot::RwLock::new(std::collections::HashMap::new()),
            reviewer: std::sync::OnceLock::new(),
        }
    }

    /// Accepts Kubernetes ServiceAccount tokens from now on, reviewed by `reviewer`.
    pub fn set_reviewer(&self, reviewer: Arc<crate::token_review::TokenReviewer>) {
        let _ = self.reviewer.set(reviewer);
    }

    /// The ServiceAccount tokens' reviewer, when they are accepted.
    pub fn reviewer(&self) -> Option<&Arc<crate::token_review::TokenReviewer>> {
        self.reviewer.get()
    }

    /// Whether the token of `hash` is a reviewed ServiceAccount token.
    pub fn is_reviewed(&self, hash: &[u8; 32]) -> bool {
        self.reviewed.contains_key(hash)
    }

    /// Makes `map` (namespace -> tenant) the namespaces' tenants.
    pub fn set_namespace_tenants(&self, map: std::collections::HashMap<String, String>) {
        *self.namespaces.write() = map;
    }

    /// The tenant whose ServiceAccount tokens of `namespace` act as, if one lists it.
    pub fn tenant_of_namespace(&self, namespace: &str) -> Option<String> {
        self.namespaces.read().get(namespace).cloned()
    }

    /// Accepts a reviewed ServiceAccount token (`entry`) until its expiry or
    /// [`Authenticator::forget_reviewed`].
    pub fn add_reviewed(&self, entry: TokenEntry) {
        self.reviewed.insert(entry.hash, entry);
        // At most once a minute, the expired ones go (their sessions are swept already).
        let mut pruned = self.reviewed_pruned.lock();
        if pruned.elapsed() >= std::time::Duration::from_secs(60) {
            *pruned = std::time::Instant::now();
            drop(pruned);
            let now = crate::units::unix_ms(std::time::SystemTime::now());
            self.reviewed
                .retain(|_, e| e.expires_unix_ms.is_none_or(|exp| now < exp));
        }
    }

    /// Stops accepting a reviewed token (the API server refused it since): its sessions
    /// end on the next sweep.
    pub fn forget_reviewed(&self, hash: &[u8; 32]) {
        self.reviewed.remove(hash);
    }

    /// Makes `entries` the declared tokens: those not accepted now are added (again, if a
    /// tenant's deletion dropped them; a declared token keeps its first creation time), the
    /// previously declared ones not among `entries` are dropped. Returns (added, dropped).
    pub fn replace_declared(&self, entries: Vec<TokenEntry>) -> (Vec<TokenEntry>, Vec<TokenEntry>) {
        let mut declared = self.declared.lock();
        let mut added = Vec::new();
        let mut next = std::collections::HashMap::new();
        for mut e in entries {
            if let Some(before) = declared.get(&e.hash) {
                e.created_unix_ms = before.created_unix_ms;
            }
            let accepted = self.tokens.get(&e.hash).is_some_and(|t| *t == e);
            if !accepted {
                self.tokens.insert(e.hash, e.clone());
                added.push(e.clone());
            }
            next.insert(e.hash, e);
        }
        let mut dropped = Vec::new();
        for (h, _) in declared.iter().filter(|(h, _)| !next.contains_key(*h)) {
            if let Some(e) = self.remove(h) {
                dropped.push(e);
            }
        }
        *declared = next;
        (added, dropped)
    }

    /// Whether the token of `hash` is declared in the config file (not revocable by RPC).
    pub fn is_declared(&self, hash: &[u8; 32]) -> bool {
        self.declared.lock().contains_key(hash)
    }

    /// Remembers the admin token file, which [`Authenticator::rotate_admin`] rewrites.
    pub fn set_admin_file(&self, path: &std::path::Path) {
        *self.admin_file.lock() = Some(path.to_path_buf());
    }

    /// The admin token file, if known.
    pub fn admin_file(&self) -> Option<std::path::PathBuf> {
        self.admin_file.lock().clone()
    }

    /// Makes `new_token` the admin file token; the old one keeps working for `grace`
    /// (zero: not at all), so clients can switch without downtime.
    pub fn rotate_admin(&self, new_token: &str, grace: std::time::Duration) {
        let mut k = self.admin.write();
        let old = k.current;
        k.current = hash_token(new_token);
        k.previous = (!grace.is_zero()).then(|| (old, std::time::Instant::now() + grace));
    }

    fn is_admin_file_token(&self, h: &[u8; 32]) -> bool {
        let k = self.admin.read();
        if bool::from(h.ct_eq(&k.current)) {
            return true;
        }
        matches!(k.previous, Some((p, until)) if bool::from(h.ct_eq(&p)) && std::time::Instant::now() < until)
    }

    /// Resolves a bearer token to its principal: refuses unknown, revoked and expired
    /// tokens, and records the use.
    pub fn authenticate(&self, token: &str) -> Result<Principal, AuthError> {
        let h = hash_token(token);
        if self.is_admin_file_token(&h) {
            return Ok(Principal {
                token_id: ADMIN_FILE_TOKEN_ID.into(),
                name: "admin token file".into(),
                scope: Scope::Admin,
                tenant: None,
            });
        }
        let e = match self.tokens.get(&h) {
            Some(e) => e,
            None => self.reviewed.get(&h).ok_or(AuthError::Unknown)?,
        };
        let now = crate::units::unix_ms(std::time::SystemTime::now());
        if let Some(exp) = e.expires_unix_ms {
            if now >= exp {
                return Err(AuthError::Expired {
                    token_id: e.token_id.clone(),
                    name: e.name.clone(),
                    expired_at: exp,
                });
            }
        }
        let p = Principal {
            token_id: e.token_id.clone(),
            name: e.name.clone(),
            scope: e.scope,
            tenant: (!e.tenant.is_empty()).then(|| e.tenant.clone()),
        };
        drop(e);
        self.mark_used(&h, now);
        Ok(p)
    }

    /// Notes that the token of `hash` was used at `now` (ms since the epoch): by a call, or
    /// by a lease line its session opened.
    pub fn mark_used(&self, hash: &[u8; 32], now: i64) {
        // One write a second per token at most: the map is read on every request.
        let stale = self.last_used.get(hash).is_none_or(|t| *t + 1000 <= now);
        if stale {
            self.last_used.insert(*hash, now);
        }
    }

    /// When a token was last accepted since this broker started (ms since the epoch).
    pub fn last_used(&self, hash: &[u8; 32]) -> Option<i64> {
        self.last_used.get(hash).map(|t| *t)
    }

    /// Accepts a token that may read usage, metrics and status: `read` (node-wide or of
    /// a tenant), or `admin`. For `/metrics` and status pages.
    pub fn authorize_read(&self, token: &str) -> Result<Principal, AuthError> {
        let p = self.authenticate(token)?;
        match p.scope {
            Scope::Read | Scope::Admin => Ok(p),
            Scope::Worker => Err(AuthError::Scope {
                scope: p.scope,
                what: "reading metrics or status needs a read or admin token".into(),
            }),
        }
    }

    /// Resolves a bearer token.
    pub fn identify(&self, token: &str) -> Option<Caller> {
        self.authenticate(token).ok().map(|p| p.caller())
    }

    pub fn add(&self, entry: TokenEntry) {
        self.tokens.insert(entry.hash, entry);
    }

    /// The ids of the tokens that authenticate now (not revoked, not expired), the admin
    /// token file's included.
    pub fn live_token_ids(&self) -> std::collections::HashSet<String> {
        let now = crate::units::unix_ms(std::time::SystemTime::now());
        let mut live: std::collections::HashSet<String> = self
            .tokens
            .iter()
            .chain(self.reviewed.iter())
            .filter(|e| e.expires_unix_ms.is_none_or(|exp| now < exp))
            .map(|e| e.token_id.clone())
            .collect();
        live.insert(ADMIN_FILE_TOKEN_ID.into());
        live
    }

    /// The token of id `token_id` as it authenticates now (its name, hash and expiry);
    /// `None` when no token of that id authenticates (revoked, expired, unknown), or it is
    /// the admin token file's. A scan: for what holds a token's id across many calls (a
    /// lease line).
    pub fn live_by_id(&self, token_id: &str) -> Option<LiveToken> {
        let now = crate::units::unix_ms(std::time::SystemTime::now());
        self.tokens
            .iter()
            .chain(self.reviewed.iter())
            .find(|e| e.token_id == token_id)
            .filter(|e| e.expires_unix_ms.is_none_or(|exp| now < exp))
            .map(|e| LiveToken {
                name: e.name.clone(),
                hash: e.hash,
                expires_unix_ms: e.expires_unix_ms,
            })
    }

    /// Looks a token up by id or by the token itself.
    pub fn find(&self, id_or_token: &str) -> Option<TokenEntry> {
        let by_hash = hash_token(id_or_token);
        if let Some(e) = self.tokens.get(&by_hash) {
            return Some(e.clone());
        }
        self.tokens
            .iter()
            .find(|e| e.token_id == id_or_token)
            .map(|e| e.clone())
    }

    pub fn remove(&self, hash: &[u8; 32]) -> Option<TokenEntry> {
        self.last_used.remove(hash);
        self.tokens.remove(hash).map(|(_, e)| e)
    }

    /// Drops every token of `tenant`.
    pub fn remove_tenant(&self, tenant: &str) {
        self.reviewed.retain(|_, e| e.tenant != tenant);
        let last_used = &self.last_used;
        self.tokens.retain(|h, e| {
            let keep = e.tenant != tenant;
            if !keep {
                last_used.remove(h);
            }
            keep
        });
    }

    /// How many tokens each tenant has (tenants without a token are absent); copies no
    /// token entry.
    pub fn counts(&self) -> std::collections::HashMap<String, u32> {
        let mut m = std::collections::HashMap::new();
        for e in self.tokens.iter() {
            if let Some(c) = m.get_mut(e.tenant.as_str()) {
                *c += 1;
            } else {
                m.insert(e.tenant.clone(), 1);
            }
        }
        m
    }

    /// Tokens (of one tenant, or all), sorted by tenant then id.
    pub fn list(&self, tenant: Option<&str>) -> Vec<TokenEntry> {
        let mut v: Vec<_> = self
            .tokens
            .iter()
            .filter(|e| tenant.is_none_or(|t| e.tenant == t))
            .map(|e| e.clone())
            .collect();
        v.sort_by(|a, b| (&a.tenant, &a.token_id).cmp(&(&b.tenant, &b.token_id)));
        v
    }

    pub fn count(&self, tenant: &str) -> usize {
        self.tokens.iter().filter(|e| e.tenant == tenant).count()
    }
}

/// The token of an `authorization: Bearer <token>` header value.
pub fn bearer(value: Option<&str>) -> Result<&str, AuthError> {
    let value = value.ok_or(AuthError::Missing)?;
    Ok(value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .ok_or(AuthError::Malformed)?
        .trim())
}

/// The request's principal: the one the gate resolved, else resolved from the header.
fn principal_of<T>(auth: &Authenticator, req: &Request<T>) -> Result<Principal, Status> {
    if let Some(p) = req.extensions().get::<Principal>() {
        return Ok(p.clone());
    }
    let value = match req.metadata().get("authorization") {
        None => None,
        Some(v) => Some(v.to_str().map_err(|_| malformed_header())?),
    };
    Ok(auth.authenticate(bearer(value)?)?)
}

/// Reads `authorization: Bearer <token>` and resolves it.
fn caller_of<T>(auth: &Authenticator, req: &Request<T>) -> Result<Caller, Status> {
    principal_of(auth, req).map(|p| p.caller())
}

/// Interceptor of the `Broker` service: tenants only.
pub fn tenant_interceptor(
    auth: Arc<Authenticator>,
) -> impl Fn(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |mut req: Request<()>| match caller_of(&auth, &req)? {
        c @ (Caller::Tenant(_) | Caller::Reader(Some(_))) => {
            req.extensions_mut().insert(c);
            Ok(req)
        }
        Caller::Reader(None) => Err(wrong_service(
            Scope::Read,
            "a node-wide read token has no tenant: it reads through the Admin service",
        )),
        Caller::Admin => Err(wrong_service(
            Scope::Admin,
            "the admin token is for the Admin service; workers use a tenant token",
        )),
    }
}

/// Interceptor of the `Admin` service: the admin only.
pub fn admin_interceptor(
    auth: Arc<Authenticator>,
) -> impl Fn(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |mut req: Request<()>| match caller_of(&auth, &req)? {
        c @ (Caller::Admin | Caller::Reader(None)) => {
            req.extensions_mut().insert(c);
            Ok(req)
        }
        Caller::Tenant(_) => Err(wrong_service(
            Scope::Worker,
            "tenant tokens cannot call the Admin service",
        )),
        Caller::Reader(Some(_)) => Err(wrong_service(
            Scope::Read,
            "tenant tokens cannot call the Admin service",
        )),
    }
}

/// The tenant a `Broker` request was authenticated as.
pub fn tenant_of<T>(req: &Request<T>) -> Result<String, Status> {
    match req.extensions().get::<Caller>() {
        Some(Caller::Tenant(t)) | Some(Caller::Reader(Some(t))) => Ok(t.clone()),
        _ => Err(Status::unauthenticated("no tenant on this request")),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Every token refusal carries its reason: an expired token is told from an unknown
    /// one (and names itself), a scope refusal names the scope.
    #[test]
    fn token_refusals_carry_their_reason_and_what_they_are_about() {
        use tonic_types::StatusExt;
        let cases = [
            (
                AuthError::Missing,
                tonic::Code::Unauthenticated,
                "TOKEN_MISSING",
                vec![],
            ),
            (
                AuthError::Malformed,
                tonic::Code::Unauthenticated,
                "TOKEN_MALFORMED",
                vec![],
            ),
            (
                AuthError::Unknown,
                tonic::Code::Unauthenticated,
                "TOKEN_UNKNOWN",
                vec![],
            ),
            (
                AuthError::Expired {
                    token_id: "tok1".into(),
                    name: "ci".into(),
                    expired_at: 1_700_000_000_000,
                },
                tonic::Code::Unauthenticated,
                "TOKEN_EXPIRED",
                vec![("token_id", "tok1"), ("expired_at_ms", "1700000000000")],
            ),
            (
                AuthError::Scope {
                    scope: Scope::Read,
                    what: "SetQuota".into(),
                },
                tonic::Code::PermissionDenied,
                "SCOPE_DENIED",
                vec![("scope", "read")],
            ),
        ];
        for (e, code, reason, meta) in cases {
            let s = Status::from(e.clone());
            assert_eq!(s.code(), code, "{e:?}");
            assert_eq!(s.message(), e.to_string());
            let info = s.get_details_error_info().expect("an ErrorInfo");
            assert_eq!(info.reason, reason);
            assert_eq!(e.reason().code(), Some(code), "{e:?}");
            let want: std::collections::HashMap<String, String> = meta
                .into_iter()
                .map(|(k, v): (&str, &str)| (k.to_string(), v.to_string()))
                .collect();
            assert_eq!(info.metadata, want, "{e:?}");
        }
        let s = malformed_header();
        assert_eq!(s.code(), tonic::Code::Unauthenticated);
        assert_eq!(
            s.get_details_error_info().unwrap().reason,
            "TOKEN_MALFORMED"
        );
        let s = wrong_service(Scope::Admin, "the admin token is for the Admin service");
        assert_eq!(s.code(), tonic::Code::PermissionDenied);
        let info = s.get_details_error_info().unwrap();
        assert_eq!(
            (info.reason.as_str(), info.metadata["scope"].as_str()),
            ("SCOPE_DENIED", "admin")
        );
    }

    fn with_token(token: &str) -> Request<()> {
        let mut r = Request::new(());
        r.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        r
    }

    #[test]
    fn deleting_a_tenant_forgets_when_its_tokens_were_used() {
        let (a, tok) = auth_with_tenant();
        a.authenticate(&tok).unwrap();
        let h = hash_token(&tok);
        assert!(a.last_used(&h).is_some());
        a.remove_tenant("t1");
        assert!(a.authenticate(&tok).is_err());
        assert_eq!(a.last_used(&h), None);
    }

    /// An authenticator with the admin token `admin-secret` and a worker token of
    /// tenant `t1` (returned).
    #[test]
    fn reviewed_serviceaccount_tokens_act_until_their_expiry_and_expired_ones_are_dropped() {
        let a = Authenticator::new("admin-secret");
        let now = crate::units::unix_ms(std::time::SystemTime::now());
        let reviewed = |token: &str, exp: i64| TokenEntry {
            token_id: token_id(&hash_token(token)),
            tenant: "training".into(),
            hash: hash_token(token),
            description: String::new(),
            created_unix_ms: now,
            name: "serviceaccount:training/w".into(),
            scope: Scope::Worker,
            expires_unix_ms: Some(exp),
        };
        a.add_reviewed(reviewed("old", now - 1));
        assert!(matches!(
            a.authenticate("old"),
            Err(AuthError::Expired { .. })
        ));
        a.add_reviewed(reviewed("live", now + 60_000));
        let p = a.authenticate("live").unwrap();
        assert_eq!(
            (p.scope, p.tenant.as_deref()),
            (Scope::Worker, Some("training"))
        );
        assert!(a.live_token_ids().contains(&p.token_id));
        assert!(
            a.is_reviewed(&hash_token("old")),
            "kept until the next prune"
        );
        // A minute later, the next accepted token drops the expired ones.
        *a.reviewed_pruned.lock() = std::time::Instant::now() - std::time::Duration::from_secs(61);
        a.add_reviewed(reviewed("new", now + 60_000));
        assert!(!a.is_reviewed(&hash_token("old")));
        assert!(matches!(a.authenticate("old"), Err(AuthError::Unknown)));
        assert!(a.authenticate("live").is_ok() && a.authenticate("new").is_ok());
        // Refused since: no longer accepted.
        a.forget_reviewed(&hash_token("live"));
        assert!(matches!(a.authenticate("live"), Err(AuthError::Unknown)));
    }

    pub(crate) fn auth_with_tenant() -> (Arc<Authenticator>, String) {
        let a = Arc::new(Authenticator::new("admin-secret"));
        let (tok, hash) = generate_token();
        a.add(TokenEntry {
            token_id: token_id(&hash),
            tenant: "t1".into(),
            description: String::new(),
            created_unix_ms: 0,
            hash,
            name: String::new(),
            scope: Scope::Worker,
            expires_unix_ms: None,
        });
        (a, tok)
    }

    #[test]
    fn tokens_resolve_to_callers() {
        let (a, tok) = auth_with_tenant();
        assert_eq!(a.identify("admin-secret"), Some(Caller::Admin));
        assert_eq!(a.identify(&tok), Some(Caller::Tenant("t1".into())));
        assert_eq!(a.identify("nope"), None);
    }

    #[test]
    fn interceptors_map_to_precise_codes() {
        let (a, tok) = auth_with_tenant();
        let ti = tenant_interceptor(a.clone());
        let ai = admin_interceptor(a.clone());
        assert!(ti(with_token(&tok)).is_ok());
        assert_eq!(
            ti(Request::new(())).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            ti(with_token("bad")).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            ai(with_token(&tok)).unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        assert!(ai(with_token("admin-secret")).is_ok());
    }

    #[test]
    fn expired_tokens_say_so_and_record_no_use() {
        let a = Authenticator::new("admin-secret");
        let (tok, hash) = generate_token();
        a.add(TokenEntry {
            token_id: token_id(&hash),
            tenant: "t1".into(),
            description: String::new(),
            created_unix_ms: 0,
            hash,
            name: "old".into(),
            scope: Scope::Worker,
            expires_unix_ms: Some(1),
        });
        let e = a.authenticate(&tok).unwrap_err();
        assert!(matches!(e, AuthError::Expired { .. }));
        assert!(e.to_string().contains("expired"), "{e}");
        assert_eq!(Status::from(e).code(), tonic::Code::Unauthenticated);
        assert_eq!(a.last_used(&hash), None);
    }

    #[test]
    fn admin_rotation_keeps_the_old_token_for_the_grace_only() {
        let a = Authenticator::new("old");
        a.rotate_admin("new", std::time::Duration::from_secs(60));
        assert_eq!(a.identify("old"), Some(Caller::Admin));
        assert_eq!(a.identify("new"), Some(Caller::Admin));
        a.rotate_admin("newer", std::time::Duration::ZERO);
        assert_eq!(a.identify("old"), None);
        assert_eq!(a.identify("new"), None);
        assert_eq!(a.identify("newer"), Some(Caller::Admin));
    }

    #[test]
    fn read_principals_map_to_readers() {
        let p = Principal {
            token_id: "x".into(),
            name: String::new(),
            scope: Scope::Read,
            tenant: Some("t".into()),
        };
        assert_eq!(p.caller(), Caller::Reader(Some("t".into())));
        let ti = tenant_interceptor(Arc::new(Authenticator::new("a")));
        let mut r = Request::new(());
        r.extensions_mut().insert(Principal { tenant: None, ..p });
        assert_eq!(ti(r).unwrap_err().code(), tonic::Code::PermissionDenied);
    }

    #[test]
    fn revoked_token_stops_working() {
        let (a, tok) = auth_with_tenant();
        let e = a.find(&tok).unwrap();
        assert_eq!(a.find(&e.token_id).unwrap(), e);
        a.remove(&e.hash);
        assert_eq!(a.identify(&tok), None);
    }
}
