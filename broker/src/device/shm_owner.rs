//! Who owns the block files in a shared-memory directory. Each host device holds an
//! exclusive `flock` on `<prefix>lock` for its lifetime; at start a device removes only the
//! files of prefixes whose lock nobody holds (their broker is gone, however it died). A pid
//! in a file name says nothing across PID namespaces (two containers sharing `/dev/shm`),
//! so it is used only for files of older brokers that wrote no lock file, and only when the
//! pid is certainly gone.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// Names of block files start with this.
pub const FILE_PREFIX: &str = "gpu-broker-";
/// The lock file of a prefix is `<prefix>lock`.
const LOCK_SUFFIX: &str = "lock";

/// An exclusive lock on a prefix's lock file, held while the device lives; the lock file
/// is removed on drop.
#[derive(Debug)]
pub struct OwnerLock {
    _file: File,
    path: PathBuf,
}

impl OwnerLock {
    /// Creates and locks `<dir>/<prefix>lock`. The file is created under a name no other
    /// broker considers, locked, then renamed into place, so nobody ever sees it unlocked.
    pub fn take(dir: &Path, prefix: &str) -> std::io::Result<OwnerLock> {
        let tmp = dir.join(format!(".{prefix}{LOCK_SUFFIX}"));
        let path = dir.join(format!("{prefix}{LOCK_SUFFIX}"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&tmp)?;
        if !try_lock(&file) {
            return Err(std::io::Error::other(format!(
                "{} is locked by another process",
                tmp.display()
            )));
        }
        std::fs::rename(&tmp, &path)?;
        Ok(OwnerLock { _file: file, path })
    }
}

impl Drop for OwnerLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Takes an exclusive, non-blocking `flock`; false if another open file holds it.
fn try_lock(f: &File) -> bool {
    // SAFETY: plain syscall on a descriptor we own.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// The prefix of a block or lock file name (`gpu-broker-<pid>-<tag>-dev<i>-`) and the pid
/// in it.
fn prefix_of(name: &str) -> Option<(&str, u32)> {
    let rest = name.strip_prefix(FILE_PREFIX)?;
    let pid = rest.split('-').next()?.parse::<u32>().ok()?;
    let cut = name.rfind('-')?;
    Some((&name[..=cut], pid))
}

/// Is the owner of `prefix` in `dir` gone? With a lock file: nobody holds its lock. Without
/// one (a broker of an older version): its pid is certainly gone.
fn owner_gone(dir: &Path, prefix: &str, pid: u32) -> bool {
    let lock = dir.join(format!("{prefix}{LOCK_SUFFIX}"));
    match File::open(&lock) {
        Ok(f) => try_lock(&f),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            pid != std::process::id() && crate::process::process_gone(pid)
        }
        // Cannot tell: keep the files.
        Err(_) => false,
    }
}

/// Removes block files a broker that died without cleaning up (SIGKILL) left behind, and
/// their lock files; never the files of a live broker.
pub fn remove_stale_files(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut gone: std::collections::HashMap<String, bool> = Default::default();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some((prefix, pid)) = name.to_str().and_then(prefix_of) else {
            continue;
        };
        let stale = *gone
            .entry(prefix.to_string())
            .or_insert_with(|| owner_gone(dir, prefix, pid));
        if stale && std::fs::remove_file(e.path()).is_ok() {
            tracing::info!(path = %e.path().display(), "removed a block file left by a dead broker");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_of_a_live_owner_stay_whatever_its_pid_says() {
        let dir = tempfile::tempdir().unwrap();
        // A live broker in another PID namespace: its pid means nothing here.
        let prefix = "gpu-broker-4000000-abcd1234-dev0-";
        let lock = OwnerLock::take(dir.path(), prefix).unwrap();
        let block = dir.path().join(format!("{prefix}1"));
        std::fs::write(&block, b"x").unwrap();
        remove_stale_files(dir.path());
        assert!(block.exists(), "a live broker's block was removed");
        drop(lock);
        remove_stale_files(dir.path());
        assert!(!block.exists(), "a dead broker's block was kept");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn an_unheld_lock_file_marks_its_files_stale() {
        let dir = tempfile::tempdir().unwrap();
        // Our own pid, so the pid check alone would keep them.
        let prefix = format!("gpu-broker-{}-ffff0000-dev1-", std::process::id());
        std::fs::write(dir.path().join(format!("{prefix}lock")), b"").unwrap();
        std::fs::write(dir.path().join(format!("{prefix}7")), b"x").unwrap();
        remove_stale_files(dir.path());
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
