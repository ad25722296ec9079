//! The shipped deployment material: every Kubernetes manifest validates against the
//! Kubernetes schemas (`kubernetes-validate --strict`, PyPI, offline; installed into
//! `target/k8s-venv` by `scripts/test-deps.sh`), the ConfigMap's config file is one the
//! broker accepts, and `scripts/install.sh --dry-run` installs both binaries. Container
//! images cannot be built here: the `Containerfile` is checked for what it copies only.

use gpu_broker_tests::*;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every Kubernetes object file under `deploy/kubernetes` (its subdirectories included;
/// the kustomization, which is not an object, left out).
fn manifests() -> Vec<PathBuf> {
    let mut v = Vec::new();
    let mut dirs = vec![root().join("deploy/kubernetes")];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|e| e == "yaml")
                && p.file_name().is_some_and(|n| n != "kustomization.yaml")
            {
                v.push(p);
            }
        }
    }
    v.sort();
    v
}

#[test]
fn every_kubernetes_manifest_validates() {
    let tool = root().join("target/k8s-venv/bin/kubernetes-validate");
    assert!(
        tool.exists(),
        "{} not found: install it with scripts/test-deps.sh (pip install kubernetes-validate \
         into target/k8s-venv), which the README's test command scripts/test.sh runs first",
        tool.display()
    );
    let files = manifests();
    assert!(files.len() >= 4, "{files:?}");
    let out = std::process::Command::new(&tool)
        .arg("--strict")
        .args(&files)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy();
        assert!(
            text.lines()
                .any(|l| l.contains(name.as_ref()) && l.contains("passed")),
            "{name} not validated:\n{text}"
        );
    }
}

#[test]
fn the_manifests_keep_their_promises() {
    let read = |f: &str| std::fs::read_to_string(root().join("deploy/kubernetes").join(f)).unwrap();
    let ds = read("daemonset.yaml");
    for want in [
        "kind: DaemonSet",
        "nodeSelector:",
        "path: /run/gpu-broker",
        "path: /var/lib/gpu-broker",
        "configMap:",
        "secretName: gpu-broker-admin-token",
        "livenessProbe:",
        "path: /healthz",
        "readinessProbe:",
        "path: /readyz",
        "resources:",
    ] {
        assert!(ds.contains(want), "daemonset.yaml lacks {want:?}");
    }
    assert!(
        !ds.contains("subPath"),
        "the config is mounted as a directory so that ConfigMap updates (symlink swaps) arrive"
    );
    let pod = read("examples/worker-pod.yaml");
    let spec: String = pod
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    for refused in ["hostPID", "hostIPC", "hostPath", "privileged"] {
        assert!(
            !spec.contains(refused),
            "{refused} in the worker pod:\n{spec}"
        );
    }
    assert!(pod.contains("resourceClaimTemplateName: gpu-memory-8gi"));

    // The ConfigMap's config file is one the broker accepts, tenants included.
    let cm = read("configmap.yaml");
    let start = cm.find("config.toml: |\n").expect("a config.toml key") + "config.toml: |\n".len();
    let config: String = cm[start..]
        .lines()
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.toml");
    std::fs::write(&file, config).unwrap();
    let out = std::process::Command::new(bin("gpu-broker"))
        .arg("check-config")
        .arg(&file)
        .args(["--broker", "unix:///nonexistent/broker.sock"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("valid (2 tenants declared)"), "{text}");
    assert!(
        text.contains("+ training: new tenant: limit 64.0 GiB"),
        "{text}"
    );

    let containerfile = std::fs::read_to_string(root().join("Containerfile")).unwrap();
    assert!(
        containerfile.contains("target/release/gpu-broker ")
            && containerfile.contains("gpu-brokerctl")
    );
}

#[test]
fn install_script_installs_both_binaries_the_group_and_the_unit() {
    let out = std::process::Command::new(root().join("scripts/install.sh"))
        .arg("--dry-run")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for want in [
        "cargo install --locked --path broker",
        "cargo install --locked --path client/ctl ",
        "/etc/systemd/system/gpu-broker.service",
        "/etc/systemd/system/gpu-broker-mps.service",
    ] {
        assert!(text.contains(want), "{want:?} in\n{text}");
    }
}

/// The systemd unit is sandboxed as far as GPU access allows: systemd's own scoring of it
/// (`systemd-analyze security`, offline) is at most 4.5 of 10, and it waits for readiness.
#[test]
fn the_systemd_unit_is_hardened_and_waits_for_readiness() {
    let unit = root().join("deploy/gpu-broker.service");
    let out = std::process::Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--threshold=45", "--no-pager"])
        .arg(&unit)
        .output()
        .expect("systemd-analyze (Debian's systemd package; scripts/test-deps.sh installs it)");
    let text = String::from_utf8_lossy(&out.stdout);
    let overall = text
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or_else(|| panic!("no overall score in:\n{text}"));
    assert!(out.status.success(), "the unit scores above 4.5: {overall}");
    let unit = std::fs::read_to_string(unit).unwrap();
    assert!(unit.contains("Type=notify") && unit.contains("NotifyAccess=main"));
}

/// `Type=notify`: the broker sends READY=1 once its sockets answer, and STOPPING=1 when a
/// stop signal arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_tells_systemd_when_it_is_ready_and_when_it_stops() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify.sock");
    let sock = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    let b = Broker::start_wrapped(
        vec!["env".into(), format!("NOTIFY_SOCKET={}", path.display())],
        BrokerOpts::default(),
    )
    .unwrap();
    let mut buf = [0u8; 256];
    let n = sock.recv(&mut buf).unwrap();
    assert_eq!(std::str::from_utf8(&buf[..n]).unwrap(), "READY=1\n");
    b.admin().await.unwrap().list_tenants().await.unwrap();
    b.signal(libc::SIGTERM);
    let n = sock.recv(&mut buf).unwrap();
    assert_eq!(std::str::from_utf8(&buf[..n]).unwrap(), "STOPPING=1\n");
}

