#!/usr/bin/env bash
# The GPU machine's check of shared read-only leases on CUDA memory.
#
#   scripts/gpu-shared-check.sh run     # on the GPU machine, from the folder that
#                                       # `scripts/gpu-all.sh build` makes (GPU_OUT,
#                                       # default .gpu/all)
#
# What runs on the GPU (gpu-worker shared-check does the work, one line per fact):
#   tenant `pub` publishes a written 256 MiB CUDA VMM lease for tenant `reader`; a worker
#   process of `reader` imports it, maps it read-only and reads every byte; tenant
#   `outsider` (not listed) gets NOT_FOUND; only `pub` is charged; after pub's lease ends
#   the reader still reads every byte (the memory counted as pub's quarantined bytes and
#   still in use on the card) until it releases; then nothing is charged and the card's
#   free memory comes back.
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh
OUT=$GPU_OUT

run() {
    local t0=$SECONDS
    local dir
    dir=$(mktemp -d)
    gpu_smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    gpu_start "$OUT" "$dir" --headroom 100GiB
    local tok_pub tok_reader tok_outsider
    tok_pub=$(gpu_tenant pub --limit 4GiB)
    tok_reader=$(gpu_tenant reader --limit 4GiB)
    tok_outsider=$(gpu_tenant outsider --limit 4GiB)
    "${CTL[@]}" devices

    echo "=== shared CUDA lease: publish, import by another tenant's worker, outsider, lifetime ==="
    gpu_step shared-check "$OUT/gpu-worker" --broker "$GPU_BROKER_ADDR" --token "$tok_pub" \
        shared-check --bytes $((256 << 20)) --publisher pub --reader reader \
        --token-b "$tok_reader" --token-c "$tok_outsider"

    "${CTL[@]}" shared
    "${CTL[@]}" leaks
    "${CTL[@]}" devices
    gpu_stop "$dir" || GPU_FAILED+=(broker)
    echo "=== in $((SECONDS - t0)) s ==="
    gpu_result "shared check"
}

case ${1:-} in
    run) run ;;
    *) echo "usage: $0 run" >&2; exit 2 ;;
esac
