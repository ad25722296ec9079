#!/usr/bin/env bash
# Acquire latency while an admin client writes quotas, on the GPU machine's idle CPUs
# (host backend, no GPU used): `gpu-broker-bench quota-writes`, brokers side by side in
# each part, every arm of every broker in each run (interleaved).
#
#   scripts/gpu-quota-writes.sh build DIR [BEFORE_REV]   here: the release builds into DIR
#   scripts/gpu-quota-writes.sh DIR                      there (or here, as a dry run)
#
# DIR holds gpu-broker-bench and the brokers, release builds: gpu-broker (the one
# measured, B) and, optionally, gpu-broker-before (the broker to compare against, A) and
# gpu-broker-exp (an experimental build, one arm per word of EXP_ENVS: the environment
# that picks what it does, e.g. "GPB_X_QUOTA=one GPB_X_QUOTA=writer"). `build` makes
# gpu-broker and gpu-broker-bench from this checkout and, with BEFORE_REV, gpu-broker-before
# from that commit (a temporary worktree, built into this checkout's target directory),
# strips them and copies this script. Where gpu-broker has an operators' socket
# (`--admin-listen`), it is measured a second time with the admin loop on that socket (C:
# the operator's connection served wholly on the operators' runtime). The parts:
#   1. writer in a child process, state on disk, SetQuota and GetQuota (the control, at
#      the pace SetQuota reached)
#   2. writer as a task of the bench (as the first measurements)
#   3. state on tmpfs (fsync costs nothing there), writes capped at RATE a second (500)
#   4. state on disk, SetQuota and GetQuota capped at RATE a second, so every broker gets
#      the same pace
#   5. with gpu-broker-before: scripts/bench-ab.sh A B (throughput and latency, no writes)
#   6. with EXTRA=1: the broker's log at warn, and its runtime at 4 worker threads
# PARTS=burn runs one short part instead (~60 s): gpu-broker on its main socket and C (the
# admin loop on its operators' socket), writer process, state on disk, tight loop: set,
# get, and burn (the control for CPU busy elsewhere: a process that talks to nobody keeps
# as many cores busy as set added to the broker, `--op burn`).
# PARTS=arms runs the arms ARMS lists (below), each on its own operators' socket.
# PARTS=exp runs the experimental build's arms (EXP_ENVS), each on its own operators'
# socket, beside gpu-broker on its main and operators' sockets: set and get (EXP_OPS), tight
# loop.
# REPEAT (4), DURATION (1s), ROUNDS (3, part 5) scale it. Every part has its `timeout`.
set -euo pipefail
if [ "${1:-}" = build ]; then
    out=${2:?usage: $0 build DIR [BEFORE_REV]}
    mkdir -p "$out"
    target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
    # The before build first: the measured one's build then leaves its own binaries there.
    if [ -n "${3:-}" ]; then
        tree=$(mktemp -d /tmp/qw-before.XXXXXX)
        git worktree add --detach "$tree" "$3"
        (cd "$tree" && cargo build --release --target-dir "$target" -p gpu-broker --bin gpu-broker)
        cp -f "$target/release/gpu-broker" "$out/gpu-broker-before"
        git worktree remove --force "$tree"
    fi
    cargo build --release -p gpu-broker --bin gpu-broker -p gpu-broker-tests --bin gpu-broker-bench
    cp -f "$target/release/gpu-broker" "$out/gpu-broker"
    cp -f "$target/release/gpu-broker-bench" "$out/gpu-broker-bench"
    rm -f "$out/gpu-broker-exp"
    strip "$out"/gpu-broker* 2>/dev/null || true
    cp -f "$0" "$out/"
    for b in "$out"/gpu-broker*; do echo "$(basename "$b"): $(sha256sum "$b" | cut -c1-12)"; done
    du -sh "$out"
    exit 0
fi
dir=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
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
# The operators' socket of broker C (short: a socket path has at most 107 bytes).
ops=$(mktemp -d /tmp/qw-ops.XXXXXX)
trap 'rm -rf "$disk" "$tmpfs" "$ops"' EXIT
echo "machine: $(nproc) cores, $(uname -r); load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "state dirs: disk $(df -PT "$disk" | awk 'NR==2 {print $2, $1}'), tmpfs $(df -PT "$tmpfs" | awk 'NR==2 {print $2, $1}')"
# The first broker (A) is the one before where there is one; then the one measured; then
# the experimental arms.
first=$main
also=()
if [ -x "$before" ]; then
    first=$before
    also+=(--also "$main")
fi
if "$main" --help | grep -q -- --admin-listen; then
    also+=(--also "$main --admin-listen $ops/admin.sock")
