//! Declared tokens: the `[tokens.NAME]` tables of the config file, so that every broker
//! reading the same file (every node's, from one ConfigMap) accepts the same tokens. A
//! table names a token by its SHA-256 only (`sha256 = "<64 hex digits>"`, of the token as
//! the client sends it), with its `scope` (worker, read or admin; default worker) and, for
//! worker tokens, its `tenant`, which the same file must declare. The token itself stays in
//! a Secret; the file holds nothing that lets anyone in.
//!
//! Declared tokens live beside the minted ones in the authenticator but never in the state
//! store: each apply makes the file's set the declared set (new ones accepted, ones no
//! longer declared refused, their sessions ended). They cannot be revoked by RPC (the file
//! would bring them back): they are removed from the file.

use crate::arbiter::Arbiter;
use crate::auth::{token_id, Scope, TokenEntry};
use crate::file_read::{read_regular, FileReadError, MAX_WATCHED_FILE_BYTES};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why a config file's tokens could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    /// Not read: missing, unreadable, not a regular file or too large.
    #[error(transparent)]
    Read(#[from] FileReadError),
    #[error("{}: not UTF-8 text", path.display())]
    NotText { path: PathBuf },
    #[error("{}:{line}: {reason}", path.display())]
    Invalid {
        path: PathBuf,
        line: usize,
        reason: String,
    },
}

/// One `[tokens.NAME]` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeclaredToken {
    pub name: String,
    pub scope: Scope,
    /// The tenant of a worker token or of a tenant's read token.
    pub tenant: Option<String>,
    pub hash: [u8; 32],
}

