# Shared by the GPU check scripts (sourced, not run): building what the GPU machine needs,
# and starting a CUDA broker there.
#
#   gpu_build OUT FILE...        here (Rust): release gpu-broker, gpu-brokerctl, gpu-worker
#                                (stripped) and the abi3 wheel into OUT, and the FILEs (the
#                                check's own scripts); carry OUT to the GPU run
#   gpu_python OUT DIR           there: unpacks OUT's wheel into DIR/py, onto PYTHONPATH
#   gpu_start OUT DIR FLAGS...   there: starts `gpu-broker --backend cuda` on DIR/b.sock
#                                with DIR/state and FLAGS; sets BROKER_PID, GPU_BROKER_ADDR
#                                and the array CTL (gpu-brokerctl with the admin token)
#   gpu_stop DIR                 stops it (its log's tail if it exits badly), then prints
#                                the log's warnings
# Nothing here changes the card's settings.

gpu_build() {
    local out=$1
    shift
    local target=${CARGO_TARGET_DIR:-target}
    mkdir -p "$out"
    rm -f "$out"/gpubroker-*.whl
    cargo build --release -p gpu-broker --bin gpu-broker -p gpu-brokerctl --bin gpu-brokerctl \
        -p gpu-broker-tests --bin gpu-worker
    # The wheel users install (scripts/build-wheel.sh; the release profile strips it).
    cp -f "$(scripts/build-wheel.sh)" "$out/"
    local b
    for b in gpu-broker gpu-brokerctl gpu-worker; do cp -f "$target/release/$b" "$out/$b"; done
    strip "$out"/gpu-broker "$out"/gpu-brokerctl "$out"/gpu-worker 2>/dev/null || true
    [[ $# -eq 0 ]] || cp -f "$@" "$out/"
    du -sh "$out"
}

gpu_python() {
    local out=$1 dir=$2
    local wheel
    wheel=$(ls "$out"/gpubroker-*.whl | head -n1)
    python3 -m zipfile -e "$wheel" "$dir/py"
    export PYTHONPATH="$dir/py${PYTHONPATH:+:$PYTHONPATH}"
}

gpu_start() {
    local out=$1 dir=$2
    shift 2
    "$out/gpu-broker" --backend cuda --socket "$dir/b.sock" --state-dir "$dir/state" \
        --shutdown-grace 1s "$@" >"$dir/broker.log" 2>&1 &
    BROKER_PID=$!
    trap 'kill -TERM $BROKER_PID 2>/dev/null || true' EXIT
    local _
    for _ in $(seq 100); do [[ -S "$dir/b.sock" ]] && break; sleep 0.1; done
    CTL=("$out/gpu-brokerctl" --broker "unix://$dir/b.sock" --token-file "$dir/state/admin.token")
    export GPU_BROKER_ADDR="unix://$dir/b.sock"
}

gpu_stop() {
    local dir=$1
    kill -TERM "$BROKER_PID"
    wait "$BROKER_PID" || { echo "broker exit status $?"; tail -50 "$dir/broker.log"; }
    trap - EXIT
    grep -E "WARN|ERROR" "$dir/broker.log" | tail -20 || true
}
