#!/usr/bin/env bash
# Whether a broker's history or log level moves its pooled latency and 32-worker
# throughput: gpu-broker-bench against a fresh broker and against the same broker after
# `gpu-worker bench` left cached blocks of another tenant, at the default log level and at
# warn, on one machine in one run (part `probe` of scripts/gpu-all.sh).
#
#   scripts/gpu-throughput-probe.sh run   # on the GPU machine, from the folder that
#                                         # `scripts/gpu-all.sh build` makes (GPU_OUT,
#                                         # default .gpu/all)
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh
OUT=${GPU_OUT:-.gpu/all}

# probe DIR LABEL: pooled 2 MiB latency (current-thread client), then 32-worker
# throughput with the machine's busiest processes read halfway through.
probe() {
    local dir=$1 label=$2 top
    local b=("$OUT/gpu-broker-bench" --broker "$GPU_BROKER_ADDR" --admin-token-file "$dir/state/admin.token")
    echo "---- $label"
    gpu_step "latency ($label)" "${b[@]}" --client-threads 1 latency --sizes 2MiB --repeat 1
    if gpu_dry; then
        gpu_step "throughput ($label)" "${b[@]}" throughput --workers 32 --duration 3s --repeat 1
        return
    fi
    (sleep 2.5; top -b -n 1 -w 200 | sed -n 7,11p) &
    top=$!
    gpu_step "throughput ($label)" "${b[@]}" throughput --workers 32 --duration 3s --repeat 1
    wait "$top" || true
}

run() {
    local t0=$SECONDS lvl dir token
    for lvl in default warn; do
        dir=$(mktemp -d)
        if [[ $lvl == warn ]]; then export GPU_BROKER_LOG=warn; else unset GPU_BROKER_LOG; fi
        gpu_start "$OUT" "$dir"
        probe "$dir" "$lvl log, fresh broker"
        token=$(gpu_tenant bench --limit 100GiB)
        gpu_step "gpu-worker bench ($lvl log)" "$OUT/gpu-worker" --broker "$GPU_BROKER_ADDR" \
            --token "$token" bench --sizes 2MiB,64MiB,1GiB --iters 30
        "${CTL[@]}" devices
        probe "$dir" "$lvl log, after gpu-worker bench"
        gpu_stop "$dir" || GPU_FAILED+=(broker)
        rm -rf "$dir"
    done
    unset GPU_BROKER_LOG
    echo "=== in $((SECONDS - t0)) s ==="
    gpu_result "throughput probe"
}

case ${1:-} in
    run) run ;;
    *) echo "usage: $0 run" >&2; exit 2 ;;
esac
