//! A crate's module graph read from its sources, for the client's layer test
//! (`client/tests/layers.rs`): which sibling modules each
//! module's code names (through `crate::` or `super::` paths, comments aside, test modules
//! and macro arguments included; a directory module counts as one, with all its files),
//! what a module reaches through others, and the first import circle if there is one. The
//! sources are read as Rust tokens (proc-macro2's lexer: comments dropped, literals whole),
//! not through the compiler: a path a macro builds, or a glob import, is not seen.

use proc_macro2::{Delimiter, Spacing, TokenStream, TokenTree};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module -> the other modules of the graph it names.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// The names that follow `prefix` (`crate::`, `super::`; after any repeats of it:
/// `super::super::`) in a source file's code (not its comments or literals): the first
/// segment of each path, the first segment of each member of a `{...}` group (nested
/// groups and groups over several lines, as rustfmt writes a long one, included).
pub fn names_after(source: &str, prefix: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    paths(&tokens(source), keyword(prefix), 0, &mut |_, _, head| {
        found.insert(head);
    });
    found
}

/// The names a source file's code reaches at the root of the scanned tree through
/// `super::` chains, the file being `depth` modules below that root (`a.rs` and
/// `d/mod.rs`: 1; `d/x.rs`: 2): the chains exactly as long as the depth where they stand
/// (each inline `mod m { ... }` block adds one).
pub fn names_at_root(source: &str, depth: usize) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    paths(&tokens(source), "super", depth, &mut |n, at, head| {
        if n == at {
            found.insert(head);
        }
    });
    found
}

/// The keyword of a path prefix (`crate::`: `crate`).
fn keyword(prefix: &str) -> &str {
    prefix.trim_end_matches("::")
}

/// `source` as token trees (comments dropped; a doc comment is an attribute holding its
/// text as a literal).
fn tokens(source: &str) -> Vec<TokenTree> {
    let stream: TokenStream = source
        .parse()
        .unwrap_or_else(|e| panic!("not Rust tokens: {e}"));
    stream.into_iter().collect()
}

/// Whether `t` is the identifier `name`.
fn is_ident(t: Option<&TokenTree>, name: &str) -> bool {
    matches!(t, Some(TokenTree::Ident(i)) if i == name)
}

/// Whether `trees[i..]` starts with `::`.
fn is_path_sep(trees: &[TokenTree], i: usize) -> bool {
    match (trees.get(i), trees.get(i + 1)) {
        (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b))) => {
            a.as_char() == ':' && a.spacing() == Spacing::Joint && b.as_char() == ':'
        }
        _ => false,
    }
}

/// Every path in `trees` (groups, inline modules and macro arguments included) that starts
/// with one or more `start::` (`crate`, `super`): `found(n, depth, head)` for each head
/// after the `n` of them (the next segment, or each member's first of a `{...}` group),
/// `depth` being `base` plus the inline modules around the path.
fn paths(
    trees: &[TokenTree],
    start: &str,
    depth: usize,
    found: &mut impl FnMut(usize, usize, String),
) {
    let mut i = 0;
    while i < trees.len() {
        let fresh = i < 2 || !is_path_sep(trees, i - 2);
        if fresh && is_ident(trees.get(i), start) && is_path_sep(trees, i + 1) {
            let mut n = 0;
            while is_ident(trees.get(i), start) && is_path_sep(trees, i + 1) {
                n += 1;
                i += 3;
            }
            for head in heads(trees.get(i)) {
                found(n, depth, head);
            }
            continue;
        }
        if let TokenTree::Group(g) = &trees[i] {
            // `mod m { ... }`: one level down.
            let inline_mod = g.delimiter() == Delimiter::Brace
                && i >= 2
                && matches!(&trees[i - 1], TokenTree::Ident(_))
                && is_ident(trees.get(i - 2), "mod");
            let inner: Vec<TokenTree> = g.stream().into_iter().collect();
            paths(&inner, start, depth + usize::from(inline_mod), found);
        }
        i += 1;
    }
}

/// The names a path's next tree stands for: the identifier, or each member's first of a
/// `{...}` group (a glob: none).
fn heads(next: Option<&TokenTree>) -> Vec<String> {
    match next {
        Some(TokenTree::Ident(i)) => vec![i.to_string()],
        Some(TokenTree::Group(g)) if g.delimiter() == Delimiter::Brace => {
            let inner: Vec<TokenTree> = g.stream().into_iter().collect();
            inner
                .split(|t| matches!(t, TokenTree::Punct(p) if p.as_char() == ','))
                .flat_map(|member| heads(member.first()))
                .collect()
        }
        _ => Vec::new(),
    }
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
        let texts: Vec<(usize, String)> = if p.is_dir() {
            files(&p)
                .into_iter()
                .map(|(f, text)| {
                    let parts = f.strip_prefix(dir).unwrap().components().count();
                    let depth = if f.file_name().is_some_and(|n| n == "mod.rs") {
                        parts - 1
                    } else {
                        parts
                    };
                    (depth, text)
                })
                .collect()
        } else if p.extension().is_some_and(|x| x == "rs") {
            vec![(1, std::fs::read_to_string(&p).unwrap())]
        } else {
            continue;
        };
        let all: String = texts.iter().map(|(_, t)| format!("{t}\n")).collect();
        let mut named = scan(&all);
        for (depth, text) in &texts {
            named.extend(names_at_root(text, *depth));
        }
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
    fn a_double_slash_in_a_string_starts_no_comment() {
        let found = uses("let u = \"http://x\"; use crate::a::B;\nlet r = r#\"//\"#; crate::b::f();\nlet c = '\"'; crate::c::g(); // crate::d\n/* crate::e */ let s = \"crate::f\";\n");
        assert_eq!(found, set(&["a", "b", "c"]));
        // A lifetime, and a character literal that is a quote, end no literal early.
        let found = uses("fn f<'a>(x: &'a str) -> char { '\\'' } // crate::x\nlet y = crate::y::Z; let q = '\"'; crate::q::f();\n");
        assert_eq!(found, set(&["y", "q"]));
    }

    #[test]
    fn super_paths_out_of_a_directory_module_reach_its_siblings() {
        let dir = std::env::temp_dir().join(format!("module-graph-super-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("d/s")).unwrap();
        std::fs::write(dir.join("a.rs"), "use crate::d::X;\n").unwrap();
        std::fs::write(dir.join("b.rs"), "pub struct B;\n").unwrap();
        std::fs::write(dir.join("c.rs"), "pub struct C;\n").unwrap();
        std::fs::write(dir.join("e.rs"), "pub struct E;\n").unwrap();
        std::fs::write(dir.join("f.rs"), "pub struct F;\n").unwrap();
        // mod.rs's `super::` is the root; a child's `super::` is the directory module itself
        // (its own item, not a sibling), its `super::super::` the root; an inline module
        // adds a level.
        std::fs::write(
            dir.join("d/mod.rs"),
            "mod x;\nmod s;\nuse super::a::Y;\nmod tests { use super::super::f::F; use super::Z; }\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("d/x.rs"),
            "use super::b;\nuse super::super::{c::C, e};\n",
        )
        .unwrap();
        std::fs::write(dir.join("d/s/mod.rs"), "use super::super::b::B;\n").unwrap();
        let graph = module_graph(&dir, &[], uses);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(graph["d"], set(&["a", "b", "c", "e", "f"]));
        assert_eq!(circle(&graph).as_deref(), Some("a -> d -> a"));
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
