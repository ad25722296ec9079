#!/usr/bin/env bash
# GPU check of the CUDA backend and the client's CUDA module (VMM memory as fds).
#
#   scripts/gpu-conformance.sh build   # on a machine with Rust (no GPU needed): builds the
#                                      # release binaries into .gpu/ (git-ignored)
#   scripts/gpu-conformance.sh run     # on the GPU machine (no Rust needed): runs them
#   scripts/gpu-conformance.sh         # both, on a machine with Rust and a GPU
#
# What runs: the device conformance suite against CudaDevice on every GPU, a cross-process
# check (CudaDevice exports a block's descriptor, a child process that inherits it imports
# and maps it with gpu_broker_client::cuda, reads/writes, import cache), timings, and the
# standalone cuda_fd_check example (raw VMM exporter, child). Without a driver/GPU
# everything prints "skipped".
# It only allocates and frees memory; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.gpu

build() {
    mkdir -p "$OUT"
    local test_bin example_bin
    test_bin=$(cargo test --release -p gpu-broker --test cuda_conformance --no-run \
        --message-format=json 2>/dev/null |
        grep '"name":"cuda_conformance"' | grep '"executable":"' |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n1)
    example_bin=$(cargo build --release -p gpu-broker-client --features cuda \
        --example cuda_fd_check --message-format=json 2>/dev/null |
        grep '"name":"cuda_fd_check"' | grep '"executable":"' |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n1)
    if [[ -z "$test_bin" || -z "$example_bin" ]]; then
        echo "build failed (run the cargo commands above by hand to see why)" >&2
        exit 1
    fi
    cp -f "$test_bin" "$OUT/cuda_conformance"
    cp -f "$example_bin" "$OUT/cuda_fd_check"
    if command -v strip >/dev/null; then strip "$OUT/cuda_conformance" "$OUT/cuda_fd_check"; fi
    ls -l "$OUT"
    echo "--- local run (expect 'skipped' without a GPU) ---"
    run
}

run() {
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    fi
    local t0=$SECONDS
    echo "=== cuda_conformance (conformance suite, cross-process fd import, timings) ==="
    GPU_BROKER_CUDA_FD_CHILD="$PWD/$OUT/cuda_fd_check" \
        "$OUT/cuda_conformance" --nocapture --test-threads=1
    echo "=== cuda_fd_check (standalone two-process check) ==="
    "$OUT/cuda_fd_check"
    echo "=== all GPU checks passed in $((SECONDS - t0)) s ==="
}

case "${1:-all}" in
    build) build ;;
    run) run ;;
    all) build ;;
    *) echo "usage: $0 [build|run]" >&2; exit 2 ;;
esac
