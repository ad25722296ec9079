//! `gpu-brokerctl status`: one screen, like `nvidia-smi`, built from one [`Snapshot`] of
//! the admin views: each device with a usage bar (leased, reserved for processes, cached,
//! quarantined, outside the broker, headroom, free), tenants against their limit and
//! guarantee, the process reservations (`gpu-brokerctl run`), the largest and oldest
//! leases, and the requests waiting; under the header, when the broker started and, with a
//! keeper, what that start took back (sessions and leases adopted, reclaimed). [`render`] is a pure function of the snapshot
//! and the time (`top` draws the same lines live).

use std::time::SystemTime;

use anyhow::Result;
use serde::Serialize;

use gpu_broker_client::table::Table;
use gpu_broker_client::units::{format_age_at, format_bytes};
use gpu_broker_client::{
    AdminClient, DeviceInfo, LeaseInfo, QuarantinedBlock, SessionInfo, TenantInfo,
};

/// Everything the operator views show, read at one moment.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Snapshot {
    pub broker: String,
    pub devices: Vec<DeviceInfo>,
    pub tenants: Vec<TenantInfo>,
    pub leases: Vec<LeaseInfo>,
    pub sessions: Vec<SessionInfo>,
    pub quarantined: Vec<QuarantinedBlock>,
    /// What the broker says of itself (none from a broker that cannot say).
    pub info: Option<gpu_broker_client::BrokerInfo>,
}

impl Snapshot {
    /// Reads every view (concurrently).
    pub async fn fetch(admin: &AdminClient, broker: &str) -> Result<Snapshot> {
        let (devices, tenants, leases, sessions, quarantined) = tokio::try_join!(
            admin.get_devices(),
            admin.list_tenants(),
            admin.list_all_leases(None),
            admin.list_sessions(None),
            admin.list_quarantined(),
        )?;
        let info = admin.broker_info().await.ok();
        Ok(Snapshot {
            broker: broker.to_string(),
            devices,
            tenants,
            leases,
            sessions,
            quarantined,
            info,
        })
    }
}

/// When the broker started and what that start took back from its keeper, in a line.
pub fn start_line(info: &gpu_broker_client::BrokerInfo, now: SystemTime) -> String {
    let mut line = format!("started {} ago", format_age_at(info.started_unix_ms, now));
    match (&info.restart, info.keeper) {
        // A start that read a keeper always reports: no keeper since means it was lost.
        (Some(_), false) => {
            line.push_str("  keeper LOST: leases are no longer kept (a restart loses them)")
        }
        (Some(r), true) => {
            line.push_str(&format!(
                "  keeper: took back {} leases ({}) of {} sessions, reclaimed {} leases of {} gone sessions, in {} ms",
                r.leases_adopted,
                format_bytes(r.bytes_adopted),
                r.sessions_adopted,
                r.leases_reclaimed,
                r.sessions_reclaimed,
                r.took_ms
            ));
            line.push_str(&kept_memory_parts(r));
        }
        (None, true) => line.push_str("  keeper: on"),
        (None, false) => line.push_str("  no keeper: a restart loses every lease"),
    }
    line
}

/// What else a start took back (said only when it found any): blocks held for other
/// processes (importers, fd recipients), lingering imports, charges of memory kept outside the broker.
fn kept_memory_parts(r: &gpu_broker_client::RestartInfo) -> String {
    let mut out = String::new();
    if r.held_adopted + r.held_let_go > 0 {
        out.push_str(&format!(
            "; {} blocks held for other processes (let go {})",
            r.held_adopted, r.held_let_go
        ));
    }
    if r.lingering_adopted + r.lingering_ended > 0 {
        out.push_str(&format!(
            "; {} lingering imports (ended {})",
            r.lingering_adopted, r.lingering_ended
        ));
    }
    if r.stranded_adopted + r.stranded_lifted > 0 {
        out.push_str(&format!(
            "; {} charges of memory kept outside the broker ({}, lifted {})",
            r.stranded_adopted,
            format_bytes(r.stranded_bytes),
            r.stranded_lifted
        ));
    }
    out
}

