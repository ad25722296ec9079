#!/usr/bin/env bash
# The GPU machine's check of managed MPS and compute turns, and their benchmark.
#
#   scripts/gpu-mps-check.sh run [PARTS] [ARGS]  # on the GPU machine (Python 3 + PyTorch, no
#                                             # Rust, no network), from the folder that
#                                             # `scripts/gpu-all.sh build` makes (GPU_OUT,
#                                             # default .gpu/all); PARTS: check,bench (both),
#                                             # external, handoff, ordinal; ARGS go to gpu_mps_check.py
#                                             # (--ks 4,8 --duration 6 --before DIR --repeat N)
#
# What runs on the GPU (scripts/gpu_mps_check.py does the work):
#   check: the broker with --mps runs its own MPS control daemon in private directories;
#     `gpu-brokerctl status` shows it and its clients; an unmodified PyTorch program held to
#     4 GiB (gpu-brokerctl run --memory 4GiB when it exists, else the same MPS environment
#     set by hand) gets torch.OutOfMemoryError at ~4 GiB while a neighbour held to 8 GiB
#     allocates 7 GiB and keeps its bytes; the control daemon SIGKILLed is restarted;
#     after the broker stops nothing of MPS is left running.
#   external: deploy/gpu-broker-mps.service's setup: `nvidia-cuda-mps-control -f` started
#     apart (its own pipe and log directories), the broker with --mps-external-daemon and a
#     keeper adopts it (same pid); a program reserved with `gpu-brokerctl run --memory 4GiB`
#     holds 3 GiB through a broker SIGKILL + restart (the daemon adopted again, the program
#     and its reservation kept and charged, its bytes intact), then is refused at its
#     pinned limit, and its reservation ends when it exits; a SIGTERM stop of the broker
#     leaves the daemon running; `echo quit | nvidia-cuda-mps-control` stops it and nothing
#     of MPS is left. GPU_MPS_BACKEND=host GPU_MPS_CONTROL=broker/src/mps/fake-control.sh
#     tries it without a GPU (`--bin target/debug --parts external`).
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
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh
OUT=$GPU_OUT

run() {
    gpu_smi --query-gpu=index,name,memory.total,memory.used,compute_mode,driver_version --format=csv || true
    local parts=${1:-check,bench}
    shift || true
    gpu_step "mps $parts" env PYTHONUNBUFFERED=1 python3 "$OUT/gpu_mps_check.py" --bin "$OUT" \
        --parts "$parts" "$@"
    gpu_result "MPS check"
}

case ${1:-} in
    run) shift; run "$@" ;;
    *) echo "usage: $0 run [check,bench]" >&2; exit 2 ;;
esac
