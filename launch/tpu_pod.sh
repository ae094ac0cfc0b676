#!/usr/bin/env bash
# Every worker of a Cloud TPU VM pod runs the same command; jax.distributed finds the
# coordinator from the TPU metadata. The checkout (with .venv) must exist on all workers,
# and MODEL_DIR must be storage they all reach (e.g. gs://...).
#   TPU=my-pod ZONE=us-central2-b launch/tpu_pod.sh train --gin_file=... --gin.MODEL_DIR="'gs://b/run'"
set -euo pipefail
: "${TPU:?set TPU to the TPU VM name}" "${ZONE:?set ZONE}"
repo=${KTX_REMOTE_DIR:-ktx}
args=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "${TPU}" --zone "${ZONE}" --worker=all \
  --command "cd ${repo} && .venv/bin/ktx${args} --multihost"
