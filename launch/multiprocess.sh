#!/usr/bin/env bash
# N ktx processes on this machine joined by jax.distributed: each process owns its own
# devices and feeds its own rows of every global batch, exactly as on a multi-host pod.
#   launch/multiprocess.sh 2 train --gin_file=gin/runs/quickstart.gin --gin.MODEL_DIR="'/tmp/run'"
# If a process dies, the others exit within --heartbeat_timeout seconds (default 100);
# run the same command again to resume from the last checkpoint.
# SIGTERM or SIGINT to this script is passed to every process: they stop at the same step
# boundary with a checkpoint of that step and exit 75, and so does this script
# (docs/multihost.md, "Preemption"): run the same command again to resume.
set -euo pipefail
n=${1:?usage: launch/multiprocess.sh NUM_PROCESSES COMMAND [ktx flags...]}
shift
port=${KTX_COORDINATOR_PORT:-12355}
preempted=75
pids=()
for ((i = 0; i < n; i++)); do
  "${KTX:-ktx}" "$@" --multihost --coordinator_address="localhost:${port}" \
    --num_processes="${n}" --process_id="${i}" &
  pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' TERM INT
status=0
all_preempted=1
for i in "${!pids[@]}"; do
  while :; do
    code=0
    wait "${pids[$i]}" || code=$?
    # A trapped signal ends `wait` early (status > 128) while the process still runs.
    if ((code > 128)) && kill -0 "${pids[$i]}" 2>/dev/null; then continue; fi
    break
  done
  ((code == preempted)) || all_preempted=0
  if ((code != 0 && code != preempted)); then
    echo "ktx: process ${i} of ${n} exited with status ${code}; run the same command again to resume from the last checkpoint" >&2
    status=${code}
  fi
done
if ((status == 0 && all_preempted)); then
  echo "ktx: preempted: every process saved the checkpoint of the interrupted step and exited ${preempted}; run the same command again to resume" >&2
  status=${preempted}
fi
exit "${status}"
