#!/usr/bin/env bash
# The GPU machine's check of shared read-only leases on CUDA memory.
#
#   scripts/gpu-shared-check.sh run     # on the GPU machine, from the folder that
#                                       # `scripts/gpu-all.sh build` makes (GPU_OUT,
#                                       # default .gpu/all)
#
# What runs on the GPU (gpu-worker shared-check does the work, one line per fact):
#   tenant `pub` publishes a written 256 MiB CUDA VMM lease for tenant `reader`; a worker
#   process of `reader` imports it, maps it read-only and reads every byte; tenant
#   `outsider` (not listed) gets NOT_FOUND; only `pub` is charged; after pub's lease ends
#   the reader still reads every byte (the memory counted as pub's quarantined bytes and
#   still in use on the card) until it releases; then nothing is charged and the card's
#   free memory comes back.
# Then (gpu-worker kept-check) memory handed on where the broker cannot see it: tenant
#   `keeper`'s worker sends its 256 MiB lease's descriptor to its child over SCM_RIGHTS;
#   the child maps it with a CUDA context of its own; the worker releases and exits. The
#   tenant stays charged the 256 MiB while the child lives (NVML lists it, near the
#   worker), and nothing once it exits, when the card gets the memory back. Twice: the
#   lease published (freed at the release, the worker alive: the child is its
#   descendant), and, as root, cached and evicted by tenant `evictor` after the worker
#   (run as nobody) exited: the child is found by the uid it shares with the worker.
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
    # A directory every user may traverse (kept-check's worker runs as nobody).
    chmod 0711 "$dir"
    cp "$OUT/gpu-worker" "$dir/gpu-worker"
    chmod 0755 "$dir/gpu-worker"
    gpu_smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    local headroom
    headroom=$(gpu_headroom_leaving 41371)
    gpu_start "$OUT" "$dir" --headroom "$headroom"
    local tok_pub tok_reader tok_outsider
    tok_pub=$(gpu_tenant pub --limit 4GiB)
    tok_reader=$(gpu_tenant reader --limit 4GiB)
    tok_outsider=$(gpu_tenant outsider --limit 4GiB)
    "${CTL[@]}" devices

    echo "=== shared CUDA lease: publish, import by another tenant's worker, outsider, lifetime ==="
    gpu_step shared-check "$OUT/gpu-worker" --broker "$GPU_BROKER_ADDR" --token "$tok_pub" \
        shared-check --bytes $((256 << 20)) --publisher pub --reader reader \
        --token-b "$tok_reader" --token-c "$tok_outsider"

    "${CTL[@]}" shared
    "${CTL[@]}" leaks
    "${CTL[@]}" devices

    echo "=== memory handed to a child the broker never saw: charged until the child exits ==="
    local tok_keeper tok_evictor as_nobody=()
    tok_keeper=$(gpu_tenant keeper --limit 4GiB)
    tok_evictor=$(gpu_tenant evictor --limit 200GiB)
    if [[ $(id -u) == 0 ]]; then
        chmod 0666 "$dir/b.sock"
        as_nobody=(--child-uid 65534)
    fi
    gpu_step kept-check "$dir/gpu-worker" --broker "$GPU_BROKER_ADDR" --token "$tok_keeper" \
        kept-check --bytes $((256 << 20)) --token-b "$tok_evictor" \
        --admin-token-file "$dir/state/admin.token" "${as_nobody[@]}"
    "${CTL[@]}" leaks
    "${CTL[@]}" devices
    gpu_stop "$dir" || GPU_FAILED+=(broker)
    echo "=== in $((SECONDS - t0)) s ==="
    gpu_result "shared check"
}

case ${1:-} in
    run) run ;;
    *) echo "usage: $0 run" >&2; exit 2 ;;
esac
