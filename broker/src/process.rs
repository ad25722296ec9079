//! Process liveness: whether a pid still runs (`/proc` state; a zombie counts as gone)
//! and a future that resolves when it exits (pidfd, falling back to polling). Used for
//! session peers (their memory may be reused once they are gone) and for block files
//! left by a dead broker.

use std::time::Duration;

/// Is process `pid` still running? A zombie (exited, not yet reaped) counts as gone:
/// its memory mappings are already released.
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // Format: pid (comm) state ... ; comm may hold spaces and parentheses.
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next());
            !matches!(state, Some("Z") | Some("X") | Some("x"))
        }
        Err(_) => false,
    }
}

/// Resolves when process `pid` exits. Uses a pidfd (no polling, immune to pid reuse
/// after the watch starts) and falls back to polling `/proc` every 200 ms.
pub async fn wait_for_exit(pid: u32) {
    if let Some(fd) = pidfd_open(pid) {
        // SAFETY: `fd` is an OwnedFd moved into the AsyncFd, so it stays open exactly as
        // long as the registration.
        let registered = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
        };
        if let Ok(afd) = registered {
            let _ = afd.readable().await;
            return;
        }
    }
    while process_alive(pid) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn pidfd_open(pid: u32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain syscall; a non-negative result is a new fd we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd is a fresh, valid descriptor owned by nobody else.
    Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive_and_bogus_pid_is_not() {
        assert!(process_alive(std::process::id()));
        assert!(!process_alive(u32::MAX - 1));
    }

    #[tokio::test]
    async fn wait_for_exit_sees_a_child_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        let pid = child.id();
        let waiter = tokio::spawn(wait_for_exit(pid));
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("exit seen within 5 s")
            .unwrap();
        let _ = child.wait();
        assert!(!process_alive(pid));
    }
}
