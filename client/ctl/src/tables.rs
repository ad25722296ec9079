//! The plain-text listings `gpu-brokerctl` prints for tenants, tokens, leases, sessions,
//! devices, drains and the audit log (one function each; those given a width fit it:
//! [`WIDTH`] columns unless `--wide`), and the time formats they share.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpu_broker_client::table::Table;
use gpu_broker_client::units::{format_age, format_bytes, format_duration};
use gpu_broker_client::{
    AuditEntry, DeviceInfo, DrainStatus, LeaseInfo, SessionInfo, TenantInfo, TokenInfo,
};

/// Width the default tables fit (`--wide` lifts it).
pub(crate) const WIDTH: usize = 100;

fn or_dash(n: u64, text: String) -> String {
    if n == 0 {
        "-".into()
    } else {
        text
    }
}

/// The text, or "-" when empty (a field an older broker does not send).
fn or_dash_str(s: &str) -> String {
    if s.is_empty() {
        "-".to_string()
    } else {
        s.to_string()
    }
}

/// One line per device where the tenant has a cap or holds memory:
/// `device 0: 12.0 MiB held of its 16.0 MiB limit`.
pub(crate) fn device_lines(info: &TenantInfo) -> String {
    let (caps, held) = (
        &info.quota.device_limit_bytes,
        &info.usage.device_committed_bytes,
    );
    let devices: std::collections::BTreeSet<u32> =
        caps.keys().chain(held.keys()).copied().collect();
    let mut out = String::new();
    for d in devices {
        let h = format_bytes(held.get(&d).copied().unwrap_or(0));
        match caps.get(&d) {
            Some(c) => out.push_str(&format!(
                "device {d}: {h} held of its {} limit\n",
                format_bytes(*c)
            )),
            None => out.push_str(&format!("device {d}: {h} held (no per-device limit)\n")),
        }
    }
    out
}

pub(crate) fn tenant_table(tenants: &[TenantInfo], width: Option<usize>) -> String {
    if width.is_some() {
        let mut t = Table::new([
            "TENANT",
            "HELD",
            "LIMIT",
            "GUARANTEED",
            "LEASES",
            "PRIORITY",
            "QUARANTINED",
            "SESSIONS",
            "WAITING",
        ])
        .right(&[1, 2, 3, 4, 5, 6, 7, 8])
        .fit(width, &[0]);
        for i in tenants {
            let (q, u) = (&i.quota, &i.usage);
            t.row([
                i.name.clone(),
                format_bytes(u.held_bytes),
                format_bytes(q.limit_bytes),
                format_bytes(q.guaranteed_bytes),
                u.lease_count.to_string(),
                q.priority.to_string(),
                format_bytes(u.quarantined_bytes),
                u.session_count.to_string(),
                u.waiting_requests.to_string(),
            ]);
        }
        return t.render();
    }
    let mut t = Table::new([
        "TENANT",
        "LIMIT",
        "HELD",
        "LEASES",
        "MAX_LEASES",
        "PRIORITY",
        "GUARANTEED",
        "BORROWED",
        "HOST_LIMIT",
        "HOST_HELD",
        "QUARANTINED",
        "PROC_RESERVED",
        "SESSIONS",
        "WAITING",
        "TOKENS",
        "TURNS",
        "COMPUTE",
        "OVERRUN",
    ])
    .right(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]);
    for i in tenants {
        let (q, u) = (&i.quota, &i.usage);
        t.row([
            i.name.clone(),
            format_bytes(q.limit_bytes),
            format_bytes(u.held_bytes),
            u.lease_count.to_string(),
            or_dash(q.max_leases.into(), q.max_leases.to_string()),
            q.priority.to_string(),
            format_bytes(q.guaranteed_bytes),
            format_bytes(u.borrowed_bytes),
            format_bytes(q.host_limit_bytes),
            format_bytes(u.host_held_bytes),
            format_bytes(u.quarantined_bytes),
            format_bytes(u.process_reserved_bytes),
            u.session_count.to_string(),
            u.waiting_requests.to_string(),
            i.token_count.to_string(),
            u.turns.to_string(),
            format!("{} ms", u.compute_ms),
            format!("{} ms", u.overrun_ms),
        ]);
    }
    t.render()
}

