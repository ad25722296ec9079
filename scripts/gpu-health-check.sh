#!/usr/bin/env bash
# The GPU machine's check of device health and identity: a healthy GPU reads healthy, its
# UUID is the driver's (as nvidia-smi prints it) and the NVML fields the health monitor
# watches are real readings. Uses the release binaries of scripts/gpu-fd-check.sh build
# (.gpu/fd). Run on the GPU machine: scripts/gpu-health-check.sh
# It allocates nothing and never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_HEALTH_BIN:-.gpu/fd}
dir=$(mktemp -d)
"$OUT/gpu-broker" --backend cuda --socket "$dir/b.sock" --state-dir "$dir/state" \
    --shutdown-grace 1s >"$dir/broker.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do [[ -S $dir/b.sock && -f $dir/state/admin.token ]] && break; sleep 0.1; done
CTL=("$OUT/gpu-brokerctl" --broker "unix://$dir/b.sock" --token-file "$dir/state/admin.token")
sleep 2 # one health round
"${CTL[@]}" devices --wide
json=$("${CTL[@]}" --json devices)
echo "$json"
echo "--- NVML as the broker read it at start ---"
grep "NVML: device" "$dir/broker.log" || { echo "FAIL: no NVML reading in the broker log"; exit 1; }
fail=0
smi=$(nvidia-smi --query-gpu=uuid --format=csv,noheader)
python3 - "$json" "$smi" <<'PY' || fail=1
import json, sys
devices = json.loads(sys.argv[1])
devices = devices.get("devices", devices) if isinstance(devices, dict) else devices
smi = [l.strip() for l in sys.argv[2].splitlines() if l.strip()]
ok = True
for d in devices:
    i = d.get("index")
    print(f"device {i}: uuid {d.get('uuid')} model {d.get('model')!r} unhealthy {d.get('unhealthy')} reason {d.get('health_reason')!r}")
    if d.get("unhealthy"):
        print(f"FAIL: device {i} reads unhealthy"); ok = False
    if d.get("uuid") not in smi:
        print(f"FAIL: device {i} uuid {d.get('uuid')} is not one nvidia-smi lists {smi}"); ok = False
if len(devices) != len(smi):
    print(f"FAIL: {len(devices)} devices, nvidia-smi lists {len(smi)}"); ok = False
sys.exit(0 if ok else 1)
PY
if grep -q "NVML: device 0 .*: NVML error" "$dir/broker.log"; then echo "FAIL: NVML error"; fail=1; fi
[[ $fail == 0 ]] && echo "PASS: every GPU reads healthy with the driver's UUID and real NVML fields" || { echo "FAIL"; exit 1; }
