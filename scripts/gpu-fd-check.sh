#!/usr/bin/env bash
# The GPU machine's check of fd leases (CUDA VMM memory handed over as file descriptors).
#
#   scripts/gpu-fd-check.sh build        # here (Rust, no GPU): release binaries into .gpu/fd
#   scripts/gpu-fd-check.sh run [STEPS]  # on the GPU machine (no Rust); default 123456
#
# What runs on the GPU:
#   1. the Device conformance suite on the CUDA backend (VMM memory exported as fds), the
#      cross-process fd check (a child imports CudaDevice's descriptor), driver timings
#   2. the GPU end-to-end tests (tests/gpu), on fd leases: two processes share a lease (the
#      second with a ticket of its own), another tenant reads only zeros from FRESH memory,
#      a block still mapped when its session ends is quarantined until its holder exits, a
#      SIGKILLed worker's memory returns, capacity, NVML, host fallback
#   3. a lease carries an fd handle of CUDA VMM memory, never a legacy handle (the broker
#      has none: docs/security.md)
#   4. a VMM lease acquired, imported and mapped by a worker of ANOTHER uid (nobody) in its
#      own PID, IPC and mount namespaces (unshare)
#   5. Python as the other language: grpcio + socket.recv_fds + cuda-python import
#      (scripts/gpu_python_fd_worker.py), a Rust process opening the same lease
#   6. benchmark, one run: lease + map for fresh, pooled and cross-tenant-pooled leases of
#      2 MiB, 64 MiB, 1 GiB on the fd path, against raw in-process cuMemCreate + reserve +
#      map + set access
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_BIN:-.gpu/fd}
TARGET=${CARGO_TARGET_DIR:-target}

exe_of() { sed -n "s/.*\"name\":\"$1\".*\"executable\":\"\([^\"]*\)\".*/\1/p" | tail -n1; }

build() {
    mkdir -p "$OUT"
    cargo build --release -p gpu-broker -p gpu-brokerctl -p gpu-broker-tests --bins
    local t c e
    t=$(cargo test --release -p gpu-broker-tests --test gpu --no-run --message-format=json 2>/dev/null | grep '"executable":"' | exe_of gpu)
    c=$(cargo test --release -p gpu-broker --test cuda_conformance --no-run --message-format=json 2>/dev/null | grep '"executable":"' | exe_of cuda_conformance)
    e=$(cargo build --release -p gpu-broker-client --features cuda --example cuda_fd_check --message-format=json 2>/dev/null | grep '"executable":"' | exe_of cuda_fd_check)
    [[ -n "$t" && -n "$c" && -n "$e" ]] || { echo "cannot find the test executables" >&2; exit 1; }
    cp -f "$t" "$OUT/gpu-test"
    cp -f "$c" "$OUT/cuda_conformance"
    cp -f "$e" "$OUT/cuda_fd_check"
    for b in gpu-broker gpu-brokerctl gpu-worker; do cp -f "$TARGET/release/$b" "$OUT/$b"; done
    cp -f "$(ls -t "$TARGET"/release/build/gpu-broker-proto-*/out/gpubroker_descriptor.bin | head -n1)" "$OUT/gpubroker_descriptor.bin"
    strip "$OUT"/gpu-broker "$OUT"/gpu-brokerctl "$OUT"/gpu-worker "$OUT"/gpu-test "$OUT"/cuda_conformance "$OUT"/cuda_fd_check 2>/dev/null || true
    du -sh "$OUT"
}

# start_broker DIR [FLAGS...]: a CUDA broker in DIR; sets BROKER_PID, CTL
start_broker() {
    local dir=$1; shift
    "$OUT/gpu-broker" --backend cuda --socket "$dir/b.sock" --state-dir "$dir/state" \
        --shutdown-grace 1s "$@" >"$dir/broker.log" 2>&1 &
    BROKER_PID=$!
    for _ in $(seq 200); do [[ -S "$dir/b.sock" ]] && break; sleep 0.05; done
    CTL=("$OUT/gpu-brokerctl" --broker "unix://$dir/b.sock" --token-file "$dir/state/admin.token")
}

