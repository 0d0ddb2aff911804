#!/usr/bin/env bash
# The wheels the offline GPU machine lacks, for scripts/gpu_check.sh to install there without a network:
#
#     bash scripts/gpu_wheelhouse.sh            # writes .whl/ in the checkout (gitignored), about 8 MB
#
# That machine (docs/gpu.md): x86-64, CPython 3.12, torch 2.11.0+cu130,
# torchvision 0.26, no network; it has numpy, pandas, matplotlib, timm, huggingface_hub, safetensors, tqdm,
# tensorboard, pyyaml, regex, psutil, msgpack, ninja, py-cpuinfo, einops, nvidia-ml-py, mpi4py, pytest and
# lacks the packages below. Each is a pure-Python wheel or a cp312 manylinux x86_64 one, fetched with
# `pip download --no-deps` for that Python and platform (whatever this machine runs), except:
#   - deepspeed 0.19.8, an sdist upstream: `pip wheel --no-deps` builds a py3-none-any wheel once (no CUDA
#     op prebuilt: DeepSpeed JIT-builds what it needs on first use);
#   - ds_clip itself, rebuilt from this checkout on every run (its code changes).
# The versions are the ones the project's venv runs (scripts/setup.sh). The working tree is copied to the
# GPU machine together with .whl/, at most 64 MiB for the two together, which this script checks. Running
# it again downloads nothing that is already there.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHL=$ROOT/.whl
PY=${PYTHON:-python3}
LIMIT_MIB=64

# name==version of every wheel the GPU machine lacks (ds_clip and deepspeed handled apart).
PINNED=(
    open_clip_torch==3.3.0 webdataset==1.0.2 ftfy==6.3.1 wcwidth==0.9.4 braceexpand==0.1.7 hjson==3.1.0
    pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5
    typing_extensions==4.16.0 xxhash==4.1.0
)
DEEPSPEED=deepspeed==0.19.8

mkdir -p "$WHL"

# A wheel's file name starts with its normalised name and version: NAME-VERSION-...whl.
have() {
    local norm=${1//-/_}
    compgen -G "$WHL/${norm%%==*}-${norm##*==}-*.whl" >/dev/null
}

missing=()
for spec in "${PINNED[@]}"; do
    have "$spec" || missing+=("$spec")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu_wheelhouse: downloading ${missing[*]}"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --abi cp312 --abi abi3 --abi none \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$WHL" "${missing[@]}"
fi

if ! have "$DEEPSPEED"; then
    echo "gpu_wheelhouse: building $DEEPSPEED from its sdist (no ops prebuilt)"
    # DS_BUILD_OPS=0: a pure-Python wheel; DeepSpeed JIT-compiles an op the first time it is used.
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-binary deepspeed -w "$WHL" "$DEEPSPEED"
fi

# ds_clip: always rebuilt, so the wheel holds this checkout's code.
rm -f "$WHL"/ds_clip-*.whl
# Without build isolation where this Python's setuptools builds wheels by itself (>= 70.1: the project venv's),
# else pip fetches a build backend from the registry.
if "$PY" -c "import setuptools.command.bdist_wheel" 2>/dev/null; then ISOLATION=--no-build-isolation; else ISOLATION=; fi
"$PY" -m pip wheel -q --no-deps $ISOLATION -w "$WHL" "$ROOT"
rm -rf "$ROOT/build" "$ROOT"/*.egg-info

# Exactly one wheel per package: two versions of one would stop the offline install.
dups=$(ls "$WHL" | sed -E 's/-[^-]+-.*$//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dups" ]; then
    echo "gpu_wheelhouse: more than one wheel of: $dups (remove the stale ones from $WHL)" >&2
    exit 1
fi

# What is copied to the GPU machine: tracked and untracked-not-ignored files, plus .whl/.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s -- 2>/dev/null \
    | awk '{s += $1} END {print s + 0}')
whl_bytes=$(du -sb "$WHL" | cut -f1)
total_mib=$(( (tree_bytes + whl_bytes) / 1048576 ))
echo "gpu_wheelhouse: $(ls "$WHL" | wc -l) wheels, $((whl_bytes / 1024)) KiB; with the working tree" \
    "$((tree_bytes / 1024)) KiB: ${total_mib} MiB of the ${LIMIT_MIB} MiB copied to the GPU machine"
if [ $((tree_bytes + whl_bytes)) -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "gpu_wheelhouse: the working tree and .whl/ exceed ${LIMIT_MIB} MiB, the most copied to the GPU machine" >&2
    exit 1
fi
ls -1 "$WHL"