pub(crate) fn token_table(tokens: &[TokenInfo], width: Option<usize>) -> String {
    let now = SystemTime::now();
    let mut t = Table::new([
        "TOKEN_ID",
        "TENANT",
        "NAME",
        "SCOPE",
        "AGE",
        "EXPIRES",
        "LAST_USED",
        "DESCRIPTION",
    ])
    .right(&[4, 5, 6])
    .fit(width, &[1, 2, 7]);
    for k in tokens {
        t.row([
            k.token_id.clone(),
            or_dash_str(&k.tenant),
            or_dash_str(&k.name),
            k.scope.as_str().to_string(),
            format_age(k.created_unix_ms),
            match k.expires_unix_ms {
                None => "never".to_string(),
                Some(ms) => format_until(ms, now),
            },
            match k.last_used_unix_ms {
                None => "-".to_string(),
                Some(ms) => format!("{} ago", format_age(ms)),
            },
            k.description.clone(),
        ]);
    }
    t.render()
}

/// "in 3h02m", or "expired 5m ago".
fn format_until(unix_ms: i64, now: SystemTime) -> String {
    let at = UNIX_EPOCH + Duration::from_millis(unix_ms.max(0).unsigned_abs());
    match at.duration_since(now) {
        Ok(d) => format!("in {}", format_duration(d)),
        Err(e) => format!("expired {} ago", format_duration(e.duration())),
    }
}

/// An instant as RFC 3339 (UTC, seconds).
pub(crate) fn format_time(unix_ms: i64) -> String {
    let at = UNIX_EPOCH + Duration::from_millis(unix_ms.max(0).unsigned_abs());
    humantime::format_rfc3339_seconds(at).to_string()
}

pub(crate) fn drain_table(status: &DrainStatus) -> String {
    let mut t = Table::new([
        "DEVICE",
        "DRAINING",
        "LEASES",
        "LEFT",
        "ASKED",
        "NOT_RECLAIMABLE",
        "QUARANTINED",
        "DEADLINE",
        "REASON",
    ])
    .right(&[0, 2, 3, 4, 5, 6]);
    for d in &status.devices {
        t.row([
            d.index.to_string(),
            if d.draining { "yes" } else { "no" }.to_string(),
            d.leases.to_string(),
            format_bytes(d.bytes),
            d.reclaim_requested.to_string(),
            d.not_reclaimable.to_string(),
            format_bytes(d.quarantined_bytes),
            d.deadline_unix_ms
                .map(format_time)
                .unwrap_or_else(|| "-".into()),
            or_dash_str(&d.reason),
        ]);
    }
    t.render()
}

pub(crate) fn audit_table(entries: &[AuditEntry], width: Option<usize>) -> String {
    let mut t = Table::new([
        "SEQ", "TIME", "WHO", "PEER", "ACTION", "TENANT", "TARGET", "BEFORE", "AFTER",
    ])
    .right(&[0])
    .fit(width, &[3, 6, 7, 8]);
    for e in entries {
        // The token id (the name and scope are in --json and the broker's log).
        let who = e.token_id.clone();
        let peer = match (e.peer_uid, e.peer_pid) {
            (Some(u), Some(p)) => format!("uid {u} pid {p}"),
            (Some(u), None) => format!("uid {u}"),
            _ => "-".into(),
        };
        t.row([
            e.seq.to_string(),
            format_time(e.unix_ms),
            who,
            peer,
            e.action.clone(),
            or_dash_str(&e.tenant),
            or_dash_str(&e.target),
            or_dash_str(&e.before_json),
            or_dash_str(&e.after_json),
        ]);
    }
    t.render()
}

fn lease_flags(l: &LeaseInfo) -> String {
    let mut flags = Vec::new();
    if l.reclaimable {
        flags.push("reclaimable");
    }
    if l.borrowed {
        flags.push("borrowed");
    }
    if flags.is_empty() {
        "-".to_string()
    } else {
        flags.join(",")
    }
}

