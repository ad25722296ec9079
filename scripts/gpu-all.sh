#!/usr/bin/env bash
# Every GPU check from ONE folder of release binaries, for a closing run in few device calls.
#
#   scripts/gpu-all.sh build [BEFORE]   # here (Rust, no GPU): everything into .gpu/all;
#                                       # BEFORE (a commit or tag, or GPU_ALL_BEFORE_REF): the
#                                       # previous release's broker and bench built beside it
#   scripts/gpu-all.sh run [PARTS]      # on the GPU machine (no Rust); PARTS is a comma list
#                                       # of fd,fd-ab,check,forge,shared,sleep,python,mps,host
#                                       # (default: all of them, in that order)
#
# The parts are the other scripts' runs, pointed at .gpu/all:
#   fd      scripts/gpu-fd-check.sh run        conformance, GPU e2e, another uid in its own
#                                              namespaces, Python recv_fds, fd-path benchmark
#   fd-ab   the CUDA broker side by side, interleaved (scripts/bench-ab.sh, AB_BACKEND=cuda):
#           A = the previous release (its bench and broker: build BEFORE), B = this build,
#           C = this build's bench against the previous broker (the client's share apart);
#           32-worker throughput, pooled latency (current-thread and default client), the
#           breakdown of a pooled lease + map (health Check floor, RPC, ticket, import+map,
#           raw cuMemCreate+map), medians and ratios to A; ROUNDS rounds (default 3)
#   check   scripts/gpu-check.sh run 0         Python fd worker, lease benchmark, gpu-broker-bench
#   forge   scripts/gpu-legacy-forge.sh run    why there are no legacy IPC handles
#   shared  scripts/gpu-shared-check.sh run    shared CUDA imports across tenants
#   sleep   scripts/gpu-sleep-check.sh run     sleep/wake (pinned vs pageable), PyTorch, reclaim
#   python  scripts/gpu-python-check.sh run    PyTorch on fd leases
#   mps     scripts/gpu-mps-check.sh run check,handoff   managed MPS and turn hand-off
#   host    the host backend on the machine's idle cores (no GPU): scripts/bench-ab.sh of
#           gpu-broker-before (if the build was given GPU_ALL_BEFORE=path of an older broker)
#           against gpu-broker, then quota-writes side by side (acquire p50/p99 alone and
#           while an admin client writes or reads quotas in a tight loop; gpu-broker also with
#           the loop on its operators' socket)
#   ab      the host backend only, brokers side by side: gpu-broker-before (if given), gpu-broker,
#           then every variant the build was given (GPU_ALL_VARIANTS="name=path ...": copied as
#           gpu-broker-variant-NAME, an experiment's build to ablate one cost), ROUNDS rounds
# Carry .gpu/all (the build prints its size: at most 64 MiB). Nothing here changes the
# card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_ALL_OUT:-.gpu/all}
TARGET=${CARGO_TARGET_DIR:-target}

# build_before REF: REF's broker and bench, built in a worktree of their own with this
# target directory (its dependencies are mostly this build's), copied out before this
# build overwrites them.
build_before() {
    local ref=$1 wt target
    target=$(realpath -m "$TARGET")
    wt=$(mktemp -d /tmp/gpu-all-before.XXXXXX)
    git worktree add --detach "$wt" "$ref"
    (cd "$wt" && CARGO_TARGET_DIR=$target cargo build --release -p gpu-broker -p gpu-broker-tests --bins) \
        || { git worktree remove --force "$wt"; return 1; }
    git worktree remove --force "$wt"
    mkdir -p "$OUT"
    cp -f "$target/release/gpu-broker" "$OUT/gpu-broker-before"
    cp -f "$target/release/gpu-broker-bench" "$OUT/gpu-broker-bench-before"
    strip "$OUT/gpu-broker-before" "$OUT/gpu-broker-bench-before" 2>/dev/null || true
    git rev-parse --short "$ref^{commit}" >"$OUT/before.ref"
}

