//! Rules of the daemon's code that neither the compiler nor clippy can keep, checked by
//! reading the sources (comments aside). Kept elsewhere: the core's layering is its crate
//! boundary (no runtime, OS binding, RPC or metrics crate in `gpu-broker-core`; only the
//! core makes effects; the state lock is private to `arbiter/effects.rs`); its transitions'
//! clocks and I/O, who frees device memory and where a thread may sleep are clippy's
//! (`broker/core/clippy.toml`, `broker/clippy.toml`, by resolved path). What is left names
//! a crate in some modules and not others, or is a kind of item, which no type or path
//! can forbid: the command line and the wire stay at the edge; the process holds no
//! static but the listed ones; tonic is named only by the transport modules, listed with
//! their reasons (a refusal is a `BrokerError` everywhere else; `grpc_status.rs` makes it
//! a status). A last test checks that clippy's lists still name the rules it keeps.

use std::path::Path;

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// Where the command line may be named: the configuration parses the flags. Elsewhere a
/// component takes its own plain settings; only a component's flag group (a `...Flags`
/// struct deriving `clap::Args`, flattened into the configuration) may sit beside it, and
/// it converts into those settings. No domain type derives `clap::ValueEnum`.
const CLI_FILES: [&str; 3] = ["config.rs", "check_config.rs", "main.rs"];

/// Where the generated gRPC types may be named: the services and the server (the edge that
/// converts records to messages and back), a lease reply's handle (`fd/handles.rs`), the
/// ticket server (the ticket socket's reply bytes, shared with the client, are defined
/// beside the messages), a lease line (its frames carry the API's messages), and the read pool
/// (its test takes the services' method paths from the proto, to check each is served
/// where it should be).
const WIRE_FILES: [&str; 6] = [
    "service/",
    "server.rs",
    "fd/handles.rs",
    "fd/lease_line.rs",
    "fd/ticket_server.rs",
    "read_pool.rs",
];

/// Every `.rs` file of the daemon (`src/`) and of the core (`core/src/`), as (path relative
/// to `src/`, or `core/...`, and text).
fn all_sources() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("src");
    let core = root.join("core/src");
    rust_files(&src)
        .into_iter()
        .chain(rust_files(&core))
        .map(|p| {
            let rel = match p.strip_prefix(&src) {
                Ok(rel) => rel.to_string_lossy().to_string(),
                Err(_) => format!("core/{}", p.strip_prefix(&core).unwrap().to_string_lossy()),
            };
            let text = std::fs::read_to_string(&p).unwrap();
            (rel, text)
        })
        .collect()
}

/// The first line of `source`'s code (comments aside) that names the command line, other
/// than the `clap::Args` derive of a `...Flags` struct.
fn names_the_cli(source: &str) -> Option<String> {
    let code: Vec<&str> = source
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect();
    code.iter().enumerate().find_map(|(i, line)| {
        if !(line.contains("clap") || line.contains("ValueEnum")) {
            return None;
        }
        let flag_group = line.trim_start().starts_with("#[derive(")
            && line.contains("clap::Args")
            && !line.contains("ValueEnum")
            && code[i + 1..]
                .iter()
                .map(|l| l.trim())
                .find(|l| !l.is_empty() && !l.starts_with("#["))
                .and_then(|l| l.strip_prefix("pub struct "))
                .and_then(|l| l.split(|c: char| !c.is_alphanumeric()).next())
                .is_some_and(|name| name.ends_with("Flags"));
        (!flag_group).then(|| line.to_string())
    })
}

/// Does `code` name the generated gRPC types? The error reasons (`gpu_broker_proto::reason`)
/// are not messages: defined once beside the proto, every layer that refuses names them.
fn names_the_wire(code: &str) -> bool {
    code.contains("gpu_broker_proto") && !code.contains("gpu_broker_proto::reason")
}