pub(crate) fn lease_table(leases: &[LeaseInfo], width: Option<usize>) -> String {
    if width.is_some() {
        let mut t = Table::new(["LEASE", "TENANT", "DEVICE", "SIZE", "STATE", "AGE", "LABEL"])
            .right(&[2, 3, 5])
            .fit(width, &[1, 6]);
        for l in leases {
            t.row([
                l.lease_id.clone(),
                l.tenant.clone(),
                l.device.to_string(),
                format_bytes(l.bytes),
                l.state.as_str().to_string(),
                format_age(l.created_unix_ms),
                l.label.clone(),
            ]);
        }
        return t.render();
    }
    let mut t = Table::new([
        "LEASE",
        "TENANT",
        "SESSION",
        "DEVICE",
        "TIER",
        "SIZE",
        "REQUESTED",
        "STATE",
        "FLAGS",
        "AGE",
        "LABEL",
    ])
    .right(&[3, 5, 6, 9]);
    for l in leases {
        t.row([
            l.lease_id.clone(),
            l.tenant.clone(),
            l.session_id.clone(),
            l.device.to_string(),
            l.tier.as_str().to_string(),
            format_bytes(l.bytes),
            format_bytes(l.requested_bytes),
            l.state.as_str().to_string(),
            lease_flags(l),
            format_age(l.created_unix_ms),
            l.label.clone(),
        ]);
    }
    t.render()
}

pub(crate) fn session_table(sessions: &[SessionInfo], width: Option<usize>) -> String {
    if width.is_some() {
        let mut t = Table::new(["SESSION", "TENANT", "NAME", "PID", "LEASES", "HELD", "AGE"])
            .right(&[3, 4, 5, 6])
            .fit(width, &[1, 2]);
        for s in sessions {
            t.row([
                s.session_id.clone(),
                s.tenant.clone(),
                s.name.clone(),
                or_dash(s.peer_pid.into(), s.peer_pid.to_string()),
                s.lease_count.to_string(),
                format_bytes(s.held_bytes),
                format_age(s.opened_unix_ms),
            ]);
        }
        return t.render();
    }
    let mut t = Table::new([
        "SESSION",
        "TENANT",
        "NAME",
        "PID",
        "UID",
        "TRANSPORT",
        "LEASES",
        "HELD",
        "GPU_USED",
        "OWN_ALLOC",
        "PROC_RESERVED",
        "AGE",
    ])
    .right(&[3, 4, 6, 7, 8, 9, 10, 11]);
    for s in sessions {
        t.row([
            s.session_id.clone(),
            s.tenant.clone(),
            s.name.clone(),
            or_dash(s.peer_pid.into(), s.peer_pid.to_string()),
            if s.transport == "unix" {
                s.peer_uid.to_string()
            } else {
                "-".to_string()
            },
            s.transport.clone(),
            s.lease_count.to_string(),
            format_bytes(s.held_bytes),
            or_dash(s.gpu_used_bytes, format_bytes(s.gpu_used_bytes)),
            if s.over_allowance {
                format!("{} (!)", format_bytes(s.own_alloc_bytes))
            } else {
                or_dash(s.gpu_used_bytes, format_bytes(s.own_alloc_bytes))
            },
            or_dash(
                s.process_reserved_bytes,
                format_bytes(s.process_reserved_bytes),
            ),
            format_age(s.opened_unix_ms),
        ]);
    }
    t.render()
}

/// "open", "draining", "unhealthy" or "draining,unhealthy".
fn device_state(d: &DeviceInfo) -> String {
    match (d.draining, d.unhealthy) {
        (false, false) => "open".into(),
        (true, false) => "draining".into(),
        (false, true) => "unhealthy".into(),
        (true, true) => "draining,unhealthy".into(),
    }
}

