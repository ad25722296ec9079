#!/usr/bin/env bash
# The GPU machine's check and benchmark of sleep/wake.
#
#   scripts/gpu-sleep-check.sh build   # here (Rust): release binaries and the abi3 wheel
#                                      # into .gpu/leases (carry that folder to the GPU run)
#   scripts/gpu-sleep-check.sh run     # on the GPU machine (Python 3 + PyTorch, no Rust)
#
# What runs on the GPU:
#   1. gpu-worker sleep-bench: a 1 GiB VMM lease mapped at a reserved range (Resident);
#      sleep with contents saved to a host-tier lease and wake (the same address, the bytes
#      back, the device bytes uncharged while asleep), and sleep/wake without contents;
#      medians of each step
#   2. scripts/gpu_sleep_check.py: a PyTorch tensor in gpubroker.torch's leases keeps its
#      address and contents across gpubroker.torch.sleep()/wake(); gpubroker.Resident too
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_LEASES_OUT:-.gpu/leases}
TARGET=${CARGO_TARGET_DIR:-target}

build() {
    mkdir -p "$OUT"
    rm -f "$OUT"/gpubroker-*.whl
    cargo build --release -p gpu-broker --bin gpu-broker -p gpu-broker-client --bin gpu-brokerctl \
        -p gpu-broker-tests --bin gpu-worker
    local venv=${GPUBROKER_VENV:-target/py-venv}
    [[ -x $venv/bin/maturin ]] || scripts/test-python.sh --co -q >/dev/null
    "$venv/bin/maturin" build --release --strip --manifest-path client/python/Cargo.toml --out "$OUT"
    for b in gpu-broker gpu-brokerctl gpu-worker; do cp -f "$TARGET/release/$b" "$OUT/$b"; done
    strip "$OUT"/gpu-broker "$OUT"/gpu-brokerctl "$OUT"/gpu-worker 2>/dev/null || true
    cp -f scripts/gpu-sleep-check.sh scripts/gpu_sleep_check.py "$OUT/"
    du -sh "$OUT"
}

run() {
    local t0=$SECONDS
    local dir; dir=$(mktemp -d)
    local wheel; wheel=$(ls "$OUT"/gpubroker-*.whl | head -n1)
    python3 -m zipfile -e "$wheel" "$dir/py"
    export PYTHONPATH="$dir/py${PYTHONPATH:+:$PYTHONPATH}"
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    "$OUT/gpu-broker" --backend cuda --socket "$dir/b.sock" --state-dir "$dir/state" \
        --headroom 100GiB --shutdown-grace 1s >"$dir/broker.log" 2>&1 &
    local pid=$!
    trap 'kill -TERM $pid 2>/dev/null || true' EXIT
    for _ in $(seq 100); do [[ -S "$dir/b.sock" ]] && break; sleep 0.1; done
    local ctl=("$OUT/gpu-brokerctl" --broker "unix://$dir/b.sock" --token-file "$dir/state/admin.token")
    export GPU_BROKER_ADDR="unix://$dir/b.sock"
    "${ctl[@]}" quota set sleeper --limit 8GiB --host-limit 8GiB >/dev/null
    "${ctl[@]}" quota set torch --limit 8GiB --host-limit 8GiB >/dev/null
    local sleeper torch
    sleeper=$("${ctl[@]}" tokens issue sleeper 2>/dev/null)
    torch=$("${ctl[@]}" tokens issue torch 2>/dev/null)
    "${ctl[@]}" devices

    echo "=== 1. sleep/wake of a 1 GiB VMM lease (Rust client, Resident) ==="
    "$OUT/gpu-worker" --broker "unix://$dir/b.sock" --token "$sleeper" sleep-bench \
        --bytes $((1 << 30)) --iters 5 || echo "STEP FAILED: sleep-bench"

    echo "=== 2. PyTorch tensors across gpubroker.torch.sleep()/wake() ==="
    GPU_BROKER_TOKEN=$torch python3 "$OUT/gpu_sleep_check.py" || echo "STEP FAILED: torch sleep/wake"

    "${ctl[@]}" devices
    "${ctl[@]}" shared || true
    kill -TERM "$pid"; wait "$pid" || { echo "broker exit status $?"; tail -50 "$dir/broker.log"; }
    trap - EXIT
    grep -E "WARN|ERROR" "$dir/broker.log" | tail -20 || true
    echo "=== done in $((SECONDS - t0)) s ==="
}

case ${1:-} in
    build) build ;;
    run) run ;;
    *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
