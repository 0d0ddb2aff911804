#!/usr/bin/env bash
# Runs: deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
#         --module ds_clip.train "$@"
# Run it once, on the first host of the hostfile; DeepSpeed starts "slots" ranks on every host by ssh
# (pdsh), so every host needs passwordless ssh, the same repo path and the same venv (see hostfile.example
# and docs/multinode.md).
#   HOSTFILE=hostfile scripts/launch_multi_node.sh --ds-config zero3_bf16 --batch-size 32 --accum-freq 8
#   GLOO_SOCKET_IFNAME=eth1 NCCL_SOCKET_IFNAME=eth1 HOSTFILE=hostfile scripts/launch_multi_node.sh ...
# HOSTFILE defaults to ./hostfile; MASTER_ADDR to its first host (give an address every host can reach
# when that name resolves differently on some hosts); MASTER_PORT to 29500.
#
# Before launching, scripts/check_hosts.sh tests every host (ssh with a timeout, same paths) and names
# the ones that fail (SKIP_HOST_CHECK=1 skips it). The ranks themselves check that they reach
# MASTER_ADDR:MASTER_PORT (ds_clip.preflight, bounded by DS_CLIP_PREFLIGHT_TIMEOUT_S) instead of hanging.
#
# Environment of the remote ranks: pdsh starts them with the remote login's environment plus what the
# runner exports: PYTHON* (PYTHONPATH included), UCX*, MV2*, MLFLOW*, NCCL* on CUDA, and the lines of
# .deepspeed_env. This script writes one merged env file for the run (DS_ENV_FILE) from
#   1. ~/.deepspeed_env and ./.deepspeed_env (or $DS_ENV_FILE) if present (blank and # lines dropped:
#      DeepSpeed's parser crashes on them),
#   2. the launching shell's PATH, LD_LIBRARY_PATH, OMP_NUM_THREADS, DS_ACCELERATOR and every GLOO_*,
#      NCCL_*, TORCH_*, HF_* and DS_CLIP_* variable, and the names listed in DS_CLIP_FORWARD_ENV,
# later lines winning. Every rank on every host gets them.
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTFILE="${HOSTFILE:-hostfile}"
[[ -f "$HOSTFILE" ]] || { echo "launch_multi_node.sh: no hostfile at $HOSTFILE (see hostfile.example)" >&2; exit 2; }
MASTER_ADDR="${MASTER_ADDR:-$(sed -e 's/#.*//' "$HOSTFILE" | awk 'NF {print $1; exit}')}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -z "${SKIP_HOST_CHECK:-}" ]]; then
  scripts/check_hosts.sh "$HOSTFILE"
fi

env_dir="$(mktemp -d)"
trap 'rm -rf "$env_dir"' EXIT
env_file="$env_dir/deepspeed_env"
: >"$env_file"
name="${DS_ENV_FILE:-.deepspeed_env}"
sources=("$HOME/$name" "./$name")
[[ "$name" == /* ]] && sources=("$name")
for f in "${sources[@]}"; do
  [[ -f "$f" ]] && grep -E '^[A-Za-z_][A-Za-z0-9_]*=' "$f" >>"$env_file" || true
done
forward=(PATH LD_LIBRARY_PATH OMP_NUM_THREADS DS_ACCELERATOR ${DS_CLIP_FORWARD_ENV:-})
mapfile -t -O "${#forward[@]}" forward < <(compgen -e | grep -E '^(GLOO_|NCCL_|TORCH_|HF_|DS_CLIP_)' || true)
for v in "${forward[@]}"; do
  [[ "$v" == DS_CLIP_FORWARD_ENV || -z "${!v+x}" ]] && continue
  [[ "${!v}" == *$'\n'* ]] && { echo "launch_multi_node.sh: $v holds a newline; cannot forward it" >&2; exit 2; }
  printf '%s=%s\n' "$v" "${!v}" >>"$env_file"
done

# DS_ENV_FILE may be a path: DeepSpeed joins it to ~ and ., and an absolute path wins both joins.
DS_ENV_FILE="$env_file" deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" \
  --master_port "$MASTER_PORT" --module ds_clip.train "$@"
