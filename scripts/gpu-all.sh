#!/usr/bin/env bash
# The GPU harness: every GPU check from ONE folder of release binaries, in few device calls.
#
#   scripts/gpu-all.sh build [BEFORE]   # here (Rust, no GPU): everything into .gpu/all;
#                                       # BEFORE (a commit or tag, or GPU_ALL_BEFORE_REF): the
#                                       # previous release's broker and bench built beside it
#                                       # (or GPU_ALL_BEFORE, GPU_ALL_BEFORE_BENCH: binaries built earlier)
#   scripts/gpu-all.sh run [PARTS]      # on the GPU machine (no Rust); PARTS is a comma list
#                                       # (default: fd,fd-ab,check,forge,shared,sleep,python,serving,mps,health,restart,probe,host)
#   scripts/gpu-all.sh dry-run [PARTS]  # here, no GPU: the same parts on the host backend
#                                       # with the debug binaries (GPU_ALL_BIN, default
#                                       # target/debug), each GPU step checked, not run;
#                                       # the test suite runs it (tests/e2e/gpu_harness.rs)
#
# The parts (each script's header says what it checks):
#   fd      scripts/gpu-fd-check.sh        conformance, GPU e2e, another uid in its own
#                                          namespaces, Python recv_fds, fd-path benchmark
#   fd-ab   the CUDA broker side by side, interleaved (scripts/bench-ab.sh, AB_BACKEND=cuda):
#           A = the previous release (its bench and broker: build BEFORE), B = this build,
#           C = this build's bench against the previous broker (the client's share apart),
#           D = the previous release serving legacy IPC handles (--legacy-ipc-handles: the
#           path its closing run measured, before fd tickets were the only kind);
#           32-worker throughput, pooled latency (current-thread and default client), the
#           breakdown of a pooled lease + map (health Check floor, RPC, ticket, import+map,
#           raw cuMemCreate+map), medians and ratios to A; ROUNDS rounds (default 3);
#           then system calls per pooled pair of A and B, broker and client apart
#           (scripts/bench-syscalls.sh, where strace is installed)
#   check   scripts/gpu-check.sh           Python fd worker, lease benchmark, gpu-broker-bench
#   forge   scripts/gpu-legacy-forge.sh    why there are no legacy IPC handles
#   shared  scripts/gpu-shared-check.sh    shared CUDA imports across tenants; memory a worker
#                                          handed to a child stays charged until the child exits
#   sleep   scripts/gpu-sleep-check.sh     sleep/wake (pinned vs pageable), PyTorch, reclaim
#   python  scripts/gpu-python-check.sh    PyTorch on fd leases
#   serving scripts/gpu-serving-check.sh   inference servers on leases: quotas without stalls,
#                                          side-stream blocks, CUDA graphs and a decode
#                                          benchmark, torch.multiprocessing, torch_memory_saver
#   mps     scripts/gpu-mps-check.sh check,external,handoff   managed MPS, the daemon in its
#                                          own unit through broker restarts, turn hand-off
#   health  scripts/gpu-health-check.sh    device health, UUIDs and NVML readings
#   restart scripts/gpu-restart-check.sh  a broker SIGKILL + restart with a keeper: 10,000
#                                          live leases (restart to serving), PyTorch training
#                                          stepping through it, quota enforced after
#   probe   scripts/gpu-throughput-probe.sh  pooled latency and 32-worker pairs/s of a fresh broker
#                                          and of the same broker after other work, default log
#                                          level and warn, side by side
#   pybench scripts/gpu-python-bench.sh    the PyTorch allocator against PyTorch's own,
#                                          interleaved (not in the default parts: minutes)
#   host    the host backend on the machine's idle cores (no GPU): scripts/bench-ab.sh of
#           gpu-broker-before (if the build was given GPU_ALL_BEFORE=path of an older broker)
#           against gpu-broker, then quota-writes side by side (acquire p50/p99 alone and
#           while an admin client writes or reads quotas in a tight loop; gpu-broker also with
#           the loop on its operators' socket)
#   ab      the host backend only, brokers side by side: gpu-broker-before (if given), gpu-broker,
#           then every variant the build was given (GPU_ALL_VARIANTS="name=path ...": copied as
#           gpu-broker-variant-NAME, an experiment's build to ablate one cost), ROUNDS rounds
# A part fails when one of its steps does; the last line names the failed parts.
# Carry .gpu/all (the build prints its size: at most 64 MiB). Nothing here changes the
# card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_ALL_OUT:-.gpu/all}
TARGET=${CARGO_TARGET_DIR:-target}
ALL_PARTS=fd,fd-ab,check,forge,shared,sleep,python,serving,mps,health,restart,probe,host
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh

