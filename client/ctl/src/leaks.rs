//! `gpu-brokerctl leaks`: what looks leaked, seen from outside the workers — leases held
//! far past a threshold (the broker does not see whether a worker still touches a lease,
//! so age is the measure), quarantined memory with the process that may still map it, and
//! processes whose own GPU memory (NVML, on CUDA nodes) exceeds the broker's allowance,
//! i.e. that allocate behind the broker's back.

use std::time::{Duration, SystemTime};

use serde::Serialize;

use gpu_broker_client::table::Table;
use gpu_broker_client::units::{format_age_at, format_bytes, format_duration};
use gpu_broker_client::{LeaseInfo, QuarantinedBlock, SessionInfo};

use super::status::Snapshot;

/// The three kinds of suspects.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Leaks {
    /// Leases older than the threshold, oldest first, with the session holding them.
    pub old_leases: Vec<(LeaseInfo, Option<SessionInfo>)>,
    pub quarantined: Vec<QuarantinedBlock>,
    /// Sessions whose process uses more GPU memory of its own than the allowance.
    pub over_allowance: Vec<SessionInfo>,
}

impl Leaks {
    pub fn is_empty(&self) -> bool {
        self.old_leases.is_empty() && self.quarantined.is_empty() && self.over_allowance.is_empty()
    }
}

fn age_of(unix_ms: i64, now: SystemTime) -> Duration {
    let then = SystemTime::UNIX_EPOCH + Duration::from_millis(unix_ms.max(0) as u64);
    now.duration_since(then).unwrap_or_default()
}

/// Picks the suspects out of a snapshot.
pub fn find(s: &Snapshot, older_than: Duration, now: SystemTime) -> Leaks {
    let mut old: Vec<(LeaseInfo, Option<SessionInfo>)> = s
        .leases
        .iter()
        .filter(|l| age_of(l.created_unix_ms, now) > older_than)
        .map(|l| {
            let session = s
                .sessions
                .iter()
                .find(|x| x.session_id == l.session_id)
                .cloned();
            (l.clone(), session)
        })
        .collect();
    old.sort_by_key(|(l, _)| l.created_unix_ms);
    Leaks {
        old_leases: old,
        quarantined: s.quarantined.clone(),
        over_allowance: s
            .sessions
            .iter()
            .filter(|x| x.over_allowance)
            .cloned()
            .collect(),
    }
}

/// The command name of a local process, when this machine has it (`/proc/PID/comm`).
fn command_of(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| "-".into())
}

