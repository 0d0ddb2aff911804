#!/usr/bin/env bash
# Runs: deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
#         --module ds_clip.train "$@"
# Run it once, on the first host of the hostfile; DeepSpeed starts "slots" ranks on every host by ssh
# (pdsh), so every host needs passwordless ssh, the same repo path and the same venv (see hostfile.example;
# extra environment variables go in .deepspeed_env).
#   HOSTFILE=hostfile scripts/launch_multi_node.sh --ds-config zero3_bf16 --batch-size 32 --accum-freq 8
# HOSTFILE defaults to ./hostfile; MASTER_ADDR to its first host; MASTER_PORT to 29500.
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTFILE="${HOSTFILE:-hostfile}"
[[ -f "$HOSTFILE" ]] || { echo "launch_multi_node.sh: no hostfile at $HOSTFILE (see hostfile.example)" >&2; exit 2; }
MASTER_ADDR="${MASTER_ADDR:-$(grep -v '^\s*#' "$HOSTFILE" | awk 'NF {print $1; exit}')}"
MASTER_PORT="${MASTER_PORT:-29500}"
exec deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  --module ds_clip.train "$@"