exe_of() { sed -n "s/.*\"name\":\"$1\".*\"executable\":\"\([^\"]*\)\".*/\1/p" | tail -n1; }

# build_before REF: REF's broker and bench, built in a worktree of their own with this
# target directory (its dependencies are mostly this build's), copied out before this
# build overwrites them.
build_before() {
    local ref=$1 wt target
    target=$(realpath -m "$TARGET")
    wt=$(mktemp -d -t gpu-all-before.XXXXXX)
    git worktree add --detach "$wt" "$ref"
    (cd "$wt" && CARGO_TARGET_DIR=$target cargo build --release -p gpu-broker -p gpu-broker-tests --bins) \
        || { git worktree remove --force "$wt"; return 1; }
    git worktree remove --force "$wt"
    mkdir -p "$OUT"
    cp -f "$target/release/gpu-broker" "$OUT/gpu-broker-before"
    cp -f "$target/release/gpu-broker-bench" "$OUT/gpu-broker-bench-before"
    strip "$OUT/gpu-broker-before" "$OUT/gpu-broker-bench-before" 2>/dev/null || true
    git rev-parse --short "$ref^{commit}" >"$OUT/before.ref"
    # Its workspace crates share this build's artifact names, and cargo takes them as fresh
    # when this tree's sources are older than they are: remove them so this build rebuilds.
    local pkgs
    pkgs=$(cargo metadata --no-deps --format-version 1 |
        python3 -c 'import json,sys; print(" ".join("-p " + p["name"] for p in json.load(sys.stdin)["packages"]))')
    # shellcheck disable=SC2086
    CARGO_TARGET_DIR=$target cargo clean --release $pkgs
}

build() {
    local before=${1:-${GPU_ALL_BEFORE_REF:-}}
    rm -f "$OUT/gpu-broker-bench-before" "$OUT/before.ref"
    if [[ -n $before ]]; then build_before "$before"; fi
    cargo build --release -p gpu-broker -p gpu-brokerctl -p gpu-broker-tests \
        -p gpu-broker-examples --bins
    local t c e
    t=$(cargo test --release -p gpu-broker-tests --test gpu --no-run --message-format=json | exe_of gpu)
    c=$(cargo test --release -p gpu-broker --test cuda_conformance --no-run --message-format=json | exe_of cuda_conformance)
    e=$(cargo build --release -p gpu-broker-client --features cuda --example cuda_fd_check --message-format=json | exe_of cuda_fd_check)
    [[ -n "$t" && -n "$c" && -n "$e" ]] || { echo "cannot find the test executables" >&2; exit 1; }
    gpu_stage "$OUT" release
    cp -f "$t" "$OUT/gpu-test"
    cp -f "$c" "$OUT/cuda_conformance"
    cp -f "$e" "$OUT/cuda_fd_check"
    strip "${GPU_BINS[@]/#/$OUT/}" "$OUT"/gpu-test "$OUT"/cuda_conformance "$OUT"/cuda_fd_check \
        2>/dev/null || true
    rm -f "$OUT"/gpubroker-*.whl
    cp -f "$(scripts/build-wheel.sh)" "$OUT/"
    scripts/gpu-serving-check.sh fetch-memory-saver "$OUT"
    if [[ -n ${GPU_ALL_BEFORE:-} ]]; then
        cp -f "$GPU_ALL_BEFORE" "$OUT/gpu-broker-before"
        strip "$OUT/gpu-broker-before" 2>/dev/null || true
    fi
    # Its bench too, where the previous release was built apart (build-before).
    if [[ -n ${GPU_ALL_BEFORE_BENCH:-} ]]; then
        cp -f "$GPU_ALL_BEFORE_BENCH" "$OUT/gpu-broker-bench-before"
        strip "$OUT/gpu-broker-bench-before" 2>/dev/null || true
    fi
    rm -f "$OUT"/gpu-broker-variant-* "$OUT/extra-brokers.tgz" "$OUT/binaries.tgz"
    local v
    for v in ${GPU_ALL_VARIANTS:-}; do
        cp -f "${v#*=}" "$OUT/gpu-broker-variant-${v%%=*}"
        strip "$OUT/gpu-broker-variant-${v%%=*}" 2>/dev/null || true
    done
    # Every executable travels compressed (about a third of its size: a device call carries
    # 64 MiB); run unpacks them.
    local bins=()
    for v in "$OUT"/*; do
        [[ -f $v && -x $v ]] && head -c 4 "$v" | grep -q ELF && bins+=("${v##*/}")
    done
    tar czf "$OUT/binaries.tgz" -C "$OUT" "${bins[@]}"
    (cd "$OUT" && rm -f "${bins[@]}")
    du -sh "$OUT"
}

