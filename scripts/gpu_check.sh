#!/usr/bin/env bash
# What only a GPU shows, on one H200, in about 8.5 minutes by its own estimate (below):
#
#     bash scripts/gpu_wheelhouse.sh                 # first, where pip works: the wheels into .whl/
#     bash scripts/gpu_check.sh                      # every default part; results in $OUT/gpu_check.json
#     bash scripts/gpu_check.sh --part mfu           # one part alone (repeat --part for several)
#     bash scripts/gpu_check.sh --dry-run            # print every command, run none (works without a GPU)
#     bash scripts/gpu_check.sh --out DIR/result.json --site DIR --wheels DIR
#
# install  The GPU machine as it is (Python 3.12, torch 2.11 + CUDA, no network): the wheels in .whl/
#          go into a folder of their own, offline, `pip install --no-index --no-deps --target SITE`, and
#          every part runs with PYTHONPATH=SITE:<checkout>: the machine's torch is never touched. Runs
#          before any other part (about 20 s). No .whl/: stops at once, saying so.
# a        NCCL, one rank: ds-clip-train with ViT-B-32 at 224 px, bf16, ZeRO-2, logging every step,
#          evaluation (--val-data synthetic, --zeroshot-classes), a checkpoint, then --resume latest; with
#          DS_CLIP_COLLECTIVES_IN_WORLD_OF_ONE=1 every ds_clip collective is really issued on the 1-rank NCCL
#          group; scripts/gpu_check_collectives.py calls every helper of ds_clip.distributed on CPU and GPU
#          tensors.
# b        Cost of --accum-freq: the cached step vs the plain DeepSpeed step vs open_clip_train, ViT-B-32,
#          224 px, bf16, m = 256, k in {1, 8}, peak memory (benchmarks/bench_accum.py).
# c        Exactness: k=4 x m vs k=1 x 4m on one GPU, fp32 with TF32 off: relative gradient error per
#          parameter (scripts/gpu_check_exactness.py), failing above 1e-4.
# mfu      Model FLOP utilisation of the cached step: ViT-B-16, bf16, k = 8, the largest m that fits (m
#          doubles from 128 up to 4096), FLOPs from the model's shapes (forward + recompute + backward) against the
#          H200's 989 TFLOP/s dense bf16 (scripts/gpu_check_capacity.py mfu).
# largest  The largest N one tiled-loss step with data offload trains on ViT-B-16 (bf16, m = 512), N
#          doubling within a 3-minute budget (scripts/gpu_check_capacity.py largest).
# d        (not in the default run: --part d) --torchcompile vs eager, ViT-B-32, 224 px, bf16, ZeRO-2: the
#          first (compile) step and the steady time per step (benchmarks/bench_compile.py).
#
# Each part runs under its own time limit (a part past it fails) and is skipped, saying so, when the
# estimate of what is left would end past the whole check's budget (GPU_CHECK_BUDGET_S, 570 s: one command
# on the GPU machine runs 600 s at most). Any failure stops the script with a non-zero exit naming the part.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY_RUN=0
OUT_FILE=""
PARTS=()
WHEELS=$ROOT/.whl
SITE=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --out) OUT_FILE=$2; shift ;;
        --out=*) OUT_FILE=${1#--out=} ;;
        --part) PARTS+=("$2"); shift ;;
        --part=*) PARTS+=("${1#--part=}") ;;
        --site) SITE=$2; shift ;;
        --wheels) WHEELS=$2; shift ;;
        -h|--help) sed -n '2,36p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
