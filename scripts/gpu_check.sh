#!/usr/bin/env bash
# GPU check for issue 6 ("what --accum-freq costs"), under 5 minutes on one H200 (or H100):
#
#     bash scripts/gpu_check.sh
#
# ViT-B-32 at 224 px, bf16, ZeRO-2, one GPU, m = 256, k in {1, 4}: the plain DeepSpeed step (baseline),
# ds_clip's cached step, and open_clip's own trainer (open_clip_train, --precision amp_bf16: autocast
# on fp32 weights, where DeepSpeed's bf16 keeps bf16 weights and fp32 master weights) side by side.
# It prints the tables of docs/benchmarks.md and writes the raw numbers to $OUT (bench_gpu.json).
# It uses what is installed: .venv if present, else the python on PATH; the repo is put on PYTHONPATH.
#
# Without CUDA it stops with a clear message. The same argument path runs on a CPU with tiny sizes:
#
#     DEVICE=cpu MODEL=ds-clip-tiny IMAGE_SIZE=32 BATCH=2 STEPS=1 WARMUP=0 bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-ViT-B-32}
IMAGE_SIZE=${IMAGE_SIZE:-224}
BATCH=${BATCH:-256}
PRECISION=${PRECISION:-bf16}
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-2}
OUT=${OUT:-bench_gpu.json}
LIMIT_S=${LIMIT_S:-285}

python - <<'PY' || exit 1
import importlib, sys
missing = [m for m in ("torch", "deepspeed", "open_clip", "open_clip_train", "pandas") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing Python packages: {', '.join(missing)} (install the project: pip install -e .)")
PY
if [ "$DEVICE" = cuda ]; then
    if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); this check needs one GPU." >&2
        echo "  CPU dry run of the same path: DEVICE=cpu MODEL=ds-clip-tiny IMAGE_SIZE=32 BATCH=2 STEPS=1 WARMUP=0 bash $0" >&2
        exit 1
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
date -Is
uptime

timeout "$LIMIT_S" python -m ds_clip.bench \
    --device "$DEVICE" --precision "$PRECISION" --models "$MODEL" --image-size "$IMAGE_SIZE" \
    --batch-size "$BATCH" --k 1 4 --world-sizes 1 --zero-stages 2 \
    --steps "$STEPS" --warmup "$WARMUP" --open-clip --open-clip-k 1 4 --threads 4 \
    --json "$OUT"
