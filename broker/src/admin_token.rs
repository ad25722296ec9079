//! The admin token file: read it if present, otherwise generate a token into a new 0600
//! file (the log prints its path, never the token).

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
