"""The claim calls of the Admin service (`ReserveClaim`, `ReleaseClaim`, `ListClaims`: the
DRA driver's) as a plain grpc-core client sees them, with stubs generated from
proto/gpubroker/v1 at test time: what a claim gets, every refusal's code and
`google.rpc.ErrorInfo` reason (a claim's token that reaches beyond its claim included), and
a claim that outlives a broker killed with SIGKILL."""

from __future__ import annotations

import signal

import grpc
from google.rpc import error_details_pb2  # comes with grpcio-status
from grpc_status import rpc_status

from test_grpc_refusals import assert_refused, bearer, channel_to, pb, refused  # noqa: F401

MIB = 1 << 20


def reserve(pb, admin, md, claim, tenant="t", size=32 * MIB, device=0):
    return admin.ReserveClaim(
        pb.admin.ReserveClaimRequest(
            claim=claim, tenant=tenant, bytes=size, device=device, label="ns/c"
        ),
        metadata=md,
        timeout=10,
    )


def open_session(pb, channel, token):
    """A session opened with `token` (its events stream, to cancel) and its id."""
    b = pb.broker_grpc.BrokerStub(channel)
    events = b.OpenSession(pb.broker.OpenSessionRequest(name="pod"), metadata=bearer(token))
    return events, next(events).opened.session_id


def reserved_bytes(pb, admin, md, tenant="t"):
    q = admin.GetQuota(pb.admin.GetQuotaRequest(tenant=tenant), metadata=md, timeout=10)
    return q.tenant.usage.process_reserved_bytes


def test_a_claim_is_reserved_listed_and_released_with_its_token(pb, broker):
    worker = broker.tenant("t", "128MiB")
    with channel_to(broker.address) as channel:
        admin = pb.admin_grpc.AdminStub(channel)
        md = bearer(broker.admin_token)
        got = reserve(pb, admin, md, "uid-1")
        assert got.token and got.reservation.claim == "uid-1"
        assert (got.reservation.tenant, got.reservation.bytes) == ("t", 32 * MIB)
        listed = admin.ListClaims(pb.admin.ListClaimsRequest(), metadata=md, timeout=10).claims
        assert [(c.claim, c.reservation_id) for c in listed] == [
            ("uid-1", got.reservation.reservation_id)
        ]
        assert reserved_bytes(pb, admin, md) == 32 * MIB

        # The claim's token is a worker's: the Broker service, not Admin.
        events, session = open_session(pb, channel, got.token)
        events.cancel()
        assert session
        err = refused(admin.ListClaims, pb.admin.ListClaimsRequest(), metadata=bearer(got.token))
        assert_refused(err, grpc.StatusCode.PERMISSION_DENIED, "SCOPE_DENIED")

        admin.ReleaseClaim(pb.admin.ReleaseClaimRequest(claim="uid-1"), metadata=md, timeout=10)
        assert admin.ListClaims(pb.admin.ListClaimsRequest(), metadata=md, timeout=10).claims == []
        assert reserved_bytes(pb, admin, md) == 0
        b = pb.broker_grpc.BrokerStub(channel)
        err = refused(
            lambda *a, **k: next(b.OpenSession(*a, **k)),
            pb.broker.OpenSessionRequest(name="late"),
            metadata=bearer(got.token),
        )
        assert_refused(err, grpc.StatusCode.UNAUTHENTICATED, "TOKEN_UNKNOWN")
        assert worker


def test_claim_refusals_reach_grpcio_with_their_code_and_reason(pb, broker):
    worker = broker.tenant("t", "64MiB")
    with channel_to(broker.address) as channel:
        admin = pb.admin_grpc.AdminStub(channel)
        md = bearer(broker.admin_token)

        def refused_reserve(claim="uid-x", tenant="t", size=32 * MIB, device=0, token=None):
            return refused(
                admin.ReserveClaim,
                pb.admin.ReserveClaimRequest(claim=claim, tenant=tenant, bytes=size, device=device),
                metadata=bearer(token) if token else md,
            )

        # An unknown claim.
        err = refused(admin.ReleaseClaim, pb.admin.ReleaseClaimRequest(claim="nope"), metadata=md)
        assert_refused(err, grpc.StatusCode.NOT_FOUND, "RESERVATION_NOT_FOUND")
        err = refused(admin.ReleaseClaim, pb.admin.ReleaseClaimRequest(claim=""), metadata=md)
        assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT)
        # Bad uids and sizes: the code alone.
        for claim in ["", "has space", "x" * 129]:
            assert_refused(refused_reserve(claim=claim), grpc.StatusCode.INVALID_ARGUMENT)
        assert_refused(refused_reserve(size=0), grpc.StatusCode.INVALID_ARGUMENT)
        assert_refused(refused_reserve(size=1 << 62), grpc.StatusCode.INVALID_ARGUMENT)
        # Past the tenant's quota, past the device, an unknown tenant or device.
        assert_refused(
            refused_reserve(size=65 * MIB), grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED"
        )
        assert_refused(
            refused_reserve(tenant="nobody"), grpc.StatusCode.NOT_FOUND, "TENANT_NOT_FOUND"
        )
        assert_refused(
            refused_reserve(device=99), grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_DEVICE"
        )
        # A claim reserved twice.
        reserve(pb, admin, md, "uid-2", size=16 * MIB)
        assert_refused(refused_reserve(claim="uid-2"), grpc.StatusCode.FAILED_PRECONDITION)
        # The wrong token's scope: a worker's, a read token's; no token.
        assert_refused(refused_reserve(token=worker), grpc.StatusCode.PERMISSION_DENIED, "SCOPE_DENIED")
        read = admin.IssueToken(
            pb.admin.IssueTokenRequest(scope=pb.admin.TOKEN_SCOPE_READ, name="prometheus"),
            metadata=md,
            timeout=10,
        ).token
        assert_refused(refused_reserve(token=read), grpc.StatusCode.PERMISSION_DENIED, "SCOPE_DENIED")
        # ...though it lists them, as it lists leases and sessions.
        listed = admin.ListClaims(pb.admin.ListClaimsRequest(), metadata=bearer(read), timeout=10)
        assert [c.claim for c in listed.claims] == ["uid-2"]
        err = refused(
            admin.ReleaseClaim, pb.admin.ReleaseClaimRequest(claim="uid-2"), metadata=bearer(read)
        )
        assert_refused(err, grpc.StatusCode.PERMISSION_DENIED, "SCOPE_DENIED")
        err = refused(admin.ListClaims, pb.admin.ListClaimsRequest())
        assert_refused(err, grpc.StatusCode.UNAUTHENTICATED, "TOKEN_MISSING")
        # Nothing refused was left behind: one claim, its bytes, its token.
        claims = admin.ListClaims(pb.admin.ListClaimsRequest(), metadata=md, timeout=10).claims
        assert [c.claim for c in claims] == ["uid-2"]
        assert reserved_bytes(pb, admin, md) == 16 * MIB
        tokens = admin.ListTokens(pb.admin.ListTokensRequest(tenant="t"), metadata=md, timeout=10)
        assert sorted(t.name for t in tokens.tokens if t.name.startswith("claim/")) == ["claim/uid-2"]