/// The example PodMonitor selects the DaemonSet's pods by their label and scrapes the
/// port the DaemonSet names `metrics`.
#[test]
fn the_pod_monitor_scrapes_the_daemonsets_metrics_port() {
    let monitor =
        std::fs::read_to_string(root().join("deploy/prometheus/podmonitor.yaml")).unwrap();
    let daemonset =
        std::fs::read_to_string(root().join("deploy/kubernetes/daemonset.yaml")).unwrap();
    assert!(monitor.contains("kind: PodMonitor") && monitor.contains("- port: metrics"));
    assert!(daemonset.contains("- name: metrics\n              containerPort: 7478"));
    let label = "app.kubernetes.io/name: gpu-broker";
    assert!(monitor.contains(label) && daemonset.contains(label));
    assert!(
        daemonset.contains("fieldPath: spec.nodeName"),
        "NODE_NAME for Hostname"
    );
}

/// The build context of the image leaves out the build tree and the history.
#[test]
fn the_container_context_leaves_out_target_and_git() {
    let ignore = std::fs::read_to_string(root().join(".containerignore")).unwrap();
    let lines: Vec<&str> = ignore.lines().map(str::trim).collect();
    for want in ["target/", ".git/"] {
        assert!(lines.contains(&want), "{want} in .containerignore");
    }
}

/// `gpu-brokerctl completions SHELL` prints a script its shell accepts, naming the
/// subcommands; the installer installs them.
#[test]
fn shell_completions_come_from_the_cli_and_are_installed() {
    let out = std::process::Command::new(bin("gpu-brokerctl"))
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let script = String::from_utf8(out.stdout).unwrap();
    assert!(script.contains("quota") && script.contains("leases") && script.contains("run"));
    let checked = std::process::Command::new("bash")
        .arg("-n")
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(script.as_bytes())?;
            c.wait()
        })
        .unwrap();
    assert!(checked.success(), "bash parses the completion script");
    let dry = std::process::Command::new(root().join("scripts/install.sh"))
        .arg("--dry-run")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&dry.stdout);
    assert!(
        text.contains("completions bash > /usr/share/bash-completion/completions/gpu-brokerctl"),
        "{text}"
    );
}

