"""The broker version check: the rules on their own, and connect()'s warning against a
real broker on the host backend."""

from __future__ import annotations

import warnings

import pytest

import gpubroker
from gpubroker import compat


def _info(version: str, revision: int) -> dict:
    return {"version": version, "api_revision": revision, "backend": "host",
            "device_count": 1, "features": []}


def test_the_rules():
    req = compat.REQUIRED_API_REVISION
    assert compat.version_problem(_info("0.1.0", req), "0.1.0") is None
    assert compat.version_problem(_info("0.1.7", req + 1), "0.1.0") is None, "newer patch, newer API"
    assert compat.version_problem(_info("1.4.0", req), "1.2.0") is None, "same major"
    rule, msg = compat.version_problem(None, "0.1.0")
    assert rule == "no-getinfo" and "rule: no-getinfo" in msg
    rule, msg = compat.version_problem(_info("0.1.0", req - 1), "0.1.0")
    assert rule == "api-revision" and f"API revision {req - 1}" in msg and "rule: api-revision" in msg
    for broker, ours in [("0.2.0", "0.1.0"), ("0.1.0", "0.2.3"), ("2.0.0", "1.9.0")]:
        rule, msg = compat.version_problem(_info(broker, req), ours)
        assert rule == "release" and broker in msg and ours in msg, (broker, ours, msg)
    # The API revision is checked first; an unparsable release is not judged.
    assert compat.version_problem(_info("0.9.0", req - 1), "0.1.0")[0] == "api-revision"
    assert compat.version_problem(_info("dev", req), "0.1.0") is None


def test_a_matching_broker_gets_no_warning(broker):
    token = broker.tenant("t")
    with warnings.catch_warnings():
        warnings.simplefilter("error", gpubroker.BrokerVersionWarning)
        b = gpubroker.connect(broker.address, token)
    info = b.info()
    assert info["version"] == gpubroker.__version__
    assert info["api_revision"] >= compat.REQUIRED_API_REVISION
    assert info["backend"] == "host" and info["device_count"] >= 1


def test_an_older_or_foreign_broker_is_warned_about_with_the_rule(broker, monkeypatch):
    token = broker.tenant("t")
    monkeypatch.setattr(compat, "REQUIRED_API_REVISION", 1000)
    with pytest.warns(gpubroker.BrokerVersionWarning, match="rule: api-revision") as w:
        b = gpubroker.connect(broker.address, token)
    assert w[0].message.rule == "api-revision"
    assert w[0].filename == __file__, "the warning points at the caller of connect()"
    b.usage()  # still works
    monkeypatch.undo()
    monkeypatch.setattr(gpubroker._native, "__version__", "7.0.0")
    with pytest.warns(gpubroker.BrokerVersionWarning, match="rule: release") as w:
        gpubroker.connect(broker.address, token)
    assert w[0].message.rule == "release"
