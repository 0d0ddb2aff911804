#!/usr/bin/env bash
# What only a GPU shows (issue 13), in under 11 minutes on one H200:
#
#     bash scripts/gpu_check.sh                      # results in $OUT/gpu_check.json (else ./gpu_check_out/)
#     bash scripts/gpu_check.sh --out DIR/result.json
#     bash scripts/gpu_check.sh --dry-run            # print every command, run none (works without a GPU)
#
# (a) NCCL, one rank: ds-clip-train with ViT-B-32 at 224 px, bf16, ZeRO-2, logging every step, evaluation
#     (--val-data synthetic, --zeroshot-classes), a checkpoint, then --resume latest; with
#     DS_CLIP_COLLECTIVES_IN_WORLD_OF_ONE=1 every ds_clip collective is really issued on the 1-rank NCCL
#     group (a CPU tensor in one raises "No backend type associated with device type cpu"), and
#     scripts/gpu_check_collectives.py calls every helper of ds_clip.distributed on CPU and GPU tensors.
# (b) Cost of --accum-freq: the cached step vs the plain DeepSpeed step vs open_clip_train, ViT-B-32, 224 px,
#     bf16, k in {1, 4, 8}, peak memory from torch.cuda.max_memory_allocated (benchmarks/bench_accum.py).
# (c) Exactness: k=4 x m vs k=1 x 4m on one GPU, fp32 with TF32 off: relative gradient error per parameter
#     (scripts/gpu_check_exactness.py), failing above 1e-4.
# (d) --torchcompile: ds-clip-train with and without it, ViT-B-32, 224 px, bf16, ZeRO-2: the first (compile)
#     step and the steady time per step, from the runs' own metrics (benchmarks/bench_compile.py).
# Every part fails loudly: any error stops the script with a non-zero exit and names the part.
#
# Install (the GPU machine may have torch preinstalled and no network), first that applies:
#   1. ./.venv exists (bash scripts/setup.sh made it): use it;
#   2. the python3 on PATH has torch with CUDA, deepspeed, open_clip_torch, webdataset and pandas: install
#      ds_clip itself into it, offline (pip install --no-deps --no-build-isolation -e .);
#   3. a folder .whl/ holds wheels of the missing packages (see docs/gpu.md): install from it, offline,
#      on top of the preinstalled torch;
#   4. otherwise: bash scripts/setup.sh (needs the package registry) and use ./.venv.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY_RUN=0
OUT_FILE=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --out) OUT_FILE=$2; shift ;;
        --out=*) OUT_FILE=${1#--out=} ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
OUT_DIR=${OUT:-$ROOT/gpu_check_out}
OUT_FILE=${OUT_FILE:-$OUT_DIR/gpu_check.json}
OUT_DIR=$(dirname "$OUT_FILE")
WORK=${GPU_CHECK_WORK:-/tmp/ds_clip_gpu_check}
LOG=$OUT_DIR/gpu_check.log

# Sizes: each part has a time limit (a run past it fails the check). Expected on one H200, install excluded:
# (a) ~2.5 min, (b) ~3 min, (c) ~1 min, (d) ~2.5 min (a cold inductor compile of ViT-B-32 in it).
MODEL=ViT-B-32
M_TRAIN=64
M_BENCH=256
LIMIT_TRAIN_S=150
LIMIT_COLLECTIVES_S=60
LIMIT_BENCH_S=225
LIMIT_EXACT_S=90
LIMIT_COMPILE_S=240

PART="set-up"
trap 'rc=$?; echo "gpu_check: FAILED in part ${PART} (exit ${rc}); log: ${LOG}" >&2; exit ${rc}' ERR

# show: print a command as one would type it (words with shell characters in single quotes).
show() {
    local line="+" a q="'"
    for a in "$@"; do
        if [[ $a =~ ^[A-Za-z0-9_./=:,@%+-]+$ ]]; then line+=" $a"; else line+=" '${a//$q/$q\\$q$q}'"; fi
    done
    printf '%s\n' "$line"
}
# say: print a shell line that is not a plain command (a redirect, a builtin).
say() { printf '+ %s\n' "$1"; }
run() {
    show "$@"
    if [ "$DRY_RUN" = 0 ]; then
        "$@" 2>&1 | tee -a "$LOG"
    fi
}

if [ "$DRY_RUN" = 0 ]; then
    mkdir -p "$OUT_DIR"
    rm -rf "$WORK"
    mkdir -p "$WORK"
    : >"$LOG"
fi

# ------------------------------------------------------------------------------------------ install
PART="install"
has_stack() {
    python3 - <<'PY' >/dev/null 2>&1
import importlib.util, sys, torch
need = ("deepspeed", "open_clip", "open_clip_train", "webdataset", "pandas")
sys.exit(0 if torch.cuda.is_available() and all(importlib.util.find_spec(m) for m in need) else 1)
PY
}
if [ -x .venv/bin/python ]; then
    say "source .venv/bin/activate"
    # shellcheck disable=SC1091
    . .venv/bin/activate
elif has_stack; then
    run python3 -m pip install -q --no-deps --no-build-isolation -e .
elif [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    run python3 -m pip install -q --no-index --find-links .whl --no-build-isolation -e ".[bench]"
else
    run bash scripts/setup.sh
    say "source .venv/bin/activate"
    if [ "$DRY_RUN" = 0 ]; then . .venv/bin/activate; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4

# The bench is a tool beside the package (benchmarks/bench_accum.py; its old console script ds-clip-bench
# is gone from the wheel): run the file, or ds-clip-bench where an install still provides a working one.
if [ "$DRY_RUN" = 0 ] && ds-clip-bench --help >/dev/null 2>&1; then
    BENCH=(ds-clip-bench)
else
    BENCH=(python benchmarks/bench_accum.py)
fi

if [ "$DRY_RUN" = 0 ]; then
    python - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine "
             "(bash scripts/gpu_check.sh --dry-run lists the commands)")
PY
fi
run nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
run python -c "import torch, deepspeed, open_clip; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__, 'open_clip', open_clip.__version__)"

# ----------------------------------------------------------- (a) 1-rank NCCL: trainer + every helper
PART="a: 1-rank NCCL trainer, evaluation, checkpoint, resume"
T0=$SECONDS
CLASSES=$WORK/classes.txt
say "printf 'circle\\nsquare\\ntriangle\\n' > $CLASSES"
if [ "$DRY_RUN" = 0 ]; then printf '%s\n' circle square triangle >"$CLASSES"; fi
TRAIN=(
    --model "$MODEL" --batch-size "$M_TRAIN" --accum-freq 2 --zero-stage 2 --precision bf16
    --log-every-n-steps 1 --val-data synthetic --val-num-samples 256 --val-every-n-steps 3
    --zeroshot-classes "$CLASSES" --save-every-n-steps 3 --logs "$WORK" --name nccl --workers 4
    --report-to csv --warmup 1 --lr 1e-4
)
LAUNCH=(env DS_CLIP_COLLECTIVES_IN_WORLD_OF_ONE=1 timeout "$LIMIT_TRAIN_S" torchrun --standalone --nproc_per_node 1)
# "--": torchrun would otherwise read the trainer's flags as abbreviations of its own (--logs: --logs-specs).
run "${LAUNCH[@]}" --no-python -- ds-clip-train "${TRAIN[@]}" --max-steps 6
run "${LAUNCH[@]}" --no-python -- ds-clip-train "${TRAIN[@]}" --max-steps 8 --resume latest
if [ "$DRY_RUN" = 0 ]; then
    grep -q "resumed from" "$LOG" || { echo "gpu_check: the --resume run did not resume" >&2; false; }
    cp "$WORK/nccl/metrics.csv" "$OUT_DIR/train_metrics.csv"
    cp "$WORK/nccl/eval_results.json" "$OUT_DIR/train_eval_results.json"
fi
run env DS_CLIP_COLLECTIVES_IN_WORLD_OF_ONE=1 timeout "$LIMIT_COLLECTIVES_S" torchrun --standalone \
    --nproc_per_node 1 -- scripts/gpu_check_collectives.py --out "$OUT_DIR/collectives.json"
TIME_A=$((SECONDS - T0))

# ------------------------------------------------------------------ (b) cached vs plain vs open_clip
PART="b: cached step vs plain step vs open_clip_train"
T0=$SECONDS
run timeout "$LIMIT_BENCH_S" "${BENCH[@]}" --device cuda --precision bf16 --models "$MODEL" --image-size 224 \
    --batch-size "$M_BENCH" --k 1 4 8 --world-sizes 1 --zero-stages 2 --steps 3 --warmup 1 \
    --open-clip --open-clip-k 1 4 8 --threads 8 --json "$OUT_DIR/bench_gpu.json"
TIME_B=$((SECONDS - T0))

# -------------------------------------------------------------------- (c) exactness, fp32, TF32 off
PART="c: exactness k=4 x m vs k=1 x 4m"
T0=$SECONDS
run timeout "$LIMIT_EXACT_S" torchrun --standalone --nproc_per_node 1 -- scripts/gpu_check_exactness.py \
    --model "$MODEL" --micro-batch-size 32 --zero-stages 0 2 --out "$OUT_DIR/exactness.json"
TIME_C=$((SECONDS - T0))

# ------------------------------------------------------------------- (d) --torchcompile, time per step
PART="d: --torchcompile vs eager, time per step"
T0=$SECONDS
run timeout "$LIMIT_COMPILE_S" python benchmarks/bench_compile.py --model "$MODEL" --batch-size "$M_TRAIN" \
    --accum-freq 2 --steps 8 --zero-stage 2 --extra=--precision --extra=bf16 --extra=--workers --extra=4 \
    --json "$OUT_DIR/compile_gpu.json"
TIME_D=$((SECONDS - T0))

# ------------------------------------------------------------------------------------------ summary
PART="summary"
say "python - <<'PY' ... PY  # gathers the parts' results into $OUT_FILE"
if [ "$DRY_RUN" = 1 ]; then
    exit 0
fi
OUT_DIR=$OUT_DIR OUT_FILE=$OUT_FILE TIME_A=$TIME_A TIME_B=$TIME_B TIME_C=$TIME_C TIME_D=$TIME_D python - <<'PY'
import csv, json, os, subprocess
from pathlib import Path
d = Path(os.environ["OUT_DIR"])
rows = list(csv.DictReader((d / "train_metrics.csv").open()))
bench = json.loads((d / "bench_gpu.json").read_text())
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
summary = {
    "gpu": gpu,
    "seconds": {"a_train_and_collectives": int(os.environ["TIME_A"]), "b_bench": int(os.environ["TIME_B"]),
                "c_exactness": int(os.environ["TIME_C"]), "d_compile": int(os.environ["TIME_D"])},
    "a_train": {
        "steps_logged": [int(r["step"]) for r in rows],
        "peak_mem_mib": max(float(r["peak_mem_mib"]) for r in rows),
        "samples_per_s_last": float(rows[-1]["samples_per_s"]),
        "eval": json.loads((d / "train_eval_results.json").read_text()),
    },
    "a_collectives": json.loads((d / "collectives.json").read_text()),
    "b_bench": bench["measurements"],
    "c_exactness": json.loads((d / "exactness.json").read_text()),
    "d_compile": {k: v["summary"] for k, v in json.loads((d / "compile_gpu.json").read_text()).items()},
}
Path(os.environ["OUT_FILE"]).write_text(json.dumps(summary, indent=1))
print(f"gpu_check: all parts passed; results in {os.environ['OUT_FILE']}")
PY