/// Where a restart's time went, as parts of a line: `restart phases:`, then each step
/// with its time (`open devices 310 ms`).
pub fn restart_phases(r: &gpu_broker_client::RestartInfo) -> Vec<String> {
    std::iter::once("restart phases:".to_string())
        .chain(r.phases.iter().map(|(name, us)| {
            let ms = *us as f64 / 1000.0;
            if ms < 10.0 {
                format!("{name} {ms:.1} ms")
            } else {
                format!("{name} {ms:.0} ms")
            }
        }))
        .collect()
}

/// Width of a device's usage bar, in characters.
const BAR: usize = 40;

/// The bar's segments: (character, bytes), in this order, then free as `.`.
fn segments(d: &DeviceInfo) -> [(char, u64); 6] {
    [
        ('#', d.leased_bytes),
        ('r', d.process_reserved_bytes),
        ('c', d.cached_bytes),
        ('q', d.quarantined_bytes),
        ('x', d.external_used_bytes),
        ('h', d.headroom_bytes),
    ]
}

/// `[###cc..]` of `width` cells: each segment's share of the device's total, rounded so
/// that a non-zero segment shows at least one cell.
pub fn usage_bar(d: &DeviceInfo, width: usize) -> String {
    let total = d.total_bytes.max(1);
    let mut cells = String::with_capacity(width + 2);
    let mut used = 0usize;
    for (ch, bytes) in segments(d) {
        if bytes == 0 || used >= width {
            continue;
        }
        let n = ((bytes as u128 * width as u128) / total as u128) as usize;
        let n = n.max(1).min(width - used);
        cells.extend(std::iter::repeat_n(ch, n));
        used += n;
    }
    cells.extend(std::iter::repeat_n('.', width - used));
    format!("[{cells}]")
}

fn held_bar(held: u64, limit: u64, width: usize) -> String {
    let n = if limit == 0 {
        0
    } else {
        ((held.min(limit) as u128 * width as u128) / limit as u128) as usize
    };
    let n = if held > 0 { n.max(1) } else { n };
    format!(
        "[{}{}]",
        "#".repeat(n.min(width)),
        ".".repeat(width - n.min(width))
    )
}

/// The status screen as lines of at most 100 characters.
pub fn render(s: &Snapshot, now: SystemTime) -> String {
    render_fit(s, now, crate::tables::WIDTH)
}

/// Appends `parts` after `indent`, two spaces apart, starting a new line (indented again)
/// before a part that would pass `width`.
fn push_wrapped(out: &mut String, indent: &str, parts: &[String], width: usize) {
    let mut line = indent.to_string();
    for p in parts.iter().filter(|p| !p.is_empty()) {
        let sep = if line.len() > indent.len() { "  " } else { "" };
        if line.len() > indent.len() && line.len() + sep.len() + p.chars().count() > width {
            out.push_str(&line);
            out.push('\n');
            line = format!("{indent}{p}");
        } else {
            line.push_str(sep);
            line.push_str(p);
        }
    }
    out.push_str(&line);
    out.push('\n');
}

