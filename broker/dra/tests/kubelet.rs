//! The driver end to end: a fake kubelet speaking the real registration and DRA protos
//! drives the plugin binary against a real broker (host backend) and a fake API server.

mod support;

use anyhow::Result;
use gpu_broker_client::{Client, QuotaSpec};
use gpu_broker_dra::broker::Broker as BrokerAdmin;
use gpu_broker_tests::{Broker, BrokerOpts};
use serde_json::Value;
use support::{FakeApi, Kubelet, Plugin, DRIVER};

const MIB: u64 = 1 << 20;
const NS: &str = "team-a";

struct Node {
    broker: Broker,
    admin: BrokerAdmin,
    api: FakeApi,
    plugin: Plugin,
    _dir: tempfile::TempDir,
}

/// A 1 GiB broker whose tenant `team-a` may hold 512 MiB, a fake API server, the plugin.
async fn node() -> Result<Node> {
    let broker = Broker::start_with(BrokerOpts::default())?;
    broker
        .admin()
        .await?
        .set_quota(NS, QuotaSpec::new(512 * MIB))
        .await?;
    let admin = BrokerAdmin::connect(&broker.socket.display().to_string(), &broker.admin_token)?;
    let api = FakeApi::start().await?;
    let dir = tempfile::tempdir()?;
    let plugin = Plugin::start(
        dir.path(),
        &broker.socket,
        &broker.state_dir.join("admin.token"),
        &api.url,
    )?;
    Ok(Node {
        broker,
        admin,
        api,
        plugin,
        _dir: dir,
    })
}

impl Node {
    async fn reserved(&self) -> Result<u64> {
        let t = self.broker.admin().await?.get_quota(NS).await?;
        Ok(t.usage.process_reserved_bytes)
    }

    async fn claims(&self) -> Result<Vec<String>> {
        Ok(self
            .admin
            .list_claims()
            .await?
            .into_iter()
            .map(|c| c.claim)
            .collect())
    }

    async fn tokens(&self) -> Result<Vec<String>> {
        Ok(self
            .broker
            .admin()
            .await?
            .list_tokens(Some(NS))
            .await?
            .into_iter()
            .map(|t| t.name)
            .collect())
    }
}

