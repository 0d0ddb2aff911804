#!/usr/bin/env bash
# Runs: deepspeed --num_gpus "$NUM_GPUS" --module ds_clip.train "$@"
# One machine, one rank per GPU (or NUM_GPUS CPU processes on a machine without GPUs; DeepSpeed then
# uses its CPU accelerator and gloo). The launcher appends --local_rank=N, which ds_clip accepts.
#   NUM_GPUS=8 scripts/launch_single_node.sh --ds-config zero2_bf16 --batch-size 64 --accum-freq 4
# NUM_GPUS defaults to the number of GPUs nvidia-smi lists, or 1 where there is none.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${NUM_GPUS:-}" ]]; then
  NUM_GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "$NUM_GPUS" -ge 1 ]] || NUM_GPUS=1
fi
exec deepspeed --num_gpus "$NUM_GPUS" --module ds_clip.train "$@"