/// [`render`] for a screen `width` columns wide (`top` gives its terminal's): bars,
/// tables and long lines shrink or wrap to fit. The sections come in the order an
/// operator needs them, so that a short screen cuts the least useful (the lease lists)
/// first: devices, tenants, waiting requests, process reservations, leases.
pub fn render_fit(s: &Snapshot, now: SystemTime, width: usize) -> String {
    let width = width.max(40);
    let bar = BAR.min(width.saturating_sub(30)).max(10);
    let mut out = String::new();
    let waiting: u32 = s.tenants.iter().map(|t| t.usage.waiting_requests).sum();
    out.push_str(&format!(
        "gpu-broker {}\ndevices {}  tenants {}  sessions {}  leases {}  waiting {}\n\n",
        cut(&s.broker, width.saturating_sub(12)),
        s.devices.len(),
        s.tenants.len(),
        s.sessions.len(),
        s.leases.len(),
        waiting
    ));
    if let Some(info) = s.info.as_ref().filter(|i| i.started_unix_ms > 0) {
        // Above the blank line that ends the header.
        out.pop();
        push_wrapped(&mut out, "", &[start_line(info, now)], width);
        if let Some(r) = info.restart.as_ref().filter(|r| !r.phases.is_empty()) {
            push_wrapped(&mut out, "  ", &restart_phases(r), width);
        }
        out.push('\n');
    }

    for d in &s.devices {
        let model = if d.model.is_empty() {
            &d.name
        } else {
            &d.model
        };
        // Every state the device is in, not only the first.
        let mut states = Vec::new();
        if d.unhealthy {
            states.push(if d.health_reason.is_empty() {
                "UNHEALTHY".to_string()
            } else {
                format!("UNHEALTHY ({})", cut(&d.health_reason, 40))
            });
        }
        if d.draining {
            states.push("DRAINING".to_string());
        }
        if states.is_empty() {
            states.push("open".to_string());
        }
        push_wrapped(
            &mut out,
            "",
            &[
                format!("GPU {}", d.index),
                cut(model, 30),
                cut(&d.uuid, 40),
                states.join(", "),
            ],
            width,
        );
        let headroom_free = d.leasable_bytes.saturating_sub(
            d.leased_bytes + d.cached_bytes + d.quarantined_bytes + d.process_reserved_bytes,
        );
        out.push_str(&format!(
            "  {} {:>10} / {}\n",
            usage_bar(d, bar),
            format_bytes(d.leased_bytes),
            format_bytes(d.total_bytes),
        ));
        push_wrapped(
            &mut out,
            "  ",
            &[
                format!("# leased {}", format_bytes(d.leased_bytes)),
                format!("c cached {}", format_bytes(d.cached_bytes)),
                format!("q quarantined {}", format_bytes(d.quarantined_bytes)),
                format!(
                    "x outside the broker {}",
                    format_bytes(d.external_used_bytes)
                ),
            ],
            width,
        );
        if d.process_reserved_bytes > 0 {
            out.push_str(&format!(
                "  r reserved for processes {}\n",
                format_bytes(d.process_reserved_bytes)
            ));
        }
        push_wrapped(
            &mut out,
            "  ",
            &[
                format!("h headroom {}", format_bytes(d.headroom_bytes)),
                format!("leasable now {}", format_bytes(headroom_free)),
                format!("leases {}", d.lease_count),
                format!("waiting {}", d.waiting_requests),
                if d.turn_holder.is_empty() {
                    String::new()
                } else if d.turn_holders > 1 {
                    format!(
                        "turns: {} holders, {} first (+{} waiting)",
                        d.turn_holders, d.turn_holder, d.turns_waiting
                    )
                } else {
                    format!("turn: {} (+{} waiting)", d.turn_holder, d.turns_waiting)
                },
            ],
            width,
        );
        out.push('\n');
        if !d.mps_state.is_empty() {
            // The line ends the device's block: replace the blank line after it.
            out.pop();
            push_wrapped(
                &mut out,
                "  ",
                &[
                    format!("mps: {}", cut(&d.mps_detail, width.saturating_sub(8))),
                    format!(
                        "compute mode {}",
                        if d.compute_mode.is_empty() {
                            "unknown"
                        } else {
                            &d.compute_mode
                        }
                    ),
                ],
                width,
            );
            out.push('\n');
        } else if !d.compute_mode.is_empty() {
            // A CUDA broker without managed MPS reports the mode too.
            out.pop();
            out.push_str(&format!("  compute mode {}\n\n", cut(&d.compute_mode, 40)));
        }
    }

    // The column of process reservations only when there are some.
    let procs = s.tenants.iter().any(|t| t.usage.process_reservations > 0);
    let mut headers = vec![
        "TENANT",
        "HELD/LIMIT",
        "HELD",
        "LIMIT",
        "GUARANTEED",
        "QUARANTINED",
        "LEASES",
        "WAITING",
    ];
    if procs {
        headers.insert(3, "PROCESSES");
    }
    // Below 100 columns the held/limit bar goes: the numbers beside it say the same.
    let with_bar = width >= crate::tables::WIDTH;
    if !with_bar {
        headers.remove(1);
    }
    let right: Vec<usize> = ((if with_bar { 2 } else { 1 })..headers.len()).collect();
    let mut t = Table::new(headers).right(&right).fit(Some(width), &[0]);
    for i in &s.tenants {
        let (q, u) = (&i.quota, &i.usage);
        // Reservations count against the limit like leases do.
        let charged = u.held_bytes + u.quarantined_bytes + u.process_reserved_bytes;
        let mut row = vec![
            i.name.clone(),
            held_bar(charged, q.limit_bytes, 12),
            format_bytes(u.held_bytes),
            format_bytes(q.limit_bytes),
            format_bytes(q.guaranteed_bytes),
            format_bytes(u.quarantined_bytes),
            u.lease_count.to_string(),
            u.waiting_requests.to_string(),
        ];
        if procs {
            row.insert(3, format_bytes(u.process_reserved_bytes));
        }
        if !with_bar {
            row.remove(1);
        }
        t.row(row);
    }
    out.push_str(&t.render());
    push_waiting(&mut out, s);

    let reserved: Vec<&SessionInfo> = s
        .sessions
        .iter()
        .filter(|x| x.process_reserved_bytes > 0)
        .collect();
    if !reserved.is_empty() {
        let mut t = Table::new(["TENANT", "SESSION", "PID", "RESERVED", "GPU USED", "AGE"])
            .right(&[2, 3, 4, 5])
            .fit(Some(width), &[0, 1]);
        for x in reserved {
            t.row([
                x.tenant.clone(),
                x.name.clone(),
                if x.peer_pid == 0 {
                    "-".to_string()
                } else {
                    x.peer_pid.to_string()
                },
                format_bytes(x.process_reserved_bytes),
                if x.over_allowance {
                    format!("{} (!)", format_bytes(x.gpu_used_bytes))
                } else {
                    format_bytes(x.gpu_used_bytes)
                },
                format_age_at(x.opened_unix_ms, now),
            ]);
        }
        out.push_str(&format!("\nPROCESS RESERVATIONS\n{}", t.render()));
    }

    let lease_rows = |title: &str, leases: Vec<&LeaseInfo>| {
        let mut t = Table::new(["LEASE", "TENANT", "DEV", "SIZE", "AGE", "LABEL"])
            .right(&[2, 3, 4])
            .fit(Some(width), &[1, 5]);
        for l in leases {
            t.row([
                l.lease_id.clone(),
                l.tenant.clone(),
                l.device.to_string(),
                format_bytes(l.bytes),
                format_age_at(l.created_unix_ms, now),
                l.label.clone(),
            ]);
        }
        format!("\n{title}\n{}", t.render())
    };
    if !s.leases.is_empty() {
        let mut largest: Vec<&LeaseInfo> = s.leases.iter().collect();
        largest.sort_by_key(|l| std::cmp::Reverse(l.bytes));
        largest.truncate(5);
        out.push_str(&lease_rows("LARGEST LEASES", largest));
        let mut oldest: Vec<&LeaseInfo> = s.leases.iter().collect();
        oldest.sort_by_key(|l| l.created_unix_ms);
        oldest.truncate(5);
        out.push_str(&lease_rows("OLDEST LEASES", oldest));
    }
    out
}