/// The report, in three sections.
pub fn render(l: &Leaks, older_than: Duration, now: SystemTime) -> String {
    let w = Some(crate::tables::WIDTH);
    let mut out = format!(
        "LEASES HELD LONGER THAN {} ({})\n",
        format_duration(older_than),
        l.old_leases.len()
    );
    if !l.old_leases.is_empty() {
        let mut t = Table::new(["LEASE", "TENANT", "SIZE", "AGE", "PID", "SESSION"])
            .right(&[2, 3, 4])
            .fit(w, &[1, 5]);
        for (lease, session) in &l.old_leases {
            t.row([
                lease.lease_id.clone(),
                lease.tenant.clone(),
                format_bytes(lease.bytes),
                format_age_at(lease.created_unix_ms, now),
                session
                    .as_ref()
                    .filter(|s| s.peer_pid != 0)
                    .map(|s| s.peer_pid.to_string())
                    .unwrap_or_else(|| "-".into()),
                session.as_ref().map(|s| s.name.clone()).unwrap_or_default(),
            ]);
        }
        out.push_str(&t.render());
    }
    let total: u64 = l.quarantined.iter().map(|q| q.bytes).sum();
    out.push_str(&format!(
        "\nQUARANTINED MEMORY ({} blocks, {}): freed when its holders let go or exit; \
         nothing lifts it\n",
        l.quarantined.len(),
        format_bytes(total)
    ));
    if !l.quarantined.is_empty() {
        let mut t = Table::new([
            "LEASE", "TENANT", "DEV", "SIZE", "FOR", "WHY", "PIDS", "COMMAND",
        ])
        .right(&[2, 3, 4])
        .fit(w, &[1, 7]);
        for q in &l.quarantined {
            let why = match q.reason {
                gpu_broker_client::HoldReason::Importers => {
                    format!("{} importers", q.importers)
                }
                r => r.describe().to_string(),
            };
            let pids = if q.holder_pids.is_empty() {
                "-".to_string()
            } else {
                q.holder_pids
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let command = if q.holder_pids.is_empty() {
                "(tcp peer)".to_string()
            } else {
                q.holder_pids
                    .iter()
                    .map(|&p| command_of(p))
                    .collect::<Vec<_>>()
                    .join(",")
            };
            t.row([
                q.lease_id.clone(),
                q.tenant.clone(),
                q.device.to_string(),
                format_bytes(q.bytes),
                format_age_at(q.since_unix_ms, now),
                why,
                pids,
                command,
            ]);
        }
        out.push_str(&t.render());
    }
    out.push_str(&format!(
        "\nPROCESSES USING GPU MEMORY BEYOND THEIR LEASES ({})\n",
        l.over_allowance.len()
    ));
    if !l.over_allowance.is_empty() {
        let mut t = Table::new([
            "PID",
            "TENANT",
            "SESSION",
            "GPU_USED",
            "LEASED",
            "OWN_ALLOC",
        ])
        .right(&[0, 3, 4, 5])
        .fit(w, &[1, 2]);
        for s in &l.over_allowance {
            t.row([
                s.peer_pid.to_string(),
                s.tenant.clone(),
                s.name.clone(),
                format_bytes(s.gpu_used_bytes),
                format_bytes(s.held_bytes),
                format_bytes(s.own_alloc_bytes),
            ]);
        }
        out.push_str(&t.render());
    }
    if l.is_empty() {
        out.push_str("\nnothing looks leaked\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::status::tests::{now, snapshot};
    use super::*;

    #[test]
    fn finds_old_leases_quarantine_and_greedy_processes() {
        let mut s = snapshot();
        s.quarantined.push(QuarantinedBlock {
            lease_id: "33333333-3333-4333-8333-333333333333".into(),
            tenant: "training".into(),
            device: 0,
            bytes: 7 << 30,
            pid: Some(4242),
            since_unix_ms: 999_999_000_000,
            reason: gpu_broker_client::HoldReason::Holder,
            holder_pids: vec![4242],
            ..Default::default()
        });
        s.quarantined.push(QuarantinedBlock {
            lease_id: "44444444-4444-4444-8444-444444444444".into(),
            tenant: "weights".into(),
            device: 0,
            bytes: 3 << 30,
            pid: None,
            since_unix_ms: 999_999_500_000,
            reason: gpu_broker_client::HoldReason::Importers,
            holder_pids: vec![5151, 5252],
            publication_id: Some("p".into()),
            importers: 2,
        });
        s.sessions.push(SessionInfo {
            session_id: "s".into(),
            tenant: "inference".into(),
            name: "greedy".into(),
            peer_pid: 777,
            gpu_used_bytes: 5 << 30,
            own_alloc_bytes: 5 << 30,
            over_allowance: true,
            ..Default::default()
        });
        let l = find(&s, Duration::from_secs(3600), now());
        assert_eq!(l.old_leases.len(), 1, "only the 2 h old lease");
        assert_eq!(l.old_leases[0].0.label, "weights");
        assert_eq!(l.quarantined.len(), 2);
        assert_eq!(l.over_allowance.len(), 1);
        let text = render(&l, Duration::from_secs(3600), now());
        for line in text.lines() {
            assert!(line.chars().count() <= 100, "{line:?}");
        }
        for want in [
            "LONGER THAN 1h00m (1)",
            "11111111",
            "4242",
            "7.0 GiB",
            "greedy",
            "5.0 GiB",
            "2 importers",
            "5151,5252",
            "holder",
            "nothing lifts it",
        ] {
            assert!(text.contains(want), "{want:?} in\n{text}");
        }
        assert!(find(&snapshot(), Duration::from_secs(3 * 3600), now()).is_empty());
    }
}
