"""Refusals as a plain grpc-core client sees them (grpcio, with stubs generated from
proto/gpubroker/v1 at test time, not the gpubroker package): every service the broker
serves answers a refused call with its real gRPC code and, where docs/protocol.md lists
one, its `google.rpc.ErrorInfo` reason; never `UNKNOWN: Stream removed`, which is what a
grpc-core client makes of a refusal sent as headers followed by an empty DATA frame."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import grpc
import grpc_tools
import pytest
from google.rpc import error_details_pb2  # comes with grpcio-status
from grpc_status import rpc_status
from grpc_tools import protoc

from conftest import ROOT

PROTO_DIR = ROOT / "proto"
# The stubs' Python package: not `gpubroker`, the name of the package under test, whose
# module would shadow the generated `gpubroker.v1`.
STUBS = "gpb_grpc_stubs"
NO_LEASE = "00000000-0000-4000-8000-000000000000"


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    """The generated modules: `pb.admin`, `pb.admin_grpc`, `pb.broker`, `pb.broker_grpc`."""
    out = tmp_path_factory.mktemp("stubs")
    src = out / "src" / STUBS / "v1"
    src.mkdir(parents=True)
    for proto in sorted((PROTO_DIR / "gpubroker" / "v1").glob("*.proto")):
        text = proto.read_text()
        text = text.replace('import "gpubroker/v1/', f'import "{STUBS}/v1/')
        (src / proto.name).write_text(text)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{out / 'src'}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        *[str(p) for p in sorted(src.glob("*.proto"))],
    ]
    assert protoc.main(args) == 0, "grpc_tools.protoc failed"
    for d in (out / STUBS, out / STUBS / "v1"):
        (d / "__init__.py").touch()
    sys.path.insert(0, str(out))
    try:

        class Stubs:
            admin = importlib.import_module(f"{STUBS}.v1.admin_pb2")
            admin_grpc = importlib.import_module(f"{STUBS}.v1.admin_pb2_grpc")
            broker = importlib.import_module(f"{STUBS}.v1.broker_pb2")
            broker_grpc = importlib.import_module(f"{STUBS}.v1.broker_pb2_grpc")
            common = importlib.import_module(f"{STUBS}.v1.common_pb2")

        yield Stubs
    finally:
        sys.path.remove(str(out))


def channel_to(address: str):
    """A channel to the broker's Unix socket `address` (unix:///path), with the authority
    `localhost` (README): grpc-core sends the socket's path, which the broker's HTTP/2
    stack (h2) refuses as malformed (RST_STREAM) before any service sees the call."""
    return grpc.insecure_channel(address, options=[("grpc.default_authority", "localhost")])


def bearer(token: str):
    return (("authorization", f"Bearer {token}"),)


def refused(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, timeout=10, **kwargs)
    return caught.value


def reason_of(err: grpc.RpcError):
    """The ErrorInfo reason in the status details (None: no details or no ErrorInfo)."""
    status = rpc_status.from_call(err)
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            assert info.domain == "gpu-broker"
            return info.reason
    return None


def assert_refused(err: grpc.RpcError, code: grpc.StatusCode, reason=None):
    assert err.code() == code, f"{err.code()}: {err.details()}"
    assert "Stream removed" not in (err.details() or "")
    assert reason_of(err) == reason, err.details()


def health_check(channel, service: str):
    """grpc.health.v1.Health/Check, its request encoded by hand (field 1: the service)."""
    name = service.encode()
    request = b"\x0a" + bytes([len(name)]) + name
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    return check(request, timeout=10)


def check_admin(pb, channel, admin_token: str, tenant_token: str):
    admin = pb.admin_grpc.AdminStub(channel)
    md = bearer(admin_token)
    err = refused(admin.GetQuota, pb.admin.GetQuotaRequest(tenant="nobody"), metadata=md)
    assert_refused(err, grpc.StatusCode.NOT_FOUND, "TENANT_NOT_FOUND")
    err = refused(admin.RevokeLease, pb.admin.RevokeLeaseRequest(lease_id=NO_LEASE), metadata=md)
    assert_refused(err, grpc.StatusCode.NOT_FOUND, "LEASE_NOT_FOUND")
    err = refused(
        admin.SetDeviceHealth,
        pb.admin.SetDeviceHealthRequest(device=99, healthy=False, reason="test"),
        metadata=md,
    )
    assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_DEVICE")
    # A malformed value: the code alone.
    err = refused(
        admin.ListAllLeases, pb.admin.ListAllLeasesRequest(page_token="x"), metadata=md
    )
    assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT)
    err = refused(admin.GetInfo, pb.common.GetInfoRequest())
    assert_refused(err, grpc.StatusCode.UNAUTHENTICATED, "TOKEN_MISSING")
    err = refused(admin.GetInfo, pb.common.GetInfoRequest(), metadata=bearer("gpb_wrong"))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    assert reason_of(err) in ("TOKEN_UNKNOWN", "TOKEN_MALFORMED")
    err = refused(admin.GetInfo, pb.common.GetInfoRequest(), metadata=bearer(tenant_token))
    assert_refused(err, grpc.StatusCode.PERMISSION_DENIED, "SCOPE_DENIED")
    # And the connection still answers.
    assert admin.GetInfo(pb.common.GetInfoRequest(), metadata=md, timeout=10) is not None


def check_health(channel):
    with pytest.raises(grpc.RpcError) as caught:
        health_check(channel, "no.such.Service")
    assert_refused(caught.value, grpc.StatusCode.NOT_FOUND)
    assert health_check(channel, "") == b"\x08\x01"  # SERVING


def test_refusals_of_every_service_reach_grpcio_with_their_code_and_reason(pb, broker):
    token = broker.tenant("t", "64MiB")
    with channel_to(broker.address) as channel:
        check_admin(pb, channel, broker.admin_token, token)
        check_health(channel)

        b = pb.broker_grpc.BrokerStub(channel)
        md = bearer(token)
        # The listings, served on the operators' runtime like Admin.
        err = refused(b.ListLeases, pb.broker.ListLeasesRequest(page_token="x"), metadata=md)
        assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT)
        err = refused(
            b.ListSharedLeases, pb.broker.ListSharedLeasesRequest(page_token="x"), metadata=md
        )
        assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT)
        err = refused(b.ListLeases, pb.broker.ListLeasesRequest(), metadata=bearer(broker.admin_token))
        assert_refused(err, grpc.StatusCode.PERMISSION_DENIED, "SCOPE_DENIED")
        err = refused(b.ListLeases, pb.broker.ListLeasesRequest())
        assert_refused(err, grpc.StatusCode.UNAUTHENTICATED, "TOKEN_MISSING")
        assert b.ListLeases(pb.broker.ListLeasesRequest(), metadata=md, timeout=10).leases == []

        # Admission's calls: an acquire over the tenant's quota.
        events = b.OpenSession(pb.broker.OpenSessionRequest(name="refusals"), metadata=md)
        try:
            session = next(events).opened.session_id
            assert session
            err = refused(
                b.AcquireLease,
                pb.broker.AcquireLeaseRequest(
                    session_id=session,
                    bytes=128 << 20,
                    accept_handles=[pb.common.HANDLE_KIND_FD],
                ),
                metadata=md,
            )
            assert_refused(err, grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED")
            err = refused(
                b.ReleaseLease, pb.broker.ReleaseLeaseRequest(lease_id=NO_LEASE), metadata=md
            )
            assert_refused(err, grpc.StatusCode.NOT_FOUND, "LEASE_NOT_FOUND")
        finally:
            events.cancel()

        # A resume naming a let-go lease id that is not one: the code, on the stream.
        resume = b.OpenSession(
            pb.broker.OpenSessionRequest(
                name="resume",
                resume_session_id=NO_LEASE,
                resume_secret="x",
                let_go_lease_ids=["not-a-lease"],
            ),
            metadata=md,
            timeout=10,
        )
        with pytest.raises(grpc.RpcError) as caught:
            next(resume)
        assert_refused(caught.value, grpc.StatusCode.INVALID_ARGUMENT)


def test_refusals_on_the_operators_socket_reach_grpcio_with_their_code_and_reason(
    pb, make_broker, tmp_path
):
    ops = tmp_path / "ops.sock"
    b = make_broker("--host-capacity", "256MiB", "--admin-listen", str(ops))
    token = b.tenant("t", "64MiB")
    with channel_to(f"unix://{ops}") as channel:
        check_admin(pb, channel, b.admin_token, token)
        check_health(channel)


def test_reflection_v1alpha_lists_the_services_and_refuses_an_unknown_symbol(broker):
    """grpcio-reflection speaks v1alpha (as older grpcurl does)."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with channel_to(broker.address) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        for want in (
            "gpubroker.v1.Broker",
            "gpubroker.v1.Admin",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ):
            assert want in services, services
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.such.Symbol")
        with pytest.raises(grpc.RpcError) as caught:
            for _ in stub.ServerReflectionInfo(iter([ask]), timeout=10):
                pass
        assert_refused(caught.value, grpc.StatusCode.NOT_FOUND)
