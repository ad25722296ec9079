//! `gpu-brokerctl shared`: every shared read-only lease — publisher, name, size, who may
//! import it, whether the OS enforces read-only — and one line per importer under it.

use gpu_broker_client::table::Table;
use gpu_broker_client::units::format_bytes;
use gpu_broker_client::SharedLeaseInfo;

/// The table: a row per publication, then an indented row per importer.
pub fn render(shared: &[SharedLeaseInfo], width: Option<usize>) -> String {
    if shared.is_empty() {
        return "no shared leases\n".into();
    }
    let mut t = Table::new([
        "PUBLISHER",
        "NAME",
        "SIZE",
        "DEVICE",
        "READERS",
        "READ-ONLY",
        "IMPORTS",
    ])
    .right(&[2, 3, 6])
    .fit(width, &[0, 1, 4]);
    for s in shared {
        let name = if s.published {
            s.name.clone()
        } else {
            "(unpublished)".into()
        };
        let readers = if s.tenants.is_empty() {
            "(own)".to_string()
        } else {
            s.tenants.join(",")
        };
        let ro = if s.read_only_enforced {
            "enforced"
        } else {
            "by importer"
        };
        t.row([
            s.publisher.clone(),
            name,
            format_bytes(s.bytes),
            s.device.to_string(),
            readers,
            ro.to_string(),
            s.import_count.to_string(),
        ]);
        for i in &s.imports {
            let pid = if i.pid == 0 {
                "-".to_string()
            } else {
                i.pid.to_string()
            };
            let state = if i.lingering { "lingering" } else { "live" };
            t.row([
                format!("  <- {}", i.tenant),
                format!("pid {pid}"),
                String::new(),
                String::new(),
                short(&i.session_id),
                state.to_string(),
                String::new(),
            ]);
        }
    }
    t.render()
}

fn short(id: &str) -> String {
    id.chars().take(8).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_broker_client::{MemoryKind, SharedImportInfo};

    #[test]
    fn publications_list_their_importers() {
        let s = SharedLeaseInfo {
            publication_id: "p".into(),
            publisher: "alice".into(),
            name: "weights".into(),
            lease_id: "l".into(),
            device: 0,
            device_uuid: String::new(),
            bytes: 8 << 20,
            memory_kind: MemoryKind::HostMemfd,
            tenants: vec!["bob".into()],
            published: true,
            published_unix_ms: 0,
            read_only_enforced: true,
            imports: vec![SharedImportInfo {
                import_id: "i".into(),
                tenant: "bob".into(),
                session_id: "0123456789abcdef".into(),
                pid: 42,
                imported_unix_ms: 0,
                lingering: true,
            }],
            import_count: 1,
        };
        let out = render(&[s], None);
        assert!(
            out.contains("alice") && out.contains("weights") && out.contains("8.0 MiB"),
            "{out}"
        );
        assert!(
            out.contains("<- bob") && out.contains("pid 42") && out.contains("lingering"),
            "{out}"
        );
        assert!(
            out.contains("01234567") && out.contains("enforced"),
            "{out}"
        );
        assert_eq!(render(&[], None), "no shared leases\n");
    }
}
