//! The CLI's modules (each a file of `src/`, naming its siblings through `super::`) form
//! no import circle.

use gpu_broker_module_graph::{circle, module_graph, uses_super};

#[test]
fn the_cli_modules_have_no_import_circle() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_graph(&src, &["main"], uses_super);
    if let Some(path) = circle(&graph) {
        panic!("import circle among the CLI's modules: {path}");
    }
    assert!(graph.len() >= 7, "only {} modules: {graph:?}", graph.len());
    // The check sees real dependencies (`super::status`, `super::super::status` in tests).
    assert!(graph["top"].contains("status"));
    assert!(graph["leaks"].contains("status"));
}
