#!/usr/bin/env bash
# The GPU machine's check of fd leases (CUDA VMM memory handed over as file descriptors).
#
#   scripts/gpu-fd-check.sh run [STEPS]  # on the GPU machine, from the folder that
#                                        # `scripts/gpu-all.sh build` makes (GPU_OUT,
#                                        # default .gpu/all); STEPS default 123456
#
# What runs on the GPU:
#   1. the Device conformance suite on the CUDA backend (VMM memory exported as fds), the
#      cross-process fd check (a child imports CudaDevice's descriptor), driver timings
#   2. the GPU end-to-end tests (tests/gpu), on fd leases: two processes share a lease (the
#      second with a ticket of its own), another tenant reads only zeros from FRESH memory,
#      a block still mapped when its session ends is quarantined until its holder exits,
#      memory whose import a worker kept past its release stays charged to its tenant
#      after the block is freed for another tenant, until the worker exits, a SIGKILLed
#      worker's memory returns, capacity, NVML, host fallback
#   3. a lease carries an fd handle of CUDA VMM memory, never a legacy handle (the broker
#      has none: docs/security.md)
#   4. a VMM lease acquired, imported and mapped by a worker of ANOTHER uid (nobody) in its
#      own PID, IPC and mount namespaces (unshare)
#   5. Python as the other language: grpcio + socket.recv_fds + cuda-python import
#      (scripts/gpu_python_fd_worker.py), a Rust process opening the same lease
#   6. benchmark, one run: lease + map for fresh, pooled and cross-tenant-pooled leases of
#      2 MiB, 64 MiB, 1 GiB on the fd path, against raw in-process cuMemCreate + reserve +
#      map + set access; and pooled with the block retained mapped (Session::retain_mappings:
#      one request on the session's lease line, no ticket, no import, no map): the
#      retained_lease_map_us column and its ratio to raw; then FD_LINE_ROUNDS (default 2)
#      rounds of the same with the lease line and without it (GPU_BROKER_CLIENT_LEASE_LINE=off:
#      the retained lease over gRPC), interleaved
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh
OUT=$GPU_OUT

# A lease's handle is a VMM fd, never a legacy handle, and reads back (selftest's lines).
vmm_selftest() {
    local out=$1
    grep -q "^KIND fd CudaVmm" "$out" || { echo "the lease is not a VMM fd lease"; return 1; }
    grep -q "^MAPPED 0$" "$out" || { echo "the VMM lease did not read back"; return 1; }
}

fd_only() {
    "$dir/gpu-worker" --broker "$GPU_BROKER_ADDR" --token "$tok" selftest --bytes 67108864 \
        | tee "$dir/selftest.out"
    vmm_selftest "$dir/selftest.out" || return 1
    if "${CTL[@]}" --json leases list | grep -q cuda_ipc; then
        echo "a legacy handle was listed"
        return 1
    fi
    echo "lease: fd handle of CUDA VMM memory; no cuda_ipc anywhere"
}

other_uid() {
    unshare --pid --ipc --mount --fork --mount-proc \
        "$dir/gpu-worker" --as-uid 65534 --broker "$GPU_BROKER_ADDR" --token "$ntok" \
        selftest --bytes 67108864 | tee "$dir/ns.out"
    vmm_selftest "$dir/ns.out"
}

run() {
    local t0=$SECONDS steps=${1:-123456}
    gpu_smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    if [[ $steps == *1* ]]; then
        echo "=== 1. conformance (VMM fds, cross-process import, timings) ==="
        gpu_step conformance env GPU_BROKER_CUDA_FD_CHILD="$(realpath "$OUT")/cuda_fd_check" \
            "$OUT/cuda_conformance" --nocapture --test-threads=1
    fi
    if [[ $steps == *2* ]]; then
        echo "=== 2. GPU end-to-end tests (fd leases by default) ==="
        gpu_step gpu-e2e "$OUT/gpu-test" --test-threads=1 --nocapture
    fi
    # A directory every user may traverse (the worker of step 4 runs as nobody).
    dir=$(mktemp -d -t gpu-fd.XXXXXX)
    chmod 0711 "$dir"
    cp "$OUT/gpu-worker" "$dir/gpu-worker"
    chmod 0755 "$dir/gpu-worker"
    gpu_start "$OUT" "$dir"
    tok=$(gpu_tenant a --limit 100GiB)
    if [[ $steps == *3* ]]; then
        echo "=== 3. fd handles only: no legacy handle ==="
        gpu_step fd-only fd_only
    fi
    if [[ $steps == *4* ]]; then
        echo "=== 4. a worker of another uid in its own PID/IPC/mount namespaces ==="
        chmod 0666 "$dir/b.sock"
        ntok=$(gpu_tenant ns --limit 100GiB)
        gpu_step other-uid other_uid
        "${CTL[@]}" sessions list
        grep "ticket refused" "$dir/broker.log" || echo "no ticket refused"
    fi
    if [[ $steps == *5* ]]; then
        echo "=== 5. Python (grpcio + socket.recv_fds + cuda-python) imports a VMM lease ==="
        gpu_step python-fd python3 "$OUT/gpu_python_fd_worker.py" "$dir/b.sock" "$tok" \
            "$OUT/gpubroker_descriptor.bin" "$dir/gpu-worker"
    fi
    if [[ $steps == *6* ]]; then
        echo "=== 6. benchmark: lease + map, fd path vs raw VMM, one run ==="
        local tok2
        tok2=$(gpu_tenant b --limit 100GiB)
        gpu_step bench-map "$dir/gpu-worker" --broker "$GPU_BROKER_ADDR" --token "$tok" bench-map \
            --sizes 2MiB,64MiB,1GiB --iters 20 --token2 "$tok2" --label fd
        # The retained lease on its lease line against the same over gRPC (the client's
        # lines off), interleaved, each run beside its own raw baseline. Read their retained
        # columns: their fresh ones are not fresh (the first run cached those sizes).
        local r
        for r in $(seq "${FD_LINE_ROUNDS:-2}"); do
            gpu_step bench-map-line "$dir/gpu-worker" --broker "$GPU_BROKER_ADDR" --token "$tok" \
                bench-map --sizes 2MiB,64MiB,1GiB --iters 20 --token2 "$tok2" --label "line-$r"
            gpu_step bench-map-grpc env GPU_BROKER_CLIENT_LEASE_LINE=off "$dir/gpu-worker" \
                --broker "$GPU_BROKER_ADDR" --token "$tok" bench-map --sizes 2MiB,64MiB,1GiB \
                --iters 20 --token2 "$tok2" --label "grpc-$r"
        done
    fi
    "${CTL[@]}" devices
    gpu_stop "$dir" || GPU_FAILED+=(broker)
    echo "=== in $((SECONDS - t0)) s ==="
    gpu_result "fd checks"
}

case ${1:-} in
    run) run "${2:-123456}" ;;
    *) echo "usage: $0 run [STEPS]" >&2; exit 2 ;;
esac
