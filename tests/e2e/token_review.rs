//! Kubernetes ServiceAccount tokens as workers' credentials (`--token-review-audience`),
//! against a fake API server answering TokenReview as kube-apiserver does: a pod's token
//! acts as its namespace's tenant (the config file's `namespaces`), each answer is trusted
//! for the cache time, and an invalid, expired, foreign-audience or tenantless token is
//! `UNAUTHENTICATED` with its reason. Without the flag nothing is sent to the API server.

use gpu_broker_client::error::Reason;
use gpu_broker_client::{Client, ClientError, Code};
use gpu_broker_tests::*;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;
const AUDIENCE: &str = "gpu-broker";
/// `{"alg":"RS256"}`, `{"exp":4102444800}` (2100) and `{"exp":1000000000}` (2001),
/// base64url: the header and payloads of the tokens below (their signatures the fake's
/// keys).
const HEADER: &str = "eyJhbGciOiJSUzI1NiJ9";
const LIVE: &str = "eyJleHAiOjQxMDI0NDQ4MDB9";
const EXPIRED: &str = "eyJleHAiOjEwMDAwMDAwMDB9";

fn token(payload: &str, signature: &str) -> String {
    format!("{HEADER}.{payload}.{signature}")
}

/// The fake API server's TokenReviews: the status it answers per token (a token it does
/// not know: not authenticated), and the reviews it was sent.
#[derive(Default)]
struct Reviews {
    answers: HashMap<String, Value>,
    asked: Vec<Value>,
}

struct FakeApi {
    url: String,
    reviews: Arc<Mutex<Reviews>>,
}

async fn handle(
    reviews: Arc<Mutex<Reviews>>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let path = req.uri().path().to_string();
    let post = req.method() == hyper::Method::POST;
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let (code, answer) = if post && path == "/apis/authentication.k8s.io/v1/tokenreviews" {
        let review: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let mut r = reviews.lock();
        r.asked.push(review.clone());
        let token = review["spec"]["token"].as_str().unwrap_or_default();
        let status = r.answers.get(token).cloned().unwrap_or_else(
            || json!({"authenticated": false, "error": "[invalid bearer token, square/go-jose: error in cryptographic primitive]"}),
        );
        let mut out = review;
        out["status"] = status;
        (StatusCode::CREATED, out)
    } else {
        let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "NotFound", "code": 404, "message": path});
        (StatusCode::NOT_FOUND, status)
    };
    Ok(Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(answer.to_string())))
        .unwrap())
}

impl FakeApi {
    async fn start() -> FakeApi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let reviews = Arc::new(Mutex::new(Reviews::default()));
        let r = reviews.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let r = r.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| handle(r.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        FakeApi { url, reviews }
    }

    /// The API server accepts `token` as ServiceAccount `account` of `namespace`, for
    /// `audiences`.
    fn accept(&self, token: &str, namespace: &str, account: &str, audiences: &[&str]) {
        self.reviews.lock().answers.insert(
            token.into(),
            json!({"authenticated": true, "audiences": audiences,
                "user": {"username": format!("system:serviceaccount:{namespace}:{account}"),
                    "uid": "u", "groups": ["system:serviceaccounts"]}}),
        );
    }

    fn refuse(&self, token: &str) {
        self.reviews.lock().answers.remove(token);
    }

    /// How many reviews of `token` it was sent.
    fn asked(&self, token: &str) -> usize {
        self.reviews
            .lock()
            .asked
            .iter()
            .filter(|r| r["spec"]["token"] == token)
            .count()
    }
}

fn broker(dir: &std::path::Path, extra: &[&str]) -> Broker {
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        "[tenants.training]\nlimit = \"64MiB\"\nnamespaces = [\"training\"]\n\n[tenants.serving]\nlimit = \"64MiB\"\n",
    )
    .unwrap();
    let mut args = vec!["--config".to_string(), config.display().to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        extra: args,
        ..BrokerOpts::default()
    })
    .unwrap()
}

