#!/usr/bin/env bash
# The README's test command: every test of the project (Rust and Python), on a fresh
# machine that has only the Rust toolchain and Python 3. What the tests need beyond that is
# installed from the package registries by scripts/test-deps.sh (idempotent). .ci/run runs
# the same three steps, spelled out: keep both in step.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/test-deps.sh
# Rust: unit tests, end-to-end tests against the real binaries, fault tests. GPU tests
# print "skipped: ..." without a GPU (scripts/gpu-check.sh runs them on one).
cargo test --workspace
# Python: the gpubroker package, built and tested with pytest against real brokers.
scripts/test-python.sh
