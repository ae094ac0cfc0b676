#!/usr/bin/env bash
# One process on this machine, all its devices in one (data, model) mesh.
#   launch/local.sh train --gin_file=gin/runs/quickstart.gin --gin.MODEL_DIR="'/tmp/run'"
set -euo pipefail
exec "${KTX:-ktx}" "$@"