/// Every file the docs name in backticks (`broker/src/x.rs`, `deploy/config.toml`) exists in
/// the repository (by path, or by name somewhere in it).
#[test]
fn the_docs_cite_only_files_that_exist() {
    let root = root();
    let mut all = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with('.') || name == "target" || name == "node_modules" {
                continue;
            }
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(rel) = p.strip_prefix(&root) {
                all.push(rel.to_string_lossy().to_string());
            }
        }
    }
    let exists = |cited: &str| {
        all.iter().any(|f| {
            f == cited
                || f.ends_with(&format!("/{cited}"))
                || f.rsplit('/').next() == Some(cited.rsplit('/').next().unwrap_or(cited))
        })
    };
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.push(root.join("README.md"));
    let exts = [
        ".rs", ".md", ".sh", ".toml", ".yml", ".yaml", ".json", ".service", ".py",
    ];
    let mut missing = Vec::new();
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        for (i, part) in text.split('`').enumerate() {
            let cited = part.trim();
            let is_path = i % 2 == 1
                && !cited.is_empty()
                && cited
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_./-".contains(c))
                && exts.iter().any(|e| cited.ends_with(e));
            if is_path && !exists(cited) {
                missing.push(format!("{}: {cited}", doc.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the docs cite files that do not exist: {missing:#?}"
    );
}

/// The systemd unit raises the descriptor limit (systemd's soft default of 1024 is what
/// idle connections exhausted) far enough that the broker's own connection cap (half the
/// limit, at most 4096) binds first.
#[test]
fn the_systemd_unit_raises_the_descriptor_limit_above_the_connection_cap() {
    let unit = std::fs::read_to_string(root().join("deploy/gpu-broker.service")).unwrap();
    let limit: u64 = unit
        .lines()
        .find_map(|l| l.trim().strip_prefix("LimitNOFILE="))
        .expect("deploy/gpu-broker.service sets LimitNOFILE")
        .trim()
        .parse()
        .expect("a number");
    assert!(limit >= 2 * 4096, "LimitNOFILE={limit}");
}

/// The systemd unit gives the broker a file-descriptor store that outlives a stop, large
/// enough for a lease per descriptor the broker may hold, and leaves the broker's
/// `keep-in = "auto"` to use it (docs/operations.md, "Restarts that keep every lease").
#[test]
fn the_systemd_unit_keeps_leases_in_its_file_descriptor_store() {
    let unit = std::fs::read_to_string(root().join("deploy/gpu-broker.service")).unwrap();
    let value = |key: &str| {
        unit.lines()
            .find_map(|l| l.trim().strip_prefix(key)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("deploy/gpu-broker.service sets {key}"))
            .trim()
            .to_string()
    };
    let max: u64 = value("FileDescriptorStoreMax").parse().unwrap();
    let nofile: u64 = value("LimitNOFILE").parse().unwrap();
    assert!(max >= nofile, "FileDescriptorStoreMax={max}");
    assert_eq!(value("FileDescriptorStorePreserve"), "yes");
    // What `keep-in = "auto"` reads: systemd before 254 does not set it.
    assert!(
        unit.lines()
            .any(|l| l.trim() == format!("Environment=FDSTORE={max}")),
        "the unit tells an older systemd's broker its store's size"
    );
    let config = std::fs::read_to_string(root().join("deploy/config.toml")).unwrap();
    assert!(config.contains("\nkeep-in = \"auto\"\n"));
}

/// The YAML documents of `file` (under `deploy/kubernetes`), parsed by PyYAML from the
/// venv `scripts/test-deps.sh` makes (the one kubernetes-validate runs in).
fn yaml_docs(file: &str) -> Vec<serde_json::Value> {
    let python = root().join("target/k8s-venv/bin/python");
    assert!(
        python.exists(),
        "{} not found: scripts/test-deps.sh makes it",
        python.display()
    );
    let out = std::process::Command::new(&python)
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))",
        ])
        .arg(root().join("deploy/kubernetes").join(file))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{file}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The one document of `kind` in `file`.