/// The requests waiting, by tenant (what holds them: the tenant's holdings and limit).
fn push_waiting(out: &mut String, s: &Snapshot) {
    let waiters: Vec<&TenantInfo> = s
        .tenants
        .iter()
        .filter(|t| t.usage.waiting_requests > 0)
        .collect();
    out.push_str("\nWAITING REQUESTS");
    if waiters.is_empty() {
        out.push_str(": none\n");
    } else {
        out.push('\n');
        for t in waiters {
            out.push_str(&format!(
                "  {}: {} waiting (holds {} of {})\n",
                cut(&t.name, 40),
                t.usage.waiting_requests,
                format_bytes(t.usage.held_bytes),
                format_bytes(t.quota.limit_bytes)
            ));
        }
    }
}

fn cut(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut c: String = s.chars().take(n - 1).collect();
        c.push('…');
        c
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use gpu_broker_client::proto::v1 as pb;
    use gpu_broker_client::QuotaSpec;

    /// A node with one busy device, two tenants (one waiting) and two leases.
    pub fn snapshot() -> Snapshot {
        const GIB: u64 = 1 << 30;
        let device = DeviceInfo {
            index: 0,
            name: "NVIDIA H200".into(),
            model: "NVIDIA H200".into(),
            uuid: "GPU-0a1b2c3d-0000-1111-2222-333344445555".into(),
            total_bytes: 140 * GIB,
            leased_bytes: 70 * GIB,
            cached_bytes: 14 * GIB,
            quarantined_bytes: 7 * GIB,
            external_used_bytes: 7 * GIB,
            headroom_bytes: 14 * GIB,
            leasable_bytes: 119 * GIB,
            lease_count: 2,
            waiting_requests: 1,
            ..Default::default()
        };
        let tenant = |name: &str, held: u64, limit: u64, waiting: u32| TenantInfo {
            name: name.into(),
            quota: QuotaSpec {
                limit_bytes: limit,
                guaranteed_bytes: limit / 4,
                ..QuotaSpec::default()
            },
            usage: gpu_broker_client::UsageCounters {
                held_bytes: held,
                lease_count: 1,
                waiting_requests: waiting,
                ..Default::default()
            },
            token_count: 1,
        };
        let lease = |id: &str, tenant: &str, bytes: u64, age_s: i64, label: &str| {
            LeaseInfo::from(pb::Lease {
                lease_id: id.into(),
                tenant: tenant.into(),
                bytes,
                label: label.into(),
                created_unix_ms: 1_000_000_000_000 - age_s * 1000,
                state: 1,
                ..Default::default()
            })
        };
        Snapshot {
            broker: "unix:///run/gpu-broker/broker.sock".into(),
            devices: vec![device],
            tenants: vec![
                tenant("training", 60 * GIB, 64 * GIB, 1),
                tenant("inference", 10 * GIB, 24 * GIB, 0),
            ],
            leases: vec![
                lease(
                    "11111111-1111-4111-8111-111111111111",
                    "training",
                    60 * GIB,
                    7200,
                    "weights",
                ),
                lease(
                    "22222222-2222-4222-8222-222222222222",
                    "inference",
                    10 * GIB,
                    60,
                    "kv-cache",
                ),
            ],
            sessions: vec![],
            quarantined: vec![],
            info: None,
        }
    }

    pub fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000)
    }

    #[test]
    fn the_bar_shows_every_state_in_proportion() {
        let s = snapshot();
        let bar = usage_bar(&s.devices[0], 40);
        assert_eq!(bar.chars().count(), 42);
        assert_eq!(bar.matches('#').count(), 20, "{bar}");
        assert_eq!(bar.matches('c').count(), 4, "{bar}");
        assert_eq!(bar.matches('q').count(), 2, "{bar}");
        assert_eq!(bar.matches('x').count(), 2, "{bar}");
        assert_eq!(bar.matches('h').count(), 4, "{bar}");
        assert!(bar.ends_with(".]"), "{bar}");
    }

    #[test]
    fn status_says_when_the_broker_started_and_what_it_took_back() {
        let mut s = snapshot();
        let plain = render(&s, now());
        assert!(!plain.contains("started"), "{plain}");
        s.info = Some(gpu_broker_client::BrokerInfo {
            started_unix_ms: 1_000_000_000_000 - 90_000,
            keeper: true,
            restart: Some(gpu_broker_client::RestartInfo {
                sessions_adopted: 2,
                sessions_reclaimed: 1,
                leases_adopted: 5,
                leases_reclaimed: 3,
                bytes_adopted: 5 << 30,
                took_ms: 12,
                phases: vec![
                    ("open devices".into(), 310_400),
                    ("keeper dump".into(), 2_500),
                ],
                ..Default::default()
            }),
            ..Default::default()
        });
        let text = render(&s, now());
        assert!(
            text.contains("started 1m30s ago  keeper: took back 5 leases (5.0 GiB) of 2 sessions, reclaimed 3 leases of 1 gone sessions, in 12 ms"),
            "{text}"
        );
        let header: Vec<&str> = text.lines().take(5).collect();
        assert!(
            header[2].starts_with("started") && header[4].is_empty(),
            "{header:?}"
        );
        assert_eq!(
            header[3],
            "  restart phases:  open devices 310 ms  keeper dump 2.5 ms"
        );
        {
            let r = s.info.as_mut().unwrap().restart.as_mut().unwrap();
            (r.held_adopted, r.held_let_go) = (1, 2);
            (r.stranded_adopted, r.stranded_bytes, r.stranded_lifted) = (3, 96 << 20, 1);
        }
        let text = render(&s, now());
        assert!(
            text.contains("in 12 ms; 1 blocks held for other processes (let go 2); 3 charges of memory kept outside the broker (96.0 MiB, lifted 1)"),
            "{text}"
        );
        assert!(!text.contains("lingering"), "{text}");
        s.info.as_mut().unwrap().keeper = false;
        assert!(render(&s, now()).contains("keeper LOST: leases are no longer kept"));
        s.info.as_mut().unwrap().restart = None;
        assert!(render(&s, now()).contains("no keeper: a restart loses every lease"));
    }

    #[test]
    fn status_fits_100_columns_and_says_what_matters() {
        let text = render(&snapshot(), now());
        for line in text.lines() {
            assert!(line.chars().count() <= 100, "{line:?}");
        }
        for want in [
            "GPU 0  NVIDIA H200  GPU-0a1b2c3d",
            "# leased 70.0 GiB",
            "x outside the broker 7.0 GiB",
            "LARGEST LEASES",
            "OLDEST LEASES",
            "training: 1 waiting (holds 60.0 GiB of 64.0 GiB)",
        ] {
            assert!(text.contains(want), "{want:?} in\n{text}");
        }
        let largest = text.split("LARGEST LEASES").nth(1).unwrap();
        let first = largest.lines().nth(2).unwrap();
        assert!(first.contains("11111111"), "largest first: {first}");
        let oldest = text.split("OLDEST LEASES").nth(1).unwrap();
        assert!(oldest.lines().nth(2).unwrap().contains("11111111"));
        assert!(oldest.contains("2h00m"), "{oldest}");
    }

    #[test]
    fn status_shows_process_reservations_per_device_tenant_and_session() {
        const GIB: u64 = 1 << 30;
        let mut s = snapshot();
        let plain = render(&s, now());
        assert!(!plain.contains("PROCESSES") && !plain.contains("PROCESS RESERVATIONS"));
        assert!(!plain.contains("reserved for processes"));
        assert!(plain.contains("leasable now 28.0 GiB"), "{plain}");
        s.devices[0].process_reserved_bytes = 7 * GIB;
        s.tenants[1].usage.process_reserved_bytes = 7 * GIB;
        s.tenants[1].usage.process_reservations = 2;
        s.sessions = vec![
            SessionInfo {
                session_id: "s1".into(),
                tenant: "inference".into(),
                name: "run:python3".into(),
                peer_pid: 4242,
                process_reserved_bytes: 4 * GIB,
                gpu_used_bytes: 3 * GIB,
                opened_unix_ms: 1_000_000_000_000 - 90_000,
                ..Default::default()
            },
            SessionInfo {
                session_id: "s2".into(),
                tenant: "inference".into(),
                name: "run:serve".into(),
                peer_pid: 4343,
                process_reserved_bytes: 3 * GIB,
                gpu_used_bytes: 5 * GIB,
                over_allowance: true,
                opened_unix_ms: 1_000_000_000_000 - 30_000,
                ..Default::default()
            },
            SessionInfo {
                session_id: "s3".into(),
                tenant: "training".into(),
                name: "trainer".into(),
                ..Default::default()
            },
        ];
        let text = render(&s, now());
        for line in text.lines() {
            assert!(line.chars().count() <= 100, "{line:?}");
        }
        let bar = usage_bar(&s.devices[0], 40);
        assert_eq!(bar.matches('r').count(), 2, "{bar}");
        assert!(
            text.contains("  r reserved for processes 7.0 GiB\n"),
            "{text}"
        );
        assert!(text.contains("leasable now 21.0 GiB"), "{text}");
        let tenants = text.split("TENANT").nth(1).unwrap();
        let header = tenants.lines().next().unwrap();
        assert!(header.contains("HELD  PROCESSES"), "{text}");
        let inference = tenants
            .lines()
            .find(|l| l.starts_with("inference "))
            .expect(&text);
        let cols: Vec<&str> = inference.split("  ").filter(|c| !c.is_empty()).collect();
        assert_eq!(cols[2].trim(), "10.0 GiB", "held: {cols:?}");
        assert_eq!(
            cols[3].trim(),
            "7.0 GiB",
            "reserved for processes: {cols:?}"
        );
        let training = tenants
            .lines()
            .find(|l| l.starts_with("training "))
            .expect(&text);
        assert!(training.contains("60.0 GiB        0 B"), "{training}");
        let section = text.split("PROCESS RESERVATIONS\n").nth(1).expect(&text);
        let rows: Vec<&str> = section
            .lines()
            .skip(1)
            .take_while(|l| !l.is_empty())
            .collect();
        assert_eq!(rows.len(), 2, "only sessions with a reservation: {section}");
        assert!(
            rows[0].contains("run:python3") && rows[0].contains("4242"),
            "{rows:?}"
        );
        assert!(
            rows[0].contains("4.0 GiB") && rows[0].contains("1m30s"),
            "{rows:?}"
        );
        assert!(
            rows[1].contains("5.0 GiB (!)"),
            "over its allowance: {rows:?}"
        );
    }

    #[test]
    fn status_shows_the_mps_daemon_when_managed_and_any_reported_compute_mode() {
        let mut s = snapshot();
        assert!(!render(&s, now()).contains("mps:"));
        s.devices[0].mps_state = "running".into();
        s.devices[0].mps_detail = "running (pid 77, 1 server(s), 3 client(s), 0 restart(s))".into();
        s.devices[0].mps_clients = 3;
        s.devices[0].compute_mode = "Default".into();
        let text = render(&s, now());
        assert!(
            text.contains("  mps: running (pid 77, 1 server(s), 3 client(s), 0 restart(s))  compute mode Default\n\n"),
            "{text}"
        );
        s.devices[0].mps_state = "down".into();
        s.devices[0].mps_detail = "down: failed to start: no binary".into();
        s.devices[0].compute_mode.clear();
        let text = render(&s, now());
        assert!(
            text.contains("mps: down: failed to start: no binary  compute mode unknown"),
            "{text}"
        );
        // Without managed MPS a CUDA broker still reports the mode.
        s.devices[0].mps_state.clear();
        s.devices[0].compute_mode = "ExclusiveProcess".into();
        let text = render(&s, now());
        assert!(!text.contains("mps:"), "{text}");
        assert!(
            text.contains("waiting 1\n  compute mode ExclusiveProcess\n\n"),
            "{text}"
        );
    }
}
