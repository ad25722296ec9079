//! Which broker socket `gpu-brokerctl` talks to when it is not told: operators' commands
//! go to the operators' socket (`--admin-listen`, served on the broker's operators'
//! runtime, so an operator's loop never takes a worker thread from acquires) when the node
//! has one, else to the workers' socket; `run` (a worker) always goes to the workers'
//! socket, the only one that serves the Broker service.

use std::os::unix::fs::FileTypeExt;
use std::path::Path;

/// The workers' socket of a packaged broker (`deploy/config.toml` `socket`).
pub const WORKERS_SOCKET: &str = "/run/gpu-broker/broker.sock";

/// The operators' socket of a packaged broker (`deploy/config.toml` `admin-listen`).
pub const OPERATORS_SOCKET: &str = "/run/gpu-broker/admin.sock";

/// The address to use: `given` (`--broker` or `GPU_BROKER_ADDR`) when there is one; else,
/// for an operator's command, `operators` when a socket is there, and `workers` otherwise.
pub fn resolve(given: Option<&str>, operator: bool, operators: &Path, workers: &str) -> String {
    if let Some(a) = given {
        return a.to_string();
    }
    let is_socket = std::fs::metadata(operators).is_ok_and(|m| m.file_type().is_socket());
    if operator && is_socket {
        format!("unix://{}", operators.display())
    } else {
        format!("unix://{workers}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operators_go_to_the_operators_socket_only_where_there_is_one() {
        let dir = tempfile::tempdir().unwrap();
        let ops = dir.path().join("admin.sock");
        let workers = "/run/w/broker.sock";
        let want_workers = "unix:///run/w/broker.sock".to_string();
        assert_eq!(resolve(None, true, &ops, workers), want_workers, "no file");
        std::fs::write(&ops, b"").unwrap();
        assert_eq!(
            resolve(None, true, &ops, workers),
            want_workers,
            "a file that is not a socket"
        );
        std::fs::remove_file(&ops).unwrap();
        let _listener = std::os::unix::net::UnixListener::bind(&ops).unwrap();
        assert_eq!(
            resolve(None, true, &ops, workers),
            format!("unix://{}", ops.display())
        );
        assert_eq!(
            resolve(None, false, &ops, workers),
            want_workers,
            "a worker's command goes to the workers' socket"
        );
        assert_eq!(
            resolve(Some("http://h:1"), true, &ops, workers),
            "http://h:1",
            "what the operator names wins"
        );
    }
}
