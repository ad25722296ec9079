#!/usr/bin/env bash
# The GPU machine's check of a broker restart that keeps every lease (the keeper).
#
#   scripts/gpu-restart-check.sh run   # on the GPU machine (Python 3 + PyTorch, no Rust),
#                                      # from the folder `scripts/gpu-all.sh build` makes
#
# What runs on the GPU (CUDA backend, a keeper beside the broker):
#   1. a worker holds 10,000 leases of 2 MiB; the broker is SIGKILLed and started again;
#      prints `restart to serving: N ms` (process start to its first answered call),
#      the status line (`keeper: took back 10000 leases ... in N ms`: reading the keeper
#      and adopting) and the one under it (`restart phases: open store N ms, open devices
#      N ms, ..., keeper dump N ms, parse, sessions, device 0 take-back, adopt under the
#      lock, ..., to serving N ms`: where the start's time went); the worker prints `FIRST_CALL_MS` (its first call after the
#      restart), `RESUMED kept=10000 lost=0`, `USAGE_OK` (held bytes exact), `DONE`
#      and the card's leasable bytes are what they were before the kill
#   2. a PyTorch training loop on gpubroker.torch keeps stepping through a broker SIGKILL
#      + restart: `RESUMED`, `QUOTA_ENFORCED` (an allocation beyond the quota still
#      fails after it), `TRAIN_OK`
#   3. the keeper SIGKILLed and started again under the running broker (a worker holding
#      1,000 leases): the broker logs `the keeper is back` (it gave the new keeper every
#      CUDA descriptor again); then a broker SIGKILL + restart keeps them all:
#      `RESUMED kept=1000 lost=0`, `USAGE_OK`, `DONE`
# It allocates and frees memory only; it never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh
OUT=$GPU_OUT

# Starts the keeper on DIR/keeper.sock (KEEPER_PID).
keeper_start() {
    local dir=$1 _
    "$OUT/gpu-broker" keeper --socket "$dir/keeper.sock" 2>"$dir/keeper.log" &
    KEEPER_PID=$!
    for _ in $(seq 100); do [[ -S $dir/keeper.sock ]] && return 0; sleep 0.05; done
    cat "$dir/keeper.log"
    return 1
}

# The first device's leasable bytes, as the broker reports them.
leasable() {
    "${CTL[@]}" --json devices | python3 -c '
import json, sys
d = json.load(sys.stdin)
d = d[0] if isinstance(d, list) else d.get("devices", [d])[0]
print(d["leasable_bytes"])'
}

# SIGKILLs the broker, starts it again on the same socket and state, and prints how long
# it took to answer a call; fails when the restarted broker leases less of the card (the
# kept memory counted as used by others).
restart_broker() {
    local dir=$1 before after
    shift
    before=$(leasable)
    kill -KILL "$BROKER_PID"
    wait "$BROKER_PID" 2>/dev/null || true
    local t0 t1
    t0=$(date +%s%N)
    gpu_start "$OUT" "$dir" "$@"
    until "${CTL[@]}" devices >/dev/null 2>&1; do sleep 0.005; done
    t1=$(date +%s%N)
    echo "restart to serving: $(((t1 - t0) / 1000000)) ms"
    # The start line and the phases under it (up to the header's blank line).
    "${CTL[@]}" status | sed -n '3,/^$/p'
    grep -E "took back what the keeper held|serving after a restart" "$dir/broker.log" | tail -2
    after=$(leasable)
    echo "leasable before / after the restart: $before / $after bytes"
    # Contexts that come and go move it by less than 1 GiB.
    ((after + 1073741824 >= before))
}

# Waits until FILE has a line starting with WHAT (or PID exited).
wait_line() {
    local file=$1 what=$2 pid=$3 _
    for _ in $(seq 3000); do
        grep -q "^$what" "$file" && return 0
        kill -0 "$pid" 2>/dev/null || { cat "$file"; return 1; }
        sleep 0.1
    done
    cat "$file"
    return 1
}

