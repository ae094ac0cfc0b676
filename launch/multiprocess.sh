#!/usr/bin/env bash
# N ktx processes on this machine joined by jax.distributed: each process owns its own
# devices and feeds its own rows of every global batch, exactly as on a multi-host pod.
#   launch/multiprocess.sh 2 train --gin_file=gin/runs/quickstart.gin --gin.MODEL_DIR="'/tmp/run'"
# If a process dies, the others exit within --heartbeat_timeout seconds (default 100);
# run the same command again to resume from the last checkpoint.
set -euo pipefail
n=${1:?usage: launch/multiprocess.sh NUM_PROCESSES COMMAND [ktx flags...]}
shift
port=${KTX_COORDINATOR_PORT:-12355}
pids=()
for ((i = 0; i < n; i++)); do
  "${KTX:-ktx}" "$@" --multihost --coordinator_address="localhost:${port}" \
    --num_processes="${n}" --process_id="${i}" &
  pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
  code=0
  wait "${pids[$i]}" || code=$?
  if ((code != 0)); then
    echo "ktx: process ${i} of ${n} exited with status ${code}; run the same command again to resume from the last checkpoint" >&2
    status=${code}
  fi
done
exit "${status}"
