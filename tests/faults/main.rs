//! Fault and load tests: the real `gpu-broker` binary (host backend) under SIGKILLed
//! workers and brokers, corrupt state, malformed requests, reclaim and revocation,
//! guarantees, liveness and host fallback. Each test starts its own broker and stops by
//! itself within a bounded time; worker processes are `fault-worker` (tests/bin).

mod abuse;
mod capacity;
mod crash_points;
mod durability;
mod fallback;
mod fdstore;
mod guarantees;
mod keeper;
mod kept_mappings;
mod liveness;
mod load;
mod malformed;
mod reclaim;
mod restart;
mod systemd_unit;

pub use gpu_broker_tests::*;

use gpu_broker_client::{AdminClient, ClientError, Code, QuotaSpec, TenantInfo};
use serde_json::Value;
use std::process::Command;
use std::time::{Duration, Instant};

/// The `fault-worker <mode>` command for `broker` and `token`.
pub fn fault_cmd(b: &Broker, token: &str, mode: &str, args: &[&str]) -> Command {
    let mut c = Command::new(bin("fault-worker"));
    c.arg(mode)
        .arg("--uri")
        .arg(b.uri())
        .arg("--token")
        .arg(token)
        .args(args);
    c
}

/// Reads the process's JSON lines until one whose `ev` is `ev` (or panics after
/// `timeout`); returns every event read, that one last.
pub async fn events_until(p: &mut Proc, ev: &str, timeout: Duration) -> Vec<Value> {
    let deadline = Instant::now() + timeout;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = match p.line_starting("", left).await {
            Ok(l) => l,
            Err(e) => panic!("waiting for event {ev:?}: {e:#}"),
        };
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if v["ev"] == "error" {
            panic!("worker failed: {v}\n{}", p.history());
        }
        let done = v["ev"] == ev;
        seen.push(v);
        if done {
            return seen;
        }
    }
}

/// The next event named `ev` (earlier ones are skipped).
pub async fn event(p: &mut Proc, ev: &str, timeout: Duration) -> Value {
    events_until(p, ev, timeout)
        .await
        .pop()
        .expect("events_until returns the event")
}

/// Every JSON event the process prints within `dur`.
pub async fn events_for(p: &mut Proc, dur: Duration) -> Vec<Value> {
    let deadline = Instant::now() + dur;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return seen;
        }
        match p.line_starting("", left).await {
            Ok(line) => {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    seen.push(v);
                }
            }
            Err(_) => return seen,
        }
    }
}

/// A `fault-worker hold` process that holds its leases.
pub struct Holder {
    pub proc: Proc,
    /// Lease ids in the order they were granted.
    pub leases: Vec<String>,
}

/// Starts `fault-worker hold <args>` and waits until it reports `holding`.
pub async fn holder(b: &Broker, token: &str, args: &[&str]) -> Holder {
    let mut proc = Proc::spawn(fault_cmd(b, token, "hold", args)).expect("spawn fault-worker");
    let evs = events_until(&mut proc, "holding", Duration::from_secs(20)).await;
    let leases = evs
        .iter()
        .filter(|v| v["ev"] == "granted")
        .map(|v| v["id"].as_str().expect("lease id").to_string())
        .collect();
    Holder { proc, leases }
}

/// Is process `pid` running (not a zombie)?
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next());
            !matches!(state, Some("Z") | Some("X"))
        }
        Err(_) => false,
    }
}

/// Asserts the broker process still runs and its log shows no panic.
pub fn assert_broker_alive(b: &Broker) {
    let pid = b.pid().expect("broker started");
    assert!(alive(pid), "broker died:\n{}", b.log_text());
    let log = b.log_text();
    assert!(!log.contains("panicked"), "broker panicked:\n{log}");
}

/// One tenant as the admin sees it.
pub async fn tenant(admin: &AdminClient, name: &str) -> TenantInfo {
    admin.get_quota(name).await.expect("get_quota")
}

/// A quota with everything spelled out.
pub fn quota(limit: u64, guaranteed: u64, priority: i32) -> QuotaSpec {
    QuotaSpec {
        limit_bytes: limit,
        guaranteed_bytes: guaranteed,
        priority,
        ..QuotaSpec::default()
    }
}

/// The gRPC code of a client result's error (`None` when it succeeded).
pub fn code_of<T>(r: &Result<T, ClientError>) -> Option<Code> {
    r.as_ref().err().map(|e| e.code())
}

