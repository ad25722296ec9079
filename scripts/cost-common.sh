# Shared by the scripts that count what the broker's work costs (sourced, not run):
# scripts/bench-cost.sh (per acquire+release pair) and scripts/quota-write-cost.sh (per
# operator call). Each runs the broker under valgrind's callgrind and under `strace -f -c`,
# twice each with more and less work, and sets the two runs' counts against each other per
# operation, so the start and the setup cancel out.
#
#   cost_wrapper FILE        writes at FILE a wrapper that runs $COST_BROKER with its
#                            arguments under $COST_TOOL (callgrind or strace), counting into
#                            $COST_OUT (callgrind's log, the broker's stderr with it:
#                            $COST_OUT.log); a SIGTERM to the wrapper reaches the broker
#                            itself, so it shuts down normally and the tool writes its counts
#   cost_instructions OUT    the instructions callgrind counted in the run into OUT
#   cost_per A B N           (B - A) / N, rounded, thousands separated (12,345)
#   cost_syscalls S0 S1 N    the system calls per operation between the strace counts S0
#                            and S1, N operations apart: the total (one decimal) on one
#                            line, then "NAME V, ..." (those at least 0.05 an operation,
#                            most first) on the next

cost_wrapper() {
    cat >"$1" <<'EOF'
#!/usr/bin/env bash
case "$COST_TOOL" in
callgrind) exec valgrind --tool=callgrind --callgrind-out-file="$COST_OUT" "$COST_BROKER" "$@" 2>>"$COST_OUT.log" ;;
strace)
    strace -f -c -o "$COST_OUT" "$COST_BROKER" "$@" &
    tracer=$!
    trap 'kill -TERM $(pgrep -P $tracer)' TERM
    wait $tracer || wait $tracer
    ;;
esac
EOF
    chmod +x "$1"
}

cost_instructions() {
    grep -o 'Collected : [0-9]*' "$1.log" | awk '{print $3}'
}

cost_per() {
    python3 -c 'import sys; a, b, n = map(int, sys.argv[1:]); print(f"{(b - a) / n:,.0f}")' "$@"
}

cost_syscalls() {
    python3 - "$@" <<'EOF'
import sys
s0, s1, n = sys.argv[1:]

def counts(path):
    out = {}
    for line in open(path):
        f = line.split()
        if len(f) >= 5 and f[0][0].isdigit() and f[-1] != "total":
            out[f[-1]] = int(f[3])
    return out

a, b = counts(s0), counts(s1)
per = {k: (b.get(k, 0) - a.get(k, 0)) / int(n) for k in set(a) | set(b)}
top = sorted(((v, k) for k, v in per.items() if v >= 0.05), reverse=True)
print(f"{sum(per.values()):.1f}")
print(", ".join(f"{k} {v:.2f}" for v, k in top))
EOF
}
