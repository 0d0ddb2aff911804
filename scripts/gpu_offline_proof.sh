#!/usr/bin/env bash
# Proof, on a CPU machine, that the wheelhouse installs and trains on the offline GPU machine as it is:
#
#     bash scripts/gpu_offline_proof.sh    # ~11 min here under load (+ ~10 min and 5 GB the first time: the venv)
#
# 1. A CPython 3.12 venv (pyenv's 3.12.1) shaped like that machine: torch 2.11.0 and torchvision 0.26.0
#    (PyPI's wheels with what they require, the CUDA libraries included: torch does not import without
#    them), then ONLY the packages that machine has (the list docs/gpu.md gives:
#    numpy, pandas, matplotlib, timm, huggingface_hub, safetensors, tqdm, tensorboard, pyyaml, regex,
#    psutil, msgpack, ninja, py-cpuinfo, einops, nvidia-ml-py, mpi4py, pytest). It checks that none of
#    deepspeed, open_clip, webdataset, pydantic, ftfy, wcwidth, braceexpand, hjson is there.
#    The venv is kept (PROOF_VENV, default /tmp/ds_clip_py312) and reused when it is complete.
# 2. bash scripts/gpu_wheelhouse.sh, then `bash scripts/gpu_check.sh --part install` with that venv's
#    python3: the same offline install (pip install --no-index --no-deps --target SITE) the GPU machine
#    runs, into a fresh SITE, the venv's torch untouched.
# 3. From a folder outside the checkout, with PYTHONPATH=SITE:<checkout> (as gpu_check.sh runs):
#    `python -m deepspeed.launcher.runner --num_gpus 2 --module ds_clip.train` trains ds-clip-tiny
#    2 steps on the CPU (2 ranks over gloo, DeepSpeed's CPU shm op JIT-built), then checks that no
#    /dev/shm/deepspeed_* file of the run is left.
# The results are recorded in docs/gpu.md ("Offline install, proven on Python 3.12 / torch 2.11").
set -Eeuo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${PROOF_VENV:-/tmp/ds_clip_py312}
WORK=${PROOF_WORK:-/tmp/ds_clip_offline_proof}
SITE=$WORK/site
T_START=$SECONDS

step() { printf '\n== %s\n' "$*"; }

# ------------------------------------------------------------------------------- 1. the GPU machine's twin
step "1. Python 3.12 venv with torch 2.11.0 and the GPU machine's packages only ($VENV)"
HAS=(numpy pandas matplotlib timm huggingface_hub safetensors tqdm tensorboard pyyaml regex psutil msgpack
     ninja py-cpuinfo einops nvidia-ml-py mpi4py pytest)
LACKS=(deepspeed open_clip webdataset pydantic ftfy wcwidth braceexpand hjson)
if [ ! -f "$VENV/.complete" ]; then
    rm -rf "$VENV"
    PY312=$(PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || command -v python3.12)
    "$PY312" -m venv "$VENV"
    # torch with its CUDA libraries, as on the GPU machine (PyPI's torch 2.11.0 wheel does not import
    # without them: libcudnn.so.9), about 3 GB; it runs on the CPU.
    "$VENV/bin/python" -m pip install -q --only-binary=:all: torch==2.11.0 torchvision==0.26.0
    "$VENV/bin/python" -m pip install -q "${HAS[@]}"
    touch "$VENV/.complete"
fi
"$VENV/bin/python" - "${LACKS[@]}" <<'PY'
import importlib.util, sys, torch, torchvision
present = [m for m in sys.argv[1:] if importlib.util.find_spec(m)]
if present:
    sys.exit(f"gpu_offline_proof: the venv must lack {present} (the GPU machine does)")
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, torchvision {torchvision.__version__}; "
      f"absent: {', '.join(sys.argv[1:])}")
PY

# ------------------------------------------------------------------------------------ 2. offline install
step "2. wheelhouse, then gpu_check.sh's offline install into $SITE"
bash scripts/gpu_wheelhouse.sh | grep "^gpu_wheelhouse:"
rm -rf "$WORK"
mkdir -p "$WORK"
PATH="$VENV/bin:$PATH" PYTHON="$VENV/bin/python3" bash scripts/gpu_check.sh --part install --site "$SITE" \
    --out "$WORK/out/gpu_check.json"

# ------------------------------------------------------------------------- 3. train 2 steps from that install
step "3. ds-clip-train, 2 steps, 2 CPU ranks, from $WORK (outside the checkout)"
PORT=$("$VENV/bin/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
cd "$WORK"
T0=$SECONDS
# TORCH_EXTENSIONS_DIR: DeepSpeed keys its JIT-built ops by name only; this Python's build lives apart.
env PYTHONPATH="$SITE:$ROOT" PATH="$SITE/bin:$VENV/bin:$PATH" TORCH_EXTENSIONS_DIR="$WORK/torch_extensions" \
    OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 \
    "$VENV/bin/python" -m deepspeed.launcher.runner --num_gpus 2 --master_port "$PORT" --module ds_clip.train \
    --model ds-clip-tiny --batch-size 8 --accum-freq 2 --max-steps 2 --log-every-n-steps 1 --logs "$WORK/logs" \
    --name proof --workers 1 --report-to csv --warmup 1 2>&1 | tee "$WORK/train.log" \
    | grep -E "^step |ds_clip|world size|error|Error" || true
grep -q "^step 2/2 " "$WORK/train.log" || { echo "gpu_offline_proof: training did not reach step 2" >&2; exit 1; }
TRAIN_S=$((SECONDS - T0))
left=$(ls /dev/shm 2>/dev/null | grep -E "^deepspeed_.*_${PORT}_[0-9]+$" || true)
if [ -n "$left" ]; then
    echo "gpu_offline_proof: left in /dev/shm: $left" >&2
    exit 1
fi
"$VENV/bin/python" - "$SITE" <<PY
import sys
sys.path[:0] = [sys.argv[1], "$ROOT"]
import deepspeed, ds_clip, open_clip, torch, webdataset
for m in (deepspeed, ds_clip, open_clip, webdataset):
    assert m.__file__.startswith(sys.argv[1]), m.__file__
assert not torch.__file__.startswith(sys.argv[1]), torch.__file__
print(f"imported from {sys.argv[1]}: deepspeed {deepspeed.__version__}, open_clip {open_clip.__version__}, "
      f"ds_clip ({ds_clip.__file__}); torch {torch.__version__} from {torch.__file__}")
PY
echo "gpu_offline_proof: passed: 2 steps trained from the offline install in ${TRAIN_S} s" \
    "(whole proof $((SECONDS - T_START)) s); nothing left in /dev/shm"