fn doc(file: &str, kind: &str) -> serde_json::Value {
    let docs = yaml_docs(file);
    let found: Vec<_> = docs.into_iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind} in {file}");
    found.into_iter().next().unwrap()
}

/// A container's environment variable (a plain `value`).
fn env_of(container: &serde_json::Value, name: &str) -> String {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
        .unwrap_or_else(|| panic!("no {name} in {container}"))
        .to_string()
}

/// Where `volume` of `pod_spec` comes from on the host (`hostPath.path`), if it does.
fn host_path_of(pod_spec: &serde_json::Value, volume: &str) -> Option<String> {
    pod_spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == volume)
        .and_then(|v| v["hostPath"]["path"].as_str())
        .map(String::from)
}

/// The broker's config file, out of the ConfigMap.
fn broker_config() -> toml::Table {
    let cm = doc("configmap.yaml", "ConfigMap");
    cm["data"]["config.toml"].as_str().unwrap().parse().unwrap()
}

/// `kubectl apply -k deploy/kubernetes/` on first use: the kustomization lists the
/// namespace first and then every object file of the fleet (the examples, applied in a
/// tenant's namespace, aside), each of which names that namespace or is cluster-scoped;
/// the admin token comes from a generated Secret (no placeholder is shipped).
#[test]
fn the_kustomization_applies_the_fleet_namespace_first() {
    let k = &yaml_docs("kustomization.yaml")[0];
    assert_eq!(k["kind"], "Kustomization");
    let resources: Vec<String> = k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    let first = doc(&resources[0], "Namespace");
    let ns = first["metadata"]["name"].as_str().unwrap().to_string();
    assert_eq!(ns, "gpu-broker");
    let base = root().join("deploy/kubernetes");
    let listed: Vec<PathBuf> = resources.iter().map(|r| base.join(r)).collect();
    for m in manifests() {
        let rel = m.strip_prefix(&base).unwrap().to_string_lossy().to_string();
        if rel.starts_with("examples/") {
            assert!(!listed.contains(&m), "{rel}: examples are not the fleet's");
            continue;
        }
        assert!(listed.contains(&m), "{rel} is not in kustomization.yaml");
        let text = std::fs::read_to_string(&m).unwrap();
        assert!(
            !text.contains(gpu_broker::admin_token::PLACEHOLDER),
            "{rel} ships the placeholder"
        );
    }
    let cluster_scoped = [
        "Namespace",
        "DeviceClass",
        "ClusterRole",
        "ClusterRoleBinding",
    ];
    for r in &resources[1..] {
        for d in yaml_docs(r) {
            let kind = d["kind"].as_str().unwrap().to_string();
            if cluster_scoped.contains(&kind.as_str()) {
                assert!(kind != "Namespace", "{r}: one namespace, listed first");
                continue;
            }
            assert_eq!(d["metadata"]["namespace"], ns.as_str(), "{r}: {kind}");
        }
    }
    let secret = &k["secretGenerator"][0];
    assert_eq!(secret["name"], "gpu-broker-admin-token");
    assert_eq!(secret["namespace"], ns.as_str());
    assert_eq!(k["generatorOptions"]["disableNameSuffixHash"], true);
    let ignored = std::fs::read_to_string(root().join(".gitignore")).unwrap();
    assert!(
        secret["files"][0] == "admin.token" && ignored.lines().any(|l| l == "*.token"),
        "the generated Secret's file is the operator's, never committed"
    );
}

