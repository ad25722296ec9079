#!/usr/bin/env bash
# Installs what the test suite needs beyond the Rust toolchain and Python 3, from the
# package registries, skipping whatever is already there. Run by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: Prometheus (promtool and a real server for the metrics tests),
# Chromium (headless, for the status page test) and systemd (systemd-analyze). One apt-get run, only when missing.
apt_missing=()
command -v promtool >/dev/null 2>&1 || apt_missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || apt_missing+=(chromium)
# systemd-analyze scores the shipped unit's sandboxing (offline; nothing is started).
command -v systemd-analyze >/dev/null 2>&1 || apt_missing+=(systemd)
if ((${#apt_missing[@]})); then
    sudo=""
    [[ $(id -u) -eq 0 ]] || sudo="sudo"
    echo "test-deps: apt-get install ${apt_missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        "${apt_missing[@]}" >/dev/null
fi

# kubernetes-validate (PyPI, bundled schemas: validates deploy/kubernetes offline), in a
# venv under target/. A venv copied from another checkout (its scripts name the old
# path) does not run: it is made again.
k8s_venv=target/k8s-venv
if ! "$k8s_venv/bin/kubernetes-validate" --help >/dev/null 2>&1; then
    echo "test-deps: pip install kubernetes-validate into $k8s_venv"
    rm -rf "$k8s_venv"
    python3 -m venv "$k8s_venv"
    "$k8s_venv/bin/pip" install -q kubernetes-validate==1.37.0
fi
