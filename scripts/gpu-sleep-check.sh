#!/usr/bin/env bash
# The GPU machine's check and benchmark of sleep/wake.
#
#   scripts/gpu-sleep-check.sh build   # here (Rust): release binaries and the abi3 wheel
#                                      # into .gpu/leases (carry that folder to the GPU run)
#   scripts/gpu-sleep-check.sh run     # on the GPU machine (Python 3 + PyTorch, no Rust)
#
# GPU_SLEEP_OUT names another folder (e.g. .gpu/shared).
#
# What runs on the GPU:
#   1. gpu-worker sleep-bench: a 1 GiB VMM lease mapped at a reserved range (Resident);
#      sleep with contents saved to a host-tier lease and wake (the same address, the bytes
#      back, the device bytes uncharged while asleep), through page-locked staging and
#      through the pageable copy, side by side in each round; sleep/wake without contents;
#      medians of each step
#   2. scripts/gpu_sleep_check.py: a PyTorch tensor in gpubroker.torch's leases keeps its
#      address and contents across gpubroker.torch.sleep()/wake(); gpubroker.Resident too
#   3. scripts/gpu_sleep_check.py reclaim, on a broker with about 2 GiB leasable: gpubroker.torch
#      with sleep_on_reclaim=True sleeps by itself when a higher-priority tenant needs its
#      memory; that tenant is granted; a wake restores the tensor at its address
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_SLEEP_OUT:-${GPU_LEASES_OUT:-.gpu/leases}}
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh

build() {
    gpu_build "$OUT" scripts/gpu-common.sh scripts/gpu-sleep-check.sh scripts/gpu_sleep_check.py
}

run() {
    local t0=$SECONDS
    local dir; dir=$(mktemp -d)
    gpu_python "$OUT" "$dir"
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    gpu_start "$OUT" "$dir" --headroom 100GiB
    "${CTL[@]}" quota set sleeper --limit 8GiB --host-limit 8GiB >/dev/null
    "${CTL[@]}" quota set torch --limit 8GiB --host-limit 8GiB >/dev/null
    local sleeper torch
    sleeper=$("${CTL[@]}" tokens issue sleeper 2>/dev/null)
    torch=$("${CTL[@]}" tokens issue torch 2>/dev/null)
    "${CTL[@]}" devices

    echo "=== 1. sleep/wake of a 1 GiB VMM lease (Rust client, Resident): pinned and pageable staging ==="
    "$OUT/gpu-worker" --broker "$GPU_BROKER_ADDR" --token "$sleeper" sleep-bench \
        --bytes $((1 << 30)) --iters 5 || echo "STEP FAILED: sleep-bench"

    echo "=== 2. PyTorch tensors across gpubroker.torch.sleep()/wake() ==="
    GPU_BROKER_TOKEN=$torch python3 "$OUT/gpu_sleep_check.py" || echo "STEP FAILED: torch sleep/wake"

    "${CTL[@]}" devices
    gpu_stop "$dir"

    echo "=== 3. gpubroker.torch sleeps by itself on a reclaim request ==="
    local total; total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1)
    local dir3; dir3=$(mktemp -d)
    gpu_start "$OUT" "$dir3" --headroom "$((total - 3072))MiB" --reclaim-deadline 30s
    "${CTL[@]}" quota set low --limit 4GiB --host-limit 4GiB --priority 0 >/dev/null
    "${CTL[@]}" quota set high --limit 4GiB --priority 10 >/dev/null
    local low high
    low=$("${CTL[@]}" tokens issue low 2>/dev/null)
    high=$("${CTL[@]}" tokens issue high 2>/dev/null)
    "${CTL[@]}" devices
    GPU_SLEEP_CTL="${CTL[*]}" GPU_BROKER_TOKEN=$low python3 "$OUT/gpu_sleep_check.py" reclaim "$high" \
        || echo "STEP FAILED: torch sleep on reclaim"
    "${CTL[@]}" devices
    gpu_stop "$dir3"
    echo "=== done in $((SECONDS - t0)) s ==="
}

case ${1:-} in
    build) build ;;
    run) run ;;
    *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
