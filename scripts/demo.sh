#!/usr/bin/env bash
# The main job on built-in defaults:  bash scripts/demo.sh [extra ds-clip-train flags]
# Installs what it needs, then trains the built-in tiny CLIP on generated captioned shapes with
# 2 CPU ranks under the deepspeed launcher and --accum-freq 4 (global batch 2 x 4 x 16 = 128 pairs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# DeepSpeed JIT-builds a comm op into the torch extensions cache; one cache per venv, or two checkouts
# rebuild it back and forth.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec deepspeed --num_gpus 2 --module ds_clip.train \
  --model ds-clip-tiny --dataset-type synthetic --batch-size 16 --accum-freq 4 \
  --max-steps 80 --warmup 5 --lr 1e-3 --log-every-n-steps 5 --workers 1 \
  --logs ./logs --report-to csv,tensorboard "$@"
