#!/usr/bin/env bash
# Acquire latency while an admin client writes quotas, on the GPU machine's idle CPUs
# (host backend, no GPU used): `gpu-broker-bench quota-writes`, brokers side by side in
# each part, every arm of every broker in each run (interleaved).
#
#   scripts/gpu-quota-writes.sh DIR
#
# DIR holds gpu-broker-bench and the brokers, release builds: gpu-broker (the one
# measured) and, optionally, gpu-broker-before (the broker to compare against) and
# gpu-broker-exp (an experimental build whose quota write path is picked by the
# environment variable GPB_X_QUOTA: main, audit, one, writer, writer-one). The parts:
#   1. writer in a child process, state on disk, SetQuota and GetQuota (the control)
#   2. writer as a task of the bench (as the first measurements)
#   3. state on tmpfs (fsync costs nothing there)
#   4. writes capped at RATE a second (500), so every broker gets the same pace
#   5. the broker's log at warn, and its runtime at 4 worker threads
# REPEAT (4), DURATION (1s) scale it. Every part stays within its `timeout`.
set -euo pipefail
dir=$(cd "$1" && pwd)
repeat=${REPEAT:-4}
duration=${DURATION:-1s}
rate=${RATE:-500}
bench=$dir/gpu-broker-bench
main=$dir/gpu-broker
exp=$dir/gpu-broker-exp
before=$dir/gpu-broker-before
# State directories: on disk (a folder here) and on tmpfs.
disk=$(mktemp -d -p "$PWD" .qw-disk.XXXXXX)
tmpfs=$(mktemp -d -p /dev/shm qw-tmpfs.XXXXXX)
trap 'rm -rf "$disk" "$tmpfs"' EXIT
echo "machine: $(nproc) cores, $(uname -r); load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "state dirs: disk $(df -PT "$disk" | awk 'NR==2 {print $2, $1}'), tmpfs $(df -PT "$tmpfs" | awk 'NR==2 {print $2, $1}')"
# The experimental arms, where that build is there.
also_exp=()
if [ -x "$exp" ]; then
    for m in audit one writer writer-one; do also_exp+=(--also "GPB_X_QUOTA=$m $exp"); done
fi
also_some=()
if [ -x "$exp" ]; then
    also_some=(--also "GPB_X_QUOTA=one $exp" --also "GPB_X_QUOTA=writer-one $exp")
fi
also_before=()
if [ -x "$before" ]; then also_before=(--also "$before"); fi
qw() { # qw NAME TIMEOUT TMPDIR ARGS...
    local name=$1 limit=$2 tmp=$3
    shift 3
    echo "== $name"
    date -u +%FT%TZ
    TMPDIR=$tmp timeout "$limit" "$bench" --json --broker-bin "$main" quota-writes \
        --repeat "$repeat" --duration "$duration" "$@" || echo "$name rc=$?"
    echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
}
qw "part 1: writer process, disk, set and get" 120 "$disk" \
    --writer process --op set,get ${also_exp[@]+"${also_exp[@]}"} ${also_before[@]+"${also_before[@]}"}
qw "part 2: writer task, disk" 60 "$disk" --writer task --op set ${also_some[@]+"${also_some[@]}"}
qw "part 3: writer process, tmpfs" 60 "$tmpfs" --writer process --op set ${also_some[@]+"${also_some[@]}"}
qw "part 4: writer process, disk, at most $rate/s" 90 "$disk" \
    --writer process --op set --rate "$rate" ${also_exp[@]+"${also_exp[@]}"}
qw "part 5: writer process, disk, broker log warn / 4 runtime threads" 60 "$disk" \
    --writer process --op set,get \
    --also "GPU_BROKER_LOG=warn $main" --also "TOKIO_WORKER_THREADS=4 $main"
date -u +%FT%TZ
