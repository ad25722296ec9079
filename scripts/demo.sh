#!/usr/bin/env bash
# Starts a broker on the simulated device, makes a tenant, takes a lease from one process,
# reads it from another, shows what the operator sees, and shuts the broker down.
# Needs only the Rust toolchain. Everything lives in a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --workspace --bins
BIN=${CARGO_TARGET_DIR:-target}/debug
DIR=$(mktemp -d /tmp/gpu-broker-demo.XXXXXX)
SOCK=$DIR/broker.sock
cleanup() {
    [[ -n "${WRITER:-}" ]] && kill "$WRITER" 2>/dev/null || true
    [[ -n "${BROKER:-}" ]] && kill -TERM "$BROKER" 2>/dev/null && wait "$BROKER" 2>/dev/null || true
    rm -rf "$DIR"
}
trap cleanup EXIT

echo "== starting gpu-broker on the simulated device (log: $DIR/broker.log)"
"$BIN/gpu-broker" --backend host --host-capacity 4GiB --socket "$SOCK" \
    --state-dir "$DIR/state" >"$DIR/broker.log" 2>&1 &
BROKER=$!
for _ in $(seq 100); do [[ -S $SOCK ]] && break; sleep 0.05; done
CTL=("$BIN/gpu-brokerctl" --broker "unix://$SOCK" --token-file "$DIR/state/admin.token")

echo "== operator: a tenant with a 1 GiB quota, and a token for it"
"${CTL[@]}" quota set demo --limit 1GiB --max-leases 8
export GPU_BROKER_ADDR="unix://$SOCK"
GPU_BROKER_TOKEN=$("${CTL[@]}" tokens issue demo 2>/dev/null)
export GPU_BROKER_TOKEN

echo "== worker: lease 64 MiB and fill it with 0xAB (examples/writer.rs)"
"$BIN/writer" --bytes 64MiB --pattern 0xAB >"$DIR/writer.out" 2>/dev/null &
WRITER=$!
for _ in $(seq 100); do grep -q lease_id "$DIR/writer.out" 2>/dev/null && break; sleep 0.05; done
cat "$DIR/writer.out"
LEASE=$(sed -n 's/.*lease_id=\([^ ]*\).*/\1/p' "$DIR/writer.out")

echo "== operator view"
"${CTL[@]}" leases list
"${CTL[@]}" devices

echo "== another process reads the lease (examples/reader.rs)"
"$BIN/reader" --lease "$LEASE"

echo "== worker releases; the tenant holds nothing; broker shuts down (SIGTERM)"
kill -INT "$WRITER"; wait "$WRITER" || true; WRITER=
"${CTL[@]}" tenants list
held=$("${CTL[@]}" --json tenants list | python3 -c 'import json,sys; print(sum(t["usage"]["held_bytes"] for t in json.load(sys.stdin)))')
kill -TERM "$BROKER"; status=0; wait "$BROKER" || status=$?; BROKER=
echo "bytes still leased: $held; broker exit status: $status"
[[ $held == 0 && $status == 0 ]]
