#!/usr/bin/env bash
# Every row of the current table in docs/benchmarks.md, one after another, on a machine nothing else uses:
#
#   bash scripts/quiet_bench.sh                 # all rows (about 75-90 minutes on 2 CPU cores)
#   bash scripts/quiet_bench.sh sbs_tiny_w1 loader   # only the named rows
#   ROWS_LIST=1 bash scripts/quiet_bench.sh     # print the row names and commands, run nothing
#
# Each row writes benchmarks/results/raw/quiet_<row>.json (the benchmark's own JSON, every step of the run)
# and quiet_<row>.log (its output, the table it prints, the 1-minute load before and after), and
# quiet_machine.txt records the machine; the record in benchmarks/results/ that docs/benchmarks.md prints
# (scripts/gen_benchmarks_doc.py) is written from them. Rows run strictly one at a time; the load before each
# row is in its log: a row that started above load 0.5 was not quiet (rerun it alone). Side-by-side rows compare
# each trainer's own per-step log (ds_clip `data + step`, open_clip `Batch (t)`), medians of steps 2-8.
# Run from the repository root with the project's environment (python, deepspeed and torchrun on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/raw}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

VITB="--model ViT-B-32 --force-image-size 64 --batch-size 4"
TINY="--model ds-clip-tiny --batch-size 16"
declare -A CMD
ORDER=()
add() { ORDER+=("$1"); CMD[$1]=$2; }
sbs() { echo "python benchmarks/side_by_side.py --json $OUT/quiet_$1.json ${*:2}"; }

