#!/usr/bin/env bash
# Why the broker has no legacy CUDA IPC handles, re-run on the GPU (docs/security.md).
#
#   scripts/gpu-legacy-forge.sh build   # here (Rust, no GPU): release binaries into .gpu/legacy
#   scripts/gpu-legacy-forge.sh run     # on the GPU machine (no Rust): both parts below
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
OUT=${GPU_BIN:-.gpu/legacy}
TARGET=${CARGO_TARGET_DIR:-target}

build() {
    mkdir -p "$OUT"
    cargo build --release -p gpu-broker -p gpu-brokerctl -p gpu-broker-tests --bins
    for b in gpu-broker gpu-brokerctl gpu-worker; do cp -f "$TARGET/release/$b" "$OUT/$b"; done
    cp -f "$(ls -t "$TARGET"/release/build/gpu-broker-proto-*/out/gpubroker_descriptor.bin | head -n1)" "$OUT/gpubroker_descriptor.bin"
    strip "$OUT"/gpu-broker "$OUT"/gpu-brokerctl "$OUT"/gpu-worker 2>/dev/null || true
    du -sh "$OUT"
}

run() {
    local t0=$SECONDS
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version,compute_mode --format=csv || true
    echo "=== (a) two raw exporter processes: does a per-tenant exporter stop forging? ==="
    python3 scripts/gpu_legacy_forge.py raw
    echo "=== (b) the broker (its only mode): tenant A forges against tenant B's lease ==="
    local dir; dir=$(mktemp -d /tmp/gpu-forge.XXXXXX)
    if "$OUT/gpu-broker" --backend cuda --socket "$dir/x.sock" --state-dir "$dir/x" \
        --legacy-ipc-handles >"$dir/refused.log" 2>&1; then
        echo "the broker STARTED with --legacy-ipc-handles"; exit 1
    fi
    echo "--legacy-ipc-handles: $(head -c 300 "$dir/refused.log")"
    "$OUT/gpu-broker" --backend cuda --socket "$dir/b.sock" --state-dir "$dir/state" \
        --shutdown-grace 1s >"$dir/broker.log" 2>&1 &
    local pid=$!
    for _ in $(seq 200); do [[ -S "$dir/b.sock" ]] && break; sleep 0.05; done
    local ctl=("$OUT/gpu-brokerctl" --broker "unix://$dir/b.sock" --token-file "$dir/state/admin.token")
    "${ctl[@]}" quota set a --limit 16GiB >/dev/null
    "${ctl[@]}" quota set b --limit 16GiB >/dev/null
    local ta tb; ta=$("${ctl[@]}" tokens issue a 2>/dev/null); tb=$("${ctl[@]}" tokens issue b 2>/dev/null)
    # Tenant B's worker: a 64 MiB lease written with 0xb7, held.
    "$OUT/gpu-worker" --broker "unix://$dir/b.sock" --token "$tb" hold --bytes 67108864 --pattern b7 \
        >"$dir/victim.out" 2>&1 &
    local victim=$!
    for _ in $(seq 200); do grep -q '^READY' "$dir/victim.out" && break; sleep 0.05; done
    local ready; ready=$(grep '^READY' "$dir/victim.out") || { cat "$dir/victim.out"; exit 1; }
    echo "tenant B holds: $ready"
    local rc=0
    python3 scripts/gpu_legacy_forge.py broker "$dir/b.sock" "$ta" "$pid" \
        "$OUT/gpubroker_descriptor.bin" "$(awk '{print $2}' <<<"$ready")" b7 || rc=$?
    if "${ctl[@]}" --json leases list | grep -q cuda_ipc; then
        echo "a legacy handle was listed"; rc=1
    fi
    "${ctl[@]}" leases list || true
    if grep -q CHANGED "$dir/victim.out"; then echo "tenant B's lease was written by someone else"; rc=1; fi
    kill "$victim"; wait "$victim" 2>/dev/null || true
    kill -TERM "$pid"; wait "$pid" || { echo "broker exit status $?"; cat "$dir/broker.log"; exit 1; }
    [[ $rc == 0 ]] || exit "$rc"
    echo "=== legacy forge check done in $((SECONDS - t0)) s ==="
}

case "${1:-build}" in
    build) build ;;
    run) run ;;
    *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
