#!/usr/bin/env bash
# Installs gpu-broker on this node: the binaries (cargo install), the gpu-broker group
# (owner of the socket: add worker users to it), the config (kept if present) and the
# systemd unit (which creates /run/gpu-broker and /var/lib/gpu-broker itself).
#
#   sudo scripts/install.sh [--prefix /usr/local] [--dry-run]
#
# --dry-run prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=/usr/local
dry=false
# run CMD...: runs it (prints it with --dry-run); into FILE CMD...: runs it into FILE.
run() { if $dry; then echo "+ $*"; else "$@"; fi; }
into() { local f=$1; shift; if $dry; then echo "+ $* > $f"; else "$@" >"$f"; fi; }
while (($#)); do
    case "$1" in
        --prefix) prefix="$2"; shift 2 ;;
        --dry-run) dry=true; shift ;;
        *) echo "usage: $0 [--prefix DIR] [--dry-run]" >&2; exit 2 ;;
    esac
done
run cargo install --locked --path broker --root "$prefix"
run cargo install --locked --path client/ctl --root "$prefix"
getent group gpu-broker >/dev/null 2>&1 || run groupadd --system gpu-broker
run install -d -m 0755 /etc/gpu-broker
if [[ ! -e /etc/gpu-broker/config.toml ]]; then
    run install -m 0644 deploy/config.toml /etc/gpu-broker/config.toml
fi
run install -m 0644 deploy/gpu-broker.service /etc/systemd/system/gpu-broker.service
# Managed MPS's daemon in its own unit (enable it with mps-external-daemon: docs/mps.md).
run install -m 0644 deploy/gpu-broker-mps.service /etc/systemd/system/gpu-broker-mps.service
if [[ "$prefix" != /usr/local ]]; then
    run sed -i "s|/usr/local/bin/gpu-broker|$prefix/bin/gpu-broker|" /etc/systemd/system/gpu-broker.service
fi
# Shell completions of gpu-brokerctl (bash and zsh), from the installed binary.
ctl="$prefix/bin/gpu-brokerctl"
run install -d -m 0755 /usr/share/bash-completion/completions /usr/share/zsh/vendor-completions
into /usr/share/bash-completion/completions/gpu-brokerctl "$ctl" completions bash
into /usr/share/zsh/vendor-completions/_gpu-brokerctl "$ctl" completions zsh
run systemctl daemon-reload
echo "installed. Start it:  systemctl enable --now gpu-broker"
echo "then: add worker users to the gpu-broker group (usermod -aG gpu-broker USER),"
echo "and as root: gpu-brokerctl status   (admin token: /var/lib/gpu-broker/admin.token)"
