#!/usr/bin/env bash
# The GPU machine's check of the Python package and of PyTorch on broker leases.
#
#   scripts/gpu-python-check.sh run     # on the GPU machine (Python 3 + PyTorch + CuPy,
#                                       # no Rust, no network), from the folder that
#                                       # `scripts/gpu-all.sh build` makes (GPU_OUT,
#                                       # default .gpu/all)
#
# What runs on the GPU (scripts/gpu_python_check.py does the work):
#   1. as_torch -> as_cupy -> as_torch round trip between two processes, and what NVML
#      puts on a process that maps a lease
#   2. a small transformer trained on random data under PyTorch's own allocator (before
#      the broker starts, so it takes nothing from the broker's leasable memory)
#   3. the same loop, unmodified, under gpubroker.torch.install(): steps/s, peak reserved,
#      broker calls per step after warm-up, every allocation in leases (also autograd's
#      backward thread), refusals of CUDA graphs and torch.multiprocessing, empty_cache
#   4. the same loop again while a second tenant's job asks for more than the card has
#      left: that job waits GPU_BROKER_WAIT and gets torch.OutOfMemoryError with the
#      broker's reason; the training never does
#   5. pooled lease() latency from Python and, in the same run, from Rust (gpu-worker bench)
#      and of a retained 2 MiB block on the lease line and over gRPC
#   6. a gpubroker.torch segment of 2 MiB (a 1 MiB tensor) and 64 MiB retained across empty_cache() (on the
#      lease line and over gRPC), not retained, and PyTorch's own cudaMalloc of the size
#      (its caching off, so the tensor's size); each RESULT line names its lease_line
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh
OUT=$GPU_OUT

# Step 4: the training again while a second tenant's job asks for 1 GiB more than is left.
train_beside_a_hog() {
    env GPU_BROKER_TOKEN="$train" "${check[@]}" train --mode broker --steps 50 \
        --ready-file "$dir/ready" --hold-until "$dir/hog-done" >"$dir/train4.out" 2>&1 &
    local tpid=$! _ free_now rc=0
    for _ in $(seq 600); do [[ -f $dir/ready ]] && break; sleep 0.1; done
    "${CTL[@]}" sessions list || true
    free_now=$("${CTL[@]}" --json devices | python3 -c '
import json, sys
d = json.load(sys.stdin)
d = d[0] if isinstance(d, list) else d.get("devices", [d])[0]
print(max(0, d["leasable_bytes"] - d["leased_bytes"] - d.get("reserved_bytes", 0) - d.get("quarantined_bytes", 0)))') \
        || free_now=$((8 << 30))
    echo "left on the card: $free_now bytes; the second tenant asks for 1 GiB more"
    env GPU_BROKER_TOKEN="$other" GPU_BROKER_WAIT=5 "${check[@]}" hog --wait 5 \
        --nbytes $((free_now + (1 << 30))) || true
    touch "$dir/hog-done"
    wait "$tpid" || rc=$?
    cat "$dir/train4.out"
    return "$rc"
}

run() {
    local t0=$SECONDS
    dir=$(mktemp -d)
    gpu_python "$OUT" "$dir"
    check=(python3 "$OUT/gpu_python_check.py")
    gpu_smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    gpu_step versions python3 -c 'import torch, cupy, gpubroker; print("torch", torch.__version__, "cupy", cupy.__version__, "gpubroker", gpubroker.__version__)'

    echo "=== 2. training loop, PyTorch's own allocator (no broker yet) ==="
    gpu_step native-training "${check[@]}" train --mode native --steps 200

    # A card with 16 GiB leasable: the rest is headroom, so the second tenant can find it full.
    local headroom=${GPU_PYTHON_HEADROOM:-}
    [[ -n $headroom ]] || headroom=$(gpu_headroom_leaving 16795)
    gpu_start "$OUT" "$dir" --headroom "$headroom"
    local bench
    train=$(gpu_tenant train --limit 12GiB)
    other=$(gpu_tenant other --limit 100GiB)
    bench=$(gpu_tenant bench --limit 100GiB)
    "${CTL[@]}" devices

    echo "=== 1. as_torch / as_cupy round trip between two processes ==="
    gpu_step round-trip env GPU_BROKER_TOKEN="$train" "${check[@]}" roundtrip

    echo "=== 3. training loop under gpubroker.torch.install() ==="
    gpu_step broker-training env GPU_BROKER_TOKEN="$train" "${check[@]}" train --mode broker --steps 200

    echo "=== 4. training again while a second tenant wants more than is left ==="
    gpu_step training-beside-a-hog train_beside_a_hog

    echo "=== 5. pooled lease latency: Python, then Rust (same broker, same run) ==="
    gpu_step python-latency env GPU_BROKER_TOKEN="$bench" "${check[@]}" latency \
        --nbytes $((64 << 20)) --iters 200
    gpu_step rust-latency "$OUT/gpu-worker" --broker "$GPU_BROKER_ADDR" --token "$bench" bench \
        --sizes 64MiB --iters 200
    # A retained block's lease + release from Python, on the lease line and over gRPC.
    gpu_step python-latency-retained env GPU_BROKER_TOKEN="$bench" "${check[@]}" latency \
        --nbytes $((2 << 20)) --iters 500 --retained
    gpu_step python-latency-retained-grpc env GPU_BROKER_TOKEN="$bench" \
        GPU_BROKER_CLIENT_LEASE_LINE=off "${check[@]}" latency --nbytes $((2 << 20)) \
        --iters 500 --retained

    echo "=== 6. gpubroker.torch segments retained across empty_cache(), then not ==="
    local n seg
    # A 1 MiB tensor is a 2 MiB segment (PyTorch's small pool; a 2 MiB one would take 20 MiB).
    for n in $((1 << 20)) $((64 << 20)); do
        seg=$((n < (2 << 20) ? 2 << 20 : n))
        # Retained on the session's lease line, retained over gRPC, not retained, and
        # PyTorch's own cudaMalloc of the same size (the baseline).
        gpu_step torch-retained env GPU_BROKER_TOKEN="$bench" "${check[@]}" retain \
            --nbytes "$n" --retain "$seg" --iters 100
        gpu_step torch-retained-grpc env GPU_BROKER_TOKEN="$bench" \
            GPU_BROKER_CLIENT_LEASE_LINE=off "${check[@]}" retain --nbytes "$n" --retain "$seg" \
            --iters 100
        gpu_step torch-not-retained env GPU_BROKER_TOKEN="$bench" "${check[@]}" retain \
            --nbytes "$n" --retain 0 --iters 100
        gpu_step torch-native-malloc env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${check[@]}" retain \
            --mode native --nbytes "$n" --iters 100
    done
    "${CTL[@]}" devices
    gpu_stop "$dir" || GPU_FAILED+=(broker)
    echo "=== 2b. PyTorch's own allocator again (brackets step 3 against clock drift) ==="
    gpu_step native-training-again "${check[@]}" train --mode native --steps 200
    echo "=== in $((SECONDS - t0)) s ==="
    gpu_result "Python check"
}

case ${1:-} in
    run) run ;;
    *) echo "usage: $0 run" >&2; exit 2 ;;
esac
