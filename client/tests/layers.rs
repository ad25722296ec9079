//! The session's modules form layers, not a circle: reads the crate's own sources and
//! checks that no module among the connection, session, events, pump, reconnect,
//! lease and turn modules reaches (through `crate::` paths in code, comments aside) a
//! module that reaches back to it.

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