/// Everything the admin API shows is back to zero: every tenant's usage, every device's
/// leased / quarantined bytes and leases, no session, no lease, nothing waiting. Polls up to
/// `timeout`; returns how long it took, or what is still not zero.
pub async fn wait_all_zero(admin: &AdminClient, timeout: Duration) -> Result<Duration, String> {
    let t0 = Instant::now();
    loop {
        let tenants = admin.list_tenants().await.map_err(|e| e.to_string())?;
        let devices = admin.get_devices().await.map_err(|e| e.to_string())?;
        let sessions = admin.list_sessions(None).await.map_err(|e| e.to_string())?;
        let leases = admin
            .list_all_leases(None)
            .await
            .map_err(|e| e.to_string())?;
        let mut bad = Vec::new();
        for t in &tenants {
            let u = &t.usage;
            if u.held_bytes != 0
                || u.lease_count != 0
                || u.quarantined_bytes != 0
                || u.host_held_bytes != 0
                || u.borrowed_bytes != 0
                || u.session_count != 0
                || u.waiting_requests != 0
            {
                bad.push(format!("tenant {}: {u:?}", t.name));
            }
        }
        for d in &devices {
            if d.leased_bytes != 0
                || d.quarantined_bytes != 0
                || d.lease_count != 0
                || d.waiting_requests != 0
            {
                bad.push(format!(
                    "device {}: leased {} quarantined {} leases {} waiting {}",
                    d.index, d.leased_bytes, d.quarantined_bytes, d.lease_count, d.waiting_requests
                ));
            }
        }
        if !sessions.is_empty() {
            bad.push(format!("{} sessions", sessions.len()));
        }
        if !leases.is_empty() {
            bad.push(format!("{} leases", leases.len()));
        }
        if bad.is_empty() {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() > timeout {
            return Err(bad.join("; "));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Raw gRPC with a codec that sends and receives plain bytes: for garbage protobufs.
pub mod raw {
    use gpu_broker_client::proto::v1 as pb;
    use prost::bytes::{Buf, BufMut};
    use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
    use tonic::codegen::http::uri::PathAndQuery;
    use tonic::transport::Channel;
    use tonic::{Request, Status};

    #[derive(Clone, Copy, Default)]
    pub struct BytesCodec;
    pub struct BytesEnc;
    pub struct BytesDec;

    impl Codec for BytesCodec {
        type Encode = Vec<u8>;
        type Decode = Vec<u8>;
        type Encoder = BytesEnc;
        type Decoder = BytesDec;
        fn encoder(&mut self) -> BytesEnc {
            BytesEnc
        }
        fn decoder(&mut self) -> BytesDec {
            BytesDec
        }
    }

    impl Encoder for BytesEnc {
        type Item = Vec<u8>;
        type Error = Status;
        fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
            dst.put_slice(&item);
            Ok(())
        }
    }

    impl Decoder for BytesDec {
        type Item = Vec<u8>;
        type Error = Status;
        fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
            Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
        }
    }

    fn request(token: Option<&str>, body: Vec<u8>) -> Request<Vec<u8>> {
        let mut req = Request::new(body);
        if let Some(t) = token {
            req.metadata_mut().insert(
                "authorization",
                format!("Bearer {t}").parse().expect("ascii token"),
            );
        }
        req
    }

    /// Sends `body` as the request message of unary method `path`; returns the raw reply.
    pub async fn unary(
        channel: &Channel,
        token: Option<&str>,
        path: &'static str,
        body: Vec<u8>,
    ) -> Result<Vec<u8>, Status> {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready()
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        grpc.unary(
            request(token, body),
            PathAndQuery::from_static(path),
            BytesCodec,
        )
        .await
        .map(|r| r.into_inner())
    }

    /// Sends `body` to server-streaming method `path`; returns the first message or the
    /// status (sent at once, or as the stream's first item).
    pub async fn first_of_stream(
        channel: &Channel,
        token: Option<&str>,
        path: &'static str,
        body: Vec<u8>,
    ) -> Result<Option<Vec<u8>>, Status> {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready()
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let mut stream = grpc
            .server_streaming(
                request(token, body),
                PathAndQuery::from_static(path),
                BytesCodec,
            )
            .await?
            .into_inner();
        stream.message().await
    }

    /// A typed Broker client with a token, over its own connection.
    pub async fn broker(
        uri: &str,
        token: &str,
    ) -> pb::broker_client::BrokerClient<gpu_broker_client::connect::AuthChannel> {
        let channel = gpu_broker_client::connect::connect_channel(uri)
            .await
            .expect("connect");
        pb::broker_client::BrokerClient::new(
            gpu_broker_client::connect::authenticated(channel, token).expect("token"),
        )
    }

    /// Opens a session with raw calls; returns its id and the event stream.
    pub async fn open_session(
        client: &mut pb::broker_client::BrokerClient<gpu_broker_client::connect::AuthChannel>,
        name: &str,
    ) -> (String, tonic::Streaming<pb::SessionEvent>) {
        let mut stream = client
            .open_session(pb::OpenSessionRequest {
                name: name.into(),
                ..Default::default()
            })
            .await
            .expect("open session")
            .into_inner();
        match stream.message().await {
            Ok(Some(pb::SessionEvent {
                event: Some(pb::session_event::Event::Opened(o)),
            })) => (o.session_id, stream),
            other => panic!("first event is not `opened`: {other:?}"),
        }
    }
}

/// A broker on a 64 MiB simulated device with `extra` flags.
pub fn broker_64mib(extra: &[&str]) -> Broker {
    Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        extra: extra.iter().map(|s| s.to_string()).collect(),
        ..BrokerOpts::default()
    })
    .expect("start broker")
}

/// A session of the tenant whose token is `token`.
pub async fn session_of(b: &Broker, token: String, name: &str) -> gpu_broker_client::Session {
    let c = gpu_broker_client::Client::connect(&b.uri(), token)
        .await
        .expect("connect");
    c.session(name).await.expect("session")
}

/// Asks for `bytes`, waiting up to `wait`, on a task.
pub fn spawn_lease(
    s: &gpu_broker_client::Session,
    bytes: u64,
    wait: Duration,
) -> tokio::task::JoinHandle<Result<gpu_broker_client::Lease, gpu_broker_client::ClientError>> {
    let s = s.clone();
    tokio::spawn(async move { s.lease_request(bytes).wait(wait).send().await })
}
