#!/usr/bin/env bash
# The GPU machine's check of shared read-only leases on CUDA memory.
#
#   scripts/gpu-shared-check.sh build   # here (Rust): release binaries into .gpu/shared
#                                       # (and the wheel, unused here; carry the folder)
#   scripts/gpu-shared-check.sh run     # on the GPU machine (no Rust)
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
OUT=${GPU_SHARED_OUT:-.gpu/shared}
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh

build() {
    gpu_build "$OUT" scripts/gpu-common.sh scripts/gpu-shared-check.sh
}

run() {
    local t0=$SECONDS
    local dir; dir=$(mktemp -d)
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    gpu_start "$OUT" "$dir" --headroom 100GiB
    local t tok_pub tok_reader tok_outsider
    for t in pub reader outsider; do "${CTL[@]}" quota set "$t" --limit 4GiB >/dev/null; done
    tok_pub=$("${CTL[@]}" tokens issue pub 2>/dev/null)
    tok_reader=$("${CTL[@]}" tokens issue reader 2>/dev/null)
    tok_outsider=$("${CTL[@]}" tokens issue outsider 2>/dev/null)
    "${CTL[@]}" devices

    echo "=== shared CUDA lease: publish, import by another tenant's worker, outsider, lifetime ==="
    "$OUT/gpu-worker" --broker "$GPU_BROKER_ADDR" --token "$tok_pub" shared-check \
        --bytes $((256 << 20)) --publisher pub --reader reader \
        --token-b "$tok_reader" --token-c "$tok_outsider" || echo "STEP FAILED: shared-check"

    "${CTL[@]}" shared
    "${CTL[@]}" leaks
    "${CTL[@]}" devices
    gpu_stop "$dir"
    echo "=== done in $((SECONDS - t0)) s ==="
}

case ${1:-} in
    build) build ;;
    run) run ;;
    *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
