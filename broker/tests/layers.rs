//! The broker's modules form layers where it matters: reads the crate's own sources and
//! checks, through `crate::` paths in code (comments aside, test modules included), that
//! the configuration is on no import circle and that nothing below the arbiter reaches up
//! into it, the configuration, the services or the server; that the module graph has no
//! import circle at all; and that the arbiter's core
//! (`arbiter/state/` and the records it owns) names no tokio. A directory module
//! (`arbiter/`, `device/`, `service/`, `mps/`) counts as one module.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Modules below the arbiter: the state it owns, the devices, the records and their rules.
const BELOW_ARBITER: [&str; 25] = [
    "units",
    "tier",
    "faults",
    "audit",
    "bounds",
    "process",
    "quota",
    "error",
    "device",
    "pool",
    "lease",
    "ledger",
    "session",
    "sharing",
    "availability",
    "scheduler",
    "views",
    "defaults",
    "backend",
    "store",
    "auth",
    "rate",
    "gate",
    "metrics",
    "tickets",
];

/// What those must never reach, directly or through other modules.
const ABOVE: [&str; 4] = ["arbiter", "config", "service", "server"];

/// The crate modules a source file's code (not its comments) names.
fn uses(source: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for line in source.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let names: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
                group
                    .split('}')
                    .next()
                    .unwrap_or("")
                    .split(',')
                    .map(|n| n.trim().split("::").next().unwrap_or(""))
                    .collect()
            } else {
                vec![rest
                    .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .next()
                    .unwrap_or("")]
            };
            found.extend(names.into_iter().map(str::to_string));
        }
    }
    found
}

/// Every `.rs` file under `dir`, read.
fn sources(dir: &Path, out: &mut String) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push_str(&std::fs::read_to_string(&p).unwrap());
            out.push('\n');
        }
    }
}

/// Module -> the other crate modules it names.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph = BTreeMap::new();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().to_string();
        if matches!(name.as_str(), "lib" | "main") {
            continue;
        }
        let mut text = String::new();
        if p.is_dir() {
            sources(&p, &mut text);
        } else if p.extension().is_some_and(|x| x == "rs") {
            text = std::fs::read_to_string(&p).unwrap();
        } else {
            continue;
        }
        let mut named = uses(&text);
        named.remove(&name);
        graph.insert(name, named);
    }
    // Names that are not modules (`crate::Foo` re-exports) are dropped.
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for named in graph.values_mut() {
        named.retain(|n| modules.contains(n));
    }
    graph
}

