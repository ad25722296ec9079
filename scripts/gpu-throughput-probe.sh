#!/usr/bin/env bash
# Whether a broker's history or log level moves its pooled latency and 32-worker
# throughput: gpu-broker-bench against a fresh broker and against the same broker after
# `gpu-worker bench` left cached blocks of another tenant, at the default log level and at
# warn, on one machine in one run.
#
#   scripts/gpu-throughput-probe.sh   # on the GPU machine, from the folder that
#                                     # `scripts/gpu-all.sh build` makes (GPU_OUT, default .gpu/all)
# GPU_DRY_RUN=1 runs it on the host backend (the gpu-worker step then does nothing).
# It allocates and frees memory only; it never changes the card's settings.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh
OUT=${GPU_OUT:-.gpu/all}
[[ -x $OUT/gpu-broker ]] || tar xzf "$OUT/binaries.tgz" -C "$OUT"

# probe LABEL: pooled 2 MiB latency (current-thread client), then 32-worker throughput
# with the machine's busiest processes read halfway through.
probe() {
    local label=$1 top
    local b=("$OUT/gpu-broker-bench" --broker "$GPU_BROKER_ADDR" --admin-token-file "$dir/state/admin.token")
    echo "---- $label"
    "${b[@]}" --client-threads 1 latency --sizes 2MiB --repeat 1 2>&1 | grep -E '^(size|2.0 MiB)'
    (sleep 2.5; top -b -n 1 -w 200 | sed -n 7,11p) &
    top=$!
    "${b[@]}" throughput --workers 32 --duration 3s --repeat 1 2>&1 | grep -E '^(run|1 )'
    wait "$top"
}

for lvl in default warn; do
    dir=$(mktemp -d)
    if [[ $lvl == warn ]]; then export GPU_BROKER_LOG=warn; else unset GPU_BROKER_LOG; fi
    gpu_start "$OUT" "$dir"
    probe "$lvl log, fresh broker"
    token=$(gpu_tenant bench --limit 100GiB)
    gpu_dry || "$OUT/gpu-worker" --broker "$GPU_BROKER_ADDR" --token "$token" bench \
        --sizes 2MiB,64MiB,1GiB --iters 30 >/dev/null
    "${CTL[@]}" devices
    probe "$lvl log, after gpu-worker bench"
    gpu_stop "$dir" >/dev/null
    rm -rf "$dir"
done