pub(crate) fn device_table(devices: &[DeviceInfo], width: Option<usize>) -> String {
    if width.is_some() {
        let mut t = Table::new([
            "DEVICE",
            "NAME",
            "TOTAL",
            "LEASABLE",
            "LEASED",
            "CACHED",
            "QUARANTINED",
            "EXTERNAL",
            "WAITING",
            "STATE",
        ])
        .right(&[0, 2, 3, 4, 5, 6, 7, 8])
        .fit(width, &[1]);
        for d in devices {
            t.row([
                d.index.to_string(),
                d.name.clone(),
                format_bytes(d.total_bytes),
                format_bytes(d.leasable_bytes),
                format_bytes(d.leased_bytes),
                format_bytes(d.cached_bytes),
                format_bytes(d.quarantined_bytes),
                format_bytes(d.external_used_bytes),
                d.waiting_requests.to_string(),
                device_state(d),
            ]);
        }
        return t.render();
    }
    let mut t = Table::new([
        "DEVICE",
        "NAME",
        "BACKEND",
        "TOTAL",
        "FREE",
        "LEASABLE",
        "LEASED",
        "CACHED",
        "QUARANTINED",
        "HEADROOM",
        "EXTERNAL",
        "PROC_RESERVED",
        "GRANULARITY",
        "LEASES",
        "WAITING",
        "TURN",
        "MODEL",
        "UUID",
        "STATE",
    ])
    .right(&[0, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]);
    for d in devices {
        t.row([
            d.index.to_string(),
            d.name.clone(),
            d.backend.clone(),
            format_bytes(d.total_bytes),
            format_bytes(d.free_bytes),
            format_bytes(d.leasable_bytes),
            format_bytes(d.leased_bytes),
            format_bytes(d.cached_bytes),
            format_bytes(d.quarantined_bytes),
            format_bytes(d.headroom_bytes),
            format_bytes(d.external_used_bytes),
            format_bytes(d.process_reserved_bytes),
            format_bytes(d.granularity_bytes),
            d.lease_count.to_string(),
            d.waiting_requests.to_string(),
            if d.turn_holder.is_empty() {
                "-".to_string()
            } else {
                format!("{} (+{} waiting)", d.turn_holder, d.turns_waiting)
            },
            or_dash_str(&d.model),
            or_dash_str(&d.uuid),
            device_state(d),
        ]);
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_render() {
        let tenants = vec![TenantInfo {
            name: "a".into(),
            quota: gpu_broker_client::QuotaSpec::new(8 << 30),
            ..Default::default()
        }];
        let text = tenant_table(&tenants, None);
        let mut lines = text.lines();
        assert!(lines.next().unwrap().starts_with("TENANT    LIMIT"));
        assert!(lines.next().unwrap().starts_with("a       8.0 GiB"));
    }

    #[test]
    fn default_tables_fit_100_columns() {
        let long = "a-tenant-with-a-rather-long-name-for-a-team".to_string();
        let tenants = vec![TenantInfo {
            name: long.clone(),
            quota: gpu_broker_client::QuotaSpec::new(1023 << 30),
            ..Default::default()
        }];
        let lease = LeaseInfo::from(gpu_broker_client::proto::v1::Lease {
            lease_id: uuid::Uuid::nil().to_string(),
            tenant: long.clone(),
            label: "kv-cache-for-the-biggest-model-we-have".into(),
            bytes: 1000 << 30,
            state: 2,
            ..Default::default()
        });
        let session = SessionInfo {
            session_id: uuid::Uuid::nil().to_string(),
            tenant: long.clone(),
            name: "trainer-with-a-long-name-too".into(),
            peer_pid: 4_000_000,
            held_bytes: 1000 << 30,
            lease_count: 1000,
            ..Default::default()
        };
        let device = DeviceInfo {
            name: "NVIDIA H200 NVL with a long model name".into(),
            total_bytes: 1000 << 30,
            leasable_bytes: 1000 << 30,
            ..Default::default()
        };
        let token = TokenInfo {
            token_id: "0123456789abcdef".into(),
            tenant: long.clone(),
            description: "a description that goes on and on and on and on and on and on and on"
                .into(),
            created_unix_ms: 1,
            ..Default::default()
        };
        let w = Some(WIDTH);
        for text in [
            tenant_table(&tenants, w),
            lease_table(std::slice::from_ref(&lease), w),
            session_table(std::slice::from_ref(&session), w),
            device_table(std::slice::from_ref(&device), w),
            token_table(std::slice::from_ref(&token), w),
        ] {
            for line in text.lines() {
                assert!(
                    line.chars().count() <= 100,
                    "{} wide:\n{text}",
                    line.chars().count()
                );
            }
        }
        assert!(lease_table(std::slice::from_ref(&lease), w).contains(&lease.lease_id));
        assert!(lease_table(std::slice::from_ref(&lease), None).contains(&lease.label));
    }
}
