#!/usr/bin/env bash
# Runs: mpirun -np "$NP" --bind-to none [--hostfile "$HOSTFILE"] $MPI_ARGS -x PATH -x PYTHONPATH ... \
#         python -m ds_clip.train "$@"
# Open MPI starts the ranks; ds_clip reads rank and world size from MPI (needs mpi4py:
# pip install -e '.[mpi]').
#   NP=4 scripts/launch_mpirun.sh --ds-config zero2_fp32 --batch-size 16 --accum-freq 2
# Several hosts (docs/multinode.md): HOSTFILE=hostfile (same format as hostfile.example; NP defaults to
# the sum of its slots). scripts/check_hosts.sh then tests every host first (ssh with a timeout) and
# names the ones that fail (SKIP_HOST_CHECK=1 skips it). Pin Open MPI's own traffic to the interface the
# hosts share with MPI_ARGS="--mca oob_tcp_if_include eth1 --mca btl_tcp_if_include eth1" (a name or a
# CIDR such as 10.0.0.0/24), and set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for torch's.
#   HOSTFILE=hostfile GLOO_SOCKET_IFNAME=eth1 MPI_ARGS="--mca btl_tcp_if_include eth1" \
#     scripts/launch_mpirun.sh --batch-size 16 --accum-freq 2
# Environment of the ranks: Open MPI passes only what `-x` names. This script forwards PATH and
# PYTHONPATH always, and OMP_NUM_THREADS, LD_LIBRARY_PATH, MASTER_ADDR, MASTER_PORT, DS_ACCELERATOR and
# every GLOO_*, NCCL_*, TORCH_*, HF_*, DS_CLIP_* variable that is set, plus the names in
# DS_CLIP_FORWARD_ENV. The master address under mpirun is rank 0's first `hostname -I` address unless
# MASTER_ADDR is set (ds_clip keeps it).
# --bind-to none: Open MPI pins each rank to ONE core by default, which makes data loading, the CPU
#   collectives and the first-start op build crawl.
# In containers (root, few cores): MPI_ARGS="--allow-run-as-root --oversubscribe" -- Open MPI refuses
#   to run as root without the first, and more ranks than detected slots without the second.
set -euo pipefail
cd "$(dirname "$0")/.."
host_args=()
if [[ -n "${HOSTFILE:-}" ]]; then
  [[ -f "$HOSTFILE" ]] || { echo "launch_mpirun.sh: no hostfile at $HOSTFILE (see hostfile.example)" >&2; exit 2; }
  [[ -n "${SKIP_HOST_CHECK:-}" ]] || scripts/check_hosts.sh "$HOSTFILE"
  host_args=(--hostfile "$HOSTFILE")
  NP="${NP:-$(sed -e 's/#.*//' "$HOSTFILE" | awk 'NF {n += 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) {
    split($i, a, "="); n += a[2] - 1 } } END {print n}')}"
fi
NP="${NP:-2}"
export PYTHONPATH="${PYTHONPATH:-}"
forward=(PATH PYTHONPATH OMP_NUM_THREADS LD_LIBRARY_PATH MASTER_ADDR MASTER_PORT DS_ACCELERATOR ${DS_CLIP_FORWARD_ENV:-})
mapfile -t -O "${#forward[@]}" forward < <(compgen -e | grep -E '^(GLOO_|NCCL_|TORCH_|HF_|DS_CLIP_)' || true)
x_args=()
for v in "${forward[@]}"; do
  [[ "$v" == DS_CLIP_FORWARD_ENV || -z "${!v+x}" ]] && continue
  x_args+=(-x "$v")
done
# Ctrl-C or SIGTERM to mpirun: Open MPI 4 sends the ranks SIGCONT at once, SIGTERM odls_base_sigkill_timeout
# seconds later and SIGKILL as long again after that (default 1 s: too short to save). MPI_SIGKILL_TIMEOUT
# (default 30) is both the wait before the ranks hear of the stop and the time they have to finish the step
# and save (docs/faults.md, "Signals"). `kill -USR1 <mpirun pid>` reaches the ranks at once (Open MPI passes
# SIGUSR1 on) and stops them the same way.
# shellcheck disable=SC2086  # MPI_ARGS is a list of flags
exec mpirun -np "$NP" --bind-to none --mca odls_base_sigkill_timeout "${MPI_SIGKILL_TIMEOUT:-30}" \
  "${host_args[@]}" ${MPI_ARGS:-} "${x_args[@]}" python -m ds_clip.train "$@"