impl DeclaredToken {
    /// The authenticator's entry for this token (`created_unix_ms`: when first accepted).
    fn entry(&self, created_unix_ms: i64) -> TokenEntry {
        TokenEntry {
            token_id: token_id(&self.hash),
            tenant: self.tenant.clone().unwrap_or_default(),
            hash: self.hash,
            description: "declared in the config file".into(),
            created_unix_ms,
            name: self.name.clone(),
            scope: self.scope,
            expires_unix_ms: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenTable {
    tenant: Option<toml::Spanned<String>>,
    scope: Option<toml::Spanned<String>>,
    sha256: toml::Spanned<String>,
}

#[derive(Deserialize)]
struct FileTokens {
    #[serde(default)]
    tokens: BTreeMap<toml::Spanned<String>, toml::Spanned<TokenTable>>,
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The tokens declared in `text` (the contents of `path`, named in errors); `tenants` are
/// the names of the tenants the same file declares (a token's tenant must be one of them).
pub fn parse(
    path: &Path,
    text: &str,
    tenants: &[String],
) -> Result<Vec<DeclaredToken>, TokensError> {
    let invalid = |offset: usize, reason: String| TokensError::Invalid {
        path: path.to_path_buf(),
        line: line_of(text, offset),
        reason,
    };
    let file: FileTokens = toml::from_str(text).map_err(|e| {
        let at = e.span().map(|s| s.start).unwrap_or(0);
        invalid(at, e.message().to_string())
    })?;
    let mut out = Vec::new();
    let mut seen: HashMap<[u8; 32], String> = HashMap::new();
    for (name, table) in file.tokens {
        let at = name.span().start;
        let name = name.into_inner();
        crate::ledger::validate_tenant_name(&name)
            .map_err(|e| invalid(at, format!("token name {name:?}: {e}")))?;
        let t = table.into_inner();
        let scope = match &t.scope {
            None => Scope::Worker,
            Some(s) => match s.get_ref().as_str() {
                "" => None,
                other => Scope::parse(other),
            }
            .ok_or_else(|| {
                invalid(
                    s.span().start,
                    format!(
                        "tokens.{name}.scope: {:?} is not worker, read or admin",
                        s.get_ref()
                    ),
                )
            })?,
        };
        let tenant = t.tenant.map(|s| (s.span().start, s.into_inner()));
        match (scope, &tenant) {
            (Scope::Worker, None) => {
                return Err(invalid(
                    at,
                    format!("tokens.{name}: a worker token needs a `tenant`"),
                ))
            }
            (Scope::Admin, Some((at, _))) => {
                return Err(invalid(
                    *at,
                    format!("tokens.{name}: an admin token has no tenant"),
                ))
            }
            _ => {}
        }
        if let Some((at, tenant)) = &tenant {
            if !tenants.contains(tenant) {
                return Err(invalid(
                    *at,
                    format!(
                        "tokens.{name}.tenant: {tenant:?} is not declared in this file (add a \
                         [tenants.{tenant}] table: every node must know the tenant)"
                    ),
                ));
            }
        }
        let sha_at = t.sha256.span().start;
        let mut hash = [0u8; 32];
        hex::decode_to_slice(t.sha256.get_ref().trim(), &mut hash).map_err(|_| {
            invalid(
                sha_at,
                format!(
                    "tokens.{name}.sha256: not a SHA-256 (64 hex digits); make it with \
                     `printf %s \"$TOKEN\" | sha256sum`"
                ),
            )
        })?;
        if let Some(other) = seen.insert(hash, name.clone()) {
            return Err(invalid(
                sha_at,
                format!("tokens.{name}: the same token as tokens.{other}"),
            ));
        }
        out.push(DeclaredToken {
            name,
            scope,
            tenant: tenant.map(|(_, t)| t),
            hash,
        });
    }
    Ok(out)
}

/// Reads `path` (a regular file of at most 1 MiB) and parses its tokens.
pub fn load(path: &Path, tenants: &[String]) -> Result<Vec<DeclaredToken>, TokensError> {
    let bytes = read_regular(path, MAX_WATCHED_FILE_BYTES)?;
    let text = std::str::from_utf8(&bytes).map_err(|_| TokensError::NotText {
        path: path.to_path_buf(),
    })?;
    parse(path, text, tenants)
}

/// What an apply changed: the names of the tokens now accepted that were not, and of
/// those no longer accepted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenChanges {
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

/// Makes `tokens` the declared set of `arb`'s authenticator; the sessions of tokens no
/// longer declared end (as a revocation ends them).
pub fn apply(arb: &Arc<Arbiter>, tokens: &[DeclaredToken], why: &str) -> TokenChanges {
    let now = crate::units::unix_ms(std::time::SystemTime::now());
    let entries = tokens.iter().map(|t| t.entry(now)).collect();
    let (added, removed) = arb.authenticator().replace_declared(entries);
    for e in &added {
        tracing::info!(why, token_id = %e.token_id, name = %e.name, scope = %e.scope, tenant = %e.tenant, "config: token declared");
    }
    for e in &removed {
        tracing::warn!(why, token_id = %e.token_id, name = %e.name, "config: token no longer declared: refused from now on");
        arb.sessions()
            .end_of_token(&e.token_id, "the session's token is no longer declared");
    }
    TokenChanges {
        added: added.into_iter().map(|e| e.name).collect(),
        removed: removed.into_iter().map(|e| e.name).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenants(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    fn sha(token: &str) -> String {
        hex::encode(crate::auth::hash_token(token))
    }

    #[test]
    fn parses_worker_read_and_admin_tokens() {
        let text = format!(
            "[tenants.training]\nlimit = \"1GiB\"\n\n[tokens.training-workers]\ntenant = \"training\"\nsha256 = \"{}\"\n\n[tokens.prometheus]\nscope = \"read\"\nsha256 = \"{}\"\n\n[tokens.ops]\nscope = \"admin\"\nsha256 = \"{}\"\n",
            sha("w"),
            sha("r"),
            sha("a").to_uppercase()
        );
        let t = parse(Path::new("c.toml"), &text, &tenants(&["training"])).unwrap();
        let by = |n: &str| t.iter().find(|t| t.name == n).unwrap().clone();
        assert_eq!(
            by("training-workers"),
            DeclaredToken {
                name: "training-workers".into(),
                scope: Scope::Worker,
                tenant: Some("training".into()),
                hash: crate::auth::hash_token("w"),
            }
        );
        assert_eq!(by("prometheus").scope, Scope::Read);
        assert_eq!(by("prometheus").tenant, None);
        assert_eq!(by("ops").hash, crate::auth::hash_token("a"));
    }

    #[test]
    fn errors_name_file_line_and_reason() {
        let h = sha("x");
        for (text, line, want) in [
            (
                format!("[tokens.a]\nsha256 = \"{h}\"\n"),
                1,
                "a worker token needs a `tenant`",
            ),
            (
                format!("[tokens.a]\ntenant = \"nobody\"\nsha256 = \"{h}\"\n"),
                2,
                "\"nobody\" is not declared in this file",
            ),
            (
                format!("[tokens.a]\nscope = \"root\"\nsha256 = \"{h}\"\n"),
                2,
                "is not worker, read or admin",
            ),
            (
                format!("[tokens.a]\nscope = \"admin\"\ntenant = \"t\"\nsha256 = \"{h}\"\n"),
                3,
                "an admin token has no tenant",
            ),
            (
                "[tokens.a]\ntenant = \"t\"\nsha256 = \"REPLACE-ME\"\n".to_string(),
                3,
                "not a SHA-256",
            ),
            (
                format!("[tokens.a]\ntenant = \"t\"\nsha256 = \"{h}\"\n[tokens.b]\ntenant = \"t\"\nsha256 = \"{h}\"\n"),
                6,
                "the same token as tokens.a",
            ),
            (
                format!("[tokens.a]\ntenant = \"t\"\nsha256 = \"{h}\"\nexpires = 3\n"),
                4,
                "unknown field",
            ),
        ] {
            let e = parse(Path::new("c.toml"), &text, &tenants(&["t"]))
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with(&format!("c.toml:{line}: ")) && e.contains(want),
                "{text}: {e}"
            );
        }
    }
}
