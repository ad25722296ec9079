#!/usr/bin/env bash
# The GPU machine's check of device health and identity: a healthy GPU reads healthy, its
# UUID is the driver's (as nvidia-smi prints it) and the NVML fields the health monitor
# watches are real readings.
#
#   scripts/gpu-health-check.sh run   # on the GPU machine, from the folder that
#                                     # `scripts/gpu-all.sh build` makes (GPU_OUT, default
#                                     # .gpu/all)
# It allocates nothing and never changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh
OUT=$GPU_OUT

# Every device the broker lists is healthy and has a UUID nvidia-smi lists, and the broker
# read NVML at start.
health_readings() {
    local json smi
    json=$("${CTL[@]}" --json devices)
    echo "$json"
    echo "--- NVML as the broker read it at start ---"
    grep "NVML: device" "$dir/broker.log" || { echo "no NVML reading in the broker log"; return 1; }
    if grep -q "NVML: device 0 .*: NVML error" "$dir/broker.log"; then echo "NVML error"; return 1; fi
    smi=$(nvidia-smi --query-gpu=uuid --format=csv,noheader)
    python3 - "$json" "$smi" <<'PY'
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
}

run() {
    dir=$(mktemp -d)
    gpu_start "$OUT" "$dir"
    gpu_dry || sleep 2 # one health round
    "${CTL[@]}" devices --wide
    gpu_step health-readings health_readings
    gpu_stop "$dir" || GPU_FAILED+=(broker)
    gpu_result "health check"
}

case ${1:-} in
    run) run ;;
    *) echo "usage: $0 run" >&2; exit 2 ;;
esac
