//! Declarative tenants: the `[tenants.NAME]` tables of the config file (keys named like
//! `gpu-brokerctl quota set`'s options: `limit`, `max-leases`, `priority`, `guaranteed`,
//! `host-limit`, `turn-weight`), applied at start, on SIGHUP and when the file changes
//! (polled, so a Kubernetes ConfigMap's symlink swap is seen like an edit). A table's
//! `namespaces` lists the Kubernetes namespaces whose ServiceAccount tokens act as the
//! tenant (`token_review.rs`); a namespace belongs to one tenant at most.
//!
//! How the file and the admin RPCs combine: the file is authoritative for the fields it
//! declares — each apply sets them (a patch: undeclared fields keep whatever `quota set`
//! gave them) — and only tenants whose declared fields differ from the running ones are
//! changed (each change is audited as `config.reload`). Tenants the file does not declare,
//! or no longer declares, are left alone: a reload never deletes a tenant. An invalid file
//! is refused whole, with file, line and reason, and the running state stays. The same
//! watch applies the file's `[tokens.NAME]` tables (`tokens_config`) after the tenants.

use crate::arbiter::{Arbiter, QuotaUpdate};
use crate::file_read::{
    read_regular, read_regular_off_runtime, FileReadError, MAX_WATCHED_FILE_BYTES,
};
use crate::ledger::{Quota, QuotaPatch};
use crate::units::show;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Why a config file's tenants could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TenantsError {
    /// Not read: missing, unreadable, not a regular file or too large.
    #[error(transparent)]
    Read(#[from] FileReadError),
    #[error("{}: not UTF-8 text", path.display())]
    NotText { path: PathBuf },
    #[error("{}:{line}: {reason}", path.display())]
    Invalid {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    /// Its `[tokens.NAME]` tables (`tokens_config`), read by the same watch.
    #[error(transparent)]
    Tokens(#[from] crate::tokens_config::TokensError),
}

/// The names of `declared` (what a token's tenant is checked against).
pub fn names(declared: &[DeclaredTenant]) -> Vec<String> {
    declared.iter().map(|d| d.name.clone()).collect()
}

/// One `[tenants.NAME]` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeclaredTenant {
    pub name: String,
    pub patch: QuotaPatch,
    /// Kubernetes namespaces whose ServiceAccount tokens act as this tenant.
    pub namespaces: Vec<String>,
}

/// Namespace -> tenant, from the tables' `namespaces`.
pub fn namespace_tenants(declared: &[DeclaredTenant]) -> std::collections::HashMap<String, String> {
    declared
        .iter()
        .flat_map(|d| d.namespaces.iter().map(|ns| (ns.clone(), d.name.clone())))
        .collect()
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Size {
    Bytes(u64),
    Text(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct TenantTable {
    limit: Option<toml::Spanned<Size>>,
    max_leases: Option<u32>,
    priority: Option<i32>,
    guaranteed: Option<toml::Spanned<Size>>,
    host_limit: Option<toml::Spanned<Size>>,
    turn_weight: Option<u32>,
    /// Per-device caps by device index (`{ 0 = "8GiB", 1 = "4GiB" }`): when given, the
    /// whole set (caps not listed are removed).
    device_limits: Option<BTreeMap<toml::Spanned<String>, toml::Spanned<Size>>>,
    /// Kubernetes namespaces whose ServiceAccount tokens act as this tenant.
    namespaces: Option<Vec<toml::Spanned<String>>>,
}

#[derive(Deserialize)]
struct FileTenants {
    #[serde(default)]
    tenants: BTreeMap<toml::Spanned<String>, toml::Spanned<TenantTable>>,
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The tenants declared in `text` (the contents of `path`, named in errors).
pub fn parse(path: &Path, text: &str) -> Result<Vec<DeclaredTenant>, TenantsError> {
    let invalid = |offset: usize, reason: String| TenantsError::Invalid {
        path: path.to_path_buf(),
        line: line_of(text, offset),
        reason,
    };
    let file: FileTenants = toml::from_str(text).map_err(|e| {
        let at = e.span().map(|s| s.start).unwrap_or(0);
        invalid(at, e.message().to_string())
    })?;
    let mut out = Vec::new();
    let mut namespace_owner: BTreeMap<String, String> = BTreeMap::new();
    for (name, table) in file.tenants {
        let at = name.span().start;
        crate::ledger::validate_tenant_name(name.get_ref())
            .map_err(|e| invalid(at, format!("tenant {:?}: {e}", name.get_ref())))?;
        let size =
            |v: Option<toml::Spanned<Size>>, key: &str| -> Result<Option<u64>, TenantsError> {
                let Some(v) = v else { return Ok(None) };
                let at = v.span().start;
                // A TOML number is read as the same text: a bare one (but 0) is refused.
                let text = match v.into_inner() {
                    Size::Bytes(b) => b.to_string(),
                    Size::Text(s) => s,
                };
                crate::units::parse(&text)
                    .map(Some)
                    .map_err(|e| invalid(at, format!("tenants.{}.{key}: {e}", name.get_ref())))
            };
        let t = table.into_inner();
        let patch = QuotaPatch {
            limit_bytes: size(t.limit, "limit")?,
            max_leases: t.max_leases,
            priority: t.priority,
            guaranteed_bytes: size(t.guaranteed, "guaranteed")?,
            host_limit_bytes: size(t.host_limit, "host-limit")?,
            turn_weight: t.turn_weight,
            clear_device_limits: t.device_limits.is_some(),
            device_limits: Vec::new(),
        };
        let mut patch = patch;
        for (device, limit) in t.device_limits.into_iter().flatten() {
            let at = device.span().start;
            let index: u32 = device.get_ref().parse().map_err(|_| {
                invalid(
                    at,
                    format!(
                        "tenants.{}.device-limits: {:?} is not a device index (0, 1, ...)",
                        name.get_ref(),
                        device.get_ref()
                    ),
                )
            })?;
            let bytes = size(Some(limit), "device-limits")?;
            patch.device_limits.push((index, bytes));
        }
        if patch.limit_bytes.is_none() {
            return Err(invalid(
                at,
                format!("tenants.{}: `limit` is required", name.get_ref()),
            ));
        }
        if let (Some(g), Some(l)) = (patch.guaranteed_bytes, patch.limit_bytes) {
            if g > l {
                return Err(invalid(
                    at,
                    format!(
                        "tenants.{}: guaranteed {} exceeds limit {}",
                        name.get_ref(),
                        show(g),
                        show(l)
                    ),
                ));
            }
        }
        let mut namespaces = Vec::new();
        for ns in t.namespaces.into_iter().flatten() {
            let at = ns.span().start;
            let ns = ns.into_inner();
            if !is_namespace_name(&ns) {
                return Err(invalid(
                    at,
                    format!(
                        "tenants.{}.namespaces: {ns:?} is not a Kubernetes namespace name",
                        name.get_ref()
                    ),
                ));
            }
            if let Some(other) = namespace_owner.insert(ns.clone(), name.get_ref().clone()) {
                return Err(invalid(
                    at,
                    format!(
                        "tenants.{}.namespaces: {ns:?} is tenant {other:?}'s already (a namespace has one tenant)",
                        name.get_ref()
                    ),
                ));
            }
            namespaces.push(ns);
        }
        out.push(DeclaredTenant {
            name: name.into_inner(),
            patch,
            namespaces,
        });
    }
    Ok(out)
}

/// A namespace name as Kubernetes allows it (an RFC 1123 label: at most 63 lowercase
/// letters, digits and '-', starting and ending with a letter or digit).
fn is_namespace_name(ns: &str) -> bool {
    let b = ns.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Reads and parses `path` (a regular file of at most 1 MiB: `crate::file_read`).
/// Blocking: the watch runs it off the runtime.
pub fn load(path: &Path) -> Result<Vec<DeclaredTenant>, TenantsError> {
    parse_bytes(path, &read_regular(path, MAX_WATCHED_FILE_BYTES)?)
}

/// Parses the contents `bytes` read from `path`.
fn parse_bytes(path: &Path, bytes: &[u8]) -> Result<Vec<DeclaredTenant>, TenantsError> {
    let text = std::str::from_utf8(bytes).map_err(|_| TenantsError::NotText {
        path: path.to_path_buf(),
    })?;
    parse(path, text)
}

/// What applying the file would do to one tenant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Create {
        name: String,
        quota: Quota,
    },
    Update {
        name: String,
        from: Quota,
        to: Quota,
    },
    Same {
        name: String,
    },
}

/// The changes `declared` makes to the `running` quotas (tenant name -> quota).
pub fn diff(declared: &[DeclaredTenant], running: &BTreeMap<String, Quota>) -> Vec<Change> {
    declared
        .iter()
        .map(|d| {
            let name = d.name.clone();
            match running.get(&d.name) {
                None => Change::Create {
                    quota: d.patch.apply(None).unwrap_or_default(),
                    name,
                },
                Some(from) => {
                    let to = d.patch.apply(Some(from)).unwrap_or(from.clone());
                    if to == *from {
                        Change::Same { name }
                    } else {
                        Change::Update {
                            name,
                            from: from.clone(),
                            to,
                        }
                    }
                }
            }
        })
        .collect()
}

/// A size as operators read it (`64.0 GiB`).
fn human(bytes: u64) -> String {
    crate::units::human(bytes)
}

fn describe(q: &Quota) -> String {
    let mut out = format!(
        "limit {}, guaranteed {}, priority {}, max-leases {}, host-limit {}, turn-weight {}",
        human(q.limit_bytes),
        human(q.guaranteed_bytes),
        q.priority,
        q.max_leases,
        human(q.host_limit_bytes),
        q.turn_weight
    );
    if !q.device_limit_bytes.is_empty() {
        out.push_str(&format!(", device-limits {}", device_limits(q)));
    }
    out
}

/// Per-device caps as `0=8.0 GiB 1=4.0 GiB` (`none` without any).
fn device_limits(q: &Quota) -> String {
    if q.device_limit_bytes.is_empty() {
        return "none".into();
    }
    q.device_limit_bytes
        .iter()
        .map(|(d, b)| format!("{d}={}", human(*b)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One line per change: `+` created, `~` changed (only the fields that differ), `=` same.
pub fn describe_change(c: &Change) -> String {
    match c {
        Change::Create { name, quota } => format!("+ {name}: new tenant: {}", describe(quota)),
        Change::Same { name } => format!("= {name}: unchanged"),
        Change::Update { name, from, to } => {
            let mut parts = Vec::new();
            let mut field = |key: &str, a: String, b: String| {
                if a != b {
                    parts.push(format!("{key} {a} -> {b}"));
                }
            };
            field("limit", human(from.limit_bytes), human(to.limit_bytes));
            field(
                "guaranteed",
                human(from.guaranteed_bytes),
                human(to.guaranteed_bytes),
            );
            field(
                "priority",
                from.priority.to_string(),
                to.priority.to_string(),
            );
            field(
                "max-leases",
                from.max_leases.to_string(),
                to.max_leases.to_string(),
            );
            field(
                "host-limit",
                human(from.host_limit_bytes),
                human(to.host_limit_bytes),
            );
            field(
                "turn-weight",
                from.turn_weight.to_string(),
                to.turn_weight.to_string(),
            );
            field("device-limits", device_limits(from), device_limits(to));
            format!("~ {name}: {}", parts.join(", "))
        }
    }
}

/// Applies the declared tenants that differ from the running ones; returns the changes
/// made. A tenant the arbiter refuses (e.g. guarantees above capacity) is logged and
/// skipped; the others still apply.
pub fn apply(arb: &Arc<Arbiter>, declared: &[DeclaredTenant], why: &str) -> Vec<Change> {
    let running: BTreeMap<String, Quota> = arb
        .views()
        .tenants()
        .into_iter()
        .map(|t| (t.name, t.quota))
        .collect();
    let mut done = Vec::new();
    for (change, d) in diff(declared, &running).into_iter().zip(declared) {
        if matches!(change, Change::Same { .. }) {
            continue;
        }
        // Each change is committed with its audit record (`config.reload`, on the tenant).
        let who = crate::audit::Who::system(why);
        match arb.changes().change_quota(
            &d.name,
            QuotaUpdate::Patch(d.patch.clone()),
            Some((&who, "config.reload", &d.name)),
        ) {
            Ok(_) => {
                tracing::info!(tenant = %d.name, why, "config: {}", describe_change(&change));
                done.push(change);
            }
            Err(e) => {
                tracing::error!(tenant = %d.name, error = %e, "config: tenant not applied");
            }
        }
    }
    done
}

/// Reloads the tenants of `path` on SIGHUP and whenever its contents change (checked every
/// `poll`), until `stop`, as the named worker `tenants-config-watch`. The file is read on a
/// blocking thread, bounded and only if it is a regular file (`crate::file_read`): a file
/// replaced by a FIFO, a device or a huge file is refused (logged once per change) and the
/// running state stays, like an invalid file's. The stop is seen only between reloads: a
/// reload handed to the store writer is waited for, so [`Lifecycle::join`](crate::arbiter::Lifecycle::join) returns
/// with it applied whole (and the store writer stops after it); one asked for after the
/// writer stopped is refused whole (`ShuttingDown`, nothing applied).
pub fn spawn_watch(arb: Arc<Arbiter>, path: PathBuf, poll: Duration, stop: CancellationToken) {
    // Registered before returning, so a SIGHUP right after start reloads (not kills).
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    // What the caller started from, read before returning too: an edit made before the task
    // first runs is a change it sees. (Read here on the caller's thread: at start, once.)
    let mut last = Seen::of(read_regular(&path, MAX_WATCHED_FILE_BYTES));
    let me = arb.clone();
    me.lifecycle().spawn_worker_to_end("tenants-config-watch", async move {
        loop {
            let why = tokio::select! {
                _ = stop.cancelled() => return,
                _ = async {
                    match hup.as_mut() {
                        Some(h) => { h.recv().await; }
                        None => std::future::pending::<()>().await,
                    }
                } => "SIGHUP",
                _ = tokio::time::sleep(poll) => "config file changed",
            };
            // Reads follow symlinks: a ConfigMap's `..data` swap shows as new contents.
            let read = read_regular_off_runtime(&path, MAX_WATCHED_FILE_BYTES).await;
            let now = Seen::of_ref(&read);
            if why != "SIGHUP" && now == last {
                continue;
            }
            last = now;
            let parsed = read.map_err(TenantsError::from).and_then(|b| {
                let declared = parse_bytes(&path, &b)?;
                let text = std::str::from_utf8(&b).unwrap_or_default();
                let tokens = crate::tokens_config::parse(&path, text, &names(&declared))?;
                Ok((declared, tokens))
            });
            match parsed {
                Ok((declared, tokens)) => {
                    // On the store writer, in order with operators' changes; the tokens
                    // after the tenants they name.
                    let n = declared.len();
                    arb.authenticator()
                        .set_namespace_tenants(namespace_tenants(&declared));
                    let applied = arb.changes().run(move |a| {
                        let changes = apply(a, &declared, why);
                        Ok((changes, crate::tokens_config::apply(a, &tokens, why)))
                    });
                    match applied.await {
                        Ok((changes, tokens)) => {
                            tracing::info!(path = %path.display(), why, tenants = n, changed = changes.len(), tokens_added = tokens.added.len(), tokens_removed = tokens.removed.len(), "config reloaded");
                        }
                        Err(e) => tracing::error!(why, "config not reloaded: {e}"),
                    }
                }
                Err(e) => {
                    tracing::error!(why, "config not reloaded, the running state stays: {e}");
                }
            }
        }
    });
}

/// What a look at the file found: its contents, or why it was not read (so a refusal is
/// logged once, not at every poll).
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Contents(Vec<u8>),
    Refused(String),
}

impl Seen {
    fn of(r: Result<Vec<u8>, FileReadError>) -> Seen {
        match r {
            Ok(b) => Seen::Contents(b),
            Err(e) => Seen::Refused(e.to_string()),
        }
    }

    fn of_ref(r: &Result<Vec<u8>, FileReadError>) -> Seen {
        match r {
            Ok(b) => Seen::Contents(b.clone()),
            Err(e) => Seen::Refused(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arbiter::durable_tests::change_quota_for;

    const FILE: &str = "socket = \"/run/x.sock\"\n\n[tenants.training]\nlimit = \"64GiB\"\nguaranteed = \"16GiB\"\npriority = 1\n\n[tenants.inference]\nlimit = \"1GiB\"\nmax-leases = 8\n";

    #[test]
    fn parses_tenant_tables() {
        let t = parse(Path::new("c.toml"), FILE).unwrap();
        assert_eq!(t.len(), 2);
        let training = t.iter().find(|t| t.name == "training").unwrap();
        assert_eq!(training.patch.limit_bytes, Some(64 << 30));
        assert_eq!(training.patch.guaranteed_bytes, Some(16 << 30));
        assert_eq!(training.patch.priority, Some(1));
        assert_eq!(training.patch.max_leases, None);
        let inference = t.iter().find(|t| t.name == "inference").unwrap();
        assert_eq!(inference.patch.limit_bytes, Some(1 << 30));
        assert_eq!(inference.patch.max_leases, Some(8));
        assert!(parse(Path::new("c.toml"), "socket = \"/x\"\n")
            .unwrap()
            .is_empty());
    }

    #[test]
    fn namespaces_name_their_tenant_once() {
        let text = "[tenants.a]\nlimit = \"1GiB\"\nnamespaces = [\"team-a\", \"team-a-eval\"]\n\n[tenants.b]\nlimit = \"1GiB\"\n";
        let t = parse(Path::new("c.toml"), text).unwrap();
        let map = namespace_tenants(&t);
        assert_eq!(map.len(), 2);
        assert_eq!(map["team-a"], "a");
        assert_eq!(map["team-a-eval"], "a");
        for (bad, why) in [
            ("namespaces = [\"Team\"]", "not a Kubernetes namespace name"),
            ("namespaces = [\"-x\"]", "not a Kubernetes namespace name"),
            ("namespaces = [\"team-a\"]", "is tenant \"a\"'s already"),
        ] {
            let text = format!("[tenants.a]\nlimit = \"1GiB\"\nnamespaces = [\"team-a\"]\n\n[tenants.c]\nlimit = \"1GiB\"\n{bad}\n");
            let e = parse(Path::new("c.toml"), &text).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("c.toml:7"), "{e}");
        }
    }

    #[test]
    fn device_limits_replace_the_set_of_caps() {
        let text = "[tenants.a]\nlimit = \"64GiB\"\ndevice-limits = { 0 = \"16GiB\", 1 = 0 }\n\n[tenants.b]\nlimit = \"1GiB\"\n";
        let t = parse(Path::new("c.toml"), text).unwrap();
        let a = t.iter().find(|t| t.name == "a").unwrap();
        assert!(a.patch.clear_device_limits);
        assert_eq!(a.patch.device_limits, [(0, Some(16 << 30)), (1, Some(0))]);
        let b = t.iter().find(|t| t.name == "b").unwrap();
        assert!(!b.patch.clear_device_limits && b.patch.device_limits.is_empty());
        // Against a running quota with other caps: the file's set replaces them.
        let running = BTreeMap::from([(
            "a".to_string(),
            Quota {
                limit_bytes: 64 << 30,
                device_limit_bytes: BTreeMap::from([(2, 5)]),
                ..Quota::default()
            },
        )]);
        let changes = diff(&t[..1], &running);
        let Change::Update { to, .. } = &changes[0] else {
            panic!("{changes:?}")
        };
        assert_eq!(
            to.device_limit_bytes,
            BTreeMap::from([(0, 16 << 30), (1, 0)])
        );
        let line = describe_change(&changes[0]);
        assert!(
            line.contains("device-limits 2=5 B -> 0=16.0 GiB 1=0 B"),
            "{line}"
        );
        let e = parse(
            Path::new("c.toml"),
            "[tenants.a]\nlimit = \"1GiB\"\ndevice-limits = { gpu0 = \"1GiB\" }\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("c.toml:3: ") && e.contains("not a device index"),
            "{e}"
        );
    }

    #[test]
    fn errors_name_file_line_and_reason() {
        for (text, line, want) in [
            ("[tenants.a]\nlimit = \"lots\"\n", 2, "invalid size"),
            ("[tenants.a]\nlimit = \"16EiB\"\n", 2, "too large"),
            (
                "[tenants.a]\nlimit = \"1GiB\"\nguaranteed = \"1GiB\"\nhost-limit = \"16384PiB\"\n",
                4,
                "too large",
            ),
            (
                "[tenants.a]\nlimit = \"1GiB\"\nlimt = 3\n",
                3,
                "unknown field",
            ),
            ("\n\n[tenants.a]\npriority = 1\n", 3, "`limit` is required"),
            (
                "[tenants.\"a b\"]\nlimit = \"1GiB\"\n",
                1,
                "invalid tenant name",
            ),
            (
                "[tenants.a]\n\nlimit = 4096\n",
                3,
                "tenants.a.limit: size \"4096\" has no unit",
            ),
            (
                "[tenants.a]\nlimit = \"1GiB\"\nguaranteed = \"2GiB\"\n",
                1,
                "exceeds limit",
            ),
            ("[tenants.a]\nlimit = \n", 2, ""),
        ] {
            let e = parse(Path::new("/etc/gpu-broker.toml"), text).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.starts_with(&format!("/etc/gpu-broker.toml:{line}: ")) && msg.contains(want),
                "{text:?}: {msg}"
            );
        }
    }

    #[test]
    fn the_diff_says_what_changes() {
        let declared = parse(Path::new("c.toml"), FILE).unwrap();
        let mut running = BTreeMap::new();
        running.insert(
            "training".to_string(),
            Quota {
                limit_bytes: 32 << 30,
                guaranteed_bytes: 16 << 30,
                priority: 1,
                max_leases: 4,
                ..Quota::default()
            },
        );
        let d = diff(&declared, &running);
        let lines: Vec<String> = d.iter().map(describe_change).collect();
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("+ inference: new tenant: limit 1.0 GiB")),
            "{lines:?}"
        );
        let t = lines.iter().find(|l| l.starts_with("~ training")).unwrap();
        assert_eq!(
            t, "~ training: limit 32.0 GiB -> 64.0 GiB",
            "max-leases 4 stays: {t}"
        );
        running.insert(
            "training".into(),
            Quota {
                limit_bytes: 64 << 30,
                guaranteed_bytes: 16 << 30,
                priority: 1,
                max_leases: 4,
                ..Quota::default()
            },
        );
        assert!(diff(&declared, &running).iter().any(|c| *c
            == Change::Same {
                name: "training".into()
            }));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_config_reload_commits_each_change_with_its_record() {
        let dir = tempfile::tempdir().unwrap();
        let arb = crate::arbiter::durable_tests::stored_arbiter(dir.path());
        change_quota_for(
            &arb,
            "a".into(),
            QuotaUpdate::Replace(Quota {
                limit_bytes: 8 << 20,
                ..Quota::default()
            }),
            crate::audit::Who::system("test"),
        )
        .await
        .unwrap();
        let declared = parse(
            std::path::Path::new("tenants.toml"),
            "[tenants.a]\nlimit = \"16MiB\"\n",
        )
        .unwrap();
        let changes = arb
            .changes()
            .run(move |a| Ok(apply(a, &declared, "SIGHUP")))
            .await
            .unwrap();
        assert_eq!(changes.len(), 1);
        let records = arb
            .durable
            .list_audit(&crate::audit::AuditFilter::default())
            .unwrap();
        assert_eq!(
            records
                .iter()
                .map(|r| r.action.as_str())
                .collect::<Vec<_>>(),
            ["quota.set", "config.reload"]
        );
        assert_eq!(records[1].who, crate::audit::Who::system("SIGHUP"));
        assert_eq!(
            (records[1].tenant.as_str(), records[1].target.as_str()),
            ("a", "a")
        );
        assert_eq!(records[1].before, records[0].after);
        arb.lifecycle()
            .join(std::time::Duration::from_secs(5))
            .await;
        drop(arb);
        let (tenants, durable) = crate::arbiter::durable_tests::reopened(dir.path());
        assert_eq!(tenants, vec![("a".to_string(), 16 << 20)]);
        assert_eq!(durable, records);
    }

    /// Waits (bounded: a failure detector, not a speed limit) until `a`'s quota is `limit`.
    async fn limit_becomes(arb: &Arbiter, limit: u64) -> bool {
        for _ in 0..500 {
            if arb.views().tenant("a").map(|t| t.quota.limit_bytes) == Ok(limit) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// As the broker starts: `file` applied on the store writer, then watched (every
    /// 20 ms) until the returned token is cancelled.
    async fn start_watching(arb: &Arc<Arbiter>, file: &Path) -> (Vec<Change>, CancellationToken) {
        let declared = load(file).unwrap();
        let at_start = arb
            .changes()
            .run(move |a| Ok(apply(a, &declared, "start")))
            .await
            .unwrap();
        let stop = CancellationToken::new();
        spawn_watch(
            arb.clone(),
            file.to_path_buf(),
            Duration::from_millis(20),
            stop.clone(),
        );
        (at_start, stop)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_watched_file_is_applied_on_the_store_writer_in_order_with_operators_changes() {
        use crate::audit::{AuditFilter, Who};
        let dir = tempfile::tempdir().unwrap();
        let arb = crate::arbiter::durable_tests::stored_arbiter(dir.path());
        let file = dir.path().join("tenants.toml");
        std::fs::write(&file, "[tenants.a]\nlimit = \"16MiB\"\n").unwrap();
        let (at_start, stop) = start_watching(&arb, &file).await;
        assert_eq!(at_start.len(), 1);
        // An operator changes the declared field and an undeclared one.
        change_quota_for(
            &arb,
            "a".into(),
            QuotaUpdate::Patch(QuotaPatch {
                limit_bytes: Some(8 << 20),
                max_leases: Some(5),
                ..QuotaPatch::default()
            }),
            Who::system("operator"),
        )
        .await
        .unwrap();
        // The file changes: applied after the operator's change, over it.
        std::fs::write(&file, "[tenants.a]\nlimit = \"32MiB\"\n").unwrap();
        assert!(
            limit_becomes(&arb, 32 << 20).await,
            "the edit was not applied"
        );
        assert_eq!(
            arb.views().tenant("a").unwrap().quota.max_leases,
            5,
            "undeclared: kept"
        );
        // An invalid edit changes nothing; the next valid one applies.
        std::fs::write(&file, "[tenants.a]\nlimit = \"lots\"\n").unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(arb.views().tenant("a").unwrap().quota.limit_bytes, 32 << 20);
        std::fs::write(&file, "[tenants.a]\nlimit = \"48MiB\"\n").unwrap();
        assert!(
            limit_becomes(&arb, 48 << 20).await,
            "the next edit was not applied"
        );
        stop.cancel();
        let records = arb.durable.list_audit(&AuditFilter::default()).unwrap();
        let seen: Vec<(&str, &Who)> = records
            .iter()
            .map(|r| (r.action.as_str(), &r.who))
            .collect();
        let reload = Who::system("config file changed");
        assert_eq!(
            seen,
            [
                ("config.reload", &Who::system("start")),
                ("quota.set", &Who::system("operator")),
                ("config.reload", &reload),
                ("config.reload", &reload),
            ]
        );
        // Each applied over what the change before it committed: the store's order.
        for pair in records.windows(2) {
            assert_eq!(pair[1].before, pair[0].after, "{pair:?}");
        }
        assert!(arb
            .lifecycle()
            .join(Duration::from_secs(5))
            .await
            .is_empty());
        assert!(
            arb.lifecycle().worker_names().is_empty(),
            "the watch has ended"
        );
        drop(arb);
        let (tenants, durable) = crate::arbiter::durable_tests::reopened(dir.path());
        assert_eq!(tenants, vec![("a".to_string(), 48 << 20)]);
        assert_eq!(durable, records);
    }

    /// An edit made right after the watch is started, before its task first runs, is a
    /// change it sees (the contents it compares with are read when it is started).
    #[tokio::test]
    async fn an_edit_before_the_watch_first_runs_is_reloaded() {
        let dir = tempfile::tempdir().unwrap();
        let arb = crate::arbiter::durable_tests::stored_arbiter(dir.path());
        let file = dir.path().join("tenants.toml");
        std::fs::write(&file, "[tenants.a]\nlimit = \"16MiB\"\n").unwrap();
        let (_, stop) = start_watching(&arb, &file).await;
        // A current-thread runtime: the watch's task has not run yet.
        std::fs::write(&file, "[tenants.a]\nlimit = \"32MiB\"\n").unwrap();
        let limit = || arb.views().tenant("a").unwrap().quota.limit_bytes;
        let t = std::time::Instant::now();
        while limit() != 32 << 20 && t.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(limit(), 32 << 20, "the edit is reloaded");
        stop.cancel();
        assert!(arb
            .lifecycle()
            .join(Duration::from_secs(5))
            .await
            .is_empty());
    }

    /// A reload handed to the store writer when the stop comes is applied whole before the
    /// shutdown's join returns; after the stop, an edit applies nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reload_in_flight_at_stop_is_applied_whole_before_the_join_returns() {
        let dir = tempfile::tempdir().unwrap();
        let arb = crate::arbiter::durable_tests::stored_arbiter(dir.path());
        let file = dir.path().join("tenants.toml");
        let two = |limit: &str| {
            format!("[tenants.a]\nlimit = \"{limit}\"\n[tenants.b]\nlimit = \"{limit}\"\n")
        };
        std::fs::write(&file, two("16MiB")).unwrap();
        let (_, stop) = start_watching(&arb, &file).await;
        assert_eq!(arb.lifecycle().worker_names(), vec!["tenants-config-watch"]);
        // The store writer is held busy, so the next reload waits in its queue.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (started, running) = tokio::sync::oneshot::channel::<()>();
        let blocker = tokio::spawn({
            let arb = arb.clone();
            async move {
                arb.changes()
                    .run(move |_| {
                        let _ = started.send(());
                        let _ = held.recv();
                        Ok(())
                    })
                    .await
            }
        });
        running.await.unwrap();
        // The watcher's reload holds a clone of the arbiter while it waits on the writer.
        let idle = Arc::strong_count(&arb);
        std::fs::write(&file, two("32MiB")).unwrap();
        let t = std::time::Instant::now();
        while Arc::strong_count(&arb) == idle && t.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            Arc::strong_count(&arb),
            idle + 1,
            "the reload is handed to the writer"
        );
        stop.cancel();
        let join = tokio::spawn({
            let arb = arb.clone();
            async move { arb.lifecycle().join(Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !join.is_finished(),
            "the join waits for the reload in flight"
        );
        let limits =
            |arb: &Arbiter| ["a", "b"].map(|t| arb.views().tenant(t).unwrap().quota.limit_bytes);
        assert_eq!(limits(&arb), [16 << 20; 2], "nothing applied yet");
        release.send(()).unwrap();
        assert!(join.await.unwrap().is_empty(), "every worker ended in time");
        blocker.await.unwrap().unwrap();
        assert_eq!(limits(&arb), [32 << 20; 2], "the reload applied whole");
        assert!(arb.lifecycle().worker_names().is_empty());
        // The watch has ended and the writer stopped: a later edit changes nothing.
        std::fs::write(&file, two("48MiB")).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(limits(&arb), [32 << 20; 2]);
        let refused = arb
            .changes()
            .run(move |a| Ok(apply(a, &load(&file).unwrap(), "late")))
            .await;
        assert!(
            matches!(refused, Err(crate::error::BrokerError::ShuttingDown)),
            "{refused:?}"
        );
        assert_eq!(limits(&arb), [32 << 20; 2], "refused whole");
    }
}
