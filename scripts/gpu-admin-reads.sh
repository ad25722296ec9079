#!/usr/bin/env bash
# Admin and metrics reads against acquire latency, on the GPU machine's idle CPUs (host
# backend, no GPU used): `gpu-broker-bench abuse --phases 3` (3,000 tenants, 10,000 leases)
# with brokers side by side in one run, every arm of every broker in each round.
#
#   scripts/gpu-admin-reads.sh DIR
#
# DIR holds gpu-broker-bench, gpu-broker-before (the broker to compare against) and
# gpu-broker (the one measured), release builds. Part 1: read loops in a child process of
# the bench; A = before, B = gpu-broker, C = gpu-broker --admin-threads 0 (its reads on the
# main runtime). Part 2: read loops on a thread of the bench (as earlier runs), A and B,
# ListAllLeases only. ROUNDS (3), DURATION (2s), TENANTS (3000), LEASES (10000) scale it.
set -euo pipefail
dir=$(cd "$1" && pwd)
rounds=${ROUNDS:-3}
duration=${DURATION:-2s}
sizes=(--tenants "${TENANTS:-3000}" --leases "${LEASES:-10000}")
bench=$dir/gpu-broker-bench
# The bench holds every lease's descriptor of every broker (10,000 each): raise the limit.
ulimit -n 1048576 2>/dev/null || ulimit -n "$(ulimit -Hn)"
echo "descriptor limit: $(ulimit -n)"
echo "machine: $(nproc) cores, $(uname -r); load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== part 1: readers in a child process; A = before, B = after, C = after --admin-threads 0"
date -u +%FT%TZ
timeout 200 "$bench" --json --broker-bin "$dir/gpu-broker-before" abuse --phases 3 "${sizes[@]}" \
    --rounds "$rounds" --duration "$duration" \
    --also "$dir/gpu-broker" --also "$dir/gpu-broker --admin-threads 0" || echo "part 1 rc=$?"
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== part 2: readers on a thread of the bench; A = before, B = after"
date -u +%FT%TZ
timeout 60 "$bench" --json --broker-bin "$dir/gpu-broker-before" abuse --phases 3 "${sizes[@]}" \
    --readers thread --arms 2 --rounds 2 --duration "$duration" \
    --also "$dir/gpu-broker" || echo "part 2 rc=$?"
date -u +%FT%TZ
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
