#!/usr/bin/env bash
# One `ktx study run` worker per SLURM array task: the array shares a study's runs by
# `--shard=$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT`, and the claims in the study
# directory (which every task must see: a shared file system) keep two tasks off one run.
#   sbatch --array=0-7 --gpus=1 --time=8:00:00 --requeue --signal=TERM@120 \
#     launch/study_slurm_array.sh gin/studies/cs224n_encoders.gin \
#       --gin.INITIAL_CHECKPOINT_PATH="'hf:$DIR'" --gin.ENCODER_VOCAB="'$DIR'"
# A task stopped part-way (preemption, the time limit: `ktx train` saves a checkpoint and
# exits 75) is requeued and resumes its run from that checkpoint; finished runs are
# skipped. `ktx study run STUDY.gin --dry_run` shows what is done, `ktx study report DIR`
# the results (docs/studies.md).
set -euo pipefail
study="${1:?usage: sbatch --array=0-N launch/study_slurm_array.sh STUDY.gin [flags]}"
shift
task="${SLURM_ARRAY_TASK_ID:?not in a SLURM array job (sbatch --array=0-N)}"
count="${SLURM_ARRAY_TASK_COUNT:-$(( ${SLURM_ARRAY_TASK_MAX:-0} - ${SLURM_ARRAY_TASK_MIN:-0} + 1 ))}"
trap 'echo "ktx study: SIGTERM: the run stops at its next step boundary with a checkpoint" >&2' TERM
status=0
"${KTX:-ktx}" study run "${study}" --shard="$(( task - ${SLURM_ARRAY_TASK_MIN:-0} ))/${count}" "$@" \
  || status=$?
if ((status == 75)) && [[ -n "${SLURM_JOB_ID:-}" ]]; then
  echo "ktx study: preempted (exit status 75): requeueing ${SLURM_JOB_ID} to resume" >&2
  scontrol requeue "${SLURM_JOB_ID}_${task}"
fi
exit "${status}"
