# Shared by the GPU checks (sourced, not run; scripts/gpu-all.sh is the harness): what the
# GPU machine is given, starting and stopping a broker there, tenants, and the steps.
#
#   GPU_OUT                      the folder of binaries and scripts (default .gpu/all, made
#                                by `scripts/gpu-all.sh build`)
#   gpu_stage OUT PROFILE        the binaries of target/PROFILE and the checks' own scripts
#                                into OUT (the build's release ones, or the dry run's debug)
#   gpu_python OUT DIR           unpacks OUT's wheel into DIR/py, onto PYTHONPATH
#   gpu_smi ARGS...              nvidia-smi ARGS
#   gpu_start OUT DIR FLAGS...   starts `gpu-broker --backend cuda` on DIR/b.sock with
#                                DIR/state and FLAGS; sets BROKER_PID, GPU_BROKER_ADDR and
#                                the array CTL (gpu-brokerctl with the admin token)
#   gpu_stop DIR                 stops it; fails when it exits badly or the log has a CUDA
#                                out-of-memory; prints the log's warnings
#   gpu_tenant NAME FLAGS...     sets NAME's quota (FLAGS of `quota set`), prints its token
#   gpu_step NAME CMD...         runs a step that needs the GPU; a failure prints
#                                `STEP FAILED: NAME` and is counted, the check goes on
#   gpu_result WHAT              the check's verdict: fails when a step failed
#
# GPU_DRY_RUN=1 (`scripts/gpu-all.sh dry-run`) runs a check without a GPU: the broker
# starts on the host backend (--headroom dropped), nvidia-smi is not called, and each step
# is checked instead of run (its program exists; a Python script parses); the rest (the
# broker's flags, the CLI calls, the order, the verdicts) runs as on the GPU.
# GPU_DRY_FAIL=NAME makes step NAME fail in a dry run (the harness's own test).
# Nothing here changes the card's settings.

GPU_OUT=${GPU_OUT:-.gpu/all}
GPU_FAILED=()

gpu_dry() { [[ ${GPU_DRY_RUN:-} == 1 ]]; }

# The programs a check runs, by where they come from (gpu_stage copies them).
GPU_BINS=(gpu-broker gpu-brokerctl gpu-worker gpu-broker-bench turn-gate)
GPU_SCRIPTS=(scripts/gpu-common.sh scripts/bench-ab.sh scripts/bench-ab-summary.py
    scripts/bench-syscalls.sh
    scripts/gpu_python_check.py scripts/gpu_python_fd_worker.py scripts/gpu_sleep_check.py
    scripts/gpu_serving_check.py scripts/gpu_restart_check.py
    scripts/gpu_mps_check.py scripts/gpu_legacy_forge.py examples/turn_step_worker.py)

gpu_stage() {
    local out=$1 profile=$2 b
    local target=${CARGO_TARGET_DIR:-target}
    # A dry run links what it runs in place (the debug binaries are large).
    local put=(cp -f)
    gpu_dry && put=(ln -sf) && target=$(realpath "$target")
    mkdir -p "$out"
    for b in "${GPU_BINS[@]}"; do "${put[@]}" "$target/$profile/$b" "$out/$b"; done
    "${put[@]}" "$(ls -t "$target/$profile"/build/gpu-broker-proto-*/out/gpubroker_descriptor.bin |
        head -n1)" "$out/gpubroker_descriptor.bin"
    cp -f "${GPU_SCRIPTS[@]}" "$out/"
}

gpu_python() {
    local out=$1 dir=$2
    gpu_dry && return 0
    local wheel
    wheel=$(ls "$out"/gpubroker-*.whl | head -n1)
    python3 -m zipfile -e "$wheel" "$dir/py"
    export PYTHONPATH="$dir/py${PYTHONPATH:+:$PYTHONPATH}"
}

gpu_smi() {
    if gpu_dry; then
        echo "dry-run: nvidia-smi $*"
        return 0
    fi
    nvidia-smi "$@"
}

# The card's memory in MiB (a dry run's host device: 16 GiB).
gpu_total_mib() {
    if gpu_dry; then echo 16384; else
        nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1
    fi
}

