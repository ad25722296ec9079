//! The driver's checkpoint: one JSON file recording, per claim uid, how far its prepare
//! got (`PrepareStarted` before anything is asked of the broker, `PrepareCompleted` once
//! the reservation, the token file and the CDI spec exist) and what to undo, with the
//! node's boot id. Written whole to a temporary file, synced and renamed over the old one,
//! so a crash leaves the previous or the next version, never half of one.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("checkpoint {path} is not a checkpoint: {source}")]
    Corrupt {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// How far a claim's prepare got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClaimState {
    /// Recorded before the broker is asked: a restart finding it rolls the claim back.
    PrepareStarted,
    /// Everything exists: a second prepare answers from here.
    PrepareCompleted,
}

/// What the kubelet is told about a prepared claim's device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedDevice {
    pub request: String,
    pub pool: String,
    pub device: String,
    pub cdi_ids: Vec<String>,
    pub share_id: Option<String>,
}

/// One claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimEntry {
    pub state: ClaimState,
    pub namespace: String,
    pub name: String,
    /// Set once the broker reserved it.
    #[serde(default)]
    pub reservation_id: String,
    #[serde(default)]
    pub device: Option<PreparedDevice>,
    /// The broker device and the bytes reserved there (to reserve again after the
    /// broker restarted).
    #[serde(default)]
    pub index: u32,
    #[serde(default)]
    pub bytes: u64,
}

/// The whole checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The boot the entries were made in (`/proc/sys/kernel/random/boot_id`).
    pub boot_id: String,
    pub claims: BTreeMap<String, ClaimEntry>,
}

/// The checkpoint's file.
#[derive(Clone, Debug)]
pub struct CheckpointFile {
    path: PathBuf,
}

impl CheckpointFile {
    pub fn new(path: impl Into<PathBuf>) -> CheckpointFile {
        CheckpointFile { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The recorded checkpoint; an empty one when there is no file yet. A file that is
    /// not a checkpoint is an error, not a fresh start: claims it records would leak.
    pub fn load(&self) -> Result<Checkpoint, CheckpointError> {
        match std::fs::read(&self.path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes).map_err(|source| CheckpointError::Corrupt {
                    path: self.path.clone(),
                    source,
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Checkpoint::default()),
            Err(source) => Err(self.io(source)),
        }
    }

    /// Replaces the file with `c`, durably.
    pub fn save(&self, c: &Checkpoint) -> Result<(), CheckpointError> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| self.io(e))?;
        let tmp = self.path.with_extension("tmp");
        let body = serde_json::to_vec_pretty(c).expect("a checkpoint serializes");
        let mut f = std::fs::File::create(&tmp).map_err(|e| self.io(e))?;
        f.write_all(&body).map_err(|e| self.io(e))?;
        f.sync_all().map_err(|e| self.io(e))?;
        std::fs::rename(&tmp, &self.path).map_err(|e| self.io(e))?;
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| self.io(e))
    }

    fn io(&self, source: std::io::Error) -> CheckpointError {
        CheckpointError::Io {
            path: self.path.clone(),
            source,
        }
    }
}

/// This boot's id ("" where the kernel does not say).
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_survives_a_save_and_a_broken_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let f = CheckpointFile::new(dir.path().join("sub/checkpoint.json"));
        assert_eq!(f.load().unwrap(), Checkpoint::default());
        let mut c = Checkpoint {
            boot_id: boot_id(),
            ..Default::default()
        };
        c.claims.insert(
            "u1".into(),
            ClaimEntry {
                state: ClaimState::PrepareStarted,
                namespace: "ns".into(),
                name: "c".into(),
                reservation_id: String::new(),
                device: None,
                index: 0,
                bytes: 0,
            },
        );
        f.save(&c).unwrap();
        assert_eq!(f.load().unwrap(), c);
        std::fs::write(f.path(), b"{not json").unwrap();
        assert!(matches!(f.load(), Err(CheckpointError::Corrupt { .. })));
    }
}
