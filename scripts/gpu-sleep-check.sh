#!/usr/bin/env bash
# The GPU machine's check and benchmark of sleep/wake.
#
#   scripts/gpu-sleep-check.sh run     # on the GPU machine (Python 3 + PyTorch, no Rust),
#                                      # from the folder that `scripts/gpu-all.sh build`
#                                      # makes (GPU_OUT, default .gpu/all)
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
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh
OUT=$GPU_OUT

run() {
    local t0=$SECONDS
    local dir
    dir=$(mktemp -d)
    gpu_python "$OUT" "$dir"
    gpu_smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    local headroom
    headroom=$(gpu_headroom_leaving 41371)
    gpu_start "$OUT" "$dir" --headroom "$headroom"
    local sleeper torch
    sleeper=$(gpu_tenant sleeper --limit 8GiB --host-limit 8GiB)
    torch=$(gpu_tenant torch --limit 8GiB --host-limit 8GiB)
    "${CTL[@]}" devices

    echo "=== 1. sleep/wake of a 1 GiB VMM lease (Rust client, Resident): pinned and pageable staging ==="
    gpu_step sleep-bench "$OUT/gpu-worker" --broker "$GPU_BROKER_ADDR" --token "$sleeper" \
        sleep-bench --bytes $((1 << 30)) --iters 5

    echo "=== 2. PyTorch tensors across gpubroker.torch.sleep()/wake() ==="
    gpu_step torch-sleep env GPU_BROKER_TOKEN="$torch" python3 "$OUT/gpu_sleep_check.py"

    "${CTL[@]}" devices
    gpu_stop "$dir" || GPU_FAILED+=(broker)

    echo "=== 3. gpubroker.torch sleeps by itself on a reclaim request ==="
    local headroom3 dir3
    headroom3=$(gpu_headroom_leaving 3072)
    dir3=$(mktemp -d)
    gpu_start "$OUT" "$dir3" --headroom "$headroom3" --reclaim-deadline 30s
    local low high
    low=$(gpu_tenant low --limit 4GiB --host-limit 4GiB --priority 0)
    high=$(gpu_tenant high --limit 4GiB --priority 10)
    "${CTL[@]}" devices
    gpu_step torch-sleep-on-reclaim env GPU_SLEEP_CTL="${CTL[*]}" GPU_BROKER_TOKEN="$low" \
        python3 "$OUT/gpu_sleep_check.py" reclaim "$high"
    "${CTL[@]}" devices
    gpu_stop "$dir3" || GPU_FAILED+=(broker)
    echo "=== in $((SECONDS - t0)) s ==="
    gpu_result "sleep check"
}

case ${1:-} in
    run) run ;;
    *) echo "usage: $0 run" >&2; exit 2 ;;
esac