# A --headroom value that leaves about MIB MiB leasable on whatever card this is (less the
# memory outside the broker): the checks size their tenants for it, not for one card.
# The H200's 143,771 MiB less 124 GiB leaves 16,795 MiB; less 100 GiB, 41,371 MiB.
# Fails (assign it to a variable, so that `set -e` stops there) when nvidia-smi gives no
# size or the card is smaller than MIB.
gpu_headroom_leaving() {
    local total
    if gpu_dry; then echo 0MiB; return; fi # gpu_start drops it there
    total=$(gpu_total_mib)
    if [[ ! $total =~ ^[0-9]+$ ]] || ((total < $1)); then
        echo "gpu_headroom_leaving $1: the card's memory is '$total' MiB" >&2
        return 1
    fi
    echo "$((total - $1))MiB"
}

gpu_start() {
    local out=$1 dir=$2
    shift 2
    local flags=(--backend cuda "$@")
    if gpu_dry; then
        flags=(--backend host --host-capacity 16GiB)
        while (($#)); do
            if [[ $1 == --headroom ]]; then shift 2; else flags+=("$1"); shift; fi
        done
    fi
    "$out/gpu-broker" "${flags[@]}" --socket "$dir/b.sock" --state-dir "$dir/state" \
        --shutdown-grace 1s >"$dir/broker.log" 2>&1 &
    BROKER_PID=$!
    trap 'kill -TERM $BROKER_PID 2>/dev/null || true' EXIT
    local _
    for _ in $(seq 200); do
        [[ -S "$dir/b.sock" && -f "$dir/state/admin.token" ]] && break
        kill -0 "$BROKER_PID" 2>/dev/null || { cat "$dir/broker.log"; return 1; }
        sleep 0.05
    done
    CTL=("$out/gpu-brokerctl" --broker "unix://$dir/b.sock" --token-file "$dir/state/admin.token")
    export GPU_BROKER_ADDR="unix://$dir/b.sock"
}

gpu_stop() {
    local dir=$1 rc=0
    kill -TERM "$BROKER_PID"
    wait "$BROKER_PID" || { rc=$?; echo "broker exit status $rc"; tail -50 "$dir/broker.log"; }
    trap - EXIT
    if grep -q "OUT_OF_MEMORY" "$dir/broker.log"; then echo "CUDA OOM in the broker log"; rc=1; fi
    grep -E "WARN|ERROR" "$dir/broker.log" | tail -20 || true
    return "$rc"
}

gpu_tenant() {
    local name=$1
    shift
    "${CTL[@]}" quota set "$name" "$@" >/dev/null
    "${CTL[@]}" tokens issue "$name" 2>/dev/null
}

# Whether CMD can run here: its program exists (after `env` and its assignments), and a
# Python script given to python3 parses.
gpu_runnable() {
    while [[ $1 == env || $1 == *=* ]]; do shift; done
    local prog=$1
    if declare -F "$prog" >/dev/null; then return 0; fi
    if [[ $prog == */* ]]; then [[ -x $prog ]] || { echo "no program $prog"; return 1; }; else
        command -v "$prog" >/dev/null || { echo "no program $prog"; return 1; }
    fi
    if [[ $prog == python3 && ${2:-} == *.py ]]; then
        python3 -c 'import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])' "$2"
    fi
}

gpu_step() {
    local name=$1
    shift
    if gpu_dry; then
        if ! gpu_runnable "$@" || [[ ${GPU_DRY_FAIL:-} == "$name" ]]; then
            echo "STEP FAILED: $name"
            GPU_FAILED+=("$name")
        else
            echo "dry-run: $name: $*"
        fi
        return 0
    fi
    "$@" || { echo "STEP FAILED: $name"; GPU_FAILED+=("$name"); }
}

gpu_result() {
    if ((${#GPU_FAILED[@]})); then
        echo "=== $1: FAILED steps: ${GPU_FAILED[*]} ==="
        return 1
    fi
    echo "=== $1: every step passed ==="
}
