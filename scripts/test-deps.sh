#!/usr/bin/env bash
# Installs what the test suite needs beyond the Rust toolchain and Python 3, from the
# package registries, skipping whatever is already there. Run by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