# Part 1: a worker holding N leases through a restart.
hold_through() {
    local dir=$1 token=$2 n=$3 log=$1/hold.log
    GPU_BROKER_TOKEN=$token python3 "$OUT/gpu_restart_check.py" hold "$n" >"$log" 2>&1 &
    local w=$!
    wait_line "$log" HOLDING "$w" || return 1
    cat "$log"
    local same=0
    restart_broker "$dir" --keeper "$dir/keeper.sock" --headroom 4GiB || same=1
    wait "$w" || { cat "$log"; return 1; }
    cat "$log"
    grep -q "^DONE" "$log" && return "$same"
}

# Part 2: training through a restart.
train_through() {
    local dir=$1 token=$2 log=$1/train.log
    GPU_BROKER_TOKEN=$token python3 "$OUT/gpu_restart_check.py" train >"$log" 2>&1 &
    local w=$!
    wait_line "$log" "STEP 50" "$w" || return 1
    local same=0
    restart_broker "$dir" --keeper "$dir/keeper.sock" --headroom 4GiB || same=1
    wait "$w" || { cat "$log"; return 1; }
    grep -E "^(RESUMED|QUOTA|TRAIN|STEP [0-9]*00 )" "$log"
    grep -q "^TRAIN_OK" "$log" && return "$same"
}

# Counts the broker log's lines saying a lost keeper was filled again.
keeper_backs() {
    grep -c "the keeper is back" "$1/broker.log" || true
}

# Part 3: the keeper killed and started again under the broker, then a broker restart.
keeper_swap_through() {
    local dir=$1 token=$2 n=$3 log=$1/swap.log backs _
    GPU_BROKER_TOKEN=$token python3 "$OUT/gpu_restart_check.py" hold "$n" >"$log" 2>&1 &
    local w=$!
    wait_line "$log" HOLDING "$w" || return 1
    cat "$log"
    backs=$(keeper_backs "$dir")
    kill -KILL "$KEEPER_PID"
    wait "$KEEPER_PID" 2>/dev/null || true
    keeper_start "$dir"
    for _ in $(seq 300); do
        (($(keeper_backs "$dir") > backs)) && break
        sleep 0.1
    done
    grep -E "the keeper is (lost|back)" "$dir/broker.log" | tail -2
    (($(keeper_backs "$dir") > backs)) || { echo "the broker did not fill the new keeper"; return 1; }
    local same=0
    restart_broker "$dir" --keeper "$dir/keeper.sock" --headroom 4GiB || same=1
    wait "$w" || { cat "$log"; return 1; }
    cat "$log"
    grep -q "^DONE" "$log" && return "$same"
}

run() {
    local t0=$SECONDS dir
    dir=$(mktemp -d)
    gpu_python "$OUT" "$dir"
    gpu_smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv || true
    keeper_start "$dir"
    gpu_start "$OUT" "$dir" --keeper "$dir/keeper.sock" --headroom 4GiB
    local holder trainer
    holder=$(gpu_tenant holder --limit 32GiB)
    trainer=$(gpu_tenant trainer --limit 4GiB)
    echo "=== 1. 10,000 live leases through a broker SIGKILL + restart ==="
    gpu_step hold-10000 hold_through "$dir" "$holder" "${GPU_RESTART_LEASES:-10000}"
    echo "=== 2. PyTorch training through a broker SIGKILL + restart ==="
    gpu_step train train_through "$dir" "$trainer"
    echo "=== 3. the keeper restarted under the broker, then a broker SIGKILL + restart ==="
    gpu_step keeper-swap keeper_swap_through "$dir" "$holder" "${GPU_RESTART_SWAP_LEASES:-1000}"
    "${CTL[@]}" status | head -3
    gpu_stop "$dir" || GPU_FAILED+=(broker)
    kill "$KEEPER_PID" 2>/dev/null || true
    echo "=== in $((SECONDS - t0)) s ==="
    gpu_result "restart check"
}

case ${1:-} in
    run) run ;;
    *) echo "usage: $0 run" >&2; exit 2 ;;
esac
