#!/usr/bin/env bash
# One task per GPU host under SLURM; jax.distributed reads the SLURM environment.
#   sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 launch/gpu_slurm.sh train --gin_file=...
set -euo pipefail
srun "${KTX:-ktx}" "$@" --multihost
