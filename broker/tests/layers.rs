//! The broker's modules form layers where it matters: reads the crate's own sources and
//! checks, through `crate::` paths in code (comments aside, test modules included), that
//! the configuration is on no import circle and that nothing below the arbiter reaches up
//! into it, the configuration, the services or the server; that the module graph has no
//! import circle at all; and that the arbiter's core (`arbiter/state/` and the records it
//! owns) names no tokio. A directory module (`arbiter/`, `device/`, `service/`, `mps/`)
//! counts as one module. The graph is read by `gpu-broker-module-graph`
//! (`tests/module-graph`), shared with the client's layer test.

use gpu_broker_module_graph::{circle, module_graph, reach, uses, Graph};
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

/// Module -> the other crate modules it names (`lib.rs` and `main.rs`, the roots, aside).
fn graph() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    module_graph(&src, &["lib", "main"], uses)
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
