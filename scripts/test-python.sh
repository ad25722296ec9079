#!/usr/bin/env bash
# The Python tests: builds the `gpubroker` wheel with scripts/build-wheel.sh (release,
# manylinux: what users install), installs it into a virtual environment cached under
# target/ with pytest, numpy and grpcio (with its tools, status and reflection packages, for
# the tests that call the broker as a plain grpc-core client: stubs generated from proto/
# at test time) from PyPI, and runs pytest against real brokers on the host backend. Run by
# scripts/test.sh; rerunning it is quick (the venvs and the Rust builds are reused). Needs
# the Rust toolchain and Python 3 (with its venv module).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${GPUBROKER_VENV:-target/py-venv}

if [[ ! -x $VENV/bin/python ]]; then
    if ! "$PY" -m venv "$VENV" 2>/dev/null; then
        rm -rf "$VENV"
        # Debian/Ubuntu ship the venv module separately.
        if command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
            ver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
            apt-get update -qq && apt-get install -y -qq "python${ver}-venv" >/dev/null
        fi
        "$PY" -m venv "$VENV"
    fi
fi
if ! "$VENV/bin/python" -c 'import pytest, numpy, grpc, grpc_tools, grpc_status, grpc_reflection' 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check 'pytest>=7' numpy \
        'grpcio>=1.60,<2' 'grpcio-tools>=1.60,<2' 'grpcio-status>=1.60,<2' \
        'grpcio-reflection>=1.60,<2'
fi

# The broker and the CLI the tests drive (debug, sharing the workspace's target/), then the
# package itself: the release manylinux wheel scripts/build-wheel.sh builds, the one the
# README tells users to install.
cargo build --quiet -p gpu-broker --bin gpu-broker -p gpu-brokerctl --bin gpu-brokerctl
wheel=$(scripts/build-wheel.sh)
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall \
    --no-deps "$wheel"

# pytest exit codes: 0 passed, 1 tests failed, 2 interrupted, 3 internal error, 4 usage
# error, 5 no tests collected. Only 0 passes; 5 means the tests went missing.
set +e
GPU_BROKER_BIN_DIR="$PWD/target/debug" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    client/python/tests "$@"
rc=$?
set -e
case $rc in
    0) ;;
    1) echo "test-python: Python tests failed" >&2 ;;
    5) echo "test-python: pytest collected no tests (client/python/tests missing?)" >&2 ;;
    *) echo "test-python: pytest stopped with exit code $rc" >&2 ;;
esac
exit "$rc"