stop_broker() {
    local dir=$1
    kill -TERM "$BROKER_PID"; wait "$BROKER_PID" || { echo "broker exit status $?"; cat "$dir/broker.log"; exit 1; }
    if grep -q "OUT_OF_MEMORY" "$dir/broker.log"; then echo "CUDA OOM in the broker log"; exit 1; fi
}

token_for() { # tenant -> token
    "${CTL[@]}" quota set "$1" --limit 100GiB >/dev/null
    "${CTL[@]}" tokens issue "$1" 2>/dev/null
}

run() {
    local t0=$SECONDS steps=${1:-123456}
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    if [[ $steps == *1* ]]; then
        echo "=== 1. conformance (VMM fds, cross-process import, timings) ==="
        GPU_BROKER_CUDA_FD_CHILD="$PWD/$OUT/cuda_fd_check" "$OUT/cuda_conformance" --nocapture --test-threads=1
    fi
    if [[ $steps == *2* ]]; then
        echo "=== 2. GPU end-to-end tests (fd leases by default) ==="
        "$OUT/gpu-test" --test-threads=1 --nocapture
    fi
    # A directory every user may traverse (the worker of step 4 runs as nobody).
    local dir; dir=$(mktemp -d /tmp/gpu-fd.XXXXXX); chmod 0711 "$dir"
    cp "$OUT/gpu-worker" "$dir/gpu-worker"; chmod 0755 "$dir/gpu-worker"
    start_broker "$dir"
    local tok; tok=$(token_for a)
    if [[ $steps == *3* ]]; then
        echo "=== 3. fd handles only: no legacy handle ==="
        out=$("$dir/gpu-worker" --broker "unix://$dir/b.sock" --token "$tok" selftest --bytes 67108864)
        echo "$out"
        grep -q "^KIND fd CudaVmm" <<<"$out" || { echo "default lease is not a VMM fd lease"; exit 1; }
        grep -q "^MAPPED 0$" <<<"$out" || { echo "VMM lease did not read back"; exit 1; }
        "${CTL[@]}" --json leases list | grep -c cuda_ipc && { echo "a legacy handle was listed"; exit 1; } || true
        echo "lease: fd handle of CUDA VMM memory; no cuda_ipc anywhere"
    fi
    if [[ $steps == *4* ]]; then
        echo "=== 4. a worker of another uid in its own PID/IPC/mount namespaces ==="
        chmod 0666 "$dir/b.sock"
        local ntok; ntok=$(token_for ns)
        unshare --pid --ipc --mount --fork --mount-proc \
            "$dir/gpu-worker" --as-uid 65534 --broker "unix://$dir/b.sock" --token "$ntok" \
            selftest --bytes 67108864 | tee "$dir/ns.out"
        grep -q "^KIND fd CudaVmm" "$dir/ns.out" && grep -q "^MAPPED 0$" "$dir/ns.out" \
            || { echo "namespaced worker could not map its VMM lease"; exit 1; }
        "${CTL[@]}" sessions list || true
        grep "ticket refused" "$dir/broker.log" || echo "no ticket refused"
    fi
    if [[ $steps == *5* ]]; then
        echo "=== 5. Python (grpcio + socket.recv_fds + cuda-python) imports a VMM lease ==="
        python3 scripts/gpu_python_fd_worker.py "$dir/b.sock" "$tok" "$OUT/gpubroker_descriptor.bin" "$dir/gpu-worker"
    fi
    if [[ $steps == *6* ]]; then
        echo "=== 6. benchmark: lease + map, fd path vs raw VMM, one run ==="
        local tok2; tok2=$(token_for b)
        "$dir/gpu-worker" --broker "unix://$dir/b.sock" --token "$tok" bench-map \
            --sizes 2MiB,64MiB,1GiB --iters 20 --token2 "$tok2" --label fd
    fi
    "${CTL[@]}" devices || true
    stop_broker "$dir"
    echo "=== all fd GPU checks passed in $((SECONDS - t0)) s ==="
}

case "${1:-build}" in
    build) build ;;
    run) run "${2:-123456}" ;;
    *) echo "usage: $0 build|run [STEPS]" >&2; exit 2 ;;
esac
