#!/usr/bin/env bash
# Builds the gpubroker wheel (client/python): one file that installs with pip on GPU nodes
# that have no Rust toolchain and no network beyond the wheel itself. Release build, abi3
# (CPython 3.9+), linked by zig against glibc 2.28 (maturin --zig; ziglang from PyPI) and
# tagged manylinux_2_28 after maturin checks that it uses no newer glibc symbol: it installs
# on any x86_64 Linux with glibc >= 2.28, whatever glibc the build machine has. CI builds
# and tests this same wheel (scripts/test-python.sh). Output: target/wheels/gpubroker-*.whl.
# Extra arguments go to `maturin build`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=target/wheel-venv
if ! "$VENV/bin/maturin" --version >/dev/null 2>&1 || ! "$VENV/bin/python" -m ziglang version >/dev/null 2>&1; then
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check 'maturin>=1.9,<2' 'ziglang>=0.13,<0.14'
fi
rm -f target/wheels/gpubroker-*.whl
echo "build-wheel: maturin build --release (a few minutes the first time)" >&2
# maturin finds zig as `python -m ziglang` of the python first on PATH.
PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/maturin" build --release --zig \
    --manifest-path client/python/Cargo.toml --out target/wheels \
    --compatibility manylinux_2_28 "$@" 2>&1 |
    grep -v '^\(📦\|🍹\|🐍\|🔗\|📡\)' >&2 || true
wheel=$(ls target/wheels/gpubroker-*.whl 2>/dev/null | head -n 1)
if [[ -z $wheel ]]; then
    echo "build-wheel: maturin built no wheel" >&2
    exit 1
fi
echo "$wheel"
