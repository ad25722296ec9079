//! Authentication: bearer token -> caller. Tenant tokens are kept only as SHA-256 hashes;
//! the admin token is compared in constant time. Two tonic interceptors put the resolved
//! [`Caller`] into each request's extensions: the `Broker` service admits tenants only,
//! the `Admin` service the admin only (a tenant there is `PERMISSION_DENIED`; no token or
//! an unknown one is `UNAUTHENTICATED` everywhere).

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
}

/// A tenant token, as kept (never the token itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenEntry {
    pub token_id: String,
    pub tenant: String,
    pub description: String,
    pub created_unix_ms: i64,
    pub hash: [u8; 32],
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
    admin_hash: [u8; 32],
    /// Token hash -> entry; read on every request, without the arbiter's lock.
    tokens: DashMap<[u8; 32], TokenEntry>,
}

impl Authenticator {
    pub fn new(admin_token: &str) -> Authenticator {
        Authenticator {
            admin_hash: hash_token(admin_token),
            tokens: DashMap::new(),
        }
    }

    /// Resolves a bearer token.
    pub fn identify(&self, token: &str) -> Option<Caller> {
        let h = hash_token(token);
        if bool::from(h.ct_eq(&self.admin_hash)) {
            return Some(Caller::Admin);
        }
        self.tokens
            .get(&h)
            .map(|e| Caller::Tenant(e.tenant.clone()))
    }

    pub fn add(&self, entry: TokenEntry) {
        self.tokens.insert(entry.hash, entry);
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
        self.tokens.remove(hash).map(|(_, e)| e)
    }

    /// Drops every token of `tenant`.
    pub fn remove_tenant(&self, tenant: &str) {
        self.tokens.retain(|_, e| e.tenant != tenant);
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

/// Reads `authorization: Bearer <token>` and resolves it.
fn caller_of<T>(auth: &Authenticator, req: &Request<T>) -> Result<Caller, Status> {
    let value = req
        .metadata()
        .get("authorization")
        .ok_or_else(|| Status::unauthenticated("missing authorization: Bearer <token>"))?;
    let value = value
        .to_str()
        .map_err(|_| Status::unauthenticated("malformed authorization header"))?;
    let token = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .ok_or_else(|| Status::unauthenticated("authorization must be: Bearer <token>"))?
        .trim();
    auth.identify(token)
        .ok_or_else(|| Status::unauthenticated("unknown or revoked token"))
}

/// Interceptor of the `Broker` service: tenants only.
pub fn tenant_interceptor(
    auth: Arc<Authenticator>,
) -> impl Fn(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |mut req: Request<()>| match caller_of(&auth, &req)? {
        Caller::Tenant(t) => {
            req.extensions_mut().insert(Caller::Tenant(t));
            Ok(req)
        }
        Caller::Admin => Err(Status::permission_denied(
            "the admin token is for the Admin service; workers use a tenant token",
        )),
    }
}

/// Interceptor of the `Admin` service: the admin only.
pub fn admin_interceptor(
    auth: Arc<Authenticator>,
) -> impl Fn(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |mut req: Request<()>| match caller_of(&auth, &req)? {
        Caller::Admin => {
            req.extensions_mut().insert(Caller::Admin);
            Ok(req)
        }
        Caller::Tenant(_) => Err(Status::permission_denied(
            "tenant tokens cannot call the Admin service",
        )),
    }
}

/// The tenant a `Broker` request was authenticated as.
pub fn tenant_of<T>(req: &Request<T>) -> Result<String, Status> {
    match req.extensions().get::<Caller>() {
        Some(Caller::Tenant(t)) => Ok(t.clone()),
        _ => Err(Status::unauthenticated("no tenant on this request")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_token(token: &str) -> Request<()> {
        let mut r = Request::new(());
        r.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        r
    }

    fn auth_with_tenant() -> (Arc<Authenticator>, String) {
        let a = Arc::new(Authenticator::new("admin-secret"));
        let (tok, hash) = generate_token();
        a.add(TokenEntry {
            token_id: token_id(&hash),
            tenant: "t1".into(),
            description: String::new(),
            created_unix_ms: 0,
            hash,
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
    fn revoked_token_stops_working() {
        let (a, tok) = auth_with_tenant();
        let e = a.find(&tok).unwrap();
        assert_eq!(a.find(&e.token_id).unwrap(), e);
        a.remove(&e.hash);
        assert_eq!(a.identify(&tok), None);
    }
}