fn cdi_env(spec: &Value) -> Vec<String> {
    spec["devices"][0]["containerEdits"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_registers_prepares_twice_and_unprepares_a_claim() -> Result<()> {
    let n = node().await?;
    let k = Kubelet::register(&n.plugin).await?;
    assert_eq!(k.info.r#type, "DRAPlugin");
    assert_eq!(k.info.name, DRIVER);
    assert_eq!(
        k.info.supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth"
        ]
    );
    assert!(
        k.info.endpoint.ends_with("plugins/gpu-broker.io/dra.sock"),
        "{}",
        k.info.endpoint
    );

    n.api.add_claim(NS, "c1", "uid-1", "gpu-0", "256Mi");
    let r = k.prepare(&[(NS, "c1", "uid-1")]).await?;
    let one = &r.claims["uid-1"];
    assert_eq!(one.error, "");
    assert_eq!(one.devices.len(), 1);
    let d = &one.devices[0];
    assert_eq!(
        (d.pool_name.as_str(), d.device_name.as_str()),
        ("node-a", "gpu-0")
    );
    assert_eq!(d.request_names, ["gpu"]);
    assert_eq!(
        d.cdi_device_ids,
        ["gpu-broker.io/claim=uid-1"],
        "no GPU CDI id on the host backend"
    );
    assert_eq!(d.share_id.as_deref(), Some("share-uid-1"));
    // The broker holds the claim's memory for the tenant, with a token bound to it.
    assert_eq!(n.reserved().await?, 256 * MIB);
    assert_eq!(n.claims().await?, ["uid-1"]);
    assert_eq!(n.tokens().await?, ["claim/uid-1"]);
    // The CDI spec hands the container the socket directory, the token and the variables.
    let spec: Value = serde_json::from_slice(&std::fs::read(n.plugin.cdi_spec("uid-1"))?)?;
    let env = cdi_env(&spec);
    assert!(
        env.contains(&"GPU_BROKER_TOKEN_FILE=/run/gpu-broker-claim/token".to_string()),
        "{env:?}"
    );
    assert!(env.contains(&"GPU_BROKER_DEVICE=0".to_string()), "{env:?}");
    let mounts = &spec["devices"][0]["containerEdits"]["mounts"];
    assert_eq!(
        mounts[0]["hostPath"],
        n.broker.socket.parent().unwrap().display().to_string()
    );
    assert_eq!(mounts[0]["containerPath"], "/run/gpu-broker");
    // A worker with the claim's token draws its leases from the claim's reservation.
    let token = std::fs::read_to_string(n.plugin.token_file("uid-1"))?;
    let worker = Client::connect(&n.broker.uri(), token).await?;
    let session = worker.session("pod").await?;
    let lease = session.lease(100 * MIB).await?;
    let u = n.broker.admin().await?.get_quota(NS).await?.usage;
    assert_eq!(
        (u.held_bytes, u.process_reserved_bytes),
        (100 * MIB, 156 * MIB),
        "drawn, not charged twice"
    );
    let e = session.lease(200 * MIB).await.unwrap_err();
    assert!(
        format!("{e}").contains("reservation"),
        "beyond the claim: {e}"
    );
    // Nor a process reservation beside the claim's.
    let e = gpu_broker_client::ReservationRequest::new(&session, 30 * MIB)
        .send()
        .await
        .unwrap_err();
    assert!(format!("{e}").contains("cannot reserve a process"), "{e}");
    drop(lease);

    // Prepared again (kubelet restarted): the same answer, nothing reserved twice; v1beta1 too.
    let again = k.prepare(&[(NS, "c1", "uid-1")]).await?;
    assert_eq!(again.claims["uid-1"], *one);
    let beta = k
        .v1beta1
        .clone()
        .node_prepare_resources(
            gpu_broker_dra::pb::dra_v1beta1::NodePrepareResourcesRequest {
                claims: vec![gpu_broker_dra::pb::dra_v1beta1::Claim {
                    namespace: NS.into(),
                    name: "c1".into(),
                    uid: "uid-1".into(),
                }],
            },
        )
        .await?
        .into_inner();
    assert_eq!(
        beta.claims["uid-1"].devices[0].cdi_device_ids,
        ["gpu-broker.io/claim=uid-1"]
    );
    assert_eq!(n.claims().await?, ["uid-1"]);
    assert_eq!(n.tokens().await?, ["claim/uid-1"]);

    // Unprepared: reservation, token (and the sessions opened with it), spec and token file go.
    let r = k.unprepare(&[(NS, "c1", "uid-1")]).await?;
    assert_eq!(r.claims["uid-1"].error, "");
    assert_eq!(n.reserved().await?, 0);
    assert!(n.claims().await?.is_empty());
    assert!(n.tokens().await?.is_empty());
    assert!(!n.plugin.cdi_spec("uid-1").exists());
    assert!(!n.plugin.token_file("uid-1").exists());
    assert!(
        session.lease(MIB).await.is_err(),
        "the claim's sessions ended with its token"
    );
    // An unknown claim (and the same one again) unprepares without error.
    let r = k
        .unprepare(&[(NS, "gone", "uid-unknown"), (NS, "c1", "uid-1")])
        .await?;
    assert_eq!(r.claims["uid-unknown"].error, "");
    assert_eq!(r.claims["uid-1"].error, "");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_over_the_tenants_quota_is_an_error_on_the_claim() -> Result<()> {
    let n = node().await?;
    let k = Kubelet::register(&n.plugin).await?;
    n.api.add_claim(NS, "big", "uid-big", "gpu-0", "600Mi");
    n.api.add_claim(NS, "ok", "uid-ok", "gpu-0", "64Mi");
    let r = k
        .prepare(&[
            (NS, "big", "uid-big"),
            (NS, "ok", "uid-ok"),
            (NS, "absent", "uid-x"),
        ])
        .await?;
    let big = &r.claims["uid-big"];
    assert!(big.devices.is_empty());
    assert!(
        big.error.contains("ResourceExhausted") && big.error.contains("team-a"),
        "{}",
        big.error
    );
    assert_eq!(
        r.claims["uid-ok"].error, "",
        "the other claim of the call is prepared"
    );
    assert!(
        r.claims["uid-x"].error.contains("reading ResourceClaim"),
        "{}",
        r.claims["uid-x"].error
    );
    // Nothing of the refused claim is left: no reservation, no token, no spec.
    assert_eq!(n.claims().await?, ["uid-ok"]);
    assert_eq!(n.tokens().await?, ["claim/uid-ok"]);
    assert!(!n.plugin.cdi_spec("uid-big").exists());
    assert_eq!(n.reserved().await?, 64 * MIB);
    // And the plugin still serves.
    assert_eq!(
        k.prepare(&[(NS, "ok", "uid-ok")]).await?.claims["uid-ok"].error,
        ""
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_restarted_in_the_middle_rolls_back_completes_nothing_twice() -> Result<()> {
    let mut n = node().await?;
    let k = Kubelet::register(&n.plugin).await?;
    n.api.add_claim(NS, "done", "uid-done", "gpu-0", "128Mi");
    n.api.add_claim(NS, "mid", "uid-mid", "gpu-0", "64Mi");
    let first = k.prepare(&[(NS, "done", "uid-done")]).await?;
    assert_eq!(first.claims["uid-done"].error, "");
    let reservation = n.admin.list_claims().await?[0].reservation_id.clone();
    // The plugin dies in the middle of preparing "mid": it had recorded PrepareStarted
    // and the broker had reserved the claim, but no spec was written.
    n.plugin.kill();
    let ck_path = n.plugin.checkpoint();
    let mut ck: Value = serde_json::from_slice(&std::fs::read(&ck_path)?)?;
    assert_eq!(ck["claims"]["uid-done"]["state"], "PrepareCompleted");
    ck["claims"]["uid-mid"] =
        serde_json::json!({"state": "PrepareStarted", "namespace": NS, "name": "mid"});
    std::fs::write(&ck_path, serde_json::to_vec(&ck)?)?;
    n.admin
        .reserve_claim(gpu_broker_proto::v1::ReserveClaimRequest {
            claim: "uid-mid".into(),
            tenant: NS.into(),
            bytes: 64 * MIB,
            device: 0,
            label: "half-done".into(),
        })
        .await?;
    assert_eq!(n.reserved().await?, 192 * MIB);
    // Restarted: the half-done claim is rolled back, the completed one kept.
    n.plugin.spawn()?;
    let k = Kubelet::register(&n.plugin).await?;
    assert_eq!(n.claims().await?, ["uid-done"]);
    assert_eq!(n.tokens().await?, ["claim/uid-done"]);
    assert_eq!(n.reserved().await?, 128 * MIB);
    // The kubelet asks again for both: the completed one answers from the checkpoint (the
    // same reservation), the rolled-back one is prepared once.
    let r = k
        .prepare(&[(NS, "done", "uid-done"), (NS, "mid", "uid-mid")])
        .await?;
    assert_eq!(r.claims["uid-done"], first.claims["uid-done"]);
    assert_eq!(r.claims["uid-mid"].error, "");
    let claims = n.admin.list_claims().await?;
    assert_eq!(claims.len(), 2);
    assert!(claims.iter().any(|c| c.reservation_id == reservation));
    assert_eq!(n.reserved().await?, 192 * MIB);
    let mut tokens = n.tokens().await?;
    tokens.sort();
    assert_eq!(tokens, ["claim/uid-done", "claim/uid-mid"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_deleted_from_the_api_server_is_cleaned_up() -> Result<()> {
    let n = node().await?;
    let k = Kubelet::register(&n.plugin).await?;
    n.api.add_claim(NS, "c", "uid-c", "gpu-0", "32Mi");
    assert_eq!(
        k.prepare(&[(NS, "c", "uid-c")]).await?.claims["uid-c"].error,
        ""
    );
    assert_eq!(n.claims().await?, ["uid-c"]);
    // Deleted without an unprepare (the kubelet missed it): the cleaner notices, ends the
    // claim at the broker, then removes its spec (wait for both).
    n.api.remove_claim(NS, "c");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !n.claims().await?.is_empty() || n.plugin.cdi_spec("uid-c").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "never cleaned: {}",
            n.plugin.log_text()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(n.tokens().await?.is_empty());
    assert!(!n.plugin.cdi_spec("uid-c").exists());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slice_publishes_the_brokers_leasable_memory_and_withdraws_a_drained_gpu() -> Result<()>
{
    let n = node().await?;
    let name = "node-a-gpu-broker.io";
    let leasable = n.broker.admin().await?.get_devices().await?[0].leasable_bytes;
    let s = n.api.wait_slice(name, |_| true).await?;
    assert_eq!(s["spec"]["driver"], DRIVER);
    assert_eq!(s["spec"]["nodeName"], "node-a");
    assert_eq!(s["spec"]["pool"]["generation"], 1);
    let devices = s["spec"]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 1);
    let d = &devices[0];
    assert_eq!(d["name"], "gpu-0");
    assert_eq!(d["allowMultipleAllocations"], true);
    assert!(d["attributes"]["uuid"]["string"]
        .as_str()
        .unwrap()
        .starts_with("HOST-"));
    assert_eq!(
        d["attributes"]["brokerVersion"]["version"],
        env!("CARGO_PKG_VERSION")
    );
    let value =
        gpu_broker_dra::quantity::parse_bytes(d["capacity"]["memory"]["value"].as_str().unwrap())?;
    assert_eq!(value, leasable / (2 * MIB) * (2 * MIB));
    assert_eq!(
        d["capacity"]["memory"]["requestPolicy"]["validRange"]["step"],
        "2Mi"
    );
    // Drained: withdrawn from the slice (generation 2); undrained: back (generation 3).
    let admin = n.broker.admin().await?;
    admin.drain(Some(0), None, "maintenance").await?;
    let s = n
        .api
        .wait_slice(name, |s| {
            s["spec"]["devices"]
                .as_array()
                .is_some_and(|d| d.is_empty())
        })
        .await?;
    assert_eq!(s["spec"]["pool"]["generation"], 2);
    admin.undrain(Some(0)).await?;
    let s = n
        .api
        .wait_slice(name, |s| {
            s["spec"]["devices"]
                .as_array()
                .is_some_and(|d| d.len() == 1)
        })
        .await?;
    assert_eq!(s["spec"]["pool"]["generation"], 3);
    // Nothing changed: no more writes.
    let writes = n.api.state.lock().writes.len();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(
        n.api.state.lock().writes.len(),
        writes,
        "unchanged slices are not rewritten"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slice_follows_the_brokers_leasable_memory_when_its_headroom_changes() -> Result<()> {
    let mut n = node().await?;
    let name = "node-a-gpu-broker.io";
    let capacity = |s: &Value| -> Result<u64> {
        let v = s["spec"]["devices"][0]["capacity"]["memory"]["value"]
            .as_str()
            .unwrap_or("0");
        Ok(gpu_broker_dra::quantity::parse_bytes(v)?)
    };
    let s = n.api.wait_slice(name, |_| true).await?;
    assert_eq!(capacity(&s)?, 1024 * MIB);
    // A quarter of the GPU kept free from now on: the scheduler sees 768 MiB.
    n.broker.stop(std::time::Duration::from_secs(10))?;
    n.broker.set_flag("--headroom", "25%");
    n.broker.spawn()?;
    let s = n
        .api
        .wait_slice(name, |s| capacity(s).is_ok_and(|c| c != 1024 * MIB))
        .await?;
    assert_eq!(capacity(&s)?, 768 * MIB);
    assert_eq!(s["spec"]["pool"]["generation"], 2);
    assert_eq!(
        s["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["validRange"]["max"],
        "768Mi"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slice_print_prints_the_slice_it_would_publish() -> Result<()> {
    let n = node().await?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-broker-dra"))
        .args(["slice", "--print", "--node", "node-b", "--broker"])
        .arg(&n.broker.socket)
        .arg("--admin-token-file")
        .arg(n.broker.state_dir.join("admin.token"))
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(v["apiVersion"], "resource.k8s.io/v1");
    assert_eq!(v["kind"], "ResourceSlice");
    assert_eq!(v["metadata"]["name"], "node-b-gpu-broker.io");
    assert_eq!(v["spec"]["devices"][0]["name"], "gpu-0");
    // The printed slice passes Kubernetes' own schema (strict), as do the driver's
    // manifests (deploy/kubernetes/dra, where they exist).
    let dir = tempfile::tempdir()?;
    let printed = dir.path().join("slice.json");
    std::fs::write(&printed, &out.stdout)?;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let tool = root.join("target/k8s-venv/bin/kubernetes-validate");
    assert!(
        tool.exists(),
        "{} not found: scripts/test-deps.sh installs it",
        tool.display()
    );
    let mut files = vec![printed];
    if let Ok(dir) = std::fs::read_dir(root.join("deploy/kubernetes/dra")) {
        for e in dir {
            files.push(e?.path());
        }
    }
    let check = std::process::Command::new(&tool)
        .arg("--strict")
        .args(&files)
        .output()?;
    let text = String::from_utf8_lossy(&check.stdout).to_string()
        + &String::from_utf8_lossy(&check.stderr);
    assert!(check.status.success(), "{text}");
    assert!(
        text.lines()
            .any(|l| l.contains("resourceslice/node-b-gpu-broker.io") && l.contains("passed")),
        "the slice was not validated:\n{text}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_survives_a_broker_killed_and_restarted() -> Result<()> {
    let mut n = node().await?;
    let k = Kubelet::register(&n.plugin).await?;
    n.api.add_claim(NS, "c", "uid-r", "gpu-0", "96Mi");
    assert_eq!(
        k.prepare(&[(NS, "c", "uid-r")]).await?.claims["uid-r"].error,
        ""
    );
    let token = std::fs::read_to_string(n.plugin.token_file("uid-r"))?;
    let before = n.admin.list_claims().await?;
    n.broker.kill()?;
    n.broker.spawn()?;
    // At once, before the plugin's next look: the reservation, its id and its token.
    let after = n.admin.list_claims().await?;
    assert_eq!(after.len(), 1, "{after:?}");
    assert_eq!(after[0].claim, "uid-r");
    let key = |c: &gpu_broker_proto::v1::ClaimReservation| {
        (c.reservation_id.clone(), c.bytes, c.token_id.clone())
    };
    assert_eq!(key(&after[0]), key(&before[0]));
    assert_eq!(n.reserved().await?, 96 * MIB);
    let worker = Client::connect(&n.broker.uri(), token.clone()).await?;
    let session = worker.session("pod").await?;
    let lease = session.lease(32 * MIB).await?;
    let u = n.broker.admin().await?.get_quota(NS).await?.usage;
    assert_eq!(
        (u.held_bytes, u.process_reserved_bytes),
        (32 * MIB, 64 * MIB),
        "drawn from the restored reservation"
    );
    drop(lease);
    // The plugin found nothing lost: the same token, nothing reserved again.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(
        std::fs::read_to_string(n.plugin.token_file("uid-r"))?,
        token
    );
    assert_eq!(n.tokens().await?, ["claim/uid-r"]);
    // Released after the restart, the claim's bytes are free, and stay free after another.
    assert!(n.admin.release_claim("uid-r").await?);
    assert_eq!(n.reserved().await?, 0);
    assert_eq!(n.tokens().await?, Vec::<String>::new());
    n.plugin.kill();
    n.broker.kill()?;
    n.broker.spawn()?;
    assert_eq!(n.claims().await?, Vec::<String>::new());
    assert_eq!(n.reserved().await?, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_broker_no_longer_holds_is_reserved_again() -> Result<()> {
    let n = node().await?;
    let k = Kubelet::register(&n.plugin).await?;
    n.api.add_claim(NS, "c", "uid-r", "gpu-0", "96Mi");
    assert_eq!(
        k.prepare(&[(NS, "c", "uid-r")]).await?.claims["uid-r"].error,
        ""
    );
    let old_token = std::fs::read_to_string(n.plugin.token_file("uid-r"))?;
    // Gone at the broker behind the plugin's back (its state lost, an operator's release).
    assert!(n.admin.release_claim("uid-r").await?);
    // The plugin notices and reserves the claim again, with a new token in the same file
    // (written after the reserve: wait for both).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while n.claims().await.unwrap_or_default() != ["uid-r"]
        || !matches!(std::fs::read_to_string(n.plugin.token_file("uid-r")), Ok(t) if t != old_token)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "never reserved again: {}",
            n.plugin.log_text()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(n.reserved().await?, 96 * MIB);
    assert_eq!(n.tokens().await?, ["claim/uid-r"], "the old token revoked");
    let token = std::fs::read_to_string(n.plugin.token_file("uid-r"))?;
    assert_ne!(token, old_token);
    let worker = Client::connect(&n.broker.uri(), token).await?;
    let session = worker.session("pod").await?;
    let _lease = session.lease(32 * MIB).await?;
    let u = n.broker.admin().await?.get_quota(NS).await?.usage;
    assert_eq!(
        (u.held_bytes, u.process_reserved_bytes),
        (32 * MIB, 64 * MIB)
    );
    if let Ok(old) = Client::connect(&n.broker.uri(), old_token).await {
        assert!(old.session("x").await.is_err(), "the old token is refused");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_prepares_of_one_claim_reserve_it_once() -> Result<()> {
    let n = node().await?;
    let k = Kubelet::register(&n.plugin).await?;
    n.api.add_claim(NS, "c", "uid-c", "gpu-0", "64Mi");
    let calls = (0..4).map(|_| k.prepare(&[(NS, "c", "uid-c")]));
    let answers = futures::future::try_join_all(calls).await?;
    for a in &answers {
        assert_eq!(a.claims["uid-c"], answers[0].claims["uid-c"]);
        assert_eq!(a.claims["uid-c"].error, "");
    }
    assert_eq!(n.claims().await?, ["uid-c"]);
    assert_eq!(n.tokens().await?, ["claim/uid-c"]);
    assert_eq!(n.reserved().await?, 64 * MIB);
    Ok(())
}

/// The next message of a health stream whose device `gpu-0` is `want`: (health, message).
async fn health_of_gpu0<S>(stream: &mut S, want: i32) -> Result<(i32, String, i64)>
where
    S: futures::Stream<
            Item = Result<gpu_broker_dra::pb::health_v1::NodeWatchResourcesResponse, tonic::Status>,
        > + Unpin,
{
    use futures::StreamExt;
    let deadline = std::time::Duration::from_secs(20);
    tokio::time::timeout(deadline, async {
        loop {
            let Some(m) = stream.next().await else {
                anyhow::bail!("the health stream ended");
            };
            let m = m?;
            anyhow::ensure!(m.devices.len() == 1, "one device: {m:?}");
            let d = &m.devices[0];
            let id = d.device.clone().unwrap_or_default();
            anyhow::ensure!(
                (id.pool_name.as_str(), id.device_name.as_str()) == ("node-a", "gpu-0"),
                "{id:?}"
            );
            if d.health == want {
                return Ok((d.health, d.message.clone(), d.health_check_timeout_seconds));
            }
        }
    })
    .await
    .map_err(|_| anyhow::anyhow!("gpu-0 never became {want}"))?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_watches_a_drained_or_unhealthy_gpu_turn_unhealthy_and_back() -> Result<()> {
    use gpu_broker_dra::pb::health_v1::{HealthStatus, NodeWatchResourcesRequest};
    use gpu_broker_dra::pb::health_v1alpha1 as alpha;
    let n = node().await?;
    let k = Kubelet::register(&n.plugin).await?;
    let mut v1 = k
        .health
        .clone()
        .node_watch_resources(NodeWatchResourcesRequest {})
        .await?
        .into_inner();
    let (_, message, timeout) = health_of_gpu0(&mut v1, HealthStatus::Healthy as i32).await?;
    assert_eq!(message, "");
    assert!(timeout >= 30, "{timeout}");
    // Drained by an operator: unhealthy with the drain's reason, and healthy when undrained.
    let admin = n.broker.admin().await?;
    admin.drain(Some(0), None, "maintenance").await?;
    let (_, message, _) = health_of_gpu0(&mut v1, HealthStatus::Unhealthy as i32).await?;
    assert_eq!(message, "draining: maintenance");
    admin.undrain(Some(0)).await?;
    health_of_gpu0(&mut v1, HealthStatus::Healthy as i32).await?;
    // Marked unhealthy: the kubelet's v1alpha1 stream (kubelets before 1.37) says so too.
    let mut old = k
        .health_v1alpha1
        .clone()
        .node_watch_resources(alpha::NodeWatchResourcesRequest {})
        .await?
        .into_inner();
    admin.set_device_health(0, false, "Xid 79").await?;
    let (_, message, _) = health_of_gpu0(&mut v1, HealthStatus::Unhealthy as i32).await?;
    assert_eq!(message, "unhealthy: Xid 79");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        use futures::StreamExt;
        let m = old.next().await.expect("the v1alpha1 stream ended")?;
        if m.devices[0].health == alpha::HealthStatus::Unhealthy as i32 {
            assert_eq!(m.devices[0].message, "unhealthy: Xid 79");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "v1alpha1 never unhealthy"
        );
    }
    // The broker gone: its devices' health is unknown, not healthy.
    let mut n = n;
    n.broker.kill()?;
    let (_, message, _) = health_of_gpu0(&mut v1, HealthStatus::Unknown as i32).await?;
    assert!(
        message.starts_with("the broker does not answer"),
        "{message}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_stopped_ends_the_health_streams_and_exits() -> Result<()> {
    use futures::StreamExt;
    use gpu_broker_dra::pb::health_v1::{HealthStatus, NodeWatchResourcesRequest};
    let mut n = node().await?;
    let k = Kubelet::register(&n.plugin).await?;
    let mut stream = k
        .health
        .clone()
        .node_watch_resources(NodeWatchResourcesRequest {})
        .await?
        .into_inner();
    health_of_gpu0(&mut stream, HealthStatus::Healthy as i32).await?;
    // The kubelet keeps its stream open; SIGTERM still stops the plugin at once.
    let took = n.plugin.terminate(std::time::Duration::from_secs(10));
    assert!(
        took.is_some_and(|t| t < std::time::Duration::from_secs(5)),
        "took {took:?}: {}",
        n.plugin.log_text()
    );
    let end = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        while let Some(Ok(_)) = stream.next().await {}
    })
    .await;
    assert!(end.is_ok(), "the stream never ended");
    Ok(())
}
