//! A crate's module graph read from its sources, for the layer tests of the broker and the
//! client (`broker/tests/layers.rs`, `client/tests/layers.rs`): which sibling modules each
//! module's code names (through `crate::` or `super::` paths, comments aside, test modules
//! included; a directory module counts as one, with all its files), what a module reaches
//! through others, and the first import circle if there is one. It reads text, not the
//! compiler's view: a path a macro builds, or a glob import, is not seen.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module -> the other modules of the graph it names.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// The names that follow `prefix` (after any repeats of it: `super::super::`) in a source
/// file's code (not its comments): the first segment of each path, the first segment of
/// each member of a `{...}` group (nested groups and groups over several lines, as rustfmt
/// writes a long one, included).
pub fn names_after(source: &str, prefix: &str) -> BTreeSet<String> {
    let code: Vec<&str> = source
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect();
    let code = code.join("\n");
    let mut found = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find(prefix) {
        rest = &rest[at + prefix.len()..];
        while let Some(r) = rest.strip_prefix(prefix) {
            rest = r;
        }
        match rest.strip_prefix('{') {
            Some(group) => found.extend(group_heads(group)),
            None => {
                found.insert(head(rest));
            }
        }
    }
    found.remove("");
    found
}

/// The first path segment of each member of the group whose text follows its `{`.
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut member = String::new();
    let mut depth = 0usize;
    for c in group.chars() {
        match c {
            '}' if depth == 0 => break,
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => heads.push(head(&std::mem::take(&mut member))),
            _ if depth == 0 => member.push(c),
            _ => {}
        }
    }
    heads.push(head(&member));
    heads
}

/// The first identifier of a path's text.
fn head(path: &str) -> String {
    path.trim_start()
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .next()
        .unwrap_or("")
        .to_string()
}

/// The crate modules a source file's code names (`crate::NAME`).
pub fn uses(source: &str) -> BTreeSet<String> {
    names_after(source, "crate::")
}

/// The modules a source file's code names through `super::` (from a file of a directory
/// module: its siblings; `super::*` in a test module is that module's own parent).
pub fn uses_super(source: &str) -> BTreeSet<String> {
    names_after(source, "super::")
}

/// Every `.rs` file under `dir` (subdirectories too), in path order, with its text.
pub fn files(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    let mut out = Vec::new();
    for p in entries {
        if p.is_dir() {
            out.extend(files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            let text =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
            out.push((p, text));
        }
    }
    out
}

/// Every `.rs` file under `dir` (subdirectories too), read, in path order, one after the
/// other.
pub fn sources(dir: &Path) -> String {
    files(dir)
        .into_iter()
        .map(|(_, text)| text + "\n")
        .collect()
}

/// The modules of `dir` (each `.rs` file and each directory, as one module, but those named
/// in `skip`) -> the others among them that its code names through `scan`. Names that are
/// not modules of `dir` (re-exports, a parent's items) are dropped.
pub fn module_graph(dir: &Path, skip: &[&str], scan: fn(&str) -> BTreeSet<String>) -> Graph {
    let mut graph = Graph::new();
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    for e in entries {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().to_string();
        if skip.contains(&name.as_str()) {
            continue;
        }
        let text = if p.is_dir() {
            sources(&p)
        } else if p.extension().is_some_and(|x| x == "rs") {
            std::fs::read_to_string(&p).unwrap()
        } else {
            continue;
        };
        let mut named = scan(&text);
        named.remove(&name);
        graph.insert(name, named);
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for named in graph.values_mut() {
        named.retain(|n| modules.contains(n));
    }
    graph
}

/// Every module `from` reaches in `graph`, with the path to it (`a -> b -> c`).
pub fn reach(graph: &Graph, from: &str) -> BTreeMap<String, String> {
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
pub fn circle(graph: &Graph) -> Option<String> {
    graph.keys().find_map(|m| reach(graph, m).get(m).cloned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_scanner_reads_paths_groups_and_skips_comments() {
        let found = uses(
            "use crate::a::B;\nuse crate::{b, c::D};\nlet x = crate::d::f(); // crate::e\n/// [`crate::g`]\n",
        );
        assert_eq!(found, set(&["a", "b", "c", "d"]));
    }

    #[test]
    fn a_group_over_several_lines_is_read_whole() {
        // What rustfmt makes of a group too long for one line.
        let found = uses("use crate::{\n    arbiter::Arbiter,\n    error::{BrokerError, BrokerResult},\n    ledger,\n};\n");
        assert_eq!(found, set(&["arbiter", "error", "ledger"]));
    }

    #[test]
    fn a_nested_group_names_its_heads_only() {
        let found = uses("use crate::{a::{B, c::D}, e, f as g, self};\n");
        assert_eq!(found, set(&["a", "e", "f", "self"]));
        let found = uses_super("use super::{\n    a::{B, C},\n    d,\n};\n");
        assert_eq!(found, set(&["a", "d"]));
    }

    #[test]
    fn a_circle_closed_by_a_multi_line_group_is_found() {
        let dir = std::env::temp_dir().join(format!("module-graph-multi-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.rs"), "use crate::b::X;\n").unwrap();
        std::fs::write(
            dir.join("b.rs"),
            "use crate::{\n    a::Y,\n    c::{Z, W},\n};\n",
        )
        .unwrap();
        std::fs::write(dir.join("c.rs"), "pub struct Z;\n").unwrap();
        let graph = module_graph(&dir, &[], uses);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(graph["b"], set(&["a", "c"]));
        assert_eq!(circle(&graph).as_deref(), Some("a -> b -> a"));
    }

    #[test]
    fn the_super_scanner_skips_leading_supers_and_comments() {
        let found = uses_super(
            "use super::a::B;\nuse super::super::b::C;\nuse super::{c, d::E};\nlet w = super::WIDTH; // super::e\n",
        );
        assert_eq!(found, set(&["a", "b", "c", "d", "WIDTH"]));
    }

    #[test]
    fn the_circle_check_finds_a_circle_through_other_modules() {
        let edges = [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")];
        let mut graph = Graph::new();
        for (f, t) in edges {
            graph
                .entry(f.to_string())
                .or_default()
                .insert(t.to_string());
        }
        assert_eq!(circle(&graph).as_deref(), Some("a -> b -> c -> a"));
        assert_eq!(reach(&graph, "a")["d"], "a -> b -> c -> d");
        graph.get_mut("c").unwrap().remove("a");
        assert_eq!(circle(&graph), None);
    }

    #[test]
    fn a_directory_is_one_module_and_other_names_are_dropped() {
        let dir = std::env::temp_dir().join(format!("module-graph-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("d/inner")).unwrap();
        std::fs::write(dir.join("lib.rs"), "use crate::a;\n").unwrap();
        std::fs::write(dir.join("a.rs"), "use crate::d::X;\nuse crate::Reexport;\n").unwrap();
        std::fs::write(dir.join("d/mod.rs"), "mod inner;\n").unwrap();
        std::fs::write(dir.join("d/inner/deep.rs"), "use crate::a::Y;\n").unwrap();
        std::fs::write(dir.join("notes.txt"), "crate::a").unwrap();
        let graph = module_graph(&dir, &["lib"], uses);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            graph.keys().cloned().collect::<BTreeSet<_>>(),
            set(&["a", "d"])
        );
        assert_eq!(graph["a"], set(&["d"]));
        assert_eq!(graph["d"], set(&["a"]));
        assert_eq!(circle(&graph).as_deref(), Some("a -> d -> a"));
    }
}