build() {
    local before=${1:-${GPU_ALL_BEFORE_REF:-}}
    rm -f "$OUT/gpu-broker-bench-before" "$OUT/before.ref"
    [[ -n $before ]] && build_before "$before"
    GPU_BIN=$OUT scripts/gpu-fd-check.sh build
    cargo build --release -p gpu-broker-examples --bin turn-gate
    mkdir -p "$OUT/deps"
    ln -f "$OUT/gpu-test" "$OUT/deps/gpu-test"
    for b in gpu-broker-bench turn-gate; do cp -f "$TARGET/release/$b" "$OUT/$b"; done
    strip "$OUT"/gpu-broker-bench "$OUT"/turn-gate 2>/dev/null || true
    rm -f "$OUT"/gpubroker-*.whl
    cp -f "$(scripts/build-wheel.sh)" "$OUT/"
    if [[ -n ${GPU_ALL_BEFORE:-} ]]; then
        cp -f "$GPU_ALL_BEFORE" "$OUT/gpu-broker-before"
        strip "$OUT/gpu-broker-before" 2>/dev/null || true
    fi
    rm -f "$OUT"/gpu-broker-variant-* "$OUT/extra-brokers.tgz"
    local v
    for v in ${GPU_ALL_VARIANTS:-}; do
        cp -f "${v#*=}" "$OUT/gpu-broker-variant-${v%%=*}"
        strip "$OUT/gpu-broker-variant-${v%%=*}" 2>/dev/null || true
    done
    # The extra brokers travel compressed (a third of their size: the carry holds 64 MiB);
    # run unpacks them.
    local extra=()
    for v in "$OUT"/gpu-broker-before "$OUT"/gpu-broker-bench-before "$OUT"/gpu-broker-variant-*; do
        [[ -f $v ]] && extra+=("${v##*/}")
    done
    if [[ ${#extra[@]} -gt 0 ]]; then
        tar czf "$OUT/extra-brokers.tgz" -C "$OUT" "${extra[@]}"
        (cd "$OUT" && rm -f "${extra[@]}")
    fi
    cp -f scripts/bench-ab.sh scripts/bench-ab-summary.py "$OUT/"
    cp -f scripts/gpu_python_check.py scripts/gpu_sleep_check.py scripts/gpu_mps_check.py \
        examples/turn_step_worker.py "$OUT/"
    du -sh "$OUT"
}

host_ab() {
    local dir=$OUT results brokers=("$OUT/gpu-broker") b
    [[ -x $dir/gpu-broker-before ]] && brokers=("$dir/gpu-broker-before" "$dir/gpu-broker")
    results=$(mktemp -d)
    OUT=$results ROUNDS=${ROUNDS:-4} "$dir/bench-ab.sh" "$dir/gpu-broker-bench" "${brokers[@]}"
    # Quota writes side by side: every broker with its admin loop on the workers' socket,
    # and gpu-broker also with it on its operators' socket (--admin-listen), interleaved.
    local ops also=()
    ops=$(mktemp -d /tmp/ga-ops.XXXXXX)
    for b in "${brokers[@]:1}"; do also+=(--also "$b"); done
    also+=(--also "$dir/gpu-broker --admin-listen $ops/admin.sock")
    echo "quota-writes: ${brokers[*]}, then gpu-broker on its operators' socket"
    "$dir/gpu-broker-bench" --broker-bin "${brokers[0]}" --broker-log info quota-writes \
        --writer process --op set,get --repeat "${QW_REPEAT:-12}" --duration 0.6s "${also[@]}" |
        grep -v '^{'
    rm -rf "$ops"
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
        echo "fd-ab: A = previous release $(cat "$dir/before.ref" 2>/dev/null || echo '(given as a binary)'), B = this build, C = this bench against A's broker"
    else
        entries=("$dir/gpu-broker")
        echo "fd-ab: no previous release in the build (scripts/gpu-all.sh build BEFORE): this build alone"
    fi
    nvidia-smi --query-gpu=index,name,memory.used,driver_version --format=csv || true
    AB_BACKEND=cuda AB_BREAKDOWN=1 OUT=$(mktemp -d) ROUNDS=${ROUNDS:-3} \
        "$dir/bench-ab.sh" "$dir/gpu-broker-bench" "${entries[@]}" | grep -v '^{'
}

ab() {
    local dir=$OUT brokers=() b
    [[ -x $dir/gpu-broker-before ]] && brokers+=("$(before_entry)")
    brokers+=("$dir/gpu-broker")
    for b in "$dir"/gpu-broker-variant-*; do [[ -x $b ]] && brokers+=("$b"); done
    echo "ab: ${brokers[*]} (labels A, B, ... in that order)"
    for b in "${brokers[@]}"; do echo "$(sha256sum "$b" | cut -c1-16) $b"; done
    AB_BREAKDOWN=1 OUT=$(mktemp -d) ROUNDS=${ROUNDS:-7} "$dir/bench-ab.sh" "$dir/gpu-broker-bench" "${brokers[@]}"
}

run() {
    [[ -f $OUT/extra-brokers.tgz ]] && tar xzf "$OUT/extra-brokers.tgz" -C "$OUT"
    local parts=${1:-fd,fd-ab,check,forge,shared,sleep,python,mps,host} t0=$SECONDS failed=()
    local p
    for p in ${parts//,/ }; do
        echo "################ $p ################"
        case $p in
            fd) GPU_BIN=$OUT scripts/gpu-fd-check.sh run ;;
            fd-ab) fd_ab ;;
            check) GPU_BIN=$OUT scripts/gpu-check.sh run 0 ;;
            forge) GPU_BIN=$OUT scripts/gpu-legacy-forge.sh run ;;
            shared) GPU_SHARED_OUT=$OUT scripts/gpu-shared-check.sh run ;;
            sleep) GPU_SLEEP_OUT=$OUT scripts/gpu-sleep-check.sh run ;;
            python) GPU_PYTHON_OUT=$OUT scripts/gpu-python-check.sh run ;;
            mps) GPU_MPS_OUT=$OUT scripts/gpu-mps-check.sh run check,handoff ;;
            host) host_ab ;;
            ab) ab ;;
            *) echo "unknown part $p" >&2; exit 2 ;;
        esac || failed+=("$p")
    done
    echo "################ parts failed: ${failed[*]:-none} (in $((SECONDS - t0)) s) ################"
    [[ ${#failed[@]} -eq 0 ]]
}

case ${1:-} in
    build) shift; build "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 build [BEFORE] | run [PARTS]" >&2; exit 2 ;;
esac
