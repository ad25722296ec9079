#!/usr/bin/env bash
# Host-backend brokers side by side on the GPU machine's idle cores, with what a timing
# alone does not say: how the broker's threads are scheduled per acquire+release pair under
# the 32-worker throughput mode, its system calls, and where its CPU goes. That machine has
# no strace or perf: the build carries this machine's (with their libraries and loader).
#
#   scripts/gpu-profile-ab.sh build BENCH NAME=BROKER [NAME=BROKER ...]   # here
#   scripts/gpu-profile-ab.sh run [PARTS]                                 # there
#
# Carry .gpu/prof (the build prints its size; GPU_PROF_TOOLS=0 at the build leaves strace and
# perf out, for the ab and sched parts only). PARTS (default ab,sched,strace,perf):
#   ab      scripts/bench-ab.sh (throughput and one worker's pooled latency), ROUNDS rounds
#   sched   SCHED_ROUNDS runs of each broker in the throughput mode (6 s); between 3 s and
#           6 s after the start the broker's threads' context switches (voluntary, forced),
#           time spent runnable but waiting for a CPU and on a CPU (/proc/PID/task/*/
#           schedstat), per pair
#   strace  scripts/bench-contention.sh (system calls a pair, `strace -f -c`), one round
#   perf    a 3 s `perf record -e cpu-clock` of each broker in the same mode: the share of
#           its samples by object (kernel, broker, libc) and the top symbols (a stripped
#           broker's own are not named; the kernel's and the C library's are)
#   stacks  where the broker's threads call `futex` and `sched_yield` and go to sleep
#           (`sched_switch`) in the same mode: 1.5 s of `perf record` on those tracepoints
#           (every event: perf takes no sample period for them) with DWARF call chains; per
#           pair, by the first four frames outside the standard library (give brokers with
#           their symbols, `CARGO_PROFILE_RELEASE_STRIP=false`, for names)
# Nothing here uses a GPU or changes the card's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_PROF_OUT:-.gpu/prof}

