//! The client's modules form layers, not circles: reads the crate's own sources and
//! checks, through `crate::` paths in code (comments aside, test modules included), that
//! no module among the connection, session, events, pump, reconnect, lease and turn
//! modules reaches a module that reaches back to it; that the library's whole module
//! graph (every file and directory of `src/`, a directory counting as one module) has no
//! import circle; and that the CLI's modules (`src/ctl/`, part of the `gpu-brokerctl`
//! binary, which name each other through `super::`) have none either.

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

/// The names that follow `prefix` (after any repeats of it: `super::super::`) in a
/// source file's code (not its comments): the first segment of each path, each member of a
/// `{...}` group.
fn names_after(source: &str, prefix: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for line in source.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find(prefix) {
            rest = &rest[at + prefix.len()..];
            while let Some(r) = rest.strip_prefix(prefix) {
                rest = r;
            }
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

/// The crate modules a source file's code (not its comments) names.
fn uses(source: &str) -> BTreeSet<String> {
    names_after(source, "crate::")
}

/// The modules that `source` names through `super::` (a top-level module's `super` is the
/// crate root; `super::*` in a test module is its own parent).
fn uses_super(source: &str) -> BTreeSet<String> {
    names_after(source, "super::")
}

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

#[test]
fn the_scanner_reads_paths_groups_and_skips_comments() {
    let found = uses(
        "use crate::a::B;\nuse crate::{b, c::D};\nlet x = crate::d::f(); // crate::e\n/// [`crate::g`]\n",
    );
    let want: BTreeSet<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
    assert_eq!(found, want);
}

/// Every `.rs` file under `dir`, read, in name order.
fn read_all(dir: &std::path::Path, out: &mut String) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            read_all(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push_str(&std::fs::read_to_string(&p).unwrap());
            out.push('\n');
        }
    }
}

/// The modules of `dir` (each `.rs` file but `skip`, and each directory as one module)
/// -> the others among them that its code names through `scan`.
fn module_graph(
    dir: &std::path::Path,
    skip: &[&str],
    scan: fn(&str) -> BTreeSet<String>,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().to_string();
        if skip.contains(&name.as_str()) {
            continue;
        }
        let mut text = String::new();
        if p.is_dir() {
            read_all(&p, &mut text);
        } else if p.extension().is_some_and(|x| x == "rs") {
            text = std::fs::read_to_string(&p).unwrap();
        } else {
            continue;
        }
        let mut named = scan(&text);
        named.remove(&name);
        graph.insert(name, named);
    }
    // Names that are not modules (re-exports, the parent's items) are dropped.
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for named in graph.values_mut() {
        named.retain(|n| modules.contains(n));
    }
    graph
}

/// The library's modules: every file and directory of `src/` but the crate root and the
/// binary's (`bin/`, and `ctl/`, which the binary includes as its own module).
fn library_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    module_graph(&src, &["lib", "bin", "ctl"], uses)
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

/// A module that reaches itself in `graph`, with the path (the first found).
fn circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<String> {
    graph.keys().find_map(|m| reach(graph, m).get(m).cloned())
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

#[test]
fn the_cli_modules_have_no_import_circle() {
    let ctl = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ctl");
    let graph = module_graph(&ctl, &["mod"], uses_super);
    if let Some(path) = circle(&graph) {
        panic!("import circle among the CLI's modules: {path}");
    }
    assert!(graph.len() >= 7, "only {} modules: {graph:?}", graph.len());
    // The check sees real dependencies (`super::status`, `super::super::status` in tests).
    assert!(graph["top"].contains("status"));
    assert!(graph["leaks"].contains("status"));
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

#[test]
fn the_super_scanner_skips_leading_supers_and_comments() {
    let found = uses_super(
        "use super::a::B;\nuse super::super::b::C;\nuse super::{c, d::E};\nlet w = super::WIDTH; // super::e\n",
    );
    let want: BTreeSet<String> = ["a", "b", "c", "d", "WIDTH"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(found, want);
}
