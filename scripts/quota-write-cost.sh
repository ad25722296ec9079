#!/usr/bin/env bash
# What one operator call costs the broker, in counts a busy machine does not blur: user-space
# instructions (valgrind's callgrind) and system calls (strace -c) per `SetQuota` and per
# `GetQuota`, each the difference of a run of the bench's admin loop (`quota-writer`, a
# child process on its own connection, 16 tenants in turn) for SHORT and for LONG seconds
# (3 and 9), divided by the difference in calls, so the start and the connection cancel
# out. Host backend, state on disk in a folder here. Needs valgrind and strace (for
# measurements only: `apt-get install valgrind strace`).
#
#   scripts/quota-write-cost.sh DIR [FLAGS...]
#
# DIR holds release builds of gpu-broker and gpu-broker-bench (e.g. the folder
# `scripts/gpu-all.sh build` makes; BROKER=PATH measures another broker); FLAGS go to the broker; with OPS=1 the
# broker gets an operators' socket (`--admin-listen`) and the admin loop runs there. Prints
# one line per call and tool.
set -euo pipefail
# shellcheck source=scripts/cost-common.sh
source "$(dirname "$0")/cost-common.sh"
dir=$(cd "$1" && pwd)
shift
flags=("$@")
broker=${BROKER:-$dir/gpu-broker}
short=${SHORT:-3}
long=${LONG:-9}
work=$(mktemp -d -p "$PWD" .qcost.XXXXXX)
trap 'rm -rf "$work"' EXIT
names=$(seq -f "t%02g" 0 15 | paste -sd,)
wrap=$work/wrap.sh
cost_wrapper "$wrap"

one() { # one TOOL OP SECS -> "COUNT CALLS" (COUNT: instructions, or the strace file)
    local tool=$1 op=$2 secs=$3 w sock pid tok res
    w=$(mktemp -d -p "$work" run.XXXXXX)
    sock=$w/b.sock
    local uri=unix://$sock ops=()
    if [ "${OPS:-0}" = 1 ]; then
        ops=(--admin-listen "$w/ops.sock")
        uri=unix://$w/ops.sock
    fi
    local args=(--backend host --host-capacity 1GiB --socket "$sock" --state-dir "$w/state"
        --host-shm-dir "/dev/shm/qcost-$(basename "$w")" --shutdown-grace 1s ${ops[@]+"${ops[@]}"} ${flags[@]+"${flags[@]}"})
    COST_TOOL=$tool COST_BROKER=$broker COST_OUT=$w/$tool.out GPU_BROKER_LOG=warn \
        "$wrap" "${args[@]}" 2>"$w/tool.log" &
    pid=$!
    for _ in $(seq 300); do [ -S "$sock" ] && break; sleep 0.1; done
    tok=$(cat "$w/state/admin.token")
    writer() { # writer OP SECS: the admin loop for SECS seconds (it stops when stdin closes)
        (sleep "$2") | GPB_BENCH_ADMIN_TOKEN=$tok "$dir/gpu-broker-bench" quota-writer \
            --uri "$uri" --tenants "$names" --op "$1" | tail -1
    }
    # The tenants exist before a get loop (the same in both runs: cancels out).
    [ "$op" = get ] && writer set 2 >/dev/null
    res=$(writer "$op" "$secs")
    kill -TERM "$pid"
    wait "$pid" || true
    if [ "$tool" = callgrind ]; then
        echo "$(cost_instructions "$w/$tool.out") $(echo "$res" | awk '{print $2}')"
    else
        echo "$w/$tool.out $(echo "$res" | awk '{print $2}')"
    fi
}

echo "machine: $(nproc) cores, $(uname -r); load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "$(basename "$broker"): $(sha256sum "$broker" | cut -c1-12) ${flags[*]:-}${OPS:+ (OPS=$OPS: admin loop on --admin-listen)}"
for op in set get; do
    read -r i0 c0 <<<"$(one callgrind "$op" "$short")"
    read -r i1 c1 <<<"$(one callgrind "$op" "$long")"
    read -r s0 d0 <<<"$(one strace "$op" "$short")"
    read -r s1 d1 <<<"$(one strace "$op" "$long")"
    n=$((c1 - c0))
    echo "$op: $(cost_per "$i0" "$i1" "$n") instructions/call ($n calls apart)"
    n=$((d1 - d0))
    { read -r calls; read -r top; } < <(cost_syscalls "$s0" "$s1" "$n")
    echo "$op: $calls system calls/call ($n calls apart): $top"
done
