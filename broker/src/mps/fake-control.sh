#!/bin/sh
# A stand-in for nvidia-cuda-mps-control in tests: records every invocation and command
# line in commands.log beside $CUDA_MPS_PIPE_DIRECTORY, runs a "daemon" (a sleeping
# process whose pid is in the pid file of $CUDA_MPS_PIPE_DIRECTORY) for -d (is one for -f),
# and answers
# commands on stdin while that process lives. A file `fail-start` beside the pipe
# directory makes -d fail; files `servers` and `clients` in it are the answers.
log="$(dirname "${CUDA_MPS_PIPE_DIRECTORY:?}")/commands.log"
pidfile="${CUDA_MPS_PIPE_DIRECTORY:?}/nvidia-cuda-mps-control.pid"
now() { date +%s.%N; }
alive() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }
if [ "$1" = "-f" ]; then
    # Foreground, as a unit runs it: this process is the daemon.
    echo "$(now) -f pipe=$CUDA_MPS_PIPE_DIRECTORY log=${CUDA_MPS_LOG_DIRECTORY:-}" >>"$log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY"
    echo $$ >"$pidfile"
    exec sleep 3600 </dev/null >/dev/null 2>&1
fi
if [ "$1" = "-d" ]; then
    echo "$(now) -d pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY visible=${CUDA_VISIBLE_DEVICES:-}" >>"$log"
    if [ -e "$(dirname "$log")/fail-start" ]; then
        echo "fake: cannot start" >&2
        exit 1
    fi
    if alive; then
        echo "An instance of this daemon is already running" >&2
        exit 1
    fi
    sleep 3600 </dev/null >/dev/null 2>&1 &
    echo $! >"$pidfile"
    exit 0
fi
read -r line
echo "$(now) cmd $line" >>"$log"
if ! alive; then
    echo "Cannot find MPS control daemon process" >&2
    exit 1
fi
case "$line" in
get_server_list) [ -f "$CUDA_MPS_PIPE_DIRECTORY/servers" ] && cat "$CUDA_MPS_PIPE_DIRECTORY/servers" ;;
get_client_list*) [ -f "$CUDA_MPS_PIPE_DIRECTORY/clients" ] && cat "$CUDA_MPS_PIPE_DIRECTORY/clients" ;;
quit) kill "$(cat "$pidfile")"; rm -f "$pidfile" ;;
*) echo "unknown command" ;;
esac
exit 0