/// Every module `from` reaches, with the path to it.
fn reach(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> BTreeMap<String, String> {
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    let mut todo = vec![(from.to_string(), from.to_string())];
    while let Some((m, path)) = todo.pop() {
        for n in graph.get(&m).into_iter().flatten() {
            if !seen.contains_key(n) {
                let p = format!("{path} -> {n}");
                seen.insert(n.clone(), p.clone());
                todo.push((n.clone(), p));
            }
        }
    }
    seen
}

#[test]
fn the_configuration_is_on_no_import_circle() {
    let graph = graph();
    let back = reach(&graph, "config");
    if let Some(path) = back.get("config") {
        panic!("config reaches itself: {path}");
    }
    // The check sees real dependencies (it would catch one going back).
    assert!(graph["config"].contains("arbiter"));
    assert!(back.contains_key("backend"), "config reaches the backend");
}

#[test]
fn nothing_below_the_arbiter_reaches_up() {
    let graph = graph();
    for m in BELOW_ARBITER {
        assert!(graph.contains_key(m), "no module {m}");
        let reached = reach(&graph, m);
        for up in ABOVE {
            if let Some(path) = reached.get(up) {
                panic!("{m} reaches {up}: {path}");
            }
        }
    }
    assert!(graph["arbiter"].contains("backend"));
    assert!(reach(&graph, "arbiter").contains_key("ledger"));
}

#[test]
fn the_scanner_reads_paths_groups_and_skips_comments() {
    let found = uses(
        "use crate::a::B;\nuse crate::{b, c::D};\nlet x = crate::d::f(); // crate::e\n/// [`crate::g`]\n",
    );
    let want: BTreeSet<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
    assert_eq!(found, want);
}

/// A module that reaches itself in `graph`, with the path (the first found).
fn circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<String> {
    graph.keys().find_map(|m| reach(graph, m).get(m).cloned())
}

#[test]
fn the_module_graph_has_no_import_circle() {
    let graph = graph();
    if let Some(path) = circle(&graph) {
        panic!("import circle: {path}");
    }
    // The check sees the imports that once closed circles, now one way: the arbiter holds
    // the audit log, the fault source and the reservations' table; the health monitor
    // drives the arbiter; errors name the tier; the ledger and the bounds return errors.
    assert!(graph["arbiter"].contains("audit"));
    assert!(graph["arbiter"].contains("faults"));
    assert!(graph["arbiter"].contains("reservations"));
    assert!(graph["health"].contains("arbiter"));
    assert!(graph["error"].contains("tier"));
    assert!(graph["ledger"].contains("error"));
    assert!(graph["bounds"].contains("error"));
    // The metrics, the tickets, the ticket server and the arbiter: one way only.
    assert!(!reach(&graph, "metrics").contains_key("tickets"));
    assert!(!reach(&graph, "tickets").contains_key("arbiter"));
    assert!(reach(&graph, "arbiter").contains_key("metrics"));
    assert!(reach(&graph, "ticket_server").contains_key("arbiter"));
}

#[test]
fn the_circle_check_finds_a_circle_through_other_modules() {
    let edges = [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")];
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (f, t) in edges {
        graph
            .entry(f.to_string())
            .or_default()
            .insert(t.to_string());
    }
    assert_eq!(circle(&graph).as_deref(), Some("a -> b -> c -> a"));
    graph.get_mut("c").unwrap().remove("a");
    assert_eq!(circle(&graph), None);
}

/// The arbiter's core and the records it owns (paths under `src/`; a directory: every file
/// in it). They name no tokio type (the shell owns every channel and task: `effects.rs`,
/// `outbox.rs`) and do not ask whether a process lives (`crate::process`, a `/proc` read:
/// the shell looks before the lock or after it). The files' own test modules (from a line `#[cfg(test)]` on) may use a
/// runtime to drive the whole arbiter, except the core's model test, which drives the core
/// directly.
const CORE: [&str; 10] = [
    "arbiter/state",
    "arbiter/queue.rs",
    "arbiter/overtaking.rs",
    "availability.rs",
    "session.rs",
    "lease.rs",
    "ledger.rs",
    "pool.rs",
    "sharing.rs",
    "reservations.rs",
];

/// What the core's code must not name.
const NOT_IN_THE_CORE: [&str; 2] = ["tokio", "crate::process::"];

/// The first line of `source`'s code (comments and, with `tests_apart`, its test module
/// aside) that names one of [`NOT_IN_THE_CORE`].
fn names_forbidden(source: &str, tests_apart: bool) -> Option<String> {
    source
        .lines()
        .take_while(|l| !(tests_apart && l.trim() == "#[cfg(test)]"))
        .map(|l| l.split("//").next().unwrap_or(""))
        .find(|code| NOT_IN_THE_CORE.iter().any(|w| code.contains(w)))
        .map(str::to_string)
}

#[test]
fn the_core_names_no_tokio_and_reads_no_liveness() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut checked = 0;
    for path in CORE {
        let p = src.join(path);
        let files: Vec<std::path::PathBuf> = if p.is_dir() {
            let mut v: Vec<_> = std::fs::read_dir(&p)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|f| f.extension().is_some_and(|x| x == "rs"))
                .collect();
            v.sort();
            v
        } else {
            vec![p]
        };
        for f in files {
            let text =
                std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("read {}: {e}", f.display()));
            // Inside the core's own directory the test modules are the core's too.
            if let Some(line) = names_forbidden(&text, !path.starts_with("arbiter/state")) {
                panic!("{} names tokio or process liveness: {line}", f.display());
            }
            checked += 1;
        }
    }
    assert!(checked >= 12, "only {checked} core files found");
    // The check sees tokio where it is.
    assert!(names_forbidden("use tokio::sync::mpsc;\n", true).is_some());
    assert!(names_forbidden("let a = crate::process::process_alive(p);\n", true).is_some());
    assert!(names_forbidden("use crate::process_group::ProcessGroup;\n", true).is_none());
    assert!(names_forbidden(
        "// tokio\nfn f() {}\n#[cfg(test)]\nmod t { use tokio; }\n",
        true
    )
    .is_none());
    assert!(names_forbidden("#[cfg(test)]\nmod t { use tokio; }\n", false).is_some());
}