/// The Admin service is on the operators' socket alone, which is outside the workers'
/// socket directory; `kubectl exec ... gpu-brokerctl` in the broker pod finds that socket
/// and the admin token through the container's environment (the Secret's mount); the
/// DRA driver reaches the same socket and token; the sockets' group is in the worker's
/// supplementary groups.
#[test]
fn operators_and_the_driver_reach_admin_and_workers_do_not() {
    let config = broker_config();
    let admin_listen = config["admin-listen"].as_str().unwrap().to_string();
    let socket = config["socket"].as_str().unwrap().to_string();
    assert_eq!(config["admin-listen-only"].as_bool(), Some(true));
    let socket_dir = Path::new(&socket).parent().unwrap();
    assert!(!Path::new(&admin_listen).starts_with(socket_dir));

    let ds = doc("daemonset.yaml", "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    let broker = &pod["containers"][0];
    assert_eq!(
        env_of(broker, "GPU_BROKER_ADDR"),
        format!("unix://{admin_listen}")
    );
    let token_file = env_of(broker, "GPU_BROKER_ADMIN_TOKEN_FILE");
    assert_eq!(
        config["admin-token-file"].as_str(),
        Some(token_file.as_str())
    );
    let mounted = broker["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| {
            Path::new(&token_file).parent() == Some(Path::new(m["mountPath"].as_str().unwrap()))
        })
        .expect("the admin token's directory is a mount");
    let secret = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mounted["name"])
        .unwrap();
    assert_eq!(secret["secret"]["secretName"], "gpu-broker-admin-token");
    let admin_dir = Path::new(&admin_listen).parent().unwrap().to_str().unwrap();

    // The DRA driver: its own service account, the broker's operators' socket and token.
    let dra = doc("dra/daemonset.yaml", "DaemonSet");
    let dra_pod = &dra["spec"]["template"]["spec"];
    let host = |p: &serde_json::Value, mount_path: &str| {
        let c = &p["containers"][0];
        let m = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["mountPath"] == mount_path)
            .unwrap_or_else(|| panic!("{mount_path} not mounted"));
        host_path_of(p, m["name"].as_str().unwrap())
    };
    assert_eq!(host(pod, admin_dir), host(dra_pod, admin_dir));
    assert!(host(pod, admin_dir).is_some());
    let args: Vec<&str> = dra_pod["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.contains(&format!("--broker=unix://{admin_listen}").as_str()),
        "{args:?}"
    );
    assert!(
        args.contains(&format!("--admin-token-file={token_file}").as_str()),
        "{args:?}"
    );
    let role = doc("dra/rbac.yaml", "ClusterRole");
    let may = |resource: &str, verb: &str| {
        role["rules"].as_array().unwrap().iter().any(|r| {
            r["resources"]
                .as_array()
                .unwrap()
                .iter()
                .any(|x| x == resource)
                && r["verbs"].as_array().unwrap().iter().any(|x| x == verb)
        })
    };
    for verb in ["create", "update", "delete", "list"] {
        assert!(may("resourceslices", verb), "resourceslices {verb}");
    }
    for verb in ["get", "watch"] {
        assert!(may("resourceclaims", verb), "resourceclaims {verb}");
    }
    assert!(!may("resourceclaims", "update") && !may("secrets", "get"));
    let binding = doc("dra/rbac.yaml", "ClusterRoleBinding");
    assert_eq!(
        binding["subjects"][0]["name"],
        dra_pod["serviceAccountName"]
    );

    // A worker: non-root, in the sockets' group, its GPU memory by a claim of the class.
    let worker = doc("examples/worker-pod.yaml", "Pod");
    let group = broker["securityContext"]["runAsGroup"].as_i64().unwrap();
    let sc = &worker["spec"]["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true);
    assert!(sc["supplementalGroups"]
        .as_array()
        .unwrap()
        .iter()
        .any(|g| g.as_i64() == Some(group)));
    let template = doc("examples/worker-pod.yaml", "ResourceClaimTemplate");
    let request = &template["spec"]["spec"]["devices"]["requests"][0]["exactly"];
    let class = doc("dra/deviceclass.yaml", "DeviceClass");
    assert_eq!(request["deviceClassName"], class["metadata"]["name"]);
    assert_eq!(request["capacity"]["requests"]["memory"], "8Gi");
    assert_eq!(
        worker["spec"]["resourceClaims"][0]["resourceClaimTemplateName"],
        template["metadata"]["name"]
    );
}

