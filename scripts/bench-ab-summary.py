"""Medians and ratios to entry A of the runs scripts/bench-ab.sh recorded (JSON lines)."""

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


def values(broker, match, key):
    return [r[key] for r in rows if r["broker"] == broker and match(r) and key in r]


def line(title, match, key):
    med = {b: statistics.median(values(b, match, key)) for b in brokers if values(b, match, key)}
    if not med:
        return
    parts = [f"{b} {med[b]:.2f} {[round(v, 2) for v in values(b, match, key)]}" for b in med]
    ratios = ""
    if "A" in med and med["A"]:
        ratios = " ".join(f"{b}/A {med[b] / med['A']:.3f}" for b in med if b != "A")
    print(f"{title} {key}: " + "  ".join(parts) + "  " + ratios)


for mode, call, tag, keys in [
    ("throughput", None, None, ["pairs_per_s", "pair_p50_us", "pair_p99_us", "broker_cpu_cores", "broker_cpu_us_per_pair"]),
    ("latency", "acquire", "t1", ["p50_us", "p99_us"]),
    ("latency", "release", "t1", ["p50_us", "p99_us"]),
    ("latency", "acquire", "t2", ["p50_us", "p99_us"]),
]:
    for k in keys:
        title = f"{mode} {call or ''} {'' if tag is None else ('current-thread' if tag == 't1' else 'two-thread')}"
        line(title.strip(), lambda r, m=mode, c=call, t=tag: r["mode"] == m and r.get("call") == c and (t is None or r.get("tag", "t1" if m == "latency" else "t2") == t), k)

# The breakdown: every part's p50 and its ratio to the health Check of the same run and to
# the raw baseline, per worker count and ticket way.
parts = []
for r in rows:
    if r["mode"] == "breakdown" and "workers" in r:
        key = (r["workers"], r.get("tickets", "library"), r["part"])
        if key not in parts:
            parts.append(key)
for w, t, p in parts:
    m = lambda r, w=w, t=t, p=p: r["mode"] == "breakdown" and r.get("workers") == w and r.get("tickets", "library") == t and r["part"] == p
    for k in (["p50_us", "over_check", "over_raw"] if p in ("mmap", "import+map") or p.startswith("lease+map") else ["p50_us", "over_check"]):
        line(f"breakdown {w} workers, tickets {t}, {p}", m, k)
    if p == "health Check":
        line(f"breakdown {w} workers, tickets {t}, loops", m, "loops_per_s")
line("breakdown raw", lambda r: r["mode"] == "breakdown" and r["part"] == "raw", "p50_us")