ALL_PARTS=(install a b c mfu largest d)
[ ${#PARTS[@]} -gt 0 ] || PARTS=(install a b c mfu largest)
for p in "${PARTS[@]}"; do
    [[ " ${ALL_PARTS[*]} " == *" $p "* ]] || { echo "gpu_check: unknown part $p (one of: ${ALL_PARTS[*]})" >&2; exit 2; }
done
wants() { [[ " ${PARTS[*]} " == *" $1 "* ]]; }

OUT_DIR=${OUT:-$ROOT/gpu_check_out}
OUT_FILE=${OUT_FILE:-$OUT_DIR/gpu_check.json}
OUT_DIR=$(dirname "$OUT_FILE")
WORK=${GPU_CHECK_WORK:-/tmp/ds_clip_gpu_check}
SITE=${SITE:-$WORK/site}
LOG=$OUT_DIR/gpu_check.log
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-570}

# Sizes. Each part: expected seconds on one H200 (estimated from the sizes, not yet measured there) and
# its limit. Expected total of the default run: 20 + 95 + 90 + 30 + 90 + 195 = 520 s (8.7 min).
MODEL=ViT-B-32
M_TRAIN=64
M_BENCH=256
LIMIT_INSTALL_S=90;  EST_INSTALL_S=20
LIMIT_TRAIN_S=60;    LIMIT_COLLECTIVES_S=45; EST_A_S=95
LIMIT_BENCH_S=150;   EST_B_S=90
LIMIT_EXACT_S=60;    EST_C_S=30
LIMIT_MFU_S=150;     EST_MFU_S=90
LARGEST_BUDGET_S=180; LIMIT_LARGEST_S=210; EST_LARGEST_S=195
LIMIT_COMPILE_S=240; EST_D_S=150

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

T_CHECK=$SECONDS
declare -A SECS=()
SKIPPED=()
# begin PART EST: start a part unless its estimate would end past the budget (then it is skipped, said).
begin() {
    PART=$1
    T0=$SECONDS
    local left=$((BUDGET_S - (SECONDS - T_CHECK)))
    if [ "$DRY_RUN" = 0 ] && [ "$2" -gt "$left" ]; then
        echo "gpu_check: part $1 skipped: it needs about $2 s and $left s of the ${BUDGET_S} s budget are left" \
            "(rerun it alone: bash scripts/gpu_check.sh --part $1)" | tee -a "$LOG"
        SKIPPED+=("$1")
        return 1
    fi
    say "# part $1 (about $2 s)"
}
finish() { SECS[$PART]=$((SECONDS - T0)); }

if [ "$DRY_RUN" = 0 ] && ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "gpu_check: no wheels in $WHEELS: run 'bash scripts/gpu_wheelhouse.sh' where pip works, then carry" \
        ".whl/ to this machine (device tool: carry [\".whl\"])" >&2
    exit 2
fi
if [ "$DRY_RUN" = 0 ]; then
    mkdir -p "$OUT_DIR"
    : >"$LOG"
fi

# ------------------------------------------------------------------------------------------ install
begin install "$EST_INSTALL_S"
if [ "$DRY_RUN" = 0 ]; then rm -rf "$SITE" "$WORK"; mkdir -p "$WORK"; fi
run timeout "$LIMIT_INSTALL_S" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE:$ROOT" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
say "export PYTHONPATH=$SITE:$ROOT PATH=$SITE/bin:\$PATH"
# What runs: deepspeed, open_clip and webdataset from SITE, torch from the machine's own site-packages; ds_clip
# from SITE, or from the checkout where the current folder comes first on sys.path (python -c / -m here).
run "$PY" -c "import sys, torch, deepspeed, open_clip, webdataset, ds_clip
site = sys.argv[1]
assert all(m.__file__.startswith(site) for m in (deepspeed, open_clip, webdataset)), (deepspeed.__file__, site)
assert not torch.__file__.startswith(site), 'torch must be the machine own, not one from the wheels'
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(),
      'deepspeed', deepspeed.__version__, 'open_clip', open_clip.__version__, 'ds_clip from', ds_clip.__file__)" "$SITE"
finish

needs_gpu() {
    [ "$DRY_RUN" = 1 ] && return 0
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine" \
            "(bash scripts/gpu_check.sh --dry-run lists the commands)" >&2
        exit 1
    }
}
if [ "${PARTS[*]}" != install ]; then
    needs_gpu
    run nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi

# ----------------------------------------------------------- (a) 1-rank NCCL: trainer + every helper
if wants a && begin a "$EST_A_S"; then
    PART="a: 1-rank NCCL trainer, evaluation, checkpoint, resume"
    CLASSES=$WORK/classes.txt
    say "printf 'circle\\nsquare\\ntriangle\\n' > $CLASSES"
    if [ "$DRY_RUN" = 0 ]; then printf '%s\n' circle square triangle >"$CLASSES"; fi
    TRAIN=(
        --model "$MODEL" --batch-size "$M_TRAIN" --accum-freq 2 --zero-stage 2 --precision bf16
        --log-every-n-steps 1 --val-data synthetic --val-num-samples 256 --val-every-n-steps 3
        --zeroshot-classes "$CLASSES" --save-every-n-steps 3 --logs "$WORK" --name nccl --workers 4
        --report-to csv --warmup 1 --lr 1e-4
    )
    LAUNCH=(env DS_CLIP_COLLECTIVES_IN_WORLD_OF_ONE=1 timeout "$LIMIT_TRAIN_S" "$PY" -m torch.distributed.run
            --standalone --nproc_per_node 1)
    # "--": torchrun would otherwise read the trainer's flags as abbreviations of its own (--logs: --logs-specs).
    run "${LAUNCH[@]}" --no-python -- ds-clip-train "${TRAIN[@]}" --max-steps 6
    run "${LAUNCH[@]}" --no-python -- ds-clip-train "${TRAIN[@]}" --max-steps 8 --resume latest
    if [ "$DRY_RUN" = 0 ]; then
        grep -q "resumed from" "$LOG" || { echo "gpu_check: the --resume run did not resume" >&2; false; }
        cp "$WORK/nccl/metrics.csv" "$OUT_DIR/train_metrics.csv"
        cp "$WORK/nccl/eval_results.json" "$OUT_DIR/train_eval_results.json"
    fi
    run env DS_CLIP_COLLECTIVES_IN_WORLD_OF_ONE=1 timeout "$LIMIT_COLLECTIVES_S" "$PY" -m torch.distributed.run \
        --standalone --nproc_per_node 1 -- scripts/gpu_check_collectives.py --out "$OUT_DIR/collectives.json"
    finish
