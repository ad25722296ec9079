//! Reading a file the broker watches (the config file's tenants, the TLS certificate and
//! key): whoever can replace it must not be able to wedge or bloat the broker. The file is
//! opened with `O_NONBLOCK` (a FIFO's open then does not wait for a writer), must be a
//! regular file (checked on the open descriptor: no FIFO, device or socket, whatever a
//! symlink named) and is read up to a bound, past which it is refused. A caller on the
//! runtime runs this with `spawn_blocking`: even a regular file can sit on a slow disk.

use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The most a watched file may hold (a config file or a PEM chain is a few KiB).
pub const MAX_WATCHED_FILE_BYTES: u64 = 1 << 20;

/// Why a watched file was not read.
#[derive(Debug, thiserror::Error)]
pub enum FileReadError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: a {kind}, not a regular file: not read", path.display())]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("{}: larger than {max} bytes: not read", path.display())]
    TooLarge { path: PathBuf, max: u64 },
}

impl FileReadError {
    /// The file is not there (or not reachable): what a missing file means is the
    /// caller's to say.
    pub fn not_found(&self) -> bool {
        matches!(self, FileReadError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

fn kind(t: std::fs::FileType) -> &'static str {
    if t.is_fifo() {
        "FIFO"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_socket() {
        "socket"
    } else if t.is_dir() {
        "directory"
    } else {
        "special file"
    }
}

/// The contents of the regular file `path` (symlinks followed), at most `max` bytes.
/// Blocking: call it off the runtime.
pub fn read_regular(path: &Path, max: u64) -> Result<Vec<u8>, FileReadError> {
    read_regular_with_meta(path, max).map(|(bytes, _)| bytes)
}

/// [`read_regular`], with what the open descriptor's `fstat` said (its owner, say).
pub fn read_regular_with_meta(
    path: &Path,
    max: u64,
) -> Result<(Vec<u8>, std::fs::Metadata), FileReadError> {
    read_opened(path, max, 0)
}

/// [`read_regular_with_meta`] of a file that must not be a symbolic link: for a file in a
/// directory others may write, where a link could name any file the broker can read.
pub fn read_regular_no_symlink(
    path: &Path,
    max: u64,
) -> Result<(Vec<u8>, std::fs::Metadata), FileReadError> {
    read_opened(path, max, libc::O_NOFOLLOW)
}

fn read_opened(
    path: &Path,
    max: u64,
    extra_flags: i32,
) -> Result<(Vec<u8>, std::fs::Metadata), FileReadError> {
    let io = |source| FileReadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | extra_flags)
        .open(path)
        .map_err(io)?;
    let meta = f.metadata().map_err(io)?;
    if !meta.file_type().is_file() {
        return Err(FileReadError::NotRegular {
            path: path.to_path_buf(),
            kind: kind(meta.file_type()),
        });
    }
    let too_large = || FileReadError::TooLarge {
        path: path.to_path_buf(),
        max,
    };
    if meta.len() > max {
        return Err(too_large());
    }
    // It may grow between the look and the read: never more than `max` + 1 bytes.
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    f.take(max + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > max {
        return Err(too_large());
    }
    Ok((bytes, meta))
}

/// [`read_regular`] on a blocking thread.
pub async fn read_regular_off_runtime(path: &Path, max: u64) -> Result<Vec<u8>, FileReadError> {
    let p = path.to_path_buf();
    tokio::task::spawn_blocking(move || read_regular(&p, max))
        .await
        .unwrap_or_else(|e| {
            Err(FileReadError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other(e),
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mkfifo(p: &Path) {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid, NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    #[test]
    fn a_regular_file_within_the_bound_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, b"x = 1\n").unwrap();
        assert_eq!(read_regular(&f, 6).unwrap(), b"x = 1\n");
        let e = read_regular(&f, 5).unwrap_err();
        assert!(matches!(e, FileReadError::TooLarge { max: 5, .. }), "{e}");
        let gone = read_regular(&dir.path().join("none"), 5).unwrap_err();
        assert!(gone.not_found(), "{gone}");
    }

    /// A FIFO with no writer, `/dev/zero` behind a symlink and a sparse file of 10 GiB are
    /// refused at once, without waiting or reading them.
    #[test]
    fn a_fifo_a_device_or_a_huge_file_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        let zero = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let sparse = dir.path().join("sparse");
        std::fs::File::create(&sparse)
            .unwrap()
            .set_len(10 << 30)
            .unwrap();
        let t0 = std::time::Instant::now();
        let e = read_regular(&fifo, MAX_WATCHED_FILE_BYTES).unwrap_err();
        assert!(
            matches!(e, FileReadError::NotRegular { kind: "FIFO", .. }),
            "{e}"
        );
        let e = read_regular(&zero, MAX_WATCHED_FILE_BYTES).unwrap_err();
        assert!(
            matches!(
                e,
                FileReadError::NotRegular {
                    kind: "character device",
                    ..
                }
            ),
            "{e}"
        );
        let e = read_regular(&sparse, MAX_WATCHED_FILE_BYTES).unwrap_err();
        assert!(matches!(e, FileReadError::TooLarge { .. }), "{e}");
        assert!(e.to_string().contains("larger than 1048576 bytes"), "{e}");
        let e = read_regular(dir.path(), MAX_WATCHED_FILE_BYTES).unwrap_err();
        assert!(matches!(e, FileReadError::NotRegular { .. }), "{e}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(1));
    }
}