host_ab() {
    local dir=$OUT results brokers=("$OUT/gpu-broker") b
    [[ -x $dir/gpu-broker-before ]] && brokers=("$dir/gpu-broker-before" "$dir/gpu-broker")
    results=$(mktemp -d)
    gpu_step bench-ab env OUT="$results" ROUNDS="${ROUNDS:-4}" \
        "$dir/bench-ab.sh" "$dir/gpu-broker-bench" "${brokers[@]}"
    # Quota writes side by side: every broker with its admin loop on the workers' socket,
    # and gpu-broker also with it on its operators' socket (--admin-listen), interleaved.
    local ops also=()
    ops=$(mktemp -d -t ga-ops.XXXXXX)
    for b in "${brokers[@]:1}"; do also+=(--also "$b"); done
    also+=(--also "$dir/gpu-broker --admin-listen $ops/admin.sock")
    echo "quota-writes: ${brokers[*]}, then gpu-broker on its operators' socket"
    gpu_step quota-writes "$dir/gpu-broker-bench" --broker-bin "${brokers[0]}" --broker-log info \
        quota-writes --writer process --op set,get --repeat "${QW_REPEAT:-12}" --duration 0.6s \
        "${also[@]}"
    rm -rf "$ops"
    gpu_result host
}

# The previous release as bench-ab.sh takes it: with its own bench where it was built so.
before_entry() {
    local dir=$OUT
    if [[ -x $dir/gpu-broker-bench-before ]]; then
        echo "$dir/gpu-broker-bench-before::$dir/gpu-broker-before"
    else
        echo "$dir/gpu-broker-before"
    fi
}

fd_ab() {
    local dir=$OUT entries=()
    if [[ -x $dir/gpu-broker-before ]]; then
        entries=("$(before_entry)" "$dir/gpu-broker" "$dir/gpu-broker-bench::$dir/gpu-broker-before")
        # D only for a release that still has the flag.
        "$dir/gpu-broker-before" --help 2>/dev/null | grep -q -- --legacy-ipc-handles &&
            entries+=("$(before_entry) --legacy-ipc-handles")
        echo "fd-ab: A = previous release $(cat "$dir/before.ref" 2>/dev/null || echo '(given as a binary)'), B = this build, C = this bench against A's broker, D (where it has the flag) = A serving legacy IPC handles"
    else
        entries=("$dir/gpu-broker")
        echo "fd-ab: no previous release in the build (scripts/gpu-all.sh build BEFORE): this build alone"
    fi
    gpu_smi --query-gpu=index,name,memory.used,driver_version --format=csv || true
    gpu_step fd-ab env AB_BACKEND=cuda AB_BREAKDOWN=1 AB_JSON=0 OUT="$(mktemp -d)" ROUNDS="${ROUNDS:-3}" \
        "$dir/bench-ab.sh" "$dir/gpu-broker-bench" "${entries[@]}"
    # System calls per pooled pair, broker and client apart, of A and B (where strace is).
    if command -v strace >/dev/null || gpu_dry; then
        gpu_step fd-ab-syscalls env AB_BACKEND=cuda "$dir/bench-syscalls.sh" "$dir/gpu-broker-bench" \
            "${entries[@]:0:2}"
    else
        echo "fd-ab: no strace on this machine: system calls per pair not counted"
    fi
    gpu_result fd-ab
}