fi

# ------------------------------------------------------------------ (b) cached vs plain vs open_clip
if wants b && begin b "$EST_B_S"; then
    PART="b: cached step vs plain step vs open_clip_train"
    run timeout "$LIMIT_BENCH_S" "$PY" benchmarks/bench_accum.py --device cuda --precision bf16 --models "$MODEL" \
        --image-size 224 --batch-size "$M_BENCH" --k 1 8 --world-sizes 1 --zero-stages 2 --steps 3 --warmup 1 \
        --open-clip --open-clip-k 1 8 --threads 8 --json "$OUT_DIR/bench_gpu.json"
    finish
fi

# -------------------------------------------------------------------- (c) exactness, fp32, TF32 off
if wants c && begin c "$EST_C_S"; then
    PART="c: exactness k=4 x m vs k=1 x 4m"
    run timeout "$LIMIT_EXACT_S" "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -- \
        scripts/gpu_check_exactness.py --model "$MODEL" --micro-batch-size 32 --zero-stages 0 2 \
        --out "$OUT_DIR/exactness.json"
    finish
fi

# ------------------------------------------------------- mfu: model FLOP utilisation of the cached step
if wants mfu && begin mfu "$EST_MFU_S"; then
    PART="mfu: ViT-B-16 bf16 k=8, largest m"
    run timeout "$LIMIT_MFU_S" "$PY" scripts/gpu_check_capacity.py mfu --model ViT-B-16 --precision bf16 --k 8 \
        --m-start 128 --m-max 4096 --steps 3 --out-dir "$OUT_DIR"
    finish
fi

# ------------------------------------------------- largest: the largest N one tiled-loss step trains
if wants largest && begin largest "$EST_LARGEST_S"; then
    PART="largest: ViT-B-16 tiled loss, N doubling in ${LARGEST_BUDGET_S} s"
    run timeout "$LIMIT_LARGEST_S" "$PY" scripts/gpu_check_capacity.py largest --model ViT-B-16 --precision bf16 \
        --batch-size 512 --k-start 8 --budget-s "$LARGEST_BUDGET_S" --out-dir "$OUT_DIR"
    finish
fi

# ------------------------------------------------------------------- (d) --torchcompile, time per step
if wants d && begin d "$EST_D_S"; then
    PART="d: --torchcompile vs eager, time per step"
    run timeout "$LIMIT_COMPILE_S" "$PY" benchmarks/bench_compile.py --model "$MODEL" --batch-size "$M_TRAIN" \
        --accum-freq 2 --steps 8 --zero-stage 2 --extra=--precision --extra=bf16 --extra=--workers --extra=4 \
        --json "$OUT_DIR/compile_gpu.json"
    finish
fi

# ------------------------------------------------------------------------------------------ summary
PART="summary"
say "$PY - <<'PY' ... PY  # gathers the parts' results into $OUT_FILE"
if [ "$DRY_RUN" = 1 ]; then
    exit 0
fi
SECS_JSON=$(for k in "${!SECS[@]}"; do printf '"%s": %s\n' "$k" "${SECS[$k]}"; done | paste -sd, -)
OUT_DIR=$OUT_DIR OUT_FILE=$OUT_FILE SECS_JSON="{${SECS_JSON}}" SKIPPED="${SKIPPED[*]:-}" "$PY" - <<'PY'
import csv, json, os, subprocess
from pathlib import Path
d = Path(os.environ["OUT_DIR"])
def load(name):
    p = d / name
    return json.loads(p.read_text()) if p.exists() else None
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except FileNotFoundError:  # --part install alone, on a machine without the driver's tools
    gpu = None
summary = {"gpu": gpu, "seconds": json.loads(os.environ["SECS_JSON"]),
           "skipped": os.environ["SKIPPED"].split()}
if (d / "train_metrics.csv").exists():
    rows = list(csv.DictReader((d / "train_metrics.csv").open()))
    summary["a_train"] = {
        "steps_logged": [int(r["step"]) for r in rows],
        "peak_mem_mib": max(float(r["peak_mem_mib"]) for r in rows),
        "samples_per_s_last": float(rows[-1]["samples_per_s"]),
        "eval": load("train_eval_results.json"),
    }
    summary["a_collectives"] = load("collectives.json")
if (bench := load("bench_gpu.json")) is not None:
    summary["b_bench"] = bench["measurements"]
summary["c_exactness"] = load("exactness.json")
summary["mfu"] = load("mfu.json")
summary["largest"] = load("largest.json")
if (comp := load("compile_gpu.json")) is not None:
    summary["d_compile"] = {k: v["summary"] for k, v in comp.items()}
summary = {k: v for k, v in summary.items() if v is not None}
Path(os.environ["OUT_FILE"]).write_text(json.dumps(summary, indent=1))
done = ", ".join(summary["seconds"])
print(f"gpu_check: passed: {done}; skipped: {summary['skipped'] or 'none'}; results in {os.environ['OUT_FILE']}")
PY
