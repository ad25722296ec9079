//! The admin token file: read it if present, otherwise generate a token into a new 0600
//! file (the log prints its path, never the token). A token read from a file must be one
//! nobody can guess: the shipped manifests' placeholder and short tokens are refused.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Why the admin token could not be had.
#[derive(Debug, thiserror::Error)]
pub enum AdminTokenError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}: the admin token file is empty")]
    Empty(PathBuf),
    #[error("{path}: mode {mode:o} lets others read the admin token; chmod 600 it")]
    TooOpen { path: PathBuf, mode: u32 },
    #[error(
        "{0}: the admin token is the example manifest's placeholder {PLACEHOLDER}: put a random \
         token there (e.g. `head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'`)"
    )]
    Placeholder(PathBuf),
    #[error(
        "{path}: the admin token has {len} characters, fewer than {MIN_ADMIN_TOKEN_CHARS}: \
         put a random token of at least {MIN_ADMIN_TOKEN_CHARS} there (e.g. `head -c 32 \
         /dev/urandom | od -An -tx1 | tr -d ' \\n'`)"
    )]
    TooShort { path: PathBuf, len: usize },
}

/// The value the example Secret ships with, refused so that applying it unchanged cannot
/// give a cluster a known admin token.
pub const PLACEHOLDER: &str = "REPLACE-WITH-A-RANDOM-TOKEN";

/// The shortest admin token accepted from a file: 128 bits as hex digits.
pub const MIN_ADMIN_TOKEN_CHARS: usize = 32;

/// Refuses a token that is the placeholder (or contains it) or shorter than
/// [`MIN_ADMIN_TOKEN_CHARS`].
fn check_guessable(path: &Path, token: &str) -> Result<(), AdminTokenError> {
    if token.contains(PLACEHOLDER) {
        return Err(AdminTokenError::Placeholder(path.to_path_buf()));
    }
    let len = token.chars().count();
    if len < MIN_ADMIN_TOKEN_CHARS {
        return Err(AdminTokenError::TooShort {
            path: path.to_path_buf(),
            len,
        });
    }
    Ok(())
}

/// Reads the token at `path`, or creates one there.
pub fn load_or_create(path: &Path) -> Result<String, AdminTokenError> {
    let io = |source| AdminTokenError::Io {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::read_to_string(path) {
        Ok(s) => {
            let mode = std::fs::metadata(path).map_err(io)?.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(AdminTokenError::TooOpen {
                    path: path.to_path_buf(),
                    mode,
                });
            }
            let t = s.trim().to_string();
            if t.is_empty() {
                return Err(AdminTokenError::Empty(path.to_path_buf()));
            }
            check_guessable(path, &t)?;
            Ok(t)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(io)?;
            }
            let (token, _) = crate::auth::generate_token();
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .map_err(io)?;
            f.write_all(format!("{token}\n").as_bytes()).map_err(io)?;
            tracing::warn!(path = %path.display(), "generated a new admin token (mode 0600)");
            Ok(token)
        }
        Err(e) => Err(io(e)),
    }
}

/// Longest grace for the old admin token after a rotation.
pub const MAX_ROTATION_GRACE: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

/// Replaces the admin token file's token with a new one (written 0600, atomically); the
/// old one keeps working for `grace` (`auth` accepts both meanwhile). Returns the new
/// token. Writes and syncs the file: call it off the runtime.
pub fn rotate(
    auth: &crate::auth::Authenticator,
    grace: std::time::Duration,
) -> Result<String, crate::error::BrokerError> {
    use crate::error::BrokerError;
    if grace > MAX_ROTATION_GRACE {
        return Err(BrokerError::InvalidArgument(format!(
            "grace is limited to {} hours",
            MAX_ROTATION_GRACE.as_secs() / 3600
        )));
    }
    let path = auth.admin_file().ok_or(BrokerError::NoAdminTokenFile)?;
    let (token, _) = crate::auth::generate_token();
    replace(&path, &token)
        .map_err(|e| BrokerError::Internal(format!("writing the new admin token: {e}")))?;
    auth.rotate_admin(&token, grace);
    tracing::warn!(path = %path.display(), grace = ?grace, "admin token rotated");
    Ok(token)
}

/// Atomically replaces the token at `path` with `token` (a new 0600 file renamed over
/// it, fsynced), so a reader sees the old token or the new one, never a partial file.
pub fn replace(path: &Path, token: &str) -> Result<(), AdminTokenError> {
    let io = |source| AdminTokenError::Io {
        path: path.to_path_buf(),
        source,
    };
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let tmp = dir.join(format!(
        ".{}.new-{}",
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "admin.token".into()),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io)?;
    let written = f
        .write_all(format!("{token}\n").as_bytes())
        .and_then(|_| f.sync_all())
        .and_then(|_| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_then_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/admin.token");
        let t = load_or_create(&p).unwrap();
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(load_or_create(&p).unwrap(), t);
    }

    #[test]
    fn replace_swaps_the_token_and_keeps_mode() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("admin.token");
        let old = load_or_create(&p).unwrap();
        let new = format!("gpb_{}", "7".repeat(64));
        replace(&p, &new).unwrap();
        assert_eq!(load_or_create(&p).unwrap(), new);
        assert_ne!(old, new);
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn refuses_the_placeholder_and_short_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("admin.token");
        let write = |text: &str| {
            std::fs::write(&p, text).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o400)).unwrap();
        };
        write("REPLACE-WITH-A-RANDOM-TOKEN\n");
        let e = load_or_create(&p).unwrap_err();
        assert!(matches!(e, AdminTokenError::Placeholder(_)), "{e}");
        assert!(e.to_string().contains("placeholder"), "{e}");
        std::fs::remove_file(&p).unwrap();
        write("hunter2-hunter2\n");
        let e = load_or_create(&p).unwrap_err();
        assert!(
            matches!(e, AdminTokenError::TooShort { len: 15, .. }),
            "{e}"
        );
        std::fs::remove_file(&p).unwrap();
        let fine = "0123456789abcdef".repeat(2);
        write(&fine);
        assert_eq!(load_or_create(&p).unwrap(), fine);
    }

    #[test]
    fn refuses_world_readable_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("admin.token");
        std::fs::write(&p, "x").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            load_or_create(&p),
            Err(AdminTokenError::TooOpen { .. })
        ));
    }
}
