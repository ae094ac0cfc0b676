#!/usr/bin/env bash
# Every worker of a Cloud TPU VM pod runs the same command; jax.distributed finds the
# coordinator from the TPU metadata. The checkout (with .venv) must exist on all workers,
# and MODEL_DIR must be storage they all reach (e.g. gs://...).
#   TPU=my-pod ZONE=us-central2-b launch/tpu_pod.sh train --gin_file=... --gin.MODEL_DIR="'gs://b/run'"
# A maintenance event or preemption (SIGTERM, JAX's preemption sync point) stops `ktx
# train` at a step boundary with a checkpoint of that step and exit status 75; this
# script then runs the command again, which resumes from it, up to KTX_MAX_RESUMES times
# (default 100), KTX_RESUME_DELAY seconds later (default 60: the VMs come back)
# (docs/multihost.md, "Preemption").
set -euo pipefail
: "${TPU:?set TPU to the TPU VM name}" "${ZONE:?set ZONE}"
repo=${KTX_REMOTE_DIR:-ktx}
args=$(printf ' %q' "$@")
resumes=0
while :; do
  status=0
  gcloud compute tpus tpu-vm ssh "${TPU}" --zone "${ZONE}" --worker=all \
    --command "cd ${repo} && .venv/bin/ktx${args} --multihost" || status=$?
  if ((status != 75 || resumes >= ${KTX_MAX_RESUMES:-100})); then
    exit "${status}"
  fi
  resumes=$((resumes + 1))
  echo "ktx: preempted (exit status 75): resuming from the saved checkpoint (relaunch ${resumes})" >&2
  sleep "${KTX_RESUME_DELAY:-60}"
done
