#!/usr/bin/env bash
# The GPU machine's check of the CUDA backend against its workers and its benchmarks.
#
#   scripts/gpu-check.sh run   # on the GPU machine, from the folder that
#                              # `scripts/gpu-all.sh build` makes (GPU_OUT, default .gpu/all)
#
# What runs on the GPU (the conformance suite and the GPU end-to-end tests are part `fd`,
# scripts/gpu-fd-check.sh):
#   1. a Python worker (grpcio + socket.recv_fds + cuda-python) imports a VMM fd lease and
#      a Rust worker sees its bytes (scripts/gpu_python_fd_worker.py)
#   2. the lease benchmark: AcquireLease (fresh, pooled) vs in-process cuMemCreate + map +
#      fd export for 2 MiB, 64 MiB, 1 GiB, in the same run
#   3. gpu-broker-bench latency and throughput against the CUDA broker; the same retaining
#      (each pair the worker's own block again) on lease lines and over gRPC, interleaved;
#      the breakdown of a retained lease on the line and over gRPC beside the health Check
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh
OUT=$GPU_OUT

run() {
    local t0=$SECONDS dir token
    gpu_smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    dir=$(mktemp -d)
    gpu_start "$OUT" "$dir"
    echo "=== 1. Python worker (grpcio + socket.recv_fds + cuda-python) imports an fd lease ==="
    token=$(gpu_tenant py --limit 16GiB)
    gpu_step python-fd python3 "$OUT/gpu_python_fd_worker.py" "$dir/b.sock" "$token" \
        "$OUT/gpubroker_descriptor.bin" "$OUT/gpu-worker"
    echo "=== 2. lease benchmark (same run: raw in-process alloc vs gRPC lease) ==="
    token=$(gpu_tenant bench --limit 100GiB)
    gpu_step lease-bench "$OUT/gpu-worker" --broker "$GPU_BROKER_ADDR" --token "$token" bench \
        --sizes 2MiB,64MiB,1GiB --iters 30
    "${CTL[@]}" devices
    echo "=== 3. gpu-broker-bench against the CUDA broker (pooled latency, 32-worker throughput) ==="
    local bench=("$OUT/gpu-broker-bench" --broker "$GPU_BROKER_ADDR"
        --admin-token-file "$dir/state/admin.token")
    gpu_step bench-latency "${bench[@]}" --client-threads 1 latency --sizes 2MiB,64MiB,1GiB
    gpu_step bench-throughput "${bench[@]}" throughput --workers 32 --duration 5s
    # Retaining workers: each pair its own block again, on its lease line, then over gRPC.
    local r
    for r in 1 2; do
        echo "--- round $r: retained on the lease line, then over gRPC (GPU_BROKER_CLIENT_LEASE_LINE=off)"
        gpu_step bench-retained-line "${bench[@]}" latency --retain --sizes 2MiB,64MiB
        echo "--- over gRPC"
        gpu_step bench-retained-grpc env GPU_BROKER_CLIENT_LEASE_LINE=off "${bench[@]}" \
            latency --retain --sizes 2MiB,64MiB
        echo "--- 32 retaining workers on lease lines, then over gRPC"
        gpu_step bench-throughput-retained-line "${bench[@]}" throughput --retain --repeat 1 \
            --duration 3s
        echo "--- over gRPC"
        gpu_step bench-throughput-retained-grpc env GPU_BROKER_CLIENT_LEASE_LINE=off \
            "${bench[@]}" throughput --retain --repeat 1 --duration 3s
    done
    echo "--- where a lease's time goes: retained over gRPC, on the lease line, with a ticket"
    gpu_step bench-breakdown-line "${bench[@]}" breakdown --workers 1 \
        --tickets retained,line,library --rounds 2 --duration 1s
    gpu_stop "$dir" || GPU_FAILED+=(broker)
    echo "=== in $((SECONDS - t0)) s ==="
    gpu_result "CUDA backend checks"
}

case ${1:-} in
    run) run ;;
    *) echo "usage: $0 run" >&2; exit 2 ;;
esac
