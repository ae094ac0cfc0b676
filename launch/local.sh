#!/usr/bin/env bash
# One process on this machine, all its devices in one (data, model) mesh.
#   launch/local.sh train --gin_file=gin/runs/quickstart.gin --gin.MODEL_DIR="'/tmp/run'"
# SIGTERM or SIGINT (Ctrl-C) stops `ktx train` at the next step boundary with a checkpoint
# of that step and exit status 75 (docs/multihost.md, "Preemption"): run the same command
# again to resume.
set -euo pipefail
exec "${KTX:-ktx}" "$@"
