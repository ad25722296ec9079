"""Medians and ratios to broker A of the runs scripts/bench-ab.sh recorded (JSON lines)."""

import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
# Each invocation prints its runs and then their summary: keep the runs.
rows = [r for r in rows if "summary" not in r]
for r in rows:
    # The broker's CPU time per pair (us): what the broker costs, whatever else runs.
    if r["mode"] == "throughput" and r.get("broker_cpu_cores") and r.get("pairs_per_s"):
        r["broker_cpu_us_per_pair"] = r["broker_cpu_cores"] * 1e6 / r["pairs_per_s"]
brokers = sorted({r["broker"] for r in rows})


def values(broker, mode, call, key):
    return [
        r[key]
        for r in rows
        if r["broker"] == broker and r["mode"] == mode and r.get("call") == call and key in r
    ]


for mode, call, keys in [
    ("throughput", None, ["pairs_per_s", "pair_p50_us", "pair_p99_us", "broker_cpu_cores", "broker_cpu_us_per_pair"]),
    ("latency", "acquire", ["p50_us", "p99_us"]),
    ("latency", "release", ["p50_us", "p99_us"]),
]:
    for k in keys:
        med = {b: statistics.median(values(b, mode, call, k)) for b in brokers if values(b, mode, call, k)}
        if "A" not in med:
            continue
        parts = [f"{b} {med[b]:.2f} {[round(v, 2) for v in values(b, mode, call, k)]}" for b in med]
        ratios = " ".join(f"{b}/A {med[b] / med['A']:.3f}" for b in med if b != "A")
        print(f"{mode} {call or ''} {k}: " + "  ".join(parts) + "  " + ratios)