/// The broker pod runs as its own ServiceAccount, bound to `system:auth-delegator` and to
/// nothing else, so `token-review-audience` works as shipped: its TokenReviews are allowed.
#[test]
fn the_broker_may_review_tokens_and_nothing_more() {
    let ds = doc("daemonset.yaml", "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    let account = doc("rbac.yaml", "ServiceAccount");
    assert_eq!(pod["serviceAccountName"], account["metadata"]["name"]);
    assert_eq!(
        account["metadata"]["namespace"],
        ds["metadata"]["namespace"]
    );
    let binding = doc("rbac.yaml", "ClusterRoleBinding");
    assert_eq!(binding["roleRef"]["kind"], "ClusterRole");
    assert_eq!(binding["roleRef"]["name"], "system:auth-delegator");
    let subjects = binding["subjects"].as_array().unwrap();
    assert_eq!(subjects.len(), 1, "{subjects:?}");
    assert_eq!(subjects[0]["kind"], "ServiceAccount");
    assert_eq!(subjects[0]["name"], account["metadata"]["name"]);
    assert_eq!(subjects[0]["namespace"], account["metadata"]["namespace"]);
    // No Role or ClusterRole of the broker's own: it is granted nothing else.
    let text = std::fs::read_to_string(root().join("deploy/kubernetes/rbac.yaml")).unwrap();
    assert!(!text.contains("\nkind: ClusterRole\n") && !text.contains("\nkind: Role\n"));
}

/// What `kubectl exec <broker pod> -- gpu-brokerctl tenants list` does, here: a broker
/// with the ConfigMap's operators' socket settings and a token file at the Secret's
/// place, and gpu-brokerctl with nothing but the DaemonSet container's environment.
#[test]
fn gpu_brokerctl_in_the_broker_pod_needs_no_flags() {
    let ds = doc("daemonset.yaml", "DaemonSet");
    let broker = &ds["spec"]["template"]["spec"]["containers"][0];
    let (addr, token_file) = (
        env_of(broker, "GPU_BROKER_ADDR"),
        env_of(broker, "GPU_BROKER_ADMIN_TOKEN_FILE"),
    );
    // The pod's paths, under a temporary root.
    let dir = tempfile::tempdir().unwrap();
    let at = |p: &str| dir.path().join(p.trim_start_matches('/'));
    let admin_sock = at(addr.trim_start_matches("unix://"));
    let token_path = at(&token_file);
    std::fs::create_dir_all(token_path.parent().unwrap()).unwrap();
    let (token, _) = gpu_broker::auth::generate_token();
    std::fs::write(&token_path, &token).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&token_path, std::fs::Permissions::from_mode(0o400)).unwrap();
    let config = dir.path().join("tenants.toml");
    std::fs::write(&config, "[tenants.training]\nlimit = \"32MiB\"\n").unwrap();
    let log = dir.path().join("broker.log");
    let mut broker = std::process::Command::new(bin("gpu-broker"))
        .args([
            "--backend",
            "host",
            "--host-capacity",
            "64MiB",
            "--admin-listen-only",
        ])
        .arg("--socket")
        .arg(dir.path().join("run/gpu-broker/broker.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--host-shm-dir")
        .arg(dir.path().join("shm"))
        .arg("--admin-listen")
        .arg(&admin_sock)
        .arg("--admin-token-file")
        .arg(&token_path)
        .arg("--config")
        .arg(&config)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(&admin_sock).is_err() {
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            broker.try_wait().unwrap().is_none(),
            "the broker exited:\n{log}"
        );
        assert!(started.elapsed().as_secs() < 20, "not serving:\n{log}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = std::process::Command::new(bin("gpu-brokerctl"))
        .args(["tenants", "list"])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env(
            "GPU_BROKER_ADDR",
            format!("unix://{}", admin_sock.display()),
        )
        .env("GPU_BROKER_ADMIN_TOKEN_FILE", &token_path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("training"),
        "{text}{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    broker.kill().unwrap();
    broker.wait().unwrap();
}
