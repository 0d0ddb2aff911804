#!/usr/bin/env bash
# Installs everything ds_clip needs into ./.venv (idempotent; fast when already done).
#   bash scripts/setup.sh            # called by scripts/demo.sh and scripts/test.sh
# Open MPI comes from apt when `mpicc` is missing and we are root; elsewhere (a cluster where MPI
# is a module) load your MPI first so `mpicc` is on PATH, or set DS_CLIP_NO_MPI=1 to skip mpi4py.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if ! command -v mpicc >/dev/null 2>&1 && [ -z "${DS_CLIP_NO_MPI:-}" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing Open MPI from apt (libopenmpi-dev openmpi-bin)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenmpi-dev openmpi-bin >/dev/null
  else
    echo "[setup] no mpicc found and not root: load your MPI (module load openmpi) or set DS_CLIP_NO_MPI=1" >&2
    exit 1
  fi
fi

# The two-host tests (tests/test_multinode.py) run sshd inside network namespaces and launch through pdsh:
# they need root anyway (without it they skip), so only root installs these.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ -z "${DS_CLIP_NO_MULTINODE:-}" ]; then
  if ! { command -v sshd || [ -x /usr/sbin/sshd ]; } >/dev/null 2>&1 || ! command -v ssh >/dev/null 2>&1 \
    || ! command -v pdsh >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then
    echo "[setup] installing openssh-server openssh-client pdsh iproute2 from apt (two-host tests)"
    apt-get update -qq >/dev/null
    # The tests start their own sshd inside a namespace: keep apt from starting a system-wide one.
    made_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
    fi
    rc=0
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client pdsh iproute2 >/dev/null || rc=$?
    if [ -n "$made_policy" ]; then rm -f /usr/sbin/policy-rc.d; fi
    [ "$rc" = 0 ] || exit "$rc"
  fi
fi

# The SLURM tests (tests/test_slurm.py) start their own munged, slurmctld and slurmd on this machine (one node):
# root only, like the packages above; without root (a real cluster has its SLURM) they skip.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ -z "${DS_CLIP_NO_SLURM:-}" ]; then
  if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
    echo "[setup] installing slurm-wlm munge from apt (SLURM tests)"
    apt-get update -qq >/dev/null
    # The tests start the daemons themselves: keep apt from starting system-wide ones (policy-rc.d: "no").
    policy=/usr/sbin/policy-rc.d own_policy=""
    [ -e "$policy" ] || { printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && own_policy=1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null \
      || echo "[setup] slurm-wlm/munge did not install: the SLURM tests will skip" >&2
    [ -z "$own_policy" ] || rm -f "$policy"
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.ds_clip-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing python packages into .venv (first time: a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch/torchvision pinned to the pair that DeepSpeed 0.19.8 and open_clip were checked with.
  .venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
  extras="test"
  [ -n "${DS_CLIP_NO_MPI:-}" ] && extras="test-nompi"
  .venv/bin/python -m pip install -q -e ".[${extras}]"
  touch "$stamp"
fi