def test_a_claim_outlives_a_broker_killed_with_sigkill(pb, broker):
    broker.tenant("t", "128MiB")
    with channel_to(broker.address) as channel:
        admin = pb.admin_grpc.AdminStub(channel)
        got = reserve(pb, admin, bearer(broker.admin_token), "uid-k", size=48 * MIB)
    broker.stop(signal.SIGKILL)
    broker.start()
    with channel_to(broker.address) as channel:
        admin = pb.admin_grpc.AdminStub(channel)
        md = bearer(broker.admin_token)
        claims = admin.ListClaims(pb.admin.ListClaimsRequest(), metadata=md, timeout=10).claims
        assert [(c.claim, c.reservation_id, c.bytes) for c in claims] == [
            ("uid-k", got.reservation.reservation_id, 48 * MIB)
        ]
        assert reserved_bytes(pb, admin, md) == 48 * MIB
        events, session = open_session(pb, channel, got.token)
        events.cancel()
        assert session
        admin.ReleaseClaim(pb.admin.ReleaseClaimRequest(claim="uid-k"), metadata=md, timeout=10)
        assert reserved_bytes(pb, admin, md) == 0


def error_info(err: grpc.RpcError):
    """The ErrorInfo of a refusal (reason and metadata)."""
    for detail in rpc_status.from_call(err).details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    raise AssertionError(f"no ErrorInfo: {err.details()}")


def test_a_claims_token_beyond_its_claim_is_refused_with_its_reason(pb, broker):
    broker.tenant("t", "128MiB")
    with channel_to(broker.address) as channel:
        admin = pb.admin_grpc.AdminStub(channel)
        md = bearer(broker.admin_token)
        got = reserve(pb, admin, md, "uid-1", size=64 * MIB)
        # No operator's token may take a claim's name.
        err = refused(
            admin.IssueToken,
            pb.admin.IssueTokenRequest(tenant="t", name="claim/uid-1"),
            metadata=md,
        )
        assert_refused(err, grpc.StatusCode.INVALID_ARGUMENT, "TOKEN_NAME_RESERVED")
        assert error_info(err).metadata["prefix"] == "claim/"
        # The claim's token reserves no process: it leases from its claim.
        events, session = open_session(pb, channel, got.token)
        try:
            b = pb.broker_grpc.BrokerStub(channel)
            err = refused(
                b.ReserveProcessMemory,
                pb.broker.ReserveProcessMemoryRequest(session_id=session, bytes=8 * MIB),
                metadata=bearer(got.token),
            )
            assert_refused(err, grpc.StatusCode.FAILED_PRECONDITION, "CLAIM_TOKEN_CANNOT_RESERVE")
            assert error_info(err).metadata["claim"] == "uid-1"
        finally:
            events.cancel()
        # The quota lowered under the claim, then a restart: the claim is not taken again.
        broker.ctl("quota", "set", "t", "--limit", "32MiB")
    broker.stop(signal.SIGKILL)
    broker.start()
    with channel_to(broker.address) as channel:
        admin = pb.admin_grpc.AdminStub(channel)
        md = bearer(broker.admin_token)
        assert admin.ListClaims(pb.admin.ListClaimsRequest(), metadata=md, timeout=10).claims == []
        # Its token still authenticates; its leases wait for the driver to reserve it again.
        events, session = open_session(pb, channel, got.token)
        try:
            b = pb.broker_grpc.BrokerStub(channel)
            err = refused(
                b.AcquireLease,
                pb.broker.AcquireLeaseRequest(
                    session_id=session, bytes=MIB, accept_handles=[pb.common.HANDLE_KIND_FD]
                ),
                metadata=bearer(got.token),
            )
            assert_refused(err, grpc.StatusCode.FAILED_PRECONDITION, "CLAIM_NOT_RESERVED")
            assert error_info(err).metadata["claim"] == "uid-1"
        finally:
            events.cancel()
