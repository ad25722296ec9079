//! The client's modules form layers, not circles: reads the crate's own sources and
//! checks, through `crate::` paths in code (comments aside, test modules included), that
//! no module among the connection, session, events, pump, reconnect, lease and turn
//! modules reaches a module that reaches back to it; that the library's whole module
//! graph (every file and directory of `src/`, a directory counting as one module) has no
//! import circle.

use gpu_broker_module_graph::{circle, module_graph, reach, uses, uses_super, Graph};
use std::collections::{BTreeMap, BTreeSet};

/// The modules kept in layers, lowest first (each may use only those before it).
const LAYERS: [&str; 11] = [
    "session_info",
    "lease_info",
    "client",
    "events",
    "handshake",
    "generation",
    "pump",
    "reconnect",
    "session",
    "lease",
    "turn",
];

fn graph() -> BTreeMap<&'static str, BTreeSet<String>> {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    LAYERS
        .iter()
        .map(|m| {
            let text = std::fs::read_to_string(src.join(format!("{m}.rs")))
                .unwrap_or_else(|e| panic!("read {m}.rs: {e}"));
            let named = uses(&text)
                .into_iter()
                .filter(|n| LAYERS.contains(&n.as_str()) && n != m)
                .collect();
            (*m, named)
        })
        .collect()
}

#[test]
fn session_modules_use_only_lower_layers() {
    let graph = graph();
    for (at, m) in LAYERS.iter().enumerate() {
        for used in &graph[m] {
            let level = LAYERS.iter().position(|l| l == used).unwrap();
            assert!(
                level < at,
                "{m}.rs uses crate::{used}, which is not below it ({LAYERS:?})"
            );
        }
    }
    // The check sees real dependencies (it would catch one going up).
    assert!(graph["session"].contains("reconnect"));
    assert!(graph["lease"].contains("session"));
    assert!(graph["reconnect"].contains("pump"));
}

/// The library's modules: every file and directory of `src/` but the crate root.
fn library_graph() -> Graph {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    module_graph(&src, &["lib"], uses)
}

#[test]
fn the_library_module_graph_has_no_import_circle() {
    let graph = library_graph();
    if let Some(path) = circle(&graph) {
        panic!("import circle: {path}");
    }
    // Every module of the library is in the graph, the session's layers among them.
    assert!(graph.len() >= 30, "only {} modules: {graph:?}", graph.len());
    for m in LAYERS {
        assert!(graph.contains_key(m), "no module {m}");
    }
    // The check sees real dependencies (it would catch one going back).
    assert!(graph["shared"].contains("admin"));
    assert!(graph["session"].contains("reconnect"));
    assert!(reach(&graph, "turn").contains_key("client"));
    // A top-level module names its siblings through `crate::` only (`super::` from the
    // top is the crate root, which the scan above would not follow).
    for (m, _) in graph.iter() {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("src/{m}.rs"));
        let Ok(text) = std::fs::read_to_string(&p) else {
            continue;
        };
        let named: Vec<String> = uses_super(&text)
            .into_iter()
            .filter(|n| graph.contains_key(n))
            .collect();
        assert!(named.is_empty(), "{m}.rs names {named:?} through super::");
    }
}
