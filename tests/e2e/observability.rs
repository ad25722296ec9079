//! What operators and tools see from outside: Prometheus metrics over HTTP and gRPC
//! server reflection (what `grpcurl list` uses).

use gpu_broker_tests::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub(crate) async fn get(addr: &str, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

pub(crate) fn gauge(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        // The name must end where the prefix does: `sessions` is not `sessions_resumed_total`.
        .find(|l| {
            l.strip_prefix(name_and_labels).is_some_and(|rest| {
                name_and_labels.ends_with(['{', ',']) || rest.starts_with([' ', '{'])
            })
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Metric `name` (with its labels) of broker `b`, scraped from its `--metrics-listen`; 0
/// when absent.
pub(crate) async fn metric(b: &Broker, name: &str) -> f64 {
    let addr = b.metrics_addr().await;
    gauge(&get(&addr, "/metrics").await, name).unwrap_or(0.0)
}

#[tokio::test]
async fn prometheus_metrics_follow_the_leases() {
    let b = Broker::start_with(BrokerOpts {
        extra: vec!["--metrics-listen".into(), "127.0.0.1:0".into()],
        ..BrokerOpts::default()
    })
    .unwrap();
    let addr = b.metrics_addr().await;
    let c = b.client("metered", 256 * MIB).await.unwrap();
    let s = c.session("m").await.unwrap();
    let lease = s.lease(6 * MIB).await.unwrap();
    let text = get(&addr, "/metrics").await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(
        gauge(&text, "gpu_broker_device_leased_bytes{gpu=\"0\","),
        Some((6 * MIB) as f64),
        "{text}"
    );
    assert_eq!(
        gauge(&text, "gpu_broker_tenant_held_bytes{tenant=\"metered\"}"),
        Some((6 * MIB) as f64)
    );
    assert_eq!(gauge(&text, "gpu_broker_sessions"), Some(1.0));
    assert!(
        gauge(&text, "gpu_broker_leases_granted_total{tier=\"device\"}").unwrap_or(0.0) >= 1.0,
        "{text}"
    );
    lease.release().await.unwrap();
    let text = get(&addr, "/metrics").await;
    assert_eq!(
        gauge(&text, "gpu_broker_device_leased_bytes{gpu=\"0\","),
        Some(0.0)
    );
    assert_eq!(
        gauge(&text, "gpu_broker_device_cached_bytes{gpu=\"0\","),
        Some((6 * MIB) as f64)
    );
    assert!(get(&addr, "/nope").await.starts_with("HTTP/1.1 404"));
}

/// Asks the reflection service of version `$v` (`v1`, `v1alpha`) on `$channel` for the
/// services it lists and for an unknown symbol: the names, and the unknown symbol's
/// refusal's code.
macro_rules! reflect {
    ($v:ident, $channel:expr) => {{
        use tonic_reflection::pb::$v::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::$v::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::$v::server_reflection_response::MessageResponse;
        use tonic_reflection::pb::$v::ServerReflectionRequest;
        let mut client = ServerReflectionClient::new($channel);
        let ask = |m| ServerReflectionRequest {
            host: String::new(),
            message_request: Some(m),
        };
        let reqs = vec![
            ask(MessageRequest::ListServices(String::new())),
            ask(MessageRequest::FileContainingSymbol(
                "no.such.Symbol".into(),
            )),
        ];
        let mut stream = client
            .server_reflection_info(tokio_stream::iter(reqs))
            .await
            .unwrap()
            .into_inner();
        let resp = stream.message().await.unwrap().expect("a response");
        let names: Vec<String> = match resp.message_response {
            Some(MessageResponse::ListServicesResponse(l)) => {
                l.service.into_iter().map(|s| s.name).collect()
            }
            other => panic!("unexpected {other:?}"),
        };
        // tonic-reflection ends the stream with the status rather than answering with an
        // ErrorResponse: either way, its code.
        let unknown = match stream.message().await {
            Err(status) => status.code() as i32,
            Ok(Some(resp)) => match resp.message_response {
                Some(MessageResponse::ErrorResponse(e)) => e.error_code,
                other => panic!("unexpected {other:?}"),
            },
            Ok(None) => panic!("no answer for the unknown symbol"),
        };
        (names, unknown)
    }};
}

/// Reflection answers in both versions clients speak (v1; v1alpha: older grpcurl,
/// grpcio-reflection), each listing every service.
#[tokio::test]
async fn reflection_lists_the_services() {
    let b = Broker::start().unwrap();
    let channel = tonic::transport::Endpoint::from_shared(b.uri())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let v1 = reflect!(v1, channel.clone());
    let v1alpha = reflect!(v1alpha, channel);
    for (names, unknown) in [v1, v1alpha] {
        for want in [
            "gpubroker.v1.Broker",
            "gpubroker.v1.Admin",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ] {
            assert!(
                names.iter().any(|n| n == want),
                "{want} missing from {names:?}"
            );
        }
        assert_eq!(unknown, tonic::Code::NotFound as i32);
    }
}

/// Operators' calls answer alike on their own runtime (`--admin-threads 1`) and on the main
/// one (`--admin-threads 0`): pages of a listing, a bad page token's status, a quota
/// change and its read, a refused change's status, the metrics
/// listener (which counts the state lock's waits) and the status page.
#[tokio::test]
async fn operator_reads_answer_alike_on_either_runtime() {
    use gpu_broker_client::{Code, QuotaSpec};
    for threads in ["0", "1"] {
        let b = Broker::start_with(BrokerOpts {
            capacity: "64MiB",
            extra: vec![
                "--admin-threads".into(),
                threads.into(),
                "--metrics-listen".into(),
                "127.0.0.1:0".into(),
            ],
            ..BrokerOpts::default()
        })
        .unwrap();
        let admin = b.admin().await.unwrap();
        for i in 0..3 {
            admin
                .set_quota(&format!("t{i}"), QuotaSpec::new(MIB))
                .await
                .unwrap();
        }
        let (first, next) = admin.list_tenants_page(2, "").await.unwrap();
        let (rest, last) = admin
            .list_tenants_page(2, &next.expect("a second page"))
            .await
            .unwrap();
        let names: Vec<String> = first.into_iter().chain(rest).map(|t| t.name).collect();
        assert_eq!(names, ["t0", "t1", "t2"], "--admin-threads {threads}");
        // Admin changes and reads answer alike too (they run there as well).
        admin
            .set_quota("t1", QuotaSpec::new(2 * MIB))
            .await
            .unwrap();
        let t1 = admin.get_quota("t1").await.unwrap();
        assert_eq!(t1.quota.limit_bytes, 2 * MIB, "--admin-threads {threads}");
        let bad = admin
            .set_quota("", QuotaSpec::new(MIB))
            .await
            .expect_err("an empty tenant name is refused");
        assert_eq!(bad.code(), Code::InvalidArgument, "{bad}");
        assert!(last.is_none());
        let bad = admin
            .list_all_leases_page(None, 5, "not-a-token")
            .await
            .expect_err("a bad token is refused");
        assert_eq!(bad.code(), Code::InvalidArgument, "{bad}");
        let addr = b.metrics_addr().await;
        let metrics = get(&addr, "/metrics").await;
        assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
        assert!(
            metrics.contains("gpu_broker_state_lock_waits_total{longer_than=\"1ms\"}"),
            "{metrics}"
        );
        let status = get(&addr, "/status").await;
        assert!(status.starts_with("HTTP/1.1 200") && status.contains("<td>t2</td>"));
    }
}
