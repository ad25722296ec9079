#!/usr/bin/env bash
# The GPU machine's check of managed MPS and compute turns, and their benchmark.
#
#   scripts/gpu-mps-check.sh build            # here (Rust): release binaries into .gpu/mps
#   scripts/gpu-mps-check.sh run [PARTS] [ARGS]  # on the GPU machine (Python 3 + PyTorch, no
#                                             # Rust, no network); PARTS: check,bench (both),
#                                             # handoff; ARGS go to gpu_mps_check.py
#                                             # (--ks 4,8 --duration 6 --before DIR --repeat N)
#
# What runs on the GPU (scripts/gpu_mps_check.py does the work):
#   check: the broker with --mps runs its own MPS control daemon in private directories;
#     `gpu-brokerctl status` shows it and its clients; an unmodified PyTorch program held to
#     4 GiB (gpu-brokerctl run --memory 4GiB when it exists, else the same MPS environment
#     set by hand) gets torch.OutOfMemoryError at ~4 GiB while a neighbour held to 8 GiB
#     allocates 7 GiB and keeps its bytes; the control daemon SIGKILLed is restarted;
#     after the broker stops nothing of MPS is left running.
#   ordinal: `gpu-brokerctl run -- gpu-worker ordinal` maps its lease on the CUDA ordinal
#     whose UUID is the lease's device's (with and without --mps).
#   handoff: (c) alone, this build's turn hand-off beside an earlier gpu-broker's
#     (--before DIR), alternating.
#   bench: K = 2, 4, 8 workers of examples/turn_step_worker.py (ResNet-18 inference,
#     batch 8) (a) alone, one after another, (b) all at once uncoordinated, (c) with broker
#     turns and 1 slot, (d) under managed MPS with K slots; tenants weighted 1:2:4.
# Set GPU_MPS_DEVICES (e.g. 0,1) to give the broker a device list; default: every GPU.
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_MPS_OUT:-.gpu/mps}
TARGET=${CARGO_TARGET_DIR:-target}

build() {
    mkdir -p "$OUT"
    cargo build --release -p gpu-broker --bin gpu-broker -p gpu-brokerctl --bin gpu-brokerctl \
        -p gpu-broker-examples --bin turn-gate -p gpu-broker-tests --bin gpu-worker
    for b in gpu-broker gpu-brokerctl turn-gate gpu-worker; do cp -f "$TARGET/release/$b" "$OUT/$b"; done
    strip "$OUT"/gpu-broker "$OUT"/gpu-brokerctl "$OUT"/turn-gate "$OUT"/gpu-worker 2>/dev/null || true
    cp -f scripts/gpu-mps-check.sh scripts/gpu_mps_check.py examples/turn_step_worker.py "$OUT/"
    du -sh "$OUT"
}

run() {
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,compute_mode,driver_version --format=csv || true
    local parts=${1:-check,bench}
    shift || true
    PYTHONUNBUFFERED=1 python3 "$OUT/gpu_mps_check.py" --bin "$OUT" --parts "$parts" "$@"
}

case "${1:-}" in
build) build ;;
run) shift; run "$@" ;;
*) echo "usage: $0 build|run [check,bench]" >&2; exit 2 ;;
esac