fi
if [ -x "$exp" ]; then
    for e in ${EXP_ENVS:-}; do also+=(--also "$e $exp"); done
fi
for b in "$before" "$main" "$exp"; do
    [ -x "$b" ] && echo "$(basename "$b"): $(sha256sum "$b" | cut -c1-12)"
done
qw() { # qw NAME TIMEOUT TMPDIR ARGS...
    local name=$1 limit=$2 tmp=$3
    shift 3
    echo "== $name"
    date -u +%FT%TZ
    TMPDIR=$tmp timeout "$limit" "$bench" --json --broker-bin "$first" quota-writes \
        --repeat "$repeat" --duration "$duration" "$@" || echo "$name rc=$?"
    echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
}
if [ "${PARTS:-all}" = exp ]; then
    # The experimental build's arms, each with its admin loop on its own operators'
    # socket, beside gpu-broker on its main socket (A) and on its operators' socket (C).
    first=$main
    also=(--also "$main --admin-listen $ops/admin.sock")
    i=0
    for e in ${EXP_ENVS:-}; do
        i=$((i + 1))
        also+=(--also "$e $exp --admin-listen $ops/x$i.sock")
    done
    qw "part exp: writer process, disk, set and get, the experimental arms" 420 "$disk" \
        --writer process --op "${EXP_OPS:-set,get}" "${also[@]}"
    date -u +%FT%TZ
    exit 0
fi
if [ "${PARTS:-all}" = arms ]; then
    # Arms given whole, each on its own operators' socket, beside gpu-broker on its main
    # socket (A): ARMS is a ';'-separated list of "[NAME=value...] BIN [FLAGS...]", BIN a
    # file in DIR, '@' in a NAME=value standing for DIR (e.g. a preloaded allocator:
    # "LD_PRELOAD=@/libjemalloc.so.2 gpu-broker"). One arm twice tells the noise.
    first=$main
    also=()
    i=0
    IFS=';' read -ra specs <<<"${ARMS:?PARTS=arms needs ARMS}"
    for spec in "${specs[@]}"; do
        i=$((i + 1))
        words=()
        for w in $spec; do
            case $w in
            *=*) words+=("${w//@/$dir}") ;;
            *) [ -e "$dir/$w" ] && w=$dir/$w; words+=("$w") ;;
            esac
        done
        echo "arm $i (the bench's broker $i after A): $spec"
        also+=(--also "${words[*]} --admin-listen $ops/x$i.sock")
    done
    qw "part arms: writer process, disk, ${EXP_OPS:-set,get}, the arms" 540 "$disk" \
        --writer process --op "${EXP_OPS:-set,get}" "${also[@]}"
    date -u +%FT%TZ
    exit 0
fi
if [ "${PARTS:-all}" = burn ]; then
    first=$main
    also=(--also "$main --admin-listen $ops/admin.sock")
    qw "part burn: writer process, disk, set, get and burn (a CPU load alone)" 120 "$disk" \
        --writer process --op set,get,burn "${also[@]}"
    date -u +%FT%TZ
    exit 0
fi
qw "part 1: writer process, disk, set and get" 180 "$disk" \
    --writer process --op set,get ${also[@]+"${also[@]}"}
qw "part 2: writer task, disk" 90 "$disk" --writer task --op set ${also[@]+"${also[@]}"}
qw "part 3: writer process, tmpfs, at most $rate/s" 90 "$tmpfs" \
    --writer process --op set --rate "$rate" ${also[@]+"${also[@]}"}
qw "part 4: writer process, disk, set and get, at most $rate/s" 180 "$disk" \
    --writer process --op set,get --rate "$rate" ${also[@]+"${also[@]}"}
if [ -x "$before" ]; then
    echo "== part 5: no writes, A = before, B = measured (scripts/bench-ab.sh)"
    date -u +%FT%TZ
    ab=$here/bench-ab.sh
    [ -x "$ab" ] || ab=$PWD/scripts/bench-ab.sh
    ROUNDS=${ROUNDS:-3} OUT=$(mktemp -d) timeout 120 "$ab" "$bench" "$before" "$main" |
        grep -v '^{' || echo "part 5 rc=$?"
fi
if [ "${EXTRA:-0}" = 1 ]; then
    qw "part 6: writer process, disk, broker log warn / 4 runtime threads" 60 "$disk" \
        --writer process --op set,get \
        --also "GPU_BROKER_LOG=warn $main" --also "TOKIO_WORKER_THREADS=4 $main"
fi
date -u +%FT%TZ
