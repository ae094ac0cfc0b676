#!/usr/bin/env bash
# One task per GPU host under SLURM; jax.distributed reads the SLURM environment.
#   sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --requeue --signal=TERM@120 \
#     launch/gpu_slurm.sh train --gin_file=...
# On preemption or at the time limit SLURM sends SIGTERM to the tasks: `ktx train` stops
# at the next step boundary with a checkpoint of that step and exits 75; this script then
# requeues the job (scontrol requeue), which resumes from that checkpoint
# (docs/multihost.md, "Preemption").
set -euo pipefail
# A handler, not `trap ''`: ignoring SIGTERM here would make srun inherit it ignored.
trap 'echo "ktx: SIGTERM: the tasks stop at their next step boundary with a checkpoint" >&2' TERM
status=0
srun "${KTX:-ktx}" "$@" --multihost || status=$?
if ((status == 75)) && [[ -n "${SLURM_JOB_ID:-}" ]]; then
  echo "ktx: preempted (exit status 75): requeueing SLURM job ${SLURM_JOB_ID} to resume" >&2
  scontrol requeue "${SLURM_JOB_ID}"
fi
exit "${status}"