build() {
    local bench=$1 v names=()
    shift
    rm -rf "$OUT" && mkdir -p "$OUT/brokers"
    cp -f "$bench" "$OUT/gpu-broker-bench"
    for v in "$@"; do
        cp -f "${v#*=}" "$OUT/brokers/${v%%=*}"
        names+=("${v%%=*}")
        echo "$(sha256sum "${v#*=}" | cut -c1-16) ${v%%=*} (${v#*=})"
    done
    printf '%s\n' "${names[@]}" >"$OUT/brokers/order"
    tar czf "$OUT/brokers.tgz" -C "$OUT" brokers && rm -rf "$OUT/brokers"
    # The tools with every library they load and the loader itself, run through that loader
    # there (so that machine's own C library is not mixed in); GPU_PROF_TOOLS=0 leaves them
    # out (the ab and sched parts need none).
    cp -f scripts/bench-ab.sh scripts/bench-ab-summary.py scripts/bench-contention.sh \
        scripts/cost-common.sh "$OUT/"
    if [[ ${GPU_PROF_TOOLS:-1} == 0 ]]; then
        du -sh "$OUT"
        return
    fi
    local t
    t=$(mktemp -d)
    mkdir -p "$t/tools/lib"
    for b in strace perf; do
        cp -f "$(command -v $b)" "$t/tools/$b.real"
        ldd "$(command -v $b)" | awk '/=>/ {print $3} /ld-linux/ {print $1}' |
            while read -r l; do cp -Lf "$l" "$t/tools/lib/"; done
    done
    tar czf "$OUT/tools.tgz" -C "$t" tools && rm -rf "$t"
    du -sh "$OUT"
}

# The tools' wrappers, on PATH.
tools() {
    local d=$OUT/tools b
    [[ -f $OUT/tools.tgz ]] || { echo "no tools carried (GPU_PROF_TOOLS=0 at the build)"; return 0; }
    tar xzf "$OUT/tools.tgz" -C "$OUT"
    mkdir -p "$d/bin"
    for b in strace perf; do
        printf '#!/bin/sh\nexec %s/lib/ld-linux-x86-64.so.2 --library-path %s/lib %s/%s.real "$@"\n' \
            "$PWD/$d" "$PWD/$d" "$PWD/$d" "$b" >"$d/bin/$b"
        chmod +x "$d/bin/$b"
    done
    export PATH=$PWD/$d/bin:$PATH
    strace -f -c -o /dev/null true && echo "strace works" || echo "strace does not work here"
    perf stat -e task-clock true >/dev/null 2>&1 && echo "perf works" || echo "perf does not work here"
}

brokers=()
labels=(A B C D E F G H)
unpack() {
    tar xzf "$OUT/brokers.tgz" -C "$OUT"
    local n i=0
    while read -r n; do
        brokers+=("$OUT/brokers/$n")
        echo "${labels[$i]} = $n $(sha256sum "$OUT/brokers/$n" | cut -c1-16)"
        i=$((i + 1))
    done <"$OUT/brokers/order"
}

# A pid's threads' context switches and schedstat sums: "voluntary forced run_ns wait_ns".
sched_of() {
    local pid=$1
    python3 - "$pid" <<'EOF'
import glob, sys
pid = sys.argv[1]
vol = inv = run = wait = 0
for t in glob.glob(f"/proc/{pid}/task/*"):
    try:
        for line in open(f"{t}/status"):
            if line.startswith("voluntary_ctxt_switches"):
                vol += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                inv += int(line.split()[1])
        r, w, _ = open(f"{t}/schedstat").read().split()
        run += int(r)
        wait += int(w)
    except (OSError, ValueError):
        pass
print(vol, inv, run, wait)
EOF
}

# One throughput run of broker $1 in the background; sets bench_pid and broker_pid, and the
# run's JSON goes to $2.
start_run() {
    "$OUT/gpu-broker-bench" --broker-bin "$1" --broker-log warn --json throughput \
        --duration "${3:-6s}" --warmup 1s --repeat 1 >"$2" 2>/dev/null &
    bench_pid=$!
    broker_pid=
    local i
    for i in $(seq 50); do
        broker_pid=$(pgrep -P "$bench_pid" | head -1 || true)
        [[ -n $broker_pid ]] && break
        sleep 0.1
    done
}

sched() {
    local rounds=${SCHED_ROUNDS:-5} r j json f
    f=$(mktemp)
    for r in $(seq "$rounds"); do
        for j in "${!brokers[@]}"; do
            json=$(mktemp)
            start_run "${brokers[$j]}" "$json"
            sleep 3
            local b0 b1
            b0=$(sched_of "$broker_pid")
            sleep 3
            b1=$(sched_of "$broker_pid")
            wait "$bench_pid" || true
            local pps
            pps=$(grep '^{' "$json" | grep -v summary | python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["pairs_per_s"])')
            echo "${labels[$j]} $pps $b0 $b1" >>"$f"
            rm -f "$json"
        done
    done
    python3 - "$f" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    label, pps = f[0], float(f[1])
    b0, b1 = (list(map(int, f[i:i + 4])) for i in (2, 6))
    pairs = pps * 3.0
    rows.setdefault(label, []).append((pps, [(y - x) / pairs for x, y in zip(b0, b1)]))
names = ["voluntary switches", "forced switches", "on-CPU us", "runnable-waiting us"]
print("sched: medians per pair between 3 s and 6 s of a 32-worker run (pairs from the run's rate)")
base = None
for label, rs in rows.items():
    med = lambda k, i: statistics.median(r[k][i] for r in rs)
    pps = statistics.median(r[0] for r in rs)
    broker = [med(1, i) for i in range(4)]
    broker[2] /= 1000
    broker[3] /= 1000
    if base is None:
        base = (pps, broker)
    ratio = lambda a, b: f"{a / b:.3f}" if b else "-"
    print(f"  {label}: {pps:,.0f} pairs/s ({ratio(pps, base[0])}); broker " +
          ", ".join(f"{n} {v:.2f} ({ratio(v, base[1][i])})" for i, (n, v) in enumerate(zip(names, broker))) +
          f"  [runs: {', '.join(f'{r[0]:,.0f}' for r in rs)}]")
EOF
    rm -f "$f"
}

# A throughput run of broker $1 with, from 2.5 s in, `perf record` of it for $2 seconds
# (the other arguments are perf's) into the file $data; the run's JSON in the file $json.
perf_during_run() {
    local broker=$1 secs=$2
    shift 2
    json=$(mktemp)
    data=$(mktemp)
    start_run "$broker" "$json"
    sleep 2.5
    perf record -q -p "$broker_pid" -o "$data" "$@" -- sleep "$secs" >/dev/null 2>&1 || true
    wait "$bench_pid" || true
}

perf_part() {
    local j json data
    for j in "${!brokers[@]}"; do
        perf_during_run "${brokers[$j]}" 3 -F 2999 -e cpu-clock
        echo "---- perf ${labels[$j]} (${brokers[$j]##*/}): $(grep '^{' "$json" | grep -v summary | cut -c1-160)"
        perf report -i "$data" --stdio --no-children --sort dso --percent-limit 0.5 2>/dev/null | grep -v '^#' | grep -v '^$' | head -12 || true
        perf report -i "$data" --stdio --no-children --sort dso,sym --percent-limit 0.4 2>/dev/null | grep -v '^#' | grep -v '^$' | head -40 || true
        rm -f "$json" "$data"
    done
}

stacks() {
    local j json data
    for j in "${!brokers[@]}"; do
        perf_during_run "${brokers[$j]}" 1.5 --call-graph dwarf,4096 \
            -e syscalls:sys_enter_sched_yield -e syscalls:sys_enter_futex -e sched:sched_switch
        echo "---- stacks ${labels[$j]} (${brokers[$j]##*/})"
        perf script -i "$data" >"$data.txt" 2>/dev/null || true
        python3 - "$json" "$data.txt" <<'EOF2'
import collections, json, re, sys
js, script = sys.argv[1:]
pps = 0.0
for line in open(js):
    if line.startswith("{") and "summary" not in line:
        pps = json.loads(line)["pairs_per_s"]
pairs = pps * 1.5
skip = re.compile(r"^(core::|<core::|std::sys|<std::sys|alloc::|<alloc::|__GI_|syscall|\[unknown\])")
by = collections.defaultdict(collections.Counter)
event, frames = None, []

def done():
    if event is None:
        return
    own = [f for f in frames if not skip.match(f)]
    key = " < ".join(own[:4]) or "(no frames)"
    by[event][key] += 1

for line in open(script, errors="replace"):
    if not line.strip():
        done()
        event, frames = None, []
    elif not line.startswith("\t"):
        m = re.search(r"(syscalls:sys_enter_\w+|sched:sched_switch)", line)
        event = m.group(1).split(":")[1] if m else None
    else:
        f = line.split(None, 1)
        if len(f) == 2:
            sym = re.sub(r"\+0x[0-9a-f]+ .*$| \(.*$", "", f[1].strip())
            frames.append(re.sub(r"::h[0-9a-f]{16}$", "", sym))
done()
print(f"  {pps:,.0f} pairs/s in the run; per pair: " +
      ", ".join(f"{e} {sum(c.values()) / max(pairs, 1):.2f}" for e, c in by.items()))
for e, c in by.items():
    for key, n in c.most_common(12):
        print(f"  {e} {n / max(pairs, 1):.3f}  {key[:400]}")
EOF2
        rm -f "$json" "$data" "$data.txt"
    done
}

run() {
    local parts=${1:-ab,sched,strace,perf} p t0=$SECONDS
    echo "machine: $(nproc) cores, $(uname -r); load: $(cut -d' ' -f1-3 /proc/loadavg)"
    unpack
    tools
    for p in ${parts//,/ }; do
        echo "################ $p ($((SECONDS - t0)) s) ################"
        case $p in
            ab) OUT=$(mktemp -d) ROUNDS=${ROUNDS:-7} "$OUT/bench-ab.sh" "$OUT/gpu-broker-bench" "${brokers[@]}" | grep -v '^{' ;;
            sched) sched ;;
            strace) ROUNDS=1 "$OUT/bench-contention.sh" "$OUT/gpu-broker-bench" "${brokers[@]}" ;;
            perf) perf_part ;;
            stacks) stacks ;;
            *) echo "unknown part $p" >&2; exit 2 ;;
        esac
    done
    echo "################ done in $((SECONDS - t0)) s ################"
}

case ${1:-} in
    build) shift; build "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 build BENCH NAME=BROKER... | run [PARTS]" >&2; exit 2 ;;
esac
