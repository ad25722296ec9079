//! The lists kept beside the Rust one (`gpu_broker_proto::reason::Reason`) say the same:
//! the reasons table of `docs/protocol.md` has exactly one row per reason, with its code,
//! and the Python package's `gpubroker.errors.REASONS` names exactly the reasons (the
//! Python tests check each class against its code through `_native.REASON_CODES`).

use gpu_broker_proto::reason::Reason;
use std::collections::BTreeSet;

fn read(path: &str) -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `tonic::Code`'s canonical name (`ResourceExhausted` -> `RESOURCE_EXHAUSTED`).
fn code_name(r: &Reason) -> String {
    let mut name = String::new();
    for c in format!("{:?}", r.code().unwrap()).chars() {
        if c.is_ascii_uppercase() && !name.is_empty() {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    name
}

/// The list's reasons as rows of `(reason, code)`.
fn known() -> Vec<(String, String)> {
    Reason::KNOWN
        .iter()
        .map(|r| (r.as_str().to_string(), code_name(r)))
        .collect()
}

#[test]
fn the_protocol_table_has_one_row_per_reason_with_its_code() {
    let doc = read("docs/protocol.md");
    let section = doc
        .split("\n# Refusals: codes and reasons\n")
        .nth(1)
        .expect("a section \"Refusals: codes and reasons\"");
    let section = section.split("\n# ").next().unwrap();
    let rows: Vec<(String, String)> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(|c| c.trim().trim_matches('`')).collect();
            (cells[0].to_string(), cells[1].to_string())
        })
        .collect();
    let mut known = known();
    assert!(known.len() >= 50, "{known:?}");
    assert!(known.contains(&("TOKEN_EXPIRED".into(), "UNAUTHENTICATED".into())));
    let mut table = rows.clone();
    table.sort();
    known.sort();
    let named: BTreeSet<_> = rows.iter().map(|(r, _)| r).collect();
    assert_eq!(named.len(), rows.len(), "a reason has two rows");
    let missing: Vec<_> = known.iter().filter(|r| !table.contains(r)).collect();
    let extra: Vec<_> = table.iter().filter(|r| !known.contains(r)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "docs/protocol.md's table lacks {missing:?} and has {extra:?} that the list \
         (proto/src/reason.rs) has not"
    );
}

#[test]
fn the_python_package_names_exactly_the_reasons() {
    let text = read("client/python/python/gpubroker/errors.py");
    let dict = text
        .split("REASONS: Dict[str, Type[BrokerError]] = {")
        .nth(1)
        .and_then(|rest| rest.split("\n}").next())
        .expect("the REASONS dict in gpubroker/errors.py");
    let python: BTreeSet<String> = dict
        .lines()
        .filter_map(|l| l.trim().strip_prefix('"'))
        .filter_map(|l| l.split('"').next())
        .map(str::to_string)
        .collect();
    let known: BTreeSet<String> = known().into_iter().map(|(r, _)| r).collect();
    assert!(python.contains("QUOTA_EXCEEDED"), "{python:?}");
    assert_eq!(
        python.symmetric_difference(&known).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "gpubroker.errors.REASONS and proto/src/reason.rs differ"
    );
}
