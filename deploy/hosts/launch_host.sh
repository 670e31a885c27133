#!/bin/bash
# Start this host's share of a multi-process JAX job by hand (no scheduler). Run it on EVERY host, with the
# same COORDINATOR and NUM_PROCESSES and a different HOST_INDEX; see deploy/hosts/README.md.
#
#   COORDINATOR=10.0.0.1:61234 NUM_HOSTS=2 HOST_INDEX=0 deploy/hosts/launch_host.sh check   # on host 0
#   COORDINATOR=10.0.0.1:61234 NUM_HOSTS=2 HOST_INDEX=1 deploy/hosts/launch_host.sh check   # on host 1
#   ... then the same with `train` instead of `check`.
#
# MODE=per-host (default): one process per host owning all its GPUs; process id = HOST_INDEX.
# MODE=per-gpu:  one process per GPU, CUDA_VISIBLE_DEVICES=k; process id = HOST_INDEX * GPUS_PER_HOST + k.
set -euo pipefail

ACTION=${1:-check}                         # check | train
: "${COORDINATOR:?set COORDINATOR=host:port of host 0 (an address every host can reach, a free port)}"
: "${NUM_HOSTS:?set NUM_HOSTS, the number of hosts in the job}"
: "${HOST_INDEX:?set HOST_INDEX: 0 on the coordinator host, then 1, 2, ...}"
MODE=${MODE:-per-host}
GPUS_PER_HOST=${GPUS_PER_HOST:-$(nvidia-smi -L 2>/dev/null | wc -l)}
REPO=${REPO:-$(cd "$(dirname "$0")/../.." && pwd)}
VENV=${VENV:-$REPO/.venv}
PROFILE=${PROFILE:-gpu}
STEPS=${STEPS:-20}
OUT=${OUT:-$REPO/build/multihost-hosts}
INIT_TIMEOUT_S=${INIT_TIMEOUT_S:-300}      # how long a process waits for the others to join

unset XLA_FLAGS JAX_PLATFORMS JAX_NUM_CPU_DEVICES
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# export NCCL_SOCKET_IFNAME=eth0           # the interface the hosts share, if NCCL picks the wrong one

case "$ACTION" in
  check) EXTRA=(--check-only --out "$OUT/check") ;;
  train) EXTRA=(--profile "$PROFILE" --steps "$STEPS" --data device --out "$OUT") ;;
  *) echo "usage: $0 check|train" >&2; exit 2 ;;
esac

cd "$REPO"
pids=()
stop_all() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; }
trap stop_all EXIT INT TERM             # never leave a process behind waiting for its peers

run() {  # run <process_id> <expect_local_devices> <cuda_visible_devices or ""> [extra worker args...]
  local pid_=$1 expect=$2 cuda=$3; shift 3
  # The worker prefixes its own lines with "[process i/N]"; its output goes to this terminal.
  env ${cuda:+CUDA_VISIBLE_DEVICES=$cuda} "$VENV/bin/python" -m course_tools.launcher worker \
    --coordinator "$COORDINATOR" --num-processes "$NUM_PROCESSES" --process-id "$pid_" \
    --init-timeout-s "$INIT_TIMEOUT_S" --expect-local-devices "$expect" "$@" "${EXTRA[@]}" &
  pids+=($!)
}

case "$MODE" in
  per-host)
    NUM_PROCESSES=$NUM_HOSTS
    # all of this host's GPUs, named explicitly
    run "$HOST_INDEX" "$GPUS_PER_HOST" "" --local-device-ids "$(seq -s, 0 $((GPUS_PER_HOST - 1)))"
    ;;
  per-gpu)
    NUM_PROCESSES=$((NUM_HOSTS * GPUS_PER_HOST))
    for k in $(seq 0 $((GPUS_PER_HOST - 1))); do
      run $((HOST_INDEX * GPUS_PER_HOST + k)) 1 "$k"   # this process sees GPU k only, as its device 0
    done
    ;;
  *) echo "MODE=$MODE: use per-host or per-gpu" >&2; exit 2 ;;
esac
echo "host $HOST_INDEX: started ${#pids[@]} process(es) of $NUM_PROCESSES, coordinator $COORDINATOR" >&2

# Wait; the first failure stops this host's other processes (the other hosts' ones then fail or time out).
status=0
while ((${#pids[@]})); do
  if ! wait -n; then status=1; echo "host $HOST_INDEX: a process failed; stopping the others" >&2; break; fi
  alive=(); for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done; pids=("${alive[@]}")
done
exit $status
