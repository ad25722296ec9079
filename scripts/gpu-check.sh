#!/usr/bin/env bash
# The GPU machine's check of the CUDA backend, end to end.
#
#   scripts/gpu-check.sh build   # here (Rust, no GPU): release binaries into .gpu/check
#   scripts/gpu-check.sh run [STEPS]  # on the GPU machine (no Rust): runs the steps below
#                                     # (default 1234; 3 and 4 always run together)
#
# What runs on the GPU:
#   1. the Device conformance suite against the CUDA backend (scripts/gpu-conformance.sh)
#   2. the GPU end-to-end tests (tests/gpu), on fd leases: two worker processes exchange
#      data through a lease; a second tenant reads only zeros (fresh memory); a block still
#      mapped when its session ends is quarantined until its holder exits; a SIGKILLed
#      worker's memory comes back; more than the card is RESOURCE_EXHAUSTED with no CUDA OOM
#      and >= 95% of (total - headroom) is leasable; every GPU of the node is used
#   3. a Python worker (grpcio + socket.recv_fds + cuda-python) imports a VMM fd lease and
#      a Rust worker sees its bytes (scripts/gpu_python_fd_worker.py)
#   4. the lease benchmark: AcquireLease (fresh, pooled) vs in-process cuMemCreate + map +
#      fd export for 2 MiB, 64 MiB, 1 GiB, in the same run
#   5. gpu-broker-bench latency and throughput against the CUDA broker
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_BIN:-.gpu/check}
TARGET=${CARGO_TARGET_DIR:-target}

exe_of() { # package, target kind, name -> path of the built test executable
    sed -n "s/.*\"name\":\"$1\".*\"executable\":\"\([^\"]*\)\".*/\1/p" | tail -n1
}

build() {
    mkdir -p "$OUT/deps"
    cargo build --release -p gpu-broker -p gpu-brokerctl -p gpu-broker-tests --bins
    local t
    t=$(cargo test --release -p gpu-broker-tests --test gpu --no-run --message-format=json 2>/dev/null | grep '"executable":"' | exe_of gpu)
    [[ -n "$t" ]] || { echo "cannot find the gpu test executable" >&2; exit 1; }
    cp -f "$t" "$OUT/deps/gpu-test"
    for b in gpu-broker gpu-brokerctl gpu-worker gpu-broker-bench; do cp -f "$TARGET/release/$b" "$OUT/$b"; done
    cp -f "$(ls -t "$TARGET"/release/build/gpu-broker-proto-*/out/gpubroker_descriptor.bin | head -n1)" "$OUT/gpubroker_descriptor.bin"
    strip "$OUT"/gpu-broker "$OUT"/gpu-brokerctl "$OUT"/gpu-worker "$OUT"/deps/gpu-test 2>/dev/null || true
    scripts/gpu-conformance.sh build >/dev/null
    du -sh .gpu
    echo "--- local run of the GPU tests (expect 'skipped' without a GPU) ---"
    "$OUT/deps/gpu-test" --test-threads=1 --nocapture
}

run() {
    local t0=$SECONDS
    local steps=${1:-1234}
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    if [[ $steps == *1* ]]; then
        echo "=== 1. conformance ==="
        scripts/gpu-conformance.sh run
    fi
    if [[ $steps == *2* ]]; then
        echo "=== 2. GPU end-to-end tests ==="
        "$OUT/deps/gpu-test" --test-threads=1 --nocapture
    fi
    echo "=== 3. Python worker (grpcio + socket.recv_fds + cuda-python) imports an fd lease ==="
    local dir; dir=$(mktemp -d)
    "$OUT/gpu-broker" --backend cuda --socket "$dir/b.sock" --state-dir "$dir/state" \
        --shutdown-grace 1s >"$dir/broker.log" 2>&1 &
    local pid=$!
    for _ in $(seq 100); do [[ -S "$dir/b.sock" ]] && break; sleep 0.1; done
    local ctl=("$OUT/gpu-brokerctl" --broker "unix://$dir/b.sock" --token-file "$dir/state/admin.token")
    "${ctl[@]}" quota set py --limit 16GiB >/dev/null
    local token; token=$("${ctl[@]}" tokens issue py 2>/dev/null)
    python3 scripts/gpu_python_fd_worker.py "$dir/b.sock" "$token" "$OUT/gpubroker_descriptor.bin" "$OUT/gpu-worker"
    echo "=== 4. lease benchmark (same run: raw in-process alloc vs gRPC lease) ==="
    "${ctl[@]}" quota set bench --limit 100GiB >/dev/null
    token=$("${ctl[@]}" tokens issue bench 2>/dev/null)
    "$OUT/gpu-worker" --broker "unix://$dir/b.sock" --token "$token" bench --sizes 2MiB,64MiB,1GiB --iters 30
    "${ctl[@]}" devices
    echo "=== 5. gpu-broker-bench against the CUDA broker (pooled latency, 32-worker throughput) ==="
    "$OUT/gpu-broker-bench" --broker "unix://$dir/b.sock" --admin-token-file "$dir/state/admin.token" \
        --client-threads 1 latency --sizes 2MiB,64MiB,1GiB
    "$OUT/gpu-broker-bench" --broker "unix://$dir/b.sock" --admin-token-file "$dir/state/admin.token" \
        throughput --workers 32 --duration 5s
    kill -TERM "$pid"; wait "$pid" || { echo "broker exit status $?"; cat "$dir/broker.log"; exit 1; }
    if grep -q "OUT_OF_MEMORY" "$dir/broker.log"; then echo "CUDA OOM in the broker log"; exit 1; fi
    echo "=== all GPU checks passed in $((SECONDS - t0)) s ==="
}

case "${1:-build}" in
    build) build ;;
    run) run "${2:-1234}" ;;
    *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