ab() {
    local dir=$OUT brokers=() b
    [[ -x $dir/gpu-broker-before ]] && brokers+=("$(before_entry)")
    brokers+=("$dir/gpu-broker")
    for b in "$dir"/gpu-broker-variant-*; do [[ -x $b ]] && brokers+=("$b"); done
    echo "ab: ${brokers[*]} (labels A, B, ... in that order)"
    for b in "${brokers[@]}"; do echo "$(sha256sum "$b" | cut -c1-16) $b"; done
    gpu_step bench-ab env AB_BREAKDOWN=1 OUT="$(mktemp -d)" ROUNDS="${ROUNDS:-7}" \
        "$dir/bench-ab.sh" "$dir/gpu-broker-bench" "${brokers[@]}"
    gpu_result ab
}

# The script of a part and its arguments.
part_command() {
    case $1 in
        fd) echo scripts/gpu-fd-check.sh run ;;
        fd-ab) echo fd_ab ;;
        check) echo scripts/gpu-check.sh run ;;
        forge) echo scripts/gpu-legacy-forge.sh run ;;
        shared) echo scripts/gpu-shared-check.sh run ;;
        sleep) echo scripts/gpu-sleep-check.sh run ;;
        python) echo scripts/gpu-python-check.sh run ;;
        serving) echo scripts/gpu-serving-check.sh run ;;
        mps) echo scripts/gpu-mps-check.sh run check,external,handoff ;;
        health) echo scripts/gpu-health-check.sh run ;;
        restart) echo scripts/gpu-restart-check.sh run ;;
        probe) echo scripts/gpu-throughput-probe.sh run ;;
        pybench) echo scripts/gpu-python-bench.sh run ;;
        host) echo host_ab ;;
        ab) echo ab ;;
        *) return 1 ;;
    esac
}

run() {
    [[ -f $OUT/binaries.tgz ]] && tar xzf "$OUT/binaries.tgz" -C "$OUT"
    local parts=${1:-$ALL_PARTS} t0=$SECONDS failed=() p
    # Every part is known before any runs.
    for p in ${parts//,/ }; do
        part_command "$p" >/dev/null || { echo "unknown part $p (parts: $ALL_PARTS,pybench,ab)" >&2; exit 2; }
    done
    for p in ${parts//,/ }; do
        echo "################ $p ################"
        # shellcheck disable=SC2046
        (export GPU_OUT=$OUT; $(part_command "$p")) || failed+=("$p")
    done
    echo "################ parts failed: ${failed[*]:-none} (in $((SECONDS - t0)) s) ################"
    [[ ${#failed[@]} -eq 0 ]]
}

# The dry run's folder: the debug binaries and the scripts, and stand-ins for what only the
# release build makes (the test executables; the wheel is not needed: no Python step runs).
dry_run() {
    export GPU_DRY_RUN=1
    OUT=$(mktemp -d -t gpu-dry.XXXXXX)
    # Every check's temporary folders go with it.
    export TMPDIR=$OUT/tmp
    mkdir "$TMPDIR"
    local bins=${GPU_ALL_BIN:-$TARGET/debug} f
    CARGO_TARGET_DIR=${bins%/*} gpu_stage "$OUT" "${bins##*/}"
    for f in gpu-test cuda_conformance cuda_fd_check; do
        printf '#!/bin/sh\necho "stand-in for %s (scripts/gpu-all.sh build makes it)"\n' "$f" >"$OUT/$f"
        chmod +x "$OUT/$f"
    done
    trap 'rm -rf "$OUT"' EXIT
    run "$@"
}

case ${1:-} in
    build) shift; build "$@" ;;
    run) shift; run "$@" ;;
    dry-run) shift; dry_run "$@" ;;
    *) echo "usage: $0 build [BEFORE] | run [PARTS] | dry-run [PARTS]" >&2; exit 2 ;;
esac