/// What opening a session with `token` was refused with: code, reason, message.
async fn refused(b: &Broker, token: &str) -> (Code, Option<Reason>, String, ClientError) {
    let e = match Client::connect(&b.uri(), token.to_string()).await {
        Err(e) => e,
        Ok(c) => c.session("w").await.map(|_| ()).unwrap_err(),
    };
    (e.code(), e.reason().cloned(), e.to_string(), e)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_serviceaccount_token_acts_as_its_namespaces_tenant() {
    let api = FakeApi::start().await;
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        dir.path(),
        &[
            "--token-review-audience",
            AUDIENCE,
            "--token-review-apiserver",
            &api.url,
            "--token-review-cache",
            "2s",
        ],
    );
    let pod = token(LIVE, "pod-of-training");
    api.accept(&pod, "training", "trainer", &[AUDIENCE]);
    let c = Client::connect(&b.uri(), pod.clone()).await.unwrap();
    let s = c.session("pod").await.unwrap();
    let lease = s.lease(4 * MIB).await.unwrap();
    let usage = c.usage().await.unwrap();
    assert_eq!(usage.tenant, "training");
    assert_eq!(usage.usage.held_bytes, 4 * MIB);
    // Asked once for all those calls, with the audience.
    assert_eq!(api.asked(&pod), 1);
    let asked = api.reviews.lock().asked[0].clone();
    assert_eq!(asked["spec"]["audiences"], json!([AUDIENCE]));
    assert_eq!(asked["kind"], "TokenReview");
    lease.release().await.unwrap();

    // A namespace no tenant lists.
    let stranger = token(LIVE, "pod-of-serving");
    api.accept(&stranger, "serving", "web", &[AUDIENCE]);
    let (code, reason, message, e) = refused(&b, &stranger).await;
    assert_eq!(
        (code, reason),
        (Code::Unauthenticated, Some(Reason::NamespaceHasNoTenant)),
        "{message}"
    );
    assert_eq!(e.detail("namespace"), Some("serving"));
    assert!(
        message.contains("\"serving\"") && message.contains("namespaces"),
        "{message}"
    );
    // A token the API server refuses: its answer is said, and remembered (asked once).
    let forged = token(LIVE, "forged");
    for _ in 0..3 {
        let (code, reason, message, _) = refused(&b, &forged).await;
        assert_eq!(
            (code, reason),
            (Code::Unauthenticated, Some(Reason::ServiceAccountRefused)),
            "{message}"
        );
        assert!(message.contains("invalid bearer token"), "{message}");
    }
    assert_eq!(api.asked(&forged), 1);
    // Another audience's token.
    let other = token(LIVE, "for-vault");
    api.accept(&other, "training", "trainer", &["vault"]);
    let (code, reason, message, _) = refused(&b, &other).await;
    assert_eq!(
        (code, reason),
        (Code::Unauthenticated, Some(Reason::ServiceAccountRefused)),
        "{message}"
    );
    assert!(message.contains("vault"), "{message}");
    // An expired token: refused without asking.
    let old = token(EXPIRED, "old-pod");
    api.accept(&old, "training", "trainer", &[AUDIENCE]);
    let (code, reason, message, _) = refused(&b, &old).await;
    assert_eq!(
        (code, reason),
        (Code::Unauthenticated, Some(Reason::TokenExpired)),
        "{message}"
    );
    assert_eq!(api.asked(&old), 0);

    // The pod deleted: the API server refuses its token, and the broker does too once
    // the cached answer is older than the cache time.
    api.refuse(&pod);
    assert!(c.usage().await.is_ok(), "trusted within the cache time");
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let e = c.usage().await.unwrap_err();
    assert_eq!(
        (e.code(), e.reason()),
        (Code::Unauthenticated, Some(&Reason::ServiceAccountRefused)),
        "{e}"
    );
    assert_eq!(api.asked(&pod), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serviceaccount_tokens_are_unknown_unless_configured() {
    let api = FakeApi::start().await;
    let dir = tempfile::tempdir().unwrap();
    let b = broker(dir.path(), &[]);
    let pod = token(LIVE, "pod-of-training");
    api.accept(&pod, "training", "trainer", &[AUDIENCE]);
    let (code, reason, message, _) = refused(&b, &pod).await;
    assert_eq!(
        (code, reason),
        (Code::Unauthenticated, Some(Reason::TokenUnknown)),
        "{message}"
    );
    assert_eq!(api.reviews.lock().asked.len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_that_does_not_answer_is_unavailable_for_new_tokens() {
    // Nothing listens there.
    let url = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        dir.path(),
        &[
            "--token-review-audience",
            AUDIENCE,
            "--token-review-apiserver",
            &url,
        ],
    );
    let (code, reason, message, _) = refused(&b, &token(LIVE, "pod")).await;
    assert_eq!(
        (code, reason),
        (Code::Unavailable, Some(Reason::TokenReviewUnavailable)),
        "{message}"
    );
    // The broker's own tokens are not affected.
    let worker = b
        .tenant("t", gpu_broker_client::QuotaSpec::new(8 * MIB))
        .await
        .unwrap();
    let c = Client::connect(&b.uri(), worker).await.unwrap();
    c.session("w").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_that_hangs_holds_a_call_ten_seconds_at_most() {
    // Accepts connections and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        dir.path(),
        &[
            "--token-review-audience",
            AUDIENCE,
            "--token-review-apiserver",
            &url,
        ],
    );
    // One call (a session's opening would try again: UNAVAILABLE is an outage to it).
    let c = Client::connect(&b.uri(), token(LIVE, "pod")).await.unwrap();
    let started = std::time::Instant::now();
    let e = c.usage().await.unwrap_err();
    assert_eq!(
        (e.code(), e.reason()),
        (Code::Unavailable, Some(&Reason::TokenReviewUnavailable)),
        "{e}"
    );
    assert!(e.to_string().contains("no answer within"), "{e}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(9) && waited < Duration::from_secs(15),
        "{waited:?}"
    );
}
