#!/usr/bin/env bash
# Runs: mpirun -np "$NP" --bind-to none $MPI_ARGS -x PATH -x PYTHONPATH python -m ds_clip.train "$@"
# Open MPI starts the ranks; ds_clip reads rank and world size from MPI (needs mpi4py:
# pip install -e '.[mpi]'). Several hosts: MPI_ARGS="--hostfile hostfile" (same format as hostfile.example).
#   NP=4 scripts/launch_mpirun.sh --ds-config zero2_fp32 --batch-size 16 --accum-freq 2
# --bind-to none: Open MPI pins each rank to ONE core by default, which makes data loading, the CPU
#   collectives and the first-start op build crawl.
# In containers (root, few cores): MPI_ARGS="--allow-run-as-root --oversubscribe" -- Open MPI refuses
#   to run as root without the first, and more ranks than detected slots without the second.
set -euo pipefail
cd "$(dirname "$0")/.."
NP="${NP:-2}"
# shellcheck disable=SC2086  # MPI_ARGS is a list of flags
exec mpirun -np "$NP" --bind-to none ${MPI_ARGS:-} -x PATH -x PYTHONPATH python -m ds_clip.train "$@"