# Side by side, ds-clip-train defaults against open_clip_train's (fp32), k = 1 and 8, 1/2/4 ranks, two models.
add sbs_vitb32_w1 "$(sbs sbs_vitb32_w1 --k 1 8 -- $VITB)"
add sbs_vitb32_w2 "$(sbs sbs_vitb32_w2 --ranks 2 --k 1 8 -- $VITB)"
add sbs_vitb32_w4 "$(sbs sbs_vitb32_w4 --ranks 4 --k 1 8 -- $VITB)"
add sbs_tiny_w1 "$(sbs sbs_tiny_w1 --k 1 8 -- $TINY)"
add sbs_tiny_w2 "$(sbs sbs_tiny_w2 --ranks 2 --k 1 8 -- $TINY)"
add sbs_tiny_w4 "$(sbs sbs_tiny_w4 --ranks 4 --k 1 8 -- $TINY)"
# Large N: N = 4096 (ds-clip-tiny, m = 256, k = 16, one process, the tiled loss), and the loss alone at that N
# (dense = open_clip's ClipLoss, which open_clip's accumulation loop computes in each of its k passes).
add large_n "$(sbs large_n --k 16 --steps 5 --ds-clip-flags=--loss-impl=tiled -- --model ds-clip-tiny --batch-size 256)"
add loss_4096 "python benchmarks/bench_loss.py --sizes 1024 2048 4096 8192 --losses clip siglip --threads 1 --json $OUT/quiet_loss_4096.json"
add loss_small "python benchmarks/bench_loss.py --sizes 128 256 512 1024 --losses clip --threads 1 --repeats 5 --json $OUT/quiet_loss_small.json"
# Loader: ds_clip's webdataset pipeline against open_clip_train's get_wds_dataset, same JPEG shards, 224 px.
add loader "python benchmarks/bench_loader.py --open-clip --sizes 224 --workers 1 2 --seconds 10 --json $OUT/quiet_loader.json"
# Loader on web-like data (JPEG/PNG of 300-1500 px, generated): ds_clip --decode fast and exact against
# get_wds_dataset, one worker and all cores, and the PSNR of fast against exact.
add loader_web "python benchmarks/bench_loader.py --data web --open-clip --sizes 224 --decode fast exact --workers 1 all --seconds 10 --rounds 3 --json $OUT/quiet_loader_web.json"
# The price of exactness: the cached step against DeepSpeed's gradient_accumulation_steps = k.
add exactness_cost "python benchmarks/bench_exactness_cost.py --model ViT-B-32 --image-size 64 --batch-size 4 --k 2 4 8 --world-sizes 1 2 --steps 9 --json $OUT/quiet_exactness_cost.json"
# Memory per rank of the multi-rank default against ZeRO-1 and ZeRO-2 (peak RSS of one step, largest over ranks;
# memory does not depend on load, the step times beside it do).
add mem_w4 "python benchmarks/bench_accum.py --models ds-clip-tiny ViT-B-32 --image-size 64 --batch-size 4 --k 1 8 --world-sizes 2 4 --zero-stages 0 1 2 --steps 2 --warmup 1 --json $OUT/quiet_mem_w4.json"
# Where a 2-rank step goes (shares of one step's self CPU time), the default and each ZeRO stage.
prof() { echo "python benchmarks/profile_step.py $1 --ranks 2 --json $OUT/quiet_$2.json -- ${*:3}"; }
add prof_tiny_default "$(prof ds_clip prof_tiny_default $TINY)"
add prof_tiny_z0 "$(prof ds_clip prof_tiny_z0 $TINY --zero-stage 0)"
add prof_tiny_z1 "$(prof ds_clip prof_tiny_z1 $TINY --zero-stage 1)"
add prof_tiny_z2 "$(prof ds_clip prof_tiny_z2 $TINY --zero-stage 2)"
add prof_tiny_z2_coalesce "$(prof ds_clip prof_tiny_z2_coalesce $TINY --zero-stage 2 --coalesce-grad-reduction on)"
add prof_tiny_open_clip "$(prof open_clip prof_tiny_open_clip $TINY)"
add prof_vitb32_default "$(prof ds_clip prof_vitb32_default $VITB)"
add prof_vitb32_z1 "$(prof ds_clip prof_vitb32_z1 $VITB --zero-stage 1)"
add prof_vitb32_open_clip "$(prof open_clip prof_vitb32_open_clip $VITB)"
# The same at 4 ranks, and at k = 8 on 2 ranks.
prof4() { echo "python benchmarks/profile_step.py $1 --ranks 4 --json $OUT/quiet_$2.json -- ${*:3}"; }
add prof_tiny_default_w4 "$(prof4 ds_clip prof_tiny_default_w4 $TINY)"
add prof_tiny_z1_w4 "$(prof4 ds_clip prof_tiny_z1_w4 $TINY --zero-stage 1)"
add prof_tiny_z2_w4 "$(prof4 ds_clip prof_tiny_z2_w4 $TINY --zero-stage 2)"
add prof_tiny_z2_coalesce_w4 "$(prof4 ds_clip prof_tiny_z2_coalesce_w4 $TINY --zero-stage 2 --coalesce-grad-reduction on)"
add prof_tiny_open_clip_w4 "$(prof4 open_clip prof_tiny_open_clip_w4 $TINY)"
add prof_vitb32_default_w4 "$(prof4 ds_clip prof_vitb32_default_w4 $VITB)"
add prof_vitb32_z1_w4 "$(prof4 ds_clip prof_vitb32_z1_w4 $VITB --zero-stage 1)"
add prof_vitb32_default_k8 "$(prof ds_clip prof_vitb32_default_k8 $VITB --accum-freq 8)"
add prof_vitb32_open_clip_k8 "$(prof open_clip prof_vitb32_open_clip_k8 $VITB --accum-freq 8)"

if [[ -n "${ROWS_LIST:-}" ]]; then
    for row in "${ORDER[@]}"; do echo "$row: ${CMD[$row]}"; done
    exit 0
fi
rows=("$@")
[[ ${#rows[@]} -eq 0 ]] && rows=("${ORDER[@]}")
for row in "${rows[@]}"; do
    [[ -n "${CMD[$row]:-}" ]] || { echo "unknown row '$row' (ROWS_LIST=1 lists them)" >&2; exit 2; }
done

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    git rev-parse --short HEAD 2>/dev/null || true
    lscpu | grep -E "Model name|^CPU\(s\)" || true
    free -g | head -2
    python -c "import torch, deepspeed, open_clip; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'open_clip', open_clip.__version__)"
} > "$OUT/quiet_machine.txt"

for row in "${rows[@]}"; do
    log="$OUT/quiet_$row.log"
    rm -f "$OUT/quiet_$row.json"  # side_by_side appends: a row's JSON holds this run only
    {
        echo "# $row: ${CMD[$row]}"
        echo "# start $(date -u +%H:%M:%SZ), load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    } | tee "$log"
    # shellcheck disable=SC2086
    bash -c "${CMD[$row]}" 2>&1 | tee -a "$log"
    echo "# end $(date -u +%H:%M:%SZ), load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$log"
done
