"""Kubernetes ServiceAccount tokens (`--token-review-audience`) as a plain grpc-core client
sees them, against a fake API server answering TokenReview: a pod's token acts as its
namespace's tenant, and a refused one is UNAUTHENTICATED with its `google.rpc.ErrorInfo`
reason (and metadata)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from test_grpc_claims import error_info
from test_grpc_refusals import assert_refused, bearer, channel_to, pb, refused  # noqa: F401

# {"alg":"RS256"} . {"exp":4102444800} (2100), base64url; the signature names the pod.
LIVE = "eyJhbGciOiJSUzI1NiJ9.eyJleHAiOjQxMDI0NDQ4MDB9"
POD = LIVE + ".pod-of-training"
STRANGER = LIVE + ".pod-of-serving"
FORGED = LIVE + ".forged"

ANSWERS = {
    POD: {"authenticated": True, "audiences": ["gpu-broker"],
          "user": {"username": "system:serviceaccount:training:trainer"}},
    STRANGER: {"authenticated": True, "audiences": ["gpu-broker"],
               "user": {"username": "system:serviceaccount:serving:web"}},
}


class TokenReviews(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802 (http.server's name)
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        token = review["spec"]["token"]
        review["status"] = ANSWERS.get(token, {"authenticated": False,
                                               "error": "invalid bearer token"})
        body = json.dumps(review).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), TokenReviews)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_serviceaccount_tokens_reach_grpcio_with_their_tenant_and_reasons(
    pb, make_broker, api, tmp_path
):
    config = tmp_path / "config.toml"
    config.write_text('[tenants.training]\nlimit = "64MiB"\nnamespaces = ["training"]\n')
    broker = make_broker("--config", str(config), "--token-review-audience", "gpu-broker",
                         "--token-review-apiserver", api)
    with channel_to(broker.address) as channel:
        b = pb.broker_grpc.BrokerStub(channel)
        usage = b.GetUsage(pb.broker.GetUsageRequest(), metadata=bearer(POD), timeout=10)
        assert usage.tenant == "training"

        err = refused(b.GetUsage, pb.broker.GetUsageRequest(), metadata=bearer(STRANGER))
        assert_refused(err, grpc.StatusCode.UNAUTHENTICATED, "NAMESPACE_HAS_NO_TENANT")
        assert error_info(err).metadata["namespace"] == "serving"

        err = refused(b.GetUsage, pb.broker.GetUsageRequest(), metadata=bearer(FORGED))
        assert_refused(err, grpc.StatusCode.UNAUTHENTICATED, "SERVICE_ACCOUNT_REFUSED")
        assert "invalid bearer token" in err.details()