// A scan: clap and the proto are dependencies of the whole crate; no path says which module.
#[test]
fn the_command_line_and_the_wire_stay_at_the_edge() {
    let mut cli_seen = 0;
    let mut wire_seen = 0;
    for (path, text) in all_sources() {
        let at = |files: &[&str]| files.iter().any(|f| path == *f || path.starts_with(f));
        if at(&CLI_FILES) {
            cli_seen += usize::from(text.contains("clap"));
        } else if let Some(line) = names_the_cli(&text) {
            panic!("{path} names the command line: {line}");
        }
        let wire = text
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .find(|code| names_the_wire(code));
        match wire {
            Some(_) if at(&WIRE_FILES) => wire_seen += 1,
            Some(line) => panic!("{path} names the gRPC messages: {line}"),
            None => {}
        }
    }
    // The checks see the command line and the wire where they are.
    assert!(names_the_wire("use gpu_broker_proto::v1 as pb;"));
    assert!(!names_the_wire(
        "pub use gpu_broker_proto::reason::{Reason, ERROR_DOMAIN};"
    ));
    assert!(cli_seen >= 2, "clap in {cli_seen} configuration files");
    assert!(
        wire_seen >= 5,
        "gRPC messages in {wire_seen} files of the edge"
    );
    assert!(
        names_the_cli("#[derive(Clone, Debug, clap::Args)]\npub struct MpsFlags {\n").is_none()
    );
    assert!(names_the_cli(
        "/// Flags.\n#[derive(Clone, clap::Args)]\n#[command(next_help_heading = \"x\")]\npub struct LimitFlags {\n"
    )
    .is_none());
    assert!(
        names_the_cli("#[derive(Clone, Copy, clap::ValueEnum)]\npub enum ReclaimPolicy {\n")
            .is_some()
    );
    assert!(names_the_cli("#[derive(Clone, clap::Args)]\npub struct Quota {\n").is_some());
    assert!(names_the_cli("use clap::Parser;\n").is_some());
    assert!(names_the_cli("// clap\nfn f() {}\n").is_none());
}

/// The broker's process-wide statics, each with its reason. Everything else a component
/// counts or keeps is a field of the component (the metrics are `metrics::Metrics`, owned
/// by the arbiter and passed in), so two arbiters in one process (the tests) share nothing;
/// a new static (a global counter, a registry) fails the test below, and so does one of
/// these gone.
const STATICS: [(&str, &str, &str); 2] = [
    (
        "core/error.rs",
        "STARTED",
        "when this process started: a session id older than that is another run's",
    ),
    (
        "device/cuda.rs",
        "PRESENT",
        "whether libcuda loads, checked once per process",
    ),
];

/// The names of the `static` items in `source`'s code (comments aside).
fn statics(source: &str) -> Vec<String> {
    source
        .lines()
        .map(|l| l.split("//").next().unwrap_or("").trim_start())
        .filter_map(|code| {
            let code = code
                .strip_prefix("pub(crate) ")
                .or_else(|| code.strip_prefix("pub "))
                .unwrap_or(code);
            let rest = code.strip_prefix("static ")?;
            let rest = rest.strip_prefix("mut ").unwrap_or(rest);
            Some(rest.split(':').next().unwrap_or("").trim().to_string())
        })
        .chain(
            source
                .lines()
                .map(|l| l.split("//").next().unwrap_or(""))
                .filter(|code| code.contains("lazy_static!") || code.contains("thread_local!"))
                .map(|code| code.trim().to_string()),
        )
        .collect()
}

// A scan: a `static` is a kind of item, not a type or path clippy could forbid.
#[test]
fn no_process_wide_state_but_the_listed_statics() {
    let mut found: Vec<(String, String)> = Vec::new();
    for (path, text) in all_sources() {
        for name in statics(&text) {
            found.push((path.clone(), name));
        }
    }
    for (path, name, why) in STATICS {
        let at = found.iter().position(|(p, n)| p == path && n == name);
        let Some(at) = at else {
            panic!("{path} has no static {name} ({why}) any more: drop it from the list");
        };
        found.remove(at);
    }
    assert!(
        found.is_empty(),
        "statics not listed (make them fields of their component): {found:?}"
    );
    // The check sees statics where they are.
    assert_eq!(
        statics("    static PRESENT: OnceLock<bool> = OnceLock::new();\n"),
        ["PRESENT"]
    );
    assert_eq!(
        statics("pub static LEASES: AtomicU64 = AtomicU64::new(0);\n"),
        ["LEASES"]
    );
    assert_eq!(statics("lazy_static! {\n"), ["lazy_static! {"]);
    assert!(statics("// static X: u8 = 0;\nlet s: &'static str = \"\";\n").is_empty());
}

