#!/usr/bin/env bash
# Why the broker has no legacy CUDA IPC handles, re-run on the GPU (docs/security.md).
#
#   scripts/gpu-legacy-forge.sh run     # on the GPU machine, from the folder that
#                                       # `scripts/gpu-all.sh build` makes (GPU_OUT,
#                                       # default .gpu/all): both parts below
#
# (a) two raw exporter processes (scripts/gpu_legacy_forge.py raw): a holder of exporter B's
#     legacy handles opens exporter A's memory by trying the 256 values of byte 48; prints
#     the handle layout, "reached A's memory: yes/no" and what a CUDA context costs (what
#     one exporter process per tenant would have cost). A measurement: it does not fail.
# (b) a broker in its only mode: tenant B's worker holds a lease written with 0xb7; tenant
#     A's worker checks that no lease reply or listing carries a legacy handle, that asking
#     for HANDLE_KIND_CUDA_IPC only is LEGACY_HANDLES_REMOVED, then crafts legacy handles
#     from its own export template with the broker's pid, all 256 values of byte 48 and a
#     range of counters (after a control run that must reach an exporter of its own): none
#     may open memory of another context (its own byte-48 value reaches only its own
#     allocations: reported apart). Also: the removed --legacy-ipc-handles flag stops the
#     broker at start.
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh
OUT=$GPU_OUT

# (b): tenant B's worker holds a lease written with 0xb7 while tenant A forges against it.
forge_against_the_broker() {
    "$OUT/gpu-worker" --broker "$GPU_BROKER_ADDR" --token "$tb" hold --bytes 67108864 \
        --pattern b7 >"$dir/victim.out" 2>&1 &
    local victim=$! ready rc=0 _
    for _ in $(seq 200); do grep -q '^READY' "$dir/victim.out" && break; sleep 0.05; done
    ready=$(grep '^READY' "$dir/victim.out") || { cat "$dir/victim.out"; return 1; }
    echo "tenant B holds: $ready"
    python3 "$OUT/gpu_legacy_forge.py" broker "$dir/b.sock" "$ta" "$BROKER_PID" \
        "$OUT/gpubroker_descriptor.bin" "$(awk '{print $2}' <<<"$ready")" b7 || rc=$?
    if "${CTL[@]}" --json leases list | grep -q cuda_ipc; then
        echo "a legacy handle was listed"
        rc=1
    fi
    "${CTL[@]}" leases list || true
    if grep -q CHANGED "$dir/victim.out"; then
        echo "tenant B's lease was written by someone else"
        rc=1
    fi
    kill "$victim"
    wait "$victim" 2>/dev/null || true
    return "$rc"
}

run() {
    local t0=$SECONDS
    gpu_smi --query-gpu=index,name,memory.total,memory.used,driver_version,compute_mode --format=csv || true
    echo "=== (a) two raw exporter processes: does a per-tenant exporter stop forging? ==="
    gpu_step raw-exporters python3 "$OUT/gpu_legacy_forge.py" raw
    echo "=== (b) the broker (its only mode): tenant A forges against tenant B's lease ==="
    dir=$(mktemp -d -t gpu-forge.XXXXXX)
    local refused=0
    timeout 20 "$OUT/gpu-broker" --backend host --socket "$dir/x.sock" --state-dir "$dir/x" \
        --legacy-ipc-handles >"$dir/refused.log" 2>&1 || refused=$?
    if [[ $refused == 0 || $refused == 124 ]]; then
        echo "the broker STARTED with --legacy-ipc-handles"
        GPU_FAILED+=(legacy-flag)
    fi
    echo "--legacy-ipc-handles: $(head -c 300 "$dir/refused.log")"
    gpu_start "$OUT" "$dir"
    ta=$(gpu_tenant a --limit 16GiB)
    tb=$(gpu_tenant b --limit 16GiB)
    gpu_step forge-broker forge_against_the_broker
    gpu_stop "$dir" || GPU_FAILED+=(broker)
    echo "=== in $((SECONDS - t0)) s ==="
    gpu_result "legacy forge check"
}

case ${1:-} in
    run) run ;;
    *) echo "usage: $0 run" >&2; exit 2 ;;
esac
