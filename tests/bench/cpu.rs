//! CPU accounting from /proc: CPU time of given processes and of the whole machine over a
//! window, in cores (1.0 = one core busy for the whole window). Tells how the two cores
//! were split between the broker, the load generator, and anything else running.

use std::time::Instant;

/// CPU times at one instant.
#[derive(Clone, Debug)]
pub struct Snapshot {
    at: Instant,
    pids: Vec<Option<f64>>,
    machine_busy: Option<f64>,
}

/// CPU used over a window, in cores.
#[derive(Clone, Debug, Default)]
pub struct Usage {
    /// One entry per pid given to [`snapshot`], `None` when unreadable.
    pub pids: Vec<Option<f64>>,
    /// Every process on the machine.
    pub machine: Option<f64>,
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    t.max(1) as f64
}

/// User + system CPU seconds of `pid` (its threads included).
pub fn process_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state); utime and stime are fields 14 and 15.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / ticks_per_second())
}

/// Busy CPU seconds of the whole machine (all but idle and iowait).
fn machine_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|x| x.parse().ok())
        .collect();
    if v.len() < 5 {
        return None;
    }
    let total: f64 = v.iter().sum();
    Some((total - v[3] - v[4]) / ticks_per_second())
}

pub fn snapshot(pids: &[u32]) -> Snapshot {
    Snapshot {
        at: Instant::now(),
        pids: pids.iter().map(|&p| process_seconds(p)).collect(),
        machine_busy: machine_seconds(),
    }
}

/// CPU used between two snapshots of the same pids.
pub fn between(a: &Snapshot, b: &Snapshot) -> Usage {
    let secs = (b.at - a.at).as_secs_f64().max(1e-9);
    let d = |x: Option<f64>, y: Option<f64>| match (x, y) {
        (Some(x), Some(y)) => Some((y - x) / secs),
        _ => None,
    };
    Usage {
        pids: a.pids.iter().zip(&b.pids).map(|(&x, &y)| d(x, y)).collect(),
        machine: d(a.machine_busy, b.machine_busy),
    }
}

/// CPU use of the broker and this process over a stretch of a run, for the report.
pub struct Meter {
    start: Snapshot,
    pids: Vec<u32>,
}

impl Meter {
    /// Starts measuring the broker (if its pid is known) and this process.
    pub fn start(broker: Option<u32>) -> Meter {
        let mut pids = vec![std::process::id()];
        pids.extend(broker);
        Meter {
            start: snapshot(&pids),
            pids,
        }
    }

    /// One line: broker, bench, and everything else on the machine, in % of one core.
    pub fn line(&self) -> String {
        let now = snapshot(&self.pids);
        if (now.at - self.start.at).as_secs_f64() < 0.5 {
            return "CPU during the run: window too short to measure (< 0.5 s)".into();
        }
        let u = between(&self.start, &now);
        let bench = u.pids.first().copied().flatten();
        let broker = u.pids.get(1).copied().flatten();
        let others = match (u.machine, bench, broker) {
            (Some(m), Some(b), Some(k)) => Some((m - b - k).max(0.0)),
            (Some(m), Some(b), None) => Some((m - b).max(0.0)),
            _ => None,
        };
        format!(
            "CPU during the run (% of one core, 2 cores = 200%): broker {}, bench {}, other processes {}",
            show(broker),
            show(bench),
            show(others)
        )
    }
}

/// A percentage of one core, or `-`.
pub fn show(cores: Option<f64>) -> String {
    cores
        .map(|c| format!("{:.0}%", c * 100.0))
        .unwrap_or_else(|| "-".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_cpu_time() {
        let me = std::process::id();
        let a = snapshot(&[me]);
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        assert!(x > 0);
        let u = between(&a, &snapshot(&[me]));
        assert!(u.pids[0].is_some());
        assert!(u.machine.is_some());
    }
}