/// Where the transport (tonic and its `tonic_*` companions) may be named, each with its
/// reason. Everything else speaks in domain types: a refusal is a `BrokerError`, and
/// `grpc_status.rs` alone makes it a status (code, message, reason and its numbers). A new
/// file naming tonic fails the test below, and so does one of these that no longer does.
const TRANSPORT: [(&str, &str); 9] = [
    (
        "server.rs",
        "builds the gRPC server, its health and reflection services",
    ),
    ("service/", "the services: requests in, statuses out"),
    (
        "grpc_status.rs",
        "a refusal becomes a gRPC status with its ErrorInfo",
    ),
    (
        "listener.rs",
        "accepts connections; refuses one over its caps with a status",
    ),
    (
        "gate.rs",
        "the tower layer that authenticates and scopes every call",
    ),
    (
        "auth.rs",
        "the services' interceptors: a request's token to a principal",
    ),
    (
        "rate.rs",
        "a call over the tenant's rate is a status with RetryInfo",
    ),
    (
        "read_pool.rs",
        "the tower layer that runs reads on their own runtime",
    ),
    (
        "health.rs",
        "device health reported to the gRPC health service",
    ),
];

/// The first line of `source`'s code (comments aside) that names tonic or a `tonic_*`
/// crate (not a word that merely ends in "tonic").
fn names_the_transport(source: &str) -> Option<String> {
    source
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .find(|code| {
            code.match_indices("tonic").any(|(at, _)| {
                !code[..at]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_')
            })
        })
        .map(str::to_string)
}

// A scan: tonic is a dependency of the whole crate; no path says which module.
#[test]
fn the_transport_is_named_only_at_the_edge() {
    let mut named: Vec<&str> = Vec::new();
    for (path, text) in all_sources() {
        let Some(line) = names_the_transport(&text) else {
            continue;
        };
        let listed = TRANSPORT
            .iter()
            .find(|(f, _)| path == *f || (f.ends_with('/') && path.starts_with(f)));
        match listed {
            Some((f, _)) => named.push(f),
            None => panic!(
                "{path} names the transport (only {:?} may): {line}",
                TRANSPORT.map(|(f, _)| f)
            ),
        }
    }
    for (f, why) in TRANSPORT {
        assert!(
            named.contains(&f),
            "{f} ({why}) names no tonic any more: drop it from the list"
        );
    }
    // The check sees tonic where it is, and only there.
    assert!(names_the_transport("use tonic::Status;\n").is_some());
    assert!(names_the_transport("fn f() -> Result<(), tonic::Status> {\n").is_some());
    assert!(names_the_transport("    reporter: tonic_health::server::HealthReporter,\n").is_some());
    assert!(names_the_transport("// tonic\n/// a `tonic::Status`\n").is_none());
    assert!(names_the_transport("/// a monotonic clock\nlet monotonic = 1;\n").is_none());
}

/// The paths `file`'s `key` list names (a `clippy.toml`'s `disallowed-methods` or
/// `disallowed-types`).
fn clippy_listed(file: &str, key: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
    let table: toml::Table = text.parse().unwrap_or_else(|e| panic!("{file}: {e}"));
    table
        .get(key)
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter_map(|e| e.get("path").and_then(|p| p.as_str()).map(String::from))
        .collect()
}

// The rules clippy keeps hold only while their lists name them and the transitions deny the
// lints: an emptied list or a dropped deny would let them go unnoticed.
#[test]
fn the_rules_clippy_keeps_are_listed() {
    let daemon = clippy_listed("clippy.toml", "disallowed-methods");
    for path in [
        "gpu_broker::device::Device::free",
        "gpu_broker::device::Device::free_checked",
        "std::thread::sleep",
    ] {
        assert!(
            daemon.iter().any(|p| p == path),
            "broker/clippy.toml lost {path}"
        );
    }
    let core_methods = clippy_listed("core/clippy.toml", "disallowed-methods");
    for path in [
        "std::time::Instant::now",
        "std::time::Instant::elapsed",
        "std::time::SystemTime::now",
        "uuid::Uuid::now_v7",
        "std::fs::read",
        "std::fs::write",
    ] {
        assert!(
            core_methods.iter().any(|p| p == path),
            "core/clippy.toml lost {path}"
        );
    }
    let core_types = clippy_listed("core/clippy.toml", "disallowed-types");
    for path in [
        "std::fs::File",
        "std::net::TcpStream",
        "std::os::unix::net::UnixStream",
    ] {
        assert!(
            core_types.iter().any(|p| p == path),
            "core/clippy.toml lost {path}"
        );
    }
    let state = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("core/src/state/mod.rs"),
    )
    .unwrap();
    assert!(
        state.contains(
            "#![cfg_attr(not(test), deny(clippy::disallowed_methods, clippy::disallowed_types))]"
        ),
        "the core's transitions no longer deny clippy's list"
    );
}
